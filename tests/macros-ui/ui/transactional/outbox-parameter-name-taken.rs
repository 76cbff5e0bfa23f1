use outbox_core::{OutboxTx, transactional_outbox};

#[derive(Debug)]
struct AppError;

impl From<outbox_core::Error> for AppError {
    fn from(_: outbox_core::Error) -> Self {
        AppError
    }
}

#[transactional_outbox]
async fn confirm(tx: &mut OutboxTx<'_>, outbox: &str) -> Result<(), AppError> {
    let _ = (tx, outbox);
    Ok(())
}

fn main() {}
