//! `#[derive(OutboxEvent)]`: the metadata it generates, the rows it produces, and the
//! event catalog it registers.

use std::borrow::Cow;
use std::sync::Arc;

use outbox_core::sqlx::{self, Row};
use outbox_core::{Destination, OutboxEvent, PartitionKey, destinations};
use outbox_tests::TestDb;
use serde::Serialize;
use uuid::Uuid;

destinations! {
    /// Orders.
    pub ORDER_EVENTS = "orders.events";
    pub BILLING = "billing.events";
}

mod routes {
    outbox_core::destinations! {
        pub AUDIT = "audit";
    }
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = ORDER_EVENTS, key = order_id)]
struct OrderConfirmed {
    order_id: Uuid,
    customer: String,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(
    destination = "billing.events",
    event_type = "invoice.issued",
    version = 3,
    key = 1
)]
struct InvoiceIssued(String, u64);

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = routes::AUDIT)]
struct Ping;

/// Generic payloads keep their bounds; the key field's type must be a `PartitionKey`.
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = BILLING, key = account, event_type = "Envelope")]
struct Envelope<K, T: Clone>
where
    T: std::fmt::Debug,
{
    account: K,
    body: T,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = ORDER_EVENTS, key = order_id, version = 1)]
enum OrderEvent {
    Created {
        order_id: i64,
        items: u32,
    },
    #[outbox(event_type = "order.cancelled", version = 2)]
    Cancelled {
        order_id: i64,
        reason: String,
    },
    /// Has its own key: a tuple variant names it by index.
    #[outbox(key = 0)]
    Moved(Option<String>, i64),
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "keys")]
enum NoKeys {
    A,
    B { x: u8 },
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "keys", key = id)]
struct Borrowed<'a> {
    id: Cow<'a, str>,
    shared: Arc<str>,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "keys", key = id)]
struct MaybeKeyed {
    id: Option<u32>,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "keys", key = r#type)]
struct RawIdent {
    r#type: char,
}

#[test]
fn named_struct() {
    let id = Uuid::now_v7();
    let e = OrderConfirmed {
        order_id: id,
        customer: "c".into(),
    };
    assert_eq!(e.event_type(), "OrderConfirmed");
    assert_eq!(e.destination(), ORDER_EVENTS);
    assert_eq!(e.partition_key(), Some(id.to_string()));
    assert_eq!(e.version(), None);
    // Through a reference too (the blanket impl).
    assert_eq!(OutboxEvent::event_type(&&e), "OrderConfirmed");
}

#[test]
fn tuple_and_unit_structs() {
    let e = InvoiceIssued("acct".into(), 99);
    assert_eq!(e.event_type(), "invoice.issued");
    assert_eq!(e.destination().as_str(), "billing.events");
    assert_eq!(e.partition_key().as_deref(), Some("99"));
    assert_eq!(e.version(), Some(3));

    assert_eq!(Ping.event_type(), "Ping");
    assert_eq!(Ping.destination(), routes::AUDIT);
    assert_eq!(Ping.partition_key(), None);
}

#[test]
fn generic_struct() {
    let e = Envelope {
        account: 7_u64,
        body: vec![1, 2],
    };
    assert_eq!(e.event_type(), "Envelope");
    assert_eq!(e.destination(), BILLING);
    assert_eq!(e.partition_key().as_deref(), Some("7"));
    let e = Envelope {
        account: Some("acc-1".to_owned()),
        body: "x",
    };
    assert_eq!(e.partition_key().as_deref(), Some("acc-1"));
    let e = Envelope {
        account: None::<String>,
        body: (),
    };
    assert_eq!(e.partition_key(), None, "None is no key");
}

#[test]
fn enums() {
    let created = OrderEvent::Created {
        order_id: 1,
        items: 2,
    };
    let cancelled = OrderEvent::Cancelled {
        order_id: 2,
        reason: "r".into(),
    };
    let moved = OrderEvent::Moved(Some("m".into()), 3);
    assert_eq!(created.event_type(), "Created");
    assert_eq!(cancelled.event_type(), "order.cancelled");
    assert_eq!(moved.event_type(), "Moved");
    for e in [&created, &cancelled, &moved] {
        assert_eq!(e.destination(), ORDER_EVENTS);
    }
    assert_eq!(created.partition_key().as_deref(), Some("1"));
    assert_eq!(cancelled.partition_key().as_deref(), Some("2"));
    assert_eq!(
        moved.partition_key().as_deref(),
        Some("m"),
        "own key: field 0"
    );
    assert_eq!(created.version(), Some(1), "the enum's version");
    assert_eq!(cancelled.version(), Some(2), "the variant's own version");
    assert_eq!(moved.version(), Some(1));

    assert_eq!(NoKeys::A.event_type(), "A");
    assert_eq!(NoKeys::B { x: 1 }.partition_key(), None);
}

#[test]
fn key_types() {
    let e = Borrowed {
        id: Cow::Borrowed("b-1"),
        shared: Arc::from("s"),
    };
    assert_eq!(e.partition_key().as_deref(), Some("b-1"));
    assert_eq!(
        MaybeKeyed { id: Some(4) }.partition_key().as_deref(),
        Some("4")
    );
    assert_eq!(MaybeKeyed { id: None }.partition_key(), None);
    assert_eq!(
        RawIdent { r#type: 'q' }.partition_key().as_deref(),
        Some("q")
    );
    assert_eq!(RawIdent { r#type: 'q' }.event_type(), "RawIdent");
    assert_eq!(e.shared.to_partition_key().as_deref(), Some("s"));
}

#[test]
fn catalog_lists_every_derived_event_type() {
    let catalog = outbox_core::catalog();
    let find = |event_type: &str| {
        let found: Vec<_> = catalog
            .iter()
            .filter(|e| e.event_type == event_type)
            .collect();
        assert_eq!(found.len(), 1, "{event_type}: {catalog:#?}");
        *found[0]
    };
    let e = find("OrderConfirmed");
    assert_eq!(e.destination, ORDER_EVENTS);
    assert_eq!(e.version, None);
    assert_eq!(e.rust_type, "macros_derive::OrderConfirmed");
    assert_eq!(e.module_path, "macros_derive");
    assert_eq!(e.variant, None);

    let e = find("invoice.issued");
    assert_eq!(e.rust_type, "macros_derive::InvoiceIssued");
    assert_eq!(e.version, Some(3));
    assert_eq!(find("Ping").destination.as_str(), "audit");
    assert_eq!(find("Envelope").rust_type, "macros_derive::Envelope");

    let e = find("order.cancelled");
    assert_eq!(e.rust_type, "macros_derive::OrderEvent");
    assert_eq!(e.variant, Some("Cancelled"));
    assert_eq!(e.version, Some(2));
    assert_eq!(find("Created").version, Some(1));
    assert_eq!(find("Moved").variant, Some("Moved"));

    // Sorted by destination, then event type.
    let keys: Vec<_> = catalog
        .iter()
        .map(|e| (e.destination, e.event_type))
        .collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted);

    outbox_core::catalog::validate().expect("this binary's catalog has no duplicates");
}

#[tokio::test]
async fn derived_events_are_written_with_their_metadata() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let id = Uuid::now_v7();
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(OrderConfirmed {
        order_id: id,
        customer: "c".into(),
    })
    .expect("emit");
    tx.emit(OrderEvent::Cancelled {
        order_id: 9,
        reason: "late".into(),
    })
    .expect("emit");
    tx.emit(InvoiceIssued("a".into(), 5)).expect("emit");
    tx.emit(Ping).expect("emit");
    tx.commit().await.expect("commit");

    let rows = sqlx::query(
        "SELECT event_type, destination, partition_key, event_version, \
         convert_from(body, 'UTF8')::jsonb AS payload FROM outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .expect("rows");
    let got: Vec<(String, String, Option<String>, Option<i32>)> = rows
        .iter()
        .map(|r| {
            (
                r.get("event_type"),
                r.get("destination"),
                r.get("partition_key"),
                r.get("event_version"),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "OrderConfirmed".into(),
                "orders.events".into(),
                Some(id.to_string()),
                None
            ),
            (
                "order.cancelled".into(),
                "orders.events".into(),
                Some("9".into()),
                Some(2)
            ),
            (
                "invoice.issued".into(),
                "billing.events".into(),
                Some("5".into()),
                Some(3)
            ),
            ("Ping".into(), "audit".into(), None, None),
        ]
    );
    assert_eq!(
        rows[1].get::<serde_json::Value, _>("payload"),
        serde_json::json!({"Cancelled": {"order_id": 9, "reason": "late"}})
    );
    let _: Destination = ORDER_EVENTS;
    db.cleanup().await;
}
