//! Remembered token ids of pieces of prompt text.
//!
//! A conversation resends its whole history on every turn, an agent its tools and system
//! prompt on every call, a RAG application the same documents under different questions:
//! most of a long prompt's text was tokenized moments ago. [`SegmentCache`] cuts a text at
//! points where tokenization provably starts afresh, keeps the ids of the long pieces keyed
//! by a seeded 128-bit hash of their text, and a request pays for the pieces it has not sent
//! before. The ids are exactly the uncached ones; where a cut is made, and why it is exact:
//!
//! 1. **At added tokens** (`<|im_start|>`, `<|im_end|>`, …) — so a chat's messages are
//!    separate pieces. HF tokenizers cut a text at its added tokens before anything else and
//!    encode each piece between them on its own. Exact for every tokenizer that
//!    [`SegmentCache::supports`]: no added token looks at its neighbours (`single_word`,
//!    `lstrip`, `rstrip`), no normalizer depends on where a piece starts (`Metaspace` with its
//!    prepend scheme, `Precompiled`), and the post-processor adds nothing around the sequence.
//! 2. **Between words**, inside long pieces, for tokenizers whose pipeline is Qwen2/Qwen3's
//!    ([`splits_between_words`]: NFC or no normalizer, that exact pre-tokenizer regex, then
//!    byte-level without a prefix space, no normalized added tokens): at `p` where the byte
//!    before is an ASCII letter or digit, `p` is a space and the byte after is an ASCII letter
//!    (`…word| word…`). No alternative of the regex matches an ASCII letter or digit followed
//!    by a space, so in the whole text a match ends at `p`; the text before `p` alone is
//!    matched the same way (its last match — letters, digits or a contraction — ends at the
//!    end of its input just as it ended before the space, and the pattern's one lookahead,
//!    `\s+(?!\S)`, follows whitespace, which that text does not end with, so nothing before
//!    `p` is decided by what comes after it); the text from `p` alone is matched the same
//!    way too (the pattern has no lookbehind, and the scan of the whole text restarts at
//!    `p`: ` word` is one match either way). NFC never composes across an ASCII space, and byte-level mapping and
//!    BPE work word by word. Which such points become cuts depends on the text alone (its
//!    8 bytes before the point, at least [`MIN_WORD_CUT_BYTES`] after the previous cut), so a
//!    document shared by two prompts is cut alike in both, wherever it starts in them.
//!
//! The tests check both against the plain encoder on random texts full of special tokens,
//! digits, punctuation, newlines and non-ASCII text, and against HF transformers
//! (`tests/parity_hf.rs`). A hash collision would cost one request a worse route (the engine
//! tokenizes for itself); the seed is random per process, so one cannot be aimed.

use quick_cache::Weighter;
use quick_cache::sync::Cache;
use serde_json::{Value, json};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokenizers::pipeline::{
    EncodeOptions, PipelineNormalizer, PipelineToken, PipelineTokenizer, Segment, SpecialSegmentIterator,
};

/// Pieces shorter than this are encoded every time: hashing and a lookup cost about what
/// encoding them does, and short pieces (role headers, a new question) rarely repeat.
pub const MIN_CACHED_BYTES: usize = 512;

/// Cuts between words are at least this far apart (pieces of ≈ 300 tokens).
pub const MIN_WORD_CUT_BYTES: usize = 1024;

/// Qwen2's and Qwen3's pre-tokenizer pattern, for which cuts between words are exact.
const QWEN_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token ids of recently seen pieces of text, bounded by their total number of tokens.
pub struct SegmentCache {
    pieces: Cache<u128, Arc<[u32]>, ByTokens>,
    seed: u64,
    between_words: bool,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_encoded: AtomicU64,
}

/// What the cache did, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// Pieces whose ids came from the cache.
    pub hits: u64,
    /// Long pieces encoded (and then kept).
    pub misses: u64,
    /// Bytes of text encoded: long pieces missed and short pieces.
    pub bytes_encoded: u64,
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

/// Whether the tokenizer described by `config` (its `tokenizer.json`) can be cut between
/// words (point 2 of the module's description).
pub fn splits_between_words(config: &Value) -> bool {
    let normalizer_ok = match &config["normalizer"] {
        Value::Null => true,
        n => n["type"] == "NFC",
    };
    let pre_tokenizer = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]});
    let added_raw =
        config["added_tokens"].as_array().is_some_and(|tokens| tokens.iter().all(|t| t["normalized"] == false));
    normalizer_ok && config["pre_tokenizer"] == pre_tokenizer && added_raw
}

impl SegmentCache {
    /// A cache holding up to `max_tokens` token ids (4 bytes each, plus ≈ 40 bytes per
    /// piece), cutting between words too when `between_words` ([`splits_between_words`]).
    pub fn new(max_tokens: u64, between_words: bool) -> Self {
        // Pieces of a few hundred tokens each, typically.
        let pieces = (max_tokens / 256).clamp(16, 1 << 20) as usize;
        Self {
            pieces: Cache::with_weighter(pieces, max_tokens, ByTokens),
            seed: std::collections::hash_map::RandomState::new().hash_one(0x6b76_6761_7465_u64),
            between_words,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            bytes_encoded: AtomicU64::new(0),
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
        let mut encoded: Vec<PipelineToken> = Vec::new();
        for segment in SpecialSegmentIterator::new(text, tokenizer.get_added_vocabulary(), false, false) {
            match segment {
                Segment::SpecialToken(id) => out.push(id),
                Segment::Text { text, .. } if !self.between_words => {
                    self.encode_piece(tokenizer, text, &mut encoded, out)?;
                }
                Segment::Text { text, .. } => {
                    let mut start = 0;
                    for cut in word_cuts(text.as_bytes()) {
                        self.encode_piece(tokenizer, &text[start..cut], &mut encoded, out)?;
                        start = cut;
                    }
                    self.encode_piece(tokenizer, &text[start..], &mut encoded, out)?;
                }
            }
        }
        Ok(())
    }

    /// One piece: from the cache, or encoded (and kept when long).
    fn encode_piece(
        &self,
        tokenizer: &PipelineTokenizer,
        piece: &str,
        encoded: &mut Vec<PipelineToken>,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let key = (piece.len() >= MIN_CACHED_BYTES)
            .then(|| xxhash_rust::xxh3::xxh3_128_with_seed(piece.as_bytes(), self.seed));
        if let Some(ids) = key.and_then(|key| self.pieces.get(&key)) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            out.extend_from_slice(&ids);
            return Ok(());
        }
        encoded.clear();
        let options = EncodeOptions { add_special_tokens: false, ..EncodeOptions::default() };
        tokenizer.encode_into(piece, &options, encoded)?;
        let start = out.len();
        out.extend(encoded.iter().map(|t| t.id()));
        self.bytes_encoded.fetch_add(piece.len() as u64, Ordering::Relaxed);
        if let Some(key) = key {
            self.misses.fetch_add(1, Ordering::Relaxed);
            self.pieces.insert(key, Arc::from(&out[start..]));
        }
        Ok(())
    }

    pub fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes_encoded: self.bytes_encoded.load(Ordering::Relaxed),
            tokens: self.pieces.weight(),
        }
    }
}

/// The cuts between words in `text` (point 2 of the module's description), in order: points
/// `…alnum| letter…`, at least [`MIN_WORD_CUT_BYTES`] after the previous cut, chosen by their
/// 8 bytes before (one in 16 qualifies). Looks at the spaces of ≈ 100 bytes per cut.
fn word_cuts(text: &[u8]) -> impl Iterator<Item = usize> + '_ {
    std::iter::successors(next_word_cut(text, 0), move |&last| next_word_cut(text, last))
}

fn next_word_cut(text: &[u8], last: usize) -> Option<usize> {
    let mut from = last + MIN_WORD_CUT_BYTES;
    while from + 1 < text.len() {
        let p = from + memchr::memchr(b' ', &text[from..text.len() - 1])?;
        let chosen = text[p - 1].is_ascii_alphanumeric()
            && text[p + 1].is_ascii_alphabetic()
            && u64::from_le_bytes(text[p - 8..p].try_into().expect("8 bytes")).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                >> 60
                == 0;
        if chosen {
            return Some(p);
        }
        from = p + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_cuts_fall_between_words_and_follow_the_text_not_its_offset() {
        let words: String = (0..3000).map(|i| format!("w{} ", i * 7919 % 10007)).collect();
        let cuts: Vec<usize> = word_cuts(words.as_bytes()).collect();
        assert!(cuts.len() > 5, "{} cuts in {} bytes", cuts.len(), words.len());
        for pair in cuts.windows(2) {
            assert!(pair[1] - pair[0] >= MIN_WORD_CUT_BYTES);
        }
        for &p in &cuts {
            let b = words.as_bytes();
            assert!(b[p] == b' ' && b[p - 1].is_ascii_alphanumeric() && b[p + 1].is_ascii_alphabetic());
        }
        // The same text behind a different start: after a cut or two the cuts agree again.
        let shifted = format!("A different question, then the document: {words}");
        let offset = shifted.len() - words.len();
        let later: Vec<usize> = word_cuts(shifted.as_bytes()).map(|p| p - offset.min(p)).collect();
        let common = cuts.iter().filter(|p| later.contains(p)).count();
        assert!(common + 3 >= cuts.len(), "{common} of {} cuts shared", cuts.len());
    }

    #[test]
    fn only_qwens_pipeline_is_cut_between_words() {
        let qwen = json!({"normalizer": {"type": "NFC"}, "added_tokens": [{"content": "<|im_start|>", "normalized": false}],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]}});
        assert!(splits_between_words(&qwen));
        let mut other = qwen.clone();
        other["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = json!(true);
        assert!(!splits_between_words(&other));
        let mut other = qwen.clone();
        other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
            json!(QWEN_PATTERN.replace(r"\p{N}|", r"\p{N}{1,3}|"));
        assert!(!splits_between_words(&other));
        let mut other = qwen.clone();
        other["added_tokens"][0]["normalized"] = json!(true);
        assert!(!splits_between_words(&other));
        let mut other = qwen;
        other["normalizer"] = json!({"type": "NFKC"});
        assert!(!splits_between_words(&other));
    }
}
