//! `kvgate-cluster-sim`: every workload × every router on simulated engines in virtual
//! time; writes `results.json`, `results.md` and one SVG chart per workload.

use anyhow::Context;
use clap::Parser;
use kvgate_bench::cluster::{ClusterConfig, PodRole, RunResult, run};
use kvgate_bench::report::{Summary, svg, table};
use kvgate_bench::routers;
use kvgate_bench::workload::{self, NAMES, Params, Workload};
use kvgate_sim::engine::EngineConfig;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

/// Routers compared on every workload, kvgate's default first.
const ROUTERS: [&str; 8] =
    ["kv", "prefix", "ttft", "least-loaded", "power-of-two", "round-robin", "random", "sglang-cache-aware"];
/// Extra variants on the P/D workload.
const PD_VARIANTS: [&str; 2] = ["kv@pd-always", "kv@no-pd"];

#[derive(Parser, Debug)]
#[command(
    about = "Replays seeded workloads against simulated vLLM engines in virtual time, routed by kvgate's policies and by SGLang's cache_aware rule"
)]
struct Args {
    /// Comma-separated workloads, or `all`: chat, documents, unique-long, burst, capacity, pd-mixed.
    #[arg(long, default_value = "all")]
    workloads: String,
    /// Routers (space-separated), or `all`: kv, prefix, ttft, least-loaded, power-of-two,
    /// round-robin, random, sglang-cache-aware (P/D variants kv@pd-always, kv@no-pd are
    /// added on pd-mixed); a kvgate policy may be given as the scorer's YAML, e.g.
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
    /// Multiplies each workload's arrival rate.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Where results go.
    #[arg(long, default_value = "target/bench/cluster")]
    out: PathBuf,
    /// Worker threads (runs are independent; results do not depend on this).
    #[arg(long, default_value_t = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))]
    threads: usize,
}

fn list<'a>(arg: &'a str, all: &[&'a str]) -> Vec<&'a str> {
    if arg == "all" { all.to_vec() } else { arg.split(',').map(str::trim).filter(|s| !s.is_empty()).collect() }
}

fn layout(w: &Workload, pods: usize) -> Vec<PodRole> {
    (0..pods)
        .map(|i| match (w.prefill_pods, i < w.prefill_pods) {
            (0, _) => PodRole::Both,
            (_, true) => PodRole::Prefill,
            (_, false) => PodRole::Decode,
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.pods >= 2, "--pods must be at least 2");
    let params = Params { seed: args.seed, pods: args.pods, scale: args.scale, load: args.load };
    anyhow::ensure!(args.seeds >= 1, "--seeds must be at least 1");
    let mut jobs: Vec<(&'static str, String)> = Vec::new();
    for name in list(&args.workloads, &NAMES) {
        let w =
            workload::build(name, &params).with_context(|| format!("unknown workload {name:?} (known: {NAMES:?})"))?;
        println!("{:<12} {:>6} requests  {}", w.name, w.requests(), w.description);
        let all = args.routers == ["all"];
        let mut names: Vec<String> =
            if all { ROUTERS.iter().map(|s| s.to_string()).collect() } else { args.routers.clone() };
        if w.prefill_pods > 0 && all {
            names.extend(PD_VARIANTS.iter().map(|s| s.to_string()));
        }
        for r in names {
            routers::build(&r, &layout(&w, args.pods), args.seed)?; // fail early on a bad name
            jobs.push((w.name, r));
        }
    }
    let started = Instant::now();
    let total = jobs.len();
    let queue = Mutex::new(jobs.into_iter().enumerate().collect::<Vec<_>>());
    let results: Mutex<Vec<(usize, Summary)>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..args.threads.max(1) {
            scope.spawn(|| {
                loop {
                    let Some((i, (workload_name, name))) = queue.lock().unwrap().pop() else { break };
                    let t0 = Instant::now();
                    let mut pooled: Option<RunResult> = None;
                    let mut roles = Vec::new();
                    for seed in args.seed..args.seed + args.seeds {
                        let w = workload::build(workload_name, &Params { seed, ..params }).expect("built before");
                        roles = layout(&w, args.pods);
                        let config = ClusterConfig {
                            roles: roles.clone(),
                            engine: EngineConfig {
                                num_blocks: w.num_blocks,
                                hash_seed: Some("0".into()),
                                ..EngineConfig::default()
                            },
                            scrape_interval: 1.0,
                        };
                        let mut router = routers::build(&name, &roles, seed).expect("checked above");
                        let result = run(&w, &config, router.as_mut());
                        pooled = Some(match pooled {
                            None => result,
                            Some(mut p) => {
                                p.requests.extend(result.requests);
                                for (a, b) in p.prefill_tokens_per_pod.iter_mut().zip(result.prefill_tokens_per_pod) {
                                    *a += b;
                                }
                                p.preemptions += result.preemptions;
                                p.peak_inflight = p.peak_inflight.max(result.peak_inflight);
                                p.makespan += result.makespan;
                                p
                            }
                        });
                    }
                    let result = pooled.expect("at least one seed");
                    let decode_pods: Vec<usize> = (0..roles.len()).filter(|&p| roles[p] != PodRole::Prefill).collect();
                    let summary = Summary::of(workload_name, &name, &result, &decode_pods);
                    let mut done = results.lock().unwrap();
                    done.push((i, summary.clone()));
                    println!(
                        "[{:>3}/{total}] {:<12} {:<20} p90 TTFT {:>9.1} ms  hits {:>5.1} %  ({:.1} s wall, {:.0} s simulated)",
                        done.len(),
                        workload_name,
                        name,
                        summary.ttft_p90_ms,
                        summary.prefix_hit_rate * 100.0,
                        t0.elapsed().as_secs_f64(),
                        summary.makespan_s
                    );
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    let summaries: Vec<Summary> = results.into_iter().map(|(_, s)| s).collect();

    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
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
    let mut workloads_seen: Vec<&str> = summaries.iter().map(|s| s.workload.as_str()).collect();
    workloads_seen.dedup();
    for name in &workloads_seen {
        let rows: Vec<&Summary> = summaries.iter().filter(|s| s.workload == *name).collect();
        let w = workload::build(name, &params).expect("built before");
        markdown.push_str(&format!("\n### {name}\n\n{}\n\n{}", w.description, table(&rows)));
        let chart = args.out.join(format!("{name}.svg"));
        std::fs::write(&chart, svg(&format!("{name}: {} pods, {} requests", args.pods, w.requests()), &rows))?;
    }
    let json = serde_json::json!({ "params": params, "results": summaries });
    std::fs::write(args.out.join("results.json"), serde_json::to_string_pretty(&json)?)?;
    std::fs::write(args.out.join("results.md"), &markdown)?;
    println!("\n{markdown}\nwrote {}/results.{{json,md}} and one SVG per workload", args.out.display());
    Ok(())
}
