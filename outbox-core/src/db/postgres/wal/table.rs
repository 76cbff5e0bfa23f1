//! What WAL mode writes into the outbox table: dead letters, messages parked behind
//! them, keys set aside while they wait for a retry, and the rows it reads back, every
//! write fenced on the relay still holding the slot.

use super::*;

use crate::store::trusted_sql;

/// Writes `record` into the outbox table `t` (quoted): dead with `error`, or pending
/// (parked behind its key's dead letter, or set aside while it waits for a retry at
/// `retry_at`), with its attempts. Idempotent by id: after a restart the unconfirmed
/// part of the stream comes again.
pub(super) async fn insert_row(
    conn: &mut PgConnection,
    t: &str,
    record: &OutboxRecord,
    error: Option<&str>,
    retry_at: Option<DateTime<Utc>>,
) -> sqlx::Result<()> {
    let headers =
        serde_json::to_string(&record.headers).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query(trusted_sql(format!(
        "INSERT INTO {t} (id, event_type, event_version, destination, partition_key, body, \
                          content_type, headers, created_at, attempts, last_error, dead_at, \
                          next_attempt_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, $11, \
                 CASE WHEN $11 IS NULL THEN NULL ELSE now() END, $12) \
         ON CONFLICT (id) DO NOTHING"
    )))
    .bind(record.id)
    .bind(&record.event_type)
    .bind(record.event_version)
    .bind(&record.destination)
    .bind(&record.partition_key)
    .bind(record.payload.as_bytes())
    .bind(&*record.content_type)
    .bind(headers)
    .bind(record.created_at)
    .bind(record.attempts)
    .bind(error)
    .bind(retry_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Writes `records` into the outbox table in one statement per chunk, in their order
/// (messages parked behind a dead letter, or set aside while they wait for a retry at
/// their `retry_at`), with their attempts. Idempotent by id, like [`insert_row`].
pub(super) async fn insert_rows(
    conn: &mut PgConnection,
    t: &str,
    records: &[(&OutboxRecord, Option<DateTime<Utc>>)],
) -> sqlx::Result<u64> {
    // Bounded statements: a chunk's arrays are sent as one message.
    const ROWS: usize = 1000;
    const BYTES: usize = 8 * 1024 * 1024;
    let sql = format!(
        "INSERT INTO {t} (id, event_type, event_version, destination, partition_key, body, \
                          content_type, headers, created_at, attempts, next_attempt_at) \
         SELECT m.id, m.event_type, m.event_version, m.destination, m.partition_key, \
                m.body, m.content_type, m.headers::jsonb, m.created_at, m.attempts, m.retry_at \
         FROM UNNEST($1::uuid[], $2::text[], $3::int4[], $4::text[], $5::text[], $6::bytea[], \
                     $7::text[], $8::text[], $9::timestamptz[], $10::int4[], $11::timestamptz[]) \
              WITH ORDINALITY AS m(id, event_type, event_version, destination, partition_key, \
                                   body, content_type, headers, created_at, attempts, retry_at, ord) \
         ORDER BY m.ord \
         ON CONFLICT (id) DO NOTHING"
    );
    let mut statements = 0;
    let mut rest = records;
    while !rest.is_empty() {
        let mut n = 0;
        let mut bytes = 0;
        while n < rest.len() && n < ROWS && (n == 0 || bytes < BYTES) {
            bytes += size_of_record(rest[n].0);
            n += 1;
        }
        let (chunk, after) = rest.split_at(n);
        rest = after;
        let mut headers = Vec::with_capacity(chunk.len());
        for (r, _) in chunk {
            headers.push(
                serde_json::to_string(&r.headers).map_err(|e| sqlx::Error::Encode(Box::new(e)))?,
            );
        }
        sqlx::query(trusted_sql(&sql))
            .bind(column(chunk, |r| r.id))
            .bind(column(chunk, |r| r.event_type.as_str()))
            .bind(column(chunk, |r| r.event_version))
            .bind(column(chunk, |r| r.destination.as_str()))
            .bind(column(chunk, |r| r.partition_key.as_deref()))
            .bind(column(chunk, |r| r.payload.as_bytes()))
            .bind(column(chunk, |r| &*r.content_type))
            .bind(headers)
            .bind(column(chunk, |r| r.created_at))
            .bind(column(chunk, |r| r.attempts))
            .bind(chunk.iter().map(|(_, at)| *at).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await?;
        statements += 1;
    }
    Ok(statements)
}

/// One column of `chunk`, as an array to bind.
fn column<'r, T>(
    chunk: &[(&'r OutboxRecord, Option<DateTime<Utc>>)],
    field: impl Fn(&'r OutboxRecord) -> T,
) -> Vec<T> {
    chunk.iter().map(|(r, _)| field(r)).collect()
}

impl WalSession<'_> {
    /// Writes `record` into the outbox table as a dead letter (or marks its row dead).
    pub(super) async fn bury(
        &mut self,
        record: &OutboxRecord,
        row: Option<i64>,
        error: &str,
    ) -> SessionResult<()> {
        let t = self.cx.tables.outbox.quoted();
        let mut tx = self.fenced().await?;
        self.cx.count_queries(1);
        match row {
            Some(seq) => {
                sqlx::query(trusted_sql(format!(
                    "UPDATE {t} SET dead_at = now(), attempts = $2, last_error = $3 WHERE seq = $1"
                )))
                .bind(seq)
                .bind(record.attempts)
                .bind(error)
                .execute(&mut *tx)
                .await?;
            }
            None => insert_row(&mut tx, &t, record, Some(error), None).await?,
        }
        tx.commit().await?;
        if let Some(seq) = row {
            self.loaded.remove(&seq);
        }
        tracing::error!(
            id = %record.id,
            key = record.partition_key.as_deref(),
            error,
            "outbox WAL relay: message dead-lettered into the outbox table; the later messages \
             of its key wait there behind it (`outbox dead`, `release`, `discard`)"
        );
        Ok(())
    }

    /// Moves the messages of parked keys into the outbox table, in order (a message
    /// waiting for a retry keeps its attempts and its due time there).
    pub(super) async fn park(&mut self) -> SessionResult<()> {
        let waiting: Vec<usize> = (0..self.buffer.len())
            .filter(|&i| self.buffer[i].to_table && !self.buffer[i].sent)
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        let t = self.cx.tables.outbox.quoted();
        let mut tx = self.fenced().await?;
        let records: Vec<(&OutboxRecord, Option<DateTime<Utc>>)> = waiting
            .iter()
            .map(|&i| (&self.buffer[i].record, wall(self.buffer[i].due)))
            .collect();
        let statements = insert_rows(&mut tx, &t, &records).await?;
        self.cx.count_queries(statements);
        tx.commit().await?;
        for i in waiting {
            self.buffer[i].sent = true;
        }
        Ok(())
    }

    /// Hands the unsent messages of `key` over to the outbox table: messages of the
    /// stream are written there (by [`park`](Self::park)), rows read from it are left
    /// there (the one waiting for a retry keeps its attempts and due time), and the key's
    /// later messages follow them until none is left.
    pub(super) async fn shelve(&mut self, key: &str) -> SessionResult<()> {
        let mut kept = Vec::new();
        for i in 0..self.buffer.len() {
            let e = &self.buffer[i];
            if e.sent || e.record.partition_key.as_deref() != Some(key) {
                continue;
            }
            let (row, retry_at, attempts) = (e.row, wall(e.due), e.record.attempts);
            let Some(row) = row else {
                self.buffer[i].to_table = true;
                continue;
            };
            self.buffer[i].sent = true; // settled: it stays in the table
            if attempts > 0 {
                kept.push((row, attempts, retry_at));
            } else {
                self.loaded.remove(&row);
            }
        }
        self.keep_rows(kept).await?;
        self.parked.insert(key.to_owned());
        Ok(())
    }

    /// Leaves the table rows `rows` (read from the table, no longer in memory) there,
    /// each with the attempts and the due time it had in memory: `(seq, attempts,
    /// retry_at)`.
    pub(super) async fn keep_rows(
        &mut self,
        rows: Vec<(i64, i32, Option<DateTime<Utc>>)>,
    ) -> SessionResult<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let t = self.cx.tables.outbox.quoted();
        let mut tx = self.fenced().await?;
        self.cx.count_queries(1);
        sqlx::query(trusted_sql(format!(
            "UPDATE {t} o SET attempts = u.attempts, next_attempt_at = u.retry_at \
             FROM UNNEST($1::int8[], $2::int4[], $3::timestamptz[]) AS u(seq, attempts, retry_at) \
             WHERE o.seq = u.seq"
        )))
        .bind(rows.iter().map(|r| r.0).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.1).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.2).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        for (row, _, _) in rows {
            self.loaded.remove(&row);
        }
        Ok(())
    }

    /// A transaction in which this relay may write the outbox table: it holds the slot's
    /// fence lock (see [`fence_key`]) and has checked that the slot is still streamed to
    /// this relay. A relay that lost the slot (frozen past `wal_sender_timeout`, the
    /// server ended its replication connection and a standby took over) writes nothing
    /// more: the standby may have published already what it was about to dead-letter or
    /// set aside, and a dead letter there would park a key behind a delivered message.
    pub(super) async fn fenced(&mut self) -> SessionResult<sqlx::Transaction<'static, Postgres>> {
        let mut tx = self.cx.pool.begin().await?;
        self.cx.count_queries(4); // BEGIN, the lock, the check, COMMIT
        // A relay that stops answering here (SIGSTOP, a frozen VM) would hold the fence
        // until it is continued, and the standby that took its slot would wait for it as
        // long: the server ends this transaction (rolled back, the lock released) once it
        // stood idle as long as a silent replication connection may.
        sqlx::query(
            "SELECT set_config('idle_in_transaction_session_timeout', $2, true), \
                    pg_advisory_xact_lock(hashtext($1))",
        )
        .bind(fence_key(self.wal))
        .bind(format!("{}ms", SENDER_TIMEOUT.as_millis()))
        .execute(&mut *tx)
        .await?;
        let holder: Option<i32> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&self.wal.slot)
                .fetch_optional(&mut *tx)
                .await?
                .flatten();
        if holder.is_some() && holder == self.walsender {
            return Ok(tx);
        }
        drop(tx); // rolled back
        let ours = self.walsender.take();
        self.client = None;
        tracing::warn!(
            slot = %self.wal.slot,
            walsender = ours,
            holder,
            "outbox WAL relay: this relay lost its replication slot (its server process \
             ended, likely after the relay stood still longer than wal_sender_timeout); it \
             writes nothing into the outbox table and starts over"
        );
        Err(SessionError::closed(
            format!("the replication stream of slot {:?}", self.wal.slot),
            Some(format!(
                "the slot is no longer streamed to this relay (held by server process {}); \
                 nothing was written into the outbox table, and the relay starts over (as a \
                 standby while another relay holds the slot)",
                holder.map_or_else(|| "none".to_owned(), |p| p.to_string())
            )),
        ))
    }

    /// With the buffer full and nothing to send, the keys that wait for a retry go into
    /// the outbox table: the stream moves on, the slot's position with it. Called only
    /// between drains, when nothing is in flight.
    pub(super) async fn spill(&mut self) -> SessionResult<()> {
        let now = Instant::now();
        // Without a key, a waiting message holds nothing back: it goes alone (a row read
        // from the table stays there, with its attempts and due time).
        // A message that waits because the broker is unavailable stays: during an outage
        // the stream waits in the slot rather than pass through the table.
        let mut keyless = 0;
        let mut rows = Vec::new();
        for e in self.buffer.iter_mut() {
            if e.sent
                || e.to_table
                || e.outage
                || e.record.partition_key.is_some()
                || e.due.is_none_or(|d| d <= now)
            {
                continue;
            }
            keyless += 1;
            match e.row {
                None => e.to_table = true,
                Some(row) => {
                    e.sent = true;
                    rows.push((row, e.record.attempts, wall(e.due)));
                }
            }
        }
        self.keep_rows(rows).await?;
        let waiting: Vec<String> = self
            .buffer
            .iter()
            .filter(|e| !e.sent && !e.to_table && !e.outage && e.due.is_some_and(|d| d > now))
            .filter_map(|e| e.record.partition_key.clone())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if waiting.is_empty() && keyless == 0 {
            return Ok(());
        }
        tracing::warn!(
            keys = waiting.len(),
            keyless,
            buffered = self.buffer.len(),
            buffered_bytes = self.bytes,
            "outbox WAL relay: keys waiting for a retry are set aside into the outbox table \
             (the relay holds at most {} messages and {} bytes in memory)",
            self.cap,
            self.cap_bytes
        );
        for key in &waiting {
            self.shelve(key).await?;
        }
        self.park().await?;
        self.reload = true;
        self.confirm();
        Ok(())
    }

    /// Reads which keys have unsent rows in the outbox table, and takes into the buffer
    /// the rows that may go out (not dead, not behind a dead letter of their key).
    pub(super) async fn load_table(&mut self) -> SessionResult<()> {
        let t = self.cx.tables.outbox.quoted();
        // With `SkipKey`, a dead letter holds nothing back: only the rows that will go
        // out keep their key in the table.
        let skip = self.cx.config.on_dead_letter == crate::config::OnDeadLetter::SkipKey;
        let (alive, behind_dead) = if skip {
            ("AND dead_at IS NULL", "")
        } else {
            (
                "",
                "AND NOT EXISTS (SELECT 1 FROM {t} d WHERE d.partition_key = o.partition_key \
                   AND d.seq < o.seq AND d.dead_at IS NOT NULL AND d.sent_at IS NULL)",
            )
        };
        self.cx.count_queries(2);
        let keys: Vec<String> = sqlx::query_scalar(trusted_sql(format!(
            "SELECT DISTINCT partition_key FROM {t} \
             WHERE sent_at IS NULL AND partition_key IS NOT NULL {alive}"
        )))
        .fetch_all(self.cx.pool)
        .await?;
        let mut parked: HashSet<String> = keys.into_iter().collect();
        // Not written there yet, or still on their way out of it.
        for e in self
            .buffer
            .iter()
            .filter(|e| !e.sent && (e.to_table || e.row.is_some()))
        {
            parked.extend(e.record.partition_key.clone());
        }
        self.parked = parked;
        let sql = format!(
            "SELECT {columns}, \
                    (CASE WHEN o.next_attempt_at > now() + interval '1 day' THEN 86400 \
                          ELSE GREATEST(EXTRACT(EPOCH FROM o.next_attempt_at - now()), 0) END)::float8 AS wait \
             FROM {t} o \
             WHERE o.sent_at IS NULL AND o.dead_at IS NULL {behind_dead} \
             ORDER BY o.seq LIMIT $1",
            columns = crate::db::rows::claim_columns(
                |c| format!("{c}::text"),
                crate::db::postgres::payload_bytes,
            ),
            behind_dead = behind_dead.replace("{t}", &t),
        );
        let limit = self.cx.config.batch_size.max(1) * 4;
        let rows = sqlx::query(trusted_sql(&sql))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.cx.pool)
            .await?;
        // A full page: there may be more to read once these are sent.
        self.reload = rows.len() >= limit;
        let now = Instant::now();
        for r in &rows {
            use sqlx::Row as _;
            let mut record = crate::db::rows::record(r)?;
            let wait: Option<f64> = r.try_get("wait")?;
            if !self.loaded.insert(record.seq) {
                continue;
            }
            let row = record.seq;
            record.seq = self.next_seq;
            self.next_seq += 1;
            self.bytes += size_of_record(&record);
            self.buffer.push_back(Entry {
                record,
                sent: false,
                // Capped at a day: an operator may well set `next_attempt_at` far ahead.
                due: wait
                    .filter(|w| *w > 0.0)
                    .map(|w| now + Duration::from_secs_f64(w.min(86_400.0))),
                row: Some(row),
                to_table: false,
                outage: false,
            });
        }
        Ok(())
    }
}
