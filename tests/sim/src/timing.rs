//! How long one engine step takes: the cost model of a continuous-batching engine.
//!
//! One step runs a batch of scheduled tokens: chunks of prompts being prefilled and one
//! token per decoding sequence. Its duration is
//!
//! ```text
//! step = step_base                                   (read the weights once: memory bound)
//!      + token_cost      · scheduled tokens          (linear layers: compute bound)
//!      + attention_cost  · Σ prefill (query, key) pairs
//!      + kv_read_cost    · Σ context tokens of decoding sequences
//! ```
//!
//! A prefill chunk computing positions `start..start+n` attends to `(start+1) + … + (start+n)`
//! keys, so a prompt of `p` tokens with `c` cached costs the trapezoid
//! `(c + 1 + p) · (p − c) / 2` pairs: cached tokens are free, and long contexts cost more per
//! new token. Decode steps grow with the batch (linear cost per sequence) and with the
//! context each sequence reads.
//!
//! Defaults resemble Llama-3.1-8B (bf16) on one H100 SXM; see each field for the derivation.

use serde::Serialize;

/// Cost coefficients of the step-time model; all durations in milliseconds.
#[derive(Clone, Debug, Serialize)]
pub struct TimingModel {
    /// Fixed cost of any step: reading 16 GB of weights at ≈ 2.7 TB/s effective HBM bandwidth
    /// (H100 SXM peak 3.35 TB/s) ≈ 6 ms — the familiar floor of an 8B model's decode step.
    pub step_base_ms: f64,
    /// Per scheduled token: ≈ 2 FLOP × 8 B parameters = 16 GFLOP at ≈ 400 TFLOP/s sustained
    /// bf16 (≈ 40 % of dense peak) ≈ 0.04 ms, i.e. ≈ 25k prefill tokens/s.
    pub token_ms: f64,
    /// Per (query, key) pair of prefill attention: ≈ 4 · 32 layers · 4096 dims ≈ 0.5 MFLOP at
    /// 400 TFLOP/s ≈ 1.3e-6 ms. At 32k context, attention costs as much as the linear layers.
    pub attention_pair_ms: f64,
    /// Per context token read by a decoding sequence: the KV of one token is 2 · 32 layers ·
    /// 8 KV heads · 128 dims · 2 bytes = 128 KiB, read at ≈ 2.7 TB/s ≈ 4.9e-5 ms.
    pub kv_read_ms: f64,
    /// P/D: fixed cost of pulling a request's KV from the prefill pod (NIXL handshake and
    /// first RDMA read) ≈ 2 ms.
    pub transfer_base_ms: f64,
    /// P/D: per transferred token, 128 KiB over ≈ 40 GB/s effective RDMA ≈ 0.0033 ms.
    pub transfer_token_ms: f64,
    /// Offload tier: fixed cost of loading a request's blocks back from host memory ≈ 0.5 ms.
    pub offload_base_ms: f64,
    /// Offload tier: per loaded token, 128 KiB over ≈ 25 GB/s effective PCIe ≈ 0.0052 ms
    /// (an eighth of computing it).
    pub offload_token_ms: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            step_base_ms: 6.0,
            token_ms: 0.04,
            attention_pair_ms: 1.3e-6,
            kv_read_ms: 4.9e-5,
            transfer_base_ms: 2.0,
            transfer_token_ms: 0.0033,
            offload_base_ms: 0.5,
            offload_token_ms: 0.0052,
        }
    }
}

/// Attention pairs of computing positions `start..start + n` (each attends to itself and all
/// earlier positions): `(start + 1 + start + n) · n / 2`.
pub fn prefill_pairs(start: u64, n: u64) -> u64 {
    (2 * start + 1 + n) * n / 2
}

/// The work of one step, as the scheduler built it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepWork {
    /// Tokens scheduled in total (prefill chunks + one per decoding sequence).
    pub tokens: u64,
    /// Σ prefill attention pairs over the step's prefill chunks.
    pub prefill_pairs: u64,
    /// Σ context length over the sequences decoding in this step.
    pub decode_context: u64,
}

impl TimingModel {
    /// Duration of one step, in milliseconds.
    pub fn step_ms(&self, work: &StepWork) -> f64 {
        self.step_base_ms
            + self.token_ms * work.tokens as f64
            + self.attention_pair_ms * work.prefill_pairs as f64
            + self.kv_read_ms * work.decode_context as f64
    }

    /// The same engine `factor` times slower at computing (an older GPU beside newer ones):
    /// every step coefficient multiplied, KV transfers (the network) unchanged.
    pub fn slowed(&self, factor: f64) -> Self {
        Self {
            step_base_ms: self.step_base_ms * factor,
            token_ms: self.token_ms * factor,
            attention_pair_ms: self.attention_pair_ms * factor,
            kv_read_ms: self.kv_read_ms * factor,
            ..self.clone()
        }
    }

    /// Duration of pulling `tokens` tokens of KV from a prefill pod, in milliseconds.
    pub fn transfer_ms(&self, tokens: u64) -> f64 {
        self.transfer_base_ms + self.transfer_token_ms * tokens as f64
    }

    /// Duration of loading `tokens` tokens of KV back from host memory, in milliseconds.
    pub fn offload_load_ms(&self, tokens: u64) -> f64 {
        self.offload_base_ms + self.offload_token_ms * tokens as f64
    }

    /// Time to prefill a `prompt`-token prompt with `cached` tokens cached, alone on the
    /// engine, in one step (no chunking): the figure routers estimate.
    pub fn isolated_prefill_ms(&self, prompt: u64, cached: u64) -> f64 {
        let new = prompt.saturating_sub(cached);
        self.step_ms(&StepWork { tokens: new, prefill_pairs: prefill_pairs(cached, new), decode_context: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_the_trapezoid() {
        // (cached + 1 + prompt) · (prompt − cached) / 2
        for (p, c) in [(100u64, 0u64), (100, 40), (8192, 4096), (7, 6)] {
            assert_eq!(prefill_pairs(c, p - c), (c + 1 + p) * (p - c) / 2);
        }
        // Chunking does not change the total.
        assert_eq!(prefill_pairs(0, 30) + prefill_pairs(30, 70), prefill_pairs(0, 100));
    }

    #[test]
    fn cached_tokens_make_prefill_cheaper() {
        let t = TimingModel::default();
        let cold = t.isolated_prefill_ms(8192, 0);
        let warm = t.isolated_prefill_ms(8192, 6144);
        assert!(warm < cold / 3.0, "cold {cold} warm {warm}");
        // 8k cold prefill on an H100 for an 8B model: a few hundred ms.
        assert!((250.0..600.0).contains(&cold), "{cold}");
    }

    #[test]
    fn attention_makes_long_contexts_cost_more_per_token() {
        let t = TimingModel::default();
        let per_token_short = (t.isolated_prefill_ms(2048, 0) - t.step_base_ms) / 2048.0;
        let per_token_long = (t.isolated_prefill_ms(32768, 0) - t.step_base_ms) / 32768.0;
        assert!(per_token_long > 1.4 * per_token_short);
    }

    #[test]
    fn a_slowed_engine_takes_longer_for_every_step_but_transfers_alike() {
        let (t, slow) = (TimingModel::default(), TimingModel::default().slowed(2.0));
        let work = StepWork { tokens: 512, prefill_pairs: 100_000, decode_context: 30_000 };
        assert!((slow.step_ms(&work) - 2.0 * t.step_ms(&work)).abs() < 1e-9);
        assert_eq!(slow.transfer_ms(1000), t.transfer_ms(1000));
    }

    #[test]
    fn decode_steps_grow_with_batch_and_context() {
        let t = TimingModel::default();
        let one = t.step_ms(&StepWork { tokens: 1, prefill_pairs: 0, decode_context: 1000 });
        let many = t.step_ms(&StepWork { tokens: 64, prefill_pairs: 0, decode_context: 64_000 });
        assert!((6.0..7.0).contains(&one));
        assert!(many > one + 4.0);
    }
}
