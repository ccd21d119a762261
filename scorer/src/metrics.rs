//! The scorer's Prometheus metrics. Labels carry pod names and policy names only — never
//! anything from a request.

use prometheus::{
    CounterVec, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    docs: Vec<MetricDoc>,
    pub decisions: IntCounterVec,
    pub decisions_by_path: IntCounterVec,
    pub decision_seconds: Histogram,
    pub tokenize_seconds: HistogramVec,
    pub tokenizer_cache_pieces: IntCounterVec,
    pub tokenizer_cache_tokens: IntGauge,
    pub route_errors: IntCounterVec,
    pub state_lock_waits: IntCounter,
    pub state_lock_wait_seconds: Histogram,
    pub route_streams: IntGauge,
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
    pub prefix_predictions: IntCounterVec,
    pub prefix_overcredited_tokens: IntCounterVec,
    pub error_responses: IntCounterVec,
    pub bookings_expired: IntCounter,
    pub bookings_reconciled: IntCounter,
    pub bookings_moved: IntCounter,
    pub epp_errors: IntCounterVec,
    pub epp_exchanges_open: IntGauge,
    pub pods_down: IntCounterVec,
    pub admission_waiting: GaugeVec,
    pub admission_wait_seconds: HistogramVec,
    pub admission_refused: IntCounterVec,
    pub objectives_unknown: IntCounter,
    pub model_rewrites: IntCounterVec,
    pub engine_restarts: IntCounterVec,
    pub output_tokens: IntCounter,
    pub scrape_failures: IntCounterVec,
    pub scrapes_late: IntCounterVec,
    pub index_blocks: GaugeVec,
    pub index_entries: GaugeVec,
    pub inflight_requests: GaugeVec,
    pub queued_prefill_tokens: GaugeVec,
    pub pod_slowness: GaugeVec,
    pub fixed_prefill_tokens: prometheus::Gauge,
    pub pod_healthy: GaugeVec,
    pub prefix_hit_ratio: CounterVec,
    pub sync: SyncMetrics,
    pub pool: PoolMetrics,
}

/// The pool's signals an autoscaler scales the engines on (docs/autoscaling.md).
pub struct PoolMetrics {
    pub healthy_pods: IntGauge,
    pub inflight_per_pod: prometheus::Gauge,
    pub predicted_wait: GaugeVec,
    pub kv_cache_usage: GaugeVec,
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
    pub replicas: IntGauge,
    /// Replicas dropped after `replica_timeout_ms` of silence (their bookings with them).
    pub replicas_lost: IntCounter,
    /// 1 while connected to NATS.
    pub connected: IntGauge,
    /// What NATS or its client reported wrong: `authorization` (the server refused this
    /// replica's credentials), `server`, `client` (TLS among them).
    pub errors: IntCounterVec,
}

/// One metric as `docs/metrics.md` lists it.
#[derive(Clone, Debug)]
pub struct MetricDoc {
    /// Its name without the `kvgate_` prefix.
    pub name: String,
    pub kind: &'static str,
    pub labels: Vec<String>,
    pub help: String,
}

/// Registers each metric as it is made, and describes it.
struct Registrar(Registry, std::cell::RefCell<Vec<MetricDoc>>);

impl Registrar {
    fn add<M: prometheus::core::Collector + Clone + 'static>(
        &self,
        kind: &'static str,
        made: prometheus::Result<M>,
    ) -> M {
        let metric = made.expect("valid metric");
        self.0.register(Box::new(metric.clone())).expect("unique metric");
        for d in metric.desc() {
            let (name, help, labels) = (d.fq_name.clone(), d.help.clone(), d.variable_labels.clone());
            self.1.borrow_mut().push(MetricDoc { name, kind, labels, help });
        }
        metric
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add("counter", IntCounter::new(name, help))
    }

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add("counter", IntCounterVec::new(Opts::new(name, help), labels))
    }

    fn int_gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add("gauge", IntGauge::new(name, help))
    }

    fn gauges(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.add("gauge", GaugeVec::new(Opts::new(name, help), labels))
    }

    fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        self.add("histogram", Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)))
    }
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
        let r = Registrar(Registry::new_custom(Some("kvgate".into()), None).expect("valid prefix"), Default::default());
        Self {
            decisions: r.counters("decisions_total", "Routing decisions.", &["policy", "pod"]),
            decisions_by_path: r.counters(
                "decisions_by_path_total",
                "Routing decisions: direct, or prefill/decode disaggregated.",
                &["path"],
            ),
            decision_seconds: r.histogram(
                "decision_seconds",
                "Time to choose a pod, tokenization excluded.",
                buckets(),
            ),
            tokenize_seconds: r.add("histogram", HistogramVec::new(
                HistogramOpts::new(
                    "tokenize_seconds",
                    "Time to tokenize a request (chat template included), by API: completions, chat, responses, messages.",
                )
                    .buckets(buckets()),
                &["api"],
            )),
            tokenizer_cache_pieces: r.counters(
                "tokenizer_cache_pieces_total",
                "Long pieces of prompt text (cut at special tokens and between words): ids from the cache (hit) or encoded (miss).",
                &["outcome"],
            ),
            tokenizer_cache_tokens: r.int_gauge("tokenizer_cache_tokens", "Token ids the tokenizer cache holds."),
            route_errors: r.counters("route_errors_total", "Route calls answered with an error.", &["code"]),
            state_lock_waits: r.counter(
                "state_lock_waits_total",
                "Times a thread found the scorer's state (index, bookings, pods) locked by another and waited.",
            ),
            state_lock_wait_seconds: r.histogram(
                "state_lock_wait_seconds",
                "How long those waits for the scorer's state took.",
                buckets(),
            ),
            route_streams: r.int_gauge(
                "route_streams",
                "Route streams and sockets open: one per Envoy worker and filter, and one more per Envoy for the wasm \
                 filter (its VM on Envoy's main thread keeps one too).",
            ),
            prompt_tokens: r.counter("routed_prompt_tokens_total", "Prompt tokens of routed requests."),
            cached_tokens: r.counter("routed_cached_tokens_total", "Of those, tokens cached on the chosen pod."),
            kv_events: r.counters("kv_events_total", "KV events applied, by type.", &["pod", "type"]),
            kv_event_gaps: r.counters("kv_event_gaps_total", "Sequence gaps in a pod's events.", &["pod"]),
            discovered_pods: r.gauges("discovered_pods", "Pods a discovery source currently sees.", &["source"]),
            discovery_errors: r.counters(
                "discovery_errors_total",
                "Failed discovery lookups or watches (pods kept).",
                &["source"],
            ),
            kv_event_batches_missed: r.counters(
                "kv_event_batches_missed_total",
                "Batches skipped by sequence gaps (before replay).",
                &["pod"],
            ),
            kv_event_batches_stale: r.counters(
                "kv_event_batches_stale_total",
                "Duplicate or late batches dropped.",
                &["pod"],
            ),
            kv_event_decode_errors: r.counters(
                "kv_event_decode_errors_total",
                "Event messages dropped as undecodable.",
                &["pod"],
            ),
            kv_replays: r.counters(
                "kv_replays_total",
                "Replays after gaps (recovered, failed, unavailable) and on joining a stream (caught_up, caught_up_partly, failed).",
                &["pod", "outcome"],
            ),
            lifecycle_reports: r.counters("lifecycle_reports_total", "Lifecycle reports received.", &["event"]),
            lifecycle_unknown: r.counter("lifecycle_unknown_total", "Lifecycle reports naming no in-flight request."),
            prefix_predictions: r.counters(
                "prefix_predictions_total",
                "Finished requests whose engine said how many prompt tokens it served from its cache (vLLM's \
                 `usage` with `--enable-prompt-tokens-details`), by how the tokens kvgate credited the pod that \
                 served compare: exact; evicted (more than served, the engine having evicted a credited block \
                 while the request was in flight: cache pressure); over (more than served, no eviction seen: \
                 kvgate believed in blocks the engine did not hold); under.",
                &["pod", "outcome"],
            ),
            prefix_overcredited_tokens: r.counters(
                "prefix_overcredited_tokens_total",
                "Of those credited more than served (evicted or over), the tokens credited beyond it.",
                &["pod"],
            ),
            error_responses: r.counters(
                "error_responses_total",
                "Routed requests answered with an error status (4xx: the engine refused the request; 5xx: it \
                 failed, or the proxy found no way to it), by the pod they were booked on.",
                &["pod", "class"],
            ),
            bookings_expired: r.counter("bookings_expired_total", "In-flight bookings dropped after their TTL."),
            bookings_reconciled: r.counter(
                "bookings_reconciled_total",
                "In-flight bookings dropped because the pod's engine no longer accounted for them.",
            ),
            bookings_moved: r.counter(
                "bookings_moved_total",
                "Bookings moved to the pod that served after the proxy retried elsewhere.",
            ),
            epp_errors: r.counters(
                "epp_errors_total",
                "Endpoint Picker streams failed: protocol (a gateway setting kvgate cannot serve).",
                &["kind"],
            ),
            epp_exchanges_open: r.int_gauge(
                "epp_exchanges_open",
                "Endpoint Picker exchanges (one per request a gateway relays) open now.",
            ),
            pods_down: r.counters(
                "pods_down_total",
                "Pods taken out of the choice, by why (back at their next good scrape).",
                &["pod", "reason"],
            ),
            admission_waiting: r.gauges(
                "admission_waiting",
                "Requests waiting for a pod with room (admission queue), by priority (their objective's).",
                &["priority"],
            ),
            admission_wait_seconds: r.add("histogram", HistogramVec::new(
                HistogramOpts::new(
                    "admission_wait_seconds",
                    "Time requests waited in the admission queue before a pod, by priority.",
                )
                .buckets(vec![0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
                &["priority"],
            )),
            admission_refused: r.counters(
                "admission_refused_total",
                "Requests refused for overload (429), by why (sheddable, queue_full, deadline) and priority.",
                &["reason", "priority"],
            ),
            objectives_unknown: r.counter(
                "objectives_unknown_total",
                "Requests naming an objective that neither the pool's InferenceObjectives nor admission.objectives \
                 define (given the default priority).",
            ),
            model_rewrites: r.counters(
                "model_rewrites_total",
                "Requests routed with their model rewritten, by the model the rule matched (`*`: the catch-all) \
                 and the target the pods were asked for.",
                &["from", "to"],
            ),
            engine_restarts: r.counters(
                "engine_restarts_total",
                "Engine restarts noticed by a new process start time (index cleared).",
                &["pod"],
            ),
            output_tokens: r.counter(
                "output_tokens_total",
                "Completion tokens of finished requests (from their usage).",
            ),
            scrape_failures: r.counters("scrape_failures_total", "Failed scrapes of a pod's /metrics.", &["pod"]),
            scrapes_late: r.counters(
                "scrapes_late_total",
                "Scrapes of a pod's /metrics not answered in time while its engine sent KV events (busy, not down).",
                &["pod"],
            ),
            index_blocks: r.gauges(
                "index_blocks",
                "Blocks indexed per pod: on its GPU by index (precise, approximate), and offloaded.",
                &["pod", "index"],
            ),
            index_entries: r.gauges("index_size", "Index size.", &["measure"]),
            inflight_requests: r.gauges("inflight_requests", "Requests routed and not finished.", &["pod"]),
            queued_prefill_tokens: r.gauges(
                "queued_prefill_tokens",
                "Uncached prompt tokens routed and not yet at first token.",
                &["pod"],
            ),
            pod_slowness: r.gauges(
                "pod_slowness",
                "Prefill time relative to the fleet's average (1 = average), learned from first tokens.",
                &["pod"],
            ),
            fixed_prefill_tokens: r.add(
                "gauge",
                prometheus::Gauge::new(
                    "fixed_prefill_tokens",
                    "Tokens of prefill a first token's fixed time (the base cost of the steps it waits through) \
                     is worth at the fleet's average speed, learned from first tokens (0 until then).",
                ),
            ),
            pod_healthy: r.gauges("pod_healthy", "1 if the pod can be chosen.", &["pod"]),
            prefix_hit_ratio: r.add("counter", CounterVec::new(
                Opts::new("prefix_hit_ratio_sum", "Σ cached/prompt tokens over decisions (÷ decisions = mean ratio)."),
                &["policy"],
            )),
            sync: SyncMetrics {
                updates: r.counters(
                    "sync_updates_total",
                    "Booking updates shared with other replicas: sent, applied, dropped_bus_down, unknown_pod, unknown_booking.",
                    &["outcome"],
                ),
                messages: r.counters(
                    "sync_messages_total",
                    "NATS messages of the booking sync, sent and received.",
                    &["direction"],
                ),
                gaps: r.counter("sync_gaps_total", "Sequence gaps in another replica's booking messages."),
                snapshots: r.counters(
                    "sync_snapshots_total",
                    "Booking snapshots: sent (ours) and applied (another replica's).",
                    &["direction"],
                ),
                lag_seconds: r.histogram(
                    "sync_lag_seconds",
                    "Delay from another replica's send to our apply.",
                    vec![1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0],
                ),
                replicas: r.int_gauge("sync_replicas", "Other gateway replicas currently heard from."),
                replicas_lost: r.counter(
                    "sync_replicas_lost_total",
                    "Replicas dropped after replica_timeout_ms of silence (their bookings dropped).",
                ),
                connected: r.int_gauge("sync_connected", "1 while connected to NATS (with sync)."),
                errors: r.counters(
                    "sync_errors_total",
                    "Errors NATS reported: authorization (credentials refused), server, client (TLS among them).",
                    &["kind"],
                ),
            },
            pool: PoolMetrics {
                healthy_pods: r.int_gauge("pool_healthy_pods", "Pods that can be chosen now."),
                inflight_per_pod: r.add(
                    "gauge",
                    prometheus::Gauge::new(
                        "pool_inflight_requests_per_pod",
                        "Requests in flight (every replica's) per pod that can be chosen.",
                    ),
                ),
                predicted_wait: r.gauges(
                    "pool_predicted_wait_seconds",
                    "Predicted seconds of prefill queued ahead of a request on the pods that can be chosen: at the \
                     soonest pod (what the next request waits at least) and their mean. Absent until the fleet's \
                     prefill speed is learned from first tokens.",
                    &["at"],
                ),
                kv_cache_usage: r.gauges(
                    "pool_kv_cache_usage",
                    "KV-cache usage the pods that can be chosen report (vllm:kv_cache_usage_perc, 0–1): mean and max.",
                    &["stat"],
                ),
            },
            docs: r.1.into_inner(),
            registry: r.0,
        }
    }

    /// Every metric, in the order they are made.
    pub fn docs(&self) -> &[MetricDoc] {
        &self.docs
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
