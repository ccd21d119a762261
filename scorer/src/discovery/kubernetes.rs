//! Kubernetes discovery: the pods matching a label selector in a namespace, through the API
//! server's list + watch (`kube`'s watcher: it relists when a watch expires with 410 Gone
//! and backs off on errors). A pod counts while it is Running, Ready, not terminating and has
//! an IP; its role comes from a label, its ports from the configuration or its annotations.
//! [`PodWatch`] follows one such watch; the InferencePool discovery uses it too.

use super::{DiscoveredPod, PodEndpoints, Registry};
use crate::config::{ApiServer, KubernetesDiscovery, Role};
use crate::scorer::Scorer;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Annotation overriding the HTTP port.
pub const PORT_ANNOTATION: &str = "kvgate.io/port";
/// Annotation overriding the KV-event port.
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kvgate.io/kv-events-port";
/// Annotation overriding the replay port.
pub const REPLAY_PORT_ANNOTATION: &str = "kvgate.io/kv-events-replay-port";
/// Annotation declaring the pod's slowness (`pods[].slowness` of a configured pod).
pub const SLOWNESS_ANNOTATION: &str = "kvgate.io/slowness";

/// A pod that can serve now — Running, Ready, not terminating, with an IP and a role kvgate
/// understands (from `role_label`; absent = both) — as its IP and role.
pub fn serving(pod: &Pod, role_label: &str) -> Option<(IpAddr, Role)> {
    let status = pod.status.as_ref()?;
    let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
    if status.phase.as_deref() != Some("Running") || !ready || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let role = match pod.metadata.labels.as_ref().and_then(|l| l.get(role_label)).map(String::as_str) {
        None | Some("both") => Role::Both,
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some(other) => {
            let name = pod.metadata.name.as_deref().unwrap_or("?");
            tracing::warn!(pod = name, label = %role_label, "discovery: unknown role {other:?}; pod skipped");
            return None;
        }
    };
    Some((ip, role))
}

/// The pod's annotation `key` as a `T` that `valid` accepts: `None` without it, or when it
/// is not `what` (warned, then ignored).
fn annotation<T: std::str::FromStr>(pod: &Pod, key: &str, valid: impl Fn(&T) -> bool, what: &str) -> Option<T> {
    let value = pod.metadata.annotations.as_ref()?.get(key)?;
    let parsed = value.parse().ok().filter(valid);
    if parsed.is_none() {
        let name = pod.metadata.name.as_deref().unwrap_or("?");
        tracing::warn!(pod = name, "discovery: annotation {key}={value:?} is not {what}; ignored");
    }
    parsed
}

/// A port from the pod's annotation `key`.
pub fn annotated_port(pod: &Pod, key: &str) -> Option<u16> {
    annotation(pod, key, |_| true, "a port")
}

/// The pod's declared slowness (annotation `kvgate.io/slowness`), a positive number.
pub fn annotated_slowness(pod: &Pod) -> Option<f64> {
    annotation(pod, SLOWNESS_ANNOTATION, |s: &f64| s.is_finite() && *s > 0.0, "a positive number")
}

/// What `pod` contributes: its address and description, or `None` while it cannot serve
/// (see [`serving`]).
pub fn discovered(pod: &Pod, config: &KubernetesDiscovery) -> Option<(SocketAddr, DiscoveredPod)> {
    let (ip, role) = serving(pod, &config.role_label)?;
    let port = annotated_port(pod, PORT_ANNOTATION).unwrap_or(config.port);
    let events = annotated_port(pod, KV_EVENTS_PORT_ANNOTATION).or(config.kv_events_port);
    let replay = annotated_port(pod, REPLAY_PORT_ANNOTATION).or(config.kv_events_replay_port);
    let endpoints = PodEndpoints::at(ip, port, events, replay, config.metrics_path.as_deref());
    Some((SocketAddr::new(ip, port), DiscoveredPod { role, endpoints, slowness: annotated_slowness(pod) }))
}

/// The client: the configured API server, else in-cluster / `KUBECONFIG`; retried every 5 s
/// (counted) until it can be built.
pub async fn client(scorer: &Scorer, api_server: Option<&ApiServer>, source: &str) -> Client {
    loop {
        let built = match api_server {
            Some(ApiServer(uri)) => Client::try_from(kube::Config::new(uri.clone())).map_err(|e| e.to_string()),
            None => Client::try_default().await.map_err(|e| e.to_string()),
        };
        match built {
            Ok(c) => return c,
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[source]).inc();
                tracing::error!(%source, "discovery: no Kubernetes client ({e}); retrying in 5 s");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// The endpoints of the pods one list + watch has shown, by pod name. During a (re)list the
/// pods listed so far are kept apart, so pods deleted while no watch ran disappear when the
/// list is complete.
#[derive(Default)]
pub struct PodWatch {
    current: BTreeMap<String, Vec<(SocketAddr, DiscoveredPod)>>,
    relisting: Option<BTreeMap<String, Vec<(SocketAddr, DiscoveredPod)>>>,
}

impl PodWatch {
    /// Applies one event, `endpoints` saying what a pod contributes; true when the endpoints
    /// may have changed.
    pub fn apply(&mut self, event: Event<Pod>, endpoints: impl Fn(&Pod) -> Vec<(SocketAddr, DiscoveredPod)>) -> bool {
        match event {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                if let (Some(list), Some(name)) = (self.relisting.as_mut(), pod.metadata.name.clone()) {
                    list.insert(name, endpoints(&pod));
                }
                false
            }
            Event::InitDone => {
                self.current = self.relisting.take().unwrap_or_default();
                true
            }
            Event::Apply(pod) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                self.current.insert(name, endpoints(&pod));
                true
            }
            Event::Delete(pod) => {
                self.current.remove(pod.metadata.name.as_deref().unwrap_or_default());
                true
            }
        }
    }

    /// Every endpoint of every pod seen.
    pub fn desired(&self) -> BTreeMap<SocketAddr, DiscoveredPod> {
        self.current.values().flatten().cloned().collect()
    }
}

/// Watches the pods until the process stops.
pub async fn run(scorer: Arc<Scorer>, config: KubernetesDiscovery) {
    let source = format!("kubernetes:{}/{}", config.namespace, config.label_selector);
    let client = client(&scorer, config.api_server.as_ref(), &source).await;
    let api: Api<Pod> = Api::namespaced(client, &config.namespace);
    let watch = watcher::Config::default().labels(&config.label_selector);
    let mut events = watcher::watcher(api, watch).default_backoff().boxed();
    let mut registry = Registry::default();
    let mut pods = PodWatch::default();
    while let Some(event) = events.next().await {
        match event {
            Ok(event) => {
                if pods.apply(event, |pod| discovered(pod, &config).into_iter().collect()) {
                    registry.update(&scorer, &pods.desired());
                    scorer.metrics.discovered_pods.with_label_values(&[&source]).set(registry.present().len() as f64);
                }
            }
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
                tracing::warn!(%source, "discovery: watch failed ({e}); retrying, pods kept");
            }
        }
    }
}
