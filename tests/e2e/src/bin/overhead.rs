//! `kvgate-overhead` (`make bench-overhead`): what each way into kvgate adds to a request.
//!
//! One simulated pod whose engine takes almost no time (so the figures are the gateway's),
//! reached five ways: directly; through Envoy round robin (no kvgate); through Envoy with the
//! kvgate wasm filter and its scorer sidecar; through Envoy with the scorer's Endpoint Picker
//! over ext_proc (the bootstrap's default mode), in plain h2c and in TLS. For each prompt size and concurrency the paths run in interleaved rounds
//! (the order rotating each round) so the shared machine's noise hits all alike. Short (≈30
//! tokens) and long (≈8k tokens) prompts at 1 and 24 in flight, and a 220 kB prompt at 64 in
//! flight — the case where llm-d's picker adds over a second. Non-streaming, one output token.

use clap::Parser;
use kvgate_e2e::{ms, percentile, send};
use kvgate_test_harness::{EPP_PORT, EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

#[derive(Parser, Debug)]
struct Args {
    /// Requests per path and cell (prompt size × concurrency).
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Rounds each cell's requests are split into (paths alternate between rounds).
    #[arg(long, default_value_t = 8)]
    rounds: usize,
    /// Only these cells, e.g. `short@1,long@24,220kB@64` (all by default).
    #[arg(long, value_delimiter = ',')]
    cells: Vec<String>,
    /// The Endpoint Picker paths' ext_proc body mode (`kvgate-envoy-config --epp-body-mode`).
    #[arg(long, default_value = "streamed", value_parser = ["streamed", "buffered", "full-duplex"])]
    epp_body_mode: String,
}

/// A prompt size: its label, the words of its text, its cell name.
struct Prompt {
    label: &'static str,
    name: &'static str,
    words: usize,
}

const PROMPTS: [Prompt; 3] = [
    Prompt { label: "short (≈30 tokens)", name: "short", words: 10 },
    Prompt { label: "long (≈8k tokens)", name: "long", words: 2700 },
    // 220 kB of text (≈ 55k tokens).
    Prompt { label: "220 kB (≈55k tokens)", name: "220kB", words: 22_000 },
];

/// (prompt index, in flight).
const CELLS: [(usize, usize); 5] = [(0, 1), (0, 24), (1, 1), (1, 24), (2, 64)];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.rounds >= 1 && args.requests >= args.rounds, "--requests must be ≥ --rounds ≥ 1");
    kvgate_test_harness::quiet_children();
    let tokenizer = qwen3_tokenizer();
    // A near-instant engine: 1e-4 × model time, with room for 220 kB prompts.
    let pod = Sim::start(
        "pod-1",
        &["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.0001", "--max-model-len", "262144"],
    )
    .await;
    let config = format!(
        "tokenizer: {}\nepp: {{listen: '127.0.0.1:{EPP_PORT}'}}\npods:\n  - {{name: pod-1, address: '127.0.0.1:{}', kv_events: '{}'}}\n",
        tokenizer.display(),
        pod.port,
        pod.events
    );
    let scorer = ScorerProcess::start(&config).await;
    // The picker as a sidecar speaks plain h2c on loopback (as the filter's callout does);
    // as its own Deployment, TLS (the default): both are measured.
    let plaintext = ScorerProcess::start(&config.replace("'}\npods:", "', tls: {mode: plaintext}}\npods:")).await;
    let wasm = EnvoyProcess::start(&scorer, &["--picker", "wasm"]).await;
    let epp_tls = EnvoyProcess::start(&scorer, &["--picker", "epp", "--epp-body-mode", &args.epp_body_mode]).await;
    let epp = EnvoyProcess::start(&plaintext, &["--picker", "epp", "--epp-body-mode", &args.epp_body_mode]).await;
    let baseline = EnvoyProcess::start(&scorer, &["--picker", "none"]).await;
    let paths = [
        ("direct to the pod", pod.url.clone()),
        ("Envoy round robin", baseline.url.clone()),
        ("Envoy + kvgate (wasm filter)", wasm.url.clone()),
        ("Envoy + kvgate (Endpoint Picker, h2c)", epp.url.clone()),
        ("Envoy + kvgate (Endpoint Picker, TLS)", epp_tls.url.clone()),
    ];
    let cells: Vec<(usize, usize)> = CELLS
        .into_iter()
        .filter(|(p, c)| args.cells.is_empty() || args.cells.contains(&format!("{}@{c}", PROMPTS[*p].name)))
        .collect();
    anyhow::ensure!(!cells.is_empty(), "no cell matches --cells {:?}", args.cells);
    println!(
        "kvgate overhead: {} requests per path and cell in {} interleaved rounds; one near-instant pod",
        args.requests, args.rounds
    );
    let client = reqwest::Client::new();
    let mut table = String::from(
        "| prompt | in flight | path | latency p50 | p90 | added p50 | req/s |\n|---|---|---|---|---|---|---|\n",
    );
    for (p, in_flight) in cells {
        let prompt = &PROMPTS[p];
        let body = json!({"prompt": text("overhead", prompt.words), "max_tokens": 1});
        for (_, url) in &paths {
            for _ in 0..5 {
                let m = send(&client, &format!("{url}/v1/completions"), &body).await; // warm-up
                anyhow::ensure!(m.status == 200, "{url} answered {} to the warm-up", m.status);
            }
        }
        let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(args.requests); paths.len()];
        let mut busy = vec![Duration::ZERO; paths.len()];
        let per_round = args.requests / args.rounds;
        for round in 0..args.rounds {
            for k in (0..paths.len()).map(|i| (i + round) % paths.len()) {
                let url = format!("{}/v1/completions", paths[k].1);
                let started = Instant::now();
                let statuses = burst(&client, &url, &body, per_round, in_flight, &mut samples[k]).await;
                busy[k] += started.elapsed();
                anyhow::ensure!(statuses.iter().all(|&s| s == 200), "{} failed: {statuses:?}", paths[k].0);
            }
            eprintln!("    {} at {in_flight} in flight: round {}/{}", prompt.label, round + 1, args.rounds);
        }
        let p50: Vec<Duration> = samples.iter_mut().map(|s| percentile(s, 0.5)).collect();
        for (k, (name, _)) in paths.iter().enumerate() {
            let p90 = percentile(&mut samples[k], 0.9);
            let added = if k == 0 { String::new() } else { format!("+{}", ms(p50[k].saturating_sub(p50[0]))) };
            let rate = (per_round * args.rounds) as f64 / busy[k].as_secs_f64();
            table.push_str(&format!(
                "| {} | {in_flight} | {name} | {} | {} | {added} | {rate:.0} |\n",
                prompt.label,
                ms(p50[k]),
                ms(p90)
            ));
        }
    }
    println!("\n{table}");
    Ok(())
}

/// `n` requests at `in_flight` at a time; latencies appended to `samples`; the statuses.
async fn burst(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    n: usize,
    in_flight: usize,
    samples: &mut Vec<Duration>,
) -> Vec<u16> {
    let gate = Arc::new(Semaphore::new(in_flight));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (client, url, body, gate) = (client.clone(), url.to_string(), body.clone(), gate.clone());
            tokio::spawn(async move {
                let _permit = gate.acquire().await.expect("semaphore");
                send(&client, &url, &body).await
            })
        })
        .collect();
    let mut statuses = Vec::with_capacity(n);
    for t in tasks {
        let m = t.await.expect("request task");
        statuses.push(m.status);
        samples.push(m.total);
    }
    statuses
}
