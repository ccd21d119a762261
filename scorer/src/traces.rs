//! Traces: each request's decision as spans of its trace, exported over OTLP/gRPC (`traces:`).
//!
//! A way in hands the picking service the request's W3C `traceparent` — the gateway's span
//! (the picker's ext_proc call carries it in its gRPC metadata; the filters read it from the
//! request); kvgate's spans are its children and follow its sampling decision. Two spans per
//! sampled request:
//!
//! - `kvgate.pick`, from the request's arrival at the scorer to its decision (admission's
//!   wait included): the pod chosen and why (cached tokens, predicted wait), or the refusal;
//! - `kvgate.response`, from the decision to the response's end as the proxy reports it:
//!   the time to the first token, the pod that answered (a fallback, when the pick refused
//!   the connection), output tokens and what the engine said it had cached.
//!
//! Never the prompt: only counts and names. Without `traces:` nothing here runs.

use crate::config::TracesSection;
use crate::scorer::{Pick, PickError};
use ahash::AHashMap;
use kvgate_route_api::{LifecycleEvent, LifecycleReport};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Span, Tracer};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// The exporter and the responses whose spans are open.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: Tracer,
    /// `kvgate.response` spans by booking, until their request's end is reported.
    responses: Mutex<AHashMap<String, Response>>,
    /// A response whose end never comes is closed after this long.
    ttl: Duration,
}

struct Response {
    span: Span,
    /// The picked pod's address: another one answering means a fallback was used.
    picked: String,
    opened: Instant,
    decided: SystemTime,
}

impl Response {
    fn served(&mut self, address: &str) {
        self.span.set_attribute(KeyValue::new("kvgate.served_by", address.to_string()));
        self.span.set_attribute(KeyValue::new("kvgate.fallback_used", address != self.picked));
    }
}

/// A request's `kvgate.pick` span while its decision is made, and the context it joined.
pub struct PickSpan(Span, Context);

impl PickSpan {
    /// Sampled: its attributes are worth gathering.
    pub fn is_recording(&self) -> bool {
        self.0.is_recording()
    }
}

/// The one header a propagator reads here.
struct TraceParent<'a>(&'a str);

impl Extractor for TraceParent<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == "traceparent").then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent"]
    }
}

/// Seconds as a span attribute.
fn seconds(key: &'static str, value: Duration) -> KeyValue {
    KeyValue::new(key, value.as_secs_f64())
}

impl Traces {
    /// Starts the exporter (inside the Tokio runtime: its gRPC channel lives there).
    pub fn start(section: &TracesSection, ttl: Duration) -> anyhow::Result<Self> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(section.otlp_endpoint.to_string())
            .build()?;
        let resource = opentelemetry_sdk::Resource::builder().with_service_name(section.service_name.clone()).build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(section.sample_ratio))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("kvgate");
        Ok(Self { provider, tracer, responses: Mutex::new(AHashMap::new()), ttl })
    }

    /// The request's context: the span its `traceparent` names (none, or unreadable: a root).
    fn parent(trace_parent: Option<&str>) -> Context {
        trace_parent.map_or_else(Context::new, |header| TraceContextPropagator::new().extract(&TraceParent(header)))
    }

    /// Opens a request's `kvgate.pick` span, now.
    pub fn pick(&self, trace_parent: Option<&str>) -> PickSpan {
        let parent = Self::parent(trace_parent);
        let builder = self.tracer.span_builder("kvgate.pick").with_kind(SpanKind::Server);
        PickSpan(builder.start_with_context(&self.tracer, &parent), parent)
    }

    /// Closes a `kvgate.pick` span with its decision; a sampled pick opens its
    /// `kvgate.response` span beside it, under the same parent.
    pub fn decided(&self, span: PickSpan, booking: &str, model: Option<&str>, decided: &Result<Pick, PickError>) {
        let PickSpan(mut span, parent) = span;
        if !span.is_recording() {
            return;
        }
        span.set_attribute(KeyValue::new("kvgate.booking", booking.to_string()));
        match decided {
            Ok(pick) => {
                span.set_attributes([
                    KeyValue::new("kvgate.pod", pick.decode.name.clone()),
                    KeyValue::new("kvgate.pod.address", pick.decode.address.clone()),
                    KeyValue::new("kvgate.path", if pick.prefill.is_some() { "pd" } else { "direct" }),
                    KeyValue::new("kvgate.policy", pick.policy),
                    KeyValue::new("kvgate.prompt_tokens", i64::from(pick.prompt_tokens)),
                    KeyValue::new("kvgate.cached_tokens", i64::from(pick.cached_tokens)),
                    KeyValue::new("kvgate.fallbacks", pick.fallbacks.len() as i64),
                    seconds("kvgate.admission_wait_seconds", pick.admission_wait),
                ]);
                if let Some(prefill) = &pick.prefill {
                    span.set_attribute(KeyValue::new("kvgate.prefill_pod", prefill.name.clone()));
                }
                if let Some(wait) = pick.predicted_wait_seconds {
                    span.set_attribute(KeyValue::new("kvgate.predicted_wait_seconds", wait));
                }
                if let Some(model) = model {
                    span.set_attribute(KeyValue::new("gen_ai.request.model", model.to_string()));
                }
            }
            Err(e) => {
                let refused = e.refused();
                span.set_attributes([
                    KeyValue::new("kvgate.refused", format!("{refused:?}")),
                    KeyValue::new("http.response.status_code", i64::from(refused.status())),
                ]);
                span.set_status(Status::error(e.to_string()));
            }
        }
        span.end();
        let Ok(pick) = decided else { return };
        let response = self
            .tracer
            .span_builder("kvgate.response")
            .with_kind(SpanKind::Internal)
            .start_with_context(&self.tracer, &parent);
        let open = Response {
            span: response,
            picked: pick.decode.address.clone(),
            opened: Instant::now(),
            decided: SystemTime::now(),
        };
        self.responses.lock().unwrap_or_else(|e| e.into_inner()).insert(booking.to_string(), open);
    }

    /// Lifecycle reports (a proxy's batch): a traced request's first token is noted, its end
    /// closes its span. One lock for the batch; reports of requests not traced pass by.
    pub fn reports(&self, reports: &[LifecycleReport]) {
        let mut responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        for report in reports {
            let Some(open) = responses.get_mut(&report.request_id) else { continue };
            let at = SystemTime::now() - Duration::from_micros(report.age_us.map_or(0, u64::from));
            if let Some(served) = &report.served {
                open.served(served);
            }
            let outcome = match report.event {
                LifecycleEvent::FirstToken => {
                    let ttft = at.duration_since(open.decided).unwrap_or_default();
                    open.span.set_attribute(seconds("kvgate.time_to_first_token_seconds", ttft));
                    open.span.add_event_with_timestamp("first_token", at, Vec::new());
                    continue;
                }
                LifecycleEvent::PrefillDone => {
                    open.span.add_event_with_timestamp("prefill_done", at, Vec::new());
                    continue;
                }
                LifecycleEvent::Done => "done",
                LifecycleEvent::Cancelled => "cancelled",
                LifecycleEvent::ErrorStatus => "error_status",
            };
            let Some(mut open) = responses.remove(&report.request_id) else { continue };
            open.span.set_attribute(KeyValue::new("kvgate.outcome", outcome));
            if let Some(tokens) = report.output_tokens {
                open.span.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", i64::from(tokens)));
            }
            if let Some(tokens) = report.cached_tokens {
                open.span.set_attribute(KeyValue::new("kvgate.engine_cached_tokens", i64::from(tokens)));
            }
            if let Some(status) = report.status {
                open.span.set_attribute(KeyValue::new("http.response.status_code", i64::from(status)));
                open.span.set_status(Status::error(format!("the engine answered {status}")));
            }
            open.span.end_with_timestamp(at);
        }
    }

    /// `address` served the booking's request (the picker learns it apart from the reports).
    pub fn served(&self, booking: &str, address: std::net::SocketAddr) {
        if let Some(open) = self.responses.lock().unwrap_or_else(|e| e.into_inner()).get_mut(booking) {
            open.served(&address.to_string());
        }
    }

    /// Closes the response spans whose end was never reported (`kvgate.outcome: expired`).
    pub fn expire(&self) {
        let mut responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        responses.retain(|_, open| {
            let keep = open.opened.elapsed() < self.ttl;
            if !keep {
                open.span.set_attribute(KeyValue::new("kvgate.outcome", "expired"));
                open.span.end();
            }
            keep
        });
    }

    /// Sends what is batched (at exit).
    pub fn shutdown(&self) {
        self.expire();
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("traces: the last spans were not exported: {e}");
        }
    }
}
