//! The SQL behind [`Inbox`](crate::inbox::Inbox), [`Retention`](crate::retention::Retention)
//! and [`Admin`](crate::admin::Admin), one implementation per database. Those types hold
//! the logic (transactions, state checks, error messages, batching); this trait only runs
//! statements. Not a public API: it changes without notice.

#[cfg(any(feature = "mysql", feature = "sqlite"))]
mod lite;
#[cfg(feature = "postgres")]
mod postgres;

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use uuid::Uuid;

use crate::admin::{ListFilter, MessageInfo, MessageState, Status};
use crate::config::Tables;

/// A statement's result.
pub type SqlResult<T> = std::result::Result<T, sqlx::Error>;

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
    /// The `WHERE` condition, the same on every database.
    pub(crate) fn condition(self) -> &'static str {
        match self {
            Which::Pending => "sent_at IS NULL AND dead_at IS NULL",
            Which::InRetry => "sent_at IS NULL AND dead_at IS NULL AND attempts > 0",
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

/// What re-queuing (replay, release) sets besides the state column: attempts and error
/// reset, and `next_attempt_at` = `now` (the database's clock expression). The message is
/// due at once and, like a row waiting for a retry, holds back the later pending messages
/// of its key (the relay's claim skips rows behind a pending row with a `next_attempt_at`),
/// also in a drain already under way whose prefetched batches start after it: it goes out
/// before them. It is not "in retry": that is a pending row with failed attempts.
pub(crate) fn requeue_reset(now: &str) -> String {
    format!("attempts = 0, next_attempt_at = {now}, last_error = NULL")
}

/// Per-database statements for the inbox, retention and admin operations.
///
/// Methods taking `conn` run inside the caller's transaction; the others take a
/// connection from the pool.
pub trait Ops: sqlx::Database {
    /// How [`Admin`](crate::admin::Admin) and retention begin their write transactions
    /// (`None`: the driver's `BEGIN`). MySQL: at `READ COMMITTED`, set in the same round
    /// trip as `START TRANSACTION` (so it can never outlive it on a pooled connection),
    /// which keeps InnoDB's next-key locks off the index gap where writers append
    /// pending rows; SQLite: `BEGIN IMMEDIATE`.
    const ADMIN_BEGIN: Option<&'static str> = None;

    /// Inserts `(consumer, id)` into the processed table unless present; `true` if inserted.
    fn record_processed<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, SqlResult<bool>>;

    /// Whether `(consumer, id)` is in the processed table.
    fn is_processed<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, SqlResult<bool>>;

    /// The database clock minus `age_secs`: the clock that set `sent_at` and `processed_at`.
    fn clock_minus(
        pool: &sqlx::Pool<Self>,
        age_secs: f64,
    ) -> BoxFuture<'_, SqlResult<DateTime<Utc>>>;

    /// Deletes up to `limit` sent, not dead, messages with `seq > after` and
    /// `sent_at < cutoff`, lowest `seq` first, skipping rows locked by others where the
    /// database can; returns how many and the largest `seq` deleted.
    fn delete_sent<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        after: i64,
        cutoff: DateTime<Utc>,
        limit: i64,
    ) -> BoxFuture<'c, SqlResult<SentBatch>>;

    /// Deletes up to `limit` processed ids with `processed_at < cutoff`, oldest first.
    fn delete_processed<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        cutoff: DateTime<Utc>,
        limit: i64,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Counts per destination, relays and the row estimate (`table` left empty).
    fn status<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<Status>>;

    /// Messages in state `which` matching `filter`, in `seq` order.
    fn list<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        which: Which,
        filter: &'c ListFilter,
    ) -> BoxFuture<'c, SqlResult<Vec<MessageInfo>>>;

    /// Locks the messages `ids` (those that exist) and says what state each is in.
    fn lock_states<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        ids: &'c [Uuid],
    ) -> BoxFuture<'c, SqlResult<Vec<(Uuid, MessageState)>>>;

    /// Returns the messages `ids`, which are in state `from`, to pending, attempts and
    /// errors reset; returns how many.
    fn requeue_ids<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        ids: &'c [Uuid],
        from: Which,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Returns to pending every message sent in `[since, until)`, optionally only for
    /// `destination`; returns how many.
    fn requeue_sent_between<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// How many messages were sent in `[since, until)`, optionally only for
    /// `destination`: what [`requeue_sent_between`](Self::requeue_sent_between) would
    /// re-queue now.
    fn count_sent_between<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Returns every dead-lettered message with partition key `key` to pending.
    fn release_key<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        key: &'c str,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Deletes (or with `dry_run` counts) sent messages sent before `sent_before` and
    /// dead-lettered ones dead before `dead_before`; returns (sent, dead).
    fn purge<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        sent_before: Option<DateTime<Utc>>,
        dead_before: Option<DateTime<Utc>>,
        dry_run: bool,
    ) -> BoxFuture<'c, SqlResult<(u64, u64)>>;

    /// Wakes listening relays when the transaction commits (PostgreSQL); a no-op on
    /// polling databases.
    fn wake_relays<'c>(
        _conn: &'c mut Self::Connection,
        _tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<()>> {
        Box::pin(async { Ok(()) })
    }
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
