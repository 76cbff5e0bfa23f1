//! What SQLite says differently from MySQL/MariaDB: its [`Lite`] dialect.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::query::Query;
use sqlx::sqlite::SqliteArguments;
use sqlx::{Sqlite, SqliteConnection};

use crate::config::{TableName, Tables};
use crate::db::lite::Lite;
use crate::store::trusted_sql;

impl Lite for Sqlite {
    fn quote(table: &TableName) -> String {
        table.quoted()
    }

    fn text(column: &str) -> String {
        column.to_owned()
    }

    /// `body` (migration 4 moved the payloads of older rows there, as their bytes).
    fn payload(prefix: &str) -> String {
        format!("{prefix}body")
    }

    /// Timestamps are stored as RFC 3339 text, UTC, with milliseconds, which sorts by time.
    const NOW: &'static str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";
    const CLOCK_MINUS: &'static str = "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?)";
    /// A write transaction holds the whole database already (`BEGIN IMMEDIATE`).
    const FOR_UPDATE: &'static str = "";
    const ADMIN_BEGIN: &'static str = "BEGIN IMMEDIATE";
    const CLAIM_PARAMS: [&'static str; 4] = ["?1", "?2", "?3", "?4"];
    const LENGTH: &'static str = "length(CAST(% AS BLOB))";

    type Ts = String;
    fn ts(t: DateTime<Utc>) -> String {
        t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
    }

    type Age = String;
    fn age(secs: f64) -> String {
        format!("-{secs:.3} seconds")
    }

    fn fail(outbox: &str) -> String {
        format!(
            "UPDATE {outbox} SET attempts = attempts + ?4, last_error = ?1, \
               dead_at = CASE WHEN ?2 THEN {now} END, \
               next_attempt_at = CASE WHEN ?2 THEN next_attempt_at \
                 ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3) END \
             WHERE seq = ?5",
            now = Self::NOW
        )
    }

    /// Binds `?2` (dead?) and `?3` (the delay, as a `strftime` modifier).
    fn bind_plan<'q>(
        query: Query<'q, Sqlite, SqliteArguments>,
        dead: bool,
        delay: f64,
    ) -> Query<'q, Sqlite, SqliteArguments> {
        query.bind(dead).bind(format!("+{delay:.3} seconds"))
    }

    fn delete_processed(table: &str) -> String {
        format!(
            "DELETE FROM {table} WHERE rowid IN \
             (SELECT rowid FROM {table} WHERE processed_at < ? ORDER BY processed_at LIMIT ?)"
        )
    }

    /// Nothing to end: one relay per file, no server.
    fn prepare_session(
        _conn: &mut SqliteConnection,
        _timeout: std::time::Duration,
    ) -> BoxFuture<'_, sqlx::Result<()>> {
        Box::pin(async { Ok(()) })
    }

    /// Always: one relay per file is the deployment rule (see the module docs).
    fn acquire<'c>(
        _conn: &'c mut SqliteConnection,
        _table: &'c TableName,
    ) -> BoxFuture<'c, sqlx::Result<bool>> {
        Box::pin(async { Ok(true) })
    }

    /// SQLite relays leave no trace to count; the row estimate is the `seq` span (cheap:
    /// both ends of the primary key).
    fn relays_and_rows<'c>(
        conn: &'c mut SqliteConnection,
        tables: &'c Tables,
    ) -> BoxFuture<'c, sqlx::Result<(Option<i64>, i64)>> {
        Box::pin(async move {
            let rows: i64 = sqlx::query_scalar(trusted_sql(format!(
                "SELECT COALESCE(MAX(seq) - MIN(seq) + 1, 0) FROM {}",
                tables.outbox.quoted()
            )))
            .fetch_one(conn)
            .await?;
            Ok((None, rows))
        })
    }
}
