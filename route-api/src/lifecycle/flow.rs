//! One request through a proxy: what to do at each of the host's hooks.

use super::config::{FailureMode, PdMode, ProxyConfig};
use super::response::ResponseWatch;
use crate::trace::{HEADER_GATEWAY_SPAN, gateway_traceparent};
use crate::{
    Api, ErrorBody, HEADER_REQUEST_ID, LifecycleEvent, LifecycleReport, NOT_AN_OBJECT, Outcome, Refused, RouteAnswer,
    RouteCall, starts_as_object,
};
use serde_json::{Map, Value, json};
use std::fmt::Arguments;
use std::net::SocketAddr;

/// What a proxy host does for a request, with its own calls into Envoy.
pub trait Proxy {
    /// Sets a request header, or removes it (`None`).
    fn set_request_header(&mut self, name: &str, value: Option<&str>);
    /// Answers the client directly.
    fn send_response(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]);
    fn count(&mut self, counter: Counter);
    /// Queues a lifecycle report for the scorer.
    fn report(&mut self, report: LifecycleReport);
    fn warn(&mut self, message: Arguments<'_>);
    /// A line for debugging (built only when the host logs at debug level).
    fn debug(&mut self, message: Arguments<'_>);
    /// Whether the host sends prefill legs itself ([`AnswerNext::PrefillLeg`]); without, a
    /// disaggregated pick in `pd_mode: envoy` is served by its decode pod prefilling locally.
    fn sends_prefill_legs(&self) -> bool {
        false
    }
    /// The request's body as buffered (to rewrite its model).
    fn request_body(&mut self) -> Result<Vec<u8>, String> {
        Err("this proxy cannot read request bodies".into())
    }
    /// Replaces the request's body (its model rewritten; the decode leg's, after a prefill leg).
    fn replace_request_body(&mut self, _body: &[u8]) -> Result<(), String> {
        Err("this proxy cannot replace request bodies".into())
    }
}

/// What a proxy counts (each host exports them as its own stats).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::EnumIter, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "schema", schemars(rename_all = "snake_case"))]
pub enum Counter {
    /// Sent to the pod the scorer chose.
    Routed,
    /// The scorer could not decide; left to Envoy's balancing.
    FailOpen,
    /// The scorer could not decide; answered 503.
    FailClosed,
    /// Refused by the proxy itself (no body, not a JSON object).
    BadRequest,
    /// Refused by the scorer: unreadable, too large, or naming a model no pod serves.
    ScorerBadRequest,
    /// Refused for overload (429).
    Shed,
    /// Disaggregated, the prefill pod named in a header (`pd_mode: header`).
    PdHeader,
    /// Disaggregated in `pd_mode: envoy` by a host that sends no prefill legs: the decode pod
    /// prefilled locally.
    PdLocalPrefill,
    /// A prefill leg answered and its KV handed to the decode pod.
    PdPrefillOk,
    /// A prefill leg failed: the decode pod prefilled locally.
    PdFallback,
}

impl Counter {
    /// Every counter, in declaration order (its index in a host's table).
    pub fn all() -> impl Iterator<Item = Counter> {
        <Counter as strum::IntoEnumIterator>::iter()
    }

    /// Its name in a host's stats (after the host's prefix).
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// What the host does once a hook has been handled.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// The request goes on (from its own hook: continue; from elsewhere: resume it).
    Go,
    /// It stays where it is (paused, or answered by the proxy).
    Hold,
}

/// What the host does after the request body's hook.
#[derive(Debug, PartialEq)]
pub enum BodyNext {
    Go,
    /// Keep buffering, or stay paused.
    Wait,
    /// Send this route call (numbered by the host) and stay paused until its answer or its
    /// failure ([`RequestFlow::answer`]).
    Call(RouteCall),
}

/// What the host does after the scorer's answer.
#[derive(Debug, PartialEq)]
pub enum AnswerNext {
    Go,
    Hold,
    /// Send the prefill leg ([`prefill_leg_body`] of the request's body, to `prefill`
    /// through the pods' cluster) and report its outcome ([`RequestFlow::prefilled`]).
    PrefillLeg {
        prefill: String,
    },
}

#[derive(Debug, Default, PartialEq)]
enum Phase {
    /// Not for the scorer (other path or method): passes untouched.
    #[default]
    Passthrough,
    /// Buffering the body.
    Buffering,
    /// Waiting for the scorer's answer.
    Deciding,
    /// Waiting for the prefill leg of a disaggregated request; then on to `decode`.
    Prefilling { decode: String },
    /// Sent to the pod the scorer chose.
    Routed,
    /// Answered by the proxy itself, sent on without a decision (fail-open), or over.
    Settled,
}

/// One request's state through a proxy.
#[derive(Debug, Default)]
pub struct RequestFlow {
    phase: Phase,
    request_id: String,
    api_path: String,
    /// The pod that answered (Envoy may have retried one of the pick's fallbacks).
    served: Option<String>,
    response: ResponseWatch,
    /// The gateway's span, for the route call (with `traces`).
    trace_parent: Option<String>,
}

/// A request id for a request that came without one: time, the host's worker or context,
/// and a counter of its own.
pub fn request_id(now_nanos: u128, context: u32, counter: u64) -> String {
    format!("kvgate-{:x}-{context:x}-{counter:x}", now_nanos & 0xffff_ffff_ffff)
}

impl RequestFlow {
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The client's API path (query string removed).
    pub fn api_path(&self) -> &str {
        &self.api_path
    }

    /// The request's headers: its method and path; `header` reads one (asked of routed
    /// requests only: `x-request-id`, and the gateway's span when tracing), and `new_id`
    /// makes a request id, set on the request, when it has none. A client-supplied
    /// destination is removed from every request: nobody but the scorer names it.
    #[allow(clippy::too_many_arguments)] // what a headers hook knows, passed as it is read
    pub fn request_headers(
        &mut self,
        config: &ProxyConfig,
        proxy: &mut impl Proxy,
        method: Option<&str>,
        path: &str,
        end_of_stream: bool,
        header: impl Fn(&str) -> Option<String>,
        new_id: impl FnOnce() -> String,
    ) -> Next {
        proxy.set_request_header(&config.destination_header, None);
        if method != Some("POST") || !config.intercepts(path) {
            return Next::Go;
        }
        self.api_path = path.split('?').next().unwrap_or_default().to_string();
        self.request_id = match header(HEADER_REQUEST_ID) {
            Some(id) if !id.is_empty() => id,
            _ => {
                let id = new_id();
                proxy.set_request_header(HEADER_REQUEST_ID, Some(&id));
                id
            }
        };
        if config.traces
            && let Some(span) = header(HEADER_GATEWAY_SPAN)
        {
            proxy.set_request_header(HEADER_GATEWAY_SPAN, None);
            self.trace_parent = gateway_traceparent(&span, &self.request_id, header("traceparent").as_deref());
        }
        if end_of_stream {
            return self.refuse(proxy, Counter::BadRequest, Refused::BadRequest, "request body is required", None);
        }
        self.phase = Phase::Buffering;
        Next::Hold
    }

    /// A request body chunk arrived; `body` reads the whole body buffered so far, and
    /// `objective` the request's objective header, when the last chunk is in.
    pub fn request_body(
        &mut self,
        proxy: &mut impl Proxy,
        end_of_stream: bool,
        body: impl FnOnce() -> Vec<u8>,
        objective: impl FnOnce() -> Option<String>,
    ) -> BodyNext {
        match self.phase {
            Phase::Buffering if end_of_stream => {}
            Phase::Buffering | Phase::Deciding | Phase::Prefilling { .. } => return BodyNext::Wait,
            Phase::Passthrough | Phase::Routed | Phase::Settled => return BodyNext::Go,
        }
        let body = body();
        // What is plainly not a JSON object is refused here; the scorer parses the rest (one
        // parse per request) and refuses what it cannot read.
        if !starts_as_object(&body) {
            self.refuse(proxy, Counter::BadRequest, Refused::BadRequest, NOT_AN_OBJECT, None);
            return BodyNext::Wait;
        }
        self.phase = Phase::Deciding;
        BodyNext::Call(RouteCall {
            request_id: self.request_id.clone(),
            api_path: self.api_path.clone(),
            objective: objective(),
            body,
            trace_parent: self.trace_parent.take(),
            rewrites_model: true,
            ..RouteCall::default()
        })
    }

    /// The scorer's answer to the request's call, or why there is none (unreachable, timed
    /// out, the stream or socket broke): route, refuse, or let the failure mode decide.
    pub fn answer(
        &mut self,
        config: &ProxyConfig,
        proxy: &mut impl Proxy,
        answer: Result<&RouteAnswer, &str>,
    ) -> AnswerNext {
        if self.phase != Phase::Deciding {
            return AnswerNext::Hold;
        }
        let answered = match answer.map(|a| &a.outcome) {
            Err(reason) => Err(reason.to_string()),
            Ok(None) => Err("the scorer's answer says nothing".to_string()),
            Ok(Some(Outcome::Refusal(refusal))) => {
                let (message, retry_after) = (refusal.message.as_str(), refusal.retry_after);
                return match refusal.refused() {
                    r @ (Refused::BadRequest | Refused::TooLarge | Refused::ModelNotFound) => {
                        self.refuse(proxy, Counter::ScorerBadRequest, r, message, None).into()
                    }
                    Refused::Overloaded => {
                        self.refuse(proxy, Counter::Shed, Refused::Overloaded, message, retry_after).into()
                    }
                    other => {
                        self.unavailable(config, proxy, &format!("the scorer refused ({other:?}): {message}")).into()
                    }
                };
            }
            Ok(Some(Outcome::Pick(pick))) => {
                let addresses = std::iter::once(&pick.decode).chain(&pick.fallbacks).chain(&pick.prefill);
                match addresses.into_iter().find(|a| a.parse::<SocketAddr>().is_err()) {
                    Some(bad) => Err(format!("the scorer named {bad:?}, which is not ip:port")),
                    None => Ok(pick),
                }
            }
        };
        let pick = match answered {
            Ok(pick) => pick,
            Err(reason) => return self.unavailable(config, proxy, &reason).into(),
        };
        if let Some(rewrite) = &pick.model_rewrite {
            let rewritten = proxy.request_body().and_then(|body| rewrite.apply(&body));
            if let Err(reason) = rewritten.and_then(|body| replace_body(proxy, &body)) {
                let id = &self.request_id;
                proxy.warn(format_args!("kvgate: request {id} cannot be sent as model {:?}: {reason}", rewrite.model));
                // Booked, but never sent: its booking is released now.
                self.report(proxy, LifecycleEvent::Cancelled, None);
                let message = "the gateway could not rewrite the request's model";
                return self.refuse(proxy, Counter::FailClosed, Refused::Unknown, message, None).into();
            }
        }
        let destination = pick.destinations();
        let Some(prefill) = &pick.prefill else {
            proxy.debug(format_args!("kvgate: request {} → {} ({destination})", self.request_id, pick.pod));
            return self.route(config, proxy, &destination).into();
        };
        proxy.debug(format_args!(
            "kvgate: request {} → prefill {prefill}, decode {} ({destination})",
            self.request_id, pick.pod
        ));
        match config.pd_mode {
            PdMode::Header => {
                proxy.count(Counter::PdHeader);
                proxy.set_request_header(&config.prefiller_header, Some(prefill));
            }
            PdMode::Envoy if proxy.sends_prefill_legs() => {
                self.phase = Phase::Prefilling { decode: destination };
                return AnswerNext::PrefillLeg { prefill: prefill.clone() };
            }
            PdMode::Envoy => {
                proxy.count(Counter::PdLocalPrefill);
                self.report(proxy, LifecycleEvent::PrefillDone, None);
            }
        }
        self.route(config, proxy, &destination).into()
    }

    /// The prefill leg's outcome: the prefill pod's status and answer, or why there is none.
    /// The decode pod gets the request with the leg's `kv_transfer_params` (`original`: the
    /// request's body), or, when the leg failed, prefills locally: the client is served either
    /// way.
    pub fn prefilled(
        &mut self,
        config: &ProxyConfig,
        proxy: &mut impl Proxy,
        leg: Result<(Option<u16>, &[u8]), String>,
        original: &[u8],
    ) -> Next {
        let Phase::Prefilling { decode } = &mut self.phase else { return Next::Hold };
        let decode = std::mem::take(decode);
        self.report(proxy, LifecycleEvent::PrefillDone, None);
        let body = match leg {
            Ok((Some(200), answer)) => decode_leg_body(original, answer),
            Ok((status, _)) => Err(format!("prefill pod answered {status:?}")),
            Err(why) => Err(why),
        };
        match body.and_then(|body| replace_body(proxy, &body)) {
            Ok(()) => proxy.count(Counter::PdPrefillOk),
            Err(reason) => {
                proxy.count(Counter::PdFallback);
                let id = &self.request_id;
                proxy.warn(format_args!("kvgate: prefill leg of {id} failed ({reason}); decoding with local prefill"));
            }
        }
        self.route(config, proxy, &decode)
    }

    /// The response's headers; `served` reads the pod that answered (asked of routed
    /// requests only).
    pub fn response_headers(
        &mut self,
        status: Option<u16>,
        end_of_stream: bool,
        served: impl FnOnce() -> Option<String>,
    ) {
        self.response.headers(status, end_of_stream);
        if self.phase == Phase::Routed {
            self.served = served();
        }
    }

    /// A response body chunk (`chunk` reads it; asked of routed requests only): the first one
    /// with bytes is the first token, reported with the pod that served.
    pub fn response_body(&mut self, proxy: &mut impl Proxy, end_of_stream: bool, chunk: impl FnOnce() -> Vec<u8>) {
        if self.phase != Phase::Routed {
            self.response.body(&[], end_of_stream);
            return;
        }
        if self.response.body(&chunk(), end_of_stream) {
            let served = self.served.take();
            self.report(proxy, LifecycleEvent::FirstToken, served);
        }
    }

    /// The request is over (its stream completed or was reset): a decided request (or one
    /// whose decision may have been made before the client left) reports its end, which
    /// releases its booking.
    pub fn complete(&mut self, proxy: &mut impl Proxy) {
        let phase = std::mem::replace(&mut self.phase, Phase::Settled);
        if matches!(phase, Phase::Prefilling { .. }) {
            self.report(proxy, LifecycleEvent::PrefillDone, None);
        }
        if matches!(phase, Phase::Routed | Phase::Deciding | Phase::Prefilling { .. })
            && let Some(end) = self.response.finish()
        {
            // An error answer brought no first token: where it came from comes with its end.
            let served = if end.event == LifecycleEvent::ErrorStatus { self.served.take() } else { None };
            proxy.report(LifecycleReport { served, ..LifecycleReport::ended(self.request_id.clone(), &end) });
        }
    }

    fn report(&self, proxy: &mut impl Proxy, event: LifecycleEvent, served: Option<String>) {
        proxy.report(LifecycleReport { served, ..LifecycleReport::new(self.request_id.clone(), event) });
    }

    fn route(&mut self, config: &ProxyConfig, proxy: &mut impl Proxy, destination: &str) -> Next {
        proxy.set_request_header(&config.destination_header, Some(destination));
        proxy.count(Counter::Routed);
        self.phase = Phase::Routed;
        Next::Go
    }

    /// Answers the client with the refusal's status and a JSON error.
    fn refuse(
        &mut self,
        proxy: &mut impl Proxy,
        counter: Counter,
        refused: Refused,
        message: &str,
        retry_after: Option<u64>,
    ) -> Next {
        self.phase = Phase::Settled;
        proxy.count(counter);
        respond(proxy, &self.api_path, refused.status(), refused.error_type(), message, retry_after);
        Next::Hold
    }

    /// The scorer could not decide: the failure mode applies.
    fn unavailable(&mut self, config: &ProxyConfig, proxy: &mut impl Proxy, reason: &str) -> Next {
        self.phase = Phase::Settled;
        let id = &self.request_id;
        match config.failure_mode {
            FailureMode::Open => {
                proxy.count(Counter::FailOpen);
                proxy.warn(format_args!(
                    "kvgate: scorer unavailable ({reason}); request {id} left to Envoy's balancing"
                ));
                Next::Go
            }
            FailureMode::Closed => {
                proxy.count(Counter::FailClosed);
                proxy.warn(format_args!("kvgate: scorer unavailable ({reason}); request {id} refused"));
                respond(proxy, &self.api_path, 503, "ServiceUnavailable", "the routing service is unavailable", None);
                Next::Hold
            }
        }
    }
}

impl From<Next> for AnswerNext {
    fn from(next: Next) -> Self {
        match next {
            Next::Go => AnswerNext::Go,
            Next::Hold => AnswerNext::Hold,
        }
    }
}

/// Sends `body` on in place of the client's, with its length.
fn replace_body(proxy: &mut impl Proxy, body: &[u8]) -> Result<(), String> {
    proxy.replace_request_body(body)?;
    // The client's content-length no longer holds; a stale one would truncate it.
    proxy.set_request_header("content-length", Some(&body.len().to_string()));
    Ok(())
}

/// A JSON error answer in the shape of the request's API, with `Retry-After` when given.
fn respond(proxy: &mut impl Proxy, api_path: &str, status: u16, kind: &str, message: &str, retry_after: Option<u64>) {
    let body = ErrorBody::new(status, kind, message).to_json_for(Api::from_path(api_path));
    let seconds = retry_after.map(|s| s.to_string());
    let mut headers = vec![("content-type", "application/json"), ("x-kvgate-error", kind)];
    if let Some(seconds) = &seconds {
        headers.push(("retry-after", seconds));
    }
    proxy.send_response(status, &headers, &body);
}

/// The prefill leg of a disaggregated request (vLLM's NIXL flow): the client's request with
/// `stream: false`, one output token, no `stream_options`/`min_tokens`, and
/// `kv_transfer_params` asking the prefill pod to keep the KV for a remote decode.
pub fn prefill_leg_body(original: &[u8]) -> Result<Vec<u8>, String> {
    let mut body: Map<String, Value> = serde_json::from_slice(original).map_err(|e| e.to_string())?;
    body.insert("stream".into(), Value::Bool(false));
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    body.remove("stream_options");
    body.remove("min_tokens");
    body.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    serde_json::to_vec(&body).map_err(|e| e.to_string())
}

/// The decode leg: the client's request with the prefill pod's `kv_transfer_params` copied
/// in unchanged. Fails when the prefill answer carries none.
pub fn decode_leg_body(original: &[u8], prefill_answer: &[u8]) -> Result<Vec<u8>, String> {
    let answer: Value = serde_json::from_slice(prefill_answer).map_err(|e| format!("prefill answer: {e}"))?;
    let params = match answer.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => return Err("the prefill answer has no kv_transfer_params".into()),
    };
    let mut body: Map<String, Value> = serde_json::from_slice(original).map_err(|e| e.to_string())?;
    body.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&body).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Refusal, RoutePick};

    /// A response sent: status, headers, body.
    type Sent = (u16, Vec<(String, String)>, String);

    /// A proxy that writes down what it was asked to do.
    #[derive(Default)]
    struct Recorder {
        headers: Vec<(String, Option<String>)>,
        responses: Vec<Sent>,
        counts: Vec<Counter>,
        reports: Vec<LifecycleReport>,
        warnings: Vec<String>,
        legs: bool,
        body: Option<Vec<u8>>,
    }

    impl Proxy for Recorder {
        fn set_request_header(&mut self, name: &str, value: Option<&str>) {
            self.headers.push((name.into(), value.map(str::to_string)));
        }
        fn send_response(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
            let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            self.responses.push((status, headers, String::from_utf8_lossy(body).into_owned()));
        }
        fn count(&mut self, counter: Counter) {
            self.counts.push(counter);
        }
        fn report(&mut self, report: LifecycleReport) {
            self.reports.push(report);
        }
        fn warn(&mut self, message: Arguments<'_>) {
            self.warnings.push(message.to_string());
        }
        fn debug(&mut self, _: Arguments<'_>) {}
        fn sends_prefill_legs(&self) -> bool {
            self.legs
        }
        fn request_body(&mut self) -> Result<Vec<u8>, String> {
            self.body.clone().ok_or_else(|| "no body".to_string())
        }
        fn replace_request_body(&mut self, body: &[u8]) -> Result<(), String> {
            self.body = Some(body.to_vec());
            Ok(())
        }
    }

    impl Recorder {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers.iter().rev().find(|(n, _)| n == name).and_then(|(_, v)| v.as_deref())
        }
        fn events(&self) -> Vec<LifecycleEvent> {
            self.reports.iter().map(|r| r.event).collect()
        }
    }

    const DEST: &str = "x-gateway-destination-endpoint";

    /// A request through its headers and body, waiting for the scorer.
    fn deciding(config: &ProxyConfig, proxy: &mut Recorder) -> RequestFlow {
        let mut flow = RequestFlow::default();
        let next =
            flow.request_headers(config, proxy, Some("POST"), "/v1/completions?x=1", false, |_| None, || "gen".into());
        assert_eq!(next, Next::Hold);
        assert_eq!(flow.request_body(proxy, false, Vec::new, || None), BodyNext::Wait);
        let BodyNext::Call(call) =
            flow.request_body(proxy, true, || br#"{"prompt":"p"}"#.to_vec(), || Some("gold".into()))
        else {
            panic!("a route call")
        };
        assert_eq!((call.request_id.as_str(), call.api_path.as_str()), ("gen", "/v1/completions"));
        assert_eq!(call.objective.as_deref(), Some("gold"));
        assert_eq!(flow.phase, Phase::Deciding);
        flow
    }

    fn pick(decode: &str, fallbacks: &[&str], prefill: Option<&str>) -> RouteAnswer {
        let pick = RoutePick {
            decode: decode.into(),
            fallbacks: fallbacks.iter().map(|f| f.to_string()).collect(),
            prefill: prefill.map(str::to_string),
            pod: "p1".into(),
            model_rewrite: None,
        };
        RouteAnswer { call: 1, outcome: Some(Outcome::Pick(pick)), ..Default::default() }
    }

    #[test]
    fn a_rewritten_model_is_what_the_pod_is_asked_for_or_the_request_is_refused() {
        let config = ProxyConfig::default();
        let original = br#"{"model":"llama","prompt":"p"}"#;
        let mut answer = pick("10.0.0.1:8000", &[], None);
        let Some(Outcome::Pick(p)) = &mut answer.outcome else { unreachable!() };
        p.model_rewrite = Some(crate::ModelRewrite { model: "llama-v2".into(), at: 9, len: 7 });
        let mut proxy = Recorder { body: Some(original.to_vec()), ..Recorder::default() };
        let mut flow = deciding(&config, &mut proxy);
        assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Go);
        assert_eq!(proxy.body.as_deref(), Some(&br#"{"model":"llama-v2","prompt":"p"}"#[..]));
        assert_eq!(proxy.header("content-length"), Some("33"));
        assert_eq!(proxy.header(DEST), Some("10.0.0.1:8000"));
        // A body the rewrite does not fit (or a host that cannot rewrite) is never sent on as
        // the client's: refused, and its booking released.
        let mut proxy = Recorder { body: Some(br#"{"prompt":"p"}"#.to_vec()), ..Recorder::default() };
        let mut flow = deciding(&config, &mut proxy);
        assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Hold);
        assert_eq!(proxy.responses[0].0, 503);
        assert_eq!(proxy.events(), [LifecycleEvent::Cancelled]);
        assert_eq!((proxy.header(DEST), proxy.counts.last()), (None, Some(&Counter::FailClosed)));
        flow.complete(&mut proxy);
        assert_eq!(proxy.events(), [LifecycleEvent::Cancelled], "released once");
    }

    fn refused(reason: Refused, message: &str, retry_after: Option<u64>) -> RouteAnswer {
        let refusal = Refusal { reason: reason as i32, message: message.into(), retry_after };
        RouteAnswer { call: 1, outcome: Some(Outcome::Refusal(refusal)), ..Default::default() }
    }

    #[test]
    fn requests_not_routed_pass_and_lose_the_clients_destination() {
        let config = ProxyConfig::default();
        for (method, path) in
            [(Some("GET"), "/v1/completions"), (Some("POST"), "/v1/models"), (None, "/v1/completions")]
        {
            let mut proxy = Recorder::default();
            let mut flow = RequestFlow::default();
            assert_eq!(
                flow.request_headers(&config, &mut proxy, method, path, false, |_| unreachable!(), || unreachable!()),
                Next::Go
            );
            assert_eq!(proxy.headers, [(DEST.to_string(), None)]);
            assert_eq!(flow.request_body(&mut proxy, true, || unreachable!(), || None), BodyNext::Go);
            flow.complete(&mut proxy);
            assert!(proxy.reports.is_empty());
        }
    }

    #[test]
    fn bodies_that_cannot_be_routed_are_refused_by_the_proxy() {
        let config = ProxyConfig::default();
        let mut proxy = Recorder::default();
        let mut flow = RequestFlow::default();
        let next = flow.request_headers(
            &config,
            &mut proxy,
            Some("POST"),
            "/v1/completions",
            true,
            |name| (name == "x-request-id").then(|| "r1".into()),
            || unreachable!(),
        );
        assert_eq!(next, Next::Hold);
        assert_eq!(proxy.responses[0].0, 400);
        assert!(proxy.responses[0].2.contains("request body is required"));
        assert_eq!(proxy.header("x-request-id"), None, "the client's id is kept");
        let mut flow = RequestFlow::default();
        flow.request_headers(&config, &mut proxy, Some("POST"), "/v1/completions", false, |_| None, || "gen".into());
        assert_eq!(proxy.header("x-request-id"), Some("gen"), "a made-up id is set on the request");
        assert_eq!(flow.request_body(&mut proxy, true, || b"[1]".to_vec(), || None), BodyNext::Wait);
        assert_eq!(proxy.responses[1].0, 400);
        assert!(proxy.responses[1].2.contains(NOT_AN_OBJECT));
        assert_eq!(proxy.counts, [Counter::BadRequest, Counter::BadRequest]);
        flow.complete(&mut proxy);
        assert!(proxy.reports.is_empty(), "nothing was booked");
        // On the Messages API the error is in Anthropic's shape.
        let mut flow = RequestFlow::default();
        flow.request_headers(&config, &mut proxy, Some("POST"), "/v1/messages", false, |_| None, || "m".into());
        flow.request_body(&mut proxy, true, || b"[1]".to_vec(), || None);
        let body: serde_json::Value = serde_json::from_str(&proxy.responses[2].2).unwrap();
        assert_eq!(
            (body["type"].as_str(), body["error"]["type"].as_str()),
            (Some("error"), Some("invalid_request_error"))
        );
    }

    #[test]
    fn a_pick_routes_to_the_pod_then_its_fallbacks_and_the_response_is_reported() {
        let config = ProxyConfig::default();
        let mut proxy = Recorder::default();
        let mut flow = deciding(&config, &mut proxy);
        let answer = pick("10.0.0.1:8000", &["10.0.0.2:8000", "10.0.0.3:8000"], None);
        assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Go);
        assert_eq!(proxy.header(DEST), Some("10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"));
        assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Hold, "answered once");
        flow.response_headers(Some(200), false, || Some("10.0.0.2:8000".into()));
        flow.response_body(&mut proxy, false, || b"data: {}".to_vec());
        flow.response_body(&mut proxy, true, || br#"data: {"usage":{"completion_tokens":9}}"#.to_vec());
        flow.complete(&mut proxy);
        flow.complete(&mut proxy);
        assert_eq!(proxy.events(), [LifecycleEvent::FirstToken, LifecycleEvent::Done]);
        assert_eq!(proxy.reports[0].served.as_deref(), Some("10.0.0.2:8000"), "the first token names who served");
        assert_eq!(proxy.reports[1].output_tokens, Some(9));
        assert_eq!(proxy.counts, [Counter::Routed]);
        // A client that leaves: cancelled.
        let mut proxy = Recorder::default();
        let mut flow = deciding(&config, &mut proxy);
        flow.answer(&config, &mut proxy, Ok(&pick("10.0.0.1:8000", &[], None)));
        flow.response_headers(Some(200), false, || None);
        flow.complete(&mut proxy);
        assert_eq!(proxy.events(), [LifecycleEvent::Cancelled]);
        // The pod answers an error (a fallback of the pick, here): no first token, an error
        // status with its status and who answered.
        let mut proxy = Recorder::default();
        let mut flow = deciding(&config, &mut proxy);
        flow.answer(&config, &mut proxy, Ok(&answer));
        flow.response_headers(Some(404), false, || Some("10.0.0.2:8000".into()));
        flow.response_body(&mut proxy, true, || br#"{"error":{"message":"no such model"}}"#.to_vec());
        flow.complete(&mut proxy);
        assert_eq!(proxy.events(), [LifecycleEvent::ErrorStatus]);
        assert_eq!((proxy.reports[0].status, proxy.reports[0].served.as_deref()), (Some(404), Some("10.0.0.2:8000")));
        // The client left while the scorer was deciding: the booking it may have made ends.
        let mut proxy = Recorder::default();
        let mut flow = deciding(&config, &mut proxy);
        flow.complete(&mut proxy);
        assert_eq!(proxy.events(), [LifecycleEvent::Cancelled]);
    }

    #[test]
    fn refusals_reach_the_client_and_failures_follow_the_failure_mode() {
        let config = ProxyConfig::default();
        for (answer, status, counter) in [
            (refused(Refused::BadRequest, "'prompt' is required", None), 400, Counter::ScorerBadRequest),
            (refused(Refused::ModelNotFound, "The model `m` does not exist.", None), 404, Counter::ScorerBadRequest),
            (refused(Refused::Overloaded, "every pod is saturated", Some(5)), 429, Counter::Shed),
        ] {
            let mut proxy = Recorder::default();
            let mut flow = deciding(&config, &mut proxy);
            assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Hold);
            let (got, headers, body) = &proxy.responses[0];
            assert_eq!((*got, proxy.counts[0]), (status, counter));
            let Some(Outcome::Refusal(refusal)) = &answer.outcome else { unreachable!() };
            assert!(body.contains(&refusal.message), "{body}");
            let retry = headers.iter().find(|(k, _)| k == "retry-after").map(|(_, v)| v.as_str());
            assert_eq!(retry, refusal.retry_after.map(|_| "5"));
        }
        let failures: [Result<RouteAnswer, &str>; 6] = [
            Err("no answer within 100 ms"),
            Ok(RouteAnswer::default()),
            Ok(refused(Refused::NoPod, "no pod", None)),
            Ok(refused(Refused::Unknown, "?", None)),
            Ok(pick("evil.example:80", &[], None)),
            Ok(pick("10.0.0.1:8000", &["10.0.0.2:8000"], Some("x"))),
        ];
        for failure in &failures {
            for mode in [FailureMode::Open, FailureMode::Closed] {
                let config = ProxyConfig { failure_mode: mode, ..ProxyConfig::default() };
                let mut proxy = Recorder::default();
                let mut flow = deciding(&config, &mut proxy);
                let next = flow.answer(&config, &mut proxy, failure.as_ref().map_err(|e| *e));
                assert_eq!(proxy.header(DEST), None, "{failure:?}");
                assert_eq!(proxy.warnings.len(), 1);
                match mode {
                    FailureMode::Open => assert_eq!((next, proxy.counts[0]), (AnswerNext::Go, Counter::FailOpen)),
                    FailureMode::Closed => {
                        assert_eq!((next, proxy.counts[0]), (AnswerNext::Hold, Counter::FailClosed));
                        assert_eq!(proxy.responses[0].0, 503);
                    }
                }
            }
        }
    }

    #[test]
    fn disaggregated_picks_by_mode_and_by_host() {
        let answer = pick("10.0.0.1:8000", &[], Some("10.0.0.9:8000"));
        // Header mode: the prefill pod named for the decode pod's sidecar.
        let config = ProxyConfig { pd_mode: PdMode::Header, ..ProxyConfig::default() };
        let mut proxy = Recorder::default();
        let mut flow = deciding(&config, &mut proxy);
        assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Go);
        assert_eq!(proxy.header("x-prefiller-host-port"), Some("10.0.0.9:8000"));
        assert_eq!(proxy.counts, [Counter::PdHeader, Counter::Routed]);
        // Envoy mode, a host without prefill legs: the decode pod prefills, the leg is over.
        let config = ProxyConfig::default();
        let mut proxy = Recorder::default();
        let mut flow = deciding(&config, &mut proxy);
        assert_eq!(flow.answer(&config, &mut proxy, Ok(&answer)), AnswerNext::Go);
        assert_eq!(proxy.counts, [Counter::PdLocalPrefill, Counter::Routed]);
        assert_eq!(proxy.events(), [LifecycleEvent::PrefillDone]);
        // Envoy mode with legs: the leg first, then the decode pod with its KV.
        let original = br#"{"prompt":"p","stream":true}"#;
        let mut proxy = Recorder { legs: true, ..Recorder::default() };
        let mut flow = deciding(&config, &mut proxy);
        let leg = flow.answer(&config, &mut proxy, Ok(&answer));
        assert_eq!(leg, AnswerNext::PrefillLeg { prefill: "10.0.0.9:8000".into() });
        assert_eq!(proxy.header(DEST), None, "not routed before the leg");
        let kv = br#"{"kv_transfer_params":{"remote_block_ids":[1]}}"#;
        assert_eq!(flow.prefilled(&config, &mut proxy, Ok((Some(200), kv)), original), Next::Go);
        let body: Value = serde_json::from_slice(proxy.body.as_deref().unwrap()).unwrap();
        assert_eq!(body["kv_transfer_params"]["remote_block_ids"][0], 1);
        assert_eq!(proxy.header("content-length"), Some(proxy.body.as_ref().unwrap().len().to_string().as_str()));
        assert_eq!(
            (proxy.header(DEST), proxy.counts.as_slice()),
            (Some("10.0.0.1:8000"), &[Counter::PdPrefillOk, Counter::Routed][..])
        );
        // A leg that fails: decoded with local prefill, the client still served.
        for outcome in [Ok((Some(500), &b""[..])), Ok((Some(200), &b"{}"[..])), Err("cannot reach the pod".to_string())]
        {
            let mut proxy = Recorder { legs: true, ..Recorder::default() };
            let mut flow = deciding(&config, &mut proxy);
            flow.answer(&config, &mut proxy, Ok(&answer));
            assert_eq!(flow.prefilled(&config, &mut proxy, outcome, original), Next::Go);
            assert!(proxy.body.is_none() && proxy.warnings.len() == 1);
            assert_eq!(proxy.counts, [Counter::PdFallback, Counter::Routed]);
            flow.complete(&mut proxy);
            assert_eq!(proxy.events(), [LifecycleEvent::PrefillDone, LifecycleEvent::Cancelled]);
        }
        // The client gone during the leg: the leg's booking and the request's both end.
        let mut proxy = Recorder { legs: true, ..Recorder::default() };
        let mut flow = deciding(&config, &mut proxy);
        flow.answer(&config, &mut proxy, Ok(&answer));
        flow.complete(&mut proxy);
        assert_eq!(proxy.events(), [LifecycleEvent::PrefillDone, LifecycleEvent::Cancelled]);
    }

    #[test]
    fn pd_legs_follow_vllms_nixl_flow() {
        let original = br#"{"model":"m","prompt":"p","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"min_tokens":3}"#;
        let leg: Value = serde_json::from_slice(&prefill_leg_body(original).unwrap()).unwrap();
        assert_eq!(leg["stream"], false);
        assert_eq!((leg["max_tokens"].as_u64(), leg["max_completion_tokens"].as_u64()), (Some(1), Some(1)));
        assert!(leg.get("stream_options").is_none() && leg.get("min_tokens").is_none());
        assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
        assert!(leg["kv_transfer_params"]["remote_engine_id"].is_null());
        let answer = br#"{"choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"e","x":{"opaque":[1]}}}"#;
        let decode: Value = serde_json::from_slice(&decode_leg_body(original, answer).unwrap()).unwrap();
        let params: Value = serde_json::from_slice::<Value>(answer).unwrap()["kv_transfer_params"].clone();
        assert_eq!(decode["kv_transfer_params"], params, "copied unchanged");
        assert_eq!(
            (decode["stream"].as_bool(), decode["max_tokens"].as_u64()),
            (Some(true), Some(50)),
            "the rest untouched"
        );
        assert!(decode_leg_body(original, br#"{"choices":[]}"#).is_err());
        assert!(decode_leg_body(original, b"<html>").is_err());
    }

    #[test]
    fn counters_are_listed_in_order_with_their_names() {
        assert!(Counter::all().enumerate().all(|(i, c)| c as usize == i));
        assert_eq!((Counter::Routed.name(), Counter::PdFallback.name()), ("routed", "pd_fallback"));
    }

    #[test]
    fn generated_ids_differ() {
        assert_ne!(request_id(1, 2, 3), request_id(1, 2, 4));
        assert!(request_id(u128::MAX, 1, 1).starts_with("kvgate-"));
    }
}
