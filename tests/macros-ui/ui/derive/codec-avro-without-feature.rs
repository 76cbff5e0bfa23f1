// `codec = avro` where outbox was built without its `avro` feature: the error says which
// feature to turn on (and nothing else: the type's serde derives are not reported).
use outbox_core::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(destination = "orders.events", codec = avro)]
struct OrderShipped {
    order_id: u64,
}

fn main() {}
