//! Pod health: what scrapes and event streams say of each pod — its load, its engine's
//! identity, its event batches — and pods going down and coming back.

use super::{BlockSizeFrom, Core, Scorer};
use crate::engine_pages::PodAdapters;
use kvgate_routing::adapters::ReportedAdapters;
use kvgate_routing::events::{EventBatch, KvEvent};
use kvgate_routing::pod_set::PodId;
use kvgate_routing::policy::ReportedLoad;
use std::sync::atomic::Ordering;

/// What one scrape of a pod's `/metrics` found.
#[derive(Clone, Debug)]
pub enum Scrape {
    /// Its load, its engine's identity when the page has one (`process_start_time_seconds`:
    /// a restart changes it), and the LoRA adapters it runs, when it serves some.
    Answered { load: ReportedLoad, started_at: Option<f64>, adapters: Option<PodAdapters>, block_size: Option<usize> },
    /// The connection was refused or reset: nothing listens there (down at once).
    Refused,
    /// No answer within `health.scrape_timeout_ms`: a failure (below) unless the pod's
    /// engine sent KV events since its last scrape — a busy engine's `/metrics` can answer
    /// late while it serves, and its events show it alive.
    TimedOut,
    /// An error status, a page without vLLM's metrics, a timeout of a silent pod (down
    /// after `health.unhealthy_after` in a row).
    Failed,
}

/// Why a pod stopped being chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DownReason {
    /// Its `/metrics` refused the connection.
    ScrapeRefused,
    /// `health.unhealthy_after` scrapes in a row failed.
    ScrapesFailed,
    /// The proxy served a request elsewhere than the pick (the pick refused the connection
    /// or reset before answering, and a fallback answered).
    NotServed,
    /// Its KV-event stream disconnected.
    EventsDisconnected,
}

impl Scorer {
    /// Takes a pod out of the choice (its bookings released): it comes back with a
    /// successful scrape (unscraped pods: after `health.retry_seconds`).
    pub(super) fn pod_down(&self, core: &mut Core, pod: PodId, reason: DownReason, now: f64) {
        if !core.router.is_healthy(pod) {
            return;
        }
        core.router.unhealthy(pod);
        core.health(pod).down_since = Some(now);
        let name = core.name(pod);
        let reason: &str = reason.into();
        tracing::warn!(pod = %name, reason, "pod is down: not chosen until it answers again");
        self.metrics.pods_down.with_label_values(&[name, reason]).inc();
        self.metrics.pod_healthy.with_label_values(&[name]).set(0.0);
    }

    /// The pod's KV-event stream disconnected (its engine stopped, or the network broke).
    pub fn events_disconnected(&self, pod: PodId) {
        let now = self.now();
        let mut core = self.lock();
        if core.router.is_present(pod) {
            self.pod_down(&mut core, pod, DownReason::EventsDisconnected, now);
        }
    }

    /// A pod back from down: its index cannot be trusted unless its engine is known to be
    /// the same one (a restarted engine has an empty cache; forgetting costs less than
    /// believing).
    fn pod_up(&self, core: &mut Core, pod: PodId, same_engine: bool) {
        let name = core.name(pod).to_string();
        core.health(pod).down_since = None;
        if same_engine {
            tracing::info!(pod = %name, "pod is back (same engine): index kept");
        } else {
            Self::engine_changed(core, pod);
            tracing::info!(pod = %name, "pod is back: index cleared, rebuilt from its events");
        }
        self.metrics.pod_healthy.with_label_values(&[&name]).set(1.0);
    }

    /// Applies one decoded event batch of a pod.
    pub fn apply_events(&self, pod: PodId, batch: &EventBatch<'_>) {
        let (mut stored, mut removed, mut cleared) = (0u64, 0u64, 0u64);
        let mut block_size = None;
        for e in &batch.events {
            match e {
                KvEvent::BlockStored(s) => {
                    stored += s.block_hashes.len() as u64;
                    block_size = block_size.or((s.block_size > 0).then_some(s.block_size));
                    if let Some(adapter) = s.lora_name {
                        self.learn_adapter(adapter, None);
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => removed += block_hashes.len() as u64,
                KvEvent::AllBlocksCleared => cleared += 1,
                KvEvent::Unknown(_) => {}
            }
        }
        let p = {
            let mut core = self.lock();
            if let Some(block_size) = block_size {
                self.engine_block_size(&mut core, pod, block_size, "KV events");
            }
            core.router.apply_events(pod, batch);
            let health = core.health(pod);
            health.events_received += 1;
            health.events_since_scrape = true;
            core.info(pod)
        };
        for (kind, n) in [("block_stored", stored), ("block_removed", removed), ("all_blocks_cleared", cleared)] {
            if n > 0 {
                self.metrics.kv_events.with_label_values(&[p.name.as_str(), kind]).inc_by(n);
            }
        }
    }

    /// The pod's engine stated its KV block size (`source`: where): the first statement
    /// sets the size requests are hashed in, unless configured; one that disagrees with it
    /// is an error, once per pod and size (that engine's blocks cannot be indexed).
    fn engine_block_size(&self, core: &mut Core, pod: PodId, stated: usize, source: &str) {
        if core.health(pod).block_size.replace(stated) == Some(stated) {
            return;
        }
        let name = core.name(pod).to_string();
        let current = core.router.block_size();
        match &core.block_size_from {
            None => {
                core.router.set_block_size(stated);
                self.block_size.store(stated, Ordering::Relaxed);
                core.block_size_from = Some(BlockSizeFrom::Learned(name.clone()));
                tracing::info!(pod = %name, "KV blocks of {stated} tokens, as pod {name}'s engine states in its {source}");
            }
            Some(_) if stated == current => {}
            Some(from) => {
                let ours = match from {
                    BlockSizeFrom::Configured => format!("`block_size` is {current}"),
                    BlockSizeFrom::Learned(first) => format!("the fleet's are {current} (learned from pod {first})"),
                };
                tracing::error!(
                    pod = %name,
                    "pod {name}'s engine states KV blocks of {stated} tokens (its {source}), but {ours}: its cache \
                     cannot be indexed and nothing it holds is credited. Serve every pod with one --block-size, \
                     and leave `block_size` out of the configuration (kvgate learns it) or set it to the engines'."
                );
            }
        }
    }

    /// Tokens per KV block requests are hashed in now.
    pub fn block_size(&self) -> usize {
        self.block_size.load(Ordering::Relaxed)
    }

    /// A message from the pod's event socket could not be decoded.
    pub fn event_decode_error(&self, pod: PodId) {
        self.lock().health(pod).decode_errors += 1;
        self.metrics.kv_event_decode_errors.with_label_values(&[&self.pod(pod).name]).inc();
    }

    /// `missed` batches were lost before the one just received.
    pub fn event_gap(&self, pod: PodId, missed: u64) {
        {
            let mut core = self.lock();
            let health = &mut core.health(pod);
            health.event_gaps += 1;
            health.batches_missed += missed;
        }
        let name = &self.pod(pod).name;
        self.metrics.kv_event_gaps.with_label_values(&[name]).inc();
        self.metrics.kv_event_batches_missed.with_label_values(&[name]).inc_by(missed);
    }

    /// A duplicate or late batch was dropped.
    pub fn event_stale(&self, pod: PodId) {
        self.lock().health(pod).batches_stale += 1;
        self.metrics.kv_event_batches_stale.with_label_values(&[&self.pod(pod).name]).inc();
    }

    /// The pod's index can no longer be trusted (lost events not replayed, engine restart):
    /// forget it and rebuild from the events that follow.
    pub fn resync(&self, pod: PodId) {
        self.lock().router.clear_index(pod);
    }

    /// The pod's engine may be another one than its index was built from: forget it all.
    fn engine_changed(core: &mut Core, pod: PodId) {
        core.router.clear_index(pod);
        core.health(pod).engine_changes += 1;
    }

    /// How many times the pod's engine was found changed ([`Scorer::resync`] aside): a
    /// subscriber that sees this grow judges the stream afresh, catching up from replay.
    pub fn engine_changes(&self, pod: PodId) -> u64 {
        self.lock().health(pod).engine_changes
    }

    /// Result of one scrape of a pod's `/metrics`.
    pub fn scraped(&self, pod: PodId, scrape: Scrape) {
        let now = self.now();
        let mut core = self.lock();
        let core = &mut *core;
        if !core.router.is_present(pod) {
            return; // removed by discovery while this scrape was in flight
        }
        let was_healthy = core.router.is_healthy(pod);
        let events_since_scrape = std::mem::take(&mut core.health(pod).events_since_scrape);
        match scrape {
            Scrape::Answered { load, started_at, adapters, block_size } => {
                if let Some(block_size) = block_size {
                    self.engine_block_size(core, pod, block_size, "metrics (vllm:cache_config_info)");
                }
                if let Some(a) = &adapters {
                    a.running.iter().chain(&a.waiting).for_each(|name| self.learn_adapter(name, None));
                    core.router.reported_adapters(pod, ReportedAdapters::named(&a.running, &a.waiting, a.max_lora));
                }
                core.pods.get_mut(pod).adapters = adapters;
                let health = &mut core.health(pod);
                health.consecutive_failures = 0;
                let known = health.started_at;
                health.started_at = started_at.or(known);
                let same_engine = matches!((known, started_at), (Some(a), Some(b)) if a == b);
                let restarted = matches!((known, started_at), (Some(a), Some(b)) if a != b);
                core.router.reported(pod, load);
                let dropped = core.router.reconcile(pod, now);
                if dropped > 0 {
                    self.metrics.bookings_reconciled.inc_by(dropped as u64);
                    tracing::debug!(pod = %core.name(pod), dropped, "bookings the engine does not hold dropped");
                }
                self.room_may_have_appeared();
                if !was_healthy {
                    self.pod_up(core, pod, same_engine);
                } else if restarted {
                    // Restarted between two scrapes, unnoticed otherwise: its cache is empty.
                    Self::engine_changed(core, pod);
                    tracing::warn!(pod = %core.name(pod), "engine restarted (new process start time): index cleared");
                    self.metrics.engine_restarts.with_label_values(&[core.name(pod)]).inc();
                }
            }
            Scrape::Refused => {
                self.metrics.scrape_failures.with_label_values(&[core.name(pod)]).inc();
                self.pod_down(core, pod, DownReason::ScrapeRefused, now);
            }
            Scrape::TimedOut if events_since_scrape => {
                self.metrics.scrapes_late.with_label_values(&[core.name(pod)]).inc();
            }
            Scrape::TimedOut | Scrape::Failed => {
                self.metrics.scrape_failures.with_label_values(&[core.name(pod)]).inc();
                let health = &mut core.health(pod);
                health.consecutive_failures += 1;
                if health.consecutive_failures >= self.config.health.unhealthy_after {
                    self.pod_down(core, pod, DownReason::ScrapesFailed, now);
                }
            }
        }
    }

    /// Drops expired bookings and approximate entries.
    pub fn expire(&self) {
        let now = self.now();
        let mut core = self.lock();
        let n = core.router.expire(now);
        // Pods nobody scrapes are tried again after a while (their next failure takes them
        // out again).
        let retry = self.config.health.retry_seconds;
        let due: Vec<PodId> = (core.pods.iter())
            .filter(|(id, p)| !p.info.scraped && core.router.is_present(*id))
            .filter(|(_, p)| p.health.down_since.is_some_and(|t| now - t >= retry))
            .map(|(id, _)| id)
            .collect();
        for pod in due {
            core.router.retry(pod);
            self.pod_up(&mut core, pod, false);
        }
        drop(core);
        self.metrics.bookings_expired.inc_by(n as u64);
        self.room_may_have_appeared();
    }
}
