//! The two kinds of block hash kvgate deals with.
//!
//! An engine names each cached block by its own hash ([`EngineHash`]), computed with an
//! algorithm and seed kvgate must not depend on (vLLM's varies with
//! `--prefix-caching-hash-algo` and `PYTHONHASHSEED`). kvgate computes its own chained
//! [`SequenceHash`] of each block from the token ids the engine announces, and hashes request
//! tokens the same way, so a request's blocks and the engines' blocks meet in one key space.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// kvgate's hash of a full block *and everything before it*: `xxh3(tokens, seed = parent)`,
/// starting from a root seeded by the LoRA adapter and cache salt. Equal sequence hashes mean
/// equal prefixes (up to 64-bit collisions), whichever engine computed them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// An engine's identifier of a cached block, as found in its KV events. vLLM sends a u64
/// (often above `i64::MAX`), SGLang a signed i64 (kept as its two's-complement bits), vLLM with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` 32 raw bytes (folded to 64 bits with xxh3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// The identifier of a hash given as bytes.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        EngineHash(xxh3_64(bytes))
    }
}

/// The root of a request's hash chain: requests for different LoRA adapters or with
/// different cache salts never share blocks (as in vLLM, where both enter the block hash).
pub fn root_hash(lora_name: Option<&str>, cache_salt: Option<&str>) -> SequenceHash {
    match (lora_name, cache_salt) {
        (None, None) => SequenceHash(0),
        (lora, salt) => {
            let mut key = Vec::with_capacity(64);
            for part in [lora, salt] {
                let part = part.unwrap_or_default();
                key.extend_from_slice(&(part.len() as u32).to_le_bytes());
                key.extend_from_slice(part.as_bytes());
            }
            SequenceHash(xxh3_64(&key))
        }
    }
}

/// The sequence hash of a block of `tokens` following `parent`.
pub fn chain(parent: SequenceHash, tokens: &[u32]) -> SequenceHash {
    SequenceHash(xxh3_64_with_seed(bytemuck::cast_slice(tokens), parent.0))
}

/// Appends the sequence hashes of the full blocks of `tokens` to `out` (cleared first).
/// A trailing partial block has no hash: engines only cache full blocks.
pub fn sequence_hashes(root: SequenceHash, tokens: &[u32], block_size: usize, out: &mut Vec<SequenceHash>) {
    out.clear();
    out.reserve(tokens.len() / block_size);
    let mut parent = root;
    for block in tokens.chunks_exact(block_size) {
        parent = chain(parent, block);
        out.push(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_depend_on_the_whole_prefix() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        sequence_hashes(SequenceHash(0), &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, &mut a);
        sequence_hashes(SequenceHash(0), &[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut b);
        assert_eq!(a, b, "the partial block has no hash");
        assert_eq!(a.len(), 2);
        sequence_hashes(SequenceHash(0), &[0, 2, 3, 4, 5, 6, 7, 8], 4, &mut b);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1], "a different first block changes every later hash");
        assert_eq!(a[1], chain(a[0], &[5, 6, 7, 8]));
    }

    #[test]
    fn adapters_and_salts_separate_chains() {
        let roots = [
            root_hash(None, None),
            root_hash(Some("a"), None),
            root_hash(None, Some("a")),
            root_hash(Some("a"), Some("b")),
            root_hash(Some("ab"), None),
        ];
        for i in 0..roots.len() {
            for j in i + 1..roots.len() {
                assert_ne!(roots[i], roots[j]);
            }
        }
    }
}
