//! The simulator checked against the real engine: one trace — conversations under shared
//! system prompts, questions over shared documents, a LoRA adapter's conversations, more
//! distinct tokens than the cache holds — sent one request at a time to a real vLLM engine
//! and to `kvgate-sim` configured alike (block size, KV blocks, adapter slots, model length);
//! per request, the prompt tokens each served from its cache, and the blocks each evicted
//! (counted from its own KV events).
//!
//! The trace fixes everything a client controls: assistant turns are the client's text (not
//! the model's noise), and every answer is exactly `max_tokens` long (`ignore_eos`), so both
//! engines hold the same blocks after each request.

use kvgate_routing::events::{KvEvent, decode_batch};
use kvgate_test_harness::{
    ENGINE_ADAPTER, ENGINE_BLOCK_SIZE, ENGINE_MODEL, ENGINE_SECOND_ADAPTER, Engine, EngineOptions, Sim, qwen3_tokenizer,
};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SubSocket};

/// Output tokens of every request of the trace.
const OUTPUT_TOKENS: u32 = 8;

/// One request of the trace: its API path, its body, and what it exercises.
#[derive(Clone, Debug)]
pub struct Step {
    pub api: &'static str,
    pub body: Value,
    pub kind: &'static str,
}

/// `kvgate-sim` set up as `engine` (started with `options`) is — its model, adapter, block
/// size, KV blocks, adapter slots and model length — in virtual time; and the blocks each of
/// the two evicts from now on, counted from its events (engine's, simulator's).
pub async fn simulator_beside(engine: &Engine, options: &EngineOptions) -> anyhow::Result<(Sim, [EvictionCounter; 2])> {
    let tokenizer = qwen3_tokenizer();
    let (blocks, loras, block_size, model_len) = (
        options.kv_blocks.to_string(),
        options.max_loras.to_string(),
        ENGINE_BLOCK_SIZE.to_string(),
        options.max_model_len.to_string(),
    );
    let tokenizer = tokenizer.to_str().expect("utf-8 path");
    let sim = Sim::start(
        "sim",
        &[
            "--tokenizer",
            tokenizer,
            "--model",
            ENGINE_MODEL,
            "--lora-module",
            ENGINE_ADAPTER,
            "--lora-module",
            ENGINE_SECOND_ADAPTER,
            "--max-loras",
            &loras,
            "--block-size",
            &block_size,
            "--num-blocks",
            &blocks,
            "--max-model-len",
            &model_len,
            "--time-scale",
            "0",
        ],
    )
    .await;
    let counters = [EvictionCounter::subscribe(&engine.events).await?, EvictionCounter::subscribe(&sim.events).await?];
    tokio::time::sleep(Duration::from_millis(300)).await; // subscriptions settle
    Ok((sim, counters))
}

/// A small deterministic generator (the trace is the same on every run and machine).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

fn words(seed: &str, n: usize) -> String {
    (0..n).map(|i| format!("{seed}{}", i % 83)).collect::<Vec<_>>().join(" ")
}

/// `n` requests for `model` (and its LoRA `adapter`): conversations under 6 shared system
/// prompts (a quarter of them on the adapter), questions over 10 documents.
pub fn trace(model: &str, adapter: &str, n: usize, seed: u64) -> Vec<Step> {
    let mut rng = Lcg(seed);
    let systems: Vec<String> = (0..6).map(|k| words(&format!("sys{k}w"), 150)).collect();
    let documents: Vec<String> = (0..10).map(|d| words(&format!("doc{d}w"), 320)).collect();
    struct Chat {
        system: usize,
        adapter: bool,
        turns: Vec<(String, String)>,
    }
    let mut chats: Vec<Chat> = Vec::new();
    let mut steps = Vec::with_capacity(n);
    while steps.len() < n {
        let roll = rng.below(10);
        if roll < 3 {
            // A question over a document (completions).
            let d = rng.below(documents.len());
            let question = words(&format!("ask{}x", steps.len()), 12);
            steps.push(Step {
                api: "/v1/completions",
                kind: "document",
                body: json!({"model": model, "prompt": format!("{}\nQ: {question}\nA:", documents[d]),
                             "max_tokens": OUTPUT_TOKENS, "ignore_eos": true}),
            });
            continue;
        }
        // The next turn of a conversation: a new one now and then, else one going on.
        if chats.len() < 4 || roll == 9 {
            chats.push(Chat { system: rng.below(systems.len()), adapter: rng.below(4) == 0, turns: Vec::new() });
        }
        let c = rng.below(chats.len());
        let chat = &mut chats[c];
        let question = words(&format!("u{c}t{}x", chat.turns.len()), 20);
        let mut messages = vec![json!({"role": "system", "content": systems[chat.system]})];
        for (user, assistant) in &chat.turns {
            messages.push(json!({"role": "user", "content": user}));
            messages.push(json!({"role": "assistant", "content": assistant}));
        }
        messages.push(json!({"role": "user", "content": question}));
        let (model, kind) = if chat.adapter { (adapter, "adapter") } else { (model, "conversation") };
        steps.push(Step {
            api: "/v1/chat/completions",
            kind,
            body: json!({"model": model, "messages": messages, "max_tokens": OUTPUT_TOKENS, "ignore_eos": true}),
        });
        let reply = words(&format!("a{c}t{}x", chat.turns.len()), 25);
        chat.turns.push((question, reply));
        if chat.turns.len() >= 8 {
            chats.swap_remove(c);
        }
    }
    steps
}

/// Counts the blocks a publisher's `BlockRemoved` events name, from when it is subscribed.
pub struct EvictionCounter {
    removed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl EvictionCounter {
    pub async fn subscribe(endpoint: &str) -> anyhow::Result<EvictionCounter> {
        let mut socket = SubSocket::new();
        socket.connect(endpoint).await?;
        socket.subscribe("").await?;
        let removed = Arc::new(AtomicU64::new(0));
        let counted = removed.clone();
        let task = tokio::spawn(async move {
            while let Ok(message) = socket.recv().await {
                let Some(payload) = message.into_vec().pop() else { continue };
                let Ok(batch) = decode_batch(&payload) else { continue };
                for event in &batch.events {
                    if let KvEvent::BlockRemoved { block_hashes, .. } = event {
                        counted.fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
                    }
                }
            }
        });
        Ok(EvictionCounter { removed, task })
    }

    pub fn removed(&self) -> u64 {
        self.removed.load(Ordering::Relaxed)
    }
}

impl Drop for EvictionCounter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One request's answers on both sides.
#[derive(Clone, Debug)]
pub struct Answered {
    pub kind: &'static str,
    pub prompt_tokens: u64,
    pub engine_cached: u64,
    pub sim_cached: u64,
}

/// The comparison of a whole trace.
#[derive(Clone, Debug, Default)]
pub struct Compared {
    pub answered: Vec<Answered>,
    pub engine_evicted: u64,
    pub sim_evicted: u64,
}

impl Compared {
    /// Requests whose cached tokens were equal on both sides, of `kind` (`None`: all).
    pub fn equal(&self, kind: Option<&str>) -> (usize, usize) {
        let of_kind = self.answered.iter().filter(|a| kind.is_none_or(|k| a.kind == k));
        let (mut equal, mut all) = (0, 0);
        for a in of_kind {
            all += 1;
            equal += usize::from(a.engine_cached == a.sim_cached);
        }
        (equal, all)
    }

    /// Cached tokens served in all, (engine, simulator).
    pub fn cached_totals(&self) -> (u64, u64) {
        self.answered.iter().fold((0, 0), |(e, s), a| (e + a.engine_cached, s + a.sim_cached))
    }
}

/// `prompt_tokens` and cached tokens of an OpenAI answer.
async fn usage(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<(u64, u64)> {
    let response = client.post(url).json(body).send().await?;
    let status = response.status();
    let answer: Value = response.json().await?;
    anyhow::ensure!(status.is_success(), "{url} answered {status}: {answer}");
    let usage = &answer["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    Ok((usage["prompt_tokens"].as_u64().unwrap_or(0), cached))
}

/// Sends `trace` one request at a time to the engine and to the simulator (each at its base
/// URL), calling `progress` after each request.
pub async fn compare(
    engine: &str,
    sim: &str,
    (engine_events, sim_events): (&EvictionCounter, &EvictionCounter),
    trace: &[Step],
    mut progress: impl FnMut(usize, &Answered),
) -> anyhow::Result<Compared> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    let mut compared = Compared::default();
    for (i, step) in trace.iter().enumerate() {
        let (prompt_tokens, engine_cached) = usage(&client, &format!("{engine}{}", step.api), &step.body).await?;
        let (sim_prompt, sim_cached) = usage(&client, &format!("{sim}{}", step.api), &step.body).await?;
        anyhow::ensure!(
            prompt_tokens == sim_prompt,
            "request {i}: {prompt_tokens} prompt tokens, the simulator {sim_prompt}"
        );
        let answered = Answered { kind: step.kind, prompt_tokens, engine_cached, sim_cached };
        progress(i, &answered);
        compared.answered.push(answered);
    }
    // The last batches' events are on their way.
    tokio::time::sleep(Duration::from_millis(300)).await;
    compared.engine_evicted = engine_events.removed();
    compared.sim_evicted = sim_events.removed();
    Ok(compared)
}

/// Tokens of the prefix [`send_shared_batch`] sends.
pub const BATCH_PREFIX_TOKENS: u64 = 1024;

/// Sends one completions request of four prompts that share a fresh
/// [`BATCH_PREFIX_TOKENS`]-token prefix to `url` (a base URL) as `model`. vLLM caches a
/// step's blocks when it schedules them, so the three scheduled after the first are served
/// the prefix even in the step that computes it: its engine's
/// `vllm:prefix_cache_hits_total` grows by three prefixes.
pub async fn send_shared_batch(url: &str, model: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    // Token ids no text of the trace renders to in this order.
    let token = |i: u32| 1000 + (i * 31) % 20_000;
    let prefix: Vec<u32> = (0..BATCH_PREFIX_TOKENS as u32).map(token).collect();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|p| prefix.iter().copied().chain((0..64).map(|k| token(100_000 + 64 * p + k))).collect())
        .collect();
    let body = json!({"model": model, "prompt": prompts, "max_tokens": 1, "ignore_eos": true});
    let response = client.post(format!("{url}/v1/completions")).json(&body).send().await?;
    anyhow::ensure!(response.status().is_success(), "{url} answered {}", response.status());
    Ok(())
}

/// The table docs/benchmarks.md shows.
pub fn table(c: &Compared) -> String {
    let mut out = String::from("| requests | cached tokens equal | engine | simulator |\n|---|---|---|---|\n");
    for (name, kind) in [
        ("all", None),
        ("conversations", Some("conversation")),
        ("documents", Some("document")),
        ("LoRA adapter", Some("adapter")),
    ] {
        let (equal, all) = c.equal(kind);
        let (engine, sim) = c
            .answered
            .iter()
            .filter(|a| kind.is_none_or(|k| a.kind == k))
            .fold((0, 0), |(e, s), a| (e + a.engine_cached, s + a.sim_cached));
        let share = if all == 0 { 0.0 } else { 100.0 * equal as f64 / all as f64 };
        out.push_str(&format!(
            "| {name} ({all}) | {equal} ({share:.1} %) | {engine} cached tokens | {sim} cached tokens |\n"
        ));
    }
    out.push_str(&format!("| blocks evicted | | {} | {} |\n", c.engine_evicted, c.sim_evicted));
    out
}
