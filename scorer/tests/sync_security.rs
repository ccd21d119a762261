//! Replicas share bookings only over a NATS they authenticate to: with the token or the user
//! and password from their files, and over TLS when asked; a replica with wrong credentials
//! is refused by the server (and says so in its metrics) while the others keep syncing; a
//! missing or empty secret stops start-up naming the field. Real `nats-server`, real scorers.

use kvgate_test_harness::{NatsServer, ScorerProcess, binary};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A file in a fresh temporary directory of this test.
fn temp_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn temp_dir(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvgate-sync-security-{test}-{}", std::process::id()))
}

/// A replica with one static pod (nobody answers there: only the bus matters here).
fn replica_config(r: usize, sync: &str) -> String {
    format!(
        "pods: [{{name: pod-1, address: '127.0.0.1:9', kv_events: 'tcp://127.0.0.1:9'}}]\n\
         sync: {{replica_id: replica-{r}, heartbeat_ms: 100, replica_timeout_ms: 1000, join_wait_ms: 500, {sync}}}\n"
    )
}

/// Polls `name` until `holds`; panics with `what` after 15 s.
async fn wait_metric(scorer: &ScorerProcess, name: &str, holds: impl Fn(f64) -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let value = scorer.metric(name).await;
        if holds(value) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {name} is {value}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sync_only_with_the_servers_token_and_the_refused_one_says_so() {
    let dir = temp_dir("token");
    let nats = NatsServer::start_with(&["--auth", "s3cret-token"], &[]).await;
    let good = temp_file(&dir, "token", "s3cret-token\n");
    let wrong = temp_file(&dir, "wrong", "guessed\n");
    let sync = |token: &Path| format!("nats: '{}', token_file: '{}'", nats.url, token.display());
    let a = ScorerProcess::start(&replica_config(0, &sync(&good))).await;
    let b = ScorerProcess::start(&replica_config(1, &sync(&good))).await;
    let intruder = ScorerProcess::start(&replica_config(2, &sync(&wrong))).await;
    let anonymous = ScorerProcess::start(&replica_config(3, &format!("nats: '{}'", nats.url))).await;

    for s in [&a, &b] {
        wait_metric(s, "kvgate_sync_connected", |v| v == 1.0, "an authenticated replica connects").await;
        wait_metric(s, "kvgate_sync_replicas", |v| v == 1.0, "it hears the other one, and only that one").await;
    }
    for s in [&intruder, &anonymous] {
        let refused = "kvgate_sync_errors_total{kind=\"authorization\"}";
        wait_metric(s, refused, |v| v >= 1.0, "the server refuses it, counted").await;
        assert_eq!(s.metric("kvgate_sync_connected").await, 0.0);
        assert_eq!(s.metric("kvgate_sync_replicas").await, 0.0);
    }
    // Some heartbeats later, still only the two: nothing the refused ones sent got through.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for s in [&a, &b] {
        assert_eq!(s.metric("kvgate_sync_replicas").await, 1.0);
    }
    drop((a, b, intruder, anonymous, nats));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sync_over_tls_with_a_user_and_password() {
    let dir = temp_dir("tls");
    // A CA, and a server certificate for 127.0.0.1 signed by it.
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let server_key = rcgen::KeyPair::generate().unwrap();
    let server_params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()]).unwrap();
    let server_cert = server_params.signed_by(&server_key, &issuer).unwrap();
    let ca_file = temp_file(&dir, "ca.pem", &ca.pem());
    let cert = temp_file(&dir, "server.pem", &server_cert.pem());
    let key = temp_file(&dir, "server-key.pem", &server_key.serialize_pem());
    let password = temp_file(&dir, "password", "pa55word");

    let args = ["--user", "kvgate", "--pass", "pa55word", "--tls", "--tlscert", cert.to_str().unwrap()];
    let nats = NatsServer::start_with(&[&args[..], &["--tlskey", key.to_str().unwrap()]].concat(), &[]).await;
    let sync = format!(
        "nats: '{}', user: kvgate, password_file: '{}', tls: {{ca_file: '{}'}}",
        nats.url,
        password.display(),
        ca_file.display()
    );
    let a = ScorerProcess::start(&replica_config(0, &sync)).await;
    let b = ScorerProcess::start(&replica_config(1, &sync)).await;
    for s in [&a, &b] {
        wait_metric(s, "kvgate_sync_connected", |v| v == 1.0, "a replica trusting the CA connects over TLS").await;
        wait_metric(s, "kvgate_sync_replicas", |v| v == 1.0, "and hears the other").await;
    }
    // Without the CA the server's certificate is not trusted: no connection.
    let untrusting = format!("nats: '{}', user: kvgate, password_file: '{}', tls: {{}}", nats.url, password.display());
    let c = ScorerProcess::start(&replica_config(2, &untrusting)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.metric("kvgate_sync_connected").await, 0.0, "a certificate it does not trust");
    assert_eq!(a.metric("kvgate_sync_replicas").await, 1.0);
    drop((a, b, c, nats));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_or_empty_secret_stops_start_up_naming_the_field() {
    let dir = temp_dir("start");
    let empty = temp_file(&dir, "empty", "\n");
    let missing = dir.join("no-such-token");
    for (token, expected) in [(&empty, "sync.token_file"), (&missing, "sync.token_file")] {
        let sync = format!("nats: 'nats://127.0.0.1:9', token_file: '{}'", token.display());
        let config = temp_file(&dir, "scorer.yaml", &format!("listen: 127.0.0.1:0\n{}", replica_config(0, &sync)));
        let out = std::process::Command::new(binary("kvgate-scorer")).arg("--config").arg(&config).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "the scorer must not start without its secret");
        assert!(stderr.contains(expected), "the error names {expected}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
