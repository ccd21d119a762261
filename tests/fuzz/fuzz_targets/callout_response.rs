//! What the filter reads from the network: the scorer's answer (status + body), the prefill
//! pod's answer, response chunks. A panic here would trap Envoy's wasm VM.
#![no_main]
use kvgate_filter::logic;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (status, body) = match data.split_first() {
        Some((&s, rest)) => (Some(u16::from(s) * 3), rest),
        None => (None, data),
    };
    let _ = logic::interpret(status, body);
    let _ = kvgate_route_api::completion_tokens(body);
    let original = br#"{"prompt": "x", "stream": true, "max_tokens": 9}"#;
    let _ = logic::decode_leg_body(original, body);
    let _ = logic::prefill_leg_body(body);
});
