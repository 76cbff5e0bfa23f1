//! The behaviour every database must share, written once and run against PostgreSQL,
//! MySQL/MariaDB and SQLite: `suite!` below turns each generic test into one `#[tokio::test]`
//! per database (`postgres::name`, `mysql::name`, `sqlite::name`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outbox_core::publisher::{InMemoryPublisher, PublishError};
use outbox_core::relay::Relay;
use outbox_core::{Outbox, OutboxMessage, OutboxRecord};
use outbox_tests::backends::{Fixture, TestBackend, init_statement_log, logged_statements};

const WAIT: Duration = Duration::from_secs(30);

fn message(key: &str, n: usize) -> OutboxMessage {
    OutboxMessage::new("Counted", "counts", format!(r#"{{"key":"{key}","n":{n}}}"#)).with_key(key)
}

fn key_and_n(r: &OutboxRecord) -> (String, u64) {
    let v: serde_json::Value = serde_json::from_str(&r.payload).expect("payload is JSON");
    (
        v["key"].as_str().expect("key").to_owned(),
        v["n"].as_u64().expect("n"),
    )
}

/// Every (key, n) published once, and per key in increasing `n`.
fn check_order(published: &[OutboxRecord], keys: usize, per_key: usize) {
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut seen = HashSet::new();
    for r in published {
        assert!(seen.insert(r.id), "message {} published twice", r.id);
        let (key, n) = key_and_n(r);
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(
            n, *expected,
            "key {key}: got event {n}, expected {expected}"
        );
        *expected += 1;
    }
    assert_eq!(next.len(), keys, "every key published");
    assert!(
        next.values().all(|n| *n == per_key as u64),
        "every event published"
    );
}

async fn count<DB: TestBackend>(f: &Fixture<DB>, filter: &str) -> i64 {
    DB::int(f, &format!("SELECT count(*) FROM outbox WHERE {filter}")).await
}

/// Commit writes the business change and the events; rollback, drop and panic write
/// neither, and leave the connection clean for the next transaction.
async fn commit_rollback_drop_and_panic<DB: TestBackend>() {
    init_statement_log();
    let f = DB::fixture().await;
    DB::exec(
        &f,
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, status VARCHAR(20) NOT NULL)",
    )
    .await;
    DB::exec(
        &f,
        "INSERT INTO orders (id, status) VALUES (1, 'new'), (2, 'new'), (3, 'new'), (4, 'new')",
    )
    .await;
    let confirmed =
        |id: i64| format!("SELECT count(*) FROM orders WHERE id = {id} AND status = 'confirmed'");

    let mut tx = f.outbox.begin().await.expect("begin");
    DB::exec_on(
        &mut tx,
        "UPDATE orders SET status = 'confirmed' WHERE id = 1",
    )
    .await;
    let id = tx.emit_message(message("1", 0)).expect("emit");
    tx.emit_message(message("1", 1)).expect("emit");
    assert_eq!(count(&f, "1 = 1").await, 0, "nothing visible before commit");
    tx.commit().await.expect("commit");
    assert_eq!(DB::int(&f, &confirmed(1)).await, 1, "the change committed");
    assert_eq!(count(&f, "1 = 1").await, 2, "and both events with it");
    assert_eq!(
        count(&f, &format!("id = '{id}' AND event_type = 'Counted' AND destination = 'counts' AND partition_key = '1' AND sent_at IS NULL AND attempts = 0")).await,
        1,
        "columns as emitted"
    );

    let mut tx = f.outbox.begin().await.expect("begin");
    DB::exec_on(
        &mut tx,
        "UPDATE orders SET status = 'confirmed' WHERE id = 2",
    )
    .await;
    tx.emit_message(message("2", 0)).expect("emit");
    tx.rollback().await.expect("rollback");

    let mut tx = f.outbox.begin().await.expect("begin");
    DB::exec_on(
        &mut tx,
        "UPDATE orders SET status = 'confirmed' WHERE id = 3",
    )
    .await;
    tx.emit_message(message("3", 0)).expect("emit");
    drop(tx);

    let outbox = f.outbox.clone();
    let panicked = tokio::spawn(async move {
        let mut tx = outbox.begin().await.expect("begin");
        DB::exec_on(
            &mut tx,
            "UPDATE orders SET status = 'confirmed' WHERE id = 4",
        )
        .await;
        tx.emit_message(message("4", 0)).expect("emit");
        panic!("the business code panics mid-transaction");
    })
    .await;
    assert!(panicked.is_err_and(|e| e.is_panic()));

    // The next transactions (on the same pooled connections) see none of it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for id in 2..=4 {
        assert_eq!(DB::int(&f, &confirmed(id)).await, 0, "order {id} unchanged");
    }
    assert_eq!(
        count(&f, "1 = 1").await,
        2,
        "no event from rollback, drop or panic"
    );
    let mut tx = f.outbox.begin().await.expect("a clean connection");
    tx.emit_message(message("5", 0)).expect("emit");
    tx.commit().await.expect("commit");
    assert_eq!(count(&f, "1 = 1").await, 3);
    DB::cleanup(f).await;
}

/// A thousand events go to the database in one INSERT statement, in emit order.
async fn one_insert_per_commit<DB: TestBackend>() {
    init_statement_log();
    let f = DB::fixture().await;
    // Short: MySQL's identifiers (`<table>_processed_processed_at_idx`) stop at 64 characters.
    let id = uuid::Uuid::now_v7().simple().to_string();
    let table = format!("one_stmt_{}", &id[20..]);
    let outbox = DB::named(&f, &table).await;
    let mut tx = outbox.begin().await.expect("begin");
    for i in 0..1000 {
        tx.emit_message(message(&i.to_string(), i)).expect("emit");
    }
    tx.commit().await.expect("commit");
    let inserts: Vec<String> = logged_statements()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|s| {
            s.contains(&table)
                && s.contains("INSERT INTO")
                && s.contains("id, event_type, event_version")
        })
        .cloned()
        .collect();
    assert_eq!(inserts.len(), 1, "one statement wrote the events");
    let rows = DB::int(&f, &format!("SELECT count(*) FROM {table}")).await;
    assert_eq!(rows, 1000);
    // seq follows emit order: the key (= emit index) grows with seq.
    let out_of_order = DB::int(
        &f,
        &format!(
            "SELECT count(*) FROM {table} a JOIN {table} b ON a.seq < b.seq \
             WHERE CAST(a.partition_key AS INTEGER) > CAST(b.partition_key AS INTEGER) AND b.seq = a.seq + 1"
        ),
    )
    .await;
    assert_eq!(out_of_order, 0, "seq follows emit order");
    DB::cleanup(f).await;
}

/// Concurrent writers, one relay: every event published once, per key in order, and
/// marked sent; then the relay shuts down cleanly.
async fn relay_publishes_in_key_order<DB: TestBackend>() {
    init_statement_log();
    let f = DB::fixture().await;
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(f.outbox.clone(), publisher.clone())
        .batch_size(50)
        .spawn();
    let (keys, per_key, writers) = (20, 25, 4);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let outbox: Outbox<DB> = f.outbox.clone();
        tasks.push(tokio::spawn(async move {
            let mine: Vec<String> = (0..keys)
                .filter(|k| k % writers == w)
                .map(|k| format!("k{k}"))
                .collect();
            for n in 0..per_key {
                let mut tx = outbox.begin().await.expect("begin");
                for key in &mine {
                    tx.emit_message(message(key, n)).expect("emit");
                }
                tx.commit().await.expect("commit");
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer");
    }
    let total = keys * per_key;
    assert!(
        publisher.wait_for(total, WAIT).await,
        "published {}",
        publisher.published_count()
    );
    tokio::time::sleep(Duration::from_millis(300)).await; // would-be duplicates arrive
    relay.shutdown().await;
    let published = publisher.published();
    check_order(&published, keys, per_key);
    assert_eq!(published.len(), total);
    let first = &published[0];
    assert_eq!(
        (first.event_type.as_str(), first.destination.as_str()),
        ("Counted", "counts")
    );
    assert_eq!(
        count(&f, "sent_at IS NOT NULL").await,
        total as i64,
        "all marked sent"
    );
    DB::cleanup(f).await;
}

/// A transaction that drew a smaller `seq` and commits after a later one of the same key
/// is not overtaken: the relay publishes the key's events in `seq` order.
async fn a_late_commit_is_not_overtaken<DB: TestBackend>() {
    init_statement_log();
    let f = DB::fixture().await;
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(f.outbox.clone(), publisher.clone()).spawn();

    let mut a = f.outbox.begin().await.expect("begin a");
    a.emit_message(message("same", 0)).expect("emit");
    a.flush().await.expect("flush a: its row has drawn its seq");
    let outbox = f.outbox.clone();
    let b = tokio::spawn(async move {
        let mut b = outbox.begin().await.expect("begin b");
        b.emit_message(message("same", 1)).expect("emit");
        b.emit_message(message("other", 0)).expect("emit");
        b.commit().await.expect("commit b");
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        publisher.published_count(),
        0,
        "nothing overtakes A while it is open"
    );
    a.commit().await.expect("commit a");
    b.await.expect("b");
    assert!(publisher.wait_for(3, WAIT).await);
    relay.shutdown().await;
    let same: Vec<u64> = publisher
        .published()
        .iter()
        .map(key_and_n)
        .filter(|(k, _)| k == "same")
        .map(|(_, n)| n)
        .collect();
    assert_eq!(same, vec![0, 1], "A's event before B's");
    DB::cleanup(f).await;
}

/// A failing message is retried with backoff, then dead-lettered; the later message of
/// its key waits behind it until then, other keys flow on.
async fn retries_backoff_and_dead_letter<DB: TestBackend>() {
    init_statement_log();
    let f = DB::fixture().await;
    let mut tx = f.outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("Poison", "d", "{}").with_key("bad"))
        .expect("emit");
    tx.emit_message(message("good", 0)).expect("emit");
    tx.emit_message(message("good", 1)).expect("emit");
    tx.emit_message(message("bad", 1)).expect("emit");
    for n in 2..10 {
        tx.emit_message(message("good", n)).expect("emit");
    }
    tx.commit().await.expect("commit");

    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.event_type == "Poison",
        None,
        PublishError::retryable("broker rejected it"),
    );
    let relay = Relay::builder(f.outbox.clone(), publisher.clone())
        .batch_size(3)
        .max_attempts(3)
        .backoff(Duration::from_millis(300), Duration::from_secs(2))
        .poll_interval(Duration::from_millis(100))
        .spawn();
    assert!(publisher.wait_for(10, WAIT).await, "other keys flow");
    let started = std::time::Instant::now();
    let wait = loop {
        let failed = count(
            &f,
            "event_type = 'Poison' AND attempts >= 1 AND last_error = 'broker rejected it'",
        )
        .await;
        if failed == 1 {
            let secs = DB::float(
                &f,
                &format!(
                    "SELECT {} FROM outbox WHERE event_type = 'Poison'",
                    DB::seconds_until("next_attempt_at")
                ),
            )
            .await;
            if let Some(secs) = secs {
                break secs;
            }
        }
        assert!(started.elapsed() < WAIT, "the failure is recorded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(wait > -0.5 && wait <= 2.0, "backoff scheduled: {wait} s");
    assert!(
        !publisher
            .published()
            .iter()
            .any(|r| r.partition_key.as_deref() == Some("bad")),
        "the later message of the failing key waits behind it"
    );
    assert!(
        publisher.wait_for(11, WAIT).await,
        "the key is unblocked by the dead letter"
    );
    let stats = relay.stats();
    relay.shutdown().await;
    assert_eq!(
        count(&f, "event_type = 'Poison' AND attempts = 3 AND dead_at IS NOT NULL AND next_attempt_at IS NOT NULL").await,
        1,
        "dead after 3 attempts, the last backoff still visible"
    );
    assert_eq!((stats.failed, stats.dead), (3, 1));
    let bad: Vec<String> = publisher
        .published()
        .iter()
        .filter(|r| r.partition_key.as_deref() == Some("bad"))
        .map(|r| r.event_type.clone())
        .collect();
    assert_eq!(bad, vec!["Counted"]);
    DB::cleanup(f).await;
}

/// A retry that comes due is published before the later messages of its key, also when
/// the pipelined relay has already claimed past them: here the first batch takes the
/// due retry `A` (its key's `K2` is held back behind it), the prefetched second batch goes
/// past `K2`, and once `A` is marked the third claim could reach `K3` — which must wait
/// for `K2`.
async fn a_retry_that_comes_due_is_not_overtaken<DB: TestBackend>() {
    init_statement_log();
    let f = DB::fixture().await;
    let mut tx = f.outbox.begin().await.expect("begin");
    tx.emit_message(message("k", 0)).expect("emit"); // A: in retry, due
    for n in 0..3 {
        tx.emit_message(message(&format!("y{n}"), 0)).expect("emit");
    }
    tx.emit_message(message("k", 1)).expect("emit"); // K2
    for n in 3..7 {
        tx.emit_message(message(&format!("y{n}"), 0)).expect("emit");
    }
    tx.emit_message(message("k", 2)).expect("emit"); // K3
    for n in 7..12 {
        tx.emit_message(message(&format!("y{n}"), 0)).expect("emit");
    }
    tx.commit().await.expect("commit");
    // A failed once before and its retry is due now.
    DB::exec(
        &f,
        "UPDATE outbox SET attempts = 1, next_attempt_at = '2000-01-01 00:00:00', last_error = 'earlier failure' \
         WHERE seq = (SELECT m FROM (SELECT min(seq) AS m FROM outbox) t)",
    )
    .await;

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(f.outbox.clone(), publisher.clone())
        .batch_size(4)
        .spawn();
    assert!(
        publisher.wait_for(15, WAIT).await,
        "everything is published"
    );
    relay.shutdown().await;
    let published = publisher.published();
    let k: Vec<u64> = published
        .iter()
        .map(key_and_n)
        .filter(|(key, _)| key == "k")
        .map(|(_, n)| n)
        .collect();
    assert_eq!(k, vec![0, 1, 2], "key k in seq order");
    let ids: HashSet<_> = published.iter().map(|r| r.id).collect();
    assert_eq!(
        (ids.len(), published.len()),
        (15, 15),
        "each message exactly once"
    );
    DB::cleanup(f).await;
}

macro_rules! suite {
    ($($db:ident => $ty:ty),* $(,)?) => {$(
        mod $db {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn commit_rollback_drop_and_panic() {
                super::commit_rollback_drop_and_panic::<$ty>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_insert_per_commit() {
                super::one_insert_per_commit::<$ty>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn relay_publishes_in_key_order() {
                super::relay_publishes_in_key_order::<$ty>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_late_commit_is_not_overtaken() {
                super::a_late_commit_is_not_overtaken::<$ty>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_retry_that_comes_due_is_not_overtaken() {
                super::a_retry_that_comes_due_is_not_overtaken::<$ty>().await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn retries_backoff_and_dead_letter() {
                super::retries_backoff_and_dead_letter::<$ty>().await;
            }
        }
    )*};
}

suite! {
    postgres => outbox_core::sqlx::Postgres,
    mysql => outbox_core::sqlx::MySql,
    sqlite => outbox_core::sqlx::Sqlite,
}

/// MySQL/MariaDB only: of two relays one publishes (it holds the `GET_LOCK`), the other
/// stands by; nothing is published twice or out of order, and when the active relay dies
/// the standby takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_one_active_relay_and_a_standby_that_takes_over() {
    use outbox_core::sqlx::MySql;
    init_statement_log();
    let f = <MySql as TestBackend>::fixture().await;
    let publisher = InMemoryPublisher::new();
    let first = Relay::builder(f.outbox.clone(), publisher.clone())
        .batch_size(20)
        .spawn();
    tokio::time::sleep(Duration::from_millis(300)).await; // `first` holds the lock
    let second = Relay::builder(f.outbox.clone(), publisher.clone())
        .batch_size(20)
        .spawn();
    let write = |from: usize, to: usize| {
        let outbox = f.outbox.clone();
        async move {
            for n in from..to {
                let mut tx = outbox.begin().await.expect("begin");
                for k in 0..5 {
                    tx.emit_message(message(&format!("k{k}"), n)).expect("emit");
                }
                tx.commit().await.expect("commit");
            }
        }
    };
    write(0, 40).await;
    assert!(
        publisher.wait_for(200, WAIT).await,
        "published {}",
        publisher.published_count()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        first.stats().published,
        200,
        "the active relay published everything"
    );
    assert_eq!(second.stats().published, 0, "the standby published nothing");

    first.abort(); // its connection closes, and with it the lock
    write(40, 80).await;
    assert!(
        publisher.wait_for(400, WAIT).await,
        "the standby took over: {}",
        publisher.published_count()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    second.shutdown().await;
    check_order(&publisher.published(), 5, 80);
    assert_eq!(count(&f, "sent_at IS NOT NULL").await, 400);
    <MySql as TestBackend>::cleanup(f).await;
}
