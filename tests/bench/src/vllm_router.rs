//! vllm-router's `kv_aware` routing rule, re-implemented as a reference point for the
//! cluster simulator (vllm-project/router's `KvAwarePolicy` with its defaults: block size
//! 16, hash seed 0, speculative entries on, their TTL 2 s).
//!
//! The rule, per request:
//! 1. The prompt's block keys are the engine's own chained block hashes (vllm-router hashes
//!    as vLLM does, with the same seed), and its index maps each key to the workers that
//!    hold the block — from `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events, and
//!    from its own speculative entries.
//! 2. Each worker's score is the number of leading blocks it holds without a gap. The
//!    worker with the highest score wins (on a tie, the last in worker order, as Rust's
//!    `max_by_key` picks); if no worker holds even the first block (or the prompt is shorter
//!    than a block), the least-loaded worker wins (requests the router has in flight; on a
//!    tie the first).
//! 3. The blocks after the best score are inserted speculatively for the chosen worker,
//!    visible to later decisions for 2 s unless a real event for them arrives first.
//!
//! There is no load term beyond that fallback: a worker with the longest match takes every
//! request for its prefix however busy it is.
//!
//! This is the rule of the router's earlier source. The PyPI release the live benchmark runs
//! (0.1.17) decides by a cost that trades load against prefill for requests answered whole
//! (with six of them in flight on the pod caching a prompt, it computes the prompt afresh on
//! an idle pod), but not for streamed ones, which the live benchmark sends: twelve at once
//! all stay on the warm pod (`tests/tools/vllm_router_probe.py`). For those it credits only
//! what the pods' events announced — no speculative entries: a prompt sent again while its
//! first copy is still computing is computed afresh elsewhere — and rotates ties among the
//! pods holding the longest match: that is [`KvAwareConfig::streamed`]
//! (docs/benchmarks.md, "The real vllm-router balances load").

use ahash::AHashMap;
use kvgate_sim::cache::{CacheChange, EngineBlockHash, HashKeys, hash_blocks, root_hash};

/// Defaults of vllm-router's `KvAwareConfig`.
#[derive(Clone, Copy, Debug)]
pub struct KvAwareConfig {
    pub block_size: usize,
    pub speculative_ttl_secs: f64,
    /// 0.1.17's rule for streamed requests, probed: only blocks the pods' events announced
    /// count (no speculative entries), and the pods tied for the longest match (all of them
    /// when none holds the first block) take turns.
    pub streamed: bool,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self { block_size: 16, speculative_ttl_secs: 2.0, streamed: false }
    }
}

/// One worker holding a block: from its events (`expires: None`) or speculatively.
#[derive(Clone, Copy, Debug)]
struct Holder {
    worker: usize,
    expires: Option<f64>,
}

/// The `kv_aware` policy over `n` workers whose engines hash with `hash_seed`.
pub struct KvAware {
    config: KvAwareConfig,
    root: EngineBlockHash,
    index: AHashMap<u64, Vec<Holder>>,
    load: Vec<usize>,
    scores: Vec<usize>,
    /// Where the streamed rule's turn-taking among tied pods starts next.
    next_turn: usize,
}

impl KvAware {
    pub fn new(workers: usize, hash_seed: &str) -> Self {
        Self::with_config(KvAwareConfig::default(), workers, hash_seed)
    }

    pub fn with_config(config: KvAwareConfig, workers: usize, hash_seed: &str) -> Self {
        Self {
            config,
            root: root_hash(Some(hash_seed)),
            index: AHashMap::new(),
            load: vec![0; workers],
            scores: vec![0; workers],
            next_turn: 0,
        }
    }

    /// Of the workers with the highest score, the first at or after the turn's start.
    fn next_of_best(&mut self) -> usize {
        let n = self.scores.len();
        let best = self.scores.iter().copied().max().unwrap_or(0);
        let chosen = (0..n).map(|i| (self.next_turn + i) % n).find(|&w| self.scores[w] == best).unwrap_or(0);
        self.next_turn = (self.next_turn + 1) % n;
        chosen
    }

    fn least_loaded(&self) -> usize {
        (0..self.load.len()).min_by_key(|&w| self.load[w]).expect("at least one worker")
    }

    /// Chooses a worker for `tokens` at time `now` and counts it in flight there.
    pub fn route(&mut self, tokens: &[u32], now: f64) -> usize {
        let keys: Vec<u64> = hash_blocks(&self.root, tokens, self.config.block_size, &HashKeys::default())
            .iter()
            .map(EngineBlockHash::as_u64)
            .collect();
        let chosen = if keys.is_empty() {
            if self.config.streamed {
                self.scores.fill(0);
                self.next_of_best()
            } else {
                self.least_loaded()
            }
        } else {
            self.scores.fill(0);
            for (i, key) in keys.iter().enumerate() {
                let mut extended = false;
                for h in self.index.get(key).map(Vec::as_slice).unwrap_or_default() {
                    // The streamed rule makes no speculative entries; the other's expire.
                    if h.expires.is_none_or(|t| now <= t) && self.scores[h.worker] == i {
                        self.scores[h.worker] = i + 1;
                        extended = true;
                    }
                }
                if !extended {
                    break;
                }
            }
            if self.config.streamed {
                let chosen = self.next_of_best();
                self.load[chosen] += 1;
                return chosen;
            }
            let best = (0..self.load.len()).max_by_key(|&w| self.scores[w]).expect("at least one worker");
            let best_score = self.scores[best];
            let chosen = if best_score == 0 { self.least_loaded() } else { best };
            let expires = now + self.config.speculative_ttl_secs;
            for key in &keys[best_score..] {
                let holders = self.index.entry(*key).or_default();
                if holders.iter().any(|h| h.worker == chosen && h.expires.is_none()) {
                    continue;
                }
                holders.retain(|h| h.worker != chosen);
                holders.push(Holder { worker: chosen, expires: Some(expires) });
            }
            chosen
        };
        self.load[chosen] += 1;
        chosen
    }

    /// A request routed to `worker` completed.
    pub fn finished(&mut self, worker: usize) {
        self.load[worker] = self.load[worker].saturating_sub(1);
    }

    /// `worker`'s KV events.
    pub fn kv_events(&mut self, worker: usize, changes: &[CacheChange]) {
        for change in changes {
            match change {
                CacheChange::Stored { hashes, .. } => {
                    for hash in hashes {
                        let holders = self.index.entry(hash.as_u64()).or_default();
                        match holders.iter_mut().find(|h| h.worker == worker) {
                            Some(h) => h.expires = None,
                            None => holders.push(Holder { worker, expires: None }),
                        }
                    }
                }
                CacheChange::Removed { hash, .. } => {
                    if let Some(holders) = self.index.get_mut(&hash.as_u64()) {
                        holders.retain(|h| h.worker != worker);
                        if holders.is_empty() {
                            self.index.remove(&hash.as_u64());
                        }
                    }
                }
                // The offload tier's announcements: this rule indexes the GPU cache only.
                CacheChange::Offloaded { .. } | CacheChange::OffloadRemoved { .. } => {}
                CacheChange::Cleared => {
                    self.index.retain(|_, holders| {
                        holders.retain(|h| h.worker != worker);
                        !holders.is_empty()
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(tokens: &[u32]) -> CacheChange {
        let hashes = hash_blocks(&root_hash(Some("0")), tokens, 16, &HashKeys::default());
        CacheChange::Stored {
            hashes,
            parent: None,
            token_ids: tokens.to_vec(),
            keys: HashKeys::default(),
            first_index: 0,
            group: None,
        }
    }

    #[test]
    fn longest_contiguous_match_wins_regardless_of_load() {
        let mut kv = KvAware::new(3, "0");
        let doc: Vec<u32> = (0..64).collect();
        // Worker 1 holds the whole document, worker 2 its first half.
        kv.kv_events(1, &[stored(&doc)]);
        kv.kv_events(2, &[stored(&doc[..32])]);
        for _ in 0..10 {
            assert_eq!(kv.route(&doc, 0.0), 1, "4 blocks beat 2, however busy worker 1 is");
        }
        assert_eq!(kv.load, vec![0, 10, 0]);
        // Evicting worker 1's second block caps it at one block: worker 2's two win.
        let second = hash_blocks(&root_hash(Some("0")), &doc, 16, &HashKeys::default())[1];
        kv.kv_events(1, &[CacheChange::Removed { hash: second, group: None }]);
        assert_eq!(kv.route(&doc, 0.0), 2);
    }

    #[test]
    fn streamed_rule_credits_only_announced_blocks_and_rotates_ties() {
        let config = KvAwareConfig { streamed: true, ..KvAwareConfig::default() };
        let mut kv = KvAware::with_config(config, 3, "0");
        let doc: Vec<u32> = (0..64).collect();
        // Cold: every worker ties, and they take turns — the same prompt again is computed
        // afresh elsewhere while nothing is announced.
        assert_eq!([kv.route(&doc, 0.0), kv.route(&doc, 0.0), kv.route(&doc, 0.0)], [0, 1, 2]);
        // Worker 1 announces it: it takes every request, however many are in flight.
        kv.kv_events(1, &[stored(&doc)]);
        assert!((0..5).all(|_| kv.route(&doc, 0.1) == 1));
        assert_eq!(kv.load, vec![1, 6, 1]);
        // Workers 1 and 2 both hold it: they alternate; worker 0 holds half and gets none.
        kv.kv_events(2, &[stored(&doc)]);
        kv.kv_events(0, &[stored(&doc[..32])]);
        let taken: Vec<usize> = (0..4).map(|_| kv.route(&doc, 0.2)).collect();
        assert_eq!(taken.iter().filter(|&&w| w == 1).count(), 2, "{taken:?}");
        assert_eq!(taken.iter().filter(|&&w| w == 2).count(), 2, "{taken:?}");
    }

    #[test]
    fn cold_prompts_go_least_loaded_and_are_remembered_for_the_ttl() {
        let mut kv = KvAware::new(2, "0");
        let a: Vec<u32> = (100..148).collect();
        let b: Vec<u32> = (500..548).collect();
        assert_eq!(kv.route(&a, 0.0), 0, "nothing cached, both idle: the first");
        assert_eq!(kv.route(&a, 1.0), 0, "its speculative blocks hold for 2 s, busy or not");
        assert_eq!(kv.route(&b, 1.0), 1, "a new prompt goes to the less loaded worker");
        assert_eq!(kv.route(&a, 3.5), 1, "expired (last written at 1 s): least loaded, 2 vs 1");
        // A real event keeps the blocks past any TTL.
        kv.kv_events(0, &[stored(&a)]);
        assert_eq!(kv.route(&a, 100.0), 0);
        assert_eq!(kv.load, vec![3, 2]);
        assert_eq!(kv.route(&a[..10], 100.0), 1, "shorter than a block: least loaded");
        kv.finished(1);
        kv.finished(1);
        kv.kv_events(0, &[CacheChange::Cleared]);
        assert_eq!(kv.route(&a, 100.0), 1, "cleared, worker 1's guesses long expired: least loaded");
    }
}
