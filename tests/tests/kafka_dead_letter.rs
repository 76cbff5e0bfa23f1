//! A message whose handler keeps failing is given up on after `handler_attempts` and
//! written to the dead-letter topic with where it came from and why; the messages after
//! it are handled. A badly configured dead-letter policy is refused at build time.

use std::time::{Duration, Instant};

use outbox_core::consumer::{Consumer, Error, Policy, dead_letter_headers};
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_core::{OutboxRecord, sqlx};
use outbox_kafka::rdkafka::ClientConfig;
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use outbox_kafka::rdkafka::message::{Headers, Message};
use outbox_tests::TestDb;
use outbox_tests::kafka::{self, Job, TEST_CONSUMER_SETTINGS, job};

/// A message read back: key, payload, headers.
type Read = (String, String, Vec<(String, String)>);

/// The messages on `topic`, read from the beginning: until `n` arrived, or for `wait`.
fn read_all(brokers: &str, topic: &str, n: usize, wait: Duration) -> Vec<Read> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", kafka::unique("dlq-reader"))
        .set("auto.offset.reset", "earliest");
    for (k, v) in TEST_CONSUMER_SETTINGS {
        config.set(k, v);
    }
    let c: BaseConsumer = config.create().expect("reader");
    c.subscribe(&[topic]).expect("subscribe");
    let mut out = Vec::new();
    let deadline = Instant::now() + wait;
    while out.len() < n && Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
            let text =
                |b: Option<&[u8]>| String::from_utf8_lossy(b.unwrap_or_default()).into_owned();
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_owned(), text(h.value)))
                        .collect()
                })
                .unwrap_or_default();
            out.push((text(m.key()), text(m.payload()), headers));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_failing_goes_to_the_dead_letter_topic_and_the_rest_flows() {
    let brokers = kafka::brokers();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("CREATE TABLE effects (n int NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create effects");
    let (topic, dlq) = (kafka::unique("jobs"), kafka::unique("jobs-dlq"));
    kafka::create_topic(&brokers, &topic, 1).await;
    kafka::create_topic(&brokers, &dlq, 1).await;
    let publisher = kafka::job_publisher(&brokers, &topic).await;
    let batch: Vec<OutboxRecord> = (1..=3).map(|n| job(&topic, n)).collect();
    assert!(publisher.publish(&batch).await.iter().all(Result::is_ok));

    let transport = kafka::transport(&brokers, kafka::unique("group"), &topic)
        .dead_letter_topic(&dlq)
        .build()
        .await
        .expect("kafka transport");
    let builder = Consumer::builder(transport, Inbox::new(&outbox, "jobs"))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
        .handler_attempts(3, Policy::DeadLetter)
        .on_event_type::<Job, _>("Job", |tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (n) VALUES ($1)")
                    .bind(msg.event.n)
                    .execute(&mut **tx)
                    .await?;
                if msg.event.n == 2 {
                    return Err("job 2 is poison".into());
                }
                Ok(())
            })
        });
    let consumer = builder.build().expect("consumer").spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.stats().handled + consumer.stats().dead_lettered < 3 {
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
        (stats.handled, stats.dead_lettered, stats.handler_errors),
        (2, 1, 3),
        "job 2 ran three times, then was dead-lettered; jobs 1 and 3 were handled: {stats:?}"
    );
    let effects: Vec<i32> = sqlx::query_scalar("SELECT n FROM effects ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .expect("effects");
    assert_eq!(effects, vec![1, 3], "the failed attempts were rolled back");
    let inbox = Inbox::new(&outbox, "jobs");
    assert!(!inbox.is_processed(batch[1].id).await.expect("lookup"));

    // Up to two, for a few seconds: a duplicate would show.
    let dead = read_all(&brokers, &dlq, 2, Duration::from_secs(5));
    assert_eq!(
        dead.len(),
        1,
        "exactly one message in the dead-letter topic"
    );
    let (key, payload, headers) = &dead[0];
    assert_eq!((key.as_str(), payload.as_str()), ("jobs", r#"{"n":2}"#));
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("header {name} in {headers:?}"))
    };
    assert_eq!(
        header("message-id"),
        batch[1].id.to_string(),
        "original headers kept"
    );
    assert_eq!(header(dead_letter_headers::SOURCE), topic);
    assert_eq!(header(dead_letter_headers::PARTITION), "0");
    assert_eq!(header(dead_letter_headers::OFFSET), "1");
    let reason = header(dead_letter_headers::REASON);
    assert!(
        reason.contains("failed 3 times") && reason.contains("job 2 is poison"),
        "{reason}"
    );
    assert!(
        !reason.contains("Policy::Stop"),
        "the reason does not name another policy: {reason}"
    );
    kafka::delete_topic(&brokers, &topic).await;
    kafka::delete_topic(&brokers, &dlq).await;
    db.cleanup().await;
}

#[tokio::test]
async fn a_dead_letter_policy_without_a_topic_is_refused() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let transport = || {
        kafka::transport("127.0.0.1:9092", "g", "t")
            .build_unchecked()
            .expect("kafka transport")
    };
    for builder in [
        Consumer::builder(transport(), Inbox::new(&outbox, "c"))
            .handler_attempts(3, Policy::DeadLetter),
        Consumer::builder(transport(), Inbox::new(&outbox, "c")).on_undecodable(Policy::DeadLetter),
    ] {
        let built = builder
            .on_event_type::<Job, _>("Job", |_tx, _msg| Box::pin(async { Ok(()) }))
            .build();
        match built {
            Err(e @ Error::NoDeadLetterDestination { transport: "kafka" }) => {
                assert!(e.to_string().contains(".dead_letter_topic("), "{e}")
            }
            Err(e) => panic!("expected NoDeadLetterDestination, got {e}"),
            Ok(_) => panic!("expected NoDeadLetterDestination, got a consumer"),
        }
    }
    db.cleanup().await;
}

/// Database failures are not handler failures: with `handler_attempts(1, Policy::Skip)`,
/// a message whose inbox transaction cannot run (here its table is missing for a while)
/// is retried, not skipped, and handled once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_failures_do_not_count_as_handler_attempts() {
    let brokers = kafka::brokers();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("ALTER TABLE outbox_processed RENAME TO outbox_processed_away")
        .execute(&db.pool)
        .await
        .expect("hide the processed table");
    let topic = kafka::unique("blip");
    kafka::create_topic(&brokers, &topic, 1).await;
    let publisher = kafka::job_publisher(&brokers, &topic).await;
    let record = job(&topic, 7);
    assert!(publisher.publish(std::slice::from_ref(&record)).await[0].is_ok());

    let builder = Consumer::builder(
        kafka::transport(&brokers, kafka::unique("group"), &topic)
            .build()
            .await
            .expect("kafka transport"),
        Inbox::new(&outbox, "jobs"),
    )
    .retry_backoff(Duration::from_millis(20), Duration::from_millis(50))
    .handler_attempts(1, Policy::Skip)
    .on_event_type::<Job, _>("Job", |_tx, _msg| Box::pin(async { Ok(()) }));
    let consumer = builder.build().expect("consumer").spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.stats().handler_errors < 3 {
        assert!(
            Instant::now() < deadline,
            "no retries: {:?}",
            consumer.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        consumer.stats().skipped,
        0,
        "a database failure skipped the message"
    );
    sqlx::query("ALTER TABLE outbox_processed_away RENAME TO outbox_processed")
        .execute(&db.pool)
        .await
        .expect("bring the processed table back");
    while consumer.stats().handled < 1 {
        assert!(
            Instant::now() < deadline,
            "not handled: {:?}",
            consumer.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        (stats.handled, stats.skipped, stats.dead_lettered),
        (1, 0, 0)
    );
    assert!(
        Inbox::new(&outbox, "jobs")
            .is_processed(record.id)
            .await
            .expect("lookup")
    );
    kafka::delete_topic(&brokers, &topic).await;
    db.cleanup().await;
}

/// A dead-letter write that fails stops the consumer with `Error::DeadLetter` and leaves
/// the message's offset uncommitted: it is never dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dead_letter_write_stops_the_consumer_without_committing() {
    let brokers = kafka::brokers();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let topic = kafka::unique("jobs");
    kafka::create_topic(&brokers, &topic, 1).await;
    let publisher = kafka::job_publisher(&brokers, &topic).await;
    assert!(publisher.publish(&[job(&topic, 1)]).await[0].is_ok());
    let group = kafka::unique("group");
    let consume = |dead_letter_topic: String, dead_letter_brokers: &str| {
        let transport = kafka::transport(&brokers, &group, &topic)
            .dead_letter_topic(dead_letter_topic)
            .dead_letter_set("bootstrap.servers", dead_letter_brokers)
            .dead_letter_set("message.timeout.ms", "2000")
            // The dead-letter topic is on a cluster `build` does not ask.
            .build_unchecked()
            .expect("kafka transport");
        let builder = Consumer::builder(transport, Inbox::new(&outbox, "jobs"))
            .handler_attempts(1, Policy::DeadLetter)
            .on_event_type::<Job, _>("Job", |_tx, _msg| {
                Box::pin(async { Err("always fails".into()) })
            });
        builder.build().expect("consumer").spawn()
    };
    // The dead-letter producer cannot reach a broker (tansu would create a missing topic
    // on the fly, so an unreachable broker is the failure to provoke).
    let dlq = kafka::unique("jobs-dlq");
    kafka::create_topic(&brokers, &dlq, 1).await;
    let consumer = consume(dlq.clone(), "127.0.0.1:1");
    let ended = tokio::time::timeout(Duration::from_secs(60), consumer.join())
        .await
        .expect("the consumer stops by itself");
    match ended {
        Err(Error::DeadLetter {
            destination,
            origin,
            ..
        }) => {
            assert_eq!((destination, origin.position), (dlq.clone(), Some(0)));
        }
        other => panic!("expected Error::DeadLetter, got {other:?}"),
    }
    // The message was not committed past: a consumer of the same group with a working
    // dead-letter topic gets it again and dead-letters it.
    let consumer = consume(dlq.clone(), &brokers);
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.stats().dead_lettered < 1 {
        assert!(
            Instant::now() < deadline,
            "not redelivered: {:?}",
            consumer.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.shutdown().await.expect("consumer");
    assert_eq!(
        read_all(&brokers, &dlq, 1, Duration::from_secs(30)).len(),
        1
    );
    kafka::delete_topic(&brokers, &topic).await;
    kafka::delete_topic(&brokers, &dlq).await;
    db.cleanup().await;
}
