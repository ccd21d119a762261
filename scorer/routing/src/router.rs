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

use crate::adapters::{AdapterId, AdapterLoad, PodAdapters, ReportedAdapters};
use crate::approx::ApproxIndex;
use crate::events::EventBatch;
use crate::hash::SequenceHash;
use crate::index::IndexConfig;
use crate::index::{KvIndex, TieredMatch};
use crate::load::LoadConfig;
use crate::load::{Booking, BookingKey, BookingUpdate, Credit, Leg, Lifecycle, LoadTracker, Origin, UnknownRequest};
use crate::pod_set::{PodId, PodSet};
use crate::policy::PolicyConfig;
use crate::policy::{AdapterFit, Candidate, Decision, Policy, ReportedLoad, RouteInput};
use crate::validate::{Invalid, check, non_negative};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Which side of prefill/decode disaggregation a pod serves.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    /// Whether the pod can take a request's decode (and a direct request).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Both | Role::Decode)
    }
}

/// Prefill/decode disaggregation (`pd`).
#[derive(Clone, Debug, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    /// Disaggregate when the best decode-capable pod would have to prefill at least this many
    /// uncached tokens (and a healthy prefill pod exists). 0 = always.
    pub threshold_tokens: u32,
    /// How the prefill pod is chosen (`kv`: KV overlap + queued prefill work).
    pub prefill_policy: PolicyConfig,
    /// How the decode pod of a disaggregated request is chosen (`kv`: decode load).
    pub decode_policy: PolicyConfig,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self { threshold_tokens: 1024, prefill_policy: PolicyConfig::default(), decode_policy: PolicyConfig::default() }
    }
}

/// Everything a router is built from.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Tokens per KV block: must equal the engines' `--block-size`.
    pub block_size: usize,
    pub index: IndexConfig,
    pub load: LoadConfig,
    pub policy: PolicyConfig,
    pub pd: PdConfig,
    /// Seed of the policies' random choices.
    pub seed: u64,
    /// When pods have no room, and how requests wait for some (absent: never saturated).
    pub admission: Option<Admission>,
}

impl RouterConfig {
    /// Checks every part; fields are named as the scorer's YAML writes them.
    pub fn validate(&self) -> Result<(), Invalid> {
        check(self.block_size > 0, "block_size", "must be positive")?;
        self.index.validate().map_err(|e| e.under("index"))?;
        self.load.validate().map_err(|e| e.under("load"))?;
        self.policy.validate().map_err(|e| e.under("policy"))?;
        self.pd.prefill_policy.validate().map_err(|e| e.under("pd.prefill_policy"))?;
        self.pd.decode_policy.validate().map_err(|e| e.under("pd.decode_policy"))?;
        if let Some(admission) = &self.admission {
            admission.validate().map_err(|e| e.under("admission"))?;
        }
        Ok(())
    }
}

/// One request, as the router needs it: its block chain (kvgate's own hashes) and sizes.
#[derive(Clone, Copy, Debug)]
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
}

impl<'a> RouteRequest<'a> {
    /// A request any pod may serve, with no fallbacks named.
    pub fn new(
        request_id: &'a str,
        chain: &'a [SequenceHash],
        prompt_tokens: u32,
        max_output_tokens: Option<u32>,
    ) -> Self {
        Self {
            request_id,
            chain,
            prompt_tokens,
            max_output_tokens,
            subset: None,
            fallbacks: 0,
            leave_headroom: false,
            adapter: None,
        }
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
}

/// Overload (`admission`): when a pod has no room for another request — beyond any of these
/// limits it is not chosen (the router judges it) — and how a request finding every pod so
/// waits for room in the scorer's admission queue (by priority, first come first served within
/// one, until its wait runs out: 429 with `Retry-After`; sheddable ones are refused at once).
#[derive(Clone, Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Admission {
    /// A pod is saturated at this many waiting requests it reports
    /// (`vllm:num_requests_waiting`)…
    pub max_waiting: Option<f64>,
    /// …or this KV-cache usage it reports (0–1)…
    pub max_kv_usage: Option<f64>,
    /// …or this many uncached prompt tokens kvgate has sent it and not seen start (its own
    /// bookings: no scrape lag)…
    pub max_queued_prefill_tokens: Option<u64>,
    /// …or this many requests kvgate has in flight there (its own bookings): the concurrency
    /// beyond which a pod's steps, and so everyone's time to first token, grow.
    pub max_inflight_requests: Option<u32>,
    /// Share (0–1) of the two limits above that only requests of higher than default
    /// priority may use: interactive traffic finds room while a burst of ordinary requests
    /// waits.
    pub headroom: f64,
    /// Requests waiting at most (at least 1); a newcomer beyond it is refused, or takes the
    /// place of a waiter of lower priority.
    pub queue_limit: NonZeroUsize,
    /// Longest wait for room (then 429); Envoy's timeouts toward the scorer are rendered
    /// this much longer.
    pub max_wait_ms: u64,
    /// Priority of each objective named in `x-gateway-inference-objective` (the Gateway
    /// API Inference Extension's InferenceObjective); negative = sheddable.
    pub objectives: BTreeMap<String, i32>,
    /// Priority of requests naming no known objective.
    pub default_priority: i32,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_waiting: None,
            max_kv_usage: None,
            max_queued_prefill_tokens: None,
            max_inflight_requests: None,
            headroom: 0.0,
            queue_limit: NonZeroUsize::new(1024).expect("not zero"),
            max_wait_ms: 5000,
            objectives: BTreeMap::new(),
            default_priority: 0,
        }
    }
}

impl Admission {
    /// Checks the limits (one at least must be set: else nothing is ever saturated) and the
    /// wait.
    pub fn validate(&self) -> Result<(), Invalid> {
        check((0.0..1.0).contains(&self.headroom), "headroom", "must be in [0, 1)")?;
        let limits = [self.max_waiting, self.max_kv_usage].iter().any(Option::is_some)
            || self.max_queued_prefill_tokens.is_some()
            || self.max_inflight_requests.is_some();
        let why = "set when a pod is saturated: max_waiting, max_kv_usage, max_queued_prefill_tokens or max_inflight_requests";
        check(limits, "", why)?;
        check(self.max_kv_usage.is_none_or(|u| u > 0.0 && u <= 1.0), "max_kv_usage", "must be in (0, 1]")?;
        check(self.max_waiting.is_none_or(non_negative), "max_waiting", "must be a number >= 0")?;
        check(self.max_wait_ms > 0, "max_wait_ms", "must be positive")
    }

    /// Whether `c` has no room — for a request that must leave the headroom free, when
    /// `leave_headroom`.
    pub fn saturated(&self, c: &Candidate, leave_headroom: bool) -> bool {
        let reported = |f: fn(&ReportedLoad) -> f64, max: Option<f64>| matches!((c.reported, max), (Some(r), Some(m)) if f(&r) >= m);
        let share = if leave_headroom { 1.0 - self.headroom } else { 1.0 };
        let own = |value: f64, max: f64| value >= (max * share).max(1.0);
        reported(|r| r.waiting, self.max_waiting)
            || reported(|r| r.kv_cache_usage, self.max_kv_usage)
            || self.max_queued_prefill_tokens.is_some_and(|m| own(c.load.queued_prefill_tokens as f64, m as f64))
            || self.max_inflight_requests.is_some_and(|m| own(f64::from(c.load.inflight_requests), f64::from(m)))
    }
}

struct PodState {
    role: Role,
    precise: bool,
    /// False once discovery removed the pod (its id is kept for when it comes back).
    present: bool,
    healthy: bool,
    reported: Option<ReportedLoad>,
    adapters: PodAdapters,
    /// The pod's identity in [`Candidate::tie_rank`]s: the same on every gateway replica.
    key: u64,
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
    load: LoadTracker,
    policy: Box<dyn Policy>,
    prefill_policy: Box<dyn Policy>,
    decode_policy: Box<dyn Policy>,
    overlap: Vec<u32>,
    approx_overlap: Vec<u32>,
    adapters_in_flight: Vec<AdapterLoad>,
    /// This replica's booking changes not yet taken for the other replicas (while sharing).
    shared: Option<Vec<BookingUpdate>>,
}

/// Up to `n` candidates after the chosen one, best first: those the policy scored by
/// ascending cost, then the unscored in turn after the chosen one (round robin's order).
fn fallbacks(candidates: &[Candidate], decision: &Decision, n: usize) -> Vec<PodId> {
    if n == 0 {
        return Vec::new();
    }
    let len = candidates.len();
    let mut order: Vec<usize> = (1..len).map(|k| (decision.chosen + k) % len).collect();
    // Stable: unscored candidates keep their turn order, after every scored one.
    order.sort_by(|&a, &b| {
        match (decision.costs.get(a).copied().flatten(), decision.costs.get(b).copied().flatten()) {
            (Some(x), Some(y)) => x.total_cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        }
    });
    order.into_iter().take(n).map(|i| candidates[i].pod).collect()
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
            load: LoadTracker::new(config.block_size, config.load.clone()),
            policy: config.policy.build(config.seed),
            prefill_policy: config.pd.prefill_policy.build(config.seed.wrapping_add(1)),
            decode_policy: config.pd.decode_policy.build(config.seed.wrapping_add(2)),
            overlap: Vec::new(),
            approx_overlap: Vec::new(),
            adapters_in_flight: Vec::new(),
            shared: None,
        }
    }

    /// From now on every change this router makes to its bookings (a decision, a lifecycle
    /// report, a moved booking) is kept for [`Router::take_shared`]: gateway replicas that
    /// apply each other's ([`Router::apply_shared`]) decide on the whole fleet's requests in
    /// flight. Expiry, reconciliation and pods going down are each replica's own judgement.
    pub fn share_bookings(&mut self) {
        self.shared.get_or_insert_with(Vec::new);
    }

    /// The booking changes made since the last call (none unless sharing).
    pub fn take_shared(&mut self) -> Vec<BookingUpdate> {
        self.shared.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Applies another replica's booking change as if this router had made it (the
    /// approximate index learns where its request went, too).
    pub fn apply_shared(&mut self, origin: Origin, update: &BookingUpdate, now: f64) -> Result<(), UnknownRequest> {
        match update {
            BookingUpdate::Booked {
                request,
                leg,
                pod,
                prompt_tokens,
                cached_tokens,
                chain,
                max_output_tokens,
                adapter,
            } => {
                let key = BookingKey { origin, leg: *leg, request: request.clone() };
                let booking = Booking {
                    pod: *pod,
                    prompt_tokens: *prompt_tokens,
                    cached_tokens: *cached_tokens,
                    chain,
                    max_output_tokens: *max_output_tokens,
                    adapter: *adapter,
                };
                self.load.book(&key, &booking, now);
                self.record_routed(*pod, chain, *adapter, now);
            }
            BookingUpdate::Reported { request, leg, event } => {
                self.load.report(&BookingKey { origin, leg: *leg, request: request.clone() }, *event, now)?;
            }
            BookingUpdate::Moved { request, leg, pod, cached_tokens } => {
                let key = BookingKey { origin, leg: *leg, request: request.clone() };
                self.load.rebook(&key, *pod, *cached_tokens)?;
                if let Some((chain, _)) = self.load.booked_prompt(&key) {
                    self.record_routed(*pod, &chain, self.load.booked_adapter(&key), now);
                }
            }
        }
        Ok(())
    }

    /// Forgets another replica's bookings (it left, or a snapshot of them follows).
    pub fn clear_origin(&mut self, origin: Origin) -> usize {
        self.load.clear_origin(origin)
    }

    /// This replica's bookings as updates that rebuild them elsewhere: for a replica that
    /// joins, or lost some of our updates.
    pub fn snapshot(&self) -> Vec<BookingUpdate> {
        let mut out = Vec::new();
        for (key, booking, first_token) in self.load.local_bookings() {
            out.push(BookingUpdate::Booked {
                request: key.request.clone(),
                leg: key.leg,
                pod: booking.pod,
                prompt_tokens: booking.prompt_tokens,
                cached_tokens: booking.cached_tokens,
                chain: booking.chain.into(),
                max_output_tokens: booking.max_output_tokens,
                adapter: booking.adapter,
            });
            if first_token {
                out.push(BookingUpdate::Reported {
                    request: key.request.clone(),
                    leg: key.leg,
                    event: Lifecycle::FirstToken,
                });
            }
        }
        out
    }

    /// Books this replica's decision (and keeps it for the others, while sharing).
    fn book(&mut self, request: &str, leg: Leg, booking: &Booking<'_>, now: f64) {
        let chain = self.load.book(&BookingKey::local(request, leg), booking, now);
        if let Some(shared) = &mut self.shared {
            shared.push(BookingUpdate::Booked {
                request: request.into(),
                leg,
                pod: booking.pod,
                prompt_tokens: booking.prompt_tokens,
                cached_tokens: booking.cached_tokens,
                chain,
                max_output_tokens: booking.max_output_tokens,
                adapter: booking.adapter,
            });
        }
    }

    /// Applies a lifecycle report to this replica's booking (and shares it).
    fn report_leg(&mut self, request: &str, leg: Leg, event: Lifecycle, now: f64) -> Result<PodId, UnknownRequest> {
        let pod = self.load.report(&BookingKey::local(request, leg), event, now)?;
        if let Some(shared) = &mut self.shared {
            shared.push(BookingUpdate::Reported { request: request.into(), leg, event });
        }
        Ok(pod)
    }

    /// A request was routed to `pod`: pods without KV events are indexed by what is routed
    /// there, and its adapter is run there next.
    fn record_routed(&mut self, pod: PodId, chain: &[SequenceHash], adapter: Option<AdapterId>, now: f64) {
        let Some(state) = self.pods.get_mut(pod.index()) else { return };
        if let Some(adapter) = adapter {
            state.adapters.routed(adapter);
        }
        if !state.precise {
            self.approx.record(pod, chain, now);
        }
    }

    /// Adds a pod, healthy, and gives it its id: the one place pod ids are made (the index,
    /// the bookings and the speeds keep their state of it by that id). `precise`: its KV
    /// events will be applied; otherwise it is indexed approximately by what is routed there.
    pub fn add_pod(&mut self, role: Role, precise: bool) -> PodId {
        let id = PodId(self.pods.len() as u32);
        let key = xxh3_64(&(id.index() as u64).to_le_bytes());
        self.pods.push(PodState {
            role,
            precise,
            present: true,
            healthy: true,
            reported: None,
            adapters: PodAdapters::default(),
            key,
        });
        id
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
        state.present = false;
        state.healthy = false;
        state.reported = None;
        state.adapters = PodAdapters::default();
        self.index.clear_pod(pod);
        self.approx.clear_pod(pod);
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

    pub fn is_healthy(&self, pod: PodId) -> bool {
        let state = &self.pods[pod.index()];
        state.present && state.healthy
    }

    /// The load the pod last reported, while healthy.
    pub fn reported_load(&self, pod: PodId) -> Option<ReportedLoad> {
        self.pods[pod.index()].reported
    }

    /// Blocks the router believes `pod` holds (precise or approximate).
    pub fn pod_blocks(&self, pod: PodId) -> usize {
        if self.pods[pod.index()].precise { self.index.pod_blocks(pod) } else { self.approx.pod_blocks(pod) }
    }

    /// True when some healthy pod can take requests.
    pub fn ready(&self) -> bool {
        self.pods.iter().any(|p| p.present && p.healthy && p.role.decodes())
    }

    /// Chooses the pod(s) for one request at time `now` and books the choice.
    pub fn route(&mut self, request: &RouteRequest<'_>, now: f64) -> Result<Routed, Unroutable> {
        // The subset limits where the proxy sends the request: the decode pod and its
        // fallbacks. A prefill pod is reached by the decode side (or the filter's leg).
        let mut decoders = self.eligible(|r| r.decodes(), request.subset);
        if decoders.is_empty() {
            return Err(Unroutable::NoPod);
        }
        let prefillers = self.eligible(|r| r == Role::Prefill, None);
        let slot_seconds = request.adapter.map_or(0.0, |_| self.load.output_seconds(request.max_output_tokens));
        let input = RouteInput { prompt_tokens: request.prompt_tokens, block_size: self.block_size, slot_seconds };
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
        let prefill_pods = !prefillers.is_empty();
        let mut prefill_choice = None;
        if prefill_pods && uncached_tokens >= self.pd_threshold_tokens {
            let prefill_candidates = self.candidates(&prefillers, request, now, None);
            let prefill = prefill_candidates[self.prefill_policy.select(&input, &prefill_candidates).chosen];
            // Disaggregation pays when the prefill pod starts this prompt no later than the
            // least-busy decode-capable pod could compute it itself; an overloaded prefill
            // pool sends long prompts direct instead of queueing them (threshold 0: always).
            let backlog =
                |c: &Candidate| c.load.queued_prefill_tokens + u64::from(request.prompt_tokens - c.credited_tokens());
            let local = direct.iter().map(backlog).min().unwrap_or(u64::MAX);
            if self.pd_threshold_tokens == 0 || backlog(&prefill) <= local {
                prefill_choice = Some(prefill);
            }
        }

        let routed = if let Some(prefill) = prefill_choice {
            // The decode pod pulls the KV: it computes no prefill, only its load counts.
            let candidates = self.candidates(&decoders, request, now, Some(request.prompt_tokens));
            let decision = self.decode_policy.select(&input, &candidates);
            self.book(
                request.request_id,
                Leg::Prefill,
                &Booking {
                    pod: prefill.pod,
                    prompt_tokens: request.prompt_tokens,
                    cached_tokens: prefill.credited_tokens(),
                    chain: request.chain,
                    max_output_tokens: Some(0),
                    adapter: request.adapter,
                },
                now,
            );
            let decode = candidates[decision.chosen];
            let policy = self.decode_policy.name();
            let fallbacks = fallbacks(&candidates, &decision, request.fallbacks);
            Routed {
                decode,
                prefill: Some(prefill),
                fallbacks,
                candidates,
                decision,
                policy,
                uncached_tokens,
                prefill_pods,
            }
        } else {
            let decision = self.policy.select(&input, &direct);
            let decode = direct[decision.chosen];
            let policy = self.policy.name();
            let fallbacks = fallbacks(&direct, &decision, request.fallbacks);
            Routed {
                decode,
                prefill: None,
                fallbacks,
                candidates: direct,
                decision,
                policy,
                uncached_tokens,
                prefill_pods,
            }
        };
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

    fn eligible(&self, role: impl Fn(Role) -> bool, subset: Option<&PodSet>) -> Vec<PodId> {
        (0..self.pods.len() as u32)
            .map(PodId)
            .filter(|p| {
                let s = &self.pods[p.index()];
                s.present && s.healthy && role(s.role) && subset.is_none_or(|set| set.contains(*p))
            })
            .collect()
    }

    /// Candidates among `pods`: their cached prefix of the request — indexed, or being
    /// computed by requests in flight there — (or `cached_override` tokens, for decode pods
    /// that will receive the KV), booked load and reported load.
    fn candidates(
        &mut self,
        pods: &[PodId],
        request: &RouteRequest<'_>,
        now: f64,
        cached_override: Option<u32>,
    ) -> Vec<Candidate> {
        if cached_override.is_none() {
            let precise: PodSet = pods.iter().copied().filter(|p| self.pods[p.index()].precise).collect();
            let approximate: PodSet = pods.iter().copied().filter(|p| !self.pods[p.index()].precise).collect();
            self.index.longest_prefixes(request.chain, &precise, &mut self.overlap);
            self.approx.longest_prefixes(request.chain, &approximate, &mut self.approx_overlap);
        }
        let offloaded = cached_override.is_none() && self.index.has_offloaded();
        let offload = self.index.config().offload;
        let tokens =
            |blocks: u32| (u64::from(blocks) * u64::from(self.block_size)).min(u64::from(request.prompt_tokens)) as u32;
        // vLLM computes at least a prompt's last token: a hit is at most the whole blocks
        // before it (a block-aligned prompt held whole is served one block short).
        let max_hit = request.prompt_tokens.saturating_sub(1) / self.block_size;
        // Rendezvous hashing of the prompt's first block: its own order of pods.
        let first_block = request.chain.first();
        let tie_rank = |p: PodId| {
            first_block.map_or(0, |b| xxh3_64_with_seed(&self.pods[p.index()].key.to_le_bytes(), b.0).max(1))
        };
        let mut in_flight = std::mem::take(&mut self.adapters_in_flight);
        let candidates = pods
            .iter()
            .map(|&p| {
                let adapter = match request.adapter {
                    Some(adapter) => {
                        self.load.adapters_in_flight(p, now, &mut in_flight);
                        let unknown = self.load.default_decode_seconds(p);
                        self.pods[p.index()].adapters.fit(adapter, &in_flight, unknown)
                    }
                    None => AdapterFit::Unlimited,
                };
                let (cached, offloaded_tokens, offload_work_tokens) = match cached_override {
                    Some(cached) => (cached, 0, 0),
                    None => {
                        let overlap = |o: &[u32]| o.get(p.index()).copied().unwrap_or(0);
                        let mut indexed = overlap(&self.overlap).max(overlap(&self.approx_overlap));
                        if self.index.is_hybrid(p) {
                            indexed =
                                self.index.hybrid_prefix(request.chain, p, indexed as usize, max_hit as usize) as u32;
                        }
                        let blocks = indexed.max(self.load.inflight_prefix(p, request.chain) as u32).min(max_hit);
                        let cached = tokens(blocks);
                        // Blocks past the GPU prefix the pod holds offloaded: loaded, not computed.
                        let run = if offloaded {
                            self.index.offloaded_run(request.chain, p, blocks as usize)
                        } else {
                            TieredMatch::default()
                        };
                        let loaded = tokens(blocks + run.cpu_blocks + run.storage_blocks) - cached;
                        let storage = loaded.min(run.storage_blocks * self.block_size);
                        let work = f64::from(loaded - storage) * offload.cpu_load_cost
                            + f64::from(storage) * offload.storage_load_cost;
                        (cached, loaded, (work.ceil() as u32).min(loaded))
                    }
                };
                Candidate {
                    pod: p,
                    cached_tokens: cached,
                    offloaded_tokens,
                    offload_work_tokens,
                    pod_blocks: self.pod_blocks(p) as u64,
                    load: self.load.load(p, now),
                    reported: self.pods[p.index()].reported,
                    slowness: self.load.slowness(p),
                    tie_rank: tie_rank(p),
                    adapter,
                }
            })
            .collect();
        self.adapters_in_flight = in_flight;
        candidates
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
        if let Some(shared) = &mut self.shared {
            shared.push(BookingUpdate::Moved { request: key.request, leg: Leg::Serve, pod, cached_tokens: cached });
        }
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
        for pod in 0..self.pods.len() {
            self.approx.clear_pod(PodId(pod as u32));
        }
    }

    /// Applies one decoded event batch of a pod.
    pub fn apply_events(&mut self, pod: PodId, batch: &EventBatch<'_>) {
        self.index.apply(pod, batch);
        for &block in self.index.evicted() {
            self.load.evicted(pod, block);
        }
    }

    /// The pod's cache can no longer be trusted (lost events, a restarted engine): forget
    /// what it holds — indexed or routed there — and rebuild from what follows.
    pub fn clear_index(&mut self, pod: PodId) {
        self.index.clear_pod(pod);
        self.approx.clear_pod(pod);
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

    /// Drops expired bookings and approximate entries; returns the bookings expired.
    pub fn expire(&mut self, now: f64) -> usize {
        let n = self.load.expire(now);
        self.approx.expire(now);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{root_hash, sequence_hashes};

    fn router(threshold: u32) -> Router {
        Router::new(&test_config(threshold))
    }

    fn test_config(threshold: u32) -> RouterConfig {
        RouterConfig {
            block_size: 16,
            index: IndexConfig { approximate_ttl_seconds: 60.0, ..IndexConfig::default() },
            load: LoadConfig { default_output_tokens: 64, ..LoadConfig::default() },
            policy: PolicyConfig::default(),
            pd: PdConfig {
                threshold_tokens: threshold,
                decode_policy: PolicyConfig::LeastLoaded,
                ..PdConfig::default()
            },
            seed: 7,
            admission: None,
        }
    }

    fn chain(seed: u32, tokens: u32) -> Vec<SequenceHash> {
        let ids: Vec<u32> = (0..tokens).map(|i| seed * 100_000 + i).collect();
        let mut out = Vec::new();
        sequence_hashes(root_hash(None, None), &ids, 16, &mut out);
        out
    }

    /// `pod` announces the 512-token prompt of `chain(1, 512)`'s first `blocks` blocks in `tier`.
    fn announce(r: &mut Router, pod: PodId, blocks: usize, tier: crate::events::Tier) {
        use crate::events::{BlockStored, EventBatch, KvEvent};
        let stored = BlockStored {
            block_hashes: (0..blocks as u64).map(|h| crate::hash::EngineHash(h + 1)).collect(),
            parent_block_hash: None,
            token_ids: (0..blocks as u32 * 16).map(|i| 100_000 + i).collect(),
            block_size: 16,
            lora_name: None,
            first_block_extra: vec![],
            opaque_extra_keys: false,
            tier,
            group: 0,
            group_kind: crate::events::GroupKind::FullAttention,
        };
        r.apply_events(
            pod,
            &EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(stored)], data_parallel_rank: None },
        );
    }

    #[test]
    fn an_adapters_requests_follow_the_pod_running_it_and_spread_when_its_slots_are_full() {
        let mut r = router(u32::MAX);
        let pods: Vec<PodId> = (0..3).map(|_| r.add_pod(Role::Both, true)).collect();
        let one_slot = ReportedAdapters { max_loras: 1, ..ReportedAdapters::default() };
        for &p in &pods {
            r.reported_adapters(p, one_slot.clone());
        }
        let (sql, law) = (AdapterId::of("sql"), AdapterId::of("law"));
        let route = |r: &mut Router, id: &str, seed: u32, adapter: AdapterId, now: f64| {
            let c = chain(seed, 64);
            let request = RouteRequest { adapter: Some(adapter), ..RouteRequest::new(id, &c, 64, Some(64)) };
            r.route(&request, now).unwrap()
        };
        let first = route(&mut r, "s1", 1, sql, 0.0).decode.pod;
        let second = route(&mut r, "s2", 2, sql, 0.0);
        assert_eq!(second.decode.pod, first, "the pod running sql takes its next request, another prompt");
        assert_eq!(second.decode.adapter, AdapterFit::Running);
        // The only slot there holds sql (two requests of 64 tokens at 50 tokens/s: 1.28 s, and
        // a stream of them keeps it e¹ times as long): law goes elsewhere and pays for its
        // load there.
        let third = route(&mut r, "l1", 3, law, 0.0);
        assert_ne!(third.decode.pod, first);
        assert_eq!(third.decode.adapter, AdapterFit::Free { load: true });
        let at_home = third.candidates.iter().find(|c| c.pod == first).unwrap();
        assert!(
            matches!(at_home.adapter, AdapterFit::Full { load: true, wait_seconds, .. } if (wait_seconds - 1.28 * 1f64.exp()).abs() < 1e-9),
            "{:?}",
            at_home.adapter
        );
        // A crowd of long sql prompts piles up at its home until its queue outweighs a second
        // slot.
        let spread: Vec<PodId> = (0..40)
            .map(|i| {
                let (c, id) = (chain(10 + i, 1024), format!("s{}", i + 3));
                let request = RouteRequest { adapter: Some(sql), ..RouteRequest::new(&id, &c, 1024, Some(64)) };
                r.route(&request, 0.0).unwrap().decode.pod
            })
            .collect();
        assert_eq!(spread[0], first);
        let third_pod = pods.iter().copied().find(|p| *p != first && *p != third.decode.pod).unwrap();
        assert!(spread.contains(&third_pod), "sql spreads to the free pod once its home is busy: {spread:?}");
        assert!(!spread.contains(&third.decode.pod), "never behind law's slot");
        // Base-model requests take no slot.
        let base = r.route(&RouteRequest::new("b", &chain(99, 64), 64, Some(8)), 0.0).unwrap();
        assert!(base.candidates.iter().all(|c| c.adapter == AdapterFit::Unlimited));
    }

    #[test]
    fn a_prompt_held_whole_is_credited_up_to_its_last_token_only() {
        // vLLM computes a prompt's last token whatever it holds: of a block-aligned prompt held
        // whole it serves one block short (a real engine reported 96 of 128; kvgate said 128).
        let mut r = router(u32::MAX);
        let pod = r.add_pod(Role::Both, true);
        announce(&mut r, pod, 32, crate::events::Tier::Gpu);
        let cached = |r: &mut Router, tokens: u32| {
            let c = chain(1, tokens);
            r.route(&RouteRequest::new("q", &c, tokens, Some(1)), 0.0).unwrap().decode.cached_tokens
        };
        assert_eq!(cached(&mut r, 512), 496, "32 blocks held, 31 served");
        assert_eq!(cached(&mut r, 513), 512, "a token past them: all 32");
        assert_eq!(cached(&mut r, 17), 16);
        assert_eq!(cached(&mut r, 16), 0);
        assert_eq!(cached(&mut r, 1), 0);
    }

    #[test]
    fn a_request_served_elsewhere_takes_its_adapter_along() {
        let mut r = router(u32::MAX);
        let pods: Vec<PodId> = (0..2).map(|_| r.add_pod(Role::Both, true)).collect();
        for &p in &pods {
            r.reported_adapters(p, ReportedAdapters { max_loras: 1, ..ReportedAdapters::default() });
        }
        let sql = AdapterId::of("sql");
        let c = chain(1, 64);
        let ask = |id| RouteRequest { adapter: Some(sql), ..RouteRequest::new(id, &c, 64, Some(8)) };
        let picked = r.route(&ask("a"), 0.0).unwrap().decode.pod;
        let other = pods.into_iter().find(|p| *p != picked).unwrap();
        // The proxy retried it on the other pod, where it ran and ended.
        assert_eq!(r.served("a", other, 0.1), Ok(Some(picked)));
        r.report("a", Lifecycle::Done, false, 0.2).unwrap();
        let next = r.route(&ask("b"), 0.3).unwrap();
        let fit = next.candidates.iter().find(|c| c.pod == other).unwrap().adapter;
        assert_eq!(fit, AdapterFit::Free { load: false }, "sql was loaded where it ran");
    }

    #[test]
    fn an_adapters_blocks_as_vllm_publishes_them_serve_its_requests_only() {
        // vLLM 0.33's engine stores "sql"'s blocks and the base model's of the same 8 tokens
        // (block size 4), then evicts the second block of each.
        let mut r = Router::new(&RouterConfig { block_size: 4, ..test_config(u32::MAX) });
        let pod = r.add_pod(Role::Both, true);
        let tokens: Vec<u32> = (1..=8).collect();
        let found = |r: &mut Router, lora: Option<&str>| {
            let mut c = Vec::new();
            sequence_hashes(root_hash(lora, None), &tokens, 4, &mut c);
            let request = RouteRequest { adapter: lora.map(AdapterId::of), ..RouteRequest::new("q", &c, 9, Some(1)) };
            r.route(&request, 0.0).unwrap().decode.cached_tokens
        };
        for (batch, cached) in [(0, 8), (1, 4)] {
            let payload = kvgate_test_harness::vllm_fixture_payload("vllm-0.33.0-lora-kv-events.json", batch);
            r.apply_events(pod, &crate::events::decode_batch(&payload).unwrap());
            assert_eq!((found(&mut r, Some("sql")), found(&mut r, None)), (cached, cached), "batch {batch}");
            assert_eq!(found(&mut r, Some("law")), 0, "another adapter's blocks are not these");
        }
    }

    #[test]
    fn a_hybrid_models_prefix_as_vllm_publishes_its_groups_counts_as_far_as_its_window_serves_it() {
        // vLLM 0.33's engine of a hybrid model stores 4 blocks (of 4 tokens) in its
        // full-attention group and its sliding-window group (9 tokens: 2 blocks), then the
        // window group evicts blocks 0 and 1, then block 3.
        let mut r = Router::new(&RouterConfig { block_size: 4, ..test_config(u32::MAX) });
        let pod = r.add_pod(Role::Both, true);
        let tokens: Vec<u32> = (1..=17).collect();
        let mut c = Vec::new();
        sequence_hashes(root_hash(None, None), &tokens, 4, &mut c);
        for (batch, cached) in [(0, 16), (1, 16), (2, 0)] {
            let payload = kvgate_test_harness::vllm_fixture_payload("vllm-0.33.0-hybrid-kv-events.json", batch);
            r.apply_events(pod, &crate::events::decode_batch(&payload).unwrap());
            let routed = r.route(&RouteRequest::new(&format!("q{batch}"), &c, 17, Some(1)), 0.0).unwrap();
            assert_eq!(routed.decode.cached_tokens, cached, "batch {batch}");
            r.report(&format!("q{batch}"), Lifecycle::Done, false, 0.0).unwrap();
        }
        assert_eq!(r.index().stats(pod).removed_blocks, 3);
    }

    #[test]
    fn a_prompt_held_offloaded_is_loaded_not_recomputed() {
        use crate::events::Tier;
        let c = chain(1, 512);
        let setup = |offload: crate::index::OffloadConfig| {
            let mut config = test_config(0);
            config.index.offload = offload;
            let mut r = Router::new(&config);
            let pods = [r.add_pod(Role::Both, true), r.add_pod(Role::Both, true), r.add_pod(Role::Both, true)];
            announce(&mut r, pods[1], 32, Tier::Cpu);
            announce(&mut r, pods[2], 16, Tier::Gpu);
            (r, pods)
        };
        let (mut r, pods) = setup(Default::default());
        let routed = r.route(&RouteRequest::new("a", &c, 512, Some(8)), 0.0).unwrap();
        assert_eq!(routed.decode.pod, pods[1], "loading 512 tokens from host memory beats computing 256");
        assert_eq!((routed.decode.cached_tokens, routed.decode.offloaded_tokens), (0, 512));
        assert_eq!(routed.decode.offload_work_tokens, 52, "a tenth of computing them, rounded up");
        assert_eq!(routed.candidates[2].offloaded_tokens, 0);
        // The booking counts the loading as prefill work, not the whole prompt.
        assert_eq!(r.load().load(pods[1], 0.0).queued_prefill_tokens, 52);
        // Offload tiers left out: the GPU prefix wins.
        let off = crate::index::OffloadConfig { max_blocks_per_pod: 0, ..Default::default() };
        let (mut r, pods) = setup(off);
        assert_eq!(r.route(&RouteRequest::new("a", &c, 512, Some(8)), 0.0).unwrap().decode.pod, pods[2]);
        // Loading costing as much as computing: a GPU prefix of half the prompt wins again.
        let dear = crate::index::OffloadConfig { cpu_load_cost: 1.0, ..Default::default() };
        let (mut r, pods) = setup(dear);
        assert_eq!(r.route(&RouteRequest::new("a", &c, 512, Some(8)), 0.0).unwrap().decode.pod, pods[2]);
    }

    #[test]
    fn routes_a_repeated_prefix_back_and_books_until_done() {
        let mut r = router(1024);
        let pods = [r.add_pod(Role::Both, false), r.add_pod(Role::Both, false)];
        let c = chain(1, 512);
        let req = |id| RouteRequest::new(id, &c, 512, Some(8));
        let first = r.route(&req("a"), 0.0).unwrap();
        assert_eq!((first.prefill, first.cached_tokens()), (None, 0));
        assert!(!first.prefill_pods);
        r.report("a", Lifecycle::Done, false, 1.0).unwrap();
        let again = r.route(&req("b"), 2.0).unwrap();
        assert_eq!(again.decode.pod, first.decode.pod, "the approximate index remembers where the prefix went");
        assert_eq!(again.cached_tokens(), 496, "all but the block of its last token");
        assert_eq!(r.load().load(again.decode.pod, 2.0).inflight_requests, 1);
        r.report("b", Lifecycle::Done, false, 3.0).unwrap();
        assert!(pods.iter().all(|&p| r.load().load(p, 3.0).inflight_requests == 0));
        assert!(r.report("b", Lifecycle::Done, false, 3.0).is_err(), "a second done names no request");
    }

    #[test]
    fn disaggregates_above_the_threshold_and_skips_unhealthy_pods() {
        let mut r = router(256);
        let prefill = r.add_pod(Role::Prefill, false);
        let decode = [r.add_pod(Role::Decode, false), r.add_pod(Role::Decode, false)];
        let long = chain(2, 512);
        let routed = r.route(&RouteRequest::new("p", &long, 512, None), 0.0).unwrap();
        assert_eq!(routed.prefill.map(|p| p.pod), Some(prefill));
        assert!(decode.contains(&routed.decode.pod));
        assert_eq!((routed.policy, routed.uncached_tokens), ("least-loaded", 512));
        assert_eq!(r.load().load(prefill, 0.0).inflight_requests, 1);
        r.report("p", Lifecycle::Done, true, 1.0).unwrap();
        assert_eq!(r.load().load(prefill, 1.0).inflight_requests, 0, "prefill_done ends the prefill booking");
        assert_eq!(r.load().load(routed.decode.pod, 1.0).inflight_requests, 1);

        let short = chain(3, 64);
        let direct = r.route(&RouteRequest::new("s", &short, 64, None), 1.0).unwrap();
        assert!(direct.prefill.is_none() && direct.prefill_pods, "below the threshold: one decode pod");

        r.unhealthy(decode[0]);
        r.unhealthy(decode[1]);
        assert!(!r.ready());
        let none = r.route(&RouteRequest::new("x", &short, 64, None), 2.0);
        assert_eq!(none.unwrap_err(), Unroutable::NoPod);
        r.reported(decode[1], ReportedLoad::default());
        r.remove_pod(decode[0]);
        r.reported(decode[0], ReportedLoad::default());
        assert!(!r.is_healthy(decode[0]), "a removed pod stays out whatever it reports");
        assert_eq!(r.route(&RouteRequest::new("y", &short, 64, None), 3.0).unwrap().decode.pod, decode[1]);
    }

    #[test]
    fn fallbacks_follow_the_costs_and_the_subset_limits_the_choice() {
        let mut r = router(1024);
        let pods: Vec<PodId> = (0..4).map(|_| r.add_pod(Role::Both, false)).collect();
        let warm = chain(5, 256);
        // pod 2 caches the prefix; pods 0 and 1 carry load; pod 3 is idle.
        r.route(
            &RouteRequest {
                subset: Some(&[pods[2]].into_iter().collect()),
                ..RouteRequest::new("w", &warm, 256, Some(1))
            },
            0.0,
        )
        .unwrap();
        r.report("w", Lifecycle::Done, false, 0.1).unwrap();
        for (i, pod) in [pods[0], pods[0], pods[1]].into_iter().enumerate() {
            let c = chain(10 + i as u32, 512);
            let subset: PodSet = [pod].into_iter().collect();
            let id = format!("busy{i}");
            r.route(&RouteRequest { subset: Some(&subset), ..RouteRequest::new(&id, &c, 512, Some(64)) }, 0.2).unwrap();
        }
        let routed =
            r.route(&RouteRequest { fallbacks: 3, ..RouteRequest::new("q", &warm, 256, Some(1)) }, 0.3).unwrap();
        assert_eq!(routed.decode.pod, pods[2], "the cached prefix wins");
        assert_eq!(routed.fallbacks, vec![pods[3], pods[1], pods[0]], "then by cost: idle, one busy, two busy");
        let two = r.route(&RouteRequest { fallbacks: 1, ..RouteRequest::new("q2", &warm, 256, Some(1)) }, 0.3).unwrap();
        assert_eq!(two.fallbacks.len(), 1);
        let only: PodSet = [pods[0], pods[1]].into_iter().collect();
        let limited = r
            .route(
                &RouteRequest { subset: Some(&only), fallbacks: 3, ..RouteRequest::new("q3", &warm, 256, Some(1)) },
                0.3,
            )
            .unwrap();
        assert_eq!(
            (limited.decode.pod, limited.fallbacks.clone()),
            (pods[1], vec![pods[0]]),
            "only the subset, cache elsewhere ignored"
        );
        let nobody: PodSet = [PodId(99)].into_iter().collect();
        assert_eq!(
            r.route(&RouteRequest { subset: Some(&nobody), ..RouteRequest::new("q4", &warm, 256, None) }, 0.3)
                .unwrap_err(),
            Unroutable::NoPod
        );
    }

    #[test]
    fn replicas_that_cannot_hear_each_other_send_a_new_prefix_to_the_same_pod() {
        // Two gateway replicas that found the same 6 pods in different orders, and differ in
        // seed: on an idle fleet every pod ties, and each prefix still goes to the same pod
        // (by address) on both, while different prefixes spread over the pods.
        let addresses: Vec<String> = (0..6).map(|i| format!("10.0.0.{i}:8000")).collect();
        let replica = |order: &mut dyn Iterator<Item = usize>, seed| {
            let mut r = Router::new(&RouterConfig { seed, ..test_config(1024) });
            let mut address_of = Vec::new();
            for i in order {
                let pod = r.add_pod(Role::Both, true);
                r.set_pod_key(pod, &addresses[i]);
                address_of.push(addresses[i].clone());
            }
            (r, address_of)
        };
        let (mut a, a_address) = replica(&mut (0..6), 1);
        let (mut b, b_address) = replica(&mut (0..6).rev(), 2);
        let mut used = std::collections::HashSet::new();
        for seed in 0..40 {
            let c = chain(seed, 320);
            let pick = |r: &mut Router| r.route(&RouteRequest::new("x", &c, 320, None), 0.0).unwrap().decode.pod;
            let (on_a, on_b) = (pick(&mut a), pick(&mut b));
            assert_eq!(a_address[on_a.index()], b_address[on_b.index()], "prefix {seed}");
            used.insert(a_address[on_a.index()].clone());
            // Idle again for the next prefix.
            for r in [&mut a, &mut b] {
                r.report("x", Lifecycle::Done, false, 0.0).unwrap();
            }
        }
        assert_eq!(used.len(), 6, "40 prefixes over 6 pods use them all");
    }

    #[test]
    fn a_booking_follows_the_pod_that_served() {
        let mut r = router(1024);
        let pods = [r.add_pod(Role::Both, true), r.add_pod(Role::Both, true)];
        let c = chain(7, 320);
        let first = r.route(&RouteRequest::new("a", &c, 320, Some(4)), 0.0).unwrap();
        let other = if first.decode.pod == pods[0] { pods[1] } else { pods[0] };
        assert_eq!(r.served("a", first.decode.pod, 0.1), Ok(None), "served where booked: nothing moves");
        assert_eq!(r.served("a", other, 0.1), Ok(Some(first.decode.pod)));
        assert_eq!(r.load().load(first.decode.pod, 0.1), crate::load::PodLoad::default());
        let moved = r.load().load(other, 0.1);
        assert_eq!((moved.inflight_requests, moved.queued_prefill_tokens), (1, 320));
        // The prefix is being computed where it was served: the next request follows it there.
        assert_eq!(r.route(&RouteRequest::new("b", &c, 320, Some(4)), 0.3).unwrap().decode.pod, other);
        assert!(r.served("zzz", other, 0.3).is_err());
    }

    #[test]
    fn saturated_pods_are_skipped_and_a_saturated_fleet_makes_the_request_wait() {
        let mut r = Router::new(&RouterConfig {
            admission: Some(Admission { max_queued_prefill_tokens: Some(1000), ..Admission::default() }),
            ..test_config(1024)
        });
        let pods = [r.add_pod(Role::Both, false), r.add_pod(Role::Both, false)];
        let c = |seed| chain(seed, 640);
        let first = r.route(&RouteRequest::new("a", &c(1), 640, None), 0.0).unwrap().decode.pod;
        let second = r.route(&RouteRequest::new("b", &c(2), 640, None), 0.0).unwrap().decode.pod;
        assert_ne!(first, second, "640 queued is below the limit, but the policy spreads");
        // Both pods now queue 640 tokens; one more each reaches 1280 ≥ 1000.
        let third = r.route(&RouteRequest::new("c", &c(3), 640, None), 0.0).unwrap().decode.pod;
        let fourth = r.route(&RouteRequest::new("d", &c(4), 640, None), 0.0).unwrap().decode.pod;
        assert_ne!(third, fourth, "a pod with room is chosen over a saturated one");
        assert_eq!(r.route(&RouteRequest::new("e", &c(5), 640, None), 0.0).unwrap_err(), Unroutable::Saturated);
        // A first token frees prefill room on its pod.
        r.report("a", Lifecycle::FirstToken, false, 1.0).unwrap();
        assert_eq!(r.route(&RouteRequest::new("e", &c(5), 640, None), 1.0).unwrap().decode.pod, first);
        assert!(pods.contains(&first));
    }

    #[test]
    fn replicas_sharing_bookings_see_each_others_requests_in_flight() {
        let replica = || {
            let mut r = router(256);
            r.add_pod(Role::Prefill, false);
            r.add_pod(Role::Both, false);
            r.add_pod(Role::Both, false);
            r.share_bookings();
            r
        };
        let (mut a, mut b) = (replica(), replica());
        let from_a = Origin(1);
        let long = chain(11, 512);
        let first = a.route(&RouteRequest::new("r1", &long, 512, Some(8)), 0.0).unwrap();
        let prefill = first.prefill.expect("512 uncached tokens disaggregate").pod;
        for update in a.take_shared() {
            b.apply_shared(from_a, &update, 0.1).unwrap();
        }
        assert!(a.take_shared().is_empty(), "taken once");
        let seen = |r: &Router, pod| r.load().load(pod, 0.1).inflight_requests;
        assert_eq!((seen(&b, prefill), seen(&b, first.decode.pod)), (1, 1), "both legs of a's request");
        // b's own request with the same id is another booking; the prefix a sent is cached
        // (approximate index) where a sent it.
        let again = b.route(&RouteRequest::new("r1", &long, 512, Some(8)), 0.2).unwrap();
        assert_eq!((again.prefill, again.decode.pod), (None, first.decode.pod));
        assert_eq!(again.cached_tokens(), 496, "all but the block of its last token");
        assert_eq!(seen(&b, first.decode.pod), 2);

        // a's lifecycle follows: prefill done, then done.
        a.report("r1", Lifecycle::Done, true, 0.3).unwrap();
        a.report("r1", Lifecycle::Done, false, 0.4).unwrap();
        let reports = a.take_shared();
        assert_eq!(reports.len(), 2);
        for update in &reports {
            b.apply_shared(from_a, update, 0.4).unwrap();
        }
        assert_eq!((seen(&b, prefill), seen(&b, first.decode.pod)), (0, 1), "only b's own is left");
        assert!(b.apply_shared(from_a, &reports[1], 0.5).is_err(), "a repeated done names nothing");

        // A booking moved by the proxy moves on the other replica too.
        let other = |p: PodId| if p == PodId(1) { PodId(2) } else { PodId(1) };
        let short = chain(12, 64);
        let routed = a.route(&RouteRequest::new("r2", &short, 64, None), 1.0).unwrap().decode.pod;
        a.served("r2", other(routed), 1.1).unwrap();
        for update in a.take_shared() {
            b.apply_shared(from_a, &update, 1.1).unwrap();
        }
        assert_eq!(seen(&b, other(routed)), 1 + u32::from(other(routed) == first.decode.pod));

        // A replica that joins rebuilds a's bookings from a snapshot; one that loses a
        // forgets them.
        let mut c = replica();
        a.report("r2", Lifecycle::FirstToken, false, 1.2).unwrap();
        for update in a.snapshot() {
            c.apply_shared(from_a, &update, 1.3).unwrap();
        }
        let on = |r: &Router, pod| {
            let l = r.load().load(pod, 1.3);
            (l.inflight_requests, l.queued_prefill_tokens)
        };
        assert_eq!(on(&c, other(routed)), on(&a, other(routed)));
        assert_eq!(on(&c, other(routed)).1, 0, "past its first token: no prefill queued");
        assert_eq!(b.clear_origin(from_a), 1);
        assert_eq!(seen(&b, other(routed)), u32::from(other(routed) == first.decode.pod));
    }

    #[test]
    fn headroom_is_kept_for_higher_priorities() {
        let mut r = Router::new(&RouterConfig {
            admission: Some(Admission { max_inflight_requests: Some(4), headroom: 0.5, ..Admission::default() }),
            ..test_config(1024)
        });
        r.add_pod(Role::Both, false);
        let c = chain(9, 64);
        let ordinary = |id| RouteRequest { leave_headroom: true, ..RouteRequest::new(id, &c, 64, None) };
        r.route(&ordinary("a"), 0.0).unwrap();
        r.route(&ordinary("b"), 0.0).unwrap();
        assert_eq!(r.route(&ordinary("c"), 0.0).unwrap_err(), Unroutable::Saturated, "half the pod is kept");
        r.route(&RouteRequest::new("p1", &c, 64, None), 0.0).unwrap();
        r.route(&RouteRequest::new("p2", &c, 64, None), 0.0).unwrap();
        assert_eq!(r.route(&RouteRequest::new("p3", &c, 64, None), 0.0).unwrap_err(), Unroutable::Saturated);
    }
}
