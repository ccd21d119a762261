//! `kvgate-envoy-config`: prints the Envoy bootstrap that matches a scorer configuration, so
//! Envoy's pods cluster and the scorer's pod list can never disagree.

use anyhow::Context;
use clap::Parser;
use kvgate_scorer::config::Config;
use kvgate_scorer::envoy::{EnvoyOptions, EppBodyMode, Picker, render};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Render the Envoy bootstrap for a kvgate scorer configuration (to stdout or --out).
#[derive(Parser, Debug)]
#[command(name = "kvgate-envoy-config", version)]
struct Args {
    /// The scorer's YAML configuration (its pods and listen address are used).
    #[arg(long)]
    scorer_config: PathBuf,
    /// The kvgate filter's `.wasm` file (with `--picker wasm`).
    #[arg(long, default_value = "kvgate_filter.wasm")]
    wasm: PathBuf,
    /// The kvgate filter's native module (with `--picker native`).
    #[arg(long, default_value = "libkvgate_filter_native.so")]
    native_module: PathBuf,
    /// Envoy's listener for inference traffic.
    #[arg(long, default_value = "127.0.0.1:10000")]
    listen: SocketAddr,
    /// Envoy's admin interface.
    #[arg(long, default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
    /// Who picks the pod: `wasm` (the filter and the scorer sidecar), `native` (the filter as
    /// an Envoy dynamic module, and the scorer sidecar), `epp` (the scorer's Endpoint Picker
    /// through ext_proc; needs `epp` in the scorer configuration) or `none` (plain round
    /// robin, the baseline).
    #[arg(long, default_value = "wasm", value_parser = ["wasm", "native", "epp", "none"])]
    picker: String,
    /// When the scorer is unavailable: `open` (Envoy balances) or `closed` (503).
    #[arg(long, default_value = "open", value_parser = ["open", "closed"])]
    failure_mode: String,
    /// Timeout of a decision: the filter's route call, the ext_proc message timeout.
    #[arg(long, default_value_t = 100)]
    scorer_timeout_ms: u64,
    /// How ext_proc sends bodies to the picker: `streamed` (one round trip per request;
    /// Envoy keeps the body, so a dead or frozen picker costs no request), `buffered`, or
    /// `full-duplex` (Istio's and llm-d's). See docs/scorer.md.
    #[arg(long, default_value = "streamed", value_parser = ["streamed", "buffered", "full-duplex"])]
    epp_body_mode: String,
    /// Retries onto the next pods of the pick's list when a pod refuses the connection or
    /// resets before answering.
    #[arg(long, default_value_t = 2)]
    retries: u32,
    /// Disaggregated requests: `envoy` (the filter sends the prefill leg) or `header` (it sets
    /// x-prefiller-host-port for the decode pod's sidecar).
    #[arg(long, default_value = "envoy", value_parser = ["envoy", "header"])]
    pd_mode: String,
    /// Largest request body (bytes); larger ones get a 413.
    #[arg(long, default_value_t = 8 << 20)]
    body_limit_bytes: u64,
    /// Same as `--picker none`.
    #[arg(long)]
    baseline_round_robin: bool,
    /// Write here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Parsed and validated like the scorer does, minus the check that the tokenizer file
    // exists here: the bootstrap is often rendered away from the pod that runs the scorer.
    let text = std::fs::read_to_string(&args.scorer_config)
        .with_context(|| format!("cannot read {}", args.scorer_config.display()))?;
    let config = Config::parse(&text)
        .with_context(|| format!("invalid scorer configuration {}", args.scorer_config.display()))?;
    let picker = match (args.baseline_round_robin, args.picker.as_str()) {
        (true, _) | (_, "none") => Picker::None,
        (_, "epp") => Picker::Epp,
        (_, "native") => Picker::Native,
        _ => Picker::Wasm,
    };
    let epp_body_mode = match args.epp_body_mode.as_str() {
        "full-duplex" => EppBodyMode::FullDuplex,
        "buffered" => EppBodyMode::Buffered,
        _ => EppBodyMode::Streamed,
    };
    let yaml = render(
        &config,
        &EnvoyOptions {
            listen: args.listen,
            admin: args.admin,
            wasm: args.wasm,
            native_module: args.native_module,
            picker,
            failure_mode: args.failure_mode,
            scorer_timeout_ms: args.scorer_timeout_ms,
            pd_mode: args.pd_mode,
            body_limit_bytes: args.body_limit_bytes,
            epp_body_mode,
            retries: args.retries,
        },
    )
    .map_err(anyhow::Error::msg)?;
    match args.out {
        Some(path) => std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?,
        None => print!("{yaml}"),
    }
    Ok(())
}
