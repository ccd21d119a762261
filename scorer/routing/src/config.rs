//! Everything a [`Router`](crate::router::Router) is built from, as the scorer's YAML writes
//! it: each part deserializes with its defaults and is validated beside its type; the scorer
//! (and the cluster simulator, from the same YAML) compose them.

use crate::index::IndexConfig;
use crate::load::LoadConfig;
use crate::policy::PolicyConfig;
use crate::router::Saturation;
use serde::Deserialize;

/// A value out of range: its field, as a path from the part validated, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    pub field: String,
    pub message: String,
}

impl Invalid {
    pub fn new(field: &str, message: impl Into<String>) -> Self {
        Self { field: field.to_string(), message: message.into() }
    }

    /// The same error, its field under `section` (`section.field`).
    pub fn under(self, section: &str) -> Self {
        let field = if self.field.is_empty() { section.to_string() } else { format!("{section}.{}", self.field) };
        Self { field, ..self }
    }
}

/// A finite number above zero (NaN and infinities are not).
pub fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// `Err(Invalid)` for `field` unless `ok`.
pub(crate) fn check(ok: bool, field: &str, message: &str) -> Result<(), Invalid> {
    if ok { Ok(()) } else { Err(Invalid::new(field, message)) }
}

/// Prefill/decode disaggregation (`pd`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    /// Disaggregate when the best decode-capable pod would have to prefill at least this many
    /// uncached tokens (and a healthy prefill pod exists). 0 = always.
    pub threshold_tokens: u32,
    /// How the prefill pod is chosen (`kv`: KV overlap + queued prefill work).
    pub prefill_policy: PolicyConfig,
    /// How the decode pod of a disaggregated request is chosen (`kv`: decode load).
    pub decode_policy: PolicyConfig,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self { threshold_tokens: 1024, prefill_policy: PolicyConfig::default(), decode_policy: PolicyConfig::default() }
    }
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
    /// When pods have no room (absent: never saturated).
    pub saturation: Option<Saturation>,
}

impl RouterConfig {
    /// Checks every part; fields are named as the scorer's YAML writes them (the saturation
    /// limits under `admission`).
    pub fn validate(&self) -> Result<(), Invalid> {
        check(self.block_size > 0, "block_size", "must be positive")?;
        self.index.validate().map_err(|e| e.under("index"))?;
        self.load.validate().map_err(|e| e.under("load"))?;
        self.policy.validate().map_err(|e| e.under("policy"))?;
        self.pd.prefill_policy.validate().map_err(|e| e.under("pd.prefill_policy"))?;
        self.pd.decode_policy.validate().map_err(|e| e.under("pd.decode_policy"))?;
        if let Some(saturation) = &self.saturation {
            saturation.validate().map_err(|e| e.under("admission"))?;
        }
        Ok(())
    }
}
