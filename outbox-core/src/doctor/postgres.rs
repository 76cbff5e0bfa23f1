//! The doctor's PostgreSQL checks: the table's size and vacuum, the `seq` sequence, the
//! relays and their partitions, the replication slots, the open writer.

use super::{Finding, Limits, Severity};
use crate::admin::Status;
use crate::model::human_duration;
use crate::postgres::Health;

/// `open-writer`: a transaction holding the writer lock holds the relay back.
pub(super) fn open_writer(status: &Status, limits: &Limits, out: &mut Vec<Finding>) {
    if let Some(writer) = &status.oldest_writer
        && writer.age_seconds > limits.open_writer.as_secs_f64()
    {
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
            None => "`COMMIT PREPARED` or `ROLLBACK PREPARED` it (`pg_prepared_xacts`)".to_owned(),
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

pub(super) fn table(
    name: &str,
    sql_name: &str,
    health: &Health,
    limits: &Limits,
    out: &mut Vec<Finding>,
) {
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

pub(super) fn sequence(health: &Health, out: &mut Vec<Finding>) {
    if let (Some(name), Some(cache)) = (&health.sequence, health.sequence_cache)
        && cache != 1
    {
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

pub(super) fn relays(health: &Health, limits: &Limits, out: &mut Vec<Finding>) {
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
    if let (Some(wanted), [registered]) = (limits.partitions, health.partition_counts.as_slice())
        && i32::from(wanted) != *registered
    {
        problems.push(format!(
            "the relays run with {registered} partitions, {wanted} expected: a relay \
                 configured with {wanted} stands by until they are gone"
        ));
    }
    if let [count] = health.partition_counts.as_slice()
        && !health.relays.is_empty()
    {
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

pub(super) fn slots(status: &Status, health: &Health, limits: &Limits, out: &mut Vec<Finding>) {
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
