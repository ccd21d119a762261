//! What each pod's recent traffic needs cached: the KV blocks of the prompts routed there
//! lately. A pod whose recent prompts need more blocks than its KV cache holds cannot keep
//! them: its engine evicts the least recently used, so the conversations that come back find
//! their history gone and compute it again — before any eviction event shows it, and while
//! the index still credits what the pod is about to evict.
//!
//! Counted over the last half window to the whole window: two generations of block sets,
//! each half a window long, the older dropped when a new one begins, so that nothing is kept
//! per routing. A block's
//! hash names its whole prefix, so each set holds whole prefixes of the chains routed: the
//! blocks of a chain already counted are a prefix of it, found by bisection, and routing a
//! prompt costs set insertions for its blocks new to this half window only.

use crate::hash::SequenceHash;
use crate::pod_set::{PodId, PodMap};
use ahash::AHashSet;

/// Most blocks one pod's generation holds (past it, the count stays there): 2M tokens at 16
/// a block, more than one engine's KV cache holds, so a pod at the limit counts as
/// over-committed anyway, and its memory stays bounded (≈ 4 MiB) under any traffic.
const MAX_BLOCKS: usize = 1 << 17;

/// Blocks routed to one pod: this half window's, and the one before's.
#[derive(Default)]
struct PodRecent {
    current: AHashSet<SequenceHash>,
    previous: AHashSet<SequenceHash>,
    /// Blocks in either set.
    distinct: usize,
}

/// Blocks recently routed to each pod.
pub struct RecentBlocks {
    half_window: f64,
    /// When the current generation began.
    began: f64,
    pods: PodMap<PodRecent>,
}

impl RecentBlocks {
    pub fn new(window_seconds: f64) -> Self {
        Self { half_window: window_seconds / 2.0, began: 0.0, pods: PodMap::default() }
    }

    /// Records that `chain` was routed to `pod` at `now`.
    pub fn record(&mut self, pod: PodId, chain: &[SequenceHash], now: f64) {
        self.advance(now);
        let recent = self.pods.get_mut(pod);
        let counted = chain.partition_point(|b| recent.current.contains(b));
        let in_previous = chain.partition_point(|b| recent.previous.contains(b));
        let room = MAX_BLOCKS.saturating_sub(recent.current.len());
        let new = &chain[counted..chain.len().min(counted + room)];
        recent.current.extend(new.iter().copied());
        recent.distinct += new.len().saturating_sub(in_previous.saturating_sub(counted));
    }

    /// Drops the generation older than the window once the current one is half a window old.
    pub fn advance(&mut self, now: f64) {
        if now < self.began + self.half_window {
            return;
        }
        let idle = now >= self.began + 2.0 * self.half_window;
        for recent in self.pods.values_mut() {
            recent.previous = std::mem::take(&mut recent.current);
            if idle {
                recent.previous.clear();
            }
            recent.distinct = recent.previous.len();
        }
        self.began = now;
    }

    /// Blocks routed to `pod` within the window.
    pub fn blocks(&self, pod: PodId) -> u64 {
        self.pods.get(pod).map_or(0, |r| r.distinct as u64)
    }

    /// Forgets what was routed to `pod`.
    pub fn clear_pod(&mut self, pod: PodId) {
        *self.pods.get_mut(pod) = PodRecent::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt's chain: blocks `1..=n` of prefix `prefix` (a block's hash names its prefix).
    fn chain(prefix: u64, n: u64) -> Vec<SequenceHash> {
        (1..=n).map(|i| SequenceHash(prefix << 32 | i)).collect()
    }

    #[test]
    fn blocks_count_once_within_the_window_and_not_after_it() {
        let mut recent = RecentBlocks::new(10.0);
        let (a, b) = (PodId(0), PodId(1));
        recent.record(a, &chain(1, 4), 0.0);
        let mut longer = chain(1, 4);
        longer.extend((5..=6).map(|i| SequenceHash(1 << 32 | i)));
        recent.record(a, &longer, 1.0); // the first four again, two more
        assert_eq!(recent.blocks(a), 6);
        assert_eq!(recent.blocks(b), 0);
        // Half a window on, they are the older generation: still counted, and routed again
        // they count once.
        recent.record(a, &chain(1, 2), 6.0);
        recent.record(a, &chain(2, 3), 6.0);
        assert_eq!(recent.blocks(a), 9);
        // Another half window: only what was routed since 6 s.
        recent.advance(12.0);
        assert_eq!(recent.blocks(a), 5);
        // A window without traffic: nothing.
        recent.advance(40.0);
        assert_eq!(recent.blocks(a), 0);
        recent.record(a, &chain(3, 2), 41.0);
        recent.clear_pod(a);
        assert_eq!(recent.blocks(a), 0);
    }

    #[test]
    fn a_pod_counts_at_most_max_blocks_a_generation() {
        let mut recent = RecentBlocks::new(10.0);
        let pod = PodId(0);
        recent.record(pod, &chain(1, MAX_BLOCKS as u64 + 10), 0.0);
        recent.record(pod, &chain(2, 10), 0.0);
        assert_eq!(recent.blocks(pod), MAX_BLOCKS as u64);
    }
}
