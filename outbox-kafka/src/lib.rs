//! Kafka for the outbox framework, built on `rdkafka`: a [`KafkaPublisher`] for the
//! relay, and a [`KafkaConsumer`] that dispatches messages to typed handlers and runs
//! each in an [`Inbox`](outbox_core::inbox::Inbox) transaction, so every event takes
//! effect once.
//!
//! placeholder
#![warn(missing_docs)]

mod consumer;
mod error;
pub mod headers;
mod publisher;
mod settings;
mod topics;

pub use consumer::{
    BoxError, ConsumerHandle, ConsumerStats, ConsumerStatsSnapshot, KafkaConsumer,
    KafkaConsumerBuilder, Policy, Received,
};
pub use error::{Error, Result};
pub use publisher::{KafkaPublisher, KafkaPublisherBuilder};
pub use settings::{Settings, is_secret};

pub use rdkafka;
