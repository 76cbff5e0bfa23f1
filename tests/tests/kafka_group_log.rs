//! A Kafka consumer says what its group gave it: the partition assignment is logged at
//! info, so a consumer that waits for the group is visible (a test binary of its own:
//! it installs the global log subscriber).

use std::time::Duration;

use outbox_core::Relay;
use outbox_kafka::{KafkaPublisher, KafkaTransport};
use outbox_tests::TestDb;
use outbox_tests::consumers::{emit_jobs, handle_jobs};
use outbox_tests::kafka::brokers;
use outbox_tests::logs::Captured;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitions_the_group_assigns_are_logged() {
    let logs = Captured::install(tracing::Level::INFO);
    let brokers = brokers();
    let topic = format!("outbox-group-log-{}", uuid::Uuid::now_v7().simple());
    let group = format!("group-log-{}", uuid::Uuid::now_v7().simple());
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    emit_jobs(&outbox, &topic, 3).await;
    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .create_missing_topics(2, 1)
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let transport = KafkaTransport::builder(&brokers, &group)
        .topic(&topic)
        .build()
        .expect("transport");
    let seen = handle_jobs(transport, &outbox, "group-log", 3, Duration::from_secs(60)).await;
    relay.shutdown().await;
    assert_eq!(seen, [0, 1, 2], "in key order");
    let text = logs.text();
    let assigned = text
        .lines()
        .find(|line| line.contains("the group assigned partitions") && line.contains(&group))
        .unwrap_or_else(|| panic!("no assignment logged for group {group}; the log:\n{text}"));
    assert!(
        assigned.contains(&format!("{topic}/0")) && assigned.contains(&format!("{topic}/1")),
        "both partitions named: {assigned}"
    );
    db.cleanup().await;
}
