//! OpenAI Responses API answers, in the shapes vLLM's `/v1/responses` gives them: a `response`
//! object, or a stream of `response.created`, `response.in_progress`, the output message's item
//! and text part added, text deltas, their done events and `response.completed` (with usage).

use super::{AppState, ChoiceState, Frame, Job, named_event};
use axum::response::sse::Event;
use serde_json::{Value, json};

fn message_id(job: &Job) -> String {
    format!("msg_{}", job.request_id)
}

fn output_text(choice: &ChoiceState) -> Value {
    json!({"type": "output_text", "text": choice.text, "annotations": []})
}

fn message(job: &Job, status: &str, content: Value) -> Value {
    json!({"id": message_id(job), "type": "message", "role": "assistant", "status": status, "content": content})
}

/// The response object; `done`: with its output, status and usage.
fn response(state: &AppState, job: &Job, choice: &ChoiceState, done: bool) -> Value {
    let incomplete = choice.finish_reason == Some("length");
    let status = match (done, incomplete) {
        (false, _) => "in_progress",
        (true, false) => "completed",
        (true, true) => "incomplete",
    };
    let u = &choice.usage;
    json!({
        "id": format!("resp_{}", job.request_id),
        "object": "response",
        "created_at": super::unix_now() as u64,
        "model": state.pod.model,
        "status": status,
        "incomplete_details": if done && incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "output": if done { json!([message(job, "completed", json!([output_text(choice)]))]) } else { json!([]) },
        "usage": if done { json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }) } else { Value::Null },
    })
}

/// The whole answer.
pub(super) fn body(state: &AppState, job: &Job, choice: &ChoiceState) -> Value {
    response(state, job, choice, true)
}

/// The stream's events at each point of the answer (numbered as they go).
pub(super) fn frame(state: &AppState, job: &Job, choice: &ChoiceState, frame: Frame, sequence: &mut u64) -> Vec<Event> {
    let item_id = message_id(job);
    let mut out = Vec::with_capacity(4);
    let mut push = |kind: &str, mut data: Value| {
        data["type"] = kind.into();
        data["sequence_number"] = (*sequence).into();
        *sequence += 1;
        out.push(named_event(kind, data));
    };
    let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
    match frame {
        Frame::Start => {
            push("response.created", json!({"response": response(state, job, choice, false)}));
            push("response.in_progress", json!({"response": response(state, job, choice, false)}));
            push(
                "response.output_item.added",
                json!({"output_index": 0, "item": message(job, "in_progress", json!([]))}),
            );
            push(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part("")}),
            );
        }
        Frame::Delta(piece) => push(
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []}),
        ),
        Frame::End => {
            let text = choice.text.as_str();
            push(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            );
            push(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part(text)}),
            );
            push(
                "response.output_item.done",
                json!({"output_index": 0, "item": message(job, "completed", json!([output_text(choice)]))}),
            );
            push("response.completed", json!({"response": response(state, job, choice, true)}));
        }
    }
    out
}
