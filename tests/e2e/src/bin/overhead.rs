//! `kvgate-overhead` (`make bench-overhead`): what the kvgate path adds to a request.
//!
//! One simulated pod whose engine takes almost no time (so the figures are the gateway's),
//! reached three ways, interleaved request by request so the shared machine's noise hits all
//! alike: directly; through Envoy round robin without the filter; through Envoy with the
//! kvgate filter and scorer. Short (~30 tokens) and long (~8k tokens) prompts, sequential,
//! non-streaming, one output token.

use clap::Parser;
use kvgate_e2e::{ms, percentile, send};
use kvgate_test_harness::{EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::json;
use std::time::Duration;

#[derive(Parser, Debug)]
struct Args {
    /// Requests per path and prompt size.
    #[arg(long, default_value_t = 400)]
    requests: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvgate_test_harness::quiet_children();
    println!("kvgate overhead: {} sequential requests per path and prompt size, interleaved", args.requests);
    let tokenizer = qwen3_tokenizer();
    // A near-instant engine: 1e-4 × model time.
    let pod = Sim::start("pod-1", &["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.0001"]).await;
    let config = format!(
        "tokenizer: {}\npods:\n  - {{name: pod-1, address: '127.0.0.1:{}', kv_events: '{}'}}\n",
        tokenizer.display(),
        pod.port,
        pod.events
    );
    let scorer = ScorerProcess::start(&config).await;
    let kvgate = EnvoyProcess::start(&scorer, &[]).await;
    let baseline = EnvoyProcess::start(&scorer, &["--baseline-round-robin"]).await;
    let client = reqwest::Client::new();
    let paths = [
        ("direct to the pod", pod.url.clone()),
        ("Envoy round robin", baseline.url.clone()),
        ("Envoy + kvgate", kvgate.url.clone()),
    ];

    println!("| prompt | path | p50 | p90 | p50 vs round robin |");
    println!("|---|---|---|---|---|");
    for (label, words) in [("short (≈30 tokens)", 10), ("long (≈8k tokens)", 2700)] {
        let body = json!({"prompt": text("overhead", words), "max_tokens": 1});
        let mut samples: Vec<Vec<Duration>> = vec![Vec::with_capacity(args.requests); paths.len()];
        for _ in 0..20 {
            for (_, url) in &paths {
                send(&client, &format!("{url}/v1/completions"), &body).await; // warm-up
            }
        }
        for i in 0..args.requests {
            for (k, (_, url)) in paths.iter().enumerate() {
                let m = send(&client, &format!("{url}/v1/completions"), &body).await;
                anyhow::ensure!(m.status == 200, "{} answered {}", paths[k].0, m.status);
                samples[k].push(m.total);
            }
            if (i + 1).is_multiple_of((args.requests / 4).max(1)) {
                eprintln!("    {label}: {}/{} rounds", i + 1, args.requests);
            }
        }
        let p50: Vec<Duration> = samples.iter_mut().map(|s| percentile(s, 0.5)).collect();
        for (k, (name, _)) in paths.iter().enumerate() {
            let p90 = percentile(&mut samples[k], 0.9);
            println!(
                "| {label} | {name} | {} | {} | {:.2}× |",
                ms(p50[k]),
                ms(p90),
                p50[k].as_secs_f64() / p50[1].as_secs_f64()
            );
        }
        println!("| {label} | kvgate adds | {} | | |", ms(p50[2].saturating_sub(p50[1])));
    }
    Ok(())
}
