//! JSON values as block-style YAML. Strings are always double-quoted (JSON's escapes
//! are YAML's), so no string can be read back as a number, a boolean or null; keys are
//! quoted unless they are plain words.

use serde_json::Value;

/// `value` as a YAML document.
pub(super) fn to_string(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Object(map) if !map.is_empty() => mapping(&mut out, map, 0),
        Value::Array(items) if !items.is_empty() => sequence(&mut out, items, 0),
        other => {
            out.push_str(&scalar(other));
            out.push('\n');
        }
    }
    out
}

fn mapping(out: &mut String, map: &serde_json::Map<String, Value>, indent: usize) {
    for (key, value) in map {
        push_indent(out, indent);
        out.push_str(&key_text(key));
        out.push(':');
        nested(out, value, indent);
    }
}

fn sequence(out: &mut String, items: &[Value], indent: usize) {
    for value in items {
        push_indent(out, indent);
        out.push('-');
        nested(out, value, indent);
    }
}

/// The value after `key:` or `-`: inline when it is a scalar or empty, on the next
/// lines, indented, otherwise.
fn nested(out: &mut String, value: &Value, indent: usize) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            out.push('\n');
            mapping(out, map, indent + 2);
        }
        Value::Array(items) if !items.is_empty() => {
            out.push('\n');
            sequence(out, items, indent + 2);
        }
        other => {
            out.push(' ');
            out.push_str(&scalar(other));
            out.push('\n');
        }
    }
}

fn scalar(value: &Value) -> String {
    match value {
        Value::Object(_) => "{}".to_owned(),
        Value::Array(_) => "[]".to_owned(),
        Value::String(text) => quoted(text),
        // JSON's literals and numbers are YAML's.
        other => other.to_string(),
    }
}

fn key_text(key: &str) -> String {
    let plain = key
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !matches!(
            key.to_ascii_lowercase().as_str(),
            "y" | "n" | "yes" | "no" | "on" | "off" | "true" | "false" | "null"
        );
    if plain { key.to_owned() } else { quoted(key) }
}

/// A double-quoted YAML scalar: JSON's escapes, and `\u` escapes for what JSON leaves
/// as is but YAML does not (C1 controls, which YAML forbids, and the line and paragraph
/// separators and the byte order mark, which YAML readers take for breaks).
fn quoted(text: &str) -> String {
    let json = Value::String(text.to_owned()).to_string();
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if matches!(
            c,
            '\u{80}'..='\u{9f}' | '\u{2028}' | '\u{2029}' | '\u{feff}'
        ) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

fn push_indent(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn nested_values_are_indented_and_strings_quoted() {
        let value = json!({
            "asyncapi": "3.0.0",
            "info": { "title": "orders: \"v1\"", "version": "1" },
            "list": [1, "two", { "three": true, "empty": {} }, []],
            "$ref": "#/x",
            "on": null,
            "odd": "nel\u{85} ls\u{2028} bom\u{feff} é",
        });
        insta::assert_snapshot!(super::to_string(&value));
    }
}
