//! What `outbox doctor` and `outbox status` read from the server beyond the counts: the
//! oldest open writer (with its statement's literals masked), the table's health, the
//! relays connected and the replication slots.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Postgres, Row};

use crate::config::Tables;
use crate::store::trusted_sql;

use super::locks;

/// A transaction holding the outbox's writer lock; see [`Status::oldest_writer`](crate::admin::Status::oldest_writer).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct OpenWriter {
    /// Its server process (`pg_stat_activity.pid`); `None` for a prepared (two-phase)
    /// transaction, which no session holds: `COMMIT PREPARED` or `ROLLBACK PREPARED` ends it.
    pub pid: Option<i32>,
    /// How long ago its transaction began (or was prepared).
    pub age_seconds: f64,
    /// `pg_stat_activity.state` (`idle in transaction`, `active`...), or `prepared`.
    pub state: String,
    /// Its last statement (`pg_stat_activity.query`), with string literals masked as
    /// `'…'` and cut to 300 characters; `None` for a prepared transaction.
    pub query: Option<String>,
}

/// What the database says about the outbox's own health, for `outbox doctor`
/// (the `doctor` module): PostgreSQL only (`None` elsewhere).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Health {
    /// The outbox table with its indexes and TOAST, in bytes.
    pub table_bytes: i64,
    /// Live rows (`pg_stat_user_tables.n_live_tup`, an estimate).
    pub live_rows: i64,
    /// Dead row versions not vacuumed yet (`n_dead_tup`).
    pub dead_rows: i64,
    /// The last vacuum of the table, by autovacuum or by hand.
    pub last_vacuum: Option<DateTime<Utc>>,
    /// The table's storage parameters (`autovacuum_vacuum_scale_factor=0.01`...).
    pub storage_parameters: Vec<String>,
    /// Whether autovacuum may visit the table (its `autovacuum_enabled` parameter).
    pub table_autovacuum: bool,
    /// Dead rows past which autovacuum visits the table: `autovacuum_vacuum_threshold`
    /// plus `autovacuum_vacuum_scale_factor` times the row estimate (the table's own
    /// settings first).
    pub vacuum_trigger_rows: f64,
    /// The server is a standby (in recovery): relays and writers run on the primary.
    pub in_recovery: bool,
    /// Whether autovacuum runs on this server (`autovacuum` and `track_counts`).
    pub autovacuum_on: bool,
    /// The `seq` column's sequence, and its cache size (the relay needs 1).
    pub sequence: Option<String>,
    /// See [`sequence`](Self::sequence).
    pub sequence_cache: Option<i64>,
    /// The relays connected now, each with the partitions it holds.
    pub relays: Vec<RelayInstance>,
    /// The partition counts relays registered (one, unless relays disagree).
    pub partition_counts: Vec<i32>,
    /// Partitions held by a session that is not a relay of this outbox.
    pub partitions_held_by_others: Vec<i32>,
    /// The logical replication slots of this database.
    pub slots: Vec<ReplicationSlot>,
}

/// A relay connected to the outbox, as the server sees it; see [`Health::relays`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RelayInstance {
    /// Its connection's server process.
    pub pid: i32,
    /// `application_name` (`RelayConfig::application_name`).
    pub application_name: String,
    /// The client's address, when it connects over TCP.
    pub client: Option<String>,
    /// How long it has been connected.
    pub connected_seconds: f64,
    /// The partitions it publishes.
    pub partitions: Vec<i32>,
}

/// A logical replication slot; see [`Health::slots`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ReplicationSlot {
    /// Its name.
    pub name: String,
    /// Whether a client streams from it now.
    pub active: bool,
    /// WAL it keeps on disk (bytes from its `restart_lsn`).
    pub retained_bytes: Option<i64>,
    /// `wal_status` (`reserved`, `extended`, `unreserved`, `lost`).
    pub wal_status: Option<String>,
}

/// The oldest transaction holding the writer lock of the outbox `table` (quoted): the
/// one the publish horizon waits for. A prepared transaction holds it without a session.
pub(crate) async fn oldest_writer<'e, E>(
    executor: E,
    table: &str,
) -> sqlx::Result<Option<OpenWriter>>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let row: Option<(Option<i32>, f64, String, Option<String>)> = sqlx::query_as(trusted_sql(format!(
        "SELECT a.pid, \
                coalesce(extract(epoch FROM now() - coalesce(a.xact_start, p.prepared))::float8, 0), \
                CASE WHEN a.pid IS NULL THEN 'prepared' ELSE coalesce(a.state, 'unknown') END, \
                a.query \
         FROM pg_locks l \
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         LEFT JOIN pg_prepared_xacts p \
           ON l.pid IS NULL AND p.transaction::text = split_part(l.virtualtransaction, '/', 2) \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.objid = {writers} \
           AND l.classid = ($1::text::regclass::oid::int4)::oid \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         ORDER BY 2 DESC NULLS LAST LIMIT 1",
        writers = locks::WRITERS,
    )))
    .bind(table)
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|(pid, age_seconds, state, query)| OpenWriter {
        pid,
        age_seconds,
        state,
        query: query.map(|q| mask_literals(&q, 300)),
    }))
}

/// `query` without the data in it, cut to `max` characters: string constants (`'...'`,
/// `E'...'` with backslash escapes, dollar-quoted `$tag$...$tag$`) become `'…'` or `$…$`,
/// numeric constants `?`, comments are dropped; keywords, identifiers (`"quoted"` ones
/// too) and parameters (`$1`) stay. What a writer was doing, without what it wrote.
pub fn mask_literals(query: &str, max: usize) -> String {
    let chars: Vec<char> = query.chars().collect();
    let n = chars.len();
    let at = |i: usize| chars.get(i).copied();
    let word = |c: char| c.is_alphanumeric() || c == '_' || c == '$';
    let mut out = String::new();
    let mut i = 0;
    while i < n {
        let c = chars[i];
        let after_word = i > 0 && word(chars[i - 1]);
        if c == '-' && at(i + 1) == Some('-') {
            while i < n && chars[i] != '\n' {
                i += 1;
            }
            out.push(' ');
        } else if c == '/' && at(i + 1) == Some('*') {
            let mut depth = 0;
            while i < n {
                if chars[i] == '/' && at(i + 1) == Some('*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == Some('/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == '"' {
            // A quoted identifier, kept (`""` inside it is a quote).
            out.push('"');
            i += 1;
            while i < n {
                if chars[i] == '"' {
                    if at(i + 1) == Some('"') {
                        out.push_str("\"\"");
                        i += 2;
                        continue;
                    }
                    out.push('"');
                    i += 1;
                    break;
                }
                out.push(chars[i]);
                i += 1;
            }
        } else if c == '\'' || (matches!(c, 'E' | 'e') && at(i + 1) == Some('\'') && !after_word) {
            let escapes = c != '\'';
            i += if escapes { 2 } else { 1 };
            while i < n {
                if escapes && chars[i] == '\\' {
                    i += 2;
                } else if chars[i] == '\'' {
                    if at(i + 1) == Some('\'') {
                        i += 2;
                    } else {
                        i += 1;
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push_str("'…'");
        } else if c == '$' && !after_word {
            // `$tag$` (the tag empty or an identifier) opens a dollar-quoted string; `$1`
            // is a parameter.
            let mut j = i + 1;
            while j < n && (chars[j].is_alphanumeric() || chars[j] == '_') {
                j += 1;
            }
            let tagged = at(j) == Some('$') && !at(i + 1).is_some_and(|d| d.is_ascii_digit());
            if tagged {
                let tag: String = chars[i..=j].iter().collect();
                let rest: String = chars[j + 1..].iter().collect();
                i = match rest.find(&tag) {
                    Some(pos) => j + 1 + rest[..pos].chars().count() + tag.chars().count(),
                    None => n,
                };
                out.push_str("$…$");
            } else {
                out.push(c);
                i += 1;
            }
        } else if c.is_ascii_digit() && !after_word {
            while i < n && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '.' | '_')) {
                i += 1;
            }
            out.push('?');
        } else {
            out.push(c);
            i += 1;
        }
    }
    let collapsed = out.split_whitespace().collect::<Vec<_>>().join(" ");
    match collapsed.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &collapsed[..cut]),
        None => collapsed,
    }
}

/// The database's view of the outbox's health (`outbox doctor`).
pub(super) async fn health(pool: &PgPool, tables: &Tables) -> sqlx::Result<Option<Health>> {
    let t = tables.outbox.quoted();
    let mut conn = pool.acquire().await?;
    let row = sqlx::query(
        "SELECT pg_total_relation_size(c.oid) AS bytes, \
                coalesce(s.n_live_tup, 0) AS live, coalesce(s.n_dead_tup, 0) AS dead, \
                greatest(s.last_autovacuum, s.last_vacuum) AS vacuumed, \
                coalesce(c.reloptions, '{}')::text[] AS options, \
                current_setting('autovacuum') = 'on' AND current_setting('track_counts') = 'on' AS autovacuum, \
                q.name AS sequence, \
                coalesce((SELECT option_value::bool FROM pg_options_to_table(c.reloptions) \
                          WHERE option_name = 'autovacuum_enabled'), true) AS table_autovacuum, \
                (coalesce((SELECT option_value::float8 FROM pg_options_to_table(c.reloptions) \
                           WHERE option_name = 'autovacuum_vacuum_threshold'), \
                          current_setting('autovacuum_vacuum_threshold')::float8) \
                 + coalesce((SELECT option_value::float8 FROM pg_options_to_table(c.reloptions) \
                             WHERE option_name = 'autovacuum_vacuum_scale_factor'), \
                            current_setting('autovacuum_vacuum_scale_factor')::float8) \
                   * greatest(c.reltuples, 0)) AS trigger, \
                pg_is_in_recovery() AS recovery, \
                (SELECT seqcache FROM pg_sequence WHERE seqrelid = q.name::regclass) AS cache \
         FROM pg_class c \
         LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
         CROSS JOIN (SELECT pg_get_serial_sequence($1, 'seq') AS name) q \
         WHERE c.oid = $1::text::regclass",
    )
    .bind(&t)
    .fetch_one(&mut *conn)
    .await?;
    let mut health = Health {
        table_bytes: row.try_get("bytes")?,
        live_rows: row.try_get("live")?,
        dead_rows: row.try_get("dead")?,
        last_vacuum: row.try_get("vacuumed")?,
        storage_parameters: row.try_get("options")?,
        autovacuum_on: row.try_get("autovacuum")?,
        sequence: row.try_get("sequence")?,
        sequence_cache: row.try_get("cache")?,
        table_autovacuum: row.try_get("table_autovacuum")?,
        vacuum_trigger_rows: row.try_get("trigger")?,
        in_recovery: row.try_get("recovery")?,
        ..Health::default()
    };
    // This outbox's advisory locks (keyed by the table's oid), by session.
    let locks_cte = format!(
        "WITH l AS (SELECT pid, objid::int8 AS objid FROM pg_locks \
           WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
             AND classid = ($1::text::regclass::oid::int4)::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())), \
         relays AS (SELECT DISTINCT pid FROM l WHERE objid >= {relays} AND objid < {relays} + {max}), \
         parts AS (SELECT pid, (objid - {parts})::int4 AS p FROM l \
           WHERE objid >= {parts} AND objid < {parts} + 65536) ",
        relays = locks::RELAYS,
        max = locks::MAX_RELAYS,
        parts = locks::PARTITIONS,
    );
    let rows = sqlx::query(trusted_sql(format!(
        "{locks_cte} \
         SELECT r.pid, coalesce(a.application_name, '') AS name, host(a.client_addr) AS client, \
                coalesce(extract(epoch FROM now() - a.backend_start), 0)::float8 AS connected, \
                coalesce((SELECT array_agg(p ORDER BY p) FROM parts WHERE parts.pid = r.pid), '{{}}') AS partitions \
         FROM relays r LEFT JOIN pg_stat_activity a ON a.pid = r.pid ORDER BY r.pid"
    )))
    .bind(&t)
    .fetch_all(&mut *conn)
    .await?;
    for row in &rows {
        health.relays.push(RelayInstance {
            pid: row.try_get("pid")?,
            application_name: row.try_get("name")?,
            client: row.try_get("client")?,
            connected_seconds: row.try_get("connected")?,
            partitions: row.try_get("partitions")?,
        });
    }
    health.partition_counts = sqlx::query_scalar(trusted_sql(format!(
        "{locks_cte} SELECT DISTINCT (objid - {counts})::int4 FROM l \
         WHERE objid > {counts} AND objid <= {counts} + 65535 ORDER BY 1",
        counts = locks::PARTITION_COUNT,
    )))
    .bind(&t)
    .fetch_all(&mut *conn)
    .await?;
    health.partitions_held_by_others = sqlx::query_scalar(trusted_sql(format!(
        "{locks_cte} SELECT p FROM parts WHERE pid NOT IN (SELECT pid FROM relays) ORDER BY p"
    )))
    .bind(&t)
    .fetch_all(&mut *conn)
    .await?;
    let slots = sqlx::query(
        "SELECT slot_name::text AS name, active, \
                CASE WHEN pg_is_in_recovery() THEN NULL \
                     ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 END AS retained, \
                wal_status \
         FROM pg_replication_slots \
         WHERE slot_type = 'logical' AND database = current_database() ORDER BY slot_name",
    )
    .fetch_all(&mut *conn)
    .await?;
    for row in &slots {
        health.slots.push(ReplicationSlot {
            name: row.try_get("name")?,
            active: row.try_get("active")?,
            retained_bytes: row.try_get("retained")?,
            wal_status: row.try_get("wal_status")?,
        });
    }
    Ok(Some(health))
}

#[cfg(test)]
mod tests {
    use super::mask_literals;

    #[test]
    fn literals_are_masked_and_long_queries_cut() {
        let cases = [
            (
                "UPDATE users SET password = 'hunter''2', name = 'x'\n  WHERE id = $1",
                "UPDATE users SET password = '…', name = '…' WHERE id = $1",
            ),
            ("SELECT 'unterminated", "SELECT '…'"),
            (
                r#"SELECT "it's" FROM t WHERE a = 'secret'"#,
                r#"SELECT "it's" FROM t WHERE a = '…'"#,
            ),
            (r"SELECT E'a\'secret' , e'x'", "SELECT '…' , '…'"),
            (
                "SELECT $$card 4111$$, $o$x$o$ FROM t2 WHERE c = $2",
                "SELECT $…$, $…$ FROM t2 WHERE c = $2",
            ),
            (
                "SELECT 1 -- card 4111\n, /* 4111 /* nested */ */ t.col2",
                "SELECT ? , t.col2",
            ),
            (
                "UPDATE cards SET number = 4111111111111111, cvv = 1.5e3",
                "UPDATE cards SET number = ?, cvv = ?",
            ),
            ("SELECT 4111_1111_1111_1111", "SELECT ?"),
        ];
        for (query, masked) in cases {
            assert_eq!(mask_literals(query, 300), masked, "{query}");
        }
        assert_eq!(
            mask_literals(&"x".repeat(400), 300),
            format!("{}…", "x".repeat(300))
        );
    }
}
