//! What kvgate's proxies and its scorer share: the route protocol's messages ([`wire`]), the
//! lifecycle of a routed request ([`lifecycle`]), and the HTTP API's JSON.
//!
//! Both sides compile this crate (the wasm filter for `wasm32-wasip1`), so a field renamed on
//! one side cannot silently drift from the other.
//!
//! **Route protocol** — how the proxies ask (see [`wire`]): the filter keeps a gRPC stream per
//! Envoy worker open ([`ROUTE_STREAM_SERVICE`]/[`ROUTE_STREAM_METHOD`]), the native module a
//! length-framed route socket ([`ROUTE_SOCKET_PREFACE`]); [`RouteCall`]s go in, typed
//! [`RouteAnswer`]s (a [`RoutePick`] or a [`Refusal`]) come back in any order, matched by
//! `call`; lifecycle reports ride on calls ([`RouteCall::reports`]).
//!
//! **HTTP API** — the same picking by hand or from other clients: `POST /v1/route` (the body is
//! the client's request body, verbatim; its metadata in headers [`HEADER_REQUEST_ID`],
//! [`HEADER_API_PATH`], [`HEADER_OBJECTIVE`]) answers 200 with a [`RouteResponse`], or an
//! [`ErrorBody`] with the status of its [`Refused`] reason (`Retry-After` with a 429);
//! `?explain=1` adds per-pod figures. `POST /v1/lifecycle` takes a [`LifecycleBatch`] (the wasm
//! filter's reports while its route stream is down).
//!
//! Also shared: which request paths are routed ([`Api`]), the first check of a request body
//! ([`starts_as_object`]) and the scan of a response for its output size
//! ([`output_tokens`]).

pub mod lifecycle;
pub mod trace;
mod wire;

pub use wire::*;

use serde::{Deserialize, Serialize};

/// The APIs kvgate routes (vLLM's OpenAI-compatible ones, OpenAI's Responses and Anthropic's
/// Messages), by request path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr)]
#[strum(serialize_all = "lowercase")]
pub enum Api {
    Completions,
    #[strum(serialize = "chat")]
    ChatCompletions,
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
}

impl Api {
    /// Every routed API.
    pub const ALL: [Api; 4] = [Api::Completions, Api::ChatCompletions, Api::Messages, Api::Responses];
    /// Every routed path.
    pub const PATHS: [&'static str; 4] = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"];

    /// The API of a request path (query string ignored); `None` for anything else.
    pub fn from_path(path: &str) -> Option<Api> {
        let path = path.split('?').next().unwrap_or_default();
        Api::ALL.into_iter().find(|api| api.path() == path)
    }

    /// Its request path.
    pub fn path(self) -> &'static str {
        Api::PATHS[self as usize]
    }

    /// Its name in metrics.
    pub fn label(self) -> &'static str {
        self.into()
    }
}

/// The 400 message for a body that is not a JSON object.
pub const NOT_AN_OBJECT: &str = "request body must be a JSON object";

/// Whether the first non-blank byte opens an object.
pub fn starts_as_object(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// What a response's `usage` says, as far as one chunk of it shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Its last `"completion_tokens": N` (OpenAI usage, of a non-streaming answer or a
    /// stream's usage chunk) or `"output_tokens": N` (Anthropic and Responses usage; a
    /// stream's `message_delta` or `response.completed` carries the final count).
    pub output_tokens: Option<u32>,
    /// Prompt tokens the engine served from its prefix cache: its last `"cached_tokens": N`
    /// (OpenAI `prompt_tokens_details`, Responses `input_tokens_details`; vLLM reports it
    /// with `--enable-prompt-tokens-details`) or `"cache_read_input_tokens": N` (Anthropic).
    pub cached_tokens: Option<u32>,
}

impl Usage {
    /// The usage figures a response chunk holds.
    pub fn of(chunk: &[u8]) -> Usage {
        Usage {
            output_tokens: last_count(chunk, &[b"\"completion_tokens\"", b"\"output_tokens\""]),
            cached_tokens: last_count(chunk, &[b"\"cached_tokens\"", b"\"cache_read_input_tokens\""]),
        }
    }

    /// This chunk's figures over the earlier ones (a stream's later usage is the final one).
    pub fn update(&mut self, chunk: &[u8]) {
        let seen = Usage::of(chunk);
        self.output_tokens = seen.output_tokens.or(self.output_tokens);
        self.cached_tokens = seen.cached_tokens.or(self.cached_tokens);
    }
}

/// The number after the last of `keys` in `chunk` (`"key": N`); `None` if the last is
/// followed by no number (`null`, or the chunk ends).
fn last_count(chunk: &[u8], keys: &[&[u8]]) -> Option<u32> {
    let (at, key) = keys
        .iter()
        .filter_map(|key| Some((chunk.windows(key.len()).rposition(|w| w == *key)?, key)))
        .max_by_key(|(at, _)| *at)?;
    let rest = &chunk[at + key.len()..];
    let rest = rest.iter().position(|b| !b.is_ascii_whitespace() && *b != b':').map(|i| &rest[i..])?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// Request id of the routed request (the filter forwards or generates `x-request-id`).
pub const HEADER_REQUEST_ID: &str = "x-request-id";
/// The client's API path (one of [`Api::PATHS`]).
pub const HEADER_API_PATH: &str = "x-kvgate-api-path";
/// The request's objective (the Gateway API Inference Extension's InferenceObjective
/// convention), which sets its priority under overload; forwarded from the client.
pub const HEADER_OBJECTIVE: &str = "x-gateway-inference-objective";
/// Path of the route call on the scorer.
pub const ROUTE_PATH: &str = "/v1/route";
/// Path of the lifecycle call on the scorer.
pub const LIFECYCLE_PATH: &str = "/v1/lifecycle";

/// Whether a request is served by one pod, or prefilled on one and decoded on another.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RoutePath {
    /// One pod prefills and decodes.
    #[default]
    Direct,
    /// Prefill/decode disaggregation: `prefill` computes the KV, `decode` pulls it.
    Pd,
}

/// The scorer's decision.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RouteResponse {
    /// `ip:port` of the pod that serves the request (decodes it, under disaggregation).
    pub decode: String,
    /// The next-best pods, best first (`ip:port`): where Envoy retries when `decode`
    /// refuses the connection (they follow it in the destination header).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<String>,
    /// `ip:port` of the pod that should prefill it first, when disaggregated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<String>,
    /// Name of the chosen (decode) pod (for logs and headers).
    pub pod: String,
    /// Name of the prefill pod, when disaggregated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_pod: Option<String>,
    /// Direct or disaggregated.
    #[serde(default)]
    pub path: RoutePath,
    /// Uncached prompt tokens on the best decode-capable pod: what the P/D threshold weighs.
    #[serde(default)]
    pub uncached_tokens: u32,
    /// The P/D threshold the decision compared them with (absent without prefill pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold_tokens: Option<u32>,
    /// The policy that decided.
    pub policy: String,
    /// Prompt tokens of the request, as the engine will count them.
    pub prompt_tokens: u32,
    /// Of those, the tokens the chosen pod holds in its prefix cache.
    pub cached_tokens: u32,
    /// The model the pods must be asked for, when a model rewrite changed the client's: the
    /// caller sends the body on with this `model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Per-pod figures, with `?explain=1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<PodExplain>>,
}

/// Why a pod got the cost it got.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PodExplain {
    pub pod: String,
    pub address: String,
    pub cached_blocks: u32,
    pub cached_tokens: u32,
    /// Prompt tokens past `cached_tokens` the pod holds offloaded (host memory, storage): it
    /// loads them instead of computing them.
    #[serde(default)]
    pub offloaded_tokens: u32,
    /// Linear-equivalent prefill tokens already queued on the pod (kvgate's bookings).
    pub queued_prefill_tokens: u64,
    /// Predicted KV blocks held by in-flight requests.
    pub decode_blocks: f64,
    pub inflight_requests: u32,
    /// The pod's prefill time relative to the fleet's average, learned online (its costs
    /// are scaled by it).
    #[serde(default = "average_speed")]
    pub slowness: f64,
    /// The policy's cost (lower wins); absent when the policy did not score this pod.
    pub cost: Option<f64>,
    pub chosen: bool,
}

fn average_speed() -> f64 {
    1.0
}

/// An error answer, in the OpenAI shape clients already parse (Anthropic's on the Messages
/// API: [`ErrorBody::to_json_for`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub code: u16,
}

impl ErrorBody {
    pub fn new(code: u16, kind: &str, message: impl Into<String>) -> Self {
        Self { error: ErrorDetail { message: message.into(), kind: kind.to_string(), code } }
    }

    /// The body a client gets for a refusal: its status and type, and `message`.
    pub fn refused(refused: Refused, message: impl Into<String>) -> Self {
        Self::new(refused.status(), refused.error_type(), message)
    }

    /// As JSON.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// As JSON in the shape the clients of `api` read: on the Messages API Anthropic's
    /// (`{"type": "error", "error": {"type", "message"}}`, its `type` named by status as vLLM
    /// names it — Anthropic's SDKs dispatch on it), elsewhere OpenAI's.
    pub fn to_json_for(&self, api: Option<Api>) -> Vec<u8> {
        if api != Some(Api::Messages) {
            return self.to_json();
        }
        let kind = match self.error.code {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            code if code >= 500 => "api_error",
            _ => "invalid_request_error",
        };
        let body = serde_json::json!({"type": "error", "error": {"type": kind, "message": self.error.message}});
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec())
    }
}

/// What happened to a routed request.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[serde(rename_all = "snake_case")]
#[repr(i32)]
pub enum LifecycleEvent {
    /// The first response bytes arrived: prefill is over.
    FirstToken = 0,
    /// The response completed.
    Done = 1,
    /// The client went away or the upstream failed.
    Cancelled = 2,
    /// The prefill leg of a disaggregated request finished (answered, failed or timed out).
    PrefillDone = 3,
    /// The response was an error status: the engine refused the request (4xx: an unknown
    /// model, a prompt too long) or failed it (5xx), or the proxy found no way to it. No
    /// token came.
    ErrorStatus = 4,
}

/// One report.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LifecycleReport {
    pub request_id: String,
    pub event: LifecycleEvent,
    /// `ip:port` of the pod that answered (Envoy may have retried a fallback): reported
    /// with the first token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<String>,
    /// Completion tokens, when the response carried `usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u32>,
    /// Prompt tokens the engine served from its cache, when its `usage` said (with `done`):
    /// the scorer holds it against what it predicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
    /// The response's status, with `error_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Microseconds from the event to the sending of its batch (a proxy that batches its
    /// reports says how old each is, so the scorer dates the first token and the end where
    /// they happened); absent = just now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_us: Option<u32>,
}

impl LifecycleReport {
    /// A report of `event` alone.
    pub fn new(request_id: impl Into<String>, event: LifecycleEvent) -> Self {
        Self { request_id: request_id.into(), event, ..Default::default() }
    }

    /// The last report of a request that ended as `end` says.
    pub fn ended(request_id: impl Into<String>, end: &lifecycle::End) -> Self {
        Self {
            output_tokens: end.usage.output_tokens,
            cached_tokens: end.usage.cached_tokens,
            status: end.status,
            ..Self::new(request_id, end.event)
        }
    }
}

/// `POST /v1/lifecycle` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
pub struct LifecycleBatch {
    pub reports: Vec<LifecycleReport>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_apis() {
        assert_eq!(Api::from_path("/v1/completions"), Some(Api::Completions));
        assert_eq!(Api::from_path("/v1/chat/completions?x=1"), Some(Api::ChatCompletions));
        assert_eq!(Api::from_path("/v1/messages"), Some(Api::Messages));
        assert_eq!(Api::from_path("/v1/responses"), Some(Api::Responses));
        assert_eq!(Api::from_path("/v1/embeddings"), None);
        assert!(Api::PATHS.iter().all(|p| Api::from_path(p).is_some_and(|api| api.path() == *p)));
    }

    #[test]
    fn only_bodies_opening_an_object_pass_the_first_check() {
        assert!(starts_as_object(br#" {"prompt": "x"}"#));
        for bad in [&b""[..], b"[]", b"\"text\"", b"\xff\xfe{}", b"  "] {
            assert!(!starts_as_object(bad), "{bad:?}");
        }
    }

    #[test]
    fn usage_is_found_in_chunks() {
        let output_tokens = |chunk: &[u8]| Usage::of(chunk).output_tokens;
        assert_eq!(
            output_tokens(br#"{"usage":{"prompt_tokens":9,"completion_tokens":42,"total_tokens":51}}"#),
            Some(42)
        );
        assert_eq!(output_tokens(b"data: {\"usage\": {\"completion_tokens\" : 7}}\n\ndata: [DONE]"), Some(7));
        assert_eq!(output_tokens(b"data: {\"choices\":[]}"), None);
        assert_eq!(output_tokens(b"\"completion_tokens\":"), None);
        // Anthropic's: the usage of a whole message, and a stream's start (1) then delta (12).
        assert_eq!(output_tokens(br#"{"usage":{"input_tokens":9,"output_tokens":5}}"#), Some(5));
        let stream =
            b"event: message_start\ndata: {\"message\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":1}}}\n\n\
            event: message_delta\ndata: {\"delta\":{},\"usage\":{\"output_tokens\":12}}\n\n";
        assert_eq!(output_tokens(stream), Some(12));
        // Quoted in generated text, the key is escaped and does not count.
        assert_eq!(output_tokens(br#"{"delta":{"text":"\"output_tokens\": 3"}}"#), None);
    }

    #[test]
    fn cached_tokens_are_found_in_each_apis_usage_as_vllm_writes_it() {
        // vLLM 0.32's usage of each API (trimmed), with --enable-prompt-tokens-details.
        let chat = br#"data: {"choices":[],"usage":{"prompt_tokens":298,"total_tokens":301,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":288,"created_cache_tokens":0}}}"#;
        let messages = br#"data: {"type":"message_delta","usage":{"input_tokens":10,"output_tokens":3,"cache_creation_input_tokens":0,"cache_read_input_tokens":288}}"#;
        let responses = br#"{"usage":{"input_tokens":298,"input_tokens_details":{"cached_tokens":288,"cache_write_tokens":0,"input_tokens_per_turn":[],"cached_tokens_per_turn":[]},"output_tokens":3}}"#;
        for chunk in [&chat[..], messages, responses] {
            assert_eq!(Usage::of(chunk), Usage { output_tokens: Some(3), cached_tokens: Some(288) });
        }
        // Without the details vLLM writes none; a null is no figure.
        assert_eq!(Usage::of(br#"{"usage":{"prompt_tokens":9,"completion_tokens":1}}"#).cached_tokens, None);
        assert_eq!(Usage::of(br#"{"prompt_tokens_details":{"cached_tokens":null}}"#).cached_tokens, None);
        // A stream's figures stay as later chunks without usage pass.
        let mut usage = Usage::default();
        usage.update(chat);
        usage.update(b"data: [DONE]");
        assert_eq!(usage, Usage { output_tokens: Some(3), cached_tokens: Some(288) });
    }

    #[test]
    fn wire_shapes_are_stable() {
        let r = RouteResponse {
            decode: "10.0.0.7:8000".into(),
            fallbacks: Vec::new(),
            prefill: None,
            pod: "pod-a".into(),
            prefill_pod: None,
            path: RoutePath::Direct,
            uncached_tokens: 10,
            threshold_tokens: None,
            policy: "kv".into(),
            prompt_tokens: 10,
            cached_tokens: 0,
            model: None,
            explain: None,
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"decode":"10.0.0.7:8000","pod":"pod-a","path":"direct","uncached_tokens":10,"policy":"kv","prompt_tokens":10,"cached_tokens":0}"#
        );
        let pd: RouteResponse = serde_json::from_str(
            r#"{"decode":"d:1","prefill":"p:1","pod":"d","prefill_pod":"p","path":"pd","uncached_tokens":900,"policy":"kv","prompt_tokens":1000,"cached_tokens":0}"#,
        )
        .unwrap();
        assert_eq!((pd.path, pd.prefill.as_deref()), (RoutePath::Pd, Some("p:1")));
        assert!(pd.fallbacks.is_empty());
        let with: RouteResponse = serde_json::from_str(
            r#"{"decode":"d:1","fallbacks":["e:1","f:1"],"pod":"d","policy":"kv","prompt_tokens":1,"cached_tokens":0}"#,
        )
        .unwrap();
        assert_eq!(with.fallbacks, ["e:1", "f:1"]);
        let batch: LifecycleBatch = serde_json::from_str(
            r#"{"reports":[{"request_id":"a","event":"first_token","served":"10.0.0.8:8000"},{"request_id":"a","event":"done","output_tokens":5}]}"#,
        )
        .unwrap();
        assert_eq!(batch.reports[1].event, LifecycleEvent::Done);
        assert_eq!(batch.reports[1].output_tokens, Some(5));
        assert_eq!(batch.reports[0].served.as_deref(), Some("10.0.0.8:8000"));
        let prefill: LifecycleReport = serde_json::from_str(r#"{"request_id":"a","event":"prefill_done"}"#).unwrap();
        assert_eq!(prefill.event, LifecycleEvent::PrefillDone);
        let anthropic = ErrorBody::new(429, "TooManyRequests", "busy").to_json_for(Some(Api::Messages));
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&anthropic).unwrap(),
            serde_json::json!({"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}})
        );
        let openai = ErrorBody::new(429, "TooManyRequests", "busy");
        assert_eq!(openai.to_json_for(Some(Api::Responses)), openai.to_json());
        let e = serde_json::to_value(ErrorBody::new(503, "ServiceUnavailable", "no pod")).unwrap();
        assert_eq!(e["error"]["type"], "ServiceUnavailable");
    }
}
