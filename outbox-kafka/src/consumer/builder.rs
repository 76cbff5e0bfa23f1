//! Configuring a consumer: handlers, policies, the dead-letter topic, and the checks
//! of `build`.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use outbox_core::inbox::Inbox;
use outbox_core::{Backend, DefaultBackend, OutboxEvent, OutboxTx};
use rdkafka::consumer::{Consumer, StreamConsumer};
use serde::de::DeserializeOwned;

use crate::settings::Settings;
use crate::{Error, Result};

use super::dead_letter::dead_letter_producer;
use super::dispatch::Typed;
use super::*;

/// Configures a [`KafkaConsumer`]; start with [`KafkaConsumer::builder`].
pub struct KafkaConsumerBuilder<DB: Backend = DefaultBackend> {
    pub(super) settings: Settings,
    pub(super) topics: Vec<String>,
    pub(super) inbox: Inbox<DB>,
    pub(super) handlers: HashMap<String, Arc<dyn Dispatch<DB>>>,
    pub(super) errors: Vec<Error>,
    pub(super) unknown: Policy,
    pub(super) undecodable: Policy,
    pub(super) retry_backoff: (Duration, Duration),
    pub(super) handler_attempts: Option<(u32, Policy)>,
    pub(super) dead_letter_topic: Option<String>,
    pub(super) dead_letter_settings: Vec<(String, String)>,
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
