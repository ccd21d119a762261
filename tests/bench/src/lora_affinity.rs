//! A re-implementation of the Gateway API Inference Extension's endpoint picker with its
//! LoRA affinity scorer — the rule llm-d and GIE gateways route adapters by — as a
//! reference point for kvgate's adapter-aware costs.
//!
//! Four scorers, each in [0, 1], summed at equal weights (the GIE profile that lists all
//! four; `lora-first` weighs the affinity 10×, so that it decides unless pods tie on it),
//! and the highest total wins (ties at random):
//!
//! - **lora-affinity**: 1 where the adapter is running, 0.8 where the running and waiting
//!   adapters leave a slot free, 0.6 where it is waiting, else 0;
//! - **queue**: `(max − waiting) / (max − min)` over the pods' waiting requests (1 when
//!   all are equal);
//! - **kv-cache-utilization**: `1 − KV-cache usage`;
//! - **prefix-cache**: the share of the prompt's 64-token blocks found, from its first, in
//!   what was routed to the pod (an LRU of 31,250 block hashes per pod; the model name
//!   seeds the chain).
//!
//! It reads every pod's metrics as they are at each decision (GIE refreshes them every
//! 50 ms; the simulated scrape is once a second): generous to the rule.

use crate::cluster::{Arrival, Choice, ClusterRouter, EngineAdapters, Foreseen, PodRole, reported_load};
use ahash::AHashMap;
use kvgate_sim::engine::Engine;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens per block of the prefix-cache scorer.
const BLOCK_TOKENS: usize = 64;
/// Block hashes remembered per pod.
const LRU_CAPACITY: usize = 31_250;

/// The block hashes routed to one pod, the least recently used first out.
#[derive(Default)]
struct RoutedBlocks {
    /// Hash → the tick it was last routed at.
    last_used: AHashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl RoutedBlocks {
    fn insert(&mut self, hash: u64, tick: u64) {
        self.last_used.insert(hash, tick);
        self.order.push_back((hash, tick));
        while self.last_used.len() > LRU_CAPACITY {
            let Some((old, at)) = self.order.pop_front() else { break };
            if self.last_used.get(&old) == Some(&at) {
                self.last_used.remove(&old);
            }
        }
    }
}

pub struct LoraAffinity {
    /// Weight of the lora-affinity score (the others weigh 1).
    lora_weight: f64,
    serving: Vec<usize>,
    routed: Vec<RoutedBlocks>,
    tick: u64,
    rng: StdRng,
}

impl LoraAffinity {
    pub fn new(roles: &[PodRole], seed: u64, lora_weight: f64) -> Self {
        Self {
            lora_weight,
            serving: (0..roles.len()).filter(|&p| roles[p] != PodRole::Prefill).collect(),
            routed: (0..roles.len()).map(|_| RoutedBlocks::default()).collect(),
            tick: 0,
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

/// The lora-affinity scorer's score for `adapter` on a pod.
fn affinity(adapters: Option<&EngineAdapters>, adapter: Option<&str>) -> f64 {
    let (Some(a), Some(adapter)) = (adapters, adapter) else { return 0.0 };
    let named = |list: &[String]| list.iter().any(|n| n == adapter);
    if named(&a.running) {
        1.0
    } else if a.running.len() + a.waiting.len() < a.max_loras {
        0.8
    } else if named(&a.waiting) {
        0.6
    } else {
        0.0
    }
}

/// The prompt's chained 64-token block hashes, seeded by the model name.
fn block_hashes(request: &Arrival<'_>) -> Vec<u64> {
    let mut previous = xxh3_64_with_seed(request.adapter.unwrap_or_default().as_bytes(), 0);
    request
        .prompt
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            previous = xxh3_64_with_seed(&bytes, previous);
            previous
        })
        .collect()
}

impl ClusterRouter for LoraAffinity {
    fn route(&mut self, _request: &Arrival<'_>, _now: f64) -> Choice {
        unreachable!("the endpoint picker reads fresh metrics: the simulator calls route_seeing")
    }

    fn route_seeing(&mut self, request: &Arrival<'_>, _now: f64, engines: &[&Engine], _: &[Foreseen<'_>]) -> Choice {
        let blocks = block_hashes(request);
        let waiting: Vec<f64> = self.serving.iter().map(|&p| reported_load(engines[p]).waiting).collect();
        let (min, max) = waiting.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &w| (lo.min(w), hi.max(w)));
        let scores: Vec<f64> = self
            .serving
            .iter()
            .zip(&waiting)
            .map(|(&p, &w)| {
                let queue = if max > min { (max - w) / (max - min) } else { 1.0 };
                let kv = 1.0 - reported_load(engines[p]).kv_cache_usage;
                let found = blocks.iter().take_while(|h| self.routed[p].last_used.contains_key(h)).count();
                let prefix = if blocks.is_empty() { 0.0 } else { found as f64 / blocks.len() as f64 };
                let lora = affinity(EngineAdapters::of(engines[p]).as_ref(), request.adapter);
                queue + kv + prefix + self.lora_weight * lora
            })
            .collect();
        let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let ties: Vec<usize> = (0..scores.len()).filter(|&i| scores[i] >= best).collect();
        let pod = self.serving[ties[self.rng.random_range(0..ties.len())]];
        self.tick += 1;
        for &h in &blocks {
            self.routed[pod].insert(h, self.tick);
        }
        Choice::pod(pod)
    }

    fn done(&mut self, _id: u64, _output_tokens: Option<u32>, _now: f64) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapters(running: &[&str], waiting: &[&str], max_loras: usize) -> EngineAdapters {
        let names = |l: &[&str]| l.iter().map(|n| n.to_string()).collect();
        EngineAdapters { running: names(running), waiting: names(waiting), max_loras }
    }

    #[test]
    fn affinity_scores_running_then_free_slots_then_waiting() {
        let a = adapters(&["sql"], &["law"], 3);
        assert_eq!(affinity(Some(&a), Some("sql")), 1.0);
        assert_eq!(affinity(Some(&a), Some("med")), 0.8);
        let full = adapters(&["sql", "art"], &["law"], 3);
        assert_eq!(affinity(Some(&full), Some("law")), 0.6);
        assert_eq!(affinity(Some(&full), Some("med")), 0.0);
        assert_eq!(affinity(None, Some("sql")), 0.0, "a pod without adapter slots");
        assert_eq!(affinity(Some(&a), None), 0.0, "the base model");
    }

    #[test]
    fn the_lru_forgets_the_least_recently_routed() {
        let mut r = RoutedBlocks::default();
        for h in 0..LRU_CAPACITY as u64 {
            r.insert(h, h);
        }
        r.insert(0, LRU_CAPACITY as u64); // used again
        r.insert(u64::MAX, LRU_CAPACITY as u64 + 1);
        assert!(r.last_used.contains_key(&0) && !r.last_used.contains_key(&1));
        assert_eq!(r.last_used.len(), LRU_CAPACITY);
    }
}
