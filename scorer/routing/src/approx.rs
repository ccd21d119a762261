//! The approximate index, for pods that publish no KV events.
//!
//! Without events kvgate cannot know what such a pod cached, but it knows what it sent there:
//! a request's blocks are very likely cached on the pod that just served it, for a while.
//! So each routing decision records the request's block hashes for the chosen pod with a
//! time to live (refreshed when routed again); after the TTL the pod is assumed to have
//! evicted them. This is what llm-d's approximate prefix scorer and Dynamo's no-events mode
//! do. Time is supplied by the caller, in seconds.

use crate::hash::SequenceHash;
use crate::holders::BlockHolders;
use crate::pod_set::{PodId, PodMap, PodSet};
use ahash::AHashMap;
use std::collections::VecDeque;

#[derive(Default)]
struct PodRoutes {
    /// Latest expiry per block.
    expires: AHashMap<SequenceHash, f64>,
    /// (block, expiry) in recording order; stale slots are skipped.
    order: VecDeque<(SequenceHash, f64)>,
}

/// Blocks recently routed to each pod.
pub struct ApproxIndex {
    ttl: f64,
    max_blocks_per_pod: usize,
    holders: BlockHolders,
    pods: PodMap<PodRoutes>,
}

impl ApproxIndex {
    pub fn new(ttl_seconds: f64, max_blocks_per_pod: usize) -> Self {
        Self { ttl: ttl_seconds, max_blocks_per_pod, holders: BlockHolders::default(), pods: PodMap::default() }
    }

    /// Records that `chain` was routed to `pod` at `now`.
    pub fn record(&mut self, pod: PodId, chain: &[SequenceHash], now: f64) {
        let expiry = now + self.ttl;
        let routes = self.pods.get_mut(pod);
        for &h in chain {
            if routes.expires.insert(h, expiry).is_none() {
                self.holders.insert(h, pod);
            }
            routes.order.push_back((h, expiry));
        }
        while routes.expires.len() > self.max_blocks_per_pod {
            let Some((h, at)) = routes.order.pop_front() else { break };
            if routes.expires.get(&h) == Some(&at) {
                routes.expires.remove(&h);
                self.holders.remove(h, pod);
            }
        }
    }

    /// Forgets blocks whose TTL has passed.
    pub fn expire(&mut self, now: f64) {
        for (i, routes) in self.pods.values_mut().enumerate() {
            while let Some(&(h, at)) = routes.order.front().filter(|(_, at)| *at <= now) {
                routes.order.pop_front();
                if routes.expires.get(&h) == Some(&at) {
                    routes.expires.remove(&h);
                    self.holders.remove(h, PodId(i as u32));
                }
            }
        }
    }

    /// Forgets everything routed to `pod`.
    pub fn clear_pod(&mut self, pod: PodId) {
        let routes = std::mem::take(self.pods.get_mut(pod));
        for h in routes.expires.into_keys() {
            self.holders.remove(h, pod);
        }
    }

    /// Blocks recorded for `pod`.
    pub fn pod_blocks(&self, pod: PodId) -> usize {
        self.pods.get(pod).map_or(0, |r| r.expires.len())
    }

    /// Leading blocks of `chain` recently routed to each pod in `eligible` (see
    /// [`crate::index::KvIndex::longest_prefixes`]); entries past their TTL but not yet
    /// expired by [`ApproxIndex::expire`] still count.
    pub fn longest_prefixes(&self, chain: &[SequenceHash], eligible: &PodSet, out: &mut Vec<u32>) {
        self.holders.longest_prefixes(chain, eligible, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64) -> Vec<SequenceHash> {
        (1..=n).map(SequenceHash).collect()
    }

    #[test]
    fn routed_blocks_count_until_their_ttl() {
        let mut idx = ApproxIndex::new(10.0, 1000);
        let (a, b) = (PodId(0), PodId(1));
        let both: PodSet = [a, b].into_iter().collect();
        idx.record(a, &chain(5), 0.0);
        idx.record(b, &chain(2), 5.0);
        let mut out = Vec::new();
        idx.longest_prefixes(&chain(8), &both, &mut out);
        assert_eq!(out, vec![5, 2]);
        idx.expire(10.0);
        idx.longest_prefixes(&chain(8), &both, &mut out);
        assert_eq!(out, vec![0, 2], "a's records expired");
        // Routing again refreshes the TTL.
        idx.record(b, &chain(2), 12.0);
        idx.expire(15.5);
        idx.longest_prefixes(&chain(8), &both, &mut out);
        assert_eq!(out, vec![0, 2]);
        idx.clear_pod(b);
        idx.longest_prefixes(&chain(8), &both, &mut out);
        assert_eq!(out, vec![0, 0]);
    }

    #[test]
    fn the_per_pod_cap_drops_the_oldest_records() {
        let mut idx = ApproxIndex::new(100.0, 3);
        let a = PodId(0);
        idx.record(a, &chain(5), 0.0);
        assert_eq!(idx.pod_blocks(a), 3);
        let mut out = Vec::new();
        idx.longest_prefixes(&chain(5), &[a].into_iter().collect(), &mut out);
        assert_eq!(out, vec![0], "the first blocks went first");
    }
}
