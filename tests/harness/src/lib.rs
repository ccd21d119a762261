//! The harness kvgate's integration tests share: start `kvgate-sim` pods, real vLLM engines
//! ([`Engine`]) and other binaries of the workspace on loopback — kvgate's own processes and
//! Envoy on port 0, asked which port they got; the rest on [`free_port`]s — find the
//! project's Python venv, the Qwen3 tokenizer and vLLM's own event code (all installed by
//! `make setup`), drive helpers.

mod engine;

pub use engine::{
    ENGINE_ADAPTER, ENGINE_BLOCK_SIZE, ENGINE_LLAMA_MODEL, ENGINE_MODEL, ENGINE_SECOND_ADAPTER, ENGINE_VERSION, Engine,
    EngineOptions, TinyModel, engine_dir,
};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

fn required(path: PathBuf, what: &str) -> PathBuf {
    assert!(path.exists(), "{what} not found at {}: run `make setup` first", path.display());
    path
}

/// Python of the project venv (`make setup`), or `$KVGATE_VENV/bin/python`.
pub fn python() -> PathBuf {
    let venv = std::env::var_os("KVGATE_VENV").map(PathBuf::from).unwrap_or_else(|| root().join(".kvgate/venv"));
    required(venv.join("bin/python"), "the project venv")
}

/// A program installed in the project venv.
pub fn venv_bin(name: &str) -> PathBuf {
    required(python().parent().expect("venv bin").join(name), name)
}

/// Where `make setup` keeps what it reads out of vLLM release `version`'s wheel.
fn vllm_cache(version: &str) -> PathBuf {
    let cache = std::env::var_os("KVGATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/kvgate"));
    cache.join("vllm").join(version)
}

/// vLLM's own `kv_events.py` of release `version`, cached by `make setup`.
pub fn vllm_kv_events(version: &str) -> PathBuf {
    required(vllm_cache(version).join("kv_events.py"), "vLLM's kv_events.py")
}

/// The folder of vLLM release `version`'s sources that `make setup` extracts (its `vllm/...`
/// files the rendering references run).
pub fn vllm_sources(version: &str) -> PathBuf {
    let dir = vllm_cache(version);
    required(dir.join("vllm/entrypoints/anthropic/serving.py"), "vLLM's Messages-API sources");
    dir
}

/// The real Qwen3 `tokenizer.json` fetched by `make setup`.
pub fn qwen3_tokenizer() -> PathBuf {
    let path = std::env::var_os("KVGATE_TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".kvgate/tokenizers/qwen3/tokenizer.json"));
    required(path, "the Qwen3 tokenizer")
}

/// The real Llama 3 `tokenizer.json` fetched by `make setup` (a second model's).
pub fn llama3_tokenizer() -> PathBuf {
    required(root().join(".kvgate/tokenizers/llama3/tokenizer.json"), "the Llama 3 tokenizer")
}

/// The target directory's folder of the running test's profile (`target/<profile>`, wherever
/// `CARGO_TARGET_DIR` puts it).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> (tests) or target/<profile>/<bin> (tools) → target/<profile>
    let mut dir = exe.parent().expect("executable directory");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("target profile directory");
    }
    dir.to_path_buf()
}

/// A binary of this workspace, built for the running test's profile (`cargo test` builds
/// only the tested package's binaries, so `make test` builds all of them first).
pub fn binary(name: &str) -> PathBuf {
    let path = profile_dir().join(name);
    assert!(
        path.exists(),
        "{} not built: run `cargo build --bins` with this profile (`make test` does)",
        path.display()
    );
    path
}

/// The msgpack payload of message `index` of a fixture in `tests/fixtures/vllm/` (bytes that
/// vLLM's own publisher produced; see `tests/fixtures/README.md`).
pub fn vllm_fixture_payload(file: &str, index: usize) -> Vec<u8> {
    let path = root().join("tests/fixtures/vllm").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("fixture JSON");
    let hex = json["messages"][index]["payload_hex"].as_str().expect("payload_hex");
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect()
}

static QUIET_CHILDREN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Discard the stderr of processes started from now on (tools that print their own
/// progress); by default it is inherited, so a failing test shows its processes' logs.
pub fn quiet_children() {
    QUIET_CHILDREN.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn child_stderr() -> Stdio {
    if QUIET_CHILDREN.load(std::sync::atomic::Ordering::Relaxed) { Stdio::null() } else { Stdio::inherit() }
}

/// Polls `url` until it answers 2xx while `child` runs: Ok, or Err saying why not (the
/// child exited — typically a port taken between [`free_port`] and its bind — or `limit`
/// passed).
pub async fn wait_child_ready(child: &mut Child, url: &str, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Err(format!("exited ({status})"));
        }
        if let Ok(r) = reqwest::get(url).await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("not ready after {limit:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How often a process started on fresh ports is started again on other ports when it
/// exits during start-up (another process may bind a port between [`free_port`] and the
/// child's bind).
const START_ATTEMPTS: usize = 3;

/// Where a child says on stdout it is bound (`listening <name> <address>`, as kvgate's
/// scorer and simulator say of every listener). kvgate's own processes are started on port 0
/// and asked, so no port is handed out for something else to take first.
struct Announcements(mpsc::Receiver<(String, String)>);

impl Announcements {
    fn of(child: &mut Child) -> Announcements {
        let stdout = child.stdout.take().expect("the child's stdout is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some((name, address)) = line.strip_prefix("listening ").and_then(|l| l.split_once(' ')) {
                    let _ = tx.send((name.to_string(), address.to_string()));
                }
            }
        });
        Announcements(rx)
    }

    /// The addresses of `names`, in that order, once each is announced (Err if the child
    /// exits first or `limit` passes).
    async fn wait(&self, child: &mut Child, names: &[&str], limit: Duration) -> Result<Vec<String>, String> {
        let deadline = Instant::now() + limit;
        let mut heard = std::collections::HashMap::new();
        loop {
            heard.extend(self.0.try_iter());
            if let Some(addresses) = names.iter().map(|n| heard.get(*n).cloned()).collect() {
                return Ok(addresses);
            }
            if let Some(status) = child.try_wait().expect("try_wait") {
                return Err(format!("exited ({status})"));
            }
            if Instant::now() >= deadline {
                return Err(format!("never said where {names:?} listen ({limit:?})"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The port of an announced `ip:port` or `tcp://ip:port`.
fn port_of(address: &str) -> u16 {
    address.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port in {address:?}"))
}

/// A free TCP port on 127.0.0.1 (bound, then released for the child to take). Never the
/// same port twice in one test process, so parallel tests do not hand each other's ports out.
///
/// Taken below the kernel's ephemeral range, where no `bind(0)` and no outgoing connection
/// lands: a child that binds many seconds after the pick (a vLLM engine binds its NIXL side
/// channel after loading its model, while it and its neighbours open ports of their own)
/// would otherwise race every socket on the machine for it.
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let below = ephemeral_range_start();
    let picks = PORT_FLOOR..below.max(PORT_FLOOR + 1);
    loop {
        let port = if below > PORT_FLOOR + 1_000 {
            let port = picks.start + (random_u64() % u64::from(picks.end - picks.start)) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            port
        } else {
            // A machine whose ephemeral range leaves no room below it: the OS's pick.
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
        };
        let mut handed_out = HANDED_OUT.lock().expect("port registry");
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// The lowest port [`free_port`] hands out (well above the ports services are known by).
const PORT_FLOOR: u16 = 20_000;

/// The first port of the kernel's ephemeral range (`ip_local_port_range`; 32768 by default).
fn ephemeral_range_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A random number from the standard library's per-process hasher keys.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static DRAWS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    hasher.finish()
}

/// How long a pod may take to answer `/health` after its start.
const SIM_START_LIMIT: Duration = Duration::from_secs(20);

/// `vllm-router --policy kv_aware` (the project venv's, PyPI) in front of `pods`, on
/// loopback `port`, fed every pod's KV events (it connects to tcp endpoints and keeps only
/// frames with an empty topic); `model` is the name the pods serve.
pub fn vllm_router_command(port: u16, model: &str, pods: &[Sim]) -> Command {
    let mut cmd = Command::new(venv_bin("vllm-router"));
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &free_port().to_string()])
        .args(["--policy", "kv_aware", "--kv-event-model", model, "--kv-event-block-size", "16"])
        .args(["--log-level", "warning", "--worker-startup-timeout-secs", "30"])
        .arg("--worker-urls")
        .args(pods.iter().map(|p| p.url.clone()));
    for p in pods {
        cmd.args(["--kv-event-source", &format!("{}={}", p.url, p.events)]);
    }
    cmd
}

/// A running `kvgate-sim`; killed on drop.
pub struct Sim {
    child: Child,
    args: Vec<String>,
    pub pod_id: String,
    pub url: String,
    pub port: u16,
    pub events: String,
    pub replay: String,
}

impl Sim {
    /// Starts a pod with KV events and replay on ports of the OS's choosing, plus `extra`
    /// flags, and waits until `/health` answers.
    pub async fn start(pod_id: &str, extra: &[&str]) -> Sim {
        let mut args: Vec<String> = vec!["--listen".into(), "127.0.0.1:0".into(), "--pod-id".into(), pod_id.into()];
        let given_events = extra.iter().position(|a| *a == "--kv-events-endpoint").map(|i| extra[i + 1]);
        if given_events.is_none() {
            args.extend(["--kv-events-endpoint".into(), "tcp://127.0.0.1:0".into()]);
        }
        args.extend(["--kv-events-replay-endpoint".into(), "tcp://127.0.0.1:0".into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = spawn_sim(&args, Stdio::piped());
        // A PUB socket that connects (`--kv-events-connect`) binds nothing.
        let names: &[&str] = if extra.contains(&"--kv-events-connect") {
            &["http", "kv-events-replay"]
        } else {
            &["http", "kv-events-replay", "kv-events"]
        };
        let bound = match Announcements::of(&mut child).wait(&mut child, names, SIM_START_LIMIT).await {
            Ok(bound) => bound,
            Err(e) => panic!("kvgate-sim {pod_id} did not start: {e}"),
        };
        let (port, replay) = (port_of(&bound[0]), bound[1].clone());
        let events = bound.get(2).cloned().unwrap_or_else(|| given_events.expect("the endpoint connected to").into());
        // Restarts bind the same ports.
        for (flag, value) in
            [("--listen", format!("127.0.0.1:{port}")), ("--kv-events-replay-endpoint", replay.clone())]
                .into_iter()
                .chain(bound.get(2).map(|e| ("--kv-events-endpoint", e.clone())))
        {
            let i = args.iter().position(|a| a == flag).expect("flag given");
            args[i + 1] = value;
        }
        let url = format!("http://127.0.0.1:{port}");
        if let Err(e) = wait_child_ready(&mut child, &format!("{url}/health"), SIM_START_LIMIT).await {
            panic!("kvgate-sim {pod_id} did not become healthy: {e}");
        }
        Sim { child, args, pod_id: pod_id.into(), url, port, events, replay }
    }

    /// Kills the pod (SIGKILL: no goodbye on any socket).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the pod again on the same ports and flags (an engine restart: empty cache,
    /// event sequence from 0).
    pub async fn restart(&mut self) {
        self.kill();
        self.child = spawn_sim(&self.args, Stdio::null());
        let health = format!("{}/health", self.url);
        if let Err(e) = wait_child_ready(&mut self.child, &health, SIM_START_LIMIT).await {
            panic!("kvgate-sim {} did not come back: {e}", self.pod_id);
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit by itself (after a signal).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        reqwest::Client::new().post(format!("{}{path}", self.url)).json(body).send().await.expect("request")
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Value {
        let r = self.post(path, body).await;
        let status = r.status();
        let body: Value = r.json().await.expect("json body");
        assert!(status.is_success(), "{path} answered {status}: {body}");
        body
    }

    /// Token ids of `prompt` as the pod tokenizes it.
    pub async fn tokenize(&self, prompt: &str) -> Vec<u64> {
        let body = self.post_json("/tokenize", &serde_json::json!({"prompt": prompt})).await;
        body["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().expect("id")).collect()
    }

    /// The value of metric `name` (first sample) in `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.url)).await.expect("metrics").text().await.expect("text");
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
    }

    /// `GET /sim/requests`.
    pub async fn requests(&self) -> Vec<Value> {
        reqwest::get(format!("{}/sim/requests", self.url)).await.expect("log").json().await.expect("json")
    }
}

fn spawn_sim(args: &[String], stdout: Stdio) -> Child {
    Command::new(binary("kvgate-sim"))
        .args(args)
        .stdout(stdout)
        .stderr(child_stderr())
        .spawn()
        .expect("spawn kvgate-sim")
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process whose stdout is read line by line as JSON; killed on drop.
pub struct JsonLines {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl JsonLines {
    pub fn spawn(mut command: Command) -> JsonLines {
        let mut child = command.stdout(Stdio::piped()).stderr(child_stderr()).spawn().expect("spawn helper");
        let stdout: ChildStdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        JsonLines { child, lines }
    }

    /// The next line, parsed; panics after `limit`.
    pub fn next(&self, limit: Duration) -> Value {
        let line = self.lines.recv_timeout(limit).expect("helper produced no line in time");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("helper printed non-JSON {line:?}: {e}"))
    }

    /// Every remaining line until the helper exits.
    pub fn rest(&self, limit: Duration) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            out.push(serde_json::from_str(&line).unwrap_or_else(|e| panic!("non-JSON {line:?}: {e}")));
        }
        out
    }
}

impl Drop for JsonLines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// vLLM's own decoder subscribed to `endpoint`; returns once it is subscribed.
pub fn vllm_subscriber(version: &str, endpoint: &str, count: usize, extra: &[&str]) -> JsonLines {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/tools/vllm_kv_events.py"))
        .arg("--kv-events")
        .arg(vllm_kv_events(version))
        .args(["subscribe", "--endpoint", endpoint, "--count", &count.to_string(), "--timeout", "20"])
        .args(extra);
    let sub = JsonLines::spawn(cmd);
    assert_eq!(sub.next(Duration::from_secs(20))["ready"], true);
    sub
}

/// vLLM's replay protocol through a DEALER: every reply until the end marker.
pub fn vllm_replay(version: &str, endpoint: &str, start: u64) -> Vec<Value> {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tests/tools/vllm_kv_events.py")).arg("--kv-events").arg(vllm_kv_events(version)).args([
        "replay",
        "--endpoint",
        endpoint,
        "--start",
        &start.to_string(),
        "--timeout",
        "10",
    ]);
    JsonLines::spawn(cmd).rest(Duration::from_secs(20))
}

/// A completions request body.
pub fn completion(prompt: &str, max_tokens: u32) -> Value {
    serde_json::json!({"prompt": prompt, "max_tokens": max_tokens})
}

/// A long, distinctive text of about `words` words.
pub fn text(seed: &str, words: usize) -> String {
    (0..words).map(|i| format!("{seed}{}", i % 97)).collect::<Vec<_>>().join(" ")
}

/// ASCII text of exactly `tokens` tokens for the fallback tokenizer (4 bytes per token).
pub fn sized(seed: &str, tokens: usize) -> String {
    let mut s = text(seed, tokens);
    s.truncate(tokens * 4);
    assert_eq!(s.len(), tokens * 4, "seed too short for {tokens} tokens");
    s
}

/// A running `kvgate-scorer` on a free port; killed on drop.
pub struct ScorerProcess {
    child: Child,
    pub url: String,
    pub port: u16,
    /// The Endpoint Picker's gRPC port, when the configuration has one.
    pub epp_port: Option<u16>,
    pub config_path: PathBuf,
    /// The binary it runs (restarts run it again).
    binary: PathBuf,
}

/// The kvgate builds a test or a benchmark runs: this workspace's, or an earlier one's (its
/// binaries gathered in one directory) to measure beside it.
#[derive(Clone, Debug)]
pub struct Build {
    pub scorer: PathBuf,
    pub wasm: PathBuf,
    pub native: PathBuf,
    /// Whether its scorer says where it listens (an earlier build may predate it: it is
    /// handed free ports instead).
    announces: bool,
}

impl Build {
    /// This workspace's build (`make test` makes it).
    pub fn current() -> Build {
        // The native module is looked for when a test asks for it: `make demo` builds the
        // wasm filter only.
        Build { scorer: binary("kvgate-scorer"), wasm: filter_wasm(), native: native_module_path(), announces: true }
    }

    /// A build whose `kvgate-scorer`, `kvgate_filter.wasm` and `libkvgate_filter_native.so`
    /// are in `dir`.
    pub fn in_dir(dir: &std::path::Path) -> Build {
        let file = |name: &str| required(dir.join(name), name);
        Build {
            scorer: file("kvgate-scorer"),
            wasm: file("kvgate_filter.wasm"),
            native: file("libkvgate_filter_native.so"),
            announces: false,
        }
    }
}

/// Stands for the Endpoint Picker's port in a configuration given to [`ScorerProcess::start`]
/// (e.g. `epp: {listen: '127.0.0.1:${EPP_PORT}'}`): one the OS picks.
pub const EPP_PORT: &str = "${EPP_PORT}";

impl ScorerProcess {
    /// Starts the scorer with `config` (YAML without `listen`, which is added, and with the
    /// debug endpoints on unless it has an `admin` section; [`EPP_PORT`] stands for the
    /// picker's port) on ports the OS picks, and waits for `/healthz` (and the picker's port).
    /// Its configuration file then names the ports it got (what Envoy's bootstrap is made
    /// from, and what a restart binds).
    pub async fn start(config: &str) -> ScorerProcess {
        Self::start_built(config, &Build::current()).await
    }

    /// Like [`ScorerProcess::start`], running `build`'s scorer.
    pub async fn start_built(config: &str, build: &Build) -> ScorerProcess {
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let with_epp = config.contains(EPP_PORT);
        // The tests read `/v1/pods` and `?explain=1`: on unless the config sets `admin`.
        let debug = if config.contains("admin:") { "" } else { "admin: {debug_endpoints: true}\n" };
        let render = |port: u16, epp_port: u16| {
            format!("listen: 127.0.0.1:{port}\n{debug}{}", config.replace(EPP_PORT, &epp_port.to_string()))
        };
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let config_path = std::env::temp_dir().join(format!("kvgate-scorer-{}-{n}.yaml", std::process::id()));
        let mut why = String::new();
        for _ in 0..START_ATTEMPTS {
            let (port, epp_port) = if build.announces { (0, 0) } else { (free_port(), free_port()) };
            std::fs::write(&config_path, render(port, epp_port)).expect("write scorer config");
            let mut child = spawn_scorer(&build.scorer, &config_path, Stdio::piped());
            let names: &[&str] = if with_epp { &["api", "epp"] } else { &["api"] };
            let ports = match build.announces {
                true => Announcements::of(&mut child)
                    .wait(&mut child, names, Duration::from_secs(30))
                    .await
                    .map(|bound| (port_of(&bound[0]), bound.get(1).map(|epp| port_of(epp)))),
                false => Ok((port, with_epp.then_some(epp_port))),
            };
            let mut scorer = ScorerProcess {
                child,
                url: String::new(),
                port,
                epp_port: None,
                config_path: config_path.clone(),
                binary: build.scorer.clone(),
            };
            let up = match ports {
                Ok((port, epp_port)) => {
                    (scorer.port, scorer.epp_port, scorer.url) = (port, epp_port, format!("http://127.0.0.1:{port}"));
                    std::fs::write(&config_path, render(port, epp_port.unwrap_or_default()))
                        .expect("write scorer config");
                    scorer.wait_up().await
                }
                Err(e) => Err(e),
            };
            match up {
                Ok(()) => return scorer,
                Err(e) => why = e, // dropped: killed, config removed
            }
        }
        panic!("kvgate-scorer did not come up: {why}");
    }

    async fn wait_up(&mut self) -> Result<(), String> {
        let health = format!("{}/healthz", self.url);
        wait_child_ready(&mut self.child, &health, Duration::from_secs(30)).await?;
        if let Some(port) = self.epp_port {
            let deadline = Instant::now() + Duration::from_secs(10);
            while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                if let Some(status) = self.child.try_wait().expect("try_wait") {
                    return Err(format!("exited ({status})"));
                }
                if Instant::now() >= deadline {
                    return Err(format!("the endpoint picker's port {port} never opened"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Freezes the scorer (SIGSTOP): it accepts connections but never answers. Returns once
    /// every thread has stopped: a stop reaches a process's threads one by one, and on a
    /// loaded machine the others may run (and answer) for a while meanwhile.
    pub fn pause(&self) {
        let pid = self.child.id();
        signal(pid, "-STOP");
        assert!(
            holds_within(Duration::from_secs(10), || all_threads_stopped(pid)),
            "scorer {pid} did not stop within 10 s"
        );
    }

    /// Thaws a paused scorer (SIGCONT).
    pub fn resume(&self) {
        signal(self.child.id(), "-CONT");
    }

    /// Kills the scorer (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Asks the scorer to stop (SIGTERM) and waits up to `limit` for it to exit: its exit
    /// status, or `None` if it is still running.
    pub async fn stop(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        self.terminate();
        self.wait_exit(limit).await
    }

    /// Sends SIGTERM (a rolling update's step) without waiting.
    pub fn terminate(&self) {
        signal(self.child.id(), "-TERM");
    }

    /// Waits up to `limit` for the process to exit: its exit status, or `None` if it is
    /// still running.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the scorer again with the same configuration and port.
    pub async fn restart(&mut self) {
        self.kill();
        self.child = spawn_scorer(&self.binary, &self.config_path, Stdio::null());
        if let Err(e) = self.wait_up().await {
            panic!("kvgate-scorer did not come back: {e}");
        }
    }

    /// Polls `/readyz` until it answers 200 (`limit` at most): subscribed to every pod's
    /// events with its index rebuilt from its replay buffer, other replicas heard (with
    /// `sync`), some pod healthy.
    pub async fn wait_ready(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let why = match reqwest::get(format!("{}/readyz", self.url)).await {
                Ok(r) if r.status().is_success() => return,
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(e) => e.to_string(),
            };
            assert!(Instant::now() < deadline, "kvgate-scorer never became ready: {why}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Polls until no request is in flight on any pod (lifecycle reports all arrived).
    pub async fn wait_idle(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let pods = self.pods().await;
            if pods.iter().all(|p| p["inflight_requests"] == 0) {
                return;
            }
            assert!(Instant::now() < deadline, "requests still in flight: {pods:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `POST /v1/route` for a request body sent to `api_path`: (status, JSON answer).
    pub async fn route(&self, api_path: &str, request_id: &str, body: &Value, explain: bool) -> (u16, Value) {
        let url = format!("{}/v1/route{}", self.url, if explain { "?explain=1" } else { "" });
        let r = reqwest::Client::new()
            .post(url)
            .header("x-request-id", request_id)
            .header("x-kvgate-api-path", api_path)
            .body(body.to_string())
            .send()
            .await
            .expect("route call");
        let status = r.status().as_u16();
        (status, r.json().await.expect("JSON answer"))
    }

    /// Reports `request_id` cancelled (`POST /v1/lifecycle`, as the filter would): releases
    /// the bookings of a decision made through [`ScorerProcess::route`] and never served.
    /// Not `done`: a request done leaves its prompt taken as cached on its pod.
    pub async fn report_cancelled(&self, request_id: &str) {
        let cancelled = serde_json::json!({"reports": [{"request_id": request_id, "event": "cancelled"}]});
        let r = reqwest::Client::new()
            .post(format!("{}/v1/lifecycle", self.url))
            .json(&cancelled)
            .send()
            .await
            .expect("lifecycle");
        assert_eq!(r.json::<Value>().await.expect("JSON answer")["accepted"], 1, "{request_id} was in flight");
    }

    /// `/metrics` as text; empty when the scorer does not answer.
    pub async fn metrics_text(&self) -> String {
        match reqwest::get(format!("{}/metrics", self.url)).await {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// The sum of a metric's samples in `/metrics` — every label set of `name`, or one
    /// series when `name` carries its labels; 0 when absent or the scorer does not answer.
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics_text()
            .await
            .lines()
            .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{' | b' ')))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// `GET /v1/pods`.
    pub async fn pods(&self) -> Vec<Value> {
        reqwest::get(format!("{}/v1/pods", self.url)).await.expect("pods").json().await.expect("json")
    }

    /// The pod entry named `name` in `/v1/pods`.
    pub async fn pod(&self, name: &str) -> Value {
        self.find_pod(name).await.unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// The pod entry named `name` in `/v1/pods`, if it is listed.
    async fn find_pod(&self, name: &str) -> Option<Value> {
        self.pods().await.into_iter().find(|p| p["name"] == name)
    }

    /// Polls `/v1/pods` until pod `name` is listed and `check` holds for it (a discovered
    /// pod may appear some time after the scorer is ready); panics after `limit`.
    pub async fn wait_pod(&self, name: &str, limit: Duration, check: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let state = match self.find_pod(name).await {
                Some(pod) if check(&pod) => return pod,
                Some(pod) => pod.to_string(),
                None => "not listed".to_owned(),
            };
            assert!(Instant::now() < deadline, "pod {name} never reached the expected state: {state}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether `check` holds within `limit` (polled every millisecond).
fn holds_within(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !check() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // `pid (comm) state …`; the command name may hold spaces or parentheses.
        stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) == Some("T")
    })
}

fn signal(pid: u32, which: &str) {
    let status = Command::new("kill").args([which, &pid.to_string()]).status().expect("run kill");
    assert!(status.success(), "kill {which} {pid} failed");
}

fn spawn_scorer(binary: &std::path::Path, config_path: &std::path::Path, stdout: Stdio) -> Child {
    Command::new(binary)
        .arg("--config")
        .arg(config_path)
        .stdout(stdout)
        .stderr(child_stderr())
        .spawn()
        .expect("spawn kvgate-scorer")
}

impl Drop for ScorerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Killed, it leaves its route socket (a scorer stopped by a signal removes it).
        let config = std::fs::read_to_string(&self.config_path).unwrap_or_default();
        if let Some(socket) = config.lines().find_map(|line| line.strip_prefix("route_socket_path:")) {
            let _ = std::fs::remove_file(socket.trim());
        }
        let _ = std::fs::remove_file(&self.config_path);
    }
}

/// Envoy 1.40 as installed by `make setup`.
pub fn envoy_binary() -> PathBuf {
    required(root().join(".kvgate/bin/envoy"), "Envoy")
}

/// The filter module built for `wasm32-wasip1` (`make test` builds it), in the target
/// directory the tests run from.
pub fn filter_wasm() -> PathBuf {
    let target = profile_dir().parent().expect("target directory").to_path_buf();
    required(target.join("wasm32-wasip1/release/kvgate_filter.wasm"), "the kvgate filter .wasm")
}

/// The filter's native module (an Envoy dynamic module; `make test` builds it, release).
pub fn filter_native() -> PathBuf {
    required(native_module_path(), "the kvgate filter's native module")
}

fn native_module_path() -> PathBuf {
    profile_dir().parent().expect("target directory").join("release/libkvgate_filter_native.so")
}

/// A fresh path for a bootstrap.
fn envoy_bootstrap_path() -> PathBuf {
    static RENDERED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RENDERED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("kvgate-envoy-{}-{n}.yaml", std::process::id()))
}

/// A running Envoy with the kvgate filter in front of a scorer's pods; killed on drop.
pub struct EnvoyProcess {
    child: Child,
    pub url: String,
    pub admin: String,
    pub config_path: PathBuf,
}

impl EnvoyProcess {
    /// Renders the bootstrap for `scorer` with `kvgate-envoy-config` (extra flags such as
    /// `--failure-mode closed` appended) and starts Envoy on free ports.
    pub async fn start(scorer: &ScorerProcess, extra: &[&str]) -> EnvoyProcess {
        Self::start_for(&scorer.config_path, extra).await
    }

    /// Like [`EnvoyProcess::start`], for a scorer configuration file (whose `listen` may be
    /// any server standing in for the scorer).
    pub async fn start_for(scorer_config: &std::path::Path, extra: &[&str]) -> EnvoyProcess {
        Self::start_patched(scorer_config, extra, |bootstrap| bootstrap).await
    }

    /// Like [`EnvoyProcess::start_for`], with the rendered bootstrap changed by `patch` first
    /// (e.g. a filter a test needs in front).
    pub async fn start_patched(
        scorer_config: &std::path::Path,
        extra: &[&str],
        patch: impl Fn(String) -> String,
    ) -> EnvoyProcess {
        Self::launch(scorer_config, extra, patch, 1, &Build::current()).await
    }

    /// Like [`EnvoyProcess::start`], with `build`'s filter modules.
    pub async fn start_built(scorer: &ScorerProcess, extra: &[&str], build: &Build) -> EnvoyProcess {
        Self::launch(&scorer.config_path, extra, |bootstrap| bootstrap, 1, build).await
    }

    /// Like [`EnvoyProcess::start`], with `workers` Envoy workers instead of one.
    pub async fn start_with_workers(scorer: &ScorerProcess, extra: &[&str], workers: usize) -> EnvoyProcess {
        Self::launch(&scorer.config_path, extra, |bootstrap| bootstrap, workers, &Build::current()).await
    }

    /// Starts Envoy on a bootstrap of the caller's (e.g. another gateway's shape), made for
    /// its (listener, admin) ports: 0 and 0, the OS picks them.
    pub async fn start_bootstrap(bootstrap: impl Fn(u16, u16) -> String) -> EnvoyProcess {
        let config_path = envoy_bootstrap_path();
        std::fs::write(&config_path, bootstrap(0, 0)).expect("write the bootstrap");
        Self::run(config_path, 1).await.unwrap_or_else(|e| panic!("envoy did not become ready: {e}"))
    }

    async fn launch(
        scorer_config: &std::path::Path,
        extra: &[&str],
        patch: impl Fn(String) -> String,
        workers: usize,
        build: &Build,
    ) -> EnvoyProcess {
        let config_path = envoy_bootstrap_path();
        let status = Command::new(binary("kvgate-envoy-config"))
            .arg("--scorer-config")
            .arg(scorer_config)
            .arg("--wasm")
            .arg(&build.wasm)
            .args(
                extra
                    .contains(&"native")
                    .then(|| {
                        let module = required(build.native.clone(), "the kvgate filter's native module");
                        ["--native-module".into(), module.into_os_string()]
                    })
                    .into_iter()
                    .flatten(),
            )
            .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .arg("--out")
            .arg(&config_path)
            .args(extra)
            .status()
            .expect("run kvgate-envoy-config");
        assert!(status.success(), "kvgate-envoy-config failed");
        let bootstrap = std::fs::read_to_string(&config_path).expect("rendered bootstrap");
        std::fs::write(&config_path, patch(bootstrap)).expect("patched bootstrap");
        Self::run(config_path, workers).await.unwrap_or_else(|e| panic!("envoy did not become ready: {e}"))
    }

    /// Runs Envoy on the bootstrap at `config_path`, its listener and admin on ports the OS
    /// picks, until it is ready (else the reason, having killed it and removed the
    /// bootstrap). Envoy writes its admin address to a file; the admin names the listener's.
    async fn run(config_path: PathBuf, workers: usize) -> Result<EnvoyProcess, String> {
        let admin_path = config_path.with_extension("admin");
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", &workers.to_string(), "--use-dynamic-base-id", "-l", "warning"])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(Stdio::null())
            .stderr(child_stderr())
            .spawn()
            .expect("spawn envoy");
        let mut envoy = EnvoyProcess { child, url: String::new(), admin: String::new(), config_path };
        let deadline = Instant::now() + Duration::from_secs(30);
        // The address read the same twice running: written whole.
        let mut last = None;
        let admin = loop {
            let read = std::fs::read_to_string(&admin_path).ok().and_then(|a| a.trim().parse::<SocketAddr>().ok());
            match read {
                Some(address) if last == Some(address) => break address,
                _ if Instant::now() >= deadline => return Err("no admin address after 30 s".into()),
                _ => last = read,
            }
            if let Some(status) = envoy.child.try_wait().expect("try_wait") {
                return Err(format!("exited ({status})"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let _ = std::fs::remove_file(&admin_path);
        envoy.admin = format!("http://{admin}");
        let ready = format!("{}/ready", envoy.admin);
        wait_child_ready(&mut envoy.child, &ready, deadline.saturating_duration_since(Instant::now())).await?;
        let listeners: Value = reqwest::get(format!("{}/listeners?format=json", envoy.admin))
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("admin /listeners: {e}"))?
            .json()
            .await
            .map_err(|e| format!("admin /listeners: {e}"))?;
        let port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
            .as_u64()
            .ok_or_else(|| format!("no listener in {listeners}"))?;
        envoy.url = format!("http://127.0.0.1:{port}");
        Ok(envoy)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A counter or gauge from Envoy's admin `/stats` (0 if absent).
    pub async fn stat(&self, name: &str) -> u64 {
        let text = reqwest::get(format!("{}/stats?filter=^{name}$", self.admin))
            .await
            .expect("stats")
            .text()
            .await
            .expect("text");
        text.lines().find_map(|l| l.strip_prefix(&format!("{name}: "))).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config_path);
    }
}

/// `envoy --mode validate -c PATH`: Ok, or Envoy's complaint.
pub fn envoy_validate(path: &std::path::Path) -> Result<(), String> {
    let out = Command::new(envoy_binary())
        .args(["--mode", "validate", "--use-dynamic-base-id", "-l", "error", "-c"])
        .arg(path)
        .current_dir(root())
        .output()
        .expect("run envoy --mode validate");
    if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).into_owned()) }
}

/// CPU time a process has used so far, every thread summed (`/proc/<pid>/task/*/schedstat`,
/// nanosecond-precise, unlike `stat`'s clock ticks); zero when the process is gone.
pub fn cpu_time(pid: u32) -> Duration {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Duration::ZERO };
    let nanos: u64 = tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(nanos)
}

/// `nats-server` (Debian's package, installed by `make setup`) on a loopback port: the bus
/// of replicas that share their bookings.
pub struct NatsServer {
    child: Child,
    pub port: u16,
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    /// Arguments after the address and port (authentication, TLS, a config file).
    args: Vec<String>,
}

/// The `nats-server` binary: on `PATH`, else where Debian puts it.
fn nats_server_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join("nats-server")).find(|p| p.exists()));
    on_path.unwrap_or_else(|| required(PathBuf::from("/usr/sbin/nats-server"), "nats-server"))
}

impl NatsServer {
    /// Starts a server on a free port and waits until it accepts connections.
    pub async fn start() -> NatsServer {
        Self::start_with(&[], &[]).await
    }

    /// Starts a server with more arguments (`--auth`, `--tls…`, `-c FILE`; the address and
    /// port given here win over a config file's) and environment variables.
    pub async fn start_with(args: &[&str], env: &[(&str, &str)]) -> NatsServer {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let mut why = String::new();
        for _ in 0..START_ATTEMPTS {
            let port = free_port();
            let child = Self::spawn(port, &args, env);
            let url = format!("nats://127.0.0.1:{port}");
            let mut server = NatsServer { child, port, url, args: args.clone() };
            match server.wait_up().await {
                Ok(()) => return server,
                Err(e) => why = e,
            }
        }
        panic!("nats-server did not come up: {why}");
    }

    fn spawn(port: u16, args: &[String], env: &[(&str, &str)]) -> Child {
        Command::new(nats_server_binary())
            .args(args)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(child_stderr())
            .spawn()
            .expect("spawn nats-server")
    }

    async fn wait_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_err() {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Err(format!("exited ({status})"));
            }
            if Instant::now() >= deadline {
                return Err(format!("port {} never opened", self.port));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Kills the server (SIGKILL: its clients see the connection drop).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port.
    pub async fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(self.port, &self.args, &[]);
        if let Err(e) = self.wait_up().await {
            panic!("nats-server did not come back: {e}");
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_process_is_seen_stopped_and_a_continued_one_running() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        let pid = child.id();
        assert!(!all_threads_stopped(pid));
        signal(pid, "-STOP");
        assert!(holds_within(Duration::from_secs(5), || all_threads_stopped(pid)), "never seen stopped");
        signal(pid, "-CONT");
        assert!(holds_within(Duration::from_secs(5), || !all_threads_stopped(pid)), "never seen running again");
        let _ = child.kill();
        let _ = child.wait();
        assert!(!all_threads_stopped(pid), "a reaped process has no threads to be stopped");
    }
}
