//! `ttft` — the seed's queue-workload estimate: the pod where this request's first token
//! comes soonest, if a pod works through its queued prefill before this request's own:
//! `queued prefill tokens + uncached tokens of this request + fixed` (linear tokens; `fixed`
//! the tokens a first token's fixed time is worth, [`RouteInput::fixed_prefill_tokens`]),
//! with the pod's reported waiting queue as a tie-breaker; tokens are scaled by the pod's
//! learned slowness ([`crate::speed`]), so a slower pod's queue counts for longer. No decode
//! term: it optimises time to first token only.

use super::{Candidate, Decision, Policy, RouteInput, argmin_tie, uncached_tokens};
use rand::rngs::StdRng;

#[derive(derive_more::Constructor)]
pub struct TtftPolicy {
    rng: StdRng,
}

impl Policy for TtftPolicy {
    fn select(&mut self, input: &RouteInput, candidates: &[Candidate]) -> Decision {
        let costs: Vec<Option<f64>> = candidates
            .iter()
            .map(|c| {
                let waiting = c.reported.map_or(0.0, |r| r.waiting);
                let tokens = c.load.queued_prefill_tokens as f64
                    + f64::from(uncached_tokens(input, c))
                    + input.fixed_prefill_tokens;
                Some(tokens * c.slowness + waiting * 1e-3)
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
    fn soonest_first_token_wins() {
        let mut p = TtftPolicy::new(StdRng::seed_from_u64(1));
        // 1000-token prompt: pod 0 computes 1000; pod 1 computes 200 after 900 queued.
        let cands = [candidate(0, 0, 0, 0), candidate(1, 800, 3, 900)];
        let d = p.select(&INPUT, &cands);
        assert_eq!(d.chosen, 0);
        assert_eq!(d.costs, vec![Some(1000.0), Some(1100.0)]);
    }
}
