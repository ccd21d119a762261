//! InferencePool discovery: the pods of a Gateway API Inference Extension `InferencePool`
//! (`inference.networking.k8s.io/v1`), the way the pool itself says — the pool object is
//! watched, and the pods its `selector` matches in its namespace; every `podIP:targetPort` is
//! an endpoint. Several target ports are data-parallel ranks: rank `r` (the `r`-th target
//! port) publishes its KV events on the configured port + `r`, as vLLM offsets them. A change
//! of the pool (selector, ports) re-watches its pods; a deleted pool empties the fleet.

use super::kubernetes::{
    self, KV_EVENTS_PORT_ANNOTATION, PodWatch, REPLAY_PORT_ANNOTATION, annotated_port, annotated_slowness, serving,
};
use super::{DiscoveredPod, PodEndpoints, Registry};
use crate::config::InferencePoolDiscovery;
use crate::scorer::Scorer;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// What a pool says about its pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels` as a label selector (`k=v,…`).
    pub selector: String,
    /// `spec.targetPorts[].number`, in order: data-parallel rank r is the r-th.
    pub target_ports: Vec<u16>,
}

/// Reads a pool's `spec` (an InferencePool v1 object, as JSON).
pub fn pool_spec(pool: &serde_json::Value) -> Result<PoolSpec, String> {
    let spec = pool.get("spec").ok_or("no spec")?;
    let labels = spec
        .pointer("/selector/matchLabels")
        .and_then(|m| m.as_object())
        .filter(|m| !m.is_empty())
        .ok_or("spec.selector.matchLabels is missing or empty")?;
    let mut pairs = Vec::with_capacity(labels.len());
    for (k, v) in labels {
        let v = v.as_str().ok_or_else(|| format!("label {k} is not a string"))?;
        pairs.push(format!("{k}={v}"));
    }
    pairs.sort();
    let ports = spec.get("targetPorts").and_then(|p| p.as_array()).ok_or("spec.targetPorts is missing")?;
    let target_ports = ports
        .iter()
        .map(|p| {
            p.get("number")
                .and_then(|n| n.as_u64())
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("target port {p} is not a port number"))
        })
        .collect::<Result<Vec<u16>, String>>()?;
    if target_ports.is_empty() {
        return Err("spec.targetPorts is empty".into());
    }
    Ok(PoolSpec { selector: pairs.join(","), target_ports })
}

/// Every endpoint a pod contributes to the pool: one per target port (rank), with that
/// rank's KV-event and replay ports; none while it cannot serve.
pub fn endpoints(pod: &Pod, spec: &PoolSpec, config: &InferencePoolDiscovery) -> Vec<(SocketAddr, DiscoveredPod)> {
    let Some((ip, role)) = serving(pod, &config.role_label) else { return Vec::new() };
    let events = annotated_port(pod, KV_EVENTS_PORT_ANNOTATION).unwrap_or(config.kv_events_port);
    let replay = annotated_port(pod, REPLAY_PORT_ANNOTATION).unwrap_or(config.kv_events_replay_port);
    let slowness = annotated_slowness(pod);
    let rank = |base: Option<u16>, r: usize| base.and_then(|b| b.checked_add(r as u16));
    spec.target_ports
        .iter()
        .enumerate()
        .map(|(r, &port)| {
            let endpoints =
                PodEndpoints::at(ip, port, rank(events, r), rank(replay, r), config.metrics_path.as_deref());
            (SocketAddr::new(ip, port), DiscoveredPod { role, endpoints, slowness })
        })
        .collect()
}

/// An InferenceObjective's priority, if it is one of `pool`'s (its `spec.poolRef` names that
/// InferencePool); unset, 0.
pub fn objective_priority(objective: &serde_json::Value, pool: &str) -> Option<i32> {
    let pool_ref = objective.pointer("/spec/poolRef")?;
    let field = |name: &str, default: &'static str| pool_ref.get(name).and_then(|v| v.as_str()).unwrap_or(default);
    let ours = pool_ref.get("name").and_then(|v| v.as_str()) == Some(pool)
        && field("kind", "InferencePool") == "InferencePool"
        && field("group", "inference.networking.k8s.io") == "inference.networking.k8s.io";
    let priority = objective.pointer("/spec/priority").and_then(|p| p.as_i64());
    ours.then(|| priority.and_then(|p| i32::try_from(p).ok()).unwrap_or(0))
}

fn objective_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective");
    ApiResource::from_gvk_with_plural(&gvk, "inferenceobjectives")
}

/// Follows the InferenceObjectives of the pool in its namespace until the process stops: the
/// scorer's admission takes their priorities as they change.
pub async fn run_objectives(scorer: Arc<Scorer>, config: InferencePoolDiscovery) {
    let source = format!("inference_objectives:{}/{}", config.namespace, config.name);
    let client = kubernetes::client(&scorer, config.api_server.as_ref(), &source).await;
    let api: Api<DynamicObject> = Api::namespaced_with(client, &config.namespace, &objective_resource());
    let mut events = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    // By object name; a relist builds the next one whole.
    let (mut objectives, mut relisted) = (BTreeMap::new(), None::<BTreeMap<String, i32>>);
    let file = |map: &mut BTreeMap<String, i32>, object: &DynamicObject| {
        let name = object.metadata.name.clone().unwrap_or_default();
        match objective_priority(&object.data, &config.name) {
            Some(priority) => map.insert(name, priority),
            None => map.remove(&name),
        };
    };
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relisted = Some(BTreeMap::new()),
            Ok(Event::InitApply(object)) => file(relisted.get_or_insert_default(), &object),
            Ok(Event::InitDone) => objectives = relisted.take().unwrap_or_default(),
            Ok(Event::Apply(object)) => file(&mut objectives, &object),
            Ok(Event::Delete(object)) => {
                objectives.remove(object.metadata.name.as_deref().unwrap_or_default());
            }
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
                tracing::warn!(%source, "InferenceObjective watch failed ({e}); retrying, priorities kept");
                continue;
            }
        }
        if relisted.is_none() {
            tracing::info!(%source, ?objectives, "the pool's objectives");
            scorer.set_pool_objectives(objectives.clone());
        }
    }
}

/// The pool's resource, for the dynamic API.
fn pool_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
    ApiResource::from_gvk_with_plural(&gvk, "inferencepools")
}

type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

fn watch_pods(client: &Client, namespace: &str, spec: &PoolSpec) -> PodEvents {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    watcher::watcher(api, watcher::Config::default().labels(&spec.selector)).default_backoff().boxed()
}

async fn next_pod_event(events: &mut Option<PodEvents>) -> Option<Result<Event<Pod>, watcher::Error>> {
    match events {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

/// Follows the pool and its pods until the process stops.
pub async fn run(scorer: Arc<Scorer>, config: InferencePoolDiscovery) {
    let source = format!("inference_pool:{}/{}", config.namespace, config.name);
    let client = kubernetes::client(&scorer, config.api_server.as_ref(), &source).await;
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &config.namespace, &pool_resource());
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", config.name));
    let mut pool_events = watcher::watcher(pools, by_name).default_backoff().boxed();
    let mut spec: Option<PoolSpec> = None;
    let mut pod_events: Option<PodEvents> = None;
    let mut pods = PodWatch::default();
    let mut registry = Registry::default();
    let error = |what: &str, e: &dyn std::fmt::Display| {
        scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
        tracing::warn!(%source, "discovery: {what} ({e}); retrying, pods kept");
    };
    loop {
        let changed = tokio::select! {
            event = pool_events.next() => match event {
                None => return,
                Some(Ok(Event::Apply(pool) | Event::InitApply(pool))) => match pool_spec(&pool.data) {
                    Ok(new) if Some(&new) == spec.as_ref() => false,
                    Ok(new) => {
                        tracing::info!(%source, selector = %new.selector, ports = ?new.target_ports, "discovery: pool spec");
                        pod_events = Some(watch_pods(&client, &config.namespace, &new));
                        pods = PodWatch::default();
                        spec = Some(new);
                        true
                    }
                    Err(e) => {
                        error("the pool's spec is unusable", &e);
                        false
                    }
                },
                Some(Ok(Event::Delete(_))) => {
                    tracing::warn!(%source, "discovery: the pool was deleted; no pods");
                    (spec, pod_events, pods) = (None, None, PodWatch::default());
                    true
                }
                Some(Ok(Event::Init | Event::InitDone)) => false,
                Some(Err(e)) => {
                    error("pool watch failed", &e);
                    false
                }
            },
            Some(event) = next_pod_event(&mut pod_events) => match (event, &spec) {
                (Ok(event), Some(spec)) => pods.apply(event, |pod| endpoints(pod, spec, &config)),
                (Ok(_), None) => false,
                (Err(e), _) => {
                    error("pod watch failed", &e);
                    false
                }
            },
        };
        if changed {
            registry.update(&scorer, &pods.desired());
            scorer.metrics.discovered_pods.with_label_values(&[&source]).set(registry.present().len() as f64);
        }
    }
}
