//! The route protocol's messages: what a proxy and the scorer exchange on a route stream (gRPC)
//! or a route socket (length-framed), typed end to end — the pick, or why there is none.
//!
//! Versioned: the stream's service name and the socket's preface carry [`ROUTE_PROTOCOL`]; a
//! scorer refuses a proxy of another version at once, with a message naming both (a stream
//! fails with `FAILED_PRECONDITION`, a socket is closed), so a half-upgraded fleet fails in the
//! open (the proxy's failure mode) and says why, instead of misreading answers.

use crate::LifecycleReport;

/// The version of the route protocol this crate speaks (1: answers carried an HTTP status
/// and a JSON body; 2: typed answers).
pub const ROUTE_PROTOCOL: u32 = 2;

/// The route stream's gRPC service (package `kvgate.route.v2`).
pub const ROUTE_STREAM_SERVICE: &str = "kvgate.route.v2.Router";
/// Its one method: a bidirectional stream of [`RouteCall`] → [`RouteAnswer`].
pub const ROUTE_STREAM_METHOD: &str = "Route";
/// The method's gRPC path.
pub const ROUTE_STREAM_PATH: &str = "/kvgate.route.v2.Router/Route";
/// The gRPC path of the protocol's first version, which a scorer refuses by name.
pub const ROUTE_STREAM_V1_PATH: &str = "/kvgate.route.v1.Router/Route";

/// Opens a **route socket**: the route stream's messages without HTTP/2 or gRPC, for a
/// caller that keeps its own connection to the scorer (the filter's native module). The
/// caller writes this preface first, then [`RouteCall`]s; the scorer writes [`RouteAnswer`]s;
/// each message framed as its length (4 bytes, big-endian) and its protobuf encoding. HTTP/1
/// and HTTP/2 clients never start this way, so the scorer tells them apart by the first bytes.
pub const ROUTE_SOCKET_PREFACE: &[u8] = b"KVGATE-ROUTE/2\r\n\r\n";

/// What every version's preface starts with (the version follows).
pub const ROUTE_SOCKET_PREFACE_START: &[u8] = b"KVGATE-ROUTE/";

/// Largest request body a route call carries (Envoy's own limit applies first).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Largest message on a route socket or stream: a call carries the client's whole body.
pub const ROUTE_SOCKET_MAX_MESSAGE: usize = MAX_BODY_BYTES + (64 << 10);

/// A route call: the request to pick a pod for, and lifecycle reports riding along.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteCall {
    /// Chosen by the caller, unique among its calls in flight; echoed in the answer.
    #[prost(uint64, tag = "1")]
    pub call: u64,
    #[prost(string, tag = "2")]
    pub request_id: String,
    /// The client's API path (see [`crate::HEADER_API_PATH`]).
    #[prost(string, tag = "3")]
    pub api_path: String,
    /// See [`crate::HEADER_OBJECTIVE`].
    #[prost(string, optional, tag = "4")]
    pub objective: Option<String>,
    /// The client's request body, verbatim.
    #[prost(bytes = "vec", tag = "5")]
    pub body: Vec<u8>,
    /// Lifecycle reports riding on the stream, applied before the call. A message with an
    /// empty `api_path` is no route call: it carries reports only and is not answered.
    #[prost(message, repeated, tag = "6")]
    pub reports: Vec<StreamReport>,
    /// The request's W3C `traceparent` as the gateway's tracer made it (its span), which
    /// the scorer's spans of the decision join; absent when the gateway does not trace.
    #[prost(string, optional, tag = "7")]
    pub trace_parent: Option<String>,
    /// The caller applies a pick's [`RoutePick::model_rewrite`] to the body it sends on; a
    /// scorer refuses a call it would rewrite from a caller that does not (an older proxy),
    /// rather than let the pod be asked for a model it may not serve.
    #[prost(bool, tag = "8")]
    pub rewrites_model: bool,
}

/// A [`LifecycleReport`] on the route stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamReport {
    #[prost(string, tag = "1")]
    pub request_id: String,
    #[prost(enumeration = "crate::LifecycleEvent", tag = "2")]
    pub event: i32,
    #[prost(string, optional, tag = "3")]
    pub served: Option<String>,
    #[prost(uint32, optional, tag = "4")]
    pub output_tokens: Option<u32>,
    #[prost(uint32, optional, tag = "5")]
    pub age_us: Option<u32>,
    #[prost(uint32, optional, tag = "6")]
    pub cached_tokens: Option<u32>,
    #[prost(uint32, optional, tag = "7")]
    pub status: Option<u32>,
}

impl From<LifecycleReport> for StreamReport {
    fn from(r: LifecycleReport) -> Self {
        Self {
            request_id: r.request_id,
            event: r.event.into(),
            served: r.served,
            output_tokens: r.output_tokens,
            age_us: r.age_us,
            cached_tokens: r.cached_tokens,
            status: r.status.map(u32::from),
        }
    }
}

impl TryFrom<StreamReport> for LifecycleReport {
    /// The event number, when it names no event.
    type Error = i32;

    fn try_from(r: StreamReport) -> Result<Self, i32> {
        Ok(Self {
            request_id: r.request_id,
            event: crate::LifecycleEvent::try_from(r.event).map_err(|_| r.event)?,
            served: r.served,
            output_tokens: r.output_tokens,
            age_us: r.age_us,
            cached_tokens: r.cached_tokens,
            status: r.status.and_then(|s| u16::try_from(s).ok()),
        })
    }
}

/// The answer to a [`RouteCall`] — or, with `call` 0 and no outcome, a notice: requests
/// started waiting for admission, or none waits any more (`admission_waiting`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RouteAnswer {
    /// The call answered (callers number theirs from 1); 0 for a notice.
    #[prost(uint64, tag = "1")]
    pub call: u64,
    // Tags 2–4 were version 1's status, JSON body and Retry-After.
    /// Requests waiting in the scorer's admission queue as it answered. While some wait, a
    /// proxy sends its lifecycle reports at once instead of batching them: each first token
    /// and end frees room that a waiting request (a premium one, say) is owed now.
    #[prost(uint32, tag = "5")]
    pub admission_waiting: u32,
    #[prost(oneof = "Outcome", tags = "6, 7")]
    pub outcome: Option<Outcome>,
}

/// What became of a call.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Outcome {
    #[prost(message, tag = "6")]
    Pick(RoutePick),
    #[prost(message, tag = "7")]
    Refusal(Refusal),
}

/// The pod that serves the request, and where the proxy goes if it cannot.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RoutePick {
    /// `ip:port` of the pod that serves the request (decodes it, when disaggregated).
    #[prost(string, tag = "1")]
    pub decode: String,
    /// The next-best pods, best first (`ip:port`): where Envoy retries when `decode` refuses
    /// the connection (they follow it in the destination header).
    #[prost(string, repeated, tag = "2")]
    pub fallbacks: Vec<String>,
    /// `ip:port` of the pod that prefills it first, when disaggregated.
    #[prost(string, optional, tag = "3")]
    pub prefill: Option<String>,
    /// Name of the chosen (decode) pod, for logs.
    #[prost(string, tag = "4")]
    pub pod: String,
    /// The model the pods must be asked for, when a model rewrite (an alias, a split between
    /// versions) changed the client's: the caller rewrites the body before sending it on.
    #[prost(message, optional, tag = "5")]
    pub model_rewrite: Option<ModelRewrite>,
}

/// A rewrite of a request body's `model`: the JSON string at `at` (`len` bytes, quotes
/// included: the client's value) becomes `model`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelRewrite {
    #[prost(string, tag = "1")]
    pub model: String,
    #[prost(uint64, tag = "2")]
    pub at: u64,
    #[prost(uint64, tag = "3")]
    pub len: u64,
}

impl ModelRewrite {
    /// `body` with its model rewritten; an error when the span is not a JSON string of it.
    pub fn apply(&self, body: &[u8]) -> Result<Vec<u8>, String> {
        let span = usize::try_from(self.at)
            .ok()
            .zip(usize::try_from(self.len).ok())
            .and_then(|(at, len)| Some(at..at.checked_add(len)?))
            .filter(|span| {
                span.len() >= 2 && body.get(span.clone()).is_some_and(|s| s[0] == b'"' && s[s.len() - 1] == b'"')
            })
            .ok_or_else(|| format!("the model rewrite's span {}+{} is not a string of the body", self.at, self.len))?;
        let model = serde_json::to_string(&self.model).map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(body.len() - span.len() + model.len());
        out.extend_from_slice(&body[..span.start]);
        out.extend_from_slice(model.as_bytes());
        out.extend_from_slice(&body[span.end..]);
        Ok(out)
    }
}

impl RoutePick {
    /// The pick then its fallbacks, `ip:port,ip:port,…`: the value of the destination header
    /// (the GIE convention, which Envoy's `override_host` walks in order).
    pub fn destinations(&self) -> String {
        let mut out = self.decode.clone();
        for f in &self.fallbacks {
            out.push(',');
            out.push_str(f);
        }
        out
    }
}

/// Why no pod was picked.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Refusal {
    #[prost(enumeration = "Refused", tag = "1")]
    pub reason: i32,
    /// For the client (never prompt text).
    #[prost(string, tag = "2")]
    pub message: String,
    /// Seconds, when refused for overload.
    #[prost(uint64, optional, tag = "3")]
    pub retry_after: Option<u64>,
}

/// The picking service's refusals, and the one mapping of each to what a client gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum Refused {
    /// A reason this version does not know (a newer scorer's): a proxy treats it as the
    /// scorer failing.
    Unknown = 0,
    /// The request cannot be read (not JSON, no prompt, not a routed API).
    BadRequest = 1,
    /// Its body is over the limit.
    TooLarge = 2,
    /// Refused for overload: retry later.
    Overloaded = 3,
    /// No healthy pod can serve it.
    NoPod = 4,
    /// The scorer is stopping.
    Stopping = 5,
    /// No pod serves the model it names.
    ModelNotFound = 6,
}

impl Refused {
    /// The HTTP status the client gets.
    pub fn status(self) -> u16 {
        match self {
            Refused::BadRequest => 400,
            Refused::TooLarge => 413,
            Refused::ModelNotFound => 404,
            Refused::Overloaded => 429,
            Refused::NoPod | Refused::Stopping | Refused::Unknown => 503,
        }
    }

    /// The error `type` of the OpenAI-shaped error body.
    pub fn error_type(self) -> &'static str {
        match self {
            Refused::BadRequest => "BadRequestError",
            Refused::TooLarge => "PayloadTooLarge",
            Refused::ModelNotFound => "NotFoundError",
            Refused::Overloaded => "TooManyRequests",
            Refused::NoPod | Refused::Stopping | Refused::Unknown => "ServiceUnavailable",
        }
    }
}

impl Refusal {
    /// The reason, [`Refused::Unknown`] for a number this version does not know.
    pub fn refused(&self) -> Refused {
        Refused::try_from(self.reason).unwrap_or(Refused::Unknown)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LifecycleEvent;
    use prost::Message;

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
    fn a_model_rewrite_replaces_the_clients_model_string_and_nothing_else() {
        let body = br#"{"model": "l\u006cama", "messages": [{"role": "user", "content": "model"}]}"#;
        let at = body.windows(2).position(|w| w == b" \"").unwrap() as u64 + 1;
        let rewrite = ModelRewrite { model: "llama-\"v2\"".into(), at, len: 12 };
        let out: serde_json::Value = serde_json::from_slice(&rewrite.apply(body).unwrap()).unwrap();
        assert_eq!(out["model"], "llama-\"v2\"");
        assert_eq!(out["messages"][0]["content"], "model");
        for (at, len) in [(at + 1, 12), (at, 11), (at, 1), (u64::MAX, 2), (body.len() as u64, 2)] {
            let e = ModelRewrite { at, len, ..rewrite.clone() }.apply(body).unwrap_err();
            assert!(e.contains("not a string"), "{at}+{len}: {e}");
        }
    }

    #[test]
    fn reports_cross_the_route_stream_unchanged() {
        let report = LifecycleReport {
            request_id: "r-1".into(),
            event: LifecycleEvent::Done,
            served: Some("10.0.0.8:8000".into()),
            output_tokens: Some(42),
            age_us: Some(1500),
            cached_tokens: Some(96),
            status: None,
        };
        let call = RouteCall { reports: vec![report.clone().into()], ..Default::default() };
        let decoded = RouteCall::decode(call.encode_to_vec().as_slice()).unwrap();
        assert!(decoded.api_path.is_empty() && decoded.body.is_empty(), "reports only");
        let back: Vec<LifecycleReport> = decoded.reports.into_iter().map(|r| r.try_into().unwrap()).collect();
        assert_eq!(back, [report]);
        let stray = StreamReport { request_id: "x".into(), event: 9, ..Default::default() };
        assert_eq!(LifecycleReport::try_from(stray), Err(9));
    }

    /// The protocol's bytes, pinned: a proxy and a scorer built from different commits of one
    /// version read each other; a change here is a new [`ROUTE_PROTOCOL`].
    #[test]
    fn answers_are_pinned_on_the_wire() {
        let hex = |answer: &RouteAnswer| answer.encode_to_vec().iter().map(|b| format!("{b:02x}")).collect::<String>();
        let pick = RouteAnswer {
            call: 7,
            admission_waiting: 0,
            outcome: Some(Outcome::Pick(RoutePick {
                decode: "10.0.0.1:8000".into(),
                fallbacks: vec!["10.0.0.2:8000".into()],
                prefill: None,
                pod: "a".into(),
                model_rewrite: None,
            })),
        };
        assert_eq!(
            hex(&pick),
            "080732210a0d31302e302e302e313a38303030120d31302e302e302e323a383030302201
             61"
            .replace(char::is_whitespace, "")
        );
        let shed = RouteAnswer {
            call: 8,
            admission_waiting: 3,
            outcome: Some(Outcome::Refusal(Refusal {
                reason: Refused::Overloaded as i32,
                message: "full".into(),
                retry_after: Some(5),
            })),
        };
        assert_eq!(hex(&shed), "080828033a0a0803120466756c6c1805");
        let notice = RouteAnswer { admission_waiting: 2, ..Default::default() };
        assert_eq!(hex(&notice), "2802");
        assert_eq!(RouteAnswer::decode(&pick.encode_to_vec()[..]).unwrap(), pick);
        let back = RouteAnswer::decode(&shed.encode_to_vec()[..]).unwrap();
        let Some(Outcome::Refusal(refusal)) = back.outcome else { panic!("a refusal") };
        assert_eq!((refusal.refused(), refusal.retry_after), (Refused::Overloaded, Some(5)));
        let future = Refusal { reason: 99, ..Default::default() };
        assert_eq!(future.refused(), Refused::Unknown);
        assert!(ROUTE_SOCKET_PREFACE.starts_with(ROUTE_SOCKET_PREFACE_START));
        assert!(ROUTE_STREAM_PATH.contains(&format!("v{ROUTE_PROTOCOL}")));
    }

    #[test]
    fn each_refusal_maps_to_one_status() {
        let all = [
            Refused::Unknown,
            Refused::BadRequest,
            Refused::TooLarge,
            Refused::Overloaded,
            Refused::NoPod,
            Refused::Stopping,
        ];
        let statuses: Vec<u16> = all.iter().map(|r| r.status()).collect();
        assert_eq!(statuses, [503, 400, 413, 429, 503, 503]);
        assert!(all.iter().all(|r| !r.error_type().is_empty()));
        let pick =
            RoutePick { decode: "a:1".into(), fallbacks: vec!["b:1".into(), "c:1".into()], ..Default::default() };
        assert_eq!(pick.destinations(), "a:1,b:1,c:1");
    }
}
