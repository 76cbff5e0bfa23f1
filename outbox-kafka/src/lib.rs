//! Kafka for the outbox framework, built on `rdkafka`: a [`KafkaPublisher`] for the
//! relay, and a [`KafkaTransport`] for [`outbox_core::consumer::Consumer`], which
//! dispatches messages to typed handlers and runs each in an
//! [`Inbox`](outbox_core::inbox::Inbox) transaction, so every event takes effect once.
//!
//! ```no_run
//! use outbox_core::consumer::{Consumer, Policy};
//! use outbox_core::inbox::Inbox;
//! use outbox_core::relay::Relay;
//! use outbox_core::{Outbox, OutboxEvent};
//! use outbox_kafka::{KafkaPublisher, KafkaTransport};
//!
//! #[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
//! #[outbox(destination = "orders.events", key = order_id)]
//! struct OrderConfirmed {
//!     order_id: i64,
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::connect("postgres://postgres@127.0.0.1/test").await?;
//! outbox.migrate().await?;
//!
//! // Publishing: checks at start-up that `orders.events` (every catalog destination) exists.
//! let publisher = KafkaPublisher::builder("127.0.0.1:9092")
//!     .linger(std::time::Duration::from_millis(5))
//!     .compression("lz4")
//!     .set("client.id", "order-service") // any librdkafka property
//!     .build()
//!     .await?;
//! let relay = Relay::builder(outbox.clone(), publisher).spawn();
//!
//! // Consuming: each message runs once in effect, in one transaction with its effect.
//! let transport = KafkaTransport::builder("127.0.0.1:9092", "billing")
//!     .topic("orders.events")
//!     .build()
//!     .await?;
//! let consumer = Consumer::builder(transport, Inbox::new(&outbox, "billing"))
//!     .on::<OrderConfirmed, _>(|tx, msg| {
//!         Box::pin(async move {
//!             outbox_core::sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
//!                 .bind(msg.event.order_id)
//!                 .execute(&mut **tx)
//!                 .await?;
//!             Ok(())
//!         })
//!     })
//!     .on_unknown_event_type(Policy::Skip)
//!     .build()?
//!     .spawn();
//!
//! // ... on shutdown:
//! consumer.shutdown().await?;
//! relay.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # Publisher
//! [`KafkaPublisher`] uses an idempotent producer (`enable.idempotence=true`,
//! `acks=all`): destination → topic, partition key → message key (so one key stays on
//! one partition, in order), the payload as stored, and the [`headers`]. A batch is
//! pipelined and each delivery report becomes that message's result. Too large or
//! invalid messages are dead-lettered at once ([permanent]); everything else, an unknown
//! topic included, is retried. After a message timed out, the producer is replaced,
//! because librdkafka's idempotent producer does not recover from that by itself.
//!
//! # Consumer
//! [`KafkaTransport`] is the Kafka side of [`outbox_core::consumer::Consumer`] (typed
//! dispatch, the inbox transaction, policies and per-key scheduling live there). It
//! stores a message's offset for commit only after that message's transaction committed
//! and every earlier message of its partition was done, and writes dead letters to a
//! topic.
//!
//! Settings, headers, error classification and outage behaviour: [`docs/kafka.md`](https://github.com/outbox-rs/outbox/blob/main/docs/kafka.md);
//! consumers of every broker, their policies and guarantees: [`docs/consumers.md`](https://github.com/outbox-rs/outbox/blob/main/docs/consumers.md).
//!
//! [permanent]: outbox_core::publisher::PublishError::permanent
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod consumer;
mod error;
pub mod headers;
mod publisher;
mod settings;
mod topics;

pub use consumer::{KafkaToken, KafkaTransport, KafkaTransportBuilder};
pub use error::{Error, Result};
pub use publisher::{KafkaPublisher, KafkaPublisherBuilder};
pub use settings::{Settings, is_secret};

pub use rdkafka;
