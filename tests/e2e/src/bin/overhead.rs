//! `kvgate-overhead` (`make bench-overhead`): what each way into kvgate adds to a request.
//!
//! One simulated pod whose engine takes almost no time (so the figures are the gateway's),
//! reached five ways: directly; through Envoy round robin (no kvgate); through Envoy with the
//! kvgate wasm filter and its scorer sidecar; through Envoy with the scorer's Endpoint Picker
//! over ext_proc (the bootstrap's default mode), in plain h2c and in TLS. For each prompt size and concurrency the paths run in interleaved rounds
//! (the order rotating each round) so the shared machine's noise hits all alike. Short (≈30
//! tokens) and long (≈8k tokens) prompts at 1 and 24 in flight, a chat whose ≈8k-token history
//! every request resends with a new last turn, and a 220 kB prompt at 64 in flight — the case
//! where llm-d's picker adds over a second. Non-streaming, one output token. Every request's
//! prompt is its own, and each path gets its own prompts (two paths share a scorer): the
//! completions prompts end with the request's own question (no cache of whole prompts helps;
//! the pod's prefix cache and the scorer's cache of pieces do, as with many questions on one
//! document), the chats resend a shared history (as conversations do), and the `long-new`
//! prompts differ from their first word (every block is new: the pod computes and the scorer
//! indexes ≈ 500 new blocks per request; the scorer's cache of pieces still reads the text
//! after the question back).

use clap::Parser;
use kvgate_e2e::collector::Collector;
use kvgate_e2e::{ms, percentile, send, send_each};
use kvgate_test_harness::{Build, EPP_PORT, EnvoyProcess, ScorerProcess, Sim, cpu_time, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Requests per path and cell (prompt size × concurrency).
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Rounds each cell's requests are split into (paths alternate between rounds).
    #[arg(long, default_value_t = 8)]
    rounds: usize,
    /// Only these cells, e.g. `short@1,long@24,long-new@24,chat@24,220kB@64` (all by default).
    #[arg(long, value_delimiter = ',')]
    cells: Vec<String>,
    /// The Endpoint Picker paths' ext_proc body mode (`kvgate-envoy-config --epp-body-mode`).
    #[arg(long, default_value = "streamed", value_parser = ["streamed", "buffered", "full-duplex"])]
    epp_body_mode: String,
    /// Only these paths (`direct`, `rr`, `wasm`, `native`, `epp`, `epp-tls`; all by default) — for
    /// profiling one path at a time (`make profile`).
    #[arg(long, value_delimiter = ',', value_parser = ["direct", "rr", "wasm", "native", "native-tcp", "epp", "epp-tls", "wasm-base", "native-base", "epp-base", "wasm-traced", "native-traced", "epp-traced"])]
    paths: Vec<String>,
    /// Samples the gateway's processes (Envoy and the scorer) with `perf record` into this
    /// file while the measured rounds run (one path with a scorer, one cell; `make profile`).
    #[arg(long)]
    perf: Option<std::path::PathBuf>,
    /// An earlier build to measure beside this one, in the same rounds: a directory holding
    /// its `kvgate-scorer`, `kvgate_filter.wasm` and `libkvgate_filter_native.so`. Adds the
    /// paths `wasm-base`, `native-base` and `epp-base` (its scorer, its filters).
    #[arg(long)]
    baseline: Option<std::path::PathBuf>,
    /// This build again with traces on, new traces sampled at this ratio (the scorer's
    /// `traces.sample_ratio`, which the gateway's tracer takes too), exported to an OTLP
    /// receiver in this process. Adds the paths `wasm-traced`, `native-traced` and
    /// `epp-traced`.
    #[arg(long)]
    traces: Option<f64>,
}

/// A prompt size: its label, its cell name, the words of its text, and its shape.
struct Prompt {
    label: &'static str,
    name: &'static str,
    words: usize,
    shape: Shape,
}

/// Where a request's own words go.
#[derive(PartialEq)]
enum Shape {
    /// A completions prompt ending with the request's own question.
    OwnEnd,
    /// A completions prompt that is the request's own from its first word.
    OwnStart,
    /// A chat: the shared history, then the request's own question.
    Chat,
}

const PROMPTS: [Prompt; 5] = [
    Prompt { label: "short (≈30 tokens)", name: "short", words: 10, shape: Shape::OwnEnd },
    Prompt { label: "long (≈8k tokens)", name: "long", words: 2700, shape: Shape::OwnEnd },
    Prompt { label: "long, every block new (≈8k tokens)", name: "long-new", words: 2700, shape: Shape::OwnStart },
    Prompt { label: "chat (≈8k-token history, new turn)", name: "chat", words: 2700, shape: Shape::Chat },
    // 220 kB of text (≈ 55k tokens).
    Prompt { label: "220 kB (≈55k tokens)", name: "220kB", words: 22_000, shape: Shape::OwnEnd },
];

/// Turns of the chat prompt's history (user and assistant alternating), before its new turn.
const CHAT_HISTORY_TURNS: usize = 8;

impl Prompt {
    /// The API path and body of request `n`.
    fn request(&self, n: usize) -> (&'static str, Value) {
        let question = format!("Question {n}: what does part {} say?", n % 7);
        if self.shape != Shape::Chat {
            let text = text("overhead", self.words);
            let prompt = match self.shape {
                Shape::OwnStart => format!("{question} {text}"),
                _ => format!("{text} {question}"),
            };
            return ("/v1/completions", json!({"prompt": prompt, "max_tokens": 1}));
        }
        let turn_words = self.words / CHAT_HISTORY_TURNS;
        let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant."})];
        for turn in 0..CHAT_HISTORY_TURNS {
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": text(&format!("turn{turn}x"), turn_words)}));
        }
        messages.push(json!({"role": "user", "content": question}));
        ("/v1/chat/completions", json!({"messages": messages, "max_tokens": 1}))
    }
}

/// (prompt index, in flight).
const CELLS: [(usize, usize); 7] = [(0, 1), (0, 24), (1, 1), (1, 24), (2, 24), (3, 24), (4, 64)];

/// Request numbers of path `k`'s requests start here (paths never send the same prompt).
fn first_request(path: usize) -> usize {
    (path + 1) * 10_000_000
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.rounds >= 1 && args.requests >= args.rounds, "--requests must be ≥ --rounds ≥ 1");
    kvgate_test_harness::quiet_children();
    let tokenizer = qwen3_tokenizer();
    // An instant engine (time scale 0: its steps run back to back, nothing is slept), with
    // room for 220 kB prompts. A paced one at a tiny scale would wait for tokio's
    // millisecond timer ticks between steps — a 1 kHz batch clock that sets every path's
    // latency and hides what the gateway costs.
    let pod = Sim::start(
        "pod-1",
        &["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0", "--max-model-len", "262144"],
    )
    .await;
    let route_socket = std::env::temp_dir().join(format!("kvgate-overhead-{}.sock", std::process::id()));
    let config = format!(
        "tokenizer: {}\nroute_socket_path: {}\nepp: {{listen: '127.0.0.1:{EPP_PORT}'}}\npods:\n  - {{name: pod-1, address: '127.0.0.1:{}', kv_events: '{}'}}\n",
        tokenizer.display(),
        route_socket.display(),
        pod.port,
        pod.events
    );
    let scorer = ScorerProcess::start(&config).await;
    // The picker as a sidecar speaks plain h2c on loopback (as the filter's route stream does);
    // as its own Deployment, TLS (the default): both are measured.
    let plaintext = ScorerProcess::start(
        &config
            .replace(&format!("route_socket_path: {}\n", route_socket.display()), "")
            .replace("'}\npods:", "', tls: {mode: plaintext}}\npods:"),
    )
    .await;
    let wasm = EnvoyProcess::start(&scorer, &["--picker", "wasm"]).await;
    let native = EnvoyProcess::start(&scorer, &["--picker", "native"]).await;
    let unix = format!("unix:{}", route_socket.display());
    let tcp = scorer.url.trim_start_matches("http://").to_string();
    let native_tcp =
        EnvoyProcess::start_patched(&scorer.config_path, &["--picker", "native"], |b| b.replace(&unix, &tcp)).await;
    let epp_tls = EnvoyProcess::start(&scorer, &["--picker", "epp", "--epp-body-mode", &args.epp_body_mode]).await;
    let epp = EnvoyProcess::start(&plaintext, &["--picker", "epp", "--epp-body-mode", &args.epp_body_mode]).await;
    let baseline = EnvoyProcess::start(&scorer, &["--picker", "none"]).await;
    // An earlier build beside this one: its scorers (one with the route socket path, one
    // plaintext picker, as above) and its filters.
    let earlier = match &args.baseline {
        Some(dir) => {
            let build = Build::in_dir(dir);
            let unix = format!("route_socket_path: {}\n", route_socket.display());
            let unix_base = format!("route_socket_path: {}-base\n", route_socket.display());
            let scorer = ScorerProcess::start_built(&config.replace(&unix, &unix_base), &build).await;
            let plaintext = ScorerProcess::start_built(
                &config.replace(&unix, "").replace("'}\npods:", "', tls: {mode: plaintext}}\npods:"),
                &build,
            )
            .await;
            let wasm = EnvoyProcess::start_built(&scorer, &["--picker", "wasm"], &build).await;
            let native = EnvoyProcess::start_built(&scorer, &["--picker", "native"], &build).await;
            let args = ["--picker", "epp", "--epp-body-mode", args.epp_body_mode.as_str()];
            let epp = EnvoyProcess::start_built(&plaintext, &args, &build).await;
            Some((scorer, plaintext, wasm, native, epp))
        }
        None => None,
    };
    // This build with traces on: its scorers and Envoys rendered from a configuration with a
    // `traces` section (the gateway's tracer on too), exporting to a receiver here.
    let collector = match args.traces {
        Some(_) => Some(Collector::start().await),
        None => None,
    };
    let traced = match (args.traces, &collector) {
        (Some(ratio), Some(collector)) => {
            let traces = format!("traces: {{otlp_endpoint: '{}', sample_ratio: {ratio}}}\n", collector.endpoint);
            let unix = format!("route_socket_path: {}\n", route_socket.display());
            let unix_traced = format!("route_socket_path: {}-traced\n", route_socket.display());
            let scorer = ScorerProcess::start(&(traces.clone() + &config.replace(&unix, &unix_traced))).await;
            let plaintext = ScorerProcess::start(
                &(traces + &config.replace(&unix, "").replace("'}\npods:", "', tls: {mode: plaintext}}\npods:")),
            )
            .await;
            let wasm = EnvoyProcess::start(&scorer, &["--picker", "wasm"]).await;
            let native = EnvoyProcess::start(&scorer, &["--picker", "native"]).await;
            let epp =
                EnvoyProcess::start(&plaintext, &["--picker", "epp", "--epp-body-mode", &args.epp_body_mode]).await;
            Some((scorer, plaintext, wasm, native, epp))
        }
        _ => None,
    };
    let path = |key, name, url: &str, envoy: Option<&EnvoyProcess>, scorer: Option<&ScorerProcess>| Path {
        key,
        name,
        url: url.to_string(),
        envoy: envoy.map(|e| e.pid()),
        scorer: scorer.map(|s| s.pid()),
        pod: pod.pid(),
    };
    let paths: Vec<Path> = [
        path("direct", "direct to the pod", &pod.url, None, None),
        path("rr", "Envoy round robin", &baseline.url, Some(&baseline), None),
        path("wasm", "Envoy + kvgate (wasm filter)", &wasm.url, Some(&wasm), Some(&scorer)),
        path("native", "Envoy + kvgate (native module)", &native.url, Some(&native), Some(&scorer)),
        path("native-tcp", "Envoy + kvgate (native module, TCP)", &native_tcp.url, Some(&native_tcp), Some(&scorer)),
        path("epp", "Envoy + kvgate (Endpoint Picker, h2c)", &epp.url, Some(&epp), Some(&plaintext)),
        path("epp-tls", "Envoy + kvgate (Endpoint Picker, TLS)", &epp_tls.url, Some(&epp_tls), Some(&scorer)),
    ]
    .into_iter()
    .chain(earlier.iter().flat_map(|(scorer, plaintext, wasm, native, epp)| {
        [
            path("wasm-base", "Envoy + kvgate (wasm filter), baseline", &wasm.url, Some(wasm), Some(scorer)),
            path("native-base", "Envoy + kvgate (native module), baseline", &native.url, Some(native), Some(scorer)),
            path("epp-base", "Envoy + kvgate (Endpoint Picker, h2c), baseline", &epp.url, Some(epp), Some(plaintext)),
        ]
    }))
    .chain(traced.iter().flat_map(|(scorer, plaintext, wasm, native, epp)| {
        [
            path("wasm-traced", "Envoy + kvgate (wasm filter), traced", &wasm.url, Some(wasm), Some(scorer)),
            path("native-traced", "Envoy + kvgate (native module), traced", &native.url, Some(native), Some(scorer)),
            path("epp-traced", "Envoy + kvgate (Endpoint Picker, h2c), traced", &epp.url, Some(epp), Some(plaintext)),
        ]
    }))
    .filter(|p| args.paths.is_empty() || args.paths.iter().any(|k| k == p.key))
    .collect();
    anyhow::ensure!(!paths.is_empty(), "no path matches --paths {:?}", args.paths);
    let cells: Vec<(usize, usize)> = CELLS
        .into_iter()
        .filter(|(p, c)| args.cells.is_empty() || args.cells.contains(&format!("{}@{c}", PROMPTS[*p].name)))
        .collect();
    anyhow::ensure!(!cells.is_empty(), "no cell matches --cells {:?}", args.cells);
    anyhow::ensure!(
        args.perf.is_none() || (cells.len() == 1 && paths.len() == 1 && paths[0].scorer.is_some()),
        "--perf samples one cell of one path through a scorer"
    );
    println!(
        "kvgate overhead: {} requests per path and cell in {} interleaved rounds; one instant pod (simulator at time scale 0)",
        args.requests, args.rounds
    );
    let client = reqwest::Client::new();
    let mut table = String::from(
        "| prompt | in flight | path | latency p50 | p90 | added p50 | req/s |\n|---|---|---|---|---|---|---|\n",
    );
    let mut cpu_table = String::from(
        "| prompt | in flight | path | client | Envoy | scorer | pod | gateway (Envoy + scorer) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (p, in_flight) in cells {
        let prompt = &PROMPTS[p];
        for (k, path) in paths.iter().enumerate() {
            for i in 0..5 {
                let (api, body) = prompt.request(first_request(k) + 9_000_000 + i);
                let m = send(&client, &format!("{}{api}", path.url), &body).await; // warm-up
                anyhow::ensure!(m.status == 200, "{} answered {} to the warm-up", path.url, m.status);
            }
        }
        let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(args.requests); paths.len()];
        let mut busy = vec![Duration::ZERO; paths.len()];
        let mut cpu = vec![[Duration::ZERO; 4]; paths.len()];
        let per_round = args.requests / args.rounds;
        let perf = match &args.perf {
            Some(file) => Some(PerfRecord::start(file, &paths)?),
            None => None,
        };
        for round in 0..args.rounds {
            for k in (0..paths.len()).map(|i| (i + round) % paths.len()) {
                let first = first_request(k) + round * per_round;
                let requests: Vec<(&str, Value)> = (first..first + per_round).map(|n| prompt.request(n)).collect();
                let url = format!("{}{}", paths[k].url, requests[0].0);
                let bodies = requests.into_iter().map(|(_, body)| body).collect();
                let cpu_before = paths[k].cpu();
                let started = Instant::now();
                let measured = send_each(&client, &url, bodies, in_flight).await;
                busy[k] += started.elapsed();
                samples[k].extend(measured.iter().map(|m| m.total));
                let statuses: Vec<u16> = measured.iter().map(|m| m.status).collect();
                for (total, (after, before)) in cpu[k].iter_mut().zip(paths[k].cpu().into_iter().zip(cpu_before)) {
                    *total += after.saturating_sub(before);
                }
                anyhow::ensure!(statuses.iter().all(|&s| s == 200), "{} failed: {statuses:?}", paths[k].name);
            }
            eprintln!("    {} at {in_flight} in flight: round {}/{}", prompt.label, round + 1, args.rounds);
        }
        if let Some(perf) = perf {
            perf.stop()?;
        }
        let p50: Vec<Duration> = samples.iter_mut().map(|s| percentile(s, 0.5)).collect();
        let sent = (per_round * args.rounds) as f64;
        for (k, path) in paths.iter().enumerate() {
            let name = path.name;
            let p90 = percentile(&mut samples[k], 0.9);
            let added = match paths[0].key == "direct" && k > 0 {
                true => format!("+{}", ms(p50[k].saturating_sub(p50[0]))),
                false => String::new(),
            };
            let rate = sent / busy[k].as_secs_f64();
            table.push_str(&format!(
                "| {} | {in_flight} | {name} | {} | {} | {added} | {rate:.0} |\n",
                prompt.label,
                ms(p50[k]),
                ms(p90)
            ));
            let per_request = |d: Duration| d.as_secs_f64() * 1e6 / sent;
            let [client_cpu, envoy_cpu, scorer_cpu, pod_cpu] = cpu[k].map(per_request);
            let shown = |us: f64, present: bool| if present { format!("{us:.0} µs") } else { "–".into() };
            cpu_table.push_str(&format!(
                "| {} | {in_flight} | {name} | {} | {} | {} | {} | {} |\n",
                prompt.label,
                shown(client_cpu, true),
                shown(envoy_cpu, path.envoy.is_some()),
                shown(scorer_cpu, path.scorer.is_some()),
                shown(pod_cpu, true),
                shown(envoy_cpu + scorer_cpu, path.envoy.is_some()),
            ));
        }
    }
    println!("\n{table}");
    println!("CPU time per request, by process (every thread; /proc schedstat):\n\n{cpu_table}");
    println!("The scorers' state lock over the whole run (absent from builds without the metric):\n");
    println!("| scorer | decisions | waits for the lock | time waited |\n|---|---|---|---|");
    let mut scorers = vec![("filters' (route stream, route socket)", &scorer), ("Endpoint Picker's (h2c)", &plaintext)];
    if let Some((scorer, plaintext, ..)) = &earlier {
        scorers.extend([("baseline: filters'", scorer), ("baseline: Endpoint Picker's", plaintext)]);
    }
    for (name, s) in scorers {
        let decisions = s
            .metrics_text()
            .await
            .lines()
            .filter(|l| l.starts_with("kvgate_decisions_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        let (waits, waited) =
            (s.metric("kvgate_state_lock_waits_total").await, s.metric("kvgate_state_lock_wait_seconds_sum").await);
        println!("| {name} | {decisions:.0} | {waits:.0} | {:.1} ms |", waited * 1e3);
    }
    Ok(())
}

/// One way to the pod, and the processes whose CPU a request on it costs.
struct Path {
    key: &'static str,
    name: &'static str,
    url: String,
    envoy: Option<u32>,
    scorer: Option<u32>,
    pod: u32,
}

impl Path {
    /// CPU used so far by the client (this process), Envoy, the scorer and the pod (zero
    /// for a process the path does not have).
    fn cpu(&self) -> [Duration; 4] {
        [Some(std::process::id()), self.envoy, self.scorer, Some(self.pod)]
            .map(|pid| pid.map(cpu_time).unwrap_or_default())
    }
}

/// `perf record` of a path's Envoy and scorer, with DWARF call graphs (release builds keep
/// no frame pointers).
struct PerfRecord(std::process::Child);

impl PerfRecord {
    fn start(file: &std::path::Path, paths: &[Path]) -> anyhow::Result<PerfRecord> {
        let pids: Vec<String> = [paths[0].envoy, paths[0].scorer].iter().flatten().map(u32::to_string).collect();
        let child = std::process::Command::new("perf")
            .args(["record", "-q", "-F", "499", "--call-graph", "dwarf,16384", "-p", &pids.join(","), "-o"])
            .arg(file)
            .stdout(std::process::Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot run perf (make profile installs it): {e}"))?;
        std::thread::sleep(Duration::from_millis(500)); // perf attaches
        Ok(PerfRecord(child))
    }

    fn stop(mut self) -> anyhow::Result<()> {
        let status = std::process::Command::new("kill").args(["-INT", &self.0.id().to_string()]).status()?;
        anyhow::ensure!(status.success(), "cannot stop perf");
        let status = self.0.wait()?;
        // perf writes its file on SIGINT, then ends by it.
        use std::os::unix::process::ExitStatusExt;
        anyhow::ensure!(status.success() || status.signal() == Some(2), "perf record failed: {status}");
        Ok(())
    }
}
