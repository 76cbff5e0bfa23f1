//! The PostgreSQL write path: what `OutboxTx::commit` writes, and what it must not.

use std::collections::{BTreeMap, HashMap};

use outbox_core::sqlx::{self, Row};
use outbox_core::{Destination, Error, Outbox, OutboxEvent, OutboxMessage, OutboxTx};
use outbox_tests::TestDb;
use outbox_tests::trusted_sql;
use serde::Serialize;
use uuid::Uuid;

const ORDERS: Destination = Destination::new("orders.events");

#[derive(Debug, Serialize)]
struct OrderConfirmed {
    order_id: i64,
    customer: String,
}

impl OutboxEvent for OrderConfirmed {
    fn event_type(&self) -> &'static str {
        "OrderConfirmed"
    }
    fn destination(&self) -> Destination {
        ORDERS
    }
    fn partition_key(&self) -> Option<String> {
        Some(self.order_id.to_string())
    }
    fn version(&self) -> Option<i32> {
        Some(2)
    }
}

#[derive(Debug, Serialize)]
struct Heartbeat {}

impl OutboxEvent for Heartbeat {
    fn event_type(&self) -> &'static str {
        "Heartbeat"
    }
    fn destination(&self) -> Destination {
        Destination::new("health")
    }
}

/// Serializing this fails: JSON object keys must be strings.
#[derive(Debug, Serialize)]
struct Unserializable {
    by_pair: HashMap<(i32, i32), i32>,
}

impl OutboxEvent for Unserializable {
    fn event_type(&self) -> &'static str {
        "Unserializable"
    }
    fn destination(&self) -> Destination {
        ORDERS
    }
}

async fn orders_table(db: &TestDb) {
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create orders");
    sqlx::query("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 10) g")
        .execute(&db.pool)
        .await
        .expect("seed orders");
}

async fn confirm(tx: &mut OutboxTx<'_>, order_id: i64) {
    sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = $1")
        .bind(order_id)
        .execute(&mut **tx)
        .await
        .expect("update order");
}

async fn status(db: &TestDb, order_id: i64) -> String {
    sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(&db.pool)
        .await
        .expect("read status")
}

#[tokio::test]
async fn commit_writes_exactly_the_emitted_rows() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;

    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 7).await;
    let id1 = tx
        .emit(OrderConfirmed {
            order_id: 7,
            customer: "ada".into(),
        })
        .expect("emit");
    let id2 = tx.emit(&Heartbeat {}).expect("emit by reference");
    let id3 = tx
        .emit_message(
            OutboxMessage::new("Raw", "raw.topic", r#"{"a": [1, 2]}"#)
                .with_key("k")
                .with_header(
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                ),
        )
        .expect("emit message");
    assert_eq!(tx.pending().len(), 3);
    tx.commit().await.expect("commit");

    assert_eq!(status(&db, 7).await, "confirmed");
    let rows = sqlx::query(
        "SELECT seq, id, event_type, event_version, destination, partition_key, \
                convert_from(body, 'UTF8')::jsonb AS payload, body, content_type, headers, \
                created_at, sent_at, attempts, next_attempt_at, last_error, dead_at, \
                xact_id IS NULL AS no_xact_id, now() - created_at < interval '1 minute' AS recent \
         FROM outbox ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read outbox");
    assert_eq!(rows.len(), 3, "exactly the emitted rows");

    let ids: Vec<Uuid> = rows.iter().map(|r| r.get("id")).collect();
    assert_eq!(ids, vec![id1, id2, id3], "rows in emit order");
    assert_eq!(id1.get_version_num(), 7, "message ids are UUIDv7");
    let seqs: Vec<i64> = rows.iter().map(|r| r.get("seq")).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "seq increases in emit order: {seqs:?}"
    );
    // One writing transaction: `created_at` is its start (`now()`), the same for all.
    let created: Vec<chrono::DateTime<chrono::Utc>> =
        rows.iter().map(|r| r.get("created_at")).collect();
    assert!(
        created.iter().all(|c| c == &created[0]),
        "one writing transaction: {created:?}"
    );
    assert!(
        rows.iter().all(|r| r.get::<bool, _>("no_xact_id")),
        "xact_id is no longer written"
    );

    let r = &rows[0];
    assert_eq!(r.get::<String, _>("event_type"), "OrderConfirmed");
    assert_eq!(r.get::<Option<i32>, _>("event_version"), Some(2));
    assert_eq!(r.get::<String, _>("destination"), "orders.events");
    assert_eq!(
        r.get::<Option<String>, _>("partition_key").as_deref(),
        Some("7")
    );
    assert_eq!(
        r.get::<serde_json::Value, _>("payload"),
        serde_json::json!({"order_id": 7, "customer": "ada"})
    );
    assert_eq!(r.get::<String, _>("content_type"), "application/json");
    assert_eq!(
        r.get::<Vec<u8>, _>("body"),
        br#"{"order_id":7,"customer":"ada"}"#,
        "the bytes serde wrote, as they were written"
    );
    assert_eq!(
        r.get::<serde_json::Value, _>("headers"),
        serde_json::json!({})
    );
    assert!(
        r.get::<bool, _>("recent"),
        "created_at is set to the commit's time"
    );
    for r in &rows {
        assert!(
            r.get::<Option<chrono::DateTime<chrono::Utc>>, _>("sent_at")
                .is_none()
        );
        assert!(
            r.get::<Option<chrono::DateTime<chrono::Utc>>, _>("next_attempt_at")
                .is_none()
        );
        assert!(
            r.get::<Option<chrono::DateTime<chrono::Utc>>, _>("dead_at")
                .is_none()
        );
        assert!(r.get::<Option<String>, _>("last_error").is_none());
        assert_eq!(r.get::<i32, _>("attempts"), 0);
    }

    let r = &rows[1];
    assert_eq!(r.get::<String, _>("event_type"), "Heartbeat");
    assert_eq!(r.get::<Option<String>, _>("partition_key"), None);
    assert_eq!(r.get::<Option<i32>, _>("event_version"), None);
    assert_eq!(
        r.get::<serde_json::Value, _>("payload"),
        serde_json::json!({})
    );

    let r = &rows[2];
    assert_eq!(r.get::<String, _>("destination"), "raw.topic");
    assert_eq!(
        r.get::<Option<String>, _>("partition_key").as_deref(),
        Some("k")
    );
    assert_eq!(
        r.get::<serde_json::Value, _>("payload"),
        serde_json::json!({"a": [1, 2]})
    );
    assert_eq!(
        r.get::<serde_json::Value, _>("headers"),
        serde_json::json!({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    );
    db.cleanup().await;
}

#[tokio::test]
async fn rollback_drop_and_error_write_nothing() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;

    // Explicit rollback.
    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 1).await;
    tx.emit(OrderConfirmed {
        order_id: 1,
        customer: "a".into(),
    })
    .expect("emit");
    tx.flush()
        .await
        .expect("flush writes inside the transaction");
    tx.rollback().await.expect("rollback");

    // Dropped without commit (an early return, a cancelled future).
    {
        let mut tx = outbox.begin().await.expect("begin");
        confirm(&mut tx, 2).await;
        tx.emit(OrderConfirmed {
            order_id: 2,
            customer: "b".into(),
        })
        .expect("emit");
        tx.flush().await.expect("flush");
    }

    // An `Err` in the middle of a service function, propagated with `?`.
    async fn service(outbox: &Outbox, order_id: i64) -> Result<(), Error> {
        let mut tx = outbox.begin().await?;
        confirm(&mut tx, order_id).await;
        tx.emit(OrderConfirmed {
            order_id,
            customer: "c".into(),
        })?;
        tx.emit(Unserializable {
            by_pair: HashMap::from([((1, 2), 3)]),
        })?;
        tx.commit().await
    }
    let err = service(&outbox, 3).await.expect_err("serialization fails");
    assert!(matches!(err, Error::Serialize { .. }), "{err:?}");

    assert_eq!(db.count("outbox").await, 0, "no event survives a rollback");
    for id in 1..=3 {
        assert_eq!(
            status(&db, id).await,
            "new",
            "order {id}'s change is undone too"
        );
    }
    db.cleanup().await;
}

#[tokio::test]
async fn a_serialization_error_leaves_the_transaction_usable() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;

    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 4).await;
    let err = tx
        .emit(Unserializable {
            by_pair: HashMap::from([((1, 2), 3)]),
        })
        .expect_err("cannot serialize");
    let msg = err.to_string();
    assert!(
        msg.contains("`Unserializable`") && msg.contains("Serialize"),
        "{msg}"
    );
    assert!(tx.pending().is_empty(), "the failed event is not collected");
    tx.emit(OrderConfirmed {
        order_id: 4,
        customer: "d".into(),
    })
    .expect("emit");
    tx.commit().await.expect("commit without the bad event");
    assert_eq!(db.count("outbox").await, 1);
    assert_eq!(status(&db, 4).await, "confirmed");
    db.cleanup().await;
}

#[tokio::test]
async fn a_thousand_events_are_written_by_one_statement() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;

    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 5).await;
    for i in 0..1000 {
        tx.emit(OrderConfirmed {
            order_id: i,
            customer: format!("c{i}"),
        })
        .expect("emit");
    }
    tx.commit().await.expect("commit");

    // Every SQL statement in a transaction gets its own command id, stored in each row it
    // inserts as `cmin`: one distinct value means one INSERT wrote all 1,000 rows.
    let (rows, commands, keys_in_order): (i64, i64, bool) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT cmin::text::int), \
                bool_and(partition_key::int = rn - 1) \
         FROM (SELECT cmin, partition_key, row_number() OVER (ORDER BY seq) AS rn FROM outbox) s",
    )
    .fetch_one(&db.pool)
    .await
    .expect("inspect rows");
    assert_eq!(rows, 1000);
    assert_eq!(commands, 1, "all rows come from one statement");
    assert!(keys_in_order, "seq follows emit order");
    db.cleanup().await;
}

#[tokio::test]
async fn enqueue_joins_a_transaction_the_caller_owns() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;

    let mut tx = db.pool.begin().await.expect("begin");
    sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = 6")
        .execute(&mut *tx)
        .await
        .expect("update");
    let events = vec![
        OrderConfirmed {
            order_id: 6,
            customer: "e".into(),
        },
        OrderConfirmed {
            order_id: 6,
            customer: "f".into(),
        },
    ];
    let ids = outbox.enqueue(&mut tx, &events).await.expect("enqueue");
    assert_eq!(ids.len(), 2);
    let visible_outside: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(visible_outside, 0, "not visible before commit");
    tx.commit().await.expect("commit");
    let stored: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .expect("ids");
    assert_eq!(stored, ids);

    // A bad hand-built message is refused before anything is written.
    let mut tx = db.pool.begin().await.expect("begin");
    let err = outbox
        .enqueue_messages(&mut tx, &[OutboxMessage::new("T", "d", "not json")])
        .await
        .expect_err("payload is not JSON");
    assert!(err.to_string().contains("not JSON"), "{err}");
    let err = outbox
        .enqueue_messages(&mut tx, &[OutboxMessage::new("T", " ", "{}")])
        .await
        .expect_err("empty destination");
    assert!(err.to_string().contains("empty destination"), "{err}");
    tx.rollback().await.expect("rollback");
    db.cleanup().await;
}

/// Notifications received until the marker (`NOTIFY channel, 'marker'` sent from another
/// session): how many were empty (a commit's wake-up). Notifications arrive in commit
/// order, so the marker sent last delimits what the commits before it sent, with no
/// sleep before a negative assertion.
async fn wake_ups_before_marker(
    db: &TestDb,
    listener: &mut sqlx::postgres::PgListener,
    channel: &str,
) -> usize {
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(channel)
        .execute(&db.pool)
        .await
        .expect("marker");
    let mut wake_ups = 0;
    loop {
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), listener.recv())
            .await
            .expect("the marker arrives within 10 s")
            .expect("notification");
        if n.payload() == "marker" {
            return wake_ups;
        }
        assert_eq!(n.payload(), "", "a commit's wake-up is empty");
        wake_ups += 1;
    }
}

/// A `NOTIFY` takes an instance-wide lock through the commit, so notifying commits queue
/// one behind another. Commits therefore notify only while a relay waits idle (holding
/// the outbox's idle lock); a busy relay finds the rows by itself. Failed on main, where
/// every emitting commit notified.
#[tokio::test]
async fn commits_notify_only_while_a_relay_waits_idle() {
    // Every step below is bounded; this bounds the whole, so that a hang names the test.
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        commits_notify_only_while_a_relay_waits_idle_steps(),
    )
    .await
    .expect("the test finishes within 60 s");
}

async fn commits_notify_only_while_a_relay_waits_idle_steps() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let channel = outbox.notify_channel().await.expect("channel");
    // The listener on a connection of its own, outside the pool the writers use.
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.listen_pool())
        .await
        .expect("listener");
    listener.listen(&channel).await.expect("listen");

    // A relay waits idle: a commit wakes it, at commit and not before.
    let mut idle = outbox_tests::IdleRelay::hold(&db, &outbox).await;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(Heartbeat {}).expect("emit");
    tx.flush().await.expect("flush");
    assert_eq!(
        wake_ups_before_marker(&db, &mut listener, &channel).await,
        0,
        "nothing is delivered before the commit"
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        wake_ups_before_marker(&db, &mut listener, &channel).await,
        1
    );

    // A rolled-back transaction wakes nobody.
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(Heartbeat {}).expect("emit");
    tx.flush().await.expect("flush");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        wake_ups_before_marker(&db, &mut listener, &channel).await,
        0
    );

    // The relay is busy: no commit notifies, whichever way it commits.
    idle.release().await;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(Heartbeat {}).expect("emit");
    tx.commit().await.expect("commit in one round trip");
    let mut tx = OutboxTx::from_transaction(db.pool.begin().await.expect("begin"), &outbox);
    tx.emit(Heartbeat {}).expect("emit");
    tx.commit()
        .await
        .expect("commit a transaction of the caller's");
    assert_eq!(
        wake_ups_before_marker(&db, &mut listener, &channel).await,
        0
    );

    // Written while the relay was busy, committed after it went idle: the commit wakes it
    // (the relay saw the writer in flight, but a rows-less commit would leave it waiting).
    for own in [true, false] {
        idle.release().await;
        let mut tx = if own {
            outbox.begin().await.expect("begin")
        } else {
            OutboxTx::from_transaction(db.pool.begin().await.expect("begin"), &outbox)
        };
        tx.emit(Heartbeat {}).expect("emit");
        tx.flush().await.expect("flush");
        idle.take().await;
        tx.commit().await.expect("commit");
        assert_eq!(
            wake_ups_before_marker(&db, &mut listener, &channel).await,
            1,
            "flushed while busy, committed while idle (own transaction: {own})"
        );
    }
    // Before the pool closes: a pool waits for its connections to come back.
    drop(listener);
    drop(idle);
    db.cleanup().await;
}

#[tokio::test]
async fn custom_schema_qualified_tables() {
    let db = TestDb::new().await;
    let table = format!("{}_custom.events", db.schema);
    let outbox = Outbox::builder(db.pool.clone())
        .table(table.clone())
        .build()
        .expect("valid names");
    assert_eq!(
        outbox.migrate().await.expect("migrate"),
        vec![1, 2, 3, 4, 5, 6]
    );
    assert!(
        outbox.migrate().await.expect("migrate again").is_empty(),
        "second run is a no-op"
    );

    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(Heartbeat {}).expect("emit");
    tx.commit().await.expect("commit");
    let n: i64 = sqlx::query_scalar(trusted_sql(format!(
        "SELECT count(*) FROM \"{}_custom\".events",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .expect("count");
    assert_eq!(n, 1);
    let processed: i64 = sqlx::query_scalar(trusted_sql(format!(
        "SELECT count(*) FROM \"{}_custom\".events_processed",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .expect("processed table exists");
    assert_eq!(processed, 0);
    sqlx::query(trusted_sql(format!(
        "DROP SCHEMA \"{}_custom\" CASCADE",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .expect("drop");
    db.cleanup().await;
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_to_race() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    let runs = futures_join_all((0..4).map(|_| {
        let outbox = outbox.clone();
        tokio::spawn(async move { outbox.migrate().await })
    }))
    .await;
    let applied: Vec<Vec<i64>> = runs
        .into_iter()
        .map(|r| r.expect("join").expect("migrate"))
        .collect();
    assert_eq!(
        applied.iter().filter(|a| !a.is_empty()).count(),
        1,
        "exactly one racer applies: {applied:?}"
    );
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM outbox_migrations ORDER BY version")
            .fetch_all(&db.pool)
            .await
            .expect("versions");
    assert_eq!(versions, vec![1, 2, 3, 4, 5, 6]);
    db.cleanup().await;
}

async fn futures_join_all<T>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await);
    }
    out
}

#[tokio::test]
async fn migration_drift_and_newer_databases_are_refused() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;

    sqlx::query("UPDATE outbox_migrations SET checksum = checksum + 1 WHERE version = 1")
        .execute(&db.pool)
        .await
        .expect("tamper");
    let err = outbox.migrate().await.expect_err("checksum differs");
    assert!(
        matches!(err, Error::Migration { version: 1, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("different SQL"), "{err}");
    sqlx::query("UPDATE outbox_migrations SET checksum = checksum - 1 WHERE version = 1")
        .execute(&db.pool)
        .await
        .expect("untamper");

    sqlx::query("INSERT INTO outbox_migrations (version, description, checksum) VALUES (999, 'from the future', 0)")
        .execute(&db.pool)
        .await
        .expect("future migration");
    let err = outbox.migrate().await.expect_err("unknown version");
    assert!(
        err.to_string().contains("newer version of outbox-core"),
        "{err}"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn missing_tables_say_to_migrate() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone()); // not migrated
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit(Heartbeat {}).expect("emit");
    let err = tx.commit().await.expect_err("no table");
    assert!(matches!(err, Error::SchemaMissing { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("outbox") && msg.contains("migrate()"), "{msg}");
    db.cleanup().await;
}

#[tokio::test]
async fn invalid_names_are_rejected_at_configuration_time() {
    let db = TestDb::new().await;
    for bad in [
        "outbox; DROP TABLE orders",
        "a.b.c",
        "9lives",
        "",
        "out-box",
    ] {
        let err = Outbox::builder(db.pool.clone())
            .table(bad)
            .build()
            .expect_err("invalid table name");
        assert!(
            matches!(err, Error::InvalidIdentifier { .. }),
            "{bad:?}: {err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("outbox table name") && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
    }
    let err = Outbox::builder(db.pool.clone())
        .processed_table("x y")
        .build()
        .expect_err("invalid processed table");
    assert!(
        err.to_string().contains("processed-messages table name"),
        "{err}"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn an_unreachable_database_is_a_clear_error() {
    // Port 1 on loopback: nothing listens there.
    let err = Outbox::connect("postgres://app:hunter2@127.0.0.1:1/app")
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("127.0.0.1:1"), "names the server: {msg}");
    assert!(
        msg.contains("server is running"),
        "says what to check: {msg}"
    );
    assert!(!msg.contains("hunter2"), "never shows the password: {msg}");

    // A pool that could connect once and then lost the server reports the same way.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_millis(500))
        .connect_lazy("postgres://app@127.0.0.1:1/app")
        .expect("lazy pool");
    let err = Outbox::new(pool).begin().await.expect_err("unreachable");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
}

#[tokio::test]
async fn headers_are_stored_as_a_json_object() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    let mut msg = OutboxMessage::new("T", "d", "[1,2,3]");
    msg.headers = BTreeMap::from([
        ("correlation-id".to_owned(), "abc".to_owned()),
        ("x".to_owned(), "\"q\"".to_owned()),
    ]);
    tx.emit_message(msg).expect("emit");
    tx.commit().await.expect("commit");
    let (headers, payload): (serde_json::Value, serde_json::Value) =
        sqlx::query_as("SELECT headers, convert_from(body, 'UTF8')::jsonb FROM outbox")
            .fetch_one(&db.pool)
            .await
            .expect("row");
    assert_eq!(
        headers,
        serde_json::json!({"correlation-id": "abc", "x": "\"q\""})
    );
    assert_eq!(payload, serde_json::json!([1, 2, 3]));
    db.cleanup().await;
}

#[tokio::test]
async fn hostile_strings_round_trip_verbatim() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    let nasty = [
        r#"'); DROP TABLE orders; --"#,
        r"back\slash \' \\' E'\x41' $$ $tag$ ",
        "unicode: ünï ☃ 日本 \u{1F600} \u{FEFF}",
        "newline\nand\ttab\r",
        "''''",
        "\\",
        "$o$ $o $o1$ ends with $o",
        "$o1",
        "$o",
    ];
    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 9).await;
    let mut expected = Vec::new();
    for (i, s) in nasty.iter().enumerate() {
        let payload = serde_json::json!({ "s": s, "i": i });
        // Destinations refuse whitespace and control characters (no broker takes them);
        // the rest of the string goes in.
        let destination: String = s
            .chars()
            .filter(|c| !c.is_whitespace() && !c.is_control())
            .collect();
        let msg = OutboxMessage::new(
            format!("Type{s}"),
            format!("dest{destination}"),
            payload.to_string(),
        )
        .with_key(*s)
        .with_header(format!("h{s}"), *s);
        expected.push((
            msg.id,
            msg.event_type.clone(),
            msg.destination.clone(),
            payload,
        ));
        tx.emit_message(msg).expect("emit");
    }
    tx.commit().await.expect("commit");
    assert_eq!(
        status(&db, 9).await,
        "confirmed",
        "the orders table is intact"
    );
    let rows: Vec<(Uuid, String, String, Option<String>, serde_json::Value, serde_json::Value)> =
        sqlx::query_as("SELECT id, event_type, destination, partition_key, convert_from(body, 'UTF8')::jsonb, headers FROM outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("rows");
    assert_eq!(rows.len(), nasty.len());
    for ((s, (id, event_type, destination, payload)), row) in nasty.iter().zip(expected).zip(rows) {
        assert_eq!(row.0, id);
        assert_eq!(row.1, event_type);
        assert_eq!(row.2, destination);
        assert_eq!(row.3.as_deref(), Some(*s));
        assert_eq!(row.4, payload);
        assert_eq!(row.5, serde_json::json!({ format!("h{s}"): s }));
    }
    db.cleanup().await;
}

#[tokio::test]
async fn a_nul_character_is_refused_at_emit_and_the_transaction_goes_on() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 8).await;
    for bad in [
        OutboxMessage::new("T", "d", "{}").with_key("a\0b"),
        OutboxMessage::new("T", "d", "{}").with_header("h", "\0"),
    ] {
        let err = tx.emit_message(bad).expect_err("NUL cannot be stored");
        assert!(matches!(err, Error::InvalidMessage(_)), "{err:?}");
        assert!(err.to_string().contains("NUL"), "{err}");
    }
    // A payload is bytes (#38): `\u0000` in JSON, refused while payloads were `jsonb`,
    // is stored as written.
    tx.emit_message(OutboxMessage::new("T", "d", r#"{"s":"a\u0000b"}"#))
        .expect("any payload bytes");
    tx.emit(Heartbeat {}).expect("a good event");
    tx.commit().await.expect("commit without the bad messages");
    assert_eq!(db.count("outbox").await, 2);
    let stored: Vec<u8> = sqlx::query_scalar("SELECT body FROM outbox ORDER BY seq LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .expect("body");
    assert_eq!(stored, br#"{"s":"a\u0000b"}"#);
    assert_eq!(status(&db, 8).await, "confirmed");
    db.cleanup().await;
}

/// `"\\u0000"` in JSON is an escaped backslash followed by the letters `u0000`, not NUL
/// (it was once refused as NUL): stored byte for byte as written.
#[tokio::test]
async fn an_escaped_backslash_before_u0000_is_not_taken_for_nul() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let payload = r#"{"s":"\\u0000"}"#;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("T", "d", payload))
        .expect("no NUL in this payload");
    tx.commit().await.expect("commit");
    let stored: Vec<u8> = sqlx::query_scalar("SELECT body FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("row");
    assert_eq!(stored, payload.as_bytes());
    db.cleanup().await;
}

/// A destination with whitespace or a control character is refused at emit, whatever the
/// broker: a CR LF in a NATS subject injected protocol commands (sent with the relay's
/// credentials), a space made the server drop the connection on every attempt.
#[tokio::test]
async fn a_destination_no_broker_takes_is_refused_at_emit() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    for bad in [
        "orders\r\nPUB orders.injected 2\r\nhi",
        "orders events",
        "orders\u{a0}x",
        "tab\t",
    ] {
        let err = tx
            .emit_message(OutboxMessage::new("T", bad, "{}"))
            .expect_err("refused");
        assert!(matches!(err, Error::InvalidMessage(_)), "{err:?}");
        assert!(
            err.to_string()
                .contains("whitespace or a control character"),
            "{err}"
        );
    }
    tx.emit_message(OutboxMessage::new("T", "orders.events", "{}"))
        .expect("a good destination");
    tx.commit().await.expect("commit");
    assert_eq!(db.count("outbox").await, 1, "only the good message");
    db.cleanup().await;
}

/// The commit sends the events as literals in one simple-protocol query. A pooled
/// connection switched to a client-only multi-byte encoding (SJIS: its second bytes
/// include `\\`) with `backslash_quote = on` broke `E'...'` literals: `ā\\'` in a key
/// (UTF-8 `C4 81 5C ...`) became SJIS `81 5C`, one character, eating the escaping
/// backslash, and the rest of the key ran as SQL. Now the literals cannot be broken
/// (dollar quoting), and a connection whose `client_encoding` is not UTF-8 is refused
/// before anything is written, on both the commit path and the bound `flush` path.
#[tokio::test]
async fn a_connection_switched_to_sjis_cannot_inject_sql_through_an_event() {
    let db = TestDb::with_max_connections(1).await;
    let outbox = db.outbox().await;
    sqlx::query("SET client_encoding = 'SJIS'")
        .execute(&db.pool)
        .await
        .expect("switch the pooled connection to SJIS");
    sqlx::query("SET backslash_quote = on")
        .execute(&db.pool)
        .await
        .expect("backslash_quote");
    // After the key's literal breaks out: finish the row and the statement, commit, and
    // run a statement of the attacker's. No quote or backslash in it (they are doubled).
    let key = "ā\\'".to_owned()
        + ", chr(123) || chr(125), chr(123) || chr(125), 0)) AS m(id, event_type, event_version, \
           destination, partition_key, payload, headers, ord) ORDER BY m.ord) SELECT 1; COMMIT; \
           BEGIN; CREATE TABLE injected (); COMMIT; BEGIN; --";
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("T", "d", "{}").with_key(key.as_str()))
        .expect("emit");
    let err = tx
        .commit()
        .await
        .expect_err("a non-UTF-8 connection is refused");
    let shown = outbox_core::ErrorChain(&err).to_string();
    assert!(shown.contains("client_encoding"), "{shown}");
    // The bound path (flush before commit) refuses it too.
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("T", "d", "{}").with_key(key.as_str()))
        .expect("emit");
    let err = tx
        .flush()
        .await
        .expect_err("a non-UTF-8 connection is refused");
    let shown = outbox_core::ErrorChain(&err).to_string();
    assert!(shown.contains("client_encoding"), "{shown}");
    drop(tx);
    let mut other = db.connect().await;
    let injected: Option<String> = sqlx::query_scalar("SELECT to_regclass('injected')::text")
        .fetch_one(&mut other)
        .await
        .expect("look for the table");
    assert_eq!(injected, None, "the key's text ran as SQL");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&mut other)
        .await
        .expect("count");
    assert_eq!(rows, 0, "nothing was written");
    // Back on UTF-8 (by its alias UNICODE, which `current_setting` would report as is)
    // the same key is stored exactly as written.
    sqlx::query("SET client_encoding = 'UNICODE'")
        .execute(&db.pool)
        .await
        .expect("back to UTF-8");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("T", "d", "{}").with_key(key.as_str()))
        .expect("emit");
    tx.commit().await.expect("commit");
    let stored: String = sqlx::query_scalar("SELECT partition_key FROM outbox")
        .fetch_one(&mut other)
        .await
        .expect("row");
    assert_eq!(stored, key);
    drop(other);
    db.cleanup().await;
}

#[tokio::test]
async fn a_transaction_opened_inside_is_a_savepoint_not_a_commit() {
    use outbox_core::sqlx::Connection;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    let mut tx = outbox.begin().await.expect("begin");
    confirm(&mut tx, 1).await;
    tx.emit(Heartbeat {}).expect("emit");
    {
        // A helper that opens and commits "its own" transaction on the connection.
        let mut inner = tx.conn().begin().await.expect("nested begin");
        sqlx::query("UPDATE orders SET status = 'audited' WHERE id = 2")
            .execute(&mut *inner)
            .await
            .expect("update");
        inner.commit().await.expect("release the savepoint");
    }
    assert_eq!(
        status(&db, 1).await,
        "new",
        "nothing is visible outside before the outer commit"
    );
    assert_eq!(status(&db, 2).await, "new");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        status(&db, 1).await,
        "new",
        "the outer rollback undoes everything"
    );
    assert_eq!(status(&db, 2).await, "new", "including the inner 'commit'");
    assert_eq!(db.count("outbox").await, 0);
    db.cleanup().await;
}

#[tokio::test]
async fn commit_after_a_failed_statement_is_an_error_not_a_silent_rollback() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    for with_event in [false, true] {
        let mut tx = outbox.begin().await.expect("begin");
        confirm(&mut tx, 3).await;
        if with_event {
            tx.emit(Heartbeat {}).expect("emit");
        }
        let ignored = sqlx::query("INSERT INTO orders VALUES (3, 'duplicate key')")
            .execute(&mut *tx)
            .await;
        assert!(
            ignored.is_err(),
            "the statement fails and the caller ignores it"
        );
        let err = tx.commit().await.expect_err("the transaction was aborted");
        assert!(
            err.to_string().contains("aborted") || err.to_string().contains("25P02"),
            "{err}"
        );
        assert_eq!(status(&db, 3).await, "new", "with_event={with_event}");
    }
    assert_eq!(db.count("outbox").await, 0);
    db.cleanup().await;
}

#[tokio::test]
async fn a_dropped_transaction_leaves_a_clean_connection_behind() {
    let db = TestDb::with_max_connections(1).await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    for round in 0..3 {
        let mut tx = outbox.begin().await.expect("begin on the only connection");
        confirm(&mut tx, 3).await;
        tx.emit(Heartbeat {}).expect("emit");
        drop(tx); // an early return: rolled back before the connection is reused
        let mut tx = outbox.begin().await.expect("the connection came back");
        let open: bool = sqlx::query_scalar("SELECT count(*) = 0 FROM outbox")
            .fetch_one(&mut *tx)
            .await
            .expect("query");
        assert!(
            open,
            "round {round}: the dropped transaction's rows are gone"
        );
        tx.rollback().await.expect("rollback");
    }
    assert_eq!(status(&db, 3).await, "new");
    db.cleanup().await;
}

#[tokio::test]
async fn from_transaction_wraps_a_caller_owned_transaction() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    let tx = db.pool.begin().await.expect("begin");
    let mut tx = OutboxTx::from_transaction(tx, &outbox);
    confirm(&mut tx, 2).await;
    tx.emit(Heartbeat {}).expect("emit");
    tx.commit().await.expect("commit");
    assert_eq!(db.count("outbox").await, 1);
    assert_eq!(status(&db, 2).await, "confirmed");

    let tx = db.pool.begin().await.expect("begin");
    let mut tx = OutboxTx::from_transaction(tx, &outbox);
    confirm(&mut tx, 5).await;
    tx.emit(Heartbeat {}).expect("emit");
    tx.rollback().await.expect("rollback");
    assert_eq!(db.count("outbox").await, 1);
    assert_eq!(status(&db, 5).await, "new");
    db.cleanup().await;
}

/// A transaction that an earlier error aborted cannot be committed as if it had worked,
/// whether it came from `Outbox::begin` or was wrapped with `from_transaction`, with or
/// without events: PostgreSQL answers `COMMIT` in an aborted transaction with a silent
/// `ROLLBACK`, and the docs promise an error.
#[tokio::test]
async fn committing_an_aborted_transaction_is_an_error() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    for own in [true, false] {
        for emit in [false, true] {
            let mut tx = if own {
                outbox.begin().await.expect("begin")
            } else {
                let begun = outbox.pool().begin().await.expect("begin");
                OutboxTx::from_transaction(begun, &outbox)
            };
            sqlx::query("SELECT 1/0")
                .execute(&mut *tx)
                .await
                .expect_err("division by zero aborts the transaction");
            if emit {
                tx.emit(Heartbeat {}).expect("emit");
            }
            let err = tx
                .commit()
                .await
                .expect_err("an aborted transaction does not commit");
            assert!(
                matches!(err, Error::TransactionAborted { .. }),
                "own={own} emit={emit}: {err:?}"
            );
            assert!(err.to_string().contains("roll back"), "{err}");
        }
    }
    assert_eq!(db.count("outbox").await, 0);
    db.cleanup().await;
}

/// A message over the outbox's `max_message_bytes` is refused when it is emitted, with
/// its size and the limit, and the transaction goes on without it; before, it was
/// accepted, then dead-lettered by the relay (`MessageSizeTooLarge`) with its key's later
/// messages parked behind it (#36). `enqueue_messages` refuses it the same way.
#[tokio::test]
async fn a_message_over_max_message_bytes_is_refused_at_emit() {
    let db = TestDb::new().await;
    let outbox = Outbox::builder(db.pool.clone())
        .max_message_bytes(1_000)
        .build()
        .expect("build");
    outbox.migrate().await.expect("migrate");
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(1_200));
    let mut tx = outbox.begin().await.expect("begin");
    let err = tx
        .emit_message(OutboxMessage::new("Big", "orders", big.clone()).with_key("o-1"))
        .expect_err("over the limit");
    assert!(
        matches!(
            err,
            Error::TooLarge {
                bytes: 1_211,
                limit: 1_000,
                ..
            }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("`Big`")
            && text.contains("1211 bytes")
            && text.contains("max_message_bytes of 1000"),
        "{text}"
    );
    tx.emit_message(OutboxMessage::new("Small", "orders", "{}").with_key("o-1"))
        .expect("under the limit");
    tx.commit().await.expect("commit without the refused one");
    assert_eq!(db.count("outbox").await, 1);

    let mut tx = db.pool.begin().await.expect("begin");
    let err = outbox
        .enqueue_messages(&mut tx, &[OutboxMessage::new("Big", "orders", big)])
        .await
        .expect_err("over the limit");
    assert!(matches!(err, Error::TooLarge { .. }), "{err:?}");
    drop(tx);
    db.cleanup().await;
}
