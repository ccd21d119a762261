//! SGLang's `cache_aware` routing rule, re-implemented as a reference point for the cluster
//! simulator, with the defaults of sglang-router 0.3.2 (the PyPI release the live benchmark
//! runs: `--help` shows them).
//!
//! The rule, per request:
//! 1. **Imbalance switch.** With `load` = requests the router has in flight per worker, the
//!    system is imbalanced when `max − min > balance_abs_threshold` (64) **and**
//!    `max > balance_rel_threshold · min` (1.5); then the least-loaded worker is chosen.
//! 2. Otherwise the request's text is matched against an approximate prefix tree that
//!    remembers, per worker, the texts routed there. If the longest match covers more than
//!    `cache_threshold` (0.3) of the text, the worker holding it is chosen (ties at random);
//!    else the worker with the smallest tree (the least cached text).
//! 3. Either way the text is inserted into the chosen worker's tree; every
//!    `eviction_interval_secs` (60) each worker's tree is pruned, least recently used
//!    first, to `max_tree_size` (2^26 characters).
//!
//! SGLang's tree works on characters; this one on token ids (the simulator has no text).
//! A match ratio is the same measured either way up to the characters-per-token ratio,
//! which the size limit converts at 4 characters per token. The tree is held as the set
//! of prefix hashes of every inserted text (a set closed under prefixes, so the longest
//! match is a binary search), each with its last use; pruning removes least recently used
//! entries, longest first among equals, which keeps the set prefix-closed.

use ahash::AHashMap;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Defaults of sglang-router 0.3.2.
#[derive(Clone, Copy, Debug)]
pub struct CacheAwareConfig {
    pub cache_threshold: f64,
    pub balance_abs_threshold: usize,
    pub balance_rel_threshold: f64,
    pub eviction_interval_secs: f64,
    /// In tokens: `--max-tree-size` (characters) / 4.
    pub max_tree_tokens: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 60.0,
            max_tree_tokens: (1 << 26) / 4,
        }
    }
}

/// The approximate tree of one worker: prefix hash → (last use, prefix length).
#[derive(Default)]
struct Tenant {
    prefixes: AHashMap<u64, (f64, u32)>,
}

impl Tenant {
    /// Length of the longest inserted prefix of the text whose prefix hashes are `hashes`.
    fn longest_match(&self, hashes: &[u64]) -> usize {
        let (mut lo, mut hi) = (0, hashes.len()); // invariant: prefix lo matches
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.prefixes.contains_key(&hashes[mid - 1]) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    fn insert(&mut self, hashes: &[u64], now: f64) {
        for (i, h) in hashes.iter().enumerate() {
            self.prefixes.insert(*h, (now, i as u32 + 1));
        }
    }

    fn prune(&mut self, max: usize) {
        if self.prefixes.len() <= max {
            return;
        }
        let mut entries: Vec<(f64, u32, u64)> = self.prefixes.iter().map(|(h, (t, len))| (*t, *len, *h)).collect();
        entries.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        let excess = self.prefixes.len() - max;
        for (_, _, h) in &entries[..excess] {
            self.prefixes.remove(h);
        }
    }
}

/// The `cache_aware` policy over `n` workers.
pub struct CacheAware {
    config: CacheAwareConfig,
    tenants: Vec<Tenant>,
    load: Vec<usize>,
    next_eviction: f64,
    rng: StdRng,
    hashes: Vec<u64>,
}

/// Chained hash of each prefix of `tokens` (SplitMix64 finaliser over the previous hash and
/// the token).
fn prefix_hashes(tokens: &[u32], out: &mut Vec<u64>) {
    out.clear();
    let mut h: u64 = 0x243f_6a88_85a3_08d3;
    for &t in tokens {
        let mut z = h ^ u64::from(t).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h = z ^ (z >> 31);
        out.push(h);
    }
}

impl CacheAware {
    pub fn new(workers: usize, seed: u64) -> Self {
        Self::with_config(CacheAwareConfig::default(), workers, seed)
    }

    pub fn with_config(config: CacheAwareConfig, workers: usize, seed: u64) -> Self {
        Self {
            config,
            tenants: (0..workers).map(|_| Tenant::default()).collect(),
            load: vec![0; workers],
            next_eviction: config.eviction_interval_secs,
            rng: StdRng::seed_from_u64(seed),
            hashes: Vec::new(),
        }
    }

    /// Chooses a worker for `tokens` at time `now` and counts it in flight there.
    pub fn route(&mut self, tokens: &[u32], now: f64) -> usize {
        if now >= self.next_eviction {
            for t in &mut self.tenants {
                t.prune(self.config.max_tree_tokens);
            }
            self.next_eviction = now + self.config.eviction_interval_secs;
        }
        prefix_hashes(tokens, &mut self.hashes);
        let max = *self.load.iter().max().expect("at least one worker");
        let min = *self.load.iter().min().expect("at least one worker");
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max as f64 > self.config.balance_rel_threshold * min as f64;
        let chosen = if imbalanced {
            self.load.iter().position(|&l| l == min).expect("min exists")
        } else {
            let matched: Vec<usize> = self.tenants.iter().map(|t| t.longest_match(&self.hashes)).collect();
            let best = matched.iter().copied().max().unwrap_or(0);
            let rate = if tokens.is_empty() { 0.0 } else { best as f64 / tokens.len() as f64 };
            if rate > self.config.cache_threshold {
                let ties: Vec<usize> = (0..matched.len()).filter(|&i| matched[i] == best).collect();
                ties[self.rng.random_range(0..ties.len())]
            } else {
                (0..self.tenants.len()).min_by_key(|&i| self.tenants[i].prefixes.len()).expect("a worker")
            }
        };
        self.tenants[chosen].insert(&self.hashes, now);
        self.load[chosen] += 1;
        chosen
    }

    /// A request routed to `worker` completed.
    pub fn finished(&mut self, worker: usize) {
        self.load[worker] = self.load[worker].saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_cached_text_until_imbalanced_then_balances() {
        let mut ca = CacheAware::new(2, 1);
        let shared: Vec<u32> = (0..100).collect();
        let first = ca.route(&shared, 0.0);
        // Same prefix + a short suffix: match 100/110 > 0.3 → same worker.
        for i in 0..60 {
            let mut t = shared.clone();
            t.extend(1000 + i * 10..1010 + i * 10);
            assert_eq!(ca.route(&t, 1.0), first);
        }
        // 61 in flight vs 0: not yet imbalanced (abs threshold 64). 4 more tip it over.
        for _ in 0..4 {
            ca.route(&shared, 1.0);
        }
        assert_eq!(ca.load[first], 65);
        assert_eq!(ca.route(&shared, 1.0), 1 - first, "max − min > 64 and max > 1.5 · min");
        // A text matching nothing goes to the smaller tree once balanced again.
        for _ in 0..65 {
            ca.finished(first);
        }
        let fresh: Vec<u32> = (50_000..50_100).collect();
        assert_eq!(ca.route(&fresh, 2.0), 1 - first, "the other worker's tree is smaller");
    }

    #[test]
    fn pruning_keeps_prefixes_of_what_remains() {
        let mut t = Tenant::default();
        let mut a = Vec::new();
        prefix_hashes(&(0..50).collect::<Vec<u32>>(), &mut a);
        let mut b = Vec::new();
        prefix_hashes(&(0..20).chain(500..530).collect::<Vec<u32>>(), &mut b);
        t.insert(&a, 1.0);
        t.insert(&b, 2.0); // re-touches the shared 20-token prefix
        t.prune(60);
        assert_eq!(t.prefixes.len(), 60);
        assert_eq!(t.longest_match(&b), 50, "the newer text stays whole");
        assert_eq!(t.longest_match(&a), 30, "the older one lost its tail, not its head");
    }
}
