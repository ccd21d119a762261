//! A proxy's lifecycle reports on their way to the scorer.

use crate::{LifecycleReport, RouteAnswer, StreamReport};
use std::time::SystemTime;

/// Reports waiting to go, with when each happened. They ride on the next route call, or go
/// alone when [`ReportQueue::due`] says so (enough of them, or the scorer has requests
/// waiting for the room they free) or at the host's flush period; each goes with its age, so
/// the scorer dates the event where it happened.
#[derive(Debug)]
pub struct ReportQueue {
    waiting: Vec<(LifecycleReport, SystemTime)>,
    batch_max: usize,
    /// The scorer's last answer (or notice) said requests wait in its admission queue:
    /// reports go at once (each frees room someone waits for), not at the next flush.
    at_once: bool,
}

impl ReportQueue {
    pub fn new(batch_max: usize) -> Self {
        Self { waiting: Vec::new(), batch_max, at_once: false }
    }

    /// Queues a report of an event at `at`; true if the reports should go now.
    pub fn push(&mut self, report: LifecycleReport, at: SystemTime) -> bool {
        self.waiting.push((report, at));
        self.due()
    }

    /// Whether the waiting reports should go now rather than at the next flush.
    pub fn due(&self) -> bool {
        !self.waiting.is_empty() && (self.waiting.len() >= self.batch_max || self.at_once)
    }

    /// The scorer answered (or sent a notice): while it says requests wait for admission,
    /// reports go at once.
    pub fn heard(&mut self, answer: &RouteAnswer) {
        self.at_once = answer.admission_waiting > 0;
    }

    /// The waiting reports, each stamped with its age at `sent` (a clock gone backwards
    /// counts as no wait); `sent` is read only when some wait (most route calls take none).
    pub fn take(&mut self, sent: impl FnOnce() -> SystemTime) -> Vec<LifecycleReport> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        let sent = sent();
        let aged = |(report, at): (LifecycleReport, SystemTime)| {
            let age = sent.duration_since(at).unwrap_or_default().as_micros();
            LifecycleReport { age_us: Some(u32::try_from(age).unwrap_or(u32::MAX)), ..report }
        };
        self.waiting.drain(..).map(aged).collect()
    }

    /// [`ReportQueue::take`], as the route protocol carries them.
    pub fn take_for_call(&mut self, sent: impl FnOnce() -> SystemTime) -> Vec<StreamReport> {
        self.take(sent).into_iter().map(StreamReport::from).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LifecycleEvent;
    use std::time::Duration;

    fn report(id: &str) -> LifecycleReport {
        LifecycleReport::new(id, LifecycleEvent::Done)
    }

    #[test]
    fn reports_are_batched_and_stamped_with_their_age() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let mut q = ReportQueue::new(3);
        assert!(!q.push(report("a"), at) && !q.push(report("b"), at + Duration::from_secs(20_000)));
        assert!(q.push(report("c"), at), "the batch is full");
        let sent = at + Duration::from_micros(1500);
        let ages: Vec<_> = q.take(|| sent).into_iter().map(|r| r.age_us).collect();
        assert_eq!(ages, [Some(1500), Some(0), Some(1500)], "a clock gone backwards counts as no wait");
        assert!(q.take(|| sent).is_empty() && !q.due());
        let much_later = at + Duration::from_secs(10_000);
        q.push(report("d"), at);
        assert_eq!(q.take_for_call(|| much_later)[0].age_us, Some(u32::MAX));
    }

    #[test]
    fn reports_go_at_once_while_requests_wait_for_admission() {
        let mut q = ReportQueue::new(100);
        let now = SystemTime::now();
        q.heard(&RouteAnswer { admission_waiting: 2, ..Default::default() });
        assert!(q.push(report("a"), now));
        q.take(|| now);
        assert!(!q.due(), "nothing waits");
        q.heard(&RouteAnswer { admission_waiting: 0, ..Default::default() });
        assert!(!q.push(report("b"), now));
    }
}
