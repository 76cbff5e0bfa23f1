//! [`KafkaPublisher`]: the relay's [`Publisher`] for Kafka.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Shared};
use outbox_core::publisher::cloudevents::CloudEvents;
use outbox_core::publisher::{OutboxRecord, PublishError, Publisher};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use tokio::time::Instant;
use uuid::Uuid;

use crate::Result;
use crate::headers;
use crate::settings::Settings;
use crate::topics::{self, CreateTopics};

/// Publishes outbox messages to Kafka with an idempotent producer.
///
/// destination → topic, partition key → message key, payload → value (the JSON text as
/// stored), and the [headers](crate::headers). Every batch is sent pipelined: all
/// messages are enqueued, then the delivery reports are awaited and each becomes that
/// message's result.
///
/// librdkafka never times a message out (`message.timeout.ms=0`): a timed-out message
/// is dropped while later ones of its partition are still written, a gap that puts a
/// key out of order in the topic. Instead a batch waits at most
/// [`delivery_wait`](KafkaPublisherBuilder::delivery_wait) for its reports; a message
/// still without one stays queued in the producer, is reported as unavailable, and is
/// not enqueued again when the relay retries it: the retry waits for the same delivery.
/// See `docs/kafka.md` for error classification and outage behaviour.
///
/// Cheap to clone; clones share one producer.
#[derive(Clone)]
pub struct KafkaPublisher {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
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

/// A message in the producer: its delivery report, shared between the calls that wait
/// for it.
struct Pending {
    generation: u64,
    report: Shared<BoxFuture<'static, Outcome>>,
    since: Instant,
}

/// How long a resolved report nobody asked for again is kept (a retry after it finds
/// the message already delivered and sends no second copy).
const KEEP_RESOLVED: Duration = Duration::from_secs(300);

/// What a batch can take beyond `1.25 × delivery_wait` by our own timers: the lookup of
/// a missing topic (2 s at most) and replacing a stuck producer (dropping the old one
/// flushes for up to 500 ms).
const PUBLISH_SLACK: Duration = Duration::from_millis(3000);

/// The default [`delivery_wait`](KafkaPublisherBuilder::delivery_wait).
const DEFAULT_DELIVERY_WAIT: Duration = Duration::from_secs(20);

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
    delivery_wait: Duration,
    cloudevents: Option<CloudEvents>,
}

impl KafkaPublisher {
    /// A publisher for the cluster at `bootstrap_servers` (`host:port[,host:port...]`).
    ///
    /// Defaults: `enable.idempotence=true`, `acks=all`, `linger.ms=1`,
    /// `message.timeout.ms=0` (never: see [`delivery_wait`](KafkaPublisherBuilder::delivery_wait)),
    /// `compression.type=none`.
    pub fn builder(bootstrap_servers: impl Into<String>) -> KafkaPublisherBuilder {
        let mut settings = Settings::default();
        settings.set("bootstrap.servers", bootstrap_servers);
        KafkaPublisherBuilder {
            settings,
            destinations: BTreeSet::new(),
            check_catalog: true,
            create: None,
            startup_timeout: Duration::from_secs(10),
            delivery_wait: DEFAULT_DELIVERY_WAIT,
            cloudevents: None,
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

    /// How long a batch waits for its delivery reports before it returns (default 20 s).
    ///
    /// A message whose report has not come by then is **not** dropped: it stays queued
    /// in the producer, which delivers it in order when the cluster answers. The batch
    /// reports it as unavailable (no attempt counted), and the relay's retry waits for
    /// that same delivery instead of sending a second copy. A shorter wait makes the
    /// relay notice an outage sooner; it never reorders or drops anything. A batch takes
    /// at most `1.25 ×` this plus 3 s ([`Publisher::max_publish_time`]: 28 s with the
    /// default, below the relay's default `publish_timeout` of 30 s).
    pub fn delivery_wait(mut self, wait: Duration) -> Self {
        self.delivery_wait = wait;
        self
    }

    /// CloudEvents 1.0 binary content mode: every message also carries the `ce_id`,
    /// `ce_source`, `ce_specversion`, `ce_type` and `ce_time` headers (Kafka binding),
    /// with the outbox headers and the payload unchanged
    /// ([`outbox_core::publisher::cloudevents`]).
    pub fn cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    /// Renamed [`delivery_wait`](Self::delivery_wait): it no longer sets librdkafka's
    /// `message.timeout.ms`, whose timed-out messages leave gaps that reorder a key.
    #[deprecated(
        since = "0.2.0",
        note = "use `delivery_wait`: messages no longer time out in librdkafka (a timeout leaves a gap that reorders a key)"
    )]
    pub fn message_timeout(self, timeout: Duration) -> Self {
        self.delivery_wait(timeout)
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
        check_no_delivery_timeout(&self.settings)?;
        self.settings.set_default("message.timeout.ms", "0");
        // Back within a second of a broker's return (librdkafka's default backs off
        // reconnects up to 10 s).
        self.settings
            .set_default("reconnect.backoff.max.ms", "1000");
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
        tracing::info!(settings = ?self.settings, "outbox-kafka publisher ready");
        Ok(KafkaPublisher {
            inner: Arc::new(Inner {
                settings: self.settings,
                cloudevents: self.cloudevents,
                producer: Mutex::new(Current {
                    generation: 0,
                    producer,
                }),
                rebuilds: AtomicU64::new(0),
                enqueue_timeout: self.delivery_wait / 4,
                delivery_wait: self.delivery_wait,
                pending: Mutex::new(HashMap::new()),
                cluster_up_since: Mutex::new(None),
                probe: Mutex::new(None),
            }),
        })
    }
}

/// Refuses a delivery timeout on the idempotent producer: librdkafka drops a timed-out
/// message while later messages of its partition are still written ("1,2,3,4,5 →
/// written 1,4,5"), and no later re-send puts it back in front of them.
fn check_no_delivery_timeout(settings: &Settings) -> Result<()> {
    let idempotent = settings
        .get("enable.idempotence")
        .is_none_or(|v| v.trim() != "false");
    for key in ["message.timeout.ms", "delivery.timeout.ms"] {
        if let Some(value) = settings.get(key) {
            if idempotent && value.trim() != "0" {
                return Err(crate::Error::Config(format!(
                    "{key}={value}: a delivery timeout lets librdkafka drop a message while later \
                     messages of its key are still written, which puts the key out of order in the \
                     topic; remove the setting (the publisher leaves it at 0, never) and bound how \
                     long a batch waits with `.delivery_wait(..)` instead"
                )));
            }
        }
    }
    Ok(())
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
#[derive(Clone)]
enum Outcome {
    Acked,
    Failed(PublishError, Option<RDKafkaErrorCode>),
    NotAttempted,
}

/// A delivery report as the batch sees it.
fn delivery_outcome(report: <DeliveryFuture as std::future::Future>::Output) -> Outcome {
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
            // Purged by us (a replaced producer) or by librdkafka while it resets the
            // idempotent producer's state: nothing about the message.
            | RDKafkaErrorCode::PurgeQueue
            | RDKafkaErrorCode::PurgeInflight
    )
}

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
    fn current(&self) -> (u64, Arc<FutureProducer>) {
        let current = self
            .inner
            .producer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (current.generation, Arc::clone(&current.producer))
    }

    /// The probe client, created on first use (idempotence off: it never sends).
    fn probe_client(&self) -> Option<Arc<FutureProducer>> {
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

    fn lock_up_since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.inner
            .cluster_up_since
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Pending>> {
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The delivery of message `id` if the producer of `generation` still holds it (or
    /// delivered it): a retry waits for that instead of enqueueing a second copy behind
    /// later messages of its key. A failed delivery is forgotten: the retry sends it
    /// again.
    fn in_producer(
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
    fn forget_resolved(&self, batch: &[OutboxRecord], outcomes: &[Option<Outcome>]) {
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
        // What the old producer held is purged with it: never waited for again.
        self.lock_pending().retain(|_, p| p.generation > generation);
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
enum Waited {
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

/// How often a batch that has no report at all asks the cluster whether it answers.
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// How long the cluster must answer while a batch gets no report before its producer is
/// considered wedged and replaced. A producer that recovers by itself reports within a
/// few hundred milliseconds of reconnecting (`reconnect.backoff.max.ms` is 1 s).
const STUCK_AFTER: Duration = Duration::from_millis(1500);

impl KafkaPublisher {
    /// Step 1 of a batch: every message without an outcome is put in flight, except
    /// after a failure of its key. A message still in the producer from an earlier
    /// call is waited for, not sent again. A key whose message could not be enqueued
    /// sends nothing more in this batch.
    async fn send(
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
    async fn await_reports(
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
    async fn unreported(
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

/// Whether the cluster answers a metadata request for `topics` with a leader for every
/// partition (a broker that is back, a topic that exists): then a producer that still
/// gets no delivery report is wedged, not waiting for the cluster.
async fn leaders_answer(probe: &Arc<FutureProducer>, topics: &[String]) -> bool {
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
            RDKafkaErrorCode::PurgeQueue,
            RDKafkaErrorCode::PurgeInflight,
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
