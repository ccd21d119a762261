//! Model rewrites: the Gateway API Inference Extension's `InferenceModelRewrite` rules, from
//! configuration (`model_rewrites`) and from the pool's objects in the Kubernetes API.
//!
//! A request's `model` is matched exactly, else by the first catch-all rule; a rule with one
//! target renames it (an alias), a rule with several picks one by weight (a canary, a split).
//! The pick hangs on the conversation's start, not on the request: every turn of a
//! conversation reaches the same target, so a split does not halve its cache. The pods get the
//! body with the target's name (the proxies splice it in at the span found here), and the
//! request is tokenized, hashed and routed as the target.

use crate::config::{ModelRewriteRule, RewriteTarget};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use xxhash_rust::xxh3::Xxh3;

/// Bytes of a completions prompt that identify its conversation (a text prompt has no turns
/// to tell its start by; turns that resend it share these).
pub const PROMPT_KEY_BYTES: usize = 1024;

/// The rules in force, in precedence order: a rule naming the model beats a catch-all, and
/// among either kind the first listed wins.
#[derive(Debug, Default, derive_more::Constructor)]
pub struct ModelRewrites {
    rules: Vec<ModelRewriteRule>,
}

/// A request's rewrite.
#[derive(Clone, Debug, PartialEq)]
pub struct Rewrite {
    /// What the pods are asked for.
    pub model: String,
    /// The client's model as metrics name it: its name when a rule names it, `*` for the
    /// catch-all (whatever unknown names clients send, the label set stays bounded).
    pub from: String,
    /// Where the client's `model` value is in the body (a JSON string, quotes included):
    /// `(at, len)`; `None` when the target is the client's own model (nothing to rewrite).
    pub span: Option<(usize, usize)>,
}

impl ModelRewrites {
    /// The rule for `model`: the first naming it, else the first catch-all.
    fn rule(&self, model: &str) -> Option<(&ModelRewriteRule, bool)> {
        let named = self.rules.iter().find(|r| r.matches.iter().any(|m| m == model)).map(|r| (r, true));
        named.or_else(|| self.rules.iter().find(|r| r.matches.is_empty()).map(|r| (r, false)))
    }

    /// The rewrite of a request body's model, if a rule matches it. A body that cannot be read
    /// (or names no model) is not rewritten: reading the prompt refuses what is unreadable.
    pub fn of(&self, body: &[u8]) -> Option<Rewrite> {
        if self.rules.is_empty() {
            return None;
        }
        let head: Head<'_> = serde_json::from_slice(body).ok()?;
        let raw = head.model?;
        let model: Cow<'_, str> = serde_json::from_str(raw.get()).ok()?;
        let (rule, named) = self.rule(&model)?;
        let target = match &rule.targets[..] {
            [only] => only,
            targets => {
                // The conversation's point on the targets' weights laid end to end.
                let weight = |t: &RewriteTarget| u64::from(t.weight.unwrap_or(1));
                let mut point = head.conversation_key() % targets.iter().map(weight).sum::<u64>();
                let mut past = |t: &&RewriteTarget| point.checked_sub(weight(t)).map(|rest| point = rest).is_some();
                targets.iter().find(|t| !past(t)).unwrap_or(&targets[targets.len() - 1])
            }
        };
        // The value's place in the body: `raw` borrows it.
        let at = raw.get().as_ptr() as usize - body.as_ptr() as usize;
        Some(Rewrite {
            span: (target.model != *model).then_some((at, raw.get().len())),
            model: target.model.clone(),
            from: if named { model.into_owned() } else { "*".into() },
        })
    }
}

/// What a body shows of its model and of its conversation's start, borrowed from the body
/// (the rest is skipped; lists are read only when a split needs the conversation's key).
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    /// OpenAI's key for requests that share a prompt's start; when the client sets it, it
    /// names the conversation.
    #[serde(borrow)]
    prompt_cache_key: Option<&'a RawValue>,
    /// Anthropic's system prompt.
    #[serde(borrow)]
    system: Option<&'a RawValue>,
    /// The Responses API's system prompt.
    #[serde(borrow)]
    instructions: Option<&'a RawValue>,
    /// Chat completions and Anthropic messages.
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    /// The Responses API's input: a string or items.
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    /// Completions.
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Role<'a> {
    #[serde(borrow)]
    role: Option<Cow<'a, str>>,
}

impl Head<'_> {
    /// A hash of what every turn of the request's conversation starts with: the client's
    /// `prompt_cache_key`; else the system prompt and the messages up to the first user
    /// message (chat, messages, responses items), or the input text; else the first
    /// [`PROMPT_KEY_BYTES`] of a completions prompt.
    fn conversation_key(&self) -> u64 {
        let mut hash = Xxh3::new();
        let mut feed = |raw: &RawValue| {
            hash.update(raw.get().as_bytes());
            hash.update(b"\x1e");
        };
        if let Some(key) = self.prompt_cache_key {
            feed(key);
            return hash.digest();
        }
        self.system.into_iter().chain(self.instructions).for_each(&mut feed);
        let items = (self.messages.or(self.input))
            .filter(|raw| raw.get().starts_with('['))
            .and_then(|raw| serde_json::from_str::<Vec<&RawValue>>(raw.get()).ok());
        match items.as_deref() {
            Some(items) => {
                for item in items {
                    feed(item);
                    let role = serde_json::from_str::<Role<'_>>(item.get()).ok().and_then(|r| r.role);
                    if role.as_deref() == Some("user") {
                        break;
                    }
                }
            }
            None => {
                if let Some(input) = self.input {
                    feed(input);
                } else if let Some(prompt) = self.prompt {
                    let text = prompt.get().as_bytes();
                    hash.update(&text[..text.len().min(PROMPT_KEY_BYTES)]);
                }
            }
        }
        hash.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RewriteTarget;

    fn rule(matches: &[&str], targets: &[(&str, Option<u32>)]) -> ModelRewriteRule {
        ModelRewriteRule {
            matches: matches.iter().map(|m| m.to_string()).collect(),
            targets: targets.iter().map(|&(model, weight)| RewriteTarget { model: model.into(), weight }).collect(),
        }
    }

    fn chat(model: &str, first: &str, turns: usize) -> String {
        let mut messages = vec![
            serde_json::json!({"role": "system", "content": "be brief"}),
            serde_json::json!({"role": "user", "content": first}),
        ];
        for t in 1..turns {
            messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
            messages.push(serde_json::json!({"role": "user", "content": format!("and then {t}?")}));
        }
        serde_json::json!({"model": model, "messages": messages}).to_string()
    }

    #[test]
    fn a_named_rule_beats_the_catch_all_and_the_first_of_each_wins() {
        let rewrites = ModelRewrites::new(vec![
            rule(&[], &[("fallback", None)]),
            rule(&["llama", "llama-3"], &[("llama-v2", None)]),
            rule(&["llama"], &[("never", None)]),
            rule(&[], &[("never", None)]),
        ]);
        let of = |body: &str| rewrites.of(body.as_bytes()).map(|r| (r.model, r.from));
        assert_eq!(of(&chat("llama-3", "hi", 1)), Some(("llama-v2".into(), "llama-3".into())));
        assert_eq!(of(&chat("llama", "hi", 1)), Some(("llama-v2".into(), "llama".into())));
        assert_eq!(of(&chat("gpt-5", "hi", 1)), Some(("fallback".into(), "*".into())));
        assert_eq!(of(r#"{"prompt": "no model"}"#), None);
        assert_eq!(of(r#"{"model": 7, "prompt": "x"}"#), None, "left to the prompt's reading");
        assert_eq!(of("not json"), None);
        assert_eq!(ModelRewrites::new(vec![rule(&["a"], &[("b", None)])]).of(chat("c", "hi", 1).as_bytes()), None);
    }

    #[test]
    fn the_span_is_the_clients_value_as_written() {
        let rewrites = ModelRewrites::new(vec![rule(&["llama"], &[("llama-v2", None)])]);
        let body = br#"{ "stream": true, "model" :	"ll\u0061ma", "prompt": "model"}"#;
        let (at, len) = rewrites.of(body).unwrap().span.unwrap();
        assert_eq!(&body[at..at + len], br#""ll\u0061ma""#);
        let itself = ModelRewrites::new(vec![rule(&[], &[("llama", None)])]).of(body).unwrap();
        assert_eq!((itself.model.as_str(), itself.span), ("llama", None), "its own model: nothing to splice");
    }

    #[test]
    fn a_split_follows_its_weights_and_keeps_each_conversation_on_one_target() {
        let rewrites = ModelRewrites::new(vec![rule(&["llama"], &[("v2", Some(90)), ("v1", Some(10))])]);
        let target = |body: &str| rewrites.of(body.as_bytes()).unwrap().model;
        let mut v1 = 0;
        for c in 0..2000 {
            let first = format!("conversation {c}: tell me about topic {}", c * 7);
            let model = target(&chat("llama", &first, 1));
            for turns in 2..5 {
                assert_eq!(target(&chat("llama", &first, turns)), model, "conversation {c}, turn {turns}");
            }
            v1 += usize::from(model == "v1");
        }
        // 10 % of 2000 is 200; the binomial's σ is 13.4.
        assert!((150..=250).contains(&v1), "{v1} of 2000 to the 10 % target");
        // Equal shares without weights; the client's prompt_cache_key names its conversation.
        let even = ModelRewrites::new(vec![rule(&[], &[("a", None), ("b", None)])]);
        let keyed = |key: u32, text: &str| {
            let body = format!(r#"{{"model": "m", "prompt_cache_key": "user-{key}", "prompt": "{text}"}}"#);
            even.of(body.as_bytes()).unwrap().model
        };
        let a = (0..1000).filter(|&k| keyed(k, "one") == "a").count();
        assert!((430..=570).contains(&a), "{a} of 1000");
        assert!((0..50).all(|k| keyed(k, "one") == keyed(k, "two")));
    }

    #[test]
    fn each_api_keys_a_conversation_by_its_start() {
        let even = ModelRewrites::new(vec![rule(&[], &[("a", None), ("b", None), ("c", None), ("d", None)])]);
        let target = |body: serde_json::Value| even.of(body.to_string().as_bytes()).unwrap().model;
        let responses = |c: u32, turns: u32| {
            let mut input = vec![serde_json::json!({"role": "user", "content": format!("start {c}")})];
            input.extend((0..turns).map(|t| serde_json::json!({"role": "user", "content": format!("more {t}")})));
            serde_json::json!({"model": "m", "instructions": "S", "input": input})
        };
        let messages = |c: u32, turns: u32| {
            let mut messages = vec![serde_json::json!({"role": "user", "content": format!("start {c}")})];
            messages.extend((0..turns).map(|t| serde_json::json!({"role": "user", "content": format!("more {t}")})));
            serde_json::json!({"model": "m", "max_tokens": 9, "system": "S", "messages": messages})
        };
        let prompt = |c: u32, turns: u32| {
            let start = format!("document {c} ").repeat(200);
            serde_json::json!({"model": "m", "prompt": format!("{start}{}", "and more ".repeat(turns as usize))})
        };
        for api in [responses, messages, prompt] {
            let firsts: Vec<String> = (0..40).map(|c| target(api(c, 0))).collect();
            assert!((0..40).all(|c| target(api(c, 3)) == firsts[c as usize]), "turns stay");
            let used: std::collections::HashSet<&String> = firsts.iter().collect();
            assert_eq!(used.len(), 4, "conversations spread: {firsts:?}");
        }
    }
}
