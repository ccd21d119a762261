//! `kvgate-demo` (`make demo`): four simulated vLLM pods, the scorer and a real Envoy on
//! loopback; a realistic mixed workload through Envoy asking kvgate through its wasm filter,
//! then through its Endpoint Picker (ext_proc, as Gateway API Inference Extension gateways
//! ask), then through plain Envoy round robin, each on freshly started pods; a report.
//!
//! `--engines N` (`make demo-engines`): the same on N real vLLM engines (vLLM 0.32 on CPU
//! serving a tiny model, `make setup` installs them) instead of simulated pods.
//!
//! `--replicas N` (`make demo-replicas`): the gateway as one Envoy + scorer, N Envoys asking
//! one scorer, N Envoy + scorer replicas sharing their bookings over a real `nats-server`,
//! and N that do not, the client's requests spread over the gateways in turn; the mixed
//! workload and a burst (many requests at once over a few shared documents), each on
//! freshly started pods; one report with the replicas' sync lag.

use clap::Parser;
use kvgate_e2e::{Measured, ms, name_the_upstream, percentile, send};
use kvgate_test_harness::{
    ENGINE_MODEL, EPP_PORT, Engine, EngineOptions, EnvoyProcess, NatsServer, ScorerProcess, Sim, qwen3_tokenizer, text,
};
use serde_json::{Value, json};
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
    /// Real vLLM engines instead of simulated pods (1 or 2: each takes a CPU and ≈ 3 GB),
    /// serving the tiny model `make setup` makes; `--pods`, `--time-scale` and `--num-blocks`
    /// then do not apply.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=2))]
    engines: u32,
    /// KV blocks per engine (32 tokens each), with `--engines`: 16k tokens, as the simulated
    /// pods'.
    #[arg(long, default_value_t = 512)]
    engine_blocks: u64,
    /// Wall seconds per simulated second (1 = an 8B model on an H100, in real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Prefill/decode disaggregation: half the pods prefill, half decode; compares
    /// conditional, always and never disaggregating.
    #[arg(long)]
    pd: bool,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Multi-turn conversations (on the chat, Messages and Responses APIs in turn).
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
    /// Which way into kvgate: `wasm` (the Envoy filter and scorer sidecar), `native` (the
    /// filter as an Envoy dynamic module), `epp` (the scorer's Endpoint Picker over ext_proc,
    /// as GIE gateways call it), `both` (wasm and epp) or `all`.
    #[arg(long, default_value = "both", value_parser = ["wasm", "native", "epp", "both", "all"])]
    picker: String,
    /// Gateway replicas (Envoy + scorer each): > 1 compares one replica, this many Envoys on
    /// one scorer, this many replicas sharing their bookings over NATS, and this many on
    /// their own (wasm path).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8))]
    replicas: u32,
    /// Requests of the burst (replicas mode), all sent at once.
    #[arg(long, default_value_t = 96)]
    burst_requests: usize,
    /// Shared documents (≈ 2,000 tokens each) the burst's requests ask about.
    #[arg(long, default_value_t = 4)]
    burst_documents: usize,
}

/// The model the simulated pods serve.
const SIM_MODEL: &str = "Qwen/Qwen3-8B";
const MAX_TOKENS: u32 = 32;

impl Args {
    /// The model every request names.
    fn model(&self) -> &'static str {
        if self.engines > 0 { ENGINE_MODEL } else { SIM_MODEL }
    }
}

/// A pod of the demo: simulated, or a real engine.
enum Pod {
    Sim(Sim),
    Engine(Engine),
}

impl Pod {
    fn name(&self) -> &str {
        match self {
            Pod::Sim(p) => &p.pod_id,
            Pod::Engine(e) => &e.name,
        }
    }

    /// (`ip:port`, KV-event endpoint, replay endpoint, base URL).
    fn endpoints(&self) -> (String, &str, &str, &str) {
        match self {
            Pod::Sim(p) => (format!("127.0.0.1:{}", p.port), &p.events, &p.replay, &p.url),
            Pod::Engine(e) => (format!("127.0.0.1:{}", e.port), &e.events, &e.replay, &e.url),
        }
    }

    /// Starts the pods again: empty caches.
    async fn restart_all(pods: &mut [Pod]) {
        for p in pods.iter_mut() {
            match p {
                Pod::Sim(sim) => sim.restart().await,
                Pod::Engine(engine) => engine.respawn(),
            }
        }
        for p in pods.iter_mut() {
            if let Pod::Engine(engine) = p {
                engine.wait_ready().await;
            }
        }
    }
}

fn progress(done: &AtomicUsize, total: usize) {
    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
    if n == total || n.is_multiple_of((total / 8).max(1)) {
        println!("    {n}/{total} requests done");
        let _ = std::io::stdout().flush();
    }
}

/// The gateways' URLs taken in turn, one per request (as a load balancer in front of
/// gateway replicas spreads clients).
#[derive(Clone)]
struct Gateways {
    urls: Arc<Vec<String>>,
    next: Arc<AtomicUsize>,
}

impl Gateways {
    fn new(urls: Vec<String>) -> Self {
        Self { urls: Arc::new(urls), next: Arc::new(AtomicUsize::new(0)) }
    }

    fn next(&self) -> &str {
        &self.urls[self.next.fetch_add(1, Ordering::Relaxed) % self.urls.len()]
    }
}

/// A session's next request: sessions take the chat, Anthropic Messages and OpenAI Responses
/// APIs in turn (the conversation is the same; each API carries it in its own shape).
fn session_request(model: &str, session: usize, messages: &[Value]) -> (&'static str, Value) {
    let (system, turns) = (&messages[0]["content"], &messages[1..]);
    match session % 3 {
        0 => (
            "/v1/chat/completions",
            json!({"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "stream": true,
                   "stream_options": {"include_usage": true}}),
        ),
        1 => (
            "/v1/messages",
            json!({"model": model, "system": system, "messages": turns, "max_tokens": MAX_TOKENS, "stream": true}),
        ),
        _ => (
            "/v1/responses",
            json!({"model": model, "instructions": system, "input": turns, "max_output_tokens": MAX_TOKENS,
                   "stream": true}),
        ),
    }
}

/// Runs the mixed workload through the gateways; returns every request's measurement.
async fn workload(gateways: &Gateways, args: &Args) -> Vec<Measured> {
    let client = reqwest::Client::new();
    let systems: Vec<String> = (0..args.system_prompts)
        .map(|i| format!("You are assistant number {i} of the support desk. {}", text(&format!("rule{i}x"), 330)))
        .collect();
    let total = args.sessions * args.turns + args.unique;
    let done = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(args.concurrency));
    let mut tasks = Vec::new();
    for s in 0..args.sessions {
        let (client, gateways, gate, done) = (client.clone(), gateways.clone(), gate.clone(), done.clone());
        let system = systems[s % systems.len()].clone();
        let (turns, model) = (args.turns, args.model());
        tasks.push(tokio::spawn(async move {
            let mut messages = vec![json!({"role": "system", "content": system})];
            let mut out = Vec::new();
            for t in 0..turns {
                messages.push(
                    json!({"role": "user", "content": format!("User {s}, question {t}: {}", text("detail", 30))}),
                );
                let (path, body) = session_request(model, s, &messages);
                let permit = gate.acquire().await.expect("semaphore");
                let m = send(&client, &format!("{}{path}", gateways.next()), &body).await;
                drop(permit);
                progress(&done, total);
                messages.push(json!({"role": "assistant", "content": m.text.clone()}));
                out.push(m);
            }
            out
        }));
    }
    for u in 0..args.unique {
        let (client, gateways, gate, done) = (client.clone(), gateways.clone(), gate.clone(), done.clone());
        let model = args.model();
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": model, "prompt": text(&format!("unique{u}x"), 400), "max_tokens": MAX_TOKENS,
                              "stream": true, "stream_options": {"include_usage": true}});
            let permit = gate.acquire().await.expect("semaphore");
            let m = send(&client, &format!("{}/v1/completions", gateways.next()), &body).await;
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
    name: String,
    /// `direct / pd` decisions (P/D demo).
    paths: Option<String>,
    per_pod: BTreeMap<String, usize>,
    hit_rate: f64,
    ttft_p50: Duration,
    ttft_p90: Duration,
    latency_mean: Duration,
    errors: usize,
}

/// One leg's row; `pods` names the pods real engines are known by (their `ip:port`).
fn summarize(name: &str, results: &[Measured], pods: &[Pod]) -> Row {
    let names: BTreeMap<String, &str> = pods.iter().map(|p| (p.endpoints().0, p.name())).collect();
    let mut per_pod = BTreeMap::new();
    for r in results {
        let pod = r.pod.as_deref().map(|p| names.get(p).copied().unwrap_or(p));
        *per_pod.entry(pod.unwrap_or("-").to_string()).or_insert(0) += 1;
    }
    let ok: Vec<&Measured> = results.iter().filter(|r| r.status == 200).collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let mut ttft: Vec<Duration> = ok.iter().map(|r| r.ttft).collect();
    let total: Duration = ok.iter().map(|r| r.total).sum();
    Row {
        name: name.to_string(),
        paths: None,
        per_pod,
        hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        ttft_p50: percentile(&mut ttft, 0.5),
        ttft_p90: percentile(&mut ttft, 0.9),
        latency_mean: total / ok.len().max(1) as u32,
        errors: results.len() - ok.len(),
    }
}

/// Starts the pods: real engines with `--engines`, else simulated ones, all `both` or with
/// `--pd` half prefill, half decode.
async fn start_pods(args: &Args) -> Vec<Pod> {
    if args.engines > 0 {
        let options = |cpu| EngineOptions { kv_blocks: args.engine_blocks, cpu, ..EngineOptions::default() };
        let mut engines: Vec<Engine> =
            (0..args.engines as usize).map(|i| Engine::spawn(&format!("engine-{}", i + 1), &options(i % 2))).collect();
        for e in &mut engines {
            e.wait_ready().await;
        }
        return engines.into_iter().map(Pod::Engine).collect();
    }
    let tokenizer = qwen3_tokenizer();
    let scale = args.time_scale.to_string();
    let blocks = args.num_blocks.to_string();
    let mut pods = Vec::new();
    for i in 1..=args.pods {
        let role = match (args.pd, i <= args.pods / 2) {
            (false, _) => "both",
            (true, true) => "prefill",
            (true, false) => "decode",
        };
        let flags = [
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--time-scale",
            &scale,
            "--model",
            SIM_MODEL,
            "--num-blocks",
            &blocks,
            "--role",
            role,
        ];
        let name = if args.pd { format!("{role}-{i}") } else { format!("pod-{i}") };
        pods.push(Pod::Sim(Sim::start(&name, &flags).await));
    }
    pods
}

/// The scorer configuration for `pods`, with extra top-level YAML.
fn scorer_config(pods: &[Pod], args: &Args, extra: &str) -> String {
    let mut config = format!("tokenizer: {}\n{extra}pods:\n", qwen3_tokenizer().display());
    for (i, p) in pods.iter().enumerate() {
        let role = match (args.pd, i < args.pods / 2) {
            (false, _) => "both",
            (true, true) => "prefill",
            (true, false) => "decode",
        };
        let (address, events, replay, url) = p.endpoints();
        config.push_str(&format!(
            "  - {{name: {}, role: {role}, address: '{address}', kv_events: '{events}', kv_events_replay: '{replay}', metrics: '{url}/metrics'}}\n",
            p.name()
        ));
    }
    config
}

fn print_table(rows: &[Row]) {
    println!(
        "| routing | requests per pod | direct / P/D | prefix-cache hit rate | TTFT p50 | TTFT p90 | mean latency | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        let per_pod: Vec<String> = r.per_pod.iter().map(|(p, n)| format!("{p}: {n}")).collect();
        println!(
            "| {} | {} | {} | {:.1} % | {} | {} | {} | {} |",
            r.name,
            per_pod.join(", "),
            r.paths.as_deref().unwrap_or("–"),
            r.hit_rate * 100.0,
            ms(r.ttft_p50),
            ms(r.ttft_p90),
            ms(r.latency_mean),
            r.errors
        );
    }
}

/// `direct / pd` decision counts from the scorer's metrics.
async fn paths(scorer: &ScorerProcess) -> String {
    let count = async |path: &str| scorer.metric(&format!("kvgate_decisions_by_path_total{{path=\"{path}\"}}")).await;
    format!("{} / {}", count("direct").await, count("pd").await)
}

/// `make demo-pd`: the same workload on prefill and decode pods, disaggregated only when it
/// pays off (the threshold), always, and never.
async fn pd_demo(args: &Args) -> anyhow::Result<Vec<Row>> {
    println!("[1/4] starting {} prefill and {} decode pods", args.pods / 2, args.pods - args.pods / 2);
    let mut pods = start_pods(args).await;
    let variants = [
        ("kvgate, conditional P/D (threshold 512)", "pd: {threshold_tokens: 512}\n"),
        ("kvgate, always disaggregate", "pd: {threshold_tokens: 0}\n"),
        ("kvgate, never disaggregate", "pd: {threshold_tokens: 4294967295}\n"),
    ];
    let mut rows = Vec::new();
    for (step, (name, extra)) in variants.iter().enumerate() {
        if step > 0 {
            Pod::restart_all(&mut pods).await;
        }
        let scorer = ScorerProcess::start(&scorer_config(&pods, args, extra)).await;
        let envoy = EnvoyProcess::start(&scorer, &[]).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        println!("[{}/4] workload: {name}", step + 2);
        let results = workload(&Gateways::new(vec![envoy.url.clone()]), args).await;
        let mut row = summarize(name, &results, &pods);
        row.paths = Some(paths(&scorer).await);
        rows.push(row);
    }
    println!("\nreport\n");
    Ok(rows)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvgate_test_harness::quiet_children();
    let pods = if args.engines > 0 {
        format!(
            "{} real vLLM engines (vLLM 0.32 on CPU, a tiny model, {} KV blocks of 32 tokens each)",
            args.engines, args.engine_blocks
        )
    } else {
        format!("{} simulated pods ({} KV blocks each, time scale {})", args.pods, args.num_blocks, args.time_scale)
    };
    println!(
        "kvgate demo: {pods}, {} conversations × {} turns (chat, messages and responses APIs in turn) sharing {} system prompts, {} unique prompts, {} in flight",
        args.sessions, args.turns, args.system_prompts, args.unique, args.concurrency
    );
    anyhow::ensure!(
        args.engines == 0 || (!args.pd && args.replicas == 1),
        "--engines runs the main demo only (not --pd, not --replicas)"
    );
    let rows = if args.replicas > 1 {
        replicas_demo(&args).await?
    } else if args.pd {
        pd_demo(&args).await?
    } else {
        demo(&args).await?
    };
    print_table(&rows);
    if rows.iter().any(|r| r.errors > 0) {
        anyhow::bail!("some requests failed");
    }
    Ok(())
}

async fn demo(args: &Args) -> anyhow::Result<Vec<Row>> {
    let mut legs: Vec<(&str, &str)> = Vec::new();
    let runs = |leg: &str| args.picker == leg || args.picker == "all" || (args.picker == "both" && leg != "native");
    if runs("wasm") {
        legs.push(("Envoy + kvgate, wasm filter (kv policy)", "wasm"));
    }
    if runs("native") {
        legs.push(("Envoy + kvgate, native module (kv policy)", "native"));
    }
    if runs("epp") {
        legs.push(("Envoy + kvgate, Endpoint Picker (kv policy)", "epp"));
    }
    legs.push(("Envoy round robin", "none"));
    let steps = legs.len() + 1;
    println!("[1/{steps}] starting pods and the scorer (HTTP API for the filter, Endpoint Picker on gRPC)");
    let mut pods = start_pods(args).await;
    let epp = format!("epp: {{listen: '127.0.0.1:{EPP_PORT}'}}\n");
    let scorer = ScorerProcess::start(&scorer_config(&pods, args, &epp)).await;
    let mut rows = Vec::new();
    for (i, (name, picker)) in legs.iter().enumerate() {
        if i > 0 {
            println!("    restarting the pods: every leg starts from cold caches");
            Pod::restart_all(&mut pods).await;
        }
        // Real engines do not name themselves in their answers: Envoy names the upstream.
        let envoy = EnvoyProcess::start_patched(&scorer.config_path, &["--picker", picker], name_the_upstream).await;
        if args.engines > 0 {
            // A restarted engine is indexed from its events once the scorer heard it again.
            scorer.wait_ready(Duration::from_secs(60)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        println!("[{}/{steps}] workload through {name} ({})", i + 2, envoy.url);
        rows.push(summarize(name, &workload(&Gateways::new(vec![envoy.url.clone()]), args).await, &pods));
    }
    println!("\nreport\n");
    let baseline = rows.last().expect("the round-robin leg").ttft_p90;
    for r in &rows[..rows.len() - 1] {
        println!(
            "TTFT p90: {} {} vs round robin {} ({:.2}×)",
            r.name,
            ms(r.ttft_p90),
            ms(baseline),
            baseline.as_secs_f64() / r.ttft_p90.as_secs_f64().max(1e-9)
        );
    }
    println!();
    Ok(rows)
}

/// All `args.burst_requests` at once, each a question about one of a few shared documents.
async fn burst(gateways: &Gateways, args: &Args) -> Vec<Measured> {
    let client = reqwest::Client::new();
    let documents: Vec<String> = (0..args.burst_documents)
        .map(|d| format!("Document {d}. {}", text(&format!("burst document {d} clause"), 650)))
        .collect();
    let total = args.burst_requests;
    let done = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..total)
        .map(|i| {
            let url = format!("{}/v1/completions", gateways.next());
            let prompt = format!("{}\nQuestion {i}: {}", documents[i % documents.len()], text(&format!("ask{i}"), 20));
            let body = json!({"model": args.model(), "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": true,
                              "stream_options": {"include_usage": true}});
            let (client, done) = (client.clone(), done.clone());
            tokio::spawn(async move {
                let m = send(&client, &url, &body).await;
                progress(&done, total);
                m
            })
        })
        .collect();
    let mut all = Vec::with_capacity(total);
    for t in tasks {
        all.push(t.await.expect("burst task"));
    }
    all
}

/// The delay of the other replicas' updates (`kvgate_sync_lag_seconds`), over all scorers:
/// (mean, the histogram bound under which 99 % fell).
async fn sync_lag(scorers: &[ScorerProcess]) -> (Duration, Duration) {
    let (mut sum, mut count) = (0.0, 0.0);
    let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
    for s in scorers {
        let text = s.metrics_text().await;
        for line in text.lines().filter(|l| l.starts_with("kvgate_sync_lag_seconds")) {
            let Some((key, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            if key == "kvgate_sync_lag_seconds_sum" {
                sum += value;
            } else if key == "kvgate_sync_lag_seconds_count" {
                count += value;
            } else if let Some(le) = key.split("le=\"").nth(1).and_then(|r| r.strip_suffix("\"}"))
                && let Ok(bound) = le.parse::<f64>()
            {
                *buckets.entry((bound * 1e9) as u64).or_default() += value;
            }
        }
    }
    let mean = Duration::from_secs_f64(if count > 0.0 { sum / count } else { 0.0 });
    let p99 =
        buckets.iter().find(|(_, n)| **n >= 0.99 * count).map_or(Duration::ZERO, |(ns, _)| Duration::from_nanos(*ns));
    (mean, p99)
}

/// `make demo-replicas`: one gateway replica, N Envoys asking one scorer, N replicas sharing
/// their bookings over NATS, N on their own; the mixed workload and a burst through each, on
/// fresh pods every time.
async fn replicas_demo(args: &Args) -> anyhow::Result<Vec<Row>> {
    let n = args.replicas as usize;
    // (name, Envoys, scorers, synced): N Envoys asking one scorer decide on one state with
    // no lag — what sync approaches, with the same gateway processes in the way.
    let variants = [
        ("1 replica".to_string(), 1, 1, false),
        (format!("{n} Envoys, one scorer"), n, 1, false),
        (format!("{n} replicas, synced over NATS"), n, n, true),
        (format!("{n} replicas, unsynced"), n, n, false),
    ];
    let steps = 1 + 2 * variants.len();
    println!("[1/{steps}] starting {} pods and nats-server", args.pods);
    let mut pods = start_pods(args).await;
    let nats = NatsServer::start().await;
    let mut rows = Vec::new();
    let mut lags = Vec::new();
    let mut step = 1;
    for (name, envoy_count, scorer_count, synced) in &variants {
        for (workload_name, is_burst) in [("mixed", false), ("burst", true)] {
            step += 1;
            if step > 2 {
                println!("    restarting the pods: every run starts from cold caches");
                Pod::restart_all(&mut pods).await;
            }
            let mut scorers = Vec::new();
            for r in 0..*scorer_count {
                let sync = if *synced {
                    format!("sync: {{nats: '{}', replica_id: gateway-{r}, join_wait_ms: 3000}}\n", nats.url)
                } else {
                    String::new()
                };
                scorers.push(ScorerProcess::start(&scorer_config(&pods, args, &sync)).await);
            }
            let mut envoys = Vec::new();
            for e in 0..*envoy_count {
                envoys.push(EnvoyProcess::start(&scorers[e % scorers.len()], &["--picker", "wasm"]).await);
            }
            if *synced {
                wait_for_peers(&scorers, scorer_count - 1).await?;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            println!("[{step}/{steps}] {workload_name} workload through {name}");
            let gateways = Gateways::new(envoys.iter().map(|e| e.url.clone()).collect());
            let results = if is_burst { burst(&gateways, args).await } else { workload(&gateways, args).await };
            rows.push(summarize(&format!("{workload_name}: {name}"), &results, &pods));
            if *synced {
                lags.push((workload_name, sync_lag(&scorers).await));
            }
        }
    }
    println!("\nreport\n");
    for (workload_name, (mean, p99)) in lags {
        println!("sync lag ({workload_name}): mean {}, 99 % under {}", ms(mean), ms(p99));
    }
    for workload_name in ["mixed", "burst"] {
        let of = |i: usize| rows.iter().filter(|r| r.name.starts_with(workload_name)).nth(i).expect("row").ttft_p90;
        let one = of(0).as_secs_f64().max(1e-9);
        println!(
            "TTFT p90 ({workload_name}): {n} Envoys on one scorer {:.2}×, {n} replicas synced {:.2}×, unsynced {:.2}× one replica's",
            of(1).as_secs_f64() / one,
            of(2).as_secs_f64() / one,
            of(3).as_secs_f64() / one
        );
    }
    println!();
    Ok(rows)
}

/// Waits until every scorer has heard the others and taken their bookings (30 s at most).
async fn wait_for_peers(scorers: &[ScorerProcess], peers: usize) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut all = true;
        for s in scorers {
            all &= s.metric("kvgate_sync_replicas").await == peers as f64;
        }
        if all {
            return Ok(());
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the replicas did not hear each other within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
