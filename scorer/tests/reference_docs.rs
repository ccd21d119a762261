//! `docs/configuration.md` and `docs/metrics.md` are generated from the code — the
//! configuration types' own schemas (defaults, types and doc comments) and the metrics the
//! scorer registers — so that a field or a metric cannot change without its page: these tests
//! render both pages and fail when the committed ones differ. `make docs` rewrites them
//! (`KVGATE_WRITE_DOCS=1`).

use kvgate_route_api::lifecycle::{Counter, NativeSettings, ProxyConfig, WasmSettings};
use kvgate_scorer::config::Config;
use kvgate_scorer::metrics::Metrics;
use serde_json::Value;
use std::path::PathBuf;

fn page(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs").join(name)
}

/// Compares `rendered` with the committed page, or writes it with `KVGATE_WRITE_DOCS=1`.
fn check(name: &str, rendered: &str) {
    let path = page(name);
    if std::env::var_os("KVGATE_WRITE_DOCS").is_some() {
        std::fs::write(&path, rendered).expect("write the page");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "docs/{name} differs from what the code says: run `make docs` and commit it\n--- rendered:\n{rendered}"
    );
}

/// One line of a doc comment's text, for a table cell.
fn cell(text: &str) -> String {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|");
    // Rustdoc links read as plain code here.
    text.replace("[`", "`").replace("`]", "`")
}

/// The rows of a schema: one per field, sections recursed into, at `path`.
struct Walk<'a> {
    defs: &'a Value,
    rows: Vec<[String; 4]>,
    /// Definitions already expanded, and where: a second use refers to the first.
    expanded: Vec<(*const Value, String)>,
}

/// `node` with its `$ref` (or an optional `$ref`) resolved in `defs`; true when it may be
/// absent.
fn resolve<'v>(defs: &'v Value, node: &'v Value) -> (&'v Value, bool) {
    let reference = |n: &'v Value| n["$ref"].as_str().map(|r| &defs[r.trim_start_matches("#/$defs/")]);
    if let Some(def) = reference(node) {
        return (def, false);
    }
    if let Some(options) = node["anyOf"].as_array()
        && let Some(def) = options.iter().find_map(reference)
    {
        return (def, true);
    }
    (node, false)
}

impl<'a> Walk<'a> {
    fn field(&mut self, path: &str, node: &'a Value, default: Option<&'a Value>) {
        let (def, optional) = resolve(self.defs, node);
        let described = node["description"].as_str().or(def["description"].as_str()).unwrap_or_default();
        let default = default.or(node.get("default")).or(def.get("default"));
        let shown = match default {
            Some(Value::Null) | None if optional || node["type"].as_array().is_some() => "absent".to_string(),
            // A tagged enum's default names its variant.
            Some(Value::Object(o)) if o.contains_key("name") => format!("`{}`", o["name"]),
            Some(v) => format!("`{v}`"),
            None => String::new(),
        };
        let nested = def["properties"].is_object() || def["oneOf"].as_array().is_some_and(|v| v[0]["type"] == "object");
        let list = def["type"] == "array" && def["items"].get("$ref").is_some();
        let shown = if shown.is_empty() && !nested && !list { "required".to_string() } else { shown };
        if nested && let Some((_, first)) = self.expanded.iter().find(|(d, _)| std::ptr::eq(*d, def)) {
            let kind = format!("as `{first}`");
            self.rows.push([format!("`{path}`"), kind, shown, cell(described)]);
            return;
        }
        if nested {
            self.expanded.push((def as *const Value, path.to_string()));
        }
        if let Some(properties) = def["properties"].as_object() {
            let kind = if optional { "section (optional)" } else { "section" };
            self.rows.push([format!("`{path}`"), kind.into(), shown, cell(described)]);
            for (name, property) in properties {
                self.field(&format!("{path}.{name}"), property, None);
            }
        } else if let Some(variants) = def["oneOf"].as_array().filter(|v| v.iter().all(|v| v["type"] == "object")) {
            // A tagged enum: the tag picks the variant, whose own fields follow.
            let tag = variants[0]["properties"].as_object().and_then(|p| p.keys().next()).cloned().unwrap_or_default();
            let names: Vec<String> = variants.iter().map(|v| format!("`{}`", v["properties"][&tag]["const"])).collect();
            let kind = format!("`{tag}`: {}", names.join(", ").replace('"', ""));
            self.rows.push([format!("`{path}`"), kind, shown, cell(described)]);
            for variant in variants {
                let value = variant["properties"][&tag]["const"].as_str().unwrap_or_default().to_string();
                for (name, property) in variant["properties"].as_object().into_iter().flatten() {
                    if *name != tag {
                        self.field(&format!("{path}.{name} ({tag}: {value})"), property, None);
                    }
                }
            }
        } else if list {
            self.rows.push([format!("`{path}`"), "list".into(), shown, cell(described)]);
            let (item, _) = resolve(self.defs, &def["items"]);
            for (name, property) in item["properties"].as_object().into_iter().flatten() {
                self.field(&format!("{path}[].{name}"), property, None);
            }
        } else {
            self.rows.push([format!("`{path}`"), cell(&leaf_type(def)), shown, cell(described)]);
        }
    }
}

/// A leaf field's type, in words.
fn leaf_type(def: &Value) -> String {
    if let Some(values) = def["enum"].as_array() {
        return values.iter().map(|v| format!("`{}`", v.as_str().unwrap_or_default())).collect::<Vec<_>>().join(", ");
    }
    if let Some(values) = def["oneOf"].as_array() {
        return values
            .iter()
            .map(|v| format!("`{}`", v["const"].as_str().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(", ");
    }
    let types: Vec<&str> = match &def["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect(),
        _ => vec!["any"],
    };
    match (types.first().copied().unwrap_or("any"), def["format"].as_str()) {
        ("integer", _) if def["minimum"].as_u64() == Some(1) => "integer ≥ 1".to_string(),
        ("integer", Some(f)) if f.starts_with('u') => "integer ≥ 0".to_string(),
        ("array", _) => format!("list of {}", leaf_type(&def["items"])),
        ("object", _) => "map".to_string(),
        (t, _) => t.to_string(),
    }
}

fn table(rows: &[[String; 4]]) -> String {
    let mut out = String::from("| field | type | default | meaning |\n|---|---|---|---|\n");
    for [field, kind, default, meaning] in rows {
        out.push_str(&format!("| {field} | {kind} | {default} | {meaning} |\n"));
    }
    out
}

/// The rows of a struct's fields (top level: no section row).
fn fields_of(schema: &schemars::Schema, prefix: &str) -> Vec<[String; 4]> {
    let root = schema.as_value();
    let mut walk = Walk { defs: &root["$defs"], rows: Vec::new(), expanded: Vec::new() };
    for (name, property) in root["properties"].as_object().into_iter().flatten() {
        walk.field(&format!("{prefix}{name}"), property, None);
    }
    walk.rows
}

fn configuration_md() -> String {
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated from the configuration types (`make docs`; `make test` fails when this page and the code \
         differ). Every field is optional unless it has no default; an unknown field, or a value out of \
         range, refuses the configuration with a message naming the field.\n\n\
         ## The scorer\n\n\
         `kvgate-scorer --config FILE` (YAML; `--check` validates it and exits).\n\n",
    );
    out.push_str(&table(&fields_of(&schemars::schema_for!(Config), "")));
    out.push_str(
        "\n## The Envoy filter\n\n\
         JSON in the filter's configuration (the wasm filter's `plugin_config.configuration`, the native \
         module's `filter_config`); `kvgate-envoy-config` renders it. The shared fields first, then each \
         host's own: a field of the other host is refused.\n\n### Both hosts\n\n",
    );
    out.push_str(&table(&fields_of(&schemars::schema_for!(ProxyConfig), "")));
    out.push_str("\n### The wasm filter's own\n\n");
    out.push_str(&table(&fields_of(&schemars::schema_for!(WasmSettings), "")));
    out.push_str("\n### The native module's own\n\n");
    out.push_str(&table(&fields_of(&schemars::schema_for!(NativeSettings), "")));
    out
}

/// The unit a metric counts in: seconds by Prometheus' naming convention, else as listed,
/// else `1` (a plain count).
fn unit(name: &str) -> &'static str {
    const UNITS: [(&str, &str); 9] = [
        ("prompt_tokens", "tokens"),
        ("cached_tokens", "tokens"),
        ("output_tokens", "tokens"),
        ("cache_tokens", "tokens"),
        ("prefill_tokens", "tokens"),
        ("index_blocks", "blocks"),
        ("slowness", "ratio"),
        ("hit_ratio", "ratio"),
        ("index_size", "entries"),
    ];
    if name.contains("_seconds") {
        return "seconds";
    }
    UNITS.iter().find(|(part, _)| name.contains(part)).map_or("1", |(_, unit)| unit)
}

fn metrics_md() -> String {
    let mut out = String::from(
        "# Metrics reference\n\n\
         Generated from the code (`make docs`; `make test` fails when this page and the code differ).\n\n\
         ## The scorer\n\n\
         Prometheus text on `/metrics` (on `listen`, or on `admin.listen`). Labels carry pod, policy and \
         replica names and fixed words only — never anything from a request. Unit `1`: a plain count.\n\n\
         | metric | type | labels | unit | meaning |\n|---|---|---|---|---|\n",
    );
    for m in Metrics::new().docs() {
        let labels = m.labels.iter().map(|l| format!("`{l}`")).collect::<Vec<_>>().join(", ");
        let name = format!("kvgate_{}", m.name);
        out.push_str(&format!("| `{name}` | {} | {labels} | {} | {} |\n", m.kind, unit(&name), cell(&m.help)));
    }
    out.push_str(
        "\n## The Envoy filter\n\n\
         Counters in Envoy's stats, the same for both hosts: `wasmcustom.kvgate_<name>` from the wasm filter, \
         `kvgate.<name>` from the native module (its bootstrap's `metrics_namespace`). A host counts only \
         what it does (the wasm filter sends prefill legs itself, the native module lets the decode pod \
         prefill).\n\n| name | meaning |\n|---|---|\n",
    );
    let counters = schemars::schema_for!(Counter);
    for variant in counters.as_value()["oneOf"].as_array().into_iter().flatten() {
        let name = variant["const"].as_str().unwrap_or_default();
        assert!(Counter::all().any(|c| c.name() == name), "{name} is exported under another name");
        out.push_str(&format!("| `{name}` | {} |\n", cell(variant["description"].as_str().unwrap_or(""))));
    }
    out
}

#[test]
fn the_configuration_reference_is_current() {
    check("configuration.md", &configuration_md());
}

#[test]
fn the_metrics_reference_is_current() {
    check("metrics.md", &metrics_md());
}
