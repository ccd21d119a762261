//! The route protocol's calls, whichever framing carries them (the gRPC route stream, the
//! route socket): a [`RouteCall`] becomes a [`PickRequest`] and its pick a [`RouteAnswer`];
//! reports riding on a call are applied first; proxies are told when requests start and stop
//! waiting for admission.

use crate::picking::{PickRequest, Picker, PickingService};
use kvgate_route_api::{LifecycleReport, Outcome, RouteAnswer, RouteCall, StreamReport};
use tokio::sync::mpsc;

/// Applies a call's lifecycle reports and returns its answer to come (`None` for a message
/// carrying reports only).
pub fn take_call(picker: &Picker, mut call: RouteCall) -> Option<impl Future<Output = RouteAnswer> + use<>> {
    if !call.reports.is_empty() {
        apply_reports(picker, std::mem::take(&mut call.reports));
    }
    if call.api_path.is_empty() {
        return None;
    }
    let picker = picker.clone();
    Some(async move {
        let request = PickRequest {
            booking: Some(&call.request_id),
            api_path: Some(&call.api_path),
            body: call.body.into(),
            objective: call.objective.as_deref(),
            subset: None,
            explain: false,
            trace_parent: call.trace_parent.as_deref(),
            rewrites_model: call.rewrites_model,
        };
        let outcome = match picker.pick(request).await {
            Ok(pick) => Outcome::Pick(pick.route_pick()),
            Err(e) => Outcome::Refusal(e.refusal()),
        };
        RouteAnswer { call: call.call, admission_waiting: picker.admission_waiting(), outcome: Some(outcome) }
    })
}

/// Tells a route connection's proxy, by an answer to no call (`call` 0), whenever requests
/// start waiting for admission and when none waits any more (when it connects, too, if some
/// wait): while some wait, it sends its lifecycle reports at once. `None` without admission;
/// the caller aborts the task when the connection ends.
pub fn admission_notices<T: Send + 'static>(
    picker: &Picker,
    answers: mpsc::Sender<T>,
    wrap: fn(RouteAnswer) -> T,
) -> Option<tokio::task::JoinHandle<()>> {
    let mut queuing = picker.admission_queuing()?;
    let picker = picker.clone();
    Some(tokio::spawn(async move {
        if *queuing.borrow_and_update() {
            queuing.mark_changed();
        }
        while queuing.changed().await.is_ok() {
            // The count as of now, but never against the change told (the next one follows).
            let waiting = if *queuing.borrow_and_update() { picker.admission_waiting().max(1) } else { 0 };
            let notice = RouteAnswer { admission_waiting: waiting, ..Default::default() };
            if answers.send(wrap(notice)).await.is_err() {
                break;
            }
        }
    }))
}

/// The reports a call carried; one naming no known event is counted and dropped.
fn apply_reports(picker: &Picker, reports: Vec<StreamReport>) {
    let reports: Vec<LifecycleReport> = reports
        .into_iter()
        .filter_map(|r| {
            LifecycleReport::try_from(r)
                .map_err(|event| {
                    picker.metrics().lifecycle_reports.with_label_values(&["invalid"]).inc();
                    tracing::debug!("route call: a lifecycle report with unknown event {event} dropped");
                })
                .ok()
        })
        .collect();
    picker.report_batch(&reports);
}

/// Says that a proxy of another protocol version was refused: at most once a minute at warn
/// level (such a proxy retries every few hundred milliseconds), at debug level otherwise.
pub fn refused_version(what: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};
    static LAST_WARNED: AtomicU64 = AtomicU64::new(0);
    let message = format!(
        "refused a {what}: this scorer speaks route protocol {}; deploy the kvgate filter of the same release",
        kvgate_route_api::ROUTE_PROTOCOL
    );
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let last = LAST_WARNED.load(Ordering::Relaxed);
    if now >= last + 60 && LAST_WARNED.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
        tracing::warn!("{message}");
    } else {
        tracing::debug!("{message}");
    }
}
