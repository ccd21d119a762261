//! `health:`, the scraping of pods' `/metrics` and what makes a pod unhealthy (see
//! `crate::scrape`).

use kvgate_routing::validate::{Invalid, check, positive};
use serde::Deserialize;
use smart_default::SmartDefault;

/// Scraping of pods' `/metrics`.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSection {
    /// How often each pod's `/metrics` is scraped.
    #[default(1000)]
    pub scrape_interval_ms: u64,
    /// A scrape not answered within this long has failed.
    #[default(500)]
    pub scrape_timeout_ms: u64,
    /// Consecutive failed scrapes (timeouts, error statuses) after which a pod stops being
    /// chosen; a refused connection takes it out at once.
    #[default(3)]
    pub unhealthy_after: u32,
    /// A pod without `/metrics` that was taken out (its pick refused the connection) is
    /// tried again after this long.
    #[default(2.0)]
    pub retry_seconds: f64,
    /// At start, how long `/readyz` (and the picker's gRPC health) waits at most for every
    /// healthy pod's index to be rebuilt from its replay buffer (`kv_events_replay`), so a
    /// new replica does not route on an empty index; pods still not caught up then are
    /// logged.
    #[default(10_000)]
    pub catch_up_wait_ms: u64,
}

impl HealthSection {
    pub(super) fn check(&self) -> Result<(), Invalid> {
        check(positive(self.retry_seconds), "retry_seconds", "must be positive")?;
        let positives = self.scrape_interval_ms > 0 && self.scrape_timeout_ms > 0 && self.unhealthy_after > 0;
        check(positives, "", "scrape_interval_ms, scrape_timeout_ms and unhealthy_after must be positive")
    }
}
