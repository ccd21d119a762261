//! What `GET /v1/pods` shows of each pod, and the per-pod gauges it refreshes.

use super::Scorer;
use crate::config::Role;
use crate::engine_pages::PodAdapters;
use kvgate_routing::index::PodIndexStats;
use kvgate_routing::policy::ReportedLoad;
use kvgate_routing::router::PrefillWaits;
use serde::Serialize;

/// One entry of `GET /v1/pods`.
#[derive(Serialize)]
pub struct PodView {
    pub name: String,
    pub address: String,
    pub role: Role,
    pub healthy: bool,
    /// `precise` (KV events) or `approximate` (what kvgate routed there).
    pub index: &'static str,
    pub cached_blocks: usize,
    /// Blocks its KV connector offloaded to host memory or storage (precise index only).
    pub offloaded_blocks: usize,
    pub inflight_requests: u32,
    pub queued_prefill_tokens: u64,
    /// Predicted seconds to work through that prefill (the wait before a request sent there
    /// now starts its own), once the fleet's prefill speed is learned from first tokens.
    pub queued_prefill_seconds: Option<f64>,
    pub decode_blocks: f64,
    /// Blocks of the prompts routed to it within `load.recent_window_seconds`: more than its
    /// KV cache holds (`reported.num_gpu_blocks`), it evicts what that traffic comes back for.
    pub recent_blocks: u64,
    /// Its prefill time relative to the fleet's average (1 = average), learned from the
    /// first tokens it reported; applied to its costs unless `load.pod_speed.learn` is off.
    pub slowness: f64,
    /// The (decayed) count of first tokens that taught it.
    pub slowness_samples: f64,
    /// Tokens per second one sequence decodes there, learned from `done` reports with
    /// output tokens (absent until enough arrived).
    pub decode_tokens_per_second: Option<f64>,
    pub events_received: u64,
    pub event_gaps: u64,
    /// Batches the gaps skipped (lost by the publisher's full queue or the network), before
    /// any replay: with `events_received` this accounts for every batch a pod published.
    pub event_batches_missed: u64,
    /// Duplicate or late batches dropped by their sequence number.
    pub event_batches_stale: u64,
    pub event_decode_errors: u64,
    /// Tokens per KV block its engine states (its events, its metrics); one unlike the
    /// scorer's is an error in its log, and its cache is not indexed.
    pub block_size: Option<usize>,
    pub reported: Option<ReportedLoad>,
    /// The LoRA adapters it runs and has waiting, and how many it holds at once (its last
    /// scrape's `vllm:lora_requests_info`).
    pub adapters: Option<PodAdapters>,
    /// The models it lists (`/v1/models`): it is chosen only for requests naming one of them.
    /// Absent until read (then it may be chosen for any).
    pub models: Option<Vec<String>>,
    pub index_stats: PodIndexStats,
}

impl Scorer {
    /// `GET /v1/pods`; also refreshes the gauges.
    pub fn pods_view(&self) -> Vec<PodView> {
        let now = self.now();
        let core = self.lock();
        let views: Vec<PodView> = (core.pods.iter())
            .filter(|(id, _)| core.router.is_present(*id))
            .map(|(_, entry)| {
                let (p, h) = (&entry.info, entry.health);
                let load = core.router.load().load(p.id, now);
                let cached = core.router.pod_blocks(p.id);
                let speed = core.router.load().speed(p.id);
                PodView {
                    name: p.name.clone(),
                    address: p.address.clone(),
                    role: p.role,
                    healthy: core.router.is_healthy(p.id),
                    index: if p.precise { "precise" } else { "approximate" },
                    cached_blocks: cached,
                    offloaded_blocks: core.router.index().pod_offloaded_blocks(p.id),
                    inflight_requests: load.inflight_requests,
                    queued_prefill_tokens: load.queued_prefill_tokens,
                    queued_prefill_seconds: core.router.load().queued_prefill_seconds(p.id),
                    decode_blocks: load.decode_blocks,
                    recent_blocks: core.router.recent_blocks(p.id),
                    slowness: speed.slowness,
                    slowness_samples: speed.samples,
                    decode_tokens_per_second: speed.decode_tokens_per_second,
                    events_received: h.events_received,
                    event_gaps: h.event_gaps,
                    event_batches_missed: h.batches_missed,
                    event_batches_stale: h.batches_stale,
                    event_decode_errors: h.decode_errors,
                    block_size: h.block_size,
                    reported: core.router.reported_load(p.id),
                    adapters: entry.adapters.clone(),
                    models: entry.models.clone(),
                    index_stats: core.router.index().stats(p.id),
                }
            })
            .collect();
        let waits = core.router.prefill_waits();
        let (entries, distinct) = (core.router.index().entries(), core.router.index().distinct_blocks());
        let fixed_prefill_tokens = core.router.load().fixed_prefill_tokens();
        drop(core);
        for v in &views {
            self.metrics.index_blocks.with_label_values(&[&v.name, v.index]).set(v.cached_blocks as f64);
            if v.index == "precise" {
                self.metrics.index_blocks.with_label_values(&[&v.name, "offloaded"]).set(v.offloaded_blocks as f64);
            }
            self.metrics.inflight_requests.with_label_values(&[&v.name]).set(f64::from(v.inflight_requests));
            self.metrics.queued_prefill_tokens.with_label_values(&[&v.name]).set(v.queued_prefill_tokens as f64);
            self.metrics.pod_slowness.with_label_values(&[&v.name]).set(v.slowness);
        }
        self.metrics.fixed_prefill_tokens.set(fixed_prefill_tokens);
        self.set_pool_gauges(&views, waits);
        self.metrics.index_entries.with_label_values(&["block_pod_entries"]).set(entries as f64);
        self.metrics.index_entries.with_label_values(&["distinct_blocks"]).set(distinct as f64);
        if let Some(stats) = self.tokenizers.default_tokenizer().segment_cache_stats() {
            for (outcome, total) in [("hit", stats.hits), ("miss", stats.misses)] {
                let counter = self.metrics.tokenizer_cache_pieces.with_label_values(&[outcome]);
                counter.inc_by(total.saturating_sub(counter.get()));
            }
            self.metrics.tokenizer_cache_tokens.set(i64::try_from(stats.tokens).unwrap_or(i64::MAX));
        }
        views
    }
}

impl Scorer {
    /// The pool's signals for autoscaling, over the pods that can be chosen (see
    /// docs/autoscaling.md): each replica shares its bookings, so every replica shows the
    /// whole fleet's.
    fn set_pool_gauges(&self, views: &[PodView], waits: Option<PrefillWaits>) {
        let pool = &self.metrics.pool;
        let healthy: Vec<&PodView> = views.iter().filter(|v| v.healthy).collect();
        pool.healthy_pods.set(healthy.len() as i64);
        let mean = |values: &[f64]| (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
        let inflight: Vec<f64> = healthy.iter().map(|v| f64::from(v.inflight_requests)).collect();
        pool.inflight_per_pod.set(mean(&inflight).unwrap_or(0.0));
        // A wait is predicted once the fleet's prefill speed is learned: absent before.
        if let Some(waits) = waits {
            pool.predicted_wait.with_label_values(&["soonest"]).set(waits.soonest);
            pool.predicted_wait.with_label_values(&["mean"]).set(waits.mean);
        }
        let usage: Vec<f64> = healthy.iter().filter_map(|v| Some(v.reported.as_ref()?.kv_cache_usage)).collect();
        if let Some(mean_usage) = mean(&usage) {
            pool.kv_cache_usage.with_label_values(&["mean"]).set(mean_usage);
            pool.kv_cache_usage.with_label_values(&["max"]).set(usage.iter().copied().fold(0.0, f64::max));
        }
    }
}
