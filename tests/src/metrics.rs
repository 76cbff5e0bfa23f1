//! What a test's metrics recorder saw, for the tests of metric labels (each such test is a
//! binary of its own: it installs the process's recorder).

use std::collections::BTreeMap;

use metrics_util::debugging::{DebugValue, Snapshotter};

/// Every metric seen so far, by name and the value of one label (`<none>` without it):
/// counters summed (a snapshot takes what was counted since the one before), gauges as
/// last set, histograms by their number of values.
#[derive(Debug)]
pub struct Seen {
    label: &'static str,
    values: BTreeMap<(String, String), f64>,
}

impl Seen {
    /// Metrics told apart by the label `label`.
    pub fn by(label: &'static str) -> Seen {
        Seen {
            label,
            values: BTreeMap::new(),
        }
    }

    /// Adds what `snapshotter` saw since its last snapshot.
    pub fn take(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let label = key
                .key()
                .labels()
                .find(|l| l.key() == self.label)
                .map(|l| l.value().to_owned())
                .unwrap_or_else(|| "<none>".to_owned());
            let entry = self
                .values
                .entry((key.key().name().to_owned(), label))
                .or_default();
            match value {
                DebugValue::Counter(c) => *entry += c as f64,
                DebugValue::Gauge(g) => *entry = g.into_inner(),
                DebugValue::Histogram(h) => *entry += h.len() as f64,
            }
        }
    }

    /// `name`'s value under the label value `label`.
    pub fn get(&self, name: &str, label: &str) -> Option<f64> {
        self.values
            .get(&(name.to_owned(), label.to_owned()))
            .copied()
    }

    /// `name`'s values by label value.
    pub fn by_label(&self, name: &str) -> BTreeMap<String, f64> {
        self.values
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|((_, l), v)| (l.clone(), *v))
            .collect()
    }
}
