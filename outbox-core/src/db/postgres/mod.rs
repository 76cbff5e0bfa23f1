//! PostgreSQL's wing. Its public face is [`crate::postgres`]; the sub-wings:
//!
//! | Module | Holds |
//! |---|---|
//! | `options.rs` | [`Options`] (beside the table names: WAL mode), [`Wal`], the builder's `wal*` methods, `Outbox::connect_wal` |
//! | `write.rs` | the write path: the prepared flush statement (writer lock, `seq`, the wake-up while a relay waits idle), WAL mode's one-round-trip commit |
//! | `schema.rs` | the migration dialect (one transaction under an advisory lock; WAL mode creates its slot) |
//! | `ops.rs` | the stored-message SQL: inbox, retention, admin, status |
//! | `diagnostics.rs` | what `doctor` and `status` read from the server: [`Health`], the oldest open writer, `mask_literals` |
//! | `partitions.rs` | the time-partitioned layout and its retention |
//! | `session/` | the table-mode relay session: statements (`sql.rs`), the publish horizon (`horizon.rs`), partitions among relays (`ownership.rs`), the session (`table.rs`), what a hub's tenants hand one another (`lease.rs`); `mod.rs` opens a table or a WAL session |
//! | `wal/` | WAL mode: the envelope, the commit's statement, the slot ([`Slot`]), the WAL session and its stream and table writes |
//! | `hub.rs` | `Shared` for PostgreSQL: the connections a relay process's tenants take in turns, and its control connection |
//!
//! Rule: nothing here names a service (`admin`, `doctor`, `inbox`, `retention`) or the
//! relay loop; what they need comes through the `store` traits.

mod diagnostics;
mod hub;
mod ops;
mod options;
mod partitions;
mod schema;
mod session;
mod wal;
mod write;

#[cfg(feature = "fuzzing")]
pub use diagnostics::mask_literals;
pub use diagnostics::{Health, OpenWriter, RelayInstance, ReplicationSlot};
pub use options::{Options, Wal};
pub use partitions::{PartitionInterval, PartitionReport, Partitioned};
pub use wal::{Slot, SlotStatus};

use sqlx::Postgres;

use crate::config::Tables;
use crate::error::DbContext;
use crate::store::{Database, Sealed};
use crate::{Outbox, Result};

impl Sealed for Postgres {}

impl Database for Postgres {
    type Options = Options;

    fn resolve(options: &mut Options, tables: &Tables) -> Result<()> {
        options::resolve(options, tables)
    }

    /// The URL's database, or the user's name (PostgreSQL's default when none is given).
    fn database_name(pool: &sqlx::PgPool) -> String {
        let options = pool.connect_options();
        options
            .get_database()
            .unwrap_or(options.get_username())
            .to_owned()
    }
}

impl Outbox<Postgres> {
    /// Connects to PostgreSQL at `url` with a default pool and the default table names.
    ///
    /// The error names the server (without the password) and says what to check.
    pub async fn connect(url: &str) -> Result<Self> {
        Ok(Outbox::new(super::connect::pool(url).await?))
    }

    /// The `LISTEN`/`NOTIFY` channel notified at every commit that wrote events:
    /// `outbox_<oid of the outbox table>`, so outboxes in different schemas never wake
    /// each other's relays.
    pub async fn notify_channel(&self) -> Result<String> {
        let outbox = &self.tables().outbox;
        sqlx::query_scalar("SELECT 'outbox_' || $1::text::regclass::oid::text")
            .bind(outbox.quoted())
            .fetch_one(self.pool())
            .await
            .context("resolving the notification channel", outbox)
    }
}

/// The payload's bytes of the row `prefix` names (`"o."`, or `""`): `body`, or, in a row
/// written before payloads were bytes (migration 6), the bytes of the `jsonb` text it was
/// published with then.
pub(crate) fn payload_bytes(prefix: &str) -> String {
    format!("COALESCE({prefix}body, convert_to({prefix}payload::text, 'UTF8'))")
}

/// Advisory locks of one outbox table use the two-key form `(table oid as int4, id)`,
/// so outboxes in different schemas or with different names never share a lock.
pub(crate) mod locks {
    /// Held shared by every transaction writing outbox rows, from before its rows draw
    /// `seq` values until it ends.
    pub(crate) const WRITERS: i32 = 0;
    /// `PARTITIONS + p`: held by the relay publishing partition `p`.
    pub(crate) const PARTITIONS: i32 = 1_000_000;
    /// `RELAYS + slot`: held by each running relay (one slot each), to count them.
    pub(crate) const RELAYS: i32 = 2_000_000;
    /// Relay slots per outbox.
    pub(crate) const MAX_RELAYS: i32 = 4096;
    /// `PARTITION_COUNT + n`: held shared by every running relay configured with `n`
    /// partitions, so that a relay configured differently can see it and stand by.
    pub(crate) const PARTITION_COUNT: i32 = 3_000_000;
    /// Held shared by each relay while it waits idle: commits notify only then
    /// (`wake_sql`).
    pub(crate) const IDLE: i32 = 4_000_000;
    /// Held for a moment while a relay checks and registers its partition count.
    pub(crate) const PARTITION_COUNT_CHECK: i32 = 2_999_999;
}
