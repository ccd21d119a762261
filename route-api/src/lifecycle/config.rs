//! The proxies' configuration (JSON in Envoy's filter configuration): the fields every host
//! shares, validated here, and each host's own fields beside them in one object.

use crate::Api;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use smart_default::SmartDefault;

/// How a disaggregated request reaches its prefill pod.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum PdMode {
    /// The proxy sends the prefill leg itself and hands its `kv_transfer_params` to the
    /// decode pod (vLLM's NIXL flow, no extra proxy to deploy); a host that sends no legs
    /// lets the decode pod prefill.
    Envoy,
    /// The proxy names the prefill pod in a header for the decode pod's own sidecar (llm-d's
    /// convention) and routes to the decode pod.
    Header,
}

/// What to do when the scorer is down, slow (timeout) or cannot decide.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Let Envoy's fallback load balancing pick a pod: requests keep flowing, without
    /// cache affinity.
    Open,
    /// Answer 503 with a JSON error.
    Closed,
}

/// The settings every proxy host shares.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, SmartDefault)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// Route-call timeout; beyond it the failure mode applies.
    #[default(100)]
    pub scorer_timeout_ms: u64,
    #[default(FailureMode::Open)]
    pub failure_mode: FailureMode,
    /// Request paths routed by the scorer (exact match, query string ignored), among
    /// `/v1/completions`, `/v1/chat/completions`, `/v1/messages` and `/v1/responses`; other
    /// traffic passes untouched.
    #[default(Api::PATHS.iter().map(|p| p.to_string()).collect())]
    pub paths: Vec<String>,
    /// Header naming the chosen pod for Envoy's `override_host` load-balancing policy.
    #[default = "x-gateway-destination-endpoint"]
    pub destination_header: String,
    /// Lifecycle reports not yet gone with a route call are sent at this period (also the
    /// period at which route-call timeouts are checked)…
    #[default(20)]
    pub lifecycle_flush_ms: u64,
    /// …or as soon as this many are waiting, or at once while the scorer says requests wait
    /// in its admission queue (each report frees room one of them is owed).
    #[default(256)]
    pub lifecycle_batch_max: usize,
    #[default(PdMode::Envoy)]
    pub pd_mode: PdMode,
    /// Header naming the prefill pod in `header` mode.
    #[default = "x-prefiller-host-port"]
    pub prefiller_header: String,
    /// Envoy traces requests, and a `header_mutation` filter before this one names the
    /// gateway's span in `x-kvgate-gateway-span` (as the bootstrap rendered with the
    /// scorer's `traces` does): the route call carries it, so the scorer's spans of the
    /// decision join the gateway's trace. The proxy removes the header.
    pub traces: bool,
}

/// A lowercase HTTP header name.
pub fn header_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl ProxyConfig {
    fn validate(&self) -> Result<(), String> {
        if self.scorer_timeout_ms == 0 || self.lifecycle_flush_ms == 0 || self.lifecycle_batch_max == 0 {
            return Err("scorer_timeout_ms, lifecycle_flush_ms and lifecycle_batch_max must be positive".into());
        }
        // The scorer tokenizes by API, so only the paths of APIs it knows can be routed.
        if self.paths.is_empty() {
            return Err(format!("paths must name some of {:?}", Api::PATHS));
        }
        if let Some(p) = self.paths.iter().find(|p| Api::from_path(p).is_none() || p.contains('?')) {
            return Err(format!("paths: {p:?} is not a routed API path (one of {:?})", Api::PATHS));
        }
        for (field, name) in
            [("destination_header", &self.destination_header), ("prefiller_header", &self.prefiller_header)]
        {
            if !header_name(name) {
                return Err(format!("{field} {name:?} is not a lowercase header name"));
            }
        }
        Ok(())
    }

    /// True if requests to `path` are routed by the scorer.
    pub fn intercepts(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or_default();
        self.paths.iter().any(|p| p == path)
    }
}

/// A host's own settings, beside the shared ones in the same JSON object.
pub trait HostConfig: DeserializeOwned + Serialize + Default {
    /// The host, for messages ("the wasm filter").
    const HOST: &'static str;
    /// Checks values and combinations.
    fn validate(&self) -> Result<(), String>;
}

/// A configuration's field names, in order: those its defaults serialize.
fn field_names<T: Serialize + Default>() -> Vec<String> {
    match serde_json::to_value(T::default()) {
        Ok(Value::Object(fields)) => fields.into_iter().map(|(name, _)| name).collect(),
        _ => Vec::new(),
    }
}

/// Parses and validates a host's configuration; an empty one means all defaults. A field
/// neither shared nor the host's refuses the configuration, naming it.
pub fn parse<H: HostConfig>(bytes: &[u8]) -> Result<(ProxyConfig, H), String> {
    let invalid = |e: &dyn std::fmt::Display| format!("invalid kvgate filter configuration: {e}");
    let mut fields: Map<String, Value> = if bytes.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        serde_json::from_slice(bytes).map_err(|e| invalid(&e))?
    };
    let (shared_fields, own_fields) = (field_names::<ProxyConfig>(), field_names::<H>());
    if let Some(unknown) = fields.keys().find(|k| !shared_fields.contains(k) && !own_fields.contains(k)) {
        let takes = [shared_fields, own_fields.clone()].concat().join(", ");
        return Err(invalid(&format!("unknown field `{unknown}`: {} takes {takes}", H::HOST)));
    }
    let own: Map<String, Value> = own_fields.iter().filter_map(|f| fields.remove_entry(f)).collect();
    let shared: ProxyConfig = serde_json::from_value(Value::Object(fields)).map_err(|e| invalid(&e))?;
    let own: H = serde_json::from_value(Value::Object(own)).map_err(|e| invalid(&e))?;
    shared.validate()?;
    own.validate()?;
    Ok((shared, own))
}

/// The wasm filter's own settings: it reaches the scorer and the pods through Envoy clusters.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, SmartDefault)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, deny_unknown_fields)]
pub struct WasmSettings {
    /// Envoy cluster of the scorer sidecar (HTTP/2: the route stream is gRPC).
    #[default = "kvgate_scorer"]
    pub scorer_cluster: String,
    /// `:authority` of lifecycle batches sent to the scorer by HTTP, while the route stream is
    /// closed (route calls and, while it is open, lifecycle reports go on the stream).
    #[default = "kvgate-scorer"]
    pub scorer_authority: String,
    /// Timeout of a lifecycle batch sent by HTTP.
    #[default(1000)]
    pub lifecycle_timeout_ms: u64,
    /// Envoy cluster of the pods (prefill legs go there, steered by the destination header).
    #[default = "kvgate_pods"]
    pub pods_cluster: String,
    /// Timeout of a prefill leg; beyond it the decode pod prefills locally.
    #[default(60_000)]
    pub prefill_timeout_ms: u64,
}

impl HostConfig for WasmSettings {
    const HOST: &'static str = "the wasm filter";

    fn validate(&self) -> Result<(), String> {
        if self.scorer_cluster.is_empty() || self.pods_cluster.is_empty() {
            return Err("scorer_cluster and pods_cluster must not be empty".into());
        }
        if self.lifecycle_timeout_ms == 0 || self.prefill_timeout_ms == 0 {
            return Err("lifecycle_timeout_ms and prefill_timeout_ms must be positive".into());
        }
        Ok(())
    }
}

/// The native module's own settings: it keeps its own route sockets to the scorer.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct NativeSettings {
    /// Where the module opens its route sockets: the scorer's `unix:<path>` (its
    /// `route_socket_path`) or its API's `ip:port` (or `host:port`).
    pub scorer_address: String,
}

impl HostConfig for NativeSettings {
    const HOST: &'static str = "the native module";

    fn validate(&self) -> Result<(), String> {
        if self.scorer_address.is_empty() {
            return Err("the native module needs scorer_address (the scorer's unix:<path> or ip:port)".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default, Deserialize, Serialize, Debug, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Own {
        socket: String,
    }

    impl HostConfig for Own {
        const HOST: &'static str = "a test host";
        fn validate(&self) -> Result<(), String> {
            if self.socket == "bad" { Err("socket is bad".into()) } else { Ok(()) }
        }
    }

    #[test]
    fn field_lists_name_every_field() {
        assert_eq!(field_names::<Own>(), ["socket"]);
        assert_eq!(field_names::<NativeSettings>(), ["scorer_address"]);
        let shared = field_names::<ProxyConfig>();
        assert_eq!((shared.len(), shared[0].as_str(), shared[8].as_str()), (9, "scorer_timeout_ms", "traces"));
    }

    #[test]
    fn defaults_and_overrides() {
        let (c, own) = parse::<Own>(b"").unwrap();
        assert_eq!((c.clone(), own), (ProxyConfig::default(), Own::default()));
        assert!(c.intercepts("/v1/chat/completions") && c.intercepts("/v1/completions?x=1"));
        assert!(!c.intercepts("/v1/models") && !c.intercepts("/v1/completions/render"));
        let (c, own) =
            parse::<Own>(br#"{"failure_mode": "closed", "scorer_timeout_ms": 20, "pd_mode": "header", "socket": "s"}"#)
                .unwrap();
        assert_eq!((c.failure_mode, c.scorer_timeout_ms, c.pd_mode), (FailureMode::Closed, 20, PdMode::Header));
        assert_eq!(own.socket, "s");
    }

    #[test]
    fn invalid_configurations_say_why() {
        for (json, needle) in [
            (r#"{"failure_mode": "sometimes"}"#, "expected `open` or `closed`"),
            (r#"{"scorer_timeout": 5}"#, "unknown field `scorer_timeout`: a test host takes scorer_timeout_ms"),
            (r#"{"scorer_timeout_ms": 0}"#, "positive"),
            (r#"{"lifecycle_batch_max": 0}"#, "positive"),
            (r#"{"paths": []}"#, "paths"),
            (r#"{"paths": ["v1/completions"]}"#, "paths"),
            (r#"{"paths": ["/v1/embeddings"]}"#, "not a routed API path"),
            (r#"{"destination_header": "X-Dest"}"#, "destination_header"),
            (r#"{"pd_mode": "sidecar"}"#, "expected `envoy` or `header`"),
            (r#"{"prefiller_header": "X"}"#, "prefiller_header"),
            (r#"{"socket": 3}"#, "invalid type"),
            (r#"{"socket": "bad"}"#, "socket is bad"),
            ("not json", "invalid"),
            ("[]", "invalid"),
        ] {
            let err = parse::<Own>(json.as_bytes()).unwrap_err();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
