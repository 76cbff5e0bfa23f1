//! A Kafka consumer with an inbox on a database other than PostgreSQL: SQLite, through the
//! real broker. A redelivered message (same id) is skipped, the others run once.

use std::time::{Duration, Instant};

use outbox_core::Outbox;
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_core::sqlx::{self, Sqlite};
use outbox_tests::kafka::{self, Job, job};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_consumer_deduplicates_through_a_sqlite_inbox() {
    let path = std::env::temp_dir().join(format!("outbox-kafka-{}.db", Uuid::now_v7().simple()));
    let outbox = Outbox::<Sqlite>::open(path.to_str().expect("utf-8 temp path"))
        .await
        .expect("open");
    outbox.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (n INTEGER NOT NULL)")
        .execute(outbox.pool())
        .await
        .expect("effects table");

    let brokers = kafka::brokers();
    let topic = kafka::unique("sqlite-inbox");
    kafka::create_topic(&brokers, &topic, 1).await;
    let publisher = kafka::job_publisher(&brokers, &topic).await;
    let first = job(&topic, 1);
    // The first job twice, as a relay that lost its acknowledgement sends it again (the
    // publisher sends an id once per call: a copy in one batch would be waited for).
    let batch = [first.clone(), job(&topic, 2)];
    assert!(publisher.publish(&batch).await.iter().all(Result::is_ok));
    assert!(
        publisher
            .publish(std::slice::from_ref(&first))
            .await
            .iter()
            .all(Result::is_ok)
    );

    let inbox = Inbox::new(&outbox, "jobs");
    let builder = Consumer::builder(
        kafka::transport(&brokers, kafka::unique("group"), &topic)
            .build()
            .expect("kafka transport"),
        inbox.clone(),
    )
    .on_event_type::<Job, _>("Job", |tx, msg| {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (n) VALUES (?)")
                .bind(msg.event.n)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    });
    let consumer = builder.build().expect("consumer").spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.stats().duplicates + consumer.stats().handled < 3 {
        assert!(
            Instant::now() < deadline,
            "not all consumed: {:?}",
            consumer.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        (stats.handled, stats.duplicates),
        (2, 1),
        "the redelivery of the first job was skipped: {stats:?}"
    );
    let effects: Vec<i64> = sqlx::query_scalar("SELECT n FROM effects ORDER BY n")
        .fetch_all(outbox.pool())
        .await
        .expect("effects");
    assert_eq!(effects, vec![1, 2], "each job took effect once");
    assert!(inbox.is_processed(first.id).await.expect("lookup"));
    outbox.pool().close().await;
    kafka::delete_topic(&brokers, &topic).await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}
