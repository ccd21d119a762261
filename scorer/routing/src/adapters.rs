//! LoRA adapters as routing state: which adapters each pod has on its GPU and how many it
//! may hold at once, so a request for an adapter is charged what it waits for on each pod.
//!
//! vLLM serves adapters as `model` names and keeps at most `max_loras` of them in one batch:
//! a waiting request of another adapter is passed over until every request of some
//! running adapter has finished (`v1/core/sched/scheduler.py`), and an adapter not among
//! those recently run is loaded onto the GPU first. A pod reports its adapters and
//! `max_lora` in `vllm:lora_requests_info` (vLLM 0.32 names every adapter with a request
//! there in both its running and its waiting list); kvgate adds the adapters of the requests
//! it has in flight there (no scrape lag; one with a first token runs) and remembers which
//! adapters each pod ran last. For one request's adapter each pod is then [`AdapterFit`]: running it already,
//! with a free slot (maybe after a load), or full of other adapters — waiting until the
//! soonest of them drains.

use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_64;

/// An adapter, by its name's hash (the same on every gateway replica).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterId(pub u64);

impl AdapterId {
    pub fn of(name: &str) -> Self {
        Self(xxh3_64(name.as_bytes()))
    }
}

/// What a pod reported of its adapters (`vllm:lora_requests_info`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReportedAdapters {
    pub running: Vec<AdapterId>,
    pub waiting: Vec<AdapterId>,
    /// Adapters one batch holds (`--max-loras`).
    pub max_loras: u32,
}

impl ReportedAdapters {
    /// From the adapter names the metric lists.
    pub fn named<S: AsRef<str>>(running: &[S], waiting: &[S], max_loras: u32) -> Self {
        let ids = |names: &[S]| names.iter().map(|n| AdapterId::of(n.as_ref())).collect();
        Self { running: ids(running), waiting: ids(waiting), max_loras }
    }
}

/// The requests of one adapter in flight on a pod.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdapterLoad {
    pub adapter: AdapterId,
    /// When the first of them was booked.
    pub since: f64,
    /// Seconds until the last of them is predicted to finish.
    pub drain_seconds: f64,
    pub requests: u32,
    /// One of them has its first token: the engine runs the adapter, which keeps its slot
    /// while its requests last.
    pub decoding: bool,
}

impl AdapterLoad {
    /// Seconds until its slot frees: its requests there drain, unless more arrive first —
    /// and an adapter with `n` requests in flight is one whose requests keep coming (an
    /// M/G/∞ stream of `n` at once leaves a gap only after about `eⁿ⁻¹` of their times; on
    /// the cluster simulator's `adapters` workload, goodput 36.7 → 37.6 req/s at 8 pods).
    pub fn slot_seconds(&self) -> f64 {
        self.drain_seconds * f64::from(self.requests.clamp(1, 8) - 1).exp()
    }
}

/// How a pod stands for a request's adapter.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum AdapterFit {
    /// No adapter asked for, or the pod reports no adapter slots: nothing to charge.
    #[default]
    Unlimited,
    /// The adapter holds a slot there: the request joins its batch.
    Running,
    /// A slot is free; `load`: the adapter is not among those the pod ran last and is
    /// loaded onto the GPU first.
    Free { load: bool },
    /// Every slot holds another adapter: the request waits about `wait_seconds` for a slot
    /// to drain — the adapters waiting there before it take the first (then it loads, with
    /// `load`); `joins`: requests of its adapter already wait there, and it runs with them.
    Full { load: bool, wait_seconds: f64, joins: bool },
}

/// A pod's adapter slots and the requests booked there that wait for one (their adapter
/// holds none): what taking a slot for a long time delays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotQueue {
    /// Adapters one batch holds (`--max-loras`; 0: no adapter slots reported).
    pub slots: u32,
    pub waiting_requests: u32,
}

/// One pod's adapters as the router believes them.
#[derive(Clone, Debug, Default)]
pub(crate) struct PodAdapters {
    reported: Option<ReportedAdapters>,
    /// The adapters most recently run or routed there, the latest last (at most
    /// `max_loras`): those on its GPU.
    resident: SmallVec<[AdapterId; 4]>,
    /// The adapters last routed there (at most [`ROUTED_MEMORY`]): when one of them is
    /// reported running with none of its bookings left, the report predates their end.
    routed: SmallVec<[AdapterId; 8]>,
}

/// Adapters remembered as routed to a pod.
const ROUTED_MEMORY: usize = 64;

impl PodAdapters {
    /// A scrape's `vllm:lora_requests_info`: its running adapters are on the GPU, or loaded
    /// for their waiting requests next (vLLM 0.32 lists waiting adapters as running too).
    pub fn reported(&mut self, reported: ReportedAdapters) {
        for &a in &reported.running {
            self.touch(a, reported.max_loras);
        }
        self.reported = Some(reported);
    }

    /// A request for `adapter` was routed here: it is run (and loaded) here next.
    pub fn routed(&mut self, adapter: AdapterId) {
        let max = self.reported.as_ref().map_or(0, |r| r.max_loras);
        self.touch(adapter, max);
        self.routed.retain(|a| *a != adapter);
        self.routed.push(adapter);
        if self.routed.len() > ROUTED_MEMORY {
            self.routed.remove(0);
        }
    }

    fn touch(&mut self, adapter: AdapterId, max_loras: u32) {
        self.resident.retain(|a| *a != adapter);
        self.resident.push(adapter);
        if max_loras > 0 && self.resident.len() > max_loras as usize {
            self.resident.remove(0);
        }
    }

    /// How the pod stands for a request of `adapter`, given the adapters of the requests
    /// booked there (`in_flight`), and `unknown_seconds` for how long an adapter the pod
    /// reports holds its slot when no booking explains it (routed by someone else; one this
    /// router routed there and has no booking of has drained since the report). The engine
    /// keeps a running adapter's slot while its requests last, and gives a freed one in
    /// order of arrival: after the unexplained adapters, the booked ones with a request past
    /// its first token (running), then the others by their first booking, fill the slots;
    /// the rest wait (the pod's [`SlotQueue`], returned beside).
    pub fn fit(&self, adapter: AdapterId, in_flight: &[AdapterLoad], unknown_seconds: f64) -> (AdapterFit, SlotQueue) {
        let Some(reported) = self.reported.as_ref().filter(|r| r.max_loras > 0) else {
            return (AdapterFit::Unlimited, SlotQueue::default());
        };
        let slots = reported.max_loras as usize;
        let mut order: SmallVec<[AdapterLoad; 8]> = SmallVec::new();
        for &a in reported.running.iter().chain(&reported.waiting) {
            // Each once: vLLM 0.32 names an adapter in both lists.
            let listed = order.iter().any(|l| l.adapter == a);
            if !listed && !in_flight.iter().any(|l| l.adapter == a) && !self.routed.contains(&a) {
                order.push(AdapterLoad {
                    adapter: a,
                    since: f64::NEG_INFINITY,
                    drain_seconds: unknown_seconds,
                    requests: 1,
                    decoding: false,
                });
            }
        }
        // Unexplained running adapters first, then unexplained waiting ones, then the booked
        // ones decoding (judged by their oldest booking, an adapter whose requests keep
        // coming would lose its slot to one waiting longer), then by arrival. Not the
        // report's running adapters: vLLM 0.32 lists every adapter with a request in both of
        // `vllm:lora_requests_info`'s lists, waiting or running.
        let unexplained = order.len();
        order.extend_from_slice(in_flight);
        order[unexplained..].sort_by(|a, b| b.decoding.cmp(&a.decoding).then(a.since.total_cmp(&b.since)));
        let (running, queued) = order.split_at(order.len().min(slots));
        let queue = SlotQueue { slots: reported.max_loras, waiting_requests: queued.iter().map(|l| l.requests).sum() };
        if running.iter().any(|l| l.adapter == adapter) {
            return (AdapterFit::Running, queue);
        }
        let load = !self.resident.contains(&adapter);
        let waiting_at = queued.iter().position(|l| l.adapter == adapter);
        let ahead = waiting_at.unwrap_or(queued.len());
        if running.len() + ahead < slots {
            return (AdapterFit::Free { load }, queue);
        }
        // Slots free up as the running adapters drain, soonest first; those ahead take the
        // first.
        let mut drains: SmallVec<[f64; 8]> = running.iter().map(AdapterLoad::slot_seconds).collect();
        drains.sort_by(f64::total_cmp);
        let wait_seconds = drains.get(ahead.min(drains.len().saturating_sub(1))).copied().unwrap_or(unknown_seconds);
        (AdapterFit::Full { load, wait_seconds, joins: waiting_at.is_some() }, queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> AdapterId {
        AdapterId::of(name)
    }

    fn pod(running: &[&str], waiting: &[&str], max_loras: u32) -> PodAdapters {
        let mut p = PodAdapters::default();
        p.reported(ReportedAdapters::named(running, waiting, max_loras));
        p
    }

    /// `requests` of `name` booked at `since`, the last done in `drain_seconds`.
    fn booked(name: &str, since: f64, drain_seconds: f64, requests: u32) -> AdapterLoad {
        AdapterLoad { adapter: id(name), since, drain_seconds, requests, decoding: false }
    }

    #[test]
    fn a_pod_runs_an_adapter_has_a_slot_for_it_or_makes_it_wait_for_the_soonest_to_drain() {
        let two = pod(&["sql"], &[], 2);
        assert_eq!(two.fit(id("sql"), &[], 9.0).0, AdapterFit::Running);
        assert_eq!(two.fit(id("law"), &[], 9.0).0, AdapterFit::Free { load: true });
        // Booked here: law runs too, so the slots are full for a third adapter, which waits
        // for the first to drain (sql, unexplained by bookings: 9 s).
        let law = [booked("law", 0.0, 2.5, 1)];
        assert_eq!(two.fit(id("law"), &law, 9.0).0, AdapterFit::Running);
        assert_eq!(two.fit(id("med"), &law, 9.0).0, AdapterFit::Full { load: true, wait_seconds: 2.5, joins: false });
        let long_law = [booked("law", 0.0, 12.0, 1)];
        assert_eq!(
            two.fit(id("med"), &long_law, 9.0).0,
            AdapterFit::Full { load: true, wait_seconds: 9.0, joins: false }
        );
        // No adapter slots reported: nothing is known to limit it.
        assert_eq!(PodAdapters::default().fit(id("sql"), &law, 9.0).0, AdapterFit::Unlimited);
        assert_eq!(pod(&[], &[], 0).fit(id("sql"), &[], 9.0).0, AdapterFit::Unlimited);
    }

    #[test]
    fn slots_go_in_order_of_arrival_and_later_comers_wait_behind_those_waiting() {
        let empty = pod(&[], &[], 2);
        // sql and law came first and hold the slots; med (3 requests) waits behind them.
        let booked = [booked("med", 2.0, 5.0, 3), booked("sql", 0.0, 1.0, 1), booked("law", 1.0, 4.0, 2)];
        assert_eq!(
            empty.fit(id("med"), &booked, 9.0),
            (
                AdapterFit::Full { load: true, wait_seconds: 1.0, joins: true },
                SlotQueue { slots: 2, waiting_requests: 3 }
            )
        );
        // A newcomer waits for the second slot: law's, whose two requests say a stream of them.
        let law_frees = 4.0 * 1f64.exp();
        assert_eq!(
            empty.fit(id("art"), &booked, 9.0).0,
            AdapterFit::Full { load: true, wait_seconds: law_frees, joins: false }
        );
        assert_eq!(empty.fit(id("sql"), &booked, 9.0).0, AdapterFit::Running);
        // An adapter the pod reports running that no booking explains came before them all…
        let mut reported = pod(&["art"], &[], 2);
        assert_eq!(
            reported.fit(id("law"), &booked, 9.0).0,
            AdapterFit::Full { load: true, wait_seconds: 1.0, joins: true }
        );
        // Named in both lists, as vLLM 0.32 names it, it still holds one slot.
        assert_eq!(
            pod(&["art"], &["art"], 2).fit(id("law"), &booked, 9.0).0,
            AdapterFit::Full { load: true, wait_seconds: 1.0, joins: true }
        );
        // …unless this router sent it there: then it has drained since the report.
        reported.routed(id("art"));
        assert_eq!(reported.fit(id("law"), &booked, 9.0).0, AdapterFit::Running);
    }

    #[test]
    fn a_running_adapter_keeps_its_slot_from_adapters_waiting_longer_than_its_oldest_request() {
        // sql decodes; its requests keep coming, so its oldest one in flight is recent. law
        // and med have waited since before it: vLLM does not take sql's slot. The report
        // tells them apart no more than vLLM 0.32's does (every adapter in both lists).
        let all = ["sql", "law", "med"];
        let mut p = pod(&all, &all, 2);
        for a in all {
            p.routed(id(a));
        }
        let sql = AdapterLoad { decoding: true, ..booked("sql", 5.0, 1.5, 2) };
        let booked = [booked("law", 0.0, 2.0, 1), booked("med", 1.0, 3.0, 1), sql];
        assert_eq!(p.fit(id("sql"), &booked, 9.0).0, AdapterFit::Running);
        assert_eq!(p.fit(id("law"), &booked, 9.0).0, AdapterFit::Running, "the first waiting takes the free slot");
        let law_frees = 2.0;
        assert_eq!(
            p.fit(id("med"), &booked, 9.0).0,
            AdapterFit::Full { load: false, wait_seconds: law_frees, joins: true }
        );
        // Once its requests are done, sql holds nothing.
        assert_eq!(p.fit(id("med"), &booked[..2], 9.0).0, AdapterFit::Running);
    }

    #[test]
    fn the_adapters_run_last_stay_loaded() {
        let mut p = pod(&[], &[], 2);
        p.routed(id("sql"));
        p.routed(id("law"));
        // Both drained: slots free, and neither needs loading; a third does.
        assert_eq!(p.fit(id("sql"), &[], 9.0).0, AdapterFit::Free { load: false });
        assert_eq!(p.fit(id("med"), &[], 9.0).0, AdapterFit::Free { load: true });
        p.routed(id("med"));
        assert_eq!(p.fit(id("sql"), &[], 9.0).0, AdapterFit::Free { load: true }, "the least recent left the GPU");
        assert_eq!(p.fit(id("law"), &[], 9.0).0, AdapterFit::Free { load: false });
    }
}
