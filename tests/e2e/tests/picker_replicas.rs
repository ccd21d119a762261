//! Two picker replicas sharing their bookings over NATS behind a real Envoy in Istio's shape
//! (full duplex, fail-open, kvgate's picker settings), which spreads the exchanges over both:
//! they route as one picker would (affinity, spread, one view of what is in flight); under
//! closed-loop load a rolling restart of each replica in turn fails no request, a `kill -9`
//! fails at most the exchanges open on the killed replica and none that started a second
//! after it, NATS going away fails nothing and the replicas share again when it is back.
//! `make picker-failover` runs the failover in both gateway shapes, longer.

use kvgate_e2e::failover::{self, Fleet, Load, Settings, Shape};
use kvgate_test_harness::{ScorerProcess, text};
use serde_json::json;
use std::time::{Duration, Instant};

/// One test at a time: a replica restarts on its own ports, which a process of another test
/// starting meanwhile could take.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn quiet() {
    if std::env::var_os("KVGATE_SHOW_CHILDREN").is_none() {
        kvgate_test_harness::quiet_children();
    }
}

/// Requests in flight per pod, as `picker` sees them.
async fn inflight(picker: &ScorerProcess) -> Vec<(String, u64)> {
    let mut pods: Vec<(String, u64)> = (picker.pods().await.iter())
        .map(|p| (p["name"].as_str().unwrap().to_string(), p["inflight_requests"].as_u64().unwrap()))
        .collect();
    pods.sort();
    pods
}

/// Sends a completion through the gateway: (status, the pod that served).
async fn complete(url: &str, prompt: &str, max_tokens: u32) -> (u16, String) {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens});
    let r = reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
    let pod = r.headers().get("x-kvgate-pod").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    (status, pod)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_synced_pickers_route_as_one() {
    let _alone = ONE_AT_A_TIME.lock().await;
    quiet();
    let fleet = Fleet::start(Shape::Istio, Settings::Shipped, 2, 4).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    for p in &fleet.pickers {
        while p.metric("kvgate_sync_replicas").await != 1.0 {
            assert!(Instant::now() < deadline, "the pickers never heard each other");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Affinity: one document's questions, one after another, asked of either picker (the
    // gateway alternates), all go where the document is cached.
    let document = text("two pickers, one fleet: the ferry timetable", 300);
    let mut served = Vec::new();
    for q in 0..6 {
        let (status, pod) = complete(&fleet.envoy.url, &format!("{document} Question {q}?"), 4).await;
        assert_eq!(status, 200);
        served.push(pod);
    }
    assert!(served.iter().all(|p| *p == served[0] && !p.is_empty()), "one home for the document: {served:?}");
    let mut decided = Vec::new();
    for p in &fleet.pickers {
        decided.push(p.metric("kvgate_decisions_total").await);
    }
    let mut hosts = Vec::new();
    for p in &fleet.pickers {
        hosts.push(fleet.picker_host(p.epp_port.unwrap()).await);
    }
    assert!(decided.iter().all(|d| *d > 0.0), "both pickers decided: {decided:?}; the gateway's view: {hosts:?}");

    // Spread: a burst of unrelated long generations over both pickers spreads over the pods
    // as one picker would spread it, and both see all of it in flight, alike.
    let url = fleet.envoy.url.clone();
    let burst: Vec<_> = (0..8)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { complete(&url, &text(&format!("burst {i}"), 80), 400).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    let views = loop {
        let views = [inflight(&fleet.pickers[0]).await, inflight(&fleet.pickers[1]).await];
        let total = |v: &[(String, u64)]| v.iter().map(|(_, n)| n).sum::<u64>();
        if total(&views[0]) == 8 && views[0] == views[1] {
            break views;
        }
        assert!(Instant::now() < deadline, "the pickers never agreed on the burst: {views:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(views[0].iter().all(|(_, n)| *n <= 3), "spread over the pods: {views:?}");
    for answer in futures::future::join_all(burst).await {
        assert_eq!(answer.unwrap().0, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_fails_nothing_and_a_kill_only_what_was_open_on_the_replica() {
    let _alone = ONE_AT_A_TIME.lock().await;
    quiet();
    let mut fleet = Fleet::start(Shape::Istio, Settings::Shipped, 2, 2).await;
    let load = Load::start(&fleet.envoy.url, 4);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let restart = failover::rolling_restart(&mut fleet).await;
    // Past the restart's window (a second after the last replica is back).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kill = failover::kill(&mut fleet, 1, Duration::from_secs(3)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outage = failover::bus_outage(&mut fleet, Duration::from_secs(2)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let records = load.stop().await;
    let bus = failover::cost(&records, &outage);
    assert!(bus.requests > 50 && bus.failed == 0, "the pickers route on without NATS: {bus:?}");
    let (restarted, killed) = (failover::cost(&records, &restart), failover::cost(&records, &kill));
    assert!(restarted.requests > 50 && killed.requests > 50, "load ran through both: {restarted:?} {killed:?}");
    assert_eq!(restarted.failed, 0, "a rolling restart fails nothing: {restarted:?}");
    let outside = failover::failed_outside(&records, &[&restart, &kill, &outage]);
    assert!(outside.is_empty(), "nothing fails outside the events: {outside:?}");
    let open = kill.open_on_victim.unwrap();
    assert!(killed.failed as u64 <= open, "only exchanges open on the dead replica ({open}) fail: {killed:?}");
    assert_eq!(killed.failed_1_to_3 + killed.failed_after_3, 0, "none from 1 s after the kill: {killed:?}");
    assert!(kill.settled.is_some_and(|d| d < Duration::from_secs(1)), "the gateway drops it fast: {kill:?}");
    // The replicas share their bookings: the survivor applied the other's, and the one
    // restarted last hears it again.
    let applied = fleet.pickers[0].metric("kvgate_sync_updates_total{outcome=\"applied\"}").await;
    assert!(applied > 0.0, "picker 0 applied picker 1's bookings");
    assert_eq!(fleet.pickers[1].metric("kvgate_sync_replicas").await, 1.0, "the restarted replica rejoined");
}
