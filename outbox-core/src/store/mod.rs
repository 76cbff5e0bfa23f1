//! Database back ends. Each implements [`Backend`] for one `sqlx` database.

#[cfg(feature = "postgres")]
pub mod postgres;

use futures_util::future::BoxFuture;

use crate::config::Tables;
use crate::{OutboxMessage, Result};

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// A database the outbox can live in. Implemented by this crate for each supported
/// `sqlx` database (PostgreSQL today); not meant to be implemented outside it.
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
}
