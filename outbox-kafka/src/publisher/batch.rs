//! The steps of one batch: enqueue, wait for the delivery reports, and an outcome for
//! every message left without one.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};
use outbox_core::publisher::cloudevents::CloudEvents;
use outbox_core::publisher::{OutboxRecord, PublishError};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use tokio::time::Instant;

use super::KafkaPublisher;
use super::classify::{classify, straggler};
use super::deliveries::{Outcome, Pending, delivery_outcome};
use super::producer::{PROBE_EVERY, STUCK_AFTER, leaders_answer};
use crate::headers;

/// The least a batch waits for a message's delivery report once the cluster has answered
/// for others of the batch (see `publish`).
const STRAGGLER_GRACE: Duration = Duration::from_secs(1);

fn kafka_headers(record: &OutboxRecord, cloudevents: Option<&CloudEvents>) -> OwnedHeaders {
    let pairs = headers::encode(record, cloudevents);
    let mut h = OwnedHeaders::new_with_capacity(pairs.len());
    for (key, value) in &pairs {
        h = h.insert(Header {
            key,
            value: Some(value.as_str()),
        });
    }
    h
}

impl KafkaPublisher {
    /// Enqueues one message, waiting while librdkafka's local queue is full.
    async fn enqueue(
        &self,
        producer: &FutureProducer,
        record: &OutboxRecord,
        deadline: Instant,
    ) -> Result<DeliveryFuture, KafkaError> {
        let mut kafka = FutureRecord::<str, [u8]>::to(&record.destination)
            .payload(record.payload.as_bytes())
            .headers(kafka_headers(record, self.inner.cloudevents.as_ref()))
            .timestamp(record.created_at.timestamp_millis());
        if let Some(key) = &record.partition_key {
            kafka = kafka.key(key.as_str());
        }
        loop {
            match producer.send_result(kafka) {
                Ok(delivery) => return Ok(delivery),
                Err((e, back))
                    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull)
                        && Instant::now() < deadline =>
                {
                    kafka = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }
}

/// How a batch's wait for its delivery reports ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    /// Every message in flight has its report.
    All,
    /// The cluster answered for some messages; the rest did not come within the grace.
    Stragglers,
    /// Nothing answered within `delivery_wait`, and the cluster did not answer either.
    Nothing,
    /// Nothing answered while the cluster answered metadata for the batch's topics, with
    /// a leader for each of their partitions, for `STUCK_AFTER` (counted across calls):
    /// the producer is wedged.
    Stuck,
}

impl KafkaPublisher {
    /// Step 1 of a batch: every message without an outcome is put in flight, except
    /// after a failure of its key. A message still in the producer from an earlier
    /// call is waited for, not sent again. A key whose message could not be enqueued
    /// sends nothing more in this batch.
    pub(super) async fn send(
        &self,
        producer: &FutureProducer,
        generation: u64,
        batch: &[OutboxRecord],
        outcomes: &mut [Option<Outcome>],
        started: Instant,
    ) -> Vec<(usize, Shared<BoxFuture<'static, Outcome>>)> {
        let deadline = started + self.inner.enqueue_timeout;
        let mut in_flight = Vec::with_capacity(batch.len());
        let mut refused_keys: HashSet<&str> = HashSet::new();
        for (i, record) in batch.iter().enumerate() {
            let key = record.partition_key.as_deref();
            match &outcomes[i] {
                Some(Outcome::Acked) => continue,
                Some(_) => {
                    refused_keys.extend(key);
                    continue;
                }
                None => {}
            }
            if key.is_some_and(|k| refused_keys.contains(k)) {
                outcomes[i] = Some(Outcome::NotAttempted);
                continue;
            }
            if let Some((report, unresolved)) = self.in_producer(record.id, generation) {
                in_flight.push((i, report));
                if unresolved {
                    // It may still fail (a purge, a reset producer): nothing later of its
                    // key goes into the producer behind it in this call.
                    refused_keys.extend(key);
                }
                continue;
            }
            match self.enqueue(producer, record, deadline).await {
                Ok(delivery) => {
                    let report = delivery.map(delivery_outcome).boxed().shared();
                    self.lock_pending().insert(
                        record.id,
                        Pending {
                            generation,
                            report: report.clone(),
                            since: Instant::now(),
                        },
                    );
                    in_flight.push((i, report));
                }
                Err(e) => {
                    refused_keys.extend(key);
                    let (error, code) = classify(&e);
                    outcomes[i] = Some(Outcome::Failed(error, code));
                }
            }
        }
        in_flight
    }

    /// Step 2: the delivery reports, as they come. Until the cluster has answered for
    /// some message of the batch (an outage: nothing answers), they are awaited for up
    /// to `delivery_wait`, asking the cluster now and then whether the producer is
    /// wedged. After that, a message whose report does not come within as long again as
    /// the batch has taken (at least STRAGGLER_GRACE) is not waited for: one failing
    /// message (a missing topic, a partition without a leader) must not hold back the
    /// other keys. Either way a message without a report stays in the producer
    /// (librdkafka never times it out) and the relay's retry waits for it
    /// (`in_producer`), so its key keeps its order.
    pub(super) async fn await_reports(
        &self,
        batch: &[OutboxRecord],
        in_flight: Vec<(usize, Shared<BoxFuture<'static, Outcome>>)>,
        outcomes: &mut [Option<Outcome>],
        started: Instant,
    ) -> Waited {
        // One deadline for the whole call, replacement round included.
        let deadline = started + self.inner.enqueue_timeout + self.inner.delivery_wait;
        let mut topics: Vec<String> = in_flight
            .iter()
            .map(|(i, _)| batch[*i].destination.clone())
            .collect();
        topics.sort_unstable();
        topics.dedup();
        let mut reports: futures_util::stream::FuturesUnordered<_> = in_flight
            .into_iter()
            .map(|(i, report)| async move { (i, report.await) })
            .collect();
        let mut answered = false;
        loop {
            let wait = if answered {
                started.elapsed().max(STRAGGLER_GRACE)
            } else {
                let left = deadline.saturating_duration_since(Instant::now());
                left.min(PROBE_EVERY)
            };
            match tokio::time::timeout(wait, futures_util::StreamExt::next(&mut reports)).await {
                Ok(Some((i, outcome))) => {
                    answered = true;
                    *self.lock_up_since() = None;
                    outcomes[i] = Some(outcome);
                }
                Ok(None) => return Waited::All,
                Err(_) if answered => return Waited::Stragglers,
                Err(_) => {
                    let up = match self.probe_client() {
                        Some(client) => leaders_answer(&client, &topics).await,
                        None => false,
                    };
                    let mut since = self.lock_up_since();
                    if up {
                        if since.get_or_insert_with(Instant::now).elapsed() >= STUCK_AFTER {
                            *since = None;
                            return Waited::Stuck;
                        }
                    } else {
                        *since = None;
                    }
                    if Instant::now() >= deadline {
                        return Waited::Nothing;
                    }
                }
            }
        }
    }

    /// Step 2b: an outcome for every message the wait left without one.
    pub(super) async fn unreported(
        &self,
        producer: &Arc<FutureProducer>,
        batch: &[OutboxRecord],
        outcomes: &mut [Option<Outcome>],
        waited: Waited,
        started: Instant,
    ) {
        let took = started.elapsed();
        let mut by_topic: HashMap<&str, PublishError> = HashMap::new();
        for (record, outcome) in batch.iter().zip(outcomes.iter_mut()) {
            if outcome.is_some() {
                continue;
            }
            let error = if waited == Waited::Stragglers {
                // One metadata lookup per topic, not per message.
                let topic = record.destination.as_str();
                if !by_topic.contains_key(topic) {
                    let error = straggler(producer, topic, took).await;
                    by_topic.insert(topic, error);
                }
                by_topic[topic].clone()
            } else {
                PublishError::unavailable(format!(
                    "kafka: no delivery report within {took:?} (the cluster did not answer); \
                     the message stays queued in the producer and is delivered in order when it does"
                ))
            };
            *outcome = Some(Outcome::Failed(error, None));
        }
    }
}
