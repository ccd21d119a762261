//! `kv` — the default: the pod where this request will cost the least, counting the prefill
//! work its cache saves, the prefill work already queued there, and its decode load.
//!
//! ```text
//! cost(pod) = slowness · ( prefill_weight     · (queued prefill + this request's uncached prefill + fixed) / block_size
//!                        + decode_weight      · decode blocks held
//!                        + decode_read_weight · decode blocks read per step
//!                        + overflow_weight    · max(0, decode blocks held + its uncached blocks − KV capacity)
//!                        + prefill_weight     · adapter wait / block_size )
//!           + prefill_weight · miss_weight · its uncached tokens / block_size
//! ```
//!
//! `miss_weight` charges a cache miss for the prefixes its new blocks evict (later requests
//! recompute what was evicted) — on a cache not yet full too: a fleet's caches fill, and a
//! prefix computed on a second pod while they were empty then holds room twice and splits
//! its traffic (charged by how full each cache was, the capacity workload's cold start
//! computed its 48 prefixes in 55 places). It is waived on pods that relieve the prompt's
//! home (of the pods caching most of it, the one with the fewest requests in flight), where
//! another copy of the prefix is capacity, not waste: pods with more than
//! `balance_abs_threshold` fewer requests in flight than a piled-up home (and
//! `balance_rel_threshold` times fewer) while at least `balance_group_share` of the home's
//! requests are the prompt's own group, and pods with at most half as many while the
//! home's requests hold more blocks than its KV cache has — it cannot keep its traffic
//! cached anyway (live, the sessions of three system prompts stayed on one such pod at
//! 400 ms TTFT beside idle pods, a fresh prefill there being charged four times over),
//! unless it offloads to a host-memory or storage tier, which loads back what its GPU
//! evicts (the cluster simulator's `tiered`: p90 103 → 93 ms at its base rate) — or
//! while the home thrashes: at least `thrashing_share` of its recent stores compute again
//! blocks it evicted lately (live, one pod holding four system prompts' sessions recomputed
//! most of what it stored while the others recomputed nothing), for pods thrashing at most
//! half as much with fewer requests in flight — or while the home is over-committed: the
//! prompts routed to it lately need `overcommit_share` of its KV cache or more, so what they
//! come back for is evicted before its events show it (live, a burst of one system prompt's
//! conversations piled onto its one home beside idle pods and found their histories gone),
//! for pods with fewer requests in flight whose own recent traffic leaves room for the
//! request's new blocks — or while the home is 1.75 times slower
//! than the pod (`SLOWER_HOME`; learned speeds: a mixed fleet's first prefixes land before
//! its speeds are known, and the charge had kept them on the slow pods).
//! On such a fleet prefix groups also move to the fast pods ([`ByPodSpeed`]): a pod 1.5
//! times faster than every pod holding the prompt's prefix is priced as holding it too, and
//! a holder as holding none of it while a holder 1.5 times faster has no prefill queued.
//! All of them compare a pod with the home, not the fleet's busiest with its idlest: on 64 pods
//! that gap is always wide, and waiving every miss then cost the capacity workload its
//! partition (p90 7.8 s against 0.55 s at 1.5× its rate).
//! On a light fleet no idle pod (no prefill queued) is charged the miss
//! (`light_fleet_requests`): a prefix group's requests that come back together (a system
//! prompt's turns) then spread over pods with compute to spare.
//! A prompt no pod holds `new_prompt_share` of starts a new prefix group: its miss is
//! charged at each pod's cache fill (indexed blocks over KV capacity), so the group's home
//! is the pod holding the fewest other groups rather than whichever was least busy at that
//! instant (the capacity workload's busiest pod had taken 1.24× the mean of requests) —
//! unless a pod offloads to another tier, whose size kvgate does not know: there a GPU's
//! fill is churn (the cluster simulator's `tiered` at 64 pods: 312 → 316 req/s, `prefix` 319).
//! Copies of a prompt take turns (`copy_share`): of the pods holding at least half what its
//! home holds, only the one where the request would start soonest by vllm-router's measure,
//! (prefill queued + its own) × (1 + requests in flight), competes with the other pods; the
//! cost alone sent a group's requests that come back together (a system prompt's turns) to
//! one copy, each behind the last. Only while the fleet has compute to spare, averaged over
//! the last hundred decisions (`copy_busy_pods`): at chat's knee such a turn computes its
//! history again on another copy (goodput at 8 pods 514 req/s ungated, 523 gated, 524 off).
//! `decode_read_weight` charges the per-sequence context each decode step reads (a prefix
//! shared by ten sequences is held once but read ten times), which sets the pod's step
//! time. `overflow_weight` charges the blocks a request would need beyond the pod's KV
//! capacity (`num_gpu_blocks` from its metrics): an engine
//! admits a request only when its blocks fit, so past capacity it waits for requests in
//! flight to finish, or preempts them. Defaults come from the cluster simulator
//! (`make bench-cluster`): see docs/benchmarks.md for what each term buys.
//!
//! Prefill is measured in *linear-equivalent tokens*: with the trapezoid estimate, uncached
//! tokens `n` after `c` cached cost `n + work / attention_horizon_tokens`, where
//! `work = (c+1+p)·(p−c)/2` and the horizon is the context length at which attention costs as
//! much as the linear layers (≈ 30k tokens for an 8B model; see `tests/sim` timing model).
//! With `prefill_estimate: linear` it is just `n`. Dividing by the block size puts prefill
//! in blocks, the unit of decode load. `prefix_weight` scales the cached tokens credited
//! (0 = ignore the cache: pure load balancing). With `temperature > 0`, the pod is sampled
//! with probability ∝ `exp(−normalised cost / temperature)` instead of taking the minimum.
//! The pod's learned slowness ([`crate::speed`]) multiplies what this request waits for,
//! putting pods of different speeds on one scale of predicted time. That includes `fixed`,
//! the tokens of prefill a first token's fixed time is worth (the base cost of the steps it
//! waits through, [`RouteInput::fixed_prefill_tokens`], learned): the same on every pod of
//! one speed, longer on a slower pod however short the prompt (on the cluster simulator's
//! mixed fleet, where cache hits of 20–80 tokens had gone to idle half-speed pods at twice
//! the fast pods' first-token time, goodput at 8 pods 147 → 149 req/s). The miss charge, a
//! price on the fleet's later recomputation, is left out of it (scaled too, it made a miss
//! on a pod 1.3× slower cost as much as queueing behind a whole prompt on a fast one).
//! A request for a LoRA adapter waits on a pod that does not run it ([`AdapterFit`]): for
//! the adapter's load (`adapter_load_ms`) where it is not among those the pod ran last, and
//! where every adapter slot holds another adapter, until the soonest of them drains (vLLM
//! passes such a request over meanwhile). Both are seconds, put in tokens of prefill at
//! `prefill_tokens_per_second`. An adapter already running or waiting on some pod is
//! charged, beside the miss, for taking a slot on another ([`second_slot_seconds`]): spread
//! over pods, adapters held the slots the rarer ones waited for (the cluster simulator's
//! `adapters` workload; docs/design/placement.md).
//! Optional busy thresholds drop pods that report too long a queue or too full a cache
//! (unless every pod is busy, then all stay eligible).

use super::{AdapterFit, Candidate, Decision, Policy, RouteInput, argmin_tie, uncached_tokens};
use crate::load::prefill_work;
use crate::validate::{Invalid, check, non_negative, positive};
use rand::Rng;
use rand::rngs::StdRng;
use serde::Deserialize;
use smart_default::SmartDefault;

/// The fill from which a cache counts as full for a new prompt's miss charge: past it, fills
/// differ by the engine's churn, not by room (at 64 pods with host-memory tiers, steering
/// new prompts by those differences had cost 3.5 % of goodput; such fleets are now charged
/// flat, as [`KvPolicy::charges_at_fill`] says).
const FULL_CACHE: f64 = 0.9;

/// A home this many times slower than a pod (in slowness as applied: learned or declared)
/// gives its requests to that pod at the price of their prefill alone: the prefix group
/// then answers at the faster pod's speed, where the miss charge had kept it on whichever
/// pod it reached before the fleet's speeds were learned. Past the speed learner's
/// `alike_spread` (1.5) by a margin: under load a fleet of one pod type can learn
/// slownesses 1.5 apart for a moment (64 pods of the cluster simulator's capacity
/// workload), and relieving from 1.5 on cost it 3.5 % of goodput.
const SLOWER_HOME: f64 = 1.75;

/// How prefill work is estimated.
#[derive(Clone, Copy, Debug, Default, Deserialize, serde::Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PrefillEstimate {
    /// Linear tokens plus the attention trapezoid.
    #[default]
    Trapezoid,
    /// Uncached tokens only.
    Linear,
}

/// Weights of the `kv` policy.
#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct KvPolicyConfig {
    /// Weight of prefill work: the uncached prompt tokens queued on the pod plus this
    /// request's (in linear-equivalent tokens, per block), scaled by the pod's slowness.
    #[default(1.0)]
    pub prefill_weight: f64,
    /// Weight of the KV blocks held by the pod's requests in flight (decode load).
    #[default(0.1)]
    pub decode_weight: f64,
    /// Weight of the blocks decode steps read (per sequence: shared prefixes count once per
    /// sequence reading them), which sets decode step time.
    #[default(0.02)]
    pub decode_read_weight: f64,
    /// Fraction of the cached tokens credited (1 = all, 0 = cache ignored).
    #[default(1.0)]
    pub prefix_weight: f64,
    /// Extra cost per uncached prompt token, as a fraction of computing it: the blocks a
    /// miss stores evict other prefixes (now, or once the caches have filled), which later
    /// requests recompute.
    #[default(3.0)]
    pub miss_weight: f64,
    /// Cost per block this request would need beyond the pod's KV capacity: blocks held by
    /// requests in flight plus its uncached ones, less `num_gpu_blocks` from the pod's
    /// metrics (no charge while that is unknown). A request whose blocks do not fit waits
    /// for others to finish. 0 = off.
    #[default(1.0)]
    pub overflow_weight: f64,
    /// How prefill work is estimated: `trapezoid` (tokens plus the attention work of a long
    /// context) or `linear` (tokens).
    #[default(PrefillEstimate::Trapezoid)]
    pub prefill_estimate: PrefillEstimate,
    /// Context length at which attention work equals linear work (trapezoid estimate).
    #[default(30_000.0)]
    pub attention_horizon_tokens: f64,
    /// Milliseconds a pod takes to bring a LoRA adapter onto its GPU (one it has not run
    /// lately), charged to a request for it there. 0 = loads are free.
    #[default(50.0)]
    pub adapter_load_ms: f64,
    /// Prompt tokens a pod prefills in a second: what a second of waiting — for an adapter's
    /// load, or for an adapter slot to free — costs in prefill work. 0 = adapters ignored.
    #[default(20_000.0)]
    pub prefill_tokens_per_second: f64,
    /// 0 = always the cheapest pod; > 0 = softmax sampling over normalised costs.
    pub temperature: f64,
    /// Pile-up guard: a pod with more than this many fewer requests in flight than the
    /// prompt's home (of the pods caching most of it, the least busy), and fewer by the factor
    /// `balance_rel_threshold`, is not charged the miss, so load wins over stickiness.
    /// `None` = off.
    #[default(Some(32))]
    pub balance_abs_threshold: Option<u32>,
    /// The factor of the pile-up guard (see `balance_abs_threshold`).
    #[default(1.5)]
    pub balance_rel_threshold: f64,
    /// The pile-up guard counts a pile-up only when the prompt's prefix group (the requests
    /// sharing its first block) holds at least this share of the home's requests in flight:
    /// another copy of the prefix then takes the group's overflow. A home piled up by many
    /// groups is not relieved by copying one of them. 0 = any pile-up.
    #[default(0.35)]
    pub balance_group_share: f64,
    /// A home thrashes when at least this share of its recent GPU stores compute again
    /// blocks it evicted lately (its cache cannot hold the traffic sent to it): then pods
    /// thrashing at most half as much, with fewer requests in flight, take its requests at
    /// the price of their prefill alone (no miss charge). `None` = off.
    #[default(Some(0.3))]
    pub thrashing_share: Option<f64>,
    /// A home is over-committed when the blocks of the prompts routed to it lately (within
    /// `load.recent_window_seconds`) reach this share of its KV capacity: its
    /// cache cannot keep what that traffic comes back for. Then pods with fewer requests in
    /// flight whose own recent traffic leaves room for the request's new blocks take its
    /// requests at the price of their prefill alone (no miss charge). `None` = off.
    #[default(Some(1.0))]
    pub overcommit_share: Option<f64>,
    /// A prompt of which no pod caches this share is new (its prefix group has no home yet):
    /// its miss charge is then scaled on each pod by how full its cache is (indexed blocks
    /// over KV capacity; 90 % counts as full), so the group's home becomes the pod holding
    /// the least — the fewest other groups — rather than whichever was least busy at that
    /// instant. Only while every pod states its KV capacity (`num_gpu_blocks`) and none
    /// offloads to another tier (its GPU's fill then says nothing of its room): one that
    /// does not makes the charge flat on all. `None` = the charge is flat there too.
    #[default(Some(0.3))]
    pub new_prompt_share: Option<f64>,
    /// Copies of a prompt take turns: of the pods holding at least this share of what its
    /// home holds, only the one where the request would start soonest by vllm-router's
    /// measure — (prefill queued + the request's own) × (1 + requests in flight); on a fleet
    /// of mixed speeds with a first token's fixed time, in the pod's time; plus any adapter
    /// wait — competes with the other pods at its cost; the other copies are passed over.
    /// The cost alone sends a group's requests that come back together (a system prompt's
    /// turns) to one copy, each behind the last. Only while the fleet has compute to spare
    /// (`copy_busy_pods`), and not among the decode pods of a disaggregated request (each
    /// receives the prompt's KV: none is a copy). `None` = off.
    #[default(Some(0.5))]
    pub copy_share: Option<f64>,
    /// Copies take turns (`copy_share`) only while, averaged over the last hundred routing
    /// decisions, fewer than this share of the pods had prefill queued: at a fleet's knee a
    /// turn sent to another copy of its system prompt computes its history again with no
    /// compute to spare. Averaged, because a fleet with room still has moments when every
    /// pod is computing (a cold start's first wave), and those are when the turns pay.
    #[default(0.5)]
    pub copy_busy_pods: f64,
    /// No miss is charged on a pod with no prefill queued while the fleet is light: its
    /// pods average at most this many requests in flight, none recomputes what it evicted,
    /// is computing the prompt's prefix, offloads or runs a hybrid model, and every pod
    /// states its KV capacity. There a copy of the prefix costs no request a wait, and the
    /// prompt's group's requests that come back together (a system prompt's turns) answer
    /// sooner spread (live at 24 in flight, 50 paired runs: p90 after the cold start 22.9
    /// ms against 26.1 with the miss waived only while the group crowds its home, and
    /// vllm-router's 26.1). `None` = off.
    #[default(Some(8.0))]
    pub light_fleet_requests: Option<f64>,
    /// Drop pods reporting at least this many waiting requests.
    pub max_waiting: Option<f64>,
    /// Drop pods reporting at least this KV-cache usage (0–1).
    pub max_kv_usage: Option<f64>,
}

impl KvPolicyConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        for (name, v) in [
            ("prefill_weight", self.prefill_weight),
            ("decode_weight", self.decode_weight),
            ("decode_read_weight", self.decode_read_weight),
            ("prefix_weight", self.prefix_weight),
            ("miss_weight", self.miss_weight),
            ("overflow_weight", self.overflow_weight),
            ("adapter_load_ms", self.adapter_load_ms),
            ("prefill_tokens_per_second", self.prefill_tokens_per_second),
            ("temperature", self.temperature),
        ] {
            check(non_negative(v), name, &format!("{v} must be a finite number >= 0"))?;
        }
        let factor = self.balance_rel_threshold;
        check(
            factor.is_finite() && factor >= 1.0,
            "balance_rel_threshold",
            &format!("{factor} must be a factor >= 1"),
        )?;
        let share = self.balance_group_share;
        check((0.0..=1.0).contains(&share), "balance_group_share", &format!("{share} must be a fraction (0-1)"))?;
        if let Some(share) = self.overcommit_share {
            check(share > 0.0 && share.is_finite(), "overcommit_share", &format!("{share} must be > 0, or null"))?;
        }
        if let Some(share) = self.thrashing_share {
            check(
                share > 0.0 && share <= 1.0,
                "thrashing_share",
                &format!("{share} must be a fraction (0-1], or null"),
            )?;
        }
        // 0 would make no prompt new: the rule silently off, which `null` says plainly.
        if let Some(share) = self.new_prompt_share {
            check(
                share > 0.0 && share <= 1.0,
                "new_prompt_share",
                &format!("{share} must be a fraction (0-1], or null"),
            )?;
        }
        if let Some(share) = self.copy_share {
            check(share > 0.0 && share <= 1.0, "copy_share", &format!("{share} must be a fraction (0-1], or null"))?;
        }
        let busy = self.copy_busy_pods;
        check((0.0..=1.0).contains(&busy), "copy_busy_pods", &format!("{busy} must be a fraction (0-1)"))?;
        if let Some(requests) = self.light_fleet_requests {
            check(non_negative(requests), "light_fleet_requests", &format!("{requests} must be >= 0, or null"))?;
        }
        if let Some(usage) = self.max_kv_usage {
            check((0.0..=1.0).contains(&usage), "max_kv_usage", &format!("{usage} must be a fraction (0-1)"))?;
        }
        check(positive(self.attention_horizon_tokens), "attention_horizon_tokens", "must be positive")
    }
}

pub struct KvPolicy {
    config: KvPolicyConfig,
    rng: StdRng,
    /// The share of pods with prefill queued, averaged over the last [`BUSY_DECISIONS`]
    /// routing decisions (`copy_busy_pods`).
    busy_pods: f64,
}

/// How many routing decisions [`KvPolicy::busy_pods`] averages over (as an exponential
/// moving average).
const BUSY_DECISIONS: f64 = 100.0;

/// The recompute share ([`Candidate::recompute_share`]) from which a pod's cache counts as
/// short of room for [`KvPolicy::light_fleet`]: any steady recomputing (the light-load
/// record's gate; tests/bench/results/light-load-rule).
const LIGHT_RECOMPUTE: f64 = 0.005;

impl KvPolicy {
    pub fn new(config: KvPolicyConfig, rng: StdRng) -> Self {
        Self { config, rng, busy_pods: 0.0 }
    }

    /// Linear-equivalent prefill tokens of `n` uncached tokens after `cached`.
    fn prefill_tokens(&self, prompt: u64, cached: u64) -> f64 {
        let n = prompt.saturating_sub(cached) as f64;
        match self.config.prefill_estimate {
            PrefillEstimate::Linear => n,
            PrefillEstimate::Trapezoid => n + prefill_work(prompt, cached) / self.config.attention_horizon_tokens,
        }
    }

    /// Tokens of prefill worth the time the request waits for its adapter on `c`.
    fn adapter_wait_tokens(&self, c: &Candidate) -> f64 {
        let load = |load: bool| if load { self.config.adapter_load_ms / 1000.0 } else { 0.0 };
        let seconds = match c.adapter {
            AdapterFit::Unlimited | AdapterFit::Running => return 0.0,
            AdapterFit::Free { load: l } => load(l),
            AdapterFit::Full { load: l, wait_seconds, .. } => load(l) + wait_seconds,
        };
        seconds * self.config.prefill_tokens_per_second
    }

    /// `second_slot_seconds` in tokens of prefill where the request would take another slot
    /// for its adapter on `c` (a free one, or one another adapter leaves); 0 where it joins.
    fn second_slot_tokens(&self, c: &Candidate, second_slot_seconds: f64) -> f64 {
        let takes_slot = matches!(c.adapter, AdapterFit::Free { .. } | AdapterFit::Full { joins: false, .. });
        if takes_slot { second_slot_seconds * self.config.prefill_tokens_per_second } else { 0.0 }
    }

    fn busy(&self, c: &Candidate) -> bool {
        let Some(r) = c.reported else { return false };
        self.config.max_waiting.is_some_and(|m| r.waiting >= m)
            || self.config.max_kv_usage.is_some_and(|m| r.kv_cache_usage >= m)
    }

    /// Cost of sending the request to `c` (judged alone: no other pod runs its adapter).
    pub fn cost(&self, input: &RouteInput, c: &Candidate) -> f64 {
        self.cost_with(input, c, self.config.miss_weight, 0.0)
    }

    /// Whether the prompt's miss is charged at each pod's cache fill: no pod credits
    /// `new_prompt_share` of it (it is new to the fleet), and every pod states its KV
    /// capacity. The charge compares fills, so one pod of unknown capacity (not yet scraped,
    /// or an engine that does not say) makes it flat on all: charged in full there and at
    /// its fill elsewhere, that pod would be passed over for no fault of its cache. So does
    /// a pod that [`offloads`](Candidate::offloads): what its GPU evicts stays in the other
    /// tier, whose size no engine reports, so its GPU's fill is churn, not room.
    fn charges_at_fill(&self, input: &RouteInput, candidates: &[Candidate]) -> bool {
        let best = candidates.iter().map(Candidate::credited_tokens).max().unwrap_or(0);
        self.config.new_prompt_share.is_some_and(|share| f64::from(best) < share * f64::from(input.prompt_tokens))
            && candidates.iter().all(Candidate::states_room)
    }

    /// Whether the fleet is light for the prompt (`light_fleet_requests`): no miss is
    /// charged on its pods with no prefill queued. What the charge protects is room a fleet
    /// short of it would recompute; a light fleet has room, and an idle pod's compute is
    /// spare, so a copy there costs no request a wait while the prompt's group's requests
    /// that come back together answer sooner spread. A pod with prefill queued is charged
    /// as before: the capacity workload's cold start has every pod computing 12,000–24,000
    /// tokens of new prefixes, and the few copies the waiver made there were its whole loss
    /// (64 pods: 1,408 → 1,355 req/s with the waiver on every pod). Some pod must hold part
    /// of the prompt, and every pod must say the fleet is light:
    /// - its requests in flight, averaged over the fleet, are at most `light_fleet_requests`
    ///   (the live benchmark's 24 in flight on 4 pods, 6 a pod; the burst passes it within
    ///   its first decisions);
    /// - it recomputes nothing it evicted lately ([`LIGHT_RECOMPUTE`]): the capacity
    ///   workload's caches, short of room, do;
    /// - it states its KV capacity and keeps its cache on its GPU alone: a pod that
    ///   [`offloads`](Candidate::offloads) loads back what its GPU evicts, so its GPU's fill
    ///   says nothing of its room (the waiver was not measured on such fleets);
    /// - it runs a full-attention model: a [`hybrid`](Candidate::hybrid) model's home holds
    ///   its group's sliding-window blocks at the points its requests ended, which a copy
    ///   lacks (the cluster simulator's `hybrid` at 8 pods: 138 → 119 req/s without this);
    /// - it is not computing the prompt's prefix in flight: a second copy of a prefix still
    ///   being computed is the burst's loss (1,552 → 1,319 requests at once at 8 pods).
    ///
    /// Measured in tests/bench/results/light-fleet and tests/bench/results/idle-pods.
    fn light_fleet(&self, candidates: &[Candidate], home: Option<&Candidate>) -> bool {
        home.is_some()
            && self.config.light_fleet_requests.is_some_and(|requests| {
                let in_flight: u32 = candidates.iter().map(|c| c.load.inflight_requests).sum();
                f64::from(in_flight) <= requests * candidates.len() as f64
                    && candidates.iter().all(|c| {
                        c.recompute_share < LIGHT_RECOMPUTE && c.states_room() && !c.hybrid && !c.computing_prefix
                    })
            })
    }

    /// Whether `c` takes the overflow of the prompt's `home` at the price of its prefill
    /// alone (no miss charge): the prompt's group has piled up there — the home has more
    /// than `balance_abs_threshold` requests in flight above `c`, `balance_rel_threshold`
    /// times as many, and at least `balance_group_share` of them are the group's (a home
    /// piled up by many groups is not relieved by copying one: under KV-capacity pressure on
    /// 64 pods such copies moved groups between pods and evicted them) — or its
    /// requests hold more blocks than its KV cache has (it cannot keep this prefix's traffic
    /// cached anyway, unless it [`offloads`](Candidate::offloads) to another tier and loads
    /// it back) and `c` has at most half its requests in flight — or the home thrashes
    /// (`thrashing_share`) and `c`, with fewer requests in flight, thrashes at most half as
    /// much — or the home is over-committed and `c` has room ([`Self::overcommitted`]) — or
    /// the home is [`SLOWER_HOME`] times slower than `c`. All are judged against
    /// the home, not the fleet: on 64 pods some pod is always far busier than the idlest,
    /// which says nothing about where this prompt should go.
    fn relieves(&self, input: &RouteInput, home: &Candidate, c: &Candidate) -> bool {
        let (at_home, here) = (home.load.inflight_requests, c.load.inflight_requests);
        let piled_up = self.config.balance_abs_threshold.is_some_and(|abs| {
            at_home.saturating_sub(here) > abs
                && f64::from(at_home) > self.config.balance_rel_threshold * f64::from(here)
                && f64::from(home.group_inflight) >= self.config.balance_group_share * f64::from(at_home)
        });
        let overflowing = !home.offloads
            && home.reported.is_some_and(|r| r.num_gpu_blocks > 0.0 && home.load.decode_blocks >= r.num_gpu_blocks)
            && 2 * here <= at_home;
        let thrashing = self.config.thrashing_share.is_some_and(|share| {
            home.recompute_share >= share && 2.0 * c.recompute_share <= home.recompute_share && here < at_home
        });
        let slower = home.slowness >= SLOWER_HOME * c.slowness;
        piled_up || overflowing || thrashing || slower || self.overcommitted(input, home, c)
    }

    /// Whether the prompt's `home` is over-committed (`overcommit_share`) and `c`, with fewer
    /// requests in flight, has room for the request among the blocks of its own recent
    /// traffic. A home that offloads to another tier is not: it loads back what its GPU
    /// evicts.
    fn overcommitted(&self, input: &RouteInput, home: &Candidate, c: &Candidate) -> bool {
        let capacity = |c: &Candidate| c.reported.map_or(0.0, |r| r.num_gpu_blocks);
        let Some(share) = self.config.overcommit_share else { return false };
        if home.offloads || capacity(home) == 0.0 || capacity(c) == 0.0 {
            return false;
        }
        let new_blocks = u64::from(uncached_tokens(input, c) / input.block_size.max(1));
        home.recent_blocks as f64 >= share * capacity(home)
            && (c.recent_blocks + new_blocks) as f64 <= capacity(c)
            && c.load.inflight_requests < home.load.inflight_requests
    }

    /// Copies take turns (`copy_share`): of the pods still priced that hold at least that
    /// share of what the prompt's `home` holds, all but the one where the request would
    /// start soonest are priced just above it: passed over this time, still the first
    /// fallbacks.
    fn take_turns(
        &self,
        input: &RouteInput,
        shown: &[Candidate],
        home: &Candidate,
        by_speed: Option<&ByPodSpeed>,
        second_slot_seconds: f64,
        costs: &mut [Option<f64>],
    ) {
        let at_home = f64::from(home.credited_tokens());
        let Some(share) = self.config.copy_share.filter(|_| at_home > 0.0) else { return };
        let prompt = u64::from(input.prompt_tokens);
        let turn_price = |c: &Candidate| {
            let c = by_speed.map_or(*c, |s| s.priced(c));
            let own = self.prefill_tokens(prompt, u64::from(c.credited_tokens()).min(prompt));
            // On pods of one speed a first token's fixed time is the same everywhere: left
            // out, as vllm-router's measure leaves it (counted, the live mix in the
            // simulator: p90 66.8 → 70.1 ms). On a fleet of mixed speeds it is not.
            let (slowness, fixed) =
                if by_speed.is_some() { (c.slowness, input.fixed_prefill_tokens) } else { (1.0, 0.0) };
            (c.load.queued_prefill_tokens as f64 + own + fixed) * slowness * (1.0 + f64::from(c.load.inflight_requests))
                + self.adapter_wait_tokens(&c)
                + self.second_slot_tokens(&c, second_slot_seconds)
        };
        let is_copy =
            |c: &Candidate, cost: &Option<f64>| cost.is_some() && f64::from(c.credited_tokens()) >= share * at_home;
        let turn = (0..shown.len())
            .filter(|&i| is_copy(&shown[i], &costs[i]))
            .map(|i| (i, turn_price(&shown[i])))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((turn, _)) = turn else { return };
        let Some(after_turn) = costs[turn].map(f64::next_up) else { return };
        for (i, (c, cost)) in shown.iter().zip(costs.iter_mut()).enumerate() {
            if i != turn && is_copy(c, cost) {
                *cost = cost.map(|own| own.max(after_turn));
            }
        }
    }

    /// `second_slot_seconds`: what taking another adapter slot for the request's adapter
    /// costs the fleet ([`second_slot_seconds`]), charged where it would take one.
    fn cost_with(&self, input: &RouteInput, c: &Candidate, miss_weight: f64, second_slot_seconds: f64) -> f64 {
        let prompt = u64::from(input.prompt_tokens);
        let credited = (f64::from(c.credited_tokens()) * self.config.prefix_weight) as u64;
        let uncached = u64::from(uncached_tokens(input, &c.holding(credited as u32)));
        let own = self.prefill_tokens(prompt, prompt - uncached);
        let queued = match self.config.prefill_estimate {
            PrefillEstimate::Linear => c.load.queued_prefill_tokens as f64,
            PrefillEstimate::Trapezoid => {
                c.load.queued_prefill_tokens as f64 + c.load.queued_prefill_work / self.config.attention_horizon_tokens
            }
        };
        let block_size = f64::from(input.block_size.max(1));
        let capacity = c.reported.map_or(0.0, |r| r.num_gpu_blocks);
        let overflow = c.load.blocks_past_capacity(uncached as f64 / block_size, capacity);
        let work = self.config.prefill_weight
            * (queued + own + input.fixed_prefill_tokens + self.adapter_wait_tokens(c))
            / block_size
            + self.config.decode_weight * c.load.decode_blocks
            + self.config.decode_read_weight * c.load.decode_read_blocks
            + self.config.overflow_weight * overflow;
        // In the pod's time: the same work takes a slower pod longer. The miss and slot
        // charges are not: they price what the fleet recomputes or waits for later, not this
        // request's wait.
        let slot = self.second_slot_tokens(c, second_slot_seconds);
        let miss = self.config.prefill_weight * (miss_weight * uncached as f64 + slot) / block_size;
        work * c.slowness + miss
    }
}

impl Policy for KvPolicy {
    fn select(&mut self, input: &RouteInput, candidates: &[Candidate]) -> Decision {
        let all_busy = candidates.iter().all(|c| self.busy(c));
        let by_speed = ByPodSpeed::of(candidates);
        let shown = by_speed.as_ref().map_or(candidates, |s| &s.shown[..]);
        let home = home(shown).map(|h| &shown[h]);
        let second_slot = second_slot_seconds(input, shown);
        let at_fill = self.charges_at_fill(input, shown);
        let light = self.light_fleet(candidates, home);
        let mut costs: Vec<Option<f64>> = shown
            .iter()
            .map(|c| {
                let priced;
                let c = match &by_speed {
                    Some(by_speed) => {
                        priced = by_speed.priced(c);
                        &priced
                    }
                    None => c,
                };
                let relieves = home.is_some_and(|h| self.relieves(input, h, c));
                let miss_weight = match c.reported {
                    _ if relieves => 0.0,
                    Some(r) if at_fill => {
                        self.config.miss_weight * (c.pod_blocks as f64 / r.num_gpu_blocks / FULL_CACHE).min(1.0)
                    }
                    _ if light && c.load.queued_prefill_tokens == 0 => 0.0,
                    _ => self.config.miss_weight,
                };
                (all_busy || !self.busy(c)).then(|| self.cost_with(input, c, miss_weight, second_slot))
            })
            .collect();
        if self.config.copy_share.is_some() {
            let busy_now =
                shown.iter().filter(|c| c.load.queued_prefill_tokens > 0).count() as f64 / shown.len() as f64;
            self.busy_pods += (busy_now - self.busy_pods) / BUSY_DECISIONS;
            if let Some(home) = home
                && !input.kv_received
                && self.busy_pods < self.config.copy_busy_pods
            {
                self.take_turns(input, shown, home, by_speed.as_ref(), second_slot, &mut costs);
            }
        }
        let chosen = if self.config.temperature > 0.0 {
            softmax_sample(&costs, self.config.temperature, &mut self.rng)
        } else {
            argmin_tie(&costs, candidates, &mut self.rng)
        };
        Decision { chosen, costs }
    }
}

/// A pod this many times faster than another (in slowness as applied: learned or declared)
/// outpaces it as the home of a prompt's prefix group ([`ByPodSpeed`]). At the speed
/// learner's `alike_spread`: a fleet it judges alike has every slowness applied as 1. (The
/// relief of a slower home needs a margin past it, [`SLOWER_HOME`]; this does not: 64 pods
/// of the capacity workload keep 1,087 req/s with or without it.)
const OUTPACES: f64 = 1.5;

/// On a fleet of mixed speeds, the caches a prompt is priced with: its prefix group belongs
/// on the fast pods, where its requests answer sooner. The group's first requests land
/// before the fleet's speeds are learned, and the miss charge then kept the most popular
/// prefixes on the slow pods where they landed (the cluster simulator's mixed fleet: p90 at
/// a quarter of its rate 28.0 ms, against 15.9 ms with the speeds declared; 16.7 ms with
/// this, docs/design/placement.md). So, of the
/// pods holding as much of the prompt as its home (the full prefix):
/// - a holder outpaced by another holder with no prefill queued is shown as holding none of
///   it: the faster copy answers first, and the slower one is left to age out;
/// - a pod that outpaces every holder is priced as holding it too: the group moves there.
///   This is a price, not a belief: the request that moves the group computes the prefix
///   there (its own first token is later), and what the pod is booked for and credited
///   elsewhere is what it holds. The group's later requests answer at the faster speed.
struct ByPodSpeed {
    /// The candidates with outpaced holders' caches hidden: the prompt's home, the pile-up
    /// guard and the miss charge are judged on these.
    shown: Vec<Candidate>,
    /// Tokens of the prompt's full prefix.
    full: u32,
    /// The least slowness of a pod holding the full prefix.
    fastest_holder: f64,
}

impl ByPodSpeed {
    /// `None` where it changes nothing: no pod holds the prompt, or no pod outpaces another.
    fn of(candidates: &[Candidate]) -> Option<Self> {
        let (fastest, slowest) =
            candidates.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), c| (lo.min(c.slowness), hi.max(c.slowness)));
        if slowest < OUTPACES * fastest {
            return None;
        }
        let full = candidates[home(candidates)?].cached_tokens;
        let fastest_holding = |idle_only: bool| {
            candidates
                .iter()
                .filter(|c| c.cached_tokens >= full && (!idle_only || c.load.queued_prefill_tokens == 0))
                .map(|c| c.slowness)
                .fold(f64::INFINITY, f64::min)
        };
        let (fastest_holder, fastest_idle_holder) = (fastest_holding(false), fastest_holding(true));
        let outpaced = |c: &Candidate| c.cached_tokens >= full && OUTPACES * fastest_idle_holder <= c.slowness;
        let shown = candidates.iter().map(|c| if outpaced(c) { c.holding(0) } else { *c }).collect();
        Some(Self { shown, full, fastest_holder })
    }

    /// `c` (as shown) as priced: holding the full prefix where it outpaces every holder.
    fn priced(&self, c: &Candidate) -> Candidate {
        let outpaces_holders = c.cached_tokens < self.full && self.fastest_holder >= OUTPACES * c.slowness;
        if outpaces_holders { c.holding(self.full) } else { *c }
    }
}

/// What taking another slot for an adapter that runs or waits on some pod already costs the
/// other adapters, in seconds the request holds it: times the share of pods with no slot
/// free (a later adapter wants it), plus the requests already waiting for a slot per slot
/// of the fleet (each is that much later). 0 while no pod is full, or the adapter is nowhere
/// yet. Each slot an adapter holds serves only its own requests: spread over pods it holds
/// several. (Without the waiting requests, on the cluster simulator's `adapters` workload,
/// kvgate spread a rare adapter over the pods whose slots free first once the fleet was
/// past its knee: p90 TTFT at 1× its rate 3.4 s; 2.2 s with them, docs/design/placement.md.)
fn second_slot_seconds(input: &RouteInput, candidates: &[Candidate]) -> f64 {
    if input.slot_seconds == 0.0
        || !candidates.iter().any(|c| matches!(c.adapter, AdapterFit::Running | AdapterFit::Full { joins: true, .. }))
    {
        return 0.0;
    }
    let limited = candidates.iter().filter(|c| c.adapter != AdapterFit::Unlimited).count();
    let full = candidates.iter().filter(|c| matches!(c.adapter, AdapterFit::Full { .. })).count();
    if full == 0 {
        return 0.0;
    }
    let (slots, waiting) =
        candidates.iter().fold((0, 0), |(s, w), c| (s + c.slot_queue.slots, w + c.slot_queue.waiting_requests));
    let waiting_per_slot = f64::from(waiting) / f64::from(slots.max(1));
    (full as f64 / limited as f64 + waiting_per_slot) * input.slot_seconds
}

/// The prompt's home: of the pods caching most of it, the one with the fewest requests in
/// flight (none while it is cached nowhere). A pile-up is judged against the quietest
/// copy: once a second pod relieves the first, a third copy is worth it only when the
/// second piles up too (judged against the busiest copy, a 64-pod burst kept copying its
/// prefixes: p90 524 ms at twice its size, against 275 ms).
pub(crate) fn home(candidates: &[Candidate]) -> Option<usize> {
    (0..candidates.len())
        .filter(|&i| candidates[i].cached_tokens > 0)
        .max_by_key(|&i| (candidates[i].cached_tokens, std::cmp::Reverse(candidates[i].load.inflight_requests)))
}

/// Samples index i with probability ∝ exp(−(cost_i − min)/(max − min)/temperature).
fn softmax_sample(costs: &[Option<f64>], temperature: f64, rng: &mut StdRng) -> usize {
    let (min, max) =
        costs.iter().flatten().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| (lo.min(c), hi.max(c)));
    let span = if max > min { max - min } else { 1.0 };
    let weights: Vec<f64> = costs.iter().map(|c| c.map_or(0.0, |c| (-(c - min) / span / temperature).exp())).collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if *w > 0.0 && x < *w {
            return i;
        }
        x -= w;
    }
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{INPUT, candidate, histogram};
    use super::super::{ReportedLoad, SlotQueue};
    use super::*;
    use crate::pod_set::PodId;
    use rand::SeedableRng;

    fn policy(config: KvPolicyConfig) -> KvPolicy {
        KvPolicy::new(config, StdRng::seed_from_u64(7))
    }

    #[test]
    fn an_adapter_keeps_to_its_slot_while_slots_are_scarce_and_never_waits_behind_others_for_one() {
        let mut p = policy(KvPolicyConfig::default());
        let input = RouteInput { slot_seconds: 1.0, ..INPUT };
        let with = |adapter, c: Candidate| Candidate { adapter, ..c };
        let full = AdapterFit::Full { load: true, wait_seconds: 0.5, joins: false };
        let free = AdapterFit::Free { load: false };
        // Nowhere yet: a free slot beats waiting half a second behind another adapter.
        let cands = [with(full, candidate(0, 0, 0, 0)), with(free, candidate(1, 0, 0, 0))];
        assert_eq!(p.select(&input, &cands).chosen, 1);
        // Running on a busy pod while another is full: a second slot would hold one that
        // half the fleet waits for (0.5 s × 20k tokens/s): it queues where it runs.
        let busy_home = with(AdapterFit::Running, candidate(2, 0, 4, 3000));
        let cands = [with(full, candidate(0, 0, 0, 0)), with(free, candidate(1, 0, 0, 0)), busy_home];
        let d = p.select(&input, &cands);
        assert_eq!(d.chosen, 2);
        let charge = d.costs[1].unwrap() - p.cost(&input, &cands[1]);
        assert!((charge - 1.0 / 3.0 * 20_000.0 / 16.0).abs() < 1e-6, "{charge}");
        // Slots everywhere free: no charge, and the idle pod takes it.
        let cands = [with(free, candidate(0, 0, 0, 0)), busy_home];
        assert_eq!(p.select(&input, &cands).chosen, 0);
        // A home far busier: the second slot is worth it while no request waits for one…
        let busier_home = with(AdapterFit::Running, candidate(2, 0, 4, 12_000));
        let slots = |waiting_requests| SlotQueue { slots: 2, waiting_requests };
        let queued = |waiting, c: Candidate| Candidate { slot_queue: slots(waiting), ..c };
        let (full_pod, free_pod) = (with(full, candidate(0, 0, 0, 0)), with(free, candidate(1, 0, 0, 0)));
        let fleet = |waiting| [queued(waiting, full_pod), queued(0, free_pod), queued(0, busier_home)];
        assert_eq!(p.select(&input, &fleet(0)).chosen, 1);
        // …but not while six requests wait for one of the fleet's six slots: each would wait
        // as long again as the second slot is held.
        let d = p.select(&input, &fleet(6));
        assert_eq!(d.chosen, 2);
        let charge = d.costs[1].unwrap() - p.cost(&input, &fleet(6)[1]);
        assert!((charge - (1.0 / 3.0 + 1.0) * 20_000.0 / 16.0).abs() < 1e-6, "{charge}");
        // Adapters ignored (`prefill_tokens_per_second: 0`): the full pod is as good as any.
        let mut off = policy(KvPolicyConfig { prefill_tokens_per_second: 0.0, ..KvPolicyConfig::default() });
        let cands = [with(full, candidate(0, 0, 0, 0)), with(free, candidate(1, 0, 0, 0))];
        assert_eq!(off.select(&input, &cands).costs[0], off.select(&input, &cands).costs[1]);
    }

    #[test]
    fn a_cached_prefix_wins_on_idle_pods() {
        let mut p = policy(KvPolicyConfig::default());
        let cands = [candidate(0, 0, 0, 0), candidate(1, 800, 0, 0), candidate(2, 400, 0, 0)];
        let d = p.select(&INPUT, &cands);
        assert_eq!(d.chosen, 1);
        let c: Vec<f64> = d.costs.iter().map(|c| c.unwrap()).collect();
        assert!(c[1] < c[2] && c[2] < c[0]);
    }

    #[test]
    fn a_slower_pod_costs_its_work_in_its_own_time() {
        let mut p = policy(KvPolicyConfig::default());
        let (fast, slow) = (candidate(0, 0, 0, 0), Candidate { slowness: 2.0, ..candidate(1, 0, 0, 0) });
        let unpriced_misses = policy(KvPolicyConfig { miss_weight: 0.0, ..Default::default() });
        assert_eq!(unpriced_misses.cost(&INPUT, &slow), 2.0 * unpriced_misses.cost(&INPUT, &fast));
        // What a miss evicts is recomputed later, wherever it lands: not in this pod's time.
        let twice_the_work = p.cost(&INPUT, &slow) - p.cost(&INPUT, &fast);
        assert!((twice_the_work - unpriced_misses.cost(&INPUT, &fast)).abs() < 1e-9);
        assert_eq!(p.select(&INPUT, &[slow, fast]).chosen, 1, "same work, the fast pod");
        // A slower pod holding most of the prompt still beats a cold fast one (less than
        // `OUTPACES` slower: see the next tests for more).
        let warm_slow = Candidate { slowness: 1.4, ..candidate(1, 800, 0, 0) };
        assert_eq!(p.select(&INPUT, &[warm_slow, fast]).chosen, 0);
    }

    #[test]
    fn a_short_prompt_waits_through_a_slower_pods_steps_too() {
        let mut p = policy(KvPolicyConfig::default());
        // Both pods cache all but 8 tokens; the fast one has 48 tokens of prefill queued.
        let fast = candidate(0, 992, 0, 48);
        let slow = Candidate { slowness: 2.0, ..candidate(1, 992, 0, 0) };
        assert_eq!(p.select(&INPUT, &[fast, slow]).chosen, 1, "in prefill tokens alone, the idle slow pod");
        // A first token's fixed time is worth 200 tokens: twice as long on the slow pod.
        let learned = RouteInput { fixed_prefill_tokens: 200.0, ..INPUT };
        assert_eq!(p.select(&learned, &[fast, slow]).chosen, 0, "the fast pod's queue is shorter than that");
        // On pods of one speed it moves every cost alike.
        let busier = candidate(1, 992, 2, 96);
        let gap = |input: &RouteInput| p.cost(input, &busier) - p.cost(input, &fast);
        assert!((gap(&learned) - gap(&INPUT)).abs() < 1e-9);
    }

    #[test]
    fn blocks_beyond_the_kv_capacity_are_charged() {
        let p = policy(KvPolicyConfig::default());
        let off = policy(KvPolicyConfig { overflow_weight: 0.0, ..Default::default() });
        let with_capacity = |blocks: f64| ReportedLoad { num_gpu_blocks: blocks, ..Default::default() };
        // 8 in flight hold 80 blocks; this request adds 1000 uncached tokens = 62.5 blocks.
        let held = candidate(0, 0, 8, 0);
        let roomy = Candidate { reported: Some(with_capacity(1000.0)), ..held };
        let full = Candidate { reported: Some(with_capacity(100.0)), ..held };
        assert_eq!(p.cost(&INPUT, &roomy), off.cost(&INPUT, &roomy), "it fits: no charge");
        assert_eq!(p.cost(&INPUT, &held), off.cost(&INPUT, &held), "capacity unknown: no charge");
        assert!((p.cost(&INPUT, &full) - off.cost(&INPUT, &full) - 42.5).abs() < 1e-9, "80 + 62.5 − 100");
        // Two pods alike but for room: the one where the request fits.
        let mut p = p;
        assert_eq!(p.select(&INPUT, &[full, Candidate { pod: PodId(1), ..roomy }]).chosen, 1);
    }

    #[test]
    fn queued_work_outweighs_a_small_cache_gain() {
        let mut p = policy(KvPolicyConfig::default());
        // Pod 1 holds 160 of 1000 tokens but has 5000 prefill tokens queued.
        let cands = [candidate(0, 0, 0, 0), candidate(1, 160, 1, 5000)];
        assert_eq!(p.select(&INPUT, &cands).chosen, 0);
    }

    #[test]
    fn trapezoid_charges_long_contexts_more_than_linear() {
        let tz = policy(KvPolicyConfig { miss_weight: 0.0, ..Default::default() });
        let lin = policy(KvPolicyConfig {
            prefill_estimate: PrefillEstimate::Linear,
            miss_weight: 0.0,
            ..Default::default()
        });
        let long = RouteInput { prompt_tokens: 32_000, ..INPUT };
        let c = candidate(0, 0, 0, 0);
        assert!(tz.cost(&long, &c) > 1.4 * lin.cost(&long, &c));
        assert_eq!(lin.cost(&long, &c), 2000.0);
    }

    #[test]
    fn a_cold_fleet_does_not_compute_a_prefix_twice() {
        let mut p = policy(KvPolicyConfig::default());
        let mut no_miss_charge = policy(KvPolicyConfig { miss_weight: 0.0, ..Default::default() });
        // Pod 0 is computing the prompt's prefix (it counts as cached there) with two
        // prompts' worth of prefill queued; pod 1 is idle, its cache empty.
        let computing = candidate(0, 992, 2, 2000);
        let mut idle_empty = candidate(1, 0, 0, 0);
        idle_empty.reported = Some(ReportedLoad { num_gpu_blocks: 1000.0, ..Default::default() });
        assert!(p.cost(&INPUT, &idle_empty) > 3.5 * no_miss_charge.cost(&INPUT, &idle_empty), "miss_weight 3");
        assert_eq!(p.select(&INPUT, &[computing, idle_empty]).chosen, 0, "the miss is charged on an empty cache too");
        assert_eq!(
            no_miss_charge.select(&INPUT, &[computing, idle_empty]).chosen,
            1,
            "charged only its prefill, the idle pod would compute the prefix a second time"
        );
    }

    #[test]
    fn a_home_past_its_kv_capacity_gives_its_overflow_to_quiet_pods() {
        // As traced live (48 in flight over 4 pods): the sessions of three system prompts
        // on one pod, 21 in flight holding more blocks than its cache has; two pods idle.
        let input = RouteInput { prompt_tokens: 2486, ..INPUT };
        let capacity = Some(ReportedLoad { num_gpu_blocks: 1500.0, ..Default::default() });
        let mut home = Candidate { reported: capacity, ..candidate(0, 2320, 21, 718) };
        home.load.decode_blocks = 1580.0;
        home.load.decode_read_blocks = 3405.0;
        let idle = Candidate { reported: capacity, ..candidate(1, 0, 0, 0) };
        let mut p = policy(KvPolicyConfig::default());
        assert_eq!(p.select(&input, &[home, idle]).chosen, 1, "the idle pod pays its prefill, not a miss charge");
        // Within its capacity the home keeps the prefix: a second copy would evict others.
        let fits = Candidate { load: crate::load::PodLoad { decode_blocks: 1400.0, ..home.load }, ..home };
        assert_eq!(p.select(&input, &[fits, idle]).chosen, 0);
        // A pod with more than half the home's requests in flight is charged as before.
        let busy = Candidate { reported: capacity, ..candidate(1, 0, 11, 0) };
        let costs = p.select(&input, &[home, busy]).costs;
        assert_eq!(costs[1], Some(p.cost_with(&input, &busy, 3.0, 0.0)));
        assert!(costs[1].unwrap() > p.cost_with(&input, &busy, 0.0, 0.0));
        // A home that offloads to host memory loads back what its GPU evicts: it keeps the
        // prefix, and the idle pod is charged the miss.
        let offloading = Candidate { offloads: true, ..home };
        let d = p.select(&input, &[offloading, idle]);
        assert_eq!(d.costs[1], Some(p.cost_with(&input, &idle, 3.0, 0.0)));
        assert_eq!(d.chosen, 0);
    }

    #[test]
    fn a_slower_home_gives_its_prefix_to_a_faster_pod_once_the_wait_there_is_longer() {
        let mut p = policy(KvPolicyConfig::default());
        // The home caches the prompt and has 960 tokens of prefill queued; pod 1 is idle and
        // caches nothing. Of one speed, the home wins: a miss on pod 1 is charged 3× over.
        let home = candidate(0, 992, 4, 960);
        let idle = candidate(1, 0, 0, 0);
        assert_eq!(p.select(&INPUT, &[home, idle]).chosen, 0);
        // 1.4× slower (within `OUTPACES`): the miss is charged as before, and the home keeps it.
        let (a_bit_slower, fast) = (Candidate { slowness: 0.98, ..home }, Candidate { slowness: 0.7, ..idle });
        let d = p.select(&INPUT, &[a_bit_slower, fast]);
        assert_eq!(d.costs[1], Some(p.cost(&INPUT, &fast)));
        assert_eq!(d.chosen, 0);
        // Twice as slow, the home waits 2 × (960 + 8) tokens' time, and pod 1 takes it
        // without the miss charge, even while a second holder, busier, within 1.5× of pod 1's
        // speed keeps pod 1 from being priced as holding the prefix (next test).
        let slow = Candidate { slowness: 1.4, ..home };
        let near = Candidate { slowness: 0.8, ..candidate(2, 992, 8, 2000) };
        let d = p.select(&INPUT, &[slow, fast, near]);
        assert_eq!(d.chosen, 1);
        assert_eq!(d.costs[1], Some(p.cost_with(&INPUT, &fast, 0.0, 0.0)));
    }

    #[test]
    fn a_prefix_group_moves_to_a_pod_that_outpaces_its_holders() {
        let mut p = policy(KvPolicyConfig::default());
        // An idle half-speed pod holds the prompt; pod 1, twice as fast, holds nothing. The
        // group moves: pod 1 is priced as holding the prefix (its first request computes it).
        let slow = Candidate { slowness: 2.0, ..candidate(0, 992, 0, 0) };
        let fast = candidate(1, 0, 0, 0);
        let d = p.select(&INPUT, &[slow, fast]);
        assert_eq!(d.chosen, 1);
        assert_eq!(d.costs[1], Some(p.cost_with(&INPUT, &fast.holding(992), 0.0, 0.0)));
        assert_eq!(d.costs[0], Some(p.cost(&INPUT, &slow)));
        // Once pod 1 holds it too, with no prefill queued, the slow copy counts for nothing:
        // pod 1 keeps the group though its decode load outweighs 8 tokens' prefill.
        let fast_holder = candidate(1, 992, 6, 0);
        assert!(p.cost(&INPUT, &slow) < p.cost(&INPUT, &fast_holder), "judged on caches alone, the slow pod");
        let d = p.select(&INPUT, &[slow, fast_holder]);
        assert_eq!(d.chosen, 1);
        assert_eq!(d.costs[0], Some(p.cost(&INPUT, &slow.holding(0))));
        // While pod 1 has prefill queued, the slow copy counts again.
        let queued = candidate(1, 992, 6, 16);
        let d = p.select(&INPUT, &[slow, queued]);
        assert_eq!(d.costs[0], Some(p.cost(&INPUT, &slow)));
        assert_eq!(d.chosen, 0);
        // Pods less than 1.5× apart are priced with the caches they hold.
        let nearly = Candidate { slowness: 1.45, ..slow };
        let d = p.select(&INPUT, &[nearly, fast]);
        assert_eq!(d.costs, vec![Some(p.cost(&INPUT, &nearly)), Some(p.cost(&INPUT, &fast))]);
        assert_eq!(d.chosen, 0);
    }

    #[test]
    fn a_pile_up_turns_the_miss_charge_off() {
        let mut p = policy(KvPolicyConfig::default());
        // Pod 0 holds the prefix; pod 1 does not (both caches full, capacity unknown).
        let mut hot = candidate(0, 992, 30, 2000);
        let cold = candidate(1, 0, 2, 0);
        assert_eq!(p.select(&INPUT, &[hot, cold]).chosen, 0, "28 more in flight is not a pile-up (abs 32)");
        hot.load.inflight_requests = 60;
        hot.group_inflight = 30;
        let d = p.select(&INPUT, &[hot, cold]);
        assert_eq!(d.chosen, 1, "imbalanced: misses cost only their prefill, and pod 0's queue is longer");
        let sticky = policy(KvPolicyConfig { balance_abs_threshold: None, ..Default::default() });
        assert!(sticky.cost(&INPUT, &hot) < sticky.cost(&INPUT, &cold), "without the guard the miss charge keeps it");
    }

    #[test]
    fn a_home_piled_up_by_other_groups_keeps_the_prompts_group() {
        let mut p = policy(KvPolicyConfig::default());
        // 60 in flight at the home, 20 of them the prompt's group (under 0.35): copying its
        // prefix to pod 1 would relieve the home of a third of its pile and evict there.
        let home = Candidate { group_inflight: 20, ..candidate(0, 992, 60, 2000) };
        let cold = candidate(1, 0, 2, 0);
        let d = p.select(&INPUT, &[home, cold]);
        assert_eq!(d.chosen, 0);
        assert_eq!(d.costs[1], Some(p.cost(&INPUT, &cold)), "pod 1 is charged the miss");
        let mut any_pile = policy(KvPolicyConfig { balance_group_share: 0.0, ..Default::default() });
        assert_eq!(any_pile.select(&INPUT, &[home, cold]).chosen, 1, "counting any pile-up, pod 1 relieves it");
    }

    #[test]
    fn copies_take_turns_by_where_the_request_starts_soonest_while_the_fleet_has_compute_to_spare() {
        // Two copies of the prompt: pod 0 computing 300 tokens with one request in flight,
        // pod 1 with no prefill queued but six requests in flight. The cost alone prefers
        // pod 1 (its decode load weighs less than pod 0's queue); by (queued + own) × (1 + in
        // flight) pod 0 starts the request sooner: 500 × 2 against 200 × 7.
        let queued = candidate(0, 800, 1, 300);
        let crowded = candidate(1, 800, 6, 0);
        let cold = candidate(2, 0, 0, 0);
        let cands = [queued, crowded, cold];
        let mut off = policy(KvPolicyConfig { copy_share: None, ..Default::default() });
        assert_eq!(off.select(&INPUT, &cands).chosen, 1);
        let mut p = policy(KvPolicyConfig::default());
        let received = RouteInput { kv_received: true, ..INPUT };
        assert_eq!(p.select(&received, &cands).chosen, 1, "a decode leg: each pod receives the KV, none is a copy");
        let d = p.select(&INPUT, &cands);
        assert_eq!(d.chosen, 0);
        assert!(d.costs[1] > d.costs[0], "the other copy is passed over");
        assert!(d.costs[1] < d.costs[2], "and still ahead of the pods without the prompt");
        assert_eq!(d.costs[2], Some(p.cost(&INPUT, &cold)), "a pod without the prompt is priced as ever");
        // A pod holding under half what the home holds is not a copy.
        let partial = candidate(1, 320, 6, 0);
        assert_eq!(p.select(&INPUT, &[queued, partial, cold]).costs[1], Some(p.cost(&INPUT, &partial)));

        // On a fleet whose pods have prefill queued, the turns stop once that has lasted:
        // averaged over the last hundred decisions, half the pods or more were computing.
        let busy = |c: Candidate| Candidate { load: crate::load::PodLoad { queued_prefill_tokens: 10, ..c.load }, ..c };
        let cands = [queued, busy(crowded), busy(cold)];
        let mut p = policy(KvPolicyConfig::default());
        assert_eq!(p.select(&INPUT, &cands).chosen, 0, "a moment's load: the copies still take turns");
        let chosen: Vec<usize> = (0..100).map(|_| p.select(&INPUT, &cands).chosen).collect();
        assert_eq!(chosen[..60], [0; 60]);
        assert_eq!(chosen[80..], [1; 20], "a lasting load: the cost alone");
    }

    #[test]
    fn a_thrashing_home_hands_its_requests_to_a_pod_that_is_not() {
        let mut p = policy(KvPolicyConfig::default());
        // The home holds the prompt but 60 % of what it stores recomputes blocks it evicted;
        // pod 1 holds nothing, recomputes nothing and has fewer requests in flight.
        let home = Candidate { recompute_share: 0.6, ..candidate(0, 992, 10, 1200) };
        let calm = candidate(1, 0, 4, 0);
        let d = p.select(&INPUT, &[home, calm]);
        assert_eq!(d.chosen, 1, "its prefill alone beats the home's queue");
        assert_eq!(d.costs[1], Some(p.cost_with(&INPUT, &calm, 0.0, 0.0)), "pod 1 is not charged the miss");
        // A home under the share, a pod thrashing over half as much, or one as busy: charged.
        let charged = [
            (Candidate { recompute_share: 0.1, ..home }, calm),
            (home, Candidate { recompute_share: 0.35, ..calm }),
            (home, candidate(1, 0, 10, 0)),
        ];
        for (home, other) in charged {
            let d = p.select(&INPUT, &[home, other]);
            assert_eq!((d.chosen, d.costs[1]), (0, Some(p.cost(&INPUT, &other))));
        }
        let mut off = policy(KvPolicyConfig { thrashing_share: None, ..Default::default() });
        assert_eq!(off.select(&INPUT, &[home, calm]).chosen, 0, "off: the miss keeps the prompt home");
    }

    #[test]
    fn a_light_fleet_charges_no_miss_on_an_idle_pod_unless_a_pod_is_short_of_room_or_computing_the_prefix() {
        let capacity = Some(ReportedLoad { num_gpu_blocks: 1000.0, ..Default::default() });
        let reporting = |c: Candidate| Candidate { reported: capacity, ..c };
        // Copies taking turns (`copy_share`) off: the cost alone decides.
        let light = KvPolicyConfig { copy_share: None, ..Default::default() };
        let mut p = policy(light.clone());
        // The home holds the prompt, with prefill queued; pod 1, quieter and with no prefill
        // queued, holds none of it.
        let home = reporting(candidate(0, 992, 6, 3000));
        let idle = reporting(candidate(1, 0, 2, 0));
        let d = p.select(&INPUT, &[home, idle]);
        assert_eq!(d.costs[1], Some(p.cost_with(&INPUT, &idle, 0.0, 0.0)), "no miss charged");
        assert_eq!(d.chosen, 1, "its prefill alone beats the home's queue");
        // Charged: a pod with prefill queued, the home still computing the prefix or
        // recomputing what it evicted, a pod that offloads, runs a hybrid model or has not
        // stated its capacity, or more than 8 requests in flight a pod.
        let charged = [
            (home, reporting(candidate(1, 0, 2, 100))),
            (Candidate { computing_prefix: true, ..home }, idle),
            (Candidate { recompute_share: 0.01, ..home }, idle),
            (home, Candidate { offloads: true, ..idle }),
            (home, Candidate { hybrid: true, ..idle }),
            (home, Candidate { reported: None, ..idle }),
            (reporting(candidate(0, 992, 14, 3000)), reporting(candidate(1, 0, 3, 0))),
        ];
        for (home, other) in charged {
            let d = p.select(&INPUT, &[home, other]);
            assert_eq!((d.chosen, d.costs[1]), (0, Some(p.cost(&INPUT, &other))), "{home:?} {other:?}");
        }
        let mut off = policy(KvPolicyConfig { light_fleet_requests: None, ..light });
        assert_eq!(off.select(&INPUT, &[home, idle]).chosen, 0, "off: the miss keeps the prompt home");
        assert!(KvPolicyConfig { light_fleet_requests: Some(-1.0), ..Default::default() }.validate().is_err());
    }

    #[test]
    fn an_overcommitted_home_hands_its_requests_to_a_pod_with_room() {
        let capacity = Some(ReportedLoad { num_gpu_blocks: 1000.0, ..Default::default() });
        let with = |recent_blocks, c: Candidate| Candidate { recent_blocks, reported: capacity, ..c };
        // Its fleet of 14 requests in flight on 2 pods is light: the light fleet's waiver
        // (`light_fleet_requests`) off, so that this rule alone decides.
        let alone = KvPolicyConfig { light_fleet_requests: None, ..Default::default() };
        let mut p = policy(alone.clone());
        // The prompts routed to the home lately need 1,200 blocks of its 1,000: what its
        // conversations come back for is evicted first. Pod 1, quieter, has room for the
        // prompt's 62 new blocks beside its own recent 800.
        let home = with(1200, candidate(0, 992, 10, 1200));
        let roomy = with(800, candidate(1, 0, 4, 0));
        let d = p.select(&INPUT, &[home, roomy]);
        assert_eq!(d.chosen, 1, "its prefill alone beats the home's queue");
        assert_eq!(d.costs[1], Some(p.cost_with(&INPUT, &roomy, 0.0, 0.0)), "pod 1 is not charged the miss");
        // A home within its cache, a pod without room, one as busy, a home that offloads
        // (it loads back what its GPU evicts): charged.
        let charged = [
            (with(900, home), roomy),
            (home, with(950, roomy)),
            (home, with(800, candidate(1, 0, 10, 0))),
            (Candidate { offloads: true, ..home }, roomy),
        ];
        for (home, other) in charged {
            let d = p.select(&INPUT, &[home, other]);
            assert_eq!((d.chosen, d.costs[1]), (0, Some(p.cost(&INPUT, &other))));
        }
        let mut off = policy(KvPolicyConfig { overcommit_share: None, ..alone });
        assert_eq!(off.select(&INPUT, &[home, roomy]).chosen, 0, "off: the miss keeps the prompt home");
    }

    #[test]
    fn a_share_that_would_turn_a_rule_off_unsaid_is_refused() {
        let with = |thrashing, new_prompt, overcommit| KvPolicyConfig {
            thrashing_share: thrashing,
            new_prompt_share: new_prompt,
            overcommit_share: overcommit,
            ..Default::default()
        };
        assert!(with(Some(0.3), Some(0.3), Some(1.2)).validate().is_ok());
        assert!(with(None, None, None).validate().is_ok(), "null: off, said plainly");
        let refused =
            [(Some(0.0), None, None), (None, Some(0.0), None), (None, Some(1.5), None), (None, None, Some(0.0))];
        for (thrashing, new_prompt, overcommit) in refused {
            let config = with(thrashing, new_prompt, overcommit);
            assert!(config.validate().is_err(), "{thrashing:?} {new_prompt:?} {overcommit:?}");
        }
        for share in [0.0, 1.5, f64::NAN] {
            assert!(KvPolicyConfig { copy_share: Some(share), ..Default::default() }.validate().is_err());
        }
        for busy in [-0.1, 1.5] {
            assert!(KvPolicyConfig { copy_busy_pods: busy, ..Default::default() }.validate().is_err());
        }
    }

    #[test]
    fn a_new_prefix_goes_to_the_emptier_cache_not_the_momentarily_quieter_pod() {
        let capacity = |blocks| Some(ReportedLoad { num_gpu_blocks: blocks, ..Default::default() });
        // No pod caches the prompt. Pod 0 has a shorter queue but a cache 90 % full (full, for
        // this charge: the homes of many groups); pod 1 is a little busier and holds a tenth.
        let full = Candidate { pod_blocks: 900, reported: capacity(1000.0), ..candidate(0, 0, 2, 200) };
        let empty = Candidate { pod_blocks: 100, reported: capacity(1000.0), ..candidate(1, 0, 3, 500) };
        let mut p = policy(KvPolicyConfig::default());
        let d = p.select(&INPUT, &[full, empty]);
        assert_eq!(d.chosen, 1);
        assert_eq!(
            d.costs[1],
            Some(p.cost_with(&INPUT, &empty, 3.0 * (100.0 / 1000.0 / FULL_CACHE), 0.0)),
            "the miss charged at the cache's fill"
        );
        let mut flat = policy(KvPolicyConfig { new_prompt_share: None, ..Default::default() });
        assert_eq!(flat.select(&INPUT, &[full, empty]).chosen, 0, "off: the quieter pod, whatever it holds");
        // Once a pod caches the share, the prompt's group has a home: the charge is flat.
        let holder = Candidate { cached_tokens: 320, ..full };
        let d = p.select(&INPUT, &[holder, empty]);
        assert_eq!(d.costs[1], Some(p.cost(&INPUT, &empty)));
        assert_eq!(d.chosen, 0);
        // A pod whose capacity is not known yet (its first scrape has not come back) makes
        // the charge flat on every pod: the empty pod that reported pays the full miss too.
        let unscraped = Candidate { reported: None, ..candidate(1, 0, 2, 200) };
        let idle_empty = Candidate { pod_blocks: 0, ..empty };
        let d = p.select(&INPUT, &[idle_empty, unscraped]);
        assert_eq!(d.costs, vec![Some(p.cost(&INPUT, &idle_empty)), Some(p.cost(&INPUT, &unscraped))]);
        assert_eq!(d.chosen, 1, "the quieter pod, as with the rule off");
        // So does a pod that offloads: its GPU's fill is churn, whatever its other tier holds.
        let offloading = Candidate { offloads: true, ..empty };
        let d = p.select(&INPUT, &[full, offloading]);
        assert_eq!(d.costs, vec![Some(p.cost(&INPUT, &full)), Some(p.cost(&INPUT, &offloading))]);
        assert_eq!(d.chosen, 0, "the quieter pod, as with the rule off");
    }

    #[test]
    fn a_pile_up_elsewhere_in_the_fleet_keeps_the_miss_charge() {
        let mut p = policy(KvPolicyConfig::default());
        // The prompt's home (pod 0) is as busy as most; pod 1 is idle; pod 2, holding
        // other prefixes, has piled up 60 requests.
        let home = candidate(0, 992, 4, 0);
        let idle = candidate(1, 0, 0, 0);
        let piled = candidate(2, 0, 60, 8000);
        let d = p.select(&INPUT, &[home, idle, piled]);
        assert_eq!(d.chosen, 0, "the cache wins: no pile-up at home");
        assert_eq!(d.costs[1], Some(p.cost(&INPUT, &idle)), "the idle pod is charged the miss");
    }

    #[test]
    fn a_quiet_copy_of_the_prefix_relieves_a_piled_up_one() {
        let mut p = policy(KvPolicyConfig::default());
        let piled = candidate(0, 992, 60, 4000);
        let copy = candidate(1, 992, 20, 500);
        let idle = candidate(2, 0, 0, 0);
        let d = p.select(&INPUT, &[piled, copy, idle]);
        assert_eq!(d.costs[2], Some(p.cost(&INPUT, &idle)), "the copy has not piled up: the miss is charged");
        assert_eq!(d.chosen, 1);
        assert_eq!(p.select(&INPUT, &[piled, idle]).chosen, 1, "without the copy, the idle pod relieves the pile");
    }

    #[test]
    fn prefix_weight_zero_is_pure_load_balancing() {
        let mut p = policy(KvPolicyConfig { prefix_weight: 0.0, ..Default::default() });
        let cands = [candidate(0, 999, 3, 0), candidate(1, 0, 1, 0)];
        assert_eq!(p.select(&INPUT, &cands).chosen, 1);
    }

    #[test]
    fn busy_pods_are_skipped_unless_all_are_busy() {
        let mut p = policy(KvPolicyConfig { max_waiting: Some(10.0), ..Default::default() });
        let mut hot = candidate(0, 1000, 0, 0);
        hot.reported = Some(ReportedLoad { waiting: 12.0, ..Default::default() });
        let cold = candidate(1, 0, 0, 0);
        let d = p.select(&INPUT, &[hot, cold]);
        assert_eq!((d.chosen, d.costs[0]), (1, None));
        assert_eq!(p.select(&INPUT, &[hot]).chosen, 0);
    }

    #[test]
    fn temperature_spreads_choices_by_cost() {
        let mut p = policy(KvPolicyConfig { temperature: 0.5, ..Default::default() });
        let cands = [candidate(0, 900, 0, 0), candidate(1, 0, 0, 0), candidate(2, 500, 0, 0)];
        let h = histogram(&mut p, &cands, 3000);
        assert!(h[0] > h[2] && h[2] > h[1] && h[1] > 0, "{h:?}");
        let mut greedy = policy(KvPolicyConfig::default());
        assert_eq!(histogram(&mut greedy, &cands, 100), vec![100, 0, 0]);
    }
}
