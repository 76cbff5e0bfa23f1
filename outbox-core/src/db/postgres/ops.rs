//! The stored-message SQL (inbox, retention, admin) on PostgreSQL.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use uuid::Uuid;

use super::locks;
use crate::config::Tables;
use crate::db::rows::{message, message_columns};
use crate::model::state::{FAILED, PENDING};
use crate::model::{
    DeadGroup, DestinationStatus, Health, ListFilter, MessageInfo, MessageState, PartitionReport,
    RelayInstance, ReplicationSlot, SentBatch, Status, Which, count, requeue_reset, total,
};
use crate::store::ops::{Behind, Ops, SqlResult};

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
            let done = sqlx::query(&sql)
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
            sqlx::query_scalar(&sql)
                .bind(consumer)
                .bind(id)
                .fetch_one(pool)
                .await
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
            let mut query = sqlx::query_as(&sql).bind(after).bind(cutoff).bind(limit);
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
            let n: i64 = sqlx::query_scalar(&format!(
                "WITH doomed AS (\
                   SELECT consumer, message_id FROM {p} \
                   WHERE processed_at < $1 \
                   ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED), \
                 gone AS (DELETE FROM {p} x USING doomed d \
                   WHERE x.consumer = d.consumer AND x.message_id = d.message_id RETURNING 1) \
                 SELECT count(*) FROM gone"
            ))
            .bind(cutoff)
            .bind(limit)
            .fetch_one(pool)
            .await?;
            Ok(count(n))
        })
    }

    fn status<'c>(pool: &'c PgPool, tables: &'c Tables) -> BoxFuture<'c, SqlResult<Status>> {
        Box::pin(async move {
            let t = tables.outbox.quoted();
            let rows = sqlx::query(&format!(
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
            ))
            .fetch_all(pool)
            .await?;
            let mut status = Status::default();
            for row in &rows {
                status.destinations.push(DestinationStatus {
                    destination: row.try_get("destination")?,
                    pending: row.try_get("pending")?,
                    in_retry: row.try_get("in_retry")?,
                    dead: row.try_get("dead")?,
                    oldest_pending_age_seconds: row.try_get("oldest")?,
                });
            }
            total(&mut status);
            let (relays, rows_estimate): (i64, i64) = sqlx::query_as(&format!(
                "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
                           AND classid = (c.oid::int4)::oid \
                           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                           AND objid >= {relays} AND objid < {relays} + {max}), \
                        c.reltuples::int8 \
                 FROM pg_class c WHERE c.oid = $1::text::regclass",
                relays = locks::RELAYS,
                max = locks::MAX_RELAYS,
            ))
            .bind(&t)
            .fetch_one(pool)
            .await?;
            status.relays = Some(relays);
            status.rows_estimate = rows_estimate;
            status.last_seq = sqlx::query_scalar(&format!("SELECT max(seq) FROM {t}"))
                .fetch_one(pool)
                .await?;
            status.oldest_writer = super::oldest_writer(pool, &t).await?;
            if let Some(wal) = &tables.wal {
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
            let rows: Vec<(String, i64, i64)> = sqlx::query_as(&format!(
                "SELECT coalesce(last_error, '') AS error, count(*), min(seq) FROM {t} \
                 WHERE dead_at IS NOT NULL GROUP BY 1 ORDER BY 2 DESC, 3 LIMIT $1",
                t = tables.outbox.quoted()
            ))
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?;
            Ok(rows
                .into_iter()
                .map(|(error, count, first_seq)| DeadGroup {
                    error,
                    count,
                    first_seq,
                })
                .collect())
        })
    }

    fn health<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
    ) -> BoxFuture<'c, SqlResult<Option<Health>>> {
        Box::pin(async move {
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
            let rows = sqlx::query(&format!(
                "{locks_cte} \
                 SELECT r.pid, coalesce(a.application_name, '') AS name, host(a.client_addr) AS client, \
                        coalesce(extract(epoch FROM now() - a.backend_start), 0)::float8 AS connected, \
                        coalesce((SELECT array_agg(p ORDER BY p) FROM parts WHERE parts.pid = r.pid), '{{}}') AS partitions \
                 FROM relays r LEFT JOIN pg_stat_activity a ON a.pid = r.pid ORDER BY r.pid"
            ))
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
            health.partition_counts = sqlx::query_scalar(&format!(
                "{locks_cte} SELECT DISTINCT (objid - {counts})::int4 FROM l \
                 WHERE objid > {counts} AND objid <= {counts} + 65535 ORDER BY 1",
                counts = locks::PARTITION_COUNT,
            ))
            .bind(&t)
            .fetch_all(&mut *conn)
            .await?;
            health.partitions_held_by_others = sqlx::query_scalar(&format!(
                "{locks_cte} SELECT p FROM parts WHERE pid NOT IN (SELECT pid FROM relays) ORDER BY p"
            ))
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
        })
    }

    fn list<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        which: Which,
        filter: &'c ListFilter,
    ) -> BoxFuture<'c, SqlResult<Vec<MessageInfo>>> {
        Box::pin(async move {
            let rows = sqlx::query(&format!(
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
                columns = message_columns(|c| format!("{c}::text")),
                held_back = which.held_back(&tables.outbox.quoted()),
                t = tables.outbox.quoted(),
                state = which.condition(),
            ))
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
            let rows = sqlx::query(&format!(
                "SELECT id, sent_at IS NOT NULL AS sent, dead_at IS NOT NULL AS dead, \
                        {FAILED} AS retrying \
                 FROM {} WHERE id = ANY($1) ORDER BY seq FOR UPDATE",
                tables.outbox.quoted()
            ))
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

    fn delete_ids<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        ids: &'c [Uuid],
        from: Which,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let done = sqlx::query(&format!(
                "DELETE FROM {} WHERE id = ANY($1) AND {}",
                tables.outbox.quoted(),
                from.condition(),
            ))
            .bind(ids)
            .execute(conn)
            .await?;
            Ok(done.rows_affected())
        })
    }

    fn requeue_ids<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        ids: &'c [Uuid],
        from: Which,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let done = sqlx::query(&format!(
                "UPDATE {t} SET {set}, {reset} WHERE id = ANY($1) AND {state}",
                t = tables.outbox.quoted(),
                reset = requeue_reset("now()"),
                set = from.requeue_set(),
                state = from.condition(),
            ))
            .bind(ids)
            .execute(conn)
            .await?;
            Ok(done.rows_affected())
        })
    }

    fn requeue_sent_between<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let done = sqlx::query(&format!(
                "UPDATE {} SET sent_at = NULL, {} WHERE {SENT_WINDOW}",
                tables.outbox.quoted(),
                requeue_reset("now()")
            ))
            .bind(since)
            .bind(until)
            .bind(destination)
            .execute(conn)
            .await?;
            Ok(done.rows_affected())
        })
    }

    fn count_sent_between<'c>(
        pool: &'c PgPool,
        tables: &'c Tables,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        destination: Option<&'c str>,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let n: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {} WHERE {SENT_WINDOW}",
                tables.outbox.quoted()
            ))
            .bind(since)
            .bind(until)
            .bind(destination)
            .fetch_one(pool)
            .await?;
            Ok(count(n))
        })
    }

    fn release_key<'c>(
        conn: &'c mut PgConnection,
        tables: &'c Tables,
        key: &'c str,
    ) -> BoxFuture<'c, SqlResult<u64>> {
        Box::pin(async move {
            let done = sqlx::query(&format!(
                "UPDATE {} SET dead_at = NULL, {} WHERE dead_at IS NOT NULL AND partition_key = $1",
                tables.outbox.quoted(),
                requeue_reset("now()")
            ))
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
                    sqlx::query(&format!(
                        "{update}(SELECT partition_key FROM {t} WHERE id = ANY($1))"
                    ))
                    .bind(ids)
                    .execute(conn)
                    .await?
                }
                Behind::Key(key) => {
                    sqlx::query(&format!("{update}($1)"))
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
            let (sent, dead): (i64, i64) = sqlx::query_as(&sql)
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

/// Messages sent in `[$1, $2)`, for destination `$3` unless it is NULL.
const SENT_WINDOW: &str =
    "sent_at >= $1 AND sent_at < $2 AND ($3::text IS NULL OR destination = $3)";
