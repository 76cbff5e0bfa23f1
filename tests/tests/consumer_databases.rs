//! The consumer layer with each inbox database (PostgreSQL, MariaDB/MySQL, SQLite)
//! behind each broker's transport: messages handled and committed by a consumer that
//! stopped before acknowledging them come again, and the inbox of that database skips
//! every one. A handler failing on one message shows, in that database, in
//! `Admin::status`, the doctor and the table of failing messages, and goes from them
//! once the message is handled; the consumer's heartbeat shows its instance, what it
//! did and its transport's lag, and goes when it stops.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::Outbox;
use outbox_core::admin::{Admin, ConsumerStatus};
use outbox_core::consumer::{Consumer, ConsumerBuilder, Transport};
use outbox_core::doctor::{Doctor, Limits, Report, Severity};
use outbox_core::inbox::Inbox;
use outbox_tests::backends::TestBackend;
use outbox_tests::consumers::{Broker, NeverAck, job};
use outbox_tests::kafka::Job;
use outbox_tests::{wait_until, wait_until_explained};

const WAIT: Duration = Duration::from_secs(60);

/// A consumer of `Job`s recording each in `effects`.
fn consumer<DB: TestBackend, T: Transport>(
    transport: T,
    outbox: &Outbox<DB>,
) -> ConsumerBuilder<T, DB> {
    Consumer::builder(transport, Inbox::new(outbox, "jobs"))
        .concurrency(2)
        .on_event_type::<Job, _>("Job", |tx, msg| {
            Box::pin(async move {
                let sql = format!("INSERT INTO effects (n) VALUES ({})", msg.event.n);
                DB::exec_on(&mut **tx, &sql).await;
                Ok(())
            })
        })
}

async fn redeliveries_are_skipped<DB: TestBackend, B: Broker>() {
    let fixture = DB::fixture().await;
    let outbox = fixture.outbox.clone();
    DB::exec(&fixture, "CREATE TABLE effects (n INTEGER NOT NULL)").await;
    let place = B::place().await;
    let group = outbox_tests::kafka::unique("db-group").replace('.', "-");
    let jobs: Vec<_> = (0..5).map(|n| job(&place.destination, "k", n)).collect();
    B::publish(&place, &jobs).await;

    // Handled and committed, never acknowledged.
    let first = consumer(NeverAck(B::transport(&place, &group).await), &outbox)
        .build()
        .expect("consumer")
        .spawn();
    wait_until("five handled", WAIT, || async {
        first.stats().handled >= 5
    })
    .await;
    first.shutdown().await.expect("consumer");

    let again = consumer(B::transport(&place, &group).await, &outbox)
        .build()
        .expect("consumer")
        .spawn();
    wait_until("five skipped as duplicates", WAIT, || async {
        again.stats().duplicates >= 5
    })
    .await;
    let stats = again.stats();
    again.shutdown().await.expect("consumer");
    assert_eq!((stats.handled, stats.duplicates), (0, 5), "{stats:?}");
    assert_eq!(DB::int(&fixture, "SELECT count(*) FROM effects").await, 5);
    B::remove(place).await;
    DB::cleanup(fixture).await;
}

/// The consumer `jobs`' entry in the status, if it has one.
async fn jobs_status<DB: TestBackend>(outbox: &Outbox<DB>) -> Option<ConsumerStatus> {
    let status = Admin::new(outbox.clone()).status().await.expect("status");
    status.consumers.into_iter().find(|c| c.consumer == "jobs")
}

/// What a wait for `jobs`' status prints when it fails: the status and the counters.
async fn explain<DB: TestBackend>(
    outbox: &Outbox<DB>,
    consumer: &outbox_core::consumer::ConsumerHandle,
) -> String {
    format!(
        "{:?}; stats {:?}",
        jobs_status(outbox).await,
        consumer.stats()
    )
}

async fn a_failing_handler_is_visible<DB: TestBackend, B: Broker>() {
    let fixture = DB::fixture().await;
    let outbox = fixture.outbox.clone();
    DB::exec(&fixture, "CREATE TABLE effects (n INTEGER NOT NULL)").await;
    let place = B::place().await;
    let group = outbox_tests::kafka::unique("failing-group").replace('.', "-");
    let jobs = [
        job(&place.destination, "stuck", 0),
        job(&place.destination, "stuck", 1),
        job(&place.destination, "free", 2),
    ];
    let stuck_id = jobs[0].id;
    // One publish call each: the test broker (tansu) reports a high watermark of the
    // last batch's first offset + 1 after a batch of several records (end offset 1 for
    // offsets 0..2, to librdkafka and kafka-python alike), which would hide two of the
    // three from the Kafka lag checked below.
    for job in &jobs {
        B::publish(&place, std::slice::from_ref(job)).await;
    }

    // Job 0 fails until `fail` is cleared; it holds back job 1 (same key), not job 2.
    let fail = Arc::new(AtomicBool::new(true));
    let failing = Arc::clone(&fail);
    let consumer = Consumer::builder(
        B::transport(&place, &group).await,
        Inbox::new(&outbox, "jobs"),
    )
    .concurrency(2)
    .heartbeat(Duration::from_millis(200))
    .retry_backoff(Duration::from_millis(20), Duration::from_millis(100))
    .on_event_type::<Job, _>("Job", move |tx, msg| {
        let fail = msg.event.n == 0 && failing.load(Ordering::SeqCst);
        Box::pin(async move {
            if fail {
                return Err("the projection has no row for order 0".into());
            }
            let sql = format!("INSERT INTO effects (n) VALUES ({})", msg.event.n);
            DB::exec_on(&mut **tx, &sql).await;
            Ok(())
        })
    })
    .build()
    .expect("consumer")
    .spawn();

    wait_until_explained(
        "status to show job 0 failing for a while, and job 2 processed",
        WAIT,
        || async {
            jobs_status(&outbox).await.is_some_and(|c| {
                c.processed_last_minute == 1
                    && c.failing.len() == 1
                    && c.failing[0].attempts >= 3
                    && c.failing[0].failing_seconds > 0.0
                    && c.instances.first().is_some_and(|i| i.handler_errors >= 3)
                    && c.lag.is_some()
            })
        },
        || explain(&outbox, &consumer),
    )
    .await;
    let status = jobs_status(&outbox).await.expect("the consumer is listed");
    let failing = &status.failing[0];
    assert_eq!(failing.message_id, stuck_id, "{failing:?}");
    assert_eq!(failing.event_type, "Job");
    assert_eq!(failing.partition_key.as_deref(), Some("stuck"));
    assert!(
        failing
            .last_error
            .contains("the projection has no row for order 0"),
        "{failing:?}"
    );
    assert!(!failing.origin.is_empty(), "{failing:?}");
    assert!(
        failing.last_failed_at >= failing.first_failed_at,
        "{failing:?}"
    );
    // The one running instance's heartbeat: alive, what it did, and its transport's lag
    // (Kafka: job 0's offset is not committed, so the partition lags by 3; NATS and
    // RabbitMQ: nothing left undelivered).
    let [instance] = status.instances.as_slice() else {
        panic!("one instance: {status:?}");
    };
    assert!(
        instance.alive && instance.transport == B::NAME,
        "{instance:?}"
    );
    assert_eq!(instance.handled, 1, "{instance:?}");
    let stuck_lag = if B::NAME == "kafka" { 3 } else { 0 };
    assert_eq!(status.lag, Some(stuck_lag), "{status:?}");

    // The doctor: a note under the limit, an action over it.
    let finding = |report: &Report| {
        report
            .of("consumer-failing")
            .first()
            .map(|f| (f.severity, f.summary.clone(), f.details.clone()))
    };
    let patient = Doctor::new(outbox.clone()).examine().await.expect("doctor");
    let (severity, summary, details) = finding(&patient).expect("a consumer-failing finding");
    assert_eq!(severity, Severity::Note, "{summary}");
    assert!(
        !patient.needs_action()
            || patient
                .findings
                .iter()
                .any(|f| f.check != "consumer-failing" && f.severity == Severity::Action),
        "{patient:?}"
    );
    assert!(
        summary.contains("consumer jobs") && summary.contains("1 message(s)"),
        "{summary}"
    );
    assert!(
        details[0].contains(&stuck_id.to_string()) && details[0].contains("key stuck"),
        "{details:?}"
    );
    let strict = Doctor::new(outbox.clone())
        .limits(Limits::default().consumer_failing(Duration::ZERO))
        .examine()
        .await
        .expect("doctor");
    assert_eq!(finding(&strict).expect("finding").0, Severity::Action);
    assert!(strict.needs_action());

    // Fixed: both jobs of the key go through, and the failure is gone from the table.
    fail.store(false, Ordering::SeqCst);
    wait_until_explained(
        "jobs 0 and 1 handled and nothing failing",
        WAIT,
        || async {
            jobs_status(&outbox).await.is_some_and(|c| {
                c.processed_last_minute == 3 && c.failing.is_empty() && c.lag == Some(0)
            })
        },
        || explain(&outbox, &consumer),
    )
    .await;
    consumer.shutdown().await.expect("consumer");
    // A graceful stop deletes the instance's row: gone, not dead.
    let after = jobs_status(&outbox)
        .await
        .expect("still listed: it processed lately");
    assert!(after.instances.is_empty(), "{after:?}");
    assert_eq!(
        DB::int(&fixture, "SELECT count(*) FROM outbox_processed_failing").await,
        0,
        "the record of the failures is removed once the message is handled"
    );
    assert_eq!(DB::int(&fixture, "SELECT count(*) FROM effects").await, 3);
    B::remove(place).await;
    DB::cleanup(fixture).await;
}

/// One test per (database, broker) pair: `$name: $db, $broker;` runs `$test::<$db, $broker>`.
macro_rules! cases {
    ($test:ident { $($name:ident: $db:ty, $broker:ty;)* }) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $test::<$db, $broker>().await;
            }
        )*
    };
}

use outbox_core::sqlx::{MySql, Postgres, Sqlite};
use outbox_tests::consumers::{Kafka, Nats, Rabbit};

cases! { redeliveries_are_skipped {
    postgres_inbox_behind_kafka: Postgres, Kafka;
    postgres_inbox_behind_nats: Postgres, Nats;
    postgres_inbox_behind_rabbitmq: Postgres, Rabbit;
    mysql_inbox_behind_kafka: MySql, Kafka;
    mysql_inbox_behind_nats: MySql, Nats;
    mysql_inbox_behind_rabbitmq: MySql, Rabbit;
    sqlite_inbox_behind_kafka: Sqlite, Kafka;
    sqlite_inbox_behind_nats: Sqlite, Nats;
    sqlite_inbox_behind_rabbitmq: Sqlite, Rabbit;
} }

cases! { a_failing_handler_is_visible {
    postgres_failing_handler_behind_nats: Postgres, Nats;
    mysql_failing_handler_behind_rabbitmq: MySql, Rabbit;
    sqlite_failing_handler_behind_kafka: Sqlite, Kafka;
} }

/// A consumer whose `run` future is dropped (its task aborted) stops its heartbeat at
/// once: it is shown as gone, not as alive for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_consumer_stops_its_heartbeat() {
    let fixture = <Postgres as TestBackend>::fixture().await;
    let outbox = fixture.outbox.clone();
    let place = <Nats as Broker>::place().await;
    let group = outbox_tests::kafka::unique("dropped-group").replace('.', "-");
    let consumer = Consumer::builder(
        <Nats as Broker>::transport(&place, &group).await,
        Inbox::new(&outbox, "jobs"),
    )
    .heartbeat(Duration::from_millis(100))
    .on_event_type::<Job, _>("Job", |_tx, _msg| Box::pin(async { Ok(()) }))
    .build()
    .expect("consumer");
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(consumer.run(shutdown));
    let alive = |c: &ConsumerStatus| c.instances.iter().any(|i| i.alive);
    wait_until_explained(
        "the instance's heartbeat",
        WAIT,
        || async { jobs_status(&outbox).await.is_some_and(|c| alive(&c)) },
        || async { format!("{:?}", jobs_status(&outbox).await) },
    )
    .await;
    task.abort();
    wait_until_explained(
        "the aborted instance shown as gone",
        WAIT,
        || async {
            jobs_status(&outbox)
                .await
                .is_some_and(|c| c.instances.len() == 1 && !alive(&c))
        },
        || async { format!("{:?}", jobs_status(&outbox).await) },
    )
    .await;
    <Nats as Broker>::remove(place).await;
    <Postgres as TestBackend>::cleanup(fixture).await;
}

/// Records a job in `effects`: a handler written as an `async fn` (#36 §4: handlers had
/// to be `Box::pin(async move ..)` closures).
async fn record<DB: TestBackend>(
    tx: &mut outbox_core::OutboxTx<'static, DB>,
    msg: outbox_core::consumer::Received<Job>,
) -> Result<(), outbox_core::consumer::BoxError> {
    let sql = format!("INSERT INTO effects (n) VALUES ({})", msg.event.n);
    DB::exec_on(&mut **tx, &sql).await;
    Ok(())
}

/// An `async fn` handler and an async closure handler, with no `Box::pin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_fns_and_async_closures_are_handlers() {
    let fixture = <Sqlite as TestBackend>::fixture().await;
    let outbox = fixture.outbox.clone();
    Sqlite::exec(&fixture, "CREATE TABLE effects (n INTEGER NOT NULL)").await;
    let place = <Rabbit as Broker>::place().await;
    let mut jobs: Vec<_> = (0..3).map(|n| job(&place.destination, "k", n)).collect();
    jobs[2].event_type = "Other".to_owned();
    <Rabbit as Broker>::publish(&place, &jobs).await;
    let consumer = Consumer::builder(
        <Rabbit as Broker>::transport(&place, "async-fns").await,
        Inbox::new(&outbox, "jobs"),
    )
    .on_event_type_async::<Job, _>("Job", record::<Sqlite>)
    .on_event_type_async::<Job, _>(
        "Other",
        async |tx: &mut outbox_core::OutboxTx<'static, Sqlite>,
               msg: outbox_core::consumer::Received<Job>| {
            let sql = format!("INSERT INTO effects (n) VALUES ({})", msg.event.n + 100);
            Sqlite::exec_on(&mut **tx, &sql).await;
            Ok(())
        },
    )
    .build()
    .expect("consumer")
    .spawn();
    wait_until("three handled", WAIT, || async {
        consumer.stats().handled >= 3
    })
    .await;
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        Sqlite::int(&fixture, "SELECT sum(n) FROM effects").await,
        1 + 102,
        "jobs 0 and 1 by the async fn, job 2 (+100) by the closure"
    );
    <Rabbit as Broker>::remove(place).await;
    Sqlite::cleanup(fixture).await;
}
