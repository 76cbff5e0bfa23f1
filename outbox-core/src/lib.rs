//! # outbox
//!
//! The transactional outbox for Rust: write events into an outbox table in the **same**
//! database transaction as your business change, so a change and its events commit or
//! roll back together. A relay then publishes pending rows to your broker.
//!
//! ```no_run
//! use outbox_core::{destinations, Destination, Outbox, OutboxEvent};
//!
//! destinations! {
//!     /// Everything the order service announces.
//!     pub ORDER_EVENTS = "orders.events";
//! }
//!
//! #[derive(serde::Serialize)]
//! struct OrderConfirmed { order_id: i64 }
//!
//! impl OutboxEvent for OrderConfirmed {
//!     fn event_type(&self) -> &'static str { "OrderConfirmed" }
//!     fn destination(&self) -> Destination { ORDER_EVENTS }
//!     fn partition_key(&self) -> Option<String> { Some(self.order_id.to_string()) }
//! }
//!
//! # async fn demo() -> outbox_core::Result<()> {
//! let outbox = Outbox::connect("postgres://postgres@127.0.0.1/test").await?;
//! outbox.migrate().await?;
//!
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
//! ## Guarantees
//! - **Atomic write**: events emitted in an [`OutboxTx`] are written in one statement
//!   just before commit; they exist if and only if the transaction commits.
//! - **At-least-once delivery**: a message is marked sent only after the broker
//!   acknowledged it; a crash in between publishes it again. Consumers deduplicate on the
//!   message id (a UUIDv7).
#![warn(missing_docs)]

pub mod catalog;
pub mod config;
mod error;
pub mod event;
mod key;
pub mod migrate;
mod outbox;
pub mod store;
mod transactional;
mod tx;

pub use config::{TableName, Tables};
pub use error::{Error, Result};
pub use catalog::EventInfo;
pub use event::{Destination, OutboxEvent, OutboxMessage};
pub use key::PartitionKey;
pub use outbox::{Outbox, OutboxBuilder};
pub use store::Backend;
pub use tx::OutboxTx;

/// `#[derive(OutboxEvent)]` and `#[transactional_outbox]`; see `docs/macros.md`.
#[cfg(feature = "macros")]
pub use outbox_macros::{OutboxEvent, transactional_outbox};

/// Every event type registered by `#[derive(OutboxEvent)]` in this binary; see [`catalog`].
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
    pub use ::serde_json;
    pub use ::sqlx;
    pub use ::sqlx::Postgres;
    pub use ::std::string::String;

    pub use crate::catalog::EventInfo;
    pub use crate::transactional::{FromOutboxError, begin, commit, rollback};
    pub use crate::{Destination, Outbox, OutboxEvent, OutboxTx, PartitionKey};
}

/// The README's example compiles (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
