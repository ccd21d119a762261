//! The whole routing decision, without I/O: pods with roles and health, the precise and
//! approximate indexes, the in-flight bookkeeping and the policies, combined as one state
//! machine. The live scorer wraps a [`Router`] in a mutex and feeds it from sockets; the
//! offline cluster simulator feeds it from simulated engines in virtual time — so what the
//! benchmarks measure is the code that serves.
//!
//! Per request: the uncached prompt tokens on the best decode-capable pod decide whether
//! disaggregation pays off (at least `pd_threshold_tokens`, and a prefill pod exists). If it
//! does, the prefill policy picks a prefill pod (its overlap and queued prefill) and the
//! decode policy a decode pod (which receives the KV, so only its load counts); otherwise
//! the main policy picks one pod that prefills and decodes. The choice is booked at once.
//!
//! Here: the decision and the request's lifecycle. Beside it, one concern a file: what a
//! router is built from (`config`), the pod registry (`pods`), candidate assembly
//! (`candidates`), the P/D choice (`pd`) and the bookings shared with other replicas
//! (`sharing`).

mod candidates;
mod config;
mod pd;
mod pods;
mod sharing;
#[cfg(test)]
mod tests;

pub use config::{Admission, PdConfig, Role, RouterConfig};
pub use pods::{ModelId, PrefillWaits};

use crate::adapters::{AdapterId, AdapterLoad};
use crate::approx::ApproxIndex;
use crate::events::EventBatch;
use crate::hash::SequenceHash;
use crate::index::KvIndex;
use crate::load::{Booking, BookingKey, BookingUpdate, Credit, Leg, Lifecycle, LoadTracker, UnknownRequest};
use crate::pod_set::{PodId, PodSet};
use crate::policy::{Candidate, Decision, Policy, RouteInput};
use crate::recent::RecentBlocks;
use candidates::fallbacks;
use pods::PodState;

/// One request, as the router needs it: its block chain (kvgate's own hashes) and sizes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteRequest<'a> {
    pub request_id: &'a str,
    pub chain: &'a [SequenceHash],
    pub prompt_tokens: u32,
    /// The request's `max_tokens`, when it set one.
    pub max_output_tokens: Option<u32>,
    /// Only these pods may serve it (the proxy's subset hint); `None` = any pod.
    pub subset: Option<&'a PodSet>,
    /// How many next-best pods to name after the pick, for the proxy's retries.
    pub fallbacks: usize,
    /// The request must leave the saturation headroom free (it has no more than the
    /// default priority).
    pub leave_headroom: bool,
    /// The LoRA adapter it asks for.
    pub adapter: Option<AdapterId>,
    /// The model it asks for (base or adapter): only pods serving it are chosen.
    pub model: Option<ModelId>,
}

impl<'a> RouteRequest<'a> {
    /// A request any pod may serve, with no fallbacks named.
    pub fn new(
        request_id: &'a str,
        chain: &'a [SequenceHash],
        prompt_tokens: u32,
        max_output_tokens: Option<u32>,
    ) -> Self {
        Self { request_id, chain, prompt_tokens, max_output_tokens, ..Self::default() }
    }
}

/// A decision: the pod(s) chosen and the figures behind the choice.
#[derive(Clone, Debug)]
pub struct Routed {
    /// The pod that decodes (and, on the direct path, prefills).
    pub decode: Candidate,
    /// The prefill pod, when disaggregated.
    pub prefill: Option<Candidate>,
    /// The next-best pods after `decode`, best first (at most `RouteRequest::fallbacks`):
    /// where the proxy retries when the pick refuses the connection.
    pub fallbacks: Vec<PodId>,
    /// The candidates the deciding policy saw (decode candidates when disaggregated).
    pub candidates: Vec<Candidate>,
    pub decision: Decision,
    /// Name of the deciding policy.
    pub policy: &'static str,
    /// Prompt tokens not cached on the best decode-capable pod.
    pub uncached_tokens: u32,
    /// Whether any healthy prefill pod existed (the threshold applied).
    pub prefill_pods: bool,
}

impl Routed {
    /// Prompt tokens cached where the prompt is computed.
    pub fn cached_tokens(&self) -> u32 {
        self.prefill.map_or(self.decode.cached_tokens, |p| p.cached_tokens)
    }
}

/// Why a request cannot be routed now.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unroutable {
    /// No healthy pod can take the request's decode.
    #[error("no healthy pod can serve this request")]
    NoPod,
    /// Every eligible pod is saturated (see [`Admission`]): the request should wait.
    #[error("every pod is saturated")]
    Saturated,
    /// Healthy pods could take it, but none serves the model it asks for.
    #[error("no pod serves the model")]
    ModelNotServed,
}

/// The routing state machine (see the module doc).
pub struct Router {
    block_size: u32,
    pd_threshold_tokens: u32,
    /// See [`crate::load::LoadConfig::reconcile_after_seconds`].
    reconcile_after_seconds: f64,
    admission: Option<Admission>,
    pods: Vec<PodState>,
    index: KvIndex,
    approx: ApproxIndex,
    recent: RecentBlocks,
    load: LoadTracker,
    policy: Box<dyn Policy>,
    prefill_policy: Box<dyn Policy>,
    decode_policy: Box<dyn Policy>,
    /// The names of `policy` and `decode_policy` (a decision names the one that decided).
    policy_names: (&'static str, &'static str),
    overlap: Vec<u32>,
    approx_overlap: Vec<u32>,
    adapters_in_flight: Vec<AdapterLoad>,
    /// This replica's booking changes not yet taken for the other replicas (while sharing).
    shared: Option<Vec<BookingUpdate>>,
}

impl Router {
    pub fn new(config: &RouterConfig) -> Self {
        Self {
            block_size: config.block_size as u32,
            pd_threshold_tokens: config.pd.threshold_tokens,
            reconcile_after_seconds: config.load.reconcile_after_seconds,
            admission: config.admission.clone(),
            pods: Vec::new(),
            index: KvIndex::new(config.block_size, config.index.clone()),
            approx: ApproxIndex::new(config.index.approximate_ttl_seconds, config.index.max_blocks_per_pod),
            recent: RecentBlocks::new(config.load.recent_window_seconds),
            load: LoadTracker::new(config.block_size, config.load.clone()),
            policy: config.policy.build(config.seed),
            prefill_policy: config.pd.prefill_policy.build(config.seed.wrapping_add(1)),
            decode_policy: config.pd.decode_policy.build(config.seed.wrapping_add(2)),
            policy_names: (config.policy.name(), config.pd.decode_policy.name()),
            overlap: Vec::new(),
            approx_overlap: Vec::new(),
            adapters_in_flight: Vec::new(),
            shared: None,
        }
    }

    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    pub fn load(&self) -> &LoadTracker {
        &self.load
    }

    /// `pod` is known to take `slowness` times the fleet's average time (its GPU beside the
    /// fleet's): its learned speed starts there ([`crate::speed`]).
    pub fn declare_slowness(&mut self, pod: PodId, slowness: f64) {
        self.load.declare_slowness(pod, slowness);
    }

    /// Chooses the pod(s) for one request at time `now` and books the choice.
    pub fn route(&mut self, request: &RouteRequest<'_>, now: f64) -> Result<Routed, Unroutable> {
        // The subset limits where the proxy sends the request: the decode pod and its
        // fallbacks. A prefill pod is reached by the decode side (or the filter's leg).
        let mut decoders = self.eligible(|r| r.decodes(), request.subset, request.model);
        if decoders.is_empty() {
            let model_unserved =
                request.model.is_some() && !self.eligible(|r| r.decodes(), request.subset, None).is_empty();
            return Err(if model_unserved { Unroutable::ModelNotServed } else { Unroutable::NoPod });
        }
        let prefillers = self.eligible(|r| r == Role::Prefill, None, request.model);
        let slot_seconds = request.adapter.map_or(0.0, |_| self.load.output_seconds(request.max_output_tokens));
        let input = RouteInput {
            prompt_tokens: request.prompt_tokens,
            block_size: self.block_size,
            slot_seconds,
            fixed_prefill_tokens: self.load.fixed_prefill_tokens(),
            kv_received: false,
        };
        let mut direct = self.candidates(&decoders, request, now, None);
        if let Some(admission) = &self.admission {
            // Only pods with room; none: the request waits (the scorer's admission queue).
            direct.retain(|c| !admission.saturated(c, request.leave_headroom));
            if direct.is_empty() {
                return Err(Unroutable::Saturated);
            }
            decoders = direct.iter().map(|c| c.pod).collect();
        }
        let best_cached = direct.iter().map(|c| c.credited_tokens()).max().unwrap_or(0);
        let uncached_tokens = request.prompt_tokens - best_cached;
        let prefill = self.prefill_pod(&prefillers, &direct, request, &input, uncached_tokens, now);
        let (candidates, decision, policy) = match &prefill {
            Some(prefill) => self.disaggregate(prefill, &decoders, request, &input, now),
            None => {
                let decision = self.policy.select(&input, &direct);
                (direct, decision, self.policy_names.0)
            }
        };
        let decode = candidates[decision.chosen];
        let fallbacks = fallbacks(&candidates, &decision, request.fallbacks);
        let prefill_pods = !prefillers.is_empty();
        let routed = Routed { decode, prefill, fallbacks, candidates, decision, policy, uncached_tokens, prefill_pods };
        self.book(
            request.request_id,
            Leg::Serve,
            &Booking {
                pod: routed.decode.pod,
                prompt_tokens: request.prompt_tokens,
                cached_tokens: routed.decode.credited_tokens(),
                chain: request.chain,
                max_output_tokens: request.max_output_tokens,
                adapter: request.adapter,
            },
            now,
        );
        for chosen in std::iter::once(routed.decode.pod).chain(routed.prefill.map(|p| p.pod)) {
            self.record_routed(chosen, request.chain, request.adapter, now);
        }
        Ok(routed)
    }

    /// A lifecycle report for `request_id`. A disaggregated request's prefill booking ends
    /// with its prefill leg (`prefill_done`), or at the latest with the first token (header
    /// mode: the decode pod's sidecar prefills). `prefill_done` is `Lifecycle::Done` with
    /// `prefill_leg` set.
    pub fn report(
        &mut self,
        request_id: &str,
        event: Lifecycle,
        prefill_leg: bool,
        now: f64,
    ) -> Result<(), UnknownRequest> {
        let prefill_known = self.report_leg(request_id, Leg::Prefill, Lifecycle::Done, now).is_ok();
        if prefill_leg {
            return if prefill_known { Ok(()) } else { Err(UnknownRequest(request_id.to_string())) };
        }
        self.report_leg(request_id, Leg::Serve, event, now).map(|_| ())
    }

    /// Where `request_id` is served and the prompt tokens credited as cached there; `None`
    /// for a request not in flight, and for a disaggregated one: its prompt is computed on
    /// its prefill pod (whose leg may be over), and its decode pod is credited the whole
    /// prompt — which no pod serving a request alone is, vLLM computing its last token.
    pub fn credited(&self, request_id: &str) -> Option<Credit> {
        if self.load.pod_of(&BookingKey::local(request_id, Leg::Prefill)).is_some() {
            return None;
        }
        let credit = self.load.booked_credit(&BookingKey::local(request_id, Leg::Serve))?;
        (credit.tokens < credit.prompt_tokens || credit.prompt_tokens == 0).then_some(credit)
    }

    /// `request_id` finished with `output_tokens` (its usage): the pod's decode speed learns
    /// from it. Call before its `done` report.
    pub fn decoded(&mut self, request_id: &str, output_tokens: u32, now: f64) {
        self.load.decoded(&BookingKey::local(request_id, Leg::Serve), output_tokens, now);
    }

    /// The proxy reports which pod served `request_id` (after its retries): a booking made
    /// for another pod moves there, recomputed for what that pod has cached. Returns the pod
    /// it was booked on when it moved.
    pub fn served(&mut self, request_id: &str, pod: PodId, now: f64) -> Result<Option<PodId>, UnknownRequest> {
        let key = BookingKey::local(request_id, Leg::Serve);
        let booked = self.load.pod_of(&key).ok_or_else(|| UnknownRequest(request_id.to_string()))?;
        if booked == pod || pod.index() >= self.pods.len() {
            return Ok(None);
        }
        let (chain, prompt_tokens) =
            self.load.booked_prompt(&key).ok_or_else(|| UnknownRequest(request_id.to_string()))?;
        let request = RouteRequest::new(request_id, &chain, prompt_tokens, None);
        let cached = self.candidates(&[pod], &request, now, None)[0].credited_tokens();
        self.load.rebook(&key, pod, cached)?;
        self.record_routed(pod, &chain, self.load.booked_adapter(&key), now);
        self.share(|| BookingUpdate::Moved { request: key.request, leg: Leg::Serve, pod, cached_tokens: cached });
        Ok(Some(booked))
    }

    /// Tokens per KV block: the configured size, or the one learned since.
    pub fn block_size(&self) -> usize {
        self.block_size as usize
    }

    /// The engines' KV blocks hold `block_size` tokens (learned from their events or
    /// metrics): requests are hashed in blocks of that size from now on, and what was indexed
    /// at another size is forgotten (the precise index drops an engine's blocks of a size not
    /// its own, so it held none).
    pub fn set_block_size(&mut self, block_size: usize) {
        if block_size == 0 || block_size == self.block_size as usize {
            return;
        }
        self.block_size = block_size as u32;
        self.index.set_block_size(block_size);
        self.load.set_block_size(block_size);
        for pod in (0..self.pods.len()).map(|p| PodId(p as u32)) {
            self.approx.clear_pod(pod);
            self.recent.clear_pod(pod);
        }
    }

    /// Applies one decoded event batch of a pod.
    pub fn apply_events(&mut self, pod: PodId, batch: &EventBatch<'_>) {
        let clears = self.index.stats(pod).clears;
        self.index.apply(pod, batch);
        for &block in self.index.evicted() {
            self.load.evicted(pod, block);
        }
        // `AllBlocksCleared` (a reset prefix cache): what ended requests left is gone too.
        if self.index.stats(pod).clears != clears {
            self.load.forget_finished(pod);
        }
    }

    /// The pod's cache can no longer be trusted (lost events, a restarted engine): forget
    /// what it holds — indexed or routed there — and rebuild from what follows.
    pub fn clear_index(&mut self, pod: PodId) {
        self.index.clear_pod(pod);
        self.approx.clear_pod(pod);
        self.load.forget_finished(pod);
    }

    /// Drops expired bookings and approximate entries; returns the bookings expired.
    pub fn expire(&mut self, now: f64) -> usize {
        let n = self.load.expire(now);
        self.approx.expire(now);
        self.recent.advance(now);
        n
    }
}
