//! The scorer's YAML configuration. Every field is documented in docs/configuration.md,
//! generated from these types (`make docs`); unknown fields and invalid values stop start-up
//! with a message naming the field.
//!
//! One file per subsystem's section, each with its own checks; this one holds the whole file
//! and what ties sections together. Values are typed as they are read (addresses, ZMQ
//! endpoints, URLs), so an error names the field and quotes the value, and nothing later
//! parses them again. (The sections sit here rather than in their subsystems' modules: every
//! subsystem reads the scorer, which holds the configuration.)

mod discovery;
mod epp;
mod health;
mod models;
mod pods;
mod serving;
mod sync;
mod traces;

pub use discovery::{ApiServer, DiscoverySection, DnsDiscovery, InferencePoolDiscovery, KubernetesDiscovery};
pub use epp::{EppSection, EppTls};
pub use health::HealthSection;
pub use kvgate_routing::router::Role;
pub use models::{MAX_REWRITE_WEIGHT, ModelConfig, ModelRewriteRule, RewriteTarget};
pub use pods::{MetricsUrl, PodConfig, ZmqEndpoint};
pub use serving::{AdminSection, ShutdownSection};
pub use sync::{NatsUrls, SyncSection, SyncTls};
pub use traces::{OtlpEndpoint, TracesSection};

use kvgate_routing::index::IndexConfig;
use kvgate_routing::load::LoadConfig;
use kvgate_routing::policy::PolicyConfig;
use kvgate_routing::router::{Admission, PdConfig, RouterConfig};
use kvgate_routing::validate::{Invalid, check};
use serde::Deserialize;
use smart_default::SmartDefault;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// What becomes of a request naming a model no engine lists (`unlisted_models`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum UnlistedModels {
    /// Answered 404, naming the model.
    #[default]
    Refuse,
    /// Routed to any engine, which may load it.
    Route,
}

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

/// The whole file.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// HTTP address of the scorer's API (loopback by default: only the local Envoy calls it).
    /// On port 0 (here, `admin.listen` or `epp.listen`) the OS picks a port; every listener
    /// says where it is bound on stdout as it binds (`listening api|admin|epp <ip:port>`).
    #[default(SocketAddr::from(([127, 0, 0, 1], 7070)))]
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
    /// Models whose requests are tokenized by a tokenizer of their own (a gateway in front
    /// of several models); every other model's by `tokenizer`, which is then required. Each
    /// model's requests go only to the engines listing it (`unlisted_models`).
    pub models: Vec<ModelConfig>,
    /// Rewrites of the `model` requests name (the Gateway API Inference Extension's
    /// InferenceModelRewrite rules): aliases, a catch-all for unknown names, weighted splits.
    /// The pods get the body with the rewritten model, and it is routed, tokenized and
    /// cached as that model. With `discovery.inference_pool.inference_model_rewrites`, the
    /// pool's own rules come first.
    pub model_rewrites: Vec<ModelRewriteRule>,
    /// Token ids of long pieces of prompt text (cut at special tokens — a chat's messages —
    /// and, for Qwen's tokenizers, between words) kept so that resent history or a document
    /// sent again is not tokenized again, at most this many in all (4 bytes each); 0 turns
    /// the cache off.
    #[default(4 << 20)]
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
    pub lora_adapters: Vec<String>,
    /// A request naming a model no engine lists in its `/v1/models`: `refuse` it (404 in the
    /// API's shape, without reaching an engine), or `route` it to any engine — for fleets whose
    /// vLLM loads adapters on their first request (a LoRA resolver), which no listing names
    /// before. Models some engine lists go only to the engines listing them either way.
    pub unlisted_models: UnlistedModels,
    pub policy: PolicyConfig,
    /// Seed of the policies' random choices (ties, sampling).
    pub seed: u64,
    /// Next-best pods named after the pick (`ip:port,ip:port,…`), which Envoy's
    /// `override_host` retries in order when a pod refuses the connection; 0 for gateways
    /// that route with an ORIGINAL_DST cluster on the header (llm-d's standalone Envoy),
    /// which accept a single endpoint only.
    #[default(2)]
    pub fallback_endpoints: usize,
    pub index: IndexConfig,
    pub load: LoadConfig,
    pub health: HealthSection,
    pub pd: PdConfig,
    pub admin: AdminSection,
    pub discovery: DiscoverySection,
    pub shutdown: ShutdownSection,
    /// Serve the Endpoint Picker protocol (absent: only the HTTP API of the wasm filter).
    pub epp: Option<EppSection>,
    /// Queue requests while every pod is saturated (absent: route at once, always).
    pub admission: Option<Admission>,
    /// Share in-flight bookings with the other gateway replicas over NATS (absent: this
    /// replica decides on its own requests in flight only).
    pub sync: Option<SyncSection>,
    /// Export a span for each decision over OTLP, joined to the request's trace (absent:
    /// no traces).
    pub traces: Option<TracesSection>,
    /// Static pods (may be empty when discovery finds them).
    pub pods: Vec<PodConfig>,
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
        if let Some((i, model)) = config.models.iter().enumerate().find(|(_, m)| !m.tokenizer.is_file()) {
            return invalid(format!("models[{i}].tokenizer"), format!("{} is not a file", model.tokenizer.display()));
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
        self.discovery.check().map_err(|e| e.under("discovery"))?;
        check(
            self.discovery.any() || !self.pods.is_empty(),
            "pods",
            "at least one pod is needed (or configure discovery)",
        )?;
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
        let mut models = HashSet::new();
        for (i, model) in self.models.iter().enumerate() {
            let unique = !model.name.is_empty() && models.insert(model.name.as_str());
            check(unique, &format!("models[{i}].name"), &format!("{:?} is empty or listed twice", model.name))?;
        }
        for (i, rule) in self.model_rewrites.iter().enumerate() {
            if let Some((field, message)) = rule.problem() {
                return Err(Invalid { field: format!("model_rewrites[{i}].{field}"), message });
            }
        }
        check(
            self.models.is_empty() || self.tokenizer.is_some(),
            "tokenizer",
            "needed with models: the tokenizer of every model not listed there",
        )?;
        check(self.fallback_endpoints <= 16, "fallback_endpoints", "at most 16 (a retry per endpoint)")?;
        check(self.listen_threads != Some(0), "listen_threads", "must be at least 1")?;
        // Two listeners on port 0 get two ports.
        let same = |a: SocketAddr, b: Option<SocketAddr>| a.port() != 0 && Some(a) == b;
        check(!same(self.listen, self.admin.listen), "admin.listen", "must differ from listen")?;
        if let Some(epp) = &self.epp {
            epp.check().map_err(|e| e.under("epp"))?;
            let apart = !same(epp.listen, Some(self.listen)) && !same(epp.listen, self.admin.listen);
            check(apart, "epp.listen", "must differ from listen and admin.listen")?;
        }
        if let Some(traces) = &self.traces {
            traces.check().map_err(|e| e.under("traces"))?;
        }
        self.shutdown.check().map_err(|e| e.under("shutdown"))?;
        self.health.check().map_err(|e| e.under("health"))
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
    fn a_metrics_url_finds_the_models_page_beside_it() {
        let url = MetricsUrl::try_from("http://10.0.0.1:8000/metrics?x=1".to_string()).unwrap();
        assert_eq!(url.models().as_str(), "http://10.0.0.1:8000/v1/models");
        let discovered = MetricsUrl::at("[::1]:8000".parse().unwrap(), "/stats");
        assert_eq!(
            (&*discovered, discovered.models().as_str()),
            ("http://[::1]:8000/stats", "http://[::1]:8000/v1/models")
        );
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
            ("pods:\n  - {name: a, address: '1.2.3.4:5', metrics: '1.2.3.4:5/metrics'}\n", "metrics: '1.2.3.4:5"),
            (
                "pods:\n  - {name: a, address: '1.2.3.4:5', metrics: 'https://x/m'}\n",
                "\"https://x/m\" is not an http://",
            ),
            ("pods:\n  - {name: a, address: '1.2.3.4:5', role: router}\n", "router"),
            ("models: [{name: m, tokenizer: /t}]\npods: [{name: a, address: '1.2.3.4:5'}]\n", "needed with models"),
            (
                "tokenizer: /t\nmodels: [{name: m, tokenizer: /t}, {name: m, tokenizer: /u}]\npods: [{name: a, address: '1.2.3.4:5'}]\n",
                "models[1].name",
            ),
            ("traces: {otlp_endpoint: 'collector:4317'}\npods: [{name: a, address: '1.2.3.4:5'}]\n", "not an http://"),
            (
                "traces: {otlp_endpoint: 'http://c:4317', sample_ratio: 2}\npods: [{name: a, address: '1.2.3.4:5'}]\n",
                "traces.sample_ratio",
            ),
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
