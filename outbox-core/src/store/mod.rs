//! Database back ends. Each implements [`Backend`] for one `sqlx` database.

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
mod sqlite_like;

use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use crate::config::Tables;
use crate::publisher::Publisher;
use crate::relay::Relay;
use crate::{OutboxMessage, Result};

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!("outbox-core needs at least one database feature: `postgres`, `mysql` or `sqlite`");

/// The database `Outbox`, `OutboxTx` and `Relay` use when none is named:
/// PostgreSQL if the `postgres` feature is on, else MySQL, else SQLite.
#[cfg(feature = "postgres")]
pub type DefaultBackend = sqlx::Postgres;
/// The database `Outbox`, `OutboxTx` and `Relay` use when none is named:
/// PostgreSQL if the `postgres` feature is on, else MySQL, else SQLite.
#[cfg(all(not(feature = "postgres"), feature = "mysql"))]
pub type DefaultBackend = sqlx::MySql;
/// The database `Outbox`, `OutboxTx` and `Relay` use when none is named:
/// PostgreSQL if the `postgres` feature is on, else MySQL, else SQLite.
#[cfg(all(not(feature = "postgres"), not(feature = "mysql"), feature = "sqlite"))]
pub type DefaultBackend = sqlx::Sqlite;

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// A database the outbox can live in. Implemented by this crate for each supported
/// `sqlx` database (PostgreSQL, MySQL/MariaDB, SQLite, each behind its cargo feature);
/// not meant to be implemented outside it.
pub trait Backend: sqlx::Database + Sealed {
    /// Writes `messages` in one statement on `conn` (inside the caller's transaction) and
    /// wakes listening relays at commit.
    #[doc(hidden)]
    fn insert_messages<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>>;

    /// Starts a transaction on `conn` (a pooled connection [`OutboxTx`](crate::OutboxTx)
    /// manages itself, so that its commit can carry the events).
    #[doc(hidden)]
    fn begin<'c>(conn: &'c mut Self::Connection) -> BoxFuture<'c, Result<()>>;

    /// Writes `messages` (if any) and commits, in one round trip where the database allows.
    #[doc(hidden)]
    fn write_and_commit<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>>;

    /// Rolls back the transaction started by [`begin`](Self::begin).
    #[doc(hidden)]
    fn rollback<'c>(conn: &'c mut Self::Connection) -> BoxFuture<'c, Result<()>>;

    /// Applies the pending migrations; returns the versions applied now.
    #[doc(hidden)]
    fn migrate<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
    ) -> BoxFuture<'c, Result<Vec<i64>>>;

    /// The relay's default poll interval on this database.
    #[doc(hidden)]
    const RELAY_POLL_INTERVAL: Duration;

    /// One database session of `relay`: runs until shutdown (`Ok`) or a database error.
    #[doc(hidden)]
    fn relay_session<'r, P: Publisher>(
        relay: &'r Relay<P, Self>,
        shutdown: &'r mut watch::Receiver<bool>,
    ) -> BoxFuture<'r, Result<(), sqlx::Error>>;
}
