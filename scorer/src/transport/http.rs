//! The HTTP API's picking calls (JSON): `POST /v1/route` — a request's headers and body in,
//! a [`RouteResponse`] or an [`ErrorBody`](kvgate_route_api::ErrorBody) out — and
//! `POST /v1/lifecycle`, a [`LifecycleBatch`] of reports. What people try by hand; the proxies
//! use the route stream or the route socket.

use crate::picking::{Pick, PickRequest, Picker, PickingService};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use kvgate_route_api::{
    ErrorBody, HEADER_API_PATH, HEADER_OBJECTIVE, HEADER_REQUEST_ID, LIFECYCLE_PATH, LifecycleBatch, ROUTE_PATH,
    RoutePath, RoutePick, RouteResponse,
};
use serde::Deserialize;

/// `POST /v1/route` and `POST /v1/lifecycle`.
pub fn routes<S>(picker: Picker) -> Router<S> {
    Router::new().route(ROUTE_PATH, post(route)).route(LIFECYCLE_PATH, post(lifecycle)).with_state(picker)
}

/// A JSON answer with `status`.
pub fn json(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// An error answer in OpenAI's shape.
pub fn error(error: ErrorBody) -> Response {
    let status = StatusCode::from_u16(error.error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(status, error.to_json())
}

#[derive(Deserialize)]
struct RouteQuery {
    explain: Option<String>,
}

async fn route(
    State(picker): State<Picker>,
    Query(query): Query<RouteQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let request = PickRequest {
        booking: header(HEADER_REQUEST_ID),
        api_path: header(HEADER_API_PATH),
        body,
        objective: header(HEADER_OBJECTIVE),
        subset: None,
        explain: matches!(query.explain.as_deref(), Some("1" | "true")),
        trace_parent: header("traceparent"),
        rewrites_model: true, // the answer's `model`
    };
    let picked = picker.pick(request).await;
    match picked {
        Ok(pick) => json(StatusCode::OK, serde_json::to_vec(&route_response(pick)).unwrap_or_default()),
        Err(e) => {
            let mut response = error(e.body());
            if let Some(seconds) = e.retry_after() {
                response.headers_mut().insert(header::RETRY_AFTER, seconds.into());
            }
            response
        }
    }
}

/// The pick as the HTTP API answers it.
fn route_response(pick: Pick) -> RouteResponse {
    let RoutePick { decode, fallbacks, prefill, pod, model_rewrite } = pick.route_pick();
    RouteResponse {
        decode,
        fallbacks,
        prefill,
        pod,
        prefill_pod: pick.prefill.as_ref().map(|p| p.name.clone()),
        path: if pick.prefill.is_some() { RoutePath::Pd } else { RoutePath::Direct },
        uncached_tokens: pick.uncached_tokens,
        threshold_tokens: pick.threshold_tokens,
        policy: pick.policy.to_string(),
        prompt_tokens: pick.prompt_tokens,
        cached_tokens: pick.cached_tokens,
        model: model_rewrite.map(|r| r.model),
        explain: pick.explain,
    }
}

async fn lifecycle(State(picker): State<Picker>, body: Bytes) -> Response {
    match serde_json::from_slice::<LifecycleBatch>(&body) {
        Ok(batch) => {
            let unknown = picker.report_batch(&batch.reports);
            Json(serde_json::json!({"accepted": batch.reports.len() - unknown, "unknown": unknown})).into_response()
        }
        Err(e) => error(ErrorBody::new(400, "BadRequestError", format!("invalid lifecycle batch: {e}"))),
    }
}
