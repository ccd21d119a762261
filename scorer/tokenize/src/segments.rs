//! Remembered token ids of the text between special tokens.
//!
//! A conversation resends its whole history on every turn, and an agent its tools and system
//! prompt on every call: most of a long prompt's text was tokenized moments ago. HF tokenizers
//! cut the text at added tokens (`<|im_start|>`, `<|im_end|>`, …) *before* anything else and
//! encode each piece between them on its own, so a chat template's output is a run of
//! independent pieces — one per message, roughly. [`SegmentCache`] keeps the ids of the long
//! pieces, keyed by a seeded 128-bit hash of their text, and a request pays for the pieces it
//! has not sent before.
//!
//! The ids are exactly the uncached ones (checked against HF transformers by
//! `tests/parity_hf.rs`, and against the uncached encoder by the tests below), under the
//! conditions [`SegmentCache::supports`] checks: no added token looks at its neighbours
//! (`single_word`, `lstrip`, `rstrip`), no normalizer depends on where a piece starts
//! (`Metaspace` with its prepend scheme, `Precompiled`), and the post-processor adds nothing
//! around the sequence. A hash collision would cost one request a worse route (the engine
//! tokenizes for itself); the seed is random per process, so one cannot be aimed.

use quick_cache::Weighter;
use quick_cache::sync::Cache;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokenizers::pipeline::{
    EncodeOptions, PipelineNormalizer, PipelineToken, PipelineTokenizer, Segment, SpecialSegmentIterator,
};

/// Pieces shorter than this are encoded every time: hashing and a lookup cost about what
/// encoding them does, and short pieces (role headers, a new question) rarely repeat.
pub const MIN_CACHED_BYTES: usize = 512;

/// Token ids of recently seen pieces of text, bounded by their total number of tokens.
pub struct SegmentCache {
    pieces: Cache<u128, Arc<[u32]>, ByTokens>,
    seed: u64,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// What the cache holds, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// Pieces whose ids came from the cache.
    pub hits: u64,
    /// Pieces encoded (and then kept).
    pub misses: u64,
    /// Token ids held now.
    pub tokens: u64,
}

#[derive(Clone)]
struct ByTokens;

impl Weighter<u128, Arc<[u32]>> for ByTokens {
    fn weight(&self, _: &u128, ids: &Arc<[u32]>) -> u64 {
        ids.len().max(1) as u64
    }
}

impl SegmentCache {
    /// A cache holding up to `max_tokens` token ids (4 bytes each, plus ≈ 40 bytes per piece).
    pub fn new(max_tokens: u64) -> Self {
        // Pieces of a few hundred tokens each, typically.
        let pieces = (max_tokens / 256).clamp(16, 1 << 20) as usize;
        Self {
            pieces: Cache::with_weighter(pieces, max_tokens, ByTokens),
            seed: std::collections::hash_map::RandomState::new().hash_one(0x6b76_6761_7465_u64),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Why `tokenizer`'s pieces cannot be encoded apart, or `Ok` when they can.
    pub fn supports(tokenizer: &PipelineTokenizer) -> Result<(), String> {
        for (id, token) in tokenizer.get_added_vocabulary().get_added_tokens_decoder() {
            if token.single_word || token.lstrip || token.rstrip {
                return Err(format!(
                    "added token {:?} (id {id}) matches depending on its neighbours (single_word, lstrip or rstrip)",
                    token.content
                ));
            }
        }
        for normalizer in tokenizer.get_normalizers() {
            if matches!(normalizer, PipelineNormalizer::Metaspace(_) | PipelineNormalizer::Precompiled(_)) {
                return Err("a normalizer depends on where a piece of text starts (Metaspace or Precompiled)".into());
            }
        }
        if tokenizer.get_truncation().is_some() || tokenizer.get_post_processor().single.has_type_ids() {
            return Err("the tokenizer truncates or sets type ids".into());
        }
        Ok(())
    }

    /// Appends the ids of `text`, encoded without added special tokens, to `out`: special
    /// tokens as they are, short pieces encoded, long ones from the cache when they were seen.
    pub fn encode_into(&self, tokenizer: &PipelineTokenizer, text: &str, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        let options = EncodeOptions { add_special_tokens: false, ..EncodeOptions::default() };
        let mut encoded: Vec<PipelineToken> = Vec::new();
        for segment in SpecialSegmentIterator::new(text, tokenizer.get_added_vocabulary(), false, false) {
            let piece = match segment {
                Segment::SpecialToken(id) => {
                    out.push(id);
                    continue;
                }
                Segment::Text { text, .. } => text,
            };
            let key = (piece.len() >= MIN_CACHED_BYTES)
                .then(|| xxhash_rust::xxh3::xxh3_128_with_seed(piece.as_bytes(), self.seed));
            if let Some(ids) = key.and_then(|key| self.pieces.get(&key)) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                out.extend_from_slice(&ids);
                continue;
            }
            encoded.clear();
            tokenizer.encode_into(piece, &options, &mut encoded)?;
            let start = out.len();
            out.extend(encoded.iter().map(|t| t.id()));
            if let Some(key) = key {
                self.misses.fetch_add(1, Ordering::Relaxed);
                self.pieces.insert(key, Arc::from(&out[start..]));
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            tokens: self.pieces.weight(),
        }
    }
}
