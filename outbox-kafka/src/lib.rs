//! Kafka publisher and idempotent consumer for the outbox framework, built on `rdkafka`.
//!
//! Not implemented yet: the publisher and the consumer land with the relay. Until then
//! this crate only pins the `rdkafka` dependency the workspace builds and tests with.
#![warn(missing_docs)]

pub use rdkafka;
