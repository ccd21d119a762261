//! `kvgate-chaos` (`make chaos`): faults one after the other under a steady streaming load
//! through the real stack — simulated pods, the scorer, Envoy with the kvgate filter or the
//! Endpoint Picker — and one line per phase: the requests that started in it, how each
//! ended as its client saw it, and how long until the scorer's health and index were right
//! again. Exits non-zero when a fault cost a client error it should not have.
//!
//! Phases: steady; scorer killed (restarted after 3 s); scorer frozen 3 s; a pod killed
//! (`kill -9`); that pod back after 10 s with an empty cache; garbage on every event
//! socket; a burst of 5× the fleet's capacity with sheddable requests in it.

use clap::Parser;
use futures::StreamExt;
use kvgate_e2e::{has_generated_text, percentile};
use kvgate_test_harness::{EPP_PORT, EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Which way into kvgate: `wasm` (the filter), `epp` (the Endpoint Picker) or `both`.
    #[arg(long, default_value = "both", value_parser = ["wasm", "epp", "both"])]
    picker: String,
    /// Steady load: requests started per second.
    #[arg(long, default_value_t = 16)]
    rate: u64,
    /// Length of each phase.
    #[arg(long, default_value_t = 10)]
    phase_seconds: u64,
    /// Where the report goes (`chaos-<picker>.md`).
    #[arg(long, default_value = "target/chaos")]
    out: std::path::PathBuf,
}

const PODS: usize = 4;
/// Requests a pod runs at once (the engine's `--max-num-seqs`, and kvgate's admission
/// limit): the fleet's capacity is `PODS × SLOTS` requests in flight.
const SLOTS: usize = 8;
/// Longest a request may take before it counts as hung.
const HANG: Duration = Duration::from_secs(60);

/// How one request ended, as its client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    /// 429: refused for overload (`Retry-After`).
    Shed,
    /// An error status before any byte of an answer (e.g. Envoy's 503).
    ErrorStatus(u16),
    /// No HTTP answer at all (connection reset or refused).
    NoAnswer,
    /// The answer began (status 200), then its stream broke.
    Cut,
    /// No end within [`HANG`].
    Hung,
}

struct Record {
    phase: usize,
    objective: &'static str,
    /// Streamed: `ttft` is the time to the first token (else to the whole answer).
    stream: bool,
    outcome: Outcome,
    ttft: Duration,
}

type Records = Arc<Mutex<Vec<Record>>>;

async fn request(client: &reqwest::Client, url: &str, body: &Value, objective: &str) -> (Outcome, Duration) {
    let start = Instant::now();
    let stream = body["stream"] == true;
    let run = async {
        let response = match client.post(url).header("x-gateway-inference-objective", objective).json(body).send().await
        {
            Ok(r) => r,
            Err(_) => return (Outcome::NoAnswer, start.elapsed()),
        };
        match response.status().as_u16() {
            200 => {}
            429 => return (Outcome::Shed, start.elapsed()),
            status => return (Outcome::ErrorStatus(status), start.elapsed()),
        }
        let (mut buffer, mut ttft) = (Vec::new(), None);
        let mut chunks = response.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            let Ok(chunk) = chunk else { return (Outcome::Cut, start.elapsed()) };
            buffer.extend_from_slice(&chunk);
            if ttft.is_none() && has_generated_text(&buffer) {
                ttft = Some(start.elapsed());
            }
        }
        let complete = if stream {
            buffer.ends_with(b"data: [DONE]\n\n")
        } else {
            serde_json::from_slice::<Value>(&buffer).is_ok_and(|v| v["choices"].is_array())
        };
        let ttft = ttft.unwrap_or_else(|| start.elapsed());
        (if complete { Outcome::Ok } else { Outcome::Cut }, ttft)
    };
    tokio::time::timeout(HANG, run).await.unwrap_or((Outcome::Hung, HANG))
}

/// The steady workload: chat over a few shared system prompts (most of it) and unique
/// prompts; three in four stream.
fn steady_body(n: u64, systems: &[String]) -> (&'static str, Value) {
    let stream = !n.is_multiple_of(4);
    if n.is_multiple_of(5) {
        let body =
            json!({"prompt": text(&format!("a unique question number {n}"), 150), "max_tokens": 96, "stream": stream});
        ("/v1/completions", body)
    } else {
        let system = &systems[(n % systems.len() as u64) as usize];
        let body = json!({"messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": format!("question {n}: what now?")}],
                          "max_tokens": 96, "stream": stream});
        ("/v1/chat/completions", body)
    }
}

/// The scorer's view of every pod next to the engines' own: healthy as expected, and an
/// index within a few blocks of what each live engine caches (events in flight aside).
async fn index_right(scorer: &ScorerProcess, pods: &[Sim]) -> bool {
    let Ok(response) = reqwest::get(format!("{}/v1/pods", scorer.url)).await else { return false };
    let Ok(view) = response.json::<Vec<Value>>().await else { return false };
    for pod in pods {
        let Some(v) = view.iter().find(|v| v["name"] == pod.pod_id.as_str()) else { return false };
        if v["healthy"] != true {
            return false;
        }
        let Some(engine) = engine_blocks(pod).await else { return false };
        let indexed = v["cached_blocks"].as_f64().unwrap_or(-1.0);
        if (indexed - engine).abs() > (engine * 0.02).max(8.0) {
            return false;
        }
    }
    true
}

async fn engine_blocks(pod: &Sim) -> Option<f64> {
    let text = reqwest::get(format!("{}/metrics", pod.url)).await.ok()?.text().await.ok()?;
    text.lines().find(|l| l.starts_with("kvgate_sim:cached_blocks{"))?.rsplit(' ').next()?.parse().ok()
}

/// Polls `check` every 50 ms for up to `limit`: how long it took to hold.
async fn until<F: std::future::Future<Output = bool>>(
    limit: Duration,
    mut check: impl FnMut() -> F,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Where the run stands: requests started and ended, bookings the scorer holds.
async fn progress(scorer: &ScorerProcess, records: &Records, started: &AtomicUsize) {
    let booked: u64 = match reqwest::get(format!("{}/v1/pods", scorer.url)).await {
        Ok(r) => r
            .json::<Vec<Value>>()
            .await
            .unwrap_or_default()
            .iter()
            .map(|p| p["inflight_requests"].as_u64().unwrap_or(0))
            .sum(),
        Err(_) => 0,
    };
    let done = records.lock().unwrap().len();
    let started = started.load(Ordering::Relaxed);
    println!(
        "        steady load: {started} started, {} in flight; the scorer books {booked}",
        started.saturating_sub(done)
    );
}

/// How long until the scorer's view is right (see [`index_right`]), within `limit`.
async fn right(scorer: &ScorerProcess, pods: &[Sim], limit: Duration) -> Option<Duration> {
    until(limit, || index_right(scorer, pods)).await
}

fn secs(d: Option<Duration>) -> String {
    d.map_or("never".into(), |d| format!("{:.2} s", d.as_secs_f64()))
}

struct Phase {
    name: &'static str,
    /// What the phase must cost the clients, checked at the end.
    rule: Rule,
    recovery: String,
}

#[derive(Clone, Copy, PartialEq)]
enum Rule {
    /// Nothing may fail.
    NoError,
    /// Only answers already under way on the killed pod may break.
    OnlyCutStreams,
    /// Only 429s (overload) — and every sheddable request refused at once.
    OnlyShed,
}

async fn run(args: &Args, picker: &str) -> anyhow::Result<(String, bool)> {
    let tokenizer = qwen3_tokenizer();
    let tok = tokenizer.to_str().unwrap();
    let slots = SLOTS.to_string();
    println!("[{picker}] starting {PODS} pods, the scorer and Envoy ({picker} path)");
    let mut pods = Vec::new();
    for i in 0..PODS {
        let flags = ["--tokenizer", tok, "--time-scale", "1", "--max-num-seqs", &slots, "--num-blocks", "6000"];
        pods.push(Sim::start(&format!("pod-{i}"), &flags).await);
    }
    let mut config = format!(
        "tokenizer: {tok}\n\
         health: {{scrape_interval_ms: 250}}\n\
         epp: {{listen: '127.0.0.1:{EPP_PORT}'}}\n\
         admission: {{max_inflight_requests: {SLOTS}, headroom: 0.25, max_wait_ms: 15000, queue_limit: 4096, \
         objectives: {{interactive: 10, standard: 0, batch: -1}}}}\n\
         pods:\n"
    );
    for p in &pods {
        config.push_str(&format!(
            "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', kv_events_replay: '{}', metrics: '{}/metrics'}}\n",
            p.pod_id, p.port, p.events, p.replay, p.url
        ));
    }
    let mut scorer = ScorerProcess::start(&config).await;
    let envoy_flags: &[&str] = if picker == "epp" { &["--picker", "epp"] } else { &[] };
    let envoy = EnvoyProcess::start(&scorer, envoy_flags).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The steady load, tagged with the phase it starts in.
    let records: Records = Arc::default();
    let phase_now = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let client = reqwest::Client::new();
    let load = {
        let (records, phase_now, stop, client, base, started) =
            (records.clone(), phase_now.clone(), stop.clone(), client.clone(), envoy.url.clone(), started.clone());
        let rate = args.rate.max(1);
        tokio::spawn(async move {
            let systems: Vec<String> = (0..6).map(|i| text(&format!("chaos system prompt {i}"), 250)).collect();
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
            let mut tasks = tokio::task::JoinSet::new();
            let mut n = 0u64;
            while stop.load(Ordering::Relaxed) == 0 {
                tick.tick().await;
                n += 1;
                let (path, body) = steady_body(n, &systems);
                let (records, client, url) = (records.clone(), client.clone(), format!("{base}{path}"));
                let phase = phase_now.load(Ordering::Relaxed);
                started.fetch_add(1, Ordering::Relaxed);
                tasks.spawn(async move {
                    let stream = body["stream"] == true;
                    let (outcome, ttft) = request(&client, &url, &body, "interactive").await;
                    records.lock().unwrap().push(Record { phase, objective: "interactive", stream, outcome, ttft });
                });
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    };

    let phase_time = Duration::from_secs(args.phase_seconds);
    let mut phases: Vec<Phase> = Vec::new();
    let begin = |phases: &mut Vec<Phase>, name: &'static str, rule: Rule| {
        phase_now.store(phases.len(), Ordering::Relaxed);
        println!("[{picker}] phase {}: {name}", phases.len() + 1);
        phases.push(Phase { name, rule, recovery: String::new() });
        Instant::now()
    };
    let rest = |since: Instant| tokio::time::sleep(phase_time.saturating_sub(since.elapsed()));

    // 1. Steady: the yardstick.
    let t = begin(&mut phases, "steady", Rule::NoError);
    rest(t).await;
    progress(&scorer, &records, &started).await;
    phases.last_mut().unwrap().recovery =
        format!("index right: {}", secs(right(&scorer, &pods, Duration::from_secs(5)).await));

    // 2. The scorer killed, restarted 3 s later.
    let t = begin(&mut phases, "scorer killed (back after 3 s)", Rule::NoError);
    scorer.kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    scorer.restart().await;
    let back = right(&scorer, &pods, Duration::from_secs(10)).await;
    phases.last_mut().unwrap().recovery = format!("index and health right {} after its restart", secs(back));
    rest(t).await;
    progress(&scorer, &records, &started).await;

    // 3. The scorer frozen 3 s (SIGSTOP): Envoy's calls time out.
    let t = begin(&mut phases, "scorer frozen 3 s", Rule::NoError);
    scorer.pause();
    tokio::time::sleep(Duration::from_secs(3)).await;
    scorer.resume();
    let back = right(&scorer, &pods, Duration::from_secs(10)).await;
    phases.last_mut().unwrap().recovery = format!("index and health right {} after it thawed", secs(back));
    rest(t).await;
    progress(&scorer, &records, &started).await;

    // 4. A pod killed (-9) and kept down: out of the choice at once; its requests that had
    //    not begun answering are retried on the next pod.
    let victim = PODS - 1;
    let t = begin(&mut phases, "pod killed (kill -9)", Rule::OnlyCutStreams);
    tokio::time::sleep(Duration::from_secs(2)).await;
    pods[victim].kill();
    let killed = Instant::now();
    let out = until(Duration::from_secs(10), || async {
        scorer.pods().await.iter().any(|p| p["name"] == pods[victim].pod_id.as_str() && p["healthy"] == false)
    })
    .await;
    phases.last_mut().unwrap().recovery = format!("out of the choice {} after the kill", secs(out));
    rest(t).await;
    progress(&scorer, &records, &started).await;

    // 5. The pod back 10 s after its death, with an empty cache.
    let t = begin(&mut phases, "pod back after 10 s (empty cache)", Rule::NoError);
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(killed.elapsed())).await;
    pods[victim].restart().await;
    let healthy = until(Duration::from_secs(10), || async {
        scorer.pods().await.iter().any(|p| p["name"] == pods[victim].pod_id.as_str() && p["healthy"] == true)
    })
    .await;
    let indexed = right(&scorer, &pods, Duration::from_secs(10)).await.map(|d| d + healthy.unwrap_or_default());
    phases.last_mut().unwrap().recovery =
        format!("healthy {} after its return, index right {} after", secs(healthy), secs(indexed));
    let pod_back_index = indexed;
    rest(t).await;
    progress(&scorer, &records, &started).await;

    // 6. Garbage on every event socket, between real batches.
    let t = begin(&mut phases, "garbage on the event sockets", Rule::NoError);
    let errors_before = scorer.metric("kvgate_kv_event_decode_errors_total").await;
    const GARBAGE: usize = 100;
    for p in &pods {
        p.post_json("/sim/kv_events/garbage", &json!({"messages": GARBAGE})).await;
    }
    let expected = (GARBAGE * PODS) as f64;
    let counted = until(Duration::from_secs(10), || async {
        scorer.metric("kvgate_kv_event_decode_errors_total").await - errors_before >= expected
    })
    .await;
    let dropped = scorer.metric("kvgate_kv_event_decode_errors_total").await - errors_before;
    let back = right(&scorer, &pods, Duration::from_secs(10)).await;
    phases.last_mut().unwrap().recovery = format!(
        "{dropped:.0} of {expected:.0} malformed messages counted and dropped{}; index right {}",
        if counted.is_some() { String::new() } else { " (the rest lost in the sockets' queues)".into() },
        secs(back)
    );
    rest(t).await;
    progress(&scorer, &records, &started).await;

    // 7. A burst of 5× the fleet's capacity of ordinary requests, sheddable ones among them,
    //    while the interactive load goes on.
    let t = begin(&mut phases, "burst of 5× capacity", Rule::OnlyShed);
    let burst_phase = phases.len() - 1;
    let capacity = PODS * SLOTS;
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..5 * capacity {
        let objective: &'static str = if i % 10 == 9 { "batch" } else { "standard" };
        let body = json!({"prompt": text(&format!("burst request {i} about its own document"), 200), "max_tokens": 96, "stream": true});
        let (records, client, url) = (records.clone(), client.clone(), format!("{}/v1/completions", envoy.url));
        burst.spawn(async move {
            let (outcome, ttft) = request(&client, &url, &body, objective).await;
            records.lock().unwrap().push(Record { phase: burst_phase, objective, stream: true, outcome, ttft });
        });
    }
    while burst.join_next().await.is_some() {}
    let drained =
        until(Duration::from_secs(10), || async { scorer.metric("kvgate_admission_waiting").await == 0.0 }).await;
    let (mut standard, mut refused) = (Vec::new(), [0usize; 2]);
    for r in records.lock().unwrap().iter().filter(|r| r.phase == burst_phase) {
        match (r.objective, r.outcome) {
            ("standard", Outcome::Ok) => standard.push(r.ttft),
            ("standard", Outcome::Shed) => refused[0] += 1,
            ("batch", Outcome::Shed) => refused[1] += 1,
            _ => {}
        }
    }
    let reasons = reqwest::get(format!("{}/metrics", scorer.url)).await?.text().await?;
    let reasons: Vec<&str> = reasons.lines().filter_map(|l| l.strip_prefix("kvgate_admission_refused_total")).collect();
    phases.last_mut().unwrap().recovery = format!(
        "{} ordinary (429: {}; served, p90 TTFT {:.0} ms) and {} sheddable (429: {}) at once; refusals by reason: {}; \
         queue empty {} after the last",
        capacity * 9 / 2,
        refused[0],
        percentile(&mut standard, 0.9).as_secs_f64() * 1e3,
        capacity / 2,
        refused[1],
        reasons.join(", "),
        secs(drained)
    );
    rest(t).await;
    progress(&scorer, &records, &started).await;

    stop.store(1, Ordering::Relaxed);
    load.await?;
    println!("[{picker}] load stopped; waiting for the scorer's bookings to drain");
    scorer.wait_idle(Duration::from_secs(15)).await;

    // The report.
    let records = records.lock().unwrap();
    let mut report = String::new();
    let steady_p90 = {
        let mut t: Vec<Duration> =
            records.iter().filter(|r| r.phase == 0 && r.stream && r.outcome == Outcome::Ok).map(|r| r.ttft).collect();
        percentile(&mut t, 0.9)
    };
    writeln!(
        report,
        "\n### `kvgate-chaos --picker {picker}`: {} requests/s of steady streaming load, {PODS} pods\n",
        args.rate
    )?;
    writeln!(
        report,
        "| phase | requests | ok | shed (429) | error status | no answer | cut mid-answer | hung | interactive p90 TTFT (streamed) | recovery |"
    )?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|")?;
    let mut passed = true;
    for (i, phase) in phases.iter().enumerate() {
        let mine: Vec<&Record> = records.iter().filter(|r| r.phase == i).collect();
        let count = |f: &dyn Fn(Outcome) -> bool| mine.iter().filter(|r| f(r.outcome)).count();
        let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
        for r in &mine {
            if let Outcome::ErrorStatus(s) = r.outcome {
                *statuses.entry(s).or_default() += 1;
            }
        }
        let error_status = if statuses.is_empty() {
            "0".to_string()
        } else {
            statuses.iter().map(|(s, n)| format!("{n}× {s}")).collect::<Vec<_>>().join(", ")
        };
        let (ok, shed, no_answer, cut, hung) = (
            count(&|o| o == Outcome::Ok),
            count(&|o| o == Outcome::Shed),
            count(&|o| o == Outcome::NoAnswer),
            count(&|o| o == Outcome::Cut),
            count(&|o| o == Outcome::Hung),
        );
        let mut interactive: Vec<Duration> = mine
            .iter()
            .filter(|r| r.objective == "interactive" && r.stream && r.outcome == Outcome::Ok)
            .map(|r| r.ttft)
            .collect();
        let p90 = percentile(&mut interactive, 0.9);
        let errors = statuses.values().sum::<usize>() + no_answer + hung;
        let sheddable_kept = mine.iter().any(|r| r.objective == "batch" && r.outcome == Outcome::Ok);
        let ok_by_rule = match phase.rule {
            Rule::NoError => errors + cut + shed == 0,
            Rule::OnlyCutStreams => errors + shed == 0,
            Rule::OnlyShed => {
                errors + cut == 0
                    && mine.iter().filter(|r| r.objective == "interactive").all(|r| r.outcome == Outcome::Ok)
                    && (shed > 0 || !sheddable_kept)
            }
        };
        passed &= ok_by_rule;
        writeln!(
            report,
            "| {}{} | {} | {ok} | {shed} | {error_status} | {no_answer} | {cut} | {hung} | {:.0} ms ({:.2}× steady) | {} |",
            phase.name,
            if ok_by_rule { "" } else { " **FAILED**" },
            mine.len(),
            p90.as_secs_f64() * 1e3,
            p90.as_secs_f64() / steady_p90.as_secs_f64().max(1e-9),
            phase.recovery
        )?;
    }
    let pod_back_ok = pod_back_index.is_some_and(|d| d <= Duration::from_secs(2));
    if !pod_back_ok {
        passed = false;
        writeln!(report, "\n**FAILED**: the restarted pod's index was not right within 2 s of its return.")?;
    }
    writeln!(
        report,
        "\nRules: scorer faults, the pod's return and garbage cost no request; a pod's death breaks only answers \
         already under way on it (`cut`); the burst gets 429s only (sheddable requests first), \
         interactive requests all served. `{}`.",
        if passed { "all held" } else { "SOME FAILED" }
    )?;
    Ok((report, passed))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvgate_test_harness::quiet_children();
    let pickers: &[&str] = match args.picker.as_str() {
        "both" => &["wasm", "epp"],
        "wasm" => &["wasm"],
        _ => &["epp"],
    };
    std::fs::create_dir_all(&args.out)?;
    let mut all_passed = true;
    for picker in pickers {
        let (report, passed) = run(&args, picker).await?;
        println!("{report}");
        std::fs::write(args.out.join(format!("chaos-{picker}.md")), &report)?;
        all_passed &= passed;
    }
    anyhow::ensure!(all_passed, "a fault cost client errors it should not have (see the report)");
    Ok(())
}
