//! The pod registry: the one place pod ids are made, each pod's role, presence, health, the
//! load and adapters it reported, and what was routed where.

use super::{Role, Router};
use crate::adapters::{AdapterId, PodAdapters, ReportedAdapters};
use crate::hash::SequenceHash;
use crate::pod_set::{PodId, PodSet};
use crate::policy::{Candidate, ReportedLoad};
use xxhash_rust::xxh3::xxh3_64;

/// One pod as the router knows it (a removed pod keeps its role, kind of index and key).
#[derive(Default)]
pub(super) struct PodState {
    pub(super) role: Role,
    pub(super) precise: bool,
    /// False once discovery removed the pod (its id is kept for when it comes back).
    pub(super) present: bool,
    pub(super) healthy: bool,
    pub(super) reported: Option<ReportedLoad>,
    pub(super) adapters: PodAdapters,
    /// The pod's identity in [`Candidate::tie_rank`]s: the same on every gateway replica.
    pub(super) key: u64,
    /// The models it serves (base models and loaded adapters, by name hash), as it last
    /// listed them; `None` until it has (or when nobody reads its listing).
    pub(super) models: Option<Vec<ModelId>>,
}

/// A model a request asks for or a pod serves (a base model or an adapter), by its name's
/// hash: the same on every gateway replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(pub u64);

impl ModelId {
    pub fn of(name: &str) -> Self {
        Self(xxh3_64(name.as_bytes()))
    }
}

/// The predicted seconds of prefill queued ahead of a new request ([`Router::prefill_waits`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillWaits {
    /// At the pod where it is shortest: what the next request waits at least.
    pub soonest: f64,
    /// Over the healthy pods.
    pub mean: f64,
}

impl Router {
    /// A request was routed to `pod`: pods without KV events are indexed by what is routed
    /// there, and its adapter is run there next.
    pub(super) fn record_routed(&mut self, pod: PodId, chain: &[SequenceHash], adapter: Option<AdapterId>, now: f64) {
        let Some(state) = self.pods.get_mut(pod.index()) else { return };
        if let Some(adapter) = adapter {
            state.adapters.routed(adapter);
        }
        if !state.precise {
            self.approx.record(pod, chain, now);
        }
        self.recent.record(pod, chain, now);
    }

    /// Adds a pod, healthy, and gives it its id: the one place pod ids are made (the index,
    /// the bookings and the speeds keep their state of it by that id). `precise`: its KV
    /// events will be applied; otherwise it is indexed approximately by what is routed there.
    pub fn add_pod(&mut self, role: Role, precise: bool) -> PodId {
        let id = PodId(self.pods.len() as u32);
        let key = xxh3_64(&(id.index() as u64).to_le_bytes());
        self.pods.push(PodState { role, precise, present: true, healthy: true, key, ..PodState::default() });
        id
    }

    /// The models `pod` serves, as it lists them (vLLM's `/v1/models`: base models and the
    /// adapters loaded): from now on it is chosen only for requests of those models.
    pub fn served_models(&mut self, pod: PodId, models: Vec<ModelId>) {
        self.pods[pod.index()].models = Some(models);
    }

    /// Names the pod for tie-breaking by something every gateway replica knows it by (its
    /// address), whatever order discovery found the pods in; until then it goes by its id,
    /// the same on every replica only while all add the same pods in the same order.
    pub fn set_pod_key(&mut self, pod: PodId, name: &str) {
        self.pods[pod.index()].key = xxh3_64(name.as_bytes());
    }

    /// Discovery lost the pod: never chosen, and everything known about it forgotten
    /// (index entries, bookings, reported load), until [`Router::restore_pod`].
    pub fn remove_pod(&mut self, pod: PodId) {
        let state = &mut self.pods[pod.index()];
        *state = PodState { role: state.role, precise: state.precise, key: state.key, ..PodState::default() };
        self.index.clear_pod(pod);
        self.approx.clear_pod(pod);
        self.recent.clear_pod(pod);
        self.load.clear_pod(pod);
    }

    /// A removed pod is back (same address): healthy, with an empty index.
    pub fn restore_pod(&mut self, pod: PodId) {
        let state = &mut self.pods[pod.index()];
        state.present = true;
        state.healthy = true;
    }

    pub fn is_present(&self, pod: PodId) -> bool {
        self.pods[pod.index()].present
    }

    pub fn num_pods(&self) -> usize {
        self.pods.len()
    }

    pub fn is_healthy(&self, pod: PodId) -> bool {
        let state = &self.pods[pod.index()];
        state.present && state.healthy
    }

    /// The predicted waits before a new request's prefill over the healthy pods (see
    /// `LoadTracker::queued_prefill_seconds`); `None` until the fleet's prefill speed is
    /// learned, or with no healthy pod.
    pub fn prefill_waits(&self) -> Option<PrefillWaits> {
        let healthy = (0..self.pods.len() as u32).map(PodId).filter(|pod| self.is_healthy(*pod));
        let waits: Vec<f64> = healthy.map(|pod| self.load.queued_prefill_seconds(pod)).collect::<Option<_>>()?;
        let soonest = waits.iter().copied().reduce(f64::min)?;
        Some(PrefillWaits { soonest, mean: waits.iter().sum::<f64>() / waits.len() as f64 })
    }

    /// Predicted seconds a request placed on `candidate` waits before its own prefill: the
    /// prefill queued there when it was chosen; `None` until the fleet's speed is learned.
    pub fn predicted_wait(&self, candidate: &Candidate) -> Option<f64> {
        self.load.prefill_seconds(candidate.pod, candidate.load.queued_prefill_tokens)
    }

    /// The load the pod last reported, while healthy.
    pub fn reported_load(&self, pod: PodId) -> Option<ReportedLoad> {
        self.pods[pod.index()].reported
    }

    /// Blocks the router believes `pod` holds (precise or approximate).
    pub fn pod_blocks(&self, pod: PodId) -> usize {
        if self.pods[pod.index()].precise { self.index.pod_blocks(pod) } else { self.approx.pod_blocks(pod) }
    }

    /// Blocks of the prompts routed to `pod` lately ([`crate::recent::RecentBlocks`]).
    pub fn recent_blocks(&self, pod: PodId) -> u64 {
        self.recent.blocks(pod)
    }

    /// True when some healthy pod can take requests.
    pub fn ready(&self) -> bool {
        self.pods.iter().any(|p| p.present && p.healthy && p.role.decodes())
    }

    /// The healthy pods of `role` in `subset` that serve `model` (a pod that has not listed
    /// its models may).
    pub(super) fn eligible(
        &self,
        role: impl Fn(Role) -> bool,
        subset: Option<&PodSet>,
        model: Option<ModelId>,
    ) -> Vec<PodId> {
        (0..self.pods.len() as u32)
            .map(PodId)
            .filter(|p| {
                let s = &self.pods[p.index()];
                let serves = match (model, &s.models) {
                    (Some(model), Some(models)) => models.contains(&model),
                    _ => true,
                };
                s.present && s.healthy && role(s.role) && subset.is_none_or(|set| set.contains(*p)) && serves
            })
            .collect()
    }

    /// A pod nobody scrapes is given another chance (healthy, load unknown).
    pub fn retry(&mut self, pod: PodId) {
        let state = &mut self.pods[pod.index()];
        if state.present {
            state.healthy = true;
        }
    }

    /// The pod answered a scrape with its load.
    pub fn reported(&mut self, pod: PodId, reported: ReportedLoad) {
        let state = &mut self.pods[pod.index()];
        if !state.present {
            return;
        }
        state.healthy = true;
        state.reported = Some(reported);
        self.load.set_kv_capacity(pod, reported.num_gpu_blocks);
    }

    /// The pod's scrape named the LoRA adapters it runs and has waiting, and its slots.
    pub fn reported_adapters(&mut self, pod: PodId, adapters: ReportedAdapters) {
        let state = &mut self.pods[pod.index()];
        if state.present {
            state.adapters.reported(adapters);
        }
    }

    /// Drops bookings older than `load.reconcile_after_seconds` that the pod's last report
    /// does not account for ([`LoadTracker::reconcile`]); returns how many.
    pub fn reconcile(&mut self, pod: PodId, now: f64) -> usize {
        match self.pods[pod.index()].reported {
            Some(r) if self.reconcile_after_seconds > 0.0 => {
                let booked_before = now - self.reconcile_after_seconds;
                self.load.reconcile(pod, (r.running + r.waiting).max(0.0) as u32, booked_before)
            }
            _ => 0,
        }
    }

    /// The pod is unhealthy: not chosen until it reports again; its in-flight bookings are
    /// released (their proxies' reports of how they ended are still recognised).
    pub fn unhealthy(&mut self, pod: PodId) {
        let state = &mut self.pods[pod.index()];
        state.healthy = false;
        state.reported = None;
        state.adapters = PodAdapters::default();
        self.load.clear_pod(pod);
    }
}
