//! Request bodies → prompt tokens, for both APIs (fallback tokenizer: the chat template path
//! and every body shape are exercised), and → a model rewrite (its span must be the body's).
//! Never a panic; errors are fine.
#![no_main]
use kvgate_route_api::{Api, ModelRewrite};
use kvgate_scorer::config::{ModelRewriteRule, RewriteTarget};
use kvgate_scorer::prompt::{Adapters, ModelTokenizers, extract};
use kvgate_scorer::rewrites::ModelRewrites;
use kvgate_tokenize::Tokenizer;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static TOKENIZERS: OnceLock<ModelTokenizers> = OnceLock::new();
static REWRITES: OnceLock<ModelRewrites> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let tokenizers = TOKENIZERS.get_or_init(|| ModelTokenizers::new(Tokenizer::fallback()));
    let adapters = Adapters::new(vec!["sql".to_string()]);
    let _ = extract(tokenizers, Api::Completions, data, &adapters, None);
    let _ = extract(tokenizers, Api::ChatCompletions, data, &adapters, Some("sql"));
    let _ = kvgate_route_api::starts_as_object(data);
    let rewrites = REWRITES.get_or_init(|| {
        let target = |model: &str| RewriteTarget { model: model.into(), weight: Some(3) };
        ModelRewrites::new(vec![ModelRewriteRule { matches: Vec::new(), targets: vec![target("a"), target("b")] }])
    });
    if let Some((at, len)) = rewrites.of(data).and_then(|r| r.span) {
        let rewrite = ModelRewrite { model: "a".into(), at: at as u64, len: len as u64 };
        assert!(rewrite.apply(data).is_ok());
    }
});
