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
use sqlx::Transaction;
use uuid::Uuid;

use crate::ops::Which;
use crate::store::{Backend, DefaultBackend};
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
    /// Relays connected to this outbox now (PostgreSQL: relays holding a session; MySQL:
    /// 1 if the active relay holds its lock, standbys not counted). `None` on SQLite,
    /// where relays leave no trace to count.
    pub relays: Option<i64>,
    /// All rows of the table, sent ones included, estimated so as not to scan the
    /// history: PostgreSQL's `reltuples` (updated by `ANALYZE`/autovacuum), InnoDB's
    /// `TABLE_ROWS`, SQLite's `seq` span (gaps left by deleted rows included); -1 if
    /// the database has no estimate yet.
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
pub struct Admin<DB: Backend = DefaultBackend> {
    outbox: Outbox<DB>,
}

impl<DB: Backend> Clone for Admin<DB> {
    fn clone(&self) -> Self {
        Admin {
            outbox: self.outbox.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Admin<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin")
            .field("outbox", &self.outbox)
            .finish()
    }
}

impl<DB: Backend> Admin<DB> {
    /// Operations on `outbox`'s tables.
    pub fn new(outbox: Outbox<DB>) -> Self {
        Admin { outbox }
    }

    /// The outbox operated on.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    fn table(&self) -> String {
        self.outbox.tables().outbox.to_string()
    }

    fn err(&self, context: &'static str) -> impl Fn(sqlx::Error) -> Error + '_ {
        move |e| Error::db(context, &self.table(), e)
    }

    /// Counts of pending, in-retry and dead messages, overall and per destination, the
    /// age of the oldest pending message and the number of connected relays. Reads only
    /// the pending and dead-letter rows, never the history.
    pub async fn status(&self) -> Result<Status> {
        let mut status = DB::status(self.outbox.pool(), self.outbox.tables())
            .await
            .map_err(self.err("reading the outbox status"))?;
        status.table = self.table();
        Ok(status)
    }

    /// Pending messages (in retry or not), oldest first.
    pub async fn pending(&self, filter: &ListFilter) -> Result<Vec<MessageInfo>> {
        let which = if filter.in_retry_only {
            Which::InRetry
        } else {
            Which::Pending
        };
        self.list(which, filter, "listing pending messages").await
    }

    /// Dead-lettered messages, oldest first.
    pub async fn dead(&self, filter: &ListFilter) -> Result<Vec<MessageInfo>> {
        self.list(Which::Dead, filter, "listing dead-lettered messages")
            .await
    }

    async fn list(
        &self,
        which: Which,
        filter: &ListFilter,
        context: &'static str,
    ) -> Result<Vec<MessageInfo>> {
        DB::list(self.outbox.pool(), self.outbox.tables(), which, filter)
            .await
            .map_err(self.err(context))
    }

    /// Re-queues the **sent** messages `ids`, to be published again (after a consumer
    /// lost or mishandled them). Their attempts and errors are reset; they keep their
    /// `seq` (see [Ordering](self#ordering)). Fails without changing anything if an id
    /// is unknown or its message is not sent. Returns how many were re-queued.
    pub async fn replay(&self, ids: &[Uuid]) -> Result<u64> {
        self.requeue(
            ids,
            Which::Sent,
            "replayed",
            "only sent messages can be replayed: a pending message is published anyway, and a \
             dead-lettered one is returned with `outbox release`",
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
        check_window(since, until)?;
        let context = "re-queuing sent messages";
        let mut tx = self.begin(context).await?;
        let n = DB::requeue_sent_between(&mut tx, self.outbox.tables(), since, until, destination)
            .await
            .map_err(self.err(context))?;
        self.wake_and_commit(tx, n > 0, context).await?;
        Ok(n)
    }

    /// How many messages [`replay_sent_between`](Self::replay_sent_between) would
    /// re-queue now (a count; nothing is written or locked).
    pub async fn preview_replay_sent_between(
        &self,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        destination: Option<&str>,
    ) -> Result<u64> {
        check_window(since, until)?;
        DB::count_sent_between(
            self.outbox.pool(),
            self.outbox.tables(),
            since,
            until,
            destination,
        )
        .await
        .map_err(self.err("counting the sent messages to re-queue"))
    }

    /// Returns the **dead-lettered** messages `ids` to pending, with attempts and errors
    /// reset. Fails without changing anything if an id is unknown or its message is not
    /// dead-lettered. Returns how many were released.
    pub async fn release(&self, ids: &[Uuid]) -> Result<u64> {
        self.requeue(
            ids,
            Which::Dead,
            "released",
            "only dead-lettered messages can be released (`outbox dead` lists them); a sent one \
             is sent again with `outbox replay`",
        )
        .await
    }

    /// Returns every dead-lettered message with partition key `key` to pending, with
    /// attempts and errors reset. Returns how many were released (0 if none was dead).
    pub async fn release_key(&self, key: &str) -> Result<u64> {
        let context = "releasing dead-lettered messages";
        let mut tx = self.begin(context).await?;
        let n = DB::release_key(&mut tx, self.outbox.tables(), key)
            .await
            .map_err(self.err(context))?;
        self.wake_and_commit(tx, n > 0, context).await?;
        Ok(n)
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
        let mut tx = self.begin(context).await?;
        let (sent, dead) = DB::purge(
            &mut tx,
            self.outbox.tables(),
            sent_before,
            dead_before,
            dry_run,
        )
        .await
        .map_err(self.err(context))?;
        tx.commit().await.map_err(self.err(context))?;
        Ok(PurgeReport {
            sent,
            dead,
            dry_run,
        })
    }

    /// A write transaction: see `Ops::ADMIN_BEGIN` (MySQL: `READ COMMITTED`, so a purge
    /// or replay holds back no writer; SQLite: the write lock up front).
    async fn begin(&self, context: &'static str) -> Result<Transaction<'static, DB>> {
        match DB::ADMIN_BEGIN {
            Some(statement) => self.outbox.pool().begin_with(statement).await,
            None => self.outbox.pool().begin().await,
        }
        .map_err(self.err(context))
    }

    /// Locks `ids`, checks that all exist and are in state `from`, then re-queues them.
    async fn requeue(
        &self,
        ids: &[Uuid],
        from: Which,
        operation: &'static str,
        hint: &'static str,
    ) -> Result<u64> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument(Cow::Borrowed(
                "no message ids given",
            )));
        }
        let context = match from {
            Which::Dead => "releasing dead-lettered messages",
            _ => "re-queuing sent messages",
        };
        let wanted = match from {
            Which::Dead => MessageState::Dead,
            _ => MessageState::Sent,
        };
        let tables = self.outbox.tables();
        let mut tx = self.begin(context).await?;
        let states: HashMap<Uuid, MessageState> = DB::lock_states(&mut tx, tables, ids)
            .await
            .map_err(self.err(context))?
            .into_iter()
            .collect();
        for id in ids {
            match states.get(id) {
                None => {
                    return Err(Error::UnknownMessage {
                        table: self.table(),
                        id: *id,
                    });
                }
                Some(state) if *state != wanted => {
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
        let n = DB::requeue_ids(&mut tx, tables, ids, from)
            .await
            .map_err(self.err(context))?;
        self.wake_and_commit(tx, n > 0, context).await?;
        Ok(n)
    }

    /// Wakes listening relays when the transaction commits, then commits.
    async fn wake_and_commit(
        &self,
        mut tx: Transaction<'static, DB>,
        wake: bool,
        context: &'static str,
    ) -> Result<()> {
        if wake {
            DB::wake_relays(&mut tx, self.outbox.tables())
                .await
                .map_err(self.err(context))?;
        }
        tx.commit().await.map_err(self.err(context))
    }
}

/// A replay window must not be empty.
fn check_window(since: DateTime<Utc>, until: DateTime<Utc>) -> Result<()> {
    if since >= until {
        return Err(Error::InvalidArgument(Cow::Owned(format!(
            "the replay window is empty: since ({since}) is not before until ({until}); \
             give an earlier --since or a later --until"
        ))));
    }
    Ok(())
}
