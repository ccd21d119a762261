//! Prompt → token ids, the way vLLM computes them.
//!
//! KV-cache-aware routing compares the block hashes of a request's tokens with what each
//! engine cached, so the router must produce *the same token ids the engine will*: one
//! differing id shifts every later block. This crate loads a model's HF `tokenizer.json`
//! and the chat template from the `tokenizer_config.json` beside it, and reproduces vLLM's
//! `/tokenize` for completions prompts and chat messages. Without a tokenizer it offers a
//! documented deterministic [`Tokenizer::fallback`] so simulators and tests still work.
//!
//! Encoding uses `tokenizers` 1.0.0-rc.3 (pinned), whose pipeline encodes ≈ 100× faster than
//! 0.23 (32k tokens in ≈ 0.5 ms instead of ≈ 70 ms here) — tokenization dominates the cost of
//! a long-prompt routing decision. It is a release candidate, so `tests/parity_hf.rs` checks
//! its ids (and our chat rendering) against HF transformers on a varied request set.

pub mod anthropic;
mod chat;
mod pyjson;
pub mod responses;
mod segments;

pub use anthropic::{MessagesRequest, TemplateTraits};
pub use chat::{ChatOptions, ChatTemplate};
pub use responses::ResponsesRequest;
use segments::SegmentCache;
pub use segments::{MIN_CACHED_BYTES, SegmentCacheStats};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tokenizers::pipeline::{EncodeOptions, PipelineToken, PipelineTokenizer};

/// Why a prompt could not be tokenized. `Request` errors are the caller's fault (HTTP 400);
/// the others are configuration problems found at load time.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("invalid tokenizer file {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{0}")]
    Template(String),
    #[error("{0}")]
    Request(String),
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

/// Fallback vocabulary size: ids are `FALLBACK_FIRST_ID..FALLBACK_FIRST_ID + FALLBACK_VOCAB`.
pub const FALLBACK_VOCAB: u32 = 100_000;
/// Ids below this are left free so fallback ids never look like byte or special tokens.
pub const FALLBACK_FIRST_ID: u32 = 256;
/// Bytes of UTF-8 text per fallback token (about what BPE tokenizers average on English).
pub const FALLBACK_BYTES_PER_TOKEN: usize = 4;

/// A tokenizer that matches vLLM's, or the deterministic fallback.
pub struct Tokenizer {
    kind: Kind,
}

enum Kind {
    Hf {
        tokenizer: Box<PipelineTokenizer>,
        chat: Option<Box<ChatTemplate>>,
        segments: Option<SegmentCache>,
        /// Whether its pieces can be cut between words too (see the `segments` module).
        between_words: bool,
    },
    Fallback,
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, when present beside it, `tokenizer_config.json` for the
    /// chat template and the BOS/EOS strings. A `tokenizer_config.json` without a
    /// `chat_template` leaves chat requests unsupported (they fail with a clear error).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TokenizeError::Io { path: path.into(), source })?;
        let load = |message: String| TokenizeError::Load { path: path.into(), message };
        // The reader accepts canonical tokenizer.json only; upgrade files written by older
        // versions first (a no-op for canonical ones).
        let canonical = tokenizers::canonicalize_str(&text).map_err(|e| load(e.to_string()))?;
        let tokenizer = tokenizers::from_json(&canonical).map_err(|e| load(e.to_string()))?;
        let between_words = serde_json::from_str(&text).is_ok_and(|config| segments::splits_between_words(&config));
        let config_path = path.with_file_name("tokenizer_config.json");
        let chat = if config_path.exists() { load_chat_template(&config_path)?.map(Box::new) } else { None };
        Ok(Self { kind: Kind::Hf { tokenizer: Box::new(tokenizer), chat, segments: None, between_words } })
    }

    /// Remembers the token ids of long pieces of text — between special tokens (a chat's
    /// messages), and between words for Qwen's tokenizers (a shared document) — up to
    /// `max_tokens` ids in all, so that a conversation's history or a document sent again is
    /// not tokenized again. The ids are the same as without the cache; a tokenizer for which
    /// that cannot be guaranteed (the `segments` module says when) is refused with the
    /// reason, as is the fallback, which has nothing worth caching.
    pub fn cache_segments(&mut self, max_tokens: u64) -> Result<(), String> {
        match &mut self.kind {
            Kind::Hf { tokenizer, segments, between_words, .. } => {
                SegmentCache::supports(tokenizer)?;
                *segments = Some(SegmentCache::new(max_tokens, *between_words));
                Ok(())
            }
            Kind::Fallback => Err("the fallback tokenizer has nothing worth caching".into()),
        }
    }

    /// What the segment cache did so far; `None` without one.
    pub fn segment_cache_stats(&self) -> Option<SegmentCacheStats> {
        match &self.kind {
            Kind::Hf { segments: Some(cache), .. } => Some(cache.stats()),
            _ => None,
        }
    }

    /// The deterministic stand-in used when no tokenizer is configured: the UTF-8 bytes of
    /// the text, cut into groups of [`FALLBACK_BYTES_PER_TOKEN`] bytes, each group mapped to
    /// `FALLBACK_FIRST_ID + fnv1a64(group) % FALLBACK_VOCAB`. Texts sharing a prefix share
    /// the token ids of that prefix (except a trailing partial group), as with real
    /// tokenizers; chats are rendered with a ChatML-style template first.
    pub fn fallback() -> Self {
        Self { kind: Kind::Fallback }
    }

    /// True for the real tokenizer, false for the fallback.
    pub fn is_exact(&self) -> bool {
        matches!(self.kind, Kind::Hf { .. })
    }

    /// Token ids of a completions prompt. vLLM's default is `add_special_tokens = true`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.kind {
            Kind::Hf { tokenizer, segments: Some(cache), .. }
                if text.len() >= MIN_CACHED_BYTES
                    && (!add_special_tokens || tokenizer.get_post_processor().single.n_special() == 0) =>
            {
                let mut ids = Vec::with_capacity(text.len() / 3);
                cache.encode_into(tokenizer, text, &mut ids).map_err(|e| TokenizeError::Encode(e.to_string()))?;
                Ok(ids)
            }
            Kind::Hf { tokenizer, .. } => {
                let options = EncodeOptions { add_special_tokens, ..EncodeOptions::default() };
                let mut out: Vec<PipelineToken> = Vec::with_capacity(text.len() / 3);
                tokenizer.encode_into(text, &options, &mut out).map_err(|e| TokenizeError::Encode(e.to_string()))?;
                Ok(out.into_iter().map(PipelineToken::id).collect())
            }
            Kind::Fallback => Ok(fallback_encode(text)),
        }
    }

    /// The prompt text vLLM builds from chat messages (template applied).
    pub fn render_chat(&self, messages: &[Value], options: &ChatOptions) -> Result<String, TokenizeError> {
        match &self.kind {
            Kind::Hf { chat: Some(template), .. } => template.render(messages, options),
            Kind::Hf { chat: None, .. } => Err(TokenizeError::Request(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json)".into(),
            )),
            Kind::Fallback => fallback_chat_template().render(messages, options),
        }
    }

    /// Token ids of a chat request: the rendered template, encoded without adding special
    /// tokens (vLLM's chat default; the template already contains them).
    /// What this tokenizer's chat template makes vLLM do with Messages requests.
    pub fn template_traits(&self) -> TemplateTraits {
        match &self.kind {
            Kind::Hf { chat: Some(template), .. } => template.traits(),
            Kind::Hf { chat: None, .. } => TemplateTraits::default(),
            Kind::Fallback => fallback_chat_template().traits(),
        }
    }

    /// Renders and encodes an Anthropic Messages request as vLLM does.
    pub fn encode_messages_request(&self, request: &MessagesRequest) -> Result<Vec<u32>, TokenizeError> {
        let (messages, options) = request.to_chat(self.template_traits())?;
        self.encode_chat(&messages, &options)
    }

    /// Renders and encodes an OpenAI Responses request as vLLM does.
    pub fn encode_responses_request(&self, request: &ResponsesRequest) -> Result<Vec<u32>, TokenizeError> {
        let (messages, options) = request.to_chat()?;
        self.encode_chat(&messages, &options)
    }

    pub fn encode_chat(&self, messages: &[Value], options: &ChatOptions) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages, options)?;
        self.encode(&text, false)
    }

    /// Text of token ids (special tokens skipped). The fallback cannot invert its hash and
    /// returns `None`.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        match &self.kind {
            Kind::Hf { tokenizer, .. } => tokenizer.decode(ids, true).ok(),
            Kind::Fallback => None,
        }
    }

    /// The token string of one id (e.g. `Ġthe`), as `/tokenize` reports with `return_token_strs`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.kind {
            Kind::Hf { tokenizer, .. } => tokenizer.decode_tokens(&[id], false).into_iter().next(),
            Kind::Fallback => None,
        }
    }
}

fn load_chat_template(config_path: &Path) -> Result<Option<ChatTemplate>, TokenizeError> {
    let text = std::fs::read_to_string(config_path)
        .map_err(|source| TokenizeError::Io { path: config_path.into(), source })?;
    let config: Value = serde_json::from_str(&text)
        .map_err(|e| TokenizeError::Load { path: config_path.into(), message: e.to_string() })?;
    let template = match config.get("chat_template") {
        Some(Value::String(s)) => s.clone(),
        // A list of named templates: HF picks the one named "default".
        Some(Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| TokenizeError::Load {
                path: config_path.into(),
                message: "chat_template list has no entry named 'default'".into(),
            })?,
        _ => return Ok(None),
    };
    let token = |key: &str| match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_owned(),
        _ => String::new(),
    };
    ChatTemplate::new(template, token("bos_token"), token("eos_token")).map(Some)
}

fn fallback_encode(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(FALLBACK_BYTES_PER_TOKEN)
        .map(|group| FALLBACK_FIRST_ID + (fnv1a64(group) % u64::from(FALLBACK_VOCAB)) as u32)
        .collect()
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then the assistant header.
fn fallback_chat_template() -> &'static ChatTemplate {
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                          {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    static TEMPLATE: std::sync::LazyLock<ChatTemplate> = std::sync::LazyLock::new(|| {
        ChatTemplate::new(CHATML.into(), String::new(), String::new()).expect("the ChatML template compiles")
    });
    &TEMPLATE
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fallback_is_deterministic_and_prefix_stable() {
        let t = Tokenizer::fallback();
        let a = t.encode("The quick brown fox jumps", true).unwrap();
        let b = t.encode("The quick brown fox jumps over the lazy dog", true).unwrap();
        assert_eq!(a.len(), 7); // 25 bytes → 6 full groups + 1 partial
        assert_eq!(a[..6], b[..6]);
        assert!(a.iter().all(|&id| (FALLBACK_FIRST_ID..FALLBACK_FIRST_ID + FALLBACK_VOCAB).contains(&id)));
        assert_eq!(a, t.encode("The quick brown fox jumps", false).unwrap());
    }

    #[test]
    fn fallback_chat_is_chatml() {
        let t = Tokenizer::fallback();
        let text = t
            .render_chat(
                &[json!({"role": "system", "content": "S"}), json!({"role": "user", "content": "U"})],
                &ChatOptions::default(),
            )
            .unwrap();
        assert_eq!(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
        assert!(t.render_chat(&[], &ChatOptions::default()).is_err());
    }
}
