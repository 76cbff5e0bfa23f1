//! Event contracts from code (feature `schema`): the [AsyncAPI 3.0] document of the
//! events this binary emits, and a breaking-change check against a committed copy of
//! it. See [`docs/contracts.md`](https://github.com/outbox-rs/outbox/blob/main/docs/contracts.md).
//!
//! The catalog ([`crate::catalog`](mod@crate::catalog)) knows every event type `#[derive(OutboxEvent)]` saw:
//! its destination, version and key. With `schemars::JsonSchema` derived on the same
//! type, it also knows the payload's JSON Schema. From that, [`asyncapi`] writes one
//! channel per destination and one message per event type (payload schema, the headers
//! our publishers set, the key), and [`assert_compatible`] fails a test when a change
//! would break consumers.
//!
//! ```standalone_crate
//! use outbox_core::OutboxEvent;
//! use outbox_core::contract::{Info, asyncapi};
//!
//! #[derive(serde::Serialize, schemars::JsonSchema, OutboxEvent)]
//! #[outbox(destination = "orders.events", key = order_id, version = 1)]
//! struct OrderConfirmed {
//!     order_id: u64,
//!     note: Option<String>,
//! }
//!
//! let document = asyncapi(&Info::new("orders", "1.4.0").server("production", "kafka:9092", "kafka"))
//!     .expect("a consistent catalog");
//! let json: serde_json::Value = serde_json::from_str(&document.to_json()).expect("the fixture");
//! assert_eq!(json["channels"]["orders.events"]["address"], "orders.events");
//! assert_eq!(json["components"]["messages"]["OrderConfirmed.v1"]["x-outbox-key"], "order_id");
//! assert!(document.to_yaml().starts_with("asyncapi: \"3.0.0\"\n"));
//! ```
//!
//! [AsyncAPI 3.0]: https://www.asyncapi.com/docs/reference/specification/v3.0.0

mod avro;
mod compat;
mod protobuf;
mod yaml;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value, json};

pub use compat::{Change, Report, check};

use crate::catalog::{EventInfo, SchemaGen};
use crate::publisher::headers;
use crate::{Error, Result};

/// The document's `info` and `servers`. Servers are named by host (and port) only:
/// never put credentials here, the document is meant to be published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    title: String,
    version: String,
    description: Option<String>,
    servers: Vec<Server>,
    cloudevents: Option<CloudEventsInfo>,
    /// CloudEvents header prefixes given for servers by name
    /// ([`Info::cloudevents_prefix_for`]), over what their protocol implies.
    cloudevents_prefixes: BTreeMap<String, String>,
    destinations: Option<Vec<String>>,
}

/// What the document says of the CloudEvents headers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CloudEventsInfo {
    source: String,
    type_prefix: Option<String>,
    /// One prefix for every server ([`Info::cloudevents`]), or `None`: each server's
    /// own ([`Info::cloudevents_by_server`]).
    prefix: Option<String>,
}

/// A server's layout, in place of a prefix: structured mode.
const STRUCTURED_LAYOUT: &str = "structured";

/// The CloudEvents header prefix of each broker's publisher, by AsyncAPI protocol name:
/// `ce_` (Kafka binding), `ce-` (NATS binding draft 1.0.3-wip), `cloudEvents:` (AMQP
/// binding 1.0.2, RabbitMQ's default).
fn default_prefix(protocol: &str) -> Option<&'static str> {
    match protocol {
        "kafka" | "kafka-secure" => Some("ce_"),
        "nats" => Some("ce-"),
        "amqp" | "amqps" => Some("cloudEvents:"),
        _ => None,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Server {
    name: String,
    host: String,
    protocol: String,
}

impl Info {
    /// `title` and `version` of the application (its API version, not AsyncAPI's).
    pub fn new(title: impl Into<String>, version: impl Into<String>) -> Info {
        Info {
            title: title.into(),
            version: version.into(),
            description: None,
            servers: Vec::new(),
            cloudevents: None,
            cloudevents_prefixes: BTreeMap::new(),
            destinations: None,
        }
    }

    /// A description of the application (Markdown).
    pub fn description(mut self, description: impl Into<String>) -> Info {
        self.description = Some(description.into());
        self
    }

    /// A broker the events are published to: `host` with its port
    /// (`kafka.internal:9092`), `protocol` as AsyncAPI names it (`kafka`, `nats`,
    /// `amqp`). Only the host and port are kept: a scheme, credentials (before an `@`),
    /// a path and a query string are dropped, so a connection URL can be passed as is
    /// without publishing its password.
    pub fn server(
        mut self,
        name: impl Into<String>,
        host: impl Into<String>,
        protocol: impl Into<String>,
    ) -> Info {
        let host = host.into();
        let host = host
            .split_once("://")
            .map_or(host.as_str(), |(_, rest)| rest);
        let host = host.split(['/', '?', '#']).next().unwrap_or_default();
        let host = host.rsplit_once('@').map_or(host, |(_, h)| h).to_owned();
        self.servers.push(Server {
            name: name.into(),
            host,
            protocol: protocol.into(),
        });
        self
    }

    /// The publishers write CloudEvents attributes as headers with this one prefix on
    /// every server (`ce_` on Kafka, `ce-` on NATS, `cloudEvents:` on RabbitMQ) and
    /// this `source` (what
    /// [`CloudEvents::new`](crate::publisher::cloudevents::CloudEvents::new) was
    /// given): the document lists them (see [`crate::publisher::cloudevents`]). With
    /// servers of several brokers, use [`cloudevents_by_server`](Self::cloudevents_by_server).
    pub fn cloudevents(
        mut self,
        header_prefix: impl Into<String>,
        source: impl Into<String>,
    ) -> Info {
        self.cloudevents = Some(CloudEventsInfo {
            source: source.into(),
            type_prefix: None,
            prefix: Some(header_prefix.into()),
        });
        self
    }

    /// The publishers write the CloudEvents attributes of `cloudevents` (its source and
    /// type prefix), each server with its broker's headers: `ce_*` on `kafka`, `ce-*`
    /// on `nats`, `cloudEvents:*` on `amqp`, or the prefix given to
    /// [`cloudevents_prefix_for`](Self::cloudevents_prefix_for). Each message's headers
    /// schema then accepts each server's layout (`anyOf`, a branch per layout naming its
    /// servers in `x-outbox-servers`), so every broker's message validates against it.
    pub fn cloudevents_by_server(
        mut self,
        cloudevents: &crate::publisher::cloudevents::CloudEvents,
    ) -> Info {
        self.cloudevents = Some(CloudEventsInfo {
            source: cloudevents.source().to_owned(),
            type_prefix: cloudevents.type_prefix_of().map(str::to_owned),
            prefix: None,
        });
        self
    }

    /// The CloudEvents header prefix of the server named `server`, instead of its
    /// protocol's (with [`cloudevents_by_server`](Self::cloudevents_by_server)): e.g.
    /// `cloudEvents_` for a RabbitMQ publisher built with
    /// `.cloudevents_headers(CloudEventsHeaders::Underscore)`.
    pub fn cloudevents_prefix_for(
        mut self,
        server: impl Into<String>,
        prefix: impl Into<String>,
    ) -> Info {
        self.cloudevents_prefixes
            .insert(server.into(), prefix.into());
        self
    }

    /// The server named `server` gets CloudEvents in structured mode (with
    /// [`cloudevents_by_server`](Self::cloudevents_by_server)): a NATS publisher built
    /// with `.cloudevents_mode(CloudEventsMode::Structured)`. Its messages have
    /// `content-type: application/cloudevents+json` and no attribute headers; their
    /// payload is a JSON event whose `data` is the payload described.
    pub fn cloudevents_structured_for(self, server: impl Into<String>) -> Info {
        self.cloudevents_prefix_for(server, STRUCTURED_LAYOUT)
    }

    /// The CloudEvents header layouts of the document: each prefix with the servers
    /// that use it (none: every server, or no server declared).
    fn cloudevents_layouts(&self) -> Vec<(String, Vec<String>)> {
        let Some(ce) = &self.cloudevents else {
            return Vec::new();
        };
        if let Some(prefix) = &ce.prefix {
            return vec![(prefix.clone(), Vec::new())];
        }
        let mut layouts: Vec<(String, Vec<String>)> = Vec::new();
        for server in &self.servers {
            let prefix = match self.cloudevents_prefixes.get(&server.name) {
                Some(prefix) => prefix.as_str(),
                None => match default_prefix(&server.protocol) {
                    Some(prefix) => prefix,
                    None => continue,
                },
            };
            match layouts.iter_mut().find(|(p, _)| p == prefix) {
                Some((_, names)) => names.push(server.name.clone()),
                None => layouts.push((prefix.to_owned(), vec![server.name.clone()])),
            }
        }
        // In an order that does not depend on the servers' (a document read back lists
        // them by name).
        for (_, names) in &mut layouts {
            names.sort();
        }
        layouts.sort();
        layouts
    }

    /// Only the event types published to these destinations are in the document (all
    /// of them by default): the contract of one service when its binary (or its test
    /// binary) also links event types it does not publish, or generic event types,
    /// which have no one schema. Kept in the document (`x-outbox-destinations`), so
    /// that [`assert_compatible`] uses it again.
    pub fn destinations<I, D>(mut self, destinations: I) -> Info
    where
        I: IntoIterator<Item = D>,
        D: AsRef<str>,
    {
        let mut list: Vec<String> = destinations
            .into_iter()
            .map(|d| d.as_ref().to_owned())
            .collect();
        list.sort();
        list.dedup();
        self.destinations = Some(list);
        self
    }

    fn includes(&self, e: &EventInfo) -> bool {
        self.destinations
            .as_ref()
            .is_none_or(|list| list.iter().any(|d| d == e.destination.as_str()))
    }

    /// The `info` and `servers` of an existing document, so that a rewritten baseline
    /// keeps them.
    fn from_document(document: &Value) -> Option<Info> {
        let info = document.get("info")?;
        let mut out = Info::new(info.get("title")?.as_str()?, info.get("version")?.as_str()?);
        out.description = info
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_owned);
        if let Some(Value::Object(servers)) = document.get("servers") {
            for (name, server) in servers {
                let (Some(host), Some(protocol)) = (
                    server.get("host").and_then(Value::as_str),
                    server.get("protocol").and_then(Value::as_str),
                ) else {
                    continue;
                };
                out = out.server(name, host, protocol);
            }
        }
        if let Some(ce) = document.get("x-outbox-cloudevents") {
            let source = ce.get("source").and_then(Value::as_str);
            if let (Some(prefix), Some(source)) = (ce.get("prefix").and_then(Value::as_str), source)
            {
                out = out.cloudevents(prefix, source);
            } else if let (Some(Value::Object(servers)), Some(source)) = (ce.get("servers"), source)
            {
                out.cloudevents = Some(CloudEventsInfo {
                    source: source.to_owned(),
                    type_prefix: ce
                        .get("typePrefix")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    prefix: None,
                });
                out.cloudevents_prefixes = servers
                    .iter()
                    .filter_map(|(name, p)| Some((name.clone(), p.as_str()?.to_owned())))
                    .collect();
            }
        }
        if let Some(Value::Array(list)) = document.get("x-outbox-destinations") {
            out = out.destinations(list.iter().filter_map(Value::as_str));
        }
        Some(out)
    }
}

/// An AsyncAPI 3.0 document; [`to_json`](Self::to_json) or
/// [`to_yaml`](Self::to_yaml) to write it.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    value: Value,
}

impl Document {
    /// The document as JSON (pretty-printed, ending with a newline).
    pub fn to_json(&self) -> String {
        let mut out = serde_json::to_string_pretty(&self.value).unwrap_or_default();
        out.push('\n');
        out
    }

    /// The document as YAML.
    pub fn to_yaml(&self) -> String {
        yaml::to_string(&self.value)
    }

    /// The document as a JSON value.
    pub fn as_value(&self) -> &Value {
        &self.value
    }
}

/// The AsyncAPI 3.0 document of every event type in this binary's catalog: one channel
/// per destination, one `send` operation per channel, one message per event type (and
/// version) with its payload schema, headers and key.
///
/// Fails when [`crate::catalog::validate`] does (two types claiming one event type, one
/// event type and version on two destinations): such a catalog has no one contract.
/// An event type whose Rust type does not derive `schemars::JsonSchema` gets a message
/// without a payload schema (`x-outbox-schema: "missing"`); [`assert_compatible`]
/// refuses those.
pub fn asyncapi(info: &Info) -> Result<Document> {
    crate::catalog::validate()?;
    Ok(Document {
        value: document(info, &selected(info)),
    })
}

/// The catalog's entries `info` includes, each registration once.
fn selected(info: &Info) -> Vec<&'static EventInfo> {
    let mut out: Vec<&'static EventInfo> = Vec::new();
    for e in crate::catalog::entries() {
        let same = |o: &&EventInfo| {
            (o.rust_type, o.variant, o.file, o.line) == (e.rust_type, e.variant, e.file, e.line)
        };
        if info.includes(e) && !out.iter().any(same) {
            out.push(e);
        }
    }
    out
}

fn document(info: &Info, entries: &[&'static EventInfo]) -> Value {
    let mut generator = SchemaGen::new("/components/schemas");
    let mut channels = Map::new();
    let mut operations = Map::new();
    let mut messages = Map::new();
    let mut by_destination: BTreeMap<&str, Vec<&EventInfo>> = BTreeMap::new();
    for e in entries {
        by_destination
            .entry(e.destination.as_str())
            .or_default()
            .push(e);
    }
    // Messages that are an enum's variant: (message id, variant).
    let mut variants: Vec<(String, &str)> = Vec::new();
    let mut channel_ids = Ids::default();
    let mut message_ids = Ids::default();
    for (destination, events) in by_destination {
        let channel_id = channel_ids.take(destination);
        let mut channel_messages = Map::new();
        let mut operation_messages = Vec::new();
        for e in events {
            let name = match e.version {
                Some(v) => format!("{}.v{v}", e.event_type),
                None => e.event_type.to_owned(),
            };
            let message_id = message_ids.take(&name);
            if let Some(variant) = e.variant {
                variants.push((message_id.clone(), variant));
            }
            messages.insert(message_id.clone(), message(e, &name, &mut generator, info));
            channel_messages.insert(
                message_id.clone(),
                json!({ "$ref": format!("#/components/messages/{message_id}") }),
            );
            operation_messages.push(json!({
                "$ref": format!("#/channels/{channel_id}/messages/{message_id}")
            }));
        }
        channels.insert(
            channel_id.clone(),
            json!({
                "address": destination,
                "messages": channel_messages,
            }),
        );
        operations.insert(
            format!("send.{channel_id}"),
            json!({
                "action": "send",
                "summary": format!("The outbox relay publishes the events written for `{destination}`."),
                "channel": { "$ref": format!("#/channels/{channel_id}") },
                "messages": operation_messages,
            }),
        );
    }
    let mut info_value = json!({ "title": info.title, "version": info.version });
    if let Some(description) = &info.description {
        info_value["description"] = json!(description);
    }
    let mut out = json!({
        "asyncapi": "3.0.0",
        "info": info_value,
    });
    if !info.servers.is_empty() {
        let servers: Map<String, Value> = info
            .servers
            .iter()
            .map(|s| {
                (
                    ids_safe(&s.name),
                    json!({ "host": s.host, "protocol": s.protocol }),
                )
            })
            .collect();
        out["servers"] = Value::Object(servers);
    }
    out["defaultContentType"] = json!(headers::JSON);
    out["channels"] = Value::Object(channels);
    out["operations"] = Value::Object(operations);
    let schemas = generator.take_definitions();
    for (message_id, variant) in variants {
        if let Some(message) = messages.get_mut(&message_id) {
            let branch = message
                .get("payload")
                .and_then(|payload| variant_branch(&schemas, payload, variant));
            if let Some(branch) = branch {
                message["payload"] = branch;
            }
        }
    }
    let mut components = json!({ "messages": messages });
    if !schemas.is_empty() {
        components["schemas"] = Value::Object(schemas);
    }
    out["components"] = components;
    if let Some(ce) = &info.cloudevents {
        out["x-outbox-cloudevents"] = match &ce.prefix {
            Some(prefix) => json!({ "prefix": prefix, "source": ce.source }),
            None => {
                let servers: Map<String, Value> = info
                    .cloudevents_layouts()
                    .into_iter()
                    .flat_map(|(prefix, names)| {
                        names.into_iter().map(move |n| (n, json!(prefix.clone())))
                    })
                    .collect();
                let mut v = json!({ "source": ce.source, "servers": servers });
                if let Some(type_prefix) = &ce.type_prefix {
                    v["typePrefix"] = json!(type_prefix);
                }
                v
            }
        };
    }
    if let Some(list) = &info.destinations {
        out["x-outbox-destinations"] = json!(list);
    }
    out
}

/// The alternative of an enum's schema (`payload`, a reference into `schemas`) that is
/// `variant`: the variant's payload, as the enum's serde form writes it (`{"Shipped":
/// {...}}`, `{"type": "Shipped", ...}` or `"Held"`). Names are matched as serde's
/// `rename_all` rules leave them (case, `_` and `-` aside); a variant renamed otherwise
/// keeps the whole enum's schema.
fn variant_branch(schemas: &Map<String, Value>, payload: &Value, variant: &str) -> Option<Value> {
    let name = payload
        .get("$ref")?
        .as_str()?
        .strip_prefix("#/components/schemas/")?;
    let enum_schema = schemas.get(name)?;
    let normal = |s: &str| -> String {
        s.chars()
            .filter(char::is_ascii_alphanumeric)
            .map(|c| c.to_ascii_lowercase())
            .collect()
    };
    let wanted = normal(variant);
    let is = |v: &Value| v.as_str().is_some_and(|s| normal(s) == wanted);
    let branches = enum_schema
        .get("oneOf")
        .or_else(|| enum_schema.get("anyOf"))
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(std::slice::from_ref(enum_schema));
    for branch in branches {
        if branch.get("const").is_some_and(is) {
            return Some(branch.clone());
        }
        if let Some(found) = branch
            .get("enum")
            .and_then(Value::as_array)
            .and_then(|values| values.iter().find(|v| is(v)))
        {
            // Unit variants grouped in one `enum`: this one alone.
            return Some(json!({ "type": "string", "const": found }));
        }
        let Some(properties) = branch.get("properties").and_then(Value::as_object) else {
            continue;
        };
        // Externally tagged: `{"Variant": ...}`, one required property.
        let required: Vec<&Value> = branch
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().collect())
            .unwrap_or_default();
        if properties.len() == 1 && required.len() == 1 && properties.keys().any(|k| is(&json!(k)))
        {
            return Some(branch.clone());
        }
        // Internally or adjacently tagged: a property with the variant's name as constant.
        if properties.values().any(|p| {
            p.get("const").is_some_and(is)
                || p.get("enum")
                    .and_then(Value::as_array)
                    .is_some_and(|e| e.len() == 1 && is(&e[0]))
        }) {
            return Some(branch.clone());
        }
    }
    None
}

/// One message: the event type's payload schema, headers and key.
fn message(e: &EventInfo, name: &str, generator: &mut SchemaGen, info: &Info) -> Value {
    let mut message = json!({
        "name": name,
        "title": e.event_type,
        "contentType": e.content_type,
        "headers": message_headers(e, info),
    });
    // An Avro or Protobuf event's schema, as AsyncAPI's multi-format schema object:
    // what any Avro library, or protoc, reads its payloads with (the Protobuf one is the
    // `.proto` the derive wrote from the fields' prost attributes).
    let format = [
        (crate::codec::AVRO, crate::codec::AVRO_SCHEMA_FORMAT),
        (crate::codec::PROTOBUF, crate::codec::PROTOBUF_SCHEMA_FORMAT),
    ]
    .into_iter()
    .find(|(content_type, _)| crate::codec::is_media_type(e.content_type, content_type))
    .map(|(_, format)| format);
    match (e.schema_in(generator), format) {
        (Some(schema), Some(format)) => {
            message["payload"] = json!({ "schemaFormat": format, "schema": schema });
        }
        // A JSON Schema describes JSON only; another codec's payload (a Protobuf message
        // with fields defined elsewhere, bytes) is opaque here: the document says its
        // content type, not its fields.
        _ if !crate::payload::is_json(e.content_type) => {
            message["x-outbox-schema"] = json!("opaque");
        }
        (Some(schema), None) => message["payload"] = schema,
        (None, _) => message["x-outbox-schema"] = json!("missing"),
    }
    if let Some(key) = e.key {
        message["x-outbox-key"] = json!(key);
        message["bindings"] = json!({
            "kafka": {
                "key": {
                    "type": "string",
                    "description": format!("The partition key: the event's `{key}` field. Events of one key are published in the order they were written."),
                },
                "bindingVersion": "0.5.0",
            }
        });
    }
    message["x-outbox-event-type"] = json!(e.event_type);
    if let Some(version) = e.version {
        message["x-outbox-version"] = json!(version);
    }
    message
}

/// The headers every publisher writes ([`crate::publisher::headers`]), and the
/// CloudEvents attributes when they are on: required as one set when every server
/// writes the same prefix, else one `anyOf` branch per prefix, naming its servers.
fn message_headers(e: &EventInfo, info: &Info) -> Value {
    let mut properties = Map::new();
    let required = {
        let mut r = vec![
            headers::MESSAGE_ID,
            headers::EVENT_TYPE,
            headers::CONTENT_TYPE,
        ];
        if e.version.is_some() {
            r.push(headers::EVENT_VERSION);
        }
        r
    };
    properties.insert(
        headers::MESSAGE_ID.into(),
        json!({ "type": "string", "format": "uuid", "description": "The outbox message id (UUIDv7): consumers deduplicate by it." }),
    );
    properties.insert(
        headers::EVENT_TYPE.into(),
        json!({ "type": "string", "const": e.event_type, "description": "The event type: consumers dispatch on it." }),
    );
    if let Some(version) = e.version {
        properties.insert(
            headers::EVENT_VERSION.into(),
            json!({ "type": "string", "const": version.to_string(), "description": "The payload's schema version." }),
        );
    }
    properties.insert(
        headers::CONTENT_TYPE.into(),
        json!({ "type": "string", "const": e.content_type }),
    );
    if e.key.is_some() {
        properties.insert(
            headers::PARTITION_KEY.into(),
            json!({ "type": "string", "description": "The partition key, on brokers whose messages have no key of their own (NATS, AMQP); Kafka uses the message key." }),
        );
    }
    properties.insert(
        headers::TRACEPARENT.into(),
        json!({ "type": "string", "description": "W3C trace context of the request that wrote the event, when it had one." }),
    );
    properties.insert(
        headers::TRACESTATE.into(),
        json!({ "type": "string", "description": "W3C trace state, next to traceparent." }),
    );
    let mut required: Vec<String> = required.into_iter().map(str::to_owned).collect();
    let layouts = info.cloudevents_layouts();
    let mut branches = Vec::new();
    if let Some(ce) = &info.cloudevents {
        let bare = match e.version {
            Some(v) => format!("{}.v{v}", e.event_type),
            None => e.event_type.to_owned(),
        };
        let kind = match &ce.type_prefix {
            Some(prefix) => format!("{prefix}.{bare}"),
            None => bare,
        };
        const REQUIRED: [&str; 5] = ["specversion", "id", "source", "type", "time"];
        let structured_type = crate::publisher::cloudevents::STRUCTURED_CONTENT_TYPE;
        let any_structured = layouts.iter().any(|(p, _)| p == STRUCTURED_LAYOUT);
        if any_structured {
            properties.insert(
                headers::CONTENT_TYPE.into(),
                if layouts.len() == 1 {
                    json!({ "type": "string", "const": structured_type })
                } else {
                    json!({ "type": "string", "enum": [e.content_type, structured_type] })
                },
            );
        }
        for (prefix, servers) in &layouts {
            if prefix == STRUCTURED_LAYOUT {
                if layouts.len() > 1 {
                    branches.push(json!({
                        "title": "CloudEvents structured mode",
                        "description": format!("As written to server(s) {}: the payload is a JSON event (CloudEvents JSON format, type `{kind}`, source `{}`) whose `data` is the payload described; no attribute headers.", servers.join(", "), ce.source),
                        "properties": { headers::CONTENT_TYPE: { "const": structured_type } },
                        "x-outbox-servers": servers,
                    }));
                }
                continue;
            }
            for (attribute, schema) in [
                ("specversion", json!({ "type": "string", "const": "1.0" })),
                ("id", json!({ "type": "string", "format": "uuid" })),
                (
                    "source",
                    json!({ "type": "string", "format": "uri-reference", "const": ce.source }),
                ),
                ("type", json!({ "type": "string", "const": kind })),
                ("time", json!({ "type": "string", "format": "date-time" })),
                (
                    "datacontenttype",
                    json!({ "type": "string", "const": e.content_type }),
                ),
            ] {
                properties.insert(format!("{prefix}{attribute}"), schema);
            }
            let names = REQUIRED.map(|a| format!("{prefix}{a}"));
            if layouts.len() == 1 {
                required.extend(names);
            } else {
                let mut branch = json!({
                    "title": format!("CloudEvents binary mode, `{prefix}` headers"),
                    "description": format!("The CloudEvents attributes as written to server(s) {}.", servers.join(", ")),
                    "required": names,
                    "x-outbox-servers": servers,
                });
                if any_structured {
                    branch["properties"] =
                        json!({ headers::CONTENT_TYPE: { "const": e.content_type } });
                }
                branches.push(branch);
            }
        }
    }
    let mut out = json!({
        "type": "object",
        "properties": properties,
        "required": required,
    });
    if !branches.is_empty() {
        out["anyOf"] = Value::Array(branches);
    }
    out
}

/// Component and channel ids: AsyncAPI allows `[A-Za-z0-9._-]`; other characters become
/// `_`, and a clash gets a suffix.
#[derive(Default)]
struct Ids(Vec<String>);

impl Ids {
    fn take(&mut self, name: &str) -> String {
        let base = ids_safe(name);
        let mut id = base.clone();
        let mut n = 2;
        while self.0.contains(&id) {
            id = format!("{base}_{n}");
            n += 1;
        }
        self.0.push(id.clone());
        id
    }
}

fn ids_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The environment variable that makes [`assert_compatible`] rewrite its baseline:
/// `OUTBOX_CONTRACT=overwrite cargo test`.
pub const OVERWRITE_ENV: &str = "OUTBOX_CONTRACT";

/// The breaking-change check, for your test suite: compares this binary's event
/// contract with the committed baseline at `baseline` (an AsyncAPI document written by
/// a previous run) and panics with a readable list of changes when they differ.
///
/// - A change that breaks consumers (a removed event type or destination, a removed or
///   renamed field, a changed field type, a field that became required, a changed key,
///   a changed schema under the same version) fails, and says what to do.
/// - Compatible changes (new event types, new optional fields, a schema changed with a
///   version bump) fail too, asking to record them: the committed document is the
///   published contract and must match the code.
/// - `OUTBOX_CONTRACT=overwrite` writes the current contract to `baseline` instead (the
///   way `insta` and `trybuild` update their snapshots), printing what changed. Review
///   the file's diff like any other.
///
/// The baseline's `info` and `servers` are kept; a new baseline takes the test's
/// package name and version (`CARGO_PKG_NAME`, `CARGO_PKG_VERSION`). Relative paths are
/// relative to the package (where `cargo test` runs). Use
/// [`assert_compatible_with`] to set them.
///
/// ```no_run
/// #[test]
/// fn the_event_contract_is_compatible() {
///     outbox_core::contract::assert_compatible("contracts/orders.asyncapi.json");
/// }
/// ```
#[track_caller]
pub fn assert_compatible(baseline: impl AsRef<Path>) {
    if let Err(message) = overwrite_from_env().and_then(|o| compatible(baseline.as_ref(), None, o))
    {
        panic!("{message}");
    }
}

/// [`assert_compatible`] with the `info` and `servers` of the document given.
#[track_caller]
pub fn assert_compatible_with(baseline: impl AsRef<Path>, info: &Info) {
    if let Err(message) =
        overwrite_from_env().and_then(|o| compatible(baseline.as_ref(), Some(info), o))
    {
        panic!("{message}");
    }
}

fn overwrite_from_env() -> std::result::Result<bool, String> {
    overwrite_from(std::env::var(OVERWRITE_ENV).ok().as_deref())
}

/// What `OUTBOX_CONTRACT` asks for: `overwrite`, nothing (unset or empty), or a mistake.
fn overwrite_from(value: Option<&str>) -> std::result::Result<bool, String> {
    match value {
        Some("overwrite") => Ok(true),
        None | Some("") => Ok(false),
        Some(other) => Err(format!(
            "{OVERWRITE_ENV}={other:?} is not understood: set it to `overwrite` to rewrite the baseline, or unset it"
        )),
    }
}

/// The check behind [`assert_compatible`]: `Err` is the message it panics with.
fn compatible(
    path: &Path,
    info: Option<&Info>,
    overwrite: bool,
) -> std::result::Result<(), String> {
    let existing = match std::fs::read_to_string(path) {
        Ok(text) => match serde_json::from_str::<Value>(&text) {
            Ok(value) => Some(value),
            // Rewritten from scratch (a merge conflict, say).
            Err(_) if overwrite => None,
            Err(e) => {
                return Err(format!(
                    "the contract baseline {} is not valid JSON ({e}); fix it, or rewrite it with `{OVERWRITE_ENV}=overwrite cargo test`",
                    path.display()
                ));
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(format!(
                "cannot read the contract baseline {}: {e}",
                path.display()
            ));
        }
    };
    let info = match (info, existing.as_ref().and_then(Info::from_document)) {
        (Some(info), _) => info.clone(),
        (None, Some(info)) => info,
        (None, None) => Info::new(
            std::env::var("CARGO_PKG_NAME").unwrap_or_else(|_| "events".to_owned()),
            std::env::var("CARGO_PKG_VERSION").unwrap_or_else(|_| "0.0.0".to_owned()),
        ),
    };
    let current = asyncapi(&info).map_err(|e| match e {
        Error::Catalog(conflicts) => format!("the event catalog is inconsistent: {conflicts}"),
        other => other.to_string(),
    })?;
    missing_schemas(&info)?;
    let report = existing.as_ref().map(|old| check(old, current.as_value()));
    if overwrite {
        if existing.as_ref() != Some(current.as_value()) {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
            }
            std::fs::write(path, current.to_json())
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            match &report {
                Some(report) => eprintln!(
                    "outbox: rewrote the contract baseline {}:\n{report}",
                    path.display()
                ),
                None => eprintln!("outbox: wrote the contract baseline {}", path.display()),
            }
        }
        return Ok(());
    }
    let Some(report) = report else {
        return Err(format!(
            "no contract baseline at {}: write it with `{OVERWRITE_ENV}=overwrite cargo test`, review it and commit it",
            path.display()
        ));
    };
    if report.is_breaking() {
        return Err(format!(
            "the event contract has changes that break consumers (baseline {}):\n{report}\n\
             Undo them, or publish the change as a new version (`#[outbox(version = N)]`, \
             bumped) or a new event type. If consumers are ready for it, accept the change \
             with `{OVERWRITE_ENV}=overwrite cargo test` and commit the baseline.",
            path.display()
        ));
    }
    if existing.as_ref() != Some(current.as_value()) {
        let changes = if report.changes().is_empty() {
            let mut places = Vec::new();
            if let Some(old) = &existing {
                differences("", old, current.as_value(), &mut places);
            }
            let more = places.len().saturating_sub(10);
            places.truncate(10);
            let mut text = format!(
                "  no change to the events; the document differs at {}",
                places.join(", ")
            );
            if more > 0 {
                text.push_str(&format!(" and {more} more places"));
            }
            text.push('\n');
            text
        } else {
            report.to_string()
        };
        return Err(format!(
            "the event contract changed compatibly, and the baseline {} does not have it yet:\n{changes}\
             Record it with `{OVERWRITE_ENV}=overwrite cargo test` and commit the baseline.",
            path.display()
        ));
    }
    Ok(())
}

/// The JSON pointers at which two documents differ (descriptions, servers...).
fn differences(at: &str, old: &Value, new: &Value, out: &mut Vec<String>) {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for key in keys {
                let here = format!("{at}/{}", key.replace('~', "~0").replace('/', "~1"));
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => differences(&here, x, y, out),
                    (Some(_), None) => out.push(format!("`{here}` (removed)")),
                    (None, _) => out.push(format!("`{here}` (added)")),
                }
            }
        }
        (a, b) if a != b => out.push(format!("`{at}`")),
        _ => {}
    }
}

/// Refuses event types without a schema, saying why each has none.
fn missing_schemas(info: &Info) -> std::result::Result<(), String> {
    let name = |e: &EventInfo| match e.variant {
        Some(v) => format!("`{}::{v}`", e.rust_type),
        None => format!("`{}`", e.rust_type),
    };
    let missing: Vec<&EventInfo> = selected(info)
        .into_iter()
        .filter(|e| crate::payload::is_json(e.content_type) && e.schema().is_none())
        .collect();
    let (generic, plain): (Vec<&EventInfo>, Vec<&EventInfo>) =
        missing.into_iter().partition(|e| e.is_generic());
    let mut problems = Vec::new();
    if !plain.is_empty() {
        let names: Vec<String> = plain.iter().map(|e| name(e)).collect();
        problems.push(format!(
            "no JSON Schema for {}: derive `schemars::JsonSchema` (schemars 1.x; 0.8's trait is another trait) next to `OutboxEvent`, so that the contract can check their fields",
            names.join(", ")
        ));
    }
    if !generic.is_empty() {
        let names: Vec<String> = generic.iter().map(|e| name(e)).collect();
        problems.push(format!(
            "{} generic: a generic event type has no one schema (it depends on the type parameters); leave its destination out of the contract with `Info::destinations`, or publish a concrete type",
            if names.len() == 1 { format!("{} is", names[0]) } else { format!("{} are", names.join(", ")) }
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An order was confirmed.
    #[derive(serde::Serialize, schemars::JsonSchema, crate::OutboxEvent)]
    #[outbox(crate = "crate", destination = "contract.orders", key = order_id, version = 3)]
    struct ContractOrderConfirmed {
        order_id: u64,
        /// What the customer wrote.
        note: Option<String>,
        lines: Vec<Line>,
    }

    #[derive(serde::Serialize, schemars::JsonSchema)]
    struct Line {
        sku: String,
        quantity: u32,
    }

    /// Keys are named as in the payload.
    #[derive(serde::Serialize, schemars::JsonSchema, crate::OutboxEvent)]
    #[serde(rename_all = "camelCase")]
    #[outbox(crate = "crate", destination = "contract.camel", key = order_id)]
    struct ContractCamel {
        order_id: u64,
    }

    /// Each variant is an event type of its own, with its own payload.
    #[derive(serde::Serialize, schemars::JsonSchema, crate::OutboxEvent)]
    #[outbox(crate = "crate", destination = "contract.parcels", key = parcel)]
    enum ContractParcel {
        ParcelShipped { parcel: u64, carrier: String },
        ParcelLost { parcel: u64 },
    }

    /// The same, internally tagged, with unit variants.
    #[derive(serde::Serialize, schemars::JsonSchema, crate::OutboxEvent)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    #[outbox(crate = "crate", destination = "contract.tagged")]
    enum ContractTagged {
        DoorOpened { door: u32 },
        AlarmReset,
    }

    #[derive(serde::Serialize, schemars::JsonSchema, crate::OutboxEvent)]
    #[outbox(crate = "crate", destination = "contract.units")]
    enum ContractUnits {
        LightsOn,
        LightsOff,
    }

    #[test]
    fn keys_are_named_as_serde_writes_them_and_variants_have_their_own_payload() {
        let document = asyncapi(&Info::new("shop", "1")).expect("consistent");
        let doc = document.as_value();
        let messages = &doc["components"]["messages"];
        assert_eq!(messages["ContractCamel"]["x-outbox-key"], "orderId");
        assert_eq!(
            doc["components"]["schemas"]["ContractCamel"]["required"],
            json!(["orderId"])
        );
        let shipped = &messages["ParcelShipped"]["payload"];
        assert_eq!(shipped["required"], json!(["ParcelShipped"]), "{shipped}");
        assert!(shipped["properties"]["ParcelShipped"]["properties"]["carrier"].is_object());
        assert_eq!(
            messages["ParcelLost"]["payload"]["required"],
            json!(["ParcelLost"])
        );
        let opened = &messages["DoorOpened"]["payload"];
        assert_eq!(
            opened["properties"]["kind"]["const"], "door_opened",
            "{opened}"
        );
        let reset = &messages["AlarmReset"]["payload"];
        assert_eq!(
            reset["properties"]["kind"]["const"], "alarm_reset",
            "{reset}"
        );
        assert_eq!(messages["LightsOff"]["payload"]["const"], "LightsOff");
        assert_eq!(messages["LightsOn"]["payload"]["const"], "LightsOn");
        let _ = (
            ContractCamel { order_id: 1 }.order_id,
            ContractParcel::ParcelLost { parcel: 1 },
            ContractParcel::ParcelShipped {
                parcel: 1,
                carrier: String::new(),
            },
            ContractTagged::DoorOpened { door: 1 },
            ContractTagged::AlarmReset,
            ContractUnits::LightsOn,
            ContractUnits::LightsOff,
        );
    }

    fn message(document: &Value) -> &Value {
        &document["components"]["messages"]["ContractOrderConfirmed.v3"]
    }

    #[test]
    fn the_derive_records_the_schema_key_and_location() {
        let entry = crate::catalog()
            .into_iter()
            .find(|e| e.event_type == "ContractOrderConfirmed")
            .expect("registered");
        assert_eq!(entry.key, Some("order_id"));
        assert!(entry.file.ends_with("mod.rs"), "{}", entry.file);
        assert!(entry.line > 1);
        let schema = entry.schema().expect("derives JsonSchema");
        assert_eq!(
            schema["properties"]["note"]["type"],
            json!(["string", "null"])
        );
        assert_eq!(
            schema["properties"]["note"]["description"],
            "What the customer wrote."
        );
        assert_eq!(schema["required"], json!(["order_id", "lines"]));
        assert_eq!(
            schema["properties"]["lines"]["items"]["$ref"],
            "#/definitions/Line"
        );
        assert!(schema["definitions"]["Line"].is_object(), "{schema}");
    }

    #[test]
    fn the_document_has_channels_messages_headers_and_shared_schemas() {
        let info = Info::new("shop", "2.0.0")
            .server("prod", "user:secret@kafka.internal:9092", "kafka")
            .server(
                "tls",
                "kafka+ssl://user:secret@kafka.internal:9093/?password=secret2",
                "kafka-secure",
            )
            .cloudevents("ce_", "/shop");
        let document = asyncapi(&info).expect("consistent");
        let doc = document.as_value();
        assert_eq!(doc["servers"]["prod"]["host"], "kafka.internal:9092");
        assert_eq!(doc["servers"]["tls"]["host"], "kafka.internal:9093");
        assert!(!document.to_json().contains("secret"));
        assert!(!document.to_yaml().contains("secret"));
        assert_eq!(
            doc["channels"]["contract.orders"]["address"],
            "contract.orders"
        );
        assert_eq!(
            doc["operations"]["send.contract.orders"]["channel"]["$ref"],
            "#/channels/contract.orders"
        );
        let m = message(doc);
        assert_eq!(m["x-outbox-key"], "order_id");
        assert_eq!(m["x-outbox-version"], 3);
        assert_eq!(
            m["payload"]["$ref"],
            "#/components/schemas/ContractOrderConfirmed"
        );
        assert_eq!(
            doc["components"]["schemas"]["ContractOrderConfirmed"]["properties"]["lines"]["items"]
                ["$ref"],
            "#/components/schemas/Line"
        );
        let headers = &m["headers"]["properties"];
        assert_eq!(headers["event-type"]["const"], "ContractOrderConfirmed");
        assert_eq!(headers["event-version"]["const"], "3");
        assert_eq!(headers["ce_type"]["const"], "ContractOrderConfirmed.v3");
        assert_eq!(headers["ce_source"]["const"], "/shop");
        assert!(m.get("x-outbox-rust-type").is_none(), "no internal paths");
        // Kept for the check to use again.
        assert_eq!(Info::from_document(doc), Some(info.clone()));
        // A filter leaves the other destinations out, and is kept too.
        let only = info.clone().destinations(["elsewhere"]);
        let filtered = asyncapi(&only).expect("consistent");
        assert_eq!(filtered.as_value()["channels"], json!({}));
        assert_eq!(Info::from_document(filtered.as_value()), Some(only));
        assert!(headers["traceparent"].is_object());
    }

    /// Each server's CloudEvents headers (#33): `ce_` on Kafka, `ce-` on NATS,
    /// `cloudEvents:` on AMQP unless told otherwise, one `anyOf` branch each; the
    /// outbox headers stay required for all.
    #[test]
    fn cloudevents_headers_are_described_per_server() {
        let ce = crate::publisher::cloudevents::CloudEvents::new("/shop")
            .expect("source")
            .type_prefix("com.example.shop")
            .expect("prefix");
        let info = Info::new("shop", "2.0.0")
            .server("kafka", "kafka.internal:9092", "kafka")
            .server("nats", "nats.internal:4222", "nats")
            .server("rabbit", "rabbit.internal:5672", "amqp")
            .server("legacy", "old-rabbit.internal:5672", "amqp")
            .server("other", "mqtt.internal:1883", "mqtt")
            .cloudevents_by_server(&ce)
            .cloudevents_prefix_for("legacy", "cloudEvents_");
        let document = asyncapi(&info).expect("consistent");
        let doc = document.as_value();
        let headers = &message(doc)["headers"];
        assert_eq!(
            headers["required"],
            json!(["message-id", "event-type", "content-type", "event-version"])
        );
        let branches = headers["anyOf"].as_array().expect("a branch per layout");
        let layouts: Vec<(&Value, &Value)> = branches
            .iter()
            .map(|b| (&b["required"][3], &b["x-outbox-servers"]))
            .collect();
        assert_eq!(
            layouts,
            [
                (&json!("ce-type"), &json!(["nats"])),
                (&json!("ce_type"), &json!(["kafka"])),
                (&json!("cloudEvents:type"), &json!(["rabbit"])),
                (&json!("cloudEvents_type"), &json!(["legacy"])),
            ]
        );
        for prefix in ["ce_", "ce-", "cloudEvents:", "cloudEvents_"] {
            assert_eq!(
                headers["properties"][format!("{prefix}type")]["const"],
                "com.example.shop.ContractOrderConfirmed.v3"
            );
        }
        assert_eq!(
            doc["x-outbox-cloudevents"],
            json!({
                "source": "/shop",
                "typePrefix": "com.example.shop",
                "servers": { "kafka": "ce_", "nats": "ce-", "rabbit": "cloudEvents:", "legacy": "cloudEvents_" },
            })
        );
        // Read back, it writes the same document.
        let again = Info::from_document(doc).expect("info");
        assert_eq!(asyncapi(&again).expect("consistent").as_value(), doc);
        // NATS in structured mode: a branch of its own, without attribute headers.
        let structured =
            asyncapi(&info.clone().cloudevents_structured_for("nats")).expect("consistent");
        let headers = &message(structured.as_value())["headers"];
        let branches = headers["anyOf"].as_array().expect("branches");
        let of = |server: &str| {
            branches
                .iter()
                .find(|b| b["x-outbox-servers"] == json!([server]))
                .expect("a branch")
        };
        let branch = of("nats");
        assert_eq!(
            branch["properties"]["content-type"]["const"],
            "application/cloudevents+json"
        );
        assert!(branch.get("required").is_none(), "{branch}");
        assert!(headers["properties"].get("ce-type").is_none());
        assert_eq!(
            of("kafka")["properties"]["content-type"]["const"],
            "application/json"
        );
    }

    #[test]
    fn outbox_contract_is_overwrite_or_nothing() {
        assert_eq!(overwrite_from(Some("overwrite")), Ok(true));
        assert_eq!(overwrite_from(None), Ok(false));
        assert_eq!(overwrite_from(Some("")), Ok(false));
        let err = overwrite_from(Some("yes")).expect_err("a mistake");
        assert!(
            err.contains("OUTBOX_CONTRACT=\"yes\" is not understood")
                && err.contains("`overwrite`"),
            "{err}"
        );
    }

    #[test]
    fn the_check_writes_a_baseline_then_refuses_breaking_and_unrecorded_changes() {
        let dir = std::env::temp_dir().join(format!("outbox-contract-{}", uuid::Uuid::now_v7()));
        let path = dir.join("contracts/events.asyncapi.json");
        let info = Info::new("shop", "1").server("local", "127.0.0.1:9092", "kafka");
        let err = compatible(&path, Some(&info), false).expect_err("refused");
        assert!(
            err.contains("no contract baseline") && err.contains("OUTBOX_CONTRACT=overwrite"),
            "{err}"
        );

        compatible(&path, Some(&info), true).expect("writes the baseline");
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("the fixture"))
                .expect("the fixture");
        assert_eq!(&written, asyncapi(&info).expect("the fixture").as_value());
        compatible(&path, None, false).expect("the baseline's own info is kept");

        let tamper = |change: &dyn Fn(&mut Value)| {
            let mut old = written.clone();
            change(&mut old);
            std::fs::write(
                &path,
                serde_json::to_string_pretty(&old).expect("the fixture"),
            )
            .expect("the fixture");
        };
        // The published contract had a field the type no longer has: breaking.
        tamper(&|old| {
            old["components"]["schemas"]["ContractOrderConfirmed"]["properties"]["legacy"] =
                json!({ "type": "string" });
        });
        let err = compatible(&path, None, false).expect_err("refused");
        assert!(
            err.contains("break consumers") && err.contains("field `legacy` was removed"),
            "{err}"
        );
        // The type has an optional field the published contract lacks: compatible, but
        // it must be recorded.
        tamper(&|old| {
            let schema = &mut old["components"]["schemas"]["ContractOrderConfirmed"];
            schema["properties"]
                .as_object_mut()
                .expect("the fixture")
                .remove("note");
        });
        let err = compatible(&path, None, false).expect_err("refused");
        assert!(
            err.contains("changed compatibly") && err.contains("new optional field `note`"),
            "{err}"
        );
        // Overwrite accepts either.
        compatible(&path, None, true).expect("rewrites");
        compatible(&path, None, false).expect("recorded");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
