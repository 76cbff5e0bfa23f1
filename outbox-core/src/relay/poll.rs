//! The session loop of relays that poll (MySQL/MariaDB and SQLite have no `LISTEN`):
//! become the active relay, drain, and look again every `poll_interval`.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tokio::time::Instant;

use super::drain::{Claims, SqlResult, drain};
use super::{Relay, stopped};
use crate::publisher::Publisher;
use crate::store::Backend;

/// How often the pending-rows gauges are refreshed.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// A polling relay's database session.
pub(crate) trait Polled: Claims {
    /// Whether this session may publish now (it is, or just became, the one active relay).
    fn acquire(&mut self) -> impl Future<Output = SqlResult<bool>> + Send;

    /// Pending rows and the oldest one's creation time.
    fn probe(&mut self) -> impl Future<Output = SqlResult<(i64, Option<DateTime<Utc>>)>> + Send;
}

/// Runs `session` until shutdown (`Ok`) or a database error.
pub(crate) async fn run<P: Publisher, DB: Backend, S: Polled>(
    relay: &Relay<P, DB>,
    session: &mut S,
    shutdown: &mut watch::Receiver<bool>,
) -> SqlResult<()> {
    let poll = relay.config.poll_interval;
    let mut next_probe = Instant::now();
    let mut standby_logged = false;
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        if !session.acquire().await? {
            if !standby_logged {
                tracing::info!("another outbox relay is active; standing by");
                standby_logged = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(poll.max(Duration::from_millis(500))) => {}
                _ = stopped(shutdown) => {}
            }
            continue;
        }
        if standby_logged {
            tracing::info!("outbox relay is now the active one");
            standby_logged = false;
        }
        if Instant::now() >= next_probe {
            let (pending, oldest) = session.probe().await?;
            metrics::gauge!("outbox_pending").set(pending as f64);
            let age = oldest.map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            });
            metrics::gauge!("outbox_oldest_pending_age_seconds").set(age);
            next_probe = Instant::now() + PROBE_INTERVAL;
        }
        let claimed = drain(relay, session, shutdown).await?;
        if claimed > 0 {
            continue; // there may be more
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = stopped(shutdown) => {}
        }
    }
}

/// The session of a polling relay, stamped out for MySQL/MariaDB and SQLite from one
/// body: `lite_session!(Database, Connection, Row, dialect)`, where `dialect` is a module
/// with what differs — the statements (`claim`, `mark`, `fail`, `retrying`, `probe`, `NAME`),
/// how a failure's plan is bound (`bind_plan`) and how a session becomes the active relay
/// (`acquire`).
macro_rules! lite_session {
    ($db:ty, $conn:ty, $row:ty, $d:ident) => {
        use chrono::{DateTime, Utc};
        use sqlx::{Connection, Executor, Row};
        use tokio::sync::watch;
        use uuid::Uuid;

        use super::drain::{Claims, Outcome, SqlResult, headers, retry_plan, decode_each};
        use super::poll::{self, Polled};
        use super::{Relay, RelayStats};
        use crate::publisher::{OutboxRecord, Publisher};

        /// Seqs per marking statement.
        const MARK_CHUNK: usize = 5000;

        pub(crate) async fn run<P: Publisher>(
            relay: &Relay<P, $db>,
            shutdown: &mut watch::Receiver<bool>,
        ) -> SqlResult<()> {
            let options = (*relay.outbox.pool().connect_options()).clone();
            let conn = <$conn>::connect_with(&options).await?;
            let table = &relay.outbox.tables().outbox;
            let outbox = $d::quote(table);
            let mut session = Session {
                relay,
                conn,
                owner: false,
                claim: $d::claim(&outbox),
                mark: $d::mark(&outbox, relay.config.on_sent),
                fail: $d::fail(&outbox),
                retrying: $d::retrying(&outbox),
                probe: format!(
                    "SELECT count(*), min(created_at) FROM {outbox} \
                     WHERE sent_at IS NULL AND dead_at IS NULL"
                ),
            };
            tracing::info!(outbox = %table, engine = $d::NAME, "outbox relay connected (polling)");
            let result = poll::run(relay, &mut session, shutdown).await;
            if result.is_ok() {
                // Hand the outbox over at once instead of when the connection times out.
                let _ = session.conn.close().await;
            }
            result
        }

        struct Session<'r, P> {
            relay: &'r Relay<P, $db>,
            conn: $conn,
            owner: bool,
            claim: String,
            mark: String,
            fail: String,
            probe: String,
            retrying: String,
        }

        impl<P> Session<'_, P> {
            fn count_queries(&self, n: u64) {
                RelayStats::add(&self.relay.stats.queries, n);
            }
        }

        impl<P: Publisher> Claims for Session<'_, P> {
            async fn retrying_keys(&mut self) -> SqlResult<Vec<String>> {
                self.count_queries(1);
                sqlx::query_scalar(&self.retrying)
                    .fetch_all(&mut self.conn)
                    .await
            }

            async fn claim(&mut self, after: Option<i64>) -> SqlResult<Vec<OutboxRecord>> {
                self.count_queries(1);
                let limit = i64::try_from(self.relay.config.batch_size).unwrap_or(i64::MAX);
                let budget = i64::try_from(self.relay.config.max_batch_bytes).unwrap_or(i64::MAX);
                let rows = sqlx::query(&self.claim)
                    .bind(after.unwrap_or(0))
                    .bind(after.unwrap_or(0))
                    .bind(limit)
                    .bind(budget)
                    .fetch(&mut self.conn);
                decode_each(rows, record).await
            }

            async fn mark(&mut self, seqs: &[i64]) -> SqlResult<()> {
                // The seqs go as one bound JSON array per statement.
                for chunk in seqs.chunks(MARK_CHUNK) {
                    self.count_queries(1);
                    let list = serde_json::to_string(chunk)
                        .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
                    sqlx::query(&self.mark)
                        .bind(list)
                        .execute(&mut self.conn)
                        .await?;
                }
                Ok(())
            }

            async fn fail(&mut self, outcome: &Outcome) -> SqlResult<u64> {
                let mut dead = 0;
                self.count_queries(outcome.failed_seq.len() as u64 + 2);
                let mut tx = self.conn.begin().await?;
                for (i, seq) in outcome.failed_seq.iter().enumerate() {
                    let (is_dead, delay) = retry_plan(self.relay, outcome, i);
                    dead += u64::from(is_dead);
                    let query = sqlx::query(&self.fail).bind(&outcome.failed_error[i]);
                    $d::bind_plan(query, is_dead, delay)
                        .bind(seq)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(dead)
            }
        }

        impl<P: Publisher> Polled for Session<'_, P> {
            async fn acquire(&mut self) -> SqlResult<bool> {
                if !self.owner {
                    self.count_queries(1);
                    self.owner =
                        $d::acquire(&mut self.conn, &self.relay.outbox.tables().outbox).await?;
                }
                Ok(self.owner)
            }

            async fn probe(&mut self) -> SqlResult<(i64, Option<DateTime<Utc>>)> {
                self.count_queries(1);
                let row = (&mut self.conn).fetch_one(self.probe.as_str()).await?;
                Ok((row.try_get(0)?, row.try_get(1)?))
            }
        }

        fn record(row: &$row) -> SqlResult<OutboxRecord> {
            let seq: i64 = row.try_get("seq")?;
            let id: String = row.try_get("id")?;
            let headers = headers(seq, &row.try_get::<String, _>("headers")?);
            Ok(OutboxRecord {
                seq,
                id: Uuid::parse_str(&id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
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
    };
}
