//! The Kafka side of the benchmarks: topics, our publisher, the raw-produce ceiling and
//! a consumer that timestamps arrivals.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use outbox_kafka::KafkaPublisher;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::mpsc;

use crate::BoxError;

pub const PARTITIONS: i32 = 4;

/// A fresh topic with [`PARTITIONS`] partitions.
pub async fn create_topic(brokers: &str) -> Result<String, BoxError> {
    let topic = format!("outbox-bench-{}", uuid::Uuid::now_v7().simple());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let results = admin
        .create_topics(
            &[NewTopic::new(
                &topic,
                PARTITIONS,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for r in results {
        r.map_err(|(t, e)| format!("cannot create topic {t}: {e}"))?;
    }
    Ok(topic)
}

/// Our publisher with its defaults, for `topic`. `OUTBOX_BENCH_PRODUCER=k=v,k=v` sets
/// producer properties on top, for experiments (they are printed when set).
pub async fn publisher(brokers: &str, topic: &str) -> Result<KafkaPublisher, BoxError> {
    let mut builder = KafkaPublisher::builder(brokers)
        .skip_catalog_check()
        .destination(topic);
    let overrides = overrides("OUTBOX_BENCH_PRODUCER")?;
    if !overrides.is_empty() {
        eprintln!("producer properties set by OUTBOX_BENCH_PRODUCER: {overrides:?}");
    }
    for (key, value) in overrides {
        builder = builder.set(key, value);
    }
    Ok(builder.build().await?)
}

/// The librdkafka properties in the environment variable `name` (`k=v,k=v`).
pub fn overrides(name: &str) -> Result<Vec<(String, String)>, BoxError> {
    let Ok(text) = std::env::var(name) else {
        return Ok(Vec::new());
    };
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| format!("{name}: {p:?} is not key=value (e.g. linger.ms=0)").into())
        })
        .collect()
}

/// The latency ceiling of the broker: one message of `payload` bytes at a time, at `rate`
/// per second for `seconds`, produced straight with rdkafka (idempotent, `acks=all`,
/// `linger.ms=1` as the relay's producer); returns the send -> acknowledgement times in
/// ms, sorted.
pub async fn raw_produce_latency(
    brokers: &str,
    topic: &str,
    rate: u64,
    seconds: u64,
    payload: usize,
) -> Result<Vec<f64>, BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .create()?;
    let body = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(payload.saturating_sub(14))
    );
    // Warm-up: the producer's connection and id before the clock starts.
    producer
        .send_result(
            FutureRecord::to(topic)
                .key("warm-up")
                .payload(body.as_str()),
        )
        .map_err(|(e, _)| e)?
        .await?
        .map_err(|(e, _)| e)?;
    let started = tokio::time::Instant::now();
    let mut waiting = Vec::new();
    for i in 0..rate * seconds {
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate as f64)).await;
        let key = format!("k{}", i % 1000);
        let sent = Instant::now();
        let delivery = producer
            .send_result(
                FutureRecord::to(topic)
                    .key(key.as_str())
                    .payload(body.as_str()),
            )
            .map_err(|(e, _)| e)?;
        waiting.push(tokio::spawn(async move {
            let acked = delivery.await;
            (acked, sent.elapsed())
        }));
    }
    let mut ms = Vec::with_capacity(waiting.len());
    for w in waiting {
        let (acked, took) = w.await?;
        acked?.map_err(|(e, _)| e)?;
        ms.push(took.as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms)
}

/// (c) The broker ceiling: the same messages produced straight from memory by an
/// idempotent producer (`acks=all`), all in flight, then every ack awaited.
pub async fn raw_produce(
    brokers: &str,
    topic: &str,
    events: u64,
    keys: u64,
    payload: usize,
) -> Result<f64, BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()?;
    let filler = "x".repeat(payload.saturating_sub(60));
    let bodies: Vec<(String, String)> = (0..events)
        .map(|g| {
            let key = format!("k{}", g % keys);
            let body = serde_json::json!({"n": g, "key": key, "filler": filler}).to_string();
            (key, body)
        })
        .collect();
    let started = Instant::now();
    let mut in_flight = Vec::with_capacity(bodies.len());
    for (key, body) in &bodies {
        let mut record = FutureRecord::to(topic)
            .key(key.as_str())
            .payload(body.as_str());
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    in_flight.push(delivery);
                    break;
                }
                Err((e, back)) => {
                    if e.rdkafka_error_code() != Some(rdkafka::types::RDKafkaErrorCode::QueueFull) {
                        return Err(e.into());
                    }
                    record = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    for delivery in in_flight {
        delivery.await?.map_err(|(e, _)| e)?;
    }
    Ok(events as f64 / started.elapsed().as_secs_f64())
}

/// Arrival times of messages on `topic`, keyed by their `message-id` header.
pub struct Arrivals {
    rx: mpsc::UnboundedReceiver<(uuid::Uuid, Instant)>,
    pub seen: HashMap<uuid::Uuid, Instant>,
}

impl Arrivals {
    /// Subscribes from the beginning of `topic`; returns once partitions are assigned.
    pub async fn start(brokers: &str, topic: &str) -> Result<Arrivals, BoxError> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set(
                "group.id",
                format!("outbox-bench-{}", uuid::Uuid::now_v7().simple()),
            )
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("session.timeout.ms", "2000")
            .set("heartbeat.interval.ms", "500")
            .set("fetch.wait.max.ms", "5")
            .create()?;
        consumer.subscribe(&[topic])?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while consumer.assignment()?.count() == 0 {
            if Instant::now() > deadline {
                return Err("the bench consumer got no partitions within 30 s".into());
            }
            // Polling drives the group join.
            let _ = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut stream = consumer.stream();
            while let Some(Ok(m)) = stream.next().await {
                let now = Instant::now();
                let id = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == "message-id")
                        .and_then(|h| h.value)
                        .and_then(|v| std::str::from_utf8(v).ok())
                        .and_then(|v| v.parse::<uuid::Uuid>().ok())
                });
                if let Some(id) = id
                    && tx.send((id, now)).is_err()
                {
                    break;
                }
            }
        });
        Ok(Arrivals {
            rx,
            seen: HashMap::new(),
        })
    }

    /// Arrivals sent by hand on the returned channel (see `publisher::Acked`).
    pub fn channel() -> (mpsc::UnboundedSender<(uuid::Uuid, Instant)>, Arrivals) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            tx,
            Arrivals {
                rx,
                seen: HashMap::new(),
            },
        )
    }

    /// Arrivals at an in-memory publisher (acknowledgement time), for `--broker memory`.
    pub fn from_memory(publisher: &outbox_core::publisher::InMemoryPublisher) -> Arrivals {
        let mut published = publisher.subscribe();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(record) = published.recv().await {
                if tx.send((record.id, Instant::now())).is_err() {
                    break;
                }
            }
        });
        Arrivals {
            rx,
            seen: HashMap::new(),
        }
    }

    /// Waits until `n` distinct messages arrived; false on timeout.
    pub async fn wait_for(&mut self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.seen.len() < n {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some((id, at))) => {
                    self.seen.entry(id).or_insert(at);
                }
                _ => return false,
            }
        }
        true
    }
}
