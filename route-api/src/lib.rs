//! The wire contract between kvgate's Envoy filter (proxy-wasm) and its scorer sidecar.
//!
//! Both sides compile this crate (the filter for `wasm32-wasip1`), so a field renamed on one
//! side cannot silently drift from the other.
//!
//! **Route** — `POST /v1/route`: the body is the client's request body, verbatim (the filter
//! does not re-encode it); the request's metadata travels in headers:
//! [`HEADER_REQUEST_ID`] and [`HEADER_API_PATH`]. The scorer answers 200 with a
//! [`RouteResponse`], 400 with an [`ErrorBody`] for a request it cannot parse, 503 with an
//! [`ErrorBody`] when no pod is eligible. `?explain=1` adds per-pod figures.
//!
//! **Lifecycle** — `POST /v1/lifecycle` with a [`LifecycleBatch`]: the filter reports each
//! routed request's first token and end, batched, so the scorer can release its bookings.

use serde::{Deserialize, Serialize};

/// Request id of the routed request (the filter forwards or generates `x-request-id`).
pub const HEADER_REQUEST_ID: &str = "x-request-id";
/// The client's API path (`/v1/completions` or `/v1/chat/completions`).
pub const HEADER_API_PATH: &str = "x-kvgate-api-path";
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
    /// Linear-equivalent prefill tokens already queued on the pod (kvgate's bookings).
    pub queued_prefill_tokens: u64,
    /// Predicted KV blocks held by in-flight requests.
    pub decode_blocks: f64,
    pub inflight_requests: u32,
    /// The policy's cost (lower wins); absent when the policy did not score this pod.
    pub cost: Option<f64>,
    pub chosen: bool,
}

/// An error answer, in the OpenAI shape clients already parse.
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
}

/// What happened to a routed request.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LifecycleEvent {
    /// The first response bytes arrived: prefill is over.
    FirstToken,
    /// The response completed.
    Done,
    /// The client went away or the upstream failed.
    Cancelled,
    /// The prefill leg of a disaggregated request finished (answered, failed or timed out).
    PrefillDone,
}

/// One report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LifecycleReport {
    pub request_id: String,
    pub event: LifecycleEvent,
    /// Completion tokens, when the response carried `usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u32>,
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
    fn wire_shapes_are_stable() {
        let r = RouteResponse {
            decode: "10.0.0.7:8000".into(),
            prefill: None,
            pod: "pod-a".into(),
            prefill_pod: None,
            path: RoutePath::Direct,
            uncached_tokens: 10,
            threshold_tokens: None,
            policy: "kv".into(),
            prompt_tokens: 10,
            cached_tokens: 0,
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
        let batch: LifecycleBatch = serde_json::from_str(
            r#"{"reports":[{"request_id":"a","event":"first_token"},{"request_id":"a","event":"done","output_tokens":5}]}"#,
        )
        .unwrap();
        assert_eq!(batch.reports[1].event, LifecycleEvent::Done);
        assert_eq!(batch.reports[1].output_tokens, Some(5));
        let prefill: LifecycleReport = serde_json::from_str(r#"{"request_id":"a","event":"prefill_done"}"#).unwrap();
        assert_eq!(prefill.event, LifecycleEvent::PrefillDone);
        let e = serde_json::to_value(ErrorBody::new(503, "ServiceUnavailable", "no pod")).unwrap();
        assert_eq!(e["error"]["type"], "ServiceUnavailable");
    }
}
