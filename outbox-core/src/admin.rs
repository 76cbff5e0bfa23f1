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

use chrono::{DateTime, Utc};
use sqlx::Transaction;
use uuid::Uuid;

use crate::model::{Change, SentWindow, Which};
pub use crate::model::{
    ConsumerInstance, ConsumerStatus, DeadGroup, DestinationStatus, FAILING_LISTED, FailingMessage,
    ListFilter, MessageInfo, MessageState, PurgeReport, Status, human_duration,
};

use crate::store::Backend;
use crate::store::ops::Behind;

/// Whether the warning that the consumers' state cannot be read was logged (the
/// dashboard reads the status every 5 s).
static CONSUMERS_UNREADABLE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Runs `warn` the first time only.
fn once_per_process(done: &std::sync::atomic::AtomicBool, warn: impl FnOnce()) {
    if !done.swap(true, std::sync::atomic::Ordering::Relaxed) {
        warn();
    } else {
        tracing::debug!("the consumers' state is not shown (see the first warning)");
    }
}
use crate::{Error, Outbox, Result};

moved! {
    #[cfg(feature = "postgres")]
    OpenWriter => postgres, "moved to `outbox_core::postgres::OpenWriter`";
    #[cfg(feature = "postgres")]
    SlotStatus => postgres, "moved to `outbox_core::postgres::SlotStatus`";
}

/// Operations on the stored messages of one outbox. See the [module](self).
#[derive(Debug)]
pub struct Admin<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    pub(crate) outbox: Outbox<DB>,
}

impl<DB: Backend> Clone for Admin<DB> {
    fn clone(&self) -> Self {
        Admin {
            outbox: self.outbox.clone(),
        }
    }
}

#[cfg(feature = "postgres")]
impl Admin<sqlx::Postgres> {
    /// Drops the outbox's replication slot and its publication (WAL mode).
    #[deprecated(
        since = "0.2.0",
        note = "use `outbox_core::postgres::Slot::drop(&outbox)`"
    )]
    pub async fn drop_slot(&self) -> Result<crate::postgres::SlotStatus> {
        crate::postgres::Slot::drop(&self.outbox).await
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
        let mut status = DB::status(
            self.outbox.pool(),
            self.outbox.tables(),
            self.outbox.options(),
        )
        .await
        .map_err(self.err("reading the outbox status"))?;
        status.table = self.table();
        // The consumers' part must not take the outbox's status down with it (a role
        // that may not read the new tables, an older schema): said once, then left out.
        status.consumers = self.consumers().await.unwrap_or_else(|e| {
            once_per_process(&CONSUMERS_UNREADABLE, || {
                tracing::warn!(error = %crate::ErrorChain(&e), "the consumers' state is not shown")
            });
            Vec::new()
        });
        Ok(status)
    }

    /// The consumers recording processed messages in this outbox's database (see
    /// [`Status::consumers`]). Empty, with a warning logged, on a database whose
    /// migrations predate the table of failing messages (run `outbox migrate`).
    pub async fn consumers(&self) -> Result<Vec<ConsumerStatus>> {
        let context = "reading the consumers' state";
        let pool = self.outbox.pool();
        let since = DB::clock_minus(pool, 60.0)
            .await
            .map_err(self.err(context))?;
        match DB::consumers(pool, self.outbox.tables(), since, FAILING_LISTED).await {
            Ok(mut consumers) => {
                let now = since + chrono::Duration::seconds(60);
                for failing in consumers.iter_mut().flat_map(|c| c.failing.iter_mut()) {
                    failing.failing_seconds =
                        (now - failing.first_failed_at).as_seconds_f64().max(0.0);
                }
                Ok(consumers)
            }
            Err(e) if crate::error::is_schema_missing(&e) => {
                once_per_process(
                    &CONSUMERS_UNREADABLE,
                    || tracing::warn!(table = %self.outbox.tables().processed, "the consumers' state is not shown: this database lacks the consumers' tables; run the migrations (`outbox migrate`)"),
                );
                Ok(Vec::new())
            }
            Err(e) => Err(self.err(context)(e)),
        }
    }

    /// Dead letters grouped by their last error, the largest groups first (at most
    /// `limit` groups): what failed, how often. Reads the dead letters only.
    pub async fn dead_by_error(&self, limit: u32) -> Result<Vec<DeadGroup>> {
        DB::dead_by_error(self.outbox.pool(), self.outbox.tables(), limit)
            .await
            .map_err(self.err("grouping the dead letters by error"))
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
        let window = window(since, until, destination)?;
        let context = "re-queuing sent messages";
        let mut tx = self.begin(context).await?;
        let n = DB::requeue_sent(&mut tx, self.outbox.tables(), window, false)
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
        let window = window(since, until, destination)?;
        let context = "counting the sent messages to re-queue";
        let mut conn = self
            .outbox
            .pool()
            .acquire()
            .await
            .map_err(self.err(context))?;
        DB::requeue_sent(&mut conn, self.outbox.tables(), window, true)
            .await
            .map_err(self.err(context))
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

    /// Deletes the **dead-lettered** messages `ids` for good: they will never be
    /// published. The later messages of their keys, parked behind them
    /// ([`OnDeadLetter::ParkKey`](crate::relay::OnDeadLetter)), go on. Fails without
    /// changing anything if an id is unknown or its message is not dead-lettered. Returns
    /// how many were discarded.
    pub async fn discard(&self, ids: &[Uuid]) -> Result<u64> {
        let context = "discarding dead-lettered messages";
        let mut tx = self
            .locked_in_state(
                ids,
                MessageState::Dead,
                "discarded",
                "only dead-lettered messages can be discarded (`outbox dead` lists them)",
                context,
            )
            .await?;
        DB::unpark(&mut tx, self.outbox.tables(), Behind::Ids(ids))
            .await
            .map_err(self.err(context))?;
        let n = DB::change_ids(
            &mut tx,
            self.outbox.tables(),
            ids,
            Which::Dead,
            Change::Delete,
        )
        .await
        .map_err(self.err(context))?;
        self.wake_and_commit(tx, n > 0, context).await?;
        Ok(n)
    }

    /// Returns every dead-lettered message with partition key `key` to pending, with
    /// attempts and errors reset. Returns how many were released (0 if none was dead).
    pub async fn release_key(&self, key: &str) -> Result<u64> {
        let context = "releasing dead-lettered messages";
        let mut tx = self.begin(context).await?;
        DB::unpark(&mut tx, self.outbox.tables(), Behind::Key(key))
            .await
            .map_err(self.err(context))?;
        let n = DB::release_key(&mut tx, self.outbox.tables(), key)
            .await
            .map_err(self.err(context))?;
        self.wake_and_commit(tx, n > 0, context).await?;
        Ok(n)
    }

    /// Deletes sent messages sent before `sent_before` and dead-lettered messages
    /// dead-lettered before `dead_before`, in one transaction. With `dry_run`, deletes
    /// nothing and counts what would be deleted. For routine clean-up of large
    /// histories prefer [`Retention`](crate::Retention), which deletes in
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
        let context = match from {
            Which::Dead => "releasing dead-lettered messages",
            _ => "re-queuing sent messages",
        };
        let wanted = match from {
            Which::Dead => MessageState::Dead,
            _ => MessageState::Sent,
        };
        let mut tx = self
            .locked_in_state(ids, wanted, operation, hint, context)
            .await?;
        if from == Which::Dead {
            DB::unpark(&mut tx, self.outbox.tables(), Behind::Ids(ids))
                .await
                .map_err(self.err(context))?;
        }
        let n = DB::change_ids(&mut tx, self.outbox.tables(), ids, from, Change::Requeue)
            .await
            .map_err(self.err(context))?;
        self.wake_and_commit(tx, n > 0, context).await?;
        Ok(n)
    }

    /// A write transaction holding the messages `ids`, all of which exist and are in
    /// state `wanted` (else an error naming the first that is not, and nothing changed).
    async fn locked_in_state(
        &self,
        ids: &[Uuid],
        wanted: MessageState,
        operation: &'static str,
        hint: &'static str,
        context: &'static str,
    ) -> Result<Transaction<'static, DB>> {
        if ids.is_empty() {
            return Err(Error::InvalidArgument(Cow::Borrowed(
                "no message ids given",
            )));
        }
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
        Ok(tx)
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

/// The replay window, which must not be empty.
fn window(
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    destination: Option<&str>,
) -> Result<SentWindow<'_>> {
    if since >= until {
        return Err(Error::InvalidArgument(Cow::Owned(format!(
            "the replay window is empty: since ({since}) is not before until ({until}); \
             give an earlier --since or a later --until"
        ))));
    }
    Ok(SentWindow {
        since,
        until,
        destination,
    })
}
