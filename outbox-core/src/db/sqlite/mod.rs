//! SQLite: the write path (one multi-row `INSERT` per flush; transactions from
//! [`Outbox::begin`] start with `BEGIN IMMEDIATE`, taking SQLite's single write lock up
//! front), the migration dialect, and the `Lite` dialect the relay session and the
//! stored-message SQL are rendered from (`dialect.rs`).
//!
//! SQLite has one writer at a time, so transactions that write outbox rows commit in the
//! order their rows drew `seq` values: the relay needs no publish horizon. Readers (the
//! relay's claims) don't wait for writers in WAL mode, which [`Outbox::open`] turns on.

//!
//! The relay: its own connection, polling. One relay per database file: SQLite has no
//! session-scoped locks to share work or fence a second relay with, so a second relay on
//! the same file would publish the same rows twice (never out of order).

mod dialect;

use std::str::FromStr;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, Sqlite, SqliteConnection};

use crate::config::Tables;
use crate::migrate::{Migration, SQLITE as MIGRATIONS};
use crate::store::schema::{self, Schema};
use crate::store::{Sealed, Write};
use crate::{Error, Outbox, OutboxMessage, Result};

mod backend {
    crate::db::lite::lite_backend!(sqlx::Sqlite);
}

/// Rows per `INSERT` statement: 8 bound values each stays under SQLite's limit of
/// 32,766 variables. Commits with more events than this use several statements.
const ROWS_PER_INSERT: usize = 4000;

impl Sealed for Sqlite {}

impl crate::store::Database for Sqlite {
    type Options = ();

    /// The database file's name (without its folder), or `:memory:`.
    fn database_name(pool: &sqlx::SqlitePool) -> String {
        let options = pool.connect_options();
        let file = options.get_filename();
        file.file_name()
            .map_or_else(|| file.to_string_lossy(), |name| name.to_string_lossy())
            .into_owned()
    }
}

impl Write for Sqlite {
    fn insert_messages<'c>(
        conn: &'c mut SqliteConnection,
        tables: &'c Tables,
        _options: &'c (),
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(insert_messages(conn, tables, messages))
    }

    // IMMEDIATE: take the write lock at once (waiting up to the busy timeout), so a
    // transaction that reads before it writes never fails to upgrade its lock.
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");
}

impl Schema for Sqlite {
    const MIGRATIONS: &'static [Migration] = MIGRATIONS;
    const TRANSACTIONAL_DDL: bool = true;
    const CLOSE_AFTER: bool = false;
    /// The write lock for the whole migration: concurrent migrators wait, then find
    /// nothing to do.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";

    fn ensure_table(tables: &Tables) -> Vec<String> {
        vec![format!(
            "CREATE TABLE IF NOT EXISTS {} (\
               version INTEGER PRIMARY KEY, description TEXT NOT NULL, checksum INTEGER NOT NULL, \
               applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))",
            tables.migrations.quoted()
        )]
    }

    fn migrate<'c>(
        pool: &'c sqlx::SqlitePool,
        tables: &'c Tables,
        _options: &'c (),
    ) -> BoxFuture<'c, Result<Vec<i64>>> {
        Box::pin(schema::run(pool, tables))
    }
}

async fn insert_messages(
    conn: &mut SqliteConnection,
    tables: &Tables,
    messages: &[OutboxMessage],
) -> Result<()> {
    backend::insert_chunks(conn, tables, messages.chunks(ROWS_PER_INSERT)).await
}

impl Outbox<Sqlite> {
    /// Opens (creating it if needed) the SQLite database at `url` (`sqlite://path/to/app.db`
    /// or a plain path) with the settings the outbox wants: WAL journal (the relay reads
    /// while a writer writes), `synchronous = NORMAL`, a 10 s busy timeout, and the default
    /// table names. (Not called `connect` so that `Outbox::connect` keeps naming the
    /// PostgreSQL constructor when several database features are on.)
    pub async fn open(url: &str) -> Result<Self> {
        let options = if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(url).map_err(|source| Error::Database {
                context: "reading the SQLite URL",
                source,
            })?
        } else {
            SqliteConnectOptions::new().filename(url)
        };
        Self::open_with(options).await
    }

    /// Like [`open`](Self::open), with your own options; WAL, `synchronous = NORMAL`,
    /// the busy timeout and `create_if_missing` are set on top of them.
    pub async fn open_with(options: SqliteConnectOptions) -> Result<Self> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10));
        // Check once directly, so a bad path is reported at once and clearly.
        SqliteConnection::connect_with(&options)
            .await
            .map_err(|source| Error::Unavailable {
                target: format!(" at {}", options.get_filename().display()),
                source,
            })?
            .close()
            .await
            .map_err(|e| Error::db("opening the database", "", e))?;
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(|e| Error::db("opening the database", "", e))?;
        Ok(Outbox::new(pool))
    }
}
