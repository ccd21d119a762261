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

use super::Shared;
use crate::config::EppSection;
use crate::picking::{PickError, PickRequest, PickingService};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode as BodyMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
    TrailersResponse, body_mutation,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::{Stream, StreamExt};
use kvgate_route_api::lifecycle::ResponseWatch;
use kvgate_route_api::{Api, ErrorBody, HEADER_OBJECTIVE, LifecycleEvent, LifecycleReport, Refused};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tonic::Status;

/// The header and `envoy.lb` metadata key naming the pick and its fallbacks.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata key (in `envoy.lb`) where the gateway reports the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the pick, and of the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace and key of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// kvgate's metadata namespace and the key naming a decision's booking in it.
pub const KVGATE_NAMESPACE: &str = "kvgate";
pub const BOOKING_KEY: &str = "booking";
/// Largest body chunk sent back in full-duplex mode (the reference picker's size).
pub const MAX_CHUNK: usize = 62_000;

/// How the gateway sends one side's body: `None` (the picker sees no body), `Streamed` (chunks,
/// each answered; the gateway keeps the data), `Buffered` (the whole body in one message, after
/// the headers were answered) or `FullDuplexStreamed` (chunks without waiting; the picker sends
/// the body back).
fn body_mode(mode: i32) -> Result<BodyMode, String> {
    match BodyMode::try_from(mode) {
        Ok(mode @ (BodyMode::None | BodyMode::Streamed | BodyMode::Buffered | BodyMode::FullDuplexStreamed)) => {
            Ok(mode)
        }
        Ok(other) => Err(format!("body mode {} is not supported", other.as_str_name())),
        Err(_) => Err(format!("body mode {mode} is unknown")),
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
    const PROTOCOL: Modes = Modes { request: BodyMode::FullDuplexStreamed, response: BodyMode::FullDuplexStreamed };

    /// The modes of a stream; `observing`: the gateway sends without waiting (observability
    /// mode), so the request body mode does not matter — such a stream only reports.
    fn of(config: &ProtocolConfiguration, observing: bool) -> Result<Modes, String> {
        let request = body_mode(config.request_body_mode)?;
        let response = body_mode(config.response_body_mode)?;
        if observing {
            return Ok(Modes { request, response });
        }
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
    Buffering {
        api: Api,
        request_id: String,
        /// `x-gateway-inference-objective`: the request's priority under overload.
        objective: Option<String>,
        subset: Option<Vec<SocketAddr>>,
        body: Vec<u8>,
        chunks: usize,
    },
    /// Answered (pick, or an immediate response).
    Done,
}

/// A booking made for this stream, released when the response ends or the stream does.
struct Booking {
    id: String,
    /// x-request-id, for logs.
    request_id: String,
    /// Made by another stream (named in the `kvgate` metadata): this one only reports.
    joined: bool,
}

/// One stream's exchange, asking `P` (the scorer's [`crate::picking::Picker`]; a fake in tests).
pub struct Exchange<P: PickingService> {
    picker: P,
    settings: Arc<EppSection>,
    shared: Arc<Shared>,
    stream: u64,
    /// Observability mode: answers are neither awaited nor sent.
    observing: bool,
    /// Some response message reached this stream.
    saw_response: bool,
    /// The response's end reached this stream.
    response_over: bool,
    /// Answers to the message being handled, in order (several for a full-duplex body).
    outbox: VecDeque<Result<ProcessingResponse, Status>>,
    /// The stream failed (a mode the picker cannot serve): the outbox ends it.
    failed: bool,
    modes: Modes,
    /// The routed API of the request, once its headers came (its errors take its shape).
    api: Option<Api>,
    request: RequestSide,
    booking: Option<Booking>,
    /// The response, as far as this stream sees it (the request lifecycle every way in shares).
    response: ResponseWatch,
    /// The `traceparent` of the gateway's call (its gRPC metadata), which the decision's
    /// spans join.
    trace_parent: Option<String>,
}

impl<P: PickingService> Exchange<P> {
    pub fn new(picker: P, settings: Arc<EppSection>, shared: Arc<Shared>, stream: u64) -> Self {
        picker.metrics().epp_exchanges_open.inc();
        Self {
            picker,
            settings,
            shared,
            stream,
            observing: false,
            saw_response: false,
            response_over: false,
            outbox: VecDeque::new(),
            failed: false,
            modes: Modes::PROTOCOL,
            api: None,
            request: RequestSide::Start,
            booking: None,
            response: ResponseWatch::default(),
            trace_parent: None,
        }
    }

    /// The exchange of a call whose gRPC metadata carried `traceparent`.
    pub fn traced(mut self, trace_parent: Option<String>) -> Self {
        self.trace_parent = trace_parent;
        self
    }

    /// The answers to the stream's messages, as a stream: each message is handled when the
    /// answer stream is polled for more (on the task that serves the gRPC stream: no hop
    /// to another task per message). It ends when the proxy closes its side; dropped
    /// earlier (the proxy reset the stream), the exchange cancels what it booked.
    pub fn answers(
        self,
        inbound: impl Stream<Item = Result<ProcessingRequest, Status>> + Send + Unpin + 'static,
    ) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send + 'static {
        futures::stream::unfold((self, inbound), |(mut exchange, mut inbound)| async move {
            loop {
                if let Some(answer) = exchange.outbox.pop_front() {
                    return Some((answer, (exchange, inbound)));
                }
                // Failed, or an observing stream whose response has ended: the gateway keeps such
                // a stream open until the picker closes it (or a deferred-close timeout).
                if exchange.failed || (exchange.observing && exchange.response_over) {
                    return None;
                }
                match inbound.next().await {
                    Some(Ok(message)) => exchange.handle(message).await,
                    None => return None, // the proxy is done with this request
                    Some(Err(status)) => {
                        tracing::debug!(stream = exchange.stream, "ext_proc stream ended: {status}");
                        return None;
                    }
                }
            }
        })
    }

    fn send(&mut self, answer: Answer, metadata: Option<Struct>) {
        if self.observing {
            return; // nobody waits for it
        }
        let response = ProcessingResponse { response: Some(answer), dynamic_metadata: metadata, ..Default::default() };
        self.outbox.push_back(Ok(response));
    }

    async fn handle(&mut self, message: ProcessingRequest) {
        // Observability mode: the gateway does not wait for answers; this stream reports
        // responses (for a booking another stream made) and answers nothing.
        self.observing |= message.observability_mode;
        if let Some(config) = &message.protocol_config {
            match Modes::of(config, self.observing) {
                Ok(modes) => self.modes = modes,
                Err(why) => return self.refuse(&why),
            }
        }
        let context = message.metadata_context;
        if self.booking.is_none()
            && let Some(id) = joined_booking(context.as_ref())
        {
            // A booking made by the stream that routed this request: this one reports for it.
            self.shared.observers_seen.store(true, Ordering::Relaxed);
            self.booking = Some(Booking { id, request_id: String::new(), joined: true });
        }
        if self.observing {
            return match message.request {
                Some(Message::ResponseHeaders(h)) => self.response_headers(h, context.as_ref()),
                Some(Message::ResponseBody(b)) => self.response_body(b, context.as_ref()),
                Some(Message::ResponseTrailers(_)) => self.response_ended(),
                _ => {}
            };
        }
        match message.request {
            Some(Message::RequestHeaders(h)) => self.request_headers(h, context.as_ref()),
            Some(Message::RequestBody(b)) => self.request_body(b).await,
            Some(Message::RequestTrailers(_)) => self.request_trailers().await,
            Some(Message::ResponseHeaders(h)) => self.response_headers(h, context.as_ref()),
            Some(Message::ResponseBody(b)) => self.response_body(b, context.as_ref()),
            Some(Message::ResponseTrailers(_)) => {
                self.response_ended();
                self.send(Answer::ResponseTrailers(TrailersResponse::default()), None)
            }
            None => {}
        }
    }

    /// A gateway configured in a way the picker cannot serve: the stream fails with the
    /// reason, so the gateway's failure mode applies and its logs say why.
    fn refuse(&mut self, why: &str) {
        self.picker.metrics().epp_errors.with_label_values(&["protocol"]).inc();
        tracing::warn!(stream = self.stream, "ext_proc: {why}");
        self.outbox.push_back(Err(Status::failed_precondition(format!("kvgate: {why}"))));
        self.failed = true;
    }

    fn request_headers(&mut self, h: HttpHeaders, context: Option<&Metadata>) {
        let headers = h.headers.unwrap_or_default();
        let method = header(&headers, ":method");
        let api = (method.as_deref() == Some("POST"))
            .then(|| header(&headers, ":path").and_then(|p| Api::from_path(&p)))
            .flatten();
        self.api = api;
        let Some(api) = api else {
            self.request = RequestSide::PassThrough;
            return self.send(Answer::RequestHeaders(headers_answer(None, false)), None);
        };
        let request_id = header(&headers, "x-request-id").unwrap_or_default();
        if h.end_of_stream {
            self.request = RequestSide::Done;
            return self.refuse_request(&PickError::BadRequest("request body is required".into()));
        }
        let subset = match subset_hint(context) {
            Ok(subset) => subset,
            Err(why) => {
                self.request = RequestSide::Done;
                return self.immediate(Refused::NoPod, &why, None);
            }
        };
        let objective = header(&headers, HEADER_OBJECTIVE);
        self.request = RequestSide::Buffering { api, request_id, objective, subset, body: Vec::new(), chunks: 0 };
        if self.modes.request == BodyMode::Buffered {
            // The gateway sends the body only after this answer; the pick follows with it.
            self.send(Answer::RequestHeaders(headers_answer(None, false)), None);
        }
    }

    async fn request_body(&mut self, b: HttpBody) {
        let limit = self.settings.body_limit_bytes;
        match &mut self.request {
            RequestSide::Buffering { body, chunks, .. } => {
                if body.len() + b.body.len() > limit {
                    self.request = RequestSide::Done;
                    return self.refuse_request(&PickError::TooLarge(limit));
                }
                if body.is_empty() {
                    body.reserve(if b.end_of_stream { b.body.len() } else { b.body.len().max(64 << 10) });
                }
                body.extend_from_slice(&b.body);
                *chunks += 1;
                if b.end_of_stream {
                    self.decide(true).await;
                }
            }
            // Relayed as it came (pass-through, or a body after an answer already given).
            _ => self.relay_request_chunk(b),
        }
    }

    fn relay_request_chunk(&mut self, b: HttpBody) {
        let answer = match self.modes.request {
            BodyMode::FullDuplexStreamed => Answer::RequestBody(streamed_chunk(b.body, b.end_of_stream)),
            _ => Answer::RequestBody(BodyResponse { response: Some(CommonResponse::default()) }),
        };
        self.send(answer, None)
    }

    async fn request_trailers(&mut self) {
        // Trailers end a body whose last chunk did not say end_of_stream.
        if matches!(self.request, RequestSide::Buffering { .. }) {
            self.decide(false).await;
        }
        self.send(Answer::RequestTrailers(TrailersResponse::default()), None)
    }

    /// The body is complete: pick, answer, hand the body back.
    async fn decide(&mut self, end_of_stream: bool) {
        let RequestSide::Buffering { api, request_id, objective, subset, body, chunks } =
            std::mem::replace(&mut self.request, RequestSide::Done)
        else {
            return;
        };
        let booking_id = format!("epp-{}", self.picker.next_booking());
        let body = bytes::Bytes::from(body);
        let request = PickRequest {
            booking: Some(&booking_id),
            api_path: Some(api.path()),
            body: body.clone(),
            objective: objective.as_deref(),
            subset: subset.as_deref(),
            explain: false,
            trace_parent: self.trace_parent.as_deref(),
            rewrites_model: true,
        };
        let pick = match self.picker.pick(request).await {
            Ok(pick) => pick,
            Err(e) => return self.refuse_request(&e),
        };
        let route = pick.route_pick();
        let destinations = route.destinations();
        tracing::debug!(stream = self.stream, request_id = %request_id, pod = %pick.decode.name, "ext_proc: picked {destinations}");
        let metadata = decision_metadata(&destinations, &booking_id);
        self.booking = Some(Booking { id: booking_id, request_id, joined: false });
        let mut set = vec![(DESTINATION, destinations.as_str())];
        if let Some(prefill) = &pick.prefill {
            set.push((self.settings.prefiller_header.as_str(), prefill.address.as_str()));
        }
        // With its model rewritten, the body the gateway sends on is another (the booking,
        // made, is released with the stream if it cannot be).
        let mut rewritten = match route.model_rewrite.map(|rewrite| rewrite.apply(&body)) {
            None => None,
            Some(Ok(rewritten)) => Some(rewritten),
            Some(Err(why)) => return self.immediate(Refused::NoPod, &format!("cannot rewrite the model: {why}"), None),
        };
        let length = rewritten.as_ref().map(|b| b.len().to_string());
        if let Some(length) = &length {
            set.push(("content-length", length));
        }
        let mutation = |m| Some(BodyMutation { mutation: Some(m) });
        match self.modes.request {
            BodyMode::Buffered => {
                let mut response = common(Some(&set), true);
                response.body_mutation = rewritten.and_then(|b| mutation(body_mutation::Mutation::Body(b)));
                self.send(Answer::RequestBody(BodyResponse { response: Some(response) }), Some(metadata))
            }
            BodyMode::Streamed => {
                self.send(Answer::RequestHeaders(headers_answer(Some(&set), true)), Some(metadata));
                let rewriting = rewritten.is_some();
                for _ in 0..chunks {
                    // Rewritten: the first chunk's answer carries the whole body, the others none.
                    let body_mutation = rewriting
                        .then(|| {
                            rewritten
                                .take()
                                .map_or(body_mutation::Mutation::ClearBody(true), body_mutation::Mutation::Body)
                        })
                        .and_then(mutation);
                    let answer =
                        BodyResponse { response: Some(CommonResponse { body_mutation, ..Default::default() }) };
                    self.send(Answer::RequestBody(answer), None);
                }
            }
            _ => {
                // Full duplex: the body goes back in chunks.
                self.send(Answer::RequestHeaders(headers_answer(Some(&set), true)), Some(metadata));
                let mut pieces = rewritten.as_deref().unwrap_or(&body).chunks(MAX_CHUNK).peekable();
                if pieces.peek().is_none() {
                    return self.send(Answer::RequestBody(streamed_chunk(Vec::new(), end_of_stream)), None);
                }
                while let Some(piece) = pieces.next() {
                    let last = pieces.peek().is_none();
                    let answer = streamed_chunk(piece.to_vec(), last && end_of_stream);
                    self.send(Answer::RequestBody(answer), None);
                }
            }
        }
    }

    /// Answers the client with the error (nothing is routed).
    fn refuse_request(&mut self, e: &PickError) {
        let retry_after = e.retry_after().map(|s| s.to_string());
        self.immediate(e.refused(), &e.to_string(), retry_after.as_deref())
    }

    /// Answers the client directly with a JSON error, with `Retry-After` when given.
    fn immediate(&mut self, refused: Refused, message: &str, retry_after: Option<&str>) {
        let kind = refused.error_type();
        let mut set_headers = vec![set_header("content-type", "application/json"), set_header("x-kvgate-error", kind)];
        if let Some(seconds) = retry_after {
            set_headers.push(set_header("retry-after", seconds));
        }
        let headers = HeaderMutation { set_headers, remove_headers: Vec::new() };
        let answer = ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(refused.status()) }),
            headers: Some(headers),
            body: ErrorBody::refused(refused, message).to_json_for(self.api),
            grpc_status: None,
            details: format!("kvgate_{}", refused.status()),
        };
        self.send(Answer::ImmediateResponse(answer), None)
    }

    /// The proxy says which endpoint served (after its retries): the booking follows.
    fn note_served(&self, context: Option<&Metadata>) {
        if let (Some(booking), Some(served)) = (&self.booking, served_endpoint(context)) {
            self.picker.served(&booking.id, served);
        }
    }

    fn response_headers(&mut self, h: HttpHeaders, context: Option<&Metadata>) {
        let headers = h.headers.unwrap_or_default();
        let status = header(&headers, ":status").and_then(|s| s.parse().ok());
        if !self.saw_response {
            self.note_served(context);
        }
        self.saw_response = true;
        self.response.headers(status, h.end_of_stream);
        // Bookings are settled before answering: once the proxy has the answer, the next
        // decision may already count on them.
        if h.end_of_stream {
            self.response_ended();
        } else if self.modes.response == BodyMode::None && self.booking.is_some() && self.response.first_token() {
            // No body will be seen: the headers are as close to the first token as it gets.
            self.report(|id| LifecycleReport::new(id, LifecycleEvent::FirstToken));
        }
        self.send(Answer::ResponseHeaders(HeadersResponse::default()), None)
    }

    fn response_body(&mut self, b: HttpBody, context: Option<&Metadata>) {
        if !self.saw_response {
            // The first response message: the served endpoint (when the headers were skipped).
            self.note_served(context);
        }
        self.saw_response = true;
        if self.booking.is_some() && self.response.body(&b.body, b.end_of_stream) {
            self.report(|id| LifecycleReport::new(id, LifecycleEvent::FirstToken));
        }
        if b.end_of_stream {
            self.response_ended();
        }
        let answer = match self.modes.response {
            BodyMode::FullDuplexStreamed => Answer::ResponseBody(streamed_chunk(b.body, b.end_of_stream)),
            _ => Answer::ResponseBody(BodyResponse { response: Some(CommonResponse::default()) }),
        };
        self.send(answer, None)
    }

    fn report(&self, report: impl FnOnce(&str) -> LifecycleReport) {
        if let Some(booking) = &self.booking {
            self.picker.report(&report(&booking.id));
        }
    }

    /// The response is complete: `done` if it succeeded, `error_status` if it was an error.
    fn response_ended(&mut self) {
        self.response_over = true;
        self.response.completed();
        if let Some(end) = self.response.finish() {
            if let Some(booking) = &self.booking {
                tracing::debug!(stream = self.stream, request_id = %booking.request_id, "ext_proc: response ended ({:?})", end.event);
            }
            self.report(|id| LifecycleReport::ended(id, &end));
        }
        self.booking = None;
    }
}

impl<P: PickingService> Drop for Exchange<P> {
    /// The stream is over: a request still booked never finished (client gone, upstream
    /// reset, gateway gave up) and frees its booking.
    fn drop(&mut self) {
        self.picker.metrics().epp_exchanges_open.dec();
        let Some(booking) = self.booking.take() else { return };
        if !booking.joined && !self.saw_response && self.modes.response == BodyMode::None {
            // This stream was never to see the response (response_body_mode NONE): the booking
            // ends with the reports of an observing stream, or by expiry.
            if !self.shared.observers_seen.load(Ordering::Relaxed)
                && !self.shared.unobserved_warned.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    "ext_proc: the gateway sends the picker no response (response_body_mode NONE) and no observing \
                     stream reports responses: bookings end only after load.request_ttl_seconds. Send the response \
                     body (STREAMED or FULL_DUPLEX_STREAMED), or add an ext_proc filter in observability_mode."
                );
            }
            return;
        }
        tracing::debug!(stream = self.stream, request_id = %booking.request_id, "ext_proc: stream ended before the response");
        if let Some(end) = self.response.finish() {
            self.picker.report(&LifecycleReport::ended(booking.id, &end));
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

/// The decision's dynamic metadata: `envoy.lb: {x-gateway-destination-endpoint:
/// destinations}` (what the proxy routes on), `kvgate: {booking: id}` (what an observing
/// stream reports for).
fn decision_metadata(destinations: &str, booking: &str) -> Struct {
    let namespace = |key: &str, value: &str| Value {
        kind: Some(Kind::StructValue(Struct { fields: [(key.to_string(), string_value(value))].into() })),
    };
    Struct {
        fields: [
            (LB_NAMESPACE.to_string(), namespace(DESTINATION, destinations)),
            (KVGATE_NAMESPACE.to_string(), namespace(BOOKING_KEY, booking)),
        ]
        .into(),
    }
}

/// The booking named in the `kvgate` metadata (set by the stream that routed the request).
fn joined_booking(context: Option<&Metadata>) -> Option<String> {
    match &context?.filter_metadata.get(KVGATE_NAMESPACE)?.fields.get(BOOKING_KEY)?.kind {
        Some(Kind::StringValue(id)) => Some(id.clone()),
        _ => None,
    }
}

/// The gateway's subset hint: `None` without one; the listed endpoints otherwise (a list of
/// `ip:port` strings, or one comma-separated string). Empty, or none valid: an error (503).
fn subset_hint(context: Option<&Metadata>) -> Result<Option<Vec<SocketAddr>>, String> {
    let Some(hint) = context.and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE)) else { return Ok(None) };
    let Some(value) = hint.fields.get(SUBSET_KEY) else { return Ok(None) };
    let mut entries: Vec<String> = Vec::new();
    match &value.kind {
        Some(Kind::ListValue(list)) => entries.extend(list.values.iter().filter_map(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        })),
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

    impl Modes {
        fn of_test(config: &ProtocolConfiguration) -> Result<Modes, String> {
            Modes::of(config, false)
        }
    }

    #[test]
    fn modes_the_picker_cannot_serve_are_refused_with_the_reason() {
        let config = |request, response, without_waiting| ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: response as i32,
            send_body_without_waiting_for_header_response: without_waiting,
        };
        let full = Modes::of_test(&config(BodyMode::FullDuplexStreamed, BodyMode::FullDuplexStreamed, false));
        assert_eq!(full.unwrap().request, BodyMode::FullDuplexStreamed);
        assert!(Modes::of_test(&config(BodyMode::Buffered, BodyMode::None, false)).is_ok());
        assert!(Modes::of_test(&config(BodyMode::Streamed, BodyMode::Streamed, true)).is_ok());
        let waiting = Modes::of_test(&config(BodyMode::Streamed, BodyMode::Streamed, false));
        assert!(waiting.unwrap_err().contains("send_body_without_waiting_for_header_response"));
        assert!(Modes::of_test(&config(BodyMode::None, BodyMode::None, false)).unwrap_err().contains("NONE"));
        assert!(Modes::of_test(&config(BodyMode::BufferedPartial, BodyMode::None, false)).is_err());
        let observer = Modes::of(&config(BodyMode::None, BodyMode::Streamed, false), true);
        assert_eq!(observer.unwrap().response, BodyMode::Streamed, "an observing stream needs no request body");
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
        let meta = decision_metadata("10.0.0.1:8000", "epp-7");
        let Some(Kind::StructValue(lb)) = &meta.fields[LB_NAMESPACE].kind else { panic!("envoy.lb is a struct") };
        assert_eq!(lb.fields[DESTINATION], string_value("10.0.0.1:8000"));
        let context = Metadata {
            filter_metadata: meta
                .fields
                .into_iter()
                .filter_map(|(k, v)| match v.kind {
                    Some(Kind::StructValue(s)) => Some((k, s)),
                    _ => None,
                })
                .collect(),
            ..Default::default()
        };
        assert_eq!(joined_booking(Some(&context)).as_deref(), Some("epp-7"), "an observer finds the booking");
    }

    type Asked = (String, Vec<u8>, Option<String>);

    /// A picking service of the test's: picks `10.0.0.1:8000` (fallback `10.0.0.2:8000`) or
    /// refuses as told, and keeps what it was asked and told.
    #[derive(Default)]
    struct FakePicker {
        refuse: Option<fn() -> PickError>,
        /// Picks with the model rewritten to this (the span found in the body as the scorer's
        /// rules would).
        rewrite_to: Option<&'static str>,
        /// Each request asked for: API path, body, objective.
        asked: std::sync::Mutex<Vec<Asked>>,
        reports: std::sync::Mutex<Vec<LifecycleReport>>,
        served: std::sync::Mutex<Vec<(String, SocketAddr)>>,
        bookings: std::sync::atomic::AtomicU64,
        metrics: crate::metrics::Metrics,
    }

    impl PickingService for Arc<FakePicker> {
        async fn pick(&self, request: PickRequest<'_>) -> Result<crate::picking::Pick, PickError> {
            let asked =
                (request.api_path.unwrap().to_string(), request.body.to_vec(), request.objective.map(String::from));
            self.asked.lock().unwrap().push(asked);
            if let Some(refuse) = self.refuse {
                return Err(refuse());
            }
            let model_rewrite = self.rewrite_to.map(|model| {
                let rule = crate::config::ModelRewriteRule {
                    matches: Vec::new(),
                    targets: vec![crate::config::RewriteTarget { model: model.into(), weight: None }],
                };
                crate::rewrites::ModelRewrites::new(vec![rule]).of(&request.body).expect("a model to rewrite")
            });
            let pod = |name: &str, address: &str| {
                Arc::new(crate::picking::Pod { name: name.into(), address: address.into(), ..Default::default() })
            };
            Ok(crate::picking::Pick {
                decode: pod("a", "10.0.0.1:8000"),
                prefill: None,
                fallbacks: vec![pod("b", "10.0.0.2:8000")],
                policy: "fake",
                prompt_tokens: 0,
                cached_tokens: 0,
                uncached_tokens: 0,
                threshold_tokens: None,
                predicted_wait_seconds: None,
                admission_wait: std::time::Duration::ZERO,
                model_rewrite,
                explain: None,
            })
        }

        fn report(&self, report: &LifecycleReport) -> bool {
            self.reports.lock().unwrap().push(report.clone());
            true
        }

        fn served(&self, booking: &str, address: SocketAddr) {
            self.served.lock().unwrap().push((booking.to_string(), address));
        }

        fn next_booking(&self) -> u64 {
            self.bookings.fetch_add(1, Ordering::Relaxed)
        }

        fn metrics(&self) -> &crate::metrics::Metrics {
            &self.metrics
        }
    }

    fn request(message: Message) -> ProcessingRequest {
        ProcessingRequest { request: Some(message), ..Default::default() }
    }

    fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue { key: k.to_string(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
            .collect();
        HttpHeaders { headers: Some(HeaderMap { headers }), end_of_stream, ..Default::default() }
    }

    fn body(bytes: &[u8], end_of_stream: bool) -> HttpBody {
        HttpBody { body: bytes.to_vec(), end_of_stream, ..Default::default() }
    }

    fn post(path: &str, extra: &[(&str, &str)]) -> Message {
        let mut pairs = vec![(":method", "POST"), (":path", path), ("x-request-id", "r-1")];
        pairs.extend_from_slice(extra);
        Message::RequestHeaders(headers(&pairs, false))
    }

    /// Runs one stream's messages through an exchange asking `picker`; its answers.
    async fn exchange(picker: &Arc<FakePicker>, messages: Vec<ProcessingRequest>) -> Vec<ProcessingResponse> {
        let settings = Arc::new(EppSection { body_limit_bytes: 1000, ..EppSection::default() });
        let exchange = Exchange::new(picker.clone(), settings, Arc::default(), 0);
        let inbound = futures::stream::iter(messages.into_iter().map(Ok));
        exchange.answers(inbound).map(|answer| answer.expect("an answer, not a failed stream")).collect().await
    }

    fn set_headers(answer: &ProcessingResponse) -> Vec<(String, String)> {
        let common = match &answer.response {
            Some(Answer::RequestHeaders(h)) => h.response.as_ref(),
            Some(Answer::RequestBody(b)) => b.response.as_ref(),
            _ => None,
        };
        let mutation = common.and_then(|c| c.header_mutation.clone()).unwrap_or_default();
        mutation
            .set_headers
            .into_iter()
            .filter_map(|h| h.header)
            .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
            .collect()
    }

    fn streamed_body(answer: &ProcessingResponse) -> Option<(Vec<u8>, bool)> {
        let Some(Answer::RequestBody(BodyResponse { response: Some(common) })) = &answer.response else { return None };
        match &common.body_mutation.as_ref()?.mutation {
            Some(body_mutation::Mutation::StreamedResponse(s)) => Some((s.body.clone(), s.end_of_stream)),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_full_duplex_stream_is_picked_once_its_body_is_whole_and_its_response_reported() {
        let picker = Arc::new(FakePicker::default());
        let served = metadata(LB_NAMESPACE, SERVED, string_value("10.0.0.2:8000"));
        let messages = vec![
            request(post("/v1/chat/completions", &[(HEADER_OBJECTIVE, "gold")])),
            request(Message::RequestBody(body(br#"{"messages":[{"role":"user","#, false))),
            request(Message::RequestBody(body(br#""content":"hi"}]}"#, true))),
            ProcessingRequest {
                metadata_context: Some(served),
                ..request(Message::ResponseHeaders(headers(&[(":status", "200")], false)))
            },
            request(Message::ResponseBody(body(b"data: {\"choices\":[]}\n\n", false))),
            request(Message::ResponseBody(body(b"data: [DONE]\n\n", true))),
        ];
        let answers = exchange(&picker, messages).await;
        // Nothing answered before the body was whole: the pick rides on the headers' answer.
        let picked = &answers[0];
        assert!(matches!(picked.response, Some(Answer::RequestHeaders(_))));
        assert_eq!(set_headers(picked), vec![(DESTINATION.to_string(), "10.0.0.1:8000,10.0.0.2:8000".to_string())]);
        let lb = &picked.dynamic_metadata.as_ref().expect("the decision's metadata").fields[LB_NAMESPACE];
        assert!(
            matches!(&lb.kind, Some(Kind::StructValue(s)) if s.fields[DESTINATION] == string_value("10.0.0.1:8000,10.0.0.2:8000"))
        );
        // The body goes back whole, its end marked once.
        let returned: Vec<(Vec<u8>, bool)> = answers.iter().filter_map(streamed_body).collect();
        let whole: Vec<u8> = returned.iter().flat_map(|(b, _)| b.clone()).collect();
        assert_eq!(whole, br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec());
        assert_eq!(returned.iter().filter(|(_, end)| *end).count(), 1);
        // The service was asked once, with the whole body and the objective.
        let asked = picker.asked.lock().unwrap().clone();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].0, "/v1/chat/completions");
        assert_eq!(asked[0].1, whole);
        assert_eq!(asked[0].2.as_deref(), Some("gold"));
        // The response: served by the fallback (the booking follows), first token, done.
        assert_eq!(*picker.served.lock().unwrap(), vec![("epp-0".to_string(), "10.0.0.2:8000".parse().unwrap())]);
        let events: Vec<LifecycleEvent> = picker.reports.lock().unwrap().iter().map(|r| r.event).collect();
        assert_eq!(events, vec![LifecycleEvent::FirstToken, LifecycleEvent::Done]);
        assert!(picker.reports.lock().unwrap().iter().all(|r| r.request_id == "epp-0"));
        assert_eq!(answers.len(), 2 + 1 + 2, "headers, body back, response headers and two chunks");
    }

    #[tokio::test]
    async fn a_rewritten_model_is_in_the_body_the_gateway_sends_on_in_every_body_mode() {
        let picker = Arc::new(FakePicker { rewrite_to: Some("llama-v2"), ..FakePicker::default() });
        let (first, second) = (&br#"{"model": "llama", "prom"#[..], &br#"pt": "hi"}"#[..]);
        let want = br#"{"model": "llama-v2", "prompt": "hi"}"#;
        for mode in [BodyMode::FullDuplexStreamed, BodyMode::Buffered, BodyMode::Streamed] {
            let config = ProtocolConfiguration {
                request_body_mode: mode as i32,
                response_body_mode: BodyMode::None as i32,
                send_body_without_waiting_for_header_response: true,
            };
            let whole = [first, second].concat();
            let chunks: Vec<&[u8]> = if mode == BodyMode::Buffered { vec![&whole] } else { vec![first, second] };
            let mut messages =
                vec![ProcessingRequest { protocol_config: Some(config), ..request(post("/v1/completions", &[])) }];
            let last = chunks.len() - 1;
            messages.extend(chunks.iter().enumerate().map(|(i, c)| request(Message::RequestBody(body(c, i == last)))));
            let answers = exchange(&picker, messages).await;
            let length = ("content-length".to_string(), want.len().to_string());
            assert!(answers.iter().any(|a| set_headers(a).contains(&length)), "{mode:?}: its length");
            // What the gateway sends on: each body answer's replacement (or the chunk kept).
            let mut sent = Vec::new();
            let mut kept = chunks.iter();
            for answer in &answers {
                let Some(Answer::RequestBody(BodyResponse { response: Some(common) })) = &answer.response else {
                    continue;
                };
                let chunk = kept.next().expect("one answer per chunk");
                match common.body_mutation.as_ref().and_then(|m| m.mutation.as_ref()) {
                    Some(body_mutation::Mutation::StreamedResponse(s)) => sent.extend_from_slice(&s.body),
                    Some(body_mutation::Mutation::Body(b)) => sent.extend_from_slice(b),
                    Some(body_mutation::Mutation::ClearBody(true)) => {}
                    _ => sent.extend_from_slice(chunk),
                }
            }
            assert_eq!(String::from_utf8_lossy(&sent), String::from_utf8_lossy(want), "{mode:?}");
        }
    }

    #[tokio::test]
    async fn a_buffered_stream_gets_the_pick_in_its_body_answer() {
        let picker = Arc::new(FakePicker::default());
        let config = ProtocolConfiguration {
            request_body_mode: BodyMode::Buffered as i32,
            response_body_mode: BodyMode::None as i32,
            ..Default::default()
        };
        let messages = vec![
            ProcessingRequest { protocol_config: Some(config), ..request(post("/v1/completions", &[])) },
            request(Message::RequestBody(body(br#"{"prompt":"hi"}"#, true))),
        ];
        let answers = exchange(&picker, messages).await;
        assert_eq!(answers.len(), 2);
        assert!(set_headers(&answers[0]).is_empty(), "headers answered before the body, without a pick");
        assert!(matches!(answers[1].response, Some(Answer::RequestBody(_))));
        assert_eq!(set_headers(&answers[1])[0].1, "10.0.0.1:8000,10.0.0.2:8000");
    }

    #[tokio::test]
    async fn a_refusal_is_the_clients_answer_in_its_apis_shape() {
        let shed = || PickError::Shed { retry_after_seconds: 3, reason: "sheddable" };
        let picker = Arc::new(FakePicker { refuse: Some(shed), ..FakePicker::default() });
        let messages = vec![
            request(post("/v1/messages", &[])),
            request(Message::RequestBody(body(br#"{"model":"m","max_tokens":1,"messages":[]}"#, true))),
        ];
        let answers = exchange(&picker, messages).await;
        assert_eq!(answers.len(), 1);
        let Some(Answer::ImmediateResponse(refused)) = &answers[0].response else { panic!("{:?}", answers[0]) };
        assert_eq!(refused.status.as_ref().unwrap().code, 429);
        let set: Vec<(String, String)> = refused
            .headers
            .as_ref()
            .unwrap()
            .set_headers
            .iter()
            .filter_map(|h| h.header.clone())
            .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
            .collect();
        assert!(set.contains(&("retry-after".to_string(), "3".to_string())), "{set:?}");
        let error: serde_json::Value = serde_json::from_slice(&refused.body).unwrap();
        assert_eq!(error["type"], "error", "Anthropic's error shape: {error}");
        assert_eq!(error["error"]["type"], "rate_limit_error");
        assert!(picker.reports.lock().unwrap().is_empty(), "nothing was booked");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_without_asking() {
        let picker = Arc::new(FakePicker::default());
        let messages = vec![
            request(post("/v1/completions", &[])),
            request(Message::RequestBody(body(&[b' '; 600], false))),
            request(Message::RequestBody(body(&[b' '; 600], true))),
        ];
        let answers = exchange(&picker, messages).await;
        let Some(Answer::ImmediateResponse(refused)) = &answers[0].response else { panic!("{:?}", answers[0]) };
        assert_eq!(refused.status.as_ref().unwrap().code, 413);
        assert!(picker.asked.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_stream_gone_before_its_response_cancels_the_booking() {
        let picker = Arc::new(FakePicker::default());
        let messages = vec![
            request(post("/v1/completions", &[])),
            request(Message::RequestBody(body(br#"{"prompt":"hi"}"#, true))),
        ];
        let answers = exchange(&picker, messages).await;
        assert_eq!(set_headers(&answers[0])[0].1, "10.0.0.1:8000,10.0.0.2:8000");
        let reports = picker.reports.lock().unwrap().clone();
        assert_eq!(reports.len(), 1);
        assert_eq!((reports[0].request_id.as_str(), reports[0].event), ("epp-0", LifecycleEvent::Cancelled));
    }

    #[tokio::test]
    async fn other_requests_pass_with_the_clients_destination_stripped() {
        let picker = Arc::new(FakePicker::default());
        let get = headers(&[(":method", "GET"), (":path", "/v1/models"), (DESTINATION, "6.6.6.6:80")], true);
        let answers = exchange(&picker, vec![request(Message::RequestHeaders(get))]).await;
        let Some(Answer::RequestHeaders(h)) = &answers[0].response else { panic!("{:?}", answers[0]) };
        let mutation = h.response.as_ref().unwrap().header_mutation.as_ref().unwrap();
        assert_eq!(mutation.remove_headers, vec![DESTINATION.to_string()]);
        assert!(picker.asked.lock().unwrap().is_empty());
    }
}
