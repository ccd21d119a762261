//! `least-loaded` — the pod with the fewest requests kvgate has in flight there, then the
//! smallest reported queue (running + waiting), then at random. Ignores the cache.

use super::{Candidate, Decision, Policy, RouteInput, argmin_random_tie};
use rand::rngs::StdRng;

pub struct LeastLoaded {
    rng: StdRng,
}

impl LeastLoaded {
    pub fn new(rng: StdRng) -> Self {
        Self { rng }
    }
}

/// Requests in flight, with the reported queue as a fractional tie-breaker.
pub(crate) fn load_score(c: &Candidate) -> f64 {
    let reported = c.reported.map_or(0.0, |r| r.running + r.waiting);
    f64::from(c.load.inflight_requests) + reported / (1.0 + reported) * 0.5
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(&mut self, _input: &RouteInput, candidates: &[Candidate]) -> Decision {
        let costs: Vec<Option<f64>> = candidates.iter().map(|c| Some(load_score(c))).collect();
        let chosen = argmin_random_tie(&costs, &mut self.rng);
        Decision { chosen, costs }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ReportedLoad;
    use super::super::test_support::{INPUT, candidate};
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn fewest_inflight_then_reported_queue() {
        let mut p = LeastLoaded::new(StdRng::seed_from_u64(1));
        let cands = [candidate(0, 900, 4, 0), candidate(1, 0, 2, 0), candidate(2, 0, 3, 0)];
        assert_eq!(p.select(&INPUT, &cands).chosen, 1);
        let mut a = candidate(0, 0, 1, 0);
        a.reported = Some(ReportedLoad { running: 5.0, waiting: 2.0, ..Default::default() });
        let b = candidate(1, 0, 1, 0);
        assert_eq!(p.select(&INPUT, &[a, b]).chosen, 1);
    }
}
