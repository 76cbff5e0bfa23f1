//! [`KafkaTransport`]: the Kafka side of an [`outbox_core::consumer::Consumer`]. It
//! stores a message's offset for commit only once the message and every earlier one of
//! its partition were handled, and writes dead letters to a topic.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use outbox_core::consumer::{BoxError, Delivery, Origin, Transport, dead_letter_headers};
use rdkafka::Message;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::settings::Settings;
use crate::{Error, Result, headers};

/// Where a message was read; what [`KafkaTransport`] needs to store its offset.
#[derive(Debug, Clone)]
pub struct KafkaToken {
    topic: String,
    partition: i32,
    offset: i64,
}

/// The offsets received and not yet acknowledged, per partition. An offset is stored
/// (for the next commit) only when every earlier one received is acknowledged, so the
/// committed offset never passes a message still in hand.
#[derive(Debug, Default)]
struct Offsets {
    partitions: HashMap<(String, i32), Partition>,
}

#[derive(Debug)]
struct Partition {
    /// The first offset received: nothing below it is ours to store.
    first: i64,
    /// The highest offset received.
    high: i64,
    in_hand: BTreeSet<i64>,
}

impl Offsets {
    /// Records `offset` as received; returns the offsets skipped between the highest one
    /// received before and this one, if any.
    fn received(&mut self, topic: &str, partition: i32, offset: i64) -> Option<(i64, i64)> {
        let p = self
            .partitions
            .entry((topic.to_owned(), partition))
            .or_insert(Partition {
                first: offset,
                high: offset,
                in_hand: BTreeSet::new(),
            });
        let skipped = (offset > p.high + 1).then(|| (p.high + 1, offset - 1));
        p.first = p.first.min(offset);
        p.high = p.high.max(offset);
        p.in_hand.insert(offset);
        skipped
    }

    /// Acknowledges `offset`; returns the offset of the last message that may now be
    /// stored (it and every earlier one are done), if that moved.
    fn acknowledged(&mut self, topic: &str, partition: i32, offset: i64) -> Option<i64> {
        let p = self.partitions.get_mut(&(topic.to_owned(), partition))?;
        let lowest_before = p.in_hand.first().copied();
        p.in_hand.remove(&offset);
        let next = p.in_hand.first().copied().unwrap_or(p.high + 1);
        let moved = lowest_before.is_none_or(|low| next > low);
        (moved && next > p.first).then_some(next - 1)
    }
}

/// Consumes outbox messages from Kafka topics in a consumer group, for an
/// [`outbox_core::consumer::Consumer`]; start with [`KafkaTransport::builder`].
///
/// - An offset is stored for commit only after its message's transaction committed and
///   every earlier message of its partition was done too (messages of different keys run
///   concurrently); stored offsets are committed every `auto.commit.interval.ms` (1 s)
///   and at shutdown. A crash redelivers at most what was not committed, and the inbox
///   skips what had committed.
/// - Dead letters go to [`dead_letter_topic`](KafkaTransportBuilder::dead_letter_topic)
///   with the original key, payload and headers.
/// - The message key is the partition key: one key is on one partition, in order.
pub struct KafkaTransport {
    consumer: StreamConsumer<GroupLog>,
    settings: Settings,
    /// The dead-letter topic and the producer writing to it.
    dead_letters: Option<(String, FutureProducer)>,
    /// The dead-letter producer's settings, whose secrets are redacted too.
    dead_letter_settings: Settings,
    offsets: Mutex<Offsets>,
}

impl fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("settings", &self.settings)
            .field(
                "dead_letter_topic",
                &self.dead_letters.as_ref().map(|(t, _)| t),
            )
            .finish_non_exhaustive()
    }
}

/// Configures a [`KafkaTransport`].
#[must_use = "a builder does nothing until `build`"]
pub struct KafkaTransportBuilder {
    settings: Settings,
    startup_timeout: Duration,
    topics: Vec<String>,
    dead_letter_topic: Option<String>,
    dead_letter_settings: Vec<(String, String)>,
}

impl fmt::Debug for KafkaTransportBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaTransportBuilder")
            .field("settings", &self.settings)
            .field("topics", &self.topics)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .finish_non_exhaustive()
    }
}

impl KafkaTransport {
    /// A consumer in group `group_id` of the cluster at `bootstrap_servers`.
    ///
    /// Defaults: `enable.auto.commit=true` with `enable.auto.offset.store=false` (an
    /// offset is stored only after its message was handled, and stored offsets are
    /// committed every `auto.commit.interval.ms=1000` and at shutdown),
    /// `auto.offset.reset=earliest`.
    pub fn builder(
        bootstrap_servers: impl Into<String>,
        group_id: impl Into<String>,
    ) -> KafkaTransportBuilder {
        let mut settings = Settings::default();
        settings
            .set("bootstrap.servers", bootstrap_servers)
            .set("group.id", group_id);
        KafkaTransportBuilder {
            settings,
            startup_timeout: DEFAULT_STARTUP_TIMEOUT,
            topics: Vec::new(),
            dead_letter_topic: None,
            dead_letter_settings: Vec::new(),
        }
    }

    /// The next message; while this member holds no partition, says so at info every
    /// [`WAITING_LOG_EVERY`] (a new member waits for the group's rebalance; a member
    /// that took over a killed one's partitions waits for that member's session to time
    /// out; a member beyond the partition count gets none).
    async fn recv_or_say_why_not(
        &self,
    ) -> std::result::Result<rdkafka::message::BorrowedMessage<'_>, rdkafka::error::KafkaError>
    {
        loop {
            let group = self.consumer.context();
            if group.holds_partitions() {
                return self.consumer.recv().await;
            }
            match tokio::time::timeout(WAITING_LOG_EVERY, self.consumer.recv()).await {
                Ok(received) => return received,
                Err(_) if !group.holds_partitions() => {
                    tracing::info!(group = %group.group, waited = ?group.waiting_since().elapsed(),
                        "outbox-kafka consumer: waiting for the group to assign partitions \
                         (a rebalance, a killed member's session to time out, or more members than partitions)");
                }
                Err(_) => {}
            }
        }
    }

    fn offsets(&self) -> MutexGuard<'_, Offsets> {
        // The map stays consistent whatever panicked while it was held.
        self.offsets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl KafkaTransportBuilder {
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

    /// The topic [`Policy::DeadLetter`](outbox_core::consumer::Policy::DeadLetter)
    /// writes to (e.g. `orders.events.dlq`). It must exist; it is written with a producer
    /// made from this consumer's connection and security settings (`bootstrap.servers`,
    /// `security.protocol`, `sasl.*`, `ssl.*`, `https.*`, `socket.*`, `client.id`, ...),
    /// idempotent, `acks=all`, plus what [`dead_letter_set`](Self::dead_letter_set) adds.
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

    /// How long [`build`](Self::build) waits for the cluster to say which topics it
    /// has (default 10 s, as the publisher's
    /// [`startup_timeout`](crate::KafkaPublisherBuilder::startup_timeout)).
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = timeout;
        self
    }

    /// Checks the cluster, then creates the consumer and subscribes: within
    /// [`startup_timeout`](Self::startup_timeout) the cluster must answer (a wrong
    /// address, a refused TLS handshake or SASL login is [`Error::Metadata`], with
    /// librdkafka's reason), and the topics and the dead-letter topic must exist
    /// ([`Error::NoSuchTopics`]: a consumer of a missing topic would wait in silence).
    /// Like the other transports' and the publishers' `build`, it is async; without a
    /// cluster to ask (a synchronous context, topics made later), use
    /// [`build_unchecked`](Self::build_unchecked).
    ///
    /// [`Error::Metadata`]: crate::Error::Metadata
    /// [`Error::NoSuchTopics`]: crate::Error::NoSuchTopics
    pub async fn build(self) -> Result<KafkaTransport> {
        if self.topics.is_empty() {
            return Err(Error::Incomplete("no topics"));
        }
        // Only the connection and security settings: a producer-side client asks.
        let connection = dead_letter_settings(&self.settings, &[]);
        let have = crate::topics::existing(&connection, self.startup_timeout).await?;
        let missing: Vec<String> = self
            .topics
            .iter()
            .chain(&self.dead_letter_topic)
            .filter(|t| !have.contains(t.as_str()))
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if !missing.is_empty() {
            return Err(Error::NoSuchTopics {
                topics: missing,
                brokers: self.settings.brokers().to_owned(),
            });
        }
        self.build_unchecked()
    }

    /// Creates the consumer and subscribes, without asking the cluster anything first:
    /// a wrong address or a missing topic shows only later, in the consumer's log and
    /// [`state`](outbox_core::consumer::Transport::state). For synchronous code, and for
    /// a consumer started before its topics exist (it waits for them).
    pub fn build_unchecked(mut self) -> Result<KafkaTransport> {
        if self.topics.is_empty() {
            return Err(Error::Incomplete("no topics"));
        }
        let dead_letter_settings = dead_letter_settings(&self.settings, &self.dead_letter_settings);
        let dead_letters = match self.dead_letter_topic.take() {
            Some(topic) => Some((topic, dead_letter_settings.create()?)),
            None => None,
        };
        self.settings.set_default("enable.auto.commit", "true");
        self.settings
            .set_default("enable.auto.offset.store", "false");
        self.settings.set_default("auto.commit.interval.ms", "1000");
        self.settings.set_default("auto.offset.reset", "earliest");
        // The lag (`Transport::backlog`) comes from librdkafka's statistics: offsets it
        // has from its own fetches and commits, no request of its own.
        self.settings.set_default("statistics.interval.ms", "5000");
        let group = self.settings.get("group.id").unwrap_or_default().to_owned();
        let stats_every = self
            .settings
            .get("statistics.interval.ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .map(Duration::from_millis);
        let consumer: StreamConsumer<GroupLog> = self.settings.create_with_context(GroupLog {
            group,
            stats_every,
            lag: Mutex::new(None),
            held: Mutex::new((false, std::time::Instant::now())),
        })?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(Error::Consumer)?;
        tracing::info!(settings = ?self.settings, ?topics, "outbox-kafka consumer subscribed");
        Ok(KafkaTransport {
            consumer,
            settings: self.settings,
            dead_letters,
            dead_letter_settings,
            offsets: Mutex::new(Offsets::default()),
        })
    }
}

/// How often a member that holds no partition says it waits for the group.
const WAITING_LOG_EVERY: Duration = Duration::from_secs(5);

/// The default [`KafkaTransportBuilder::startup_timeout`].
const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Says at info what the group gave this member and took from it: a consumer that waits
/// for the group (a new member, a member that took over a killed one's partitions after
/// its session timed out) is visible in the log, not silent.
///
/// It also keeps the lag of this member's partitions from librdkafka's statistics.
struct GroupLog {
    group: String,
    /// `statistics.interval.ms`, if set and not 0.
    stats_every: Option<Duration>,
    /// The lag at the last statistics, and when they came.
    lag: Mutex<Option<(u64, std::time::Instant)>>,
    /// Whether the group assigned this member partitions, and since when it has none
    /// (its subscription, or the last revocation).
    held: Mutex<(bool, std::time::Instant)>,
}

impl GroupLog {
    fn holds_partitions(&self) -> bool {
        self.held.lock().map(|held| held.0).unwrap_or(true)
    }

    fn waiting_since(&self) -> std::time::Instant {
        self.held
            .lock()
            .map(|held| held.1)
            .unwrap_or_else(|_| std::time::Instant::now())
    }

    fn set_held(&self, held: bool) {
        if let Ok(mut state) = self.held.lock()
            && state.0 != held
        {
            *state = (held, std::time::Instant::now());
        }
    }

    /// The lag, if the last statistics are at most three intervals old.
    fn lag(&self) -> Option<u64> {
        let every = self.stats_every.filter(|d| !d.is_zero())?;
        let (lag, at) = (*self.lag.lock().ok()?)?;
        (at.elapsed() <= every * 3).then_some(lag)
    }
}

impl rdkafka::ClientContext for GroupLog {
    /// Per partition this member was assigned, the last offset it can read (the last
    /// stable one under `read_committed`, the default; else the high watermark) minus
    /// the group's committed offset (the low watermark before the group committed),
    /// summed; unknown while nothing is assigned or an offset is not known yet.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let mut lag = 0_u64;
        let mut assigned = 0;
        for topic in statistics.topics.values() {
            for p in topic.partitions.values() {
                if p.partition < 0 || !p.desired {
                    continue;
                }
                assigned += 1;
                let end = if p.ls_offset >= 0 {
                    p.ls_offset
                } else {
                    p.hi_offset
                };
                let from = if p.committed_offset >= 0 {
                    p.committed_offset
                } else {
                    p.lo_offset
                };
                if end < 0 || from < 0 {
                    return;
                }
                lag += u64::try_from(end - from).unwrap_or(0);
            }
        }
        if assigned > 0
            && let Ok(mut last) = self.lag.lock()
        {
            *last = Some((lag, std::time::Instant::now()));
        }
    }
}

impl rdkafka::consumer::ConsumerContext for GroupLog {
    fn post_rebalance(
        &self,
        consumer: &rdkafka::consumer::BaseConsumer<Self>,
        rebalance: &rdkafka::consumer::Rebalance<'_>,
    ) {
        // What the member holds after the rebalance (under the cooperative protocol a
        // revocation or an assignment is a part of it).
        self.set_held(consumer.assignment().is_ok_and(|held| held.count() > 0));
        use rdkafka::consumer::Rebalance;
        let partitions = |list: &rdkafka::TopicPartitionList| {
            list.elements()
                .iter()
                .map(|e| format!("{}/{}", e.topic(), e.partition()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match rebalance {
            // The cooperative protocol's rounds that hand this member nothing new.
            Rebalance::Assign(list) if list.count() == 0 => {
                tracing::debug!(group = %self.group, "outbox-kafka consumer: a rebalance assigned nothing new");
            }
            Rebalance::Assign(list) => {
                tracing::info!(
                    group = %self.group,
                    partitions = %partitions(list),
                    "outbox-kafka consumer: the group assigned partitions"
                );
            }
            Rebalance::Revoke(list) => {
                // The last statistics counted partitions this member no longer has.
                if let Ok(mut lag) = self.lag.lock() {
                    *lag = None;
                }
                tracing::info!(
                    group = %self.group,
                    partitions = %partitions(list),
                    "outbox-kafka consumer: the group revoked partitions"
                );
            }
            Rebalance::Error(e) => tracing::warn!(
                group = %self.group,
                error = %e,
                "outbox-kafka consumer: the group's rebalance failed"
            ),
        }
    }
}

/// The dead-letter producer's settings: the consumer's connection and security settings
/// only, then its own.
fn dead_letter_settings(consumer: &Settings, own: &[(String, String)]) -> Settings {
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
    settings
}

impl Transport for KafkaTransport {
    type Token = KafkaToken;
    const NAME: &'static str = "kafka";
    const CLOUDEVENTS_PREFIX: &'static str = headers::CLOUDEVENTS_PREFIX;

    fn consumer_group(&self) -> Option<&str> {
        self.settings.get("group.id")
    }

    /// The lag of the partitions the group assigned to this member, from librdkafka's
    /// statistics (`statistics.interval.ms`, 5 s unless you set it; 0 turns the lag
    /// off): per partition, the last offset it can read minus the group's committed
    /// offset, summed. Offsets stored since the last commit (at most
    /// `auto.commit.interval.ms` old) count as lag. `None` while nothing is assigned, or
    /// when the last statistics are older than three intervals.
    async fn backlog(&self) -> Option<u64> {
        self.consumer.context().lag()
    }

    async fn receive(&self) -> Result<Delivery<KafkaToken>, BoxError> {
        loop {
            let message = match self.recv_or_say_why_not().await {
                Ok(m) => m,
                Err(e) => {
                    if self.consumer.client().fatal_error().is_some() {
                        return Err(Box::new(Error::Consumer(e)));
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
            let all = headers::decode(
                message
                    .headers()
                    .into_iter()
                    .flat_map(|h| h.iter())
                    .map(|header| (header.key, header.value)),
            );
            let (topic, partition, offset) =
                (message.topic(), message.partition(), message.offset());
            tracing::trace!(topic, partition, offset, "outbox-kafka: received");
            if let Some((from, to)) = self.offsets().received(topic, partition, offset) {
                // The relay's producer writes no transaction markers, so its offsets
                // leave no gaps: the stored offset will pass these unread.
                tracing::warn!(
                    topic,
                    partition,
                    from,
                    to,
                    "outbox-kafka: offsets {from}..={to} were never received; expected after a \
                     rebalance that gave the partition to another member for a while, or on a \
                     compacted or transactional topic; otherwise the broker or the client \
                     skipped those messages"
                );
            }
            return Ok(Delivery::new(
                message.payload().unwrap_or_default().to_vec(),
                message
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned()),
                all,
                Origin::new(topic, Some(partition), Some(offset)),
                KafkaToken {
                    topic: topic.to_owned(),
                    partition,
                    offset,
                },
            ));
        }
    }

    async fn ack(&self, delivery: &Delivery<KafkaToken>) -> Result<(), BoxError> {
        let KafkaToken {
            topic,
            partition,
            offset,
        } = &delivery.token;
        // Stored under the lock, so that two acknowledgements cannot store out of order.
        let mut offsets = self.offsets();
        let Some(done) = offsets.acknowledged(topic, *partition, *offset) else {
            return Ok(());
        };
        // Fails when the partition was revoked meanwhile: its new owner reads the
        // message again and the inbox skips it.
        let stored = self.consumer.store_offset(topic, *partition, done);
        drop(offsets);
        stored.map_err(|e| Box::new(Error::Consumer(e)) as BoxError)
    }

    fn dead_letter_destination(&self) -> Option<String> {
        self.dead_letters.as_ref().map(|(topic, _)| topic.clone())
    }

    async fn dead_letter(
        &self,
        delivery: &Delivery<KafkaToken>,
        reason: &str,
    ) -> Result<(), BoxError> {
        let Some((dead_letter_topic, producer)) = &self.dead_letters else {
            return Err("no dead-letter topic".into());
        };
        let mut headers = OwnedHeaders::new();
        for (key, value) in &delivery.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let KafkaToken {
            topic,
            partition,
            offset,
        } = &delivery.token;
        let (partition, offset) = (partition.to_string(), offset.to_string());
        for (key, value) in [
            (dead_letter_headers::REASON, reason),
            (dead_letter_headers::SOURCE, topic.as_str()),
            (dead_letter_headers::PARTITION, partition.as_str()),
            (dead_letter_headers::OFFSET, offset.as_str()),
        ] {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::<str, [u8]>::to(dead_letter_topic)
            .headers(headers)
            .payload(&delivery.payload);
        if let Some(key) = &delivery.key {
            record = record.key(key);
        }
        producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| Box::new(e) as BoxError)?;
        Ok(())
    }

    fn redact(&self, text: &str) -> String {
        // A dead-letter producer may authenticate with credentials of its own.
        self.dead_letter_settings
            .redact(&self.settings.redact(text))
    }

    async fn close(self) {
        if let Err(e) = self.consumer.commit_consumer_state(CommitMode::Sync)
            && e.rdkafka_error_code() != Some(RDKafkaErrorCode::NoOffset)
        {
            tracing::warn!(error = %e, "outbox-kafka: committing offsets at shutdown failed");
        }
        let consumer = self.consumer;
        // Closing leaves the group; librdkafka blocks while it does.
        let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::Offsets;

    #[test]
    fn a_gap_in_the_offsets_received_is_reported() {
        let mut offsets = Offsets::default();
        assert_eq!(offsets.received("t", 0, 5), None, "the first one");
        assert_eq!(offsets.received("t", 0, 6), None);
        assert_eq!(offsets.received("t", 0, 9), Some((7, 8)));
        assert_eq!(offsets.received("t", 0, 7), None, "back: a redelivery");
        assert_eq!(offsets.received("t", 1, 0), None, "another partition");
    }

    #[test]
    fn an_offset_is_stored_only_when_every_earlier_one_is_done() {
        let mut offsets = Offsets::default();
        for o in 5..9 {
            offsets.received("t", 0, o);
        }
        assert_eq!(offsets.acknowledged("t", 0, 6), None, "5 is still in hand");
        assert_eq!(offsets.acknowledged("t", 0, 5), Some(6), "5 and 6 are done");
        assert_eq!(offsets.acknowledged("t", 0, 8), None, "7 is still in hand");
        assert_eq!(offsets.acknowledged("t", 0, 7), Some(8));
        offsets.received("t", 0, 9);
        offsets.received("t", 1, 0);
        assert_eq!(offsets.acknowledged("t", 1, 0), Some(0), "partitions apart");
        assert_eq!(offsets.acknowledged("t", 0, 9), Some(9));
        assert_eq!(offsets.acknowledged("u", 0, 1), None, "never received");
    }

    /// The dead-letter producer's own credentials are redacted like the consumer's
    /// (before, only the consumer's settings were).
    #[tokio::test]
    async fn the_dead_letter_producers_secrets_are_redacted_too() {
        use outbox_core::consumer::Transport;
        let transport = super::KafkaTransport::builder("127.0.0.1:1", "redaction")
            .set("sasl.password", "consumer-secret-1")
            .topic("orders")
            .dead_letter_topic("orders.dlq")
            .dead_letter_set("sasl.password", "dlq-secret-2")
            .build_unchecked()
            .expect("a client needs no broker to be created");
        let text = "auth failed with consumer-secret-1 and dlq-secret-2";
        assert_eq!(
            transport.redact(text),
            "auth failed with *** and ***",
            "neither password survives"
        );
        let debug = format!("{transport:?}");
        assert!(!debug.contains("secret"), "{debug}");
    }
}
