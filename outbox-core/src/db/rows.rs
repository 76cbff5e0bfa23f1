//! What every database's SQL shares: the claim's byte budget, and decoding rows into
//! [`OutboxRecord`], [`MessageInfo`], a [`Status`] and [`DeadGroup`]s (one decoder each,
//! for every database: ids, payloads and headers are selected as text).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Row, Type};
use uuid::Uuid;

use crate::Payload;
use crate::model::{
    ConsumerInstance, ConsumerStatus, DeadGroup, DestinationStatus, FailingMessage, MessageInfo,
    MessageState, Status, total,
};
use crate::publisher::OutboxRecord;

type SqlResult<T> = Result<T, sqlx::Error>;

/// The columns a claim selects, as the row decoders read them. `text(column)` renders a
/// column as text in the database's dialect; `payload(prefix)` the payload's bytes of
/// the row `prefix` names (`"o."`): the `body` column, or, in a row written before
/// payloads were bytes, the bytes it was published with then.
pub(crate) fn claim_columns(
    text: impl Fn(&str) -> String,
    payload: impl Fn(&str) -> String,
) -> String {
    format!(
        "o.seq, {} AS id, {} AS event_type, o.event_version, {} AS destination, \
         {} AS partition_key, {} AS payload, {} AS content_type, {} AS headers, o.created_at, \
         o.attempts",
        text("o.id"),
        text("o.event_type"),
        text("o.destination"),
        text("o.partition_key"),
        payload("o."),
        text("o.content_type"),
        text("o.headers"),
    )
}

/// The columns a listing selects, as [`message`] reads them.
pub(crate) fn message_columns(
    text: impl Fn(&str) -> String,
    payload: impl Fn(&str) -> String,
) -> String {
    let text = [
        "id",
        "event_type",
        "destination",
        "partition_key",
        "content_type",
        "headers",
        "last_error",
    ]
    .map(|column| format!("{} AS {column}", text(column)))
    .join(", ");
    format!(
        "seq, {text}, {} AS payload, event_version, created_at, sent_at, attempts, \
         next_attempt_at, dead_at",
        payload("")
    )
}

/// One claimed row (selected with [`claim_columns`]) as a record.
pub(crate) fn record<R: Decode>(row: &R) -> SqlResult<OutboxRecord> {
    row.to_record()
}

/// One listed row (selected with [`message_columns`]).
pub(crate) fn message<R: Decode>(row: &R) -> SqlResult<MessageInfo> {
    row.to_message()
}

/// The rows of a status query, one per destination (`destination`, `pending`,
/// `in_retry`, `dead`), as a [`Status`] with its totals; `oldest_age` reads a row's age
/// of its oldest pending message (seconds).
pub(crate) fn status<R: Decode>(
    rows: &[R],
    oldest_age: impl Fn(&R) -> SqlResult<Option<f64>>,
) -> SqlResult<Status> {
    let mut status = Status::default();
    for row in rows {
        status
            .destinations
            .push(row.to_destination(oldest_age(row)?)?);
    }
    total(&mut status);
    Ok(status)
}

/// The columns of the failing messages, as [`consumers`] reads them.
pub(crate) fn failing_columns(text: impl Fn(&str) -> String) -> String {
    format!(
        "consumer, {} AS message_id, event_type, partition_key, origin, attempts, \
         first_failed_at, last_failed_at, last_error",
        text("message_id")
    )
}

/// The columns of the consumer instances, as [`consumers`] reads them (with `now`, the
/// database's clock).
pub(crate) fn instance_columns(text: impl Fn(&str) -> String) -> String {
    format!(
        "consumer, {} AS instance, transport, interval_ms, started_at, seen_at, handled, \
         handler_errors, lag",
        text("instance")
    )
}

/// The consumers, from the processed table's recent counts (`consumer`, count, latest
/// `processed_at`), the instances' heartbeat rows (selected with [`instance_columns`])
/// and the failing messages' rows (selected with [`failing_columns`], longest failing
/// first), by consumer name.
pub(crate) fn consumers<R: Decode>(
    processed: Vec<(String, i64, Option<DateTime<Utc>>)>,
    instances: &[R],
    failing: &[R],
) -> SqlResult<Vec<ConsumerStatus>> {
    let mut by_name = BTreeMap::<String, ConsumerStatus>::new();
    for (consumer, n, last) in processed {
        let entry = by_name.entry(consumer.clone()).or_default();
        entry.consumer = consumer;
        entry.processed_last_minute = n;
        entry.last_processed_at = last;
    }
    for row in instances {
        let (consumer, instance) = row.to_instance()?;
        let entry = by_name.entry(consumer.clone()).or_default();
        entry.consumer = consumer;
        entry.instances.push(instance);
    }
    for c in by_name.values_mut() {
        c.lag = lag(&c.instances);
    }
    for row in failing {
        let (consumer, message) = row.to_failing()?;
        let entry = by_name.entry(consumer.clone()).or_default();
        entry.consumer = consumer;
        entry.failing.push(message);
    }
    Ok(by_name.into_values().collect())
}

/// A consumer's lag from its live instances' reports: a Kafka instance reports the
/// partitions it was assigned, so the group's lag is their sum; the others report the
/// one durable's or queue's count, each at its own moment, and the largest stands for
/// it. `None` when no live instance reported one.
pub(crate) fn lag(instances: &[crate::model::ConsumerInstance]) -> Option<i64> {
    let mut live = instances
        .iter()
        .filter(|i| i.alive)
        .filter_map(|i| Some((i.transport.as_str(), i.lag?)))
        .peekable();
    live.peek()?;
    let (kafka, others): (Vec<_>, Vec<_>) = live.partition(|(t, _)| *t == "kafka");
    Some(
        kafka.iter().map(|(_, l)| l).sum::<i64>()
            + others.iter().map(|(_, l)| *l).max().unwrap_or(0),
    )
}

/// A row of the dead letters grouped by error: (error, count, lowest `seq`).
pub(crate) fn dead_group((error, count, first_seq): (String, i64, i64)) -> DeadGroup {
    DeadGroup {
        error,
        count,
        first_seq,
    }
}

/// The decoders, for a row of any database that decodes the outbox's column types: a
/// trait with one blanket impl, so that sqlx's bounds are written once (bounds in a
/// `where` clause are not implied where a function uses them).
pub(crate) trait Decode: Row {
    /// See [`record`].
    fn to_record(&self) -> SqlResult<OutboxRecord>;
    /// See [`message`].
    fn to_message(&self) -> SqlResult<MessageInfo>;
    /// One row of [`status`].
    fn to_destination(&self, oldest_age: Option<f64>) -> SqlResult<DestinationStatus>;
    /// One failing message of [`consumers`], with its consumer's name.
    fn to_failing(&self) -> SqlResult<(String, FailingMessage)>;
    /// One instance of [`consumers`], with its consumer's name.
    fn to_instance(&self) -> SqlResult<(String, ConsumerInstance)>;
}

impl<R> Decode for R
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + Type<R::Database>,
    i32: for<'r> sqlx::Decode<'r, R::Database> + Type<R::Database>,
    String: for<'r> sqlx::Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: for<'r> sqlx::Decode<'r, R::Database> + Type<R::Database>,
    DateTime<Utc>: for<'r> sqlx::Decode<'r, R::Database> + Type<R::Database>,
{
    fn to_record(&self) -> SqlResult<OutboxRecord> {
        let seq: i64 = self.try_get("seq")?;
        Ok(OutboxRecord {
            seq,
            id: uuid(&self.try_get::<String, _>("id")?)?,
            event_type: self.try_get("event_type")?,
            event_version: self.try_get("event_version")?,
            destination: self.try_get("destination")?,
            partition_key: self.try_get("partition_key")?,
            payload: Payload::from(self.try_get::<Vec<u8>, _>("payload")?),
            content_type: self.try_get::<String, _>("content_type")?.into(),
            headers: headers(seq, &self.try_get::<String, _>("headers")?),
            created_at: self.try_get("created_at")?,
            attempts: self.try_get("attempts")?,
        })
    }

    fn to_message(&self) -> SqlResult<MessageInfo> {
        let sent_at: Option<DateTime<Utc>> = self.try_get("sent_at")?;
        let dead_at: Option<DateTime<Utc>> = self.try_get("dead_at")?;
        let attempts: i32 = self.try_get("attempts")?;
        let last_error: Option<String> = self.try_get("last_error")?;
        // Failed before: `model::state::FAILED`.
        let failed = attempts > 0 || last_error.is_some();
        let content_type: String = self.try_get("content_type")?;
        Ok(MessageInfo {
            seq: self.try_get("seq")?,
            id: uuid(&self.try_get::<String, _>("id")?)?,
            state: MessageState::of(sent_at.is_some(), dead_at.is_some(), failed),
            event_type: self.try_get("event_type")?,
            event_version: self.try_get("event_version")?,
            destination: self.try_get("destination")?,
            partition_key: self.try_get("partition_key")?,
            created_at: self.try_get("created_at")?,
            sent_at,
            attempts,
            next_attempt_at: self.try_get("next_attempt_at")?,
            last_error,
            dead_at,
            payload: shown(&self.try_get::<Vec<u8>, _>("payload")?, &content_type),
            content_type,
            headers: json(&self.try_get::<String, _>("headers")?)?,
            held_back: self.try_get("held_back")?,
        })
    }

    fn to_destination(&self, oldest_age: Option<f64>) -> SqlResult<DestinationStatus> {
        Ok(DestinationStatus {
            destination: self.try_get("destination")?,
            pending: self.try_get("pending")?,
            in_retry: self.try_get("in_retry")?,
            dead: self.try_get("dead")?,
            oldest_pending_age_seconds: oldest_age,
        })
    }

    fn to_instance(&self) -> SqlResult<(String, ConsumerInstance)> {
        let now: DateTime<Utc> = self.try_get("now")?;
        let seen_at: DateTime<Utc> = self.try_get("seen_at")?;
        let interval_ms: i64 = self.try_get("interval_ms")?;
        let seen_seconds_ago = (now - seen_at).as_seconds_f64().max(0.0);
        Ok((
            self.try_get("consumer")?,
            ConsumerInstance {
                instance: uuid(&self.try_get::<String, _>("instance")?)?,
                transport: self.try_get("transport")?,
                started_at: self.try_get("started_at")?,
                seen_at,
                seen_seconds_ago,
                alive: seen_seconds_ago * 1000.0 <= 3.0 * interval_ms as f64,
                handled: self.try_get("handled")?,
                handler_errors: self.try_get("handler_errors")?,
                lag: self.try_get("lag")?,
            },
        ))
    }

    fn to_failing(&self) -> SqlResult<(String, FailingMessage)> {
        Ok((
            self.try_get("consumer")?,
            FailingMessage {
                message_id: uuid(&self.try_get::<String, _>("message_id")?)?,
                event_type: self.try_get("event_type")?,
                partition_key: self.try_get("partition_key")?,
                origin: self.try_get("origin")?,
                attempts: self.try_get("attempts")?,
                first_failed_at: self.try_get("first_failed_at")?,
                failing_seconds: 0.0,
                last_failed_at: self.try_get("last_failed_at")?,
                last_error: self.try_get("last_error")?,
            },
        ))
    }
}

/// A message id stored or selected as text.
pub(crate) fn uuid(text: &str) -> SqlResult<Uuid> {
    Uuid::parse_str(text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// A payload as a listing shows it: its JSON when it says it is JSON (and is), else its
/// bytes in base64.
fn shown(payload: &[u8], content_type: &str) -> serde_json::Value {
    use base64::Engine as _;
    if crate::payload::is_json(content_type)
        && let Ok(value) = serde_json::from_slice(payload)
    {
        return value;
    }
    serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(payload))
}

fn json(text: &str) -> SqlResult<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// `claim` (a `SELECT` of claimable rows with `payload` as bytes and `headers` as text, in
/// `seq` order, with its `LIMIT`) cut where its rows' payloads and headers reach `budget` bytes
/// (a placeholder): the rows before the one that crosses it, and that one, so a batch
/// always has a row and the server sends no more than the budget (plus one row).
/// `length` is the database's byte length of the text `%`.
pub(crate) fn budgeted(claim: &str, length: &str, budget: &str) -> String {
    let bytes = format!(
        "({} + {})",
        length.replace('%', "c.payload"),
        length.replace('%', "c.headers")
    );
    format!(
        "SELECT * FROM (\
           SELECT c.*, SUM({bytes}) OVER (ORDER BY c.seq) - {bytes} AS bytes_before \
           FROM ({claim}) c) w \
         WHERE w.bytes_before < {budget} ORDER BY w.seq"
    )
}

/// Decodes claimed rows as they arrive, so that a batch is never held twice (as rows
/// and as records). Its size is bounded by the claim statement ([`budgeted`]).
pub(crate) async fn decode_each<R, E>(
    rows: impl futures_util::Stream<Item = Result<R, E>>,
    decode: impl Fn(&R) -> SqlResult<OutboxRecord>,
) -> SqlResult<Vec<OutboxRecord>>
where
    sqlx::Error: From<E>,
{
    use futures_util::TryStreamExt;
    let mut rows = std::pin::pin!(rows);
    let mut batch = Vec::new();
    while let Some(row) = rows.try_next().await? {
        batch.push(decode(&row)?);
    }
    Ok(batch)
}

/// Headers written by hand may hold non-string values: they are passed on as JSON text
/// rather than blocking the relay on one row.
pub(crate) fn headers(seq: i64, text: &str) -> BTreeMap<String, String> {
    if text == "{}" {
        return BTreeMap::new();
    }
    match serde_json::from_str::<BTreeMap<String, serde_json::Value>>(text) {
        Ok(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        Err(e) => {
            tracing::warn!(seq, error = %e, "outbox row's headers are not a JSON object; publishing without them");
            BTreeMap::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(transport: &str, alive: bool, lag: Option<i64>) -> crate::model::ConsumerInstance {
        crate::model::ConsumerInstance {
            instance: Uuid::now_v7(),
            transport: transport.to_owned(),
            started_at: Utc::now(),
            seen_at: Utc::now(),
            seen_seconds_ago: 0.0,
            alive,
            handled: 0,
            handler_errors: 0,
            lag,
        }
    }

    #[test]
    fn the_lag_sums_kafka_instances_and_takes_the_largest_of_the_others_live_only() {
        assert_eq!(lag(&[]), None);
        assert_eq!(lag(&[instance("kafka", true, None)]), None);
        assert_eq!(
            lag(&[
                instance("kafka", true, Some(3)),
                instance("kafka", true, Some(4)),
                instance("kafka", false, Some(100)),
            ]),
            Some(7),
            "each Kafka instance reports its partitions; a gone one is not counted"
        );
        assert_eq!(
            lag(&[
                instance("nats", true, Some(5)),
                instance("nats", true, Some(6)),
                instance("nats", false, Some(50)),
            ]),
            Some(6),
            "NATS instances report the same durable"
        );
        assert_eq!(lag(&[instance("rabbitmq", false, Some(9))]), None);
    }
}
