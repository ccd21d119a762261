//! `models:`, the tokenizer of each model behind the gateway (see
//! `crate::prompt::ModelTokenizers`).

use serde::Deserialize;
use std::path::PathBuf;

/// A model whose requests are tokenized by a tokenizer of its own.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The `model` its requests name, as its engines list it in `/v1/models`.
    pub name: String,
    /// Its HF `tokenizer.json` (the chat template from the `tokenizer_config.json` beside
    /// it).
    pub tokenizer: PathBuf,
}

/// A rule of `model_rewrites`: the Gateway API Inference Extension's `InferenceModelRewrite`
/// rule, from configuration (see `crate::rewrites`).
#[derive(Clone, Debug, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelRewriteRule {
    /// The `model`s it rewrites, exactly as requests name them; empty (the default): every
    /// model no rule names (the catch-all). A rule naming a model comes before a catch-all.
    #[serde(default)]
    pub matches: Vec<String>,
    /// What the pods are asked for instead: one target (an alias), or several sharing the
    /// requests by weight (a canary, an A/B split), every turn of a conversation to one.
    pub targets: Vec<RewriteTarget>,
}

/// One target of a [`ModelRewriteRule`].
#[derive(Clone, Debug, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewriteTarget {
    /// The model the pods are asked for.
    pub model: String,
    /// Its share of the rule's requests: its weight over the sum of the rule's (1 to
    /// 1,000,000; set on every target or on none, and then the shares are equal).
    pub weight: Option<u32>,
}

/// The largest weight (the InferenceModelRewrite API's).
pub const MAX_REWRITE_WEIGHT: u32 = 1_000_000;

impl ModelRewriteRule {
    /// What is wrong with it: the field (under the rule) and why.
    pub fn problem(&self) -> Option<(String, String)> {
        if let Some(i) = self.matches.iter().position(String::is_empty) {
            return Some((format!("matches[{i}]"), "is empty".into()));
        }
        if self.targets.is_empty() {
            return Some(("targets".into(), "needs at least one target".into()));
        }
        let weighted = self.targets.iter().filter(|t| t.weight.is_some()).count();
        if weighted != 0 && weighted != self.targets.len() {
            return Some(("targets".into(), "set a weight on every target or on none".into()));
        }
        self.targets.iter().enumerate().find_map(|(i, target)| {
            let field = |f: &str| format!("targets[{i}].{f}");
            if target.model.is_empty() {
                Some((field("model"), "is empty".into()))
            } else if target.weight.is_some_and(|w| !(1..=MAX_REWRITE_WEIGHT).contains(&w)) {
                Some((field("weight"), format!("{:?} is outside 1..={MAX_REWRITE_WEIGHT}", target.weight)))
            } else {
                None
            }
        })
    }
}
