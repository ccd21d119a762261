//! Anthropic's Messages API answers, in the shapes vLLM's `/v1/messages` gives them: a
//! `message` object, or a stream of `message_start`, one text block's start, deltas and stop,
//! `message_delta` (stop reason and the whole usage) and `message_stop`.

use super::{AppState, ChoiceState, Frame, Job, named_event};
use axum::response::sse::Event;
use serde_json::{Value, json};

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

/// The whole answer.
pub(super) fn body(state: &AppState, job: &Job, choice: &ChoiceState) -> Value {
    json!({
        "id": format!("msg_{}", job.request_id),
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": choice.text}],
        "model": state.pod.model,
        "stop_reason": stop_reason(choice),
        "stop_sequence": null,
        "usage": usage(choice),
    })
}

/// The stream's events at each point of the answer.
pub(super) fn frame(state: &AppState, job: &Job, choice: &ChoiceState, frame: Frame) -> Vec<Event> {
    match frame {
        Frame::Start => {
            // The prompt's size is known here, its cached part only at the end (vLLM, too,
            // leaves out what a chunk has not carried yet).
            let mut message = body(state, job, choice);
            message["content"] = json!([]);
            message["stop_reason"] = Value::Null;
            message["usage"] = json!({"input_tokens": job.prompts[0].len(), "output_tokens": 0});
            vec![
                named_event("message_start", json!({"type": "message_start", "message": message})),
                named_event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                ),
            ]
        }
        Frame::Delta(piece) => vec![named_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}),
        )],
        Frame::End => vec![
            named_event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            named_event(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(choice), "stop_sequence": null},
                       "usage": usage(choice)}),
            ),
            named_event("message_stop", json!({"type": "message_stop"})),
        ],
    }
}
