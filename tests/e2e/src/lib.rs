//! Shared pieces of kvgate's end-to-end tools (`kvgate-demo`, `kvgate-overhead`): sending
//! OpenAI requests through a gateway and measuring them from the client's side.

pub mod failover;

use futures::StreamExt;
use serde_json::Value;
use std::time::{Duration, Instant};

/// One request as the client saw it.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub status: u16,
    /// `x-kvgate-pod` of the pod that answered.
    pub pod: Option<String>,
    /// Time to the first generated text (streaming) or to the whole answer (non-streaming).
    pub ttft: Duration,
    pub total: Duration,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The generated text (for multi-turn conversations).
    pub text: String,
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
    let pod = response.headers().get("x-kvgate-pod").and_then(|v| v.to_str().ok()).map(str::to_string);
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
    for line in text.lines().map(|l| l.trim_start_matches("data: ")).filter(|l| l.starts_with('{')) {
        let Ok(json) = serde_json::from_str::<Value>(line) else { continue };
        if let Some(usage) = json.get("usage").filter(|u| u.is_object()) {
            out.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
            out.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        }
        for choice in json["choices"].as_array().into_iter().flatten() {
            for piece in [&choice["delta"]["content"], &choice["text"], &choice["message"]["content"]] {
                if let Some(s) = piece.as_str() {
                    out.text.push_str(s);
                }
            }
        }
    }
    out
}

/// True once a chunk carries generated text: a non-empty `"content"` (chat) or `"text"`
/// (completions) string. The role-only first chunk of a chat stream does not count.
pub fn has_generated_text(buffer: &[u8]) -> bool {
    [&b"\"content\":\""[..], b"\"text\":\""].iter().any(|key| {
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
    }

    #[test]
    fn percentiles() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(percentile(&mut v, 0.5), Duration::from_millis(51));
        assert_eq!(percentile(&mut v, 0.9), Duration::from_millis(90));
        assert_eq!(percentile(&mut [], 0.5), Duration::ZERO);
    }
}
