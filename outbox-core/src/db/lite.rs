//! What MySQL/MariaDB and SQLite share. Each has one dialect, `impl Lite for <db>` in its
//! folder (quoting, the clock, text casts, how a timestamp or a retry delay is bound, how
//! a relay becomes the active one); the statements are rendered from it here, once, for
//! the relay session and the stored-message operations alike.
//!
//! The code that binds and runs those statements is the same text for both databases,
//! stamped out by [`lite_backend!`]: written generically, each function would restate
//! sqlx's bounds for every bound and decoded type and for the executor.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::query::Query;

use crate::config::{OnDeadLetter, OnSent, RelayConfig, TableName, Tables};
use crate::db::rows::{budgeted, claim_columns};
use crate::model::state::{self, PENDING};

/// What MySQL/MariaDB and SQLite say differently. Every statement uses `?` placeholders
/// bound in order (SQLite's claim numbers them, to bind `after` twice by position).
pub(crate) trait Lite: sqlx::Database {
    /// A table name quoted.
    fn quote(table: &TableName) -> String;
    /// A column read as text (MySQL: the binary collation would make sqlx see bytes).
    fn text(column: &str) -> String;
    /// The payload's bytes of the row `prefix` names (`"o."`, or `""`).
    fn payload(prefix: &str) -> String;
    /// The current time as stored.
    const NOW: &'static str;
    /// `SELECT` the clock minus a bound age ([`age`](Self::age)).
    const CLOCK_MINUS: &'static str;
    /// Row locks for a read in a write transaction (SQLite's hold the database already).
    const FOR_UPDATE: &'static str;
    /// How admin and retention write transactions begin.
    const ADMIN_BEGIN: &'static str;
    /// The claim's placeholders: after, after, limit, byte budget.
    const CLAIM_PARAMS: [&'static str; 4];
    /// The byte length of text `%`.
    const LENGTH: &'static str;
    /// A bound timestamp.
    type Ts;
    /// `t` as bound.
    fn ts(t: DateTime<Utc>) -> Self::Ts;
    /// A bound age for [`CLOCK_MINUS`](Self::CLOCK_MINUS).
    type Age;
    /// `secs` as bound.
    fn age(secs: f64) -> Self::Age;
    /// The failure statement: binds the error, then [`bind_plan`](Self::bind_plan)'s
    /// values, then what to add to `attempts` (0 or 1), then the seq.
    fn fail(outbox: &str) -> String;
    /// Binds whether the row dies and the delay before its next attempt (seconds).
    fn bind_plan<'q>(
        query: Query<'q, Self, <Self as sqlx::Database>::Arguments>,
        dead: bool,
        delay: f64,
    ) -> Query<'q, Self, <Self as sqlx::Database>::Arguments>;
    /// Deletes up to `?` processed ids older than `?`, oldest first.
    fn delete_processed(table: &str) -> String;
    /// Sets up the relay's connection. MySQL: the server ends the session once it is idle
    /// for `timeout` (`wait_timeout`, which releases the relay's named lock), and the
    /// session reads committed (see the MySQL dialect). SQLite: nothing.
    fn prepare_session(
        conn: &mut Self::Connection,
        timeout: std::time::Duration,
    ) -> BoxFuture<'_, sqlx::Result<()>>;
    /// Makes this connection the active relay if it is free; `true` if it is.
    fn acquire<'c>(
        conn: &'c mut Self::Connection,
        table: &'c TableName,
    ) -> BoxFuture<'c, sqlx::Result<bool>>;
    /// Whether a relay is connected (`None`: the database cannot tell), and the row
    /// estimate.
    fn relays_and_rows<'c>(
        conn: &'c mut Self::Connection,
        tables: &'c Tables,
    ) -> BoxFuture<'c, sqlx::Result<(Option<i64>, i64)>>;
}

/// A relay session's statements, rendered once per session.
pub(crate) struct Statements {
    pub(crate) claim: String,
    /// The marking statement up to its `IN (` list: see [`mark_list`].
    pub(crate) mark: String,
    pub(crate) fail: String,
    pub(crate) retrying: String,
    pub(crate) probe: String,
}

impl Statements {
    pub(crate) fn new<D: Lite>(table: &TableName, config: &RelayConfig) -> Statements {
        let on_sent = config.on_sent;
        let outbox = D::quote(table);
        let parked = state::parked(&outbox, config.on_dead_letter == OnDeadLetter::ParkKey);
        let [after, after_again, limit, budget] = D::CLAIM_PARAMS;
        Statements {
            claim: budgeted(
                &format!(
                    "SELECT {columns} FROM {outbox} o \
                     WHERE {pending_o} AND o.seq > {after} \
                       AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= {now}) \
                       AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                            WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                              AND {pending_r} AND {blocker}){parked} \
                     ORDER BY o.seq LIMIT {limit}",
                    columns = claim_columns(D::text, D::payload),
                    pending_o = state::pending("o"),
                    pending_r = state::pending("r"),
                    now = D::NOW,
                    blocker = state::blocker(D::NOW, after_again),
                ),
                D::LENGTH,
                budget,
            ),
            // A bound list, not a sub-select: MariaDB runs `UPDATE .. WHERE seq IN
            // (SELECT ..)` as a scan of the whole table, locking every row.
            mark: match on_sent {
                OnSent::Mark => format!(
                    "UPDATE {outbox} SET sent_at = {now} WHERE seq IN (",
                    now = D::NOW
                ),
                OnSent::Delete => format!("DELETE FROM {outbox} WHERE seq IN ("),
            },
            fail: D::fail(&outbox),
            retrying: state::retrying(&D::text("partition_key"), &outbox),
            probe: format!("SELECT count(*), min(created_at) FROM {outbox} WHERE {PENDING}"),
        }
    }
}

pub(crate) use super::retry::retry_plan;

/// Ids per `IN (?, ...)` list: well under both databases' placeholder limits.
pub(crate) const IDS_PER_STATEMENT: usize = 500;

/// Seqs per marking statement: under SQLite's 32,766 and MySQL's 65,535 placeholders.
pub(crate) const MARK_CHUNK: usize = 4096;

/// The `?, ?, ..)` list closing a marking statement for `n` seqs (1 ≤ n ≤
/// [`MARK_CHUNK`]), rounded up to a power of two (at least 8) so a connection prepares
/// a dozen statements at most; the caller binds its last seq again to fill the list.
pub(crate) fn mark_list(n: usize) -> (usize, String) {
    let slots = n.next_power_of_two().max(8);
    (slots, format!("{})", placeholders(slots)))
}

/// `?, ?, ?` for `n` values.
pub(crate) fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Messages sent in `[?, ?)`, and for `destination` (one more `?`) if there is one.
pub(crate) fn sent_window(destination: Option<&str>) -> &'static str {
    match destination {
        Some(_) => "sent_at >= ? AND sent_at < ? AND destination = ?",
        None => "sent_at >= ? AND sent_at < ?",
    }
}

/// Implements the stored-message operations ([`Ops`](crate::store::ops::Ops)) and the
/// relay session ([`Source`](crate::store::session::Source)) for `$db` from its [`Lite`]
/// dialect.
macro_rules! lite_backend {
    ($db:ty) => {
        use chrono::{DateTime, Utc};
        use futures_util::future::BoxFuture;
        use sqlx::Row;
        use uuid::Uuid;


        use $crate::config::Tables;
        use $crate::db::lite::{IDS_PER_STATEMENT, Lite, placeholders, sent_window};
        use $crate::db::rows::{dead_group, message, message_columns, uuid};
        use $crate::model::{
            Change, ConsumerStatus, Failure, ListFilter, MessageInfo, MessageState, SentBatch, SentWindow, Status, Which,
            count, requeue_reset,
        };
        use $crate::store::ops::{Behind, Ops, SqlResult};

        type Conn = <$db as sqlx::Database>::Connection;
        type Pool = sqlx::Pool<$db>;

        impl Ops for $db {
            const ADMIN_BEGIN: Option<&'static str> = Some(<$db as Lite>::ADMIN_BEGIN);

            fn record_processed<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                consumer: &'c str,
                id: Uuid,
            ) -> BoxFuture<'c, SqlResult<bool>> {
                Box::pin(async move {
                    let sql = format!(
                        "INSERT INTO {} (consumer, message_id) VALUES (?, ?)",
                        <$db as Lite>::quote(&tables.processed)
                    );
                    // A failed statement leaves the transaction usable on both databases;
                    // a plain INSERT (not INSERT IGNORE) never truncates a long name.
                    match sqlx::query(crate::store::trusted_sql(&sql))
                        .bind(consumer)
                        .bind(id.to_string())
                        .execute(conn)
                        .await
                    {
                        Ok(_) => Ok(true),
                        Err(e)
                            if e
                                .as_database_error()
                                .is_some_and(|d| d.is_unique_violation()) =>
                        {
                            Ok(false)
                        }
                        Err(e) => Err(e),
                    }
                })
            }

            fn is_processed<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                consumer: &'c str,
                id: Uuid,
            ) -> BoxFuture<'c, SqlResult<bool>> {
                Box::pin(async move {
                    let sql = format!(
                        "SELECT COUNT(*) FROM {} WHERE consumer = ? AND message_id = ?",
                        <$db as Lite>::quote(&tables.processed)
                    );
                    let n: i64 = sqlx::query_scalar(crate::store::trusted_sql(&sql))
                        .bind(consumer)
                        .bind(id.to_string())
                        .fetch_one(pool)
                        .await?;
                    Ok(n > 0)
                })
            }

            fn note_failure<'c>(pool: &'c Pool, tables: &'c Tables, f: Failure<'c>) -> BoxFuture<'c, SqlResult<()>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.processed.with_suffix("_failing"));
                    let id = f.id.to_string();
                    // An update, else an insert: the same two statements on both
                    // databases. Two instances inserting the first failure at once: the
                    // loser's row would say the same, and its error is dropped.
                    let updated = sqlx::query(crate::store::trusted_sql(format!(
                        "UPDATE {t} SET attempts = attempts + 1, last_failed_at = {now}, origin = ?, last_error = ? \
                         WHERE consumer = ? AND message_id = ?",
                        now = <$db as Lite>::NOW
                    )))
                    .bind(f.origin)
                    .bind(f.error)
                    .bind(f.consumer)
                    .bind(&id)
                    .execute(pool)
                    .await?
                    .rows_affected();
                    if updated > 0 {
                        return Ok(());
                    }
                    let inserted = sqlx::query(crate::store::trusted_sql(format!(
                        "INSERT INTO {t} (consumer, message_id, event_type, partition_key, origin, attempts, last_error, \
                           first_failed_at, last_failed_at) \
                         VALUES (?, ?, ?, ?, ?, 1, ?, {now}, {now})",
                        now = <$db as Lite>::NOW
                    )))
                    .bind(f.consumer)
                    .bind(&id)
                    .bind(f.event_type)
                    .bind(f.key)
                    .bind(f.origin)
                    .bind(f.error)
                    .execute(pool)
                    .await;
                    match inserted {
                        Err(e) if e.as_database_error().is_some_and(|d| d.is_unique_violation()) => Ok(()),
                        other => other.map(drop),
                    }
                })
            }

            fn clear_consumer_rows<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                rows: $crate::store::ops::ConsumerRows<'c>,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                use $crate::store::ops::ConsumerRows;
                Box::pin(async move {
                    let failing = <$db as Lite>::quote(&tables.processed.with_suffix("_failing"));
                    let instances = <$db as Lite>::quote(&tables.processed.with_suffix("_consumers"));
                    let done = match rows {
                        ConsumerRows::Failure { consumer, id } => {
                            sqlx::query(crate::store::trusted_sql(format!(
                                "DELETE FROM {failing} WHERE consumer = ? AND message_id = ?"
                            )))
                            .bind(consumer)
                            .bind(id.to_string())
                            .execute(pool)
                            .await?
                            .rows_affected()
                        }
                        ConsumerRows::Instance { consumer, instance } => {
                            sqlx::query(crate::store::trusted_sql(format!(
                                "DELETE FROM {instances} WHERE consumer = ? AND instance = ?"
                            )))
                            .bind(consumer)
                            .bind(instance.to_string())
                            .execute(pool)
                            .await?
                            .rows_affected()
                        }
                        ConsumerRows::Before(cutoff) => {
                            let mut n = 0;
                            for sql in [
                                format!("DELETE FROM {failing} WHERE last_failed_at < ?"),
                                format!("DELETE FROM {instances} WHERE seen_at < ?"),
                            ] {
                                n += sqlx::query(crate::store::trusted_sql(sql))
                                    .bind(<$db as Lite>::ts(cutoff))
                                    .execute(pool)
                                    .await?
                                    .rows_affected();
                            }
                            n
                        }
                    };
                    Ok(done)
                })
            }

            fn beat<'c>(pool: &'c Pool, tables: &'c Tables, b: $crate::model::Beat<'c>) -> BoxFuture<'c, SqlResult<()>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.processed.with_suffix("_consumers"));
                    let instance = b.instance.to_string();
                    let updated = sqlx::query(crate::store::trusted_sql(format!(
                        "UPDATE {t} SET seen_at = {now}, interval_ms = ?, handled = ?, handler_errors = ?, lag = ? \
                         WHERE consumer = ? AND instance = ?",
                        now = <$db as Lite>::NOW
                    )))
                    .bind(b.interval_ms)
                    .bind(b.handled)
                    .bind(b.handler_errors)
                    .bind(b.lag)
                    .bind(b.consumer)
                    .bind(&instance)
                    .execute(pool)
                    .await?
                    .rows_affected();
                    if updated == 0 {
                        sqlx::query(crate::store::trusted_sql(format!(
                            "INSERT INTO {t} (consumer, instance, transport, interval_ms, handled, handler_errors, lag, \
                               started_at, seen_at) \
                             VALUES (?, ?, ?, ?, ?, ?, ?, {now}, {now})",
                            now = <$db as Lite>::NOW
                        )))
                        .bind(b.consumer)
                        .bind(&instance)
                        .bind(b.transport)
                        .bind(b.interval_ms)
                        .bind(b.handled)
                        .bind(b.handler_errors)
                        .bind(b.lag)
                        .execute(pool)
                        .await?;
                    }
                    Ok(())
                })
            }

            fn consumers<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                since: DateTime<Utc>,
                limit: i64,
            ) -> BoxFuture<'c, SqlResult<Vec<ConsumerStatus>>> {
                Box::pin(async move {
                    let processed = sqlx::query_as(crate::store::trusted_sql(format!(
                        "SELECT consumer, COUNT(*), MAX(processed_at) FROM {} \
                         WHERE processed_at >= ? GROUP BY consumer",
                        <$db as Lite>::quote(&tables.processed)
                    )))
                    .bind(<$db as Lite>::ts(since))
                    .fetch_all(pool)
                    .await?;
                    let failing = sqlx::query(crate::store::trusted_sql(format!(
                        "SELECT {} FROM {} f WHERE NOT EXISTS \
                           (SELECT 1 FROM {} p WHERE p.consumer = f.consumer AND p.message_id = f.message_id) \
                         ORDER BY first_failed_at, consumer, message_id LIMIT ?",
                        $crate::db::rows::failing_columns(<$db as Lite>::text),
                        <$db as Lite>::quote(&tables.processed.with_suffix("_failing")),
                        <$db as Lite>::quote(&tables.processed),
                    )))
                    .bind(limit)
                    .fetch_all(pool)
                    .await?;
                    let instances = sqlx::query(crate::store::trusted_sql(format!(
                        "SELECT {}, {} AS now FROM {} ORDER BY consumer, started_at",
                        $crate::db::rows::instance_columns(<$db as Lite>::text),
                        <$db as Lite>::NOW,
                        <$db as Lite>::quote(&tables.processed.with_suffix("_consumers"))
                    )))
                    .fetch_all(pool)
                    .await?;
                    $crate::db::rows::consumers(processed, &instances, &failing)
                })
            }

            fn clock_minus(pool: &Pool, age_secs: f64) -> BoxFuture<'_, SqlResult<DateTime<Utc>>> {
                Box::pin(async move {
                    sqlx::query_scalar(crate::store::trusted_sql(<$db as Lite>::CLOCK_MINUS))
                        .bind(<$db as Lite>::age(age_secs))
                        .fetch_one(pool)
                        .await
                })
            }

            fn delete_sent<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                after: i64,
                cutoff: DateTime<Utc>,
                limit: i64,
            ) -> BoxFuture<'c, SqlResult<SentBatch>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    let mut conn = pool.acquire().await?;
                    // The batch's upper end first, then a range delete that checks the
                    // state again (a message replayed in between is kept).
                    let (found, last): (i64, Option<i64>) = sqlx::query_as(crate::store::trusted_sql(format!(
                        "SELECT COUNT(*), MAX(seq) FROM (SELECT seq FROM {t} \
                         WHERE seq > ? AND sent_at < ? AND dead_at IS NULL ORDER BY seq LIMIT ?) d"
                    )))
                    .bind(after)
                    .bind(<$db as Lite>::ts(cutoff))
                    .bind(limit)
                    .fetch_one(&mut *conn)
                    .await?;
                    let Some(last) = last.filter(|_| found > 0) else {
                        return Ok(SentBatch::default());
                    };
                    drop(conn);
                    let mut tx = pool.begin_with(<$db as Lite>::ADMIN_BEGIN).await?;
                    let done = sqlx::query(crate::store::trusted_sql(format!(
                        "DELETE FROM {t} WHERE seq > ? AND seq <= ? AND sent_at < ? AND dead_at IS NULL"
                    )))
                    .bind(after)
                    .bind(last)
                    .bind(<$db as Lite>::ts(cutoff))
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                    Ok(SentBatch {
                        deleted: done.rows_affected(),
                        found: count(found),
                        last: Some(last),
                    })
                })
            }

            fn delete_processed<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                cutoff: DateTime<Utc>,
                limit: i64,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let mut tx = pool.begin_with(<$db as Lite>::ADMIN_BEGIN).await?;
                    let done = sqlx::query(crate::store::trusted_sql(&<$db as Lite>::delete_processed(&<$db as Lite>::quote(&tables.processed))))
                        .bind(<$db as Lite>::ts(cutoff))
                        .bind(limit)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(done.rows_affected())
                })
            }

            fn status<'c>(pool: &'c Pool, tables: &'c Tables, _options: &'c ()) -> BoxFuture<'c, SqlResult<Status>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    let mut conn = pool.acquire().await?;
                    let rows = sqlx::query(crate::store::trusted_sql(format!(
                        "SELECT {destination} AS destination, \
                                COUNT(CASE WHEN dead = 0 THEN 1 END) AS pending, \
                                COUNT(CASE WHEN retrying = 1 AND dead = 0 THEN 1 END) AS in_retry, \
                                COUNT(CASE WHEN dead = 1 THEN 1 END) AS dead, \
                                MIN(CASE WHEN dead = 0 THEN created_at END) AS oldest, \
                                {now} AS now \
                         FROM (SELECT destination, created_at, \
                                 CASE WHEN {failed} THEN 1 ELSE 0 END AS retrying, 0 AS dead \
                               FROM {t} WHERE {pending} \
                               UNION ALL \
                               SELECT destination, created_at, 0, 1 FROM {t} WHERE dead_at IS NOT NULL) live \
                         GROUP BY destination ORDER BY destination",
                        destination = <$db as Lite>::text("destination"),
                        now = <$db as Lite>::NOW,
                        pending = $crate::model::state::PENDING,
                        failed = $crate::model::state::FAILED,
                    )))
                    .fetch_all(&mut *conn)
                    .await?;
                    let mut status = $crate::db::rows::status(&rows, |row| {
                        let oldest: Option<DateTime<Utc>> = row.try_get("oldest")?;
                        let now: DateTime<Utc> = row.try_get("now")?;
                        Ok(oldest.map(|o| (now - o).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6))
                    })?;
                    let (relays, rows_estimate) = <$db as Lite>::relays_and_rows(&mut conn, tables).await?;
                    status.relays = relays;
                    status.rows_estimate = rows_estimate;
                    let last: (Option<i64>,) = sqlx::query_as(crate::store::trusted_sql(format!("SELECT MAX(seq) FROM {t}")))
                        .fetch_one(&mut *conn)
                        .await?;
                    status.last_seq = last.0;
                    Ok(status)
                })
            }

            fn dead_by_error<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                limit: u32,
            ) -> BoxFuture<'c, SqlResult<Vec<$crate::model::DeadGroup>>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    let rows: Vec<(String, i64, i64)> = sqlx::query_as(crate::store::trusted_sql(format!(
                        "SELECT COALESCE(last_error, '') AS error, COUNT(*) AS n, MIN(seq) AS first_seq FROM {t} \
                         WHERE dead_at IS NOT NULL GROUP BY COALESCE(last_error, '') ORDER BY n DESC, first_seq LIMIT ?"
                    )))
                    .bind(i64::from(limit))
                    .fetch_all(pool)
                    .await?;
                    Ok(rows.into_iter().map(dead_group).collect())
                })
            }

            fn list<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                which: Which,
                filter: &'c ListFilter,
            ) -> BoxFuture<'c, SqlResult<Vec<MessageInfo>>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    let mut sql = format!(
                        "SELECT {}, {} FROM {t} x WHERE {}",
                        message_columns(<$db as Lite>::text, <$db as Lite>::payload),
                        which.held_back(&t),
                        which.condition()
                    );
                    for (column, set) in [
                        ("destination = ?", filter.destination.is_some()),
                        ("event_type = ?", filter.event_type.is_some()),
                        ("partition_key = ?", filter.key.is_some()),
                        ("created_at >= ?", filter.since.is_some()),
                        ("created_at < ?", filter.until.is_some()),
                        ("seq > ?", filter.after_seq.is_some()),
                    ] {
                        if set {
                            sql.push_str(" AND ");
                            sql.push_str(column);
                        }
                    }
                    sql.push_str(" ORDER BY seq LIMIT ?");
                    let mut query = sqlx::query(crate::store::trusted_sql(&sql));
                    for text in [&filter.destination, &filter.event_type, &filter.key]
                        .into_iter()
                        .flatten()
                    {
                        query = query.bind(text.as_str());
                    }
                    for time in [filter.since, filter.until].into_iter().flatten() {
                        query = query.bind(<$db as Lite>::ts(time));
                    }
                    if let Some(after) = filter.after_seq {
                        query = query.bind(after);
                    }
                    let rows = query.bind(i64::from(filter.limit)).fetch_all(pool).await?;
                    rows.iter().map(message).collect()
                })
            }

            fn lock_states<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                ids: &'c [Uuid],
            ) -> BoxFuture<'c, SqlResult<Vec<(Uuid, MessageState)>>> {
                Box::pin(async move {
                    let mut states = Vec::with_capacity(ids.len());
                    for chunk in ids.chunks(IDS_PER_STATEMENT) {
                        let sql = format!(
                            "SELECT {id} AS id, \
                                    CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END AS sent, \
                                    CASE WHEN dead_at IS NULL THEN 0 ELSE 1 END AS dead, \
                                    CASE WHEN {failed} THEN 1 ELSE 0 END AS retrying \
                             FROM {t} WHERE id IN ({list}) ORDER BY seq{lock}",
                            id = <$db as Lite>::text("id"),
                            t = <$db as Lite>::quote(&tables.outbox),
                            list = placeholders(chunk.len()),
                            lock = <$db as Lite>::FOR_UPDATE,
                            failed = $crate::model::state::FAILED,
                        );
                        let mut query = sqlx::query(crate::store::trusted_sql(&sql));
                        for id in chunk {
                            query = query.bind(id.to_string());
                        }
                        for row in query.fetch_all(&mut *conn).await? {
                            let flag = |name: &str| row.try_get::<i64, _>(name).map(|v| v != 0);
                            states.push((
                                uuid(&row.try_get::<String, _>("id")?)?,
                                MessageState::of(flag("sent")?, flag("dead")?, flag("retrying")?),
                            ));
                        }
                    }
                    Ok(states)
                })
            }

            fn change_ids<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                ids: &'c [Uuid],
                from: Which,
                change: Change,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                let t = <$db as Lite>::quote(&tables.outbox);
                Box::pin(by_id_chunks(conn, ids, move |list| {
                    change.sql(&t, &format!("IN ({list})"), from, <$db as Lite>::NOW)
                }))
            }

            fn requeue_sent<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                window: SentWindow<'c>,
                dry_run: bool,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    let sent = sent_window(window.destination);
                    let sql = if dry_run {
                        format!("SELECT COUNT(*) FROM {t} WHERE {sent}")
                    } else {
                        let reset = requeue_reset(<$db as Lite>::NOW);
                        format!("UPDATE {t} SET sent_at = NULL, {reset} WHERE {sent}")
                    };
                    let mut query = sqlx::query(crate::store::trusted_sql(&sql))
                        .bind(<$db as Lite>::ts(window.since))
                        .bind(<$db as Lite>::ts(window.until));
                    if let Some(d) = window.destination {
                        query = query.bind(d);
                    }
                    if dry_run {
                        Ok(count(query.fetch_one(conn).await?.try_get(0)?))
                    } else {
                        Ok(query.execute(conn).await?.rows_affected())
                    }
                })
            }

            fn release_key<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                key: &'c str,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let sql = format!(
                        "UPDATE {} SET dead_at = NULL, {} WHERE dead_at IS NOT NULL AND partition_key = ?",
                        <$db as Lite>::quote(&tables.outbox),
                        requeue_reset(<$db as Lite>::NOW)
                    );
                    Ok(sqlx::query(crate::store::trusted_sql(&sql)).bind(key).execute(conn).await?.rows_affected())
                })
            }

            fn unpark<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                behind: Behind<'c>,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    // One statement per key, through the `(partition_key, seq)` index: it
                    // locks that key's rows only (MariaDB runs `partition_key IN
                    // (SELECT ..)` as a scan of the whole table).
                    let keys: Vec<String> = match behind {
                        Behind::Key(key) => vec![key.to_owned()],
                        Behind::Ids(ids) => {
                            let mut keys = Vec::new();
                            for chunk in ids.chunks(IDS_PER_STATEMENT) {
                                let sql = format!(
                                    "SELECT DISTINCT partition_key FROM {t} \
                                     WHERE partition_key IS NOT NULL AND id IN ({})",
                                    placeholders(chunk.len())
                                );
                                let mut query = sqlx::query(crate::store::trusted_sql(&sql));
                                for id in chunk {
                                    query = query.bind(id.to_string());
                                }
                                for row in query.fetch_all(&mut *conn).await? {
                                    // MySQL reports the column as binary: the text is the
                                    // key the writer bound.
                                    keys.push(row.try_get_unchecked::<String, _>(0)?);
                                }
                            }
                            keys.sort_unstable();
                            keys.dedup();
                            keys
                        }
                    };
                    let sql = format!(
                        "UPDATE {t} SET next_attempt_at = {now} \
                         WHERE {pending} AND next_attempt_at IS NULL AND partition_key = ?",
                        now = <$db as Lite>::NOW,
                        pending = $crate::model::state::PENDING,
                    );
                    let mut n = 0;
                    for key in &keys {
                        n += sqlx::query(crate::store::trusted_sql(&sql)).bind(key).execute(&mut *conn).await?.rows_affected();
                    }
                    Ok(n)
                })
            }

            fn purge<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                sent_before: Option<DateTime<Utc>>,
                dead_before: Option<DateTime<Utc>>,
                dry_run: bool,
            ) -> BoxFuture<'c, SqlResult<(u64, u64)>> {
                Box::pin(async move {
                    let t = <$db as Lite>::quote(&tables.outbox);
                    let sent_sql = "sent_at < ? AND dead_at IS NULL";
                    let dead_sql = "dead_at < ?";
                    let mut counts = [0_u64; 2];
                    for (i, (cutoff, condition)) in
                        [(sent_before, sent_sql), (dead_before, dead_sql)].into_iter().enumerate()
                    {
                        let Some(cutoff) = cutoff else { continue };
                        counts[i] = if dry_run {
                            let n: i64 = sqlx::query_scalar(crate::store::trusted_sql(format!(
                                "SELECT COUNT(*) FROM {t} WHERE {condition}"
                            )))
                            .bind(<$db as Lite>::ts(cutoff))
                            .fetch_one(&mut *conn)
                            .await?;
                            count(n)
                        } else {
                            sqlx::query(crate::store::trusted_sql(format!("DELETE FROM {t} WHERE {condition}")))
                                .bind(<$db as Lite>::ts(cutoff))
                                .execute(&mut *conn)
                                .await?
                                .rows_affected()
                        };
                    }
                    Ok((counts[0], counts[1]))
                })
            }
        }


        /// Runs `sql(list of ? placeholders)` for the ids, at most `IDS_PER_STATEMENT` per
        /// statement, binding them in order; returns the rows affected.
        async fn by_id_chunks(
            conn: &mut Conn,
            ids: &[Uuid],
            sql: impl Fn(&str) -> String,
        ) -> SqlResult<u64> {
            let mut n = 0;
            for chunk in ids.chunks(IDS_PER_STATEMENT) {
                let sql = sql(&placeholders(chunk.len()));
                let mut query = sqlx::query(crate::store::trusted_sql(&sql));
                for id in chunk {
                    query = query.bind(id.to_string());
                }
                n += query.execute(&mut *conn).await?.rows_affected();
            }
            Ok(n)
        }

        /// Writes `chunks` of messages, one multi-row `INSERT` each, in order (rows draw
        /// `seq` in emit order).
        pub(crate) async fn insert_chunks<'m>(
            conn: &mut Conn,
            tables: &Tables,
            chunks: impl IntoIterator<Item = &'m [$crate::OutboxMessage]>,
        ) -> $crate::Result<()> {
            use $crate::error::DbContext as _;
            let outbox = <$db as Lite>::quote(&tables.outbox);
            for chunk in chunks {
                let sql = $crate::db::lite::insert_sql(&outbox, chunk.len());
                let mut query = sqlx::query(crate::store::trusted_sql(&sql));
                for m in chunk {
                    query = query
                        .bind(m.id.to_string())
                        .bind(m.event_type.as_str())
                        .bind(m.event_version)
                        .bind(m.destination.as_str())
                        .bind(m.partition_key.as_deref())
                        .bind(m.payload.as_bytes())
                        .bind(&*m.content_type)
                        .bind(m.headers_json()?);
                }
                query
                    .execute(&mut *conn)
                    .await
                    .context("writing events to the outbox", &tables.outbox)?;
            }
            Ok(())
        }

        /// The relay session: its own connection, polling; ownership per the dialect's
        /// `acquire`.
        pub struct LiteSession<'a> {
            cx: $crate::store::session::Context<'a, $db>,
            conn: <$db as sqlx::Database>::Connection,
            owner: bool,
            sql: $crate::db::lite::Statements,
        }

        impl std::fmt::Debug for LiteSession<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct("LiteSession")
                    .field("outbox", &self.cx.tables.outbox)
                    .field("owner", &self.owner)
                    .finish_non_exhaustive()
            }
        }

        impl $crate::store::session::Source for $db {
            const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

            type Session<'a> = LiteSession<'a>;

            async fn open<'a>(
                cx: $crate::store::session::Context<'a, Self>,
            ) -> $crate::store::session::SessionResult<LiteSession<'a>> {
                use sqlx::Connection as _;
                let options = (*cx.pool.connect_options()).clone();
                let mut conn = <<$db as sqlx::Database>::Connection>::connect_with(&options).await?;
                // A relay process that stops answering keeps its connection (and its
                // lock) open: the server ends an idle session after this long.
                cx.count_queries(1);
                <$db as Lite>::prepare_session(&mut conn, cx.config.effective_session_timeout()).await?;
                let sql = $crate::db::lite::Statements::new::<$db>(&cx.tables.outbox, cx.config);
                tracing::info!(
                    outbox = %cx.tables.outbox,
                    engine = <$db as sqlx::Database>::NAME,
                    "outbox relay connected (polling)"
                );
                Ok(LiteSession { cx, conn, owner: false, sql })
            }
        }

        impl $crate::store::session::Session for LiteSession<'_> {
            /// Pending rows and the oldest one's age, every 5 s, by the active relay only.
            async fn probe(
                &mut self,
            ) -> $crate::store::session::SessionResult<Option<$crate::store::session::Probe>> {
                use sqlx::{Executor as _, Row as _};
                if !self.owner {
                    return Ok(None);
                }
                self.cx.count_queries(1);
                let row = (&mut self.conn).fetch_one(crate::store::trusted_sql(self.sql.probe.as_str())).await?;
                let pending: i64 = row.try_get(0)?;
                let oldest: Option<DateTime<Utc>> = row.try_get(1)?;
                Ok(Some($crate::store::session::Probe {
                    pending,
                    oldest_age_seconds: oldest.map_or(0.0, |t| {
                        (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
                    }),
                    due: None,
                    next_due_in: None,
                }))
            }

            fn probe_interval(&self) -> std::time::Duration {
                std::time::Duration::from_secs(5)
            }

            async fn own(&mut self) -> $crate::store::session::SessionResult<bool> {
                if !self.owner {
                    self.cx.count_queries(1);
                    self.owner = <$db as Lite>::acquire(&mut self.conn, &self.cx.tables.outbox).await?;
                }
                Ok(self.owner)
            }

            /// Nothing tells a polling relay about new rows: it looks again after
            /// `poll_interval` (or sooner, `until`).
            async fn wait(
                &mut self,
                shutdown: &mut tokio::sync::watch::Receiver<bool>,
                until: tokio::time::Instant,
            ) -> $crate::store::session::SessionResult<()> {
                let until = until.min(tokio::time::Instant::now() + self.cx.config.poll_interval);
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => {}
                    _ = $crate::task::stopped(shutdown) => {}
                }
                Ok(())
            }

            async fn retrying_keys(&mut self) -> $crate::store::session::SessionResult<Vec<String>> {
                self.cx.count_queries(1);
                Ok(sqlx::query_scalar(crate::store::trusted_sql(&self.sql.retrying))
                    .fetch_all(&mut self.conn)
                    .await?)
            }

            async fn claim(
                &mut self,
                after: Option<i64>,
            ) -> $crate::store::session::SessionResult<Vec<$crate::publisher::OutboxRecord>> {
                self.cx.count_queries(1);
                let config = self.cx.config;
                let limit = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
                let budget = i64::try_from(config.max_batch_bytes).unwrap_or(i64::MAX);
                let rows = sqlx::query(crate::store::trusted_sql(&self.sql.claim))
                    .bind(after.unwrap_or(0))
                    .bind(after.unwrap_or(0))
                    .bind(limit)
                    .bind(budget)
                    .fetch(&mut self.conn);
                Ok($crate::db::rows::decode_each(rows, $crate::db::rows::record).await?)
            }

            async fn acknowledge(
                &mut self,
                outcome: &$crate::store::session::Outcome,
            ) -> $crate::store::session::SessionResult<()> {
                // The seqs as a bound list: a lookup by primary key.
                for chunk in outcome.sent.chunks($crate::db::lite::MARK_CHUNK) {
                    self.cx.count_queries(1);
                    let (slots, list) = $crate::db::lite::mark_list(chunk.len());
                    let sql = format!("{}{list}", self.sql.mark);
                    let mut query = sqlx::query(crate::store::trusted_sql(&sql));
                    let last = chunk[chunk.len() - 1];
                    for seq in chunk.iter().copied().chain(std::iter::repeat(last)).take(slots) {
                        query = query.bind(seq);
                    }
                    query.execute(&mut self.conn).await?;
                }
                Ok(())
            }

            async fn fail(
                &mut self,
                outcome: &$crate::store::session::Outcome,
            ) -> $crate::store::session::SessionResult<u64> {
                use sqlx::Connection as _;
                let mut dead = 0;
                self.cx.count_queries(outcome.failed.len() as u64 + 2);
                let mut tx = self.conn.begin().await?;
                for failure in &outcome.failed {
                    // A failure of the broker keeps `attempts` and never dead-letters.
                    let unavailable = failure.unavailable;
                    let (is_dead, delay) = if unavailable {
                        (false, outcome.unavailable_delay.as_secs_f64())
                    } else {
                        $crate::db::lite::retry_plan(
                            self.cx.config,
                            failure.attempts,
                            failure.permanent,
                        )
                    };
                    dead += u64::from(is_dead);
                    let query = sqlx::query(crate::store::trusted_sql(&self.sql.fail)).bind(&failure.error);
                    <$db as Lite>::bind_plan(query, is_dead, delay)
                        .bind(i32::from(!unavailable))
                        .bind(failure.seq)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(dead)
            }

            async fn close(self) {
                use sqlx::Connection as _;
                // Hands the outbox over at once instead of when the connection times out.
                let _ = self.conn.close().await;
            }
        }
    };
}
pub(crate) use lite_backend;

/// `INSERT INTO t (...) VALUES (?, ...), (?, ...)`: rows draw `seq` in emit order.
pub(crate) fn insert_sql(outbox: &str, rows: usize) -> String {
    let mut sql = format!(
        "INSERT INTO {outbox} (id, event_type, event_version, destination, partition_key, body, content_type, headers) VALUES "
    );
    for i in 0..rows {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str("(?, ?, ?, ?, ?, ?, ?, ?)");
    }
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_plan_backs_off_and_dead_letters_on_the_last_attempt() {
        let config = RelayConfig {
            max_attempts: 3,
            backoff_base: std::time::Duration::from_secs(1),
            backoff_cap: std::time::Duration::from_secs(3),
            ..RelayConfig::default()
        };
        let (dead, delay) = retry_plan(&config, 0, false);
        assert!(!dead);
        assert!((0.75..=1.25).contains(&delay), "{delay}");
        let (_, delay) = retry_plan(&config, 1, false);
        assert!((1.5..=2.5).contains(&delay), "{delay}");
        let (_, delay) = retry_plan(&config, 40, false);
        assert!(delay <= 3.0 * 1.25, "capped: {delay}");
        assert!(
            retry_plan(&config, 2, false).0,
            "the third failure is the last"
        );
        assert!(retry_plan(&config, 0, true).0, "permanent: at once");
    }
}
