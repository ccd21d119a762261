//! The clairvoyant bound: what routing could reach if it saw everything. Not a policy a
//! gateway can run — it reads each simulated engine's true state (cache contents and
//! eviction order, queue and batch, speed) — but the ceiling kvgate's distance is measured
//! against.
//!
//! Greedy on true state: for each request and each pod that can serve it, a copy of the
//! engine runs ahead (virtual time, no further arrivals) with the request and without it;
//! the request goes where the fleet loses least ([`cost`]): its own TTFT, the delay it
//! causes to requests on that pod still waiting for their first token, and the decode time
//! the pod's other requests lose over a horizon. Output lengths are the workload's true ones
//! (the engines' true lengths, not what clients ask for). Greedy, so not an upper bound everywhere: it cannot
//! keep room for the arrivals to come.

use crate::cluster::{Arrival, Choice, ClusterRouter, PodRole};
use kvgate_sim::cache::HashKeys;
use kvgate_sim::engine::{Engine, KvTransfer, NewRequest, RequestId};
use std::collections::HashMap;

/// Steps a what-if runs at most: a pod further behind than this is no place for the request.
const MAX_STEPS: usize = 4096;

pub struct Clairvoyant {
    /// Pods that take a request whole (prefill and decode).
    serving: Vec<usize>,
    /// Virtual seconds a what-if looks ahead for decode slowdown (0: first tokens only).
    horizon: f64,
}

impl Clairvoyant {
    pub fn new(roles: &[PodRole], horizon: f64) -> Self {
        Self { serving: (0..roles.len()).filter(|&p| roles[p] != PodRole::Prefill).collect(), horizon }
    }
}

/// What a what-if saw: when each watched request got its first token, and how many tokens
/// each request produced by the horizon.
#[derive(Default)]
struct Ahead {
    first: HashMap<RequestId, f64>,
    tokens: HashMap<RequestId, u32>,
}

/// Runs `engine` ahead from `now` until every request of `watched` has its first token and
/// the horizon has passed (or `MAX_STEPS` steps).
fn run_ahead(engine: &mut Engine, now: f64, horizon: f64, watched: &[RequestId]) -> Ahead {
    let mut ahead = Ahead::default();
    engine.advance_to(now);
    for _ in 0..MAX_STEPS {
        if ahead.first.len() == watched.len() && engine.now() >= now + horizon {
            break;
        }
        match engine.step() {
            Some(step) => {
                let at = engine.now();
                for out in step.outputs {
                    if at <= now + horizon {
                        *ahead.tokens.entry(out.id).or_default() += 1;
                    }
                    if watched.contains(&out.id) {
                        ahead.first.entry(out.id).or_insert(at);
                    }
                }
            }
            None => match engine.next_wakeup() {
                Some(at) => engine.advance_to(at),
                None => break,
            },
        }
    }
    ahead
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

/// What placing the request on `engine` costs the fleet, in seconds (infinite where the
/// engine refuses it or the what-if runs out of steps): its own time to first token, the
/// delay to the first tokens of requests on the pod still waiting for theirs, and — over
/// `horizon` — the decode time the pod's other requests lose to it (a fuller batch steps
/// slower, for everyone routed there later too).
fn cost(engine: &Engine, request: &Arrival<'_>, now: f64, horizon: f64) -> f64 {
    let waiting: Vec<RequestId> = engine.awaiting_first_token().collect();
    let before = run_ahead(&mut engine.clone(), now, horizon, &waiting);
    let mut with = engine.clone();
    with.advance_to(now);
    let Ok(id) = with.add_request(local(request)) else { return f64::INFINITY };
    let mut watched = waiting.clone();
    watched.push(id);
    let after = run_ahead(&mut with, now, horizon, &watched);
    let Some(own) = after.first.get(&id) else { return f64::INFINITY };
    let first_token_delays: f64 = waiting
        .iter()
        .map(|r| match (before.first.get(r), after.first.get(r)) {
            (Some(b), Some(a)) => (a - b).max(0.0),
            (Some(_), None) => f64::INFINITY,
            (None, _) => 0.0,
        })
        .sum();
    let decode_delays: f64 = before
        .tokens
        .iter()
        .map(|(r, &n)| {
            let lost = n.saturating_sub(after.tokens.get(r).copied().unwrap_or(0));
            f64::from(lost) * horizon / f64::from(n)
        })
        .sum();
    (own - now) + first_token_delays + decode_delays
}

/// A lower bound of [`cost`]: the request waits for the step in progress, then computes at
/// least what the pod has not cached, alone in its batch (an offload tier may hold more of
/// it: then only the wait and one step count).
fn least_cost(engine: &Engine, request: &Arrival<'_>, now: f64) -> f64 {
    let config = engine.config();
    let cached = engine.cached_prefix_blocks(request.prompt, &keys(request)) * config.block_size;
    let uncached = if config.offload_blocks > 0 { 0 } else { request.prompt.len().saturating_sub(cached) };
    let steps = uncached.div_ceil(config.max_num_batched_tokens).max(1);
    let compute_ms = config.timing.step_base_ms * steps as f64 + config.timing.token_ms * uncached as f64;
    (engine.now() - now).max(0.0) + compute_ms / 1000.0
}

impl ClusterRouter for Clairvoyant {
    fn route(&mut self, _request: &Arrival<'_>, _now: f64) -> Choice {
        unreachable!("the clairvoyant bound needs the engines: the simulator calls route_seeing")
    }

    fn route_seeing(&mut self, request: &Arrival<'_>, now: f64, engines: &[&Engine]) -> Choice {
        // Pods in order of the least their cost could be; a what-if runs only where that
        // could still beat the best found. Near-exact, far cheaper: the bound counts what a
        // pod holds now, and a request already there may compute more of the prefix first.
        let mut order: Vec<(usize, f64)> =
            self.serving.iter().map(|&p| (p, least_cost(engines[p], request, now))).collect();
        order.sort_by(|a, b| a.1.total_cmp(&b.1));
        let mut best = (self.serving[0], f64::INFINITY);
        for (p, least) in order {
            if least >= best.1 {
                break;
            }
            let cost = cost(engines[p], request, now, self.horizon);
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
        let mut router = Clairvoyant::new(&[PodRole::Both, PodRole::Both], 1.0);
        let now = warm.now();
        let choice = router.route_seeing(&arrival(0, &prompt, 10), now, &[&cold, &warm]);
        assert_eq!(choice, Choice::pod(1), "the warm pod computes nothing");
        assert!(warm.awaiting_first_token().next().is_none(), "a what-if leaves the engine as it was");

        // The warm pod has a queue of long unique prompts ahead of it: the cold pod answers first.
        for i in 0..8u32 {
            let other: Vec<u32> = (0..8_000).map(|t| 100_000 * (i + 1) + t).collect();
            submit(&mut warm, &other, 50);
        }
        let choice = router.route_seeing(&arrival(1, &prompt, 10), now, &[&cold, &warm]);
        assert_eq!(choice, Choice::pod(0));
        assert_eq!(warm.awaiting_first_token().count(), 8);
    }
}
