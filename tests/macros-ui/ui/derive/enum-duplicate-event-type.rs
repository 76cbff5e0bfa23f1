use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "orders.events")]
enum OrderEvent {
    Created { order_id: u64 },
    #[outbox(event_type = "Created")]
    Recreated { order_id: u64 },
}

fn main() {}
