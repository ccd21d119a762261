//! Event-stream faults against the real scorer: a publisher under the test's control sends
//! vLLM-encoded batches with lost, duplicated and garbage messages, and a replay socket.

use bytes::Bytes;
use kvgate_sim::cache::{CacheChange, EngineBlockHash, HashKeys};
use kvgate_sim::events::{EventEncoder, EventFormat, HashFormat};
use kvgate_test_harness::{ScorerProcess, free_port, qwen3_tokenizer};
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BS: usize = 16;

fn engine_hash(v: u64) -> EngineBlockHash {
    let mut d = [0u8; 32];
    d[24..].copy_from_slice(&v.to_be_bytes());
    EngineBlockHash(d)
}

/// The prompt: 70 token ids → 4 full blocks.
fn prompt() -> Vec<u32> {
    (1000..1070).collect()
}

/// Batch `i` stores block `i` of the prompt, chained to block `i − 1`.
fn store_block(i: usize) -> Vec<u8> {
    let tokens = prompt()[i * BS..(i + 1) * BS].to_vec();
    let change = CacheChange::Stored {
        hashes: vec![engine_hash(0xf000_0000_0000_0000 + i as u64)],
        parent: i.checked_sub(1).map(|p| engine_hash(0xf000_0000_0000_0000 + p as u64)),
        token_ids: tokens,
        keys: HashKeys::default(),
        first_index: i,
        group: None,
    };
    let encoder =
        EventEncoder { format: EventFormat::Map, hashes: HashFormat::U64, block_size: BS, data_parallel_rank: Some(0) };
    encoder.encode_batch(1.0, &[change])
}

struct FakePod {
    publisher: PubSocket,
    events: String,
    replay: String,
    buffer: Arc<Mutex<Vec<(u64, Bytes)>>>,
}

impl FakePod {
    async fn start() -> FakePod {
        let events = format!("tcp://127.0.0.1:{}", free_port());
        let replay = format!("tcp://127.0.0.1:{}", free_port());
        let mut publisher = PubSocket::new();
        publisher.bind(&events).await.unwrap();
        let mut router = RouterSocket::new();
        router.bind(&replay).await.unwrap();
        let buffer: Arc<Mutex<Vec<(u64, Bytes)>>> = Arc::default();
        let served = buffer.clone();
        tokio::spawn(async move {
            // vLLM ≥ 0.26 replay: ["", topic, seq, payload] per batch ≥ start, then the end marker.
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let start = u64::from_be_bytes(frames[2].as_ref().try_into().unwrap());
                let batches: Vec<(u64, Bytes)> =
                    served.lock().unwrap().iter().filter(|(s, _)| *s >= start).cloned().collect();
                for (seq, payload) in batches {
                    let reply = vec![
                        frames[0].clone(),
                        Bytes::new(),
                        Bytes::new(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    router.send(ZmqMessage::try_from(reply).unwrap()).await.unwrap();
                }
                let end =
                    vec![frames[0].clone(), Bytes::new(), Bytes::new(), Bytes::from_static(&[0xff; 8]), Bytes::new()];
                router.send(ZmqMessage::try_from(end).unwrap()).await.unwrap();
            }
        });
        FakePod { publisher, events, replay, buffer }
    }

    /// Records batch `seq` for replay; publishes it unless `lose` is set.
    async fn batch(&mut self, seq: u64, payload: Vec<u8>, lose: bool) {
        let payload = Bytes::from(payload);
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if !lose {
            self.raw(vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload]).await;
        }
    }

    async fn raw(&mut self, frames: Vec<Bytes>) {
        self.publisher.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
    }
}

async fn scorer_for(pod: &FakePod, with_replay: bool) -> ScorerProcess {
    let replay = if with_replay { format!("\n    kv_events_replay: {}", pod.replay) } else { String::new() };
    let config = format!(
        "tokenizer: {}\npods:\n  - name: fake\n    address: 127.0.0.1:9\n    kv_events: {}{replay}\n",
        qwen3_tokenizer().display(),
        pod.events
    );
    let scorer = ScorerProcess::start(&config).await;
    // Ready: subscribed, and the pod's index rebuilt from its replay buffer (with one) —
    // what the test publishes from here on comes live.
    scorer.wait_ready(Duration::from_secs(10)).await;
    scorer
}

/// Publishes batch 0 until the scorer has applied it (its SUB socket joins asynchronously).
async fn first_batch(pod: &mut FakePod, scorer: &ScorerProcess) {
    first_batch_at(pod, scorer, 0).await;
}

/// Publishes batch `seq` (storing block `seq`) until it is the first the scorer received.
async fn first_batch_at(pod: &mut FakePod, scorer: &ScorerProcess, seq: u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let payload = Bytes::from(store_block(seq as usize));
    pod.buffer.lock().unwrap().push((seq, payload.clone()));
    let before = scorer.pod("fake").await["events_received"].as_u64().unwrap();
    while scorer.pod("fake").await["events_received"].as_u64().unwrap() == before {
        assert!(Instant::now() < deadline, "the scorer never received batch {seq}");
        pod.raw(vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn cached_tokens(scorer: &ScorerProcess) -> u64 {
    let (status, d) =
        scorer.route("/v1/completions", "probe", &json!({"prompt": prompt(), "max_tokens": 1}), false).await;
    assert_eq!(status, 200, "{d}");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/lifecycle", scorer.url))
        .json(&json!({"reports": [{"request_id": "probe", "event": "done"}]}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    d["cached_tokens"].as_u64().unwrap()
}

async fn metric(scorer: &ScorerProcess, line_start: &str) -> Option<String> {
    let text = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    text.lines().find(|l| l.starts_with(line_start)).map(str::to_string)
}

#[tokio::test]
async fn a_gap_is_filled_from_the_replay_socket() {
    let mut pod = FakePod::start().await;
    let scorer = scorer_for(&pod, true).await;
    first_batch(&mut pod, &scorer).await;
    pod.batch(1, store_block(1), false).await;
    pod.batch(2, store_block(2), true).await; // lost on the PUB socket
    pod.batch(3, store_block(3), false).await;
    let state = scorer.wait_pod("fake", Duration::from_secs(10), |p| p["events_received"] == 4).await;
    assert_eq!(state["event_gaps"], 1);
    assert_eq!(state["index_stats"]["orphan_blocks"], 0);
    assert_eq!(cached_tokens(&scorer).await, 64, "all four blocks, the replayed one included");
    assert!(metric(&scorer, "kvgate_kv_replays_total{outcome=\"recovered\",pod=\"fake\"} 1").await.is_some());
}

#[tokio::test]
async fn a_scorer_joining_a_running_engine_catches_up_from_its_replay_buffer() {
    // The engine published batches 0–2 before the scorer listened (a scorer restart).
    let mut pod = FakePod::start().await;
    for i in 0..3 {
        pod.batch(i, store_block(i as usize), true).await;
    }
    let scorer = scorer_for(&pod, true).await;
    // Known as soon as it subscribed, before the engine publishes again (an idle engine may
    // not for long): readiness waits for this.
    scorer.wait_pod("fake", Duration::from_secs(5), |p| p["cached_blocks"] == 3).await;
    first_batch_at(&mut pod, &scorer, 3).await;
    let state = scorer.wait_pod("fake", Duration::from_secs(5), |p| p["cached_blocks"] == 4).await;
    assert_eq!(state["event_gaps"], 0, "joining is not a gap");
    assert_eq!(cached_tokens(&scorer).await, 64, "the blocks stored before it listened are known");
    assert!(metric(&scorer, "kvgate_kv_replays_total{outcome=\"caught_up\",pod=\"fake\"} 1").await.is_some());
}

#[tokio::test]
async fn a_gap_without_replay_clears_the_pod_and_garbage_is_dropped() {
    let mut pod = FakePod::start().await;
    let scorer = scorer_for(&pod, false).await;
    first_batch(&mut pod, &scorer).await;
    pod.batch(1, store_block(1), false).await;
    scorer.wait_pod("fake", Duration::from_secs(10), |p| p["events_received"] == 2).await;
    assert_eq!(cached_tokens(&scorer).await, 32);

    // Garbage: undecodable payload, wrong frame count, short sequence frame. Counted, dropped.
    pod.raw(vec![Bytes::new(), Bytes::copy_from_slice(&2u64.to_be_bytes()), Bytes::from_static(b"\xc1garbage")]).await;
    pod.raw(vec![Bytes::from_static(b"only one frame")]).await;
    pod.raw(vec![Bytes::new(), Bytes::from_static(b"\x01"), Bytes::from(store_block(2))]).await;
    let state = scorer.wait_pod("fake", Duration::from_secs(10), |p| p["event_decode_errors"] == 3).await;
    assert_eq!(state["cached_blocks"], 2, "garbage never touches the index");
    // A duplicate of an applied batch is ignored.
    pod.batch(1, store_block(1), false).await;

    // Batches 3 and 4 are lost; 5 reveals the gap. With no replay the pod's index is cleared
    // and rebuilt from here: 5's parent is unknown, so it is an orphan.
    pod.batch(3, store_block(2), true).await;
    pod.batch(4, store_block(3), true).await;
    pod.batch(5, store_block(3), false).await;
    // (The gap is counted before batch 5 is applied: wait for both.)
    let state = scorer
        .wait_pod("fake", Duration::from_secs(10), |p| p["event_gaps"] == 1 && p["index_stats"]["orphan_blocks"] == 1)
        .await;
    assert_eq!(state["event_batches_missed"], 2);
    assert!(state["event_batches_stale"].as_u64().unwrap() >= 1, "the duplicate of batch 1 was counted");
    assert_eq!(state["cached_blocks"], 0);
    assert_eq!(cached_tokens(&scorer).await, 0);
    assert!(metric(&scorer, "kvgate_kv_replays_total{outcome=\"unavailable\",pod=\"fake\"} 1").await.is_some());

    // The engine restarts: its sequence starts over at 0 and the index is rebuilt.
    pod.batch(0, store_block(0), false).await;
    pod.batch(1, store_block(1), false).await;
    scorer.wait_pod("fake", Duration::from_secs(10), |p| p["cached_blocks"] == 2).await;
    assert_eq!(cached_tokens(&scorer).await, 32);
    let pods: Vec<Value> = scorer.pods().await;
    assert_eq!(pods[0]["event_gaps"], 1, "a restart is not a gap");
}

#[tokio::test]
async fn a_batch_overtaken_by_a_later_one_is_replayed_in_order_and_its_late_copy_dropped() {
    let mut pod = FakePod::start().await;
    let scorer = scorer_for(&pod, true).await;
    first_batch(&mut pod, &scorer).await;
    let stale_before = scorer.pod("fake").await["event_batches_stale"].as_u64().unwrap();
    pod.batch(1, store_block(1), false).await;
    pod.batch(2, store_block(2), true).await; // delayed: published after batch 3
    pod.batch(3, store_block(3), false).await;
    scorer.wait_pod("fake", Duration::from_secs(10), |p| p["events_received"] == 4).await;
    let late = Bytes::from(store_block(2));
    pod.raw(vec![Bytes::new(), Bytes::copy_from_slice(&2u64.to_be_bytes()), late]).await;
    let state = scorer
        .wait_pod("fake", Duration::from_secs(10), |p| p["event_batches_stale"].as_u64() == Some(stale_before + 1))
        .await;
    assert_eq!(state["events_received"], 4, "the late copy is not applied again");
    assert_eq!((state["event_gaps"].as_u64(), state["event_batches_missed"].as_u64()), (Some(1), Some(1)));
    assert_eq!(state["index_stats"]["orphan_blocks"], 0, "2 was applied before 3");
    assert_eq!(cached_tokens(&scorer).await, 64);
}

/// A memory figure of `/proc/<pid>/status` (`VmRSS`, `VmHWM` = peak RSS), in bytes.
fn memory(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} missing"));
    kib * 1024
}

/// Events published far faster than the scorer applies them (it is frozen while the pod
/// floods): the scorer has no queue of its own — its SUB socket reads only as fast as it
/// applies — so the backlog piles up at the publisher, whose bounded per-subscriber queue
/// drops the excess. The scorer's memory stays flat, every batch is either applied or
/// counted as missed, and the index is rebuilt from the batches after the gap.
#[tokio::test]
async fn an_event_flood_is_bounded_and_every_lost_batch_is_counted() {
    const FLOOD: u64 = 130_000; // above zeromq's PUB queue (100,000 messages) plus socket buffers
    const BOUND: u64 = 24 << 20;
    let mut pod = FakePod::start().await;
    let scorer = scorer_for(&pod, false).await;
    first_batch(&mut pod, &scorer).await;

    // One batch storing 8 blocks (128 tokens), re-published with rising sequence numbers.
    let tokens: Vec<u32> = (5000..5128).collect();
    let change = CacheChange::Stored {
        hashes: (0..8).map(|i| engine_hash(0xe000_0000_0000_0000 + i)).collect(),
        parent: None,
        token_ids: tokens.clone(),
        keys: HashKeys::default(),
        first_index: 0,
        group: None,
    };
    let encoder =
        EventEncoder { format: EventFormat::Map, hashes: HashFormat::U64, block_size: BS, data_parallel_rank: Some(0) };
    let payload = Bytes::from(encoder.encode_batch(2.0, &[change]));
    let flood_bytes = FLOOD * payload.len() as u64;
    assert!(flood_bytes > 2 * BOUND, "the flood ({flood_bytes} bytes) must dwarf the memory bound");

    let rss_before = memory(scorer.pid(), "VmRSS");
    scorer.pause();
    for seq in 1..=FLOOD {
        pod.raw(vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]).await;
    }
    scorer.resume();

    // Publish further batches until the last one sent is accounted for: once the backlog
    // drains one gets through and reveals the gap left by the dropped ones.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut next = FLOOD + 1;
    let state = loop {
        pod.raw(vec![Bytes::new(), Bytes::copy_from_slice(&next.to_be_bytes()), payload.clone()]).await;
        next += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let state = scorer.pod("fake").await;
        let accounted = state["events_received"].as_u64().unwrap() + state["event_batches_missed"].as_u64().unwrap();
        if accounted == next {
            break state;
        }
        assert!(Instant::now() < deadline, "batches unaccounted for: sent {next}, state {state}");
    };
    let missed = state["event_batches_missed"].as_u64().unwrap();
    assert!(missed > 0, "the publisher's queue overflowed, so batches were lost: {state}");
    assert!(state["event_gaps"].as_u64().unwrap() >= 1);
    // The peak since start-up (tokenizer loading included) against the resident size before.
    let growth = memory(scorer.pid(), "VmHWM").saturating_sub(rss_before);
    assert!(growth < BOUND, "scorer peak RSS is {growth} bytes above its size before a {flood_bytes}-byte flood");

    // The index was cleared at the gap and rebuilt from the batches after it.
    assert_eq!(state["cached_blocks"], 8, "{state}");
    assert_eq!(state["index_stats"]["orphan_blocks"], 0);
    let body = json!({"prompt": tokens, "max_tokens": 1});
    let (status, d) = scorer.route("/v1/completions", "flood-probe", &body, false).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["cached_tokens"], 112, "all 8 blocks but the one of its last token");
    eprintln!(
        "flood: {FLOOD} batches ({flood_bytes} bytes), {missed} missed, scorer peak RSS {growth} bytes above its size before"
    );
}
