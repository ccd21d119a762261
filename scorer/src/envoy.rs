//! The Envoy bootstrap matching a scorer configuration: the pods cluster holds exactly the
//! scorer's pods, the scorer cluster points at its `listen` address.

use crate::config::{Config, EppTls};
use std::net::SocketAddr;
use std::path::PathBuf;

const TEMPLATE: &str = include_str!("../../envoy/bootstrap.yaml.tmpl");

/// Who picks the pod in Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Picker {
    /// The kvgate wasm filter calling the scorer sidecar's HTTP API.
    Wasm,
    /// The kvgate filter as a native Envoy dynamic module, on its own route socket to the
    /// scorer sidecar.
    Native,
    /// The scorer's Endpoint Picker through Envoy's ext_proc filter (the scorer
    /// configuration needs an `epp` section).
    Epp,
    /// Nobody: plain round robin over the same pods, the baseline kvgate is measured against.
    None,
}

/// How the rendered bootstrap's ext_proc filter talks to the picker (see docs/scorer.md, The Endpoint Picker).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EppBodyMode {
    /// The body streamed to the picker without waiting, the pick with the headers' answer
    /// (one round trip); responses STREAMED. Envoy keeps every byte: a picker that dies or
    /// freezes costs no request. Default.
    Streamed,
    /// The whole request body in one message after the headers' answer (Envoy AI
    /// Gateway's), responses STREAMED.
    Buffered,
    /// Full duplex both ways (Istio's and llm-d's): the picker hands every body byte back;
    /// a picker that dies mid-request fails it (Envoy cannot fall back once the body left).
    FullDuplex,
}

impl EppBodyMode {
    /// (request body, response headers, response body, response trailers) modes of the
    /// routing filter. The picker sees every answer's headers, as Istio's and llm-d's
    /// gateways send them: its status tells an engine's refusal (a 4xx) from a first token.
    fn modes(self) -> (&'static str, &'static str, &'static str, &'static str) {
        match self {
            EppBodyMode::Streamed => ("STREAMED", "SEND", "STREAMED", "SEND"),
            EppBodyMode::Buffered => ("BUFFERED", "SEND", "STREAMED", "SEND"),
            EppBodyMode::FullDuplex => ("FULL_DUPLEX_STREAMED", "SEND", "FULL_DUPLEX_STREAMED", "SEND"),
        }
    }
}

/// Envoy-side settings (everything else comes from the scorer configuration).
#[derive(Clone, Debug)]
pub struct EnvoyOptions {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The filter's `.wasm` file.
    pub wasm: PathBuf,
    /// The filter's native module (`libkvgate_filter_native.so`).
    pub native_module: PathBuf,
    pub picker: Picker,
    /// `open` or `closed`: the picker down, slow or failing.
    pub failure_mode: String,
    /// Per decision: the filter's route call, the ext_proc message timeout.
    pub scorer_timeout_ms: u64,
    /// `envoy` (the filter sends prefill legs) or `header` (llm-d decode sidecars).
    pub pd_mode: String,
    pub body_limit_bytes: u64,
    pub epp_body_mode: EppBodyMode,
    /// Retries onto the next pods of the pick's list (connection refused, reset before an
    /// answer).
    pub retries: u32,
}

/// Lines between `begin` and `end` markers are kept when `keep`, else dropped.
fn section(out: String, begin: &str, end: &str, keep: bool) -> String {
    let mut kept = String::with_capacity(out.len());
    let mut inside = false;
    for line in out.lines() {
        if line == begin {
            inside = true;
        } else if line == end {
            inside = false;
        } else if keep || !inside {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    kept
}

/// `address` with an unspecified IP (listening on all interfaces) made loopback: how this
/// Envoy, beside the scorer, dials it.
fn loopback(address: SocketAddr) -> SocketAddr {
    if address.ip().is_unspecified() {
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), address.port())
    } else {
        address
    }
}

/// Renders the bootstrap YAML.
pub fn render(config: &Config, options: &EnvoyOptions) -> Result<String, String> {
    // A request may wait in the scorer's admission queue for room: the decision's timeout
    // covers that wait.
    let timeout_ms = options.scorer_timeout_ms + config.admission.as_ref().map_or(0, |a| a.max_wait_ms);
    let mut filter = serde_json::json!({
        "scorer_cluster": "kvgate_scorer",
        "failure_mode": options.failure_mode,
        "scorer_timeout_ms": timeout_ms,
        "pd_mode": options.pd_mode,
        "destination_header": "x-gateway-destination-endpoint",
    });
    let in_proxy = matches!(options.picker, Picker::Wasm | Picker::Native);
    if config.traces.is_some() && in_proxy {
        filter["traces"] = true.into();
    }
    if options.picker == Picker::Native {
        let prefill = crate::config::Role::Prefill;
        let has_prefill_pods =
            config.pods.iter().any(|p| p.role == prefill) || config.discovery.dns.iter().any(|d| d.role == prefill);
        if options.pd_mode == "envoy" && has_prefill_pods {
            return Err("--picker native sends no prefill legs: with prefill pods, use --pd-mode header (the decode pods' sidecars prefill) or --picker wasm".into());
        }
        // The module dials the scorer itself: on its route socket path when it has one,
        // else its API (listening on all interfaces by default; the sidecar is reached on
        // loopback).
        if let Some(fields) = filter.as_object_mut() {
            fields.remove("scorer_cluster"); // no Envoy cluster: the module has its own socket
        }
        filter["scorer_address"] = match &config.route_socket_path {
            Some(path) => format!("unix:{}", path.display()),
            None => loopback(config.listen).to_string(),
        }
        .into();
    }
    let epp = match (options.picker, &config.epp) {
        (Picker::Epp, None) => return Err("--picker epp needs an `epp` section in the scorer configuration".into()),
        (Picker::Epp, Some(epp)) => Some(epp),
        _ => None,
    };
    let endpoints: String = config
        .pods
        .iter()
        .map(|pod| {
            let addr = pod.address;
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
    // The wasm filter names the pick in the header (stripping clients'); the picker in both,
    // and Envoy routes on its metadata alone, which no client can set.
    let override_source = match options.picker {
        Picker::Epp => {
            "            - metadata:\n                key: envoy.lb\n                path: [{ key: x-gateway-destination-endpoint }]"
        }
        _ => "            - header: x-gateway-destination-endpoint",
    };
    // The picker listens on all interfaces by default; this Envoy reaches it on loopback.
    let epp_address = epp.map(|e| loopback(e.listen));
    let (request_mode, response_headers, response_mode, response_trailers) = options.epp_body_mode.modes();
    let traces = config.traces.as_ref();
    let replacements = [
        ("${PODS_DISCOVERY}", discovery),
        ("${ADMIN_IP}", options.admin.ip().to_string()),
        ("${ADMIN_PORT}", options.admin.port().to_string()),
        ("${LISTEN_IP}", options.listen.ip().to_string()),
        ("${LISTEN_PORT}", options.listen.port().to_string()),
        ("${BODY_LIMIT}", options.body_limit_bytes.to_string()),
        ("${RETRIES}", options.retries.to_string()),
        ("${FILTER_CONFIG}", filter.to_string()),
        ("${WASM_PATH}", options.wasm.display().to_string()),
        ("${NATIVE_MODULE_PATH}", options.native_module.display().to_string()),
        ("${SCORER_IP}", config.listen.ip().to_string()),
        ("${SCORER_PORT}", config.listen.port().to_string()),
        ("${EPP_FAILURE_MODE_ALLOW}", (options.failure_mode == "open").to_string()),
        ("${EPP_REQUEST_BODY_MODE}", request_mode.to_string()),
        ("${EPP_RESPONSE_HEADER_MODE}", response_headers.to_string()),
        ("${EPP_RESPONSE_BODY_MODE}", response_mode.to_string()),
        ("${EPP_RESPONSE_TRAILER_MODE}", response_trailers.to_string()),
        ("${EPP_MESSAGE_TIMEOUT}", format!("{}s", timeout_ms as f64 / 1000.0)),
        ("${EPP_IP}", epp_address.map(|a| a.ip().to_string()).unwrap_or_default()),
        ("${EPP_PORT}", epp_address.map(|a| a.port().to_string()).unwrap_or_default()),
        ("${OVERRIDE_HOST_SOURCE}", override_source.to_string()),
        ("${POD_ENDPOINTS}", endpoints.trim_end().to_string()),
        ("${TRACES_PERCENT}", traces.map(|t| (t.sample_ratio * 100.0).to_string()).unwrap_or_default()),
        ("${TRACES_GATEWAY_SERVICE}", traces.map(|t| format!("{}-gateway", t.service_name)).unwrap_or_default()),
        ("${TRACES_HOST}", traces.and_then(|t| t.otlp_endpoint.host().map(String::from)).unwrap_or_default()),
        ("${TRACES_PORT}", traces.and_then(|t| t.otlp_endpoint.port_u16()).unwrap_or_default().to_string()),
    ];
    let mut out = TEMPLATE.to_string();
    out = section(out, "${WASM_BEGIN}", "${WASM_END}", options.picker == Picker::Wasm);
    out = section(out, "${NATIVE_BEGIN}", "${NATIVE_END}", options.picker == Picker::Native);
    out = section(out, "${EPP_BEGIN}", "${EPP_END}", epp.is_some());
    out = section(out, "${EPP_STREAMED_BEGIN}", "${EPP_STREAMED_END}", request_mode == "STREAMED");
    let tls = epp.is_some_and(|e| e.tls != EppTls::Plaintext);
    out = section(out, "${EPP_TLS_BEGIN}", "${EPP_TLS_END}", tls);
    out = section(out, "${TRACES_BEGIN}", "${TRACES_END}", traces.is_some());
    out = section(out, "${FILTER_TRACES_BEGIN}", "${FILTER_TRACES_END}", traces.is_some() && in_proxy);
    for (key, value) in replacements {
        out = out.replace(key, &value);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> EnvoyOptions {
        EnvoyOptions {
            listen: "0.0.0.0:10000".parse().unwrap(),
            admin: "127.0.0.1:9901".parse().unwrap(),
            wasm: "/x/kvgate_filter.wasm".into(),
            native_module: "/x/libkvgate_filter_native.so".into(),
            failure_mode: "closed".into(),
            scorer_timeout_ms: 50,
            pd_mode: "envoy".into(),
            body_limit_bytes: 1 << 23,
            picker: Picker::Wasm,
            epp_body_mode: EppBodyMode::Streamed,
            retries: 2,
        }
    }

    #[test]
    fn the_native_module_dials_the_route_socket_path_or_the_api_on_loopback() {
        let native = EnvoyOptions { picker: Picker::Native, ..options() };
        let config = Config::parse("listen: 0.0.0.0:7171\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n").unwrap();
        let out = render(&config, &native).unwrap();
        assert!(!out.contains("${") && out.contains("DynamicModuleFilter"), "{out}");
        assert!(out.contains("filename: /x/libkvgate_filter_native.so") && out.contains("metrics_namespace: kvgate"));
        assert!(out.contains("\"scorer_address\":\"127.0.0.1:7171\""), "all interfaces → loopback: {out}");
        // Neither the wasm filter nor its scorer cluster.
        assert!(!out.contains("filters.http.wasm") && !out.contains("kvgate_scorer"), "{out}");
        let config = Config::parse(
            "route_socket_path: /run/kvgate/route.sock\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n",
        )
        .unwrap();
        let out = render(&config, &native).unwrap();
        assert!(out.contains("\"scorer_address\":\"unix:/run/kvgate/route.sock\""), "{out}");
        // No prefill legs from the module: prefill pods need the header mode.
        for pods in [
            "pods:\n  - {name: p, address: '10.0.0.1:8000', role: prefill}\n",
            "discovery: {dns: [{name: vllm-prefill.x, port: 8000, role: prefill}]}\n",
        ] {
            let config = Config::parse(pods).unwrap();
            assert!(render(&config, &native).unwrap_err().contains("--pd-mode header"), "{pods}");
            assert!(render(&config, &EnvoyOptions { pd_mode: "header".into(), ..native.clone() }).is_ok());
        }
    }

    #[test]
    fn every_placeholder_is_filled_and_every_pod_listed() {
        let config = Config::parse(
            "listen: 127.0.0.1:7171\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n  - {name: b, address: '10.0.0.2:8000', role: decode}\n",
        )
        .unwrap();
        let out = render(&config, &options()).unwrap();
        assert!(!out.contains("${"), "{out}");
        assert!(
            out.contains("address: 10.0.0.1, port_value: 8000") && out.contains("address: 10.0.0.2, port_value: 8000")
        );
        assert!(out.contains("kvgate: { pod: b, role: decode }"));
        assert!(out.contains("port_value: 7171") && out.contains("\"failure_mode\":\"closed\""));
        assert!(out.contains("filters.http.wasm.v3.Wasm"));
        assert!(!out.contains("filters.http.ext_proc") && !out.contains("kvgate_epp"));
        let baseline = render(&config, &EnvoyOptions { picker: Picker::None, ..options() }).unwrap();
        assert!(!baseline.contains("filters.http.wasm") && baseline.contains("envoy.filters.http.router"));
        assert!(!baseline.contains("kvgate_scorer") && !baseline.contains("filters.http.ext_proc"));
        assert!(out.contains("type: STATIC") && !out.contains("dns_lookup_family"));
        let no_epp = render(&config, &EnvoyOptions { picker: Picker::Epp, ..options() });
        assert!(no_epp.unwrap_err().contains("epp"), "the picker needs its section");
    }

    #[test]
    fn traces_turn_the_gateways_tracer_on_towards_the_same_receiver() {
        let pods = "pods:\n  - {name: a, address: '10.0.0.1:8000'}\n";
        let plain = render(&Config::parse(pods).unwrap(), &options()).unwrap();
        assert!(!plain.contains("tracing:") && !plain.contains("kvgate_otlp") && !plain.contains("gateway-span"));
        assert!(!plain.contains("\"traces\""));
        let traced =
            Config::parse(&format!("traces: {{otlp_endpoint: 'http://otel.obs:4317', sample_ratio: 0.01}}\n{pods}"))
                .unwrap();
        for picker in [Picker::Wasm, Picker::Native, Picker::Epp] {
            let config = Config { epp: Some(Default::default()), ..traced.clone() };
            let out = render(&config, &EnvoyOptions { picker, ..options() }).unwrap();
            assert!(!out.contains("${"), "{out}");
            assert!(out.contains("random_sampling: { value: 1 }") && out.contains("envoy.tracers.opentelemetry"));
            assert!(out.contains("socket_address: { address: otel.obs, port_value: 4317 }"), "{out}");
            assert!(out.contains("service_name: kvgate-gateway"));
            // The in-proxy filters learn the gateway's span from a filter placed before them.
            let in_proxy = picker != Picker::Epp;
            assert_eq!(out.contains("x-kvgate-gateway-span"), in_proxy, "{picker:?}");
            assert_eq!(out.contains("\"traces\":true"), in_proxy, "{picker:?}");
        }
    }

    #[test]
    fn the_endpoint_picker_path_routes_on_its_metadata() {
        let config = Config::parse(
            "epp: {listen: '0.0.0.0:9102', tls: {mode: plaintext}}\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n",
        )
        .unwrap();
        let epp =
            |mode| render(&config, &EnvoyOptions { picker: Picker::Epp, epp_body_mode: mode, ..options() }).unwrap();
        let out = epp(EppBodyMode::FullDuplex);
        assert!(!out.contains("${") && !out.contains("filters.http.wasm") && !out.contains("kvgate_scorer"), "{out}");
        assert!(out.contains("request_body_mode: FULL_DUPLEX_STREAMED") && out.contains("failure_mode_allow: false"));
        assert!(out.contains("socket_address: { address: 127.0.0.1, port_value: 9102 }"), "loopback to 0.0.0.0");
        assert!(!out.contains("UpstreamTlsContext") && !out.contains("send_body_without_waiting"));
        assert!(
            out.contains("path: [{ key: x-gateway-destination-endpoint }]") && !out.contains("- header: x-gateway"),
            "routed on the picker's metadata alone"
        );
        let buffered = epp(EppBodyMode::Buffered);
        assert!(buffered.contains("request_body_mode: BUFFERED") && buffered.contains("response_body_mode: STREAMED"));
        assert!(epp(EppBodyMode::Streamed).contains("send_body_without_waiting_for_header_response: true"));
        for mode in [EppBodyMode::Streamed, EppBodyMode::Buffered, EppBodyMode::FullDuplex] {
            assert!(epp(mode).contains("response_header_mode: SEND"), "{mode:?}: the picker sees each answer's status");
        }
        let tls = Config::parse("epp: {}\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n").unwrap();
        let out = render(&tls, &EnvoyOptions { picker: Picker::Epp, ..options() }).unwrap();
        assert!(out.contains("UpstreamTlsContext") && out.contains("sni: kvgate-epp"));
        let queued = Config::parse(
            "admission: {max_waiting: 8, max_wait_ms: 3000}\npods:\n  - {name: a, address: '10.0.0.1:8000'}\n",
        )
        .unwrap();
        let wasm = render(&queued, &options()).unwrap();
        assert!(wasm.contains("\"scorer_timeout_ms\":3050"), "the decision may wait in the queue: {wasm}");
    }

    #[test]
    fn dns_discovery_makes_the_pods_cluster_resolve_the_same_name() {
        let config = Config::parse(
            "discovery:\n  dns:\n    - {name: vllm.inference.svc.cluster.local, port: 8000, interval_seconds: 2}\n    - {name: vllm-prefill.inference.svc.cluster.local, port: 8000, role: prefill}\npods: []\n",
        )
        .unwrap();
        let out = render(&config, &options()).unwrap();
        assert!(!out.contains("${"), "{out}");
        assert!(out.contains("name: envoy.clusters.dns\n") && out.contains("dns_refresh_rate: 2s\n"), "{out}");
        assert!(out.contains("socket_address: { address: vllm.inference.svc.cluster.local, port_value: 8000 }"));
        assert!(
            out.contains("socket_address: { address: vllm-prefill.inference.svc.cluster.local, port_value: 8000 }")
        );
    }
}
