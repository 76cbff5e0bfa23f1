//! Producer generations: the one producer in use, its replacement when it cannot
//! recover by itself, and the probe client that tells a wedged producer from an outage.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::producer::{FutureProducer, Producer};
use tokio::time::Instant;

use super::KafkaPublisher;
use crate::Result;
use crate::settings::Settings;

/// The publisher's own metric, described to the recorder when a publisher is built.
pub(crate) const REBUILDS: outbox_core::telemetry::Metric = outbox_core::telemetry::Metric::new(
    "outbox_kafka_producer_rebuilds_total",
    outbox_core::telemetry::Kind::Counter,
    None,
    &[],
    "Idempotent producers the Kafka publisher replaced because librdkafka could not recover them (a fatal error).",
);

pub(super) struct Current {
    pub(super) generation: u64,
    pub(super) producer: Arc<FutureProducer>,
}

pub(super) fn create_producer(settings: &Settings) -> Result<FutureProducer> {
    settings.create()
}

/// Drops a producer handle; the last one is dropped off the runtime, because dropping a
/// producer purges, flushes (up to 500 ms) and joins librdkafka's threads.
pub(super) async fn release(producer: Arc<FutureProducer>) {
    if let Some(last) = Arc::into_inner(producer) {
        let _ = tokio::task::spawn_blocking(move || drop(last)).await;
    }
}

impl KafkaPublisher {
    pub(super) fn current(&self) -> (u64, Arc<FutureProducer>) {
        let current = self
            .inner
            .producer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (current.generation, Arc::clone(&current.producer))
    }

    /// The probe client, created on first use (idempotence off: it never sends).
    pub(super) fn probe_client(&self) -> Option<Arc<FutureProducer>> {
        let mut probe = self
            .inner
            .probe
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if probe.is_none() {
            let mut settings = self.inner.settings.clone();
            settings.set("enable.idempotence", "false");
            match create_producer(&settings) {
                Ok(client) => *probe = Some(Arc::new(client)),
                Err(e) => {
                    tracing::warn!(error = %e, "outbox-kafka: could not create the probe client")
                }
            }
        }
        probe.clone()
    }

    pub(super) fn lock_up_since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.inner
            .cluster_up_since
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Replaces the producer of `generation` (unless someone else already did).
    pub(super) async fn rebuild(&self, generation: u64, reason: &str) {
        let fresh = match create_producer(&self.inner.settings) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                tracing::error!(error = %e, "outbox-kafka: could not create a new producer; keeping the old one");
                return;
            }
        };
        let old = {
            let mut current = self
                .inner
                .producer
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if current.generation != generation {
                return;
            }
            current.generation += 1;
            std::mem::replace(&mut current.producer, fresh)
        };
        // What the old producer held is purged with it: never waited for again.
        self.lock_pending().retain(|_, p| p.generation > generation);
        self.inner.rebuilds.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(REBUILDS.name).increment(1);
        tracing::warn!(
            reason,
            generation = generation + 1,
            "outbox-kafka: the idempotent producer cannot recover by itself; replaced it with a new one"
        );
        release(old).await;
    }
}

/// How often a batch that has no report at all asks the cluster whether it answers.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(500);

/// How long the cluster must answer while a batch gets no report before its producer is
/// considered wedged and replaced. A producer that recovers by itself reports within a
/// few hundred milliseconds of reconnecting (`reconnect.backoff.max.ms` is 1 s).
pub(super) const STUCK_AFTER: Duration = Duration::from_millis(1500);

/// Whether the cluster answers a metadata request for `topics` with a leader for every
/// partition (a broker that is back, a topic that exists): then a producer that still
/// gets no delivery report is wedged, not waiting for the cluster.
pub(super) async fn leaders_answer(probe: &Arc<FutureProducer>, topics: &[String]) -> bool {
    let (client, topics) = (Arc::clone(probe), topics.to_vec());
    tokio::task::spawn_blocking(move || {
        // One request: for the one topic, or for all of them.
        let only = match topics.as_slice() {
            [one] => Some(one.as_str()),
            _ => None,
        };
        let Ok(metadata) = client.client().fetch_metadata(only, PROBE_EVERY) else {
            return false;
        };
        topics.iter().all(|name| {
            metadata.topics().iter().any(|t| {
                t.name() == name
                    && t.error().is_none()
                    && !t.partitions().is_empty()
                    && t.partitions()
                        .iter()
                        .all(|p| p.error().is_none() && p.leader() >= 0)
            })
        })
    })
    .await
    .unwrap_or(false)
}
