use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", key = 2)]
struct OrderConfirmed(u64, String);

fn main() {}
