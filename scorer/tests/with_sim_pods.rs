//! The scorer against simulated vLLM pods over real ZMQ and HTTP: it learns what each pod
//! cached from the pods' own events and routes there; eviction moves the decision; a dead
//! pod is excluded and returns; pods without events are indexed approximately.

use kvgate_test_harness::{ScorerProcess, Sim, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::time::Duration;

const MODEL: &str = "Qwen/Qwen3-8B";

async fn pods(n: usize, extra: &[&str]) -> Vec<Sim> {
    let tokenizer = qwen3_tokenizer();
    let mut args = vec!["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.01", "--model", MODEL];
    args.extend_from_slice(extra);
    let mut out = Vec::new();
    for i in 0..n {
        out.push(Sim::start(&format!("pod-{i}"), &args).await);
    }
    out
}

fn config(pods: &[Sim], with_events: bool, extra: &str) -> String {
    let mut yaml = format!(
        "tokenizer: {}\nhealth: {{scrape_interval_ms: 100, scrape_timeout_ms: 200, unhealthy_after: 2}}\n{extra}pods:\n",
        qwen3_tokenizer().display()
    );
    for p in pods {
        yaml.push_str(&format!(
            "  - name: {}\n    address: 127.0.0.1:{}\n    metrics: {}/metrics\n",
            p.pod_id, p.port, p.url
        ));
        if with_events {
            yaml.push_str(&format!("    kv_events: {}\n    kv_events_replay: {}\n", p.events, p.replay));
        }
    }
    yaml
}

fn chat(system: &str, question: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})
}

/// A scorer following the pods' KV events, once its subscriptions are in place.
async fn following_events(pods: &[Sim]) -> ScorerProcess {
    let scorer = ScorerProcess::start(&config(pods, true, "")).await;
    for p in pods {
        scorer.wait_pod(&p.pod_id, Duration::from_secs(10), |v| v["events_received"].as_u64().is_some()).await;
    }
    // Let the SUB sockets subscribe before the events we rely on are published.
    tokio::time::sleep(Duration::from_millis(500)).await;
    scorer
}

/// Waits until the scorer's index holds at least `blocks` blocks of `pod`.
async fn indexed(scorer: &ScorerProcess, pod: &str, blocks: u64) {
    scorer.wait_pod(pod, Duration::from_secs(10), |p| p["cached_blocks"].as_u64().unwrap() >= blocks).await;
}

#[tokio::test]
async fn routes_to_the_pod_whose_events_announced_the_prefix() {
    let pods = pods(3, &[]).await;
    let scorer = following_events(&pods).await;

    // Warm a long system prompt on pod-1 directly: only its events can tell the scorer.
    let system = text("You are a meticulous assistant for harbor logistics", 200);
    let warm = pods[1].post_json("/v1/chat/completions", &chat(&system, "warm up")).await;
    let warm_prompt = warm["usage"]["prompt_tokens"].as_u64().unwrap();
    indexed(&scorer, "pod-1", warm_prompt / 16).await;

    for i in 0..5 {
        let (status, decision) =
            scorer.route("/v1/chat/completions", &format!("req-{i}"), &chat(&system, &format!("q{i}")), true).await;
        assert_eq!(status, 200, "{decision}");
        assert_eq!(decision["pod"], "pod-1", "{decision}");
        assert_eq!(decision["decode"], format!("127.0.0.1:{}", pods[1].port));
        assert!(decision["cached_tokens"].as_u64().unwrap() >= warm_prompt / 16 * 16 - 16, "{decision}");
        // The scorer's token count is the engine's.
        let served = pods[1].post_json("/v1/chat/completions", &chat(&system, &format!("q{i}"))).await;
        assert_eq!(decision["prompt_tokens"], served["usage"]["prompt_tokens"]);
        let explain = decision["explain"].as_array().unwrap();
        assert_eq!(explain.len(), 3);
        assert_eq!(explain.iter().filter(|e| e["chosen"] == true).count(), 1);
        scorer_lifecycle_done(&scorer, &format!("req-{i}")).await;
    }

    // Eviction moves the decision: pod-1 drops its cache, pod-2 caches the prefix.
    assert_eq!(pods[1].post("/reset_prefix_cache", &Value::Null).await.status(), 200);
    scorer.wait_pod("pod-1", Duration::from_secs(10), |p| p["cached_blocks"] == 0).await;
    let warm2 = pods[2].post_json("/v1/chat/completions", &chat(&system, "warm up again")).await;
    indexed(&scorer, "pod-2", warm2["usage"]["prompt_tokens"].as_u64().unwrap() / 16).await;
    let (_, decision) = scorer.route("/v1/chat/completions", "after-evict", &chat(&system, "q"), false).await;
    assert_eq!(decision["pod"], "pod-2", "{decision}");

    let pod = scorer.pod("pod-1").await;
    assert_eq!(pod["index"], "precise");
    assert_eq!(pod["index_stats"]["clears"], 1);
    assert_eq!(pod["event_gaps"], 0);
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_decisions_total{pod=\"pod-1\",policy=\"kv\"} 5"), "{metrics}");
    assert!(metrics.contains("kvgate_kv_events_total{pod=\"pod-1\",type=\"all_blocks_cleared\"} 1"));
    assert!(metrics.contains("kvgate_decision_seconds_bucket"));
    // Six route calls resent the long system prompt: its pieces tokenized by the first, read
    // back by the other five (and the token counts above equal the engine's all the same).
    let pieces = |outcome: &str| -> u64 {
        let line = format!("kvgate_tokenizer_cache_pieces_total{{outcome=\"{outcome}\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(line.as_str())).and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    assert!(pieces("miss") >= 1, "{metrics}");
    assert!(pieces("hit") >= 5 * pieces("miss"), "{metrics}");
}

async fn scorer_lifecycle_done(scorer: &ScorerProcess, id: &str) {
    let batch = json!({"reports": [{"request_id": id, "event": "first_token"}, {"request_id": id, "event": "done"}]});
    let r = reqwest::Client::new().post(format!("{}/v1/lifecycle", scorer.url)).json(&batch).send().await.unwrap();
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer, json!({"accepted": 2, "unknown": 0}));
}

#[tokio::test]
async fn bookings_spread_a_burst_and_lifecycle_releases_them() {
    let pods = pods(2, &[]).await;
    let scorer = ScorerProcess::start(&config(&pods, true, "")).await;
    // Four distinct long prompts decided back to back, before any pod reports load: the
    // scorer's own bookings must spread them.
    let mut chosen = Vec::new();
    for i in 0..4 {
        let body = json!({"prompt": text(&format!("topic{i}"), 300), "max_tokens": 50});
        let (_, d) = scorer.route("/v1/completions", &format!("burst-{i}"), &body, false).await;
        chosen.push(d["pod"].as_str().unwrap().to_string());
    }
    assert_eq!(chosen.iter().filter(|p| *p == "pod-0").count(), 2, "{chosen:?}");
    let inflight: u64 = scorer.pods().await.iter().map(|p| p["inflight_requests"].as_u64().unwrap()).sum();
    assert_eq!(inflight, 4);
    for i in 0..4 {
        scorer_lifecycle_done(&scorer, &format!("burst-{i}")).await;
    }
    for p in scorer.pods().await {
        assert_eq!(p["inflight_requests"], 0);
        assert_eq!(p["queued_prefill_tokens"], 0);
    }
}

#[tokio::test]
async fn a_dead_pod_is_excluded_until_it_answers_again() {
    let mut pods = pods(2, &[]).await;
    let scorer = ScorerProcess::start(&config(&pods, true, "")).await;
    pods[0].kill();
    scorer.wait_pod("pod-0", Duration::from_secs(10), |p| p["healthy"] == false).await;
    for i in 0..6 {
        let body = json!({"prompt": format!("question {i}"), "max_tokens": 5});
        let (status, d) = scorer.route("/v1/completions", &format!("k{i}"), &body, false).await;
        assert_eq!(status, 200);
        assert_eq!(d["pod"], "pod-1");
    }
    pods[1].kill();
    scorer.wait_pod("pod-1", Duration::from_secs(10), |p| p["healthy"] == false).await;
    let (status, d) = scorer.route("/v1/completions", "none", &json!({"prompt": "x"}), false).await;
    assert_eq!(status, 503, "{d}");
    assert_eq!(d["error"]["type"], "ServiceUnavailable");
    assert_eq!(reqwest::get(format!("{}/readyz", scorer.url)).await.unwrap().status(), 503);

    // pod-0 comes back (a restarted engine: empty cache, event sequence from 0).
    pods[0].restart().await;
    scorer.wait_pod("pod-0", Duration::from_secs(10), |p| p["healthy"] == true).await;
    let (status, d) = scorer.route("/v1/completions", "back", &json!({"prompt": "x"}), false).await;
    assert_eq!((status, d["pod"].as_str()), (200, Some("pod-0")));
    assert_eq!(reqwest::get(format!("{}/readyz", scorer.url)).await.unwrap().status(), 200);
    // Its event stream is followed again: what it caches after the restart is indexed (the
    // scorer resubscribes within its reconnect backoff; batches published before are missed).
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    for i in 0.. {
        let body = json!({"prompt": text(&format!("after restart {i}"), 200), "max_tokens": 1});
        pods[0].post_json("/v1/completions", &body).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if scorer.pod("pod-0").await["cached_blocks"].as_u64().unwrap() > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the restarted pod's events are never indexed");
    }
}

#[tokio::test]
async fn a_pod_down_ten_seconds_returns_with_what_it_really_caches() {
    let mut pods = pods(2, &[]).await;
    let scorer = ScorerProcess::start(&config(&pods, true, "")).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // subscriptions settle
    let warm = text("A prefix pod-0 caches before it dies", 300);
    pods[0].post_json("/v1/completions", &json!({"prompt": warm, "max_tokens": 1})).await;
    indexed(&scorer, "pod-0", 20).await;

    let killed = std::time::Instant::now();
    pods[0].kill();
    // Its event stream disconnects and its scrape is refused: out at once.
    scorer.wait_pod("pod-0", Duration::from_secs(2), |p| p["healthy"] == false).await;
    assert!(killed.elapsed() < Duration::from_secs(1), "down within a second: {:?}", killed.elapsed());
    tokio::time::sleep(Duration::from_secs(10)).await;

    // Back with an empty cache, and busy at once: its first batches are published before
    // the scorer has resubscribed, so the stream it finds does not start at sequence 0.
    pods[0].restart().await;
    let back = std::time::Instant::now();
    let fresh = text("What pod-0 caches after its restart", 300);
    pods[0].post_json("/v1/completions", &json!({"prompt": fresh, "max_tokens": 1})).await;
    // Within 2 s: healthy, and nothing of the old cache believed.
    let pod = scorer.wait_pod("pod-0", Duration::from_secs(2), |p| p["healthy"] == true).await;
    assert!(back.elapsed() < Duration::from_secs(2), "{pod}");
    let (status, d) = scorer.route("/v1/completions", "old", &json!({"prompt": warm, "max_tokens": 1}), true).await;
    assert_eq!(status, 200, "{d}");
    let old = d["explain"].as_array().unwrap().iter().find(|e| e["pod"] == "pod-0").unwrap().clone();
    assert_eq!(old["cached_tokens"], 0, "the evicted-by-restart prefix is not predicted: {old}");
    // And what it caches now is indexed — by its events, not by bookings (a prefix booked on
    // a pod counts as cached there too) — though the engine publishes nothing more: its
    // first batches, published before the scorer resubscribed, come from its replay buffer.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let pod = scorer.pod("pod-0").await;
        if pod["cached_blocks"].as_u64().unwrap() > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the restarted pod's events are never indexed: {pod}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, d) = scorer.route("/v1/completions", "new", &json!({"prompt": fresh, "max_tokens": 1}), true).await;
    let now = d["explain"].as_array().unwrap().iter().find(|e| e["pod"] == "pod-0").unwrap().clone();
    assert!(now["cached_tokens"].as_u64().unwrap() > 0, "{now}");
    // The subscriber reconnected on its own pace (not the socket library's growing backoff)
    // and caught up with what the new engine published before it was back.
    assert!(back.elapsed() < Duration::from_secs(2), "indexed {:?} after the return", back.elapsed());
}

#[tokio::test]
async fn pods_without_events_are_indexed_by_what_was_routed() {
    let pods = pods(3, &[]).await;
    let scorer = ScorerProcess::start(&config(&pods, false, "")).await;
    let system = text("Shared instructions for the support desk", 150);
    let (_, first) = scorer.route("/v1/chat/completions", "a1", &chat(&system, "first"), false).await;
    let target = first["pod"].as_str().unwrap().to_string();
    assert_eq!(first["cached_tokens"], 0);
    // Requests finish between decisions (otherwise queued prefill rightly sends the next
    // request elsewhere).
    scorer_lifecycle_done(&scorer, "a1").await;
    for i in 0..4 {
        let id = format!("a{i}x");
        let (_, d) = scorer.route("/v1/chat/completions", &id, &chat(&system, &format!("next {i}")), false).await;
        assert_eq!(d["pod"], target.as_str(), "approximate affinity: {d}");
        assert!(d["cached_tokens"].as_u64().unwrap() > 100);
        scorer_lifecycle_done(&scorer, &id).await;
    }
    assert_eq!(scorer.pod(&target).await["index"], "approximate");
}

#[tokio::test]
async fn bad_route_calls_get_clear_errors() {
    let pods = pods(1, &[]).await;
    let scorer = ScorerProcess::start(&config(&pods, true, "")).await;
    for (path, body, needle) in [
        ("/v1/completions", "{oops", "not valid JSON"),
        ("/v1/completions", r#"{"max_tokens": 2}"#, "'prompt' is required"),
        ("/v1/chat/completions", r#"{"messages": "hi"}"#, "invalid request"),
        ("/v1/embeddings", r#"{"input": "x"}"#, "kvgate routes"),
    ] {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/route", scorer.url))
            .header("x-kvgate-api-path", path)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = r.json().await.unwrap();
        assert!(e["error"]["message"].as_str().unwrap().contains(needle), "{e}");
    }
    let r = reqwest::Client::new().post(format!("{}/v1/route", scorer.url)).body("{}").send().await.unwrap();
    assert_eq!(r.status(), 400, "the API path header is required");
}

#[tokio::test]
async fn bookings_whose_lifecycle_reports_are_lost_expire() {
    let pods = pods(1, &[]).await;
    let scorer = ScorerProcess::start(&config(&pods, true, "load: {request_ttl_seconds: 1}\n")).await;
    let (status, _) = scorer.route("/v1/completions", "lost-1", &json!({"prompt": text("orphan", 100)}), false).await;
    assert_eq!(status, 200);
    assert_eq!(scorer.pod("pod-0").await["inflight_requests"], 1);
    // No `done` ever arrives: the booking is dropped after its TTL (checked every second).
    scorer.wait_pod("pod-0", Duration::from_secs(5), |p| p["inflight_requests"] == 0).await;
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_bookings_expired_total 1"), "{metrics}");
}

/// How many threads of the scorer serve the API's connections.
fn api_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.unwrap().path().join("comm")).ok())
        .filter(|comm| comm.starts_with("kvgate-api-"))
        .count()
}

#[tokio::test]
async fn route_streams_are_served_on_listen_threads_and_do_not_hold_up_a_stop() {
    use kvgate_route_api::{LifecycleEvent, Outcome, ROUTE_STREAM_PATH, RouteAnswer, RouteCall, StreamReport};
    let picked = |answer: &RouteAnswer| match &answer.outcome {
        Some(Outcome::Pick(pick)) => pick.pod.clone(),
        other => panic!("call {}: {other:?}", answer.call),
    };
    let pods = pods(1, &[]).await;
    let mut scorer = ScorerProcess::start(&config(&pods, false, "listen_threads: 3\n")).await;
    // A thread names itself once it first runs: on a busy machine, some time after the start.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while api_threads(scorer.pid()) < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(api_threads(scorer.pid()), 3);

    // A route stream, as Envoy's filter keeps one open per worker.
    let channel = tonic::transport::Endpoint::from_shared(scorer.url.clone()).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let (calls, queued) = tokio::sync::mpsc::channel(4);
    let answers = grpc.streaming(
        tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(queued)),
        tonic::codegen::http::uri::PathAndQuery::from_static(ROUTE_STREAM_PATH),
        tonic_prost::ProstCodec::<RouteCall, RouteAnswer>::default(),
    );
    let mut answers = answers.await.unwrap().into_inner();
    // A short prompt and a document over 64 kB (prepared off the stream's thread).
    let document = text("clause", 15_000);
    assert!(document.len() > 64 << 10);
    for (call, prompt) in [(1, "a short question"), (2, document.as_str())] {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
        calls
            .send(RouteCall {
                call,
                request_id: format!("stream-{call}"),
                api_path: "/v1/completions".into(),
                body: serde_json::to_vec(&body).unwrap(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let mut answered = std::collections::BTreeMap::new();
    for _ in 0..2 {
        let answer = answers.message().await.unwrap().expect("an answer");
        answered.insert(answer.call, picked(&answer));
    }
    assert_eq!(answered.keys().copied().collect::<Vec<_>>(), [1, 2], "{answered:?}");
    // Both prompts tokenized in full: the question's few tokens and the document's 16k+.
    let routed = scorer.metric("kvgate_routed_prompt_tokens_total").await;
    assert!(routed > 16_000.0, "{routed}");
    assert_eq!(scorer.pod("pod-0").await["inflight_requests"], 2);

    // Lifecycle reports ride on the stream: alone (no answer), or on a route call (applied
    // before it). A report naming no known event is counted and dropped.
    let done = |id: &str| StreamReport {
        request_id: id.into(),
        event: LifecycleEvent::Done.into(),
        output_tokens: Some(2),
        ..Default::default()
    };
    let stray = StreamReport { request_id: "stream-1".into(), event: 17, ..Default::default() };
    calls.send(RouteCall { reports: vec![done("stream-1"), stray], ..Default::default() }).await.unwrap();
    let body = json!({"model": MODEL, "prompt": "another question", "max_tokens": 2});
    calls
        .send(RouteCall {
            call: 3,
            request_id: "stream-3".into(),
            api_path: "/v1/completions".into(),
            body: serde_json::to_vec(&body).unwrap(),
            reports: vec![done("stream-2")],
            ..Default::default()
        })
        .await
        .unwrap();
    let answer = answers.message().await.unwrap().expect("an answer");
    assert_eq!(answer.call, 3, "the reports-only message is not answered");
    assert_eq!(picked(&answer), "pod-0");
    assert_eq!(scorer.pod("pod-0").await["inflight_requests"], 1, "only stream-3 is in flight");
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_lifecycle_reports_total{event=\"done\"} 2"), "{metrics}");
    assert!(metrics.contains("kvgate_lifecycle_reports_total{event=\"invalid\"} 1"), "{metrics}");

    // The stream stays open (Envoy closes it when it goes): a stop waits a few seconds for
    // it, not for ever.
    let stopped = scorer.stop(Duration::from_secs(15)).await.expect("the scorer stops with a route stream open");
    assert!(stopped.success(), "{stopped}");
    drop(calls);
}

#[tokio::test]
async fn debug_endpoints_can_be_turned_off_or_moved() {
    let pods = pods(1, &[]).await;
    let admin = kvgate_test_harness::free_port();
    let scorer = ScorerProcess::start(&config(
        &pods,
        true,
        &format!("admin: {{listen: '127.0.0.1:{admin}', debug_endpoints: false}}\n"),
    ))
    .await;
    let get = |url: String| async move { reqwest::get(url).await.unwrap().status().as_u16() };
    assert_eq!(get(format!("{}/v1/pods", scorer.url)).await, 404);
    assert_eq!(get(format!("{}/metrics", scorer.url)).await, 404, "moved to the admin address");
    assert_eq!(get(format!("http://127.0.0.1:{admin}/metrics")).await, 200);
    assert_eq!(get(format!("http://127.0.0.1:{admin}/v1/pods")).await, 404, "debug endpoints off");
    assert_eq!(get(format!("{}/readyz", scorer.url)).await, 200, "probes stay on the main address");
    let (status, d) = scorer.route("/v1/completions", "x", &json!({"prompt": "hello"}), true).await;
    assert_eq!(status, 200);
    assert!(d.get("explain").is_none(), "explain is a debug endpoint: {d}");
}

#[tokio::test]
async fn a_slower_pod_is_learned_from_first_tokens_and_avoided() {
    // pod-1 is the same engine three times slower (an older GPU beside a newer one); no
    // configuration says so.
    let tokenizer = qwen3_tokenizer();
    let mut pods = Vec::new();
    for (i, scale) in ["0.5", "1.5"].iter().enumerate() {
        let args = ["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", scale, "--model", MODEL];
        pods.push(Sim::start(&format!("pod-{i}"), &args).await);
    }
    let scorer = ScorerProcess::start(&config(&pods, true, "load: {pod_speed: {prior_samples: 4}}\n")).await;
    let mut served = [0; 2];
    // Pairs of distinct prompts of one size (100–700 words), decided back to back and
    // served together, each reported at its first token (non-streaming with one output
    // token: the answer is the first token). While pod-1 looks less than twice as slow, the
    // second of a pair goes there rather than queue behind the first.
    for pair in 0..20 {
        let mut legs = Vec::new();
        for k in 0..2 {
            let body = json!({"prompt": text(&format!("topic{pair}x{k}"), 100 + 150 * (pair % 5)), "max_tokens": 1});
            let id = format!("speed-{pair}-{k}");
            let (status, d) = scorer.route("/v1/completions", &id, &body, false).await;
            assert_eq!(status, 200, "{d}");
            let pod = if d["pod"] == "pod-0" { 0 } else { 1 };
            served[pod] += 1;
            legs.push((pod, id, body));
        }
        futures::future::join_all(legs.iter().map(|(pod, id, body)| async {
            pods[*pod].post_json("/v1/completions", body).await;
            scorer_lifecycle_done(&scorer, id).await;
        }))
        .await;
    }
    let (fast, slow) = (scorer.pod("pod-0").await, scorer.pod("pod-1").await);
    let ratio = slow["slowness"].as_f64().unwrap() / fast["slowness"].as_f64().unwrap();
    assert!(ratio > 1.8, "pod-1 should look about 3x slower: {fast} {slow}");
    assert!(slow["slowness_samples"].as_f64().unwrap() >= 3.0, "{slow}");
    // Idle pods, no cache: the work is the same, the time is not.
    assert!(served[0] > served[1], "{served:?}");
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    let fixed_prefill_tokens: Option<f64> =
        metrics.lines().find_map(|l| l.strip_prefix("kvgate_fixed_prefill_tokens ")).and_then(|v| v.parse().ok());
    for i in 0..5 {
        let body = json!({"prompt": text(&format!("fresh{i}y"), 300), "max_tokens": 1});
        let (_, d) = scorer.route("/v1/completions", &format!("after-{i}"), &body, true).await;
        assert_eq!(d["pod"], "pod-0", "{d}");
        let explain = d["explain"].as_array().unwrap();
        let slowness: Vec<f64> = explain.iter().map(|e| e["slowness"].as_f64().unwrap()).collect();
        assert!(slowness.iter().any(|&s| s > 1.0) && slowness.iter().any(|&s| s < 1.0), "{d}");
        scorer_lifecycle_done(&scorer, &format!("after-{i}")).await;
    }
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_pod_slowness{pod=\"pod-1\"}"), "{metrics}");
    // The fixed part of a first token's time (the engines' step cost, the report's trip) in
    // tokens of prefill, as learned from the pairs served (the requests below, reported
    // without being served, would teach it that first tokens come at once).
    let fixed = fixed_prefill_tokens.unwrap_or_else(|| panic!("not exported"));
    assert!(fixed > 0.0 && fixed.is_finite(), "{fixed}");
}

#[tokio::test]
async fn a_prefix_offloaded_to_host_memory_keeps_its_pod() {
    // GPU caches of 256 blocks (4,096 tokens), host-memory tiers of 4,096: the engines offload
    // every computed block and announce it as vLLM's connector does (hash-only placeholders).
    let pods = pods(2, &["--num-blocks", "256", "--offload-blocks", "4096"]).await;
    let scorer = following_events(&pods).await;
    let system = text("You are a careful assistant for orchard irrigation schedules", 200);
    let warm = pods[1].post_json("/v1/chat/completions", &chat(&system, "warm up")).await;
    let blocks = warm["usage"]["prompt_tokens"].as_u64().unwrap() / 16;
    // Other prompts push the prefix out of pod-1's GPU cache; it stays in host memory.
    for i in 0..5 {
        let other = text(&format!("Unrelated instructions number {i} about bridge maintenance"), 200);
        pods[1].post_json("/v1/chat/completions", &chat(&other, "go")).await;
    }
    let pod = scorer
        .wait_pod("pod-1", Duration::from_secs(10), |p| {
            p["index_stats"]["removed_blocks"].as_u64().unwrap() >= blocks
                && p["offloaded_blocks"].as_u64().unwrap() >= 2 * blocks
        })
        .await;
    assert_eq!(pod["index_stats"]["unresolved_offloads"], 0, "{pod}");
    let (status, decision) = scorer.route("/v1/chat/completions", "again", &chat(&system, "q"), true).await;
    assert_eq!(status, 200, "{decision}");
    assert_eq!(decision["pod"], "pod-1", "the prefix loads from pod-1's host memory: {decision}");
    let explain = decision["explain"].as_array().unwrap();
    let held = explain.iter().find(|e| e["pod"] == "pod-1").unwrap();
    let (gpu, offloaded) = (held["cached_tokens"].as_u64().unwrap(), held["offloaded_tokens"].as_u64().unwrap());
    assert!(gpu < blocks * 16 && gpu + offloaded >= (blocks - 1) * 16, "{held}");
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_index_blocks{index=\"offloaded\",pod=\"pod-1\"}"), "{metrics}");
}

#[tokio::test]
async fn lora_adapters_are_learned_from_the_pods() {
    // No `lora_adapters` in the configuration: kvgate learns "sql" from the pods.
    let pods = pods(2, &["--lora-module", "sql"]).await;
    let scorer = following_events(&pods).await;
    let system = text("You translate warehouse questions into SQL", 200);
    let sql = |question: &str| {
        json!({"model": "sql", "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]})
    };

    // The adapter's blocks hash apart (events carry `lora_name`); once kvgate has them, it
    // hashes the adapter's requests the same way and finds the prefix.
    let warm = pods[1].post_json("/v1/chat/completions", &sql("warm up")).await;
    let warm_prompt = warm["usage"]["prompt_tokens"].as_u64().unwrap();
    indexed(&scorer, "pod-1", warm_prompt / 16).await;
    let (status, adapter) = scorer.route("/v1/chat/completions", "sql-1", &sql("q1"), true).await;
    assert_eq!(status, 200, "{adapter}");
    assert_eq!(adapter["pod"], "pod-1", "{adapter}");
    assert!(adapter["cached_tokens"].as_u64().unwrap() >= warm_prompt / 16 * 16 - 16, "{adapter}");
    // The base model with the same prompt is not credited with the adapter's blocks.
    let (_, base) = scorer.route("/v1/chat/completions", "base-1", &chat(&system, "q1"), true).await;
    assert_eq!(base["cached_tokens"], 0, "{base}");

    // An adapter request in flight shows in the pod's `vllm:lora_requests_info`, and so in
    // what kvgate reports of the pod.
    let slow = Sim::start("pod-slow", &["--model", MODEL, "--lora-module", "law", "--time-scale", "1"]).await;
    let scorer = ScorerProcess::start(&config(std::slice::from_ref(&slow), false, "")).await;
    let long = json!({"model": "law", "max_tokens": 300, "prompt": "Summarise the contract"});
    let url = format!("{}/v1/completions", slow.url);
    let running = tokio::spawn(async move { reqwest::Client::new().post(url).json(&long).send().await });
    let pod =
        scorer.wait_pod("pod-slow", Duration::from_secs(10), |p| p["adapters"]["running"] == json!(["law"])).await;
    assert_eq!(pod["adapters"]["max_lora"], 1, "{pod}");
    running.abort();
}
