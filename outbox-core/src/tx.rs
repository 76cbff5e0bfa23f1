//! [`OutboxTx`]: a database transaction that collects events and writes them at commit.

use std::fmt;
use std::ops::{Deref, DerefMut};

use sqlx::Transaction;
use tracing::Instrument;
use uuid::Uuid;

use crate::error::DbContext;
use crate::store::Backend;
use crate::{Outbox, OutboxEvent, OutboxMessage, Result};

/// A database transaction plus the events emitted in it.
///
/// Use it as the connection for your own queries (`&mut *tx`, or [`conn`](Self::conn)),
/// [`emit`](Self::emit) events as things happen, then [`commit`](Self::commit): all
/// collected events are written in one statement and committed together with your
/// changes. Dropping it without committing, or [`rollback`](Self::rollback), writes
/// nothing and undoes your changes; a transaction dropped while it holds events logs a
/// warning that names them (roll back to discard events on purpose).
///
/// ```no_run
/// # use outbox_core::{Outbox, OutboxMessage};
/// # async fn demo(outbox: Outbox) -> outbox_core::Result<()> {
/// let mut tx = outbox.begin().await?;
/// sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = $1")
///     .bind(42_i64)
///     .execute(&mut *tx)
///     .await
///     .expect("update");
/// tx.emit_message(OutboxMessage::new("OrderConfirmed", "orders.events", r#"{"order_id":42}"#).with_key("42"))?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[must_use = "an outbox transaction writes its events only when you `commit()` it; dropping it rolls everything back"]
pub struct OutboxTx<
    'c,
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    tx: Transaction<'c, DB>,
    /// Opened by [`Outbox::begin`] at the top level, so its commit may take the one-round-
    /// trip path where the database has one ([`Backend::write_commit_and_begin`]).
    own: bool,
    outbox: Outbox<DB>,
    pending: Vec<OutboxMessage>,
    /// Events were flushed before the commit: the commit still wakes an idle relay.
    wrote: bool,
    unsettled: Unsettled,
}

/// What an [`OutboxTx`] emitted, to warn when it is dropped holding events without a
/// `commit` or a `rollback` (an early return, a forgotten commit): those events are
/// gone, and the program said nothing.
#[derive(Debug, Default)]
struct Unsettled {
    events: usize,
    first: Option<(Uuid, String)>,
    settled: bool,
}

impl Unsettled {
    fn emitted(&mut self, message: &OutboxMessage) {
        self.events += 1;
        self.first
            .get_or_insert_with(|| (message.id, message.event_type.clone()));
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        // Unwinding from a panic says enough already.
        if self.settled || self.events == 0 || std::thread::panicking() {
            return;
        }
        let (first_id, first_type) = self.first.take().unwrap_or_default();
        tracing::warn!(
            events = self.events,
            first_event_type = %first_type,
            first_id = %first_id,
            "an outbox transaction holding events was dropped without commit(): its events \
             and changes were rolled back; commit it, or call rollback() to discard them on \
             purpose"
        );
    }
}

impl<'c, DB: Backend> OutboxTx<'c, DB> {
    pub(crate) fn begun(tx: Transaction<'c, DB>, outbox: Outbox<DB>) -> Self {
        OutboxTx {
            tx,
            own: true,
            outbox,
            pending: Vec::new(),
            wrote: false,
            unsettled: Unsettled::default(),
        }
    }

    /// Wraps a transaction you started yourself, so events can be emitted into it.
    ///
    /// In PostgreSQL's WAL mode its commit costs one more round trip than a transaction
    /// from [`Outbox::begin`] (the events are written, then `COMMIT` is sent); elsewhere
    /// both commit that way.
    pub fn from_transaction(tx: Transaction<'c, DB>, outbox: &Outbox<DB>) -> Self {
        OutboxTx {
            tx,
            own: false,
            outbox: outbox.clone(),
            pending: Vec::new(),
            wrote: false,
            unsettled: Unsettled::default(),
        }
    }

    /// The connection, for your own queries. Code that opens a transaction on it (for
    /// example through `sqlx::Acquire`) gets a savepoint inside this one.
    pub fn conn(&mut self) -> &mut DB::Connection {
        &mut self.tx
    }

    /// The underlying `sqlx` transaction.
    pub fn transaction(&mut self) -> &mut Transaction<'c, DB> {
        &mut self.tx
    }

    /// The outbox this transaction writes to.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    /// Collects `event`, to be written at commit. Returns its message id.
    ///
    /// Fails (without touching the transaction) if the event cannot be encoded by its
    /// codec or has an empty type or destination; you can still roll back, or commit
    /// without it.
    ///
    /// With the `opentelemetry` feature, the current `tracing` span's OpenTelemetry
    /// context is recorded as `traceparent` (and `tracestate`) headers, unless the
    /// message has a `traceparent` already.
    pub fn emit<E: OutboxEvent>(&mut self, event: E) -> Result<Uuid> {
        self.collect(OutboxMessage::from_event(&event)?)
    }

    /// Collects a message built by hand. Checked now: an empty event type or destination,
    /// a content type that cannot travel as a header, or a payload that is not JSON while
    /// its content type says JSON, is refused with
    /// [`Error::InvalidMessage`](crate::Error::InvalidMessage). The payload is stored and
    /// published byte for byte.
    pub fn emit_message(&mut self, message: OutboxMessage) -> Result<Uuid> {
        message.validate()?;
        self.collect(message)
    }

    /// A checked message, with the trace context, collected if its size is admitted.
    fn collect(&mut self, mut message: OutboxMessage) -> Result<Uuid> {
        crate::trace::capture(&mut message.headers);
        self.outbox.admit(&message)?;
        let id = message.id;
        self.unsettled.emitted(&message);
        self.pending.push(message);
        Ok(id)
    }

    /// The events emitted and not yet written, in emit order.
    pub fn pending(&self) -> &[OutboxMessage] {
        &self.pending
    }

    /// Writes the collected events now, still inside the transaction (they stay invisible
    /// to others until commit). Useful before reading the outbox in the same transaction;
    /// [`commit`](Self::commit) does it for you.
    ///
    /// On PostgreSQL, writing takes the outbox's writer lock until the transaction ends:
    /// until then the relay publishes nothing written after it began, for any key. Commit
    /// or roll back soon after; a transaction left open (idle in transaction, prepared)
    /// stalls the relay, which names it in `outbox status` and in a warning after 10 s.
    pub async fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let outbox = self.outbox.clone();
        let pending = std::mem::take(&mut self.pending);
        if let Err(e) = outbox.write(&mut self.tx, &pending).await {
            self.pending = pending;
            return Err(e);
        }
        self.wrote = true;
        Ok(())
    }

    /// Writes the collected events in one statement and commits them with everything
    /// else done in this transaction: one prepared `INSERT` with bound parameters, then
    /// `COMMIT`. In PostgreSQL's WAL mode, for a transaction from [`Outbox::begin`], the
    /// events and the `COMMIT` travel in one round trip.
    ///
    /// Fails with [`Error::TransactionAborted`](crate::Error::TransactionAborted), writing
    /// nothing, if the transaction can no longer commit what was done in it, even with no
    /// events: PostgreSQL aborted it after an error, or MySQL/MariaDB rolled it back (a
    /// deadlock), after which statements commit one by one.
    pub async fn commit(mut self) -> Result<()> {
        // Whatever happens now, the caller hears of it.
        self.unsettled.settled = true;
        let count = self.pending.len();
        let span = tracing::debug_span!("outbox.commit", events = count);
        // A handle (one `Arc`), so that its names and options outlive the borrows below.
        let outbox = self.outbox.clone();
        let (tables, options) = (outbox.tables(), outbox.options());
        if self.own {
            let done = DB::write_commit_and_begin(&mut self.tx, tables, options, &self.pending)
                .instrument(span.clone())
                .await?;
            if done {
                // Committed; `self.tx` now holds an empty transaction, rolled back when it
                // drops (queued, sent as the connection returns to the pool).
                tracing::debug!(events = count, "outbox transaction committed");
                return Ok(());
            }
        }
        if self.pending.is_empty() {
            // Nothing to write, which would have found out: a `COMMIT` alone does not
            // fail on a transaction that can no longer commit (PostgreSQL answers it
            // with a silent rollback; MySQL has nothing left to commit).
            DB::check_open(&mut self.tx, tables, options, self.wrote).await?;
        } else {
            self.flush().instrument(span).await?;
        }
        self.tx
            .commit()
            .await
            .context("committing the transaction", &tables.outbox)?;
        tracing::debug!(events = count, "outbox transaction committed");
        Ok(())
    }

    /// Rolls back: your changes are undone and no event is written.
    pub async fn rollback(mut self) -> Result<()> {
        self.unsettled.settled = true;
        let outbox = self.outbox.clone();
        self.tx
            .rollback()
            .await
            .context("rolling back the transaction", &outbox.tables().outbox)
    }
}

impl<DB: Backend> Deref for OutboxTx<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl<DB: Backend> DerefMut for OutboxTx<'_, DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

impl<DB: Backend> fmt::Debug for OutboxTx<'_, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxTx")
            .field("outbox", &self.outbox)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}
