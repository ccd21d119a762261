//! kvgate's routing logic, free of I/O and clocks, so the live scorer sidecar and an offline
//! cluster simulator run the same code.
//!
//! - [`events`]: decoding the KV-event batches engines publish (vLLM's two encodings, SGLang's
//!   signed hashes), on top of a small defensive [`msgpack`] reader;
//! - [`hash`]: kvgate's own chained [`hash::SequenceHash`] of blocks, and the engines'
//!   [`hash::EngineHash`];
//! - [`index`]: which pod holds which block, matched in one lookup per block;
//! - [`sequence`]: batch sequence numbers → in order, gap, restart or duplicate;
//! - [`adapters`]: the LoRA adapters each pod holds and has room for;
//! - [`load`]: in-flight bookkeeping (queued prefill work, decode blocks) with expiry;
//! - [`speed`]: each pod's prefill speed, learned from its first tokens;
//! - [`approx`]: blocks recently routed to pods that publish no events, with a TTL;
//! - [`policy`]: one trait, one file per policy (`kv`, `prefix`, `ttft`, `least-loaded`,
//!   `round-robin`, `random`, `power-of-two`), built from configuration;
//! - [`router`]: all of it combined into one decision per request, prefill/decode included,
//!   and what it is built from ([`router::RouterConfig`]: each part deserialized and
//!   validated beside its type, [`validate`]).

pub mod adapters;
pub mod approx;
pub mod events;
pub mod hash;
pub mod holders;
pub mod index;
pub mod load;
pub mod msgpack;
pub mod pod_set;
pub mod policy;
pub mod recent;
pub mod router;
pub mod sequence;
pub mod speed;
pub mod validate;
