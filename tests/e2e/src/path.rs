//! The three ways Envoy asks kvgate, as the end-to-end tests set each up and read it back.

use kvgate_test_harness::{EPP_PORT, EnvoyProcess};

/// How Envoy asks kvgate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The wasm filter calling the scorer's HTTP API.
    Wasm,
    /// The filter as an Envoy dynamic module, on its own route socket to the scorer.
    Native,
    /// The Endpoint Picker (ext_proc over gRPC, TLS with its self-signed certificate).
    Epp,
}

impl Path {
    /// The scorer configuration this path needs. A body limit given to Envoy
    /// (`--body-limit-bytes`) is the picker's too: in streamed mode Envoy holds a body only
    /// in flow-controlled pieces, so the picker enforces the limit (413).
    pub fn scorer_config(self, envoy_flags: &[&str]) -> String {
        let limit = envoy_flags.windows(2).find(|w| w[0] == "--body-limit-bytes").map(|w| w[1]);
        match (self, limit) {
            (Path::Wasm, _) => String::new(),
            // The module on a Unix socket, as deployed beside the scorer.
            (Path::Native, _) => format!("route_socket_path: {}\n", unique_socket_path().display()),
            (Path::Epp, None) => format!("epp: {{listen: '127.0.0.1:{EPP_PORT}'}}\n"),
            (Path::Epp, Some(n)) => format!("epp: {{listen: '127.0.0.1:{EPP_PORT}', body_limit_bytes: {n}}}\n"),
        }
    }

    /// `kvgate-envoy-config` flags for this path, then `extra`.
    pub fn envoy_flags<'a>(self, extra: &[&'a str]) -> Vec<&'a str> {
        let picker: &[&str] = match self {
            Path::Wasm => &["--picker", "wasm"],
            Path::Native => &["--picker", "native"],
            Path::Epp => &["--picker", "epp"],
        };
        picker.iter().chain(extra).copied().collect()
    }

    /// Requests `envoy` let through without a decision (fail-open).
    pub async fn failed_open(self, envoy: &EnvoyProcess) -> u64 {
        match self {
            Path::Wasm => envoy.stat("wasmcustom.kvgate_fail_open").await,
            Path::Native => envoy.stat("kvgate.fail_open").await,
            Path::Epp => envoy.stat("http.kvgate.ext_proc.failure_mode_allowed").await,
        }
    }
}

/// A Unix socket path no other test of this process uses.
fn unique_socket_path() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("kvgate-e2e-{}-{n}.sock", std::process::id()))
}
