// A syntax error in the body is rustc's own error, at its place; the attribute does not
// claim the item is "not a function".
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
    let total = order_id +;
    let _ = (tx, total);
    Ok(())
}

fn main() {}
