//! Codecs chosen by the event type (#38 §2): a Protobuf event (`codec = protobuf` on a
//! `prost::Message`) is written as prost encodes it, with `content-type:
//! application/protobuf`, on every broker; Google's Protobuf runtime for Python decodes
//! what each broker received; a consumer's handler decodes it by its type, and a handler
//! of JSON refuses it by its content type. A raw-bytes event carries the type's bytes
//! and the content type it names. An Avro event (`codec = avro`) is written in Avro's
//! single-object encoding and documented with its schema; fastavro decodes what each
//! broker received with the schema from the AsyncAPI document.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::admin::{Admin, ListFilter};
use outbox_core::consumer::{BoxError, Consumer, ConsumerBuilder, Policy};
use outbox_core::inbox::Inbox;
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::{OutboxEvent, OutboxMessage, OutboxRecord, sqlx};
use outbox_tests::consumers::Broker;
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

/// The first `n` messages a relay of `outbox` publishes, in order.
async fn relayed(outbox: &outbox_core::Outbox, n: usize) -> Vec<OutboxRecord> {
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    wait_until("published", WAIT, || async {
        publisher.published_count() >= n
    })
    .await;
    relay.shutdown().await;
    publisher.published()
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

    let published = relayed(&outbox, 2).await;
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
    // Its `.proto`, read off the prost attributes: what the contract document gives.
    assert_eq!(
        info.schema(),
        Some(Value::String(
            "syntax = \"proto3\";\n\nmessage OrderPlaced {\n  uint64 order_id = 1;\n  string customer = 2;\n  bytes signature = 3;\n}\n"
                .into()
        ))
    );
    db.cleanup().await;
}

/// Events 1 to 3 made by `record`, published to a fresh place of `B` and read back from
/// the broker by `tests/interop/<script>` (arguments: the broker's name and address, the
/// place, the count, then `extra`): each record with what the decoder printed for it, checked for
/// what every codec shares (decoded without error, the message id, the content type,
/// RabbitMQ's property too).
async fn decoded_by_python<B: Broker>(
    record: fn(&str, u64) -> OutboxRecord,
    script: &str,
    extra: &[&str],
) -> Vec<(OutboxRecord, Value)> {
    let place = B::place().await;
    let records: Vec<OutboxRecord> = (1..=3).map(|n| record(&place.destination, n)).collect();
    B::publish(&place, &records).await;
    let (mode, count) = (B::NAME, records.len().to_string());
    let address = match mode {
        "kafka" => kafka::brokers(),
        "nats" => nats::nats_url(),
        _ => rabbitmq::rabbitmq_url(),
    };
    let args: Vec<&str> = [
        mode,
        address.as_str(),
        place.source.as_str(),
        count.as_str(),
    ]
    .into_iter()
    .chain(extra.iter().copied())
    .collect();
    let decoded = outbox_tests::python::run_interop(script, &args, records.len()).await;
    B::remove(place).await;
    for (record, line) in records.iter().zip(&decoded) {
        assert!(line.get("error").is_none(), "{script} refused it: {line:#}");
        let content_type = record.content_type.as_ref();
        assert_eq!(line["headers"]["content-type"], content_type, "{line:#}");
        assert_eq!(
            line["headers"]["message-id"],
            record.id.to_string(),
            "{line:#}"
        );
        if mode == "rabbitmq" {
            assert_eq!(
                line["headers"]["content_type (property)"], content_type,
                "{line:#}"
            );
        }
    }
    records.into_iter().zip(decoded).collect()
}

/// The contract document of this binary's catalog, written to a file of its own for a
/// Python decoder; removed when dropped.
struct DocumentFile(std::path::PathBuf);

impl DocumentFile {
    fn new() -> Self {
        let document =
            outbox_core::contract::asyncapi(&outbox_core::contract::Info::new("codecs", "1"))
                .expect("a document");
        let path =
            std::env::temp_dir().join(format!("outbox-codecs-{}.json", uuid::Uuid::now_v7()));
        std::fs::write(&path, document.to_json()).expect("write the document");
        DocumentFile(path)
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for DocumentFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Each broker's messages, decoded by Python's Protobuf runtime with the `.proto` the
/// AsyncAPI document gives `OrderPlaced` (compiled by protoc), are the events sent, and
/// re-encode to the same bytes.
async fn python_decodes_protobuf<B: Broker>() {
    let document = DocumentFile::new();
    let decoded = decoded_by_python::<B>(
        record,
        "protobuf_decode.py",
        &[&document.path(), "OrderPlaced"],
    )
    .await;
    for (record, line) in decoded {
        assert_eq!(
            line["headers"]["content-type"], "application/protobuf",
            "{line:#}"
        );
        let n = record.seq as u64;
        assert_eq!(
            line["message"]["order_id"],
            n.to_string(),
            "uint64 as JSON: {line:#}"
        );
        assert_eq!(line["message"]["customer"], order(n).customer, "{line:#}");
        assert_eq!(line["reencoded_equal"], true, "{line:#}");
    }
}

/// Records (made by `records` for the place's destination) published to a fresh place
/// of `B` and consumed by the handlers `on` adds, each writing `(id, what)` into the table
/// `got`, undecodable messages dead-lettered; once every record is handled or
/// dead-lettered, what the handlers wrote (by id) and the dead letters' headers.
async fn consumed<B: Broker>(
    records: impl FnOnce(&str) -> Vec<OutboxRecord>,
    dead_letters: usize,
    on: impl FnOnce(ConsumerBuilder<B::T>) -> ConsumerBuilder<B::T>,
) -> (Vec<(i64, String)>, Vec<BTreeMap<String, String>>) {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("CREATE TABLE got (id bigint PRIMARY KEY, what text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create got");
    let place = B::place().await;
    let records = records(&place.destination);
    B::publish(&place, &records).await;
    let group = outbox_tests::kafka::unique("codec-group").replace('.', "-");
    let builder = Consumer::builder(B::transport(&place, &group).await, Inbox::new(&outbox, "c"));
    let consumer = on(builder)
        .on_undecodable(Policy::DeadLetter)
        .build()
        .expect("consumer")
        .spawn();
    let stats = outbox_tests::consumers::settle(consumer, records.len() as u64, WAIT).await;
    let handled = (records.len() - dead_letters) as u64;
    assert_eq!(
        (stats.handled, stats.dead_lettered),
        (handled, dead_letters as u64),
        "{stats:?}"
    );
    let got: Vec<(i64, String)> = sqlx::query_as("SELECT id, what FROM got ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .expect("got");
    let dead = B::dead_letters(&place, dead_letters, WAIT).await;
    B::remove(place).await;
    db.cleanup().await;
    (got, dead)
}

/// What a handler writes into `got`.
async fn got(
    tx: &mut outbox_core::OutboxTx<'static>,
    id: i64,
    what: String,
) -> Result<(), BoxError> {
    sqlx::query("INSERT INTO got (id, what) VALUES ($1, $2)")
        .bind(id)
        .bind(what)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A message of `event_type` whose payload is JSON, for handlers of another codec.
fn json_record(destination: &str, event_type: &str, n: i64) -> OutboxRecord {
    let json = format!(r#"{{"order_id":{n}}}"#);
    OutboxRecord::from(OutboxMessage::new(event_type, destination, json).with_key(n.to_string()))
        .with_seq(n)
}

/// The one dead letter is `json`'s, and its reason names its content type and what the
/// handler reads.
fn dead_for_content_type(dead: &[BTreeMap<String, String>], json: &str, reads: &str) {
    assert_eq!(
        dead[0].get("message-id").map(String::as_str),
        Some(json),
        "{dead:?}"
    );
    let reason = &dead[0]["dlq-reason"];
    assert!(
        reason.contains("application/json") && reason.contains(&format!("reads {reads}")),
        "{reason}"
    );
}

/// A handler of the Protobuf type gets the event, and one of the bytes type its bytes; a
/// JSON message of the Protobuf event type is undecodable for its handler (its content
/// type), and goes to the dead letters by that policy.
async fn a_protobuf_handler_decodes_by_content_type<B: Broker>() {
    let mut json = String::new();
    let (got_, dead) = consumed::<B>(
        |destination| {
            let mut thumbnail =
                OutboxMessage::from_event(&Thumbnail(vec![0x89, 0, 0xff])).expect("encode");
            thumbnail.destination = destination.to_owned();
            let records = vec![
                record(destination, 1),
                json_record(destination, "OrderPlaced", 2),
                OutboxRecord::from(thumbnail).with_seq(3),
            ];
            json = records[1].id.to_string();
            records
        },
        1,
        |builder| {
            builder
                .on::<OrderPlaced, _>(|tx, msg| {
                    Box::pin(got(tx, msg.event.order_id as i64, msg.event.customer))
                })
                .on::<Thumbnail, _>(|tx, msg| {
                    let len = msg.event.0.len() as i64;
                    Box::pin(got(tx, -len, format!("{:?}", msg.event.0)))
                })
        },
    )
    .await;
    assert_eq!(
        got_,
        [(-3, "[137, 0, 255]".to_owned()), (1, order(1).customer)]
    );
    dead_for_content_type(&dead, &json, "Protobuf");
}

/// An Avro event: apache-avro's schema and serde, the outbox's routing.
#[derive(
    Debug,
    Clone,
    PartialEq,
    serde::Serialize,
    serde::Deserialize,
    apache_avro::AvroSchema,
    OutboxEvent,
)]
#[avro(namespace = "acme")]
#[outbox(destination = "orders.avro", key = order_id, codec = avro)]
struct OrderShipped {
    order_id: i64,
    carrier: String,
    weight_kg: f64,
    note: Option<String>,
}

fn shipped(n: i64) -> OrderShipped {
    OrderShipped {
        order_id: n,
        carrier: format!("carrier é {n}"),
        weight_kg: n as f64 + 0.25,
        note: (n % 2 == 0).then(|| format!("fragile {n}")),
    }
}

/// `shipped(n)` as a record for `destination`.
fn avro_record(destination: &str, n: i64) -> OutboxRecord {
    let mut message = OutboxMessage::from_event(&shipped(n)).expect("encode");
    message.destination = destination.to_owned();
    OutboxRecord::from(message).with_seq(n)
}

/// The single-object header of `OrderShipped`'s schema: the marker and the CRC-64-AVRO
/// fingerprint of its Parsing Canonical Form as fastavro 1.13.1 computes it
/// (`{"name":"acme.OrderShipped","type":"record","fields":[{"name":"order_id","type":"long"},
/// {"name":"carrier","type":"string"},{"name":"weight_kg","type":"double"},
/// {"name":"note","type":["null","string"]}]}`), not by our code.
const SHIPPED_HEADER: [u8; 10] = [0xC3, 0x01, 0x01, 0x38, 0x0f, 0x7d, 0xb3, 0x41, 0x4b, 0x52];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_events_are_written_in_single_object_encoding_and_documented_with_their_schema() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    let sent = [shipped(4), shipped(5)];
    tx.emit(sent[0].clone()).expect("emit an Avro event");
    tx.emit(&sent[1]).expect("and one by reference");
    tx.commit().await.expect("commit");
    for (published, event) in relayed(&outbox, 2).await.iter().zip(&sent) {
        let n = event.order_id;
        assert_eq!(published.content_type, "application/avro");
        assert_eq!(
            published.partition_key.as_deref(),
            Some(n.to_string().as_str())
        );
        let bytes = published.payload.as_bytes();
        assert_eq!(bytes[..10], SHIPPED_HEADER, "{bytes:02x?}");
        let decoded: OrderShipped =
            outbox_core::codec::avro::decode(bytes).expect("the codec reads it back");
        assert_eq!(decoded, *event);
    }
    let catalog = outbox_core::catalog::entries();
    let info = catalog
        .iter()
        .find(|e| e.event_type == "OrderShipped")
        .expect("in the catalog");
    assert_eq!(info.content_type, "application/avro");
    let document =
        outbox_core::contract::asyncapi(&outbox_core::contract::Info::new("codecs", "1"))
            .expect("a document");
    let message = document.as_value()["components"]["messages"]
        .as_object()
        .expect("messages")
        .values()
        .find(|m| m["x-outbox-event-type"] == "OrderShipped")
        .expect("OrderShipped's message")
        .clone();
    assert_eq!(message["contentType"], "application/avro", "{message:#}");
    assert_eq!(
        message["payload"]["schemaFormat"], "application/vnd.apache.avro+json;version=1.9.0",
        "{message:#}"
    );
    let schema = &message["payload"]["schema"];
    assert_eq!(schema["name"], "OrderShipped", "{schema:#}");
    assert_eq!(schema["namespace"], "acme", "{schema:#}");
    assert_eq!(
        schema["fields"]
            .as_array()
            .expect("fields")
            .iter()
            .map(|f| f["name"].as_str().expect("a name"))
            .collect::<Vec<_>>(),
        ["order_id", "carrier", "weight_kg", "note"],
        "{schema:#}"
    );
    db.cleanup().await;
}

/// Each broker's messages, decoded by fastavro with the schema the AsyncAPI document
/// gives `OrderShipped`, are the events sent; the fingerprint is the one fastavro
/// computes for that schema, and fastavro re-encodes the same datum.
async fn fastavro_decodes_avro<B: Broker>() {
    let document = DocumentFile::new();
    let decoded = decoded_by_python::<B>(
        |destination, n| avro_record(destination, n as i64),
        "avro_decode.py",
        &[&document.path(), "OrderShipped"],
    )
    .await;
    for (record, line) in decoded {
        assert_eq!(
            line["headers"]["content-type"], "application/avro",
            "{line:#}"
        );
        let expected = shipped(record.seq);
        assert_eq!(line["fingerprint_matches"], true, "{line:#}");
        assert_eq!(line["reencoded_equal"], true, "{line:#}");
        assert_eq!(line["record"]["order_id"], expected.order_id, "{line:#}");
        assert_eq!(line["record"]["carrier"], expected.carrier, "{line:#}");
        assert_eq!(line["record"]["weight_kg"], expected.weight_kg, "{line:#}");
        let note = serde_json::to_value(&expected.note).expect("json");
        assert_eq!(line["record"]["note"], note, "{line:#}");
    }
}

/// A handler of the Avro type gets the events; a JSON message of the same event type is
/// undecodable for it (its content type) and goes to the dead letters.
async fn an_avro_handler_decodes_by_content_type<B: Broker>() {
    let mut json = String::new();
    let (got_, dead) = consumed::<B>(
        |destination| {
            let records = vec![
                avro_record(destination, 1),
                avro_record(destination, 2),
                json_record(destination, "OrderShipped", 3),
            ];
            json = records[2].id.to_string();
            records
        },
        1,
        |builder| {
            builder.on::<OrderShipped, _>(|tx, msg| {
                let e = msg.event;
                Box::pin(got(
                    tx,
                    e.order_id,
                    format!("{} {:?} {}", e.carrier, e.note, e.weight_kg),
                ))
            })
        },
    )
    .await;
    let expected = |n: i64| {
        let e = shipped(n);
        (n, format!("{} {:?} {}", e.carrier, e.note, e.weight_kg))
    };
    assert_eq!(got_, [expected(1), expected(2)]);
    dead_for_content_type(&dead, &json, "Avro");
}

/// `on_event_type` would read an Avro type as JSON (its serde derives): `build` refuses
/// it, naming `on`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_avro_type_is_handled_with_on_not_on_event_type() {
    use outbox_tests::consumers::Kafka;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let place = Kafka::place().await;
    let built = Consumer::builder(
        Kafka::transport(&place, "g").await,
        Inbox::new(&outbox, "c"),
    )
    .on_event_type::<OrderShipped, _>("OrderShipped", |_, _| Box::pin(async { Ok(()) }))
    .build();
    let Err(err) = built else {
        panic!("an Avro type registered with on_event_type was accepted")
    };
    let text = err.to_string();
    assert!(
        text.contains("OrderShipped")
            && text.contains("application/avro")
            && text.contains(".on::<T, _>"),
        "{text}"
    );
    Kafka::remove(place).await;
    db.cleanup().await;
}

/// Each generic test above, once per broker.
macro_rules! suite {
    ($broker:ident, $ty:ty) => {
        mod $broker {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn python_decodes_protobuf() {
                super::python_decodes_protobuf::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_protobuf_handler_decodes_by_content_type() {
                super::a_protobuf_handler_decodes_by_content_type::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fastavro_decodes_avro() {
                super::fastavro_decodes_avro::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_avro_handler_decodes_by_content_type() {
                super::an_avro_handler_decodes_by_content_type::<$ty>().await;
            }
        }
    };
}

suite!(on_kafka, outbox_tests::consumers::Kafka);
suite!(on_nats, outbox_tests::consumers::Nats);
suite!(on_rabbitmq, outbox_tests::consumers::Rabbit);

mod evolution {
    //! A consumer whose type's schema gained a field (with a default) reads payloads of
    //! the earlier schema once that schema is registered, and says what is missing until
    //! then.

    /// The first schema of `Shipment`.
    #[derive(serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
    #[serde(rename = "Shipment")]
    pub struct V1 {
        pub order_id: i64,
    }

    /// The next one: `service` added, with a default.
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
    #[serde(rename = "Shipment")]
    pub struct V2 {
        pub order_id: i64,
        #[avro(default = r#""standard""#)]
        pub service: String,
    }

    #[test]
    fn an_earlier_schema_is_read_once_registered() {
        use apache_avro::AvroSchema as _;
        use outbox_core::codec::avro;
        let payload = avro::encode(&V1 { order_id: 9 }).expect("encode");
        let err = avro::decode::<V2>(&payload).expect_err("an unknown writer schema");
        let text = err.to_string();
        let hex = |f: [u8; 8]| f.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert!(
            text.contains(&hex(avro::fingerprint(&V1::get_schema())))
                && text.contains(&hex(avro::fingerprint(&V2::get_schema())))
                && text.contains("register_writer_schema"),
            "{text}"
        );
        avro::register_writer_schema(V1::get_schema()).expect("register");
        assert_eq!(
            avro::decode::<V2>(&payload).expect("resolved"),
            V2 {
                order_id: 9,
                service: "standard".to_owned()
            }
        );
        let garbage = avro::decode::<V2>(b"{\"order_id\":9}").expect_err("not Avro");
        assert!(
            garbage
                .to_string()
                .contains("not an Avro single-object payload"),
            "{garbage}"
        );
    }
}
