use outbox_core::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "health", key = 0)]
struct Heartbeat;

fn main() {}
