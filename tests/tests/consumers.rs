//! One suite for every broker's consumer: the same tests against Kafka, NATS JetStream
//! and RabbitMQ, each through its `Transport` and the consumer layer of `outbox-core`,
//! with a PostgreSQL inbox.
//!
//! - A consumer SIGKILLed after its database commits and before its acknowledgements:
//!   every redelivery is skipped by the inbox.
//! - A poison message follows the policy (dead-lettered after its attempts; its key
//!   goes on).
//! - Per-key order holds while handlers are retried.
//! - A handler retried forever holds back only its own key.
//! - The handler's decoder gets the payload's exact bytes; a payload it cannot read
//!   (another content type) follows the undecodable policy.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::consumer::{Consumer, ConsumerBuilder, Policy, Transport};
use outbox_core::inbox::Inbox;
use outbox_core::{Outbox, sqlx};
use outbox_tests::consumers::{Broker, CommitBeforeAck, job};
use outbox_tests::kafka::Job;
use outbox_tests::process::Process;
use outbox_tests::{TestDb, database_url, wait_until};

const WAIT: Duration = Duration::from_secs(60);

async fn setup() -> (TestDb, Outbox) {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query(
        "CREATE TABLE effects (at bigserial PRIMARY KEY, key text NOT NULL, n int NOT NULL, run text NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("create effects");
    (db, outbox)
}

/// A consumer group (Kafka) or durable consumer name (NATS) of its own; NATS names
/// hold no `.`.
fn group() -> String {
    outbox_tests::kafka::unique("suite-group").replace('.', "-")
}

async fn effects(db: &TestDb, run: &str) -> Vec<(String, i32)> {
    sqlx::query_as("SELECT key, n FROM effects WHERE run = $1 ORDER BY at")
        .bind(run)
        .fetch_all(&db.pool)
        .await
        .expect("effects")
}

/// The numbers each key's handler committed, in commit order.
async fn by_key(db: &TestDb, run: &str) -> HashMap<String, Vec<i32>> {
    let mut keys: HashMap<String, Vec<i32>> = HashMap::new();
    for (key, n) in effects(db, run).await {
        keys.entry(key).or_default().push(n);
    }
    keys
}

/// A consumer of `Job`s that records each in `effects` under `run`, and fails while
/// `fail(n, attempt)` says so (`attempt` counts from 1).
fn consumer<T: Transport>(
    transport: T,
    outbox: &Outbox,
    run: &'static str,
    fail: impl Fn(i32, u32) -> bool + Send + Sync + 'static,
) -> ConsumerBuilder<T> {
    let attempts: Arc<Mutex<HashMap<i32, u32>>> = Arc::default();
    let fail = Arc::new(fail);
    Consumer::builder(transport, Inbox::new(outbox, "jobs"))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .on_event_type::<Job, _>("Job", move |tx, msg| {
            let attempt = {
                let mut attempts = attempts.lock().expect("attempts");
                let a = attempts.entry(msg.event.n).or_default();
                *a += 1;
                *a
            };
            let fail = Arc::clone(&fail);
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (key, n, run) VALUES ($1, $2, $3)")
                    .bind(msg.key.clone().unwrap_or_default())
                    .bind(msg.event.n)
                    .bind(run)
                    .execute(&mut **tx)
                    .await?;
                if fail(msg.event.n, attempt) {
                    return Err(format!("job {} fails on attempt {attempt}", msg.event.n).into());
                }
                Ok(())
            })
        })
}

async fn killed_after_its_commits_and_before_its_acks<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let group = group();
    let jobs: Vec<_> = (0..20)
        .map(|n| job(&place.destination, &format!("k{}", n % 4), n))
        .collect();
    B::publish(&place, &jobs).await;

    // The child commits all 20 and acknowledges none; then it is SIGKILLed.
    let child = Process::start(
        Command::new(env!("CARGO_BIN_EXE_consumer_process"))
            .args([B::NAME, &database_url(), &db.schema])
            .args(place.to_args())
            .arg(&group),
    );
    wait_until("the consumer process committed 20 jobs", WAIT, || async {
        effects(&db, "child").await.len() >= 20
    })
    .await;
    child.signal("-KILL");
    drop(child);
    assert_eq!(
        db.count("outbox_processed").await,
        20,
        "20 database commits"
    );

    // The same group and inbox again: all 20 come back and none runs again; a new job
    // runs.
    let consumer = consumer(
        B::transport(&place, &group).await,
        &outbox,
        "again",
        |_, _| false,
    )
    .build()
    .expect("consumer")
    .spawn();
    B::publish(&place, &[job(&place.destination, "k0", 20)]).await;
    wait_until(
        "the redelivery and the new job were consumed",
        WAIT,
        || async {
            let s = consumer.stats();
            s.duplicates >= 20 && s.handled >= 1
        },
    )
    .await;
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!(stats.handled, 1, "only the new job ran: {stats:?}");
    assert_eq!(effects(&db, "child").await.len(), 20);
    assert_eq!(effects(&db, "again").await, [("k0".to_owned(), 20)]);
    B::remove(place).await;
    db.cleanup().await;
}

async fn a_poison_message_is_dead_lettered_and_its_key_goes_on<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let group = group();
    let jobs: Vec<_> = (0..3).map(|n| job(&place.destination, "a", n)).collect();
    B::publish(&place, &jobs).await;
    let consumer = consumer(
        B::transport(&place, &group).await,
        &outbox,
        "run",
        |n, _| n == 1,
    )
    .handler_attempts(2, Policy::DeadLetter)
    .build()
    .expect("consumer")
    .spawn();
    let stats = outbox_tests::consumers::settle(consumer, 3, WAIT).await;
    assert_eq!(
        (stats.handled, stats.dead_lettered, stats.handler_errors),
        (2, 1, 2),
        "{stats:?}"
    );
    assert_eq!(
        by_key(&db, "run").await["a"],
        [0, 2],
        "job 1's effects rolled back; 0 and 2 committed in order"
    );
    let dead = B::dead_letters(&place, 1, WAIT).await;
    assert_eq!(
        dead[0].get("message-id"),
        Some(&jobs[1].id.to_string()),
        "{dead:?}"
    );
    assert_eq!(dead[0].get("event-type").map(String::as_str), Some("Job"));
    let reason = &dead[0]["dlq-reason"];
    assert!(
        reason.contains("failed 2 times") && reason.contains("job 1 fails on attempt 2"),
        "{reason}"
    );
    B::remove(place).await;
    db.cleanup().await;
}

async fn per_key_order_holds_while_handlers_are_retried<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let group = group();
    let keys = ["a", "b", "c"];
    let jobs: Vec<_> = (0..30)
        .map(|n| job(&place.destination, keys[n as usize % 3], n))
        .collect();
    B::publish(&place, &jobs).await;
    // Every fifth job fails twice before it succeeds. Each acknowledgement checks that
    // its message's transaction committed first.
    let transport = CommitBeforeAck {
        inner: B::transport(&place, &group).await,
        pool: db.pool.clone(),
        acks: Arc::default(),
        early: Arc::default(),
    };
    let (acks, early) = (Arc::clone(&transport.acks), Arc::clone(&transport.early));
    let consumer = consumer(transport, &outbox, "run", |n, attempt| {
        n % 5 == 2 && attempt <= 2
    })
    .build()
    .expect("consumer")
    .spawn();
    wait_until("all 30 handled", WAIT, || async {
        consumer.stats().handled >= 30
    })
    .await;
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!((stats.handled, stats.handler_errors), (30, 12), "{stats:?}");
    assert_eq!(
        acks.load(Ordering::SeqCst),
        30,
        "one acknowledgement per message"
    );
    assert_eq!(
        early.load(Ordering::SeqCst),
        0,
        "no acknowledgement before its commit"
    );
    let committed = by_key(&db, "run").await;
    for (i, key) in keys.iter().enumerate() {
        let expected: Vec<i32> = (0..30).filter(|n| n % 3 == i as i32).collect();
        assert_eq!(committed[*key], expected, "key {key} in order, each once");
    }
    B::remove(place).await;
    db.cleanup().await;
}

async fn a_handler_retried_forever_holds_back_only_its_own_key<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let group = group();
    let mut jobs = vec![job(&place.destination, "stuck", 0)];
    jobs.extend((1..=10).map(|n| job(&place.destination, "free", n)));
    jobs.push(job(&place.destination, "stuck", 11));
    B::publish(&place, &jobs).await;
    let consumer = consumer(
        B::transport(&place, &group).await,
        &outbox,
        "run",
        |n, _| n == 0,
    )
    .build()
    .expect("consumer")
    .spawn();
    wait_until("the other key's ten jobs handled", WAIT, || async {
        consumer.stats().handled >= 10
    })
    .await;
    wait_until("the stuck job retried", WAIT, || async {
        consumer.stats().handler_errors >= 3
    })
    .await;
    let committed = by_key(&db, "run").await;
    assert_eq!(committed["free"], (1..=10).collect::<Vec<_>>());
    assert!(!committed.contains_key("stuck"), "{committed:?}");
    assert!(!consumer.is_finished());
    assert_eq!(consumer.stats().handled, 10, "job 11 waits behind job 0");
    consumer
        .shutdown()
        .await
        .expect("a shutdown interrupts the retries");
    B::remove(place).await;
    db.cleanup().await;
}

async fn messages_held_longer_than_the_ack_wait_are_not_delivered_twice<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let jobs: Vec<_> = (0..3).map(|n| job(&place.destination, "a", n)).collect();
    B::publish(&place, &jobs).await;
    // Job 0 fails 100 times (about 5 s, over twice JetStream's AckWait in this suite)
    // while jobs 1 and 2 wait behind it.
    let consumer = consumer(
        B::transport(&place, &group()).await,
        &outbox,
        "run",
        |n, attempt| n == 0 && attempt <= 100,
    )
    .build()
    .expect("consumer")
    .spawn();
    wait_until("all three handled", WAIT, || async {
        consumer.stats().handled >= 3
    })
    .await;
    // Anything delivered again arrives right behind the originals.
    B::publish(&place, &[job(&place.destination, "a", 3)]).await;
    wait_until("the fourth handled", WAIT, || async {
        consumer.stats().handled >= 4
    })
    .await;
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        (stats.handled, stats.duplicates, stats.handler_errors),
        (4, 0, 100),
        "{stats:?}"
    );
    assert_eq!(by_key(&db, "run").await["a"], [0, 1, 2, 3]);
    B::remove(place).await;
    db.cleanup().await;
}

async fn a_panicking_handler_is_a_failing_one<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let jobs: Vec<_> = (0..3).map(|n| job(&place.destination, "a", n)).collect();
    B::publish(&place, &jobs).await;
    let consumer = Consumer::builder(
        B::transport(&place, &group()).await,
        Inbox::new(&outbox, "jobs"),
    )
    .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
    .handler_attempts(2, Policy::Skip)
    .on_event_type::<Job, _>("Job", |tx, msg| {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (key, n, run) VALUES ('a', $1, 'run')")
                .bind(msg.event.n)
                .execute(&mut **tx)
                .await?;
            assert_ne!(msg.event.n, 1, "job 1 panics");
            Ok(())
        })
    })
    .build()
    .expect("consumer")
    .spawn();
    wait_until("all three consumed", WAIT, || async {
        let s = consumer.stats();
        s.handled + s.skipped >= 3
    })
    .await;
    let stats = consumer.stats();
    assert!(!consumer.is_finished(), "the consumer survived the panics");
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        (stats.handled, stats.skipped, stats.handler_errors),
        (2, 1, 2),
        "{stats:?}"
    );
    assert_eq!(
        by_key(&db, "run").await["a"],
        [0, 2],
        "job 1's effects rolled back"
    );
    B::remove(place).await;
    db.cleanup().await;
}

async fn a_message_in_hand_at_shutdown_comes_again_after_a_restart<B: Broker>() {
    let (db, outbox) = setup().await;
    let place = B::place().await;
    let group = group();
    let mut jobs = vec![job(&place.destination, "slow", 0)];
    jobs.extend((1..=10).map(|n| job(&place.destination, "fast", n)));
    B::publish(&place, &jobs).await;
    // Job 0 fails until the consumer stops; the jobs after it, of another key, are done.
    let first = consumer(
        B::transport(&place, &group).await,
        &outbox,
        "first",
        |n, _| n == 0,
    )
    .build()
    .expect("consumer")
    .spawn();
    wait_until("the other key's jobs handled", WAIT, || async {
        first.stats().handled >= 10 && first.stats().handler_errors >= 1
    })
    .await;
    first.shutdown().await.expect("consumer");
    // Restarted: job 0 comes again (nothing acknowledged it, and no later message's
    // acknowledgement covered it), and runs; whatever else comes again is skipped.
    let second = consumer(
        B::transport(&place, &group).await,
        &outbox,
        "second",
        |_, _| false,
    )
    .build()
    .expect("consumer")
    .spawn();
    wait_until("job 0 handled after the restart", WAIT, || async {
        second.stats().handled >= 1
    })
    .await;
    let stats = second.stats();
    second.shutdown().await.expect("consumer");
    assert_eq!(stats.handled, 1, "{stats:?}");
    assert!(stats.duplicates <= 10, "{stats:?}");
    assert_eq!(effects(&db, "second").await, [("slow".to_owned(), 0)]);
    assert_eq!(
        by_key(&db, "first").await["fast"],
        (1..=10).collect::<Vec<_>>()
    );
    B::remove(place).await;
    db.cleanup().await;
}

/// What the consumer layer hands to the decoder is the payload as emitted, byte for
/// byte (a `Box<RawValue>` handler sees the JSON text as written: spaces, key order,
/// `1e2`, an escape); a payload in a content type the JSON handler cannot read is
/// undecodable, and dead-lettered by that policy, not handed over as garbage.
async fn the_decoder_gets_the_exact_bytes_and_another_format_is_undecodable<B: Broker>() {
    let (db, outbox) = setup().await;
    sqlx::query("CREATE TABLE raw (id uuid PRIMARY KEY, text text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create raw");
    let place = B::place().await;
    let json = r#"{"z": 1,  "a": [1.10, 1e2, "\u00e9"]}"#;
    let mut as_written = job(&place.destination, "a", 0);
    as_written.payload = json.into();
    as_written.event_type = "Raw".to_owned();
    let mut binary = job(&place.destination, "b", 1);
    binary.payload = vec![0x08, 0x96, 0x01, 0xff].into();
    binary.content_type = "application/x-protobuf".into();
    binary.event_type = "Raw".to_owned();
    B::publish(&place, &[as_written.clone(), binary.clone()]).await;
    let consumer = Consumer::builder(
        B::transport(&place, &group()).await,
        Inbox::new(&outbox, "raw"),
    )
    .on_event_type::<Box<serde_json::value::RawValue>, _>("Raw", |tx, msg| {
        Box::pin(async move {
            sqlx::query("INSERT INTO raw (id, text) VALUES ($1, $2)")
                .bind(msg.id)
                .bind(msg.event.get())
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    })
    .on_undecodable(Policy::DeadLetter)
    .build()
    .expect("consumer")
    .spawn();
    let stats = outbox_tests::consumers::settle(consumer, 2, WAIT).await;
    assert_eq!((stats.handled, stats.dead_lettered), (1, 1), "{stats:?}");
    let stored: Vec<(uuid::Uuid, String)> = sqlx::query_as("SELECT id, text FROM raw")
        .fetch_all(&db.pool)
        .await
        .expect("raw");
    assert_eq!(stored, [(as_written.id, json.to_owned())]);
    let dead = B::dead_letters(&place, 1, WAIT).await;
    assert_eq!(
        dead[0].get("message-id"),
        Some(&binary.id.to_string()),
        "{dead:?}"
    );
    let reason = &dead[0]["dlq-reason"];
    assert!(
        reason.contains("application/x-protobuf") && reason.contains("reads JSON"),
        "{reason}"
    );
    B::remove(place).await;
    db.cleanup().await;
}

macro_rules! suite {
    ($broker:ident, $ty:ty) => {
        mod $broker {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_consumer_killed_after_its_commits_and_before_its_acks_skips_every_redelivery() {
                super::killed_after_its_commits_and_before_its_acks::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_poison_message_is_dead_lettered_and_its_key_goes_on() {
                super::a_poison_message_is_dead_lettered_and_its_key_goes_on::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_in_hand_at_shutdown_comes_again_after_a_restart() {
                super::a_message_in_hand_at_shutdown_comes_again_after_a_restart::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_panicking_handler_is_a_failing_one() {
                super::a_panicking_handler_is_a_failing_one::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn per_key_order_holds_while_handlers_are_retried() {
                super::per_key_order_holds_while_handlers_are_retried::<$ty>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn messages_held_longer_than_the_ack_wait_are_not_delivered_twice() {
                super::messages_held_longer_than_the_ack_wait_are_not_delivered_twice::<$ty>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_decoder_gets_the_exact_bytes_and_another_format_is_undecodable() {
                super::the_decoder_gets_the_exact_bytes_and_another_format_is_undecodable::<$ty>()
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_retried_forever_holds_back_only_its_own_key() {
                super::a_handler_retried_forever_holds_back_only_its_own_key::<$ty>().await;
            }
        }
    };
}

suite!(kafka, outbox_tests::consumers::Kafka);
suite!(nats, outbox_tests::consumers::Nats);
suite!(rabbitmq, outbox_tests::consumers::Rabbit);
