//! # outbox
//!
//! The transactional outbox for Rust. Your service changes its database and must tell
//! other services about it; writing to the database and then to the broker loses or
//! invents events whenever one of the two fails. `outbox` writes each event into an
//! outbox table in the **same** database transaction as your business change, a relay
//! publishes the pending rows to Kafka, NATS or RabbitMQ (in order per key), and
//! consumers take each message once through an inbox.
//!
//! This crate is the one to depend on: it re-exports the core API (from `outbox-rs-core`),
//! the macros, and each broker behind a feature.
//!
//! ```toml
//! [dependencies]
//! outbox = { version = "0.1", features = ["kafka"] }   # PostgreSQL is the default database
//! ```
//!
//! ## Write events in your transaction
//!
//! ```no_run
//! use outbox::{destinations, transactional_outbox, Outbox, OutboxEvent, OutboxTx};
//!
//! destinations! { pub ORDER_EVENTS = "orders.events"; }  // a typo in a route won't compile
//!
//! #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
//! #[outbox(destination = ORDER_EVENTS, key = order_id)]   // event type "OrderConfirmed"
//! struct OrderConfirmed { order_id: i64 }
//!
//! #[transactional_outbox]     // begins, commits on Ok (with the events), rolls back on Err
//! async fn confirm_order(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), AppError> {
//!     outbox::sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = $1")
//!         .bind(order_id).execute(&mut **tx).await?;
//!     tx.emit(OrderConfirmed { order_id })?;
//!     Ok(())
//! }
//!
//! #[derive(Debug, thiserror::Error)]
//! enum AppError {
//!     #[error(transparent)] Outbox(#[from] outbox::Error),
//!     #[error(transparent)] Db(#[from] outbox::sqlx::Error),
//! }
//!
//! # async fn run() -> Result<(), AppError> {
//! let outbox = Outbox::connect("postgres://postgres@127.0.0.1/app").await?;
//! outbox.migrate().await?;
//! confirm_order(&outbox, 42).await?;  // the macro supplies `tx`
//! # Ok(()) }
//! ```
//!
//! ## Publish them, and consume them once
//!
//! A [`Relay`] publishes what was committed, with any [`Publisher`]: the brokers' are in
//! [`kafka`](crate#features), [`nats`](crate#features) and [`rabbitmq`](crate#features).
//! A [`consumer::Consumer`] takes messages from a broker and runs each handler in a
//! database transaction that also records the message id in an [`inbox::Inbox`], so each
//! event takes effect once and is acknowledged only after that commit.
//!
//! ```no_run
//! # #[cfg(feature = "kafka")]
//! # mod with_kafka {
//! use outbox::consumer::Consumer;
//! use outbox::inbox::Inbox;
//! use outbox::kafka::{KafkaPublisher, KafkaTransport};
//! use outbox::relay::Relay;
//! use outbox::{destinations, Outbox, OutboxEvent};
//!
//! destinations! { pub ORDER_EVENTS = "orders.events"; }
//!
//! #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
//! #[outbox(destination = ORDER_EVENTS, key = order_id)]
//! struct OrderConfirmed { order_id: i64 }
//!
//! async fn relay(outbox: Outbox) -> Result<(), Box<dyn std::error::Error>> {
//!     let kafka = KafkaPublisher::builder("127.0.0.1:9092").build().await?;
//!     let relay = Relay::builder(outbox, kafka).spawn();
//!     // ... until the service stops:
//!     relay.shutdown().await;
//!     Ok(())
//! }
//!
//! async fn invoice(outbox: Outbox) -> Result<(), Box<dyn std::error::Error>> {
//!     let kafka = KafkaTransport::builder("127.0.0.1:9092", "billing")
//!         .topic(ORDER_EVENTS.as_str())
//!         .build()
//!         .await?;
//!     let consumer = Consumer::builder(kafka, Inbox::new(&outbox, "billing"))
//!         .on::<OrderConfirmed, _>(|tx, msg| Box::pin(async move {
//!             outbox::sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
//!                 .bind(msg.event.order_id).execute(&mut **tx).await?;
//!             Ok(())
//!         }))
//!         .build()?
//!         .spawn();
//!     consumer.shutdown().await?;
//!     Ok(())
//! }
//! # }
//! ```
//!
//! ## Databases
//!
//! [`Outbox`] is `Outbox<Postgres>`: PostgreSQL is the database every handle uses when
//! none is named, with the `postgres` feature only. With `mysql` or `sqlite`, name it:
//! `Outbox<outbox::sqlx::MySql>`, `OutboxTx<'_, outbox::sqlx::Sqlite>`. Features add
//! up: turning one on never changes what code written without it means, and a MySQL or
//! SQLite build compiles no PostgreSQL code. The `sqlx` the outbox shares your
//! transaction with is re-exported as [`sqlx`]: use the same major version in your own
//! code.
//!
//! ## Features
//!
#![doc = document_features::document_features!()]
//!
//! The guide, the guarantees and every document are in the
//! [repository](https://github.com/outbox-rs/outbox#readme).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[doc(inline)]
pub use outbox_core::*;

/// The Kafka publisher and consumer transport (the `kafka` feature): `outbox-rs-kafka`.
#[cfg(feature = "kafka")]
#[doc(inline)]
pub use outbox_kafka as kafka;

/// The NATS JetStream publisher and consumer transport (the `nats` feature):
/// `outbox-rs-nats`.
#[cfg(feature = "nats")]
#[doc(inline)]
pub use outbox_nats as nats;

/// The RabbitMQ publisher and consumer transport (the `rabbitmq` feature):
/// `outbox-rs-rabbitmq`.
#[cfg(feature = "rabbitmq")]
#[doc(inline)]
pub use outbox_rabbitmq as rabbitmq;

/// The README's example compiles, through this crate alone (`cargo test --doc -p outbox
/// --features kafka`).
#[cfg(all(doctest, feature = "kafka"))]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
