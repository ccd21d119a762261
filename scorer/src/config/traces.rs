//! `traces:`, each request's decision as a span of its trace, exported over OTLP (see
//! `crate::traces`).

use kvgate_routing::validate::{Invalid, check};
use serde::Deserialize;

/// Spans of kvgate's decisions, joined to the request's trace (W3C `traceparent`).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TracesSection {
    /// The OTLP/gRPC receiver the spans go to (`http://collector:4317`). The Envoy bootstrap
    /// rendered from this configuration (`kvgate-envoy-config`) turns the gateway's own
    /// OpenTelemetry tracer on towards the same receiver.
    pub otlp_endpoint: OtlpEndpoint,
    /// The share of requests traced among those that come without a sampled or unsampled
    /// parent (no `traceparent`, or one kvgate cannot read). A request whose trace the
    /// gateway started follows its parent's decision, whatever this says. The rendered Envoy
    /// bootstrap samples at the same ratio.
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
    /// The `service.name` of kvgate's spans.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_sample_ratio() -> f64 {
    1.0
}

fn default_service_name() -> String {
    "kvgate".into()
}

/// An OTLP/gRPC receiver: an `http://host:port` URL, checked when read; shown as the URL it is.
#[derive(Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema, derive_more::Debug, derive_more::Deref)]
#[serde(try_from = "String")]
#[schemars(with = "String")]
#[debug("{_0:?}")]
pub struct OtlpEndpoint(http::Uri);

impl TryFrom<String> for OtlpEndpoint {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.parse::<http::Uri>() {
            Ok(uri) if uri.scheme_str() == Some("http") && uri.port_u16().is_some() => Ok(OtlpEndpoint(uri)),
            _ => Err(format!("{text:?} is not an http://host:port URL (OTLP over gRPC, without TLS)")),
        }
    }
}

impl TracesSection {
    pub(super) fn check(&self) -> Result<(), Invalid> {
        check((0.0..=1.0).contains(&self.sample_ratio), "sample_ratio", "must be in [0, 1]")
    }
}
