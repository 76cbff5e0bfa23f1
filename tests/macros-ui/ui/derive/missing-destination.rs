use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(key = order_id)]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
