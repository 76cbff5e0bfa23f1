//! The inbox: idempotent consumption. A handler's effect and the record that its message
//! was processed commit in **one** database transaction, so a message delivered twice
//! (at-least-once brokers, consumer restarts) takes effect once.
//!
//! ```no_run
//! use outbox_core::inbox::{Inbox, Processed};
//! use outbox_core::Outbox;
//!
//! # async fn demo(outbox: Outbox, message_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::new(&outbox, "billing");
//! let outcome = inbox
//!     .process(message_id, |tx| {
//!         Box::pin(async move {
//!             sqlx::query("UPDATE invoices SET paid = true WHERE id = 7")
//!                 .execute(&mut **tx)
//!                 .await?;
//!             Ok::<_, sqlx::Error>(())
//!         })
//!     })
//!     .await?;
//! match outcome {
//!     Processed::Handled(()) => println!("paid"),
//!     Processed::Duplicate => println!("seen before: skipped"),
//! }
//! # Ok(()) }
//! ```
//!
//! # How it works
//! [`Inbox::process`] begins a transaction and first inserts `(consumer, message_id)` into
//! the processed-messages table with `ON CONFLICT DO NOTHING`:
//!
//! - no row inserted: the message was processed before, the transaction is rolled back
//!   and the handler does **not** run ([`Processed::Duplicate`]);
//! - a row inserted: the handler runs with the transaction (an [`OutboxTx`], so it can
//!   also [`emit`](OutboxTx::emit) events: consume-and-publish is atomic too). On `Ok`
//!   the transaction commits, emitted events included; on `Err` (or a panic, or a
//!   dropped future) it rolls back, nothing is recorded, and a redelivery runs the
//!   handler again.
//!
//! Two concurrent deliveries of one message: the second insert waits on the first's
//! uncommitted row (on SQLite, the second transaction waits for the first, which holds
//! the write lock); if the first commits, the second is a duplicate; if it rolls back,
//! the second runs. Exactly one handler run commits. The same holds on PostgreSQL,
//! MySQL/MariaDB and SQLite (`Inbox<MySql>`, `Inbox<Sqlite>`).
//!
//! The consumer name scopes the deduplication: two services (or two independent
//! handlers) reading the same messages use different names.

use std::fmt;

use futures_util::future::BoxFuture;
use uuid::Uuid;

use crate::error::DbContext;
use crate::store::Backend;
use crate::{Error, Outbox, OutboxTx, Result};

/// What [`Inbox::process`] did with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Processed<T> {
    /// The handler ran and its transaction committed; its return value.
    Handled(T),
    /// The message had been processed already by this consumer: the handler did not run.
    Duplicate,
}

impl<T> Processed<T> {
    /// Whether the message was a duplicate.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Processed::Duplicate)
    }
}

/// Why [`Inbox::process`] failed. In both cases nothing was recorded: the message can be
/// processed again.
#[derive(Debug, thiserror::Error)]
pub enum InboxError<E> {
    /// The handler returned an error; its transaction was rolled back.
    #[error("message handler failed: {0}")]
    Handler(E),
    /// The database failed (begin, the processed-id insert, or the commit).
    #[error(transparent)]
    Database(Error),
}

/// Runs message handlers exactly once in effect, for one consumer name.
///
/// Cheap to clone. See the [module docs](self).
pub struct Inbox<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    outbox: Outbox<DB>,
    consumer: String,
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            outbox: self.outbox.clone(),
            consumer: self.consumer.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("consumer", &self.consumer)
            .field("table", &self.outbox.tables().processed)
            .finish()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// An inbox recording processed ids of `consumer` in `outbox`'s processed-messages
    /// table (`outbox.tables().processed`, created by [`Outbox::migrate`]).
    pub fn new(outbox: &Outbox<DB>, consumer: impl Into<String>) -> Inbox<DB> {
        Inbox {
            outbox: outbox.clone(),
            consumer: consumer.into(),
        }
    }

    /// The consumer name deduplication is scoped to.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The outbox whose tables this inbox uses.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    /// Runs `handler` for message `message_id` unless this consumer processed it before.
    ///
    /// The handler gets the transaction that also records the id; it must do its work
    /// through it (`&mut **tx` is the connection). It returns a boxed future:
    /// `|tx| Box::pin(async move { ... })`.
    pub async fn process<T, E, F>(
        &self,
        message_id: Uuid,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: for<'t> FnOnce(&'t mut OutboxTx<'static, DB>) -> BoxFuture<'t, Result<T, E>>,
    {
        let tables = self.outbox.tables();
        let mut tx = self.outbox.begin().await.map_err(InboxError::Database)?;
        let inserted = DB::record_processed(&mut tx, tables, &self.consumer, message_id)
            .await
            .context("recording a processed message id", &tables.processed)
            .map_err(InboxError::Database)?;
        if !inserted {
            tracing::debug!(consumer = %self.consumer, %message_id, "duplicate message skipped");
            tx.rollback().await.map_err(InboxError::Database)?;
            return Ok(Processed::Duplicate);
        }
        match handler(&mut tx).await {
            Ok(value) => {
                tx.commit().await.map_err(InboxError::Database)?;
                Ok(Processed::Handled(value))
            }
            Err(e) => {
                // Nothing recorded: a redelivery runs the handler again. A failed rollback
                // is harmless (the server rolls back when the connection goes).
                if let Err(rollback) = tx.rollback().await {
                    tracing::warn!(error = %crate::ErrorChain(&rollback), "rolling back a failed handler's transaction");
                }
                Err(InboxError::Handler(e))
            }
        }
    }

    /// Whether this consumer has processed `message_id` (committed).
    pub async fn is_processed(&self, message_id: Uuid) -> Result<bool> {
        DB::is_processed(
            self.outbox.pool(),
            self.outbox.tables(),
            &self.consumer,
            message_id,
        )
        .await
        .context(
            "looking up a processed message id",
            &self.outbox.tables().processed,
        )
    }
}
