//! A pod of the static `pods:` list, and the typed endpoints a pod (listed or discovered) is
//! reached at: checked as the file is read, so nothing later parses or skips one.

use derive_more::{Deref, Display};
use kvgate_routing::router::Role;
use kvgate_routing::validate::{Invalid, check};
use serde::Deserialize;
use std::net::SocketAddr;

/// One vLLM pod.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PodConfig {
    /// Unique name, used in logs, metrics and `/v1/pods`.
    pub name: String,
    /// `ip:port` of the pod's HTTP server: what Envoy routes to.
    #[serde(deserialize_with = "ip_port")]
    pub address: SocketAddr,
    #[serde(default)]
    pub role: Role,
    /// ZMQ endpoint of the pod's KV-event publisher (`tcp://host:port` or `ipc://path`).
    /// Without it the pod is indexed approximately (what kvgate routed there, with a TTL).
    pub kv_events: Option<ZmqEndpoint>,
    /// ZMQ ROUTER endpoint of the pod's replay socket, to fetch batches lost in a gap.
    pub kv_events_replay: Option<ZmqEndpoint>,
    /// URL of the pod's Prometheus `/metrics` (`http://`), scraped for load and health.
    pub metrics: Option<MetricsUrl>,
    /// How much longer than the fleet's average pod this one takes (2: an older GPU at half
    /// the speed), where it is known: applied from the first request, before its first
    /// tokens could teach it — a cold fleet places its first prefixes by it, and later
    /// requests follow them — and refined by what it then reports (`load.pod_speed`).
    /// Unset: learned alone. A discovered pod declares it in its annotation
    /// `kvgate.io/slowness`.
    pub slowness: Option<f64>,
}

/// A ZMQ endpoint kvgate connects to: `tcp://host:port` or `ipc://path`, checked when read;
/// shown as the endpoint it is (`"tcp://10.0.0.1:5557"`).
#[derive(Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema, derive_more::Debug, Display, Deref)]
#[serde(try_from = "String")]
#[debug("{_0:?}")]
#[deref(forward)]
pub struct ZmqEndpoint(String);

impl ZmqEndpoint {
    /// `tcp://ip:port`.
    pub fn tcp(address: SocketAddr) -> Self {
        ZmqEndpoint(format!("tcp://{address}"))
    }
}

impl TryFrom<String> for ZmqEndpoint {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.split_once("://") {
            Some(("tcp" | "ipc", rest)) if !rest.is_empty() => Ok(ZmqEndpoint(text)),
            _ => Err(format!("{text:?} is not a ZMQ endpoint (tcp://host:port or ipc://path)")),
        }
    }
}

/// The `http://` URL of a pod's Prometheus page, checked when read; shown as the URL it is.
#[derive(Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema, derive_more::Debug)]
#[serde(try_from = "String")]
#[schemars(with = "String")]
#[debug("{:?}", _0.as_str())]
pub struct MetricsUrl(reqwest::Url);

impl TryFrom<String> for MetricsUrl {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match reqwest::Url::parse(&text) {
            Ok(url) if url.scheme() == "http" && url.has_host() => Ok(MetricsUrl(url)),
            _ => Err(format!("{text:?} is not an http:// URL")),
        }
    }
}

impl MetricsUrl {
    /// `path` on the pod's HTTP server at `address` (a discovered pod's page).
    pub fn at(address: SocketAddr, path: &str) -> Self {
        let mut url = reqwest::Url::parse(&format!("http://{address}")).expect("http://ip:port is a URL");
        url.set_path(path);
        MetricsUrl(url)
    }

    /// The engine's `/v1/models`, on the same server.
    pub fn models(&self) -> reqwest::Url {
        let mut url = self.0.clone();
        url.set_path("/v1/models");
        url.set_query(None);
        url
    }
}

impl std::ops::Deref for MetricsUrl {
    type Target = str;

    fn deref(&self) -> &str {
        self.0.as_str()
    }
}

/// An `ip:port`, read once at load (an error quotes the value; the parser's points at it).
fn ip_port<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|_| serde::de::Error::custom(format!("{text:?} is not ip:port")))
}

impl PodConfig {
    pub(super) fn check(&self) -> Result<(), Invalid> {
        let name = !self.name.is_empty() && self.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        check(name, "name", &format!("{:?} must be non-empty [A-Za-z0-9._-]", self.name))?;
        check(self.kv_events_replay.is_none() || self.kv_events.is_some(), "kv_events_replay", "needs kv_events")
    }
}
