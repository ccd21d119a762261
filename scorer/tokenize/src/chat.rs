//! Chat-template rendering the way vLLM (through HF transformers) renders it.
//!
//! The rendered text is what the engine tokenizes, so any difference from vLLM — a missing
//! newline, a different JSON separator — changes the token ids and with them every block hash.
//! The environment therefore mirrors HF's: `trim_blocks` + `lstrip_blocks`, Python string
//! methods (`.startswith`, `.split`, `.strip`…), `raise_exception`, `strftime_now` and a
//! Python-exact `tojson`. Messages are normalised as vLLM does before rendering: content
//! given as a list of parts is flattened into one string joined by `"\n"`, and tool-call
//! arguments given as JSON strings are parsed into objects.

use crate::anthropic::{Effort, TemplateTraits};
use crate::{TokenizeError, pyjson};
use minijinja::value::{Kwargs, Serde, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};
use smart_default::SmartDefault;
use strum::VariantArray;

/// Options of one chat rendering, named as in vLLM's chat-completions / tokenize requests.
#[derive(Debug, Clone, SmartDefault)]
pub struct ChatOptions {
    /// Append the assistant header so the model answers (vLLM default: true).
    #[default(true)]
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open so the model continues it.
    pub continue_final_message: bool,
    /// `tools` of the request, passed to the template as is.
    pub tools: Option<Value>,
    /// `chat_template_kwargs` of the request (e.g. `enable_thinking`).
    pub template_kwargs: Option<Map<String, Value>>,
    /// `reasoning_effort` of the request: passed to the template, and, unless the request's
    /// kwargs set `enable_thinking`, turning thinking on (any effort) or off (`"none"`).
    pub reasoning_effort: Option<String>,
}

/// A compiled chat template plus the special-token strings templates refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    traits: TemplateTraits,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source` in an HF-compatible environment. Fails on template syntax errors,
    /// so a broken `tokenizer_config.json` is reported at start-up rather than per request.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TokenizeError::Template(format!("chat template does not compile: {e:#}")))?;
        let mut template = Self { env, bos_token, eos_token, traits: TemplateTraits::default() };
        template.traits = template.probe_traits();
        Ok(template)
    }

    /// What vLLM probes this template for before serving Messages requests.
    pub fn traits(&self) -> TemplateTraits {
        self.traits
    }

    /// vLLM's two probes: a conversation with a second system message (does the template
    /// reject it?), and a greeting rendered with `reasoning_effort: "none"` against every
    /// effort (does "none" change anything?).
    fn probe_traits(&self) -> TemplateTraits {
        let turn = |role: &str| serde_json::json!({"role": role, "content": "t"});
        let interleaved = [turn("system"), turn("user"), turn("system"), turn("user")];
        let no_prompt = ChatOptions { add_generation_prompt: false, ..ChatOptions::default() };
        let requires_leading_system = self.render(&interleaved, &no_prompt).is_err();
        let hi = [serde_json::json!({"role": "user", "content": "Hi"})];
        let with_effort = |effort: &str| {
            self.render(&hi, &ChatOptions { reasoning_effort: Some(effort.into()), ..ChatOptions::default() }).ok()
        };
        let disabled_thinking_is_low = match with_effort("none") {
            None => true,
            Some(none) => Effort::VARIANTS.iter().any(|e| with_effort(e.into()).as_ref() == Some(&none)),
        };
        TemplateTraits { requires_leading_system, disabled_thinking_is_low }
    }

    /// Renders `messages` (OpenAI chat format) to the prompt text vLLM would tokenize.
    pub fn render(&self, messages: &[Value], options: &ChatOptions) -> Result<String, TokenizeError> {
        if messages.is_empty() {
            return Err(TokenizeError::Request("messages must not be empty".into()));
        }
        if options.continue_final_message && options.add_generation_prompt {
            return Err(TokenizeError::Request(
                "continue_final_message and add_generation_prompt cannot both be true".into(),
            ));
        }
        // The messages go to the template as they are where vLLM would not change them (a
        // string content, no tool calls: the common case, read in place rather than copied
        // first — an 8k-token history is tens of kB); the others normalised.
        let mut final_content = None;
        let mut values = Vec::with_capacity(messages.len());
        for (i, message) in messages.iter().enumerate() {
            let normalised = normalise_message(message)?;
            let message = normalised.as_ref().unwrap_or(message);
            if options.continue_final_message && i + 1 == messages.len() {
                final_content = Some(message.get("content").and_then(Value::as_str).unwrap_or("").to_owned());
            }
            values.push(template_value(message));
        }
        // vLLM's kwargs: the request's, under the effort it asks for.
        let effort_kwargs = options.reasoning_effort.as_ref().map(|effort| {
            let mut kwargs = options.template_kwargs.clone().unwrap_or_default();
            kwargs.insert("reasoning_effort".into(), effort.as_str().into());
            kwargs.entry("enable_thinking").or_insert_with(|| (effort != "none").into());
            kwargs
        });
        let kwargs = effort_kwargs.as_ref().or(options.template_kwargs.as_ref());
        let ctx = minijinja::context! {
            messages => values,
            add_generation_prompt => options.add_generation_prompt,
            tools => template_value(options.tools.as_ref().unwrap_or(&Value::Null)),
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..kwargs.map(template_value).unwrap_or_default()
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut rendered =
            template.render(ctx).map_err(|e| TokenizeError::Template(format!("chat template failed: {e:#}")))?;
        if let Some(last) = final_content {
            // As HF does: cut the text right after the final message's content.
            let last = last.as_str();
            let end = match rendered.rfind(last) {
                Some(pos) => pos + last.len(),
                None => rendered
                    .rfind(last.trim())
                    .map(|pos| pos + last.trim().len())
                    .ok_or_else(|| TokenizeError::Request("final message not found in rendered chat".into()))?,
            };
            rendered.truncate(end);
        }
        Ok(rendered)
    }
}

/// vLLM's message normalisation for string-content templates: `None` where the message goes
/// to the template as it is (a string content, no tool calls), else the normalised copy.
fn normalise_message(message: &Value) -> Result<Option<Value>, TokenizeError> {
    let Value::Object(map) = message else {
        return Err(TokenizeError::Request("each message must be an object".into()));
    };
    match map.get("role") {
        Some(Value::String(_)) => {}
        _ => return Err(TokenizeError::Request("each message needs a string 'role'".into())),
    }
    let content = match map.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(_)) if !map.contains_key("tool_calls") => return Ok(None),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match part {
                    Value::String(s) => texts.push(s.as_str()),
                    Value::Object(p) => match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        // vLLM's text parts (the Responses API names its own).
                        (Some("text" | "input_text" | "output_text") | None, Some(Value::String(t))) => texts.push(t),
                        (Some(kind), _) => {
                            return Err(TokenizeError::Request(format!("unsupported content part type '{kind}'")));
                        }
                        _ => return Err(TokenizeError::Request("content part without 'text'".into())),
                    },
                    _ => return Err(TokenizeError::Request("content parts must be objects".into())),
                }
            }
            texts.join("\n")
        }
        Some(_) => return Err(TokenizeError::Request("message 'content' must be a string or a list of parts".into())),
    };
    let mut out = map.clone();
    out.insert("content".into(), Value::String(content));
    with_parsed_tool_calls(&mut out)?;
    Ok(Some(Value::Object(out)))
}

/// Parses the message's tool calls' arguments, as vLLM hands them to templates.
fn with_parsed_tool_calls(out: &mut Map<String, Value>) -> Result<(), TokenizeError> {
    if let Some(Value::Array(calls)) = out.get_mut("tool_calls") {
        for call in calls.iter_mut() {
            let Some(Value::Object(function)) = call.get_mut("function") else { continue };
            // vLLM hands templates parsed arguments: a JSON string is parsed, an empty or
            // missing one becomes {}.
            let parsed = match function.get("arguments") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(Value::String(s)) if s.is_empty() => Value::Object(Map::new()),
                Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                    TokenizeError::Request(format!("tool_calls[].function.arguments is not valid JSON: {e}"))
                })?,
                Some(other) => other.clone(),
            };
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(())
}

/// JSON as the template sees it (its strings copied once, into the template's values).
fn template_value(value: &impl serde::Serialize) -> JValue {
    JValue::from(Serde(value))
}

fn tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accepted for compatibility; Python's defaults are what templates expect.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| JError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(JValue::from_safe_string(pyjson::dumps(&json, indent)))
}

fn raise_exception(message: String) -> Result<JValue, JError> {
    Err(JError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(fmt)` as HF registers it (Llama 3 templates print today's date).
fn strftime_now(format: String) -> Result<JValue, JError> {
    Ok(JValue::from(strftime(&format, jiff::Timestamp::now().as_second())))
}

/// In UTC; a format with a directive jiff does not know is left as written (a template is
/// not failed for its date).
fn strftime(format: &str, unix_secs: i64) -> String {
    let at = jiff::Timestamp::from_second(unix_secs).unwrap_or_default().to_zoned(jiff::tz::TimeZone::UTC);
    jiff::fmt::strtime::format(format, &at).unwrap_or_else(|_| format.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-26 13:05:09 UTC
        assert_eq!(strftime("%d %b %Y %H:%M:%S %B %%", 1_721_999_109), "26 Jul 2024 13:05:09 July %");
    }

    #[test]
    fn strftime_takes_more_directives_and_leaves_an_unknown_one_as_written() {
        assert_eq!(strftime("%A %a %j %I %p %Z", 1_721_999_109), "Friday Fri 208 01 PM UTC");
        assert_eq!(strftime("%Y %J", 1_721_999_109), "%Y %J");
    }

    #[test]
    fn content_parts_are_joined_with_newlines() {
        let m = normalise_message(
            &json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        )
        .unwrap()
        .expect("parts are joined");
        assert_eq!(m["content"], "a\nb");
    }

    #[test]
    fn tool_call_arguments_are_parsed() {
        let m = normalise_message(&json!({"role": "assistant", "content": null,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}))
        .unwrap()
        .expect("arguments are parsed");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(m["content"], "");
    }

    #[test]
    fn bad_messages_are_rejected() {
        assert!(normalise_message(&json!({"content": "x"})).is_err());
        assert!(normalise_message(&json!({"role": "user", "content": 5})).is_err());
        assert!(normalise_message(&json!({"role": "user", "content": [{"type": "image_url"}]})).is_err());
    }

    #[test]
    fn renders_with_python_methods_and_tojson() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role.upper() }}:{{ m.content.strip() }}|{% endfor %}{{ tools | tojson }}{% if add_generation_prompt %}>{% endif %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let out = t
            .render(
                &[json!({"role": "user", "content": " hi "})],
                &ChatOptions { tools: Some(json!([{"a": "<x>"}])), ..Default::default() },
            )
            .unwrap();
        assert_eq!(out, "USER:hi|[{\"a\": \"<x>\"}]>");
    }
}
