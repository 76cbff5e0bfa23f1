// The attribute fails (a method without `outbox = ...`), and its callers, of the wrapper
// and of the `_in_tx` companion, see no error of their own: only the one on `confirm`.
use outbox_core::{OutboxTx, transactional_outbox};

#[derive(Debug)]
struct AppError;

impl From<outbox_core::Error> for AppError {
    fn from(_: outbox_core::Error) -> Self {
        AppError
    }
}

struct OrderService {
    outbox: outbox_core::Outbox,
}

impl OrderService {
    #[transactional_outbox]
    async fn confirm(&self, tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), AppError> {
        let _ = (&self.outbox, tx, order_id);
        Ok(())
    }
}

#[transactional_outbox]
fn not_async(tx: &mut OutboxTx<'_>, id: i64) -> Result<u64, AppError> {
    let _ = (tx, id);
    Ok(1)
}

async fn callers(service: &OrderService, outbox: &outbox_core::Outbox) -> Result<u64, AppError> {
    service.confirm(1).await?;
    let mut tx = outbox.begin().await?;
    service.confirm_in_tx(&mut tx, 2).await?;
    not_async_in_tx(&mut tx, 3).await?;
    not_async(outbox, 4).await
}

fn main() {
    let _ = callers;
}
