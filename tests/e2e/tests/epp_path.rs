//! What only the Endpoint Picker path has, through a real Envoy (ext_proc over gRPC, TLS with
//! the picker's self-signed certificate) in front of simulated pods: every body mode a gateway
//! may use, the gateway's subset hint, and a destination no client can choose. The tests
//! shared with the wasm path (retries onto the pick's fallbacks among them) are in
//! `envoy_path.rs`.

use kvgate_test_harness::{EPP_PORT, EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-8B";

/// `n` pods and a scorer serving the Endpoint Picker; `extra` is more configuration,
/// `extra_pods` more entries of its `pods:` list.
async fn pods_and_picker(n: usize, extra: &str, extra_pods: &str) -> (Vec<Sim>, ScorerProcess) {
    let tokenizer = qwen3_tokenizer();
    let mut pods = Vec::new();
    let mut config = format!(
        "tokenizer: {}\nhealth: {{scrape_interval_ms: 200, unhealthy_after: 2}}\nepp: {{listen: '127.0.0.1:{EPP_PORT}'}}\n{extra}pods:\n",
        tokenizer.display()
    );
    for i in 0..n {
        let args = ["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.02", "--model", MODEL];
        let sim = Sim::start(&format!("pod-{i}"), &args).await;
        config.push_str(&format!(
            "  - {{name: pod-{i}, address: '127.0.0.1:{}', kv_events: '{}', metrics: '{}/metrics'}}\n",
            sim.port, sim.events, sim.url
        ));
        pods.push(sim);
    }
    config.push_str(extra_pods);
    let scorer = ScorerProcess::start(&config).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // event subscriptions settle
    (pods, scorer)
}

async fn post(
    envoy: &EnvoyProcess,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new().post(format!("{}{path}", envoy.url)).json(body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let r = request.send().await.expect("request through envoy");
    let pod = r.headers().get("x-kvgate-pod").map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), pod, r.text().await.unwrap())
}

fn usage(body: &str) -> Value {
    let line = body.lines().rev().find(|l| l.contains("\"usage\"")).unwrap_or(body);
    serde_json::from_str::<Value>(line.trim_start_matches("data: ")).expect("usage JSON")["usage"].clone()
}

/// The sum of a Prometheus metric's samples on the scorer.
async fn scorer_metric(scorer: &ScorerProcess, name: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{' | b' ')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn every_body_mode_relays_bodies_and_streams_unchanged() {
    let rewrites = format!("model_rewrites: [{{matches: [alias], targets: [{{model: {MODEL}}}]}}]\n");
    let (pods, scorer) = pods_and_picker(2, &rewrites, "").await;
    // A prompt of ≈ 150 kB: full duplex hands it back in chunks of at most 62,000 bytes.
    let long = text("Clause of a very long contract", 4_600);
    assert!(long.len() > 2 * 62_000, "{}", long.len());
    let expected_tokens = pods[0].tokenize(&long).await.len() as u64;
    for mode in ["buffered", "full-duplex", "streamed"] {
        let envoy = EnvoyProcess::start(&scorer, &["--picker", "epp", "--epp-body-mode", mode]).await;
        let (status, _, body) =
            post(&envoy, "/v1/completions", &json!({"model": MODEL, "prompt": long, "max_tokens": 2}), &[]).await;
        assert_eq!(status, 200, "{mode}: {body}");
        assert_eq!(usage(&body)["prompt_tokens"], expected_tokens, "{mode}: the pod got the body unchanged");
        // The same body naming a model a rule rewrites: the pod (which answers 404 to any
        // other name) gets it, in as many chunks, under the served model's name.
        let (status, _, body) =
            post(&envoy, "/v1/completions", &json!({"model": "alias", "prompt": long, "max_tokens": 2}), &[]).await;
        assert_eq!(status, 200, "{mode}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (answer["model"].as_str(), &answer["usage"]["prompt_tokens"]),
            (Some(MODEL), &json!(expected_tokens))
        );

        // A system prompt shared by a conversation's turns: streamed back, then cached where it went.
        let system = text(&format!("Instructions for the {mode} assistant"), 300);
        let mut served = Vec::new();
        for turn in 0..3 {
            let chat = json!({"model": MODEL, "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true},
                              "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("turn {turn}")}]});
            let (status, pod, body) = post(&envoy, "/v1/chat/completions", &chat, &[]).await;
            assert_eq!(status, 200, "{mode}: {body}");
            assert!(body.trim_end().ends_with("data: [DONE]"), "{mode}: streamed to the end");
            if turn > 0 {
                assert!(
                    usage(&body)["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 500,
                    "{mode}: {body}"
                );
            }
            served.push(pod.expect("x-kvgate-pod"));
            scorer.wait_idle(Duration::from_secs(5)).await;
        }
        assert!(served.iter().all(|p| *p == served[0]), "{mode}: {served:?}");
        // Not routed (no body, another path): passed through.
        let models = reqwest::get(format!("{}/v1/models", envoy.url)).await.unwrap();
        assert_eq!(models.status(), 200, "{mode}");
    }
    // Every request's response was read by the picker: nothing left booked, nothing unknown.
    scorer.wait_idle(Duration::from_secs(5)).await;
    assert_eq!(scorer_metric(&scorer, "kvgate_lifecycle_unknown_total").await, 0.0);
    assert_eq!(scorer_metric(&scorer, "kvgate_lifecycle_reports_total{event=\"done\"}").await, 15.0);
    assert_eq!(scorer_metric(&scorer, "kvgate_model_rewrites_total").await, 3.0);
}

#[tokio::test]
async fn the_gateways_subset_hint_limits_the_choice() {
    let (pods, scorer) = pods_and_picker(2, "", "").await;
    let system = text("A prefix first served by whichever pod", 300);
    let chat = |q: &str| json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]});
    let plain = EnvoyProcess::start(&scorer, &["--picker", "epp"]).await;
    let (_, home, _) = post(&plain, "/v1/chat/completions", &chat("warm"), &[]).await;
    let home = home.unwrap();
    scorer.wait_idle(Duration::from_secs(5)).await;
    let other = pods.iter().find(|p| p.pod_id != home).unwrap();

    // A gateway filter names the subset in envoy.lb.subset_hint, as GIE gateways may.
    let hinted = |endpoints: String| {
        move |bootstrap: String| {
            let filter = format!(
                "          - name: envoy.filters.http.set_metadata\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n              metadata:\n              - metadata_namespace: envoy.lb.subset_hint\n                value:\n                  x-gateway-destination-endpoint-subset: [{endpoints}]\n"
            );
            let at = bootstrap.find("          - name: envoy.filters.http.ext_proc").expect("the picker's filter");
            format!("{}{filter}{}", &bootstrap[..at], &bootstrap[at..])
        }
    };
    let limited = EnvoyProcess::start_patched(
        &scorer.config_path,
        &["--picker", "epp"],
        hinted(format!("'127.0.0.1:{}'", other.port)),
    )
    .await;
    for i in 0..4 {
        let (status, pod, body) = post(&limited, "/v1/chat/completions", &chat(&format!("q{i}")), &[]).await;
        assert_eq!(
            (status, pod.as_deref()),
            (200, Some(other.pod_id.as_str())),
            "only the subset, cache or not: {body}"
        );
        scorer.wait_idle(Duration::from_secs(5)).await;
    }
    let nowhere =
        EnvoyProcess::start_patched(&scorer.config_path, &["--picker", "epp"], hinted("'10.9.9.9:1'".into())).await;
    let (status, pod, body) = post(&nowhere, "/v1/chat/completions", &chat("none"), &[]).await;
    assert_eq!((status, pod), (503, None), "{body}");
    let err: Value = serde_json::from_str(&body).expect("a JSON error");
    assert_eq!(err["error"]["type"], "ServiceUnavailable");
}

#[tokio::test]
async fn no_client_chooses_the_destination_even_with_the_picker_down() {
    let (pods, mut scorer) = pods_and_picker(2, "", "").await;
    let envoy = EnvoyProcess::start(&scorer, &["--picker", "epp", "--failure-mode", "open"]).await;
    let target = format!("127.0.0.1:{}", pods[0].port);
    let spoof = [("x-gateway-destination-endpoint", target.as_str())];
    let mut served: BTreeMap<String, u32> = BTreeMap::new();
    scorer.kill();
    for i in 0..8 {
        let body = json!({"model": MODEL, "prompt": format!("spoofed {i}"), "max_tokens": 1});
        let (status, pod, body) = post(&envoy, "/v1/completions", &body, &spoof).await;
        assert_eq!(status, 200, "fail-open: {body}");
        *served.entry(pod.unwrap()).or_default() += 1;
    }
    // Envoy's round robin, not the client's header, chose: both pods served.
    assert_eq!(served.len(), 2, "{served:?}");
    assert!(served.values().all(|&n| n >= 2), "{served:?}");
}
