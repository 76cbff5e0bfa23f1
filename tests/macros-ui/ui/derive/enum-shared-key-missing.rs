use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", key = order_id)]
enum OrderEvent {
    Created { order_id: u64 },
    Heartbeat,
    #[outbox(destination = "elsewhere", key = id)]
    Moved { order_id: u64 },
}

fn main() {}
