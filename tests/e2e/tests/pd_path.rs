//! Prefill/decode disaggregation through a real Envoy: the scorer decides per request, the
//! filter sends the prefill leg itself (or names the prefill pod in a header), simulated
//! pods in prefill and decode roles do the NIXL-style hand-over.

use kvgate_e2e::collector::{Collector, ReceivedSpan};
use kvgate_test_harness::{EPP_PORT, EnvoyProcess, ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-8B";

struct Stack {
    prefill: Vec<Sim>,
    decode: Vec<Sim>,
    scorer: ScorerProcess,
    envoy: EnvoyProcess,
}

async fn stack(prefill: usize, decode: usize, envoy_flags: &[&str]) -> Stack {
    stack_with(prefill, decode, envoy_flags, "").await
}

/// [`stack`] with `extra` scorer configuration.
async fn stack_with(prefill: usize, decode: usize, envoy_flags: &[&str], extra: &str) -> Stack {
    let tokenizer = qwen3_tokenizer();
    let tok = tokenizer.to_str().unwrap();
    let mut config = format!(
        "tokenizer: {tok}\nhealth: {{scrape_interval_ms: 200, unhealthy_after: 2}}\npd: {{threshold_tokens: 256}}\nepp: {{listen: '127.0.0.1:{EPP_PORT}'}}\n{extra}pods:\n"
    );
    let mut pods = (Vec::new(), Vec::new());
    for (role, n) in [("prefill", prefill), ("decode", decode)] {
        for i in 0..n {
            let name = format!("{role}-{i}");
            let sim =
                Sim::start(&name, &["--tokenizer", tok, "--time-scale", "0.02", "--model", MODEL, "--role", role])
                    .await;
            config.push_str(&format!(
                "  - {{name: {name}, role: {role}, address: '127.0.0.1:{}', kv_events: '{}', metrics: '{}/metrics'}}\n",
                sim.port, sim.events, sim.url
            ));
            if role == "prefill" { pods.0.push(sim) } else { pods.1.push(sim) }
        }
    }
    let scorer = ScorerProcess::start(&config).await;
    let envoy = EnvoyProcess::start(&scorer, envoy_flags).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    Stack { prefill: pods.0, decode: pods.1, scorer, envoy }
}

/// Sends a completions request through Envoy with a given request id; returns the body.
async fn complete(envoy: &EnvoyProcess, id: &str, prompt: &str, stream: bool) -> (u16, String) {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 20, "stream": stream,
                      "stream_options": {"include_usage": true}});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", envoy.url))
        .header("x-request-id", id)
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The records of request `id` on the given pods: (pod id, record).
async fn records(pods: &[Sim], id: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for p in pods {
        for r in p.requests().await {
            if r["request_id"] == id {
                out.push((p.pod_id.clone(), r));
            }
        }
    }
    out
}

async fn metric(scorer: &ScorerProcess, line: &str) -> bool {
    let text = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    text.lines().any(|l| l == line)
}

#[tokio::test]
async fn long_prompts_are_disaggregated_short_ones_go_direct() {
    let collector = Collector::start().await;
    let s = stack_with(2, 2, &[], &format!("traces: {{otlp_endpoint: '{}'}}\n", collector.endpoint)).await;
    let (status, body) = complete(&s.envoy, "long-1", &text("A long document about tides", 600), true).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.trim_end().ends_with("data: [DONE]") && body.contains(r#""completion_tokens":20"#),
        "full streamed answer"
    );

    // The prefill pod saw a 1-token, non-streaming request asking for a remote decode.
    let legs = records(&s.prefill, "long-1").await;
    assert_eq!(legs.len(), 1, "{legs:?}");
    let (prefill_pod, leg) = &legs[0];
    assert_eq!(
        (leg["kv_transfer"].as_str(), leg["max_tokens"].as_u64(), leg["stream"].as_bool()),
        (Some("remote_decode"), Some(1), Some(false))
    );
    // The decode pod received the prefill's kv_transfer_params and skipped the prefill.
    let decoded = records(&s.decode, "long-1").await;
    assert_eq!(decoded.len(), 1);
    let (decode_pod, rec) = &decoded[0];
    assert_eq!(rec["kv_transfer"], "remote_prefill");
    assert_eq!(rec["kv_transfer_params"]["remote_engine_id"], format!("{prefill_pod}-engine"));
    assert_eq!(rec["completion_tokens"], 20);
    let decoder = s.decode.iter().find(|d| &d.pod_id == decode_pod).unwrap();
    assert_eq!(decoder.metric("kvgate_sim:prefill_tokens_computed_total").await, 1.0, "only the last prompt token");

    // A short prompt goes straight to a decode pod.
    let (status, _) = complete(&s.envoy, "short-1", "Hi there", false).await;
    assert_eq!(status, 200);
    assert!(records(&s.prefill, "short-1").await.is_empty());
    assert_eq!(records(&s.decode, "short-1").await[0].1["kv_transfer"], "local");
    assert!(metric(&s.scorer, "kvgate_decisions_by_path_total{path=\"pd\"} 1").await);
    // The scorer explains its choice: both pods, and why (uncached tokens vs threshold).
    let body = json!({"model": MODEL, "prompt": text("Explain the tides once more", 600), "max_tokens": 2});
    let (status, d) = s.scorer.route("/v1/completions", "explained", &body, true).await;
    assert_eq!(status, 200);
    assert_eq!((d["path"].as_str(), d["threshold_tokens"].as_u64()), (Some("pd"), Some(256)));
    assert!(d["uncached_tokens"].as_u64().unwrap() >= 256 && d["prefill"].is_string() && d["prefill_pod"].is_string());
    // (That decision was not served: release its bookings as the filter would.)
    let done = json!({"reports": [{"request_id": "explained", "event": "done"}]});
    let r = reqwest::Client::new().post(format!("{}/v1/lifecycle", s.scorer.url)).json(&done).send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["accepted"], 1);
    assert!(metric(&s.scorer, "kvgate_decisions_by_path_total{path=\"direct\"} 1").await);
    s.scorer.wait_idle(Duration::from_secs(5)).await;
    assert_eq!(s.envoy.stat("wasmcustom.kvgate_pd_prefill_ok").await, 1);
    // Traced under the gateway's span: a disaggregated decision names its prefill pod, its
    // response the prefill leg's end; a short one goes direct. (Sent without an id of the client's: Envoy decides to
    // trace by the UUID it makes.)
    for (prompt, stream) in [(text("Yet another long document", 600), true), ("Hi again".to_string(), false)] {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream});
        let r =
            reqwest::Client::new().post(format!("{}/v1/completions", s.envoy.url)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap();
    }
    let traced = |spans: &[ReceivedSpan], path: &str| {
        let through_envoy = |s: &&ReceivedSpan| s.name == "kvgate.pick" && !s.parent_span_id.is_empty();
        let pick = spans.iter().filter(through_envoy).find(|s| s.attribute("kvgate.path") == path)?;
        let response = spans.iter().find(|s| s.name == "kvgate.response" && s.trace_id == pick.trace_id)?;
        spans.iter().find(|s| s.span_id == pick.parent_span_id && s.service == "kvgate-gateway")?;
        Some((pick.clone(), response.clone()))
    };
    let spans = collector
        .wait(Duration::from_secs(20), |spans| traced(spans, "pd").is_some() && traced(spans, "direct").is_some())
        .await;
    let (pd, response) = traced(&spans, "pd").unwrap_or_else(|| panic!("no disaggregated decision traced: {spans:#?}"));
    assert!(s.prefill.iter().any(|p| pd.attribute("kvgate.prefill_pod") == p.pod_id.as_str()), "{pd:?}");
    assert!(response.events.contains(&"prefill_done".to_string()), "{response:?}");
    let (direct, _) = traced(&spans, "direct").unwrap();
    assert!(direct.attribute("kvgate.prefill_pod").is_null());
}

#[tokio::test]
async fn a_prefix_cached_on_a_prefill_pod_attracts_later_long_requests() {
    let s = stack(2, 2, &[]).await;
    let prefix = text("Shared contract clauses", 500);
    let mut homes = Vec::new();
    for i in 0..4 {
        let id = format!("contract-{i}");
        // Each request adds a long unique part, so it is still worth disaggregating even
        // once a decode pod has the shared prefix (well-cached prompts would go direct).
        let prompt = format!("{prefix} {}", text(&format!("Annex {i} of the contract"), 150));
        let (status, _) = complete(&s.envoy, &id, &prompt, false).await;
        assert_eq!(status, 200);
        s.scorer.wait_idle(Duration::from_secs(5)).await;
        let legs = records(&s.prefill, &id).await;
        assert_eq!(legs.len(), 1);
        homes.push(legs[0].0.clone());
        if i > 0 {
            assert!(
                legs[0].1["cached_tokens"].as_u64().unwrap() > 1000,
                "the prefix was cached there: {:?}",
                legs[0].1
            );
        }
    }
    assert!(homes.iter().all(|h| h == &homes[0]), "{homes:?}");
}

#[tokio::test]
async fn one_prefill_three_decode_and_a_dead_prefill_pod_degrades_to_direct() {
    let mut s = stack(1, 3, &["--scorer-timeout-ms", "500"]).await;
    let mut decoders = Vec::new();
    for i in 0..3 {
        let id = format!("doc-{i}");
        let (status, _) = complete(&s.envoy, &id, &text(&format!("Distinct document {i}"), 500), true).await;
        assert_eq!(status, 200);
        assert_eq!(records(&s.prefill, &id).await.len(), 1, "the only prefill pod");
        let decoder = records(&s.decode, &id).await[0].0.clone();
        // Once the scorer has indexed what that pod now holds, the next new document (an
        // equal miss everywhere, on idle pods) goes to an emptier cache.
        s.scorer.wait_pod(&decoder, Duration::from_secs(5), |p| p["cached_blocks"].as_u64() > Some(0)).await;
        decoders.push(decoder);
    }
    decoders.sort();
    decoders.dedup();
    assert_eq!(decoders.len(), 3, "new documents spread over the empty caches: {decoders:?}");

    // The prefill pod dies: no client error — first the filter's prefill leg fails and the
    // decode pod prefills locally, then the scorer sees the pod unhealthy and goes direct.
    s.prefill[0].kill();
    for i in 0..6 {
        let (status, body) =
            complete(&s.envoy, &format!("after-{i}"), &text(&format!("Another document {i}"), 500), i % 2 == 0).await;
        assert_eq!(status, 200, "{body}");
        let rec = &records(&s.decode, &format!("after-{i}")).await[0].1;
        assert_eq!(rec["kv_transfer"], "local");
        assert_eq!(rec["completion_tokens"], 20);
    }
    s.scorer.wait_pod("prefill-0", Duration::from_secs(10), |p| p["healthy"] == false).await;
    // Once the pod is known down, a long prompt is sent straight to a decode pod.
    let direct = "kvgate_decisions_by_path_total{path=\"direct\"}";
    let before = s.scorer.metric(direct).await;
    let (status, _) = complete(&s.envoy, "direct-now", &text("Final document", 500), false).await;
    assert_eq!(status, 200);
    assert_eq!(s.scorer.metric(direct).await, before + 1.0);
}

#[tokio::test]
async fn header_mode_names_the_prefill_pod_for_the_decode_sidecar() {
    let s = stack(1, 1, &["--pd-mode", "header"]).await;
    let (status, _) = complete(&s.envoy, "hdr-1", &text("A long prompt for header mode", 500), false).await;
    assert_eq!(status, 200);
    assert!(records(&s.prefill, "hdr-1").await.is_empty(), "no prefill leg from Envoy");
    let rec = &records(&s.decode, "hdr-1").await[0].1;
    assert_eq!(rec["prefiller"], format!("127.0.0.1:{}", s.prefill[0].port));
    assert_eq!(s.envoy.stat("wasmcustom.kvgate_pd_header").await, 1);
    s.scorer.wait_idle(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn the_endpoint_picker_names_the_prefill_pod_for_the_decode_sidecar() {
    let s = stack(1, 2, &["--picker", "epp"]).await;
    let (status, body) = complete(&s.envoy, "epp-pd-1", &text("A long prompt for the picker", 500), true).await;
    assert_eq!(status, 200, "{body}");
    assert!(records(&s.prefill, "epp-pd-1").await.is_empty(), "Envoy sends no prefill leg");
    let decoded = records(&s.decode, "epp-pd-1").await;
    assert_eq!(decoded.len(), 1);
    assert_eq!(decoded[0].1["prefiller"], format!("127.0.0.1:{}", s.prefill[0].port), "llm-d's header");
    let (status, _) = complete(&s.envoy, "epp-pd-2", "A short one", false).await;
    assert_eq!(status, 200);
    let short = records(&s.decode, "epp-pd-2").await;
    assert!(short[0].1["prefiller"].is_null(), "short prompts go direct: {short:?}");
    assert!(metric(&s.scorer, "kvgate_decisions_by_path_total{path=\"pd\"} 1").await);
    s.scorer.wait_idle(Duration::from_secs(5)).await;
}
