//! The publish horizon: the highest `seq` below which every row is final (committed or
//! rolled back), so publishing in `seq` order never overtakes a row that commits late.
//!
//! Writers take a shared advisory lock (the *writer lock*) before their rows draw `seq`
//! values and hold it until their transaction ends. The relay samples, in this order,
//! `H` = the sequence's last value, then the set `S` of transactions holding the writer
//! lock. Every transaction that drew a `seq <= H` held the lock at sampling time or had
//! already finished, so once none of `S` holds the lock any more, every row with
//! `seq <= H` is final. A writer holds the lock continuously, so if a sample is safe,
//! so are all the earlier ones: the horizon is the `H` of the newest safe sample.

use std::collections::{HashSet, VecDeque};

/// One observation: the sequence's value and the writers in flight when it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sample {
    pub(crate) last_seq: i64,
    pub(crate) writers: HashSet<String>,
}

/// Keeps the samples not yet known to be safe.
#[derive(Debug, Default)]
pub(crate) struct Horizon {
    pending: VecDeque<Sample>,
    safe: i64,
}

/// At most this many unresolved samples are kept; a writer holding its transaction open
/// longer than that many relay cycles makes the oldest ones merge (keeping the smaller,
/// safe-side `H` of the two).
const MAX_SAMPLES: usize = 64;

impl Horizon {
    /// Adds a new sample and returns the horizon: rows with `seq <= horizon` are final.
    pub(crate) fn observe(&mut self, now: Sample) -> i64 {
        // The newest sample none of whose writers still holds the lock.
        let total = self.pending.len() + 1;
        let newest_safe = if now.writers.is_empty() {
            Some(total - 1)
        } else {
            self.pending
                .iter()
                .rposition(|s| s.writers.is_disjoint(&now.writers))
        };
        match newest_safe {
            Some(i) if i + 1 == total => {
                self.safe = self.safe.max(now.last_seq);
                self.pending.clear();
            }
            Some(i) => {
                self.safe = self.safe.max(self.pending[i].last_seq);
                self.pending.drain(..=i);
                self.push(now);
            }
            None => self.push(now),
        }
        self.safe
    }

    fn push(&mut self, sample: Sample) {
        if self
            .pending
            .back()
            .is_some_and(|b| b.writers == sample.writers)
        {
            // Same writers in flight: the newer H is safe exactly when the older one is.
            if let Some(back) = self.pending.back_mut() {
                back.last_seq = sample.last_seq;
            }
            return;
        }
        if self.pending.len() == MAX_SAMPLES {
            // Merge the two oldest: keep the older H (safe side) and the union of writers.
            if let (Some(first), Some(second)) =
                (self.pending.pop_front(), self.pending.front_mut())
            {
                second.last_seq = first.last_seq;
                second.writers.extend(first.writers);
            }
        }
        self.pending.push_back(sample);
    }

    /// Whether rows may exist above the horizon that are waiting for writers to finish.
    pub(crate) fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The current horizon.
    #[cfg(test)]
    pub(crate) fn value(&self) -> i64 {
        self.safe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(last_seq: i64, writers: &[&str]) -> Sample {
        Sample {
            last_seq,
            writers: writers.iter().map(|w| (*w).to_owned()).collect(),
        }
    }

    #[test]
    fn no_writers_in_flight_means_everything_is_final() {
        let mut h = Horizon::default();
        assert_eq!(h.observe(s(10, &[])), 10);
        assert!(!h.waiting());
    }

    #[test]
    fn waits_for_the_writers_seen_with_a_sample() {
        let mut h = Horizon::default();
        // A (which may hold seq <= 10) is in flight: nothing new is final yet.
        assert_eq!(h.observe(s(10, &["A"])), 0);
        assert!(h.waiting());
        // B started too, A still running: still 0.
        assert_eq!(h.observe(s(12, &["A", "B"])), 0);
        // A finished, B still running: the first sample (only A) is safe now.
        assert_eq!(h.observe(s(13, &["B"])), 10);
        // B finished: everything is final.
        assert_eq!(h.observe(s(13, &[])), 13);
        assert!(!h.waiting());
    }

    #[test]
    fn a_long_writer_holds_the_horizon_back() {
        let mut h = Horizon::default();
        assert_eq!(h.observe(s(5, &[])), 5);
        for i in 6..200 {
            assert_eq!(
                h.observe(s(i, &["LONG", &format!("w{i}")])),
                5,
                "sample {i}"
            );
        }
        assert!(h.pending.len() <= MAX_SAMPLES);
        // When LONG ends, the newest sample whose writers are gone becomes the horizon.
        assert_eq!(h.observe(s(300, &["w299"])), 199);
        assert_eq!(h.observe(s(301, &[])), 301);
    }

    #[test]
    fn the_horizon_never_moves_back() {
        let mut h = Horizon::default();
        assert_eq!(h.observe(s(50, &[])), 50);
        // A sequence read can't go back, but a sample can name writers: stays at 50.
        assert_eq!(h.observe(s(50, &["A"])), 50);
        assert_eq!(h.value(), 50);
    }
}
