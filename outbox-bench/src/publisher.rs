//! A publisher that only counts: the relay's own cost, without a broker or storage.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use outbox_core::publisher::{OutboxRecord, PublishError, Publisher};
use tokio::sync::mpsc;

#[derive(Clone, Default)]
pub struct CountingPublisher {
    count: Arc<AtomicU64>,
}

impl Publisher for CountingPublisher {
    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        self.count.fetch_add(batch.len() as u64, Ordering::Relaxed);
        vec![Ok(()); batch.len()]
    }
}

/// Wraps a publisher and reports when each message was acknowledged to the relay (for
/// a batch: when its last acknowledgement arrived, an upper bound for each message).
/// It also records each publish call's duration and batch size: the broker's share of
/// the latency, against which the relay's own share shows.
pub struct Acked<P> {
    inner: P,
    acks: mpsc::UnboundedSender<(uuid::Uuid, Instant)>,
    calls: PublishCalls,
}

/// Each publish call: (milliseconds, messages).
pub type PublishCalls = Arc<std::sync::Mutex<Vec<(f64, usize)>>>;

impl<P> Acked<P> {
    pub fn new(inner: P, acks: mpsc::UnboundedSender<(uuid::Uuid, Instant)>) -> Self {
        Acked {
            inner,
            acks,
            calls: PublishCalls::default(),
        }
    }

    /// The publish calls recorded so far (shared: it fills while the relay runs).
    pub fn calls(&self) -> PublishCalls {
        self.calls.clone()
    }
}

impl<P: Publisher> Publisher for Acked<P> {
    fn max_batches_in_flight(&self) -> usize {
        self.inner.max_batches_in_flight()
    }

    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let started = Instant::now();
        let results = self.inner.publish(batch).await;
        let now = Instant::now();
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(((now - started).as_secs_f64() * 1000.0, batch.len()));
        }
        for (record, result) in batch.iter().zip(&results) {
            if result.is_ok() {
                let _ = self.acks.send((record.id, now));
            }
        }
        results
    }
}

/// The broker's share, into `report` under `(group, prefix)`: how long each publish call
/// took (p50, p99) and how many messages it carried.
pub fn report_calls(
    report: &mut crate::report::Report,
    (group, prefix): (&str, &str),
    calls: &PublishCalls,
) {
    let Ok(calls) = calls.lock() else {
        return;
    };
    let mut ms: Vec<f64> = calls.iter().map(|c| c.0).collect();
    ms.sort_by(f64::total_cmp);
    let messages: usize = calls.iter().map(|c| c.1).sum();
    let name = |q: &str| format!("{prefix}publish call (relay -> broker acks), {q}");
    report.add(group, &name("p50"), crate::setup::quantile(&ms, 0.5), "ms");
    report.add(group, &name("p99"), crate::setup::quantile(&ms, 0.99), "ms");
    report.add(
        group,
        &format!("{prefix}messages per publish call, mean"),
        messages as f64 / calls.len().max(1) as f64,
        "messages",
    );
}
