//! The header names every publisher writes and every consumer reads, whatever the
//! broker, so that consumers can share their decoding.
//!
//! | header | value |
//! | --- | --- |
//! | [`MESSAGE_ID`] `message-id` | the outbox message id (UUIDv7), the consumer's deduplication key |
//! | [`EVENT_TYPE`] `event-type` | the event type name, the consumer's dispatch key |
//! | [`EVENT_VERSION`] `event-version` | the schema version, only when the event has one |
//! | [`CONTENT_TYPE`] `content-type` | the message's content type ([`JSON`] unless the event says otherwise) |
//! | [`PARTITION_KEY`] `partition-key` | the partition key, where the broker has no key of its own |
//! | `traceparent`, ... | every header stored with the row (W3C trace context, correlation ids) |

/// The message id header.
pub const MESSAGE_ID: &str = "message-id";
/// The event type header.
pub const EVENT_TYPE: &str = "event-type";
/// The schema version header (absent for unversioned events).
pub const EVENT_VERSION: &str = "event-version";
/// The content type header.
pub const CONTENT_TYPE: &str = "content-type";
/// The content type of a JSON payload (the default).
pub use crate::payload::JSON;
/// The partition key header, for brokers whose messages have no key (NATS, AMQP).
pub const PARTITION_KEY: &str = "partition-key";
/// The W3C trace context header, copied from the row's headers when present.
pub const TRACEPARENT: &str = "traceparent";
/// W3C trace context: vendor-specific trace state, next to [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";
