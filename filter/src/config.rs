//! The wasm filter's plugin configuration (JSON in Envoy's `plugin_config.configuration`):
//! the settings every proxy shares ([`ProxyConfig`]) and the filter's own, in one object,
//! validated in `on_configure` (an invalid configuration refuses to load, with a log line
//! saying why).

use kvgate_route_api::lifecycle::{self, HostConfig, ProxyConfig};
use serde::{Deserialize, Serialize};

/// The wasm filter's own settings: it reaches the scorer and the pods through Envoy clusters.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WasmSettings {
    /// Envoy cluster of the scorer sidecar (HTTP/2: the route stream is gRPC).
    pub scorer_cluster: String,
    /// `:authority` of lifecycle batches sent to the scorer by HTTP, while the route stream is
    /// closed (route calls and, while it is open, lifecycle reports go on the stream).
    pub scorer_authority: String,
    /// Timeout of a lifecycle batch sent by HTTP.
    pub lifecycle_timeout_ms: u64,
    /// Envoy cluster of the pods (prefill legs go there, steered by the destination header).
    pub pods_cluster: String,
    /// Timeout of a prefill leg; beyond it the decode pod prefills locally.
    pub prefill_timeout_ms: u64,
}

impl Default for WasmSettings {
    fn default() -> Self {
        Self {
            scorer_cluster: "kvgate_scorer".into(),
            scorer_authority: "kvgate-scorer".into(),
            lifecycle_timeout_ms: 1000,
            pods_cluster: "kvgate_pods".into(),
            prefill_timeout_ms: 60_000,
        }
    }
}

impl HostConfig for WasmSettings {
    const HOST: &'static str = "the wasm filter";
    const FIELDS: &'static [&'static str] =
        &["scorer_cluster", "scorer_authority", "lifecycle_timeout_ms", "pods_cluster", "prefill_timeout_ms"];

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

/// The whole configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct FilterConfig {
    pub proxy: ProxyConfig,
    pub wasm: WasmSettings,
}

impl FilterConfig {
    /// Parses and validates; an empty configuration means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, String> {
        lifecycle::parse(bytes).map(|(proxy, wasm)| FilterConfig { proxy, wasm })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_list_names_every_field() {
        let value = serde_json::to_value(WasmSettings::default()).unwrap();
        assert_eq!(value.as_object().unwrap().keys().collect::<Vec<_>>(), WasmSettings::FIELDS);
    }

    #[test]
    fn shared_and_own_fields_in_one_object() {
        let c = FilterConfig::parse(b"").unwrap();
        assert_eq!((c.proxy, c.wasm), (ProxyConfig::default(), WasmSettings::default()));
        let c = FilterConfig::parse(br#"{"failure_mode": "closed", "pods_cluster": "outbound|8000||vllm"}"#).unwrap();
        assert_eq!(c.proxy.failure_mode, kvgate_route_api::lifecycle::FailureMode::Closed);
        assert_eq!(c.wasm.pods_cluster, "outbound|8000||vllm");
    }

    #[test]
    fn invalid_configurations_say_why() {
        for (json, needle) in [
            (r#"{"scorer_cluster": ""}"#, "scorer_cluster"),
            (r#"{"pods_cluster": ""}"#, "pods_cluster"),
            (r#"{"prefill_timeout_ms": 0}"#, "positive"),
            (r#"{"lifecycle_timeout_ms": 0}"#, "positive"),
            (r#"{"scorer_timeout_ms": 0}"#, "positive"),
            (r#"{"scorer_address": "unix:/run/kvgate.sock"}"#, "unknown field `scorer_address`: the wasm filter takes"),
        ] {
            let err = FilterConfig::parse(json.as_bytes()).unwrap_err();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
