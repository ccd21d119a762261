//! kvgate's routing-quality benchmarks.
//!
//! - [`workload`]: the seeded workloads (multi-turn chat, shared documents, long unique
//!   prompts, a burst, KV-capacity pressure, mixed lengths for P/D);
//! - [`cluster`]: simulated engines (`kvgate-sim`'s model) in virtual time, routed by a
//!   [`cluster::ClusterRouter`];
//! - [`routers`]: kvgate's own `Router` (as the scorer configures it) and SGLang's rule;
//! - [`sglang`]: a re-implementation of SGLang's `cache_aware` as a reference point;
//! - [`report`]: figures, tables and SVG charts.

pub mod cluster;
pub mod report;
pub mod routers;
pub mod sglang;
pub mod workload;
