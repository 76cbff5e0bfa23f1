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

/// What the server says of `slot` and the sessions around it, for a failed WAL fault
/// test: the slot (active, which server process streams it, its confirmed position), that
/// walsender (its state, what it sent, what the relay last confirmed and when it last
/// replied), and every session that holds or waits for an advisory lock (the relays'
/// fence and idle locks), with its state, what it waits on and its last statement.
pub async fn slot_report(db: &TestDb, slot: &str) -> String {
    let slot_row: Result<Option<String>, _> = sqlx::query_scalar(
        "SELECT format('slot %s: active %s, active_pid %s, restart_lsn %s, confirmed_flush_lsn %s', \
                slot_name, active, active_pid, restart_lsn, confirmed_flush_lsn) \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(&db.pool)
    .await;
    let senders: Result<Vec<String>, _> = sqlx::query_scalar(
        "SELECT format('walsender %s (%s): state %s, started %s, sent %s, flushed %s, last reply %s', \
                r.pid, r.application_name, r.state, r.backend_start, r.sent_lsn, r.flush_lsn, \
                r.reply_time) \
         FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid \
         WHERE s.slot_name = $1",
    )
    .bind(slot)
    .fetch_all(&db.pool)
    .await;
    let locks: Result<Vec<String>, _> = sqlx::query_scalar(
        "SELECT format('pid %s (%s): advisory lock %s/%s %s, %s since %s, waits on %s/%s, query %L', \
                a.pid, a.application_name, l.classid, l.objid, \
                CASE WHEN l.granted THEN 'held' ELSE 'awaited' END, a.state, a.state_change, \
                a.wait_event_type, a.wait_event, left(a.query, 120)) \
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND a.datname = current_database() \
         ORDER BY a.pid",
    )
    .fetch_all(&db.pool)
    .await;
    let mut report = String::from("what the server says:");
    match slot_row {
        Ok(Some(row)) => report.push_str(&format!("\n  {row}")),
        Ok(None) => report.push_str(&format!("\n  slot {slot}: none")),
        Err(e) => report.push_str(&format!("\n  slot {slot}: {e}")),
    }
    for rows in [senders, locks] {
        match rows {
            Ok(rows) => rows
                .iter()
                .for_each(|row| report.push_str(&format!("\n  {row}"))),
            Err(e) => report.push_str(&format!("\n  {e}")),
        }
    }
    report
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
