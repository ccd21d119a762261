//! The OpenAI Responses API (`POST /v1/responses`) as vLLM serves it to chat-template models:
//! the request turned into the chat conversation, tools and template options vLLM renders
//! (vLLM 0.33, `construct_input_messages` and `construct_tool_dicts` after
//! `ResponsesRequest`'s input parsing):
//!
//! - `instructions` become a leading system message; a string `input` one user message;
//! - input items with a `role` go in as chat messages (an assistant's: its first text), an
//!   assistant message `"status": "in_progress"` or `"incomplete"` last is continued rather than
//!   answered;
//! - `function_call` items become tool calls and `reasoning` items the reasoning of the assistant
//!   message before them (or a new one), `function_call_output` items tool messages;
//! - function tools (and the functions of namespace tools, named `namespace__name`) go to the
//!   template; tools the model is never shown (web search, file search, MCP…) are dropped;
//! - `reasoning.effort` sets the reasoning effort.
//!
//! What kvgate cannot render as the pod would is refused with a 400 rather than guessed:
//! `previous_response_id` (the history is stored on a pod), encrypted reasoning, custom tools.

use crate::{ChatOptions, TokenizeError};
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// A Responses request: the fields that shape the prompt or the request's cost.
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub tools: Vec<Map<String, Value>>,
    pub reasoning: Option<Reasoning>,
    pub previous_response_id: Option<String>,
    pub prompt: Option<Value>,
    pub stream: Option<bool>,
    pub cache_salt: Option<String>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Map<String, Value>>),
}

#[derive(Debug, Deserialize)]
pub struct Reasoning {
    pub effort: Option<ReasoningEffort>,
}

#[derive(Debug, Deserialize, Clone, Copy, strum::IntoStaticStr)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum ReasoningEffort {
    None,
    Minimal,
    Low,
    Medium,
    High,
    Xhigh,
}

fn refuse<T>(message: impl Into<String>) -> Result<T, TokenizeError> {
    Err(TokenizeError::Request(message.into()))
}

impl ResponsesRequest {
    /// The chat conversation and template options vLLM renders for this request.
    pub fn to_chat(&self) -> Result<(Vec<Value>, ChatOptions), TokenizeError> {
        if self.previous_response_id.is_some() {
            return refuse(
                "'previous_response_id' is not supported: the history it names is stored on one pod, \
                 where kvgate cannot read it; send the conversation in 'input'",
            );
        }
        if self.prompt.as_ref().is_some_and(|p| !p.is_null()) {
            return refuse("prompt template is not supported");
        }
        if self.cache_salt.as_ref().is_some_and(|s| s.is_empty() || s.len() > 1024) {
            return refuse("'cache_salt' must be 1 to 1024 characters");
        }
        let mut messages = Vec::new();
        if let Some(instructions) = self.instructions.as_deref().filter(|i| !i.is_empty()) {
            messages.push(json!({"role": "system", "content": instructions}));
        }
        let mut continue_final = false;
        match &self.input {
            Input::Text(text) => messages.push(json!({"role": "user", "content": text})),
            Input::Items(items) => {
                for item in items {
                    add_item(item, &mut messages)?;
                }
                continue_final = items.last().is_some_and(is_partial);
            }
        }
        let options = ChatOptions {
            add_generation_prompt: !continue_final,
            continue_final_message: continue_final,
            tools: tool_definitions(&self.tools)?,
            template_kwargs: self.chat_template_kwargs.clone(),
            reasoning_effort: self.reasoning.as_ref().and_then(|r| r.effort).map(|e| <&str>::from(e).to_owned()),
        };
        Ok((messages, options))
    }
}

fn field<'a>(item: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    item.get(key).and_then(Value::as_str)
}

fn required<'a>(item: &'a Map<String, Value>, kind: &str, key: &str) -> Result<&'a str, TokenizeError> {
    field(item, key).ok_or_else(|| TokenizeError::Request(format!("{kind} input items need a string '{key}'")))
}

/// An assistant message or reasoning item the client leaves unfinished, for the model to
/// continue.
fn is_partial(item: &Map<String, Value>) -> bool {
    matches!(field(item, "type").unwrap_or("message"), "message" | "reasoning")
        && matches!(field(item, "status"), Some("in_progress" | "incomplete"))
}

/// The assistant message `messages` ends with, if it does.
fn last_assistant(messages: &mut [Value]) -> Option<&mut Map<String, Value>> {
    messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// Sets `key` on the assistant message `messages` ends with if it has none yet; else adds a new
/// assistant message with it.
fn merge_into_assistant(messages: &mut Vec<Value>, key: &str, value: Value) {
    if let Some(last) = last_assistant(messages).filter(|m| m.get(key).is_none_or(Value::is_null)) {
        last.insert(key.into(), value);
        return;
    }
    messages.push(json!({"role": "assistant", key: value}));
}

fn add_item(item: &Map<String, Value>, messages: &mut Vec<Value>) -> Result<(), TokenizeError> {
    match field(item, "type") {
        Some("function_call") => {
            let name = required(item, "function_call", "name")?;
            let name = match field(item, "namespace") {
                Some(namespace) => format!("{namespace}__{name}"),
                None => name.to_owned(),
            };
            let call = json!({
                "id": required(item, "function_call", "call_id")?,
                "function": {"name": name, "arguments": required(item, "function_call", "arguments")?},
                "type": "function",
            });
            match last_assistant(messages) {
                Some(last) => match last.get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => {
                        last.insert("tool_calls".into(), json!([call]));
                    }
                },
                None => messages.push(json!({"role": "assistant", "tool_calls": [call]})),
            }
        }
        Some("reasoning") => {
            if item.get("encrypted_content").is_some_and(|c| !c.is_null()) {
                return refuse("Encrypted content is not supported.");
            }
            let first_text = |key: &str| -> Result<Option<String>, TokenizeError> {
                match item.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::Array(parts)) => match parts.first() {
                        None => Ok(None),
                        Some(part) => match part.get("text").and_then(Value::as_str) {
                            Some(text) => Ok(Some(text.to_owned())),
                            None => refuse(format!("reasoning '{key}' parts need a string 'text'")),
                        },
                    },
                    Some(_) => refuse(format!("reasoning '{key}' must be a list")),
                }
            };
            if !item.get("summary").is_some_and(Value::is_array) {
                return refuse("reasoning input items need a 'summary' list");
            }
            let reasoning = match first_text("content")? {
                Some(text) => text,
                None => first_text("summary")?.unwrap_or_default(),
            };
            merge_into_assistant(messages, "reasoning", reasoning.into());
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            let output = item
                .get("output")
                .filter(|o| o.is_string() || o.is_array())
                .ok_or_else(|| TokenizeError::Request("function_call_output input items need an 'output'".into()))?;
            messages.push(json!({
                "role": "tool",
                "content": output,
                "tool_call_id": required(item, "function_call_output", "call_id")?,
            }));
        }
        Some("custom_tool_call") => return refuse("custom tool calls are not supported by kvgate"),
        Some(kind) if kind != "message" => return refuse(format!("Unsupported input item type: {kind}")),
        _ => add_message(item, messages)?,
    }
    Ok(())
}

/// An input item with a role (a message).
fn add_message(item: &Map<String, Value>, messages: &mut Vec<Value>) -> Result<(), TokenizeError> {
    let role = match field(item, "role") {
        Some(role @ ("user" | "assistant" | "system" | "developer")) => role,
        Some(other) => {
            return refuse(format!("input messages have role user, assistant, system or developer, not '{other}'"));
        }
        None => return refuse("input messages need a 'role'"),
    };
    let content = item
        .get("content")
        .filter(|c| c.is_string() || c.is_array())
        .ok_or_else(|| TokenizeError::Request("input messages need a 'content' string or list".into()))?;
    if role != "assistant" {
        messages.push(Value::Object(item.clone()));
        return Ok(());
    }
    // An assistant's message counts by its first part's text.
    let text = match content {
        Value::String(text) => Some(text.as_str()),
        Value::Array(parts) => match parts.first() {
            None => None,
            Some(part) => Some(part.get("text").and_then(Value::as_str).ok_or_else(|| {
                TokenizeError::Request("an assistant message's first content part needs a 'text'".into())
            })?),
        },
        _ => unreachable!("checked above"),
    };
    match text {
        Some(text) => merge_into_assistant(messages, "content", text.into()),
        None => messages.push(Value::Object(item.clone())),
    }
    Ok(())
}

/// The function tools as vLLM hands them to the template; `None` without any tool.
fn tool_definitions(tools: &[Map<String, Value>]) -> Result<Option<Value>, TokenizeError> {
    if tools.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        match field(tool, "type") {
            Some("function") => out.push(function_definition(tool, None)?),
            Some("namespace") => {
                let namespace = required(tool, "namespace tool", "name")?;
                let inner = tool
                    .get("tools")
                    .and_then(Value::as_array)
                    .ok_or_else(|| TokenizeError::Request("namespace tools need a 'tools' list".into()))?;
                for function in inner.iter().filter_map(Value::as_object) {
                    if field(function, "type") == Some("function") {
                        out.push(function_definition(function, Some(namespace))?);
                    }
                }
            }
            Some("custom") => return refuse("custom tools are not supported by kvgate"),
            Some(_) => {} // never shown to the model
            None => return refuse("tools need a 'type'"),
        }
    }
    Ok(Some(Value::Array(out)))
}

fn function_definition(tool: &Map<String, Value>, namespace: Option<&str>) -> Result<Value, TokenizeError> {
    let name = required(tool, "function tool", "name")?;
    let mut function = Map::new();
    function.insert(
        "name".into(),
        match namespace {
            Some(namespace) => format!("{namespace}__{name}").into(),
            None => name.into(),
        },
    );
    function.insert("description".into(), tool.get("description").cloned().unwrap_or(Value::Null));
    function.insert("parameters".into(), tool.get("parameters").cloned().unwrap_or(Value::Null));
    for key in ["strict", "defer_loading"] {
        if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), value.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<(Vec<Value>, ChatOptions), TokenizeError> {
        serde_json::from_value::<ResponsesRequest>(body).map_err(|e| TokenizeError::Request(e.to_string()))?.to_chat()
    }

    #[test]
    fn instructions_and_a_string_input() {
        let (messages, options) = chat(json!({"instructions": "Be terse.", "input": "hi"})).unwrap();
        assert_eq!(
            messages,
            [json!({"role": "system", "content": "Be terse."}), json!({"role": "user", "content": "hi"})]
        );
        assert!(options.add_generation_prompt && options.tools.is_none());
    }

    #[test]
    fn calls_and_reasoning_join_the_assistant_turn_before_them() {
        let (messages, options) = chat(json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "21"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "so warm"}]}],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}, {"type": "web_search"}],
            "reasoning": {"effort": "low"}}))
        .unwrap();
        assert_eq!(messages[1]["content"], "checking");
        assert_eq!(messages[1]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(messages[2], json!({"role": "tool", "content": "21", "tool_call_id": "c1"}));
        assert_eq!(messages[3], json!({"role": "assistant", "reasoning": "so warm"}));
        assert_eq!(
            options.tools.unwrap(),
            json!([{"type": "function", "function": {"name": "weather", "description": null, "parameters": {"type": "object"}}}])
        );
        assert_eq!(options.reasoning_effort.as_deref(), Some("low"));
    }

    #[test]
    fn an_unfinished_assistant_message_is_continued() {
        let (_, options) = chat(json!({"input": [{"role": "user", "content": "haiku"},
            {"type": "message", "role": "assistant", "status": "in_progress", "content": [{"type": "output_text", "text": "Autumn"}]}]}))
        .unwrap();
        assert!(options.continue_final_message && !options.add_generation_prompt);
    }

    #[test]
    fn what_cannot_be_rendered_is_refused() {
        for (body, want) in [
            (json!({"input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
            (json!({"input": [{"type": "file_search_call", "id": "f"}]}), "Unsupported input item type"),
            (json!({"input": [{"role": "tool", "content": "x"}]}), "not 'tool'"),
            (json!({"input": [{"type": "function_call", "name": "f"}]}), "'call_id'"),
            (json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}), "Encrypted"),
            (json!({"input": "x", "tools": [{"type": "custom", "name": "c"}]}), "custom tools"),
            (json!({"input": "x", "reasoning": {"effort": "extreme"}}), "unknown variant"),
            (json!({"instructions": "x"}), "missing field `input`"),
        ] {
            let e = chat(body.clone()).unwrap_err().to_string();
            assert!(e.contains(want), "{body}: {e}");
        }
    }
}
