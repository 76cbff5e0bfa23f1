//! Runtime support for `#[transactional_outbox]`: what the generated wrapper calls to
//! begin, commit and roll back, converting [`Error`] into the function's error type.
//! Reached through `__private`; not a public API.

use crate::store::Backend;
use crate::{Error, Outbox, OutboxTx};

/// The error type of a `#[transactional_outbox]` function must be able to hold the
/// outbox's own errors (failing to begin or to commit the transaction).
#[diagnostic::on_unimplemented(
    message = "the error type `{Self}` of this `#[transactional_outbox]` function cannot hold an `outbox::Error`",
    label = "`{Self}` does not implement `From<outbox::Error>`",
    note = "beginning and committing the transaction can fail with `outbox::Error`; \
            add `impl From<outbox::Error> for {Self}` (with thiserror: a variant `Outbox(#[from] outbox::Error)`)"
)]
pub trait FromOutboxError {
    /// Converts the outbox's error.
    fn from_outbox_error(error: Error) -> Self;
}

impl<E: From<Error>> FromOutboxError for E {
    fn from_outbox_error(error: Error) -> Self {
        E::from(error)
    }
}

/// Begins the wrapper's transaction.
pub async fn begin<DB: Backend, E: FromOutboxError>(
    outbox: &Outbox<DB>,
) -> Result<OutboxTx<'static, DB>, E> {
    outbox.begin().await.map_err(E::from_outbox_error)
}

/// Writes the collected events and commits.
pub async fn commit<DB: Backend, E: FromOutboxError>(tx: OutboxTx<'static, DB>) -> Result<(), E> {
    tx.commit().await.map_err(E::from_outbox_error)
}

/// Rolls back after the body returned `Err`. The body's error is what the caller gets;
/// a failed rollback is logged (the server rolls back anyway when the connection goes).
pub async fn rollback<DB: Backend>(tx: OutboxTx<'static, DB>) {
    if let Err(error) = tx.rollback().await {
        tracing::warn!(error = %crate::ErrorChain(&error), "rolling back after an error returned by a #[transactional_outbox] function failed");
    }
}
