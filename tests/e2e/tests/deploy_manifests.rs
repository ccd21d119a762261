//! Everything under `deploy/` is checked by the tools that would reject it in production:
//! each overlay rendered alone by kustomize (`kubectl kustomize`) and every resource against
//! the Kubernetes schemas (`kubernetes-validate --strict`), the scorer's ConfigMaps by the
//! scorer's own parser, the shipped NATS configuration by a real `nats-server`, the Envoy
//! bootstrap by rendering it again from that configuration and by the real `envoy --mode
//! validate`, the Istio EnvoyFilter's patches assembled into a bootstrap that Envoy
//! validates, the Dockerfiles by hadolint. What a security review asks of the shipped
//! configuration (debug endpoints off, admin interfaces unexposed, NATS authenticated,
//! NetworkPolicies that admit only the right pods) is asserted on the rendered resources.
//! (No Docker engine or cluster exists here: nothing is built or applied.)

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

const MANIFESTS: [&str; 12] = [
    "base/namespace.yaml",
    "nats/nats.yaml",
    "base/rbac.yaml",
    "base/vllm.yaml",
    "base/vllm-pd.yaml",
    "envoy/gateway.yaml",
    "istio/gateway.yaml",
    "istio/envoyfilter.yaml",
    "istio/gateway-api.yaml",
    "istio/telemetry.yaml",
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
        "configmap/nats",
        "networkpolicy/nats",
        "networkpolicy/kvgate-epp",
    ];
    for kind in core {
        assert!(report.contains(&format!("passed for resource {kind}")), "{kind} not validated:\n{report}");
    }
    // The only resources without a Kubernetes schema are the Istio and Gateway API CRs,
    // checked by the other tests of this file (the InferencePool against its CRD).
    let unchecked: Vec<&str> = report.lines().filter(|l| l.contains("Couldn't find schema")).collect();
    for line in &unchecked {
        assert!(
            [
                "kind Gateway ",
                "kind VirtualService ",
                "kind EnvoyFilter ",
                "kind HTTPRoute ",
                "kind DestinationRule ",
                "kind Telemetry ",
            ]
            .iter()
            .any(|k| line.contains(k)),
            "unexpected resource without schema: {line}"
        );
    }
    assert_eq!(unchecked.len(), 9, "{report}");

    // Every file a kustomization names exists.
    for dir in ["base", "nats", "sidecar", "envoy", "istio", "gateway-api"] {
        let k = documents(&format!("{dir}/kustomization.yaml"));
        let names = k[0]["resources"].as_array().into_iter().flatten().chain(
            k[0]["configMapGenerator"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["files"].as_array().into_iter().flatten()),
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
    let config = Config::parse(&read("sidecar/scorer.yaml")).expect("the scorer's parser accepts it");
    assert_eq!(config.listen.to_string(), "127.0.0.1:7070", "the sidecar listens on loopback only");
    let dns = &config.discovery.dns[0];
    assert_eq!((dns.name.as_str(), dns.port, dns.role), ("vllm.inference.svc.cluster.local", 8000, Role::Both));
    assert_eq!(config.admin.listen.map(|a| a.port()), Some(9090), "probes and metrics on the admin port");
    // The gateway's replicas share their bookings over the NATS Service of nats/nats.yaml.
    let gateway = documents("envoy/gateway.yaml");
    assert!(find(&gateway, "Deployment", "kvgate-gateway")["spec"]["replicas"].as_u64().unwrap() >= 2);
    let sync = config.sync.as_ref().expect("sync is configured");
    let nats = documents("nats/nats.yaml");
    let nats_port = find(&nats, "Service", "nats")["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(sync.nats.to_string(), format!("nats://nats.inference.svc.cluster.local:{nats_port}"));
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
        .arg(deploy("sidecar/scorer.yaml"))
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
    // The gateway's span named for the filter, by a filter placed before it.
    let span_patch = (patches.iter())
        .find(|p| p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == wasm["name"])
        .expect("a patch placing a filter before kvgate's");
    assert_eq!(span_patch["patch"]["operation"], "INSERT_BEFORE");
    let span_filter = &span_patch["patch"]["value"];
    let mutation = &span_filter["typed_config"]["mutations"]["request_mutations"][0]["append"]["header"];
    assert_eq!(
        (&mutation["key"], &mutation["value"]),
        (&json!("x-kvgate-gateway-span"), &json!("%TRACE_ID%-%SPAN_ID%"))
    );
    let telemetry = documents("istio/telemetry.yaml").remove(0);
    assert_eq!(
        telemetry["spec"]["selector"]["matchLabels"]["istio"], filter["spec"]["workloadSelector"]["labels"]["istio"],
        "the gateway's tracing is turned on where the filter runs"
    );
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
    assert_eq!(plugin["traces"], true, "the filter reads the span the filter before it names");
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
                "http_filters": [span_filter, wasm, {"name": "envoy.filters.http.router", "typed_config": {
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
    validate_by_crd("gie/inference.networking.k8s.io_inferencepools.yaml", files)
}

/// Validates `files` by the schema of a CRD kept in tests/fixtures (`tests/tools/crd_validate.py`).
fn validate_by_crd(crd: &str, files: &[PathBuf]) -> Result<String, String> {
    let mut cmd = Command::new(kvgate_test_harness::python());
    cmd.arg(root().join("tests/tools/crd_validate.py")).arg(root().join("tests/fixtures").join(crd)).args(files);
    run(cmd)
}

#[test]
fn the_autoscaling_examples_pass_their_schemas_and_scale_the_pool() {
    // The HPA against Kubernetes' schema, the ScaledObject against KEDA's CRD (KEDA's own file);
    // a broken one of each is refused.
    let hpa = deploy("autoscaling/hpa.yaml");
    let report = kubernetes_validate(std::slice::from_ref(&hpa)).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.contains("passed for resource horizontalpodautoscaler/vllm"), "{report}");
    const KEDA: &str = "keda/keda.sh_scaledobjects.yaml";
    let report =
        validate_by_crd(KEDA, &[deploy("autoscaling/keda-scaledobject.yaml")]).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.contains("valid: ScaledObject/vllm"), "{report}");
    let broken = std::env::temp_dir().join(format!("kvgate-broken-autoscaling-{}.yaml", std::process::id()));
    for (file, from, to, why) in [
        ("autoscaling/keda-scaledobject.yaml", "threshold: \"0.2\"", "threshold: 0.2", "is not of type 'string'"),
        ("autoscaling/hpa.yaml", "value: 200m", "valeu: 200m", "valeu"),
    ] {
        std::fs::write(&broken, read(file).replacen(from, to, 1)).unwrap();
        let result = match file.ends_with("hpa.yaml") {
            true => kubernetes_validate(std::slice::from_ref(&broken)),
            false => validate_by_crd(KEDA, std::slice::from_ref(&broken)),
        };
        assert!(result.as_ref().is_err_and(|e| e.contains(why)), "{file} with {to}: {result:?}");
    }
    std::fs::remove_file(&broken).unwrap();
    // Both scale the pool's Deployment, in its namespace.
    let vllm = find(&documents("base/vllm.yaml"), "Deployment", "vllm").clone();
    for (file, target) in
        [("autoscaling/hpa.yaml", "scaleTargetRef"), ("autoscaling/keda-scaledobject.yaml", "scaleTargetRef")]
    {
        let doc = documents(file).remove(0);
        assert_eq!(doc["spec"][target]["name"], vllm["metadata"]["name"], "{file}");
        assert_eq!(doc["metadata"]["namespace"], vllm["metadata"]["namespace"], "{file}");
    }
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

    // The example objectives pass their CRD's schema and name this pool.
    let objectives_crd = "gie/inference.networking.x-k8s.io_inferenceobjectives.yaml";
    let report =
        validate_by_crd(objectives_crd, &[deploy("gateway-api/objectives.yaml")]).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.contains("valid: InferenceObjective/interactive"), "{report}");
    for objective in documents("gateway-api/objectives.yaml") {
        assert_eq!(objective["spec"]["poolRef"]["name"], pool["metadata"]["name"]);
    }
    // So do the example model rewrites, and the scorer reads each rule as kvgate applies it.
    let rewrites_crd = "gie/inference.networking.x-k8s.io_inferencemodelrewrites.yaml";
    let report =
        validate_by_crd(rewrites_crd, &[deploy("gateway-api/model-rewrites.yaml")]).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.contains("valid: InferenceModelRewrite/aliases"), "{report}");
    let served = documents("base/kustomization.yaml")[0]["configMapGenerator"][0]["literals"][0]
        .as_str()
        .and_then(|l| l.strip_prefix("MODEL="))
        .expect("the served model")
        .to_string();
    for rewrite in documents("gateway-api/model-rewrites.yaml") {
        let pool_name = pool["metadata"]["name"].as_str().unwrap();
        let rules = kvgate_scorer::discovery::inference_pool::model_rewrite_rules(&rewrite, pool_name)
            .expect("the pool's")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(rules.iter().flat_map(|r| &r.targets).all(|t| t.model == served), "every target is served");
    }

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
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let selector = service["spec"]["selector"].as_object().unwrap();
    assert!(selector.iter().all(|(k, v)| &labels[k] == v), "the Service selects the picker's pods");
    let rules = &find(&epp_docs, "Role", "kvgate-epp")["rules"];
    let watched = [
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"),
        ("inference.networking.x-k8s.io", "inferencemodelrewrites"),
    ];
    for (group, resource) in watched {
        let lists = |r: &Value| r["resources"].as_array().is_some_and(|all| all.iter().any(|x| x == resource));
        assert!(
            rules.as_array().unwrap().iter().any(|r| r["apiGroups"][0] == group && lists(r)),
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

/// The overlays a user applies, each on its own.
const OVERLAYS: [&str; 4] = ["envoy", "istio", "gateway-api", "two-models"];

/// `kubectl kustomize deploy/<overlay>`: every resource the overlay applies.
fn render(overlay: &str) -> (String, Vec<Value>) {
    let mut cmd = Command::new(venv_bin("kubectl"));
    cmd.arg("kustomize").arg(deploy(overlay));
    let yaml = run(cmd).unwrap_or_else(|e| panic!("kubectl kustomize deploy/{overlay}:\n{e}"));
    let docs = serde_saphyr::from_multiple::<Value>(&yaml).unwrap_or_else(|e| panic!("deploy/{overlay}: {e}"));
    (yaml, docs)
}

/// Every pod template of the rendered resources, with the name of what holds it.
fn pod_specs(docs: &[Value]) -> Vec<(String, &Value)> {
    docs.iter()
        .filter(|d| d["kind"] == "Deployment")
        .map(|d| (d["metadata"]["name"].as_str().unwrap().to_string(), &d["spec"]["template"]))
        .collect()
}

/// Every image a pod template names: containers, init containers, image volumes.
fn images(template: &Value) -> Vec<String> {
    let spec = &template["spec"];
    let containers =
        ["initContainers", "containers"].into_iter().flat_map(|k| spec[k].as_array().into_iter().flatten());
    let volumes = spec["volumes"].as_array().into_iter().flatten().filter_map(|v| v["image"]["reference"].as_str());
    containers.filter_map(|c| c["image"].as_str()).chain(volumes).map(str::to_string).collect()
}

#[test]
fn every_overlay_renders_alone_validates_and_brings_only_what_it_uses() {
    for overlay in OVERLAYS {
        let (yaml, docs) = render(overlay);
        let file = std::env::temp_dir().join(format!("kvgate-render-{overlay}-{}.yaml", std::process::id()));
        std::fs::write(&file, &yaml).unwrap();
        let report = kubernetes_validate(std::slice::from_ref(&file));
        std::fs::remove_file(&file).unwrap();
        let report = report.unwrap_or_else(|e| panic!("deploy/{overlay} rendered:\n{e}"));
        assert!(report.contains("passed for resource deployment/vllm"), "{overlay}: {report}");

        let has = |kind: &str, name: &str| docs.iter().any(|d| d["kind"] == kind && d["metadata"]["name"] == name);
        let sidecars = !matches!(overlay, "gateway-api" | "two-models");
        assert!(has("Deployment", "nats"), "{overlay}: the replicas (gateways or pickers) sync over NATS");
        assert_eq!(has("ConfigMap", "kvgate-scorer"), sidecars, "{overlay}: the sidecars' configuration");
        assert!(has("ConfigMap", "kvgate-model") && has("Deployment", "vllm"), "{overlay}: the pods and their model");

        // One name per kvgate image, from the overlay's `images:`; every image pinned to a tag.
        let kustomization = documents(&format!("{overlay}/kustomization.yaml")).remove(0);
        let wanted: Vec<String> = kustomization["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| format!("{}:{}", i["newName"].as_str().unwrap(), i["newTag"].as_str().unwrap()))
            .collect();
        let mut used = std::collections::BTreeSet::new();
        for (name, template) in pod_specs(&docs) {
            for image in images(template) {
                if image == "auto" {
                    continue; // Istio's injection fills it in
                }
                assert!(
                    image.rsplit_once(':').is_some_and(|(_, tag)| !tag.is_empty() && tag != "latest"),
                    "{overlay}/{name}: {image} is not pinned"
                );
                if image.contains("kvgate") {
                    assert!(
                        wanted.contains(&image),
                        "{overlay}/{name}: {image} is not one of the overlay's images {wanted:?}"
                    );
                    used.insert(image);
                }
            }
        }
        assert_eq!(used.len(), wanted.len(), "{overlay}: every image named in kustomization.yaml is used");

        // Nothing is installed when a pod starts.
        for (name, template) in pod_specs(&docs) {
            let commands = serde_json::to_string(&template["spec"]).unwrap();
            for installer in ["pip install", "apt-get", "apk add", "npm install"] {
                assert!(!commands.contains(installer), "{overlay}/{name} runs {installer} at start");
            }
        }
    }
}

/// The scorer configurations an overlay ships (ConfigMaps holding `scorer.yaml`).
fn scorer_configs(docs: &[Value]) -> Vec<(String, Config)> {
    docs.iter()
        .filter(|d| d["kind"] == "ConfigMap" && d["data"]["scorer.yaml"].is_string())
        .map(|d| {
            let name = d["metadata"]["name"].as_str().unwrap().to_string();
            let config = Config::parse(d["data"]["scorer.yaml"].as_str().unwrap())
                .unwrap_or_else(|e| panic!("ConfigMap {name}: {e}"));
            (name, config)
        })
        .collect()
}

#[test]
fn the_shipped_configs_keep_debug_endpoints_off_admin_unexposed_and_nats_authenticated() {
    for overlay in OVERLAYS {
        let (_, docs) = render(overlay);
        let configs = scorer_configs(&docs);
        assert!(!configs.is_empty(), "{overlay} ships a scorer configuration");
        for (name, config) in &configs {
            assert!(!config.admin.debug_endpoints, "{overlay}/{name}: debug endpoints on");
            assert!(config.listen.ip().is_loopback(), "{overlay}/{name}: the route API beyond loopback");
            if let Some(sync) = &config.sync {
                let token = sync.token_file.as_ref().expect("sync authenticates to NATS");
                // The pods of this configuration (the gateway's sidecars, the pickers) mount
                // the Secret the NATS server takes its token from, where the configuration
                // reads it.
                let (_, pods) = pod_specs(&docs)
                    .into_iter()
                    .find(|(_, t)| {
                        t["spec"]["volumes"].as_array().unwrap().iter().any(|v| v["configMap"]["name"] == name.as_str())
                    })
                    .unwrap_or_else(|| panic!("{overlay}: no pod mounts {name}"));
                let volumes = pods["spec"]["volumes"].as_array().unwrap();
                let secret =
                    volumes.iter().find(|v| v["secret"]["secretName"] == "kvgate-nats").expect("token mounted");
                let mounts = pods["spec"]["containers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["name"] == "scorer" || c["name"] == "epp")
                    .unwrap()["volumeMounts"]
                    .as_array()
                    .unwrap();
                let mount = mounts.iter().find(|m| m["name"] == secret["name"]).unwrap();
                let path = format!(
                    "{}/{}",
                    mount["mountPath"].as_str().unwrap(),
                    secret["secret"]["items"][0]["path"].as_str().unwrap()
                );
                assert_eq!(PathBuf::from(path), *token, "{overlay}: the token file is the mounted Secret");
                let (_, nats) = pod_specs(&docs).into_iter().find(|(n, _)| n == "nats").unwrap();
                let env = &nats["spec"]["containers"][0]["env"][0];
                assert_eq!(env["valueFrom"]["secretKeyRef"]["name"], "kvgate-nats");
                let conf = docs.iter().find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "nats").unwrap();
                let var = format!("token: ${}", env["name"].as_str().unwrap());
                assert!(conf["data"]["nats.conf"].as_str().unwrap().contains(&var), "NATS requires the token");
            }
        }
        // kvgate's pods run unprivileged (the vLLM pods need their GPUs; Istio fills in its proxy).
        for (name, template) in pod_specs(&docs).into_iter().filter(|(n, _)| !n.starts_with("vllm")) {
            let spec = &template["spec"];
            assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{overlay}/{name}: runs as root");
            let containers =
                ["initContainers", "containers"].into_iter().flat_map(|k| spec[k].as_array().into_iter().flatten());
            for c in containers.filter(|c| c["image"] != "auto") {
                let sc = &c["securityContext"];
                let locked = sc["allowPrivilegeEscalation"] == false
                    && sc["readOnlyRootFilesystem"] == true
                    && sc["capabilities"]["drop"] == json!(["ALL"]);
                assert!(locked, "{overlay}/{name}/{}: not locked down: {sc}", c["name"]);
            }
        }
        // Envoy's admin interface stays on loopback.
        for envoy in docs.iter().filter(|d| d["kind"] == "ConfigMap" && d["data"]["envoy.yaml"].is_string()) {
            let bootstrap: Value = serde_saphyr::from_str(envoy["data"]["envoy.yaml"].as_str().unwrap()).unwrap();
            assert_eq!(
                bootstrap["admin"]["address"]["socket_address"]["address"], "127.0.0.1",
                "{overlay}: Envoy's admin"
            );
        }
        // Where a NetworkPolicy guards a port, it admits only pods that exist in the overlay.
        let labels_of = |name: &str| {
            pod_specs(&docs).into_iter().find(|(n, _)| n == name).map(|(_, t)| t["metadata"]["labels"].clone())
        };
        for policy in docs.iter().filter(|d| d["kind"] == "NetworkPolicy") {
            let target = policy["spec"]["podSelector"]["matchLabels"].as_object().unwrap();
            assert!(
                pod_specs(&docs).iter().any(|(_, t)| target.iter().all(|(k, v)| &t["metadata"]["labels"][k] == v)),
                "{overlay}: {} selects no pod",
                policy["metadata"]["name"]
            );
            for rule in policy["spec"]["ingress"].as_array().unwrap() {
                let Some(from) = rule["from"].as_array() else { continue };
                if policy["metadata"]["name"] == "nats" {
                    let pickers = matches!(overlay, "gateway-api" | "two-models");
                    let replicas = if pickers { "kvgate-epp" } else { "kvgate-gateway" };
                    let labels = labels_of(replicas).unwrap();
                    let admitted = from[0]["podSelector"]["matchLabels"].as_object().unwrap();
                    assert!(admitted.iter().all(|(k, v)| &labels[k] == v), "{overlay}: {replicas} reach NATS");
                }
            }
        }
    }
    // Which policies guard what: NATS's client port only from the gateways; the picker's gRPC
    // only from the gateway that owns the pool.
    let (_, istio) = render("istio");
    let nats = istio.iter().find(|d| d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == "nats").unwrap();
    let client = &nats["spec"]["ingress"][0];
    assert_eq!((client["ports"][0]["port"].as_u64(), client["from"].as_array().map(Vec::len)), (Some(4222), Some(1)));
    assert!(nats["spec"]["ingress"].as_array().unwrap().iter().skip(1).all(|r| r["ports"][0]["port"] != 4222));
    let (_, picker) = render("gateway-api");
    let epp = picker.iter().find(|d| d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == "kvgate-epp").unwrap();
    let grpc = &epp["spec"]["ingress"][0];
    assert_eq!(grpc["ports"][0]["port"].as_u64(), Some(9002));
    let gateway = find(&picker, "Gateway", "inference");
    assert_eq!(
        grpc["from"][0]["podSelector"]["matchLabels"]["gateway.networking.k8s.io/gateway-name"],
        gateway["metadata"]["name"]
    );
    assert!(epp["spec"]["ingress"].as_array().unwrap().iter().skip(1).all(|r| r["ports"][0]["port"] != 9002));
    // The plain-Envoy gateway is reachable from outside the cluster, as the README says.
    let (_, envoy) = render("envoy");
    assert_eq!(find(&envoy, "Service", "kvgate-gateway")["spec"]["type"], "LoadBalancer");
}

/// One NATS client handshake on a raw socket: the server's answer to CONNECT + PING.
fn nats_handshake(port: u16, token: Option<&str>) -> String {
    use std::io::{BufRead, BufReader, Write};
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut info = String::new();
    reader.read_line(&mut info).unwrap();
    assert!(info.starts_with("INFO "), "{info}");
    let auth = token.map(|t| format!(",\"auth_token\":\"{t}\"")).unwrap_or_default();
    write!(&stream, "CONNECT {{\"verbose\":false,\"pedantic\":false{auth}}}\r\nPING\r\n").unwrap();
    let mut answer = String::new();
    reader.read_line(&mut answer).unwrap();
    answer.trim().to_string()
}

#[tokio::test]
async fn the_shipped_nats_config_refuses_clients_without_the_token() {
    let (_, docs) = render("envoy");
    let conf = docs.iter().find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "nats").unwrap();
    let path = std::env::temp_dir().join(format!("kvgate-nats-{}.conf", std::process::id()));
    std::fs::write(&path, conf["data"]["nats.conf"].as_str().unwrap()).unwrap();
    let monitor = kvgate_test_harness::free_port().to_string();
    let args = ["-c", path.to_str().unwrap(), "-m", monitor.as_str()];
    let nats = kvgate_test_harness::NatsServer::start_with(&args, &[("NATS_TOKEN", "from-the-secret")]).await;
    let port = nats.port;
    let answers = tokio::task::spawn_blocking(move || {
        [None, Some("guessed"), Some("from-the-secret")].map(|token| nats_handshake(port, token))
    })
    .await
    .unwrap();
    drop(nats);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(answers[0], "-ERR 'Authorization Violation'", "no token");
    assert_eq!(answers[1], "-ERR 'Authorization Violation'", "a wrong token");
    assert_eq!(answers[2], "PONG", "the Secret's token");
}

#[test]
fn the_picker_runs_synced_replicas_that_drain_and_the_gateway_ejects_a_dead_one() {
    let (_, docs) = render("gateway-api");
    let epp = find(&docs, "Deployment", "kvgate-epp");
    assert!(epp["spec"]["replicas"].as_u64().unwrap() >= 2, "more than one picker");
    assert_eq!(epp["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0, "a rollout keeps every replica");
    let labels = &epp["spec"]["template"]["metadata"]["labels"];
    let pdb = find(&docs, "PodDisruptionBudget", "kvgate-epp");
    assert!(pdb["spec"]["minAvailable"].as_u64().unwrap() >= 1, "a drain leaves a picker");
    let selected = pdb["spec"]["selector"]["matchLabels"].as_object().unwrap();
    assert!(selected.iter().all(|(k, v)| &labels[k] == v), "the budget covers the pickers");

    // The replicas share their bookings and drain on SIGTERM within the grace period.
    let (_, config) = scorer_configs(&docs).into_iter().find(|(n, _)| n == "kvgate-epp").unwrap();
    let sync = config.sync.as_ref().expect("the pickers sync");
    assert!(sync.token_file.is_some() && sync.replica_id.is_none(), "authenticated, named by the pod");
    let spec = &epp["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"].as_f64().expect("a preStop sleep");
    let needed = pre_stop + config.shutdown.drain_seconds + config.shutdown.finish_seconds;
    let grace = spec["terminationGracePeriodSeconds"].as_f64().unwrap();
    assert!(config.shutdown.drain_seconds >= 2.0, "the drain outlasts a gateway's notice");
    assert!(grace > needed, "terminationGracePeriodSeconds {grace} covers preStop + drain + finish ({needed})");
    // Readiness is the scorer's own (not ready while draining, joining or catching up).
    let admin = config.admin.listen.unwrap().port();
    let ports = container["ports"].as_array().unwrap();
    let probe = &container["readinessProbe"]["httpGet"];
    assert_eq!(probe["path"], "/readyz");
    assert!(ports.iter().any(|p| p["name"] == probe["port"] && p["containerPort"].as_u64() == Some(admin.into())));

    // The gateway dials the pickers' Service with ejection settings for it.
    let service = find(&docs, "Service", "kvgate-epp");
    let host = format!("{}.{}.svc.cluster.local", service["metadata"]["name"].as_str().unwrap(), "inference");
    let pool = find(&docs, "InferencePool", "vllm");
    assert_eq!(pool["spec"]["endpointPickerRef"]["name"], service["metadata"]["name"]);
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "DestinationRule" && d["spec"]["host"] == host.as_str())
        .expect("a DestinationRule for the picker Service");
    let policy = &rule["spec"]["trafficPolicy"];
    assert_eq!(policy["tls"]["mode"], "SIMPLE");
    let outlier = &policy["outlierDetection"];
    assert_eq!(outlier["consecutiveGatewayErrors"], 1, "one failed exchange ejects a replica");
    assert_eq!(outlier["maxEjectionPercent"], 100, "either of two replicas may be ejected");
    let interval = outlier["interval"].as_str().unwrap();
    let ms: f64 = interval.strip_suffix("ms").and_then(|v| v.parse().ok()).expect("an interval in ms");
    assert!(ms <= 1000.0, "ejections looked at within a second: {interval}");
    assert!(policy["connectionPool"]["tcp"]["connectTimeout"].is_string());
}

#[test]
fn two_models_share_one_pool_and_the_picker_tokenizes_each_as_its_own() {
    let (_, docs) = render("two-models");
    let find_kind = |kind: &str, name: &str| find(&docs, kind, name).clone();
    let pool = find_kind("InferencePool", "vllm");
    let selects = |selector: &Value, labels: &Value| selector.as_object().unwrap().iter().all(|(k, v)| &labels[k] == v);
    let (first, second) = (find_kind("Deployment", "vllm"), find_kind("Deployment", "vllm-second"));
    let labels = |d: &Value| d["spec"]["template"]["metadata"]["labels"].clone();
    let selector = |d: &Value| d["spec"]["selector"]["matchLabels"].clone();
    for d in [&first, &second] {
        assert!(
            selects(&pool["spec"]["selector"]["matchLabels"], &labels(d)),
            "the pool selects {}",
            d["metadata"]["name"]
        );
        assert!(selects(&selector(d), &labels(d)));
    }
    assert!(
        !selects(&selector(&first), &labels(&second)) && !selects(&selector(&second), &labels(&first)),
        "the Deployments' selectors overlap"
    );
    // Each serves its model; the picker has a tokenizer for the second, fetched by an init
    // container into a volume its container mounts.
    let models = &find_kind("ConfigMap", "kvgate-model")["data"];
    let arg = |d: &Value| d["spec"]["template"]["spec"]["containers"][0]["args"][0].as_str().unwrap().to_string();
    assert_eq!((arg(&first), arg(&second)), ("--model=$(MODEL)".into(), "--model=$(SECOND_MODEL)".into()));
    let (_, config) =
        scorer_configs(&docs).into_iter().find(|(name, _)| name == "kvgate-epp").expect("the picker's ConfigMap");
    assert_eq!(config.models.len(), 1);
    assert_eq!(Some(config.models[0].name.as_str()), models["SECOND_MODEL"].as_str());
    assert_ne!(models["SECOND_MODEL"], models["MODEL"]);
    let dir = config.models[0].tokenizer.parent().unwrap().to_str().unwrap().to_string();
    let epp = find_kind("Deployment", "kvgate-epp");
    let spec = &epp["spec"]["template"]["spec"];
    let mounted = |c: &Value| {
        c["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == dir.as_str()).map(|m| m["name"].clone())
    };
    let volume = mounted(&spec["containers"][0]).expect("the picker mounts the second tokenizer's directory");
    let fetcher = (spec["initContainers"].as_array().unwrap().iter())
        .find(|c| mounted(c) == Some(volume.clone()))
        .expect("an init container fills it");
    assert!(fetcher["args"][0].as_str().unwrap().contains("$SECOND_MODEL"));
    assert!(config.discovery.inference_pool.is_some_and(|p| p.name == "vllm"));
}
