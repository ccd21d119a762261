//! LoRA adapters as routing state: which adapters each pod has on its GPU and how many it
//! may hold at once, so a request for an adapter is charged what it waits for on each pod.
//!
//! vLLM serves adapters as `model` names and keeps at most `max_loras` of them in one batch:
//! a waiting request of another adapter is passed over until every request of some
//! running adapter has finished (`v1/core/sched/scheduler.py`), and an adapter not among
//! those recently run is loaded onto the GPU first. A pod reports its running and waiting
//! adapters and `max_lora` in `vllm:lora_requests_info`; kvgate adds the adapters of the
//! requests it has in flight there (no scrape lag) and remembers which adapters each pod ran
//! last. For one request's adapter each pod is then [`AdapterFit`]: running it already,
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

/// How a pod stands for a request's adapter.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum AdapterFit {
    /// No adapter asked for, or the pod reports no adapter slots: nothing to charge.
    #[default]
    Unlimited,
    /// The adapter runs there now: the request joins its batch.
    Running,
    /// A slot is free; `load`: the adapter is not among those the pod ran last and is
    /// loaded onto the GPU first.
    Free { load: bool },
    /// Every slot holds another adapter: the request waits about `wait_seconds` for the
    /// soonest of them to drain (then loads, with `load`).
    Full { load: bool, wait_seconds: f64 },
}

/// One pod's adapters as the router believes them.
#[derive(Clone, Debug, Default)]
pub(crate) struct PodAdapters {
    reported: Option<ReportedAdapters>,
    /// The adapters most recently run or routed there, the latest last (at most
    /// `max_loras`): those on its GPU.
    resident: SmallVec<[AdapterId; 4]>,
}

impl PodAdapters {
    /// A scrape's `vllm:lora_requests_info`: its running adapters are on the GPU.
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
    }

    fn touch(&mut self, adapter: AdapterId, max_loras: u32) {
        self.resident.retain(|a| *a != adapter);
        self.resident.push(adapter);
        if max_loras > 0 && self.resident.len() > max_loras as usize {
            self.resident.remove(0);
        }
    }

    /// How the pod stands for `adapter`, given the adapters of the requests booked there
    /// and the seconds until each has drained (`in_flight`), and `unknown_wait` for an
    /// adapter the pod reports running that no booking explains (another replica's).
    pub fn fit(&self, adapter: AdapterId, in_flight: &[(AdapterId, f64)], unknown_wait: f64) -> AdapterFit {
        let Some(reported) = self.reported.as_ref().filter(|r| r.max_loras > 0) else {
            return AdapterFit::Unlimited;
        };
        let mut running: SmallVec<[(AdapterId, f64); 8]> = SmallVec::from_slice(in_flight);
        for &a in &reported.running {
            if !running.iter().any(|(r, _)| *r == a) {
                running.push((a, unknown_wait));
            }
        }
        if running.iter().any(|(a, _)| *a == adapter) {
            return AdapterFit::Running;
        }
        let load = !self.resident.contains(&adapter);
        // Adapters waiting there take the slots that free up before this one does.
        let ahead = reported.waiting.iter().filter(|&&a| a != adapter && !running.iter().any(|(r, _)| *r == a)).count();
        let taken = running.len() + ahead;
        if taken < reported.max_loras as usize {
            return AdapterFit::Free { load };
        }
        running.sort_by(|a, b| a.1.total_cmp(&b.1));
        let wait_seconds = running.get(ahead.min(running.len().saturating_sub(1))).map_or(unknown_wait, |r| r.1);
        AdapterFit::Full { load, wait_seconds }
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
        p.reported(ReportedAdapters {
            running: running.iter().map(|n| id(n)).collect(),
            waiting: waiting.iter().map(|n| id(n)).collect(),
            max_loras,
        });
        p
    }

    #[test]
    fn a_pod_runs_an_adapter_has_a_slot_for_it_or_makes_it_wait_for_the_soonest_to_drain() {
        let two = pod(&["sql"], &[], 2);
        assert_eq!(two.fit(id("sql"), &[], 9.0), AdapterFit::Running);
        assert_eq!(two.fit(id("law"), &[], 9.0), AdapterFit::Free { load: true });
        // Booked here: law now runs too, so the slots are full for a third adapter, which
        // waits for the booking that drains first (sql, unexplained by bookings: 9 s).
        let booked = [(id("law"), 2.5)];
        assert_eq!(two.fit(id("law"), &booked, 9.0), AdapterFit::Running);
        assert_eq!(two.fit(id("med"), &booked, 9.0), AdapterFit::Full { load: true, wait_seconds: 2.5 });
        assert_eq!(two.fit(id("med"), &[(id("law"), 12.0)], 9.0), AdapterFit::Full { load: true, wait_seconds: 9.0 });
        // An adapter waiting there takes the first slot to free: a newcomer waits for the second.
        let queued = pod(&["sql", "law"], &["med"], 2);
        let both = [(id("sql"), 1.0), (id("law"), 4.0)];
        assert_eq!(queued.fit(id("art"), &both, 9.0), AdapterFit::Full { load: true, wait_seconds: 4.0 });
        assert_eq!(queued.fit(id("med"), &both, 9.0), AdapterFit::Full { load: true, wait_seconds: 1.0 });
        // No adapter slots reported: nothing is known to limit it.
        assert_eq!(PodAdapters::default().fit(id("sql"), &booked, 9.0), AdapterFit::Unlimited);
        assert_eq!(pod(&[], &[], 0).fit(id("sql"), &[], 9.0), AdapterFit::Unlimited);
    }

    #[test]
    fn the_adapters_run_last_stay_loaded() {
        let mut p = pod(&[], &[], 2);
        p.routed(id("sql"));
        p.routed(id("law"));
        // Both drained: slots free, and neither needs loading; a third does.
        assert_eq!(p.fit(id("sql"), &[], 9.0), AdapterFit::Free { load: false });
        assert_eq!(p.fit(id("med"), &[], 9.0), AdapterFit::Free { load: true });
        p.routed(id("med"));
        assert_eq!(p.fit(id("sql"), &[], 9.0), AdapterFit::Free { load: true }, "the least recent left the GPU");
        assert_eq!(p.fit(id("law"), &[], 9.0), AdapterFit::Free { load: false });
    }
}
