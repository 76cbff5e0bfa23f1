//! WAL-mode fixtures (`docs/wal.md`): replication slots of the test's own, dropped after
//! the test, and swept when a test process died before it could drop them.

use outbox_core::Outbox;
use uuid::Uuid;

use crate::trusted_sql;
use crate::{TestDb, wait_until};

/// A slot name of this process's own. Slots are server-wide, and one left behind keeps
/// WAL forever: [`drop_stale_slots`] drops those of processes that no longer run.
pub fn slot_name() -> String {
    format!(
        "owt_{}_{}",
        std::process::id(),
        &Uuid::now_v7().simple().to_string()[20..]
    )
}

/// Drops the inactive test slots (`owt_<pid>_...`) of processes that no longer run.
pub async fn drop_stale_slots(db: &TestDb) {
    let slots: Vec<String> = sqlx::query_scalar(
        "SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE 'owt\\_%' AND NOT active",
    )
    .fetch_all(&db.pool)
    .await
    .expect("list slots");
    for slot in slots {
        let pid = slot.split('_').nth(1).unwrap_or("");
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&slot)
            .execute(&db.pool)
            .await;
        let _ = sqlx::query(trusted_sql(format!(
            "DROP PUBLICATION IF EXISTS \"{slot}\""
        )))
        .execute(&db.pool)
        .await;
    }
}

/// A migrated WAL-mode outbox in `db`'s schema, with a slot of its own.
pub async fn outbox_in(db: &TestDb) -> (Outbox, String) {
    drop_stale_slots(db).await;
    let slot = slot_name();
    let outbox = Outbox::builder(db.pool.clone())
        .wal_slot(&slot)
        .build()
        .expect("build");
    outbox.migrate().await.expect("migrate creates the slot");
    (outbox, slot)
}

/// Waits until no relay streams from `slot`, drops it and its publication, and drops
/// the test's schema.
pub async fn cleanup(db: TestDb, slot: &str) {
    let wait = std::time::Duration::from_secs(30);
    wait_until("the slot is released", wait, || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT NOT active FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(slot)
        .fetch_optional(&db.pool)
        .await
        .expect("slot state")
        .unwrap_or(true)
    })
    .await;
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(slot)
        .execute(&db.pool)
        .await
        .expect("drop the slot");
    sqlx::query(trusted_sql(format!(
        "DROP PUBLICATION IF EXISTS \"{slot}\""
    )))
    .execute(&db.pool)
    .await
    .expect("drop the publication");
    db.cleanup().await;
}
