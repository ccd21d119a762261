//! An OTLP/gRPC trace receiver for the tests: it serves the OpenTelemetry collector's trace
//! service (the protocol's own generated server) on a loopback port the OS gives, and keeps
//! every span Envoy's tracer and kvgate's exporter send, to be asked.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One span as received.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    /// Its resource's `service.name`.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root.
    pub parent_span_id: String,
    pub attributes: BTreeMap<String, Value>,
    pub events: Vec<String>,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> &Value {
        self.attributes.get(key).unwrap_or(&Value::Null)
    }
}

#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<ReceivedSpan>>>);

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn json(value: Option<Any>) -> Value {
    match value {
        Some(Any::StringValue(s)) => Value::from(s),
        Some(Any::BoolValue(b)) => Value::from(b),
        Some(Any::IntValue(i)) => Value::from(i),
        Some(Any::DoubleValue(d)) => Value::from(d),
        other => Value::from(format!("{other:?}")),
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = self.0.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = (resource_spans.resource.iter().flat_map(|r| &r.attributes))
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.clone())
                .map(|v| json(v.value))
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                received.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: span
                        .attributes
                        .into_iter()
                        .map(|kv| (kv.key, json(kv.value.and_then(|v| v.value))))
                        .collect(),
                    events: span.events.into_iter().map(|e| e.name).collect(),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The receiver, serving until dropped.
pub struct Collector {
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    received: Received,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let received = Received::default();
        let service = TraceServiceServer::new(received.clone());
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await;
        });
        Collector { endpoint, received, task }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.0.lock().unwrap().clone()
    }

    /// The spans received once `done` holds of them (or `limit` passed: then as they are).
    pub async fn wait(&self, limit: Duration, done: impl Fn(&[ReceivedSpan]) -> bool) -> Vec<ReceivedSpan> {
        let start = Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) || start.elapsed() > limit {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
