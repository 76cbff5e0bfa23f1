//! The macros with `outbox-core` renamed to `outbox` in `Cargo.toml`: this crate has no
//! `outbox_core` in scope, so it compiles only if `crate = "outbox"` is honoured.

use outbox::{OutboxEvent, OutboxTx, transactional_outbox};

outbox::destinations! {
    /// Where the renamed crate's events go.
    pub RENAMED = "renamed.events";
}

/// A derived event, through the renamed crate.
#[derive(Debug, serde::Serialize, OutboxEvent)]
#[outbox(crate = "outbox", destination = RENAMED, key = n, version = 4)]
pub struct Renamed {
    /// The key.
    pub n: i16,
}

/// An enum, through the renamed crate.
#[derive(Debug, serde::Serialize, OutboxEvent)]
#[outbox(crate = "::outbox", destination = "renamed.enum")]
pub enum RenamedEnum {
    /// A variant.
    Only,
}

/// The error of [`emit_renamed`].
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct RenamedError(#[from] outbox::Error);

/// A transactional function, through the renamed crate.
#[transactional_outbox(crate = "outbox")]
pub async fn emit_renamed(tx: &mut OutboxTx<'_>, n: i16) -> Result<(), RenamedError> {
    tx.emit(Renamed { n })?;
    Ok(())
}
