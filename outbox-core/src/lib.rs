//! # outbox
//!
//! The transactional outbox for Rust: write events into an outbox table in the **same**
//! database transaction as your business change, so a change and its events commit or
//! roll back together. A relay then publishes pending rows to your broker.
//!
//! ```no_run
//! use outbox_core::{destinations, transactional_outbox, Outbox, OutboxEvent, OutboxTx};
//!
//! destinations! {
//!     /// Everything the order service announces.
//!     pub ORDER_EVENTS = "orders.events";
//! }
//!
//! // event_type defaults to "OrderConfirmed"; the key orders events per order.
//! #[derive(Debug, serde::Serialize, OutboxEvent)]
//! #[outbox(destination = ORDER_EVENTS, key = order_id)]
//! pub struct OrderConfirmed {
//!     pub order_id: i64,
//! }
//!
//! #[derive(Debug, thiserror::Error)]
//! pub enum OrderError {
//!     #[error("order {0} not found")]
//!     NotFound(i64),
//!     #[error(transparent)]
//!     Outbox(#[from] outbox_core::Error),
//!     #[error(transparent)]
//!     Db(#[from] sqlx::Error),
//! }
//!
//! pub struct OrderService {
//!     outbox: Outbox,
//! }
//!
//! impl OrderService {
//!     /// Confirms an order. The macro begins a transaction, passes it as `tx`, and on
//!     /// `Ok` writes the events in one INSERT and commits; on `Err` or a panic, nothing
//!     /// is written and the UPDATE is undone. Callers write `service.confirm_order(42)`.
//!     #[transactional_outbox(outbox = self.outbox)]
//!     pub async fn confirm_order(
//!         &self,
//!         tx: &mut OutboxTx<'_>,
//!         order_id: i64,
//!     ) -> Result<(), OrderError> {
//!         let updated = sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = $1")
//!             .bind(order_id)
//!             .execute(&mut **tx)
//!             .await?;
//!         if updated.rows_affected() == 0 {
//!             return Err(OrderError::NotFound(order_id));
//!         }
//!         tx.emit(OrderConfirmed { order_id })?;
//!         Ok(())
//!     }
//! }
//!
//! /// A free function gets the handle as a generated first parameter, `outbox: &Outbox`.
//! /// It joins `confirm_order`'s work through the `_in_tx` companion: one transaction.
//! #[transactional_outbox]
//! pub async fn confirm_all(
//!     tx: &mut OutboxTx<'_>,
//!     service: &OrderService,
//!     ids: &[i64],
//! ) -> Result<(), OrderError> {
//!     for &id in ids {
//!         service.confirm_order_in_tx(tx, id).await?;
//!     }
//!     Ok(())
//! }
//!
//! # async fn demo() -> Result<(), OrderError> {
//! let outbox = Outbox::connect("postgres://postgres@127.0.0.1/test").await?;
//! outbox.migrate().await?;
//! outbox_core::catalog::validate()?; // no two types claim one event type name
//!
//! let service = OrderService { outbox: outbox.clone() };
//! service.confirm_order(42).await?;
//! confirm_all(&outbox, &service, &[43, 44]).await?;
//! # Ok(()) }
//! ```
//!
//! Without the macros it is plain API:
//!
//! ```no_run
//! # use outbox_core::{Outbox, OutboxEvent};
//! # #[derive(serde::Serialize, OutboxEvent)]
//! # #[outbox(destination = "orders.events")]
//! # struct OrderConfirmed { order_id: i64 }
//! # async fn demo(outbox: Outbox) -> outbox_core::Result<()> {
//! let mut tx = outbox.begin().await?;
//! sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = $1")
//!     .bind(42_i64)
//!     .execute(&mut *tx)
//!     .await
//!     .expect("update the order");
//! tx.emit(OrderConfirmed { order_id: 42 })?;
//! tx.commit().await?; // the UPDATE and the event, atomically
//! # Ok(()) }
//! ```
//!
//! The attributes, composition rules and error messages of the macros are described in
//! [`docs/macros.md`](https://github.com/outbox-rs/outbox/blob/main/docs/macros.md).
//!
//! ## Guarantees
//! - **Atomic write**: events emitted in an [`OutboxTx`] are written in one statement
//!   just before commit; they exist if and only if the transaction commits.
//! - **At-least-once delivery**: a message is marked sent only after the broker
//!   acknowledged it; a crash in between publishes it again. Consumers deduplicate on the
//!   message id (a UUIDv7).
#![cfg_attr(docsrs, feature(doc_cfg))]
// Without a database feature the crate is its neutral part only (what the broker crates
// build on: publisher, transport, consumer layer); the database helpers go unused.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_imports)
)]
#![warn(missing_docs)]

#[macro_use]
mod macros;

pub mod admin;
pub mod backoff;
pub mod catalog;
pub mod codec;
pub mod config;
pub mod consumer;
#[cfg(feature = "schema")]
pub mod contract;
mod db;
pub mod doctor;
mod error;
pub mod event;
pub mod inbox;
mod key;
pub mod migrate;
mod model;
mod outbox;
mod payload;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod publisher;
pub mod relay;
pub mod retention;
// The contracts a database implements (sealed: the implementations are this crate's).
// Not a public API, so hidden from the docs; `Backend` and `DefaultBackend`, which
// applications name, are documented at the crate root.
#[doc(hidden)]
pub mod store;
pub mod task;
pub mod telemetry;
mod trace;
mod transactional;
mod tx;

/// The parsers of untrusted input, for the fuzz targets in `fuzz/`. Not a public API:
/// it changes without notice.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    #[cfg(feature = "postgres")]
    pub use crate::db::mask_literals;
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub use crate::db::redact_url;
    pub use crate::trace::{TraceParent, traceparent};
}

pub use catalog::EventInfo;
pub use config::{TableName, Tables};
pub use error::{Error, ErrorChain, Result};
pub use event::{Destination, OutboxEvent, OutboxMessage, Payload};
pub use key::PartitionKey;
pub use outbox::{Outbox, OutboxBuilder};
pub use publisher::{OutboxRecord, PublishError, Publisher};
pub use relay::{Relay, RelayHandle};
pub use retention::{Retention, RetentionHandle, RetentionReport};
pub use store::Backend;
#[cfg(feature = "postgres")]
pub use store::DefaultBackend;
pub use tx::OutboxTx;

/// `#[derive(OutboxEvent)]`: implements [`OutboxEvent`](trait@OutboxEvent) and registers
/// the type in the [`catalog`](mod@catalog).
///
/// `#[outbox(destination = ..., key = field, event_type = "...", version = N, crate = "...")]`:
/// `destination` (required) is a string literal or a [`destinations!`] constant;
/// `event_type` defaults to the type's name; `key` names the field (`key = 0` in a tuple
/// struct) whose value, through [`PartitionKey`], orders the events; `version` is the
/// payload's schema version. Enums are one event type per variant: `event_type`, `key`
/// and `version` may be set per variant; an enum-level `key` names a field every variant
/// without its own `key` must have.
#[cfg(feature = "macros")]
pub use outbox_macros::OutboxEvent;

/// `#[transactional_outbox]`: runs an `async fn` in a transaction.
///
/// The function takes `tx: &mut OutboxTx<'_>` (or `OutboxTx<'_, DB>`) and returns a
/// `Result` whose error type implements `From<outbox_core::Error>`. The macro emits:
///
/// * `<name>`: the same function without `tx`. It begins a transaction, runs the body,
///   and commits on `Ok` (writing every emitted event in one INSERT) or rolls back on
///   `Err` (returning the error unchanged); a panic drops, and so rolls back, the
///   transaction. A free function gets a first parameter `outbox: &Outbox<DB>`; a method
///   names its handle with `#[transactional_outbox(outbox = self.outbox)]` (any
///   expression giving an `Outbox` or `&Outbox`, evaluated with the parameters in scope).
/// * `<name>_in_tx`: the function as written, which joins the transaction it is given
///   (no begin, no commit). Call it from another transactional function to compose.
///
/// `crate = "..."` names `outbox_core` when it is renamed in `Cargo.toml`.
///
/// **The function you write is not the one you call.** For
///
/// ```ignore
/// #[transactional_outbox]
/// async fn confirm_order(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), AppError> { .. }
/// ```
///
/// the macro emits these two (the first parameter of the first is the macro's):
///
/// ```ignore
/// async fn confirm_order(outbox: &Outbox, order_id: i64) -> Result<(), AppError>;
/// async fn confirm_order_in_tx(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), AppError>;
/// ```
///
/// so a call reads `confirm_order(&outbox, 42).await?`, and from inside another
/// transactional function `confirm_order_in_tx(tx, 42).await?`. The generated items carry
/// the spans of what you wrote, so an editor's "go to definition" lands on your function.
#[cfg(feature = "macros")]
pub use outbox_macros::transactional_outbox;

/// Every event type registered by `#[derive(OutboxEvent)]` in this binary; see [`catalog`](mod@catalog).
pub fn catalog() -> Vec<&'static EventInfo> {
    catalog::entries()
}

/// Re-exported so that users and generated code name the same `sqlx`.
pub use sqlx;

/// What generated code needs. Not a public API: it changes without notice.
#[doc(hidden)]
pub mod __private {
    pub use ::core::option::Option;
    pub use ::core::result::Result;
    pub use ::inventory;
    pub use ::serde;
    pub use ::std::string::String;

    /// Asserted by `#[derive(OutboxEvent)]` on the type, so that a payload that is not
    /// `Serialize` is reported there, saying what to add.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be an outbox event: it does not implement `serde::Serialize`",
        label = "the payload of an outbox event is serialized to JSON unless the derive names another codec",
        note = "add `#[derive(serde::Serialize)]` to `{Self}`, or `#[outbox(codec = protobuf)]` (a prost::Message) or `codec = bytes`"
    )]
    pub trait SerializableEvent {}
    impl<T: ?Sized + ::serde::Serialize> SerializableEvent for T {}
    /// Compiles only for a `Serialize` type.
    pub const fn assert_serialize<T: ?Sized + SerializableEvent>() {}

    pub use crate::codec::{AVRO, CodecError, Decode, Encode, OCTET_STREAM, PROTOBUF, bytes};
    pub use crate::payload::JSON;
    pub use ::std::borrow::Cow;
    pub use ::std::vec::Vec;

    /// Asserted by `#[outbox(codec = protobuf)]` on the type.
    #[cfg(feature = "protobuf")]
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be a Protobuf event: it does not implement `prost::Message`",
        label = "`codec = protobuf` encodes the event with prost",
        note = "add `#[derive(prost::Message)]` (and `Default`) to `{Self}`, or generate it with prost-build"
    )]
    pub trait ProtobufEvent: Sized {
        fn __encode(&self) -> Result<Vec<u8>, CodecError>;
        fn __decode(payload: &[u8]) -> Result<Self, CodecError>;
    }
    #[cfg(feature = "protobuf")]
    impl<T: ::prost::Message + Default> ProtobufEvent for T {
        fn __encode(&self) -> Result<Vec<u8>, CodecError> {
            crate::codec::protobuf::encode(self)
        }
        fn __decode(payload: &[u8]) -> Result<Self, CodecError> {
            crate::codec::protobuf::decode(payload)
        }
    }
    /// Without the `protobuf` feature no type is a Protobuf event.
    #[cfg(not(feature = "protobuf"))]
    #[diagnostic::on_unimplemented(
        message = "`codec = protobuf` needs the `protobuf` feature of outbox",
        label = "Protobuf events are encoded by prost, behind a feature",
        note = "enable it: `outbox = {{ version = \"...\", features = [\"protobuf\"] }}`"
    )]
    pub trait ProtobufEvent: Sized {
        fn __encode(&self) -> Result<Vec<u8>, CodecError>;
        fn __decode(payload: &[u8]) -> Result<Self, CodecError>;
    }
    /// Compiles only for a `prost::Message` (with the `protobuf` feature).
    pub const fn assert_protobuf<T: ProtobufEvent>() {}
    #[cfg(feature = "protobuf")]
    pub use crate::codec::protobuf;
    /// Without the feature, what the derive names exists, so that the one error is
    /// `assert_protobuf`'s, saying to turn the feature on.
    #[cfg(not(feature = "protobuf"))]
    pub mod protobuf {
        pub fn reads(_: &str) -> bool {
            false
        }
    }

    pub use crate::codec::Decoder;

    /// Asserted by `#[outbox(codec = avro)]` on the type; what its `OutboxEvent` impl
    /// calls.
    #[cfg(feature = "avro")]
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot be an Avro event: it needs `apache_avro::AvroSchema`, `serde::Serialize` and `serde::Deserialize`",
        label = "`codec = avro` encodes the event with apache-avro's serde support",
        note = "add `#[derive(apache_avro::AvroSchema, serde::Serialize, serde::Deserialize)]` to `{Self}`"
    )]
    pub trait AvroEvent: Sized {
        fn __encode(&self) -> Result<Vec<u8>, CodecError>;
        fn __decoder() -> Decoder<Self>;
        fn __schema() -> ::serde_json::Value;
    }
    #[cfg(feature = "avro")]
    impl<T> AvroEvent for T
    where
        T: ::apache_avro::AvroSchema + ::serde::Serialize + ::serde::de::DeserializeOwned + 'static,
    {
        fn __encode(&self) -> Result<Vec<u8>, CodecError> {
            crate::codec::avro::encode(self)
        }
        fn __decoder() -> Decoder<Self> {
            Decoder {
                format: "Avro",
                reads: crate::codec::avro::reads,
                decode: crate::codec::avro::decode::<T>,
            }
        }
        fn __schema() -> ::serde_json::Value {
            crate::codec::avro::schema_json::<T>()
        }
    }
    /// Without the `avro` feature no type is an Avro event.
    #[cfg(not(feature = "avro"))]
    #[diagnostic::on_unimplemented(
        message = "`codec = avro` needs the `avro` feature of outbox",
        label = "Avro events are encoded by apache-avro, behind a feature",
        note = "enable it: `outbox = {{ version = \"...\", features = [\"avro\"] }}`"
    )]
    pub trait AvroEvent: Sized {
        fn __encode(&self) -> Result<Vec<u8>, CodecError>;
        fn __decoder() -> Decoder<Self>;
        fn __schema() -> ::serde_json::Value;
    }
    /// Compiles only for an Avro event (with the `avro` feature).
    pub const fn assert_avro<T: AvroEvent>() {}

    pub use crate::catalog::probe::{
        NoAvroSchema, NoJsonSchema, Probe, ViaAvroSchema, ViaJsonSchema, none as no_schema,
        proto as proto_schema,
    };
    pub use crate::catalog::{EventInfo, SchemaGen};
    pub use crate::store::default::DefaultBackend;
    pub use crate::transactional::{FromOutboxError, begin, commit, rollback};
    pub use crate::{Destination, Outbox, OutboxEvent, OutboxTx, PartitionKey};
}
