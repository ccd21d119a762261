//! Anthropic Messages and OpenAI Responses requests must tokenize as vLLM tokenizes them. The
//! reference is vLLM 0.33's own request models and conversion code (extracted from its wheel
//! by `make setup` and run by `tests/tools/vllm_render.py`), rendered by HF transformers on the
//! real Qwen3 tokenizer — for Messages also with a variant of Qwen3's template that allows the
//! system message only first (where vLLM merges inline system messages into it). Requests vLLM
//! refuses, kvgate must refuse too.

use kvgate_test_harness::{python, qwen3_tokenizer, root, vllm_sources};
use kvgate_tokenize::{MessagesRequest, ResponsesRequest, Tokenizer};
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The request APIs the reference renders.
#[derive(Clone, Copy)]
enum Api {
    Messages,
    Responses,
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Api::Messages => "messages",
            Api::Responses => "responses",
        }
    }

    fn encode(self, tokenizer: &Tokenizer, body: &Value) -> Result<Vec<u32>, String> {
        match self {
            Api::Messages => serde_json::from_value::<MessagesRequest>(body.clone())
                .map_err(|e| e.to_string())
                .and_then(|r| tokenizer.encode_messages_request(&r).map_err(|e| e.to_string())),
            Api::Responses => serde_json::from_value::<ResponsesRequest>(body.clone())
                .map_err(|e| e.to_string())
                .and_then(|r| tokenizer.encode_responses_request(&r).map_err(|e| e.to_string())),
        }
    }

    fn render(self, tokenizer: &Tokenizer, body: &Value) -> String {
        let (messages, options) = match self {
            Api::Messages => serde_json::from_value::<MessagesRequest>(body.clone())
                .unwrap()
                .to_chat(tokenizer.template_traits())
                .unwrap(),
            Api::Responses => serde_json::from_value::<ResponsesRequest>(body.clone()).unwrap().to_chat().unwrap(),
        };
        tokenizer.render_chat(&messages, &options).unwrap()
    }
}

fn messages_requests() -> Vec<Value> {
    let long: String = (0..400).map(|i| format!("Rule {i}: answer from the cached documents. ")).collect();
    let weather = json!({"name": "get_weather", "description": "Weather <today> & \"tomorrow\"",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "Città"}},
                         "required": ["city"]}});
    let search = json!({"name": "search", "input_schema": {"properties": {"q": {"type": "string"}}}, "strict": true});
    let base = |messages: Value| json!({"model": "qwen3", "max_tokens": 64, "messages": messages});
    let with = |extra: Value, messages: Value| {
        let mut body = base(messages);
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    vec![
        base(json!([{"role": "user", "content": "Hello!"}])),
        with(json!({"system": "You are terse."}), json!([{"role": "user", "content": "What is KV caching?"}])),
        with(
            json!({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=8f3a1;"},
                {"type": "text", "text": long.clone(), "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": " And be kind."}]}),
            json!([{"role": "user", "content": [{"type": "text", "text": "Summarise the rules."}]}]),
        ),
        base(json!([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}])),
        // Claude Code's per-turn reminders: system messages between turns.
        with(
            json!({"system": "Base prompt."}),
            json!([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                {"role": "system", "content": [{"type": "text", "text": "<reminder>stay on task</reminder>"}]},
                {"role": "user", "content": "Q2"},
                {"role": "system", "content": "x-anthropic-billing-header: only"}]),
        ),
        // Tools, a tool round trip with thinking, results as text and as item lists.
        with(
            json!({"tools": [weather.clone(), search.clone()], "tool_choice": {"type": "auto"}}),
            json!([{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Two cities, two calls.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome", "days": 2.5}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "{\"temp\": 21.5}"},
                    {"type": "tool_result", "tool_use_id": "toolu_2",
                     "content": [{"type": "text", "text": "cloudy"}, {"type": "text", "text": "18 °C"}]}]},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Paris 21.5, Rome 18."}]},
                {"role": "user", "content": "Thanks 😀"}]),
        ),
        // A prefilled assistant turn (vLLM renders it closed, then the generation prompt).
        base(json!([{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon,"}])),
        with(json!({"thinking": {"type": "disabled"}}), json!([{"role": "user", "content": "No thinking please."}])),
        with(
            json!({"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2048}}),
            json!([{"role": "user", "content": "Think hard."}]),
        ),
        with(json!({"output_config": {"effort": "low"}}), json!([{"role": "user", "content": "Quick one."}])),
        with(
            json!({"chat_template_kwargs": {"enable_thinking": false}, "output_config": {"effort": "high"}}),
            json!([{"role": "user", "content": "kwargs win over the effort"}]),
        ),
        // Deferred tools: added by reference and by definition, one removed.
        with(
            json!({"tools": [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"},
                "defer_loading": true}, search.clone()]}),
            json!([{"role": "system", "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "get_weather"}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "search"}},
                    {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": weather.clone()}}]},
                {"role": "user", "content": "go"}]),
        ),
        with(
            json!({"cache_salt": "tenant-a", "stream": true, "metadata": {"user_id": "u"}, "temperature": 0.2}),
            json!([{"role": "user", "content": "Special <|im_end|> text"}]),
        ),
    ]
}

fn responses_requests() -> Vec<Value> {
    let long: String = (0..400).map(|i| format!("Policy {i}: cite the retrieved passage. ")).collect();
    let weather = json!({"type": "function", "name": "get_weather", "description": "Weather <today> & \"tomorrow\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": true});
    vec![
        json!({"model": "qwen3", "input": "Hello!"}),
        json!({"model": "qwen3", "instructions": long, "input": "Summarise the policies.", "max_output_tokens": 32}),
        json!({"input": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": [{"type": "input_text", "text": "part one"}, {"type": "input_text", "text": "part two"}]}]}),
        json!({"instructions": "Be brief.", "input": [{"type": "message", "role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How far is the moon?"}]}]}),
        // A tool round trip, with reasoning and an assistant message carrying its output parts.
        json!({"tools": [weather, {"type": "web_search"}], "tool_choice": "auto", "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "two calls"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Rome\", \"days\": 2.5}"},
            {"type": "function_call_output", "call_id": "c1", "output": "{\"temp\": 21.5}"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "cloudy"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Paris 21.5, Rome 18.", "annotations": []}]},
            {"role": "user", "content": "Thanks 😀"}]}),
        json!({"tools": [{"type": "namespace", "name": "crm", "description": "CRM", "tools": [
            {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]}],
            "input": [{"role": "user", "content": "find Ada"},
                {"type": "function_call", "call_id": "c9", "namespace": "crm", "name": "lookup", "arguments": "{}"}]}),
        // An unfinished assistant message, continued.
        json!({"input": [{"role": "user", "content": "Write a haiku"},
            {"type": "message", "role": "assistant", "status": "in_progress", "content": [{"type": "output_text", "text": "Autumn moon,"}]}]}),
        json!({"input": "Think quickly.", "reasoning": {"effort": "none"}}),
        json!({"input": "Think hard.", "reasoning": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"input": "Special <|im_end|> text", "cache_salt": "tenant-a", "stream": true, "store": false,
               "metadata": {"k": "v"}, "temperature": 0.3}),
    ]
}

fn responses_refused() -> Vec<Value> {
    vec![
        json!({"instructions": "no input"}),
        json!({"input": 5}),
        json!({"input": [{"role": "tool", "content": "x"}]}),
        json!({"input": [{"type": "function_call", "name": "f"}]}),
        json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}),
        json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
        json!({"input": "x", "reasoning": {"effort": "extreme"}}),
        json!({"input": "x", "prompt": {"id": "pmpt_1"}}),
        json!({"input": "x", "cache_salt": ""}),
    ]
}

/// Requests vLLM refuses; kvgate must refuse them too (a 400, not a guess).
fn messages_refused() -> Vec<Value> {
    let one = json!([{"role": "user", "content": "x"}]);
    vec![
        json!({"model": "qwen3", "messages": one}),
        json!({"model": "qwen3", "max_tokens": 0, "messages": one}),
        json!({"model": "", "max_tokens": 8, "messages": one}),
        json!({"model": "qwen3", "max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}),
        json!({"model": "qwen3", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document"}]}]}),
        json!({"model": "qwen3", "max_tokens": 8, "messages": [{"role": "user", "content": 5}]}),
        json!({"model": "qwen3", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}]}]}),
        json!({"model": "qwen3", "max_tokens": 8, "tools": [], "messages": [{"role": "system", "content": [
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "missing"}}]}, {"role": "user", "content": "x"}]}),
        json!({"model": "qwen3", "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 4096}, "messages": one}),
        json!({"model": "qwen3", "max_tokens": 8, "tools": [{"name": "t"}], "messages": one}),
    ]
}

fn reference(api: Api, bodies: &[Value], template: Option<&Path>) -> Vec<Value> {
    let mut command = Command::new(python());
    command
        .arg(root().join("tests/tools/vllm_render.py"))
        .arg(api.name())
        .arg(vllm_sources("0.33.0"))
        .arg(qwen3_tokenizer().parent().unwrap())
        .args(template)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = command.spawn().expect("run vLLM's conversion");
    child.stdin.take().unwrap().write_all(serde_json::to_string(bodies).unwrap().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "vLLM's conversion failed");
    serde_json::from_slice(&out.stdout).expect("reference JSON")
}

/// Renders `bodies` both ways and compares (and `refused` must be refused by both); returns the
/// reference's answer to the first body.
fn check(api: Api, tokenizer: &Tokenizer, bodies: &[Value], refused: &[Value], template: Option<&Path>) -> Value {
    let expected = reference(api, bodies, template);
    for (i, (body, want)) in bodies.iter().zip(&expected).enumerate() {
        assert!(want.get("error").is_none(), "case {i}: vLLM refused {body}: {}", want["error"]);
        let want_ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
        let got = api.encode(tokenizer, body).unwrap_or_else(|e| panic!("case {i}: kvgate refused {body}: {e}"));
        if got != want_ids {
            let text = api.render(tokenizer, body);
            assert_eq!(text, want["text"].as_str().unwrap(), "case {i}: rendered prompt differs");
            panic!("case {i}: token ids differ");
        }
    }
    for (body, want) in refused.iter().zip(reference(api, refused, template)) {
        assert!(want.get("error").is_some(), "vLLM accepted {body}");
        assert!(api.encode(tokenizer, body).is_err(), "kvgate accepted what vLLM refuses: {body}");
    }
    expected[0].clone()
}

#[test]
fn messages_requests_tokenize_as_vllm_renders_them_on_qwen3() {
    let tokenizer = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    let first = check(Api::Messages, &tokenizer, &messages_requests(), &messages_refused(), None);
    assert_eq!(first["merge_inline_system"], false, "Qwen3's template takes system messages anywhere");
    assert!(!tokenizer.template_traits().requires_leading_system);
    assert_eq!(first["disabled_thinking_effort"], "none");
    assert!(!tokenizer.template_traits().disabled_thinking_is_low);
}

#[test]
fn inline_system_messages_merge_as_vllm_merges_them_for_system_first_templates() {
    // Qwen3's template, refusing a system message anywhere but first (as many templates do).
    let dir = std::env::temp_dir().join(format!("kvgate-system-first-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let qwen3 = qwen3_tokenizer();
    let config: Value =
        serde_json::from_slice(&std::fs::read(qwen3.with_file_name("tokenizer_config.json")).unwrap()).unwrap();
    let guard = "{%- for message in messages %}{%- if message.role == 'system' and not loop.first %}\
                 {{- raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}";
    let template = format!("{guard}{}", config["chat_template"].as_str().unwrap());
    let mut config = config;
    config["chat_template"] = template.clone().into();
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    std::fs::copy(&qwen3, dir.join("tokenizer.json")).unwrap();
    let template_file: PathBuf = dir.join("chat_template.jinja");
    std::fs::write(&template_file, &template).unwrap();

    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).expect("load the variant");
    assert!(tokenizer.template_traits().requires_leading_system);
    let first = check(Api::Messages, &tokenizer, &messages_requests(), &messages_refused(), Some(&template_file));
    assert_eq!(first["merge_inline_system"], true);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn responses_requests_tokenize_as_vllm_renders_them_on_qwen3() {
    let tokenizer = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    check(Api::Responses, &tokenizer, &responses_requests(), &responses_refused(), None);
}
