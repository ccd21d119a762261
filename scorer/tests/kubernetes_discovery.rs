//! Kubernetes discovery against an API server stand-in that speaks the real list + watch
//! protocol (`GET /api/v1/namespaces/{ns}/pods`, a `PodList` with a resourceVersion, then
//! `?watch=true` streaming one JSON event per line, `ERROR` 410 Gone when a resourceVersion
//! is too old) with pod objects shaped like the API server's. The scorer's discovery task
//! runs against it through the real `kube` client and watcher.

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kvgate_route_api::{Api, LifecycleEvent, LifecycleReport};
use kvgate_scorer::config::Config;
use kvgate_scorer::discovery::{inference_pool, kubernetes};
use kvgate_scorer::scorer::{Limits, PickError, Scorer};
use kvgate_tokenize::Tokenizer;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// One resource collection (pods, inferencepools): its objects, watches and what clients asked.
#[derive(Default)]
struct Collection {
    objects: BTreeMap<String, Value>,
    /// Each watch with its label selector (`k=v,…`, equality only: what discovery sends).
    watchers: Vec<(String, mpsc::UnboundedSender<String>)>,
    /// The next watch gets `ERROR` 410 Gone (its resourceVersion is "too old").
    expire_next_watch: bool,
    lists: u32,
    selectors: Vec<String>,
}

#[derive(Default)]
struct ApiState {
    /// By path segment: "pods", "inferencepools".
    collections: BTreeMap<&'static str, Collection>,
    resource_version: u64,
}

type Shared = Arc<Mutex<ApiState>>;

/// Whether `object`'s labels satisfy an equality label selector (`k=v,…`; empty: all).
fn selected(object: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| match term.split_once('=') {
        Some((k, v)) => object["metadata"]["labels"][k] == v,
        None => false,
    })
}

/// Sends a watch event to the watchers whose selector the object satisfies.
fn notify(c: &mut Collection, kind: &str, object: &Value) {
    let line = format!("{}\n", json!({"type": kind, "object": object}));
    c.watchers.retain(|(selector, w)| !selected(object, selector) || w.send(line.clone()).is_ok());
}

/// List or watch (`?watch=true`) one collection, the way the API server does.
fn list_or_watch(state: &Shared, resource: &'static str, list_kind: &str, q: &HashMap<String, String>) -> Response {
    let mut s = state.lock().unwrap();
    let version = s.resource_version;
    let c = s.collections.entry(resource).or_default();
    let labels = q.get("labelSelector").cloned().unwrap_or_default();
    let selector = [q.get("labelSelector"), q.get("fieldSelector")].into_iter().flatten().cloned().collect::<Vec<_>>();
    c.selectors.push(selector.join(";"));
    if matches!(q.get("watch").map(String::as_str), Some("true" | "1")) {
        let (tx, rx) = mpsc::unbounded_channel::<String>();
        if std::mem::take(&mut c.expire_next_watch) {
            let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "message": "too old resource version: 1 (42)", "reason": "Expired", "code": 410}});
            tx.send(format!("{gone}\n")).unwrap();
            drop(tx);
        } else {
            c.watchers.push((labels, tx));
        }
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|line| (Ok::<_, std::convert::Infallible>(line), rx))
        });
        return ([("content-type", "application/json")], Body::from_stream(stream)).into_response();
    }
    c.lists += 1;
    let api_version = match resource {
        "pods" => "v1",
        "inferenceobjectives" | "inferencemodelrewrites" => "inference.networking.x-k8s.io/v1alpha2",
        _ => "inference.networking.k8s.io/v1",
    };
    let list = json!({"apiVersion": api_version, "kind": list_kind,
        "metadata": {"resourceVersion": version.to_string()},
        "items": c.objects.values().filter(|o| selected(o, &labels)).cloned().collect::<Vec<_>>()});
    axum::Json(list).into_response()
}

async fn pods(State(state): State<Shared>, Query(q): Query<HashMap<String, String>>) -> Response {
    list_or_watch(&state, "pods", "PodList", &q)
}

async fn pools(State(state): State<Shared>, Query(q): Query<HashMap<String, String>>) -> Response {
    list_or_watch(&state, "inferencepools", "InferencePoolList", &q)
}

async fn objectives(State(state): State<Shared>, Query(q): Query<HashMap<String, String>>) -> Response {
    list_or_watch(&state, "inferenceobjectives", "InferenceObjectiveList", &q)
}

async fn model_rewrites(State(state): State<Shared>, Query(q): Query<HashMap<String, String>>) -> Response {
    list_or_watch(&state, "inferencemodelrewrites", "InferenceModelRewriteList", &q)
}

struct ApiServer {
    url: String,
    state: Shared,
}

impl ApiServer {
    async fn start() -> ApiServer {
        let state: Shared = Arc::default();
        let app = Router::new()
            .route("/api/v1/namespaces/inference/pods", get(pods))
            .route("/apis/inference.networking.k8s.io/v1/namespaces/inference/inferencepools", get(pools))
            .route(
                "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/inference/inferenceobjectives",
                get(objectives),
            )
            .route(
                "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/inference/inferencemodelrewrites",
                get(model_rewrites),
            )
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        ApiServer { url, state }
    }

    /// Creates or replaces an object; watchers see ADDED or MODIFIED unless `silently`.
    fn put_in(&self, resource: &'static str, mut object: Value, silently: bool) {
        let mut s = self.state.lock().unwrap();
        s.resource_version += 1;
        object["metadata"]["resourceVersion"] = json!(s.resource_version.to_string());
        let c = s.collections.entry(resource).or_default();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        let kind = if c.objects.contains_key(&name) { "MODIFIED" } else { "ADDED" };
        c.objects.insert(name, object.clone());
        if !silently {
            notify(c, kind, &object);
        }
    }

    fn delete_in(&self, resource: &'static str, name: &str, silently: bool) {
        let mut s = self.state.lock().unwrap();
        s.resource_version += 1;
        let version = s.resource_version;
        let c = s.collections.entry(resource).or_default();
        let mut object = c.objects.remove(name).expect("object exists");
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        if !silently {
            notify(c, "DELETED", &object);
        }
    }

    fn put(&self, pod: Value, silently: bool) {
        self.put_in("pods", pod, silently)
    }

    fn delete(&self, name: &str, silently: bool) {
        self.delete_in("pods", name, silently)
    }

    fn lists(&self, resource: &'static str) -> u32 {
        self.state.lock().unwrap().collections.get(resource).map_or(0, |c| c.lists)
    }

    fn selectors(&self, resource: &'static str) -> Vec<String> {
        self.state.lock().unwrap().collections.get(resource).map_or(Vec::new(), |c| c.selectors.clone())
    }

    /// Ends every pod watch; the next one is answered 410 Gone, so the client must relist.
    fn expire_watches(&self) {
        let mut s = self.state.lock().unwrap();
        let c = s.collections.entry("pods").or_default();
        c.watchers.clear();
        c.expire_next_watch = true;
    }
}

/// A pod object as the API server returns it.
fn pod(name: &str, ip: Option<&str>, phase: &str, ready: bool, role: Option<&str>, annotations: Value) -> Value {
    let mut labels = json!({"app.kubernetes.io/name": "vllm", "pod-template-hash": "7d9f8c6b5"});
    if let Some(role) = role {
        labels["llm-d.ai/role"] = json!(role);
    }
    let condition = |t: &str, ok: bool| {
        json!({"type": t, "status": if ok { "True" } else { "False" },
        "lastProbeTime": null, "lastTransitionTime": "2026-11-22T06:00:00Z"})
    };
    let mut status = json!({"phase": phase, "hostIP": "10.0.0.1", "hostIPs": [{"ip": "10.0.0.1"}],
        "qosClass": "Burstable", "startTime": "2026-11-22T05:59:00Z",
        "conditions": [condition("PodReadyToStartContainers", true), condition("Initialized", true),
                       condition("Ready", ready), condition("ContainersReady", ready), condition("PodScheduled", true)]});
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "inference", "uid": format!("uid-{name}"),
            "generateName": "vllm-7d9f8c6b5-", "creationTimestamp": "2026-11-22T05:59:00Z",
            "labels": labels, "annotations": annotations,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-7d9f8c6b5",
                "uid": "rs-uid", "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": "node-1", "restartPolicy": "Always", "containers": [{"name": "vllm",
            "image": "vllm/vllm-openai:v0.33.0", "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]}]},
        "status": status})
}

/// Polls until the scorer's present pods (address, role) are `want`.
async fn wait_pods(scorer: &Scorer, want: &[(&str, &str)]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now: Vec<(String, String)> = scorer
            .pods_view()
            .into_iter()
            .map(|p| (p.name, serde_json::to_value(p.role).unwrap().as_str().unwrap().to_string()))
            .collect();
        let expected: Vec<(String, String)> = want.iter().map(|(a, r)| (a.to_string(), r.to_string())).collect();
        if now == expected {
            return;
        }
        assert!(Instant::now() < deadline, "pods {now:?}, expected {expected:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn pods_follow_the_api_server_through_readiness_deletion_and_a_watch_restart() {
    let api = ApiServer::start().await;
    let none = json!({});
    api.put(pod("vllm-a", Some("10.1.0.1"), "Running", true, Some("prefill"), none.clone()), true);
    api.put(pod("vllm-b", Some("10.1.0.2"), "Running", true, None, none.clone()), true);
    api.put(pod("vllm-c", None, "Pending", false, Some("decode"), none.clone()), true);

    let yaml = format!(
        "discovery:\n  kubernetes:\n  - {{namespace: inference, label_selector: app.kubernetes.io/name=vllm, port: 8000, metrics_path: null, api_server: '{}'}}\n",
        api.url
    );
    let config = Config::parse(&yaml).unwrap();
    let k8s = config.discovery.kubernetes[0].clone();
    let scorer = Arc::new(Scorer::new(config, Tokenizer::fallback()));
    tokio::spawn(kubernetes::run(scorer.clone(), k8s));

    // The initial list: Running + Ready pods with an IP; the role from the label (absent = both).
    wait_pods(&scorer, &[("10.1.0.1:8000", "prefill"), ("10.1.0.2:8000", "both")]).await;
    assert!(api.selectors("pods").iter().all(|s| s == "app.kubernetes.io/name=vllm"));

    // Watch events: b turns not-ready, c becomes ready with its port in an annotation, a is
    // deleted, d is added.
    api.put(pod("vllm-b", Some("10.1.0.2"), "Running", false, None, none.clone()), false);
    wait_pods(&scorer, &[("10.1.0.1:8000", "prefill")]).await;
    let port = json!({"kvgate.io/port": "9000"});
    api.put(pod("vllm-c", Some("10.1.0.3"), "Running", true, Some("decode"), port), false);
    wait_pods(&scorer, &[("10.1.0.1:8000", "prefill"), ("10.1.0.3:9000", "decode")]).await;
    api.delete("vllm-a", false);
    let slow = json!({"kvgate.io/slowness": "2"});
    api.put(pod("vllm-d", Some("10.1.0.4"), "Running", true, Some("both"), slow), false);
    wait_pods(&scorer, &[("10.1.0.3:9000", "decode"), ("10.1.0.4:8000", "both")]).await;
    // d declared itself twice as slow: it is, from its first request (c alone is average).
    let slowness = |name: &str| scorer.pods_view().into_iter().find(|p| p.name == name).unwrap().slowness;
    assert_eq!((slowness("10.1.0.3:9000"), slowness("10.1.0.4:8000")), (1.0, 2.0));

    // The watch ends and its resourceVersion has expired (410 Gone): while no watch ran, c was
    // deleted and b became ready again. The relist must show both.
    let lists_before = api.lists("pods");
    api.expire_watches();
    api.delete("vllm-c", true);
    api.put(pod("vllm-b", Some("10.1.0.2"), "Running", true, None, none.clone()), true);
    wait_pods(&scorer, &[("10.1.0.2:8000", "both"), ("10.1.0.4:8000", "both")]).await;
    assert!(api.lists("pods") > lists_before, "the client relisted after 410 Gone");

    // Routing only ever answers present pods.
    let body = serde_json::to_vec(&json!({"prompt": "hello", "max_tokens": 4})).unwrap();
    let prepared = scorer.prepare(Api::Completions, &body).unwrap();
    let first = scorer.decide("first", &prepared, &Limits::default()).unwrap();
    assert_eq!(first.decode.address, "10.1.0.2:8000", "both idle: not d, declared twice as slow");
    for i in 0..20 {
        let pick = scorer.decide(&format!("r{i}"), &prepared, &Limits::default()).unwrap();
        assert!(["10.1.0.2:8000", "10.1.0.4:8000"].contains(&pick.decode.address.as_str()), "{}", pick.decode.address);
    }
}

#[test]
fn pods_that_cannot_serve_are_not_discovered() {
    let config = Config::parse(
        "discovery:\n  kubernetes:\n  - {namespace: inference, label_selector: app=vllm, port: 8000, kv_events_port: 5557}\n",
    )
    .unwrap();
    let k = &config.discovery.kubernetes[0];
    let parse = |v: Value| serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(v).unwrap();
    let none = json!({});
    let found =
        kubernetes::discovered(&parse(pod("p", Some("10.1.0.9"), "Running", true, None, none.clone())), k).unwrap();
    assert_eq!(found.0.to_string(), "10.1.0.9:8000");
    assert_eq!(found.1.endpoints.kv_events.as_deref(), Some("tcp://10.1.0.9:5557"));
    assert_eq!(found.1.endpoints.metrics.as_deref(), Some("http://10.1.0.9:8000/metrics"));
    assert!(
        kubernetes::discovered(&parse(pod("p", Some("10.1.0.9"), "Running", false, None, none.clone())), k).is_none()
    );
    assert!(
        kubernetes::discovered(&parse(pod("p", Some("10.1.0.9"), "Pending", true, None, none.clone())), k).is_none()
    );
    assert!(kubernetes::discovered(&parse(pod("p", None, "Running", true, None, none.clone())), k).is_none());
    assert!(
        kubernetes::discovered(&parse(pod("p", Some("10.1.0.9"), "Running", true, Some("router"), none.clone())), k)
            .is_none()
    );
    let mut terminating = pod("p", Some("10.1.0.9"), "Running", true, None, none.clone());
    terminating["metadata"]["deletionTimestamp"] = json!("2026-11-22T07:00:00Z");
    assert!(kubernetes::discovered(&parse(terminating), k).is_none());
    let annotated = json!({"kvgate.io/kv-events-port": "6000", "kvgate.io/port": "not a port"});
    let found = kubernetes::discovered(&parse(pod("p", Some("fd00::9"), "Running", true, None, annotated)), k).unwrap();
    assert_eq!(found.0.to_string(), "[fd00::9]:8000", "a malformed annotation is ignored");
    assert_eq!(found.1.endpoints.kv_events.as_deref(), Some("tcp://[fd00::9]:6000"));
    assert_eq!(found.1.slowness, None);
    let slowness = |value: &str| {
        let annotated = json!({"kvgate.io/slowness": value});
        kubernetes::discovered(&parse(pod("p", Some("10.1.0.9"), "Running", true, None, annotated)), k)
            .unwrap()
            .1
            .slowness
    };
    assert_eq!(slowness("2"), Some(2.0));
    assert_eq!(slowness("0.75"), Some(0.75));
    for bad in ["fast", "0", "-1", "NaN", "inf"] {
        assert_eq!(slowness(bad), None, "{bad:?} is ignored");
    }
}

/// An InferencePool v1 object as the API server returns it.
fn pool(app: &str, ports: &[u16]) -> Value {
    json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "vllm-pool", "namespace": "inference", "uid": "pool-uid", "generation": 1,
            "creationTimestamp": "2026-11-22T05:00:00Z"},
        "spec": {"selector": {"matchLabels": {"app": app}},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "appProtocol": "http",
            "endpointPickerRef": {"group": "", "kind": "Service", "name": "kvgate-epp", "port": {"number": 9002},
                "failureMode": "FailOpen"}},
        "status": {"parents": []}})
}

/// A ready pod labelled `app`.
fn app_pod(name: &str, ip: &str, app: &str, ready: bool) -> Value {
    let mut p = pod(name, Some(ip), "Running", ready, None, json!({}));
    p["metadata"]["labels"]["app"] = json!(app);
    p
}

#[tokio::test]
async fn an_inference_pools_pods_follow_the_pool_and_its_selector() {
    let api = ApiServer::start().await;
    api.put_in("inferencepools", pool("vllm-a", &[8000, 8001]), true);
    api.put(app_pod("a-1", "10.2.0.1", "vllm-a", true), true);
    api.put(app_pod("a-2", "10.2.0.3", "vllm-a", false), true);
    api.put(app_pod("b-1", "10.2.0.2", "vllm-b", true), true);

    let yaml = format!(
        "discovery:\n  inference_pool: {{namespace: inference, name: vllm-pool, kv_events_port: 5557, metrics_path: null, api_server: '{}'}}\n",
        api.url
    );
    let config = Config::parse(&yaml).unwrap();
    let scorer = Arc::new(Scorer::new(config.clone(), Tokenizer::fallback()));
    tokio::spawn(inference_pool::run(scorer.clone(), config.discovery.inference_pool.unwrap()));

    // Every target port of every ready pod the selector matches is an endpoint (two ranks).
    wait_pods(&scorer, &[("10.2.0.1:8000", "both"), ("10.2.0.1:8001", "both")]).await;
    assert_eq!(api.selectors("inferencepools")[0], "metadata.name=vllm-pool", "only the named pool is watched");
    assert!(api.selectors("pods").iter().all(|s| s == "app=vllm-a"), "{:?}", api.selectors("pods"));
    api.put(app_pod("a-2", "10.2.0.3", "vllm-a", true), false);
    wait_pods(
        &scorer,
        &[("10.2.0.1:8000", "both"), ("10.2.0.1:8001", "both"), ("10.2.0.3:8000", "both"), ("10.2.0.3:8001", "both")],
    )
    .await;

    // The pool changes: another selector, one port. Its pods are re-watched.
    api.put_in("inferencepools", pool("vllm-b", &[9000]), false);
    wait_pods(&scorer, &[("10.2.0.2:9000", "both")]).await;
    assert!(api.selectors("pods").iter().any(|s| s == "app=vllm-b"));
    api.delete("a-1", false); // no longer selected: nothing changes
    api.put(app_pod("b-2", "10.2.0.4", "vllm-b", true), false);
    wait_pods(&scorer, &[("10.2.0.2:9000", "both"), ("10.2.0.4:9000", "both")]).await;

    // The pool is deleted: no endpoints.
    api.delete_in("inferencepools", "vllm-pool", false);
    wait_pods(&scorer, &[]).await;
}

#[test]
fn a_pools_ranks_publish_on_offset_ports() {
    let config = Config::parse("discovery:\n  inference_pool: {namespace: inference, name: p, kv_events_port: 5557, kv_events_replay_port: 5567}\n")
        .unwrap();
    let c = config.discovery.inference_pool.unwrap();
    let spec = inference_pool::pool_spec(&pool("vllm-a", &[8000, 8001, 8002])).unwrap();
    assert_eq!((spec.selector.as_str(), spec.target_ports.as_slice()), ("app=vllm-a", &[8000, 8001, 8002][..]));
    let parse = |v: Value| serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(v).unwrap();
    let found = inference_pool::endpoints(&parse(app_pod("a", "10.2.0.9", "vllm-a", true)), &spec, &c);
    let described: Vec<String> = found
        .iter()
        .map(|(a, p)| {
            let e = &p.endpoints;
            format!("{a} {:?} {:?} {:?}", e.kv_events, e.kv_events_replay, e.metrics)
        })
        .collect();
    assert_eq!(
        described[1],
        r#"10.2.0.9:8001 Some("tcp://10.2.0.9:5558") Some("tcp://10.2.0.9:5568") Some("http://10.2.0.9:8001/metrics")"#
    );
    assert!(described[2].contains("\"tcp://10.2.0.9:5559\""), "{}", described[2]);
    assert!(inference_pool::endpoints(&parse(app_pod("a", "10.2.0.9", "vllm-a", false)), &spec, &c).is_empty());
    // A pool kvgate cannot use says why.
    let mut broken = pool("x", &[8000]);
    broken["spec"]["selector"]["matchLabels"] = json!({});
    assert!(inference_pool::pool_spec(&broken).unwrap_err().contains("matchLabels"));
    broken = pool("x", &[]);
    assert!(inference_pool::pool_spec(&broken).unwrap_err().contains("targetPorts"));
}

/// An InferenceObjective of `pool` (`priority` unset when `None`), as the llm-d router's CRD
/// (`inference.networking.x-k8s.io/v1alpha2`) shapes it.
fn objective(name: &str, pool: &str, priority: Option<i64>) -> Value {
    let mut spec = json!({"poolRef": {"name": pool}});
    if let Some(priority) = priority {
        spec["priority"] = json!(priority);
    }
    json!({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": "inference", "uid": format!("uid-{name}"), "generation": 1,
            "creationTimestamp": "2026-11-27T17:00:00Z"},
        "spec": spec})
}

#[tokio::test]
async fn the_pools_inference_objectives_set_priorities_as_they_change() {
    let api = ApiServer::start().await;
    api.put_in("inferenceobjectives", objective("critical", "vllm-pool", Some(10)), true);
    api.put_in("inferenceobjectives", objective("batch", "vllm-pool", Some(-1)), true);
    api.put_in("inferenceobjectives", objective("elsewhere", "another-pool", Some(50)), true);
    api.put_in("inferenceobjectives", objective("unset", "vllm-pool", None), true);
    let yaml = format!(
        "admission: {{max_waiting: 1, objectives: {{critical: 1, legacy: 3}}, default_priority: 2}}\n\
         discovery:\n  inference_pool: {{namespace: inference, name: vllm-pool, inference_objectives: true, api_server: '{}'}}\n",
        api.url
    );
    let config = Config::parse(&yaml).unwrap();
    let scorer = Arc::new(Scorer::new(config.clone(), Tokenizer::fallback()));
    tokio::spawn(inference_pool::run_objectives(scorer.clone(), config.discovery.inference_pool.unwrap()));
    let wait_priority = |objective: &'static str, want: i32| {
        let scorer = scorer.clone();
        async move {
            let start = Instant::now();
            while scorer.priority(Some(objective)) != want {
                assert!(start.elapsed() < Duration::from_secs(5), "{objective}: {}", scorer.priority(Some(objective)));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            start.elapsed()
        }
    };
    // The pool's objectives over the configuration's; unset is 0; another pool's are not ours.
    wait_priority("critical", 10).await;
    let unknown_before = scorer.metrics.objectives_unknown.get();
    let priorities: Vec<i32> =
        [Some("batch"), Some("unset"), Some("legacy"), None, Some("elsewhere")].map(|o| scorer.priority(o)).into();
    assert_eq!(priorities, [-1, 0, 3, 2, 2]);
    assert_eq!(scorer.metrics.objectives_unknown.get(), unknown_before + 1, "an unknown objective is counted");
    // Changed and deleted in the API server: applied within a second, without a restart.
    api.put_in("inferenceobjectives", objective("critical", "vllm-pool", Some(20)), false);
    assert!(wait_priority("critical", 20).await < Duration::from_secs(1));
    api.delete_in("inferenceobjectives", "batch", false);
    assert!(wait_priority("batch", 2).await < Duration::from_secs(1), "deleted: the default");
    api.put_in("inferenceobjectives", objective("elsewhere", "vllm-pool", Some(7)), false);
    assert!(wait_priority("elsewhere", 7).await < Duration::from_secs(1), "moved to this pool");
}

#[tokio::test]
async fn the_pools_objectives_order_admission_under_overload() {
    let api = ApiServer::start().await;
    api.put_in("inferenceobjectives", objective("critical", "vllm-pool", Some(10)), true);
    api.put_in("inferenceobjectives", objective("batch", "vllm-pool", Some(-1)), true);
    // One pod with room for one request: the next ones wait, by the pool's priorities.
    let yaml = format!(
        "admission: {{max_inflight_requests: 1, max_wait_ms: 10000}}\npods: [{{name: a, address: '10.0.0.1:8000'}}]\n\
         discovery:\n  inference_pool: {{namespace: inference, name: vllm-pool, inference_objectives: true, api_server: '{}'}}\n",
        api.url
    );
    let config = Config::parse(&yaml).unwrap();
    let scorer = Arc::new(Scorer::new(config.clone(), Tokenizer::fallback()));
    tokio::spawn(inference_pool::run_objectives(scorer.clone(), config.discovery.inference_pool.unwrap()));
    let start = Instant::now();
    while scorer.priority(Some("batch")) != -1 {
        assert!(start.elapsed() < Duration::from_secs(5), "the pool's objectives never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let prepared = scorer.prepare(Api::Completions, br#"{"prompt": "the same prompt", "max_tokens": 2}"#).unwrap();
    let ask = |id: &'static str, objective: Option<&'static str>| {
        let (scorer, prepared) = (scorer.clone(), prepared.clone());
        tokio::spawn(async move { scorer.decide_admitted(id, &prepared, &Limits::default(), objective).await })
    };
    let done = |id: &str| scorer.report(&LifecycleReport::new(id.to_string(), LifecycleEvent::Done));
    assert!(ask("first", None).await.unwrap().is_ok());
    // The pool's sheddable objective is shed at once; an ordinary request and then a critical
    // one wait, and the critical one gets the room first.
    assert!(matches!(ask("batch", Some("batch")).await.unwrap(), Err(PickError::Shed { .. })));
    let ordinary = ask("ordinary", None);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let critical = ask("critical", Some("critical"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!ordinary.is_finished() && !critical.is_finished(), "both wait for room");
    assert!(done("first"));
    assert!(critical.await.unwrap().is_ok());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!ordinary.is_finished(), "the ordinary request, though first to wait, waits on");
    assert!(done("critical"));
    assert!(ordinary.await.unwrap().is_ok());
}

/// An InferenceModelRewrite of `pool` created at `created`, with `rules` as its CRD shapes
/// them (`matches[].model.value`, `targets[].modelRewrite` and `weight`).
fn model_rewrite(name: &str, pool: &str, created: &str, rules: Value) -> Value {
    json!({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": "inference", "uid": format!("uid-{name}"), "generation": 1,
            "creationTimestamp": created},
        "spec": {"poolRef": {"name": pool}, "rules": rules}})
}

#[tokio::test]
async fn the_pools_model_rewrites_apply_as_they_change_oldest_first() {
    let api = ApiServer::start().await;
    let exact =
        |model: &str, to: &str| json!({"matches": [{"model": {"value": model}}], "targets": [{"modelRewrite": to}]});
    let newer = json!([exact("llama", "from-newer"), {"targets": [{"modelRewrite": "catch-all"}]}]);
    api.put_in("inferencemodelrewrites", model_rewrite("newer", "vllm-pool", "2026-11-27T18:00:00Z", newer), true);
    let older = json!([exact("llama", "from-older")]);
    api.put_in("inferencemodelrewrites", model_rewrite("older", "vllm-pool", "2026-11-27T17:00:00Z", older), true);
    let elsewhere = json!([exact("qwen", "not-ours")]);
    api.put_in(
        "inferencemodelrewrites",
        model_rewrite("elsewhere", "other-pool", "2026-11-27T16:00:00Z", elsewhere),
        true,
    );
    let broken = json!([{"matches": [{"model": {"value": "x"}}], "targets": [{"modelRewrite": "a", "weight": 1}, {"modelRewrite": "b"}]}]);
    api.put_in("inferencemodelrewrites", model_rewrite("broken", "vllm-pool", "2026-11-27T15:00:00Z", broken), true);
    let yaml = format!(
        "model_rewrites: [{{matches: [mistral], targets: [{{model: from-config}}]}}]\n\
         discovery:\n  inference_pool: {{namespace: inference, name: vllm-pool, inference_model_rewrites: true, api_server: '{}'}}\n",
        api.url
    );
    let config = Config::parse(&yaml).unwrap();
    let scorer = Arc::new(Scorer::new(config.clone(), Tokenizer::fallback()));
    tokio::spawn(inference_pool::run_model_rewrites(scorer.clone(), config.discovery.inference_pool.unwrap()));
    let target = |model: &str| {
        let body = format!(r#"{{"model": "{model}", "prompt": "hello there", "max_tokens": 2}}"#);
        scorer.prepare(Api::Completions, body.as_bytes()).unwrap().rewrite.map(|r| r.model)
    };
    let wait_for = |model: &'static str, want: Option<&'static str>| {
        let target = &target;
        async move {
            let start = Instant::now();
            while target(model).as_deref() != want {
                assert!(start.elapsed() < Duration::from_secs(5), "{model}: {:?}", target(model));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            start.elapsed()
        }
    };
    // The older object's rule wins a model both name; the pool's rules come before the
    // configuration's; another pool's are not ours; an unusable object is left out, counted.
    wait_for("llama", Some("from-older")).await;
    assert_eq!(target("qwen").as_deref(), Some("catch-all"));
    assert_eq!(target("mistral").as_deref(), Some("from-config"), "a rule naming it beats the pool's catch-all");
    assert_eq!(target("x").as_deref(), Some("catch-all"), "the broken object's rule is not in force");
    let errors = scorer.metrics.discovery_errors.with_label_values(&["inferencemodelrewrites:broken"]).get();
    assert!(errors >= 1);
    // Changed and deleted in the API server: applied within a second, without a restart.
    api.put_in(
        "inferencemodelrewrites",
        model_rewrite("older", "vllm-pool", "2026-11-27T17:00:00Z", json!([exact("llama", "v3")])),
        false,
    );
    assert!(wait_for("llama", Some("v3")).await < Duration::from_secs(1));
    api.delete_in("inferencemodelrewrites", "older", false);
    assert!(wait_for("llama", Some("from-newer")).await < Duration::from_secs(1), "deleted: the next one's");
    api.delete_in("inferencemodelrewrites", "newer", false);
    assert!(wait_for("qwen", None).await < Duration::from_secs(1), "no catch-all left");
    assert_eq!(target("mistral").as_deref(), Some("from-config"), "the configuration's rule remains");
}
