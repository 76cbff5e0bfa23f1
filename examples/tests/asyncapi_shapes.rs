//! The AsyncAPI document stays valid AsyncAPI 3.0 whatever the event types look like:
//! versioned, enums (externally and internally tagged, unit variants), nested and
//! shared types, maps, tuples, optional fields, several destinations, a destination
//! that is not a valid component id, CloudEvents headers. (A test binary of its own: its
//! event types are not the order service's.)
#![allow(dead_code)]

mod asyncapi;

use std::collections::HashMap;

use outbox_core::OutboxEvent;
use outbox_core::contract::{Info, asyncapi};

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
