//! The scorer's shared state: the routing state machine (a `Router`, in `kvgate-routing`) and
//! what the runtime knows of each pod beside it, behind one mutex taken briefly per decision,
//! report and event batch (the expensive part of a decision — tokenization — happens before
//! it). Its operations, by responsibility:
//!
//! - [`deciding`]: a request prepared (parsed, tokenized, hashed) and decided, waiting for
//!   admission while every pod is saturated;
//! - [`bookings`]: lifecycle reports, served endpoints, and the bookings shared with other
//!   replicas;
//! - [`pod_health`]: scrapes, event streams, pods going down and coming back;
//! - [`view`]: what `/v1/pods` and the gauges show.
//!
//! The lock's waits are counted (`kvgate_state_lock_waits_total`,
//! `kvgate_state_lock_wait_seconds`), so whether it is contended is measured, not guessed.

mod bookings;
mod deciding;
mod pod_health;
mod view;

pub use deciding::{Limits, PREPARE_ASIDE_BYTES, Pick, PickError, Prepared};
pub use pod_health::{DownReason, Scrape};
pub use view::PodView;

use crate::admission::Queue;
use crate::config::{Config, Role};
use crate::engine_pages::PodAdapters;
use crate::metrics::Metrics;
use crate::prompt::{Adapters, ModelTokenizers};
use crate::rewrites::ModelRewrites;
use ahash::AHashMap;
use kvgate_routing::pod_set::{PodId, PodMap, PodSet};
use kvgate_routing::router::{ModelId, Router};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, TryLockError};
use std::time::Instant;

/// What the request paths share with the booking sync's tasks (used with `sync`).
#[derive(Default)]
pub struct SyncState {
    /// Bookings changed: the publisher has something to send.
    pub wake: tokio::sync::Notify,
    /// The other replicas' bookings are in (or `join_wait_ms` passed): ready to route.
    pub joined: std::sync::atomic::AtomicBool,
}

/// How the scorer names and reaches a pod (configured or discovered).
#[derive(Clone, Debug, Default)]
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

/// What the scorer counts about a pod beyond what routing needs.
#[derive(Default, Clone, Copy)]
struct PodHealth {
    consecutive_failures: u32,
    /// When it was marked down (seconds since start), while down.
    down_since: Option<f64>,
    /// The engine's `process_start_time_seconds`, as last scraped.
    started_at: Option<f64>,
    events_received: u64,
    /// A KV-event batch arrived since its last scrape (a sign of life).
    events_since_scrape: bool,
    event_gaps: u64,
    batches_missed: u64,
    batches_stale: u64,
    decode_errors: u64,
    /// Times the index was cleared because the engine changed (a return from down, a new
    /// start time): the subscriber then catches up from the new engine's replay buffer.
    engine_changes: u64,
    /// Its subscriber has not yet rebuilt its index from its replay buffer (start-up).
    catching_up: bool,
    /// Tokens per KV block, as its engine last stated (its events, its metrics).
    block_size: Option<usize>,
}

/// One pod as the runtime knows it, beside its routing state (the router's, under the same
/// id).
#[derive(Default)]
struct PodEntry {
    /// Shared, so callers take it out of the lock without copying its strings.
    info: Arc<Pod>,
    health: PodHealth,
    /// The LoRA adapters its last scrape said it runs.
    adapters: Option<PodAdapters>,
    /// The models it last listed (`/v1/models`).
    models: Option<Vec<String>>,
}

struct Core {
    router: Router,
    /// Whose block size requests are hashed with: configured, learned from a pod (its
    /// name), or not yet known (`None`: the provisional size).
    block_size_from: Option<BlockSizeFrom>,
    /// By the id the router gave each pod; a removed pod keeps its id and its entry.
    pods: PodMap<PodEntry>,
    /// Pods by the address the proxy routes to (subset hints, served endpoints).
    by_address: AHashMap<SocketAddr, PodId>,
}

/// Where the scorer's KV block size comes from.
enum BlockSizeFrom {
    Configured,
    /// The first pod whose engine stated it.
    Learned(String),
}

impl Core {
    fn info(&self, pod: PodId) -> Arc<Pod> {
        self.pods.get(pod).map(|e| e.info.clone()).unwrap_or_default()
    }

    fn name(&self, pod: PodId) -> &str {
        self.pods.get(pod).map_or("", |e| e.info.name.as_str())
    }

    fn health(&mut self, pod: PodId) -> &mut PodHealth {
        &mut self.pods.get_mut(pod).health
    }

    /// Every pod's information, by id.
    fn infos(&self) -> Vec<Arc<Pod>> {
        self.pods.iter().map(|(_, e)| e.info.clone()).collect()
    }
}

/// Everything the HTTP handlers and background tasks share.
pub struct Scorer {
    pub config: Config,
    pub metrics: Metrics,
    tokenizers: ModelTokenizers,
    core: Mutex<Core>,
    /// Tokens per KV block requests are hashed in (the router's), read without the lock.
    block_size: AtomicUsize,
    started: Instant,
    bookings: AtomicU64,
    /// Requests waiting for a pod with room (with `admission`).
    queue: Option<Queue>,
    /// What the booking sync's tasks share with the request paths (used with `sync`).
    sync: SyncState,
    /// The configured pods' ids, in configuration order.
    static_pods: Vec<PodId>,
    /// Start-up is over: every pod's index caught up (or `health.catch_up_wait_ms` passed).
    started_up: AtomicBool,
    /// SIGTERM came: not ready any more, whatever else holds.
    draining: AtomicBool,
    /// The `model` names that are LoRA adapters: those configured, and those the pods named
    /// since (in their KV events and metrics).
    adapters: RwLock<Adapters>,
    /// Readiness changed by something other than the fleet (draining): the picker's health
    /// reporter looks at once.
    pub readiness_changed: tokio::sync::Notify,
    /// The pool's InferenceObjectives by name: their priorities (with
    /// `discovery.inference_pool.inference_objectives`).
    pool_objectives: RwLock<std::collections::BTreeMap<String, i32>>,
    /// The model rewrites in force: the pool's InferenceModelRewrites' (with
    /// `discovery.inference_pool.inference_model_rewrites`), then the configuration's.
    rewrites: RwLock<ModelRewrites>,
}

/// Why the scorer is not ready: `/readyz` answers 503 with it, the picker's gRPC health says
/// NOT_SERVING.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    #[error("draining: stopping after SIGTERM")]
    Draining,
    #[error("joining: waiting for the other replicas' bookings")]
    Joining,
    #[error("catching up: {0} pod(s) not yet rebuilt from their replay buffers")]
    CatchingUp(usize),
    #[error("no healthy pod")]
    NoPod,
}

impl Scorer {
    /// Builds the scorer, with the configured pods. Without a real tokenizer every pod is
    /// indexed approximately: the fallback's token ids are not the engines', so their events
    /// could never match.
    pub fn new(config: Config, tokenizers: impl Into<ModelTokenizers>) -> Self {
        let mut router = Router::new(&config.router_config());
        if config.sync.is_some() {
            router.share_bookings();
        }
        let block_size_from = config.block_size.map(|_| BlockSizeFrom::Configured);
        let block_size = AtomicUsize::new(router.block_size());
        let core = Core { router, block_size_from, pods: PodMap::default(), by_address: AHashMap::new() };
        let mut scorer = Self {
            metrics: Metrics::new(),
            tokenizers: tokenizers.into(),
            core: Mutex::new(core),
            block_size,
            started: Instant::now(),
            bookings: AtomicU64::new(0),
            queue: config.admission.as_ref().map(|a| Queue::new(a.queue_limit)),
            sync: SyncState::default(),
            static_pods: Vec::new(),
            started_up: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            adapters: RwLock::new(Adapters::new(config.lora_adapters.clone())),
            readiness_changed: tokio::sync::Notify::new(),
            pool_objectives: RwLock::default(),
            rewrites: RwLock::new(ModelRewrites::new(config.model_rewrites.clone())),
            config,
        };
        scorer.static_pods = (scorer.config.pods.iter())
            .map(|p| {
                let id = scorer.add_pod(&p.name, p.address, p.role, p.kv_events.is_some(), p.metrics.is_some());
                if let Some(slowness) = p.slowness {
                    scorer.declare_slowness(id, slowness);
                }
                id
            })
            .collect();
        scorer
    }

    /// The configured pods' ids, in configuration order.
    pub fn static_pods(&self) -> &[PodId] {
        &self.static_pods
    }

    /// Adds a pod (healthy: scraping demotes it after consecutive failures) and returns the
    /// id the router gave it. `has_events`: it publishes KV events, so it is indexed precisely
    /// when the tokenizer is exact (the fallback's token ids could never match an engine's).
    pub fn add_pod(&self, name: &str, address: SocketAddr, role: Role, has_events: bool, scraped: bool) -> PodId {
        let precise = has_events && self.tokenizers.is_exact();
        let mut core = self.lock();
        let id = core.router.add_pod(role, precise);
        let address_text = address.to_string();
        core.router.set_pod_key(id, &address_text);
        let info = Pod { id, name: name.to_string(), address: address_text, role, precise, scraped };
        *core.pods.get_mut(id) = PodEntry { info: Arc::new(info), ..PodEntry::default() };
        // A later pod at the same address (discovery re-adding it with another role) takes
        // it over.
        core.by_address.insert(address, id);
        drop(core);
        self.metrics.pod_healthy.with_label_values(&[name]).set(1.0);
        id
    }

    /// The pod is known to take `slowness` times the fleet's average time (a configured
    /// `pods[].slowness`, or a discovered pod's `kvgate.io/slowness`): its learned speed starts
    /// there. Outside `[1/max_slowness, max_slowness]` it is clamped, with a warning.
    pub fn declare_slowness(&self, pod: PodId, slowness: f64) {
        let speed = &self.config.load.pod_speed;
        let mut core = self.lock();
        if !speed.slowness_range().contains(&slowness) {
            let max = speed.max_slowness;
            let name = &core.info(pod).name;
            tracing::warn!(pod = %name, "slowness {slowness} is outside [1/{max}, {max}] (load.pod_speed.max_slowness); clamped");
        }
        core.router.declare_slowness(pod, slowness);
    }

    /// Discovery lost the pod: it is not chosen and its index and bookings are dropped.
    pub fn remove_pod(&self, pod: PodId) {
        let mut core = self.lock();
        core.router.remove_pod(pod);
        *core.health(pod) = PodHealth::default();
        core.pods.get_mut(pod).models = None;
        let p = core.info(pod);
        drop(core);
        self.metrics.pod_healthy.with_label_values(&[&p.name]).set(0.0);
    }

    /// A removed pod is back at the same address.
    pub fn restore_pod(&self, pod: PodId) {
        let mut core = self.lock();
        core.router.restore_pod(pod);
        let p = core.info(pod);
        drop(core);
        self.metrics.pod_healthy.with_label_values(&[&p.name]).set(1.0);
    }

    /// The pod with id `pod`.
    pub fn pod(&self, pod: PodId) -> Arc<Pod> {
        self.lock().info(pod)
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

    /// The state, waiting for it if another thread holds it (counted, with the wait).
    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock would be a bug; keep serving rather than cascade.
        match self.core.try_lock() {
            Ok(core) => core,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let waited = Instant::now();
                let core = self.core.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                self.metrics.state_lock_waits.inc();
                self.metrics.state_lock_wait_seconds.observe(waited.elapsed().as_secs_f64());
                core
            }
        }
    }

    /// The pods at these addresses (unknown ones are left out): a proxy's subset hint.
    pub fn pods_at(&self, addresses: &[SocketAddr]) -> PodSet {
        let core = self.lock();
        addresses.iter().filter_map(|a| core.by_address.get(a).copied()).collect()
    }

    /// Pods by the address the proxy routes to.
    pub fn addresses(&self) -> AHashMap<SocketAddr, PodId> {
        self.lock().by_address.clone()
    }

    /// Ready to route: not draining, the other replicas' bookings in (with `sync`), at start
    /// every healthy pod's index caught up from its replay buffer, and some pod able to take
    /// requests.
    pub fn readiness(&self) -> Result<(), NotReady> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(NotReady::Draining);
        }
        if self.config.sync.is_some() && !self.sync.joined.load(Ordering::Relaxed) {
            return Err(NotReady::Joining);
        }
        let core = self.lock();
        if !self.started_up.load(Ordering::Relaxed) {
            let catching_up: Vec<&str> = (core.pods.iter())
                .filter(|(id, e)| e.health.catching_up && core.router.is_healthy(*id))
                .map(|(_, e)| e.info.name.as_str())
                .collect();
            let waited = self.started.elapsed().as_millis() >= u128::from(self.config.health.catch_up_wait_ms);
            if catching_up.is_empty() || waited {
                if !catching_up.is_empty() {
                    tracing::warn!(
                        pods = ?catching_up,
                        "ready without these pods' indexes rebuilt from their replay buffers \
                         (health.catch_up_wait_ms passed): they are indexed from the events that follow"
                    );
                }
                self.started_up.store(true, Ordering::Relaxed);
            } else {
                return Err(NotReady::CatchingUp(catching_up.len()));
            }
        }
        if core.router.ready() { Ok(()) } else { Err(NotReady::NoPod) }
    }

    /// The models `pod` lists (its `/v1/models`): it is chosen only for requests naming one
    /// of them (or none).
    pub fn served_models(&self, pod: PodId, models: Vec<String>) {
        let mut core = self.lock();
        let Some(entry) = core.pods.get(pod) else { return };
        if entry.models.as_ref() == Some(&models) {
            return;
        }
        tracing::info!(pod = %entry.info.name, ?models, "the pod serves these models");
        core.router.served_models(pod, models.iter().map(|m| ModelId::of(m)).collect());
        core.pods.get_mut(pod).models = Some(models);
    }

    /// A pod named `name` as a LoRA adapter (of `base`, where its engine said): its requests'
    /// blocks are hashed apart from now on, tokenized as its base model's.
    pub fn learn_adapter(&self, name: &str, base: Option<&str>) {
        if !self.adapters.read().unwrap_or_else(|e| e.into_inner()).is_news(name, base) {
            return;
        }
        let mut adapters = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        if adapters.is_news(name, base) {
            tracing::info!(adapter = %name, ?base, "a pod serves LoRA adapter {name:?}: its requests are hashed apart");
            adapters.learn(name, base);
        }
    }

    /// SIGTERM: not ready from now on (see the `shutdown` section).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
        self.readiness_changed.notify_one();
    }

    /// The pod's subscriber will rebuild its index from its replay buffer: until it has,
    /// the scorer is not ready at start.
    pub fn catching_up(&self, pod: PodId) {
        self.lock().health(pod).catching_up = true;
    }

    /// The pod's index was rebuilt from its replay buffer (or the replay failed: then it is
    /// indexed from the events that follow).
    pub fn caught_up(&self, pod: PodId) {
        self.lock().health(pod).catching_up = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_route_api::{Api, LifecycleEvent, LifecycleReport};
    use kvgate_routing::adapters::AdapterId;
    use kvgate_routing::policy::ReportedLoad;

    fn scorer(extra: &str) -> Scorer {
        scorer_of(&format!(
            "{extra}pods:\n  - {{name: a, address: '10.0.0.1:8000', metrics: 'http://10.0.0.1:8000/metrics'}}\n  - {{name: b, address: '10.0.0.2:8000'}}\n"
        ))
    }

    /// A scorer of configuration `yaml`, without an exact tokenizer.
    fn scorer_of(yaml: &str) -> Scorer {
        Scorer::new(Config::parse(yaml).unwrap(), kvgate_tokenize::Tokenizer::fallback())
    }

    /// A scrape that answered, stating the engine's start time and block size when given.
    fn answered(started_at: Option<f64>, block_size: Option<usize>) -> Scrape {
        Scrape::Answered { load: ReportedLoad::default(), started_at, adapters: None, block_size }
    }

    fn decide(s: &Scorer, id: &str) -> Pick {
        let prepared = s.prepare(Api::Completions, br#"{"prompt": "abcdefgh", "max_tokens": 2}"#).unwrap();
        s.decide(id, &prepared, &Limits { fallbacks: 1, ..Limits::default() }).unwrap()
    }

    fn report(id: &str, event: LifecycleEvent, served: Option<&str>) -> LifecycleReport {
        LifecycleReport { served: served.map(str::to_string), ..LifecycleReport::new(id, event) }
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
        assert!(matches!(e, PickError::BadRequest(ref m) if m.contains("not valid JSON")), "{e}");
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
    fn the_pool_signals_follow_the_fleet_and_predict_no_wait_before_speeds_are_learned() {
        let s = scorer("policy: {name: round-robin}\nload: {pod_speed: {prior_samples: 2}}\n");
        let rendered = |s: &Scorer| {
            s.pods_view();
            s.metrics.render()
        };
        let text = rendered(&s);
        assert!(text.contains("kvgate_pool_healthy_pods 2"), "{text}");
        assert!(!text.contains("kvgate_pool_predicted_wait_seconds"), "nothing learned, nothing predicted: {text}");
        // First tokens teach the fleet's prefill speed (past `prior_samples` decayed samples).
        for id in ["r0", "r1", "r2", "r3"] {
            decide(&s, id);
            std::thread::sleep(std::time::Duration::from_millis(5));
            s.lifecycle(&[report(id, LifecycleEvent::FirstToken, None), report(id, LifecycleEvent::Done, None)]);
        }
        let idle = rendered(&s);
        assert!(idle.contains("kvgate_pool_predicted_wait_seconds{at=\"soonest\"} 0"), "{idle}");
        assert!(idle.contains("kvgate_pool_inflight_requests_per_pod 0"), "{idle}");
        // Two requests booked on `a` and `b`, one more on `a`: every pod has prefill queued.
        for id in ["q0", "q1", "q2"] {
            decide(&s, id);
        }
        let views = s.pods_view();
        let waits: Vec<f64> = views.iter().map(|v| v.queued_prefill_seconds.unwrap()).collect();
        assert!(waits.iter().all(|w| *w > 0.0), "{waits:?}");
        let busy = s.metrics.render();
        let gauge = |at: &str| -> f64 {
            let line = format!("kvgate_pool_predicted_wait_seconds{{at=\"{at}\"}} ");
            busy.lines().find_map(|l| l.strip_prefix(&line)).unwrap().parse().unwrap()
        };
        assert_eq!(gauge("soonest"), waits.iter().copied().fold(f64::INFINITY, f64::min));
        assert!(gauge("mean") >= gauge("soonest"));
        assert!(busy.contains("kvgate_pool_inflight_requests_per_pod 1.5"), "{busy}");
        // A pod taken out leaves the pool.
        s.scraped(s.static_pods()[0], Scrape::Refused);
        assert!(rendered(&s).contains("kvgate_pool_healthy_pods 1"));
    }

    #[test]
    fn a_model_no_engine_lists_is_refused_or_routed_as_configured() {
        let ask = |s: &Scorer, model: &str| {
            let body = format!(r#"{{"model": "{model}", "prompt": "abcdefgh", "max_tokens": 2}}"#);
            let prepared = s.prepare(Api::Completions, body.as_bytes()).unwrap();
            s.decide(model, &prepared, &Limits::default())
        };
        for (config, refused) in [("", true), ("unlisted_models: route\n", false)] {
            let s = scorer(config);
            let [a, b] = [s.static_pods()[0], s.static_pods()[1]];
            assert!(ask(&s, "mistral").is_ok(), "no engine has listed its models yet: any may serve");
            s.served_models(a, vec!["qwen".into(), "sql".into()]);
            s.served_models(b, vec!["llama".into()]);
            assert_eq!(ask(&s, "sql").unwrap().decode.name, "a");
            assert_eq!(ask(&s, "llama").unwrap().decode.name, "b");
            match ask(&s, "mistral") {
                Err(PickError::ModelNotServed(model)) => assert!(refused && model == "mistral"),
                Ok(_) => assert!(!refused, "refused by default"),
                Err(e) => panic!("{e}"),
            }
        }
        let e = Config::parse("unlisted_models: guess\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n").unwrap_err();
        assert!(e.to_string().contains("guess"), "{e}");
    }

    #[test]
    fn a_rewritten_request_is_routed_and_hashed_as_its_target() {
        let s = scorer("lora_adapters: [sql]\nmodel_rewrites:\n  - {matches: [llama], targets: [{model: sql}]}\n");
        let [a, b] = [s.static_pods()[0], s.static_pods()[1]];
        s.served_models(a, vec!["llama".into()]);
        s.served_models(b, vec!["sql".into()]);
        let prepare = |s: &Scorer, model: &str| {
            let prompt = "abcdefgh".repeat(40);
            let body = format!(r#"{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 2}}"#);
            s.prepare(Api::Completions, body.as_bytes()).unwrap()
        };
        let rewritten = prepare(&s, "llama");
        assert_eq!((rewritten.model.as_deref(), rewritten.adapter), (Some("sql"), Some(AdapterId::of("sql"))));
        assert_eq!(rewritten.chain, prepare(&s, "sql").chain, "hashed as the target (an adapter)");
        assert_ne!(rewritten.chain, prepare(&scorer(""), "llama").chain);
        let pick = s.decide("r1", &rewritten, &Limits::default()).unwrap();
        assert_eq!(pick.decode.name, "b");
        assert_eq!(pick.route_pick().model_rewrite.map(|r| r.model).as_deref(), Some("sql"));
        assert!(prepare(&s, "sql").rewrite.is_none(), "a target is not rewritten again");
        // A catch-all takes every model no rule names (as the API defines it); its target
        // served nowhere is refused naming it, never a guess.
        let s = scorer("model_rewrites: [{targets: [{model: nowhere}]}]\n");
        for pod in s.static_pods() {
            s.served_models(*pod, vec!["llama".into()]);
        }
        match s.decide("r2", &prepare(&s, "llama"), &Limits::default()) {
            Err(PickError::ModelNotServed(model)) => assert_eq!(model, "nowhere"),
            other => panic!("{other:?}"),
        }
        for (rule, field) in [
            ("{targets: []}", "model_rewrites[0].targets"),
            ("{matches: [''], targets: [{model: a}]}", "model_rewrites[0].matches[0]"),
            ("{targets: [{model: a, weight: 1}, {model: b}]}", "model_rewrites[0].targets"),
            ("{targets: [{model: a, weight: 0}]}", "model_rewrites[0].targets[0].weight"),
            ("{targets: [{model: ''}]}", "model_rewrites[0].targets[0].model"),
        ] {
            let e =
                Config::parse(&format!("model_rewrites: [{rule}]\npods: [{{name: a, address: '10.0.0.1:8000'}}]\n"));
            let e = e.unwrap_err().to_string();
            assert!(e.contains(field), "{rule}: {e}");
        }
    }

    #[test]
    fn a_configured_slowness_applies_from_the_first_request() {
        let pods = |a: &str, b: &str| {
            scorer_of(&format!(
                "pods:\n  - {{name: a, address: '10.0.0.1:8000'{a}}}\n  - {{name: b, address: '10.0.0.2:8000'{b}}}\n"
            ))
        };
        let slowness = |s: &Scorer| s.pods_view().iter().map(|v| v.slowness).collect::<Vec<_>>();
        // Idle, with nothing cached: the pod declared faster is chosen, whichever it is.
        let mixed = pods(", slowness: 2", ", slowness: 0.5");
        assert_eq!(slowness(&mixed), vec![2.0, 0.5]);
        assert_eq!(decide(&mixed, "r").decode.name, "b");
        let mixed = pods(", slowness: 0.5", ", slowness: 2");
        assert_eq!(decide(&mixed, "r").decode.name, "a");
        assert_eq!(slowness(&pods("", "")), vec![1.0, 1.0], "unset: learned alone");
        let e = Config::parse("pods:\n  - {name: a, address: '10.0.0.1:8000', slowness: 9}\n").unwrap_err();
        assert!(e.to_string().contains("pods[0].slowness"), "{e}");
    }

    /// A batch storing `blocks` blocks of `block_size` tokens (token ids from 1).
    fn stored(blocks: usize, block_size: usize) -> kvgate_routing::events::EventBatch<'static> {
        use kvgate_routing::events::{BlockStored, EventBatch, GroupKind, KvEvent, Tier};
        let stored = BlockStored {
            block_hashes: (0..blocks as u64).map(|h| kvgate_routing::hash::EngineHash(h + 1)).collect(),
            parent_block_hash: None,
            token_ids: (1..=(blocks * block_size) as u32).collect(),
            block_size,
            lora_name: None,
            first_block_extra: vec![],
            opaque_extra_keys: false,
            tier: Tier::Gpu,
            group: 0,
            group_kind: GroupKind::FullAttention,
        };
        EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(stored)], data_parallel_rank: None }
    }

    #[test]
    fn the_block_size_is_learned_from_the_first_engine_and_checked_against_the_others() {
        let s = scorer_of("pods:\n  - {name: a, address: '10.0.0.1:8000'}\n  - {name: b, address: '10.0.0.2:8000'}\n");
        let (a, b) = (PodId(0), PodId(1));
        assert_eq!(s.block_size(), crate::config::PROVISIONAL_BLOCK_SIZE, "none stated yet");
        s.apply_events(a, &stored(4, 32));
        assert_eq!((s.block_size(), s.lock().router.block_size()), (32, 32), "a's events state 32");
        assert_eq!(s.lock().router.index().pod_blocks(a), 4, "and are indexed at it");
        // b's engine states 16: an error; b's blocks are not indexed, the size stays.
        s.apply_events(b, &stored(4, 16));
        assert_eq!(s.block_size(), 32);
        assert_eq!(s.lock().router.index().pod_blocks(b), 0);
        assert_eq!(s.lock().router.index().stats(b).block_size_mismatches, 4);
        // A scrape states it too: b's metrics say 16 again (no new error), a's 32.
        let answered = |block_size| answered(None, Some(block_size));
        s.scraped(b, answered(16));
        s.scraped(a, answered(32));
        assert_eq!(s.block_size(), 32);
        // Configured, the size is the configuration's: an engine stating another is not indexed.
        let s = scorer_of("block_size: 16\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n");
        s.scraped(a, answered(32));
        s.apply_events(a, &stored(4, 32));
        assert_eq!((s.block_size(), s.lock().router.index().pod_blocks(a)), (16, 0));
        // Learned from a scrape before any event: the events that follow are indexed.
        let s = scorer_of("pods:\n  - {name: a, address: '10.0.0.1:8000'}\n");
        s.scraped(a, answered(32));
        s.apply_events(a, &stored(2, 32));
        assert_eq!((s.block_size(), s.lock().router.index().pod_blocks(a)), (32, 2));
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
            s.report(&LifecycleReport::new("warm", LifecycleEvent::Done));
            assert_eq!(pick.decode.id, a);
        };
        let blocks = |s: &Scorer| s.lock().router.pod_blocks(a);
        let answered = |started_at| answered(Some(started_at), None);
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

    #[test]
    fn a_late_scrape_of_an_engine_sending_events_is_not_a_failure() {
        let s = scorer("");
        let a = PodId(0);
        let healthy = |s: &Scorer| s.lock().router.is_healthy(a);
        // Busy: every scrape times out, but its engine stores blocks between them.
        for _ in 0..5 {
            s.apply_events(a, &stored(1, 16));
            s.scraped(a, Scrape::TimedOut);
        }
        assert!(healthy(&s), "late while it sends events: in");
        assert_eq!(s.metrics.scrapes_late.with_label_values(&["a"]).get(), 5);
        assert_eq!(s.metrics.scrape_failures.with_label_values(&["a"]).get(), 0);
        // Silent: timeouts count, as do error answers while it sends events.
        s.scraped(a, Scrape::TimedOut);
        s.apply_events(a, &stored(1, 16));
        s.scraped(a, Scrape::Failed);
        assert!(healthy(&s));
        s.scraped(a, Scrape::TimedOut);
        assert!(!healthy(&s), "three failures in a row: out");
    }
}
