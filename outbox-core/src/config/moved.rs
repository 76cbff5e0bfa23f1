//! Deprecated paths of types that moved to [`crate::postgres`].

moved! {
    PartitionInterval => postgres, "moved to `outbox_core::postgres::PartitionInterval`";
    /// An outbox's WAL mode is `outbox.options().wal`, no longer `outbox.tables().wal`.
    Wal => postgres, "moved to `outbox_core::postgres::Wal`";
}
