//! The scorer's other inputs: lifecycle batches and its YAML configuration.
#![no_main]
use kvgate_route_api::LifecycleBatch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<LifecycleBatch>(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = kvgate_scorer::config::Config::parse(text);
    }
});
