//! WAL mode (`docs/wal.md`) against the real PostgreSQL (`wal_level = logical`, set by
//! `scripts/services.sh`): events reach the relay through a logical replication slot,
//! in commit order, if and only if their transaction commits.

use std::collections::HashSet;
use std::time::Duration;

use outbox_core::publisher::{InMemoryPublisher, PublishError};
use outbox_core::relay::Relay;
use outbox_core::{Outbox, OutboxMessage};
use outbox_tests::trusted_sql;
use outbox_tests::wal::slot_report;
use outbox_tests::{TestDb, wait_until, wait_until_explained};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

/// A migrated WAL-mode outbox in a fresh schema, with a slot of its own.
async fn wal_outbox() -> (TestDb, Outbox, String) {
    wal_outbox_in(TestDb::new().await).await
}

async fn wal_outbox_in(db: TestDb) -> (TestDb, Outbox, String) {
    let (outbox, slot) = outbox_tests::wal::outbox_in(&db).await;
    (db, outbox, slot)
}

async fn cleanup(db: TestDb, slot: &str) {
    outbox_tests::wal::cleanup(db, slot).await;
}

fn message(key: &str, n: usize) -> OutboxMessage {
    OutboxMessage::new("Counted", "counts", format!(r#"{{"key":"{key}","n":{n}}}"#)).with_key(key)
}

/// Committed events arrive, in commit order (not start order), with their ids, types,
/// keys, headers and payloads; rolled-back and dropped transactions leave nothing; the
/// outbox table stays empty and no notification is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_the_relay_in_commit_order_iff_committed() {
    let (db, outbox, slot) = wal_outbox().await;
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();

    // Started first, committed second.
    let mut early = outbox.begin().await.expect("begin");
    let late_id = early.emit_message(message("a", 1)).expect("emit");
    let mut tx = outbox.begin().await.expect("begin");
    let first_id = tx
        .emit_message(message("a", 0).with_header("traceparent", "00-abc-def-01"))
        .expect("emit");
    tx.commit().await.expect("commit");
    early.commit().await.expect("commit");

    let mut rolled = outbox.begin().await.expect("begin");
    rolled.emit_message(message("gone", 0)).expect("emit");
    rolled.rollback().await.expect("rollback");
    let mut dropped = outbox.begin().await.expect("begin");
    dropped.emit_message(message("gone", 1)).expect("emit");
    drop(dropped);

    // Through the caller's own transaction (`enqueue`), bound parameters.
    let mut own = db.pool.begin().await.expect("begin");
    let enqueued = outbox
        .enqueue_messages(&mut own, &[message("b", 0), message("b", 1)])
        .await;
    enqueued.expect("enqueue");
    own.commit().await.expect("commit");

    assert!(publisher.wait_for(4, WAIT).await, "4 events published");
    let published = publisher.published();
    let ids: Vec<Uuid> = published.iter().map(|r| r.id).collect();
    assert_eq!(&ids[..2], &[first_id, late_id], "commit order");
    assert_eq!(
        published[0].headers.get("traceparent").map(String::as_str),
        Some("00-abc-def-01")
    );
    assert_eq!(
        published[0].payload, r#"{"key":"a","n":0}"#,
        "the payload verbatim"
    );
    assert_eq!(published[0].partition_key.as_deref(), Some("a"));
    assert_eq!(published[0].event_type, "Counted");
    let keys: Vec<&str> = published
        .iter()
        .filter_map(|r| r.partition_key.as_deref())
        .collect();
    assert_eq!(
        keys,
        ["a", "a", "b", "b"],
        "nothing rolled back or dropped arrives"
    );
    assert_eq!(db.count("outbox").await, 0, "no row in WAL mode");
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// The slot's position is confirmed only for what the broker acknowledged: a relay that
/// stops and a new one that starts publish every event (duplicates only of what was
/// acknowledged and not yet confirmed), and a failing key waits while others flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_relay_resumes_where_the_broker_acknowledged() {
    let (db, outbox, slot) = wal_outbox().await;
    let emit = |from: usize, to: usize| {
        let outbox = outbox.clone();
        async move {
            for n in from..to {
                let mut tx = outbox.begin().await.expect("begin");
                for k in 0..4 {
                    tx.emit_message(message(&format!("k{k}"), n)).expect("emit");
                }
                tx.commit().await.expect("commit");
            }
        }
    };
    emit(0, 50).await;
    let publisher = InMemoryPublisher::new();
    // Key k3 fails for a while (the broker refused it): it waits, in order.
    publisher.fail_when(
        |m| m.partition_key.as_deref() == Some("k3"),
        None,
        PublishError::retryable("leader not available"),
    );
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .spawn();
    assert!(publisher.wait_for(150, WAIT).await, "the other keys flow");
    publisher.clear_failures();
    assert!(publisher.wait_for(200, WAIT).await, "k3 follows");
    relay.shutdown().await;
    let before = publisher.published();

    // Written while no relay runs: the slot keeps them.
    emit(50, 80).await;
    let second = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), second.clone()).spawn();
    wait_until(
        "the new relay publishes what was written meanwhile",
        WAIT,
        || async {
            // Every event, counted once: a repeat is no progress (and fails below).
            let seen: HashSet<Uuid> = before
                .iter()
                .chain(second.published().iter())
                .map(|r| r.id)
                .collect();
            seen.len() >= 320
        },
    )
    .await;
    relay.shutdown().await;
    let after = second.published();
    let all: HashSet<Uuid> = before.iter().chain(after.iter()).map(|r| r.id).collect();
    assert_eq!(all.len(), 320, "nothing lost");
    let first_ids: HashSet<Uuid> = before.iter().map(|r| r.id).collect();
    let repeated = after.iter().filter(|r| first_ids.contains(&r.id)).count();
    assert_eq!(
        repeated, 0,
        "a clean shutdown confirms what was acknowledged"
    );
    // Per key, in order, across both relays.
    for k in 0..4 {
        let key = format!("k{k}");
        let ns: Vec<u64> = before
            .iter()
            .chain(after.iter())
            .filter(|r| r.partition_key.as_deref() == Some(key.as_str()))
            .map(|r| {
                serde_json::from_slice::<serde_json::Value>(&r.payload).expect("json")["n"]
                    .as_u64()
                    .expect("n")
            })
            .collect();
        let mut dedup = ns.clone();
        dedup.dedup();
        assert_eq!(dedup, (0..80).collect::<Vec<u64>>(), "key {key} in order");
    }
    cleanup(db, &slot).await;
}

/// A clean shutdown leaves the slot at what the broker acknowledged, also while the
/// server streams other work to the relay as it lets go. The relay's last confirmation
/// used to be written to the socket and the connection closed at once: a walsender busy
/// sending (here, other logical messages of the database) met the client's reset before
/// it read the confirmation, and the next relay published again what had been
/// acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_confirms_while_the_server_streams_other_work() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let (db, outbox, slot) = wal_outbox().await;
    let stop = Arc::new(AtomicBool::new(false));
    let noise = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                sqlx::query(
                    "SELECT count(pg_logical_emit_message(true, 'outbox-test-noise', \
                     repeat('x', 100))) FROM generate_series(1, 20000)",
                )
                .execute(&pool)
                .await
                .expect("noise");
                // Paced so that the relay keeps up with it.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    let mut published: HashSet<Uuid> = HashSet::new();
    for round in 0..16 {
        let mut written = HashSet::new();
        for n in 0..10 {
            let mut tx = outbox.begin().await.expect("begin");
            written.insert(tx.emit_message(message("k", round * 10 + n)).expect("emit"));
            tx.commit().await.expect("commit");
        }
        let publisher = InMemoryPublisher::new();
        let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
        wait_until("this round's events are published", WAIT, || async {
            let seen: HashSet<Uuid> = publisher.published().iter().map(|r| r.id).collect();
            written.is_subset(&seen)
        })
        .await;
        relay.shutdown().await;
        let ids: Vec<Uuid> = publisher.published().iter().map(|r| r.id).collect();
        let again = ids.iter().filter(|id| published.contains(id)).count();
        assert_eq!(
            again, 0,
            "round {round}: the relay before this one stopped cleanly after its events were \
             acknowledged, yet {again} of them were published again"
        );
        published.extend(ids);
    }
    stop.store(true, Ordering::Relaxed);
    noise.await.expect("noise task");
    assert_eq!(published.len(), 160);
    cleanup(db, &slot).await;
}

/// One relay holds the slot; a second stands by and takes over when the first stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_the_slot_when_the_active_relay_stops() {
    let (db, outbox, slot) = wal_outbox().await;
    let one = InMemoryPublisher::new();
    let two = InMemoryPublisher::new();
    let first = Relay::builder(outbox.clone(), one.clone()).spawn();
    wait_until("the first relay holds the slot", WAIT, || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&slot)
        .fetch_one(&db.pool)
        .await
        .expect("slot")
    })
    .await;
    let second = Relay::builder(outbox.clone(), two.clone())
        .poll_interval(Duration::from_millis(100))
        .spawn();
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(message("x", 0)).expect("emit");
    tx.commit().await.expect("commit");
    assert!(one.wait_for(1, WAIT).await, "the active relay publishes");
    first.shutdown().await;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(message("x", 1)).expect("emit");
    tx.commit().await.expect("commit");
    assert!(two.wait_for(1, WAIT).await, "the standby took over");
    assert_eq!(two.published()[0].payload, r#"{"key":"x","n":1}"#);
    assert_eq!(one.published().len(), 1, "one relay at a time");
    second.shutdown().await;
    cleanup(db, &slot).await;
}

/// A message refused for good mid-key becomes a dead letter in the outbox table, and the
/// later messages of its key wait there behind it, also those committed afterwards;
/// other keys flow. Released, it goes out first and its key follows in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_into_the_table_and_parks_its_key() {
    use outbox_core::admin::Admin;
    let (db, outbox, slot) = wal_outbox().await;
    let emit = |m: OutboxMessage| {
        let outbox = outbox.clone();
        async move {
            let mut tx = outbox.begin().await.expect("begin");
            let id = tx.emit_message(m).expect("emit");
            tx.commit().await.expect("commit");
            id
        }
    };
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.event_type == "Poison",
        None,
        PublishError::permanent("message too large"),
    );
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_millis(100))
        .spawn();
    emit(message("p", 0)).await;
    let poison =
        emit(OutboxMessage::new("Poison", "counts", r#"{"key":"p","n":1}"#).with_key("p")).await;
    emit(message("p", 2)).await;
    emit(message("q", 0)).await;
    let admin = Admin::new(outbox.clone());
    wait_until("the poison message is dead", WAIT, || async {
        admin.status().await.expect("status").dead == 1
    })
    .await;
    emit(message("p", 3)).await; // after the dead letter: parked too
    emit(message("q", 1)).await;
    wait_until("q flows, p waits in the table", WAIT, || async {
        let q = publisher
            .published()
            .iter()
            .filter(|r| r.partition_key.as_deref() == Some("q"))
            .count();
        q == 2 && db.count("outbox").await == 3
    })
    .await;
    let p_sent = |published: &[outbox_core::OutboxRecord]| -> Vec<u64> {
        published
            .iter()
            .filter(|r| r.partition_key.as_deref() == Some("p"))
            .map(|r| {
                serde_json::from_slice::<serde_json::Value>(&r.payload).expect("json")["n"]
                    .as_u64()
                    .expect("n")
            })
            .collect()
    };
    assert_eq!(
        p_sent(&publisher.published()),
        [0],
        "p is parked behind its dead letter"
    );
    let dead = admin
        .dead(&outbox_core::admin::ListFilter::default())
        .await
        .expect("dead letters");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, poison);
    assert_eq!(dead[0].held_back, 2, "p:2 and p:3 wait behind it");

    publisher.clear_failures();
    assert_eq!(admin.release(&[poison]).await.expect("release"), 1);
    emit(message("p", 4)).await;
    wait_until("p goes out in order", WAIT, || async {
        p_sent(&publisher.published()).len() >= 5
    })
    .await;
    assert_eq!(p_sent(&publisher.published()), [0, 1, 2, 3, 4]);
    wait_until("the table rows are marked sent", WAIT, || async {
        admin.status().await.expect("status").pending == 0
    })
    .await;
    emit(message("p", 5)).await; // the key flows through the stream again
    wait_until("p:5", WAIT, || async {
        p_sent(&publisher.published()).len() >= 6
    })
    .await;
    assert_eq!(p_sent(&publisher.published()), [0, 1, 2, 3, 4, 5]);
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// Commits `rounds` transactions of one event per key; records each key's ids in commit
/// order in `written` and returns all of them.
async fn write_rounds(written: &mut [Vec<Uuid>], outbox: &Outbox, rounds: usize) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for n in 0..rounds {
        let mut tx = outbox.begin().await.expect("begin");
        for (k, key_ids) in written.iter_mut().enumerate() {
            let id = tx.emit_message(message(&format!("k{k}"), n)).expect("emit");
            key_ids.push(id);
            ids.push(id);
        }
        tx.commit().await.expect("commit");
    }
    ids
}

/// A relay in a process of its own (`src/bin/relay_process.rs`), killed when dropped.
struct RelayProcess;

impl RelayProcess {
    fn command(db: &TestDb, slot: &str, name: &str) -> std::process::Command {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_relay_process"));
        command
            .args(["postgres", &outbox_tests::database_url(), name])
            .env("OUTBOX_TEST_SCHEMA", &db.schema)
            .env("OUTBOX_TEST_WAL_SLOT", slot)
            .stdin(std::process::Stdio::null());
        command
    }

    fn start(db: &TestDb, slot: &str, name: &str) -> outbox_tests::process::Process {
        outbox_tests::process::Process::start(&mut RelayProcess::command(db, slot, name))
    }

    /// A relay that stops at the gate on a `Gated` message (`relay_process`'s docs), with
    /// a publish timeout it never reaches and batches of one: the outcome of a batch is
    /// recorded before the next claim reads the stream (and could find it ended).
    fn gated(db: &TestDb, slot: &str, name: &str) -> outbox_tests::process::Process {
        outbox_tests::process::Process::start(
            RelayProcess::command(db, slot, name)
                .env("OUTBOX_TEST_GATED", name)
                .env("OUTBOX_TEST_PUBLISH_TIMEOUT_MS", "120000")
                .env("OUTBOX_TEST_BATCH_SIZE", "1"),
        )
    }
}

/// The tables `relay_process` writes: what it published, and its gate.
async fn gate_tables(db: &TestDb) {
    for table in [
        "CREATE TABLE published (n bigserial, id text NOT NULL, relay text NOT NULL)",
        "CREATE TABLE gate (n bigserial, relay text NOT NULL, stage text NOT NULL)",
    ] {
        sqlx::query(trusted_sql(table))
            .execute(&db.pool)
            .await
            .expect("table");
    }
}

/// What `relay` published, in order.
async fn published_by(pool: sqlx::PgPool, relay: &'static str) -> Vec<Uuid> {
    sqlx::query_scalar::<_, String>("SELECT id FROM published WHERE relay = $1 ORDER BY n")
        .bind(relay)
        .fetch_all(&pool)
        .await
        .expect("published")
        .iter()
        .map(|id| id.parse::<Uuid>().expect("uuid"))
        .collect()
}

/// SIGKILL of the active relay mid-stream: the next one publishes everything (again
/// what was acknowledged after the last confirmation, nothing lost, per-key order kept).
/// SIGSTOP: the server ends the frozen relay's replication connection after
/// `wal_sender_timeout` (10 s), a standby takes the slot, and the frozen relay, once
/// continued, publishes nothing written after it was stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_frozen_relays_lose_nothing_and_hand_the_slot_over() {
    let (db, outbox, slot) = wal_outbox().await;
    sqlx::query("CREATE TABLE published (n bigserial, id text NOT NULL, relay text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("published table");
    // Per key, the ids in the order they were committed.
    let mut written: Vec<Vec<Uuid>> = vec![Vec::new(); 8];
    let published = |relay: Option<&'static str>| {
        let pool = db.pool.clone();
        async move {
            let ids: Vec<String> = match relay {
                None => {
                    sqlx::query_scalar("SELECT id FROM published ORDER BY n")
                        .fetch_all(&pool)
                        .await
                }
                Some(name) => {
                    sqlx::query_scalar("SELECT id FROM published WHERE relay = $1 ORDER BY n")
                        .bind(name)
                        .fetch_all(&pool)
                        .await
                }
            }
            .expect("published");
            ids.iter()
                .map(|id| id.parse::<Uuid>().expect("uuid"))
                .collect::<Vec<_>>()
        }
    };
    let a = RelayProcess::start(&db, &slot, "relay-a");
    let first = write_rounds(&mut written, &outbox, 250).await;
    wait_until_explained(
        "relay-a publishes",
        WAIT,
        || async { published(None).await.len() > 200 },
        || slot_report(&db, &slot),
    )
    .await;
    a.signal("-KILL");
    drop(a);
    let b = RelayProcess::start(&db, &slot, "relay-b");
    wait_until_explained(
        "relay-b publishes everything after the kill",
        WAIT,
        || async {
            let seen: HashSet<Uuid> = published(None).await.into_iter().collect();
            first.iter().all(|id| seen.contains(id))
        },
        || slot_report(&db, &slot),
    )
    .await;
    let all = published(None).await;
    let distinct: HashSet<&Uuid> = all.iter().collect();
    eprintln!(
        "measured: {} published, {} again after SIGKILL",
        all.len(),
        all.len() - distinct.len()
    );

    b.signal("-STOP");
    let stopped = std::time::Instant::now();
    let c = RelayProcess::start(&db, &slot, "relay-c");
    let second = write_rounds(&mut written, &outbox, 20).await;
    wait_until_explained(
        "relay-c takes the slot and publishes",
        WAIT,
        || async {
            let seen: HashSet<Uuid> = published(None).await.into_iter().collect();
            second.iter().all(|id| seen.contains(id))
        },
        || slot_report(&db, &slot),
    )
    .await;
    let took = stopped.elapsed();
    eprintln!("measured: WAL slot taken over {took:?} after SIGSTOP");
    assert!(
        took < Duration::from_secs(20),
        "taken over within wal_sender_timeout + a poll: {took:?}"
    );
    b.signal("-CONT");
    let third = write_rounds(&mut written, &outbox, 20).await;
    wait_until_explained(
        "relay-c publishes what comes after",
        WAIT,
        || async {
            let seen: HashSet<Uuid> = published(Some("relay-c")).await.into_iter().collect();
            third.iter().all(|id| seen.contains(id))
        },
        || slot_report(&db, &slot),
    )
    .await;
    let late: HashSet<Uuid> = second.iter().chain(third.iter()).copied().collect();
    let by_b = published(Some("relay-b")).await;
    assert!(
        by_b.iter().all(|id| !late.contains(id)),
        "the frozen relay published nothing written after it was stopped"
    );
    // Per key, first publications in commit order.
    let order = published(None).await;
    let mut seen = HashSet::new();
    let firsts: Vec<Uuid> = order.into_iter().filter(|id| seen.insert(*id)).collect();
    for (k, ids) in written.iter().enumerate() {
        let of_key: HashSet<&Uuid> = ids.iter().collect();
        let got: Vec<&Uuid> = firsts.iter().filter(|id| of_key.contains(id)).collect();
        let want: Vec<&Uuid> = ids.iter().collect();
        assert_eq!(got, want, "key k{k}: every event, in commit order");
    }
    drop(c);
    drop(b);
    cleanup(db, &slot).await;
}

/// A relay frozen (SIGSTOP) in the middle of a publish loses the slot after
/// `wal_sender_timeout`; a standby takes it and publishes the same message. When the frozen
/// relay is continued and its publish fails, it must not write the message into the table
/// as a dead letter: that would park the key behind a message already delivered. (With
/// full batches, the outcome is recorded before the next claim reads the stream and finds
/// it ended.) Failed on main: the old relay buried k:7 through the pool (one dead row),
/// and k:8 waited behind it in the table instead of reaching the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_lost_the_slot_while_frozen_writes_nothing_into_the_table() {
    let (db, outbox, slot) = wal_outbox().await;
    gate_tables(&db).await;
    let published = |relay: &'static str| published_by(db.pool.clone(), relay);
    let stage = |stage: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM gate WHERE stage = $1")
                .bind(stage)
                .fetch_one(&pool)
                .await
                .expect("gate")
                > 0
        }
    };
    let b = RelayProcess::gated(&db, &slot, "relay-b");
    let state = || {
        let text = b.output();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        format!(
            "relay-b's last log lines (newest first):\n{}",
            tail.join("\n")
        )
    };
    let mut ids = Vec::new();
    for n in 0..7 {
        ids.push(emit_one(&outbox, message("k", n)).await);
    }
    outbox_tests::wait_until_or(
        "relay-b publishes k:0..6",
        WAIT,
        || async { published("relay-b").await.len() == 7 },
        state,
    )
    .await;
    let gated = OutboxMessage::new("Gated", "counts", r#"{"key":"k","n":7}"#).with_key("k");
    ids.push(emit_one(&outbox, gated).await);
    outbox_tests::wait_until_or(
        "relay-b is publishing k:7",
        WAIT,
        || stage("reached"),
        state,
    )
    .await;
    b.signal("-STOP");
    let c = RelayProcess::start(&db, &slot, "relay-c");
    outbox_tests::wait_until_or(
        "relay-c takes the slot and publishes k:7",
        WAIT,
        || async { published("relay-c").await.contains(&ids[7]) },
        state,
    )
    .await;
    let before = b.output().len();
    sqlx::query("INSERT INTO gate (relay, stage) VALUES ('test', 'open')")
        .execute(&db.pool)
        .await
        .expect("open the gate");
    b.signal("-CONT");
    outbox_tests::wait_until_or(
        "relay-b's publish of k:7 fails and its session ends",
        WAIT,
        || async {
            stage("answered").await
                && b.output()
                    .get(before..)
                    .is_some_and(|new| new.contains("database session failed"))
        },
        state,
    )
    .await;
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT event_type, last_error FROM outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("rows");
    assert!(
        rows.is_empty(),
        "the relay that lost the slot wrote into the outbox table: {rows:?}\n{}",
        state()
    );
    ids.push(emit_one(&outbox, message("k", 8)).await);
    outbox_tests::wait_until_or(
        "k:8 reaches the broker through relay-c (k is not parked)",
        WAIT,
        || async { published("relay-c").await.contains(&ids[8]) },
        state,
    )
    .await;
    // Per key, first publications in commit order.
    let mut seen = HashSet::new();
    let firsts: Vec<Uuid> = sqlx::query_scalar::<_, String>("SELECT id FROM published ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .expect("published")
        .iter()
        .map(|id| id.parse::<Uuid>().expect("uuid"))
        .filter(|id| seen.insert(*id))
        .collect();
    assert_eq!(firsts, ids, "every event of k once, in commit order");
    drop(c);
    drop(b);
    cleanup(db, &slot).await;
}

/// A relay frozen (SIGSTOP) in the middle of a table write holds the slot's fence lock
/// (the advisory lock a relay taking the slot waits for, so that it reads what the old
/// one wrote). Its replication connection ends after `wal_sender_timeout`, and a standby
/// takes the slot; the standby must not then wait for the fence until the frozen process
/// is continued, however long that is. The server ends the frozen relay's transaction
/// (its write rolled back, the lock released) once it stood idle as long, and the standby
/// goes on. Failed on main: relay-c took the slot and waited on the fence until the
/// test's 30 s ran out (the red fresh-clone CI run of 2026-12-03, `killed_and_frozen_...`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_frozen_inside_a_table_write_does_not_hold_the_standby_back() {
    let (db, outbox, slot) = wal_outbox().await;
    gate_tables(&db).await;
    let published = |relay: &'static str| published_by(db.pool.clone(), relay);
    let b = RelayProcess::gated(&db, &slot, "relay-b");
    let first = emit_one(&outbox, message("k", 0)).await;
    wait_until_explained(
        "relay-b publishes k:0",
        WAIT,
        || async { published("relay-b").await.contains(&first) },
        || slot_report(&db, &slot),
    )
    .await;
    // The test holds the outbox table in SHARE mode: relay-b's dead-letter insert, made
    // under the fence lock, waits for it.
    let mut holder = db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE outbox IN SHARE MODE")
        .execute(&mut *holder)
        .await
        .expect("lock the outbox table");
    let gated = OutboxMessage::new("Gated", "counts", r#"{"key":"k","n":1}"#).with_key("k");
    let gated = emit_one(&outbox, gated).await;
    wait_until_explained(
        "relay-b is publishing k:1",
        WAIT,
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM gate WHERE stage = 'reached'")
                .fetch_one(&db.pool)
                .await
                .expect("gate")
                > 0
        },
        || slot_report(&db, &slot),
    )
    .await;
    sqlx::query("INSERT INTO gate (relay, stage) VALUES ('test', 'open')")
        .execute(&db.pool)
        .await
        .expect("open the gate");
    // Refused for good, k:1 is dead: relay-b writes it into the table under the fence
    // lock, and waits for the table.
    wait_until_explained(
        "relay-b holds the fence lock and waits for the outbox table",
        WAIT,
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_locks w JOIN pg_locks f ON f.pid = w.pid \
                 WHERE w.locktype = 'relation' AND NOT w.granted \
                   AND w.relation = 'outbox'::regclass \
                   AND f.locktype = 'advisory' AND f.granted)",
            )
            .fetch_one(&db.pool)
            .await
            .expect("locks")
        },
        || slot_report(&db, &slot),
    )
    .await;
    b.signal("-STOP");
    let stopped = std::time::Instant::now();
    // Its insert goes through; its transaction, fence lock held, waits for a client that
    // does not answer.
    holder.commit().await.expect("release the outbox table");
    let c = RelayProcess::start(&db, &slot, "relay-c");
    let next = emit_one(&outbox, message("k", 2)).await;
    wait_until_explained(
        "relay-c takes the slot and publishes k:2",
        WAIT,
        || async { published("relay-c").await.contains(&next) },
        || async {
            format!(
                "{}\nrelay-c:\n{}",
                slot_report(&db, &slot).await,
                c.output_tail()
            )
        },
    )
    .await;
    eprintln!(
        "measured: relay-c published {:?} after relay-b froze with the fence lock",
        stopped.elapsed()
    );
    let before = b.output().len();
    b.signal("-CONT");
    wait_until_explained(
        "relay-b's table write fails and its session ends",
        WAIT,
        || async {
            b.output()
                .get(before..)
                .is_some_and(|new| new.contains("database session failed"))
        },
        || async { format!("relay-b:\n{}", b.output_tail()) },
    )
    .await;
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT event_type, last_error FROM outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .expect("rows");
    assert!(
        rows.is_empty(),
        "the frozen relay's dead letter was written after the standby took the slot: {rows:?}"
    );
    // relay-c published k:1 (not gated there) and k:2 after it.
    let by_c = published("relay-c").await;
    let at = |id: &Uuid| by_c.iter().position(|p| p == id);
    assert!(
        at(&gated).is_some() && at(&gated) < at(&next),
        "relay-c publishes k:1, then k:2: {by_c:?}"
    );
    drop(c);
    drop(b);
    cleanup(db, &slot).await;
}

/// The `n` of each published message of `key`, in publication order.
fn sent_of(published: &[outbox_core::OutboxRecord], key: &str) -> Vec<u64> {
    published
        .iter()
        .filter(|r| r.partition_key.as_deref() == Some(key))
        .map(|r| {
            serde_json::from_slice::<serde_json::Value>(&r.payload).expect("json")["n"]
                .as_u64()
                .expect("n")
        })
        .collect()
}

async fn emit_one(outbox: &Outbox, m: OutboxMessage) -> Uuid {
    let mut tx = outbox.begin().await.expect("begin");
    let id = tx.emit_message(m).expect("emit");
    tx.commit().await.expect("commit");
    id
}

fn poison(key: &str, n: usize) -> OutboxMessage {
    OutboxMessage::new("Poison", "counts", format!(r#"{{"key":"{key}","n":{n}}}"#)).with_key(key)
}

fn failing_poison() -> InMemoryPublisher {
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.event_type == "Poison",
        None,
        PublishError::permanent("message too large"),
    );
    publisher
}

/// A key parked behind a dead letter stays parked for a relay that starts later: its
/// first drain must not publish, from the stream, what waits behind the dead letter.
/// Failed on main: the new session read the table's parked keys only at its first probe,
/// after its first drain, and published p:2 ahead of the dead p:1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_relay_keeps_a_key_parked_behind_its_dead_letter() {
    use outbox_core::admin::Admin;
    let (db, outbox, slot) = wal_outbox().await;
    let admin = Admin::new(outbox.clone());
    let first = failing_poison();
    let relay = Relay::builder(outbox.clone(), first.clone()).spawn();
    emit_one(&outbox, message("p", 0)).await;
    emit_one(&outbox, poison("p", 1)).await;
    wait_until("the poison message is dead", WAIT, || async {
        admin.status().await.expect("status").dead == 1
    })
    .await;
    relay.shutdown().await;
    emit_one(&outbox, message("p", 2)).await; // while no relay runs
    emit_one(&outbox, message("q", 0)).await;
    let second = failing_poison();
    let relay = Relay::builder(outbox.clone(), second.clone()).spawn();
    wait_until("q:0 is published", WAIT, || async {
        sent_of(&second.published(), "q") == [0]
    })
    .await;
    assert_eq!(
        sent_of(&second.published(), "p"),
        Vec::<u64>::new(),
        "p:2 waits behind the dead p:1"
    );
    wait_until("p:2 is parked in the table", WAIT, || async {
        db.count("outbox").await == 2
    })
    .await;
    second.clear_failures();
    let dead = admin
        .dead(&outbox_core::admin::ListFilter::default())
        .await
        .expect("dead");
    assert_eq!(dead[0].held_back, 1);
    admin.release(&[dead[0].id]).await.expect("release");
    wait_until("p follows in order", WAIT, || async {
        sent_of(&second.published(), "p").len() >= 2
    })
    .await;
    assert_eq!(sent_of(&second.published(), "p"), [1, 2]);
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// A released dead letter that fails for good again is dead again, and the messages of
/// its key that were read from the table with it wait again behind it. Failed on main:
/// they stayed in memory and were published ahead of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_dead_letter_that_dies_again_keeps_its_key_parked() {
    use outbox_core::admin::Admin;
    let (db, outbox, slot) = wal_outbox().await;
    let admin = Admin::new(outbox.clone());
    let publisher = failing_poison();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_millis(100))
        .spawn();
    let poisoned = emit_one(&outbox, poison("p", 0)).await;
    emit_one(&outbox, message("p", 1)).await;
    emit_one(&outbox, message("p", 2)).await;
    wait_until("p:1 and p:2 wait behind the dead p:0", WAIT, || async {
        db.count("outbox").await == 3
    })
    .await;
    // Released while it still fails: it dies again.
    assert_eq!(admin.release(&[poisoned]).await.expect("release"), 1);
    wait_until("the released message is dead again", WAIT, || async {
        sqlx::query_scalar::<_, bool>("SELECT dead_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(poisoned)
            .fetch_one(&db.pool)
            .await
            .expect("row")
    })
    .await;
    // A drain after the second death: p:1 would go out ahead of q:0 if it could.
    emit_one(&outbox, message("q", 0)).await;
    wait_until("q:0 is published", WAIT, || async {
        sent_of(&publisher.published(), "q") == [0]
    })
    .await;
    assert_eq!(
        sent_of(&publisher.published(), "p"),
        Vec::<u64>::new(),
        "p:1 and p:2 wait behind the dead p:0"
    );
    let dead = admin
        .dead(&outbox_core::admin::ListFilter::default())
        .await
        .expect("dead");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].held_back, 2);
    publisher.clear_failures();
    admin.release(&[poisoned]).await.expect("release");
    wait_until("p goes out in order", WAIT, || async {
        sent_of(&publisher.published(), "p").len() >= 3
    })
    .await;
    assert_eq!(sent_of(&publisher.published(), "p"), [0, 1, 2]);
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// A released key with a long queue in the table drains at the relay's pace, not one
/// page per probe. Failed on main: 2,000 parked messages, read 40 per 2 s probe, took
/// more than a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_key_drains_its_queue_at_the_relays_pace() {
    use outbox_core::admin::Admin;
    let (db, outbox, slot) = wal_outbox().await;
    let admin = Admin::new(outbox.clone());
    let publisher = failing_poison();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_secs(2))
        .batch_size(10)
        .spawn();
    let poisoned = emit_one(&outbox, poison("p", 0)).await;
    for round in 0..20 {
        let mut tx = outbox.begin().await.expect("begin");
        for n in 0..100 {
            tx.emit_message(message("p", 1 + round * 100 + n))
                .expect("emit");
        }
        tx.commit().await.expect("commit");
    }
    wait_until(
        "2,000 messages wait behind the dead letter",
        WAIT,
        || async { db.count("outbox").await == 2001 },
    )
    .await;
    publisher.clear_failures();
    admin.release(&[poisoned]).await.expect("release");
    wait_until("the key's queue drains", WAIT, || async {
        publisher.published_count() >= 2001
    })
    .await;
    assert_eq!(
        sent_of(&publisher.published(), "p"),
        (0..2001).collect::<Vec<u64>>()
    );
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// A key that keeps failing (retryable) does not pin the stream: once the relay holds
/// its limit of messages in memory, the waiting key is set aside into the outbox table,
/// with its attempts, and the slot's position moves past it. Failed on main: the relay
/// kept every later message in memory and never confirmed past the failing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_keeps_failing_is_set_aside_and_the_slot_moves_on() {
    let (db, outbox, slot) = wal_outbox().await;
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.partition_key.as_deref() == Some("stuck"),
        None,
        PublishError::retryable("leader not available"),
    );
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .max_attempts(1_000_000)
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .batch_size(100) // at most 10,000 messages in memory
        .spawn();
    for round in 0..121 {
        let mut tx = outbox.begin().await.expect("begin");
        tx.emit_message(message("stuck", round)).expect("emit");
        if round < 120 {
            for n in 0..100 {
                tx.emit_message(message(&format!("k{}", n % 10), round * 10 + n / 10))
                    .expect("emit");
            }
        }
        tx.commit().await.expect("commit");
    }
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .expect("lsn");
    wait_until("the other keys flow", WAIT, || async {
        publisher.published_count() >= 12_000
    })
    .await;
    wait_until(
        "the slot is confirmed past the failing key",
        WAIT,
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .bind(&end)
            .fetch_one(&db.pool)
            .await
            .expect("slot")
        },
    )
    .await;
    assert_eq!(
        db.count("outbox").await,
        121,
        "the failing key waits in the table"
    );
    let attempts: i32 = sqlx::query_scalar("SELECT max(attempts) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("attempts");
    assert!(attempts >= 1, "its attempts went with it");
    assert_eq!(sent_of(&publisher.published(), "stuck"), Vec::<u64>::new());
    publisher.clear_failures();
    wait_until("the failing key follows, in order", WAIT, || async {
        publisher.published_count() >= 12_121
    })
    .await;
    assert_eq!(
        sent_of(&publisher.published(), "stuck"),
        (0..121).collect::<Vec<u64>>()
    );
    for k in 0..10 {
        let want: Vec<u64> = (0..1200).collect();
        assert_eq!(sent_of(&publisher.published(), &format!("k{k}")), want);
    }
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// A publisher whose broker is down: every message fails as unavailable, and each offer
/// is counted by id (what the relay holds in memory is what it offers, once per round).
fn broker_down() -> (
    InMemoryPublisher,
    std::sync::Arc<std::sync::Mutex<std::collections::HashMap<Uuid, usize>>>,
) {
    let publisher = InMemoryPublisher::new();
    let offers = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let counted = std::sync::Arc::clone(&offers);
    publisher.fail_when(
        move |m| {
            *counted.lock().expect("offers").entry(m.id).or_insert(0) += 1;
            true
        },
        None,
        PublishError::unavailable("broker down"),
    );
    (publisher, offers)
}

/// A broker outage with the relay's memory full does not set the buffer aside into the
/// outbox table: set-aside is for a key that keeps failing, not for an outage, so the
/// stream waits in the slot and every message goes out from memory once the broker is
/// back. Failed on main: all 10,000 buffered messages were written into the table, one
/// INSERT each, and every key then ran through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_with_the_memory_full_sets_nothing_aside() {
    let (db, outbox, slot) = wal_outbox().await;
    let (publisher, offers) = broker_down();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .spawn(); // batch_size 1000: at most 10,000 messages in memory
    // Every other message without a key: those are all offered in each round, so what
    // the relay holds shows in the offers.
    let mut keyless = Vec::new();
    for round in 0..21 {
        let mut tx = outbox.begin().await.expect("begin");
        for n in 0..500 {
            let i = round * 500 + n;
            if i % 2 == 0 {
                let m = OutboxMessage::new("Counted", "counts", format!(r#"{{"n":{i}}}"#));
                keyless.push(tx.emit_message(m).expect("emit"));
            } else {
                tx.emit_message(message(&format!("k{}", i % 50), i / 50))
                    .expect("emit");
            }
        }
        tx.commit().await.expect("commit");
    }
    let offered = |id: &Uuid| offers.lock().expect("offers").get(id).copied().unwrap_or(0);
    let held = || keyless.iter().filter(|id| offered(id) > 0).count();
    let state = || {
        format!(
            "keyless offered: {}, first offered {} times, stats {:?}, rows in the table: see below",
            held(),
            offered(&keyless[0]),
            relay.stats()
        )
    };
    outbox_tests::wait_until_or(
        "the relay holds its limit of 10,000 messages (5,000 without a key offered)",
        WAIT,
        || async { held() >= 5_000 },
        state,
    )
    .await;
    // Two more rounds: between them the relay waited with its memory full.
    let rounds = offered(&keyless[0]);
    outbox_tests::wait_until_or(
        "two more rounds of retries",
        WAIT,
        || async { offered(&keyless[0]) >= rounds + 2 },
        state,
    )
    .await;
    assert_eq!(
        db.count("outbox").await,
        0,
        "nothing set aside into the table during the outage ({})",
        state()
    );
    publisher.clear_failures();
    wait_until(
        "every message goes out once the broker is back",
        WAIT,
        || async { publisher.published_count() >= 10_500 },
    )
    .await;
    for k in 0..50 {
        let want: Vec<u64> = (0..10_500u64)
            .filter(|i| i % 2 == 1 && i % 50 == k)
            .map(|i| i / 50)
            .collect();
        assert_eq!(
            sent_of(&publisher.published(), &format!("k{k}")),
            want,
            "key k{k}"
        );
    }
    assert_eq!(
        db.count("outbox").await,
        0,
        "nothing went through the table"
    );
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// The relay's memory is bounded in bytes too, not only in messages: 100 messages of
/// 64 KiB with a 1 MiB bound, the broker down: the relay holds (offers) at most 16 of
/// them at once, and all 100 go out once the broker is back. Failed on main (the bound
/// left out, as main has none): all 100 (6.4 MiB) were held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_memory_is_bounded_in_bytes() {
    let (db, outbox, slot) = wal_outbox().await;
    let (publisher, offers) = broker_down();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .max_batch_bytes(128 * 1024)
        .wal_buffer_bytes(1024 * 1024)
        .spawn();
    let filler = "x".repeat(64 * 1024);
    let mut ids = Vec::new();
    for chunk in 0..10 {
        let mut tx = outbox.begin().await.expect("begin");
        for n in 0..10 {
            let payload = format!(r#"{{"n":{},"filler":"{filler}"}}"#, chunk * 10 + n);
            ids.push(
                tx.emit_message(OutboxMessage::new("Big", "counts", payload))
                    .expect("emit"),
            );
        }
        tx.commit().await.expect("commit");
    }
    let offered = |id: &Uuid| offers.lock().expect("offers").get(id).copied().unwrap_or(0);
    let held = || ids.iter().filter(|id| offered(id) > 0).count();
    let state = || {
        format!(
            "offered: {} distinct, first offered {} times, stats {:?}",
            held(),
            offered(&ids[0]),
            relay.stats()
        )
    };
    // Two full rounds of retries after the first: everything held has been offered.
    outbox_tests::wait_until_or(
        "three rounds of retries",
        WAIT,
        || async { offered(&ids[0]) >= 3 },
        state,
    )
    .await;
    // 1 MiB holds 15 of these messages (64 KiB and some each); the 16th crosses it.
    assert!(
        held() <= 16,
        "at most 1 MiB (plus the message that crossed it) in memory: {}",
        state()
    );
    publisher.clear_failures();
    wait_until("all 100 go out once the broker is back", WAIT, || async {
        publisher.published_count() >= 100
    })
    .await;
    let sent: HashSet<Uuid> = publisher.published().iter().map(|r| r.id).collect();
    assert!(ids.iter().all(|id| sent.contains(id)), "every message sent");
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// A connection switched to another client encoding is refused before anything reaches
/// the WAL, on the commit path and the bound path. Failed on main: the guard sat in an
/// unreferenced sub-select, which PostgreSQL never evaluates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_not_in_utf8_is_refused_in_wal_mode() {
    let (db, outbox, slot) = wal_outbox_in(TestDb::with_max_connections(1).await).await;
    let publisher = InMemoryPublisher::new();
    sqlx::query("SET client_encoding = 'LATIN1'")
        .execute(&db.pool)
        .await
        .expect("switch the pooled connection to LATIN1");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(message("é", 0)).expect("emit");
    let err = tx.commit().await.expect_err("refused on the commit path");
    let shown = outbox_core::ErrorChain(&err).to_string();
    assert!(shown.contains("client_encoding"), "{shown}");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(message("é", 1)).expect("emit");
    let err = tx.flush().await.expect_err("refused on the bound path");
    let shown = outbox_core::ErrorChain(&err).to_string();
    assert!(shown.contains("client_encoding"), "{shown}");
    drop(tx);
    sqlx::query("SET client_encoding = 'UTF8'")
        .execute(&db.pool)
        .await
        .expect("back to UTF-8");
    emit_one(&outbox, message("é", 2)).await;
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    assert!(
        publisher.wait_for(1, WAIT).await,
        "the UTF-8 commit arrives"
    );
    // Nothing else came before it: the refused commits wrote nothing.
    assert_eq!(sent_of(&publisher.published(), "é"), [2]);
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// The relay does not create a missing slot: one made now would skip, silently, what
/// was committed since the old one was lost. It refuses (and retries) until `migrate`
/// creates it. Failed on main: the relay created the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_refuses_a_missing_slot_and_does_not_create_it() {
    let (db, outbox, slot) = wal_outbox().await;
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&db.pool)
        .await
        .expect("drop the slot");
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .reconnect_delay(Duration::from_millis(100))
        .spawn();
    wait_until("the relay refuses, twice", WAIT, || async {
        relay.stats().reconnects >= 2
    })
    .await;
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
    )
    .bind(&slot)
    .fetch_one(&db.pool)
    .await
    .expect("slot");
    assert!(!exists, "the relay created the slot");
    outbox.migrate().await.expect("migrate creates it");
    emit_one(&outbox, message("a", 0)).await;
    assert!(publisher.wait_for(1, WAIT).await, "the relay goes on");
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// `OnDeadLetter::SkipKey`: the key's later messages go on without its dead letter, and
/// the released dead letter follows them. Failed on main: WAL mode parked the key anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_key_lets_the_key_go_on_without_its_dead_letter() {
    use outbox_core::admin::Admin;
    use outbox_core::config::OnDeadLetter;
    let (db, outbox, slot) = wal_outbox().await;
    let admin = Admin::new(outbox.clone());
    let publisher = failing_poison();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_millis(100))
        .on_dead_letter(OnDeadLetter::SkipKey)
        .spawn();
    emit_one(&outbox, message("p", 0)).await;
    let poisoned = emit_one(&outbox, poison("p", 1)).await;
    emit_one(&outbox, message("p", 2)).await;
    wait_until("p:2 goes on", WAIT, || async {
        sent_of(&publisher.published(), "p") == [0, 2]
    })
    .await;
    emit_one(&outbox, message("p", 3)).await;
    wait_until("p:3 goes on", WAIT, || async {
        sent_of(&publisher.published(), "p") == [0, 2, 3]
    })
    .await;
    assert_eq!(
        db.count("outbox").await,
        1,
        "only the dead letter is in the table"
    );
    publisher.clear_failures();
    admin.release(&[poisoned]).await.expect("release");
    wait_until("the released dead letter follows", WAIT, || async {
        sent_of(&publisher.published(), "p") == [0, 2, 3, 1]
    })
    .await;
    relay.shutdown().await;
    cleanup(db, &slot).await;
}

/// Switching from table mode to WAL mode needs no drain: the WAL relay publishes the
/// rows still pending in the table, and a key with rows there waits for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_left_from_table_mode_go_out_first_in_key_order() {
    let (db, outbox, slot) = wal_outbox().await;
    let table_mode = Outbox::new(db.pool.clone());
    let mut tx = table_mode.begin().await.expect("begin");
    for n in 0..3 {
        tx.emit_message(message("a", n)).expect("emit");
    }
    tx.commit().await.expect("commit");
    emit_one(&outbox, message("a", 3)).await; // into the WAL
    emit_one(&outbox, message("b", 0)).await;
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    wait_until("everything is published", WAIT, || async {
        publisher.published_count() >= 5
    })
    .await;
    assert_eq!(sent_of(&publisher.published(), "a"), [0, 1, 2, 3]);
    wait_until("the table rows are marked sent", WAIT, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .expect("count")
            == 0
    })
    .await;
    relay.shutdown().await;
    cleanup(db, &slot).await;
}
