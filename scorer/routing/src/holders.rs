//! Which pods hold each block: the global side of both indexes.
//!
//! Pods are grouped in shards of 64; each shard is one map `SequenceHash → u64` whose bits
//! are the shard's pods holding that block. Eight bytes of value per block keep a 64-pod
//! fleet's index compact, and matching a prompt walks its blocks once per shard: one hash
//! lookup and a few bit operations per block, whatever the number of pods in the shard.

use crate::hash::SequenceHash;
use crate::pod_set::{PodId, PodSet};
use ahash::AHashMap;

#[derive(Default)]
pub struct BlockHolders {
    shards: Vec<AHashMap<SequenceHash, u64>>,
}

fn split(pod: PodId) -> (usize, u64) {
    (pod.index() / 64, 1u64 << (pod.index() % 64))
}

impl BlockHolders {
    /// Marks `pod` as holding `block`; true if it did not before.
    pub fn insert(&mut self, block: SequenceHash, pod: PodId) -> bool {
        let (shard, bit) = split(pod);
        if self.shards.len() <= shard {
            self.shards.resize_with(shard + 1, AHashMap::new);
        }
        let mask = self.shards[shard].entry(block).or_insert(0);
        let new = *mask & bit == 0;
        *mask |= bit;
        new
    }

    /// Marks `pod` as no longer holding `block`.
    pub fn remove(&mut self, block: SequenceHash, pod: PodId) {
        let (shard, bit) = split(pod);
        let Some(map) = self.shards.get_mut(shard) else { return };
        if let Some(mask) = map.get_mut(&block) {
            *mask &= !bit;
            if *mask == 0 {
                map.remove(&block);
            }
        }
    }

    pub fn holds(&self, block: SequenceHash, pod: PodId) -> bool {
        let (shard, bit) = split(pod);
        self.shards.get(shard).and_then(|m| m.get(&block)).is_some_and(|mask| mask & bit != 0)
    }

    /// (block, shard) keys: distinct blocks for fleets of up to 64 pods.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|m| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the maps' slots (key, value, control byte), from their capacities.
    pub fn memory_bytes(&self) -> usize {
        self.shards.iter().map(|m| m.capacity() * (size_of::<SequenceHash>() + size_of::<u64>() + 1)).sum()
    }

    /// For each pod of `eligible`, the number of leading blocks of `chain` it holds, written to
    /// `out[pod]` (`out` resized to cover every eligible pod's id, others 0).
    pub fn longest_prefixes(&self, chain: &[SequenceHash], eligible: &PodSet, out: &mut Vec<u32>) {
        out.clear();
        out.resize(eligible.id_bound(), 0);
        for (shard, map) in self.shards.iter().enumerate() {
            let mut active = eligible.word(shard);
            let mut matched = 0u32;
            for block in chain {
                if active == 0 {
                    break;
                }
                let holders = map.get(block).copied().unwrap_or(0) & active;
                let mut dropped = active & !holders;
                while dropped != 0 {
                    out[shard * 64 + dropped.trailing_zeros() as usize] = matched;
                    dropped &= dropped - 1;
                }
                active = holders;
                matched += 1;
            }
            while active != 0 {
                out[shard * 64 + active.trailing_zeros() as usize] = matched;
                active &= active - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_across_shards() {
        let mut h = BlockHolders::default();
        let chain: Vec<SequenceHash> = (1..=4).map(SequenceHash).collect();
        for (pod, blocks) in [(0u32, 4usize), (3, 2), (64, 3), (130, 4)] {
            for b in &chain[..blocks] {
                assert!(h.insert(*b, PodId(pod)));
            }
        }
        assert!(!h.insert(chain[0], PodId(0)), "already held");
        let all: PodSet = (0..140).map(PodId).collect();
        let mut out = Vec::new();
        h.longest_prefixes(&chain, &all, &mut out);
        assert_eq!((out[0], out[3], out[64], out[130], out[1]), (4, 2, 3, 4, 0));
        let some: PodSet = [PodId(3), PodId(64)].into_iter().collect();
        h.longest_prefixes(&chain, &some, &mut out);
        assert_eq!((out[0], out[3], out[64], out.get(130).copied().unwrap_or(0)), (0, 2, 3, 0));
        h.remove(chain[1], PodId(0));
        assert!(!h.holds(chain[1], PodId(0)) && h.holds(chain[2], PodId(0)));
        h.longest_prefixes(&chain, &all, &mut out);
        assert_eq!(out[0], 1);
        assert_eq!(h.len(), 4 + 3 + 4, "per shard: 4 blocks, 3, 4");
    }
}
