use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", version = "2")]
struct OrderConfirmed {
    order_id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", version = 3000000000)]
struct OrderShipped {
    order_id: u64,
}

fn main() {}
