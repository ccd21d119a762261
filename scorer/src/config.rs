//! The scorer's YAML configuration. Every field is documented in docs/configuration.md,
//! generated from these types (`make docs`); unknown fields and invalid values stop start-up
//! with a message naming the field.

use kvgate_route_api::lifecycle::header_name;
use kvgate_routing::policy::PolicyConfig;
use serde::Deserialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// A configuration problem, named by its field path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid<T>(field: impl Into<String>, message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid { field: field.into(), message: message.into() })
}

use kvgate_routing::index::IndexConfig;
use kvgate_routing::load::LoadConfig;
pub use kvgate_routing::router::Role;
use kvgate_routing::router::{Admission, PdConfig, RouterConfig};
use kvgate_routing::validate::{Invalid, check, non_negative, positive};

/// One vLLM pod.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PodConfig {
    /// Unique name, used in logs, metrics and `/v1/pods`.
    pub name: String,
    /// `ip:port` of the pod's HTTP server: what Envoy routes to.
    #[serde(deserialize_with = "ip_port")]
    pub address: SocketAddr,
    #[serde(default = "default_role")]
    pub role: Role,
    /// ZMQ endpoint of the pod's KV-event publisher (`tcp://host:port` or `ipc://path`).
    /// Without it the pod is indexed approximately (what kvgate routed there, with a TTL).
    pub kv_events: Option<ZmqEndpoint>,
    /// ZMQ ROUTER endpoint of the pod's replay socket, to fetch batches lost in a gap.
    pub kv_events_replay: Option<ZmqEndpoint>,
    /// URL of the pod's Prometheus `/metrics`, scraped for load and health.
    pub metrics: Option<String>,
    /// How much longer than the fleet's average pod this one takes (2: an older GPU at half
    /// the speed), where it is known: applied from the first request, before its first
    /// tokens could teach it — a cold fleet places its first prefixes by it, and later
    /// requests follow them — and refined by what it then reports (`load.pod_speed`).
    /// Unset: learned alone. A discovered pod declares it in its annotation
    /// `kvgate.io/slowness`.
    pub slowness: Option<f64>,
}

fn default_role() -> Role {
    Role::Both
}

/// A ZMQ endpoint kvgate connects to: `tcp://host:port` or `ipc://path`, checked when read.
#[derive(Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String")]
pub struct ZmqEndpoint(String);

/// Shown as the endpoint it is (`"tcp://10.0.0.1:5557"`).
impl std::fmt::Debug for ZmqEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl ZmqEndpoint {
    /// `tcp://host:port`.
    pub fn tcp(host: impl std::fmt::Display, port: u16) -> Self {
        ZmqEndpoint(format!("tcp://{host}:{port}"))
    }
}

impl TryFrom<String> for ZmqEndpoint {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.split_once("://") {
            Some(("tcp" | "ipc", rest)) if !rest.is_empty() => Ok(ZmqEndpoint(text)),
            _ => Err(format!("{text:?} is not a ZMQ endpoint (tcp://host:port or ipc://path)")),
        }
    }
}

impl std::ops::Deref for ZmqEndpoint {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// NATS server URLs (`nats://` or `tls://`): one, several comma-separated, or a list.
#[derive(Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[schemars(with = "String")]
pub struct NatsUrls(Vec<String>);

impl<'de> Deserialize<'de> for NatsUrls {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Joined(String),
            Listed(Vec<String>),
        }
        let urls: Vec<String> = match Written::deserialize(deserializer)? {
            Written::Joined(text) => text.split(',').map(|u| u.trim().to_string()).collect(),
            Written::Listed(urls) => urls.into_iter().map(|u| u.trim().to_string()).collect(),
        };
        match urls.iter().find(|u| !(u.starts_with("nats://") || u.starts_with("tls://"))) {
            Some(bad) => Err(serde::de::Error::custom(format!("{bad:?} is not a nats:// or tls:// URL"))),
            None if urls.is_empty() => Err(serde::de::Error::custom("no NATS URL")),
            None => Ok(NatsUrls(urls)),
        }
    }
}

impl NatsUrls {
    pub fn urls(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }
}

impl std::fmt::Display for NatsUrls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

/// An `ip:port`, read once at load (an error quotes the value; the parser's points at it).
fn ip_port<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|_| serde::de::Error::custom(format!("{text:?} is not ip:port")))
}

/// Scraping of pods' `/metrics`.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSection {
    /// How often each pod's `/metrics` is scraped.
    pub scrape_interval_ms: u64,
    /// A scrape not answered within this long has failed.
    pub scrape_timeout_ms: u64,
    /// Consecutive failed scrapes (timeouts, error statuses) after which a pod stops being
    /// chosen; a refused connection takes it out at once.
    pub unhealthy_after: u32,
    /// A pod without `/metrics` that was taken out (its pick refused the connection) is
    /// tried again after this long.
    pub retry_seconds: f64,
    /// At start, how long `/readyz` (and the picker's gRPC health) waits at most for every
    /// healthy pod's index to be rebuilt from its replay buffer (`kv_events_replay`), so a
    /// new replica does not route on an empty index; pods still not caught up then are
    /// logged.
    pub catch_up_wait_ms: u64,
}

impl Default for HealthSection {
    fn default() -> Self {
        Self {
            scrape_interval_ms: 1000,
            scrape_timeout_ms: 500,
            unhealthy_after: 3,
            retry_seconds: 2.0,
            catch_up_wait_ms: 10_000,
        }
    }
}

/// Who can see what: the debug endpoints reveal per-pod state, so they can be turned off or
/// moved to their own address (with `/metrics`).
#[derive(Clone, Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSection {
    /// Serve `/v1/pods`, `/metrics`, `/healthz` and `/readyz` here instead of on `listen`.
    pub listen: Option<SocketAddr>,
    /// `GET /v1/pods` and `?explain=1` on route calls: every pod's address, load and cache,
    /// and every candidate's cost. Off unless asked for (the local stack turns it on).
    pub debug_endpoints: bool,
}

/// What the scorer does on SIGTERM (a rolling update's step, a scale-down): it stops being
/// ready at once (`/readyz` answers 503, gRPC health NOT_SERVING) so that gateways and
/// Kubernetes move new requests to other replicas, keeps answering everything for
/// `drain_seconds` while they notice, then closes its listeners and lets what is still open
/// (a full-duplex picker exchange lasts as long as its response) finish for up to
/// `finish_seconds`. Set the pod's `terminationGracePeriodSeconds` above the sum (plus any
/// `preStop` sleep).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownSection {
    /// Seconds between SIGTERM and closing the listeners, answering as usual but not ready.
    pub drain_seconds: f64,
    /// Longest wait, after the listeners close, for the picker's open exchanges to end
    /// (the filters' HTTP connections and route streams get 5 s).
    pub finish_seconds: f64,
}

impl Default for ShutdownSection {
    fn default() -> Self {
        Self { drain_seconds: 5.0, finish_seconds: 60.0 }
    }
}

impl ShutdownSection {
    fn check(&self) -> Result<(), Invalid> {
        check(non_negative(self.drain_seconds), "drain_seconds", "must be 0 or more seconds")?;
        check(non_negative(self.finish_seconds), "finish_seconds", "must be 0 or more seconds")
    }

    pub fn drain(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.drain_seconds)
    }

    pub fn finish(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.finish_seconds)
    }
}

/// The Endpoint Picker: the Gateway API Inference Extension's protocol (Envoy ext_proc over
/// gRPC), so any InferencePool gateway can use kvgate as its picker.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EppSection {
    /// gRPC address of `envoy.service.ext_proc.v3.ExternalProcessor` and gRPC health.
    pub listen: SocketAddr,
    pub tls: EppTls,
    /// Largest request body buffered for a decision; larger ones are answered 413.
    pub body_limit_bytes: usize,
    /// Header naming the prefill pod of a disaggregated request (llm-d's decode sidecars).
    pub prefiller_header: String,
}

impl Default for EppSection {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9002)),
            tls: EppTls::SelfSigned,
            body_limit_bytes: 8 << 20,
            prefiller_header: "x-prefiller-host-port".into(),
        }
    }
}

/// How the Endpoint Picker's gRPC listener is secured. Gateways dial pickers over TLS
/// without verifying them by default (Istio with a DestinationRule, llm-d's Envoy), so a
/// self-signed certificate made at start-up is the drop-in default.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum EppTls {
    /// A certificate for `kvgate-epp` generated at start-up.
    #[default]
    SelfSigned,
    /// PEM certificate chain and private key (e.g. a mounted Secret).
    Files {
        /// The PEM certificate chain.
        cert: PathBuf,
        /// The PEM private key.
        key: PathBuf,
    },
    /// Plain HTTP/2 (h2c).
    Plaintext,
}

/// Where pods come from besides the static `pods:` list.
#[derive(Clone, Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySection {
    /// One entry per name, e.g. a prefill and a decode Service with their roles.
    #[serde(default)]
    pub dns: Vec<DnsDiscovery>,
    /// One entry per namespace and label selector.
    #[serde(default)]
    pub kubernetes: Vec<KubernetesDiscovery>,
    /// The pods of one InferencePool (the pool an Endpoint Picker serves).
    pub inference_pool: Option<InferencePoolDiscovery>,
}

/// Pods of a Gateway API Inference Extension `InferencePool` (v1), as the pool says: its
/// `selector` picks the pods in its namespace, every `podIP:targetPort` is an endpoint; the
/// pool and the pods are watched. Needs get/list/watch on pods and inferencepools there.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolDiscovery {
    /// The pool's namespace (its pods are in it).
    pub namespace: String,
    /// The pool's name.
    pub name: String,
    /// KV-event port of the first target port (data-parallel rank 0); rank r publishes on
    /// this port + r, as vLLM offsets them. Annotation `kvgate.io/kv-events-port` overrides it.
    pub kv_events_port: Option<u16>,
    /// Replay port of rank 0 (rank r: + r); annotation `kvgate.io/kv-events-replay-port`.
    pub kv_events_replay_port: Option<u16>,
    /// Path of the metrics page on each target port; `null` turns scraping off.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: Option<String>,
    /// The label carrying a pod's role (`prefill`, `decode`, `both`; absent = both).
    #[serde(default = "default_role_label")]
    pub role_label: String,
    /// The API server; by default the in-cluster service account (or `KUBECONFIG`).
    pub api_server: Option<String>,
}

/// Pods from the Kubernetes API: those matching `label_selector` in `namespace` that are
/// Running, Ready and have an IP, watched (list + watch, relisting when the watch expires).
/// Needs get/list/watch on pods in that namespace.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesDiscovery {
    /// The namespace of the pods.
    pub namespace: String,
    /// e.g. `app.kubernetes.io/name=vllm` (an InferencePool's selector, written as a label
    /// selector).
    pub label_selector: String,
    /// The pods' HTTP port; a pod's annotation `kvgate.io/port` overrides it.
    pub port: u16,
    /// KV-event port (annotation `kvgate.io/kv-events-port` overrides it).
    pub kv_events_port: Option<u16>,
    /// Replay port (annotation `kvgate.io/kv-events-replay-port` overrides it).
    pub kv_events_replay_port: Option<u16>,
    /// Path of the metrics page on `port`; `null` turns scraping off.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: Option<String>,
    /// The label carrying a pod's role (`prefill`, `decode`, `both`; absent = both).
    #[serde(default = "default_role_label")]
    pub role_label: String,
    /// The API server; by default the in-cluster service account (or `KUBECONFIG`).
    pub api_server: Option<String>,
}

fn default_role_label() -> String {
    "llm-d.ai/role".into()
}

/// Pods as the A/AAAA records of one name — a Kubernetes headless Service (what an Envoy
/// `STRICT_DNS` cluster resolves too), re-resolved periodically.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DnsDiscovery {
    /// e.g. `vllm.inference.svc.cluster.local`.
    pub name: String,
    /// The pods' HTTP port (vLLM's `--port`).
    pub port: u16,
    /// The pods' KV-event port (`tcp://<ip>:<port>`), if they publish events.
    pub kv_events_port: Option<u16>,
    /// Their replay port, if any.
    pub kv_events_replay_port: Option<u16>,
    /// Path of the metrics page on `port`; `null` turns scraping off.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: Option<String>,
    #[serde(default = "default_role")]
    pub role: Role,
    /// How often the name is resolved again.
    #[serde(default = "default_dns_interval")]
    pub interval_seconds: f64,
}

fn default_metrics_path() -> Option<String> {
    Some("/metrics".into())
}

fn default_dns_interval() -> f64 {
    5.0
}

/// The whole file.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// HTTP address of the scorer's API (loopback by default: only the local Envoy calls it).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Threads serving the connections to `listen` (default: one per CPU). Each connection
    /// stays on one thread, and so do the route calls it carries: Envoy keeps one route
    /// stream per worker, whose calls are then read, decided and answered without being
    /// handed between threads.
    pub listen_threads: Option<usize>,
    /// A Unix socket path serving route sockets only: the filter's native module connects
    /// here instead of to `listen` when Envoy shares a directory with the scorer (a pod's
    /// `emptyDir`); cheaper per call than TCP on loopback. A stale socket file is replaced.
    pub route_socket_path: Option<PathBuf>,
    /// HF `tokenizer.json` of the served model; the chat template comes from the
    /// `tokenizer_config.json` beside it. Without it tokens are estimated (bytes/4) and only
    /// the approximate index is used.
    pub tokenizer: Option<PathBuf>,
    /// Token ids of long pieces of prompt text (cut at special tokens — a chat's messages —
    /// and, for Qwen's tokenizers, between words) kept so that resent history or a document
    /// sent again is not tokenized again, at most this many in all (4 bytes each); 0 turns
    /// the cache off.
    #[serde(default = "default_tokenizer_cache_tokens")]
    pub tokenizer_cache_tokens: u64,
    /// Tokens per KV block. Absent (the default), it is learned from the engines: every KV
    /// event and `vllm:cache_config_info` states it, and requests are hashed in blocks of
    /// that size from the first one heard (until then, in blocks of 16: nothing is credited
    /// from an engine not yet heard). Set, it is checked: an engine stating another size is
    /// an error naming both, and its cache is not indexed.
    pub block_size: Option<usize>,
    /// `model` names that are LoRA adapters (their blocks are hashed apart). kvgate also
    /// learns them from the pods — their KV events' `lora_name` and their
    /// `vllm:lora_requests_info` — so list here only adapters whose first requests must hash
    /// apart before any pod has named them.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Seed of the policies' random choices (ties, sampling).
    #[serde(default)]
    pub seed: u64,
    /// Next-best pods named after the pick (`ip:port,ip:port,…`), which Envoy's
    /// `override_host` retries in order when a pod refuses the connection; 0 for gateways
    /// that route with an ORIGINAL_DST cluster on the header (llm-d's standalone Envoy),
    /// which accept a single endpoint only.
    #[serde(default = "default_fallback_endpoints")]
    pub fallback_endpoints: usize,
    #[serde(default)]
    pub index: IndexConfig,
    #[serde(default)]
    pub load: LoadConfig,
    #[serde(default)]
    pub health: HealthSection,
    #[serde(default)]
    pub pd: PdConfig,
    #[serde(default)]
    pub admin: AdminSection,
    #[serde(default)]
    pub discovery: DiscoverySection,
    #[serde(default)]
    pub shutdown: ShutdownSection,
    /// Serve the Endpoint Picker protocol (absent: only the HTTP API of the wasm filter).
    pub epp: Option<EppSection>,
    /// Queue requests while every pod is saturated (absent: route at once, always).
    pub admission: Option<Admission>,
    /// Share in-flight bookings with the other gateway replicas over NATS (absent: this
    /// replica decides on its own requests in flight only).
    pub sync: Option<SyncSection>,
    /// Static pods (may be empty when discovery finds them).
    #[serde(default)]
    pub pods: Vec<PodConfig>,
}

/// Active-active replicas: each publishes its booking changes (decisions, first tokens,
/// completions, moved bookings) on NATS and applies the others' as its own, so every
/// replica decides on the whole fleet's requests in flight. A decision never waits for the
/// bus; without it each replica routes on its own bookings (counted in metrics).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncSection {
    /// NATS server URL, e.g. `nats://nats.kvgate:4222` (several, comma-separated or as a
    /// list, for a NATS cluster).
    pub nats: NatsUrls,
    /// Subject prefix shared by the replicas of one fleet (`<prefix>.bookings`,
    /// `<prefix>.snapshot.<replica>`): two fleets on one NATS use two prefixes.
    #[serde(default = "default_subject_prefix")]
    pub subject_prefix: String,
    /// This replica's name, unique in the fleet (default: `$HOSTNAME`, the pod's name in
    /// Kubernetes).
    pub replica_id: Option<String>,
    /// A replica publishes at least this often (a heartbeat when it has nothing to say).
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A replica not heard from for this long has left: its bookings are dropped.
    #[serde(default = "default_replica_timeout_ms")]
    pub replica_timeout_ms: u64,
    /// At start, how long to wait at most for the other replicas' bookings before
    /// `/readyz` answers ready (a replica that joins decides on the fleet's state).
    #[serde(default = "default_join_wait_ms")]
    pub join_wait_ms: u64,
    /// NATS token authentication: a file holding the token (a mounted Secret), read at
    /// start. Any client that can reach an unauthenticated NATS can inject bookings.
    pub token_file: Option<PathBuf>,
    /// NATS user authentication: the user, whose password is in `password_file`.
    pub user: Option<String>,
    /// The file holding `user`'s password (a mounted Secret), read at start.
    pub password_file: Option<PathBuf>,
    /// TLS to NATS: the connection is refused unless the server speaks TLS with a
    /// certificate this replica trusts.
    pub tls: Option<SyncTls>,
}

/// TLS to NATS (`sync.tls`).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncTls {
    /// PEM file of the CA that signed the NATS server's certificate (absent: the system's
    /// roots).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for a server that verifies its clients (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
}

fn default_subject_prefix() -> String {
    "kvgate".into()
}

fn default_heartbeat_ms() -> u64 {
    500
}

fn default_replica_timeout_ms() -> u64 {
    3000
}

fn default_join_wait_ms() -> u64 {
    2000
}

impl SyncSection {
    /// The configured replica id, else `$HOSTNAME`, else one made of the process id.
    pub fn replica(&self) -> String {
        self.replica_id
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| format!("replica-{}", std::process::id()))
    }
}

/// A NATS subject token: no separators, wildcards or whitespace.
fn subject_token(s: &str) -> bool {
    !s.is_empty() && !s.chars().any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace())
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7070))
}

fn default_fallback_endpoints() -> usize {
    2
}

fn default_tokenizer_cache_tokens() -> u64 {
    4 << 20
}

/// Tokens per block requests are hashed in until the engines state theirs.
pub const PROVISIONAL_BLOCK_SIZE: usize = 16;

impl Config {
    /// The routing state machine's settings: what the scorer routes with, and what the
    /// cluster simulator builds its routers from (same defaults, same validation).
    pub fn router_config(&self) -> RouterConfig {
        RouterConfig {
            block_size: self.block_size.unwrap_or(PROVISIONAL_BLOCK_SIZE),
            index: self.index.clone(),
            load: self.load.clone(),
            policy: self.policy.clone(),
            pd: self.pd.clone(),
            seed: self.seed,
            admission: self.admission.clone(),
        }
    }

    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        let config = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.into(), message },
            other => other,
        })?;
        if let Some(tokenizer) = &config.tokenizer
            && !tokenizer.is_file()
        {
            return invalid("tokenizer", format!("{} is not a file", tokenizer.display()));
        }
        let mut files: Vec<(&str, &Path)> = Vec::new();
        if let Some(EppSection { tls: EppTls::Files { cert, key }, .. }) = &config.epp {
            files.extend([("epp.tls.cert", cert.as_path()), ("epp.tls.key", key.as_path())]);
        }
        files.extend(config.sync.iter().flat_map(SyncSection::files));
        if let Some((field, path)) = files.iter().find(|(_, path)| !path.is_file()) {
            return invalid(*field, format!("{} is not a file", path.display()));
        }
        Ok(config)
    }

    /// Parses and validates YAML text (file checks aside).
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = serde_saphyr::from_str(text)
            .map_err(|e| ConfigError::Parse { path: PathBuf::new(), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(|e| ConfigError::Invalid { field: e.field, message: e.message })
    }

    /// Every section checked by itself, then what ties them together.
    fn check(&self) -> Result<(), Invalid> {
        self.router_config().validate()?;
        let mut dns_names = HashSet::new();
        for (i, dns) in self.discovery.dns.iter().enumerate() {
            let field = format!("discovery.dns[{i}]");
            dns.check().map_err(|e| e.under(&field))?;
            let unique = dns_names.insert((dns.name.as_str(), dns.port));
            check(unique, &format!("{field}.name"), &format!("{}:{} is discovered twice", dns.name, dns.port))?;
        }
        for (i, k) in self.discovery.kubernetes.iter().enumerate() {
            k.check().map_err(|e| e.under(&format!("discovery.kubernetes[{i}]")))?;
        }
        if let Some(pool) = &self.discovery.inference_pool {
            pool.check().map_err(|e| e.under("discovery.inference_pool"))?;
        }
        let discovered = !self.discovery.dns.is_empty()
            || !self.discovery.kubernetes.is_empty()
            || self.discovery.inference_pool.is_some();
        check(discovered || !self.pods.is_empty(), "pods", "at least one pod is needed (or configure discovery)")?;
        let (mut names, mut addresses) = (HashSet::new(), HashSet::new());
        for (i, pod) in self.pods.iter().enumerate() {
            let field = |f: &str| format!("pods[{i}].{f}");
            pod.check().map_err(|e| e.under(&format!("pods[{i}]")))?;
            check(names.insert(pod.name.as_str()), &field("name"), &format!("duplicate pod name {:?}", pod.name))?;
            let unique = addresses.insert(pod.address);
            check(unique, &field("address"), &format!("duplicate address {}", pod.address))?;
            if let Some(slowness) = pod.slowness {
                let max = self.load.pod_speed.max_slowness;
                check(
                    self.load.pod_speed.slowness_range().contains(&slowness),
                    &field("slowness"),
                    &format!("{slowness} is outside [1/{max}, {max}] (load.pod_speed.max_slowness)"),
                )?;
            }
        }
        if let Some(sync) = &self.sync {
            sync.check().map_err(|e| e.under("sync"))?;
        }
        check(self.fallback_endpoints <= 16, "fallback_endpoints", "at most 16 (a retry per endpoint)")?;
        check(self.listen_threads != Some(0), "listen_threads", "must be at least 1")?;
        check(self.admin.listen != Some(self.listen), "admin.listen", "must differ from listen")?;
        if let Some(epp) = &self.epp {
            let apart = epp.listen != self.listen && Some(epp.listen) != self.admin.listen;
            check(apart, "epp.listen", "must differ from listen and admin.listen")?;
            check(epp.body_limit_bytes > 0, "epp.body_limit_bytes", "must be positive")?;
            let h = &epp.prefiller_header;
            check(header_name(h), "epp.prefiller_header", &format!("{h:?} is not a lowercase header name"))?;
        }
        self.shutdown.check().map_err(|e| e.under("shutdown"))?;
        self.health.check().map_err(|e| e.under("health"))
    }
}

impl PodConfig {
    fn check(&self) -> Result<(), Invalid> {
        let name = !self.name.is_empty() && self.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        check(name, "name", &format!("{:?} must be non-empty [A-Za-z0-9._-]", self.name))?;
        check(self.kv_events_replay.is_none() || self.kv_events.is_some(), "kv_events_replay", "needs kv_events")?;
        match &self.metrics {
            Some(url) => check(url.starts_with("http://"), "metrics", &format!("{url:?} must be an http:// URL")),
            None => Ok(()),
        }
    }
}

impl HealthSection {
    fn check(&self) -> Result<(), Invalid> {
        check(positive(self.retry_seconds), "retry_seconds", "must be positive")?;
        let positives = self.scrape_interval_ms > 0 && self.scrape_timeout_ms > 0 && self.unhealthy_after > 0;
        check(positives, "", "scrape_interval_ms, scrape_timeout_ms and unhealthy_after must be positive")
    }
}

impl SyncSection {
    fn check(&self) -> Result<(), Invalid> {
        let prefix = self.subject_prefix.split('.').all(subject_token);
        check(prefix, "subject_prefix", "must be NATS subject tokens joined by '.', without wildcards")?;
        let replica = subject_token(&self.replica());
        check(replica, "replica_id", "must be one NATS subject token (no '.', '*', '>' or spaces)")?;
        let timeout = self.heartbeat_ms > 0 && self.replica_timeout_ms >= 2 * self.heartbeat_ms;
        check(timeout, "replica_timeout_ms", "must be at least twice a positive heartbeat_ms")?;
        check(self.token_file.is_none() || self.user.is_none(), "token_file", "use either token_file or user")?;
        check(self.user.is_none() || self.password_file.is_some(), "password_file", "user needs its password_file")?;
        check(self.password_file.is_none() || self.user.is_some(), "user", "password_file needs its user")?;
        if let Some(tls) = &self.tls {
            let pair = tls.cert_file.is_some() == tls.key_file.is_some();
            check(pair, "tls.key_file", "cert_file and key_file go together")?;
        }
        Ok(())
    }

    /// The files this section names, by field: they must exist at start.
    fn files(&self) -> Vec<(&'static str, &Path)> {
        let tls = self.tls.as_ref();
        [
            ("sync.token_file", self.token_file.as_deref()),
            ("sync.password_file", self.password_file.as_deref()),
            ("sync.tls.ca_file", tls.and_then(|t| t.ca_file.as_deref())),
            ("sync.tls.cert_file", tls.and_then(|t| t.cert_file.as_deref())),
            ("sync.tls.key_file", tls.and_then(|t| t.key_file.as_deref())),
        ]
        .into_iter()
        .filter_map(|(field, path)| Some((field, path?)))
        .collect()
    }
}

impl DnsDiscovery {
    fn check(&self) -> Result<(), Invalid> {
        check(!self.name.trim().is_empty(), "name", "must be a DNS name")?;
        check(self.port > 0, "port", "must be a port number")?;
        check(positive(self.interval_seconds), "interval_seconds", "must be a positive number of seconds")?;
        check_metrics_path(&self.metrics_path)
    }
}

impl KubernetesDiscovery {
    fn check(&self) -> Result<(), Invalid> {
        check(!self.namespace.trim().is_empty(), "namespace", "must name a namespace")?;
        let selector = !self.label_selector.trim().is_empty();
        check(selector, "label_selector", "must select the model's pods (e.g. app=vllm)")?;
        check(self.port > 0, "port", "must be a port number")?;
        check_api_server(&self.api_server)?;
        check_metrics_path(&self.metrics_path)
    }
}

impl InferencePoolDiscovery {
    fn check(&self) -> Result<(), Invalid> {
        check(!self.namespace.trim().is_empty(), "namespace", "must name the pool's namespace")?;
        check(!self.name.trim().is_empty(), "name", "must name the InferencePool")?;
        check_api_server(&self.api_server)?;
        check_metrics_path(&self.metrics_path)
    }
}

fn check_metrics_path(path: &Option<String>) -> Result<(), Invalid> {
    match path {
        Some(path) => check(path.starts_with('/'), "metrics_path", &format!("{path:?} must start with /")),
        None => Ok(()),
    }
}

fn check_api_server(url: &Option<String>) -> Result<(), Invalid> {
    match url {
        Some(url) => {
            let http = url.starts_with("https://") || url.starts_with("http://");
            check(http, "api_server", &format!("{url:?} must be an http(s) URL"))
        }
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "pods:\n  - name: pod-a\n    address: 127.0.0.1:8001\n";

    #[test]
    fn nats_credentials_are_one_kind_and_whole() {
        let sync = |fields: &str| Config::parse(&format!("sync: {{nats: 'nats://n:4222', {fields}}}\n{MINIMAL}"));
        assert!(sync("token_file: /t").is_ok());
        assert!(sync("user: kvgate, password_file: /p, tls: {ca_file: /ca, cert_file: /c, key_file: /k}").is_ok());
        for (fields, field) in [
            ("token_file: /t, user: kvgate, password_file: /p", "sync.token_file"),
            ("user: kvgate", "sync.password_file"),
            ("password_file: /p", "sync.user"),
            ("token_file: /t, tls: {cert_file: /c}", "sync.tls.key_file"),
        ] {
            let e = sync(fields).unwrap_err().to_string();
            assert!(e.contains(field), "{fields}: {e}");
        }
    }

    #[test]
    fn nats_urls_are_one_a_joined_few_or_a_list() {
        let urls = |nats: &str| {
            Config::parse(&format!("sync: {{nats: {nats}}}\n{MINIMAL}"))
                .map(|c| c.sync.unwrap().nats.urls().map(String::from).collect::<Vec<_>>())
                .map_err(|e| e.to_string())
        };
        assert_eq!(urls("'nats://a:4222'").unwrap(), ["nats://a:4222"]);
        assert_eq!(urls("'nats://a:4222, tls://b:4222'").unwrap(), ["nats://a:4222", "tls://b:4222"]);
        assert_eq!(urls("[nats://a:4222, tls://b:4222]").unwrap(), ["nats://a:4222", "tls://b:4222"]);
        assert!(urls("'nats://a:4222,http://b'").unwrap_err().contains("\"http://b\" is not a nats:// or tls:// URL"));
        assert!(urls("[]").unwrap_err().contains("no NATS URL"));
    }

    #[test]
    fn defaults_are_sane() {
        let c = Config::parse(MINIMAL).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:7070");
        assert_eq!(c.block_size, None, "learned from the engines");
        assert_eq!(c.policy, PolicyConfig::default());
        assert_eq!(c.pods[0].role, Role::Both);
        assert!(c.pods[0].kv_events.is_none());
        assert!(c.epp.is_none(), "no Endpoint Picker unless asked");
        assert!(!c.admin.debug_endpoints, "per-pod state and costs are not served unless asked");
        let epp = Config::parse(&format!("epp: {{}}\n{MINIMAL}")).unwrap().epp.unwrap();
        assert_eq!(
            (epp.listen.to_string(), epp.tls, c.fallback_endpoints),
            ("0.0.0.0:9002".into(), EppTls::SelfSigned, 2)
        );
        let plain =
            Config::parse(&format!("epp: {{tls: {{mode: plaintext}}}}\nfallback_endpoints: 0\n{MINIMAL}")).unwrap();
        assert_eq!(plain.epp.unwrap().tls, EppTls::Plaintext);
    }

    #[test]
    fn a_full_file_parses() {
        let c = Config::parse(
            r#"
listen: 127.0.0.1:7171
block_size: 32
lora_adapters: [sql]
policy: {name: kv, decode_weight: 0.5, prefill_estimate: linear, temperature: 0.1, max_waiting: 32}
index: {max_blocks_per_pod: 1000, approximate_ttl_seconds: 30}
load: {default_output_tokens: 128}
health: {scrape_interval_ms: 200}
pd: {threshold_tokens: 2048, prefill_policy: {name: least-loaded}}
pods:
  - {name: p1, address: "10.0.0.1:8000", role: prefill, kv_events: "tcp://10.0.0.1:5557", kv_events_replay: "tcp://10.0.0.1:5558", metrics: "http://10.0.0.1:8000/metrics"}
  - {name: d1, address: "10.0.0.2:8000", role: decode}
"#,
        )
        .unwrap();
        assert_eq!(c.pods.len(), 2);
        assert_eq!(c.pods[1].role, Role::Decode);
        assert_eq!(c.index.max_blocks_per_pod, 1000);
        assert_eq!(c.health.unhealthy_after, 3, "unset fields keep their defaults");
        assert_eq!((c.pd.threshold_tokens, &c.pd.prefill_policy), (2048, &PolicyConfig::LeastLoaded));
    }

    #[test]
    fn mistakes_name_their_field() {
        let cases = [
            ("pods:\n  - name: a\n    address: 1.2.3.4:5\n    kv_event: tcp://x:1\n", "kv_event"),
            ("blok_size: 4\npods: []\n", "blok_size"),
            ("block_size: 0\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "block_size"),
            ("pods: []\n", "or configure discovery"),
            ("pods:\n  - {name: a, address: 'localhost'}\n", "address: 'localhost'"),
            ("pods:\n  - {name: a, address: 'localhost'}\n", "\"localhost\" is not ip:port"),
            ("pods:\n  - {name: a, address: '1.2.3.4:5'}\n  - {name: a, address: '1.2.3.4:6'}\n", "pods[1].name"),
            ("pods:\n  - {name: a, address: '1.2.3.4:5', kv_events: 'http://x'}\n", "kv_events: 'http://x'"),
            ("pods:\n  - {name: a, address: '1.2.3.4:5', kv_events: 'http://x'}\n", "is not a ZMQ endpoint"),
            ("pods:\n  - {name: a, address: '1.2.3.4:5', kv_events_replay: 'tcp://x:1'}\n", "kv_events_replay"),
            ("pods:\n  - {name: a, address: '1.2.3.4:5', role: router}\n", "router"),
            (
                "policy: {name: kv, decode_weight: -1}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "policy.decode_weight",
            ),
            ("policy: {name: fastest}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "fastest"),
            ("health: {unhealthy_after: 0}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "health"),
            (
                "load: {pod_speed: {window_samples: 1}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "load.pod_speed.window_samples",
            ),
            ("load: {pod_speed: {learn: 3}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "learn"),
            (
                "index: {offload: {cpu_load_cost: 2}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "index.offload.cpu_load_cost",
            ),
            ("index: {offload: {gpu_load_cost: 0.1}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "gpu_load_cost"),
            ("discovery:\n  dns: [{name: '', port: 8000}]\n", "discovery.dns[0].name"),
            ("discovery:\n  dns: [{name: vllm, port: 0}]\n", "discovery.dns[0].port"),
            (
                "discovery:\n  dns: [{name: vllm, port: 8000, interval_seconds: 0}]\n",
                "discovery.dns[0].interval_seconds",
            ),
            ("discovery:\n  dns: [{name: vllm, port: 8000, metrics_path: metrics}]\n", "discovery.dns[0].metrics_path"),
            ("discovery:\n  dns: [{name: vllm, port: 8000, kv_event_port: 1}]\n", "kv_event_port"),
            (
                "discovery:\n  dns: [{name: v, port: 8000}, {name: v, port: 8000, role: decode}]\n",
                "discovery.dns[1].name",
            ),
            ("discovery:\n  consul: {}\n", "consul"),
            (
                "discovery:\n  kubernetes: [{namespace: '', label_selector: app=vllm, port: 8000}]\n",
                "discovery.kubernetes[0].namespace",
            ),
            (
                "discovery:\n  kubernetes: [{namespace: ns, label_selector: ' ', port: 8000}]\n",
                "discovery.kubernetes[0].label_selector",
            ),
            (
                "discovery:\n  kubernetes: [{namespace: ns, label_selector: a=b, port: 8000, api_server: x}]\n",
                "api_server",
            ),
            ("discovery:\n  inference_pool: {namespace: ns, name: ''}\n", "discovery.inference_pool.name"),
            ("discovery:\n  inference_pool: {namespace: ns, name: p, port: 8000}\n", "port"),
            ("epp: {listen: '127.0.0.1:7070'}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "epp.listen"),
            ("listen_threads: 0\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "listen_threads"),
            ("fallback_endpoints: 99\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "fallback_endpoints"),
            ("epp: {tls: {mode: sometimes}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "sometimes"),
            ("epp: {tls: {mode: files}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "cert"),
            ("epp: {prefiller_header: X-P}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "epp.prefiller_header"),
            ("admission: {queue_limit: 4}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "saturated"),
            ("admission: {max_kv_usage: 1.5}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "admission.max_kv_usage"),
            ("admission: {max_waiting: 4, queue_limit: 0}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "nonzero"),
            (
                "admission: {max_waiting: 4, max_wait_ms: 0}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "admission.max_wait_ms",
            ),
            (
                "admission: {max_waiting: 4, headroom: 1}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "admission.headroom",
            ),
            (
                "pd: {prefill_policy: {name: kv, temperature: -1}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "pd.prefill_policy.temperature",
            ),
            ("policy: {name: kv, miss_weight: -1}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n", "policy.miss_weight"),
            (
                "policy: {name: kv, balance_rel_threshold: 0.5}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "policy.balance_rel_threshold",
            ),
            (
                "policy: {name: kv, max_kv_usage: 2}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "policy.max_kv_usage",
            ),
            (
                "index: {max_blocks_per_pod: 0}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "index.max_blocks_per_pod",
            ),
            (
                "load: {request_ttl_seconds: 0}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "load.request_ttl_seconds",
            ),
            (
                "admission: {max_waiting: 4, objectives: {gold: high}}\npods:\n  - {name: a, address: '1.2.3.4:5'}\n",
                "high",
            ),
        ];
        for (yaml, needle) in cases {
            let err = Config::parse(yaml).expect_err(yaml).to_string();
            assert!(err.contains(needle), "{yaml:?} → {err}");
        }
    }
}
