//! A cluster of simulated engines in virtual time, routed by a [`ClusterRouter`].
//!
//! Discrete-event simulation: the clock jumps from event to event (a turn arrives, an
//! engine's step ends, a KV transfer completes, a load scrape). Each engine is
//! `kvgate-sim`'s [`Engine`] — the model that serves live — stepping back to back while it
//! has work; a step's outputs (tokens, finished requests) and its cache changes (KV events)
//! take effect when the step ends. The router hears what the live scorer hears: the pods'
//! KV events (encoded as vLLM msgpack and decoded again, as on the wire), first-token and
//! done reports, and a load scrape every `scrape_interval`. Nothing reads a wall clock, so
//! a run is a pure function of the workload, the router and the seed.
//!
//! Disaggregated requests run as vLLM's NIXL flow does: a one-token `do_remote_decode` leg
//! on the prefill pod, then the request on the decode pod with `do_remote_prefill`, which
//! pulls the prompt's KV (the engine models the transfer time) and computes one token.

use crate::workload::{Session, Workload};
use kvgate_routing::policy::ReportedLoad;
use kvgate_routing::router::PrefillWaits;
use kvgate_sim::cache::{CacheChange, HashKeys};
use kvgate_sim::engine::{Engine, EngineConfig, KvTransfer, NewRequest, RequestId, StepResult};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, VecDeque};

/// Where one request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    pub decode: usize,
    pub prefill: Option<usize>,
    /// The prompt tokens the router expects the pod that computes it to have cached (routers
    /// that predict it).
    pub predicted_cached_tokens: Option<usize>,
}

impl Choice {
    /// One pod, no prediction.
    pub fn pod(decode: usize) -> Self {
        Self { decode, prefill: None, predicted_cached_tokens: None }
    }
}

/// A request (one turn) as it reaches the router.
#[derive(Clone, Copy, Debug)]
pub struct Arrival<'a> {
    /// Unique per request.
    pub id: u64,
    pub prompt: &'a [u32],
    /// What the client asks for (`max_tokens`).
    pub max_tokens: usize,
    /// What the engine will generate: the truth, which no gateway knows ahead (the same as
    /// `max_tokens` unless clients ask for more than they get).
    pub output_tokens: usize,
    /// The LoRA adapter it names as its `model`.
    pub adapter: Option<&'a str>,
}

/// A request still to come, as the simulator foresees it (the look-ahead bound's view).
#[derive(Clone, Copy, Debug)]
pub struct Foreseen<'a> {
    /// When it will arrive.
    pub at: f64,
    pub request: Arrival<'a>,
}

/// The most arrivals to come a router is shown at once.
pub const FORESEEN_MAX: usize = 16;

/// A pod's role, as the simulated cluster is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodRole {
    Both,
    Prefill,
    Decode,
}

/// A routing algorithm under test, fed what a live router could know.
pub trait ClusterRouter {
    /// Chooses the pod(s) for a request.
    fn route(&mut self, request: &Arrival<'_>, now: f64) -> Choice;
    /// The same, shown the engines as they truly are now: only the simulator's bounds look
    /// ([`crate::clairvoyant`], `kv@informed`) and a peer's rule modelled with fresher metrics
    /// than the simulated scrape; a router a gateway could run routes on what it heard.
    /// `foreseen`: the arrivals of the next [`ClusterRouter::foresight`] seconds, soonest
    /// first, at most [`FORESEEN_MAX`] (turns whose predecessor has not finished are not
    /// foreseen yet).
    fn route_seeing(
        &mut self,
        request: &Arrival<'_>,
        now: f64,
        _engines: &[&Engine],
        _foreseen: &[Foreseen<'_>],
    ) -> Choice {
        self.route(request, now)
    }
    /// Seconds of arrivals to come the router is shown at each decision: none, but for the
    /// simulator's look-ahead bound.
    fn foresight(&self) -> f64 {
        0.0
    }
    /// The request's prefill leg finished (disaggregated requests only).
    fn prefill_done(&mut self, _id: u64, _now: f64) {}
    fn first_token(&mut self, _id: u64, _now: f64) {}
    /// The request finished with `output_tokens` (`None`: the engine refused it).
    fn done(&mut self, id: u64, output_tokens: Option<u32>, now: f64);
    /// A pod's cache changed (its KV events); routers without event support ignore it.
    fn kv_events(&mut self, _pod: usize, _changes: &[CacheChange], _now: f64) {}
    /// A pod's `/metrics`, scraped.
    fn scraped(&mut self, _pod: usize, _load: ReportedLoad, _now: f64) {}
    /// The predicted waits before a new request's prefill, for routers that predict them
    /// (kvgate's autoscaling signal).
    fn prefill_waits(&self) -> Option<PrefillWaits> {
        None
    }
    /// The same scrape's `vllm:lora_requests_info`, from pods with adapter slots.
    fn scraped_adapters(&mut self, _pod: usize, _adapters: &EngineAdapters) {}
}

/// What a pod's `vllm:lora_requests_info` says.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineAdapters {
    pub running: Vec<String>,
    pub waiting: Vec<String>,
    pub max_loras: usize,
}

impl EngineAdapters {
    /// The engine's adapters now (`None`: it has no adapter slots, and exports no such metric).
    pub fn of(engine: &Engine) -> Option<Self> {
        let max_loras = engine.config().max_loras;
        (max_loras > 0).then(|| {
            let (running, waiting) = engine.adapters();
            Self { running, waiting, max_loras }
        })
    }
}

/// What a pod's `/metrics` says of its load now.
pub fn reported_load(engine: &Engine) -> ReportedLoad {
    ReportedLoad {
        running: engine.num_running() as f64,
        waiting: engine.num_waiting() as f64,
        kv_cache_usage: engine.kv_cache_usage(),
        num_gpu_blocks: engine.config().num_blocks as f64,
    }
}

/// Cluster layout and engine sizing.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub roles: Vec<PodRole>,
    /// Per pod.
    pub engines: Vec<EngineConfig>,
    /// Seconds between load scrapes (the scorer's `health.scrape_interval`).
    pub scrape_interval: f64,
    /// What clients ask for as `max_tokens` ([`crate::workload::Params::max_tokens`]).
    pub max_tokens_asked: Option<usize>,
    /// Clients keep this many requests in flight, as `kvgate-live-bench`'s do: every
    /// session's first turn waits in one queue in session order, and each answered turn's
    /// successor joins the back of it; start and think times are ignored. `None`: sessions
    /// start at their start times (an open loop).
    pub in_flight: Option<usize>,
}

/// The engines' hash seed (vLLM's `PYTHONHASHSEED`) in every simulated cluster: routers
/// that reproduce the engines' block hashes (vllm-router) need it; kvgate does not.
pub const HASH_SEED: &str = "0";

impl ClusterConfig {
    /// `pods` pods sized and shaped for `workload`: its prefill pods first, then pods that do
    /// both (or decode, in a P/D layout); load scraped every second.
    pub fn for_workload(workload: &Workload, pods: usize) -> Self {
        let roles = (0..pods)
            .map(|i| match (workload.prefill_pods, i < workload.prefill_pods) {
                (0, _) => PodRole::Both,
                (_, true) => PodRole::Prefill,
                (_, false) => PodRole::Decode,
            })
            .collect();
        let reference = EngineConfig {
            num_blocks: workload.num_blocks,
            offload_blocks: workload.offload_blocks,
            max_loras: workload.max_loras,
            lora_load_ms: workload.lora_load_ms,
            sliding_window: workload.sliding_window,
            hash_seed: Some(HASH_SEED.into()),
            ..EngineConfig::default()
        };
        let engines = (0..pods)
            .map(|i| match workload.unlike.iter().find(|(pod, _)| *pod == i) {
                Some((_, shape)) => EngineConfig {
                    num_blocks: shape.num_blocks,
                    timing: reference.timing.slowed(shape.slowdown),
                    ..reference.clone()
                },
                None => reference.clone(),
            })
            .collect();
        Self { roles, engines, scrape_interval: 1.0, max_tokens_asked: None, in_flight: None }
    }

    /// The pods that decode (all but the prefill pool).
    pub fn decode_pods(&self) -> Vec<usize> {
        (0..self.roles.len()).filter(|&p| self.roles[p] != PodRole::Prefill).collect()
    }
}

/// What happened to one request (one turn).
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    pub arrival: f64,
    pub first_token: Option<f64>,
    pub finished: Option<f64>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub output_tokens: usize,
    /// What the router expected `cached_tokens` to be.
    pub predicted_cached_tokens: Option<usize>,
    pub decode_pod: usize,
    pub prefill_pod: Option<usize>,
    /// The engine refused it (too long for a pod's cache).
    pub rejected: bool,
}

/// A finished run.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub requests: Vec<RequestRecord>,
    /// Prompt tokens each pod computed (cached and transferred ones excluded).
    pub prefill_tokens_per_pod: Vec<u64>,
    pub preemptions: u64,
    /// Virtual seconds from the first arrival to the last completion.
    pub makespan: f64,
    /// The most requests one pod had in flight at once (arrival to finish): a pile-up.
    pub peak_inflight: usize,
    /// The autoscaling signals at every scrape while requests came.
    pub signals: Vec<SignalSample>,
}

/// What an autoscaler would read at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub struct SignalSample {
    /// The router's predicted waits (seconds), where it predicts them.
    pub prefill_waits: Option<PrefillWaits>,
    /// The pods' mean KV-cache usage (0–1), as they report it.
    pub kv_cache_usage: f64,
    /// The pods' mean waiting requests (`vllm:num_requests_waiting`): the engines' own queue.
    pub engine_waiting: f64,
}

/// The most requests any one pod served at once (a request counts from arrival to finish;
/// one that never finished, to the end).
pub(crate) fn peak_inflight(records: &[RequestRecord], pods: usize) -> usize {
    (0..pods)
        .map(|pod| {
            let mut changes: Vec<(f64, i32)> = records
                .iter()
                .filter(|r| r.decode_pod == pod)
                .flat_map(|r| [(r.arrival, 1), (r.finished.unwrap_or(f64::INFINITY), -1)])
                .collect();
            // Ends before starts at one instant: a turn over is not a pile-up.
            changes.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let mut n = 0i32;
            changes
                .iter()
                .map(|(_, d)| {
                    n += d;
                    n
                })
                .max()
                .unwrap_or(0) as usize
        })
        .max()
        .unwrap_or(0)
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Arrive { session: usize, turn: usize },
    StepEnd { pod: usize },
    Wake { pod: usize },
    Scrape,
}

struct Scheduled {
    at: f64,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Earliest first (reversed for the max-heap), then in scheduling order.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.seq.cmp(&self.seq))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Leg {
    Prefill,
    Decode,
}

struct Pod {
    engine: Engine,
    /// The step in progress: its result takes effect at its end.
    step: Option<StepResult>,
    wake_at: Option<f64>,
    requests: HashMap<RequestId, (usize, Leg)>,
}

/// Clients with a bounded number of requests in flight ([`ClusterConfig::in_flight`]).
struct ClosedLoop {
    limit: usize,
    in_flight: usize,
    /// Turns waiting to be sent: (session, turn).
    waiting: VecDeque<(usize, usize)>,
}

impl ClosedLoop {
    /// The next waiting turn, counted in flight, while fewer than the limit are.
    fn next(&mut self) -> Option<(usize, usize)> {
        if self.in_flight >= self.limit {
            return None;
        }
        let next = self.waiting.pop_front()?;
        self.in_flight += 1;
        Some(next)
    }
}

/// One turn in flight.
struct Live {
    session: usize,
    turn: usize,
    prompt: Vec<u32>,
    max_tokens: usize,
    output: Vec<u32>,
}

struct Sim<'a> {
    workload: &'a Workload,
    router: &'a mut dyn ClusterRouter,
    pods: Vec<Pod>,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    live: Vec<Live>,
    records: Vec<RequestRecord>,
    /// Per session, the tokens of its conversation so far (prefix + turns + answers).
    history: Vec<Vec<u32>>,
    open_sessions: usize,
    closed_loop: Option<ClosedLoop>,
    scrape_interval: f64,
    max_tokens_asked: Option<usize>,
}

/// Runs `workload` on a cluster laid out as `config`, routed by `router`.
pub fn run(workload: &Workload, config: &ClusterConfig, router: &mut dyn ClusterRouter) -> RunResult {
    let pods = config
        .engines
        .iter()
        .map(|engine| Pod { engine: Engine::new(engine.clone()), step: None, wake_at: None, requests: HashMap::new() })
        .collect();
    let mut sim = Sim {
        workload,
        router,
        pods,
        queue: BinaryHeap::new(),
        seq: 0,
        live: Vec::new(),
        records: Vec::new(),
        history: workload.sessions.iter().map(|s: &Session| s.prefix.clone()).collect(),
        open_sessions: workload.sessions.iter().filter(|s| !s.turns.is_empty()).count(),
        closed_loop: config.in_flight.map(|limit| ClosedLoop { limit, in_flight: 0, waiting: VecDeque::new() }),
        scrape_interval: config.scrape_interval,
        max_tokens_asked: config.max_tokens_asked,
    };
    // The router has scraped every pod once before traffic starts (as the scorer does on
    // start-up), so a burst at t = 0 meets known cache sizes.
    sim.schedule(0.0, Event::Scrape);
    let mut signals = Vec::new();
    for (i, s) in workload.sessions.iter().enumerate() {
        if !s.turns.is_empty() {
            match &mut sim.closed_loop {
                Some(clients) => clients.waiting.push_back((i, 0)),
                None => sim.schedule(s.start, Event::Arrive { session: i, turn: 0 }),
            }
        }
    }
    sim.send_waiting(0.0);
    while let Some(Scheduled { at, event, .. }) = sim.queue.pop() {
        match event {
            Event::Arrive { session, turn } => sim.arrive(session, turn, at),
            Event::StepEnd { pod } => sim.step_end(pod, at),
            Event::Wake { pod } => {
                if sim.pods[pod].wake_at == Some(at) {
                    sim.pods[pod].wake_at = None;
                    sim.kick(pod, at);
                }
            }
            Event::Scrape => {
                if sim.open_sessions == 0 {
                    continue; // everything finished: let the queue drain
                }
                let (mut sample, share) = (SignalSample::default(), 1.0 / sim.pods.len() as f64);
                for (i, p) in sim.pods.iter().enumerate() {
                    let load = reported_load(&p.engine);
                    sample.kv_cache_usage += load.kv_cache_usage * share;
                    sample.engine_waiting += load.waiting * share;
                    sim.router.scraped(i, load, at);
                    if let Some(adapters) = EngineAdapters::of(&p.engine) {
                        sim.router.scraped_adapters(i, &adapters);
                    }
                }
                sample.prefill_waits = sim.router.prefill_waits();
                signals.push(sample);
                sim.schedule(at + sim.scrape_interval, Event::Scrape);
            }
        }
    }
    let first = sim.records.iter().map(|r| r.arrival).fold(f64::INFINITY, f64::min);
    let last = sim.records.iter().filter_map(|r| r.finished).fold(0.0, f64::max);
    RunResult {
        prefill_tokens_per_pod: sim.pods.iter().map(|p| p.engine.counters().prefill_tokens_computed).collect(),
        preemptions: sim.pods.iter().map(|p| p.engine.counters().preemptions).sum(),
        peak_inflight: peak_inflight(&sim.records, config.roles.len()),
        requests: sim.records,
        makespan: (last - first).max(0.0),
        signals,
    }
}

/// A turn as it reaches the router.
fn turn_arrival<'p>(
    workload: &'p Workload,
    asked: Option<usize>,
    id: u64,
    session: usize,
    turn: usize,
    prompt: &'p [u32],
) -> Arrival<'p> {
    let s = &workload.sessions[session];
    let max_tokens = s.turns[turn].max_tokens;
    Arrival {
        id,
        prompt,
        max_tokens: asked.map_or(max_tokens, |asked| asked.max(max_tokens)),
        output_tokens: max_tokens,
        adapter: s.adapter.as_deref(),
    }
}

impl Sim<'_> {
    fn schedule(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.queue.push(Scheduled { at, seq: self.seq, event });
    }

    /// The turns due in the next `seconds` (after `now`), soonest first, at most
    /// [`FORESEEN_MAX`]: when, whose, and their prompts.
    fn foreseen(&self, now: f64, seconds: f64) -> Vec<(f64, usize, usize, Vec<u32>)> {
        if seconds <= 0.0 {
            return Vec::new();
        }
        let mut due: Vec<(f64, usize, usize)> = self
            .queue
            .iter()
            .filter(|s| s.at <= now + seconds)
            .filter_map(|s| match s.event {
                Event::Arrive { session, turn } => Some((s.at, session, turn)),
                _ => None,
            })
            .collect();
        due.sort_by(|a, b| a.0.total_cmp(&b.0));
        due.truncate(FORESEEN_MAX);
        due.into_iter()
            .map(|(at, session, turn)| {
                let mut prompt = self.history[session].clone();
                prompt.extend_from_slice(&self.workload.sessions[session].turns[turn].user);
                (at, session, turn, prompt)
            })
            .collect()
    }

    fn arrive(&mut self, session: usize, turn: usize, now: f64) {
        let s = &self.workload.sessions[session];
        let t = &s.turns[turn];
        self.history[session].extend_from_slice(&t.user);
        let prompt = self.history[session].clone();
        let id = self.live.len();
        let engines: Vec<&Engine> = self.pods.iter().map(|p| &p.engine).collect();
        let arrival = turn_arrival(self.workload, self.max_tokens_asked, id as u64, session, turn, &prompt);
        let foreseen = self.foreseen(now, self.router.foresight());
        let foreseen: Vec<Foreseen<'_>> = foreseen
            .iter()
            .map(|(at, session, turn, prompt)| Foreseen {
                at: *at,
                request: turn_arrival(self.workload, self.max_tokens_asked, u64::MAX, *session, *turn, prompt),
            })
            .collect();
        let choice = self.router.route_seeing(&arrival, now, &engines, &foreseen);
        self.records.push(RequestRecord {
            arrival: now,
            prompt_tokens: prompt.len(),
            decode_pod: choice.decode,
            prefill_pod: choice.prefill,
            predicted_cached_tokens: choice.predicted_cached_tokens,
            ..Default::default()
        });
        self.live.push(Live { session, turn, prompt, max_tokens: t.max_tokens, output: Vec::new() });
        match choice.prefill {
            Some(pod) => self.submit(id, pod, Leg::Prefill, KvTransfer::RemoteDecode, now),
            None => self.submit(id, choice.decode, Leg::Decode, KvTransfer::Local, now),
        }
    }

    fn submit(&mut self, id: usize, pod: usize, leg: Leg, kv_transfer: KvTransfer, now: f64) {
        let live = &self.live[id];
        let lora_name = self.workload.sessions[live.session].adapter.clone();
        let request = NewRequest {
            prompt: live.prompt.clone(),
            max_tokens: live.max_tokens,
            keys: HashKeys { lora_name, ..HashKeys::default() },
            kv_transfer,
        };
        let p = &mut self.pods[pod];
        p.engine.advance_to(now);
        match p.engine.add_request(request) {
            Ok(engine_id) => {
                p.requests.insert(engine_id, (id, leg));
                self.kick(pod, now);
            }
            Err(_) => {
                self.records[id].rejected = true;
                self.router.done(id as u64, None, now);
                self.turn_over(id, now);
            }
        }
    }

    /// Starts the pod's next step if it is not stepping already.
    fn kick(&mut self, pod: usize, now: f64) {
        let p = &mut self.pods[pod];
        if p.step.is_some() {
            return;
        }
        p.engine.advance_to(now);
        let early = p.engine.take_cache_changes();
        if !early.is_empty() {
            self.router.kv_events(pod, &early, now);
        }
        let p = &mut self.pods[pod];
        match p.engine.step() {
            Some(result) => {
                let end = p.engine.now();
                p.step = Some(result);
                self.schedule(end, Event::StepEnd { pod });
            }
            None => {
                if let Some(at) = p.engine.next_wakeup()
                    && p.wake_at != Some(at)
                {
                    p.wake_at = Some(at);
                    self.schedule(at.max(now), Event::Wake { pod });
                }
            }
        }
    }

    fn step_end(&mut self, pod: usize, now: f64) {
        let result = self.pods[pod].step.take().expect("a step was in progress");
        if !result.cache_changes.is_empty() {
            self.router.kv_events(pod, &result.cache_changes, now);
        }
        for out in result.outputs {
            let Some(&(id, leg)) = self.pods[pod].requests.get(&out.id) else { continue };
            match leg {
                Leg::Prefill => {
                    if let Some(f) = out.finished {
                        self.pods[pod].requests.remove(&out.id);
                        self.records[id].cached_tokens = f.usage.cached_tokens;
                        self.router.prefill_done(id as u64, now);
                        let decode = self.records[id].decode_pod;
                        self.submit(id, decode, Leg::Decode, KvTransfer::RemotePrefill, now);
                    }
                }
                Leg::Decode => {
                    self.live[id].output.push(out.token);
                    if self.records[id].first_token.is_none() {
                        self.records[id].first_token = Some(now);
                        self.router.first_token(id as u64, now);
                    }
                    if let Some(f) = out.finished {
                        self.pods[pod].requests.remove(&out.id);
                        let r = &mut self.records[id];
                        r.finished = Some(now);
                        r.output_tokens = f.usage.completion_tokens;
                        if r.prefill_pod.is_none() {
                            r.cached_tokens = f.usage.cached_tokens;
                        }
                        self.router.done(id as u64, Some(f.usage.completion_tokens as u32), now);
                        self.turn_over(id, now);
                    }
                }
            }
        }
        if !self.pods[pod].engine.is_idle() {
            self.kick(pod, now);
        }
    }

    /// Closed loop: sends waiting turns while fewer than the limit are in flight.
    fn send_waiting(&mut self, now: f64) {
        while let Some((session, turn)) = self.closed_loop.as_mut().and_then(ClosedLoop::next) {
            self.schedule(now, Event::Arrive { session, turn });
        }
    }

    /// A turn ended: the session's next turn follows after its think time (closed loop: it
    /// joins the back of the queue).
    fn turn_over(&mut self, id: usize, now: f64) {
        let (session, turn) = (self.live[id].session, self.live[id].turn);
        let output = std::mem::take(&mut self.live[id].output);
        self.history[session].extend_from_slice(&output);
        self.live[id].prompt = Vec::new();
        let turns = &self.workload.sessions[session].turns;
        if let Some(clients) = &mut self.closed_loop {
            clients.in_flight -= 1;
            match turn + 1 < turns.len() {
                true => clients.waiting.push_back((session, turn + 1)),
                false => self.open_sessions -= 1,
            }
            self.send_waiting(now);
            return;
        }
        if turn + 1 < turns.len() {
            self.schedule(now + turns[turn + 1].think, Event::Arrive { session, turn: turn + 1 });
        } else {
            self.open_sessions -= 1;
        }
    }
}
