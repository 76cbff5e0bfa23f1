//! The contract comparison (`contract::check`, run on a published AsyncAPI document and
//! the current one) never panics, never loops, and finds no change between a document
//! and itself, on arbitrary JSON Schemas: recursive and dangling `$ref`s, `allOf`,
//! `oneOf`, `anyOf`, `items`, `enum`, and any JSON where a schema is expected.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::contract::check;
use serde_json::{Map, Value, json};

const NAMES: [&str; 6] = ["Order", "Address", "Line", "Item", "a", "b"];
const TYPES: [&str; 8] = [
    "object", "string", "integer", "number", "boolean", "array", "null", "bogus",
];

#[derive(Debug, Arbitrary)]
enum Schema {
    Ref(u8),
    RawRef(String),
    Type(u8),
    Types(Vec<u8>),
    Object(Vec<(u8, Schema)>, Vec<u8>, Option<bool>),
    Items(Box<Schema>),
    OneOf(Vec<Schema>),
    AnyOf(Vec<Schema>),
    AllOf(Vec<Schema>, Option<String>),
    Enum(Vec<Json>),
    Const(Json),
    Constraint(u8, Json, Box<Schema>),
    Any(Json),
}

#[derive(Debug, Arbitrary)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
    List(Vec<Json>),
    Map(Vec<(String, Json)>),
}

fn json_of(j: &Json, depth: u32) -> Value {
    if depth > 6 {
        return Value::Null;
    }
    match j {
        Json::Null => Value::Null,
        Json::Bool(b) => json!(b),
        Json::Int(n) => json!(n),
        Json::Float(f) => json!(f),
        Json::Text(t) => json!(t),
        Json::List(l) => Value::Array(l.iter().map(|j| json_of(j, depth + 1)).collect()),
        Json::Map(m) => Value::Object(
            m.iter()
                .map(|(k, j)| (k.clone(), json_of(j, depth + 1)))
                .collect::<Map<_, _>>(),
        ),
    }
}

fn name(i: u8) -> &'static str {
    NAMES[usize::from(i) % NAMES.len()]
}

const CONSTRAINTS: [&str; 6] = [
    "maxLength",
    "minimum",
    "maximum",
    "pattern",
    "format",
    "additionalProperties",
];

fn schema_of(s: &Schema, depth: u32) -> Value {
    if depth > 8 {
        return json!({});
    }
    let d = depth + 1;
    match s {
        Schema::Ref(i) => json!({ "$ref": format!("#/components/schemas/{}", name(*i)) }),
        Schema::RawRef(r) => json!({ "$ref": r }),
        Schema::Type(i) => json!({ "type": TYPES[usize::from(*i) % TYPES.len()] }),
        Schema::Types(t) => {
            json!({ "type": t.iter().map(|i| TYPES[usize::from(*i) % TYPES.len()]).collect::<Vec<_>>() })
        }
        Schema::Object(props, required, additional) => {
            let properties: Map<String, Value> = props
                .iter()
                .map(|(i, s)| (name(*i).to_owned(), schema_of(s, d)))
                .collect();
            let mut o = json!({
                "type": "object",
                "properties": properties,
                "required": required.iter().map(|i| name(*i)).collect::<Vec<_>>(),
            });
            if let Some(a) = additional {
                o["additionalProperties"] = json!(a);
            }
            o
        }
        Schema::Items(s) => json!({ "type": "array", "items": schema_of(s, d) }),
        Schema::OneOf(v) => {
            json!({ "oneOf": v.iter().map(|s| schema_of(s, d)).collect::<Vec<_>>() })
        }
        Schema::AnyOf(v) => {
            json!({ "anyOf": v.iter().map(|s| schema_of(s, d)).collect::<Vec<_>>() })
        }
        Schema::AllOf(v, description) => {
            let mut o = json!({ "allOf": v.iter().map(|s| schema_of(s, d)).collect::<Vec<_>>() });
            if let Some(text) = description {
                o["description"] = json!(text);
            }
            o
        }
        Schema::Enum(v) => json!({ "enum": v.iter().map(|j| json_of(j, d)).collect::<Vec<_>>() }),
        Schema::Const(j) => json!({ "const": json_of(j, d) }),
        Schema::Constraint(i, j, s) => {
            let mut o = schema_of(s, d);
            if let Value::Object(map) = &mut o {
                map.insert(
                    CONSTRAINTS[usize::from(*i) % CONSTRAINTS.len()].to_owned(),
                    json_of(j, d),
                );
            }
            o
        }
        Schema::Any(j) => json_of(j, d),
    }
}

#[derive(Debug, Arbitrary)]
struct Message {
    channel: u8,
    event_type: u8,
    version: Option<i64>,
    key: Option<u8>,
    payload: Option<Schema>,
    by_ref: bool,
}

#[derive(Debug, Arbitrary)]
struct Document {
    messages: Vec<Message>,
    schemas: Vec<(u8, Schema)>,
    raw: Option<Json>,
}

fn document(doc: &Document) -> Value {
    if let Some(raw) = &doc.raw {
        return json_of(raw, 0);
    }
    let mut channels = Map::new();
    let mut components = Map::new();
    for (i, m) in doc.messages.iter().enumerate() {
        let mut message =
            json!({ "name": name(m.event_type), "x-outbox-event-type": name(m.event_type) });
        if let Some(v) = m.version {
            message["x-outbox-version"] = json!(v);
        }
        if let Some(k) = m.key {
            message["x-outbox-key"] = json!(name(k));
        }
        if let Some(p) = &m.payload {
            message["payload"] = schema_of(p, 0);
        }
        let id = format!("m{i}");
        let entry = if m.by_ref {
            components.insert(id.clone(), message);
            json!({ "$ref": format!("#/components/messages/{id}") })
        } else {
            message
        };
        let channel = channels
            .entry(format!("c{}", m.channel % 3))
            .or_insert_with(
                || json!({ "address": format!("topic{}", m.channel % 3), "messages": {} }),
            );
        channel["messages"][id] = entry;
    }
    let schemas: Map<String, Value> = doc
        .schemas
        .iter()
        .map(|(i, s)| (name(*i).to_owned(), schema_of(s, 0)))
        .collect();
    json!({
        "asyncapi": "3.0.0",
        "channels": channels,
        "components": { "schemas": schemas, "messages": components },
    })
}

fuzz_target!(|input: (Document, Document)| {
    let (old, new) = (document(&input.0), document(&input.1));
    let report = check(&old, &new);
    let _ = report.to_string();
    let same = check(&old, &old);
    assert!(
        same.changes().is_empty(),
        "a document compared with itself: {same}\n{old}"
    );
});
