//! The Kafka headers the publisher writes and the consumer reads: the broker-neutral
//! names of [`outbox_core::publisher::headers`] (the partition key is the Kafka key).
//!
//! | header | value |
//! | --- | --- |
//! | [`MESSAGE_ID`] `message-id` | the outbox message id (UUIDv7), the consumer's deduplication key |
//! | [`EVENT_TYPE`] `event-type` | the event type name, the consumer's dispatch key |
//! | [`EVENT_VERSION`] `event-version` | the schema version, only when the event has one |
//! | [`CONTENT_TYPE`] `content-type` | the message's content type (`application/json` unless the event says otherwise) |
//! | `traceparent`, ... | every header stored with the row (W3C trace context, correlation ids) |
//!
//! A row header with one of the reserved names above is not copied (the publisher's
//! value wins).
//!
//! With [`cloudevents`](crate::KafkaPublisherBuilder::cloudevents), every message also
//! carries the CloudEvents attributes as `ce_*` headers (`ce_id`, `ce_source`,
//! `ce_specversion`, `ce_type`, `ce_time`); row headers named `ce_*` are then not copied.

//!
//! The two ends are functions of this module alone (`encode`, `decode`), without
//! librdkafka, so that the fuzz targets in `fuzz/` include this file as it is.

use std::collections::BTreeMap;

use outbox_core::publisher::OutboxRecord;
use outbox_core::publisher::cloudevents::{CloudEvents, is_attribute_header};

pub use outbox_core::publisher::headers::{
    CONTENT_TYPE, EVENT_TYPE, EVENT_VERSION, JSON, MESSAGE_ID, TRACEPARENT,
};

/// Headers the publisher sets itself; row headers with these names are not copied.
pub const RESERVED: [&str; 4] = [MESSAGE_ID, EVENT_TYPE, EVENT_VERSION, CONTENT_TYPE];

/// The prefix of the CloudEvents attribute headers (the Kafka binding's binary mode).
pub const CLOUDEVENTS_PREFIX: &str = "ce_";

/// The headers of `record`, in the order the publisher writes them.
pub(crate) fn encode(
    record: &OutboxRecord,
    cloudevents: Option<&CloudEvents>,
) -> Vec<(String, String)> {
    let mut h = vec![
        (MESSAGE_ID.to_owned(), record.id.to_string()),
        (EVENT_TYPE.to_owned(), record.event_type.clone()),
        (CONTENT_TYPE.to_owned(), record.content_type.to_string()),
    ];
    if let Some(version) = record.event_version {
        h.push((EVENT_VERSION.to_owned(), version.to_string()));
    }
    if let Some(ce) = cloudevents {
        for (name, value) in ce.attributes(record) {
            h.push((format!("{CLOUDEVENTS_PREFIX}{name}"), value));
        }
    }
    for (key, value) in &record.headers {
        let attribute = cloudevents.is_some() && is_attribute_header(key, CLOUDEVENTS_PREFIX);
        if RESERVED.contains(&key.as_str()) || attribute {
            tracing::debug!(id = %record.id, header = %key, "row header shadows a reserved header; not copied");
            continue;
        }
        h.push((key.clone(), value.clone()));
    }
    h
}

/// The headers of a received message as text (bytes that are not UTF-8 replaced by
/// U+FFFD; no value: empty); a header sent twice: its last value.
pub(crate) fn decode<'a>(
    headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
) -> BTreeMap<String, String> {
    headers
        .into_iter()
        .map(|(key, value)| {
            let value = value
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            (key.to_owned(), value)
        })
        .collect()
}
