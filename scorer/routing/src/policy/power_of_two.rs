//! `power-of-two` — two pods at random, the less loaded of the two (requests in flight, then
//! reported queue): near-least-loaded balance without herding onto one pod.

use super::least_loaded::load_score;
use super::{Candidate, Decision, Policy, RouteInput};
use rand::Rng;
use rand::rngs::StdRng;

#[derive(derive_more::Constructor)]
pub struct PowerOfTwo {
    rng: StdRng,
}

impl Policy for PowerOfTwo {
    fn select(&mut self, _input: &RouteInput, candidates: &[Candidate]) -> Decision {
        let n = candidates.len();
        let mut costs = vec![None; n];
        if n == 1 {
            return Decision { chosen: 0, costs };
        }
        let a = self.rng.random_range(0..n);
        let b = (a + self.rng.random_range(1..n)) % n;
        costs[a] = Some(load_score(&candidates[a]));
        costs[b] = Some(load_score(&candidates[b]));
        let chosen = if costs[b] < costs[a] { b } else { a };
        Decision { chosen, costs }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidate, histogram};
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_most_loaded_pod_is_never_chosen() {
        let cands = [candidate(0, 0, 1, 0), candidate(1, 0, 5, 0), candidate(2, 0, 9, 0)];
        let h = histogram(&mut PowerOfTwo::new(StdRng::seed_from_u64(5)), &cands, 3000);
        assert_eq!(h[2], 0);
        assert!(h[0] > h[1] && h[1] > 0, "{h:?}");
    }
}
