use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", event_type = "OrderEvent")]
enum OrderEvent {
    Created { order_id: u64 },
    Cancelled { order_id: u64 },
}

fn main() {}
