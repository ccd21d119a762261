//! Bookings after the decision: lifecycle reports (dated by their age), the endpoint that
//! really served a request, and the bookings shared with the other gateway replicas.

use super::pod_health::DownReason;
use super::{Core, Pod, Scorer, SyncState};
use kvgate_route_api::{LifecycleEvent, LifecycleReport};
use kvgate_routing::load::{BookingUpdate, Lifecycle, Origin};
use std::net::SocketAddr;
use std::sync::Arc;

/// A lifecycle report's age is believed up to this (a proxy flushes its batches every few
/// milliseconds; an age beyond it is a clock jump or a bug, not a late report).
const MAX_REPORT_AGE_SECONDS: f64 = 10.0;

impl Scorer {
    /// Applies a batch of lifecycle reports (the filter's); returns how many named no
    /// in-flight request. Each report is dated by its age (the filter batches them): a first
    /// token reported 15 ms late still ends its prefill where it ended.
    pub fn lifecycle(&self, reports: &[LifecycleReport]) -> usize {
        let now = self.now();
        let mut core = self.lock();
        let unknown = reports
            .iter()
            .filter(|r| {
                let age = r.age_us.map_or(0.0, |us| (f64::from(us) / 1e6).min(MAX_REPORT_AGE_SECONDS));
                let at = (now - age).max(0.0);
                // Where it was served comes with the first token: the booking follows first.
                if let Some(served) = r.served.as_deref().and_then(|a| a.parse().ok()) {
                    self.served_locked(&mut core, &r.request_id, served, at);
                }
                !self.report_locked(&mut core, r, at)
            })
            .count();
        drop(core);
        self.bookings_changed();
        self.metrics.lifecycle_unknown.inc_by(unknown as u64);
        self.room_may_have_appeared();
        unknown
    }

    /// One lifecycle report of a request (the Endpoint Picker's, read from the response it
    /// relays); false if it named no in-flight request.
    pub fn report(&self, report: &LifecycleReport) -> bool {
        let now = self.now();
        let known = self.report_locked(&mut self.lock(), report, now);
        if !known {
            self.metrics.lifecycle_unknown.inc();
        }
        self.bookings_changed();
        self.room_may_have_appeared();
        known
    }

    fn report_locked(&self, core: &mut Core, report: &LifecycleReport, now: f64) -> bool {
        let request_id = report.request_id.as_str();
        let (lifecycle, label) = match report.event {
            LifecycleEvent::FirstToken => (Lifecycle::FirstToken, "first_token"),
            LifecycleEvent::Done => (Lifecycle::Done, "done"),
            LifecycleEvent::Cancelled => (Lifecycle::Cancelled, "cancelled"),
            LifecycleEvent::PrefillDone => (Lifecycle::Done, "prefill_done"),
            LifecycleEvent::ErrorStatus => (Lifecycle::Cancelled, "error_status"),
        };
        self.metrics.lifecycle_reports.with_label_values(&[label]).inc();
        match report.event {
            LifecycleEvent::Done => self.check_prediction(core, request_id, report.cached_tokens),
            LifecycleEvent::ErrorStatus => {
                let class = match report.status {
                    Some(400..=499) => "4xx",
                    Some(500..=599) => "5xx",
                    _ => "other",
                };
                let pod = core.router.credited(request_id).map_or("", |credit| core.name(credit.pod));
                self.metrics.error_responses.with_label_values(&[pod, class]).inc();
            }
            _ => {}
        }
        if let Some(n) = report.output_tokens {
            self.metrics.output_tokens.inc_by(u64::from(n));
            if report.event == LifecycleEvent::Done {
                core.router.decoded(request_id, n, now);
            }
        }
        core.router.report(request_id, lifecycle, report.event == LifecycleEvent::PrefillDone, now).is_ok()
    }

    /// A request is done and its engine said how many of its prompt tokens it served from
    /// its cache: held against what kvgate credited the pod with. More credited than served
    /// is a pick made for a cache that was not there: `evicted` if the engine evicted a
    /// credited block while the request was in flight (cache pressure), else `over` (kvgate
    /// believed in blocks the engine did not hold: worth a warning).
    fn check_prediction(&self, core: &Core, request_id: &str, served: Option<u32>) {
        let (Some(served), Some(credit)) = (served, core.router.credited(request_id)) else { return };
        let name = core.name(credit.pod);
        let outcome = match credit.tokens.cmp(&served) {
            std::cmp::Ordering::Equal => "exact",
            std::cmp::Ordering::Less => "under",
            std::cmp::Ordering::Greater => {
                let over = u64::from(credit.tokens - served);
                self.metrics.prefix_overcredited_tokens.with_label_values(&[name]).inc_by(over);
                let credited = credit.tokens;
                if credit.evicted {
                    tracing::debug!(pod = %name, request_id, credited, served, "the engine evicted credited blocks before the request used them");
                    "evicted"
                } else {
                    tracing::warn!(pod = %name, request_id, credited, served, "credited more cached tokens than the engine held");
                    "over"
                }
            }
        };
        self.metrics.prefix_predictions.with_label_values(&[name, outcome]).inc();
    }

    /// The proxy reports that `address` served the request (its retries may have moved it
    /// off the pick): the booking follows.
    pub fn served(&self, request_id: &str, address: SocketAddr) {
        let now = self.now();
        self.served_locked(&mut self.lock(), request_id, address, now);
        self.bookings_changed();
    }

    /// Wakes the booking sync's publisher (with `sync`): bookings changed.
    pub(super) fn bookings_changed(&self) {
        if self.config.sync.is_some() {
            self.sync.wake.notify_one();
        }
    }

    /// The booking sync's shared state.
    pub fn sync_state(&self) -> &SyncState {
        &self.sync
    }

    /// This replica's booking changes since the last call, and the pod table that names
    /// their pods.
    pub fn take_shared(&self) -> (Vec<BookingUpdate>, Vec<Arc<Pod>>) {
        let mut core = self.lock();
        (core.router.take_shared(), core.infos())
    }

    /// At one instant: the changes not yet taken, then this replica's bookings as a
    /// snapshot, and the pod table.
    pub fn snapshot_shared(&self) -> (Vec<BookingUpdate>, Vec<BookingUpdate>, Vec<Arc<Pod>>) {
        let mut core = self.lock();
        (core.router.take_shared(), core.router.snapshot(), core.infos())
    }

    /// Applies another replica's booking changes; returns how many named a booking this
    /// replica does not hold (expired here, or reported before its booking arrived).
    pub fn apply_shared(&self, origin: Origin, updates: &[BookingUpdate]) -> usize {
        let now = self.now();
        let mut core = self.lock();
        let unknown = updates.iter().filter(|u| core.router.apply_shared(origin, u, now).is_err()).count();
        drop(core);
        self.room_may_have_appeared();
        unknown
    }

    /// Forgets another replica's bookings; returns how many.
    pub fn clear_origin(&self, origin: Origin) -> usize {
        let n = self.lock().router.clear_origin(origin);
        self.room_may_have_appeared();
        n
    }

    pub(super) fn served_locked(&self, core: &mut Core, request_id: &str, address: SocketAddr, now: f64) {
        let Some(&pod) = core.by_address.get(&address) else { return };
        if let Ok(Some(picked)) = core.router.served(request_id, pod, now) {
            self.metrics.bookings_moved.inc();
            // The pick did not answer (refused, or reset before a response): the first
            // failed connection heard of takes it out until it proves alive again.
            self.pod_down(core, picked, DownReason::NotServed, now);
        }
    }
}
