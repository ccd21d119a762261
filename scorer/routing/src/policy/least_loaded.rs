//! `least-loaded` — the pod with the fewest requests kvgate has in flight there, then the
//! smallest reported queue (running + waiting); among equals (load unknown or even), round
//! robin. Ignores the cache.

use super::{Candidate, Decision, Policy, RouteInput};

#[derive(Default)]
pub struct LeastLoaded {
    next: usize,
}

/// Requests in flight, with the reported queue as a fractional tie-breaker.
pub(crate) fn load_score(c: &Candidate) -> f64 {
    let reported = c.reported.map_or(0.0, |r| r.running + r.waiting);
    f64::from(c.load.inflight_requests) + reported / (1.0 + reported) * 0.5
}

impl Policy for LeastLoaded {
    fn select(&mut self, _input: &RouteInput, candidates: &[Candidate]) -> Decision {
        let costs: Vec<Option<f64>> = candidates.iter().map(|c| Some(load_score(c))).collect();
        let best = costs.iter().flatten().copied().fold(f64::INFINITY, f64::min);
        let ties: Vec<usize> = (0..candidates.len()).filter(|&i| costs[i] == Some(best)).collect();
        let chosen = ties[self.next % ties.len()];
        self.next = self.next.wrapping_add(1);
        Decision { chosen, costs }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ReportedLoad;
    use super::super::test_support::{INPUT, candidate, histogram};
    use super::*;

    #[test]
    fn fewest_inflight_then_reported_queue_then_round_robin() {
        let mut p = LeastLoaded::default();
        let cands = [candidate(0, 900, 4, 0), candidate(1, 0, 2, 0), candidate(2, 0, 3, 0)];
        assert_eq!(p.select(&INPUT, &cands).chosen, 1);
        let mut a = candidate(0, 0, 1, 0);
        a.reported = Some(ReportedLoad { running: 5.0, waiting: 2.0, ..Default::default() });
        let b = candidate(1, 0, 1, 0);
        assert_eq!(p.select(&INPUT, &[a, b]).chosen, 1);
        let even = [candidate(0, 0, 0, 0), candidate(1, 0, 0, 0), candidate(2, 0, 0, 0)];
        assert_eq!(histogram(&mut p, &even, 300), vec![100, 100, 100], "no load known: round robin");
    }
}
