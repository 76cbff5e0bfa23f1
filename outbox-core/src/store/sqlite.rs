//! SQLite: one multi-row `INSERT` per flush; transactions from [`Outbox::begin`] start
//! with `BEGIN IMMEDIATE`, taking SQLite's single write lock up front.
//!
//! SQLite has one writer at a time, so transactions that write outbox rows commit in the
//! order their rows drew `seq` values: the relay needs no publish horizon. Readers (the
//! relay's claims) don't wait for writers in WAL mode, which [`Outbox::open`] turns on.

use std::str::FromStr;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, Executor, Sqlite, SqliteConnection};
use tokio::sync::watch;

use super::sqlite_like::insert_sql;
use super::{Backend, Sealed};
use crate::config::{TableName, Tables};
use crate::migrate::{self, SQLITE as MIGRATIONS};
use crate::publisher::Publisher;
use crate::relay::Relay;
use crate::{Error, Outbox, OutboxMessage, Result};

/// Rows per `INSERT` statement: 7 bound values each stays under SQLite's limit of
/// 32,766 variables. Commits with more events than this use several statements.
const ROWS_PER_INSERT: usize = 4000;

impl Sealed for Sqlite {}

impl Backend for Sqlite {
    fn insert_messages<'c>(
        conn: &'c mut SqliteConnection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(insert_messages(conn, tables, messages))
    }

    // IMMEDIATE: take the write lock at once (waiting up to the busy timeout), so a
    // transaction that reads before it writes never fails to upgrade its lock.
    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");

    fn migrate<'c>(
        pool: &'c sqlx::SqlitePool,
        tables: &'c Tables,
    ) -> BoxFuture<'c, Result<Vec<i64>>> {
        Box::pin(migrate(pool, tables))
    }

    const RELAY_POLL_INTERVAL: Duration = Duration::from_millis(100);

    fn relay_session<'r, P: Publisher>(
        relay: &'r Relay<P, Sqlite>,
        shutdown: &'r mut watch::Receiver<bool>,
    ) -> BoxFuture<'r, std::result::Result<(), sqlx::Error>> {
        Box::pin(crate::relay::sqlite::run(relay, shutdown))
    }
}

async fn insert_messages(
    conn: &mut SqliteConnection,
    tables: &Tables,
    messages: &[OutboxMessage],
) -> Result<()> {
    let outbox = tables.outbox.quoted();
    for chunk in messages.chunks(ROWS_PER_INSERT) {
        let sql = insert_sql(&outbox, chunk.len());
        let mut query = sqlx::query(&sql);
        for m in chunk {
            query = query
                .bind(m.id.to_string())
                .bind(m.event_type.as_str())
                .bind(m.event_version)
                .bind(m.destination.as_str())
                .bind(m.partition_key.as_deref())
                .bind(m.payload.as_str())
                .bind(m.headers_json()?);
        }
        query.execute(&mut *conn).await.map_err(|e| {
            Error::db(
                "writing events to the outbox",
                &tables.outbox.to_string(),
                e,
            )
        })?;
    }
    Ok(())
}

async fn migrate(pool: &sqlx::SqlitePool, tables: &Tables) -> Result<Vec<i64>> {
    let table = tables.migrations.to_string();
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| Error::db("connecting to migrate", &table, e))?;
    // The write lock for the whole migration: concurrent migrators wait, then find nothing to do.
    conn.execute("BEGIN IMMEDIATE")
        .await
        .map_err(|e| Error::db("starting the migration transaction", &table, e))?;
    let result = apply(&mut conn, tables).await;
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    conn.execute(end)
        .await
        .map_err(|e| Error::db("ending the migration transaction", &table, e))?;
    result
}

async fn apply(conn: &mut SqliteConnection, tables: &Tables) -> Result<Vec<i64>> {
    let table = tables.migrations.to_string();
    let migrations = tables.migrations.quoted();
    conn.execute(
        format!(
            "CREATE TABLE IF NOT EXISTS {migrations} (\
               version INTEGER PRIMARY KEY, description TEXT NOT NULL, checksum INTEGER NOT NULL, \
               applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))"
        )
        .as_str(),
    )
    .await
    .map_err(|e| Error::db("creating the migrations table", &table, e))?;
    let applied: Vec<(i64, String, i64)> = sqlx::query_as(&format!(
        "SELECT version, description, checksum FROM {migrations} ORDER BY version"
    ))
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| Error::db("reading the applied migrations", &table, e))?;
    let mut done = Vec::new();
    for m in migrate::pending(MIGRATIONS, &applied)? {
        let sql = m.render(tables, TableName::quoted);
        for statement in migrate::statements(&sql) {
            conn.execute(statement.as_str())
                .await
                .map_err(|source| Error::Migration {
                    version: m.version,
                    description: m.description.to_owned(),
                    problem: format!("failed: {source}; nothing was changed").into(),
                })?;
        }
        sqlx::query(&format!(
            "INSERT INTO {migrations} (version, description, checksum) VALUES (?, ?, ?)"
        ))
        .bind(m.version)
        .bind(m.description)
        .bind(m.checksum())
        .execute(&mut *conn)
        .await
        .map_err(|e| Error::db("recording a migration", &table, e))?;
        tracing::info!(
            version = m.version,
            description = m.description,
            "applied outbox migration"
        );
        done.push(m.version);
    }
    Ok(done)
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
