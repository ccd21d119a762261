//! Pods that come and go: a [`Registry`] keeps the scorer's pods in line with what a
//! discovery source sees — DNS ([`dns`]: a name's A/AAAA records), the Kubernetes API
//! ([`kubernetes`]: Running and Ready pods matching a label selector) or an InferencePool
//! ([`inference_pool`]: the pool's selector and target ports) — and starts and stops each
//! pod's tasks (KV-event subscription, metrics scraping).
//!
//! A discovered pod is named by its address (`10.0.0.7:8000`). When it disappears its tasks
//! stop and the scorer forgets its index entries and bookings; when the same address comes
//! back it keeps its id and starts clean. A source that fails (lookup error, API server
//! unreachable) changes nothing and is counted: an outage of the source must not empty the
//! fleet, and pods that really died fail their scrapes and are avoided anyway.

pub mod dns;
pub mod inference_pool;
pub mod kubernetes;

use crate::config::{MetricsUrl, Role, ZmqEndpoint};
use crate::scorer::Scorer;
use crate::{scrape, subscriber};
use kvgate_routing::pod_set::PodId;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// Where a pod's tasks connect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodEndpoints {
    pub kv_events: Option<ZmqEndpoint>,
    pub kv_events_replay: Option<ZmqEndpoint>,
    pub metrics: Option<MetricsUrl>,
}

impl PodEndpoints {
    /// Endpoints of a pod at `ip`: events on `tcp://ip:port`, metrics on `http://ip:port/path`.
    pub fn at(
        ip: IpAddr,
        http_port: u16,
        kv_events_port: Option<u16>,
        replay_port: Option<u16>,
        metrics_path: Option<&str>,
    ) -> Self {
        PodEndpoints {
            kv_events: kv_events_port.map(|p| ZmqEndpoint::tcp(SocketAddr::new(ip, p))),
            kv_events_replay: replay_port.map(|p| ZmqEndpoint::tcp(SocketAddr::new(ip, p))),
            metrics: metrics_path.map(|path| MetricsUrl::at(SocketAddr::new(ip, http_port), path)),
        }
    }
}

/// A pod as a discovery source sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscoveredPod {
    pub role: Role,
    pub endpoints: PodEndpoints,
    /// Its known slowness (`kvgate.io/slowness`), if declared.
    pub slowness: Option<f64>,
}

/// Starts the pod's event subscription (when it is indexed precisely) and its scraping.
pub fn spawn_pod_tasks(scorer: &Arc<Scorer>, pod: PodId, endpoints: &PodEndpoints) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if scorer.pod(pod).precise
        && let Some(endpoint) = &endpoints.kv_events
    {
        if endpoints.kv_events_replay.is_some() {
            scorer.catching_up(pod);
        }
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

struct Entry {
    id: PodId,
    pod: DiscoveredPod,
    /// `Some` while present.
    tasks: Option<Vec<JoinHandle<()>>>,
}

/// The pods one discovery source has seen, by address.
#[derive(Default)]
pub struct Registry {
    pods: BTreeMap<SocketAddr, Entry>,
}

impl Registry {
    /// Pods present now.
    pub fn present(&self) -> Vec<PodId> {
        self.pods.values().filter(|e| e.tasks.is_some()).map(|e| e.id).collect()
    }

    /// Makes the scorer's pods from this source exactly `desired`.
    pub fn update(&mut self, scorer: &Arc<Scorer>, desired: &BTreeMap<SocketAddr, DiscoveredPod>) {
        for (address, pod) in desired {
            match self.pods.get_mut(address) {
                Some(e) if e.tasks.is_some() && e.pod == *pod => {}
                Some(e) if e.pod.role == pod.role => {
                    if let Some(tasks) = e.tasks.take() {
                        tasks.iter().for_each(JoinHandle::abort); // endpoints changed
                    } else {
                        tracing::info!(pod = %address, "discovery: pod is back");
                    }
                    scorer.restore_pod(e.id);
                    scorer.declare_slowness(e.id, pod.slowness.unwrap_or(1.0));
                    e.pod = pod.clone();
                    e.tasks = Some(spawn_pod_tasks(scorer, e.id, &pod.endpoints));
                }
                _ => {
                    // New, or its role changed (a new pod for the scorer; the old id retires).
                    if let Some(old) = self.pods.remove(address) {
                        old.tasks.into_iter().flatten().for_each(|t| t.abort());
                        scorer.remove_pod(old.id);
                    }
                    let id = scorer.add_pod(
                        &address.to_string(),
                        *address,
                        pod.role,
                        pod.endpoints.kv_events.is_some(),
                        pod.endpoints.metrics.is_some(),
                    );
                    if let Some(slowness) = pod.slowness {
                        scorer.declare_slowness(id, slowness);
                    }
                    tracing::info!(pod = %address, role = ?pod.role, "discovery: new pod");
                    let tasks = Some(spawn_pod_tasks(scorer, id, &pod.endpoints));
                    self.pods.insert(*address, Entry { id, pod: pod.clone(), tasks });
                }
            }
        }
        for (address, e) in self.pods.iter_mut().filter(|(a, _)| !desired.contains_key(a)) {
            if let Some(tasks) = e.tasks.take() {
                tracing::info!(pod = %address, "discovery: pod gone");
                tasks.iter().for_each(JoinHandle::abort);
                scorer.remove_pod(e.id);
            }
        }
    }
}
