//! `kvgate-live-bench`: the routers a user would pick, side by side on the same simulated
//! pods (live `kvgate-sim` processes, fast time scale) and one identical workload, in turn:
//! Envoy + kvgate (its wasm filter, native module and Endpoint Picker), `vllm-router --policy
//! kv_aware` (fed the pods' KV events), `sglang-router --policy cache_aware`, and Envoy round
//! robin — and, with `--kvgate-variant`, kvgate with a second policy on the same runs. Each
//! router gets fresh pods (cold caches).
//! Then the overhead: each router in front of one instant pod (time scale 0) at a fixed
//! concurrency, short and long prompts, against a direct connection.
//!
//! Writes `results.json`, `results.md`, `ttft.svg` and `requests.csv` (every request of every
//! run: its shared prefix, turn, when it was sent, the pod that answered, its TTFT, latency
//! and cached tokens; no prompt text) under `--out`.

use anyhow::Context;
use clap::Parser;
use kvgate_bench::report::svg_bars;
use kvgate_e2e::{Measured, percentile, send, send_each};
use kvgate_test_harness::{
    EPP_PORT, EnvoyProcess, ScorerProcess, Sim, free_port, qwen3_tokenizer, text, venv_bin, vllm_router_command,
    wait_child_ready,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

const MODEL: &str = "Qwen/Qwen3-8B";

#[derive(Parser, Debug)]
#[command(about = "Envoy + kvgate, vllm-router, sglang-router and Envoy round robin on the same simulated pods")]
struct Args {
    /// Simulated pods behind each router.
    #[arg(long, default_value_t = 4)]
    pods: usize,
    /// Wall seconds per simulated second (0.5: twice as fast as an H100 serving an 8B model).
    #[arg(long, default_value_t = 0.5)]
    time_scale: f64,
    /// KV blocks per pod (16 tokens each): 24k tokens, less than the workload's working set.
    #[arg(long, default_value_t = 1500)]
    num_blocks: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 24)]
    concurrency: usize,
    /// Multi-turn chat sessions (6 turns each) over 6 shared system prompts.
    #[arg(long, default_value_t = 48)]
    sessions: usize,
    /// Questions over 8 shared documents.
    #[arg(long, default_value_t = 240)]
    questions: usize,
    /// Requests per router and prompt size in the overhead part (0 skips the part).
    #[arg(long, default_value_t = 400)]
    overhead_requests: usize,
    /// Runs per router (interleaved across routers); the run with the median TTFT p90 is
    /// reported, with every run's p90 beside it.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// The kvgate scorer's `policy:` (YAML), e.g. "{name: kv, miss_weight: 1}".
    #[arg(long, default_value = "{name: kv}")]
    kvgate_policy: String,
    /// A second kvgate policy to run beside the first on the same runs (router
    /// `kvgate-variant`: the wasm filter, this policy), so that two policies are compared
    /// side by side, interleaved, rather than in runs minutes apart.
    #[arg(long)]
    kvgate_variant: Option<String>,
    /// Routers to run (all by default, and `kvgate-variant` with `--kvgate-variant`):
    /// kvgate, kvgate-native, kvgate-epp, kvgate-variant, vllm-router, sglang-router, envoy-round-robin.
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// Seed of the workload's order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where results go.
    #[arg(long, default_value = "target/bench/live")]
    out: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Kind {
    Kvgate,
    KvgateNative,
    KvgateEpp,
    KvgateVariant,
    VllmRouter,
    SglangRouter,
    EnvoyRoundRobin,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::Kvgate,
        Kind::KvgateNative,
        Kind::KvgateEpp,
        Kind::KvgateVariant,
        Kind::VllmRouter,
        Kind::SglangRouter,
        Kind::EnvoyRoundRobin,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Kvgate => "kvgate",
            Kind::KvgateNative => "kvgate-native",
            Kind::KvgateEpp => "kvgate-epp",
            Kind::KvgateVariant => "kvgate-variant",
            Kind::VllmRouter => "vllm-router",
            Kind::SglangRouter => "sglang-router",
            Kind::EnvoyRoundRobin => "envoy-round-robin",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Kvgate => "Envoy + kvgate wasm filter (kv)",
            Kind::KvgateNative => "Envoy + kvgate native module (kv)",
            Kind::KvgateEpp => "Envoy + kvgate Endpoint Picker (kv)",
            Kind::KvgateVariant => "Envoy + kvgate wasm filter (--kvgate-variant)",
            Kind::VllmRouter => "vllm-router kv_aware",
            Kind::SglangRouter => "sglang-router cache_aware",
            Kind::EnvoyRoundRobin => "Envoy round robin",
        }
    }
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running router: where to send requests, and the processes whose CPU time it costs.
struct Gateway {
    url: String,
    pids: Vec<u32>,
    _scorer: Option<ScorerProcess>,
    _envoy: Option<EnvoyProcess>,
    _peer: Option<Proc>,
    _config: Option<tempfile_path::TempPath>,
}

mod tempfile_path {
    /// A file removed on drop.
    pub struct TempPath(pub std::path::PathBuf);
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn scorer_config(pods: &[Sim], policy: &str) -> String {
    let mut config = format!("tokenizer: {}\npolicy: {policy}\npods:\n", qwen3_tokenizer().display());
    for p in pods {
        config.push_str(&format!(
            "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', metrics: '{}/metrics'}}\n",
            p.pod_id, p.port, p.events, p.url
        ));
    }
    config
}

/// Starts `kind`'s router in front of `pods`; kvgate's scorer with the policy `args` give it.
async fn start(kind: Kind, pods: &[Sim], args: &Args) -> anyhow::Result<Gateway> {
    let none = Gateway { url: String::new(), pids: vec![], _scorer: None, _envoy: None, _peer: None, _config: None };
    let policy = match kind {
        Kind::KvgateVariant => {
            args.kvgate_variant.as_deref().context("router kvgate-variant needs --kvgate-variant")?
        }
        _ => args.kvgate_policy.as_str(),
    };
    Ok(match kind {
        Kind::Kvgate | Kind::KvgateNative | Kind::KvgateEpp | Kind::KvgateVariant => {
            let (epp, picker) = match kind {
                Kind::KvgateEpp => {
                    (format!("epp: {{listen: '127.0.0.1:{EPP_PORT}', tls: {{mode: plaintext}}}}\n"), "epp")
                }
                Kind::KvgateNative => (String::new(), "native"),
                _ => (String::new(), "wasm"),
            };
            let scorer = ScorerProcess::start(&format!("{epp}{}", scorer_config(pods, policy))).await;
            let envoy = EnvoyProcess::start(&scorer, &["--picker", picker]).await;
            Gateway {
                url: envoy.url.clone(),
                pids: vec![envoy.pid(), scorer.pid()],
                _scorer: Some(scorer),
                _envoy: Some(envoy),
                ..none
            }
        }
        Kind::EnvoyRoundRobin => {
            // The bootstrap is rendered from a scorer configuration; no scorer runs.
            let path = std::env::temp_dir().join(format!("kvgate-live-rr-{}.yaml", free_port()));
            std::fs::write(&path, scorer_config(pods, policy))?;
            let envoy = EnvoyProcess::start_for(&path, &["--baseline-round-robin"]).await;
            Gateway {
                url: envoy.url.clone(),
                pids: vec![envoy.pid()],
                _envoy: Some(envoy),
                _config: Some(tempfile_path::TempPath(path)),
                ..none
            }
        }
        Kind::VllmRouter => {
            let port = free_port();
            let mut cmd = vllm_router_command(port, MODEL, pods);
            let mut child = Proc(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().context("start vllm-router")?);
            let url = format!("http://127.0.0.1:{port}");
            wait_child_ready(&mut child.0, &format!("{url}/health"), Duration::from_secs(60))
                .await
                .map_err(|e| anyhow::anyhow!("vllm-router: {e}"))?;
            tokio::time::sleep(Duration::from_secs(1)).await; // its SUB sockets subscribe
            Gateway { url, pids: vec![child.0.id()], _peer: Some(child), ..none }
        }
        Kind::SglangRouter => {
            let port = free_port();
            let mut cmd = Command::new(venv_bin("python"));
            cmd.args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &free_port().to_string()])
                .args(["--policy", "cache_aware", "--log-level", "warn"])
                .arg("--worker-urls")
                .args(pods.iter().map(|p| p.url.clone()));
            let mut child =
                Proc(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().context("start sglang-router")?);
            let url = format!("http://127.0.0.1:{port}");
            wait_child_ready(&mut child.0, &format!("{url}/health"), Duration::from_secs(60))
                .await
                .map_err(|e| anyhow::anyhow!("sglang-router: {e}"))?;
            Gateway { url, pids: vec![child.0.id()], _peer: Some(child), ..none }
        }
    })
}

/// The routers `--routers` names (all by default; the variant only with its policy).
fn kinds(args: &Args) -> anyhow::Result<Vec<Kind>> {
    let with_variant = args.kvgate_variant.is_some();
    if args.routers.is_empty() {
        return Ok(Kind::ALL.into_iter().filter(|&k| k != Kind::KvgateVariant || with_variant).collect());
    }
    let kinds = args
        .routers
        .iter()
        .map(|n| {
            Kind::ALL.into_iter().find(|k| k.name() == n).with_context(|| {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown router {n:?} ({})", names.join(", "))
            })
        })
        .collect::<anyhow::Result<Vec<Kind>>>()?;
    anyhow::ensure!(
        with_variant || !kinds.contains(&Kind::KvgateVariant),
        "router kvgate-variant needs its policy: --kvgate-variant \"{{name: kv, ...}}\""
    );
    Ok(kinds)
}

/// User + system CPU seconds of `pid` and its waited-for children, from `/proc`.
fn cpu_seconds(pid: u32, ticks_per_second: f64) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the parenthesised command name; utime is field 14 overall.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    (11..=14).filter_map(|i| fields.get(i)?.parse::<f64>().ok()).sum::<f64>() / ticks_per_second
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// One request of the workload: a chat session's turns run in order, each re-sending the
/// conversation so far; document questions stand alone. `prefix` numbers the shared text
/// it starts with: the system prompts, then the documents.
#[derive(Clone)]
enum Job {
    Session { prefix: usize, system: String, turns: Vec<String> },
    Question { prefix: usize, document: String, question: String },
}

/// Shared texts the jobs start with: 6 system prompts and 8 documents.
const PREFIXES: usize = 14;

fn jobs(args: &Args) -> Vec<Job> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let systems: Vec<String> = (0..6)
        .map(|i| format!("You are assistant {i} of the support desk. {}", text(&format!("rule{i}x"), 330)))
        .collect();
    let documents: Vec<String> =
        (0..8).map(|i| format!("Document {i}. {}", text(&format!("clause{i}y"), 650))).collect();
    let mut jobs: Vec<Job> = (0..args.sessions)
        .map(|s| Job::Session {
            prefix: s % systems.len(),
            system: systems[s % systems.len()].clone(),
            turns: (0..6).map(|t| format!("User {s}, question {t}: {}", text(&format!("q{s}t{t}"), 25))).collect(),
        })
        .collect();
    for q in 0..args.questions {
        let d = rng.random_range(0..documents.len());
        jobs.push(Job::Question {
            prefix: systems.len() + d,
            document: documents[d].clone(),
            question: format!("Question {q} about it: {}", text(&format!("ask{q}"), 15)),
        });
    }
    jobs.shuffle(&mut rng);
    jobs
}

/// Client-side figures of one router's run.
#[derive(Clone, Debug, Serialize)]
struct LiveResult {
    router: Kind,
    label: &'static str,
    requests: usize,
    errors: usize,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    latency_p50_ms: f64,
    latency_p90_ms: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    prefix_hit_rate: f64,
    router_cpu_s: f64,
    wall_s: f64,
    /// Requests each pod answered (`x-kvgate-pod`), in pod order.
    requests_per_pod: Vec<usize>,
    /// Prompt tokens each pod computed (prompt less cached, as its answers report them): a
    /// pod evicting what its own requests come back for computes far more than its share.
    computed_tokens_per_pod: Vec<u64>,
    /// Over the 14 shared prefixes, the mean number of pods that answered requests starting
    /// with one (1: each kept on one pod).
    pods_per_prefix: f64,
    /// TTFT p90 of every run of this router (this result is the median one).
    ttft_p90_runs_ms: Vec<f64>,
    /// TTFT p90 of the requests sent after the cold start ([`cold_start`]), this run's.
    ttft_p90_warm_ms: f64,
    /// The same, of every run of this router.
    ttft_p90_warm_runs_ms: Vec<f64>,
    /// Requests at or over their run's TTFT p90 (of every run of this router, in the median
    /// result), and how many of them were sent in the cold start.
    slowest: usize,
    slowest_in_cold_start: usize,
    /// After the cold start, the busiest pod's requests in flight less the idlest's, as the
    /// client saw them (sent, not yet answered), at each request's sending, averaged (over
    /// every run of this router, in the median result): how evenly the router spread load.
    inflight_spread: f64,
}

/// How a run's slow requests and load fell around its cold start: the
/// [`LiveResult::ttft_p90_warm_ms`], [`LiveResult::slowest`],
/// [`LiveResult::slowest_in_cold_start`] and [`LiveResult::inflight_spread`] of one run, given
/// its TTFT p90.
struct Phases {
    ttft_p90_warm_ms: f64,
    slowest: usize,
    slowest_in_cold_start: usize,
    inflight_spread: f64,
}

impl Phases {
    fn of(sent: &[Sent], pods: &[Sim], p90: Duration, cold_start: Duration) -> Self {
        let ok: Vec<(&Sent, Option<usize>)> =
            sent.iter().filter(|s| s.measured.status == 200).map(|s| (s, pod_index(&s.measured, pods))).collect();
        let slowest = ok.iter().filter(|(s, _)| s.measured.ttft >= p90).count();
        let slowest_in_cold_start = ok.iter().filter(|(s, _)| s.measured.ttft >= p90 && s.at < cold_start).count();
        let warm: Vec<&Sent> = ok.iter().map(|&(s, _)| s).filter(|s| s.at >= cold_start).collect();
        let mut warm_ttft: Vec<Duration> = warm.iter().map(|s| s.measured.ttft).collect();
        let spreads: Vec<usize> = warm
            .iter()
            .map(|s| {
                let mut inflight = vec![0usize; pods.len()];
                for (o, pod) in &ok {
                    if let Some(pod) = pod.filter(|_| o.at < s.at && s.at < o.at + o.measured.total) {
                        inflight[pod] += 1;
                    }
                }
                inflight.iter().max().unwrap_or(&0) - inflight.iter().min().unwrap_or(&0)
            })
            .collect();
        let mean = |n: usize, len: usize| if len == 0 { f64::NAN } else { n as f64 / len as f64 };
        Self {
            ttft_p90_warm_ms: if warm_ttft.is_empty() { f64::NAN } else { ms(percentile(&mut warm_ttft, 0.9)) },
            slowest,
            slowest_in_cold_start,
            inflight_spread: mean(spreads.iter().sum(), spreads.len()),
        }
    }
}

/// The cold start of a run: its first two simulated seconds (wall seconds at the time
/// scale). The fleet's caches start empty, so the first requests in flight compute every
/// shared prefix, and the next wave finds some prefixes new and others still computing: the
/// TTFTs of this phase are a run's slowest, and how a router spreads a prefix it has not
/// yet seen decides how many of them there are. By its end nearly every run has sent each
/// of the 14 shared prefixes (the last at 0.4–0.9 s in most runs at time scale 0.5).
fn cold_start(args: &Args) -> Duration {
    Duration::from_secs_f64(2.0 * args.time_scale)
}

/// One request as sent and answered.
struct Sent {
    /// The shared prefix its job starts with ([`Job`]).
    prefix: usize,
    /// The turn of its chat session; `None` for a document question.
    turn: Option<usize>,
    /// When it was sent, from the run's start.
    at: Duration,
    measured: Measured,
}

const MAX_TOKENS: u64 = 24;

/// Every request measured.
async fn run_workload(url: &str, jobs: &[Job], concurrency: usize) -> (Vec<Sent>, Duration) {
    let client = reqwest::Client::new();
    let gate = Arc::new(Semaphore::new(concurrency));
    let total: usize = jobs.iter().map(|j| if let Job::Session { turns, .. } = j { turns.len() } else { 1 }).sum();
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for job in jobs.iter().cloned() {
        let (client, url, gate, done) = (client.clone(), format!("{url}/v1/completions"), gate.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let progress = |done: &AtomicUsize| {
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_multiple_of((total / 4).max(1)) {
                    print!(" {n}/{total}");
                    let _ = std::io::stdout().flush();
                }
            };
            let mut out = Vec::new();
            match job {
                Job::Session { prefix, system, turns } => {
                    let mut history = system;
                    for (i, turn) in turns.into_iter().enumerate() {
                        history.push_str(&format!("\nUser: {turn}\nAssistant:"));
                        let body = json!({"model": MODEL, "prompt": history, "max_tokens": MAX_TOKENS, "stream": true,
                                          "stream_options": {"include_usage": true}});
                        let _permit = gate.acquire().await.expect("semaphore");
                        let at = started.elapsed();
                        let measured = send(&client, &url, &body).await;
                        history.push_str(&measured.text);
                        out.push(Sent { prefix, turn: Some(i), at, measured });
                        progress(&done);
                    }
                }
                Job::Question { prefix, document, question } => {
                    let body = json!({"model": MODEL, "prompt": format!("{document}\n{question}\nAnswer:"),
                                      "max_tokens": MAX_TOKENS, "stream": true, "stream_options": {"include_usage": true}});
                    let _permit = gate.acquire().await.expect("semaphore");
                    let at = started.elapsed();
                    out.push(Sent { prefix, turn: None, at, measured: send(&client, &url, &body).await });
                    progress(&done);
                }
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("workload task"));
    }
    println!();
    (all, started.elapsed())
}

/// Each run's figure, rounded: `27 / 29 / 34`.
fn runs(values: &[f64]) -> String {
    values.iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / ")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The index in `pods` of the pod that answered `m`.
fn pod_index(m: &Measured, pods: &[Sim]) -> Option<usize> {
    pods.iter().position(|p| m.pod.as_deref() == Some(p.pod_id.as_str()))
}

/// Where a run's requests went, per pod (in pod order) and per shared prefix.
struct Placement {
    requests: Vec<usize>,
    computed_tokens: Vec<u64>,
    pods_per_prefix: f64,
}

impl Placement {
    fn of(sent: &[Sent], pods: &[Sim]) -> Self {
        let (mut requests, mut computed_tokens) = (vec![0; pods.len()], vec![0; pods.len()]);
        let mut served: Vec<std::collections::BTreeSet<usize>> = vec![Default::default(); PREFIXES];
        for s in sent {
            let Some(pod) = pod_index(&s.measured, pods) else { continue };
            requests[pod] += 1;
            computed_tokens[pod] += s.measured.prompt_tokens.saturating_sub(s.measured.cached_tokens);
            served[s.prefix].insert(pod);
        }
        let used: Vec<usize> = served.iter().map(|pods| pods.len()).filter(|&n| n > 0).collect();
        let pods_per_prefix = if used.is_empty() { 0.0 } else { used.iter().sum::<usize>() as f64 / used.len() as f64 };
        Self { requests, computed_tokens, pods_per_prefix }
    }
}

/// Every router's median run, the failed requests over all runs, and `requests.csv`.
async fn quality(args: &Args, kinds: &[Kind], ticks: f64) -> anyhow::Result<(Vec<LiveResult>, usize, String)> {
    let jobs = jobs(args);
    let mut csv =
        String::from("router,run,prefix,turn,sent_s,pod,status,ttft_ms,total_ms,prompt_tokens,cached_tokens\n");
    let tokenizer = qwen3_tokenizer();
    let tok = tokenizer.to_str().context("tokenizer path")?.to_string();
    let mut runs: Vec<Vec<LiveResult>> = vec![Vec::new(); kinds.len()];
    for (rep, (k, &kind)) in (0..args.repeat.max(1)).flat_map(|r| kinds.iter().enumerate().map(move |k| (r, k))) {
        println!(
            "  run {}/{}, {}: starting {} fresh pods and the router",
            rep + 1,
            args.repeat.max(1),
            kind.label(),
            args.pods
        );
        let mut pods = Vec::new();
        for i in 0..args.pods {
            let extra = [
                "--tokenizer",
                tok.as_str(),
                "--model",
                MODEL,
                "--time-scale",
                &args.time_scale.to_string(),
                "--num-blocks",
                &args.num_blocks.to_string(),
            ];
            pods.push(Sim::start(&format!("pod-{i}"), &extra).await);
        }
        let gateway = start(kind, &pods, args).await?;
        let cpu_before: f64 = gateway.pids.iter().map(|&p| cpu_seconds(p, ticks)).sum();
        print!("    requests done:");
        let (sent, wall) = run_workload(&gateway.url, &jobs, args.concurrency).await;
        let cpu = gateway.pids.iter().map(|&p| cpu_seconds(p, ticks)).sum::<f64>() - cpu_before;
        let placement = Placement::of(&sent, &pods);
        for s in &sent {
            let m = &s.measured;
            csv.push_str(&format!(
                "{},{},{},{},{:.4},{},{},{:.2},{:.2},{},{}\n",
                kind.name(),
                rep + 1,
                s.prefix,
                s.turn.map_or(String::new(), |t| t.to_string()),
                s.at.as_secs_f64(),
                m.pod.as_deref().unwrap_or(""),
                m.status,
                ms(m.ttft),
                ms(m.total),
                m.prompt_tokens,
                m.cached_tokens
            ));
        }
        let mut ttft: Vec<Duration> =
            sent.iter().filter(|s| s.measured.status == 200).map(|s| s.measured.ttft).collect();
        let p90 = percentile(&mut ttft, 0.9);
        let phases = Phases::of(&sent, &pods, p90, cold_start(args));
        let mut measured: Vec<Measured> = sent.into_iter().map(|s| s.measured).collect();
        let ok: Vec<&mut Measured> = measured.iter_mut().filter(|m| m.status == 200).collect();
        let mut total: Vec<Duration> = ok.iter().map(|m| m.total).collect();
        let (prompt, cached) = ok.iter().fold((0, 0), |(p, c), m| (p + m.prompt_tokens, c + m.cached_tokens));
        let r = LiveResult {
            router: kind,
            label: kind.label(),
            requests: measured.len(),
            errors: measured.iter().filter(|m| m.status != 200).count(),
            ttft_p50_ms: ms(percentile(&mut ttft, 0.5)),
            ttft_p90_ms: ms(p90),
            latency_p50_ms: ms(percentile(&mut total, 0.5)),
            latency_p90_ms: ms(percentile(&mut total, 0.9)),
            requests_per_s: measured.len() as f64 / wall.as_secs_f64(),
            output_tokens_per_s: (ttft.len() as u64 * MAX_TOKENS) as f64 / wall.as_secs_f64(),
            prefix_hit_rate: if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
            router_cpu_s: cpu,
            wall_s: wall.as_secs_f64(),
            requests_per_pod: placement.requests,
            computed_tokens_per_pod: placement.computed_tokens,
            pods_per_prefix: placement.pods_per_prefix,
            ttft_p90_runs_ms: Vec::new(),
            ttft_p90_warm_ms: phases.ttft_p90_warm_ms,
            ttft_p90_warm_runs_ms: Vec::new(),
            slowest: phases.slowest,
            slowest_in_cold_start: phases.slowest_in_cold_start,
            inflight_spread: phases.inflight_spread,
        };
        println!(
            "    TTFT p50 {:.1} ms, p90 {:.1} ms (after the cold start {:.1}); hits {:.1} %; {} errors; router CPU {:.2} s; per pod {:?}, computed {:?}; {:.1} pods per prefix",
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p90_warm_ms,
            r.prefix_hit_rate * 100.0,
            r.errors,
            r.router_cpu_s,
            r.requests_per_pod,
            r.computed_tokens_per_pod,
            r.pods_per_prefix
        );
        runs[k].push(r);
    }
    let errors = runs.iter().flatten().map(|r| r.errors).sum();
    let medians = runs
        .into_iter()
        .map(|mut rs| {
            rs.sort_by(|a, b| a.ttft_p90_ms.total_cmp(&b.ttft_p90_ms));
            let all: Vec<f64> = rs.iter().map(|r| r.ttft_p90_ms).collect();
            let mut warm: Vec<f64> = rs.iter().map(|r| r.ttft_p90_warm_ms).collect();
            warm.sort_by(f64::total_cmp);
            let slowest = rs.iter().map(|r| r.slowest).sum();
            let slowest_in_cold_start = rs.iter().map(|r| r.slowest_in_cold_start).sum();
            let inflight_spread = rs.iter().map(|r| r.inflight_spread).sum::<f64>() / rs.len() as f64;
            let mut median = rs.swap_remove(all.len() / 2);
            median.ttft_p90_runs_ms = all;
            median.ttft_p90_warm_runs_ms = warm;
            median.slowest = slowest;
            median.slowest_in_cold_start = slowest_in_cold_start;
            median.inflight_spread = inflight_spread;
            median
        })
        .collect();
    Ok((medians, errors, csv))
}

/// What a router adds in front of an instant pod at fixed concurrency.
#[derive(Clone, Debug, Serialize)]
struct OverheadResult {
    path: String,
    prompt: &'static str,
    latency_p50_ms: f64,
    latency_p90_ms: f64,
    added_p50_ms: f64,
    requests_per_s: f64,
    errors: usize,
}

async fn overhead(args: &Args, kinds: &[Kind]) -> anyhow::Result<Vec<OverheadResult>> {
    let tokenizer = qwen3_tokenizer();
    let tok = tokenizer.to_str().context("tokenizer path")?;
    let pod = Sim::start("instant", &["--tokenizer", tok, "--model", MODEL, "--time-scale", "0"]).await;
    let pods = std::slice::from_ref(&pod);
    let mut gateways = vec![("direct to the pod".to_string(), None)];
    for &kind in kinds {
        gateways.push((kind.label().to_string(), Some(start(kind, pods, args).await?)));
    }
    let client = reqwest::Client::new();
    let mut out = Vec::new();
    for (prompt, words) in [("short (≈30 tokens)", 10), ("long (≈8k tokens)", 2700)] {
        // Every request its own question after a shared text, each router its own requests
        // (as in kvgate-overhead): no router's cache of whole prompts is flattered.
        let document = text("overhead", words);
        let body = |n: usize| json!({"model": MODEL, "prompt": format!("{document} Question {n}?"), "max_tokens": 1});
        let mut direct_p50 = 0.0;
        for (g, (name, gateway)) in gateways.iter().enumerate() {
            let url = format!("{}/v1/completions", gateway.as_ref().map_or(pod.url.as_str(), |g| g.url.as_str()));
            let first = (g + 1) * 10_000_000;
            for i in 0..10 {
                send(&client, &url, &body(first + 9_000_000 + i)).await; // warm-up
            }
            let bodies = (first..first + args.overhead_requests).map(body).collect();
            let started = Instant::now();
            let measured = send_each(&client, &url, bodies, args.concurrency).await;
            let errors = measured.iter().filter(|m| m.status != 200).count();
            let mut latencies: Vec<Duration> = measured.iter().map(|m| m.total).collect();
            let wall = started.elapsed();
            let p50 = ms(percentile(&mut latencies, 0.5));
            if gateway.is_none() {
                direct_p50 = p50;
            }
            let r = OverheadResult {
                path: name.clone(),
                prompt,
                latency_p50_ms: p50,
                latency_p90_ms: ms(percentile(&mut latencies, 0.9)),
                added_p50_ms: p50 - direct_p50,
                requests_per_s: args.overhead_requests as f64 / wall.as_secs_f64(),
                errors,
            };
            println!(
                "  {prompt:<20} {name:<26} p50 {:>7.2} ms (+{:.2})  {:>7.0} req/s  {} errors",
                r.latency_p50_ms, r.added_p50_ms, r.requests_per_s, r.errors
            );
            out.push(r);
        }
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.pods >= 2 && args.concurrency >= 1, "--pods must be ≥ 2 and --concurrency ≥ 1");
    let kinds = kinds(&args)?; // before any pod starts
    kvgate_test_harness::quiet_children();
    let ticks = clock_ticks();
    let started = Instant::now();
    let requests = args.sessions * 6 + args.questions;
    println!(
        "Routing quality, live: {requests} requests ({} chat sessions × 6 turns over 6 system prompts, {} questions over 8 documents), {} in flight, {} pods of {} blocks at time scale {}",
        args.sessions, args.questions, args.concurrency, args.pods, args.num_blocks, args.time_scale
    );
    let (quality, quality_errors, requests_csv) = quality(&args, &kinds, ticks).await?;
    let overhead = if args.overhead_requests == 0 {
        Vec::new()
    } else {
        println!(
            "Overhead: one instant pod, {} requests per path and prompt at concurrency {}",
            args.overhead_requests, args.concurrency
        );
        overhead(&args, &kinds).await?
    };

    let mut md = format!(
        "Live side by side: {requests} requests, {} in flight, {} simulated pods ({} KV blocks, time scale {}) per router; {:.0} s wall in all.\n\n\
         The run with the median TTFT p90 of {} runs per router (interleaved) is shown; `p90 of each run` gives the spread. \
         `after the cold start`: the p90 of the requests sent after each run's first {:.1} s (its cold start: the fleet's caches start empty), \
         the median over the runs, then each run's. `slowest tenth in the cold start`: of the requests at or over their run's p90, over all runs, \
         those sent in the cold start. `in-flight spread`: after the cold start, the busiest pod's requests in flight less the idlest's \
         at each request's sending, averaged over all runs. kvgate's policy: `{}`{}.\n\n\
         | router | TTFT p50 | TTFT p90 | p90 of each run | p90 after the cold start | slowest tenth in the cold start | in-flight spread | latency p50 | latency p90 | req/s | output tok/s | prefix hits | requests per pod | prompt tokens computed per pod | pods per prefix | errors | router CPU (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        args.concurrency,
        args.pods,
        args.num_blocks,
        args.time_scale,
        started.elapsed().as_secs_f64(),
        args.repeat.max(1),
        cold_start(&args).as_secs_f64(),
        args.kvgate_policy,
        args.kvgate_variant.as_ref().map_or(String::new(), |v| format!("; `--kvgate-variant`: `{v}`"))
    );
    for r in &quality {
        md.push_str(&format!(
            "| {} | {:.1} ms | {:.1} ms | {} | {:.1} ms ({}) | {} of {} | {:.1} | {:.1} ms | {:.1} ms | {:.1} | {:.0} | {:.1} % | {:?} | {:?} | {:.1} | {} | {:.2} |\n",
            r.label,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            runs(&r.ttft_p90_runs_ms),
            r.ttft_p90_warm_runs_ms[r.ttft_p90_warm_runs_ms.len() / 2],
            runs(&r.ttft_p90_warm_runs_ms),
            r.slowest_in_cold_start,
            r.slowest,
            r.inflight_spread,
            r.latency_p50_ms,
            r.latency_p90_ms,
            r.requests_per_s,
            r.output_tokens_per_s,
            r.prefix_hit_rate * 100.0,
            r.requests_per_pod,
            r.computed_tokens_per_pod,
            r.pods_per_prefix,
            r.errors,
            r.router_cpu_s
        ));
    }
    if !overhead.is_empty() {
        md.push_str(&format!(
        "\nOverhead (one instant pod, {} requests per path and prompt, {} in flight, non-streaming, one output token):\n\n\
         | prompt | path | latency p50 | p90 | added p50 | req/s | errors |\n|---|---|---|---|---|---|---|\n",
        args.overhead_requests, args.concurrency
    ));
        for r in &overhead {
            md.push_str(&format!(
                "| {} | {} | {:.2} ms | {:.2} ms | {:+.2} ms | {:.0} | {} |\n",
                r.prompt, r.path, r.latency_p50_ms, r.latency_p90_ms, r.added_p50_ms, r.requests_per_s, r.errors
            ));
        }
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let bars: Vec<(String, f64, f64)> =
        quality.iter().map(|r| (r.label.to_string(), r.ttft_p50_ms, r.ttft_p90_ms)).collect();
    std::fs::write(
        args.out.join("ttft.svg"),
        svg_bars(&format!("live: {requests} requests, {} pods", args.pods), &bars),
    )?;
    let json = json!({"quality": quality, "overhead": overhead});
    std::fs::write(args.out.join("results.json"), serde_json::to_string_pretty(&json)?)?;
    std::fs::write(args.out.join("results.md"), &md)?;
    std::fs::write(args.out.join("requests.csv"), requests_csv)?;
    println!("\n{md}\nwrote {}/results.{{json,md}}, ttft.svg and requests.csv", args.out.display());
    let errors = quality_errors + overhead.iter().map(|r| r.errors).sum::<usize>();
    anyhow::ensure!(errors == 0, "{errors} requests failed");
    Ok(())
}
