//! MySQL/MariaDB: the write path (one multi-row `INSERT` per flush, preceded by a lock
//! on the outbox's writer-lock row), the migration dialect, and the `Lite` dialect the
//! relay session and the stored-message SQL are rendered from (`dialect.rs`).
//!
//! InnoDB hands out AUTO_INCREMENT values at insert time, not at commit, so a transaction
//! holding a smaller `seq` can commit after one holding a larger `seq`. A relay reading in
//! `seq` order could then publish the larger one first and break per-key order. To rule
//! that out, every transaction that writes outbox rows first locks the single row of
//! `<outbox>_lock` (`SELECT ... FOR UPDATE`) and keeps it until it commits or rolls back:
//! outbox writers run their INSERT-to-COMMIT stretch one at a time, so rows become visible
//! in `seq` order and the relay needs no horizon. The price: transactions that emit
//! events serialize from their flush (normally the commit) to their commit.

//!
//! The relay: its own connection, polling, and one active relay per outbox at a time.
//! Ownership is a named lock (`GET_LOCK`) held by the relay's connection: other relays
//! stand by and try to take it every poll. A relay that dies loses its connection and
//! with it the lock; it cannot mark anything afterwards, because claims and marks go
//! through that same connection. One publisher at a time plus writers that commit in
//! `seq` order keeps per-key order with any number of relays and late commits; scaling
//! out is PostgreSQL's partitioned relay's job.

mod dialect;

use std::sync::atomic::{AtomicU8, Ordering as AtomicOrdering};

use futures_util::future::BoxFuture;
use sqlx::{MySql, MySqlConnection};

use crate::config::{TableName, Tables};
use crate::error::DbContext;
use crate::migrate::{MYSQL as MIGRATIONS, Migration};
use crate::store::schema::{self, Schema};
use crate::store::trusted_sql;
use crate::store::{Sealed, Write};
use crate::{Error, Outbox, OutboxMessage, Result};

mod backend {
    crate::db::lite::lite_backend!(sqlx::MySql);
}

/// Rows per `INSERT` statement: 8 placeholders each stays under MySQL's 65,535.
const ROWS_PER_INSERT: usize = 8000;

/// Bytes of values per `INSERT` statement: far below the smallest default
/// `max_allowed_packet` (4 MiB on MySQL 5.7, 16 MiB on MariaDB, 64 MiB on MySQL 8), so a
/// large commit takes a few more statements instead of being refused.
const BYTES_PER_INSERT: usize = 2 * 1024 * 1024;

/// The prefix of the named lock the active relay holds (see [`lock_name`]).
const RELAY_LOCK: &str = "outbox-relay:";

/// The prefix of the named lock a migrator holds.
const MIGRATE_LOCK: &str = "outbox-migrate:";

impl Sealed for MySql {}

impl crate::store::Database for MySql {
    type Options = ();

    /// The URL's database (`""` when the URL names none).
    fn database_name(pool: &sqlx::MySqlPool) -> String {
        pool.connect_options()
            .get_database()
            .unwrap_or_default()
            .to_owned()
    }
}

impl Write for MySql {
    fn insert_messages<'c>(
        conn: &'c mut MySqlConnection,
        tables: &'c Tables,
        _options: &'c (),
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(insert_messages(conn, tables, messages))
    }

    fn check_open<'c>(
        conn: &'c mut MySqlConnection,
        tables: &'c Tables,
        _options: &'c (),
        _wrote: bool,
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            let open = with_open_check(conn, |open| format!("SELECT {open}"))
                .await
                .context("checking the transaction", &tables.outbox)?;
            match open.flatten() {
                Some(open) => in_transaction(open == 1, tables),
                None => Ok(()), // MySQL: no way to ask
            }
        })
    }
}

/// Whether the server has `@@in_transaction` (MariaDB >= 10.3 does; MySQL has no such
/// variable), learned from the first statement that asks: 0 not known yet, 1 yes, 2 no.
static HAS_IN_TRANSACTION: AtomicU8 = AtomicU8::new(0);

/// Runs `sql(column)` with `column` = whether the transaction is open, where the server
/// can tell (MariaDB: `@@in_transaction`), else `NULL` (MySQL 8 has no way to ask in the
/// same statement, so its transactions are not checked); returns the first row's value.
async fn with_open_check(
    conn: &mut MySqlConnection,
    sql: impl Fn(&str) -> String,
) -> sqlx::Result<Option<Option<i64>>> {
    if HAS_IN_TRANSACTION.load(AtomicOrdering::Relaxed) != 2 {
        match sqlx::query_scalar(trusted_sql(sql("CAST(@@in_transaction AS SIGNED)")))
            .fetch_optional(&mut *conn)
            .await
        {
            Ok(row) => {
                HAS_IN_TRANSACTION.store(1, AtomicOrdering::Relaxed);
                return Ok(row);
            }
            // 1193: unknown system variable. The failed statement leaves the
            // transaction as it was.
            Err(e)
                if e.as_database_error()
                    .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
                    .is_some_and(|d| d.number() == 1193) =>
            {
                tracing::debug!(
                    "this MySQL server has no @@in_transaction; commits are not checked for a server-side rollback"
                );
                HAS_IN_TRANSACTION.store(2, AtomicOrdering::Relaxed);
            }
            Err(e) => return Err(e),
        }
    }
    sqlx::query_scalar(trusted_sql(sql("CAST(NULL AS SIGNED)")))
        .fetch_optional(conn)
        .await
}

/// After a deadlock or a lock wait timeout the server may have rolled the transaction
/// back, and the statements after it ran (and committed) one by one: events written now
/// would be committed alone, without the changes they announce.
fn in_transaction(open: bool, tables: &Tables) -> Result<()> {
    if open {
        Ok(())
    } else {
        Err(Error::TransactionAborted {
            table: tables.outbox.to_string(),
            reason: "it is no longer open: the server rolled it back (after a deadlock or a \
                     lock wait timeout, for example), and what ran after that was committed \
                     statement by statement",
        })
    }
}

impl Schema for MySql {
    const MIGRATIONS: &'static [Migration] = MIGRATIONS;
    // DDL commits implicitly: a transaction cannot hold a migration together.
    const TRANSACTIONAL_DDL: bool = false;

    fn quote(table: &TableName) -> String {
        table.backticked()
    }

    fn quote_ident(name: &str) -> String {
        format!("`{name}`")
    }

    fn ensure_table(tables: &Tables) -> Vec<String> {
        let migrations = tables.migrations.backticked();
        tables
            .outbox
            .schema()
            .map(|s| format!("CREATE DATABASE IF NOT EXISTS `{s}`"))
            .into_iter()
            .chain([format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (\
                   version BIGINT PRIMARY KEY, description VARCHAR(255) NOT NULL, checksum BIGINT NOT NULL, \
                   applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"
            )])
            .collect()
    }

    /// A named lock (one migrator per outbox table; others wait up to 60 s).
    fn lock<'c>(conn: &'c mut MySqlConnection, tables: &'c Tables) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            let got: Option<i64> = sqlx::query_scalar(trusted_sql(format!(
                "SELECT GET_LOCK({}, 60)",
                lock_name(MIGRATE_LOCK)
            )))
            .bind(tables.outbox.schema())
            .bind(tables.outbox.name())
            .fetch_one(conn)
            .await
            .context("locking the migrations", &tables.migrations)?;
            if got != Some(1) {
                return Err(Error::Migration {
                    version: 0,
                    description: "lock".to_owned(),
                    problem: "could not take the migration lock within 60 s: another migration is running"
                        .into(),
                });
            }
            Ok(())
        })
    }

    fn unlock<'c>(conn: &'c mut MySqlConnection, tables: &'c Tables) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            // Closing the connection would release it too: a failure here is no failure.
            let _ = sqlx::query(trusted_sql(format!(
                "SELECT RELEASE_LOCK({})",
                lock_name(MIGRATE_LOCK)
            )))
            .bind(tables.outbox.schema())
            .bind(tables.outbox.name())
            .execute(conn)
            .await;
            Ok(())
        })
    }

    fn migrate<'c>(
        pool: &'c sqlx::MySqlPool,
        tables: &'c Tables,
        _options: &'c (),
    ) -> BoxFuture<'c, Result<Vec<i64>>> {
        Box::pin(schema::run(pool, tables))
    }
}

impl Outbox<MySql> {
    /// Connects to MySQL/MariaDB at `url` (`mysql://user:pass@host/db`) with a default pool
    /// and the default table names. Sessions use UTC (sqlx's default `time_zone`).
    /// (Not called `connect` so that `Outbox::connect` keeps naming the PostgreSQL
    /// constructor when several database features are on.)
    pub async fn connect_mysql(url: &str) -> Result<Self> {
        Ok(Outbox::new(super::connect::pool(url).await?))
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
    let table = &tables.outbox;
    let lock_table = tables.outbox.with_suffix("_lock");
    let lock = lock_table.backticked();
    // One round trip: whether the transaction is still open (where the server can tell),
    // and the lock.
    let locked = with_open_check(conn, |open| {
        format!("SELECT {open} FROM {lock} WHERE id = 1 FOR UPDATE")
    })
    .await
    .context("taking the outbox writer lock", table)?;
    match locked {
        Some(Some(open)) => in_transaction(open == 1, tables)?,
        Some(None) => {} // MySQL: not checked
        None => {
            return Err(Error::Migration {
                version: 1,
                description: MIGRATIONS[0].description.to_owned(),
                problem: format!(
                    "is incomplete: the writer-lock table {lock_table} has no row, so writers \
                     would not serialize; nothing was written. Restore it with \
                     `INSERT INTO {lock_table} (id) VALUES (1)`"
                )
                .into(),
            });
        }
    }
    backend::insert_chunks(
        conn,
        tables,
        chunks(messages, ROWS_PER_INSERT, BYTES_PER_INSERT),
    )
    .await?;
    Ok(())
}

/// The SQL expression naming a server-wide lock (`GET_LOCK`) for one outbox table:
/// `prefix` plus the SHA-1 of `database.table`, so that outboxes in different databases
/// of one server never share a lock. Binds the table's schema (`NULL`: the connection's
/// database), then its name.
fn lock_name(prefix: &str) -> String {
    format!("CONCAT('{prefix}', SHA1(CONCAT(COALESCE(?, DATABASE()), '.', ?)))")
}

/// Splits `messages`, in order, into runs of at most `max_rows` messages and at most
/// about `max_bytes` of values (a message larger than that goes alone): one `INSERT`
/// each. The byte bound keeps a statement under the server's packet limit (MySQL's
/// `max_allowed_packet`), which 9,000 large rows would exceed. (SQLite has no such
/// limit on bound values; its store splits by rows only.)
pub(crate) fn chunks(
    messages: &[OutboxMessage],
    max_rows: usize,
    max_bytes: usize,
) -> Vec<&[OutboxMessage]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, m) in messages.iter().enumerate() {
        let size = 64 // the id, the version, the statement's own text per row
            + m.event_type.len()
            + m.destination.len()
            + m.partition_key.as_ref().map_or(0, String::len)
            + m.payload.len()
            + m.content_type.len()
            + m.headers.iter().map(|(k, v)| k.len() + v.len() + 6).sum::<usize>();
        if i > start && (i - start == max_rows || bytes + size > max_bytes) {
            out.push(&messages[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < messages.len() {
        out.push(&messages[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_bounded_by_rows_and_bytes_and_keep_the_order() {
        let m = |n: usize| OutboxMessage::new("T", "d", "x".repeat(n));
        let messages: Vec<OutboxMessage> = [10, 10, 10, 500, 10, 2000, 10].map(m).into();
        let sizes = |max_rows, max_bytes| -> Vec<usize> {
            chunks(&messages, max_rows, max_bytes)
                .iter()
                .map(|c| c.len())
                .collect()
        };
        assert_eq!(sizes(1000, usize::MAX), vec![7]);
        assert_eq!(sizes(3, usize::MAX), vec![3, 3, 1]);
        // 76 bytes each for the small ones, 566 and 2066 for the large ones.
        assert_eq!(sizes(1000, 700), vec![3, 2, 1, 1]);
        assert_eq!(
            sizes(1000, 1),
            vec![1; 7],
            "a message over the budget goes alone"
        );
        let flat: Vec<OutboxMessage> = chunks(&messages, 2, 300).concat();
        assert_eq!(flat, messages, "in order, each once");
        assert!(chunks(&[], 10, 10).is_empty());
    }
}
