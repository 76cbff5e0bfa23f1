use outbox_core::OutboxEvent;

const ORDER_TOPIC: &str = "orders.events";

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = ORDER_TOPIC)]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
