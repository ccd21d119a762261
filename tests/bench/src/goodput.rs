//! Goodput at an SLO: the highest offered load a router carries before its p90 TTFT breaks
//! the SLO, read off a sweep of the offered load — the figure that says how many GPUs a
//! fleet needs.

use crate::report::{escape, ms, svg_open};
use serde::Serialize;

/// One point of a sweep: the load offered (requests per second, or a burst's size) and the
/// p90 TTFT it got.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Point {
    pub offered: f64,
    pub ttft_p90_ms: f64,
}

/// Where the p90 TTFT first crossed the SLO.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Goodput {
    /// Over the SLO already at the sweep's lightest point (its offered load).
    Below(f64),
    /// Crossed between two points; linearly interpolated.
    At(f64),
    /// Within the SLO at every point (the heaviest one's offered load).
    AtLeast(f64),
}

impl Goodput {
    /// A number to rank and divide by: the bound where there is only a bound.
    pub fn value(self) -> f64 {
        match self {
            Goodput::Below(v) | Goodput::At(v) | Goodput::AtLeast(v) => v,
        }
    }

    pub fn label(self) -> String {
        let n = |v: f64| if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.1}") };
        match self {
            Goodput::Below(v) => format!("< {}", n(v)),
            Goodput::At(v) => n(v),
            Goodput::AtLeast(v) => format!("≥ {}", n(v)),
        }
    }
}

/// `a ÷ b` as far as the sweep knows it: `≥` where it is only a lower bound, `≤` where only
/// an upper one, `?` where the bounds point both ways.
pub fn ratio(a: Goodput, b: Goodput) -> String {
    use Goodput::*;
    if b.value() <= 0.0 {
        return "?".into();
    }
    let r = a.value() / b.value();
    match (a, b) {
        (At(_), At(_)) => format!("{r:.2}×"),
        (At(_) | AtLeast(_), At(_) | Below(_)) => format!("≥ {r:.2}×"),
        (At(_) | Below(_), At(_) | AtLeast(_)) => format!("≤ {r:.2}×"),
        _ => "?".into(),
    }
}

/// A point over the SLO (NaN — nothing finished — is over).
pub fn over(p: &Point, slo_ms: f64) -> bool {
    p.ttft_p90_ms.is_nan() || p.ttft_p90_ms > slo_ms
}

/// The last point within the SLO and the first over it, by offered load (any order in):
/// where the goodput lies. Points past the first one over are ignored (a lucky heavier
/// point does not count).
pub fn bracket(points: &[Point], slo_ms: f64) -> (Option<Point>, Option<Point>) {
    let mut sorted = points.to_vec();
    sorted.sort_by(|a, b| a.offered.total_cmp(&b.offered));
    match sorted.iter().position(|p| over(p, slo_ms)) {
        None => (sorted.last().copied(), None),
        Some(0) => (None, Some(sorted[0])),
        Some(i) => (Some(sorted[i - 1]), Some(sorted[i])),
    }
}

/// The goodput of a sweep's points at `slo_ms`: the load where the p90 TTFT first exceeds
/// the SLO, interpolated on the log of the p90 (which grows about exponentially towards
/// saturation) between the last point within it and the first over it.
pub fn goodput(points: &[Point], slo_ms: f64) -> Goodput {
    match bracket(points, slo_ms) {
        (None, None) => Goodput::Below(0.0),
        (Some(a), None) => Goodput::AtLeast(a.offered),
        (None, Some(b)) => Goodput::Below(b.offered),
        (Some(a), Some(b)) => {
            let f = if b.ttft_p90_ms.is_finite() && a.ttft_p90_ms > 0.0 {
                (slo_ms / a.ttft_p90_ms).ln() / (b.ttft_p90_ms / a.ttft_p90_ms).ln()
            } else {
                0.0
            };
            Goodput::At(a.offered + f.clamp(0.0, 1.0) * (b.offered - a.offered))
        }
    }
}

/// Line colours, one per router in order (distinguishable, colour-blind safe first).
const COLORS: [&str; 10] =
    ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#999999", "#8c564b", "#000000", "#f0e442"];

/// p90 TTFT (log scale) against offered load, one line per router, the SLO dashed: the
/// standard picture of serving papers. Points over 1,000× the SLO are clipped to the top.
pub fn svg_curves(title: &str, x_label: &str, slo_ms: f64, series: &[(String, Vec<Point>)]) -> String {
    let (left, top, plot_w, plot_h, legend_w) = (70.0, 50.0, 560.0, 340.0, 200.0);
    let (width, height) = (left + plot_w + legend_w, top + plot_h + 60.0);
    let all = || series.iter().flat_map(|(_, ps)| ps.iter());
    let x_max = all().map(|p| p.offered).fold(0.0, f64::max).max(1e-9);
    let finite = || all().map(|p| p.ttft_p90_ms).filter(|v| v.is_finite() && *v > 0.0);
    let y_hi = finite().fold(slo_ms, f64::max).min(slo_ms * 1e3).log10().ceil();
    let y_lo = finite().fold(slo_ms, f64::min).log10().floor().min(y_hi - 1.0);
    let x = |v: f64| left + v / x_max * plot_w;
    let y = |v: f64| {
        let v = if v.is_finite() { v.clamp(10f64.powf(y_lo), 10f64.powf(y_hi)) } else { 10f64.powf(y_hi) };
        top + plot_h - (v.log10() - y_lo) / (y_hi - y_lo) * plot_h
    };
    let subtitle = format!("p90 TTFT, ms (log scale) against {}; dashed: the SLO ({} ms)", escape(x_label), ms(slo_ms));
    let mut s = svg_open(width, height, title, &subtitle);
    let mut decade = y_lo;
    while decade <= y_hi {
        let gy = y(10f64.powf(decade));
        s.push_str(&format!(
            "<line x1=\"{left}\" y1=\"{gy:.1}\" x2=\"{:.1}\" y2=\"{gy:.1}\" stroke=\"#ddd\"/>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#555\">{}</text>\n",
            left + plot_w,
            left - 6.0,
            gy + 4.0,
            10f64.powf(decade)
        ));
        decade += 1.0;
    }
    for i in 0..=4 {
        let v = x_max * f64::from(i) / 4.0;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{}</text>\n",
            x(v),
            top + plot_h + 18.0,
            if x_max >= 40.0 { format!("{v:.0}") } else { format!("{v:.1}") }
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n<rect x=\"{left}\" y=\"{top}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#888\"/>\n",
        left + plot_w / 2.0,
        top + plot_h + 40.0,
        escape(x_label)
    ));
    let sy = y(slo_ms);
    s.push_str(&format!(
        "<line x1=\"{left}\" y1=\"{sy:.1}\" x2=\"{:.1}\" y2=\"{sy:.1}\" stroke=\"#c00\" stroke-dasharray=\"6 4\"/>\n",
        left + plot_w
    ));
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut sorted = points.clone();
        sorted.sort_by(|a, b| a.offered.total_cmp(&b.offered));
        let path: Vec<String> = sorted.iter().map(|p| format!("{:.1},{:.1}", x(p.offered), y(p.ttft_p90_ms))).collect();
        let width = if i == 0 { 2.5 } else { 1.5 };
        s.push_str(&format!(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\"/>\n",
            path.join(" ")
        ));
        for p in &sorted {
            s.push_str(&format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{color}\"/>\n",
                x(p.offered),
                y(p.ttft_p90_ms)
            ));
        }
        let ly = top + 10.0 + i as f64 * 18.0;
        let lx = left + plot_w + 16.0;
        s.push_str(&format!(
            "<line x1=\"{lx}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"{width}\"/>\n<text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n",
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            escape(name)
        ));
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points(v: &[(f64, f64)]) -> Vec<Point> {
        v.iter().map(|&(offered, ttft_p90_ms)| Point { offered, ttft_p90_ms }).collect()
    }

    #[test]
    fn goodput_is_where_the_p90_first_crosses_the_slo() {
        // Unsorted on purpose; 100 ms is half way from 50 to 200 ms on a log scale: 30 req/s.
        let sweep = points(&[(40.0, 200.0), (10.0, 30.0), (20.0, 50.0), (80.0, 20.0)]);
        assert_eq!(goodput(&sweep, 100.0), Goodput::At(30.0), "the lucky point at 80 req/s is past the crossing");
        assert_eq!(bracket(&sweep, 100.0), (Some(sweep[2]), Some(sweep[0])));
        assert_eq!(goodput(&sweep, 10.0), Goodput::Below(10.0));
        assert_eq!(goodput(&sweep, 500.0), Goodput::AtLeast(80.0));
        assert_eq!(goodput(&points(&[(10.0, 30.0), (20.0, f64::NAN)]), 100.0), Goodput::At(10.0));
        assert_eq!(Goodput::At(30.0).label(), "30.0");
        assert_eq!(Goodput::AtLeast(180.0).label(), "≥ 180");
        assert_eq!(ratio(Goodput::At(30.0), Goodput::At(20.0)), "1.50×");
        assert_eq!(ratio(Goodput::At(30.0), Goodput::Below(10.0)), "≥ 3.00×");
        assert_eq!(ratio(Goodput::AtLeast(40.0), Goodput::At(20.0)), "≥ 2.00×");
        assert_eq!(ratio(Goodput::Below(10.0), Goodput::At(20.0)), "≤ 0.50×");
        assert_eq!(ratio(Goodput::AtLeast(40.0), Goodput::AtLeast(40.0)), "?");
        assert_eq!(ratio(Goodput::Below(10.0), Goodput::Below(10.0)), "?");
    }

    #[test]
    fn the_plot_has_a_line_per_router_and_the_slo() {
        let svg = svg_curves(
            "chat <8 pods>",
            "req/s",
            100.0,
            &[("kv".into(), points(&[(10.0, 30.0), (20.0, 90.0)])), ("rr".into(), points(&[(10.0, 80.0)]))],
        );
        assert!(svg.contains("chat &lt;8 pods&gt;") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("stroke-dasharray"));
    }
}
