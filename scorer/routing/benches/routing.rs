//! Benchmarks of kvgate's routing core, printed as a table (`make bench-scorer`).
//!
//! 1. Decision latency: an 8k-token pre-tokenized prompt over 64 pods with ≈ 1M indexed
//!    (block, pod) entries — hashing the prompt's blocks and `Router::route`, the scorer's
//!    whole decision (index and in-flight prefixes, every pod's load, the `kv` policy, booking)
//!    — alone and sharing its bookings with other replicas; applying another replica's.
//! 2. Event ingestion: decoding vLLM-encoded batches and applying them, one core.
//! 3. Memory per indexed (block, pod) entry, from the index's table capacities.
//! 4. Tokenization with the real Qwen3 tokenizer (completions and chat, template included).

use kvgate_routing::events::decode_batch;
use kvgate_routing::hash::{SequenceHash, root_hash, sequence_hashes};
use kvgate_routing::index::{IndexConfig, KvIndex};
use kvgate_routing::load::{Lifecycle, LoadConfig, Origin};
use kvgate_routing::pod_set::PodId;
use kvgate_routing::policy::PolicyConfig;
use kvgate_routing::router::{PdConfig, Role, RouteRequest, Router, RouterConfig};
use kvgate_sim::cache::{CacheChange, EngineBlockHash, HashKeys};
use kvgate_sim::events::{EventEncoder, EventFormat, HashFormat};
use std::time::{Duration, Instant};

const BS: usize = 16;
const PODS: usize = 64;

fn engine_hash(v: u64) -> EngineBlockHash {
    let mut d = [0u8; 32];
    d[24..].copy_from_slice(&v.to_be_bytes());
    EngineBlockHash(d)
}

/// Token ids of sequence `s` (4096 tokens = 256 blocks), sharing a 1024-token prefix per group.
fn sequence(s: u32) -> Vec<u32> {
    let group = s % 16;
    (0..4096u32).map(|i| if i < 1024 { group * 7919 + i } else { s * 104_729 + i }).collect()
}

/// Stores `tokens` on `pod` as one BlockStored event (engine hashes unique per pod and block).
fn store(encoder: &EventEncoder, router: &mut Router, pod: PodId, tokens: &[u32], salt: u64) {
    let n = tokens.len() / BS;
    let hashes: Vec<EngineBlockHash> = (0..n as u64).map(|b| engine_hash(salt * 1_000_000 + b)).collect();
    let change = CacheChange::Stored {
        hashes,
        parent: None,
        token_ids: tokens.to_vec(),
        keys: HashKeys::default(),
        first_index: 0,
        group: None,
    };
    let payload = encoder.encode_batch(0.0, &[change]);
    router.apply_events(pod, &decode_batch(&payload).expect("valid"));
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The median time of `runs` calls of `f`.
fn median_time(runs: usize, f: &dyn Fn() -> usize) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// A `Router` as the scorer builds it, over a 64-pod index of ≈ 1M entries.
fn fleet_router(encoder: &EventEncoder) -> Router {
    let mut router = Router::new(&RouterConfig {
        block_size: BS,
        index: IndexConfig { max_blocks_per_pod: 1 << 22, ..IndexConfig::default() },
        load: LoadConfig::default(),
        policy: PolicyConfig::default(),
        pd: PdConfig::default(),
        seed: 1,
        admission: None,
    });
    let pods: Vec<PodId> = (0..PODS).map(|_| router.add_pod(Role::Both, true)).collect();
    let mut salt = 0;
    for (p, &pod) in pods.iter().enumerate() {
        // 64 sequences of 256 blocks per pod: 16,384 blocks, 1,048,576 entries in all.
        for k in 0..64u32 {
            salt += 1;
            store(encoder, &mut router, pod, &sequence(p as u32 * 64 + k), salt);
        }
    }
    router
}

fn main() {
    let encoder =
        EventEncoder { format: EventFormat::Map, hashes: HashFormat::U64, block_size: BS, data_parallel_rank: Some(0) };
    println!("kvgate routing benchmarks ({} cores)\n", std::thread::available_parallelism().map_or(1, |n| n.get()));
    println!("| benchmark | result | target |");
    println!("|---|---|---|");

    // --- two 64-pod indexes with ≈ 1M entries, inside the Router the scorer uses: one alone,
    // one sharing its bookings with other replicas (`sync`) -------------------------------------
    let mut router = fleet_router(&encoder);
    let mut shared = fleet_router(&encoder);
    shared.share_bookings();
    let entries = router.index().entries();
    let bytes = router.index().memory_bytes();
    let per_entry = bytes as f64 / entries as f64;

    // --- decision latency ----------------------------------------------------------------------
    // An 8192-token prompt whose first 4096 tokens are sequence 0 (held by pod 0 and, via the
    // shared 1024-token group prefix, partially by 1/16 of the others): hashing its blocks and
    // `Router::route` (index and in-flight prefixes, 64 pods' load, the `kv` policy, booking).
    // Alone and sharing bookings, in alternating rounds (the machine's noise hits both alike);
    // the sharing router's changes are taken every 8 decisions, as the sync publisher does.
    let mut prompt = sequence(0);
    prompt.extend((0..4096u32).map(|i| 900_000 + i));
    let mut chain: Vec<SequenceHash> = Vec::with_capacity(prompt.len() / BS);
    let (mut alone, mut sharing) = (Vec::with_capacity(20_000), Vec::with_capacity(20_000));
    let mut updates = Vec::new();
    for round in 0..20u64 {
        for (router, samples) in [(&mut router, &mut alone), (&mut shared, &mut sharing)] {
            for k in 0..1_000u64 {
                let i = round * 1_000 + k;
                let id = i.to_string();
                let t = Instant::now();
                sequence_hashes(root_hash(None, None), &prompt, BS, &mut chain);
                let request = RouteRequest::new(&id, &chain, prompt.len() as u32, Some(128));
                let routed = router.route(&request, 0.0).expect("healthy pods");
                samples.push(t.elapsed());
                if i == 0 {
                    assert_eq!(routed.cached_tokens(), 4096, "on an idle fleet the pod holding the prefix wins");
                }
                // Keep a realistic handful in flight.
                if i >= 32 {
                    let _ = router.report(&(i - 32).to_string(), Lifecycle::Done, false, 0.0);
                }
                if i % 8 == 7 {
                    // Sent and dropped, as by the publisher; the last round's kept to apply below.
                    let taken = router.take_shared();
                    if round == 19 {
                        updates.extend(taken);
                    }
                }
            }
        }
    }
    for (label, samples) in [("", &mut alone), (", sharing bookings (sync)", &mut sharing)] {
        samples.sort();
        println!(
            "| decision, 8k-token prompt, 64 pods, {:.2}M entries{label} | p50 {} · p99 {} | p99 ≤ 50 µs |",
            entries as f64 / 1e6,
            us(percentile(samples, 0.5)),
            us(percentile(samples, 0.99))
        );
    }
    // Another replica's changes applied as its own — bookings with their 512-block chains and
    // lifecycle reports — as the sync receiver does, under the decisions' lock.
    let t = Instant::now();
    for u in &updates {
        let _ = router.apply_shared(Origin(1), u, 0.0);
    }
    println!(
        "| another replica's booking change applied (sync), 8k-token prompts | {:.2} µs each ({} changes) | |",
        t.elapsed().as_secs_f64() * 1e6 / updates.len() as f64,
        updates.len()
    );

    // A busy fleet: 1,024 requests in flight (16 per pod on average), each decision reading
    // every pod's load over its bookings.
    const BUSY: u64 = 1_024;
    let mut busy = Vec::with_capacity(4_000);
    for i in 0..BUSY + 4_000 {
        let id = format!("busy-{i}");
        let t = Instant::now();
        sequence_hashes(root_hash(None, None), &prompt, BS, &mut chain);
        let request = RouteRequest::new(&id, &chain, prompt.len() as u32, Some(128));
        router.route(&request, 0.0).expect("healthy pods");
        if i >= BUSY {
            busy.push(t.elapsed());
            let _ = router.report(&format!("busy-{}", i - BUSY), Lifecycle::Done, false, 0.0);
        }
    }
    busy.sort();
    println!(
        "| decision, 8k-token prompt, 64 pods, {BUSY} requests in flight | p50 {} · p99 {} | p99 ≤ 50 µs |",
        us(percentile(&busy, 0.5)),
        us(percentile(&busy, 0.99))
    );

    // --- ingestion -----------------------------------------------------------------------------
    // Batches of 8 BlockStored events of 4 blocks each, followed later by their removal, so
    // the index stays bounded; decode + apply timed together.
    let mut payloads = Vec::new();
    for b in 0..2_000u64 {
        let mut changes = Vec::new();
        for e in 0..8u64 {
            let base = (b * 8 + e) * 4;
            let hashes: Vec<EngineBlockHash> = (0..4).map(|k| engine_hash(5_000_000_000 + base + k)).collect();
            let tokens: Vec<u32> = (0..64).map(|t| (base as u32).wrapping_mul(31) + t).collect();
            changes.push(CacheChange::Stored {
                hashes,
                parent: None,
                token_ids: tokens,
                keys: HashKeys::default(),
                first_index: 0,
                group: None,
            });
        }
        payloads.push(encoder.encode_batch(0.0, &changes));
        let removed: Vec<CacheChange> = (0..32)
            .map(|k| CacheChange::Removed { hash: engine_hash(5_000_000_000 + b * 32 + k), group: None })
            .collect();
        payloads.push(encoder.encode_batch(0.0, &removed));
    }
    let events_per_round = 2_000 * 64u64; // 32 stored + 32 removed blocks per batch pair
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let mut ingest = KvIndex::new(BS, IndexConfig::default());
        let pod = PodId(0);
        let t = Instant::now();
        for p in &payloads {
            ingest.apply(pod, &decode_batch(p).expect("valid"));
        }
        best = best.min(t.elapsed());
        assert_eq!(ingest.pod_blocks(pod), 0);
    }
    let rate = events_per_round as f64 / best.as_secs_f64();
    println!("| event ingestion, decode + apply, one core | {:.2}M block events/s | ≥ 1M/s |", rate / 1e6);
    println!(
        "| memory per indexed (block, pod) entry | {per_entry:.0} B ({:.0} MiB for {entries} entries) | ≤ 64 B |",
        bytes as f64 / (1 << 20) as f64
    );

    // --- tokenization --------------------------------------------------------------------------
    let path = std::env::var("KVGATE_TOKENIZER")
        .unwrap_or_else(|_| format!("{}/../../.kvgate/tokenizers/qwen3/tokenizer.json", env!("CARGO_MANIFEST_DIR")));
    match kvgate_tokenize::Tokenizer::from_file(&path) {
        Ok(tok) => {
            let sentence = "The scheduler batches prefill chunks with decode steps, and cached blocks skip work. ";
            for target in [1_000usize, 8_000, 32_000] {
                let mut text = String::new();
                while tok.encode(&text, true).map(|t| t.len()).unwrap_or(0) < target {
                    text.push_str(&sentence.repeat(target / 40 + 1));
                }
                let messages = [
                    serde_json::json!({"role": "system", "content": "You are helpful."}),
                    serde_json::json!({"role": "user", "content": text}),
                ];
                let options = kvgate_tokenize::ChatOptions::default();
                let completions = median_time(7, &|| tok.encode(&text, true).unwrap().len());
                let chat = median_time(7, &|| tok.encode_chat(&messages, &options).unwrap().len());
                let n = tok.encode(&text, true).unwrap().len();
                println!(
                    "| tokenization, {n} tokens (Qwen3) | completions {:.2} ms · chat {:.2} ms | 32k ≤ 2 ms |",
                    completions.as_secs_f64() * 1e3,
                    chat.as_secs_f64() * 1e3
                );
            }
            // A conversation resent with a new last turn: its history's pieces come from the
            // segment cache (the scorer's default) instead of being encoded again.
            let mut cached = kvgate_tokenize::Tokenizer::from_file(&path).expect("loaded above");
            cached.cache_segments(1 << 22).expect("Qwen3's pieces can be cached");
            let history: Vec<serde_json::Value> = (0..8)
                .map(|turn| {
                    let role = if turn % 2 == 0 { "user" } else { "assistant" };
                    serde_json::json!({"role": role, "content": format!("Turn {turn}. {}", sentence.repeat(55))})
                })
                .collect();
            let asked = std::cell::Cell::new(0);
            let with_new_turn = || {
                asked.set(asked.get() + 1);
                let mut messages = history.clone();
                messages.push(serde_json::json!({"role": "user", "content": format!("Question {}?", asked.get())}));
                messages
            };
            let options = kvgate_tokenize::ChatOptions::default();
            let median = |f: &dyn Fn() -> usize| median_time(9, f);
            let n = tok.encode_chat(&with_new_turn(), &options).unwrap().len();
            let plain = median(&|| tok.encode_chat(&with_new_turn(), &options).unwrap().len());
            let resent = median(&|| cached.encode_chat(&with_new_turn(), &options).unwrap().len());
            println!(
                "| tokenization, {n}-token chat resent with a new turn (Qwen3) | {:.3} ms · segment cache {:.3} ms ({:.1}×) | |",
                plain.as_secs_f64() * 1e3,
                resent.as_secs_f64() * 1e3,
                plain.as_secs_f64() / resent.as_secs_f64()
            );
            // The same conversation resent on each API, from its body's bytes (the scorer's
            // parse included): what the Messages and Responses conversions add to the chat path.
            let body = |api: &str, n: usize| {
                let mut turns = history.clone();
                turns.push(serde_json::json!({"role": "user", "content": format!("Question {n}?")}));
                let body = match api {
                    "chat" => serde_json::json!({"messages": turns}),
                    "messages" => serde_json::json!({"model": "m", "max_tokens": 8, "messages": turns}),
                    _ => serde_json::json!({"input": turns}),
                };
                serde_json::to_vec(&body).unwrap()
            };
            let per_api = |api: &'static str| {
                median(&|| {
                    asked.set(asked.get() + 1);
                    let bytes = body(api, asked.get());
                    match api {
                        "chat" => {
                            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                            cached.encode_chat(v["messages"].as_array().unwrap(), &options).unwrap().len()
                        }
                        "messages" => {
                            let r: kvgate_tokenize::MessagesRequest = serde_json::from_slice(&bytes).unwrap();
                            cached.encode_messages_request(&r).unwrap().len()
                        }
                        _ => {
                            let r: kvgate_tokenize::ResponsesRequest = serde_json::from_slice(&bytes).unwrap();
                            cached.encode_responses_request(&r).unwrap().len()
                        }
                    }
                })
            };
            let (chat, messages, responses) = (per_api("chat"), per_api("messages"), per_api("responses"));
            println!(
                "| the same {n}-token chat resent, from its body, per API (segment cache) | chat {:.3} ms · messages {:.3} ms · responses {:.3} ms | |",
                chat.as_secs_f64() * 1e3,
                messages.as_secs_f64() * 1e3,
                responses.as_secs_f64() * 1e3
            );
            // A document sent again under a new question (completions): cut between words.
            let document: String =
                (0..1400).map(|i| format!("Section {} says {} ", i * 7919 % 10007, sentence)).collect();
            let with_new_question = || format!("{document}Question {}?", asked.get());
            let n = tok.encode(&with_new_question(), true).unwrap().len();
            let plain = median(&|| {
                asked.set(asked.get() + 1);
                tok.encode(&with_new_question(), true).unwrap().len()
            });
            let resent = median(&|| {
                asked.set(asked.get() + 1);
                cached.encode(&with_new_question(), true).unwrap().len()
            });
            println!(
                "| tokenization, {n}-token document sent again with a new question (Qwen3) | {:.3} ms · segment cache {:.3} ms ({:.1}×) | |",
                plain.as_secs_f64() * 1e3,
                resent.as_secs_f64() * 1e3,
                plain.as_secs_f64() / resent.as_secs_f64()
            );
        }
        Err(e) => println!("| tokenization | skipped: {e} (run `make setup`) | |"),
    }
}
