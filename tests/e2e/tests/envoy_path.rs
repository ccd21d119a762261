//! The whole path in a real Envoy, over real sockets on loopback: simulated vLLM pods, the
//! scorer, and Envoy asking it for every request's pod — through the kvgate wasm filter
//! (`Path::Wasm`), the same filter as a native dynamic module (`Path::Native`), or the
//! scorer's Endpoint Picker over ext_proc (`Path::Epp`, in the bootstrap's default body
//! mode). Every test runs on every path (`wasm::…`, `native::…` and `epp::…`).

use kvgate_e2e::collector::Collector;
use kvgate_e2e::path::Path;
use kvgate_test_harness::{
    EnvoyProcess, ScorerProcess, Sim, envoy_validate, filter_native, filter_wasm, llama3_tokenizer, qwen3_tokenizer,
    root, text,
};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const MODEL: &str = "Qwen/Qwen3-8B";

/// The machine, shared by this file's tests; a test that compares latencies takes it alone
/// (its figures would otherwise measure the other tests running beside it).
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Runs each listed test (an `async fn(Path)`) on `path`, in module `module`: those under
/// `shared` beside each other, those under `alone` with the machine to themselves.
macro_rules! on_path {
    ($module:ident, $path:ident, shared: [$($name:ident),* $(,)?], alone: [$($alone:ident),* $(,)?] $(,)?) => {
        mod $module {
            $(#[tokio::test] async fn $name() {
                let _machine = super::MACHINE.read().await;
                super::$name(super::Path::$path).await
            })*
            $(#[tokio::test] async fn $alone() {
                let _machine = super::MACHINE.write().await;
                super::$alone(super::Path::$path).await
            })*
        }
    };
}

/// Runs each listed test on every path.
macro_rules! on_every_path {
    ($($tests:tt)*) => {
        on_path!(wasm, Wasm, $($tests)*);
        on_path!(native, Native, $($tests)*);
        on_path!(epp, Epp, $($tests)*);
    };
}

on_every_path!(
    shared: [
        shared_prefixes_converge_and_different_prefixes_spread,
        scorer_down_fail_open_keeps_serving_then_routing_resumes,
        scorer_down_fail_closed_answers_503_then_recovers,
        bad_input_and_destination_spoofing_are_handled,
        hostile_requests_get_clean_answers,
        a_pod_killed_mid_stream_fails_cleanly_and_is_avoided,
        a_scorer_slower_than_the_timeout_is_treated_as_down,
        a_connection_the_scorer_never_answers_on_is_replaced,
        a_scorer_answering_garbage_is_treated_as_down,
        a_pod_killed_costs_no_request_that_had_not_started,
        a_pick_that_refuses_connections_is_retried_on_its_fallback_and_the_booking_follows,
        an_adapters_requests_follow_the_pod_holding_it_and_spread_when_it_is_full,
        messages_and_responses_route_with_prefix_affinity_and_malformed_ones_get_400,
        a_model_no_pod_serves_is_answered_404_in_the_apis_shape,
        each_request_is_one_trace_with_the_decision_under_the_gateways_span,
        sampled_at_one_percent_about_one_percent_of_requests_are_traced_whole,
        a_scorer_without_traces_exports_nothing_though_the_gateway_traces,
        two_models_go_each_to_its_pods_tokenized_by_its_own_tokenizer,
        a_rewrite_splits_conversations_by_weight_and_every_turn_follows_its_target,
    ],
    alone: [a_burst_beyond_capacity_waits_by_priority_and_sheds_the_sheddable],
);

struct Stack {
    path: Path,
    pods: Vec<Sim>,
    scorer: ScorerProcess,
    envoy: EnvoyProcess,
}

impl Stack {
    /// Requests routed by kvgate (the filter's count, or the picker's decisions).
    async fn routed(&self) -> u64 {
        match self.path {
            Path::Wasm => self.envoy.stat("wasmcustom.kvgate_routed").await,
            Path::Native => self.envoy.stat("kvgate.routed").await,
            Path::Epp => scorer_metric(&self.scorer, "kvgate_decisions_total").await,
        }
    }

    /// Requests Envoy let through without a decision (fail-open).
    async fn failed_open(&self) -> u64 {
        self.path.failed_open(&self.envoy).await
    }
}

/// The sum of a Prometheus metric's samples (all label sets) on the scorer.
async fn scorer_metric(scorer: &ScorerProcess, name: &str) -> u64 {
    scorer.metric(name).await as u64
}

async fn stack(path: Path, n: usize, envoy_flags: &[&str]) -> Stack {
    stack_at(path, n, envoy_flags, "0.02", "", &[]).await
}

/// `n` pods at `time_scale` (wall seconds per simulated second) started with `pod_args`, a
/// scorer (with `extra` configuration) and Envoy.
async fn stack_at(
    path: Path,
    n: usize,
    envoy_flags: &[&str],
    time_scale: &str,
    extra: &str,
    pod_args: &[&str],
) -> Stack {
    let tokenizer = qwen3_tokenizer();
    let mut pods = Vec::new();
    for i in 0..n {
        let mut args = vec!["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", time_scale, "--model", MODEL];
        args.extend_from_slice(pod_args);
        pods.push(Sim::start(&format!("pod-{i}"), &args).await);
    }
    stack_of(path, pods, envoy_flags, extra).await
}

/// A scorer (the Qwen3 tokenizer by default, with `extra` configuration) and Envoy in front
/// of `pods`.
async fn stack_of(path: Path, pods: Vec<Sim>, envoy_flags: &[&str], extra: &str) -> Stack {
    let tokenizer = qwen3_tokenizer();
    let mut config = format!(
        "tokenizer: {}\nhealth: {{scrape_interval_ms: 200, unhealthy_after: 2}}\n{}{extra}pods:\n",
        tokenizer.display(),
        path.scorer_config(envoy_flags)
    );
    for p in &pods {
        config.push_str(&format!(
            "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', metrics: '{}/metrics'}}\n",
            p.pod_id, p.port, p.events, p.url
        ));
    }
    let scorer = ScorerProcess::start(&config).await;
    let envoy = EnvoyProcess::start(&scorer, &path.envoy_flags(envoy_flags)).await;
    // Let the scorer's event subscriptions settle before relying on them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Stack { path, pods, scorer, envoy }
}

struct Answer {
    status: u16,
    pod: Option<String>,
    body: String,
}

async fn send(envoy: &EnvoyProcess, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let mut req = reqwest::Client::new().post(format!("{}{path}", envoy.url)).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.expect("request through envoy");
    let status = r.status().as_u16();
    let pod = r.headers().get("x-kvgate-pod").map(|v| v.to_str().unwrap().to_string());
    Answer { status, pod, body: r.text().await.unwrap() }
}

fn chat(system: &str, question: &str, stream: bool) -> Value {
    json!({"model": MODEL, "max_tokens": 4, "stream": stream, "stream_options": {"include_usage": true},
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
}

fn cached_tokens(answer: &Answer) -> u64 {
    let usage_line = answer.body.lines().rev().find(|l| l.contains("\"usage\"")).unwrap_or(&answer.body);
    let json: Value = serde_json::from_str(usage_line.trim_start_matches("data: ")).expect("usage JSON");
    json["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

async fn shared_prefixes_converge_and_different_prefixes_spread(path: Path) {
    let s = stack(path, 3, &[]).await;
    let opened_before = s.envoy.stat("wasmcustom.kvgate_route_stream_opened").await;
    let mut homes = Vec::new();
    for (k, topic) in ["harbor logistics", "tax law", "orbital mechanics"].iter().enumerate() {
        let system = text(&format!("You are an expert in {topic}"), 220);
        let mut served = Vec::new();
        for i in 0..4 {
            let stream = (i + k) % 2 == 0;
            let a = send(&s.envoy, "/v1/chat/completions", &chat(&system, &format!("question {i}"), stream), &[]).await;
            assert_eq!(a.status, 200, "{}", a.body);
            if stream {
                assert!(a.body.trim_end().ends_with("data: [DONE]"), "streamed through Envoy");
            }
            if i > 0 {
                assert!(cached_tokens(&a) > 600, "served from the prefix cache: {}", a.body);
            }
            served.push(a.pod.expect("x-kvgate-pod"));
            // Sequential users: each request has finished (and been reported) before the next.
            s.scorer.wait_idle(Duration::from_secs(5)).await;
        }
        assert!(served.iter().all(|p| p == &served[0]), "{topic}: {served:?}");
        homes.push(served[0].clone());
    }
    homes.sort();
    homes.dedup();
    assert!(homes.len() >= 2, "different prefixes spread across pods: {homes:?}");
    // Lifecycle reports reached the scorer: nothing is left in flight, all were routed.
    for p in s.scorer.pods().await {
        assert_eq!(p["inflight_requests"], 0);
    }
    assert_eq!(s.routed().await, 12);
    assert_eq!(s.failed_open().await, 0);
    match path {
        Path::Wasm => {
            assert!(s.envoy.stat("wasmcustom.kvgate_lifecycle_reports_sent").await >= 24, "first_token + done each");
            // The 12 decisions travelled on the worker's route stream, opened once and kept.
            assert!(scorer_metric(&s.scorer, "kvgate_route_streams").await >= 1, "a route stream is open");
            assert!(s.envoy.stat("wasmcustom.kvgate_route_stream_opened").await >= 1);
            assert_eq!(s.envoy.stat("wasmcustom.kvgate_route_stream_opened").await, opened_before, "never reopened");
        }
        // One route socket, kept; a first token and a done for every request, on it.
        Path::Native => {
            let bootstrap = std::fs::read_to_string(&s.envoy.config_path).unwrap();
            assert!(bootstrap.contains("\"scorer_address\":\"unix:"), "the module on the scorer's Unix socket");
            assert_eq!(scorer_metric(&s.scorer, "kvgate_route_streams").await, 1, "one route socket is open");
            assert_eq!(scorer_metric(&s.scorer, "kvgate_lifecycle_reports_total").await, 24);
        }
        // The picker reads the responses itself: a first token and a done for every request.
        Path::Epp => {
            assert_eq!(scorer_metric(&s.scorer, "kvgate_lifecycle_reports_total").await, 24);
            assert_eq!(scorer_metric(&s.scorer, "kvgate_lifecycle_unknown_total").await, 0);
        }
    }
}

async fn scorer_down_fail_open_keeps_serving_then_routing_resumes(path: Path) {
    let mut s = stack(path, 2, &["--failure-mode", "open", "--scorer-timeout-ms", "200"]).await;
    let system = text("Shared instructions for the evaluation harness", 150);
    let warm = send(&s.envoy, "/v1/chat/completions", &chat(&system, "warm", false), &[]).await;
    assert_eq!(warm.status, 200);
    // Traffic in flight from two clients while the scorer dies: no client sees an error.
    let clients: Vec<_> = (0..2)
        .map(|c| {
            let (url, system) = (s.envoy.url.clone(), system.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for i in 0..15 {
                    let body = chat(&system, &format!("client {c} request {i}"), i % 2 == 0);
                    let r = reqwest::Client::new().post(format!("{url}/v1/chat/completions")).json(&body).send().await;
                    statuses.push(match r {
                        Ok(r) => (r.status().as_u16(), r.text().await.is_ok()),
                        Err(_) => (0, false),
                    });
                }
                statuses
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(60)).await;
    s.scorer.kill();
    for client in clients {
        for (status, complete) in client.await.unwrap() {
            assert_eq!((status, complete), (200, true), "fail-open: Envoy balances without the scorer");
        }
    }
    for i in 0..10 {
        let a = send(&s.envoy, "/v1/chat/completions", &chat(&system, &format!("while down {i}"), false), &[]).await;
        assert_eq!(a.status, 200, "fail-open: Envoy balances without the scorer: {}", a.body);
    }
    assert!(s.failed_open().await >= 10);
    s.scorer.restart().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    // The restarted scorer learns the caches again from new events; routing is KV-aware.
    loop {
        send(&s.envoy, "/v1/chat/completions", &chat(&system, "refill", false), &[]).await;
        s.scorer.wait_idle(Duration::from_secs(5)).await;
        let a = send(&s.envoy, "/v1/chat/completions", &chat(&system, "after restart", false), &[]).await;
        s.scorer.wait_idle(Duration::from_secs(5)).await;
        if a.status == 200 && cached_tokens(&a) > 400 {
            break;
        }
        assert!(Instant::now() < deadline, "routing did not become KV-aware again");
    }
    assert!(s.routed().await >= 2);
}

async fn scorer_down_fail_closed_answers_503_then_recovers(path: Path) {
    let mut s = stack(path, 1, &["--failure-mode", "closed"]).await;
    let body = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2});
    assert_eq!(send(&s.envoy, "/v1/completions", &body, &[]).await.status, 200);
    s.scorer.kill();
    let a = send(&s.envoy, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 503);
    assert!(a.pod.is_none(), "no pod saw it");
    if path != Path::Epp {
        // The filter answers itself, in the OpenAI error shape (Envoy's ext_proc failure is
        // its own local reply, status only).
        let err: Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(err["error"]["type"], "ServiceUnavailable");
        let stat = if path == Path::Wasm { "wasmcustom.kvgate_fail_closed" } else { "kvgate.fail_closed" };
        assert_eq!(s.envoy.stat(stat).await, 1);
    }
    s.scorer.restart().await;
    // The filter's route stream reconnects after a backoff: recovery within seconds, not at
    // once on a loaded machine.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let status = send(&s.envoy, "/v1/completions", &body, &[]).await.status;
        if status == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no recovery within 10 s (last status {status})");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// An Anthropic Messages request (`/v1/messages`) with a system prompt and one question.
fn anthropic_message(system: &str, question: &str, stream: bool) -> Value {
    json!({"model": MODEL, "max_tokens": 4, "stream": stream, "system": [{"type": "text", "text": system}],
           "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]})
}

/// An OpenAI Responses request (`/v1/responses`) with instructions and one question.
fn openai_response(instructions: &str, question: &str, stream: bool) -> Value {
    json!({"model": MODEL, "max_output_tokens": 4, "stream": stream, "instructions": instructions,
           "input": [{"role": "user", "content": [{"type": "input_text", "text": question}]}]})
}

/// The cached prompt tokens an answer of either API reports (a stream's, in its last event
/// with usage: `message_delta`, `response.completed`).
fn cached_prompt_tokens(answer: &Answer) -> u64 {
    let usage_line = answer.body.lines().rev().find(|l| l.contains("\"usage\"")).unwrap_or(&answer.body);
    let json: Value = serde_json::from_str(usage_line.trim_start_matches("data: ")).expect("usage JSON");
    let usage = if json["response"].is_object() { &json["response"]["usage"] } else { &json["usage"] };
    let cached = usage["cache_read_input_tokens"].as_u64().or(usage["input_tokens_details"]["cached_tokens"].as_u64());
    cached.unwrap_or_else(|| panic!("no cached tokens in {usage}"))
}

async fn a_model_no_pod_serves_is_answered_404_in_the_apis_shape(path: Path) {
    let s = stack(path, 2, &[]).await;
    for p in &s.pods {
        let listed = s.scorer.wait_pod(&p.pod_id, Duration::from_secs(10), |v| !v["models"].is_null()).await;
        assert_eq!(listed["models"], json!([MODEL]), "learned from the pod's /v1/models");
    }
    let question = chat("You answer in one word", "which model are you?", false);
    let mut unknown = question.clone();
    unknown["model"] = json!("no-such-model");
    let a = send(&s.envoy, "/v1/chat/completions", &unknown, &[]).await;
    assert_eq!(a.status, 404, "{}", a.body);
    let error: Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(error["error"]["type"], "NotFoundError", "{}", a.body);
    assert!(error["error"]["message"].as_str().unwrap().contains("`no-such-model`"), "names the model: {}", a.body);
    let mut message = anthropic_message("You answer in one word", "which model?", false);
    message["model"] = json!("no-such-model");
    let a = send(&s.envoy, "/v1/messages", &message, &[]).await;
    assert_eq!(a.status, 404, "{}", a.body);
    let error: Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!((&error["type"], &error["error"]["type"]), (&json!("error"), &json!("not_found_error")), "{}", a.body);
    // Never sent to a pod; the model the pods serve is routed as ever.
    for p in &s.pods {
        assert!(p.requests().await.is_empty(), "{} saw a request for a model it does not serve", p.pod_id);
    }
    assert_eq!(send(&s.envoy, "/v1/chat/completions", &question, &[]).await.status, 200);
    assert_eq!(s.failed_open().await, 0);
}

async fn messages_and_responses_route_with_prefix_affinity_and_malformed_ones_get_400(path: Path) {
    let s = stack(path, 3, &[]).await;
    let mut homes = Vec::new();
    for topic in ["harbor logistics", "tax law", "orbital mechanics"] {
        let system = text(&format!("You answer questions on {topic}"), 220);
        let mut served = Vec::new();
        // The two APIs in turn, streamed and not: one conversation prefix, one pod.
        for i in 0..4 {
            let (api, body) = match i {
                0 => ("/v1/messages", anthropic_message(&system, "question 0", false)),
                1 => ("/v1/responses", openai_response(&system, "question 1", true)),
                2 => ("/v1/messages", anthropic_message(&system, "question 2", true)),
                _ => ("/v1/responses", openai_response(&system, "question 3", false)),
            };
            let a = send(&s.envoy, api, &body, &[]).await;
            assert_eq!(a.status, 200, "{api}: {}", a.body);
            match i {
                1 => assert!(a.body.contains("event: response.completed"), "{}", a.body),
                2 => assert!(a.body.contains("event: message_stop"), "{}", a.body),
                _ => {}
            }
            if i > 0 {
                assert!(
                    cached_prompt_tokens(&a) > 600,
                    "{api} served from the prefix cache on {:?} after {served:?}: {}",
                    a.pod,
                    a.body
                );
            }
            served.push(a.pod.expect("x-kvgate-pod"));
            s.scorer.wait_idle(Duration::from_secs(5)).await;
        }
        assert!(served.iter().all(|p| p == &served[0]), "{topic}: {served:?}");
        // The same conversation on the chat API renders the same prompt: same pod, cached.
        let same = send(&s.envoy, "/v1/chat/completions", &chat(&system, "question 9", false), &[]).await;
        assert_eq!(same.pod.as_ref(), Some(&served[0]), "one index for every API");
        assert!(cached_tokens(&same) > 600, "{}", same.body);
        s.scorer.wait_idle(Duration::from_secs(5)).await;
        homes.push(served[0].clone());
    }
    homes.sort();
    homes.dedup();
    assert!(homes.len() >= 2, "different prefixes spread across pods: {homes:?}");
    assert_eq!(s.routed().await, 15);
    // Every request ended (reported done) before the next was sent.
    for p in s.scorer.pods().await {
        assert_eq!(p["inflight_requests"], 0);
    }

    // What vLLM would refuse is refused before any pod sees it, with the reason.
    let one = json!([{"role": "user", "content": "x"}]);
    for (api, body, reason) in [
        ("/v1/messages", json!({"model": MODEL, "messages": one}), "max_tokens"),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}),
            "invalid request",
        ),
        ("/v1/messages", json!({"model": MODEL, "max_tokens": 0, "messages": one}), "must be positive"),
        ("/v1/responses", json!({"model": MODEL, "instructions": "no input"}), "input"),
        (
            "/v1/responses",
            json!({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}),
            "Unsupported input item",
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
    ] {
        let a = send(&s.envoy, api, &body, &[]).await;
        assert_eq!(a.status, 400, "{body}: {}", a.body);
        let err: Value = serde_json::from_str(&a.body).expect("a JSON error body");
        assert!(err["error"]["message"].as_str().unwrap().contains(reason), "{body}: {err}");
        // Each API's own error shape: Anthropic's SDKs dispatch on `error.type`.
        let kind = if api == "/v1/messages" { "invalid_request_error" } else { "BadRequestError" };
        assert_eq!(err["error"]["type"], kind, "{api}: {err}");
        assert_eq!(err["type"].as_str(), (api == "/v1/messages").then_some("error"), "{api}: {err}");
        assert_eq!(a.pod, None, "no pod saw it");
    }
    for api in ["/v1/messages", "/v1/responses"] {
        let r = reqwest::Client::new().post(format!("{}{api}", s.envoy.url)).body("{\"model\": ").send().await.unwrap();
        assert_eq!(r.status(), 400);
    }
    let served: usize = futures::future::join_all(s.pods.iter().map(|p| p.requests())).await.iter().map(Vec::len).sum();
    assert_eq!(served, 15, "the pods served the good requests only");
}

async fn bad_input_and_destination_spoofing_are_handled(path: Path) {
    let s = stack(path, 2, &["--body-limit-bytes", "65536"]).await;
    let client = reqwest::Client::new();
    // Malformed JSON: 400 from the scorer, which parses every body once (the filter only
    // refuses what does not even open an object).
    let r = client.post(format!("{}/v1/completions", s.envoy.url)).body("{\"prompt\": ").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("not valid JSON"));
    // A body the scorer cannot use: its 400 and message reach the client.
    let a = send(&s.envoy, "/v1/completions", &json!({"max_tokens": 3}), &[]).await;
    assert_eq!(a.status, 400);
    assert!(a.body.contains("'prompt' is required"), "{}", a.body);
    assert_eq!(scorer_metric(&s.scorer, "kvgate_route_errors_total").await, 2, "the scorer answered both");
    // Not even an object: refused by the filter or the picker before any parse.
    let r = client.post(format!("{}/v1/completions", s.envoy.url)).body("[1, 2]").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("must be a JSON object"), "{err}");
    // Over the body limit: 413 from Envoy.
    let huge = json!({"prompt": "x".repeat(100_000)});
    assert_eq!(send(&s.envoy, "/v1/completions", &huge, &[]).await.status, 413);

    // A client naming the destination is ignored: the scorer's choice stands.
    let system = text("Pinned instructions for spoofing checks", 150);
    let first = send(&s.envoy, "/v1/chat/completions", &chat(&system, "one", false), &[]).await;
    let home = first.pod.unwrap();
    s.scorer.wait_idle(Duration::from_secs(5)).await;
    let other = s.pods.iter().find(|p| p.pod_id != home).unwrap();
    for target in [format!("127.0.0.1:{}", other.port), "127.0.0.1:1".to_string(), "169.254.169.254:80".to_string()] {
        let a = send(
            &s.envoy,
            "/v1/chat/completions",
            &chat(&system, "two", false),
            &[("x-gateway-destination-endpoint", target.as_str())],
        )
        .await;
        assert_eq!((a.status, a.pod.as_deref()), (200, Some(home.as_str())), "header {target} ignored");
        s.scorer.wait_idle(Duration::from_secs(5)).await;
    }
    // Other traffic passes untouched (and the header is stripped there too).
    let r = client
        .get(format!("{}/v1/models", s.envoy.url))
        .header("x-gateway-destination-endpoint", "127.0.0.1:1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[test]
fn every_envoy_config_validates_and_the_local_one_matches_its_scorer_config() {
    let dir = root().join("envoy");
    let mut checked = 0;
    for entry in walk(&dir) {
        if entry.extension().is_some_and(|e| e == "yaml") && entry.file_name().is_some_and(|n| n == "envoy.yaml") {
            envoy_validate(&entry).unwrap_or_else(|e| panic!("{}: {e}", entry.display()));
            checked += 1;
        }
    }
    assert!(checked >= 1);
    // The committed local bootstrap is exactly what its scorer configuration renders.
    let config = kvgate_scorer::config::Config::parse(&std::fs::read_to_string(dir.join("local/scorer.yaml")).unwrap())
        .expect("local scorer config");
    let rendered = kvgate_scorer::envoy::render(
        &config,
        &kvgate_scorer::envoy::EnvoyOptions {
            listen: "127.0.0.1:10000".parse().unwrap(),
            admin: "127.0.0.1:9901".parse().unwrap(),
            wasm: "target/wasm32-wasip1/release/kvgate_filter.wasm".into(),
            native_module: "target/release/libkvgate_filter_native.so".into(),
            failure_mode: "open".into(),
            scorer_timeout_ms: 100,
            pd_mode: "envoy".into(),
            body_limit_bytes: 8 << 20,
            picker: kvgate_scorer::envoy::Picker::Wasm,
            epp_body_mode: kvgate_scorer::envoy::EppBodyMode::Streamed,
            retries: 2,
        },
    )
    .unwrap();
    assert_eq!(
        rendered,
        std::fs::read_to_string(dir.join("local/envoy.yaml")).unwrap(),
        "re-render envoy/local/envoy.yaml"
    );
    // The template renders to a valid bootstrap for any pod list (here with fail-closed).
    let config = kvgate_scorer::config::Config::parse(
        "pods:\n  - {name: a, address: '10.1.2.3:8000', role: prefill}\n  - {name: b, address: '[::1]:8000'}\n",
    )
    .unwrap();
    let options = kvgate_scorer::envoy::EnvoyOptions {
        listen: "0.0.0.0:8080".parse().unwrap(),
        admin: "127.0.0.1:9902".parse().unwrap(),
        wasm: filter_wasm(),
        native_module: filter_native(),
        failure_mode: "closed".into(),
        scorer_timeout_ms: 25,
        pd_mode: "header".into(),
        body_limit_bytes: 1 << 20,
        picker: kvgate_scorer::envoy::Picker::Wasm,
        epp_body_mode: kvgate_scorer::envoy::EppBodyMode::Streamed,
        retries: 2,
    };
    // Each picker's bootstrap passes `envoy --mode validate` (the native one loading the module).
    let path = std::env::temp_dir().join(format!("kvgate-validate-{}.yaml", std::process::id()));
    for picker in
        [kvgate_scorer::envoy::Picker::Wasm, kvgate_scorer::envoy::Picker::None, kvgate_scorer::envoy::Picker::Native]
    {
        let rendered =
            kvgate_scorer::envoy::render(&config, &kvgate_scorer::envoy::EnvoyOptions { picker, ..options.clone() })
                .unwrap();
        if picker == kvgate_scorer::envoy::Picker::Native {
            assert!(rendered.contains("DynamicModuleFilter") && rendered.contains("\"scorer_address\":\"127.0.0.1:"));
        }
        std::fs::write(&path, rendered).unwrap();
        let result = envoy_validate(&path);
        let _ = std::fs::remove_file(&path);
        result.unwrap_or_else(|e| panic!("the {picker:?} bootstrap does not validate: {e}"));
    }
}

#[tokio::test]
async fn the_native_module_keeps_a_route_socket_per_envoy_worker() {
    let _machine = MACHINE.read().await;
    let s = stack(Path::Native, 2, &[]).await;
    let envoy = EnvoyProcess::start_with_workers(&s.scorer, &Path::Native.envoy_flags(&[]), 2).await;
    // 24 requests at once, on as many connections, spread by Envoy over its workers.
    let sent: Vec<_> = (0..24)
        .map(|i| {
            let url = envoy.url.clone();
            tokio::spawn(async move {
                let body = json!({"model": MODEL, "prompt": format!("worker question {i}"), "max_tokens": 2});
                reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await.unwrap().status()
            })
        })
        .collect();
    for answer in sent {
        assert_eq!(answer.await.unwrap(), 200);
    }
    assert_eq!(envoy.stat("kvgate.routed").await, 24, "every request decided by the scorer");
    // The stack's own Envoy (one worker) holds one socket; this one, one per worker.
    assert_eq!(scorer_metric(&s.scorer, "kvgate_route_streams").await, 3);
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// A JSON completions body of exactly `len` bytes.
fn body_of_len(len: usize) -> Vec<u8> {
    let head = br#"{"max_tokens": 1, "prompt": ""#;
    let tail = br#""}"#;
    let mut body = head.to_vec();
    body.extend(std::iter::repeat_n(b'a', len - head.len() - tail.len()));
    body.extend_from_slice(tail);
    body
}

async fn hostile_requests_get_clean_answers(path: Path) {
    let s = stack(path, 1, &["--body-limit-bytes", "65536"]).await;
    let client = reqwest::Client::new();
    let deep = format!("{{\"prompt\": {}1{}}}", "[".repeat(20_000), "]".repeat(20_000));
    let cases: Vec<(&str, &str, Vec<u8>, u16)> = vec![
        ("non-JSON", "/v1/completions", b"hello world".to_vec(), 400),
        ("JSON array", "/v1/chat/completions", b"[1, 2, 3]".to_vec(), 400),
        ("deeply nested JSON", "/v1/completions", deep.into_bytes(), 400),
        ("invalid UTF-8", "/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), 400),
        ("wrong type", "/v1/completions", br#"{"prompt": 5}"#.to_vec(), 400),
        ("wrong nested type", "/v1/chat/completions", br#"{"messages": [{"role": 1, "content": "x"}]}"#.to_vec(), 400),
        ("empty messages", "/v1/chat/completions", br#"{"messages": []}"#.to_vec(), 400),
        ("empty prompt", "/v1/completions", br#"{"prompt": ""}"#.to_vec(), 400),
        ("empty body", "/v1/completions", Vec::new(), 400),
        ("unknown path", "/v1/embeddings", br#"{"input": "x"}"#.to_vec(), 404),
        ("huge string", "/v1/completions", body_of_len(60_000), 200),
        ("body at the limit", "/v1/completions", body_of_len(65_536), 200),
        ("body one byte over the limit", "/v1/completions", body_of_len(65_537), 413),
    ];
    for (name, path, body, status) in cases {
        let r = client.post(format!("{}{path}", s.envoy.url)).body(body).send().await.unwrap();
        let got = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        assert_eq!(got, status, "{name}: {text}");
        if status == 400 {
            let err: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {text}"));
            assert!(err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{name}: {err}");
        }
    }
    // Nothing trapped the filter or broke the picker: Envoy still routes normally.
    let ok = send(&s.envoy, "/v1/completions", &json!({"prompt": "still fine", "max_tokens": 1}), &[]).await;
    assert_eq!(ok.status, 200);
    assert_eq!(s.routed().await, 3, "the huge string, the body at the limit, and this");
}

/// A completion for LoRA adapter `model`: a prompt of its own (no prefix shared with any other).
fn for_adapter(model: &str, seed: &str, words: usize, max_tokens: u32) -> Value {
    json!({"model": model, "prompt": text(seed, words), "max_tokens": max_tokens})
}

async fn an_adapters_requests_follow_the_pod_holding_it_and_spread_when_it_is_full(path: Path) {
    // Pods holding one adapter at a time, 50 ms to load one (vLLM's --max-loras 1).
    let lora = ["--lora-module", "sql", "--lora-module", "law", "--max-loras", "1", "--lora-load-ms", "50"];
    let s = stack_at(path, 3, &[], "0.5", "lora_adapters: [sql, law]\n", &lora).await;
    for p in &s.pods {
        s.scorer.wait_pod(&p.pod_id, Duration::from_secs(10), |p| p["adapters"]["max_lora"] == 1).await;
    }
    // One after another, each with its own prompt (no prefix to follow): sql stays where it
    // is loaded.
    let mut served = Vec::new();
    for i in 0..4 {
        let a = send(&s.envoy, "/v1/completions", &for_adapter("sql", &format!("sql {i}"), 60, 4), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        served.push(a.pod.expect("x-kvgate-pod"));
        s.scorer.wait_idle(Duration::from_secs(10)).await;
    }
    assert!(served.iter().all(|p| p == &served[0]), "sql follows the pod holding it: {served:?}");
    let home = served[0].clone();

    // While a long sql request holds home's only slot, sql joins it there and law, which
    // would wait for the slot, goes elsewhere.
    let envoy_url = s.envoy.url.clone();
    let long = tokio::spawn(async move {
        let body = for_adapter("sql", "a long sql answer", 60, 600);
        reqwest::Client::new().post(format!("{envoy_url}/v1/completions")).json(&body).send().await.unwrap()
    });
    s.scorer.wait_pod(&home, Duration::from_secs(10), |p| p["inflight_requests"] == 1).await;
    let joins = send(&s.envoy, "/v1/completions", &for_adapter("sql", "sql beside it", 60, 4), &[]).await;
    assert_eq!(joins.pod.as_deref(), Some(home.as_str()), "{}", joins.body);
    let law = send(&s.envoy, "/v1/completions", &for_adapter("law", "a law question", 60, 4), &[]).await;
    assert_eq!(law.status, 200, "{}", law.body);
    assert_ne!(law.pod.as_deref(), Some(home.as_str()), "law is not queued behind sql's slot");

    // A crowd of long sql prompts at once: home takes the first, then the queue there
    // outweighs loading sql on a free pod.
    let crowd = (0..8).map(|i| {
        let envoy_url = s.envoy.url.clone();
        tokio::spawn(async move {
            let body = for_adapter("sql", &format!("long sql prompt {i}"), 1500, 4);
            let r =
                reqwest::Client::new().post(format!("{envoy_url}/v1/completions")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.headers()["x-kvgate-pod"].to_str().unwrap().to_string()
        })
    });
    let mut spread: Vec<String> = futures::future::join_all(crowd).await.into_iter().map(Result::unwrap).collect();
    assert!(spread.contains(&home), "{spread:?}");
    spread.sort();
    spread.dedup();
    assert!(spread.len() >= 2, "sql spreads once the pod holding it is full: {spread:?}");
    assert_eq!(long.await.unwrap().status(), 200);
    assert_eq!(s.failed_open().await, 0);
}

async fn a_pod_killed_mid_stream_fails_cleanly_and_is_avoided(path: Path) {
    let mut s = stack_at(path, 2, &[], "1", "", &[]).await;
    // A long generation in real time (≈ 6 ms per token): plenty of time to kill its pod.
    let body = json!({"model": MODEL, "prompt": text("A long story", 50), "max_tokens": 2000, "stream": true});
    let response =
        reqwest::Client::new().post(format!("{}/v1/completions", s.envoy.url)).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let victim = response.headers()["x-kvgate-pod"].to_str().unwrap().to_string();
    let mut stream = futures::StreamExt::boxed(response.bytes_stream());
    assert!(futures::StreamExt::next(&mut stream).await.is_some(), "streaming started");
    assert_eq!(s.scorer.pod(&victim).await["inflight_requests"], 1);
    s.pods.iter_mut().find(|p| p.pod_id == victim).unwrap().kill();
    // The client sees the stream end with an error, not a hang and not a fake success.
    let mut failed = false;
    let mut text = String::new();
    while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
        match chunk {
            Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(failed || !text.contains("[DONE]"), "a killed pod cannot have finished the stream");
    // Its booking is released (cancelled), it is marked unhealthy, and it is not chosen.
    s.scorer.wait_pod(&victim, Duration::from_secs(10), |p| p["inflight_requests"] == 0 && p["healthy"] == false).await;
    for i in 0..5 {
        let a = send(&s.envoy, "/v1/completions", &json!({"prompt": format!("after {i}"), "max_tokens": 2}), &[]).await;
        assert_eq!(a.status, 200);
        assert_ne!(a.pod.as_deref(), Some(victim.as_str()));
    }
}

async fn a_scorer_slower_than_the_timeout_is_treated_as_down(path: Path) {
    let s = stack(path, 1, &["--failure-mode", "open", "--scorer-timeout-ms", "100"]).await;
    let closed =
        EnvoyProcess::start(&s.scorer, &path.envoy_flags(&["--failure-mode", "closed", "--scorer-timeout-ms", "100"]))
            .await;
    let body = json!({"model": MODEL, "prompt": "while the scorer hangs", "max_tokens": 2});
    s.scorer.pause();
    let started = Instant::now();
    let open = send(&s.envoy, "/v1/completions", &body, &[]).await;
    assert_eq!(open.status, 200, "fail-open: served without a decision");
    assert!(started.elapsed() < Duration::from_secs(5));
    let shut = send(&closed, "/v1/completions", &body, &[]).await;
    // Envoy answers a picker past ext_proc's message timeout with its own 504.
    let expected = if path == Path::Epp { 504 } else { 503 };
    assert_eq!(shut.status, expected, "fail-closed: {}", shut.body);
    assert_eq!(s.failed_open().await, 1);
    s.scorer.resume();
    // Routing resumes. Bounded: a scorer just thawed on a loaded machine may miss the 100 ms
    // for a request or two (those fail open, as they should).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let before = s.routed().await;
        assert_eq!(send(&s.envoy, "/v1/completions", &body, &[]).await.status, 200);
        if s.routed().await > before {
            break;
        }
        assert!(Instant::now() < deadline, "routing never resumed");
    }
}

/// A stuck connection to the scorer (accepted, never answered: a frozen replica behind a
/// Service, a path the network black-holes) while the scorer itself is well: calls fail open
/// within the timeout, the connection is replaced, and routing resumes on the new one.
async fn a_connection_the_scorer_never_answers_on_is_replaced(path: Path) {
    let flags = ["--failure-mode", "open", "--scorer-timeout-ms", "200"];
    let s = stack(path, 1, &flags).await;
    // Envoy reaches the scorer (or picker) through a relay that holds every connection it
    // accepts while `stuck`, and forwards the later ones.
    let target = if path == Path::Epp { s.scorer.epp_port.expect("the picker's port") } else { s.scorer.port };
    let relay = Relay::start(target).await;
    let config = std::fs::read_to_string(&s.scorer.config_path).unwrap();
    let config: String = config
        .lines()
        .filter(|line| !line.starts_with("route_socket_path:"))
        .map(|line| line.replace(&format!("127.0.0.1:{target}"), &format!("127.0.0.1:{}", relay.port)) + "\n")
        .collect();
    let config_path = std::env::temp_dir().join(format!("kvgate-relayed-{}.yaml", relay.port));
    std::fs::write(&config_path, config).unwrap();
    let envoy = EnvoyProcess::start_for(&config_path, &path.envoy_flags(&flags)).await;
    let routed = || async {
        match path {
            Path::Wasm => envoy.stat("wasmcustom.kvgate_routed").await,
            Path::Native => envoy.stat("kvgate.routed").await,
            Path::Epp => scorer_metric(&s.scorer, "kvgate_decisions_total").await,
        }
    };
    let body = json!({"model": MODEL, "prompt": "on a stuck connection", "max_tokens": 2});
    for _ in 0..3 {
        let started = Instant::now();
        assert_eq!(send(&envoy, "/v1/completions", &body, &[]).await.status, 200, "fail-open");
        assert!(started.elapsed() < Duration::from_secs(2), "answered within the timeout: {:?}", started.elapsed());
    }
    assert_eq!(routed().await, 0);
    assert!(path.failed_open(&envoy).await >= 3);
    relay.unstick();
    // Bounded: a connection replaced once the proxy sees it stuck (Envoy's HTTP/2 keepalive
    // for the gRPC clusters: a PING every 2 s, closed 2 s after one goes unanswered).
    let deadline = Instant::now() + Duration::from_secs(20);
    while routed().await == 0 {
        assert!(Instant::now() < deadline, "routing never resumed: {} connections", relay.accepted());
        assert_eq!(send(&envoy, "/v1/completions", &body, &[]).await.status, 200);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(relay.accepted() >= 2, "the stuck connection was replaced");
    let before = routed().await;
    for _ in 0..3 {
        assert_eq!(send(&envoy, "/v1/completions", &body, &[]).await.status, 200);
    }
    assert_eq!(routed().await, before + 3, "routing resumed");
}

/// A TCP relay to `127.0.0.1:target` that holds the connections it accepts while stuck
/// (reads and drops what they send, answers nothing, closes only when they do) and forwards
/// the rest.
struct Relay {
    port: u16,
    stuck: std::sync::Arc<std::sync::atomic::AtomicBool>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: u16) -> Relay {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let stuck = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (held, counted) = (stuck.clone(), accepted.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                let stuck = held.load(Ordering::Relaxed);
                tokio::spawn(async move {
                    if stuck {
                        let _ = tokio::io::copy(&mut client, &mut tokio::io::sink()).await;
                        return;
                    }
                    if let Ok(mut scorer) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut scorer).await;
                    }
                });
            }
        });
        Relay { port, stuck, accepted, task }
    }

    fn unstick(&self) {
        self.stuck.store(false, std::sync::atomic::Ordering::Relaxed);
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn a_scorer_answering_garbage_is_treated_as_down(path: Path) {
    // Something else answers on the scorer's (or picker's) port: 200 with nonsense, or a bad
    // status line.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut n = 0u32;
        while let Ok((mut socket, _)) = listener.accept().await {
            n += 1;
            let answer: &[u8] = match n % 3 {
                0 => b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!",
                1 => b"HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n{\"decode\": \"evil.example:80\", \"pod\": \"x\"}",
                _ => b"garbage garbage garbage\r\n\r\n",
            };
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = vec![0u8; 1 << 16];
                let _ = socket.read(&mut buf).await;
                let _ = socket.write_all(answer).await;
            });
        }
    });
    let pod = Sim::start("pod-g", &["--time-scale", "0.02"]).await;
    let config = std::env::temp_dir().join(format!("kvgate-garbage-{port}.yaml"));
    let (listen, epp) = match path {
        Path::Wasm | Path::Native => (port, String::new()),
        Path::Epp => (kvgate_test_harness::free_port(), format!("epp: {{listen: '127.0.0.1:{port}'}}\n")),
    };
    std::fs::write(
        &config,
        format!("listen: 127.0.0.1:{listen}\n{epp}pods:\n  - {{name: pod-g, address: '127.0.0.1:{}'}}\n", pod.port),
    )
    .unwrap();
    let open = EnvoyProcess::start_for(&config, &path.envoy_flags(&["--failure-mode", "open"])).await;
    let closed = EnvoyProcess::start_for(&config, &path.envoy_flags(&["--failure-mode", "closed"])).await;
    let _ = std::fs::remove_file(&config);
    for i in 0..6 {
        let body = json!({"prompt": format!("garbage {i}"), "max_tokens": 2});
        let a = send(&open, "/v1/completions", &body, &[]).await;
        assert_eq!((a.status, a.pod.as_deref()), (200, Some("pod-g")), "fail-open serves: {}", a.body);
        assert_eq!(send(&closed, "/v1/completions", &body, &[]).await.status, 503);
    }
    if path != Path::Epp {
        let routed = if path == Path::Wasm { "wasmcustom.kvgate_routed" } else { "kvgate.routed" };
        assert_eq!(open.stat(routed).await, 0, "no garbage decision was followed");
    }
    assert_eq!(path.failed_open(&open).await, 6);
}

async fn a_pod_killed_costs_no_request_that_had_not_started(path: Path) {
    // Scrapes far apart: the scorer cannot know the pod died before the first requests do.
    let mut s = stack(path, 2, &[]).await;
    let system = text("Instructions every request shares, so that one pod holds them", 300);
    let body = |i: usize| chat(&system, &format!("question {i}"), i.is_multiple_of(2));
    let first = send(&s.envoy, "/v1/chat/completions", &body(0), &[]).await;
    let victim = first.pod.expect("x-kvgate-pod");
    s.scorer.wait_idle(Duration::from_secs(5)).await;
    s.pods.iter_mut().find(|p| p.pod_id == victim).unwrap().kill();
    // The prefix draws every request to the dead pod: each is retried on its fallback by
    // Envoy (connection refused), and the first report of it takes the pod out.
    for i in 1..=12 {
        let a = send(&s.envoy, "/v1/chat/completions", &body(i), &[]).await;
        assert_eq!(a.status, 200, "request {i} after the kill: {}", a.body);
        assert_ne!(a.pod.as_deref(), Some(victim.as_str()));
    }
    let down = s.scorer.wait_pod(&victim, Duration::from_secs(5), |p| p["healthy"] == false).await;
    assert_eq!(down["inflight_requests"], 0, "its bookings were released");
    s.scorer.wait_idle(Duration::from_secs(5)).await;
    let metrics = reqwest::get(format!("{}/metrics", s.scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains(&format!("kvgate_pods_down_total{{pod=\"{victim}\"")), "{metrics}");
}

async fn a_pick_that_refuses_connections_is_retried_on_its_fallback_and_the_booking_follows(path: Path) {
    let pod = Sim::start("pod-0", &["--tokenizer", qwen3_tokenizer().to_str().unwrap(), "--time-scale", "0.02"]).await;
    // `dead` is an address nothing listens on, without metrics or events: only a refused
    // connection reported by the proxy tells the scorer. Round robin picks it in turn (the
    // `kv` policy would see through it: an unknown pod counts as a full cache).
    let dead = format!("127.0.0.1:{}", kvgate_test_harness::free_port());
    let collector = Collector::start().await;
    let config = format!(
        "policy: {{name: round-robin}}\nhealth: {{retry_seconds: 0.3}}\ntraces: {{otlp_endpoint: '{}'}}\n{}pods:\n  - {{name: pod-0, address: '127.0.0.1:{}', metrics: '{}/metrics'}}\n  - {{name: dead, address: '{dead}'}}\n",
        collector.endpoint,
        path.scorer_config(&[]),
        pod.port,
        pod.url
    );
    let scorer = ScorerProcess::start(&config).await;
    let envoy = EnvoyProcess::start(&scorer, &path.envoy_flags(&[])).await;
    for i in 0..16 {
        let body = json!({"prompt": format!("question number {i} about retries"), "max_tokens": 2});
        let a = send(&envoy, "/v1/completions", &body, &[]).await;
        assert_eq!((a.status, a.pod.as_deref()), (200, Some("pod-0")), "{}", a.body);
        scorer.wait_idle(Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let picked_dead = scorer_metric(&scorer, "kvgate_decisions_total{pod=\"dead\",policy=\"round-robin\"}").await;
    assert!(picked_dead >= 1, "the dead pod was picked");
    assert_eq!(
        scorer_metric(&scorer, "kvgate_bookings_moved_total").await,
        picked_dead,
        "every such booking moved to the pod that served"
    );
    assert_eq!(
        scorer_metric(&scorer, "kvgate_pods_down_total{pod=\"dead\",reason=\"not_served\"}").await,
        picked_dead,
        "each time, the report took it out"
    );
    assert!(envoy.stat("cluster.kvgate_pods.upstream_rq_retry").await >= picked_dead);
    // Traced: the response of each pick of the dead pod says a fallback served it.
    let responses =
        |spans: &[kvgate_e2e::collector::ReceivedSpan]| spans.iter().filter(|s| s.name == "kvgate.response").count();
    let spans = collector.wait(Duration::from_secs(20), |spans| responses(spans) >= 16).await;
    let dead_picks: Vec<_> =
        spans.iter().filter(|s| s.name == "kvgate.pick" && s.attribute("kvgate.pod") == "dead").collect();
    assert_eq!(dead_picks.len() as u64, picked_dead, "{spans:#?}");
    for pick in dead_picks {
        let response = (spans.iter()).find(|s| s.name == "kvgate.response" && s.trace_id == pick.trace_id).unwrap();
        assert_eq!(response.attribute("kvgate.fallback_used"), true, "{response:?}");
        assert_eq!(response.attribute("kvgate.served_by"), &json!(format!("127.0.0.1:{}", pod.port)));
    }
}

/// One streamed request: (status, time to its first generated chunk or to its answer,
/// Retry-After).
async fn timed(client: &reqwest::Client, url: &str, body: &Value, objective: &str) -> (u16, Duration, Option<String>) {
    let started = Instant::now();
    let r = client
        .post(url)
        .header("x-gateway-inference-objective", objective)
        .json(body)
        .send()
        .await
        .expect("request through envoy");
    let status = r.status().as_u16();
    let retry_after = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    let mut stream = futures::StreamExt::boxed(r.bytes_stream());
    let mut first = None;
    let mut seen = Vec::new();
    while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
        seen.extend_from_slice(&chunk.expect("the stream completes"));
        if first.is_none() && String::from_utf8_lossy(&seen).contains("\"text\":\" ") {
            first = Some(started.elapsed());
        }
    }
    (status, first.unwrap_or_else(|| started.elapsed()), retry_after)
}

/// The 90th percentile of `v` (nearest rank; sorts it).
fn p90(v: &mut [Duration]) -> Duration {
    v.sort();
    v[(v.len() * 9).div_ceil(10) - 1]
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap()
}

async fn a_burst_beyond_capacity_waits_by_priority_and_sheds_the_sheddable(path: Path) {
    // Two pods in real time; a pod has room while it runs fewer than 4 requests and less
    // than one prompt's prefill is queued on it (kvgate's own bookings): the fleet's
    // capacity is 8 requests at once, a quarter of it kept for premium requests.
    let admission = "admission: {max_inflight_requests: 4, max_queued_prefill_tokens: 1200, headroom: 0.25, \
                     max_wait_ms: 20000, queue_limit: 64, objectives: {premium: 10, batch: -1}}\n";
    let s = stack_at(path, 2, &["--scorer-timeout-ms", "1000"], "1", admission, &[]).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", s.envoy.url);
    let body = |tag: &str, i: usize, max_tokens: u32| json!({"prompt": text(&format!("{tag} request {i} with its own long context"), 120), "max_tokens": max_tokens, "stream": true});
    // Unloaded: premium requests one at a time.
    let mut unloaded = Vec::new();
    for i in 0..10 {
        let (status, ttft, _) = timed(&client, &url, &body("alone", i, 16), "premium").await;
        assert_eq!(status, 200);
        unloaded.push(ttft);
    }
    let unloaded_p90 = p90(&mut unloaded);
    let rss_before = rss_kib(s.scorer.pid());

    // The burst: 40 ordinary requests (5× the fleet's capacity, answers of 128 tokens), then
    // 10 sheddable ones, then 20 premium (interactive) ones arriving one by one behind them
    // while the burst lasts, every 200 ms: one lasts 170 ms unloaded, so they fit the room
    // kept for them (one request per pod), as an interactive tier should. What a premium
    // request cannot skip is a prompt's prefill under way on every pod (one prompt is more
    // than its 1,200 tokens of room: it waits for the first to end, ≈ 2× unloaded); with
    // these answers a pod prefills a small share of its time, as under a chat workload, and
    // that befalls about one arrival in twenty. Twenty, not ten: a p90 of ten is their
    // second slowest.
    let send_all = |tag: &'static str, objective: &'static str, n: usize, max_tokens: u32| {
        (0..n)
            .map(|i| {
                let (client, url, body) = (client.clone(), url.clone(), body(tag, i, max_tokens));
                tokio::spawn(async move { timed(&client, &url, &body, objective).await })
            })
            .collect::<Vec<_>>()
    };
    let ordinary = send_all("ordinary", "standard", 40, 128);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sheddable = send_all("sheddable", "batch", 10, 16);
    let mut premium = Vec::new();
    for i in 0..20 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (client, url, body) = (client.clone(), url.clone(), body("premium", i, 16));
        premium.push(tokio::spawn(async move { timed(&client, &url, &body, "premium").await }));
    }
    let waiting = scorer_metric(&s.scorer, "kvgate_admission_waiting").await;
    assert!(waiting > 0, "the burst still queued when the last premium request arrived");
    let ordinary_waiting = scorer_metric(&s.scorer, "kvgate_admission_waiting{priority=\"0\"}").await;
    assert!(ordinary_waiting > 0, "counted by priority: the ordinary ones wait");

    for t in sheddable {
        let (status, took, retry_after) = t.await.unwrap();
        assert_eq!(status, 429, "sheddable under overload: refused");
        assert!(took < Duration::from_millis(500), "at once: {took:?}");
        assert!(retry_after.is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
    }
    let mut premium_ttft = Vec::new();
    for t in premium {
        let (status, ttft, _) = t.await.unwrap();
        assert_eq!(status, 200);
        premium_ttft.push(ttft);
    }
    let premium_p90 = p90(&mut premium_ttft);
    let mut ordinary_ttft = Vec::new();
    for t in ordinary {
        let (status, ttft, _) = t.await.unwrap();
        assert_eq!(status, 200, "ordinary requests wait their turn, nothing hangs or fails");
        ordinary_ttft.push(ttft);
    }
    let ordinary_p90 = p90(&mut ordinary_ttft);
    let ms = |v: &[Duration]| v.iter().map(|d| d.as_millis()).collect::<Vec<_>>();
    eprintln!(
        "overload ({path:?}): unloaded p90 {unloaded_p90:?}, premium p90 {premium_p90:?}, ordinary p90 {ordinary_p90:?}; \
         unloaded {:?} ms, premium {:?} ms, {waiting} waiting when the last premium arrived",
        ms(&unloaded),
        ms(&premium_ttft)
    );
    assert!(
        premium_p90 <= unloaded_p90 * 2,
        "premium p90 {premium_p90:?} within 2× unloaded {unloaded_p90:?} (ordinary: {ordinary_p90:?})"
    );
    assert!(ordinary_p90 > premium_p90, "the queue ran by priority");
    s.scorer.wait_idle(Duration::from_secs(10)).await;
    assert_eq!(scorer_metric(&s.scorer, "kvgate_admission_waiting").await, 0, "the queue drained");
    let sheddable = "kvgate_admission_refused_total{priority=\"-1\",reason=\"sheddable\"}";
    assert_eq!(scorer_metric(&s.scorer, sheddable).await, 10, "{}", s.scorer.metrics_text().await);
    // The admission wait by priority: most ordinary requests waited, and longer than premium.
    let waited = |priority: &str| {
        let metric = |part: &str| format!("kvgate_admission_wait_seconds_{part}{{priority=\"{priority}\"}}");
        let (sum, count) = (metric("sum"), metric("count"));
        let scorer = &s.scorer;
        async move { (scorer.metric(&count).await, scorer.metric(&sum).await) }
    };
    let ((ordinary_n, ordinary_s), (premium_n, premium_s)) = (waited("0").await, waited("10").await);
    assert!(ordinary_n >= 30.0, "{ordinary_n} of 40 ordinary requests waited");
    assert!(ordinary_s / ordinary_n > premium_s / premium_n.max(1.0), "ordinary {ordinary_s} s, premium {premium_s} s");
    let grown = rss_kib(s.scorer.pid()).saturating_sub(rss_before);
    assert!(grown < 32 * 1024, "the scorer's memory stays bounded: grew {grown} KiB");
}

async fn each_request_is_one_trace_with_the_decision_under_the_gateways_span(path: Path) {
    let collector = Collector::start().await;
    // Prefill speed learned from two first tokens: later picks predict their wait.
    let traces =
        format!("traces: {{otlp_endpoint: '{}'}}\nload: {{pod_speed: {{prior_samples: 2}}}}\n", collector.endpoint);
    let s = stack_at(path, 2, &[], "0.02", &traces, &[]).await;
    let system = text("a system prompt every request of this test shares", 300);
    let mut answered = Vec::new();
    for i in 0..4 {
        let a = send(&s.envoy, "/v1/chat/completions", &chat(&system, &format!("question {i}"), i % 2 == 0), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        answered.push(a.pod.unwrap());
    }
    // A trace the client started: the gateway's span joins it, and kvgate's under that.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{client_trace}-00f067aa0ba902b7-01");
    let a =
        send(&s.envoy, "/v1/chat/completions", &chat(&system, "question 4", true), &[("traceparent", &traceparent)])
            .await;
    assert_eq!(a.status, 200, "{}", a.body);
    answered.push(a.pod.unwrap());
    // A refusal is traced too: a model no pod serves.
    let mut unknown = chat(&system, "question 5", false);
    unknown["model"] = json!("no-such-model");
    assert_eq!(send(&s.envoy, "/v1/chat/completions", &unknown, &[]).await.status, 404);

    let n = answered.len();
    let ended = |spans: &[kvgate_e2e::collector::ReceivedSpan]| {
        spans.iter().filter(|s| s.name == "kvgate.response" && s.attribute("kvgate.outcome") == "done").count()
    };
    let spans = collector
        .wait(Duration::from_secs(30), |spans| {
            let picks: Vec<_> = spans.iter().filter(|s| s.name == "kvgate.pick").collect();
            ended(spans) == n
                && picks.len() > n
                && picks.iter().all(|p| spans.iter().any(|s| s.span_id == p.parent_span_id))
        })
        .await;
    let refused: Vec<_> =
        spans.iter().filter(|s| s.name == "kvgate.pick" && !s.attribute("kvgate.refused").is_null()).collect();
    assert_eq!(refused.len(), 1, "{spans:#?}");
    assert_eq!(
        (refused[0].attribute("kvgate.refused"), refused[0].attribute("http.response.status_code")),
        (&json!("ModelNotFound"), &json!(404))
    );
    assert!(spans.iter().all(|s| s.name != "kvgate.response" || s.trace_id != refused[0].trace_id), "no response span");
    let picks: Vec<_> =
        spans.iter().filter(|s| s.name == "kvgate.pick" && s.attribute("kvgate.refused").is_null()).collect();
    assert_eq!(picks.len(), n, "one decision span per request: {spans:#?}");
    assert_eq!(ended(&spans), n, "one response span per request, ended at done");
    let trace_ids: std::collections::HashSet<&str> = picks.iter().map(|p| p.trace_id.as_str()).collect();
    assert_eq!(trace_ids.len(), n, "one trace per request");
    assert!(trace_ids.contains(client_trace), "the client's trace is kept");
    let mut picked = Vec::new();
    for pick in &picks {
        assert_eq!(pick.service, "kvgate");
        let parent = spans.iter().find(|s| s.span_id == pick.parent_span_id).expect("the parent span exported");
        assert_eq!((parent.service.as_str(), &parent.trace_id), ("kvgate-gateway", &pick.trace_id), "{parent:?}");
        assert_eq!(pick.attribute("kvgate.path"), "direct");
        assert_eq!(pick.attribute("kvgate.policy"), "kv");
        assert_eq!(pick.attribute("gen_ai.request.model"), MODEL);
        assert_eq!(pick.attribute("kvgate.admission_wait_seconds"), 0.0);
        assert!(pick.attribute("kvgate.prompt_tokens").as_i64().unwrap() > 300, "{pick:?}");
        assert!(pick.attribute("kvgate.cached_tokens").is_i64(), "{pick:?}");
        picked.push(pick.attribute("kvgate.pod").as_str().unwrap().to_string());
        let response = (spans.iter())
            .find(|s| s.name == "kvgate.response" && s.trace_id == pick.trace_id)
            .expect("the response's span, in the same trace");
        assert_eq!(response.parent_span_id, pick.parent_span_id, "beside the decision, under the gateway");
        assert!(response.attribute("kvgate.time_to_first_token_seconds").as_f64().unwrap() > 0.0, "{response:?}");
        assert!(response.events.contains(&"first_token".to_string()), "{response:?}");
        assert_eq!(response.attribute("kvgate.fallback_used"), false, "{response:?}");
    }
    picked.sort();
    answered.sort();
    assert_eq!(picked, answered, "each decision names the pod that answered");
    assert!(picks.iter().any(|p| p.attribute("kvgate.cached_tokens").as_i64() > Some(0)), "the shared prefix cached");
    assert!(
        picks.iter().any(|p| p.attribute("kvgate.predicted_wait_seconds").as_f64() >= Some(0.0)),
        "a predicted wait once the prefill speed is learned"
    );
    // Never the prompt.
    let words: Vec<&str> = system.split_whitespace().collect();
    let phrase = words[..6].join(" ");
    for span in &spans {
        assert!(span.attributes.values().all(|v| !v.to_string().contains(&phrase)), "{span:?}");
    }
}

async fn sampled_at_one_percent_about_one_percent_of_requests_are_traced_whole(path: Path) {
    use futures::StreamExt;
    let collector = Collector::start().await;
    let traces = format!("traces: {{otlp_endpoint: '{}', sample_ratio: 0.01}}\n", collector.endpoint);
    let s = stack_at(path, 2, &[], "0.02", &traces, &[]).await;
    let n = 2000;
    let statuses: Vec<u16> = futures::stream::iter(0..n)
        .map(|i| {
            let body = json!({"model": MODEL, "prompt": format!("request {i} of the sampling test"), "max_tokens": 1});
            let envoy = &s.envoy;
            async move { send(envoy, "/v1/completions", &body, &[]).await.status }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert!(statuses.iter().all(|&status| status == 200), "{statuses:?}");
    // Both exporters flush every 5 s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let spans = collector.spans();
    let traced = |service: &str, name: Option<&str>| -> std::collections::BTreeSet<String> {
        (spans.iter())
            .filter(|s| s.service == service && name.is_none_or(|n| s.name == n))
            .map(|s| s.trace_id.clone())
            .collect()
    };
    let gateway = traced("kvgate-gateway", None);
    let picks = spans.iter().filter(|s| s.name == "kvgate.pick").count();
    // 20 expected; outside [6, 40] once in ten thousand runs.
    assert!((6..=40).contains(&gateway.len()), "{} of {n} requests traced", gateway.len());
    assert_eq!(
        traced("kvgate", Some("kvgate.pick")),
        gateway,
        "kvgate's spans exactly in the traces the gateway sampled"
    );
    assert_eq!(picks, gateway.len(), "one decision span per traced request");
}

async fn a_scorer_without_traces_exports_nothing_though_the_gateway_traces(path: Path) {
    let collector = Collector::start().await;
    let s = stack(path, 2, &[]).await;
    // A second Envoy in front of the same scorer, rendered as if the scorer traced: the
    // gateway traces every request and hands kvgate its span.
    let config = std::fs::read_to_string(&s.scorer.config_path).unwrap();
    let traced = s.scorer.config_path.with_extension("traced.yaml");
    std::fs::write(&traced, format!("traces: {{otlp_endpoint: '{}'}}\n{config}", collector.endpoint)).unwrap();
    let envoy = EnvoyProcess::start_patched(&traced, &path.envoy_flags(&[]), |bootstrap| bootstrap).await;
    let n = 20;
    for i in 0..n {
        let a = send(&envoy, "/v1/chat/completions", &chat("tracing off", &format!("question {i}"), false), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let gateway_traces = |spans: &[kvgate_e2e::collector::ReceivedSpan]| {
        spans.iter().map(|s| &s.trace_id).collect::<std::collections::HashSet<_>>().len()
    };
    let spans = collector.wait(Duration::from_secs(20), |spans| gateway_traces(spans) >= n).await;
    std::fs::remove_file(&traced).unwrap();
    assert_eq!(gateway_traces(&spans), n, "the gateway traced every request");
    assert!(spans.iter().all(|s| s.service == "kvgate-gateway"), "kvgate exported: {spans:#?}");
    assert_eq!(path.failed_open(&envoy).await, 0, "every request decided");
}

async fn two_models_go_each_to_its_pods_tokenized_by_its_own_tokenizer(path: Path) {
    const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";
    let (qwen, llama) = (qwen3_tokenizer(), llama3_tokenizer());
    let mut pods = Vec::new();
    for (i, (model, tokenizer)) in [(MODEL, &qwen), (MODEL, &qwen), (LLAMA, &llama), (LLAMA, &llama)].iter().enumerate()
    {
        let args = ["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.02", "--model", model];
        pods.push(Sim::start(&format!("pod-{i}"), &args).await);
    }
    let models = format!("models: [{{name: '{LLAMA}', tokenizer: '{}'}}]\n", llama.display());
    let s = stack_of(path, pods, &[], &models).await;
    for p in &s.pods {
        s.scorer.wait_pod(&p.pod_id, Duration::from_secs(10), |v| !v["models"].is_null()).await;
    }
    let serves = |model: &str, pod: &str| (model == MODEL) == (pod == "pod-0" || pod == "pod-1");
    // Conversations of each model, each with a long system prompt of its own: every turn
    // on a pod serving its model, and after the first on the pod holding its prefix, which
    // serves it from its cache — kvgate credited it in the model's own tokens.
    for (c, model) in [MODEL, LLAMA, MODEL, LLAMA].iter().enumerate() {
        let system = text(&format!("conversation {c} of two models"), 400);
        let mut first = None;
        for turn in 0..3 {
            let mut body = chat(&system, &format!("turn {turn}"), turn % 2 == 0);
            body["model"] = json!(model);
            let a = send(&s.envoy, "/v1/chat/completions", &body, &[]).await;
            assert_eq!(a.status, 200, "{}", a.body);
            let pod = a.pod.clone().unwrap();
            assert!(serves(model, &pod), "{model} sent to {pod}");
            match &first {
                None => first = Some(pod),
                Some(held) => {
                    assert_eq!(&pod, held, "{model}: turn {turn} away from the pod holding its prefix");
                    assert!(cached_tokens(&a) >= 300, "{model} turn {turn}: {} cached", cached_tokens(&a));
                }
            }
        }
    }
    // The prompt tokens the scorer counts are each model's own: its pods' count, and the
    // Llama 3 tokenizer splits this text otherwise than Qwen3's.
    let prompt = text("count me", 200);
    let mut counts = Vec::new();
    for (model, pod) in [(MODEL, &s.pods[0]), (LLAMA, &s.pods[2])] {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
        let (status, routed) = s.scorer.route("/v1/completions", &format!("count-{}", pod.pod_id), &body, false).await;
        assert_eq!(status, 200, "{routed}");
        assert!(serves(model, routed["pod"].as_str().unwrap()), "{routed}");
        assert_eq!(routed["prompt_tokens"], pod.tokenize(&prompt).await.len(), "{model}: {routed}");
        counts.push(routed["prompt_tokens"].clone());
    }
    assert_ne!(counts[0], counts[1]);
    assert_eq!(s.failed_open().await, 0);
}

async fn a_rewrite_splits_conversations_by_weight_and_every_turn_follows_its_target(path: Path) {
    use futures::StreamExt;
    let tokenizer = qwen3_tokenizer();
    let mut pods = Vec::new();
    for (i, model) in ["llama-v2", "llama-v2", "llama-v1"].iter().enumerate() {
        let args = ["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.02", "--model", model];
        pods.push(Sim::start(&format!("pod-{i}"), &args).await);
    }
    let rewrites = "model_rewrites:\n  - {matches: [llama], targets: [{model: llama-v2, weight: 90}, {model: llama-v1, weight: 10}]}\n";
    let s = stack_of(path, pods, &[], rewrites).await;
    for p in &s.pods {
        s.scorer.wait_pod(&p.pod_id, Duration::from_secs(10), |v| !v["models"].is_null()).await;
    }
    // 1,000 conversations asking for `llama`, which no pod serves: each pod answers only the
    // model it serves (404 otherwise), so a 200 shows the body reached it rewritten.
    let n = 1000;
    let turn = |c: usize, turns: usize| {
        let mut messages = vec![json!({"role": "user", "content": format!("conversation {c}: what is {c} squared?")})];
        for t in 1..turns {
            messages.push(json!({"role": "assistant", "content": format!("answer {t}")}));
            messages.push(json!({"role": "user", "content": format!("and {c} to the power {}?", t + 2)}));
        }
        json!({"model": "llama", "max_tokens": 2, "messages": messages})
    };
    let ask = |body: Value| {
        let envoy = &s.envoy;
        async move {
            let a = send(envoy, "/v1/chat/completions", &body, &[]).await;
            assert_eq!(a.status, 200, "{}", a.body);
            let answered: Value = serde_json::from_str(&a.body).unwrap();
            (answered["model"].as_str().unwrap().to_string(), a.pod.unwrap())
        }
    };
    let firsts: Vec<(String, String)> =
        futures::stream::iter(0..n).map(|c| ask(turn(c, 1))).buffered(16).collect().await;
    let serves = |pod: &str, model: &str| (pod == "pod-2") == (model == "llama-v1");
    assert!(firsts.iter().all(|(model, pod)| serves(pod, model)), "each answered by a pod serving its target");
    let v1 = firsts.iter().filter(|(model, _)| model == "llama-v1").count();
    assert!((70..=130).contains(&v1), "{v1} of {n} conversations to the 10 % target (±3 %)");
    // Every later turn of a conversation reaches its first turn's target.
    let later: Vec<(usize, (String, String))> = futures::stream::iter((0..n).step_by(5))
        .map(|c| async move { (c, ask(turn(c, 3)).await) })
        .buffered(16)
        .collect()
        .await;
    for (c, (model, _)) in &later {
        assert_eq!(model, &firsts[*c].0, "conversation {c}: its third turn went elsewhere");
    }
    // A body of many chunks (≈ 150 kB) reaches its pod whole under its target's name.
    let long = text("Clause of a very long contract", 4_600);
    let body = json!({"model": "llama", "prompt": long, "max_tokens": 2, "prompt_cache_key": "contract"});
    let a = send(&s.envoy, "/v1/completions", &body, &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let answered: Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(answered["usage"]["prompt_tokens"], s.pods[0].tokenize(&long).await.len(), "the whole prompt");
    assert!(serves(a.pod.as_deref().unwrap(), answered["model"].as_str().unwrap()));
    // Each decision's target, counted.
    let v1_later = later.iter().filter(|(_, (model, _))| model == "llama-v1").count();
    let counted = s.scorer.metric(r#"kvgate_model_rewrites_total{from="llama",to="llama-v1"}"#).await;
    assert_eq!(counted as usize, v1 + v1_later);
    let all = s.scorer.metric("kvgate_model_rewrites_total").await;
    assert_eq!(all as usize, firsts.len() + later.len() + 1);
    assert_eq!(s.failed_open().await, 0);
}
