//! The relay's contract with a database: a [`Source`] opens [`Session`]s, and the one
//! relay loop (`relay/run.rs`) drives any of them. A session claims batches, records
//! what the broker acknowledged and what failed, says whether it may publish now, and
//! waits for work. The loop never names a database; a database never names the loop.
//!
//! Progress is recorded per batch ([`Outcome`]): the positions (`seq`) acknowledged,
//! the failures, and [`Outcome::settled_through`], the position up to which everything
//! in the batch is settled. A table session marks the acknowledged rows; a session that
//! confirms "everything up to position P" (a WAL LSN) confirms `settled_through`.

use std::borrow::Cow;
use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::{RelayConfig, Tables};
use crate::publisher::OutboxRecord;

/// Why a relay session ended. The relay logs it, waits (with backoff) and opens a new one;
/// a tenant of [`Shared`] does the same on its own (no error ends a tenant: one that
/// could not start is tried again at the next look at the tenant list).
///
/// Each variant says what happened; the message says to what, and what to do:
///
/// | Variant | What happened |
/// |---|---|
/// | [`Database`](Self::Database) | the driver failed, or the connection was lost |
/// | [`TimedOut`](Self::TimedOut) | a step got no answer in time (bounded by `RelayConfig::connect_timeout`) |
/// | [`Closed`](Self::Closed) | something the session works through has closed: the replication stream, the hub's control connection or task |
/// | [`Protocol`](Self::Protocol) | the database sent what the relay cannot read: a WAL message that does not decode, a malformed answer |
/// | [`Refused`](Self::Refused) | the session cannot run as things stand: a configuration conflict, a missing or lost slot, a table without what the relay needs |
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The database failed or the connection was lost.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A step got no answer within its bound, which `RelayConfig::connect_timeout` sets:
    /// opening the session, connecting the hub or the replication stream, a discovery
    /// query, the hub's control connection.
    #[error(
        "no answer within {after:?} from {what} (bounded by RelayConfig::connect_timeout); \
         the relay tries again after its backoff: check that the database is up and \
         reachable, or raise connect_timeout if it is only slow"
    )]
    TimedOut {
        /// What did not answer, and while doing what (`the database while the relay
        /// opened its session`).
        what: Cow<'static, str>,
        /// How long the relay waited.
        after: Duration,
    },
    /// Something the session works through has closed: the replication stream (the
    /// server ended it, the connection broke, or the slot is streamed to another relay
    /// now), the hub's control connection (it is reconnecting) or its control task.
    #[error("{what} has closed{}; the relay tries again after its backoff", Colon(.detail))]
    Closed {
        /// What closed (`the replication stream of slot "outbox"`).
        what: Cow<'static, str>,
        /// Why, if known, and what the relay does meanwhile.
        detail: Option<String>,
    },
    /// The database sent what the relay cannot read: a WAL message that does not decode
    /// (never skipped: the slot keeps it for a relay that can read it), a replication
    /// protocol error, a malformed answer to one of the relay's queries.
    #[error(
        "cannot read {what}: {detail}; the relay skips nothing and tries again after its backoff"
    )]
    Protocol {
        /// What could not be read (`a WAL message of replication slot "outbox"`).
        what: Cow<'static, str>,
        /// What was wrong with it, and what to do.
        detail: String,
    },
    /// The session cannot run as things stand: another relay's configuration conflicts,
    /// the table lacks what the relay needs, no relay slot is free, a WAL-mode outbox
    /// given to a relay of many outboxes, a replication slot that is missing, lost or not
    /// the relay's kind, a server that refuses the replication connection. Says what to
    /// do.
    #[error("{0}")]
    Refused(String),
}

/// `": detail"`, or nothing.
struct Colon<'a>(&'a Option<String>);

impl std::fmt::Display for Colon<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(detail) => write!(f, ": {detail}"),
            None => Ok(()),
        }
    }
}

impl SessionError {
    /// The database says the outbox's tables do not exist: the migrations have not run.
    pub(crate) fn is_schema_missing(&self) -> bool {
        matches!(self, SessionError::Database(e) if crate::error::is_schema_missing(e))
    }

    /// [`SessionError::TimedOut`]: `what` did not answer within `after`.
    pub fn timed_out(what: impl Into<Cow<'static, str>>, after: Duration) -> Self {
        SessionError::TimedOut {
            what: what.into(),
            after,
        }
    }

    /// [`SessionError::Closed`]: `what` has closed, for the reason `detail` if known.
    pub fn closed(what: impl Into<Cow<'static, str>>, detail: Option<String>) -> Self {
        SessionError::Closed {
            what: what.into(),
            detail,
        }
    }

    /// [`SessionError::Protocol`]: `what` cannot be read, because of `detail`.
    pub fn protocol(what: impl Into<Cow<'static, str>>, detail: impl Into<String>) -> Self {
        SessionError::Protocol {
            what: what.into(),
            detail: detail.into(),
        }
    }
}

/// What a session returns.
pub type SessionResult<T> = Result<T, SessionError>;

/// What a session works with: the relay's pool, tables and settings, and the counter of
/// statements it sends (`RelayStats::queries`).
#[derive(Debug)]
pub struct Context<'a, DB: super::Database> {
    /// The outbox's pool (its connect options open the session's own connections).
    pub pool: &'a sqlx::Pool<DB>,
    /// The outbox's tables.
    pub tables: &'a Tables,
    /// The database's own options (PostgreSQL: WAL mode).
    pub options: &'a DB::Options,
    /// The relay's settings.
    pub config: &'a RelayConfig,
    /// Statements sent, for the relay's stats.
    pub queries: &'a AtomicU64,
    /// The labels of the relay's metrics (`tenant`, for a relay of many outboxes; empty
    /// otherwise). `None`: this relay's gauges are not reported (a tenant past the
    /// labelled ones, whose gauges would overwrite each other's under `other`).
    pub labels: Option<&'a [metrics::Label]>,
}

impl<DB: super::Database> Clone for Context<'_, DB> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<DB: super::Database> Copy for Context<'_, DB> {}

impl<DB: super::Database> Context<'_, DB> {
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
        options: &Self::Options,
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
pub trait Source: super::Database {
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
            if outcome.failed.is_empty() {
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
    /// The messages that failed, in batch order. (A database that binds columns, such as
    /// PostgreSQL's `UNNEST`, builds them from these where it binds them.)
    pub failed: Vec<Failure>,
    /// The relay's outage backoff: when rows that failed as unavailable
    /// ([`Failure::unavailable`]) are due again.
    pub unavailable_delay: Duration,
    /// Keys with a failed or unattempted message in this batch.
    pub failed_keys: HashSet<String>,
    /// The largest position such that every message of the batch at or below it was
    /// acknowledged or failed (none was left unattempted behind a failure of its key).
    /// `None` if the batch's first message was left unattempted.
    pub settled_through: Option<i64>,
    /// How many of [`sent`](Self::sent) went to each destination (for the relay's
    /// metrics, labelled by destination).
    pub sent_to: Vec<(String, u64)>,
}

/// One message of a batch that failed to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Failure {
    /// Its position.
    pub seq: i64,
    /// Its `attempts` when it was claimed.
    pub attempts: i32,
    /// The publisher's message.
    pub error: String,
    /// Its destination (for the relay's metrics, labelled by destination).
    pub destination: String,
    /// The failure is permanent: dead-letter it at once.
    pub permanent: bool,
    /// The failure says nothing about the message (the broker was unavailable): it keeps
    /// its `attempts`, is never dead-lettered for it, and is due again after
    /// [`Outcome::unavailable_delay`].
    pub unavailable: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_says_what_happened_and_what_the_relay_does() {
        let timed_out = SessionError::timed_out(
            "the database while the relay opened its session",
            Duration::from_secs(5),
        );
        assert_eq!(
            timed_out.to_string(),
            "no answer within 5s from the database while the relay opened its session \
             (bounded by RelayConfig::connect_timeout); the relay tries again after its \
             backoff: check that the database is up and reachable, or raise connect_timeout \
             if it is only slow"
        );
        let closed = SessionError::closed("the relay's hub", None);
        assert_eq!(
            closed.to_string(),
            "the relay's hub has closed; the relay tries again after its backoff"
        );
        let closed = SessionError::closed(
            "the replication stream of slot \"outbox\"",
            Some("io error: connection reset".to_owned()),
        );
        assert_eq!(
            closed.to_string(),
            "the replication stream of slot \"outbox\" has closed: io error: connection reset; \
             the relay tries again after its backoff"
        );
        let protocol = SessionError::protocol("the horizon sample", "it returned 1 row(s)");
        assert_eq!(
            protocol.to_string(),
            "cannot read the horizon sample: it returned 1 row(s); the relay skips nothing and \
             tries again after its backoff"
        );
        // The cause is in the message, so not also a `source` (printed twice otherwise).
        for e in [timed_out, closed, protocol] {
            assert!(std::error::Error::source(&e).is_none(), "{e}");
        }
    }
}
