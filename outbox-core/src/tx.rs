//! [`OutboxTx`]: a database transaction that collects events and writes them at commit.

use std::fmt;
use std::ops::{Deref, DerefMut};

use sqlx::Transaction;
use sqlx::pool::PoolConnection;
use tracing::Instrument;
use uuid::Uuid;

use crate::store::Backend;
use crate::{Error, Outbox, OutboxEvent, OutboxMessage, Result};

/// A database transaction plus the events emitted in it.
///
/// Use it as the connection for your own queries (`&mut *tx`, or [`conn`](Self::conn)),
/// [`emit`](Self::emit) events as things happen, then [`commit`](Self::commit): all
/// collected events are written in one statement and committed together with your
/// changes. Dropping it without committing, or [`rollback`](Self::rollback), writes
/// nothing and undoes your changes.
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
pub struct OutboxTx<'c, DB: Backend = crate::store::DefaultBackend> {
    conn: Conn<'c, DB>,
    outbox: Outbox<DB>,
    pending: Vec<OutboxMessage>,
}

/// Where the transaction lives.
enum Conn<'c, DB: Backend> {
    /// Begun by [`Outbox::begin`] on a pooled connection; we send `BEGIN` and `COMMIT`
    /// ourselves so the commit can carry the events in the same round trip. `open` is
    /// true until it is committed or rolled back.
    Own {
        conn: PoolConnection<DB>,
        open: bool,
    },
    /// A `sqlx` transaction the caller started ([`OutboxTx::from_transaction`]).
    Sqlx(Transaction<'c, DB>),
    /// Committed or rolled back (only seen inside `commit`, `rollback` and `drop`).
    Taken,
}

impl<'c, DB: Backend> OutboxTx<'c, DB> {
    pub(crate) async fn begin(mut conn: PoolConnection<DB>, outbox: Outbox<DB>) -> Result<Self> {
        DB::begin(&mut conn).await?;
        Ok(OutboxTx {
            conn: Conn::Own { conn, open: true },
            outbox,
            pending: Vec::new(),
        })
    }

    /// Wraps a transaction you started yourself, so events can be emitted into it.
    ///
    /// Its commit costs one more round trip than a transaction from [`Outbox::begin`]
    /// (the events are written, then `COMMIT` is sent).
    pub fn from_transaction(tx: Transaction<'c, DB>, outbox: &Outbox<DB>) -> Self {
        OutboxTx {
            conn: Conn::Sqlx(tx),
            outbox: outbox.clone(),
            pending: Vec::new(),
        }
    }

    /// The connection, for your own queries.
    pub fn conn(&mut self) -> &mut DB::Connection {
        match &mut self.conn {
            Conn::Own { conn, .. } => conn,
            Conn::Sqlx(tx) => tx,
            Conn::Taken => unreachable!("an OutboxTx is used only before commit or rollback"),
        }
    }

    /// The outbox this transaction writes to.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    /// Collects `event`, to be written at commit. Returns its message id.
    ///
    /// Fails (without touching the transaction) if the event cannot be serialized or has
    /// an empty type or destination; you can still roll back, or commit without it.
    pub fn emit<E: OutboxEvent>(&mut self, event: E) -> Result<Uuid> {
        let message = OutboxMessage::from_event(&event)?;
        let id = message.id;
        self.pending.push(message);
        Ok(id)
    }

    /// Collects a message built by hand. Checked now: an empty event type or destination,
    /// or a payload that is not JSON, is refused with [`Error::InvalidMessage`].
    pub fn emit_message(&mut self, message: OutboxMessage) -> Result<Uuid> {
        message.validate()?;
        let id = message.id;
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
    pub async fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let outbox = self.outbox.clone();
        let pending = std::mem::take(&mut self.pending);
        if let Err(e) = outbox.write(self.conn(), &pending).await {
            self.pending = pending;
            return Err(e);
        }
        Ok(())
    }

    /// Writes the collected events in one statement and commits them with everything
    /// else done in this transaction. For a transaction from [`Outbox::begin`] the
    /// events and the `COMMIT` travel in one round trip.
    pub async fn commit(mut self) -> Result<()> {
        let count = self.pending.len();
        let span = tracing::debug_span!("outbox.commit", events = count);
        let tables = self.outbox.tables().clone();
        let pending = std::mem::take(&mut self.pending);
        match &mut self.conn {
            Conn::Own { conn, open } => {
                // On failure `open` stays true: the drop rolls back.
                DB::write_and_commit(conn, &tables, &pending)
                    .instrument(span)
                    .await?;
                *open = false;
            }
            Conn::Sqlx(_) => {
                self.pending = pending;
                self.flush().instrument(span).await?;
                let Conn::Sqlx(tx) = std::mem::replace(&mut self.conn, Conn::Taken) else {
                    unreachable!("matched above")
                };
                tx.commit().await.map_err(|e| {
                    Error::db("committing the transaction", &tables.outbox.to_string(), e)
                })?;
            }
            Conn::Taken => {}
        }
        tracing::debug!(events = count, "outbox transaction committed");
        Ok(())
    }

    /// Rolls back: your changes are undone and no event is written.
    pub async fn rollback(mut self) -> Result<()> {
        self.pending.clear();
        match std::mem::replace(&mut self.conn, Conn::Taken) {
            Conn::Own { mut conn, open } => {
                if open {
                    if let Err(e) = DB::rollback(&mut conn).await {
                        // The connection's state is unknown: don't hand it to anyone else.
                        conn.close_on_drop();
                        return Err(e);
                    }
                }
                Ok(())
            }
            Conn::Sqlx(tx) => tx.rollback().await.map_err(|e| {
                Error::db(
                    "rolling back the transaction",
                    &self.outbox.tables().outbox.to_string(),
                    e,
                )
            }),
            Conn::Taken => Ok(()),
        }
    }
}

impl<DB: Backend> Drop for OutboxTx<'_, DB> {
    /// A transaction dropped while open (an early `?`, a panic, a cancelled future) is
    /// rolled back on a background task before its connection returns to the pool; with
    /// no runtime to run that on, the connection is closed, which rolls back too.
    fn drop(&mut self) {
        if let Conn::Own { open: true, .. } = &self.conn {
            let Conn::Own { mut conn, .. } = std::mem::replace(&mut self.conn, Conn::Taken) else {
                return;
            };
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        if DB::rollback(&mut conn).await.is_err() {
                            conn.close_on_drop();
                        }
                    });
                }
                Err(_) => conn.close_on_drop(),
            }
        }
    }
}

impl<DB: Backend> Deref for OutboxTx<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        match &self.conn {
            Conn::Own { conn, .. } => conn,
            Conn::Sqlx(tx) => tx,
            Conn::Taken => unreachable!("an OutboxTx is used only before commit or rollback"),
        }
    }
}

impl<DB: Backend> DerefMut for OutboxTx<'_, DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn()
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
