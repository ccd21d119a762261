//! Everything under `deploy/` is checked by the tools that would reject it in production:
//! Kubernetes manifests against the Kubernetes schemas (`kubernetes-validate --strict`), the
//! scorer's ConfigMap by the scorer's own parser, the Envoy bootstrap by rendering it again
//! from that configuration and by the real `envoy --mode validate`, the Dockerfiles by
//! hadolint. Each check is also shown to fail on a broken input. (No Docker engine or
//! cluster exists here: nothing is built or applied.)

use kvgate_scorer::config::{Config, Role};
use kvgate_test_harness::{binary, envoy_validate, filter_wasm, root, venv_bin};
use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy(path: &str) -> PathBuf {
    root().join("deploy").join(path)
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

#[test]
fn kubernetes_manifests_pass_the_kubernetes_schemas() {
    let manifests: Vec<PathBuf> = ["namespace.yaml", "vllm.yaml", "vllm-pd.yaml", "gateway.yaml"]
        .iter()
        .map(|f| deploy(&format!("kubernetes/{f}")))
        .collect();
    let report = kubernetes_validate(&manifests).unwrap_or_else(|e| panic!("kubernetes-validate:\n{e}"));
    for kind in [
        "deployment/vllm",
        "deployment/vllm-prefill",
        "deployment/kvgate-gateway",
        "service/vllm",
        "poddisruptionbudget/kvgate-gateway",
    ] {
        assert!(report.contains(&format!("passed for resource {kind}")), "{kind} not validated:\n{report}");
    }
    // Every file kustomization.yaml names exists and is one of those validated (or a config).
    let kustomization = std::fs::read_to_string(deploy("kubernetes/kustomization.yaml")).unwrap();
    for name in ["namespace.yaml", "vllm.yaml", "gateway.yaml", "gateway/scorer.yaml", "gateway/envoy.yaml"] {
        assert!(kustomization.contains(name) && deploy(&format!("kubernetes/{name}")).is_file(), "{name}");
    }

    // The check can fail: a misspelt field is rejected.
    let broken = std::env::temp_dir().join(format!("kvgate-broken-{}.yaml", std::process::id()));
    let text = std::fs::read_to_string(deploy("kubernetes/vllm.yaml")).unwrap().replace("replicas: 4", "replica: 4");
    std::fs::write(&broken, text).unwrap();
    let result = kubernetes_validate(std::slice::from_ref(&broken));
    std::fs::remove_file(&broken).unwrap();
    assert!(result.is_err(), "a misspelt field must fail: {result:?}");
}

#[test]
fn the_scorer_configmap_parses_and_the_envoy_bootstrap_matches_it_and_validates() {
    let scorer_yaml = deploy("kubernetes/gateway/scorer.yaml");
    let config =
        Config::parse(&std::fs::read_to_string(&scorer_yaml).unwrap()).expect("the scorer's parser accepts it");
    assert_eq!(config.listen.to_string(), "127.0.0.1:7070", "the sidecar listens on loopback only");
    let dns = &config.discovery.dns[0];
    assert_eq!((dns.name.as_str(), dns.port, dns.role), ("vllm.inference.svc.cluster.local", 8000, Role::Both));
    assert_eq!(config.admin.listen.map(|a| a.port()), Some(9090), "probes and metrics on the admin port");

    // The committed bootstrap is exactly what kvgate-envoy-config renders from it.
    let rendered = std::env::temp_dir().join(format!("kvgate-deploy-envoy-{}.yaml", std::process::id()));
    let status = Command::new(binary("kvgate-envoy-config"))
        .arg("--scorer-config")
        .arg(&scorer_yaml)
        .args(["--wasm", "/var/lib/kvgate/filter/plugin.wasm", "--listen", "0.0.0.0:8080", "--admin", "127.0.0.1:9901"])
        .arg("--out")
        .arg(&rendered)
        .status()
        .unwrap();
    assert!(status.success());
    let committed = std::fs::read_to_string(deploy("kubernetes/gateway/envoy.yaml")).unwrap();
    let fresh = std::fs::read_to_string(&rendered).unwrap();
    assert!(
        committed == fresh,
        "deploy/kubernetes/gateway/envoy.yaml is stale: re-render it with kvgate-envoy-config (see deploy/README.md)"
    );
    // Envoy accepts it, with the wasm path pointing at the module built here.
    std::fs::write(
        &rendered,
        fresh.replace("/var/lib/kvgate/filter/plugin.wasm", &filter_wasm().display().to_string()),
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

#[test]
fn dockerfiles_pass_hadolint() {
    let dockerfiles = [deploy("docker/scorer.Dockerfile"), deploy("docker/filter.Dockerfile")];
    hadolint(&dockerfiles).unwrap_or_else(|e| panic!("hadolint:\n{e}"));
    let scorer = std::fs::read_to_string(&dockerfiles[0]).unwrap();
    assert!(scorer.contains("\nUSER 65532:65532\n"), "the scorer image runs as non-root");
    assert!(scorer.matches("\nFROM ").count() + usize::from(scorer.starts_with("FROM ")) >= 2, "multi-stage");
    let filter = std::fs::read_to_string(&dockerfiles[1]).unwrap();
    assert!(filter.contains("FROM scratch") && filter.contains(" /plugin.wasm"), "Istio's OCI wasm layout");
    assert!(Path::new(&root().join(".dockerignore")).is_file(), "the build context leaves target/ out");

    // The check can fail: an untagged base image and a root user are flagged.
    let broken = std::env::temp_dir().join(format!("kvgate-broken-{}.Dockerfile", std::process::id()));
    std::fs::write(&broken, "FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n").unwrap();
    let result = hadolint(std::slice::from_ref(&broken));
    std::fs::remove_file(&broken).unwrap();
    assert!(result.is_err(), "hadolint flags a sloppy Dockerfile: {result:?}");
}
