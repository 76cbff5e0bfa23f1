//! The relay: publishes pending outbox rows to a [`Publisher`], in order, and marks them
//! sent.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//!
//! use outbox_core::publisher::InMemoryPublisher;
//! use outbox_core::relay::Relay;
//! use outbox_core::{Outbox, OutboxMessage};
//!
//! # let dir = std::env::temp_dir().join(format!("outbox-doc-relay-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir)?;
//! # let path = dir.join("app.db");
//! # let path = path.to_str().ok_or("path")?;
//! let outbox = Outbox::<outbox_core::sqlx::Sqlite>::open(path).await?;
//! outbox.migrate().await?;
//! let mut tx = outbox.begin().await?;
//! tx.emit_message(OutboxMessage::new("OrderPlaced", "orders", r#"{"id":7}"#).with_key("7"))?;
//! tx.commit().await?;
//!
//! let publisher = InMemoryPublisher::new();
//! let relay = Relay::builder(outbox, publisher.clone()).batch_size(500).spawn();
//! assert!(publisher.wait_for(1, Duration::from_secs(10)).await, "published");
//! assert_eq!(publisher.published()[0].event_type, "OrderPlaced");
//! // ... on shutdown:
//! relay.shutdown().await;
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(()) }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! # How it works
//! One loop (`run.rs`) and one drain (`drain.rs`) serve every database; what differs
//! (claiming, recording, waking up, who may publish) is the database's session (see
//! `store::session`), described per database in [`docs/databases.md`](https://github.com/outbox-rs/outbox/blob/main/docs/databases.md). On PostgreSQL:
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::Outbox;
use crate::backoff::Backoff;
pub use crate::config::{OnDeadLetter, OnSent, RelayConfig};
use crate::publisher::Publisher;
use crate::store::Backend;
use crate::store::session::Source;
use crate::task::TaskHandle;

/// The label of what is past a bound on label values: the tenants past
/// [`TenantsBuilder::labelled_tenants`], the destinations past
/// [`RelayBuilder::labelled_destinations`].
const OTHER: &str = "other";

/// The destinations a relay (or the tenants of one [`Tenants`] relay) labels its metrics
/// with: the first `limit` it publishes to, then [`OTHER`].
#[derive(Debug)]
struct Destinations {
    limit: usize,
    labelled: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Destinations {
    fn new(limit: usize) -> Arc<Destinations> {
        Arc::new(Destinations {
            limit,
            labelled: std::sync::Mutex::default(),
        })
    }

    /// `destination`'s label value.
    fn label(&self, destination: &str) -> String {
        let mut labelled = self.labelled.lock().unwrap_or_else(|p| p.into_inner());
        if labelled.contains(destination) {
            return destination.to_owned();
        }
        if labelled.len() < self.limit {
            labelled.insert(destination.to_owned());
            return destination.to_owned();
        }
        OTHER.to_owned()
    }
}

/// How many destinations get a label of their own by default.
const LABELLED_DESTINATIONS: usize = 32;

/// The relay's counters labelled by destination.
const DESTINATION_COUNTERS: &[&str] = &[
    "outbox_published_total",
    "outbox_failed_total",
    "outbox_dead_lettered_total",
];

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
    /// A database session is open (the relay works, or stands by for its slot or its
    /// partitions).
    connected: std::sync::atomic::AtomicBool,
    /// The last batch found the broker unavailable, and none published since.
    broker_unavailable: std::sync::atomic::AtomicBool,
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
    /// A database session is open: the relay publishes, or stands by (WAL mode: another
    /// relay streams the slot; partitions: others own them all). False while it
    /// connects or reconnects. (For a readiness probe, with `broker_unavailable`.)
    pub connected: bool,
    /// The broker did not answer the last batch, and nothing was published since.
    pub broker_unavailable: bool,
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
            connected: self.connected.load(Ordering::Relaxed),
            broker_unavailable: self.broker_unavailable.load(Ordering::Relaxed),
        }
    }

    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Configures a relay. Start with [`Relay::builder`].
#[must_use = "a builder does nothing until it is built or spawned"]
pub struct RelayBuilder<
    P,
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    outbox: Outbox<DB>,
    publisher: P,
    config: RelayConfig,
    metrics: Metrics,
}

/// How a relay labels its metrics, and whether it reports its gauges.
#[derive(Debug, Clone)]
struct Metrics {
    /// Set with `metric_label`, then (at `build`) `outbox` and `database` unless set.
    labels: Vec<metrics::Label>,
    gauges: bool,
    /// Whether `build` adds the `outbox` and `database` labels (a tenant has `tenant`).
    outbox_labels: bool,
    destinations: Arc<Destinations>,
    /// The destination labels whose counters this relay started at 0 (its own: a
    /// tenant's series differ from another tenant's by their `tenant` label).
    started: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            labels: Vec::new(),
            gauges: true,
            outbox_labels: true,
            destinations: Destinations::new(LABELLED_DESTINATIONS),
            started: Arc::default(),
        }
    }
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
    setters! { config:
        /// Rows per batch (at least 1).
        batch_size(n: usize) => n.max(1);
        /// The most payload and header bytes per batch (at least 1; a message larger than
        /// this goes in a batch of its own). See [`RelayConfig::max_batch_bytes`].
        max_batch_bytes(n: usize) => n.max(1);
        /// WAL mode: the most payload and header bytes held in memory between the slot and
        /// the broker. See [`RelayConfig::wal_buffer_bytes`].
        wal_buffer_bytes(n: usize) => n.max(1);
        /// Once caught up, how many batches may be with the publisher at once (1 to 4; the
        /// publisher's own limit applies too). See [`RelayConfig::batches_in_flight`].
        batches_in_flight(n: usize) => n.clamp(1, 4);
        /// Safety poll interval.
        poll_interval(d: Duration);
        /// Failed attempts before dead-lettering (at least 1).
        max_attempts(n: i32) => n.max(1);
        /// Number of partitions (at least 1; the same for every relay of this outbox: on
        /// PostgreSQL a relay configured differently from the running ones stands by, with an
        /// error in the log, until they are gone).
        partitions(n: u16) => n.max(1);
        /// Publish timeout per batch.
        publish_timeout(d: Duration);
        /// How long the relay may publish nothing while rows are due before it warns
        /// ([`RelayConfig::stall_warning`], default 60 s).
        stall_warning(after: Duration) => after.max(Duration::from_millis(100));
        /// Mark or delete acknowledged rows.
        on_sent(on_sent: OnSent);
        /// Whether a key's later messages wait for its dead letter (the default) or go on.
        on_dead_letter(on_dead_letter: OnDeadLetter);
        /// Longest wait between reconnection attempts.
        reconnect_delay(d: Duration);
        /// How long a relay that stopped answering keeps its work. See
        /// [`RelayConfig::session_timeout`].
        session_timeout(d: Duration);
        /// How long opening (or closing) a database session may take. See
        /// [`RelayConfig::connect_timeout`].
        connect_timeout(d: Duration);
        /// How often a busy relay re-checks the partition share.
        rebalance_interval(d: Duration);
        /// `application_name` of the relay's sessions, to find them in `pg_stat_activity`.
        application_name(name: impl Into<String>) => name.into();
    }
    /// Retry backoff: first delay and cap.
    /// Both are capped at 7 days (a longer wait is a dead letter by another name).
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);
        self.config.backoff_base = base.min(WEEK);
        self.config.backoff_cap = cap.max(base).min(WEEK);
        self
    }
    /// Replaces the whole configuration.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }
    /// Adds the label `key = value` to every metric this relay reports. Every relay
    /// labels its metrics with `outbox` (the outbox table, as configured) and `database`
    /// (the database's name), so that two relays in one process (two tables, or two
    /// databases) keep apart; set either here to replace it (a relay of many outboxes,
    /// [`Tenants`], labels each tenant's with `tenant` instead).
    pub fn metric_label(mut self, key: &'static str, value: impl Into<String>) -> Self {
        self.metrics.labels.retain(|l| l.key() != key);
        self.metrics
            .labels
            .push(metrics::Label::new(key, value.into()));
        self
    }
    /// How many destinations get a `destination` label of their own on the metrics that
    /// have it (`outbox_published_total`, `outbox_failed_total`,
    /// `outbox_dead_lettered_total`, `outbox_time_in_outbox_seconds`): the first `n` the
    /// relay publishes to (default 32); the rest share `destination="other"`, so that a
    /// destination per customer cannot grow the series without bound.
    pub fn labelled_destinations(mut self, n: usize) -> Self {
        self.metrics.destinations = Destinations::new(n);
        self
    }
    /// A tenant's metrics: `tenant` instead of `outbox` and `database`, and the
    /// destination labels shared with the other tenants.
    fn tenant_metrics(mut self, destinations: &Arc<Destinations>) -> Self {
        self.metrics.outbox_labels = false;
        self.metrics.destinations = Arc::clone(destinations);
        self
    }
    /// Whether the relay reports its gauges (`outbox_pending`,
    /// `outbox_oldest_pending_age_seconds`, ...; default `true`). Turn them off for relays
    /// that share their labels: each would overwrite the others' values. Counters and
    /// histograms add up and are always reported.
    pub fn gauges(mut self, report: bool) -> Self {
        self.metrics.gauges = report;
        self
    }

    /// The relay, to run in a task of your own with [`Relay::run`].
    ///
    /// Logs an error if `publish_timeout` is shorter than what the publisher says one
    /// batch can take ([`Publisher::max_publish_time`]).
    pub fn build(self) -> Relay<P, DB> {
        if let Some(bound) = self.publisher.max_publish_time()
            && bound > self.config.publish_timeout
        {
            tracing::error!(
                publish_timeout = ?self.config.publish_timeout,
                publisher_bound = ?bound,
                "outbox relay: publish_timeout is shorter than one batch can take with this \
                 publisher's timeouts; the relay may give up on a batch the broker stores later. \
                 Raise publish_timeout or lower the publisher's timeouts"
            );
        }
        let outage = drain::outage_backoff_for(&self.config);
        let mut metrics = self.metrics;
        if metrics.outbox_labels {
            for (key, value) in [
                ("outbox", self.outbox.tables().outbox.to_string()),
                (
                    "database",
                    <DB as crate::store::Database>::database_name(self.outbox.pool()),
                ),
            ] {
                if !metrics.labels.iter().any(|l| l.key() == key) {
                    metrics.labels.push(metrics::Label::new(key, value));
                }
            }
        }
        Relay {
            outbox: self.outbox,
            publisher: self.publisher,
            config: self.config,
            stats: Arc::new(RelayStats::default()),
            outage: std::sync::Mutex::new(outage),
            metrics,
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
pub struct Relay<
    P,
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    outbox: Outbox<DB>,
    publisher: P,
    config: RelayConfig,
    stats: Arc<RelayStats>,
    /// The outage backoff: a step for each batch in a row with failures of an
    /// unavailable broker, afresh once a batch publishes without them.
    outage: std::sync::Mutex<Backoff>,
    /// Its metrics' labels, and whether it reports its gauges.
    metrics: Metrics,
}

impl<P, DB: Backend> Relay<P, DB> {
    fn counter(&self, name: &'static str) -> metrics::Counter {
        metrics::counter!(name, self.metrics.labels.iter())
    }
    fn histogram(&self, name: &'static str) -> metrics::Histogram {
        metrics::histogram!(name, self.metrics.labels.iter())
    }
    /// The labels, and `destination` (bounded: [`RelayBuilder::labelled_destinations`]).
    /// A destination's first use starts its counters at 0, so that its first dead letter
    /// shows in `increase()` (a series that first appears at 1 shows no increase).
    fn labels_to(&self, destination: &str) -> Vec<metrics::Label> {
        let mut labels = self.metrics.labels.clone();
        let label = self.metrics.destinations.label(destination);
        let new = self
            .metrics
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(label.clone());
        labels.push(metrics::Label::new("destination", label));
        if new {
            for counter in DESTINATION_COUNTERS {
                metrics::counter!(*counter, labels.iter()).increment(0);
            }
        }
        labels
    }
    /// Starts the counters of the destinations of this binary's event types (the
    /// catalog) at 0, so that `increase()` sees their first dead letter.
    fn start_counters(&self) {
        let destinations: std::collections::BTreeSet<&str> = crate::catalog::entries()
            .into_iter()
            .map(|e| e.destination.as_str())
            .collect();
        for destination in destinations {
            self.labels_to(destination);
        }
    }
    fn counter_to(&self, name: &'static str, destination: &str) -> metrics::Counter {
        metrics::counter!(name, self.labels_to(destination))
    }
    fn histogram_to(&self, name: &'static str, destination: &str) -> metrics::Histogram {
        metrics::histogram!(name, self.labels_to(destination))
    }
    fn gauge(&self, name: &'static str, value: f64) {
        if self.metrics.gauges {
            metrics::gauge!(name, self.metrics.labels.iter()).set(value);
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

impl<DB: Backend> Relay<(), DB> {
    /// Starts configuring a relay from `outbox` to `publisher`, with the defaults of the
    /// outbox's database (the poll interval differs, see [`RelayConfig::poll_interval`]).
    pub fn builder<P: Publisher>(outbox: Outbox<DB>, publisher: P) -> RelayBuilder<P, DB> {
        RelayBuilder {
            outbox,
            publisher,
            config: RelayConfig {
                poll_interval: <DB as Source>::POLL_INTERVAL,
                ..RelayConfig::default()
            },
            metrics: Metrics::default(),
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
#[must_use = "dropping the handle detaches the relay: it runs until the runtime ends, and cannot be stopped gracefully; keep it and call `shutdown`"]
pub struct RelayHandle {
    task: TaskHandle,
    stats: Arc<RelayStats>,
}

impl RelayHandle {
    controls_task! {
        /// Asks the relay to stop after its current batch and waits until it has: within
        /// `publish_timeout + connect_timeout` in every state, also while it connects or
        /// waits on a database that stopped answering (what it had not recorded then is
        /// published again by the next relay).
        ///
        /// It returns nothing, where [`ConsumerHandle::shutdown`] returns a `Result`: a
        /// relay has no way to end in error (a database or broker outage, a failing
        /// message: each is retried, logged and counted in [`RelayHandle::stats`], the
        /// metrics and `outbox status`), while a consumer can stop by itself, on
        /// `Policy::Stop` or a fatal error, and says which.
        ///
        /// [`ConsumerHandle::shutdown`]: crate::consumer::ConsumerHandle::shutdown
        shutdown;
        /// Stops the relay at once, wherever it is (as a crash would): a batch in flight
        /// is published again by the next relay.
        abort;
        /// Whether the relay task has ended.
        is_finished;
    }

    /// The relay's counters.
    pub fn stats(&self) -> RelayStatsSnapshot {
        self.stats.snapshot()
    }

    /// A reader of the relay's counters that outlives the handle: for a health endpoint
    /// that answers while [`shutdown`](Self::shutdown) has the handle.
    pub fn stats_source(&self) -> impl Fn() -> RelayStatsSnapshot + Send + Sync + 'static {
        let stats = Arc::clone(&self.stats);
        move || stats.snapshot()
    }
}
