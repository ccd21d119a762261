//! DNS discovery: the pods are the A/AAAA records of a name — a Kubernetes headless Service,
//! which lists only Ready pods — re-resolved every `interval_seconds` with the system
//! resolver (`getaddrinfo`), the way Envoy's strict-DNS cluster resolves the same name.

use super::{DiscoveredPod, PodEndpoints, Registry};
use crate::config::DnsDiscovery;
use crate::scorer::Scorer;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// The pods behind one name.
pub struct DnsPods {
    config: DnsDiscovery,
    registry: Registry,
}

impl DnsPods {
    pub fn new(config: DnsDiscovery) -> Self {
        Self { config, registry: Registry::default() }
    }

    pub fn present(&self) -> Vec<kvgate_routing::pod_set::PodId> {
        self.registry.present()
    }

    /// Brings the scorer's pods in line with one lookup's addresses.
    pub fn update(&mut self, scorer: &Arc<Scorer>, ips: &BTreeSet<IpAddr>) {
        let c = &self.config;
        let desired: BTreeMap<SocketAddr, DiscoveredPod> = ips
            .iter()
            .map(|&ip| {
                let endpoints =
                    PodEndpoints::at(ip, c.port, c.kv_events_port, c.kv_events_replay_port, c.metrics_path.as_deref());
                (SocketAddr::new(ip, c.port), DiscoveredPod { role: c.role, endpoints, slowness: None })
            })
            .collect();
        self.registry.update(scorer, &desired);
    }
}

/// Resolves `config.name` every `interval_seconds` until the process stops.
pub async fn run(scorer: Arc<Scorer>, config: DnsDiscovery) {
    let interval = Duration::from_secs_f64(config.interval_seconds);
    let source = format!("dns:{}", config.name);
    let (name, port) = (config.name.clone(), config.port);
    let mut pods = DnsPods::new(config);
    loop {
        match tokio::net::lookup_host((name.as_str(), port)).await {
            Ok(addresses) => {
                let ips: BTreeSet<IpAddr> = addresses.map(|a| a.ip()).collect();
                pods.update(&scorer, &ips);
                scorer.metrics.discovered_pods.with_label_values(&[&source]).set(pods.present().len() as f64);
            }
            Err(e) => {
                scorer.metrics.discovery_errors.with_label_values(&[&source]).inc();
                tracing::warn!(%source, "discovery: lookup failed ({e}); keeping the pods known so far");
            }
        }
        tokio::time::sleep(interval).await;
    }
}
