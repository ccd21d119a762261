//! Anthropic's Messages API answers, in the shapes vLLM's `/v1/messages` gives them: a
//! `message` object, or a stream of `message_start`, one text block's start, deltas and stop,
//! `message_delta` (stop reason and the whole usage) and `message_stop`.

use super::{AppState, ChoiceState, Job, apply, record};
use crate::driver::Emission;
use axum::response::sse::Event;
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

/// vLLM's mapping of a finish reason to Anthropic's stop reason.
fn stop_reason(choice: &ChoiceState) -> Option<&'static str> {
    match choice.finish_reason? {
        "length" => Some("max_tokens"),
        _ => Some("end_turn"),
    }
}

/// Anthropic's usage: `input_tokens` excludes the cached ones, reported apart.
fn usage(choice: &ChoiceState) -> Value {
    let u = &choice.usage;
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

fn id(job: &Job) -> String {
    format!("msg_{}", job.request_id)
}

/// The whole answer.
pub(super) fn body(state: &AppState, job: &Job, choice: &ChoiceState) -> Value {
    json!({
        "id": id(job),
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": choice.text}],
        "model": state.pod.model,
        "stop_reason": stop_reason(choice),
        "stop_sequence": null,
        "usage": usage(choice),
    })
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// The answer as it is generated; the message starts with its first token, as vLLM's does.
pub(super) fn events(
    state: Arc<AppState>,
    job: Arc<Job>,
    emissions: impl Stream<Item = (usize, Emission)> + Send + 'static,
    started: Instant,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let mut choice = ChoiceState::default();
    emissions
        .map(move |(_, emission)| {
            let piece = state.filler_text.get(&emission.token).cloned().unwrap_or_default();
            let first = choice.first_token.is_none();
            apply(&mut choice, &piece, emission);
            let mut events = Vec::with_capacity(4);
            if first {
                // The prompt's size is known here, its cached part only at the end (vLLM, too,
                // leaves out what a chunk has not carried yet).
                let mut message = body(&state, &job, &choice);
                message["content"] = json!([]);
                message["stop_reason"] = Value::Null;
                message["usage"] = json!({"input_tokens": job.prompts[0].len(), "output_tokens": 0});
                events.push(event("message_start", json!({"type": "message_start", "message": message})));
                events.push(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ));
            }
            if !piece.is_empty() {
                events.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}),
                ));
            }
            if choice.finish_reason.is_some() {
                record(&state, &job, std::slice::from_ref(&choice), started);
                events.push(event("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                events.push(event(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(&choice), "stop_sequence": null},
                           "usage": usage(&choice)}),
                ));
                events.push(event("message_stop", json!({"type": "message_stop"})));
            }
            futures::stream::iter(events.into_iter().map(Ok))
        })
        .flatten()
}
