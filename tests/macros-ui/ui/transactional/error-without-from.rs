use outbox_core::{OutboxTx, transactional_outbox};

#[derive(Debug)]
enum OrderError {
    NotFound,
}

#[transactional_outbox]
async fn confirm(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), OrderError> {
    let _ = (tx, order_id);
    Err(OrderError::NotFound)
}

fn main() {}
