//! `prefix` — the longest cached prefix wins; among equals, the pod with the fewest requests
//! in flight (then the smallest decode load), then the prompt's own order of pods
//! ([`Candidate::tie_rank`]). Blind to queued work: the policy that piles a hot prefix onto
//! one pod, kept as a reference point.

use super::{Candidate, Decision, Policy, RouteInput, argmin_tie};
use rand::rngs::StdRng;

#[derive(derive_more::Constructor)]
pub struct LongestPrefix {
    rng: StdRng,
}

impl Policy for LongestPrefix {
    fn select(&mut self, _input: &RouteInput, candidates: &[Candidate]) -> Decision {
        // Lexicographic (−cached, inflight, decode blocks) folded into one number.
        let costs: Vec<Option<f64>> = candidates
            .iter()
            .map(|c| {
                Some(
                    -f64::from(c.credited_tokens()) * 1e9
                        + f64::from(c.load.inflight_requests) * 1e4
                        + c.load.decode_blocks.min(9e3),
                )
            })
            .collect();
        let chosen = argmin_tie(&costs, candidates, &mut self.rng);
        Decision { chosen, costs }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{INPUT, candidate};
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn longest_prefix_then_least_loaded() {
        let mut p = LongestPrefix::new(StdRng::seed_from_u64(1));
        let cands = [candidate(0, 100, 0, 0), candidate(1, 500, 9, 99_999), candidate(2, 500, 2, 0)];
        assert_eq!(p.select(&INPUT, &cands).chosen, 2);
        let cands = [candidate(0, 0, 0, 0), candidate(1, 16, 50, 0)];
        assert_eq!(p.select(&INPUT, &cands).chosen, 1, "load never outweighs a longer prefix");
    }
}
