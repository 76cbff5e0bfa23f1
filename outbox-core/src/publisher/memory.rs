//! An in-memory publisher for tests, demos and the quick-start.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

use super::{OutboxRecord, PublishError, Publisher};

type Predicate = Box<dyn Fn(&OutboxRecord) -> bool + Send + Sync>;

struct FailRule {
    matches: Predicate,
    remaining: Option<u32>,
    error: PublishError,
}

#[derive(Default)]
struct State {
    published: Vec<OutboxRecord>,
    rules: Vec<FailRule>,
    delay: Duration,
    subscribers: Vec<mpsc::UnboundedSender<OutboxRecord>>,
    batches: usize,
    /// `publish` calls open now, and the most open at once so far.
    open_calls: usize,
    most_open_calls: usize,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Notify,
}

/// A [`Publisher`] that keeps what it receives in memory, and can be told to fail or
/// slow down. Clones share state: keep one clone, give the other to the relay.
///
/// ```
/// use outbox_core::publisher::{InMemoryPublisher, PublishError};
///
/// let publisher = InMemoryPublisher::new();
/// publisher.fail_when(|m| m.event_type == "Poison", None, PublishError::retryable("broker said no"));
/// assert!(publisher.published().is_empty());
/// ```
#[derive(Clone, Default)]
pub struct InMemoryPublisher {
    shared: Arc<Shared>,
}

impl fmt::Debug for InMemoryPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("InMemoryPublisher")
            .field("published", &state.published.len())
            .field("rules", &state.rules.len())
            .field("delay", &state.delay)
            .finish()
    }
}

impl InMemoryPublisher {
    /// A publisher that accepts everything at once.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state half-changed.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Fails messages matching `matches` with `error`: `times` times, or always if `None`.
    pub fn fail_when(
        &self,
        matches: impl Fn(&OutboxRecord) -> bool + Send + Sync + 'static,
        times: Option<u32>,
        error: PublishError,
    ) {
        self.lock().rules.push(FailRule {
            matches: Box::new(matches),
            remaining: times,
            error,
        });
    }

    /// Removes every failure rule.
    pub fn clear_failures(&self) {
        self.lock().rules.clear();
    }

    /// Waits `delay` after receiving each batch before acknowledging it: the messages are
    /// already in [`published`](Self::published) (the broker has them) while the
    /// acknowledgement is on its way, as with a slow broker.
    pub fn set_delay(&self, delay: Duration) {
        self.lock().delay = delay;
    }

    /// Everything acknowledged so far, in acknowledgement order.
    pub fn published(&self) -> Vec<OutboxRecord> {
        self.lock().published.clone()
    }

    /// How many messages were acknowledged so far.
    pub fn published_count(&self) -> usize {
        self.lock().published.len()
    }

    /// How many batches were received so far.
    pub fn batches(&self) -> usize {
        self.lock().batches
    }

    /// The most `publish` calls that were open at the same time so far.
    pub fn most_batches_in_flight(&self) -> usize {
        self.lock().most_open_calls
    }

    /// Forgets what was published.
    pub fn clear(&self) {
        self.lock().published.clear();
    }

    /// A stream of every message acknowledged from now on.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<OutboxRecord> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().subscribers.push(tx);
        rx
    }

    /// Waits until at least `count` messages were acknowledged; `false` on timeout.
    pub async fn wait_for(&self, count: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.shared.changed.notified();
            if self.published_count() >= count {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.published_count() >= count;
            }
        }
    }
}

impl Publisher for InMemoryPublisher {
    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let results = self.receive(batch);
        self.shared.changed.notify_waiters();
        let delay = {
            let mut state = self.lock();
            state.open_calls += 1;
            state.most_open_calls = state.most_open_calls.max(state.open_calls);
            state.delay
        };
        // Closed when the call ends, or is dropped (a relay's publish timeout).
        struct Open<'a>(&'a InMemoryPublisher);
        impl Drop for Open<'_> {
            fn drop(&mut self) {
                self.0.lock().open_calls -= 1;
            }
        }
        let _open = Open(self);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        results
    }

    fn max_batches_in_flight(&self) -> usize {
        4
    }
}

impl InMemoryPublisher {
    fn receive(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let mut state = self.lock();
        state.batches += 1;
        let mut failed_keys: HashSet<&str> = HashSet::new();
        let mut results = Vec::with_capacity(batch.len());
        for record in batch {
            let key = record.partition_key.as_deref();
            if key.is_some_and(|k| failed_keys.contains(k)) {
                results.push(Err(PublishError::not_attempted()));
                continue;
            }
            let rule = state
                .rules
                .iter_mut()
                .find(|r| r.remaining != Some(0) && (r.matches)(record));
            if let Some(rule) = rule {
                if let Some(n) = &mut rule.remaining {
                    *n -= 1;
                }
                if let Some(k) = key {
                    failed_keys.insert(k);
                }
                results.push(Err(rule.error.clone()));
                continue;
            }
            state.published.push(record.clone());
            state.subscribers.retain(|s| s.send(record.clone()).is_ok());
            results.push(Ok(()));
        }
        results
    }
}
