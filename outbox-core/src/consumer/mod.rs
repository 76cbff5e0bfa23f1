//! Consumers: typed, idempotent handling of outbox messages from any broker.
//!
//! The broker-neutral part lives here: typed dispatch (`.on::<T, _>(handler)`), the
//! [`Inbox`](crate::inbox::Inbox) transaction, retries of a failing handler, the policies for messages that
//! cannot be handled, and per-key scheduling. A broker crate supplies only a
//! [`Transport`]: receive, acknowledge after the database commit, and write a dead
//! letter (`outbox_kafka::KafkaTransport`, `outbox_nats::NatsTransport`,
//! `outbox_rabbitmq::RabbitTransport`).
//!
//! ```no_run
//! use outbox_core::consumer::{Consumer, Policy, Transport};
//! use outbox_core::inbox::Inbox;
//! # use outbox_core::OutboxEvent;
//! # #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
//! # #[outbox(destination = "orders", key = order_id)]
//! # struct OrderPlaced { order_id: i64 }
//!
//! # async fn demo(outbox: outbox_core::Outbox, transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = Consumer::builder(transport, Inbox::new(&outbox, "billing"))
//!     .on::<OrderPlaced, _>(|tx, msg| {
//!         Box::pin(async move {
//!             sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
//!                 .bind(msg.event.order_id)
//!                 .execute(&mut **tx)
//!                 .await?;
//!             Ok(())
//!         })
//!     })
//!     .handler_attempts(5, Policy::DeadLetter)
//!     .build()?
//!     .spawn();
//! // ...
//! consumer.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! # What a consumer guarantees
//! - **Effect once.** The handler runs in an [`Inbox`](crate::inbox::Inbox) transaction that also records the
//!   message id; a redelivered message whose transaction committed is skipped.
//! - **Acknowledged after the commit.** A message is acknowledged (Kafka: its offset
//!   stored; JetStream: `+ACK`; RabbitMQ: `basic.ack`) only after its transaction
//!   committed, or after a policy disposed of it. A crash in between redelivers it, and
//!   the inbox skips it.
//! - **Per-key order.** Messages of one key (the Kafka message key, or the
//!   `partition-key` header) are handled one after the other, in the order received.
//!   Messages of different keys run concurrently, up to
//!   [`concurrency`](ConsumerBuilder::concurrency), so a handler retried for a long time
//!   holds back only its own key. Messages without a key are independent of each other.
//! - **Nothing dropped silently.** A message is skipped only by [`Policy::Skip`], which
//!   logs it and counts it.
//!
//! Which of these survive a crash or a broker restart depends on the broker:
//! [`docs/consumers.md`](https://github.com/outbox-rs/outbox/blob/main/docs/consumers.md) has the table.

mod builder;
mod dispatch;
mod handle;
mod run;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::future::BoxFuture;
use tokio::sync::watch;
use uuid::Uuid;

use crate::store::Backend;
use crate::task::TaskHandle;
use crate::tx::OutboxTx;

pub use builder::ConsumerBuilder;

/// The error a handler returns; anything that converts with `?` will do.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A handler of the events of type `E` ([`ConsumerBuilder::on`]): a function of the inbox
/// transaction and the decoded message that returns a boxed future,
/// `|tx, msg| Box::pin(async move { ...; Ok(()) })`. Every such closure or function is
/// one. An `async fn` is an [`AsyncHandler`], for [`ConsumerBuilder::on_async`].
pub trait Handler<DB: Backend, E>:
    for<'t> Fn(&'t mut OutboxTx<'static, DB>, Received<E>) -> BoxFuture<'t, Result<(), BoxError>>
    + Send
    + Sync
    + 'static
{
}

/// One call of an [`AsyncHandler`] for the transaction borrowed for `'t`: what lets an
/// `async fn` (whose future borrows the transaction) be a handler. Implemented for every
/// such function; not to be implemented by hand.
pub trait AsyncHandlerCall<'t, DB: Backend, E>:
    Fn(&'t mut OutboxTx<'static, DB>, Received<E>) -> <Self as AsyncHandlerCall<'t, DB, E>>::Fut
{
    /// The future the call returns.
    type Fut: Future<Output = Result<(), BoxError>> + Send + 't;
}

impl<'t, DB: Backend, E, F, Fut> AsyncHandlerCall<'t, DB, E> for F
where
    F: Fn(&'t mut OutboxTx<'static, DB>, Received<E>) -> Fut,
    Fut: Future<Output = Result<(), BoxError>> + Send + 't,
{
    type Fut = Fut;
}

/// A handler of the events of type `E` written as an `async fn` (or an async closure
/// with its parameter types written out), for [`ConsumerBuilder::on_async`]: `async fn
/// invoice(tx: &mut OutboxTx<'static>, msg: Received<OrderPlaced>) -> Result<(), BoxError>`.
pub trait AsyncHandler<DB: Backend, E>:
    for<'t> AsyncHandlerCall<'t, DB, E> + Send + Sync + 'static
{
}

impl<DB: Backend, E, F> AsyncHandler<DB, E> for F where
    F: for<'t> AsyncHandlerCall<'t, DB, E> + Send + Sync + 'static
{
}

impl<DB: Backend, E, F> Handler<DB, E> for F where
    F: for<'t> Fn(
            &'t mut OutboxTx<'static, DB>,
            Received<E>,
        ) -> BoxFuture<'t, Result<(), BoxError>>
        + Send
        + Sync
        + 'static
{
}

/// What the consumer does with a message it cannot handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Log it (at `warn`, with where it came from and the reason), count it in
    /// [`ConsumerStatsSnapshot::skipped`], acknowledge it, and go on.
    Skip,
    /// Stop the consumer with an error naming the message. It is not acknowledged, so it
    /// comes again after a restart.
    Stop,
    /// Hand the message to the transport's dead-letter destination (as it came, with
    /// [`dead_letter_headers`] added), and once the broker took it, count it in
    /// [`ConsumerStatsSnapshot::dead_lettered`], acknowledge it and go on. If that write
    /// fails the consumer stops ([`Error::DeadLetter`]) without acknowledging: the
    /// message is never dropped. Later messages of its key are handled without it.
    DeadLetter,
}

/// Headers a transport adds to a dead-lettered message.
pub mod dead_letter_headers {
    /// Why it was dead-lettered (the error, as text).
    pub const REASON: &str = "dlq-reason";
    /// The topic, subject or queue it was consumed from.
    pub const SOURCE: &str = "dlq-topic";
    /// Its partition there (Kafka).
    pub const PARTITION: &str = "dlq-partition";
    /// Its position there (Kafka offset, JetStream stream sequence).
    pub const OFFSET: &str = "dlq-offset";
}

/// Where a message was read: the topic, subject or queue, and where available its
/// partition and position (Kafka offset, JetStream stream sequence).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Origin {
    /// The topic (Kafka), subject (NATS) or queue (RabbitMQ).
    pub source: String,
    /// The partition (Kafka).
    pub partition: Option<i32>,
    /// The offset (Kafka) or stream sequence (JetStream).
    pub position: Option<i64>,
}

impl Origin {
    /// A message read from `source`, at `partition` and `position` where the broker
    /// has them.
    pub fn new(source: impl Into<String>, partition: Option<i32>, position: Option<i64>) -> Self {
        Origin {
            source: source.into(),
            partition,
            position,
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)?;
        if let Some(p) = self.partition {
            write!(f, "/{p}")?;
        }
        if let Some(o) = self.position {
            write!(f, "@{o}")?;
        }
        Ok(())
    }
}

/// A message handed to a handler: the decoded event and where it came from.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Received<T> {
    /// The payload, deserialized.
    pub event: T,
    /// The message id (the deduplication key).
    pub id: Uuid,
    /// The event type.
    pub event_type: String,
    /// The schema version, if the message has one.
    pub version: Option<i32>,
    /// The partition key (Kafka: the message key; elsewhere the `partition-key` header).
    pub key: Option<String>,
    /// Where the message was read.
    pub origin: Origin,
    /// Every header, as text.
    pub headers: BTreeMap<String, String>,
}

/// One message as a transport received it. `token` is the transport's own handle for
/// acknowledging it.
#[derive(Debug)]
#[non_exhaustive]
pub struct Delivery<A> {
    /// The body.
    pub payload: Vec<u8>,
    /// The partition key, if the message has one: messages with the same key are handled
    /// in order.
    pub key: Option<String>,
    /// The headers, as text (a header sent twice: the last value).
    pub headers: BTreeMap<String, String>,
    /// Where it was read.
    pub origin: Origin,
    /// What the transport needs to acknowledge it.
    pub token: A,
    /// The routing key it was published with (RabbitMQ), for the `process` span's
    /// `messaging.rabbitmq.destination.routing_key`.
    pub routing_key: Option<String>,
}

impl<A> Delivery<A> {
    /// A received message.
    pub fn new(
        payload: Vec<u8>,
        key: Option<String>,
        headers: BTreeMap<String, String>,
        origin: Origin,
        token: A,
    ) -> Self {
        Delivery {
            payload,
            key,
            headers,
            origin,
            token,
            routing_key: None,
        }
    }

    /// With the routing key it was published with (RabbitMQ).
    pub fn with_routing_key(mut self, routing_key: impl Into<String>) -> Self {
        self.routing_key = Some(routing_key.into());
        self
    }
}

/// The broker side of a [`Consumer`]: receives messages, acknowledges them after their
/// database transaction committed, and writes dead letters. Each broker crate has one;
/// implement it to consume from another broker.
///
/// The consumer calls [`receive`](Self::receive) from one task and the other methods
/// from the tasks handling messages, concurrently.
pub trait Transport: Send + Sync + 'static {
    /// What [`ack`](Self::ack) needs to acknowledge a message.
    type Token: Send + Sync + 'static;

    /// The broker's name, for logs and the `transport` label of the metrics.
    const NAME: &'static str;

    /// The prefix of CloudEvents attribute headers in binary mode on this broker
    /// (`ce_` for Kafka, `ce-` for NATS, `cloudEvents:` for AMQP). The consumer reads
    /// `<prefix>id` and `<prefix>type` when the outbox headers are absent.
    const CLOUDEVENTS_PREFIX: &'static str;

    /// Other prefixes the consumer reads, after [`CLOUDEVENTS_PREFIX`](Self::CLOUDEVENTS_PREFIX),
    /// when a message has no `<CLOUDEVENTS_PREFIX>type`: the ones older publishers or
    /// other SDKs write (`cloudEvents_` and `ce-` on AMQP). None by default.
    const CLOUDEVENTS_OTHER_PREFIXES: &'static [&'static str] = &[];

    /// The next message. Transient failures (a broker restart, a lost connection) are
    /// retried inside; an `Err` is fatal and stops the consumer.
    ///
    /// It must be cancel-safe: the consumer drops a pending `receive` when a handler
    /// finishes first, and a message must not be lost that way.
    fn receive(&self) -> impl Future<Output = Result<Delivery<Self::Token>, BoxError>> + Send;

    /// Acknowledges a message: it was handled (its transaction committed) or disposed
    /// of by a policy. A failure is logged and the message comes again, which the inbox
    /// skips.
    fn ack(
        &self,
        delivery: &Delivery<Self::Token>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Where [`dead_letter`](Self::dead_letter) writes, if the transport has a
    /// dead-letter destination; `None` makes [`Policy::DeadLetter`] a build error.
    fn dead_letter_destination(&self) -> Option<String>;

    /// Writes the message as it came, with [`dead_letter_headers`] added, to the
    /// dead-letter destination, and returns once the broker took it.
    fn dead_letter(
        &self,
        delivery: &Delivery<Self::Token>,
        reason: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// How often [`working`](Self::working) must be called while a message is in hand
    /// (JetStream: half the `AckWait`); `None` (the default) if never.
    fn keep_alive(&self) -> Option<std::time::Duration> {
        None
    }

    /// Tells the broker a message is still being worked on (JetStream: `+WPI`), so it
    /// is not redelivered meanwhile.
    fn working(&self, delivery: &Delivery<Self::Token>) -> impl Future<Output = ()> + Send {
        let _ = delivery;
        async {}
    }

    /// The consumer group (Kafka's `group.id`, a JetStream durable consumer's name), for
    /// the `process` span's `messaging.consumer.group.name`. Default `None`.
    fn consumer_group(&self) -> Option<&str> {
        None
    }

    /// Removes secrets (passwords in URLs or settings) from a text that goes into logs or
    /// dead-letter headers.
    fn redact(&self, text: &str) -> String {
        text.to_owned()
    }

    /// What the transport is doing, in a line for the consumer's warning when no message
    /// made progress for a while (connected since, last delivery, reconnections, last
    /// error). Free of secrets. Empty (the default) if the transport keeps no such state.
    fn state(&self) -> String {
        String::new()
    }

    /// How many messages the broker holds for this consumer that it has not handled
    /// yet, if the transport can ask cheaply (Kafka: the lag of its assigned partitions,
    /// from librdkafka's statistics; RabbitMQ: the queue's ready messages; JetStream:
    /// the consumer's pending count). The consumer asks at every heartbeat (see
    /// [`ConsumerBuilder::heartbeat`], 10 s by default; the answer is its lag in `outbox
    /// status` and the `outbox_consumer_lag` gauge), bounded by 10 s, and when it has
    /// received nothing for a while, to tell an idle consumer from a stuck one. `None`
    /// (the default) if the transport cannot tell.
    fn backlog(&self) -> impl Future<Output = Option<u64>> + Send {
        async { None }
    }

    /// Called once when the consumer stops, after every message in hand finished
    /// (Kafka: commits the stored offsets and leaves the group).
    fn close(self) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async {}
    }
}

/// Why a consumer could not be built, or why it stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `.on::<T, _>` with a type that no `#[derive(OutboxEvent)]` registered.
    #[error(
        "`{rust_type}` is not in the event catalog, so its event type name is unknown; derive `OutboxEvent` \
         for it, or register the handler with `.on_event_type::<T, _>(\"EventTypeName\", handler)`"
    )]
    NotInCatalog {
        /// The Rust type.
        rust_type: &'static str,
    },

    /// Two handlers for one event type.
    #[error("two handlers registered for event type `{0}`; register one handler per event type")]
    DuplicateHandler(String),

    /// `.on_event_type::<T, _>` with a type whose derive chose a codec that only
    /// [`on`](ConsumerBuilder::on) reads with (Avro): by its serde derives it would be
    /// read as JSON, and every message would be undecodable.
    #[error(
        "`{rust_type}` is a `{content_type}` event type: register its handler with `.on::<T, _>(handler)`, \
         which decodes its payloads as its derive says (`.on_event_type` would read them as JSON)"
    )]
    CodecNeedsOn {
        /// The Rust type.
        rust_type: &'static str,
        /// Its content type.
        content_type: &'static str,
    },

    /// No handler at all.
    #[error("the consumer has no handlers; add them with `.on::<T, _>(..)`")]
    NoHandlers,

    /// A policy is [`Policy::DeadLetter`] and the transport has nowhere to write.
    #[error(
        "a policy is `Policy::DeadLetter` but the {transport} transport has no dead-letter destination; \
         configure one on the transport (for example `.dead_letter_topic(\"orders.dlq\")`)"
    )]
    NoDeadLetterDestination {
        /// [`Transport::NAME`].
        transport: &'static str,
    },

    /// The transport failed for good (not a transient failure it retries itself).
    #[error("the {transport} consumer failed and stopped")]
    Transport {
        /// [`Transport::NAME`].
        transport: &'static str,
        /// What failed.
        #[source]
        source: BoxError,
    },

    /// [`Policy::Stop`] for a message whose event type has no handler.
    #[error(
        "no handler for event type `{event_type}` (message {origin}); the consumer stopped as configured \
         (`on_unknown_event_type(Policy::Stop)`): register a handler, or choose `Policy::Skip`"
    )]
    UnknownEventType {
        /// The event type.
        event_type: String,
        /// Where the message was read.
        origin: Origin,
    },

    /// [`Policy::Stop`] for a message that cannot be decoded.
    #[error(
        "cannot decode message {origin}: {reason}; the consumer stopped as configured \
         (`on_undecodable(Policy::Stop)`); it was not acknowledged, so it comes again after a restart"
    )]
    Undecodable {
        /// What is wrong with it.
        reason: String,
        /// Where the message was read.
        origin: Origin,
    },

    /// [`Policy::Stop`] after the handler failed `attempts` times.
    #[error(
        "the handler of message {id} ({event_type}, {origin}) failed {attempts} times, last with: {error}; \
         the consumer stopped as configured (`handler_attempts(.., Policy::Stop)`); nothing was recorded \
         and the message was not acknowledged, so it comes again after a restart"
    )]
    HandlerFailed {
        /// The message id.
        id: Uuid,
        /// The event type.
        event_type: String,
        /// How many times the handler failed.
        attempts: u32,
        /// The last error, as text.
        error: String,
        /// Where the message was read.
        origin: Origin,
    },

    /// [`Policy::DeadLetter`] could not write the message.
    #[error(
        "could not write message {origin} to the dead-letter destination `{destination}`: {reason}; the \
         consumer stopped and did not acknowledge the message, so it comes again after a restart (check \
         that the destination exists and the consumer may write to it)"
    )]
    DeadLetter {
        /// The dead-letter destination.
        destination: String,
        /// Why the write failed.
        reason: String,
        /// Where the message was read.
        origin: Origin,
    },
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
    /// Messages skipped by [`Policy::Skip`] (unknown event type, undecodable, handler
    /// attempts exhausted).
    pub skipped: u64,
    /// Handler (or database) failures.
    pub handler_errors: u64,
    /// Messages written to the dead-letter destination ([`Policy::DeadLetter`]).
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

/// Consumes outbox messages through a [`Transport`], dispatching each by its event type
/// to a typed handler that runs inside an [`Inbox`](crate::inbox::Inbox) transaction.
/// Start with [`Consumer::builder`]; see the [module docs](self).
pub struct Consumer<
    T: Transport,
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    inner: Arc<handle::Shared<T, DB>>,
    concurrency: usize,
    max_in_flight: usize,
}

impl<T: Transport, DB: Backend> fmt::Debug for Consumer<T, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("transport", &T::NAME)
            .field("inbox", &self.inner.inbox)
            .field(
                "event_types",
                &self.inner.handlers.keys().collect::<Vec<_>>(),
            )
            .field("concurrency", &self.concurrency)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl<T: Transport, DB: Backend> Consumer<T, DB> {
    /// A consumer reading through `transport` and recording processed messages in
    /// `inbox` (whose consumer name scopes the deduplication).
    ///
    /// Defaults: unknown event types are skipped (logged); undecodable messages stop the
    /// consumer; a failing handler is retried until it succeeds; 8 keys handled at once.
    pub fn builder(transport: T, inbox: crate::inbox::Inbox<DB>) -> ConsumerBuilder<T, DB> {
        ConsumerBuilder::new(transport, inbox)
    }

    /// The consumer's counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        Arc::clone(&self.inner.stats)
    }

    /// Starts the consumer on the current tokio runtime.
    pub fn spawn(self) -> ConsumerHandle {
        let stats = self.stats();
        ConsumerHandle {
            task: TaskHandle::spawn(|shutdown| self.run(shutdown)),
            stats,
        }
    }

    /// Consumes until `shutdown` turns `true` (`Ok`), or a [`Policy::Stop`] or fatal
    /// error ends it (`Err`). Either way the messages in hand finish first (a handler
    /// being retried stops retrying, unacknowledged), then the transport closes.
    pub async fn run(self, shutdown: watch::Receiver<bool>) -> Result<(), Error> {
        crate::telemetry::describe_metrics();
        run::run(self.inner, self.concurrency, self.max_in_flight, shutdown).await
    }
}

/// Controls a spawned [`Consumer`].
#[derive(Debug)]
#[must_use = "dropping the handle detaches the consumer: it runs until the runtime ends, and cannot be stopped gracefully; keep it and call `shutdown`"]
pub struct ConsumerHandle {
    task: TaskHandle<Result<(), Error>>,
    stats: Arc<ConsumerStats>,
}

impl ConsumerHandle {
    /// Asks the consumer to stop after the messages in hand, closes the transport, and
    /// returns how the consumer ended.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.task.shutdown().await.unwrap_or(Ok(()))
    }

    /// Waits for the consumer to end by itself (a [`Policy::Stop`] or a fatal error).
    pub async fn join(self) -> Result<(), Error> {
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
