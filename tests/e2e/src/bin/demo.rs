//! `kvgate-demo` (`make demo`): four simulated vLLM pods, the scorer and a real Envoy with the
//! kvgate filter on loopback; a realistic mixed workload through Envoy; then the same
//! workload through plain Envoy round robin on fresh pods; a report comparing the two.

use clap::Parser;
use kvgate_e2e::{Measured, ms, percentile, send};
use kvgate_test_harness::{EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Semaphore;

/// Run the kvgate demo and print a report.
#[derive(Parser, Debug)]
struct Args {
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pods: usize,
    /// Wall seconds per simulated second (1 = an 8B model on an H100, in real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Multi-turn chat sessions.
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Distinct system prompts the sessions share (≈ 1,000 tokens each).
    #[arg(long, default_value_t = 8)]
    system_prompts: usize,
    /// KV blocks per pod (16 tokens each): 16k tokens, less than the workload's working set,
    /// as when a fleet's prompts do not all fit in every pod's cache.
    #[arg(long, default_value_t = 1000)]
    num_blocks: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Requests with unique prompts.
    #[arg(long, default_value_t = 4)]
    unique: usize,
}

const MODEL: &str = "Qwen/Qwen3-8B";
const MAX_TOKENS: u32 = 32;

fn progress(done: &AtomicUsize, total: usize) {
    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
    if n == total || n.is_multiple_of((total / 8).max(1)) {
        println!("    {n}/{total} requests done");
        let _ = std::io::stdout().flush();
    }
}

/// Runs the workload through `url`; returns every request's measurement.
async fn workload(url: &str, args: &Args) -> Vec<Measured> {
    let client = reqwest::Client::new();
    let systems: Vec<String> = (0..args.system_prompts)
        .map(|i| format!("You are assistant number {i} of the support desk. {}", text(&format!("rule{i}x"), 330)))
        .collect();
    let total = args.sessions * args.turns + args.unique;
    let done = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(args.concurrency));
    let mut tasks = Vec::new();
    for s in 0..args.sessions {
        let (client, url, gate, done) = (client.clone(), url.to_string(), gate.clone(), done.clone());
        let system = systems[s % systems.len()].clone();
        let turns = args.turns;
        tasks.push(tokio::spawn(async move {
            let mut messages = vec![json!({"role": "system", "content": system})];
            let mut out = Vec::new();
            for t in 0..turns {
                messages.push(
                    json!({"role": "user", "content": format!("User {s}, question {t}: {}", text("detail", 30))}),
                );
                let body = json!({"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": true,
                                  "stream_options": {"include_usage": true}});
                let permit = gate.acquire().await.expect("semaphore");
                let m = send(&client, &format!("{url}/v1/chat/completions"), &body).await;
                drop(permit);
                progress(&done, total);
                messages.push(json!({"role": "assistant", "content": m.text.clone()}));
                out.push(m);
            }
            out
        }));
    }
    for u in 0..args.unique {
        let (client, url, gate, done) = (client.clone(), url.to_string(), gate.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": MODEL, "prompt": text(&format!("unique{u}x"), 400), "max_tokens": MAX_TOKENS,
                              "stream": true, "stream_options": {"include_usage": true}});
            let permit = gate.acquire().await.expect("semaphore");
            let m = send(&client, &format!("{url}/v1/completions"), &body).await;
            drop(permit);
            progress(&done, total);
            vec![m]
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("workload task"));
    }
    all
}

struct Row {
    name: &'static str,
    per_pod: BTreeMap<String, usize>,
    hit_rate: f64,
    ttft_p50: Duration,
    ttft_p90: Duration,
    latency_mean: Duration,
    errors: usize,
}

fn summarize(name: &'static str, results: &[Measured]) -> Row {
    let mut per_pod = BTreeMap::new();
    for r in results {
        *per_pod.entry(r.pod.clone().unwrap_or_else(|| "-".into())).or_insert(0) += 1;
    }
    let ok: Vec<&Measured> = results.iter().filter(|r| r.status == 200).collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let mut ttft: Vec<Duration> = ok.iter().map(|r| r.ttft).collect();
    let total: Duration = ok.iter().map(|r| r.total).sum();
    Row {
        name,
        per_pod,
        hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        ttft_p50: percentile(&mut ttft, 0.5),
        ttft_p90: percentile(&mut ttft, 0.9),
        latency_mean: total / ok.len().max(1) as u32,
        errors: results.len() - ok.len(),
    }
}

async fn start_pods(args: &Args) -> Vec<Sim> {
    let tokenizer = qwen3_tokenizer();
    let scale = args.time_scale.to_string();
    let mut pods = Vec::new();
    for i in 1..=args.pods {
        let blocks = args.num_blocks.to_string();
        let flags = [
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--time-scale",
            &scale,
            "--model",
            MODEL,
            "--num-blocks",
            &blocks,
        ];
        pods.push(Sim::start(&format!("pod-{i}"), &flags).await);
    }
    pods
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvgate_test_harness::quiet_children();
    println!(
        "kvgate demo: {} simulated pods ({} KV blocks each, time scale {}), {} chat sessions × {} turns sharing {} system prompts, {} unique prompts, {} in flight",
        args.pods,
        args.num_blocks,
        args.time_scale,
        args.sessions,
        args.turns,
        args.system_prompts,
        args.unique,
        args.concurrency
    );

    println!("[1/4] starting pods, scorer and Envoy with the kvgate filter");
    let mut pods = start_pods(&args).await;
    let mut config = format!("tokenizer: {}\npods:\n", qwen3_tokenizer().display());
    for p in &pods {
        config.push_str(&format!(
            "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', kv_events_replay: '{}', metrics: '{}/metrics'}}\n",
            p.pod_id, p.port, p.events, p.replay, p.url
        ));
    }
    let scorer = ScorerProcess::start(&config).await;
    let envoy = EnvoyProcess::start(&scorer, &[]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    println!("[2/4] workload through Envoy + kvgate ({})", envoy.url);
    let kvgate = workload(&envoy.url, &args).await;
    drop(envoy);

    println!("[3/4] same workload through Envoy round robin (no filter), on freshly started pods");
    for p in &mut pods {
        p.restart().await;
    }
    let baseline_envoy = EnvoyProcess::start(&scorer, &["--baseline-round-robin"]).await;
    let baseline = workload(&baseline_envoy.url, &args).await;
    drop(baseline_envoy);

    println!("[4/4] report\n");
    let rows = [summarize("Envoy + kvgate (kv policy)", &kvgate), summarize("Envoy round robin", &baseline)];
    println!("| routing | requests per pod | prefix-cache hit rate | TTFT p50 | TTFT p90 | mean latency | errors |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        let per_pod: Vec<String> = r.per_pod.iter().map(|(p, n)| format!("{p}: {n}")).collect();
        println!(
            "| {} | {} | {:.1} % | {} | {} | {} | {} |",
            r.name,
            per_pod.join(", "),
            r.hit_rate * 100.0,
            ms(r.ttft_p50),
            ms(r.ttft_p90),
            ms(r.latency_mean),
            r.errors
        );
    }
    println!(
        "\nTTFT p90: kvgate {} vs round robin {} ({:.2}×)",
        ms(rows[0].ttft_p90),
        ms(rows[1].ttft_p90),
        rows[1].ttft_p90.as_secs_f64() / rows[0].ttft_p90.as_secs_f64().max(1e-9)
    );
    if rows.iter().any(|r| r.errors > 0) {
        anyhow::bail!("some requests failed");
    }
    Ok(())
}
