//! The contract comparison (`contract::check`, run on a published AsyncAPI document and
//! the current one) never panics, never loops, and finds no change between a document
//! and itself, on arbitrary JSON Schemas: recursive and dangling `$ref`s, `allOf`,
//! `oneOf`, `anyOf`, `items`, `enum`, and any JSON where a schema is expected; and on
//! Avro schemas (AsyncAPI's multi-format payloads): records, enums, fixed, unions,
//! arrays, maps, references to named types in and across namespaces, aliases, defaults,
//! logical types, and any JSON where an Avro type is expected; and on Protobuf schemas
//! (`.proto` text): fields of every label, maps, oneofs, reserved numbers and names,
//! numbers used twice or out of range, and any text.
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

const AVRO_NAMES: [&str; 5] = ["Order", "Address", "a.Address", "b.Line", "Line"];
const AVRO_PRIMITIVES: [&str; 9] = [
    "null", "boolean", "int", "long", "float", "double", "bytes", "string", "bogus",
];

#[derive(Debug, Arbitrary)]
enum Avro {
    Primitive(u8),
    Ref(u8),
    Record(
        u8,
        Option<u8>,
        Vec<(u8, Avro, Option<Json>, Vec<u8>)>,
        Vec<u8>,
    ),
    Enum(u8, Vec<u8>, Option<u8>),
    Fixed(u8, u32, Option<u8>),
    Array(Box<Avro>),
    Map(Box<Avro>),
    Union(Vec<Avro>),
    Wrapped(Box<Avro>),
    Logical(u8, u8, Option<u8>),
    Any(Json),
}

fn avro_name(i: u8) -> &'static str {
    AVRO_NAMES[usize::from(i) % AVRO_NAMES.len()]
}

fn avro_of(a: &Avro, depth: u32) -> Value {
    if depth > 8 {
        return json!("int");
    }
    let d = depth + 1;
    match a {
        Avro::Primitive(i) => json!(AVRO_PRIMITIVES[usize::from(*i) % AVRO_PRIMITIVES.len()]),
        Avro::Ref(i) => json!(avro_name(*i)),
        Avro::Record(name, namespace, fields, aliases) => {
            let mut o = json!({
                "type": "record",
                "name": avro_name(*name),
                "fields": fields.iter().map(|(f, t, default, field_aliases)| {
                    let mut field = json!({ "name": name_of_field(*f), "type": avro_of(t, d) });
                    if let Some(v) = default {
                        field["default"] = json_of(v, d);
                    }
                    if !field_aliases.is_empty() {
                        field["aliases"] = json!(field_aliases.iter().map(|i| name_of_field(*i)).collect::<Vec<_>>());
                    }
                    field
                }).collect::<Vec<_>>(),
            });
            if let Some(ns) = namespace {
                o["namespace"] = json!(["", "a", "b", "shop"][usize::from(*ns) % 4]);
            }
            if !aliases.is_empty() {
                o["aliases"] = json!(aliases.iter().map(|i| avro_name(*i)).collect::<Vec<_>>());
            }
            o
        }
        Avro::Enum(name, symbols, default) => {
            let mut o = json!({
                "type": "enum",
                "name": avro_name(*name),
                "symbols": symbols.iter().map(|i| name_of_field(*i)).collect::<Vec<_>>(),
            });
            if let Some(s) = default {
                o["default"] = json!(name_of_field(*s));
            }
            o
        }
        Avro::Fixed(name, size, logical) => {
            let mut o = json!({ "type": "fixed", "name": avro_name(*name), "size": size % 32 });
            if let Some(p) = logical {
                o["logicalType"] = json!("decimal");
                o["precision"] = json!(p % 20);
            }
            o
        }
        Avro::Array(t) => json!({ "type": "array", "items": avro_of(t, d) }),
        Avro::Map(t) => json!({ "type": "map", "values": avro_of(t, d) }),
        Avro::Union(v) => Value::Array(v.iter().map(|t| avro_of(t, d)).collect()),
        Avro::Wrapped(t) => json!({ "type": avro_of(t, d) }),
        Avro::Logical(base, logical, scale) => {
            let base = ["int", "long", "bytes", "string"][usize::from(*base) % 4];
            let logical =
                ["date", "timestamp-millis", "decimal", "uuid"][usize::from(*logical) % 4];
            let mut o = json!({ "type": base, "logicalType": logical });
            if let Some(s) = scale {
                o["scale"] = json!(s % 10);
            }
            o
        }
        Avro::Any(j) => json_of(j, d),
    }
}

fn name_of_field(i: u8) -> &'static str {
    ["id", "note", "to", "from", "status", "NEW", "PAID"][usize::from(i) % 7]
}

/// A Protobuf payload's `.proto`: a message of fields (label, type, number, name),
/// reserved numbers and names, a oneof, or any text.
#[derive(Debug, Arbitrary)]
enum Proto {
    Message(Vec<(u8, u8, u32, u8)>, Vec<(u32, Option<u32>)>, Vec<u8>, bool),
    Raw(String),
}

fn proto_of(p: &Proto) -> String {
    const LABELS: [&str; 4] = ["", "optional ", "repeated ", "required "];
    const TYPES: [&str; 7] = [
        "uint64", "string", "bytes", "int32", "map<string, int64>", "Address", "double",
    ];
    match p {
        Proto::Raw(text) => text.clone(),
        Proto::Message(fields, reserved, names, oneof) => {
            let mut text = String::from("syntax = \"proto3\";\nmessage Order {\n");
            if *oneof {
                text.push_str("  oneof who { string customer = 90; bytes raw = 91; }\n");
            }
            for (label, ty, number, name) in fields {
                text.push_str(&format!(
                    "  {}{} {} = {};\n",
                    LABELS[usize::from(*label) % 4],
                    TYPES[usize::from(*ty) % 7],
                    name_of_field(*name),
                    number % 100
                ));
            }
            for (from, to) in reserved {
                match to {
                    Some(to) => text.push_str(&format!("  reserved {} to {};\n", from % 100, to % 100)),
                    None => text.push_str(&format!("  reserved {};\n", from % 100)),
                }
            }
            for n in names {
                text.push_str(&format!("  reserved \"{}\";\n", name_of_field(*n)));
            }
            text.push_str("}\n");
            text
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Message {
    channel: u8,
    event_type: u8,
    version: Option<i64>,
    key: Option<u8>,
    payload: Option<Schema>,
    avro: Option<Avro>,
    proto: Option<Proto>,
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
        if let Some(a) = &m.avro {
            message["payload"] = json!({
                "schemaFormat": "application/vnd.apache.avro+json;version=1.9.0",
                "schema": avro_of(a, 0),
            });
        }
        if let Some(p) = &m.proto {
            message["payload"] = json!({
                "schemaFormat": "application/vnd.google.protobuf;version=3",
                "schema": proto_of(p),
            });
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
