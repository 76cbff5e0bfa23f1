//! An event type that does not derive `schemars::JsonSchema` (in a test binary of its
//! own, so that the other contract tests see a catalog where every type has a schema).
#![cfg(feature = "schema")]

use outbox_core::OutboxEvent;
use outbox_core::contract::{Info, assert_compatible, asyncapi};

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "contract.plain", key = 0)]
struct PlainEvent(u64);

/// Generic: no one schema, even with `JsonSchema`.
#[derive(serde::Serialize, schemars::JsonSchema, OutboxEvent)]
#[outbox(destination = "contract.generic")]
struct Envelope<T: serde::Serialize + schemars::JsonSchema> {
    body: T,
}

#[test]
fn an_event_without_a_schema_is_marked_and_the_check_says_what_to_derive() {
    let entry = outbox_core::catalog()
        .into_iter()
        .find(|e| e.event_type == "PlainEvent")
        .expect("registered");
    assert_eq!(entry.schema(), None);
    assert_eq!(entry.key, Some("0"));
    let document = asyncapi(&Info::new("plain", "1")).expect("consistent");
    let message = &document.as_value()["components"]["messages"]["PlainEvent"];
    assert_eq!(message["x-outbox-schema"], "missing");
    assert!(message.get("payload").is_none());

    let panic = std::panic::catch_unwind(|| assert_compatible("does-not-matter.json"))
        .expect_err("refuses a catalog with an event without a schema");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("no JSON Schema for `contract_without_schema::PlainEvent`")
            && message.contains("derive `schemars::JsonSchema` (schemars 1.x"),
        "{message}"
    );
    assert!(
        message.contains("`contract_without_schema::Envelope` is generic")
            && message.contains("Info::destinations"),
        "{message}"
    );
    // Leaving those destinations out is the way through.
    let only = Info::new("plain", "1").destinations(["elsewhere"]);
    assert!(
        asyncapi(&only).expect("consistent").as_value()["channels"]
            .as_object()
            .is_some_and(|c| c.is_empty())
    );
    let _ = Envelope { body: 1u8 }.event_type();
}
