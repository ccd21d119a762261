//! The index agrees with the engines' real caches.
//!
//! Three simulated engines (the `kvgate-sim` engine model, each with its own random hash
//! seed) run a random workload with shared prefixes, LoRA adapters, cache salts, evictions
//! and cache resets. Every step's cache changes are encoded exactly as vLLM publishes them,
//! decoded by kvgate and applied to one index. At checkpoints, for random probe prompts, the
//! index's per-pod prefix overlap must equal what each engine actually has cached. As hybrid
//! models (a sliding window beside full attention), the engines announce each KV-cache group
//! apart, free the blocks their windows move past, and serve a prefix only as far as both
//! groups hold it: the index's hybrid prefix must equal that too.

use kvgate_routing::events::decode_batch;
use kvgate_routing::hash::{root_hash, sequence_hashes};
use kvgate_routing::index::{IndexConfig, KvIndex};
use kvgate_routing::pod_set::{PodId, PodSet};
use kvgate_sim::cache::HashKeys;
use kvgate_sim::engine::{Engine, EngineConfig, KvTransfer, NewRequest};
use kvgate_sim::events::{EventEncoder, EventFormat, HashFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BS: usize = 4;

fn keys(rng: &mut StdRng) -> HashKeys {
    match rng.random_range(0..6) {
        0 => HashKeys { lora_name: Some("sql".into()), lora_id: Some(1), cache_salt: None },
        1 => HashKeys { cache_salt: Some("tenant-9".into()), ..HashKeys::default() },
        2 => HashKeys { lora_name: Some("sql".into()), lora_id: Some(1), cache_salt: Some("tenant-9".into()) },
        _ => HashKeys::default(),
    }
}

fn run(format: EventFormat, hashes: HashFormat, seed: u64, sliding_window: Option<usize>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let encoder = EventEncoder { format, hashes, block_size: BS, data_parallel_rank: Some(0) };
    let mut engines: Vec<Engine> = (0..3)
        .map(|i| {
            Engine::new(EngineConfig {
                block_size: BS,
                num_blocks: 48 + 16 * i,
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
                hash_seed: None, // random per engine: their hashes never agree with ours
                filler_tokens: vec![7, 8, 9, 10, 11],
                sliding_window,
                ..Default::default()
            })
        })
        .collect();
    let mut index = KvIndex::new(BS, IndexConfig::default());
    let pods: Vec<PodId> = (0..engines.len() as u32).map(PodId).collect();
    let all: PodSet = pods.iter().copied().collect();
    let prefixes: Vec<Vec<u32>> =
        (0..8).map(|_| (0..rng.random_range(4..40)).map(|_| rng.random_range(0..50)).collect()).collect();
    let prompt = |rng: &mut StdRng| {
        let mut p = prefixes[rng.random_range(0..prefixes.len())].clone();
        p.extend((0..rng.random_range(1..20)).map(|_| rng.random_range(0..50)));
        p
    };
    let publish = |index: &mut KvIndex, pod: PodId, changes: Vec<kvgate_sim::cache::CacheChange>| {
        if changes.is_empty() {
            return;
        }
        let payload = encoder.encode_batch(1.0, &changes);
        let batch = decode_batch(&payload).expect("kvgate decodes what vLLM's format carries");
        index.apply(pod, &batch);
    };

    let (mut checks, mut cut_by_window) = (0, 0);
    for round in 0..400 {
        let e = rng.random_range(0..engines.len());
        let request = NewRequest {
            prompt: prompt(&mut rng),
            max_tokens: rng.random_range(1..8),
            keys: keys(&mut rng),
            kv_transfer: KvTransfer::Local,
        };
        engines[e].add_request(request).expect("valid request");
        // Run every engine a few steps, publishing each step's batch.
        for (i, engine) in engines.iter_mut().enumerate() {
            for _ in 0..rng.random_range(0..4) {
                match engine.step() {
                    Some(step) => publish(&mut index, pods[i], step.cache_changes),
                    None => publish(&mut index, pods[i], engine.take_cache_changes()),
                }
            }
            if engine.is_idle() && rng.random_range(0..60) == 0 {
                let cleared = engine.reset_prefix_cache().expect("idle engine resets");
                publish(&mut index, pods[i], cleared);
            }
        }
        if round % 5 == 0 {
            for _ in 0..10 {
                let probe = prompt(&mut rng);
                let k = keys(&mut rng);
                let mut chain = Vec::new();
                sequence_hashes(root_hash(k.lora_name.as_deref(), k.cache_salt.as_deref()), &probe, BS, &mut chain);
                let mut overlap = Vec::new();
                index.longest_prefixes(&chain, &all, &mut overlap);
                for (i, engine) in engines.iter().enumerate() {
                    let mut cached = overlap[i] as usize;
                    if index.is_hybrid(pods[i]) {
                        cached = index.hybrid_prefix(&chain, pods[i], cached, chain.len());
                        cut_by_window += usize::from(cached < overlap[i] as usize);
                    }
                    assert_eq!(
                        cached,
                        engine.cached_prefix_blocks(&probe, &k),
                        "round {round}, pod {i}, format {format:?}/{hashes:?}"
                    );
                }
                checks += 1;
            }
        }
    }
    assert!(checks >= 800);
    if sliding_window.is_some() {
        // The full-attention prefix alone would have been wrong this often.
        assert!(cut_by_window > 50, "the windows cut {cut_by_window} prefixes");
    }
    for (i, pod) in pods.iter().enumerate() {
        let stats = index.stats(*pod);
        assert!(stats.stored_blocks > 50 && stats.removed_blocks > 10, "pod {i} saw churn: {stats:?}");
        assert_eq!((stats.orphan_blocks, stats.unknown_removals), (0, 0), "no event was lost");
    }
}

#[test]
fn index_matches_engines_with_vllm_map_events() {
    run(EventFormat::Map, HashFormat::U64, 1, None);
}

#[test]
fn index_matches_engines_with_vllm_array_events() {
    run(EventFormat::Array, HashFormat::U64, 2, None);
}

#[test]
fn index_matches_engines_with_byte_hashes() {
    run(EventFormat::Map, HashFormat::Bytes, 3, None);
}

#[test]
fn index_matches_hybrid_engines_across_window_boundaries() {
    // Windows of 2 and 4 blocks (9 and 14 tokens) over prompts of 5–59 tokens.
    run(EventFormat::Map, HashFormat::U64, 4, Some(9));
    run(EventFormat::Array, HashFormat::U64, 5, Some(14));
}
