//! What MySQL/MariaDB says differently from SQLite: its [`Lite`] dialect.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::mysql::MySqlArguments;
use sqlx::query::Query;
use sqlx::{MySql, MySqlConnection};

use super::{RELAY_LOCK, lock_name};
use crate::config::{TableName, Tables};
use crate::db::lite::Lite;
use crate::store::trusted_sql;

impl Lite for MySql {
    fn quote(table: &TableName) -> String {
        table.backticked()
    }

    /// The columns' binary collation would make sqlx see bytes, not text.
    fn text(column: &str) -> String {
        format!("CAST({column} AS CHAR)")
    }

    /// `body`, or, in a row written before payloads were bytes (migration 3), the
    /// bytes of its JSON text as they were published then.
    fn payload(prefix: &str) -> String {
        format!("COALESCE({prefix}body, CAST(CAST({prefix}payload AS CHAR) AS BINARY))")
    }

    const NOW: &'static str = "UTC_TIMESTAMP(6)";
    const CLOCK_MINUS: &'static str = "SELECT UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND";
    const FOR_UPDATE: &'static str = " FOR UPDATE";
    /// Deletes and updates take no gap locks that would hold back writers appending
    /// rows; one round trip, so the setting cannot outlive this transaction.
    const ADMIN_BEGIN: &'static str =
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";
    const CLAIM_PARAMS: [&'static str; 4] = ["?", "?", "?", "?"];
    const LENGTH: &'static str = "LENGTH(%)";

    type Ts = DateTime<Utc>;
    fn ts(t: DateTime<Utc>) -> DateTime<Utc> {
        t
    }

    type Age = i64;
    fn age(secs: f64) -> i64 {
        (secs * 1e6) as i64
    }

    fn fail(outbox: &str) -> String {
        format!(
            "UPDATE {outbox} SET last_error = ?, \
               dead_at = IF(?, UTC_TIMESTAMP(6), NULL), \
               next_attempt_at = IF(?, next_attempt_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
               attempts = attempts + ? \
             WHERE seq = ?"
        )
    }

    /// Binds dead? (twice: `?` placeholders are positional) and the delay in µs.
    fn bind_plan<'q>(
        query: Query<'q, MySql, MySqlArguments>,
        dead: bool,
        delay: f64,
    ) -> Query<'q, MySql, MySqlArguments> {
        query.bind(dead).bind(dead).bind((delay * 1e6) as i64)
    }

    fn delete_processed(table: &str) -> String {
        format!("DELETE FROM {table} WHERE processed_at < ? ORDER BY processed_at LIMIT ?")
    }

    fn prepare_session(
        conn: &mut MySqlConnection,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, sqlx::Result<()>> {
        Box::pin(async move {
            sqlx::query("SET SESSION wait_timeout = ?")
                .bind(timeout.as_secs().max(1))
                .execute(&mut *conn)
                .await?;
            // Under REPEATABLE READ an `UPDATE` the optimizer runs as a scan (a batch
            // covering most of a small table) locks every row it reads, gaps included:
            // the mark would wait for an operator holding a dead letter, deadlock with
            // admin transactions and hold back writers' inserts. READ COMMITTED locks the
            // rows it changes only, and the relay reads nothing twice in a transaction.
            sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    /// Takes the outbox's named lock if free (no wait).
    fn acquire<'c>(
        conn: &'c mut MySqlConnection,
        table: &'c TableName,
    ) -> BoxFuture<'c, sqlx::Result<bool>> {
        Box::pin(async move {
            let got: Option<i64> = sqlx::query_scalar(trusted_sql(format!(
                "SELECT GET_LOCK({}, 0)",
                lock_name(RELAY_LOCK)
            )))
            .bind(table.schema())
            .bind(table.name())
            .fetch_one(conn)
            .await?;
            Ok(got == Some(1))
        })
    }

    /// Whether a relay holds the outbox's named lock, and InnoDB's row estimate.
    fn relays_and_rows<'c>(
        conn: &'c mut MySqlConnection,
        tables: &'c Tables,
    ) -> BoxFuture<'c, sqlx::Result<(Option<i64>, i64)>> {
        Box::pin(async move {
            let (relays, rows): (i64, Option<i64>) = sqlx::query_as(trusted_sql(format!(
                "SELECT CAST(IS_USED_LOCK({lock}) IS NOT NULL AS SIGNED), \
                        (SELECT CAST(TABLE_ROWS AS SIGNED) FROM information_schema.TABLES \
                         WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?)",
                lock = lock_name(RELAY_LOCK),
            )))
            .bind(tables.outbox.schema())
            .bind(tables.outbox.name())
            .bind(tables.outbox.schema())
            .bind(tables.outbox.name())
            .fetch_one(conn)
            .await?;
            Ok((Some(relays), rows.unwrap_or(-1)))
        })
    }
}
