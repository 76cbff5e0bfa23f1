use outbox_core::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(destination = "raw")]
union Raw {
    a: u32,
    b: f32,
}

fn main() {}
