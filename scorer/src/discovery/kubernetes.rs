//! Kubernetes discovery: the pods matching a label selector in a namespace, through the API
//! server's list + watch (`kube`'s watcher: it relists when a watch expires with 410 Gone
//! and backs off on errors). A pod counts while it is Running, Ready, not terminating and has
//! an IP; its role comes from a label, its ports from the configuration or its annotations.

use super::{DiscoveredPod, PodEndpoints, Registry};
use crate::config::{KubernetesDiscovery, Role};
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

/// What `pod` contributes: its address and description, or `None` while it cannot serve
/// (not Running, not Ready, terminating, no IP) or cannot be understood (unknown role).
pub fn discovered(pod: &Pod, config: &KubernetesDiscovery) -> Option<(SocketAddr, DiscoveredPod)> {
    let status = pod.status.as_ref()?;
    let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
    if status.phase.as_deref() != Some("Running") || !ready || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let role = match pod.metadata.labels.as_ref().and_then(|l| l.get(&config.role_label)).map(String::as_str) {
        None | Some("both") => Role::Both,
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some(other) => {
            tracing::warn!(pod = name, label = %config.role_label, "discovery: unknown role {other:?}; pod skipped");
            return None;
        }
    };
    let annotation = |key: &str| -> Option<Option<u16>> {
        let value = pod.metadata.annotations.as_ref()?.get(key)?;
        match value.parse() {
            Ok(port) => Some(Some(port)),
            Err(_) => {
                tracing::warn!(pod = name, "discovery: annotation {key}={value:?} is not a port; ignored");
                None
            }
        }
    };
    let port = annotation(PORT_ANNOTATION).flatten().unwrap_or(config.port);
    let events = annotation(KV_EVENTS_PORT_ANNOTATION).unwrap_or(config.kv_events_port);
    let replay = annotation(REPLAY_PORT_ANNOTATION).unwrap_or(config.kv_events_replay_port);
    let endpoints = PodEndpoints::at(ip, port, events, replay, config.metrics_path.as_deref());
    Some((SocketAddr::new(ip, port), DiscoveredPod { role, endpoints }))
}

/// The client: the configured API server, else in-cluster / `KUBECONFIG`.
async fn client(config: &KubernetesDiscovery) -> Result<Client, String> {
    match &config.api_server {
        Some(url) => {
            let uri = url.parse().map_err(|e| format!("api_server {url:?}: {e}"))?;
            Client::try_from(kube::Config::new(uri)).map_err(|e| e.to_string())
        }
        None => Client::try_default().await.map_err(|e| e.to_string()),
    }
}

/// Watches the pods until the process stops.
pub async fn run(scorer: Arc<Scorer>, config: KubernetesDiscovery) {
    let source = format!("kubernetes:{}/{}", config.namespace, config.label_selector);
    let client = loop {
        match client(&config).await {
            Ok(c) => break c,
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
                tracing::error!(%source, "discovery: no Kubernetes client ({e}); retrying in 5 s");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    };
    let api: Api<Pod> = Api::namespaced(client, &config.namespace);
    let watch = watcher::Config::default().labels(&config.label_selector);
    let mut events = watcher::watcher(api, watch).default_backoff().boxed();
    let mut registry = Registry::default();
    // Pods by name as last seen; during a (re)list, the pods listed so far.
    let mut current: BTreeMap<String, (SocketAddr, DiscoveredPod)> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, (SocketAddr, DiscoveredPod)>> = None;
    while let Some(event) = events.next().await {
        let changed = match event {
            Ok(Event::Init) => {
                relisting = Some(BTreeMap::new());
                false
            }
            Ok(Event::InitApply(pod)) => {
                if let (Some(list), Some(name)) = (relisting.as_mut(), pod.metadata.name.clone())
                    && let Some(found) = discovered(&pod, &config)
                {
                    list.insert(name, found);
                }
                false
            }
            Ok(Event::InitDone) => {
                // Pods deleted while no watch was running are gone from the new list.
                current = relisting.take().unwrap_or_default();
                true
            }
            Ok(Event::Apply(pod)) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                match discovered(&pod, &config) {
                    Some(found) => current.insert(name, found),
                    None => current.remove(&name),
                };
                true
            }
            Ok(Event::Delete(pod)) => {
                current.remove(pod.metadata.name.as_deref().unwrap_or_default());
                true
            }
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
                tracing::warn!(%source, "discovery: watch failed ({e}); retrying, pods kept");
                false
            }
        };
        if changed {
            let desired: BTreeMap<SocketAddr, DiscoveredPod> = current.values().cloned().collect();
            registry.update(&scorer, &desired);
            scorer.metrics.discovered_pods.with_label_values(&[&source]).set(registry.present().len() as f64);
        }
    }
}
