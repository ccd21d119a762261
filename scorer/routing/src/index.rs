//! The precise KV index: which pod holds which block, and in which tier, learned from the
//! pods' own KV events.
//!
//! Per tier (the GPU cache, and the host-memory and storage tiers a KV connector offloads
//! to), and per further KV-cache group of a hybrid model's GPU cache, two structures:
//! - [`BlockHolders`]: `SequenceHash → pods` (a 64-bit mask per shard of 64 pods), so matching
//!   a request costs one lookup per block of its prompt whatever the number of pods;
//! - per pod, a map `EngineHash → SequenceHash`, so a `BlockRemoved`, which names only the
//!   engine's hash, can be resolved; a side map counts repeated stores of one hash (an
//!   engine may hold duplicates; vLLM's offloading connector re-announces shared blocks);
//!   insertion order is kept for the per-pod cap.
//!
//! A GPU `BlockStored` whose parent the pod's maps do not know cannot be chained and is
//! counted as an orphan (it happens after lost events). An offload tier's store is chained
//! the same way when it carries its tokens (vLLM's `self_describing_kv_events`); by default
//! it names only engine hashes, which are resolved through what the pod's tiers already hold
//! (the block was announced on the GPU when it was computed) and counted as unresolved
//! otherwise. A hybrid model's engine keeps a KV-cache group per kind of layer (full
//! attention, sliding window, mamba) and announces each group's blocks apart: a prefix is
//! cached on such a pod only as far as vLLM's hybrid coordinator would serve it from every
//! group ([`KvIndex::hybrid_prefix`]). Offloaded blocks of other groups, blocks of a remote
//! tier, of a different block size, or with extra keys kvgate cannot reproduce are counted
//! and not indexed. Removing a pod's
//! last engine entry for a sequence hash clears that pod's bit; should two different engine
//! hashes of one pod map to the same sequence hash (an engine hashing inputs kvgate
//! ignores), the first removal clears it early — an under-estimate, which can only cost
//! affinity, never misroute to a pod lacking the block.

use crate::events::{BlockStored, EventBatch, GroupKind, KvEvent, Tier};
use crate::hash::{EngineHash, SequenceHash, chain, root_hash};
use crate::holders::BlockHolders;
use crate::pod_set::{PodId, PodMap, PodSet};
use crate::validate::{Invalid, check, positive};
use ahash::AHashMap;
use serde::Deserialize;
use smart_default::SmartDefault;
use std::collections::VecDeque;

/// The KV indexes (`index`).
#[derive(Clone, Debug, Deserialize, PartialEq, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Most blocks indexed per pod (precise and approximate index each); the oldest stored
    /// are forgotten first beyond it.
    #[default(1 << 20)]
    pub max_blocks_per_pod: usize,
    /// How long blocks routed to a pod without events count as cached there.
    #[default(120.0)]
    pub approximate_ttl_seconds: f64,
    /// Blocks the pods' KV connectors offload to host memory or storage (events with
    /// `medium` CPU or STORAGE).
    pub offload: OffloadConfig,
}

impl IndexConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        check(self.max_blocks_per_pod > 0, "max_blocks_per_pod", "must be positive")?;
        check(positive(self.approximate_ttl_seconds), "approximate_ttl_seconds", "must be positive")?;
        for (field, cost) in
            [("cpu_load_cost", self.offload.cpu_load_cost), ("storage_load_cost", self.offload.storage_load_cost)]
        {
            if !(0.0..=1.0).contains(&cost) {
                let why = format!("{cost} is not between 0 and 1 (a fraction of computing the block)");
                return Err(Invalid::new(field, why).under("offload"));
            }
        }
        Ok(())
    }
}

/// The tiers a pod's KV connector offloads blocks to (vLLM's `OffloadingConnector`, LMCache):
/// a block there is loaded back instead of recomputed (`index.offload`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Most blocks indexed per pod in each offload tier; 0: offloaded blocks are not indexed
    /// (counted as ignored).
    #[default(1 << 22)]
    pub max_blocks_per_pod: usize,
    /// Loading a block from host memory, as a fraction of computing it (0–1).
    #[default(0.1)]
    pub cpu_load_cost: f64,
    /// Loading a block from storage, as a fraction of computing it (0–1).
    #[default(0.4)]
    pub storage_load_cost: f64,
}

/// What happened to one pod's events, for metrics and `/v1/pods`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PodIndexStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    /// Stored blocks whose parent was unknown (after lost events): not indexed.
    pub orphan_blocks: u64,
    /// Blocks of another KV-cache group or a remote tier, offloaded blocks when offload tiers
    /// are not indexed, or blocks with opaque extra keys: not indexed.
    pub ignored_blocks: u64,
    /// Blocks whose event announced a block size other than the configured one.
    pub block_size_mismatches: u64,
    /// Removals of blocks the index did not hold (after gaps, clears or cap evictions).
    pub unknown_removals: u64,
    /// Blocks forgotten to respect the per-pod caps.
    pub cap_evictions: u64,
    /// Events of kinds this version does not know.
    pub unknown_events: u64,
    /// Blocks announced in an offload tier (host memory, storage), and removed from one.
    pub offloaded_blocks: u64,
    pub offload_removed_blocks: u64,
    /// Offloaded blocks named only by an engine hash no tier of the pod knows: not indexed.
    pub unresolved_offloads: u64,
    /// GPU stores of blocks the pod had evicted lately (not loaded back from an offload
    /// tier): computed again. Growing fast, the pod's cache cannot hold what is sent to it.
    pub recomputed_blocks: u64,
}

/// Tiers of a pod's cache, in the order a request's prefix is matched.
const TIERS: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

/// A pod's blocks in one tier.
#[derive(Default)]
struct PodBlocks {
    by_engine: AHashMap<EngineHash, SequenceHash>,
    /// Stores beyond the first of the same engine hash.
    extra_refs: AHashMap<EngineHash, u32>,
    /// Engine hashes in the order they were first stored, for the cap. Slots of blocks
    /// removed meanwhile are skipped when popped (and compacted now and then).
    order: VecDeque<EngineHash>,
}

impl PodBlocks {
    fn insert(&mut self, holders: &mut BlockHolders, pod: PodId, engine: EngineHash, seq: SequenceHash) {
        match self.by_engine.insert(engine, seq) {
            None => self.order.push_back(engine),
            Some(old) if old == seq => *self.extra_refs.entry(engine).or_insert(0) += 1,
            Some(old) => {
                // The engine reused a hash for other content (it cannot, but a restarted
                // engine with our stale state could): trust the newest announcement.
                self.extra_refs.remove(&engine);
                holders.remove(old, pod);
            }
        }
        holders.insert(seq, pod);
    }

    /// Drops one announcement of `engine`: `None` if the tier did not hold it, else whether
    /// the block is gone (`Some(Some(seq))`) or still announced again (`Some(None)`).
    fn remove(&mut self, holders: &mut BlockHolders, pod: PodId, engine: EngineHash) -> Option<Option<SequenceHash>> {
        if let Some(extra) = self.extra_refs.get_mut(&engine) {
            *extra -= 1;
            if *extra == 0 {
                self.extra_refs.remove(&engine);
            }
            return Some(None);
        }
        let seq = self.by_engine.remove(&engine)?;
        holders.remove(seq, pod);
        Some(Some(seq))
    }

    /// Forgets the oldest blocks beyond `cap`; returns how many.
    fn enforce_cap(&mut self, holders: &mut BlockHolders, pod: PodId, cap: usize) -> u64 {
        let mut evicted = 0;
        while self.by_engine.len() > cap {
            let Some(engine) = self.order.pop_front() else { break };
            if let Some(seq) = self.by_engine.remove(&engine) {
                self.extra_refs.remove(&engine);
                evicted += 1;
                holders.remove(seq, pod);
            }
        }
        // Slots of removed blocks linger in `order`; drop them before they outnumber the
        // live ones, so the queue stays bounded too.
        if self.order.len() > 2 * self.by_engine.len().max(1024) {
            let live = &self.by_engine;
            let mut seen = ahash::AHashSet::with_capacity(live.len());
            self.order.retain(|h| live.contains_key(h) && seen.insert(*h));
        }
        evicted
    }

    fn clear(&mut self, holders: &mut BlockHolders, pod: PodId) {
        for seq in std::mem::take(&mut self.by_engine).into_values() {
            holders.remove(seq, pod);
        }
        self.extra_refs.clear();
        self.order.clear();
    }

    fn memory_bytes(&self) -> usize {
        self.by_engine.capacity() * (size_of::<EngineHash>() + size_of::<SequenceHash>() + 1)
            + self.extra_refs.capacity() * (size_of::<EngineHash>() + size_of::<u32>() + 1)
            + self.order.capacity() * size_of::<EngineHash>()
    }
}

/// What the index holds of one pod: its blocks per tier, and what its events did.
#[derive(Default)]
struct PodCache {
    tiers: [PodBlocks; 3],
    /// GPU blocks of its KV-cache groups after the first (a hybrid model's), by group − 1.
    groups: Vec<PodBlocks>,
    /// The kind of each of its KV-cache groups, by group (as its events announced them).
    kinds: Vec<GroupKind>,
    stats: PodIndexStats,
    evictions: Evictions,
}

/// The blocks a pod's GPU cache evicted lately, to see it compute them again: a pod whose
/// stores are largely recomputations thrashes — its cache cannot hold the traffic sent to
/// it ([`KvIndex::recompute_share`]).
#[derive(Default)]
struct Evictions {
    /// Evicted blocks' sequence hashes, each in the slot its hash picks (a later eviction
    /// landing there takes the slot): allocated at the pod's first eviction.
    slots: Box<[u64]>,
    /// GPU stores in the current window, and those of them recomputing a remembered block
    /// (both halved when the window fills: a decaying average).
    stored: f64,
    recomputed: f64,
}

impl Evictions {
    const SLOTS: usize = 4096;
    const WINDOW: f64 = 1024.0;
    /// Fewer stores than this say nothing yet.
    const MIN_STORES: f64 = 64.0;

    fn slot(block: SequenceHash) -> usize {
        (block.0 % Self::SLOTS as u64) as usize
    }

    fn evicted(&mut self, block: SequenceHash) {
        if self.slots.is_empty() {
            self.slots = vec![0; Self::SLOTS].into_boxed_slice();
        }
        self.slots[Self::slot(block)] = block.0;
    }

    /// A GPU store of `block`; `loaded` says whether it came back from an offload tier (a
    /// load, not a computation). Whether it computed again a block evicted lately.
    fn stored(&mut self, block: SequenceHash, loaded: impl FnOnce() -> bool) -> bool {
        let slot = self.slots.get_mut(Self::slot(block)).filter(|held| **held == block.0 && block.0 != 0);
        let recomputed = match slot {
            Some(held) => {
                *held = 0;
                !loaded()
            }
            None => false,
        };
        self.stored += 1.0;
        self.recomputed += f64::from(u8::from(recomputed));
        if self.stored >= Self::WINDOW {
            self.stored /= 2.0;
            self.recomputed /= 2.0;
        }
        recomputed
    }

    fn recompute_share(&self) -> f64 {
        if self.stored < Self::MIN_STORES { 0.0 } else { self.recomputed / self.stored }
    }

    fn memory_bytes(&self) -> usize {
        self.slots.len() * size_of::<u64>()
    }
}

impl PodCache {
    /// The blocks of `target`.
    fn blocks(&mut self, target: Target) -> &mut PodBlocks {
        match target {
            Target::Tier(slot) => &mut self.tiers[slot],
            Target::Group(group) => grown(&mut self.groups, group as usize - 1),
        }
    }
}

/// Item `at` of `items`, grown with defaults to hold it.
fn grown<T: Default>(items: &mut Vec<T>, at: usize) -> &mut T {
    if items.len() <= at {
        items.resize_with(at + 1, T::default);
    }
    &mut items[at]
}

/// A sliding window's (or mamba's) hit within the first `max` blocks: scanning from the
/// right, where the first run of `needed` consecutive blocks the group holds ends; failing
/// that, the run it holds from the first block (vLLM's `SlidingWindowManager` and
/// `MambaManager`).
fn rightmost_run(max: usize, needed: usize, held: impl Fn(usize) -> bool) -> usize {
    let mut run = 0;
    for i in (0..max).rev() {
        if held(i) {
            run += 1;
            if run >= needed {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

/// The pods holding blocks of `target`: `tiers` by tier, `groups` by KV-cache group − 1.
fn holders_of<'a>(
    tiers: &'a mut [BlockHolders; 3],
    groups: &'a mut Vec<BlockHolders>,
    target: Target,
) -> &'a mut BlockHolders {
    match target {
        Target::Tier(slot) => &mut tiers[slot],
        Target::Group(group) => grown(groups, group as usize - 1),
    }
}

/// Where a store or a removal goes: a tier of the first KV-cache group, or the GPU blocks
/// of another group.
#[derive(Clone, Copy, PartialEq)]
enum Target {
    Tier(usize),
    Group(u32),
}

/// A pod's match of a request: leading blocks in its GPU cache, then the blocks right after
/// them that it holds offloaded (it loads those instead of computing them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TieredMatch {
    pub cpu_blocks: u32,
    pub storage_blocks: u32,
}

/// The index over all pods.
pub struct KvIndex {
    /// Tokens per block; must equal the engines' block size.
    block_size: usize,
    config: IndexConfig,
    /// Per tier (the order of [`TIERS`]), the pods holding each block.
    holders: [BlockHolders; 3],
    /// Per KV-cache group after the first (by group − 1), the pods holding each GPU block.
    group_holders: Vec<BlockHolders>,
    pods: PodMap<PodCache>,
    /// What the last batch applied evicted (see [`KvIndex::evicted`]).
    evicted: Vec<SequenceHash>,
}

impl KvIndex {
    pub fn new(block_size: usize, config: IndexConfig) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            config,
            holders: Default::default(),
            group_holders: Vec::new(),
            pods: PodMap::default(),
            evicted: Vec::new(),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// GPU blocks indexed for `pod`.
    pub fn pod_blocks(&self, pod: PodId) -> usize {
        self.pods.get(pod).map_or(0, |p| p.tiers[0].by_engine.len())
    }

    /// Blocks indexed for `pod` in its offload tiers (host memory and storage).
    pub fn pod_offloaded_blocks(&self, pod: PodId) -> usize {
        self.pods.get(pod).map_or(0, |p| p.tiers[1..].iter().map(|t| t.by_engine.len()).sum())
    }

    /// Distinct sequence hashes held by any pod on the GPU (per shard of 64 pods).
    pub fn distinct_blocks(&self) -> usize {
        self.holders[0].len()
    }

    /// (block, pod) pairs indexed on the GPU.
    pub fn entries(&self) -> usize {
        self.pods.iter().map(|(_, p)| p.tiers[0].by_engine.len()).sum()
    }

    /// Bytes the index holds in its tables, from their capacities: hash-map slots (key,
    /// value and a control byte each) and order queues.
    pub fn memory_bytes(&self) -> usize {
        let pods: usize = self
            .pods
            .iter()
            .map(|(_, p)| {
                p.tiers.iter().chain(&p.groups).map(PodBlocks::memory_bytes).sum::<usize>() + p.evictions.memory_bytes()
            })
            .sum();
        pods + self.holders.iter().chain(&self.group_holders).map(BlockHolders::memory_bytes).sum::<usize>()
    }

    /// The share of `pod`'s recent GPU stores that computed again a block it had evicted
    /// lately (0–1; 0 until it has stored a few dozen blocks).
    pub fn recompute_share(&self, pod: PodId) -> f64 {
        self.pods.get(pod).map_or(0.0, |p| p.evictions.recompute_share())
    }

    pub fn stats(&self, pod: PodId) -> PodIndexStats {
        self.pods.get(pod).map(|p| p.stats).unwrap_or_default()
    }

    /// Where the index keeps blocks of `tier` in KV-cache `group`, if it keeps them.
    fn indexed(&self, tier: Tier, group: u32) -> Option<Target> {
        match (tier, group) {
            (Tier::Gpu, 1..) => Some(Target::Group(group)),
            _ => (TIERS.iter().position(|t| *t == tier))
                .filter(|&slot| slot == 0 || self.config.offload.max_blocks_per_pod > 0)
                .map(Target::Tier),
        }
    }

    /// Applies one decoded batch of `pod`'s events; [`KvIndex::evicted`] then lists the GPU
    /// blocks it took from the pod.
    pub fn apply(&mut self, pod: PodId, batch: &EventBatch<'_>) {
        self.evicted.clear();
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => self.store(pod, stored),
                KvEvent::BlockRemoved { block_hashes, tier, group } => {
                    let Some(target) = self.indexed(*tier, *group) else { continue };
                    let holders = holders_of(&mut self.holders, &mut self.group_holders, target);
                    let cache = self.pods.get_mut(pod);
                    for &h in block_hashes {
                        let removed = cache.blocks(target).remove(holders, pod, h);
                        match (removed, target) {
                            (None, _) => cache.stats.unknown_removals += 1,
                            (Some(_), Target::Tier(1..)) => cache.stats.offload_removed_blocks += 1,
                            (Some(gone), _) => {
                                cache.stats.removed_blocks += 1;
                                if let (Some(seq), Target::Tier(0)) = (gone, target) {
                                    self.evicted.push(seq);
                                    cache.evictions.evicted(seq);
                                }
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    // vLLM resets the connector's tiers with the prefix cache; forgetting a
                    // tier that survived only costs affinity.
                    self.clear_pod(pod);
                    self.pods.get_mut(pod).stats.clears += 1;
                }
                KvEvent::Unknown(_) => self.pods.get_mut(pod).stats.unknown_events += 1,
            }
        }
    }

    fn store(&mut self, pod: PodId, stored: &BlockStored<'_>) {
        let n = stored.block_hashes.len() as u64;
        let target = self.indexed(stored.tier, stored.group).filter(|_| !stored.opaque_extra_keys);
        let (block_size, cap) = (self.block_size, self.config.max_blocks_per_pod);
        let offload_cap = self.config.offload.max_blocks_per_pod;
        let cache = self.pods.get_mut(pod);
        let Some(target) = target else {
            cache.stats.ignored_blocks += n;
            return;
        };
        if stored.tier == Tier::Gpu {
            *grown(&mut cache.kinds, stored.group as usize) = stored.group_kind;
        }
        // The sequence hash an engine hash stands for on this pod, from any tier or group (a
        // hybrid model's groups hash the same blocks alike).
        let resolve = |cache: &PodCache, engine| {
            cache.tiers.iter().chain(&cache.groups).find_map(|t| t.by_engine.get(&engine).copied())
        };
        let holders = holders_of(&mut self.holders, &mut self.group_holders, target);
        if stored.is_placeholder() {
            for &engine in &stored.block_hashes {
                match resolve(cache, engine) {
                    Some(seq) => {
                        cache.blocks(target).insert(holders, pod, engine, seq);
                        cache.stats.offloaded_blocks += 1;
                    }
                    None => cache.stats.unresolved_offloads += 1,
                }
            }
        } else if stored.block_size != block_size {
            cache.stats.block_size_mismatches += n;
            return;
        } else {
            let mut parent = match stored.parent_block_hash {
                None => {
                    // vLLM's first-block extra keys: the LoRA name (if any), then the cache salt.
                    let skip = usize::from(stored.lora_name.is_some());
                    root_hash(stored.lora_name, stored.first_block_extra.get(skip).copied())
                }
                Some(engine_parent) => match resolve(cache, engine_parent) {
                    Some(seq) => seq,
                    None => {
                        cache.stats.orphan_blocks += n;
                        return;
                    }
                },
            };
            for (i, &engine) in stored.block_hashes.iter().enumerate() {
                parent = chain(parent, &stored.token_ids[i * block_size..(i + 1) * block_size]);
                cache.blocks(target).insert(holders, pod, engine, parent);
                if target == Target::Tier(0) {
                    let tiers = &cache.tiers;
                    let loaded = || tiers[1..].iter().any(|tier| tier.by_engine.contains_key(&engine));
                    cache.stats.recomputed_blocks += u64::from(cache.evictions.stored(parent, loaded));
                }
            }
            match target {
                Target::Tier(1..) => cache.stats.offloaded_blocks += n,
                _ => cache.stats.stored_blocks += n,
            }
        }
        let cap = if matches!(target, Target::Tier(1..)) { offload_cap } else { cap };
        cache.stats.cap_evictions += cache.blocks(target).enforce_cap(holders, pod, cap);
    }

    /// The blocks (of the first KV-cache group) the last batch applied took from its pod's
    /// GPU cache.
    pub fn evicted(&self) -> &[SequenceHash] {
        &self.evicted
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The engines' blocks hold `block_size` tokens (learned from them): what was indexed at
    /// another size is forgotten.
    pub fn set_block_size(&mut self, block_size: usize) {
        assert!(block_size > 0, "block_size must be positive");
        if block_size != self.block_size {
            for pod in 0..self.pods.len() {
                self.clear_pod(PodId(pod as u32));
            }
            self.block_size = block_size;
        }
    }

    /// Forgets everything `pod` holds, in every tier and group (`AllBlocksCleared`, a
    /// restarted engine, a sequence gap that could not be replayed, a pod that left).
    pub fn clear_pod(&mut self, pod: PodId) {
        let cache = self.pods.get_mut(pod);
        for (tier, holders) in cache.tiers.iter_mut().zip(&mut self.holders) {
            tier.clear(holders, pod);
        }
        for (group, holders) in cache.groups.iter_mut().zip(&mut self.group_holders) {
            group.clear(holders, pod);
        }
        cache.kinds.clear();
        cache.evictions = Evictions::default();
    }

    /// Whether `pod` announced blocks of more than one KV-cache group, or of layers other
    /// than full attention (a hybrid or sliding-window model): its cached prefix is then
    /// [`KvIndex::hybrid_prefix`], not its first group's leading blocks.
    pub fn is_hybrid(&self, pod: PodId) -> bool {
        self.pods.get(pod).is_some_and(|p| !matches!(p.kinds.as_slice(), [] | [GroupKind::FullAttention]))
    }

    /// The leading blocks of `chain` that hybrid `pod` serves from every KV-cache group, as
    /// vLLM's hybrid coordinator finds them (`HybridKVCacheCoordinator.find_longest_cache_hit`
    /// in vLLM 0.33): from at most `max_blocks` (vLLM computes at least the prompt's last
    /// token), each group cuts the hit to where it holds what it needs there — full
    /// attention its prefix (the first group's is `full_blocks`), a sliding window the blocks
    /// of its last window before the hit (or a run from the first block), mamba the block at
    /// the hit — until no group cuts it further.
    pub fn hybrid_prefix(&self, chain: &[SequenceHash], pod: PodId, full_blocks: usize, max_blocks: usize) -> usize {
        let Some(cache) = self.pods.get(pod) else { return 0 };
        let mut hit = max_blocks.min(chain.len());
        if cache.kinds.is_empty() {
            return hit.min(full_blocks);
        }
        loop {
            let mut cut = hit;
            for (group, kind) in cache.kinds.iter().enumerate() {
                let holders = if group == 0 { Some(&self.holders[0]) } else { self.group_holders.get(group - 1) };
                let Some(holders) = holders else { return 0 };
                let held = |i: usize| holders.holds(chain[i], pod);
                cut = match *kind {
                    GroupKind::SlidingWindow(window) => {
                        let needed = (window as usize).saturating_sub(1).div_ceil(self.block_size).max(1);
                        rightmost_run(cut, needed, held)
                    }
                    GroupKind::Mamba => rightmost_run(cut, 1, held),
                    GroupKind::FullAttention | GroupKind::Other if group == 0 => cut.min(full_blocks),
                    GroupKind::FullAttention | GroupKind::Other => (0..cut).take_while(|&i| held(i)).count(),
                };
            }
            if cut == hit {
                return hit;
            }
            hit = cut;
        }
    }

    /// For each pod in `eligible`, the number of leading blocks of `chain` it holds on the
    /// GPU, written to `out[pod]` (`out` is resized to cover the eligible pods; other pods
    /// get 0). Costs one map lookup per matched block plus a few bit operations, independent
    /// of pod count.
    pub fn longest_prefixes(&self, chain: &[SequenceHash], eligible: &PodSet, out: &mut Vec<u32>) {
        self.holders[0].longest_prefixes(chain, eligible, out);
    }

    /// Whether any pod has offloaded blocks indexed (else [`KvIndex::offloaded_run`] is
    /// always empty).
    pub fn has_offloaded(&self) -> bool {
        self.holders[1..].iter().any(|h| !h.is_empty())
    }

    /// The blocks of `chain` that `pod` holds offloaded right after its first `from` blocks
    /// (its GPU prefix): host memory first, then storage, as a connector looks them up.
    pub fn offloaded_run(&self, chain: &[SequenceHash], pod: PodId, from: usize) -> TieredMatch {
        let mut run = TieredMatch::default();
        for &block in chain.iter().skip(from) {
            if self.holders[1].holds(block, pod) {
                run.cpu_blocks += 1;
            } else if self.holders[2].holds(block, pod) {
                run.storage_blocks += 1;
            } else {
                break;
            }
        }
        run
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::sequence_hashes;

    const BS: usize = 4;

    fn index(pods: usize, cap: usize) -> (KvIndex, Vec<PodId>) {
        let mut idx = KvIndex::new(BS, IndexConfig { max_blocks_per_pod: cap, ..IndexConfig::default() });
        let ids: Vec<PodId> = (0..pods as u32).map(PodId).collect();
        ids.iter().for_each(|&pod| idx.clear_pod(pod)); // known to the index, holding nothing
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
            group: 0,
            group_kind: GroupKind::FullAttention,
        })
    }

    fn batch(events: Vec<KvEvent<'_>>) -> EventBatch<'_> {
        EventBatch { ts: 0.0, events, data_parallel_rank: None }
    }

    fn removed<'a>(engine: &[u64]) -> KvEvent<'a> {
        KvEvent::BlockRemoved {
            block_hashes: engine.iter().map(|&h| EngineHash(h)).collect(),
            tier: Tier::Gpu,
            group: 0,
        }
    }

    fn chain_of(tokens: &[u32]) -> Vec<SequenceHash> {
        let mut out = Vec::new();
        sequence_hashes(root_hash(None, None), tokens, BS, &mut out);
        out
    }

    fn all(idx: &KvIndex) -> PodSet {
        (0..idx.pods.len() as u32).map(PodId).collect()
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
        // Ineligible pods are not reported (`out` covers the eligible pods' ids).
        let mut out = Vec::new();
        idx.longest_prefixes(&chain_of(&T), &[pods[1]].into_iter().collect(), &mut out);
        assert_eq!(out, vec![0, 2]);
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
    fn a_pod_computing_again_what_it_evicted_is_seen_thrashing_and_loads_do_not_count() {
        // One block, T[..4], stored and evicted over and over.
        let (mut idx, pods) = index(2, 100_000);
        let (gpu, cpu) = (pods[0], pods[1]);
        let round = |idx: &mut KvIndex, pod: PodId, offload: bool| {
            let mut events = vec![stored(&[10], None, &T[..4])];
            if offload {
                events.push(offloaded(&[10], Tier::Cpu));
            }
            events.push(removed(&[10]));
            idx.apply(pod, &batch(events));
        };
        // Fresh blocks every store: nothing computed twice.
        for n in 0..100 {
            idx.apply(gpu, &batch(vec![stored(&[1000 + n], None, &[n as u32 + 100, 0, 0, 0])]));
        }
        assert_eq!(idx.recompute_share(gpu), 0.0);
        // The same block stored, evicted, stored again: each store after the first recomputes.
        for _ in 0..100 {
            round(&mut idx, gpu, false);
        }
        assert_eq!(idx.stats(gpu).recomputed_blocks, 99);
        let share = idx.recompute_share(gpu);
        assert!((0.45..0.55).contains(&share), "99 of 200 stores: {share}");
        // Kept in host memory when evicted: stored back on the GPU is a load, not a recompute.
        for _ in 0..100 {
            round(&mut idx, cpu, true);
        }
        assert_eq!((idx.stats(cpu).recomputed_blocks, idx.recompute_share(cpu)), (0, 0.0));
        // A cleared cache starts over, its table of evictions freed (and counted till then).
        let held = idx.memory_bytes();
        idx.clear_pod(gpu);
        assert_eq!(idx.recompute_share(gpu), 0.0);
        assert!(held - idx.memory_bytes() >= Evictions::SLOTS * size_of::<u64>());
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
        cpu.tier = Tier::Other; // another KV-cache group
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
        assert!(idx.pods.get(pods[0]).unwrap().tiers[0].order.len() <= 2 * 1024 + 1);
        assert!(idx.memory_bytes() < 200_000);
    }

    /// The OffloadingConnector's default announcement: hashes only.
    fn offloaded<'a>(engine: &[u64], tier: Tier) -> KvEvent<'a> {
        KvEvent::BlockStored(BlockStored {
            block_hashes: engine.iter().map(|&h| EngineHash(h)).collect(),
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 0,
            lora_name: None,
            first_block_extra: vec![],
            opaque_extra_keys: false,
            tier,
            group: 0,
            group_kind: GroupKind::FullAttention,
        })
    }

    fn runs(idx: &KvIndex, tokens: &[u32]) -> Vec<(u32, TieredMatch)> {
        let chain = chain_of(tokens);
        overlaps(idx, tokens)
            .into_iter()
            .enumerate()
            .map(|(p, gpu)| (gpu, idx.offloaded_run(&chain, PodId(p as u32), gpu as usize)))
            .collect()
    }

    fn cpu(blocks: u32) -> TieredMatch {
        TieredMatch { cpu_blocks: blocks, storage_blocks: 0 }
    }

    #[test]
    fn offloaded_blocks_extend_the_gpu_prefix() {
        let (mut idx, pods) = index(2, 100);
        assert!(!idx.has_offloaded());
        // Pod 0 computes 3 blocks, its connector offloads them (placeholders resolve through
        // the GPU announcement), then the GPU evicts the last two.
        idx.apply(pods[0], &batch(vec![stored(&[10, 11, 12], None, &T), offloaded(&[10, 11, 12], Tier::Cpu)]));
        idx.apply(pods[0], &batch(vec![removed(&[12, 11])]));
        assert!(idx.has_offloaded());
        assert_eq!(runs(&idx, &T), vec![(1, cpu(2)), (0, cpu(0))]);
        assert_eq!((idx.pod_blocks(pods[0]), idx.pod_offloaded_blocks(pods[0])), (1, 3));
        // The GPU prefix comes first; the offloaded run stops at the first block in no tier.
        assert_eq!(runs(&idx, &[1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])[0], (1, cpu(1)));
        // Pod 1's storage tier, described in full (tokens, parent): chained like GPU blocks.
        let KvEvent::BlockStored(mut first) = stored(&[20, 21], None, &T[..8]) else { unreachable!() };
        first.tier = Tier::Storage;
        idx.apply(pods[1], &batch(vec![KvEvent::BlockStored(first)]));
        assert_eq!(runs(&idx, &T)[1], (0, TieredMatch { cpu_blocks: 0, storage_blocks: 2 }));
        let s = idx.stats(pods[0]);
        assert_eq!((s.stored_blocks, s.offloaded_blocks, s.removed_blocks), (3, 3, 2));
        assert_eq!(idx.stats(pods[1]).offloaded_blocks, 2);
        // An eviction from the CPU tier.
        idx.apply(
            pods[0],
            &batch(vec![KvEvent::BlockRemoved { block_hashes: vec![EngineHash(11)], tier: Tier::Cpu, group: 0 }]),
        );
        assert_eq!(runs(&idx, &T)[0], (1, cpu(0)));
        assert_eq!(idx.stats(pods[0]).offload_removed_blocks, 1);
        // Clearing the pod clears its tiers too.
        idx.apply(pods[0], &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(idx.pod_offloaded_blocks(pods[0]), 0);
    }

    #[test]
    fn offloads_resolve_through_any_tier_and_repeats_are_counted() {
        let (mut idx, pods) = index(1, 100);
        // A placeholder for a hash the pod never announced cannot be placed.
        idx.apply(pods[0], &batch(vec![offloaded(&[99], Tier::Cpu)]));
        assert_eq!((idx.stats(pods[0]).unresolved_offloads, idx.pod_offloaded_blocks(pods[0])), (1, 0));
        // Offloaded while on the GPU, evicted from the GPU, then promoted to storage: the
        // CPU tier still knows the hash.
        idx.apply(pods[0], &batch(vec![stored(&[10], None, &T[..4]), offloaded(&[10], Tier::Cpu)]));
        idx.apply(pods[0], &batch(vec![removed(&[10]), offloaded(&[10], Tier::Storage)]));
        assert_eq!(idx.pod_offloaded_blocks(pods[0]), 2);
        // A self-describing child chains from a parent only the offload tiers hold.
        let KvEvent::BlockStored(mut child) = stored(&[11], Some(10), &T[4..8]) else { unreachable!() };
        child.tier = Tier::Cpu;
        idx.apply(pods[0], &batch(vec![KvEvent::BlockStored(child.clone()), KvEvent::BlockStored(child)]));
        assert_eq!(runs(&idx, &T)[0], (0, cpu(2)));
        // Re-announced twice (vLLM's connector re-announces shared blocks): two removals.
        let cpu_removed = || KvEvent::BlockRemoved { block_hashes: vec![EngineHash(11)], tier: Tier::Cpu, group: 0 };
        idx.apply(pods[0], &batch(vec![cpu_removed()]));
        assert_eq!(runs(&idx, &T)[0], (0, cpu(2)));
        idx.apply(pods[0], &batch(vec![cpu_removed()]));
        assert_eq!(runs(&idx, &T)[0], (0, cpu(1)));
    }

    #[test]
    fn offload_tiers_can_be_left_out_and_are_capped() {
        let off = OffloadConfig { max_blocks_per_pod: 0, ..OffloadConfig::default() };
        let mut idx = KvIndex::new(BS, IndexConfig { max_blocks_per_pod: 100, offload: off, ..IndexConfig::default() });
        let pod = PodId(0);
        idx.apply(pod, &batch(vec![stored(&[10, 11], None, &T[..8]), offloaded(&[10, 11], Tier::Cpu)]));
        assert_eq!((idx.pod_offloaded_blocks(pod), idx.stats(pod).ignored_blocks), (0, 2));
        let two = OffloadConfig { max_blocks_per_pod: 2, ..OffloadConfig::default() };
        let mut idx = KvIndex::new(BS, IndexConfig { max_blocks_per_pod: 100, offload: two, ..IndexConfig::default() });
        let pod = PodId(0);
        idx.apply(pod, &batch(vec![stored(&[10, 11, 12], None, &T), offloaded(&[10, 11, 12], Tier::Cpu)]));
        assert_eq!((idx.pod_offloaded_blocks(pod), idx.stats(pod).cap_evictions), (2, 1));
        assert_eq!(idx.pod_blocks(pod), 3, "the GPU tier has its own cap");
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

    /// A store of `engine` blocks (tokens 1.. in order, from the first block) in `group`.
    fn stored_in<'a>(group: u32, kind: GroupKind, engine: &[u64], tokens: &[u32]) -> KvEvent<'a> {
        let KvEvent::BlockStored(s) = stored(engine, None, tokens) else { unreachable!() };
        KvEvent::BlockStored(BlockStored { group, group_kind: kind, ..s })
    }

    fn removed_in<'a>(group: u32, engine: &[u64]) -> KvEvent<'a> {
        KvEvent::BlockRemoved { block_hashes: engine.iter().map(|&h| EngineHash(h)).collect(), tier: Tier::Gpu, group }
    }

    #[test]
    fn a_hybrid_pod_serves_a_prefix_only_as_far_as_every_group_holds_what_it_needs() {
        let (mut idx, pods) = index(1, 100);
        let pod = pods[0];
        let tokens: Vec<u32> = (1..=24).collect();
        let c = chain_of(&tokens);
        let engine: Vec<u64> = (10..16).collect();
        // Six blocks in the full-attention group and in a sliding window of 9 tokens (the
        // last two blocks of 4 before a hit).
        let window = GroupKind::SlidingWindow(9);
        idx.apply(
            pod,
            &batch(vec![
                stored_in(0, GroupKind::FullAttention, &engine, &tokens),
                stored_in(1, window, &engine, &tokens),
            ]),
        );
        assert!(idx.is_hybrid(pod));
        let hit = |idx: &KvIndex, max| {
            let mut out = Vec::new();
            idx.longest_prefixes(&c, &all(idx), &mut out);
            idx.hybrid_prefix(&c, pod, out[0] as usize, max)
        };
        assert_eq!(hit(&idx, 6), 6);
        assert_eq!(hit(&idx, 5), 5, "at most what vLLM may serve (the last token is computed)");
        // The window group freed and evicted the blocks behind its window: still a hit.
        idx.apply(pod, &batch(vec![removed_in(1, &engine[..4])]));
        assert_eq!(hit(&idx, 6), 6);
        assert_eq!(idx.stats(pod).removed_blocks, 4);
        // Its last block gone too: no two consecutive blocks, no run from the first: nothing,
        // though the full-attention group holds all six.
        idx.apply(pod, &batch(vec![removed_in(1, &engine[5..])]));
        assert_eq!(hit(&idx, 6), 0);
        // Blocks 0–2 back in the window group: a hit ends after blocks 1–2.
        idx.apply(pod, &batch(vec![stored_in(1, window, &engine[..3], &tokens[..12])]));
        assert_eq!(hit(&idx, 6), 3);
        // A mamba group holding only block 1's state cuts it to 2, where the window's blocks
        // 0–1 serve it too (the groups agree after two rounds).
        idx.apply(pod, &batch(vec![stored_in(2, GroupKind::Mamba, &engine[..2], &tokens[..8])]));
        idx.apply(pod, &batch(vec![removed_in(2, &engine[..1])]));
        assert_eq!(hit(&idx, 6), 2);
        // The first group's blocks are not the other groups': removing its block 1 cuts the
        // prefix to block 0, where mamba holds no state: nothing.
        idx.apply(pod, &batch(vec![removed(&engine[1..2])]));
        assert_eq!(hit(&idx, 6), 0);
        // Cleared: nothing, and no longer known as hybrid until it says so again.
        idx.apply(pod, &batch(vec![KvEvent::AllBlocksCleared]));
        assert!(!idx.is_hybrid(pod));
        assert_eq!(hit(&idx, 6), 0);
    }

    #[test]
    fn the_rightmost_run_is_vllms_sliding_window_search() {
        let held = |set: &'static [usize]| move |i: usize| set.contains(&i);
        assert_eq!(rightmost_run(6, 2, held(&[0, 1, 2, 4, 5])), 6);
        assert_eq!(rightmost_run(6, 2, held(&[0, 1, 2, 4])), 3);
        assert_eq!(rightmost_run(6, 3, held(&[0, 1, 3, 4])), 2, "no run of 3: the run from the first block");
        assert_eq!(rightmost_run(6, 3, held(&[1, 3, 4])), 0);
        assert_eq!(rightmost_run(4, 1, held(&[1, 5])), 2, "mamba: the rightmost block within the hit");
    }
}
