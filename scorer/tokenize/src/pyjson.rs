//! JSON text exactly as Python's `json.dumps(x, ensure_ascii=False)` writes it.
//!
//! Chat templates call `tojson` on tool definitions and tool-call arguments, and the
//! rendered text is tokenized, so every separator and escape changes the token ids. HF
//! transformers registers `tojson` as `json.dumps(..., ensure_ascii=False)`: separators
//! `", "` and `": "` (or `","` with `indent`), keys in insertion order, no HTML escaping,
//! non-ASCII characters written as they are. minijinja's built-in `tojson` differs on all of
//! these, so templates get this one instead.

use serde_json::Value;
use std::fmt::Write;

/// Serialises `value` like Python's `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub fn dumps(value: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_value(&mut out, value, indent, 0);
    out
}

fn write_value(out: &mut String, value: &Value, indent: Option<usize>, depth: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separator(out, i, indent, depth + 1);
                write_value(out, item, indent, depth + 1);
            }
            closing(out, indent, depth);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                separator(out, i, indent, depth + 1);
                write_string(out, key);
                out.push_str(": ");
                write_value(out, item, indent, depth + 1);
            }
            closing(out, indent, depth);
            out.push('}');
        }
    }
}

/// Item separator: `", "` inline; with an indent, `","` then a newline and the indentation.
fn separator(out: &mut String, index: usize, indent: Option<usize>, depth: usize) {
    match indent {
        None if index > 0 => out.push_str(", "),
        None => {}
        Some(width) => {
            if index > 0 {
                out.push(',');
            }
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * depth));
        }
    }
}

fn closing(out: &mut String, indent: Option<usize>, depth: usize) {
    if let Some(width) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', width * depth));
    }
}

/// Python writes integers as they are and floats with `repr`: `1.0`, `0.1`, `1e+20`.
fn write_number(out: &mut String, n: &serde_json::Number) {
    if n.is_f64() {
        let f = n.as_f64().unwrap_or_default();
        if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
            let _ = write!(out, "{f:.1}");
        } else if f.abs() >= 1e16 || (f != 0.0 && f.abs() < 1e-4) {
            // Python's repr switches to exponent notation with a signed, 2-digit exponent.
            let s = format!("{f:e}");
            let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            let _ = write!(out, "{mantissa}e{sign}{digits:0>2}");
        } else {
            let _ = write!(out, "{f}");
        }
    } else {
        let _ = write!(out, "{n}");
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_separators_and_order() {
        let v = json!({"name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit"]}});
        assert_eq!(
            dumps(&v, None),
            r#"{"name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit"]}}"#
        );
    }

    #[test]
    fn no_html_escaping_and_raw_unicode() {
        let v = json!({"q": "<b>&'café' 😀\n\u{1}"});
        assert_eq!(dumps(&v, None), "{\"q\": \"<b>&'café' 😀\\n\\u0001\"}");
    }

    #[test]
    fn numbers_like_python() {
        assert_eq!(dumps(&json!([1, -2, 1.0, 0.5, 1e20, 1.5e-7]), None), "[1, -2, 1.0, 0.5, 1e+20, 1.5e-07]");
    }

    #[test]
    fn indent_like_python() {
        let v = json!({"a": [1, 2], "b": {}});
        assert_eq!(dumps(&v, Some(2)), "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}");
    }
}
