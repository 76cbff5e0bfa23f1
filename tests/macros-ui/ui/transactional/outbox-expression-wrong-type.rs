use outbox_core::{OutboxTx, transactional_outbox};

#[derive(Debug)]
struct AppError;

impl From<outbox_core::Error> for AppError {
    fn from(_: outbox_core::Error) -> Self {
        AppError
    }
}

struct OrderService {
    outbox: String,
}

impl OrderService {
    #[transactional_outbox(outbox = self.outbox)]
    async fn confirm(&self, tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), AppError> {
        let _ = (tx, order_id);
        Ok(())
    }
}

fn main() {}
