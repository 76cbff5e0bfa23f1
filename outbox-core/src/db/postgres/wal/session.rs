//! The WAL relay session: the slot taken (or waited for), the stream read into a bounded
//! buffer, batches claimed from it, and the position confirmed once the broker
//! acknowledged everything before it.

use super::*;
use pgwire_replication::{SslMode, TlsConfig};

use crate::store::trusted_sql;

/// How long a replication connection may stay silent before the server ends it
/// (`wal_sender_timeout`): a relay that stopped answering (SIGSTOP, a frozen VM) gives
/// the slot up after that long, and a standby takes it.
pub(crate) const SENDER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) record: OutboxRecord,
    pub(super) sent: bool,
    /// Failed: not before this instant.
    pub(super) due: Option<Instant>,
    /// Read from the outbox table (a released dead letter or a message parked behind
    /// one): its row's `seq`, marked there once acknowledged.
    pub(super) row: Option<i64>,
    /// Its key is parked behind a dead letter: the message goes into the outbox table,
    /// behind it, instead of to the broker.
    pub(super) to_table: bool,
    /// Its last attempt failed because the broker was unavailable (no attempt counted):
    /// it waits in memory, never set aside into the table for that (an outage is not a
    /// key that keeps failing).
    pub(super) outage: bool,
}

/// The advisory lock (one `bigint` key, `hashtext` of this) a relay holds while it writes
/// the outbox table in WAL mode, and that a relay taking the slot waits for: a write
/// checked while its relay held the slot is read by the next relay.
pub(super) fn fence_key(wal: &Wal) -> String {
    format!("outbox:wal-fence:{}", wal.slot)
}

/// Messages the replication client reads ahead of the session (its event channel), on
/// top of the session's own bounds (`RelayConfig::wal_buffer_bytes`, the count): what
/// memory holds at most is those bounds plus this many messages.
pub(crate) const READ_AHEAD: usize = 1024;

/// How long a relay that stops waits for the server to show its last confirmation.
pub(super) const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The WAL relay session (WAL mode, [`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md)).
pub struct WalSession<'a> {
    pub(super) cx: Context<'a, Postgres>,
    pub(super) wal: &'a Wal,
    /// `None` while another relay holds the slot.
    pub(super) client: Option<ReplicationClient>,
    /// Received and not yet acknowledged, in commit order.
    pub(super) buffer: VecDeque<Entry>,
    pub(super) next_seq: i64,
    /// Per received commit: the last `seq` at or before it, and its end LSN.
    pub(super) commits: VecDeque<(i64, Lsn)>,
    /// Inside a transaction (between `Begin` and `Commit`).
    pub(super) in_tx: bool,
    /// The open transaction holds outbox messages (not only other logical messages).
    pub(super) tx_ours: bool,
    pub(super) confirmed: Lsn,
    /// The end of the WAL as the server last reported it.
    pub(super) wal_end: Lsn,
    /// Keys with unsent rows in the outbox table (dead letters, messages parked behind
    /// them, released ones): their messages go there, behind them, until none is left.
    pub(super) parked: HashSet<String>,
    /// Table rows in the buffer.
    pub(super) loaded: HashSet<i64>,
    /// The outbox table may hold rows that may go out now: read it at the next claim
    /// rather than at the next probe (a released key drains at the relay's pace).
    pub(super) reload: bool,
    /// At most this many messages in memory: past it, the stream waits in the slot, and
    /// keys that wait for a retry are set aside into the outbox table.
    pub(super) cap: usize,
    /// The same in payload and header bytes (`RelayConfig::wal_buffer_bytes`).
    pub(super) cap_bytes: usize,
    /// The payload and header bytes of the buffer's messages.
    pub(super) bytes: usize,
    /// The server process streaming the slot to this relay (`active_pid` once it took
    /// the slot): table writes check that it still holds the slot.
    pub(super) walsender: Option<i32>,
}

impl std::fmt::Debug for WalSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalSession")
            .field("slot", &self.wal.slot)
            .field("buffered", &self.buffer.len())
            .field("buffered_bytes", &self.bytes)
            .field("walsender", &self.walsender)
            .finish_non_exhaustive()
    }
}

/// What the replication connection's error `e`, while it connected to or started
/// streaming `wal`'s slot, says happened: the connection broke, the server sent what the
/// client cannot read, or the server refused (a missing privilege or publication, the
/// password, TLS).
pub(super) fn connect_error(e: PgWireError, wal: &Wal) -> SessionError {
    let connection = || format!("the replication connection of slot {:?}", wal.slot);
    match e {
        PgWireError::Io(_) | PgWireError::Task(_) => {
            SessionError::closed(connection(), Some(e.to_string()))
        }
        PgWireError::Protocol(_)
        | PgWireError::Internal(_)
        | PgWireError::MessageTooLarge { .. } => {
            SessionError::protocol(connection(), e.to_string())
        }
        e => SessionError::Refused(format!("WAL relay: replication slot {:?}: {e}", wal.slot)),
    }
}

/// The replication connection's TLS: the pool's `sslmode` (libpq's meaning; `allow` tries
/// TLS first, like `prefer`), with `wal`'s certificate files. None over a Unix socket.
fn tls_config(pool: &sqlx::PgPool, wal: &Wal) -> TlsConfig {
    use sqlx::postgres::PgSslMode;
    let options = pool.connect_options();
    let mode = match options.get_ssl_mode() {
        _ if options.get_socket().is_some() => SslMode::Disable,
        PgSslMode::Disable => SslMode::Disable,
        PgSslMode::Allow | PgSslMode::Prefer => SslMode::Prefer,
        PgSslMode::Require => SslMode::Require,
        PgSslMode::VerifyCa => SslMode::VerifyCa,
        PgSslMode::VerifyFull => SslMode::VerifyFull,
    };
    // Without TLS in this build, `prefer` means plain (an error for `require` and up).
    let mode = if cfg!(feature = "tls-rustls") || mode.requires_tls() {
        mode
    } else {
        SslMode::Disable
    };
    TlsConfig {
        mode,
        ca_pem_path: wal.tls.root_cert.clone(),
        client_cert_pem_path: wal.tls.client_cert.clone(),
        client_key_pem_path: wal.tls.client_key.clone(),
        ..TlsConfig::default()
    }
}

impl<'a> WalSession<'a> {
    pub(crate) async fn open(
        cx: Context<'a, Postgres>,
        wal: &'a Wal,
    ) -> SessionResult<WalSession<'a>> {
        if cfg!(not(feature = "tls-rustls")) && tls_config(cx.pool, wal).mode.requires_tls() {
            return Err(SessionError::Refused(
                "WAL relay: the connection asks for TLS (sslmode require/verify-*), and this \
                 build's replication connection has no TLS: turn on the `tls-rustls` feature \
                 of the `outbox` crate"
                    .to_owned(),
            ));
        }
        check_slot(cx.pool, cx.tables, wal)
            .await
            .map_err(|e| match e {
                // The check could not run: a database error, not a refusal.
                Error::Database { source, .. }
                | Error::Unavailable { source, .. }
                | Error::Tls { source, .. } => SessionError::Database(source),
                e => SessionError::Refused(e.to_string()),
            })?;
        let cap = (cx.config.batch_size.max(1) * 10).max(10_000);
        let cap_bytes = cx
            .config
            .wal_buffer_bytes
            .max(cx.config.max_batch_bytes.saturating_mul(2));
        Ok(WalSession {
            cx,
            wal,
            client: None,
            buffer: VecDeque::new(),
            next_seq: 1,
            commits: VecDeque::new(),
            in_tx: false,
            tx_ours: false,
            confirmed: Lsn(0),
            wal_end: Lsn(0),
            parked: HashSet::new(),
            loaded: HashSet::new(),
            reload: false,
            cap,
            cap_bytes,
            bytes: 0,
            walsender: None,
        })
    }

    pub(super) fn config(&self) -> ReplicationConfig {
        let options = self.cx.pool.connect_options();
        let password = self
            .wal
            .password
            .as_ref()
            .map(|s| s.0.clone())
            .or_else(|| std::env::var("PGPASSWORD").ok())
            .unwrap_or_default();
        let host = match options.get_socket() {
            Some(dir) => dir.to_string_lossy().into_owned(),
            None => options.get_host().to_owned(),
        };
        ReplicationConfig::new(
            host,
            options.get_username(),
            password,
            options.get_database().unwrap_or(options.get_username()),
            &self.wal.slot,
            self.wal.publication.as_str(),
        )
        .with_port(options.get_port())
        .with_application_name(&self.cx.config.application_name)
        .with_options(format!(
            "-c wal_sender_timeout={}ms",
            SENDER_TIMEOUT.as_millis()
        ))
        .with_status_interval(Duration::from_millis(100))
        .with_buffer_size(READ_AHEAD)
        .with_tls(tls_config(self.cx.pool, self.wal))
    }

    /// Takes the slot if it is free: `Ok(false)` while another relay holds it.
    pub(super) async fn start(&mut self) -> SessionResult<bool> {
        let mut client = ReplicationClient::connect(self.config())
            .await
            .map_err(|e| connect_error(e, self.wal))?;
        let timeout = self.cx.config.connect_timeout;
        match tokio::time::timeout(timeout, client.wait_started()).await {
            Err(_) => Err(SessionError::timed_out(
                format!(
                    "the database while the relay started streaming slot {:?}",
                    self.wal.slot
                ),
                timeout,
            )),
            Ok(Ok(())) => {
                self.client = Some(client);
                // The slot is ours now: its `active_pid` is the server process that
                // streams it to us, what every table write checks.
                self.cx.count_queries(1);
                self.walsender = sqlx::query_scalar(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                )
                .bind(&self.wal.slot)
                .fetch_optional(self.cx.pool)
                .await?
                .flatten();
                // A relay that lost the slot may be half-way through a table write it
                // began while it still held it: wait for it (its fence lock), so that
                // what it wrote is read below.
                let mut barrier = self.cx.pool.begin().await?;
                self.cx.count_queries(3);
                let free: bool =
                    sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1))")
                        .bind(fence_key(self.wal))
                        .fetch_one(&mut *barrier)
                        .await?;
                if !free {
                    let holders: Vec<i32> = sqlx::query_scalar(
                        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
                         AND objsubid = 1 \
                         AND (classid::int8 << 32 | objid::int8) = hashtext($1)::int8",
                    )
                    .bind(fence_key(self.wal))
                    .fetch_all(&mut *barrier)
                    .await?;
                    tracing::warn!(
                        slot = %self.wal.slot,
                        holders = ?holders,
                        "outbox WAL relay: took the slot; waiting for the relay that held it \
                         to end a write into the outbox table (the server ends it after \
                         wal_sender_timeout if that relay stands still)"
                    );
                    self.cx.count_queries(2);
                    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                        .bind(fence_key(self.wal))
                        .execute(&mut *barrier)
                        .await?;
                }
                barrier.commit().await?;
                // Before the first message: which keys wait behind dead letters.
                self.load_table().await?;
                Ok(true)
            }
            // object_in_use: another relay streams from the slot.
            Ok(Err(PgWireError::Server(e))) if e.contains("SQLSTATE 55006") => Ok(false),
            Ok(Err(e)) => Err(connect_error(e, self.wal)),
        }
    }
}

impl Session for WalSession<'_> {
    async fn probe(&mut self) -> SessionResult<Option<Probe>> {
        if self.client.is_none() {
            return Ok(None);
        }
        self.load_table().await?;
        let now = Instant::now();
        let open: Vec<&Entry> = self.buffer.iter().filter(|e| !e.sent).collect();
        let oldest = open
            .iter()
            .map(|e| e.record.created_at)
            .min()
            .map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            });
        let next_due_in = open
            .iter()
            .filter_map(|e| e.due)
            .filter(|d| *d > now)
            .min()
            .map(|d| d - now);
        // As `outbox status` shows it per slot (the oldest age is the relay's
        // `outbox_oldest_pending_age_seconds`).
        metrics::gauge!("outbox_wal_unconfirmed_bytes")
            .set(self.wal_end.0.saturating_sub(self.confirmed.0) as f64);
        Ok(Some(Probe {
            pending: open.len() as i64,
            oldest_age_seconds: oldest,
            due: None,
            next_due_in,
        }))
    }

    fn probe_interval(&self) -> Duration {
        self.cx.config.poll_interval
    }

    async fn own(&mut self) -> SessionResult<bool> {
        match &self.client {
            Some(client) if client.is_running() => Ok(true),
            Some(_) => Err(self.ended(None)),
            None => self.start().await,
        }
    }

    async fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
    ) -> SessionResult<()> {
        if self.claimable() {
            return Ok(());
        }
        if self.full() {
            // Nothing in flight now (the drain is over): the waiting keys can move.
            let before = self.buffer.len();
            self.spill().await?;
            if self.buffer.len() < before {
                return Ok(());
            }
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = stopped(shutdown) => {}
            }
            return Ok(());
        }
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        let event = tokio::select! {
            event = client.recv() => event,
            () = tokio::time::sleep_until(until) => return Ok(()),
            () = stopped(shutdown) => return Ok(()),
        };
        match event {
            Ok(Some(event)) => self.take(event),
            Ok(None) => Err(self.ended(None)),
            Err(e) => Err(self.ended(Some(e))),
        }
    }

    async fn retrying_keys(&mut self) -> SessionResult<Vec<String>> {
        Ok(self
            .buffer
            .iter()
            .filter(|e| !e.sent && e.due.is_some())
            .filter_map(|e| e.record.partition_key.clone())
            .collect())
    }

    async fn claim(&mut self, after: Option<i64>) -> SessionResult<Vec<OutboxRecord>> {
        let config = self.cx.config;
        self.pull(config.batch_size.max(1) * 2)?;
        self.park().await?;
        if self.reload && self.loaded.is_empty() {
            self.load_table().await?;
        }
        Ok(self.select(
            after.unwrap_or(0),
            config.batch_size,
            config.max_batch_bytes,
        ))
    }

    async fn acknowledge(&mut self, outcome: &Outcome) -> SessionResult<()> {
        let mut rows = Vec::new();
        for &seq in &outcome.sent {
            if let Some(e) = self.entry(seq) {
                e.sent = true;
                rows.extend(e.row);
            }
        }
        if !rows.is_empty() {
            let t = self.cx.tables.outbox.quoted();
            let sql = match self.cx.config.on_sent {
                crate::config::OnSent::Mark => {
                    format!("UPDATE {t} SET sent_at = now() WHERE seq = ANY($1)")
                }
                crate::config::OnSent::Delete => format!("DELETE FROM {t} WHERE seq = ANY($1)"),
            };
            let mut tx = self.fenced().await?;
            self.cx.count_queries(1);
            sqlx::query(trusted_sql(&sql))
                .bind(&rows)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            for row in &rows {
                self.loaded.remove(row);
            }
            // Rows of the table went out: the ones behind them may follow now.
            self.reload = true;
        }
        self.confirm();
        Ok(())
    }

    /// Failures wait in memory and are published again after their backoff (a broker
    /// outage counts no attempt); the slot keeps them until then. A message out of
    /// attempts, or refused for good, becomes a dead letter in the outbox table, and the
    /// later messages of its key follow it there, parked behind it.
    async fn fail(&mut self, outcome: &Outcome) -> SessionResult<u64> {
        let now = Instant::now();
        let config = self.cx.config;
        let mut dead = 0;
        for failure in &outcome.failed {
            let (seq, unavailable) = (failure.seq, failure.unavailable);
            let Some(e) = self.entry(seq) else { continue };
            e.outage = unavailable;
            if unavailable {
                e.due = Some(now + outcome.unavailable_delay);
                continue;
            }
            let (is_dead, secs) =
                crate::db::retry_plan(config, e.record.attempts, failure.permanent);
            e.record.attempts = e.record.attempts.saturating_add(1);
            if !is_dead {
                e.due = Some(now + Duration::from_secs_f64(secs));
                continue;
            }
            e.sent = true; // settled: the table has it now
            let record = e.record.clone();
            let row = e.row;
            let park_key = config.on_dead_letter == crate::config::OnDeadLetter::ParkKey;
            if let (true, Some(key)) = (park_key, record.partition_key.as_deref()) {
                // Earlier messages of its key still waiting (a retry failed in the same
                // batch) go into the table first, so they stay ahead of it there.
                let mut earlier = false;
                for l in self.buffer.iter_mut() {
                    if !l.sent
                        && l.row.is_none()
                        && l.record.seq < seq
                        && l.record.partition_key.as_deref() == Some(key)
                    {
                        l.to_table = true;
                        earlier = true;
                    }
                }
                if earlier {
                    self.park().await?;
                }
            }
            self.bury(&record, row, &failure.error).await?;
            dead += 1;
            // The key's later messages wait behind it in the table, also rows read from
            // there (a released dead letter that died again); with `SkipKey` they go on.
            if let (true, Some(key)) = (park_key, &record.partition_key) {
                self.shelve(key).await?;
            }
        }
        self.park().await?;
        self.confirm();
        Ok(dead)
    }

    /// Lets the slot go once the server has taken in the last confirmation, so the next
    /// relay does not publish again what the broker acknowledged.
    ///
    /// Written is not read: the client ends the stream by closing its socket, with the
    /// server's data still unread, which resets the connection. A walsender busy sending
    /// (other transactions of the database) meets that reset before it reads the last
    /// status update, and the slot stays at the one before. So this waits until
    /// `pg_replication_slots` shows the position (it reads the slot's memory, updated as
    /// soon as the walsender reads the update).
    async fn close(mut self) {
        // Within the relay's own bound on `close` (`connect_timeout`), so that the client
        // is always shut down.
        let wait = CLOSE_WAIT.min(self.cx.config.connect_timeout.mul_f64(0.8));
        let deadline = Instant::now() + wait;
        // A message goes out as soon as it is read, and the relay may stop before it
        // reads the commit after it: with every message read acknowledged, the rest of
        // an open transaction of outbox messages is read, so that its commit is confirmed.
        while self.in_tx && self.tx_ours && self.first_open().is_none() {
            let Some(client) = self.client.as_mut() else {
                break;
            };
            let Ok(Ok(Some(event))) = tokio::time::timeout_at(deadline, client.recv()).await else {
                break;
            };
            if self.take(event).is_err() {
                break;
            }
        }
        let Some(mut client) = self.client.take() else {
            return;
        };
        let mut shown = self.confirmed.0 == 0;
        let mut failed = None;
        while !shown && client.is_running() && Instant::now() < deadline {
            self.cx.count_queries(1);
            let query = sqlx::query_scalar::<_, bool>(
                "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots \
                 WHERE slot_name = $1",
            )
            .bind(&self.wal.slot)
            .bind(self.confirmed.to_string())
            .fetch_optional(self.cx.pool);
            match tokio::time::timeout_at(deadline, query).await {
                Ok(Ok(row)) => shown = row.unwrap_or(false),
                Ok(Err(e)) => {
                    failed = Some(e.to_string());
                    break;
                }
                Err(_) => break,
            }
            if !shown {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        if !shown {
            tracing::warn!(
                slot = %self.wal.slot,
                confirmed = %self.confirmed,
                ?wait,
                error = failed.as_deref(),
                "outbox WAL relay: could not see the server take in the last confirmed \
                 position before the relay let the slot go; the next relay may publish again \
                 what came after the position the slot shows (duplicates, which consumers \
                 drop by message id)"
            );
        }
        let _ = client.shutdown().await;
    }
}
