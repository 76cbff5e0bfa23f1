//! CloudEvents that consumers in other languages can read (#33 part 3): messages our
//! publishers sent to the real brokers, read back by the broker's own Python client
//! and decoded by the official CloudEvents SDK for Python (PyPI `cloudevents` 2.2.0),
//! an implementation of the bindings that shares no code with ours.
//! `tests/interop/cloudevents_decode.py` does the reading; `scripts/services.sh`
//! installs its pinned packages in a venv and exports `OUTBOX_PYTHON`.
//!
//! Every attribute is asserted as the SDK decoded it, so a binding that regresses (a
//! prefix the SDKs do not read, a value not percent-encoded where the binding wants it)
//! fails here. And our consumer still reads what outbox 0.1 wrote (`cloudEvents_`).

use std::time::Duration;

use chrono::TimeZone;
use outbox_core::publisher::Publisher;
use outbox_core::publisher::cloudevents::CloudEvents;
use outbox_core::{OutboxMessage, OutboxRecord};
use outbox_rabbitmq::CloudEventsHeaders;
use serde_json::{Value, json};

/// A URI-reference with a query and percent-encoded octets (`dépôt`): the NATS
/// binding's draft encodes its `%` again, and the SDK must read it back unchanged.
const SOURCE: &str = "/outbox-tests/d%C3%A9p%C3%B4t?region=eu";
const TYPE_PREFIX: &str = "com.example.orders";
const COUNT: usize = 5;

fn ce() -> CloudEvents {
    CloudEvents::new(SOURCE)
        .expect("a source")
        .type_prefix(TYPE_PREFIX)
        .expect("a type prefix")
}

/// Five orders for `destination`: versions 1 to 4 and one without, each its own key,
/// with a row header that would forge the type under every prefix a decoder may read.
fn records(destination: &str) -> Vec<OutboxRecord> {
    (0..COUNT)
        .map(|n| {
            let mut message =
                OutboxMessage::new("OrderPlaced", destination, format!(r#"{{"order":{n}}}"#))
                    .with_key(format!("order-{n}"))
                    .with_header("traceparent", "00-abc-def-01")
                    .with_header("cloudEvents_type", "forged")
                    .with_header("ce-type", "forged")
                    .with_header("ce_type", "forged");
            message.event_version = (n > 0).then_some(n as i32);
            let mut record = OutboxRecord::from(message).with_seq(n as i64 + 1);
            record.created_at = chrono::Utc
                .with_ymd_and_hms(2026, 12, 1, 10, 30, n as u32)
                .single()
                .expect("a time");
            record
        })
        .collect()
}

/// What the Python decoder printed for `count` messages: one JSON object each.
async fn python_decode(mode: &str, address: &str, name: &str, count: usize) -> Vec<Value> {
    outbox_tests::python::run_interop(
        "cloudevents_decode.py",
        &[mode, address, name, &count.to_string()],
        count,
    )
    .await
}

/// Each decoded event is the record it was sent as, attribute by attribute.
fn check_decoded(sent: &[OutboxRecord], decoded: &[Value]) {
    for (record, line) in sent.iter().zip(decoded) {
        assert!(
            line.get("error").is_none(),
            "the SDK refused our message: {line:#}"
        );
        let a = &line["attributes"];
        let kind = match record.event_version {
            Some(v) => format!("{TYPE_PREFIX}.OrderPlaced.v{v}"),
            None => format!("{TYPE_PREFIX}.OrderPlaced"),
        };
        assert_eq!(a["specversion"], "1.0", "{line:#}");
        assert_eq!(a["id"], record.id.to_string(), "{line:#}");
        assert_eq!(a["source"], SOURCE, "{line:#}");
        assert_eq!(a["type"], kind, "a row header must not forge it: {line:#}");
        let time = chrono::DateTime::parse_from_rfc3339(a["time"].as_str().expect("a time"))
            .expect("RFC 3339");
        assert_eq!(time, record.created_at, "{line:#}");
        assert_eq!(a["datacontenttype"], "application/json", "{line:#}");
        let payload: Value = serde_json::from_slice(&record.payload).expect("JSON");
        assert_eq!(line["data"], payload, "the payload is the data: {line:#}");
    }
}

fn sorted_by_id(mut lines: Vec<Value>) -> Vec<Value> {
    lines.sort_by(|a, b| {
        a["headers"]["message-id"]
            .as_str()
            .cmp(&b["headers"]["message-id"].as_str())
    });
    lines
}

#[tokio::test]
async fn the_python_sdk_decodes_kafka_messages() {
    use outbox_tests::kafka::{brokers, create_topic, delete_topic, unique};
    let brokers = brokers();
    let topic = unique("ce-interop");
    create_topic(&brokers, &topic, 1).await;
    let publisher = outbox_kafka::KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .cloudevents(ce())
        .build()
        .await
        .expect("publisher");
    let sent = records(&topic);
    for result in publisher.publish(&sent).await {
        assert!(result.is_ok(), "{result:?}");
    }
    let decoded = python_decode("kafka", &brokers, &topic, COUNT).await;
    check_decoded(&sent, &sorted_by_id(decoded));
    delete_topic(&brokers, &topic).await;
}

#[tokio::test]
async fn the_python_sdk_decodes_nats_messages_in_the_drafts_binary_mode() {
    use outbox_tests::nats::{fresh_stream, nats_url};
    let (js, stream, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.orders");
    let publisher = outbox_nats::NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .cloudevents(ce())
        .build()
        .await
        .expect("publisher");
    let sent = records(&subject);
    for result in publisher.publish(&sent).await {
        assert!(result.is_ok(), "{result:?}");
    }
    let decoded = sorted_by_id(python_decode("nats", &nats_url(), &stream, COUNT).await);
    check_decoded(&sent, &decoded);
    for line in &decoded {
        let headers = &line["headers"];
        // Sent percent-encoded (draft 3.1.3.2), the `%` of the octets included.
        assert_eq!(
            headers["ce-source"], "/outbox-tests/d%25C3%25A9p%25C3%25B4t?region=eu",
            "{line:#}"
        );
        assert_eq!(
            headers["ce-datacontenttype"], "application/json",
            "{line:#}"
        );
    }
    js.delete_stream(&stream).await.expect("delete stream");
}

/// `CloudEventsMode::Structured`, the released NATS binding (1.0.2): the payload is a
/// JSON event, which the SDK's JSON format decodes.
#[tokio::test]
async fn the_python_sdk_decodes_nats_messages_in_structured_mode() {
    use outbox_tests::nats::{fresh_stream, nats_url};
    let (js, stream, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.orders");
    let publisher = outbox_nats::NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .cloudevents(ce())
        .cloudevents_mode(outbox_nats::CloudEventsMode::Structured)
        .build()
        .await
        .expect("publisher");
    let sent = records(&subject);
    for result in publisher.publish(&sent).await {
        assert!(result.is_ok(), "{result:?}");
    }
    let decoded = sorted_by_id(python_decode("nats-structured", &nats_url(), &stream, COUNT).await);
    check_decoded(&sent, &decoded);
    js.delete_stream(&stream).await.expect("delete stream");
}

/// Publishes the records to a fresh queue with `layout` and has Python read them with
/// `mode`.
async fn rabbitmq_round_trip(
    layout: Option<CloudEventsHeaders>,
    mode: &str,
) -> (Vec<OutboxRecord>, Vec<Value>) {
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
    let sent = records(&destination);
    for result in publisher.publish(&sent).await {
        assert!(result.is_ok(), "{result:?}");
    }
    let decoded = python_decode(mode, &rabbitmq_url(), &topology.queue, COUNT).await;
    topology.delete().await;
    (sent, sorted_by_id(decoded))
}

/// The default names are the AMQP binding's `cloudEvents:`: Python's AMQP binding
/// decodes them, and they are the names Go's sdk-go and Java's proton binding read
/// (those read no other prefix, so the names are asserted too). Knative's RabbitMQ
/// binding (Python's `rabbitmq` module, `ce-` only) refuses them, as it refused
/// `cloudEvents_` in #33.
#[tokio::test]
async fn the_python_sdk_decodes_rabbitmq_messages_with_the_amqp_bindings_names() {
    let (sent, decoded) = rabbitmq_round_trip(None, "rabbitmq-amqp").await;
    check_decoded(&sent, &decoded);
    for line in &decoded {
        for attribute in ["specversion", "id", "source", "type", "time"] {
            let name = format!("cloudEvents:{attribute}");
            assert!(
                line["headers"].get(&name).is_some(),
                "no {name} (what Go and Java read): {line:#}"
            );
        }
    }
    let (_, refused) = rabbitmq_round_trip(None, "rabbitmq-knative").await;
    for line in &refused {
        let error = line["error"].as_str().unwrap_or_default();
        assert!(error.contains("source"), "{line:#}");
    }
}

/// `CloudEventsHeaders::Knative`: `ce-*`, what Python's `rabbitmq` binding reads.
#[tokio::test]
async fn the_python_sdk_decodes_rabbitmq_messages_with_knatives_names() {
    let (sent, decoded) =
        rabbitmq_round_trip(Some(CloudEventsHeaders::Knative), "rabbitmq-knative").await;
    check_decoded(&sent, &decoded);
}

/// Our consumer reads what outbox 0.1 wrote, `cloudEvents_*` headers, from a producer
/// that sends only those (no outbox headers, no `message_id` or `type` property), and
/// the other two layouts as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rabbitmq_consumer_reads_every_prefix() {
    use lapin::BasicProperties;
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
    use outbox_core::consumer::Consumer;
    use outbox_core::inbox::Inbox;
    use outbox_tests::rabbitmq::{Topology, rabbitmq_url};
    use std::sync::{Arc, Mutex};

    let topology = Topology::declare("orders").await;
    let channel = topology.connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let mut sent = Vec::new();
    for (n, layout) in CloudEventsHeaders::ALL.into_iter().enumerate() {
        let id = uuid::Uuid::now_v7();
        let prefix = layout.prefix();
        let mut table = FieldTable::default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        for (name, value) in [
            ("specversion", "1.0".to_owned()),
            ("id", id.to_string()),
            ("source", "/elsewhere".to_owned()),
            ("type", format!("OrderPlaced.v{}", n + 1)),
        ] {
            table.insert(ShortString::from(format!("{prefix}{name}")), text(&value));
        }
        channel
            .basic_publish(
                topology.exchange.as_str().into(),
                "orders".into(),
                BasicPublishOptions::default(),
                format!(r#"{{"order":{n}}}"#).as_bytes(),
                BasicProperties::default()
                    .with_content_type("application/json".into())
                    .with_headers(table),
            )
            .await
            .expect("publish")
            .await
            .expect("confirmed");
        sent.push((id, Some(n as i32 + 1), n as i64));
    }

    #[derive(Debug, serde::Deserialize)]
    struct Order {
        order: i64,
    }
    let db = outbox_tests::TestDb::new().await;
    let outbox = db.outbox().await;
    type Seen = Vec<(uuid::Uuid, Option<i32>, i64)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let sink = Arc::clone(&seen);
    let transport = outbox_rabbitmq::RabbitTransport::builder(rabbitmq_url(), &topology.queue)
        .build()
        .await
        .expect("transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "ce-prefixes"))
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
    outbox_tests::wait_until("three events handled", Duration::from_secs(60), || async {
        consumer.stats().handled >= 3
    })
    .await;
    consumer.shutdown().await.expect("consumer");
    let mut seen = seen.lock().expect("lock").clone();
    seen.sort_by_key(|(.., order)| *order);
    assert_eq!(
        seen, sent,
        "ids and versions from each prefix's id and type"
    );
    topology.delete().await;
    db.cleanup().await;
}

/// Not a rubber stamp: the SDK's AMQP binding refuses a message without the
/// attributes, which the checks above would report.
#[test]
fn check_decoded_refuses_an_error_line() {
    let sent = records("x");
    let line = json!({ "headers": {}, "error": "MissingRequiredAttributeError: source" });
    let refused = std::panic::catch_unwind(|| check_decoded(&sent[..1], &[line]));
    assert!(refused.is_err());
}
