//! The scorer's shared state and its operations: route a request, apply a pod's KV events,
//! take lifecycle reports and scrape results, describe the pods.
//!
//! The routing logic itself (index, bookkeeping, policies) lives in `kvgate-routing`; this
//! module holds it behind one mutex, taken briefly per decision and per event batch. The
//! expensive part of a decision — tokenization — happens before the lock.

use crate::config::{Config, Role};
use crate::metrics::Metrics;
use crate::prompt::{self, Api, PromptError};
use kvgate_route_api::{LifecycleEvent, LifecycleReport, PodExplain, RoutePath, RouteResponse};
use kvgate_routing::approx::ApproxIndex;
use kvgate_routing::events::{EventBatch, KvEvent};
use kvgate_routing::hash::{SequenceHash, root_hash, sequence_hashes};
use kvgate_routing::index::{IndexConfig, KvIndex, PodIndexStats};
use kvgate_routing::load::{Booking, Lifecycle, LoadConfig, LoadTracker};
use kvgate_routing::pod_set::{PodId, PodSet};
use kvgate_routing::policy::{Candidate, Policy, ReportedLoad, RouteInput};
use kvgate_tokenize::Tokenizer;
use serde::Serialize;
use std::sync::Mutex;
use std::time::Instant;

/// Why a route call failed.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no healthy pod can serve this request")]
    NoPod,
}

impl From<PromptError> for RouteError {
    fn from(e: PromptError) -> Self {
        RouteError::BadRequest(e.0)
    }
}

/// Static facts about a pod.
pub struct Pod {
    pub id: PodId,
    pub name: String,
    pub address: String,
    pub role: Role,
    /// Indexed from its KV events (else approximately).
    pub precise: bool,
}

#[derive(Default, Clone, Copy)]
struct PodHealth {
    healthy: bool,
    consecutive_failures: u32,
    reported: Option<ReportedLoad>,
    events_received: u64,
    event_gaps: u64,
    batches_missed: u64,
    batches_stale: u64,
    decode_errors: u64,
}

struct Core {
    index: KvIndex,
    approx: ApproxIndex,
    load: LoadTracker,
    policy: Box<dyn Policy>,
    prefill_policy: Box<dyn Policy>,
    decode_policy: Box<dyn Policy>,
    health: Vec<PodHealth>,
    overlap: Vec<u32>,
    approx_overlap: Vec<u32>,
}

/// Everything the HTTP handlers and background tasks share.
pub struct Scorer {
    pub config: Config,
    pub pods: Vec<Pod>,
    pub metrics: Metrics,
    tokenizer: Tokenizer,
    core: Mutex<Core>,
    started: Instant,
}

/// One entry of `GET /v1/pods`.
#[derive(Serialize)]
pub struct PodView {
    pub name: String,
    pub address: String,
    pub role: Role,
    pub healthy: bool,
    /// `precise` (KV events) or `approximate` (what kvgate routed there).
    pub index: &'static str,
    pub cached_blocks: usize,
    pub inflight_requests: u32,
    pub queued_prefill_tokens: u64,
    pub decode_blocks: f64,
    pub events_received: u64,
    pub event_gaps: u64,
    /// Batches the gaps skipped (lost by the publisher's full queue or the network), before
    /// any replay: with `events_received` this accounts for every batch a pod published.
    pub event_batches_missed: u64,
    /// Duplicate or late batches dropped by their sequence number.
    pub event_batches_stale: u64,
    pub event_decode_errors: u64,
    pub reported: Option<ReportedView>,
    pub index_stats: PodIndexStats,
}

#[derive(Serialize)]
pub struct ReportedView {
    pub running: f64,
    pub waiting: f64,
    pub kv_cache_usage: f64,
}

/// The booking id of a disaggregated request's prefill leg.
fn prefill_booking(request_id: &str) -> String {
    format!("{request_id}\u{0}prefill")
}

impl Scorer {
    /// Builds the scorer. Without a real tokenizer every pod is indexed approximately: the
    /// fallback's token ids are not the engines', so their events could never match.
    pub fn new(config: Config, tokenizer: Tokenizer) -> Self {
        let precise_possible = tokenizer.is_exact();
        let mut index = KvIndex::new(IndexConfig {
            block_size: config.block_size,
            max_blocks_per_pod: config.index.max_blocks_per_pod,
        });
        let mut approx = ApproxIndex::new(config.index.approximate_ttl_seconds, config.index.max_blocks_per_pod);
        let mut load = LoadTracker::new(LoadConfig {
            block_size: config.block_size,
            default_output_tokens: config.load.default_output_tokens,
            decode_tokens_per_second: config.load.decode_tokens_per_second,
            request_ttl: config.load.request_ttl_seconds,
        });
        let mut pods = Vec::with_capacity(config.pods.len());
        for p in &config.pods {
            let id = index.add_pod();
            approx.add_pod();
            load.add_pod();
            pods.push(Pod {
                id,
                name: p.name.clone(),
                address: p.address.clone(),
                role: p.role,
                precise: precise_possible && p.kv_events.is_some(),
            });
        }
        let metrics = Metrics::new();
        for p in &pods {
            metrics.pod_healthy.with_label_values(&[&p.name]).set(1.0);
        }
        let core = Core {
            index,
            approx,
            load,
            policy: config.policy.build(config.seed),
            prefill_policy: config.pd.prefill_policy.build(config.seed.wrapping_add(1)),
            decode_policy: config.pd.decode_policy.build(config.seed.wrapping_add(2)),
            // Pods start healthy; scraping demotes them after consecutive failures.
            health: vec![PodHealth { healthy: true, ..Default::default() }; pods.len()],
            overlap: Vec::new(),
            approx_overlap: Vec::new(),
        };
        Self { config, pods, metrics, tokenizer, core: Mutex::new(core), started: Instant::now() }
    }

    /// Seconds since start: the clock of bookings and TTLs.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Core> {
        // A panic while holding the lock would be a bug; keep serving rather than cascade.
        self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Chooses the pod for one request — or, when disaggregation pays off, a prefill pod and
    /// a decode pod.
    pub fn route(&self, request_id: &str, path: &str, body: &[u8], explain: bool) -> Result<RouteResponse, RouteError> {
        let api = Api::from_path(path).ok_or_else(|| {
            RouteError::BadRequest(format!("kvgate routes /v1/completions and /v1/chat/completions, not {path:?}"))
        })?;
        let t0 = Instant::now();
        let info = prompt::extract(&self.tokenizer, api, body, &self.config.lora_adapters)?;
        let api_label = if api == Api::Completions { "completions" } else { "chat" };
        self.metrics.tokenize_seconds.with_label_values(&[api_label]).observe(t0.elapsed().as_secs_f64());

        let t1 = Instant::now();
        let mut chain: Vec<SequenceHash> = Vec::new();
        let root = root_hash(info.lora_name.as_deref(), info.cache_salt.as_deref());
        sequence_hashes(root, &info.tokens, self.config.block_size, &mut chain);
        let prompt_tokens = info.tokens.len() as u32;
        let input = RouteInput { prompt_tokens, block_size: self.config.block_size as u32 };
        let now = self.now();

        let mut core = self.lock();
        let core = &mut *core;
        let healthy = |p: &&Pod| core.health[p.id.index()].healthy;
        let decoders: Vec<&Pod> =
            self.pods.iter().filter(healthy).filter(|p| matches!(p.role, Role::Both | Role::Decode)).collect();
        if decoders.is_empty() {
            return Err(RouteError::NoPod);
        }
        let prefillers: Vec<&Pod> = self.pods.iter().filter(healthy).filter(|p| p.role == Role::Prefill).collect();
        let direct = self.candidates(core, &decoders, &chain, prompt_tokens, now, None);
        let best_cached = direct.iter().map(|c| c.cached_tokens).max().unwrap_or(0);
        let uncached_tokens = prompt_tokens - best_cached;
        let disaggregate = !prefillers.is_empty() && uncached_tokens >= self.config.pd.threshold_tokens;

        let (decode, prefill, candidates, decision, policy) = if disaggregate {
            let prefill_candidates = self.candidates(core, &prefillers, &chain, prompt_tokens, now, None);
            let prefill_decision = core.prefill_policy.select(&input, &prefill_candidates);
            let prefill = prefill_candidates[prefill_decision.chosen];
            // The decode pod pulls the KV: it computes no prefill, only its load counts.
            let decode_candidates = self.candidates(core, &decoders, &chain, prompt_tokens, now, Some(prompt_tokens));
            let decision = core.decode_policy.select(&input, &decode_candidates);
            let decode = decode_candidates[decision.chosen];
            core.load.book(
                &prefill_booking(request_id),
                &Booking {
                    pod: prefill.pod,
                    prompt_tokens,
                    cached_tokens: prefill.cached_tokens,
                    chain: &chain,
                    max_output_tokens: Some(0),
                },
                now,
            );
            (decode, Some(prefill), decode_candidates, decision, core.decode_policy.name())
        } else {
            let decision = core.policy.select(&input, &direct);
            (direct[decision.chosen], None, direct, decision, core.policy.name())
        };
        core.load.book(
            request_id,
            &Booking {
                pod: decode.pod,
                prompt_tokens,
                cached_tokens: decode.cached_tokens,
                chain: &chain,
                max_output_tokens: info.max_output_tokens,
            },
            now,
        );
        for chosen in std::iter::once(decode.pod).chain(prefill.map(|p| p.pod)) {
            if !self.pods[chosen.index()].precise {
                core.approx.record(chosen, &chain, now);
            }
        }
        let explain = explain.then(|| {
            candidates
                .iter()
                .zip(&decision.costs)
                .enumerate()
                .map(|(i, (c, cost))| {
                    let p = &self.pods[c.pod.index()];
                    PodExplain {
                        pod: p.name.clone(),
                        address: p.address.clone(),
                        cached_blocks: c.cached_tokens / self.config.block_size as u32,
                        cached_tokens: c.cached_tokens,
                        queued_prefill_tokens: c.load.queued_prefill_tokens,
                        decode_blocks: c.load.decode_blocks,
                        inflight_requests: c.load.inflight_requests,
                        cost: *cost,
                        chosen: i == decision.chosen,
                    }
                })
                .collect()
        });
        let pod = &self.pods[decode.pod.index()];
        let route_path = if prefill.is_some() { RoutePath::Pd } else { RoutePath::Direct };
        self.metrics.decisions.with_label_values(&[policy, &pod.name]).inc();
        self.metrics.decisions_by_path.with_label_values(&[if prefill.is_some() { "pd" } else { "direct" }]).inc();
        self.metrics.decision_seconds.observe(t1.elapsed().as_secs_f64());
        self.metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
        let cached_tokens = prefill.map_or(decode.cached_tokens, |p| p.cached_tokens);
        self.metrics.cached_tokens.inc_by(u64::from(cached_tokens));
        self.metrics
            .prefix_hit_ratio
            .with_label_values(&[policy])
            .inc_by(f64::from(cached_tokens) / f64::from(prompt_tokens.max(1)));
        let prefill_pod = prefill.map(|p| &self.pods[p.pod.index()]);
        Ok(RouteResponse {
            decode: pod.address.clone(),
            prefill: prefill_pod.map(|p| p.address.clone()),
            pod: pod.name.clone(),
            prefill_pod: prefill_pod.map(|p| p.name.clone()),
            path: route_path,
            uncached_tokens,
            threshold_tokens: (!prefillers.is_empty()).then_some(self.config.pd.threshold_tokens),
            policy: policy.to_string(),
            prompt_tokens,
            cached_tokens,
            explain,
        })
    }

    /// Candidates among `pods`: their cached prefix of `chain` (or `cached_override` tokens,
    /// for decode pods that will receive the KV), their booked load and reported load.
    fn candidates(
        &self,
        core: &mut Core,
        pods: &[&Pod],
        chain: &[SequenceHash],
        prompt_tokens: u32,
        now: f64,
        cached_override: Option<u32>,
    ) -> Vec<Candidate> {
        if cached_override.is_none() {
            let precise: PodSet = pods.iter().filter(|p| p.precise).map(|p| p.id).collect();
            let approximate: PodSet = pods.iter().filter(|p| !p.precise).map(|p| p.id).collect();
            core.index.longest_prefixes(chain, &precise, &mut core.overlap);
            core.approx.longest_prefixes(chain, &approximate, &mut core.approx_overlap);
        }
        pods.iter()
            .map(|p| {
                let cached = cached_override.unwrap_or_else(|| {
                    let blocks = core.overlap[p.id.index()].max(core.approx_overlap[p.id.index()]);
                    (blocks as usize * self.config.block_size).min(prompt_tokens as usize) as u32
                });
                Candidate {
                    pod: p.id,
                    cached_tokens: cached,
                    load: core.load.load(p.id, now),
                    reported: core.health[p.id.index()].reported,
                }
            })
            .collect()
    }

    /// Applies a batch of lifecycle reports; returns how many named no in-flight request.
    pub fn lifecycle(&self, reports: &[LifecycleReport]) -> usize {
        let now = self.now();
        let mut core = self.lock();
        let mut unknown = 0;
        for r in reports {
            let (event, label) = match r.event {
                LifecycleEvent::FirstToken => (Lifecycle::FirstToken, "first_token"),
                LifecycleEvent::Done => (Lifecycle::Done, "done"),
                LifecycleEvent::Cancelled => (Lifecycle::Cancelled, "cancelled"),
                LifecycleEvent::PrefillDone => (Lifecycle::Done, "prefill_done"),
            };
            self.metrics.lifecycle_reports.with_label_values(&[label]).inc();
            // A disaggregated request's prefill booking ends with its prefill leg, or at the
            // latest with the first token (header mode: the decode pod's sidecar prefills).
            let prefill = prefill_booking(&r.request_id);
            let prefill_known = core.load.report(&prefill, Lifecycle::Done, now).is_ok();
            if r.event == LifecycleEvent::PrefillDone {
                unknown += usize::from(!prefill_known);
            } else if core.load.report(&r.request_id, event, now).is_err() {
                unknown += 1;
            }
        }
        self.metrics.lifecycle_unknown.inc_by(unknown as u64);
        unknown
    }

    /// Applies one decoded event batch of a pod.
    pub fn apply_events(&self, pod: PodId, batch: &EventBatch<'_>) {
        let name = &self.pods[pod.index()].name;
        let (mut stored, mut removed, mut cleared) = (0u64, 0u64, 0u64);
        for e in &batch.events {
            match e {
                KvEvent::BlockStored(s) => stored += s.block_hashes.len() as u64,
                KvEvent::BlockRemoved { block_hashes, .. } => removed += block_hashes.len() as u64,
                KvEvent::AllBlocksCleared => cleared += 1,
                KvEvent::Unknown(_) => {}
            }
        }
        {
            let mut core = self.lock();
            core.index.apply(pod, batch);
            core.health[pod.index()].events_received += 1;
        }
        for (kind, n) in [("block_stored", stored), ("block_removed", removed), ("all_blocks_cleared", cleared)] {
            if n > 0 {
                self.metrics.kv_events.with_label_values(&[name, kind]).inc_by(n);
            }
        }
    }

    /// A message from the pod's event socket could not be decoded.
    pub fn event_decode_error(&self, pod: PodId) {
        self.lock().health[pod.index()].decode_errors += 1;
        self.metrics.kv_event_decode_errors.with_label_values(&[&self.pods[pod.index()].name]).inc();
    }

    /// `missed` batches were lost before the one just received.
    pub fn event_gap(&self, pod: PodId, missed: u64) {
        {
            let mut core = self.lock();
            let health = &mut core.health[pod.index()];
            health.event_gaps += 1;
            health.batches_missed += missed;
        }
        let name = &self.pods[pod.index()].name;
        self.metrics.kv_event_gaps.with_label_values(&[name]).inc();
        self.metrics.kv_event_batches_missed.with_label_values(&[name]).inc_by(missed);
    }

    /// A duplicate or late batch was dropped.
    pub fn event_stale(&self, pod: PodId) {
        self.lock().health[pod.index()].batches_stale += 1;
        self.metrics.kv_event_batches_stale.with_label_values(&[&self.pods[pod.index()].name]).inc();
    }

    /// The pod's index can no longer be trusted (lost events not replayed, engine restart):
    /// forget it and rebuild from the events that follow.
    pub fn resync(&self, pod: PodId) {
        self.lock().index.clear_pod(pod);
    }

    /// Result of one scrape of a pod's `/metrics`.
    pub fn scraped(&self, pod: PodId, result: Option<ReportedLoad>) {
        let name = &self.pods[pod.index()].name;
        let mut core = self.lock();
        let core = &mut *core;
        let health = &mut core.health[pod.index()];
        match result {
            Some(reported) => {
                if !health.healthy {
                    tracing::info!(pod = %name, "pod is healthy again");
                }
                *health = PodHealth { healthy: true, consecutive_failures: 0, reported: Some(reported), ..*health };
            }
            None => {
                self.metrics.scrape_failures.with_label_values(&[name]).inc();
                health.consecutive_failures += 1;
                if health.healthy && health.consecutive_failures >= self.config.health.unhealthy_after {
                    tracing::warn!(pod = %name, failures = health.consecutive_failures, "pod is unhealthy: not chosen until it answers again");
                    health.healthy = false;
                    health.reported = None;
                    // Its in-flight bookings will not report back in any useful way.
                    core.load.clear_pod(pod);
                }
            }
        }
        self.metrics.pod_healthy.with_label_values(&[name]).set(if core.health[pod.index()].healthy {
            1.0
        } else {
            0.0
        });
    }

    /// Drops expired bookings and approximate entries.
    pub fn expire(&self) {
        let now = self.now();
        let mut core = self.lock();
        let n = core.load.expire(now);
        core.approx.expire(now);
        drop(core);
        self.metrics.bookings_expired.inc_by(n as u64);
    }

    /// True when some pod can take requests.
    pub fn ready(&self) -> bool {
        let core = self.lock();
        self.pods.iter().any(|p| core.health[p.id.index()].healthy && matches!(p.role, Role::Both | Role::Decode))
    }

    /// `GET /v1/pods`; also refreshes the gauges.
    pub fn pods_view(&self) -> Vec<PodView> {
        let now = self.now();
        let core = self.lock();
        let views: Vec<PodView> = self
            .pods
            .iter()
            .map(|p| {
                let h = core.health[p.id.index()];
                let load = core.load.load(p.id, now);
                let cached = if p.precise { core.index.pod_blocks(p.id) } else { core.approx.pod_blocks(p.id) };
                PodView {
                    name: p.name.clone(),
                    address: p.address.clone(),
                    role: p.role,
                    healthy: h.healthy,
                    index: if p.precise { "precise" } else { "approximate" },
                    cached_blocks: cached,
                    inflight_requests: load.inflight_requests,
                    queued_prefill_tokens: load.queued_prefill_tokens,
                    decode_blocks: load.decode_blocks,
                    events_received: h.events_received,
                    event_gaps: h.event_gaps,
                    event_batches_missed: h.batches_missed,
                    event_batches_stale: h.batches_stale,
                    event_decode_errors: h.decode_errors,
                    reported: h.reported.map(|r| ReportedView {
                        running: r.running,
                        waiting: r.waiting,
                        kv_cache_usage: r.kv_cache_usage,
                    }),
                    index_stats: core.index.stats(p.id),
                }
            })
            .collect();
        let (entries, distinct) = (core.index.entries(), core.index.distinct_blocks());
        drop(core);
        for v in &views {
            let index = if v.index == "precise" { "precise" } else { "approximate" };
            self.metrics.index_blocks.with_label_values(&[&v.name, index]).set(v.cached_blocks as f64);
            self.metrics.inflight_requests.with_label_values(&[&v.name]).set(f64::from(v.inflight_requests));
            self.metrics.queued_prefill_tokens.with_label_values(&[&v.name]).set(v.queued_prefill_tokens as f64);
        }
        self.metrics.index_entries.with_label_values(&["block_pod_entries"]).set(entries as f64);
        self.metrics.index_entries.with_label_values(&["distinct_blocks"]).set(distinct as f64);
        views
    }
}
