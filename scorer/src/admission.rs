//! The admission queue: where requests wait while every eligible pod is saturated, instead
//! of piling onto engines that cannot start them (a pod's own queue is first come, first
//! served and knows nothing of priorities).
//!
//! Waiters are ordered by priority, then arrival. When room may have appeared — a request
//! reached its first token or ended, a pod reported its load, a pod came back — the first
//! waiter is woken and tries again; if it gets a pod, it wakes the next (there may be room
//! for several), and if not, it waits again in its place. A newcomer waits behind anyone of
//! its priority or above, so it cannot take the room they wait for. The queue is bounded: a
//! newcomer beyond it takes the place of the last waiter if that one's priority is lower,
//! else it is refused.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tokio::sync::{oneshot, watch};

/// A waiter's place: higher priority first, then earlier arrival.
type Place = (Reverse<i32>, u64);

/// Why a request gives up its place (or never gets one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The queue was full of requests of at least its priority, or a request of higher
    /// priority took its place.
    QueueFull,
}

/// Requests waiting for room, by place.
pub struct Queue {
    limit: NonZeroUsize,
    waiters: Mutex<BTreeMap<Place, oneshot::Sender<()>>>,
    arrivals: AtomicU64,
    /// Requests that have waited and are not decided yet: those in `waiters`, and those
    /// woken and trying again (out of `waiters` meanwhile).
    held: AtomicUsize,
    /// Whether `held` is above zero, for those who act on it (the route connections tell
    /// their proxies).
    queuing: watch::Sender<bool>,
}

/// A request's stay in the queue, from its first wait to its decision (or refusal); shown
/// by the gauge it was given.
pub struct Held<'a> {
    queue: &'a Queue,
    /// The count of its priority's waiters.
    gauge: prometheus::Gauge,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _order = self.queue.lock(); // `queuing` follows `held` in order
        let held = self.queue.held.fetch_sub(1, Ordering::Relaxed) - 1;
        if held == 0 {
            self.queue.queuing.send_replace(false);
        }
        self.gauge.dec();
    }
}

/// One request's place in the queue, kept across its tries so it never loses its turn.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    place: Place,
}

impl Queue {
    /// A queue holding at most `limit` waiters (at least one: a full queue always has a last
    /// waiter for a newcomer to displace).
    pub fn new(limit: NonZeroUsize) -> Self {
        Self {
            limit,
            waiters: Mutex::new(BTreeMap::new()),
            arrivals: AtomicU64::new(0),
            held: AtomicUsize::new(0),
            queuing: watch::Sender::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Place, oneshot::Sender<()>>> {
        self.waiters.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A ticket for a request of `priority` arriving now.
    pub fn ticket(&self, priority: i32) -> Ticket {
        Ticket { place: (Reverse(priority), self.arrivals.fetch_add(1, Ordering::Relaxed)) }
    }

    /// Whether someone of at least `priority` is waiting (a newcomer goes behind them).
    pub fn ahead_of(&self, priority: i32) -> bool {
        self.lock().keys().next().is_some_and(|(Reverse(p), _)| *p >= priority)
    }

    /// Whether nobody is in place.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Counts a request that has started waiting, until the guard drops; `gauge` shows the
    /// count.
    pub fn hold(&self, gauge: prometheus::Gauge) -> Held<'_> {
        let _order = self.lock(); // `queuing` follows `held` in order
        let held = self.held.fetch_add(1, Ordering::Relaxed) + 1;
        if held == 1 {
            self.queuing.send_replace(true);
        }
        gauge.inc();
        Held { queue: self, gauge }
    }

    /// Changes whenever requests start waiting (`true`) or none waits any more (`false`).
    pub fn queuing(&self) -> watch::Receiver<bool> {
        self.queuing.subscribe()
    }

    /// Requests waiting for room, whether in their place or woken and trying again.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Waits in the ticket's place; the receiver resolves when woken (`Ok`) or when a
    /// request of higher priority took the place (`Err`).
    pub fn wait(&self, ticket: Ticket) -> Result<oneshot::Receiver<()>, Refused> {
        let mut waiters = self.lock();
        if waiters.len() >= self.limit.get() && !waiters.contains_key(&ticket.place) {
            let last = *waiters.keys().next_back().expect("a full queue has a last waiter");
            if last <= ticket.place {
                return Err(Refused::QueueFull);
            }
            waiters.remove(&last); // dropping its sender tells it
        }
        let (tx, rx) = oneshot::channel();
        waiters.insert(ticket.place, tx);
        Ok(rx)
    }

    /// Gives up a place (the wait ran out).
    pub fn leave(&self, ticket: Ticket) {
        self.lock().remove(&ticket.place);
    }

    /// Room may have appeared: the first waiter tries again.
    pub fn wake_first(&self) {
        let mut waiters = self.lock();
        while let Some((_, tx)) = waiters.pop_first() {
            if tx.send(()).is_ok() {
                return; // else its request is gone (client left): the next one
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_priority_first_then_arrival_and_a_full_queue_keeps_the_most_important() {
        let q = Queue::new(NonZeroUsize::new(3).unwrap());
        let (low, normal1, normal2) = (q.ticket(-1), q.ticket(0), q.ticket(0));
        let mut low_rx = q.wait(low).unwrap();
        let mut n1 = q.wait(normal1).unwrap();
        let mut n2 = q.wait(normal2).unwrap();
        assert!(q.ahead_of(0) && !q.ahead_of(1));
        // Full: a high-priority newcomer takes the sheddable one's place; another normal
        // one is refused (everyone waiting is at least as important and came first).
        let high = q.ticket(5);
        let mut high_rx = q.wait(high).unwrap();
        assert!(low_rx.try_recv().is_err(), "its place was taken");
        assert_eq!(q.wait(q.ticket(0)).unwrap_err(), Refused::QueueFull);
        q.wake_first();
        assert!(high_rx.try_recv().is_ok(), "the most important first");
        q.wake_first();
        assert!(n1.try_recv().is_ok() && n2.try_recv().is_err(), "then first come first served");
        q.leave(normal2);
        q.wake_first();
        assert!(n2.try_recv().is_err() && q.is_empty());
    }

    #[test]
    fn held_counts_from_the_first_wait_to_the_decision_and_queuing_follows_it() {
        let q = Queue::new(NonZeroUsize::new(8).unwrap());
        let gauge = prometheus::Gauge::new("waiting", "waiting").unwrap();
        let mut queuing = q.queuing();
        let first = q.hold(gauge.clone());
        assert!(queuing.has_changed().unwrap() && *queuing.borrow_and_update());
        let second = q.hold(gauge.clone());
        assert_eq!((q.held(), gauge.get()), (2, 2.0));
        assert!(!queuing.has_changed().unwrap(), "told once, when the first one waits");
        drop(first);
        assert_eq!(q.held(), 1);
        assert!(!queuing.has_changed().unwrap());
        drop(second);
        assert_eq!((q.held(), gauge.get()), (0, 0.0));
        assert!(queuing.has_changed().unwrap() && !*queuing.borrow_and_update());
    }

    #[test]
    fn a_waiter_whose_request_is_gone_passes_the_turn() {
        let q = Queue::new(NonZeroUsize::new(8).unwrap());
        let (a, b) = (q.ticket(0), q.ticket(0));
        drop(q.wait(a).unwrap());
        let mut b_rx = q.wait(b).unwrap();
        q.wake_first();
        assert!(b_rx.try_recv().is_ok());
    }
}
