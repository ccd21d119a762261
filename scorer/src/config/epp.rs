//! `epp:`, the Endpoint Picker's listener (see `crate::transport::epp`).

use kvgate_route_api::lifecycle::header_name;
use kvgate_routing::validate::{Invalid, check};
use serde::Deserialize;
use smart_default::SmartDefault;
use std::net::SocketAddr;
use std::path::PathBuf;

/// The Endpoint Picker: the Gateway API Inference Extension's protocol (Envoy ext_proc over
/// gRPC), so any InferencePool gateway can use kvgate as its picker.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct EppSection {
    /// gRPC address of `envoy.service.ext_proc.v3.ExternalProcessor` and gRPC health.
    #[default(SocketAddr::from(([0, 0, 0, 0], 9002)))]
    pub listen: SocketAddr,
    #[default(EppTls::SelfSigned)]
    pub tls: EppTls,
    /// Largest request body buffered for a decision; larger ones are answered 413.
    #[default(8 << 20)]
    pub body_limit_bytes: usize,
    /// Header naming the prefill pod of a disaggregated request (llm-d's decode sidecars).
    #[default = "x-prefiller-host-port"]
    pub prefiller_header: String,
}

/// How the Endpoint Picker's gRPC listener is secured. Gateways dial pickers over TLS
/// without verifying them by default (Istio with a DestinationRule, llm-d's Envoy), so a
/// self-signed certificate made at start-up is the drop-in default.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum EppTls {
    /// A certificate for `kvgate-epp` generated at start-up.
    #[default]
    SelfSigned,
    /// PEM certificate chain and private key (e.g. a mounted Secret).
    Files {
        /// The PEM certificate chain.
        cert: PathBuf,
        /// The PEM private key.
        key: PathBuf,
    },
    /// Plain HTTP/2 (h2c).
    Plaintext,
}

impl EppSection {
    pub(super) fn check(&self) -> Result<(), Invalid> {
        check(self.body_limit_bytes > 0, "body_limit_bytes", "must be positive")?;
        let h = &self.prefiller_header;
        check(header_name(h), "prefiller_header", &format!("{h:?} is not a lowercase header name"))
    }
}
