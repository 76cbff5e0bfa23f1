//! Payloads are bytes: what `emit` was given is what every broker receives, byte for
//! byte, with its content type, from every database and both PostgreSQL modes.
//!
//! The payloads are the ones a JSON column changed or refused: JSON written as a
//! producer wrote it (spaces, key order, `1e2`, an escaped `é`), which PostgreSQL's
//! `jsonb` re-rendered; JSON holding `\u0000`, which `jsonb` refused; every byte value,
//! which no text column holds; and an empty body. Each database runs its own relay into
//! Kafka, NATS and RabbitMQ in turn, and each broker's own client reads the bytes back.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::publisher::headers;
use outbox_core::relay::Relay;
use outbox_core::sqlx::{MySql, Sqlite};
use outbox_core::{Backend, Outbox, OutboxMessage};
use outbox_kafka::KafkaPublisher;
use outbox_nats::NatsPublisher;
use outbox_rabbitmq::RabbitPublisher;
use outbox_tests::backends::TestBackend;
use outbox_tests::rabbitmq::{Topology, rabbitmq_url};
use outbox_tests::{TestDb, kafka, nats, wait_until};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// The messages of one round: (content type, payload).
fn payloads() -> Vec<(&'static str, Vec<u8>)> {
    let mut every_byte: Vec<u8> = (0..=255).collect();
    every_byte.extend_from_slice(b"\n\0{\xc3\x28"); // and an invalid UTF-8 pair
    vec![
        (
            "application/json",
            br#"{"z": 1,  "a": [1.10, 1e2, "\u00e9"], "n": null}"#.to_vec(),
        ),
        ("application/json", br#"{"nul":"a\u0000b"}"#.to_vec()),
        ("application/octet-stream", every_byte),
        (
            "application/x-protobuf; messageType=\"acme.Empty\"",
            Vec::new(),
        ),
    ]
}

/// Emits the round's messages to `destination` in one transaction; their ids, each
/// with its content type and payload.
async fn emit<DB: Backend>(
    outbox: &Outbox<DB>,
    destination: &str,
) -> BTreeMap<Uuid, (&'static str, Vec<u8>)> {
    let mut sent = BTreeMap::new();
    let mut tx = outbox.begin().await.expect("begin");
    // Each payload twice: by `flush` (bound parameters; WAL mode: a `bytea[]`), then
    // with the commit (WAL mode: literals in the commit's round trip).
    for flush in [true, false] {
        for (content_type, payload) in payloads() {
            let message = OutboxMessage::new("Bytes", destination, payload.clone())
                .with_content_type(content_type)
                .with_key("k");
            sent.insert(message.id, (content_type, payload));
            tx.emit_message(message).expect("emit");
        }
        if flush {
            tx.flush().await.expect("flush");
        }
    }
    tx.commit().await.expect("commit");
    sent
}

/// What a broker's client read: id -> (content-type header, payload).
type Received = BTreeMap<Uuid, (Option<String>, Vec<u8>)>;

fn check(broker: &str, database: &str, sent: &BTreeMap<Uuid, (&str, Vec<u8>)>, read: &Received) {
    assert_eq!(
        read.keys().collect::<Vec<_>>(),
        sent.keys().collect::<Vec<_>>(),
        "{database} -> {broker}: every message, once"
    );
    for (id, (content_type, payload)) in sent {
        let (got_type, got) = &read[id];
        assert_eq!(
            got,
            payload,
            "{database} -> {broker}: message {id} ({content_type}) arrived with other bytes:\n  sent {:?}\n  got  {:?}",
            String::from_utf8_lossy(payload),
            String::from_utf8_lossy(got)
        );
        assert_eq!(
            got_type.as_deref(),
            Some(*content_type),
            "{database} -> {broker}: the content-type of {id}"
        );
    }
}

fn id_of(headers: &BTreeMap<String, String>) -> Uuid {
    headers
        .get(headers::MESSAGE_ID)
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("a message-id header: {headers:?}"))
}

/// One round per broker: the round's messages emitted, relayed, read back.
async fn through_every_broker<DB: Backend>(outbox: &Outbox<DB>, database: &str) {
    // Kafka.
    let brokers = kafka::brokers();
    let topic = kafka::unique("bytes");
    kafka::create_topic(&brokers, &topic, 1).await;
    let sent = emit(outbox, &topic).await;
    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .build()
        .await
        .expect("kafka publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let read = tokio::task::spawn_blocking({
        let (brokers, topic) = (brokers.clone(), topic.clone());
        move || kafka::read_topic(&brokers, &topic, 8, WAIT)
    })
    .await
    .expect("read");
    relay.shutdown().await;
    let read: Received = read
        .into_iter()
        .map(|r| {
            let content_type = r.headers.get(headers::CONTENT_TYPE).cloned();
            (id_of(&r.headers), (content_type, r.bytes))
        })
        .collect();
    check("Kafka", database, &sent, &read);
    kafka::delete_topic(&brokers, &topic).await;

    // NATS JetStream.
    let (js, stream, prefix) = nats::fresh_stream().await;
    let subject = format!("{prefix}.bytes");
    let sent = emit(outbox, &subject).await;
    let publisher = NatsPublisher::builder(nats::nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await
        .expect("nats publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    wait_until("NATS has the round's messages", WAIT, || async {
        let info = js
            .get_stream(&stream)
            .await
            .expect("stream")
            .cached_info()
            .state
            .messages;
        info >= 8
    })
    .await;
    relay.shutdown().await;
    let read: Received = nats::read_all(&js, &stream, 20)
        .await
        .into_iter()
        .map(|(h, bytes)| (id_of(&h), (h.get(headers::CONTENT_TYPE).cloned(), bytes)))
        .collect();
    check("NATS", database, &sent, &read);
    js.delete_stream(&stream).await.expect("delete the stream");

    // RabbitMQ: the header and the `content_type` property both say it.
    let topology = Topology::declare("bytes").await;
    let destination = format!("{}/bytes", topology.exchange);
    let sent = emit(outbox, &destination).await;
    let publisher = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("rabbitmq publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let messages = topology.read(8, WAIT).await;
    relay.shutdown().await;
    for m in &messages {
        assert_eq!(
            m.content_type.as_deref(),
            m.headers.get(headers::CONTENT_TYPE).map(String::as_str),
            "{database} -> RabbitMQ: the property and the header agree"
        );
    }
    let read: Received = messages
        .into_iter()
        .map(|m| (id_of(&m.headers), (m.content_type, m.bytes)))
        .collect();
    check("RabbitMQ", database, &sent, &read);
    topology.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_table_mode_sends_the_exact_bytes_to_every_broker() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    through_every_broker(&outbox, "PostgreSQL (table mode)").await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_wal_mode_sends_the_exact_bytes_to_every_broker() {
    let db = TestDb::new().await;
    let (outbox, slot) = outbox_tests::wal::outbox_in(&db).await;
    through_every_broker(&outbox, "PostgreSQL (WAL mode)").await;
    outbox_tests::wal::cleanup(db, &slot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_sends_the_exact_bytes_to_every_broker() {
    let f = <MySql as TestBackend>::fixture().await;
    through_every_broker(&f.outbox, "MariaDB").await;
    <MySql as TestBackend>::cleanup(f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sends_the_exact_bytes_to_every_broker() {
    let f = <Sqlite as TestBackend>::fixture().await;
    through_every_broker(&f.outbox, "SQLite").await;
    <Sqlite as TestBackend>::cleanup(f).await;
}
