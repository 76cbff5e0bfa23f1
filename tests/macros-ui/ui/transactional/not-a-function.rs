use outbox_core::{OutboxTx, transactional_outbox};

#[derive(Debug)]
struct AppError;

impl From<outbox_core::Error> for AppError {
    fn from(_: outbox_core::Error) -> Self {
        AppError
    }
}

#[transactional_outbox]
pub struct OrderService {
    outbox: outbox_core::Outbox,
}

fn main() {}
