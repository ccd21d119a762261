//! Candidates of a request: each eligible pod's cached prefix (indexed, offloaded, or being
//! computed by requests in flight there), booked and reported load, adapter fit and tie rank;
//! and the fallbacks after a decision.

use super::{RouteRequest, Router};
use crate::index::TieredMatch;
use crate::pod_set::{PodId, PodSet};
use crate::policy::{AdapterFit, Candidate, Decision, SlotQueue, home};
use xxhash_rust::xxh3::xxh3_64_with_seed;
/// Up to `n` candidates after the chosen one, best first: those the policy scored by
/// ascending cost, then the unscored in turn after the chosen one (round robin's order).
pub(super) fn fallbacks(candidates: &[Candidate], decision: &Decision, n: usize) -> Vec<PodId> {
    if n == 0 {
        return Vec::new();
    }
    let len = candidates.len();
    let mut order: Vec<usize> = (1..len).map(|k| (decision.chosen + k) % len).collect();
    // Stable: unscored candidates keep their turn order, after every scored one.
    // Pods the policy did not score go after every scored one (NaN is above +∞ in total order).
    let cost = |i: usize| decision.costs.get(i).copied().flatten().unwrap_or(f64::NAN);
    order.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)));
    order.into_iter().take(n).map(|i| candidates[i].pod).collect()
}

impl Router {
    /// Candidates among `pods`: their cached prefix of the request — indexed, or being
    /// computed by requests in flight there — (or `cached_override` tokens, for decode pods
    /// that will receive the KV), booked load and reported load.
    pub(super) fn candidates(
        &mut self,
        pods: &[PodId],
        request: &RouteRequest<'_>,
        now: f64,
        cached_override: Option<u32>,
    ) -> Vec<Candidate> {
        if cached_override.is_none() {
            let precise: PodSet = pods.iter().copied().filter(|p| self.pods[p.index()].precise).collect();
            let approximate: PodSet = pods.iter().copied().filter(|p| !self.pods[p.index()].precise).collect();
            self.index.longest_prefixes(request.chain, &precise, &mut self.overlap);
            self.approx.longest_prefixes(request.chain, &approximate, &mut self.approx_overlap);
        }
        self.recent.advance(now);
        let offloaded = cached_override.is_none() && self.index.has_offloaded();
        let offload = self.index.config().offload;
        let tokens =
            |blocks: u32| (u64::from(blocks) * u64::from(self.block_size)).min(u64::from(request.prompt_tokens)) as u32;
        // vLLM computes at least a prompt's last token: a hit is at most the whole blocks
        // before it (a block-aligned prompt held whole is served one block short).
        let max_hit = request.prompt_tokens.saturating_sub(1) / self.block_size;
        // Rendezvous hashing of the prompt's first block: its own order of pods.
        let first_block = request.chain.first();
        let tie_rank = |p: PodId| {
            first_block.map_or(0, |b| xxh3_64_with_seed(&self.pods[p.index()].key.to_le_bytes(), b.0).max(1))
        };
        let mut in_flight = std::mem::take(&mut self.adapters_in_flight);
        let mut candidates = pods
            .iter()
            .map(|&p| {
                let hybrid = self.index.is_hybrid(p);
                let (adapter, slot_queue) = match request.adapter {
                    Some(adapter) => {
                        self.load.adapters_in_flight(p, now, &mut in_flight);
                        let unknown = self.load.default_decode_seconds(p);
                        self.pods[p.index()].adapters.fit(adapter, &in_flight, unknown)
                    }
                    None => (AdapterFit::Unlimited, SlotQueue::default()),
                };
                let (cached, offloaded_tokens, offload_work_tokens, computing_prefix) = match cached_override {
                    Some(cached) => (cached, 0, 0, false),
                    None => {
                        let overlap = |o: &[u32]| o.get(p.index()).copied().unwrap_or(0);
                        let mut indexed = overlap(&self.overlap).max(overlap(&self.approx_overlap));
                        if hybrid {
                            indexed =
                                self.index.hybrid_prefix(request.chain, p, indexed as usize, max_hit as usize) as u32;
                        }
                        // A hybrid model's window evicts an ended prompt unannounced as a
                        // block evicted: there only what the events say is credited.
                        let finished = if hybrid { 0 } else { self.load.finished_prefix(p, request.chain) };
                        let settled = indexed.max(finished as u32).min(max_hit);
                        let blocks = settled.max((self.load.inflight_prefix(p, request.chain) as u32).min(max_hit));
                        let cached = tokens(blocks);
                        // Blocks past the GPU prefix the pod holds offloaded: loaded, not computed.
                        let run = if offloaded {
                            self.index.offloaded_run(request.chain, p, blocks as usize)
                        } else {
                            TieredMatch::default()
                        };
                        let loaded = tokens(blocks + run.cpu_blocks + run.storage_blocks) - cached;
                        let storage = loaded.min(run.storage_blocks * self.block_size);
                        let work = f64::from(loaded - storage) * offload.cpu_load_cost
                            + f64::from(storage) * offload.storage_load_cost;
                        (cached, loaded, (work.ceil() as u32).min(loaded), blocks > settled)
                    }
                };
                Candidate {
                    pod: p,
                    cached_tokens: cached,
                    offloaded_tokens,
                    offload_work_tokens,
                    pod_blocks: self.pod_blocks(p) as u64,
                    load: self.load.load(p, now),
                    reported: self.pods[p.index()].reported,
                    slowness: self.load.slowness(p),
                    tie_rank: tie_rank(p),
                    group_inflight: 0,
                    recompute_share: self.index.recompute_share(p),
                    recent_blocks: self.recent.blocks(p),
                    offloads: self.index.pod_offloaded_blocks(p) > 0,
                    hybrid,
                    computing_prefix,
                    adapter,
                    slot_queue,
                }
            })
            .collect::<Vec<_>>();
        self.adapters_in_flight = in_flight;
        if let (Some(&block), Some(h)) = (first_block, home(&candidates)) {
            candidates[h].group_inflight = self.load.inflight_sharing(candidates[h].pod, block);
        }
        candidates
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_support::candidate;

    #[test]
    fn fallbacks_go_by_cost_with_unscored_pods_last() {
        let candidates: Vec<Candidate> = (0..5).map(|p| candidate(p, 0, 0, 0)).collect();
        let costs = vec![Some(3.0), None, Some(1.0), Some(f64::INFINITY), Some(2.0)];
        let decision = Decision { chosen: 0, costs };
        assert_eq!(fallbacks(&candidates, &decision, 4), [2, 4, 3, 1].map(PodId));
        assert_eq!(fallbacks(&candidates, &decision, 2), [2, 4].map(PodId));
        assert!(fallbacks(&candidates, &decision, 0).is_empty());
    }
}
