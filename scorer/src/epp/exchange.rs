//! One ext_proc stream: one HTTP request and its response, as the gateway relays them.
//!
//! Request side. The body modes gateways use are all served; `protocol_config` in the first
//! message says which one this stream is in:
//! - `FULL_DUPLEX_STREAMED` (Istio, agentgateway, llm-d): headers and body chunks arrive
//!   without waiting; the picker answers the headers only once the body is complete (with the
//!   pick), then sends the body back unchanged, in chunks of at most [`MAX_CHUNK`] bytes.
//! - `STREAMED` with `send_body_without_waiting_for_header_response`: the same, except that the
//!   gateway keeps the body and the picker answers each chunk with a plain continue.
//! - `BUFFERED` (Envoy AI Gateway): the gateway waits for a headers answer before it sends the
//!   whole body at once; the pick goes in the body answer (header mutations apply there in
//!   this mode).
//!
//! Requests that are not routed (other paths, other methods, no body) pass through. Every
//! headers answer removes a client-supplied destination header, routed or not: nobody but
//! the picker names the destination. Bad bodies, no pod, a body over the limit: an
//! `ImmediateResponse` with the JSON error body the filter's path answers.
//!
//! Response side: the served endpoint (`envoy.lb` / `x-gateway-destination-endpoint-served`
//! in the metadata context) moves the booking if a retry went elsewhere; the first non-empty
//! body chunk is the first token; the end of the body (or trailers) is `done` for a 2xx and
//! `cancelled` otherwise; the stream ending earlier (client gone, upstream reset) is
//! `cancelled`. Response bodies pass back unchanged and are never logged.

use crate::config::EppSection;
use crate::scorer::{Limits, RouteError, Scorer};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
    TrailersResponse, body_mutation,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kvgate_route_api::{Api, ErrorBody, LifecycleEvent, completion_tokens, validate_json_object};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

/// The header and `envoy.lb` metadata key naming the pick and its fallbacks.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata key (in `envoy.lb`) where the gateway reports the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the pick, and of the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace and key of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Largest body chunk sent back in full-duplex mode (the reference picker's size).
pub const MAX_CHUNK: usize = 62_000;

/// How the gateway sends one side's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyMode {
    /// Not sent: the picker sees no body.
    None,
    /// Chunks, each answered; the gateway keeps the data.
    Streamed,
    /// The whole body in one message, after the headers were answered.
    Buffered,
    /// Chunks without waiting; the picker sends the body back.
    FullDuplex,
}

impl BodyMode {
    fn of(mode: i32) -> Result<BodyMode, String> {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => Ok(BodyMode::None),
            Ok(BodySendMode::Streamed) => Ok(BodyMode::Streamed),
            Ok(BodySendMode::Buffered) => Ok(BodyMode::Buffered),
            Ok(BodySendMode::FullDuplexStreamed) => Ok(BodyMode::FullDuplex),
            Ok(other) => Err(format!("body mode {} is not supported", other.as_str_name())),
            Err(_) => Err(format!("body mode {mode} is unknown")),
        }
    }
}

/// The stream's modes, from the gateway's `protocol_config` (full duplex both ways when it
/// sends none: the Endpoint Picker protocol's mode).
#[derive(Clone, Copy, Debug)]
struct Modes {
    request: BodyMode,
    response: BodyMode,
}

impl Modes {
    const PROTOCOL: Modes = Modes { request: BodyMode::FullDuplex, response: BodyMode::FullDuplex };

    fn of(config: &ProtocolConfiguration) -> Result<Modes, String> {
        let request = BodyMode::of(config.request_body_mode)?;
        let response = BodyMode::of(config.response_body_mode)?;
        match request {
            BodyMode::None => Err("request_body_mode NONE: kvgate routes by the request body; use \
                                   FULL_DUPLEX_STREAMED, STREAMED or BUFFERED"
                .into()),
            // Without it the gateway waits for a headers answer before sending the body, and
            // in STREAMED mode header mutations in body answers are ignored: no way to route.
            BodyMode::Streamed if !config.send_body_without_waiting_for_header_response => {
                Err("request_body_mode STREAMED needs send_body_without_waiting_for_header_response: true".into())
            }
            _ => Ok(Modes { request, response }),
        }
    }
}

enum RequestSide {
    /// Before the request headers.
    Start,
    /// Not routed: headers answered, body (if any) relayed.
    PassThrough,
    /// Routed: collecting the body.
    Buffering { api: Api, request_id: String, subset: Option<Vec<SocketAddr>>, body: Vec<u8>, chunks: usize },
    /// Answered (pick, or an immediate response).
    Done,
}

/// A booking made for this stream, released when the response ends or the stream does.
struct Booking {
    id: String,
    /// x-request-id, for logs.
    request_id: String,
    first_token: bool,
}

pub struct Exchange {
    scorer: Arc<Scorer>,
    settings: Arc<EppSection>,
    stream: u64,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    modes: Modes,
    request: RequestSide,
    booking: Option<Booking>,
    response_status: Option<u16>,
    output_tokens: Option<u32>,
}

/// The stream ended (the proxy went away, or our answers can no longer be delivered).
struct Closed;

impl Exchange {
    pub fn new(
        scorer: Arc<Scorer>,
        settings: Arc<EppSection>,
        stream: u64,
        out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Self {
        Self {
            scorer,
            settings,
            stream,
            out,
            modes: Modes::PROTOCOL,
            request: RequestSide::Start,
            booking: None,
            response_status: None,
            output_tokens: None,
        }
    }

    /// Handles the stream's messages until the proxy closes it.
    pub async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let message = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break, // the proxy is done with this request
                Err(status) => {
                    tracing::debug!(stream = self.stream, "ext_proc stream ended: {status}");
                    break;
                }
            };
            match self.handle(message).await {
                Ok(()) => {}
                Err(Closed) => break,
            }
        }
        self.finish();
    }

    async fn send(&self, answer: Answer, metadata: Option<Struct>) -> Result<(), Closed> {
        let response = ProcessingResponse { response: Some(answer), dynamic_metadata: metadata, ..Default::default() };
        self.out.send(Ok(response)).await.map_err(|_| Closed)
    }

    async fn handle(&mut self, message: ProcessingRequest) -> Result<(), Closed> {
        if let Some(config) = &message.protocol_config {
            match Modes::of(config) {
                Ok(modes) => self.modes = modes,
                Err(why) => return self.refuse(&why).await,
            }
        }
        if message.observability_mode {
            return self.refuse("observability_mode: a picker must answer to route").await;
        }
        let context = message.metadata_context;
        match message.request {
            Some(Message::RequestHeaders(h)) => self.request_headers(h, context.as_ref()).await,
            Some(Message::RequestBody(b)) => self.request_body(b).await,
            Some(Message::RequestTrailers(_)) => self.request_trailers().await,
            Some(Message::ResponseHeaders(h)) => self.response_headers(h, context.as_ref()).await,
            Some(Message::ResponseBody(b)) => self.response_body(b).await,
            Some(Message::ResponseTrailers(_)) => {
                self.response_ended();
                self.send(Answer::ResponseTrailers(TrailersResponse::default()), None).await
            }
            None => Ok(()),
        }
    }

    /// A gateway configured in a way the picker cannot serve: the stream fails with the
    /// reason, so the gateway's failure mode applies and its logs say why.
    async fn refuse(&mut self, why: &str) -> Result<(), Closed> {
        self.scorer.metrics.epp_errors.with_label_values(&["protocol"]).inc();
        tracing::warn!(stream = self.stream, "ext_proc: {why}");
        let _ = self.out.send(Err(Status::failed_precondition(format!("kvgate: {why}")))).await;
        Err(Closed)
    }

    async fn request_headers(&mut self, h: HttpHeaders, context: Option<&Metadata>) -> Result<(), Closed> {
        let headers = h.headers.unwrap_or_default();
        let method = header(&headers, ":method");
        let api = (method.as_deref() == Some("POST"))
            .then(|| header(&headers, ":path").and_then(|p| Api::from_path(&p)))
            .flatten();
        let Some(api) = api else {
            self.request = RequestSide::PassThrough;
            return self.send(Answer::RequestHeaders(headers_answer(None, false)), None).await;
        };
        let request_id = header(&headers, "x-request-id").unwrap_or_default();
        if h.end_of_stream {
            self.request = RequestSide::Done;
            return self.immediate(400, "BadRequestError", "request body is required").await;
        }
        let subset = match subset_hint(context) {
            Ok(subset) => subset,
            Err(why) => {
                self.request = RequestSide::Done;
                return self.immediate(503, "ServiceUnavailable", &why).await;
            }
        };
        self.request = RequestSide::Buffering { api, request_id, subset, body: Vec::new(), chunks: 0 };
        if self.modes.request == BodyMode::Buffered {
            // The gateway sends the body only after this answer; the pick follows with it.
            return self.send(Answer::RequestHeaders(headers_answer(None, false)), None).await;
        }
        Ok(())
    }

    async fn request_body(&mut self, b: HttpBody) -> Result<(), Closed> {
        let limit = self.settings.body_limit_bytes;
        match &mut self.request {
            RequestSide::Buffering { body, chunks, .. } => {
                if body.len() + b.body.len() > limit {
                    self.request = RequestSide::Done;
                    let message = format!("request body is larger than {limit} bytes");
                    return self.immediate(413, "PayloadTooLarge", &message).await;
                }
                if body.is_empty() {
                    body.reserve(if b.end_of_stream { b.body.len() } else { b.body.len().max(64 << 10) });
                }
                body.extend_from_slice(&b.body);
                *chunks += 1;
                if b.end_of_stream { self.decide(true).await } else { Ok(()) }
            }
            // Relayed as it came (pass-through, or a body after an answer already given).
            _ => self.relay_request_chunk(b).await,
        }
    }

    async fn relay_request_chunk(&mut self, b: HttpBody) -> Result<(), Closed> {
        let answer = match self.modes.request {
            BodyMode::FullDuplex => Answer::RequestBody(streamed_chunk(b.body, b.end_of_stream)),
            _ => Answer::RequestBody(BodyResponse { response: Some(CommonResponse::default()) }),
        };
        self.send(answer, None).await
    }

    async fn request_trailers(&mut self) -> Result<(), Closed> {
        // Trailers end a body whose last chunk did not say end_of_stream.
        if matches!(self.request, RequestSide::Buffering { .. }) {
            self.decide(false).await?;
        }
        self.send(Answer::RequestTrailers(TrailersResponse::default()), None).await
    }

    /// The body is complete: pick, answer, hand the body back.
    async fn decide(&mut self, end_of_stream: bool) -> Result<(), Closed> {
        let RequestSide::Buffering { api, request_id, subset, body, chunks } =
            std::mem::replace(&mut self.request, RequestSide::Done)
        else {
            return Ok(());
        };
        let booking_id = format!("epp-{}", self.scorer.next_booking());
        let decided = validate_json_object(&body).map_err(RouteError::BadRequest).and_then(|()| {
            let prepared = self.scorer.prepare(api, &body)?;
            let subset = subset.map(|addresses| self.scorer.pods_at(&addresses));
            let limits =
                Limits { subset: subset.as_ref(), fallbacks: self.settings.fallback_endpoints, explain: false };
            self.scorer.decide(&booking_id, &prepared, &limits)
        });
        let pick = match decided {
            Ok(pick) => pick,
            Err(e) => {
                let (status, kind) = match e {
                    RouteError::BadRequest(_) => (400, "BadRequestError"),
                    RouteError::NoPod => (503, "ServiceUnavailable"),
                };
                self.scorer.metrics.route_errors.with_label_values(&[&status.to_string()]).inc();
                return self.immediate(status, kind, &e.to_string()).await;
            }
        };
        let destinations = pick.destinations();
        tracing::debug!(stream = self.stream, request_id = %request_id, pod = %pick.decode.name, "ext_proc: picked {destinations}");
        self.booking = Some(Booking { id: booking_id, request_id, first_token: false });
        let mut set = vec![(DESTINATION, destinations.as_str())];
        if let Some(prefill) = &pick.prefill {
            set.push((self.settings.prefiller_header.as_str(), prefill.address.as_str()));
        }
        let metadata = lb_metadata(&destinations);
        match self.modes.request {
            BodyMode::Buffered => {
                let answer = BodyResponse { response: Some(common(Some(&set), true)) };
                self.send(Answer::RequestBody(answer), Some(metadata)).await
            }
            BodyMode::Streamed => {
                self.send(Answer::RequestHeaders(headers_answer(Some(&set), true)), Some(metadata)).await?;
                for _ in 0..chunks {
                    let answer = BodyResponse { response: Some(CommonResponse::default()) };
                    self.send(Answer::RequestBody(answer), None).await?;
                }
                Ok(())
            }
            BodyMode::FullDuplex | BodyMode::None => {
                self.send(Answer::RequestHeaders(headers_answer(Some(&set), true)), Some(metadata)).await?;
                let mut pieces = body.chunks(MAX_CHUNK).peekable();
                if pieces.peek().is_none() {
                    return self.send(Answer::RequestBody(streamed_chunk(Vec::new(), end_of_stream)), None).await;
                }
                while let Some(piece) = pieces.next() {
                    let last = pieces.peek().is_none();
                    let answer = streamed_chunk(piece.to_vec(), last && end_of_stream);
                    self.send(Answer::RequestBody(answer), None).await?;
                }
                Ok(())
            }
        }
    }

    /// Answers the client directly (nothing is routed).
    async fn immediate(&mut self, status: u16, kind: &str, message: &str) -> Result<(), Closed> {
        let body = serde_json::to_vec(&ErrorBody::new(status, kind, message)).unwrap_or_default();
        let headers = HeaderMutation {
            set_headers: vec![set_header("content-type", "application/json"), set_header("x-kvgate-error", kind)],
            remove_headers: Vec::new(),
        };
        let answer = ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(status) }),
            headers: Some(headers),
            body,
            grpc_status: None,
            details: format!("kvgate_{}", status),
        };
        self.send(Answer::ImmediateResponse(answer), None).await
    }

    async fn response_headers(&mut self, h: HttpHeaders, context: Option<&Metadata>) -> Result<(), Closed> {
        let headers = h.headers.unwrap_or_default();
        self.response_status = header(&headers, ":status").and_then(|s| s.parse().ok());
        if let (Some(booking), Some(served)) = (&self.booking, served_endpoint(context)) {
            self.scorer.served(&booking.id, served);
        }
        // Bookings are settled before answering: once the proxy has the answer, the next
        // decision may already count on them.
        if h.end_of_stream {
            self.response_ended();
        } else if self.modes.response == BodyMode::None {
            // No body will be seen: the headers are as close to the first token as it gets.
            self.first_token();
        }
        self.send(Answer::ResponseHeaders(HeadersResponse::default()), None).await
    }

    async fn response_body(&mut self, b: HttpBody) -> Result<(), Closed> {
        if !b.body.is_empty() {
            self.first_token();
            if self.booking.is_some()
                && let Some(n) = completion_tokens(&b.body)
            {
                self.output_tokens = Some(n);
            }
        }
        if b.end_of_stream {
            self.response_ended();
        }
        let answer = match self.modes.response {
            BodyMode::FullDuplex => Answer::ResponseBody(streamed_chunk(b.body, b.end_of_stream)),
            _ => Answer::ResponseBody(BodyResponse { response: Some(CommonResponse::default()) }),
        };
        self.send(answer, None).await
    }

    fn first_token(&mut self) {
        if let Some(booking) = self.booking.as_mut()
            && !booking.first_token
        {
            booking.first_token = true;
            self.scorer.report(&booking.id, LifecycleEvent::FirstToken, None);
        }
    }

    /// The response is complete: `done` if it succeeded, else `cancelled`.
    fn response_ended(&mut self) {
        if let Some(booking) = self.booking.take() {
            let ok = self.response_status.is_some_and(|s| (200..300).contains(&s));
            let event = if ok { LifecycleEvent::Done } else { LifecycleEvent::Cancelled };
            tracing::debug!(stream = self.stream, request_id = %booking.request_id, "ext_proc: response ended ({event:?})");
            self.scorer.report(&booking.id, event, self.output_tokens);
        }
    }

    /// The stream is over: a request still booked never finished (client gone, upstream
    /// reset, gateway gave up) and frees its booking.
    fn finish(&mut self) {
        if let Some(booking) = self.booking.take() {
            tracing::debug!(stream = self.stream, request_id = %booking.request_id, "ext_proc: stream ended before the response");
            self.scorer.report(&booking.id, LifecycleEvent::Cancelled, None);
        }
    }
}

/// A header's value (Envoy sends `raw_value`; older versions `value`).
fn header(map: &HeaderMap, name: &str) -> Option<String> {
    map.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name)).map(|h| {
        if h.raw_value.is_empty() { h.value.clone() } else { String::from_utf8_lossy(&h.raw_value).into_owned() }
    })
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), value: String::new(), raw_value: value.as_bytes().to_vec() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// Sets `set` (the pick) or, without a pick, removes any client-supplied destination.
fn common(set: Option<&[(&str, &str)]>, clear_route_cache: bool) -> CommonResponse {
    let header_mutation = match set {
        Some(set) => HeaderMutation {
            set_headers: set.iter().map(|(k, v)| set_header(k, v)).collect(),
            remove_headers: Vec::new(),
        },
        None => HeaderMutation { set_headers: Vec::new(), remove_headers: vec![DESTINATION.into()] },
    };
    CommonResponse { header_mutation: Some(header_mutation), clear_route_cache, ..Default::default() }
}

fn headers_answer(set: Option<&[(&str, &str)]>, clear_route_cache: bool) -> HeadersResponse {
    HeadersResponse { response: Some(common(set, clear_route_cache)) }
}

fn streamed_chunk(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    let streamed = StreamedBodyResponse { body, end_of_stream, ..Default::default() };
    let mutation = BodyMutation { mutation: Some(body_mutation::Mutation::StreamedResponse(streamed)) };
    BodyResponse { response: Some(CommonResponse { body_mutation: Some(mutation), ..Default::default() }) }
}

fn string_value(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_string())) }
}

/// `envoy.lb: {x-gateway-destination-endpoint: destinations}`.
fn lb_metadata(destinations: &str) -> Struct {
    let inner = Struct { fields: [(DESTINATION.to_string(), string_value(destinations))].into() };
    Struct { fields: [(LB_NAMESPACE.to_string(), Value { kind: Some(Kind::StructValue(inner)) })].into() }
}

/// The gateway's subset hint: `None` without one; the listed endpoints otherwise (a list of
/// `ip:port` strings, or one comma-separated string). Empty, or none valid: an error (503).
fn subset_hint(context: Option<&Metadata>) -> Result<Option<Vec<SocketAddr>>, String> {
    let Some(hint) = context.and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE)) else { return Ok(None) };
    let Some(value) = hint.fields.get(SUBSET_KEY) else { return Ok(None) };
    let mut entries: Vec<String> = Vec::new();
    match &value.kind {
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    entries.push(s.clone());
                }
            }
        }
        Some(Kind::StringValue(s)) => entries.extend(s.split(',').map(|e| e.trim().to_string())),
        _ => return Err(format!("{SUBSET_KEY} is neither a list nor a string")),
    }
    let endpoints: Vec<SocketAddr> = entries.iter().filter_map(|e| e.parse().ok()).collect();
    if endpoints.is_empty() {
        return Err(format!("the gateway's subset hint ({SUBSET_KEY}) names no endpoint"));
    }
    Ok(Some(endpoints))
}

/// The endpoint that served (`envoy.lb` / `x-gateway-destination-endpoint-served`).
fn served_endpoint(context: Option<&Metadata>) -> Option<SocketAddr> {
    let lb = context?.filter_metadata.get(LB_NAMESPACE)?;
    match &lb.fields.get(SERVED)?.kind {
        Some(Kind::StringValue(s)) => s.split(',').next()?.trim().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
        let inner = Struct { fields: [(key.to_string(), value)].into() };
        Metadata { filter_metadata: [(namespace.to_string(), inner)].into(), ..Default::default() }
    }

    #[test]
    fn subset_hints_in_both_shapes() {
        assert_eq!(subset_hint(None), Ok(None));
        let list = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![string_value("10.0.0.1:8000"), string_value("x")] })),
        };
        let m = metadata(SUBSET_NAMESPACE, SUBSET_KEY, list);
        assert_eq!(subset_hint(Some(&m)), Ok(Some(vec!["10.0.0.1:8000".parse().unwrap()])));
        let m = metadata(SUBSET_NAMESPACE, SUBSET_KEY, string_value("10.0.0.1:8000, [::1]:9"));
        assert_eq!(subset_hint(Some(&m)).unwrap().unwrap().len(), 2);
        let empty = Value { kind: Some(Kind::ListValue(ListValue { values: vec![] })) };
        assert!(subset_hint(Some(&metadata(SUBSET_NAMESPACE, SUBSET_KEY, empty))).is_err(), "empty → 503");
        let other = metadata("envoy.lb", SUBSET_KEY, string_value("10.0.0.1:8000"));
        assert_eq!(subset_hint(Some(&other)), Ok(None), "another namespace is no hint");
    }

    #[test]
    fn the_served_endpoint_is_read_from_envoy_lb() {
        let m = metadata(LB_NAMESPACE, SERVED, string_value("10.0.0.3:8000"));
        assert_eq!(served_endpoint(Some(&m)), Some("10.0.0.3:8000".parse().unwrap()));
        assert_eq!(served_endpoint(Some(&metadata(LB_NAMESPACE, DESTINATION, string_value("10.0.0.3:8000")))), None);
    }

    #[test]
    fn modes_the_picker_cannot_serve_are_refused_with_the_reason() {
        let config = |request, response, without_waiting| ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: response as i32,
            send_body_without_waiting_for_header_response: without_waiting,
        };
        let full = Modes::of(&config(BodySendMode::FullDuplexStreamed, BodySendMode::FullDuplexStreamed, false));
        assert_eq!(full.unwrap().request, BodyMode::FullDuplex);
        assert!(Modes::of(&config(BodySendMode::Buffered, BodySendMode::None, false)).is_ok());
        assert!(Modes::of(&config(BodySendMode::Streamed, BodySendMode::Streamed, true)).is_ok());
        let waiting = Modes::of(&config(BodySendMode::Streamed, BodySendMode::Streamed, false));
        assert!(waiting.unwrap_err().contains("send_body_without_waiting_for_header_response"));
        assert!(Modes::of(&config(BodySendMode::None, BodySendMode::None, false)).unwrap_err().contains("NONE"));
        assert!(Modes::of(&config(BodySendMode::BufferedPartial, BodySendMode::None, false)).is_err());
    }

    #[test]
    fn answers_carry_the_pick_or_strip_the_clients_destination() {
        let set = [(DESTINATION, "10.0.0.1:8000,10.0.0.2:8000")];
        let picked = common(Some(&set), true);
        let mutation = picked.header_mutation.unwrap();
        assert_eq!(mutation.set_headers[0].header.as_ref().unwrap().raw_value, b"10.0.0.1:8000,10.0.0.2:8000");
        assert_eq!(mutation.set_headers[0].append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
        assert!(picked.clear_route_cache);
        let passed = common(None, false).header_mutation.unwrap();
        assert_eq!(passed.remove_headers, vec![DESTINATION.to_string()]);
        let meta = lb_metadata("10.0.0.1:8000");
        let Some(Kind::StructValue(lb)) = &meta.fields[LB_NAMESPACE].kind else { panic!("envoy.lb is a struct") };
        assert_eq!(lb.fields[DESTINATION], string_value("10.0.0.1:8000"));
    }
}
