//! The relay's contract with a database: a [`Source`] opens [`Session`]s, and the one
//! relay loop (`relay/run.rs`) drives any of them. A session claims batches, records
//! what the broker acknowledged and what failed, says whether it may publish now, and
//! waits for work. The loop never names a database; a database never names the loop.
//!
//! Progress is recorded per batch ([`Outcome`]): the positions (`seq`) acknowledged,
//! the failures, and [`Outcome::settled_through`], the position up to which everything
//! in the batch is settled. A table session marks the acknowledged rows; a session that
//! confirms "everything up to position P" (a WAL LSN) confirms `settled_through`.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::{RelayConfig, Tables};
use crate::publisher::OutboxRecord;

/// Why a relay session ended. The relay logs it, waits (with backoff) and opens a new one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The database failed or the connection was lost.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The database did not answer within the relay's `connect_timeout` while the
    /// session opened.
    #[error(
        "the database did not answer within {0:?} while the relay connected \
         (RelayConfig::connect_timeout)"
    )]
    TimedOut(std::time::Duration),
    /// The session cannot run as things stand (another relay's configuration conflicts,
    /// the table lacks what the relay needs, no relay slot is free). Says what to do.
    #[error("{0}")]
    Refused(String),
}

/// What a session returns.
pub type SessionResult<T> = Result<T, SessionError>;

/// What a session works with: the relay's pool, tables and settings, and the counter of
/// statements it sends (`RelayStats::queries`).
#[derive(Debug)]
pub struct Context<'a, DB: sqlx::Database> {
    /// The outbox's pool (its connect options open the session's own connections).
    pub pool: &'a sqlx::Pool<DB>,
    /// The outbox's tables.
    pub tables: &'a Tables,
    /// The relay's settings.
    pub config: &'a RelayConfig,
    /// Statements sent, for the relay's stats.
    pub queries: &'a AtomicU64,
    /// The labels of the relay's metrics (`tenant`, for a relay of many outboxes; empty
    /// otherwise). `None`: this relay's gauges are not reported (a tenant past the
    /// labelled ones, whose gauges would overwrite each other's under `other`).
    pub labels: Option<&'a [metrics::Label]>,
}

impl<DB: sqlx::Database> Clone for Context<'_, DB> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<DB: sqlx::Database> Copy for Context<'_, DB> {}

impl<DB: sqlx::Database> Context<'_, DB> {
    /// Counts `n` statements sent.
    pub fn count_queries(&self, n: u64) {
        self.queries.fetch_add(n, Ordering::Relaxed);
    }

    /// Sets the gauge `name` to `value`, with the relay's labels (not at all for a tenant
    /// past the labelled ones).
    pub fn gauge(&self, name: &'static str, value: f64) {
        if let Some(labels) = self.labels {
            metrics::gauge!(name, labels.iter()).set(value);
        }
    }
}

/// A database whose relays can serve many outboxes (tenants) from one process
/// (`relay::Tenants`): the tenants of one database share a hub, which holds a bounded set
/// of connections, handed out in turn (first come, first served), and one control
/// connection that listens for every tenant's commits. A tenant holds a connection only
/// while it works; one with nothing to do is *parked* and costs no connection.
pub trait Shared: Source {
    /// What the tenants of one database share.
    type Hub: Send + Sync + 'static;

    /// Connects the hub of the database `pool` points at: up to `connections` session
    /// connections, and the control connection.
    fn hub(
        pool: &sqlx::Pool<Self>,
        config: &RelayConfig,
        connections: u32,
    ) -> impl Future<Output = SessionResult<Self::Hub>> + Send;

    /// Registers the outbox `tables` with the hub; returns its wake-up, notified when a
    /// commit of this outbox may have rows for a parked tenant (and for every tenant after
    /// the control connection was lost and is back).
    fn join(
        hub: &Self::Hub,
        tables: &Tables,
    ) -> impl Future<Output = SessionResult<std::sync::Arc<tokio::sync::Notify>>> + Send;

    /// Unregisters the outbox `tables`, whose tenant has stopped: its commits no longer
    /// wake anything.
    fn leave<'a>(hub: &'a Self::Hub, tables: &'a Tables) -> impl Future<Output = ()> + Send + 'a;

    /// Waits for a connection of the hub (in turn with the other tenants), then opens a
    /// session of the outbox `cx.tables` on it.
    fn open_shared<'a>(
        hub: &'a Self::Hub,
        cx: Context<'a, Self>,
        wake: std::sync::Arc<tokio::sync::Notify>,
    ) -> impl Future<Output = SessionResult<Self::Session<'a>>> + Send + 'a;

    /// The name of the database `pool` points at (a tenant's label with several).
    fn database_name(pool: &sqlx::Pool<Self>) -> String;

    /// Runs a discovery query: the outbox tables' names, one per row, in its first
    /// column.
    fn discover<'a>(
        pool: &'a sqlx::Pool<Self>,
        query: &'a str,
    ) -> impl Future<Output = SessionResult<Vec<String>>> + Send + 'a;

    /// Whether a tenant waits for a connection: a working tenant then yields at the end
    /// of its turn.
    fn contended(hub: &Self::Hub) -> bool;

    /// Ends a session whose tenant has nothing to do: its commits go on waking it through
    /// the hub (none is missed between the session's last claim and this), and its
    /// connection goes back to the hub.
    fn park<'a>(
        hub: &'a Self::Hub,
        session: Self::Session<'a>,
    ) -> impl Future<Output = SessionResult<()>> + Send + 'a;
}

/// A database that relays can read from.
pub trait Source: sqlx::Database {
    /// The relay's default `poll_interval` on this database.
    const POLL_INTERVAL: Duration;

    /// One session: a connection (or more) owned by one relay.
    type Session<'a>: Session + 'a;

    /// Connects and registers a session.
    fn open<'a>(
        cx: Context<'a, Self>,
    ) -> impl Future<Output = SessionResult<Self::Session<'a>>> + Send + 'a;
}

/// What a probe found, for the gauges and the loop's schedule.
#[derive(Debug, Clone, Copy, Default)]
pub struct Probe {
    /// Pending rows (`outbox_pending`).
    pub pending: i64,
    /// Age of the oldest pending row in seconds (`outbox_oldest_pending_age_seconds`).
    pub oldest_age_seconds: f64,
    /// Rows that could be claimed now, if the probe knows: `Some(0)` lets the loop skip
    /// the claim and wait.
    pub due: Option<i64>,
    /// When the next row waiting for a retry comes due, if the probe knows.
    pub next_due_in: Option<Duration>,
}

/// One relay session. The loop calls, in each round: [`probe`](Self::probe) when its
/// interval is up, [`own`](Self::own), then claims and records batches until nothing is
/// claimable, then [`wait`](Self::wait)s.
pub trait Session: Send {
    /// Counts for the gauges; `None` when this session did not probe (it is not the
    /// active relay).
    fn probe(&mut self) -> impl Future<Output = SessionResult<Option<Probe>>> + Send;

    /// How often the loop probes.
    fn probe_interval(&self) -> Duration;

    /// Whether this session may publish now; takes or gives back its share of the work
    /// when that is due.
    fn own(&mut self) -> impl Future<Output = SessionResult<bool>> + Send;

    /// Waits for new work, `until`, or shutdown, whichever comes first (a session that
    /// cannot be told about new work returns after its poll interval).
    fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
    ) -> impl Future<Output = SessionResult<()>> + Send;

    /// The keys with a pending row waiting for a retry.
    fn retrying_keys(&mut self) -> impl Future<Output = SessionResult<Vec<String>>> + Send;

    /// The oldest claimable rows in position order (after `after`, when a batch before
    /// them is in flight), at most `batch_size` and `max_batch_bytes` (plus one row).
    fn claim(
        &mut self,
        after: Option<i64>,
    ) -> impl Future<Output = SessionResult<Vec<OutboxRecord>>> + Send;

    /// Records `outcome.sent` as acknowledged (marked sent or deleted, per `on_sent`).
    fn acknowledge(&mut self, outcome: &Outcome) -> impl Future<Output = SessionResult<()>> + Send;

    /// Records `outcome` ([`acknowledge`](Self::acknowledge), then [`fail`](Self::fail))
    /// and [`claim`](Self::claim)s the batch after `after`; returns how many rows died,
    /// and the batch. A session with a connection of its own for marks (PostgreSQL) marks
    /// while it claims; by default each step waits for the one before.
    fn record_and_claim(
        &mut self,
        outcome: &Outcome,
        after: Option<i64>,
    ) -> impl Future<Output = SessionResult<(u64, Vec<OutboxRecord>)>> + Send {
        async move {
            let dead = self.record(outcome).await?;
            Ok((dead, self.claim(after).await?))
        }
    }

    /// Records `outcome`: [`acknowledge`](Self::acknowledge)s its sent rows, then
    /// [`fail`](Self::fail)s its failed ones (each only if there are any); returns how
    /// many rows died.
    fn record(&mut self, outcome: &Outcome) -> impl Future<Output = SessionResult<u64>> + Send {
        async move {
            if !outcome.sent.is_empty() {
                self.acknowledge(outcome).await?;
            }
            if outcome.failed_seq.is_empty() {
                return Ok(0);
            }
            self.fail(outcome).await
        }
    }

    /// Reschedules the failed rows with backoff or dead-letters them; returns how many
    /// died.
    fn fail(&mut self, outcome: &Outcome) -> impl Future<Output = SessionResult<u64>> + Send;

    /// Ends the session cleanly, handing its work over at once.
    fn close(self) -> impl Future<Output = ()> + Send;

    /// Whether this session has declared itself idle and claimed since, finding nothing,
    /// so that its next [`wait`](Self::wait) would wait for a commit only (nothing it
    /// knows of will need a look sooner). A tenant of a shared relay parks then instead.
    fn idle(&self) -> bool {
        false
    }
}

/// What happened to one batch, ready to be written back.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Positions acknowledged by the broker.
    pub sent: Vec<i64>,
    /// Positions that failed.
    pub failed_seq: Vec<i64>,
    /// `attempts` of each failed row when it was claimed.
    pub failed_attempts: Vec<i32>,
    /// Each failure's message.
    pub failed_error: Vec<String>,
    /// Whether each failure is permanent (dead-letter at once).
    pub failed_permanent: Vec<bool>,
    /// Whether each failure says nothing about its message (the broker was unavailable):
    /// such a row keeps its `attempts`, is never dead-lettered for it, and is due again
    /// after [`unavailable_delay`](Self::unavailable_delay).
    pub failed_unavailable: Vec<bool>,
    /// The relay's outage backoff: when rows that failed as unavailable are due again.
    pub unavailable_delay: Duration,
    /// Keys with a failed or unattempted message in this batch.
    pub failed_keys: HashSet<String>,
    /// The largest position such that every message of the batch at or below it was
    /// acknowledged or failed (none was left unattempted behind a failure of its key).
    /// `None` if the batch's first message was left unattempted.
    pub settled_through: Option<i64>,
}
