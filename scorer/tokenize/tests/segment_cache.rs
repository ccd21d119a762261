//! The segment cache gives exactly the ids the plain encoder does — on the pieces it has seen
//! and those it has not, cut at special tokens and between words — and remembers a
//! conversation's history across turns and a document across questions.

use kvgate_test_harness::qwen3_tokenizer;
use kvgate_tokenize::{ChatOptions, MIN_CACHED_BYTES, Tokenizer};
use serde_json::json;

fn cached() -> Tokenizer {
    let mut tokenizer = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    tokenizer.cache_segments(1 << 20).expect("Qwen3's pieces can be cached");
    tokenizer
}

/// A small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
}

/// Text of pieces between special tokens, with what makes tokenizers differ at the edges:
/// spaces and newlines next to the special tokens, digits, CJK, emoji, combining marks.
fn random_text(rng: &mut Rng, specials_in_200_words: u64) -> String {
    const WORDS: &[&str] = &[
        "the",
        " cache",
        "block",
        "  ",
        "\n",
        "\n\n",
        " 1234",
        "5",
        "日本語",
        "中文",
        "😀👍🏽",
        "e\u{301}",
        "\t",
        "'s",
        "don't",
        "<|im_start",
        "|>",
        "fn main() {",
        "}",
        "Città",
        "\r\n",
        "ß",
        "...",
        " ",
        "http://x.io/a?b=c",
    ];
    const SPECIAL: &[&str] =
        &["<think>", "</think>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", " <|im_end|> "];
    let mut text = String::new();
    let words = 20 + rng.next() % 2000;
    for _ in 0..words {
        text.push_str(rng.pick(WORDS));
        let draw = rng.next() % 200;
        if draw < specials_in_200_words {
            text.push_str(rng.pick(SPECIAL));
        } else if draw < 60 {
            text.push(' ');
        }
    }
    text
}

#[test]
fn cached_ids_equal_plain_ids_on_random_text_with_special_tokens() {
    let plain = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    let cached = cached();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Special tokens every ≈ 100 words (short pieces), and none (long pieces, cut between words).
    let mut texts: Vec<String> = (0..200).map(|i| random_text(&mut rng, if i % 2 == 0 { 2 } else { 0 })).collect();
    // Documents shared by several prompts: behind other openings, before other endings.
    for i in 0..40 {
        let (opening, ending) = (random_text(&mut rng, 1), random_text(&mut rng, 0));
        let document = texts[i].clone();
        let short_opening: String = opening.chars().take(20).collect();
        let short_ending: String = ending.chars().take(20).collect();
        texts.push(format!("{short_opening}{document}{short_ending}"));
        texts.push(format!("{opening} {document}"));
        texts.push(format!("{document}{ending}"));
    }
    // Twice: the first pass fills the cache, the second reads it.
    for pass in 0..2 {
        for (i, text) in texts.iter().enumerate() {
            for add_special in [true, false] {
                let want = plain.encode(text, add_special).unwrap();
                let got = cached.encode(text, add_special).unwrap();
                assert_eq!(got, want, "pass {pass}, text {i} ({} bytes): ids differ", text.len());
            }
        }
    }
    let stats = cached.segment_cache_stats().unwrap();
    assert!(stats.hits > 0 && stats.misses > 0, "{stats:?}");
    assert!(stats.hits >= stats.misses, "the second pass reads what the first encoded: {stats:?}");
}

/// A long text of words, numbers and punctuation that does not repeat itself.
fn document(seed: u64, bytes: usize) -> String {
    let mut rng = Rng(seed);
    const WORDS: &[&str] = &["cache", "block", "prefill", "the", "of", "pod", "route", "decode", "token", "engine"];
    let mut text = String::new();
    while text.len() < bytes {
        text.push_str(rng.pick(WORDS));
        match rng.next() % 10 {
            0 => text.push_str(&format!(" {}", rng.next() % 100_000)),
            1 => text.push_str(". "),
            2 => text.push('\n'),
            _ => text.push(' '),
        }
    }
    text
}

#[test]
fn a_document_is_tokenized_once_whatever_question_follows_or_precedes_it() {
    let plain = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    let cached = cached();
    let doc = document(7, 32_000);
    let mut encoded = vec![];
    for (i, prompt) in [
        format!("{doc} Question 1: what does it say?"),
        format!("{doc} Question 2: and what else?"),
        format!("Read this first. {doc} Question 3?"),
    ]
    .iter()
    .enumerate()
    {
        let before = cached.segment_cache_stats().unwrap();
        assert_eq!(cached.encode(prompt, true).unwrap(), plain.encode(prompt, true).unwrap(), "prompt {i}");
        encoded.push(cached.segment_cache_stats().unwrap().bytes_encoded - before.bytes_encoded);
    }
    assert!(encoded[0] as usize >= doc.len(), "the first prompt is encoded whole: {encoded:?}");
    // Later prompts: the question and the piece of the document around it (pieces are
    // ≈ 1–2 kB), plus, behind a new opening, a piece or two until the cuts agree again.
    assert!(encoded[1] < 4_000, "{encoded:?}");
    assert!(encoded[2] < 8_000, "{encoded:?}");
}

#[test]
fn a_conversation_pays_only_for_its_new_turn() {
    let plain = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    let cached = cached();
    let options = ChatOptions::default();
    let long = |turn: usize| {
        (0..200).map(|i| format!("Turn {turn}, line {i}: the blocks of this turn stay cached.\n")).collect::<String>()
    };
    let mut messages = vec![json!({"role": "system", "content": long(0)})];
    for turn in 1..=6u64 {
        // Each request: the answer to the last question, and a new question.
        let mut new_bytes = 0;
        if turn > 1 {
            new_bytes += long(2 * turn as usize - 1).len();
            messages.push(json!({"role": "assistant", "content": long(2 * turn as usize - 1)}));
        }
        new_bytes += long(2 * turn as usize).len();
        messages.push(json!({"role": "user", "content": long(2 * turn as usize)}));
        let before = cached.segment_cache_stats().unwrap();
        let want = plain.encode_chat(&messages, &options).unwrap();
        assert_eq!(cached.encode_chat(&messages, &options).unwrap(), want, "turn {turn}");
        let after = cached.segment_cache_stats().unwrap();
        // The new messages are encoded (the system prompt too, the first time), and the role
        // headers between the special tokens; every earlier message is read back.
        let encoded = (after.bytes_encoded - before.bytes_encoded) as usize;
        let first_time = if turn == 1 { long(0).len() } else { 0 };
        assert!(encoded >= new_bytes + first_time, "turn {turn}: {encoded} bytes encoded, {after:?}");
        assert!(encoded <= new_bytes + first_time + 100, "turn {turn}: {encoded} bytes encoded, {after:?}");
        assert!(turn == 1 || after.hits - before.hits >= 2 * (turn - 1), "turn {turn}: {after:?}");
    }
}

#[test]
fn short_prompts_bypass_the_cache() {
    let cached = cached();
    let short = "x".repeat(MIN_CACHED_BYTES - 1);
    cached.encode(&short, true).unwrap();
    cached.encode(&short, true).unwrap();
    let stats = cached.segment_cache_stats().unwrap();
    assert_eq!((stats.hits, stats.misses, stats.tokens), (0, 0, 0), "{stats:?}");
    assert_eq!(stats.bytes_encoded, 0, "not even looked at");
}

#[test]
fn the_cache_holds_at_most_its_token_budget() {
    let mut tokenizer = Tokenizer::from_file(qwen3_tokenizer()).expect("load Qwen3");
    tokenizer.cache_segments(20_000).unwrap();
    for i in 0..100 {
        let text = (0..300).map(|j| format!("doc {i} word {j} ")).collect::<String>();
        tokenizer.encode(&text, true).unwrap();
    }
    let stats = tokenizer.segment_cache_stats().unwrap();
    assert!(stats.misses >= 100, "{stats:?}");
    assert!(stats.tokens <= 20_000 && stats.tokens > 5_000, "{stats:?}");
}

/// A tokenizer whose added token strips the whitespace on its left: its pieces depend on
/// their neighbours, so the cache is refused (and says why).
#[test]
fn tokenizers_whose_pieces_depend_on_their_neighbours_are_refused() {
    let dir = std::env::temp_dir().join(format!("kvgate-segments-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    let config = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": true, "rstrip": false,
                          "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<s>": 0, "a": 1, "[UNK]": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(&path, config.to_string()).unwrap();
    let mut tokenizer = Tokenizer::from_file(&path).expect("load the small tokenizer");
    let why = tokenizer.cache_segments(1000).unwrap_err();
    assert!(why.contains("<s>") && why.contains("lstrip"), "{why}");
    assert!(tokenizer.segment_cache_stats().is_none());
    assert!(Tokenizer::fallback().cache_segments(1000).is_err());
    std::fs::remove_dir_all(dir).ok();
}
