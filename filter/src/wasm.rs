//! The proxy-wasm glue: Envoy calls these contexts; they call the host through
//! `proxy_wasm::hostcalls` directly (the SDK's convenience methods `unwrap` host errors and
//! non-UTF-8 header values, and a panic traps the VM: every request on the worker fails).

use crate::config::{FailureMode, FilterConfig, PdMode};
use crate::logic::{self, Verdict};
use kvgate_route_api::{
    HEADER_OBJECTIVE, HEADER_REQUEST_ID, LIFECYCLE_PATH, LifecycleBatch, LifecycleEvent, LifecycleReport, Outcome,
    ROUTE_STREAM_METHOD, ROUTE_STREAM_SERVICE, RouteAnswer, RouteCall, StreamReport,
};
use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { shared: None }) });
}}

/// Counters and histograms exported through Envoy's stats (`wasmcustom.kvgate_*`).
struct Metrics {
    routed: u32,
    fail_open: u32,
    fail_closed: u32,
    bad_request: u32,
    scorer_bad_request: u32,
    callout_ms: u32,
    lifecycle_sent: u32,
    lifecycle_failed: u32,
    pd_prefill_ok: u32,
    pd_fallback: u32,
    pd_header: u32,
    shed: u32,
    route_stream_opened: u32,
}

impl Metrics {
    fn define() -> Self {
        let m = |kind, name: &str| hostcalls::define_metric(kind, name).unwrap_or(u32::MAX);
        Self {
            routed: m(MetricType::Counter, "kvgate_routed"),
            fail_open: m(MetricType::Counter, "kvgate_fail_open"),
            fail_closed: m(MetricType::Counter, "kvgate_fail_closed"),
            bad_request: m(MetricType::Counter, "kvgate_bad_request"),
            scorer_bad_request: m(MetricType::Counter, "kvgate_scorer_bad_request"),
            callout_ms: m(MetricType::Histogram, "kvgate_callout_ms"),
            lifecycle_sent: m(MetricType::Counter, "kvgate_lifecycle_reports_sent"),
            lifecycle_failed: m(MetricType::Counter, "kvgate_lifecycle_reports_failed"),
            pd_prefill_ok: m(MetricType::Counter, "kvgate_pd_prefill_ok"),
            pd_fallback: m(MetricType::Counter, "kvgate_pd_fallback"),
            pd_header: m(MetricType::Counter, "kvgate_pd_header"),
            shed: m(MetricType::Counter, "kvgate_shed"),
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
    /// Lifecycle reports waiting for the next flush, with when each happened.
    reports: RefCell<Vec<(LifecycleReport, SystemTime)>>,
    /// The scorer's last answer (or notice) said requests wait in its admission queue:
    /// reports go at once (each frees room someone waits for), not at the next flush.
    report_at_once: Cell<bool>,
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
    waiting: HashMap<u32, Waiting>,
    /// When the stream last answered anything.
    last_answer: Option<SystemTime>,
}

struct Waiting {
    flow: SharedFlow,
    sent: SystemTime,
}

impl Shared {
    /// The waiting lifecycle reports, each stamped with its age now.
    fn take_reports(&self) -> Vec<LifecycleReport> {
        let pending = std::mem::take(&mut *self.reports.borrow_mut());
        if pending.is_empty() {
            return Vec::new(); // most route calls: no clock read
        }
        let sent = now();
        pending.into_iter().map(|(report, at)| logic::aged(report, at, sent)).collect()
    }

    /// Sends the waiting lifecycle reports to the scorer in one message: on the route
    /// stream while it is open, else by HTTP.
    fn flush(&self) {
        let reports = self.take_reports();
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
            (":authority", self.config.scorer_authority.as_str()),
            ("content-type", "application/json"),
        ];
        let timeout = Duration::from_millis(self.config.lifecycle_timeout_ms);
        match hostcalls::dispatch_http_call(&self.config.scorer_cluster, headers, Some(&body), vec![], timeout) {
            Ok(_) => incr(self.metrics.lifecycle_sent, n),
            Err(status) => {
                incr(self.metrics.lifecycle_failed, n);
                log::debug!("kvgate: lifecycle batch not sent: {status:?}");
            }
        }
    }

    fn report(&self, request_id: &str, event: LifecycleEvent, output_tokens: Option<u32>, served: Option<String>) {
        let due = {
            let mut reports = self.reports.borrow_mut();
            let report =
                LifecycleReport { request_id: request_id.to_string(), event, output_tokens, served, age_us: None };
            reports.push((report, now()));
            reports.len() >= self.config.lifecycle_batch_max || self.report_at_once.get()
        };
        if due {
            self.flush();
        }
    }

    /// Opens the route stream; from the root only (the stream's answers go to the context
    /// that opened it).
    fn open_route_stream(&self) {
        // The host reads a serialized `GrpcService`, or failing that a cluster name; the SDK
        // passes text. A name shorter than 128 bytes serializes to valid UTF-8; a longer one
        // goes as the name (which a stray parse of it as a proto could misread).
        let name = &self.config.scorer_cluster;
        let service = String::from_utf8(GrpcService::cluster(name).encode_to_vec()).unwrap_or_else(|_| name.clone());
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
        let waiting = std::mem::take(&mut self.route_stream.borrow_mut().waiting);
        for (id, call) in waiting {
            if hostcalls::set_effective_context(id).is_ok() {
                unavailable(self, &call.flow, reason);
            }
        }
    }

    /// Calls unanswered past the scorer timeout fail; a stream that answered nothing since
    /// such a call was sent is stuck, and replaced.
    fn expire_waiting(&self) {
        let now = now();
        let limit = Duration::from_millis(self.config.scorer_timeout_ms);
        let (expired, stuck) = {
            let mut stream = self.route_stream.borrow_mut();
            let expired: Vec<(u32, Waiting)> = stream
                .waiting
                .extract_if(|_, call| now.duration_since(call.sent).is_ok_and(|waited| waited >= limit))
                .collect();
            let stuck = expired.iter().any(|(_, call)| stream.last_answer.is_none_or(|last| last < call.sent));
            (expired, stuck)
        };
        let reason = format!("no answer within {} ms", self.config.scorer_timeout_ms);
        for (id, call) in expired {
            if hostcalls::set_effective_context(id).is_ok() {
                unavailable(self, &call.flow, &reason);
            }
        }
        if stuck {
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

impl GrpcService {
    fn cluster(name: &str) -> Self {
        GrpcService { envoy_grpc: Some(EnvoyGrpc { cluster_name: name.to_string() }) }
    }
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
        shared.report_at_once.set(answer.admission_waiting > 0);
        let waiting = {
            let mut stream = shared.route_stream.borrow_mut();
            stream.last_answer = Some(now());
            u32::try_from(answer.call).ok().and_then(|id| stream.waiting.remove(&id).map(|call| (id, call)))
        };
        // Not waiting: timed out already, or the client left.
        let Some((id, call)) = waiting else { return };
        if hostcalls::set_effective_context(id).is_ok() {
            on_decision(&shared, id, &call, &answer);
        }
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
            on_prefilled(&shared, &flow, status, &answer);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = buffer(BufferType::PluginConfiguration, size);
        match FilterConfig::parse(&bytes) {
            Ok(config) => {
                let _ = hostcalls::set_tick_period(Duration::from_millis(config.lifecycle_flush_ms));
                log::info!(
                    "kvgate: routing {:?} via cluster {} (timeout {} ms, fail-{:?})",
                    config.paths,
                    config.scorer_cluster,
                    config.scorer_timeout_ms,
                    config.failure_mode
                );
                let shared = Rc::new(Shared {
                    config,
                    metrics: Metrics::define(),
                    reports: RefCell::new(Vec::new()),
                    report_at_once: Cell::new(false),
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
        Some(Box::new(Request { shared, context_id, flow: Rc::new(RefCell::new(Flow::default())) }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

#[derive(Default, PartialEq, Clone)]
enum Phase {
    /// Not for the scorer (other path or method): passes untouched.
    #[default]
    Passthrough,
    /// Buffering the body.
    Buffering,
    /// Waiting for the scorer.
    Deciding,
    /// Waiting for the prefill leg of a disaggregated request; then on to `decode`.
    Prefilling { decode: String },
    /// Sent to the pod the scorer chose.
    Routed,
    /// Answered by the filter itself (400, 503) or sent on without a decision (fail-open).
    Settled,
}

/// A request's [`Flow`], held by the request and, while it waits, by the root.
type SharedFlow = Rc<RefCell<Flow>>;

/// One request's state, shared with the root while the request waits on it (for its
/// decision or its prefill leg): the root acts on the request as its effective context.
#[derive(Default)]
struct Flow {
    phase: Phase,
    request_id: String,
    api_path: String,
    /// Size of the buffered request body.
    body_size: usize,
    /// `:status` of the response, read when its headers pass.
    response_status: Option<u16>,
    /// `upstream.address` when the response headers passed.
    served: Option<String>,
    first_token: bool,
    response_complete: bool,
    output_tokens: Option<u32>,
}

struct Request {
    shared: Rc<Shared>,
    context_id: u32,
    flow: SharedFlow,
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

/// Answers the client directly with a JSON error.
fn respond(status: u16, kind: &str, message: &str) {
    respond_with(status, kind, message, None)
}

/// A JSON error, with `Retry-After` when given.
fn respond_with(status: u16, kind: &str, message: &str, retry_after: Option<&str>) {
    let body = logic::error_body(status, kind, message);
    let mut headers = vec![("content-type", "application/json"), ("x-kvgate-error", kind)];
    if let Some(seconds) = retry_after {
        headers.push(("retry-after", seconds));
    }
    if let Err(e) = hostcalls::send_http_response(u32::from(status), headers, Some(&body)) {
        log::warn!("kvgate: cannot send the {status} answer: {e:?}");
    }
}

/// The scorer could not decide: the failure mode applies. Returns the action for a
/// callback of the request itself; from elsewhere, `Continue` has already been acted on.
fn fail(shared: &Shared, flow: &mut Flow, reason: &str) -> Action {
    flow.phase = Phase::Settled;
    match shared.config.failure_mode {
        FailureMode::Open => {
            incr(shared.metrics.fail_open, 1);
            log::warn!("kvgate: scorer unavailable ({reason}); request {} left to Envoy's balancing", flow.request_id);
            Action::Continue
        }
        FailureMode::Closed => {
            incr(shared.metrics.fail_closed, 1);
            log::warn!("kvgate: scorer unavailable ({reason}); request {} refused", flow.request_id);
            respond(503, "ServiceUnavailable", "the routing service is unavailable");
            Action::Pause
        }
    }
}

/// [`fail`] for a request paused while waiting (the request is the effective context).
fn unavailable(shared: &Shared, flow: &RefCell<Flow>, reason: &str) {
    if fail(shared, &mut flow.borrow_mut(), reason) == Action::Continue {
        let _ = hostcalls::resume_http_request();
    }
}

/// The scorer's answer to a request's route call (the request is the effective context).
fn on_decision(shared: &Shared, id: u32, call: &Waiting, answer: &RouteAnswer) {
    let ms = now().duration_since(call.sent).map(|d| d.as_millis() as u64).unwrap_or(0);
    let _ = hostcalls::record_metric(shared.metrics.callout_ms, ms);
    let flow_cell = &call.flow;
    let mut flow = flow_cell.borrow_mut();
    match logic::interpret(answer) {
        Verdict::Route { destination, pod, prefill: None } => {
            log::debug!("kvgate: request {} → {pod} ({destination})", flow.request_id);
            route_to(shared, &mut flow, &destination);
        }
        Verdict::Route { destination, pod, prefill: Some(prefill) } => {
            log::debug!("kvgate: request {} → prefill {prefill}, decode {pod} ({destination})", flow.request_id);
            match shared.config.pd_mode {
                PdMode::Header => {
                    incr(shared.metrics.pd_header, 1);
                    let _ = hostcalls::set_map_value(
                        MapType::HttpRequestHeaders,
                        &shared.config.prefiller_header,
                        Some(&prefill),
                    );
                    route_to(shared, &mut flow, &destination);
                }
                PdMode::Envoy => {
                    drop(flow);
                    send_prefill_leg(shared, id, flow_cell, &prefill, destination);
                }
            }
        }
        Verdict::BadRequest(message) => {
            incr(shared.metrics.scorer_bad_request, 1);
            flow.phase = Phase::Settled;
            respond(400, "BadRequestError", &message);
        }
        Verdict::Shed(message) => {
            incr(shared.metrics.shed, 1);
            flow.phase = Phase::Settled;
            let retry_after = match &answer.outcome {
                Some(Outcome::Refusal(refusal)) => refusal.retry_after.map(|s| s.to_string()),
                _ => None,
            };
            respond_with(429, "TooManyRequests", &message, retry_after.as_deref());
        }
        Verdict::Unavailable(reason) => {
            drop(flow);
            unavailable(shared, flow_cell, &reason);
        }
    }
}

/// Sets the destination and lets the request go.
fn route_to(shared: &Shared, flow: &mut Flow, destination: &str) {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &shared.config.destination_header, Some(destination));
    incr(shared.metrics.routed, 1);
    flow.phase = Phase::Routed;
    let _ = hostcalls::resume_http_request();
}

/// The prefill leg, sent by the filter to the prefill pod through the pods cluster.
fn send_prefill_leg(shared: &Shared, id: u32, flow_cell: &SharedFlow, prefill: &str, decode: String) {
    let mut flow = flow_cell.borrow_mut();
    let original = buffer(BufferType::HttpRequestBody, flow.body_size);
    let leg = match logic::prefill_leg_body(&original) {
        Ok(leg) => leg,
        Err(e) => return prefill_failed(shared, &mut flow, &format!("cannot build the prefill leg: {e}"), &decode),
    };
    let headers = vec![
        (":method", "POST"),
        (":path", flow.api_path.as_str()),
        (":authority", "kvgate-prefill"),
        ("content-type", "application/json"),
        (HEADER_REQUEST_ID, flow.request_id.as_str()),
        (shared.config.destination_header.as_str(), prefill),
    ];
    let timeout = Duration::from_millis(shared.config.prefill_timeout_ms);
    match hostcalls::dispatch_http_call(&shared.config.pods_cluster, headers, Some(&leg), vec![], timeout) {
        Ok(token) => {
            flow.phase = Phase::Prefilling { decode };
            shared.prefill_legs.borrow_mut().insert(token, (id, flow_cell.clone()));
        }
        Err(status) => {
            let reason = format!("cannot call cluster {}: {status:?}", shared.config.pods_cluster);
            prefill_failed(shared, &mut flow, &reason, &decode)
        }
    }
}

/// The prefill pod answered: hand its `kv_transfer_params` to the decode pod.
fn on_prefilled(shared: &Shared, flow_cell: &RefCell<Flow>, status: Option<u16>, answer: &[u8]) {
    let mut flow = flow_cell.borrow_mut();
    let Phase::Prefilling { decode } = flow.phase.clone() else { return };
    shared.report(&flow.request_id, LifecycleEvent::PrefillDone, None, None);
    if status != Some(200) {
        return prefill_failed(shared, &mut flow, &format!("prefill pod answered {status:?}"), &decode);
    }
    let original = buffer(BufferType::HttpRequestBody, flow.body_size);
    let body = match logic::decode_leg_body(&original, answer) {
        Ok(body) => body,
        Err(e) => return prefill_failed(shared, &mut flow, &e, &decode),
    };
    if let Err(e) = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, original.len(), &body) {
        return prefill_failed(shared, &mut flow, &format!("cannot rewrite the body: {e:?}"), &decode);
    }
    // The client's content-length no longer holds; a stale one would truncate the body.
    let length = body.len().to_string();
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", Some(&length));
    incr(shared.metrics.pd_prefill_ok, 1);
    route_to(shared, &mut flow, &decode);
}

/// No usable prefill: the decode pod prefills locally; the client still gets its answer.
fn prefill_failed(shared: &Shared, flow: &mut Flow, reason: &str, decode: &str) {
    incr(shared.metrics.pd_fallback, 1);
    log::warn!("kvgate: prefill leg of {} failed ({reason}); decoding with local prefill", flow.request_id);
    if !matches!(flow.phase, Phase::Prefilling { .. }) {
        shared.report(&flow.request_id, LifecycleEvent::PrefillDone, None, None);
    }
    route_to(shared, flow, decode);
}

impl Request {
    /// Sends the request's route call on the stream and pauses until it is answered.
    fn ask_scorer(&mut self, body: Vec<u8>) -> Action {
        let shared = self.shared.clone();
        let mut flow = self.flow.borrow_mut();
        let Some(token) = shared.route_stream.borrow().token else {
            return fail(&shared, &mut flow, "the route stream to the scorer is not open");
        };
        // The waiting lifecycle reports ride along: the scorer applies them first, so this
        // decision sees them without waiting for the next flush.
        let reports = shared.take_reports();
        let call = RouteCall {
            call: u64::from(self.context_id),
            request_id: flow.request_id.clone(),
            api_path: flow.api_path.clone(),
            objective: header(MapType::HttpRequestHeaders, HEADER_OBJECTIVE),
            body,
            reports: reports.into_iter().map(StreamReport::from).collect(),
        };
        if let Err(status) = hostcalls::send_grpc_stream_message(token, Some(&call.encode_to_vec()), false) {
            if !call.reports.is_empty() {
                shared.send_reports_by_http(unsent(call));
            }
            return fail(&shared, &mut flow, &format!("cannot send on the route stream: {status:?}"));
        }
        incr(shared.metrics.lifecycle_sent, call.reports.len() as i64);
        flow.phase = Phase::Deciding;
        shared
            .route_stream
            .borrow_mut()
            .waiting
            .insert(self.context_id, Waiting { flow: self.flow.clone(), sent: now() });
        Action::Pause
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let shared = &self.shared;
        // Nobody but the scorer names the destination: drop any client-supplied value.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &shared.config.destination_header, None);
        let method = header(MapType::HttpRequestHeaders, ":method").unwrap_or_default();
        let path = header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        if method != "POST" || !shared.config.intercepts(&path) {
            return Action::Continue;
        }
        let mut flow = self.flow.borrow_mut();
        flow.api_path = path.split('?').next().unwrap_or_default().to_string();
        flow.request_id = match header(MapType::HttpRequestHeaders, HEADER_REQUEST_ID) {
            Some(id) if !id.is_empty() => id,
            _ => {
                let n = shared.generated_ids.get().wrapping_add(1);
                shared.generated_ids.set(n);
                let nanos = now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
                let id = logic::request_id(nanos, self.context_id, n);
                let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, HEADER_REQUEST_ID, Some(&id));
                id
            }
        };
        if end_of_stream {
            incr(shared.metrics.bad_request, 1);
            flow.phase = Phase::Settled;
            respond(400, "BadRequestError", "request body is required");
            return Action::Pause;
        }
        flow.phase = Phase::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        {
            let mut flow = self.flow.borrow_mut();
            match flow.phase {
                Phase::Buffering if !end_of_stream => return Action::Pause,
                Phase::Buffering => {}
                Phase::Passthrough | Phase::Routed | Phase::Settled => return Action::Continue,
                Phase::Deciding | Phase::Prefilling { .. } => return Action::Pause,
            }
            flow.body_size = body_size;
        }
        let body = buffer(BufferType::HttpRequestBody, body_size);
        // What is plainly not a JSON object is refused here; the scorer parses the rest (one
        // parse per request) and answers 400 for what it cannot read.
        if !kvgate_route_api::starts_as_object(&body) {
            incr(self.shared.metrics.bad_request, 1);
            self.flow.borrow_mut().phase = Phase::Settled;
            respond(400, "BadRequestError", kvgate_route_api::NOT_AN_OBJECT);
            return Action::Pause;
        }
        self.ask_scorer(body)
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let mut flow = self.flow.borrow_mut();
        flow.response_status = header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse::<u16>().ok());
        if flow.phase == Phase::Routed {
            // The pod that answered: Envoy may have retried one of the pick's fallbacks.
            flow.served = hostcalls::get_property(vec!["upstream", "address"])
                .ok()
                .flatten()
                .and_then(|a| String::from_utf8(a).ok());
        }
        if end_of_stream {
            flow.response_complete = true;
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mut flow = self.flow.borrow_mut();
        if flow.phase == Phase::Routed {
            if !flow.first_token && body_size > 0 {
                flow.first_token = true;
                let served = flow.served.take();
                self.shared.report(&flow.request_id, LifecycleEvent::FirstToken, None, served);
            }
            if let Some(n) = kvgate_route_api::completion_tokens(&buffer(BufferType::HttpResponseBody, body_size)) {
                flow.output_tokens = Some(n);
            }
        }
        if end_of_stream {
            flow.response_complete = true;
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // No answer is awaited any more (the client may have left while it was).
        self.shared.route_stream.borrow_mut().waiting.remove(&self.context_id);
        let flow = self.flow.borrow();
        // A decided request (or one whose decision may have been made before the client
        // left) releases its booking in the scorer.
        if let Phase::Prefilling { .. } = flow.phase {
            self.shared.report(&flow.request_id, LifecycleEvent::PrefillDone, None, None);
        }
        if !matches!(flow.phase, Phase::Routed | Phase::Deciding | Phase::Prefilling { .. }) {
            return;
        }
        let ok = flow.response_complete && flow.response_status.is_some_and(|s| (200..300).contains(&s));
        let event = if ok { LifecycleEvent::Done } else { LifecycleEvent::Cancelled };
        self.shared.report(&flow.request_id, event, flow.output_tokens, None);
    }
}
