//! The relay on SQLite: its own connection, polling. One relay per database file: SQLite
//! has no session-scoped locks to share work or fence a second relay with, so a second
//! relay on the same file would publish the same rows twice (never out of order).

use chrono::{DateTime, Utc};
use sqlx::sqlite::SqliteRow;
use sqlx::{Connection, Executor, Row, Sqlite, SqliteConnection};
use tokio::sync::watch;
use uuid::Uuid;

use super::drain::{Claims, Outcome, SqlResult, headers, retry_plan};
use super::poll::{self, Polled};
use super::{OnSent, Relay, RelayStats};
use crate::publisher::{OutboxRecord, Publisher};

/// `now()` as stored: RFC 3339 text, UTC, milliseconds.
const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

pub(crate) async fn run<P: Publisher>(
    relay: &Relay<P, Sqlite>,
    shutdown: &mut watch::Receiver<bool>,
) -> SqlResult<()> {
    let options = (*relay.outbox.pool().connect_options()).clone();
    let conn = SqliteConnection::connect_with(&options).await?;
    let outbox = relay.outbox.tables().outbox.quoted();
    let mut session = Session {
        relay,
        conn,
        claim: format!(
            "SELECT o.seq, o.id, o.event_type, o.event_version, o.destination, o.partition_key, \
                    o.payload, o.headers, o.created_at, o.attempts \
             FROM {outbox} o \
             WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND o.seq > ?1 \
               AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= {NOW}) \
               AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                    WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                      AND r.sent_at IS NULL AND r.dead_at IS NULL AND r.next_attempt_at IS NOT NULL) \
             ORDER BY o.seq LIMIT ?2"
        ),
        mark: match relay.config.on_sent {
            OnSent::Mark => format!(
                "UPDATE {outbox} SET sent_at = {NOW} WHERE seq IN (SELECT value FROM json_each(?1))"
            ),
            OnSent::Delete => {
                format!("DELETE FROM {outbox} WHERE seq IN (SELECT value FROM json_each(?1))")
            }
        },
        fail: format!(
            "UPDATE {outbox} SET attempts = attempts + 1, last_error = ?1, \
               dead_at = CASE WHEN ?2 THEN {NOW} END, \
               next_attempt_at = CASE WHEN ?2 THEN next_attempt_at \
                 ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3) END \
             WHERE seq = ?4"
        ),
        retrying: format!(
            "SELECT DISTINCT partition_key FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL \
             AND next_attempt_at IS NOT NULL AND partition_key IS NOT NULL"
        ),
        probe: format!(
            "SELECT count(*), min(created_at) FROM {outbox} WHERE sent_at IS NULL AND dead_at IS NULL"
        ),
    };
    tracing::info!(outbox = %relay.outbox.tables().outbox, "outbox relay connected (SQLite, polling)");
    let result = poll::run(relay, &mut session, shutdown).await;
    if result.is_ok() {
        let _ = session.conn.close().await;
    }
    result
}

struct Session<'r, P> {
    relay: &'r Relay<P, Sqlite>,
    conn: SqliteConnection,
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
        self.count_queries(1);
        let list = serde_json::to_string(seqs).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        sqlx::query(&self.mark)
            .bind(list)
            .execute(&mut self.conn)
            .await?;
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
                .bind(format!("+{delay:.3} seconds"))
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
        Ok(true)
    }

    async fn probe(&mut self) -> SqlResult<(i64, Option<DateTime<Utc>>)> {
        self.count_queries(1);
        let row = (&mut self.conn).fetch_one(self.probe.as_str()).await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }
}

fn record(row: &SqliteRow) -> SqlResult<OutboxRecord> {
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
