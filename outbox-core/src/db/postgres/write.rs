//! The write path: the prepared flush statement (one row, or `UNNEST` of many) that takes
//! the writers' advisory lock before its rows draw `seq`, the wake-up that notifies only
//! while a relay waits idle, the UTF-8 guard, and WAL mode's one-round-trip commit with
//! literals (its statement is `wal::commit`'s).

use futures_util::future::BoxFuture;
use sqlx::{Executor, PgConnection, Postgres};

use super::{Options, locks, wal};
use crate::config::Tables;
use crate::error::DbContext;
use crate::store::Write;
use crate::store::trusted_sql;
use crate::{OutboxMessage, Result};

impl Write for Postgres {
    fn insert_messages<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        options: &'c Options,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(insert_messages(conn, tables, options, messages))
    }

    /// `SELECT 1` (or the wake-up, when events were flushed earlier) fails in an aborted
    /// transaction (25P02). Prepared once per connection: as a simple query it was parsed
    /// and planned at every commit without events (14 µs of planning for 3 of execution).
    fn check_open<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        options: &'c Options,
        wrote: bool,
    ) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            sqlx::query(trusted_sql(nothing_to_write(tables, options, wrote)))
                .execute(&mut *conn)
                .await
                .context("checking the transaction", &tables.outbox)?;
            Ok(())
        })
    }

    /// WAL mode only: its events and the `COMMIT` travel in one round trip. In table mode
    /// the events go through the prepared `INSERT` with bound parameters ([`insert_sql`])
    /// and `COMMIT` follows: parsing and planning the rows as literals at every commit
    /// cost more than the round trip saved ([`docs/benchmarks.md`](https://github.com/outbox-rs/outbox/blob/main/docs/benchmarks.md), scenario `notify`).
    fn write_commit_and_begin<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        options: &'c Options,
        messages: &'c [OutboxMessage],
    ) -> BoxFuture<'c, Result<bool>> {
        Box::pin(async move {
            let Some(w) = &options.wal else {
                return Ok(false);
            };
            write_commit_and_begin(conn, tables, w, messages).await?;
            Ok(true)
        })
    }
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
                m.body, m.content_type, m.headers::jsonb \
         FROM x, UNNEST($1::uuid[], $2::text[], $3::int4[], $4::text[], $5::text[], $6::bytea[], $7::text[], $8::text[]) \
              WITH ORDINALITY AS m(id, event_type, event_version, destination, partition_key, body, content_type, headers, ord) \
         ORDER BY m.ord",
    )
}

/// [`insert_sql`] for one event, with scalar parameters: no arrays to encode and decode,
/// no row source to order (most commits write one event).
fn insert_one_sql(tables: &Tables) -> String {
    write_statement(
        tables,
        "SELECT $1::uuid, $2::text, $3::int4, $4::text, $5::text, $6::bytea, $7::text, $8::text::jsonb FROM x",
    )
}

/// The writer lock and the UTF-8 guard (`x`, materialized first), the `INSERT` of the
/// rows `select` gives (reading `x`), and the wake-up.
fn write_statement(tables: &Tables, select: &str) -> String {
    format!(
        "WITH x AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(to_regclass('{outbox}')::oid::int4, {writers}) AS locked, {utf8} AS utf8), \
         ins AS (\
           INSERT INTO {outbox} \
             (id, event_type, event_version, destination, partition_key, body, content_type, headers) \
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
pub(super) const UTF8_GUARD: &str = "CASE WHEN pg_client_encoding() = 'UTF8' THEN 0 ELSE \
     ('the outbox needs client_encoding UTF8 but this connection uses ' || pg_client_encoding() || \
      '; nothing was written: do not change client_encoding on pooled connections')::int END";

/// A dollar-quote tag for `value`, found in one pass: `$o$` if `value` holds no `$o`,
/// else `$o` + one more `1` than the longest run of digits after any `$o` in it + `$`.
/// Its text without the closing `$` then occurs nowhere in `value`, so the first
/// occurrence of the tag after the opening one is the closing one.
pub(super) fn dollar_tag(value: &str) -> String {
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
fn nothing_to_write(tables: &Tables, options: &Options, wrote: bool) -> String {
    if wrote && options.wal.is_none() {
        wake_sql(&tables.outbox.quoted(), "")
    } else {
        "SELECT 1".to_owned()
    }
}

async fn write_commit_and_begin(
    conn: &mut PgConnection,
    tables: &Tables,
    wal: &super::Wal,
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
    conn.execute(trusted_sql(sql)).await.context(
        "writing events to the outbox and committing",
        &tables.outbox,
    )?;
    Ok(())
}

async fn insert_messages(
    conn: &mut PgConnection,
    tables: &Tables,
    options: &Options,
    messages: &[OutboxMessage],
) -> Result<()> {
    if messages.is_empty() {
        return Ok(());
    }
    if let Some(w) = &options.wal {
        return wal::emit(conn, tables, w, messages).await;
    }
    if let [m] = messages {
        sqlx::query(trusted_sql(insert_one_sql(tables)))
            .bind(m.id)
            .bind(&m.event_type)
            .bind(m.event_version)
            .bind(&m.destination)
            .bind(&m.partition_key)
            .bind(m.payload.as_bytes())
            .bind(&*m.content_type)
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
    let mut content_types = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    for m in messages {
        ids.push(m.id);
        types.push(m.event_type.as_str());
        versions.push(m.event_version);
        destinations.push(m.destination.as_str());
        keys.push(m.partition_key.as_deref());
        payloads.push(m.payload.as_bytes());
        content_types.push(&*m.content_type);
        headers.push(m.headers_json()?);
    }
    sqlx::query(trusted_sql(insert_sql(tables)))
        .bind(&ids)
        .bind(&types)
        .bind(&versions)
        .bind(&destinations)
        .bind(&keys)
        .bind(&payloads)
        .bind(&content_types)
        .bind(&headers)
        .execute(conn)
        .await
        .context("writing events to the outbox", &tables.outbox)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::dollar_tag;

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
