//! Deciding: a request's body parsed once and tokenized as its engine will tokenize it
//! (without the lock), then a pod chosen and booked under the lock — or, with `admission`,
//! a wait in the queue while every pod is saturated.

use super::{Pod, Scorer};
use crate::admission::{Queue, Refused};
use crate::config::{ModelRewriteRule, UnlistedModels};
use crate::prompt::{self, PromptError};
use crate::rewrites::{ModelRewrites, Rewrite};
use kvgate_route_api::{Api, ModelRewrite, PodExplain, RoutePick};
use kvgate_routing::adapters::AdapterId;
use kvgate_routing::hash::{SequenceHash, root_hash, sequence_hashes};
use kvgate_routing::pod_set::{PodId, PodSet};
use kvgate_routing::router::{ModelId, RouteRequest, Unroutable};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// Why no pod was picked (see [`crate::picking`] for what each means to a client).
#[derive(Debug, thiserror::Error)]
pub enum PickError {
    #[error("{0}")]
    BadRequest(String),
    /// The body is over the transport's limit (bytes).
    #[error("request body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("no healthy pod can serve this request")]
    NoPod,
    /// No pod serves the model it names (as vLLM words its own 404).
    #[error("The model `{0}` does not exist.")]
    ModelNotServed(String),
    /// Every pod is saturated (only with `admission`): the request should wait.
    #[error("every pod is saturated")]
    Saturated,
    /// Refused for overload: retry after this many seconds.
    #[error("{reason}")]
    Shed { retry_after_seconds: u64, reason: &'static str },
    /// A rule rewrites its model to this one, and the proxy that asked cannot rewrite bodies
    /// (one older than the scorer).
    #[error(
        "the gateway's kvgate proxy cannot rewrite the request's model to `{0}`: upgrade it to the scorer's version"
    )]
    CannotRewrite(String),
    /// The scorer is shutting down.
    #[error("the scorer is stopping")]
    Stopping,
}

impl From<PromptError> for PickError {
    fn from(e: PromptError) -> Self {
        PickError::BadRequest(e.0)
    }
}

/// The client's message for a request refused for overload.
fn shed_message(reason: &str) -> &'static str {
    match reason {
        "sheddable" => "every pod is saturated and this request is sheddable: retry later",
        "queue_full" => "every pod is saturated and the admission queue is full: retry later",
        _ => "every pod is saturated and no room appeared in time: retry later",
    }
}

/// Request bodies at least this large are prepared off the serving thread (≈ 16k tokens).
pub const PREPARE_ASIDE_BYTES: usize = 64 << 10;

/// A request ready for a decision: its block chain and sizes ([`Scorer::prepare`]).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub chain: Vec<SequenceHash>,
    pub prompt_tokens: u32,
    pub max_output_tokens: Option<u32>,
    /// The LoRA adapter it asks for.
    pub adapter: Option<AdapterId>,
    /// The `model` it is routed as: the one it names, or its rewrite's target.
    pub model: Option<String>,
    /// Its model's rewrite, when a rule matched it.
    pub rewrite: Option<Rewrite>,
}

/// What the entry path asks of a decision besides the request itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Limits<'a> {
    /// Only these pods may serve (the proxy's subset hint).
    pub subset: Option<&'a PodSet>,
    /// Next-best pods to name after the pick, for the proxy's retries.
    pub fallbacks: usize,
    /// Collect every candidate's figures (`?explain=1`).
    pub explain: bool,
    /// Leave the admission headroom free (no more than the default priority).
    pub leave_headroom: bool,
    /// Predict the chosen pod's wait before this request's prefill (a sampled trace's).
    pub predict_wait: bool,
}

/// A decision with its pods resolved: what each entry path maps to its own wire format.
#[derive(Clone, Debug)]
pub struct Pick {
    /// The pod that serves the request (decodes it, when disaggregated).
    pub decode: Arc<Pod>,
    /// The pod that prefills it first, when disaggregated.
    pub prefill: Option<Arc<Pod>>,
    /// Where the proxy retries if `decode` refuses the connection, best first.
    pub fallbacks: Vec<Arc<Pod>>,
    pub policy: &'static str,
    pub prompt_tokens: u32,
    /// Prompt tokens cached where the prompt is computed.
    pub cached_tokens: u32,
    /// Prompt tokens not cached on the best decode-capable pod (what the P/D threshold weighs).
    pub uncached_tokens: u32,
    /// The P/D threshold applied (absent without prefill pods).
    pub threshold_tokens: Option<u32>,
    /// Predicted seconds of prefill queued on `decode` ahead of this request when it was
    /// chosen, when asked (`Limits::predict_wait`) and the fleet's prefill speed is learned.
    pub predicted_wait_seconds: Option<f64>,
    /// How long the request waited in the admission queue.
    pub admission_wait: std::time::Duration,
    /// The request's model rewrite, when a rule matched it (its `span` is where the body
    /// changes, absent when the target is the client's own model).
    pub model_rewrite: Option<Rewrite>,
    pub explain: Option<Vec<PodExplain>>,
}

impl Pick {
    /// As the route protocol names it: addresses, and the pod's name.
    pub fn route_pick(&self) -> RoutePick {
        RoutePick {
            decode: self.decode.address.clone(),
            fallbacks: self.fallbacks.iter().map(|p| p.address.clone()).collect(),
            prefill: self.prefill.as_ref().map(|p| p.address.clone()),
            pod: self.decode.name.clone(),
            model_rewrite: self.model_rewrite.as_ref().and_then(|r| {
                let (at, len) = r.span?;
                Some(ModelRewrite { model: r.model.clone(), at: at as u64, len: len as u64 })
            }),
        }
    }
}

impl Scorer {
    /// The lock-free half of a decision: the body parsed once, tokenized as the engine will
    /// tokenize it, and hashed into its block chain. CPU-bound (tokenization), no shared
    /// state touched: both entry paths (the filter's route call, the Endpoint Picker) call it
    /// before [`Scorer::decide`].
    pub fn prepare(&self, api: Api, body: &[u8]) -> Result<Prepared, PickError> {
        let t0 = Instant::now();
        let rewrite = self.rewrites.read().unwrap_or_else(|e| e.into_inner()).of(body);
        let adapters = self.adapters.read().unwrap_or_else(|e| e.into_inner());
        let as_model = rewrite.as_ref().map(|r| r.model.as_str());
        let info = prompt::extract(&self.tokenizers, api, body, &adapters, as_model)?;
        drop(adapters);
        self.metrics.tokenize_seconds.with_label_values(&[api.label()]).observe(t0.elapsed().as_secs_f64());
        let block_size = self.block_size();
        let mut chain = Vec::with_capacity(info.tokens.len() / block_size + 1);
        let root = root_hash(info.lora_name.as_deref(), info.cache_salt.as_deref());
        sequence_hashes(root, &info.tokens, block_size, &mut chain);
        Ok(Prepared {
            chain,
            prompt_tokens: info.tokens.len() as u32,
            max_output_tokens: info.max_output_tokens,
            adapter: info.lora_name.as_deref().map(AdapterId::of),
            model: info.model,
            rewrite,
        })
    }

    /// [`Scorer::prepare`] for a body the caller hands over: one of
    /// [`PREPARE_ASIDE_BYTES`] or more is prepared on the blocking pool, so that its
    /// tokenization (milliseconds for a new document of tens of thousands of tokens) does
    /// not hold up the other calls served on the same thread.
    pub async fn prepare_owned(self: &Arc<Self>, api: Api, body: bytes::Bytes) -> Result<Prepared, PickError> {
        if body.len() < PREPARE_ASIDE_BYTES {
            return self.prepare(api, &body);
        }
        let scorer = self.clone();
        match tokio::task::spawn_blocking(move || scorer.prepare(api, &body)).await {
            Ok(prepared) => prepared,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(PickError::Stopping), // the runtime is shutting down
        }
    }

    /// Chooses the pod for one prepared request — or, when disaggregation pays off, a prefill
    /// pod and a decode pod — under the shared lock, books it, and counts it.
    pub fn decide(&self, request_id: &str, prepared: &Prepared, limits: &Limits<'_>) -> Result<Pick, PickError> {
        let t1 = Instant::now();
        let request = RouteRequest {
            subset: limits.subset,
            fallbacks: limits.fallbacks,
            leave_headroom: limits.leave_headroom,
            adapter: prepared.adapter,
            model: prepared.model.as_deref().map(ModelId::of),
            ..RouteRequest::new(request_id, &prepared.chain, prepared.prompt_tokens, prepared.max_output_tokens)
        };
        let now = self.now();
        let mut core = self.lock();
        let mut routed = core.router.route(&request, now);
        if matches!(routed, Err(Unroutable::ModelNotServed)) && self.config.unlisted_models == UnlistedModels::Route {
            routed = core.router.route(&RouteRequest { model: None, ..request }, now);
        }
        let routed = routed.map_err(|e| match e {
            Unroutable::NoPod => PickError::NoPod,
            Unroutable::Saturated => PickError::Saturated,
            Unroutable::ModelNotServed => PickError::ModelNotServed(prepared.model.clone().unwrap_or_default()),
        })?;
        self.bookings_changed();
        let pod = |id: PodId| core.info(id);
        let decode = pod(routed.decode.pod);
        let prefill = routed.prefill.map(|p| pod(p.pod));
        let fallbacks: Vec<Arc<Pod>> = routed.fallbacks.iter().map(|&id| pod(id)).collect();
        // Every candidate, when explaining (disaggregated: the decode candidates).
        let explained: Vec<Arc<Pod>> =
            if limits.explain { routed.candidates.iter().map(|c| pod(c.pod)).collect() } else { Vec::new() };
        let block_size = core.router.block_size() as u32;
        let predicted_wait_seconds = limits.predict_wait.then(|| core.router.predicted_wait(&routed.decode)).flatten();
        drop(core);

        let explain = limits.explain.then(|| {
            routed
                .candidates
                .iter()
                .zip(&routed.decision.costs)
                .zip(&explained)
                .enumerate()
                .map(|(i, ((c, cost), p))| PodExplain {
                    pod: p.name.clone(),
                    address: p.address.clone(),
                    cached_blocks: c.cached_tokens / block_size,
                    cached_tokens: c.cached_tokens,
                    offloaded_tokens: c.offloaded_tokens,
                    queued_prefill_tokens: c.load.queued_prefill_tokens,
                    decode_blocks: c.load.decode_blocks,
                    inflight_requests: c.load.inflight_requests,
                    slowness: c.slowness,
                    cost: *cost,
                    chosen: i == routed.decision.chosen,
                })
                .collect()
        });
        let cached_tokens = routed.cached_tokens();
        let prompt_tokens = prepared.prompt_tokens;
        let policy = routed.policy;
        self.metrics.decisions.with_label_values(&[policy, &decode.name]).inc();
        self.metrics.decisions_by_path.with_label_values(&[if prefill.is_some() { "pd" } else { "direct" }]).inc();
        self.metrics.decision_seconds.observe(t1.elapsed().as_secs_f64());
        self.metrics.prompt_tokens.inc_by(u64::from(prompt_tokens));
        self.metrics.cached_tokens.inc_by(u64::from(cached_tokens));
        self.metrics
            .prefix_hit_ratio
            .with_label_values(&[policy])
            .inc_by(f64::from(cached_tokens) / f64::from(prompt_tokens.max(1)));
        Ok(Pick {
            decode,
            prefill,
            fallbacks,
            policy,
            prompt_tokens,
            cached_tokens,
            uncached_tokens: routed.uncached_tokens,
            threshold_tokens: routed.prefill_pods.then_some(self.config.pd.threshold_tokens),
            predicted_wait_seconds,
            admission_wait: std::time::Duration::ZERO,
            model_rewrite: prepared.rewrite.clone(),
            explain,
        })
    }

    /// [`Scorer::decide`], waiting in the admission queue while every pod is saturated: the
    /// request gets a pod when one has room, in the order of priority (from `objective`,
    /// the request's `x-gateway-inference-objective`) then arrival; sheddable requests
    /// (negative priority) are refused at once, the others once `admission.max_wait_ms` has
    /// passed or when the queue is full of more important ones.
    pub async fn decide_admitted(
        &self,
        request_id: &str,
        prepared: &Prepared,
        limits: &Limits<'_>,
        objective: Option<&str>,
    ) -> Result<Pick, PickError> {
        let (Some(queue), Some(admission)) = (&self.queue, &self.config.admission) else {
            return self.decide(request_id, prepared, limits);
        };
        let priority = self.priority(objective);
        let arrived = Instant::now();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(admission.max_wait_ms);
        let retry_after_seconds = admission.max_wait_ms.div_ceil(1000).max(1);
        // The metrics' label, made only off the path of a request admitted at once.
        let label = || priority.to_string();
        let shed = |reason: &'static str| {
            self.metrics.admission_refused.with_label_values(&[reason, &label()]).inc();
            Err(PickError::Shed { retry_after_seconds, reason: shed_message(reason) })
        };
        let limits = &Limits { leave_headroom: priority <= admission.default_priority, ..*limits };
        let ticket = queue.ticket(priority);
        // Counted as waiting from its first wait to its decision.
        let mut held = None;
        // A newcomer goes behind those waiting with its priority or above.
        let mut try_now = !queue.ahead_of(priority);
        loop {
            if try_now {
                match self.decide(request_id, prepared, limits) {
                    Err(PickError::Saturated) => {}
                    mut decided => {
                        if held.is_some() {
                            let waited = arrived.elapsed();
                            let wait = self.metrics.admission_wait_seconds.with_label_values(&[&label()]);
                            wait.observe(waited.as_secs_f64());
                            if let Ok(pick) = &mut decided {
                                pick.admission_wait = waited;
                            }
                        }
                        if decided.is_ok() && !queue.is_empty() {
                            queue.wake_first(); // there may be room for the next one too
                        }
                        return decided;
                    }
                }
            }
            try_now = true;
            if priority < 0 {
                return shed("sheddable");
            }
            let woken = match queue.wait(ticket) {
                Ok(woken) => woken,
                Err(Refused::QueueFull) => return shed("queue_full"),
            };
            held.get_or_insert_with(|| queue.hold(self.metrics.admission_waiting.with_label_values(&[&label()])));
            match tokio::time::timeout_at(deadline, woken).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return shed("queue_full"), // a more important request took the place
                Err(_) => {
                    queue.leave(ticket);
                    return shed("deadline");
                }
            }
        }
    }

    /// The admission priority of a request naming `objective`: the pool's InferenceObjective
    /// of that name, else `admission.objectives`'; the default for none, and for an unknown
    /// one (counted). 0 without admission.
    pub fn priority(&self, objective: Option<&str>) -> i32 {
        let Some(admission) = &self.config.admission else { return 0 };
        let Some(name) = objective else { return admission.default_priority };
        let pool = self.pool_objectives.read().unwrap_or_else(|e| e.into_inner()).get(name).copied();
        pool.or_else(|| admission.objectives.get(name).copied()).unwrap_or_else(|| {
            self.metrics.objectives_unknown.inc();
            admission.default_priority
        })
    }

    /// The pool's InferenceModelRewrites' rules, oldest object first, as the API server has
    /// them now: they come before the configuration's.
    pub fn set_pool_rewrites(&self, rules: Vec<ModelRewriteRule>) {
        let rules = rules.into_iter().chain(self.config.model_rewrites.iter().cloned()).collect();
        *self.rewrites.write().unwrap_or_else(|e| e.into_inner()) = ModelRewrites::new(rules);
    }

    /// The pool's InferenceObjectives (name → priority), as the API server has them now.
    pub fn set_pool_objectives(&self, objectives: BTreeMap<String, i32>) {
        *self.pool_objectives.write().unwrap_or_else(|e| e.into_inner()) = objectives;
    }

    /// Requests waiting in the admission queue now (not counting those being answered).
    pub fn admission_waiting(&self) -> usize {
        self.queue.as_ref().map_or(0, Queue::held)
    }

    /// Changes whenever requests start waiting for admission or none waits any more; `None`
    /// without admission.
    pub fn admission_queuing(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        self.queue.as_ref().map(Queue::queuing)
    }

    /// Room may have appeared on some pod: the first waiter tries again.
    pub(super) fn room_may_have_appeared(&self) {
        if let Some(queue) = &self.queue {
            queue.wake_first();
        }
    }
}
