//! Codecs chosen by the event type (#38 §2): a Protobuf event (`codec = protobuf` on a
//! `prost::Message`) is written as prost encodes it, with `content-type:
//! application/protobuf`, on every broker; Google's Protobuf runtime for Python decodes
//! what each broker received; a consumer's handler decodes it by its type, and a handler
//! of JSON refuses it by its content type. A raw-bytes event carries the type's bytes
//! and the content type it names.

use std::path::PathBuf;
use std::time::Duration;

use outbox_core::admin::{Admin, ListFilter};
use outbox_core::consumer::{Consumer, Policy};
use outbox_core::inbox::Inbox;
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::{OutboxEvent, OutboxMessage, OutboxRecord, sqlx};
use outbox_tests::consumers::{Broker, Kafka, Nats, Rabbit};
use outbox_tests::{TestDb, kafka, nats, rabbitmq, wait_until};
use prost::Message as _;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

/// A Protobuf event: prost's message, the outbox's routing.
#[derive(Clone, PartialEq, prost::Message, OutboxEvent)]
#[outbox(destination = "orders.proto", key = order_id, codec = protobuf)]
struct OrderPlaced {
    #[prost(uint64, tag = "1")]
    order_id: u64,
    #[prost(string, tag = "2")]
    customer: String,
    #[prost(bytes = "vec", tag = "3")]
    signature: Vec<u8>,
}

/// Its schema, as the Python decoder builds its descriptor from it.
const ORDER_PLACED_SCHEMA: &str = r#"{"package": "acme", "message": "OrderPlaced",
 "fields": [["order_id", 1, "uint64"], ["customer", 2, "string"], ["signature", 3, "bytes"]]}"#;

/// A raw-bytes event: the type is its bytes.
#[derive(Debug, Clone, PartialEq, OutboxEvent)]
#[outbox(destination = "thumbnails", codec = bytes, content_type = "image/png")]
struct Thumbnail(Vec<u8>);

impl AsRef<[u8]> for Thumbnail {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for Thumbnail {
    fn from(bytes: Vec<u8>) -> Self {
        Thumbnail(bytes)
    }
}

fn order(n: u64) -> OrderPlaced {
    OrderPlaced {
        order_id: n,
        customer: format!("customer é {n}"),
        signature: vec![0, 255, n as u8, b'\n'],
    }
}

/// `order(n)` as a record for `destination`.
fn record(destination: &str, n: u64) -> OutboxRecord {
    let mut message = OutboxMessage::from_event(&order(n)).expect("encode");
    message.destination = destination.to_owned();
    OutboxRecord::from(message).with_seq(n as i64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_and_raw_bytes_events_are_written_as_their_codec_writes_them() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(order(7)).expect("emit a Protobuf event");
    let thumbnail = Thumbnail(vec![0x89, b'P', b'N', b'G', 0]);
    tx.emit(&thumbnail)
        .expect("emit a bytes event by reference");
    tx.commit().await.expect("commit");

    let admin = Admin::new(outbox.clone());
    let listed = admin.pending(&ListFilter::default()).await.expect("list");
    assert_eq!(listed[0].content_type, "application/protobuf");
    assert_eq!(
        listed[0].payload,
        Value::String("CAcSDWN1c3RvbWVyIMOpIDcaBAD/Bwo=".to_owned()),
        "a listing shows bytes that are not JSON in base64"
    );

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    wait_until("both published", WAIT, || async {
        publisher.published_count() >= 2
    })
    .await;
    relay.shutdown().await;
    let published = publisher.published();
    assert_eq!(published[0].content_type, "application/protobuf");
    assert_eq!(published[0].payload, order(7).encode_to_vec());
    assert_eq!(published[0].partition_key.as_deref(), Some("7"));
    assert_eq!(published[0].event_type, "OrderPlaced");
    assert_eq!(
        OrderPlaced::decode(published[0].payload.as_bytes()).expect("prost decodes it"),
        order(7)
    );
    assert_eq!(published[1].content_type, "image/png");
    assert_eq!(published[1].payload, thumbnail.0);
    let catalog = outbox_core::catalog::entries();
    let info = catalog
        .iter()
        .find(|e| e.event_type == "OrderPlaced")
        .expect("in the catalog");
    assert_eq!(info.content_type, "application/protobuf");
    db.cleanup().await;
}

/// What Python's `protobuf` decoded, one JSON object per message.
async fn python_decode(mode: &str, address: &str, name: &str, count: usize) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("interop/protobuf_decode.py");
    let python = std::env::var_os("OUTBOX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/outbox-tools/py/bin/python")
        });
    let args = [
        script.display().to_string(),
        mode.to_owned(),
        address.to_owned(),
        name.to_owned(),
        count.to_string(),
        ORDER_PLACED_SCHEMA.to_owned(),
    ];
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python).args(args).output()
    })
    .await
    .expect("the decoder task")
    .expect("run the Python decoder (scripts/services.sh installs it)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the Python decoder failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), count, "{stdout}");
    lines
}

/// Each broker's messages, decoded by Python's Protobuf runtime, are the events sent, and
/// re-encode to the same bytes.
async fn python_decodes_what_the_broker_received<B: Broker>(mode: &str, address: String) {
    let place = B::place().await;
    let records: Vec<OutboxRecord> = (1..=3).map(|n| record(&place.destination, n)).collect();
    B::publish(&place, &records).await;
    let decoded = python_decode(mode, &address, &place.source, records.len()).await;
    for (record, line) in records.iter().zip(&decoded) {
        assert!(line.get("error").is_none(), "Python refused it: {line:#}");
        let n = record.seq as u64;
        let expected = order(n);
        assert_eq!(
            line["headers"]["content-type"], "application/protobuf",
            "{line:#}"
        );
        assert_eq!(
            line["headers"]["message-id"],
            record.id.to_string(),
            "{line:#}"
        );
        assert_eq!(
            line["message"]["order_id"],
            n.to_string(),
            "uint64 as JSON: {line:#}"
        );
        assert_eq!(line["message"]["customer"], expected.customer, "{line:#}");
        assert_eq!(line["reencoded_equal"], true, "{line:#}");
        if mode == "rabbitmq" {
            assert_eq!(
                line["headers"]["content_type (property)"], "application/protobuf",
                "{line:#}"
            );
        }
    }
    B::remove(place).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decodes_protobuf_from_kafka() {
    python_decodes_what_the_broker_received::<Kafka>("kafka", kafka::brokers()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decodes_protobuf_from_nats() {
    python_decodes_what_the_broker_received::<Nats>("nats", nats::nats_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decodes_protobuf_from_rabbitmq() {
    python_decodes_what_the_broker_received::<Rabbit>("rabbitmq", rabbitmq::rabbitmq_url()).await;
}

/// A handler of the Protobuf type gets the event, and one of the bytes type its bytes; a
/// JSON message of the Protobuf event type is undecodable for its handler (its content
/// type), and goes to the dead letters by that policy.
async fn a_protobuf_handler_decodes_by_content_type<B: Broker>() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("CREATE TABLE got (order_id bigint PRIMARY KEY, customer text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create got");
    let place = B::place().await;
    let proto = record(&place.destination, 1);
    let json = OutboxRecord::from(
        OutboxMessage::new(
            "OrderPlaced",
            place.destination.as_str(),
            r#"{"order_id":2}"#,
        )
        .with_key("2"),
    )
    .with_seq(2);
    let mut thumbnail = OutboxMessage::from_event(&Thumbnail(vec![0x89, 0, 0xff])).expect("encode");
    thumbnail.destination = place.destination.clone();
    let thumbnail = OutboxRecord::from(thumbnail).with_seq(3);
    B::publish(&place, &[proto.clone(), json.clone(), thumbnail]).await;
    let group = outbox_tests::kafka::unique("codec-group").replace('.', "-");
    let consumer = Consumer::builder(B::transport(&place, &group).await, Inbox::new(&outbox, "p"))
        .on::<OrderPlaced, _>(|tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO got (order_id, customer) VALUES ($1, $2)")
                    .bind(msg.event.order_id as i64)
                    .bind(&msg.event.customer)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .on::<Thumbnail, _>(|tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO got (order_id, customer) VALUES ($1, $2)")
                    .bind(-(msg.event.0.len() as i64))
                    .bind(format!("{:?}", msg.event.0))
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .on_undecodable(Policy::DeadLetter)
        .build()
        .expect("consumer")
        .spawn();
    wait_until("all three consumed", WAIT, || async {
        let s = consumer.stats();
        s.handled + s.dead_lettered >= 3
    })
    .await;
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!((stats.handled, stats.dead_lettered), (2, 1), "{stats:?}");
    let got: Vec<(i64, String)> =
        sqlx::query_as("SELECT order_id, customer FROM got ORDER BY order_id")
            .fetch_all(&db.pool)
            .await
            .expect("got");
    assert_eq!(
        got,
        [(-3, "[137, 0, 255]".to_owned()), (1, order(1).customer)]
    );
    let dead = B::dead_letters(&place, 1, WAIT).await;
    assert_eq!(
        dead[0].get("message-id"),
        Some(&json.id.to_string()),
        "{dead:?}"
    );
    let reason = &dead[0]["dlq-reason"];
    assert!(
        reason.contains("application/json") && reason.contains("reads Protobuf"),
        "{reason}"
    );
    B::remove(place).await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protobuf_handler_decodes_by_content_type_on_kafka() {
    a_protobuf_handler_decodes_by_content_type::<Kafka>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protobuf_handler_decodes_by_content_type_on_nats() {
    a_protobuf_handler_decodes_by_content_type::<Nats>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protobuf_handler_decodes_by_content_type_on_rabbitmq() {
    a_protobuf_handler_decodes_by_content_type::<Rabbit>().await;
}
