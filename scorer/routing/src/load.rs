//! Predicted load: what kvgate itself sent to each pod and has not seen finish.
//!
//! Metrics scraped from pods lag by a scrape interval; a burst of requests decided within
//! that interval would all see the same idle pod. So the scorer books every decision at once:
//!
//! - **prefill**: the request's uncached prompt tokens and their attention work (the
//!   trapezoid `(cached+1+prompt)·(prompt−cached)/2`), released at its first token;
//! - **decode**: the KV blocks the request will hold — its prompt blocks, counted once per
//!   pod however many in-flight requests share them, plus its expected output blocks
//!   (`max_tokens`, or a default), whose weight decays as the request is estimated to
//!   generate them after its first token — freed at `done` or `cancelled`.
//!
//! A booking whose lifecycle reports never arrive expires after a TTL, so nothing leaks.
//! Time is a number of seconds supplied by the caller (no clock here).
//!
//! Bookings are keyed by [`BookingKey`]: the request, the leg of it booked (a disaggregated
//! request holds its prefill pod too) and the gateway replica that made it — replicas that
//! share their bookings apply each other's beside their own.

use crate::adapters::{AdapterId, AdapterLoad};
use crate::hash::SequenceHash;
use crate::pod_set::{PodId, PodMap};
use crate::speed::{PodSpeeds, Prefill, SpeedConfig, SpeedView};
use crate::validate::{Invalid, check, non_negative, positive};
use ahash::{AHashMap, AHashSet};
use serde::Deserialize;
use smart_default::SmartDefault;
use std::collections::VecDeque;
use std::sync::Arc;

/// In-flight bookkeeping (`load`).
#[derive(Clone, Debug, Deserialize, PartialEq, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    /// Expected completion tokens of a request without `max_tokens`.
    #[default(256)]
    pub default_output_tokens: u32,
    /// Estimated decode speed of one sequence (tokens/s), to decay expected output over time.
    #[default(50.0)]
    pub decode_tokens_per_second: f64,
    /// A booking without a `done` report is dropped after this long.
    #[default(600.0)]
    pub request_ttl_seconds: f64,
    /// Bookings at least this old that a pod's engine does not account for (its scraped
    /// running + waiting requests are fewer) are dropped, oldest first: their end was never
    /// reported (a lifecycle batch lost while the scorer was frozen, a gateway replica
    /// gone). 0 turns this off (then only `request_ttl_seconds` drops them).
    #[default(10.0)]
    pub reconcile_after_seconds: f64,
    /// Learning each pod's prefill speed from the first tokens it reports, so that pods
    /// of different speeds are compared in predicted seconds (`learn: false` to compare
    /// them in tokens of work alone), and its decode speed from the output tokens reported.
    pub pod_speed: SpeedConfig,
    /// Plan a request's output as its `max_tokens` times the share of their `max_tokens`
    /// that finished requests used (learned from the output tokens their `done` reports
    /// carry; all of it until reports come). Clients that ask for far more than they get —
    /// a 2,048-token cap on 150-token answers — otherwise make every pod look full of
    /// decodes to come. `false`: plan the whole `max_tokens`.
    #[default(true)]
    pub learn_output_share: bool,
    /// How long the blocks of a prompt routed to a pod count as its recent traffic: a pod
    /// whose recent traffic needs more blocks than its KV cache holds evicts what that
    /// traffic comes back for (see the `kv` policy's `overcommit_share`). Counted over the
    /// last half of this window to the whole of it.
    #[default(30.0)]
    pub recent_window_seconds: f64,
    /// How long the prompt blocks of a request that ended are still credited on its pod:
    /// the engine holds them (computed, then kept in its prefix cache) before its KV events
    /// may have said so, and a follow-up sent at once would otherwise find them uncredited.
    /// An eviction on the pod, or a reset of its cache, ends this credit at once. 0 = off.
    #[default(1.0)]
    pub finished_credit_seconds: f64,
}

impl LoadConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        check(positive(self.decode_tokens_per_second), "decode_tokens_per_second", "must be positive")?;
        let reconcile = self.reconcile_after_seconds;
        check(non_negative(reconcile), "reconcile_after_seconds", "must be >= 0 (0: off)")?;
        check(positive(self.request_ttl_seconds), "request_ttl_seconds", "must be positive")?;
        check(positive(self.recent_window_seconds), "recent_window_seconds", "must be positive")?;
        check(non_negative(self.finished_credit_seconds), "finished_credit_seconds", "must be >= 0 (0: off)")?;
        self.pod_speed.validate().map_err(|e| e.under("pod_speed"))
    }
}

/// The trapezoid estimate of prefill attention work for `prompt` tokens with `cached`
/// already cached: Σ over new positions of their context length.
pub fn prefill_work(prompt: u64, cached: u64) -> f64 {
    let cached = cached.min(prompt);
    (cached + 1 + prompt) as f64 * (prompt - cached) as f64 / 2.0
}

/// The gateway replica that made a booking: [`Origin::LOCAL`] for this one, others numbered
/// by whoever applies their bookings (their request ids may collide with ours).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin(pub u32);

impl Origin {
    pub const LOCAL: Origin = Origin(0);
}

/// Which part of a request a booking holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Leg {
    /// The request itself, on the pod that serves it (decodes it, when disaggregated).
    Serve,
    /// The prefill leg of a disaggregated request, on its prefill pod.
    Prefill,
}

/// What a booking is filed under.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BookingKey {
    pub origin: Origin,
    pub leg: Leg,
    pub request: Box<str>,
}

impl BookingKey {
    /// This replica's booking of `request`'s `leg`.
    pub fn local(request: &str, leg: Leg) -> Self {
        Self { origin: Origin::LOCAL, leg, request: request.into() }
    }
}

/// One change to a replica's in-flight bookings, as the other replicas apply it: what
/// sharing bookings between gateway replicas sends (`Router::share_bookings`). Pods are this
/// process's ids; whoever carries an update between processes names them portably.
#[derive(Clone, Debug, PartialEq)]
pub enum BookingUpdate {
    Booked {
        request: Box<str>,
        leg: Leg,
        /// Its chain shared with the booking it describes (no copy per decision).
        booking: Booking<Arc<[SequenceHash]>>,
    },
    Reported {
        request: Box<str>,
        leg: Leg,
        event: Lifecycle,
    },
    /// The proxy served the request elsewhere than the pick; `cached_tokens` there.
    Moved {
        request: Box<str>,
        leg: Leg,
        pod: PodId,
        cached_tokens: u32,
    },
}

/// One decision to book, its prompt's blocks in `C`: borrowed while it is decided
/// (`&[SequenceHash]`), shared once booked (`Arc<[SequenceHash]>`, as replicas exchange it).
#[derive(Clone, Debug, PartialEq)]
pub struct Booking<C> {
    pub pod: PodId,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// The request's full prompt blocks (shared ones count once per pod).
    pub chain: C,
    /// `max_tokens` of the request, if it gave one.
    pub max_output_tokens: Option<u32>,
    /// The LoRA adapter it asks for.
    pub adapter: Option<AdapterId>,
}

impl<C> Booking<C> {
    /// The same booking, its blocks held in `chain`.
    pub fn with_chain<D>(&self, chain: D) -> Booking<D> {
        Booking {
            pod: self.pod,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            chain,
            max_output_tokens: self.max_output_tokens,
            adapter: self.adapter,
        }
    }
}

/// Load of one pod as the policies see it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PodLoad {
    pub inflight_requests: u32,
    /// Uncached prompt tokens of requests not yet at their first token.
    pub queued_prefill_tokens: u64,
    /// Their trapezoid prefill work.
    pub queued_prefill_work: f64,
    /// Predicted KV blocks held by in-flight requests (decaying output part included).
    pub decode_blocks: f64,
    /// Blocks each decode step reads, summed over in-flight sequences: a prefix shared by
    /// ten sequences is held once but read ten times (decode step time grows with it).
    pub decode_read_blocks: f64,
}

impl PodLoad {
    /// Blocks past `capacity` (the pod's `num_gpu_blocks`; 0 = unknown, then none) that its
    /// requests in flight would hold with `new_blocks` more: vLLM admits a request only when
    /// its blocks fit, so past capacity it waits for others to finish.
    pub fn blocks_past_capacity(&self, new_blocks: f64, capacity: f64) -> f64 {
        if capacity > 0.0 { (self.decode_blocks + new_blocks - capacity).max(0.0) } else { 0.0 }
    }
}

#[derive(Debug)]
struct Inflight {
    pod: PodId,
    prompt_tokens: u32,
    prefill_tokens: u64,
    prefill_work: f64,
    /// Blocks of the prompt, refcounted in the pod's shared map.
    prompt_blocks: Arc<[SequenceHash]>,
    /// Prompt tokens beyond the last full block (their partial block is private).
    partial_block: bool,
    /// The `max_tokens` it asked for, or the default output.
    output_tokens: u32,
    /// It asked for `output_tokens`: planned as that times the learned share.
    asked: bool,
    first_token_at: Option<f64>,
    adapter: Option<AdapterId>,
    booked_at: f64,
    /// Requests in flight on its pod when it was booked (besides it): the sequences its
    /// prefill shares the engine's steps with.
    booked_beside: u32,
    /// Booked past its pod's KV capacity ([`LoadTracker::past_capacity`]): its first token
    /// waits for room, so it teaches nothing of the pod's speed.
    booked_past_capacity: bool,
    expires_at: f64,
    /// Where the request sits in its pod's `inflight` and `decode` lists.
    slot: usize,
}

/// What [`LoadTracker::load`] reads of a request in flight, kept in its pod's state beside
/// its key, so that a pod's load is summed over one contiguous list (no lookup per request).
#[derive(Clone, Copy)]
struct DecodeTerm {
    /// As its request's: asked (then scaled by the learned share) or the default.
    output_tokens: u32,
    asked: bool,
    first_token_at: Option<f64>,
    /// Prompt blocks, the partial one included.
    prompt_blocks: u32,
}

#[derive(Default)]
struct PodState {
    /// The pod's requests in flight; `decode[i]` is `inflight[i]`'s.
    inflight: Vec<BookingKey>,
    decode: Vec<DecodeTerm>,
    queued_prefill_tokens: u64,
    queued_prefill_work: f64,
    shared_blocks: AHashMap<SequenceHash, u32>,
    /// Blocks of requests in flight that the engine evicted since they were booked (kept
    /// while a request in flight holds them).
    evicted_blocks: AHashSet<SequenceHash>,
    private_blocks: u64,
    /// Prompt blocks of requests that ended here lately, until when each is credited
    /// (`finished_credit_seconds`), and those prompts in the order they ended.
    finished_blocks: AHashMap<SequenceHash, f64>,
    finished: VecDeque<(f64, Arc<[SequenceHash]>)>,
    /// KV blocks the engine has (`num_gpu_blocks` from its metrics), 0 while unknown.
    kv_capacity_blocks: f64,
}

impl PodState {
    /// A request that ended here left `prompt` in the engine's cache: credited until `until`.
    fn finished(&mut self, prompt: Arc<[SequenceHash]>, until: f64) {
        self.finished_blocks.extend(prompt.iter().map(|&h| (h, until)));
        self.finished.push_back((until, prompt));
    }

    /// Ends the credit of ended requests' prompts due by `now` (a block another prompt
    /// ended with later keeps that one's).
    fn expire_finished(&mut self, now: f64) {
        while let Some((until, _)) = self.finished.front()
            && *until <= now
        {
            let (_, prompt) = self.finished.pop_front().expect("front exists");
            for h in prompt.iter() {
                if self.finished_blocks.get(h).is_some_and(|&u| u <= now) {
                    self.finished_blocks.remove(h);
                }
            }
        }
    }

    fn forget_finished(&mut self) {
        self.finished_blocks.clear();
        self.finished.clear();
    }
}

impl Inflight {
    /// Prompt tokens it was booked with as cached on its pod.
    fn credited_tokens(&self) -> u32 {
        self.prompt_tokens - self.prefill_tokens.min(u64::from(self.prompt_tokens)) as u32
    }

    /// Whether the engine of its pod (`state`) evicted a block of its credited prefix since
    /// the booking.
    fn credit_evicted(&self, state: Option<&PodState>, block_size: usize) -> bool {
        self.evicted_among(state, (self.credited_tokens() as usize).div_ceil(block_size))
    }

    /// Whether the engine of its pod (`state`) evicted one of its first `blocks` prompt
    /// blocks since the booking.
    fn evicted_among(&self, state: Option<&PodState>, blocks: usize) -> bool {
        let mut leading = self.prompt_blocks.iter().take(blocks);
        state.is_some_and(|p| !p.evicted_blocks.is_empty() && leading.any(|b| p.evicted_blocks.contains(b)))
    }

    /// The prefill still to compute when `cached` of the prompt's tokens are cached.
    fn set_cached(&mut self, cached: u32) {
        let prompt = u64::from(self.prompt_tokens);
        let cached = u64::from(cached).min(prompt);
        self.prefill_tokens = prompt - cached;
        self.prefill_work = prefill_work(prompt, cached);
    }
}

/// Leading blocks of `chain` in `blocks`. Every booking (and every ended request's prompt)
/// holds its whole chain from the first block, and a block's hash names its whole prefix, so
/// the blocks held of any chain are a prefix of it: the first block not held is found by
/// bisection, not by walking the chain.
fn leading_blocks<V>(blocks: &AHashMap<SequenceHash, V>, chain: &[SequenceHash]) -> usize {
    if blocks.is_empty() { 0 } else { chain.partition_point(|h| blocks.contains_key(h)) }
}

/// The cache a booking was credited with ([`LoadTracker::booked_credit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credit {
    pub pod: PodId,
    /// Prompt tokens credited as cached on `pod`.
    pub tokens: u32,
    pub prompt_tokens: u32,
    /// The engine evicted a credited block after the booking.
    pub evicted: bool,
}

/// Lifecycle reports from the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    FirstToken,
    Done,
    Cancelled,
}

/// The in-flight bookkeeping for all pods.
pub struct LoadTracker {
    block_size: usize,
    config: LoadConfig,
    pods: PodMap<PodState>,
    requests: AHashMap<BookingKey, Inflight>,
    /// Bookings dropped with their pod (it went down while they were in flight): their
    /// pod and expiry. Their proxies still report their end; those reports are theirs, not
    /// unknown.
    ended_with_pod: AHashMap<BookingKey, (PodId, f64)>,
    speeds: PodSpeeds,
    output_share: OutputShare,
    expired: u64,
}

/// How much of their `max_tokens` finished requests used: a running mean of their shares
/// (each report weighs 1/20; bias-corrected, so the first reports count in full rather than
/// against a guess), all of it before any report. Requests in flight are planned with the
/// share as it is when their load is read, so a booking made before the first reports is
/// re-planned as they come.
#[derive(Clone, Copy, Debug)]
struct OutputShare {
    /// The mean from zero, and the weight zero still has in it.
    sum: f64,
    unseen: f64,
}

impl OutputShare {
    const WEIGHT: f64 = 0.05;

    fn new() -> Self {
        Self { sum: 0.0, unseen: 1.0 }
    }

    fn learn(&mut self, used: u32, asked: u32) {
        if asked > 0 {
            let share = (f64::from(used) / f64::from(asked)).min(1.0);
            self.sum += Self::WEIGHT * (share - self.sum);
            self.unseen *= 1.0 - Self::WEIGHT;
        }
    }

    fn share(&self) -> f64 {
        if self.unseen >= 1.0 { 1.0 } else { (self.sum / (1.0 - self.unseen)).min(1.0) }
    }
}

/// A request's planned output: `output_tokens` as it asked them (then times `share`) or as the
/// default.
fn planned(output_tokens: u32, asked: bool, share: f64) -> f64 {
    f64::from(output_tokens) * if asked { share } else { 1.0 }
}

/// Reports that named no known request (late, duplicate, or after expiry).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("no in-flight request {0}")]
pub struct UnknownRequest(pub String);

impl UnknownRequest {
    fn of(key: &BookingKey) -> Self {
        Self(key.request.to_string())
    }
}

impl LoadTracker {
    pub fn new(block_size: usize, config: LoadConfig) -> Self {
        let speeds = PodSpeeds::new(config.pod_speed);
        let output_share = OutputShare::new();
        Self {
            block_size,
            config,
            pods: PodMap::default(),
            requests: AHashMap::new(),
            ended_with_pod: AHashMap::new(),
            speeds,
            output_share,
            expired: 0,
        }
    }

    /// Books a decision under `key` at time `now`; returns the chain it keeps. A key already
    /// in flight is released first (a retried request replaces its earlier booking).
    pub fn book<C: AsRef<[SequenceHash]>>(
        &mut self,
        key: &BookingKey,
        booking: &Booking<C>,
        now: f64,
    ) -> Arc<[SequenceHash]> {
        self.release(key);
        self.ended_with_pod.remove(key);
        let output = booking.max_output_tokens.unwrap_or(self.config.default_output_tokens);
        let partial_block = !(booking.prompt_tokens as usize).is_multiple_of(self.block_size);
        let mut req = Inflight {
            pod: booking.pod,
            prompt_tokens: booking.prompt_tokens,
            prefill_tokens: 0,
            prefill_work: 0.0,
            prompt_blocks: booking.chain.as_ref().into(),
            partial_block,
            output_tokens: output,
            asked: booking.max_output_tokens.is_some(),
            first_token_at: None,
            adapter: booking.adapter,
            booked_at: now,
            booked_beside: self.inflight_on(booking.pod),
            booked_past_capacity: self.past_capacity(
                booking.pod,
                booking.prompt_tokens.saturating_sub(booking.cached_tokens),
                now,
            ),
            expires_at: now + self.config.request_ttl_seconds,
            slot: 0,
        };
        req.set_cached(booking.cached_tokens);
        let chain = req.prompt_blocks.clone();
        self.insert(key.clone(), req);
        chain
    }

    /// Moves a booking to the pod that actually serves the request (the proxy retried
    /// elsewhere), where `cached_tokens` of its prompt are cached; its progress is kept.
    /// Returns the pod it was booked on.
    pub fn rebook(&mut self, key: &BookingKey, pod: PodId, cached_tokens: u32) -> Result<PodId, UnknownRequest> {
        let (id, mut req) = self.remove(key).ok_or_else(|| UnknownRequest::of(key))?;
        let from = req.pod;
        req.pod = pod;
        req.booked_beside = self.inflight_on(pod);
        req.set_cached(cached_tokens);
        req.booked_past_capacity = self.past_capacity(pod, req.prefill_tokens as u32, req.booked_at);
        self.insert(id, req);
        Ok(from)
    }

    /// `pod`'s engine has `blocks` KV blocks (`num_gpu_blocks` from its metrics; 0 = unknown),
    /// until [`Self::clear_pod`] (a pod that comes back reports it again).
    pub fn set_kv_capacity(&mut self, pod: PodId, blocks: f64) {
        self.pods.get_mut(pod).kv_capacity_blocks = blocks.max(0.0);
    }

    /// Whether a request with `uncached_tokens` to compute, booked on `pod` now, waits for KV
    /// room ([`PodLoad::blocks_past_capacity`], as the `kv` policy's overflow charge); false
    /// while the pod's capacity is unknown.
    fn past_capacity(&self, pod: PodId, uncached_tokens: u32, now: f64) -> bool {
        let capacity = self.pods.get(pod).map_or(0.0, |p| p.kv_capacity_blocks);
        capacity > 0.0
            && self.load(pod, now).blocks_past_capacity(f64::from(uncached_tokens) / self.block_size as f64, capacity)
                > 0.0
    }

    /// Tokens per KV block from now on (learned from the engines): requests in flight keep
    /// the blocks they were booked with.
    pub fn set_block_size(&mut self, block_size: usize) {
        self.block_size = block_size;
    }

    /// The engine of `pod` evicted `block`: noted if a request in flight there holds it. If
    /// a request that ended there lately left it, the credit of every such request there
    /// ends: a cache evicting that soon may be evicting the rest of them.
    pub fn evicted(&mut self, pod: PodId, block: SequenceHash) {
        let Some(state) = self.pods.get(pod) else { return };
        let (inflight, finished) =
            (state.shared_blocks.contains_key(&block), state.finished_blocks.contains_key(&block));
        if inflight || finished {
            let state = self.pods.get_mut(pod);
            if inflight {
                state.evicted_blocks.insert(block);
            }
            if finished {
                state.forget_finished();
            }
        }
    }

    /// The pod's cache can no longer be trusted (its index was cleared): what requests that
    /// ended there left is not credited either.
    pub fn forget_finished(&mut self, pod: PodId) {
        if self.pods.get(pod).is_some() {
            self.pods.get_mut(pod).forget_finished();
        }
    }

    /// What a request was booked with: its pod, the prompt tokens credited as cached there,
    /// and whether the engine has evicted any block of that credit since.
    pub fn booked_credit(&self, key: &BookingKey) -> Option<Credit> {
        let r = self.requests.get(key)?;
        let evicted = r.credit_evicted(self.pods.get(r.pod), self.block_size);
        Some(Credit { pod: r.pod, tokens: r.credited_tokens(), evicted, prompt_tokens: r.prompt_tokens })
    }

    /// The prompt blocks (shared, not copied) and size of a booked request.
    pub fn booked_prompt(&self, key: &BookingKey) -> Option<(Arc<[SequenceHash]>, u32)> {
        self.requests.get(key).map(|r| (r.prompt_blocks.clone(), r.prompt_tokens))
    }

    /// The LoRA adapter a booked request asks for.
    pub fn booked_adapter(&self, key: &BookingKey) -> Option<AdapterId> {
        self.requests.get(key).and_then(|r| r.adapter)
    }

    /// Adds a request's load to its pod.
    fn insert(&mut self, key: BookingKey, mut req: Inflight) {
        let pod = self.pods.get_mut(req.pod);
        if req.first_token_at.is_none() {
            pod.queued_prefill_tokens += req.prefill_tokens;
            pod.queued_prefill_work += req.prefill_work;
        }
        for h in req.prompt_blocks.iter() {
            *pod.shared_blocks.entry(*h).or_insert(0) += 1;
        }
        pod.private_blocks += u64::from(req.partial_block);
        req.slot = pod.inflight.len();
        pod.inflight.push(key.clone());
        pod.decode.push(DecodeTerm {
            output_tokens: req.output_tokens,
            asked: req.asked,
            first_token_at: req.first_token_at,
            prompt_blocks: (req.prompt_blocks.len() + usize::from(req.partial_block)) as u32,
        });
        self.requests.insert(key, req);
    }

    /// Leading blocks of `chain` that requests in flight on `pod` hold: blocks being
    /// computed there now, which a request routed there next will find cached (its own
    /// prefill is queued behind theirs) before any KV event has announced them.
    pub fn inflight_prefix(&self, pod: PodId, chain: &[SequenceHash]) -> usize {
        self.pods.get(pod).map_or(0, |p| leading_blocks(&p.shared_blocks, chain))
    }

    /// Leading blocks of `chain` that requests ended on `pod` lately left in its cache
    /// (`finished_credit_seconds`). Found by bisection (`leading_blocks`): an
    /// eviction ends every such credit on the pod, so none leaves a hole in a chain.
    pub fn finished_prefix(&self, pod: PodId, chain: &[SequenceHash]) -> usize {
        self.pods.get(pod).map_or(0, |p| leading_blocks(&p.finished_blocks, chain))
    }

    /// Requests in flight on `pod` whose prompts hold `block`.
    pub fn inflight_sharing(&self, pod: PodId, block: SequenceHash) -> u32 {
        self.pods.get(pod).and_then(|p| p.shared_blocks.get(&block)).copied().unwrap_or(0)
    }

    /// Applies a lifecycle report.
    pub fn report(&mut self, key: &BookingKey, event: Lifecycle, now: f64) -> Result<PodId, UnknownRequest> {
        let Some(req) = self.requests.get_mut(key) else {
            let Some(&(pod, _)) = self.ended_with_pod.get(key) else {
                return Err(UnknownRequest::of(key));
            };
            if event != Lifecycle::FirstToken {
                self.ended_with_pod.remove(key);
            }
            return Ok(pod);
        };
        let pod = req.pod;
        // The end of the pod's prefill: the first token, or a prefill leg done.
        let prefilled = match event {
            Lifecycle::FirstToken => true,
            Lifecycle::Done => key.leg == Leg::Prefill,
            Lifecycle::Cancelled => false,
        };
        if prefilled && req.first_token_at.is_none() {
            let prefill = Prefill {
                booked_at: req.booked_at,
                tokens: req.prefill_tokens,
                beside: req.booked_beside,
                // The engine evicted part of the cache it was booked with: its prefill
                // computed more than it was booked for.
                credit_evicted: req.credit_evicted(self.pods.get(pod), self.block_size),
                past_capacity: req.booked_past_capacity,
            };
            self.speeds.prefill_done(pod, prefill, now);
        }
        match event {
            Lifecycle::FirstToken => {
                if req.first_token_at.is_none() {
                    req.first_token_at = Some(now);
                    let state = self.pods.get_mut(pod);
                    state.decode[req.slot].first_token_at = Some(now);
                    state.queued_prefill_tokens -= req.prefill_tokens;
                    state.queued_prefill_work -= req.prefill_work;
                }
            }
            Lifecycle::Done => self.finish(key, now),
            Lifecycle::Cancelled => self.release(key),
        }
        Ok(pod)
    }

    /// A request finished with `output_tokens` (its usage): its pod's decode speed learns
    /// from it (call before its `done`).
    pub fn decoded(&mut self, key: &BookingKey, output_tokens: u32, now: f64) {
        let Some(req) = self.requests.get(key) else { return };
        if let Some(first_token_at) = req.first_token_at {
            self.speeds.decode_done(req.pod, first_token_at, output_tokens, now);
        }
        if req.asked {
            self.output_share.learn(output_tokens, req.output_tokens);
        }
    }

    /// The share of its `max_tokens` a request is planned to use.
    fn planned_share(&self) -> f64 {
        if self.config.learn_output_share { self.output_share.share() } else { 1.0 }
    }

    /// The output tokens a request asking for `asked` (`None`: no `max_tokens`, the
    /// default) is planned with: what it asked times the share finished requests used.
    pub fn planned_output(&self, asked: Option<u32>) -> f64 {
        let output = asked.unwrap_or(self.config.default_output_tokens);
        planned(output, asked.is_some(), self.planned_share())
    }

    fn release(&mut self, key: &BookingKey) {
        self.remove(key);
    }

    /// A request ended whole: its load is released, and its prompt stays credited on its
    /// pod for `finished_credit_seconds` (its engine's events may not have announced it yet).
    /// A prompt the engine evicted a block of while it ran (the eviction reached kvgate
    /// before the request's end) is not credited.
    fn finish(&mut self, key: &BookingKey, now: f64) {
        let evicted = self.requests.get(key).is_some_and(|r| r.evicted_among(self.pods.get(r.pod), usize::MAX));
        let Some((_, req)) = self.remove(key) else { return };
        let credit = self.config.finished_credit_seconds;
        let pod = self.pods.get_mut(req.pod);
        pod.expire_finished(now);
        if credit > 0.0 && !evicted && !req.prompt_blocks.is_empty() {
            pod.finished(req.prompt_blocks, now + credit);
        }
    }

    /// Takes a request's load off its pod and returns it.
    fn remove(&mut self, key: &BookingKey) -> Option<(BookingKey, Inflight)> {
        let (id, req) = self.requests.remove_entry(key)?;
        let pod = self.pods.get_mut(req.pod);
        if req.first_token_at.is_none() {
            pod.queued_prefill_tokens -= req.prefill_tokens;
            pod.queued_prefill_work -= req.prefill_work;
        }
        for h in req.prompt_blocks.iter() {
            if let Some(n) = pod.shared_blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    pod.shared_blocks.remove(h);
                    pod.evicted_blocks.remove(h);
                }
            }
        }
        pod.private_blocks -= u64::from(req.partial_block);
        pod.inflight.swap_remove(req.slot);
        pod.decode.swap_remove(req.slot);
        if let Some(moved) = pod.inflight.get(req.slot) {
            self.requests.get_mut(moved).expect("a pod's requests are all booked").slot = req.slot;
        }
        if pod.inflight.is_empty() {
            // Float sums drift; an idle pod is exactly idle.
            pod.queued_prefill_work = 0.0;
        }
        Some((id, req))
    }

    /// Drops bookings older than the TTL; returns how many.
    pub fn expire(&mut self, now: f64) -> usize {
        let stale: Vec<BookingKey> =
            self.requests.iter().filter(|(_, r)| r.expires_at <= now).map(|(id, _)| id.clone()).collect();
        for id in &stale {
            self.release(id);
        }
        self.ended_with_pod.retain(|_, &mut (_, expires_at)| expires_at > now);
        self.pods.values_mut().for_each(|p| p.expire_finished(now));
        self.expired += stale.len() as u64;
        stale.len()
    }

    /// The pod's engine holds `engine_requests` requests (running + waiting): of its bookings
    /// made before `booked_before`, those beyond that many cannot all be real — their end
    /// was never reported. The oldest of them are dropped; returns how many.
    pub fn reconcile(&mut self, pod: PodId, engine_requests: u32, booked_before: f64) -> usize {
        let old = |id: &BookingKey| self.requests.get(id).filter(|r| r.booked_at < booked_before).map(|r| r.booked_at);
        let Some(inflight) = self.pods.get(pod).map(|p| &p.inflight) else { return 0 };
        let count = inflight.iter().filter(|id| old(id).is_some()).count();
        let Some(excess) = count.checked_sub(engine_requests as usize).filter(|&n| n > 0) else { return 0 };
        let mut oldest: Vec<(f64, BookingKey)> =
            inflight.iter().filter_map(|id| Some((old(id)?, id.clone()))).collect();
        oldest.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, id) in &oldest[..excess] {
            self.release(id);
        }
        excess
    }

    /// Drops every booking of a pod (it died or left); their ends, still to be reported,
    /// are recognised until they would have expired.
    pub fn clear_pod(&mut self, pod: PodId) {
        let state = std::mem::take(self.pods.get_mut(pod));
        for id in state.inflight {
            if let Some(req) = self.requests.remove(&id) {
                self.ended_with_pod.insert(id, (pod, req.expires_at));
            }
        }
    }

    /// Drops every booking another replica made (it left, or its bookings are about to be
    /// replaced by a snapshot of them); returns how many.
    pub fn clear_origin(&mut self, origin: Origin) -> usize {
        let theirs: Vec<BookingKey> = self.requests.keys().filter(|k| k.origin == origin).cloned().collect();
        for key in &theirs {
            self.release(key);
        }
        theirs.len()
    }

    /// This replica's bookings as another replica would book them — `(key, booking, first
    /// token seen)` — for a replica that joins or lost track of ours.
    pub fn local_bookings(&self) -> impl Iterator<Item = (&BookingKey, Booking<Arc<[SequenceHash]>>, bool)> {
        self.requests.iter().filter(|(k, _)| k.origin == Origin::LOCAL).map(|(k, r)| {
            let booking = Booking {
                pod: r.pod,
                prompt_tokens: r.prompt_tokens,
                cached_tokens: r.prompt_tokens - r.prefill_tokens as u32,
                chain: r.prompt_blocks.clone(),
                max_output_tokens: r.asked.then_some(r.output_tokens),
                adapter: r.adapter,
            };
            (k, booking, r.first_token_at.is_some())
        })
    }

    /// The pod a request was booked on.
    pub fn pod_of(&self, key: &BookingKey) -> Option<PodId> {
        self.requests.get(key).map(|r| r.pod)
    }

    /// Current predicted load of `pod` at time `now`.
    pub fn load(&self, pod: PodId, now: f64) -> PodLoad {
        let Some(state) = self.pods.get(pod) else { return PodLoad::default() };
        let bs = self.block_size as f64;
        let decode_speed = self.decode_speed(pod);
        let share = self.planned_share();
        let (mut output_blocks, mut read_blocks) = (0.0, 0.0);
        for r in &state.decode {
            let output = planned(r.output_tokens, r.asked, share);
            let generated = r.first_token_at.map_or(0.0, |t| (now - t).max(0.0) * decode_speed);
            output_blocks += (output - generated).max(0.0) / bs;
            read_blocks += f64::from(r.prompt_blocks) + generated.min(output) / bs;
        }
        PodLoad {
            inflight_requests: state.inflight.len() as u32,
            queued_prefill_tokens: state.queued_prefill_tokens,
            queued_prefill_work: state.queued_prefill_work.max(0.0),
            decode_blocks: (state.shared_blocks.len() as u64 + state.private_blocks) as f64 + output_blocks,
            decode_read_blocks: read_blocks,
        }
    }

    /// The adapters of the requests in flight on `pod` ([`AdapterLoad`]: since when, how
    /// many, whether one has its first token, and the seconds until the last is predicted to
    /// finish — expected output left ÷ the pod's decode speed), into `out`.
    pub fn adapters_in_flight(&self, pod: PodId, now: f64, out: &mut Vec<AdapterLoad>) {
        out.clear();
        let Some(state) = self.pods.get(pod) else { return };
        let speed = self.decode_speed(pod);
        // Off the common path (requests for an adapter only): read from the bookings.
        for r in state.inflight.iter().filter_map(|key| self.requests.get(key)) {
            let Some(adapter) = r.adapter else { continue };
            let generated = r.first_token_at.map_or(0.0, |t| (now - t).max(0.0) * speed);
            let output = planned(r.output_tokens, r.asked, self.planned_share());
            let left = (output - generated).max(0.0) / speed;
            let decoding = r.first_token_at.is_some();
            match out.iter_mut().find(|a| a.adapter == adapter) {
                Some(a) => {
                    a.drain_seconds = a.drain_seconds.max(left);
                    a.since = a.since.min(r.booked_at);
                    a.requests += 1;
                    a.decoding |= decoding;
                }
                None => {
                    out.push(AdapterLoad { adapter, since: r.booked_at, drain_seconds: left, requests: 1, decoding })
                }
            }
        }
    }

    /// Seconds a request of the default output length decodes for on `pod`.
    pub fn default_decode_seconds(&self, pod: PodId) -> f64 {
        f64::from(self.config.default_output_tokens) / self.decode_speed(pod)
    }

    /// Seconds a request asking for `max_output_tokens` decodes for (its planned output),
    /// at the fleet's mean learned decode speed.
    pub fn output_seconds(&self, max_output_tokens: Option<u32>) -> f64 {
        let speed = self.speeds.mean_decode_tokens_per_second().unwrap_or(self.config.decode_tokens_per_second);
        self.planned_output(max_output_tokens) / speed
    }

    fn decode_speed(&self, pod: PodId) -> f64 {
        self.speeds.decode_tokens_per_second(pod).unwrap_or(self.config.decode_tokens_per_second)
    }

    /// How much slower than the fleet's average the pod prefills (1 = average; always 1
    /// with learning off). See [`crate::speed`].
    pub fn slowness(&self, pod: PodId) -> f64 {
        self.speeds.slowness(pod)
    }

    /// `pod` is known to take `slowness` times the fleet's average time: learning starts
    /// there ([`PodSpeeds::declare`]).
    pub fn declare_slowness(&mut self, pod: PodId, slowness: f64) {
        self.speeds.declare(pod, slowness);
    }

    /// Predicted seconds for `pod` to work through the prefill booked on it and not yet at
    /// first token (what a request sent there now waits before its own); `None` until the
    /// fleet's prefill speed is learned ([`PodSpeeds::prefill_seconds`]).
    pub fn queued_prefill_seconds(&self, pod: PodId) -> Option<f64> {
        self.prefill_seconds(pod, self.pods.get(pod).map_or(0, |state| state.queued_prefill_tokens))
    }

    /// Predicted seconds for `pod` to prefill `tokens` beside its requests in flight
    /// ([`PodSpeeds::prefill_seconds`]).
    pub fn prefill_seconds(&self, pod: PodId, tokens: u64) -> Option<f64> {
        self.speeds.prefill_seconds(pod, tokens, self.inflight_on(pod))
    }

    /// Tokens of prefill a first token's fixed time is worth at the fleet's average speed
    /// ([`PodSpeeds::fixed_prefill_tokens`]; 0 until learned).
    pub fn fixed_prefill_tokens(&self) -> f64 {
        self.speeds.fixed_prefill_tokens().unwrap_or(0.0)
    }

    /// Requests in flight on `pod`.
    fn inflight_on(&self, pod: PodId) -> u32 {
        self.pods.get(pod).map_or(0, |state| state.inflight.len() as u32)
    }

    /// The pod's learned speed, applied or not.
    pub fn speed(&self, pod: PodId) -> SpeedView {
        self.speeds.view(pod)
    }

    /// Requests in flight on all pods.
    pub fn inflight(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> (LoadTracker, PodId, PodId) {
        let config = LoadConfig {
            default_output_tokens: 8,
            decode_tokens_per_second: 4.0,
            request_ttl_seconds: 60.0,
            ..LoadConfig::default()
        };
        let t = LoadTracker::new(4, config);
        let (a, b) = (PodId(0), PodId(1));
        (t, a, b)
    }

    fn k(request: impl AsRef<str>) -> BookingKey {
        BookingKey::local(request.as_ref(), Leg::Serve)
    }

    /// An 8-token request with nothing cached and no `max_tokens`.
    fn eight_tokens(pod: PodId, chain: &[SequenceHash]) -> Booking<&[SequenceHash]> {
        Booking { pod, prompt_tokens: 8, cached_tokens: 0, chain, max_output_tokens: None, adapter: None }
    }

    fn chain(n: u64) -> Vec<SequenceHash> {
        (0..n).map(SequenceHash).collect()
    }

    #[test]
    fn a_prefill_booked_past_the_pods_kv_capacity_teaches_nothing_of_its_speed() {
        let (mut t, a, b) = tracker();
        let first_token = |t: &mut LoadTracker, key: &BookingKey, at: f64| {
            t.report(key, Lifecycle::FirstToken, at).unwrap();
        };
        // The fleet's fit learns first (pod b, one prefill at a time).
        for i in 0..6 {
            let key = k(format!("b{i}"));
            t.book(&key, &eight_tokens(b, &chain(2)), f64::from(i));
            first_token(&mut t, &key, f64::from(i) + 0.1);
            t.report(&key, Lifecycle::Done, f64::from(i) + 0.2).unwrap();
        }
        t.set_kv_capacity(a, 4.0);
        // 16 tokens (4 blocks) fit an idle pod of 4 blocks: a sample.
        let four = chain(4);
        let holder = Booking { prompt_tokens: 16, ..eight_tokens(a, &four) };
        t.book(&k("holder"), &holder, 10.0);
        first_token(&mut t, &k("holder"), 10.1);
        let taught = t.speed(a);
        assert!(taught.samples > 0.0, "{taught:?}");
        // Beside it (4 blocks and its output's 2), 2 more do not: the engine holds the
        // request back until the holder ends, and its time is that wait.
        let other = chain(2).into_iter().map(|h| SequenceHash(h.0 + 100)).collect::<Vec<_>>();
        t.book(&k("waits"), &eight_tokens(a, &other), 11.0);
        first_token(&mut t, &k("waits"), 13.0);
        assert_eq!(t.speed(a), taught, "a wait for KV room is not a slow pod");
        // Where the capacity is unknown the same wait is a sample (held at its outlier bound).
        let other = chain(2).into_iter().map(|h| SequenceHash(h.0 + 200)).collect::<Vec<_>>();
        t.set_kv_capacity(a, 0.0);
        t.book(&k("unknown"), &eight_tokens(a, &other), 14.0);
        first_token(&mut t, &k("unknown"), 16.0);
        assert!(t.speed(a).samples > taught.samples);
    }

    #[test]
    fn trapezoid_work() {
        assert_eq!(prefill_work(100, 0), 101.0 * 100.0 / 2.0);
        assert_eq!(prefill_work(100, 40), (41.0 + 100.0) * 60.0 / 2.0);
        assert_eq!(prefill_work(10, 10), 0.0);
        assert_eq!(prefill_work(10, 20), 0.0);
    }

    #[test]
    fn bookings_the_engine_does_not_hold_are_dropped_oldest_first() {
        let (mut t, a, b) = tracker();
        let c = chain(2);
        for (i, at) in [0.0, 1.0, 2.0, 9.5].into_iter().enumerate() {
            t.book(&k(format!("a{i}")), &eight_tokens(a, &c), at);
        }
        t.book(&k("b0"), &eight_tokens(b, &c), 0.0);
        // The engine holds 2 requests; three bookings are older than 5 s: the oldest goes.
        assert_eq!(t.reconcile(a, 2, 5.0), 1);
        assert_eq!(t.load(a, 10.0).inflight_requests, 3);
        assert!(t.booked_prompt(&k("a0")).is_none() && t.booked_prompt(&k("a1")).is_some());
        // Young bookings are never judged (the engine may not have them yet), nor other pods.
        assert_eq!(t.reconcile(a, 0, 1.5), 1, "only a1 is older than 1.5 s");
        assert_eq!(t.reconcile(a, 5, 100.0), 0);
        assert_eq!(t.load(b, 10.0).inflight_requests, 1);
        assert_eq!(t.load(a, 10.0).queued_prefill_tokens, 16, "the dropped ones' prefill is released");
    }

    #[test]
    fn prefill_is_released_at_first_token_and_everything_at_done() {
        let (mut t, a, b) = tracker();
        let c = chain(4);
        t.book(
            &k("r1"),
            &Booking {
                pod: a,
                prompt_tokens: 18,
                cached_tokens: 8,
                chain: &c,
                max_output_tokens: Some(8),
                adapter: None,
            },
            0.0,
        );
        let l = t.load(a, 0.0);
        assert_eq!((l.inflight_requests, l.queued_prefill_tokens), (1, 10));
        assert_eq!(l.queued_prefill_work, prefill_work(18, 8));
        // 4 prompt blocks + 1 partial + 8 output tokens = 2 blocks.
        assert_eq!(l.decode_blocks, 7.0);
        assert_eq!(t.load(b, 0.0), PodLoad::default());
        t.report(&k("r1"), Lifecycle::FirstToken, 1.0).unwrap();
        let l = t.load(a, 1.5);
        assert_eq!((l.queued_prefill_tokens, l.queued_prefill_work), (0, 0.0));
        // Half a second at 4 tok/s: 2 of 8 output tokens generated → 6/4 blocks left.
        assert_eq!(l.decode_blocks, 5.0 + 1.5);
        assert_eq!(t.load(a, 100.0).decode_blocks, 5.0, "output part decays to nothing");
        t.report(&k("r1"), Lifecycle::Done, 2.0).unwrap();
        assert_eq!(t.load(a, 2.0), PodLoad::default());
        assert_eq!(t.report(&k("r1"), Lifecycle::Done, 2.0), Err(UnknownRequest("r1".into())));
    }

    #[test]
    fn outputs_are_planned_from_the_share_of_max_tokens_requests_used() {
        let (mut t, a, _) = tracker();
        let c = chain(2);
        let asking = |max| Booking { max_output_tokens: Some(max), ..eight_tokens(a, &c) };
        assert_eq!(t.planned_output(Some(400)), 400.0, "all of it until reports come");
        assert_eq!(t.planned_output(None), 8.0, "the default without max_tokens");
        // Booked before any report: planned whole, then re-planned as reports come.
        t.book(&k("early"), &asking(400), 0.0);
        assert_eq!(t.load(a, 0.0).decode_blocks, 2.0 + 100.0);
        // Requests asking for 400 tokens and using 40: the plan comes down towards 40.
        for i in 0..200 {
            let key = k(format!("r{i}"));
            t.book(&key, &asking(400), f64::from(i));
            t.report(&key, Lifecycle::FirstToken, f64::from(i)).unwrap();
            t.decoded(&key, 40, f64::from(i) + 0.5);
            t.report(&key, Lifecycle::Done, f64::from(i) + 0.5).unwrap();
        }
        let planned = t.planned_output(Some(400));
        assert!((planned - 40.0).abs() < 1e-9, "the mean share of the reports: {planned}");
        let l = t.load(a, 300.0);
        assert!((l.decode_blocks - (2.0 + 10.0)).abs() < 1e-9, "the early booking re-planned: {l:?}");
        // Replicas are sent what was asked, and plan it themselves.
        let shared: Vec<_> = t.local_bookings().map(|(_, b, _)| b.max_output_tokens).collect();
        assert_eq!(shared, [Some(400)]);
        // Turned off, the whole max_tokens is planned.
        let (mut off, _, _) = tracker();
        off.config.learn_output_share = false;
        off.output_share.learn(40, 400);
        assert_eq!(off.planned_output(Some(400)), 400.0);
    }

    #[test]
    fn shared_prefix_blocks_count_once_per_pod() {
        let (mut t, a, _) = tracker();
        let long = chain(10);
        t.book(
            &k("x"),
            &Booking {
                pod: a,
                prompt_tokens: 40,
                cached_tokens: 0,
                chain: &long,
                max_output_tokens: Some(4),
                adapter: None,
            },
            0.0,
        );
        t.book(
            &k("y"),
            &Booking {
                pod: a,
                prompt_tokens: 24,
                cached_tokens: 24,
                chain: &long[..6],
                max_output_tokens: Some(4),
                adapter: None,
            },
            0.0,
        );
        // 10 distinct prompt blocks, no partials, 1 + 1 output blocks.
        assert_eq!(t.load(a, 0.0).decode_blocks, 12.0);
        assert_eq!((t.inflight_sharing(a, long[0]), t.inflight_sharing(a, long[9])), (2, 1), "the group: both");
        t.report(&k("x"), Lifecycle::Cancelled, 0.0).unwrap();
        assert_eq!(t.load(a, 0.0).decode_blocks, 7.0);
        assert_eq!((t.inflight_sharing(a, long[0]), t.inflight_sharing(a, long[9])), (1, 0));
    }

    #[test]
    fn an_ended_prompt_stays_credited_until_its_credit_ends_or_its_pod_evicts() {
        let (mut t, a, b) = tracker();
        let c = chain(6);
        let book = |t: &mut LoadTracker, id: &str, at: f64| {
            let booking = Booking {
                pod: a,
                prompt_tokens: 24,
                cached_tokens: 0,
                chain: &c,
                max_output_tokens: Some(2),
                adapter: None,
            };
            t.book(&k(id), &booking, at);
            t.report(&k(id), Lifecycle::FirstToken, at + 0.1).unwrap();
        };
        book(&mut t, "r1", 0.0);
        t.report(&k("r1"), Lifecycle::Done, 0.2).unwrap();
        assert_eq!(t.load(a, 0.2), PodLoad::default(), "no load is left");
        assert_eq!((t.finished_prefix(a, &c), t.finished_prefix(b, &c)), (6, 0), "credited where it ran");
        assert_eq!((t.finished_prefix(a, &c[..3]), t.inflight_prefix(a, &c)), (3, 0));
        t.expire(1.1);
        assert_eq!(t.finished_prefix(a, &c), 6, "credited for finished_credit_seconds (1 s)");
        t.expire(1.2);
        assert_eq!(t.finished_prefix(a, &c), 0, "then the pod's events are trusted alone");

        book(&mut t, "r2", 2.0);
        t.report(&k("r2"), Lifecycle::Done, 2.2).unwrap();
        t.evicted(a, c[5]);
        assert_eq!(t.finished_prefix(a, &c), 0, "an eviction there ends the credit");

        // Evicted while it ran (the event came before its end): not credited after it.
        book(&mut t, "r3", 3.0);
        t.evicted(a, c[2]);
        t.report(&k("r3"), Lifecycle::Done, 3.2).unwrap();
        assert_eq!(t.finished_prefix(a, &c), 0);
        // Nor a cancelled request, even past its first token (a cancel may come before its
        // prefill ends: never credited), nor on a cleared index.
        book(&mut t, "r4", 4.0);
        t.report(&k("r4"), Lifecycle::Cancelled, 4.2).unwrap();
        assert_eq!(t.finished_prefix(a, &c), 0);
        book(&mut t, "r5", 5.0);
        t.report(&k("r5"), Lifecycle::Done, 5.2).unwrap();
        t.forget_finished(a);
        assert_eq!(t.finished_prefix(a, &c), 0);
    }

    /// Chained block hashes of a prompt made of `groups` (each group's tokens a run of 4).
    fn prompt_chain(groups: &[u32]) -> Vec<SequenceHash> {
        let tokens: Vec<u32> = groups.iter().flat_map(|&g| [g; 4]).collect();
        let mut out = Vec::new();
        crate::hash::sequence_hashes(crate::hash::root_hash(None, None), &tokens, 4, &mut out);
        out
    }

    #[test]
    fn in_flight_prefixes_are_found_as_by_walking_the_chain() {
        let (mut t, a, _) = tracker();
        let booked = [vec![1, 2, 3, 4, 5, 6], vec![1, 2, 3, 9], vec![1, 7], vec![8, 8, 8]];
        for (i, groups) in booked.iter().enumerate() {
            let c = prompt_chain(groups);
            let booking = Booking {
                pod: a,
                prompt_tokens: c.len() as u32 * 4,
                cached_tokens: 0,
                chain: &c,
                max_output_tokens: None,
                adapter: None,
            };
            t.book(&k(format!("r{i}")), &booking, 0.0);
        }
        t.report(&k("r1"), Lifecycle::Cancelled, 1.0).unwrap();
        let held: Vec<Vec<SequenceHash>> = [0, 2, 3].iter().map(|&i| prompt_chain(&booked[i])).collect();
        let walked = |c: &[SequenceHash]| c.iter().take_while(|h| held.iter().any(|b| b.contains(h))).count();
        for query in
            [vec![1, 2, 3, 4, 5, 6, 7], vec![1, 2, 3, 9], vec![1, 2, 9], vec![1, 7, 7], vec![8, 8], vec![2], vec![]]
        {
            let c = prompt_chain(&query);
            assert_eq!(t.inflight_prefix(a, &c), walked(&c), "{query:?}");
        }
        assert_eq!(t.inflight_prefix(a, &prompt_chain(&[1, 2, 3, 9])), 3, "r1's own fourth block left with it");
    }

    #[test]
    fn a_pods_load_follows_its_bookings_in_any_order_of_release() {
        let (mut t, a, _) = tracker();
        let c = chain(3);
        let n = 40;
        for i in 0..n {
            let booking = Booking {
                pod: a,
                prompt_tokens: 10 + i,
                cached_tokens: 0,
                chain: &c,
                max_output_tokens: Some(4 + i),
                adapter: None,
            };
            t.book(&k(format!("r{i}")), &booking, 0.0);
        }
        for i in (0..n).step_by(3) {
            t.report(&k(format!("r{i}")), Lifecycle::FirstToken, 1.0).unwrap();
        }
        let mut left: Vec<u32> = (0..n).collect();
        for i in [7, 0, 39, 13, 26, 1, 38, 20] {
            t.report(&k(format!("r{i}")), Lifecycle::Done, 1.5).unwrap();
            left.retain(|&j| j != i);
            // By hand: 4 tokens a block, 4 tokens a second decoded; at 2.0 a started request
            // has decoded 4 tokens (one block) of its 4 + i.
            let (mut output, mut read) = (0.0, 0.0);
            for &j in &left {
                let (out, generated) = (f64::from(4 + j), if j % 3 == 0 { 4.0 } else { 0.0 });
                output += (out - generated) / 4.0;
                read += 3.0 + f64::from(u32::from((10 + j) % 4 != 0)) + generated / 4.0;
            }
            let l = t.load(a, 2.0);
            assert_eq!(l.inflight_requests as usize, left.len());
            assert!(
                (l.decode_blocks - (3.0 + left.iter().filter(|&&j| (10 + j) % 4 != 0).count() as f64 + output)).abs()
                    < 1e-9
            );
            assert!((l.decode_read_blocks - read).abs() < 1e-9, "{} vs {read}", l.decode_read_blocks);
        }
    }

    #[test]
    fn lost_reports_expire_and_rebooking_replaces() {
        let (mut t, a, b) = tracker();
        let c = chain(2);
        t.book(&k("r"), &eight_tokens(a, &c), 0.0);
        t.book(&k("r"), &eight_tokens(b, &c), 1.0);
        assert_eq!(t.load(a, 1.0), PodLoad::default(), "a retried request moves its booking");
        assert_eq!(t.pod_of(&k("r")), Some(b));
        assert_eq!(t.expire(30.0), 0);
        assert_eq!(t.expire(61.0), 1);
        assert_eq!(t.load(b, 61.0), PodLoad::default());
        assert_eq!((t.inflight(), t.expired), (0, 1));
    }

    #[test]
    fn clearing_a_pod_drops_its_bookings_and_knows_their_ends() {
        let (mut t, a, b) = tracker();
        let c = chain(2);
        t.book(&k("1"), &eight_tokens(a, &c), 0.0);
        t.book(&k("2"), &eight_tokens(b, &c), 0.0);
        t.book(&k("3"), &eight_tokens(a, &c), 0.0);
        t.clear_pod(a);
        assert_eq!(t.load(a, 0.0), PodLoad::default());
        assert_eq!(t.inflight(), 1);
        // The proxies still report how they ended: theirs, once, changing nothing.
        assert_eq!(t.report(&k("1"), Lifecycle::FirstToken, 1.0), Ok(a));
        assert_eq!(t.report(&k("1"), Lifecycle::Cancelled, 1.0), Ok(a));
        assert!(t.report(&k("1"), Lifecycle::Done, 1.0).is_err(), "ended once");
        assert_eq!(t.load(a, 1.0), PodLoad::default());
        // Remembered until they would have expired.
        t.expire(61.0);
        assert!(t.report(&k("3"), Lifecycle::Done, 61.0).is_err());
    }

    #[test]
    fn a_rebooked_request_moves_its_load_and_keeps_its_progress() {
        let (mut t, a, b) = tracker();
        let c = chain(3);
        t.book(
            &k("r"),
            &Booking {
                pod: a,
                prompt_tokens: 12,
                cached_tokens: 8,
                chain: &c,
                max_output_tokens: Some(8),
                adapter: None,
            },
            0.0,
        );
        assert_eq!(t.rebook(&k("r"), b, 0), Ok(a));
        assert_eq!(t.load(a, 0.0), PodLoad::default());
        assert_eq!(t.load(b, 0.0).queued_prefill_tokens, 12, "nothing cached on the pod that served");
        t.report(&k("r"), Lifecycle::FirstToken, 1.0).unwrap();
        t.rebook(&k("r"), a, 12).unwrap();
        let l = t.load(a, 1.0);
        assert_eq!((l.inflight_requests, l.queued_prefill_tokens), (1, 0), "past its first token: no prefill queued");
        assert_eq!(t.rebook(&k("nope"), a, 0), Err(UnknownRequest("nope".into())));
    }
}
