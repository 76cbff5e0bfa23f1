//! What a database provides, as narrow traits that the services and the relay drive:
//!
//! - [`Write`]: the write path (insert a commit's events, begin, the commit shortcut);
//! - [`schema::Schema`]: the migration dialect the one runner uses;
//! - [`ops::Ops`]: the SQL behind the inbox, retention and admin;
//! - [`Source`](session::Source): a relay session (open, claim, acknowledge, fail, wait
//!   for work, ownership), run by the one relay loop.
//!
//! [`Backend`] is all four; the implementations live in one folder per database under
//! `src/db/` (see [`docs/architecture.md`](https://github.com/outbox-rs/outbox/blob/main/docs/architecture.md)). None of this names a database module.

#[doc(hidden)]
pub mod ops;
#[doc(hidden)]
pub mod schema;
#[doc(hidden)]
pub mod session;

use futures_util::future::BoxFuture;

use crate::config::Tables;
use crate::{OutboxMessage, Result};
use ops::Ops;
use schema::Schema;

/// A statement built at run time, handed to sqlx. Every statement of this crate that is
/// not a literal is built from table and column names the configuration validated and
/// quotes (`TableName`) and from the crate's own constants; every value goes in as a bind
/// parameter, so nothing a caller or a row supplies is ever spliced into SQL. sqlx 0.9
/// asks each such statement to say so (`AssertSqlSafe`); this is the one place that does.
pub(crate) fn trusted_sql(statement: impl Into<String>) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(statement.into())
}

/// The database `Outbox`, `OutboxTx`, `Relay` and the other handles use when none is
/// named: PostgreSQL. It exists with the `postgres` feature only, and never means another
/// database: features are additive, so code written against MySQL or SQLite names its
/// database (`Outbox<sqlx::MySql>`, `OutboxTx<'_, sqlx::Sqlite>`) and keeps compiling when
/// something else in the build turns `postgres` on.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub type DefaultBackend = sqlx::Postgres;

/// What `#[transactional_outbox]` names for an `OutboxTx<'_>` without a database: the
/// default one with `postgres`, else a type that is no database, so that the error says
/// to name one (the note on [`Backend`]).
#[doc(hidden)]
pub mod default {
    #[cfg(feature = "postgres")]
    pub type DefaultBackend = sqlx::Postgres;
    #[cfg(not(feature = "postgres"))]
    pub type DefaultBackend = NoDatabaseNamed;

    /// Not a database: the backend of an `OutboxTx<'_>` that names none while the
    /// `postgres` feature (the default database) is off.
    #[derive(Debug)]
    pub enum NoDatabaseNamed {}
}

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// A database the outbox can live in: the write path, the migrations, the stored-message
/// operations and a relay session. Implemented by this crate for each supported `sqlx`
/// database (PostgreSQL, MySQL/MariaDB, SQLite, each behind its cargo feature); not
/// meant to be implemented outside it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a database of outbox",
    note = "outbox stores events in sqlx::Postgres (feature `postgres`, the database used when none is named), sqlx::MySql (`mysql`) or sqlx::Sqlite (`sqlite`)",
    note = "with `postgres` off, name the database: `Outbox<sqlx::MySql>`, `OutboxTx<'_, sqlx::Sqlite>`"
)]
pub trait Backend: Database + Write + Schema + Ops + session::Source + Sealed {}

impl<DB: Database + Write + Schema + Ops + session::Source + Sealed> Backend for DB {}

/// What a database has beyond the table names every database shares: its own options
/// (PostgreSQL: `outbox_core::postgres::Options`, WAL mode; MySQL and SQLite: none).
/// `Outbox<DB>` holds them beside its [`Tables`], and passes both to the write path, the
/// migrations, the stored-message SQL and the relay session.
#[doc(hidden)]
pub trait Database: sqlx::Database {
    /// The options (`()` where there are none).
    type Options: Clone + std::fmt::Debug + Default + Send + Sync + 'static;

    /// Checks and completes `options` once the table names are known
    /// (`OutboxBuilder::build`).
    fn resolve(_options: &mut Self::Options, _tables: &Tables) -> Result<()> {
        Ok(())
    }

    /// The name of the database `pool` points at, as a metrics label (the relay's
    /// `database`, a tenant's `<database>/<table>` with several databases).
    fn database_name(pool: &sqlx::Pool<Self>) -> String;
}

/// The write path: how a transaction begins and how its events are written.
#[doc(hidden)]
pub trait Write: Database {
    /// Writes `messages` in one statement on `conn` (inside the caller's transaction) and
    /// wakes listening relays at commit.
    fn insert_messages<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
        options: &'c Self::Options,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>>;

    /// The statement [`Outbox::begin`](crate::Outbox::begin) opens its transaction with
    /// (`None`: the driver's default `BEGIN`).
    const BEGIN: Option<&'static str> = None;

    /// Fails with [`Error::TransactionAborted`](crate::Error::TransactionAborted) if the
    /// transaction on `conn` can no longer commit what was done in it (PostgreSQL: an
    /// earlier statement failed; MySQL: the server rolled it back). Checked by a commit
    /// that writes no events (writing them checks it too). `wrote`: events were flushed
    /// earlier in this transaction, so the commit wakes an idle relay (PostgreSQL).
    fn check_open<'c>(
        _conn: &'c mut Self::Connection,
        _tables: &'c Tables,
        _options: &'c Self::Options,
        _wrote: bool,
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    /// For a top-level transaction opened by [`Outbox::begin`](crate::Outbox::begin):
    /// writes `messages`, commits, and opens a new, empty transaction, all in one round
    /// trip, so that the `sqlx` transaction wrapping `conn` stays in step with the server
    /// (dropping it rolls the empty one back when the connection returns to the pool).
    /// Fails if the transaction was aborted by an earlier error. Returns `false` where the
    /// database has no such shortcut; the caller then writes and commits the usual way.
    fn write_commit_and_begin<'c>(
        _conn: &'c mut Self::Connection,
        _tables: &'c Tables,
        _options: &'c Self::Options,
        _messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<bool>> {
        Box::pin(async { Ok(false) })
    }
}
