//! `random` — a pod uniformly at random: the other baseline.

use super::{Candidate, Decision, Policy, RouteInput};
use rand::Rng;
use rand::rngs::StdRng;

#[derive(derive_more::Constructor)]
pub struct Random {
    rng: StdRng,
}

impl Policy for Random {
    fn select(&mut self, _input: &RouteInput, candidates: &[Candidate]) -> Decision {
        Decision { chosen: self.rng.random_range(0..candidates.len()), costs: vec![None; candidates.len()] }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidate, histogram};
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn spreads_uniformly() {
        let cands = [candidate(0, 999, 0, 0), candidate(1, 0, 9, 0), candidate(2, 0, 0, 0)];
        let h = histogram(&mut Random::new(StdRng::seed_from_u64(3)), &cands, 3000);
        assert!(h.iter().all(|&n| (850..1150).contains(&n)), "{h:?}");
    }
}
