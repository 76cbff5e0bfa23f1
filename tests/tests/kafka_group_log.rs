//! A Kafka consumer says what its group gave it: the partition assignment is logged at
//! info, so a consumer that waits for the group is visible; and a wrong broker address
//! is one clear error from `build`, not a stream of librdkafka lines (a test binary of
//! its own: it installs the global log subscriber, shared by its tests).

use std::time::Duration;

use outbox_core::Relay;
use outbox_kafka::{KafkaPublisher, KafkaTransport};
use outbox_tests::TestDb;
use outbox_tests::consumers::{emit_jobs, handle_jobs};
use outbox_tests::kafka::brokers;
use outbox_tests::logs::Captured;

/// The global log subscriber, installed once for the tests of this binary.
fn logs() -> &'static Captured {
    static LOGS: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| Captured::install(tracing::Level::INFO))
}

/// Nothing listens at the address: the consumer's and the publisher's `build` fail
/// within their `startup_timeout` with one error naming the address and librdkafka's
/// reason; librdkafka's own reports of it are not logged above debug (#36: the
/// publisher logged four `AllBrokersDown` lines, the consumer's `build` succeeded in a
/// millisecond and failed later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_broker_address_is_one_clear_error_within_the_bound() {
    let logs = logs();
    let bound = Duration::from_secs(2);
    let started = std::time::Instant::now();
    let err = KafkaTransport::builder("127.0.0.1:1", "wrong-address")
        .topic("orders")
        .startup_timeout(bound)
        .build()
        .await
        .expect_err("nothing listens on port 1");
    let took = started.elapsed();
    assert!(
        matches!(err, outbox_kafka::Error::Metadata { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("127.0.0.1:1") && text.contains("librdkafka:"),
        "{text}"
    );
    // The bound, plus what it takes to make and drop a client.
    assert!(took < bound + Duration::from_secs(3), "took {took:?}");
    eprintln!("KafkaTransport::build against a closed port: {took:?}: {text}");

    let started = std::time::Instant::now();
    let err = KafkaPublisher::builder("127.0.0.1:1")
        .skip_catalog_check()
        .destination("orders")
        .startup_timeout(bound)
        .build()
        .await
        .expect_err("nothing listens on port 1");
    let took = started.elapsed();
    assert!(
        matches!(err, outbox_kafka::Error::Metadata { .. }),
        "{err:?}"
    );
    assert!(took < bound + Duration::from_secs(3), "took {took:?}");
    eprintln!("KafkaPublisher::build against a closed port: {took:?}: {err}");

    let noisy: Vec<String> = logs
        .text()
        .lines()
        .filter(|l| l.contains("127.0.0.1:1") && (l.contains(" ERROR ") || l.contains(" WARN ")))
        .map(str::to_owned)
        .collect();
    assert!(
        noisy.is_empty(),
        "librdkafka's reports were logged: {noisy:#?}"
    );
}

/// A consumer of a topic that does not exist is refused by `build`, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_refused_by_build() {
    let topic = format!("outbox-no-such-topic-{}", uuid::Uuid::now_v7().simple());
    let err = KafkaTransport::builder(brokers(), "no-such-topic")
        .topic(&topic)
        .build()
        .await
        .expect_err("the topic does not exist");
    assert!(
        matches!(&err, outbox_kafka::Error::NoSuchTopics { topics, .. } if topics == std::slice::from_ref(&topic)),
        "{err:?}"
    );
    assert!(err.to_string().contains("build_unchecked()"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitions_the_group_assigns_are_logged() {
    let logs = logs();
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
        .await
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

/// A member the group gives no partition (here: a second member of a group reading one
/// partition) says so at info while it waits, instead of an empty log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_partitions_says_it_waits_for_the_group() {
    let logs = logs();
    let brokers = brokers();
    let topic = format!("outbox-group-wait-{}", uuid::Uuid::now_v7().simple());
    let group = format!("group-wait-{}", uuid::Uuid::now_v7().simple());
    outbox_tests::kafka::create_topic(&brokers, &topic, 1).await;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let member = || async {
        let transport = KafkaTransport::builder(&brokers, &group)
            .topic(&topic)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .build()
            .await
            .expect("transport");
        outbox_core::consumer::Consumer::builder(
            transport,
            outbox_core::inbox::Inbox::new(&outbox, "group-wait"),
        )
        .on_event_type::<outbox_tests::kafka::Job, _>("Job", |_tx, _msg| Box::pin(async { Ok(()) }))
        .build()
        .expect("consumer")
        .spawn()
    };
    let first = member().await;
    let second = member().await;
    let waiting = |text: &str| {
        text.lines()
            .find(|l| {
                l.contains("waiting for the group to assign partitions") && l.contains(&group)
            })
            .map(str::to_owned)
    };
    outbox_tests::wait_until_or(
        "a member of the group saying it waits for partitions",
        Duration::from_secs(60),
        || async { waiting(&logs.text()).is_some() },
        || {
            logs.text()
                .lines()
                .filter(|l| l.contains(&group))
                .collect::<Vec<_>>()
                .join("\n")
        },
    )
    .await;
    eprintln!("{}", waiting(&logs.text()).unwrap_or_default());
    first.shutdown().await.expect("first member");
    second.shutdown().await.expect("second member");
    db.cleanup().await;
}
