//! What a router is built from (`RouterConfig`, each part deserialized from the scorer's YAML
//! and checking itself), pods' roles, and when a pod has no room (`admission`).

use crate::index::IndexConfig;
use crate::load::LoadConfig;
use crate::policy::{Candidate, PolicyConfig, ReportedLoad};
use crate::validate::{Invalid, check, non_negative};
use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;
use std::collections::BTreeMap;
use std::num::NonZeroUsize;

/// Which side of prefill/decode disaggregation a pod serves.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl Role {
    /// Whether the pod can take a request's decode (and a direct request).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Both | Role::Decode)
    }
}

/// Prefill/decode disaggregation (`pd`).
#[derive(Clone, Debug, Deserialize, PartialEq, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    /// Disaggregate when the best decode-capable pod would have to prefill at least this many
    /// uncached tokens (and a healthy prefill pod exists). 0 = always.
    #[default(1024)]
    pub threshold_tokens: u32,
    /// How the prefill pod is chosen (`kv`: KV overlap + queued prefill work).
    pub prefill_policy: PolicyConfig,
    /// How the decode pod of a disaggregated request is chosen (`kv`: decode load).
    pub decode_policy: PolicyConfig,
}

/// Everything a router is built from.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Tokens per KV block: must equal the engines' `--block-size`.
    pub block_size: usize,
    pub index: IndexConfig,
    pub load: LoadConfig,
    pub policy: PolicyConfig,
    pub pd: PdConfig,
    /// Seed of the policies' random choices.
    pub seed: u64,
    /// When pods have no room, and how requests wait for some (absent: never saturated).
    pub admission: Option<Admission>,
}

impl RouterConfig {
    /// Checks every part; fields are named as the scorer's YAML writes them.
    pub fn validate(&self) -> Result<(), Invalid> {
        check(self.block_size > 0, "block_size", "must be positive")?;
        self.index.validate().map_err(|e| e.under("index"))?;
        self.load.validate().map_err(|e| e.under("load"))?;
        self.policy.validate().map_err(|e| e.under("policy"))?;
        self.pd.prefill_policy.validate().map_err(|e| e.under("pd.prefill_policy"))?;
        self.pd.decode_policy.validate().map_err(|e| e.under("pd.decode_policy"))?;
        if let Some(admission) = &self.admission {
            admission.validate().map_err(|e| e.under("admission"))?;
        }
        Ok(())
    }
}

/// Overload (`admission`): when a pod has no room for another request — beyond any of these
/// limits it is not chosen (the router judges it) — and how a request finding every pod so
/// waits for room in the scorer's admission queue (by priority, first come first served within
/// one, until its wait runs out: 429 with `Retry-After`; sheddable ones are refused at once).
#[derive(Clone, Debug, PartialEq, Deserialize, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct Admission {
    /// A pod is saturated at this many waiting requests it reports
    /// (`vllm:num_requests_waiting`)…
    pub max_waiting: Option<f64>,
    /// …or this KV-cache usage it reports (0–1)…
    pub max_kv_usage: Option<f64>,
    /// …or this many uncached prompt tokens kvgate has sent it and not seen start (its own
    /// bookings: no scrape lag)…
    pub max_queued_prefill_tokens: Option<u64>,
    /// …or this many requests kvgate has in flight there (its own bookings): the concurrency
    /// beyond which a pod's steps, and so everyone's time to first token, grow.
    pub max_inflight_requests: Option<u32>,
    /// Share (0–1) of the two limits above that only requests of higher than default
    /// priority may use: interactive traffic finds room while a burst of ordinary requests
    /// waits.
    pub headroom: f64,
    /// Requests waiting at most (at least 1); a newcomer beyond it is refused, or takes the
    /// place of a waiter of lower priority.
    #[default(NonZeroUsize::new(1024).expect("not zero"))]
    pub queue_limit: NonZeroUsize,
    /// Longest wait for room (then 429); Envoy's timeouts toward the scorer are rendered
    /// this much longer.
    #[default(5000)]
    pub max_wait_ms: u64,
    /// Priority of each objective named in `x-gateway-inference-objective` (the Gateway
    /// API Inference Extension's InferenceObjective); negative = sheddable.
    pub objectives: BTreeMap<String, i32>,
    /// Priority of requests naming no known objective.
    pub default_priority: i32,
}

impl Admission {
    /// Checks the limits (one at least must be set: else nothing is ever saturated) and the
    /// wait.
    pub fn validate(&self) -> Result<(), Invalid> {
        check((0.0..1.0).contains(&self.headroom), "headroom", "must be in [0, 1)")?;
        let limits = [self.max_waiting, self.max_kv_usage].iter().any(Option::is_some)
            || self.max_queued_prefill_tokens.is_some()
            || self.max_inflight_requests.is_some();
        let why = "set when a pod is saturated: max_waiting, max_kv_usage, max_queued_prefill_tokens or max_inflight_requests";
        check(limits, "", why)?;
        check(self.max_kv_usage.is_none_or(|u| u > 0.0 && u <= 1.0), "max_kv_usage", "must be in (0, 1]")?;
        check(self.max_waiting.is_none_or(non_negative), "max_waiting", "must be a number >= 0")?;
        check(self.max_wait_ms > 0, "max_wait_ms", "must be positive")
    }

    /// Whether `c` has no room — for a request that must leave the headroom free, when
    /// `leave_headroom`.
    pub fn saturated(&self, c: &Candidate, leave_headroom: bool) -> bool {
        let reported = |f: fn(&ReportedLoad) -> f64, max: Option<f64>| matches!((c.reported, max), (Some(r), Some(m)) if f(&r) >= m);
        let share = if leave_headroom { 1.0 - self.headroom } else { 1.0 };
        let own = |value: f64, max: f64| value >= (max * share).max(1.0);
        reported(|r| r.waiting, self.max_waiting)
            || reported(|r| r.kv_cache_usage, self.max_kv_usage)
            || self.max_queued_prefill_tokens.is_some_and(|m| own(c.load.queued_prefill_tokens as f64, m as f64))
            || self.max_inflight_requests.is_some_and(|m| own(f64::from(c.load.inflight_requests), f64::from(m)))
    }
}
