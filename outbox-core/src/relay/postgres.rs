//! One database session of the relay on PostgreSQL: a dedicated connection that holds
//! the relay's advisory locks and runs every claim and mark, plus a `LISTEN` connection.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{Connection, Executor, PgConnection, Postgres, Row};
use tokio::sync::watch;
use tokio::time::Instant;
use uuid::Uuid;

use super::drain::{Claims, Outcome, SqlResult, budgeted, decode_each, drain, headers};
use super::horizon::{Horizon, Sample};
use super::{OnSent, Relay, RelayStats, stopped};
use crate::config::locks;
use crate::publisher::{OutboxRecord, Publisher};

/// The statements of one relay, rendered once per session.
struct Sql {
    sample: String,
    claim: String,
    mark: String,
    fail: String,
    probe: String,
    retrying: String,
    count_relays: String,
}

impl Sql {
    fn new(outbox: &str, seq_name: &str, table_key: i32, on_sent: OnSent) -> Sql {
        let advisory = format!(
            "locktype = 'advisory' AND granted AND objsubid = 2 AND classid = ({table_key})::int4::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        );
        let (writers, relays, max_relays) = (locks::WRITERS, locks::RELAYS, locks::MAX_RELAYS);
        Sql {
            // Two statements, two snapshots, in this order: H first, then the writers.
            sample: format!(
                "SELECT (CASE WHEN is_called THEN last_value ELSE 0 END)::text FROM {seq_name}; \
                 SELECT coalesce(string_agg(virtualtransaction, ','), '') FROM pg_locks \
                 WHERE {advisory} AND objid = {writers}"
            ),
            claim: budgeted(
                &format!(
                    "SELECT o.seq, o.id, o.event_type, o.event_version, o.destination, o.partition_key, \
                            o.payload::text AS payload, o.headers::text AS headers, o.created_at, o.attempts \
                     FROM {outbox} o \
                     WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.seq <= $1 AND o.seq > $5 \
                       AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
                       AND ($3::int4[] IS NULL OR \
                            ((hashtextextended(coalesce(o.partition_key, o.id::text), 0) & 9223372036854775807) % $4)::int4 \
                              = ANY($3)) \
                       AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                            WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                              AND r.sent_at IS NULL AND r.dead_at IS NULL AND {blocker}) \
                     ORDER BY o.seq LIMIT $2",
                    blocker = crate::relay::blocker("now()", "$5"),
                ),
                "octet_length(%)",
                "$6",
            ),
            mark: match on_sent {
                OnSent::Mark => format!("UPDATE {outbox} SET sent_at = now() WHERE seq = ANY($1)"),
                OnSent::Delete => format!("DELETE FROM {outbox} WHERE seq = ANY($1)"),
            },
            fail: format!(
                "UPDATE {outbox} o SET \
                   attempts = o.attempts + 1, \
                   last_error = f.error, \
                   dead_at = CASE WHEN f.permanent OR o.attempts + 1 >= $4 THEN now() END, \
                   next_attempt_at = CASE WHEN f.permanent OR o.attempts + 1 >= $4 THEN o.next_attempt_at \
                     ELSE now() + make_interval(secs => least($6, $5 * power(2, least(o.attempts, 62))) * (0.75 + random() * 0.5)) END \
                 FROM UNNEST($1::bigint[], $2::text[], $3::bool[]) AS f(seq, error, permanent) \
                 WHERE o.seq = f.seq \
                 RETURNING o.dead_at IS NOT NULL AS dead"
            ),
            count_relays: format!(
                "SELECT count(*) FROM pg_locks WHERE {advisory} AND objid >= {relays} AND objid < {relays} + {max_relays}"
            ),
            retrying: format!(
                "SELECT DISTINCT partition_key FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL \
             AND next_attempt_at IS NOT NULL AND partition_key IS NOT NULL"
            ),
            probe: format!(
                "SELECT count(*) AS pending, \
                        count(*) FILTER (WHERE next_attempt_at IS NULL OR next_attempt_at <= now()) AS due, \
                        coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age, \
                        extract(epoch FROM min(next_attempt_at) FILTER (WHERE next_attempt_at > now()) - now())::float8 \
                          AS next_due_in, \
                        (SELECT count(*) FROM pg_locks WHERE {advisory} \
                          AND objid >= {relays} AND objid < {relays} + {max_relays}) \
                          AS relays \
                 FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL"
            ),
        }
    }
}

/// Registers this relay's partition count, or refuses to run next to relays of the same
/// outbox configured with another: they would hash keys to different partitions, and two
/// relays could then publish one key at the same time, out of order. The check and the
/// registration happen under a short exclusive lock, so two relays starting together with
/// different counts cannot both pass. A refused relay reports the error and retries like
/// after any failed session: it takes over once the others are gone (a rolling change of
/// `partitions` therefore switches over without overlap).
async fn register_partition_count<P>(
    conn: &mut PgConnection,
    table_key: i32,
    relay: &Relay<P, Postgres>,
) -> SqlResult<()> {
    let mine = i32::from(relay.config.partitions);
    sqlx::query("SELECT pg_advisory_lock($1, $2)")
        .bind(table_key)
        .bind(locks::PARTITION_COUNT_CHECK)
        .execute(&mut *conn)
        .await?;
    let others: Option<i32> = sqlx::query_scalar(
        "SELECT (objid::int8 - $2)::int4 FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = ($1)::int4::oid \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND objid::int8 > $2 AND objid::int8 <= $2 + 65535 AND objid::int8 <> $2 + $3 \
         LIMIT 1",
    )
    .bind(table_key)
    .bind(i64::from(locks::PARTITION_COUNT))
    .bind(i64::from(mine))
    .fetch_optional(&mut *conn)
    .await?;
    if others.is_none() {
        sqlx::query("SELECT pg_advisory_lock_shared($1, $2)")
            .bind(table_key)
            .bind(locks::PARTITION_COUNT + mine)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query("SELECT pg_advisory_unlock($1, $2)")
        .bind(table_key)
        .bind(locks::PARTITION_COUNT_CHECK)
        .execute(&mut *conn)
        .await?;
    match others {
        None => Ok(()),
        Some(theirs) => Err(sqlx::Error::Protocol(format!(
            "other relays of outbox {} run with {theirs} partitions, this one is configured with \
             {mine}; every relay of one outbox must use the same `partitions` (RelayBuilder::partitions). \
             This relay stands by and takes over when those relays are gone",
            relay.outbox.tables().outbox
        ))),
    }
}

/// What the safety-poll probe found.
struct Probe {
    due: i64,
    next_due_in: Option<Duration>,
    relays: i64,
}

pub(crate) struct Session<'r, P> {
    relay: &'r Relay<P, Postgres>,
    conn: PgConnection,
    listener: PgListener,
    sql: Sql,
    table_key: i32,
    slot: i32,
    owned: BTreeSet<i32>,
    relays: i64,
    horizon: Horizon,
}

impl<'r, P: Publisher> Session<'r, P> {
    /// Connects, registers, and publishes until shutdown (`Ok`) or a database error.
    pub(crate) async fn run(
        relay: &'r Relay<P, Postgres>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> SqlResult<()> {
        let mut session = Session::connect(relay).await?;
        let result = session.work(shutdown).await;
        if result.is_ok() {
            // Hand the partitions over at once instead of when the connection closes.
            let _ = session.conn.close().await;
        }
        result
    }

    async fn connect(relay: &'r Relay<P, Postgres>) -> SqlResult<Session<'r, P>> {
        let tables = relay.outbox.tables();
        let options = (*relay.outbox.pool().connect_options())
            .clone()
            .application_name(&relay.config.application_name);
        let mut conn = PgConnection::connect_with(&options).await?;
        // Notice a vanished relay host in ~25 s instead of the OS default of 2 hours, so its
        // partitions are taken over (the server drops the session and its locks).
        conn.execute("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3")
            .await?;
        let seq_name: Option<String> =
            sqlx::query_scalar("SELECT pg_get_serial_sequence($1, 'seq')")
                .bind(tables.outbox.quoted())
                .fetch_one(&mut conn)
                .await?;
        let seq_name = seq_name.ok_or_else(|| {
            sqlx::Error::Protocol(format!(
                "the outbox table {} has no `seq` identity column; run the outbox migrations",
                tables.outbox
            ))
        })?;
        // The table's oid keys every advisory lock of this outbox.
        let (table_key, channel): (i32, String) =
            sqlx::query_as("SELECT oid::int4, 'outbox_' || oid::text FROM (SELECT $1::text::regclass::oid AS oid) t")
                .bind(tables.outbox.quoted())
                .fetch_one(&mut conn)
                .await?;
        // Before taking a relay slot: a refused relay must not count as a relay.
        register_partition_count(&mut conn, table_key, relay).await?;
        let slot: Option<i32> = sqlx::query_scalar(
            "SELECT s FROM generate_series(0, $3 - 1) AS s WHERE pg_try_advisory_lock($1, $2 + s) LIMIT 1",
        )
        .bind(table_key)
        .bind(locks::RELAYS)
        .bind(locks::MAX_RELAYS)
        .fetch_optional(&mut conn)
        .await?;
        let slot = slot.ok_or_else(|| {
            sqlx::Error::Protocol(format!(
                "more than {} relays on one outbox",
                locks::MAX_RELAYS
            ))
        })?;

        // The listener reconnects by itself through this one-connection pool.
        let listen_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(options);
        let mut listener = PgListener::connect_with(&listen_pool).await?;
        listener.ignore_pool_close_event(true);
        listener.listen(&channel).await?;

        let sql = Sql::new(
            &tables.outbox.quoted(),
            &seq_name,
            table_key,
            relay.config.on_sent,
        );
        RelayStats::add(&relay.stats.queries, 5);
        tracing::info!(slot, outbox = %tables.outbox, "outbox relay connected");
        Ok(Session {
            relay,
            conn,
            listener,
            sql,
            table_key,
            slot,
            owned: BTreeSet::new(),
            relays: 1,
            horizon: Horizon::default(),
        })
    }

    fn count_queries(&self, n: u64) {
        RelayStats::add(&self.relay.stats.queries, n);
    }

    async fn work(&mut self, shutdown: &mut watch::Receiver<bool>) -> SqlResult<()> {
        let config = &self.relay.config;
        let mut next_probe = Instant::now();
        let mut next_rebalance = Instant::now();
        let mut wake_for_retry: Option<Instant> = None;
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= next_probe {
                let probe = self.probe().await?;
                next_probe = now + config.poll_interval;
                wake_for_retry = probe.next_due_in.map(|d| now + d);
                self.relays = probe.relays;
                self.rebalance().await?;
                next_rebalance = now + config.rebalance_interval;
                if probe.due == 0 {
                    self.wait(shutdown, next_probe, wake_for_retry).await?;
                    continue;
                }
            } else if now >= next_rebalance {
                self.relays = self.count_relays().await?;
                self.rebalance().await?;
                next_rebalance = now + config.rebalance_interval;
            }

            let claimed = drain(self.relay, self, shutdown).await?;
            if claimed > 0 {
                continue; // there may be more
            }
            if self.horizon.waiting() {
                // Writers were in flight: look again shortly (a rollback sends no notification).
                let soon = Instant::now() + Duration::from_millis(5);
                self.wait(shutdown, soon.min(next_probe), wake_for_retry)
                    .await?;
            } else {
                self.wait(shutdown, next_probe, wake_for_retry).await?;
            }
            if wake_for_retry.is_some_and(|t| t <= Instant::now()) {
                wake_for_retry = None;
            }
        }
    }

    /// Waits for a notification, a deadline, or shutdown. Notifications already buffered
    /// are drained: one cycle serves them all.
    async fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
        retry_at: Option<Instant>,
    ) -> SqlResult<()> {
        let until = retry_at.map_or(until, |r| r.min(until));
        tokio::select! {
            n = self.listener.try_recv() => {
                // `None`: the listening connection was lost and is being re-established;
                // notifications may have been missed, so run a cycle anyway.
                n?;
                while self.listener.next_buffered().is_some() {}
            }
            _ = tokio::time::sleep_until(until) => {}
            _ = stopped(shutdown) => {}
        }
        Ok(())
    }

    async fn probe(&mut self) -> SqlResult<Probe> {
        self.count_queries(1);
        let row = sqlx::query(&self.sql.probe)
            .fetch_one(&mut self.conn)
            .await?;
        let pending: i64 = row.try_get("pending")?;
        let oldest_age: f64 = row.try_get("oldest_age")?;
        metrics::gauge!("outbox_pending").set(pending as f64);
        metrics::gauge!("outbox_oldest_pending_age_seconds").set(oldest_age);
        let next_due_in: Option<f64> = row.try_get("next_due_in")?;
        Ok(Probe {
            due: row.try_get("due")?,
            next_due_in: next_due_in.map(|s| Duration::from_secs_f64(s.max(0.0))),
            relays: row.try_get("relays")?,
        })
    }

    async fn count_relays(&mut self) -> SqlResult<i64> {
        self.count_queries(1);
        sqlx::query_scalar(&self.sql.count_relays)
            .fetch_one(&mut self.conn)
            .await
    }

    /// Takes or gives back partitions so that every relay holds its fair share.
    async fn rebalance(&mut self) -> SqlResult<()> {
        let total = i32::from(self.relay.config.partitions);
        let relays = i32::try_from(self.relays.max(1)).unwrap_or(i32::MAX);
        let share = usize::try_from((total + relays - 1) / relays).unwrap_or(1);
        if self.owned.len() > share {
            let extra: Vec<i32> = self
                .owned
                .iter()
                .rev()
                .take(self.owned.len() - share)
                .copied()
                .collect();
            self.count_queries(1);
            sqlx::query("SELECT pg_advisory_unlock($1, $2 + p) FROM unnest($3::int4[]) AS p")
                .bind(self.table_key)
                .bind(locks::PARTITIONS)
                .bind(&extra)
                .execute(&mut self.conn)
                .await?;
            for p in &extra {
                self.owned.remove(p);
            }
            tracing::info!(released = ?extra, relays, "outbox relay gave partitions back");
        } else if self.owned.len() < share {
            // Start looking at a slot-dependent offset so relays don't all race for partition 0.
            let start = (self.slot * i32::try_from(share).unwrap_or(1)).rem_euclid(total);
            let candidates: Vec<i32> = (0..total)
                .map(|i| (start + i) % total)
                .filter(|p| !self.owned.contains(p))
                .collect();
            self.count_queries(1);
            let got: Vec<i32> = sqlx::query_scalar(
                "SELECT p FROM unnest($3::int4[]) AS p WHERE pg_try_advisory_lock($1, $2 + p) LIMIT $4",
            )
            .bind(self.table_key)
            .bind(locks::PARTITIONS)
            .bind(&candidates)
            .bind(i64::try_from(share - self.owned.len()).unwrap_or(0))
            .fetch_all(&mut self.conn)
            .await?;
            if !got.is_empty() {
                tracing::info!(acquired = ?got, relays, "outbox relay took partitions");
            }
            self.owned.extend(got);
        }
        metrics::gauge!("outbox_relay_partitions").set(self.owned.len() as f64);
        Ok(())
    }

    async fn sample(&mut self) -> SqlResult<Sample> {
        self.count_queries(2);
        // No arguments: the simple protocol runs both statements, each with its own snapshot.
        let rows = (&mut self.conn).fetch_all(self.sql.sample.as_str()).await?;
        let text = |i: usize| -> SqlResult<String> {
            rows.get(i)
                .ok_or_else(|| {
                    sqlx::Error::Protocol("horizon sample returned too few rows".to_owned())
                })?
                .try_get::<String, _>(0)
        };
        let last_seq = text(0)?
            .parse::<i64>()
            .map_err(|e| sqlx::Error::Protocol(format!("bad sequence value: {e}")))?;
        let writers = text(1)?;
        Ok(Sample {
            last_seq,
            writers: writers
                .split(',')
                .filter(|w| !w.is_empty())
                .map(str::to_owned)
                .collect(),
        })
    }

    /// Claims the next batch: samples the horizon, then the oldest claimable rows of the
    /// owned partitions (after `after`, when a batch before them is still in flight).
    async fn claim(&mut self, after: Option<i64>) -> SqlResult<Vec<OutboxRecord>> {
        let sample = self.sample().await?;
        let horizon = self.horizon.observe(sample);
        if self.owned.is_empty() {
            return Ok(Vec::new());
        }
        let config = &self.relay.config;
        let filter: Option<Vec<i32>> = (self.owned.len() < usize::from(config.partitions))
            .then(|| self.owned.iter().copied().collect());
        self.count_queries(1);
        let rows = sqlx::query(&self.sql.claim)
            .bind(horizon)
            .bind(i64::try_from(config.batch_size).unwrap_or(i64::MAX))
            .bind(filter)
            .bind(i32::from(config.partitions))
            .bind(after.unwrap_or(0))
            .bind(i64::try_from(config.max_batch_bytes).unwrap_or(i64::MAX))
            .fetch(&mut self.conn);
        decode_each(rows, record).await
    }
}

impl<P: Publisher> Claims for Session<'_, P> {
    async fn retrying_keys(&mut self) -> SqlResult<Vec<String>> {
        self.count_queries(1);
        sqlx::query_scalar(&self.sql.retrying)
            .fetch_all(&mut self.conn)
            .await
    }

    fn claim(
        &mut self,
        after: Option<i64>,
    ) -> impl std::future::Future<Output = SqlResult<Vec<OutboxRecord>>> + Send {
        Session::claim(self, after)
    }

    async fn mark(&mut self, seqs: &[i64]) -> SqlResult<()> {
        self.count_queries(1);
        sqlx::query(&self.sql.mark)
            .bind(seqs)
            .execute(&mut self.conn)
            .await?;
        Ok(())
    }

    async fn fail(&mut self, outcome: &Outcome) -> SqlResult<u64> {
        let config = &self.relay.config;
        self.count_queries(1);
        let dead: Vec<bool> = sqlx::query_scalar(&self.sql.fail)
            .bind(&outcome.failed_seq)
            .bind(&outcome.failed_error)
            .bind(&outcome.failed_permanent)
            .bind(config.max_attempts)
            .bind(config.backoff_base.as_secs_f64())
            .bind(config.backoff_cap.as_secs_f64())
            .fetch_all(&mut self.conn)
            .await?;
        Ok(dead.iter().filter(|d| **d).count() as u64)
    }
}

fn record(row: &PgRow) -> SqlResult<OutboxRecord> {
    let seq: i64 = row.try_get("seq")?;
    let headers = headers(seq, &row.try_get::<String, _>("headers")?);
    Ok(OutboxRecord {
        seq,
        id: row.try_get::<Uuid, _>("id")?,
        event_type: row.try_get("event_type")?,
        event_version: row.try_get("event_version")?,
        destination: row.try_get("destination")?,
        partition_key: row.try_get("partition_key")?,
        payload: row.try_get("payload")?,
        headers,
        created_at: row.try_get::<DateTime<Utc>, _>("created_at")?,
        attempts: row.try_get("attempts")?,
    })
}
