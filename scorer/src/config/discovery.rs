//! `discovery:`, where pods come from besides the `pods:` list (see `crate::discovery`).

use kvgate_routing::router::Role;
use kvgate_routing::validate::{Invalid, check, positive};
use serde::Deserialize;
use std::collections::HashSet;

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
    pub api_server: Option<ApiServer>,
    /// Also watch the namespace's `InferenceObjective`s (`inference.networking.x-k8s.io/
    /// v1alpha2`) whose `poolRef` names this pool: the objective a request names in
    /// `x-gateway-inference-objective` gets its `priority` (unset: 0) in admission, ahead of
    /// `admission.objectives`; a change applies at once. Needs get/list/watch on
    /// inferenceobjectives, and the CRD installed.
    #[serde(default)]
    pub inference_objectives: bool,
    /// Also watch the namespace's `InferenceModelRewrite`s (`inference.networking.x-k8s.io/
    /// v1alpha2`) whose `poolRef` names this pool: their rules (the oldest object's first)
    /// rewrite requests' models ahead of `model_rewrites`; a change applies to the next
    /// request. An object with a rule kvgate cannot use is left out, logged and counted in
    /// `kvgate_discovery_errors_total`. Needs get/list/watch on inferencemodelrewrites, and
    /// the CRD installed.
    #[serde(default)]
    pub inference_model_rewrites: bool,
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
    pub api_server: Option<ApiServer>,
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
    #[serde(default)]
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

impl DiscoverySection {
    /// Whether any source is configured.
    pub fn any(&self) -> bool {
        !self.dns.is_empty() || !self.kubernetes.is_empty() || self.inference_pool.is_some()
    }

    pub(super) fn check(&self) -> Result<(), Invalid> {
        let mut dns_names = HashSet::new();
        for (i, dns) in self.dns.iter().enumerate() {
            let field = format!("dns[{i}]");
            dns.check().map_err(|e| e.under(&field))?;
            let unique = dns_names.insert((dns.name.as_str(), dns.port));
            check(unique, &format!("{field}.name"), &format!("{}:{} is discovered twice", dns.name, dns.port))?;
        }
        for (i, k) in self.kubernetes.iter().enumerate() {
            k.check().map_err(|e| e.under(&format!("kubernetes[{i}]")))?;
        }
        match &self.inference_pool {
            Some(pool) => pool.check().map_err(|e| e.under("inference_pool")),
            None => Ok(()),
        }
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
        check_metrics_path(&self.metrics_path)
    }
}

impl InferencePoolDiscovery {
    fn check(&self) -> Result<(), Invalid> {
        check(!self.namespace.trim().is_empty(), "namespace", "must name the pool's namespace")?;
        check(!self.name.trim().is_empty(), "name", "must name the InferencePool")?;
        check_metrics_path(&self.metrics_path)
    }
}

fn check_metrics_path(path: &Option<String>) -> Result<(), Invalid> {
    match path {
        Some(path) => check(path.starts_with('/'), "metrics_path", &format!("{path:?} must start with /")),
        None => Ok(()),
    }
}

/// The Kubernetes API server's `http(s)://` URL, checked when read.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String")]
#[schemars(with = "String")]
pub struct ApiServer(pub http::Uri);

impl TryFrom<String> for ApiServer {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.parse::<http::Uri>() {
            Ok(uri) if matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some() => Ok(ApiServer(uri)),
            _ => Err(format!("{text:?} is not an http(s) URL")),
        }
    }
}
