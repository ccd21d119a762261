//! Request bodies → prompt tokens, for both APIs (fallback tokenizer: the chat template path
//! and every body shape are exercised). Never a panic; errors are fine.
#![no_main]
use kvgate_route_api::Api;
use kvgate_scorer::prompt::extract;
use kvgate_tokenize::Tokenizer;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let tokenizer = TOKENIZER.get_or_init(Tokenizer::fallback);
    let adapters = ["sql".to_string()];
    let _ = extract(tokenizer, Api::Completions, data, &adapters);
    let _ = extract(tokenizer, Api::ChatCompletions, data, &adapters);
    let _ = kvgate_route_api::starts_as_object(data);
});
