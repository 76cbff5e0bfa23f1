//! The shared consumer suite's view of a broker: a place to publish jobs to, a consumer
//! transport reading them, and the dead letters it writes. `tests/tests/consumers.rs`
//! runs the same tests against Kafka, NATS JetStream and RabbitMQ through [`Broker`].

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::OutboxRecord;
use outbox_core::consumer::{BoxError, ConsumerHandle, ConsumerStatsSnapshot, Delivery, Transport};
use outbox_core::publisher::Publisher;

use crate::{kafka, nats, rabbitmq};

/// A consumer group, or durable consumer, and its dead letters, on one broker, made for
/// one test.
#[derive(Debug, Clone)]
pub struct Place {
    /// Kafka: the topic; NATS: the stream; RabbitMQ: the queue.
    pub source: String,
    /// The outbox destination jobs are published to.
    pub destination: String,
    /// Where dead letters go: a Kafka topic, a NATS subject, a RabbitMQ queue.
    pub dead_letters: String,
}

impl Place {
    /// As command-line arguments, for a consumer process.
    pub fn to_args(&self) -> [String; 3] {
        [
            self.source.clone(),
            self.destination.clone(),
            self.dead_letters.clone(),
        ]
    }

    /// From [`to_args`](Self::to_args).
    pub fn from_args(args: &[String]) -> Place {
        let [source, destination, dead_letters] = args else {
            panic!("a place is <source> <destination> <dead letters>");
        };
        Place {
            source: source.clone(),
            destination: destination.clone(),
            dead_letters: dead_letters.clone(),
        }
    }
}

/// A `Job` record (payload `{"n":n}`) for `destination` with partition key `key`.
pub fn job(destination: &str, key: &str, n: i32) -> OutboxRecord {
    let mut record = kafka::job(destination, n);
    record.partition_key = Some(key.to_owned());
    record
}

/// One broker, as the shared suite sees it.
pub trait Broker: Send + Sync + 'static {
    /// Its consumer transport.
    type T: Transport;
    /// Its name, as a consumer process takes it.
    const NAME: &'static str;
    /// A fresh place: a topic, a stream or a queue, and a dead-letter destination.
    fn place() -> impl Future<Output = Place> + Send;
    /// Publishes `records` (their destination: [`Place::destination`]) and checks that
    /// the broker took every one.
    fn publish(place: &Place, records: &[OutboxRecord]) -> impl Future<Output = ()> + Send;
    /// A transport for consumer group `group`, with dead letters to
    /// [`Place::dead_letters`].
    fn transport(place: &Place, group: &str) -> impl Future<Output = Self::T> + Send;
    /// The headers of the first `n` dead letters, or a failure after `timeout`.
    fn dead_letters(
        place: &Place,
        n: usize,
        timeout: Duration,
    ) -> impl Future<Output = Vec<BTreeMap<String, String>>> + Send;
    /// Removes what [`place`](Self::place) made.
    fn remove(place: Place) -> impl Future<Output = ()> + Send;
}

/// Kafka (the tansu broker of `scripts/services.sh`).
#[derive(Debug)]
pub struct Kafka;

impl Broker for Kafka {
    type T = outbox_kafka::KafkaTransport;
    const NAME: &'static str = "kafka";

    async fn place() -> Place {
        let brokers = kafka::brokers();
        let (topic, dlq) = (kafka::unique("suite"), kafka::unique("suite-dlq"));
        kafka::create_topic(&brokers, &topic, 1).await;
        kafka::create_topic(&brokers, &dlq, 1).await;
        Place {
            source: topic.clone(),
            destination: topic,
            dead_letters: dlq,
        }
    }

    async fn publish(place: &Place, records: &[OutboxRecord]) {
        let publisher = kafka::job_publisher(&kafka::brokers(), &place.destination).await;
        check(publisher.publish(records).await);
    }

    async fn transport(place: &Place, group: &str) -> Self::T {
        kafka::transport(&kafka::brokers(), group, &place.source)
            .dead_letter_topic(&place.dead_letters)
            .build()
            .await
            .expect("kafka transport")
    }

    async fn dead_letters(
        place: &Place,
        n: usize,
        timeout: Duration,
    ) -> Vec<BTreeMap<String, String>> {
        kafka::read_topic(&kafka::brokers(), &place.dead_letters, n, timeout)
            .into_iter()
            .map(|read| read.headers)
            .collect()
    }

    async fn remove(place: Place) {
        let brokers = kafka::brokers();
        kafka::delete_topic(&brokers, &place.source).await;
        kafka::delete_topic(&brokers, &place.dead_letters).await;
    }
}

/// NATS JetStream (the shared server): a memory stream per test, jobs on
/// `<prefix>.jobs` and dead letters on `<prefix>.dlq` in the same stream.
#[derive(Debug)]
pub struct Nats;

/// How long JetStream waits for an acknowledgement in the suite: a killed consumer's
/// messages come again this soon.
pub const NATS_ACK_WAIT: Duration = Duration::from_secs(2);

impl Broker for Nats {
    type T = outbox_nats::NatsTransport;
    const NAME: &'static str = "nats";

    async fn place() -> Place {
        let (_, stream, prefix) = nats::fresh_stream().await;
        Place {
            source: stream,
            destination: format!("{prefix}.jobs"),
            dead_letters: format!("{prefix}.dlq"),
        }
    }

    async fn publish(place: &Place, records: &[OutboxRecord]) {
        let publisher = outbox_nats::NatsPublisher::builder(nats::nats_url())
            .skip_catalog_check()
            .destination(&place.destination)
            .build()
            .await
            .expect("nats publisher");
        check(publisher.publish(records).await);
    }

    async fn transport(place: &Place, group: &str) -> Self::T {
        outbox_nats::NatsTransport::builder(nats::nats_url(), &place.source, group)
            .filter_subject(&place.destination)
            .ack_wait(NATS_ACK_WAIT)
            .dead_letter_subject(&place.dead_letters)
            .build()
            .await
            .expect("nats transport")
    }

    async fn dead_letters(
        place: &Place,
        n: usize,
        timeout: Duration,
    ) -> Vec<BTreeMap<String, String>> {
        use async_nats::jetstream::{self, consumer};
        use futures_util::StreamExt;
        let client = async_nats::connect(nats::nats_url()).await.expect("nats");
        let js = jetstream::new(client);
        let stream = js.get_stream(&place.source).await.expect("stream");
        let reader = stream
            .create_consumer(consumer::pull::Config {
                filter_subject: place.dead_letters.clone(),
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("dead-letter reader");
        let mut messages = reader.messages().await.expect("messages");
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while out.len() < n {
            let Ok(Some(Ok(m))) = tokio::time::timeout_at(deadline, messages.next()).await else {
                panic!(
                    "read {} of {n} dead letters on {}",
                    out.len(),
                    place.dead_letters
                );
            };
            out.push(nats::text_headers(m.headers.as_ref()));
        }
        out
    }

    async fn remove(place: Place) {
        let client = async_nats::connect(nats::nats_url()).await.expect("nats");
        let _ = async_nats::jetstream::new(client)
            .delete_stream(&place.source)
            .await;
    }
}

/// RabbitMQ: a topic exchange with a queue bound to `jobs`, and a dead-letter queue
/// reached through the default exchange.
#[derive(Debug)]
pub struct Rabbit;

impl Rabbit {
    async fn topology(queue: &str) -> rabbitmq::Topology {
        let connection = lapin::Connection::connect(
            &rabbitmq::rabbitmq_url(),
            lapin::ConnectionProperties::default(),
        )
        .await
        .expect("connect to RabbitMQ");
        rabbitmq::Topology {
            connection,
            exchange: String::new(),
            queue: queue.to_owned(),
        }
    }
}

impl Broker for Rabbit {
    type T = outbox_rabbitmq::RabbitTransport;
    const NAME: &'static str = "rabbitmq";

    async fn place() -> Place {
        let topology = rabbitmq::Topology::declare("jobs").await;
        let dlq = format!("{}-dlq", topology.queue);
        let channel = topology.connection.create_channel().await.expect("channel");
        channel
            .queue_declare(
                dlq.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .expect("declare the dead-letter queue");
        let place = Place {
            source: topology.queue.clone(),
            destination: format!("{}/jobs", topology.exchange),
            dead_letters: dlq,
        };
        let _ = topology.connection.close(200, "declared".into()).await;
        place
    }

    async fn publish(place: &Place, records: &[OutboxRecord]) {
        let publisher = outbox_rabbitmq::RabbitPublisher::builder(rabbitmq::rabbitmq_url())
            .skip_catalog_check()
            .destination(&place.destination)
            .build()
            .await
            .expect("rabbitmq publisher");
        check(publisher.publish(records).await);
    }

    async fn transport(place: &Place, _group: &str) -> Self::T {
        outbox_rabbitmq::RabbitTransport::builder(rabbitmq::rabbitmq_url(), &place.source)
            .dead_letter(&place.dead_letters)
            .build()
            .await
            .expect("rabbitmq transport")
    }

    async fn dead_letters(
        place: &Place,
        n: usize,
        timeout: Duration,
    ) -> Vec<BTreeMap<String, String>> {
        let topology = Rabbit::topology(&place.dead_letters).await;
        let read = topology.read(n, timeout).await;
        let _ = topology.connection.close(200, "read".into()).await;
        read.into_iter().map(|r| r.headers).collect()
    }

    async fn remove(place: Place) {
        let exchange = place
            .destination
            .split_once('/')
            .map(|(e, _)| e.to_owned())
            .unwrap_or_default();
        let topology = Rabbit::topology(&place.source).await;
        let channel = topology.connection.create_channel().await.expect("channel");
        let _ = channel
            .queue_delete(place.dead_letters.as_str().into(), Default::default())
            .await;
        rabbitmq::Topology {
            exchange,
            ..topology
        }
        .delete()
        .await;
    }
}

fn check(results: Vec<Result<(), outbox_core::PublishError>>) {
    for (i, result) in results.into_iter().enumerate() {
        if let Err(e) = result {
            panic!("publishing job {i} failed: {e:?}");
        }
    }
}

/// A transport that checks, at every acknowledgement, that the message's id is already
/// committed in the inbox's processed-messages table (read on a connection of its own):
/// an acknowledgement before the commit counts in `early`.
#[derive(Debug)]
pub struct CommitBeforeAck<T> {
    /// The real transport.
    pub inner: T,
    /// The test database, where the inbox records processed ids.
    pub pool: outbox_core::sqlx::PgPool,
    /// Acknowledgements seen.
    pub acks: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Acknowledgements whose message was not committed yet.
    pub early: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<T: Transport> Transport for CommitBeforeAck<T> {
    type Token = T::Token;
    const NAME: &'static str = T::NAME;
    const CLOUDEVENTS_PREFIX: &'static str = T::CLOUDEVENTS_PREFIX;
    const CLOUDEVENTS_OTHER_PREFIXES: &'static [&'static str] = T::CLOUDEVENTS_OTHER_PREFIXES;

    fn receive(&self) -> impl Future<Output = Result<Delivery<T::Token>, BoxError>> + Send {
        self.inner.receive()
    }

    async fn ack(&self, delivery: &Delivery<T::Token>) -> Result<(), BoxError> {
        use std::sync::atomic::Ordering;
        let id: uuid::Uuid = delivery.headers["message-id"]
            .parse()
            .expect("a message id");
        let committed: bool = outbox_core::sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outbox_processed WHERE message_id = $1)",
        )
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .expect("look the id up");
        self.acks.fetch_add(1, Ordering::SeqCst);
        if !committed {
            self.early.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.ack(delivery).await
    }

    fn dead_letter_destination(&self) -> Option<String> {
        self.inner.dead_letter_destination()
    }

    fn dead_letter(
        &self,
        delivery: &Delivery<T::Token>,
        reason: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send {
        self.inner.dead_letter(delivery, reason)
    }

    fn keep_alive(&self) -> Option<Duration> {
        self.inner.keep_alive()
    }

    fn working(&self, delivery: &Delivery<T::Token>) -> impl Future<Output = ()> + Send {
        self.inner.working(delivery)
    }
}

/// A transport that never acknowledges: a consumer on it behaves as one killed after
/// each database commit and before its acknowledgement.
#[derive(Debug)]
pub struct NeverAck<T>(pub T);

impl<T: Transport> Transport for NeverAck<T> {
    type Token = T::Token;
    const NAME: &'static str = T::NAME;
    const CLOUDEVENTS_PREFIX: &'static str = T::CLOUDEVENTS_PREFIX;
    const CLOUDEVENTS_OTHER_PREFIXES: &'static [&'static str] = T::CLOUDEVENTS_OTHER_PREFIXES;

    fn receive(&self) -> impl Future<Output = Result<Delivery<T::Token>, BoxError>> + Send {
        self.0.receive()
    }

    async fn ack(&self, _delivery: &Delivery<T::Token>) -> Result<(), BoxError> {
        Ok(())
    }

    fn dead_letter_destination(&self) -> Option<String> {
        self.0.dead_letter_destination()
    }

    fn dead_letter(
        &self,
        delivery: &Delivery<T::Token>,
        reason: &str,
    ) -> impl Future<Output = Result<(), BoxError>> + Send {
        self.0.dead_letter(delivery, reason)
    }
}

/// Commits `count` `Job`s (`{"n":0}`, `{"n":1}`, ..., key `a`) to `destination` in one
/// transaction.
pub async fn emit_jobs(outbox: &outbox_core::Outbox, destination: &str, count: i32) {
    let mut tx = outbox.begin().await.expect("begin");
    for n in 0..count {
        tx.emit_message(
            outbox_core::OutboxMessage::new("Job", destination, format!(r#"{{"n":{n}}}"#))
                .with_key("a"),
        )
        .expect("emit");
    }
    tx.commit().await.expect("commit");
}

/// Runs a consumer of `transport` with the inbox `name` until it handled `count` jobs
/// (failing after `wait`), shuts it down, and returns the jobs' numbers in the order
/// they were handled.
pub async fn handle_jobs<T: Transport>(
    transport: T,
    outbox: &outbox_core::Outbox,
    name: &str,
    count: u64,
    wait: Duration,
) -> Vec<i32> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let into = std::sync::Arc::clone(&seen);
    let consumer = outbox_core::consumer::Consumer::builder(
        transport,
        outbox_core::inbox::Inbox::new(outbox, name),
    )
    .on_event_type::<kafka::Job, _>("Job", move |_tx, msg| {
        into.lock().expect("seen").push(msg.event.n);
        Box::pin(async { Ok(()) })
    })
    .build()
    .expect("consumer")
    .spawn();
    crate::wait_until(
        &format!("the consumer {name} handled {count} jobs"),
        wait,
        || async { consumer.stats().handled >= count },
    )
    .await;
    consumer.shutdown().await.expect("consumer");
    seen.lock().expect("seen").clone()
}

/// Waits until `consumer` has handled or dead-lettered `n` messages (a failure after
/// `timeout` prints its stats), stops it, and returns its final stats.
pub async fn settle(consumer: ConsumerHandle, n: u64, timeout: Duration) -> ConsumerStatsSnapshot {
    crate::wait_until_or(
        &format!("{n} messages handled or dead-lettered"),
        timeout,
        || async {
            let s = consumer.stats();
            s.handled + s.dead_lettered >= n
        },
        || format!("{:?}", consumer.stats()),
    )
    .await;
    let stats = consumer.stats();
    consumer.shutdown().await.expect("the consumer stops");
    stats
}
