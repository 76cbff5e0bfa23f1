//! Operations on stored messages: status, listings, replay, release and purge. The
//! `outbox` command-line tool is a thin layer over these; they are here so that a service
//! can offer them too (an admin endpoint, a scheduled job).
//!
//! ```no_run
//! # async fn demo(outbox: outbox_core::Outbox) -> outbox_core::Result<()> {
//! use outbox_core::admin::{Admin, ListFilter};
//!
//! let admin = Admin::new(outbox);
//! let status = admin.status().await?;
//! println!("{} pending, {} dead", status.pending, status.dead);
//! for m in admin.dead(&ListFilter::default()).await? {
//!     println!("{} {} {:?}", m.id, m.event_type, m.last_error);
//! }
//! # Ok(()) }
//! ```
//!
//! Every operation that changes rows runs in **one transaction**: it changes everything
//! it was asked to, or, on an error (an unknown id, a message in the wrong state, a lost
//! connection), nothing.
//!
//! # Ordering
//! Replayed and released messages keep their `seq`. The relay publishes pending
//! messages in `seq` order, so a re-queued message goes out **before** the newer pending
//! messages of its partition key, not after them. Messages of its key that were already
//! published stay published: after a replay or a release, consumers see the old message
//! again (replay) or for the first time after newer ones of its key (release). Consumers
//! that deduplicate by id skip a replayed message they recorded as processed: remove
//! those ids from their processed table first if they must handle it again.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use crate::config::locks;
use crate::{Error, Outbox, Result};

/// Where a message is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageState {
    /// Waiting for the relay.
    Pending,
    /// Pending, after a failed attempt: waits for `next_attempt_at`, and holds back the
    /// later messages of its partition key until then.
    InRetry,
    /// Acknowledged by the broker.
    Sent,
    /// Dead-lettered: no more attempts until released.
    Dead,
}

impl MessageState {
    /// How the state is written in messages: `pending`, `in retry`, `sent`, `dead-lettered`.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Pending => "pending",
            MessageState::InRetry => "in retry",
            MessageState::Sent => "sent",
            MessageState::Dead => "dead-lettered",
        }
    }

    fn of(sent: bool, dead: bool, retrying: bool) -> MessageState {
        match (sent, dead, retrying) {
            (true, _, _) => MessageState::Sent,
            (_, true, _) => MessageState::Dead,
            (_, _, true) => MessageState::InRetry,
            _ => MessageState::Pending,
        }
    }
}

impl fmt::Display for MessageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stored message, as listed by [`Admin::pending`] and [`Admin::dead`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct MessageInfo {
    /// Relay order.
    pub seq: i64,
    /// The message id.
    pub id: Uuid,
    /// Where it is in its life.
    pub state: MessageState,
    /// The event type name.
    pub event_type: String,
    /// The payload's schema version.
    pub event_version: Option<i32>,
    /// Topic, exchange or subject.
    pub destination: String,
    /// The partition key.
    pub partition_key: Option<String>,
    /// When the writing transaction started.
    pub created_at: DateTime<Utc>,
    /// When the broker acknowledged it.
    pub sent_at: Option<DateTime<Utc>>,
    /// Failed publish attempts.
    pub attempts: i32,
    /// Retry not before.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The last publish error.
    pub last_error: Option<String>,
    /// When it was dead-lettered.
    pub dead_at: Option<DateTime<Utc>>,
    /// The payload.
    pub payload: serde_json::Value,
    /// The stored headers.
    pub headers: serde_json::Value,
}

/// Which messages [`Admin::pending`] and [`Admin::dead`] list. `Default` lists the first
/// 100 in `seq` order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListFilter {
    /// Only this destination.
    pub destination: Option<String>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this partition key.
    pub key: Option<String>,
    /// Only messages created at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only messages created before this time.
    pub until: Option<DateTime<Utc>>,
    /// Pending listing only: just the messages in retry.
    pub in_retry_only: bool,
    /// At most this many (the oldest first).
    pub limit: u32,
}

impl Default for ListFilter {
    fn default() -> Self {
        ListFilter {
            destination: None,
            event_type: None,
            key: None,
            since: None,
            until: None,
            in_retry_only: false,
            limit: 100,
        }
    }
}

/// Counts per destination; see [`Status`].
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DestinationStatus {
    /// The destination.
    pub destination: String,
    /// Messages waiting for the relay, including those in retry.
    pub pending: i64,
    /// Pending messages waiting for a retry after a failure.
    pub in_retry: i64,
    /// Dead-lettered messages.
    pub dead: i64,
    /// Age of the oldest pending message, from its `created_at`.
    pub oldest_pending_age_seconds: Option<f64>,
}

/// What [`Admin::status`] reports: the state of the queue.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Status {
    /// The outbox table.
    pub table: String,
    /// Messages waiting for the relay, including those in retry.
    pub pending: i64,
    /// Pending messages waiting for a retry after a failure.
    pub in_retry: i64,
    /// Dead-lettered messages.
    pub dead: i64,
    /// Age of the oldest pending message (the relay's `outbox_oldest_pending_age_seconds`).
    pub oldest_pending_age_seconds: Option<f64>,
    /// Relays connected to this outbox now.
    pub relays: i64,
    /// All rows of the table, sent ones included: PostgreSQL's estimate (`reltuples`,
    /// updated by `ANALYZE`/autovacuum), so as not to scan the history; -1 if never analyzed.
    pub rows_estimate: i64,
    /// The same counts per destination, for destinations with pending or dead messages.
    pub destinations: Vec<DestinationStatus>,
}

/// What [`Admin::purge`] deleted, or would delete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Sent messages.
    pub sent: u64,
    /// Dead-lettered messages.
    pub dead: u64,
    /// Nothing was deleted: these are the counts a real run would delete now.
    pub dry_run: bool,
}

/// Operations on the stored messages of one outbox. See the [module](self).
#[derive(Debug, Clone)]
pub struct Admin {
    outbox: Outbox,
}

const COLUMNS: &str = "seq, id, event_type, event_version, destination, partition_key, payload, headers, \
                       created_at, sent_at, attempts, next_attempt_at, last_error, dead_at";

impl Admin {
    /// Operations on `outbox`'s tables.
    pub fn new(outbox: Outbox) -> Self {
        Admin { outbox }
    }

    /// The outbox operated on.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    fn table(&self) -> String {
        self.outbox.tables().outbox.to_string()
    }

    fn quoted(&self) -> String {
        self.outbox.tables().outbox.quoted()
    }

    fn err(&self, context: &'static str) -> impl Fn(sqlx::Error) -> Error + '_ {
        move |e| Error::db(context, &self.table(), e)
    }

    /// Counts of pending, in-retry and dead messages, overall and per destination, the
    /// age of the oldest pending message and the number of connected relays. Reads only
    /// the pending and dead-letter indexes, never the history.
    pub async fn status(&self) -> Result<Status> {
        let t = self.quoted();
        let rows = sqlx::query(&format!(
            "WITH live AS (\
               SELECT destination, created_at, next_attempt_at IS NOT NULL AS retrying, false AS dead \
                 FROM {t} WHERE sent_at IS NULL AND dead_at IS NULL \
               UNION ALL \
               SELECT destination, created_at, false, true FROM {t} WHERE dead_at IS NOT NULL) \
             SELECT destination, \
                    count(*) FILTER (WHERE NOT dead) AS pending, \
                    count(*) FILTER (WHERE retrying AND NOT dead) AS in_retry, \
                    count(*) FILTER (WHERE dead) AS dead, \
                    extract(epoch FROM now() - min(created_at) FILTER (WHERE NOT dead))::float8 AS oldest \
             FROM live GROUP BY destination ORDER BY destination"
        ))
        .fetch_all(self.outbox.pool())
        .await
        .map_err(self.err("reading the outbox status"))?;
        let mut status = Status {
            table: self.table(),
            ..Status::default()
        };
        for row in &rows {
            let d = DestinationStatus {
                destination: row
                    .try_get("destination")
                    .map_err(self.err("reading the outbox status"))?,
                pending: row
                    .try_get("pending")
                    .map_err(self.err("reading the outbox status"))?,
                in_retry: row
                    .try_get("in_retry")
                    .map_err(self.err("reading the outbox status"))?,
                dead: row
                    .try_get("dead")
                    .map_err(self.err("reading the outbox status"))?,
                oldest_pending_age_seconds: row
                    .try_get("oldest")
                    .map_err(self.err("reading the outbox status"))?,
            };
            status.pending += d.pending;
            status.in_retry += d.in_retry;
            status.dead += d.dead;
            status.oldest_pending_age_seconds = match (
                status.oldest_pending_age_seconds,
                d.oldest_pending_age_seconds,
            ) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            status.destinations.push(d);
        }
        let (relays, rows_estimate): (i64, i64) = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
                       AND classid = (c.oid::int4)::oid \
                       AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                       AND objid >= {relays} AND objid < {relays} + {max}), \
                    c.reltuples::int8 \
             FROM pg_class c WHERE c.oid = $1::text::regclass",
            relays = locks::RELAYS,
            max = locks::MAX_RELAYS,
        ))
        .bind(&t)
        .fetch_one(self.outbox.pool())
        .await
        .map_err(self.err("counting the relays"))?;
        status.relays = relays;
        status.rows_estimate = rows_estimate;
        Ok(status)
    }

    /// Pending messages (in retry or not), oldest first.
    pub async fn pending(&self, filter: &ListFilter) -> Result<Vec<MessageInfo>> {
        let state = if filter.in_retry_only {
            "sent_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL"
        } else {
            "sent_at IS NULL AND dead_at IS NULL"
        };
        self.list(state, filter, "listing pending messages").await
    }

    /// Dead-lettered messages, oldest first.
    pub async fn dead(&self, filter: &ListFilter) -> Result<Vec<MessageInfo>> {
        self.list(
            "dead_at IS NOT NULL",
            filter,
            "listing dead-lettered messages",
        )
        .await
    }

    async fn list(
        &self,
        state: &str,
        filter: &ListFilter,
        context: &'static str,
    ) -> Result<Vec<MessageInfo>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM {t} WHERE {state} \
               AND ($1::text IS NULL OR destination = $1) \
               AND ($2::text IS NULL OR event_type = $2) \
               AND ($3::text IS NULL OR partition_key = $3) \
               AND ($4::timestamptz IS NULL OR created_at >= $4) \
               AND ($5::timestamptz IS NULL OR created_at < $5) \
             ORDER BY seq LIMIT $6",
            t = self.quoted()
        ))
        .bind(&filter.destination)
        .bind(&filter.event_type)
        .bind(&filter.key)
        .bind(filter.since)
        .bind(filter.until)
        .bind(i64::from(filter.limit))
        .fetch_all(self.outbox.pool())
        .await
        .map_err(self.err(context))?;
        rows.iter()
            .map(|r| message(r).map_err(self.err(context)))
            .collect()
    }

    /// Re-queues the **sent** messages `ids`, to be published again (after a consumer
    /// lost or mishandled them). Their attempts and errors are reset; they keep their
    /// `seq` (see [Ordering](self#ordering)). Fails without changing anything if an id
    /// is unknown or its message is not sent. Returns how many were re-queued.
    pub async fn replay(&self, ids: &[Uuid]) -> Result<u64> {
        self.requeue(
            ids,
            MessageState::Sent,
            "replayed",
            "only sent messages can be replayed: a pending message is published anyway, and a \
             dead-lettered one is returned with `outbox release`",
            "sent_at = NULL",
        )
        .await
    }

    /// Re-queues every message **sent** at or after `since` and before `until` (by
    /// `sent_at`), optionally only those for `destination`. One transaction; scans the
    /// table (sent messages are not indexed by time). Returns how many were re-queued.
    pub async fn replay_sent_between(
        &self,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        destination: Option<&str>,
    ) -> Result<u64> {
        if since >= until {
            return Err(Error::InvalidArgument(Cow::Owned(format!(
                "the replay window is empty: since ({since}) is not before until ({until}); \
                 give an earlier --since or a later --until"
            ))));
        }
        let context = "re-queuing sent messages";
        let mut tx = self.begin(context).await?;
        let n: i64 = sqlx::query_scalar(&format!(
            "WITH r AS (UPDATE {t} SET sent_at = NULL, attempts = 0, next_attempt_at = NULL, last_error = NULL \
               WHERE sent_at >= $1 AND sent_at < $2 AND ($3::text IS NULL OR destination = $3) \
               RETURNING 1) \
             SELECT count(*) FROM r",
            t = self.quoted()
        ))
        .bind(since)
        .bind(until)
        .bind(destination)
        .fetch_one(&mut *tx)
        .await
        .map_err(self.err(context))?;
        self.notify_and_commit(tx, n > 0, context).await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Returns the **dead-lettered** messages `ids` to pending, with attempts and errors
    /// reset. Fails without changing anything if an id is unknown or its message is not
    /// dead-lettered. Returns how many were released.
    pub async fn release(&self, ids: &[Uuid]) -> Result<u64> {
        self.requeue(
            ids,
            MessageState::Dead,
            "released",
            "only dead-lettered messages can be released (`outbox dead` lists them); a sent one \
             is sent again with `outbox replay`",
            "dead_at = NULL",
        )
        .await
    }

    /// Returns every dead-lettered message with partition key `key` to pending, with
    /// attempts and errors reset. Returns how many were released (0 if none was dead).
    pub async fn release_key(&self, key: &str) -> Result<u64> {
        let context = "releasing dead-lettered messages";
        let mut tx = self.begin(context).await?;
        let n: i64 = sqlx::query_scalar(&format!(
            "WITH r AS (UPDATE {t} SET dead_at = NULL, attempts = 0, next_attempt_at = NULL, last_error = NULL \
               WHERE dead_at IS NOT NULL AND partition_key = $1 RETURNING 1) \
             SELECT count(*) FROM r",
            t = self.quoted()
        ))
        .bind(key)
        .fetch_one(&mut *tx)
        .await
        .map_err(self.err(context))?;
        self.notify_and_commit(tx, n > 0, context).await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Deletes sent messages sent before `sent_before` and dead-lettered messages
    /// dead-lettered before `dead_before`, in one transaction. With `dry_run`, deletes
    /// nothing and counts what would be deleted. For routine clean-up of large
    /// histories prefer [`Retention`](crate::retention::Retention), which deletes in
    /// small batches.
    pub async fn purge(
        &self,
        sent_before: Option<DateTime<Utc>>,
        dead_before: Option<DateTime<Utc>>,
        dry_run: bool,
    ) -> Result<PurgeReport> {
        if sent_before.is_none() && dead_before.is_none() {
            return Err(Error::InvalidArgument(Cow::Borrowed(
                "nothing to purge: give a cutoff for sent messages, dead-lettered messages, or both",
            )));
        }
        let context = "purging messages";
        let t = self.quoted();
        let sql = if dry_run {
            format!(
                "SELECT count(*) FILTER (WHERE sent_at < $1 AND dead_at IS NULL), \
                        count(*) FILTER (WHERE dead_at < $2) \
                 FROM {t} WHERE (sent_at < $1 AND dead_at IS NULL) OR dead_at < $2"
            )
        } else {
            format!(
                "WITH gone AS (DELETE FROM {t} \
                   WHERE (sent_at < $1 AND dead_at IS NULL) OR dead_at < $2 \
                   RETURNING dead_at IS NOT NULL AS dead) \
                 SELECT count(*) FILTER (WHERE NOT dead), count(*) FILTER (WHERE dead) FROM gone"
            )
        };
        let mut tx = self.begin(context).await?;
        let (sent, dead): (i64, i64) = sqlx::query_as(&sql)
            .bind(sent_before)
            .bind(dead_before)
            .fetch_one(&mut *tx)
            .await
            .map_err(self.err(context))?;
        tx.commit().await.map_err(self.err(context))?;
        Ok(PurgeReport {
            sent: u64::try_from(sent).unwrap_or(0),
            dead: u64::try_from(dead).unwrap_or(0),
            dry_run,
        })
    }

    async fn begin(&self, context: &'static str) -> Result<Transaction<'static, Postgres>> {
        self.outbox.pool().begin().await.map_err(self.err(context))
    }

    /// Locks `ids`, checks that all exist and are in state `from`, then applies `set`
    /// (plus the reset of attempts and errors) to them.
    async fn requeue(
        &self,
        ids: &[Uuid],
        from: MessageState,
        operation: &'static str,
        hint: &'static str,
        set: &str,
    ) -> Result<u64> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument(Cow::Borrowed(
                "no message ids given",
            )));
        }
        let context = match from {
            MessageState::Dead => "releasing dead-lettered messages",
            _ => "re-queuing sent messages",
        };
        let t = self.quoted();
        let mut tx = self.begin(context).await?;
        let rows = sqlx::query(&format!(
            "SELECT id, sent_at IS NOT NULL AS sent, dead_at IS NOT NULL AS dead, \
                    next_attempt_at IS NOT NULL AS retrying \
             FROM {t} WHERE id = ANY($1) ORDER BY seq FOR UPDATE"
        ))
        .bind(ids)
        .fetch_all(&mut *tx)
        .await
        .map_err(self.err(context))?;
        let mut states = HashMap::with_capacity(rows.len());
        for row in &rows {
            let state = MessageState::of(
                row.try_get("sent").map_err(self.err(context))?,
                row.try_get("dead").map_err(self.err(context))?,
                row.try_get("retrying").map_err(self.err(context))?,
            );
            states.insert(
                row.try_get::<Uuid, _>("id").map_err(self.err(context))?,
                state,
            );
        }
        for id in ids {
            match states.get(id) {
                None => {
                    return Err(Error::UnknownMessage {
                        table: self.table(),
                        id: *id,
                    });
                }
                Some(state) if *state != from => {
                    return Err(Error::WrongState {
                        id: *id,
                        state: state.as_str(),
                        operation,
                        hint,
                    });
                }
                Some(_) => {}
            }
        }
        let n = sqlx::query(&format!(
            "UPDATE {t} SET {set}, attempts = 0, next_attempt_at = NULL, last_error = NULL \
             WHERE id = ANY($1)"
        ))
        .bind(ids)
        .execute(&mut *tx)
        .await
        .map_err(self.err(context))?
        .rows_affected();
        self.notify_and_commit(tx, n > 0, context).await?;
        Ok(n)
    }

    /// Wakes listening relays when the transaction commits, then commits.
    async fn notify_and_commit(
        &self,
        mut tx: Transaction<'static, Postgres>,
        notify: bool,
        context: &'static str,
    ) -> Result<()> {
        if notify {
            sqlx::query("SELECT pg_notify('outbox_' || $1::text::regclass::oid::text, '')")
                .bind(self.quoted())
                .execute(&mut *tx)
                .await
                .map_err(self.err(context))?;
        }
        tx.commit().await.map_err(self.err(context))
    }
}

fn message(row: &PgRow) -> Result<MessageInfo, sqlx::Error> {
    let sent_at: Option<DateTime<Utc>> = row.try_get("sent_at")?;
    let dead_at: Option<DateTime<Utc>> = row.try_get("dead_at")?;
    let next_attempt_at: Option<DateTime<Utc>> = row.try_get("next_attempt_at")?;
    Ok(MessageInfo {
        seq: row.try_get("seq")?,
        id: row.try_get("id")?,
        state: MessageState::of(
            sent_at.is_some(),
            dead_at.is_some(),
            next_attempt_at.is_some(),
        ),
        event_type: row.try_get("event_type")?,
        event_version: row.try_get("event_version")?,
        destination: row.try_get("destination")?,
        partition_key: row.try_get("partition_key")?,
        created_at: row.try_get("created_at")?,
        sent_at,
        attempts: row.try_get("attempts")?,
        next_attempt_at,
        last_error: row.try_get("last_error")?,
        dead_at,
        payload: row.try_get("payload")?,
        headers: row.try_get("headers")?,
    })
}
