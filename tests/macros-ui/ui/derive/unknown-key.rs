use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", topic = "orders", partition = order_id)]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
