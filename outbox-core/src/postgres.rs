//! PostgreSQL's own part of outbox, as `sqlx::postgres` is sqlx's: the options an outbox
//! has on PostgreSQL beside its table names ([`Options`], WAL mode's [`Wal`]), the
//! replication slot of WAL mode ([`Slot`], [`SlotStatus`]), the time-partitioned layout
//! ([`PartitionInterval`], [`Partitioned`], [`PartitionReport`]) and what `outbox
//! doctor` reads from the server ([`Health`], [`OpenWriter`], [`RelayInstance`],
//! [`ReplicationSlot`]).
//!
//! The methods PostgreSQL adds to the common types are on them, for `DB = Postgres`:
//! [`Outbox::connect`](crate::Outbox::connect),
//! [`Outbox::connect_wal`](crate::Outbox::connect_wal),
//! [`Outbox::notify_channel`](crate::Outbox::notify_channel),
//! [`Outbox::partition_by_time`](crate::Outbox::partition_by_time),
//! [`OutboxBuilder::wal`](crate::OutboxBuilder::wal) and its siblings.
//!
//! ```no_run
//! # #[cfg(feature = "wal")]
//! # async fn demo() -> outbox_core::Result<()> {
//! use outbox_core::Outbox;
//! use outbox_core::postgres::Slot;
//!
//! let outbox = Outbox::connect_wal("postgres://app@localhost/shop").await?;
//! assert!(outbox.options().wal.is_some());
//! let slot = Slot::status(&outbox).await?;
//! println!("{} keeps {:?} bytes of WAL", slot.name, slot.retained_bytes);
//! # Ok(())
//! # }
//! ```

pub use crate::db::postgres::{
    Health, OpenWriter, Options, PartitionInterval, PartitionReport, Partitioned, RelayInstance,
    ReplicationSlot, Slot, SlotStatus, Wal,
};
