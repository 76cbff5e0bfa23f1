//! The AsyncAPI document stays valid AsyncAPI 3.0 whatever the event types look like:
//! versioned, enums (externally and internally tagged, unit variants), nested and
//! shared types, maps, tuples, optional fields, several destinations, a destination
//! that is not a valid component id, CloudEvents headers. (A test binary of its own: its
//! event types are not the order service's.)
#![allow(dead_code)]

mod asyncapi;

use std::collections::HashMap;

use outbox::OutboxEvent;
use outbox::contract::{Info, asyncapi};

#[derive(serde::Serialize, schemars::JsonSchema)]
struct Address {
    city: String,
    zip: Option<String>,
}

/// A parcel left the warehouse.
#[derive(serde::Serialize, schemars::JsonSchema, OutboxEvent)]
#[outbox(destination = "parcels", key = parcel_id, version = 3)]
struct ParcelShipped {
    parcel_id: uuid::Uuid,
    /// Where to.
    to: Address,
    from: Option<Address>,
    weights: HashMap<String, f64>,
    dimensions: (u32, u32, u32),
    at: String,
}

#[derive(serde::Serialize, schemars::JsonSchema, OutboxEvent)]
#[outbox(destination = "billing/invoices.created", key = account)]
enum Billing {
    InvoiceIssued { account: u64, lines: Vec<Address> },
    InvoicePaid { account: u64, amount_cents: i64 },
}

#[derive(serde::Serialize, schemars::JsonSchema, OutboxEvent)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[outbox(destination = "doors")]
enum Door {
    Opened { door: u32 },
    Closed,
}

#[test]
fn documents_of_every_shape_are_valid_asyncapi_3() {
    let validator = asyncapi::validator();
    let info = Info::new("shapes", "0.1.0")
        .description("Every shape of event.")
        .server("kafka", "kafka.internal:9092", "kafka")
        .server("nats", "nats://nats.internal:4222", "nats")
        .cloudevents("ce-", "urn:example:shapes");
    let document = asyncapi(&info).expect("a consistent catalog");
    let doc = document.as_value();
    let found = asyncapi::errors(&validator, doc);
    assert!(
        found.is_empty(),
        "not valid AsyncAPI 3.0: {found:#?}\n{}",
        document.to_json()
    );
    // The YAML form reads back as the same document.
    let yaml: serde_json::Value =
        serde_yaml_ng::from_str(&document.to_yaml()).expect("the YAML form parses");
    assert_eq!(&yaml, doc);
    // What was asked for is there.
    let channels = doc["channels"].as_object().expect("channels");
    let ids: Vec<&String> = channels.keys().collect();
    assert_eq!(ids, ["billing_invoices.created", "doors", "parcels"]);
    assert_eq!(
        doc["channels"]["billing_invoices.created"]["address"],
        "billing/invoices.created"
    );
    for message in [
        "ParcelShipped.v3",
        "InvoiceIssued",
        "InvoicePaid",
        "Opened",
        "Closed",
    ] {
        assert!(
            doc["components"]["messages"][message]["payload"].is_object(),
            "{message}"
        );
    }
    assert_eq!(
        doc["components"]["messages"]["Closed"]["payload"]["properties"]["kind"]["const"],
        "closed"
    );
}

/// The headers each broker's publisher writes with CloudEvents on (as
/// tests/tests/cloudevents.rs reads them from the brokers): `ce_*` on Kafka, `ce-*` on
/// NATS (with `ce-datacontenttype`), `cloudEvents:*` on RabbitMQ, next to the outbox
/// headers.
fn broker_headers(prefix: &str, kind: &str) -> serde_json::Value {
    let mut headers = serde_json::json!({
        "message-id": "01890a5d-ac96-774b-bcce-b302099a8057",
        "event-type": "ParcelShipped",
        "event-version": "3",
        "content-type": "application/json",
        "partition-key": "parcel-7",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    });
    for (name, value) in [
        ("specversion", "1.0"),
        ("id", "01890a5d-ac96-774b-bcce-b302099a8057"),
        ("source", "urn:example:shapes"),
        ("type", kind),
        ("time", "2026-12-01T10:30:00.000000Z"),
    ] {
        headers[format!("{prefix}{name}")] = value.into();
    }
    if prefix == "ce-" {
        headers["ce-datacontenttype"] = "application/json".into();
    }
    headers
}

/// #33: with servers of three brokers, every broker's message validates against the
/// headers schema the document gives it (one `anyOf` branch per broker's prefix); the
/// outbox headers and some broker's attributes stay required. The one-prefix form
/// (`Info::cloudevents`) refuses the other brokers' messages, which is what the
/// per-server form fixes.
#[test]
fn each_brokers_cloudevents_headers_validate_against_its_schema() {
    let ce = outbox::publisher::cloudevents::CloudEvents::new("urn:example:shapes")
        .expect("a source")
        .type_prefix("com.example.shapes")
        .expect("a prefix");
    let info = Info::new("shapes", "0.1.0")
        .server("kafka", "kafka.internal:9092", "kafka")
        .server("nats", "nats://nats.internal:4222", "nats")
        .server("rabbit", "amqp://rabbit.internal:5672", "amqp")
        .cloudevents_by_server(&ce);
    let document = asyncapi(&info).expect("a consistent catalog");
    let doc = document.as_value();
    let found = asyncapi::errors(&asyncapi::validator(), doc);
    assert!(found.is_empty(), "not valid AsyncAPI 3.0: {found:#?}");
    let schema = &doc["components"]["messages"]["ParcelShipped.v3"]["headers"];
    let headers_schema = jsonschema::draft7::new(schema).expect("the headers schema compiles");
    let kind = "com.example.shapes.ParcelShipped.v3";
    for prefix in ["ce_", "ce-", "cloudEvents:"] {
        let headers = broker_headers(prefix, kind);
        let errors: Vec<String> = headers_schema
            .iter_errors(&headers)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{prefix}: {errors:#?}\n{headers:#}");
    }
    // Not a rubber stamp: without any broker's attributes, with another type, or
    // without an outbox header, a message is refused.
    let mut bare = broker_headers("ce_", kind);
    for name in ["specversion", "id", "source", "type", "time"] {
        bare.as_object_mut()
            .expect("an object")
            .remove(&format!("ce_{name}"));
    }
    assert!(!headers_schema.is_valid(&bare), "no CloudEvents attributes");
    assert!(
        !headers_schema.is_valid(&broker_headers("ce-", "ParcelShipped.v3")),
        "the type without its prefix"
    );
    let mut no_id = broker_headers("cloudEvents:", kind);
    no_id
        .as_object_mut()
        .expect("an object")
        .remove("message-id");
    assert!(!headers_schema.is_valid(&no_id), "no message-id");
    // NATS in structured mode (`CloudEventsMode::Structured`): `content-type:
    // application/cloudevents+json` and no attribute headers; then a binary-mode NATS
    // message no longer fits.
    let structured =
        asyncapi(&info.clone().cloudevents_structured_for("nats")).expect("a consistent catalog");
    let found = asyncapi::errors(&asyncapi::validator(), structured.as_value());
    assert!(found.is_empty(), "not valid AsyncAPI 3.0: {found:#?}");
    let structured_schema = jsonschema::draft7::new(
        &structured.as_value()["components"]["messages"]["ParcelShipped.v3"]["headers"],
    )
    .expect("compiles");
    let mut nats_structured = broker_headers("ce_", kind);
    let object = nats_structured.as_object_mut().expect("an object");
    object.retain(|name, _| !name.starts_with("ce_"));
    object.insert(
        "content-type".to_owned(),
        "application/cloudevents+json".into(),
    );
    assert!(
        structured_schema.is_valid(&nats_structured),
        "{nats_structured:#}"
    );
    assert!(
        structured_schema.is_valid(&broker_headers("ce_", kind)),
        "Kafka"
    );
    assert!(
        structured_schema.is_valid(&broker_headers("cloudEvents:", kind)),
        "RabbitMQ"
    );
    assert!(
        !structured_schema.is_valid(&broker_headers("ce-", kind)),
        "binary mode on a structured server"
    );
    // The one-prefix document describes Kafka's headers only.
    let single = asyncapi(
        &Info::new("shapes", "0.1.0")
            .server("kafka", "kafka.internal:9092", "kafka")
            .server("nats", "nats://nats.internal:4222", "nats")
            .cloudevents("ce_", "urn:example:shapes"),
    )
    .expect("a consistent catalog");
    let single_schema = jsonschema::draft7::new(
        &single.as_value()["components"]["messages"]["ParcelShipped.v3"]["headers"],
    )
    .expect("compiles");
    assert!(single_schema.is_valid(&broker_headers("ce_", "ParcelShipped.v3")));
    assert!(!single_schema.is_valid(&broker_headers("ce-", "ParcelShipped.v3")));
}
