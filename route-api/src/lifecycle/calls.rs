//! A proxy's route calls in flight on one stream (or socket) to the scorer.

use std::collections::HashMap;
use std::hash::Hash;

/// Route calls sent on one stream or socket and not answered yet, by call id, each with the
/// request waiting on it (`W`) and when it was sent (`T`: the host's clock).
///
/// One rule for every proxy host: a call unanswered past the timeout fails; and if the
/// stream has answered nothing since that call was sent, the stream is stuck (a scorer that
/// accepts and never answers, a connection the network black-holed) and the host replaces
/// it — kept, it would cost every later request the whole timeout.
#[derive(Debug)]
pub struct CallsInFlight<K, W, T> {
    waiting: HashMap<K, (W, T)>,
    /// When the stream last answered anything (a call's answer or a notice).
    last_answer: Option<T>,
}

/// The calls [`CallsInFlight::expire`] took out, to fail; and whether the stream is stuck.
#[derive(Debug)]
pub struct Expired<K, W> {
    pub calls: Vec<(K, W)>,
    /// Nothing came back on the stream since one of these calls was sent: replace it (and
    /// fail every call still on it, [`CallsInFlight::reset`]).
    pub stuck: bool,
}

impl<K: Eq + Hash, W, T: Ord + Copy> Default for CallsInFlight<K, W, T> {
    fn default() -> Self {
        Self { waiting: HashMap::new(), last_answer: None }
    }
}

impl<K: Eq + Hash, W, T: Ord + Copy> CallsInFlight<K, W, T> {
    /// Call `id` went out at `at`; `waiter` hears its outcome.
    pub fn sent(&mut self, id: K, waiter: W, at: T) {
        self.waiting.insert(id, (waiter, at));
    }

    /// The stream answered call `id` at `at` (a notice answers no call): the call's waiter
    /// and when it was sent, unless it has failed already or its request left.
    pub fn answered(&mut self, id: &K, at: T) -> Option<(W, T)> {
        self.last_answer = Some(self.last_answer.map_or(at, |last| last.max(at)));
        self.waiting.remove(id)
    }

    /// The request left: nobody waits on call `id` any more.
    pub fn forget(&mut self, id: &K) -> Option<W> {
        self.waiting.remove(id).map(|(waiter, _)| waiter)
    }

    /// Takes out the calls sent at or before `sent_by` (now less the timeout), to fail.
    pub fn expire(&mut self, sent_by: T) -> Expired<K, W> {
        if !self.waiting.values().any(|(_, sent)| *sent <= sent_by) {
            return Expired { calls: Vec::new(), stuck: false };
        }
        let last_answer = self.last_answer;
        let mut stuck = false;
        let calls = self
            .waiting
            .extract_if(|_, (_, sent)| *sent <= sent_by)
            .map(|(id, (waiter, sent))| {
                stuck |= last_answer.is_none_or(|last| last < sent);
                (id, waiter)
            })
            .collect();
        Expired { calls, stuck }
    }

    /// The stream is gone (closed, or replaced as stuck): every call on it, to fail. What is
    /// sent next goes on a new stream, which has answered nothing yet.
    pub fn reset(&mut self) -> Vec<(K, W)> {
        self.last_answer = None;
        self.waiting.drain().map(|(id, (waiter, _))| (id, waiter)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Times in ms on a clock of the test's own; the timeout is 100.
    type Calls = CallsInFlight<u32, &'static str, u64>;

    fn ids<W>(mut calls: Vec<(u32, W)>) -> Vec<u32> {
        calls.sort_by_key(|(id, _)| *id);
        calls.into_iter().map(|(id, _)| id).collect()
    }

    #[test]
    fn an_answered_call_goes_to_its_waiter_once() {
        let mut calls = Calls::default();
        calls.sent(1, "a", 0);
        calls.sent(2, "b", 5);
        assert_eq!(calls.answered(&2, 30), Some(("b", 5)));
        assert_eq!(calls.answered(&2, 31), None, "answered twice");
        assert_eq!(calls.waiting.len(), 1);
        assert_eq!(calls.forget(&1), Some("a"));
        assert!(calls.waiting.is_empty());
    }

    #[test]
    fn a_late_call_fails_and_a_stream_that_answered_since_is_kept() {
        let mut calls = Calls::default();
        calls.sent(1, "slow", 1000);
        calls.sent(2, "quick", 1010);
        calls.sent(3, "young", 1090);
        assert_eq!(calls.answered(&2, 1020), Some(("quick", 1010)));
        let none = calls.expire(1099 - 100);
        assert!(none.calls.is_empty() && !none.stuck, "at 1099 nothing has waited 100 ms");
        // At 1105 call 1 is past the timeout; the stream answered at 1020, after it went out.
        let expired = calls.expire(1105 - 100);
        assert_eq!(ids(expired.calls), vec![1]);
        assert!(!expired.stuck, "the stream answered after the call went out");
        assert_eq!(calls.waiting.len(), 1, "call 3 still has time");
    }

    #[test]
    fn a_stream_that_answers_nothing_is_stuck() {
        let mut calls = Calls::default();
        calls.sent(1, "a", 0);
        calls.sent(2, "b", 50);
        let expired = calls.expire(120 - 100);
        assert_eq!(ids(expired.calls), vec![1]);
        assert!(expired.stuck, "a new stream that never answered");
        // The host replaces it: call 2 fails too, and the next stream starts afresh.
        assert_eq!(ids(calls.reset()), vec![2]);
        assert!(calls.waiting.is_empty());
    }

    #[test]
    fn a_stream_silent_since_a_call_went_out_is_stuck_though_it_answered_before() {
        let mut calls = Calls::default();
        calls.sent(1, "a", 0);
        assert!(calls.answered(&1, 5).is_some());
        // A notice (no call) at 40 still counts as an answer.
        assert!(calls.answered(&0, 40).is_none());
        calls.sent(2, "b", 30);
        calls.sent(3, "c", 60);
        let first = calls.expire(135 - 100);
        assert_eq!(ids(first.calls), vec![2]);
        assert!(!first.stuck, "heard at 40, after call 2 went out at 30");
        let second = calls.expire(165 - 100);
        assert_eq!(ids(second.calls), vec![3]);
        assert!(second.stuck, "nothing heard since 60");
    }

    #[test]
    fn a_reset_stream_has_answered_nothing() {
        let mut calls = Calls::default();
        assert!(calls.answered(&0, 10).is_none());
        assert!(calls.reset().is_empty());
        calls.sent(1, "a", 20);
        assert!(calls.expire(130 - 100).stuck, "what the old stream said does not vouch for the new one");
    }
}
