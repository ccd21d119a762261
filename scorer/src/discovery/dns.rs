//! DNS discovery: the pods are the A/AAAA records of a name — a Kubernetes headless Service,
//! which lists only Ready pods — re-resolved every `interval_seconds`, the way Envoy's
//! strict-DNS cluster resolves the same name.

use super::{DiscoveredPod, PodEndpoints, Registry};
use crate::config::DnsDiscovery;
use crate::scorer::Scorer;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Turns the name into the pods' IP addresses: the system resolver in production, anything
/// in tests.
pub trait Resolve: Send {
    fn resolve(&mut self) -> impl std::future::Future<Output = std::io::Result<BTreeSet<IpAddr>>> + Send;
}

/// The system resolver (`getaddrinfo`, as Envoy's DNS clusters use by default).
pub struct SystemResolver {
    name: String,
    port: u16,
}

impl Resolve for SystemResolver {
    async fn resolve(&mut self) -> std::io::Result<BTreeSet<IpAddr>> {
        Ok(tokio::net::lookup_host((self.name.as_str(), self.port)).await?.map(|a| a.ip()).collect())
    }
}

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
                (SocketAddr::new(ip, c.port), DiscoveredPod { role: c.role, endpoints })
            })
            .collect();
        self.registry.update(scorer, &desired);
    }
}

/// Resolves `config.name` every `interval_seconds` until the process stops.
pub async fn run(scorer: Arc<Scorer>, config: DnsDiscovery) {
    let resolver = SystemResolver { name: config.name.clone(), port: config.port };
    run_with(scorer, config, resolver).await
}

/// The discovery loop with any resolver.
pub async fn run_with(scorer: Arc<Scorer>, config: DnsDiscovery, mut resolver: impl Resolve) {
    let interval = Duration::from_secs_f64(config.interval_seconds);
    let source = format!("dns:{}", config.name);
    let mut pods = DnsPods::new(config);
    loop {
        match resolver.resolve().await {
            Ok(ips) => {
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
