//! `admin:` and `shutdown:`, what the scorer's listeners serve and how they stop (see
//! `crate::serve`, `crate::admin`).

use kvgate_routing::validate::{Invalid, check, non_negative};
use serde::Deserialize;
use smart_default::SmartDefault;
use std::net::SocketAddr;

/// Who can see what: the debug endpoints reveal per-pod state, so they can be turned off or
/// moved to their own address (with `/metrics`).
#[derive(Clone, Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSection {
    /// Serve `/v1/pods`, `/metrics`, `/healthz` and `/readyz` here instead of on `listen`.
    pub listen: Option<SocketAddr>,
    /// `GET /v1/pods` and `?explain=1` on route calls: every pod's address, load and cache,
    /// and every candidate's cost. Off unless asked for (the local stack turns it on).
    pub debug_endpoints: bool,
}

/// What the scorer does on SIGTERM (a rolling update's step, a scale-down): it stops being
/// ready at once (`/readyz` answers 503, gRPC health NOT_SERVING) so that gateways and
/// Kubernetes move new requests to other replicas, keeps answering everything for
/// `drain_seconds` while they notice, then closes its listeners and lets what is still open
/// (a full-duplex picker exchange lasts as long as its response) finish for up to
/// `finish_seconds`. Set the pod's `terminationGracePeriodSeconds` above the sum (plus any
/// `preStop` sleep).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownSection {
    /// Seconds between SIGTERM and closing the listeners, answering as usual but not ready.
    #[default(5.0)]
    pub drain_seconds: f64,
    /// Longest wait, after the listeners close, for the picker's open exchanges to end
    /// (the filters' HTTP connections and route streams get 5 s).
    #[default(60.0)]
    pub finish_seconds: f64,
}

impl ShutdownSection {
    pub(super) fn check(&self) -> Result<(), Invalid> {
        check(non_negative(self.drain_seconds), "drain_seconds", "must be 0 or more seconds")?;
        check(non_negative(self.finish_seconds), "finish_seconds", "must be 0 or more seconds")
    }

    pub fn drain(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.drain_seconds)
    }

    pub fn finish(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.finish_seconds)
    }
}
