//! Everything under `deploy/` is checked by the tools that would reject it in production:
//! Kubernetes manifests against the Kubernetes schemas (`kubernetes-validate --strict`), the
//! scorer's ConfigMap by the scorer's own parser, the Envoy bootstrap by rendering it again
//! from that configuration and by the real `envoy --mode validate`, the Istio EnvoyFilter's
//! patches assembled into a bootstrap that Envoy validates, the Dockerfiles by hadolint.
//! Each tool is also shown to reject a broken input. (No Docker engine or cluster exists
//! here: nothing is built or applied.)

use kvgate_scorer::config::{Config, Role};
use kvgate_test_harness::{binary, envoy_validate, filter_native, filter_wasm, root, venv_bin};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

fn deploy(path: &str) -> PathBuf {
    root().join("deploy").join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("deploy/{path}: {e}"))
}

/// Every document of a YAML file.
fn documents(path: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(&read(path)).unwrap_or_else(|e| panic!("deploy/{path}: {e}"))
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Runs a tool; Ok(output) on success, Err(output) on failure.
fn run(mut cmd: Command) -> Result<String, String> {
    let out = cmd.output().expect("run tool");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() { Ok(text) } else { Err(text) }
}

fn kubernetes_validate(files: &[PathBuf]) -> Result<String, String> {
    let mut cmd = Command::new(venv_bin("kubernetes-validate"));
    cmd.arg("--strict").args(files);
    run(cmd)
}

fn hadolint(files: &[PathBuf]) -> Result<String, String> {
    let mut cmd = Command::new(venv_bin("hadolint"));
    cmd.args(files);
    run(cmd)
}

const MANIFESTS: [&str; 11] = [
    "base/namespace.yaml",
    "base/nats.yaml",
    "base/rbac.yaml",
    "base/vllm.yaml",
    "base/vllm-pd.yaml",
    "envoy/gateway.yaml",
    "istio/gateway.yaml",
    "istio/envoyfilter.yaml",
    "istio/gateway-api.yaml",
    "gateway-api/epp.yaml",
    "gateway-api/gateway.yaml",
];

#[test]
fn kubernetes_manifests_pass_the_kubernetes_schemas() {
    let files: Vec<PathBuf> = MANIFESTS.iter().map(|f| deploy(f)).collect();
    let report = kubernetes_validate(&files).unwrap_or_else(|e| panic!("kubernetes-validate:\n{e}"));
    let core = [
        "namespace/inference",
        "deployment/vllm",
        "service/vllm",
        "deployment/vllm-prefill",
        "deployment/vllm-decode",
        "deployment/kvgate-gateway",
        "service/kvgate-gateway",
        "poddisruptionbudget/kvgate-gateway",
        "service/vllm-lb",
        "serviceaccount/kvgate-gateway",
        "role/kvgate-scorer-pods",
        "rolebinding/kvgate-scorer-pods",
        "serviceaccount/kvgate-epp",
        "role/kvgate-epp",
        "rolebinding/kvgate-epp",
        "service/kvgate-epp",
        "deployment/kvgate-epp",
        "poddisruptionbudget/kvgate-epp",
        "deployment/nats",
        "service/nats",
    ];
    for kind in core {
        assert!(report.contains(&format!("passed for resource {kind}")), "{kind} not validated:\n{report}");
    }
    // The only resources without a Kubernetes schema are the Istio and Gateway API CRs,
    // checked by the other tests of this file (the InferencePool against its CRD).
    let unchecked: Vec<&str> = report.lines().filter(|l| l.contains("Couldn't find schema")).collect();
    for line in &unchecked {
        assert!(
            ["kind Gateway ", "kind VirtualService ", "kind EnvoyFilter ", "kind HTTPRoute ", "kind DestinationRule "]
                .iter()
                .any(|k| line.contains(k)),
            "unexpected resource without schema: {line}"
        );
    }
    assert_eq!(unchecked.len(), 8, "{report}");

    // Every file a kustomization names exists.
    for dir in ["base", "envoy", "istio", "gateway-api"] {
        let k = documents(&format!("{dir}/kustomization.yaml"));
        let names = k[0]["resources"].as_array().into_iter().flatten().chain(
            k[0]["configMapGenerator"].as_array().into_iter().flatten().flat_map(|g| g["files"].as_array().unwrap()),
        );
        for name in names {
            let path = deploy(dir).join(name.as_str().unwrap());
            assert!(path.exists(), "{dir}/kustomization.yaml names {}", path.display());
        }
    }

    // The check can fail: a misspelt field is rejected.
    let broken = std::env::temp_dir().join(format!("kvgate-broken-{}.yaml", std::process::id()));
    std::fs::write(&broken, read("base/vllm.yaml").replace("replicas: 4", "replica: 4")).unwrap();
    let result = kubernetes_validate(std::slice::from_ref(&broken));
    std::fs::remove_file(&broken).unwrap();
    assert!(result.is_err(), "a misspelt field must fail: {result:?}");
}

#[test]
fn the_scorer_configmap_parses_and_the_envoy_bootstrap_matches_it_and_validates() {
    let config = Config::parse(&read("base/scorer.yaml")).expect("the scorer's parser accepts it");
    assert_eq!(config.listen.to_string(), "127.0.0.1:7070", "the sidecar listens on loopback only");
    let dns = &config.discovery.dns[0];
    assert_eq!((dns.name.as_str(), dns.port, dns.role), ("vllm.inference.svc.cluster.local", 8000, Role::Both));
    assert_eq!(config.admin.listen.map(|a| a.port()), Some(9090), "probes and metrics on the admin port");
    // The gateway's replicas share their bookings over the NATS Service of base/nats.yaml.
    let gateway = documents("envoy/gateway.yaml");
    assert!(find(&gateway, "Deployment", "kvgate-gateway")["spec"]["replicas"].as_u64().unwrap() >= 2);
    let sync = config.sync.as_ref().expect("sync is configured");
    let nats = documents("base/nats.yaml");
    let nats_port = find(&nats, "Service", "nats")["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(sync.nats, format!("nats://nats.inference.svc.cluster.local:{nats_port}"));
    assert_eq!(sync.replica_id, None, "each replica is named by its pod ($HOSTNAME)");
    // The headless Service it resolves exists with those ports.
    let vllm = documents("base/vllm.yaml");
    let service = find(&vllm, "Service", "vllm");
    assert_eq!(service["spec"]["clusterIP"], "None", "discovery needs a headless Service");
    let ports: Vec<u64> =
        service["spec"]["ports"].as_array().unwrap().iter().map(|p| p["port"].as_u64().unwrap()).collect();
    assert_eq!(ports, [8000, 5557, 5558]);

    // The committed bootstrap is exactly what kvgate-envoy-config renders from it.
    let rendered = std::env::temp_dir().join(format!("kvgate-deploy-envoy-{}.yaml", std::process::id()));
    let status = Command::new(binary("kvgate-envoy-config"))
        .arg("--scorer-config")
        .arg(deploy("base/scorer.yaml"))
        .args(["--picker", "native", "--native-module", "/var/lib/kvgate/filter/libkvgate_filter_native.so"])
        .args(["--listen", "0.0.0.0:8080", "--admin", "127.0.0.1:9901"])
        .arg("--out")
        .arg(&rendered)
        .status()
        .unwrap();
    assert!(status.success());
    let fresh = std::fs::read_to_string(&rendered).unwrap();
    assert!(read("envoy/envoy.yaml") == fresh, "deploy/envoy/envoy.yaml is stale: re-render it (deploy/README.md)");
    // Envoy accepts it, with the module's path pointing at the module built here.
    std::fs::write(
        &rendered,
        fresh.replace("/var/lib/kvgate/filter/libkvgate_filter_native.so", &filter_native().display().to_string()),
    )
    .unwrap();
    let result = envoy_validate(&rendered);
    std::fs::write(&rendered, "static_resources: {clusters: [{name: x, type: STRICT_DNS, lb_policy: NOPE}]}\n")
        .unwrap();
    let broken = envoy_validate(&rendered);
    std::fs::remove_file(&rendered).unwrap();
    result.unwrap_or_else(|e| panic!("envoy --mode validate:\n{e}"));
    assert!(broken.is_err(), "envoy --mode validate rejects a broken bootstrap");
}

/// Istio's name for the cluster of `host:port`.
fn istio_cluster(host: &str, port: u64) -> String {
    format!("outbound|{port}||{host}")
}

#[test]
fn the_istio_envoyfilter_patches_assemble_into_a_bootstrap_envoy_accepts() {
    let filter = documents("istio/envoyfilter.yaml").remove(0);
    let patches = filter["spec"]["configPatches"].as_array().unwrap();
    let patch = |apply_to: &str, op: &str| {
        patches
            .iter()
            .find(|p| p["applyTo"] == apply_to && p["patch"]["operation"] == op)
            .unwrap_or_else(|| panic!("no {apply_to} {op} patch"))
    };
    let http_filter = patch("HTTP_FILTER", "INSERT_BEFORE");
    assert_eq!(
        http_filter["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        "envoy.filters.http.router"
    );
    let wasm = &http_filter["patch"]["value"];
    assert_eq!(wasm["typed_config"]["config"]["allow_on_headers_stop_iteration"], true);
    let scorer_cluster = &patch("CLUSTER", "ADD")["patch"]["value"];
    let merge = patch("CLUSTER", "MERGE");

    // The pieces agree with each other and with the routes: the filter calls the scorer
    // cluster the EnvoyFilter adds, sends prefill legs to the cluster whose LB policy it
    // patches, and that is the cluster both Istio's VirtualService and the HTTPRoute use.
    let host = merge["match"]["cluster"]["service"].as_str().unwrap();
    let port = merge["match"]["cluster"]["portNumber"].as_u64().unwrap();
    let pods_cluster = istio_cluster(host, port);
    let plugin: Value =
        serde_json::from_str(wasm["typed_config"]["config"]["configuration"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(plugin["scorer_cluster"], scorer_cluster["name"]);
    let options =
        &scorer_cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
    assert!(
        options["explicit_http_config"]["http2_protocol_options"].is_object(),
        "the filter's route stream (gRPC) needs HTTP/2 to the scorer: {scorer_cluster}"
    );
    assert_eq!(plugin["pods_cluster"], pods_cluster.as_str());
    let istio = documents("istio/gateway.yaml");
    let route = &find(&istio, "VirtualService", "kvgate")["spec"]["http"][0]["route"][0]["destination"];
    assert_eq!((route["host"].as_str(), route["port"]["number"].as_u64()), (Some(host), Some(port)));
    let deployment = find(&istio, "Deployment", "kvgate-gateway");
    assert_eq!(
        deployment["spec"]["template"]["metadata"]["labels"]["istio"],
        filter["spec"]["workloadSelector"]["labels"]["istio"]
    );
    let gateway_api = documents("istio/gateway-api.yaml");
    let backend = &find(&gateway_api, "HTTPRoute", "kvgate")["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(format!("{}.inference.svc.cluster.local", backend["name"].as_str().unwrap()), host);
    assert_eq!(backend["port"].as_u64(), Some(port));
    let lb_service = find(&istio, "Service", "vllm-lb");
    assert!(lb_service["spec"]["clusterIP"].is_null(), "Istio gives headless Services passthrough clusters");

    // A gateway as Istio would build it: a listener with the patched filter chain, the added
    // scorer cluster, and a stand-in for Istio's EDS cluster with the MERGE applied.
    let wasm_path = filter_wasm().display().to_string();
    let mut wasm = wasm.clone();
    wasm["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = json!(wasm_path);
    let mut pods = json!({
        "name": pods_cluster, "type": "STATIC", "connect_timeout": "1s", "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": pods_cluster, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "10.0.0.1", "port_value": port}}}}]}]}
    });
    for (k, v) in merge["patch"]["value"].as_object().unwrap() {
        pods[k] = v.clone();
    }
    let bootstrap = json!({"static_resources": {
        "listeners": [{"name": "gateway", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8080}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "gateway",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                    {"match": {"prefix": "/v1/"}, "route": {"cluster": pods_cluster, "timeout": "0s"}}]}]},
                "http_filters": [wasm, {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}],
        "clusters": [scorer_cluster, pods]}});
    let path = std::env::temp_dir().join(format!("kvgate-istio-{}.json", std::process::id()));
    std::fs::write(&path, serde_json::to_string_pretty(&bootstrap).unwrap()).unwrap();
    let result = envoy_validate(&path);
    std::fs::remove_file(&path).unwrap();
    result.unwrap_or_else(|e| panic!("envoy --mode validate on the assembled Istio patches:\n{e}"));
}

/// The InferencePool CRD kept in tests/fixtures/gie (GIE's, unmodified): its schema
/// validates manifests by `tests/tools/crd_validate.py`.
fn crd_validate(files: &[PathBuf]) -> Result<String, String> {
    let mut cmd = Command::new(kvgate_test_harness::python());
    cmd.arg(root().join("tests/tools/crd_validate.py"))
        .arg(root().join("tests/fixtures/gie/inference.networking.k8s.io_inferencepools.yaml"))
        .args(files);
    run(cmd)
}

#[test]
fn the_inference_pool_names_kvgates_picker_and_the_pieces_agree() {
    // The pool passes the InferencePool v1 CRD's schema; a broken one does not.
    let report = crd_validate(&[deploy("gateway-api/inferencepool.yaml")]).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.contains("valid: InferencePool/vllm"), "{report}");
    let broken = std::env::temp_dir().join(format!("kvgate-broken-pool-{}.yaml", std::process::id()));
    std::fs::write(
        &broken,
        read("gateway-api/inferencepool.yaml").replace("failureMode: FailOpen", "failureMode: Maybe"),
    )
    .unwrap();
    let result = crd_validate(std::slice::from_ref(&broken));
    std::fs::remove_file(&broken).unwrap();
    assert!(result.as_ref().is_err_and(|e| e.contains("failureMode")), "{result:?}");
    let pool = documents("gateway-api/inferencepool.yaml").remove(0);
    let spec = &pool["spec"];
    // The CRD's CEL rules (not evaluated by JSON Schema): a Service reference has a port, and
    // target ports are unique.
    let picker = &spec["endpointPickerRef"];
    assert!(picker["kind"] != "Service" || picker["port"]["number"].is_u64());
    let ports: Vec<u64> =
        spec["targetPorts"].as_array().unwrap().iter().map(|p| p["number"].as_u64().unwrap()).collect();
    assert_eq!(ports.iter().collect::<std::collections::BTreeSet<_>>().len(), ports.len());

    // The picker's configuration: the scorer's parser accepts it, it serves the port the pool
    // names, and it discovers exactly this pool.
    let config = Config::parse(&read("gateway-api/scorer.yaml")).expect("the scorer's parser accepts it");
    let epp = config.epp.as_ref().expect("the Endpoint Picker is on");
    assert_eq!(Some(u64::from(epp.listen.port())), picker["port"]["number"].as_u64());
    let discovered = config.discovery.inference_pool.as_ref().expect("InferencePool discovery");
    assert_eq!(
        (discovered.namespace.as_str(), discovered.name.as_str()),
        ("inference", pool["metadata"]["name"].as_str().unwrap())
    );
    // The Service the pool names exists, on that port, in front of the picker's pods; the
    // Role lets it watch pods and pools.
    let epp_docs = documents("gateway-api/epp.yaml");
    let service = find(&epp_docs, "Service", picker["name"].as_str().unwrap());
    let grpc =
        service["spec"]["ports"].as_array().unwrap().iter().find(|p| p["port"] == picker["port"]["number"]).unwrap();
    let deployment = find(&epp_docs, "Deployment", "kvgate-epp");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let named = container["ports"].as_array().unwrap().iter().find(|p| p["name"] == grpc["targetPort"]).unwrap();
    assert_eq!(named["containerPort"].as_u64(), Some(u64::from(epp.listen.port())));
    assert_eq!(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]);
    let rules = &find(&epp_docs, "Role", "kvgate-epp")["rules"];
    for (group, resource) in [("", "pods"), ("inference.networking.k8s.io", "inferencepools")] {
        assert!(
            rules.as_array().unwrap().iter().any(|r| r["apiGroups"][0] == group && r["resources"][0] == resource),
            "the picker may watch {resource}"
        );
    }
    // The pool selects the vLLM pods and their HTTP port.
    let vllm = find(&documents("base/vllm.yaml"), "Deployment", "vllm").clone();
    let labels = &vllm["spec"]["template"]["metadata"]["labels"];
    for (k, v) in spec["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the pool selects the vLLM pods");
    }
    let vllm_ports = &vllm["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert!(
        ports.iter().all(|p| vllm_ports.as_array().unwrap().iter().any(|c| c["containerPort"].as_u64() == Some(*p)))
    );
    // The route sends the OpenAI paths to the pool; Istio dials the picker over TLS.
    let gateway = documents("gateway-api/gateway.yaml");
    let backend = &find(&gateway, "HTTPRoute", "vllm")["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!((backend["kind"].as_str(), backend["name"].as_str()), (Some("InferencePool"), Some("vllm")));
    let rule = find(&gateway, "DestinationRule", "kvgate-epp");
    assert_eq!(rule["spec"]["host"], "kvgate-epp.inference.svc.cluster.local");
    assert_eq!(rule["spec"]["trafficPolicy"]["tls"]["mode"], "SIMPLE");
}

#[test]
fn dockerfiles_pass_hadolint() {
    let dockerfiles = [
        deploy("docker/scorer.Dockerfile"),
        deploy("docker/filter.Dockerfile"),
        deploy("docker/filter-native.Dockerfile"),
    ];
    hadolint(&dockerfiles).unwrap_or_else(|e| panic!("hadolint:\n{e}"));
    let scorer = read("docker/scorer.Dockerfile");
    assert!(scorer.contains("\nUSER 65532:65532\n"), "the scorer image runs as non-root");
    assert_eq!(scorer.lines().filter(|l| l.starts_with("FROM ")).count(), 2, "multi-stage");
    let filter = read("docker/filter.Dockerfile");
    assert!(filter.contains("FROM scratch") && filter.contains(" /plugin.wasm"), "Istio's OCI wasm layout");
    let native = read("docker/filter-native.Dockerfile");
    assert!(
        native.contains("FROM scratch") && native.contains(" /libkvgate_filter_native.so"),
        "the module at the root"
    );
    assert!(root().join(".dockerignore").is_file(), "the build context leaves target/ out");

    // The check can fail: an untagged base image is flagged.
    let broken = std::env::temp_dir().join(format!("kvgate-broken-{}.Dockerfile", std::process::id()));
    std::fs::write(&broken, "FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n").unwrap();
    let result = hadolint(std::slice::from_ref(&broken));
    std::fs::remove_file(&broken).unwrap();
    assert!(result.is_err(), "hadolint flags a sloppy Dockerfile: {result:?}");
}
