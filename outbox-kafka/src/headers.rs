//! The Kafka headers the publisher writes and the consumer reads: the broker-neutral
//! names of [`outbox_core::publisher::headers`] (the partition key is the Kafka key).
//!
//! | header | value |
//! | --- | --- |
//! | [`MESSAGE_ID`] `message-id` | the outbox message id (UUIDv7), the consumer's deduplication key |
//! | [`EVENT_TYPE`] `event-type` | the event type name, the consumer's dispatch key |
//! | [`EVENT_VERSION`] `event-version` | the schema version, only when the event has one |
//! | [`CONTENT_TYPE`] `content-type` | `application/json` |
//! | `traceparent`, ... | every header stored with the row (W3C trace context, correlation ids) |
//!
//! A row header with one of the reserved names above is not copied (the publisher's
//! value wins).
//!
//! With [`cloudevents`](crate::KafkaPublisherBuilder::cloudevents), every message also
//! carries the CloudEvents attributes as `ce_*` headers (`ce_id`, `ce_source`,
//! `ce_specversion`, `ce_type`, `ce_time`); row headers named `ce_*` are then not copied.

pub use outbox_core::publisher::headers::{
    CONTENT_TYPE, EVENT_TYPE, EVENT_VERSION, JSON, MESSAGE_ID, TRACEPARENT,
};

/// Headers the publisher sets itself; row headers with these names are not copied.
pub const RESERVED: [&str; 4] = [MESSAGE_ID, EVENT_TYPE, EVENT_VERSION, CONTENT_TYPE];

/// The prefix of the CloudEvents attribute headers (the Kafka binding's binary mode).
pub const CLOUDEVENTS_PREFIX: &str = "ce_";
