//! The simulator's OpenAI-compatible HTTP API over real sockets.

use futures::StreamExt;
use kvgate_test_harness::{Sim, completion, qwen3_tokenizer, text};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn qwen3_sim(pod: &str, extra: &[&str]) -> Sim {
    let tokenizer = qwen3_tokenizer();
    let mut args = vec!["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0.02"];
    args.extend_from_slice(extra);
    Sim::start(pod, &args).await
}

/// Reads an SSE response: the JSON of each `data:` line, and whether `[DONE]` ended it.
async fn sse(response: reqwest::Response) -> (Vec<Value>, bool) {
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let body = response.text().await.expect("stream body");
    let mut chunks = Vec::new();
    let mut done = false;
    for line in body.lines().filter(|l| !l.is_empty()) {
        let data = line.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data line: {line:?}"));
        assert!(!done, "data after [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(serde_json::from_str(data).expect("chunk JSON"));
        }
    }
    (chunks, done)
}

#[tokio::test]
async fn completions_and_chat_report_real_token_counts() {
    let sim = qwen3_sim("pod-a", &[]).await;
    let prompt = text("alpha", 300);
    let ids = sim.tokenize(&prompt).await;
    let r = sim.post("/v1/completions", &completion(&prompt, 7)).await;
    assert_eq!(r.headers()["x-kvgate-pod"], "pod-a");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert_eq!(body["usage"]["total_tokens"], ids.len() + 7);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert!(!body["choices"][0]["text"].as_str().unwrap().is_empty());

    // The same prompt again: every full block but the last is served from the cache.
    let again = sim.post_json("/v1/completions", &completion(&prompt, 1)).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], (ids.len() - 1) / 16 * 16);

    // Token ids as the prompt, and a list of prompts.
    let by_ids = sim.post_json("/v1/completions", &json!({"prompt": ids, "max_tokens": 2})).await;
    assert_eq!(by_ids["usage"]["prompt_tokens"], ids.len());
    let two =
        sim.post_json("/v1/completions", &json!({"prompt": ["one two three", "four five"], "max_tokens": 2})).await;
    assert_eq!(two["choices"].as_array().unwrap().len(), 2);
    assert_eq!(two["usage"]["completion_tokens"], 4);

    // Chat: the template is applied (Qwen3 adds <|im_start|> etc.), and
    // max_completion_tokens wins over max_tokens.
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]);
    let chat_ids = sim.post_json("/tokenize", &json!({"messages": messages})).await;
    assert_eq!(chat_ids["tokens"][0], 151644, "<|im_start|>");
    let chat = sim
        .post_json("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 50, "max_completion_tokens": 4}))
        .await;
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["usage"]["prompt_tokens"], chat_ids["count"]);
    assert_eq!(chat["usage"]["completion_tokens"], 4);
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
}

#[tokio::test]
async fn streaming_sends_chunks_usage_and_done() {
    let sim = qwen3_sim("pod-s", &[]).await;
    let body = json!({"prompt": text("beta", 50), "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (chunks, done) = sse(sim.post("/v1/completions", &body).await).await;
    assert!(done);
    let text_chunks: Vec<&Value> = chunks.iter().filter(|c| !c["choices"].as_array().unwrap().is_empty()).collect();
    assert_eq!(text_chunks.len(), 5, "one chunk per token");
    assert_eq!(text_chunks[4]["choices"][0]["finish_reason"], "length");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 5);

    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true});
    let (chunks, done) = sse(sim.post("/v1/chat/completions", &chat).await).await;
    assert!(done);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "no usage without include_usage");
    let content: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert!(!content.is_empty());
}

#[tokio::test]
async fn bad_requests_get_openai_errors_from_the_pod() {
    let sim = qwen3_sim("pod-e", &["--max-model-len", "512"]).await;
    let client = reqwest::Client::new();
    let cases: Vec<(&str, &str, u16, &str)> = vec![
        ("/v1/completions", "{not json", 400, "not valid JSON"),
        ("/v1/completions", "[1, 2]", 400, "JSON object"),
        ("/v1/completions", r#"{"max_tokens": 3}"#, 400, "'prompt' is required"),
        ("/v1/completions", r#"{"prompt": {"a": 1}}"#, 400, "invalid request"),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": "many"}"#, 400, "invalid request"),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": 0}"#, 400, "max_tokens"),
        ("/v1/completions", r#"{"prompt": ""}"#, 400, "empty"),
        ("/v1/completions", r#"{"prompt": "x", "model": "other"}"#, 404, "does not exist"),
        ("/v1/chat/completions", r#"{"messages": []}"#, 400, "must not be empty"),
        ("/v1/chat/completions", r#"{"messages": [{"content": "x"}]}"#, 400, "role"),
        ("/v1/chat/completions", r#"{"prompt": "x"}"#, 400, "'messages' is required"),
        ("/v1/no-such-thing", "{}", 404, "no such endpoint"),
    ];
    for (path, body, status, message) in cases {
        let r = client.post(format!("{}{path}", sim.url)).body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{path} {body}");
        assert_eq!(r.headers()["x-kvgate-pod"], "pod-e");
        let err: Value = r.json().await.unwrap();
        let text = err["error"]["message"].as_str().unwrap_or_default();
        assert!(text.contains(message), "{path} {body}: {err}");
        assert_eq!(err["error"]["code"], status);
    }
    let long = sim.post("/v1/completions", &completion(&text("gamma", 400), 300)).await;
    assert_eq!(long.status(), 400);
    let err: Value = long.json().await.unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("maximum context length is 512"));
    assert!(sim.metric("kvgate_sim:http_errors_total").await >= 13.0);
}

#[tokio::test]
async fn models_health_and_metrics_speak_vllm() {
    let sim = qwen3_sim("pod-m", &["--num-blocks", "4000", "--block-size", "32", "--model", "m1"]).await;
    let models: Value = reqwest::get(format!("{}/v1/models", sim.url)).await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "m1");
    let health = reqwest::get(format!("{}/health", sim.url)).await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(health.headers()["x-kvgate-pod"], "pod-m");

    let prompt = text("delta", 200);
    for _ in 0..2 {
        sim.post_json("/v1/completions", &completion(&prompt, 2)).await;
    }
    let metrics = reqwest::get(format!("{}/metrics", sim.url)).await.unwrap().text().await.unwrap();
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_hits_total{",
        "vllm:prefix_cache_queries_total{",
    ] {
        assert!(metrics.contains(name), "{name} missing");
    }
    assert!(metrics.contains(r#"block_size="32""#) && metrics.contains(r#"num_gpu_blocks="4000""#));
    assert!(metrics.contains(r#"model_name="m1""#));
    let prompt_tokens = sim.tokenize(&prompt).await.len() as f64;
    assert_eq!(sim.metric("vllm:prefix_cache_queries_total").await, 2.0 * prompt_tokens);
    assert_eq!(sim.metric("vllm:prefix_cache_hits_total").await, ((prompt_tokens as usize - 1) / 32 * 32) as f64);
    assert_eq!(sim.metric("vllm:generation_tokens_total").await, 4.0);
    assert_eq!(sim.metric("vllm:kv_cache_usage_perc").await, 0.0, "nothing running");
}

#[tokio::test]
async fn a_full_batch_queues_requests_visibly() {
    // One sequence at a time, real-time clock: requests queue behind each other.
    let sim = Sim::start("pod-q", &["--max-num-seqs", "1", "--time-scale", "1"]).await;
    let url = sim.url.clone();
    let requests: Vec<_> = (0..3)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = completion(&format!("queue test {i}"), 40);
                reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await.unwrap()
            })
        })
        .collect();
    let mut max_waiting: f64 = 0.0;
    let mut max_running: f64 = 0.0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && !requests.iter().all(|r| r.is_finished()) {
        max_waiting = max_waiting.max(sim.metric("vllm:num_requests_waiting").await);
        max_running = max_running.max(sim.metric("vllm:num_requests_running").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for r in requests {
        assert_eq!(r.await.unwrap().status(), 200);
    }
    assert_eq!(max_running, 1.0);
    assert!(max_waiting >= 1.0, "requests beyond --max-num-seqs wait");
    assert!(sim.metric("vllm:kv_cache_usage_perc").await == 0.0);
}

/// Time to the first streamed token, client side.
async fn ttft(sim: &Sim, prompt: &str) -> Duration {
    let start = Instant::now();
    let body = json!({"prompt": prompt, "max_tokens": 2, "stream": true});
    let mut stream = sim.post("/v1/completions", &body).await.bytes_stream();
    stream.next().await.expect("first chunk").expect("bytes");
    let elapsed = start.elapsed();
    while stream.next().await.is_some() {}
    elapsed
}

#[tokio::test]
async fn a_cached_prefix_cuts_time_to_first_token() {
    // At time scale 0.2 a cold 6k-token prefill takes ≈ 55 ms, a cached one ≈ 1.3 ms.
    let sim = Sim::start("pod-t", &["--time-scale", "0.2"]).await;
    let prefix = text("epsilon", 4000);
    let cold = ttft(&sim, &format!("{prefix} first")).await;
    let warm = ttft(&sim, &format!("{prefix} second")).await;
    assert!(cold > Duration::from_millis(30), "cold prefill {cold:?}");
    assert!(warm * 3 < cold, "warm {warm:?} vs cold {cold:?}");
    let log = sim.requests().await;
    assert!(log[1]["cached_tokens"].as_u64().unwrap() > 5000);
}

#[tokio::test]
async fn sigterm_stops_the_pod_cleanly() {
    let mut sim = Sim::start("pod-k", &[]).await;
    let status = std::process::Command::new("kill").args(["-TERM", &sim.pid().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = sim.wait_exit(Duration::from_secs(10)).expect("exits after SIGTERM");
    assert!(exit.success(), "{exit:?}");
}

#[tokio::test]
async fn at_time_scale_zero_the_engine_never_waits() {
    // 2,000 decode steps: paced, each would wait for at least one of tokio's millisecond
    // timer ticks (seconds in all); at time scale 0 they run back to back. The bound only
    // keeps a broken engine from hanging the test.
    let tokenizer = qwen3_tokenizer();
    let sim = Sim::start("pod-i", &["--tokenizer", tokenizer.to_str().unwrap(), "--time-scale", "0"]).await;
    let answered = tokio::time::timeout(
        Duration::from_secs(30),
        sim.post("/v1/completions", &json!({"prompt": text("gamma", 40), "max_tokens": 2000})),
    )
    .await
    .expect("an instant engine answers");
    let body: Value = answered.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 2000);
}
