//! Kafka fixtures: the shared broker of `scripts/services.sh`, unique topic and group
//! names per test, and brokers of a test's own (to kill and restart).
//!
//! The shared broker is `OUTBOX_TEST_KAFKA` (default `127.0.0.1:9092`). A missing broker
//! fails the test with a message saying how to start it; it never skips.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outbox_kafka::rdkafka::ClientConfig;
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use outbox_kafka::rdkafka::types::RDKafkaErrorCode;

/// The shared broker's address, after checking that it accepts connections.
pub fn brokers() -> String {
    let addr = std::env::var("OUTBOX_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let reachable = addr
        .parse()
        .ok()
        .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok())
        .is_some();
    assert!(
        reachable,
        "no Kafka-protocol broker at {addr}: start the services with `eval \"$(scripts/services.sh)\"` \
         (or set OUTBOX_TEST_KAFKA)"
    );
    addr
}

/// A topic (or group) name no other test or run uses.
pub fn unique(prefix: &str) -> String {
    format!("outbox-test.{prefix}.{}", uuid::Uuid::now_v7().simple())
}

fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create a Kafka admin client")
}

/// Creates `topic` with `partitions` partitions (an existing topic is fine).
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let results = admin(brokers)
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap_or_else(|e| panic!("create topic {topic} on {brokers}: {e}"));
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => panic!("create topic {t} on {brokers}: {code}"),
        }
    }
}

/// Deletes `topic` if it exists.
pub async fn delete_topic(brokers: &str, topic: &str) {
    let _ = admin(brokers)
        .delete_topics(
            &[topic],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await;
}

/// The topics on the cluster, with their partition counts.
pub fn topics(brokers: &str) -> Vec<(String, usize)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create a metadata client");
    let metadata = consumer
        .fetch_metadata(None, Duration::from_secs(10))
        .expect("fetch metadata");
    metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| (t.name().to_owned(), t.partitions().len()))
        .collect()
}

/// librdkafka settings for test consumers on this broker (group joins take half the
/// session timeout on tansu).
pub const TEST_CONSUMER_SETTINGS: [(&str, &str); 3] = [
    ("session.timeout.ms", "2000"),
    ("heartbeat.interval.ms", "500"),
    // The lag (from librdkafka's statistics) within a test's patience.
    ("statistics.interval.ms", "200"),
];

/// A consumer transport for tests: group `group`, subscribed to `topic`, with
/// [`TEST_CONSUMER_SETTINGS`].
pub fn transport(
    brokers: &str,
    group: impl Into<String>,
    topic: &str,
) -> outbox_kafka::KafkaTransportBuilder {
    let mut builder = outbox_kafka::KafkaTransport::builder(brokers, group).topic(topic);
    for (k, v) in TEST_CONSUMER_SETTINGS {
        builder = builder.set(k, v);
    }
    builder
}

/// A tansu broker of the test's own, on a free port, with in-memory storage.
#[derive(Debug)]
pub struct OwnBroker {
    bin: String,
    port: u16,
    /// What the broker tells clients to connect to (itself, or a proxy in front of it).
    advertised: String,
    child: Option<Child>,
    log: std::path::PathBuf,
}

impl OwnBroker {
    /// Starts a broker from `$TANSU_BIN` on a free port; fails the test if `TANSU_BIN`
    /// is not set.
    pub fn start() -> OwnBroker {
        let port = free_port();
        OwnBroker::start_on(port, format!("127.0.0.1:{port}"))
    }

    /// A broker with a fault-injecting [`Proxy`](crate::proxy::Proxy) in front of it,
    /// which it advertises: every connection of a client, bootstrap and partition leader
    /// alike, goes through the proxy.
    pub async fn behind_proxy() -> (OwnBroker, crate::proxy::Proxy) {
        let port = free_port();
        let proxy =
            crate::proxy::Proxy::start(format!("127.0.0.1:{port}").parse().expect("address")).await;
        let advertised = proxy.addr().to_string();
        let broker = tokio::task::spawn_blocking(move || OwnBroker::start_on(port, advertised))
            .await
            .expect("start the broker");
        (broker, proxy)
    }

    fn start_on(port: u16, advertised: String) -> OwnBroker {
        let bin = std::env::var("TANSU_BIN").unwrap_or_else(|_| {
            panic!(
                "TANSU_BIN is not set: this test starts and kills a broker of its own; run \
                 `eval \"$(scripts/services.sh)\"` first, which installs tansu and exports TANSU_BIN"
            )
        });
        let log = std::env::temp_dir().join(format!("outbox-test-tansu-{port}.log"));
        let mut broker = OwnBroker {
            bin,
            port,
            advertised,
            child: None,
            log,
        };
        broker.restart();
        broker
    }

    /// `127.0.0.1:<port>`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker process (again) and waits until it accepts connections.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the broker is already running");
        let addr = self.address();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the broker log");
        let child = Command::new(&self.bin)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{addr}"),
                "--advertised-listener-url",
                &format!("tcp://{}", self.advertised),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {} : {e}", self.bin));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        let sock = addr.parse().expect("address");
        while TcpStream::connect_timeout(&sock, Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not listen on {addr} within 20 s; see {}",
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILLs the broker and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL the broker");
            let _ = child.wait();
        }
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("find a free port")
        .port()
}

/// One message read back from a topic.
#[derive(Debug, Clone)]
pub struct Read {
    /// The partition it is in.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
    /// Its message key.
    pub key: Option<String>,
    /// Its `outbox-message-id` header.
    pub id: String,
    /// Its value, as text (bytes that are not UTF-8 replaced).
    pub payload: String,
    /// Its value, the bytes as they came.
    pub bytes: Vec<u8>,
    /// Its headers, as text.
    pub headers: std::collections::BTreeMap<String, String>,
}

impl Read {
    fn of(message: &outbox_kafka::rdkafka::message::BorrowedMessage<'_>) -> Read {
        use outbox_kafka::rdkafka::Message as _;
        use outbox_kafka::rdkafka::message::Headers as _;
        let headers: std::collections::BTreeMap<String, String> = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_owned(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Read {
            partition: message.partition(),
            offset: message.offset(),
            key: message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            id: headers
                .get(outbox_kafka::headers::MESSAGE_ID)
                .cloned()
                .unwrap_or_default(),
            payload: String::from_utf8_lossy(message.payload().unwrap_or_default()).into_owned(),
            bytes: message.payload().unwrap_or_default().to_vec(),
            headers,
        }
    }
}

/// A consumer outside any group (offsets never committed; from the log's start when
/// an assigned offset is out of range), and `topic`'s partitions.
fn reader(
    brokers: &str,
    topic: &str,
    timeout: Duration,
) -> Result<(BaseConsumer, Vec<i32>), String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(|e| format!("create a reader: {e}"))?;
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("metadata of {topic}: {e}"))?;
    let partitions = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    Ok((consumer, partitions))
}

/// Each partition's log start and high watermark as the broker reports them (ListOffsets).
pub fn watermarks(
    brokers: &str,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<(i32, i64, i64)>, String> {
    let (consumer, partitions) = reader(brokers, topic, timeout)?;
    let mut marks = Vec::new();
    for p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, timeout)
            .map_err(|e| format!("watermarks of {topic}/{p}: {e}"))?;
        marks.push((p, low, high));
    }
    marks.sort_unstable();
    Ok(marks)
}

/// Every message of `topic`, every partition from its first offset, read until none
/// came for `quiet` (the writers have stopped: this is for after a run), in log order
/// per partition, without a consumer group. For telling afterwards whether a message
/// reached the broker at all.
///
/// Each partition is read from offset 0, whatever the broker says its log starts at.
/// The end is found by silence, not by the high watermark: tansu reports a partition's
/// high watermark as the base offset of its last record batch plus one, so a batch of
/// 30 records at offsets 0..29 shows as ending at 1.
pub fn read_to_end(
    brokers: &str,
    topic: &str,
    quiet: Duration,
    timeout: Duration,
) -> Result<Vec<Read>, String> {
    use outbox_kafka::rdkafka::{Offset, TopicPartitionList};
    let (consumer, partitions) = reader(brokers, topic, timeout)?;
    // From offset 0, not from the broker's "earliest": a broker that reports a wrong
    // start of its log must not hide the records before it.
    let mut assignment = TopicPartitionList::new();
    for p in partitions {
        assignment
            .add_partition_offset(topic, p, Offset::Offset(0))
            .map_err(|e| e.to_string())?;
    }
    if assignment.count() == 0 {
        return Err(format!("{topic} has no partitions"));
    }
    consumer
        .assign(&assignment)
        .map_err(|e| format!("assign {topic}: {e}"))?;
    let deadline = Instant::now() + timeout;
    let mut last = Instant::now();
    let mut read = Vec::new();
    while last.elapsed() < quiet {
        if Instant::now() > deadline {
            return Err(format!(
                "{topic} was still sending after {timeout:?} ({} messages read)",
                read.len()
            ));
        }
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        // An error event (a broker connection dropped and retried) is not the end.
        let Ok(message) = message else {
            continue;
        };
        read.push(Read::of(&message));
        last = Instant::now();
    }
    Ok(read)
}

/// Every message of `topic`, partition by partition in log order, read until `distinct`
/// distinct message ids were seen (or the test fails after `timeout`).
pub fn read_topic(brokers: &str, topic: &str, distinct: usize, timeout: Duration) -> Vec<Read> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("create a reader");
    consumer.subscribe(&[topic]).expect("subscribe");
    let deadline = Instant::now() + timeout;
    let mut read = Vec::new();
    let mut ids = std::collections::HashSet::new();
    while ids.len() < distinct {
        assert!(
            Instant::now() < deadline,
            "read {} distinct messages of {topic} within {timeout:?}, expected {distinct}",
            ids.len()
        );
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let message = message.unwrap_or_else(|e| panic!("read {topic}: {e}"));
        let message = Read::of(&message);
        assert!(!message.id.is_empty(), "a message id header: {message:?}");
        ids.insert(message.id.clone());
        read.push(message);
    }
    read
}

/// The payload of the `Job` test events: `{"n": ...}`.
#[derive(Debug, serde::Deserialize)]
pub struct Job {
    /// The job's number.
    pub n: i32,
}

/// A `Job` record for `topic`, key `jobs`, payload `{"n":n}`, a fresh id.
pub fn job(topic: &str, n: i32) -> outbox_core::OutboxRecord {
    let message =
        outbox_core::OutboxMessage::new("Job", topic, format!(r#"{{"n":{n}}}"#)).with_key("jobs");
    outbox_core::OutboxRecord::from(message).with_seq(i64::from(n))
}

/// A publisher with the defaults for `topic` (which must exist), catalog not checked.
pub async fn job_publisher(brokers: &str, topic: &str) -> outbox_kafka::KafkaPublisher {
    outbox_kafka::KafkaPublisher::builder(brokers)
        .skip_catalog_check()
        .destination(topic)
        .build()
        .await
        .expect("publisher")
}
