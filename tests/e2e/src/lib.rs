//! Shared pieces of kvgate's end-to-end tools (`kvgate-demo`, `kvgate-overhead`): sending
//! requests through a gateway (OpenAI completions, chat and responses, Anthropic messages) and
//! measuring them from the client's side.

pub mod collector;
pub mod failover;
pub mod path;
pub mod sim_check;

use futures::StreamExt;
use serde_json::Value;
use std::time::{Duration, Instant};

/// A bootstrap's virtual host changed to name, in each response, the upstream Envoy reached
/// (`x-kvgate-upstream: ip:port`): real engines do not say who they are, as simulated pods do.
pub fn name_the_upstream(bootstrap: String) -> String {
    let routes = "              routes:\n";
    assert!(bootstrap.contains(routes), "no virtual host's routes in the bootstrap");
    bootstrap.replacen(
        routes,
        "              response_headers_to_add:\n              - header: {key: x-kvgate-upstream, value: \"%UPSTREAM_HOST%\"}\n              routes:\n",
        1,
    )
}

/// One request as the client saw it.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub status: u16,
    /// `x-kvgate-pod` of the pod that answered (a simulated one), else the address Envoy
    /// reached, where its bootstrap names it in `x-kvgate-upstream` ([`name_the_upstream`]).
    pub pod: Option<String>,
    /// Time to the first generated text (streaming) or to the whole answer (non-streaming).
    pub ttft: Duration,
    pub total: Duration,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The generated text (for multi-turn conversations).
    pub text: String,
    /// The body of an error answer.
    pub error: Option<String>,
}

/// Each of `bodies` sent to `url`, `in_flight` at a time; each measured, in sending order.
pub async fn send_each(client: &reqwest::Client, url: &str, bodies: Vec<Value>, in_flight: usize) -> Vec<Measured> {
    let n = bodies.len();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(in_flight));
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let (client, url, gate) = (client.clone(), url.to_string(), gate.clone());
            tokio::spawn(async move {
                let _permit = gate.acquire().await.expect("semaphore");
                send(&client, &url, &body).await
            })
        })
        .collect();
    let mut measured = Vec::with_capacity(n);
    for task in tasks {
        measured.push(task.await.expect("request task"));
    }
    measured
}

/// Sends `body` to `url` and measures it. Streaming bodies are read chunk by chunk: TTFT is
/// the arrival of the first chunk carrying generated text.
pub async fn send(client: &reqwest::Client, url: &str, body: &Value) -> Measured {
    let start = Instant::now();
    let response = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(_) => return Measured { status: 0, total: start.elapsed(), ..Default::default() },
    };
    let status = response.status().as_u16();
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let pod = header("x-kvgate-pod").or_else(|| header("x-kvgate-upstream"));
    let mut out = Measured { status, pod, ..Default::default() };
    let mut buffer = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        buffer.extend_from_slice(&chunk);
        if out.ttft.is_zero() && has_generated_text(&buffer) {
            out.ttft = start.elapsed();
        }
    }
    out.total = start.elapsed();
    if out.ttft.is_zero() {
        out.ttft = out.total;
    }
    let text = String::from_utf8_lossy(&buffer);
    if status >= 400 {
        out.error = Some(text.to_string());
    }
    for line in text.lines().map(|l| l.trim_start_matches("data: ")).filter(|l| l.starts_with('{')) {
        let Ok(json) = serde_json::from_str::<Value>(line) else { continue };
        read_chunk(&json, &mut out);
    }
    out
}

/// What one answer (or streamed chunk) of any routed API says: its usage and its text.
fn read_chunk(json: &Value, out: &mut Measured) {
    let usage = json.get("usage").or_else(|| json["response"].get("usage")).filter(|u| u.is_object());
    if let Some(usage) = usage {
        let count = |v: &Value| v.as_u64().unwrap_or(0);
        if usage.get("prompt_tokens").is_some() {
            // OpenAI completions and chat.
            out.prompt_tokens = count(&usage["prompt_tokens"]);
            out.cached_tokens = count(&usage["prompt_tokens_details"]["cached_tokens"]);
        } else if usage.get("input_tokens_details").is_some() {
            // OpenAI responses: input tokens count the cached ones.
            out.prompt_tokens = count(&usage["input_tokens"]);
            out.cached_tokens = count(&usage["input_tokens_details"]["cached_tokens"]);
        } else {
            // Anthropic messages: input tokens leave the cached ones out.
            out.cached_tokens = count(&usage["cache_read_input_tokens"]);
            out.prompt_tokens = count(&usage["input_tokens"]) + out.cached_tokens;
        }
    }
    let mut push = |piece: &Value| {
        if let Some(s) = piece.as_str() {
            out.text.push_str(s);
        }
    };
    for choice in json["choices"].as_array().into_iter().flatten() {
        for piece in [&choice["delta"]["content"], &choice["text"], &choice["message"]["content"]] {
            push(piece);
        }
    }
    match (json["type"].as_str(), json["object"].as_str()) {
        (Some("content_block_delta"), _) => push(&json["delta"]["text"]),
        (Some("response.output_text.delta"), _) => push(&json["delta"]),
        (Some("message"), _) => json["content"].as_array().into_iter().flatten().for_each(|b| push(&b["text"])),
        (_, Some("response")) => json["output"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|item| item["content"].as_array().into_iter().flatten())
            .for_each(|part| push(&part["text"])),
        _ => {}
    }
}

/// True once a chunk carries generated text: a non-empty `"content"` (chat), `"text"`
/// (completions, messages) or `"delta"` (responses) string. The role-only first chunk of a
/// chat stream, and the empty text a message's or response's stream opens with, do not count.
pub fn has_generated_text(buffer: &[u8]) -> bool {
    [&b"\"content\":\""[..], b"\"text\":\"", b"\"delta\":\""].iter().any(|key| {
        buffer
            .windows(key.len())
            .enumerate()
            .any(|(i, w)| w == *key && buffer.get(i + key.len()).is_some_and(|&c| c != b'"'))
    })
}

/// The `p`-quantile (0–1) of `samples` (sorted in place); zero for none.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

/// Milliseconds with two decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_text_is_told_from_the_role_chunk() {
        assert!(!has_generated_text(br#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#));
        assert!(has_generated_text(br#"data: {"choices":[{"delta":{"content":" The"}}]}"#));
        assert!(has_generated_text(br#"data: {"choices":[{"text":" The"}]}"#));
        assert!(!has_generated_text(br#"data: {"choices":[{"text":""}]}"#));
        let block_start =
            br#"data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#;
        assert!(!has_generated_text(block_start));
        assert!(has_generated_text(
            br#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" The"}}"#
        ));
        assert!(!has_generated_text(br#"data: {"type":"response.content_part.added","part":{"text":""}}"#));
        assert!(has_generated_text(br#"data: {"type":"response.output_text.delta","delta":" The"}"#));
    }

    #[test]
    fn usage_and_text_are_read_from_every_api() {
        let read = |chunks: &[Value]| {
            let mut out = Measured::default();
            chunks.iter().for_each(|c| read_chunk(c, &mut out));
            (out.prompt_tokens, out.cached_tokens, out.text)
        };
        let messages = [
            serde_json::json!({"type": "message_start", "message": {"usage": {"input_tokens": 90, "output_tokens": 0}}}),
            serde_json::json!({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}),
            serde_json::json!({"type": "message_delta", "usage": {"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 80}}),
        ];
        assert_eq!(read(&messages), (90, 80, "Hi".into()));
        let responses = [
            serde_json::json!({"type": "response.output_text.delta", "delta": "Hi"}),
            serde_json::json!({"type": "response.output_text.done", "text": "Hi"}),
            serde_json::json!({"type": "response.completed", "response": {"usage": {"input_tokens": 90,
                "input_tokens_details": {"cached_tokens": 80}, "output_tokens": 1}, "output": [{"content": [{"text": "Hi"}]}]}}),
        ];
        assert_eq!(read(&responses), (90, 80, "Hi".into()));
        let whole = serde_json::json!({"object": "response", "output": [{"content": [{"type": "output_text", "text": "Yo"}]}],
            "usage": {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}}});
        assert_eq!(read(&[whole]), (5, 0, "Yo".into()));
    }

    #[test]
    fn percentiles() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(percentile(&mut v, 0.5), Duration::from_millis(51));
        assert_eq!(percentile(&mut v, 0.9), Duration::from_millis(90));
        assert_eq!(percentile(&mut [], 0.5), Duration::ZERO);
    }
}
