//! The picking service: what every way into kvgate asks of the scorer, in one typed contract.
//!
//! A transport — the HTTP API, the route stream and the route socket, the Endpoint Picker's
//! ext_proc exchange (`transport/`) — turns its wire format into a [`PickRequest`], asks
//! [`PickingService::pick`] and turns the [`Pick`] or the [`PickError`] back into its own format; it
//! tells the service of the request's first token and end ([`PickingService::report`]) and of the pod
//! that really served it ([`PickingService::served`]). What an error means for the client (status,
//! error type, `Retry-After`) is decided by its [`Refused`] reason, and errors are counted
//! here, once for every transport.

use crate::metrics::Metrics;
use crate::scorer::{Limits, Scorer};
use crate::traces::Traces;
use bytes::Bytes;
use kvgate_route_api::{Api, ErrorBody, HEADER_API_PATH, LifecycleReport, Refusal, Refused};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::scorer::{Pick, PickError, Pod};

/// One request to pick a pod for, as a transport hands it over.
pub struct PickRequest<'a> {
    /// The id its booking goes under, which its lifecycle reports name; one is made up when
    /// absent or empty.
    pub booking: Option<&'a str>,
    /// The client's API path (`None`: the caller named none).
    pub api_path: Option<&'a str>,
    /// The client's request body, verbatim.
    pub body: Bytes,
    /// The request's objective (`x-gateway-inference-objective`): its priority under overload.
    pub objective: Option<&'a str>,
    /// Only the pods at these addresses may serve it (a gateway's subset hint).
    pub subset: Option<&'a [SocketAddr]>,
    /// Collect every candidate's figures (honoured while the debug endpoints are on).
    pub explain: bool,
    /// The request's W3C `traceparent` (the gateway's span), which kvgate's spans join.
    pub trace_parent: Option<&'a str>,
    /// The caller sends the body on with a rewritten model ([`Pick::model_rewrite`]); a
    /// request a rule would rewrite is refused from a caller that cannot.
    pub rewrites_model: bool,
}

/// What a transport asks of the picking service, as a trait: [`Picker`] in the scorer, a fake
/// of the test's in a transport's unit tests (the Endpoint Picker's exchange is driven so,
/// without sockets).
pub trait PickingService: Send + Sync + 'static {
    /// Picks and books the pod for one request.
    fn pick(&self, request: PickRequest<'_>) -> impl std::future::Future<Output = Result<Pick, PickError>> + Send;
    /// One lifecycle event of a booking; false if it named no booking.
    fn report(&self, report: &LifecycleReport) -> bool;
    /// `address` served the booking's request: the booking follows.
    fn served(&self, booking: &str, address: SocketAddr);
    /// A number for a booking id no other request of this process has.
    fn next_booking(&self) -> u64;
    fn metrics(&self) -> &Metrics;
}

impl PickingService for Picker {
    /// Picks the pod (or prefill and decode pods) for one request and books it: the body
    /// prepared (parsed and tokenized, off the connection's thread when long), then decided,
    /// waiting for room while every pod is saturated (with `admission`).
    async fn pick(&self, request: PickRequest<'_>) -> Result<Pick, PickError> {
        let scorer = &self.scorer;
        let span = self.traces.as_ref().map(|traces| traces.pick(request.trace_parent));
        let booking = match request.booking {
            Some(id) if !id.is_empty() => id.to_string(),
            _ => format!("kvgate-scorer-{}", GENERATED_IDS.fetch_add(1, Ordering::Relaxed)),
        };
        let prepared = match Self::api(request.api_path) {
            Ok(api) => scorer.prepare_owned(api, request.body).await,
            Err(e) => Err(e),
        };
        // What a sampled request's span holds beyond the pick: only then gathered.
        let traced = span.as_ref().is_some_and(|span| span.is_recording());
        let mut model = None;
        let decided = match prepared {
            Ok(prepared) => {
                if traced {
                    model = prepared.model.clone();
                }
                if let Some(rewrite) = prepared.rewrite.as_ref().filter(|r| r.span.is_some() && !request.rewrites_model)
                {
                    return Err(PickError::CannotRewrite(rewrite.model.clone()));
                }
                let subset = request.subset.map(|addresses| scorer.pods_at(addresses));
                let limits = Limits {
                    subset: subset.as_ref(),
                    fallbacks: scorer.config.fallback_endpoints,
                    explain: request.explain && scorer.config.admin.debug_endpoints,
                    predict_wait: traced,
                    ..Limits::default()
                };
                scorer.decide_admitted(&booking, &prepared, &limits, request.objective).await
            }
            Err(e) => Err(e),
        };
        match &decided {
            Ok(Pick { model_rewrite: Some(rewrite), .. }) => {
                scorer.metrics.model_rewrites.with_label_values(&[&rewrite.from, &rewrite.model]).inc();
            }
            Ok(_) => {}
            Err(e) => scorer.metrics.route_errors.with_label_values(&[&e.refused().status().to_string()]).inc(),
        }
        if let (Some(traces), Some(span)) = (&self.traces, span) {
            traces.decided(span, &booking, model.as_deref(), &decided);
        }
        decided
    }

    /// One lifecycle event of a booking (the picker's exchange reads them from the responses
    /// it relays); false if it named no booking.
    fn report(&self, report: &LifecycleReport) -> bool {
        if let Some(traces) = &self.traces {
            traces.reports(std::slice::from_ref(report));
        }
        self.scorer.report(report)
    }

    /// The gateway reports that `address` served the booking's request (its retries may have
    /// moved it off the pick): the booking follows.
    fn served(&self, booking: &str, address: SocketAddr) {
        if let Some(traces) = &self.traces {
            traces.served(booking, address);
        }
        self.scorer.served(booking, address)
    }

    /// A number for a booking id no other request of this process has (the Endpoint Picker
    /// books under its own ids: clients' `x-request-id`s may repeat).
    fn next_booking(&self) -> u64 {
        self.scorer.next_booking()
    }

    fn metrics(&self) -> &Metrics {
        &self.scorer.metrics
    }
}

/// The picking service (cheap to clone: every connection holds one).
#[derive(Clone, derive_more::Constructor)]
pub struct Picker {
    scorer: Arc<Scorer>,
    /// The decisions' spans (with `traces`; started by the process, in its runtime).
    traces: Option<Arc<Traces>>,
}

static GENERATED_IDS: AtomicU64 = AtomicU64::new(0);

impl Picker {
    /// The API of a request path (`None`: the caller named none).
    fn api(path: Option<&str>) -> Result<Api, PickError> {
        match path.map(|path| (path, Api::from_path(path))) {
            None => Err(PickError::BadRequest(format!("missing header {HEADER_API_PATH}"))),
            Some((_, Some(api))) => Ok(api),
            Some((path, None)) => Err(PickError::BadRequest(format!("kvgate routes {:?}, not {path:?}", Api::PATHS))),
        }
    }

    /// Applies a proxy's batch of lifecycle reports; returns how many named no booking.
    pub fn report_batch(&self, reports: &[LifecycleReport]) -> usize {
        if let Some(traces) = &self.traces {
            traces.reports(reports);
        }
        self.scorer.lifecycle(reports)
    }

    /// Requests waiting in the admission queue now (a proxy sends its reports at once while
    /// some do).
    pub fn admission_waiting(&self) -> u32 {
        u32::try_from(self.scorer.admission_waiting()).unwrap_or(u32::MAX)
    }

    /// Changes whenever requests start waiting for admission or none waits any more; `None`
    /// without admission.
    pub fn admission_queuing(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        self.scorer.admission_queuing()
    }

    /// Whether the scorer is ready to route (a picker's readiness), or why not.
    pub fn readiness(&self) -> Result<(), crate::scorer::NotReady> {
        self.scorer.readiness()
    }

    /// Wakes when readiness changed for a reason other than the fleet (draining).
    pub async fn readiness_changed(&self) {
        self.scorer.readiness_changed.notified().await
    }
}

impl PickError {
    /// What the error means for the client: one mapping for every transport.
    pub fn refused(&self) -> Refused {
        match self {
            PickError::BadRequest(_) => Refused::BadRequest,
            PickError::TooLarge(_) => Refused::TooLarge,
            PickError::NoPod | PickError::CannotRewrite(_) => Refused::NoPod,
            PickError::ModelNotServed(_) => Refused::ModelNotFound,
            PickError::Stopping => Refused::Stopping,
            PickError::Saturated | PickError::Shed { .. } => Refused::Overloaded,
        }
    }

    /// `Retry-After` seconds, for a request refused for overload.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            PickError::Shed { retry_after_seconds, .. } => Some(*retry_after_seconds),
            _ => None,
        }
    }

    /// The error as the route protocol carries it.
    pub fn refusal(&self) -> Refusal {
        Refusal { reason: self.refused() as i32, message: self.to_string(), retry_after: self.retry_after() }
    }

    /// The error as an HTTP client gets it (OpenAI's error shape).
    pub fn body(&self) -> ErrorBody {
        ErrorBody::refused(self.refused(), self.to_string())
    }
}
