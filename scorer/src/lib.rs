//! The scorer sidecar's runtime: configuration, HTTP API, KV-event subscriptions, scraping,
//! and the generation of the matching Envoy configuration. The routing logic itself lives in
//! `kvgate-routing`; see `README.md` beside this crate for the design.

pub mod admin;
pub mod admission;
pub mod config;
pub mod discovery;
pub mod engine_pages;
pub mod envoy;
pub mod metrics;
pub mod picking;
pub mod prompt;
pub mod rewrites;
pub mod scorer;
pub mod scrape;
pub mod serve;
pub mod subscriber;
pub mod sync;
pub mod traces;
pub mod transport;
