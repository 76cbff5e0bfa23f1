//! MySQL/MariaDB: one multi-row `INSERT` per flush, preceded by a lock on the outbox's
//! writer-lock row.
//!
//! InnoDB hands out AUTO_INCREMENT values at insert time, not at commit, so a transaction
//! holding a smaller `seq` can commit after one holding a larger `seq`. A relay reading in
//! `seq` order could then publish the larger one first and break per-key order. To rule
//! that out, every transaction that writes outbox rows first locks the single row of
//! `<outbox>_lock` (`SELECT ... FOR UPDATE`) and keeps it until it commits or rolls back:
//! outbox writers run their INSERT-to-COMMIT stretch one at a time, so rows become visible
//! in `seq` order and the relay needs no horizon. The price: transactions that emit
//! events serialize from their flush (normally the commit) to their commit.

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::{Executor, MySql, MySqlConnection};
use tokio::sync::watch;

use super::sqlite_like::{chunks, insert_sql};
use super::{Backend, Sealed};
use crate::config::{TableName, Tables};
use crate::migrate::{self, MYSQL as MIGRATIONS};
use crate::publisher::Publisher;
use crate::relay::Relay;
use crate::{Error, Outbox, OutboxMessage, Result};

/// Rows per `INSERT` statement: 7 placeholders each stays under MySQL's 65,535.
const ROWS_PER_INSERT: usize = 9000;

/// Bytes of values per `INSERT` statement: far below the smallest default
/// `max_allowed_packet` (4 MiB on MySQL 5.7, 16 MiB on MariaDB, 64 MiB on MySQL 8), so a
/// large commit takes a few more statements instead of being refused.
const BYTES_PER_INSERT: usize = 2 * 1024 * 1024;

impl Sealed for MySql {}

impl Backend for MySql {
    fn insert_messages<'c>(
        conn: &'c mut MySqlConnection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(insert_messages(conn, tables, messages))
    }

    fn migrate<'c>(
        pool: &'c sqlx::MySqlPool,
        tables: &'c Tables,
    ) -> BoxFuture<'c, Result<Vec<i64>>> {
        Box::pin(migrate(pool, tables))
    }

    const RELAY_POLL_INTERVAL: Duration = Duration::from_millis(100);

    fn relay_session<'r, P: Publisher>(
        relay: &'r Relay<P, MySql>,
        shutdown: &'r mut watch::Receiver<bool>,
    ) -> BoxFuture<'r, std::result::Result<(), sqlx::Error>> {
        Box::pin(crate::relay::mysql::run(relay, shutdown))
    }
}

async fn insert_messages(
    conn: &mut MySqlConnection,
    tables: &Tables,
    messages: &[OutboxMessage],
) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    let table = tables.outbox.to_string();
    let lock = tables.outbox.with_suffix("_lock").backticked();
    conn.execute(format!("SELECT id FROM {lock} WHERE id = 1 FOR UPDATE").as_str())
        .await
        .map_err(|e| Error::db("taking the outbox writer lock", &table, e))?;
    let outbox = tables.outbox.backticked();
    for chunk in chunks(messages, ROWS_PER_INSERT, BYTES_PER_INSERT) {
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
        query
            .execute(&mut *conn)
            .await
            .map_err(|e| Error::db("writing events to the outbox", &table, e))?;
    }
    Ok(())
}

/// The SQL expression naming a server-wide lock (`GET_LOCK`) for one outbox table:
/// `prefix` plus the SHA-1 of `database.table`, so that outboxes in different databases
/// of one server never share a lock. Binds the table's schema (`NULL`: the connection's
/// database), then its name.
pub(crate) fn lock_name(prefix: &str) -> String {
    format!("CONCAT('{prefix}', SHA1(CONCAT(COALESCE(?, DATABASE()), '.', ?)))")
}

async fn migrate(pool: &sqlx::MySqlPool, tables: &Tables) -> Result<Vec<i64>> {
    let table = tables.migrations.to_string();
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| Error::db("connecting to migrate", &table, e))?;
    // MySQL DDL commits implicitly, so a transaction cannot serialize migrators: a named
    // lock does (one migrator per outbox table; others wait, then find nothing to do).
    let lock = lock_name("outbox-migrate:");
    let got: Option<i64> = sqlx::query_scalar(&format!("SELECT GET_LOCK({lock}, 60)"))
        .bind(tables.outbox.schema())
        .bind(tables.outbox.name())
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| Error::db("locking the migrations", &table, e))?;
    if got != Some(1) {
        return Err(Error::Migration {
            version: 0,
            description: "lock".to_owned(),
            problem: "could not take the migration lock within 60 s: another migration is running"
                .into(),
        });
    }
    let result = apply(&mut conn, tables).await;
    let _ = sqlx::query(&format!("SELECT RELEASE_LOCK({lock})"))
        .bind(tables.outbox.schema())
        .bind(tables.outbox.name())
        .execute(&mut *conn)
        .await;
    result
}

async fn apply(conn: &mut MySqlConnection, tables: &Tables) -> Result<Vec<i64>> {
    let table = tables.migrations.to_string();
    let migrations = tables.migrations.backticked();
    if let Some(schema) = tables.outbox.schema() {
        conn.execute(format!("CREATE DATABASE IF NOT EXISTS `{schema}`").as_str())
            .await
            .map_err(|e| Error::db("creating the outbox database", &table, e))?;
    }
    conn.execute(
        format!(
            "CREATE TABLE IF NOT EXISTS {migrations} (\
               version BIGINT PRIMARY KEY, description VARCHAR(255) NOT NULL, checksum BIGINT NOT NULL, \
               applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"
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
        let sql = m.render_with(tables, TableName::backticked, |name| format!("`{name}`"));
        for statement in migrate::statements(&sql) {
            conn.execute(statement.as_str())
                .await
                .map_err(|source| Error::Migration {
                    version: m.version,
                    description: m.description.to_owned(),
                    problem: format!(
                        "failed: {source}; MySQL cannot roll back DDL, so drop what this migration \
                         created before running it again"
                    )
                    .into(),
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

impl Outbox<MySql> {
    /// Connects to MySQL/MariaDB at `url` (`mysql://user:pass@host/db`) with a default pool
    /// and the default table names. Sessions use UTC (sqlx's default `time_zone`).
    /// (Not called `connect` so that `Outbox::connect` keeps naming the PostgreSQL
    /// constructor when several database features are on.)
    pub async fn connect_mysql(url: &str) -> Result<Self> {
        Ok(Outbox::new(crate::connect::pool(url).await?))
    }
}
