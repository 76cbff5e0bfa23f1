// Another codec than JSON goes on a struct; `content_type` only with `codec = bytes`;
// an unknown codec is named; bytes that say they are JSON are refused.
use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", codec = bytes)]
enum Orders {
    Placed { order_id: u64 },
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", content_type = "text/csv")]
struct Report {
    rows: u64,
}

#[derive(OutboxEvent)]
#[outbox(destination = "orders.events", codec = bytes, content_type = "not a type")]
struct Thumbnail(Vec<u8>);

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", codec = thrift)]
struct Later {
    n: u64,
}

#[derive(OutboxEvent)]
#[outbox(destination = "orders.events", codec = bytes, content_type = "application/json")]
struct PreSerialized(Vec<u8>);

fn main() {}
