// `codec = protobuf` where outbox was built without its `protobuf` feature: the error
// says which feature to turn on.
use outbox_core::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(destination = "orders.events", codec = protobuf)]
struct OrderPlaced {
    order_id: u64,
}

fn main() {}
