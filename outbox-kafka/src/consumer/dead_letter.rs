//! What happens to a message that cannot be handled: the policies, and the
//! dead-letter topic.

use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_core::Backend;
use outbox_core::task::stopped;
use rdkafka::Message;
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::watch;

use crate::settings::Settings;
use crate::{Error, Result};

use super::run::Step;
use super::*;

/// A producer with the consumer's connection and security settings only.
pub(super) fn dead_letter_producer(
    consumer: &Settings,
    own: &[(String, String)],
) -> Result<FutureProducer> {
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
pub(super) fn short_reason(error: &Error) -> String {
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

impl<DB: Backend> KafkaConsumer<DB> {
    pub(super) async fn policy(
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
}
