//! The simulator's KV events, received over real ZMQ sockets and decoded by vLLM's own
//! decoder (the msgspec structs of `vllm/distributed/kv_events.py` from the 0.23 and 0.33
//! wheels), and its replay socket driven by a DEALER as vLLM's consumers do.

use kvgate_test_harness::{Sim, completion, sized, text, vllm_replay, vllm_subscriber};
use serde_json::Value;
use std::time::Duration;

const NEW: &str = "0.33.0"; // maps tagged by "type"; replay replies carry the topic
const OLD: &str = "0.23.0"; // positional arrays; replay replies without topic

fn events(batch: &Value) -> &Vec<Value> {
    batch["events"].as_array().expect("events")
}

fn of_type<'a>(batches: &'a [Value], kind: &str) -> Vec<&'a Value> {
    batches.iter().flat_map(events).filter(|e| e["type"] == kind).collect()
}

fn hashes(event: &Value) -> Vec<u64> {
    event["block_hashes"].as_array().unwrap().iter().map(|h| h.as_u64().expect("u64 hash")).collect()
}

/// Stores, evicts and clears on a small cache; returns the live batches (decoded by vLLM's
/// `version`) and the prompt token ids of the first request.
async fn exercise(sim: &Sim, version: &str, expected_batches: usize) -> (Vec<Value>, Vec<u64>) {
    let sub = vllm_subscriber(version, &sim.events, expected_batches, &[]);
    // 78 tokens: 4 full blocks and a partial one.
    let first = sized("zeta", 78);
    let first_ids = sim.tokenize(&first).await;
    assert_eq!(first_ids.len(), 78);
    sim.post_json("/v1/completions", &completion(&first, 1)).await;
    // The same prefix, extended to 101 tokens: stores only blocks 4 and 5, chained.
    sim.post_json("/v1/completions", &completion(&format!("{first}{}", sized("eta", 23)), 1)).await;
    // A different 180-token prompt needs 12 of the 14 blocks: it evicts cached ones.
    sim.post_json("/v1/completions", &completion(&sized("theta", 180), 1)).await;
    let reset = sim.post("/reset_prefix_cache", &Value::Null).await;
    assert_eq!(reset.status(), 200);
    let mut batches = Vec::new();
    for _ in 0..expected_batches {
        let batch = sub.next(Duration::from_secs(20));
        assert!(batch.get("timeout").is_none(), "vLLM's decoder got only {} batches", batches.len());
        batches.push(batch);
    }
    (batches, first_ids)
}

fn check_semantics(batches: &[Value], first_ids: &[u64]) {
    // Sequence numbers count batches from 0 per publisher.
    let seqs: Vec<u64> = batches.iter().map(|b| b["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (0..batches.len() as u64).collect::<Vec<_>>());
    assert!(batches.iter().all(|b| b["data_parallel_rank"] == 0 && b["topic"] == ""));

    let stored = of_type(batches, "BlockStored");
    // First request: its full prompt blocks, with the prompt's own token ids, no parent.
    let first = stored[0];
    assert_eq!(first["block_size"], 16);
    assert!(first["parent_block_hash"].is_null());
    assert_eq!(first["medium"], "GPU");
    let n = first_ids.len() / 16;
    assert_eq!(hashes(first).len(), n);
    let tokens: Vec<u64> = first["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(tokens, first_ids[..n * 16]);
    // Second request: new blocks only, chained to a block the first one stored.
    let second = stored.iter().find(|e| !e["parent_block_hash"].is_null()).expect("a chained store");
    assert!(hashes(first).contains(&second["parent_block_hash"].as_u64().unwrap()));
    // Evictions name blocks that were stored; a clear ends the stream.
    let all_stored: Vec<u64> = stored.iter().flat_map(|e| hashes(e)).collect();
    let removed = of_type(batches, "BlockRemoved");
    assert!(!removed.is_empty(), "the small cache evicted");
    assert!(removed.iter().flat_map(|e| hashes(e)).all(|h| all_stored.contains(&h)));
    assert!(removed.iter().flat_map(|e| hashes(e)).any(|h| hashes(first).contains(&h)), "LRU evicts the oldest");
    assert_eq!(events(batches.last().unwrap()).last().unwrap()["type"], "AllBlocksCleared");
    // vLLM's integer hashes use the full u64 range.
    assert!(all_stored.iter().any(|&h| h > i64::MAX as u64), "a hash above i64::MAX: {all_stored:?}");
}

/// Replay from `start` returns the same batches as the live stream, then the end marker.
fn check_replay(sim: &Sim, version: &str, live: &[Value], frames: u64) {
    let replies = vllm_replay(version, &sim.replay, 2);
    let (end, replayed) = replies.split_last().expect("replies");
    assert_eq!(end["end"], true, "end marker");
    assert_eq!(end["frames"], frames);
    assert_eq!(end["payload_len"], 0);
    assert_eq!(replayed.len(), live.len() - 2);
    for (r, l) in replayed.iter().zip(&live[2..]) {
        assert_eq!(r["frames"], frames);
        assert_eq!((&r["seq"], &r["events"], &r["ts"]), (&l["seq"], &l["events"], &l["ts"]));
    }
}

// 14 blocks of cache. Batches: the first prompt's store, the extension's store, the third
// prompt's evictions and store (one engine step), the reset.
const SMALL_CACHE: &[&str] = &["--num-blocks", "14", "--hash-seed", "7", "--time-scale", "0.01"];

#[tokio::test]
async fn map_events_decode_with_vllm_0_33_and_replay_with_topic_frame() {
    let sim = Sim::start("pod-map", &[SMALL_CACHE, &["--event-format", "map"]].concat()).await;
    let (batches, first_ids) = exercise(&sim, NEW, 4).await;
    check_semantics(&batches, &first_ids);
    check_replay(&sim, NEW, &batches, 4);
}

#[tokio::test]
async fn array_events_decode_with_vllm_0_23_and_replay_without_topic_frame() {
    let sim = Sim::start("pod-array", &[SMALL_CACHE, &["--event-format", "array"]].concat()).await;
    let (batches, first_ids) = exercise(&sim, OLD, 4).await;
    check_semantics(&batches, &first_ids);
    check_replay(&sim, OLD, &batches, 3);
}

#[tokio::test]
async fn bytes_hashes_decode_as_32_byte_digests() {
    let sim = Sim::start("pod-bytes", &["--hash-format", "bytes", "--time-scale", "0.01"]).await;
    let sub = vllm_subscriber(NEW, &sim.events, 1, &[]);
    sim.post_json("/v1/completions", &completion(&text("iota", 40), 1)).await;
    let batch = sub.next(Duration::from_secs(20));
    let stored = &events(&batch)[0];
    let hs = stored["block_hashes"].as_array().unwrap();
    assert!(!hs.is_empty());
    assert!(hs.iter().all(|h| h["hex"].as_str().unwrap().len() == 64));
}

#[tokio::test]
async fn topic_and_connect_mode_work_like_vllm() {
    // vLLM connects its PUB socket for non-wildcard tcp endpoints; the subscriber binds,
    // possibly later than the engine starts: the pod keeps trying.
    let port = kvgate_test_harness::free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let sim = Sim::start(
        "pod-connect",
        &[
            "--kv-events-endpoint",
            &endpoint,
            "--kv-events-connect",
            "--kv-events-topic",
            "kv@pod",
            "--time-scale",
            "0.01",
        ],
    )
    .await;
    let sub = vllm_subscriber(NEW, &endpoint, 1, &["--bind", "--topic", "kv@pod"]);
    // The PUB side retries every 100 ms: give the connection and subscription a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    sim.post_json("/v1/completions", &completion(&text("kappa", 40), 1)).await;
    let batch = sub.next(Duration::from_secs(20));
    assert_eq!(batch["topic"], "kv@pod");
    assert_eq!(events(&batch)[0]["type"], "BlockStored");
}

#[tokio::test]
async fn lora_and_cache_salt_are_hashed_and_announced() {
    let args = ["--lora-module", "law", "--lora-module", "sql-adapter", "--hash-seed", "1", "--time-scale", "0.01"];
    let sim = Sim::start("pod-lora", &args).await;
    let sub = vllm_subscriber(NEW, &sim.events, 3, &[]);
    let prompt = sized("lambda", 40);
    let base = serde_json::json!({"prompt": prompt, "max_tokens": 1});
    sim.post_json("/v1/completions", &base).await;
    let lora = serde_json::json!({"prompt": prompt, "max_tokens": 1, "model": "sql-adapter"});
    let lora_reply = sim.post_json("/v1/completions", &lora).await;
    assert_eq!(lora_reply["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "other adapter, other blocks");
    let salted = serde_json::json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-7"});
    sim.post_json("/v1/completions", &salted).await;
    let batches: Vec<Value> = (0..3).map(|_| sub.next(Duration::from_secs(20))).collect();
    let stored = of_type(&batches, "BlockStored");
    let (plain, adapter, salt) = (stored[0], stored[1], stored[2]);
    assert!(plain["lora_name"].is_null() && plain["extra_keys"].is_null());
    assert_eq!(adapter["lora_name"], "sql-adapter");
    assert_eq!((&plain["lora_id"], &adapter["lora_id"]), (&Value::Null, &serde_json::json!(2)), "ids in load order");
    assert_eq!(adapter["extra_keys"], serde_json::json!([["sql-adapter"], ["sql-adapter"]]));
    assert_eq!(salt["extra_keys"], serde_json::json!([["tenant-7"], null]), "the salt seeds the first block only");
    assert_eq!(plain["token_ids"], adapter["token_ids"]);
    for other in [adapter, salt] {
        assert!(hashes(other).iter().all(|h| !hashes(plain).contains(h)));
    }
    let unknown = sim.post("/v1/completions", &serde_json::json!({"prompt": "x", "model": "nope"})).await;
    assert_eq!(unknown.status(), 404);
}

#[tokio::test]
async fn a_hybrid_models_groups_are_announced_as_vllm_annotates_them() {
    let sim = Sim::start("pod-hybrid", &["--sliding-window", "32", "--time-scale", "0.01"]).await;
    let sub = vllm_subscriber(NEW, &sim.events, 1, &[]);
    sim.post_json("/v1/completions", &completion(&sized("mu", 100), 1)).await;
    let batch = sub.next(Duration::from_secs(20));
    let stored = of_type(std::slice::from_ref(&batch), "BlockStored");
    assert_eq!(stored.len(), 2, "one store per KV-cache group: {batch}");
    let (full, window) = (stored[0], stored[1]);
    assert_eq!(
        (&full["group_idx"], &full["kv_cache_spec_kind"]),
        (&serde_json::json!(0), &serde_json::json!("full_attention"))
    );
    assert!(full["kv_cache_spec_sliding_window"].is_null());
    assert_eq!(window["group_idx"], 1);
    assert_eq!(
        (&window["kv_cache_spec_kind"], &window["kv_cache_spec_sliding_window"]),
        (&serde_json::json!("sliding_window"), &serde_json::json!(32))
    );
    assert_eq!(hashes(full), hashes(window), "the groups cache the same blocks");
}
