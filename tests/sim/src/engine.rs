//! A continuous-batching engine in the manner of vLLM V1's scheduler, in model time.
//!
//! The engine owns the [`BlockPool`] and a queue of requests. Each [`Engine::step`] builds
//! one batch under a token budget (`max_num_batched_tokens`) and a sequence cap
//! (`max_num_seqs`): first the running requests (one token each when decoding, a chunk of
//! the prompt when prefilling), then waiting requests in arrival order while blocks and
//! budget last. A request that finds its prefix cached skips those tokens, including blocks
//! a request ahead of it in the same step is about to compute (blocks are cached as their
//! step is scheduled, as in vLLM). When a decode step cannot get a block, the most recently
//! admitted request is preempted (its blocks are freed and it is recomputed later, as vLLM
//! does). The step's duration comes from the [`TimingModel`]; the engine's clock advances
//! by it.
//!
//! Nothing here does I/O or reads a wall clock, so the same engine runs live behind the HTTP
//! server (`kvgate-sim`) and in an offline cluster simulator in virtual time.

use crate::cache::{
    BlockId, BlockPool, CacheChange, EngineBlockHash, HashKeys, KvGroup, OffloadTier, block_hash, hash_blocks,
    root_hash,
};
use crate::timing::{StepWork, TimingModel, prefill_pairs};
use ahash::{AHashMap, AHashSet};
use std::collections::VecDeque;

/// Engine-internal request id.
pub type RequestId = u64;

/// Sizes and limits of the engine; defaults are vLLM V1's for an 80 GB GPU.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM `--block-size`, default 16).
    pub block_size: usize,
    /// KV blocks in the pool. Default 26,000: an H100 80 GB at 0.9 memory utilisation less
    /// 16 GB of Llama-8B weights leaves ≈ 56 GB; at 128 KiB per token that is ≈ 420k tokens
    /// ≈ 26k blocks of 16.
    pub num_blocks: usize,
    /// Most sequences in one batch (vLLM V1 default for ≥ 70 GiB GPUs in the API server: 1024).
    pub max_num_seqs: usize,
    /// Token budget per step (vLLM V1 default for ≥ 70 GiB GPUs in the API server: 8192).
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output (Llama-3.1-8B: 131072).
    pub max_model_len: usize,
    /// Seed of the block-hash chain (vLLM: `PYTHONHASHSEED`); `None` = random per engine.
    pub hash_seed: Option<String>,
    /// Blocks of a host-memory offload tier (vLLM's `OffloadingConnector`, `num_cpu_blocks`);
    /// 0: none.
    pub offload_blocks: usize,
    pub timing: TimingModel,
    /// LoRA adapters one batch may hold (vLLM `--max-loras`, default 1 there): a waiting
    /// request of another adapter is passed over while that many are running. 0: no limit.
    pub max_loras: usize,
    /// Milliseconds a step takes longer for each adapter it brings onto the GPU (one not among
    /// the last `max_loras` it ran).
    pub lora_load_ms: f64,
    /// Runs as a hybrid model (gpt-oss, Gemma 3): full attention beside sliding-window
    /// attention over this many tokens, a KV-cache group each in the one pool, a prefix hit
    /// only as far as both serve it (vLLM's hybrid coordinator). `None`: full attention only.
    pub sliding_window: Option<usize>,
    /// Token ids the engine "generates", cycled (the text is filler; counts and timing are real).
    pub filler_tokens: Vec<u32>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 26_000,
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            max_model_len: 131_072,
            hash_seed: None,
            offload_blocks: 0,
            timing: TimingModel::default(),
            max_loras: 0,
            lora_load_ms: 0.0,
            sliding_window: None,
            filler_tokens: vec![0],
        }
    }
}

/// The KV-transfer role of one request in prefill/decode disaggregation.
#[derive(Clone, Debug, PartialEq)]
pub enum KvTransfer {
    /// An ordinary request: prefill and decode here.
    Local,
    /// Prefill side (`do_remote_decode`): prefill, sample one token, hand the KV over.
    RemoteDecode,
    /// Decode side (`do_remote_prefill`): the prompt's KV is pulled from a prefill pod
    /// instead of computed; only the last prompt token is computed here.
    RemotePrefill,
}

/// A request as the engine sees it: token ids and limits.
#[derive(Clone, Debug)]
pub struct NewRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub keys: HashKeys,
    pub kv_transfer: KvTransfer,
}

/// Why a request cannot be accepted (the HTTP layer answers 400).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    NoOutput,
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested {requested} tokens ({prompt} in the messages, {output} in the completion). Please reduce the length of the messages or completion."
    )]
    TooLong { max_model_len: usize, requested: usize, prompt: usize, output: usize },
    #[error("the prompt needs {needed} KV blocks but the engine has only {available}")]
    TooManyBlocks { needed: usize, available: usize },
}

/// Why a request stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens` (the simulator never samples an end-of-sequence token).
    Length,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
        }
    }
}

/// Token accounting of a finished request, as in the OpenAI `usage` object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
}

/// A sampled token, and how its request ended if this was the last one.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub id: RequestId,
    pub token: u32,
    pub finished: Option<Finished>,
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    /// For a prefill-side (`RemoteDecode`) request, the blocks holding its prompt's KV, for
    /// the decode pod's transfer parameters.
    pub kv_blocks: Option<Vec<BlockId>>,
}

/// The outcome of one engine step.
#[derive(Clone, Debug, Default)]
pub struct StepResult {
    /// Model time the step took, in seconds.
    pub duration: f64,
    pub work: StepWork,
    pub outputs: Vec<Output>,
    /// Cache changes in order: the KV events of this step.
    pub cache_changes: Vec<CacheChange>,
}

/// Running totals, exported as vLLM's Prometheus counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Prompt tokens computed by this engine's prefill (cached and transferred ones excluded).
    pub prefill_tokens_computed: u64,
    /// Prompt tokens whose KV was pulled from a prefill pod.
    pub transferred_tokens: u64,
    /// Prompt tokens whose KV was loaded back from the offload tier.
    pub offload_loaded_tokens: u64,
    pub preemptions: u64,
    pub finished_requests: u64,
    pub steps: u64,
}

#[derive(Clone)]
struct Sequence {
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    keys: HashKeys,
    kv_transfer: KvTransfer,
    /// Hashes of the full blocks of `tokens` computed so far (grows with the sequence).
    hashes: Vec<EngineBlockHash>,
    blocks: Vec<BlockId>,
    /// A hybrid model's sliding-window group's blocks, by block number: `None` where the
    /// window has moved past (freed, or skipped on a prefix hit).
    window_blocks: Vec<Option<BlockId>>,
    /// Tokens whose KV is computed (or loaded).
    computed: usize,
    /// Leading blocks already registered in the cache (hit or stored by this sequence).
    registered: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    cached_tokens: Option<usize>,
    /// Model time at which a pending KV transfer (from a prefill pod or the offload tier)
    /// completes, and the tokens computed then.
    transfer_done_at: Option<f64>,
    transfer_to: usize,
}

impl Sequence {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// What a request added to an engine now waits behind, at least: vLLM's scheduler serves the
/// running requests first (what each has left to compute for its next token; a decode's
/// one), then the waiting ones in arrival order (their tokens neither cached now nor
/// computed first by a request ahead; at least one each, as vLLM recomputes a fully cached
/// prompt's last block; one where the offload tier may hold the rest). Requests waiting for
/// a KV transfer, and waiting requests an adapter limit may pass over, count nothing.
#[derive(Clone, Debug, Default)]
pub struct Backlog {
    /// Tokens computed before the request is scheduled at all.
    pub tokens: usize,
    /// The blocks the requests ahead hold or will compute.
    queued: AHashSet<EngineBlockHash>,
}

/// The simulated engine (cloned, it runs a what-if: the simulator's clairvoyant bound).
pub struct Engine {
    config: EngineConfig,
    root: EngineBlockHash,
    pool: BlockPool,
    offload: Option<OffloadTier>,
    seqs: AHashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    next_id: RequestId,
    now: f64,
    counters: Counters,
    /// The adapters on the GPU, the least recently run first (at most `max_loras`).
    resident_loras: VecDeque<String>,
    /// Bumped by every change of state (see [`Engine::revision`]).
    revision: u64,
}

/// By hand, for `clone_from`: a what-if copies an engine into the allocations of the last
/// (a pool of 26,000 blocks is megabytes).
impl Clone for Engine {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            root: self.root,
            pool: self.pool.clone(),
            offload: self.offload.clone(),
            seqs: self.seqs.clone(),
            waiting: self.waiting.clone(),
            running: self.running.clone(),
            next_id: self.next_id,
            now: self.now,
            counters: self.counters,
            resident_loras: self.resident_loras.clone(),
            revision: self.revision,
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.config.clone_from(&source.config);
        self.root = source.root;
        self.pool.clone_from(&source.pool);
        self.offload.clone_from(&source.offload);
        self.seqs.clone_from(&source.seqs);
        self.waiting.clone_from(&source.waiting);
        self.running.clone_from(&source.running);
        self.next_id = source.next_id;
        self.now = source.now;
        self.counters = source.counters;
        self.resident_loras.clone_from(&source.resident_loras);
        self.revision = source.revision;
    }
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        assert!(!config.filler_tokens.is_empty(), "filler_tokens must not be empty");
        let pool = BlockPool::new(config.num_blocks, config.block_size);
        let root = root_hash(config.hash_seed.as_deref());
        let offload = (config.offload_blocks > 0).then(|| OffloadTier::new(config.offload_blocks));
        Self {
            config,
            root,
            pool,
            offload,
            seqs: AHashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            now: 0.0,
            counters: Counters::default(),
            resident_loras: VecDeque::new(),
            revision: 0,
        }
    }

    /// Changes whenever the engine's state does (a step, a request added or aborted, the
    /// clock moved, the cache reset): two equal revisions of one engine run ahead alike, so
    /// a what-if may keep what it learned of one.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Model time, seconds.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Moves the clock forward to `t` (never back): idle time between arrivals.
    pub fn advance_to(&mut self, t: f64) {
        if t > self.now {
            self.now = t;
            self.revision += 1;
        }
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// vLLM's `kv_cache_usage_perc`: fraction of blocks held by requests.
    pub fn kv_cache_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Distinct block hashes currently cached.
    pub fn cached_blocks(&self) -> usize {
        self.pool.num_cached_hashes()
    }

    /// Full prompt blocks of `tokens` that are cached right now (what a perfect router sees).
    pub fn cached_prefix_blocks(&self, tokens: &[u32], keys: &HashKeys) -> usize {
        let hashes = self.block_hashes(tokens, keys);
        self.cache_hit(&hashes, hashes.len())
    }

    /// The hashes of the full blocks of `tokens`, as this engine hashes them (engines with
    /// the same [`Engine::hash_root`] and block size hash alike).
    pub fn block_hashes(&self, tokens: &[u32], keys: &HashKeys) -> Vec<EngineBlockHash> {
        hash_blocks(&self.root, tokens, self.config.block_size, keys)
    }

    /// The root of this engine's block hashes (from its hash seed).
    pub fn hash_root(&self) -> EngineBlockHash {
        self.root
    }

    /// Blocks of `hashes` from `from` on that the offload tier holds, one after the other
    /// (after a GPU hit of `from` blocks they would load, not compute).
    pub fn offloaded_run(&self, hashes: &[EngineBlockHash], from: usize) -> usize {
        self.offload.as_ref().map_or(0, |tier| tier.run_of(&hashes[from.min(hashes.len())..]))
    }

    /// What a request added now waits behind, at least ([`Backlog`]).
    pub fn backlog(&self) -> Backlog {
        let bs = self.config.block_size;
        let mut backlog = Backlog::default();
        for seq in self.running.iter().map(|id| &self.seqs[id]) {
            if seq.transfer_done_at.is_none() {
                backlog.tokens += seq.tokens.len() - seq.computed;
            }
            backlog.queued.extend(seq.hashes.iter().copied());
        }
        if self.config.max_loras > 0 {
            return backlog; // a waiting request's adapter may have it passed over
        }
        for seq in self.waiting.iter().map(|id| &self.seqs[id]) {
            if seq.kv_transfer != KvTransfer::Local {
                continue;
            }
            backlog.tokens += match self.offload {
                Some(_) => 1,
                None => {
                    let hit = self.cached_or_queued_prefix(&seq.hashes, &backlog);
                    (seq.tokens.len() - seq.computed).saturating_sub(hit * bs).max(1)
                }
            };
            backlog.queued.extend(seq.hashes.iter().copied());
        }
        backlog
    }

    /// Leading blocks of these [`Engine::block_hashes`] that are cached now or that a
    /// request in `backlog` computes first (a request added now finds them cached).
    pub fn cached_or_queued_prefix(&self, hashes: &[EngineBlockHash], backlog: &Backlog) -> usize {
        let group = self.full_group();
        hashes.iter().take_while(|h| self.pool.holds(h, group) || backlog.queued.contains(*h)).count()
    }

    /// KV-cache groups: 2 for a hybrid model, else 1.
    fn groups(&self) -> usize {
        1 + usize::from(self.config.sliding_window.is_some())
    }

    /// The full-attention group, when the model is hybrid (else its blocks carry no group).
    fn full_group(&self) -> Option<KvGroup> {
        self.config.sliding_window.map(|_| KvGroup { index: 0, sliding_window: None })
    }

    /// The sliding-window group of a hybrid model.
    fn window_group(&self) -> Option<KvGroup> {
        self.config.sliding_window.map(|w| KvGroup { index: 1, sliding_window: Some(w as u32) })
    }

    /// Blocks of the sliding-window group a hit needs: those of its last window.
    fn window_blocks_needed(&self) -> usize {
        self.config.sliding_window.map_or(0, |w| w.saturating_sub(1).div_ceil(self.config.block_size).max(1))
    }

    /// Leading blocks of `hashes` (at most `max`) served from the cache: the full-attention
    /// prefix; for a hybrid model, cut to where the window group holds the blocks of its last
    /// window — the first such run scanning from the right, else its run from the first block
    /// (vLLM 0.33's `SlidingWindowManager.find_longest_cache_hit`, one round for one full
    /// and one other group).
    fn cache_hit(&self, hashes: &[EngineBlockHash], max: usize) -> usize {
        let full = self.pool.longest_cached_prefix(&hashes[..max], self.full_group());
        let Some(group) = self.window_group() else { return full };
        let needed = self.window_blocks_needed();
        let mut run = 0;
        for i in (0..full).rev() {
            if !self.pool.holds(&hashes[i], Some(group)) {
                run = 0;
                continue;
            }
            run += 1;
            if run == needed {
                return i + run;
            }
        }
        run
    }

    /// `n` new blocks for each KV-cache group: (full attention's, the window group's).
    fn allocate_blocks(&mut self, n: usize) -> Option<(Vec<BlockId>, Vec<BlockId>)> {
        let mut blocks = self.try_allocate(n * self.groups())?;
        let window = blocks.split_off(n);
        Some((blocks, window))
    }

    /// Returns all of a sequence's blocks to the pool.
    fn free_blocks(pool: &mut BlockPool, seq: &mut Sequence) {
        pool.free(&seq.blocks);
        let window: Vec<BlockId> = seq.window_blocks.drain(..).flatten().collect();
        pool.free(&window);
    }

    /// Queues a request; it is scheduled by the next steps.
    pub fn add_request(&mut self, request: NewRequest) -> Result<RequestId, EngineError> {
        let prompt = request.prompt.len();
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if request.max_tokens == 0 {
            return Err(EngineError::NoOutput);
        }
        let output = if request.kv_transfer == KvTransfer::RemoteDecode { 1 } else { request.max_tokens };
        if prompt + output > self.config.max_model_len {
            return Err(EngineError::TooLong {
                max_model_len: self.config.max_model_len,
                requested: prompt + output,
                prompt,
                output,
            });
        }
        let needed = (prompt + output).div_ceil(self.config.block_size) * self.groups();
        let available = self.pool.num_blocks();
        if needed > available {
            return Err(EngineError::TooManyBlocks { needed, available });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.revision += 1;
        let hashes = self.block_hashes(&request.prompt, &request.keys);
        self.seqs.insert(
            id,
            Sequence {
                tokens: request.prompt,
                prompt_len: prompt,
                max_tokens: output,
                keys: request.keys,
                kv_transfer: request.kv_transfer,
                hashes,
                blocks: Vec::new(),
                window_blocks: Vec::new(),
                computed: 0,
                registered: 0,
                cached_tokens: None,
                transfer_done_at: None,
                transfer_to: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Drops a request (client went away); its blocks return to the pool, still cached.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(mut seq) = self.seqs.remove(&id) else { return false };
        self.revision += 1;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        Self::free_blocks(&mut self.pool, &mut seq);
        true
    }

    /// `POST /reset_prefix_cache`: forget every cached block. Refused while requests hold
    /// blocks (vLLM refuses too); the error says how many.
    pub fn reset_prefix_cache(&mut self) -> Result<Vec<CacheChange>, usize> {
        self.pool.reset()?;
        self.revision += 1;
        if let Some(tier) = &mut self.offload {
            tier.clear();
        }
        Ok(self.pool.take_changes())
    }

    /// When idle with requests waiting only for KV transfers: the model time the first
    /// completes, so a driver knows how long to sleep.
    pub fn next_wakeup(&self) -> Option<f64> {
        self.running.iter().filter_map(|id| self.seqs[id].transfer_done_at).reduce(f64::min)
    }

    /// The LoRA adapters `vllm:lora_requests_info` lists as running and as waiting, as vLLM
    /// 0.32 lists them: both lists name every adapter with a request in the engine, running or
    /// waiting (its `LoRARequestStates` fills both from one dict's keys), each once.
    pub fn adapters(&self) -> (Vec<String>, Vec<String>) {
        let all = self.loras_of(self.running.iter().chain(self.waiting.iter()));
        (all.clone(), all)
    }

    /// The adapters of these requests, each once.
    fn loras_of<'a>(&self, ids: impl Iterator<Item = &'a RequestId>) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for name in ids.filter_map(|id| self.seqs[id].keys.lora_name.as_ref()) {
            if !out.contains(name) {
                out.push(name.clone());
            }
        }
        out
    }

    /// Requests that have not produced a token yet (queued, or still prefilling).
    pub fn awaiting_first_token(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.seqs.iter().filter(|(_, seq)| seq.output_len() == 0).map(|(id, _)| *id)
    }

    /// True when no request is queued or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Runs one step at the current model time. `None` when nothing can be scheduled now
    /// (idle, or only waiting for transfers: see [`Engine::next_wakeup`]).
    pub fn step(&mut self) -> Option<StepResult> {
        self.revision += 1;
        self.complete_transfers();
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<(RequestId, usize)> = Vec::with_capacity(self.running.len() + 8);
        let mut work = StepWork::default();
        let mut preempted = false;

        // 1. Running requests, oldest first.
        let (bs, window) = (self.config.block_size, self.window_group());
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            if seq.transfer_done_at.is_some() {
                i += 1;
                continue;
            }
            let n = (seq.tokens.len() - seq.computed).min(budget);
            let needed = (seq.computed + n).div_ceil(bs).saturating_sub(seq.blocks.len());
            match self.allocate_blocks(needed) {
                Some((blocks, window_blocks)) => {
                    let seq = self.seqs.get_mut(&id).expect("running request exists");
                    seq.blocks.extend(blocks);
                    if window.is_some() {
                        seq.window_blocks.extend(window_blocks.into_iter().map(Some));
                    }
                    let upto = seq.computed + n;
                    register_full_blocks(&mut self.pool, self.offload.as_mut(), seq, upto, bs, &self.root, window);
                    budget -= n;
                    scheduled.push((id, n));
                    i += 1;
                }
                None => {
                    // Preempt the newest request (possibly this one) and try again; the
                    // newest sits at index >= i, so nothing scheduled is undone.
                    let victim = *self.running.last().expect("running is not empty");
                    self.preempt(victim);
                    preempted = true;
                }
            }
        }

        // 2. Waiting requests, in arrival order (none after a preemption, as in vLLM). One
        // whose adapter would exceed `max_loras` beside the running ones is passed over.
        let limited = self.config.max_loras > 0;
        let mut batch_loras = if limited { self.loras_of(self.running.iter()) } else { Vec::new() };
        let mut passed_over = VecDeque::new();
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            if let Some(lora) = &self.seqs[&id].keys.lora_name
                && limited
                && batch_loras.len() >= self.config.max_loras
                && !batch_loras.contains(lora)
            {
                passed_over.push_back(self.waiting.pop_front().expect("peeked"));
                continue;
            }
            match self.admit(id, budget) {
                Some(n) => {
                    self.waiting.pop_front();
                    self.running.push(id);
                    if let Some(lora) = &self.seqs[&id].keys.lora_name
                        && limited
                        && !batch_loras.contains(lora)
                    {
                        batch_loras.push(lora.clone());
                    }
                    if n > 0 {
                        budget -= n;
                        scheduled.push((id, n));
                    }
                }
                None => break, // not enough free blocks: wait for running requests to finish
            }
        }
        while let Some(id) = passed_over.pop_back() {
            self.waiting.push_front(id);
        }

        if scheduled.is_empty() {
            // Admissions with pending transfers change state but compute nothing.
            return None;
        }
        for &(id, n) in &scheduled {
            let seq = &self.seqs[&id];
            work.tokens += n as u64;
            if seq.computed < seq.prompt_len {
                work.prefill_pairs += prefill_pairs(seq.computed as u64, n as u64);
            } else {
                work.decode_context += (seq.computed + n) as u64;
            }
        }
        let loads = self.load_loras(&scheduled);
        let duration = (self.config.timing.step_ms(&work) + loads as f64 * self.config.lora_load_ms) / 1000.0;
        self.now += duration;
        self.counters.steps += 1;

        let mut outputs = Vec::with_capacity(scheduled.len() * 2);
        for (id, n) in scheduled {
            self.advance(id, n, &mut outputs);
        }
        Some(StepResult { duration, work, outputs, cache_changes: self.pool.take_changes() })
    }

    /// Brings the adapters of this step's requests onto the GPU (the least recently run leave
    /// when more than `max_loras` are there): how many had to be loaded.
    fn load_loras(&mut self, scheduled: &[(RequestId, usize)]) -> usize {
        let mut loads = 0;
        for (id, _) in scheduled {
            let Some(lora) = self.seqs[id].keys.lora_name.clone() else { continue };
            match self.resident_loras.iter().position(|l| *l == lora) {
                Some(at) => {
                    self.resident_loras.remove(at);
                }
                None => loads += 1,
            }
            self.resident_loras.push_back(lora);
            if self.config.max_loras > 0 && self.resident_loras.len() > self.config.max_loras {
                self.resident_loras.pop_front();
            }
        }
        loads
    }

    /// Cache changes made outside steps (admissions that only touched or evicted blocks).
    pub fn take_cache_changes(&mut self) -> Vec<CacheChange> {
        self.pool.take_changes()
    }

    fn try_allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n == 0 { Some(Vec::new()) } else { self.pool.allocate(n) }
    }

    /// Admits a waiting request: looks up its cached prefix, takes blocks for what it will
    /// compute (or receive) now. Returns the tokens to compute in this step, or `None` when
    /// the pool cannot hold it yet.
    fn admit(&mut self, id: RequestId, budget: usize) -> Option<usize> {
        let bs = self.config.block_size;
        let (full_group, window_group, window_needed) =
            (self.full_group(), self.window_group(), self.window_blocks_needed());
        let seq = self.seqs.get_mut(&id).expect("waiting request exists");
        // A preempted request recomputes its generated tokens too: hash all full blocks.
        extend_hashes(seq, seq.tokens.len() / bs, &self.root, bs);
        // At least one token must be computed to sample from, so a fully cached prompt
        // recomputes its last block (vLLM does the same).
        let max_hit = (seq.tokens.len() - 1) / bs;
        let hit = self.cache_hit(&self.seqs[&id].hashes, max_hit);
        let seq = self.seqs.get_mut(&id).expect("waiting request exists");
        let remote = seq.kv_transfer == KvTransfer::RemotePrefill;
        // The offload tier's blocks right after the GPU hit are loaded, not computed.
        let loaded = match &mut self.offload {
            Some(tier) if !remote => tier.take_run(&seq.hashes[hit..max_hit]),
            _ => 0,
        };
        let target = if remote {
            seq.tokens.len()
        } else if loaded > 0 {
            (hit + loaded) * bs
        } else {
            (hit * bs + budget).min(seq.tokens.len())
        };
        let needed = target.div_ceil(bs) - hit;
        // The window group keeps only its last window's blocks before the hit.
        let window_from = hit.saturating_sub(window_needed);
        let touched = self.pool.touch(&seq.hashes[..hit], full_group);
        let touched_window = if window_group.is_some() {
            self.pool.touch(&seq.hashes[window_from..hit], window_group)
        } else {
            Vec::new()
        };
        let Some((fresh, fresh_window)) = self.allocate_blocks(needed) else {
            self.pool.free(&touched);
            self.pool.free(&touched_window);
            return None;
        };
        let seq = self.seqs.get_mut(&id).expect("waiting request exists");
        seq.blocks = touched;
        seq.blocks.extend(fresh);
        if window_group.is_some() {
            seq.window_blocks = vec![None; window_from];
            seq.window_blocks.extend(touched_window.into_iter().chain(fresh_window).map(Some));
        }
        seq.computed = hit * bs;
        seq.registered = hit;
        let first_admission = seq.cached_tokens.is_none();
        if first_admission {
            seq.cached_tokens = Some((hit + loaded) * bs);
            self.counters.prefix_cache_queries += seq.prompt_len as u64;
            self.counters.prefix_cache_hits += (hit * bs) as u64;
            self.counters.prompt_tokens += seq.prompt_len as u64;
        }
        if remote {
            let transferred = seq.prompt_len - 1 - seq.computed.min(seq.prompt_len - 1);
            seq.transfer_done_at = Some(self.now + self.config.timing.transfer_ms(transferred as u64) / 1000.0);
            seq.transfer_to = seq.prompt_len - 1;
            return Some(0);
        }
        if loaded > 0 {
            // vLLM's connector loads asynchronously; the request waits for its blocks.
            self.counters.offload_loaded_tokens += (loaded * bs) as u64;
            seq.transfer_done_at = Some(self.now + self.config.timing.offload_load_ms((loaded * bs) as u64) / 1000.0);
            seq.transfer_to = (hit + loaded) * bs;
            return Some(0);
        }
        register_full_blocks(&mut self.pool, self.offload.as_mut(), seq, target, bs, &self.root, window_group);
        Some(target - seq.computed)
    }

    /// Pulled KV has arrived: all prompt tokens but the last count as computed, and the
    /// received full blocks are cached (announced like locally computed ones).
    fn complete_transfers(&mut self) {
        let (now, bs, window) = (self.now, self.config.block_size, self.window_group());
        for &id in &self.running {
            let seq = self.seqs.get_mut(&id).expect("running request exists");
            if seq.transfer_done_at.is_some_and(|t| t <= now) {
                seq.transfer_done_at = None;
                let loaded = seq.transfer_to;
                if seq.kv_transfer == KvTransfer::RemotePrefill {
                    self.counters.transferred_tokens += (loaded - seq.computed.min(loaded)) as u64;
                }
                seq.computed = seq.computed.max(loaded);
                let upto = seq.computed;
                register_full_blocks(&mut self.pool, self.offload.as_mut(), seq, upto, bs, &self.root, window);
                free_skipped_window_blocks(&mut self.pool, seq, bs, window);
            }
        }
    }

    /// Applies `n` computed tokens to a request (their blocks were cached when the step was
    /// scheduled): frees the window blocks they moved past, samples a token when the whole
    /// sequence is computed, finishes it at its limit.
    fn advance(&mut self, id: RequestId, n: usize, outputs: &mut Vec<Output>) {
        let bs = self.config.block_size;
        let window = self.window_group();
        let seq = self.seqs.get_mut(&id).expect("scheduled request exists");
        let prompt_computed = seq.prompt_len.saturating_sub(seq.computed).min(n);
        self.counters.prefill_tokens_computed += prompt_computed as u64;
        seq.computed += n;
        free_skipped_window_blocks(&mut self.pool, seq, bs, window);
        if seq.computed < seq.tokens.len() {
            return; // a prompt chunk; more to prefill
        }
        let filler = &self.config.filler_tokens;
        let token = filler[seq.output_len() % filler.len()];
        seq.tokens.push(token);
        self.counters.generation_tokens += 1;
        let mut finished = None;
        if seq.output_len() >= seq.max_tokens {
            let mut seq = self.seqs.remove(&id).expect("scheduled request exists");
            self.running.retain(|&r| r != id);
            let kv_blocks = (seq.kv_transfer == KvTransfer::RemoteDecode)
                .then(|| seq.blocks[..seq.prompt_len.div_ceil(bs).min(seq.blocks.len())].to_vec());
            Self::free_blocks(&mut self.pool, &mut seq);
            self.counters.finished_requests += 1;
            finished = Some(Finished {
                reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: seq.prompt_len,
                    completion_tokens: seq.output_len(),
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                },
                kv_blocks,
            });
        }
        outputs.push(Output { id, token, finished });
    }

    fn preempt(&mut self, id: RequestId) {
        let seq = self.seqs.get_mut(&id).expect("preempted request exists");
        Self::free_blocks(&mut self.pool, seq);
        seq.blocks.clear();
        seq.computed = 0;
        seq.registered = 0;
        if seq.transfer_done_at.take().is_some() || seq.kv_transfer == KvTransfer::RemotePrefill {
            // The pulled KV is gone with the blocks: prefill locally on re-admission.
            seq.kv_transfer = KvTransfer::Local;
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
    }
}

/// Hashes the sequence's full blocks up to block `full` (generated tokens included).
fn extend_hashes(seq: &mut Sequence, full: usize, root: &EngineBlockHash, bs: usize) {
    while seq.hashes.len() < full {
        let b = seq.hashes.len();
        let parent = seq.hashes.last().copied().unwrap_or(*root);
        seq.hashes.push(block_hash(&parent, &seq.tokens[b * bs..(b + 1) * bs], &seq.keys.for_block(b)));
    }
}

/// Registers the sequence's full blocks up to token `upto` that are not cached yet
/// (→ `BlockStored`), in each KV-cache group (`window`: a hybrid model's window group), and
/// offloads them when there is an offload tier.
///
/// A step's blocks are registered when the step is scheduled, before they are computed, as
/// vLLM's `KVCacheManager.allocate_slots` caches them: a request scheduled after another in
/// the same step finds the prefix the other computes there (a real vLLM 0.32 engine given
/// four prompts of one 1,024-token prefix at once served three of them 1,024 cached tokens
/// each).
fn register_full_blocks(
    pool: &mut BlockPool,
    offload: Option<&mut OffloadTier>,
    seq: &mut Sequence,
    upto: usize,
    bs: usize,
    root: &EngineBlockHash,
    window: Option<KvGroup>,
) {
    let full = upto.min(seq.tokens.len()) / bs;
    if full > seq.registered {
        extend_hashes(seq, full, root, bs);
        let start = seq.registered;
        let parent = start.checked_sub(1).map(|p| seq.hashes[p]);
        let stored = |group| CacheChange::Stored {
            hashes: seq.hashes[start..full].to_vec(),
            parent,
            token_ids: seq.tokens[start * bs..full * bs].to_vec(),
            keys: seq.keys.clone(),
            first_index: start,
            group,
        };
        pool.cache_blocks(&seq.blocks[start..full], stored(window.map(|_| KvGroup { index: 0, sliding_window: None })));
        if window.is_some() {
            let blocks: Vec<BlockId> = seq.window_blocks[start..full].iter().flatten().copied().collect();
            debug_assert_eq!(blocks.len(), full - start, "blocks are computed inside their window");
            pool.cache_blocks(&blocks, stored(window));
        }
        if let Some(tier) = offload {
            tier.store(&seq.hashes[start..full], pool.changes_mut());
        }
        seq.registered = full;
    }
}

/// A hybrid model's window group (`window`) frees the blocks its window has moved past now
/// that the sequence's tokens are computed: the pool evicts them first (vLLM's
/// `SlidingWindowManager.remove_skipped_blocks`).
fn free_skipped_window_blocks(pool: &mut BlockPool, seq: &mut Sequence, bs: usize, window: Option<KvGroup>) {
    if let Some(w) = window.and_then(|g| g.sliding_window) {
        let skipped = (seq.computed + 1).saturating_sub(w as usize) / bs;
        let out_of_window: Vec<BlockId> = seq.window_blocks.iter_mut().take(skipped).filter_map(Option::take).collect();
        pool.free(&out_of_window);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config() -> EngineConfig {
        EngineConfig {
            block_size: 4,
            num_blocks: 256,
            hash_seed: Some("0".into()),
            filler_tokens: vec![7, 8, 9],
            ..Default::default()
        }
    }

    fn request(prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
        NewRequest { prompt, max_tokens, keys: HashKeys::default(), kv_transfer: KvTransfer::Local }
    }

    /// Runs until idle; returns (finished usage by id, total model time, all cache changes).
    fn run(engine: &mut Engine) -> (HashMap<RequestId, Usage>, Vec<CacheChange>) {
        let mut done = HashMap::new();
        let mut changes = engine.take_cache_changes();
        for _ in 0..10_000 {
            match engine.step() {
                Some(step) => {
                    changes.extend(step.cache_changes);
                    for out in step.outputs {
                        if let Some(f) = out.finished {
                            done.insert(out.id, f.usage);
                        }
                    }
                }
                None => match engine.next_wakeup() {
                    Some(t) => engine.advance_to(t),
                    None => break,
                },
            }
        }
        assert!(engine.is_idle(), "engine did not drain");
        (done, changes)
    }

    #[test]
    fn the_backlog_counts_a_prefix_the_requests_ahead_share_once() {
        let mut engine = Engine::new(config());
        let shared: Vec<u32> = (1..=40).collect();
        let longer: Vec<u32> = shared.iter().copied().chain(100..108).collect();
        assert_eq!(engine.backlog().tokens, 0);
        let revision = engine.revision();
        engine.add_request(request(shared.clone(), 2)).unwrap();
        engine.add_request(request(longer.clone(), 2)).unwrap();
        assert_ne!(engine.revision(), revision, "a request added changes the engine");
        let backlog = engine.backlog();
        assert_eq!(backlog.tokens, 40 + 8, "the second request finds the first's 40 tokens computed");
        let third = engine.block_hashes(&longer, &HashKeys::default());
        assert_eq!(engine.cached_or_queued_prefix(&third, &backlog), 12, "a third one finds both");

        // Once both are computed and cached, a third asks for nothing the cache lacks.
        run(&mut engine);
        engine.add_request(request(longer, 2)).unwrap();
        assert_eq!(engine.backlog().tokens, 1, "fully cached: at least one token is computed");
        let revision = engine.revision();
        let _ = engine.clone().step();
        assert_eq!(engine.revision(), revision, "a what-if on a copy leaves the engine as it was");
    }

    #[test]
    fn a_request_prefills_then_decodes_to_max_tokens() {
        let mut e = Engine::new(config());
        let id = e.add_request(request((0..10).collect(), 5)).unwrap();
        let first = e.step().unwrap();
        assert_eq!(
            first.outputs,
            vec![Output { id, token: 7, finished: None }],
            "prefill step samples the first token"
        );
        assert_eq!(first.work.tokens, 10);
        assert!((first.duration * 1000.0 - e.config().timing.isolated_prefill_ms(10, 0)).abs() < 1e-9);
        let (done, changes) = run(&mut e);
        assert_eq!(done[&id], Usage { prompt_tokens: 10, completion_tokens: 5, cached_tokens: 0 });
        // Prompt blocks 0,1 stored after prefill; block 2 (tokens 8,9 + outputs 7,8) during decode.
        let stored: Vec<usize> = changes
            .iter()
            .filter_map(|c| match c {
                CacheChange::Stored { hashes, .. } => Some(hashes.len()),
                _ => None,
            })
            .collect();
        assert_eq!(stored, vec![1]);
        assert!(
            matches!(&first.cache_changes[..], [CacheChange::Stored { hashes, parent: None, .. }] if hashes.len() == 2)
        );
        assert_eq!(e.counters().generation_tokens, 5);
        assert_eq!(e.kv_cache_usage(), 0.0);
    }

    #[test]
    fn a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_offload_tier() {
        // 32 GPU blocks of 4 tokens, 80 offloaded: a 100-token prompt (25 blocks) is evicted
        // from the GPU by two others, but stays offloaded.
        let mut e = Engine::new(EngineConfig { num_blocks: 32, offload_blocks: 80, ..config() });
        let a: Vec<u32> = (0..100).collect();
        let (b, c): (Vec<u32>, Vec<u32>) = ((1000..1100).collect(), (2000..2100).collect());
        e.add_request(request(a.clone(), 1)).unwrap();
        let (_, changes) = run(&mut e);
        let offloaded = changes.iter().filter(|c| matches!(c, CacheChange::Offloaded { .. })).count();
        assert_eq!(offloaded, 25, "every computed block is offloaded");
        let first_offload = changes.iter().position(|c| matches!(c, CacheChange::Offloaded { .. })).unwrap();
        assert!(matches!(changes[first_offload - 1], CacheChange::Stored { .. }), "announced on the GPU first");
        for other in [b, c] {
            e.add_request(request(other, 1)).unwrap();
            run(&mut e);
        }
        assert_eq!(e.cached_prefix_blocks(&a, &HashKeys::default()), 0, "gone from the GPU");
        let computed = e.counters().prefill_tokens_computed;
        let t0 = e.now();
        let id = e.add_request(request(a.clone(), 1)).unwrap();
        let (done, changes) = run(&mut e);
        // The 24 blocks before the last (recomputed to sample from) are loaded.
        assert_eq!(e.counters().offload_loaded_tokens, 96);
        assert_eq!(e.counters().prefill_tokens_computed - computed, 4);
        assert_eq!(done[&id].cached_tokens, 96, "vLLM counts connector hits as cached");
        assert!(e.now() - t0 >= e.config().timing.offload_load_ms(96) / 1000.0, "the load takes its time");
        assert!(changes.iter().any(|c| matches!(c, CacheChange::Stored { hashes, .. } if hashes.len() == 24)));
        // The tier holds a's, b's and c's 25 blocks: a fourth prompt's 25 evict the least
        // recently used — b's — with CPU removals.
        e.add_request(request((5000..5100).collect(), 1)).unwrap();
        let (_, changes) = run(&mut e);
        let removed = changes.iter().filter(|c| matches!(c, CacheChange::OffloadRemoved { .. })).count();
        assert_eq!(removed, 4 * 25 - 80);
        e.reset_prefix_cache().unwrap();
        e.add_request(request(a, 1)).unwrap();
        run(&mut e);
        assert_eq!(e.counters().offload_loaded_tokens, 96, "a reset clears the offload tier too");
    }

    #[test]
    fn requests_scheduled_in_one_step_share_the_prefix_one_of_them_computes() {
        // As on a real vLLM 0.32 engine given four prompts of one 1,024-token prefix at once
        // (`--max-num-batched-tokens` 2048): one computes the prefix, the three scheduled
        // after it in the same step are served it from the cache.
        let mut e = Engine::new(EngineConfig { max_num_batched_tokens: 600, ..config() });
        let prefix: Vec<u32> = (0..256).collect();
        let ids: Vec<RequestId> = (0..4u32)
            .map(|i| {
                let prompt = prefix.iter().copied().chain((0..16).map(|k| 1000 + 16 * i + k)).collect();
                e.add_request(request(prompt, 1)).unwrap()
            })
            .collect();
        let first = e.step().unwrap();
        assert_eq!(first.work.tokens, 256 + 16 + 3 * 16, "one step: the prefix once, each suffix");
        let cached: Vec<Option<usize>> =
            first.outputs.iter().map(|o| o.finished.as_ref().map(|f| f.usage.cached_tokens)).collect();
        assert_eq!(first.outputs.iter().map(|o| o.id).collect::<Vec<_>>(), ids, "all four answered in it");
        assert_eq!(cached, vec![Some(0), Some(256), Some(256), Some(256)]);
        assert_eq!(e.counters().prefill_tokens_computed, 256 + 4 * 16);
    }

    #[test]
    fn a_cached_prefix_is_skipped_and_reported() {
        let mut e = Engine::new(config());
        let prompt: Vec<u32> = (0..400).collect();
        e.add_request(request(prompt.clone(), 1)).unwrap();
        let cold = e.step().unwrap().duration;
        run(&mut e);
        let mut longer = prompt.clone();
        longer.extend([100, 101, 102]);
        let id = e.add_request(request(longer, 2)).unwrap();
        let warm = e.step().unwrap();
        assert!(warm.duration < cold / 2.0, "warm {} cold {}", warm.duration, cold);
        assert_eq!(warm.work.tokens, 3);
        let (done, _) = run(&mut e);
        assert_eq!(done[&id], Usage { prompt_tokens: 403, completion_tokens: 2, cached_tokens: 400 });
        // An exact repeat recomputes its last block so that there is a token to sample.
        e.add_request(request(prompt, 1)).unwrap();
        assert_eq!(e.step().unwrap().work.tokens, 4);
        assert_eq!(e.counters().prefix_cache_hits, 400 + 396);
        assert_eq!(e.counters().prefix_cache_queries, 400 + 403 + 400);
    }

    #[test]
    fn lru_eviction_emits_removals_and_spares_blocks_in_use() {
        let mut e = Engine::new(EngineConfig { num_blocks: 12, ..config() });
        let a: Vec<u32> = (0..16).collect();
        e.add_request(request(a.clone(), 1)).unwrap();
        run(&mut e);
        assert_eq!(e.cached_prefix_blocks(&a, &HashKeys::default()), 4);
        // A long-running request holds 5 blocks while others churn through the rest.
        let holder: Vec<u32> = (1000..1016).collect();
        e.add_request(request(holder.clone(), 4)).unwrap();
        for k in 0..3u32 {
            e.add_request(request((k * 100 + 200..k * 100 + 216).collect(), 1)).unwrap();
        }
        let (_, changes) = run(&mut e);
        assert!(changes.iter().any(|c| matches!(c, CacheChange::Removed { .. })));
        assert_eq!(e.cached_prefix_blocks(&a, &HashKeys::default()), 0, "oldest prefix evicted first");
        assert_eq!(e.cached_prefix_blocks(&holder, &HashKeys::default()), 4, "held blocks survived");
    }

    #[test]
    fn batch_limits_queue_requests_and_long_prompts_are_chunked() {
        let mut e = Engine::new(EngineConfig { max_num_seqs: 2, max_num_batched_tokens: 32, ..config() });
        for k in 0..3u32 {
            e.add_request(request((k * 1000..k * 1000 + 8).collect(), 10)).unwrap();
        }
        e.step().unwrap();
        assert_eq!((e.num_running(), e.num_waiting()), (2, 1));
        let mut e = Engine::new(EngineConfig { max_num_batched_tokens: 32, ..config() });
        e.add_request(request((0..100).collect(), 1)).unwrap();
        let chunks: Vec<u64> = std::iter::from_fn(|| e.step().map(|s| s.work.tokens)).collect();
        assert_eq!(chunks, vec![32, 32, 32, 4]);
    }

    #[test]
    fn decode_steps_slow_down_with_batch_size() {
        let step_time = |n: u32| {
            let mut e = Engine::new(config());
            for k in 0..n {
                e.add_request(request((k * 100..k * 100 + 4).collect(), 3)).unwrap();
            }
            e.step(); // prefill
            e.step().unwrap().duration // pure decode
        };
        assert!(step_time(8) > step_time(1));
    }

    #[test]
    fn running_out_of_blocks_preempts_the_newest_request() {
        let mut e = Engine::new(EngineConfig { num_blocks: 6, ..config() });
        let a = e.add_request(request((0..8).collect(), 8)).unwrap();
        let b = e.add_request(request((100..108).collect(), 8)).unwrap();
        let (done, _) = run(&mut e);
        assert!(e.counters().preemptions > 0);
        assert_eq!(done[&a].completion_tokens, 8);
        assert_eq!(done[&b].completion_tokens, 8);
    }

    #[test]
    fn prefill_side_returns_one_token_and_its_blocks() {
        let mut e = Engine::new(config());
        let id = e
            .add_request(NewRequest { kv_transfer: KvTransfer::RemoteDecode, ..request((0..10).collect(), 50) })
            .unwrap();
        let step = e.step().unwrap();
        match &step.outputs[..] {
            [Output { id: fid, finished: Some(Finished { usage, kv_blocks: Some(blocks), .. }), .. }] => {
                assert_eq!(*fid, id);
                assert_eq!(usage.completion_tokens, 1);
                assert_eq!(blocks.len(), 3);
            }
            other => panic!("unexpected outputs {other:?}"),
        }
    }

    #[test]
    fn decode_side_pulls_the_prompt_instead_of_computing_it() {
        let mut e = Engine::new(config());
        let prompt: Vec<u32> = (0..400).collect();
        let id =
            e.add_request(NewRequest { kv_transfer: KvTransfer::RemotePrefill, ..request(prompt.clone(), 3) }).unwrap();
        assert!(e.step().is_none(), "nothing to compute while the KV is in flight");
        let ready = e.next_wakeup().unwrap();
        let expected = e.config().timing.transfer_ms(399) / 1000.0;
        assert!((ready - expected).abs() < 1e-12);
        e.advance_to(ready);
        let first = e.step().unwrap();
        assert_eq!(first.work.tokens, 1, "only the last prompt token is computed");
        assert!(
            first.cache_changes.iter().any(|c| matches!(c, CacheChange::Stored { hashes, .. } if hashes.len() == 99))
        );
        let (done, _) = run(&mut e);
        assert_eq!(done[&id].completion_tokens, 3);
        assert_eq!(e.counters().prefill_tokens_computed, 1);
        assert_eq!(e.counters().transferred_tokens, 399);
        assert_eq!(e.cached_prefix_blocks(&prompt, &HashKeys::default()), 100);
    }

    #[test]
    fn abort_and_reset() {
        let mut e = Engine::new(config());
        let id = e.add_request(request((0..16).collect(), 100)).unwrap();
        e.step();
        assert!(e.reset_prefix_cache().is_err(), "blocks in use");
        assert!(e.abort(id));
        assert_eq!(e.kv_cache_usage(), 0.0);
        assert_eq!(e.reset_prefix_cache().unwrap(), vec![CacheChange::Cleared]);
        assert_eq!(e.cached_blocks(), 0);
    }

    #[test]
    fn invalid_requests_are_rejected() {
        let mut e = Engine::new(EngineConfig { max_model_len: 20, ..config() });
        assert_eq!(e.add_request(request(vec![], 1)), Err(EngineError::EmptyPrompt));
        assert_eq!(e.add_request(request(vec![1], 0)), Err(EngineError::NoOutput));
        assert!(matches!(e.add_request(request(vec![1; 15], 10)), Err(EngineError::TooLong { requested: 25, .. })));
    }

    #[test]
    fn a_hybrid_model_serves_a_prefix_only_while_its_window_group_holds_the_last_window() {
        // Block size 4, a sliding window of 9 tokens (its last 2 blocks before a hit), a
        // pool of 14 blocks (and the null block): a 24-token prompt takes 12 of them, 6 in
        // each group.
        let hybrid = || Engine::new(EngineConfig { sliding_window: Some(9), num_blocks: 15, ..config() });
        let a: Vec<u32> = (1..=24).collect();
        let cached = |e: &mut Engine, prompt: &[u32]| {
            e.add_request(request(prompt.to_vec(), 1)).unwrap();
            let (done, changes) = run(e);
            (done.values().next().unwrap().cached_tokens, changes)
        };
        let mut e = hybrid();
        let (first, stored) = cached(&mut e, &a);
        assert_eq!(first, 0);
        let groups: Vec<Option<u32>> = stored
            .iter()
            .filter_map(|c| match c {
                CacheChange::Stored { hashes, group, .. } if hashes.len() == 6 => Some(group.map(|g| g.index)),
                _ => None,
            })
            .collect();
        assert_eq!(groups, vec![Some(0), Some(1)], "both groups store the prompt's 6 blocks, announced apart");
        // Again at once: both groups still hold it (the window's freed blocks stay cached).
        assert_eq!(cached(&mut hybrid_after(&a), &a).0, 20, "5 blocks: the last token is computed");
        // An unrelated prompt needs 4 blocks: the 2 never used, then the window blocks freed
        // first (those the window moved past while prefilling: 3, then 2).
        let (_, evicted) = cached(&mut e, &[90, 91, 92, 93, 94, 95, 96, 97]);
        let removed: Vec<(u64, Option<u32>)> = evicted
            .iter()
            .filter_map(|c| match c {
                CacheChange::Removed { hash, group } => Some((hash.as_u64(), group.map(|g| g.index))),
                _ => None,
            })
            .collect();
        let a_hashes = hash_blocks(&root_hash(Some("0")), &a, 4, &HashKeys::default());
        assert_eq!(removed, vec![(a_hashes[3].as_u64(), Some(1)), (a_hashes[2].as_u64(), Some(1))]);
        // All 6 blocks still serve a 25-token prompt (the window holds blocks 4 and 5); the
        // 24-token one, which computes its last token, hits at most 5: the window's run
        // there is broken at block 3, and the first run from the right is blocks 0–1.
        assert_eq!(e.cached_prefix_blocks(&a, &HashKeys::default()), 6);
        assert_eq!(cached(&mut e, &a).0, 8, "2 blocks, though the first group holds 5 of them");

        /// A hybrid engine that has just served `prompt`.
        fn hybrid_after(prompt: &[u32]) -> Engine {
            let mut e = Engine::new(EngineConfig { sliding_window: Some(9), num_blocks: 15, ..config() });
            e.add_request(request(prompt.to_vec(), 1)).unwrap();
            run(&mut e);
            e
        }
    }

    #[test]
    fn a_batch_holds_at_most_max_loras_adapters_and_pays_to_load_one() {
        let mut e = Engine::new(EngineConfig { max_loras: 1, lora_load_ms: 50.0, ..config() });
        let adapter = |name: &str, first: u32| NewRequest {
            keys: HashKeys { lora_name: Some(name.into()), ..HashKeys::default() },
            ..request((first..first + 8).collect(), 3)
        };
        let sql = e.add_request(adapter("sql", 0)).unwrap();
        let law = e.add_request(adapter("law", 100)).unwrap();
        let sql_again = e.add_request(adapter("sql", 200)).unwrap();
        let first = e.step().unwrap();
        // The law request is passed over (one adapter at a time); the later sql one joins.
        let ran: Vec<RequestId> = first.outputs.iter().map(|o| o.id).collect();
        assert_eq!(ran, vec![sql, sql_again]);
        // Reported as vLLM 0.32 reports them: every adapter with a request, in both lists.
        let both = vec!["sql".to_string(), "law".to_string()];
        assert_eq!(e.adapters(), (both.clone(), both));
        let plain = e.config().timing.step_ms(&first.work);
        assert!((first.duration * 1000.0 - plain - 50.0).abs() < 1e-9, "one adapter loaded");
        let second = e.step().unwrap();
        assert!((second.duration * 1000.0 - e.config().timing.step_ms(&second.work)).abs() < 1e-9, "sql stays loaded");
        let (done, _) = run(&mut e);
        assert!(done.contains_key(&law), "law runs once sql's requests are done");
    }
}
