//! Pods that come and go: their per-pod tasks (KV-event subscription, metrics scraping),
//! and DNS discovery — a name's A/AAAA records are the pods, re-resolved periodically.
//!
//! A discovered pod is named by its address (`10.0.0.7:8000`). When a record disappears,
//! the pod's tasks are stopped and the scorer forgets its index entries and bookings; when
//! the same address comes back it keeps its id and starts clean. A failed lookup changes
//! nothing (a DNS hiccup must not empty the fleet; pods that really died fail their scrapes
//! and are avoided anyway), and is counted.

use crate::config::DnsDiscovery;
use crate::scorer::Scorer;
use crate::{scrape, subscriber};
use kvgate_routing::pod_set::PodId;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Where a pod's tasks connect.
#[derive(Clone, Debug, Default)]
pub struct PodEndpoints {
    pub kv_events: Option<String>,
    pub kv_events_replay: Option<String>,
    pub metrics: Option<String>,
}

/// Starts the pod's event subscription (when it is indexed precisely) and its scraping.
pub fn spawn_pod_tasks(scorer: &Arc<Scorer>, pod: PodId, endpoints: &PodEndpoints) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if scorer.pod(pod).precise
        && let Some(endpoint) = &endpoints.kv_events
    {
        tasks.push(tokio::spawn(subscriber::run(
            scorer.clone(),
            pod,
            endpoint.clone(),
            endpoints.kv_events_replay.clone(),
        )));
    }
    if let Some(url) = &endpoints.metrics {
        tasks.push(tokio::spawn(scrape::run(scorer.clone(), pod, url.clone())));
    }
    tasks
}

/// Turns a name into the pods' IP addresses: the system resolver in production, anything in
/// tests.
pub trait Resolve: Send {
    fn resolve(&mut self) -> impl std::future::Future<Output = std::io::Result<BTreeSet<IpAddr>>> + Send;
}

/// The system resolver (`getaddrinfo`, as Envoy's `STRICT_DNS` clusters use by default).
pub struct SystemResolver {
    name: String,
    port: u16,
}

impl Resolve for SystemResolver {
    async fn resolve(&mut self) -> std::io::Result<BTreeSet<IpAddr>> {
        Ok(tokio::net::lookup_host((self.name.as_str(), self.port)).await?.map(|a| a.ip()).collect())
    }
}

struct Discovered {
    id: PodId,
    tasks: Option<Vec<JoinHandle<()>>>,
}

/// The discovered pods and what to do when the set changes.
pub struct DnsPods {
    config: DnsDiscovery,
    pods: BTreeMap<IpAddr, Discovered>,
}

impl DnsPods {
    pub fn new(config: DnsDiscovery) -> Self {
        Self { config, pods: BTreeMap::new() }
    }

    /// Pods present now.
    pub fn present(&self) -> Vec<PodId> {
        self.pods.values().filter(|d| d.tasks.is_some()).map(|d| d.id).collect()
    }

    /// Brings the scorer's pods in line with one lookup's addresses.
    pub fn update(&mut self, scorer: &Arc<Scorer>, ips: &BTreeSet<IpAddr>) {
        for ip in ips {
            let address = SocketAddr::new(*ip, self.config.port);
            let endpoints = endpoints(&self.config, *ip);
            match self.pods.get_mut(ip) {
                Some(Discovered { tasks: Some(_), .. }) => {}
                Some(d) => {
                    tracing::info!(pod = %address, "discovery: pod is back");
                    scorer.restore_pod(d.id);
                    d.tasks = Some(spawn_pod_tasks(scorer, d.id, &endpoints));
                }
                None => {
                    let name = address.to_string();
                    let id = scorer.add_pod(&name, &name, self.config.role, endpoints.kv_events.is_some());
                    tracing::info!(pod = %address, "discovery: new pod");
                    let tasks = Some(spawn_pod_tasks(scorer, id, &endpoints));
                    self.pods.insert(*ip, Discovered { id, tasks });
                }
            }
        }
        for (ip, d) in self.pods.iter_mut().filter(|(ip, _)| !ips.contains(ip)) {
            if let Some(tasks) = d.tasks.take() {
                tracing::info!(pod = %SocketAddr::new(*ip, self.config.port), "discovery: pod gone");
                tasks.iter().for_each(JoinHandle::abort);
                scorer.remove_pod(d.id);
            }
        }
    }
}

fn endpoints(config: &DnsDiscovery, ip: IpAddr) -> PodEndpoints {
    let host = match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    PodEndpoints {
        kv_events: config.kv_events_port.map(|p| format!("tcp://{host}:{p}")),
        kv_events_replay: config.kv_events_replay_port.map(|p| format!("tcp://{host}:{p}")),
        metrics: config.metrics_path.as_ref().map(|path| format!("http://{host}:{}{path}", config.port)),
    }
}

/// Resolves `config.name` every `interval_seconds` until the process stops.
pub async fn run_dns(scorer: Arc<Scorer>, config: DnsDiscovery) {
    let resolver = SystemResolver { name: config.name.clone(), port: config.port };
    run(scorer, config, resolver).await
}

/// The discovery loop with any resolver.
pub async fn run(scorer: Arc<Scorer>, config: DnsDiscovery, mut resolver: impl Resolve) {
    let interval = Duration::from_secs_f64(config.interval_seconds);
    let name = config.name.clone();
    let mut pods = DnsPods::new(config);
    loop {
        match resolver.resolve().await {
            Ok(ips) => {
                pods.update(&scorer, &ips);
                scorer.metrics.discovered_pods.set(pods.present().len() as f64);
            }
            Err(e) => {
                scorer.metrics.discovery_errors.inc();
                tracing::warn!(%name, "discovery: lookup failed ({e}); keeping the pods known so far");
            }
        }
        tokio::time::sleep(interval).await;
    }
}
