use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", key = order_id)]
struct OrderConfirmed(u64);

fn main() {}
