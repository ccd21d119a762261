//! The wire contract between kvgate's Envoy filter (proxy-wasm) and its scorer sidecar.
//!
//! Both sides compile this crate (the filter for `wasm32-wasip1`), so a field renamed on one
//! side cannot silently drift from the other.
//!
//! **Route** — `POST /v1/route`: the body is the client's request body, verbatim (the filter
//! does not re-encode it); the request's metadata travels in headers:
//! [`HEADER_REQUEST_ID`] and [`HEADER_API_PATH`]. The scorer answers 200 with a
//! [`RouteResponse`], 400 with an [`ErrorBody`] for a request it cannot parse, 503 with an
//! [`ErrorBody`] when no pod is eligible, 429 with an [`ErrorBody`] and `Retry-After` when
//! the request was refused for overload (it may first wait in the scorer for room).
//! `?explain=1` adds per-pod figures.
//!
//! **Route stream** — the same exchange without a call per request: the gRPC
//! bidirectional stream [`ROUTE_STREAM_SERVICE`]/[`ROUTE_STREAM_METHOD`] (the filter keeps one
//! per Envoy worker open), [`RouteCall`] messages in, [`RouteAnswer`] messages out in any
//! order, matched by `call`. An answer carries what the call's HTTP answer would (status,
//! JSON body, `Retry-After`). The filter uses the stream; `POST /v1/route` serves everything
//! else (and is what people try by hand).
//!
//! **Lifecycle** — the filter reports each routed request's first token and end, batched
//! and each dated by its age, so the scorer can release its bookings: on the route stream
//! ([`RouteCall::reports`], riding on a route call or alone) while it is open, else
//! `POST /v1/lifecycle` with a [`LifecycleBatch`].
//!
//! Also shared by both sides: which request paths are routed ([`Api`]), the first check of a
//! request body ([`starts_as_object`]) and the scan of a response for its output size
//! ([`completion_tokens`]) — the Endpoint Picker reads responses the way the filter does.

use serde::{Deserialize, Serialize};

/// The OpenAI APIs kvgate routes, by request path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Api {
    Completions,
    ChatCompletions,
}

impl Api {
    /// Every routed path.
    pub const PATHS: [&'static str; 2] = ["/v1/completions", "/v1/chat/completions"];

    /// The API of a request path (query string ignored); `None` for anything else.
    pub fn from_path(path: &str) -> Option<Api> {
        match path.split('?').next().unwrap_or_default() {
            "/v1/completions" => Some(Api::Completions),
            "/v1/chat/completions" => Some(Api::ChatCompletions),
            _ => None,
        }
    }

    /// Its name in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::ChatCompletions => "chat",
        }
    }
}

/// The 400 message for a body that is not a JSON object.
pub const NOT_AN_OBJECT: &str = "request body must be a JSON object";

/// Whether the first non-blank byte opens an object.
pub fn starts_as_object(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// The last `"completion_tokens": N` in a response chunk (usage of a non-streaming answer, or
/// the usage chunk of a stream).
pub fn completion_tokens(chunk: &[u8]) -> Option<u32> {
    const KEY: &[u8] = b"\"completion_tokens\"";
    let at = chunk.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &chunk[at + KEY.len()..];
    let rest = rest.iter().position(|b| !b.is_ascii_whitespace() && *b != b':').map(|i| &rest[i..])?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// Request id of the routed request (the filter forwards or generates `x-request-id`).
pub const HEADER_REQUEST_ID: &str = "x-request-id";
/// The client's API path (`/v1/completions` or `/v1/chat/completions`).
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
}

/// One report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
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
    /// Microseconds from the event to the sending of its batch (a proxy that batches its
    /// reports says how old each is, so the scorer dates the first token and the end where
    /// they happened); absent = just now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_us: Option<u32>,
}

/// The route stream's gRPC service (package `kvgate.route.v1`).
pub const ROUTE_STREAM_SERVICE: &str = "kvgate.route.v1.Router";
/// Its one method: a bidirectional stream of [`RouteCall`] → [`RouteAnswer`].
pub const ROUTE_STREAM_METHOD: &str = "Route";
/// The method's gRPC path.
pub const ROUTE_STREAM_PATH: &str = "/kvgate.route.v1.Router/Route";

/// A route call on the stream: what `POST /v1/route` carries in its headers and body.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteCall {
    /// Chosen by the caller, unique among its calls in flight; echoed in the answer.
    #[prost(uint64, tag = "1")]
    pub call: u64,
    #[prost(string, tag = "2")]
    pub request_id: String,
    /// The client's API path (see [`HEADER_API_PATH`]).
    #[prost(string, tag = "3")]
    pub api_path: String,
    /// See [`HEADER_OBJECTIVE`].
    #[prost(string, optional, tag = "4")]
    pub objective: Option<String>,
    /// The client's request body, verbatim.
    #[prost(bytes = "vec", tag = "5")]
    pub body: Vec<u8>,
    /// Lifecycle reports riding on the stream, applied before the call. A message with an
    /// empty `api_path` is no route call: it carries reports only and is not answered.
    #[prost(message, repeated, tag = "6")]
    pub reports: Vec<StreamReport>,
}

/// A [`LifecycleReport`] on the route stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamReport {
    #[prost(string, tag = "1")]
    pub request_id: String,
    #[prost(enumeration = "LifecycleEvent", tag = "2")]
    pub event: i32,
    #[prost(string, optional, tag = "3")]
    pub served: Option<String>,
    #[prost(uint32, optional, tag = "4")]
    pub output_tokens: Option<u32>,
    #[prost(uint32, optional, tag = "5")]
    pub age_us: Option<u32>,
}

impl From<LifecycleReport> for StreamReport {
    fn from(r: LifecycleReport) -> Self {
        Self {
            request_id: r.request_id,
            event: r.event.into(),
            served: r.served,
            output_tokens: r.output_tokens,
            age_us: r.age_us,
        }
    }
}

impl TryFrom<StreamReport> for LifecycleReport {
    /// The event number, when it names no event.
    type Error = i32;

    fn try_from(r: StreamReport) -> Result<Self, i32> {
        Ok(Self {
            request_id: r.request_id,
            event: LifecycleEvent::try_from(r.event).map_err(|_| r.event)?,
            served: r.served,
            output_tokens: r.output_tokens,
            age_us: r.age_us,
        })
    }
}

/// The answer to a [`RouteCall`] — or, with `call` 0, a notice: requests started waiting for
/// admission, or none waits any more (`admission_waiting`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteAnswer {
    /// The call answered (callers number theirs from 1); 0 for a notice.
    #[prost(uint64, tag = "1")]
    pub call: u64,
    /// The HTTP status `POST /v1/route` would answer (200, 400, 429, 503).
    #[prost(uint32, tag = "2")]
    pub status: u32,
    /// A [`RouteResponse`] (200) or an [`ErrorBody`], JSON.
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
    /// Seconds, with a 429.
    #[prost(uint64, optional, tag = "4")]
    pub retry_after: Option<u64>,
    /// Requests waiting in the scorer's admission queue as it answered. While some wait, a
    /// proxy sends its lifecycle reports at once instead of batching them: each first token
    /// and end frees room that a waiting request (a premium one, say) is owed now.
    #[prost(uint32, tag = "5")]
    pub admission_waiting: u32,
}

/// Opens a **route socket**: the route stream's messages without HTTP/2 or gRPC, for a
/// caller that keeps its own connection to the scorer's API port (the filter's native
/// module). The caller writes this preface first, then [`RouteCall`]s; the scorer writes
/// [`RouteAnswer`]s; each message framed as its length (4 bytes, big-endian) and its
/// protobuf encoding. HTTP/1 and HTTP/2 clients never start this way, so the scorer tells
/// them apart by the first bytes.
pub const ROUTE_SOCKET_PREFACE: &[u8] = b"KVGATE-ROUTE/1\r\n\r\n";

/// Largest message on a route socket (a call carries the client's whole body).
pub const ROUTE_SOCKET_MAX_MESSAGE: usize = (64 << 20) + (64 << 10);

/// Appends `message`, framed for a route socket, to `out`.
pub fn frame(message: &impl prost::Message, out: &mut Vec<u8>) {
    let len = message.encoded_len();
    out.reserve(4 + len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    // Cannot fail: `Vec` grows as needed.
    let _ = message.encode(out);
}

/// Reads framed messages out of the bytes a route socket delivers, however they are cut.
#[derive(Default)]
pub struct Frames {
    buffer: Vec<u8>,
    /// Bytes of `buffer` already handed out as messages.
    start: usize,
}

impl Frames {
    /// Where the next read from the socket goes: at least `room` free bytes at the end.
    pub fn spare(&mut self, room: usize) -> &mut Vec<u8> {
        if self.start > 0 && self.start == self.buffer.len() {
            self.buffer.clear();
            self.start = 0;
        } else if self.start > self.buffer.capacity() / 2 {
            self.buffer.drain(..self.start);
            self.start = 0;
        }
        self.buffer.reserve(room);
        &mut self.buffer
    }

    /// The next whole message, if one has arrived; an error for a frame longer than the
    /// limit or a message that does not decode (the connection is then beyond repair).
    pub fn message<M: prost::Message + Default>(&mut self) -> Result<Option<M>, String> {
        let waiting = &self.buffer[self.start..];
        let Some(head) = waiting.first_chunk::<4>() else { return Ok(None) };
        let len = u32::from_be_bytes(*head) as usize;
        if len > ROUTE_SOCKET_MAX_MESSAGE {
            return Err(format!("a route socket message of {len} bytes (at most {ROUTE_SOCKET_MAX_MESSAGE})"));
        }
        let Some(body) = waiting.get(4..4 + len) else { return Ok(None) };
        let message = M::decode(body).map_err(|e| format!("an unreadable route socket message: {e}"))?;
        self.start += 4 + len;
        Ok(Some(message))
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
    fn route_socket_frames_survive_any_cut() {
        let calls: Vec<RouteCall> = (0..3)
            .map(|i| RouteCall {
                call: i,
                request_id: format!("r{i}"),
                body: vec![b'x'; 100 * i as usize],
                ..Default::default()
            })
            .collect();
        let mut wire = Vec::new();
        for call in &calls {
            frame(call, &mut wire);
        }
        for piece in [1, 3, 7, 64, wire.len()] {
            let mut frames = Frames::default();
            let mut read = Vec::new();
            for bytes in wire.chunks(piece) {
                frames.spare(bytes.len()).extend_from_slice(bytes);
                while let Some(call) = frames.message::<RouteCall>().unwrap() {
                    read.push(call);
                }
            }
            assert_eq!(read, calls, "cut every {piece} bytes");
        }
        let mut frames = Frames::default();
        frames.spare(4).extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(frames.message::<RouteCall>().unwrap_err().contains("at most"));
        let mut frames = Frames::default();
        frames.spare(6).extend_from_slice(&[0, 0, 0, 2, 0xff, 0xff]);
        assert!(frames.message::<RouteCall>().unwrap_err().contains("unreadable"));
    }

    #[test]
    fn paths_map_to_apis() {
        assert_eq!(Api::from_path("/v1/completions"), Some(Api::Completions));
        assert_eq!(Api::from_path("/v1/chat/completions?x=1"), Some(Api::ChatCompletions));
        assert_eq!(Api::from_path("/v1/embeddings"), None);
        assert!(Api::PATHS.iter().all(|p| Api::from_path(p).is_some()));
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
        assert_eq!(
            completion_tokens(br#"{"usage":{"prompt_tokens":9,"completion_tokens":42,"total_tokens":51}}"#),
            Some(42)
        );
        assert_eq!(completion_tokens(b"data: {\"usage\": {\"completion_tokens\" : 7}}\n\ndata: [DONE]"), Some(7));
        assert_eq!(completion_tokens(b"data: {\"choices\":[]}"), None);
        assert_eq!(completion_tokens(b"\"completion_tokens\":"), None);
    }

    #[test]
    fn reports_cross_the_route_stream_unchanged() {
        use prost::Message;
        let report = LifecycleReport {
            request_id: "r-1".into(),
            event: LifecycleEvent::Done,
            served: Some("10.0.0.8:8000".into()),
            output_tokens: Some(42),
            age_us: Some(1500),
        };
        let call = RouteCall { reports: vec![report.clone().into()], ..Default::default() };
        let decoded = RouteCall::decode(call.encode_to_vec().as_slice()).unwrap();
        assert!(decoded.api_path.is_empty() && decoded.body.is_empty(), "reports only");
        let back: Vec<LifecycleReport> = decoded.reports.into_iter().map(|r| r.try_into().unwrap()).collect();
        assert_eq!(back, [report]);
        let stray = StreamReport { request_id: "x".into(), event: 9, ..Default::default() };
        assert_eq!(LifecycleReport::try_from(stray), Err(9));
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
        let e = serde_json::to_value(ErrorBody::new(503, "ServiceUnavailable", "no pod")).unwrap();
        assert_eq!(e["error"]["type"], "ServiceUnavailable");
    }
}
