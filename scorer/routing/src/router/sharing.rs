//! Gateway replicas sharing their bookings: this router's changes kept for the others, theirs
//! applied under their origin, and a snapshot of its own for a replica that joins.

use super::Router;
use crate::hash::SequenceHash;
use crate::load::{Booking, BookingKey, BookingUpdate, Leg, Lifecycle, Origin, UnknownRequest};
use crate::pod_set::PodId;
impl Router {
    /// From now on every change this router makes to its bookings (a decision, a lifecycle
    /// report, a moved booking) is kept for [`Router::take_shared`]: gateway replicas that
    /// apply each other's ([`Router::apply_shared`]) decide on the whole fleet's requests in
    /// flight. Expiry, reconciliation and pods going down are each replica's own judgement.
    pub fn share_bookings(&mut self) {
        self.shared.get_or_insert_with(Vec::new);
    }

    /// The booking changes made since the last call (none unless sharing).
    pub fn take_shared(&mut self) -> Vec<BookingUpdate> {
        self.shared.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Applies another replica's booking change as if this router had made it (the
    /// approximate index learns where its request went, too).
    pub fn apply_shared(&mut self, origin: Origin, update: &BookingUpdate, now: f64) -> Result<(), UnknownRequest> {
        match update {
            BookingUpdate::Booked { request, leg, booking } => {
                let key = BookingKey { origin, leg: *leg, request: request.clone() };
                self.load.book(&key, booking, now);
                self.record_routed(booking.pod, &booking.chain, booking.adapter, now);
            }
            BookingUpdate::Reported { request, leg, event } => {
                self.load.report(&BookingKey { origin, leg: *leg, request: request.clone() }, *event, now)?;
            }
            BookingUpdate::Moved { request, leg, pod, cached_tokens } => {
                let key = BookingKey { origin, leg: *leg, request: request.clone() };
                self.load.rebook(&key, *pod, *cached_tokens)?;
                if let Some((chain, _)) = self.load.booked_prompt(&key) {
                    self.record_routed(*pod, &chain, self.load.booked_adapter(&key), now);
                }
            }
        }
        Ok(())
    }

    /// Forgets another replica's bookings (it left, or a snapshot of them follows).
    pub fn clear_origin(&mut self, origin: Origin) -> usize {
        self.load.clear_origin(origin)
    }

    /// This replica's bookings as updates that rebuild them elsewhere: for a replica that
    /// joins, or lost some of our updates.
    pub fn snapshot(&self) -> Vec<BookingUpdate> {
        let mut out = Vec::new();
        for (key, booking, first_token) in self.load.local_bookings() {
            out.push(BookingUpdate::Booked { request: key.request.clone(), leg: key.leg, booking });
            if first_token {
                out.push(BookingUpdate::Reported {
                    request: key.request.clone(),
                    leg: key.leg,
                    event: Lifecycle::FirstToken,
                });
            }
        }
        out
    }

    /// Books this replica's decision (and keeps it for the others, while sharing).
    pub(super) fn book(&mut self, request: &str, leg: Leg, booking: &Booking<&[SequenceHash]>, now: f64) {
        let chain = self.load.book(&BookingKey::local(request, leg), booking, now);
        self.share(|| BookingUpdate::Booked { request: request.into(), leg, booking: booking.with_chain(chain) });
    }

    /// Applies a lifecycle report to this replica's booking (and shares it).
    pub(super) fn report_leg(
        &mut self,
        request: &str,
        leg: Leg,
        event: Lifecycle,
        now: f64,
    ) -> Result<PodId, UnknownRequest> {
        let pod = self.load.report(&BookingKey::local(request, leg), event, now)?;
        self.share(|| BookingUpdate::Reported { request: request.into(), leg, event });
        Ok(pod)
    }

    /// Keeps a change of this replica's bookings for the others (while sharing).
    pub(super) fn share(&mut self, update: impl FnOnce() -> BookingUpdate) {
        if let Some(shared) = &mut self.shared {
            shared.push(update());
        }
    }
}
