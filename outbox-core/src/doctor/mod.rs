//! A read-only health check of one outbox: what is wrong, and what to do about it. The
//! `outbox doctor` command prints it and exits non-zero when something needs action;
//! a service can run it too (an admin endpoint, a scheduled job).
//!
//! ```no_run
//! # async fn demo(outbox: outbox_core::Outbox) -> outbox_core::Result<()> {
//! use outbox_core::doctor::{Doctor, Limits};
//!
//! let report = Doctor::new(outbox)
//!     .limits(Limits::default().oldest_pending(std::time::Duration::from_secs(60)))
//!     .examine()
//!     .await?;
//! for finding in &report.findings {
//!     println!("{finding}");
//! }
//! if report.needs_action() {
//!     std::process::exit(3); // what `outbox doctor` does
//! }
//! # Ok(()) }
//! ```
//!
//! What it looks at (every database: the first five; PostgreSQL: all):
//!
//! | check | needs action when |
//! | --- | --- |
//! | `dead-letters` | there are dead letters (each listed with the messages of its key it holds back) |
//! | `oldest-pending` | the oldest pending message waited longer than [`Limits::oldest_pending`] |
//! | `no-relay` | messages are pending and no relay is connected (not known on SQLite) |
//! | `consumer-gone` | no instance of a consumer has written its heartbeat for longer than [`Limits::consumer_gone`] (it died without stopping, or cannot reach the database); earlier, or one instance of several gone: a note |
//! | `consumer-failing` | a consumer's handler has failed on a message for longer than [`Limits::consumer_failing`]: the message and the later ones of its key wait in that consumer (shorter failures: a note) |
//! | `open-writer` | a transaction has held the writer lock longer than [`Limits::open_writer`]: the relay publishes nothing written after it began |
//! | `table-bloat` | dead row versions exceed [`Limits::dead_rows`] and [`Limits::dead_ratio`] of the live ones |
//! | `autovacuum` | autovacuum is off for the server or for the outbox table |
//! | `sequence-cache` | the `seq` sequence caches values (the relay refuses to start) |
//! | `partitions` | the relays' partition count differs from [`Limits::partitions`], a partition has had no relay for longer than a rebalance takes, or a session that is not a relay holds one |
//! | `replication-slots` | WAL mode's slot keeps more WAL than [`Limits::slot_retained_bytes`], is missing or lost (other slots of the database over the limit: a note) |
//!
//! It reads the pending and dead-letter rows and the server's statistics, never the
//! history, and changes nothing.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::admin::Admin;
#[cfg(feature = "postgres")]
mod postgres;
use crate::admin;

use crate::model::{ListFilter, human_duration};
use crate::store::Backend;
use crate::{Outbox, Result};

moved! {
    #[cfg(feature = "postgres")]
    Health => postgres, "moved to `outbox_core::postgres::Health`";
    #[cfg(feature = "postgres")]
    RelayInstance => postgres, "moved to `outbox_core::postgres::RelayInstance`";
    #[cfg(feature = "postgres")]
    ReplicationSlot => postgres, "moved to `outbox_core::postgres::ReplicationSlot`";
    /// Its one path.
    Status => admin, "use `outbox_core::admin::Status`";
}

/// The thresholds of [`Doctor`]; the defaults suit a busy service.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Limits {
    /// The oldest pending message may wait this long (default 5 minutes).
    pub oldest_pending: Duration,
    /// A transaction may hold the writer lock this long (default 30 s).
    pub open_writer: Duration,
    /// Dead row versions in the outbox table above this many (default 100,000)...
    pub dead_rows: i64,
    /// ...and above this share of the live rows (default 0.2) need a vacuum.
    pub dead_ratio: f64,
    /// A replication slot may keep this much WAL, in bytes (default 1 GiB).
    pub slot_retained_bytes: i64,
    /// The partition count the relays should run with (`RelayBuilder::partitions`);
    /// `None`: whatever they registered.
    pub partitions: Option<u16>,
    /// A consumer's handler may fail on one message this long before it needs action
    /// (default 5 minutes).
    pub consumer_failing: Duration,
    /// A consumer may have no running instance this long (since its last heartbeat)
    /// before it needs action, when the broker held messages for it or this long has
    /// passed (default 5 minutes).
    pub consumer_gone: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            oldest_pending: Duration::from_secs(300),
            open_writer: Duration::from_secs(30),
            dead_rows: 100_000,
            dead_ratio: 0.2,
            slot_retained_bytes: 1 << 30,
            partitions: None,
            consumer_failing: Duration::from_secs(300),
            consumer_gone: Duration::from_secs(300),
        }
    }
}

impl Limits {
    setters! {
        /// See [`Limits::oldest_pending`](struct.Limits.html#structfield.oldest_pending).
        oldest_pending(limit: Duration);
        /// See [`Limits::open_writer`](struct.Limits.html#structfield.open_writer).
        open_writer(limit: Duration);
        /// See [`Limits::slot_retained_bytes`](struct.Limits.html#structfield.slot_retained_bytes).
        slot_retained_bytes(bytes: i64);
        /// See [`Limits::partitions`](struct.Limits.html#structfield.partitions).
        partitions(partitions: u16) => Some(partitions);
        /// See [`Limits::consumer_failing`](struct.Limits.html#structfield.consumer_failing).
        consumer_failing(limit: Duration);
        /// See [`Limits::consumer_gone`](struct.Limits.html#structfield.consumer_gone).
        consumer_gone(limit: Duration);
    }
    /// See [`Limits::dead_rows`](struct.Limits.html#structfield.dead_rows) and
    /// [`Limits::dead_ratio`](struct.Limits.html#structfield.dead_ratio).
    pub fn dead_rows(mut self, rows: i64, ratio: f64) -> Self {
        self.dead_rows = rows;
        self.dead_ratio = ratio;
        self
    }
}

/// How urgent a [`Finding`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Something is wrong: `outbox doctor` exits with 3.
    Action,
    /// Worth knowing; nothing to do.
    Note,
}

/// One thing the doctor found.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Finding {
    /// The check (`dead-letters`, `open-writer`...; see the [module](self)).
    pub check: &'static str,
    /// Whether it needs action.
    pub severity: Severity,
    /// What is wrong, in one line.
    pub summary: String,
    /// The evidence: one item per line (a dead letter, a relay, a slot...).
    pub details: Vec<String>,
    /// What to do.
    pub fix: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = match self.severity {
            Severity::Action => "ACTION",
            Severity::Note => "note",
        };
        writeln!(f, "{label:<6}  {}: {}", self.check, self.summary)?;
        for line in &self.details {
            writeln!(f, "          {line}")?;
        }
        if !self.fix.is_empty() {
            writeln!(f, "          fix: {}", self.fix)?;
        }
        Ok(())
    }
}

/// What [`Doctor::examine`] found, with the facts it looked at.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// Findings that need action first.
    pub findings: Vec<Finding>,
    /// The outbox's status (`outbox status`).
    pub status: admin::Status,
    /// The database's view of the table, relays and slots (PostgreSQL).
    #[cfg(feature = "postgres")]
    pub health: Option<crate::postgres::Health>,
}

impl Report {
    /// Whether any finding needs action.
    pub fn needs_action(&self) -> bool {
        self.findings.iter().any(|f| f.severity == Severity::Action)
    }

    /// The findings of `check`.
    pub fn of(&self, check: &str) -> Vec<&Finding> {
        self.findings.iter().filter(|f| f.check == check).collect()
    }
}

/// The health check of one outbox. See the [module](self).
#[derive(Debug)]
pub struct Doctor<
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    admin: Admin<DB>,
    limits: Limits,
}

impl<DB: Backend> Clone for Doctor<DB> {
    fn clone(&self) -> Self {
        Doctor {
            admin: self.admin.clone(),
            limits: self.limits.clone(),
        }
    }
}

impl<DB: Backend> Doctor<DB> {
    /// Examines `outbox` with the default [`Limits`].
    pub fn new(outbox: Outbox<DB>) -> Self {
        Doctor {
            admin: Admin::new(outbox),
            limits: Limits::default(),
        }
    }

    /// Other thresholds.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Looks, changing nothing.
    pub async fn examine(&self) -> Result<Report> {
        let status = self.admin.status().await?;
        #[cfg(feature = "postgres")]
        let outbox = self.admin.outbox();
        #[cfg(feature = "postgres")]
        let health = DB::health(outbox.pool(), outbox.tables())
            .await
            .map_err(|e| crate::Error::db("examining the outbox", &status.table, e))?;
        let dead = if status.dead > 0 {
            self.admin
                .dead(&ListFilter {
                    limit: 10,
                    ..ListFilter::default()
                })
                .await?
        } else {
            Vec::new()
        };
        let mut findings = Vec::new();
        let limits = &self.limits;
        #[cfg(feature = "postgres")]
        let standby = health.as_ref().is_some_and(|h| h.in_recovery);
        #[cfg(not(feature = "postgres"))]
        let standby = false;
        dead_letters(&status, &dead, &mut findings);
        pending(&status, limits, standby, &mut findings);
        consumers(&status, limits, &mut findings);
        #[cfg(feature = "postgres")]
        postgres::open_writer(&status, limits, &mut findings);
        #[cfg(feature = "postgres")]
        if let Some(health) = &health {
            let sql_name = outbox.tables().outbox.quoted();
            postgres::table(&status.table, &sql_name, health, limits, &mut findings);
            postgres::sequence(health, &mut findings);
            if standby {
                findings.push(Finding {
                    check: "relays",
                    severity: Severity::Note,
                    summary: "this server is a standby: relays and writers run on the primary; \
                              examine the primary for relays, partitions and open writers"
                        .to_owned(),
                    details: Vec::new(),
                    fix: String::new(),
                });
            } else if status.slot.is_some() {
                findings.push(Finding {
                    check: "relays",
                    severity: Severity::Note,
                    summary: "WAL mode: the relay is the slot's reader (see the status line); \
                              standbys leave no trace"
                        .to_owned(),
                    details: Vec::new(),
                    fix: String::new(),
                });
            } else {
                postgres::relays(health, limits, &mut findings);
            }
            postgres::slots(&status, health, limits, &mut findings);
        }
        findings.sort_by_key(|f| f.severity != Severity::Action);
        Ok(Report {
            findings,
            status,
            #[cfg(feature = "postgres")]
            health,
        })
    }
}

fn dead_letters(
    status: &admin::Status,
    dead: &[crate::model::MessageInfo],
    out: &mut Vec<Finding>,
) {
    if status.dead == 0 {
        return;
    }
    // The earliest dead letter of a key counts every later pending message of it,
    // including those behind a later dead letter of the same key: the largest per key.
    let mut per_key: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for m in dead {
        if let Some(key) = m.partition_key.as_deref() {
            let held = per_key.entry(key).or_default();
            *held = (*held).max(m.held_back);
        }
    }
    let held: i64 = per_key.values().sum();
    let all_listed = dead.len() as i64 >= status.dead;
    let mut details: Vec<String> = dead
        .iter()
        .map(|m| {
            let error = m.last_error.as_deref().unwrap_or("no error recorded");
            let error: String = error.chars().take(160).collect();
            format!(
                "{} {} to {}, key {}: holds back {} message(s); {} attempt(s); {error}",
                m.id,
                m.event_type,
                m.destination,
                m.partition_key.as_deref().unwrap_or("(none)"),
                m.held_back,
                m.attempts,
            )
        })
        .collect();
    if !all_listed {
        details.push(format!("... and {} more", status.dead - dead.len() as i64));
    }
    out.push(Finding {
        check: "dead-letters",
        severity: Severity::Action,
        summary: format!(
            "{} dead letter(s), holding back {}{held} later message(s) of their keys",
            status.dead,
            if all_listed { "" } else { "at least " },
        ),
        details,
        fix: "read them with `outbox dead`; once the cause is fixed, `outbox release --id <id>` \
              publishes one (first, then the rest of its key), `outbox discard --id <id>` drops it \
              and lets its key go on (with `OnDeadLetter::SkipKey` the later messages do not wait)"
            .to_owned(),
    });
}

fn pending(status: &admin::Status, limits: &Limits, standby: bool, out: &mut Vec<Finding>) {
    // A standby's locks are its own: relays connect to the primary.
    let no_relay = status.relays == Some(0) && status.pending > 0 && !standby;
    if no_relay {
        out.push(Finding {
            check: "no-relay",
            severity: Severity::Action,
            summary: format!(
                "{} message(s) pending and no relay is connected",
                status.pending
            ),
            details: Vec::new(),
            fix: "start a relay (`Relay::builder(outbox, publisher).spawn()`); if one runs, \
                  check its logs: it cannot reach the database, or stands by (another \
                  partition count, see `partitions`)"
                .to_owned(),
        });
    }
    if let Some(age) = status.oldest_pending_age_seconds
        && age > limits.oldest_pending.as_secs_f64()
    {
        #[cfg(feature = "postgres")]
        let writer_stuck = status
            .oldest_writer
            .as_ref()
            .is_some_and(|w| w.age_seconds > limits.open_writer.as_secs_f64());
        #[cfg(not(feature = "postgres"))]
        let writer_stuck = false;
        let fix = if no_relay {
            "see `no-relay`"
        } else if writer_stuck {
            "see `open-writer`: an open transaction holds the relay back"
        } else if status.dead > 0 {
            "see `dead-letters`: pending messages wait behind dead letters of their keys"
        } else {
            "the relay is behind or the broker refuses messages: check the relay's logs, \
                 `outbox_relay_broker_unavailable` and `outbox pending --in-retry`"
        };
        out.push(Finding {
            check: "oldest-pending",
            severity: Severity::Action,
            summary: format!(
                "the oldest pending message has waited {} (limit {})",
                human_duration(age),
                human_duration(limits.oldest_pending.as_secs_f64())
            ),
            details: status
                .destinations
                .iter()
                .filter(|d| d.pending > 0)
                .map(|d| {
                    format!(
                        "{}: {} pending, {} in retry, oldest {}",
                        d.destination,
                        d.pending,
                        d.in_retry,
                        d.oldest_pending_age_seconds
                            .map_or("-".to_owned(), human_duration)
                    )
                })
                .collect(),
            fix: fix.to_owned(),
        });
    }
}

fn consumers(status: &admin::Status, limits: &Limits, out: &mut Vec<Finding>) {
    let limit = limits.consumer_failing.as_secs_f64();
    for consumer in &status.consumers {
        instances(consumer, limits, out);
        if consumer.failing.is_empty() {
            continue;
        }
        let longest = consumer
            .failing
            .iter()
            .map(|m| m.failing_seconds)
            .fold(0.0, f64::max);
        let over = consumer
            .failing
            .iter()
            .filter(|m| m.failing_seconds > limit)
            .count();
        let severity = if over > 0 {
            Severity::Action
        } else {
            Severity::Note
        };
        out.push(Finding {
            check: "consumer-failing",
            severity,
            summary: format!(
                "consumer {}: the handler is failing on {} message(s), the longest for {} \
                 (limit {}); each holds back the later messages of its key",
                consumer.consumer,
                consumer.failing.len(),
                human_duration(longest),
                human_duration(limit),
            ),
            details: consumer
                .failing
                .iter()
                .map(|m| {
                    let error: String = m.last_error.chars().take(160).collect();
                    format!(
                        "{} {}, key {}, from {}: {} attempt(s) over {}; {error}",
                        m.message_id,
                        m.event_type,
                        m.partition_key.as_deref().unwrap_or("(none)"),
                        m.origin,
                        m.attempts,
                        human_duration(m.failing_seconds),
                    )
                })
                .collect(),
            fix: "read the consumer's log for the handler's error and fix its cause (data the \
                  handler does not expect, a table or service it needs); to give up on such \
                  messages, set `handler_attempts(n, Policy::DeadLetter)` on the consumer"
                .to_owned(),
        });
    }
}

/// At most this many gone instances are listed in a finding.
const GONE_LISTED: usize = 10;

/// Instances that stopped writing their heartbeat without stopping: a note; an action
/// when none of the consumer's instances is alive and the last one was seen longer ago
/// than [`Limits::consumer_gone`].
fn instances(consumer: &admin::ConsumerStatus, limits: &Limits, out: &mut Vec<Finding>) {
    let gone: Vec<_> = consumer.instances.iter().filter(|i| !i.alive).collect();
    if gone.is_empty() {
        return;
    }
    let none_alive = gone.len() == consumer.instances.len();
    let waiting = gone.iter().filter_map(|i| i.lag).max().unwrap_or(0);
    let last_seen = gone
        .iter()
        .map(|i| i.seen_seconds_ago)
        .fold(f64::MAX, f64::min);
    let severity = if none_alive && last_seen > limits.consumer_gone.as_secs_f64() {
        Severity::Action
    } else {
        Severity::Note
    };
    let summary = if none_alive {
        format!(
            "consumer {}: no instance is running (the last heartbeat was {} ago){}",
            consumer.consumer,
            human_duration(last_seen),
            if waiting > 0 {
                format!("; {waiting} message(s) waited for it then")
            } else {
                String::new()
            }
        )
    } else {
        format!(
            "consumer {}: {} instance(s) stopped writing their heartbeat without stopping",
            consumer.consumer,
            gone.len()
        )
    };
    out.push(Finding {
        check: "consumer-gone",
        severity,
        summary,
        details: gone
            .iter()
            .take(GONE_LISTED)
            .map(|i| {
                format!(
                    "instance {} ({}), started {}, last seen {} ago, {} handled",
                    i.instance,
                    i.transport,
                    i.started_at.format("%Y-%m-%dT%H:%M:%SZ"),
                    human_duration(i.seen_seconds_ago),
                    i.handled
                )
            })
            .chain(
                (gone.len() > GONE_LISTED)
                    .then(|| format!("... and {} more", gone.len() - GONE_LISTED)),
            )
            .collect(),
        fix: "an instance that died (`kill -9`, a lost host) or cannot reach the database: \
              start it again, or read its log; a consumer retired on purpose can be forgotten \
              by deleting its rows from the `_consumers` table (retention deletes them after \
              its processed-ids window)"
            .to_owned(),
    });
}
