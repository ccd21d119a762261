//! kvgate's routing-quality benchmarks.
//!
//! - [`workload`]: the seeded workloads (multi-turn chat, shared documents, long unique
//!   prompts, a burst, KV-capacity pressure, mixed lengths for P/D);
//! - [`cluster`]: simulated engines (`kvgate-sim`'s model) in virtual time, routed by a
//!   [`cluster::ClusterRouter`];
//! - [`routers`]: kvgate's own `Router` (as the scorer configures it) and the peers' rules;
//! - [`sglang`]: a re-implementation of SGLang's `cache_aware` as a reference point;
//! - [`vllm_router`]: a re-implementation of vllm-router's `kv_aware`, another;
//! - [`lora_affinity`]: the Inference Extension's endpoint picker with its LoRA affinity
//!   scorer, another;
//! - [`report`]: figures, tables and SVG charts;
//! - [`goodput`]: the highest load a router carries within a TTFT SLO, and its curve;
//! - [`clairvoyant`]: a bound, not a router: placement by what-ifs on the engines' true state
//!   (greedy, or seeing the arrivals to come).

pub mod clairvoyant;
pub mod cluster;
pub mod goodput;
pub mod lora_affinity;
pub mod report;
pub mod routers;
pub mod sglang;
pub mod vllm_router;
pub mod workload;
