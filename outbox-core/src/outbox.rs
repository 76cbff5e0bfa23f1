//! The [`Outbox`] handle: a pool plus the validated table configuration.

use std::fmt;
use std::sync::Arc;

use sqlx::{Pool, Transaction};
use tracing::Instrument;
use uuid::Uuid;

use crate::config::{TableName, Tables};
use crate::error::DbContext;
use crate::store::schema::Schema;
use crate::store::{Backend, Database, Write};
use crate::{OutboxEvent, OutboxMessage, OutboxTx, Result};

/// The entry point: a database pool and where the outbox lives in it.
///
/// Cheap to clone (an `Arc` inside); build it once at start-up and share it.
///
/// ```no_run
/// # async fn demo() -> outbox_core::Result<()> {
/// use outbox_core::Outbox;
///
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await.expect("db");
/// let outbox = Outbox::builder(pool).table("billing.outbox").build()?;
/// outbox.migrate().await?;
/// # Ok(()) }
/// ```
pub struct Outbox<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    inner: Arc<Inner<DB>>,
}

struct Inner<DB: Backend> {
    pool: Pool<DB>,
    tables: Tables,
    options: DB::Options,
    /// See [`OutboxBuilder::max_message_bytes`].
    max_message_bytes: Option<usize>,
}

impl<DB: Backend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Outbox {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<DB: Backend> fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("tables", &self.inner.tables)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Outbox<DB> {
    /// An outbox in table `outbox` (processed ids in `outbox_processed`) of `pool`'s database.
    pub fn new(pool: Pool<DB>) -> Self {
        Outbox {
            inner: Arc::new(Inner {
                pool,
                tables: Tables::default(),
                options: DB::Options::default(),
                max_message_bytes: None,
            }),
        }
    }

    /// Configures table names before building the handle.
    pub fn builder(pool: Pool<DB>) -> OutboxBuilder<DB> {
        OutboxBuilder {
            pool,
            outbox: None,
            processed: None,
            options: DB::Options::default(),
            max_message_bytes: None,
        }
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// The table names in use.
    pub fn tables(&self) -> &Tables {
        &self.inner.tables
    }

    /// The database's own options, beside its [`tables`](Self::tables): on PostgreSQL,
    /// [`postgres::Options`](crate::postgres::Options) (whether the outbox is in WAL
    /// mode, and its slot); `()` on MySQL and SQLite.
    pub fn options(&self) -> &DB::Options {
        &self.inner.options
    }

    /// Creates or upgrades the outbox tables. Safe to call at every start-up and from
    /// several processes at once: applied migrations are skipped.
    ///
    /// Returns the versions applied by this call (empty when already up to date).
    pub async fn migrate(&self) -> Result<Vec<i64>> {
        <DB as Schema>::migrate(&self.inner.pool, &self.inner.tables, &self.inner.options).await
    }

    /// Starts a transaction. Do your business writes through it, [`emit`](OutboxTx::emit)
    /// events, then [`commit`](OutboxTx::commit): the events are written atomically with
    /// your changes, or not at all.
    pub async fn begin(&self) -> Result<OutboxTx<'static, DB>> {
        // sqlx tracks the transaction (a `begin` inside it makes a savepoint) and rolls it
        // back if this future or the transaction is dropped.
        let tx = match <DB as Write>::BEGIN {
            Some(statement) => self.inner.pool.begin_with(statement).await,
            None => self.inner.pool.begin().await,
        }
        .context("starting a transaction", &self.inner.tables.outbox)?;
        Ok(OutboxTx::begun(tx, self.clone()))
    }

    /// Writes `events` into the outbox inside a transaction you already own.
    ///
    /// The events become visible, and relays are woken, when you commit `tx`; if you roll
    /// it back, they are gone with your other changes. Returns the message ids. With the
    /// `opentelemetry` feature each records the current span's trace context, as
    /// [`OutboxTx::emit`](crate::OutboxTx::emit) does (a `traceparent` you set wins).
    ///
    /// On PostgreSQL, writing takes the outbox's writer lock until the transaction ends:
    /// until then the relay publishes nothing written after it began, for any key. Commit
    /// or roll back soon after; a transaction left open (idle in transaction, prepared)
    /// stalls the relay, which names it in `outbox status` and in a warning after 10 s.
    pub async fn enqueue<I>(&self, tx: &mut Transaction<'_, DB>, events: I) -> Result<Vec<Uuid>>
    where
        I: IntoIterator,
        I::Item: OutboxEvent,
    {
        let messages = events
            .into_iter()
            .map(|e| OutboxMessage::from_event(&e))
            .collect::<Result<Vec<_>>>()?;
        self.enqueue_messages(tx, &messages).await?;
        Ok(messages.iter().map(|m| m.id).collect())
    }

    /// Like [`enqueue`](Self::enqueue), for messages built by hand.
    pub async fn enqueue_messages(
        &self,
        tx: &mut Transaction<'_, DB>,
        messages: &[OutboxMessage],
    ) -> Result<()> {
        for m in messages {
            m.validate()?;
        }
        // The trace context, as `OutboxTx::emit` records it, before the size check.
        let messages = crate::trace::captured(messages);
        for m in messages.iter() {
            self.admit(m)?;
        }
        self.write(&mut *tx, &messages).await
    }

    /// Refuses a message larger than [`max_message_bytes`](OutboxBuilder::max_message_bytes)
    /// when it is emitted: the broker would refuse it, and the relay would dead-letter it
    /// and park its key's later messages behind it.
    pub(crate) fn admit(&self, message: &OutboxMessage) -> Result<()> {
        let Some(limit) = self.inner.max_message_bytes else {
            return Ok(());
        };
        let bytes = message.payload.len()
            + message
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
        if bytes > limit {
            return Err(crate::Error::TooLarge {
                event_type: message.event_type.clone(),
                destination: message.destination.clone(),
                bytes,
                limit,
            });
        }
        Ok(())
    }

    pub(crate) async fn write(
        &self,
        conn: &mut DB::Connection,
        messages: &[OutboxMessage],
    ) -> Result<()> {
        let span = tracing::debug_span!("outbox.write", count = messages.len());
        <DB as Write>::insert_messages(conn, &self.inner.tables, &self.inner.options, messages)
            .instrument(span)
            .await
    }
}

/// Builds an [`Outbox`] with non-default table names. Names are validated in
/// [`build`](Self::build).
#[derive(Debug)]
#[must_use = "a builder does nothing until it is built or spawned"]
pub struct OutboxBuilder<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    pub(crate) pool: Pool<DB>,
    outbox: Option<String>,
    processed: Option<String>,
    /// The database's own options (PostgreSQL: WAL mode, set by `wal`, `wal_slot`...).
    pub(crate) options: DB::Options,
    max_message_bytes: Option<usize>,
}

impl<DB: Backend> OutboxBuilder<DB> {
    /// The outbox table, optionally schema-qualified (`"outbox"`, `"billing.outbox"`).
    /// The processed-messages and migrations tables default to names derived from it
    /// (`<table>_processed`, `<table>_migrations`).
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.outbox = Some(name.into());
        self
    }

    /// The consumers' processed-messages table.
    pub fn processed_table(mut self, name: impl Into<String>) -> Self {
        self.processed = Some(name.into());
        self
    }

    /// The largest message the brokers behind this outbox take, in bytes of payload and
    /// headers: a larger one is refused when it is emitted ([`Error::TooLarge`](crate::Error::TooLarge),
    /// naming its size and this limit), while the caller can still do something about
    /// it, instead of being dead-lettered by the relay later with its key's next messages
    /// parked behind it. Unset by default (no limit). The brokers' defaults: Kafka's
    /// `message.max.bytes` 1,048,588 (the whole record batch, keep a margin), NATS's
    /// `max_payload` 1 MiB, RabbitMQ's `max_message_size` 128 MiB.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = Some(bytes);
        self
    }

    /// Validates the names and builds the handle.
    pub fn build(self) -> Result<Outbox<DB>> {
        let mut tables = match &self.outbox {
            Some(name) => Tables::new(TableName::parse("outbox table name", name)?),
            None => Tables::default(),
        };
        if let Some(name) = &self.processed {
            tables.processed = TableName::parse("processed-messages table name", name)?;
        }
        let mut options = self.options;
        <DB as Database>::resolve(&mut options, &tables)?;
        Ok(Outbox {
            inner: Arc::new(Inner {
                pool: self.pool,
                tables,
                options,
                max_message_bytes: self.max_message_bytes,
            }),
        })
    }
}
