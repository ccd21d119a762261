//! A router nobody here wrote — `vllm-router --policy kv_aware` from PyPI — consumes the
//! simulated pods' KV events and tokenizes through their `/tokenize`, and routes requests to
//! the pod that cached their prefix. The prefixes are cached by sending them to the pods
//! directly, so the router can only know where they are from the pods' event streams.

use kvgate_test_harness::{Sim, free_port, qwen3_tokenizer, text, vllm_router_command, wait_child_ready};
use serde_json::json;
use std::process::{Child, Stdio};
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-8B";

struct Router(Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn vllm_router_kv_aware_follows_the_simulated_events() {
    let tokenizer = qwen3_tokenizer();
    let tok = tokenizer.to_str().unwrap();
    let mut pods = Vec::new();
    for name in ["pod-1", "pod-2", "pod-3"] {
        pods.push(Sim::start(name, &["--tokenizer", tok, "--time-scale", "0.01", "--model", MODEL]).await);
    }

    let port = free_port();
    let mut cmd = vllm_router_command(port, MODEL, &pods);
    let mut router = Router(cmd.stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("start vllm-router"));
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    if let Err(e) = wait_child_ready(&mut router.0, &format!("{base}/health"), Duration::from_secs(60)).await {
        panic!("vllm-router did not come up: {e}");
    }
    // Let its SUB sockets connect and subscribe before the events we rely on are sent.
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Cache a distinct ~700-token prefix on each pod, bypassing the router.
    let prefixes: Vec<String> = ["orchid", "granite", "harbor"].iter().map(|w| text(w, 250)).collect();
    for (pod, prefix) in pods.iter().zip(&prefixes) {
        pod.post_json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": format!("{prefix} warm-up"), "max_tokens": 1}),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut routed = vec![vec![]; pods.len()];
    for round in 0..4 {
        for (i, prefix) in prefixes.iter().enumerate() {
            let body = json!({"model": MODEL, "prompt": format!("{prefix} question {round}"), "max_tokens": 2});
            let r = client.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let pod = r.headers()["x-kvgate-pod"].to_str().unwrap().to_string();
            let usage: serde_json::Value = r.json().await.unwrap();
            routed[i].push((pod, usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()));
        }
    }
    for (i, decisions) in routed.iter().enumerate() {
        for (pod, cached) in decisions {
            assert_eq!(pod, &pods[i].pod_id, "prefix {i} routed to {pod}: {routed:?}");
            assert!(*cached >= 640, "served from the cache: {cached}");
        }
    }
}
