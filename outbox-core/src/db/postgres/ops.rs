//! The stored-message SQL (inbox, retention, admin) on PostgreSQL.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use uuid::Uuid;

use super::Options;
use super::diagnostics::Health;
use super::locks;
use super::partitions::PartitionReport;
use crate::config::Tables;
use crate::db::rows::{dead_group, message, message_columns};
use crate::model::state::{FAILED, PENDING};
use crate::model::{
    Beat, Change, ConsumerStatus, DeadGroup, Failure, ListFilter, MessageInfo, MessageState,
    SentBatch, SentWindow, Status, Which, count, requeue_reset,
};
use crate::store::ops::{Behind, ConsumerRows, Ops, SqlResult};
use crate::store::trusted_sql;

impl Ops for Postgres {
    fn record_processed<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, SqlResult<bool>> {
        Box::pin(async move {
            let sql = format!(
                "INSERT INTO {} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                tables.processed.quoted()
            );
            let done = sqlx::query(trusted_sql(&sql))
                .bind(consumer)
                .bind(id)
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn is_processed<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        consumer: &'c str,
        id: Uuid,
    ) -> BoxFuture<'c, SqlResult<bool>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT EXISTS (SELECT 1 FROM {} WHERE consumer = $1 AND message_id = $2)",
                tables.processed.quoted()
            );
            sqlx::query_scalar(trusted_sql(&sql))
                .bind(consumer)
                .bind(id)
                .fetch_one(pool)
                .await
        })
    }

    fn note_failure<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        f: Failure<'c>,
    ) -> BoxFuture<'c, SqlResult<()>> {
        Box::pin(async move {
            sqlx::query(trusted_sql(format!(
                "INSERT INTO {t} AS f \
                   (consumer, message_id, event_type, partition_key, origin, attempts, last_error) \
                 VALUES ($1, $2, $3, $4, $5, 1, $6) \
                 ON CONFLICT (consumer, message_id) DO UPDATE SET attempts = f.attempts + 1, \
                   last_failed_at = now(), origin = EXCLUDED.origin, last_error = EXCLUDED.last_error",
                t = tables.processed.with_suffix("_failing").quoted()
            )))
            .bind(f.consumer)
            .bind(f.id)
            .bind(f.event_type)
            .bind(f.key)
            .bind(f.origin)
            .bind(f.error)
            .execute(pool)
            .await?;
            Ok(())
        })
    }

    fn clear_consumer_rows<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        rows: ConsumerRows<'c>,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let failing = tables.processed.with_suffix("_failing").quoted();
            let instances = tables.processed.with_suffix("_consumers").quoted();
            let done = match rows {
                ConsumerRows::Failure { consumer, id } => sqlx::query(trusted_sql(format!(
                    "DELETE FROM {failing} WHERE consumer = $1 AND message_id = $2"
                )))
                .bind(consumer)
                .bind(id)
                .execute(pool)
                .await?
                .rows_affected(),
                ConsumerRows::Instance { consumer, instance } => sqlx::query(trusted_sql(format!(
                    "DELETE FROM {instances} WHERE consumer = $1 AND instance = $2"
                )))
                .bind(consumer)
                .bind(instance)
                .execute(pool)
                .await?
                .rows_affected(),
                ConsumerRows::Before(cutoff) => {
                    let mut n = 0;
                    for sql in [
                        format!("DELETE FROM {failing} WHERE last_failed_at < $1"),
                        format!("DELETE FROM {instances} WHERE seen_at < $1"),
                    ] {
                        n += sqlx::query(trusted_sql(sql))
                            .bind(cutoff)
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

    fn beat<'c>(pool: &'c PgPool, tables: &'c Tables, b: Beat<'c>) -> BoxFuture<'c, SqlResult<()>> {
        Box::pin(async move {
            sqlx::query(trusted_sql(format!(
                "INSERT INTO {t} AS c \
                   (consumer, instance, transport, interval_ms, handled, handler_errors, lag) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (consumer, instance) DO UPDATE SET seen_at = now(), \
                   interval_ms = EXCLUDED.interval_ms, handled = EXCLUDED.handled, \
                   handler_errors = EXCLUDED.handler_errors, lag = EXCLUDED.lag",
                t = tables.processed.with_suffix("_consumers").quoted()
            )))
            .bind(b.consumer)
            .bind(b.instance)
            .bind(b.transport)
            .bind(b.interval_ms)
            .bind(b.handled)
            .bind(b.handler_errors)
            .bind(b.lag)
            .execute(pool)
            .await?;
            Ok(())
        })
    }

    fn consumers<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        since: DateTime<Utc>,
        limit: i64,
    ) -> BoxFuture<'c, SqlResult<Vec<ConsumerStatus>>> {
        Box::pin(async move {
            let processed = sqlx::query_as(trusted_sql(format!(
                "SELECT consumer, count(*), max(processed_at) FROM {} \
                 WHERE processed_at >= $1 GROUP BY consumer",
                tables.processed.quoted()
            )))
            .bind(since)
            .fetch_all(pool)
            .await?;
            let failing = sqlx::query(trusted_sql(format!(
                "SELECT {} FROM {} f WHERE NOT EXISTS \
                   (SELECT 1 FROM {} p WHERE p.consumer = f.consumer AND p.message_id = f.message_id) \
                 ORDER BY first_failed_at, consumer, message_id LIMIT $1",
                crate::db::rows::failing_columns(|c| format!("{c}::text")),
                tables.processed.with_suffix("_failing").quoted(),
                tables.processed.quoted(),
            )))
            .bind(limit)
            .fetch_all(pool)
            .await?;
            let instances = sqlx::query(trusted_sql(format!(
                "SELECT {}, now() AS now FROM {} ORDER BY consumer, started_at",
                crate::db::rows::instance_columns(|c| format!("{c}::text")),
                tables.processed.with_suffix("_consumers").quoted()
            )))
            .fetch_all(pool)
            .await?;
            crate::db::rows::consumers(processed, &instances, &failing)
        })
    }

    fn clock_minus(pool: &PgPool, age_secs: f64) -> BoxFuture<'_, SqlResult<DateTime<Utc>>> {
        Box::pin(async move {
            sqlx::query_scalar("SELECT now() - make_interval(secs => $1)")
                .bind(age_secs)
                .fetch_one(pool)
                .await
        })
    }

    fn delete_sent<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        after: i64,
        cutoff: DateTime<Utc>,
        limit: i64,
    ) -> BoxFuture<'c, SqlResult<SentBatch>> {
        Box::pin(async move {
            let t = tables.outbox.quoted();
            // A time-partitioned outbox drops its partitions whole: rows are deleted one
            // by one only outside them (partitions kept for a pending or dead row, the
            // default partition). The condition prunes the others.
            let spared = super::partitions::spared(pool, &tables.outbox, cutoff).await?;
            let outside = if spared.is_some() {
                "AND (id < $4::uuid OR id >= $5::uuid)"
            } else {
                ""
            };
            let sql = format!(
                "WITH doomed AS (\
                   SELECT seq FROM {t} \
                   WHERE seq > $1 AND sent_at < $2 AND dead_at IS NULL {outside} \
                   ORDER BY seq LIMIT $3 FOR UPDATE SKIP LOCKED), \
                 gone AS (DELETE FROM {t} o USING doomed d WHERE o.seq = d.seq RETURNING o.seq) \
                 SELECT count(*), max(seq) FROM gone"
            );
            let mut query = sqlx::query_as(trusted_sql(&sql))
                .bind(after)
                .bind(cutoff)
                .bind(limit);
            if let Some((from, to)) = spared {
                query = query.bind(from).bind(to);
            }
            let (n, last): (i64, Option<i64>) = query.fetch_one(pool).await?;
            Ok(SentBatch {
                deleted: count(n),
                found: count(n),
                last,
            })
        })
    }

    fn maintain_partitions<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        cutoff: Option<DateTime<Utc>>,
    ) -> BoxFuture<'c, SqlResult<Option<PartitionReport>>> {
        Box::pin(super::partitions::maintain(pool, tables, cutoff))
    }

    fn delete_processed<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        cutoff: DateTime<Utc>,
        limit: i64,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let p = tables.processed.quoted();
            let n: i64 = sqlx::query_scalar(trusted_sql(format!(
                "WITH doomed AS (\
                   SELECT consumer, message_id FROM {p} \
                   WHERE processed_at < $1 \
                   ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED), \
                 gone AS (DELETE FROM {p} x USING doomed d \
                   WHERE x.consumer = d.consumer AND x.message_id = d.message_id RETURNING 1) \
                 SELECT count(*) FROM gone"
            )))
            .bind(cutoff)
            .bind(limit)
            .fetch_one(pool)
            .await?;
            Ok(count(n))
        })
    }

    fn status<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        options: &'c Options,
    ) -> BoxFuture<'c, SqlResult<Status>> {
        Box::pin(async move {
            let t = tables.outbox.quoted();
            let rows = sqlx::query(trusted_sql(format!(
                "WITH live AS (\
                   SELECT destination, created_at, {FAILED} AS retrying, false AS dead \
                     FROM {t} WHERE {PENDING} \
                   UNION ALL \
                   SELECT destination, created_at, false, true FROM {t} WHERE dead_at IS NOT NULL) \
                 SELECT destination, \
                        count(*) FILTER (WHERE NOT dead) AS pending, \
                        count(*) FILTER (WHERE retrying AND NOT dead) AS in_retry, \
                        count(*) FILTER (WHERE dead) AS dead, \
                        extract(epoch FROM now() - min(created_at) FILTER (WHERE NOT dead))::float8 AS oldest \
                 FROM live GROUP BY destination ORDER BY destination"
            )))
            .fetch_all(pool)
            .await?;
            let mut status = crate::db::rows::status(&rows, |row| row.try_get("oldest"))?;
            let (relays, rows_estimate): (i64, i64) = sqlx::query_as(trusted_sql(format!(
                "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
                           AND classid = (c.oid::int4)::oid \
                           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                           AND objid >= {relays} AND objid < {relays} + {max}), \
                        c.reltuples::int8 \
                 FROM pg_class c WHERE c.oid = $1::text::regclass",
                relays = locks::RELAYS,
                max = locks::MAX_RELAYS,
            )))
            .bind(&t)
            .fetch_one(pool)
            .await?;
            status.relays = Some(relays);
            status.rows_estimate = rows_estimate;
            status.last_seq = sqlx::query_scalar(trusted_sql(format!("SELECT max(seq) FROM {t}")))
                .fetch_one(pool)
                .await?;
            status.oldest_writer = super::diagnostics::oldest_writer(pool, &t).await?;
            if let Some(wal) = &options.wal {
                let slot = super::wal::slot_status(pool, wal).await?;
                // WAL mode: the relay streaming from the slot (standbys leave no trace).
                status.relays = Some(i64::from(slot.active_pid.is_some()));
                status.slot = Some(slot);
            }
            Ok(status)
        })
    }

    fn dead_by_error<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        limit: u32,
    ) -> BoxFuture<'c, SqlResult<Vec<DeadGroup>>> {
        Box::pin(async move {
            let rows: Vec<(String, i64, i64)> = sqlx::query_as(trusted_sql(format!(
                "SELECT coalesce(last_error, '') AS error, count(*), min(seq) FROM {t} \
                 WHERE dead_at IS NOT NULL GROUP BY 1 ORDER BY 2 DESC, 3 LIMIT $1",
                t = tables.outbox.quoted()
            )))
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?;
            Ok(rows.into_iter().map(dead_group).collect())
        })
    }

    fn health<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<Option<Health>>> {
        Box::pin(super::diagnostics::health(pool, tables))
    }

    fn list<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        which: Which,
        filter: &'c ListFilter,
    ) -> BoxFuture<'c, SqlResult<Vec<MessageInfo>>> {
        Box::pin(async move {
            let rows = sqlx::query(trusted_sql(format!(
                "SELECT {columns}, {held_back} FROM {t} x WHERE {state} \
                   AND ($1::text IS NULL OR destination = $1) \
                   AND ($2::text IS NULL OR event_type = $2) \
                   AND ($3::text IS NULL OR partition_key = $3) \
                   AND ($4::timestamptz IS NULL OR created_at >= $4) \
                   AND ($5::timestamptz IS NULL OR created_at < $5){after} \
                 ORDER BY seq LIMIT $6",
                // Its own statement (and plan): an index range, not a filter.
                after = if filter.after_seq.is_some() {
                    " AND seq > $7"
                } else {
                    ""
                },
                columns = message_columns(|c| format!("{c}::text"), super::payload_bytes),
                held_back = which.held_back(&tables.outbox.quoted()),
                t = tables.outbox.quoted(),
                state = which.condition(),
            )))
            .bind(&filter.destination)
            .bind(&filter.event_type)
            .bind(&filter.key)
            .bind(filter.since)
            .bind(filter.until)
            .bind(i64::from(filter.limit))
            .bind(filter.after_seq)
            .fetch_all(pool)
            .await?;
            rows.iter().map(message).collect()
        })
    }

    fn lock_states<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        ids: &'c [Uuid],
    ) -> BoxFuture<'c, SqlResult<Vec<(Uuid, MessageState)>>> {
        Box::pin(async move {
            let rows = sqlx::query(trusted_sql(format!(
                "SELECT id, sent_at IS NOT NULL AS sent, dead_at IS NOT NULL AS dead, \
                        {FAILED} AS retrying \
                 FROM {} WHERE id = ANY($1) ORDER BY seq FOR UPDATE",
                tables.outbox.quoted()
            )))
            .bind(ids)
            .fetch_all(conn)
            .await?;
            rows.iter()
                .map(|row| {
                    Ok((
                        row.try_get("id")?,
                        MessageState::of(
                            row.try_get("sent")?,
                            row.try_get("dead")?,
                            row.try_get("retrying")?,
                        ),
                    ))
                })
                .collect()
        })
    }

    fn change_ids<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        ids: &'c [Uuid],
        from: Which,
        change: Change,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let sql = change.sql(&tables.outbox.quoted(), "= ANY($1)", from, "now()");
            let done = sqlx::query(trusted_sql(&sql))
                .bind(ids)
                .execute(conn)
                .await?;
            Ok(done.rows_affected())
        })
    }

    fn requeue_sent<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        window: SentWindow<'c>,
        dry_run: bool,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            // Messages sent in `[$1, $2)`, for destination `$3` unless it is NULL.
            let sent = "sent_at >= $1 AND sent_at < $2 AND ($3::text IS NULL OR destination = $3)";
            let t = tables.outbox.quoted();
            let sql = if dry_run {
                format!("SELECT count(*) FROM {t} WHERE {sent}")
            } else {
                let reset = requeue_reset("now()");
                format!("UPDATE {t} SET sent_at = NULL, {reset} WHERE {sent}")
            };
            let query = sqlx::query(trusted_sql(&sql))
                .bind(window.since)
                .bind(window.until)
                .bind(window.destination);
            if dry_run {
                Ok(count(query.fetch_one(conn).await?.try_get(0)?))
            } else {
                Ok(query.execute(conn).await?.rows_affected())
            }
        })
    }

    fn release_key<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        key: &'c str,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let done = sqlx::query(trusted_sql(format!(
                "UPDATE {} SET dead_at = NULL, {} WHERE dead_at IS NOT NULL AND partition_key = $1",
                tables.outbox.quoted(),
                requeue_reset("now()")
            )))
            .bind(key)
            .execute(conn)
            .await?;
            Ok(done.rows_affected())
        })
    }

    fn unpark<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        behind: Behind<'c>,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let t = tables.outbox.quoted();
            let update = format!(
                "UPDATE {t} SET next_attempt_at = now() \
                 WHERE {PENDING} AND next_attempt_at IS NULL AND partition_key IN "
            );
            let done = match behind {
                Behind::Ids(ids) => {
                    sqlx::query(trusted_sql(format!(
                        "{update}(SELECT partition_key FROM {t} WHERE id = ANY($1))"
                    )))
                    .bind(ids)
                    .execute(conn)
                    .await?
                }
                Behind::Key(key) => {
                    sqlx::query(trusted_sql(format!("{update}($1)")))
                        .bind(key)
                        .execute(conn)
                        .await?
                }
            };
            Ok(done.rows_affected())
        })
    }

    fn purge<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        sent_before: Option<DateTime<Utc>>,
        dead_before: Option<DateTime<Utc>>,
        dry_run: bool,
    ) -> BoxFuture<'c, SqlResult<(u64, u64)>> {
        Box::pin(async move {
            let t = tables.outbox.quoted();
            let sql = if dry_run {
                format!(
                    "SELECT count(*) FILTER (WHERE sent_at < $1 AND dead_at IS NULL), \
                            count(*) FILTER (WHERE dead_at < $2) \
                     FROM {t} WHERE (sent_at < $1 AND dead_at IS NULL) OR dead_at < $2"
                )
            } else {
                format!(
                    "WITH gone AS (DELETE FROM {t} \
                       WHERE (sent_at < $1 AND dead_at IS NULL) OR dead_at < $2 \
                       RETURNING dead_at IS NOT NULL AS dead) \
                     SELECT count(*) FILTER (WHERE NOT dead), count(*) FILTER (WHERE dead) FROM gone"
                )
            };
            let (sent, dead): (i64, i64) = sqlx::query_as(trusted_sql(&sql))
                .bind(sent_before)
                .bind(dead_before)
                .fetch_one(conn)
                .await?;
            Ok((count(sent), count(dead)))
        })
    }

    fn wake_relays<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<()>> {
        Box::pin(async move {
            sqlx::query("SELECT pg_notify('outbox_' || $1::text::regclass::oid::text, '')")
                .bind(tables.outbox.quoted())
                .execute(conn)
                .await?;
            Ok(())
        })
    }
}
