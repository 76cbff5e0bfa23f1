//! The delivery registry: every message handed to a producer, by id, with its
//! generation and its delivery report, so that a retry waits for a delivery still under
//! way instead of enqueueing a second copy behind later messages of its key.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};
use outbox_core::publisher::{OutboxRecord, PublishError};
use rdkafka::producer::DeliveryFuture;
use rdkafka::types::RDKafkaErrorCode;
use tokio::time::Instant;
use uuid::Uuid;

use super::KafkaPublisher;
use super::classify::classify;

/// A message in the producer: its delivery report, shared between the calls that wait
/// for it.
pub(super) struct Pending {
    pub(super) generation: u64,
    pub(super) report: Shared<BoxFuture<'static, Outcome>>,
    pub(super) since: Instant,
}

/// How long a resolved report nobody asked for again is kept (a retry after it finds
/// the message already delivered and sends no second copy).
const KEEP_RESOLVED: Duration = Duration::from_secs(300);

/// What one message's delivery attempt came to.
#[derive(Clone)]
pub(super) enum Outcome {
    Acked,
    Failed(PublishError, Option<RDKafkaErrorCode>),
    NotAttempted,
}

/// A delivery report as the batch sees it.
pub(super) fn delivery_outcome(report: <DeliveryFuture as std::future::Future>::Output) -> Outcome {
    match report {
        Ok(Ok(_delivery)) => Outcome::Acked,
        Ok(Err((e, _message))) => {
            let (error, code) = classify(&e);
            Outcome::Failed(error, code)
        }
        Err(_canceled) => Outcome::Failed(
            PublishError::unavailable("kafka: the producer was closed before it reported delivery"),
            None,
        ),
    }
}

impl KafkaPublisher {
    pub(super) fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Pending>> {
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The delivery of message `id` if the producer of `generation` still holds it (or
    /// delivered it): a retry waits for that instead of enqueueing a second copy behind
    /// later messages of its key. A failed delivery is forgotten: the retry sends it
    /// again.
    pub(super) fn in_producer(
        &self,
        id: Uuid,
        generation: u64,
    ) -> Option<(Shared<BoxFuture<'static, Outcome>>, bool)> {
        let mut pending = self.lock_pending();
        let entry = pending.get(&id)?;
        // Polled, not peeked: `peek` only sees a report some call has already polled,
        // and a report that came after its call gave up was never polled.
        let now = entry.report.clone().now_or_never();
        let usable = entry.generation == generation && matches!(now, None | Some(Outcome::Acked));
        if usable {
            Some((entry.report.clone(), now.is_none()))
        } else {
            pending.remove(&id);
            None
        }
    }

    /// Forgets the deliveries this batch saw, and those resolved long ago that nobody
    /// asked for again (the relay that sent them lost the key, or the row was
    /// discarded). Unresolved ones stay: they are still in the producer.
    pub(super) fn forget_resolved(&self, batch: &[OutboxRecord], outcomes: &[Option<Outcome>]) {
        let mut pending = self.lock_pending();
        for (record, outcome) in batch.iter().zip(outcomes) {
            if outcome.is_some() {
                pending.remove(&record.id);
            }
        }
        let now = Instant::now();
        pending.retain(|_, p| {
            p.report.clone().now_or_never().is_none() || now - p.since < KEEP_RESOLVED
        });
    }
}
