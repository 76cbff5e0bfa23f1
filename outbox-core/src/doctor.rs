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
//! What it looks at (every database: the first three; PostgreSQL: all):
//!
//! | check | needs action when |
//! | --- | --- |
//! | `dead-letters` | there are dead letters (each listed with the messages of its key it holds back) |
//! | `oldest-pending` | the oldest pending message waited longer than [`Limits::oldest_pending`] |
//! | `no-relay` | messages are pending and no relay is connected (not known on SQLite) |
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
pub use crate::model::{Health, RelayInstance, ReplicationSlot, Status};
use crate::model::{ListFilter, human_duration};
use crate::store::{Backend, DefaultBackend};
use crate::{Outbox, Result};

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
        }
    }
}

impl Limits {
    /// See [`Limits::oldest_pending`](struct.Limits.html#structfield.oldest_pending).
    pub fn oldest_pending(mut self, limit: Duration) -> Self {
        self.oldest_pending = limit;
        self
    }
    /// See [`Limits::open_writer`](struct.Limits.html#structfield.open_writer).
    pub fn open_writer(mut self, limit: Duration) -> Self {
        self.open_writer = limit;
        self
    }
    /// See [`Limits::dead_rows`](struct.Limits.html#structfield.dead_rows) and
    /// [`Limits::dead_ratio`](struct.Limits.html#structfield.dead_ratio).
    pub fn dead_rows(mut self, rows: i64, ratio: f64) -> Self {
        self.dead_rows = rows;
        self.dead_ratio = ratio;
        self
    }
    /// See [`Limits::slot_retained_bytes`](struct.Limits.html#structfield.slot_retained_bytes).
    pub fn slot_retained_bytes(mut self, bytes: i64) -> Self {
        self.slot_retained_bytes = bytes;
        self
    }
    /// See [`Limits::partitions`](struct.Limits.html#structfield.partitions).
    pub fn partitions(mut self, partitions: u16) -> Self {
        self.partitions = Some(partitions);
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
    pub status: Status,
    /// The database's view of the table, relays and slots (PostgreSQL).
    pub health: Option<Health>,
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
pub struct Doctor<DB: Backend = DefaultBackend> {
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

impl<DB: Backend> fmt::Debug for Doctor<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Doctor")
            .field("admin", &self.admin)
            .field("limits", &self.limits)
            .finish()
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
        let outbox = self.admin.outbox();
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
        let standby = health.as_ref().is_some_and(|h| h.in_recovery);
        dead_letters(&status, &dead, &mut findings);
        pending(&status, limits, standby, &mut findings);
        if let Some(health) = &health {
            let sql_name = outbox.tables().outbox.quoted();
            table(&status.table, &sql_name, health, limits, &mut findings);
            sequence(health, &mut findings);
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
                relays(health, limits, &mut findings);
            }
            slots(&status, health, limits, &mut findings);
        }
        findings.sort_by_key(|f| f.severity != Severity::Action);
        Ok(Report {
            findings,
            status,
            health,
        })
    }
}

fn dead_letters(status: &Status, dead: &[crate::model::MessageInfo], out: &mut Vec<Finding>) {
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

fn pending(status: &Status, limits: &Limits, standby: bool, out: &mut Vec<Finding>) {
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
    if let Some(age) = status.oldest_pending_age_seconds {
        if age > limits.oldest_pending.as_secs_f64() {
            let writer_stuck = status
                .oldest_writer
                .as_ref()
                .is_some_and(|w| w.age_seconds > limits.open_writer.as_secs_f64());
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
    if let Some(writer) = &status.oldest_writer {
        if writer.age_seconds > limits.open_writer.as_secs_f64() {
            let who = match writer.pid {
                Some(pid) => format!("server process {pid} ({})", writer.state),
                None => "a prepared transaction".to_owned(),
            };
            let fix = match writer.pid {
                Some(pid) => format!(
                    "end that transaction in its application (commit or roll back); if it was \
                     abandoned, `SELECT pg_terminate_backend({pid})`; \
                     `idle_in_transaction_session_timeout` keeps it from happening again"
                ),
                None => {
                    "`COMMIT PREPARED` or `ROLLBACK PREPARED` it (`pg_prepared_xacts`)".to_owned()
                }
            };
            out.push(Finding {
                check: "open-writer",
                severity: Severity::Action,
                summary: format!(
                    "{who} has held the outbox's writer lock for {}: the relay publishes \
                     nothing written after it began",
                    human_duration(writer.age_seconds)
                ),
                details: writer
                    .query
                    .iter()
                    .map(|q| format!("last statement: {q}"))
                    .collect(),
                fix,
            });
        }
    }
}

fn table(name: &str, sql_name: &str, health: &Health, limits: &Limits, out: &mut Vec<Finding>) {
    let facts = vec![format!(
        "{} on disk, {} live rows, {} dead row versions, last vacuum {}",
        human_bytes(health.table_bytes),
        health.live_rows,
        health.dead_rows,
        health
            .last_vacuum
            .map_or("never".to_owned(), |t| t.to_rfc3339()),
    )];
    let disabled = !health.table_autovacuum;
    if !health.autovacuum_on || disabled {
        out.push(Finding {
            check: "autovacuum",
            severity: Severity::Action,
            summary: if disabled {
                format!("autovacuum is disabled for {name}: its dead rows pile up")
            } else {
                "autovacuum is off on this server (`autovacuum` or `track_counts`)".to_owned()
            },
            details: facts.clone(),
            fix: if disabled {
                format!("ALTER TABLE {sql_name} RESET (autovacuum_enabled)")
            } else {
                "turn `autovacuum` and `track_counts` on in postgresql.conf".to_owned()
            },
        });
    }
    // Autovacuum runs when dead rows pass its trigger, and then takes its time: only
    // what it has left alone for a while needs a hand.
    let vacuum_overdue = health
        .last_vacuum
        .is_none_or(|t| (chrono::Utc::now() - t).num_seconds() > 600);
    let bloated = health.dead_rows > limits.dead_rows
        && health.dead_rows as f64 > limits.dead_ratio * health.live_rows.max(1) as f64
        && health.dead_rows as f64 > health.vacuum_trigger_rows
        && vacuum_overdue;
    out.push(Finding {
        check: "table-bloat",
        severity: if bloated {
            Severity::Action
        } else {
            Severity::Note
        },
        summary: if bloated {
            format!(
                "{name} has {} dead row versions against {} live: claims and marks read through them",
                health.dead_rows, health.live_rows
            )
        } else {
            format!("{name}: {}", facts[0])
        },
        details: if bloated { facts } else { Vec::new() },
        fix: if bloated {
            let mut fix = format!(
                "VACUUM (ANALYZE) {sql_name}; if it comes back, let autovacuum visit the table \
                 sooner: ALTER TABLE {sql_name} SET (autovacuum_vacuum_scale_factor = 0.01, \
                 autovacuum_vacuum_cost_delay = 0)"
            );
            if !health.storage_parameters.is_empty() {
                fix.push_str(&format!(
                    " (set now: {})",
                    health.storage_parameters.join(", ")
                ));
            }
            fix
        } else {
            String::new()
        },
    });
}

fn sequence(health: &Health, out: &mut Vec<Finding>) {
    if let (Some(name), Some(cache)) = (&health.sequence, health.sequence_cache) {
        if cache != 1 {
            out.push(Finding {
                check: "sequence-cache",
                severity: Severity::Action,
                summary: format!(
                    "the sequence {name} caches {cache} values: relays refuse to start, since a \
                     cached value could be drawn after a larger one was published"
                ),
                details: Vec::new(),
                fix: format!("ALTER SEQUENCE {name} CACHE 1"),
            });
        }
    }
}

fn relays(health: &Health, limits: &Limits, out: &mut Vec<Finding>) {
    let details: Vec<String> = health
        .relays
        .iter()
        .map(|r| {
            format!(
                "server process {} `{}`{}, connected {}: partitions {}",
                r.pid,
                r.application_name,
                r.client
                    .as_deref()
                    .map(|c| format!(" from {c}"))
                    .unwrap_or_default(),
                human_duration(r.connected_seconds),
                ranges(&r.partitions)
            )
        })
        .collect();
    out.push(Finding {
        check: "relays",
        severity: Severity::Note,
        summary: format!(
            "{} relay(s) connected{}",
            health.relays.len(),
            match health.partition_counts.as_slice() {
                [n] => format!(", {n} partitions"),
                _ => String::new(),
            }
        ),
        details,
        fix: String::new(),
    });
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    if health.partition_counts.len() > 1 {
        problems.push(format!(
            "relays registered different partition counts: {:?}",
            health.partition_counts
        ));
    }
    if let (Some(wanted), [registered]) = (limits.partitions, health.partition_counts.as_slice()) {
        if i32::from(wanted) != *registered {
            problems.push(format!(
                "the relays run with {registered} partitions, {wanted} expected: a relay \
                 configured with {wanted} stands by until they are gone"
            ));
        }
    }
    if let [count] = health.partition_counts.as_slice() {
        if !health.relays.is_empty() {
            let owned: Vec<i32> = health
                .relays
                .iter()
                .flat_map(|r| r.partitions.iter().copied())
                .collect();
            let unowned: Vec<i32> = (0..*count)
                .filter(|p| !owned.contains(p) && !health.partitions_held_by_others.contains(p))
                .collect();
            // Relays rebalance within about a second (`rebalance_interval`) of one
            // starting or stopping: a young relay may still be taking its share.
            let settled = health.relays.iter().all(|r| r.connected_seconds >= 30.0);
            if !unowned.is_empty() && settled {
                problems.push(format!(
                    "partitions {} have no relay: the keys hashed to them are not published",
                    ranges(&unowned)
                ));
            } else if !unowned.is_empty() {
                notes.push(format!(
                    "partitions {} have no relay yet (a relay connected less than 30 s ago): look again",
                    ranges(&unowned)
                ));
            }
            let stray: Vec<i32> = owned.iter().copied().filter(|p| p >= count).collect();
            if !stray.is_empty() {
                problems.push(format!(
                    "partitions {} are held although the relays registered {count}",
                    ranges(&stray)
                ));
            }
        }
    }
    if !health.partitions_held_by_others.is_empty() {
        problems.push(format!(
            "partitions {} are held by sessions that are not relays of this outbox (an \
             advisory lock taken by hand?): their keys are not published",
            ranges(&health.partitions_held_by_others)
        ));
    }
    for note in notes {
        out.push(Finding {
            check: "partitions",
            severity: Severity::Note,
            summary: note,
            details: Vec::new(),
            fix: String::new(),
        });
    }
    if !problems.is_empty() {
        out.push(Finding {
            check: "partitions",
            severity: Severity::Action,
            summary: problems.remove(0),
            details: problems,
            fix: "run every relay of the outbox with the same `RelayBuilder::partitions`; end \
                  sessions holding partition locks that are not relays (`pg_locks`, objid \
                  1000000 + partition)"
                .to_owned(),
        });
    }
}

fn slots(status: &Status, health: &Health, limits: &Limits, out: &mut Vec<Finding>) {
    let mut problems = Vec::new();
    if let Some(slot) = &status.slot {
        if !slot.exists {
            problems.push(format!(
                "WAL mode's slot {} does not exist: the relay cannot start",
                slot.name
            ));
        } else if slot.wal_status.as_deref() == Some("lost") {
            problems.push(format!(
                "WAL mode's slot {} is lost (invalidated): events it held are gone",
                slot.name
            ));
        }
    }
    for slot in &health.slots {
        let Some(retained) = slot.retained_bytes else {
            continue;
        };
        if retained > limits.slot_retained_bytes {
            let line = format!(
                "slot {} keeps {} of WAL{}",
                slot.name,
                human_bytes(retained),
                if slot.active {
                    " (its reader is behind)"
                } else {
                    ", and nothing reads it"
                }
            );
            if status.slot.as_ref().is_some_and(|s| s.name == slot.name) {
                problems.push(line);
            } else {
                // Another application's (Debezium, a replica...): the server's disk, not
                // this outbox's to act on.
                out.push(Finding {
                    check: "replication-slots",
                    severity: Severity::Note,
                    summary: format!("{line} (not this outbox's slot)"),
                    details: Vec::new(),
                    fix: String::new(),
                });
            }
        }
    }
    if !problems.is_empty() {
        out.push(Finding {
            check: "replication-slots",
            severity: Severity::Action,
            summary: problems.remove(0),
            details: problems,
            fix: "start the slot's reader (WAL mode: the relay), or drop a slot nobody will read \
                  (`outbox slot drop` for WAL mode's; `pg_drop_replication_slot` for others); \
                  `max_slot_wal_keep_size` bounds what a slot can keep (docs/wal.md)"
                .to_owned(),
        });
    }
}

/// `0-3, 7` for `[0, 1, 2, 3, 7]`; `none` for none.
fn ranges(values: &[i32]) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(", ")
    }
}

fn human_bytes(bytes: i64) -> String {
    let b = bytes.max(0) as f64;
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = b;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_sizes_read_well() {
        assert_eq!(ranges(&[7, 0, 1, 2, 3, 9, 10]), "0-3, 7, 9-10");
        assert_eq!(ranges(&[]), "none");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * 1024 * 1024), "3.0 MiB");
    }
}
