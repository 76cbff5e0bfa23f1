use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events")]
struct OrderConfirmed {
    #[outbox(key)]
    order_id: u64,
}

fn main() {}
