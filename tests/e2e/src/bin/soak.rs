//! `kvgate-soak` (`make soak`): a bounded soak of the whole path — simulated pods, scorer,
//! Envoy with the filter — at a fixed request rate, watching the scorer's memory, file
//! descriptors and bookings. Fails if any request fails, descriptors leak, or bookings stay.

use clap::Parser;
use kvgate_e2e::send;
use kvgate_test_harness::{EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// How long to send traffic.
    #[arg(long, default_value_t = 120)]
    seconds: u64,
    /// Requests started per second.
    #[arg(long, default_value_t = 40)]
    rate: u64,
}

/// (resident KiB, peak resident KiB, open descriptors) of a process.
fn usage(pid: u32) -> (u64, u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    (field("VmRSS:"), field("VmHWM:"), fds)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvgate_test_harness::quiet_children();
    let tokenizer = qwen3_tokenizer();
    let tok = tokenizer.to_str().unwrap();
    let mut config = format!("tokenizer: {tok}\nindex: {{max_blocks_per_pod: 20000}}\npods:\n");
    let mut pods = Vec::new();
    for i in 1..=3 {
        // Small caches so blocks are stored and evicted all along.
        let pod =
            Sim::start(&format!("pod-{i}"), &["--tokenizer", tok, "--time-scale", "0.05", "--num-blocks", "3000"])
                .await;
        config.push_str(&format!(
            "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', kv_events_replay: '{}', metrics: '{}/metrics'}}\n",
            pod.pod_id, pod.port, pod.events, pod.replay, pod.url
        ));
        pods.push(pod);
    }
    let scorer = ScorerProcess::start(&config).await;
    let envoy = EnvoyProcess::start(&scorer, &[]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = scorer.pid();
    let start_usage = usage(pid);
    println!("kvgate soak: {} s at {} requests/s through Envoy + kvgate (3 pods)", args.seconds, args.rate);
    println!("| t (s) | requests | errors | scorer RSS (MiB) | fds | in flight |");
    println!("|---|---|---|---|---|---|");

    let (sent, errors) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let client = reqwest::Client::new();
    let systems: Vec<String> = (0..6).map(|i| text(&format!("soak system {i}"), 250)).collect();
    let began = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / args.rate.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    let mut next_report = 10;
    let mut n: u64 = 0;
    while began.elapsed() < Duration::from_secs(args.seconds) {
        tick.tick().await;
        n += 1;
        let body = if n.is_multiple_of(4) {
            json!({"prompt": text(&format!("unique {n}"), 120), "max_tokens": 8})
        } else {
            json!({"messages": [{"role": "system", "content": systems[(n % 6) as usize]},
                                {"role": "user", "content": format!("question {n}")}],
                   "max_tokens": 8, "stream": n.is_multiple_of(2)})
        };
        let path = if n.is_multiple_of(4) { "/v1/completions" } else { "/v1/chat/completions" };
        let (client, url) = (client.clone(), format!("{}{path}", envoy.url));
        let (done, failed) = (sent.clone(), errors.clone());
        tasks.spawn(async move {
            let m = send(&client, &url, &body).await;
            done.fetch_add(1, Ordering::Relaxed);
            if m.status != 200 {
                failed.fetch_add(1, Ordering::Relaxed);
            }
        });
        while tasks.try_join_next().is_some() {}
        if began.elapsed().as_secs() >= next_report {
            next_report += 10;
            let (rss, _, fds) = usage(pid);
            let inflight: u64 = scorer.pods().await.iter().map(|p| p["inflight_requests"].as_u64().unwrap_or(0)).sum();
            println!(
                "| {} | {} | {} | {:.1} | {fds} | {inflight} |",
                began.elapsed().as_secs(),
                sent.load(Ordering::Relaxed),
                errors.load(Ordering::Relaxed),
                rss as f64 / 1024.0
            );
        }
    }
    while tasks.join_next().await.is_some() {}
    scorer.wait_idle(Duration::from_secs(10)).await;
    let (rss, peak, fds) = usage(pid);
    let total = sent.load(Ordering::Relaxed);
    let failed = errors.load(Ordering::Relaxed);
    println!(
        "\n{total} requests in {:.0} s ({:.1}/s), {failed} errors; scorer RSS {:.1} → {:.1} MiB (peak {:.1}), fds {} → {fds}, in flight at the end: 0",
        began.elapsed().as_secs_f64(),
        total as f64 / began.elapsed().as_secs_f64(),
        start_usage.0 as f64 / 1024.0,
        rss as f64 / 1024.0,
        peak as f64 / 1024.0,
        start_usage.2,
    );
    anyhow::ensure!(failed == 0, "{failed} requests failed");
    anyhow::ensure!(fds <= start_usage.2 + 16, "scorer descriptors grew from {} to {fds}", start_usage.2);
    Ok(())
}
