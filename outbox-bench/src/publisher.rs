//! A publisher that only counts: the relay's own cost, without a broker or storage.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_core::publisher::{OutboxRecord, PublishError, Publisher};
use tokio::sync::Notify;

#[derive(Clone, Default)]
pub struct CountingPublisher {
    count: Arc<AtomicU64>,
    changed: Arc<Notify>,
}

impl CountingPublisher {
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Waits until `n` messages were acknowledged; false on timeout.
    pub async fn wait_for(&self, n: u64, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.changed.notified();
            if self.count() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.count() >= n;
            }
        }
    }
}

impl Publisher for CountingPublisher {
    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        self.count.fetch_add(batch.len() as u64, Ordering::Relaxed);
        self.changed.notify_waiters();
        vec![Ok(()); batch.len()]
    }
}
