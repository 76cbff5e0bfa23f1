use outbox_core::OutboxEvent;

#[derive(serde::Serialize)]
struct OrderId {
    value: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", key = order_id)]
struct OrderConfirmed {
    order_id: OrderId,
}

fn main() {}
