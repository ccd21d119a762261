//! kvgate's Envoy filter as a native dynamic module (`libkvgate_filter_native.so`, Envoy's
//! `envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter`): what the wasm
//! filter does, without a wasm VM and without Envoy's own HTTP/2 stream to the scorer. The
//! hooks ([`hooks`]) run on Envoy's workers and drive each request's [`RequestFlow`] (the
//! lifecycle every proxy shares): they read headers, collect the body, write the route call on
//! their worker's route socket and act on the answer; the module's own thread reads the
//! answers and wakes each request (`kvgate-native-link`, a crate of its own: no Envoy ABI). Envoy's ABI is wrapped in [`abi`].

mod abi;
mod hooks;

use abi::{Body, Filter, HeaderMap, LogLevel, body_status, headers_status};
use kvgate_native_link::{Level, Link, Outcome, Slot, Wake};
use kvgate_route_api::lifecycle::{self, BodyNext, Counter, Next, Proxy, ProxyConfig, RequestFlow};
use kvgate_route_api::{HEADER_OBJECTIVE, LifecycleReport};
use std::ffi::c_void;
use std::fmt::Arguments;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) fn warn(message: &str) {
    abi::log(LogLevel::Warn, message);
}

/// The link's log lines, in Envoy's log.
pub(crate) fn link_log(level: Level, message: &str) {
    let level = match level {
        Level::Info => LogLevel::Info,
        Level::Warn => LogLevel::Warn,
    };
    abi::log(level, message);
}

/// A request waiting on its call is woken on its worker by Envoy's scheduler of its filter.
impl Wake for abi::Scheduler {
    fn wake(&self) {
        self.commit(0);
    }
}

/// One filter configuration: its settings, its link to the scorer, its counters.
struct Config {
    proxy: ProxyConfig,
    link: Link<abi::Scheduler>,
    calls: AtomicU64,
    counters: Counters,
}

/// Envoy stats of the filter (`kvgate.<name>`: the bootstrap's metrics namespace): the
/// request flow's counters, by [`Counter`] number.
struct Counters(Vec<abi::Counter>);

impl Counters {
    /// # Safety
    /// As [`abi::define_counter`].
    unsafe fn define(config: *mut c_void) -> Option<Counters> {
        // SAFETY: the caller's contract.
        Counter::all()
            .map(|counter| unsafe { abi::define_counter(config, counter.name()) })
            .collect::<Option<_>>()
            .map(Counters)
    }
}

/// One request.
struct Request {
    config: Arc<Config>,
    flow: RequestFlow,
    slot: Option<Arc<Slot<abi::Scheduler>>>,
    /// The Envoy worker running the request: its route socket carries the request's call
    /// and reports.
    worker: usize,
}

/// What the flow asks of the host, through Envoy's handle of the request's filter.
struct Host<'a> {
    filter: &'a Filter,
    config: &'a Config,
    worker: usize,
}

impl Proxy for Host<'_> {
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        self.filter.set_header(HeaderMap::Request, name, value);
    }

    fn send_response(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        self.filter.send_response(status, headers, body);
    }

    fn count(&mut self, counter: Counter) {
        self.filter.increment(self.config.counters.0[counter as usize]);
    }

    fn report(&mut self, report: LifecycleReport) {
        self.config.link.report(self.worker, report);
    }

    fn warn(&mut self, message: Arguments<'_>) {
        warn(&message.to_string());
    }

    fn debug(&mut self, _: Arguments<'_>) {}

    fn request_body(&mut self) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        self.filter.read_body(Body::BufferedRequest, &mut body);
        Ok(body)
    }

    fn replace_request_body(&mut self, body: &[u8]) -> Result<(), String> {
        self.filter.replace_buffered_request_body(body)
    }
}

impl Request {
    fn new(config: Arc<Config>) -> Request {
        Request { config, flow: RequestFlow::default(), slot: None, worker: 0 }
    }

    /// The request's flow, its host for a hook, and the configuration.
    fn parts<'a>(&'a mut self, filter: &'a Filter) -> (&'a mut RequestFlow, Host<'a>, &'a Config) {
        let host = Host { filter, config: &self.config, worker: self.worker };
        (&mut self.flow, host, &self.config)
    }

    /// No answer is awaited any more: the link wakes nobody, and the scheduler is deleted
    /// here, on the worker.
    fn forget_call(&mut self) {
        if let Some(slot) = self.slot.take() {
            drop(slot.close());
        }
    }

    fn on_request_headers(&mut self, filter: &Filter, end_of_stream: bool) -> u32 {
        let text =
            |name: &str| filter.header(HeaderMap::Request, name).map(|v| String::from_utf8_lossy(&v).into_owned());
        let (method, path) = (text(":method"), text(":path").unwrap_or_default());
        let (flow, mut host, config) = self.parts(filter);
        let new_id = || {
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
            lifecycle::request_id(nanos, 0, config.calls.fetch_add(1, Ordering::Relaxed))
        };
        let next =
            flow.request_headers(&config.proxy, &mut host, method.as_deref(), &path, end_of_stream, text, new_id);
        match next {
            Next::Go => headers_status::CONTINUE,
            Next::Hold => headers_status::STOP_ITERATION,
        }
    }

    fn on_request_body(&mut self, filter: &Filter, end_of_stream: bool) -> u32 {
        let body = || {
            let mut body = Vec::new();
            filter.read_body(Body::BufferedRequest, &mut body);
            filter.read_body(Body::ReceivedRequest, &mut body);
            body
        };
        let objective =
            || filter.header(HeaderMap::Request, HEADER_OBJECTIVE).map(|v| String::from_utf8_lossy(&v).into_owned());
        let (flow, mut host, _) = self.parts(filter);
        match flow.request_body(&mut host, end_of_stream, body, objective) {
            BodyNext::Go => body_status::CONTINUE,
            BodyNext::Wait => body_status::STOP_ITERATION_AND_BUFFER,
            BodyNext::Call(mut call) => {
                call.call = self.config.calls.fetch_add(1, Ordering::Relaxed);
                self.worker = filter.worker();
                let slot = Slot::new(filter.scheduler());
                self.slot = Some(slot.clone());
                self.config.link.call(self.worker, call, slot);
                body_status::STOP_ITERATION_AND_BUFFER
            }
        }
    }

    /// Woken by the link: the scorer's answer (or why there is none) is in the slot.
    fn on_scheduled(&mut self, filter: &Filter) {
        let Some(outcome) = self.slot.as_ref().and_then(|slot| slot.take()) else { return };
        let (flow, mut host, config) = self.parts(filter);
        let answer = match &outcome {
            Outcome::Answer(answer) => Ok(answer),
            Outcome::Unavailable(reason) => Err(reason.as_str()),
        };
        // No prefill legs from this host: the answer routes, refuses or fails.
        if flow.answer(&config.proxy, &mut host, answer) == lifecycle::AnswerNext::Go {
            filter.continue_decoding();
        }
    }

    fn on_response_headers(&mut self, filter: &Filter, end_of_stream: bool) {
        let status = filter.header(HeaderMap::Response, ":status");
        let status = status.and_then(|s| std::str::from_utf8(&s).ok().and_then(|s| s.parse().ok()));
        // Set by the pods cluster's override_host policy (the bootstrap's selected_host_key).
        let served = || filter.dynamic_metadata("envoy.lb", "x-gateway-destination-endpoint-served");
        self.flow.response_headers(status, end_of_stream, served);
    }

    fn on_response_body(&mut self, filter: &Filter, end_of_stream: bool) {
        let chunk = || {
            let mut chunk = Vec::new();
            filter.read_body(Body::ReceivedResponse, &mut chunk);
            chunk
        };
        let (flow, mut host, _) = self.parts(filter);
        flow.response_body(&mut host, end_of_stream, chunk);
    }

    fn on_stream_complete(&mut self, filter: &Filter) {
        self.forget_call();
        let (flow, mut host, _) = self.parts(filter);
        flow.complete(&mut host);
    }
}
