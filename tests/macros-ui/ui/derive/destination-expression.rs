use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = format!("orders.{}", 1))]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
