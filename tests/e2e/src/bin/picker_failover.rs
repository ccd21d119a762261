//! `kvgate-picker-failover` (`make picker-failover`): two kvgate pickers sharing their
//! bookings over NATS behind a real Envoy — in Istio's shape and in llm-d's (see
//! `kvgate_e2e::failover`) — under a steady closed-loop load; a rolling restart of each
//! replica in turn, then a `kill -9` of one. One table per shape: the requests of each event's
//! window, the failed ones by when they started, how long until the gateway had settled;
//! then NATS down and back. Exits non-zero when a rolling restart or the bus failed a
//! request, or a kill failed more than the exchanges open on the killed replica or any
//! request from 1 s after it.

use clap::Parser;
use kvgate_e2e::failover::{self, Fleet, Load, Settings, Shape};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Which gateway shape: `istio`, `llm-d` or `both`.
    #[arg(long, default_value = "both", value_parser = ["istio", "llm-d", "both"])]
    shape: String,
    /// Closed-loop clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Steady load before, between and after the events.
    #[arg(long, default_value_t = 5)]
    steady_seconds: u64,
    /// How long the killed replica stays down.
    #[arg(long, default_value_t = 8)]
    down_seconds: u64,
    /// Also run each shape with the gateway's default picker settings (no ejection, no
    /// health check), to see what kvgate's settings save; its rules are not enforced.
    #[arg(long)]
    with_gateway_defaults: bool,
    /// Where the report goes (`picker-failover.md`).
    #[arg(long, default_value = "target/picker-failover")]
    out: std::path::PathBuf,
}

async fn progress_sleep(load: &Load, seconds: u64, what: &str) {
    let start = Instant::now();
    let before = load.done();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let rate = (load.done() - before) as f64 / start.elapsed().as_secs_f64();
    println!("        {what}: {} requests ended so far ({rate:.0}/s)", load.done());
}

async fn run(args: &Args, shape: Shape, settings: Settings) -> anyhow::Result<(String, bool)> {
    let label = match settings {
        Settings::Shipped => shape.name().to_string(),
        Settings::GatewayDefaults => format!("{}, gateway defaults", shape.name()),
    };
    println!("[{label}] starting 4 pods, NATS, 2 pickers and Envoy");
    let mut fleet = Fleet::start(shape, settings, 2, 4).await;
    let load = Load::start(&fleet.envoy.url, args.clients);
    progress_sleep(&load, args.steady_seconds, "steady").await;
    println!("[{label}] rolling restart: SIGTERM each picker in turn");
    let restart = failover::rolling_restart(&mut fleet).await;
    progress_sleep(&load, args.steady_seconds, "after the restart").await;
    println!("[{label}] kill -9 of picker 0, down {} s", args.down_seconds);
    let kill = failover::kill(&mut fleet, 0, Duration::from_secs(args.down_seconds)).await;
    progress_sleep(&load, args.steady_seconds, "after the kill").await;
    println!("[{label}] NATS down {} s", args.down_seconds);
    let outage = failover::bus_outage(&mut fleet, Duration::from_secs(args.down_seconds)).await;
    progress_sleep(&load, args.steady_seconds, "after NATS came back").await;
    let records = load.stop().await;

    let mut report = String::new();
    let seconds = |d: Option<Duration>| d.map_or("never".into(), |d| format!("{:.2} s", d.as_secs_f64()));
    writeln!(report, "\n### {label}: 2 synced pickers, 4 pods, {} closed-loop clients\n", args.clients)?;
    writeln!(
        report,
        "| event | requests | failed | of them in flight at it | started 0–1 s after | 1–3 s | later | failures | open on the replica | settled |"
    )?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|")?;
    let mut passed = true;
    for event in [&restart, &kill, &outage] {
        let c = failover::cost(&records, event);
        let held = match event.open_on_victim {
            None => c.failed == 0,
            Some(open) => c.failed as u64 <= open && c.failed_1_to_3 + c.failed_after_3 == 0,
        };
        passed &= held;
        writeln!(
            report,
            "| {}{} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            event.name,
            if held { "" } else { " **FAILED**" },
            c.requests,
            c.failed,
            c.failed_before,
            c.failed_first_second,
            c.failed_1_to_3,
            c.failed_after_3,
            if c.kinds.is_empty() { "—".into() } else { c.kinds.join(", ") },
            event.open_on_victim.map_or("—".into(), |o| o.to_string()),
            seconds(event.settled),
        )?;
    }
    let total = records.len();
    let failed = records.iter().filter(|r| !r.ok).count();
    let outside = failover::failed_outside(&records, &[&restart, &kill, &outage]).len();
    passed &= outside == 0;
    writeln!(
        report,
        "\n{total} requests in all, {failed} failed ({outside} outside the events' windows). Rules: nothing fails \
         outside an event, a rolling restart fails none; a kill fails at most the \
         exchanges open on the killed replica, none that started 1 s or more after it; NATS down fails none. `{}`. \
         \"Settled\": every replica back and healthy (restart), the dead one out of the gateway's choice (kill), \
         the replicas hearing each other again (NATS).",
        if passed { "all held" } else { "SOME FAILED" }
    )?;
    Ok((report, passed))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvgate_test_harness::quiet_children();
    let shapes: &[Shape] = match args.shape.as_str() {
        "istio" => &[Shape::Istio],
        "llm-d" => &[Shape::LlmD],
        _ => &[Shape::Istio, Shape::LlmD],
    };
    std::fs::create_dir_all(&args.out)?;
    let (mut all, mut passed) = (String::new(), true);
    for &shape in shapes {
        let (report, held) = run(&args, shape, Settings::Shipped).await?;
        println!("{report}");
        all.push_str(&report);
        passed &= held;
        if args.with_gateway_defaults {
            let (report, _) = run(&args, shape, Settings::GatewayDefaults).await?;
            println!("{report}");
            all.push_str(&report);
        }
    }
    std::fs::write(args.out.join("picker-failover.md"), &all)?;
    anyhow::ensure!(passed, "a picker event cost requests it should not have (see the report)");
    Ok(())
}
