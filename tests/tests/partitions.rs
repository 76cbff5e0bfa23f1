//! The time-partitioned outbox (PostgreSQL, docs/partitions.md): the conversion from a
//! plain table, a relay across it, and retention by partition.

use std::time::Duration;

use outbox_core::postgres::PartitionInterval;
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::retention::Retention;
use outbox_core::{Outbox, OutboxMessage, sqlx};
use outbox_tests::trusted_sql;
use outbox_tests::{TestDb, wait_until};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A UUIDv7 of `ts` (an SQL timestamptz expression), random in its other bits (a new
/// value on every row).
fn v7_at(ts: &str) -> String {
    let h = format!("lpad(to_hex((extract(epoch FROM {ts}) * 1000)::bigint), 12, '0')");
    let r = "md5(random()::text)";
    format!(
        "(substr({h}, 1, 8) || '-' || substr({h}, 9, 4) || '-7' || substr({r}, 1, 3) || '-8' \
          || substr({r}, 1, 3) || '-' || substr({r}, 1, 12))::uuid"
    )
}

/// Inserts `n` rows created `days_ago` days ago with UUIDv7 ids of that time, in `state`
/// ("sent", "pending" or "dead").
async fn rows(db: &TestDb, n: i64, days_ago: i64, state: &str) {
    let ts = format!("(now() - interval '{days_ago} days')");
    let (sent_at, dead_at) = match state {
        "sent" => (ts.as_str(), "NULL"),
        "pending" => ("NULL", "NULL"),
        _ => ("NULL", ts.as_str()),
    };
    sqlx::query(trusted_sql(format!(
        "INSERT INTO outbox (id, event_type, destination, partition_key, payload, created_at, sent_at, dead_at) \
         SELECT {id}, 'Old', 'history', 'k' || (i % 7), jsonb_build_object('i', i, 'days_ago', {days_ago}), \
                {ts}, {sent_at}, {dead_at} \
         FROM generate_series(1, $1) AS i",
        id = v7_at(&ts)
    )))
    .bind(n)
    .execute(&db.pool)
    .await
    .expect("insert history rows");
}

/// A digest of every row, in `seq` order.
async fn digest(db: &TestDb) -> (i64, String) {
    sqlx::query_as(
        "SELECT count(*), coalesce(md5(string_agg(row_to_json(t)::text, ',' ORDER BY seq)), '') FROM outbox t",
    )
    .fetch_one(&db.pool)
    .await
    .expect("digest the outbox")
}

/// The outbox's partitions, by name.
async fn partitions(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox'::regclass ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("list partitions")
}

/// The partition name of the day `days_ago` days ago.
async fn day(db: &TestDb, days_ago: i64) -> String {
    sqlx::query_scalar(trusted_sql(format!(
        "SELECT 'outbox_p' || to_char((now() - interval '{days_ago} days') AT TIME ZONE 'UTC', 'YYYYMMDD')"
    )))
    .fetch_one(&db.pool)
    .await
    .expect("a day's name")
}

/// Waits until the relay has marked every pending row sent.
async fn marked(db: &TestDb) {
    wait_until(
        "the relay marks its rows sent",
        Duration::from_secs(10),
        || {
            let pool = db.pool.clone();
            async move {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND dead_at IS NULL",
                )
                .fetch_one(&pool)
                .await
                .expect("count pending");
                left == 0
            }
        },
    )
    .await;
}

async fn emit(outbox: &Outbox, key: &str, n: i32) -> uuid::Uuid {
    let mut tx = outbox.begin().await.expect("begin");
    let id = tx
        .emit_message(
            OutboxMessage::new("Counted", "counts", format!(r#"{{"n":{n}}}"#)).with_key(key),
        )
        .expect("emit");
    tx.commit().await.expect("commit");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_outbox_converts_with_every_row_and_its_relay_carries_on() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    rows(&db, 300, 10, "sent").await;
    rows(&db, 200, 2, "sent").await;
    rows(&db, 3, 2, "dead").await;
    // A message id that is not a UUIDv7: it goes to the default partition.
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload, sent_at) \
         VALUES (gen_random_uuid(), 'V4', 'history', '{}', now())",
    )
    .execute(&db.pool)
    .await
    .expect("a v4 id");

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    let first = emit(&outbox, "a", 1).await;
    assert!(publisher.wait_for(1, Duration::from_secs(10)).await);
    marked(&db).await;
    // Held back until after the conversion: the relay must find them on the new table.
    let mut pending = Vec::new();
    let before = digest(&db).await;

    let done = outbox
        .partition_by_time(PartitionInterval::Daily)
        .await
        .expect("partition the outbox");
    assert_eq!(done.rows_copied, before.0 as u64, "{done:?}");
    assert!(
        done.relays_disconnected >= 1,
        "the running relay was disconnected to register on the new table: {done:?}"
    );
    assert_eq!(
        digest(&db).await,
        before,
        "every row, unchanged, in seq order"
    );
    let names = partitions(&db).await;
    for days_ago in [10, 2, 0, -3] {
        let name = day(&db, days_ago).await;
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    assert!(names.contains(&"outbox_default".to_owned()), "{names:?}");
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_default")
        .fetch_one(&db.pool)
        .await
        .expect("count the default partition");
    assert_eq!(in_default, 1, "the v4 id is in the default partition");

    // The relay registers again on the new table and publishes in key order.
    for n in 2..=6 {
        pending.push(emit(&outbox, "a", n).await);
    }
    assert!(
        publisher.wait_for(6, Duration::from_secs(20)).await,
        "the relay publishes what was committed after the conversion: {} published",
        publisher.published_count()
    );
    let ids: Vec<uuid::Uuid> = publisher.published().iter().map(|r| r.id).collect();
    assert_eq!(ids[0], first);
    assert_eq!(ids[1..], pending[..], "key a in commit order");
    marked(&db).await;
    // Ids stay unique across partitions, and seq goes on from where it was.
    let dup = sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload) VALUES ($1, 'Dup', 'x', '{}')",
    )
    .bind(first)
    .execute(&db.pool)
    .await
    .expect_err("a second row with an existing id");
    assert_eq!(
        dup.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("23505"),
        "a unique violation: {dup}"
    );
    let (old_max, new_min): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT max(seq) FROM outbox WHERE id <> ALL($1)), \
                (SELECT min(seq) FROM outbox WHERE id = ANY($1))",
    )
    .bind(&pending)
    .fetch_one(&db.pool)
    .await
    .expect("seq ranges");
    assert!(
        new_min > old_max,
        "seq continues: {new_min} after {old_max}"
    );

    // The operations tooling reads a partitioned outbox as a plain one.
    let status = outbox_core::admin::Admin::new(outbox.clone())
        .status()
        .await
        .expect("status of a partitioned outbox");
    assert_eq!(status.dead, 3, "{status:?}");
    let report = outbox_core::doctor::Doctor::new(outbox.clone())
        .examine()
        .await
        .expect("doctor on a partitioned outbox");
    assert!(
        !report.of("dead-letters").is_empty(),
        "doctor finds the dead letters: {:#?}",
        report.findings
    );

    // Again: nothing to do. Another interval: refused, with the reason.
    let again = outbox
        .partition_by_time(PartitionInterval::Daily)
        .await
        .expect("a second conversion is a no-op");
    assert_eq!(again.rows_copied, 0);
    let other = outbox
        .partition_by_time(PartitionInterval::Hourly)
        .await
        .expect_err("another interval");
    assert!(
        other.to_string().contains("already partitioned by the day"),
        "{other}"
    );
    relay.shutdown().await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_old_partitions_whole_and_keeps_those_with_pending_or_dead_rows() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    rows(&db, 500, 12, "sent").await; // dropped whole
    rows(&db, 100, 11, "sent").await;
    rows(&db, 1, 11, "pending").await; // keeps day -11
    rows(&db, 100, 10, "sent").await;
    rows(&db, 1, 10, "dead").await; // keeps day -10
    rows(&db, 100, 2, "sent").await; // recent: stays
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload, created_at, sent_at) \
         VALUES (gen_random_uuid(), 'V4', 'history', '{}', now() - interval '12 days', now() - interval '12 days')",
    )
    .execute(&db.pool)
    .await
    .expect("a v4 id sent long ago");
    outbox
        .partition_by_time(PartitionInterval::Daily)
        .await
        .expect("partition the outbox");
    let (d12, d11, d10, d2) = (
        day(&db, 12).await,
        day(&db, 11).await,
        day(&db, 10).await,
        day(&db, 2).await,
    );

    let report = Retention::builder(outbox.clone())
        .sent_older_than(7 * DAY)
        .build()
        .run_once()
        .await
        .expect("retention");
    let parts = report.partitions.clone().expect("a partition report");
    assert!(parts.dropped.iter().any(|p| p.ends_with(&d12)), "{parts:?}");
    assert!(parts.kept.iter().any(|p| p.ends_with(&d11)), "{parts:?}");
    assert!(parts.kept.iter().any(|p| p.ends_with(&d10)), "{parts:?}");
    let names = partitions(&db).await;
    assert!(!names.contains(&d12), "{names:?}");
    assert!(names.contains(&d11) && names.contains(&d10) && names.contains(&d2));
    // The kept partitions lost their sent rows one by one; the pending and dead rows,
    // the recent ones and nothing else remain. The v4 row went from the default
    // partition.
    let count = |table: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(trusted_sql(format!("SELECT count(*) FROM \"{table}\"")))
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    assert_eq!(
        count(d11.clone()).await,
        1,
        "day -11 keeps its pending row only"
    );
    assert_eq!(
        count(d10.clone()).await,
        1,
        "day -10 keeps its dead row only"
    );
    assert_eq!(count(d2.clone()).await, 100, "day -2 is within retention");
    assert_eq!(count("outbox_default".to_owned()).await, 0);
    assert_eq!(
        report.sent_deleted,
        100 + 100 + 1,
        "row by row: the kept partitions' sent rows and the default partition's; {report}"
    );

    // Once its pending row is sent, day -11 goes whole at the next run.
    sqlx::query(trusted_sql(format!(
        "UPDATE \"{d11}\" SET sent_at = now() - interval '11 days'"
    )))
    .execute(&db.pool)
    .await
    .expect("send the pending row");
    let report = Retention::builder(outbox.clone())
        .sent_older_than(7 * DAY)
        .build()
        .run_once()
        .await
        .expect("retention");
    let parts = report.partitions.expect("a partition report");
    assert!(parts.dropped.iter().any(|p| p.ends_with(&d11)), "{parts:?}");
    assert!(parts.kept.iter().any(|p| p.ends_with(&d10)), "{parts:?}");
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_added_late_takes_its_rows_from_the_default_partition() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    outbox
        .partition_by_time(PartitionInterval::Daily)
        .await
        .expect("partition the empty outbox");
    // The day after tomorrow's partition is missing (say retention did not run): its
    // rows land in the default partition, and no write fails.
    let later = day(&db, -2).await;
    sqlx::query(trusted_sql(format!("DROP TABLE \"{later}\"")))
        .execute(&db.pool)
        .await
        .expect("drop a partition ahead");
    sqlx::query(trusted_sql(format!(
        "INSERT INTO outbox (id, event_type, destination, payload) \
         VALUES ({}, 'Later', 'x', '{{}}')",
        v7_at("(now() + interval '2 days')")
    )))
    .execute(&db.pool)
    .await
    .expect("a row of the missing day");
    let report = Retention::builder(outbox.clone())
        .keep_sent()
        .build()
        .run_once()
        .await
        .expect("retention");
    let parts = report.partitions.expect("a partition report");
    assert!(
        parts.created.iter().any(|p| p.ends_with(&later)),
        "{parts:?}"
    );
    assert_eq!(parts.moved_from_default, 1, "{parts:?}");
    let home: String = sqlx::query_scalar(
        "SELECT tableoid::regclass::text FROM outbox WHERE event_type = 'Later'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("where the row is");
    assert!(home.ends_with(&later), "{home}");
    db.cleanup().await;
}

/// The indexes of an outbox table, as `USING ...` clauses (names and uniqueness aside).
async fn indexes(db: &TestDb, table: &str) -> std::collections::BTreeSet<String> {
    sqlx::query_scalar::<_, String>(
        "SELECT regexp_replace(pg_get_indexdef(indexrelid), '^.* USING ', '') \
         FROM pg_index WHERE indrelid = $1::regclass",
    )
    .bind(table)
    .fetch_all(&db.pool)
    .await
    .expect("list indexes")
    .into_iter()
    .collect()
}

#[tokio::test]
async fn a_partitioned_outbox_has_the_indexes_of_a_plain_one() {
    // A migration that adds an index to the plain table must add it here too: this
    // fails until the conversion creates it.
    let db = TestDb::new().await;
    let plain = db.outbox().await;
    let partitioned = Outbox::builder(db.pool.clone())
        .table("split")
        .build()
        .expect("a second outbox");
    partitioned.migrate().await.expect("migrate");
    partitioned
        .partition_by_time(PartitionInterval::Hourly)
        .await
        .expect("partition it");
    assert_eq!(
        indexes(&db, "split").await,
        indexes(&db, &plain.tables().outbox.quoted()).await
    );
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_parsed_while_the_table_is_replaced_locks_under_the_new_table() {
    // The conversion replaces the table while writers wait for it. A writer that parsed
    // its statement meanwhile must take the writer lock under the new table's oid, which
    // the relays watch once they reconnect; under the old one they would publish past
    // its uncommitted rows.
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut swap = db.connect().await;
    use sqlx::Connection as _;
    let mut swapping = swap.begin().await.expect("begin");
    sqlx::query("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *swapping)
        .await
        .expect("lock the table");
    let writer = {
        let outbox = outbox.clone();
        tokio::spawn(async move {
            let mut tx = outbox.begin().await.expect("begin");
            tx.emit_message(OutboxMessage::new("Late", "x", "{}").with_key("k"))
                .expect("emit");
            tx.flush().await.expect("flush: waits for the table");
            tx
        })
    };
    // The writer has parsed its statement and waits for the table.
    wait_until(
        "the writer waits for the table",
        Duration::from_secs(10),
        || {
            let pool = db.pool.clone();
            async move {
                let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'outbox'::regclass",
            )
            .fetch_one(&pool)
            .await
            .expect("waiting locks");
                waiting > 0
            }
        },
    )
    .await;
    for step in [
        "ALTER TABLE outbox RENAME TO outbox_before",
        "CREATE TABLE outbox (LIKE outbox_before INCLUDING ALL)",
    ] {
        sqlx::query(trusted_sql(step))
            .execute(&mut *swapping)
            .await
            .expect("replace the table");
    }
    swapping.commit().await.expect("commit the swap");
    let tx = writer.await.expect("the writer");
    let (old, new): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE classid = 'outbox_before'::regclass), \
                count(*) FILTER (WHERE classid = 'outbox'::regclass) \
         FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND objid = 0",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the writer locks");
    assert_eq!((old, new), (0, 1), "the writer lock is the new table's");
    tx.rollback().await.expect("rollback");
    db.cleanup().await;
}
