//! `kvgate-scorer`: the sidecar that tells the Envoy filter which pod should serve each
//! request. See docs/scorer.md and docs/configuration.md.

use anyhow::Context;
use clap::Parser;
use kvgate_scorer::config::Config;
use kvgate_scorer::discovery::{self, PodEndpoints};
use kvgate_scorer::picking::Picker;
use kvgate_scorer::prompt::ModelTokenizers;
use kvgate_scorer::scorer::Scorer;
use kvgate_scorer::traces::Traces;
use kvgate_scorer::transport::announce;
use kvgate_tokenize::Tokenizer;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// KV-cache-aware pod selection for LLM inference behind Envoy.
#[derive(Parser, Debug)]
#[command(name = "kvgate-scorer", version)]
struct Args {
    /// The YAML configuration file.
    #[arg(long)]
    config: PathBuf,
    /// Validate the configuration (and load the tokenizer), then exit.
    #[arg(long)]
    check: bool,
    /// Log lines as text, or as JSON objects, one per line (`timestamp`, `level`, `message`,
    /// `target` and the event's fields), for log pipelines. Levels: `RUST_LOG`.
    #[arg(long, env = "KVGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "kvgate_scorer=info".into()),
        )
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // In the log's own format: a pipeline reading JSON sees why the scorer stopped.
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let config =
        Config::load(&args.config).with_context(|| format!("invalid configuration {}", args.config.display()))?;
    let load = |field: &str, path: &std::path::Path| -> anyhow::Result<Tokenizer> {
        let mut tokenizer = Tokenizer::from_file(path).with_context(|| format!("{field}: {}", path.display()))?;
        if config.tokenizer_cache_tokens > 0
            && let Err(why) = tokenizer.cache_segments(config.tokenizer_cache_tokens)
        {
            tracing::warn!("{field}: tokenizer cache off: {why}; every prompt is tokenized in full");
        }
        Ok(tokenizer)
    };
    let tokenizer = match &config.tokenizer {
        Some(path) => load("tokenizer", path)?,
        None => {
            tracing::warn!(
                "no tokenizer configured: prompt tokens are estimated (4 bytes per token) and every pod is indexed \
                 approximately (what kvgate routed there), not from its KV events"
            );
            Tokenizer::fallback()
        }
    };
    let mut tokenizers = ModelTokenizers::new(tokenizer);
    for (i, model) in config.models.iter().enumerate() {
        tokenizers.add(&model.name, load(&format!("models[{i}].tokenizer"), &model.tokenizer)?);
    }
    if args.check {
        println!("configuration {} is valid ({} pods)", args.config.display(), config.pods.len());
        return Ok(());
    }
    let listen = config.listen;
    let admin_listen = config.admin.listen;
    let mut traces = None;
    if let Some(section) = &config.traces {
        let ttl = Duration::from_secs_f64(config.load.request_ttl_seconds);
        traces = Some(Arc::new(Traces::start(section, ttl).context("traces")?));
        tracing::info!(endpoint = ?section.otlp_endpoint, sample_ratio = section.sample_ratio, "exporting decision spans over OTLP");
    }
    let scorer = Arc::new(Scorer::new(config, tokenizers));
    let picker = Picker::new(scorer.clone(), traces.clone());

    // The configured pods' tasks run for good.
    for (p, &id) in scorer.config.pods.iter().zip(scorer.static_pods()) {
        let endpoints = PodEndpoints {
            kv_events: p.kv_events.clone(),
            kv_events_replay: p.kv_events_replay.clone(),
            metrics: p.metrics.clone(),
        };
        discovery::spawn_pod_tasks(&scorer, id, &endpoints);
    }
    for k in scorer.config.discovery.kubernetes.clone() {
        tracing::info!(namespace = %k.namespace, selector = %k.label_selector, "discovering pods through the Kubernetes API");
        tokio::spawn(discovery::kubernetes::run(scorer.clone(), k));
    }
    if let Some(pool) = scorer.config.discovery.inference_pool.clone() {
        tracing::info!(namespace = %pool.namespace, pool = %pool.name, "discovering the pods of an InferencePool");
        if pool.inference_objectives {
            tokio::spawn(discovery::inference_pool::run_objectives(scorer.clone(), pool.clone()));
        }
        if pool.inference_model_rewrites {
            tokio::spawn(discovery::inference_pool::run_model_rewrites(scorer.clone(), pool.clone()));
        }
        tokio::spawn(discovery::inference_pool::run(scorer.clone(), pool));
    }
    for dns in scorer.config.discovery.dns.clone() {
        tracing::info!(name = %dns.name, port = dns.port, role = ?dns.role, "discovering pods by DNS every {} s", dns.interval_seconds);
        tokio::spawn(discovery::dns::run(scorer.clone(), dns));
    }
    if let Some(sync) = scorer.config.sync.clone() {
        let credentials = kvgate_scorer::sync::NatsCredentials::read(&sync)?;
        tokio::spawn(kvgate_scorer::sync::run(scorer.clone(), sync, credentials));
    }
    let (expiring, expiring_spans) = (scorer.clone(), traces.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            expiring.expire();
            if let Some(traces) = &expiring_spans {
                traces.expire();
            }
        }
    });

    // SIGTERM: not ready at once, everything answered for `shutdown.drain_seconds` while
    // gateways move away, then the listeners close.
    let (stopping, stop) = tokio::sync::watch::channel(false);
    let draining = scorer.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        let drain = draining.config.shutdown.drain();
        draining.start_draining();
        tracing::info!("stopping: not ready; answering for {} s more, then closing", drain.as_secs_f64());
        tokio::time::sleep(drain).await;
        let _ = stopping.send(true);
    });
    let stopped = move || {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        }
    };

    let mut epp_thread = None;
    if let Some(epp) = scorer.config.epp.clone() {
        // Its own thread and single-threaded runtime: a gateway multiplexes every request on
        // one HTTP/2 connection, whose frames and streams are then handled on one thread
        // without handing each message to another (measured: less CPU per request).
        let picker = picker.clone();
        let (stopped, finish) = (stopped(), scorer.config.shutdown.finish());
        epp_thread = Some(std::thread::Builder::new().name("kvgate-epp".into()).spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let served = runtime
                .map_err(anyhow::Error::from)
                .and_then(|rt| rt.block_on(kvgate_scorer::transport::epp::serve(picker, epp, stopped, finish)));
            if let Err(e) = served {
                tracing::error!("endpoint picker failed: {e:#}");
                std::process::exit(1);
            }
        })?);
    }
    if let Some(admin) = admin_listen {
        let listener =
            tokio::net::TcpListener::bind(admin).await.with_context(|| format!("cannot listen on {admin}"))?;
        let admin = listener.local_addr().unwrap_or(admin);
        tracing::info!(%admin, "admin endpoints on their own address");
        announce("admin", admin);
        let router = kvgate_scorer::serve::admin_router(scorer.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router).await {
                tracing::error!("admin server failed: {e}");
            }
        });
    }
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
    let threads =
        scorer.config.listen_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let listen = listener.local_addr().unwrap_or(listen);
    tracing::info!(%listen, threads, pods = scorer.num_pods(), policy = ?scorer.config.policy, "kvgate-scorer ready");
    announce("api", listen);
    let unix = match &scorer.config.route_socket_path {
        Some(path) => Some(bind_route_socket_path(path)?),
        None => None,
    };
    kvgate_scorer::serve::serve(
        listener,
        unix,
        kvgate_scorer::serve::api_router(scorer.clone(), picker.clone()),
        picker,
        threads,
        stopped(),
    )
    .await?;
    if let Some(epp) = epp_thread {
        // The picker's open exchanges finish (up to `shutdown.finish_seconds`).
        let _ = tokio::task::spawn_blocking(move || epp.join()).await;
    }
    if let Some(path) = &scorer.config.route_socket_path {
        let _ = std::fs::remove_file(path);
    }
    if let Some(traces) = traces {
        let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
    }
    tracing::info!("kvgate-scorer stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {},
        _ = term.recv() => {},
    }
}

/// Listens on the route socket path, replacing a socket a previous run left (and refusing
/// to replace anything else).
fn bind_route_socket_path(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("cannot replace the stale route socket {}", path.display()))?,
        Ok(_) => anyhow::bail!("route_socket_path {} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on route_socket_path {}", path.display()))?;
    tracing::info!(path = %path.display(), "route sockets on a Unix socket too");
    Ok(listener)
}
