//! `round-robin` — each pod in turn, ignoring cache and load: the baseline.

use super::{Candidate, Decision, Policy, RouteInput};

#[derive(Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn select(&mut self, _input: &RouteInput, candidates: &[Candidate]) -> Decision {
        let chosen = self.next % candidates.len();
        self.next = self.next.wrapping_add(1);
        Decision { chosen, costs: vec![None; candidates.len()] }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{INPUT, candidate, histogram};
    use super::*;

    #[test]
    fn cycles_through_the_pods() {
        let cands = [candidate(0, 0, 0, 0), candidate(1, 999, 0, 0), candidate(2, 0, 0, 0)];
        let mut p = RoundRobin::default();
        let order: Vec<usize> = (0..6).map(|_| p.select(&INPUT, &cands).chosen).collect();
        assert_eq!(order, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(histogram(&mut p, &cands, 300), vec![100, 100, 100]);
    }
}
