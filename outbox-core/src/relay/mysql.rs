//! The relay on MySQL/MariaDB: its own connection, polling, and one active relay per
//! outbox at a time.
//!
//! Ownership is a named lock (`GET_LOCK`) held by the relay's connection: other relays
//! stand by and try to take it every poll. A relay that dies loses its connection and
//! with it the lock; it cannot mark anything afterwards, because claims and marks go
//! through that same connection. One publisher at a time plus writers that commit in
//! `seq` order (see `store::mysql`) keeps per-key order with any number of relays and
//! late commits; scaling out is PostgreSQL's partitioned relay's job.

lite_session!(
    sqlx::MySql,
    sqlx::MySqlConnection,
    sqlx::mysql::MySqlRow,
    dialect
);

/// The prefix of the named lock the active relay holds (see `store::mysql::lock_name`).
pub(crate) const RELAY_LOCK: &str = "outbox-relay:";

/// What the MySQL/MariaDB relay says differently (see `poll::lite_session!`).
mod dialect {
    use sqlx::mysql::MySqlArguments;
    use sqlx::query::Query;
    use sqlx::{MySql, MySqlConnection};

    use crate::config::TableName;
    use crate::relay::OnSent;
    use crate::relay::drain::budgeted;

    pub(super) const NAME: &str = "MySQL/MariaDB";

    pub(super) fn quote(table: &TableName) -> String {
        table.backticked()
    }

    /// Binds: after, after (again), limit, byte budget.
    pub(super) fn claim(outbox: &str) -> String {
        budgeted(
            &format!(
                // CASTs: the columns' binary collation would make sqlx see bytes, not text.
                "SELECT o.seq, CAST(o.id AS CHAR) AS id, CAST(o.event_type AS CHAR) AS event_type, \
                        o.event_version, CAST(o.destination AS CHAR) AS destination, \
                        CAST(o.partition_key AS CHAR) AS partition_key, \
                        CAST(o.payload AS CHAR) AS payload, CAST(o.headers AS CHAR) AS headers, \
                        o.created_at, o.attempts \
                 FROM {outbox} o \
                 WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.seq > ? \
                   AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= UTC_TIMESTAMP(6)) \
                   AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                        WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                          AND r.sent_at IS NULL AND r.dead_at IS NULL AND {blocker}) \
                 ORDER BY o.seq LIMIT ?",
                blocker = crate::relay::blocker("UTC_TIMESTAMP(6)", "?"),
            ),
            "LENGTH(%)",
            "?",
        )
    }

    /// The seqs arrive as one bound JSON array (MariaDB >= 10.6, MySQL >= 8.0).
    pub(super) fn mark(outbox: &str, on_sent: OnSent) -> String {
        let seqs = "SELECT j.seq FROM JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS j";
        match on_sent {
            OnSent::Mark => {
                format!("UPDATE {outbox} SET sent_at = UTC_TIMESTAMP(6) WHERE seq IN ({seqs})")
            }
            OnSent::Delete => format!("DELETE FROM {outbox} WHERE seq IN ({seqs})"),
        }
    }

    pub(super) fn fail(outbox: &str) -> String {
        format!(
            "UPDATE {outbox} SET attempts = attempts + 1, last_error = ?, \
               dead_at = IF(?, UTC_TIMESTAMP(6), NULL), \
               next_attempt_at = IF(?, next_attempt_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
             WHERE seq = ?"
        )
    }

    /// Binds dead? (twice: `?` placeholders are positional) and the delay in µs.
    pub(super) fn bind_plan(
        query: Query<'_, MySql, MySqlArguments>,
        is_dead: bool,
        delay: f64,
    ) -> Query<'_, MySql, MySqlArguments> {
        query.bind(is_dead).bind(is_dead).bind((delay * 1e6) as i64)
    }

    pub(super) fn retrying(outbox: &str) -> String {
        format!(
            "SELECT DISTINCT CAST(partition_key AS CHAR) FROM {outbox} \
             WHERE sent_at IS NULL AND dead_at IS NULL \
             AND next_attempt_at IS NOT NULL AND partition_key IS NOT NULL"
        )
    }

    /// Takes the outbox's named lock if free (no wait); `true` if this session holds it.
    pub(super) async fn acquire(
        conn: &mut MySqlConnection,
        table: &TableName,
    ) -> sqlx::Result<bool> {
        let sql = format!(
            "SELECT GET_LOCK({}, 0)",
            crate::store::mysql::lock_name(super::RELAY_LOCK)
        );
        let got: Option<i64> = sqlx::query_scalar(&sql)
            .bind(table.schema())
            .bind(table.name())
            .fetch_one(conn)
            .await?;
        Ok(got == Some(1))
    }
}
