use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events")]
#[outbox(destination = "orders.v2")]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
