use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(crate = "outbox core", destination = "orders.events")]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
