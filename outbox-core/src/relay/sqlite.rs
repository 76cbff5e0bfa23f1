//! The relay on SQLite: its own connection, polling. One relay per database file: SQLite
//! has no session-scoped locks to share work or fence a second relay with, so a second
//! relay on the same file would publish the same rows twice (never out of order).

lite_session!(
    sqlx::Sqlite,
    sqlx::SqliteConnection,
    sqlx::sqlite::SqliteRow,
    dialect
);

/// What the SQLite relay says differently (see `poll::lite_session!`).
mod dialect {
    use sqlx::query::Query;
    use sqlx::sqlite::SqliteArguments;
    use sqlx::{Sqlite, SqliteConnection};

    use crate::config::TableName;
    use crate::relay::OnSent;
    use crate::relay::drain::budgeted;

    pub(super) const NAME: &str = "SQLite";

    /// `now()` as stored: RFC 3339 text, UTC, milliseconds.
    const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

    pub(super) fn quote(table: &TableName) -> String {
        table.quoted()
    }

    /// Binds: after, after (again), limit, byte budget.
    pub(super) fn claim(outbox: &str) -> String {
        budgeted(
            &format!(
                "SELECT o.seq, o.id, o.event_type, o.event_version, o.destination, o.partition_key, \
                        o.payload, o.headers, o.created_at, o.attempts \
                 FROM {outbox} o \
                 WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.seq > ?1 \
                   AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= {NOW}) \
                   AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                        WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                          AND r.sent_at IS NULL AND r.dead_at IS NULL AND {blocker}) \
                 ORDER BY o.seq LIMIT ?3",
                blocker = crate::relay::blocker(NOW, "?2"),
            ),
            "length(CAST(% AS BLOB))",
            "?4",
        )
    }

    pub(super) fn mark(outbox: &str, on_sent: OnSent) -> String {
        let seqs = "SELECT value FROM json_each(?1)";
        match on_sent {
            OnSent::Mark => format!("UPDATE {outbox} SET sent_at = {NOW} WHERE seq IN ({seqs})"),
            OnSent::Delete => format!("DELETE FROM {outbox} WHERE seq IN ({seqs})"),
        }
    }

    pub(super) fn fail(outbox: &str) -> String {
        format!(
            "UPDATE {outbox} SET attempts = attempts + 1, last_error = ?1, \
               dead_at = CASE WHEN ?2 THEN {NOW} END, \
               next_attempt_at = CASE WHEN ?2 THEN next_attempt_at \
                 ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3) END \
             WHERE seq = ?4"
        )
    }

    /// Binds `?2` (dead?) and `?3` (the delay, as a `strftime` modifier).
    pub(super) fn bind_plan<'q>(
        query: Query<'q, Sqlite, SqliteArguments<'q>>,
        is_dead: bool,
        delay: f64,
    ) -> Query<'q, Sqlite, SqliteArguments<'q>> {
        query.bind(is_dead).bind(format!("+{delay:.3} seconds"))
    }

    pub(super) fn retrying(outbox: &str) -> String {
        format!(
            "SELECT DISTINCT partition_key FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL \
             AND next_attempt_at IS NOT NULL AND partition_key IS NOT NULL"
        )
    }

    /// Always: one relay per file is the deployment rule (see the module docs).
    pub(super) async fn acquire(
        _conn: &mut SqliteConnection,
        _table: &TableName,
    ) -> sqlx::Result<bool> {
        Ok(true)
    }
}
