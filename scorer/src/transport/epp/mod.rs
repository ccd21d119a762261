//! The Endpoint Picker: kvgate as the picker of a Gateway API Inference Extension
//! `InferencePool`, over the protocol every conformant gateway speaks — Envoy's external
//! processing (`envoy.service.ext_proc.v3.ExternalProcessor`, one bidirectional gRPC stream
//! per HTTP request) plus gRPC health.
//!
//! Per request the gateway streams the request headers and body here; the picker buffers the
//! body (bounded), asks the picking service as every way in does ([`PickingService::pick`](crate::picking::PickingService::pick)), and answers with the pick and its fallbacks in the header
//! `x-gateway-destination-endpoint` and the dynamic metadata `envoy.lb` (identical), then
//! hands the body back unchanged. It then reads the response the gateway relays — the
//! endpoint that served, the status, the first body bytes, the final usage — instead of the
//! filter's lifecycle reports. See [`exchange`] for one stream, and docs/scorer.md for the
//! gateway-side settings.
//!
//! Health (`grpc.health.v1.Health`, on the same port): `liveness` is serving while the process
//! answers; `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` while some healthy
//! pod can take requests.

mod exchange;

use crate::config::{EppSection, EppTls};
use crate::picking::{Picker, PickingService};
use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

/// The gRPC service name gateways health-check.
pub const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// What the streams share.
#[derive(Default)]
pub struct Shared {
    /// Streams opened so far (their ids, for logs).
    streams: AtomicU64,
    /// Some stream reported responses for a booking another stream made.
    observers_seen: AtomicBool,
    /// The warning about responses nobody reports was given.
    unobserved_warned: AtomicBool,
}

/// The ext_proc service: one [`exchange::Exchange`] per stream, run by the task that serves
/// the stream.
struct ExtProc {
    picker: Picker,
    settings: Arc<EppSection>,
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let id = self.shared.streams.fetch_add(1, Ordering::Relaxed);
        let trace_parent = request.metadata().get("traceparent").and_then(|v| v.to_str().ok()).map(String::from);
        let exchange = exchange::Exchange::new(self.picker.clone(), self.settings.clone(), self.shared.clone(), id)
            .traced(trace_parent);
        Ok(Response::new(Box::pin(exchange.answers(request.into_inner()))))
    }
}

/// The TLS identity the listener serves (`None`: plaintext h2c).
fn identity(tls: &EppTls) -> anyhow::Result<Option<Identity>> {
    match tls {
        EppTls::Plaintext => Ok(None),
        EppTls::Files { cert, key } => {
            let cert = std::fs::read(cert).with_context(|| format!("epp.tls.cert {}", cert.display()))?;
            let key = std::fs::read(key).with_context(|| format!("epp.tls.key {}", key.display()))?;
            Ok(Some(Identity::from_pem(cert, key)))
        }
        EppTls::SelfSigned => {
            let names = vec!["kvgate-epp".to_string(), "localhost".to_string()];
            let certified = rcgen::generate_simple_self_signed(names).context("self-signed certificate")?;
            Ok(Some(Identity::from_pem(certified.cert.pem(), certified.signing_key.serialize_pem())))
        }
    }
}

/// Serves the Endpoint Picker until `shutdown` resolves, then lets open exchanges finish for
/// up to `finish` (a full-duplex exchange lasts as long as its response).
pub async fn serve(
    picker: Picker,
    settings: EppSection,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    finish: Duration,
) -> anyhow::Result<()> {
    let listen = settings.listen;
    let identity = identity(&settings.tls)?;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status("liveness", ServingStatus::Serving).await;
    let watched = picker.clone();
    tokio::spawn(async move {
        // Readiness follows the fleet (looked at every 250 ms) and the scorer's own state
        // (draining: at once).
        let mut last = None;
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = watched.readiness_changed() => {}
            }
            let ready = watched.readiness().is_ok();
            if last != Some(ready) {
                let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
                for service in ["readiness", SERVICE, ""] {
                    reporter.set_service_status(service, status).await;
                }
                last = Some(ready);
            }
        }
    });
    // A buffered body arrives as one message: allow the body limit plus the message's framing.
    let max_message = settings.body_limit_bytes + (64 << 10);
    let open = picker.metrics().epp_exchanges_open.clone();
    let ext_proc = ExtProc { picker, settings: Arc::new(settings), shared: Arc::default() };
    let service = ExternalProcessorServer::new(ext_proc).max_decoding_message_size(max_message);
    // Bodies come in a few large messages: windows wide enough that a 220 kB prompt needs no
    // flow-control round trip.
    let mut server = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(32 << 20));
    let secured = identity.is_some();
    if let Some(identity) = identity {
        server = server.tls_config(ServerTlsConfig::new().identity(identity)).context("TLS configuration")?;
    }
    let incoming =
        TcpIncoming::bind(listen).with_context(|| format!("cannot listen on {listen}"))?.with_nodelay(Some(true));
    let listen = incoming.local_addr().unwrap_or(listen);
    tracing::info!(%listen, tls = secured, "endpoint picker (ext_proc) ready");
    super::announce("epp", listen);
    let (closing, closed) = tokio::sync::oneshot::channel();
    let shutdown = async move {
        shutdown.await;
        let _ = closing.send(());
    };
    let served = server.add_service(health).add_service(service).serve_with_incoming_shutdown(incoming, shutdown);
    tokio::select! {
        served = served => served.context("endpoint picker server"),
        () = async {
            if closed.await.is_ok() {
                tokio::time::sleep(finish).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => {
            let open = open.get();
            tracing::warn!(open, "endpoint picker: exchanges still open {} s after closing; cut", finish.as_secs_f64());
            Ok(())
        }
    }
}
