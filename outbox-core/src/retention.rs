//! Retention: deletes old sent messages and old processed-message ids, in small batches,
//! while the relay and the writers carry on.
//!
//! ```no_run
//! # async fn demo(outbox: outbox_core::Outbox) -> outbox_core::Result<()> {
//! use std::time::Duration;
//! use outbox_core::retention::Retention;
//!
//! const DAY: Duration = Duration::from_secs(24 * 3600);
//!
//! // Once, e.g. from a nightly job (or `outbox retention` on the command line):
//! let report = Retention::builder(outbox.clone())
//!     .sent_older_than(7 * DAY)
//!     .processed_older_than(30 * DAY)
//!     .build()
//!     .run_once()
//!     .await?;
//! println!("removed {} sent messages", report.sent_deleted);
//!
//! // Or in the background, every hour, next to the relay:
//! let retention = Retention::builder(outbox).sent_older_than(7 * DAY).spawn();
//! // ... on shutdown (a batch in flight is finished first):
//! retention.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # What is deleted
//! - **Sent messages** (`sent_at` set) whose `sent_at` is older than
//!   [`sent_older_than`](RetentionBuilder::sent_older_than).
//! - **Processed ids** whose `processed_at` is older than
//!   [`processed_older_than`](RetentionBuilder::processed_older_than). Keep them longer
//!   than a broker can redeliver a message (its retention), or a late duplicate is
//!   processed twice.
//! - Never pending or dead-lettered messages: dead letters stay until they are released
//!   or purged explicitly (`admin::Admin`, `outbox release`, `outbox purge`).
//!
//! The age cutoffs are taken once per run from the database clock (the clock that set
//! `sent_at`), so one run removes exactly the rows older than the cutoff at its start.
//!
//! # A time-partitioned outbox (PostgreSQL)
//! On an outbox converted with `Outbox::partition_by_time` ([docs/partitions.md](https://github.com/outbox-rs/outbox/blob/main/docs/partitions.md)), each
//! run first creates partitions ahead and drops, whole, every partition older than the
//! sent cutoff that holds no pending or dead-lettered row (under a 2 s lock timeout; a
//! busy one waits for the next run). The row-by-row deletes below then only touch the
//! partitions kept for such rows and the default partition.
//! [`RetentionReport::partitions`] says what happened.
//!
//! # How it stays out of the way
//! Each batch is one short statement in its own transaction. On PostgreSQL it locks up
//! to `batch_size` rows with `FOR UPDATE SKIP LOCKED` (a row someone else holds is left
//! for the next run, never waited for) and deletes them; on MySQL/MariaDB it finds the
//! batch's last `seq` and deletes that range at `READ COMMITTED` (no gap locks that would
//! hold back writers); on SQLite it deletes the range in one short write transaction. Sent rows are walked in `seq` order
//! from where the previous batch stopped, so a run reads the history once. Between
//! batches the task pauses [`batch_pause`](RetentionBuilder::batch_pause). The relay only
//! touches pending rows, which retention never touches, so they do not contend for locks.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tracing::Instrument;

use crate::error::DbContext;
use crate::store::Backend;
use crate::store::ops::ConsumerRows;
use crate::task::{TaskHandle, stopped};
use crate::{Error, Outbox, Result};

moved! {
    #[cfg(feature = "postgres")]
    PartitionReport => postgres, "moved to `outbox_core::postgres::PartitionReport`";
    #[cfg(feature = "postgres")]
    Partitioned => postgres, "moved to `outbox_core::postgres::Partitioned`";
}

/// Retention settings. Every field has a documented default.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RetentionConfig {
    /// Delete sent messages older than this; `None` keeps them. Default 7 days.
    pub sent_older_than: Option<Duration>,
    /// Delete processed-message ids older than this; `None` keeps them. Default 30 days.
    pub processed_older_than: Option<Duration>,
    /// Rows deleted per statement. Default 5000.
    pub batch_size: usize,
    /// Pause between two batches, to leave the database to others. Default 10 ms.
    pub batch_pause: Duration,
    /// Time between two runs of a [spawned](RetentionBuilder::spawn) task. Default 1 h.
    pub interval: Duration,
}

const DAY: Duration = Duration::from_secs(24 * 3600);

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            sent_older_than: Some(7 * DAY),
            processed_older_than: Some(30 * DAY),
            batch_size: 5000,
            batch_pause: Duration::from_millis(10),
            interval: Duration::from_secs(3600),
        }
    }
}

/// What one retention run removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionReport {
    /// Sent messages deleted.
    pub sent_deleted: u64,
    /// Processed-message ids deleted.
    pub processed_deleted: u64,
    /// Sent messages were deleted if `sent_at` was before this (database clock).
    pub sent_cutoff: Option<DateTime<Utc>>,
    /// Processed ids were deleted if `processed_at` was before this (database clock).
    pub processed_cutoff: Option<DateTime<Utc>>,
    /// `DELETE` statements run (each its own transaction).
    pub batches: u64,
    /// The slowest of those statements.
    pub longest_batch: Duration,
    /// The whole run.
    pub elapsed: Duration,
    /// The run stopped early because shutdown was requested.
    pub interrupted: bool,
    /// On a time-partitioned outbox (PostgreSQL): the partitions created, dropped, kept
    /// and left for the next run. `None` for a plain table.
    #[cfg(feature = "postgres")]
    pub partitions: Option<crate::postgres::PartitionReport>,
}

impl fmt::Display for RetentionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "deleted {} sent messages and {} processed ids in {} batches ({:.1?}, slowest batch {:.1?})",
            self.sent_deleted,
            self.processed_deleted,
            self.batches,
            self.elapsed,
            self.longest_batch
        )?;
        #[cfg(feature = "postgres")]
        if let Some(p) = &self.partitions {
            write!(
                f,
                "; partitions: {} dropped, {} created, {} kept for pending or dead rows, {} left for the next run",
                p.dropped.len(),
                p.created.len(),
                p.kept.len(),
                p.busy.len()
            )?;
        }
        if self.interrupted {
            f.write_str("; interrupted by shutdown")?;
        }
        Ok(())
    }
}

/// Configures retention. Start with [`Retention::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until it is built or spawned"]
pub struct RetentionBuilder<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    outbox: Outbox<DB>,
    config: RetentionConfig,
}

impl<DB: Backend> RetentionBuilder<DB> {
    setters! { config:
        /// Delete sent messages once they have been sent for longer than `age`.
        sent_older_than(age: Duration) => Some(age);
        /// Delete processed-message ids recorded longer than `age` ago.
        processed_older_than(age: Duration) => Some(age);
        /// Rows per `DELETE` (at least 1).
        batch_size(n: usize) => n.max(1);
        /// Pause between batches.
        batch_pause(d: Duration);
        /// Time between runs of a spawned task.
        interval(d: Duration);
    }
    /// Never delete sent messages.
    pub fn keep_sent(mut self) -> Self {
        self.config.sent_older_than = None;
        self
    }
    /// Never delete processed-message ids.
    pub fn keep_processed(mut self) -> Self {
        self.config.processed_older_than = None;
        self
    }
    /// Replaces the whole configuration.
    pub fn config(mut self, config: RetentionConfig) -> Self {
        self.config = config;
        self
    }

    /// The retention job, to [run once](Retention::run_once) or [run](Retention::run)
    /// in a task of your own.
    pub fn build(self) -> Retention<DB> {
        Retention {
            outbox: self.outbox,
            config: self.config,
            last: Arc::new(Mutex::new(None)),
        }
    }

    /// Starts the task on the current tokio runtime: a run at once, then one every
    /// [`interval`](Self::interval).
    pub fn spawn(self) -> RetentionHandle {
        let retention = self.build();
        let last = Arc::clone(&retention.last);
        RetentionHandle {
            task: TaskHandle::spawn(|shutdown| retention.run(shutdown)),
            last,
        }
    }
}

/// Deletes old sent messages and processed ids of one outbox. See the [module](self).
pub struct Retention<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    outbox: Outbox<DB>,
    config: RetentionConfig,
    last: Arc<Mutex<Option<RetentionReport>>>,
}

impl<DB: Backend> fmt::Debug for Retention<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retention")
            .field("outbox", &self.outbox)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Which table a batch works on.
#[derive(Clone, Copy)]
enum Kind {
    Sent,
    Processed,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Sent => "sent",
            Kind::Processed => "processed",
        }
    }
}

impl<DB: Backend> Retention<DB> {
    /// Starts configuring retention for `outbox`.
    pub fn builder(outbox: Outbox<DB>) -> RetentionBuilder<DB> {
        RetentionBuilder {
            outbox,
            config: RetentionConfig::default(),
        }
    }

    /// The settings in use.
    pub fn config(&self) -> &RetentionConfig {
        &self.config
    }

    /// One run: deletes everything older than the cutoffs, batch by batch, and says
    /// what it removed. An error stops the run; the batches before it stay deleted
    /// (each is complete in itself) and the next run carries on.
    pub async fn run_once(&self) -> Result<RetentionReport> {
        self.run_once_with_progress(|_| {}).await
    }

    /// [`run_once`](Self::run_once), calling `progress` after each batch with what the
    /// run has done so far (its `elapsed` up to date): for a progress display over
    /// millions of rows.
    pub async fn run_once_with_progress(
        &self,
        mut progress: impl FnMut(&RetentionReport) + Send,
    ) -> Result<RetentionReport> {
        crate::telemetry::describe_metrics();
        let (_tx, mut rx) = watch::channel(false);
        self.run_until(&mut rx, &mut progress).await
    }

    /// Runs at once and then every `interval` until `shutdown` turns `true` (forever if
    /// its sender is dropped). A batch in flight is finished first. Errors are logged and
    /// the next run retries.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        crate::telemetry::describe_metrics();
        loop {
            match self.run_until(&mut shutdown, &mut |_| {}).await {
                Ok(report) => {
                    tracing::info!(
                        sent_deleted = report.sent_deleted,
                        processed_deleted = report.processed_deleted,
                        batches = report.batches,
                        elapsed_ms = report.elapsed.as_millis() as u64,
                        "outbox retention run done"
                    );
                    if let Ok(mut last) = self.last.lock() {
                        *last = Some(report);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %crate::ErrorChain(&e), retry_in = ?self.config.interval, "outbox retention run failed");
                    metrics::counter!("outbox_retention_failures_total").increment(1);
                }
            }
            if *shutdown.borrow() {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(self.config.interval) => {}
                _ = stopped(&mut shutdown) => return,
            }
        }
    }

    async fn run_until(
        &self,
        shutdown: &mut watch::Receiver<bool>,
        progress: &mut (dyn FnMut(&RetentionReport) + Send),
    ) -> Result<RetentionReport> {
        let started = Instant::now();
        let mut report = RetentionReport::default();
        let span = tracing::info_span!("outbox.retention", outbox = %self.outbox.tables().outbox);
        async {
            report.sent_cutoff = self.cutoff(self.config.sent_older_than).await?;
            report.processed_cutoff = self.cutoff(self.config.processed_older_than).await?;
            // A partitioned outbox first gets its partitions ahead and drops the old
            // ones whole; the row-by-row deletes below then skip what remains of them.
            // Its failure (a second retention process racing, a deadlock, a lock that
            // was not free) leaves the partitions for the next run; the deletes go on.
            #[cfg(feature = "postgres")]
            {
                report.partitions = match DB::maintain_partitions(
                    self.outbox.pool(),
                    self.outbox.tables(),
                    report.sent_cutoff,
                )
                .await
                {
                    Ok(partitions) => partitions,
                    Err(e) => {
                        tracing::error!(error = %crate::ErrorChain(&e), "outbox retention could not maintain the outbox's partitions; trying at the next run");
                        metrics::counter!("outbox_retention_failures_total").increment(1);
                        None
                    }
                };
                if let Some(p) = &report.partitions {
                    for name in &p.dropped {
                        tracing::info!(partition = %name, "outbox retention dropped a partition");
                    }
                    for name in &p.created {
                        tracing::info!(partition = %name, "outbox retention created a partition");
                    }
                    for name in &p.busy {
                        tracing::warn!(partition = %name, "outbox retention could not lock the outbox within 2 s to add or drop this partition; trying at the next run");
                    }
                }
            }
            if let Some(cutoff) = report.sent_cutoff {
                let mut after = 0_i64;
                loop {
                    let (n, found, last) =
                        self.batch(Kind::Sent, cutoff, after, &mut report).await?;
                    report.sent_deleted += n;
                    report.elapsed = started.elapsed();
                    progress(&report);
                    after = last.unwrap_or(after);
                    if found < self.batch_len() || self.pause(shutdown, &mut report).await {
                        break;
                    }
                }
            }
            if let Some(cutoff) = report.processed_cutoff.filter(|_| !report.interrupted) {
                loop {
                    let (n, _, _) = self.batch(Kind::Processed, cutoff, 0, &mut report).await?;
                    report.processed_deleted += n;
                    report.elapsed = started.elapsed();
                    progress(&report);
                    if n < self.batch_len() || self.pause(shutdown, &mut report).await {
                        break;
                    }
                }
            }
            Ok::<_, Error>(())
        }
        .instrument(span)
        .await?;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    fn batch_len(&self) -> u64 {
        self.config.batch_size.max(1) as u64
    }

    /// Pauses between batches; `true` if shutdown was requested.
    async fn pause(
        &self,
        shutdown: &mut watch::Receiver<bool>,
        report: &mut RetentionReport,
    ) -> bool {
        if !*shutdown.borrow() {
            tokio::select! {
                _ = tokio::time::sleep(self.config.batch_pause) => {}
                _ = stopped(shutdown) => {}
            }
        }
        report.interrupted = *shutdown.borrow();
        report.interrupted
    }

    async fn cutoff(&self, age: Option<Duration>) -> Result<Option<DateTime<Utc>>> {
        let Some(age) = age else { return Ok(None) };
        DB::clock_minus(self.outbox.pool(), age.as_secs_f64())
            .await
            .map(Some)
            .context("reading the database clock", &self.outbox.tables().outbox)
    }

    /// One `DELETE`; returns the rows deleted and (for sent rows) the largest `seq`.
    async fn batch(
        &self,
        kind: Kind,
        cutoff: DateTime<Utc>,
        after: i64,
        report: &mut RetentionReport,
    ) -> Result<(u64, u64, Option<i64>)> {
        let limit = i64::try_from(self.config.batch_size.max(1)).unwrap_or(i64::MAX);
        let span = tracing::debug_span!("outbox.retention.batch", kind = kind.label(), after);
        let started = Instant::now();
        let pool = self.outbox.pool();
        let tables = self.outbox.tables();
        let (n, found, last) = match kind {
            Kind::Sent => DB::delete_sent(pool, tables, after, cutoff, limit)
                .instrument(span)
                .await
                .map(|b| (b.deleted, b.found, b.last))
                .context("deleting old sent messages", &tables.outbox)?,
            Kind::Processed => {
                // Failure records not retried, and instances not seen, within the
                // window: see `ConsumerRows::Before`.
                match DB::clear_consumer_rows(pool, tables, ConsumerRows::Before(cutoff)).await {
                    Err(e) if !crate::error::is_schema_missing(&e) => {
                        return Err(e)
                            .context("deleting the consumers' old state", &tables.processed);
                    }
                    _ => {}
                }
                DB::delete_processed(pool, tables, cutoff, limit)
                    .instrument(span)
                    .await
                    .map(|n| (n, n, None))
                    .context("deleting old processed-message ids", &tables.processed)?
            }
        };
        let elapsed = started.elapsed();
        report.batches += 1;
        report.longest_batch = report.longest_batch.max(elapsed);
        metrics::counter!("outbox_retention_deleted_total", "kind" => kind.label()).increment(n);
        metrics::histogram!("outbox_retention_batch_seconds").record(elapsed.as_secs_f64());
        tracing::debug!(
            kind = kind.label(),
            deleted = n,
            elapsed_ms = elapsed.as_millis() as u64,
            "outbox retention batch"
        );
        Ok((n, found, last))
    }
}

/// Controls a spawned retention task.
#[derive(Debug)]
#[must_use = "dropping the handle detaches the retention task: it runs until the runtime ends, and cannot be stopped gracefully; keep it and call `shutdown`"]
pub struct RetentionHandle {
    task: TaskHandle,
    last: Arc<Mutex<Option<RetentionReport>>>,
}

impl RetentionHandle {
    controls_task! {
        /// Asks the task to stop after its current batch and waits until it has.
        shutdown;
        /// Stops the task at once. A batch in flight is rolled back by the database.
        abort;
        /// Whether the task has ended.
        is_finished;
    }

    /// The report of the last run that completed, if any.
    pub fn last_report(&self) -> Option<RetentionReport> {
        self.last.lock().ok().and_then(|last| last.clone())
    }
}
