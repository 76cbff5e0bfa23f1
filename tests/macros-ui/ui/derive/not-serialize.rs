use outbox_core::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(destination = "orders.events")]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
