//! The upgrade to payloads as bytes: rows written before it publish the bytes they would
//! have published before it, and (PostgreSQL, MariaDB) a writer of the previous version,
//! still running during a rolling upgrade, keeps working, its rows published the same way.
//! SQLite rebuilds its table: every row survives with its `seq`, and no `seq` is used twice.

use std::time::Duration;

use outbox_core::migrate::{Migration, SQLITE};
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::sqlx::{self, Executor as _, MySql, Sqlite};
use outbox_core::{Outbox, OutboxMessage};
use outbox_tests::backends::{drop_mysql_database, mysql_database, mysql_url};
use outbox_tests::{TestDb, trusted_sql, wait_until};

const WAIT: Duration = Duration::from_secs(30);

/// JSON as a producer wrote it: spaces, key order, an escaped character.
const OLD_JSON: &str = r#"{"b": 2,  "a": "\u00e9"}"#;

/// Runs `migrations` on `pool` as the runner of the previous version would have, and
/// records them as applied.
async fn apply_sqlite(pool: &sqlx::SqlitePool, migrations: &[Migration]) {
    let tables = outbox_core::Tables::default();
    pool.execute(
        "CREATE TABLE outbox_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
         checksum INTEGER NOT NULL, applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))",
    )
    .await
    .expect("the migrations table");
    for m in migrations {
        let sql = m.render(&tables, |t| t.quoted());
        for statement in sql.split(";\n").filter(|s| {
            s.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--"))
        }) {
            pool.execute(trusted_sql(statement))
                .await
                .unwrap_or_else(|e| panic!("migration {}: {e}\n{statement}", m.version));
        }
        sqlx::query(
            "INSERT INTO outbox_migrations (version, description, checksum) VALUES (?, ?, ?)",
        )
        .bind(m.version)
        .bind(m.description)
        .bind(m.checksum())
        .execute(pool)
        .await
        .expect("record the migration");
    }
}

/// The relay's view of the pending rows: (id, payload bytes, content type), in order.
async fn publish_all<DB: outbox_core::Backend>(
    outbox: &Outbox<DB>,
    n: usize,
) -> Vec<outbox_core::OutboxRecord> {
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    wait_until("the relay published every pending row", WAIT, || async {
        publisher.published_count() >= n
    })
    .await;
    relay.shutdown().await;
    publisher.published()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rebuilds_its_table_keeping_rows_bytes_and_the_sequence() {
    let path = std::env::temp_dir().join(format!("outbox-upgrade-{}.db", uuid::Uuid::now_v7()));
    let url = path.to_str().expect("utf-8 path").to_owned();
    let outbox = Outbox::<Sqlite>::open(&url).await.expect("open");
    let pool = outbox.pool().clone();
    let before = SQLITE
        .iter()
        .filter(|m| m.version < 4)
        .copied()
        .collect::<Vec<_>>();
    apply_sqlite(&pool, &before).await;
    // Rows of the previous version: two pending, one sent, and a fourth that retention
    // deleted (so the table's highest `seq` is below the counter's).
    for (n, sent) in [(1, false), (2, true), (3, false), (4, false)] {
        sqlx::query(
            "INSERT INTO outbox (id, event_type, destination, partition_key, payload, sent_at) \
             VALUES (?, 'Old', 'orders', 'k', ?, CASE WHEN ? THEN '2026-01-01T00:00:00.000Z' END)",
        )
        .bind(uuid::Uuid::now_v7().to_string())
        .bind(OLD_JSON.replace("2", &n.to_string()))
        .bind(sent)
        .execute(&pool)
        .await
        .expect("an old row");
    }
    pool.execute("DELETE FROM outbox WHERE seq = 4")
        .await
        .expect("retention");

    assert_eq!(outbox.migrate().await.expect("migrate"), vec![4]);

    let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM outbox ORDER BY seq")
        .fetch_all(&pool)
        .await
        .expect("seqs");
    assert_eq!(seqs, [1, 2, 3], "every row, with its seq");
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'outbox' \
         AND name NOT LIKE 'sqlite_autoindex%' ORDER BY name",
    )
    .fetch_all(&pool)
    .await
    .expect("indexes");
    assert_eq!(
        indexes,
        [
            "outbox_dead_idx",
            "outbox_dead_key_idx",
            "outbox_pending_idx",
            "outbox_retrying_idx"
        ]
    );

    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(
        OutboxMessage::new("New", "orders", vec![0xff, 0x00, 0x7b])
            .with_content_type("application/octet-stream")
            .with_key("k"),
    )
    .expect("emit");
    tx.commit().await.expect("commit");
    let new_seq: i64 = sqlx::query_scalar("SELECT max(seq) FROM outbox")
        .fetch_one(&pool)
        .await
        .expect("seq");
    assert_eq!(
        new_seq, 5,
        "the AUTOINCREMENT counter carried over: 4 is never reused"
    );

    let published = publish_all(&outbox, 3).await;
    let shown: Vec<(i64, Vec<u8>, String)> = published
        .iter()
        .map(|r| (r.seq, r.payload.to_vec(), r.content_type.to_string()))
        .collect();
    assert_eq!(
        shown,
        [
            (
                1,
                OLD_JSON.replace("2", "1").into_bytes(),
                "application/json".to_owned()
            ),
            (
                3,
                OLD_JSON.replace("2", "3").into_bytes(),
                "application/json".to_owned()
            ),
            (
                5,
                vec![0xff, 0x00, 0x7b],
                "application/octet-stream".to_owned()
            ),
        ]
    );
    drop(outbox);
    pool.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{url}{suffix}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_publishes_a_previous_writers_rows_as_it_did() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    // A writer of the previous version, during a rolling upgrade: `payload` jsonb only.
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, partition_key, payload, headers) \
         VALUES ($1, 'Old', 'orders', 'k', $2::jsonb, '{}')",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(OLD_JSON)
    .execute(&db.pool)
    .await
    .expect("a previous version's INSERT still works");
    // What the previous relay published: jsonb's rendering of it.
    let before: String = sqlx::query_scalar("SELECT payload::text FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("the rendering");
    assert_ne!(before, OLD_JSON, "jsonb re-renders (the reason for bytes)");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("New", "orders", OLD_JSON).with_key("k"))
        .expect("emit");
    tx.commit().await.expect("commit");

    let published = publish_all(&outbox, 2).await;
    assert_eq!(
        published[0].payload, before,
        "the old row: the bytes it had before"
    );
    assert_eq!(published[0].content_type, "application/json");
    assert_eq!(
        published[1].payload, OLD_JSON,
        "the new row: the bytes emitted"
    );
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_publishes_a_previous_writers_rows_as_it_did() {
    let database = mysql_database("upgrade").await;
    let url = mysql_url();
    let url = format!(
        "{}/{database}",
        url.rsplit_once('/').expect("a database in the URL").0
    );
    let outbox = Outbox::<MySql>::connect_mysql(&url).await.expect("connect");
    outbox.migrate().await.expect("migrate");
    let pool = outbox.pool().clone();
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, partition_key, payload, headers) \
         VALUES (?, 'Old', 'orders', 'k', ?, '{}')",
    )
    .bind(uuid::Uuid::now_v7().to_string())
    .bind(OLD_JSON)
    .execute(&pool)
    .await
    .expect("a previous version's INSERT still works");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(
        OutboxMessage::new("New", "orders", vec![0x80, 0x81])
            .with_content_type("application/octet-stream")
            .with_key("k"),
    )
    .expect("emit");
    tx.commit().await.expect("commit");

    let published = publish_all(&outbox, 2).await;
    assert_eq!(
        published[0].payload, OLD_JSON,
        "the old row: its JSON text, as before"
    );
    assert_eq!(published[0].content_type, "application/json");
    assert_eq!(published[1].payload, vec![0x80, 0x81]);
    drop(outbox);
    pool.close().await;
    drop_mysql_database(&database).await;
}
