//! The precise KV index: which pod holds which block, learned from the pods' own KV events.
//!
//! Two structures:
//! - [`BlockHolders`]: `SequenceHash → pods` (a 64-bit mask per shard of 64 pods), so matching
//!   a request costs one lookup per block of its prompt whatever the number of pods;
//! - per pod, a map `EngineHash → SequenceHash`, so a `BlockRemoved`, which names only the
//!   engine's hash, can be resolved; a side map counts the rare duplicate stores of one hash;
//!   insertion order is kept for the per-pod cap.
//!
//! A `BlockStored` whose parent the pod's map does not know cannot be chained and is counted
//! as an orphan (it happens after lost events); blocks of another tier (CPU offload, other
//! KV-cache groups), of a different block size, or with extra keys kvgate cannot reproduce
//! are counted and not indexed. Removing a pod's last engine entry for a sequence hash clears
//! that pod's bit; should two different engine hashes of one pod map to the same sequence
//! hash (an engine hashing inputs kvgate ignores), the first removal clears it early — an
//! under-estimate, which can only cost affinity, never misroute to a pod lacking the block.

use crate::events::{BlockStored, EventBatch, KvEvent, Tier};
use crate::hash::{EngineHash, SequenceHash, chain, root_hash};
use crate::holders::BlockHolders;
use crate::pod_set::{PodId, PodSet};
use ahash::AHashMap;
use std::collections::VecDeque;

/// Limits of the index.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Tokens per block; must equal the engines' block size.
    pub block_size: usize,
    /// Most blocks indexed per pod; the oldest stored are forgotten first beyond it.
    pub max_blocks_per_pod: usize,
}

/// What happened to one pod's events, for metrics and `/v1/pods`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PodIndexStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    /// Stored blocks whose parent was unknown (after lost events): not indexed.
    pub orphan_blocks: u64,
    /// Blocks of another tier or KV-cache group, or with opaque extra keys: not indexed.
    pub ignored_blocks: u64,
    /// Blocks whose event announced a block size other than the configured one.
    pub block_size_mismatches: u64,
    /// Removals of blocks the index did not hold (after gaps, clears or cap evictions).
    pub unknown_removals: u64,
    /// Blocks forgotten to respect `max_blocks_per_pod`.
    pub cap_evictions: u64,
    /// Events of kinds this version does not know.
    pub unknown_events: u64,
}

#[derive(Default)]
struct PodBlocks {
    by_engine: AHashMap<EngineHash, SequenceHash>,
    /// Stores beyond the first of the same engine hash (an engine may hold duplicates).
    extra_refs: AHashMap<EngineHash, u32>,
    /// Engine hashes in the order they were first stored, for the cap. Slots of blocks
    /// removed meanwhile are skipped when popped (and compacted now and then).
    order: VecDeque<EngineHash>,
    stats: PodIndexStats,
}

/// The index over all pods.
pub struct KvIndex {
    config: IndexConfig,
    holders: BlockHolders,
    pods: Vec<PodBlocks>,
}

impl KvIndex {
    pub fn new(config: IndexConfig) -> Self {
        assert!(config.block_size > 0, "block_size must be positive");
        Self { config, holders: BlockHolders::default(), pods: Vec::new() }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Registers a pod; ids are dense, in registration order.
    pub fn add_pod(&mut self) -> PodId {
        self.pods.push(PodBlocks::default());
        PodId(self.pods.len() as u32 - 1)
    }

    pub fn num_pods(&self) -> usize {
        self.pods.len()
    }

    /// Blocks indexed for `pod`.
    pub fn pod_blocks(&self, pod: PodId) -> usize {
        self.pods[pod.index()].by_engine.len()
    }

    /// Distinct sequence hashes held by any pod (per shard of 64 pods).
    pub fn distinct_blocks(&self) -> usize {
        self.holders.len()
    }

    /// (block, pod) pairs indexed.
    pub fn entries(&self) -> usize {
        self.pods.iter().map(|p| p.by_engine.len()).sum()
    }

    /// Bytes the index holds in its tables, from their capacities: hash-map slots (key,
    /// value and a control byte each) and order queues.
    pub fn memory_bytes(&self) -> usize {
        let slot = size_of::<EngineHash>() + size_of::<SequenceHash>() + 1;
        let per_pod: usize = self
            .pods
            .iter()
            .map(|p| {
                p.by_engine.capacity() * slot
                    + p.extra_refs.capacity() * (size_of::<EngineHash>() + size_of::<u32>() + 1)
                    + p.order.capacity() * size_of::<EngineHash>()
            })
            .sum();
        self.holders.memory_bytes() + per_pod
    }

    pub fn stats(&self, pod: PodId) -> PodIndexStats {
        self.pods[pod.index()].stats
    }

    /// Applies one decoded batch of `pod`'s events.
    pub fn apply(&mut self, pod: PodId, batch: &EventBatch<'_>) {
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => self.store(pod, stored),
                KvEvent::BlockRemoved { block_hashes, tier } => {
                    if *tier == Tier::Gpu {
                        for &h in block_hashes {
                            self.remove(pod, h);
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.clear_pod(pod);
                    self.pods[pod.index()].stats.clears += 1;
                }
                KvEvent::Unknown(_) => self.pods[pod.index()].stats.unknown_events += 1,
            }
        }
    }

    fn store(&mut self, pod: PodId, stored: &BlockStored<'_>) {
        let n = stored.block_hashes.len() as u64;
        let stats = &mut self.pods[pod.index()].stats;
        if stored.block_size != self.config.block_size {
            stats.block_size_mismatches += n;
            return;
        }
        if stored.tier != Tier::Gpu || stored.opaque_extra_keys {
            stats.ignored_blocks += n;
            return;
        }
        let mut parent = match stored.parent_block_hash {
            None => {
                // vLLM's first-block extra keys: the LoRA name (if any), then the cache salt.
                let skip = usize::from(stored.lora_name.is_some());
                root_hash(stored.lora_name, stored.first_block_extra.get(skip).copied())
            }
            Some(engine_parent) => match self.pods[pod.index()].by_engine.get(&engine_parent) {
                Some(seq) => *seq,
                None => {
                    self.pods[pod.index()].stats.orphan_blocks += n;
                    return;
                }
            },
        };
        let bs = self.config.block_size;
        for (i, &engine) in stored.block_hashes.iter().enumerate() {
            parent = chain(parent, &stored.token_ids[i * bs..(i + 1) * bs]);
            self.insert(pod, engine, parent);
        }
        self.pods[pod.index()].stats.stored_blocks += n;
        self.enforce_cap(pod);
    }

    fn insert(&mut self, pod: PodId, engine: EngineHash, seq: SequenceHash) {
        let p = &mut self.pods[pod.index()];
        match p.by_engine.insert(engine, seq) {
            None => p.order.push_back(engine),
            Some(old) if old == seq => *p.extra_refs.entry(engine).or_insert(0) += 1,
            Some(old) => {
                // The engine reused a hash for other content (it cannot, but a restarted
                // engine with our stale state could): trust the newest announcement.
                p.extra_refs.remove(&engine);
                self.holders.remove(old, pod);
            }
        }
        self.holders.insert(seq, pod);
    }

    fn remove(&mut self, pod: PodId, engine: EngineHash) {
        let p = &mut self.pods[pod.index()];
        if let Some(extra) = p.extra_refs.get_mut(&engine) {
            p.stats.removed_blocks += 1;
            *extra -= 1;
            if *extra == 0 {
                p.extra_refs.remove(&engine);
            }
            return;
        }
        match p.by_engine.remove(&engine) {
            Some(seq) => {
                p.stats.removed_blocks += 1;
                self.holders.remove(seq, pod);
            }
            None => p.stats.unknown_removals += 1,
        }
    }

    fn enforce_cap(&mut self, pod: PodId) {
        let cap = self.config.max_blocks_per_pod;
        let p = &mut self.pods[pod.index()];
        while p.by_engine.len() > cap {
            let Some(engine) = p.order.pop_front() else { break };
            if let Some(seq) = p.by_engine.remove(&engine) {
                p.extra_refs.remove(&engine);
                p.stats.cap_evictions += 1;
                self.holders.remove(seq, pod);
            }
        }
        // Slots of removed blocks linger in `order`; drop them before they outnumber the
        // live ones, so the queue stays bounded too.
        if p.order.len() > 2 * p.by_engine.len().max(1024) {
            let live = &p.by_engine;
            let mut seen = ahash::AHashSet::with_capacity(live.len());
            p.order.retain(|h| live.contains_key(h) && seen.insert(*h));
        }
    }

    /// Forgets everything `pod` holds (`AllBlocksCleared`, a restarted engine, a sequence gap
    /// that could not be replayed, a pod that left).
    pub fn clear_pod(&mut self, pod: PodId) {
        let p = &mut self.pods[pod.index()];
        let entries = std::mem::take(&mut p.by_engine);
        p.extra_refs.clear();
        p.order.clear();
        for seq in entries.into_values() {
            self.holders.remove(seq, pod);
        }
    }

    /// For each pod in `eligible`, the number of leading blocks of `chain` it holds, written
    /// to `out[pod]` (`out` is resized to the number of pods; other pods get 0). Costs one
    /// map lookup per matched block plus a few bit operations, independent of pod count.
    pub fn longest_prefixes(&self, chain: &[SequenceHash], eligible: &PodSet, out: &mut Vec<u32>) {
        self.holders.longest_prefixes(chain, eligible, self.pods.len(), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::sequence_hashes;

    const BS: usize = 4;

    fn index(pods: usize, cap: usize) -> (KvIndex, Vec<PodId>) {
        let mut idx = KvIndex::new(IndexConfig { block_size: BS, max_blocks_per_pod: cap });
        let ids = (0..pods).map(|_| idx.add_pod()).collect();
        (idx, ids)
    }

    fn stored<'a>(engine: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent<'a> {
        KvEvent::BlockStored(BlockStored {
            block_hashes: engine.iter().map(|&h| EngineHash(h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: BS,
            lora_name: None,
            first_block_extra: vec![],
            opaque_extra_keys: false,
            tier: Tier::Gpu,
        })
    }

    fn batch(events: Vec<KvEvent<'_>>) -> EventBatch<'_> {
        EventBatch { ts: 0.0, events, data_parallel_rank: None }
    }

    fn removed<'a>(engine: &[u64]) -> KvEvent<'a> {
        KvEvent::BlockRemoved { block_hashes: engine.iter().map(|&h| EngineHash(h)).collect(), tier: Tier::Gpu }
    }

    fn chain_of(tokens: &[u32]) -> Vec<SequenceHash> {
        let mut out = Vec::new();
        sequence_hashes(root_hash(None, None), tokens, BS, &mut out);
        out
    }

    fn all(idx: &KvIndex) -> PodSet {
        (0..idx.num_pods() as u32).map(PodId).collect()
    }

    fn overlaps(idx: &KvIndex, tokens: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        idx.longest_prefixes(&chain_of(tokens), &all(idx), &mut out);
        out
    }

    const T: [u32; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

    #[test]
    fn matches_leading_blocks_per_pod_whatever_the_engine_hashes() {
        let (mut idx, pods) = index(3, 100);
        // Pod 0 stores 3 blocks in one event; pod 1 stores 2 in two chained events with
        // entirely different engine hashes (other seed, other algorithm).
        idx.apply(pods[0], &batch(vec![stored(&[10, 11, 12], None, &T)]));
        idx.apply(pods[1], &batch(vec![stored(&[900], None, &T[..4])]));
        idx.apply(pods[1], &batch(vec![stored(&[901], Some(900), &T[4..8])]));
        assert_eq!(overlaps(&idx, &T), vec![3, 2, 0]);
        assert_eq!(overlaps(&idx, &[1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12]), vec![1, 1, 0]);
        assert_eq!(overlaps(&idx, &[0, 2, 3, 4]), vec![0, 0, 0]);
        // Ineligible pods are not reported.
        let mut out = Vec::new();
        idx.longest_prefixes(&chain_of(&T), &[pods[1]].into_iter().collect(), &mut out);
        assert_eq!(out, vec![0, 2, 0]);
        assert_eq!((idx.entries(), idx.distinct_blocks()), (5, 3));
    }

    #[test]
    fn removals_resolve_through_engine_hashes() {
        let (mut idx, pods) = index(2, 100);
        idx.apply(pods[0], &batch(vec![stored(&[10, 11, 12], None, &T)]));
        idx.apply(pods[1], &batch(vec![stored(&[20, 21, 22], None, &T)]));
        idx.apply(pods[0], &batch(vec![removed(&[11])]));
        assert_eq!(overlaps(&idx, &T), vec![1, 3]);
        idx.apply(pods[1], &batch(vec![removed(&[99])]));
        assert_eq!(idx.stats(pods[1]).unknown_removals, 1);
        assert_eq!(idx.stats(pods[0]).removed_blocks, 1);
    }

    #[test]
    fn duplicate_stores_need_as_many_removals() {
        let (mut idx, pods) = index(1, 100);
        idx.apply(pods[0], &batch(vec![stored(&[10], None, &T[..4]), stored(&[10], None, &T[..4])]));
        idx.apply(pods[0], &batch(vec![removed(&[10])]));
        assert_eq!(overlaps(&idx, &T), vec![1], "one copy left");
        idx.apply(pods[0], &batch(vec![removed(&[10])]));
        assert_eq!(overlaps(&idx, &T), vec![0]);
        assert_eq!(idx.distinct_blocks(), 0);
    }

    #[test]
    fn clears_orphans_and_foreign_tiers() {
        let (mut idx, pods) = index(2, 100);
        idx.apply(pods[0], &batch(vec![stored(&[10, 11], None, &T[..8])]));
        idx.apply(pods[1], &batch(vec![stored(&[20, 21], None, &T[..8])]));
        idx.apply(pods[0], &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(overlaps(&idx, &T), vec![0, 2]);
        assert_eq!(idx.stats(pods[0]).clears, 1);
        // A child of a block the index never saw cannot be chained.
        idx.apply(pods[0], &batch(vec![stored(&[12], Some(11), &T[8..12])]));
        assert_eq!(idx.stats(pods[0]).orphan_blocks, 1);
        assert_eq!(idx.pod_blocks(pods[0]), 0);
        let KvEvent::BlockStored(mut cpu) = stored(&[30], None, &T[..4]) else { unreachable!() };
        cpu.tier = Tier::Other;
        let KvEvent::BlockStored(mut odd) = stored(&[31, 32], None, &T[..8]) else { unreachable!() };
        odd.block_size = 8;
        odd.token_ids = T[..8].repeat(2);
        idx.apply(pods[0], &batch(vec![KvEvent::BlockStored(cpu), KvEvent::BlockStored(odd), KvEvent::Unknown("X")]));
        let s = idx.stats(pods[0]);
        assert_eq!((s.ignored_blocks, s.block_size_mismatches, s.unknown_events), (1, 2, 1));
        assert_eq!(idx.pod_blocks(pods[0]), 0);
    }

    #[test]
    fn the_per_pod_cap_forgets_the_oldest_blocks() {
        let (mut idx, pods) = index(1, 2);
        idx.apply(pods[0], &batch(vec![stored(&[10, 11, 12], None, &T)]));
        assert_eq!(idx.pod_blocks(pods[0]), 2);
        assert_eq!(idx.stats(pods[0]).cap_evictions, 1);
        // The first block went: the chain no longer matches from the start.
        assert_eq!(overlaps(&idx, &T), vec![0]);
        // Order slots of removed entries do not grow without bound.
        for i in 0..10_000u64 {
            idx.apply(pods[0], &batch(vec![stored(&[100 + i], None, &[i as u32, 0, 0, 0])]));
            idx.apply(pods[0], &batch(vec![removed(&[100 + i])]));
        }
        assert!(idx.pods[0].order.len() <= 2 * 1024 + 1);
        assert!(idx.memory_bytes() < 200_000);
    }

    #[test]
    fn lora_and_salt_separate_prefixes() {
        let (mut idx, pods) = index(1, 100);
        let KvEvent::BlockStored(mut salted) = stored(&[10], None, &T[..4]) else { unreachable!() };
        salted.lora_name = Some("sql");
        salted.first_block_extra = vec!["sql", "tenant-1"];
        idx.apply(pods[0], &batch(vec![KvEvent::BlockStored(salted)]));
        assert_eq!(overlaps(&idx, &T), vec![0], "plain requests do not match");
        let mut chain = Vec::new();
        sequence_hashes(root_hash(Some("sql"), Some("tenant-1")), &T, BS, &mut chain);
        let mut out = Vec::new();
        idx.longest_prefixes(&chain, &all(&idx), &mut out);
        assert_eq!(out, vec![1]);
    }
}
