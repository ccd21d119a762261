//! The scorer's shared state and its operations: route a request, apply a pod's KV events,
//! take lifecycle reports and scrape results, describe the pods.
//!
//! The routing logic itself (index, bookkeeping, policies: a `Router`) lives in
//! `kvgate-routing`; this module holds it behind one mutex, taken briefly per decision and per event batch. The
//! expensive part of a decision — tokenization — happens before the lock.

use crate::admission::{Queue, Refused};
use crate::config::{Config, Role};
use crate::metrics::Metrics;
use crate::prompt::{self, PromptError};
use ahash::AHashMap;
use kvgate_route_api::{Api, LifecycleEvent, LifecycleReport, PodExplain};
use kvgate_routing::events::{EventBatch, KvEvent};
use kvgate_routing::hash::{SequenceHash, root_hash, sequence_hashes};
use kvgate_routing::index::PodIndexStats;
use kvgate_routing::load::{BookingUpdate, Lifecycle, Origin};
use kvgate_routing::pod_set::{PodId, PodSet};
use kvgate_routing::policy::ReportedLoad;
use kvgate_routing::router::{RouteRequest, Router, Unroutable};
use kvgate_tokenize::Tokenizer;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Why no pod was picked (see [`crate::picking`] for what each means to a client).
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("{0}")]
    BadRequest(String),
    /// The body is over the transport's limit (bytes).
    #[error("request body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("no healthy pod can serve this request")]
    NoPod,
    /// Every pod is saturated (only with `admission`): the request should wait.
    #[error("every pod is saturated")]
    Saturated,
    /// Refused for overload: retry after this many seconds.
    #[error("{reason}")]
    Shed { retry_after_seconds: u64, reason: &'static str },
    /// The scorer is shutting down.
    #[error("the scorer is stopping")]
    Stopping,
}

impl From<PromptError> for RouteError {
    fn from(e: PromptError) -> Self {
        RouteError::BadRequest(e.0)
    }
}

/// The client's message for a request refused for overload.
fn shed_message(reason: &str) -> &'static str {
    match reason {
        "sheddable" => "every pod is saturated and this request is sheddable: retry later",
        "queue_full" => "every pod is saturated and the admission queue is full: retry later",
        _ => "every pod is saturated and no room appeared in time: retry later",
    }
}

/// Request bodies at least this large are prepared off the serving thread (≈ 16k tokens).
pub const PREPARE_ASIDE_BYTES: usize = 64 << 10;

/// A lifecycle report's age is believed up to this (a proxy flushes its batches every few
/// milliseconds; an age beyond it is a clock jump or a bug, not a late report).
const MAX_REPORT_AGE_SECONDS: f64 = 10.0;

/// A request ready for a decision: its block chain and sizes ([`Scorer::prepare`]).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub chain: Vec<SequenceHash>,
    pub prompt_tokens: u32,
    pub max_output_tokens: Option<u32>,
}

/// What the entry path asks of a decision besides the request itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Limits<'a> {
    /// Only these pods may serve (the proxy's subset hint).
    pub subset: Option<&'a PodSet>,
    /// Next-best pods to name after the pick, for the proxy's retries.
    pub fallbacks: usize,
    /// Collect every candidate's figures (`?explain=1`).
    pub explain: bool,
    /// Leave the admission headroom free (no more than the default priority).
    pub leave_headroom: bool,
}

/// A decision with its pods resolved: what each entry path maps to its own wire format.
#[derive(Clone, Debug)]
pub struct Pick {
    /// The pod that serves the request (decodes it, when disaggregated).
    pub decode: Arc<Pod>,
    /// The pod that prefills it first, when disaggregated.
    pub prefill: Option<Arc<Pod>>,
    /// Where the proxy retries if `decode` refuses the connection, best first.
    pub fallbacks: Vec<Arc<Pod>>,
    pub policy: &'static str,
    pub prompt_tokens: u32,
    /// Prompt tokens cached where the prompt is computed.
    pub cached_tokens: u32,
    /// Prompt tokens not cached on the best decode-capable pod (what the P/D threshold weighs).
    pub uncached_tokens: u32,
    /// The P/D threshold applied (absent without prefill pods).
    pub threshold_tokens: Option<u32>,
    pub explain: Option<Vec<PodExplain>>,
}

impl Pick {
    /// The pick then its fallbacks, `ip:port,ip:port,…`: the value of
    /// `x-gateway-destination-endpoint` (the GIE convention, what `override_host` walks).
    pub fn destinations(&self) -> String {
        let mut out = self.decode.address.clone();
        for p in &self.fallbacks {
            out.push(',');
            out.push_str(&p.address);
        }
        out
    }
}

/// What the request paths share with the booking sync's tasks (used with `sync`).
#[derive(Default)]
pub struct SyncState {
    /// Bookings changed: the publisher has something to send.
    pub wake: tokio::sync::Notify,
    /// The other replicas' bookings are in (or `join_wait_ms` passed): ready to route.
    pub joined: std::sync::atomic::AtomicBool,
}

/// What the scorer knows of a pod besides routing state (configured or discovered).
#[derive(Clone, Debug)]
pub struct Pod {
    pub id: PodId,
    pub name: String,
    pub address: String,
    pub role: Role,
    /// Indexed from its KV events (else approximately).
    pub precise: bool,
    /// Its `/metrics` are scraped: a scrape brings it back after it was down (without one,
    /// it is tried again after `health.retry_seconds`).
    pub scraped: bool,
}

/// What one scrape of a pod's `/metrics` found.
#[derive(Clone, Copy, Debug)]
pub enum Scrape {
    /// Its load, and its engine's identity when the page has one
    /// (`process_start_time_seconds`: a restart changes it).
    Answered { load: ReportedLoad, started_at: Option<f64> },
    /// The connection was refused or reset: nothing listens there (down at once).
    Refused,
    /// A timeout, an error status, a page without vLLM's metrics (down after
    /// `health.unhealthy_after` in a row: a busy pod may be slow to answer).
    Failed,
}

/// Why a pod stopped being chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownReason {
    /// Its `/metrics` refused the connection.
    ScrapeRefused,
    /// `health.unhealthy_after` scrapes in a row failed.
    ScrapesFailed,
    /// The proxy served a request elsewhere than the pick (the pick refused the connection
    /// or reset before answering, and a fallback answered).
    NotServed,
    /// Its KV-event stream disconnected.
    EventsDisconnected,
}

impl DownReason {
    fn label(self) -> &'static str {
        match self {
            DownReason::ScrapeRefused => "scrape_refused",
            DownReason::ScrapesFailed => "scrapes_failed",
            DownReason::NotServed => "not_served",
            DownReason::EventsDisconnected => "events_disconnected",
        }
    }
}

/// What the scorer counts about a pod beyond what routing needs.
#[derive(Default, Clone, Copy)]
struct PodHealth {
    consecutive_failures: u32,
    /// When it was marked down (seconds since start), while down.
    down_since: Option<f64>,
    /// The engine's `process_start_time_seconds`, as last scraped.
    started_at: Option<f64>,
    events_received: u64,
    event_gaps: u64,
    batches_missed: u64,
    batches_stale: u64,
    decode_errors: u64,
    /// Times the index was cleared because the engine changed (a return from down, a new
    /// start time): the subscriber then catches up from the new engine's replay buffer.
    engine_changes: u64,
}

struct Core {
    router: Router,
    /// Indexed by `PodId`; discovered pods are appended, and keep their id when removed.
    /// Shared so callers take a pod out of the lock without copying its strings.
    pods: Vec<Arc<Pod>>,
    health: Vec<PodHealth>,
    /// Pods by the address the proxy routes to (subset hints, served endpoints).
    by_address: AHashMap<SocketAddr, PodId>,
}

/// Everything the HTTP handlers and background tasks share.
pub struct Scorer {
    pub config: Config,
    pub metrics: Metrics,
    tokenizer: Tokenizer,
    core: Mutex<Core>,
    started: Instant,
    bookings: AtomicU64,
    /// Requests waiting for a pod with room (with `admission`).
    queue: Option<Queue>,
    /// What the booking sync's tasks share with the request paths (used with `sync`).
    sync: SyncState,
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
    /// Blocks its KV connector offloaded to host memory or storage (precise index only).
    pub offloaded_blocks: usize,
    pub inflight_requests: u32,
    pub queued_prefill_tokens: u64,
    pub decode_blocks: f64,
    /// Its prefill time relative to the fleet's average (1 = average), learned from the
    /// first tokens it reported; applied to its costs unless `load.pod_speed.learn` is off.
    pub slowness: f64,
    /// The (decayed) count of first tokens that taught it.
    pub slowness_samples: f64,
    /// Tokens per second one sequence decodes there, learned from `done` reports with
    /// output tokens (absent until enough arrived).
    pub decode_tokens_per_second: Option<f64>,
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

impl Scorer {
    /// Builds the scorer. Without a real tokenizer every pod is indexed approximately: the
    /// fallback's token ids are not the engines', so their events could never match.
    pub fn new(config: Config, tokenizer: Tokenizer) -> Self {
        let mut router = Router::new(&config.router_config());
        if config.sync.is_some() {
            router.share_bookings();
        }
        let core = Core { router, pods: Vec::new(), health: Vec::new(), by_address: AHashMap::new() };
        let scorer = Self {
            metrics: Metrics::new(),
            tokenizer,
            core: Mutex::new(core),
            started: Instant::now(),
            bookings: AtomicU64::new(0),
            queue: config.admission.as_ref().map(|a| Queue::new(a.queue_limit)),
            sync: SyncState::default(),
            config,
        };
        for p in &scorer.config.pods {
            scorer.add_pod(&p.name, &p.address, p.role, p.kv_events.is_some(), p.metrics.is_some());
        }
        scorer
    }

    /// Adds a pod (healthy: scraping demotes it after consecutive failures) and returns its
    /// id. `has_events`: it publishes KV events, so it is indexed precisely when the
    /// tokenizer is exact (the fallback's token ids could never match an engine's).
    pub fn add_pod(&self, name: &str, address: &str, role: Role, has_events: bool, scraped: bool) -> PodId {
        let precise = has_events && self.tokenizer.is_exact();
        let mut core = self.lock();
        let id = core.router.add_pod(role, precise);
        core.router.set_pod_key(id, address);
        core.pods.push(Arc::new(Pod {
            id,
            name: name.to_string(),
            address: address.to_string(),
            role,
            precise,
            scraped,
        }));
        core.health.push(PodHealth::default());
        // Configured and discovered addresses are `ip:port` (validated); a later pod at the
        // same address (discovery re-adding it with another role) takes it over.
        if let Ok(socket) = address.parse() {
            core.by_address.insert(socket, id);
        }
        drop(core);
        self.metrics.pod_healthy.with_label_values(&[name]).set(1.0);
        id
    }

    /// Discovery lost the pod: it is not chosen and its index and bookings are dropped.
    pub fn remove_pod(&self, pod: PodId) {
        let mut core = self.lock();
        core.router.remove_pod(pod);
        core.health[pod.index()] = PodHealth::default();
        let p = core.pods[pod.index()].clone();
        drop(core);
        self.metrics.pod_healthy.with_label_values(&[&p.name]).set(0.0);
    }

    /// A removed pod is back at the same address.
    pub fn restore_pod(&self, pod: PodId) {
        let mut core = self.lock();
        core.router.restore_pod(pod);
        let p = core.pods[pod.index()].clone();
        drop(core);
        self.metrics.pod_healthy.with_label_values(&[&p.name]).set(1.0);
    }

    /// The pod with id `pod`.
    pub fn pod(&self, pod: PodId) -> Arc<Pod> {
        self.lock().pods[pod.index()].clone()
    }

    /// Pods known so far (removed ones included).
    pub fn num_pods(&self) -> usize {
        self.lock().pods.len()
    }

    /// A number for a booking id no other request of this process has (the Endpoint Picker
    /// books under its own ids: clients' `x-request-id`s may repeat).
    pub fn next_booking(&self) -> u64 {
        self.bookings.fetch_add(1, Ordering::Relaxed)
    }

    /// Seconds since start: the clock of bookings and TTLs.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Core> {
        // A panic while holding the lock would be a bug; keep serving rather than cascade.
        self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The lock-free half of a decision: the body parsed once, tokenized as the engine will
    /// tokenize it, and hashed into its block chain. CPU-bound (tokenization), no shared
    /// state touched: both entry paths (the filter's route call, the Endpoint Picker) call it
    /// before [`Scorer::decide`].
    pub fn prepare(&self, api: Api, body: &[u8]) -> Result<Prepared, RouteError> {
        let t0 = Instant::now();
        let info = prompt::extract(&self.tokenizer, api, body, &self.config.lora_adapters)?;
        self.metrics.tokenize_seconds.with_label_values(&[api.label()]).observe(t0.elapsed().as_secs_f64());
        let mut chain = Vec::with_capacity(info.tokens.len() / self.config.block_size + 1);
        let root = root_hash(info.lora_name.as_deref(), info.cache_salt.as_deref());
        sequence_hashes(root, &info.tokens, self.config.block_size, &mut chain);
        Ok(Prepared { chain, prompt_tokens: info.tokens.len() as u32, max_output_tokens: info.max_output_tokens })
    }

    /// [`Scorer::prepare`] for a body the caller hands over: one of
    /// [`PREPARE_ASIDE_BYTES`] or more is prepared on the blocking pool, so that its
    /// tokenization (milliseconds for a new document of tens of thousands of tokens) does
    /// not hold up the other calls served on the same thread.
    pub async fn prepare_owned(self: &Arc<Self>, api: Api, body: bytes::Bytes) -> Result<Prepared, RouteError> {
        if body.len() < PREPARE_ASIDE_BYTES {
            return self.prepare(api, &body);
        }
        let scorer = self.clone();
        match tokio::task::spawn_blocking(move || scorer.prepare(api, &body)).await {
            Ok(prepared) => prepared,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(RouteError::Stopping), // the runtime is shutting down
        }
    }

    /// The pods at these addresses (unknown ones are left out): a proxy's subset hint.
    pub fn pods_at(&self, addresses: &[SocketAddr]) -> PodSet {
        let core = self.lock();
        addresses.iter().filter_map(|a| core.by_address.get(a).copied()).collect()
    }

    /// Chooses the pod for one prepared request — or, when disaggregation pays off, a prefill
    /// pod and a decode pod — under the shared lock, books it, and counts it.
    pub fn decide(&self, request_id: &str, prepared: &Prepared, limits: &Limits<'_>) -> Result<Pick, RouteError> {
        let t1 = Instant::now();
        let request = RouteRequest {
            subset: limits.subset,
            fallbacks: limits.fallbacks,
            leave_headroom: limits.leave_headroom,
            ..RouteRequest::new(request_id, &prepared.chain, prepared.prompt_tokens, prepared.max_output_tokens)
        };
        let now = self.now();
        let mut core = self.lock();
        let routed = core.router.route(&request, now).map_err(|e| match e {
            Unroutable::NoPod => RouteError::NoPod,
            Unroutable::Saturated => RouteError::Saturated,
        })?;
        self.bookings_changed();
        let pod = |id: PodId| core.pods[id.index()].clone();
        let decode = pod(routed.decode.pod);
        let prefill = routed.prefill.map(|p| pod(p.pod));
        let fallbacks: Vec<Arc<Pod>> = routed.fallbacks.iter().map(|&id| pod(id)).collect();
        // Every candidate, when explaining (disaggregated: the decode candidates).
        let explained: Vec<Arc<Pod>> =
            if limits.explain { routed.candidates.iter().map(|c| pod(c.pod)).collect() } else { Vec::new() };
        drop(core);

        let explain = limits.explain.then(|| {
            routed
                .candidates
                .iter()
                .zip(&routed.decision.costs)
                .zip(&explained)
                .enumerate()
                .map(|(i, ((c, cost), p))| PodExplain {
                    pod: p.name.clone(),
                    address: p.address.clone(),
                    cached_blocks: c.cached_tokens / self.config.block_size as u32,
                    cached_tokens: c.cached_tokens,
                    offloaded_tokens: c.offloaded_tokens,
                    queued_prefill_tokens: c.load.queued_prefill_tokens,
                    decode_blocks: c.load.decode_blocks,
                    inflight_requests: c.load.inflight_requests,
                    slowness: c.slowness,
                    cost: *cost,
                    chosen: i == routed.decision.chosen,
                })
                .collect()
        });
        let cached_tokens = routed.cached_tokens();
        let prompt_tokens = prepared.prompt_tokens;
        let policy = routed.policy;
        self.metrics.decisions.with_label_values(&[policy, &decode.name]).inc();
        self.metrics.decisions_by_path.with_label_values(&[if prefill.is_some() { "pd" } else { "direct" }]).inc();
        self.metrics.decision_seconds.observe(t1.elapsed().as_secs_f64());
        self.metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
        self.metrics.cached_tokens.inc_by(u64::from(cached_tokens));
        self.metrics
            .prefix_hit_ratio
            .with_label_values(&[policy])
            .inc_by(f64::from(cached_tokens) / f64::from(prompt_tokens.max(1)));
        Ok(Pick {
            decode,
            prefill,
            fallbacks,
            policy,
            prompt_tokens,
            cached_tokens,
            uncached_tokens: routed.uncached_tokens,
            threshold_tokens: routed.prefill_pods.then_some(self.config.pd.threshold_tokens),
            explain,
        })
    }

    /// [`Scorer::decide`], waiting in the admission queue while every pod is saturated: the
    /// request gets a pod when one has room, in the order of priority (from `objective`,
    /// the request's `x-gateway-inference-objective`) then arrival; sheddable requests
    /// (negative priority) are refused at once, the others once `admission.max_wait_ms` has
    /// passed or when the queue is full of more important ones.
    pub async fn decide_admitted(
        &self,
        request_id: &str,
        prepared: &Prepared,
        limits: &Limits<'_>,
        objective: Option<&str>,
    ) -> Result<Pick, RouteError> {
        let (Some(queue), Some(admission)) = (&self.queue, &self.config.admission) else {
            return self.decide(request_id, prepared, limits);
        };
        let priority =
            objective.and_then(|o| admission.objectives.get(o)).copied().unwrap_or(admission.default_priority);
        let arrived = Instant::now();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(admission.max_wait_ms);
        let retry_after_seconds = admission.max_wait_ms.div_ceil(1000).max(1);
        let shed = |reason: &'static str| {
            self.metrics.admission_refused.with_label_values(&[reason]).inc();
            Err(RouteError::Shed { retry_after_seconds, reason: shed_message(reason) })
        };
        let limits = &Limits { leave_headroom: priority <= admission.default_priority, ..*limits };
        let ticket = queue.ticket(priority);
        // Counted as waiting from its first wait to its decision.
        let mut held = None;
        // A newcomer goes behind those waiting with its priority or above.
        let mut try_now = !queue.ahead_of(priority);
        loop {
            if try_now {
                match self.decide(request_id, prepared, limits) {
                    Err(RouteError::Saturated) => {}
                    decided => {
                        if held.is_some() {
                            self.metrics.admission_wait_seconds.observe(arrived.elapsed().as_secs_f64());
                        }
                        if decided.is_ok() && !queue.is_empty() {
                            queue.wake_first(); // there may be room for the next one too
                        }
                        return decided;
                    }
                }
            }
            try_now = true;
            if priority < 0 {
                return shed("sheddable");
            }
            let woken = match queue.wait(ticket) {
                Ok(woken) => woken,
                Err(Refused::QueueFull) => return shed("queue_full"),
            };
            held.get_or_insert_with(|| queue.hold(&self.metrics.admission_waiting));
            match tokio::time::timeout_at(deadline, woken).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return shed("queue_full"), // a more important request took the place
                Err(_) => {
                    queue.leave(ticket);
                    return shed("deadline");
                }
            }
        }
    }

    /// Requests waiting in the admission queue now (not counting those being answered).
    pub fn admission_waiting(&self) -> usize {
        self.queue.as_ref().map_or(0, Queue::held)
    }

    /// Changes whenever requests start waiting for admission or none waits any more; `None`
    /// without admission.
    pub fn admission_queuing(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        self.queue.as_ref().map(Queue::queuing)
    }

    /// Room may have appeared on some pod: the first waiter tries again.
    fn room_may_have_appeared(&self) {
        if let Some(queue) = &self.queue {
            queue.wake_first();
        }
    }

    /// Applies a batch of lifecycle reports (the filter's); returns how many named no
    /// in-flight request. Each report is dated by its age (the filter batches them): a first
    /// token reported 15 ms late still ends its prefill where it ended.
    pub fn lifecycle(&self, reports: &[LifecycleReport]) -> usize {
        let now = self.now();
        let mut core = self.lock();
        let unknown = reports
            .iter()
            .filter(|r| {
                let age = r.age_us.map_or(0.0, |us| (f64::from(us) / 1e6).min(MAX_REPORT_AGE_SECONDS));
                let at = (now - age).max(0.0);
                // Where it was served comes with the first token: the booking follows first.
                if let Some(served) = r.served.as_deref().and_then(|a| a.parse().ok()) {
                    self.served_locked(&mut core, &r.request_id, served, at);
                }
                !self.report_locked(&mut core, &r.request_id, r.event, r.output_tokens, at)
            })
            .count();
        drop(core);
        self.bookings_changed();
        self.metrics.lifecycle_unknown.inc_by(unknown as u64);
        self.room_may_have_appeared();
        unknown
    }

    /// One lifecycle event of a request (the Endpoint Picker's, read from the response it
    /// relays); false if it named no in-flight request.
    pub fn report(&self, request_id: &str, event: LifecycleEvent, output_tokens: Option<u32>) -> bool {
        let now = self.now();
        let known = self.report_locked(&mut self.lock(), request_id, event, output_tokens, now);
        if !known {
            self.metrics.lifecycle_unknown.inc();
        }
        self.bookings_changed();
        self.room_may_have_appeared();
        known
    }

    fn report_locked(
        &self,
        core: &mut Core,
        request_id: &str,
        event: LifecycleEvent,
        output_tokens: Option<u32>,
        now: f64,
    ) -> bool {
        let (lifecycle, label) = match event {
            LifecycleEvent::FirstToken => (Lifecycle::FirstToken, "first_token"),
            LifecycleEvent::Done => (Lifecycle::Done, "done"),
            LifecycleEvent::Cancelled => (Lifecycle::Cancelled, "cancelled"),
            LifecycleEvent::PrefillDone => (Lifecycle::Done, "prefill_done"),
        };
        self.metrics.lifecycle_reports.with_label_values(&[label]).inc();
        if let Some(n) = output_tokens {
            self.metrics.output_tokens.inc_by(u64::from(n));
            if event == LifecycleEvent::Done {
                core.router.decoded(request_id, n, now);
            }
        }
        core.router.report(request_id, lifecycle, event == LifecycleEvent::PrefillDone, now).is_ok()
    }

    /// The proxy reports that `address` served the request (its retries may have moved it
    /// off the pick): the booking follows.
    pub fn served(&self, request_id: &str, address: SocketAddr) {
        let now = self.now();
        self.served_locked(&mut self.lock(), request_id, address, now);
        self.bookings_changed();
    }

    /// Wakes the booking sync's publisher (with `sync`): bookings changed.
    fn bookings_changed(&self) {
        if self.config.sync.is_some() {
            self.sync.wake.notify_one();
        }
    }

    /// The booking sync's shared state.
    pub fn sync_state(&self) -> &SyncState {
        &self.sync
    }

    /// This replica's booking changes since the last call, and the pod table that names
    /// their pods.
    pub fn take_shared(&self) -> (Vec<BookingUpdate>, Vec<Arc<Pod>>) {
        let mut core = self.lock();
        (core.router.take_shared(), core.pods.clone())
    }

    /// At one instant: the changes not yet taken, then this replica's bookings as a
    /// snapshot, and the pod table.
    pub fn snapshot_shared(&self) -> (Vec<BookingUpdate>, Vec<BookingUpdate>, Vec<Arc<Pod>>) {
        let mut core = self.lock();
        (core.router.take_shared(), core.router.snapshot(), core.pods.clone())
    }

    /// Pods by the address the proxy routes to.
    pub fn addresses(&self) -> AHashMap<SocketAddr, PodId> {
        self.lock().by_address.clone()
    }

    /// Applies another replica's booking changes; returns how many named a booking this
    /// replica does not hold (expired here, or reported before its booking arrived).
    pub fn apply_shared(&self, origin: Origin, updates: &[BookingUpdate]) -> usize {
        let now = self.now();
        let mut core = self.lock();
        let unknown = updates.iter().filter(|u| core.router.apply_shared(origin, u, now).is_err()).count();
        drop(core);
        self.room_may_have_appeared();
        unknown
    }

    /// Forgets another replica's bookings; returns how many.
    pub fn clear_origin(&self, origin: Origin) -> usize {
        let n = self.lock().router.clear_origin(origin);
        self.room_may_have_appeared();
        n
    }

    fn served_locked(&self, core: &mut Core, request_id: &str, address: SocketAddr, now: f64) {
        let Some(&pod) = core.by_address.get(&address) else { return };
        if let Ok(Some(picked)) = core.router.served(request_id, pod, now) {
            self.metrics.bookings_moved.inc();
            // The pick did not answer (refused, or reset before a response): the first
            // failed connection heard of takes it out until it proves alive again.
            self.pod_down(core, picked, DownReason::NotServed, now);
        }
    }

    /// Takes a pod out of the choice (its bookings released): it comes back with a
    /// successful scrape (unscraped pods: after `health.retry_seconds`).
    fn pod_down(&self, core: &mut Core, pod: PodId, reason: DownReason, now: f64) {
        if !core.router.is_healthy(pod) {
            return;
        }
        core.router.unhealthy(pod);
        core.health[pod.index()].down_since = Some(now);
        let name = &core.pods[pod.index()].name;
        tracing::warn!(pod = %name, reason = reason.label(), "pod is down: not chosen until it answers again");
        self.metrics.pods_down.with_label_values(&[name, reason.label()]).inc();
        self.metrics.pod_healthy.with_label_values(&[name]).set(0.0);
    }

    /// The pod's KV-event stream disconnected (its engine stopped, or the network broke).
    pub fn events_disconnected(&self, pod: PodId) {
        let now = self.now();
        let mut core = self.lock();
        if core.router.is_present(pod) {
            self.pod_down(&mut core, pod, DownReason::EventsDisconnected, now);
        }
    }

    /// A pod back from down: its index cannot be trusted unless its engine is known to be
    /// the same one (a restarted engine has an empty cache; forgetting costs less than
    /// believing).
    fn pod_up(&self, core: &mut Core, pod: PodId, same_engine: bool) {
        let name = core.pods[pod.index()].name.clone();
        core.health[pod.index()].down_since = None;
        if same_engine {
            tracing::info!(pod = %name, "pod is back (same engine): index kept");
        } else {
            Self::engine_changed(core, pod);
            tracing::info!(pod = %name, "pod is back: index cleared, rebuilt from its events");
        }
        self.metrics.pod_healthy.with_label_values(&[&name]).set(1.0);
    }

    /// Applies one decoded event batch of a pod.
    pub fn apply_events(&self, pod: PodId, batch: &EventBatch<'_>) {
        let (mut stored, mut removed, mut cleared) = (0u64, 0u64, 0u64);
        for e in &batch.events {
            match e {
                KvEvent::BlockStored(s) => stored += s.block_hashes.len() as u64,
                KvEvent::BlockRemoved { block_hashes, .. } => removed += block_hashes.len() as u64,
                KvEvent::AllBlocksCleared => cleared += 1,
                KvEvent::Unknown(_) => {}
            }
        }
        let p = {
            let mut core = self.lock();
            core.router.apply_events(pod, batch);
            core.health[pod.index()].events_received += 1;
            core.pods[pod.index()].clone()
        };
        for (kind, n) in [("block_stored", stored), ("block_removed", removed), ("all_blocks_cleared", cleared)] {
            if n > 0 {
                self.metrics.kv_events.with_label_values(&[p.name.as_str(), kind]).inc_by(n);
            }
        }
    }

    /// A message from the pod's event socket could not be decoded.
    pub fn event_decode_error(&self, pod: PodId) {
        self.lock().health[pod.index()].decode_errors += 1;
        self.metrics.kv_event_decode_errors.with_label_values(&[&self.pod(pod).name]).inc();
    }

    /// `missed` batches were lost before the one just received.
    pub fn event_gap(&self, pod: PodId, missed: u64) {
        {
            let mut core = self.lock();
            let health = &mut core.health[pod.index()];
            health.event_gaps += 1;
            health.batches_missed += missed;
        }
        let name = &self.pod(pod).name;
        self.metrics.kv_event_gaps.with_label_values(&[name]).inc();
        self.metrics.kv_event_batches_missed.with_label_values(&[name]).inc_by(missed);
    }

    /// A duplicate or late batch was dropped.
    pub fn event_stale(&self, pod: PodId) {
        self.lock().health[pod.index()].batches_stale += 1;
        self.metrics.kv_event_batches_stale.with_label_values(&[&self.pod(pod).name]).inc();
    }

    /// The pod's index can no longer be trusted (lost events not replayed, engine restart):
    /// forget it and rebuild from the events that follow.
    pub fn resync(&self, pod: PodId) {
        self.lock().router.clear_index(pod);
    }

    /// The pod's engine may be another one than its index was built from: forget it all.
    fn engine_changed(core: &mut Core, pod: PodId) {
        core.router.clear_index(pod);
        core.health[pod.index()].engine_changes += 1;
    }

    /// How many times the pod's engine was found changed ([`Scorer::resync`] aside): a
    /// subscriber that sees this grow judges the stream afresh, catching up from replay.
    pub fn engine_changes(&self, pod: PodId) -> u64 {
        self.lock().health[pod.index()].engine_changes
    }

    /// Result of one scrape of a pod's `/metrics`.
    pub fn scraped(&self, pod: PodId, scrape: Scrape) {
        let now = self.now();
        let mut core = self.lock();
        let core = &mut *core;
        if !core.router.is_present(pod) {
            return; // removed by discovery while this scrape was in flight
        }
        let was_healthy = core.router.is_healthy(pod);
        match scrape {
            Scrape::Answered { load, started_at } => {
                let health = &mut core.health[pod.index()];
                health.consecutive_failures = 0;
                let known = health.started_at;
                health.started_at = started_at.or(known);
                let same_engine = matches!((known, started_at), (Some(a), Some(b)) if a == b);
                let restarted = matches!((known, started_at), (Some(a), Some(b)) if a != b);
                core.router.reported(pod, load);
                let dropped = core.router.reconcile(pod, now);
                if dropped > 0 {
                    self.metrics.bookings_reconciled.inc_by(dropped as u64);
                    tracing::debug!(pod = %core.pods[pod.index()].name, dropped, "bookings the engine does not hold dropped");
                }
                self.room_may_have_appeared();
                if !was_healthy {
                    self.pod_up(core, pod, same_engine);
                } else if restarted {
                    // Restarted between two scrapes, unnoticed otherwise: its cache is empty.
                    Self::engine_changed(core, pod);
                    tracing::warn!(pod = %core.pods[pod.index()].name, "engine restarted (new process start time): index cleared");
                    self.metrics.engine_restarts.with_label_values(&[&core.pods[pod.index()].name]).inc();
                }
            }
            Scrape::Refused => {
                self.metrics.scrape_failures.with_label_values(&[&core.pods[pod.index()].name]).inc();
                self.pod_down(core, pod, DownReason::ScrapeRefused, now);
            }
            Scrape::Failed => {
                self.metrics.scrape_failures.with_label_values(&[&core.pods[pod.index()].name]).inc();
                let health = &mut core.health[pod.index()];
                health.consecutive_failures += 1;
                if health.consecutive_failures >= self.config.health.unhealthy_after {
                    self.pod_down(core, pod, DownReason::ScrapesFailed, now);
                }
            }
        }
    }

    /// Drops expired bookings and approximate entries.
    pub fn expire(&self) {
        let now = self.now();
        let mut core = self.lock();
        let n = core.router.expire(now);
        // Pods nobody scrapes are tried again after a while (their next failure takes them
        // out again).
        let retry = self.config.health.retry_seconds;
        let due: Vec<PodId> = core
            .pods
            .iter()
            .filter(|p| !p.scraped && core.router.is_present(p.id))
            .filter(|p| core.health[p.id.index()].down_since.is_some_and(|t| now - t >= retry))
            .map(|p| p.id)
            .collect();
        for pod in due {
            core.router.retry(pod);
            self.pod_up(&mut core, pod, false);
        }
        drop(core);
        self.metrics.bookings_expired.inc_by(n as u64);
        self.room_may_have_appeared();
    }

    /// True when some pod can take requests.
    pub fn ready(&self) -> bool {
        let joined = self.config.sync.is_none() || self.sync.joined.load(Ordering::Relaxed);
        joined && self.lock().router.ready()
    }

    /// `GET /v1/pods`; also refreshes the gauges.
    pub fn pods_view(&self) -> Vec<PodView> {
        let now = self.now();
        let core = self.lock();
        let views: Vec<PodView> = core
            .pods
            .iter()
            .filter(|p| core.router.is_present(p.id))
            .map(|p| {
                let h = core.health[p.id.index()];
                let load = core.router.load().load(p.id, now);
                let cached = core.router.pod_blocks(p.id);
                let speed = core.router.load().speed(p.id);
                PodView {
                    name: p.name.clone(),
                    address: p.address.clone(),
                    role: p.role,
                    healthy: core.router.is_healthy(p.id),
                    index: if p.precise { "precise" } else { "approximate" },
                    cached_blocks: cached,
                    offloaded_blocks: core.router.index().pod_offloaded_blocks(p.id),
                    inflight_requests: load.inflight_requests,
                    queued_prefill_tokens: load.queued_prefill_tokens,
                    decode_blocks: load.decode_blocks,
                    slowness: speed.slowness,
                    slowness_samples: speed.samples,
                    decode_tokens_per_second: speed.decode_tokens_per_second,
                    events_received: h.events_received,
                    event_gaps: h.event_gaps,
                    event_batches_missed: h.batches_missed,
                    event_batches_stale: h.batches_stale,
                    event_decode_errors: h.decode_errors,
                    reported: core.router.reported_load(p.id).map(|r| ReportedView {
                        running: r.running,
                        waiting: r.waiting,
                        kv_cache_usage: r.kv_cache_usage,
                    }),
                    index_stats: core.router.index().stats(p.id),
                }
            })
            .collect();
        let (entries, distinct) = (core.router.index().entries(), core.router.index().distinct_blocks());
        drop(core);
        for v in &views {
            let index = if v.index == "precise" { "precise" } else { "approximate" };
            self.metrics.index_blocks.with_label_values(&[&v.name, index]).set(v.cached_blocks as f64);
            if v.index == "precise" {
                self.metrics.index_blocks.with_label_values(&[&v.name, "offloaded"]).set(v.offloaded_blocks as f64);
            }
            self.metrics.inflight_requests.with_label_values(&[&v.name]).set(f64::from(v.inflight_requests));
            self.metrics.queued_prefill_tokens.with_label_values(&[&v.name]).set(v.queued_prefill_tokens as f64);
            self.metrics.pod_slowness.with_label_values(&[&v.name]).set(v.slowness);
        }
        self.metrics.index_entries.with_label_values(&["block_pod_entries"]).set(entries as f64);
        self.metrics.index_entries.with_label_values(&["distinct_blocks"]).set(distinct as f64);
        if let Some(stats) = self.tokenizer.segment_cache_stats() {
            for (outcome, total) in [("hit", stats.hits), ("miss", stats.misses)] {
                let counter = self.metrics.tokenizer_cache_pieces.with_label_values(&[outcome]);
                counter.inc_by(total.saturating_sub(counter.get()));
            }
            self.metrics.tokenizer_cache_tokens.set(i64::try_from(stats.tokens).unwrap_or(i64::MAX));
        }
        views
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scorer(extra: &str) -> Scorer {
        let config = Config::parse(&format!(
            "{extra}pods:\n  - {{name: a, address: '10.0.0.1:8000', metrics: 'http://10.0.0.1:8000/metrics'}}\n  - {{name: b, address: '10.0.0.2:8000'}}\n"
        ))
        .unwrap();
        Scorer::new(config, Tokenizer::fallback())
    }

    fn decide(s: &Scorer, id: &str) -> Pick {
        let prepared = s.prepare(Api::Completions, br#"{"prompt": "abcdefgh", "max_tokens": 2}"#).unwrap();
        s.decide(id, &prepared, &Limits { fallbacks: 1, ..Limits::default() }).unwrap()
    }

    fn report(id: &str, event: LifecycleEvent, served: Option<&str>) -> LifecycleReport {
        LifecycleReport {
            request_id: id.into(),
            event,
            output_tokens: None,
            served: served.map(str::to_string),
            age_us: None,
        }
    }

    #[tokio::test]
    async fn a_large_body_prepared_aside_is_prepared_alike() {
        let s = Arc::new(scorer(""));
        let inline = PREPARE_ASIDE_BYTES / 2;
        for size in [inline, PREPARE_ASIDE_BYTES, 3 * PREPARE_ASIDE_BYTES] {
            let prompt = "abcd".repeat(size / 4);
            let body = serde_json::to_vec(&serde_json::json!({"prompt": prompt, "max_tokens": 3})).unwrap();
            let here = s.prepare(Api::Completions, &body).unwrap();
            let owned = s.prepare_owned(Api::Completions, body.into()).await.unwrap();
            assert_eq!(
                (owned.chain, owned.prompt_tokens, owned.max_output_tokens),
                (here.chain, here.prompt_tokens, here.max_output_tokens)
            );
        }
        let bad = format!("{{\"prompt\": \"{}", "abcd".repeat(PREPARE_ASIDE_BYTES / 4));
        let e = s.prepare_owned(Api::Completions, bad.into()).await.unwrap_err();
        assert!(matches!(e, RouteError::BadRequest(ref m) if m.contains("not valid JSON")), "{e}");
    }

    #[test]
    fn a_report_served_elsewhere_moves_the_booking_and_takes_the_pick_out() {
        let s = scorer("policy: {name: round-robin}\nhealth: {retry_seconds: 0.1}\n");
        decide(&s, "r0"); // round robin: the next pick is `b`, which nobody scrapes
        s.lifecycle(&[report("r0", LifecycleEvent::Done, None)]);
        let pick = decide(&s, "r1");
        assert!(!pick.decode.scraped);
        let other = pick.fallbacks[0].clone();
        assert_eq!(s.lifecycle(&[report("r1", LifecycleEvent::FirstToken, Some(&other.address))]), 0);
        assert_eq!(s.metrics.bookings_moved.get(), 1);
        let views = s.pods_view();
        let view = |name: &str| views.iter().find(|v| v.name == name).unwrap();
        assert!(!view(&pick.decode.name).healthy, "the pick did not answer: out");
        assert_eq!(view(&other.name).inflight_requests, 1);
        assert_eq!(s.lifecycle(&[report("r1", LifecycleEvent::Done, None)]), 0);
        // Only `other` is chosen now.
        for i in 0..4 {
            assert_eq!(decide(&s, &format!("x{i}")).decode.name, other.name);
        }
        // Nobody scrapes it: it is tried again after `health.retry_seconds`.
        std::thread::sleep(std::time::Duration::from_millis(150));
        s.expire();
        let picked: Vec<String> = (0..4).map(|i| decide(&s, &format!("y{i}")).decode.name.clone()).collect();
        assert!(picked.contains(&pick.decode.name), "{picked:?}");
    }

    #[test]
    fn done_reports_with_output_tokens_teach_the_pods_decode_speed() {
        let s = scorer("policy: {name: round-robin}\nload: {pod_speed: {prior_samples: 2}}\n");
        let speed = |s: &Scorer, name: &str| {
            s.pods_view().into_iter().find(|v| v.name == name).unwrap().decode_tokens_per_second
        };
        for i in 0..4 {
            let id = format!("r{i}");
            let pod = decide(&s, &id).decode.name.clone();
            s.lifecycle(&[report(&id, LifecycleEvent::FirstToken, None)]);
            std::thread::sleep(std::time::Duration::from_millis(20));
            // 5 tokens: 4 after the first, in at least 20 ms.
            let done = LifecycleReport { output_tokens: Some(5), ..report(&id, LifecycleEvent::Done, None) };
            assert_eq!(s.lifecycle(&[done]), 0);
            assert_eq!(pod, if i % 2 == 0 { "a" } else { "b" });
        }
        for pod in ["a", "b"] {
            let learned = speed(&s, pod).expect("two reports each");
            assert!(learned > 0.0 && learned <= 200.0, "{pod}: {learned}");
        }
        // Without output tokens nothing is learned.
        let s = scorer("load: {pod_speed: {prior_samples: 1}}\n");
        decide(&s, "x");
        s.lifecycle(&[report("x", LifecycleEvent::FirstToken, None), report("x", LifecycleEvent::Done, None)]);
        assert!(speed(&s, "a").is_none() && speed(&s, "b").is_none());
    }

    #[test]
    fn batched_reports_are_dated_by_their_age() {
        let s = scorer("policy: {name: round-robin}\nload: {pod_speed: {prior_samples: 2}}\n");
        std::thread::sleep(std::time::Duration::from_millis(120)); // a past to date them in
        for id in ["r0", "r1", "r2", "r3"] {
            decide(&s, id);
            // One batch: the first token 100 ms before the end, 5 tokens in all.
            let first = LifecycleReport { age_us: Some(100_000), ..report(id, LifecycleEvent::FirstToken, None) };
            let done =
                LifecycleReport { output_tokens: Some(5), age_us: Some(0), ..report(id, LifecycleEvent::Done, None) };
            assert_eq!(s.lifecycle(&[first, done]), 0);
        }
        for view in s.pods_view() {
            // 4 tokens after the first in 0.1 s; undated, both would fall at one instant.
            let learned = view.decode_tokens_per_second.expect("two reports each");
            assert!((learned - 40.0).abs() < 1e-6, "{}: {learned}", view.name);
        }
        // An age beyond belief is capped, not taken back past the scorer's start.
        decide(&s, "late");
        let ancient = LifecycleReport { age_us: Some(u32::MAX), ..report("late", LifecycleEvent::Done, None) };
        assert_eq!(s.lifecycle(&[ancient]), 0);
        assert_eq!(s.pods_view().iter().map(|v| v.inflight_requests).sum::<u32>(), 0);
    }

    #[test]
    fn a_new_engine_identity_or_a_return_from_down_clears_the_index_unless_the_engine_is_the_same() {
        let s = scorer("");
        let a = PodId(0);
        // `a` is indexed by what is routed there (no exact tokenizer here): one request.
        let stored = |s: &Scorer| {
            let prepared = s
                .prepare(
                    Api::Completions,
                    &serde_json::to_vec(&serde_json::json!({"prompt": "x".repeat(256)})).unwrap(),
                )
                .unwrap();
            let only_a: PodSet = [a].into_iter().collect();
            let pick = s.decide("warm", &prepared, &Limits { subset: Some(&only_a), ..Limits::default() }).unwrap();
            s.report("warm", LifecycleEvent::Done, None);
            assert_eq!(pick.decode.id, a);
        };
        let blocks = |s: &Scorer| s.lock().router.pod_blocks(a);
        let answered = |started_at| Scrape::Answered { load: ReportedLoad::default(), started_at: Some(started_at) };
        s.scraped(a, answered(100.0));
        stored(&s);
        assert_eq!(blocks(&s), 4);
        s.scraped(a, answered(100.0));
        assert_eq!(blocks(&s), 4, "same engine: kept");
        s.scraped(a, answered(200.0));
        assert_eq!(blocks(&s), 0, "restarted between scrapes: cleared");
        stored(&s);
        s.scraped(a, Scrape::Refused);
        assert!(!s.lock().router.is_healthy(a), "a refused connection takes it out at once");
        s.scraped(a, answered(200.0));
        assert_eq!(blocks(&s), 4, "back, the same engine: kept");
        s.scraped(a, Scrape::Refused);
        s.scraped(a, answered(300.0));
        assert_eq!(blocks(&s), 0, "back as another engine: cleared");
        assert!(s.lock().router.is_healthy(a));
        // Slow scrapes: out only after `health.unhealthy_after` (3) in a row.
        for _ in 0..2 {
            s.scraped(a, Scrape::Failed);
        }
        assert!(s.lock().router.is_healthy(a));
        s.scraped(a, Scrape::Failed);
        assert!(!s.lock().router.is_healthy(a));
    }
}
