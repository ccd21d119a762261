//! The routers a run can use: kvgate's own [`Router`] (any policy, the scorer's defaults),
//! several kvgate replicas that share their bookings after a delay (or not at all), and
//! re-implementations of SGLang's `cache_aware` and vllm-router's `kv_aware` rules as
//! reference points.

use crate::clairvoyant::{self, Clairvoyant};
use crate::cluster::{Arrival, Choice, ClusterRouter, EngineAdapters, Foreseen, HASH_SEED, PodRole, reported_load};
use crate::sglang::CacheAware;
use crate::vllm_router::{KvAware, KvAwareConfig};
use kvgate_routing::adapters::{AdapterId, ReportedAdapters};
use kvgate_routing::events::decode_batch;
use kvgate_routing::hash::{SequenceHash, root_hash, sequence_hashes};
use kvgate_routing::load::{BookingUpdate, Lifecycle, Origin};
use kvgate_routing::pod_set::PodId;
use kvgate_routing::policy::ReportedLoad;
use kvgate_routing::router::{PrefillWaits, RouteRequest, Router};
use kvgate_scorer::config::Config;
use kvgate_sim::cache::CacheChange;
use kvgate_sim::engine::Engine;
use kvgate_sim::events::{EventEncoder, EventFormat, HashFormat};
use std::collections::VecDeque;

/// kvgate's routing exactly as the scorer runs it: the configuration is parsed by the
/// scorer's own parser (so defaults and validation are the sidecar's), the pods' KV events
/// go through vLLM's msgpack encoding and kvgate's decoder, and every decision is booked and
/// released by lifecycle reports.
pub struct Kvgate {
    router: Router,
    encoder: EventEncoder,
    block_size: usize,
    chain: Vec<SequenceHash>,
    /// Shown each pod's true load at every decision instead of the last scrape, and each
    /// request's true output length instead of the `max_tokens` it asks for (`@informed`: the
    /// simulator's information bound, no router a gateway can run).
    informed: bool,
    /// Declares each pod's true speed at the first decision, before any sample could teach
    /// it (`@known-speed`): what a cold fleet's first placements lose by learning.
    known_speed: bool,
}

impl Kvgate {
    /// `sections`: the scorer config's YAML apart from its pods, e.g. `policy: {name: kv}`.
    pub fn new(roles: &[PodRole], sections: &str, seed: u64) -> anyhow::Result<Self> {
        let mut yaml = format!("{sections}\nseed: {seed}\npods:\n");
        for (i, role) in roles.iter().enumerate() {
            let role = match role {
                PodRole::Both => "both",
                PodRole::Prefill => "prefill",
                PodRole::Decode => "decode",
            };
            yaml.push_str(&format!("  - {{name: pod-{i}, address: '127.0.0.1:{}', role: {role}}}\n", 10_000 + i));
        }
        let config = Config::parse(&yaml)?;
        let mut router = Router::new(&config.router_config());
        for p in &config.pods {
            let pod = router.add_pod(p.role, true);
            if let Some(slowness) = p.slowness {
                router.declare_slowness(pod, slowness);
            }
        }
        let encoder = EventEncoder {
            format: EventFormat::Map,
            hashes: HashFormat::U64,
            block_size: router.block_size(),
            data_parallel_rank: None,
        };
        Ok(Self {
            block_size: router.block_size(),
            router,
            encoder,
            chain: Vec::new(),
            informed: false,
            known_speed: false,
        })
    }
}

impl Kvgate {
    /// The output length the request is planned with: what it asks for, or, informed, what
    /// it will generate.
    fn planned_output(&self, r: &Arrival<'_>) -> u32 {
        (if self.informed { r.output_tokens } else { r.max_tokens }) as u32
    }
}

impl ClusterRouter for Kvgate {
    fn route(&mut self, r: &Arrival<'_>, now: f64) -> Choice {
        sequence_hashes(root_hash(r.adapter, None), r.prompt, self.block_size, &mut self.chain);
        let id = r.id.to_string();
        let request = RouteRequest {
            adapter: r.adapter.map(AdapterId::of),
            ..RouteRequest::new(&id, &self.chain, r.prompt.len() as u32, Some(self.planned_output(r)))
        };
        let routed = self.router.route(&request, now).expect("the simulated pods are always healthy");
        Choice {
            decode: routed.decode.pod.index(),
            prefill: routed.prefill.map(|p| p.pod.index()),
            // What the engine will report: its cached prefix and the blocks it loads.
            predicted_cached_tokens: Some({
                let computes = routed.prefill.unwrap_or(routed.decode);
                (computes.cached_tokens + computes.offloaded_tokens) as usize
            }),
        }
    }

    fn route_seeing(&mut self, request: &Arrival<'_>, now: f64, engines: &[&Engine], _: &[Foreseen<'_>]) -> Choice {
        if std::mem::take(&mut self.known_speed) {
            // Each pod's step cost against the fleet's mean: the slowness learning converges to.
            let cost = |e: &&Engine| e.config().timing.token_ms;
            let mean = engines.iter().map(cost).sum::<f64>() / engines.len() as f64;
            for (pod, engine) in engines.iter().enumerate() {
                self.router.declare_slowness(PodId(pod as u32), cost(engine) / mean);
            }
        }
        if self.informed {
            for (pod, engine) in engines.iter().enumerate() {
                self.router.reported(PodId(pod as u32), reported_load(engine));
                if let Some(adapters) = EngineAdapters::of(engine) {
                    self.scraped_adapters(pod, &adapters);
                }
            }
        }
        self.route(request, now)
    }

    fn prefill_done(&mut self, id: u64, now: f64) {
        let _ = self.router.report(&id.to_string(), Lifecycle::Done, true, now);
    }

    fn first_token(&mut self, id: u64, now: f64) {
        let _ = self.router.report(&id.to_string(), Lifecycle::FirstToken, false, now);
    }

    fn done(&mut self, id: u64, output_tokens: Option<u32>, now: f64) {
        let id = id.to_string();
        if let Some(n) = output_tokens {
            self.router.decoded(&id, n, now);
        }
        let _ = self.router.report(&id, Lifecycle::Done, false, now);
    }

    fn kv_events(&mut self, pod: usize, changes: &[CacheChange], now: f64) {
        let payload = self.encoder.encode_batch(now, changes);
        let batch = decode_batch(&payload).expect("kvgate decodes what the simulated engine publishes");
        self.router.apply_events(PodId(pod as u32), &batch);
    }

    fn scraped(&mut self, pod: usize, load: ReportedLoad, now: f64) {
        self.router.reported(PodId(pod as u32), load);
        if pod == 0 {
            self.router.expire(now);
        }
    }

    fn prefill_waits(&self) -> Option<PrefillWaits> {
        self.router.prefill_waits()
    }

    fn scraped_adapters(&mut self, pod: usize, adapters: &EngineAdapters) {
        let reported = ReportedAdapters::named(&adapters.running, &adapters.waiting, adapters.max_loras as u32);
        self.router.reported_adapters(PodId(pod as u32), reported);
    }
}

/// Several gateway replicas, each with its own kvgate [`Router`], as behind a load balancer
/// that spreads clients: request `id` goes to replica `id mod n`, which hears its lifecycle.
/// Every replica follows every pod's KV events and load scrapes (as live scorers do). With
/// `sync`, each replica's booking changes reach the others that many seconds later (the
/// bus's delay); without, each decides on its own requests only.
pub struct Replicas {
    replicas: Vec<Kvgate>,
    sync_delay: Option<f64>,
    /// (when it arrives, from which replica, the updates), in sending order.
    in_transit: VecDeque<(f64, usize, Vec<BookingUpdate>)>,
}

impl Replicas {
    pub fn new(mut replicas: Vec<Kvgate>, sync_delay: Option<f64>) -> Self {
        if sync_delay.is_some() {
            for r in &mut replicas {
                r.router.share_bookings();
            }
        }
        Self { replicas, sync_delay, in_transit: VecDeque::new() }
    }

    /// Delivers the updates due by `now` to every replica but their sender.
    fn deliver(&mut self, now: f64) {
        while self.in_transit.front().is_some_and(|(at, _, _)| *at <= now) {
            let (_, from, updates) = self.in_transit.pop_front().expect("checked");
            for (_, r) in self.replicas.iter_mut().enumerate().filter(|(i, _)| *i != from) {
                for u in &updates {
                    // A report for a booking already expired here is nothing to apply.
                    let _ = r.router.apply_shared(Origin(from as u32 + 1), u, now);
                }
            }
        }
    }

    /// Runs `op` on replica `i`, then sends what it changed.
    fn on<T>(&mut self, i: usize, now: f64, op: impl FnOnce(&mut Kvgate) -> T) -> T {
        self.deliver(now);
        let out = op(&mut self.replicas[i]);
        if let Some(delay) = self.sync_delay {
            let updates = self.replicas[i].router.take_shared();
            if !updates.is_empty() {
                self.in_transit.push_back((now + delay, i, updates));
            }
        }
        out
    }

    fn owner(&self, id: u64) -> usize {
        (id % self.replicas.len() as u64) as usize
    }
}

impl ClusterRouter for Replicas {
    fn route(&mut self, request: &Arrival<'_>, now: f64) -> Choice {
        self.on(self.owner(request.id), now, |r| r.route(request, now))
    }

    fn prefill_done(&mut self, id: u64, now: f64) {
        self.on(self.owner(id), now, |r| r.prefill_done(id, now))
    }

    fn first_token(&mut self, id: u64, now: f64) {
        self.on(self.owner(id), now, |r| r.first_token(id, now))
    }

    fn done(&mut self, id: u64, output_tokens: Option<u32>, now: f64) {
        self.on(self.owner(id), now, |r| r.done(id, output_tokens, now))
    }

    fn kv_events(&mut self, pod: usize, changes: &[CacheChange], now: f64) {
        self.deliver(now);
        for r in &mut self.replicas {
            r.kv_events(pod, changes, now);
        }
    }

    fn scraped(&mut self, pod: usize, load: ReportedLoad, now: f64) {
        self.deliver(now);
        for r in &mut self.replicas {
            r.scraped(pod, load, now);
        }
    }

    fn scraped_adapters(&mut self, pod: usize, adapters: &EngineAdapters) {
        for r in &mut self.replicas {
            r.scraped_adapters(pod, adapters);
        }
    }
}

/// A peer router's rule over some of the cluster's pods, by pool-local worker index.
trait PeerRule {
    /// Chooses a worker for request `id` and counts it in flight there.
    fn route(&mut self, id: u64, prompt: &[u32], now: f64) -> usize;
    /// Request `id`'s first token came back (for rules that count requests awaiting theirs).
    fn first_token(&mut self, _id: u64) {}
    fn finished(&mut self, worker: usize);
    /// The worker's KV events (for rules that follow them).
    fn kv_events(&mut self, _worker: usize, _changes: &[CacheChange]) {}
}

impl PeerRule for CacheAware {
    fn route(&mut self, _id: u64, prompt: &[u32], now: f64) -> usize {
        CacheAware::route(self, prompt, now)
    }
    fn finished(&mut self, worker: usize) {
        CacheAware::finished(self, worker)
    }
}

impl PeerRule for KvAware {
    fn route(&mut self, id: u64, prompt: &[u32], now: f64) -> usize {
        KvAware::route(self, id, prompt, now)
    }
    fn first_token(&mut self, id: u64) {
        KvAware::first_token(self, id)
    }
    fn finished(&mut self, worker: usize) {
        KvAware::finished(self, worker)
    }
    fn kv_events(&mut self, worker: usize, changes: &[CacheChange]) {
        KvAware::kv_events(self, worker, changes)
    }
}

/// A peer router — SGLang's with `cache_aware`, vllm-router's with `kv_aware`: one rule over
/// all pods; in a P/D layout (their PD modes, which always disaggregate) one over the
/// prefill pods and one over the decode pods.
struct Peer<R> {
    decode: Pool<R>,
    prefill: Option<Pool<R>>,
    /// Request id → the pool-local workers chosen (decode, prefill).
    inflight: ahash::AHashMap<u64, (usize, Option<usize>)>,
}

/// A rule over some of the cluster's pods.
struct Pool<R> {
    rule: R,
    pods: Vec<usize>,
}

impl<R: PeerRule> Peer<R> {
    /// `rule(workers, seed)` makes one pool's rule.
    fn new(roles: &[PodRole], seed: u64, rule: impl Fn(usize, u64) -> R) -> Self {
        let pods =
            |want: &[PodRole]| -> Vec<usize> { (0..roles.len()).filter(|&i| want.contains(&roles[i])).collect() };
        let pool = |pods: Vec<usize>, seed: u64| Pool { rule: rule(pods.len(), seed), pods };
        let prefill = pods(&[PodRole::Prefill]);
        Self {
            decode: pool(pods(&[PodRole::Both, PodRole::Decode]), seed),
            prefill: (!prefill.is_empty()).then(|| pool(prefill, seed + 1)),
            inflight: Default::default(),
        }
    }
}

impl<R: PeerRule> ClusterRouter for Peer<R> {
    fn route(&mut self, request: &Arrival<'_>, now: f64) -> Choice {
        let prefill = self.prefill.as_mut().map(|p| p.rule.route(request.id, request.prompt, now));
        let decode = self.decode.rule.route(request.id, request.prompt, now);
        self.inflight.insert(request.id, (decode, prefill));
        Choice {
            decode: self.decode.pods[decode],
            prefill: prefill.zip(self.prefill.as_ref()).map(|(p, pool)| pool.pods[p]),
            predicted_cached_tokens: None,
        }
    }

    fn first_token(&mut self, id: u64, _now: f64) {
        for pool in std::iter::once(&mut self.decode).chain(self.prefill.as_mut()) {
            pool.rule.first_token(id);
        }
    }

    fn done(&mut self, id: u64, _output_tokens: Option<u32>, now: f64) {
        self.first_token(id, now); // a request that failed before its first token
        let Some((decode, prefill)) = self.inflight.remove(&id) else { return };
        self.decode.rule.finished(decode);
        if let (Some(p), Some(pool)) = (prefill, self.prefill.as_mut()) {
            pool.rule.finished(p);
        }
    }

    fn kv_events(&mut self, pod: usize, changes: &[CacheChange], _now: f64) {
        for pool in std::iter::once(&mut self.decode).chain(self.prefill.as_mut()) {
            if let Some(worker) = pool.pods.iter().position(|&p| p == pod) {
                pool.rule.kv_events(worker, changes);
            }
        }
    }
}

/// A router by name: `sglang-cache-aware`, `vllm-kv-aware` (`@streamed`: vllm-router 0.1.17's rule
/// as fitted to probes, [`KvAwareConfig::streamed`]), `lora-affinity` (the Inference
/// Extension's picker; `@lora-first` weighs its adapter score 10×), the `clairvoyant` bound
/// (`@look-ahead`: seeing the arrivals to come), or a kvgate policy (`kv`, `prefix`, `ttft`,
/// `least-loaded`, `power-of-two`, `round-robin`, `random`) with the scorer's defaults;
/// on layouts with prefill pods the policy chooses in both pools; a suffix `@pd-always`
/// (threshold 0) or `@no-pd` (never disaggregate) overrides the P/D threshold, and
/// `@fixed-speed` turns off learning pod speeds (every pod counts as average), `@known-speed`
/// declares each pod's true speed before the first request (learning refines it), `@gpu-only`
/// ignores the pods' offload tiers (`index.offload.max_blocks_per_pod: 0`), `@informed` reads
/// each pod's true load at every decision and each request's true output length (a bound: no
/// scrape lag, no guess), `@no-adapters` prices no LoRA adapter loads or slots
/// (`prefill_tokens_per_second: 0`), `@whole-max-tokens` plans every request's whole
/// `max_tokens` (`load.learn_output_share: false`). A kvgate
/// router followed by `/N-replicas` runs as N replicas sharing their bookings at once,
/// `/N-replicas-sync-Dms` after D ms, `/N-replicas-unsynced` not at all ([`Replicas`]).
pub fn build(name: &str, roles: &[PodRole], seed: u64) -> anyhow::Result<Box<dyn ClusterRouter>> {
    match name {
        "sglang-cache-aware" => return Ok(Box::new(Peer::new(roles, seed, CacheAware::new))),
        "vllm-kv-aware" => return Ok(Box::new(Peer::new(roles, seed, |workers, _| KvAware::new(workers, HASH_SEED)))),
        "vllm-kv-aware@streamed" => {
            let config = KvAwareConfig { streamed: true, ..KvAwareConfig::default() };
            return Ok(Box::new(Peer::new(roles, seed, move |workers, _| {
                KvAware::with_config(config, workers, HASH_SEED)
            })));
        }
        "lora-affinity" => return Ok(Box::new(crate::lora_affinity::LoraAffinity::new(roles, seed, 1.0))),
        "lora-affinity@lora-first" => return Ok(Box::new(crate::lora_affinity::LoraAffinity::new(roles, seed, 10.0))),
        "clairvoyant" => return Ok(Box::new(Clairvoyant::new(roles, 1.0, 0.0))),
        "clairvoyant@first-token" => return Ok(Box::new(Clairvoyant::new(roles, 0.0, 0.0))),
        "clairvoyant@look-ahead" => return Ok(Box::new(Clairvoyant::new(roles, 1.0, clairvoyant::FORESIGHT))),
        _ => {}
    }
    if let Some((single, replicas)) = name.rsplit_once('/') {
        let (n, sync) = parse_replicas(replicas)?;
        let routers = (0..n).map(|i| kvgate(single, roles, seed + i as u64)).collect::<anyhow::Result<Vec<_>>>()?;
        return Ok(Box::new(Replicas::new(routers, sync)));
    }
    Ok(Box::new(kvgate(name, roles, seed)?))
}

/// `N-replicas`, `N-replicas-sync-Dms`, `N-replicas-unsynced` → (N, sync delay in seconds).
fn parse_replicas(spec: &str) -> anyhow::Result<(usize, Option<f64>)> {
    let bad = || anyhow::anyhow!("bad replica spec {spec:?} (N-replicas, N-replicas-sync-Dms, N-replicas-unsynced)");
    let (n, rest) = spec.split_once("-replicas").ok_or_else(bad)?;
    let n: usize = n.parse().map_err(|_| bad())?;
    anyhow::ensure!(n >= 1, "a fleet needs at least one replica: {spec:?}");
    let sync = match rest {
        "" => Some(0.0),
        "-unsynced" => None,
        _ => {
            let ms: f64 = rest
                .strip_prefix("-sync-")
                .and_then(|d| d.strip_suffix("ms"))
                .ok_or_else(bad)?
                .parse()
                .map_err(|_| bad())?;
            anyhow::ensure!(ms.is_finite() && ms >= 0.0, "sync delay must be ≥ 0 ms: {spec:?}");
            Some(ms / 1e3)
        }
    };
    Ok((n, sync))
}

/// One kvgate router by policy name (see [`build`]).
fn kvgate(name: &str, roles: &[PodRole], seed: u64) -> anyhow::Result<Kvgate> {
    let (policy, variant) = name.split_once('@').map_or((name, None), |(p, v)| (p, Some(v)));
    let mut sections = Vec::new();
    let informed = variant == Some("informed");
    let mut policy_yaml = if policy.starts_with('{') { policy.to_string() } else { format!("{{name: {policy}}}") };
    let threshold = match variant {
        Some("informed") => None,
        Some("no-adapters") => {
            policy_yaml = format!("{}, prefill_tokens_per_second: 0}}", policy_yaml.trim_end_matches('}'));
            None
        }
        Some("pd-always") => Some(0),
        Some("no-pd") => Some(u32::MAX),
        Some("fixed-speed") => {
            sections.push("load: {pod_speed: {learn: false}}".to_string());
            None
        }
        Some("known-speed") => None,
        Some("whole-max-tokens") => {
            sections.push("load: {learn_output_share: false}".to_string());
            None
        }
        Some("gpu-only") => {
            sections.push("index: {offload: {max_blocks_per_pod: 0}}".to_string());
            None
        }
        Some(other) => {
            anyhow::bail!(
                "unknown variant {other:?} (pd-always, no-pd, fixed-speed, known-speed, gpu-only, informed, \
                 no-adapters, whole-max-tokens)"
            )
        }
        None => None,
    };
    // A policy written as YAML (`{name: kv, decode_weight: 0.2}`) is used as written.
    let mut pd = Vec::new();
    if let Some(t) = threshold {
        pd.push(format!("threshold_tokens: {t}"));
    }
    if roles.contains(&PodRole::Prefill) {
        pd.push(format!("prefill_policy: {policy_yaml}, decode_policy: {policy_yaml}"));
    }
    sections.push(format!("policy: {policy_yaml}"));
    if !pd.is_empty() {
        sections.push(format!("pd: {{{}}}", pd.join(", ")));
    }
    let mut router = Kvgate::new(roles, &sections.join("\n"), seed)?;
    router.informed = informed;
    router.known_speed = variant == Some("known-speed");
    Ok(router)
}
