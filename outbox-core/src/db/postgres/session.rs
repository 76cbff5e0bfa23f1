//! One relay session on PostgreSQL: a dedicated connection that holds the relay's
//! advisory locks and runs every claim, reschedule and mark, plus a `LISTEN` connection,
//! and, during a backlog, a second connection that marks batch N-1 while the first
//! claims N+1.
//!
//! - **Wake-up**: `LISTEN` on the outbox channel (writers notify at commit), plus a
//!   safety probe every `poll_interval` that costs one query while idle.
//! - **Order**: rows are only claimed below the *publish horizon* (`horizon.rs`), so a
//!   transaction that drew a smaller `seq` but commits later is never overtaken.
//! - **Several relays**: rows are spread over `partitions` by key; each relay holds the
//!   partitions it publishes through advisory locks on its own connection, and relays
//!   share partitions evenly. A relay that dies loses its connection and with it its
//!   partitions; it cannot claim, reschedule or dead-letter anything after that, because
//!   those go through that same connection. (A mark through the second connection can
//!   still land: it records an acknowledgement the broker gave, which is true anyway.)

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::{Connection, Executor, PgConnection, Postgres, Row};
use tokio::sync::watch;
use tokio::time::Instant;

use super::horizon::{Horizon, Sample};
use super::locks;
use crate::config::{OnDeadLetter, OnSent, RelayConfig};
use crate::db::rows::{budgeted, claim_columns, decode_each, record};
use crate::model::state::{self, PENDING};
use crate::publisher::OutboxRecord;
use crate::store::session::{
    Context, Outcome, Probe, Session, SessionError, SessionResult, Source,
};
use crate::task::stopped;

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
    fn new(outbox: &str, seq_name: &str, table_key: i32, config: &RelayConfig) -> Sql {
        let on_sent = config.on_sent;
        let parked = state::parked(outbox, config.on_dead_letter == OnDeadLetter::ParkKey);
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
                    "SELECT {columns} \
                     FROM {outbox} o \
                     WHERE {pending_o} AND o.seq <= $1 AND o.seq > $5 \
                       AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
                       AND ($3::int4[] IS NULL OR \
                            ((hashtextextended(coalesce(o.partition_key, o.id::text), 0) & 9223372036854775807) % $4)::int4 \
                              = ANY($3)) \
                       AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                            WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                              AND {pending_r} AND {blocker}){parked} \
                     ORDER BY o.seq LIMIT $2",
                    columns = claim_columns(|c| format!("{c}::text")),
                    pending_o = state::pending("o"),
                    pending_r = state::pending("r"),
                    blocker = state::blocker("now()", "$5"),
                ),
                "octet_length(%)",
                "$6",
            ),
            mark: match on_sent {
                OnSent::Mark => format!("UPDATE {outbox} SET sent_at = now() WHERE seq = ANY($1)"),
                OnSent::Delete => format!("DELETE FROM {outbox} WHERE seq = ANY($1)"),
            },
            // A failure of the broker (`unavailable`) keeps `attempts` and never
            // dead-letters; it is due again after the relay's outage backoff ($8).
            fail: format!(
                "UPDATE {outbox} o SET \
                   attempts = o.attempts + CASE WHEN f.unavailable THEN 0 ELSE 1 END, \
                   last_error = f.error, \
                   dead_at = CASE WHEN NOT f.unavailable AND (f.permanent OR o.attempts + 1 >= $4) \
                     THEN now() END, \
                   next_attempt_at = CASE \
                     WHEN f.unavailable THEN now() + make_interval(secs => $8) \
                     WHEN f.permanent OR o.attempts + 1 >= $4 THEN o.next_attempt_at \
                     ELSE now() + make_interval(secs => least($6, $5 * power(2, least(o.attempts, 62))) * (0.75 + random() * 0.5)) END \
                 FROM UNNEST($1::bigint[], $2::text[], $3::bool[], $7::bool[]) \
                   AS f(seq, error, permanent, unavailable) \
                 WHERE o.seq = f.seq \
                 RETURNING o.dead_at IS NOT NULL AS dead"
            ),
            count_relays: format!(
                "SELECT count(*) FROM pg_locks WHERE {advisory} AND objid >= {relays} AND objid < {relays} + {max_relays}"
            ),
            retrying: state::retrying("partition_key", outbox),
            probe: format!(
                "SELECT count(*) AS pending, \
                        count(*) FILTER (WHERE next_attempt_at IS NULL OR next_attempt_at <= now()) AS due, \
                        coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age, \
                        extract(epoch FROM min(next_attempt_at) FILTER (WHERE next_attempt_at > now()) - now())::float8 \
                          AS next_due_in, \
                        (SELECT count(*) FROM pg_locks WHERE {advisory} \
                          AND objid >= {relays} AND objid < {relays} + {max_relays}) \
                          AS relays \
                 FROM {outbox} WHERE {PENDING}"
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
async fn register_partition_count(
    conn: &mut PgConnection,
    table_key: i32,
    cx: Context<'_, Postgres>,
) -> SessionResult<()> {
    let mine = i32::from(cx.config.partitions);
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
        Some(theirs) => Err(SessionError::Refused(format!(
            "other relays of outbox {} run with {theirs} partitions, this one is configured with \
             {mine}; every relay of one outbox must use the same `partitions` (RelayBuilder::partitions). \
             This relay stands by and takes over when those relays are gone",
            cx.tables.outbox
        ))),
    }
}

/// The first re-sample delay while writers hold the horizon back.
const FIRST_RESAMPLE: Duration = Duration::from_millis(5);

/// How long the horizon may be held back before the relay names the writer in a warning.
const HELD_WARNING: Duration = Duration::from_secs(10);

/// Whether the relay holds the idle lock ([`locks::IDLE`]), which makes commits notify
/// (`wake_sql` in `mod.rs`). Commits notify only while a relay waits: a `NOTIFY`
/// serialises every notifying commit on the server, and a busy relay looks for rows by
/// itself before it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idle {
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

/// A connection of the relay's, with its settings: keepalives, marks without waiting for
/// the WAL flush, custom plans, and the idle-session timeout.
pub(super) async fn connect_configured(
    options: &sqlx::postgres::PgConnectOptions,
    config: &RelayConfig,
) -> SessionResult<PgConnection> {
    let mut conn = PgConnection::connect_with(options).await?;
    // Notice a vanished relay host in ~25 s instead of the OS default of 2 hours, so its
    // partitions are taken over (the server drops the session and its locks).
    conn.execute("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3")
        .await?;
    // The relay's marks need not wait for their WAL flush: a mark lost in a server
    // crash (at most about 3 x wal_writer_delay of them) leaves its message pending,
    // and it is published again, which at-least-once delivery allows. Marks are lost as
    // a suffix of the WAL, so a key's later mark is never kept without its earlier one.
    // Waiting for the flush would put every relay round trip in the writers' fsync
    // queue.
    conn.execute("SET synchronous_commit = off").await?;
    // Each statement is planned for its own arguments and the table as it is now. A
    // session lives for days while the outbox grows from a few rows to millions and
    // back; after five runs PostgreSQL may keep a generic plan chosen while the table
    // was tiny (a sequential scan of its one page), and until an ANALYZE invalidated
    // it every mark read the whole table: 4.7 ms for 10 rows of a 30,000-row table
    // (test `a_relay_that_started_on_a_small_table_marks_a_backlog_by_index`). Planning
    // costs tens of microseconds per statement.
    conn.execute("SET plan_cache_mode = force_custom_plan")
        .await?;
    // A relay process that stops answering (SIGSTOP, a frozen VM) keeps its TCP
    // connection alive (the kernel answers keepalives): the server ends its session,
    // and with it the partitions, once it has been idle that long (PostgreSQL >= 14).
    sqlx::query(
        "SELECT set_config('idle_session_timeout', $1, false) \
         WHERE current_setting('server_version_num')::int >= 140000",
    )
    .bind(format!(
        "{}ms",
        config.effective_session_timeout().as_millis()
    ))
    .execute(&mut conn)
    .await?;
    Ok(conn)
}

/// The first retry when taking the idle lock fails (a commit was probing it at that
/// instant); doubles up to the poll interval.
const FIRST_IDLE_RETRY: Duration = Duration::from_millis(1);

pub struct PgSession<'a> {
    cx: Context<'a, Postgres>,
    conn: PgConnection,
    options: sqlx::postgres::PgConnectOptions,
    /// The connection that marks a backlog's batches while `conn` claims the next
    /// (`record_and_claim`), opened when first needed, and when it was last used.
    marks: Option<(PgConnection, Instant)>,
    /// Opening `marks` failed: not tried again before then.
    marks_retry_at: Option<Instant>,
    /// What wakes it for new rows.
    wake: Wake,
    /// The hub's connection it works on, in a relay of many outboxes: handed back at
    /// `close`.
    lease: Option<super::lease::Lease<'a>>,
    sql: Sql,
    table_key: i32,
    slot: i32,
    owned: BTreeSet<i32>,
    relays: i64,
    /// `relays` was just counted by a probe: the next ownership check rebalances with it.
    relays_probed: bool,
    next_rebalance: Instant,
    horizon: Horizon,
    /// While writers hold the horizon back: the next re-sample's delay (5 ms, doubling up
    /// to the poll interval), and since when it has been held.
    resample: Duration,
    held_since: Option<Instant>,
    held_reported: bool,
    idle: Idle,
    idle_retry: Duration,
    /// The last wait ended on its timer (a re-sample, a retry, the safety poll), not on
    /// a notification: a relay that held the idle lock through it keeps it for its claim.
    timer_woke: bool,
    /// The last claim found fewer rows than a batch: the relay has caught up.
    caught_up: bool,
}

/// What wakes a session for new rows: a `LISTEN` connection of its own, or, in a relay of
/// many outboxes, the hub's control connection.
enum Wake {
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

impl Source for Postgres {
    const POLL_INTERVAL: Duration = Duration::from_secs(5);

    type Session<'a> = Either<PgSession<'a>, super::wal::WalSession<'a>>;

    async fn open<'a>(cx: Context<'a, Self>) -> SessionResult<Self::Session<'a>> {
        Ok(match &cx.tables.wal {
            None => Either::Table(PgSession::connect(cx).await?),
            Some(wal) => Either::Wal(super::wal::WalSession::open(cx, wal).await?),
        })
    }
}

/// Table mode's session or WAL mode's, as the outbox was built.
#[derive(Debug)]
pub enum Either<T, W> {
    /// Table mode.
    Table(T),
    /// WAL mode.
    Wal(W),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            Either::Table($s) => $e,
            Either::Wal($s) => $e,
        }
    };
}

impl<T: Session, W: Session> Session for Either<T, W> {
    async fn probe(&mut self) -> SessionResult<Option<Probe>> {
        both!(self, s => s.probe().await)
    }
    fn probe_interval(&self) -> Duration {
        both!(self, s => s.probe_interval())
    }
    async fn own(&mut self) -> SessionResult<bool> {
        both!(self, s => s.own().await)
    }
    async fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
    ) -> SessionResult<()> {
        both!(self, s => s.wait(shutdown, until).await)
    }
    async fn retrying_keys(&mut self) -> SessionResult<Vec<String>> {
        both!(self, s => s.retrying_keys().await)
    }
    async fn claim(&mut self, after: Option<i64>) -> SessionResult<Vec<OutboxRecord>> {
        both!(self, s => s.claim(after).await)
    }
    async fn acknowledge(&mut self, outcome: &Outcome) -> SessionResult<()> {
        both!(self, s => s.acknowledge(outcome).await)
    }
    async fn record_and_claim(
        &mut self,
        outcome: &Outcome,
        after: Option<i64>,
    ) -> SessionResult<(u64, Vec<OutboxRecord>)> {
        both!(self, s => s.record_and_claim(outcome, after).await)
    }
    async fn fail(&mut self, outcome: &Outcome) -> SessionResult<u64> {
        both!(self, s => s.fail(outcome).await)
    }
    async fn close(self) {
        both!(self, s => s.close().await)
    }
    fn idle(&self) -> bool {
        both!(self, s => s.idle())
    }
}

impl<'a> PgSession<'a> {
    async fn connect(cx: Context<'a, Postgres>) -> SessionResult<PgSession<'a>> {
        let options = (*cx.pool.connect_options())
            .clone()
            .application_name(&cx.config.application_name);
        let conn = connect_configured(&options, cx.config).await?;
        Self::setup(cx, conn, options, None).await
    }

    /// Registers a session on `conn`: checks the table, its partition count and takes a
    /// relay slot. `shared`: the hub's wake-up and lease, in a relay of many outboxes
    /// (otherwise the session listens on a connection of its own).
    pub(super) async fn setup(
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
            relays: 1,
            horizon: carried.horizon,
            relays_probed: false,
            next_rebalance: Instant::now(),
            resample: FIRST_RESAMPLE,
            held_since: carried.held_since,
            held_reported: carried.held_reported,
            idle: Idle::Busy,
            idle_retry: FIRST_IDLE_RETRY,
            timer_woke: false,
            caught_up: false,
        })
    }

    fn count_queries(&self, n: u64) {
        self.cx.count_queries(n);
    }

    /// The key of the outbox's advisory locks (its table's oid).
    pub(super) fn table_key(&self) -> i32 {
        self.table_key
    }

    /// The outbox table's quoted name.
    pub(super) fn table_name(&self) -> String {
        self.cx.tables.outbox.quoted()
    }

    /// The marks connection, opened again once it has been idle for half the server's
    /// idle-session timeout (which would end it under a later mark).
    ///
    /// `None` when it cannot be opened within `connect_timeout` (a connection limit, a
    /// pool in front of the server): the marks then go through `conn`, one after the
    /// claim, as before, and opening it is tried again a session timeout later.
    async fn marks_connection(&mut self) -> Option<PgConnection> {
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
    fn horizon_free(&mut self) {
        if self.held_since.take().is_some() {
            self.cx.gauge("outbox_relay_horizon_held_seconds", 0.0);
            if self.held_reported {
                tracing::info!("outbox relay: the writer that held the horizon back has ended");
            }
        }
        self.resample = FIRST_RESAMPLE;
        self.held_reported = false;
    }

    /// While writers hold the horizon back: the gauge `outbox_relay_horizon_held_seconds`,
    /// and, once it has lasted [`HELD_WARNING`], one warning naming the oldest writer.
    async fn report_held(&mut self) -> SessionResult<()> {
        let since = *self.held_since.get_or_insert_with(Instant::now);
        let held = since.elapsed();
        self.cx
            .gauge("outbox_relay_horizon_held_seconds", held.as_secs_f64());
        if held >= HELD_WARNING && !self.held_reported {
            self.held_reported = true;
            self.count_queries(1);
            let writer =
                super::oldest_writer(&mut self.conn, &self.cx.tables.outbox.quoted()).await?;
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

    async fn count_relays(&mut self) -> SessionResult<i64> {
        self.count_queries(1);
        Ok(sqlx::query_scalar(&self.sql.count_relays)
            .fetch_one(&mut self.conn)
            .await?)
    }

    /// Takes or gives back partitions so that every relay holds its fair share.
    async fn rebalance(&mut self) -> SessionResult<()> {
        let total = i32::from(self.cx.config.partitions);
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
        self.cx
            .gauge("outbox_relay_partitions", self.owned.len() as f64);
        Ok(())
    }

    async fn sample(&mut self) -> SessionResult<Sample> {
        self.count_queries(2);
        // No arguments: the simple protocol runs both statements, each with its own snapshot.
        let rows = (&mut self.conn).fetch_all(self.sql.sample.as_str()).await?;
        let text = |i: usize| -> SessionResult<String> {
            rows.get(i)
                .ok_or_else(|| {
                    SessionError::Refused("the horizon sample returned too few rows".to_owned())
                })?
                .try_get::<String, _>(0)
                .map_err(SessionError::from)
        };
        let last_seq = text(0)?.parse::<i64>().map_err(|e| {
            SessionError::Refused(format!("the outbox sequence gave a bad value: {e}"))
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
    async fn claim_rows(&mut self, after: Option<i64>) -> SessionResult<Vec<OutboxRecord>> {
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
        let rows = sqlx::query(&self.sql.claim)
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
    async fn leave_idle(&mut self) -> SessionResult<()> {
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
        let row = sqlx::query(&self.sql.probe)
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
                    self.idle_retry = FIRST_IDLE_RETRY;
                    return Ok(());
                }
                // A commit held it for its probe at that instant: try again shortly,
                // looking for rows meanwhile (commits do not notify yet).
                until = until.min(Instant::now() + self.idle_retry);
                self.idle_retry =
                    (self.idle_retry * 2).min(self.cx.config.poll_interval.max(FIRST_IDLE_RETRY));
            }
        }
        let until = if self.horizon.waiting() {
            self.report_held().await?;
            let soon = Instant::now() + self.resample;
            self.resample =
                (self.resample * 2).min(self.cx.config.poll_interval.max(FIRST_RESAMPLE));
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
        Ok(sqlx::query_scalar(&self.sql.retrying)
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
        sqlx::query(&self.sql.mark)
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
        let dead = if outcome.failed_seq.is_empty() {
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
        let mark = sqlx::query(&sql).bind(&outcome.sent).execute(&mut marks);
        let (marked, claimed) = tokio::join!(mark, self.claim_rows(after));
        marked?;
        self.marks = Some((marks, Instant::now()));
        Ok((dead, claimed?))
    }

    async fn fail(&mut self, outcome: &Outcome) -> SessionResult<u64> {
        let config = self.cx.config;
        self.count_queries(1);
        let dead: Vec<bool> = sqlx::query_scalar(&self.sql.fail)
            .bind(&outcome.failed_seq)
            .bind(&outcome.failed_error)
            .bind(&outcome.failed_permanent)
            .bind(config.max_attempts)
            .bind(config.backoff_base.as_secs_f64())
            .bind(config.backoff_cap.as_secs_f64())
            .bind(&outcome.failed_unavailable)
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
