//! The table-mode relay session ([`PgSession`]): the connection holding the relay's
//! advisory locks, `LISTEN`, the publish horizon, the claim, the marks (through a second
//! connection during a backlog) and the failures.

use super::*;

use crate::store::trusted_sql;

/// The first re-sample delay while writers hold the horizon back.
pub(super) const FIRST_RESAMPLE: Duration = Duration::from_millis(5);

/// How long the horizon may be held back before the relay names the writer in a warning.
pub(super) const HELD_WARNING: Duration = Duration::from_secs(10);

/// Whether the relay holds the idle lock ([`locks::IDLE`]), which makes commits notify
/// (`wake_sql` in `mod.rs`). Commits notify only while a relay waits: a `NOTIFY`
/// serialises every notifying commit on the server, and a busy relay looks for rows by
/// itself before it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Idle {
    /// Working: commits do not notify.
    Busy,
    /// Has just taken the lock: claims once more before waiting. A commit that probed the
    /// lock before it was taken held the writer lock while it did, so that claim's horizon
    /// sample either sees the commit's rows or sees the writer still in flight (and looks
    /// again soon, as for any writer holding the horizon back).
    Declared,
    /// Holds the lock and has claimed since taking it: may wait for a notification.
    Waiting,
}
/// The first retry when taking the idle lock fails (a commit was probing it at that
/// instant); doubles up to the poll interval.
pub(super) const FIRST_IDLE_RETRY: Duration = Duration::from_millis(1);

pub struct PgSession<'a> {
    pub(super) cx: Context<'a, Postgres>,
    pub(super) conn: PgConnection,
    pub(super) options: sqlx::postgres::PgConnectOptions,
    /// The connection that marks a backlog's batches while `conn` claims the next
    /// (`record_and_claim`), opened when first needed, and when it was last used.
    pub(super) marks: Option<(PgConnection, Instant)>,
    /// Opening `marks` failed: not tried again before then.
    pub(super) marks_retry_at: Option<Instant>,
    /// What wakes it for new rows.
    pub(super) wake: Wake,
    /// The hub's connection it works on, in a relay of many outboxes: handed back at
    /// `close`.
    pub(super) lease: Option<super::lease::Lease<'a>>,
    pub(super) sql: Sql,
    pub(super) table_key: i32,
    pub(super) slot: i32,
    pub(super) owned: BTreeSet<i32>,
    /// The partitions the log last said this outbox's relay holds.
    pub(super) reported_partitions: BTreeSet<i32>,
    pub(super) relays: i64,
    /// `relays` was just counted by a probe: the next ownership check rebalances with it.
    pub(super) relays_probed: bool,
    pub(super) next_rebalance: Instant,
    pub(super) horizon: Horizon,
    /// While writers hold the horizon back: the next re-sample's delay (5 ms, doubling up
    /// to the poll interval), and since when it has been held.
    pub(super) resample: crate::backoff::Backoff,
    pub(super) held_since: Option<Instant>,
    pub(super) held_reported: bool,
    pub(super) idle: Idle,
    /// The retry of taking the idle lock (1 ms, doubling up to the poll interval).
    pub(super) idle_retry: crate::backoff::Backoff,
    /// The last wait ended on its timer (a re-sample, a retry, the safety poll), not on
    /// a notification: a relay that held the idle lock through it keeps it for its claim.
    pub(super) timer_woke: bool,
    /// The last claim found fewer rows than a batch: the relay has caught up.
    pub(super) caught_up: bool,
}

/// What wakes a session for new rows: a `LISTEN` connection of its own, or, in a relay of
/// many outboxes, the hub's control connection.
pub(super) enum Wake {
    Own(PgListener),
    Hub(std::sync::Arc<tokio::sync::Notify>),
}

impl std::fmt::Debug for PgSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSession")
            .field("outbox", &self.cx.tables.outbox)
            .field("slot", &self.slot)
            .field("owned", &self.owned)
            .finish_non_exhaustive()
    }
}
impl<'a> PgSession<'a> {
    pub(super) async fn connect(cx: Context<'a, Postgres>) -> SessionResult<PgSession<'a>> {
        let options = (*cx.pool.connect_options())
            .clone()
            .application_name(&cx.config.application_name);
        let conn = connect_configured(&options, cx.config).await?;
        Self::setup(cx, conn, options, None).await
    }

    /// Registers a session on `conn`: checks the table, its partition count and takes a
    /// relay slot. `shared`: the hub's wake-up and lease, in a relay of many outboxes
    /// (otherwise the session listens on a connection of its own).
    pub(in crate::db::postgres) async fn setup(
        cx: Context<'a, Postgres>,
        mut conn: PgConnection,
        options: sqlx::postgres::PgConnectOptions,
        shared: Option<(std::sync::Arc<tokio::sync::Notify>, super::lease::Lease<'a>)>,
    ) -> SessionResult<PgSession<'a>> {
        let tables = cx.tables;
        let (seq_name, cache): (Option<String>, Option<i64>) = sqlx::query_as(
            "SELECT s.name, (SELECT seqcache FROM pg_sequence WHERE seqrelid = s.name::regclass) \
             FROM (SELECT pg_get_serial_sequence($1, 'seq') AS name) s",
        )
        .bind(tables.outbox.quoted())
        .fetch_one(&mut conn)
        .await?;
        let seq_name = seq_name.ok_or_else(|| {
            SessionError::Refused(format!(
                "the outbox table {} has no `seq` identity column; run the outbox migrations",
                tables.outbox
            ))
        })?;
        // The publish horizon needs `seq` values drawn in the order writers take the
        // writer lock: a session caching values could draw a smaller one after the relay
        // sampled a larger one, and the relay would overtake its rows.
        if let Some(cache) = cache.filter(|c| *c != 1) {
            return Err(SessionError::Refused(format!(
                "the outbox's sequence {seq_name} has CACHE {cache}; the relay needs CACHE 1 to \
                 keep per-key order (a cached value can be drawn after a larger one was \
                 published). Run `ALTER SEQUENCE {seq_name} CACHE 1`; the relay starts then"
            )));
        }
        // The table's oid keys every advisory lock of this outbox.
        let (table_key, channel): (i32, String) =
            sqlx::query_as("SELECT oid::int4, 'outbox_' || oid::text FROM (SELECT $1::text::regclass::oid AS oid) t")
                .bind(tables.outbox.quoted())
                .fetch_one(&mut conn)
                .await?;
        // Before taking a relay slot: a refused relay must not count as a relay.
        register_partition_count(&mut conn, table_key, cx).await?;
        let slot: Option<i32> = sqlx::query_scalar(
            "SELECT s FROM generate_series(0, $3 - 1) AS s WHERE pg_try_advisory_lock($1, $2 + s) LIMIT 1",
        )
        .bind(table_key)
        .bind(locks::RELAYS)
        .bind(locks::MAX_RELAYS)
        .fetch_optional(&mut conn)
        .await?;
        let slot = slot.ok_or_else(|| {
            SessionError::Refused(format!(
                "more than {} relays on one outbox",
                locks::MAX_RELAYS
            ))
        })?;

        let (wake, lease) = match shared {
            Some((wake, lease)) => (Wake::Hub(wake), Some(lease)),
            None => {
                // The listener reconnects by itself through this one-connection pool.
                let listen_pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect_lazy_with(options.clone());
                let mut listener = PgListener::connect_with(&listen_pool).await?;
                listener.ignore_pool_close_event(true);
                // A lost connection is reported at once (`Ok(None)`, a cycle runs), not
                // after a reconnection inside `try_recv`, which a timer could cancel
                // half-way and leave unreported.
                listener.eager_reconnect(false);
                listener.listen(&channel).await?;
                (Wake::Own(listener), None)
            }
        };

        let sql = Sql::new(&tables.outbox.quoted(), &seq_name, table_key, cx.config);
        cx.count_queries(7);
        // A tenant's horizon carries over from its last turn.
        let carried = lease
            .as_ref()
            .map(|l| l.carried(table_key))
            .unwrap_or_default();
        if lease.is_none() {
            tracing::info!(slot, outbox = %tables.outbox, "outbox relay connected");
        } else {
            tracing::debug!(slot, outbox = %tables.outbox, "outbox relay: a tenant's turn began");
        }
        Ok(PgSession {
            cx,
            conn,
            options,
            marks: None,
            marks_retry_at: None,
            wake,
            lease,
            sql,
            table_key,
            slot,
            owned: BTreeSet::new(),
            reported_partitions: carried.reported_partitions,
            relays: 1,
            horizon: carried.horizon,
            relays_probed: false,
            next_rebalance: Instant::now(),
            resample: crate::backoff::Backoff::new(
                FIRST_RESAMPLE,
                cx.config.poll_interval.max(FIRST_RESAMPLE),
            ),
            held_since: carried.held_since,
            held_reported: carried.held_reported,
            idle: Idle::Busy,
            idle_retry: crate::backoff::Backoff::new(
                FIRST_IDLE_RETRY,
                cx.config.poll_interval.max(FIRST_IDLE_RETRY),
            ),
            timer_woke: false,
            caught_up: false,
        })
    }

    pub(super) fn count_queries(&self, n: u64) {
        self.cx.count_queries(n);
    }

    /// The key of the outbox's advisory locks (its table's oid).
    pub(in crate::db::postgres) fn table_key(&self) -> i32 {
        self.table_key
    }

    /// The outbox table's quoted name.
    pub(in crate::db::postgres) fn table_name(&self) -> String {
        self.cx.tables.outbox.quoted()
    }

    /// The marks connection, opened again once it has been idle for half the server's
    /// idle-session timeout (which would end it under a later mark).
    ///
    /// `None` when it cannot be opened within `connect_timeout` (a connection limit, a
    /// pool in front of the server): the marks then go through `conn`, one after the
    /// claim, as before, and opening it is tried again a session timeout later.
    pub(super) async fn marks_connection(&mut self) -> Option<PgConnection> {
        if self.lease.is_some() {
            // A tenant of a relay of many outboxes works on one connection of the hub.
            return None;
        }
        let config = self.cx.config;
        let fresh_for = config.effective_session_timeout() / 2;
        match self.marks.take() {
            Some((conn, used)) if used.elapsed() < fresh_for => return Some(conn),
            _ => {}
        }
        if self.marks_retry_at.is_some_and(|at| Instant::now() < at) {
            return None;
        }
        // The settings: four statements.
        self.count_queries(4);
        let opened = tokio::time::timeout(
            config.connect_timeout,
            connect_configured(&self.options, config),
        )
        .await;
        match opened {
            Ok(Ok(conn)) => {
                self.marks_retry_at = None;
                Some(conn)
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {:?}", config.connect_timeout),
                };
                tracing::warn!(
                    error,
                    "outbox relay: cannot open a second connection for marks; marking on the \
                     relay's connection, after each claim"
                );
                self.marks_retry_at = Some(Instant::now() + config.effective_session_timeout());
                None
            }
        }
    }

    /// The horizon is no longer held back: the gauge and the backoff start afresh.
    pub(super) fn horizon_free(&mut self) {
        if self.held_since.take().is_some() {
            self.cx.gauge("outbox_relay_horizon_held_seconds", 0.0);
            if self.held_reported {
                tracing::info!("outbox relay: the writer that held the horizon back has ended");
            }
        }
        self.resample.reset();
        self.held_reported = false;
    }

    /// While writers hold the horizon back: the gauge `outbox_relay_horizon_held_seconds`,
    /// and, once it has lasted [`HELD_WARNING`], one warning naming the oldest writer.
    pub(super) async fn report_held(&mut self) -> SessionResult<()> {
        let since = *self.held_since.get_or_insert_with(Instant::now);
        let held = since.elapsed();
        self.cx
            .gauge("outbox_relay_horizon_held_seconds", held.as_secs_f64());
        if held >= HELD_WARNING && !self.held_reported {
            self.held_reported = true;
            self.count_queries(1);
            let writer = super::super::diagnostics::oldest_writer(
                &mut self.conn,
                &self.cx.tables.outbox.quoted(),
            )
            .await?;
            if let Some(w) = writer {
                tracing::warn!(
                    pid = w.pid,
                    open_seconds = w.age_seconds,
                    state = %w.state,
                    outbox = %self.cx.tables.outbox,
                    "outbox relay: an open transaction that wrote outbox rows holds back every key: \
                     nothing written after it began is published until it commits or rolls back \
                     (see `outbox status`)"
                );
            }
        }
        Ok(())
    }
    pub(super) async fn sample(&mut self) -> SessionResult<Sample> {
        self.count_queries(2);
        // No arguments: the simple protocol runs both statements, each with its own snapshot.
        let rows = (&mut self.conn)
            .fetch_all(trusted_sql(self.sql.sample.as_str()))
            .await?;
        let text = |i: usize| -> SessionResult<String> {
            rows.get(i)
                .ok_or_else(|| {
                    SessionError::protocol(
                        "the horizon sample",
                        format!(
                            "it returned {} row(s), the relay needs 2 (the sequence's last \
                             value, then the writers)",
                            rows.len()
                        ),
                    )
                })?
                .try_get::<String, _>(0)
                .map_err(SessionError::from)
        };
        let last = text(0)?;
        let last_seq = last.parse::<i64>().map_err(|e| {
            SessionError::protocol(
                "the outbox sequence's last value",
                format!("{last:?} is not a bigint ({e})"),
            )
        })?;
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
    pub(super) async fn claim_rows(
        &mut self,
        after: Option<i64>,
    ) -> SessionResult<Vec<OutboxRecord>> {
        match self.idle {
            Idle::Busy => {}
            // The claim after declaring idle: keep the lock; `wait` may wait now.
            Idle::Declared => self.idle = Idle::Waiting,
            // Woken by its timer: it keeps the lock (commits keep notifying, so none is
            // missed) and gives it up below only if it finds rows to publish. Released
            // and taken again, the lock would cost a statement each and one more claim
            // per re-sample while an open writer holds the horizon back.
            Idle::Waiting if self.timer_woke => {}
            // Woken: commits stop notifying; this relay looks again before it waits.
            Idle::Waiting => self.leave_idle().await?,
        }
        let sample = self.sample().await?;
        let mut horizon = self.horizon.observe(sample);
        if !self.horizon.waiting() {
            self.horizon_free();
        } else if self.caught_up && self.held_since.is_none() {
            // Caught up, and the newest rows wait for writers that were committing as
            // the relay looked. They are usually done a moment later: looking again now
            // saves the rows committed during the last cycle a whole cycle of waiting.
            // (Not while a writer has held the horizon through a wait: that one is open,
            // and `wait` re-samples with a backoff.)
            let again = self.sample().await?;
            horizon = self.horizon.observe(again);
        }
        if self.owned.is_empty() {
            return Ok(Vec::new());
        }
        let config = self.cx.config;
        let filter: Option<Vec<i32>> = (self.owned.len() < usize::from(config.partitions))
            .then(|| self.owned.iter().copied().collect());
        self.count_queries(1);
        let rows = sqlx::query(trusted_sql(&self.sql.claim))
            .bind(horizon)
            .bind(i64::try_from(config.batch_size).unwrap_or(i64::MAX))
            .bind(filter)
            .bind(i32::from(config.partitions))
            .bind(after.unwrap_or(0))
            .bind(i64::try_from(config.max_batch_bytes).unwrap_or(i64::MAX))
            .fetch(&mut self.conn);
        let rows = decode_each(rows, record).await?;
        self.caught_up = rows.len() < config.batch_size;
        if !rows.is_empty() && matches!(self.idle, Idle::Waiting) {
            self.leave_idle().await?;
        }
        Ok(rows)
    }

    /// Gives the idle lock up: commits stop notifying.
    pub(super) async fn leave_idle(&mut self) -> SessionResult<()> {
        self.count_queries(1);
        sqlx::query("SELECT pg_advisory_unlock_shared($1, $2)")
            .bind(self.table_key)
            .bind(locks::IDLE)
            .execute(&mut self.conn)
            .await?;
        self.idle = Idle::Busy;
        Ok(())
    }
}

impl Session for PgSession<'_> {
    /// The safety poll: pending and due rows, the next retry, and the relays (the
    /// ownership check that follows rebalances with that count).
    async fn probe(&mut self) -> SessionResult<Option<Probe>> {
        self.count_queries(1);
        let row = sqlx::query(trusted_sql(&self.sql.probe))
            .fetch_one(&mut self.conn)
            .await?;
        let next_due_in: Option<f64> = row.try_get("next_due_in")?;
        self.relays = row.try_get("relays")?;
        self.relays_probed = true;
        Ok(Some(Probe {
            pending: row.try_get("pending")?,
            oldest_age_seconds: row.try_get("oldest_age")?,
            due: Some(row.try_get("due")?),
            next_due_in: next_due_in.map(|s| Duration::from_secs_f64(s.max(0.0))),
        }))
    }

    fn probe_interval(&self) -> Duration {
        self.cx.config.poll_interval
    }

    /// Always the active relay (work is shared by partitions); rebalances after a probe
    /// and every `rebalance_interval`.
    async fn own(&mut self) -> SessionResult<bool> {
        let now = Instant::now();
        if self.relays_probed || now >= self.next_rebalance {
            if !std::mem::take(&mut self.relays_probed) {
                self.relays = self.count_relays().await?;
            }
            self.rebalance().await?;
            self.next_rebalance = now + self.cx.config.rebalance_interval;
        }
        Ok(true)
    }

    /// Waits for a notification, `until`, or shutdown. A busy relay first declares itself
    /// idle (takes the idle lock, so that commits notify) and returns at once, for the one
    /// claim that must follow ([`Idle::Declared`]). Notifications already buffered
    /// are drained: one cycle serves them all. While writers held the horizon back at the
    /// last claim, looks again soon (a rollback sends no notification): after 5 ms, then
    /// doubling up to the poll interval while the same wait goes on, so a writer left
    /// open (idle in transaction, prepared) costs a few statements per poll interval,
    /// not hundreds per second.
    async fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
    ) -> SessionResult<()> {
        let mut until = until;
        match self.idle {
            Idle::Waiting => {}
            Idle::Declared => return Ok(()),
            Idle::Busy => {
                self.count_queries(1);
                let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock_shared($1, $2)")
                    .bind(self.table_key)
                    .bind(locks::IDLE)
                    .fetch_one(&mut self.conn)
                    .await?;
                if taken {
                    self.idle = Idle::Declared;
                    self.idle_retry.reset();
                    tracing::trace!(outbox = %self.cx.tables.outbox, key = self.table_key, "outbox relay: declared idle; commits notify from now on");
                    return Ok(());
                }
                // A commit held it for its probe at that instant: try again shortly,
                // looking for rows meanwhile (commits do not notify yet).
                until = until.min(Instant::now() + self.idle_retry.next());
            }
        }
        let until = if self.horizon.waiting() {
            self.report_held().await?;
            let soon = Instant::now() + self.resample.next();
            until.min(soon)
        } else {
            self.horizon_free();
            until
        };
        let lease = self.lease.as_ref();
        let listener = match &mut self.wake {
            Wake::Own(listener) => listener,
            Wake::Hub(notify) => {
                // A tenant waiting for a connection ends the wait too: the relay loop
                // then yields if this tenant's turn is up.
                let asked = async move {
                    match lease {
                        Some(lease) => lease.asked().notified().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = notify.notified() => self.timer_woke = false,
                    () = asked => self.timer_woke = true,
                    _ = tokio::time::sleep_until(until) => self.timer_woke = true,
                    _ = stopped(shutdown) => self.timer_woke = false,
                }
                return Ok(());
            }
        };
        tokio::select! {
            n = listener.try_recv() => {
                // `None`: the listening connection was lost and is being re-established;
                // notifications may have been missed, so run a cycle anyway.
                self.timer_woke = false;
                n?;
                while listener.next_buffered().is_some() {}
            }
            _ = tokio::time::sleep_until(until) => self.timer_woke = true,
            _ = stopped(shutdown) => self.timer_woke = false,
        }
        Ok(())
    }

    async fn retrying_keys(&mut self) -> SessionResult<Vec<String>> {
        self.count_queries(1);
        Ok(sqlx::query_scalar(trusted_sql(&self.sql.retrying))
            .fetch_all(&mut self.conn)
            .await?)
    }

    fn claim(
        &mut self,
        after: Option<i64>,
    ) -> impl Future<Output = SessionResult<Vec<OutboxRecord>>> + Send {
        self.claim_rows(after)
    }

    async fn acknowledge(&mut self, outcome: &Outcome) -> SessionResult<()> {
        self.count_queries(1);
        sqlx::query(trusted_sql(&self.sql.mark))
            .bind(&outcome.sent)
            .execute(&mut self.conn)
            .await?;
        Ok(())
    }

    /// The mark runs on a second connection while `conn` claims. During a backlog the
    /// mark of batch N-1 (about 15 µs a row: a new row version and its index entries)
    /// and the claim of N+1 then take as long as the longer of the two, not their sum
    /// (`outbox-bench -- drain --broker memory`: 52k → 70k events/s). A mark records a
    /// broker's acknowledgement, which stays true whoever owns the partition by the time
    /// it lands, so it needs none of `conn`'s locks. Reschedules and dead letters stay on
    /// `conn` (a relay that lost its partitions no longer has it), before the claim, as
    /// in the default.
    async fn record_and_claim(
        &mut self,
        outcome: &Outcome,
        after: Option<i64>,
    ) -> SessionResult<(u64, Vec<OutboxRecord>)> {
        let dead = if outcome.failed.is_empty() {
            0
        } else {
            self.fail(outcome).await?
        };
        if outcome.sent.is_empty() {
            return Ok((dead, self.claim_rows(after).await?));
        }
        let Some(mut marks) = self.marks_connection().await else {
            self.acknowledge(outcome).await?;
            return Ok((dead, self.claim_rows(after).await?));
        };
        let sql = self.sql.mark.clone();
        self.count_queries(1);
        let mark = sqlx::query(trusted_sql(&sql))
            .bind(&outcome.sent)
            .execute(&mut marks);
        let (marked, claimed) = tokio::join!(mark, self.claim_rows(after));
        marked?;
        self.marks = Some((marks, Instant::now()));
        Ok((dead, claimed?))
    }

    async fn fail(&mut self, outcome: &Outcome) -> SessionResult<u64> {
        let config = self.cx.config;
        // One array per column, for the statement's `UNNEST`.
        let failed = &outcome.failed;
        let seq: Vec<i64> = failed.iter().map(|f| f.seq).collect();
        let error: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
        let permanent: Vec<bool> = failed.iter().map(|f| f.permanent).collect();
        let unavailable: Vec<bool> = failed.iter().map(|f| f.unavailable).collect();
        self.count_queries(1);
        let dead: Vec<bool> = sqlx::query_scalar(trusted_sql(&self.sql.fail))
            .bind(&seq)
            .bind(&error)
            .bind(&permanent)
            .bind(config.max_attempts)
            .bind(config.backoff_base.as_secs_f64())
            .bind(config.backoff_cap.as_secs_f64())
            .bind(&unavailable)
            .bind(outcome.unavailable_delay.as_secs_f64())
            .fetch_all(&mut self.conn)
            .await?;
        Ok(dead.iter().filter(|d| **d).count() as u64)
    }

    /// Not while writers it saw in flight hold the horizon back: such a writer's commit
    /// may not notify (it probed the idle lock before the session took it), so the
    /// session must look again by itself (`wait` re-samples).
    fn idle(&self) -> bool {
        self.idle == Idle::Waiting && !self.horizon.waiting()
    }

    async fn close(self) {
        if let Some(lease) = self.lease {
            // Its locks go; the connection goes back to the hub for the next tenant.
            let carry = super::lease::Carried {
                horizon: self.horizon,
                held_since: self.held_since,
                held_reported: self.held_reported,
                reported_partitions: self.reported_partitions,
            };
            lease.give_back(self.conn, self.table_key, carry).await;
            return;
        }
        // Hands the partitions over at once instead of when the connection times out.
        let _ = self.conn.close().await;
        if let Some((marks, _)) = self.marks {
            let _ = marks.close().await;
        }
    }
}
