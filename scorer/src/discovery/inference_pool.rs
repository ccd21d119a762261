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
use crate::config::{InferencePoolDiscovery, ModelRewriteRule, RewriteTarget};
use crate::scorer::Scorer;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde::Deserialize;
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
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Spec {
        selector: Selector,
        target_ports: Vec<Port>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Selector {
        match_labels: BTreeMap<String, String>,
    }
    #[derive(Deserialize)]
    struct Port {
        number: std::num::NonZeroU16,
    }
    let spec = Spec::deserialize(pool.get("spec").ok_or("no spec")?).map_err(|e| format!("spec: {e}"))?;
    let labels = spec.selector.match_labels;
    if labels.is_empty() || spec.target_ports.is_empty() {
        return Err("spec.selector.matchLabels and spec.targetPorts must not be empty".into());
    }
    let selector = labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
    Ok(PoolSpec { selector, target_ports: spec.target_ports.iter().map(|p| p.number.get()).collect() })
}

/// Every endpoint a pod contributes to the pool: one per target port (rank), with that
/// rank's KV-event and replay ports; none while it cannot serve.
pub fn endpoints(pod: &Pod, spec: &PoolSpec, config: &InferencePoolDiscovery) -> Vec<(SocketAddr, DiscoveredPod)> {
    let Some((ip, role)) = serving(pod, &config.role_label) else { return Vec::new() };
    let events = annotated_port(pod, KV_EVENTS_PORT_ANNOTATION).or(config.kv_events_port);
    let replay = annotated_port(pod, REPLAY_PORT_ANNOTATION).or(config.kv_events_replay_port);
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

/// Whether an object's `spec.poolRef` names the InferencePool `pool`.
fn names_pool(object: &serde_json::Value, pool: &str) -> bool {
    let Some(pool_ref) = object.pointer("/spec/poolRef") else { return false };
    let field = |name: &str, default: &'static str| pool_ref.get(name).and_then(|v| v.as_str()).unwrap_or(default);
    pool_ref.get("name").and_then(|v| v.as_str()) == Some(pool)
        && field("kind", "InferencePool") == "InferencePool"
        && field("group", "inference.networking.k8s.io") == "inference.networking.k8s.io"
}

/// An InferenceObjective's priority, if it is one of `pool`'s (its `spec.poolRef` names that
/// InferencePool); unset, 0.
pub fn objective_priority(objective: &serde_json::Value, pool: &str) -> Option<i32> {
    let priority = objective.pointer("/spec/priority").and_then(|p| p.as_i64());
    names_pool(objective, pool).then(|| priority.and_then(|p| i32::try_from(p).ok()).unwrap_or(0))
}

/// An InferenceModelRewrite's rules, if it is one of `pool`'s; an error naming the field when
/// a rule cannot be used (the object is then left out whole).
pub fn model_rewrite_rules(rewrite: &serde_json::Value, pool: &str) -> Option<Result<Vec<ModelRewriteRule>, String>> {
    #[derive(Deserialize)]
    struct Rule {
        #[serde(default)]
        matches: Vec<Match>,
        #[serde(default)]
        targets: Vec<Target>,
    }
    #[derive(Deserialize)]
    struct Match {
        model: ModelMatch,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ModelMatch {
        #[serde(rename = "type", default)]
        kind: Option<String>,
        value: String,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Target {
        model_rewrite: String,
        weight: Option<u32>,
    }
    if !names_pool(rewrite, pool) {
        return None;
    }
    let rules = rewrite.pointer("/spec/rules").cloned().unwrap_or_default();
    let read = || -> Result<Vec<ModelRewriteRule>, String> {
        let rules: Vec<Rule> = serde_json::from_value(rules).map_err(|e| format!("spec.rules: {e}"))?;
        rules
            .into_iter()
            .enumerate()
            .map(|(i, rule)| {
                if let Some(kind) = rule.matches.iter().filter_map(|m| m.model.kind.as_deref()).find(|k| *k != "Exact")
                {
                    return Err(format!("spec.rules[{i}].matches: match type {kind:?} (only Exact is defined)"));
                }
                let targets =
                    rule.targets.into_iter().map(|t| RewriteTarget { model: t.model_rewrite, weight: t.weight });
                let rule = ModelRewriteRule {
                    matches: rule.matches.into_iter().map(|m| m.model.value).collect(),
                    targets: targets.collect(),
                };
                match rule.problem() {
                    Some((field, why)) => Err(format!("spec.rules[{i}].{field}: {why}")),
                    None => Ok(rule),
                }
            })
            .collect()
    };
    Some(read())
}

/// Follows one kind of object of the pool's namespace until the process stops: `read` takes
/// an object for the pool (`None`: another pool's or unusable), and `apply` gets them all, by
/// name, whenever they change.
async fn follow_pool_objects<T: Clone + std::fmt::Debug>(
    scorer: Arc<Scorer>,
    config: InferencePoolDiscovery,
    (kind, plural): (&str, &str),
    read: impl Fn(&Scorer, &DynamicObject) -> Option<T>,
    apply: impl Fn(&Scorer, BTreeMap<String, T>),
) {
    let source = format!("{plural}:{}/{}", config.namespace, config.name);
    let client = kubernetes::client(&scorer, config.api_server.as_ref(), &source).await;
    let gvk = GroupVersionKind::gvk("inference.networking.x-k8s.io", "v1alpha2", kind);
    let api: Api<DynamicObject> =
        Api::namespaced_with(client, &config.namespace, &ApiResource::from_gvk_with_plural(&gvk, plural));
    let mut events = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
    // By object name; a relist builds the next one whole.
    let (mut objects, mut relisted) = (BTreeMap::new(), None::<BTreeMap<String, T>>);
    let file = |map: &mut BTreeMap<String, T>, object: &DynamicObject| {
        let name = object.metadata.name.clone().unwrap_or_default();
        match read(&scorer, object) {
            Some(value) => map.insert(name, value),
            None => map.remove(&name),
        };
    };
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relisted = Some(BTreeMap::new()),
            Ok(Event::InitApply(object)) => file(relisted.get_or_insert_default(), &object),
            Ok(Event::InitDone) => objects = relisted.take().unwrap_or_default(),
            Ok(Event::Apply(object)) => file(&mut objects, &object),
            Ok(Event::Delete(object)) => {
                objects.remove(object.metadata.name.as_deref().unwrap_or_default());
            }
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
                tracing::warn!(%source, "{kind} watch failed ({e}); retrying, the last ones kept");
                continue;
            }
        }
        if relisted.is_none() {
            tracing::info!(%source, ?objects, "the pool's {plural}");
            apply(&scorer, objects.clone());
        }
    }
}

/// Follows the InferenceObjectives of the pool in its namespace until the process stops: the
/// scorer's admission takes their priorities as they change.
pub async fn run_objectives(scorer: Arc<Scorer>, config: InferencePoolDiscovery) {
    let pool = config.name.clone();
    let read = |_: &Scorer, object: &DynamicObject| objective_priority(&object.data, &pool);
    let apply = |scorer: &Scorer, objectives| scorer.set_pool_objectives(objectives);
    follow_pool_objects(scorer, config, ("InferenceObjective", "inferenceobjectives"), read, apply).await
}

/// Follows the InferenceModelRewrites of the pool in its namespace until the process stops:
/// their rules (the oldest object's first) apply to the next request as they change. An
/// object with a rule kvgate cannot use is left out, counted and logged with the reason.
pub async fn run_model_rewrites(scorer: Arc<Scorer>, config: InferencePoolDiscovery) {
    let pool = config.name.clone();
    // Its creation time orders it among the pool's: the oldest object's rules first.
    let read = |scorer: &Scorer, object: &DynamicObject| match model_rewrite_rules(&object.data, &pool)? {
        Ok(rules) => Some((object.metadata.creation_timestamp.as_ref().map(|t| t.0), rules)),
        Err(why) => {
            let name = object.metadata.name.as_deref().unwrap_or_default();
            scorer.metrics.discovery_errors.with_label_values(&[&format!("inferencemodelrewrites:{name}")]).inc();
            tracing::warn!(rewrite = name, "InferenceModelRewrite left out: {why}");
            None
        }
    };
    let apply = |scorer: &Scorer, rewrites: BTreeMap<String, (Option<_>, Vec<ModelRewriteRule>)>| {
        let mut by_age: Vec<_> = rewrites.into_iter().map(|(name, (created, rules))| (created, name, rules)).collect();
        by_age.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        scorer.set_pool_rewrites(by_age.into_iter().flat_map(|(_, _, rules)| rules).collect());
    };
    follow_pool_objects(scorer, config, ("InferenceModelRewrite", "inferencemodelrewrites"), read, apply).await
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
    let pool = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
    let pool = ApiResource::from_gvk_with_plural(&pool, "inferencepools");
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &config.namespace, &pool);
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
