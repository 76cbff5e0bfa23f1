//! What changed between two contract documents, and which changes break consumers.
//!
//! Events are matched by destination and event type. A change breaks consumers when
//! messages already published, or consumers already deployed, no longer fit:
//!
//! | change | verdict |
//! | --- | --- |
//! | an event type or a destination removed, an event type moved to another destination | breaking |
//! | a field removed or renamed | breaking, unless the version was bumped |
//! | a field's type changed | breaking, unless the version was bumped |
//! | an optional field made required, a new required field | breaking, unless the version was bumped |
//! | any other change to a schema (enum values, formats, bounds) | breaking, unless the version was bumped |
//! | the key changed | breaking |
//! | the version went down, or was removed | breaking |
//! | a new event type, a new optional field | compatible |
//! | a schema changed together with a version bump | compatible |
//! | the content type changed | breaking |
//!
//! An Avro event's schema is compared by Avro's schema resolution instead, and any change
//! to its fingerprint is breaking for outbox consumers (`contract/avro.rs`); a Protobuf
//! event's by field numbers (a number reused is breaking, `contract/protobuf.rs`); both
//! with the same version-bump rule.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use serde_json::Value;

/// One difference between the baseline and the current contract.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Change {
    /// Whether the change breaks consumers.
    pub breaking: bool,
    /// The event type and destination (`OrderConfirmed` on `orders.events`).
    pub event: String,
    /// What changed.
    pub what: String,
}

/// The changes from a baseline to the current contract; its `Display` is the readable
/// diff [`super::assert_compatible`] prints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    changes: Vec<Change>,
}

impl Report {
    /// Every change, breaking ones first.
    pub fn changes(&self) -> &[Change] {
        &self.changes
    }

    /// Whether any change breaks consumers.
    pub fn is_breaking(&self) -> bool {
        self.changes.iter().any(|c| c.breaking)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.changes {
            let mark = if c.breaking {
                "- breaking:  "
            } else {
                "+ compatible:"
            };
            writeln!(f, "  {mark} {}: {}", c.event, c.what)?;
        }
        Ok(())
    }
}

/// Compares two AsyncAPI documents written by [`super::asyncapi`]: `baseline`, the
/// published one, and `current`.
pub fn check(baseline: &Value, current: &Value) -> Report {
    let old = events(baseline);
    let new = events(current);
    let mut changes = Vec::new();
    let new_destinations: BTreeSet<&str> = new.keys().map(|(d, _)| d.as_str()).collect();
    // Destinations that are gone, with the event types they carried.
    let mut gone: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut moved_to: HashSet<(String, String)> = HashSet::new();
    for ((destination, event_type), before) in &old {
        let label = format!("`{event_type}` on `{destination}`");
        if let Some(after) = new.get(&(destination.clone(), event_type.clone())) {
            compare_event(&label, before, after, baseline, current, &mut changes);
            continue;
        }
        let elsewhere = new
            .keys()
            .find(|(d, t)| t == event_type && !old.contains_key(&(d.clone(), t.clone())))
            .map(|(d, _)| d);
        let destination_gone = !new_destinations.contains(destination.as_str());
        if destination_gone {
            let note = if elsewhere.is_some() { " (moved)" } else { "" };
            gone.entry(destination)
                .or_default()
                .push(format!("`{event_type}`{note}"));
        }
        match elsewhere {
            Some(d) => {
                moved_to.insert((d.clone(), event_type.clone()));
                changes.push(Change {
                    breaking: true,
                    event: label,
                    what: format!(
                        "moved to destination `{d}`: consumers of `{destination}` no longer get it"
                    ),
                });
            }
            None if destination_gone => {} // reported with its destination
            None => changes.push(Change {
                breaking: true,
                event: label,
                what: "was removed".to_owned(),
            }),
        }
    }
    for (destination, types) in gone {
        changes.push(Change {
            breaking: true,
            event: format!("destination `{destination}`"),
            what: format!("was removed, with its event types {}", types.join(", ")),
        });
    }
    for (destination, event_type) in new.keys() {
        if !old.contains_key(&(destination.clone(), event_type.clone()))
            && !moved_to.contains(&(destination.clone(), event_type.clone()))
        {
            changes.push(Change {
                breaking: false,
                event: format!("`{event_type}` on `{destination}`"),
                what: "new event type".to_owned(),
            });
        }
    }
    changes.sort_by_key(|c| !c.breaking);
    Report { changes }
}

/// An event type as a document describes it.
struct Event<'a> {
    version: Option<i64>,
    key: Option<&'a str>,
    payload: Option<&'a Value>,
    /// The message's `contentType`, else the document's `defaultContentType`.
    content_type: Option<&'a str>,
    /// `x-outbox-schema: opaque`: a payload whose codec has no schema here.
    opaque: bool,
}

/// The events of a document, by destination and event type.
fn events(document: &Value) -> BTreeMap<(String, String), Event<'_>> {
    let mut out = BTreeMap::new();
    let Some(Value::Object(channels)) = document.get("channels") else {
        return out;
    };
    for (id, channel) in channels {
        let address = channel
            .get("address")
            .and_then(Value::as_str)
            .unwrap_or(id)
            .to_owned();
        let Some(Value::Object(messages)) = channel.get("messages") else {
            continue;
        };
        for message in messages.values() {
            let message = resolve(document, message);
            let event_type = message
                .get("x-outbox-event-type")
                .or_else(|| message.get("name"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            out.insert(
                (address.clone(), event_type),
                Event {
                    version: message.get("x-outbox-version").and_then(Value::as_i64),
                    key: message.get("x-outbox-key").and_then(Value::as_str),
                    payload: message.get("payload"),
                    content_type: message
                        .get("contentType")
                        .or_else(|| document.get("defaultContentType"))
                        .and_then(Value::as_str),
                    opaque: message.get("x-outbox-schema").and_then(Value::as_str)
                        == Some("opaque"),
                },
            );
        }
    }
    out
}

fn compare_event(
    label: &str,
    before: &Event<'_>,
    after: &Event<'_>,
    baseline: &Value,
    current: &Value,
    changes: &mut Vec<Change>,
) {
    let mut push = |breaking: bool, what: String| {
        changes.push(Change {
            breaking,
            event: label.to_owned(),
            what,
        })
    };
    let same_type = |a: Option<&str>, b: Option<&str>| {
        let norm = |c: Option<&str>| {
            c.map(|c| {
                c.split(';')
                    .map(|part| part.trim().to_ascii_lowercase())
                    .filter(|part| !part.is_empty())
                    .collect::<Vec<_>>()
            })
        };
        norm(a) == norm(b)
    };
    if !same_type(before.content_type, after.content_type) {
        let show = |c: Option<&str>| c.map_or("none".to_owned(), |c| format!("`{c}`"));
        push(
            true,
            format!(
                "the content type changed from {} to {}: consumers decode by it, so every consumer must read the new format first (a new event type lets both live side by side)",
                show(before.content_type),
                show(after.content_type)
            ),
        );
    }
    if before.key != after.key {
        let show = |k: Option<&str>| k.map_or("no key".to_owned(), |k| format!("`{k}`"));
        push(
            true,
            format!(
                "the key changed from {} to {}: the order consumers rely on, and where each event lands, change with it",
                show(before.key),
                show(after.key)
            ),
        );
    }
    let bumped = match (before.version, after.version) {
        (Some(a), Some(b)) if b < a => {
            push(true, format!("the version went down from {a} to {b}"));
            false
        }
        (Some(a), None) => {
            push(true, format!("lost its version ({a})"));
            false
        }
        (Some(a), Some(b)) => b > a,
        (None, Some(_)) => true,
        (None, None) => false,
    };
    let (old, new) = match (before.payload, after.payload) {
        (Some(old), Some(new)) => (old, new),
        (Some(old), None) if after.opaque => {
            let why = if proto_schema(old).is_some() {
                " (a Protobuf event's `.proto` is written only while every field is a scalar or a map of scalars and protoc would take it: a message, enumeration or oneof field was likely added, or a name or tag protoc refuses)"
            } else {
                ""
            };
            let what = format!(
                "its payload has no schema in the document any more (opaque){why}: what changed cannot be checked"
            );
            // A version bump allows it, as for every schema.
            match after.version {
                Some(version) if bumped => push(
                    false,
                    format!("{what} (allowed: the version went to {version})"),
                ),
                _ => push(
                    true,
                    format!(
                        "{what}; check it by hand, then bump the version or accept the new baseline"
                    ),
                ),
            }
            return;
        }
        (Some(_), None) => {
            push(true, "has no payload schema any more".to_owned());
            return;
        }
        (None, _) => return,
    };
    let found = match (
        (avro_schema(old), avro_schema(new)),
        (proto_schema(old), proto_schema(new)),
    ) {
        ((Some(old), Some(new)), _) => super::avro::compare(old, new),
        (_, (Some(old), Some(new))) => super::protobuf::compare(old, new),
        ((None, None), (None, None)) => {
            let mut schema = Schemas {
                baseline,
                current,
                visited: HashSet::new(),
                found: Vec::new(),
            };
            schema.compare("", old, new);
            schema.found
        }
        // One side Avro or Protobuf, the other not (the content type most likely
        // changed too).
        _ => vec![(
            true,
            format!(
                "the payload's schema format changed from {} to {}",
                schema_format(old),
                schema_format(new)
            ),
        )],
    };
    let version_note = match (before.version, after.version) {
        (a, Some(b)) if bumped => format!(
            " (allowed: the version went from {} to {b})",
            a.map_or("none".to_owned(), |a| a.to_string())
        ),
        _ => String::new(),
    };
    for (breaking, what) in found {
        if breaking && bumped {
            push(false, format!("{what}{version_note}"));
        } else {
            push(breaking, what);
        }
    }
}

/// The schema of a payload that AsyncAPI's multi-format schema object gives in a format
/// whose `schemaFormat` starts with `format` (case aside).
fn schema_of<'v>(payload: &'v Value, format: &str) -> Option<&'v Value> {
    payload
        .get("schemaFormat")
        .and_then(Value::as_str)
        .filter(|f| f.trim().to_ascii_lowercase().starts_with(format))
        .and(payload.get("schema"))
}

/// An Avro schema (`schemaFormat` `application/vnd.apache.avro...`).
fn avro_schema(payload: &Value) -> Option<&Value> {
    schema_of(payload, "application/vnd.apache.avro")
}

/// A `.proto` text (`schemaFormat` `application/vnd.google.protobuf...`).
fn proto_schema(payload: &Value) -> Option<&str> {
    schema_of(payload, "application/vnd.google.protobuf").and_then(Value::as_str)
}

/// A payload's schema format, for a report: `JSON Schema` when it names none.
fn schema_format(payload: &Value) -> String {
    match payload.get("schemaFormat").and_then(Value::as_str) {
        Some(format) => format!("`{format}`"),
        None => "JSON Schema".to_owned(),
    }
}

/// Walks two payload schemas side by side.
struct Schemas<'a> {
    baseline: &'a Value,
    current: &'a Value,
    /// `$ref` pairs already compared (recursive types).
    visited: HashSet<(String, String)>,
    /// (breaking, what) for each difference.
    found: Vec<(bool, String)>,
}

/// Keywords that describe without constraining: changing them changes no message.
const ANNOTATIONS: &[&str] = &[
    "description",
    "title",
    "examples",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$comment",
    "$schema",
    "$id",
    "definitions",
    "$defs",
];

/// Keywords compared by the walk itself.
const STRUCTURE: &[&str] = &[
    "$ref",
    "type",
    "format",
    "properties",
    "required",
    "items",
    "anyOf",
    "oneOf",
    "allOf",
];

impl<'a> Schemas<'a> {
    fn compare(&mut self, path: &str, old: &'a Value, new: &'a Value) {
        if let (Some(a), Some(b)) = (first_ref(old), first_ref(new))
            && !self.visited.insert((a.to_owned(), b.to_owned()))
        {
            return;
        }
        let old = resolve(self.baseline, old);
        let new = resolve(self.current, new);
        let (old_kind, new_kind) = (self.kind(old, self.baseline), self.kind(new, self.current));
        if old_kind != new_kind {
            self.found.push((
                true,
                format!("{} changed type from {old_kind} to {new_kind}", field(path)),
            ));
            return;
        }
        if old.get("properties").is_some() || new.get("properties").is_some() {
            self.compare_properties(path, old, new);
        }
        match (old.get("items"), new.get("items")) {
            // A tuple: element by element.
            (Some(Value::Array(a)), Some(Value::Array(b))) => {
                for (i, (a, b)) in a.iter().zip(b).enumerate() {
                    self.compare(&format!("{path}[{i}]"), a, b);
                }
            }
            (Some(a), Some(b)) if !a.is_array() && !b.is_array() => {
                self.compare(&format!("{path}[]"), a, b);
            }
            _ => {}
        }
        // A map's values (`HashMap<String, T>`).
        if let (Some(a @ Value::Object(_)), Some(b @ Value::Object(_))) = (
            old.get("additionalProperties"),
            new.get("additionalProperties"),
        ) {
            self.compare(&format!("{path}{{}}"), a, b);
        }
        for keyword in ["anyOf", "oneOf", "allOf"] {
            if let (Some(Value::Array(a)), Some(Value::Array(b))) =
                (old.get(keyword), new.get(keyword))
            {
                self.compare_branches(path, a, b);
            }
        }
        self.compare_constraints(path, old, new);
    }

    /// The alternatives of an enum or an `Option` (`oneOf`, `anyOf`), paired by what
    /// they stand for (a variant's name or tag, a referenced type, `null`), not by
    /// position: a removed alternative breaks readers of the old messages, an added one
    /// breaks consumers that handle every alternative.
    fn compare_branches(&mut self, path: &str, old: &'a [Value], new: &'a [Value]) {
        let old_ids = numbered(
            old.iter()
                .enumerate()
                .map(|(i, b)| branch_id(self.baseline, b, i)),
        );
        let new_ids = numbered(
            new.iter()
                .enumerate()
                .map(|(i, b)| branch_id(self.current, b, i)),
        );
        for (id, branch) in old_ids.iter().zip(old) {
            match new_ids.iter().position(|n| n == id) {
                Some(j) => self.compare(path, branch, &new[j]),
                None => self.found.push((
                    true,
                    format!("{}: the alternative {id} was removed", field(path)),
                )),
            }
        }
        for id in new_ids.iter().filter(|id| !old_ids.contains(id)) {
            self.found.push((
                true,
                format!(
                    "{}: new alternative {id} (consumers that handle every alternative do not know it)",
                    field(path)
                ),
            ));
        }
    }

    fn compare_properties(&mut self, path: &str, old: &'a Value, new: &'a Value) {
        static EMPTY: std::sync::LazyLock<serde_json::Map<String, Value>> =
            std::sync::LazyLock::new(serde_json::Map::new);
        let props = |s: &'a Value| match s.get("properties") {
            Some(Value::Object(p)) => p,
            _ => &*EMPTY,
        };
        let (old_props, new_props) = (props(old), props(new));
        let (old_required, new_required) = (required(old), required(new));
        let removed: Vec<&String> = old_props
            .keys()
            .filter(|k| !new_props.contains_key(*k))
            .collect();
        let added: Vec<&String> = new_props
            .keys()
            .filter(|k| !old_props.contains_key(*k))
            .collect();
        let renamed = (removed.len() == 1 && added.len() == 1).then(|| added[0]);
        for name in &removed {
            let what = match renamed {
                Some(to) => format!(
                    "{} was renamed to `{}` (or removed, and `{}` added)",
                    field(&join(path, name)),
                    join(path, to),
                    join(path, to)
                ),
                None => format!("{} was removed", field(&join(path, name))),
            };
            self.found.push((true, what));
        }
        for (name, old_schema) in old_props {
            let Some(new_schema) = new_props.get(name) else {
                continue;
            };
            let at = join(path, name);
            if !old_required.contains(name.as_str()) && new_required.contains(name.as_str()) {
                self.found.push((
                    true,
                    format!(
                        "{} became required: messages written before lack it",
                        field(&at)
                    ),
                ));
            }
            self.compare(&at, old_schema, new_schema);
        }
        for name in added {
            let at = join(path, name);
            if new_required.contains(name.as_str()) {
                self.found.push((
                    true,
                    format!(
                        "new required field `{at}`: messages written before lack it (make it an `Option` or give it `#[serde(default)]`)"
                    ),
                ));
            } else if renamed != Some(name) {
                self.found
                    .push((false, format!("new optional field `{at}`")));
            }
        }
    }

    /// Everything but annotations and what the walk compares: enum values, bounds,
    /// patterns, `additionalProperties`...
    fn compare_constraints(&mut self, path: &str, old: &Value, new: &Value) {
        let keys = |s: &Value| -> BTreeSet<String> {
            s.as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default()
        };
        let mut all = keys(old);
        all.extend(keys(new));
        for key in all {
            if ANNOTATIONS.contains(&key.as_str()) || STRUCTURE.contains(&key.as_str()) {
                continue;
            }
            let (a, b) = (old.get(&key), new.get(&key));
            if key == "additionalProperties"
                && a.is_some_and(Value::is_object)
                && b.is_some_and(Value::is_object)
            {
                continue; // walked
            }
            if a != b {
                let show = |v: Option<&Value>| v.map_or("absent".to_owned(), |v| v.to_string());
                self.found.push((
                    true,
                    format!(
                        "the schema of {} changed: `{key}` went from {} to {}",
                        field(path),
                        show(a),
                        show(b)
                    ),
                ));
            }
        }
    }

    /// A short description of a schema's type: `string (uuid)`, `integer or null`,
    /// `object`, `array of string`.
    fn kind(&self, schema: &Value, document: &Value) -> String {
        self.kind_at(schema, document, 0, &mut 0)
    }

    /// `seen`: schemas described so far. Alternatives of alternatives multiply (a
    /// `oneOf` of 10 references to itself is 10^8 schemas at depth 8), so a description
    /// stops at 256 schemas: the same document is described the same way every time.
    fn kind_at(&self, schema: &Value, document: &Value, depth: usize, seen: &mut usize) -> String {
        let schema = resolve(document, schema);
        *seen += 1;
        if depth > 8 || *seen > 256 {
            return "…".to_owned();
        }
        let mut kinds: Vec<String> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.clone()],
            Some(Value::Array(ts)) => ts
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            _ => Vec::new(),
        };
        if kinds.is_empty() {
            for keyword in ["anyOf", "oneOf"] {
                if let Some(Value::Array(options)) = schema.get(keyword) {
                    kinds = options
                        .iter()
                        .map(|o| self.kind_at(o, document, depth + 1, seen))
                        .collect();
                }
            }
        }
        if kinds.is_empty() {
            if schema.get("properties").is_some() {
                kinds.push("object".to_owned());
            } else if schema.get("enum").is_some() || schema.get("const").is_some() {
                kinds.push("constant".to_owned());
            } else {
                kinds.push("anything".to_owned());
            }
        }
        kinds.sort();
        kinds.dedup();
        let mut out = kinds.join(" or ");
        if let Some(format) = schema.get("format").and_then(Value::as_str) {
            out = format!("{out} ({format})");
        }
        if kinds == ["array"] {
            match schema.get("items") {
                Some(Value::Array(items)) => out = format!("tuple of {}", items.len()),
                Some(items) => {
                    out = format!(
                        "array of {}",
                        self.kind_at(items, document, depth + 1, seen)
                    );
                }
                None => {}
            }
        }
        out
    }
}

fn required(schema: &Value) -> BTreeSet<&str> {
    match schema.get("required") {
        Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).collect(),
        _ => BTreeSet::new(),
    }
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn field(path: &str) -> String {
    if path.is_empty() {
        "the payload".to_owned()
    } else {
        format!("field `{path}`")
    }
}

fn ref_of(schema: &Value) -> Option<&str> {
    schema.get("$ref").and_then(Value::as_str)
}

/// Follows local `$ref`s (`#/components/schemas/T`) within `document`, and a lone
/// `allOf` (what schemars writes for a referenced type with a description or a
/// default next to it).
fn resolve<'v>(document: &'v Value, mut schema: &'v Value) -> &'v Value {
    for _ in 0..32 {
        if let Some(inner) = lone_all_of(schema) {
            schema = inner;
            continue;
        }
        let Some(target) = ref_of(schema)
            .and_then(|r| r.strip_prefix('#'))
            .and_then(|pointer| document.pointer(pointer))
        else {
            return schema;
        };
        schema = target;
    }
    schema
}

/// `{"allOf": [x], ...annotations}` -> `x`.
fn lone_all_of(schema: &Value) -> Option<&Value> {
    let map = schema.as_object()?;
    match map.get("allOf") {
        Some(Value::Array(all)) if all.len() == 1 => {}
        _ => return None,
    }
    if map
        .keys()
        .any(|k| k != "allOf" && !ANNOTATIONS.contains(&k.as_str()))
    {
        return None;
    }
    map.get("allOf")?.get(0)
}

/// The first `$ref` of a schema, through lone `allOf`s (for the recursion guard).
fn first_ref(mut schema: &Value) -> Option<&str> {
    for _ in 0..32 {
        if let Some(r) = ref_of(schema) {
            return Some(r);
        }
        schema = lone_all_of(schema)?;
    }
    None
}

/// `ids` made unique by numbering a repeated one (`x`, `x (#2 of that name)`, ...), so
/// that alternatives standing for the same thing pair in order, not all with the first.
fn numbered(ids: impl Iterator<Item = String>) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    ids.map(|id| {
        let n = seen.entry(id.clone()).or_default();
        *n += 1;
        if *n == 1 {
            id
        } else {
            format!("{id} (#{n} of that name)")
        }
    })
    .collect()
}

/// What an alternative of `oneOf`/`anyOf` stands for: `null`, a constant (a unit
/// variant), a tag (`{"Shipped": {...}}`, or `{"type": "Shipped", ...}`), a referenced
/// type, or else its position.
fn branch_id(document: &Value, branch: &Value, index: usize) -> String {
    if let Some(r) = first_ref(branch) {
        return format!("`{}`", r.rsplit('/').next().unwrap_or(r));
    }
    let branch = resolve(document, branch);
    if branch.get("type").and_then(Value::as_str) == Some("null") {
        return "`null`".to_owned();
    }
    if let Some(c) = branch.get("const") {
        return format!("`{c}`");
    }
    if let Some(Value::Array(values)) = branch.get("enum") {
        let values: Vec<String> = values.iter().map(Value::to_string).collect();
        return format!("`{}`", values.join("|"));
    }
    let props = branch.get("properties").and_then(Value::as_object);
    let required = required(branch);
    if let Some(props) = props {
        // Internally or adjacently tagged: a property with a constant.
        for (name, schema) in props {
            if let Some(c) = resolve(document, schema).get("const") {
                return format!("`{name}: {c}`");
            }
        }
        // Externally tagged: one property, required.
        if props.len() == 1
            && required.len() == 1
            && let Some(name) = props.keys().next()
        {
            return format!("`{name}`");
        }
    }
    format!("#{index}")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A document with one channel `orders.events` and the messages given as
    /// (event type, version, key, payload).
    fn doc(messages: &[(&str, Option<i64>, Option<&str>, Value)]) -> Value {
        doc_on("orders.events", messages)
    }

    fn doc_on(destination: &str, messages: &[(&str, Option<i64>, Option<&str>, Value)]) -> Value {
        let mut channel = serde_json::Map::new();
        let mut components = serde_json::Map::new();
        for (event_type, version, key, payload) in messages {
            let id = format!("{event_type}.{}", version.unwrap_or(0));
            channel.insert(
                id.clone(),
                json!({ "$ref": format!("#/components/messages/{id}") }),
            );
            let mut message = json!({
                "name": event_type,
                "x-outbox-event-type": event_type,
                "payload": payload,
            });
            if let Some(v) = version {
                message["x-outbox-version"] = json!(v);
            }
            if let Some(k) = key {
                message["x-outbox-key"] = json!(k);
            }
            components.insert(id, message);
        }
        json!({
            "asyncapi": "3.0.0",
            "channels": { destination: { "address": destination, "messages": channel } },
            "components": { "messages": components, "schemas": {
                "Address": { "type": "object", "properties": {
                    "city": { "type": "string" }, "zip": { "type": "string" }
                }, "required": ["city", "zip"] }
            } },
        })
    }

    fn order(extra: Value) -> Value {
        let mut props = json!({
            "order_id": { "type": "string", "format": "uuid" },
            "quantity": { "type": "integer", "format": "int32" },
            "note": { "type": ["string", "null"] },
        });
        if let Value::Object(extra) = extra {
            for (k, v) in extra {
                if v.is_null() {
                    props.as_object_mut().expect("the fixture").remove(&k);
                } else {
                    props[k] = v;
                }
            }
        }
        json!({ "type": "object", "properties": props, "required": ["order_id", "quantity"] })
    }

    /// `OrderConfirmed` version 1, keyed by `order_id`, with `payload`.
    fn v1(payload: Value) -> Value {
        doc(&[("OrderConfirmed", Some(1), Some("order_id"), payload)])
    }

    fn base() -> Value {
        v1(order(json!({})))
    }

    fn report(new: Value) -> String {
        check(&base(), &new).to_string()
    }

    /// Found by the `contract_compat` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)), a time-out: a
    /// type whose alternatives refer to itself was described by walking every path 8
    /// levels deep (10 alternatives: 10^8 schemas), for minutes.
    #[test]
    fn a_type_made_of_references_to_itself_is_compared_at_once() {
        let mut document = v1(json!({ "$ref": "#/components/schemas/Tree" }));
        let branches: Vec<Value> = (0..10)
            .map(|_| json!({ "$ref": "#/components/schemas/Tree" }))
            .collect();
        document["components"]["schemas"]["Tree"] = json!({ "oneOf": branches });
        let started = std::time::Instant::now();
        let same = check(&document, &document);
        assert!(same.changes().is_empty(), "{same}");
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(1), "took {took:?}");
    }

    /// Found by the `contract_compat` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)): alternatives
    /// that stand for the same thing (here: both named by an empty string) were all
    /// paired with the first of them, so a document differed from itself.
    #[test]
    fn alternatives_of_the_same_name_are_paired_in_order() {
        let document = v1(json!({ "oneOf": [
            { "$ref": "" },
            { "enum": [] },
        ]}));
        let same = check(&document, &document);
        assert!(same.changes().is_empty(), "{same}");
        let document = v1(json!({ "oneOf": [
            { "const": "a", "type": "string" },
            { "const": "a", "type": "integer" },
        ]}));
        let same = check(&document, &document);
        assert!(same.changes().is_empty(), "{same}");
    }

    /// Consumers decode by the content type: a new one (JSON to Protobuf) breaks them,
    /// whatever the version; the default content type stands for a message without one.
    #[test]
    fn a_changed_content_type_breaks() {
        let mut protobuf = base();
        protobuf["components"]["messages"]["OrderConfirmed.1"]["contentType"] =
            json!("application/protobuf");
        let mut json_default = base();
        json_default["defaultContentType"] = json!("application/json");
        let r = check(&json_default, &protobuf);
        assert!(r.is_breaking(), "{r}");
        assert!(
            r.to_string().contains(
                "the content type changed from `application/json` to `application/protobuf`"
            ),
            "{r}"
        );
        let mut explicit = base();
        explicit["components"]["messages"]["OrderConfirmed.1"]["contentType"] =
            json!("application/json");
        let same = check(&json_default, &explicit);
        assert!(
            same.changes().is_empty(),
            "the default is the same content type: {same}"
        );
        let mut spelled = base();
        spelled["components"]["messages"]["OrderConfirmed.1"]["contentType"] =
            json!("Application/JSON ");
        let same = check(&json_default, &spelled);
        assert!(same.changes().is_empty(), "case and spaces aside: {same}");
    }

    /// Avro payloads (a multi-format schema object) are compared by Avro's rules, with
    /// the version-bump rule.
    #[test]
    fn avro_schemas_are_compared_by_avro_rules() {
        let avro = |version: i64, fields: Value| {
            doc(&[(
                "OrderShipped",
                Some(version),
                Some("order_id"),
                json!({
                    "schemaFormat": "application/vnd.apache.avro+json;version=1.9.0",
                    "schema": { "type": "record", "name": "OrderShipped", "fields": fields },
                }),
            )])
        };
        let old = avro(
            1,
            json!([{"name": "order_id", "type": "long"}, {"name": "carrier", "type": "string"}]),
        );
        let dropped = avro(1, json!([{"name": "order_id", "type": "long"}]));
        let r = check(&old, &dropped);
        assert!(r.is_breaking(), "{r}");
        assert!(
            r.to_string()
                .contains("`carrier` was removed, and the old schema gives it no default"),
            "{r}"
        );
        let bumped = avro(2, json!([{"name": "order_id", "type": "long"}]));
        let r = check(&old, &bumped);
        assert!(!r.is_breaking(), "a version bump allows it: {r}");
        let added = avro(
            1,
            json!([
                {"name": "order_id", "type": "long"},
                {"name": "carrier", "type": "string"},
                {"name": "note", "type": ["null", "string"], "default": null},
            ]),
        );
        let r = check(&old, &added);
        assert!(
            r.is_breaking(),
            "compatible for Avro, but a new fingerprint outbox consumers do not know: {r}"
        );
        assert!(
            r.to_string().contains("`note` was added with a default"),
            "{r}"
        );
        assert!(r.to_string().contains("register_writer_schema"), "{r}");
    }

    #[test]
    fn protobuf_schemas_are_compared_by_field_number() {
        let proto = |version: i64, fields: &str| {
            let mut d = doc(&[("OrderPlaced", Some(version), Some("order_id"), json!(null))]);
            let message = &mut d["components"]["messages"]["OrderPlaced.1"];
            message["contentType"] = json!("application/protobuf");
            message["payload"] = json!({
                "schemaFormat": "application/vnd.google.protobuf;version=3",
                "schema": format!("syntax = \"proto3\";\n\nmessage OrderPlaced {{\n{fields}}}\n"),
            });
            d
        };
        let old = proto(1, "  uint64 order_id = 1;\n  string customer = 2;\n");
        let reused = proto(1, "  uint64 order_id = 1;\n  bytes customer = 2;\n");
        let r = check(&old, &reused);
        assert!(r.is_breaking(), "{r}");
        assert!(
            r.to_string().contains(
                "field number 2 reused: it was `string customer`, it is `bytes customer`"
            ),
            "{r}"
        );
        let added = proto(
            1,
            "  uint64 order_id = 1;\n  string customer = 2;\n  string note = 3;\n",
        );
        let r = check(&old, &added);
        assert!(
            !r.is_breaking() && r.to_string().contains("new field `string note` (3)"),
            "{r}"
        );
        // To JSON Schema, and to opaque.
        let mut json_schema = old.clone();
        json_schema["components"]["messages"]["OrderPlaced.1"]["payload"] =
            json!({"type": "object"});
        let r = check(&old, &json_schema);
        assert!(
            r.to_string().contains("the payload's schema format changed from `application/vnd.google.protobuf;version=3` to JSON Schema"),
            "{r}"
        );
        let mut opaque = old.clone();
        let message = &mut opaque["components"]["messages"]["OrderPlaced.1"];
        message
            .as_object_mut()
            .expect("an object")
            .remove("payload");
        message["x-outbox-schema"] = json!("opaque");
        let r = check(&old, &opaque);
        assert!(
            r.is_breaking() && r.to_string().contains("a message, enumeration or oneof field was likely added, or a name or tag protoc refuses): what changed cannot be checked; check it by hand"),
            "{r}"
        );
        // With the version bump the message asks for, it is allowed.
        let mut bumped = opaque.clone();
        bumped["components"]["messages"]["OrderPlaced.1"]["x-outbox-version"] = json!(2);
        let r = check(&old, &bumped);
        assert!(!r.is_breaking(), "{r}");
        assert!(
            r.to_string().contains("(allowed: the version went to 2)"),
            "{r}"
        );
    }

    #[test]
    fn the_same_document_has_no_changes() {
        let r = check(&base(), &base());
        assert!(r.changes().is_empty(), "{r}");
        assert!(!r.is_breaking());
    }

    #[test]
    fn descriptions_are_not_changes() {
        let described = order(
            json!({ "quantity": { "type": "integer", "format": "int32", "description": "How many" } }),
        );
        let r = check(&base(), &v1(described));
        assert!(r.changes().is_empty(), "{r}");
    }

    #[test]
    fn a_new_event_type_and_a_new_optional_field_are_compatible() {
        let new = doc(&[
            (
                "OrderConfirmed",
                Some(1),
                Some("order_id"),
                order(json!({ "coupon": { "type": ["string", "null"] } })),
            ),
            ("OrderShipped", None, Some("order_id"), order(json!({}))),
        ]);
        let r = check(&base(), &new);
        assert!(!r.is_breaking(), "{r}");
        insta::assert_snapshot!(r.to_string());
    }

    #[test]
    fn a_removed_field_breaks() {
        let r = check(&base(), &v1(order(json!({ "note": null }))));
        assert!(r.is_breaking());
        insta::assert_snapshot!(r.to_string());
    }

    #[test]
    fn a_renamed_field_breaks() {
        insta::assert_snapshot!(report(v1(order(
            json!({ "quantity": null, "qty": { "type": "integer", "format": "int32" } })
        ))));
    }

    #[test]
    fn a_changed_field_type_breaks() {
        insta::assert_snapshot!(report(v1(order(
            json!({ "quantity": { "type": "string" } })
        ))));
    }

    #[test]
    fn an_optional_field_that_became_required_breaks() {
        let mut payload = order(json!({ "note": { "type": "string" } }));
        payload["required"] = json!(["order_id", "quantity", "note"]);
        insta::assert_snapshot!(report(v1(payload)));
    }

    #[test]
    fn a_new_required_field_breaks() {
        let mut payload = order(json!({ "sku": { "type": "string" } }));
        payload["required"] = json!(["order_id", "quantity", "sku"]);
        insta::assert_snapshot!(report(v1(payload)));
    }

    #[test]
    fn a_changed_key_breaks() {
        insta::assert_snapshot!(report(doc(&[(
            "OrderConfirmed",
            Some(1),
            Some("quantity"),
            order(json!({}))
        )])));
    }

    /// A version bump allows a new schema, not a new key: consumers' per-key order
    /// would change under them.
    #[test]
    fn a_changed_key_breaks_even_with_a_version_bump() {
        let r = check(
            &base(),
            &doc(&[(
                "OrderConfirmed",
                Some(2),
                Some("quantity"),
                order(json!({})),
            )]),
        );
        assert!(r.is_breaking(), "{r}");
        assert!(
            r.to_string()
                .contains("the key changed from `order_id` to `quantity`"),
            "{r}"
        );
    }

    #[test]
    fn a_removed_event_type_and_a_removed_destination_break() {
        let old = json!({
            "channels": {
                "orders.events": base()["channels"]["orders.events"].clone(),
                "billing": { "address": "billing", "messages": {
                    "Invoiced": { "$ref": "#/components/messages/Invoiced" }
                } },
            },
            "components": { "messages": {
                "OrderConfirmed.1": base()["components"]["messages"]["OrderConfirmed.1"].clone(),
                "Invoiced": { "x-outbox-event-type": "Invoiced", "payload": { "type": "object" } },
            } },
        });
        let new = doc(&[("OrderShipped", None, Some("order_id"), order(json!({})))]);
        let r = check(&old, &new);
        assert!(r.is_breaking());
        insta::assert_snapshot!(r.to_string());
    }

    #[test]
    fn an_event_type_moved_to_another_destination_breaks() {
        let new = doc_on(
            "orders.v2",
            &[(
                "OrderConfirmed",
                Some(1),
                Some("order_id"),
                order(json!({})),
            )],
        );
        let mut old = base();
        old["channels"]["orders.v2"] = json!({ "address": "orders.v2", "messages": {} });
        insta::assert_snapshot!(check(&old, &new).to_string());
    }

    #[test]
    fn a_changed_schema_under_the_same_version_breaks() {
        let payload =
            order(json!({ "status": { "type": "string", "enum": ["new", "confirmed"] } }));
        let old = v1(payload);
        let widened =
            order(json!({ "status": { "type": "string", "enum": ["new", "confirmed", "held"] } }));
        let r = check(&old, &v1(widened));
        assert!(r.is_breaking());
        insta::assert_snapshot!(r.to_string());
    }

    #[test]
    fn a_version_bump_allows_a_changed_schema() {
        let new = doc(&[(
            "OrderConfirmed",
            Some(2),
            Some("order_id"),
            order(json!({ "quantity": { "type": "string" }, "note": null })),
        )]);
        let r = check(&base(), &new);
        assert!(!r.is_breaking(), "{r}");
        insta::assert_snapshot!(r.to_string());
    }

    #[test]
    fn a_version_that_goes_down_or_away_breaks() {
        let down = doc(&[(
            "OrderConfirmed",
            Some(0),
            Some("order_id"),
            order(json!({})),
        )]);
        let gone = doc(&[("OrderConfirmed", None, Some("order_id"), order(json!({})))]);
        insta::assert_snapshot!(format!("{}{}", report(down), report(gone)));
    }

    #[test]
    fn nested_types_are_compared_through_their_references() {
        let with_address = |address: Value| v1(order(json!({ "ship_to": address })));
        let old = with_address(json!({ "$ref": "#/components/schemas/Address" }));
        let mut new = with_address(json!({ "$ref": "#/components/schemas/Address" }));
        new["components"]["schemas"]["Address"]["properties"]["zip"] = json!({ "type": "integer" });
        new["components"]["schemas"]["Address"]["properties"]
            .as_object_mut()
            .expect("the fixture")
            .remove("city");
        insta::assert_snapshot!(check(&old, &new).to_string());
    }

    #[test]
    fn recursive_types_end() {
        let tree = json!({ "type": "object", "properties": {
            "children": { "type": "array", "items": { "$ref": "#/components/schemas/Tree" } }
        } });
        let mut old = doc(&[(
            "Tree",
            None,
            None,
            json!({ "$ref": "#/components/schemas/Tree" }),
        )]);
        old["components"]["schemas"]["Tree"] = tree.clone();
        let r = check(&old, &old);
        assert!(r.changes().is_empty(), "{r}");
    }

    #[test]
    fn a_lost_schema_breaks() {
        let mut new = base();
        new["components"]["messages"]["OrderConfirmed.1"]
            .as_object_mut()
            .expect("the fixture")
            .remove("payload");
        insta::assert_snapshot!(check(&base(), &new).to_string());
    }

    /// What schemars writes for `T`, as `OrderConfirmed`'s payload in a document.
    #[cfg(feature = "schema")]
    fn of<T: schemars::JsonSchema>() -> Value {
        let mut generator = crate::catalog::SchemaGen::new("/components/schemas");
        let payload = generator.subschema_for::<T>();
        let mut document = v1(payload);
        document["components"]["schemas"] = Value::Object(generator.take_definitions());
        document
    }

    #[cfg(feature = "schema")]
    mod real {
        #![allow(dead_code)]
        use std::collections::HashMap;

        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Status")]
        pub enum Status {
            Placed { at: String },
            Shipped { carrier: String },
            Held,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Status")]
        pub enum StatusReordered {
            Held,
            Shipped { carrier: String },
            Placed { at: String },
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Status")]
        pub enum StatusGrown {
            Placed { at: String },
            Shipped { carrier: String },
            Held,
            Cancelled { reason: String },
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Status")]
        pub enum StatusShrunk {
            Placed { at: String },
            Held,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order")]
        pub struct WithStatus<S: schemars::JsonSchema> {
            pub status: S,
        }

        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Address")]
        pub struct Address {
            pub city: String,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order")]
        pub struct Plain {
            pub ship_to: Address,
            pub backup: Option<Address>,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order")]
        pub struct Described {
            /// Where it goes.
            pub ship_to: Address,
            /// Where else.
            pub backup: Option<Address>,
        }

        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Line")]
        pub struct Line {
            pub quantity: u32,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Line")]
        pub struct LineText {
            pub quantity: String,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order")]
        pub struct Lines<L: schemars::JsonSchema> {
            pub lines: HashMap<String, L>,
            pub pair: (String, u32),
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order")]
        pub struct LinesPair {
            pub lines: HashMap<String, Line>,
            pub pair: (String, String),
        }

        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Tree")]
        pub struct Tree {
            pub label: String,
            pub children: Vec<Tree>,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Tree")]
        pub struct TreeNumbered {
            pub label: u32,
            pub children: Vec<TreeNumbered>,
        }

        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order")]
        pub struct Kind {
            pub kind: Unit,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Order", deny_unknown_fields)]
        pub struct KindAndNote {
            pub kind: UnitMore,
            pub note: Option<String>,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Unit")]
        pub enum Unit {
            A,
            B,
        }
        #[derive(schemars::JsonSchema)]
        #[schemars(rename = "Unit")]
        pub enum UnitMore {
            A,
            B,
            C,
        }
    }

    #[cfg(feature = "schema")]
    #[test]
    fn enum_variants_are_paired_by_name_not_position() {
        use real::*;
        let base = of::<WithStatus<Status>>();
        let r = check(&base, &of::<WithStatus<StatusReordered>>());
        assert!(
            r.changes().is_empty(),
            "reordered variants are the same: {r}"
        );
        let grown = check(&base, &of::<WithStatus<StatusGrown>>());
        let shrunk = check(&base, &of::<WithStatus<StatusShrunk>>());
        assert!(grown.is_breaking() && shrunk.is_breaking());
        insta::assert_snapshot!(format!("{grown}{shrunk}"));
    }

    #[cfg(feature = "schema")]
    #[test]
    fn a_description_on_a_field_of_a_named_type_is_not_a_change() {
        use real::*;
        let r = check(&of::<Plain>(), &of::<Described>());
        assert!(r.changes().is_empty(), "{r}");
    }

    #[cfg(feature = "schema")]
    #[test]
    fn map_values_and_tuple_elements_are_compared() {
        use real::*;
        let r = check(&of::<Lines<Line>>(), &of::<Lines<LineText>>());
        let pair = check(&of::<Lines<Line>>(), &of::<LinesPair>());
        insta::assert_snapshot!(format!("{r}{pair}"));
    }

    #[cfg(feature = "schema")]
    #[test]
    fn a_change_inside_a_recursive_type_is_found_once() {
        use real::*;
        let r = check(&of::<Tree>(), &of::<TreeNumbered>());
        insta::assert_snapshot!(r.to_string());
    }

    #[cfg(feature = "schema")]
    #[test]
    fn a_new_optional_field_does_not_hide_another_change_of_its_type() {
        use real::*;
        let r = check(&of::<Kind>(), &of::<KindAndNote>());
        assert!(r.is_breaking(), "{r}");
        insta::assert_snapshot!(r.to_string());
    }
}
