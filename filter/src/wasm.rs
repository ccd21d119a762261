//! The proxy-wasm glue: Envoy calls these contexts; they call the host through
//! `proxy_wasm::hostcalls` directly (the SDK's convenience methods `unwrap` host errors and
//! non-UTF-8 header values, and a panic traps the VM: every request on the worker fails).

use crate::config::{FailureMode, FilterConfig, PdMode};
use crate::logic::{self, Verdict};
use kvgate_route_api::{
    HEADER_API_PATH, HEADER_OBJECTIVE, HEADER_REQUEST_ID, LIFECYCLE_PATH, LifecycleBatch, LifecycleEvent,
    LifecycleReport, ROUTE_PATH,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
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
    reports: RefCell<Vec<LifecycleReport>>,
    generated_ids: Cell<u64>,
}

impl Shared {
    /// Sends the waiting lifecycle reports to the scorer in one call.
    fn flush(&self) {
        let reports = std::mem::take(&mut *self.reports.borrow_mut());
        if reports.is_empty() {
            return;
        }
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
        let full = {
            let mut reports = self.reports.borrow_mut();
            reports.push(LifecycleReport { request_id: request_id.to_string(), event, output_tokens, served });
            reports.len() >= self.config.lifecycle_batch_max
        };
        if full {
            self.flush();
        }
    }
}

struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

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
                self.shared = Some(Rc::new(Shared {
                    config,
                    metrics: Metrics::define(),
                    reports: RefCell::new(Vec::new()),
                    generated_ids: Cell::new(0),
                }));
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
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Request { shared: Some(shared), context_id, ..Default::default() }))
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

#[derive(Default)]
struct Request {
    shared: Option<Rc<Shared>>,
    context_id: u32,
    phase: Phase,
    request_id: String,
    api_path: String,
    call_started: Option<SystemTime>,
    /// Size of the buffered request body.
    body_size: usize,
    /// `:status` of the response, read when its headers pass.
    response_status: Option<u16>,
    /// `upstream.address` when the response headers passed.
    served: Option<String>,
    /// `Retry-After` of the scorer's 429.
    retry_after: Option<String>,
    first_token: bool,
    response_complete: bool,
    output_tokens: Option<u32>,
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

impl Request {
    fn shared(&self) -> &Shared {
        self.shared.as_deref().expect("every request context is created with the shared state")
    }

    fn fail(&mut self, reason: &str) -> Action {
        let shared = self.shared();
        match shared.config.failure_mode {
            FailureMode::Open => {
                incr(shared.metrics.fail_open, 1);
                log::warn!(
                    "kvgate: scorer unavailable ({reason}); request {} left to Envoy's balancing",
                    self.request_id
                );
                self.phase = Phase::Settled;
                Action::Continue
            }
            FailureMode::Closed => {
                incr(shared.metrics.fail_closed, 1);
                log::warn!("kvgate: scorer unavailable ({reason}); request {} refused", self.request_id);
                self.phase = Phase::Settled;
                respond(503, "ServiceUnavailable", "the routing service is unavailable");
                Action::Pause
            }
        }
    }

    fn ask_scorer(&mut self, body: &[u8]) -> Action {
        let shared = self.shared.clone().expect("shared state");
        let config = &shared.config;
        let mut headers = vec![
            (":method", "POST"),
            (":path", ROUTE_PATH),
            (":authority", config.scorer_authority.as_str()),
            (HEADER_REQUEST_ID, self.request_id.as_str()),
            (HEADER_API_PATH, self.api_path.as_str()),
            ("content-type", "application/json"),
        ];
        let objective = header(MapType::HttpRequestHeaders, HEADER_OBJECTIVE);
        if let Some(objective) = objective.as_deref() {
            headers.push((HEADER_OBJECTIVE, objective));
        }
        let timeout = Duration::from_millis(config.scorer_timeout_ms);
        match hostcalls::dispatch_http_call(&config.scorer_cluster, headers, Some(body), vec![], timeout) {
            Ok(_) => {
                self.phase = Phase::Deciding;
                self.call_started = Some(now());
                Action::Pause
            }
            Err(status) => self.fail(&format!("cannot call cluster {}: {status:?}", config.scorer_cluster)),
        }
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, _token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let status = if num_headers == 0 {
            None
        } else {
            header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse::<u16>().ok())
        };
        if status == Some(429) {
            self.retry_after = header(MapType::HttpCallResponseHeaders, "retry-after");
        }
        let body = buffer(BufferType::HttpCallResponseBody, body_size);
        match self.phase.clone() {
            Phase::Deciding => self.on_decision(status, &body),
            Phase::Prefilling { decode } => self.on_prefilled(status, &body, &decode),
            _ => {}
        }
    }
}

impl Request {
    fn on_decision(&mut self, status: Option<u16>, body: &[u8]) {
        if let Some(started) = self.call_started {
            let ms = now().duration_since(started).map(|d| d.as_millis() as u64).unwrap_or(0);
            let _ = hostcalls::record_metric(self.shared().metrics.callout_ms, ms);
        }
        match logic::interpret(status, body) {
            Verdict::Route { destination, pod, prefill: None } => {
                log::debug!("kvgate: request {} → {pod} ({destination})", self.request_id);
                self.route_to(&destination);
            }
            Verdict::Route { destination, pod, prefill: Some(prefill) } => {
                let shared = self.shared.clone().expect("shared state");
                log::debug!("kvgate: request {} → prefill {prefill}, decode {pod} ({destination})", self.request_id);
                match shared.config.pd_mode {
                    PdMode::Header => {
                        incr(shared.metrics.pd_header, 1);
                        let _ = hostcalls::set_map_value(
                            MapType::HttpRequestHeaders,
                            &shared.config.prefiller_header,
                            Some(&prefill),
                        );
                        self.route_to(&destination);
                    }
                    PdMode::Envoy => self.send_prefill_leg(&prefill, destination),
                }
            }
            Verdict::BadRequest(message) => {
                incr(self.shared().metrics.scorer_bad_request, 1);
                self.phase = Phase::Settled;
                respond(400, "BadRequestError", &message);
            }
            Verdict::Shed(message) => {
                incr(self.shared().metrics.shed, 1);
                self.phase = Phase::Settled;
                respond_with(429, "TooManyRequests", &message, self.retry_after.as_deref());
            }
            Verdict::Unavailable(reason) => {
                if self.fail(&reason) == Action::Continue {
                    let _ = hostcalls::resume_http_request();
                }
            }
        }
    }

    /// Sets the destination and lets the request go.
    fn route_to(&mut self, destination: &str) {
        let shared = self.shared.clone().expect("shared state");
        let _ =
            hostcalls::set_map_value(MapType::HttpRequestHeaders, &shared.config.destination_header, Some(destination));
        incr(shared.metrics.routed, 1);
        self.phase = Phase::Routed;
        let _ = hostcalls::resume_http_request();
    }

    /// The prefill leg, sent by the filter to the prefill pod through the pods cluster.
    fn send_prefill_leg(&mut self, prefill: &str, decode: String) {
        let shared = self.shared.clone().expect("shared state");
        let original = buffer(BufferType::HttpRequestBody, self.body_size);
        let leg = match logic::prefill_leg_body(&original) {
            Ok(leg) => leg,
            Err(e) => return self.prefill_failed(&format!("cannot build the prefill leg: {e}"), &decode),
        };
        let headers = vec![
            (":method", "POST"),
            (":path", self.api_path.as_str()),
            (":authority", "kvgate-prefill"),
            ("content-type", "application/json"),
            (HEADER_REQUEST_ID, self.request_id.as_str()),
            (shared.config.destination_header.as_str(), prefill),
        ];
        let timeout = Duration::from_millis(shared.config.prefill_timeout_ms);
        match hostcalls::dispatch_http_call(&shared.config.pods_cluster, headers, Some(&leg), vec![], timeout) {
            Ok(_) => self.phase = Phase::Prefilling { decode },
            Err(status) => {
                self.prefill_failed(&format!("cannot call cluster {}: {status:?}", shared.config.pods_cluster), &decode)
            }
        }
    }

    /// The prefill pod answered: hand its `kv_transfer_params` to the decode pod.
    fn on_prefilled(&mut self, status: Option<u16>, answer: &[u8], decode: &str) {
        let shared = self.shared.clone().expect("shared state");
        shared.report(&self.request_id, LifecycleEvent::PrefillDone, None, None);
        if status != Some(200) {
            return self.prefill_failed(&format!("prefill pod answered {status:?}"), decode);
        }
        let original = buffer(BufferType::HttpRequestBody, self.body_size);
        let body = match logic::decode_leg_body(&original, answer) {
            Ok(body) => body,
            Err(e) => return self.prefill_failed(&e, decode),
        };
        if let Err(e) = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, original.len(), &body) {
            return self.prefill_failed(&format!("cannot rewrite the body: {e:?}"), decode);
        }
        // The client's content-length no longer holds; a stale one would truncate the body.
        let length = body.len().to_string();
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", Some(&length));
        incr(shared.metrics.pd_prefill_ok, 1);
        self.route_to(decode);
    }

    /// No usable prefill: the decode pod prefills locally; the client still gets its answer.
    fn prefill_failed(&mut self, reason: &str, decode: &str) {
        let shared = self.shared.clone().expect("shared state");
        incr(shared.metrics.pd_fallback, 1);
        log::warn!("kvgate: prefill leg of {} failed ({reason}); decoding with local prefill", self.request_id);
        if !matches!(self.phase, Phase::Prefilling { .. }) {
            shared.report(&self.request_id, LifecycleEvent::PrefillDone, None, None);
        }
        self.route_to(decode);
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let shared = self.shared.clone().expect("shared state");
        // Nobody but the scorer names the destination: drop any client-supplied value.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &shared.config.destination_header, None);
        let method = header(MapType::HttpRequestHeaders, ":method").unwrap_or_default();
        let path = header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        if method != "POST" || !shared.config.intercepts(&path) {
            return Action::Continue;
        }
        self.api_path = path.split('?').next().unwrap_or_default().to_string();
        self.request_id = match header(MapType::HttpRequestHeaders, HEADER_REQUEST_ID) {
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
            self.phase = Phase::Settled;
            respond(400, "BadRequestError", "request body is required");
            return Action::Pause;
        }
        self.phase = Phase::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.phase {
            Phase::Buffering if !end_of_stream => return Action::Pause,
            Phase::Buffering => {}
            Phase::Passthrough | Phase::Routed | Phase::Settled => return Action::Continue,
            Phase::Deciding | Phase::Prefilling { .. } => return Action::Pause,
        }
        self.body_size = body_size;
        let body = buffer(BufferType::HttpRequestBody, body_size);
        if let Err(message) = kvgate_route_api::validate_json_object(&body) {
            incr(self.shared().metrics.bad_request, 1);
            self.phase = Phase::Settled;
            respond(400, "BadRequestError", &message);
            return Action::Pause;
        }
        self.ask_scorer(&body)
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        self.response_status = header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse::<u16>().ok());
        if self.phase == Phase::Routed {
            // The pod that answered: Envoy may have retried one of the pick's fallbacks.
            self.served = hostcalls::get_property(vec!["upstream", "address"])
                .ok()
                .flatten()
                .and_then(|a| String::from_utf8(a).ok());
        }
        if end_of_stream {
            self.response_complete = true;
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.phase == Phase::Routed {
            if !self.first_token && body_size > 0 {
                self.first_token = true;
                let served = self.served.take();
                self.shared().report(&self.request_id, LifecycleEvent::FirstToken, None, served);
            }
            if let Some(n) = kvgate_route_api::completion_tokens(&buffer(BufferType::HttpResponseBody, body_size)) {
                self.output_tokens = Some(n);
            }
        }
        if end_of_stream {
            self.response_complete = true;
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // A decided request (or one whose decision may have been made before the client
        // left) releases its booking in the scorer.
        if let Phase::Prefilling { .. } = self.phase {
            self.shared().report(&self.request_id, LifecycleEvent::PrefillDone, None, None);
        }
        if !matches!(self.phase, Phase::Routed | Phase::Deciding | Phase::Prefilling { .. }) {
            return;
        }
        let ok = self.response_complete && self.response_status.is_some_and(|s| (200..300).contains(&s));
        let event = if ok { LifecycleEvent::Done } else { LifecycleEvent::Cancelled };
        self.shared().report(&self.request_id, event, self.output_tokens, None);
    }
}
