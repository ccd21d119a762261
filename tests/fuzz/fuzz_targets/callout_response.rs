//! What the filter reads from the network: the scorer's answer (a route protocol message), the
//! prefill pod's answer, response chunks. A panic here would trap Envoy's wasm VM.
#![no_main]
use kvgate_filter::logic;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(answer) = kvgate_route_api::RouteAnswer::decode(data) {
        let _ = logic::interpret(&answer);
    }
    let _ = kvgate_route_api::completion_tokens(data);
    let original = br#"{"prompt": "x", "stream": true, "max_tokens": 9}"#;
    let _ = logic::decode_leg_body(original, data);
    let _ = logic::prefill_leg_body(data);
});
