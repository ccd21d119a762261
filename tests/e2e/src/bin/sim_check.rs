//! `kvgate-sim-check`: the simulator checked against the real engine. Starts one real vLLM
//! engine (`make setup` installs it) and `kvgate-sim` configured alike, sends both the same
//! trace one request at a time, and prints per request kind how often the prompt tokens each
//! served from its cache were equal, the blocks each evicted, and every difference. Results in
//! `target/sim-check/`.

use clap::Parser;
use kvgate_e2e::sim_check::{compare, simulator_beside, table, trace};
use kvgate_test_harness::{ENGINE_ADAPTER, ENGINE_MODEL, Engine, EngineOptions};
use std::io::Write;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "kvgate-sim-check")]
struct Args {
    /// Requests in the trace.
    #[arg(long, default_value_t = 500)]
    requests: usize,
    /// The engine's KV cache, in blocks of 32 tokens (few: the trace evicts).
    #[arg(long, default_value_t = 192)]
    kv_blocks: u64,
    /// LoRA adapters the engine (and the simulator) hold at once.
    #[arg(long, default_value_t = 1)]
    max_loras: u32,
    /// The trace's seed.
    #[arg(long, default_value_t = 46)]
    seed: u64,
    /// Where the results go.
    #[arg(long, default_value = "target/sim-check")]
    out: std::path::PathBuf,
    /// Write the trace (one JSON line per request: `api`, `kind`, `body`) here and stop.
    #[arg(long)]
    dump_trace: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(path) = &args.dump_trace {
        let lines: Vec<String> = trace(ENGINE_MODEL, ENGINE_ADAPTER, args.requests, args.seed)
            .iter()
            .map(|s| serde_json::json!({"api": s.api, "kind": s.kind, "body": s.body}).to_string())
            .collect();
        std::fs::write(path, lines.join("\n") + "\n")?;
        return Ok(());
    }
    kvgate_test_harness::quiet_children();
    let started = Instant::now();
    eprintln!("starting a real engine ({} KV blocks) and the simulator configured alike…", args.kv_blocks);
    let options = EngineOptions { kv_blocks: args.kv_blocks, max_loras: args.max_loras, ..EngineOptions::default() };
    let engine = Engine::start("engine", &options).await;
    let (sim, counters) = simulator_beside(&engine, &options).await?;
    let steps = trace(ENGINE_MODEL, ENGINE_ADAPTER, args.requests, args.seed);
    eprintln!("ready after {:.0?}; {} requests to each", started.elapsed(), steps.len());
    let mut differences = Vec::new();
    let compared = compare(&engine.url, &sim.url, (&counters[0], &counters[1]), &steps, |i, a| {
        if a.engine_cached != a.sim_cached {
            differences.push(format!(
                "request {i} ({}, {} prompt tokens): engine {} cached, simulator {}",
                a.kind, a.prompt_tokens, a.engine_cached, a.sim_cached
            ));
        }
        if (i + 1) % 50 == 0 {
            eprint!("\r{} of {} requests, {} differences", i + 1, steps.len(), differences.len());
            let _ = std::io::stderr().flush();
        }
    })
    .await?;
    eprintln!();
    let report = format!(
        "kvgate-sim-check --requests {} --kv-blocks {} --max-loras {} --seed {}\n\n{}\n{}\n",
        args.requests,
        args.kv_blocks,
        args.max_loras,
        args.seed,
        table(&compared),
        differences.join("\n")
    );
    println!("{report}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("report.md"), &report)?;
    eprintln!("written to {} ({:.0?})", args.out.join("report.md").display(), started.elapsed());
    Ok(())
}
