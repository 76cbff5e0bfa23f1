//! CloudEvents 1.0 binary content mode on every publisher (#17 part 3): the attributes
//! ride as headers with each binding's prefix (`ce_` Kafka, `ce-` NATS, `cloudEvents:`
//! RabbitMQ by default since #33, `cloudEvents_` or `ce-` on request), next to the
//! outbox headers; the payload is the body, unwrapped; a row header that would shadow
//! an attribute is not copied. One expectation, three brokers. What other languages'
//! SDKs decode of it: tests/tests/cloudevents_interop.rs.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::TimeZone;
use futures_util::StreamExt;
use outbox_core::publisher::Publisher;
use outbox_core::publisher::cloudevents::CloudEvents;
use outbox_core::{OutboxMessage, OutboxRecord};

const SOURCE: &str = "/outbox-tests/orders";

fn record(destination: &str, spoofed: &str) -> OutboxRecord {
    let mut message = OutboxMessage::new("OrderPlaced", destination, r#"{"order":7}"#)
        .with_key("order-7")
        .with_header("traceparent", "00-abc-def-01")
        .with_header(spoofed, "spoofed");
    message.event_version = Some(2);
    let mut record = OutboxRecord::from(message).with_seq(1);
    record.created_at = chrono::Utc
        .with_ymd_and_hms(2026, 12, 1, 10, 30, 0)
        .single()
        .expect("a time");
    record
}

/// What every broker must show: the five attributes under `prefix`, the outbox headers,
/// the body as written.
fn check(prefix: &str, sent: &OutboxRecord, headers: &BTreeMap<String, String>, body: &str) {
    let attribute = |name: &str| headers.get(&format!("{prefix}{name}")).cloned();
    assert_eq!(
        attribute("specversion").as_deref(),
        Some("1.0"),
        "{headers:?}"
    );
    assert_eq!(attribute("id"), Some(sent.id.to_string()), "{headers:?}");
    assert_eq!(attribute("source").as_deref(), Some(SOURCE), "{headers:?}");
    assert_eq!(
        attribute("type").as_deref(),
        Some("OrderPlaced.v2"),
        "a row header must not shadow an attribute: {headers:?}"
    );
    assert_eq!(
        attribute("time").as_deref(),
        Some("2026-12-01T10:30:00.000000Z")
    );
    assert_eq!(
        headers.get("message-id"),
        Some(&sent.id.to_string()),
        "the outbox headers stay"
    );
    assert_eq!(
        headers.get("traceparent").map(String::as_str),
        Some("00-abc-def-01")
    );
    assert_eq!(body, sent.payload, "the payload is not wrapped");
}

fn ce() -> CloudEvents {
    CloudEvents::new(SOURCE).expect("a source")
}

#[tokio::test]
async fn kafka_writes_ce_headers() {
    use outbox_tests::kafka::{brokers, create_topic, delete_topic, read_topic, unique};
    let brokers = brokers();
    let topic = unique("cloudevents");
    create_topic(&brokers, &topic, 1).await;
    let publisher = outbox_kafka::KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .cloudevents(ce())
        .build()
        .await
        .expect("publisher");
    let sent = record(&topic, "ce_type");
    let results = publisher.publish(std::slice::from_ref(&sent)).await;
    assert!(results[0].is_ok(), "{results:?}");
    let read = tokio::task::spawn_blocking({
        let (brokers, topic) = (brokers.clone(), topic.clone());
        move || read_topic(&brokers, &topic, 1, Duration::from_secs(30))
    })
    .await
    .expect("reader");
    check("ce_", &sent, &read[0].headers, &read[0].payload);
    delete_topic(&brokers, &topic).await;
}

#[tokio::test]
async fn nats_writes_ce_headers() {
    use async_nats::jetstream::consumer;
    use outbox_tests::nats::{fresh_stream, nats_url};
    let (js, name, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.orders");
    let publisher = outbox_nats::NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .cloudevents(ce())
        .build()
        .await
        .expect("publisher");
    let sent = record(&subject, "ce-type");
    let results = publisher.publish(std::slice::from_ref(&sent)).await;
    assert!(results[0].is_ok(), "{results:?}");
    let reader = js
        .get_stream(&name)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config::default())
        .await
        .expect("consumer");
    let message = tokio::time::timeout(
        Duration::from_secs(30),
        reader.messages().await.expect("messages").next(),
    )
    .await
    .expect("a message within 30 s")
    .expect("a message")
    .expect("no error");
    let headers = outbox_tests::nats::text_headers(message.headers.as_ref());
    let body = std::str::from_utf8(&message.payload).expect("text");
    check("ce-", &sent, &headers, body);
    // The draft's binary mode maps every attribute, `datacontenttype` included.
    assert_eq!(
        headers.get("ce-datacontenttype").map(String::as_str),
        Some("application/json"),
        "{headers:?}"
    );
    js.delete_stream(&name).await.expect("delete stream");
}

/// `CloudEventsMode::Structured` (the released NATS binding 1.0.2): the payload is a JSON
/// event whose `data` is the payload as written, `content-type:
/// application/cloudevents+json`, no `ce-*` headers; the outbox headers stay. Our NATS
/// consumer unwraps it: the handler gets the event as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_writes_structured_mode_and_the_consumer_unwraps_it() {
    use async_nats::jetstream::consumer;
    use outbox_core::consumer::Consumer;
    use outbox_core::inbox::Inbox;
    use outbox_tests::nats::{fresh_stream, nats_url};
    use std::sync::{Arc, Mutex};
    let (js, name, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.orders");
    let publisher = outbox_nats::NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .cloudevents(ce())
        .cloudevents_mode(outbox_nats::CloudEventsMode::Structured)
        .build()
        .await
        .expect("publisher");
    let sent = record(&subject, "ce-type");
    let results = publisher.publish(std::slice::from_ref(&sent)).await;
    assert!(results[0].is_ok(), "{results:?}");
    let reader = js
        .get_stream(&name)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config::default())
        .await
        .expect("consumer");
    let message = tokio::time::timeout(
        Duration::from_secs(30),
        reader.messages().await.expect("messages").next(),
    )
    .await
    .expect("a message within 30 s")
    .expect("a message")
    .expect("no error");
    let headers = outbox_tests::nats::text_headers(message.headers.as_ref());
    assert_eq!(
        headers.get("content-type").map(String::as_str),
        Some("application/cloudevents+json"),
        "{headers:?}"
    );
    assert!(
        !headers.keys().any(|k| k.starts_with("ce-")),
        "no binary-mode headers: {headers:?}"
    );
    assert_eq!(headers.get("message-id"), Some(&sent.id.to_string()));
    assert_eq!(
        headers.get("event-type").map(String::as_str),
        Some("OrderPlaced")
    );
    let event: serde_json::Value = serde_json::from_slice(&message.payload).expect("a JSON event");
    assert_eq!(event["specversion"], "1.0");
    assert_eq!(event["id"], sent.id.to_string());
    assert_eq!(event["source"], SOURCE);
    assert_eq!(event["type"], "OrderPlaced.v2");
    assert_eq!(event["time"], "2026-12-01T10:30:00.000000Z");
    assert_eq!(event["datacontenttype"], "application/json");
    assert_eq!(event["data"], serde_json::json!({ "order": 7 }));

    #[derive(Debug, serde::Deserialize)]
    struct Order {
        order: i64,
    }
    let db = outbox_tests::TestDb::new().await;
    let outbox = db.outbox().await;
    type Seen = Vec<(uuid::Uuid, Option<i32>, i64)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let sink = Arc::clone(&seen);
    let transport = outbox_nats::NatsTransport::builder(nats_url(), &name, "structured")
        .filter_subject(&subject)
        .build()
        .await
        .expect("nats transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "ce-structured"))
        .on_event_type::<Order, _>("OrderPlaced", move |_tx, msg| {
            let sink = Arc::clone(&sink);
            Box::pin(async move {
                sink.lock()
                    .expect("lock")
                    .push((msg.id, msg.version, msg.event.order));
                Ok(())
            })
        })
        .build()
        .expect("consumer")
        .spawn();
    outbox_tests::wait_until("the event handled", Duration::from_secs(60), || async {
        consumer.stats().handled >= 1
    })
    .await;
    consumer.shutdown().await.expect("consumer");
    assert_eq!(*seen.lock().expect("lock"), vec![(sent.id, Some(2), 7)]);
    js.delete_stream(&name).await.expect("delete stream");
    db.cleanup().await;
}

/// Publishes one record with `layout` (the default when `None`) and reads it back.
async fn rabbitmq_headers(
    layout: Option<outbox_rabbitmq::CloudEventsHeaders>,
    spoofed: &str,
) -> (OutboxRecord, outbox_tests::rabbitmq::Read) {
    use outbox_tests::rabbitmq::{Topology, rabbitmq_url};
    let topology = Topology::declare("orders").await;
    let destination = format!("{}/orders", topology.exchange);
    let mut builder = outbox_rabbitmq::RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .destination(&destination)
        .cloudevents(ce());
    if let Some(layout) = layout {
        builder = builder.cloudevents_headers(layout);
    }
    let publisher = builder.build().await.expect("publisher");
    let sent = record(&destination, spoofed);
    let results = publisher.publish(std::slice::from_ref(&sent)).await;
    assert!(results[0].is_ok(), "{results:?}");
    let mut read = topology.read(1, Duration::from_secs(30)).await;
    topology.delete().await;
    (sent, read.remove(0))
}

#[tokio::test]
async fn rabbitmq_writes_cloud_events_headers() {
    use outbox_rabbitmq::CloudEventsHeaders;
    // The default: the AMQP binding's `cloudEvents:`, no other prefix.
    let (sent, read) = rabbitmq_headers(None, "cloudEvents:type").await;
    check("cloudEvents:", &sent, &read.headers, &read.body);
    assert!(
        !read.headers.keys().any(|k| k.starts_with("cloudEvents_")),
        "{:?}",
        read.headers
    );
    // A row header under another prefix a decoder reads is not copied either.
    let (_, read) = rabbitmq_headers(None, "cloudEvents_type").await;
    assert!(
        !read.headers.contains_key("cloudEvents_type"),
        "{:?}",
        read.headers
    );
    // On request: outbox 0.1's `cloudEvents_`, Knative's `ce-`.
    let (sent, read) =
        rabbitmq_headers(Some(CloudEventsHeaders::Underscore), "cloudEvents_type").await;
    check("cloudEvents_", &sent, &read.headers, &read.body);
    let (sent, read) = rabbitmq_headers(Some(CloudEventsHeaders::Knative), "ce-type").await;
    check("ce-", &sent, &read.headers, &read.body);
}

/// The Kafka consumer takes an event in either form: with the outbox headers, or from a
/// producer that writes only the CloudEvents attributes (`ce_id`, `ce_type`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_consumer_accepts_a_cloud_event_without_the_outbox_headers() {
    use outbox_core::consumer::Consumer;
    use outbox_core::inbox::Inbox;
    use outbox_kafka::rdkafka::ClientConfig;
    use outbox_kafka::rdkafka::message::{Header, OwnedHeaders};
    use outbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    use outbox_tests::kafka;
    use outbox_tests::kafka::{brokers, create_topic, delete_topic, unique};
    use std::sync::{Arc, Mutex};

    let brokers = brokers();
    let topic = unique("cloudevents-in");
    create_topic(&brokers, &topic, 1).await;
    // A foreign producer: CloudEvents binary mode only.
    let foreign = uuid::Uuid::now_v7();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("producer");
    let id = foreign.to_string();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "ce_specversion",
            value: Some("1.0"),
        })
        .insert(Header {
            key: "ce_id",
            value: Some(id.as_str()),
        })
        .insert(Header {
            key: "ce_source",
            value: Some("/elsewhere"),
        })
        .insert(Header {
            key: "ce_type",
            value: Some("OrderPlaced.v3"),
        })
        .insert(Header {
            key: "content-type",
            value: Some("application/json"),
        });
    producer
        .send(
            FutureRecord::to(&topic)
                .key("order-9")
                .payload(r#"{"order":9}"#)
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .expect("produce the foreign event");
    // Ours, CloudEvents on: both forms in one message.
    let publisher = outbox_kafka::KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .cloudevents(ce())
        .build()
        .await
        .expect("publisher");
    let ours = record(&topic, "x-other");
    assert!(publisher.publish(std::slice::from_ref(&ours)).await[0].is_ok());

    #[derive(Debug, serde::Deserialize)]
    struct Order {
        order: i64,
    }
    let db = outbox_tests::TestDb::new().await;
    let outbox = db.outbox().await;
    /// Each handled event: its id, version and order number.
    type Seen = Vec<(uuid::Uuid, Option<i32>, i64)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let sink = Arc::clone(&seen);
    let builder = Consumer::builder(
        kafka::transport(&brokers, unique("group"), &topic)
            .build()
            .await
            .expect("kafka transport"),
        Inbox::new(&outbox, "ce"),
    )
    .on_event_type::<Order, _>("OrderPlaced", move |_tx, msg| {
        let sink = Arc::clone(&sink);
        Box::pin(async move {
            sink.lock()
                .expect("lock")
                .push((msg.id, msg.version, msg.event.order));
            Ok(())
        })
    });
    let consumer = builder.build().expect("consumer").spawn();
    outbox_tests::wait_until("both events handled", Duration::from_secs(60), || async {
        consumer.stats().handled >= 2
    })
    .await;
    consumer.shutdown().await.expect("consumer");
    // Different keys: handled in parallel, in no promised order.
    let mut seen = seen.lock().expect("lock").clone();
    seen.sort_by_key(|(.., order)| -order);
    assert_eq!(
        seen,
        vec![(foreign, Some(3), 9), (ours.id, Some(2), 7)],
        "ids from ce_id / message-id, versions from the type / event-version"
    );
    delete_topic(&brokers, &topic).await;
    db.cleanup().await;
}
