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

fn main() {}
