//! Figures of a run (TTFT percentiles, inter-token latency, throughput, prefix-hit rate,
//! load imbalance) and their presentation: a Markdown table and an SVG bar chart.

use crate::cluster::RunResult;
use serde::Serialize;

/// The figures of one router on one workload.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub workload: String,
    pub router: String,
    pub requests: usize,
    /// Refused by an engine (prompt larger than a pod's cache), or never finished.
    pub failed: usize,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    /// Each seed's TTFT p90, the median over the seeds pooled (for one seed, its p90): the
    /// live benchmark's figure, which takes each run's p90 and reports the median run.
    pub ttft_p90_seed_median_ms: f64,
    pub ttft_p99_ms: f64,
    /// Mean over requests of (finish − first token) / (output tokens − 1).
    pub itl_mean_ms: f64,
    /// Output tokens per virtual second, first arrival to last completion.
    pub throughput_tokens_per_s: f64,
    /// Prompt tokens served from cache ÷ prompt tokens.
    pub prefix_hit_rate: f64,
    /// The same, as the router predicted it when routing (routers that predict it).
    pub predicted_hit_rate: Option<f64>,
    /// Requests per decoding pod: max ÷ mean (1 = perfectly even).
    pub imbalance: f64,
    /// The most requests one pod had in flight at once (arrival to finish): a pile-up.
    pub peak_inflight: usize,
    pub preemptions: u64,
    pub makespan_s: f64,
    /// The autoscaling signals over the run, as an autoscaler polling them would see them on
    /// average: the router's predicted wait at the soonest pod and over the pods (routers
    /// that predict one; samples before its speeds were learned left out), the pods' mean
    /// KV-cache usage and waiting requests.
    pub wait_soonest_ms: Option<f64>,
    pub wait_mean_ms: Option<f64>,
    pub kv_cache_usage_mean: f64,
    pub engine_waiting_mean: f64,
    /// The same per decoding pod, in pod order: where a router sent its requests and what
    /// they waited there (left out of the results where not asked for: `--per-pod`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_pod: Vec<PodFigures>,
}

/// One pod's share of a run: its requests (routed there to decode), their TTFT, and the
/// prompt tokens it computed (prefill legs included).
#[derive(Clone, Debug, Serialize)]
pub struct PodFigures {
    pub pod: usize,
    pub requests: usize,
    /// Its requests ÷ all requests.
    pub share: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub prefill_tokens: u64,
}

/// `q`-quantile (0–1) of sorted `v`, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The median of `values` (of the two middle ones, their mean); NaN when there are none.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The mean of `values`; `None` when there are none.
fn average(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (n, sum) = values.fold((0usize, 0.0), |(n, sum), v| (n + 1, sum + v));
    (n > 0).then(|| sum / n as f64)
}

/// The TTFTs (seconds) of a run's answered requests, sorted.
fn sorted_ttfts(run: &RunResult) -> Vec<f64> {
    let mut ttft: Vec<f64> =
        run.requests.iter().filter(|r| r.finished.is_some()).filter_map(|r| Some(r.first_token? - r.arrival)).collect();
    ttft.sort_by(f64::total_cmp);
    ttft
}

/// A run's TTFT p90 in milliseconds (its answered requests).
pub fn ttft_p90_ms(run: &RunResult) -> f64 {
    quantile(&sorted_ttfts(run), 0.9) * 1e3
}

impl Summary {
    pub fn of(workload: &str, router: &str, run: &RunResult, decode_pods: &[usize]) -> Summary {
        let done: Vec<_> = run.requests.iter().filter(|r| r.finished.is_some() && r.first_token.is_some()).collect();
        let ttft = sorted_ttfts(run);
        let ttft_p90_ms = quantile(&ttft, 0.9) * 1e3;
        let itl: Vec<f64> = done
            .iter()
            .filter(|r| r.output_tokens > 1)
            .map(|r| (r.finished.unwrap() - r.first_token.unwrap()) / (r.output_tokens - 1) as f64)
            .collect();
        let prompt: usize = done.iter().map(|r| r.prompt_tokens).sum();
        let cached: usize = done.iter().map(|r| r.cached_tokens).sum();
        let predicted: Option<usize> = done.iter().map(|r| r.predicted_cached_tokens).sum();
        let output: usize = done.iter().map(|r| r.output_tokens).sum();
        let per_pod: Vec<PodFigures> = decode_pods
            .iter()
            .map(|&pod| {
                let mut ttft: Vec<f64> =
                    done.iter().filter(|r| r.decode_pod == pod).map(|r| r.first_token.unwrap() - r.arrival).collect();
                ttft.sort_by(f64::total_cmp);
                let requests = run.requests.iter().filter(|r| r.decode_pod == pod).count();
                PodFigures {
                    pod,
                    requests,
                    share: requests as f64 / run.requests.len().max(1) as f64,
                    ttft_p50_ms: quantile(&ttft, 0.5) * 1e3,
                    ttft_p90_ms: quantile(&ttft, 0.9) * 1e3,
                    ttft_p99_ms: quantile(&ttft, 0.99) * 1e3,
                    prefill_tokens: run.prefill_tokens_per_pod.get(pod).copied().unwrap_or(0),
                }
            })
            .collect();
        let most = per_pod.iter().map(|p| p.requests).max().unwrap_or(0);
        let mean = per_pod.iter().map(|p| p.requests).sum::<usize>() as f64 / per_pod.len().max(1) as f64;
        let mean_of = |v: &[f64]| if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 };
        Summary {
            workload: workload.to_string(),
            router: router.to_string(),
            requests: run.requests.len(),
            failed: run.requests.len() - done.len(),
            ttft_mean_ms: mean_of(&ttft) * 1e3,
            ttft_p50_ms: quantile(&ttft, 0.5) * 1e3,
            ttft_p90_ms,
            // One run: its own p90 (`kvgate-cluster-sim` sets the median over its seeds).
            ttft_p90_seed_median_ms: ttft_p90_ms,
            ttft_p99_ms: quantile(&ttft, 0.99) * 1e3,
            itl_mean_ms: mean_of(&itl) * 1e3,
            throughput_tokens_per_s: if run.makespan > 0.0 { output as f64 / run.makespan } else { 0.0 },
            prefix_hit_rate: if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
            predicted_hit_rate: predicted.filter(|_| prompt > 0).map(|p| p as f64 / prompt as f64),
            imbalance: if mean > 0.0 { most as f64 / mean } else { 1.0 },
            peak_inflight: run.peak_inflight,
            preemptions: run.preemptions,
            makespan_s: run.makespan,
            wait_soonest_ms: average(run.signals.iter().filter_map(|s| Some(s.prefill_waits?.soonest * 1e3))),
            wait_mean_ms: average(run.signals.iter().filter_map(|s| Some(s.prefill_waits?.mean * 1e3))),
            kv_cache_usage_mean: average(run.signals.iter().map(|s| s.kv_cache_usage)).unwrap_or(0.0),
            engine_waiting_mean: average(run.signals.iter().map(|s| s.engine_waiting)).unwrap_or(0.0),
            per_pod,
        }
    }
}

/// Milliseconds, readably: 3 significant digits below 100, whole numbers above.
pub fn ms(v: f64) -> String {
    if !v.is_finite() {
        "–".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A Markdown table of one workload's rows, best p90 TTFT in bold.
pub fn table(rows: &[&Summary]) -> String {
    let best = rows.iter().map(|r| r.ttft_p90_ms).fold(f64::INFINITY, f64::min);
    let mut out = String::from(
        "| router | TTFT mean | p50 | p90 | p90, median of seeds | p99 (ms) | ITL (ms) | tokens/s | prefix hits | predicted hits | imbalance | peak in flight on a pod | failed |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let p90 = if r.ttft_p90_ms == best { format!("**{}**", ms(r.ttft_p90_ms)) } else { ms(r.ttft_p90_ms) };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.1} % | {} | {:.2} | {} | {} |\n",
            r.router,
            ms(r.ttft_mean_ms),
            ms(r.ttft_p50_ms),
            p90,
            ms(r.ttft_p90_seed_median_ms),
            ms(r.ttft_p99_ms),
            ms(r.itl_mean_ms),
            r.throughput_tokens_per_s,
            r.prefix_hit_rate * 100.0,
            r.predicted_hit_rate.map_or("–".to_string(), |p| format!("{:.1} %", p * 100.0)),
            r.imbalance,
            r.peak_inflight,
            r.failed
        ));
    }
    out
}

/// A Markdown table of each router's figures per pod: a row per pod (`label` names it, e.g.
/// its shape), a column group per router.
pub fn pod_table(rows: &[&Summary], label: impl Fn(usize) -> String) -> String {
    let mut out = String::from("| pod |");
    let mut rule = String::from("|---|");
    for r in rows {
        out.push_str(&format!(" {0}: requests | {0}: p50 | {0}: p90 (ms) | {0}: prefill tokens |", r.router));
        rule.push_str("---|---|---|---|");
    }
    out.push('\n');
    out.push_str(&rule);
    out.push('\n');
    let pods = rows.first().map_or(0, |r| r.per_pod.len());
    for i in 0..pods {
        out.push_str(&format!("| {} |", label(rows[0].per_pod[i].pod)));
        for r in rows {
            let p = &r.per_pod[i];
            out.push_str(&format!(
                " {} ({:.1} %) | {} | {} | {} |",
                p.requests,
                p.share * 100.0,
                ms(p.ttft_p50_ms),
                ms(p.ttft_p90_ms),
                p.prefill_tokens
            ));
        }
        out.push('\n');
    }
    out
}

pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// An SVG document's opening: white background, the title in bold, then a grey subtitle
/// (`subtitle` is markup, escaped by the caller).
pub(crate) fn svg_open(width: f64, height: f64, title: &str, subtitle: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{}</text>\n\
         <text x=\"10\" y=\"36\" fill=\"#555\">{subtitle}</text>\n",
        escape(title)
    )
}

/// [`svg_bars`] of the summaries' TTFT p50 and p90.
pub fn svg(title: &str, rows: &[&Summary]) -> String {
    let bars: Vec<(String, f64, f64)> = rows.iter().map(|r| (r.router.clone(), r.ttft_p50_ms, r.ttft_p90_ms)).collect();
    svg_bars(title, &bars)
}

/// A horizontal bar chart of (label, TTFT p50 ms, TTFT p90 ms) rows (log scale, so a 100×
/// gap and a 10 % gap both stay readable).
pub fn svg_bars(title: &str, rows: &[(String, f64, f64)]) -> String {
    let (label_w, plot_w, bar_h, gap) = (190.0, 520.0, 11.0, 8.0);
    let top = 48.0;
    let height = top + rows.len() as f64 * (2.0 * bar_h + gap) + 40.0;
    let width = label_w + plot_w + 90.0;
    let values = rows.iter().flat_map(|r| [r.1, r.2]).filter(|v| v.is_finite() && *v > 0.0);
    let hi = values.clone().fold(1.0f64, f64::max).log10().ceil();
    let lo = values.fold(f64::INFINITY, f64::min).max(0.01).log10().floor().min(hi - 1.0);
    let x = |v: f64| label_w + (v.max(10f64.powf(lo)).log10() - lo) / (hi - lo) * plot_w;
    let mut s = svg_open(
        width,
        height,
        title,
        "TTFT, ms (log scale): <tspan fill=\"#4a7bd0\">■ p50</tspan>  <tspan fill=\"#d0704a\">■ p90</tspan>",
    );
    let mut decade = lo;
    while decade <= hi {
        let gx = x(10f64.powf(decade));
        s.push_str(&format!(
            "<line x1=\"{gx:.1}\" y1=\"{top}\" x2=\"{gx:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\n<text x=\"{gx:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{}</text>\n",
            height - 30.0,
            height - 14.0,
            10f64.powf(decade)
        ));
        decade += 1.0;
    }
    for (i, r) in rows.iter().enumerate() {
        let y = top + i as f64 * (2.0 * bar_h + gap);
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            label_w - 8.0,
            y + bar_h + 4.0,
            escape(&r.0)
        ));
        for (j, (v, color)) in [(r.1, "#4a7bd0"), (r.2, "#d0704a")].into_iter().enumerate() {
            if !v.is_finite() {
                continue;
            }
            let by = y + j as f64 * bar_h;
            s.push_str(&format!(
                "<rect x=\"{label_w}\" y=\"{by:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\">{}</text>\n",
                (x(v) - label_w).max(1.0),
                bar_h - 1.0,
                x(v) + 4.0,
                by + bar_h - 2.0,
                ms(v)
            ));
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{RequestRecord, SignalSample};
    use kvgate_routing::router::PrefillWaits;

    #[test]
    fn figures_come_from_the_records() {
        let rec = |arrival: f64, first: f64, finished: f64, out: usize, pod: usize| RequestRecord {
            arrival,
            first_token: Some(first),
            finished: Some(finished),
            prompt_tokens: 100,
            cached_tokens: 50,
            output_tokens: out,
            decode_pod: pod,
            ..Default::default()
        };
        let requests = vec![rec(0.0, 0.1, 1.1, 11, 0), rec(1.0, 1.3, 2.3, 11, 0), rec(2.0, 2.2, 3.0, 1, 1), {
            RequestRecord { arrival: 3.0, rejected: true, ..Default::default() }
        }];
        let run = RunResult {
            peak_inflight: crate::cluster::peak_inflight(&requests, 2),
            requests,
            prefill_tokens_per_pod: vec![700, 50],
            preemptions: 0,
            makespan: 3.0,
            signals: vec![
                SignalSample { kv_cache_usage: 0.2, engine_waiting: 1.0, ..Default::default() },
                SignalSample {
                    prefill_waits: Some(PrefillWaits { soonest: 0.5, mean: 0.75 }),
                    kv_cache_usage: 0.4,
                    engine_waiting: 2.0,
                },
            ],
        };
        let s = Summary::of("w", "r", &run, &[0, 1]);
        assert_eq!(s.peak_inflight, 2, "pod 0's first two overlap from 1.0 to 1.1");
        let waits = (s.wait_soonest_ms, s.wait_mean_ms);
        assert_eq!(waits, (Some(500.0), Some(750.0)), "the sample before speeds were learned left out");
        assert!((s.kv_cache_usage_mean - 0.3).abs() < 1e-9 && (s.engine_waiting_mean - 1.5).abs() < 1e-9);
        assert_eq!((s.requests, s.failed), (4, 1));
        assert!((s.ttft_p50_ms - 200.0).abs() < 1e-9 && (s.ttft_p99_ms - 300.0).abs() < 1e-9);
        assert!((s.itl_mean_ms - 100.0).abs() < 1e-9, "{}", s.itl_mean_ms);
        assert!((s.prefix_hit_rate - 0.5).abs() < 1e-9);
        assert!((s.throughput_tokens_per_s - 23.0 / 3.0).abs() < 1e-9);
        // Requests per pod: 3 on pod 0 (the rejected one included), 1 on pod 1 → 3 / 2.
        assert!((s.imbalance - 1.5).abs() < 1e-9);
        let svg = svg("w <1>", &[&s]);
        assert!(svg.contains("w &lt;1&gt;") && svg.contains("<rect") && svg.ends_with("</svg>\n"));
        assert!(table(&[&s]).contains("| r | 200 | 200 | **300** | 300 | 300 |"));
        assert_eq!(s.ttft_p90_seed_median_ms, s.ttft_p90_ms, "one run: its own p90");
        assert_eq!(ttft_p90_ms(&run), s.ttft_p90_ms);
        assert_eq!((median(&[3.0, 1.0, 2.0]), median(&[4.0, 1.0, 3.0, 2.0])), (2.0, 2.5));
        assert!(median(&[]).is_nan());
        // Per pod: pod 0 decoded 3 of the 4 (two answered, at 100 and 300 ms), pod 1 one.
        let [p0, p1] = &s.per_pod[..] else { panic!("two decoding pods: {:?}", s.per_pod) };
        assert_eq!((p0.pod, p0.requests, p0.prefill_tokens), (0, 3, 700));
        assert!((p0.share - 0.75).abs() < 1e-9 && (p0.ttft_p50_ms - 100.0).abs() < 1e-9);
        assert!((p0.ttft_p90_ms - 300.0).abs() < 1e-9);
        assert_eq!((p1.requests, p1.prefill_tokens), (1, 50));
        assert!((p1.ttft_p90_ms - 200.0).abs() < 1e-9);
        let pods = pod_table(&[&s], |p| format!("pod {p}"));
        assert!(pods.contains("| pod 0 | 3 (75.0 %) | 100 | 300 | 700 |"), "{pods}");
        assert!(pods.contains("| pod 1 | 1 (25.0 %) | 200 | 200 | 50 |"), "{pods}");
    }
}
