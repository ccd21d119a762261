//! `kvgate-sim`: a simulated vLLM pod for testing, demonstrating and benchmarking routers
//! without GPUs. See `tests/sim/README.md`.

mod api;
mod driver;
mod publisher;
mod server;

use anyhow::Context;
use axum::serve::{Listener as _, ListenerExt};
use clap::Parser;
use kvgate_sim::engine::{Engine, EngineConfig};
use kvgate_sim::events::{EventEncoder, EventFormat, HashFormat};
use kvgate_sim::timing::TimingModel;
use kvgate_tokenize::Tokenizer;
use server::{AppState, PodInfo, Role};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A simulated vLLM engine: OpenAI-compatible HTTP API, vLLM-style prefix cache, KV events
/// over ZMQ exactly as vLLM publishes them, and a continuous-batching timing model.
#[derive(Parser, Debug)]
#[command(name = "kvgate-sim", version)]
struct Args {
    /// HTTP address to serve the OpenAI API on. A port 0 (here or in an endpoint) is one the
    /// OS picks: every socket bound is said on stdout (`listening http|kv-events|kv-events-replay
    /// <address>`).
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// Name of this pod, returned in the `x-kvgate-pod` header of every response.
    #[arg(long)]
    pod_id: Option<String>,
    /// Served model name (`model` of requests must match, as in vLLM).
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    model: String,
    /// LoRA adapter names served beside the base model (repeatable). A request naming one in
    /// `model` hashes its blocks with the adapter name, and events carry `lora_name`.
    #[arg(long = "lora-module")]
    lora_modules: Vec<String>,
    /// LoRA adapters one batch may hold (vLLM `--max-loras`; vLLM's default is 1): a request
    /// of another adapter waits while that many run. 0: no limit.
    #[arg(long, default_value_t = 0)]
    max_loras: usize,
    /// Model milliseconds a step takes longer for each adapter it loads onto the GPU.
    #[arg(long, default_value_t = 0.0)]
    lora_load_ms: f64,
    /// Run as a hybrid model (gpt-oss, Gemma 3): sliding-window attention over this many
    /// tokens beside full attention, a KV-cache group each, announced apart in the events.
    #[arg(long)]
    sliding_window: Option<usize>,
    /// P/D role: `prefill` pods serve `do_remote_decode` legs, `decode` pods
    /// `do_remote_prefill` legs, `both` either.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,

    /// HF `tokenizer.json`; the chat template comes from `tokenizer_config.json` beside it.
    /// Without it, a deterministic fallback tokenizer is used (4 UTF-8 bytes per token).
    #[arg(long)]
    tokenizer: Option<PathBuf>,

    /// ZMQ endpoint of the KV-event PUB socket (`tcp://127.0.0.1:5557`, `ipc://...`).
    /// Bound by default; see `--kv-events-connect`. No events without it.
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    /// Connect the PUB socket to the endpoint (the subscriber binds), as vLLM does for
    /// non-wildcard tcp endpoints.
    #[arg(long)]
    kv_events_connect: bool,
    /// Topic frame of every event message (vLLM's default is empty).
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    /// ROUTER endpoint serving vLLM's replay protocol for missed batches.
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    kv_events_buffer_steps: usize,
    /// Event encoding: `map` (vLLM ≥ 0.24) or `array` (vLLM ≤ 0.23). Replay replies carry the
    /// topic frame with `map` (vLLM ≥ 0.26) and omit it with `array`.
    #[arg(long, value_enum, default_value_t = EventFormat::Map)]
    event_format: EventFormat,
    /// Block-hash representation in events: `u64` (vLLM default) or 32 `bytes`.
    #[arg(long, value_enum, default_value_t = HashFormat::U64)]
    hash_format: HashFormat,
    /// Seed of the engine's block-hash chain (vLLM: PYTHONHASHSEED); random if unset.
    #[arg(long)]
    hash_seed: Option<String>,
    /// `data_parallel_rank` written in every batch.
    #[arg(long, default_value_t = 0)]
    data_parallel_rank: u64,

    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks of the cache (default ≈ an H100 80 GB serving an 8B model).
    #[arg(long, default_value_t = 26_000)]
    num_blocks: usize,
    /// Most sequences per batch.
    #[arg(long, default_value_t = 1024)]
    max_num_seqs: usize,
    /// Token budget per engine step (chunked prefill beyond it).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Longest prompt + completion.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: usize,
    /// Completion length when a request gives no `max_tokens` (a real engine stops at EOS;
    /// the simulator never samples one).
    #[arg(long, default_value_t = 128)]
    default_max_tokens: u32,

    /// Wall seconds per simulated second: 0.01 runs 100× faster than the modelled GPU; 0
    /// runs steps back to back, never waiting (an instant engine).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Timing model: fixed cost of every step, ms.
    #[arg(long, default_value_t = TimingModel::default().step_base_ms)]
    step_base_ms: f64,
    /// Timing model: cost per scheduled token, ms.
    #[arg(long, default_value_t = TimingModel::default().token_ms)]
    token_ms: f64,
    /// Timing model: cost per prefill attention (query, key) pair, ms.
    #[arg(long, default_value_t = TimingModel::default().attention_pair_ms)]
    attention_pair_ms: f64,
    /// Timing model: cost per context token read by a decoding sequence, ms.
    #[arg(long, default_value_t = TimingModel::default().kv_read_ms)]
    kv_read_ms: f64,
    /// Timing model: fixed cost of pulling a request's KV from a prefill pod, ms.
    #[arg(long, default_value_t = TimingModel::default().transfer_base_ms)]
    transfer_base_ms: f64,
    /// Timing model: cost per transferred token, ms.
    #[arg(long, default_value_t = TimingModel::default().transfer_token_ms)]
    transfer_token_ms: f64,
    /// Blocks of a host-memory offload tier (vLLM's OffloadingConnector with a CPU backend:
    /// every computed block is copied there, announced as a CPU placeholder event; a prefix
    /// found there past the GPU hit is loaded instead of computed). 0: none.
    #[arg(long, default_value_t = 0)]
    offload_blocks: usize,
    /// Timing model: fixed cost of loading a request's blocks from the offload tier, ms.
    #[arg(long, default_value_t = TimingModel::default().offload_base_ms)]
    offload_base_ms: f64,
    /// Timing model: cost per token loaded from the offload tier, ms.
    #[arg(long, default_value_t = TimingModel::default().offload_token_ms)]
    offload_token_ms: f64,
}

/// Text the engine "generates", tokenized once; its token ids are cycled.
const FILLER: &str = " The quick brown fox jumps over the lazy dog while the router keeps every cache warm.";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "kvgate_sim=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if !(args.time_scale >= 0.0 && args.time_scale.is_finite()) {
        anyhow::bail!("--time-scale must be a number ≥ 0, got {}", args.time_scale);
    }
    if args.block_size == 0 || args.num_blocks == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        anyhow::bail!("--block-size, --num-blocks, --max-num-seqs and --max-num-batched-tokens must be positive");
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?
        // Without TCP_NODELAY, Nagle + delayed ACK stall small exchanges by ≈ 40 ms.
        .tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::warn!("TCP_NODELAY: {e}");
            }
        });
    let listen = listener.local_addr().unwrap_or(args.listen);
    announce("http", &listen);
    let pod_id = args.pod_id.clone().unwrap_or_else(|| listen.to_string());

    let tokenizer = match &args.tokenizer {
        Some(path) => Tokenizer::from_file(path).with_context(|| format!("loading --tokenizer {}", path.display()))?,
        None => {
            tracing::warn!("no --tokenizer: using the deterministic fallback tokenizer (4 UTF-8 bytes per token)");
            Tokenizer::fallback()
        }
    };
    let (filler_tokens, filler_text) = filler(&tokenizer)?;

    let timing = TimingModel {
        step_base_ms: args.step_base_ms,
        token_ms: args.token_ms,
        attention_pair_ms: args.attention_pair_ms,
        kv_read_ms: args.kv_read_ms,
        transfer_base_ms: args.transfer_base_ms,
        transfer_token_ms: args.transfer_token_ms,
        offload_base_ms: args.offload_base_ms,
        offload_token_ms: args.offload_token_ms,
    };
    let engine = Engine::new(EngineConfig {
        block_size: args.block_size,
        num_blocks: args.num_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        hash_seed: args.hash_seed.clone(),
        offload_blocks: args.offload_blocks,
        timing,
        max_loras: args.max_loras,
        lora_load_ms: args.lora_load_ms,
        sliding_window: args.sliding_window,
        filler_tokens,
    });

    // Where the events are published: the bound endpoint, or the one connected to.
    let mut events_at = args.kv_events_endpoint.clone();
    let (events, publisher_stats) = match &args.kv_events_endpoint {
        Some(endpoint) => {
            let config = publisher::PublisherConfig {
                endpoint: endpoint.clone(),
                connect: args.kv_events_connect,
                replay_endpoint: args.kv_events_replay_endpoint.clone(),
                topic: args.kv_events_topic.clone(),
                buffer_steps: args.kv_events_buffer_steps,
                encoder: EventEncoder {
                    format: args.event_format,
                    hashes: args.hash_format,
                    block_size: args.block_size,
                    data_parallel_rank: Some(args.data_parallel_rank),
                },
            };
            let publisher = publisher::start(config).await?;
            if let Some(bound) = &publisher.bound {
                announce("kv-events", bound);
                events_at = Some(bound.clone());
            }
            if let Some(bound) = &publisher.replay_bound {
                announce("kv-events-replay", bound);
            }
            (Some(publisher.batches), Some((publisher.stats, publisher.garbage)))
        }
        None => {
            if args.kv_events_replay_endpoint.is_some() {
                anyhow::bail!("--kv-events-replay-endpoint needs --kv-events-endpoint");
            }
            (None, None)
        }
    };
    let handle = driver::EngineHandle::spawn(engine, args.time_scale, events);
    tokio::spawn(driver::log_stats(handle.clone(), Duration::from_secs(10)));

    let state = Arc::new(AppState {
        engine: handle,
        tokenizer: Arc::new(tokenizer),
        pod: PodInfo {
            pod_id: pod_id.clone(),
            model: args.model.clone(),
            lora_modules: args.lora_modules.clone(),
            max_loras: args.max_loras,
            role: args.role,
            listen,
            engine_id: format!("{pod_id}-engine"),
            block_size: args.block_size,
            num_blocks: args.num_blocks,
            max_model_len: args.max_model_len,
            default_max_tokens: args.default_max_tokens,
            started_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or_default(),
        },
        filler_text,
        kv_garbage: publisher_stats.as_ref().map(|(_, garbage)| garbage.clone()),
        publisher: publisher_stats.map(|(stats, _)| stats),
        log: Default::default(),
        http_errors: Default::default(),
        next_id: Default::default(),
    });

    tracing::info!(
        pod = %pod_id, %listen, role = ?args.role, events = ?events_at,
        block_size = args.block_size, num_blocks = args.num_blocks, time_scale = args.time_scale,
        "kvgate-sim ready"
    );

    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let mut graceful = stop_rx.clone();
    let server = axum::serve(listener, server::router(state))
        .with_graceful_shutdown(async move {
            let _ = graceful.wait_for(|stop| *stop).await;
        })
        .into_future();
    tokio::select! {
        result = server => result.context("HTTP server failed")?,
        _ = async {
            let _ = stop_rx.wait_for(|stop| *stop).await;
            // Streams still open after a grace period are cut.
            tokio::time::sleep(Duration::from_secs(5)).await;
        } => tracing::warn!("open streams cut at shutdown"),
    }
    tracing::info!("kvgate-sim stopped");
    Ok(())
}

/// Token ids of the filler text and the text of each id.
fn filler(tokenizer: &Tokenizer) -> anyhow::Result<(Vec<u32>, HashMap<u32, String>)> {
    let ids = tokenizer.encode(FILLER, false).context("tokenizing the filler text")?;
    let text = match tokenizer.decode(&ids) {
        // A real tokenizer: each id decodes to its piece of the text.
        Some(_) => ids.iter().map(|&id| (id, tokenizer.decode(&[id]).unwrap_or_default())).collect(),
        // The fallback cannot decode: its 4-byte groups are the text.
        None => ids
            .iter()
            .zip(FILLER.as_bytes().chunks(kvgate_tokenize::FALLBACK_BYTES_PER_TOKEN))
            .map(|(&id, bytes)| (id, String::from_utf8_lossy(bytes).into_owned()))
            .collect(),
    };
    Ok((ids, text))
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Says on stdout where a socket is bound (`listening <name> <address>`): one asked for on
/// port 0 gets its port from the OS, and whoever started the simulator reads it here.
fn announce(name: &str, address: &dyn std::fmt::Display) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "listening {name} {address}").and_then(|()| out.flush());
}
