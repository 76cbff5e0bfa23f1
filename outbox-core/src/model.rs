//! The data the stored-message operations exchange: message states, listings, status
//! counts, and the SQL conditions that define each state. A leaf: the SQL layer (`ops`),
//! the database modules and the services (`admin`, `retention`) all use it, and it uses
//! none of them. The public types are re-exported by `admin`, where users find them.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// Where a message is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageState {
    /// Waiting for the relay.
    Pending,
    /// Pending, after a failure (of its own, or of the broker): waits for
    /// `next_attempt_at`, and holds back the later messages of its partition key until then.
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

    pub(crate) fn of(sent: bool, dead: bool, retrying: bool) -> MessageState {
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

/// One stored message, as listed by `Admin::pending` and `Admin::dead`.
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
    /// The payload: its JSON when the content type is JSON, else a string of its bytes in
    /// base64 (standard alphabet, padded).
    pub payload: serde_json::Value,
    /// What the payload is (`application/json` unless the message said otherwise).
    pub content_type: String,
    /// The stored headers.
    pub headers: serde_json::Value,
    /// For a dead letter: the pending messages of its key after it, which wait for it
    /// (with the default `OnDeadLetter::ParkKey`) until it is released or discarded.
    /// 0 in other listings.
    pub held_back: i64,
}

/// Which messages `Admin::pending` and `Admin::dead` list. `Default` lists the first
/// 100 in `seq` order; set the fields you need on it (the struct grows new fields, so
/// it is not built with a struct literal outside this crate):
///
/// ```
/// # use outbox_core::admin::ListFilter;
/// let mut filter = ListFilter::default();
/// filter.key = Some("customer-7".to_owned());
/// filter.limit = 20;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Only messages after this `seq`: the next page after a page that ended there
    /// (an index range, however many rows come before).
    pub after_seq: Option<i64>,
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
            after_seq: None,
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

/// What `Admin::status` reports: the state of the queue.
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
    /// Relays connected to this outbox now (PostgreSQL: relays holding a session; MySQL:
    /// 1 if the active relay holds its lock, standbys not counted; WAL mode: 1 if a relay
    /// streams from the slot, standbys not counted). `None` on SQLite,
    /// where relays leave no trace to count.
    pub relays: Option<i64>,
    /// All rows of the table, sent ones included, estimated so as not to scan the
    /// history: PostgreSQL's `reltuples` (updated by `ANALYZE`/autovacuum), InnoDB's
    /// `TABLE_ROWS`, SQLite's `seq` span (gaps left by deleted rows included); -1 if
    /// the database has no estimate yet.
    pub rows_estimate: i64,
    /// The same counts per destination, for destinations with pending or dead messages.
    pub destinations: Vec<DestinationStatus>,
    /// PostgreSQL: the oldest transaction that wrote outbox rows and has not ended. The
    /// relay publishes nothing written after it began until it commits or rolls back, so
    /// an old one here (idle in transaction, or a prepared transaction) stalls every key.
    /// `None` when no writer is open (and on MySQL/SQLite, whose writers commit in order).
    #[cfg(feature = "postgres")]
    pub oldest_writer: Option<crate::postgres::OpenWriter>,
    /// WAL mode (PostgreSQL): the replication slot the relay reads. `None` in table mode.
    #[cfg(feature = "postgres")]
    pub slot: Option<crate::postgres::SlotStatus>,
    /// The highest `seq` in the table (read from its primary key's index), `None` when it
    /// is empty: two samples tell how many messages were written in between.
    pub last_seq: Option<i64>,
    /// The consumers (inbox names) recording processed messages in this outbox's
    /// database: what each processed in the last minute, and the messages whose handler
    /// is failing now. Empty when no consumer processed anything lately and none is
    /// failing.
    pub consumers: Vec<ConsumerStatus>,
}

/// One consumer (an [`Inbox`](crate::inbox::Inbox) name) as its database sees it: see
/// [`Status::consumers`].
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ConsumerStatus {
    /// The inbox name.
    pub consumer: String,
    /// Messages it recorded as processed in the last minute (a rate; the processed
    /// table's older rows are not counted, so as not to scan the table).
    pub processed_last_minute: i64,
    /// When it last recorded a processed message, if that was within the last minute.
    pub last_processed_at: Option<DateTime<Utc>>,
    /// Its instances that wrote a heartbeat and have not stopped: running ones, and
    /// those that died without stopping (not [`alive`](crate::admin::ConsumerInstance::alive)).
    pub instances: Vec<ConsumerInstance>,
    /// Messages the broker holds for it that it has not handled, as its live instances'
    /// transports last reported (Kafka: the sum over the partitions each was assigned;
    /// NATS and RabbitMQ: the one durable's or queue's count); `None` when no live
    /// instance reported one.
    pub lag: Option<i64>,
    /// Messages whose handler is failing now, the longest failing first (at most
    /// [`FAILING_LISTED`] over all consumers). Each holds back the later messages of its
    /// key in that consumer.
    pub failing: Vec<FailingMessage>,
}

/// One running consumer process (a [`Consumer`](crate::consumer::Consumer) from its start to
/// its stop), as its last heartbeat says.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ConsumerInstance {
    /// A random id, new at each start.
    pub instance: Uuid,
    /// `kafka`, `nats`, `rabbitmq`, or a transport of your own.
    pub transport: String,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub seen_at: DateTime<Utc>,
    /// Seconds since its last heartbeat, by the database's clock.
    pub seen_seconds_ago: f64,
    /// Whether it wrote a heartbeat within three of its intervals: `false` for an
    /// instance that died without stopping (`kill -9`, a lost host) or cannot reach the
    /// database.
    pub alive: bool,
    /// Messages it handled since it started.
    pub handled: i64,
    /// Handler (or database) failures since it started.
    pub handler_errors: i64,
    /// The lag its transport reported at its last heartbeat, if it can tell.
    pub lag: Option<i64>,
}

/// What a consumer instance writes at each heartbeat.
#[derive(Debug, Clone, Copy)]
pub struct Beat<'a> {
    /// The inbox name.
    pub consumer: &'a str,
    /// The instance id.
    pub instance: Uuid,
    /// The transport's name.
    pub transport: &'a str,
    /// The heartbeat interval, in milliseconds.
    pub interval_ms: i64,
    /// Messages handled since the start.
    pub handled: i64,
    /// Handler failures since the start.
    pub handler_errors: i64,
    /// The transport's lag, if it can tell.
    pub lag: Option<i64>,
}

/// At most this many failing messages are listed in a [`Status`].
pub const FAILING_LISTED: i64 = 100;

/// A message whose consumer handler failed and is being retried: written by the
/// consumer at each failure, removed once the message is handled, skipped or
/// dead-lettered.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct FailingMessage {
    /// The message id.
    pub message_id: Uuid,
    /// Its event type.
    pub event_type: String,
    /// Its key: the consumer holds back the key's later messages behind it.
    pub partition_key: Option<String>,
    /// Where the consumer read it (topic/partition/offset, subject/sequence, queue).
    pub origin: String,
    /// How many times the handler failed (or the database failed under it).
    pub attempts: i32,
    /// The first failure.
    pub first_failed_at: DateTime<Utc>,
    /// How long it has been failing: from the first failure to the database's clock now.
    pub failing_seconds: f64,
    /// The latest failure.
    pub last_failed_at: DateTime<Utc>,
    /// The latest failure's error (redacted as the consumer logs it).
    pub last_error: String,
}

/// One failure of a consumer's handler, as the consumer records it.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    /// The inbox name.
    pub consumer: &'a str,
    /// The message id.
    pub id: Uuid,
    /// Its event type.
    pub event_type: &'a str,
    /// Its key.
    pub key: Option<&'a str>,
    /// Where it was read.
    pub origin: &'a str,
    /// The error, redacted.
    pub error: &'a str,
}

/// Dead letters that failed with one error; see `Admin::dead_by_error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeadGroup {
    /// The last error (empty when none was recorded).
    pub error: String,
    /// How many dead letters have it.
    pub count: i64,
    /// The first of them (lowest `seq`).
    pub first_seq: i64,
}

/// What `Admin::purge` deleted, or would delete.
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

/// Which messages a listing or a re-queue works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// Pending, in retry or not.
    Pending,
    /// Pending and waiting for a retry.
    InRetry,
    /// Sent.
    Sent,
    /// Dead-lettered.
    Dead,
}

impl Which {
    /// The `held_back` column of a listing of the rows `x` of `outbox`: counted for dead
    /// letters, 0 otherwise (a `bigint` on every database).
    pub(crate) fn held_back(self, outbox: &str) -> String {
        let condition = match self {
            Which::Dead => format!(
                "p.partition_key = x.partition_key AND p.seq > x.seq AND {}",
                state::pending("p")
            ),
            _ => "1 = 0".to_owned(),
        };
        format!("(SELECT count(*) FROM {outbox} p WHERE {condition}) AS held_back")
    }

    /// The `WHERE` condition, the same on every database.
    pub(crate) fn condition(self) -> &'static str {
        match self {
            Which::Pending => state::PENDING,
            Which::InRetry => concat!(
                state::pending_condition!(),
                " AND ",
                state::failed_condition!()
            ),
            Which::Sent => "sent_at IS NOT NULL",
            Which::Dead => "dead_at IS NOT NULL",
        }
    }

    /// What re-queuing messages in this state clears (`sent_at` or `dead_at`).
    pub(crate) fn requeue_set(self) -> &'static str {
        match self {
            Which::Dead => "dead_at = NULL",
            _ => "sent_at = NULL",
        }
    }
}

/// What [`Ops::change_ids`](crate::store::ops::Ops::change_ids) does to the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Delete them (discard).
    Delete,
    /// Return them to pending, attempts and errors reset (replay, release).
    Requeue,
}

impl Change {
    /// The statement that changes the rows of `outbox` whose `id` passes `ids` (`= ANY($1)`,
    /// `IN (?, ?)`) and that are in state `from`; `now` is the database's clock.
    pub(crate) fn sql(self, outbox: &str, ids: &str, from: Which, now: &str) -> String {
        let state = from.condition();
        match self {
            Change::Delete => format!("DELETE FROM {outbox} WHERE id {ids} AND {state}"),
            Change::Requeue => format!(
                "UPDATE {outbox} SET {set}, {reset} WHERE id {ids} AND {state}",
                set = from.requeue_set(),
                reset = requeue_reset(now),
            ),
        }
    }
}

/// The messages sent in `[since, until)`, of one destination or of all: what
/// `Admin::replay_sent_between` re-queues.
#[derive(Debug, Clone, Copy)]
pub struct SentWindow<'a> {
    /// From this `sent_at` on.
    pub since: DateTime<Utc>,
    /// Before this `sent_at`.
    pub until: DateTime<Utc>,
    /// Only this destination, if set.
    pub destination: Option<&'a str>,
}

/// What re-queuing (replay, release) sets besides the state column: attempts and error
/// reset, and `next_attempt_at` = `now` (the database's clock expression). The message is
/// due at once and, like a row waiting for a retry, holds back the later pending messages
/// of its key (the relay's claim skips rows behind a pending row with a `next_attempt_at`),
/// also in a drain already under way whose prefetched batches start after it: it goes out
/// before them. It is not "in retry": that is a pending row with failed attempts.
pub(crate) fn requeue_reset(now: &str) -> String {
    format!("attempts = 0, next_attempt_at = {now}, last_error = NULL")
}

/// What one retention batch of sent messages did.
#[derive(Debug, Clone, Copy, Default)]
pub struct SentBatch {
    /// Rows deleted.
    pub deleted: u64,
    /// Rows the batch took on (at most `limit`; fewer means the run is done). Can exceed
    /// `deleted` when a message was re-queued between finding and deleting it.
    pub found: u64,
    /// The largest `seq` the batch covered.
    pub last: Option<i64>,
}

/// Converts a count from the database.
pub(crate) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// Folds per-destination counts into the totals of `status`.
pub(crate) fn total(status: &mut Status) {
    status.pending = status.destinations.iter().map(|d| d.pending).sum();
    status.in_retry = status.destinations.iter().map(|d| d.in_retry).sum();
    status.dead = status.destinations.iter().map(|d| d.dead).sum();
    status.oldest_pending_age_seconds = status
        .destinations
        .iter()
        .filter_map(|d| d.oldest_pending_age_seconds)
        .reduce(f64::max);
}

/// The SQL conditions of each state, said once. Columns are unqualified; the claim
/// statements, which join the table to itself, use the `o.`/`r.` forms.
pub(crate) mod state {
    /// Not sent and not dead-lettered: waiting for the relay (in retry or not).
    macro_rules! pending_condition {
        () => {
            "sent_at IS NULL AND dead_at IS NULL"
        };
    }
    pub(crate) use pending_condition;

    /// Not sent and not dead-lettered: waiting for the relay (in retry or not).
    pub(crate) const PENDING: &str = pending_condition!();

    /// Failed before: a failure of its own (`attempts`) or of the broker (`last_error`
    /// without an attempt counted); re-queuing clears both. A pending row that failed is
    /// "in retry".
    macro_rules! failed_condition {
        () => {
            "(attempts > 0 OR last_error IS NOT NULL)"
        };
    }
    pub(crate) use failed_condition;

    /// See [`failed_condition!`].
    pub(crate) const FAILED: &str = failed_condition!();

    /// [`PENDING`] for the row aliased `alias`.
    pub(crate) fn pending(alias: &str) -> String {
        format!("{alias}.sent_at IS NULL AND {alias}.dead_at IS NULL")
    }

    /// The claim's blocker condition on an earlier pending row `r` of the same key: the
    /// later row may not go while `r` waits for a retry (`attempts > 0`: a message that
    /// failed goes alone, so that its successors never overtake it if it fails again), or
    /// is not due yet, or lies at or below `after` (the claim starts after a batch in
    /// flight and would not take `r`: a re-queued row below it). A due re-queued row above
    /// `after` is taken by the same claim, before its successors, so a replayed run of one
    /// key goes out in whole batches. `now` is the database's clock, `after` the claim's
    /// placeholder.
    pub(crate) fn blocker(now: &str, after: &str) -> String {
        format!(
            "r.next_attempt_at IS NOT NULL \
             AND (r.attempts > 0 OR r.next_attempt_at > {now} OR r.seq <= {after})"
        )
    }

    /// The claim's condition that keeps the rows of a key behind its dead letter
    /// ([`OnDeadLetter::ParkKey`](crate::config::OnDeadLetter)); empty for `SkipKey`.
    pub(crate) fn parked(outbox: &str, park: bool) -> String {
        if park {
            format!(
                " AND NOT EXISTS (SELECT 1 FROM {outbox} d WHERE d.partition_key = o.partition_key \
                   AND d.seq < o.seq AND d.dead_at IS NOT NULL)"
            )
        } else {
            String::new()
        }
    }

    /// The rows of keys with a pending row waiting for a retry (or re-queued, not yet
    /// due): what the relay's prefetched batches leave out.
    pub(crate) fn retrying(key: &str, outbox: &str) -> String {
        format!(
            "SELECT DISTINCT {key} FROM {outbox} WHERE {PENDING} \
             AND next_attempt_at IS NOT NULL AND partition_key IS NOT NULL"
        )
    }
}

/// A duration for people: `1.2s`, `12m 5s`, `3h 2m`, `3d 4h`. What `outbox status` and
/// `outbox doctor` print.
pub fn human_duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "0s".to_owned();
    }
    if secs < 60.0 {
        return format!("{secs:.1}s");
    }
    let s = secs as u64;
    let (d, h, m, s) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (d, h) {
        (0, 0) => format!("{m}m {s}s"),
        (0, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

#[cfg(test)]
mod human_tests {
    use super::human_duration;

    #[test]
    fn human_durations() {
        assert_eq!(human_duration(1.25), "1.2s");
        assert_eq!(human_duration(725.0), "12m 5s");
        assert_eq!(human_duration(3.0 * 3600.0 + 120.0), "3h 2m");
        assert_eq!(human_duration(3.0 * 86_400.0 + 4.0 * 3600.0), "3d 4h");
    }
}
