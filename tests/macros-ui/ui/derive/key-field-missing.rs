use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", key = ordr_id)]
struct OrderConfirmed {
    order_id: u64,
    customer: String,
}

fn main() {}
