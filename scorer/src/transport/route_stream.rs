//! The route stream: route calls as gRPC messages on one long-lived bidirectional stream
//! ([`kvgate_route_api::ROUTE_STREAM_PATH`]) instead of one HTTP call each — what the wasm
//! filter uses. Each call is answered in its own task on the thread that serves the stream's
//! connection ([`crate::serve`]), so a call waiting for room (admission) holds up no other;
//! answers go back in the order they are ready ([`route_calls`]).
//!
//! A filter of the protocol's first version (`kvgate.route.v1`) is refused: its stream fails at
//! once with `FAILED_PRECONDITION` naming the versions, and the scorer says so in its log.

use super::route_calls::{self, admission_notices, take_call};
use crate::picking::{Picker, PickingService};
use futures::future::BoxFuture;
use kvgate_route_api::{ROUTE_PROTOCOL, ROUTE_SOCKET_MAX_MESSAGE, RouteAnswer, RouteCall};
use std::convert::Infallible;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Answers a caller may have ready before the transport takes them.
const ANSWERS_QUEUED: usize = 1024;

type HttpRequest = axum::http::Request<axum::body::Body>;
type HttpResponse = axum::http::Response<axum::body::Body>;

/// The stream's tower service, for the HTTP API's router (the same port, in HTTP/2).
pub fn service(
    picker: Picker,
) -> impl tower::Service<
    HttpRequest,
    Response = HttpResponse,
    Error = Infallible,
    Future = BoxFuture<'static, Result<HttpResponse, Infallible>>,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |request: HttpRequest| {
        let picker = picker.clone();
        let calls = tower::service_fn(move |calls| serve(picker.clone(), calls));
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<RouteAnswer, RouteCall>::default())
                .max_decoding_message_size(ROUTE_SOCKET_MAX_MESSAGE);
            Ok(grpc.streaming(calls, request).await.map(axum::body::Body::new))
        }) as BoxFuture<'static, _>
    })
}

/// Answers a stream of the protocol's first version: refused, saying why.
pub async fn refuse_v1() -> HttpResponse {
    route_calls::refused_version("route stream of protocol 1");
    let status = Status::failed_precondition(format!(
        "kvgate route protocol 1 is not served by this scorer (it speaks {ROUTE_PROTOCOL}): deploy the kvgate filter \
         of the same release"
    ));
    status.into_http()
}

/// One stream: reads calls until the caller ends it, answering each in its own task.
async fn serve(
    picker: Picker,
    request: Request<Streaming<RouteCall>>,
) -> Result<Response<ReceiverStream<Result<RouteAnswer, Status>>>, Status> {
    let mut calls = request.into_inner();
    let (answers, receiver) = mpsc::channel(ANSWERS_QUEUED);
    picker.metrics().route_streams.inc();
    tokio::spawn(async move {
        let notices = admission_notices(&picker, answers.clone(), Ok);
        loop {
            let call = match calls.message().await {
                Ok(Some(call)) => call,
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!("route stream ended: {status}");
                    break;
                }
            };
            let Some(answer) = take_call(&picker, call) else { continue };
            let answers = answers.clone();
            tokio::spawn(async move {
                // The caller gone: its lifecycle reports (or their absence) settle the booking.
                let _ = answers.send(Ok(answer.await)).await;
            });
        }
        if let Some(notices) = notices {
            notices.abort();
        }
        picker.metrics().route_streams.dec();
    });
    Ok(Response::new(ReceiverStream::new(receiver)))
}
