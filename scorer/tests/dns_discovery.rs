//! DNS discovery: pods are the addresses a name resolves to. Against the real resolver with a
//! name that resolves here (`localhost`), end to end through Envoy, whose pods cluster
//! resolves the same name; and the add / remove / come-back logic with a scripted resolver.

use kvgate_route_api::Api;
use kvgate_routing::pod_set::PodId;
use kvgate_scorer::config::{Config, DnsDiscovery, Role};
use kvgate_scorer::discovery::dns::DnsPods;
use kvgate_scorer::scorer::{Limits, Scorer};
use kvgate_test_harness::{EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use kvgate_tokenize::Tokenizer;
use serde_json::json;
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test]
async fn pods_behind_a_name_are_found_indexed_and_routed_to_through_envoy() {
    let tok = qwen3_tokenizer();
    let pod = Sim::start("behind-localhost", &["--tokenizer", tok.to_str().unwrap()]).await;
    let events_port: u16 = pod.events.rsplit(':').next().unwrap().parse().unwrap();
    let config = format!(
        "tokenizer: {}\nhealth: {{scrape_interval_ms: 100, scrape_timeout_ms: 200, unhealthy_after: 2}}\n\
         discovery:\n  dns:\n    - {{name: localhost, port: {}, kv_events_port: {events_port}, interval_seconds: 0.2}}\n",
        tok.display(),
        pod.port
    );
    let scorer = ScorerProcess::start(&config).await;
    let name = format!("127.0.0.1:{}", pod.port);
    scorer.wait_pod(&name, Duration::from_secs(10), |p| p["healthy"] == true && p["index"] == "precise").await;

    // Its KV events are followed: a prefix cached on it directly shows up in the index.
    let prompt = text("discovered", 200);
    pod.post_json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1})).await;
    scorer.wait_pod(&name, Duration::from_secs(10), |p| p["cached_blocks"].as_u64() > Some(0)).await;

    // Envoy's pods cluster resolves the same name (STRICT_DNS): the scorer's answer is one of
    // its hosts, so the request lands on the discovered pod, cache hit included.
    let envoy = EnvoyProcess::start(&scorer, &[]).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", envoy.url))
        .json(&json!({"prompt": format!("{prompt} and more"), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvgate-pod"], "behind-localhost");
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 192, "{body}");
    assert_eq!(envoy.stat("wasmcustom.kvgate_routed").await, 1);
}

fn dns(port: u16) -> DnsDiscovery {
    DnsDiscovery {
        name: "vllm.test".into(),
        port,
        kv_events_port: None,
        kv_events_replay_port: None,
        metrics_path: None,
        role: Role::Both,
        interval_seconds: 1.0,
    }
}

#[tokio::test]
async fn pods_that_disappear_are_forgotten_and_come_back_with_their_id() {
    let config = Config::parse("discovery:\n  dns: [{name: vllm.test, port: 8000}]\n").unwrap();
    let scorer = Arc::new(Scorer::new(config, Tokenizer::fallback()));
    let mut pods = DnsPods::new(dns(8000));
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let set = |ips: &[&str]| ips.iter().map(|s| ip(s)).collect::<BTreeSet<_>>();
    let route = |id: &str| {
        let body = serde_json::to_vec(&json!({"prompt": "hello there", "max_tokens": 4})).unwrap();
        let prepared = scorer.prepare(Api::Completions, &body).unwrap();
        scorer.decide(id, &prepared, &Limits::default()).map(|pick| pick.decode.address.clone())
    };

    assert!(route("none").is_err(), "no pod before discovery found one");
    pods.update(&scorer, &set(&["10.0.0.1", "10.0.0.2"]));
    assert_eq!(pods.present(), vec![PodId(0), PodId(1)]);
    let names: Vec<String> = scorer.pods_view().into_iter().map(|p| p.name).collect();
    assert_eq!(names, ["10.0.0.1:8000", "10.0.0.2:8000"]);
    let first = route("r1").unwrap();
    assert!(first.starts_with("10.0.0."));

    // 10.0.0.1 disappears: never answered again, and gone from /v1/pods.
    pods.update(&scorer, &set(&["10.0.0.2"]));
    assert_eq!(pods.present(), vec![PodId(1)]);
    for i in 0..10 {
        assert_eq!(route(&format!("r{i}")).unwrap(), "10.0.0.2:8000");
    }
    assert_eq!(scorer.pods_view().len(), 1);

    // It comes back with the same id; a new address gets a new one; [::1] is written bracketed.
    pods.update(&scorer, &set(&["10.0.0.1", "10.0.0.2", "::1"]));
    assert_eq!(pods.present(), vec![PodId(0), PodId(1), PodId(2)]);
    assert_eq!(scorer.pod(PodId(2)).address, "[::1]:8000");
    let seen: BTreeSet<String> = (0..60).map(|i| route(&format!("b{i}")).unwrap()).collect();
    assert!(seen.contains("10.0.0.1:8000"), "the returning pod is chosen again: {seen:?}");

    // An empty answer empties the fleet (no ready pods behind the Service).
    pods.update(&scorer, &BTreeSet::new());
    assert!(pods.present().is_empty() && scorer.readiness().is_err());
}
