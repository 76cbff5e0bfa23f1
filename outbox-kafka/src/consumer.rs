//! [`KafkaConsumer`]: typed, idempotent consumption through the [`Inbox`].

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use outbox_core::inbox::{Inbox, InboxError, Processed};
use outbox_core::task::{TaskHandle, stopped};
use outbox_core::{Backend, DefaultBackend, OutboxEvent, OutboxTx};
use rdkafka::Message;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use uuid::Uuid;

use crate::settings::Settings;
use crate::{Error, Result, headers};

/// The error a handler returns; anything that converts with `?` will do.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the consumer does with a message it cannot handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Log it (at `warn`, with topic, partition, offset and the reason), count it in
    /// [`ConsumerStats::skipped`], commit its offset, and go on.
    Skip,
    /// Stop the consumer with an error naming the message. Its offset is not committed,
    /// so it is read again after a restart.
    Stop,
    /// Write the message as it came (key, payload, headers) to the dead-letter topic set
    /// with [`KafkaConsumerBuilder::dead_letter_topic`], with `dlq-reason`, `dlq-topic`,
    /// `dlq-partition` and `dlq-offset` headers added; once the broker acknowledged it,
    /// count it in [`ConsumerStatsSnapshot::dead_lettered`], commit its offset and go
    /// on. If the write fails the consumer stops ([`Error::DeadLetter`]) without
    /// committing the offset: the message is never dropped. Later messages of its key
    /// are handled without it.
    DeadLetter,
}

/// Headers added to a dead-lettered message.
pub mod dead_letter_headers {
    /// Why it was dead-lettered (the error, as text).
    pub const REASON: &str = "dlq-reason";
    /// The topic it was consumed from.
    pub const TOPIC: &str = "dlq-topic";
    /// Its partition there.
    pub const PARTITION: &str = "dlq-partition";
    /// Its offset there.
    pub const OFFSET: &str = "dlq-offset";
}

/// A message handed to a handler: the decoded event and where it came from.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Received<T> {
    /// The payload, deserialized.
    pub event: T,
    /// The message id (the deduplication key).
    pub id: Uuid,
    /// The event type header.
    pub event_type: String,
    /// The schema version header, if present.
    pub version: Option<i32>,
    /// The Kafka message key (the outbox partition key).
    pub key: Option<String>,
    /// Topic, partition and offset.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Every header, as text.
    pub headers: BTreeMap<String, String>,
}

#[derive(Clone)]
struct Meta {
    id: Uuid,
    event_type: String,
    version: Option<i32>,
    key: Option<String>,
    topic: String,
    partition: i32,
    offset: i64,
    headers: BTreeMap<String, String>,
}

/// A type-erased handler: decodes the payload, then runs in the inbox transaction.
trait Dispatch<DB: Backend>: Send + Sync {
    fn decode(&self, payload: &[u8]) -> Result<Box<dyn Any + Send>, serde_json::Error>;
    fn run<'a>(
        &'a self,
        tx: &'a mut OutboxTx<'static, DB>,
        event: Box<dyn Any + Send>,
        meta: Meta,
    ) -> BoxFuture<'a, Result<(), BoxError>>;
}

struct Typed<T, F> {
    handler: F,
    _event: PhantomData<fn() -> T>,
}

impl<DB: Backend, T, F> Dispatch<DB> for Typed<T, F>
where
    T: DeserializeOwned + Send + 'static,
    F: for<'t> Fn(
            &'t mut OutboxTx<'static, DB>,
            Received<T>,
        ) -> BoxFuture<'t, Result<(), BoxError>>
        + Send
        + Sync
        + 'static,
{
    fn decode(&self, payload: &[u8]) -> Result<Box<dyn Any + Send>, serde_json::Error> {
        Ok(Box::new(serde_json::from_slice::<T>(payload)?))
    }

    fn run<'a>(
        &'a self,
        tx: &'a mut OutboxTx<'static, DB>,
        event: Box<dyn Any + Send>,
        meta: Meta,
    ) -> BoxFuture<'a, Result<(), BoxError>> {
        let event = match event.downcast::<T>() {
            Ok(event) => *event,
            Err(_) => {
                return Box::pin(async {
                    Err("outbox-kafka: decoded event of the wrong type".into())
                });
            }
        };
        (self.handler)(
            tx,
            Received {
                event,
                id: meta.id,
                event_type: meta.event_type,
                version: meta.version,
                key: meta.key,
                topic: meta.topic,
                partition: meta.partition,
                offset: meta.offset,
                headers: meta.headers,
            },
        )
    }
}

/// Counters of what a consumer did.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    handled: AtomicU64,
    duplicates: AtomicU64,
    skipped: AtomicU64,
    handler_errors: AtomicU64,
    dead_lettered: AtomicU64,
}

/// A copy of [`ConsumerStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStatsSnapshot {
    /// Messages whose handler ran and committed.
    pub handled: u64,
    /// Messages skipped by the inbox because they were processed before.
    pub duplicates: u64,
    /// Messages skipped by [`Policy::Skip`] (unknown event type, undecodable).
    pub skipped: u64,
    /// Handler (or database) failures.
    pub handler_errors: u64,
    /// Messages written to the dead-letter topic ([`Policy::DeadLetter`]).
    pub dead_lettered: u64,
}

impl ConsumerStats {
    /// The current values.
    pub fn snapshot(&self) -> ConsumerStatsSnapshot {
        ConsumerStatsSnapshot {
            handled: self.handled.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            handler_errors: self.handler_errors.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
        }
    }
}

/// Configures a [`KafkaConsumer`]; start with [`KafkaConsumer::builder`].
pub struct KafkaConsumerBuilder<DB: Backend = DefaultBackend> {
    settings: Settings,
    topics: Vec<String>,
    inbox: Inbox<DB>,
    handlers: HashMap<String, Arc<dyn Dispatch<DB>>>,
    errors: Vec<Error>,
    unknown: Policy,
    undecodable: Policy,
    retry_backoff: (Duration, Duration),
    handler_attempts: Option<(u32, Policy)>,
    dead_letter_topic: Option<String>,
    dead_letter_settings: Vec<(String, String)>,
}

impl<DB: Backend> fmt::Debug for KafkaConsumerBuilder<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumerBuilder")
            .field("settings", &self.settings)
            .field("topics", &self.topics)
            .field("inbox", &self.inbox)
            .field("event_types", &self.handlers.keys().collect::<Vec<_>>())
            .field("on_unknown_event_type", &self.unknown)
            .field("on_undecodable", &self.undecodable)
            .field("handler_attempts", &self.handler_attempts)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .finish()
    }
}

/// Consumes outbox messages from Kafka, dispatching each by its `event-type` header to a
/// typed handler that runs inside an [`Inbox`] transaction; the message's offset is
/// committed only after that transaction committed.
///
/// See the [crate docs](crate) for an example and `docs/kafka.md` for the policies.
pub struct KafkaConsumer<DB: Backend = DefaultBackend> {
    consumer: StreamConsumer,
    settings: Settings,
    inbox: Inbox<DB>,
    handlers: HashMap<String, Arc<dyn Dispatch<DB>>>,
    unknown: Policy,
    undecodable: Policy,
    retry_backoff: (Duration, Duration),
    handler_attempts: Option<(u32, Policy)>,
    /// The dead-letter topic and the producer writing to it.
    dead_letters: Option<(String, FutureProducer)>,
    stats: Arc<ConsumerStats>,
}

impl<DB: Backend> fmt::Debug for KafkaConsumer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("settings", &self.settings)
            .field("inbox", &self.inbox)
            .field("event_types", &self.handlers.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> KafkaConsumer<DB> {
    /// A consumer in group `group_id` of the cluster at `bootstrap_servers`, recording
    /// processed messages in `inbox` (whose consumer name scopes the deduplication).
    ///
    /// Defaults: `enable.auto.commit=true` with `enable.auto.offset.store=false` (an
    /// offset is stored only after its message's transaction committed, and stored
    /// offsets are committed every `auto.commit.interval.ms=1000` and at shutdown),
    /// `auto.offset.reset=earliest`. Unknown event types are skipped (logged);
    /// undecodable messages stop the consumer.
    pub fn builder(
        bootstrap_servers: impl Into<String>,
        group_id: impl Into<String>,
        inbox: Inbox<DB>,
    ) -> KafkaConsumerBuilder<DB> {
        let mut settings = Settings::default();
        settings
            .set("bootstrap.servers", bootstrap_servers)
            .set("group.id", group_id);
        KafkaConsumerBuilder {
            settings,
            topics: Vec::new(),
            inbox,
            handlers: HashMap::new(),
            errors: Vec::new(),
            unknown: Policy::Skip,
            undecodable: Policy::Stop,
            retry_backoff: (Duration::from_millis(100), Duration::from_secs(30)),
            handler_attempts: None,
            dead_letter_topic: None,
            dead_letter_settings: Vec::new(),
        }
    }

    /// The consumer's counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        Arc::clone(&self.stats)
    }
}

/// The event type names the catalog lists for Rust type `T`.
fn catalog_names<T>() -> Vec<&'static str> {
    let full = std::any::type_name::<T>();
    let name = full.split('<').next().unwrap_or(full);
    outbox_core::catalog()
        .into_iter()
        .filter(|e| e.rust_type == name)
        .map(|e| e.event_type)
        .collect()
}

impl<DB: Backend> KafkaConsumerBuilder<DB> {
    /// Any librdkafka consumer property (SASL, TLS, `session.timeout.ms`, ...).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.set(key, value);
        self
    }

    /// Subscribes to `topic` (call once per topic).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// Handles the event type(s) that `#[derive(OutboxEvent)]` registered for `T` (an
    /// enum: each variant's) with `handler`, which receives the inbox transaction and the
    /// decoded message, and returns a boxed future:
    ///
    /// `.on::<OrderConfirmed, _>(|tx, msg| Box::pin(async move { ...; Ok(()) }))`
    ///
    /// A type not in the event catalog is reported by [`build`](Self::build).
    pub fn on<T, F>(mut self, handler: F) -> Self
    where
        T: OutboxEvent + DeserializeOwned + Send + 'static,
        F: for<'t> Fn(
                &'t mut OutboxTx<'static, DB>,
                Received<T>,
            ) -> BoxFuture<'t, Result<(), BoxError>>
            + Send
            + Sync
            + 'static,
    {
        let names = catalog_names::<T>();
        if names.is_empty() {
            self.errors.push(Error::NotInCatalog {
                rust_type: std::any::type_name::<T>(),
            });
            return self;
        }
        let dispatch: Arc<dyn Dispatch<DB>> = Arc::new(Typed {
            handler,
            _event: PhantomData::<fn() -> T>,
        });
        for name in names {
            self.add(name.to_owned(), Arc::clone(&dispatch));
        }
        self
    }

    /// Handles messages whose `event-type` header is `event_type`, with a payload that
    /// deserializes to `T` (no `OutboxEvent` derive needed).
    pub fn on_event_type<T, F>(mut self, event_type: impl Into<String>, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        F: for<'t> Fn(
                &'t mut OutboxTx<'static, DB>,
                Received<T>,
            ) -> BoxFuture<'t, Result<(), BoxError>>
            + Send
            + Sync
            + 'static,
    {
        let dispatch: Arc<dyn Dispatch<DB>> = Arc::new(Typed {
            handler,
            _event: PhantomData::<fn() -> T>,
        });
        self.add(event_type.into(), dispatch);
        self
    }

    fn add(&mut self, event_type: String, dispatch: Arc<dyn Dispatch<DB>>) {
        match self.handlers.entry(event_type) {
            std::collections::hash_map::Entry::Occupied(e) => {
                self.errors.push(Error::DuplicateHandler(e.key().clone()));
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(dispatch);
            }
        }
    }

    /// What to do with a message whose event type has no handler. Default [`Policy::Skip`].
    pub fn on_unknown_event_type(mut self, policy: Policy) -> Self {
        self.unknown = policy;
        self
    }

    /// What to do with a message that cannot be decoded: missing or bad `message-id` /
    /// `event-type` header, or a payload that does not deserialize into the handler's type.
    /// Default [`Policy::Stop`].
    pub fn on_undecodable(mut self, policy: Policy) -> Self {
        self.undecodable = policy;
        self
    }

    /// Backoff between retries of a failing handler: first delay and cap (default
    /// 100 ms, 30 s). A failing handler is retried, in place, until it succeeds or the
    /// consumer is shut down, so later messages wait (per-key order is kept).
    pub fn retry_backoff(mut self, first: Duration, cap: Duration) -> Self {
        self.retry_backoff = (first, cap.max(first));
        self
    }

    /// Gives up on a message after its handler failed `attempts` times (at least 1) in
    /// a row, and applies `then` to it: [`Policy::DeadLetter`] (the usual choice),
    /// [`Policy::Stop`], or [`Policy::Skip`] (its effect is lost). Without this a failing
    /// handler is retried until it succeeds, holding back the messages after it.
    pub fn handler_attempts(mut self, attempts: u32, then: Policy) -> Self {
        self.handler_attempts = Some((attempts.max(1), then));
        self
    }

    /// The topic [`Policy::DeadLetter`] writes to (e.g. `orders.events.dlq`). It must
    /// exist; it is written with a producer made from this consumer's connection and
    /// security settings (`bootstrap.servers`, `security.protocol`, `sasl.*`, `ssl.*`,
    /// `https.*`, `socket.*`, `client.id`, ...), idempotent, `acks=all`, plus what
    /// [`dead_letter_set`](Self::dead_letter_set) adds.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// A librdkafka producer property for the dead-letter producer only (e.g.
    /// `message.timeout.ms`, to stop sooner when the dead-letter topic cannot be written).
    pub fn dead_letter_set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.dead_letter_settings.push((key.into(), value.into()));
        self
    }

    /// Creates the consumer and subscribes.
    pub fn build(mut self) -> Result<KafkaConsumer<DB>> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        if self.topics.is_empty() {
            return Err(Error::Incomplete("no topics"));
        }
        if self.handlers.is_empty() {
            return Err(Error::Incomplete("no handlers"));
        }
        let policies = [
            Some(self.unknown),
            Some(self.undecodable),
            self.handler_attempts.map(|(_, then)| then),
        ];
        let dead_letters = match self.dead_letter_topic.take() {
            Some(topic) => Some((
                topic,
                dead_letter_producer(&self.settings, &self.dead_letter_settings)?,
            )),
            None if policies.contains(&Some(Policy::DeadLetter)) => {
                return Err(Error::NoDeadLetterTopic);
            }
            None => None,
        };
        self.settings.set_default("enable.auto.commit", "true");
        self.settings
            .set_default("enable.auto.offset.store", "false");
        self.settings.set_default("auto.commit.interval.ms", "1000");
        self.settings.set_default("auto.offset.reset", "earliest");
        let consumer: StreamConsumer = self.settings.create()?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(Error::Consumer)?;
        tracing::info!(settings = ?self.settings, ?topics, "outbox-kafka consumer subscribed");
        Ok(KafkaConsumer {
            consumer,
            settings: self.settings,
            inbox: self.inbox,
            handlers: self.handlers,
            unknown: self.unknown,
            undecodable: self.undecodable,
            retry_backoff: self.retry_backoff,
            handler_attempts: self.handler_attempts,
            dead_letters,
            stats: Arc::new(ConsumerStats::default()),
        })
    }
}

/// A producer with the consumer's connection and security settings only.
fn dead_letter_producer(consumer: &Settings, own: &[(String, String)]) -> Result<FutureProducer> {
    let mut settings = Settings::default();
    for key in consumer.keys() {
        let shared = [
            "bootstrap.servers",
            "security.protocol",
            "client.id",
            "client.dns.lookup",
            "broker.address.family",
            "enable.ssl.certificate.verification",
            "enable.sasl.oauthbearer.unsecure.jwt",
        ]
        .contains(&key)
            || ["sasl.", "ssl.", "https.", "socket."]
                .iter()
                .any(|prefix| key.starts_with(prefix));
        if let (true, Some(value)) = (shared, consumer.get(key)) {
            settings.set(key, value);
        }
    }
    for (key, value) in own {
        settings.set(key.as_str(), value.as_str());
    }
    settings.set_default("enable.idempotence", "true");
    settings.set_default("acks", "all");
    settings.create()
}

/// What went wrong with a message, in words that do not depend on the policy applied
/// (for logs and the `dlq-reason` header), at most 4 KiB.
fn short_reason(error: &Error) -> String {
    let mut text = match error {
        Error::UnknownEventType { event_type, .. } => {
            format!("no handler for event type `{event_type}`")
        }
        Error::Undecodable { reason, .. } => format!("cannot decode the message: {reason}"),
        Error::HandlerFailed {
            attempts, error, ..
        } => format!("the handler failed {attempts} times, last with: {error}"),
        other => other.to_string(),
    };
    if text.len() > 4096 {
        let mut end = 4096;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Controls a spawned consumer.
#[derive(Debug)]
pub struct ConsumerHandle {
    task: TaskHandle<Result<()>>,
    stats: Arc<ConsumerStats>,
}

impl ConsumerHandle {
    /// Asks the consumer to stop after the message in hand, commits the stored offsets,
    /// leaves the group, and returns how the consumer ended.
    pub async fn shutdown(self) -> Result<()> {
        self.task.shutdown().await.unwrap_or(Ok(()))
    }

    /// Waits for the consumer to end by itself (a [`Policy::Stop`] or a fatal error).
    pub async fn join(self) -> Result<()> {
        self.task.join().await.unwrap_or(Ok(()))
    }

    /// Whether the consumer has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// The consumer's counters.
    pub fn stats(&self) -> ConsumerStatsSnapshot {
        self.stats.snapshot()
    }
}

enum Step {
    Next,
    Stop,
}

impl<DB: Backend> KafkaConsumer<DB> {
    /// Starts the consumer on the current tokio runtime.
    pub fn spawn(self) -> ConsumerHandle {
        let stats = Arc::clone(&self.stats);
        ConsumerHandle {
            task: TaskHandle::spawn(|shutdown| self.run(shutdown)),
            stats,
        }
    }

    /// Consumes until `shutdown` turns `true` (`Ok`), or a [`Policy::Stop`] or fatal
    /// error ends it (`Err`). Either way the offsets stored so far are committed and the
    /// consumer leaves its group.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) -> Result<()> {
        let result = self.consume(&mut shutdown).await;
        if let Err(e) = self.consumer.commit_consumer_state(CommitMode::Sync) {
            if e.rdkafka_error_code() != Some(RDKafkaErrorCode::NoOffset) {
                tracing::warn!(error = %e, "outbox-kafka: committing offsets at shutdown failed");
            }
        }
        let consumer = self.consumer;
        // Closing leaves the group; librdkafka blocks while it does.
        let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
        tracing::info!(stats = ?self.stats.snapshot(), "outbox-kafka consumer stopped");
        result
    }

    async fn consume(&self, shutdown: &mut watch::Receiver<bool>) -> Result<()> {
        loop {
            let message = tokio::select! {
                biased;
                _ = stopped(shutdown) => return Ok(()),
                m = self.consumer.recv() => m,
            };
            let message = match message {
                Ok(m) => m,
                Err(e) => {
                    if self.consumer.client().fatal_error().is_some() {
                        return Err(Error::Consumer(e));
                    }
                    let transient = matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::AllBrokersDown
                                | RDKafkaErrorCode::BrokerTransportFailure
                        )
                    );
                    if transient {
                        tracing::debug!(error = %e, "outbox-kafka: broker unreachable (librdkafka reconnects by itself)");
                    } else {
                        tracing::warn!(error = %e, "outbox-kafka: consumer error (librdkafka retries by itself)");
                    }
                    continue;
                }
            };
            match self.handle(&message, shutdown).await? {
                Step::Next => {}
                Step::Stop => return Ok(()),
            }
        }
    }

    fn store(&self, message: &BorrowedMessage<'_>) {
        if let Err(e) = self.consumer.store_offset_from_message(message) {
            // The partition was revoked meanwhile: its new owner reads the message again
            // and the inbox skips it.
            tracing::warn!(error = %e, topic = message.topic(), partition = message.partition(),
                offset = message.offset(), "outbox-kafka: could not store the offset");
        }
    }

    async fn policy(
        &self,
        message: &BorrowedMessage<'_>,
        policy: Policy,
        error: Error,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Step> {
        match policy {
            Policy::Skip => {
                tracing::warn!(
                    topic = message.topic(), partition = message.partition(), offset = message.offset(),
                    reason = %short_reason(&error), "outbox-kafka: message skipped (policy Skip)"
                );
                self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("outbox_kafka_consumer_skipped_total").increment(1);
                self.store(message);
                Ok(Step::Next)
            }
            Policy::Stop => {
                tracing::error!(
                    topic = message.topic(), partition = message.partition(), offset = message.offset(),
                    reason = %error, "outbox-kafka: consumer stops (policy Stop)"
                );
                Err(error)
            }
            Policy::DeadLetter => {
                // A shutdown does not wait for the write: the offset stays unstored, so
                // the message comes again (at worst twice in the dead-letter topic).
                let dead_letter_topic = tokio::select! {
                    written = self.dead_letter(message, &error) => written?,
                    _ = stopped(shutdown) => return Ok(Step::Stop),
                };
                tracing::warn!(
                    topic = message.topic(), partition = message.partition(), offset = message.offset(),
                    dead_letter_topic, reason = %short_reason(&error), "outbox-kafka: message dead-lettered"
                );
                self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("outbox_kafka_consumer_dead_lettered_total").increment(1);
                self.store(message);
                Ok(Step::Next)
            }
        }
    }

    /// Writes `message` to the dead-letter topic and waits for the acknowledgement;
    /// returns the topic.
    async fn dead_letter(&self, message: &BorrowedMessage<'_>, reason: &Error) -> Result<&str> {
        let Some((dead_letter_topic, producer)) = &self.dead_letters else {
            return Err(Error::NoDeadLetterTopic);
        };
        let (topic, partition, offset) = (message.topic(), message.partition(), message.offset());
        let failed = |reason: String| Error::DeadLetter {
            dead_letter_topic: dead_letter_topic.clone(),
            reason,
            topic: topic.to_owned(),
            partition,
            offset,
        };
        let mut headers = OwnedHeaders::new();
        if let Some(original) = message.headers() {
            for h in original.iter() {
                headers = headers.insert(Header {
                    key: h.key,
                    value: h.value,
                });
            }
        }
        let reason = self.settings.redact(&short_reason(reason));
        let (partition_text, offset_text) = (partition.to_string(), offset.to_string());
        for (key, value) in [
            (dead_letter_headers::REASON, reason.as_str()),
            (dead_letter_headers::TOPIC, topic),
            (dead_letter_headers::PARTITION, partition_text.as_str()),
            (dead_letter_headers::OFFSET, offset_text.as_str()),
        ] {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(dead_letter_topic).headers(headers);
        if let Some(payload) = message.payload() {
            record = record.payload(payload);
        }
        if let Some(key) = message.key() {
            record = record.key(key);
        }
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| failed(e.to_string()))?;
        Ok(dead_letter_topic)
    }

    async fn handle(
        &self,
        message: &BorrowedMessage<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Step> {
        let (topic, partition, offset) = (message.topic(), message.partition(), message.offset());
        let undecodable = |reason: String| Error::Undecodable {
            reason,
            topic: topic.to_owned(),
            partition,
            offset,
        };
        let mut all = BTreeMap::new();
        if let Some(h) = message.headers() {
            for header in h.iter() {
                let value = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                all.insert(header.key.to_owned(), value);
            }
        }
        let Some(event_type) = all.get(headers::EVENT_TYPE).cloned() else {
            return self
                .policy(
                    message,
                    self.undecodable,
                    undecodable(format!("no `{}` header", headers::EVENT_TYPE)),
                    shutdown,
                )
                .await;
        };
        let id = match all.get(headers::MESSAGE_ID).map(|v| v.parse::<Uuid>()) {
            Some(Ok(id)) => id,
            Some(Err(e)) => {
                return self
                    .policy(
                        message,
                        self.undecodable,
                        undecodable(format!("bad `{}` header: {e}", headers::MESSAGE_ID)),
                        shutdown,
                    )
                    .await;
            }
            None => {
                return self
                    .policy(
                        message,
                        self.undecodable,
                        undecodable(format!("no `{}` header", headers::MESSAGE_ID)),
                        shutdown,
                    )
                    .await;
            }
        };
        let Some(dispatch) = self.handlers.get(&event_type) else {
            let error = Error::UnknownEventType {
                event_type,
                topic: topic.to_owned(),
                partition,
                offset,
            };
            return self.policy(message, self.unknown, error, shutdown).await;
        };
        let payload = message.payload().unwrap_or_default();
        let event = match dispatch.decode(payload) {
            Ok(event) => event,
            Err(e) => {
                return self
                    .policy(
                        message,
                        self.undecodable,
                        undecodable(format!(
                            "message {id}: payload is not a valid `{event_type}`: {e}"
                        )),
                        shutdown,
                    )
                    .await;
            }
        };
        let meta = Meta {
            id,
            event_type: event_type.clone(),
            version: all.get(headers::EVENT_VERSION).and_then(|v| v.parse().ok()),
            key: message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            topic: topic.to_owned(),
            partition,
            offset,
            headers: all,
        };

        let mut decoded = Some(event);
        let mut delay = self.retry_backoff.0;
        let mut attempts = 0_u32;
        loop {
            // The first attempt uses the event decoded above; a retry decodes it again.
            let ev = match decoded.take() {
                Some(ev) => ev,
                None => dispatch
                    .decode(payload)
                    .map_err(|e| undecodable(e.to_string()))?,
            };
            let me = meta.clone();
            let d = Arc::clone(dispatch);
            let outcome = self
                .inbox
                .process(id, move |tx| {
                    Box::pin(async move { d.run(tx, ev, me).await })
                })
                .await;
            match outcome {
                Ok(Processed::Handled(())) => {
                    self.stats.handled.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("outbox_kafka_consumer_handled_total").increment(1);
                    self.store(message);
                    return Ok(Step::Next);
                }
                Ok(Processed::Duplicate) => {
                    tracing::debug!(%id, topic, partition, offset, "outbox-kafka: duplicate skipped by the inbox");
                    self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("outbox_kafka_consumer_duplicates_total").increment(1);
                    self.store(message);
                    return Ok(Step::Next);
                }
                Err(e) => {
                    self.stats.handler_errors.fetch_add(1, Ordering::Relaxed);
                    // Only the handler's own failures count towards giving up: a database
                    // that is briefly unavailable must not dead-letter or skip messages.
                    if matches!(e, InboxError::Handler(_)) {
                        attempts += 1;
                    }
                    let error: &dyn std::fmt::Display = match &e {
                        InboxError::Handler(e) => e,
                        InboxError::Database(e) => e,
                    };
                    if let Some((max, then)) =
                        self.handler_attempts.filter(|(max, _)| attempts >= *max)
                    {
                        let failure = Error::HandlerFailed {
                            id,
                            event_type: event_type.clone(),
                            attempts: max,
                            error: error.to_string(),
                            topic: topic.to_owned(),
                            partition,
                            offset,
                        };
                        return self.policy(message, then, failure, shutdown).await;
                    }
                    tracing::warn!(%id, %event_type, topic, partition, offset, error = %error, retry_in = ?delay,
                        "outbox-kafka: handler failed; nothing recorded, retrying");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped(shutdown) => return Ok(Step::Stop),
            }
            delay = (delay * 2).min(self.retry_backoff.1);
        }
    }
}
