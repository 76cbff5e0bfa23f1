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
pub trait Backend: sqlx::Database + Sealed + crate::ops::Ops {
    /// Writes `messages` in one statement on `conn` (inside the caller's transaction) and
    /// wakes listening relays at commit.
    #[doc(hidden)]
    fn insert_messages<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>>;

    /// The statement [`Outbox::begin`](crate::Outbox::begin) opens its transaction with
    /// (`None`: the driver's default `BEGIN`).
    #[doc(hidden)]
    const BEGIN: Option<&'static str> = None;

    /// For a top-level transaction opened by [`Outbox::begin`](crate::Outbox::begin):
    /// writes `messages`, commits, and opens a new, empty transaction, all in one round
    /// trip, so that the `sqlx` transaction wrapping `conn` stays in step with the server
    /// (dropping it rolls the empty one back when the connection returns to the pool).
    /// Fails if the transaction was aborted by an earlier error. Returns `false` where the
    /// database has no such shortcut; the caller then writes and commits the usual way.
    #[doc(hidden)]
    fn write_commit_and_begin<'c>(
        _conn: &'c mut Self::Connection,
        _tables: &'c Tables,
        _messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<bool>> {
        Box::pin(async { Ok(false) })
    }

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
