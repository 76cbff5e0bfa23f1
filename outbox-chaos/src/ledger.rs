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
        if let Some(&previous) = last.get(key.as_str()) {
            if *n < previous {
                ledger
                    .order_violations
                    .push(format!("{key}: {n} after {previous}"));
                continue; // keep the highest seen
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(key: &str, n: i32) -> Event {
        (key.to_owned(), n)
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
