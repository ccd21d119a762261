//! The engine's prefix cache, modelled on vLLM V1's block pool.
//!
//! A fixed pool of `num_blocks` KV blocks of `block_size` tokens. A block becomes *cached*
//! when it is full: it gets a chained hash (its parent's hash, its tokens, and the LoRA name
//! and cache salt) and can then be shared by later requests with the same prefix. Blocks
//! held by running requests are never evicted; free blocks sit in an LRU queue and a cached
//! free block loses its cache entry (→ `BlockRemoved`) only when the pool reuses it.
//! As in vLLM, two requests computing the same prefix at once produce two physical blocks
//! with the same hash: both are announced (`BlockStored`) and both are removed in time.
//! A hybrid model's KV-cache groups share the pool: a block is cached under its hash and its
//! group ([`KvGroup`]).

use ahash::AHashMap;
use sha2::{Digest, Sha256};

/// Index of a physical block in the pool.
pub type BlockId = u32;

/// The engine's hash of a cached block: a SHA-256 digest chained over the prefix, like
/// vLLM's default `sha256` prefix-caching hash. Published as its low 8 bytes, big-endian
/// (vLLM's default integer form, often above `i64::MAX`), or as the 32 raw bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct EngineBlockHash(pub [u8; 32]);

impl EngineBlockHash {
    /// The integer vLLM publishes by default.
    pub fn as_u64(&self) -> u64 {
        u64::from_be_bytes(self.0[24..32].try_into().expect("8 bytes"))
    }
}

/// The hash chain's starting point, vLLM's `NONE_HASH`: derived from a seed (like
/// `PYTHONHASHSEED`) or random per process, so different engines disagree on hashes unless
/// they share a seed — a router must never depend on reproducing them.
pub fn root_hash(seed: Option<&str>) -> EngineBlockHash {
    match seed {
        Some(seed) => EngineBlockHash(Sha256::digest(seed.as_bytes()).into()),
        None => EngineBlockHash(rand::random()),
    }
}

/// Hash of one full block: parent digest, token ids, then the extra keys (LoRA name on every
/// block, cache salt on the first block only, as vLLM does).
pub fn block_hash(parent: &EngineBlockHash, tokens: &[u32], extra: &[&str]) -> EngineBlockHash {
    let mut h = Sha256::new();
    h.update(parent.0);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    for key in extra {
        h.update((key.len() as u32).to_le_bytes());
        h.update(key.as_bytes());
    }
    EngineBlockHash(h.finalize().into())
}

/// Extra hash keys of a request: the LoRA adapter name and the cache salt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HashKeys {
    pub lora_name: Option<String>,
    /// vLLM's id of that adapter (1, 2, … in the order the server loaded them): events carry
    /// it, block hashes do not.
    pub lora_id: Option<u32>,
    pub cache_salt: Option<String>,
}

impl HashKeys {
    /// The extra keys of block `index` of a sequence, and vLLM's untagged `extra_keys`
    /// entry for the event (`None` when the block has none).
    pub fn for_block(&self, index: usize) -> Vec<&str> {
        let mut keys = Vec::new();
        if let Some(lora) = &self.lora_name {
            keys.push(lora.as_str());
        }
        if index == 0
            && let Some(salt) = &self.cache_salt
        {
            keys.push(salt.as_str());
        }
        keys
    }
}

/// Chained hashes of the full blocks of `tokens`.
pub fn hash_blocks(root: &EngineBlockHash, tokens: &[u32], block_size: usize, keys: &HashKeys) -> Vec<EngineBlockHash> {
    let mut parent = *root;
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, chunk)| {
            parent = block_hash(&parent, chunk, &keys.for_block(i));
            parent
        })
        .collect()
}

/// A KV-cache group of a hybrid model's engine (vLLM keeps one per kind of layer): its
/// index, and its sliding window in tokens (`None`: full attention). An engine of one kind
/// of layer announces its blocks without a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvGroup {
    pub index: u32,
    pub sliding_window: Option<u32>,
}

/// What the cache did, in the order it happened; the engine turns these into KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheChange {
    /// Full blocks became cached: consecutive blocks of one request's sequence, the first
    /// being block number `first_index` of that sequence (it decides the extra keys), in
    /// `group` (a hybrid model's).
    Stored {
        hashes: Vec<EngineBlockHash>,
        parent: Option<EngineBlockHash>,
        token_ids: Vec<u32>,
        keys: HashKeys,
        first_index: usize,
        group: Option<KvGroup>,
    },
    /// A cached block was evicted (reused for other data).
    Removed { hash: EngineBlockHash, group: Option<KvGroup> },
    /// The KV connector copied a block to host memory (vLLM's `OffloadingConnector`
    /// announces it by hash only: a placeholder `BlockStored` with medium CPU).
    Offloaded { hash: EngineBlockHash },
    /// Host memory evicted an offloaded block (`BlockRemoved`, medium CPU).
    OffloadRemoved { hash: EngineBlockHash },
    /// The whole cache was dropped (`reset_prefix_cache`).
    Cleared,
}

const NIL: u32 = u32::MAX;
/// vLLM's null block: the pool's first, never free.
const NULL_BLOCK: BlockId = 0;

/// The host-memory tier of a KV connector that offloads every computed block (vLLM's
/// `OffloadingConnector` with a CPU backend): least recently used blocks are evicted first;
/// a request whose prefix continues here past its GPU hit loads those blocks instead of
/// computing them.
#[derive(Clone)]
pub struct OffloadTier {
    capacity: usize,
    /// hash → last use; use → hash (the oldest first).
    used: AHashMap<EngineBlockHash, u64>,
    by_use: std::collections::BTreeMap<u64, EngineBlockHash>,
    clock: u64,
}

impl OffloadTier {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, used: AHashMap::new(), by_use: Default::default(), clock: 0 }
    }

    fn touch(&mut self, hash: EngineBlockHash) -> bool {
        self.clock += 1;
        match self.used.insert(hash, self.clock) {
            Some(old) => {
                self.by_use.remove(&old);
                self.by_use.insert(self.clock, hash);
                true
            }
            None => {
                self.by_use.insert(self.clock, hash);
                false
            }
        }
    }

    /// Copies `hashes` here (already held ones are only marked used), evicting the least
    /// recently used beyond capacity; records what changed.
    pub fn store(&mut self, hashes: &[EngineBlockHash], changes: &mut Vec<CacheChange>) {
        for &hash in hashes {
            if self.touch(hash) {
                continue;
            }
            changes.push(CacheChange::Offloaded { hash });
            while self.used.len() > self.capacity {
                let (_, oldest) = self.by_use.pop_first().expect("a full tier has entries");
                self.used.remove(&oldest);
                changes.push(CacheChange::OffloadRemoved { hash: oldest });
            }
        }
    }

    /// Number of leading `hashes` held here.
    pub fn run_of(&self, hashes: &[EngineBlockHash]) -> usize {
        hashes.iter().take_while(|h| self.used.contains_key(h)).count()
    }

    /// Number of leading `hashes` held here; they are marked used (they are about to load).
    pub fn take_run(&mut self, hashes: &[EngineBlockHash]) -> usize {
        let run = self.run_of(hashes);
        for &hash in &hashes[..run] {
            self.touch(hash);
        }
        run
    }

    /// Drops everything (`reset_prefix_cache` resets the connector's tier too).
    pub fn clear(&mut self) {
        self.used.clear();
        self.by_use.clear();
    }
}

/// The block pool: reference counts, the hash → blocks map and the LRU free queue.
pub struct BlockPool {
    block_size: usize,
    ref_count: Vec<u32>,
    hash_of: Vec<Option<(EngineBlockHash, Option<KvGroup>)>>,
    /// The first block cached under each hash; later blocks with the same hash (two
    /// requests computed it at once) follow it in `same_hash`. Plain integers, so a clone
    /// (a what-if) copies the map without allocating per entry.
    cached: AHashMap<(EngineBlockHash, Option<KvGroup>), BlockId>,
    /// The next block cached under the same hash as this one (`NIL`: none).
    same_hash: Vec<u32>,
    // Free queue as an intrusive doubly linked list: head is evicted first.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
    changes: Vec<CacheChange>,
}

/// By hand, for `clone_from`: a what-if copies a pool into the allocations of the last.
impl Clone for BlockPool {
    fn clone(&self) -> Self {
        Self {
            block_size: self.block_size,
            ref_count: self.ref_count.clone(),
            hash_of: self.hash_of.clone(),
            cached: self.cached.clone(),
            same_hash: self.same_hash.clone(),
            prev: self.prev.clone(),
            next: self.next.clone(),
            head: self.head,
            tail: self.tail,
            num_free: self.num_free,
            changes: self.changes.clone(),
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.block_size = source.block_size;
        self.ref_count.clone_from(&source.ref_count);
        self.hash_of.clone_from(&source.hash_of);
        self.cached.clone_from(&source.cached);
        self.same_hash.clone_from(&source.same_hash);
        self.prev.clone_from(&source.prev);
        self.next.clone_from(&source.next);
        self.head = source.head;
        self.tail = source.tail;
        self.num_free = source.num_free;
        self.changes.clone_from(&source.changes);
    }
}

impl BlockPool {
    /// A pool of `num_blocks` uncached blocks, as vLLM's `num_gpu_blocks` counts them: the
    /// first is its null block (a placeholder no request computes into), the others free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(num_blocks > 1 && num_blocks < NIL as usize, "num_blocks out of range");
        assert!(block_size > 0, "block_size must be positive");
        let n = num_blocks as u32;
        let mut pool = Self {
            block_size,
            ref_count: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            cached: AHashMap::new(),
            same_hash: vec![NIL; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
            changes: Vec::new(),
        };
        pool.ref_count[NULL_BLOCK as usize] = 1; // held for good
        for b in 1..n {
            pool.push_free(b);
        }
        pool
    }

    /// The blocks requests can use (all but the null block).
    pub fn num_blocks(&self) -> usize {
        self.ref_count.len() - 1
    }

    /// Blocks not held by any request (cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Distinct cached hashes.
    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of blocks held by requests: vLLM's `kv_cache_usage_perc`.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_blocks() as f64
    }

    /// Number of leading `hashes` that are cached in `group`.
    pub fn longest_cached_prefix(&self, hashes: &[EngineBlockHash], group: Option<KvGroup>) -> usize {
        hashes.iter().take_while(|h| self.holds(h, group)).count()
    }

    /// Whether block `hash` is cached in `group`.
    pub fn holds(&self, hash: &EngineBlockHash, group: Option<KvGroup>) -> bool {
        self.cached.contains_key(&(*hash, group))
    }

    /// Takes a reference on the cached blocks of `hashes` in `group` (all must be cached).
    pub fn touch(&mut self, hashes: &[EngineBlockHash], group: Option<KvGroup>) -> Vec<BlockId> {
        hashes
            .iter()
            .map(|h| {
                let block = self.cached[&(*h, group)];
                if self.ref_count[block as usize] == 0 {
                    self.unlink(block);
                }
                self.ref_count[block as usize] += 1;
                block
            })
            .collect()
    }

    /// Takes `n` blocks from the head of the free queue, evicting their cache entries.
    /// Returns `None` (and takes nothing) if fewer than `n` blocks are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let block = self.head;
            self.unlink(block);
            self.evict(block);
            self.ref_count[block as usize] = 1;
            blocks.push(block);
        }
        Some(blocks)
    }

    /// Drops one reference on each block, as vLLM 0.32+'s `free_blocks` (given a request's
    /// blocks tail first, so that the end of a sequence is evicted before its more shareable
    /// beginning): the blocks freed with a hash join the queue's tail in that order (LRU), the
    /// ones without (a partial last block: no prefix can ever match it) its head, to be
    /// reused first.
    pub fn free(&mut self, blocks: &[BlockId]) {
        let mut uncached = Vec::new();
        for &block in blocks.iter().rev() {
            let rc = &mut self.ref_count[block as usize];
            debug_assert!(*rc > 0, "double free of block {block}");
            *rc -= 1;
            if *rc == 0 {
                if self.hash_of[block as usize].is_some() {
                    self.push_free(block);
                } else {
                    uncached.push(block);
                }
            }
        }
        // vLLM prepends them in order: the first freed ends up first.
        for &block in uncached.iter().rev() {
            self.push_front(block);
        }
    }

    /// Marks full blocks as cached, as `stored` (a [`CacheChange::Stored`]) announces them:
    /// `blocks[i]` holds the data hashed as its `hashes[i]`, in its group.
    pub fn cache_blocks(&mut self, blocks: &[BlockId], stored: CacheChange) {
        let CacheChange::Stored { hashes, token_ids, group, .. } = &stored else {
            unreachable!("only stores cache blocks")
        };
        debug_assert_eq!(blocks.len(), hashes.len());
        debug_assert_eq!(token_ids.len(), hashes.len() * self.block_size);
        if blocks.is_empty() {
            return;
        }
        for (&block, &hash) in blocks.iter().zip(hashes) {
            debug_assert!(self.hash_of[block as usize].is_none());
            self.hash_of[block as usize] = Some((hash, *group));
            match self.cached.get(&(hash, *group)) {
                None => {
                    self.cached.insert((hash, *group), block);
                }
                Some(&first) => {
                    let mut last = first;
                    while self.same_hash[last as usize] != NIL {
                        last = self.same_hash[last as usize];
                    }
                    self.same_hash[last as usize] = block;
                }
            }
        }
        self.changes.push(stored);
    }

    /// Drops every cache entry, as `reset_prefix_cache` does. Refused (returns the number
    /// of blocks still held) while any request holds blocks, like vLLM.
    pub fn reset(&mut self) -> Result<(), usize> {
        let held = self.num_blocks() - self.num_free;
        if held > 0 {
            return Err(held);
        }
        self.cached.clear();
        self.hash_of.iter_mut().for_each(|h| *h = None);
        self.same_hash.iter_mut().for_each(|b| *b = NIL);
        self.changes.push(CacheChange::Cleared);
        Ok(())
    }

    /// The changes not yet taken, for the offload tier to record its own after the pool's.
    pub fn changes_mut(&mut self) -> &mut Vec<CacheChange> {
        &mut self.changes
    }

    /// Cache changes since the last call.
    pub fn take_changes(&mut self) -> Vec<CacheChange> {
        std::mem::take(&mut self.changes)
    }

    fn evict(&mut self, block: BlockId) {
        let Some((hash, group)) = self.hash_of[block as usize].take() else { return };
        let next = std::mem::replace(&mut self.same_hash[block as usize], NIL);
        let first = self.cached.get_mut(&(hash, group)).expect("a block with a hash is cached under it");
        if *first == block {
            match next {
                NIL => {
                    self.cached.remove(&(hash, group));
                }
                next => *first = next,
            }
        } else {
            let mut before = *first;
            while self.same_hash[before as usize] != block {
                before = self.same_hash[before as usize];
            }
            self.same_hash[before as usize] = next;
        }
        self.changes.push(CacheChange::Removed { hash, group });
    }

    fn push_free(&mut self, block: BlockId) {
        self.prev[block as usize] = self.tail;
        self.next[block as usize] = NIL;
        if self.tail == NIL {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.num_free += 1;
    }

    fn push_front(&mut self, block: BlockId) {
        self.next[block as usize] = self.head;
        self.prev[block as usize] = NIL;
        if self.head == NIL {
            self.tail = block;
        } else {
            self.prev[self.head as usize] = block;
        }
        self.head = block;
        self.num_free += 1;
    }

    fn unlink(&mut self, block: BlockId) {
        let (p, n) = (self.prev[block as usize], self.next[block as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[block as usize] = NIL;
        self.next[block as usize] = NIL;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32]) -> Vec<EngineBlockHash> {
        hash_blocks(&root_hash(Some("0")), tokens, 4, &HashKeys::default())
    }

    fn cache_sequence(pool: &mut BlockPool, tokens: &[u32]) -> Vec<BlockId> {
        let hs = hashes(tokens);
        let blocks = pool.allocate(hs.len()).unwrap();
        let stored = CacheChange::Stored {
            hashes: hs.clone(),
            parent: None,
            token_ids: tokens[..hs.len() * 4].to_vec(),
            keys: HashKeys::default(),
            first_index: 0,
            group: None,
        };
        pool.cache_blocks(&blocks, stored);
        blocks
    }

    #[test]
    fn hashes_chain_over_the_prefix_and_keys() {
        let a = hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        let b = hashes(&[1, 2, 3, 4, 5, 6, 7, 0]);
        assert_eq!(a.len(), 2, "only full blocks are hashed");
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        let salted = hash_blocks(
            &root_hash(Some("0")),
            &[1, 2, 3, 4],
            4,
            &HashKeys { cache_salt: Some("s".into()), ..Default::default() },
        );
        assert_ne!(salted[0], a[0]);
        assert_ne!(root_hash(None), root_hash(None), "unseeded roots are random per engine");
        assert_eq!(root_hash(Some("x")), root_hash(Some("x")));
    }

    #[test]
    fn u64_form_is_low_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&[0xf0, 0xe0, 0xd0, 0xc0, 0xb0, 0xa0, 0x90, 0x80]);
        assert_eq!(EngineBlockHash(d).as_u64(), 0xf0e0d0c0b0a09080);
        assert!(EngineBlockHash(d).as_u64() > i64::MAX as u64);
    }

    #[test]
    fn cached_blocks_are_found_and_shared() {
        let mut pool = BlockPool::new(9, 4); // 8 and the null block
        let tokens: Vec<u32> = (0..12).collect();
        let blocks = cache_sequence(&mut pool, &tokens);
        assert_eq!(pool.longest_cached_prefix(&hashes(&tokens), None), 3);
        let mut other: Vec<u32> = (0..8).collect();
        other.extend([99, 98, 97, 96]);
        assert_eq!(pool.longest_cached_prefix(&hashes(&other), None), 2);
        let shared = pool.touch(&hashes(&other)[..2], None);
        assert_eq!(shared, blocks[..2]);
        assert_eq!(pool.num_free(), 5);
        pool.free(&blocks);
        pool.free(&shared);
        assert_eq!(pool.num_free(), 8);
        assert_eq!(pool.longest_cached_prefix(&hashes(&tokens), None), 3, "freed blocks stay cached");
    }

    #[test]
    fn freed_blocks_without_a_hash_are_reused_first_as_vllm_does() {
        // 5 blocks and the null block. A request held 2 cached blocks and a partial one; an
        // older request's cached block was freed before.
        let mut pool = BlockPool::new(6, 4);
        let older = cache_sequence(&mut pool, &(100..104).collect::<Vec<_>>());
        pool.free(&older);
        let mut held = cache_sequence(&mut pool, &(0..8).collect::<Vec<_>>());
        let partial = pool.allocate(1).unwrap();
        held.extend(&partial);
        pool.free(&held);
        assert_eq!(pool.num_free(), 5);
        // The partial block comes first (no prefix can match it), then the one never used,
        // then the cached blocks, oldest first: nothing is evicted for two blocks.
        let two = pool.allocate(2).unwrap();
        assert!(two.contains(&partial[0]) && !two.contains(&older[0]), "{two:?}");
        assert!(pool.take_changes().iter().all(|c| !matches!(c, CacheChange::Removed { .. })));
        // The next one evicts the oldest cached block.
        assert_eq!(pool.allocate(1).unwrap(), older);
        assert_eq!(pool.longest_cached_prefix(&hashes(&(0..8).collect::<Vec<_>>()), None), 2);
        assert_eq!(pool.usage(), 0.6, "3 of the 5 usable blocks held");
    }

    #[test]
    fn eviction_is_lru_and_never_touches_held_blocks() {
        let mut pool = BlockPool::new(5, 4);
        let a = cache_sequence(&mut pool, &(0..8).collect::<Vec<_>>());
        let b = cache_sequence(&mut pool, &(100..108).collect::<Vec<_>>());
        pool.take_changes();
        pool.free(&a); // a's blocks become evictable first
        assert!(pool.allocate(3).is_none(), "b's blocks are held");
        let c = pool.allocate(1).unwrap();
        // vLLM frees tail first: a's second block is evicted before its first.
        assert_eq!(c, vec![a[1]]);
        assert_eq!(
            pool.take_changes(),
            vec![CacheChange::Removed { hash: hashes(&(0..8).collect::<Vec<_>>())[1], group: None }]
        );
        assert_eq!(pool.longest_cached_prefix(&hashes(&(0..8).collect::<Vec<_>>()), None), 1);
        assert_eq!(pool.longest_cached_prefix(&hashes(&(100..108).collect::<Vec<_>>()), None), 2);
        pool.free(&b);
        pool.free(&c);
    }

    #[test]
    fn duplicate_hashes_are_stored_and_removed_separately() {
        let mut pool = BlockPool::new(3, 4);
        let x = cache_sequence(&mut pool, &[1, 2, 3, 4]);
        let y = cache_sequence(&mut pool, &[1, 2, 3, 4]);
        assert_eq!(pool.num_cached_hashes(), 1);
        pool.free(&x);
        pool.free(&y);
        pool.take_changes();
        pool.allocate(2).unwrap();
        let removed = pool.take_changes();
        assert_eq!(removed.len(), 2);
        assert_eq!(pool.num_cached_hashes(), 0);
    }

    #[test]
    fn a_duplicate_evicted_before_the_others_leaves_them_cached() {
        let mut pool = BlockPool::new(4, 4);
        let [x, y, z] = [0; 3].map(|_| cache_sequence(&mut pool, &[1, 2, 3, 4]));
        pool.free(&y);
        pool.take_changes();
        pool.allocate(1).unwrap();
        assert_eq!(pool.take_changes().len(), 1, "the middle duplicate is removed");
        assert_eq!(pool.num_cached_hashes(), 1);
        assert_eq!(pool.touch(&hashes(&[1, 2, 3, 4]), None), x, "the first stored still serves hits");
        pool.free(&x);
        pool.free(&x);
        pool.free(&z);
        pool.take_changes();
        pool.allocate(2).unwrap();
        assert_eq!(pool.take_changes().len(), 2);
        assert_eq!(pool.num_cached_hashes(), 0);
    }

    #[test]
    fn reset_is_refused_while_blocks_are_held() {
        let mut pool = BlockPool::new(5, 4);
        let a = cache_sequence(&mut pool, &[1, 2, 3, 4]);
        assert_eq!(pool.reset(), Err(1));
        pool.free(&a);
        pool.take_changes();
        assert_eq!(pool.reset(), Ok(()));
        assert_eq!(pool.take_changes(), vec![CacheChange::Cleared]);
        assert_eq!(pool.longest_cached_prefix(&hashes(&[1, 2, 3, 4]), None), 0);
    }
}
