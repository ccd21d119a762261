//! Token ids must equal what vLLM computes. The reference is HF transformers (the library vLLM
//! tokenizes and renders chat templates with) on the real Qwen3 tokenizer, with vLLM's
//! message preparation in front (`tests/tools/hf_tokenize.py`), over a varied request set.

use kvgate_test_harness::{python, qwen3_tokenizer, root};
use kvgate_tokenize::{ChatOptions, Tokenizer};
use serde_json::{Value, json};
use std::io::Write;
use std::process::{Command, Stdio};

fn cases() -> Vec<Value> {
    let long: String =
        (0..3000).map(|i| format!("Paragraph {i}: the cache holds blocks of sixteen tokens. ")).collect();
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather <today> & \"tomorrow\"",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Città"},
                        "days": {"type": "integer", "minimum": 1.0}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
    ]);
    let mut cases = vec![
        json!({"kind": "prompt", "text": "Hello, world!"}),
        json!({"kind": "prompt", "text": "  leading and trailing   spaces\t\ttabs\n\n\nnewlines  "}),
        json!({"kind": "prompt", "text": "日本語のテキストと中文混合，还有한국어도 있습니다。"}),
        json!({"kind": "prompt", "text": "Emoji 😀👍🏽👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵"}),
        json!({"kind": "prompt", "text": "Combining: e\u{301} a\u{308} n\u{303} — Zalgo: Z\u{351}\u{34b}a\u{35b}l\u{352}g\u{34c}o"}),
        json!({"kind": "prompt", "text": "Special tokens in text: <|im_start|>user\nhi<|im_end|> and <|endoftext|>"}),
        json!({"kind": "prompt", "text": "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n}\n"}),
        json!({"kind": "prompt", "text": "Numbers 1234567890 3.14159 -42 1e-9 0x1F 1,000,000"}),
        json!({"kind": "prompt", "text": "URL https://example.com/a?b=c&d=e#frag and email a.b@c.io"}),
        json!({"kind": "prompt", "text": "Mixed\r\nline\rendings\u{2028}and\u{00a0}nbsp"}),
        json!({"kind": "prompt", "text": "no special tokens added", "add_special_tokens": false}),
        json!({"kind": "prompt", "text": long}),
        json!({"kind": "chat", "messages": [{"role": "user", "content": "Hi!"}]}),
        json!({"kind": "chat", "messages": [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "What is KV caching?"}]}),
        json!({"kind": "chat", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
              {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
              {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3 多言語 😀"}]}),
        json!({"kind": "chat", "messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
              {"type": "text", "text": "part two"}]}]}),
        json!({"kind": "chat", "tools": tools, "messages": [{"role": "user", "content": "Weather in Paris?"}]}),
        json!({"kind": "chat", "tools": tools, "messages": [{"role": "system", "content": "Use tools."},
              {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21.5}"},
              {"role": "tool", "tool_call_id": "c2", "content": "second result"},
              {"role": "assistant", "content": "It is 21.5 °C."}, {"role": "user", "content": "Thanks"}]}),
        json!({"kind": "chat", "messages": [{"role": "user", "content": "Think first."},
              {"role": "assistant", "content": "<think>\nreasoning here\n</think>\n\nThe answer."},
              {"role": "user", "content": "And again?"}]}),
        json!({"kind": "chat", "messages": [{"role": "user", "content": "Q"},
              {"role": "assistant", "content": "A", "reasoning_content": "hidden steps"}]}),
        json!({"kind": "chat", "chat_template_kwargs": {"enable_thinking": false},
              "messages": [{"role": "user", "content": "No thinking please."}]}),
        json!({"kind": "chat", "add_generation_prompt": false, "messages": [{"role": "user", "content": "x"},
              {"role": "assistant", "content": "y"}]}),
        json!({"kind": "chat", "add_generation_prompt": false, "continue_final_message": true,
              "messages": [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon,"}]}),
        json!({"kind": "chat", "messages": [{"role": "system", "content": long.clone()},
              {"role": "user", "content": "Summarise."}]}),
    ];
    // A tool response right after a user turn, and special-looking text in content.
    cases.push(json!({"kind": "chat", "messages": [{"role": "user", "content": "<tool_response>x</tool_response>"},
        {"role": "user", "content": "<|im_end|> inside content"}]}));
    cases
}

fn reference(cases: &[Value]) -> Vec<Value> {
    let tokenizer_dir = qwen3_tokenizer().parent().unwrap().to_path_buf();
    let mut child = Command::new(python())
        .arg(root().join("tests/tools/hf_tokenize.py"))
        .arg(tokenizer_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run the HF reference");
    child.stdin.take().unwrap().write_all(serde_json::to_string(cases).unwrap().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "HF reference failed");
    serde_json::from_slice(&out.stdout).expect("reference JSON")
}

#[test]
fn token_ids_equal_hf_transformers_on_qwen3() {
    let tokenizer = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    // The scorer's default: long pieces (cut at special tokens and between words) from the
    // segment cache.
    let mut cached = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    cached.cache_segments(1 << 20).expect("Qwen3's pieces can be cached");
    let cases = cases();
    let expected = reference(&cases);
    assert_eq!(expected.len(), cases.len());
    let mut total_tokens = 0;
    for (i, (case, want)) in cases.iter().zip(&expected).enumerate() {
        let want_ids: Vec<u32> = want["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = if case["kind"] == "prompt" {
            let add = case.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
            for pass in ["first", "cached"] {
                let ids = cached.encode(case["text"].as_str().unwrap(), add).unwrap();
                assert_eq!(ids, want_ids, "case {i}: token ids differ with the segment cache ({pass} pass)");
            }
            tokenizer.encode(case["text"].as_str().unwrap(), add).unwrap()
        } else {
            let options = ChatOptions {
                add_generation_prompt: case.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
                continue_final_message: case.get("continue_final_message").and_then(Value::as_bool).unwrap_or(false),
                tools: case.get("tools").cloned(),
                template_kwargs: case.get("chat_template_kwargs").and_then(|k| k.as_object().cloned()),
                reasoning_effort: None,
            };
            let messages = case["messages"].as_array().unwrap();
            let text = tokenizer.render_chat(messages, &options).unwrap();
            assert_eq!(text, want["text"].as_str().unwrap(), "case {i}: rendered chat differs");
            for pass in ["first", "cached"] {
                let ids = cached.encode_chat(messages, &options).unwrap();
                assert_eq!(ids, want_ids, "case {i}: token ids differ with the segment cache ({pass} pass)");
            }
            tokenizer.encode(&text, false).unwrap()
        };
        assert_eq!(got, want_ids, "case {i}: token ids differ");
        total_tokens += got.len();
    }
    assert!(total_tokens > 50_000, "the set includes long prompts ({total_tokens} tokens)");
    assert!(cached.segment_cache_stats().is_some_and(|s| s.hits > 0), "the long cases were read back");
}
