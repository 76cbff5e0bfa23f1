//! PostgreSQL: the write path (one `INSERT ... SELECT FROM UNNEST(...)` per flush,
//! `pg_notify` at commit while a relay waits idle), the migration dialect, the stored-message SQL (`ops.rs`) and
//! the relay session (`session.rs`, with its publish horizon in `horizon.rs`).

mod horizon;
mod lease;
mod ops;
mod partitions;
mod session;
mod tenants;
mod wal;

use futures_util::future::BoxFuture;
use sqlx::{Executor, PgConnection, Postgres};

use crate::config::{TableName, Tables};
use crate::error::DbContext;
use crate::migrate::{Migration, POSTGRES as MIGRATIONS};
use crate::store::schema::{self, Schema};
use crate::store::{Sealed, Write};
use crate::{Error, Outbox, OutboxMessage, Result};

impl Sealed for Postgres {}

impl Write for Postgres {
    fn insert_messages<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(insert_messages(conn, tables, messages))
    }

    /// `SELECT 1` (or the wake-up, when events were flushed earlier) fails in an aborted
    /// transaction (25P02). Prepared once per connection: as a simple query it was parsed
    /// and planned at every commit without events (14 µs of planning for 3 of execution).
    fn check_open<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        wrote: bool,
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            sqlx::query(&nothing_to_write(tables, wrote))
                .execute(&mut *conn)
                .await
                .context("checking the transaction", &tables.outbox)?;
            Ok(())
        })
    }

    /// WAL mode only: its events and the `COMMIT` travel in one round trip. In table mode
    /// the events go through the prepared `INSERT` with bound parameters ([`insert_sql`])
    /// and `COMMIT` follows: parsing and planning the rows as literals at every commit
    /// cost more than the round trip saved (`docs/benchmarks.md`, scenario `notify`).
    fn write_commit_and_begin<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<bool>> {
        Box::pin(async move {
            let Some(w) = &tables.wal else {
                return Ok(false);
            };
            write_commit_and_begin(conn, tables, w, messages).await?;
            Ok(true)
        })
    }
}

impl Schema for Postgres {
    const MIGRATIONS: &'static [Migration] = MIGRATIONS;
    const TRANSACTIONAL_DDL: bool = true;
    const THREE_PARAMS: &'static str = "$1, $2, $3";

    fn quote(table: &TableName) -> String {
        table.quoted()
    }

    fn ensure_table(tables: &Tables) -> Vec<String> {
        let schema = tables.outbox.schema();
        schema
            .map(|s| format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""))
            .into_iter()
            .chain([format!(
                "CREATE TABLE IF NOT EXISTS {} (\
                   version bigint PRIMARY KEY, \
                   description text NOT NULL, \
                   checksum bigint NOT NULL, \
                   applied_at timestamptz NOT NULL DEFAULT now())",
                tables.migrations.quoted()
            )])
            .collect()
    }

    /// The whole file at once (the simple protocol runs its statements in order).
    fn statements(migration: &Migration, tables: &Tables) -> Vec<String> {
        vec![migration.render(tables, TableName::quoted)]
    }

    /// A transaction holding an advisory lock on the outbox's name until it ends.
    fn lock<'c>(conn: &'c mut PgConnection, tables: &'c Tables) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            conn.execute("BEGIN")
                .await
                .context("starting the migration transaction", &tables.migrations)?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
                .bind(format!("outbox-migrate:{}", tables.outbox))
                .execute(conn)
                .await
                .context("locking the migrations", &tables.migrations)?;
            Ok(())
        })
    }

    fn unlock<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        ok: bool,
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            conn.execute(if ok { "COMMIT" } else { "ROLLBACK" })
                .await
                .context("committing the migrations", &tables.migrations)?;
            Ok(())
        })
    }

    /// In WAL mode, also creates the publication and the replication slot: before the
    /// first event is written, since a slot sees only what is written after it.
    fn migrate<'c>(pool: &'c sqlx::PgPool, tables: &'c Tables) -> BoxFuture<'c, Result<Vec<i64>>> {
        Box::pin(async move {
            let applied = schema::run(pool, tables).await?;
            if let Some(w) = &tables.wal {
                wal::ensure_slot(pool, tables, w).await?;
            }
            Ok(applied)
        })
    }
}

/// The oldest transaction holding the writer lock of the outbox `table` (quoted): the
/// one the publish horizon waits for. A prepared transaction holds it without a session.
pub(crate) async fn oldest_writer<'e, E>(
    executor: E,
    table: &str,
) -> sqlx::Result<Option<crate::model::OpenWriter>>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let row: Option<(Option<i32>, f64, String, Option<String>)> = sqlx::query_as(&format!(
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
    ))
    .bind(table)
    .fetch_optional(executor)
    .await?;
    Ok(row.map(
        |(pid, age_seconds, state, query)| crate::model::OpenWriter {
            pid,
            age_seconds,
            state,
            query: query.map(|q| mask_literals(&q, 300)),
        },
    ))
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

impl Outbox<Postgres> {
    /// Connects to PostgreSQL at `url` with a default pool and the default table names.
    ///
    /// The error names the server (without the password) and says what to check.
    pub async fn connect(url: &str) -> Result<Self> {
        Ok(Outbox::new(super::connect::pool(url).await?))
    }

    /// The `LISTEN`/`NOTIFY` channel notified at every commit that wrote events:
    /// `outbox_<oid of the outbox table>`, so outboxes in different schemas never wake
    /// each other's relays.
    pub async fn notify_channel(&self) -> Result<String> {
        let outbox = &self.tables().outbox;
        sqlx::query_scalar("SELECT 'outbox_' || $1::text::regclass::oid::text")
            .bind(outbox.quoted())
            .fetch_one(self.pool())
            .await
            .context("resolving the notification channel", outbox)
    }
}

/// Advisory locks of one outbox table use the two-key form `(table oid as int4, id)`,
/// so outboxes in different schemas or with different names never share a lock.
pub(crate) mod locks {
    /// Held shared by every transaction writing outbox rows, from before its rows draw
    /// `seq` values until it ends.
    pub(crate) const WRITERS: i32 = 0;
    /// `PARTITIONS + p`: held by the relay publishing partition `p`.
    pub(crate) const PARTITIONS: i32 = 1_000_000;
    /// `RELAYS + slot`: held by each running relay (one slot each), to count them.
    pub(crate) const RELAYS: i32 = 2_000_000;
    /// Relay slots per outbox.
    pub(crate) const MAX_RELAYS: i32 = 4096;
    /// `PARTITION_COUNT + n`: held shared by every running relay configured with `n`
    /// partitions, so that a relay configured differently can see it and stand by.
    pub(crate) const PARTITION_COUNT: i32 = 3_000_000;
    /// Held shared by each relay while it waits idle: commits notify only then
    /// (`wake_sql`).
    pub(crate) const IDLE: i32 = 4_000_000;
    /// Held for a moment while a relay checks and registers its partition count.
    pub(crate) const PARTITION_COUNT_CHECK: i32 = 2_999_999;
}

/// The flush statement. Before the rows draw their `seq` values (the materialized CTE
/// runs first), the transaction takes the writer lock in shared mode and keeps it until
/// it ends: relays compute their publish horizon from it (see `relay::horizon`).
/// The table's oid keys the lock; it is looked up when the statement runs
/// (`to_regclass`), not when it is parsed: a statement parsed while
/// `Outbox::partition_by_time` replaced the table would otherwise lock under the old
/// table's oid, which the relays no longer watch, while writing into the new one. Rows get
/// their `seq` in emit order (the `ORDER BY` keeps the sub-select from being flattened).
/// The notification (sent while a relay waits idle: [`wake_sql`]) is delivered to listeners
/// exactly when the transaction commits.
fn insert_sql(tables: &Tables) -> String {
    write_statement(
        tables,
        "SELECT m.id, m.event_type, m.event_version, m.destination, m.partition_key, \
                m.payload::jsonb, m.headers::jsonb \
         FROM x, UNNEST($1::uuid[], $2::text[], $3::int4[], $4::text[], $5::text[], $6::text[], $7::text[]) \
              WITH ORDINALITY AS m(id, event_type, event_version, destination, partition_key, payload, headers, ord) \
         ORDER BY m.ord",
    )
}

/// [`insert_sql`] for one event, with scalar parameters: no arrays to encode and decode,
/// no row source to order (most commits write one event).
fn insert_one_sql(tables: &Tables) -> String {
    write_statement(
        tables,
        "SELECT $1::uuid, $2::text, $3::int4, $4::text, $5::text, $6::text::jsonb, $7::text::jsonb FROM x",
    )
}

/// The writer lock and the UTF-8 guard (`x`, materialized first), the `INSERT` of the
/// rows `select` gives (reading `x`), and the wake-up.
fn write_statement(tables: &Tables, select: &str) -> String {
    format!(
        "WITH x AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(to_regclass('{outbox}')::oid::int4, {writers}) AS locked, {utf8} AS utf8), \
         ins AS (\
           INSERT INTO {outbox} \
             (id, event_type, event_version, destination, partition_key, payload, headers) \
           {select}\
         ) \
         {wake}",
        outbox = tables.outbox.quoted(),
        writers = locks::WRITERS,
        utf8 = UTF8_GUARD,
        wake = wake_sql(&tables.outbox.quoted(), "FROM x"),
    )
}

/// The statement that wakes an idle relay at commit: `pg_notify` on the outbox's channel,
/// but only while a relay waits idle, which it shows by holding the idle lock
/// ([`locks::IDLE`]) in shared mode. A `NOTIFY` takes an instance-wide lock from the
/// commit's start to its end (WAL flush included), so notifying commits queue one behind
/// another; a relay that is busy finds the rows by itself.
///
/// The probe is a momentary exclusive try of the idle lock (taken and given back in one
/// `CASE`, so never left held): it fails while any relay holds it. It runs after the
/// writer lock is taken (`from`: the materialized CTE `x` that takes it, or nothing when
/// the transaction took it with an earlier flush). Lock state is not subject to snapshots,
/// so a relay that declares itself idle (takes the lock, then samples the writers and
/// claims once more) either sees this writer in flight or is notified by it.
fn wake_sql(outbox: &str, from: &str) -> String {
    format!(
        "SELECT pg_notify('outbox_' || to_regclass('{outbox}')::oid::text, '') {from}          WHERE CASE WHEN pg_try_advisory_lock(to_regclass('{outbox}')::oid::int4, {idle})            THEN NOT pg_advisory_unlock(to_regclass('{outbox}')::oid::int4, {idle}) ELSE true END",
        idle = locks::IDLE,
    )
}

/// Fails the statement, before any row is written, on a connection whose
/// `client_encoding` is not UTF-8: sqlx sends UTF-8, which the server would convert from
/// the other encoding, garbling the events (and, in client-only encodings such as SJIS,
/// whose second bytes include `\`, swallowing bytes next to a quote). sqlx connects with
/// UTF-8; only a `SET client_encoding` on a pooled connection changes it. The error is an
/// integer cast of a message naming the problem: plain SQL has no `RAISE`, and the text is
/// not a constant (`pg_client_encoding()` is stable), so the planner does not fold it
/// into an error on every connection. `pg_client_encoding()` gives the canonical name
/// (`SET client_encoding = 'UNICODE'` is UTF-8, and `current_setting` would say UNICODE).
const UTF8_GUARD: &str = "CASE WHEN pg_client_encoding() = 'UTF8' THEN 0 ELSE \
     ('the outbox needs client_encoding UTF8 but this connection uses ' || pg_client_encoding() || \
      '; nothing was written: do not change client_encoding on pooled connections')::int END";

/// Appends `value` as a dollar-quoted literal, `$o$...$o$`, with a tag (`$o$`, `$o1$`,
/// ...) whose text without the closing `$` does not occur in `value`, so the first
/// occurrence of the tag after the opening one is the closing one. Nothing inside is an
/// escape: neither `standard_conforming_strings` nor `backslash_quote` changes what it
/// means, and no client encoding can join the closing `$` to the bytes before it (`$` is
/// never the second byte of a multi-byte character; an incomplete one before it is an
/// encoding error, not a shorter string). `E'...'` literals could be broken that way
/// on a connection switched to SJIS with `backslash_quote = on`.
fn literal(sql: &mut String, value: &str, message: &OutboxMessage) -> Result<()> {
    if value.contains('\0') {
        return Err(Error::InvalidMessage(
            format!(
                "message {} (`{}`) contains a NUL character, which PostgreSQL text cannot store; \
                 remove it from the key, headers or type",
                message.id, message.event_type
            )
            .into(),
        ));
    }
    let tag = dollar_tag(value);
    sql.push_str(&tag);
    sql.push_str(value);
    sql.push_str(&tag);
    Ok(())
}

/// A dollar-quote tag for `value`, found in one pass: `$o$` if `value` holds no `$o`,
/// else `$o` + one more `1` than the longest run of digits after any `$o` in it + `$`.
/// Its text without the closing `$` then occurs nowhere in `value`, so the first
/// occurrence of the tag after the opening one is the closing one.
fn dollar_tag(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut longest: Option<usize> = None;
    let mut i = 0;
    while let Some(at) = value[i..].find("$o") {
        let digits = bytes[i + at + 2..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        longest = Some(longest.map_or(digits, |l| l.max(digits)));
        i += at + 2;
    }
    match longest {
        None => "$o$".to_owned(),
        Some(digits) => format!("$o{}$", "1".repeat(digits + 1)),
    }
}

/// The statement before a `COMMIT` with no events left to write. Events flushed earlier
/// in the transaction took the writer lock then, and maybe found the relay busy: the
/// commit looks again, so a relay that went idle meanwhile is woken.
fn nothing_to_write(tables: &Tables, wrote: bool) -> String {
    if wrote && tables.wal.is_none() {
        wake_sql(&tables.outbox.quoted(), "")
    } else {
        "SELECT 1".to_owned()
    }
}

async fn write_commit_and_begin(
    conn: &mut PgConnection,
    tables: &Tables,
    wal: &crate::config::Wal,
    messages: &[OutboxMessage],
) -> Result<()> {
    // In an aborted transaction the first statement fails (25P02) and nothing after it
    // runs: `COMMIT` alone would answer `ROLLBACK` without an error.
    let mut sql = if messages.is_empty() {
        "SELECT 1".to_owned()
    } else {
        wal::commit_sql(wal, messages)?
    };
    sql.push_str("; COMMIT; BEGIN");
    // No arguments: the simple protocol runs the statements in one round trip.
    conn.execute(sql.as_str()).await.context(
        "writing events to the outbox and committing",
        &tables.outbox,
    )?;
    Ok(())
}

async fn insert_messages(
    conn: &mut PgConnection,
    tables: &Tables,
    messages: &[OutboxMessage],
) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    if let Some(w) = &tables.wal {
        return wal::emit(conn, tables, w, messages).await;
    }
    if let [m] = messages {
        sqlx::query(&insert_one_sql(tables))
            .bind(m.id)
            .bind(&m.event_type)
            .bind(m.event_version)
            .bind(&m.destination)
            .bind(&m.partition_key)
            .bind(&m.payload)
            .bind(m.headers_json()?)
            .execute(conn)
            .await
            .context("writing events to the outbox", &tables.outbox)?;
        return Ok(());
    }
    let n = messages.len();
    let mut ids = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut versions = Vec::with_capacity(n);
    let mut destinations = Vec::with_capacity(n);
    let mut keys = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    for m in messages {
        ids.push(m.id);
        types.push(m.event_type.as_str());
        versions.push(m.event_version);
        destinations.push(m.destination.as_str());
        keys.push(m.partition_key.as_deref());
        payloads.push(m.payload.as_str());
        headers.push(m.headers_json()?);
    }
    sqlx::query(&insert_sql(tables))
        .bind(&ids)
        .bind(&types)
        .bind(&versions)
        .bind(&destinations)
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
        .execute(conn)
        .await
        .context("writing events to the outbox", &tables.outbox)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{dollar_tag, mask_literals};

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

    #[test]
    fn the_dollar_tag_never_occurs_in_the_value() {
        for (value, tag) in [
            ("plain", "$o$"),
            ("$$ $tag$ $", "$o$"),
            ("$o", "$o1$"),
            ("x$o$", "$o1$"),
            ("$o1", "$o11$"),
            ("$o1$ and $o22 and $o", "$o111$"),
            ("ends with $o12", "$o111$"),
        ] {
            assert_eq!(dollar_tag(value), tag, "{value:?}");
            let open = &tag[..tag.len() - 1];
            assert!(!value.contains(open), "{value:?} holds {open:?}");
            // The closing tag is first found where it was put.
            let quoted = format!("{value}{tag}");
            assert_eq!(quoted.find(tag), Some(value.len()), "{value:?}");
        }
        // One pass: a value made of many `$oN` does not take quadratic time to quote.
        let many: String = (0..20_000).map(|n| format!("$o{n}")).collect();
        assert_eq!(dollar_tag(&many), "$o111111$");
    }
}
