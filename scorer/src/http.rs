//! The scorer's HTTP API (see the README): `/v1/route`, `/v1/lifecycle`, `/v1/pods`,
//! `/metrics`, `/healthz`, `/readyz`.

use crate::scorer::{Limits, Pick, RouteError, Scorer};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use kvgate_route_api::{
    Api, ErrorBody, HEADER_API_PATH, HEADER_OBJECTIVE, HEADER_REQUEST_ID, LIFECYCLE_PATH, LifecycleBatch, ROUTE_PATH,
    ROUTE_STREAM_PATH, RoutePath, RouteResponse,
};
use serde::Deserialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Largest request body `/v1/route` accepts (Envoy's own limit applies first).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// The API on `listen`: route and lifecycle calls and the probes, plus the admin endpoints
/// unless `admin.listen` moves them.
pub fn router(scorer: Arc<Scorer>) -> Router {
    let api = Router::new()
        .route(ROUTE_PATH, post(route))
        .route(LIFECYCLE_PATH, post(lifecycle))
        .route_service(ROUTE_STREAM_PATH, crate::route_stream::service(scorer.clone()));
    let api = if scorer.config.admin.listen.is_none() { api.merge(admin_routes(&scorer)) } else { api.merge(probes()) };
    api.fallback(|| async { error(StatusCode::NOT_FOUND, "NotFound", "no such endpoint") })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(scorer)
}

/// The API on `admin.listen`.
pub fn admin_router(scorer: Arc<Scorer>) -> Router {
    admin_routes(&scorer)
        .fallback(|| async { error(StatusCode::NOT_FOUND, "NotFound", "no such endpoint") })
        .with_state(scorer)
}

fn probes() -> Router<Arc<Scorer>> {
    Router::new().route("/healthz", get(|| async { StatusCode::OK })).route("/readyz", get(readyz))
}

fn admin_routes(scorer: &Scorer) -> Router<Arc<Scorer>> {
    let admin = probes().route("/metrics", get(metrics));
    if scorer.config.admin.debug_endpoints { admin.route("/v1/pods", get(pods)) } else { admin }
}

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody::new(status.as_u16(), kind, message))).into_response()
}

#[derive(Deserialize)]
struct RouteQuery {
    #[serde(default)]
    explain: Option<String>,
}

static GENERATED_IDS: AtomicU64 = AtomicU64::new(0);

/// What a route call is answered, on HTTP or on the route stream.
pub struct RouteOutcome {
    pub status: StatusCode,
    /// A [`RouteResponse`] or an [`ErrorBody`], JSON.
    pub body: Vec<u8>,
    /// `Retry-After` seconds, with a 429.
    pub retry_after: Option<u64>,
}

/// A route call: the request's id (one is made up when absent), API path, objective and
/// body, as `POST /v1/route` and the route stream carry them.
pub async fn answer_route(
    scorer: &Arc<Scorer>,
    request_id: Option<&str>,
    api_path: Option<&str>,
    objective: Option<&str>,
    body: Bytes,
    explain: bool,
) -> RouteOutcome {
    let request_id = match request_id {
        Some(id) if !id.is_empty() => id.to_string(),
        _ => format!("kvgate-scorer-{}", GENERATED_IDS.fetch_add(1, Ordering::Relaxed)),
    };
    let decided = match api_path.map(|path| (path, Api::from_path(path))) {
        None => Err(RouteError::BadRequest(format!("missing header {HEADER_API_PATH}"))),
        Some((_, Some(api))) => match scorer.prepare_owned(api, body).await {
            Ok(prepared) => {
                let limits = Limits { explain, fallbacks: scorer.config.fallback_endpoints, ..Limits::default() };
                scorer.decide_admitted(&request_id, &prepared, &limits, objective).await
            }
            Err(e) => Err(e),
        },
        Some((path, None)) => Err(RouteError::BadRequest(format!("kvgate routes {:?}, not {path:?}", Api::PATHS))),
    };
    match decided {
        Ok(pick) => RouteOutcome {
            status: StatusCode::OK,
            body: serde_json::to_vec(&route_response(pick)).expect("a route answer serializes"),
            retry_after: None,
        },
        Err(e) => {
            let (code, kind) = e.status();
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            scorer.metrics.route_errors.with_label_values(&[status.as_str()]).inc();
            RouteOutcome {
                status,
                body: serde_json::to_vec(&ErrorBody::new(code, kind, e.to_string())).expect("an error serializes"),
                retry_after: e.retry_after(),
            }
        }
    }
}

async fn route(
    State(scorer): State<Arc<Scorer>>,
    Query(query): Query<RouteQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let explain = scorer.config.admin.debug_endpoints && matches!(query.explain.as_deref(), Some("1" | "true"));
    let outcome = answer_route(
        &scorer,
        header(HEADER_REQUEST_ID),
        header(HEADER_API_PATH),
        header(HEADER_OBJECTIVE),
        body,
        explain,
    )
    .await;
    let mut response =
        (outcome.status, [(axum::http::header::CONTENT_TYPE, "application/json")], outcome.body).into_response();
    if let Some(seconds) = outcome.retry_after {
        response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
    }
    response
}

/// The route call's answer (the filter's wire contract).
fn route_response(pick: Pick) -> RouteResponse {
    RouteResponse {
        decode: pick.decode.address.clone(),
        fallbacks: pick.fallbacks.iter().map(|p| p.address.clone()).collect(),
        prefill: pick.prefill.as_ref().map(|p| p.address.clone()),
        pod: pick.decode.name.clone(),
        prefill_pod: pick.prefill.as_ref().map(|p| p.name.clone()),
        path: if pick.prefill.is_some() { RoutePath::Pd } else { RoutePath::Direct },
        uncached_tokens: pick.uncached_tokens,
        threshold_tokens: pick.threshold_tokens,
        policy: pick.policy.to_string(),
        prompt_tokens: pick.prompt_tokens,
        cached_tokens: pick.cached_tokens,
        explain: pick.explain,
    }
}

async fn lifecycle(State(scorer): State<Arc<Scorer>>, body: Bytes) -> Response {
    match serde_json::from_slice::<LifecycleBatch>(&body) {
        Ok(batch) => {
            let unknown = scorer.lifecycle(&batch.reports);
            Json(serde_json::json!({"accepted": batch.reports.len() - unknown, "unknown": unknown})).into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, "BadRequestError", format!("invalid lifecycle batch: {e}")),
    }
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
    if scorer.ready() {
        StatusCode::OK.into_response()
    } else {
        error(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable", "no healthy pod")
    }
}
