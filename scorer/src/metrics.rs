//! The scorer's Prometheus metrics. Labels carry pod names and policy names only — never
//! anything from a request.

use prometheus::{
    CounterVec, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub decisions: IntCounterVec,
    pub decisions_by_path: IntCounterVec,
    pub decision_seconds: Histogram,
    pub tokenize_seconds: HistogramVec,
    pub tokenizer_cache_pieces: IntCounterVec,
    pub tokenizer_cache_tokens: prometheus::IntGauge,
    pub route_errors: IntCounterVec,
    pub state_lock_waits: IntCounter,
    pub state_lock_wait_seconds: Histogram,
    pub route_streams: prometheus::IntGauge,
    pub prompt_tokens: IntCounter,
    pub cached_tokens: IntCounter,
    pub kv_events: IntCounterVec,
    pub kv_event_gaps: IntCounterVec,
    pub discovered_pods: GaugeVec,
    pub discovery_errors: IntCounterVec,
    pub kv_event_batches_missed: IntCounterVec,
    pub kv_event_batches_stale: IntCounterVec,
    pub kv_event_decode_errors: IntCounterVec,
    pub kv_replays: IntCounterVec,
    pub lifecycle_reports: IntCounterVec,
    pub lifecycle_unknown: IntCounter,
    pub bookings_expired: IntCounter,
    pub bookings_reconciled: IntCounter,
    pub bookings_moved: IntCounter,
    pub epp_errors: IntCounterVec,
    pub pods_down: IntCounterVec,
    pub admission_waiting: prometheus::Gauge,
    pub admission_wait_seconds: Histogram,
    pub admission_refused: IntCounterVec,
    pub engine_restarts: IntCounterVec,
    pub output_tokens: IntCounter,
    pub scrape_failures: IntCounterVec,
    pub index_blocks: GaugeVec,
    pub index_entries: GaugeVec,
    pub inflight_requests: GaugeVec,
    pub queued_prefill_tokens: GaugeVec,
    pub pod_slowness: GaugeVec,
    pub pod_healthy: GaugeVec,
    pub prefix_hit_ratio: CounterVec,
    pub sync: SyncMetrics,
}

/// What sharing bookings with the other replicas (`sync`) did.
pub struct SyncMetrics {
    /// Booking updates published, applied from others, dropped (by why).
    pub updates: IntCounterVec,
    /// NATS messages published and received (updates, heartbeats, snapshot parts).
    pub messages: IntCounterVec,
    /// Sequence gaps in another replica's messages (lost updates: its snapshot follows).
    pub gaps: IntCounter,
    /// Snapshots of our bookings sent, and of others' applied.
    pub snapshots: IntCounterVec,
    /// Send-to-apply delay of other replicas' messages (clock offset between hosts included).
    pub lag_seconds: Histogram,
    /// Other replicas currently heard from.
    pub replicas: prometheus::IntGauge,
    /// Replicas dropped after `replica_timeout_ms` of silence (their bookings with them).
    pub replicas_lost: IntCounter,
    /// 1 while connected to NATS.
    pub connected: prometheus::IntGauge,
}

fn buckets() -> Vec<f64> {
    // 1 µs … 1 s, roughly ×2.5 per bucket.
    vec![1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0]
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("kvgate".into()), None).expect("valid prefix");
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("valid metric");
                registry.register(Box::new(m.clone())).expect("unique metric");
                m
            }};
        }
        let decisions =
            reg!(IntCounterVec::new(Opts::new("decisions_total", "Routing decisions."), &["policy", "pod"]));
        let decisions_by_path = reg!(IntCounterVec::new(
            Opts::new("decisions_by_path_total", "Routing decisions: direct, or prefill/decode disaggregated."),
            &["path"]
        ));
        let decision_seconds = reg!(Histogram::with_opts(
            HistogramOpts::new("decision_seconds", "Time to choose a pod, tokenization excluded.").buckets(buckets())
        ));
        let tokenize_seconds = reg!(HistogramVec::new(
            HistogramOpts::new("tokenize_seconds", "Time to tokenize a request (chat template included).")
                .buckets(buckets()),
            &["api"]
        ));
        let tokenizer_cache_pieces = reg!(IntCounterVec::new(
            Opts::new(
                "tokenizer_cache_pieces_total",
                "Long pieces of prompt text (cut at special tokens and between words): ids from the cache (hit) or encoded (miss)."
            ),
            &["outcome"]
        ));
        let tokenizer_cache_tokens =
            reg!(prometheus::IntGauge::new("tokenizer_cache_tokens", "Token ids the tokenizer cache holds."));
        let route_errors =
            reg!(IntCounterVec::new(Opts::new("route_errors_total", "Route calls answered with an error."), &["code"]));
        let state_lock_waits = reg!(IntCounter::new(
            "state_lock_waits_total",
            "Times a thread found the scorer's state (index, bookings, pods) locked by another and waited."
        ));
        let state_lock_wait_seconds = reg!(Histogram::with_opts(
            HistogramOpts::new("state_lock_wait_seconds", "How long those waits for the scorer's state took.")
                .buckets(buckets())
        ));
        let route_streams =
            reg!(prometheus::IntGauge::new("route_streams", "Route streams open (one per Envoy worker and filter)."));
        let prompt_tokens = reg!(IntCounter::new("routed_prompt_tokens_total", "Prompt tokens of routed requests."));
        let cached_tokens =
            reg!(IntCounter::new("routed_cached_tokens_total", "Of those, tokens cached on the chosen pod."));
        let kv_events =
            reg!(IntCounterVec::new(Opts::new("kv_events_total", "KV events applied, by type."), &["pod", "type"]));
        let kv_event_gaps =
            reg!(IntCounterVec::new(Opts::new("kv_event_gaps_total", "Sequence gaps in a pod's events."), &["pod"]));
        let discovered_pods =
            reg!(GaugeVec::new(Opts::new("discovered_pods", "Pods a discovery source currently sees."), &["source"]));
        let discovery_errors = reg!(IntCounterVec::new(
            Opts::new("discovery_errors_total", "Failed discovery lookups or watches (pods kept)."),
            &["source"]
        ));
        let kv_event_batches_missed = reg!(IntCounterVec::new(
            Opts::new("kv_event_batches_missed_total", "Batches skipped by sequence gaps (before replay)."),
            &["pod"]
        ));
        let kv_event_batches_stale = reg!(IntCounterVec::new(
            Opts::new("kv_event_batches_stale_total", "Duplicate or late batches dropped."),
            &["pod"]
        ));
        let kv_event_decode_errors = reg!(IntCounterVec::new(
            Opts::new("kv_event_decode_errors_total", "Event messages dropped as undecodable."),
            &["pod"]
        ));
        let kv_replays = reg!(IntCounterVec::new(
            Opts::new(
                "kv_replays_total",
                "Replays after gaps (recovered, failed, unavailable) and on joining a stream (caught_up, caught_up_partly, failed)."
            ),
            &["pod", "outcome"]
        ));
        let lifecycle_reports =
            reg!(IntCounterVec::new(Opts::new("lifecycle_reports_total", "Lifecycle reports received."), &["event"]));
        let lifecycle_unknown =
            reg!(IntCounter::new("lifecycle_unknown_total", "Lifecycle reports naming no in-flight request."));
        let bookings_expired =
            reg!(IntCounter::new("bookings_expired_total", "In-flight bookings dropped after their TTL."));
        let bookings_reconciled = reg!(IntCounter::new(
            "bookings_reconciled_total",
            "In-flight bookings dropped because the pod's engine no longer accounted for them."
        ));
        let bookings_moved = reg!(IntCounter::new(
            "bookings_moved_total",
            "Bookings moved to the pod that served after the proxy retried elsewhere."
        ));
        let epp_errors = reg!(IntCounterVec::new(
            Opts::new(
                "epp_errors_total",
                "Endpoint Picker streams failed: protocol (a gateway setting kvgate cannot serve)."
            ),
            &["kind"]
        ));
        let pods_down = reg!(IntCounterVec::new(
            Opts::new("pods_down_total", "Pods taken out of the choice, by why (back at their next good scrape)."),
            &["pod", "reason"]
        ));
        let admission_waiting = reg!(prometheus::Gauge::new(
            "admission_waiting",
            "Requests waiting for a pod with room (admission queue)."
        ));
        let admission_wait_seconds = reg!(Histogram::with_opts(
            HistogramOpts::new("admission_wait_seconds", "Time requests waited in the admission queue before a pod.")
                .buckets(vec![0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
        ));
        let admission_refused = reg!(IntCounterVec::new(
            Opts::new(
                "admission_refused_total",
                "Requests refused for overload (429), by why: sheddable, queue_full, deadline."
            ),
            &["reason"]
        ));
        let engine_restarts = reg!(IntCounterVec::new(
            Opts::new("engine_restarts_total", "Engine restarts noticed by a new process start time (index cleared)."),
            &["pod"]
        ));
        let output_tokens =
            reg!(IntCounter::new("output_tokens_total", "Completion tokens of finished requests (from their usage)."));
        let scrape_failures = reg!(IntCounterVec::new(
            Opts::new("scrape_failures_total", "Failed scrapes of a pod's /metrics."),
            &["pod"]
        ));
        let index_blocks = reg!(GaugeVec::new(
            Opts::new(
                "index_blocks",
                "Blocks indexed per pod: on its GPU by index (precise, approximate), and offloaded."
            ),
            &["pod", "index"]
        ));
        let index_entries = reg!(GaugeVec::new(Opts::new("index_size", "Index size."), &["measure"]));
        let inflight_requests =
            reg!(GaugeVec::new(Opts::new("inflight_requests", "Requests routed and not finished."), &["pod"]));
        let queued_prefill_tokens = reg!(GaugeVec::new(
            Opts::new("queued_prefill_tokens", "Uncached prompt tokens routed and not yet at first token."),
            &["pod"]
        ));
        let pod_slowness = reg!(GaugeVec::new(
            Opts::new(
                "pod_slowness",
                "Prefill time relative to the fleet's average (1 = average), learned from first tokens."
            ),
            &["pod"]
        ));
        let pod_healthy = reg!(GaugeVec::new(Opts::new("pod_healthy", "1 if the pod can be chosen."), &["pod"]));
        let prefix_hit_ratio = reg!(CounterVec::new(
            Opts::new("prefix_hit_ratio_sum", "Σ cached/prompt tokens over decisions (÷ decisions = mean ratio)."),
            &["policy"]
        ));
        let sync = SyncMetrics {
            updates: reg!(IntCounterVec::new(
                Opts::new(
                    "sync_updates_total",
                    "Booking updates shared with other replicas: sent, applied, dropped_bus_down, unknown_pod, \
                     unknown_booking."
                ),
                &["outcome"]
            )),
            messages: reg!(IntCounterVec::new(
                Opts::new("sync_messages_total", "NATS messages of the booking sync, sent and received."),
                &["direction"]
            )),
            gaps: reg!(IntCounter::new("sync_gaps_total", "Sequence gaps in another replica's booking messages.")),
            snapshots: reg!(IntCounterVec::new(
                Opts::new("sync_snapshots_total", "Booking snapshots: sent (ours) and applied (another replica's)."),
                &["direction"]
            )),
            lag_seconds: reg!(Histogram::with_opts(
                HistogramOpts::new("sync_lag_seconds", "Delay from another replica's send to our apply.")
                    .buckets(vec![1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0])
            )),
            replicas: reg!(prometheus::IntGauge::new("sync_replicas", "Other gateway replicas currently heard from.")),
            replicas_lost: reg!(IntCounter::new(
                "sync_replicas_lost_total",
                "Replicas dropped after replica_timeout_ms of silence (their bookings dropped)."
            )),
            connected: reg!(prometheus::IntGauge::new("sync_connected", "1 while connected to NATS (with sync).")),
        };
        Self {
            registry,
            decisions,
            decisions_by_path,
            decision_seconds,
            tokenize_seconds,
            tokenizer_cache_pieces,
            tokenizer_cache_tokens,
            route_errors,
            state_lock_waits,
            state_lock_wait_seconds,
            route_streams,
            prompt_tokens,
            cached_tokens,
            kv_events,
            kv_event_gaps,
            discovered_pods,
            discovery_errors,
            kv_event_batches_missed,
            kv_event_batches_stale,
            kv_event_decode_errors,
            kv_replays,
            lifecycle_reports,
            lifecycle_unknown,
            bookings_expired,
            bookings_reconciled,
            bookings_moved,
            epp_errors,
            pods_down,
            admission_waiting,
            admission_wait_seconds,
            admission_refused,
            engine_restarts,
            output_tokens,
            scrape_failures,
            index_blocks,
            index_entries,
            inflight_requests,
            queued_prefill_tokens,
            pod_slowness,
            pod_healthy,
            prefix_hit_ratio,
            sync,
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
