//! `kvgate-cluster-sim`: every workload × every router on simulated engines in virtual
//! time; writes `results.json`, `results.md` and one SVG chart per workload — or, with
//! `--sweep`, each router's goodput at a TTFT SLO (`goodput.json`, `goodput.md`) and one
//! p90-vs-load plot per workload.

use anyhow::Context;
use clap::Parser;
use kvgate_bench::cluster::{ClusterConfig, RunResult, run};
use kvgate_bench::goodput::{Goodput, Point, bracket, goodput, over, ratio, svg_curves};
use kvgate_bench::report::{Summary, median, ms, pod_table, svg, table, ttft_p90_ms};
use kvgate_bench::routers;
use kvgate_bench::workload::{self, NAMES, Params, Workload};
use kvgate_routing::policy::PolicyConfig;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// Routers compared on every workload: kvgate's policies (its default first), then the peers'.
fn routers() -> impl Iterator<Item = &'static str> {
    PolicyConfig::NAMES.iter().copied().chain(PEERS)
}
/// The peers' rules among them: SGLang's, vllm-router's earlier source's and its 0.1.17
/// release's (the one the live benchmark runs).
const PEERS: [&str; 3] = ["sglang-cache-aware", "vllm-kv-aware", "vllm-kv-aware@streamed"];
/// Extra variants on the P/D workload.
const PD_VARIANTS: [&str; 2] = ["kv@pd-always", "kv@no-pd"];
/// Extra variant on fleets of unlike pods: kv without learning their speeds.
const UNLIKE_VARIANTS: [&str; 2] = ["kv@fixed-speed", "kv@known-speed"];
/// Extra variant on pods with offload tiers: kv blind to them.
const TIERED_VARIANTS: [&str; 1] = ["kv@gpu-only"];
/// Added on workloads whose pods serve LoRA adapters: kvgate pricing no adapter slots, and the
/// Inference Extension's picker with its LoRA affinity scorer (as profiled, and weighed first).
const ADAPTER_VARIANTS: [&str; 3] = ["kv@no-adapters", "lora-affinity", "lora-affinity@lora-first"];
/// A sweep stops a router after this many points in a row over the SLO.
const OVER_SLO_STOP: usize = 2;
/// Bisections of the interval where a router's p90 crosses the SLO (each halves it on a log
/// scale of the load).
const REFINE_STEPS: usize = 2;

#[derive(Parser, Debug)]
#[command(
    args_override_self = true,
    about = "Replays seeded workloads against simulated vLLM engines in virtual time, routed by kvgate's policies and by SGLang's, vllm-router's and the Inference Extension's rules; with --sweep, each router's goodput at a TTFT SLO"
)]
struct Args {
    /// Comma-separated workloads, or `all`: chat, documents, unique-long, burst, capacity,
    /// tiered, heterogeneous, pd-mixed, adapters, hybrid; also (not in `all`) burst-100ms, the
    /// burst spread evenly over 100 ms, and live, `kvgate-live-bench`'s mix (with
    /// `--in-flight 24`, as its clients send it).
    #[arg(long, default_value = "all")]
    workloads: String,
    /// Routers (space-separated), or `all`: kv, prefix, ttft, least-loaded, power-of-two,
    /// round-robin, random, sglang-cache-aware, vllm-kv-aware (vllm-router's earlier source),
    /// vllm-kv-aware@streamed (its 0.1.17 release, as probed) (P/D variants kv@pd-always,
    /// kv@no-pd are added on pd-mixed, kv@fixed-speed and kv@known-speed on heterogeneous,
    /// kv@gpu-only on tiered, kv@no-adapters, lora-affinity and lora-affinity@lora-first on
    /// adapters); a kvgate policy may be given as the scorer's YAML, e.g.
    /// "{name: kv, decode_weight: 0.2}".
    #[arg(long, num_args = 1.., default_values_t = ["all".to_string()])]
    routers: Vec<String>,
    /// Pods in the cluster (8–64 is the intended range).
    #[arg(long, default_value_t = 8)]
    pods: usize,
    /// Seed of workloads and policies: the same seed gives the same figures.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seeds per run (`seed`, `seed`+1, …): their requests are pooled before figures are
    /// taken, so one lucky draw does not decide a ranking.
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// Multiplies each workload's request count.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Multiplies each workload's arrival rate (the burst's size).
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Where results go.
    #[arg(long, default_value = "target/bench/cluster")]
    out: PathBuf,
    /// Sweep the offered load instead: comma-separated multiples of each workload's arrival
    /// rate (of its size, for the burst; above 1 the request count grows alike, so every
    /// heavy point lasts as long; below it stays, so the share of cold first requests does). Reports each router's p90 TTFT per point and its goodput
    /// — the highest load whose p90 TTFT stays within the SLO — with one plot per
    /// workload. A router stops after two points in a row over the SLO; then the interval
    /// where its p90 crosses the SLO is bisected twice.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    sweep: Vec<f64>,
    /// The sweep's SLO: p90 TTFT at most this many times the workload's unloaded p90 (the
    /// lowest p90 TTFT any router reaches at the sweep's lightest point). Not the p50: on
    /// cache-heavy workloads the p50 is a cache hit and the p90 a cold first request, which
    /// no router avoids at any load.
    #[arg(long, default_value_t = 3.0)]
    slo_factor: f64,
    /// Or one absolute SLO for every workload: p90 TTFT at most this many milliseconds.
    #[arg(long)]
    slo_ms: Option<f64>,
    /// Clients ask for this many output tokens (`max_tokens`) though each request still stops
    /// at its own length (the model's end of sequence): routers plan with the asked figure,
    /// `@informed` kvgate with the true one. Unset: clients ask for exactly what they get.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Clients keep this many requests in flight instead of arriving at the workload's rate
    /// (as `kvgate-live-bench`'s do): every session's first turn queues in session order, each
    /// next turn behind everything already waiting. Not with --sweep.
    #[arg(long)]
    in_flight: Option<usize>,
    /// Also each router's requests, TTFT and prefill work per pod: a table per workload and
    /// in the JSON (one load: not with --sweep).
    #[arg(long)]
    per_pod: bool,
    /// Worker threads (runs are independent; results do not depend on this).
    #[arg(long, default_value_t = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))]
    threads: usize,
}

fn list<'a>(arg: &'a str, all: &[&'a str]) -> Vec<&'a str> {
    if arg == "all" { all.to_vec() } else { arg.split(',').map(str::trim).filter(|s| !s.is_empty()).collect() }
}

/// One router on one workload, its seeds (`params.seed`, +1, …) pooled, clients keeping
/// `in_flight` requests in flight if given: the figures and the mean load offered.
fn simulate(
    workload_name: &str,
    router: &str,
    params: &Params,
    seeds: u64,
    in_flight: Option<usize>,
) -> (Summary, f64) {
    let mut pooled: Option<RunResult> = None;
    let mut seed_p90s = Vec::new();
    let mut offered = 0.0;
    let mut decode_pods = Vec::new();
    for seed in params.seed..params.seed + seeds {
        let w = workload::build(workload_name, &Params { seed, ..*params }).expect("checked before");
        offered += w.offered() / seeds as f64;
        let config = ClusterConfig {
            max_tokens_asked: params.max_tokens,
            in_flight,
            ..ClusterConfig::for_workload(&w, params.pods)
        };
        decode_pods = config.decode_pods();
        let mut r = routers::build(router, &config.roles, seed).expect("checked before");
        let result = run(&w, &config, r.as_mut());
        seed_p90s.push(ttft_p90_ms(&result));
        pooled = Some(match pooled {
            None => result,
            Some(mut p) => {
                p.requests.extend(result.requests);
                for (a, b) in p.prefill_tokens_per_pod.iter_mut().zip(result.prefill_tokens_per_pod) {
                    *a += b;
                }
                p.preemptions += result.preemptions;
                p.signals.extend(result.signals);
                p.peak_inflight = p.peak_inflight.max(result.peak_inflight);
                p.makespan += result.makespan;
                p
            }
        });
    }
    let pooled = pooled.expect("at least one seed");
    let summary = Summary {
        ttft_p90_seed_median_ms: median(&seed_p90s),
        ..Summary::of(workload_name, router, &pooled, &decode_pods)
    };
    (summary, offered)
}

/// Runs `f` over `jobs` on `threads` threads; the results in job order.
fn parallel<J: Send, R: Send>(jobs: Vec<J>, threads: usize, f: impl Fn(J) -> R + Sync) -> Vec<R> {
    let queue = Mutex::new(jobs.into_iter().enumerate().rev().collect::<Vec<_>>());
    let results = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                loop {
                    let Some((i, job)) = queue.lock().unwrap().pop() else { break };
                    let r = f(job);
                    results.lock().unwrap().push((i, r));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.pods >= 2, "--pods must be at least 2");
    anyhow::ensure!(args.seeds >= 1, "--seeds must be at least 1");
    anyhow::ensure!(!args.per_pod || args.sweep.is_empty(), "--per-pod reports one load: leave out --sweep");
    anyhow::ensure!(
        args.in_flight.is_none() || args.sweep.is_empty(),
        "--in-flight sets the load itself: leave out --sweep"
    );
    anyhow::ensure!(args.in_flight != Some(0), "--in-flight must be at least 1");
    let params =
        Params { seed: args.seed, pods: args.pods, scale: args.scale, load: args.load, max_tokens: args.max_tokens };
    // Every workload with its routers, checked before anything runs.
    let mut plan: Vec<(Workload, Vec<String>)> = Vec::new();
    for name in list(&args.workloads, &NAMES) {
        let w = workload::build(name, &params)
            .with_context(|| format!("unknown workload {name:?} (known: {NAMES:?}, burst-100ms and live)"))?;
        println!("{:<12} {:>6} requests  {}", w.name, w.requests(), w.description);
        let all = args.routers == ["all"];
        let mut names: Vec<String> = if all { routers().map(String::from).collect() } else { args.routers.clone() };
        if w.prefill_pods > 0 && all {
            names.extend(PD_VARIANTS.iter().map(|s| s.to_string()));
        }
        if !w.unlike.is_empty() && all {
            names.extend(UNLIKE_VARIANTS.iter().map(|s| s.to_string()));
        }
        if w.offload_blocks > 0 && all {
            names.extend(TIERED_VARIANTS.iter().map(|s| s.to_string()));
        }
        if w.max_loras > 0 && all {
            names.extend(ADAPTER_VARIANTS.iter().map(|s| s.to_string()));
        }
        let config = ClusterConfig::for_workload(&w, args.pods);
        for r in &names {
            routers::build(r, &config.roles, args.seed)?;
        }
        plan.push((w, names));
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    if args.sweep.is_empty() { compare(&args, &params, &plan) } else { sweep(&args, &params, &plan) }
}

/// Every router on every workload at the given load: tables and bar charts.
fn compare(args: &Args, params: &Params, plan: &[(Workload, Vec<String>)]) -> anyhow::Result<()> {
    let jobs: Vec<(&str, &str)> =
        plan.iter().flat_map(|(w, routers)| routers.iter().map(|r| (w.name, r.as_str()))).collect();
    let started = Instant::now();
    let total = jobs.len();
    let done = Mutex::new(0);
    let summaries = parallel(jobs, args.threads, |(workload_name, name)| {
        let t0 = Instant::now();
        let (mut summary, _) = simulate(workload_name, name, params, args.seeds, args.in_flight);
        if !args.per_pod {
            // Kept only when asked: at 64 pods they would be most of the results file.
            summary.per_pod.clear();
        }
        let mut done = done.lock().unwrap();
        *done += 1;
        println!(
            "[{:>3}/{total}] {:<12} {:<20} p90 TTFT {:>9.1} ms  hits {:>5.1} %  ({:.1} s wall, {:.0} s simulated)",
            *done,
            workload_name,
            name,
            summary.ttft_p90_ms,
            summary.prefix_hit_rate * 100.0,
            t0.elapsed().as_secs_f64(),
            summary.makespan_s
        );
        summary
    });
    let mut markdown = format!(
        "Cluster simulator: {} pods, seeds {}–{} pooled, scale {}, load {} ({} runs in {:.1} s wall).\n",
        args.pods,
        args.seed,
        args.seed + args.seeds - 1,
        args.scale,
        args.load,
        total,
        started.elapsed().as_secs_f64()
    );
    for (w, _) in plan {
        let rows: Vec<&Summary> = summaries.iter().filter(|s| s.workload == w.name).collect();
        markdown.push_str(&format!("\n### {}\n\n{}\n\n{}", w.name, w.description, table(&rows)));
        if args.per_pod {
            let label = |pod: usize| match w.unlike.iter().find(|(p, _)| *p == pod) {
                Some((_, shape)) => format!("{pod} (steps ×{}, {} KV blocks)", shape.slowdown, shape.num_blocks),
                None => pod.to_string(),
            };
            markdown.push_str(&format!(
                "\nPer pod (requests decoded there and their share, TTFT, prompt tokens computed):\n\n{}",
                pod_table(&rows, label)
            ));
        }
        let chart = args.out.join(format!("{}.svg", w.name));
        std::fs::write(&chart, svg(&format!("{}: {} pods, {} requests", w.name, args.pods, w.requests()), &rows))?;
    }
    let json = serde_json::json!({ "params": params, "results": summaries });
    write_results(&args.out, "results", &json, &markdown)?;
    println!("\n{markdown}\nwrote {}/results.{{json,md}} and one SVG per workload", args.out.display());
    Ok(())
}

fn write_results(out: &Path, stem: &str, json: &serde_json::Value, markdown: &str) -> anyhow::Result<()> {
    std::fs::write(out.join(format!("{stem}.json")), serde_json::to_string_pretty(json)?)?;
    std::fs::write(out.join(format!("{stem}.md")), markdown)?;
    Ok(())
}

/// One router's sweep on one workload.
struct Curve<'a> {
    workload: &'a str,
    router: &'a str,
    /// (load factor, point, figures), lightest first.
    points: Vec<(f64, Point, Summary)>,
}

/// Sweeps the offered load for every router on every workload: goodput at the SLO, the
/// p90-vs-load curves and their plots.
fn sweep(args: &Args, params: &Params, plan: &[(Workload, Vec<String>)]) -> anyhow::Result<()> {
    let mut loads = args.sweep.clone();
    anyhow::ensure!(loads.iter().all(|l| l.is_finite() && *l > 0.0), "--sweep takes positive load factors");
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    if let Some(slo) = args.slo_ms {
        anyhow::ensure!(slo > 0.0, "--slo-ms must be positive");
    }
    anyhow::ensure!(args.slo_factor > 1.0, "--slo-factor must be above 1");
    let started = Instant::now();
    // Above load 1 the request count grows with the rate, so a heavy point lasts as long as
    // load 1 does and reaches a steady state instead of being over in a moment; below it the
    // count stays, so the share of cold first requests does too. A burst's load is its size.
    let burst = |workload: &str| plan.iter().any(|(w, _)| w.name == workload && w.is_burst());
    let at = |workload: &str, load: f64| Params {
        load: params.load * load,
        scale: if burst(workload) { params.scale } else { params.scale * load.max(1.0) },
        ..*params
    };
    let run_point = |workload: &str, router: &str, load: f64| {
        let t0 = Instant::now();
        let (mut summary, offered) = simulate(workload, router, &at(workload, load), args.seeds, None);
        summary.per_pod.clear();
        println!(
            "{workload:<12} {router:<20} load {load:>5.2}× ({offered:>7.1} offered)  p90 TTFT {:>9.1} ms  ({:.1} s wall)",
            summary.ttft_p90_ms,
            t0.elapsed().as_secs_f64()
        );
        (load, Point { offered, ttft_p90_ms: summary.ttft_p90_ms }, summary)
    };
    // The lightest point first, for every router: it sets each workload's SLO.
    let pairs: Vec<(&str, &str)> =
        plan.iter().flat_map(|(w, routers)| routers.iter().map(|r| (w.name, r.as_str()))).collect();
    let lightest = parallel(pairs.clone(), args.threads, |(w, r)| run_point(w, r, loads[0]));
    let slos: Vec<(&str, f64)> = plan
        .iter()
        .map(|(w, _)| {
            let unloaded = lightest
                .iter()
                .filter(|(_, _, s)| s.workload == w.name)
                .map(|(_, _, s)| s.ttft_p90_ms)
                .fold(f64::INFINITY, f64::min);
            (w.name, args.slo_ms.unwrap_or(args.slo_factor * unloaded))
        })
        .collect();
    let slo = |workload: &str| slos.iter().find(|(w, _)| *w == workload).expect("every workload").1;
    let curves: Vec<Curve> = parallel(pairs.iter().zip(lightest).collect(), args.threads, |((w, r), first)| {
        let limit = slo(w);
        let mut points = vec![first];
        let mut overs = usize::from(over(&points[0].1, limit));
        for &load in &loads[1..] {
            if overs >= OVER_SLO_STOP {
                break;
            }
            let p = run_point(w, r, load);
            overs = if over(&p.1, limit) { overs + 1 } else { 0 };
            points.push(p);
        }
        // Narrow down where the p90 crosses the SLO.
        for _ in 0..REFINE_STEPS {
            let curve: Vec<Point> = points.iter().map(|p| p.1).collect();
            let (Some(a), Some(b)) = bracket(&curve, limit) else { break };
            let load_of = |p: Point| points.iter().find(|q| q.1 == p).expect("a point of the curve").0;
            points.push(run_point(w, r, (load_of(a) * load_of(b)).sqrt()));
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        Curve { workload: w, router: r, points }
    });

    let unit = |w: &Workload| if w.is_burst() { "requests at once" } else { "req/s" };
    let mut markdown = format!(
        "Goodput at an SLO, cluster simulator: {} pods, seeds {}–{} pooled per point, loads {} × each workload's rate (its size, for the burst), {}; {:.0} s wall.\n\n",
        args.pods,
        args.seed,
        args.seed + args.seeds - 1,
        loads.iter().map(|l| format!("{l}")).collect::<Vec<_>>().join(", "),
        match args.slo_ms {
            Some(v) => format!("SLO p90 TTFT ≤ {v} ms"),
            None =>
                format!("SLO p90 TTFT ≤ {} × the unloaded p90 (the lowest p90 at the lightest load)", args.slo_factor),
        },
        started.elapsed().as_secs_f64()
    );
    markdown.push_str(
        "| workload | SLO (p90 TTFT) | kv | best other router | kv ÷ best other | best peer rule | kv ÷ best peer | round robin | kv ÷ round robin |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut sections = String::new();
    let mut json = Vec::new();
    for (w, routers) in plan {
        let limit = slo(w.name);
        let curves: Vec<&Curve> = curves.iter().filter(|c| c.workload == w.name).collect();
        let of = |c: &Curve| goodput(&c.points.iter().map(|p| p.1).collect::<Vec<_>>(), limit);
        let find = |name: &str| curves.iter().find(|c| c.router == name).map(|c| (c.router, of(c)));
        let best_of = |keep: &dyn Fn(&str) -> bool| {
            curves
                .iter()
                .filter(|c| keep(c.router))
                .map(|c| (c.router, of(c)))
                .max_by(|a, b| a.1.value().total_cmp(&b.1.value()))
        };
        let kv = find("kv");
        let cell = |g: Option<(&str, Goodput)>, named: bool| match g {
            Some((name, g)) if named => format!("{} ({name})", g.label()),
            Some((_, g)) => g.label(),
            None => "–".into(),
        };
        let ratio = |other: Option<(&str, Goodput)>| match (kv, other) {
            (Some((_, a)), Some((_, b))) => ratio(a, b),
            _ => "–".into(),
        };
        // Other routers: not kv's own variants (kv@pd-always, kv@fixed-speed, …).
        let best_other = best_of(&|r| r != "kv" && !r.starts_with("kv@"));
        let best_peer = best_of(&|r| PEERS.contains(&r));
        let rr = find("round-robin");
        markdown.push_str(&format!(
            "| {} | {} ms | {} | {} | {} | {} | {} | {} | {} |\n",
            w.name,
            ms(limit),
            cell(kv, false),
            cell(best_other, true),
            ratio(best_other),
            cell(best_peer, true),
            ratio(best_peer),
            cell(rr, false),
            ratio(rr)
        ));
        sections.push_str(&format!(
            "\n### {}\n\n{} (at load 1). Goodput in {}; SLO p90 TTFT ≤ {} ms.\n\n| router | goodput | {} |\n|---|---|{}\n",
            w.name,
            w.description,
            unit(w),
            ms(limit),
            loads.iter().map(|l| format!("p90 at {l}×")).collect::<Vec<_>>().join(" | "),
            "---|".repeat(loads.len())
        ));
        for c in &curves {
            let cells: Vec<String> = loads
                .iter()
                .map(|l| match c.points.iter().find(|p| p.0 == *l) {
                    Some((_, p, _)) if p.ttft_p90_ms <= limit => ms(p.ttft_p90_ms),
                    Some((_, p, _)) => format!("*{}*", ms(p.ttft_p90_ms)),
                    None => "–".into(),
                })
                .collect();
            sections.push_str(&format!("| {} | {} | {} |\n", c.router, of(c).label(), cells.join(" | ")));
            json.push(serde_json::json!({
                "workload": w.name, "router": c.router, "slo_ms": limit, "goodput": of(c),
                "points": c.points.iter().map(|(load, p, s)| serde_json::json!({"load": load, "offered": p.offered, "summary": s})).collect::<Vec<_>>(),
            }));
        }
        if let Some(kv) = curves.iter().find(|c| c.router == "kv") {
            sections.push_str(&signals_table(kv, limit));
            // The wait drawn at 1 ÷ its threshold's share: it meets the SLO's line at its threshold.
            let scale = 1.0 / WAIT_THRESHOLD_OF_SLO;
            let wait = |s: &Summary| s.wait_mean_ms.map(|w| w * scale);
            let series = [
                ("kv: p90 TTFT".to_string(), kv.points.iter().map(|p| p.1).collect()),
                (
                    format!("kv: predicted wait, mean over the pods (×{scale})"),
                    kv.points.iter().filter_map(|(_, p, s)| Some(Point { ttft_p90_ms: wait(s)?, ..*p })).collect(),
                ),
            ];
            let title = format!("{}: {} pods, kvgate's scaling signal against the load offered", w.name, args.pods);
            let svg = svg_curves(&title, &format!("offered load ({})", unit(w)), limit, &series);
            std::fs::write(args.out.join(format!("{}-signals.svg", w.name)), svg)?;
        }
        let series: Vec<(String, Vec<Point>)> = routers
            .iter()
            .filter_map(|r| curves.iter().find(|c| c.router == r))
            .map(|c| (c.router.to_string(), c.points.iter().map(|p| p.1).collect()))
            .collect();
        let title = format!("{}: {} pods, p90 TTFT against the load offered", w.name, args.pods);
        let x_label = format!("offered load ({})", unit(w));
        std::fs::write(args.out.join(format!("{}-goodput.svg", w.name)), svg_curves(&title, &x_label, limit, &series))?;
    }
    markdown.push_str(&format!(
        "\nOver the SLO in *italics*; – not run (the router had stopped after {OVER_SLO_STOP} points over the SLO).\n{sections}"
    ));
    let json = serde_json::json!({ "params": params, "loads": loads, "curves": json });
    write_results(&args.out, "goodput", &json, &markdown)?;
    println!(
        "\n{markdown}\nwrote {}/goodput.{{json,md}} and one <workload>-goodput.svg (and <workload>-signals.svg with kv) per workload",
        args.out.display()
    );
    Ok(())
}

/// The autoscaling signals the sweep follows, with the threshold each is judged by: the
/// predicted waits as a share of the TTFT SLO and the KV-cache usage as the KEDA example
/// has them (0.2 s for an SLO of about 1 s, 0.7; docs/autoscaling.md), and for comparison
/// the engines' own queue, one waiting request per pod.
const WAIT_THRESHOLD_OF_SLO: f64 = 0.2;
const KV_USAGE_THRESHOLD: f64 = 0.7;
const ENGINE_WAITING_THRESHOLD: f64 = 1.0;

/// kvgate's autoscaling signals along its sweep, their means over each run: at which load
/// each crosses its threshold, beside where the p90 TTFT crosses the SLO (an autoscaler must
/// act before the latter), and each one's value at the last load within the SLO.
fn signals_table(kv: &Curve, slo_ms: f64) -> String {
    let wait_threshold = WAIT_THRESHOLD_OF_SLO * slo_ms;
    let first = |crossed: &dyn Fn(&Summary) -> bool| {
        kv.points.iter().find(|(_, _, s)| crossed(s)).map_or("–".to_string(), |(l, _, _)| format!("{l:.2}×"))
    };
    let wait = |w: Option<f64>| w.map_or("–".to_string(), |w| format!("{} ms", ms(w)));
    let mut out = format!(
        "\nkv's autoscaling signals (means over each run). Crossed at: p90 TTFT > SLO {}; predicted wait at the soonest pod ≥ {} ms ({WAIT_THRESHOLD_OF_SLO} × the SLO) {}; mean over the pods ≥ {} ms {}; KV-cache usage ≥ {KV_USAGE_THRESHOLD} {}; engines' waiting requests ≥ {ENGINE_WAITING_THRESHOLD} per pod {}.\n\n| load | p90 TTFT | predicted wait, soonest pod | predicted wait, mean | KV-cache usage | engines' waiting requests per pod |\n|---|---|---|---|---|---|\n",
        first(&|s| s.ttft_p90_ms > slo_ms),
        ms(wait_threshold),
        first(&|s| s.wait_soonest_ms.is_some_and(|w| w >= wait_threshold)),
        ms(wait_threshold),
        first(&|s| s.wait_mean_ms.is_some_and(|w| w >= wait_threshold)),
        first(&|s| s.kv_cache_usage_mean >= KV_USAGE_THRESHOLD),
        first(&|s| s.engine_waiting_mean >= ENGINE_WAITING_THRESHOLD),
    );
    for (load, _, s) in &kv.points {
        out.push_str(&format!(
            "| {load:.2}× | {} ms | {} | {} | {:.2} | {:.2} |\n",
            ms(s.ttft_p90_ms),
            wait(s.wait_soonest_ms),
            wait(s.wait_mean_ms),
            s.kv_cache_usage_mean,
            s.engine_waiting_mean
        ));
    }
    out
}
