use outbox_core::{OutboxTx, transactional_outbox};

#[derive(Debug)]
struct AppError;

impl From<outbox_core::Error> for AppError {
    fn from(_: outbox_core::Error) -> Self {
        AppError
    }
}

#[transactional_outbox]
async fn confirm(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), AppError> {
    let _ = (tx, order_id);
    Ok(())
}

async fn caller(outbox: &outbox_core::Outbox) -> Result<(), AppError> {
    // Forgot the handle: the wrapper's first parameter.
    confirm(7).await
}

fn main() {}
