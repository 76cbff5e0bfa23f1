//! The relay: publishes pending outbox rows to a [`Publisher`], in order, and marks them
//! sent.
//!
//! ```no_run
//! # async fn demo(outbox: outbox_core::Outbox) {
//! use outbox_core::publisher::InMemoryPublisher;
//! use outbox_core::relay::Relay;
//!
//! let publisher = InMemoryPublisher::new();
//! let relay = Relay::builder(outbox, publisher.clone()).batch_size(500).spawn();
//! // ... later, on shutdown:
//! relay.shutdown().await;
//! # }
//! ```
//!
//! # How it works
//! One loop (`run.rs`) and one drain (`drain.rs`) serve every database; what differs
//! (claiming, recording, waking up, who may publish) is the database's session (see
//! `store::session`), described per database in `docs/databases.md`. On PostgreSQL:
//!
//! Each cycle the relay claims up to `batch_size` pending rows in `seq` order, hands the
//! whole batch to the publisher (which has it all in flight at once), and marks the
//! acknowledged rows sent in one statement (or deletes them, see [`OnSent`]).
//!
//! - **Wake-up**: `LISTEN` on the outbox channel (writers notify at commit), plus a
//!   safety poll every `poll_interval` that costs one query while idle.
//! - **Order**: rows with the same partition key are published in `seq` order. Rows are
//!   only claimed below the *publish horizon* (see `db/postgres/horizon.rs`), so a transaction that
//!   drew a smaller `seq` but commits later is never overtaken.
//! - **Several relays**: rows are spread over `partitions` by key; each relay holds the
//!   partitions it publishes through PostgreSQL advisory locks on its own connection, and
//!   relays share partitions evenly. A relay that dies loses its connection and with it
//!   its partitions, which the others take over; it cannot mark anything after that,
//!   because claims and marks go through that same connection.
//! - **Failures**: a failed message gets `attempts + 1`, `last_error`, and a
//!   `next_attempt_at` with exponential backoff and jitter; after `max_attempts` (or at
//!   once for a [permanent](crate::publisher::PublishError::permanent) error) it is
//!   dead-lettered (`dead_at`). A failure that says nothing about the message — the
//!   broker [unavailable](crate::publisher::PublishError::unavailable), a publish
//!   timeout, every message of a batch failing the same way — counts no attempt and
//!   never dead-letters: the rows get `last_error` and wait out the relay's outage
//!   backoff (`backoff_base` doubling up to `backoff_cap`, at most 2 s) for as long as it lasts. While a message waits for its retry, the later messages
//!   of **its key** wait behind it; other keys flow on. A dead-lettered message no longer
//!   blocks its key.
//! - **Delivery** is at-least-once: a crash between the broker's ack and the mark
//!   publishes that batch again.

mod drain;
mod run;
mod tenants;

pub use tenants::{Tenants, TenantsBuilder, TenantsHandle};

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::Outbox;
pub use crate::config::{OnDeadLetter, OnSent, RelayConfig};
use crate::publisher::Publisher;
use crate::store::session::Source;
use crate::store::{Backend, DefaultBackend};
use crate::task::TaskHandle;

/// Counters of what a relay did, readable while it runs ([`RelayHandle::stats`]).
#[derive(Debug, Default)]
pub struct RelayStats {
    queries: AtomicU64,
    unavailable: AtomicU64,
    batches: AtomicU64,
    published: AtomicU64,
    failed: AtomicU64,
    dead: AtomicU64,
    reconnects: AtomicU64,
}

/// A copy of [`RelayStats`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RelayStatsSnapshot {
    /// SQL statements sent to the database.
    pub queries: u64,
    /// Batches handed to the publisher.
    pub batches: u64,
    /// Messages acknowledged and marked.
    pub published: u64,
    /// Failed publish attempts (including those that dead-lettered a message).
    pub failed: u64,
    /// Messages dead-lettered.
    pub dead: u64,
    /// Database sessions re-established after an error.
    pub reconnects: u64,
    /// Failed publish attempts that said nothing about the message (the broker was
    /// unavailable or did not answer in time): retried, never counted towards
    /// `max_attempts`. Included in `failed`.
    pub unavailable: u64,
}

impl RelayStats {
    /// The current values.
    pub fn snapshot(&self) -> RelayStatsSnapshot {
        RelayStatsSnapshot {
            queries: self.queries.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            published: self.published.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            unavailable: self.unavailable.load(Ordering::Relaxed),
        }
    }

    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Configures a relay. Start with [`Relay::builder`].
pub struct RelayBuilder<P, DB: Backend = DefaultBackend> {
    outbox: Outbox<DB>,
    publisher: P,
    config: RelayConfig,
}

impl<P, DB: Backend> fmt::Debug for RelayBuilder<P, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("outbox", &self.outbox)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<P: Publisher, DB: Backend> RelayBuilder<P, DB> {
    /// Rows per batch (at least 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.config.batch_size = n.max(1);
        self
    }
    /// The most payload and header bytes per batch (at least 1; a message larger than
    /// this goes in a batch of its own). See [`RelayConfig::max_batch_bytes`].
    pub fn max_batch_bytes(mut self, n: usize) -> Self {
        self.config.max_batch_bytes = n.max(1);
        self
    }
    /// WAL mode: the most payload and header bytes held in memory between the slot and
    /// the broker. See [`RelayConfig::wal_buffer_bytes`].
    pub fn wal_buffer_bytes(mut self, n: usize) -> Self {
        self.config.wal_buffer_bytes = n.max(1);
        self
    }
    /// Once caught up, how many batches may be with the publisher at once (1 to 4; the
    /// publisher's own limit applies too). See [`RelayConfig::batches_in_flight`].
    pub fn batches_in_flight(mut self, n: usize) -> Self {
        self.config.batches_in_flight = n.clamp(1, 4);
        self
    }
    /// Safety poll interval.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.config.poll_interval = d;
        self
    }
    /// Failed attempts before dead-lettering (at least 1).
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.config.max_attempts = n.max(1);
        self
    }
    /// Retry backoff: first delay and cap.
    /// Both are capped at 7 days (a longer wait is a dead letter by another name).
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);
        self.config.backoff_base = base.min(WEEK);
        self.config.backoff_cap = cap.max(base).min(WEEK);
        self
    }
    /// Number of partitions (at least 1; the same for every relay of this outbox: on
    /// PostgreSQL a relay configured differently from the running ones stands by, with an
    /// error in the log, until they are gone).
    pub fn partitions(mut self, n: u16) -> Self {
        self.config.partitions = n.max(1);
        self
    }
    /// Publish timeout per batch.
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.config.publish_timeout = d;
        self
    }
    /// How long the relay may publish nothing while rows are due before it warns
    /// ([`RelayConfig::stall_warning`], default 60 s).
    pub fn stall_warning(mut self, after: Duration) -> Self {
        self.config.stall_warning = after.max(Duration::from_millis(100));
        self
    }
    /// Mark or delete acknowledged rows.
    pub fn on_sent(mut self, on_sent: OnSent) -> Self {
        self.config.on_sent = on_sent;
        self
    }
    /// Whether a key's later messages wait for its dead letter (the default) or go on.
    pub fn on_dead_letter(mut self, on_dead_letter: OnDeadLetter) -> Self {
        self.config.on_dead_letter = on_dead_letter;
        self
    }
    /// Longest wait between reconnection attempts.
    pub fn reconnect_delay(mut self, d: Duration) -> Self {
        self.config.reconnect_delay = d;
        self
    }
    /// How long a relay that stopped answering keeps its work. See
    /// [`RelayConfig::session_timeout`].
    pub fn session_timeout(mut self, d: Duration) -> Self {
        self.config.session_timeout = d;
        self
    }
    /// How long opening (or closing) a database session may take. See
    /// [`RelayConfig::connect_timeout`].
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.config.connect_timeout = d;
        self
    }
    /// How often a busy relay re-checks the partition share.
    pub fn rebalance_interval(mut self, d: Duration) -> Self {
        self.config.rebalance_interval = d;
        self
    }
    /// `application_name` of the relay's sessions, to find them in `pg_stat_activity`.
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.config.application_name = name.into();
        self
    }
    /// Replaces the whole configuration.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// The relay, to run in a task of your own with [`Relay::run`].
    ///
    /// Logs an error if `publish_timeout` is shorter than what the publisher says one
    /// batch can take ([`Publisher::max_publish_time`]).
    pub fn build(self) -> Relay<P, DB> {
        if let Some(bound) = self.publisher.max_publish_time() {
            if bound > self.config.publish_timeout {
                tracing::error!(
                    publish_timeout = ?self.config.publish_timeout,
                    publisher_bound = ?bound,
                    "outbox relay: publish_timeout is shorter than one batch can take with this \
                     publisher's timeouts; the relay may give up on a batch the broker stores later. \
                     Raise publish_timeout or lower the publisher's timeouts"
                );
            }
        }
        Relay {
            outbox: self.outbox,
            publisher: self.publisher,
            config: self.config,
            stats: Arc::new(RelayStats::default()),
            outage_rounds: AtomicU32::new(0),
            labels: Vec::new(),
            gauges: true,
            turn: None,
        }
    }

    /// Starts the relay on the current tokio runtime.
    pub fn spawn(self) -> RelayHandle {
        let relay = self.build();
        let stats = Arc::clone(&relay.stats);
        RelayHandle {
            task: TaskHandle::spawn(|shutdown| relay.run(shutdown)),
            stats,
        }
    }
}

/// A relay between one outbox and one publisher.
pub struct Relay<P, DB: Backend = DefaultBackend> {
    outbox: Outbox<DB>,
    publisher: P,
    config: RelayConfig,
    stats: Arc<RelayStats>,
    /// Batches in a row with failures of an unavailable broker (the outage backoff).
    outage_rounds: AtomicU32,
    /// The labels of its metrics: `tenant` in a relay of many outboxes ([`Tenants`]).
    labels: Vec<metrics::Label>,
    /// Whether its gauges are reported (not for tenants past the labelled ones).
    gauges: bool,
    /// A tenant's turn: its drain stops prefetching after this long.
    turn: Option<Duration>,
}

impl<P, DB: Backend> Relay<P, DB> {
    fn counter(&self, name: &'static str) -> metrics::Counter {
        metrics::counter!(name, self.labels.iter())
    }
    fn histogram(&self, name: &'static str) -> metrics::Histogram {
        metrics::histogram!(name, self.labels.iter())
    }
    fn gauge(&self, name: &'static str, value: f64) {
        if self.gauges {
            metrics::gauge!(name, self.labels.iter()).set(value);
        }
    }
}

impl<P, DB: Backend> fmt::Debug for Relay<P, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.outbox)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Relay<()> {
    /// Starts configuring a relay from `outbox` to `publisher`, with the defaults of the
    /// outbox's database (the poll interval differs, see [`RelayConfig::poll_interval`]).
    pub fn builder<P: Publisher, DB: Backend>(
        outbox: Outbox<DB>,
        publisher: P,
    ) -> RelayBuilder<P, DB> {
        RelayBuilder {
            outbox,
            publisher,
            config: RelayConfig {
                poll_interval: <DB as Source>::POLL_INTERVAL,
                ..RelayConfig::default()
            },
        }
    }
}

impl<P: Publisher, DB: Backend> Relay<P, DB> {
    /// The relay's counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        Arc::clone(&self.stats)
    }
}

/// Controls a spawned relay.
#[derive(Debug)]
pub struct RelayHandle {
    task: TaskHandle,
    stats: Arc<RelayStats>,
}

impl RelayHandle {
    /// Asks the relay to stop after its current batch and waits until it has: within
    /// `publish_timeout + connect_timeout` in every state, also while it connects or waits
    /// on a database that stopped answering (what it had not recorded then is published
    /// again by the next relay).
    pub async fn shutdown(self) {
        self.task.shutdown().await;
    }

    /// Stops the relay at once, wherever it is (as a crash would): a batch in flight
    /// is published again by the next relay.
    pub fn abort(&self) {
        self.task.abort();
    }

    /// Whether the relay task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// The relay's counters.
    pub fn stats(&self) -> RelayStatsSnapshot {
        self.stats.snapshot()
    }
}
