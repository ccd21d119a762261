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
//! (0.1.17) trades load against prefill (`tests/tools/vllm_router_probe.py`): it credits only
//! what the pods' events announced — no speculative entries: a prompt sent again while its
//! first copy is still computing is computed afresh elsewhere — and prices each pod by the
//! prompt tokens still to compute there (this request's, and those of the requests routed
//! there that have not yet sent back their first token) times one plus the requests it has
//! in flight. The cheapest pod wins; tied pods take turns. [`KvAwareConfig::streamed`] is
//! that rule, as the probe measures it (docs/benchmarks.md, "The real vllm-router balances
//! load"): a pod warm with an 850-token prompt keeps 37 streamed requests sharing it, which
//! compute 23 tokens each, and the 38th goes elsewhere (23 × 37 ≤ 855 < 23 × 38); answered
//! whole, a request shows the router no first token until its end, so its 23 tokens count
//! until then, and the seventh goes elsewhere ((6 × 23 + 23) × 7 > 855); with a 1,700-token
//! prompt, where a cache hit computes 15 tokens, the eleventh ((10 × 15 + 15) × 11 > 1,695).

use ahash::AHashMap;
use kvgate_sim::cache::{CacheChange, EngineBlockHash, HashKeys, hash_blocks, root_hash};

/// Defaults of vllm-router's `KvAwareConfig`.
#[derive(Clone, Copy, Debug)]
pub struct KvAwareConfig {
    pub block_size: usize,
    pub speculative_ttl_secs: f64,
    /// 0.1.17's rule, as probed: only blocks the pods' events announced count (no
    /// speculative entries); each pod is priced by the prompt tokens to compute there (this
    /// request's and those of its requests awaiting their first token) times one plus its
    /// requests in flight; the cheapest pods take turns. Named for the requests the live
    /// benchmark sends, whose first tokens the router sees.
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
    /// The streamed rule's turn: the cheapest pods, in order, take turns by it.
    next_turn: usize,
    /// The streamed rule's requests awaiting their first token: id → (worker, the prompt
    /// tokens it computes).
    awaiting: AHashMap<u64, (usize, f64)>,
    /// Per worker, the prompt tokens its requests awaiting their first token compute.
    awaiting_tokens: Vec<f64>,
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
            awaiting: AHashMap::new(),
            awaiting_tokens: vec![0.0; workers],
        }
    }

    /// The streamed rule's choice for request `id` of `tokens` prompt tokens, `scores`
    /// filled: the cheapest workers take turns.
    fn cheapest_in_turn(&mut self, id: u64, tokens: usize) -> usize {
        let n = self.scores.len();
        let block_size = self.config.block_size;
        let computed = |w: usize| tokens.saturating_sub(self.scores[w] * block_size) as f64;
        let price = |w: usize| (computed(w) + self.awaiting_tokens[w]) * (1 + self.load[w]) as f64;
        let cheapest = (0..n).map(price).fold(f64::INFINITY, f64::min);
        let tied: Vec<usize> = (0..n).filter(|&w| price(w) <= cheapest).collect();
        let chosen = tied[self.next_turn % tied.len()];
        self.next_turn = self.next_turn.wrapping_add(1);
        let own = computed(chosen);
        self.awaiting_tokens[chosen] += own;
        self.awaiting.insert(id, (chosen, own));
        chosen
    }

    /// Request `id`'s first token came back: its prompt no longer counts as to compute.
    pub fn first_token(&mut self, id: u64) {
        if let Some((worker, own)) = self.awaiting.remove(&id) {
            self.awaiting_tokens[worker] = (self.awaiting_tokens[worker] - own).max(0.0);
        }
    }

    fn least_loaded(&self) -> usize {
        (0..self.load.len()).min_by_key(|&w| self.load[w]).expect("at least one worker")
    }

    /// Chooses a worker for request `id` of `tokens` at time `now` and counts it in flight
    /// there.
    pub fn route(&mut self, id: u64, tokens: &[u32], now: f64) -> usize {
        let keys: Vec<u64> = hash_blocks(&self.root, tokens, self.config.block_size, &HashKeys::default())
            .iter()
            .map(EngineBlockHash::as_u64)
            .collect();
        // Each worker's leading blocks held without a gap (none for a prompt shorter than a
        // block); speculative entries, which only the earlier rule makes, count until they expire.
        self.scores.fill(0);
        for (i, key) in keys.iter().enumerate() {
            let mut extended = false;
            for h in self.index.get(key).map(Vec::as_slice).unwrap_or_default() {
                if h.expires.is_none_or(|t| now <= t) && self.scores[h.worker] == i {
                    self.scores[h.worker] = i + 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
        let chosen = if self.config.streamed {
            self.cheapest_in_turn(id, tokens.len())
        } else if keys.is_empty() {
            self.least_loaded()
        } else {
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
            assert_eq!(kv.route(0, &doc, 0.0), 1, "4 blocks beat 2, however busy worker 1 is");
        }
        assert_eq!(kv.load, vec![0, 10, 0]);
        // Evicting worker 1's second block caps it at one block: worker 2's two win.
        let second = hash_blocks(&root_hash(Some("0")), &doc, 16, &HashKeys::default())[1];
        kv.kv_events(1, &[CacheChange::Removed { hash: second, group: None }]);
        assert_eq!(kv.route(0, &doc, 0.0), 2);
    }

    #[test]
    fn streamed_rule_prices_the_prompt_tokens_to_compute_by_the_requests_in_flight() {
        let config = KvAwareConfig { streamed: true, ..KvAwareConfig::default() };
        let mut kv = KvAware::with_config(config, 3, "0");
        let doc: Vec<u32> = (0..640).collect();
        let prompt: Vec<u32> = (0..664).collect(); // the document and a 24-token question
        let finish = |kv: &mut KvAware, ids: std::ops::Range<u64>, workers: &[usize]| {
            for (id, &w) in ids.zip(workers) {
                kv.first_token(id);
                kv.finished(w);
            }
        };
        // Cold: the workers take turns — the same prompt again is computed afresh elsewhere
        // while no event has announced it.
        let cold = [kv.route(0, &prompt, 0.0), kv.route(1, &prompt, 0.0), kv.route(2, &prompt, 0.0)];
        let mut sorted = cold;
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2]);
        finish(&mut kv, 0..3, &cold);
        // Worker 1 announces the document. Requests whose first tokens come back at once stay
        // there while 24 tokens times one plus those in flight cost no more than the whole
        // prompt on an idle worker: 24 × 27 ≤ 664 < 24 × 28.
        kv.kv_events(1, &[stored(&doc)]);
        let taken: Vec<usize> = (3..31)
            .map(|id| {
                let w = kv.route(id, &prompt, 0.1);
                kv.first_token(id);
                w
            })
            .collect();
        assert_eq!(&taken[..27], &[1; 27]);
        assert_ne!(taken[27], 1, "the 28th goes elsewhere");
        finish(&mut kv, 3..31, &taken);
        // Awaiting their first tokens, requests count their own tokens too: 24 × 6 × 6 > 664,
        // so five awaiting send the sixth elsewhere.
        let taken: Vec<usize> = (31..37).map(|id| kv.route(id, &prompt, 0.2)).collect();
        assert_eq!(&taken[..5], &[1; 5]);
        assert_ne!(taken[5], 1);
        finish(&mut kv, 31..37, &taken);
        // Workers 1 and 2 both hold it: they alternate; worker 0, holding half, gets none.
        kv.kv_events(2, &[stored(&doc)]);
        kv.kv_events(0, &[stored(&doc[..320])]);
        let taken: Vec<usize> = (37..41)
            .map(|id| {
                let w = kv.route(id, &prompt, 0.3);
                kv.first_token(id);
                w
            })
            .collect();
        assert_eq!(taken.iter().filter(|&&w| w == 1).count(), 2, "{taken:?}");
        assert_eq!(taken.iter().filter(|&&w| w == 2).count(), 2, "{taken:?}");
    }

    #[test]
    fn cold_prompts_go_least_loaded_and_are_remembered_for_the_ttl() {
        let mut kv = KvAware::new(2, "0");
        let a: Vec<u32> = (100..148).collect();
        let b: Vec<u32> = (500..548).collect();
        assert_eq!(kv.route(0, &a, 0.0), 0, "nothing cached, both idle: the first");
        assert_eq!(kv.route(0, &a, 1.0), 0, "its speculative blocks hold for 2 s, busy or not");
        assert_eq!(kv.route(0, &b, 1.0), 1, "a new prompt goes to the less loaded worker");
        assert_eq!(kv.route(0, &a, 3.5), 1, "expired (last written at 1 s): least loaded, 2 vs 1");
        // A real event keeps the blocks past any TTL.
        kv.kv_events(0, &[stored(&a)]);
        assert_eq!(kv.route(0, &a, 100.0), 0);
        assert_eq!(kv.load, vec![3, 2]);
        assert_eq!(kv.route(0, &a[..10], 100.0), 1, "shorter than a block: least loaded");
        kv.finished(1);
        kv.finished(1);
        kv.kv_events(0, &[CacheChange::Cleared]);
        assert_eq!(kv.route(0, &a, 100.0), 1, "cleared, worker 1's guesses long expired: least loaded");
    }
}
