//! What a proxy reads from the network: the scorer's answer (a route protocol message), the
//! prefill pod's answer, response chunks — through the request lifecycle the filters drive.
//! A panic here would trap Envoy's wasm VM, or abort Envoy (the native module).
#![no_main]
use kvgate_route_api::lifecycle::{self, BodyNext, Counter, Proxy, ProxyConfig, RequestFlow};
use kvgate_route_api::{LifecycleReport, RouteAnswer};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::fmt::Arguments;

/// A proxy that does nothing, but can replace bodies (so prefill legs run to the end).
struct Null;

impl Proxy for Null {
    fn set_request_header(&mut self, _: &str, _: Option<&str>) {}
    fn send_response(&mut self, _: u16, _: &[(&str, &str)], _: &[u8]) {}
    fn count(&mut self, _: Counter) {}
    fn report(&mut self, _: LifecycleReport) {}
    fn warn(&mut self, _: Arguments<'_>) {}
    fn debug(&mut self, _: Arguments<'_>) {}
    fn sends_prefill_legs(&self) -> bool {
        true
    }
    fn replace_request_body(&mut self, _: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let config = ProxyConfig::default();
    let original = br#"{"prompt": "x", "stream": true, "max_tokens": 9}"#;
    if let Ok(answer) = RouteAnswer::decode(data) {
        let mut flow = RequestFlow::default();
        flow.request_headers(&config, &mut Null, Some("POST"), "/v1/completions", false, |_| None, || "id".into());
        let call = flow.request_body(&mut Null, true, || original.to_vec(), || None);
        assert!(matches!(call, BodyNext::Call(_)));
        flow.answer(&config, &mut Null, Ok(&answer));
        flow.prefilled(&config, &mut Null, Ok((Some(200), data)), original);
        flow.response_headers(Some(200), false, || None);
        flow.response_body(&mut Null, true, || data.to_vec());
        flow.complete(&mut Null);
    }
    let _ = kvgate_route_api::Usage::of(data);
    let _ = lifecycle::decode_leg_body(original, data);
    let _ = lifecycle::prefill_leg_body(data);
});
