//! The Kafka headers the publisher writes and the consumer reads.
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

/// The message id header.
pub const MESSAGE_ID: &str = "message-id";
/// The event type header.
pub const EVENT_TYPE: &str = "event-type";
/// The schema version header (absent for unversioned events).
pub const EVENT_VERSION: &str = "event-version";
/// The content type header.
pub const CONTENT_TYPE: &str = "content-type";
/// The content type of every payload: outbox payloads are JSON.
pub const JSON: &str = "application/json";
/// The W3C trace context header, copied from the row's headers when present.
pub const TRACEPARENT: &str = "traceparent";

/// Headers the publisher sets itself; row headers with these names are not copied.
pub const RESERVED: [&str; 4] = [MESSAGE_ID, EVENT_TYPE, EVENT_VERSION, CONTENT_TYPE];
