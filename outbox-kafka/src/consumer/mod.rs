//! [`KafkaConsumer`]: typed, idempotent consumption through the [`Inbox`].
//!
//! Split by role: the types and the handle here, `builder` (configuration and
//! checks), `dispatch` (decoding a payload into a handler call), `dead_letter` (policies
//! and the dead-letter topic) and `run` (the consume loop).

mod builder;
mod dead_letter;
mod dispatch;
mod run;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_core::inbox::Inbox;
use outbox_core::task::TaskHandle;
use outbox_core::{Backend, DefaultBackend};
use rdkafka::consumer::StreamConsumer;
use rdkafka::producer::FutureProducer;
use uuid::Uuid;

use crate::Result;
use crate::settings::Settings;

pub use builder::KafkaConsumerBuilder;
use dispatch::Dispatch;

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
