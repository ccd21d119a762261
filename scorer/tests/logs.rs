//! `--log-format json` (or `KVGATE_LOG_FORMAT=json`): every line the scorer logs is one JSON
//! object with its timestamp, level, message and fields — the start-up line, and the error
//! that stops a misconfigured scorer.

use kvgate_test_harness::{binary, free_port};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn config(text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvgate-logs-{}-{}.yaml", std::process::id(), free_port()));
    std::fs::write(&path, text).unwrap();
    path
}

/// The scorer's stderr, line by line, until `done` holds for a line or the scorer exits or
/// 20 s pass; the scorer is then killed.
fn log_lines(mut child: Child, done: impl Fn(&Value) -> bool) -> Vec<Value> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(20)) {
        let line: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        let stop = done(&line);
        lines.push(line);
        if stop {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    lines
}

fn scorer(config: &std::path::Path) -> Command {
    let mut cmd = Command::new(binary("kvgate-scorer"));
    cmd.arg("--config").arg(config).stderr(Stdio::piped());
    cmd
}

#[test]
fn a_misconfigured_scorer_says_why_in_json() {
    let path = config("pods: [{name: pod-1, address: '127.0.0.1:9'}]\npolicy: {name: kv, miss_wieght: 1}\n");
    let child = scorer(&path).args(["--log-format", "json"]).spawn().unwrap();
    let lines = log_lines(child, |l| l["level"] == "ERROR");
    std::fs::remove_file(&path).unwrap();
    let error = lines.iter().find(|l| l["level"] == "ERROR").unwrap_or_else(|| panic!("no error line: {lines:?}"));
    assert!(error["message"].as_str().unwrap().contains("miss_wieght"), "names the field: {error}");
    assert!(error["timestamp"].is_string() && error["target"] == "kvgate_scorer", "{error}");
}

#[test]
fn a_running_scorer_logs_json_lines_with_their_fields() {
    let port = free_port();
    let path = config(&format!("listen: 127.0.0.1:{port}\npods: [{{name: pod-1, address: '127.0.0.1:9'}}]\n"));
    let child = scorer(&path).env("KVGATE_LOG_FORMAT", "json").spawn().unwrap();
    let lines = log_lines(child, |l| l["message"] == "kvgate-scorer ready");
    std::fs::remove_file(&path).unwrap();
    let ready = lines.last().filter(|l| l["message"] == "kvgate-scorer ready");
    let ready = ready.unwrap_or_else(|| panic!("no ready line among {lines:?}"));
    assert_eq!(ready["level"], "INFO");
    assert_eq!(ready["listen"], format!("127.0.0.1:{port}"), "the event's fields are the object's own: {ready}");
    assert!(lines.iter().any(|l| l["level"] == "WARN"), "the start-up warning (no tokenizer) came first: {lines:?}");
}
