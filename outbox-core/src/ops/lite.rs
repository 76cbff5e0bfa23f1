//! The operations on MySQL/MariaDB and SQLite: one body, stamped out for each by
//! `lite_ops!` with a dialect module giving what differs (quoting, the clock, text
//! casts, how a timestamp is bound). Every statement uses plain `?` placeholders, each
//! bound once, in order, which both databases accept.

/// Ids per `IN (?, ...)` list: well under both databases' placeholder limits.
const IDS_PER_STATEMENT: usize = 500;

/// `?, ?, ?` for `n` values.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Messages sent in `[?, ?)`, and for `destination` (one more `?`) if there is one.
fn sent_window(destination: Option<&str>) -> &'static str {
    match destination {
        Some(_) => "sent_at >= ? AND sent_at < ? AND destination = ?",
        None => "sent_at >= ? AND sent_at < ?",
    }
}

macro_rules! lite_ops {
    ($db:ty, $row:ty, $d:ident) => {
        use chrono::{DateTime, Utc};
        use futures_util::future::BoxFuture;
        use sqlx::Row;
        use uuid::Uuid;

        use super::super::{Ops, SentBatch, SqlResult, Which, count, requeue_reset, total};
        use super::{IDS_PER_STATEMENT, placeholders, sent_window};
        use crate::admin::{DestinationStatus, ListFilter, MessageInfo, MessageState, Status};
        use crate::config::Tables;

        type Conn = <$db as sqlx::Database>::Connection;
        type Pool = sqlx::Pool<$db>;

        fn columns() -> String {
            let text = [
                "id",
                "event_type",
                "destination",
                "partition_key",
                "payload",
                "headers",
                "last_error",
            ]
                .map(|column| format!("{} AS {column}", $d::text(column)))
                .join(", ");
            format!(
                "seq, {text}, event_version, created_at, sent_at, attempts, next_attempt_at, dead_at"
            )
        }

        impl Ops for $db {
            const ADMIN_BEGIN: Option<&'static str> = Some($d::ADMIN_BEGIN);

            fn record_processed<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                consumer: &'c str,
                id: Uuid,
            ) -> BoxFuture<'c, SqlResult<bool>> {
                Box::pin(async move {
                    let sql = format!(
                        "INSERT INTO {} (consumer, message_id) VALUES (?, ?)",
                        $d::quote(&tables.processed)
                    );
                    // A failed statement leaves the transaction usable on both databases;
                    // a plain INSERT (not INSERT IGNORE) never truncates a long name.
                    match sqlx::query(&sql)
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
                        $d::quote(&tables.processed)
                    );
                    let n: i64 = sqlx::query_scalar(&sql)
                        .bind(consumer)
                        .bind(id.to_string())
                        .fetch_one(pool)
                        .await?;
                    Ok(n > 0)
                })
            }

            fn clock_minus(pool: &Pool, age_secs: f64) -> BoxFuture<'_, SqlResult<DateTime<Utc>>> {
                Box::pin(async move {
                    sqlx::query_scalar($d::CLOCK_MINUS)
                        .bind($d::age(age_secs))
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
                    let t = $d::quote(&tables.outbox);
                    let mut conn = pool.acquire().await?;
                    // The batch's upper end first, then a range delete that checks the
                    // state again (a message replayed in between is kept).
                    let (found, last): (i64, Option<i64>) = sqlx::query_as(&format!(
                        "SELECT COUNT(*), MAX(seq) FROM (SELECT seq FROM {t} \
                         WHERE seq > ? AND sent_at < ? AND dead_at IS NULL ORDER BY seq LIMIT ?) d"
                    ))
                    .bind(after)
                    .bind($d::ts(cutoff))
                    .bind(limit)
                    .fetch_one(&mut *conn)
                    .await?;
                    let Some(last) = last.filter(|_| found > 0) else {
                        return Ok(SentBatch::default());
                    };
                    drop(conn);
                    let mut tx = pool.begin_with($d::ADMIN_BEGIN).await?;
                    let done = sqlx::query(&format!(
                        "DELETE FROM {t} WHERE seq > ? AND seq <= ? AND sent_at < ? AND dead_at IS NULL"
                    ))
                    .bind(after)
                    .bind(last)
                    .bind($d::ts(cutoff))
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
                    let mut tx = pool.begin_with($d::ADMIN_BEGIN).await?;
                    let done = sqlx::query(&$d::delete_processed(&$d::quote(&tables.processed)))
                        .bind($d::ts(cutoff))
                        .bind(limit)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok(done.rows_affected())
                })
            }

            fn status<'c>(pool: &'c Pool, tables: &'c Tables) -> BoxFuture<'c, SqlResult<Status>> {
                Box::pin(async move {
                    let t = $d::quote(&tables.outbox);
                    let mut conn = pool.acquire().await?;
                    let rows = sqlx::query(&format!(
                        "SELECT {destination} AS destination, \
                                COUNT(CASE WHEN dead = 0 THEN 1 END) AS pending, \
                                COUNT(CASE WHEN retrying = 1 AND dead = 0 THEN 1 END) AS in_retry, \
                                COUNT(CASE WHEN dead = 1 THEN 1 END) AS dead, \
                                MIN(CASE WHEN dead = 0 THEN created_at END) AS oldest, \
                                {now} AS now \
                         FROM (SELECT destination, created_at, \
                                 CASE WHEN attempts > 0 THEN 1 ELSE 0 END AS retrying, 0 AS dead \
                               FROM {t} WHERE sent_at IS NULL AND dead_at IS NULL \
                               UNION ALL \
                               SELECT destination, created_at, 0, 1 FROM {t} WHERE dead_at IS NOT NULL) live \
                         GROUP BY destination ORDER BY destination",
                        destination = $d::text("destination"),
                        now = $d::NOW,
                    ))
                    .fetch_all(&mut *conn)
                    .await?;
                    let mut status = Status::default();
                    for row in &rows {
                        let oldest: Option<DateTime<Utc>> = row.try_get("oldest")?;
                        let now: DateTime<Utc> = row.try_get("now")?;
                        status.destinations.push(DestinationStatus {
                            destination: row.try_get("destination")?,
                            pending: row.try_get("pending")?,
                            in_retry: row.try_get("in_retry")?,
                            dead: row.try_get("dead")?,
                            oldest_pending_age_seconds: oldest
                                .map(|o| (now - o).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6),
                        });
                    }
                    total(&mut status);
                    let (relays, rows_estimate) = $d::relays_and_rows(&mut conn, tables).await?;
                    status.relays = relays;
                    status.rows_estimate = rows_estimate;
                    Ok(status)
                })
            }

            fn list<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                which: Which,
                filter: &'c ListFilter,
            ) -> BoxFuture<'c, SqlResult<Vec<MessageInfo>>> {
                Box::pin(async move {
                    let mut sql = format!(
                        "SELECT {} FROM {} WHERE {}",
                        columns(),
                        $d::quote(&tables.outbox),
                        which.condition()
                    );
                    for (column, set) in [
                        ("destination = ?", filter.destination.is_some()),
                        ("event_type = ?", filter.event_type.is_some()),
                        ("partition_key = ?", filter.key.is_some()),
                        ("created_at >= ?", filter.since.is_some()),
                        ("created_at < ?", filter.until.is_some()),
                    ] {
                        if set {
                            sql.push_str(" AND ");
                            sql.push_str(column);
                        }
                    }
                    sql.push_str(" ORDER BY seq LIMIT ?");
                    let mut query = sqlx::query(&sql);
                    for text in [&filter.destination, &filter.event_type, &filter.key]
                        .into_iter()
                        .flatten()
                    {
                        query = query.bind(text.as_str());
                    }
                    for time in [filter.since, filter.until].into_iter().flatten() {
                        query = query.bind($d::ts(time));
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
                                    CASE WHEN attempts > 0 THEN 1 ELSE 0 END AS retrying \
                             FROM {t} WHERE id IN ({list}) ORDER BY seq{lock}",
                            id = $d::text("id"),
                            t = $d::quote(&tables.outbox),
                            list = placeholders(chunk.len()),
                            lock = $d::FOR_UPDATE,
                        );
                        let mut query = sqlx::query(&sql);
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

            fn requeue_ids<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                ids: &'c [Uuid],
                from: Which,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let mut n = 0;
                    for chunk in ids.chunks(IDS_PER_STATEMENT) {
                        let sql = format!(
                            "UPDATE {t} SET {set}, {reset} WHERE id IN ({list}) AND {state}",
                            t = $d::quote(&tables.outbox),
                            reset = requeue_reset($d::NOW),
                            set = from.requeue_set(),
                            list = placeholders(chunk.len()),
                            state = from.condition(),
                        );
                        let mut query = sqlx::query(&sql);
                        for id in chunk {
                            query = query.bind(id.to_string());
                        }
                        n += query.execute(&mut *conn).await?.rows_affected();
                    }
                    Ok(n)
                })
            }

            fn requeue_sent_between<'c>(
                conn: &'c mut Conn,
                tables: &'c Tables,
                since: DateTime<Utc>,
                until: DateTime<Utc>,
                destination: Option<&'c str>,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let sql = format!(
                        "UPDATE {} SET sent_at = NULL, {} WHERE {}",
                        $d::quote(&tables.outbox),
                        requeue_reset($d::NOW),
                        sent_window(destination),
                    );
                    let mut query = sqlx::query(&sql).bind($d::ts(since)).bind($d::ts(until));
                    if let Some(d) = destination {
                        query = query.bind(d);
                    }
                    Ok(query.execute(conn).await?.rows_affected())
                })
            }

            fn count_sent_between<'c>(
                pool: &'c Pool,
                tables: &'c Tables,
                since: DateTime<Utc>,
                until: DateTime<Utc>,
                destination: Option<&'c str>,
            ) -> BoxFuture<'c, SqlResult<u64>> {
                Box::pin(async move {
                    let sql = format!(
                        "SELECT count(*) FROM {} WHERE {}",
                        $d::quote(&tables.outbox),
                        sent_window(destination),
                    );
                    let mut query = sqlx::query_scalar::<_, i64>(&sql)
                        .bind($d::ts(since))
                        .bind($d::ts(until));
                    if let Some(d) = destination {
                        query = query.bind(d);
                    }
                    Ok(count(query.fetch_one(pool).await?))
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
                        $d::quote(&tables.outbox),
                        requeue_reset($d::NOW)
                    );
                    Ok(sqlx::query(&sql).bind(key).execute(conn).await?.rows_affected())
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
                    let t = $d::quote(&tables.outbox);
                    let sent_sql = "sent_at < ? AND dead_at IS NULL";
                    let dead_sql = "dead_at < ?";
                    let mut counts = [0_u64; 2];
                    for (i, (cutoff, condition)) in
                        [(sent_before, sent_sql), (dead_before, dead_sql)].into_iter().enumerate()
                    {
                        let Some(cutoff) = cutoff else { continue };
                        counts[i] = if dry_run {
                            let n: i64 = sqlx::query_scalar(&format!(
                                "SELECT COUNT(*) FROM {t} WHERE {condition}"
                            ))
                            .bind($d::ts(cutoff))
                            .fetch_one(&mut *conn)
                            .await?;
                            count(n)
                        } else {
                            sqlx::query(&format!("DELETE FROM {t} WHERE {condition}"))
                                .bind($d::ts(cutoff))
                                .execute(&mut *conn)
                                .await?
                                .rows_affected()
                        };
                    }
                    Ok((counts[0], counts[1]))
                })
            }
        }

        fn uuid(text: &str) -> SqlResult<Uuid> {
            Uuid::parse_str(text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
        }

        fn json(text: &str) -> SqlResult<serde_json::Value> {
            serde_json::from_str(text).map_err(|e| sqlx::Error::Decode(Box::new(e)))
        }

        fn message(row: &$row) -> SqlResult<MessageInfo> {
            let sent_at: Option<DateTime<Utc>> = row.try_get("sent_at")?;
            let dead_at: Option<DateTime<Utc>> = row.try_get("dead_at")?;
            let next_attempt_at: Option<DateTime<Utc>> = row.try_get("next_attempt_at")?;
            let attempts: i32 = row.try_get("attempts")?;
            Ok(MessageInfo {
                seq: row.try_get("seq")?,
                id: uuid(&row.try_get::<String, _>("id")?)?,
                state: MessageState::of(sent_at.is_some(), dead_at.is_some(), attempts > 0),
                event_type: row.try_get("event_type")?,
                event_version: row.try_get("event_version")?,
                destination: row.try_get("destination")?,
                partition_key: row.try_get("partition_key")?,
                created_at: row.try_get("created_at")?,
                sent_at,
                attempts,
                next_attempt_at,
                last_error: row.try_get("last_error")?,
                dead_at,
                payload: json(&row.try_get::<String, _>("payload")?)?,
                headers: json(&row.try_get::<String, _>("headers")?)?,
            })
        }
    };
}

#[cfg(feature = "mysql")]
mod mysql {
    /// What MySQL/MariaDB says differently.
    mod my {
        use chrono::{DateTime, Utc};
        use sqlx::MySqlConnection;

        use crate::config::{TableName, Tables};

        pub(super) fn quote(table: &TableName) -> String {
            table.backticked()
        }
        /// The columns' binary collation would make sqlx see bytes, not text.
        pub(super) fn text(column: &str) -> String {
            format!("CAST({column} AS CHAR)")
        }
        pub(super) const NOW: &str = "UTC_TIMESTAMP(6)";
        pub(super) const CLOCK_MINUS: &str = "SELECT UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND";
        pub(super) fn age(secs: f64) -> i64 {
            (secs * 1e6) as i64
        }
        pub(super) fn ts(t: DateTime<Utc>) -> DateTime<Utc> {
            t
        }
        pub(super) const FOR_UPDATE: &str = " FOR UPDATE";
        /// Deletes and updates take no gap locks that would hold back writers appending
        /// rows; one round trip, so the setting cannot outlive this transaction.
        pub(super) const ADMIN_BEGIN: &str =
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";
        pub(super) fn delete_processed(table: &str) -> String {
            format!("DELETE FROM {table} WHERE processed_at < ? ORDER BY processed_at LIMIT ?")
        }
        /// Whether a relay holds the outbox's named lock, and InnoDB's row estimate.
        pub(super) async fn relays_and_rows(
            conn: &mut MySqlConnection,
            tables: &Tables,
        ) -> sqlx::Result<(Option<i64>, i64)> {
            let (relays, rows): (i64, Option<i64>) = sqlx::query_as(&format!(
                "SELECT CAST(IS_USED_LOCK({lock}) IS NOT NULL AS SIGNED), \
                        (SELECT CAST(TABLE_ROWS AS SIGNED) FROM information_schema.TABLES \
                         WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?)",
                lock = crate::store::mysql::lock_name(crate::relay::mysql::RELAY_LOCK),
            ))
            .bind(tables.outbox.schema())
            .bind(tables.outbox.name())
            .bind(tables.outbox.schema())
            .bind(tables.outbox.name())
            .fetch_one(conn)
            .await?;
            Ok((Some(relays), rows.unwrap_or(-1)))
        }
    }

    lite_ops!(sqlx::MySql, sqlx::mysql::MySqlRow, my);
}

#[cfg(feature = "sqlite")]
mod sqlite {
    /// What SQLite says differently.
    mod lite {
        use chrono::{DateTime, Utc};
        use sqlx::SqliteConnection;

        use crate::config::{TableName, Tables};

        pub(super) fn quote(table: &TableName) -> String {
            table.quoted()
        }
        pub(super) fn text(column: &str) -> String {
            column.to_owned()
        }
        /// Timestamps are stored as RFC 3339 text with milliseconds, which sorts by time.
        pub(super) const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";
        pub(super) const CLOCK_MINUS: &str = "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?)";
        pub(super) fn age(secs: f64) -> String {
            format!("-{secs:.3} seconds")
        }
        pub(super) fn ts(t: DateTime<Utc>) -> String {
            t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
        }
        /// A write transaction holds the whole database already (`BEGIN IMMEDIATE`).
        pub(super) const FOR_UPDATE: &str = "";
        pub(super) const ADMIN_BEGIN: &str = "BEGIN IMMEDIATE";
        pub(super) fn delete_processed(table: &str) -> String {
            format!(
                "DELETE FROM {table} WHERE rowid IN \
                 (SELECT rowid FROM {table} WHERE processed_at < ? ORDER BY processed_at LIMIT ?)"
            )
        }
        /// SQLite relays leave no trace to count; the row estimate is the `seq` span
        /// (cheap: both ends of the primary key).
        pub(super) async fn relays_and_rows(
            conn: &mut SqliteConnection,
            tables: &Tables,
        ) -> sqlx::Result<(Option<i64>, i64)> {
            let rows: i64 = sqlx::query_scalar(&format!(
                "SELECT COALESCE(MAX(seq) - MIN(seq) + 1, 0) FROM {}",
                tables.outbox.quoted()
            ))
            .fetch_one(conn)
            .await?;
            Ok((None, rows))
        }
    }

    lite_ops!(sqlx::Sqlite, sqlx::sqlite::SqliteRow, lite);
}
