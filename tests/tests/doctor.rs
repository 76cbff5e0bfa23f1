//! `Doctor` (`outbox doctor`) against the real PostgreSQL: each finding, with its
//! condition created for real (dead letters, an old pending message, an open writer,
//! dead rows with autovacuum off, a caching sequence, a partition held by someone else,
//! relays running another partition count than expected, WAL mode's slot unread and
//! then dropped).

use std::time::Duration;

use outbox_core::doctor::{Doctor, Limits, Report, Severity};
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::{Outbox, OutboxMessage, sqlx};
use outbox_tests::trusted_sql;
use outbox_tests::{TestDb, wait_until};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

async fn write(outbox: &Outbox, key: &str, n: usize) -> Vec<Uuid> {
    let mut tx = outbox.begin().await.expect("begin");
    let mut ids = Vec::new();
    for _ in 0..n {
        ids.push(
            tx.emit_message(OutboxMessage::new("Checked", "doctor.events", "{}").with_key(key))
                .expect("emit"),
        );
    }
    tx.commit().await.expect("commit");
    ids
}

async fn examine(outbox: &Outbox, limits: Limits) -> Report {
    Doctor::new(outbox.clone())
        .limits(limits)
        .examine()
        .await
        .expect("examine")
}

fn action<'r>(report: &'r Report, check: &str) -> &'r outbox_core::doctor::Finding {
    let found = report.of(check);
    let finding = found
        .first()
        .unwrap_or_else(|| panic!("no `{check}` finding in {:#?}", report.findings));
    assert_eq!(finding.severity, Severity::Action, "{finding}");
    finding
}

fn relay(outbox: &Outbox, partitions: u16) -> outbox_core::RelayHandle {
    Relay::builder(outbox.clone(), InMemoryPublisher::new())
        .partitions(partitions)
        .spawn()
}

/// Waits until the relays hold `n` partitions between them; that report.
async fn holding(outbox: &Outbox, n: usize) -> Report {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let report = examine(outbox, Limits::default()).await;
        let held: usize = report
            .health
            .as_ref()
            .map_or(0, |h| h.relays.iter().map(|r| r.partitions.len()).sum());
        if held == n {
            return report;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the relays never held {n} partitions: {:#?}",
            report.health
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the server runs autovacuum.
async fn server_autovacuum(db: &TestDb) -> bool {
    sqlx::query_scalar("SELECT current_setting('autovacuum') = 'on'")
        .fetch_one(&db.pool)
        .await
        .expect("autovacuum setting")
}

#[tokio::test]
async fn a_healthy_outbox_with_a_relay_needs_nothing() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let running = relay(&outbox, 4);
    write(&outbox, "k", 3).await;
    let report = holding(&outbox, 4).await;
    wait_until("published", WAIT, || async {
        examine(&outbox, Limits::default()).await.status.pending == 0
    })
    .await;
    assert!(report.health.is_some());
    // Replication slots are server-wide: other tests' (or a crashed run's) are not this
    // outbox's business here.
    let report = examine(&outbox, Limits::default().slot_retained_bytes(i64::MAX)).await;
    // A server with autovacuum off (a test machine may well be) is worth an action on
    // its own; nothing else is.
    let actions: Vec<&str> = report
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Action)
        .map(|f| f.check)
        .collect();
    if server_autovacuum(&db).await {
        assert!(actions.is_empty(), "{:#?}", report.findings);
    } else {
        assert_eq!(actions, ["autovacuum"], "{:#?}", report.findings);
        assert!(
            report.of("autovacuum")[0]
                .summary
                .contains("off on this server")
        );
    }
    let health = report.health.as_ref().expect("PostgreSQL reports health");
    assert_eq!(health.sequence_cache, Some(1));
    assert_eq!(health.partition_counts, vec![4]);
    assert_eq!(health.relays.len(), 1);
    assert_eq!(health.relays[0].partitions, vec![0, 1, 2, 3]);
    let relays = &report.of("relays")[0];
    assert_eq!(relays.severity, Severity::Note);
    assert!(
        relays
            .summary
            .contains("1 relay(s) connected, 4 partitions"),
        "{relays}"
    );
    assert!(relays.details[0].contains("partitions 0-3"), "{relays}");
    running.shutdown().await;
    db.cleanup().await;
}

#[tokio::test]
async fn dead_letters_are_listed_with_the_messages_they_hold_back() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let ids = write(&outbox, "order-7", 3).await;
    sqlx::query(
        "UPDATE outbox SET dead_at = now(), attempts = 5, last_error = 'the broker refused it' \
         WHERE id = $1",
    )
    .bind(ids[0])
    .execute(&db.pool)
    .await
    .expect("dead-letter the first");
    let report = examine(&outbox, Limits::default()).await;
    let dead = action(&report, "dead-letters");
    assert_eq!(
        dead.summary,
        "1 dead letter(s), holding back 2 later message(s) of their keys"
    );
    assert!(
        dead.details[0].contains(&ids[0].to_string())
            && dead.details[0].contains("key order-7: holds back 2 message(s)")
            && dead.details[0].contains("the broker refused it"),
        "{dead}"
    );
    assert!(dead.fix.contains("outbox release --id"), "{dead}");
    // Nothing publishes the other two.
    let no_relay = action(&report, "no-relay");
    assert!(
        no_relay.summary.starts_with("2 message(s) pending"),
        "{no_relay}"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn an_old_pending_message_says_what_holds_it() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    write(&outbox, "k", 1).await;
    let fresh = examine(&outbox, Limits::default()).await;
    assert!(
        fresh.of("oldest-pending").is_empty(),
        "{:#?}",
        fresh.findings
    );
    sqlx::query("UPDATE outbox SET created_at = now() - interval '2 hours'")
        .execute(&db.pool)
        .await
        .expect("age it");
    let report = examine(&outbox, Limits::default()).await;
    let old = action(&report, "oldest-pending");
    assert!(
        old.summary.contains("has waited 2h 0m (limit 5m 0s)"),
        "{old}"
    );
    assert_eq!(old.fix, "see `no-relay`");
    assert!(
        old.details[0].starts_with("doctor.events: 1 pending"),
        "{old}"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn an_open_writer_is_named_without_the_data_it_wrote() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = db.pool.begin().await.expect("begin");
    outbox
        .enqueue_messages(
            &mut tx,
            &[OutboxMessage::new("Checked", "doctor.events", "{}")],
        )
        .await
        .expect("enqueue, which takes the writer lock");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .expect("pid");
    sqlx::query("SELECT 'card 4111-1111' AS secret")
        .execute(&mut *tx)
        .await
        .expect("a statement with a literal");
    let relaxed = examine(&outbox, Limits::default()).await;
    assert!(
        relaxed.of("open-writer").is_empty(),
        "under 30 s: {:#?}",
        relaxed.findings
    );
    let report = examine(&outbox, Limits::default().open_writer(Duration::ZERO)).await;
    let writer = action(&report, "open-writer");
    assert!(
        writer.summary.starts_with(&format!(
            "server process {pid} (idle in transaction) has held"
        )),
        "{writer}"
    );
    assert_eq!(
        writer.details,
        vec!["last statement: SELECT '…' AS secret".to_owned()]
    );
    assert!(
        writer.fix.contains(&format!("pg_terminate_backend({pid})")),
        "{writer}"
    );
    assert!(
        !format!("{report:?}").contains("4111"),
        "the literal stays out"
    );
    tx.rollback().await.expect("rollback");
    db.cleanup().await;
}

#[tokio::test]
async fn dead_rows_and_a_table_without_autovacuum_are_found() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .expect("autovacuum off");
    write(&outbox, "k", 300).await;
    sqlx::query("DELETE FROM outbox")
        .execute(&db.pool)
        .await
        .expect("delete");
    let off = action(&examine(&outbox, Limits::default()).await, "autovacuum").clone();
    assert!(off.summary.contains("autovacuum is disabled for"), "{off}");
    assert!(off.fix.contains("RESET (autovacuum_enabled)"), "{off}");
    // The statistics reach the server's counters within a second or so.
    let limits = Limits::default().dead_rows(100, 0.2);
    let deadline = std::time::Instant::now() + WAIT;
    let bloat = loop {
        let report = examine(&outbox, limits.clone()).await;
        if let Some(found) = report
            .of("table-bloat")
            .first()
            .filter(|f| f.severity == Severity::Action)
        {
            break (*found).clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the dead rows were never counted: {:#?}",
            report.findings
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        bloat.summary.contains("has 300 dead row versions against"),
        "{bloat}"
    );
    assert!(bloat.fix.starts_with("VACUUM (ANALYZE)"), "{bloat}");
    assert!(
        bloat.fix.contains("(set now: autovacuum_enabled=false)"),
        "{bloat}"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn a_sequence_that_caches_values_is_found() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let sequence: String = sqlx::query_scalar("SELECT pg_get_serial_sequence('outbox', 'seq')")
        .fetch_one(&db.pool)
        .await
        .expect("the sequence");
    sqlx::query(trusted_sql(format!("ALTER SEQUENCE {sequence} CACHE 20")))
        .execute(&db.pool)
        .await
        .expect("cache 20");
    let report = examine(&outbox, Limits::default()).await;
    let cache = action(&report, "sequence-cache");
    assert!(cache.summary.contains("caches 20 values"), "{cache}");
    assert_eq!(cache.fix, format!("ALTER SEQUENCE {sequence} CACHE 1"));
    db.cleanup().await;
}

#[tokio::test]
async fn a_partition_held_by_someone_else_and_another_partition_count_are_found() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    // A session that is not a relay takes partition 2 before the relay starts.
    let mut intruder = db.connect().await;
    sqlx::query("SELECT pg_advisory_lock('outbox'::regclass::oid::int4, 1000000 + 2)")
        .execute(&mut intruder)
        .await
        .expect("hold partition 2");
    let running = relay(&outbox, 4);
    let report = holding(&outbox, 3).await;
    let partitions = action(&report, "partitions");
    assert!(
        partitions
            .summary
            .starts_with("partitions 2 are held by sessions that are not relays"),
        "{partitions}"
    );
    let health = report.health.as_ref().expect("health");
    assert_eq!(health.relays[0].partitions, vec![0, 1, 3]);
    assert_eq!(health.partitions_held_by_others, vec![2]);
    drop(intruder);
    holding(&outbox, 4).await;
    // The relays run with 4 partitions; the operator expects 8.
    let report = examine(&outbox, Limits::default().partitions(8)).await;
    let mismatch = action(&report, "partitions");
    assert!(
        mismatch
            .summary
            .starts_with("the relays run with 4 partitions, 8 expected"),
        "{mismatch}"
    );
    running.shutdown().await;
    db.cleanup().await;
}

/// One event through WAL mode: WAL the slots keep.
async fn write_wal(outbox: &Outbox) {
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("Checked", "doctor.events", "{}"))
        .expect("emit");
    tx.commit().await.expect("commit");
}

#[tokio::test]
async fn a_replication_slot_nobody_reads_and_a_missing_wal_slot_are_found() {
    let db = TestDb::new().await;
    outbox_tests::wal::drop_stale_slots(&db).await;
    let (outbox, slot) = outbox_tests::wal::outbox_in(&db).await;
    write_wal(&outbox).await;
    let report = examine(&outbox, Limits::default().slot_retained_bytes(0)).await;
    let slots = action(&report, "replication-slots");
    let line = std::iter::once(&slots.summary)
        .chain(&slots.details)
        .find(|l| l.starts_with(&format!("slot {slot} keeps")))
        .unwrap_or_else(|| panic!("{slot} in {slots}"));
    assert!(line.ends_with("and nothing reads it"), "{line}");
    // Another application's slot over the limit is a note, not this outbox's action.
    let other = outbox_tests::wal::slot_name();
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&other)
        .execute(&db.pool)
        .await
        .expect("another slot");
    write_wal(&outbox).await;
    let report = examine(&outbox, Limits::default().slot_retained_bytes(0)).await;
    let note = report
        .of("replication-slots")
        .into_iter()
        .find(|f| f.summary.starts_with(&format!("slot {other} keeps")))
        .unwrap_or_else(|| panic!("{other} in {:#?}", report.findings));
    assert_eq!(note.severity, Severity::Note, "{note}");
    assert!(note.summary.ends_with("(not this outbox's slot)"), "{note}");
    assert!(
        !action(&report, "replication-slots")
            .details
            .iter()
            .chain(std::iter::once(
                &action(&report, "replication-slots").summary
            ))
            .any(|l| l.contains(&other)),
        "{report:#?}"
    );
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&other)
        .execute(&db.pool)
        .await
        .expect("drop the other slot");
    // Under the default limit (1 GiB) this outbox's few bytes are not a finding. Another
    // application's slot may be over it on a shared server (a benchmark's slot, left by a
    // run that failed, was on the CI machine): that is a note about that slot, not this one.
    let relaxed = examine(&outbox, Limits::default()).await;
    let about_ours: Vec<_> = relaxed
        .of("replication-slots")
        .into_iter()
        .filter(|f| {
            f.severity != Severity::Note
                || std::iter::once(&f.summary)
                    .chain(&f.details)
                    .any(|l| l.contains(&slot))
        })
        .collect();
    assert!(
        about_ours.is_empty(),
        "a few bytes are under 1 GiB: {:#?}",
        relaxed.findings
    );
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&db.pool)
        .await
        .expect("drop the slot");
    let report = examine(&outbox, Limits::default()).await;
    let missing = action(&report, "replication-slots");
    assert_eq!(
        missing.summary,
        format!("WAL mode's slot {slot} does not exist: the relay cannot start")
    );
    sqlx::query(trusted_sql(format!(
        "DROP PUBLICATION IF EXISTS \"{slot}\""
    )))
    .execute(&db.pool)
    .await
    .expect("drop the publication");
    db.cleanup().await;
}
