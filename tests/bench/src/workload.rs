//! Workloads: seeded, parameterised sequences of sessions.
//!
//! Everything is a *session* of one or more turns. Turn `i`'s prompt is the session's prefix,
//! then every earlier turn's user message and the tokens the engine generated for it, then
//! turn `i`'s user message — so a multi-turn chat re-sends its whole history, as chat clients
//! do, and a single-turn request is a session of one turn. The first turn arrives at the
//! session's start; each later turn `think` seconds after the previous answer completed
//! (closed loop: a slow cluster slows its users down, as in life).
//!
//! Token ids are drawn from disjoint ranges per purpose (system prompts, documents, unique
//! text), so prompts share exactly the prefixes a workload intends and nothing by accident.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// One turn of a session.
#[derive(Clone, Debug)]
pub struct Turn {
    pub user: Vec<u32>,
    pub max_tokens: usize,
    /// Seconds between the previous turn's answer and this turn (ignored for the first).
    pub think: f64,
}

/// A user's conversation, or one request.
#[derive(Clone, Debug)]
pub struct Session {
    pub start: f64,
    pub prefix: Vec<u32>,
    pub turns: Vec<Turn>,
    /// The LoRA adapter its requests name as their `model` (none: the base model).
    pub adapter: Option<String>,
}

/// A named workload and how the cluster should be set up for it.
#[derive(Clone, Debug, Default)]
pub struct Workload {
    pub name: &'static str,
    pub description: String,
    pub sessions: Vec<Session>,
    /// KV blocks per pod (smaller for the capacity-pressure case).
    pub num_blocks: usize,
    /// Prefill-only pods placed before the others (P/D workload), else 0.
    pub prefill_pods: usize,
    /// Blocks of each pod's host-memory offload tier (vLLM's OffloadingConnector), else 0.
    pub offload_blocks: usize,
    /// Pods unlike the others (a mixed fleet), by index; the rest are the reference engine
    /// with `num_blocks` blocks.
    pub unlike: Vec<(usize, PodShape)>,
    /// LoRA adapters one batch holds (vLLM `--max-loras`), else 0 (no adapters served).
    pub max_loras: usize,
    /// Milliseconds a step takes longer per adapter it loads onto the GPU.
    pub lora_load_ms: f64,
    /// Pods run a hybrid model with sliding-window attention over this many tokens beside
    /// full attention (a KV-cache group each), else `None`.
    pub sliding_window: Option<usize>,
}

/// How one pod differs from the reference engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PodShape {
    /// Its steps' duration relative to the reference engine's (2 = an older GPU generation).
    pub slowdown: f64,
    pub num_blocks: usize,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// Every session starts at t = 0: the load is the burst's size, not a rate.
    pub fn is_burst(&self) -> bool {
        self.sessions.iter().all(|s| s.start == 0.0)
    }

    /// The load it offers: requests per second over the span in which sessions start (a
    /// chat's later turns counted in), or for a burst the requests sent at once.
    pub fn offered(&self) -> f64 {
        let span = self.sessions.iter().map(|s| s.start).fold(0.0, f64::max);
        if self.is_burst() { self.requests() as f64 } else { self.requests() as f64 / span }
    }
}

/// Knobs shared by every workload.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Params {
    pub seed: u64,
    pub pods: usize,
    /// Multiplies every workload's request count (1.0 = the documented size).
    pub scale: f64,
    /// Multiplies every workload's arrival rate, and the burst's size (1.0 = as documented).
    pub load: f64,
    /// What clients ask for as `max_tokens`, when they ask for more than they get: every
    /// request still ends at its own output length (the model's end of sequence), which the
    /// routers then do not know. `None`: each asks for exactly its length.
    pub max_tokens: Option<usize>,
}

/// Every workload's name, in report order.
pub const NAMES: [&str; 10] = [
    "chat",
    "documents",
    "unique-long",
    "burst",
    "capacity",
    "tiered",
    "heterogeneous",
    "pd-mixed",
    "adapters",
    "hybrid",
];

/// Builds workload `name`.
pub fn build(name: &str, p: &Params) -> Option<Workload> {
    // The spread burst sends the burst's very requests.
    let mut g = Gen::new(p.seed, if name == "burst-100ms" { "burst" } else { name });
    Some(match name {
        "chat" => chat(&mut g, p),
        "documents" => documents(&mut g, p),
        "unique-long" => unique_long(&mut g, p),
        "burst" => burst(&mut g, p, 0.0),
        "burst-100ms" => burst(&mut g, p, 0.1),
        "live" => live(&mut g, p),
        "capacity" => capacity(&mut g, p),
        "tiered" => tiered(&mut g, p),
        "heterogeneous" => heterogeneous(&mut g, p),
        "pd-mixed" => pd_mixed(&mut g, p),
        "adapters" => adapters(&mut g, p),
        "hybrid" => hybrid(&mut g, p),
        _ => return None,
    })
}

/// Token-id source: each call to [`Gen::text`] yields ids no other call yields.
struct Gen {
    rng: StdRng,
    next_id: u32,
}

impl Gen {
    fn new(seed: u64, name: &str) -> Self {
        let salt = name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        Self { rng: StdRng::seed_from_u64(seed ^ salt), next_id: 1000 }
    }

    /// `n` fresh token ids (a text nobody else has written).
    fn text(&mut self, n: usize) -> Vec<u32> {
        let start = self.next_id;
        self.next_id += n as u32;
        // Shuffle within the block of fresh ids so texts do not look like counters.
        let mut ids: Vec<u32> = (start..start + n as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, self.rng.random_range(0..=i));
        }
        ids
    }

    /// A fresh text of `lo..=hi` tokens.
    fn text_between(&mut self, lo: usize, hi: usize) -> Vec<u32> {
        let n = self.between(lo, hi);
        self.text(n)
    }

    fn between(&mut self, lo: usize, hi: usize) -> usize {
        self.rng.random_range(lo..=hi)
    }

    /// Exponential with the given mean (Poisson inter-arrival times).
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.rng.random::<f64>()).ln()
    }

    /// Index in `0..n` with probability ∝ 1/(i+1)^s (a few popular items, a long tail).
    fn zipf(&mut self, n: usize, s: f64) -> usize {
        let weights: Vec<f64> = (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(s)).collect();
        let mut x = self.rng.random::<f64>() * weights.iter().sum::<f64>();
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        n - 1
    }
}

/// `n` sessions starting as a Poisson stream of `rate` per second, each made by `session`
/// (its prefix and turns).
fn poisson(
    g: &mut Gen,
    n: usize,
    rate: f64,
    mut session: impl FnMut(&mut Gen) -> (Vec<u32>, Vec<Turn>),
) -> Vec<Session> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += g.exp(1.0 / rate);
            let (prefix, turns) = session(g);
            Session { start: t, prefix, turns, adapter: None }
        })
        .collect()
}

/// One turn without think time.
fn turn(user: Vec<u32>, max_tokens: usize) -> Vec<Turn> {
    vec![Turn { user, max_tokens, think: 0.0 }]
}

fn scaled(p: &Params, n: usize) -> usize {
    ((n as f64 * p.scale).round() as usize).max(1)
}

/// Multi-turn chat: users share a few long system prompts; each turn re-sends the
/// conversation so far. Users start as a Poisson stream and think between turns.
fn chat(g: &mut Gen, p: &Params) -> Workload {
    let systems: Vec<Vec<u32>> = (0..8).map(|_| g.text(1500)).collect();
    let users = scaled(p, 60 * p.pods);
    let rate = 4.0 * p.pods as f64 * p.load; // users starting per second
    let sessions = poisson(g, users, rate, |g| {
        let system = systems[g.zipf(systems.len(), 1.0)].clone();
        let turns = (0..g.between(3, 6))
            .map(|_| Turn { user: g.text_between(50, 250), max_tokens: g.between(80, 250), think: g.exp(3.0) })
            .collect();
        (system, turns)
    });
    Workload {
        name: "chat",
        description: format!(
            "{users} users over 8 shared 1,500-token system prompts (Zipf), 3–6 turns each, 50–250-token messages, 80–250 output tokens, {rate} users/s, 3 s mean think time"
        ),
        sessions,
        num_blocks: 26_000,
        ..Workload::default()
    }
}

/// `n` single questions (20–80 tokens, 50–150 output tokens), each after one of `docs`
/// (Zipf 0.8), arriving as a Poisson stream of `rate` per second.
fn questions(g: &mut Gen, docs: &[Vec<u32>], n: usize, rate: f64) -> Vec<Session> {
    poisson(g, n, rate, |g| {
        let doc = docs[g.zipf(docs.len(), 0.8)].clone();
        (doc, turn(g.text_between(20, 80), g.between(50, 150)))
    })
}

/// `kvgate-live-bench`'s mix in virtual time (not among [`NAMES`]): per 4 pods, 48 chat
/// sessions of 6 turns over 6 system prompts of 1,750 tokens and 240 questions over 8
/// documents of 3,200 tokens (the sizes its Qwen3-tokenized texts have), in one shuffled
/// order, 24-token answers, on pods of 1,500 blocks — less than the prefixes take. Jobs start
/// as a Poisson stream; run with `--in-flight 24` (as that benchmark's clients) they queue
/// instead, each session's next turn behind everything already waiting.
fn live(g: &mut Gen, p: &Params) -> Workload {
    let systems: Vec<Vec<u32>> = (0..6).map(|_| g.text(1750)).collect();
    let documents: Vec<Vec<u32>> = (0..8).map(|_| g.text(3200)).collect();
    let (chats, questions) = (scaled(p, 12 * p.pods), scaled(p, 60 * p.pods));
    let mut jobs: Vec<Option<usize>> = (0..chats).map(Some).chain((0..questions).map(|_| None)).collect();
    for i in (1..jobs.len()).rev() {
        jobs.swap(i, g.rng.random_range(0..=i));
    }
    let mut jobs = jobs.into_iter();
    let rate = 9.0 * p.pods as f64 * p.load;
    let sessions = poisson(g, chats + questions, rate, |g| match jobs.next().flatten() {
        Some(chat) => {
            let turns = (0..6).map(|_| Turn { user: g.text_between(150, 190), max_tokens: 24, think: 0.0 }).collect();
            (systems[chat % systems.len()].clone(), turns)
        }
        None => (documents[g.between(0, documents.len() - 1)].clone(), turn(g.text_between(30, 50), 24)),
    });
    Workload {
        name: "live",
        description: format!(
            "{chats} chat sessions × 6 turns over 6 shared 1,750-token system prompts and {questions} questions over 8 shared 3,200-token documents, shuffled, 24 output tokens, pods of 1,500 blocks; Poisson {rate} jobs/s"
        ),
        sessions,
        num_blocks: 1500,
        ..Workload::default()
    }
}

/// Groups of questions about long shared documents (RAG, code review, …).
fn documents(g: &mut Gen, p: &Params) -> Workload {
    let docs: Vec<Vec<u32>> = (0..4 * p.pods).map(|_| g.text_between(3000, 6000)).collect();
    let n = scaled(p, 300 * p.pods);
    let rate = 12.0 * p.pods as f64 * p.load;
    let sessions = questions(g, &docs, n, rate);
    Workload {
        name: "documents",
        description: format!(
            "{n} questions (20–80 tokens) over {} shared documents of 3,000–6,000 tokens (Zipf 0.8), 50–150 output tokens, Poisson {rate}/s",
            docs.len()
        ),
        sessions,
        num_blocks: 26_000,
        ..Workload::default()
    }
}

/// Long unique prompts after one short common prefix: longest-prefix routing sees the same
/// small overlap everywhere it has been and piles requests on one pod.
fn unique_long(g: &mut Gen, p: &Params) -> Workload {
    let common = g.text(160);
    let n = scaled(p, 100 * p.pods);
    let rate = 5.0 * p.pods as f64 * p.load;
    let sessions = poisson(g, n, rate, |g| (common.clone(), turn(g.text_between(2000, 6000), g.between(50, 150))));
    Workload {
        name: "unique-long",
        description: format!(
            "{n} unique 2,000–6,000-token prompts after a common 160-token prefix, 50–150 output tokens, Poisson {rate}/s"
        ),
        sessions,
        num_blocks: 26_000,
        ..Workload::default()
    }
}

/// A burst: 1,000 requests (× scale × load) over 20 shared prefixes, at the same instant
/// (`burst`) or evenly over `span` seconds (`burst-100ms`, not among [`NAMES`]: what gateway
/// replicas that hear each other after a delay can do with a burst that takes some time).
fn burst(g: &mut Gen, p: &Params, span: f64) -> Workload {
    let prefixes: Vec<Vec<u32>> = (0..20).map(|_| g.text(2000)).collect();
    let n = ((1000.0 * p.scale * p.load).round() as usize).max(1);
    let sessions = (0..n)
        .map(|i| Session {
            start: span * i as f64 / n as f64,
            prefix: prefixes[i % prefixes.len()].clone(),
            turns: turn(g.text_between(50, 200), 100),
            adapter: None,
        })
        .collect();
    Workload {
        name: if span > 0.0 { "burst-100ms" } else { "burst" },
        description: if span > 0.0 {
            format!(
                "{n} requests evenly spread over {} ms, on 20 shared 2,000-token prefixes, 50–200 unique tokens, 100 output tokens",
                span * 1e3
            )
        } else {
            format!(
                "{n} requests at t = 0 over 20 shared 2,000-token prefixes, 50–200 unique tokens, 100 output tokens"
            )
        },
        sessions,
        num_blocks: 26_000,
        ..Workload::default()
    }
}

/// KV-capacity pressure (llm-d's benchmark setting): the prefixes in use need more KV than
/// one pod holds but fit in the cluster's, so only a router that partitions them keeps
/// them cached.
fn capacity(g: &mut Gen, p: &Params) -> Workload {
    let num_blocks = 3_000; // 48k tokens per pod
    // Working set ≈ 75 % of the cluster's KV, ≈ 6× one pod's.
    let groups = (p.pods * num_blocks * 16 * 3 / 4) / 6000;
    let rate = 10.0 * p.pods as f64 * p.load;
    let (n, sessions) = over_prefix_groups(g, p, groups, rate);
    Workload {
        name: "capacity",
        description: format!(
            "{n} requests over {groups} 6,000-token prefixes (uniform) on pods of {num_blocks} blocks (48k tokens): working set ≈ 6× one pod's cache, ≈ ¾ of the cluster's; Poisson {rate}/s"
        ),
        sessions,
        num_blocks,
        ..Workload::default()
    }
}

/// `capacity`'s and `tiered`'s requests: 300 per pod, Poisson at `rate`, each a short
/// question (50–100 output tokens) after one of `groups` 6,000-token prefixes drawn
/// uniformly. Returns (requests, sessions).
fn over_prefix_groups(g: &mut Gen, p: &Params, groups: usize, rate: f64) -> (usize, Vec<Session>) {
    let prefixes: Vec<Vec<u32>> = (0..groups).map(|_| g.text(6000)).collect();
    let n = scaled(p, 300 * p.pods);
    let sessions = poisson(g, n, rate, |g| {
        let turns = turn(g.text_between(30, 100), g.between(50, 100));
        (prefixes[g.between(0, groups - 1)].clone(), turns)
    });
    (n, sessions)
}

/// Tiered KV caches: `capacity`'s small GPU caches, each backed by a host-memory tier 8×
/// larger that every computed block is offloaded to (vLLM's OffloadingConnector with a CPU
/// backend), and a working set twice the cluster's GPU cache: a prefix the GPU evicted is
/// loaded back from host memory by the pod that held it, at an eighth of computing it.
fn tiered(g: &mut Gen, p: &Params) -> Workload {
    let num_blocks = 3_000; // 48k tokens per pod on the GPU
    let offload_blocks = 8 * num_blocks;
    let groups = p.pods * num_blocks * 16 * 2 / 6000;
    let rate = 5.0 * p.pods as f64 * p.load;
    let (n, sessions) = over_prefix_groups(g, p, groups, rate);
    Workload {
        name: "tiered",
        description: format!(
            "{n} requests over {groups} 6,000-token prefixes (uniform) on pods of {num_blocks} GPU blocks (48k tokens) offloading to {offload_blocks} host-memory blocks: working set ≈ 2× the cluster's GPU cache, ¼ of its host memory; Poisson {rate}/s"
        ),
        sessions,
        num_blocks,
        offload_blocks,
        ..Workload::default()
    }
}

/// A mixed fleet nobody configured the router for: every other pod is 2× slower (an older
/// GPU generation beside the newer one), and pod 0 — a fast one — has an eighth of the
/// cache. Questions over shared documents, as `documents`, at the rate of the fleet's
/// compute (¾ of as many fast pods).
fn heterogeneous(g: &mut Gen, p: &Params) -> Workload {
    let docs: Vec<Vec<u32>> = (0..4 * p.pods).map(|_| g.text_between(2000, 4000)).collect();
    let n = scaled(p, 300 * p.pods);
    let rate = 9.0 * p.pods as f64 * p.load;
    let sessions = questions(g, &docs, n, rate);
    let num_blocks = 26_000;
    let mut unlike: Vec<(usize, PodShape)> =
        (1..p.pods).step_by(2).map(|i| (i, PodShape { slowdown: 2.0, num_blocks })).collect();
    unlike.push((0, PodShape { slowdown: 1.0, num_blocks: num_blocks / 8 }));
    Workload {
        name: "heterogeneous",
        description: format!(
            "{n} questions (20–80 tokens) over {} shared documents of 2,000–4,000 tokens (Zipf 0.8), 50–150 output tokens, Poisson {rate}/s, on a mixed fleet: every other pod 2× slower, pod 0 with an eighth of the cache",
            docs.len()
        ),
        sessions,
        num_blocks,
        unlike,
        ..Workload::default()
    }
}

/// Mixed input lengths for prefill/decode disaggregation: mostly short prompts, some very
/// long ones, on a quarter prefill pods and three quarters decode pods.
fn pd_mixed(g: &mut Gen, p: &Params) -> Workload {
    let n = scaled(p, 160 * p.pods);
    let rate = 8.0 * p.pods as f64 * p.load;
    let sessions = poisson(g, n, rate, |g| {
        let len = if g.rng.random::<f64>() < 0.25 { g.between(6000, 10000) } else { g.between(100, 600) };
        (Vec::new(), turn(g.text(len), g.between(100, 300)))
    });
    Workload {
        name: "pd-mixed",
        description: format!(
            "{n} unique prompts, 75 % of 100–600 tokens and 25 % of 6,000–10,000, 100–300 output tokens, Poisson {rate}/s; {} prefill pods + {} decode pods",
            (p.pods / 4).max(1),
            p.pods - (p.pods / 4).max(1)
        ),
        sessions,
        num_blocks: 26_000,
        prefill_pods: (p.pods / 4).max(1),
        ..Workload::default()
    }
}

/// A fleet serving many LoRA adapters, as a platform hosting its tenants' fine-tunes does:
/// four adapters per pod, their popularity skewed (Zipf 1.0: a few carry most requests,
/// the tail a trickle), each with its own task prompt; every pod holds two adapters in a
/// batch (`--max-loras 2`) and takes 30 ms to load one onto its GPU.
fn adapters(g: &mut Gen, p: &Params) -> Workload {
    let count = 4 * p.pods;
    let tasks: Vec<Vec<u32>> = (0..count).map(|_| g.text_between(500, 1500)).collect();
    let n = scaled(p, 300 * p.pods);
    let rate = 8.0 * p.pods as f64 * p.load;
    let mut names = Vec::with_capacity(n);
    let mut sessions = poisson(g, n, rate, |g| {
        let adapter = g.zipf(count, 1.0);
        names.push(format!("adapter-{adapter}"));
        (tasks[adapter].clone(), turn(g.text_between(50, 300), g.between(50, 200)))
    });
    for (session, name) in sessions.iter_mut().zip(names) {
        session.adapter = Some(name);
    }
    Workload {
        name: "adapters",
        description: format!(
            "{n} requests for {count} LoRA adapters (Zipf 1.0), each adapter's task prompt of 500–1,500 tokens then 50–300 unique tokens, 50–200 output tokens, Poisson {rate}/s; pods hold 2 adapters per batch and load one in 30 ms"
        ),
        sessions,
        num_blocks: 26_000,
        max_loras: 2,
        lora_load_ms: 30.0,
        ..Workload::default()
    }
}

/// A hybrid model's fleet (gpt-oss: sliding-window attention over 128 tokens beside full
/// attention) on pods of an eighth of the reference cache: questions over shared documents
/// as in `documents`, each after the document read up to a chunk of 512 tokens drawn at
/// random (an agent's or a reader's place in it). A pod frees the window group's blocks of
/// a document as its prefill moves past them, and the pool evicts those first: a prefix
/// still cached in the full-attention group is served only as far back as the window group
/// still holds the blocks of its last window.
fn hybrid(g: &mut Gen, p: &Params) -> Workload {
    let docs: Vec<Vec<u32>> = (0..4 * p.pods).map(|_| g.text_between(3000, 6000)).collect();
    let n = scaled(p, 300 * p.pods);
    let rate = 12.0 * p.pods as f64 * p.load;
    let window = 128;
    let sessions = poisson(g, n, rate, |g| {
        let doc = &docs[g.zipf(docs.len(), 0.8)];
        let read = (512 * g.between(2, doc.len() / 512)).min(doc.len());
        (doc[..read].to_vec(), turn(g.text_between(20, 80), g.between(50, 150)))
    });
    Workload {
        name: "hybrid",
        description: format!(
            "{n} questions (20–80 tokens) over {} shared documents of 3,000–6,000 tokens (Zipf 0.8), each read up to a random 512-token chunk, 50–150 output tokens, Poisson {rate}/s, on pods of 3,250 blocks running a hybrid model (a {window}-token sliding window beside full attention)",
            docs.len()
        ),
        sessions,
        num_blocks: 26_000 / 8,
        sliding_window: Some(window),
        ..Workload::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_deterministic_and_share_only_intended_prefixes() {
        let p = Params { seed: 3, pods: 8, scale: 0.1, load: 1.0, max_tokens: None };
        for name in NAMES {
            let a = build(name, &p).unwrap();
            let b = build(name, &p).unwrap();
            assert_eq!(a.requests(), b.requests(), "{name}");
            assert_eq!(a.sessions[0].turns[0].user, b.sessions[0].turns[0].user, "{name}: seeded");
            assert!(a.requests() > 0);
        }
        let docs = build("documents", &p).unwrap();
        let users: Vec<&Vec<u32>> = docs.sessions.iter().map(|s| &s.turns[0].user).collect();
        for (i, u) in users.iter().enumerate() {
            assert!(!users[i + 1..].iter().any(|v| v[0] == u[0]), "questions are unique");
        }
        assert!(build("nope", &p).is_none());
        assert_ne!(
            build("chat", &Params { seed: 4, ..p }).unwrap().sessions[0].turns[0].user,
            build("chat", &p).unwrap().sessions[0].turns[0].user
        );
    }

    #[test]
    fn the_live_mix_is_the_live_benchmarks_sessions_and_questions_on_small_caches() {
        let p = Params { seed: 1, pods: 4, scale: 1.0, load: 1.0, max_tokens: None };
        let w = build("live", &p).unwrap();
        let chats: Vec<&Session> = w.sessions.iter().filter(|s| s.turns.len() == 6).collect();
        let questions: Vec<&Session> = w.sessions.iter().filter(|s| s.turns.len() == 1).collect();
        assert_eq!((chats.len(), questions.len(), w.requests()), (48, 240, 528));
        let distinct = |sessions: &[&Session]| {
            sessions.iter().map(|s| s.prefix.as_slice()).collect::<std::collections::HashSet<_>>().len()
        };
        assert_eq!((distinct(&chats), distinct(&questions)), (6, 8), "6 system prompts, 8 documents");
        assert!(chats.iter().all(|s| s.prefix.len() == 1750) && questions.iter().all(|s| s.prefix.len() == 3200));
        assert!(w.sessions.iter().flat_map(|s| &s.turns).all(|t| t.max_tokens == 24 && t.think == 0.0));
        assert_eq!(w.num_blocks, 1500);
        // Shuffled: chats are spread through the order, not bunched at its start.
        let first_half = w.sessions[..w.sessions.len() / 2].iter().filter(|s| s.turns.len() == 6).count();
        assert!((12..=36).contains(&first_half), "{first_half} of 48 chats in the first half");
        assert!(!NAMES.contains(&"live"), "a diagnostic, not one of `all`");
    }

    #[test]
    fn the_spread_burst_is_the_burst_over_100_ms() {
        let p = Params { seed: 3, pods: 8, scale: 1.0, load: 1.0, max_tokens: None };
        let (at_once, spread) = (build("burst", &p).unwrap(), build("burst-100ms", &p).unwrap());
        assert!(at_once.is_burst() && !spread.is_burst());
        assert_eq!(at_once.requests(), spread.requests());
        for (a, b) in at_once.sessions.iter().zip(&spread.sessions) {
            assert_eq!((&a.prefix, &a.turns[0].user), (&b.prefix, &b.turns[0].user), "the same requests");
        }
        let starts: Vec<f64> = spread.sessions.iter().map(|s| s.start).collect();
        assert!(starts.windows(2).all(|w| w[0] < w[1]) && starts[0] == 0.0 && *starts.last().unwrap() < 0.1);
        assert!((spread.offered() - 10_000.0).abs() < 20.0, "1,000 requests in 100 ms: {}", spread.offered());
    }

    #[test]
    fn adapter_requests_are_skewed_and_each_adapter_keeps_its_task_prompt() {
        let p = Params { seed: 3, pods: 8, scale: 1.0, load: 1.0, max_tokens: None };
        let w = build("adapters", &p).unwrap();
        let mut by_adapter: std::collections::HashMap<&str, Vec<&Session>> = Default::default();
        for s in &w.sessions {
            by_adapter.entry(s.adapter.as_deref().expect("every request names an adapter")).or_default().push(s);
        }
        assert_eq!(by_adapter.len(), 32, "four adapters per pod, all drawn");
        let (top, tail) = (by_adapter["adapter-0"].len(), by_adapter["adapter-31"].len());
        assert!(top > 15 * tail, "Zipf 1.0 over 32: the first ~32× the last ({top} vs {tail})");
        assert!(by_adapter.values().all(|s| s.iter().all(|x| x.prefix == s[0].prefix)), "one task prompt each");
        assert!(w.max_loras == 2 && w.lora_load_ms > 0.0);
    }
}
