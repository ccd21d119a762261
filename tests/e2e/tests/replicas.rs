//! Active-active gateway replicas: three Envoy + scorer pairs in front of the same simulated
//! pods, sharing their bookings over a real `nats-server`. Each replica must see the
//! requests the others have in flight (and the prefixes they are computing) as its own;
//! with the bus gone they keep routing, and once it is back they agree again.

use kvgate_test_harness::{EnvoyProcess, NatsServer, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const MODEL: &str = "Qwen/Qwen3-8B";

struct Fleet {
    nats: NatsServer,
    _pods: Vec<Sim>,
    scorers: Vec<ScorerProcess>,
    envoys: Vec<EnvoyProcess>,
}

/// Three pods whose prefill is slow (1 ms per token: a 2,000-token prompt is in its prefill
/// for 2 s, before any KV event announces it), three replicas sharing bookings over NATS.
async fn fleet() -> Fleet {
    let nats = NatsServer::start().await;
    let tokenizer = qwen3_tokenizer();
    let mut pods = Vec::new();
    for i in 0..3 {
        let args = ["--tokenizer", tokenizer.to_str().unwrap(), "--model", MODEL, "--token-ms", "1"];
        pods.push(Sim::start(&format!("pod-{i}"), &args).await);
    }
    let mut scorers = Vec::new();
    for r in 0..3 {
        let mut config = format!(
            "tokenizer: {}\nhealth: {{scrape_interval_ms: 200}}\nsync: {{nats: '{}', replica_id: replica-{r}, \
             heartbeat_ms: 200, replica_timeout_ms: 1500, join_wait_ms: 1500}}\npods:\n",
            tokenizer.display(),
            nats.url
        );
        for p in &pods {
            config.push_str(&format!(
                "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', metrics: '{}/metrics'}}\n",
                p.pod_id, p.port, p.events, p.url
            ));
        }
        scorers.push(ScorerProcess::start(&config).await);
    }
    let mut envoys = Vec::new();
    for s in &scorers {
        envoys.push(EnvoyProcess::start(s, &["--picker", "wasm"]).await);
    }
    let fleet = Fleet { nats, _pods: pods, scorers, envoys };
    fleet.wait_all("every replica hears the other two", async |s| s.metric("kvgate_sync_replicas").await == 2.0).await;
    fleet
}

impl Fleet {
    /// Polls until `check` holds on every scorer (15 s at most).
    async fn wait_all(&self, what: &str, check: impl AsyncFn(&ScorerProcess) -> bool) {
        wait_until(what, async || {
            for s in &self.scorers {
                if !check(s).await {
                    return false;
                }
            }
            true
        })
        .await;
    }

    /// Polls until every scorer sees `total` requests in flight, spread alike; returns the
    /// common view.
    async fn wait_agree(&self, what: &str, total: u64) -> Vec<(String, u64)> {
        self.wait_all(what, async |s| inflight(s).await.iter().map(|(_, n)| n).sum::<u64>() == total).await;
        let views = futures::future::join_all(self.scorers.iter().map(inflight)).await;
        assert!(views.iter().all(|v| *v == views[0]), "{what}: the replicas disagree: {views:?}");
        views[0].clone()
    }
}

/// Polls `check` until it holds (15 s at most).
async fn wait_until(what: &str, check: impl AsyncFn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within 15 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Requests in flight per pod as one scorer sees them, by pod name.
async fn inflight(scorer: &ScorerProcess) -> Vec<(String, u64)> {
    let mut pods: Vec<(String, u64)> = scorer
        .pods()
        .await
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), p["inflight_requests"].as_u64().unwrap()))
        .collect();
    pods.sort();
    pods
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
}

/// Sends a request through `envoy` in the background: (status, serving pod).
fn spawn_request(envoy: &EnvoyProcess, body: Value) -> tokio::task::JoinHandle<(u16, String)> {
    let url = format!("{}/v1/completions", envoy.url);
    tokio::spawn(async move {
        let r = reqwest::Client::new().post(url).json(&body).send().await.expect("request through envoy");
        let pod = r.headers().get("x-kvgate-pod").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
        (r.status().as_u16(), pod)
    })
}

#[tokio::test]
async fn replicas_decide_on_the_fleets_requests_and_survive_the_bus_going_away() {
    let mut f = fleet().await;

    // A long prompt through replica 0: while its pod computes the prefill (3 s), the other
    // replicas see it in flight there, and its prefix as cached there.
    let document = text("replica sync: the harbour's tide tables", 300);
    let first = spawn_request(&f.envoys[0], completion(&format!("{document} Question 0?"), 8));
    let view = f.wait_agree("one request in flight, seen by all", 1).await;
    let home = view.iter().find(|(_, n)| *n == 1).unwrap().0.clone();
    // Replicas 1 and 2 weigh the next request of that prefix exactly as one another (and
    // as replica 0, whose booking they apply as their own). Each probe is cancelled, not
    // done: a probe done would leave its prompt taken as cached on its pod, and the light
    // fleet's waiver (`light_fleet_requests`) would weigh the second probe differently.
    let mut explained = Vec::new();
    for r in [1, 2] {
        let id = format!("probe-{r}");
        let body = completion(&format!("{document} Question 1?"), 8);
        let (status, answer) = f.scorers[r].route("/v1/completions", &id, &body, true).await;
        assert_eq!(status, 200, "{answer}");
        f.scorers[r].report_cancelled(&id).await;
        f.wait_agree("the probe released everywhere", 1).await;
        let on_home = answer["explain"].as_array().unwrap().iter().find(|c| c["pod"] == home.as_str()).unwrap().clone();
        assert!(
            on_home["cached_tokens"].as_u64().unwrap() > 2000,
            "the prefix being computed counts as cached: {answer}"
        );
        assert_eq!(on_home["inflight_requests"], 1);
        explained.push(answer["explain"].clone());
    }
    assert_eq!(explained[0], explained[1], "two replicas, one view");

    // A burst through all three gateways: every replica sees all of it, spread alike.
    let burst: Vec<_> =
        (0..6).map(|i| spawn_request(&f.envoys[i % 3], completion(&text(&format!("burst {i}"), 100), 8))).collect();
    f.wait_agree("the burst in flight, seen by all", 7).await;
    for answer in futures::future::join_all(burst).await {
        assert_eq!(answer.unwrap().0, 200);
    }
    assert_eq!(first.await.unwrap(), (200, home));
    f.wait_agree("all finished, on every replica", 0).await;

    // The bus goes away: every replica keeps routing, no client error.
    f.nats.kill();
    f.wait_all("the replicas notice", async |s| s.metric("kvgate_sync_connected").await == 0.0).await;
    let during: Vec<_> =
        (0..6).map(|i| spawn_request(&f.envoys[i % 3], completion(&format!("outage {i}"), 4))).collect();
    for answer in futures::future::join_all(during).await {
        assert_eq!(answer.unwrap().0, 200);
    }
    f.wait_all("each replica's own finished", async |s| inflight(s).await.iter().all(|(_, n)| *n == 0)).await;
    // A long request made on replica 0 while the bus is away…
    let unshared = spawn_request(&f.envoys[0], completion(&text("made during the outage", 600), 4));
    wait_until("replica 0 books it", async || inflight(&f.scorers[0]).await.iter().any(|(_, n)| *n == 1)).await;
    assert_eq!(inflight(&f.scorers[1]).await.iter().map(|(_, n)| n).sum::<u64>(), 0, "not shared while away");
    assert!(f.scorers[0].metric("kvgate_sync_updates_total{outcome=\"dropped_bus_down\"}").await > 0.0);

    // …is known to all once the bus is back (the replicas ask each other for snapshots).
    f.nats.restart().await;
    f.wait_all("reconnected", async |s| s.metric("kvgate_sync_connected").await == 1.0).await;
    f.wait_agree("the outage's booking, seen by all", 1).await;
    assert!(f.scorers[1].metric("kvgate_sync_snapshots_total{direction=\"applied\"}").await >= 1.0);
    assert_eq!(unshared.await.unwrap().0, 200);
    f.wait_agree("and its end", 0).await;
}
