//! The event catalog: every event type `#[derive(OutboxEvent)]` saw in this binary.
//!
//! Each derived type registers itself at link time (with [`inventory`]); nothing runs
//! at start-up. Use the catalog to check at start-up that no two Rust types claim the
//! same event type name on one destination ([`validate`]), to list the destinations a
//! publisher must be able to reach, or to print an event catalog.
//!
//! ```standalone_crate
//! use outbox_core::OutboxEvent;
//!
//! #[derive(serde::Serialize, OutboxEvent)]
//! #[outbox(destination = "orders.events", version = 2)]
//! struct OrderConfirmed { order_id: u64 }
//!
//! let info = outbox_core::catalog()
//!     .into_iter()
//!     .find(|e| e.event_type == "OrderConfirmed")
//!     .expect("registered by the derive");
//! assert_eq!(info.destination.as_str(), "orders.events");
//! assert_eq!(info.version, Some(2));
//! assert!(info.rust_type.ends_with("::OrderConfirmed"));
//! outbox_core::catalog::validate().expect("no duplicate event type names");
//! ```

use std::collections::BTreeMap;

use crate::{Destination, Error, Result};

/// One event type registered by `#[derive(OutboxEvent)]`. An enum registers one entry
/// per variant.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct EventInfo {
    /// The event type name consumers dispatch on.
    pub event_type: &'static str,
    /// Where the event is published.
    pub destination: Destination,
    /// The payload's schema version, if the event type is versioned.
    pub version: Option<i32>,
    /// The Rust type, with its module path (`my_app::orders::OrderConfirmed`). Generic
    /// types are named without their parameters.
    pub rust_type: &'static str,
    /// For an enum, the variant this event type is.
    pub variant: Option<&'static str>,
    /// The module the type is declared in.
    pub module_path: &'static str,
    /// The key field named by `key = ...`, as it appears in the payload (serde's name:
    /// `orderId` for `order_id` under `rename_all = "camelCase"`; `0` in a tuple
    /// struct), if the events of this type are ordered by a key.
    pub key: Option<&'static str>,
    /// The source file of the type's declaration (`file!()`), for error messages.
    pub file: &'static str,
    /// The line of the type's name in [`file`](Self::file).
    pub line: u32,
    /// What its payload is (`application/json`, `application/protobuf`, ...): the
    /// codec the derive was given (`#[outbox(codec = ...)]`).
    pub content_type: &'static str,
    #[cfg_attr(not(feature = "schema"), allow(dead_code))]
    schema: SchemaFn,
    #[cfg_attr(not(feature = "schema"), allow(dead_code))]
    generic: bool,
}

/// Generates an event type's payload schema into a shared generator; `None` when the
/// type does not implement `schemars::JsonSchema` (or the `schema` feature is off).
pub(crate) type SchemaFn = fn(&mut SchemaGen) -> Option<serde_json::Value>;

impl std::fmt::Debug for EventInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventInfo")
            .field("event_type", &self.event_type)
            .field("destination", &self.destination)
            .field("version", &self.version)
            .field("rust_type", &self.rust_type)
            .field("variant", &self.variant)
            .field("module_path", &self.module_path)
            .field("key", &self.key)
            .field("file", &self.file)
            .field("line", &self.line)
            .field("content_type", &self.content_type)
            .finish_non_exhaustive()
    }
}

/// Two entries are equal when they describe the same registration (the schema is
/// generated from the Rust type, which is compared by name).
impl PartialEq for EventInfo {
    fn eq(&self, other: &Self) -> bool {
        (
            self.event_type,
            self.destination,
            self.version,
            self.rust_type,
            self.variant,
            self.module_path,
            self.key,
            self.file,
            self.line,
            self.content_type,
        ) == (
            other.event_type,
            other.destination,
            other.version,
            other.rust_type,
            other.variant,
            other.module_path,
            other.key,
            other.file,
            other.line,
            other.content_type,
        )
    }
}

impl Eq for EventInfo {}

impl EventInfo {
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub const fn __new(
        event_type: &'static str,
        destination: Destination,
        version: Option<i32>,
        rust_type: &'static str,
        variant: Option<&'static str>,
        module_path: &'static str,
        key: Option<&'static str>,
        file: &'static str,
        line: u32,
        schema: SchemaFn,
        generic: bool,
        content_type: &'static str,
    ) -> Self {
        EventInfo {
            content_type,
            event_type,
            destination,
            version,
            rust_type,
            variant,
            module_path,
            key,
            file,
            line,
            schema,
            generic,
        }
    }

    /// Whether the Rust type has type parameters (and so no one schema).
    #[cfg(feature = "schema")]
    pub(crate) fn is_generic(&self) -> bool {
        self.generic
    }

    /// The payload's JSON Schema (draft 07), with the types it uses under `definitions`;
    /// `None` when the Rust type does not derive `schemars::JsonSchema`. For an Avro
    /// event ([`content_type`](Self::content_type) `application/avro`), its Avro schema
    /// in JSON form instead (what the contract document gives with `schemaFormat`
    /// `application/vnd.apache.avro+json;version=1.9.0`). For a Protobuf event whose
    /// fields are all scalars or maps of scalars, its `.proto` text as a JSON string
    /// (`application/vnd.google.protobuf;version=3`; `None` for one with a message,
    /// enumeration or oneof field, whose schema is not all in the type). For an enum,
    /// every variant's entry has the enum's schema: the payload is the enum's serde
    /// form. Generated on each call.
    #[cfg(feature = "schema")]
    pub fn schema(&self) -> Option<serde_json::Value> {
        let mut generator = SchemaGen::new("/definitions");
        let mut schema = (self.schema)(&mut generator)?;
        let definitions = generator.take_definitions();
        if let serde_json::Value::Object(map) = &mut schema
            && !definitions.is_empty()
        {
            map.insert("definitions".into(), serde_json::Value::Object(definitions));
        }
        Some(resolve_root_ref(schema))
    }

    /// Generates this entry's payload schema into `generator`.
    #[cfg(feature = "schema")]
    pub(crate) fn schema_in(&self, generator: &mut SchemaGen) -> Option<serde_json::Value> {
        (self.schema)(generator)
    }

    fn describe(&self) -> String {
        let name = match self.variant {
            Some(v) => format!("`{}::{v}`", self.rust_type),
            None => format!("`{}`", self.rust_type),
        };
        format!("{name} ({}:{})", self.file, self.line)
    }
}

/// A schema that is only a reference to its own definition (`{"$ref":
/// "#/definitions/T", "definitions": {...}}`) keeps the reference: draft 07 ignores
/// siblings of `$ref`, so the definition is copied up instead.
#[cfg(feature = "schema")]
fn resolve_root_ref(mut schema: serde_json::Value) -> serde_json::Value {
    let target = schema
        .get("$ref")
        .and_then(|r| r.as_str())
        .and_then(|r| r.strip_prefix("#/definitions/"))
        .map(str::to_owned);
    if let (Some(name), serde_json::Value::Object(map)) = (target, &mut schema) {
        let definition = map.get("definitions").and_then(|d| d.get(&name)).cloned();
        if let Some(serde_json::Value::Object(def)) = definition {
            map.remove("$ref");
            for (k, v) in def {
                map.entry(k).or_insert(v);
            }
        }
    }
    schema
}

/// The generator behind [`EventInfo::schema`] and the contract document: one per
/// document, so types used by several events are defined once. Empty without the
/// `schema` feature.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub struct SchemaGen {
    #[cfg(feature = "schema")]
    generator: schemars::SchemaGenerator,
}

#[cfg(feature = "schema")]
impl SchemaGen {
    /// Draft 07 (what AsyncAPI 3.0's schema object extends), with shared types under
    /// `definitions_path`. The schema is the payload as a consumer reads it with serde
    /// (schemars' deserialize contract): an `Option` field may be absent, so adding
    /// one is compatible, while the publisher always writes it (as `null` when
    /// `None`, unless `skip_serializing_if` says otherwise), which the schema accepts.
    pub(crate) fn new(definitions_path: &'static str) -> SchemaGen {
        let settings = schemars::generate::SchemaSettings::draft07().with(|s| {
            s.definitions_path = definitions_path.into();
            s.contract = schemars::generate::Contract::Deserialize;
        });
        SchemaGen {
            generator: settings.into_generator(),
        }
    }

    /// `T`'s schema (a reference, for a named type), its definitions kept.
    #[cfg(test)]
    pub(crate) fn subschema_for<T: schemars::JsonSchema>(&mut self) -> serde_json::Value {
        self.generator.subschema_for::<T>().to_value()
    }

    /// The definitions collected so far.
    pub(crate) fn take_definitions(&mut self) -> serde_json::Map<String, serde_json::Value> {
        self.generator.take_definitions(true)
    }
}

/// How `#[derive(OutboxEvent)]` finds a type's schema without a bound on it: the
/// method of `ViaJsonSchema` is found first when the type implements
/// `schemars::JsonSchema`, the one of `NoJsonSchema` (one auto-reference further)
/// otherwise. Not a public API.
#[doc(hidden)]
pub mod probe {
    use super::SchemaGen;

    /// Stands for the event type `T`.
    #[allow(missing_debug_implementations)]
    pub struct Probe<T>(std::marker::PhantomData<T>);

    impl<T> Probe<T> {
        /// The probe.
        pub const NEW: Probe<T> = Probe(std::marker::PhantomData);
    }

    /// Found when `T: JsonSchema` (with the `schema` feature).
    pub trait ViaJsonSchema {
        /// `T`'s schema, generated into `generator`.
        fn outbox_schema(&self, generator: &mut SchemaGen) -> Option<serde_json::Value>;
    }

    #[cfg(feature = "schema")]
    impl<T: schemars::JsonSchema> ViaJsonSchema for Probe<T> {
        fn outbox_schema(&self, generator: &mut SchemaGen) -> Option<serde_json::Value> {
            Some(generator.generator.subschema_for::<T>().to_value())
        }
    }

    /// Found otherwise: no schema.
    pub trait NoJsonSchema {
        /// `None`.
        fn outbox_schema(&self, generator: &mut SchemaGen) -> Option<serde_json::Value>;
    }

    impl<T> NoJsonSchema for &Probe<T> {
        fn outbox_schema(&self, _: &mut SchemaGen) -> Option<serde_json::Value> {
            None
        }
    }

    /// Found when `T` is an Avro event (with the `avro` feature): its Avro schema.
    pub trait ViaAvroSchema {
        /// `T`'s Avro schema, in its JSON form.
        fn outbox_avro_schema(&self) -> Option<serde_json::Value>;
    }

    #[cfg(feature = "avro")]
    impl<T: crate::__private::AvroEvent> ViaAvroSchema for Probe<T> {
        fn outbox_avro_schema(&self) -> Option<serde_json::Value> {
            Some(T::__schema())
        }
    }

    /// Found otherwise (the derive's assertion reports the type): no schema.
    pub trait NoAvroSchema {
        /// `None`.
        fn outbox_avro_schema(&self) -> Option<serde_json::Value>;
    }

    impl<T> NoAvroSchema for &Probe<T> {
        fn outbox_avro_schema(&self) -> Option<serde_json::Value> {
            None
        }
    }

    /// For generic event types, which have no one schema.
    pub fn none(_: &mut SchemaGen) -> Option<serde_json::Value> {
        None
    }

    /// A Protobuf event's `.proto` text (the derive reads it off the fields' prost
    /// attributes), as the JSON string the contract document gives with `schemaFormat`
    /// `application/vnd.google.protobuf;version=3`.
    pub fn proto(text: &str) -> Option<serde_json::Value> {
        Some(serde_json::Value::String(text.to_owned()))
    }
}

inventory::collect!(EventInfo);

/// Every registered event type, sorted by destination, event type and Rust type.
pub fn entries() -> Vec<&'static EventInfo> {
    let mut all: Vec<&'static EventInfo> = inventory::iter::<EventInfo>.into_iter().collect();
    all.sort_by_key(|e| (e.destination, e.event_type, e.rust_type, e.variant));
    all
}

/// The destinations a publisher checks at start-up: `extra` and, with
/// `include_catalog`, every destination of the catalog; sorted, each once. Every broker
/// crate's start-up check starts from this list.
pub fn destinations_to_check(
    extra: impl IntoIterator<Item = String>,
    include_catalog: bool,
) -> Vec<String> {
    let mut wanted: Vec<String> = extra.into_iter().collect();
    if include_catalog {
        wanted.extend(entries().iter().map(|e| e.destination.as_str().to_owned()));
    }
    wanted.sort();
    wanted.dedup();
    wanted
}

/// Checks the catalog, once at start-up (and in a test). It reports, each with the Rust
/// types and source locations involved:
///
/// - two Rust types (or enum variants) claiming the same event type name on the same
///   destination: consumers could not tell their payloads apart;
/// - one event type and version published to two destinations: a consumer of both could
///   not tell which is meant;
/// - with the `schema` feature, one event type and version with two different payload
///   schemas.
///
/// The error ([`Error::Catalog`]) lists every conflict.
pub fn validate() -> Result<()> {
    check(&entries())
}

fn check(entries: &[&'static EventInfo]) -> Result<()> {
    // One entry per declaration. The same Rust path declared in two places is two
    // versions of one crate linked into the binary: they are one type to consumers if
    // their schemas agree, so only the schema check below compares them.
    let mut unique: Vec<&'static EventInfo> = Vec::new();
    for e in entries {
        if !unique.iter().any(|c| {
            c.rust_type == e.rust_type
                && c.variant == e.variant
                && (c.file, c.line) == (e.file, e.line)
        }) {
            unique.push(e);
        }
    }
    let mut conflicts = Vec::new();
    let mut by_route: BTreeMap<(Destination, &'static str), Vec<&'static EventInfo>> =
        BTreeMap::new();
    let mut by_version: BTreeMap<(&'static str, Option<i32>), Vec<&'static EventInfo>> =
        BTreeMap::new();
    for e in &unique {
        by_route
            .entry((e.destination, e.event_type))
            .or_default()
            .push(e);
        by_version
            .entry((e.event_type, e.version))
            .or_default()
            .push(e);
    }
    for ((destination, event_type), claimants) in &by_route {
        let mut types: Vec<(&str, Option<&str>)> =
            claimants.iter().map(|c| (c.rust_type, c.variant)).collect();
        types.sort_unstable();
        types.dedup();
        if types.len() > 1 {
            conflicts.push(format!(
                "event type `{event_type}` on destination `{destination}` is claimed by {}",
                list(claimants)
            ));
        }
    }
    for ((event_type, version), claimants) in &by_version {
        let mut destinations: Vec<Destination> = claimants.iter().map(|c| c.destination).collect();
        destinations.sort();
        destinations.dedup();
        let version = match version {
            Some(v) => format!("version {v}"),
            None => "without a version".to_owned(),
        };
        if destinations.len() > 1 {
            let places: Vec<String> = claimants
                .iter()
                .map(|c| format!("`{}` by {}", c.destination, c.describe()))
                .collect();
            conflicts.push(format!(
                "event type `{event_type}` {version} is published to more than one destination: {}; \
                 give each its own event type name, or a version of its own",
                places.join(" and ")
            ));
        }
        #[cfg(feature = "schema")]
        if claimants.len() > 1 {
            let schemas: Vec<Option<serde_json::Value>> =
                claimants.iter().map(|c| c.schema()).collect();
            if schemas.windows(2).any(|w| w[0] != w[1]) {
                conflicts.push(format!(
                    "event type `{event_type}` {version} has different payload schemas in {}",
                    list(claimants)
                ));
            }
        }
    }
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(Error::Catalog(conflicts.join("; ")))
    }
}

fn list(claimants: &[&'static EventInfo]) -> String {
    let names: Vec<String> = claimants.iter().map(|c| c.describe()).collect();
    names.join(" and ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        rust_type: &'static str,
        destination: &'static str,
        line: u32,
        schema: SchemaFn,
    ) -> &'static EventInfo {
        Box::leak(Box::new(EventInfo::__new(
            "Shipped",
            Destination::new(destination),
            Some(1),
            rust_type,
            None,
            "app",
            None,
            "src/app.rs",
            line,
            schema,
            false,
            "application/json",
        )))
    }

    #[test]
    fn one_type_and_version_on_two_destinations_is_reported_with_both_places() {
        let a = entry("app::a::Shipped", "a.events", 10, probe::none);
        let b = entry("app::b::Shipped", "b.events", 20, probe::none);
        let err = check(&[a, b]).expect_err("inconsistent").to_string();
        assert!(
            err.contains(
                "event type `Shipped` version 1 is published to more than one destination: \
                 `a.events` by `app::a::Shipped` (src/app.rs:10) and `b.events` by \
                 `app::b::Shipped` (src/app.rs:20)"
            ),
            "{err}"
        );
        // With another version, the same name elsewhere is fine.
        let c: &'static EventInfo = Box::leak(Box::new(EventInfo {
            version: Some(2),
            ..*b
        }));
        check(&[a, c]).expect("different versions");
    }

    #[cfg(feature = "schema")]
    #[test]
    fn one_type_and_version_with_two_schemas_is_reported() {
        fn one(_: &mut SchemaGen) -> Option<serde_json::Value> {
            Some(
                serde_json::json!({ "type": "object", "properties": { "id": { "type": "string" } } }),
            )
        }
        fn other(_: &mut SchemaGen) -> Option<serde_json::Value> {
            Some(
                serde_json::json!({ "type": "object", "properties": { "id": { "type": "integer" } } }),
            )
        }
        let a = entry("app::a::Shipped", "a.events", 10, one);
        let b = entry("app::b::Shipped", "a.events", 20, other);
        let err = check(&[a, b]).expect_err("inconsistent").to_string();
        assert!(
            err.contains(
                "event type `Shipped` version 1 has different payload schemas in \
                 `app::a::Shipped` (src/app.rs:10) and `app::b::Shipped` (src/app.rs:20)"
            ),
            "{err}"
        );
    }

    /// Two versions of one events crate linked into a binary declare the same Rust path
    /// in two places: one type to consumers while the schemas agree, a conflict when
    /// they do not.
    #[cfg(feature = "schema")]
    #[test]
    fn one_type_declared_twice_is_compared_by_its_schemas() {
        fn one(_: &mut SchemaGen) -> Option<serde_json::Value> {
            Some(serde_json::json!({ "type": "object", "required": ["id"] }))
        }
        fn other(_: &mut SchemaGen) -> Option<serde_json::Value> {
            Some(serde_json::json!({ "type": "object" }))
        }
        let a = entry("events::Shipped", "a.events", 10, one);
        let same = entry("events::Shipped", "a.events", 12, one);
        check(&[a, same, a]).expect("the same schema twice is one type");
        let changed = entry("events::Shipped", "a.events", 12, other);
        let err = check(&[a, changed]).expect_err("two schemas").to_string();
        assert!(
            err.contains(
                "event type `Shipped` version 1 has different payload schemas in \
                 `events::Shipped` (src/app.rs:10) and `events::Shipped` (src/app.rs:12);"
            ),
            "{err}"
        );
        assert!(!err.contains("claimed by"), "one type, not two: {err}");
    }
}
