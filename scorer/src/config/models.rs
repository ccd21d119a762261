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
