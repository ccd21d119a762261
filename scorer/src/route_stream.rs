//! The route stream: route calls as gRPC messages on one long-lived bidirectional stream
//! (`kvgate.route.v1.Router/Route`) instead of one HTTP call each — what the filter uses.
//! Each call is answered as `POST /v1/route` would answer it ([`http::answer_route`]), in
//! its own task on the thread that serves the stream's connection ([`crate::serve`]), so a
//! call waiting for room (admission) holds up no other; answers go back in the order they
//! are ready. Lifecycle reports ride on the stream too ([`RouteCall::reports`]): applied as
//! they are read, before the call they came with; a message with no API path carries only
//! reports and is not answered.

use crate::http;
use crate::scorer::Scorer;
use futures::future::BoxFuture;
use kvgate_route_api::{LifecycleReport, RouteAnswer, RouteCall, StreamReport};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Answers a caller may have ready before the transport takes them.
const ANSWERS_QUEUED: usize = 1024;

/// The stream's tower service, for the HTTP API's router (the same port, in HTTP/2).
pub fn service(
    scorer: Arc<Scorer>,
) -> impl tower::Service<
    axum::http::Request<axum::body::Body>,
    Response = axum::response::Response,
    Error = Infallible,
    Future = BoxFuture<'static, Result<axum::response::Response, Infallible>>,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |request: axum::http::Request<axum::body::Body>| {
        let scorer = scorer.clone();
        let calls = tower::service_fn(move |calls| serve(scorer.clone(), calls));
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<RouteAnswer, RouteCall>::default())
                // A call carries the client's whole body (Envoy's own limit applies first).
                .max_decoding_message_size(http::MAX_BODY_BYTES + (64 << 10));
            Ok(grpc.streaming(calls, request).await.map(axum::body::Body::new))
        }) as BoxFuture<'static, _>
    })
}

/// One stream: reads calls until the caller ends it, answering each in its own task.
async fn serve(
    scorer: Arc<Scorer>,
    request: Request<Streaming<RouteCall>>,
) -> Result<Response<ReceiverStream<Result<RouteAnswer, Status>>>, Status> {
    let mut calls = request.into_inner();
    let (answers, receiver) = mpsc::channel(ANSWERS_QUEUED);
    scorer.metrics.route_streams.inc();
    tokio::spawn(async move {
        let notices = admission_notices(&scorer, answers.clone(), Ok);
        loop {
            let call = match calls.message().await {
                Ok(Some(call)) => call,
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!("route stream ended: {status}");
                    break;
                }
            };
            let Some(answer) = take_call(&scorer, call) else { continue };
            let answers = answers.clone();
            tokio::spawn(async move {
                // The caller gone: its lifecycle reports (or their absence) settle the booking.
                let _ = answers.send(Ok(answer.await)).await;
            });
        }
        if let Some(notices) = notices {
            notices.abort();
        }
        scorer.metrics.route_streams.dec();
    });
    Ok(Response::new(ReceiverStream::new(receiver)))
}

/// Applies a call's lifecycle reports and returns its answer to come (`None` for a message
/// carrying reports only): what the route stream and the route socket do with each message.
pub(crate) fn take_call(
    scorer: &Arc<Scorer>,
    mut call: RouteCall,
) -> Option<impl Future<Output = RouteAnswer> + use<>> {
    if !call.reports.is_empty() {
        apply_reports(scorer, std::mem::take(&mut call.reports));
    }
    if call.api_path.is_empty() {
        return None;
    }
    let scorer = scorer.clone();
    Some(async move {
        let outcome = http::answer_route(
            &scorer,
            Some(&call.request_id),
            Some(&call.api_path),
            call.objective.as_deref(),
            call.body.into(),
            false,
        )
        .await;
        RouteAnswer {
            call: call.call,
            status: u32::from(outcome.status.as_u16()),
            body: outcome.body,
            retry_after: outcome.retry_after,
            admission_waiting: u32::try_from(scorer.admission_waiting()).unwrap_or(u32::MAX),
        }
    })
}

/// Tells a route connection's proxy, by an answer to no call (`call` 0), whenever requests
/// start waiting for admission and when none waits any more (when it connects, too, if some
/// wait): while some wait, it sends its lifecycle reports at once. `None` without admission;
/// the caller aborts the task when the connection ends.
pub(crate) fn admission_notices<T: Send + 'static>(
    scorer: &Arc<Scorer>,
    answers: mpsc::Sender<T>,
    wrap: fn(RouteAnswer) -> T,
) -> Option<tokio::task::JoinHandle<()>> {
    let mut queuing = scorer.admission_queuing()?;
    let scorer = scorer.clone();
    Some(tokio::spawn(async move {
        if *queuing.borrow_and_update() {
            queuing.mark_changed();
        }
        while queuing.changed().await.is_ok() {
            // The count as of now, but never against the change told (the next one follows).
            let waiting = if *queuing.borrow_and_update() {
                u32::try_from(scorer.admission_waiting()).unwrap_or(u32::MAX).max(1)
            } else {
                0
            };
            let notice = RouteAnswer { admission_waiting: waiting, ..Default::default() };
            if answers.send(wrap(notice)).await.is_err() {
                break;
            }
        }
    }))
}

/// The reports a stream message carried; one naming no known event is counted and dropped.
fn apply_reports(scorer: &Scorer, reports: Vec<StreamReport>) {
    let reports: Vec<LifecycleReport> = reports
        .into_iter()
        .filter_map(|r| {
            LifecycleReport::try_from(r)
                .map_err(|event| {
                    scorer.metrics.lifecycle_reports.with_label_values(&["invalid"]).inc();
                    tracing::debug!("route stream: a lifecycle report with unknown event {event} dropped");
                })
                .ok()
        })
        .collect();
    scorer.lifecycle(&reports);
}
