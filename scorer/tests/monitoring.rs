//! The Grafana dashboard and the Prometheus alerts shipped in `deploy/monitoring`, and the
//! autoscaling examples of `deploy/autoscaling`, ask only for what the scorer exports: every PromQL expression parses, every metric it selects is
//! registered by the scorer (a histogram through its `_bucket`, `_sum` or `_count` series),
//! and every label it matches, groups by or prints is a label of those metrics (or `le`, or a
//! label Prometheus adds to every target). Renaming a metric or a label without updating
//! them fails here; so does a typo, as the last test shows.

use kvgate_scorer::metrics::{MetricDoc, Metrics};
use promql_parser::parser::{self, Expr, LabelModifier, VectorSelector};
use promql_parser::util::{ExprVisitor, walk_expr};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Labels Prometheus gives every scraped series, whatever the target exports.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

fn monitoring(file: &str) -> String {
    deployed(&format!("monitoring/{file}"))
}

fn deployed(file: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What one expression selects and uses.
#[derive(Default)]
struct Uses {
    /// Metric names as selected (`kvgate_x_bucket` as written).
    metrics: Vec<String>,
    /// Label names matched in selectors, with the metric they were matched on.
    matched: Vec<(String, String)>,
}

impl ExprVisitor for Uses {
    type Error = String;

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, String> {
        if let Some(vs) = selector(expr) {
            let name = vs.name.clone().ok_or("a selector without a metric name")?;
            for m in vs.matchers.matchers.iter().chain(vs.matchers.or_matchers.iter().flatten()) {
                self.matched.push((name.clone(), m.name.clone()));
            }
            self.metrics.push(name);
        }
        Ok(true)
    }
}

fn selector(expr: &Expr) -> Option<&VectorSelector> {
    match expr {
        Expr::VectorSelector(vs) => Some(vs),
        Expr::MatrixSelector(ms) => Some(&ms.vs),
        _ => None,
    }
}

/// The scorer's metric a selected series belongs to.
fn exported<'a>(docs: &'a [MetricDoc], series: &str) -> Option<&'a MetricDoc> {
    let find = |name: &str| docs.iter().find(|d| format!("kvgate_{}", d.name) == name);
    find(series).or_else(|| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| series.strip_suffix(s))
            .find_map(find)
            .filter(|d| d.kind == "histogram")
    })
}

/// The labels the series of `expr` carry, as far as PromQL lets them through: a selector's
/// metric labels (and the target's), an aggregation's `by` labels (or its input's less the
/// `without` ones; none for a plain `sum`), a function's or a binary operation's vector
/// input's (`histogram_quantile` drops `le`). Grouping by a label the input lacks is a
/// problem.
fn flow(docs: &[MetricDoc], expr: &Expr, out: &mut Vec<String>) -> BTreeSet<String> {
    if let Some(vs) = selector(expr) {
        let mut labels: BTreeSet<String> = TARGET_LABELS.iter().map(|l| l.to_string()).collect();
        let name = vs.name.clone().unwrap_or_default();
        if let Some(doc) = exported(docs, &name) {
            labels.extend(doc.labels.iter().cloned());
            if name.ends_with("_bucket") {
                labels.insert("le".into());
            }
        }
        return labels;
    }
    match expr {
        Expr::Aggregate(a) => {
            let input = flow(docs, &a.expr, out);
            match &a.modifier {
                Some(LabelModifier::Include(by)) => {
                    for label in by.labels.iter().filter(|l| !input.contains(*l)) {
                        out.push(format!("grouped by {label}, which its input has no label of"));
                    }
                    by.labels.iter().cloned().collect()
                }
                Some(LabelModifier::Exclude(without)) => {
                    input.into_iter().filter(|l| !without.labels.contains(l)).collect()
                }
                None if ["topk", "bottomk", "limitk"].contains(&a.op.to_string().as_str()) => input,
                None => BTreeSet::new(),
            }
        }
        Expr::Binary(b) => {
            let (lhs, rhs) = (flow(docs, &b.lhs, out), flow(docs, &b.rhs, out));
            let vector = |e: &Expr| !matches!(e, Expr::NumberLiteral(_));
            if vector(&b.lhs) { lhs } else { rhs }
        }
        Expr::Call(c) => {
            let mut labels =
                c.args.args.iter().map(|a| flow(docs, a, out)).max_by_key(BTreeSet::len).unwrap_or_default();
            if c.func.name == "histogram_quantile" {
                labels.remove("le");
            }
            labels
        }
        Expr::Paren(p) => flow(docs, &p.expr, out),
        Expr::Unary(u) => flow(docs, &u.expr, out),
        Expr::Subquery(q) => flow(docs, &q.expr, out),
        _ => BTreeSet::new(),
    }
}

/// What is wrong with one expression; `printed` are the labels its legend or annotations
/// print. Empty when it asks only for what the scorer exports.
fn problems(docs: &[MetricDoc], expr: &str, printed: &[String]) -> Vec<String> {
    let ast = match parser::parse(expr) {
        Ok(ast) => ast,
        Err(e) => return vec![format!("does not parse: {e}")],
    };
    let mut uses = Uses::default();
    if let Err(e) = walk_expr(&mut uses, &ast) {
        return vec![e];
    }
    let mut out = Vec::new();
    for series in &uses.metrics {
        if exported(docs, series).is_none() {
            out.push(format!("{series} is not a metric the scorer exports"));
        }
    }
    for (series, label) in &uses.matched {
        let Some(doc) = exported(docs, series) else { continue };
        let bucket_bound = label == "le" && series.ends_with("_bucket");
        if !(doc.labels.contains(label) || TARGET_LABELS.contains(&label.as_str()) || bucket_bound) {
            out.push(format!("{series} has no label {label}"));
        }
    }
    let labels = flow(docs, &ast, &mut out);
    for label in printed.iter().filter(|l| !labels.contains(*l)) {
        out.push(format!("prints the label {label}, which the result has not"));
    }
    out
}

/// The label names a Grafana legend (`{{pod}}`) or an alert template (`{{ $labels.pod }}`)
/// prints.
fn printed_labels(template: &str) -> Vec<String> {
    template
        .split("{{")
        .skip(1)
        .filter_map(|s| s.split_once("}}"))
        .map(|(inner, _)| inner.trim().trim_start_matches("$labels.").to_string())
        .collect()
}

fn dashboard_queries() -> Vec<(String, String, Vec<String>)> {
    let dashboard: Value = serde_json::from_str(&monitoring("grafana-dashboard.json")).expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap().replace("$__rate_interval", "5m");
            let printed = printed_labels(target["legendFormat"].as_str().unwrap_or(""));
            out.push((panel["title"].as_str().unwrap().to_string(), expr, printed));
        }
    }
    out
}

fn alert_rules() -> Vec<(String, String, Vec<String>)> {
    let rules: Value = serde_saphyr::from_str(&monitoring("alerts.yaml")).expect("the alerts are YAML");
    let mut out = Vec::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let annotations = rule["annotations"].as_object().into_iter().flatten();
            let printed = annotations.flat_map(|(_, text)| printed_labels(text.as_str().unwrap())).collect();
            out.push((
                rule["alert"].as_str().unwrap().to_string(),
                rule["expr"].as_str().unwrap().to_string(),
                printed,
            ));
        }
    }
    out
}

/// Every problem of every (name, query, printed labels), named.
fn all_problems(queries: &[(String, String, Vec<String>)]) -> Vec<String> {
    let metrics = Metrics::new();
    queries
        .iter()
        .flat_map(|(name, expr, printed)| {
            problems(metrics.docs(), expr, printed).into_iter().map(move |p| format!("{name}: {p}"))
        })
        .collect()
}

#[test]
fn the_dashboard_queries_only_exported_metrics_and_labels() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "the dashboard's queries were found: {}", queries.len());
    let wrong = all_problems(&queries);
    assert!(wrong.is_empty(), "the dashboard asks for what the scorer does not export:\n{}", wrong.join("\n"));
    // What the issue asks the dashboard to show, each on some panel.
    let all: String = queries.iter().map(|(_, e, _)| e.as_str()).collect();
    for metric in [
        "kvgate_decisions_total",
        "kvgate_route_errors_total",
        "kvgate_routed_cached_tokens_total",
        "kvgate_decision_seconds_bucket",
        "kvgate_admission_waiting",
        "kvgate_kv_event_gaps_total",
        "kvgate_pod_healthy",
        "kvgate_sync_lag_seconds_bucket",
        "kvgate_pool_predicted_wait_seconds",
        "kvgate_pool_kv_cache_usage",
    ] {
        assert!(all.contains(metric), "no panel shows {metric}");
    }
}

#[test]
fn the_alerts_use_only_exported_metrics_and_labels() {
    let rules = alert_rules();
    assert!(rules.len() >= 8, "the alert rules were found: {}", rules.len());
    let wrong = all_problems(&rules);
    assert!(wrong.is_empty(), "the alerts ask for what the scorer does not export:\n{}", wrong.join("\n"));
}

/// The KEDA triggers' queries, and the HPA's external metric as the selector it stands for.
fn autoscaling_queries() -> Vec<(String, String, Vec<String>)> {
    let keda: Value = serde_saphyr::from_str(&deployed("autoscaling/keda-scaledobject.yaml")).expect("YAML");
    let mut out: Vec<(String, String, Vec<String>)> = (keda["spec"]["triggers"].as_array().unwrap().iter())
        .map(|t| (format!("KEDA {}", t["name"]), t["metadata"]["query"].as_str().unwrap().to_string(), vec![]))
        .collect();
    let hpa: Value = serde_saphyr::from_str(&deployed("autoscaling/hpa.yaml")).expect("YAML");
    for metric in hpa["spec"]["metrics"].as_array().unwrap() {
        let external = &metric["external"]["metric"];
        let labels = external["selector"]["matchLabels"].as_object().into_iter().flatten();
        let matchers: Vec<String> = labels.map(|(k, v)| format!("{k}={v}")).collect();
        out.push(("HPA".into(), format!("{}{{{}}}", external["name"].as_str().unwrap(), matchers.join(",")), vec![]));
    }
    out
}

#[test]
fn the_autoscaling_examples_scale_on_exported_metrics() {
    let queries = autoscaling_queries();
    assert_eq!(queries.len(), 4, "{queries:?}");
    let wrong = all_problems(&queries);
    assert!(
        wrong.is_empty(),
        "the autoscaling examples ask for what the scorer does not export:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_catches_a_misspelt_metric_a_foreign_label_and_bad_promql() {
    let metrics = Metrics::new();
    let docs = metrics.docs();
    assert!(problems(docs, "sum by (pod) (rate(kvgate_decisions_total[5m]))", &["pod".into()]).is_empty());
    assert!(
        problems(docs, "histogram_quantile(0.99, sum by (le) (rate(kvgate_decision_seconds_bucket[5m])))", &[])
            .is_empty()
    );
    for (expr, printed, why) in [
        ("rate(kvgate_decision_total[5m])", "", "not a metric"),
        ("sum by (model) (rate(kvgate_decisions_total[5m]))", "", "grouped by model"),
        ("kvgate_pod_healthy{region=\"eu\"}", "", "no label region"),
        ("rate(kvgate_decisions_total_bucket[5m])", "", "not a metric"),
        ("sum(rate(kvgate_decisions_total[5m])", "", "does not parse"),
        ("sum(kvgate_pod_healthy)", "{{ $labels.pod }}", "prints the label pod"),
    ] {
        let found = problems(docs, expr, &printed_labels(printed));
        assert!(found.iter().any(|p| p.contains(why)), "{expr}: expected '{why}', got {found:?}");
    }
}
