//! The consume loop: receive, decode, run the handler in the inbox transaction, store
//! the offset.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use outbox_core::Backend;
use outbox_core::inbox::{InboxError, Processed};
use outbox_core::publisher::cloudevents::split_type;
use outbox_core::task::{TaskHandle, stopped};
use rdkafka::Message;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::watch;
use uuid::Uuid;

use crate::{Error, Result, headers};

use super::dispatch::Meta;

/// The CloudEvents attribute headers the consumer reads when the outbox ones are absent.
const CE_TYPE: &str = "ce_type";
const CE_ID: &str = "ce_id";
use super::*;

pub(super) enum Step {
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

    pub(super) fn store(&self, message: &BorrowedMessage<'_>) {
        if let Err(e) = self.consumer.store_offset_from_message(message) {
            // The partition was revoked meanwhile: its new owner reads the message again
            // and the inbox skips it.
            tracing::warn!(error = %e, topic = message.topic(), partition = message.partition(),
                offset = message.offset(), "outbox-kafka: could not store the offset");
        }
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
        // The outbox headers, or a CloudEvent's in binary mode (`ce_type`, `ce_id`) from
        // a producer that writes only those.
        // A handler registered for the whole `type` takes it as it is; otherwise
        // `OrderPlaced.v2` is event type `OrderPlaced`, version 2 (as our publishers
        // write it).
        let (ce_type, ce_version) = match all.get(CE_TYPE) {
            Some(kind) if self.handlers.contains_key(kind.as_str()) => (Some(kind.clone()), None),
            Some(kind) => {
                let (name, version) = split_type(kind);
                (Some(name.to_owned()), version)
            }
            None => (None, None),
        };
        let cloudevent = !all.contains_key(headers::EVENT_TYPE) && ce_type.is_some();
        let Some(event_type) = all.get(headers::EVENT_TYPE).cloned().or(ce_type) else {
            return self
                .policy(
                    message,
                    self.undecodable,
                    undecodable(format!("no `{}` header", headers::EVENT_TYPE)),
                    shutdown,
                )
                .await;
        };
        let id_header = if all.contains_key(headers::MESSAGE_ID) || !cloudevent {
            headers::MESSAGE_ID
        } else {
            CE_ID
        };
        let id = match all.get(id_header).map(|v| v.parse::<Uuid>()) {
            Some(Ok(id)) => id,
            Some(Err(e)) => {
                return self
                    .policy(
                        message,
                        self.undecodable,
                        undecodable(format!(
                            "bad `{id_header}` header (the inbox needs a UUID): {e}"
                        )),
                        shutdown,
                    )
                    .await;
            }
            None => {
                return self
                    .policy(
                        message,
                        self.undecodable,
                        undecodable(format!("no `{id_header}` header")),
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
        let meta = Meta {
            id,
            event_type: event_type.clone(),
            version: match all.get(headers::EVENT_VERSION) {
                Some(v) => v.parse().ok(),
                None if cloudevent => ce_version,
                None => None,
            },
            key: message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            topic: topic.to_owned(),
            partition,
            offset,
            headers: all,
        };
        let run = match Arc::clone(dispatch).decode(payload, meta.clone()) {
            Ok(run) => run,
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
        let mut decoded = Some(run);
        let mut delay = self.retry_backoff.0;
        let mut attempts = 0_u32;
        loop {
            // The first attempt uses the event decoded above; a retry decodes it again.
            let run = match decoded.take() {
                Some(run) => run,
                None => Arc::clone(dispatch)
                    .decode(payload, meta.clone())
                    .map_err(|e| undecodable(e.to_string()))?,
            };
            let outcome = self.inbox.process(id, run).await;
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
