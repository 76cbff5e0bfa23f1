//! Publishers: where the relay sends outbox messages (Kafka, an in-memory channel, ...).

pub mod cloudevents;
pub mod headers;
mod memory;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::event::{OutboxMessage, Payload};

pub use memory::InMemoryPublisher;

/// A pending outbox row, as handed to a [`Publisher`].
///
/// The relay builds these; a publisher reads them. To build one yourself (to test a
/// publisher of your own), convert an [`OutboxMessage`]: the struct grows, so it cannot be
/// built with a literal.
///
/// ```
/// use outbox_core::{OutboxMessage, OutboxRecord};
///
/// let message = OutboxMessage::new("OrderPlaced", "orders", r#"{"id":7}"#)
///     .with_key("order-7")
///     .with_header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// let record = OutboxRecord::from(message).with_seq(1);
/// assert_eq!(record.partition_key.as_deref(), Some("order-7"));
/// assert_eq!(record.attempts, 0);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// Relay order.
    pub seq: i64,
    /// The message id; consumers deduplicate on it.
    pub id: Uuid,
    /// The event type name.
    pub event_type: String,
    /// The payload's schema version.
    pub event_version: Option<i32>,
    /// Topic, exchange or subject.
    pub destination: String,
    /// Messages with the same key must reach the broker in `seq` order.
    pub partition_key: Option<String>,
    /// The payload, the exact bytes written at `emit`: publish them as they are.
    pub payload: Payload,
    /// What the payload is: the `content-type` header to publish with it.
    pub content_type: Cow<'static, str>,
    /// Headers stored with the message (trace context, correlation ids, ...).
    pub headers: BTreeMap<String, String>,
    /// When the writing transaction started.
    pub created_at: DateTime<Utc>,
    /// Failed publish attempts so far.
    pub attempts: i32,
}

impl OutboxRecord {
    /// With relay order `seq`.
    #[must_use]
    pub fn with_seq(mut self, seq: i64) -> OutboxRecord {
        self.seq = seq;
        self
    }
}

/// The record a relay hands to its publisher for `message`: created now, at `seq` 0, with
/// no attempt yet.
impl From<OutboxMessage> for OutboxRecord {
    fn from(message: OutboxMessage) -> OutboxRecord {
        OutboxRecord {
            seq: 0,
            id: message.id,
            event_type: message.event_type,
            event_version: message.event_version,
            destination: message.destination,
            partition_key: message.partition_key,
            payload: message.payload,
            content_type: message.content_type,
            headers: message.headers,
            created_at: Utc::now(),
            attempts: 0,
        }
    }
}

/// Why one message could not be published.
///
/// Its message says what failed; the client's own error can come with it as the
/// [`source`](std::error::Error::source) ([`with_source`](Self::with_source)), and the
/// relay records the whole chain ([`ErrorChain`](crate::ErrorChain)) as the row's
/// `last_error`. Two errors are equal when their kind and message are.
#[derive(Debug, Clone)]
pub struct PublishError {
    kind: PublishErrorKind,
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl PartialEq for PublishError {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl Eq for PublishError {}

/// What the relay does with a failed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// A failure of this message that may pass (a transient rejection): retried with
    /// backoff, and dead-lettered after `max_attempts` such failures.
    Retryable,
    /// The broker could not be reached or did not answer in time (down, unreachable, a
    /// timeout, no responders): says nothing about the message. Retried with backoff for
    /// as long as it lasts; never counts towards `max_attempts`, so an outage dead-letters
    /// nothing and keeps every key in order.
    Unavailable,
    /// Will never succeed (too large, rejected): dead-lettered at once.
    Permanent,
    /// Not attempted, because an earlier message with the same key failed in this batch.
    /// The row is left as it was (no attempt counted) and waits behind that message.
    NotAttempted,
}

impl PublishError {
    /// A failure worth retrying.
    pub fn retryable(message: impl Into<String>) -> Self {
        PublishError {
            kind: PublishErrorKind::Retryable,
            message: message.into(),
            source: None,
        }
    }

    /// The broker is unavailable or did not answer in time; see
    /// [`PublishErrorKind::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        PublishError {
            kind: PublishErrorKind::Unavailable,
            message: message.into(),
            source: None,
        }
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(message: impl Into<String>) -> Self {
        PublishError {
            kind: PublishErrorKind::Permanent,
            message: message.into(),
            source: None,
        }
    }

    /// Not sent because an earlier message of the same key failed.
    pub fn not_attempted() -> Self {
        PublishError {
            kind: PublishErrorKind::NotAttempted,
            message: "not attempted: an earlier message with the same key failed".to_owned(),
            source: None,
        }
    }

    /// The kind of failure.
    pub fn kind(&self) -> PublishErrorKind {
        self.kind
    }

    /// The client's error behind this failure, returned by
    /// [`source`](std::error::Error::source): keep it out of the message, which then says
    /// what failed and what to do.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// What failed, without the source (the row's `last_error` holds both).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The messages of `batch` as chains of indexes, one chain per partition key in batch
/// order (a message without a key is a chain of its own), the chains in the order of
/// their first message. A publisher whose broker does not keep the order of messages in
/// flight sends each chain one message after the other, and the chains side by side.
pub fn key_chains(batch: &[OutboxRecord]) -> Vec<Vec<usize>> {
    let mut chains: Vec<Vec<usize>> = Vec::new();
    let mut by_key: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, record) in batch.iter().enumerate() {
        match record.partition_key.as_deref() {
            Some(key) => match by_key.get(key) {
                Some(&chain) => chains[chain].push(i),
                None => {
                    by_key.insert(key, chains.len());
                    chains.push(vec![i]);
                }
            },
            None => chains.push(vec![i]),
        }
    }
    chains
}

/// Publishes `batch` chain by chain ([`key_chains`]): each key's messages one after the
/// other with `send`, each once the one before succeeded, and the keys side by side.
/// After a failure of a key, and for messages not started by `deadline` (so a long chain
/// of one hot key progresses batch after batch instead of timing out as a whole), the
/// later messages of the chain are reported [`PublishError::not_attempted`]. Returns one
/// result per message, in batch order: the [`Publisher`] contract, for a broker that
/// does not keep the order of messages in flight.
pub async fn publish_in_chains<'b, F, Fut>(
    batch: &'b [OutboxRecord],
    deadline: tokio::time::Instant,
    send: F,
) -> Vec<Result<(), PublishError>>
where
    F: Fn(&'b OutboxRecord) -> Fut,
    Fut: Future<Output = Result<(), PublishError>>,
{
    let send = &send;
    let runs = key_chains(batch).into_iter().map(|chain| async move {
        let mut results = Vec::with_capacity(chain.len());
        let mut failed = false;
        for i in chain {
            let result = if failed || tokio::time::Instant::now() >= deadline {
                Err(PublishError::not_attempted())
            } else {
                send(&batch[i]).await
            };
            failed |= result.is_err();
            results.push((i, result));
        }
        results
    });
    let mut out: Vec<Result<(), PublishError>> =
        vec![Err(PublishError::not_attempted()); batch.len()];
    for (i, result) in futures_util::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
    {
        out[i] = result;
    }
    out
}

/// Sends batches of outbox messages to a broker.
///
/// The relay hands over a whole batch in `seq` order; an implementation should have all
/// of it in flight at once (pipelined), then wait for every acknowledgement. It returns
/// one result per message, in the batch's order, so one bad message does not fail the
/// others.
///
/// **Ordering contract**: for messages with the same partition key, a publisher must
/// deliver them in batch order, and must not report success for a message after it
/// reported failure for an earlier one of the same key in the same batch (report
/// [`PublishError::not_attempted`] for those instead, or fail them). Kafka's idempotent
/// producer gives this per partition.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `batch`; returns exactly `batch.len()` results, in order.
    fn publish(
        &self,
        batch: &[OutboxRecord],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send;

    /// How long one [`publish`](Self::publish) call may take by the publisher's own
    /// timeouts, if it knows. The relay logs an error when it is built with a shorter
    /// `publish_timeout`: it would give up on batches that the broker may still store
    /// afterwards. Default `None` (not known).
    fn max_publish_time(&self) -> Option<std::time::Duration> {
        None
    }

    /// How many [`publish`](Self::publish) calls the relay may have open at once when it
    /// has caught up with the writers: it then hands over each new small batch at once
    /// instead of waiting for the one before, which shortens commit → acknowledgement.
    /// Batches open at the same time never share a partition key, so each key still has
    /// one call at a time and the ordering contract holds call by call. A publisher
    /// whose calls share state that is not safe to use from overlapping calls keeps the
    /// default, 1 (one call at a time). The relay uses at most 4, and only as many as
    /// its `RelayBuilder::batches_in_flight` allows
    /// (default 1).
    fn max_batches_in_flight(&self) -> usize {
        1
    }

    /// The broker, as the relay's `send` span names it in `messaging.system` (the
    /// OpenTelemetry messaging semantic conventions' values: `kafka`, `rabbitmq`,
    /// `nats`, ...). Default `"unknown"`.
    fn messaging_system(&self) -> &'static str {
        "unknown"
    }

    /// The broker's host and port, for the `send` span's `server.address` and
    /// `server.port`: never credentials
    /// ([`telemetry::server_of`](crate::telemetry::server_of) reads them from a URL or a
    /// `host:port` list). Default `None` (not recorded).
    fn server(&self) -> Option<(&str, Option<u16>)> {
        None
    }
}

impl PublishErrorKind {
    /// Its name, as the relay's `send` span records it in `error.type`: `retryable`,
    /// `unavailable`, `permanent`, `not_attempted`.
    pub fn as_str(self) -> &'static str {
        match self {
            PublishErrorKind::Retryable => "retryable",
            PublishErrorKind::Unavailable => "unavailable",
            PublishErrorKind::Permanent => "permanent",
            PublishErrorKind::NotAttempted => "not_attempted",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_chains_keep_batch_order_per_key() {
        let record = |seq: i64, key: Option<&str>| OutboxRecord {
            seq,
            id: Uuid::now_v7(),
            event_type: "T".to_owned(),
            event_version: None,
            destination: "d".to_owned(),
            partition_key: key.map(str::to_owned),
            payload: "{}".into(),
            content_type: crate::publisher::headers::JSON.into(),
            headers: BTreeMap::new(),
            created_at: Utc::now(),
            attempts: 0,
        };
        let batch = [
            record(1, Some("a")),
            record(2, None),
            record(3, Some("b")),
            record(4, Some("a")),
            record(5, None),
            record(6, Some("b")),
            record(7, Some("a")),
        ];
        assert_eq!(
            key_chains(&batch),
            vec![vec![0, 3, 6], vec![1], vec![2, 5], vec![4]]
        );
        assert!(key_chains(&[]).is_empty());
    }

    fn keyed(seq: i64, key: &str) -> OutboxRecord {
        OutboxRecord {
            seq,
            id: Uuid::now_v7(),
            event_type: "T".to_owned(),
            event_version: None,
            destination: "d".to_owned(),
            partition_key: Some(key.to_owned()),
            payload: "{}".into(),
            content_type: crate::publisher::headers::JSON.into(),
            headers: BTreeMap::new(),
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    /// A key's next message is sent only after the one before succeeded; a failure
    /// leaves the rest of its key unattempted and the other keys untouched.
    #[tokio::test]
    async fn chains_send_a_key_in_order_and_stop_it_at_its_first_failure() {
        let batch = [
            keyed(1, "a"),
            keyed(2, "b"),
            keyed(3, "a"),
            keyed(4, "b"),
            keyed(5, "a"),
            keyed(6, "c"),
        ];
        let sent = std::sync::Mutex::new(Vec::new());
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        let results = publish_in_chains(&batch, deadline, |record| {
            let sent = &sent;
            async move {
                // Yield, so that the chains interleave.
                tokio::task::yield_now().await;
                sent.lock().expect("lock").push(record.seq);
                if record.seq == 3 {
                    Err(PublishError::retryable("refused"))
                } else {
                    Ok(())
                }
            }
        })
        .await;
        let kinds: Vec<Option<PublishErrorKind>> = results
            .iter()
            .map(|r| r.as_ref().err().map(PublishError::kind))
            .collect();
        assert_eq!(
            kinds,
            [
                None,
                None,
                Some(PublishErrorKind::Retryable),
                None,
                Some(PublishErrorKind::NotAttempted),
                None
            ]
        );
        let sent = sent.into_inner().expect("lock");
        assert!(!sent.contains(&5), "a:5 was not sent after a:3 failed");
        let position = |seq| sent.iter().position(|s| *s == seq);
        assert!(position(1) < position(3), "a in order: {sent:?}");
        assert!(position(2) < position(4), "b in order: {sent:?}");
    }

    #[tokio::test]
    async fn chains_start_nothing_after_the_deadline() {
        let batch = [keyed(1, "a"), keyed(2, "b")];
        let past = tokio::time::Instant::now();
        let results = publish_in_chains(&batch, past, |_| async { Ok(()) }).await;
        assert!(results.iter().all(|r| matches!(
            r,
            Err(e) if e.kind() == PublishErrorKind::NotAttempted
        )));
    }
}
