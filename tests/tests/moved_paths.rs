//! The paths of public types that moved to `outbox_core::postgres` (Architecture II) stay
//! usable, deprecated, for one release (CHANGELOG, "Breaking"): user code that names them
//! keeps compiling. Each old path must be the very type of the new one.
#![allow(deprecated)]

use outbox_core::{Outbox, postgres};

/// Compiles only if `A` and `B` are the same type.
fn same<A, B>()
where
    A: Same<B>,
{
}
trait Same<T> {}
impl<T> Same<T> for T {}

#[test]
fn every_moved_type_keeps_its_old_path_for_one_release() {
    same::<outbox_core::config::Wal, postgres::Wal>();
    same::<outbox_core::config::PartitionInterval, postgres::PartitionInterval>();
    same::<outbox_core::admin::SlotStatus, postgres::SlotStatus>();
    same::<outbox_core::admin::OpenWriter, postgres::OpenWriter>();
    same::<outbox_core::doctor::Health, postgres::Health>();
    same::<outbox_core::doctor::RelayInstance, postgres::RelayInstance>();
    same::<outbox_core::doctor::ReplicationSlot, postgres::ReplicationSlot>();
    same::<outbox_core::doctor::Status, outbox_core::admin::Status>();
    same::<outbox_core::retention::PartitionReport, postgres::PartitionReport>();
    same::<outbox_core::retention::Partitioned, postgres::Partitioned>();
    // Enum variants through the old path.
    assert_eq!(
        outbox_core::config::PartitionInterval::Daily,
        postgres::PartitionInterval::Daily
    );
}

#[tokio::test]
async fn the_old_drop_slot_refuses_a_table_mode_outbox_as_the_new_one_does() {
    // No server needed: a lazy pool never connects before the WAL-mode check.
    let pool = sqlx::PgPool::connect_lazy("postgres://nobody@127.0.0.1:1/none").expect("lazy pool");
    let outbox: Outbox = Outbox::new(pool);
    let old = outbox_core::admin::Admin::new(outbox.clone())
        .drop_slot()
        .await
        .expect_err("table mode");
    let new = postgres::Slot::drop(&outbox).await.expect_err("table mode");
    assert_eq!(old.to_string(), new.to_string());
    assert!(new.to_string().contains("not in WAL mode"), "{new}");
    assert!(outbox.options().wal.is_none());
}
