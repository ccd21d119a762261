//! From a request body (OpenAI completions, chat or responses, Anthropic messages) to what
//! routing needs: the prompt's token ids as the engine
//! will see them, the adapter and salt that seed its block hashes, and its output budget.

use kvgate_route_api::{Api, NOT_AN_OBJECT, starts_as_object};
use kvgate_tokenize::{ChatOptions, MessagesRequest, ResponsesRequest, Tokenizer};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Why a body cannot be routed (the client's fault: HTTP 400).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PromptError(pub String);

/// What routing needs from a request.
#[derive(Debug)]
pub struct PromptInfo {
    pub tokens: Vec<u32>,
    /// The `model` it asks for.
    pub model: Option<String>,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub max_output_tokens: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<Value>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    cache_salt: Option<String>,
    tools: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
    reasoning_effort: Option<String>,
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: bool,
    add_special_tokens: Option<bool>,
}

/// The tokenizer of each model behind the gateway: those configured by name (`models`), the
/// default one for every other model (and for a request naming none).
pub struct ModelTokenizers {
    default: Tokenizer,
    /// A handful at most: looked up by a scan.
    by_model: Vec<(String, Tokenizer)>,
}

impl ModelTokenizers {
    pub fn new(default: Tokenizer) -> Self {
        Self { default, by_model: Vec::new() }
    }

    /// `model`'s requests are tokenized by `tokenizer`.
    pub fn add(&mut self, model: &str, tokenizer: Tokenizer) {
        self.by_model.push((model.to_string(), tokenizer));
    }

    /// The tokenizer of a request naming `model`: its own, else (an adapter) its base
    /// model's, else the default.
    pub fn of(&self, model: Option<&str>, adapters: &Adapters) -> &Tokenizer {
        if self.by_model.is_empty() {
            return &self.default; // one model's gateway: nothing to look up
        }
        let listed = |model: &str| self.by_model.iter().find(|(name, _)| name == model).map(|(_, t)| t);
        let own = model.and_then(listed);
        let base = || model.and_then(|m| adapters.base_of(m)).and_then(listed);
        own.or_else(base).unwrap_or(&self.default)
    }

    /// Every tokenizer tokenizes as its engines do (none is the estimate).
    pub fn is_exact(&self) -> bool {
        self.default.is_exact() && self.by_model.iter().all(|(_, t)| t.is_exact())
    }

    pub fn default_tokenizer(&self) -> &Tokenizer {
        &self.default
    }
}

/// The LoRA adapters known: configured, and learned from the engines, with the base model
/// each adapts where its engine said (`/v1/models`' `parent`).
#[derive(Debug, Default)]
pub struct Adapters {
    names: Vec<String>,
    bases: Vec<(String, String)>,
}

impl Adapters {
    pub fn new(names: Vec<String>) -> Self {
        Self { names, bases: Vec::new() }
    }

    pub fn is_adapter(&self, model: &str) -> bool {
        self.names.iter().any(|n| n == model)
    }

    /// The base model `adapter` adapts, if an engine said.
    pub fn base_of(&self, adapter: &str) -> Option<&str> {
        self.bases.iter().find(|(name, _)| name == adapter).map(|(_, base)| base.as_str())
    }

    /// Whether learning `name` (with its `base`, if known) would change what is known.
    pub fn is_news(&self, name: &str, base: Option<&str>) -> bool {
        !self.is_adapter(name) || base.is_some_and(|base| self.base_of(name) != Some(base))
    }

    pub fn learn(&mut self, name: &str, base: Option<&str>) {
        if !self.is_adapter(name) {
            self.names.push(name.to_string());
        }
        if let Some(base) = base {
            self.bases.retain(|(n, _)| n != name);
            self.bases.push((name.to_string(), base.to_string()));
        }
    }
}

impl From<Tokenizer> for ModelTokenizers {
    fn from(default: Tokenizer) -> Self {
        Self::new(default)
    }
}

/// Tokenizes a request body the way the engine of the model it names (or `as_model`, its
/// rewrite's target) will.
///
/// A completions request with several prompts is routed by its first (the engine serves them
/// all on one pod; the first is what a shared prefix would match).
pub fn extract(
    tokenizers: &ModelTokenizers,
    api: Api,
    body: &[u8],
    adapters: &Adapters,
    as_model: Option<&str>,
) -> Result<PromptInfo, PromptError> {
    let rewritten = |model: &mut Option<String>| {
        if let Some(target) = as_model {
            *model = Some(target.to_string());
        }
    };
    if !starts_as_object(body) {
        return Err(PromptError(NOT_AN_OBJECT.into()));
    }
    // One parse, straight into the fields routing reads (the rest of the body is skipped).
    let to_request_error = |e: kvgate_tokenize::TokenizeError| PromptError(e.to_string());
    match api {
        Api::Completions => {
            let mut body: Body = parse(body)?;
            rewritten(&mut body.model);
            let tokenizer = tokenizers.of(body.model.as_deref(), adapters);
            let add_special = body.add_special_tokens.unwrap_or(true);
            let tokens = match body.prompt.take() {
                None => return Err(PromptError("'prompt' is required".into())),
                Some(Prompt::Text(text)) => encode(tokenizer, &text, add_special)?,
                Some(Prompt::Texts(texts)) => match texts.first() {
                    Some(text) => encode(tokenizer, text, add_special)?,
                    None => return Err(PromptError("'prompt' must not be empty".into())),
                },
                Some(Prompt::Tokens(ids)) => ids,
                Some(Prompt::TokenLists(mut lists)) => {
                    if lists.is_empty() {
                        return Err(PromptError("'prompt' must not be empty".into()));
                    }
                    lists.swap_remove(0)
                }
            };
            body.info(tokens, adapters)
        }
        Api::ChatCompletions => {
            let mut body: Body = parse(body)?;
            rewritten(&mut body.model);
            let tokenizer = tokenizers.of(body.model.as_deref(), adapters);
            let messages = body.messages.take().ok_or_else(|| PromptError("'messages' is required".into()))?;
            let options = ChatOptions {
                add_generation_prompt: body.add_generation_prompt.unwrap_or(!body.continue_final_message),
                continue_final_message: body.continue_final_message,
                tools: body.tools.take(),
                template_kwargs: body.chat_template_kwargs.take(),
                reasoning_effort: body.reasoning_effort.take(),
            };
            let text = tokenizer.render_chat(&messages, &options).map_err(to_request_error)?;
            let tokens = encode(tokenizer, &text, body.add_special_tokens.unwrap_or(false))?;
            body.info(tokens, adapters)
        }
        Api::Messages => {
            let request: MessagesRequest = parse(body)?;
            let tokens = tokenizers
                .of(Some(as_model.unwrap_or(&request.model)), adapters)
                .encode_messages_request(&request)
                .map_err(to_request_error)?;
            let max_tokens = u32::try_from(request.max_tokens).unwrap_or(u32::MAX);
            let model = as_model.map_or(request.model, str::to_string);
            info(tokens, Some(model), request.cache_salt, Some(max_tokens), adapters)
        }
        Api::Responses => {
            let mut request: ResponsesRequest = parse(body)?;
            rewritten(&mut request.model);
            let tokens = tokenizers
                .of(request.model.as_deref(), adapters)
                .encode_responses_request(&request)
                .map_err(to_request_error)?;
            info(tokens, request.model, request.cache_salt, request.max_output_tokens, adapters)
        }
    }
}

impl Body {
    /// What routing needs, the prompt's `tokens` given.
    fn info(self, tokens: Vec<u32>, adapters: &Adapters) -> Result<PromptInfo, PromptError> {
        info(tokens, self.model, self.cache_salt, self.max_completion_tokens.or(self.max_tokens), adapters)
    }
}

fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, PromptError> {
    serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => PromptError(format!("invalid request: {e}")),
        _ => PromptError(format!("request body is not valid JSON: {e}")),
    })
}

fn info(
    tokens: Vec<u32>,
    model: Option<String>,
    cache_salt: Option<String>,
    max_output_tokens: Option<u32>,
    adapters: &Adapters,
) -> Result<PromptInfo, PromptError> {
    if tokens.is_empty() {
        return Err(PromptError("the prompt is empty".into()));
    }
    let lora_name = model.as_ref().filter(|m| adapters.is_adapter(m)).cloned();
    Ok(PromptInfo { tokens, model, lora_name, cache_salt, max_output_tokens })
}

fn encode(tokenizer: &Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
    tokenizer.encode(text, add_special_tokens).map_err(|e| PromptError(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fallback(api: Api, body: &str) -> Result<PromptInfo, PromptError> {
        let adapters = Adapters::new(vec!["sql".into()]);
        extract(&ModelTokenizers::new(Tokenizer::fallback()), api, body.as_bytes(), &adapters, None)
    }

    #[test]
    fn each_model_has_its_tokenizer_and_an_adapter_its_base_models() {
        let mut tokenizers = ModelTokenizers::new(Tokenizer::fallback());
        tokenizers.add("llama", Tokenizer::fallback());
        let mut adapters = Adapters::new(vec!["sql".into()]);
        let (default, llama) = (tokenizers.default_tokenizer(), tokenizers.of(Some("llama"), &adapters));
        assert!(!std::ptr::eq(default, llama));
        assert!(std::ptr::eq(tokenizers.of(None, &adapters), default));
        assert!(std::ptr::eq(tokenizers.of(Some("qwen"), &adapters), default), "not listed: the default");
        assert!(std::ptr::eq(tokenizers.of(Some("sql"), &adapters), default), "its base not known yet");
        assert!(adapters.is_news("sql", Some("llama")) && !adapters.is_news("sql", None));
        adapters.learn("sql", Some("llama"));
        assert!(!adapters.is_news("sql", Some("llama")) && adapters.is_news("sql", Some("qwen")));
        assert!(std::ptr::eq(tokenizers.of(Some("sql"), &adapters), llama), "an adapter of llama");
        assert!(adapters.is_adapter("sql") && !adapters.is_adapter("llama"));
    }

    #[test]
    fn prompts_in_every_shape() {
        let text = fallback(Api::Completions, r#"{"prompt": "abcdefgh", "max_tokens": 9}"#).unwrap();
        assert_eq!(text.tokens.len(), 2);
        assert_eq!(text.max_output_tokens, Some(9));
        let ids = fallback(Api::Completions, r#"{"prompt": [5, 6, 7]}"#).unwrap();
        assert_eq!(ids.tokens, vec![5, 6, 7]);
        let lists = fallback(Api::Completions, r#"{"prompt": [[1, 2], [3]]}"#).unwrap();
        assert_eq!(lists.tokens, vec![1, 2]);
        let texts = fallback(Api::Completions, r#"{"prompt": ["abcd", "efgh"]}"#).unwrap();
        assert_eq!(texts.tokens, text.tokens[..1]);
        let chat = fallback(
            Api::ChatCompletions,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "max_tokens": 7,
                "model": "sql", "cache_salt": "t1"}"#,
        )
        .unwrap();
        assert_eq!(chat.max_output_tokens, Some(3));
        assert_eq!(chat.lora_name.as_deref(), Some("sql"));
        assert_eq!(chat.cache_salt.as_deref(), Some("t1"));
        let base =
            fallback(Api::ChatCompletions, r#"{"messages": [{"role": "user", "content": "hi"}], "model": "base"}"#);
        assert_eq!(base.unwrap().lora_name, None);
        let messages = fallback(
            Api::Messages,
            r#"{"model": "sql", "max_tokens": 5, "system": "S", "messages": [{"role": "user", "content": "hi"}],
                "cache_salt": "t2"}"#,
        )
        .unwrap();
        let same_chat = fallback(
            Api::ChatCompletions,
            r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}"#,
        )
        .unwrap();
        assert_eq!(messages.tokens, same_chat.tokens);
        assert_eq!(messages.max_output_tokens, Some(5));
        assert_eq!(messages.lora_name.as_deref(), Some("sql"));
        assert_eq!(messages.cache_salt.as_deref(), Some("t2"));
        let responses =
            fallback(Api::Responses, r#"{"model": "sql", "max_output_tokens": 6, "instructions": "S", "input": "hi"}"#)
                .unwrap();
        assert_eq!(responses.tokens, same_chat.tokens);
        assert_eq!(responses.max_output_tokens, Some(6));
        assert_eq!(responses.lora_name.as_deref(), Some("sql"));
    }

    #[test]
    fn bad_bodies_are_explained() {
        for (api, body, needle) in [
            (Api::Completions, "{", "not valid JSON"),
            (Api::Completions, "3", "JSON object"),
            (Api::Completions, "{}", "'prompt' is required"),
            (Api::Completions, r#"{"prompt": []}"#, "empty"),
            (Api::Completions, r#"{"prompt": {"x": 1}}"#, "invalid request"),
            (Api::Completions, r#"{"prompt": "x", "max_tokens": -1}"#, "invalid request"),
            (Api::ChatCompletions, r#"{"prompt": "x"}"#, "'messages' is required"),
            (Api::ChatCompletions, r#"{"messages": []}"#, "must not be empty"),
            (Api::ChatCompletions, r#"{"messages": [{"role": "user", "content": 1}]}"#, "content"),
            (Api::Messages, r#"{"messages": [{"role": "user", "content": "x"}]}"#, "missing field `model`"),
            (Api::Messages, r#"{"model": "m", "messages": [{"role": "user", "content": "x"}]}"#, "`max_tokens`"),
            (Api::Messages, r#"{"model": "m", "max_tokens": 0, "messages": []}"#, "must be positive"),
            (Api::Messages, r#"{"model": "m", "max_tokens": 9, "messages": []}"#, "must not be empty"),
            (Api::Messages, r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "user"}]}"#, "`content`"),
            (Api::Responses, r#"{"instructions": "x"}"#, "missing field `input`"),
            (Api::Responses, r#"{"input": "x", "previous_response_id": "r1"}"#, "previous_response_id"),
        ] {
            let err = fallback(api, body).expect_err(body).to_string();
            assert!(err.contains(needle), "{body}: {err}");
        }
    }
}
