//! Picker replicas under load, through the gateways that dial them (`kvgate-picker-failover`,
//! `make picker-failover`, and tests/e2e/tests/picker_replicas.rs): simulated pods, kvgate
//! pickers sharing their bookings over NATS (token-authenticated), and a real Envoy in the
//! shape Istio gives a Gateway in front of an InferencePool or in llm-d's standalone shape
//! (tests/fixtures/gateways/), its picker cluster set as kvgate's DestinationRule sets it
//! (deploy/gateway-api/gateway.yaml); closed-loop clients; then a rolling restart, a
//! `kill -9` and NATS going away, each request judged as its client saw it.

use kvgate_test_harness::{EPP_PORT, EnvoyProcess, NatsServer, ScorerProcess, Sim, qwen3_tokenizer, root, text};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which gateway dials the pickers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Istio's: full duplex both ways, fail-open, the pick in the dynamic metadata, a list
    /// of fallbacks for override_host.
    Istio,
    /// llm-d's standalone Envoy: full duplex both ways, fail-closed, the pick in the header
    /// for an ORIGINAL_DST cluster (one endpoint).
    LlmD,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Istio => "istio",
            Shape::LlmD => "llm-d",
        }
    }

    fn bootstrap(self) -> &'static str {
        match self {
            Shape::Istio => include_str!("../../fixtures/gateways/istio.yaml"),
            Shape::LlmD => include_str!("../../fixtures/gateways/llm-d.yaml"),
        }
    }
}

/// The picker Service's ejection and connection settings kvgate ships for Istio, as Envoy
/// cluster fields: (placeholder, value).
fn shipped_picker_settings() -> Vec<(&'static str, String)> {
    let path = root().join("deploy/gateway-api/gateway.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/gateway-api/gateway.yaml");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("gateway.yaml parses");
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "DestinationRule" && d["metadata"]["name"] == "kvgate-epp")
        .expect("the picker's DestinationRule");
    let policy = &rule["spec"]["trafficPolicy"];
    let outlier = &policy["outlierDetection"];
    let field = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    // The DestinationRule's durations ("500ms", "10s") as Envoy's seconds.
    let seconds = |v: &Value| {
        let s = field(v);
        let secs = match s.strip_suffix("ms") {
            Some(ms) => ms.parse::<f64>().expect("ms") / 1000.0,
            None => s.trim_end_matches('s').parse::<f64>().expect("seconds"),
        };
        format!("{secs}s")
    };
    vec![
        ("${CONSECUTIVE_GATEWAY_ERRORS}", field(&outlier["consecutiveGatewayErrors"])),
        ("${INTERVAL}", seconds(&outlier["interval"])),
        ("${BASE_EJECTION_TIME}", seconds(&outlier["baseEjectionTime"])),
        ("${MAX_EJECTION_PERCENT}", field(&outlier["maxEjectionPercent"])),
        ("${CONNECT_TIMEOUT}", seconds(&policy["connectionPool"]["tcp"]["connectTimeout"])),
    ]
}

fn endpoints(ports: impl Iterator<Item = u16>) -> String {
    ports
        .map(|p| {
            format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"
            )
        })
        .collect::<String>()
        .trim_end()
        .to_string()
}

/// How the gateway's picker cluster is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settings {
    /// As kvgate ships them: outlier detection and connection settings from the
    /// DestinationRule, and a health check standing in for Kubernetes' endpoint removal.
    Shipped,
    /// The gateway's defaults: no ejection, no health check, for comparison.
    GatewayDefaults,
}

/// The gateway's bootstrap for these pickers and pods.
fn bootstrap(shape: Shape, settings: Settings, listen: u16, admin: u16, pickers: &[u16], pods: &[u16]) -> String {
    let mut cluster = include_str!("../../fixtures/gateways/picker-cluster.yaml").to_string();
    if settings == Settings::GatewayDefaults {
        let (from, to) = (cluster.find("    outlier_detection:"), cluster.find("    load_assignment:"));
        cluster.replace_range(from.expect("outlier_detection")..to.expect("load_assignment"), "");
        cluster = cluster.replace("${CONNECT_TIMEOUT}", "10s"); // Istio's default
    }
    for (key, value) in shipped_picker_settings() {
        cluster = cluster.replace(key, &value);
    }
    cluster = cluster.replace("${PICKERS}", &endpoints(pickers.iter().copied()));
    shape
        .bootstrap()
        .replace("${PICKER_CLUSTER}", cluster.trim_end())
        .replace("${PODS}", &endpoints(pods.iter().copied()))
        .replace("${LISTEN_PORT}", &listen.to_string())
        .replace("${ADMIN_PORT}", &admin.to_string())
}

/// Seconds a picker drains after SIGTERM here: Envoy's health check (every 0.25 s) has
/// seen it NOT_SERVING well before.
pub const DRAIN_SECONDS: f64 = 1.5;

/// Pods, NATS, the picker replicas and the gateway.
pub struct Fleet {
    pub pods: Vec<Sim>,
    pub nats: NatsServer,
    pub pickers: Vec<ScorerProcess>,
    pub envoy: EnvoyProcess,
    /// The NATS token the pickers read.
    token_path: std::path::PathBuf,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.token_path);
    }
}

impl Fleet {
    pub async fn start(shape: Shape, settings: Settings, replicas: usize, pods: usize) -> Fleet {
        let tokenizer = qwen3_tokenizer();
        let tok = tokenizer.to_str().unwrap();
        let mut sims = Vec::new();
        for i in 0..pods {
            sims.push(Sim::start(&format!("pod-{i}"), &["--tokenizer", tok, "--time-scale", "0.25"]).await);
        }
        let token = format!("failover-{}", std::process::id());
        let token_path = std::env::temp_dir().join(format!("kvgate-nats-token-{}", std::process::id()));
        std::fs::write(&token_path, &token).expect("token file");
        let nats = NatsServer::start_with(&["--auth", &token], &[]).await;
        let fallbacks = if shape == Shape::LlmD { 0 } else { 2 };
        let mut pickers = Vec::new();
        for i in 0..replicas {
            let mut config = format!(
                "tokenizer: {tok}\n\
                 fallback_endpoints: {fallbacks}\n\
                 health: {{scrape_interval_ms: 250}}\n\
                 epp: {{listen: '127.0.0.1:{EPP_PORT}'}}\n\
                 shutdown: {{drain_seconds: {DRAIN_SECONDS}, finish_seconds: 30}}\n\
                 sync: {{nats: '{}', replica_id: picker-{i}, token_file: '{}'}}\n\
                 pods:\n",
                nats.url,
                token_path.display()
            );
            for p in &sims {
                config.push_str(&format!(
                    "  - {{name: {}, address: '127.0.0.1:{}', kv_events: '{}', kv_events_replay: '{}', metrics: '{}/metrics'}}\n",
                    p.pod_id, p.port, p.events, p.replay, p.url
                ));
            }
            pickers.push(ScorerProcess::start(&config).await);
        }
        // Ready (the other replicas heard, the pods' indexes caught up) before the gateway
        // looks at them.
        for p in &pickers {
            p.wait_ready(Duration::from_secs(20)).await;
        }
        let picker_ports: Vec<u16> = pickers.iter().map(|p| p.epp_port.expect("an epp port")).collect();
        let pod_ports: Vec<u16> = sims.iter().map(|p| p.port).collect();
        let envoy = EnvoyProcess::start_bootstrap(|listen, admin| {
            bootstrap(shape, settings, listen, admin, &picker_ports, &pod_ports)
        })
        .await;
        let fleet = Fleet { pods: sims, nats, pickers, envoy, token_path };
        fleet.wait_healthy(replicas as u64, Duration::from_secs(20)).await;
        fleet
    }

    /// Picker replicas the gateway deems healthy (its health check passes, not ejected).
    pub async fn healthy_pickers(&self) -> u64 {
        let healthy = self.envoy.stat("cluster.picker.membership_healthy").await;
        healthy.saturating_sub(self.envoy.stat("cluster.picker.outlier_detection.ejections_active").await)
    }

    /// What the gateway's `/clusters` says of the picker at `port`.
    pub async fn picker_host(&self, port: u16) -> PickerHost {
        let clusters = reqwest::get(format!("{}/clusters", self.envoy.admin)).await.expect("/clusters");
        let clusters = clusters.text().await.expect("text");
        let prefix = format!("picker::127.0.0.1:{port}::");
        let field = |name: &str| {
            clusters.lines().find_map(|l| l.strip_prefix(&prefix)?.strip_prefix(name)?.strip_prefix("::")).unwrap_or("")
        };
        PickerHost {
            healthy: field("health_flags") == "healthy",
            active: field("rq_active").parse().unwrap_or(0),
            total: field("rq_total").parse().unwrap_or(0),
        }
    }

    /// Waits until the gateway deems `n` pickers healthy; how long it took.
    pub async fn wait_healthy(&self, n: u64, limit: Duration) -> Duration {
        let start = Instant::now();
        while self.healthy_pickers().await != n {
            if start.elapsed() >= limit {
                // What Envoy thinks of each picker, and what each says of itself.
                let clusters = reqwest::get(format!("{}/clusters", self.envoy.admin)).await.unwrap();
                let clusters = clusters.text().await.unwrap();
                let flags: Vec<&str> = clusters.lines().filter(|l| l.starts_with("picker::")).collect();
                let mut readiness = Vec::new();
                for p in &self.pickers {
                    let r = reqwest::get(format!("{}/readyz", p.url)).await;
                    let said = match r {
                        Ok(r) => format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
                        Err(e) => e.to_string(),
                    };
                    readiness.push(format!("picker at {}: {said}", p.epp_port.unwrap_or_default()));
                }
                panic!("the gateway never saw {n} healthy pickers:\n{}\n{}", flags.join("\n"), readiness.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        start.elapsed()
    }
}

/// One picker as the gateway sees it.
#[derive(Clone, Debug, Default)]
pub struct PickerHost {
    /// Neither failing its health check nor ejected.
    pub healthy: bool,
    /// Exchanges (ext_proc streams) open on it now.
    pub active: u64,
    /// Exchanges sent to it so far.
    pub total: u64,
}

/// One request as its client saw it.
#[derive(Clone, Debug)]
pub struct Record {
    pub start: Instant,
    pub end: Instant,
    pub ok: bool,
    /// What went wrong (`500`, `cut`, `no answer`), for the report.
    pub failure: Option<String>,
}

async fn one_request(client: &reqwest::Client, url: &str, n: u64, systems: &[String]) -> Option<String> {
    let stream = n.is_multiple_of(2);
    let system = &systems[(n % systems.len() as u64) as usize];
    let body = json!({"messages": [{"role": "system", "content": system},
                                   {"role": "user", "content": format!("question {n}")}],
                      "max_tokens": 16, "stream": stream});
    let response = match client.post(format!("{url}/v1/chat/completions")).json(&body).send().await {
        Ok(r) => r,
        Err(_) => return Some("no answer".into()),
    };
    let status = response.status().as_u16();
    if status != 200 {
        return Some(status.to_string());
    }
    let bytes = match response.bytes().await {
        Ok(bytes) => bytes,
        Err(e) => return Some(format!("cut ({e:?})")),
    };
    let complete = if stream {
        bytes.ends_with(b"data: [DONE]\n\n")
    } else {
        serde_json::from_slice::<Value>(&bytes).is_ok_and(|v| v["choices"].is_array())
    };
    (!complete).then(|| {
        format!("cut ({} bytes: {:?})", bytes.len(), String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(80)..]))
    })
}

/// Closed-loop clients: each sends its next request when the last one ended.
pub struct Load {
    records: Arc<Mutex<Vec<Record>>>,
    stop: Arc<AtomicBool>,
    clients: tokio::task::JoinSet<()>,
}

impl Load {
    pub fn start(url: &str, clients: usize) -> Load {
        let records: Arc<Mutex<Vec<Record>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let systems: Arc<Vec<String>> = Arc::new((0..8).map(|i| text(&format!("failover system {i}"), 120)).collect());
        let mut tasks = tokio::task::JoinSet::new();
        for c in 0..clients {
            let (records, stop, systems, url) = (records.clone(), stop.clone(), systems.clone(), url.to_string());
            tasks.spawn(async move {
                let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
                let mut n = c as u64;
                while !stop.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    let failure = one_request(&client, &url, n, &systems).await;
                    let end = Instant::now();
                    records.lock().unwrap().push(Record { start, end, ok: failure.is_none(), failure });
                    n += clients as u64;
                }
            });
        }
        Load { records, stop, clients: tasks }
    }

    /// Requests ended so far.
    pub fn done(&self) -> usize {
        self.records.lock().unwrap().len()
    }

    pub async fn stop(mut self) -> Vec<Record> {
        self.stop.store(true, Ordering::Relaxed);
        while self.clients.join_next().await.is_some() {}
        std::mem::take(&mut *self.records.lock().unwrap())
    }
}

/// What one event cost.
#[derive(Clone, Debug)]
pub struct Event {
    pub name: String,
    pub at: Instant,
    /// The end of its window: the requests in flight at `at` or started before `until` are
    /// its.
    pub until: Instant,
    /// Exchanges open on the killed replica: active on it before the kill, or sent to it
    /// until the gateway saw it die.
    pub open_on_victim: Option<u64>,
    /// When the gateway had every replica back (rolling restart), the dead one out (kill),
    /// or the replicas heard each other again (NATS).
    pub settled: Option<Duration>,
}

/// Each replica in turn: SIGTERM, its exit, a new process on the same port, the gateway
/// seeing it healthy again.
pub async fn rolling_restart(fleet: &mut Fleet) -> Event {
    let at = Instant::now();
    let n = fleet.pickers.len() as u64;
    let since = |t: Instant| seconds_after(t, at);
    for i in 0..fleet.pickers.len() {
        let signalled = Instant::now();
        fleet.pickers[i].terminate();
        let limit = Duration::from_secs_f64(DRAIN_SECONDS) + Duration::from_secs(35);
        fleet.pickers[i].wait_exit(limit).await.expect("the picker exits after its drain");
        let exited = Instant::now();
        fleet.pickers[i].restart().await;
        fleet.wait_healthy(n, Duration::from_secs(30)).await;
        println!(
            "        picker {i}: SIGTERM at +{:.2} s, exited +{:.2} s, back in the gateway +{:.2} s",
            since(signalled),
            since(exited),
            since(Instant::now())
        );
    }
    let settled = at.elapsed();
    Event {
        name: "rolling restart (SIGTERM, each replica in turn)".into(),
        at,
        until: Instant::now() + Duration::from_secs(1),
        open_on_victim: None,
        settled: Some(settled),
    }
}

/// `kill -9` of replica `i`, which stays down for `down`; then restarted (its window runs
/// until a second after the gateway has it back). The exchanges open on it are counted as
/// the gateway counts them: those active on it just before the kill, plus those the gateway
/// still sent it until it saw it die (per host, Envoy's `rq_active` and `rq_total`).
pub async fn kill(fleet: &mut Fleet, i: usize, down: Duration) -> Event {
    let port = fleet.pickers[i].epp_port.expect("an epp port");
    let before = fleet.picker_host(port).await;
    let at = Instant::now(); // before the signal: the gateway may see the death before kill() returns
    fleet.pickers[i].kill();
    let mut settled = None;
    let mut seen_dead = before.clone();
    while at.elapsed() < down {
        if settled.is_none() {
            let now = fleet.picker_host(port).await;
            if !now.healthy {
                settled = Some(at.elapsed());
            }
            seen_dead = now;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let open = before.active + seen_dead.total.saturating_sub(before.total);
    fleet.pickers[i].restart().await;
    fleet.wait_healthy(fleet.pickers.len() as u64, Duration::from_secs(30)).await;
    let until = Instant::now() + Duration::from_secs(1);
    Event { name: "kill -9 of one replica, back after".into(), at, until, open_on_victim: Some(open), settled }
}

/// NATS down for `down`, then back: each replica routes on what it knows meanwhile, and they
/// share their bookings again once it is back (its window runs until they hear each other).
pub async fn bus_outage(fleet: &mut Fleet, down: Duration) -> Event {
    let at = Instant::now();
    fleet.nats.kill();
    tokio::time::sleep(down).await;
    fleet.nats.restart().await;
    let n = fleet.pickers.len() as f64;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut heard = 0.0;
        for p in &fleet.pickers {
            heard += p.metric("kvgate_sync_replicas").await;
        }
        if heard == n * (n - 1.0) {
            break;
        }
        assert!(Instant::now() < deadline, "the replicas never heard each other again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let settled = Some(at.elapsed());
    let until = Instant::now() + Duration::from_secs(1);
    Event { name: "NATS down, back after".into(), at, until, open_on_victim: None, settled }
}

/// Requests of an event's window, and its failures by when they started after it.
#[derive(Clone, Debug, Default)]
pub struct Cost {
    pub requests: usize,
    pub failed: usize,
    /// Failed requests that started before the event (in flight when it came).
    pub failed_before: usize,
    pub failed_first_second: usize,
    pub failed_1_to_3: usize,
    pub failed_after_3: usize,
    /// How each failure went: when it started and ended after the event, and why.
    pub failures: Vec<String>,
    pub kinds: Vec<String>,
}

/// What `event` cost the requests in flight at it or started in its window.
pub fn cost(records: &[Record], event: &Event) -> Cost {
    let mut c = Cost::default();
    for r in records.iter().filter(|r| r.end >= event.at && r.start < event.until) {
        c.requests += 1;
        if r.ok {
            continue;
        }
        c.failed += 1;
        match r.start.checked_duration_since(event.at) {
            None => c.failed_before += 1,
            Some(d) if d < Duration::from_secs(1) => c.failed_first_second += 1,
            Some(d) if d < Duration::from_secs(3) => c.failed_1_to_3 += 1,
            Some(_) => c.failed_after_3 += 1,
        }
        let kind = r.failure.clone().unwrap_or_default();
        let kind = kind.split(' ').next().unwrap_or_default().to_string();
        if !c.kinds.contains(&kind) {
            c.kinds.push(kind);
        }
        c.failures.push(format!(
            "{:+.2} s to {:+.2} s: {}",
            seconds_after(r.start, event.at),
            seconds_after(r.end, event.at),
            r.failure.as_deref().unwrap_or("")
        ));
    }
    c
}

/// Failed requests that were in no event's window: when each started (after the first
/// event) and why.
pub fn failed_outside(records: &[Record], events: &[&Event]) -> Vec<String> {
    let first = events.iter().map(|e| e.at).min();
    records
        .iter()
        .filter(|r| !r.ok && events.iter().all(|e| r.end < e.at || r.start >= e.until))
        .map(|r| {
            let offset = first.map_or(0.0, |f| seconds_after(r.start, f));
            format!("{offset:+.2} s: {}", r.failure.as_deref().unwrap_or(""))
        })
        .collect()
}

/// Seconds from `from` to `t`, negative when `t` came first.
fn seconds_after(t: Instant, from: Instant) -> f64 {
    match t.checked_duration_since(from) {
        Some(d) => d.as_secs_f64(),
        None => -(from - t).as_secs_f64(),
    }
}
