//! The scorer's admin endpoints: `/metrics`, the probes (`/healthz`, `/readyz`) and the debug
//! endpoint `/v1/pods` — on `listen` beside the API, or on their own `admin.listen`.

use crate::scorer::Scorer;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use kvgate_route_api::{ErrorBody, Refused};
use std::sync::Arc;

/// Everything the admin listener serves (the probes only, when `probes_only`: on `listen`
/// while the rest is on `admin.listen`).
pub fn routes<S>(scorer: Arc<Scorer>, probes_only: bool) -> Router<S> {
    let probes = Router::new().route("/healthz", get(|| async { StatusCode::OK })).route("/readyz", get(readyz));
    let admin = if probes_only { probes } else { probes.route("/metrics", get(metrics)) };
    let admin =
        if scorer.config.admin.debug_endpoints && !probes_only { admin.route("/v1/pods", get(pods)) } else { admin };
    admin.with_state(scorer)
}

fn error(body: ErrorBody) -> Response {
    (StatusCode::from_u16(body.error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), Json(body)).into_response()
}

/// The answer to a path nobody serves.
pub fn not_found() -> Response {
    error(ErrorBody::new(404, "NotFound", "no such endpoint"))
}

async fn pods(State(scorer): State<Arc<Scorer>>) -> Response {
    Json(scorer.pods_view()).into_response()
}

async fn metrics(State(scorer): State<Arc<Scorer>>) -> Response {
    scorer.pods_view(); // refreshes the per-pod gauges
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], scorer.metrics.render())
        .into_response()
}

async fn readyz(State(scorer): State<Arc<Scorer>>) -> Response {
    match scorer.readiness() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(why) => error(ErrorBody::refused(Refused::NoPod, why.to_string())),
    }
}
