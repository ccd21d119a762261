//! The engine model of `kvgate-sim`, a simulated vLLM pod.
//!
//! Everything here runs in model time without I/O — the [`cache`] (vLLM's prefix-caching
//! block pool), the [`engine`] (a continuous-batching scheduler), the [`timing`] model and
//! the [`events`] encoder for vLLM's KV-event wire format — so the same code drives the live
//! simulator binary and offline cluster simulations in virtual time.

pub mod cache;
pub mod engine;
pub mod events;
pub mod timing;
