use outbox_core::{OutboxEvent, destinations};

destinations! {
    pub ORDER_EVENTS = "orders.events";
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = ORDR_EVENTS)]
struct OrderConfirmed {
    order_id: u64,
}

fn main() {}
