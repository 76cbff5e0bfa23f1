//! Every shape `#[transactional_outbox]` accepts.

// A test target of the workspace: its types exist only for the attribute.
#![allow(missing_debug_implementations)]

use std::sync::Arc;

use outbox_core::sqlx::Postgres;
use outbox_core::{Outbox, OutboxTx, transactional_outbox};

#[derive(Debug)]
pub struct AppError;

impl From<outbox_core::Error> for AppError {
    fn from(_: outbox_core::Error) -> Self {
        AppError
    }
}

/// Docs and attributes are kept.
#[transactional_outbox]
#[allow(clippy::needless_pass_by_value)]
pub async fn free(tx: &mut OutboxTx<'_>, id: i64, name: String) -> Result<i64, AppError> {
    let _ = (tx, name);
    Ok(id)
}

/// An explicit backend, patterns, `impl Trait` and `mut` parameters.
#[transactional_outbox]
pub(crate) async fn explicit_backend(
    (a, b): (i64, i64),
    tx: &mut OutboxTx<'_, Postgres>,
    mut name: impl Into<String> + Send,
) -> outbox_core::Result<i64> {
    let _ = tx;
    name = std::convert::identity(name);
    let _: String = name.into();
    Ok(a + b)
}

/// Generic over the backend: the handle's type follows.
#[transactional_outbox]
async fn generic_backend<DB: outbox_core::Backend>(
    tx: &mut OutboxTx<'_, DB>,
) -> Result<(), AppError> {
    let _ = tx;
    Ok(())
}

/// The handle named by an expression over the parameters.
#[transactional_outbox(outbox = ctx.outbox)]
async fn with_context(ctx: &Context, tx: &mut OutboxTx<'_>) -> Result<(), AppError> {
    let _ = (tx, ctx);
    Ok(())
}

pub struct Context {
    outbox: Outbox,
}

/// A Result alias.
type AppResult<T> = Result<T, AppError>;

#[transactional_outbox]
async fn alias(tx: &mut OutboxTx<'_>) -> AppResult<()> {
    let _ = tx;
    Ok(())
}

/// Parameters named like generated locals do not clash with them.
#[transactional_outbox]
async fn with_two_generated_names(
    tx: &mut OutboxTx<'_>,
    __outbox_tx: i64,
) -> Result<i64, AppError> {
    let _ = tx;
    Ok(__outbox_tx)
}

struct Service<R> {
    outbox: Arc<Outbox>,
    repo: R,
}

impl<R: Send + Sync> Service<R> {
    #[transactional_outbox(outbox = self.outbox)]
    async fn by_ref(&self, tx: &mut OutboxTx<'_>) -> Result<(), AppError> {
        let _ = (tx, &self.repo);
        Ok(())
    }

    #[transactional_outbox(outbox = self.outbox)]
    async fn by_mut(&mut self, tx: &mut OutboxTx<'_>) -> Result<(), AppError> {
        let _ = (tx, &mut self.repo);
        Ok(())
    }

    #[transactional_outbox(outbox = self.outbox.clone())]
    async fn by_value(mut self, tx: &mut OutboxTx<'_>) -> Result<Self, AppError> {
        let _ = tx;
        self.repo = std::convert::identity(self.repo);
        Ok(self)
    }

    #[transactional_outbox(outbox = self.outbox)]
    async fn generic_method<'a, T: Send + 'a, const N: usize>(
        self: Arc<Self>,
        tx: &mut OutboxTx<'_>,
        items: [&'a T; N],
    ) -> Result<usize, AppError>
    where
        R: 'static,
    {
        self.by_ref_in_tx(tx).await?;
        Ok(items.len())
    }
}

fn assert_send<T: Send>(_: T) {}

async fn callers(outbox: &Outbox, pool_outbox: Outbox<Postgres>) -> Result<(), AppError> {
    assert_eq!(free(outbox, 1, "n".into()).await?, 1);
    explicit_backend(outbox, (1, 2), "x")
        .await
        .map_err(AppError::from)?;
    generic_backend(&pool_outbox).await?;
    with_context(&Context {
        outbox: outbox.clone(),
    })
    .await?;
    alias(outbox).await?;
    assert_eq!(with_two_generated_names(outbox, 1).await?, 1);
    let mut service = Service {
        outbox: Arc::new(outbox.clone()),
        repo: 0_u8,
    };
    service.by_ref().await?;
    service.by_mut().await?;
    let service = Arc::new(service.by_value().await?);
    service.clone().generic_method([&1, &2]).await?;
    assert_send(free(outbox, 1, String::new()));
    assert_send(service.by_ref());

    // Joining: the companion takes the caller's transaction.
    let mut tx = outbox.begin().await?;
    free_in_tx(&mut tx, 2, String::new()).await?;
    service.by_ref_in_tx(&mut tx).await?;
    tx.commit().await?;
    Ok(())
}

fn main() {
    let _ = callers;
}
