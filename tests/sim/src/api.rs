//! The OpenAI-compatible request bodies vLLM accepts, as far as the simulator needs them,
//! and vLLM's error body.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// An error answered in vLLM's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into() }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::CONFLICT => "ConflictError",
            _ => "InternalServerError",
        };
        let body =
            json!({"error": {"message": self.message, "type": kind, "param": null, "code": self.status.as_u16()}});
        (self.status, Json(body)).into_response()
    }
}

/// Parses a JSON body into `T`, turning syntax and type errors into clear 400s.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("request body must be a JSON object"));
    }
    serde_json::from_value(value).map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `prompt` of `/v1/completions`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// Fields both endpoints share.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u32>,
    pub n: Option<u32>,
    /// vLLM's per-request cache isolation salt (part of the first block's hash).
    pub cache_salt: Option<String>,
    /// NIXL P/D parameters (`do_remote_decode` on the prefill leg, `do_remote_prefill` +
    /// the prefill's reply on the decode leg).
    pub kv_transfer_params: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<Prompt>,
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Option<Vec<Value>>,
    pub max_completion_tokens: Option<u32>,
    pub tools: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub reasoning_effort: Option<String>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    #[serde(default)]
    pub continue_final_message: bool,
    #[serde(default)]
    pub add_special_tokens: bool,
    #[serde(flatten)]
    pub common: Common,
}

/// `POST /tokenize`: either a completions `prompt` or chat `messages`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Value>>,
    pub add_special_tokens: Option<bool>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    #[serde(default)]
    pub continue_final_message: bool,
    pub tools: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub reasoning_effort: Option<String>,
    #[serde(default)]
    pub return_token_strs: bool,
}

fn yes() -> bool {
    true
}
