//! [`KafkaPublisher`]: the relay's [`Publisher`] for Kafka.

use std::collections::{BTreeSet, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::publisher::{OutboxRecord, PublishError, Publisher};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use tokio::time::Instant;

use crate::Result;
use crate::headers;
use crate::settings::Settings;
use crate::topics::{self, CreateTopics};

/// Publishes outbox messages to Kafka with an idempotent producer.
///
/// destination → topic, partition key → message key, payload → value (the JSON text as
/// stored), and the [headers](crate::headers). Every batch is sent pipelined: all
/// messages are enqueued, then every delivery report is awaited and becomes that
/// message's result. See `docs/kafka.md` for error classification and outage behaviour.
///
/// Cheap to clone; clones share one producer.
#[derive(Clone)]
pub struct KafkaPublisher {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    producer: Mutex<Current>,
    rebuilds: AtomicU64,
    /// How long to wait for room in librdkafka's local queue, from the start of a batch:
    /// a quarter of `message_timeout`, so that a batch takes at most 1.25 times it (the
    /// last message enqueued then has `message.timeout.ms` for its delivery report).
    enqueue_timeout: Duration,
    message_timeout: Duration,
}

/// What a batch can take beyond `1.25 × message.timeout.ms` by our own timers:
/// librdkafka checks message timeouts about once a second, and a stuck producer is
/// replaced before `publish` returns (dropping the old one flushes for up to 500 ms).
const PUBLISH_SLACK: Duration = Duration::from_millis(2000);

struct Current {
    generation: u64,
    producer: Arc<FutureProducer>,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("settings", &self.inner.settings)
            .field("rebuilds", &self.inner.rebuilds.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Configures a [`KafkaPublisher`]; start with [`KafkaPublisher::builder`].
#[derive(Debug, Clone)]
pub struct KafkaPublisherBuilder {
    settings: Settings,
    destinations: BTreeSet<String>,
    check_catalog: bool,
    create: Option<CreateTopics>,
    startup_timeout: Duration,
}

impl KafkaPublisher {
    /// A publisher for the cluster at `bootstrap_servers` (`host:port[,host:port...]`).
    ///
    /// Defaults: `enable.idempotence=true`, `acks=all`, `linger.ms=1`,
    /// `message.timeout.ms=20000` (see [`message_timeout`](KafkaPublisherBuilder::message_timeout)
    /// for how it relates to the relay's `publish_timeout`), `compression.type=none`.
    pub fn builder(bootstrap_servers: impl Into<String>) -> KafkaPublisherBuilder {
        let mut settings = Settings::default();
        settings.set("bootstrap.servers", bootstrap_servers);
        KafkaPublisherBuilder {
            settings,
            destinations: BTreeSet::new(),
            check_catalog: true,
            create: None,
            startup_timeout: Duration::from_secs(10),
        }
    }

    /// How many times the producer was replaced after it got stuck (see `docs/kafka.md`).
    pub fn rebuilds(&self) -> u64 {
        self.inner.rebuilds.load(Ordering::Relaxed)
    }

    /// The settings in use (secrets hidden in `Debug`).
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }
}

impl KafkaPublisherBuilder {
    /// Any librdkafka producer property (SASL, TLS, `client.id`, batching, ...). Wins
    /// over the defaults, `enable.idempotence` and `acks` included: weakening those gives
    /// up the ordering guarantees.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.set(key, value);
        self
    }

    /// How long the producer waits to fill a batch (`linger.ms`).
    pub fn linger(self, linger: Duration) -> Self {
        self.set("linger.ms", linger.as_millis().to_string())
    }

    /// `compression.type`: `none`, `gzip`, `snappy`, `lz4` or `zstd`.
    pub fn compression(self, codec: impl Into<String>) -> Self {
        self.set("compression.type", codec)
    }

    /// How long a message may take to be acknowledged, retries included
    /// (`message.timeout.ms`). A batch may take `1.25 ×` this plus 2 s by the publisher's
    /// own timers ([`Publisher::max_publish_time`]), and longer when librdkafka waits
    /// for a request in flight: keep the relay's `publish_timeout` well above it (the
    /// default 20 s gives 27 s, below the default 30 s; see `docs/kafka.md`).
    pub fn message_timeout(self, timeout: Duration) -> Self {
        self.set("message.timeout.ms", timeout.as_millis().to_string())
    }

    /// How long one produce request may take (`request.timeout.ms`).
    pub fn request_timeout(self, timeout: Duration) -> Self {
        self.set("request.timeout.ms", timeout.as_millis().to_string())
    }

    /// Also check (or create) this topic at start-up, besides the catalog's destinations.
    pub fn destination(mut self, topic: impl Into<String>) -> Self {
        self.destinations.insert(topic.into());
        self
    }

    /// Do not check the destinations of the event catalog (`outbox_core::catalog()`) at
    /// start-up; only those given with [`destination`](Self::destination).
    pub fn skip_catalog_check(mut self) -> Self {
        self.check_catalog = false;
        self
    }

    /// Create missing topics at start-up with this many partitions and replicas, instead
    /// of failing.
    pub fn create_missing_topics(mut self, partitions: i32, replication: i32) -> Self {
        self.create = Some(CreateTopics {
            partitions,
            replication,
        });
        self
    }

    /// Time allowed for the start-up metadata and topic creation requests. Default 10 s.
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = timeout;
        self
    }

    /// Creates the producer and checks that every destination has a topic: those of the
    /// event catalog (unless [skipped](Self::skip_catalog_check)) and those given with
    /// [`destination`](Self::destination). A missing topic is an
    /// [`Error::MissingTopics`] naming it, unless [created](Self::create_missing_topics).
    pub async fn build(mut self) -> Result<KafkaPublisher> {
        self.settings.set_default("enable.idempotence", "true");
        self.settings.set_default("acks", "all");
        // The relay hands over whole batches, so a long linger adds latency without
        // making batches fuller.
        self.settings.set_default("linger.ms", "1");
        // `delivery.timeout.ms` is the same setting: a default under the other name would
        // override the user's (librdkafka applies them in key order).
        if self.settings.get("delivery.timeout.ms").is_none() {
            self.settings.set_default("message.timeout.ms", "20000");
        }
        self.settings.set_default("compression.type", "none");
        let producer = Arc::new(create_producer(&self.settings)?);
        let wanted: BTreeSet<String> =
            outbox_core::catalog::destinations_to_check(self.destinations, self.check_catalog)
                .into_iter()
                .collect();
        topics::ensure(
            &producer,
            &self.settings,
            &wanted,
            self.create,
            self.startup_timeout,
        )
        .await?;
        // `delivery.timeout.ms` is librdkafka's other name for it; 0 means no timeout.
        let message_timeout = ["message.timeout.ms", "delivery.timeout.ms"]
            .iter()
            .find_map(|k| self.settings.get(k))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::from_secs(20), Duration::from_millis);
        tracing::info!(settings = ?self.settings, "outbox-kafka publisher ready");
        Ok(KafkaPublisher {
            inner: Arc::new(Inner {
                settings: self.settings,
                producer: Mutex::new(Current {
                    generation: 0,
                    producer,
                }),
                rebuilds: AtomicU64::new(0),
                enqueue_timeout: message_timeout / 4,
                message_timeout,
            }),
        })
    }
}

fn create_producer(settings: &Settings) -> Result<FutureProducer> {
    settings.create()
}

/// Drops a producer handle; the last one is dropped off the runtime, because dropping a
/// producer purges, flushes (up to 500 ms) and joins librdkafka's threads.
async fn release(producer: Arc<FutureProducer>) {
    if let Some(last) = Arc::into_inner(producer) {
        let _ = tokio::task::spawn_blocking(move || drop(last)).await;
    }
}

/// What one message's delivery attempt came to.
enum Outcome {
    Acked,
    Failed(PublishError, Option<RDKafkaErrorCode>),
    NotAttempted,
}

/// The least a batch waits for a message's delivery report once the cluster has answered
/// for others of the batch (see `publish`).
const STRAGGLER_GRACE: Duration = Duration::from_secs(1);

/// Why a message had no delivery report while the rest of its batch did: its topic does
/// not exist (and is not created; a per-message error that counts towards
/// `max_attempts`, named so that `outbox dead` says it), or something the cluster will
/// sort out (unavailable: no attempt counted).
async fn straggler(producer: &Arc<FutureProducer>, topic: &str, waited: Duration) -> PublishError {
    let (client, name) = (Arc::clone(producer), topic.to_owned());
    let exists = tokio::task::spawn_blocking(move || {
        let metadata = client
            .client()
            .fetch_metadata(Some(&name), Duration::from_secs(2))
            .ok()?;
        // Only "unknown topic" says it does not exist; any other topic error (no leader,
        // not authorized) is not that.
        let unknown = rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART;
        Some(match metadata.topics().iter().find(|t| t.name() == name) {
            None => false,
            Some(topic) => topic.error() != Some(unknown),
        })
    })
    .await
    .ok()
    .flatten();
    match exists {
        Some(false) => PublishError::retryable(format!(
            "kafka: topic {topic} does not exist (and the cluster does not create it): \
             create it, or fix the message's destination"
        )),
        _ => PublishError::unavailable(format!(
            "kafka: no delivery report within {waited:?}, while the rest of the batch was \
             acknowledged; retried"
        )),
    }
}

/// Error codes after which librdkafka's idempotent producer may not recover by itself:
/// its producer id / sequence state no longer matches the broker's, and every later send
/// fails. A timed-out message is among them: once one timed out during an outage, later
/// sends fail with `UnknownProducerId` / `ProducerFenced` on some brokers, and time out
/// forever on others (measured on tansu 0.6, with the broker back up).
fn is_stuck(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageTimedOut
            | RDKafkaErrorCode::UnknownProducerId
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
            | RDKafkaErrorCode::OutOfOrderSequenceNumber
            | RDKafkaErrorCode::InvalidProducerIdMapping
            | RDKafkaErrorCode::Fatal
    )
}

/// Permanent: the message itself can never be accepted. Unavailable: the cluster could
/// not be reached or did not answer in time, or the producer lost its state — nothing
/// about the message, so it never counts towards `max_attempts` (an outage dead-letters
/// nothing). Retryable: the rest (a topic that does not exist or may not be written).
fn classify(error: &KafkaError) -> (PublishError, Option<RDKafkaErrorCode>) {
    let code = error.rdkafka_error_code();
    let text = match code {
        Some(code) => format!("kafka: {error} ({code:?})"),
        None => format!("kafka: {error}"),
    };
    let permanent = matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::BadMessage
        )
    );
    let unavailable = match code {
        None => true,
        Some(code) => is_stuck(code) || is_unavailable(code),
    };
    let error = if permanent {
        PublishError::permanent(text)
    } else if unavailable {
        PublishError::unavailable(text)
    } else {
        PublishError::retryable(text)
    };
    (error, code)
}

/// The cluster is down, unreachable, busy or moving leaders: retried for as long as it
/// lasts.
fn is_unavailable(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::Resolve
            | RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::QueueFull
            | RDKafkaErrorCode::LeaderNotAvailable
            | RDKafkaErrorCode::NotLeaderForPartition
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::BrokerNotAvailable
            | RDKafkaErrorCode::NetworkException
            | RDKafkaErrorCode::NotEnoughReplicas
            | RDKafkaErrorCode::NotEnoughReplicasAfterAppend
            | RDKafkaErrorCode::KafkaStorageError
            | RDKafkaErrorCode::ClusterAuthorizationFailed
    )
}

fn kafka_headers(record: &OutboxRecord) -> OwnedHeaders {
    let id = record.id.to_string();
    let version = record.event_version.map(|v| v.to_string());
    let mut h = OwnedHeaders::new_with_capacity(4 + record.headers.len())
        .insert(Header {
            key: headers::MESSAGE_ID,
            value: Some(id.as_str()),
        })
        .insert(Header {
            key: headers::EVENT_TYPE,
            value: Some(record.event_type.as_str()),
        })
        .insert(Header {
            key: headers::CONTENT_TYPE,
            value: Some(headers::JSON),
        });
    if let Some(version) = &version {
        h = h.insert(Header {
            key: headers::EVENT_VERSION,
            value: Some(version.as_str()),
        });
    }
    for (key, value) in &record.headers {
        if headers::RESERVED.contains(&key.as_str()) {
            tracing::debug!(id = %record.id, header = %key, "row header shadows a reserved header; not copied");
            continue;
        }
        h = h.insert(Header {
            key,
            value: Some(value.as_str()),
        });
    }
    h
}

impl KafkaPublisher {
    fn current(&self) -> (u64, Arc<FutureProducer>) {
        let current = self
            .inner
            .producer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (current.generation, Arc::clone(&current.producer))
    }

    /// Replaces the producer of `generation` (unless someone else already did).
    async fn rebuild(&self, generation: u64, reason: &str) {
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
        self.inner.rebuilds.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("outbox_kafka_producer_rebuilds_total").increment(1);
        tracing::warn!(
            reason,
            generation = generation + 1,
            "outbox-kafka: the idempotent producer cannot recover by itself; replaced it with a new one"
        );
        release(old).await;
    }

    /// Enqueues one message, waiting while librdkafka's local queue is full.
    async fn enqueue(
        &self,
        producer: &FutureProducer,
        record: &OutboxRecord,
        deadline: Instant,
    ) -> Result<DeliveryFuture, KafkaError> {
        let mut kafka = FutureRecord::<str, str>::to(&record.destination)
            .payload(record.payload.as_str())
            .headers(kafka_headers(record))
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

impl Publisher for KafkaPublisher {
    /// `1.25 × message.timeout.ms` plus 2 s: waiting for room in the local queue (a
    /// quarter of it), the last message's delivery report, and replacing a stuck producer.
    /// librdkafka can report later than `message.timeout.ms` for a message whose request
    /// was in flight when the broker went away (measured: 8.7 s with a 4 s timeout, see
    /// `docs/kafka.md`), so this is the least a `publish_timeout` must allow, not a
    /// guarantee.
    fn max_publish_time(&self) -> Option<Duration> {
        if self.inner.message_timeout.is_zero() {
            return None; // `message.timeout.ms=0`: librdkafka never times a message out
        }
        Some(self.inner.enqueue_timeout + self.inner.message_timeout + PUBLISH_SLACK)
    }

    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let (generation, producer) = self.current();
        let deadline = Instant::now() + self.inner.enqueue_timeout;
        let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(batch.len());
        let mut in_flight: Vec<(usize, DeliveryFuture)> = Vec::with_capacity(batch.len());
        let mut refused_keys: HashSet<&str> = HashSet::new();

        // 1. Everything in flight at once. A key whose message could not even be enqueued
        //    sends nothing more in this batch.
        for (i, record) in batch.iter().enumerate() {
            let key = record.partition_key.as_deref();
            if key.is_some_and(|k| refused_keys.contains(k)) {
                outcomes.push(Some(Outcome::NotAttempted));
                continue;
            }
            match self.enqueue(&producer, record, deadline).await {
                Ok(delivery) => {
                    outcomes.push(None);
                    in_flight.push((i, delivery));
                }
                Err(e) => {
                    if let Some(k) = key {
                        refused_keys.insert(k);
                    }
                    let (error, code) = classify(&e);
                    outcomes.push(Some(Outcome::Failed(error, code)));
                }
            }
        }
        // 2. The delivery reports, as they come. Until the cluster has answered for some
        //    message of the batch (an outage: nothing answers), every report is awaited.
        //    After that, a message whose report does not come within as long again as the
        //    batch has taken (at least STRAGGLER_GRACE) is not waited for: one failing
        //    message (a missing topic, a partition without a leader) must not hold back the
        //    other keys for its `message.timeout.ms`. It stays in librdkafka (a later
        //    report is dropped) and is retried; its key waits for that retry, which the
        //    idempotent producer orders after it, so the key keeps its order.
        let started = Instant::now();
        let mut reports: futures_util::stream::FuturesUnordered<_> = in_flight
            .into_iter()
            .map(|(i, delivery)| async move { (i, delivery.await) })
            .collect();
        let mut answered = false;
        let mut stragglers = false;
        loop {
            let next = if answered {
                let grace = started.elapsed().max(STRAGGLER_GRACE);
                match tokio::time::timeout(grace, futures_util::StreamExt::next(&mut reports)).await
                {
                    Ok(next) => next,
                    Err(_) => {
                        stragglers = true;
                        break;
                    }
                }
            } else {
                futures_util::StreamExt::next(&mut reports).await
            };
            let Some((i, report)) = next else { break };
            answered = true;
            outcomes[i] = Some(match report {
                Ok(Ok(_delivery)) => Outcome::Acked,
                Ok(Err((e, _message))) => {
                    let (error, code) = classify(&e);
                    Outcome::Failed(error, code)
                }
                Err(_canceled) => Outcome::Failed(
                    PublishError::unavailable(
                        "kafka: the producer was closed before it reported delivery",
                    ),
                    None,
                ),
            });
        }
        drop(reports);
        if stragglers {
            // One metadata lookup per topic, not per message.
            let waited = started.elapsed();
            let mut by_topic: std::collections::HashMap<&str, PublishError> =
                std::collections::HashMap::new();
            for (record, outcome) in batch.iter().zip(outcomes.iter_mut()) {
                if outcome.is_none() {
                    let topic = record.destination.as_str();
                    if !by_topic.contains_key(topic) {
                        let error = straggler(&producer, topic, waited).await;
                        by_topic.insert(topic, error);
                    }
                    *outcome = Some(Outcome::Failed(by_topic[topic].clone(), None));
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

        // 4. A producer that cannot recover by itself is replaced. Every message of this
        //    batch has its report, so nothing of ours is in flight in the old one.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        let e = |code| KafkaError::MessageProduction(code);
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidTopic,
            RDKafkaErrorCode::InvalidRecord,
        ] {
            assert_eq!(
                classify(&e(code)).0.kind(),
                outbox_core::publisher::PublishErrorKind::Permanent,
                "{code:?}"
            );
        }
        for code in [
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::UnknownTopic,
            RDKafkaErrorCode::TopicAuthorizationFailed,
        ] {
            assert_eq!(
                classify(&e(code)).0.kind(),
                outbox_core::publisher::PublishErrorKind::Retryable,
                "{code:?}"
            );
        }
        // An outage says nothing about the message: never dead-lettered for it.
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::UnknownProducerId,
            RDKafkaErrorCode::NotLeaderForPartition,
        ] {
            assert_eq!(
                classify(&e(code)).0.kind(),
                outbox_core::publisher::PublishErrorKind::Unavailable,
                "{code:?}"
            );
        }
        assert!(is_stuck(RDKafkaErrorCode::UnknownProducerId));
        assert!(is_stuck(RDKafkaErrorCode::ProducerFenced));
        assert!(is_stuck(RDKafkaErrorCode::MessageTimedOut));
        assert!(!is_stuck(RDKafkaErrorCode::MessageSizeTooLarge));
        assert!(!is_stuck(RDKafkaErrorCode::UnknownTopicOrPartition));
    }
}
