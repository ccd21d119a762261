//! kvgate's Envoy filter as a native dynamic module (`libkvgate_filter_native.so`, Envoy's
//! `envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter`): what the wasm
//! filter does, without a wasm VM and without Envoy's own HTTP/2 stream to the scorer. The
//! hooks ([`hooks`]) run on Envoy's workers: they read headers, collect the body, write the
//! route call on their worker's route socket and act on the answer; the module's own thread
//! reads the answers and wakes each request ([`link`]). Envoy's ABI is wrapped in [`abi`].

mod abi;
mod hooks;
mod link;

use abi::{Body, Counter, Filter, HeaderMap, LogLevel, body_status, headers_status};
use kvgate_filter::config::{FailureMode, FilterConfig, PdMode};
use kvgate_filter::logic::{self, Verdict};
use kvgate_route_api::{HEADER_OBJECTIVE, HEADER_REQUEST_ID, LifecycleEvent, LifecycleReport, RouteCall};
use link::{Link, Outcome, Slot};
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) fn warn(message: &str) {
    abi::log(LogLevel::Warn, message);
}

/// One filter configuration: its settings, its link to the scorer, its counters.
struct Config {
    config: FilterConfig,
    link: Link,
    calls: AtomicU64,
    counters: Counters,
}

/// Envoy stats of the filter (`kvgate.<name>`: the bootstrap's metrics namespace).
struct Counters {
    /// Requests sent to the pod the scorer chose.
    routed: Counter,
    fail_open: Counter,
    fail_closed: Counter,
    /// Refused by the filter (no body, not a JSON object).
    bad_request: Counter,
    /// Refused by the scorer (400).
    scorer_bad_request: Counter,
    /// Refused for overload (429).
    shed: Counter,
    /// Disaggregated, the prefill pod named in a header (`pd_mode: header`).
    pd_header: Counter,
    /// Disaggregated in `pd_mode: envoy`, which this module does not serve (it sends no
    /// prefill leg): the decode pod prefilled locally.
    pd_local_prefill: Counter,
}

impl Counters {
    /// # Safety
    /// As [`abi::define_counter`].
    unsafe fn define(config: *mut c_void) -> Option<Counters> {
        // SAFETY: the caller's contract.
        let counter = |name| unsafe { abi::define_counter(config, name) };
        Some(Counters {
            routed: counter("routed")?,
            fail_open: counter("fail_open")?,
            fail_closed: counter("fail_closed")?,
            bad_request: counter("bad_request")?,
            scorer_bad_request: counter("scorer_bad_request")?,
            shed: counter("shed")?,
            pd_header: counter("pd_header")?,
            pd_local_prefill: counter("pd_local_prefill")?,
        })
    }
}

/// Where a request is (as the wasm filter's phases, without its prefill leg).
#[derive(PartialEq)]
enum Phase {
    /// Not for the scorer (other path or method): passes untouched.
    Passthrough,
    /// Buffering the body.
    Buffering,
    /// Waiting for the scorer's answer.
    Deciding,
    /// Sent to the pod the scorer chose.
    Routed,
    /// Answered by the filter itself, or sent on without a decision (fail-open).
    Settled,
}

/// One request.
struct Request {
    config: Arc<Config>,
    phase: Phase,
    request_id: String,
    api_path: String,
    slot: Option<Arc<Slot>>,
    response_status: Option<u16>,
    /// The pod that answered (Envoy may have retried one of the pick's fallbacks).
    served: Option<String>,
    /// The Envoy worker running the request: its route socket carries the request's call
    /// and reports.
    worker: usize,
    first_token: bool,
    response_complete: bool,
    output_tokens: Option<u32>,
}

impl Request {
    fn new(config: Arc<Config>) -> Request {
        Request {
            config,
            phase: Phase::Passthrough,
            request_id: String::new(),
            api_path: String::new(),
            slot: None,
            response_status: None,
            served: None,
            worker: 0,
            first_token: false,
            response_complete: false,
            output_tokens: None,
        }
    }

    /// No answer is awaited any more: the link wakes nobody, and the scheduler is deleted
    /// here, on the worker.
    fn forget_call(&mut self) {
        if let Some(slot) = self.slot.take() {
            drop(slot.close());
        }
    }

    fn report(&self, event: LifecycleEvent, output_tokens: Option<u32>, served: Option<String>) {
        let report =
            LifecycleReport { request_id: self.request_id.clone(), event, output_tokens, served, age_us: None };
        self.config.link.report(self.worker, report);
    }

    fn on_request_headers(&mut self, filter: &Filter, end_of_stream: bool) -> u32 {
        let config = &self.config.config;
        // Nobody but the scorer names the destination: drop any client-supplied value.
        filter.set_header(HeaderMap::Request, &config.destination_header, None);
        let text = |name| filter.header(HeaderMap::Request, name).map(|v| String::from_utf8_lossy(&v).into_owned());
        let path = text(":path").unwrap_or_default();
        if text(":method").as_deref() != Some("POST") || !config.intercepts(&path) {
            return headers_status::CONTINUE;
        }
        self.worker = filter.worker();
        self.api_path = path.split('?').next().unwrap_or_default().to_string();
        self.request_id = match text(HEADER_REQUEST_ID) {
            Some(id) if !id.is_empty() => id,
            _ => {
                let n = self.config.calls.fetch_add(1, Ordering::Relaxed);
                let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
                let id = logic::request_id(nanos, 0, n);
                filter.set_header(HeaderMap::Request, HEADER_REQUEST_ID, Some(&id));
                id
            }
        };
        if end_of_stream {
            self.phase = Phase::Settled;
            filter.increment(self.config.counters.bad_request);
            respond(filter, 400, "BadRequestError", "request body is required", None);
            return headers_status::STOP_ITERATION;
        }
        self.phase = Phase::Buffering;
        headers_status::STOP_ITERATION
    }

    fn on_request_body(&mut self, filter: &Filter, end_of_stream: bool) -> u32 {
        match self.phase {
            Phase::Buffering if !end_of_stream => return body_status::STOP_ITERATION_AND_BUFFER,
            Phase::Buffering => {}
            Phase::Deciding => return body_status::STOP_ITERATION_AND_BUFFER,
            Phase::Passthrough | Phase::Routed | Phase::Settled => return body_status::CONTINUE,
        }
        let mut body = Vec::new();
        filter.read_body(Body::BufferedRequest, &mut body);
        filter.read_body(Body::ReceivedRequest, &mut body);
        if !kvgate_route_api::starts_as_object(&body) {
            self.phase = Phase::Settled;
            filter.increment(self.config.counters.bad_request);
            respond(filter, 400, "BadRequestError", kvgate_route_api::NOT_AN_OBJECT, None);
            return body_status::STOP_ITERATION_AND_BUFFER;
        }
        let objective =
            filter.header(HeaderMap::Request, HEADER_OBJECTIVE).map(|v| String::from_utf8_lossy(&v).into_owned());
        let call = RouteCall {
            call: self.config.calls.fetch_add(1, Ordering::Relaxed),
            request_id: self.request_id.clone(),
            api_path: std::mem::take(&mut self.api_path),
            objective,
            body,
            reports: Vec::new(),
        };
        let slot = Slot::new(filter.scheduler());
        self.slot = Some(slot.clone());
        self.phase = Phase::Deciding;
        self.config.link.call(self.worker, call, slot);
        body_status::STOP_ITERATION_AND_BUFFER
    }

    /// Woken by the link: the scorer's answer (or why there is none) is in the slot.
    fn on_scheduled(&mut self, filter: &Filter) {
        let Some(outcome) = self.slot.as_ref().and_then(|slot| slot.take()) else { return };
        if self.phase != Phase::Deciding {
            return;
        }
        let (verdict, retry_after) = match outcome {
            Outcome::Answer(answer) => {
                let retry_after = match &answer.outcome {
                    Some(kvgate_route_api::Outcome::Refusal(refusal)) => refusal.retry_after,
                    _ => None,
                };
                (logic::interpret(&answer), retry_after)
            }
            Outcome::Unavailable(reason) => (Verdict::Unavailable(reason), None),
        };
        let (config, counters) = (&self.config.config, &self.config.counters);
        match verdict {
            Verdict::Route { destination, prefill, .. } => {
                if let Some(prefill) = prefill {
                    if config.pd_mode == PdMode::Header {
                        filter.increment(counters.pd_header);
                        filter.set_header(HeaderMap::Request, &config.prefiller_header, Some(&prefill));
                    } else {
                        // No prefill leg from this module (`kvgate-envoy-config` refuses the
                        // combination when the pool has prefill pods): the decode pod prefills.
                        filter.increment(counters.pd_local_prefill);
                        self.report(LifecycleEvent::PrefillDone, None, None);
                    }
                }
                filter.set_header(HeaderMap::Request, &config.destination_header, Some(&destination));
                filter.increment(counters.routed);
                self.phase = Phase::Routed;
                filter.continue_decoding();
            }
            Verdict::BadRequest(message) => {
                self.phase = Phase::Settled;
                filter.increment(counters.scorer_bad_request);
                respond(filter, 400, "BadRequestError", &message, None);
            }
            Verdict::Shed(message) => {
                self.phase = Phase::Settled;
                filter.increment(counters.shed);
                let retry_after = retry_after.map(|s| s.to_string());
                respond(filter, 429, "TooManyRequests", &message, retry_after.as_deref());
            }
            Verdict::Unavailable(reason) => {
                self.phase = Phase::Settled;
                match config.failure_mode {
                    FailureMode::Open => {
                        filter.increment(counters.fail_open);
                        warn(&format!(
                            "kvgate: scorer unavailable ({reason}); request {} left to Envoy's balancing",
                            self.request_id
                        ));
                        filter.continue_decoding();
                    }
                    FailureMode::Closed => {
                        filter.increment(counters.fail_closed);
                        warn(&format!("kvgate: scorer unavailable ({reason}); request {} refused", self.request_id));
                        respond(filter, 503, "ServiceUnavailable", "the routing service is unavailable", None);
                    }
                }
            }
        }
    }

    fn on_response_headers(&mut self, filter: &Filter, end_of_stream: bool) {
        self.response_status = filter
            .header(HeaderMap::Response, ":status")
            .and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse().ok()));
        if self.phase == Phase::Routed {
            // Set by the pods cluster's override_host policy (the bootstrap's selected_host_key).
            self.served = filter.dynamic_metadata("envoy.lb", "x-gateway-destination-endpoint-served");
        }
        self.response_complete |= end_of_stream;
    }

    fn on_response_body(&mut self, filter: &Filter, end_of_stream: bool) {
        if self.phase == Phase::Routed {
            let mut chunk = Vec::new();
            filter.read_body(Body::ReceivedResponse, &mut chunk);
            if !self.first_token && !chunk.is_empty() {
                self.first_token = true;
                let served = self.served.take();
                self.report(LifecycleEvent::FirstToken, None, served);
            }
            if let Some(n) = kvgate_route_api::completion_tokens(&chunk) {
                self.output_tokens = Some(n);
            }
        }
        self.response_complete |= end_of_stream;
    }

    fn on_stream_complete(&mut self) {
        self.forget_call();
        if matches!(self.phase, Phase::Routed | Phase::Deciding) {
            let ok = self.response_complete && self.response_status.is_some_and(|s| (200..300).contains(&s));
            let event = if ok { LifecycleEvent::Done } else { LifecycleEvent::Cancelled };
            self.report(event, self.output_tokens, None);
        }
    }
}

/// Answers the client with a JSON error.
fn respond(filter: &Filter, status: u16, kind: &str, message: &str, retry_after: Option<&str>) {
    let body = logic::error_body(status, kind, message);
    let mut headers = vec![("content-type", "application/json"), ("x-kvgate-error", kind)];
    if let Some(seconds) = retry_after {
        headers.push(("retry-after", seconds));
    }
    filter.send_response(status, &headers, &body);
}
