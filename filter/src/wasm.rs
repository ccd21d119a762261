//! The proxy-wasm host: Envoy calls these contexts; they drive each request's
//! [`RequestFlow`] and do what it says through `proxy_wasm::hostcalls` directly (the SDK's
//! convenience methods `unwrap` host errors and non-UTF-8 header values, and a panic traps the
//! VM: every request on the worker fails).

use crate::config::FilterConfig;
use kvgate_route_api::lifecycle::{
    AnswerNext, BodyNext, CallsInFlight, Counter, Next, Proxy, ReportQueue, RequestFlow,
};
use kvgate_route_api::{
    HEADER_OBJECTIVE, HEADER_REQUEST_ID, LIFECYCLE_PATH, LifecycleBatch, LifecycleReport, ROUTE_STREAM_METHOD,
    ROUTE_STREAM_SERVICE, RouteAnswer, RouteCall, StreamReport, lifecycle,
};
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt::Arguments;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { shared: None }) });
}}

/// Counters and histograms exported through Envoy's stats (`wasmcustom.kvgate_*`).
struct Metrics {
    /// The request flow's counters, by [`Counter`] number.
    flow: Vec<u32>,
    callout_ms: u32,
    lifecycle_sent: u32,
    lifecycle_failed: u32,
    route_stream_opened: u32,
}

impl Metrics {
    fn define() -> Self {
        let m = |kind, name: &str| hostcalls::define_metric(kind, name).unwrap_or(u32::MAX);
        Self {
            flow: Counter::all().map(|c| m(MetricType::Counter, &format!("kvgate_{}", c.name()))).collect(),
            callout_ms: m(MetricType::Histogram, "kvgate_callout_ms"),
            lifecycle_sent: m(MetricType::Counter, "kvgate_lifecycle_reports_sent"),
            lifecycle_failed: m(MetricType::Counter, "kvgate_lifecycle_reports_failed"),
            route_stream_opened: m(MetricType::Counter, "kvgate_route_stream_opened"),
        }
    }
}

fn incr(metric: u32, by: i64) {
    let _ = hostcalls::increment_metric(metric, by);
}

/// What the root and every HTTP context of one VM share.
struct Shared {
    config: FilterConfig,
    metrics: Metrics,
    reports: RefCell<ReportQueue>,
    generated_ids: Cell<u64>,
    route_stream: RefCell<RouteStream>,
    /// Prefill legs in flight (sent by the root, which hears their answers), by call token.
    prefill_legs: RefCell<HashMap<u32, (u32, SharedFlow)>>,
}

/// The VM's route stream to the scorer: one gRPC stream that carries every route call of
/// this worker (no HTTP call per request). Opened and reopened by the root (whose
/// callbacks hear its answers), at start and on each tick while it is closed.
#[derive(Default)]
struct RouteStream {
    token: Option<u32>,
    /// Calls sent and not answered yet, by the request's context id (the call's id).
    calls: CallsInFlight<u32, SharedFlow, SystemTime>,
}

impl Shared {
    /// Sends the waiting lifecycle reports to the scorer in one message: on the route
    /// stream while it is open, else by HTTP.
    fn flush(&self) {
        let reports = self.reports.borrow_mut().take(now);
        if reports.is_empty() {
            return;
        }
        let token = self.route_stream.borrow().token;
        let Some(token) = token else { return self.send_reports_by_http(reports) };
        let n = reports.len() as i64;
        let call = RouteCall { reports: reports.into_iter().map(StreamReport::from).collect(), ..Default::default() };
        match hostcalls::send_grpc_stream_message(token, Some(&call.encode_to_vec()), false) {
            Ok(()) => incr(self.metrics.lifecycle_sent, n),
            Err(status) => {
                log::debug!("kvgate: lifecycle batch not sent on the route stream ({status:?}); sending by HTTP");
                self.send_reports_by_http(unsent(call));
            }
        }
    }

    /// Reports sent by a `POST /v1/lifecycle` (when the route stream cannot carry them).
    fn send_reports_by_http(&self, reports: Vec<LifecycleReport>) {
        let n = reports.len() as i64;
        let Ok(body) = serde_json::to_vec(&LifecycleBatch { reports }) else { return };
        let headers = vec![
            (":method", "POST"),
            (":path", LIFECYCLE_PATH),
            (":authority", self.config.wasm.scorer_authority.as_str()),
            ("content-type", "application/json"),
        ];
        let timeout = Duration::from_millis(self.config.wasm.lifecycle_timeout_ms);
        match hostcalls::dispatch_http_call(&self.config.wasm.scorer_cluster, headers, Some(&body), vec![], timeout) {
            Ok(_) => incr(self.metrics.lifecycle_sent, n),
            Err(status) => {
                incr(self.metrics.lifecycle_failed, n);
                log::debug!("kvgate: lifecycle batch not sent: {status:?}");
            }
        }
    }

    /// Opens the route stream; from the root only (the stream's answers go to the context
    /// that opened it).
    fn open_route_stream(&self) {
        // The host reads a serialized `GrpcService`, or failing that a cluster name; the SDK
        // passes text. A name shorter than 128 bytes serializes to valid UTF-8; a longer one
        // goes as the name (which a stray parse of it as a proto could misread).
        let name = &self.config.wasm.scorer_cluster;
        let service = GrpcService { envoy_grpc: Some(EnvoyGrpc { cluster_name: name.clone() }) };
        let service = String::from_utf8(service.encode_to_vec()).unwrap_or_else(|_| name.clone());
        match hostcalls::open_grpc_stream(&service, ROUTE_STREAM_SERVICE, ROUTE_STREAM_METHOD, vec![]) {
            Ok(token) => {
                incr(self.metrics.route_stream_opened, 1);
                self.route_stream.borrow_mut().token = Some(token);
            }
            Err(status) => log::warn!("kvgate: cannot open the route stream: {status:?}"),
        }
    }

    /// Every call still waiting on the stream fails (the stream closed or hangs).
    fn fail_waiting(&self, reason: &str) {
        let waiting = self.route_stream.borrow_mut().calls.reset();
        for (id, flow) in waiting {
            answered(self, id, &flow, Err(reason));
        }
    }

    /// Calls unanswered past the scorer timeout fail; a stream that answered nothing since
    /// such a call was sent is stuck, and replaced.
    fn expire_waiting(&self) {
        let limit = Duration::from_millis(self.config.proxy.scorer_timeout_ms);
        let Some(sent_by) = now().checked_sub(limit) else { return };
        let expired = self.route_stream.borrow_mut().calls.expire(sent_by);
        let reason = format!("no answer within {} ms", self.config.proxy.scorer_timeout_ms);
        for (id, flow) in expired.calls {
            answered(self, id, &flow, Err(&reason));
        }
        if expired.stuck {
            let token = self.route_stream.borrow_mut().token.take();
            if let Some(token) = token {
                log::warn!("kvgate: the route stream answers nothing; opening another");
                let _ = hostcalls::cancel_grpc_stream(token);
            }
            self.fail_waiting(&reason);
        }
    }
}

/// The reports of a stream message that could not be sent, back as reports.
fn unsent(call: RouteCall) -> Vec<LifecycleReport> {
    call.reports.into_iter().filter_map(|r| LifecycleReport::try_from(r).ok()).collect()
}

/// `envoy.config.core.v3.GrpcService` with `envoy_grpc.cluster_name` only: how the host
/// wants the stream's upstream named (field numbers from Envoy's API).
#[derive(Clone, PartialEq, prost::Message)]
struct GrpcService {
    #[prost(message, optional, tag = "1")]
    envoy_grpc: Option<EnvoyGrpc>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct EnvoyGrpc {
    #[prost(string, tag = "1")]
    cluster_name: String,
}

struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token: u32, size: usize) {
        let Some(shared) = self.shared.clone() else { return };
        if shared.route_stream.borrow().token != Some(token) {
            return;
        }
        let message = buffer(BufferType::GrpcReceiveBuffer, size);
        let answer = match RouteAnswer::decode(message.as_slice()) {
            Ok(answer) => answer,
            Err(e) => {
                log::warn!("kvgate: unreadable answer on the route stream: {e}");
                return;
            }
        };
        shared.reports.borrow_mut().heard(&answer);
        // A notice answers no call (0), and still shows the stream answers.
        let id = u32::try_from(answer.call).unwrap_or(0);
        let now = now();
        let waiting = shared.route_stream.borrow_mut().calls.answered(&id, now);
        // Not waiting: timed out already, or the client left.
        let Some((flow, sent)) = waiting else { return };
        let ms = now.duration_since(sent).map(|d| d.as_millis() as u64).unwrap_or(0);
        let _ = hostcalls::record_metric(shared.metrics.callout_ms, ms);
        answered(&shared, id, &flow, Ok(&answer));
    }

    fn on_grpc_stream_close(&mut self, token: u32, status: u32) {
        let Some(shared) = self.shared.clone() else { return };
        let ours = {
            let mut stream = shared.route_stream.borrow_mut();
            let ours = stream.token == Some(token);
            if ours {
                stream.token = None;
            }
            ours
        };
        if ours {
            log::info!("kvgate: route stream closed (grpc status {status}); reopening");
            shared.fail_waiting(&format!("route stream closed (grpc status {status})"));
        }
    }

    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let Some(shared) = self.shared.clone() else { return };
        // A prefill leg's answer (lifecycle batches are fire and forget).
        let Some((id, flow)) = shared.prefill_legs.borrow_mut().remove(&token) else { return };
        // Read while the root is the effective context: the call's answer is the root's.
        let status = call_status(num_headers);
        let answer = buffer(BufferType::HttpCallResponseBody, body_size);
        if hostcalls::set_effective_context(id).is_ok() {
            prefilled(&shared, &flow, Ok((status, &answer)));
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = buffer(BufferType::PluginConfiguration, size);
        match FilterConfig::parse(&bytes) {
            Ok(config) => {
                let _ = hostcalls::set_tick_period(Duration::from_millis(config.proxy.lifecycle_flush_ms));
                log::info!(
                    "kvgate: routing {:?} via cluster {} (timeout {} ms, fail-{:?})",
                    config.proxy.paths,
                    config.wasm.scorer_cluster,
                    config.proxy.scorer_timeout_ms,
                    config.proxy.failure_mode
                );
                let shared = Rc::new(Shared {
                    reports: RefCell::new(ReportQueue::new(config.proxy.lifecycle_batch_max)),
                    config,
                    metrics: Metrics::define(),
                    generated_ids: Cell::new(0),
                    route_stream: RefCell::new(RouteStream::default()),
                    prefill_legs: RefCell::new(HashMap::new()),
                });
                shared.open_route_stream();
                self.shared = Some(shared);
                true
            }
            Err(e) => {
                log::error!("kvgate: configuration rejected: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared {
            shared.flush();
            shared.expire_waiting();
            if shared.route_stream.borrow().token.is_none() {
                shared.open_route_stream();
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Request { shared, context_id, flow: Rc::default() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// A request's [`Flow`], held by the request and, while it waits, by the root.
type SharedFlow = Rc<RefCell<Flow>>;

/// One request's flow, shared with the root while the request waits on it (for its decision
/// or its prefill leg): the root acts on the request as its effective context.
#[derive(Default)]
struct Flow {
    flow: RequestFlow,
    /// Size of the buffered request body.
    body_size: usize,
}

struct Request {
    shared: Rc<Shared>,
    context_id: u32,
    flow: SharedFlow,
}

/// What the flow asks of the host, for the effective context's request.
struct Host<'a> {
    shared: &'a Shared,
    /// Size of the request body buffered (what a rewritten model's or a decode leg's body
    /// replaces).
    body_size: usize,
}

impl Proxy for Host<'_> {
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
    }

    fn send_response(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        if let Err(e) = hostcalls::send_http_response(u32::from(status), headers.to_vec(), Some(body)) {
            log::warn!("kvgate: cannot send the {status} answer: {e:?}");
        }
    }

    fn count(&mut self, counter: Counter) {
        incr(self.shared.metrics.flow[counter as usize], 1);
    }

    fn report(&mut self, report: LifecycleReport) {
        let due = self.shared.reports.borrow_mut().push(report, now());
        if due {
            self.shared.flush();
        }
    }

    fn warn(&mut self, message: Arguments<'_>) {
        log::warn!("{message}");
    }

    fn debug(&mut self, message: Arguments<'_>) {
        log::debug!("{message}");
    }

    fn sends_prefill_legs(&self) -> bool {
        true
    }

    fn request_body(&mut self) -> Result<Vec<u8>, String> {
        Ok(buffer(BufferType::HttpRequestBody, self.body_size))
    }

    fn replace_request_body(&mut self, body: &[u8]) -> Result<(), String> {
        hostcalls::set_buffer(BufferType::HttpRequestBody, 0, self.body_size, body)
            .map_err(|e| format!("cannot rewrite the body: {e:?}"))?;
        self.body_size = body.len();
        Ok(())
    }
}

/// The first `size` bytes of a buffer; empty without asking the host when `size` is 0 (the
/// host answers BadArgument for a missing buffer, and the SDK panics on that).
fn buffer(kind: BufferType, size: usize) -> Vec<u8> {
    if size == 0 {
        return Vec::new();
    }
    hostcalls::get_buffer(kind, 0, size).ok().flatten().unwrap_or_default()
}

fn header(map: MapType, name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(map, name).ok().flatten().map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// The `:status` of an HTTP call's answer; `None` when it produced no headers.
fn call_status(num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        return None;
    }
    header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse::<u16>().ok())
}

fn now() -> SystemTime {
    hostcalls::get_current_time().unwrap_or(UNIX_EPOCH)
}

/// The scorer's answer to a waiting request's call, or why there is none, heard by the root.
fn answered(shared: &Shared, id: u32, flow_cell: &SharedFlow, answer: Result<&RouteAnswer, &str>) {
    if hostcalls::set_effective_context(id).is_err() {
        return; // the request is gone
    }
    let mut flow = flow_cell.borrow_mut();
    let Flow { flow: request, body_size } = &mut *flow;
    let mut host = Host { shared, body_size: *body_size };
    let next = request.answer(&shared.config.proxy, &mut host, answer);
    *body_size = host.body_size; // its model rewritten, the body may have a new size
    match next {
        AnswerNext::Go => {
            let _ = hostcalls::resume_http_request();
        }
        AnswerNext::Hold => {}
        AnswerNext::PrefillLeg { prefill } => {
            drop(flow);
            send_prefill_leg(shared, id, flow_cell, &prefill);
        }
    }
}

/// The prefill leg, sent by the filter to the prefill pod through the pods cluster.
fn send_prefill_leg(shared: &Shared, id: u32, flow_cell: &SharedFlow, prefill: &str) {
    let sent = {
        let flow = flow_cell.borrow();
        let original = buffer(BufferType::HttpRequestBody, flow.body_size);
        lifecycle::prefill_leg_body(&original).map_err(|e| format!("cannot build the prefill leg: {e}")).and_then(
            |leg| {
                let headers = vec![
                    (":method", "POST"),
                    (":path", flow.flow.api_path()),
                    (":authority", "kvgate-prefill"),
                    ("content-type", "application/json"),
                    (HEADER_REQUEST_ID, flow.flow.request_id()),
                    (shared.config.proxy.destination_header.as_str(), prefill),
                ];
                let timeout = Duration::from_millis(shared.config.wasm.prefill_timeout_ms);
                let cluster = &shared.config.wasm.pods_cluster;
                hostcalls::dispatch_http_call(cluster, headers, Some(&leg), vec![], timeout)
                    .map_err(|status| format!("cannot call cluster {cluster}: {status:?}"))
            },
        )
    };
    match sent {
        Ok(token) => {
            shared.prefill_legs.borrow_mut().insert(token, (id, flow_cell.clone()));
        }
        Err(why) => prefilled(shared, flow_cell, Err(why)),
    }
}

/// The prefill leg's outcome (the request is the effective context).
fn prefilled(shared: &Shared, flow_cell: &SharedFlow, leg: Result<(Option<u16>, &[u8]), String>) {
    let mut flow = flow_cell.borrow_mut();
    let Flow { flow: request, body_size } = &mut *flow;
    let original = buffer(BufferType::HttpRequestBody, *body_size);
    let mut host = Host { shared, body_size: *body_size };
    if request.prefilled(&shared.config.proxy, &mut host, leg, &original) == Next::Go {
        let _ = hostcalls::resume_http_request();
    }
}

/// A hook's action for what the flow says.
fn action(next: Next) -> Action {
    match next {
        Next::Go => Action::Continue,
        Next::Hold => Action::Pause,
    }
}

impl Request {
    fn host(&self) -> Host<'_> {
        Host { shared: &self.shared, body_size: 0 }
    }

    /// Sends the request's route call on the stream and pauses until it is answered.
    fn ask_scorer(&mut self, mut call: RouteCall) -> Action {
        let shared = self.shared.clone();
        let Some(token) = shared.route_stream.borrow().token else {
            return self.unanswered("the route stream to the scorer is not open");
        };
        // The waiting lifecycle reports ride along: the scorer applies them first, so this
        // decision sees them without waiting for the next flush.
        call.call = u64::from(self.context_id);
        call.reports = shared.reports.borrow_mut().take_for_call(now);
        if let Err(status) = hostcalls::send_grpc_stream_message(token, Some(&call.encode_to_vec()), false) {
            if !call.reports.is_empty() {
                shared.send_reports_by_http(unsent(call));
            }
            return self.unanswered(&format!("cannot send on the route stream: {status:?}"));
        }
        incr(shared.metrics.lifecycle_sent, call.reports.len() as i64);
        shared.route_stream.borrow_mut().calls.sent(self.context_id, self.flow.clone(), now());
        Action::Pause
    }

    /// The call could not be sent: the failure mode decides, in the request's own hook.
    fn unanswered(&mut self, reason: &str) -> Action {
        let next = self.flow.borrow_mut().flow.answer(&self.shared.config.proxy, &mut self.host(), Err(reason));
        action(if next == AnswerNext::Go { Next::Go } else { Next::Hold })
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let method = header(MapType::HttpRequestHeaders, ":method");
        let path = header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        let new_id = || {
            let n = self.shared.generated_ids.get().wrapping_add(1);
            self.shared.generated_ids.set(n);
            let nanos = now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
            lifecycle::request_id(nanos, self.context_id, n)
        };
        let next = self.flow.borrow_mut().flow.request_headers(
            &self.shared.config.proxy,
            &mut self.host(),
            method.as_deref(),
            &path,
            end_of_stream,
            |name| header(MapType::HttpRequestHeaders, name),
            new_id,
        );
        action(next)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let next = {
            let mut flow = self.flow.borrow_mut();
            flow.body_size = body_size;
            flow.flow.request_body(
                &mut self.host(),
                end_of_stream,
                || buffer(BufferType::HttpRequestBody, body_size),
                || header(MapType::HttpRequestHeaders, HEADER_OBJECTIVE),
            )
        };
        match next {
            BodyNext::Go => Action::Continue,
            BodyNext::Wait => Action::Pause,
            BodyNext::Call(call) => self.ask_scorer(call),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let status = header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse::<u16>().ok());
        // The pod that answered: Envoy may have retried one of the pick's fallbacks.
        let served = || {
            hostcalls::get_property(vec!["upstream", "address"]).ok().flatten().and_then(|a| String::from_utf8(a).ok())
        };
        self.flow.borrow_mut().flow.response_headers(status, end_of_stream, served);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let chunk = || buffer(BufferType::HttpResponseBody, body_size);
        self.flow.borrow_mut().flow.response_body(&mut self.host(), end_of_stream, chunk);
        Action::Continue
    }

    fn on_log(&mut self) {
        // No answer is awaited any more (the client may have left while it was).
        self.shared.route_stream.borrow_mut().calls.forget(&self.context_id);
        self.flow.borrow_mut().flow.complete(&mut self.host());
    }
}
