//! A consumer process killed after its database commits but before any offset commit:
//! the messages come again, and the inbox skips every one of them.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_core::{OutboxRecord, sqlx};
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_tests::kafka::{self, Job, job};
use outbox_tests::{TestDb, database_url};

async fn effects(db: &TestDb, run: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE run = $1")
        .bind(run)
        .fetch_one(&db.pool)
        .await
        .expect("count effects")
}

fn committed_offset(brokers: &str, group: &str, topic: &str) -> Offset {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .expect("offset client");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, 0);
    let committed = c
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    committed.elements()[0].offset()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_before_committing_offsets_is_not_run_twice_by_the_redelivery() {
    let brokers = kafka::brokers();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("CREATE TABLE effects (n int NOT NULL, run text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create effects");
    let topic = kafka::unique("crash");
    let group = kafka::unique("crash-group");
    kafka::create_topic(&brokers, &topic, 1).await;
    let publisher = kafka::job_publisher(&brokers, &topic).await;
    let batch: Vec<OutboxRecord> = (0..20).map(|n| job(&topic, n)).collect();
    assert!(publisher.publish(&batch).await.iter().all(Result::is_ok));

    // The child handles all 20 (each a committed DB transaction) and is then SIGKILLed.
    let mut child = Command::new(env!("CARGO_BIN_EXE_kafka_test_consumer"))
        .args([&database_url(), &db.schema, &brokers, &topic, &group])
        .stdin(Stdio::null())
        .spawn()
        .expect("start the consumer process");
    let deadline = Instant::now() + Duration::from_secs(60);
    while effects(&db, "child").await < 20 {
        if let Some(status) = child.try_wait().expect("child status") {
            panic!("the consumer process exited early: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "the consumer process did not handle 20 messages in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().expect("SIGKILL the consumer");
    child.wait().expect("reap the consumer");
    assert_eq!(db.count("outbox_processed").await, 20, "20 DB commits");
    assert_eq!(
        committed_offset(&brokers, &group, &topic),
        Offset::Invalid,
        "the killed consumer committed no offset"
    );

    // The same group and consumer name again: all 20 come back, none runs again; a new
    // message still runs.
    let builder = Consumer::builder(
        kafka::transport(&brokers, &group, &topic)
            .build()
            .await
            .expect("kafka transport"),
        Inbox::new(&outbox, "jobs"),
    )
    .on_event_type::<Job, _>("Job", |tx, msg| {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (n, run) VALUES ($1, 'restarted')")
                .bind(msg.event.n)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    });
    let consumer = builder.build().expect("consumer").spawn();
    assert!(publisher.publish(&[job(&topic, 20)]).await[0].is_ok());
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.stats().duplicates + consumer.stats().handled < 21 {
        assert!(
            Instant::now() < deadline,
            "redelivery incomplete: {:?}",
            consumer.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        stats.duplicates, 20,
        "every redelivered message skipped by the inbox: {stats:?}"
    );
    assert_eq!(stats.handled, 1, "only the new message ran: {stats:?}");
    assert_eq!(effects(&db, "child").await, 20);
    assert_eq!(effects(&db, "restarted").await, 1);
    let n: i32 = sqlx::query_scalar("SELECT n FROM effects WHERE run = 'restarted'")
        .fetch_one(&db.pool)
        .await
        .expect("n");
    assert_eq!(n, 20);
    assert_eq!(
        committed_offset(&brokers, &group, &topic),
        Offset::Offset(21),
        "a graceful shutdown commits the stored offsets"
    );
    db.cleanup().await;
}
