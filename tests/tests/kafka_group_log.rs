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

/// Two members of one group, the second joining while the first consumes (a deploy
/// that scales out, or a restarted instance): the group moves partitions to it, and
/// still every message is handled once (the inbox skips what the first member handled
/// and had not committed) and each key's messages in order. Under `strategy` (the
/// protocol's default when `None`; docs/kafka.md suggests `cooperative-sticky`).
async fn a_member_joining_mid_stream(strategy: Option<&str>) {
    let logs = logs();
    let brokers = brokers();
    let topic = outbox_tests::kafka::unique("join");
    let group = outbox_tests::kafka::unique("join-group");
    outbox_tests::kafka::create_topic(&brokers, &topic, 4).await;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    outbox_core::sqlx::query(
        "CREATE TABLE effects (at bigserial PRIMARY KEY, key text NOT NULL, n int NOT NULL, member text NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("create effects");
    let publisher = outbox_tests::kafka::job_publisher(&brokers, &topic).await;
    let (keys, per_key) = (16, 40);
    let (brokers, topic, group) = (brokers.as_str(), topic.as_str(), group.as_str());
    let publish = |from: i32, to: i32| {
        let records: Vec<_> = (from..to)
            .flat_map(|n| {
                (0..keys).map(move |k| outbox_tests::consumers::job(topic, &format!("k{k}"), n))
            })
            .collect();
        let publisher = &publisher;
        async move {
            let results = outbox_core::publisher::Publisher::publish(publisher, &records).await;
            assert!(results.iter().all(Result::is_ok), "published: {results:?}");
        }
    };
    let outbox = &outbox;
    let member = |name: &'static str| async move {
        let mut transport = KafkaTransport::builder(brokers, group)
            .topic(topic)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500");
        if let Some(strategy) = strategy {
            transport = transport.set("partition.assignment.strategy", strategy);
        }
        outbox_core::consumer::Consumer::builder(
            transport.build().await.expect("transport"),
            outbox_core::inbox::Inbox::new(outbox, "join"),
        )
        .on_event_type::<outbox_tests::kafka::Job, _>("Job", move |tx, msg| {
            let key = msg.key.clone().unwrap_or_default();
            Box::pin(async move {
                outbox_core::sqlx::query(
                    "INSERT INTO effects (key, n, member) VALUES ($1, $2, $3)",
                )
                .bind(key)
                .bind(msg.event.n)
                .bind(name)
                .execute(&mut **tx)
                .await?;
                Ok(())
            })
        })
        .build()
        .expect("consumer")
        .spawn()
    };
    let effects = || async {
        outbox_core::sqlx::query_as::<_, (String, i32, String)>(
            "SELECT key, n, member FROM effects ORDER BY at",
        )
        .fetch_all(&db.pool)
        .await
        .expect("effects")
    };
    let group_log = || {
        logs.text()
            .lines()
            .filter(|l| l.contains(group))
            .collect::<Vec<_>>()
            .join("\n")
    };

    // One message per key every 100 ms, while the second member joins (tansu's join
    // takes 1-2 s with these settings); the last round after the rebalance.
    let flow = async {
        for n in 0..per_key - 1 {
            publish(n, n + 1).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let join = async {
        let first = member("first").await;
        outbox_tests::wait_until_or(
            "the first member handling messages",
            Duration::from_secs(60),
            || async { first.stats().handled > 0 },
            group_log,
        )
        .await;
        let second = member("second").await;
        // The group took partitions from the first member for the second.
        outbox_tests::wait_until_or(
            "a revocation from the first member",
            Duration::from_secs(60),
            || async { group_log().contains("the group revoked partitions") },
            group_log,
        )
        .await;
        (first, second)
    };
    let ((), (first, second)) = tokio::join!(flow, join);
    publish(per_key - 1, per_key).await;
    let all = (keys * per_key) as usize;
    outbox_tests::wait_until_or(
        &format!("{all} messages handled by the two members"),
        Duration::from_secs(90),
        || async { effects().await.len() >= all },
        || format!("{:?} {:?}\n{}", first.stats(), second.stats(), group_log()),
    )
    .await;
    first.shutdown().await.expect("first member");
    second.shutdown().await.expect("second member");

    let effects = effects().await;
    let mut by_key: std::collections::BTreeMap<String, Vec<i32>> = Default::default();
    for (key, n, _) in &effects {
        by_key.entry(key.clone()).or_default().push(*n);
    }
    let in_order: Vec<i32> = (0..per_key).collect();
    for (key, ns) in &by_key {
        assert_eq!(
            ns,
            &in_order,
            "key {key}: each once, in order\n{}",
            group_log()
        );
    }
    assert_eq!(by_key.len(), keys as usize);
    let by_second = effects.iter().filter(|(_, _, m)| m == "second").count();
    assert!(
        by_second > 0,
        "the second member handled none of the second half: it never held a partition\n{}",
        group_log()
    );
    eprintln!(
        "{strategy:?}: the second member handled {by_second} of {all}; the group's log:\n{}",
        group_log()
    );
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_mid_stream_takes_partitions_without_loss_or_disorder() {
    a_member_joining_mid_stream(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_mid_stream_under_the_cooperative_protocol_too() {
    a_member_joining_mid_stream(Some("cooperative-sticky")).await;
}
