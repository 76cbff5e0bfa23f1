//! What the fuzz targets share: an arbitrary outbox row, as the relay hands it to a
//! publisher, and the code of modules built without their crate (see `kafka_headers`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use outbox_core::{OutboxMessage, OutboxRecord};
use outbox_core::publisher::cloudevents::CloudEvents;

/// `outbox-kafka`'s header encoder and decoder, compiled from its source file: the
/// crate itself would build librdkafka (C, minutes) for two pure functions.
#[path = "../../outbox-kafka/src/headers.rs"]
#[allow(dead_code, reason = "the crate's own items, not all used here")]
pub mod kafka_headers;

/// `outbox-kafka`'s `headers::encode`: the headers the publisher writes for a row.
pub fn kafka_encode(
    record: &OutboxRecord,
    cloudevents: Option<&CloudEvents>,
) -> Vec<(String, String)> {
    kafka_headers::encode(record, cloudevents)
}

/// `outbox-kafka`'s `headers::decode`: the headers the consumer reads from a message.
pub fn kafka_decode<'a>(
    headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
) -> BTreeMap<String, String> {
    kafka_headers::decode(headers)
}

/// The CLI's time parser, compiled from its source file (`outbox-cli` is a binary).
#[path = "../../outbox-cli/src/time.rs"]
#[allow(dead_code, reason = "the crate's own items, not all used here")]
pub mod cli_time;

/// An outbox row with arbitrary text where a producer writes text.
#[derive(Debug, Arbitrary)]
pub struct Row {
    id: u128,
    event_type: String,
    event_version: Option<i32>,
    partition_key: Option<String>,
    headers: BTreeMap<String, String>,
    /// Header names from the reserved and CloudEvents sets, so that shadowing is tried.
    special: Vec<(u8, String)>,
    created_at: i64,
    /// The CloudEvents `source`, when CloudEvents are on (kept only if valid).
    source: Option<String>,
    type_prefix: Option<String>,
}

const SPECIAL: [&str; 16] = [
    "message-id",
    "event-type",
    "event-version",
    "content-type",
    "partition-key",
    "Message-Id",
    "ce_id",
    "ce_type",
    "ce-source",
    "CE-Type",
    "cloudEvents:type",
    "cloudEvents_id",
    "Nats-Msg-Id",
    "traceparent",
    "ce_",
    "ce-",
];

impl Row {
    /// The row as the relay reads it.
    pub fn record(&self) -> OutboxRecord {
        let mut headers = self.headers.clone();
        for (i, value) in &self.special {
            headers.insert(
                SPECIAL[usize::from(*i) % SPECIAL.len()].to_owned(),
                value.clone(),
            );
        }
        let mut message = OutboxMessage::new(self.event_type.clone(), "orders", "{}");
        message.id = uuid::Uuid::from_u128(self.id);
        message.event_version = self.event_version;
        message.partition_key = self.partition_key.clone();
        message.headers = headers;
        let mut record = OutboxRecord::from(message).with_seq(1);
        record.created_at =
            DateTime::<Utc>::from_timestamp(self.created_at % 253_402_300_799, 0).unwrap_or_default();
        record
    }

    /// The CloudEvents settings, if the row asks for them and they are valid.
    pub fn cloudevents(&self) -> Option<CloudEvents> {
        let ce = CloudEvents::new(self.source.clone()?).ok()?;
        match &self.type_prefix {
            Some(prefix) => ce.type_prefix(prefix.clone()).ok(),
            None => Some(ce),
        }
    }
}
