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
                !self.report_locked(&mut core, &r.request_id, r.event, r.output_tokens, at)
            })
            .count();
        drop(core);
        self.bookings_changed();
        self.metrics.lifecycle_unknown.inc_by(unknown as u64);
        self.room_may_have_appeared();
        unknown
    }

    /// One lifecycle event of a request (the Endpoint Picker's, read from the response it
    /// relays); false if it named no in-flight request.
    pub fn report(&self, request_id: &str, event: LifecycleEvent, output_tokens: Option<u32>) -> bool {
        let now = self.now();
        let known = self.report_locked(&mut self.lock(), request_id, event, output_tokens, now);
        if !known {
            self.metrics.lifecycle_unknown.inc();
        }
        self.bookings_changed();
        self.room_may_have_appeared();
        known
    }

    fn report_locked(
        &self,
        core: &mut Core,
        request_id: &str,
        event: LifecycleEvent,
        output_tokens: Option<u32>,
        now: f64,
    ) -> bool {
        let (lifecycle, label) = match event {
            LifecycleEvent::FirstToken => (Lifecycle::FirstToken, "first_token"),
            LifecycleEvent::Done => (Lifecycle::Done, "done"),
            LifecycleEvent::Cancelled => (Lifecycle::Cancelled, "cancelled"),
            LifecycleEvent::PrefillDone => (Lifecycle::Done, "prefill_done"),
        };
        self.metrics.lifecycle_reports.with_label_values(&[label]).inc();
        if let Some(n) = output_tokens {
            self.metrics.output_tokens.inc_by(u64::from(n));
            if event == LifecycleEvent::Done {
                core.router.decoded(request_id, n, now);
            }
        }
        core.router.report(request_id, lifecycle, event == LifecycleEvent::PrefillDone, now).is_ok()
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
