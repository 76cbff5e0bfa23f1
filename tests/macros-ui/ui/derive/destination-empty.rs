use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "  ", event_type = "")]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
