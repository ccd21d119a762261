//! The Envoy bootstrap matching a scorer configuration: the pods cluster holds exactly the
//! scorer's pods, the scorer cluster points at its `listen` address.

use crate::config::Config;
use std::net::SocketAddr;
use std::path::PathBuf;

const TEMPLATE: &str = include_str!("../../envoy/bootstrap.yaml.tmpl");

/// Envoy-side settings (everything else comes from the scorer configuration).
#[derive(Clone, Debug)]
pub struct EnvoyOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The filter's `.wasm` file.
    pub wasm: PathBuf,
    /// `open` or `closed`.
    pub failure_mode: String,
    pub scorer_timeout_ms: u64,
    /// `envoy` (the filter sends prefill legs) or `header` (llm-d decode sidecars).
    pub pd_mode: String,
    pub body_limit_bytes: u64,
    /// Leave the kvgate filter out: plain Envoy round robin over the same pods, the baseline
    /// kvgate is measured against.
    pub baseline: bool,
}

/// Renders the bootstrap YAML.
pub fn render(config: &Config, options: &EnvoyOptions) -> String {
    let filter = serde_json::json!({
        "scorer_cluster": "kvgate_scorer",
        "failure_mode": options.failure_mode,
        "scorer_timeout_ms": options.scorer_timeout_ms,
        "pd_mode": options.pd_mode,
        "destination_header": "x-gateway-destination-endpoint",
    });
    let endpoints: String = config
        .pods
        .iter()
        .map(|pod| {
            let addr: SocketAddr = pod.address.parse().expect("validated by the config parser");
            format!(
                "        - endpoint:\n            address:\n              socket_address: {{ address: {}, port_value: {} }}\n          metadata:\n            filter_metadata:\n              kvgate: {{ pod: {}, role: {} }}\n",
                addr.ip(),
                addr.port(),
                pod.name,
                serde_json::to_string(&pod.role).unwrap_or_default().trim_matches('"'),
            )
        })
        .collect::<String>()
        + &config
            .discovery
            .dns
            .iter()
            .map(|dns| {
                // Envoy resolves the names the scorer discovers pods by; every A/AAAA record
                // becomes a host `ip:port`, which is what the scorer answers.
                format!(
                    "        - endpoint:\n            address:\n              socket_address: {{ address: {}, port_value: {} }}\n",
                    dns.name, dns.port
                )
            })
            .collect::<String>();
    // STATIC, or a strict-DNS cluster (every address a host) refreshed as often as the
    // scorer re-resolves.
    let refresh = config.discovery.dns.iter().map(|d| d.interval_seconds).reduce(f64::min);
    let discovery = refresh.map_or("    type: STATIC".to_string(), |seconds| {
        format!(
            "    cluster_type:\n      name: envoy.clusters.dns\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster\n        dns_lookup_family: ALL\n        dns_refresh_rate: {seconds}s"
        )
    });
    let replacements = [
        ("${PODS_DISCOVERY}", discovery),
        ("${ADMIN_IP}", options.admin.ip().to_string()),
        ("${ADMIN_PORT}", options.admin.port().to_string()),
        ("${LISTEN_IP}", options.listen.ip().to_string()),
        ("${LISTEN_PORT}", options.listen.port().to_string()),
        ("${BODY_LIMIT}", options.body_limit_bytes.to_string()),
        ("${FILTER_CONFIG}", filter.to_string()),
        ("${WASM_PATH}", options.wasm.display().to_string()),
        ("${SCORER_IP}", config.listen.ip().to_string()),
        ("${SCORER_PORT}", config.listen.port().to_string()),
        ("${DESTINATION_HEADER}", "x-gateway-destination-endpoint".to_string()),
        ("${POD_ENDPOINTS}", endpoints.trim_end().to_string()),
    ];
    let mut out = String::with_capacity(TEMPLATE.len() + endpoints.len());
    let mut in_filter = false;
    for line in TEMPLATE.lines() {
        match line {
            "${KVGATE_FILTER_BEGIN}" => in_filter = true,
            "${KVGATE_FILTER_END}" => in_filter = false,
            _ if in_filter && options.baseline => {}
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    for (key, value) in replacements {
        out = out.replace(key, &value);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> EnvoyOptions {
        EnvoyOptions {
            listen: "0.0.0.0:10000".parse().unwrap(),
            admin: "127.0.0.1:9901".parse().unwrap(),
            wasm: "/x/kvgate_filter.wasm".into(),
            failure_mode: "closed".into(),
            scorer_timeout_ms: 50,
            pd_mode: "envoy".into(),
            body_limit_bytes: 1 << 23,
            baseline: false,
        }
    }

    #[test]
    fn every_placeholder_is_filled_and_every_pod_listed() {
        let config = Config::parse(
            "listen: 127.0.0.1:7171\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n  - {name: b, address: '10.0.0.2:8000', role: decode}\n",
        )
        .unwrap();
        let out = render(&config, &options());
        assert!(!out.contains("${"), "{out}");
        assert!(
            out.contains("address: 10.0.0.1, port_value: 8000") && out.contains("address: 10.0.0.2, port_value: 8000")
        );
        assert!(out.contains("kvgate: { pod: b, role: decode }"));
        assert!(out.contains("port_value: 7171") && out.contains("\"failure_mode\":\"closed\""));
        assert!(out.contains("filters.http.wasm.v3.Wasm"));
        let baseline = render(&config, &EnvoyOptions { baseline: true, ..options() });
        assert!(!baseline.contains("filters.http.wasm") && baseline.contains("envoy.filters.http.router"));
        assert!(out.contains("type: STATIC") && !out.contains("dns_lookup_family"));
    }

    #[test]
    fn dns_discovery_makes_the_pods_cluster_resolve_the_same_name() {
        let config = Config::parse(
            "discovery:\n  dns:\n    - {name: vllm.inference.svc.cluster.local, port: 8000, interval_seconds: 2}\n    - {name: vllm-prefill.inference.svc.cluster.local, port: 8000, role: prefill}\npods: []\n",
        )
        .unwrap();
        let out = render(&config, &options());
        assert!(!out.contains("${"), "{out}");
        assert!(out.contains("name: envoy.clusters.dns\n") && out.contains("dns_refresh_rate: 2s\n"), "{out}");
        assert!(out.contains("socket_address: { address: vllm.inference.svc.cluster.local, port_value: 8000 }"));
        assert!(
            out.contains("socket_address: { address: vllm-prefill.inference.svc.cluster.local, port_value: 8000 }")
        );
    }
}
