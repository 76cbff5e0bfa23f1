//! The relay on MySQL/MariaDB: its own connection, polling, and one active relay per
//! outbox at a time.
//!
//! Ownership is a named lock (`GET_LOCK`) held by the relay's connection: other relays
//! stand by and try to take it every poll. A relay that dies loses its connection and
//! with it the lock; it cannot mark anything afterwards, because claims and marks go
//! through that same connection. One publisher at a time plus writers that commit in
//! `seq` order (see `store::mysql`) keeps per-key order with any number of relays and
//! late commits; scaling out is PostgreSQL's partitioned relay's job.

use chrono::{DateTime, Utc};
use sqlx::mysql::MySqlRow;
use sqlx::{Connection, Executor, MySql, MySqlConnection, Row};
use tokio::sync::watch;
use uuid::Uuid;

use super::drain::{Claims, Outcome, SqlResult, headers, retry_plan};
use super::poll::{self, Polled};
use super::{OnSent, Relay, RelayStats};
use crate::publisher::{OutboxRecord, Publisher};

/// The prefix of the named lock the active relay holds (see `store::mysql::lock_name`).
pub(crate) const RELAY_LOCK: &str = "outbox-relay:";

/// Seqs per `IN (...)` list when marking.
const MARK_CHUNK: usize = 5000;

pub(crate) async fn run<P: Publisher>(
    relay: &Relay<P, MySql>,
    shutdown: &mut watch::Receiver<bool>,
) -> SqlResult<()> {
    let options = (*relay.outbox.pool().connect_options()).clone();
    let conn = MySqlConnection::connect_with(&options).await?;
    let outbox = relay.outbox.tables().outbox.backticked();
    let mut session = Session {
        relay,
        conn,
        owner: false,
        acquire: format!(
            "SELECT GET_LOCK({}, 0)",
            crate::store::mysql::lock_name(RELAY_LOCK)
        ),
        claim: format!(
            // CASTs: the columns' binary collation would make sqlx see bytes, not text.
            "SELECT o.seq, CAST(o.id AS CHAR) AS id, CAST(o.event_type AS CHAR) AS event_type, \
                    o.event_version, CAST(o.destination AS CHAR) AS destination, \
                    CAST(o.partition_key AS CHAR) AS partition_key, \
                    CAST(o.payload AS CHAR) AS payload, CAST(o.headers AS CHAR) AS headers, \
                    o.created_at, o.attempts \
             FROM {outbox} o \
             WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.seq > ? \
               AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= UTC_TIMESTAMP(6)) \
               AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                    WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                      AND r.sent_at IS NULL AND r.dead_at IS NULL AND r.next_attempt_at IS NOT NULL) \
             ORDER BY o.seq LIMIT ?"
        ),
        mark: match relay.config.on_sent {
            // The seqs arrive as one bound JSON array (MariaDB >= 10.6, MySQL >= 8.0).
            OnSent::Mark => format!(
                "UPDATE {outbox} SET sent_at = UTC_TIMESTAMP(6) WHERE seq IN \
                 (SELECT j.seq FROM JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS j)"
            ),
            OnSent::Delete => format!(
                "DELETE FROM {outbox} WHERE seq IN \
                 (SELECT j.seq FROM JSON_TABLE(?, '$[*]' COLUMNS (seq BIGINT PATH '$')) AS j)"
            ),
        },
        fail: format!(
            "UPDATE {outbox} SET attempts = attempts + 1, last_error = ?, \
               dead_at = IF(?, UTC_TIMESTAMP(6), NULL), \
               next_attempt_at = IF(?, next_attempt_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
             WHERE seq = ?"
        ),
        retrying: format!(
            "SELECT DISTINCT CAST(partition_key AS CHAR) FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL \
             AND next_attempt_at IS NOT NULL AND partition_key IS NOT NULL"
        ),
        probe: format!(
            "SELECT count(*), min(created_at) FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL"
        ),
    };
    tracing::info!(outbox = %relay.outbox.tables().outbox, "outbox relay connected (MySQL/MariaDB, polling)");
    let result = poll::run(relay, &mut session, shutdown).await;
    if result.is_ok() {
        // Hand the outbox over at once instead of when the connection times out.
        let _ = session.conn.close().await;
    }
    result
}

struct Session<'r, P> {
    relay: &'r Relay<P, MySql>,
    conn: MySqlConnection,
    owner: bool,
    acquire: String,
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
        let rows = sqlx::query(&self.claim)
            .bind(after.unwrap_or(0))
            .bind(limit)
            .fetch_all(&mut self.conn)
            .await?;
        rows.iter().map(record).collect()
    }

    async fn mark(&mut self, seqs: &[i64]) -> SqlResult<()> {
        for chunk in seqs.chunks(MARK_CHUNK) {
            self.count_queries(1);
            let list =
                serde_json::to_string(chunk).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
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
            sqlx::query(&self.fail)
                .bind(&outcome.failed_error[i])
                .bind(is_dead)
                .bind(is_dead)
                .bind((delay * 1e6) as i64)
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
            let table = &self.relay.outbox.tables().outbox;
            let got: Option<i64> = sqlx::query_scalar(&self.acquire)
                .bind(table.schema())
                .bind(table.name())
                .fetch_one(&mut self.conn)
                .await?;
            self.owner = got == Some(1);
        }
        Ok(self.owner)
    }

    async fn probe(&mut self) -> SqlResult<(i64, Option<DateTime<Utc>>)> {
        self.count_queries(1);
        let row = (&mut self.conn).fetch_one(self.probe.as_str()).await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
}

fn record(row: &MySqlRow) -> SqlResult<OutboxRecord> {
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
