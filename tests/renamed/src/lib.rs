//! The macros with the `outbox` facade renamed to `ob` in `Cargo.toml`: this crate has no
//! `outbox` or `outbox_core` in scope, so it compiles only if the macros find the name the
//! manifest gave the crate (or honour `crate = "..."`).

use ob::{OutboxEvent, OutboxTx, transactional_outbox};

ob::destinations! {
    /// Where the renamed crate's events go.
    pub RENAMED = "renamed.events";
}

/// A derived event, through the renamed crate, found in the manifest.
#[derive(Debug, serde::Serialize, OutboxEvent)]
#[outbox(destination = RENAMED, key = n, version = 4)]
pub struct Renamed {
    /// The key.
    pub n: i16,
}

/// An enum, with the path given by hand.
#[derive(Debug, serde::Serialize, OutboxEvent)]
#[outbox(crate = "::ob", destination = "renamed.enum")]
pub enum RenamedEnum {
    /// A variant.
    Only,
}

/// The error of [`emit_renamed`].
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct RenamedError(#[from] ob::Error);

/// A transactional function, through the renamed crate, found in the manifest.
#[transactional_outbox]
pub async fn emit_renamed(tx: &mut OutboxTx<'_>, n: i16) -> Result<(), RenamedError> {
    tx.emit(Renamed { n })?;
    Ok(())
}

/// The same with the path given by hand.
#[transactional_outbox(crate = "ob")]
pub async fn emit_renamed_by_hand(tx: &mut OutboxTx<'_>, n: i16) -> Result<(), RenamedError> {
    tx.emit(Renamed { n })?;
    Ok(())
}
