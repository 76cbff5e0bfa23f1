//! The ledger: what the writers committed against what the consumer applied.
//!
//! An event is `(key, n)`: the `n`-th event of `key`, committed with the business row
//! `chaos_written (key, n)` in one transaction. The consumer applies each message id
//! once through the inbox and records `(key, n)` in `chaos_consumed`, in the order it
//! applied them. From the two:
//! - **lost**: committed, not applied, and neither discarded by the operator (the
//!   oversized poison message) nor acknowledged by a broker that was then killed with
//!   its in-memory storage (the broker's loss, never ours);
//! - **order violations**: per key, an event applied after a later one of its key;
//! - **applied twice**: the same `(key, n)` applied twice (the inbox failed);
//! - **unknown**: applied but never committed (an event out of nowhere).

use std::collections::{BTreeMap, HashMap, HashSet};

/// One event: its key and its number within the key.
pub type Event = (String, i32);

/// What the ledger compares.
#[derive(Debug, Default)]
pub struct Input {
    /// Every committed event.
    pub written: Vec<Event>,
    /// Every applied event, in the order the consumer applied them.
    pub applied: Vec<Event>,
    /// Events the operator discarded (dead letters of the poison fault).
    pub discarded: HashSet<Event>,
    /// Events a killed in-memory broker had acknowledged before it died.
    pub acked_by_killed_broker: HashSet<Event>,
}

/// The verdict.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Committed events.
    pub written: usize,
    /// Distinct events applied.
    pub applied: usize,
    /// Committed, not applied, not discarded, not the broker's loss.
    pub lost: Vec<Event>,
    /// Not applied because the broker that acknowledged them was killed (in memory).
    pub lost_by_broker: usize,
    /// Not applied because the broker's fetch skipped them: in the broker's log, at an
    /// offset the consumer reported it never received (see [`skipped_by_fetch`]).
    pub skipped_by_fetch: usize,
    /// Discarded by the operator.
    pub discarded: usize,
    /// "key: n after m" for each event applied after a later one of its key.
    pub order_violations: Vec<String>,
    /// Events applied twice.
    pub applied_twice: usize,
    /// Events applied that were never committed.
    pub unknown: usize,
}

impl Ledger {
    /// Whether the run kept every guarantee.
    pub fn holds(&self) -> bool {
        self.lost.is_empty()
            && self.order_violations.is_empty()
            && self.applied_twice == 0
            && self.unknown == 0
    }
}

/// Checks `input`.
pub fn check(input: &Input) -> Ledger {
    let written: HashSet<&Event> = input.written.iter().collect();
    let mut applied: HashSet<&Event> = HashSet::new();
    let mut ledger = Ledger {
        written: written.len(),
        discarded: input.discarded.len(),
        ..Ledger::default()
    };
    let mut last: HashMap<&str, i32> = HashMap::new();
    for event in &input.applied {
        if !applied.insert(event) {
            ledger.applied_twice += 1;
            continue;
        }
        if !written.contains(event) {
            ledger.unknown += 1;
        }
        let (key, n) = event;
        if let Some(&previous) = last.get(key.as_str())
            && *n < previous
        {
            ledger
                .order_violations
                .push(format!("{key}: {n} after {previous}"));
            continue; // keep the highest seen
        }
        last.insert(key, *n);
    }
    ledger.applied = applied.len();
    let mut lost: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
    for event in &input.written {
        if applied.contains(event) || input.discarded.contains(event) {
            continue;
        }
        if input.acked_by_killed_broker.contains(event) {
            ledger.lost_by_broker += 1;
        } else {
            lost.entry(&event.0).or_default().push(event.1);
        }
    }
    ledger.lost = lost
        .into_iter()
        .flat_map(|(k, ns)| ns.into_iter().map(move |n| (k.to_owned(), n)))
        .collect();
    ledger
}

/// One message of the broker's log, read back after a run.
#[derive(Debug, Clone)]
pub struct Logged {
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// The event it carries, if its payload is one of the rig's.
    pub event: Option<Event>,
}

/// For each lost event, one line saying whether the broker's log holds it (then the
/// consumer missed it) or not (then the broker acknowledged what it did not keep, or it
/// was never sent), with where its neighbours of the same key are.
pub fn locate(log: &[Logged], lost: &[Event]) -> Vec<String> {
    let at = |key: &str, n: i32| -> Vec<String> {
        log.iter()
            .filter(|m| m.event.as_ref().is_some_and(|e| e.0 == key && e.1 == n))
            .map(|m| format!("{}@{}", m.partition, m.offset))
            .collect()
    };
    lost.iter()
        .map(|(key, n)| {
            let (here, before, after) = (at(key, *n), at(key, n - 1), at(key, n + 1));
            let verdict = if here.is_empty() {
                "is NOT in the broker's log: the broker acknowledged what it did not keep, \
                 or it was never sent"
                    .to_owned()
            } else {
                format!(
                    "IS in the broker's log at {} (partition@offset): the consumer missed it",
                    here.join(", ")
                )
            };
            format!(
                "{key}#{n} {verdict}; {key}#{} is at [{}], {key}#{} at [{}]",
                n - 1,
                before.join(", "),
                n + 1,
                after.join(", ")
            )
        })
        .collect()
}

/// The offsets a consumer received, per partition: the `outbox-kafka: received` lines
/// of its log (`KafkaTransport` at `trace`), fields `partition=` and `offset=` (colour
/// codes are skipped).
pub fn received(log: &str) -> HashMap<i32, HashSet<i64>> {
    let mut received: HashMap<i32, HashSet<i64>> = HashMap::new();
    for line in log.lines().map(strip_colours) {
        if !line.contains("outbox-kafka: received") {
            continue;
        }
        let field = |name: &str| -> Option<i64> {
            line.split_whitespace()
                .filter_map(|word| word.strip_prefix(name)?.strip_prefix('='))
                .next_back()?
                .parse()
                .ok()
        };
        if let (Some(partition), Some(offset)) = (field("partition"), field("offset"))
            && let Ok(partition) = i32::try_from(partition)
        {
            received.entry(partition).or_default().insert(offset);
        }
    }
    received
}

/// `line` without its ANSI escape sequences (`ESC [ ... m`).
fn strip_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The lost events that the broker's fetch skipped: the broker's log holds them, and at
/// **every** offset where it holds a copy, the consumer received nothing while it
/// received a later offset of that partition. The broker kept them and never handed
/// them over (seen with tansu, docs/reliability.md), so nothing of ours lost them. Only
/// these; every other lost event stays lost.
pub fn skipped_by_fetch(
    log: &[Logged],
    lost: &[Event],
    received: &HashMap<i32, HashSet<i64>>,
) -> Vec<Event> {
    lost.iter()
        .filter(|event| {
            let mut copies = log
                .iter()
                .filter(|m| m.event.as_ref() == Some(*event))
                .peekable();
            copies.peek().is_some()
                && copies.all(|m| {
                    received.get(&m.partition).is_some_and(|offsets| {
                        !offsets.contains(&m.offset) && offsets.iter().any(|&o| o > m.offset)
                    })
                })
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(key: &str, n: i32) -> Event {
        (key.to_owned(), n)
    }

    fn logged(partition: i32, offset: i64, key: &str, n: i32) -> Logged {
        Logged {
            partition,
            offset,
            event: Some(ev(key, n)),
        }
    }

    #[test]
    fn a_clean_run_holds() {
        let input = Input {
            written: vec![ev("a", 0), ev("a", 1), ev("b", 0)],
            applied: vec![ev("a", 0), ev("b", 0), ev("a", 1)],
            ..Input::default()
        };
        let ledger = check(&input);
        assert!(ledger.holds(), "{ledger:?}");
        assert_eq!((ledger.written, ledger.applied), (3, 3));
    }

    #[test]
    fn a_missing_event_is_lost_unless_discarded_or_the_brokers_loss() {
        let mut input = Input {
            written: vec![ev("a", 0), ev("a", 1), ev("a", 2), ev("a", 3)],
            applied: vec![ev("a", 0), ev("a", 3)],
            ..Input::default()
        };
        assert_eq!(check(&input).lost, vec![ev("a", 1), ev("a", 2)]);
        input.discarded.insert(ev("a", 1));
        input.acked_by_killed_broker.insert(ev("a", 2));
        let ledger = check(&input);
        assert!(ledger.holds(), "{ledger:?}");
        assert_eq!((ledger.discarded, ledger.lost_by_broker), (1, 1));
    }

    #[test]
    fn an_event_applied_after_a_later_one_of_its_key_is_a_violation() {
        let input = Input {
            written: vec![ev("a", 0), ev("a", 1), ev("a", 2), ev("b", 0)],
            applied: vec![ev("a", 0), ev("a", 2), ev("b", 0), ev("a", 1)],
            ..Input::default()
        };
        let ledger = check(&input);
        assert_eq!(ledger.order_violations, vec!["a: 1 after 2".to_owned()]);
        assert!(!ledger.holds());
    }

    #[test]
    fn a_lost_event_is_found_in_the_log_or_said_to_be_missing() {
        let log = vec![
            logged(2, 7, "a", 1),
            logged(2, 8, "a", 2),
            Logged {
                partition: 0,
                offset: 0,
                event: None,
            },
            logged(2, 9, "a", 4),
        ];
        assert_eq!(
            locate(&log, &[ev("a", 2), ev("a", 3)]),
            vec![
                "a#2 IS in the broker's log at 2@8 (partition@offset): the consumer missed it; \
                 a#1 is at [2@7], a#3 at []"
                    .to_owned(),
                "a#3 is NOT in the broker's log: the broker acknowledged what it did not keep, \
                 or it was never sent; a#2 is at [2@8], a#4 at [2@9]"
                    .to_owned(),
            ]
        );
    }

    #[test]
    fn received_offsets_are_read_from_the_consumers_log() {
        let colour =
            |name: &str, value: &str| format!("\u{1b}[3m{name}\u{1b}[0m\u{1b}[2m=\u{1b}[0m{value}");
        let log = format!(
            "\u{1b}[2m2026-12-01T22:43:25Z\u{1b}[0m \u{1b}[35mTRACE\u{1b}[0m outbox-kafka: received {} {} {}\n\
             TRACE outbox-kafka: received topic=\"t\" partition=0 offset=9\n\
             WARN outbox-kafka: offsets 5..=8 were never received partition=0 from=5 to=8\n",
            colour("topic", "\"t\""),
            colour("partition", "2"),
            colour("offset", "208"),
        );
        let received = received(&log);
        assert_eq!(received[&2], HashSet::from([208]));
        assert_eq!(received[&0], HashSet::from([9]));
    }

    #[test]
    fn only_an_event_passed_over_at_every_copy_was_skipped_by_the_fetch() {
        let log = vec![
            logged(2, 207, "a", 1),
            logged(2, 208, "a", 2),
            logged(2, 209, "a", 3),
            logged(1, 5, "b", 7),
            // d#1 twice: once passed over, once received (and lost by the consumer).
            logged(2, 210, "d", 1),
            logged(2, 211, "d", 1),
            logged(3, 4, "e", 0),
        ];
        let received = HashMap::from([
            (2, HashSet::from([207, 209, 211, 212])),
            (1, HashSet::from([4])),
            (3, HashSet::from([1, 2])),
        ]);
        assert_eq!(
            skipped_by_fetch(
                &log,
                &[ev("a", 2), ev("b", 7), ev("c", 0), ev("d", 1), ev("e", 0)],
                &received
            ),
            vec![ev("a", 2)],
            "b#7: nothing later received; c#0: not in the log; d#1: one copy received; \
             e#0: nothing later received"
        );
    }

    #[test]
    fn twice_applied_and_unknown_events_break_the_ledger() {
        let input = Input {
            written: vec![ev("a", 0)],
            applied: vec![ev("a", 0), ev("a", 0), ev("z", 9)],
            ..Input::default()
        };
        let ledger = check(&input);
        assert_eq!((ledger.applied_twice, ledger.unknown), (1, 1));
        assert!(!ledger.holds());
    }
}
