//! The wasm filter's plugin configuration (JSON in Envoy's `plugin_config.configuration`):
//! the settings every proxy shares ([`ProxyConfig`]) and the filter's own, in one object,
//! validated in `on_configure` (an invalid configuration refuses to load, with a log line
//! saying why).

use kvgate_route_api::lifecycle::{self, ProxyConfig, WasmSettings};

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
