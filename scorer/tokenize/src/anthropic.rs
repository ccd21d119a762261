//! The Anthropic Messages API (`POST /v1/messages`) as vLLM serves it: the request read and
//! validated as vLLM's `AnthropicMessagesRequest` reads it, then turned into the chat
//! conversation, tools and template options vLLM renders (vLLM 0.33,
//! `AnthropicServingMessages.to_chat_completion_request`):
//!
//! - the top-level `system` (a string, or text blocks concatenated) becomes a leading system
//!   message; Claude Code's `x-anthropic-billing-header` blocks are dropped (their per-request
//!   hash would defeat prefix caching);
//! - system messages inside `messages` stay where they are, unless the chat template requires
//!   the system message first: then they are appended to the leading one;
//! - text blocks become text parts, `thinking` blocks the message's reasoning, `tool_use`
//!   blocks tool calls, and a user's `tool_result` blocks tool messages placed before it;
//! - tools become functions (`input_schema` → `parameters`, given `"type": "object"` when it has
//!   no type); `tool_addition`/`tool_removal` blocks in system messages edit that list;
//! - `thinking: {"type": "disabled"}` and `output_config.effort` set the reasoning effort.

use crate::{ChatOptions, TokenizeError};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::borrow::Cow;

/// A Messages request: the fields that shape the prompt or the request's cost.
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub max_tokens: i64,
    pub system: Option<Content>,
    pub tools: Option<Vec<Tool>>,
    pub thinking: Option<Thinking>,
    pub output_config: Option<OutputConfig>,
    pub stream: Option<bool>,
    pub cache_salt: Option<String>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
    System,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Content,
}

/// A message's (or the system prompt's) content: a string or a list of blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

impl Content {
    /// Its blocks (none for a string).
    pub fn blocks(&self) -> &[Block] {
        match self {
            Content::Blocks(blocks) => blocks,
            Content::Text(_) => &[],
        }
    }
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BlockType {
    Text,
    Image,
    ToolUse,
    ToolResult,
    ToolReference,
    Thinking,
    RedactedThinking,
    ToolAddition,
    ToolRemoval,
}

/// A content block (one struct for every type, as vLLM's model has it).
#[derive(Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: BlockType,
    pub text: Option<String>,
    pub source: Option<Map<String, Value>>,
    pub id: Option<String>,
    pub tool_use_id: Option<String>,
    pub name: Option<String>,
    pub input: Option<Map<String, Value>>,
    pub content: Option<ToolResultContent>,
    pub thinking: Option<String>,
    pub tool: Option<ToolChange>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolResultContent {
    Text(String),
    Items(Vec<Map<String, Value>>),
}

#[derive(Debug, Deserialize, Clone)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Map<String, Value>,
    pub strict: Option<bool>,
    pub defer_loading: Option<bool>,
}

/// What a `tool_addition`/`tool_removal` block names: a declared tool, or a new definition.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChange {
    ToolReference { name: String },
    ToolDefinition { definition: Tool },
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Thinking {
    Enabled { budget_tokens: i64 },
    Disabled,
    Adaptive,
}

#[derive(Debug, Deserialize)]
pub struct OutputConfig {
    pub effort: Option<Effort>,
}

/// Anthropic's effort levels, passed to the template as `reasoning_effort`.
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::VariantArray)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Effort {
    Low,
    Medium,
    High,
    Xhigh,
    Max,
}

/// What a chat template needs to know to render Messages requests as vLLM does (vLLM probes the
/// template once for each; see [`crate::ChatTemplate`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct TemplateTraits {
    /// The template rejects a system message after the first: inline system messages are
    /// merged into the leading one.
    pub requires_leading_system: bool,
    /// The template renders `reasoning_effort: "none"` like some effort (or fails on it): a
    /// disabled thinking is sent as `"low"` instead.
    pub disabled_thinking_is_low: bool,
}

/// Claude Code's per-request attribution block, which vLLM drops from system prompts.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

impl MessagesRequest {
    /// Checks what vLLM's request model checks.
    pub fn validate(&self) -> Result<(), TokenizeError> {
        let bad = |m: &str| Err(TokenizeError::Request(m.into()));
        if self.model.is_empty() {
            return bad("'model' is required");
        }
        if self.max_tokens <= 0 {
            return bad("'max_tokens' must be positive");
        }
        if let Some(Thinking::Enabled { budget_tokens }) = self.thinking {
            if budget_tokens < 1024 {
                return bad("'thinking.budget_tokens' must be at least 1024");
            }
            if budget_tokens >= self.max_tokens {
                return bad("'thinking.budget_tokens' must be less than 'max_tokens'");
            }
        }
        let system_blocks = self.system.iter().flat_map(Content::blocks).map(|b| (Role::User, b));
        let message_blocks = self.messages.iter().flat_map(|m| m.content.blocks().iter().map(move |b| (m.role, b)));
        for (role, block) in system_blocks.chain(message_blocks) {
            if !matches!(block.kind, BlockType::ToolAddition | BlockType::ToolRemoval) {
                continue;
            }
            let kind = if block.kind == BlockType::ToolAddition { "tool_addition" } else { "tool_removal" };
            match (&block.tool, role) {
                (None, _) => return Err(TokenizeError::Request(format!("'tool' is required for {kind} blocks"))),
                (Some(_), Role::User | Role::Assistant) => {
                    return Err(TokenizeError::Request(format!(
                        "{kind} blocks are only allowed in messages with role \"system\""
                    )));
                }
                (Some(ToolChange::ToolDefinition { .. }), _) if block.kind == BlockType::ToolRemoval => {
                    return bad("tool_removal only accepts a tool_reference");
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The chat conversation and template options vLLM renders for this request.
    pub fn to_chat(&self, traits: TemplateTraits) -> Result<(Vec<Value>, ChatOptions), TokenizeError> {
        self.validate()?;
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        let mut system = String::new();
        match &self.system {
            Some(Content::Text(text)) => system.push_str(text),
            Some(Content::Blocks(blocks)) => system.push_str(&system_text(blocks).unwrap_or_default()),
            None => {}
        }
        if traits.requires_leading_system {
            for message in self.messages.iter().filter(|m| m.role == Role::System) {
                system.push_str(&message_system_text(&message.content).unwrap_or_default());
            }
        }
        if !system.is_empty() {
            messages.push(json!({"role": "system", "content": system}));
        }
        for message in &self.messages {
            if message.role == Role::System {
                if let Some(text) = message_system_text(&message.content).filter(|_| !traits.requires_leading_system) {
                    messages.push(json!({"role": "system", "content": text}));
                }
                continue;
            }
            let mut converted = Map::new();
            converted.insert("role".into(), <&str>::from(message.role).into());
            match &message.content {
                Content::Text(text) => {
                    converted.insert("content".into(), text.as_str().into());
                }
                Content::Blocks(blocks) => convert_blocks(blocks, message.role, &mut converted, &mut messages)?,
            }
            // A user turn of nothing but tool results adds no user message.
            if message.role != Role::User || converted.contains_key("content") {
                messages.push(Value::Object(converted));
            }
        }
        let reasoning_effort = match (&self.thinking, &self.output_config) {
            (Some(Thinking::Disabled), _) => Some(if traits.disabled_thinking_is_low { "low" } else { "none" }),
            (_, Some(OutputConfig { effort: Some(effort) })) => Some(effort.into()),
            _ => None,
        };
        let options = ChatOptions {
            add_generation_prompt: true,
            continue_final_message: false,
            tools: self.resolved_tools()?.map(|tools| Value::Array(tools.iter().map(tool_definition).collect())),
            template_kwargs: self.chat_template_kwargs.clone(),
            reasoning_effort: reasoning_effort.map(str::to_owned),
        };
        Ok((messages, options))
    }

    /// `tools` as edited by the `tool_addition`/`tool_removal` blocks of the conversation: the
    /// tools in effect at its end.
    fn resolved_tools(&self) -> Result<Option<Cow<'_, [Tool]>>, TokenizeError> {
        let changes: Vec<&Block> = self
            .messages
            .iter()
            .flat_map(|m| m.content.blocks())
            .filter(|b| matches!(b.kind, BlockType::ToolAddition | BlockType::ToolRemoval))
            .collect();
        if changes.is_empty() {
            return Ok(self.tools.as_deref().map(Cow::Borrowed));
        }
        // In declaration order, a definition replacing a tool keeps its place.
        let mut tools: Vec<(Tool, bool)> = self.tools.iter().flatten().map(|t| (t.clone(), false)).collect();
        for block in changes {
            let removed = block.kind == BlockType::ToolRemoval;
            let name = match block.tool.as_ref().expect("validated") {
                ToolChange::ToolDefinition { definition } => {
                    match tools.iter_mut().find(|(t, _)| t.name == definition.name) {
                        Some(slot) => slot.0 = definition.clone(),
                        None => tools.push((definition.clone(), false)),
                    }
                    definition.name.as_str()
                }
                ToolChange::ToolReference { name } => {
                    let Some(slot) = tools.iter_mut().find(|(t, _)| &t.name == name) else {
                        let kind = if removed { "tool_removal" } else { "tool_addition" };
                        return Err(TokenizeError::Request(format!(
                            "{kind} references tool '{name}', which is not declared in tools"
                        )));
                    };
                    if !removed {
                        slot.0.defer_loading = None;
                    }
                    name.as_str()
                }
            };
            if let Some(slot) = tools.iter_mut().find(|(t, _)| t.name == name) {
                slot.1 = removed;
            }
        }
        Ok(Some(Cow::Owned(tools.into_iter().filter(|(_, removed)| !removed).map(|(t, _)| t).collect())))
    }
}

/// A tool as vLLM hands it to the template (its `ChatCompletionToolsParam`, dumped).
fn tool_definition(tool: &Tool) -> Value {
    let mut parameters = tool.input_schema.clone();
    if !parameters.contains_key("type") {
        parameters.insert("type".into(), "object".into());
    }
    let mut function = Map::new();
    function.insert("name".into(), tool.name.as_str().into());
    function.insert("description".into(), tool.description.as_deref().map_or(Value::Null, Value::from));
    function.insert("parameters".into(), Value::Object(parameters));
    if let Some(strict) = tool.strict {
        function.insert("strict".into(), strict.into());
    }
    if let Some(defer) = tool.defer_loading {
        function.insert("defer_loading".into(), defer.into());
    }
    json!({"type": "function", "function": function})
}

/// The text of system blocks, billing headers dropped; `None` if nothing is left.
fn system_text(blocks: &[Block]) -> Option<String> {
    let text: String = blocks
        .iter()
        .filter(|b| b.kind == BlockType::Text)
        .filter_map(|b| b.text.as_deref())
        .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
        .collect();
    (!text.is_empty()).then_some(text)
}

fn message_system_text(content: &Content) -> Option<String> {
    match content {
        Content::Text(text) if text.starts_with(BILLING_HEADER) => None,
        Content::Text(text) => (!text.is_empty()).then(|| text.clone()),
        Content::Blocks(blocks) => system_text(blocks),
    }
}

/// A user or assistant message's blocks, into `message`; a user's tool results go to
/// `messages` first (they answer the previous assistant turn).
fn convert_blocks(
    blocks: &[Block],
    role: Role,
    message: &mut Map<String, Value>,
    messages: &mut Vec<Value>,
) -> Result<(), TokenizeError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut reasoning: Option<String> = None;
    for block in blocks {
        match block.kind {
            BlockType::Text => {
                if let Some(text) = block.text.as_deref().filter(|t| !t.is_empty()) {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            BlockType::Image => {
                if let Some(source) = &block.source {
                    parts.push(json!({"type": "image_url", "image_url": {"url": image_url(source)}}));
                }
            }
            BlockType::Thinking => {
                if let Some(thinking) = &block.thinking {
                    reasoning.get_or_insert_with(String::new).push_str(thinking);
                }
            }
            BlockType::ToolUse => {
                let id = block.id.as_deref().filter(|id| !id.is_empty()).ok_or_else(|| {
                    // vLLM would make one up from the clock, which no router can predict.
                    TokenizeError::Request("tool_use blocks need an 'id'".into())
                })?;
                tool_calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {
                        "name": block.name.as_deref().unwrap_or_default(),
                        "arguments": Value::Object(block.input.clone().unwrap_or_default()),
                    },
                }));
            }
            BlockType::ToolResult if role == Role::User => tool_result(block, messages),
            BlockType::ToolResult => match &block.content {
                None => parts.push(json!({"type": "text", "text": "Tool result: "})),
                Some(ToolResultContent::Text(text)) => {
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
                Some(ToolResultContent::Items(_)) => {
                    return Err(TokenizeError::Request(
                        "tool_result blocks belong in user messages (an assistant's with a list content \
                         cannot be rendered as vLLM renders it)"
                            .into(),
                    ));
                }
            },
            BlockType::RedactedThinking
            | BlockType::ToolReference
            | BlockType::ToolAddition
            | BlockType::ToolRemoval => {}
        }
    }
    if let Some(reasoning) = reasoning {
        // vLLM's chat parser gives templates both names.
        message.insert("reasoning".into(), reasoning.as_str().into());
        message.insert("reasoning_content".into(), reasoning.into());
    }
    if !tool_calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    match parts.len() {
        0 => {}
        1 if parts[0]["type"] == "text" => {
            message.insert("content".into(), parts.swap_remove(0)["text"].take());
        }
        _ => {
            message.insert("content".into(), Value::Array(parts));
        }
    }
    Ok(())
}

/// A user's `tool_result` block: a tool message with its text (list items joined by newlines),
/// then a user message with its images and a tool message with its tool references, if any.
fn tool_result(block: &Block, messages: &mut Vec<Value>) {
    let call_id = block.tool_use_id.as_deref().unwrap_or_default();
    let (mut texts, mut images, mut references) = (Vec::new(), Vec::new(), Vec::new());
    match &block.content {
        Some(ToolResultContent::Text(text)) => texts.push(text.as_str()),
        Some(ToolResultContent::Items(items)) => {
            for item in items {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(item.get("text").and_then(Value::as_str).unwrap_or_default()),
                    Some("image") => {
                        let url = item.get("source").and_then(Value::as_object).map(image_url).unwrap_or_default();
                        if !url.is_empty() {
                            images.push(json!({"type": "image_url", "image_url": {"url": url}}));
                        }
                    }
                    Some("tool_reference") => {
                        let name = ["tool_name", "name"]
                            .iter()
                            .find_map(|key| item.get(*key).and_then(Value::as_str).filter(|n| !n.is_empty()));
                        if let Some(name) = name {
                            references.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
        }
        None => {}
    }
    messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": texts.join("\n")}));
    if !images.is_empty() {
        messages.push(json!({"role": "user", "content": images}));
    }
    if !references.is_empty() {
        messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": references}));
    }
}

/// An image source as an OpenAI image URL (`url` sources as they are, others as data URIs).
fn image_url(source: &Map<String, Value>) -> String {
    let field = |key: &str| source.get(key).and_then(Value::as_str);
    if field("type") == Some("url") {
        return field("url").unwrap_or_default().to_owned();
    }
    format!("data:{};base64,{}", field("media_type").unwrap_or("image/jpeg"), field("data").unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value, traits: TemplateTraits) -> Result<(Vec<Value>, ChatOptions), TokenizeError> {
        let request: MessagesRequest =
            serde_json::from_value(body).map_err(|e| TokenizeError::Request(e.to_string()))?;
        request.to_chat(traits)
    }

    #[test]
    fn system_blocks_are_joined_and_the_billing_header_dropped() {
        let (messages, _) = chat(
            json!({"model": "m", "max_tokens": 8, "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                {"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Answer in French."}],
                "messages": [{"role": "user", "content": "hi"}]}),
            TemplateTraits::default(),
        )
        .unwrap();
        assert_eq!(
            messages,
            [
                json!({"role": "system", "content": "You are terse. Answer in French."}),
                json!({"role": "user", "content": "hi"})
            ]
        );
    }

    #[test]
    fn inline_system_messages_merge_only_where_the_template_needs_it() {
        let body = json!({"model": "m", "max_tokens": 8, "system": "A.", "messages": [
            {"role": "user", "content": "q1"}, {"role": "system", "content": "B."}, {"role": "user", "content": "q2"}]});
        let (kept, _) = chat(body.clone(), TemplateTraits::default()).unwrap();
        assert_eq!(
            kept.iter().map(|m| m["role"].as_str().unwrap()).collect::<Vec<_>>(),
            ["system", "user", "system", "user"]
        );
        let traits = TemplateTraits { requires_leading_system: true, ..Default::default() };
        let (merged, _) = chat(body, traits).unwrap();
        assert_eq!(merged[0], json!({"role": "system", "content": "A.B."}));
        assert_eq!(merged.len(), 3);
    }

    #[test]
    fn tool_use_and_results_become_tool_calls_and_tool_messages() {
        let (messages, options) = chat(
            json!({"model": "m", "max_tokens": 8,
                "tools": [{"name": "weather", "input_schema": {"properties": {"city": {"type": "string"}}}}],
                "messages": [
                {"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "21"}, {"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "and tomorrow?"}]}]}),
            TemplateTraits::default(),
        )
        .unwrap();
        assert_eq!(
            messages[1]["tool_calls"][0]["function"],
            json!({"name": "weather", "arguments": {"city": "Paris"}})
        );
        assert_eq!(messages[1]["reasoning_content"], "look it up");
        assert!(messages[1].get("content").is_none());
        assert_eq!(messages[2], json!({"role": "tool", "tool_call_id": "t1", "content": "21\nsunny"}));
        assert_eq!(messages[3], json!({"role": "user", "content": "and tomorrow?"}));
        assert_eq!(
            options.tools.unwrap(),
            json!([{"type": "function", "function": {"name": "weather", "description": null,
                "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}}])
        );
    }

    #[test]
    fn a_user_message_of_only_tool_results_adds_no_user_turn() {
        let (messages, _) = chat(
            json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}),
            TemplateTraits::default(),
        )
        .unwrap();
        assert_eq!(messages, [json!({"role": "tool", "tool_call_id": "t1", "content": "ok"})]);
    }

    #[test]
    fn tool_changes_edit_the_declared_tools() {
        let schema = json!({"type": "object"});
        let (_, options) = chat(
            json!({"model": "m", "max_tokens": 8,
                "tools": [{"name": "a", "input_schema": schema, "defer_loading": true}, {"name": "b", "input_schema": schema}],
                "messages": [{"role": "system", "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "b"}},
                    {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {"name": "c", "input_schema": schema}}}]},
                    {"role": "user", "content": "go"}]}),
            TemplateTraits::default(),
        )
        .unwrap();
        let names: Vec<_> = options.tools.unwrap().as_array().unwrap().iter().map(|t| t["function"].clone()).collect();
        assert_eq!(names[0], json!({"name": "a", "description": null, "parameters": schema}));
        assert_eq!(names[1]["name"], "c");
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn thinking_and_effort_set_the_reasoning_effort() {
        let with = |extra: Value, traits| {
            let mut body = json!({"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "x"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            chat(body, traits).unwrap().1.reasoning_effort
        };
        let plain = TemplateTraits::default();
        assert_eq!(with(json!({}), plain), None);
        assert_eq!(with(json!({"thinking": {"type": "disabled"}}), plain).as_deref(), Some("none"));
        let low = TemplateTraits { disabled_thinking_is_low: true, ..plain };
        assert_eq!(with(json!({"thinking": {"type": "disabled"}}), low).as_deref(), Some("low"));
        assert_eq!(with(json!({"output_config": {"effort": "high"}}), plain).as_deref(), Some("high"));
        assert_eq!(
            with(
                json!({"thinking": {"type": "enabled", "budget_tokens": 2048}, "output_config": {"effort": "max"}}),
                plain
            )
            .as_deref(),
            Some("max")
        );
    }

    #[test]
    fn what_vllm_rejects_is_rejected() {
        let cases = [
            (json!({"model": "m", "messages": []}), "max_tokens"),
            (json!({"model": "", "max_tokens": 1, "messages": []}), "'model' is required"),
            (json!({"model": "m", "max_tokens": 0, "messages": []}), "must be positive"),
            (json!({"model": "m", "max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}), "unknown variant"),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
                "did not match",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}]}]}),
                "only allowed in messages with role",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "tools": [], "messages": [{"role": "system", "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}]}]}),
                "not declared",
            ),
            (
                json!({"model": "m", "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000},
                    "messages": []}),
                "less than 'max_tokens'",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "assistant", "content": [
                    {"type": "tool_use", "name": "f", "input": {}}]}]}),
                "need an 'id'",
            ),
        ];
        for (body, want) in cases {
            let e = chat(body.clone(), TemplateTraits::default()).unwrap_err().to_string();
            assert!(e.contains(want), "{body}: {e}");
        }
    }
}
