//! [`KafkaPublisher`]: the relay's [`Publisher`] for Kafka.
//!
//! The relay calls one method, [`Publisher::publish`] (in this file); under it are four
//! layers, one file each, and the steps of a batch that use them:
//!
//! - **The builder** (`builder.rs`): [`KafkaPublisherBuilder`], the producer settings
//!   and their defaults (idempotence, `acks=all`, `message.timeout.ms=0`, a delivery
//!   timeout refused), and the start-up check that every destination has a topic.
//! - **Producer generations** (`producer.rs`): the publisher holds one idempotent
//!   `FutureProducer` at a time, numbered by its generation. One that cannot recover by
//!   itself (a delivery error that says so, a fatal error, or no report while a probe
//!   client of its own sees the cluster answer with a leader for every partition) is
//!   replaced by the next generation; the old one is dropped off the runtime.
//! - **The delivery registry** (`deliveries.rs`): every message handed to a producer,
//!   by id, with its generation and its delivery report, shared between the calls that
//!   wait for it. A retry of a message its producer still holds waits for that delivery
//!   instead of enqueueing a second copy behind later messages of its key; a replaced
//!   generation's entries go with it.
//! - **Error classification** (`classify.rs`): librdkafka's error codes as permanent,
//!   retryable or unavailable (an outage dead-letters nothing), the codes after which the
//!   producer is stuck, and why one message had no report while the rest of its batch
//!   did (a missing topic, or the cluster).
//!
//! A call runs the steps of a batch (`batch.rs`): enqueue every message without an
//! outcome (or wait for its delivery if the registry holds it), never after a failure
//! of its key; wait for the reports (all of `delivery_wait` while nothing answers, a
//! grace for stragglers once something does); give an outcome to every message left
//! without one. A producer found wedged on the way is replaced once per call, and the
//! batch is sent again, in order, by the next generation. Then the ordering contract:
//! after a failure of a key, no later message of that key is reported as a success; and
//! a producer that a delivery error says is stuck is replaced.

mod batch;
mod builder;
mod classify;
mod deliveries;
mod producer;

pub use builder::KafkaPublisherBuilder;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::publisher::cloudevents::CloudEvents;
use outbox_core::publisher::{OutboxRecord, PublishError, Publisher};
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;
use tokio::time::Instant;
use uuid::Uuid;

use self::batch::Waited;
use self::classify::is_stuck;
use self::deliveries::{Outcome, Pending};
use self::producer::{Current, release};
use crate::settings::Settings;

/// Publishes outbox messages to Kafka with an idempotent producer.
///
/// destination → topic, partition key → message key, payload → value (the bytes given to
/// `emit`, byte for byte), and the [headers](crate::headers). Every batch is sent pipelined: all
/// messages are enqueued, then the delivery reports are awaited and each becomes that
/// message's result.
///
/// librdkafka never times a message out (`message.timeout.ms=0`): a timed-out message
/// is dropped while later ones of its partition are still written, a gap that puts a
/// key out of order in the topic. Instead a batch waits at most
/// [`delivery_wait`](KafkaPublisherBuilder::delivery_wait) for its reports; a message
/// still without one stays queued in the producer, is reported as unavailable, and is
/// not enqueued again when the relay retries it: the retry waits for the same delivery.
/// See [`docs/kafka.md`](https://github.com/outbox-rs/outbox/blob/main/docs/kafka.md) for error classification and outage behaviour.
///
/// Cheap to clone; clones share one producer.
#[derive(Clone)]
pub struct KafkaPublisher {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    /// The first bootstrap server, for the `send` span's `server.address`.
    server: Option<(String, Option<u16>)>,
    /// CloudEvents binary mode: the `ce_*` headers.
    cloudevents: Option<CloudEvents>,
    producer: Mutex<Current>,
    rebuilds: AtomicU64,
    /// How long to wait for room in librdkafka's local queue, from the start of a batch:
    /// a quarter of `delivery_wait`.
    enqueue_timeout: Duration,
    /// How long a batch waits for its delivery reports (after the enqueue).
    delivery_wait: Duration,
    /// Messages handed to the producer whose report no call has seen yet, by id: a
    /// retry of one waits for its first delivery instead of enqueueing a second copy.
    pending: Mutex<HashMap<Uuid, Pending>>,
    /// Since when the cluster has answered for the topics of batches that got no
    /// delivery report (across calls: a relay retries with short waits); `None` once a
    /// report comes or the cluster stops answering.
    cluster_up_since: Mutex<Option<Instant>>,
    /// A client of its own for asking whether the cluster answers (created at the first
    /// question): a wedged producer's own connections may not say.
    probe: Mutex<Option<Arc<FutureProducer>>>,
}

/// What a batch can take beyond `1.25 × delivery_wait` by our own timers: the lookup of
/// a missing topic (2 s at most) and replacing a stuck producer (dropping the old one
/// flushes for up to 500 ms).
const PUBLISH_SLACK: Duration = Duration::from_millis(3000);

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("settings", &self.inner.settings)
            .field("rebuilds", &self.inner.rebuilds.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// How many times the producer was replaced after it got stuck (see [`docs/kafka.md`](https://github.com/outbox-rs/outbox/blob/main/docs/kafka.md)).
    pub fn rebuilds(&self) -> u64 {
        self.inner.rebuilds.load(Ordering::Relaxed)
    }

    /// The settings in use (secrets hidden in `Debug`).
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }
}

impl Publisher for KafkaPublisher {
    /// `1.25 × delivery_wait` plus 3 s: waiting for room in the local queue (a quarter
    /// of it), the delivery reports, the lookup of a missing topic and replacing a stuck
    /// producer.
    fn max_publish_time(&self) -> Option<Duration> {
        Some(self.inner.enqueue_timeout + self.inner.delivery_wait + PUBLISH_SLACK)
    }

    /// Calls may overlap: each keeps its own outcomes; the producer, the deliveries it
    /// holds and its replacement are shared under locks, and keep each partition's order.
    fn max_batches_in_flight(&self) -> usize {
        4
    }

    fn messaging_system(&self) -> &'static str {
        "kafka"
    }

    fn server(&self) -> Option<(&str, Option<u16>)> {
        let (host, port) = self.inner.server.as_ref()?;
        Some((host, *port))
    }

    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let started = Instant::now();
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let (mut generation, mut producer) = self.current();
        let mut replaced = false;
        loop {
            let in_flight = self
                .send(&producer, generation, batch, &mut outcomes, started)
                .await;
            let waited = self
                .await_reports(batch, in_flight, &mut outcomes, started)
                .await;
            self.forget_resolved(batch, &outcomes);
            match waited {
                Waited::Stuck if !replaced => {
                    // Once per batch: what the old producer held is sent again, in batch
                    // order, by the new one, within this same call.
                    replaced = true;
                    release(producer).await;
                    self.rebuild(
                        generation,
                        "no delivery report while the cluster answers for the batch's topics",
                    )
                    .await;
                    (generation, producer) = self.current();
                }
                waited => {
                    self.unreported(&producer, batch, &mut outcomes, waited, started)
                        .await;
                    break;
                }
            }
        }
        // 3. The ordering contract: after a failure of key K, no later K is a success.
        let mut failed_keys: HashSet<&str> = HashSet::new();
        let mut stuck: Option<RDKafkaErrorCode> = None;
        let mut results = Vec::with_capacity(batch.len());
        for (record, outcome) in batch.iter().zip(outcomes) {
            let key = record.partition_key.as_deref();
            let result = match outcome {
                Some(Outcome::Acked) => match key.filter(|k| failed_keys.contains(k)) {
                    None => Ok(()),
                    Some(k) => {
                        tracing::warn!(
                            seq = record.seq, id = %record.id, key = k,
                            "outbox-kafka: acknowledged after an earlier message of its key failed; reported \
                             as failed so it is published again after that one (consumers skip the duplicate)"
                        );
                        // Nothing is wrong with this message: it never counts towards
                        // max_attempts (its predecessor's failure does).
                        Err(PublishError::unavailable(
                            "kafka: acknowledged after an earlier message of the same key failed; \
                             published again in order",
                        ))
                    }
                },
                Some(Outcome::Failed(error, code)) => {
                    if let Some(k) = key {
                        failed_keys.insert(k);
                    }
                    if let Some(code) = code.filter(|c| is_stuck(*c)) {
                        stuck = Some(code);
                    }
                    Err(error)
                }
                Some(Outcome::NotAttempted) | None => Err(PublishError::not_attempted()),
            };
            results.push(result);
        }

        // 4. A producer that cannot recover by itself is replaced. What it still holds is
        //    purged with it (reported as failed), and the relay's retries enqueue it
        //    again, in order, in the new one; a copy the old one had already written is
        //    an earlier duplicate that consumers skip.
        let fatal = producer.client().fatal_error();
        release(producer).await;
        if let Some((code, reason)) = fatal {
            self.rebuild(generation, &format!("fatal error {code:?}: {reason}"))
                .await;
        } else if let Some(code) = stuck {
            self.rebuild(generation, &format!("delivery failed with {code:?}"))
                .await;
        }
        results
    }
}
