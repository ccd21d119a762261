//! The filter's plugin configuration (JSON in Envoy's `plugin_config.configuration`),
//! validated in `on_configure`: an invalid configuration refuses to load, with a log line
//! saying why.

use kvgate_route_api::Api;
use serde::Deserialize;

/// How a disaggregated request reaches its prefill pod.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PdMode {
    /// The filter sends the prefill leg itself and hands its `kv_transfer_params` to the
    /// decode pod (vLLM's NIXL flow, no extra proxy to deploy).
    Envoy,
    /// The filter names the prefill pod in a header for the decode pod's own sidecar
    /// (llm-d's convention) and routes to the decode pod.
    Header,
}

/// What to do when the scorer is down, slow (timeout) or answers 5xx.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// Let Envoy's fallback load balancing pick a pod: requests keep flowing, without
    /// cache affinity.
    Open,
    /// Answer 503 with a JSON error.
    Closed,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster of the scorer sidecar.
    pub scorer_cluster: String,
    /// Where the native module opens its route sockets: the scorer's `unix:<path>` (its
    /// `route_socket_path`) or its API's `ip:port` (the wasm filter reaches the scorer
    /// through `scorer_cluster`).
    pub scorer_address: String,
    /// `:authority` of lifecycle batches sent to the scorer by HTTP, while the route stream is
    /// closed (route calls and, while it is open, lifecycle reports go on the stream).
    pub scorer_authority: String,
    /// Route-call timeout; beyond it the failure mode applies.
    pub scorer_timeout_ms: u64,
    pub failure_mode: FailureMode,
    /// Request paths routed by the scorer (exact match, query string ignored), among
    /// `kvgate_route_api::Api::PATHS`; other traffic passes untouched.
    pub paths: Vec<String>,
    /// Header naming the chosen pod for Envoy's `override_host` load-balancing policy.
    pub destination_header: String,
    /// Lifecycle reports not yet gone with a route call are sent at this period (also the
    /// root's tick: route-call timeouts, reopening the route stream)…
    pub lifecycle_flush_ms: u64,
    /// …or as soon as this many are waiting, or at once while the scorer says requests wait
    /// in its admission queue (each report frees room one of them is owed).
    pub lifecycle_batch_max: usize,
    /// Timeout of a lifecycle batch sent by HTTP.
    pub lifecycle_timeout_ms: u64,
    pub pd_mode: PdMode,
    /// Envoy cluster of the pods (prefill legs go there, steered by the destination header).
    pub pods_cluster: String,
    /// Timeout of a prefill leg; beyond it the decode pod prefills locally.
    pub prefill_timeout_ms: u64,
    /// Header naming the prefill pod in `header` mode.
    pub prefiller_header: String,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            scorer_cluster: "kvgate_scorer".into(),
            scorer_address: String::new(),
            scorer_authority: "kvgate-scorer".into(),
            scorer_timeout_ms: 100,
            failure_mode: FailureMode::Open,
            paths: Api::PATHS.iter().map(|p| p.to_string()).collect(),
            destination_header: "x-gateway-destination-endpoint".into(),
            lifecycle_flush_ms: 20,
            lifecycle_batch_max: 256,
            lifecycle_timeout_ms: 1000,
            pd_mode: PdMode::Envoy,
            pods_cluster: "kvgate_pods".into(),
            prefill_timeout_ms: 60_000,
            prefiller_header: "x-prefiller-host-port".into(),
        }
    }
}

fn header_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl FilterConfig {
    /// Parses and validates; an empty configuration means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, String> {
        let config: FilterConfig = if bytes.iter().all(u8::is_ascii_whitespace) {
            FilterConfig::default()
        } else {
            serde_json::from_slice(bytes).map_err(|e| format!("invalid kvgate filter configuration: {e}"))?
        };
        if config.scorer_cluster.is_empty() {
            return Err("scorer_cluster must not be empty".into());
        }
        if config.scorer_timeout_ms == 0
            || config.lifecycle_timeout_ms == 0
            || config.lifecycle_flush_ms == 0
            || config.prefill_timeout_ms == 0
        {
            return Err(
                "scorer_timeout_ms, lifecycle_timeout_ms, lifecycle_flush_ms and prefill_timeout_ms must be positive"
                    .into(),
            );
        }
        if config.pods_cluster.is_empty() {
            return Err("pods_cluster must not be empty".into());
        }
        if config.lifecycle_batch_max == 0 {
            return Err("lifecycle_batch_max must be positive".into());
        }
        // The scorer tokenizes by API, so only the paths of APIs it knows can be routed.
        if config.paths.is_empty() {
            return Err(format!("paths must name some of {:?}", Api::PATHS));
        }
        if let Some(p) = config.paths.iter().find(|p| Api::from_path(p).is_none() || p.contains('?')) {
            return Err(format!("paths: {p:?} is not a routed API path (one of {:?})", Api::PATHS));
        }
        for (field, name) in
            [("destination_header", &config.destination_header), ("prefiller_header", &config.prefiller_header)]
        {
            if !header_name(name) {
                return Err(format!("{field} {name:?} is not a lowercase header name"));
            }
        }
        Ok(config)
    }

    /// True if requests to `path` are routed by the scorer.
    pub fn intercepts(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or_default();
        self.paths.iter().any(|p| p == path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = FilterConfig::parse(b"").unwrap();
        assert_eq!(c, FilterConfig::default());
        assert!(c.intercepts("/v1/chat/completions") && c.intercepts("/v1/completions?x=1"));
        assert!(!c.intercepts("/v1/models") && !c.intercepts("/v1/completions/render"));
        let c = FilterConfig::parse(br#"{"failure_mode": "closed", "scorer_timeout_ms": 20, "pd_mode": "header"}"#)
            .unwrap();
        assert_eq!((c.failure_mode, c.scorer_timeout_ms, c.pd_mode), (FailureMode::Closed, 20, PdMode::Header));
    }

    #[test]
    fn invalid_configurations_say_why() {
        for (json, needle) in [
            (r#"{"failure_mode": "sometimes"}"#, "expected `open` or `closed`"),
            (r#"{"scorer_timeout": 5}"#, "scorer_timeout"),
            (r#"{"scorer_timeout_ms": 0}"#, "positive"),
            (r#"{"paths": []}"#, "paths"),
            (r#"{"paths": ["v1/completions"]}"#, "paths"),
            (r#"{"paths": ["/v1/embeddings"]}"#, "not a routed API path"),
            (r#"{"destination_header": "X-Dest"}"#, "destination_header"),
            (r#"{"scorer_cluster": ""}"#, "scorer_cluster"),
            (r#"{"pd_mode": "sidecar"}"#, "expected `envoy` or `header`"),
            (r#"{"prefiller_header": "X"}"#, "prefiller_header"),
            ("not json", "invalid"),
        ] {
            let err = FilterConfig::parse(json.as_bytes()).unwrap_err();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
