//! [`NatsTransport`]: the JetStream side of an [`outbox_core::consumer::Consumer`], a
//! durable pull consumer acknowledged after the database commit.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::{Config, Stream as Messages};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::{self, AckKind, Message};
use futures_util::StreamExt;
use outbox_core::config::percent_decoded;
use outbox_core::consumer::{BoxError, Delivery, Origin, Transport, dead_letter_headers};
use outbox_core::publisher::cloudevents::is_attribute_header;
use tokio::sync::Mutex;

use crate::{Credentials, Error, check_streams, connect, headers, split_credentials};

/// Configures a [`NatsTransport`]; start with [`NatsTransport::builder`].
#[must_use = "a builder does nothing until `build`"]
pub struct NatsTransportBuilder {
    url: String,
    credentials: Option<Credentials>,
    options: async_nats::ConnectOptions,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    ack_wait: Duration,
    max_deliver: Option<i64>,
    max_ack_pending: i64,
    deliver_policy: DeliverPolicy,
    dead_letter_subject: Option<String>,
}

impl fmt::Debug for NatsTransportBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTransportBuilder")
            .field("url", &self.url)
            .field("credentials", &self.credentials.as_ref().map(|_| "***"))
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("ack_wait", &self.ack_wait)
            .field("deliver_policy", &self.deliver_policy)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

/// Consumes outbox messages from a JetStream stream with a durable pull consumer, for
/// an [`outbox_core::consumer::Consumer`]; start with [`NatsTransport::builder`].
///
/// - Explicit acknowledgement, sent after the message's transaction committed. A crash
///   before it redelivers the message after `AckWait`, and the inbox skips it.
/// - While a message is in hand (a handler being retried), the transport tells JetStream
///   every `AckWait / 2` that it is still working on it (`+WPI`), so it is not
///   redelivered meanwhile.
/// - Dead letters are published to a subject captured by a stream, and acknowledged by
///   JetStream before the original is acknowledged.
/// - The key is the `partition-key` header.
pub struct NatsTransport {
    client: async_nats::Client,
    js: jetstream::Context,
    url: String,
    messages: Mutex<Messages>,
    ack_wait: Duration,
    dead_letter_subject: Option<String>,
    /// The pull consumer, for its pending count ([`Transport::backlog`]).
    consumer: jetstream::consumer::Consumer<Config>,
    stream: String,
    durable: String,
}

impl fmt::Debug for NatsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsTransport")
            .field("url", &self.url)
            .field("ack_wait", &self.ack_wait)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsTransport {
    /// The durable pull consumer `durable` on JetStream stream `stream` of the server at
    /// `url` (credentials in the URL are handled as by
    /// [`NatsPublisher::builder`](crate::NatsPublisher::builder)). The consumer is created
    /// if it does not exist, and its configuration updated if it does.
    ///
    /// Defaults: every message of the stream from the start (`DeliverPolicy::All`; see
    /// [`deliver_policy`](NatsTransportBuilder::deliver_policy)), `AckWait` 30 s, no
    /// `MaxDeliver` limit, at most 256 messages unacknowledged.
    pub fn builder(
        url: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> NatsTransportBuilder {
        let (url, credentials) = split_credentials(&url.into());
        NatsTransportBuilder {
            url,
            credentials,
            options: async_nats::ConnectOptions::new().name("outbox-nats consumer"),
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            max_ack_pending: 256,
            deliver_policy: DeliverPolicy::All,
            dead_letter_subject: None,
        }
    }
}

impl NatsTransportBuilder {
    /// Connection options (credentials, TLS, name, ...) instead of the defaults.
    pub fn options(mut self, options: async_nats::ConnectOptions) -> Self {
        self.options = options;
        self
    }

    /// Where a durable that does not exist yet starts reading: every message the stream
    /// holds (`DeliverPolicy::All`, the default), only messages stored after it is
    /// created (`DeliverPolicy::New`), or from a sequence or a time. An existing durable
    /// keeps where it is: JetStream refuses to change its policy, and `build()` fails
    /// with the server's error (delete the durable to start it anew).
    pub fn deliver_policy(mut self, policy: DeliverPolicy) -> Self {
        self.deliver_policy = policy;
        self
    }

    /// Only the stream's messages on `subject` (wildcards allowed).
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// How long JetStream waits for an acknowledgement before it delivers a message again
    /// (default 30 s). The transport renews it while a message is in hand, so it bounds
    /// only how soon a crashed consumer's messages come again.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// JetStream's `MaxDeliver`: after `deliveries` deliveries without an
    /// acknowledgement (crashes, or `AckWait` expiring), JetStream stops delivering the
    /// message to this consumer and only publishes a `MAX_DELIVERIES` advisory. Default:
    /// no limit. Failing handlers are counted by
    /// [`handler_attempts`](outbox_core::consumer::ConsumerBuilder::handler_attempts)
    /// instead, which dead-letters rather than drops; set this only to protect against a
    /// message that crashes the process, and watch the advisory.
    pub fn max_deliver(mut self, deliveries: i64) -> Self {
        self.max_deliver = Some(deliveries);
        self
    }

    /// JetStream's `MaxAckPending`: how many messages may be delivered and not yet
    /// acknowledged (default 256). Keep it at most the consumer's
    /// [`max_in_flight`](outbox_core::consumer::ConsumerBuilder::max_in_flight) (default
    /// 32 × concurrency = 256): messages delivered beyond it wait in the client's buffer,
    /// where their `AckWait` is not renewed.
    pub fn max_ack_pending(mut self, messages: i64) -> Self {
        self.max_ack_pending = messages;
        self
    }

    /// The subject [`Policy::DeadLetter`](outbox_core::consumer::Policy::DeadLetter)
    /// publishes to (e.g. `orders.dlq`); a stream must capture it (checked by
    /// [`build`](Self::build)).
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Connects, creates or updates the durable consumer, and starts pulling.
    pub async fn build(self) -> Result<NatsTransport, Error> {
        let bad = |c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\');
        if self.durable.is_empty() || self.durable.contains(bad) {
            return Err(Error::Consumer {
                stream: self.stream,
                consumer: self.durable,
                reason: "a durable consumer name must be non-empty, without whitespace, `.`, `*`, `>`, `/` or `\\`"
                    .to_owned(),
                source: None,
            });
        }
        let client = connect(&self.url, self.credentials, self.options).await?;
        let js = jetstream::new(client.clone());
        let failed = |reason: String, source: Option<BoxError>| Error::Consumer {
            stream: self.stream.clone(),
            consumer: self.durable.clone(),
            reason,
            source,
        };
        if let Some(subject) = &self.dead_letter_subject {
            check_streams(&js, [subject.clone()]).await?;
            // A consumer that read its own dead letters would handle them again, fail
            // again, and write them again, for ever.
            let captured_by = js
                .stream_by_subject(subject.as_str())
                .await
                .unwrap_or_default();
            let filtered_out = self
                .filter_subject
                .as_deref()
                .is_some_and(|filter| !subject_matches(filter, subject));
            if captured_by == self.stream && !filtered_out {
                return Err(failed(
                    format!(
                        "the dead-letter subject {subject} is in the stream it reads; set `.filter_subject(..)` to the \
                     subjects of the events, or write dead letters to a subject of another stream"
                    ),
                    None,
                ));
            }
        }
        let stream = js.get_stream(&self.stream).await.map_err(|e| {
            failed(
                "the stream cannot be read; create it first".to_owned(),
                Some(Box::new(e)),
            )
        })?;
        let consumer = stream
            .create_consumer(Config {
                durable_name: Some(self.durable.clone()),
                deliver_policy: self.deliver_policy,
                ack_policy: AckPolicy::Explicit,
                ack_wait: self.ack_wait,
                max_deliver: self.max_deliver.unwrap_or(-1),
                filter_subject: self.filter_subject.clone().unwrap_or_default(),
                max_ack_pending: self.max_ack_pending,
                ..Config::default()
            })
            .await
            .map_err(|e| {
                failed(
                    "the server did not create or update the durable consumer".to_owned(),
                    Some(Box::new(e)),
                )
            })?;
        // A pull request asks for up to this many; JetStream still sends no more than
        // `MaxAckPending` unacknowledged. A request for fewer (one, with
        // `max_ack_pending(1)`) must be renewed after each message, which took ~40 ms.
        let batch = 256;
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(|e| {
                failed(
                    "the consumer's first pull request failed".to_owned(),
                    Some(Box::new(e)),
                )
            })?;
        tracing::info!(url = %self.url, stream = %self.stream, consumer = %self.durable, "outbox-nats consumer ready");
        Ok(NatsTransport {
            client,
            js,
            url: self.url,
            messages: Mutex::new(messages),
            ack_wait: self.ack_wait,
            dead_letter_subject: self.dead_letter_subject,
            consumer,
            stream: self.stream,
            durable: self.durable,
        })
    }
}

/// Whether NATS subject `subject` matches `filter` (`*`: one token, `>`: the rest).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for part in filter.split('.') {
        match (part, tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (part, Some(token)) if part == token => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

/// The headers as text; a header sent twice: its last value. CloudEvents attributes
/// (`ce-*`) are percent-decoded once, as the NATS binding's draft says.
pub(crate) fn text_headers(headers: Option<&HeaderMap>) -> BTreeMap<String, String> {
    let mut all = BTreeMap::new();
    for (name, values) in headers.into_iter().flat_map(HeaderMap::iter) {
        if let Some(value) = values.last() {
            let name = name.to_string();
            let value = value.as_str();
            let value = if is_attribute_header(&name, headers::CLOUDEVENTS_PREFIX) {
                percent_decoded(value)
            } else {
                value.to_owned()
            };
            all.insert(name, value);
        }
    }
    all
}

impl Transport for NatsTransport {
    type Token = Message;
    const NAME: &'static str = "nats";
    const CLOUDEVENTS_PREFIX: &'static str = headers::CLOUDEVENTS_PREFIX;

    fn consumer_group(&self) -> Option<&str> {
        Some(&self.durable)
    }

    async fn receive(&self) -> Result<Delivery<Message>, BoxError> {
        let mut messages = self.messages.lock().await;
        loop {
            let message = match messages.next().await {
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    use async_nats::jetstream::consumer::pull::MessagesErrorKind as Kind;
                    if matches!(e.kind(), Kind::ConsumerDeleted | Kind::PushBasedConsumer) {
                        return Err(Box::new(e));
                    }
                    // A missed heartbeat or a failed pull while the server is away: the
                    // client reconnects and pulls again by itself.
                    tracing::debug!(error = %e, "outbox-nats consumer: pulling failed; retrying");
                    continue;
                }
                None => return Err("the JetStream message stream ended".into()),
            };
            let headers = text_headers(message.headers.as_ref());
            let sequence = message
                .info()
                .ok()
                .and_then(|info| i64::try_from(info.stream_sequence).ok());
            return Ok(Delivery::new(
                message.payload.to_vec(),
                headers.get(headers::PARTITION_KEY).cloned(),
                headers,
                Origin::new(message.subject.as_str(), None, sequence),
                message,
            ));
        }
    }

    async fn ack(&self, delivery: &Delivery<Message>) -> Result<(), BoxError> {
        delivery.token.ack().await
    }

    fn state(&self) -> String {
        let stats = self.client.statistics();
        format!(
            "consumer {} of stream {}: connection {:?}, {} connects, {} messages in",
            self.durable,
            self.stream,
            self.client.connection_state(),
            stats.connects.load(std::sync::atomic::Ordering::Relaxed),
            stats.in_messages.load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    async fn backlog(&self) -> Option<u64> {
        let mut consumer = self.consumer.clone();
        let info = tokio::time::timeout(Duration::from_secs(5), consumer.info())
            .await
            .ok()?
            .ok()?;
        Some(info.num_pending)
    }

    fn dead_letter_destination(&self) -> Option<String> {
        self.dead_letter_subject.clone()
    }

    async fn dead_letter(
        &self,
        delivery: &Delivery<Message>,
        reason: &str,
    ) -> Result<(), BoxError> {
        let Some(subject) = &self.dead_letter_subject else {
            return Err("no dead-letter subject".into());
        };
        // The original's headers, but none that JetStream would act on (`Nats-Rollup`
        // could purge the dead letters, `Nats-Expected-*` refuse them).
        let mut headers = HeaderMap::new();
        for (name, values) in delivery.token.headers.iter().flat_map(HeaderMap::iter) {
            let nats = name.to_string().to_ascii_lowercase().starts_with("nats-");
            if nats && !name.to_string().eq_ignore_ascii_case(headers::NATS_MSG_ID) {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
        // A reason is one header line.
        let reason = reason.replace(['\r', '\n'], " ");
        headers.insert(dead_letter_headers::REASON, reason.as_str());
        headers.insert(dead_letter_headers::SOURCE, delivery.origin.source.as_str());
        if let Some(sequence) = delivery.origin.position {
            headers.insert(dead_letter_headers::OFFSET, sequence.to_string().as_str());
        }
        // Its own deduplication id: the original's would make a stream that captures
        // both subjects drop the dead letter as a duplicate of the original. (A header
        // received is looked up by async-nats' own name: a `&str` does not find it.)
        let original = headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .map(|id| id.as_str().to_owned());
        if let Some(id) = original {
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("dlq-{id}").as_str(),
            );
        }
        let ack = self
            .js
            .publish_with_headers(subject.clone(), headers, delivery.token.payload.clone())
            .await?;
        ack.await?;
        Ok(())
    }

    fn keep_alive(&self) -> Option<Duration> {
        Some(self.ack_wait / 2)
    }

    async fn working(&self, delivery: &Delivery<Message>) {
        // Bounded: while the server is away the client's buffer may be full, and the
        // consumer must not wait on it.
        let renew = delivery.token.ack_with(AckKind::Progress);
        match tokio::time::timeout(Duration::from_secs(1), renew).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, origin = %delivery.origin, "outbox-nats consumer: could not renew AckWait")
            }
            Err(_) => {
                tracing::debug!(origin = %delivery.origin, "outbox-nats consumer: renewing AckWait timed out")
            }
        }
    }

    async fn close(self) {
        // Acknowledgements are buffered by the client: send them before going.
        if let Err(e) = self.client.flush().await {
            tracing::warn!(error = %e, "outbox-nats consumer: flushing the last acknowledgements failed; those messages will come again and be skipped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subjects_match_filters_with_wildcards() {
        for (filter, subject, matches) in [
            ("orders.placed", "orders.placed", true),
            ("orders.*", "orders.placed", true),
            ("orders.*", "orders.placed.eu", false),
            ("orders.>", "orders.placed.eu", true),
            ("orders.>", "orders", false),
            ("orders.placed", "orders.dlq", false),
            ("*.dlq", "orders.dlq", true),
            ("orders", "orders.dlq", false),
        ] {
            assert_eq!(
                subject_matches(filter, subject),
                matches,
                "{filter} ~ {subject}"
            );
        }
    }
}
