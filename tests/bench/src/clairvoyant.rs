//! The clairvoyant bound: what routing could reach if it saw everything. Not a policy a
//! gateway can run — it reads each simulated engine's true state (cache contents and
//! eviction order, queue and batch, speed) — but the ceiling kvgate's distance is measured
//! against.
//!
//! Greedy on true state: for each request and each pod that can serve it, a copy of the
//! engine runs ahead (virtual time) with the request and without it; the request goes where
//! the fleet loses least ([`Clairvoyant::cost`]): its own TTFT, the delay it causes to
//! requests on that pod still waiting for their first token, and the decode time the pod's
//! other requests lose over a horizon. Output lengths are the workload's true ones (the
//! engines' true lengths, not what clients ask for). Greedy, so not an upper bound
//! everywhere: it cannot keep room for the arrivals to come.
//!
//! With look-ahead (`clairvoyant@look-ahead`) it also sees the arrivals of the next
//! [`FORESIGHT`] seconds: each joins both what-ifs of the pod it would go to on its own
//! (the one that would serve it soonest, by [`least_cost`]), and the delay the request
//! causes to their first tokens counts too. So a pod whose cache or compute the next
//! requests need is kept for them.
//!
//! What-ifs are what it costs: at 64 pods, one per pod for every request. So the pods are
//! ranked by a cheap estimate (a lower bound of the request's first token there, plus the
//! decode time its prefill, what neither cache tier holds, takes from the pod's running
//! requests), the what-ifs run on the best [`SHORTLIST`] of them only, and not on one whose
//! lower bound cannot beat the best found. Each pod's run without the request is kept while
//! its engine is unchanged.

use crate::cluster::{Arrival, Choice, ClusterRouter, Foreseen, PodRole};
use ahash::AHashMap;
use kvgate_sim::cache::{EngineBlockHash, HashKeys};
use kvgate_sim::engine::{Backlog, Engine, KvTransfer, NewRequest, RequestId};
use std::rc::Rc;

/// Steps a what-if runs at most: a pod further behind than this is no place for the request.
const MAX_STEPS: usize = 4096;
/// A busy pod's run without the request covers this many seconds past the horizon, so the
/// decisions before the pod's next step share it.
const REUSE: f64 = 0.25;
/// What-ifs per decision at most (at 8 pods, every pod).
const SHORTLIST: usize = 8;
/// Seconds of arrivals to come the look-ahead variant sees (the soonest
/// [`crate::cluster::FORESEEN_MAX`] of them).
pub const FORESIGHT: f64 = 0.2;

pub struct Clairvoyant {
    /// Pods that take a request whole (prefill and decode).
    serving: Vec<usize>,
    /// Virtual seconds a what-if looks ahead for decode slowdown (0: first tokens only).
    horizon: f64,
    /// Seconds of arrivals to come it plans for (0: greedy).
    foresight: f64,
    /// Per pod, its last run without a new request (and no arrivals), and the engine
    /// revision it ran from.
    without: Vec<Option<(u64, Rc<Ahead>)>>,
    /// Per pod, its last backlog, and the engine revision it is of.
    backlogs: Vec<Option<(u64, Rc<Backlog>)>>,
    /// The engines the what-ifs run on, with the request and without it: copied into, not
    /// allocated anew each time.
    with: Option<Engine>,
    without_it: Option<Engine>,
}

impl Clairvoyant {
    pub fn new(roles: &[PodRole], horizon: f64, foresight: f64) -> Self {
        Self {
            serving: (0..roles.len()).filter(|&p| roles[p] != PodRole::Prefill).collect(),
            horizon,
            foresight,
            without: (0..roles.len()).map(|_| None).collect(),
            backlogs: (0..roles.len()).map(|_| None).collect(),
            with: None,
            without_it: None,
        }
    }
}

/// What a what-if saw: when each watched request got its first token, and every token's
/// time.
#[derive(Default)]
struct Ahead {
    first: AHashMap<RequestId, f64>,
    /// (when, whose) of every token, in time order.
    tokens: Vec<(f64, RequestId)>,
    /// The engine ids the requests that arrived during the run got (`None`: refused).
    arrived: Vec<Option<RequestId>>,
    /// The run saw everything up to this time (infinite: the engine fell idle).
    until: f64,
}

impl Ahead {
    /// Tokens each request produced by `t`.
    fn tokens_by(&self, t: f64) -> AHashMap<RequestId, u32> {
        let mut by = AHashMap::new();
        for &(_, id) in self.tokens.iter().take_while(|(at, _)| *at <= t) {
            *by.entry(id).or_default() += 1;
        }
        by
    }

    /// A run in which nothing has happened (yet): an idle engine's whole run.
    fn idle() -> Self {
        Self { until: f64::INFINITY, ..Self::default() }
    }
}

/// Runs `engine` ahead from `now` until every request of `watched` (and of `arriving`) has
/// its first token and `until` has passed (or `MAX_STEPS` steps), adding each of `arriving`
/// at its time.
fn run_ahead(
    engine: &mut Engine,
    now: f64,
    until: f64,
    watched: &[RequestId],
    arriving: &[(f64, NewRequest)],
) -> Ahead {
    let mut ahead = Ahead::idle();
    let mut watched = watched.to_vec();
    engine.advance_to(now);
    let mut next = 0;
    for _ in 0..MAX_STEPS {
        while let Some((_, request)) = arriving.get(next).filter(|(at, _)| *at <= engine.now()) {
            let id = engine.add_request(request.clone()).ok();
            watched.extend(id);
            ahead.arrived.push(id);
            next += 1;
        }
        if ahead.first.len() == watched.len() && next == arriving.len() && engine.now() >= until {
            ahead.until = engine.now();
            return ahead;
        }
        match engine.step() {
            Some(step) => {
                let at = engine.now();
                for out in step.outputs {
                    ahead.tokens.push((at, out.id));
                    if watched.contains(&out.id) {
                        ahead.first.entry(out.id).or_insert(at);
                    }
                }
            }
            None => match engine.next_wakeup().into_iter().chain(arriving.get(next).map(|a| a.0)).reduce(f64::min) {
                Some(at) => engine.advance_to(at),
                None => return ahead, // idle: nothing more happens
            },
        }
    }
    ahead.until = engine.now();
    ahead
}

/// `engine`, copied into `slot`'s allocations.
fn copy_into<'s>(slot: &'s mut Option<Engine>, engine: &Engine) -> &'s mut Engine {
    match slot {
        Some(copy) => {
            copy.clone_from(engine);
            copy
        }
        None => slot.insert(engine.clone()),
    }
}

/// A request that prefills and decodes on the pod it is sent to.
fn local(request: &Arrival<'_>) -> NewRequest {
    NewRequest {
        prompt: request.prompt.to_vec(),
        max_tokens: request.output_tokens,
        keys: keys(request),
        kv_transfer: KvTransfer::Local,
    }
}

fn keys(request: &Arrival<'_>) -> HashKeys {
    HashKeys { lora_name: request.adapter.map(String::from), ..HashKeys::default() }
}

/// A request's block hashes, hashed once for every engine that hashes alike.
struct Blocks {
    root: EngineBlockHash,
    block_size: usize,
    hashes: Vec<EngineBlockHash>,
}

impl Blocks {
    fn of(request: &Arrival<'_>, engine: &Engine) -> Self {
        let hashes = engine.block_hashes(request.prompt, &keys(request));
        Self { root: engine.hash_root(), block_size: engine.config().block_size, hashes }
    }

    /// The tokens of the request `engine` holds now or computes for a request ahead first,
    /// and those its offload tier holds after them (they would load, not compute).
    fn held_tokens(&self, engine: &Engine, backlog: &Backlog, request: &Arrival<'_>) -> (usize, usize) {
        let bs = engine.config().block_size;
        let own;
        let hashes = if engine.hash_root() == self.root && bs == self.block_size {
            &self.hashes
        } else {
            own = engine.block_hashes(request.prompt, &keys(request));
            &own
        };
        let cached = engine.cached_or_queued_prefix(hashes, backlog);
        (cached * bs, engine.offloaded_run(hashes, cached) * bs)
    }

    /// What the request looks to cost on `engine` arriving at `at`: a lower bound of its
    /// first token there ([`least_cost`]), and that plus the decode time its prefill takes
    /// from each request running there over `horizon` (an estimate; what pods are ranked by).
    fn estimate(&self, engine: &Engine, backlog: &Backlog, request: &Arrival<'_>, at: f64, horizon: f64) -> (f64, f64) {
        let (cached, offloaded) = self.held_tokens(engine, backlog, request);
        let least = least_cost(engine, request.prompt.len(), cached, backlog.tokens, at);
        let computed = request.prompt.len().saturating_sub(cached + offloaded);
        let prefill = engine.config().timing.token_ms * computed as f64 / 1000.0;
        let decode = if horizon > 0.0 { prefill * engine.num_running() as f64 } else { 0.0 };
        (least, least + decode)
    }
}

/// A lower bound of the request's time to first token on `engine`: the step in progress,
/// then at least the tokens scheduled ahead of it ([`Backlog`]) and its own not cached by
/// then, in as few steps as the token budget allows (an offload tier may hold all of its
/// prompt: then one token counts).
fn least_cost(engine: &Engine, prompt: usize, cached: usize, tokens_ahead: usize, now: f64) -> f64 {
    let config = engine.config();
    let own = if config.offload_blocks > 0 { 1 } else { prompt.saturating_sub(cached).max(1) };
    let tokens = tokens_ahead + own;
    let steps = tokens.div_ceil(config.max_num_batched_tokens).max(1);
    let compute_ms = config.timing.step_base_ms * steps as f64 + config.timing.token_ms * tokens as f64;
    (engine.now() - now).max(0.0) + compute_ms / 1000.0
}

/// How much later each of `before`'s first tokens came in `after` (infinite for one that
/// came before but not after; nothing for one the run without the request did not reach).
fn first_token_delay(
    before: &Ahead,
    after: &Ahead,
    ids: impl Iterator<Item = (Option<RequestId>, Option<RequestId>)>,
) -> f64 {
    ids.map(|(b, a)| match (b.and_then(|b| before.first.get(&b)), a.and_then(|a| after.first.get(&a))) {
        (Some(b), Some(a)) => (a - b).max(0.0),
        (Some(_), None) => f64::INFINITY,
        (None, _) => 0.0,
    })
    .sum()
}

impl Clairvoyant {
    /// `engine` (pod `pod`, its requests `waiting` for their first token) run ahead without
    /// a new request, but with `arriving`. Without arrivals, a busy pod's run is kept and
    /// reused while its engine is unchanged.
    fn without(
        &mut self,
        pod: usize,
        engine: &Engine,
        waiting: &[RequestId],
        now: f64,
        arriving: &[(f64, NewRequest)],
    ) -> Rc<Ahead> {
        let until = now + self.horizon;
        if engine.is_idle() && arriving.is_empty() {
            return Rc::new(Ahead::idle());
        }
        if !arriving.is_empty() || engine.now() < now {
            return Rc::new(run_ahead(copy_into(&mut self.without_it, engine), now, until, waiting, arriving));
        }
        if let Some((revision, run)) = &self.without[pod]
            && *revision == engine.revision()
            && run.until >= until
        {
            return run.clone();
        }
        let run = Rc::new(run_ahead(copy_into(&mut self.without_it, engine), now, until + REUSE, waiting, &[]));
        self.without[pod] = Some((engine.revision(), run.clone()));
        run
    }

    /// What placing the request on `engine` costs the fleet, in seconds (infinite where the
    /// engine refuses it or the what-if runs out of steps): its own time to first token, the
    /// delay to the first tokens of requests on the pod still waiting for theirs (and of the
    /// `arriving` ones), and — over the horizon — the decode time the pod's other requests
    /// lose to it (a fuller batch steps slower, for everyone routed there later too; the
    /// arrivals count by their first tokens only).
    fn cost(
        &mut self,
        pod: usize,
        engine: &Engine,
        request: &Arrival<'_>,
        now: f64,
        arriving: &[(f64, NewRequest)],
    ) -> f64 {
        let horizon = self.horizon;
        let waiting: Vec<RequestId> = engine.awaiting_first_token().collect();
        let with = copy_into(&mut self.with, engine);
        with.advance_to(now);
        let Ok(id) = with.add_request(local(request)) else { return f64::INFINITY };
        let mut watched = waiting.clone();
        watched.push(id);
        let after = run_ahead(with, now, now + horizon, &watched, arriving);
        let Some(own) = after.first.get(&id) else { return f64::INFINITY };
        let before = self.without(pod, engine, &waiting, now, arriving);
        let before = before.as_ref();
        let delays = first_token_delay(before, &after, waiting.iter().map(|&r| (Some(r), Some(r))))
            + first_token_delay(before, &after, before.arrived.iter().copied().zip(after.arrived.iter().copied()));
        let (produced, produced_with) = (before.tokens_by(now + horizon), after.tokens_by(now + horizon));
        let decode_delays: f64 = produced
            .iter()
            .filter(|(r, _)| !before.arrived.contains(&Some(**r)))
            .map(|(r, &n)| {
                let lost = n.saturating_sub(produced_with.get(r).copied().unwrap_or(0));
                f64::from(lost) * horizon / f64::from(n)
            })
            .sum();
        (own - now) + delays + decode_delays
    }
}

impl ClusterRouter for Clairvoyant {
    fn route(&mut self, _request: &Arrival<'_>, _now: f64) -> Choice {
        unreachable!("the clairvoyant bound needs the engines: the simulator calls route_seeing")
    }

    fn foresight(&self) -> f64 {
        self.foresight
    }

    fn route_seeing(
        &mut self,
        request: &Arrival<'_>,
        now: f64,
        engines: &[&Engine],
        foreseen: &[Foreseen<'_>],
    ) -> Choice {
        let backlogs: Vec<Rc<Backlog>> = self
            .serving
            .iter()
            .map(|&p| match &self.backlogs[p] {
                Some((revision, backlog)) if *revision == engines[p].revision() => backlog.clone(),
                _ => {
                    let backlog = Rc::new(engines[p].backlog());
                    self.backlogs[p] = Some((engines[p].revision(), backlog.clone()));
                    backlog
                }
            })
            .collect();
        let reference = engines[self.serving[0]];
        // The arrivals to come, each on the pod that would serve it soonest on its own.
        let mut arriving: Vec<Vec<(f64, NewRequest)>> = vec![Vec::new(); engines.len()];
        for f in foreseen.iter().filter(|f| f.at <= now + self.foresight) {
            let blocks = Blocks::of(&f.request, reference);
            let cost =
                |i: usize| blocks.estimate(engines[self.serving[i]], &backlogs[i], &f.request, f.at, self.horizon).0;
            let i = (0..self.serving.len()).min_by(|&a, &b| cost(a).total_cmp(&cost(b))).expect("a pod serves");
            arriving[self.serving[i]].push((f.at, local(&f.request)));
        }
        // The pods whose cost looks least ([`Blocks::estimate`]): a what-if runs on the first
        // `SHORTLIST` of them, where the lower bound could still beat the best found.
        let blocks = Blocks::of(request, reference);
        let mut order: Vec<(usize, f64, f64)> = self
            .serving
            .iter()
            .zip(&backlogs)
            .map(|(&p, backlog)| {
                let (least, estimate) = blocks.estimate(engines[p], backlog, request, now, self.horizon);
                (p, least, estimate)
            })
            .collect();
        order.sort_by(|a, b| a.2.total_cmp(&b.2));
        let mut best = (self.serving[0], f64::INFINITY);
        for (p, least, _) in order.into_iter().take(SHORTLIST) {
            if least >= best.1 {
                continue;
            }
            let cost = self.cost(p, engines[p], request, now, &arriving[p]);
            if cost < best.1 {
                best = (p, cost);
            }
        }
        Choice::pod(best.0)
    }

    fn done(&mut self, _id: u64, _output_tokens: Option<u32>, _now: f64) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_sim::engine::EngineConfig;

    fn engine() -> Engine {
        Engine::new(EngineConfig { num_blocks: 2_000, ..EngineConfig::default() })
    }

    fn arrival(id: u64, prompt: &[u32], max_tokens: usize) -> Arrival<'_> {
        Arrival { id, prompt, max_tokens, output_tokens: max_tokens, adapter: None }
    }

    fn submit(engine: &mut Engine, prompt: &[u32], max_tokens: usize) {
        engine.add_request(local(&arrival(0, prompt, max_tokens))).unwrap();
    }

    /// Runs the engine until it is idle.
    fn drain(engine: &mut Engine) {
        while engine.step().is_some() {}
    }

    #[test]
    fn it_goes_where_the_prompt_is_cached_unless_that_pod_is_buried() {
        let prompt: Vec<u32> = (1..=4_000).collect();
        let (mut warm, cold) = (engine(), engine());
        submit(&mut warm, &prompt, 1);
        drain(&mut warm);
        let mut router = Clairvoyant::new(&[PodRole::Both, PodRole::Both], 1.0, 0.0);
        let now = warm.now();
        let choice = router.route_seeing(&arrival(0, &prompt, 10), now, &[&cold, &warm], &[]);
        assert_eq!(choice, Choice::pod(1), "the warm pod computes nothing");
        assert!(warm.awaiting_first_token().next().is_none(), "a what-if leaves the engine as it was");

        // The warm pod has a queue of long unique prompts ahead of it: the cold pod answers first.
        for i in 0..8u32 {
            let other: Vec<u32> = (0..8_000).map(|t| 100_000 * (i + 1) + t).collect();
            submit(&mut warm, &other, 50);
        }
        let choice = router.route_seeing(&arrival(1, &prompt, 10), now, &[&cold, &warm], &[]);
        assert_eq!(choice, Choice::pod(0));
        assert_eq!(warm.awaiting_first_token().count(), 8);
    }

    #[test]
    fn with_look_ahead_it_keeps_a_pod_for_the_request_about_to_need_its_cache() {
        let document: Vec<u32> = (1..=4_000).collect();
        let (mut warm, cold) = (engine(), engine());
        submit(&mut warm, &document, 1);
        drain(&mut warm);
        let now = warm.now();
        let unique: Vec<u32> = (0..4_000).map(|t| 900_000 + t).collect();
        let question: Vec<u32> = document.iter().copied().chain(10..60).collect();
        let foreseen = [Foreseen { at: now + 0.005, request: arrival(1, &question, 10) }];
        let roles = [PodRole::Both, PodRole::Both];

        // Either pod serves the unique prompt alike: greedy takes the first.
        let mut greedy = Clairvoyant::new(&roles, 1.0, 0.0);
        assert_eq!(greedy.route_seeing(&arrival(0, &unique, 10), now, &[&warm, &cold], &foreseen), Choice::pod(0));
        // Seeing the question about to come for the warm pod's document, it leaves that pod to it.
        let mut ahead = Clairvoyant::new(&roles, 1.0, FORESIGHT);
        assert_eq!(ahead.route_seeing(&arrival(0, &unique, 10), now, &[&warm, &cold], &foreseen), Choice::pod(1));
    }
}
