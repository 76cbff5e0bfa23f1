//! The SQL behind `Inbox`, `Retention` and `Admin`, implemented by each database module
//! (`db/<database>/`). Those services hold the logic (transactions, state checks, error
//! messages, batching); this trait only runs statements, over the data types of
//! `model`. Not a public API: it changes without notice.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use uuid::Uuid;

use crate::config::Tables;
use crate::model::{
    Beat, ConsumerStatus, DeadGroup, Failure, ListFilter, MessageInfo, MessageState, Status,
};
pub use crate::model::{Change, SentBatch, SentWindow, Which};

/// Whose parked messages [`Ops::unpark`] re-queues: those behind the dead letters with
/// these ids, or behind every dead letter of this key.
#[derive(Debug, Clone, Copy)]
pub enum Behind<'a> {
    /// The keys of these dead letters.
    Ids(&'a [Uuid]),
    /// This key.
    Key(&'a str),
}

/// Which rows of the consumers' state [`Ops::clear_consumer_rows`] deletes.
#[derive(Debug, Clone, Copy)]
pub enum ConsumerRows<'a> {
    /// One consumer's failure record of one message (handled, skipped or dead-lettered).
    Failure {
        /// The inbox name.
        consumer: &'a str,
        /// The message id.
        id: Uuid,
    },
    /// One consumer instance's heartbeat row (it stopped).
    Instance {
        /// The inbox name.
        consumer: &'a str,
        /// The instance id.
        instance: Uuid,
    },
    /// Every failure record whose last failure, and every instance row whose last
    /// heartbeat, is before this time: left by a consumer that has not retried its
    /// message since (the message was handled by another instance, or the consumer has
    /// stopped) or died, and older than the processed ids retention keeps.
    Before(DateTime<Utc>),
}

/// A statement's result.
pub type SqlResult<T> = std::result::Result<T, sqlx::Error>;

/// Per-database statements for the inbox, retention and admin operations.
///
/// Methods taking `conn` run inside the caller's transaction; the others take a
/// connection from the pool.
pub trait Ops: super::Database {
    /// How `Admin` and retention begin their write transactions
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

    /// Records one more failure of a consumer's handler for a message (the first
    /// inserts its row). Runs on its own, outside the handler's rolled-back transaction.
    fn note_failure<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        failure: Failure<'c>,
    ) -> BoxFuture<'c, SqlResult<()>>;

    /// Deletes rows of the consumers' state: see [`ConsumerRows`].
    fn clear_consumer_rows<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        rows: ConsumerRows<'c>,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Writes a consumer instance's heartbeat (inserting its row at the first).
    fn beat<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        beat: Beat<'c>,
    ) -> BoxFuture<'c, SqlResult<()>>;

    /// Each consumer's processed messages since `since`, its instances, and the failing
    /// messages (at most `limit`, the longest failing first), by consumer name.
    fn consumers<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        since: DateTime<Utc>,
        limit: i64,
    ) -> BoxFuture<'c, SqlResult<Vec<ConsumerStatus>>>;

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

    /// On a time-partitioned outbox (PostgreSQL): creates partitions ahead and drops
    /// those wholly older than `cutoff` with no pending or dead row. `None` for a plain
    /// table (the default).
    #[cfg(feature = "postgres")]
    fn maintain_partitions<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        cutoff: Option<DateTime<Utc>>,
    ) -> BoxFuture<'c, SqlResult<Option<crate::postgres::PartitionReport>>> {
        let _ = (pool, tables, cutoff);
        Box::pin(async { Ok(None) })
    }

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
        options: &'c Self::Options,
    ) -> BoxFuture<'c, SqlResult<Status>>;

    /// Dead letters grouped by their last error, the largest groups first (at most
    /// `limit` groups).
    fn dead_by_error<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        limit: u32,
    ) -> BoxFuture<'c, SqlResult<Vec<DeadGroup>>>;

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

    /// Deletes or re-queues ([`Change`]) the messages `ids` that are in state `from`;
    /// returns how many.
    fn change_ids<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        ids: &'c [Uuid],
        from: Which,
        change: Change,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Returns to pending (attempts and errors reset) every message sent in `window`, or
    /// with `dry_run` counts them; returns how many.
    fn requeue_sent<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        window: SentWindow<'c>,
        dry_run: bool,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Returns every dead-lettered message with partition key `key` to pending.
    fn release_key<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        key: &'c str,
    ) -> BoxFuture<'c, SqlResult<u64>>;

    /// Re-queues (`next_attempt_at` = now) the never-tried pending messages of the keys
    /// of the dead letters `behind`, in the transaction that releases or discards them.
    /// Their dead letter no longer parks them, but a busy relay's claim cursor may be past
    /// them already; a re-queued row at or below the cursor blocks the later rows of its
    /// key (`model::state::blocker`), so nothing written after them overtakes them. Run it
    /// before the dead letters change. Returns how many.
    fn unpark<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        behind: Behind<'c>,
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

    /// The database's view of the outbox's health (`outbox doctor`); `None` where the
    /// database has nothing to say beyond [`status`](Self::status) (MySQL, SQLite).
    #[cfg(feature = "postgres")]
    fn health<'c>(
        _pool: &'c sqlx::Pool<Self>,
        _tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<Option<crate::postgres::Health>>> {
        Box::pin(async { Ok(None) })
    }

    /// Wakes listening relays when the transaction commits (PostgreSQL); a no-op on
    /// polling databases.
    fn wake_relays<'c>(
        _conn: &'c mut Self::Connection,
        _tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<()>> {
        Box::pin(async { Ok(()) })
    }
}
