//! The filter's decisions, free of proxy-wasm host calls so they are unit-tested natively:
//! reading the scorer's answer, the prefill and decode legs, error bodies. (Body validation
//! and usage scanning are shared with the scorer, in `kvgate-route-api`.)

use kvgate_route_api::{ErrorBody, LifecycleReport, Outcome, Refused, RouteAnswer};
use serde_json::{Map, Value, json};
use std::net::SocketAddr;
use std::time::SystemTime;

/// What the scorer's answer means for the request.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// Route to `destination` (`ip:port`, then the fallbacks: `ip:port,ip:port,…`), after a
    /// prefill leg on `prefill` when given.
    Route { destination: String, pod: String, prefill: Option<String> },
    /// The request itself is bad (scorer said 400): tell the client.
    BadRequest(String),
    /// Refused for overload (scorer said 429): tell the client to retry later.
    Shed(String),
    /// The scorer is down, slow, failing, or answered nonsense: the failure mode decides.
    Unavailable(String),
}

/// Reads the scorer's answer to a route call.
pub fn interpret(answer: &RouteAnswer) -> Verdict {
    match &answer.outcome {
        Some(Outcome::Pick(pick)) => {
            let addresses = std::iter::once(&pick.decode).chain(&pick.fallbacks).chain(&pick.prefill);
            match addresses.into_iter().find(|a| a.parse::<SocketAddr>().is_err()) {
                Some(bad) => Verdict::Unavailable(format!("scorer named {bad:?}, which is not ip:port")),
                None => Verdict::Route {
                    destination: pick.destinations(),
                    pod: pick.pod.clone(),
                    prefill: pick.prefill.clone(),
                },
            }
        }
        Some(Outcome::Refusal(refusal)) => match refusal.refused() {
            Refused::BadRequest | Refused::TooLarge => Verdict::BadRequest(refusal.message.clone()),
            Refused::Overloaded => Verdict::Shed(refusal.message.clone()),
            other => Verdict::Unavailable(format!("scorer refused: {other:?}: {}", refusal.message)),
        },
        None => Verdict::Unavailable("the scorer's answer says nothing".into()),
    }
}

/// The prefill leg of a disaggregated request (vLLM's NIXL flow): the client's request
/// with `stream: false`, one output token, no `stream_options`/`min_tokens`, and
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

/// The decode leg: the client's request with the prefill pod's `kv_transfer_params`
/// copied in unchanged. Fails when the prefill answer carries none.
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

/// An OpenAI-shaped JSON error body.
pub fn error_body(code: u16, kind: &str, message: &str) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody::new(code, kind, message)).unwrap_or_else(|_| b"{}".to_vec())
}

/// A request id for a request that came without one: time, worker context and a counter.
pub fn request_id(now_nanos: u128, context_id: u32, counter: u64) -> String {
    format!("kvgate-{:x}-{context_id:x}-{counter:x}", now_nanos & 0xffff_ffff_ffff)
}

/// A report that waited since `at`, stamped with its age at `sent` (the scorer dates the
/// event by it); a clock gone backwards counts as no wait.
pub fn aged(report: LifecycleReport, at: SystemTime, sent: SystemTime) -> LifecycleReport {
    let age = sent.duration_since(at).unwrap_or_default().as_micros();
    LifecycleReport { age_us: Some(u32::try_from(age).unwrap_or(u32::MAX)), ..report }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_stamped_with_their_age() {
        let report = |age_us| LifecycleReport {
            request_id: "r".into(),
            event: kvgate_route_api::LifecycleEvent::Done,
            served: None,
            output_tokens: None,
            age_us,
        };
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(100);
        let later = at + std::time::Duration::from_micros(1500);
        assert_eq!(aged(report(None), at, later), report(Some(1500)));
        assert_eq!(aged(report(None), later, at), report(Some(0)), "clock gone backwards");
        let much_later = at + std::time::Duration::from_secs(10_000);
        assert_eq!(aged(report(None), at, much_later), report(Some(u32::MAX)));
    }

    fn picked(decode: &str, fallbacks: &[&str], prefill: Option<&str>) -> RouteAnswer {
        let pick = kvgate_route_api::RoutePick {
            decode: decode.into(),
            fallbacks: fallbacks.iter().map(|f| f.to_string()).collect(),
            prefill: prefill.map(str::to_string),
            pod: "p1".into(),
        };
        RouteAnswer { call: 1, outcome: Some(Outcome::Pick(pick)), ..Default::default() }
    }

    fn refused(reason: Refused, message: &str) -> RouteAnswer {
        let refusal = kvgate_route_api::Refusal { reason: reason as i32, message: message.into(), retry_after: None };
        RouteAnswer { call: 1, outcome: Some(Outcome::Refusal(refusal)), ..Default::default() }
    }

    #[test]
    fn scorer_answers() {
        assert_eq!(
            interpret(&picked("10.0.0.1:8000", &[], None)),
            Verdict::Route { destination: "10.0.0.1:8000".into(), pod: "p1".into(), prefill: None }
        );
        let pd = interpret(&picked("10.0.0.1:8000", &[], Some("10.0.0.2:8000")));
        assert!(matches!(pd, Verdict::Route { prefill: Some(p), .. } if p == "10.0.0.2:8000"));
        assert!(matches!(interpret(&picked("10.0.0.1:8000", &[], Some("x"))), Verdict::Unavailable(_)));
        assert_eq!(
            interpret(&picked("10.0.0.1:8000", &["10.0.0.2:8000", "10.0.0.3:8000"], None)),
            Verdict::Route {
                destination: "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000".into(),
                pod: "p1".into(),
                prefill: None
            }
        );
        assert!(matches!(interpret(&picked("10.0.0.1:8000", &["evil:80"], None)), Verdict::Unavailable(_)));
        assert!(matches!(interpret(&picked("evil.example:80", &[], None)), Verdict::Unavailable(_)));
        assert!(matches!(interpret(&RouteAnswer::default()), Verdict::Unavailable(_)));
        assert_eq!(
            interpret(&refused(Refused::BadRequest, "'prompt' is required")),
            Verdict::BadRequest("'prompt' is required".into())
        );
        assert_eq!(
            interpret(&refused(Refused::Overloaded, "every pod is saturated")),
            Verdict::Shed("every pod is saturated".into())
        );
        for reason in [Refused::NoPod, Refused::Stopping, Refused::Unknown] {
            assert!(matches!(interpret(&refused(reason, "")), Verdict::Unavailable(_)), "{reason:?}");
        }
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
    fn generated_ids_differ() {
        assert_ne!(request_id(1, 2, 3), request_id(1, 2, 4));
        assert!(request_id(u128::MAX, 1, 1).starts_with("kvgate-"));
    }
}
