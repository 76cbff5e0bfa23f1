//! What every database's SQL shares: the claim's byte budget, and decoding rows into
//! [`OutboxRecord`] and [`MessageInfo`] (one decoder each, for every database: ids,
//! payloads and headers are selected as text).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Row, Type};
use uuid::Uuid;

use crate::model::{MessageInfo, MessageState};
use crate::publisher::OutboxRecord;

type SqlResult<T> = Result<T, sqlx::Error>;

/// The columns a claim selects, as the row decoders read them. `text(column)` renders a
/// column as text in the database's dialect.
pub(crate) fn claim_columns(text: impl Fn(&str) -> String) -> String {
    format!(
        "o.seq, {} AS id, {} AS event_type, o.event_version, {} AS destination, \
         {} AS partition_key, {} AS payload, {} AS headers, o.created_at, o.attempts",
        text("o.id"),
        text("o.event_type"),
        text("o.destination"),
        text("o.partition_key"),
        text("o.payload"),
        text("o.headers"),
    )
}

/// The columns a listing selects, as [`message`] reads them.
pub(crate) fn message_columns(text: impl Fn(&str) -> String) -> String {
    let text = [
        "id",
        "event_type",
        "destination",
        "partition_key",
        "payload",
        "headers",
        "last_error",
    ]
    .map(|column| format!("{} AS {column}", text(column)))
    .join(", ");
    format!("seq, {text}, event_version, created_at, sent_at, attempts, next_attempt_at, dead_at")
}

/// One claimed row (selected with [`claim_columns`]) as a record.
pub(crate) fn record<R>(row: &R) -> SqlResult<OutboxRecord>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    i32: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    DateTime<Utc>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
{
    let seq: i64 = row.try_get("seq")?;
    Ok(OutboxRecord {
        seq,
        id: uuid(&row.try_get::<String, _>("id")?)?,
        event_type: row.try_get("event_type")?,
        event_version: row.try_get("event_version")?,
        destination: row.try_get("destination")?,
        partition_key: row.try_get("partition_key")?,
        payload: row.try_get("payload")?,
        headers: headers(seq, &row.try_get::<String, _>("headers")?),
        created_at: row.try_get("created_at")?,
        attempts: row.try_get("attempts")?,
    })
}

/// One listed row (selected with [`message_columns`]).
pub(crate) fn message<R>(row: &R) -> SqlResult<MessageInfo>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    i32: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    DateTime<Utc>: for<'r> Decode<'r, R::Database> + Type<R::Database>,
{
    let sent_at: Option<DateTime<Utc>> = row.try_get("sent_at")?;
    let dead_at: Option<DateTime<Utc>> = row.try_get("dead_at")?;
    let attempts: i32 = row.try_get("attempts")?;
    let last_error: Option<String> = row.try_get("last_error")?;
    // Failed before: `model::state::FAILED`.
    let failed = attempts > 0 || last_error.is_some();
    Ok(MessageInfo {
        seq: row.try_get("seq")?,
        id: uuid(&row.try_get::<String, _>("id")?)?,
        state: MessageState::of(sent_at.is_some(), dead_at.is_some(), failed),
        event_type: row.try_get("event_type")?,
        event_version: row.try_get("event_version")?,
        destination: row.try_get("destination")?,
        partition_key: row.try_get("partition_key")?,
        created_at: row.try_get("created_at")?,
        sent_at,
        attempts,
        next_attempt_at: row.try_get("next_attempt_at")?,
        last_error,
        dead_at,
        payload: json(&row.try_get::<String, _>("payload")?)?,
        headers: json(&row.try_get::<String, _>("headers")?)?,
        held_back: row.try_get("held_back")?,
    })
}

/// A message id stored or selected as text.
pub(crate) fn uuid(text: &str) -> SqlResult<Uuid> {
    Uuid::parse_str(text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

fn json(text: &str) -> SqlResult<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

/// `claim` (a `SELECT` of claimable rows with `payload` and `headers` as text, in `seq`
/// order, with its `LIMIT`) cut where its rows' payloads and headers reach `budget` bytes
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
