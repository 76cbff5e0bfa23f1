//! Poison messages on both sides: an oversized message on publish is dead-lettered at once
//! without blocking its key for long; undecodable messages and unknown event types on
//! consume follow the configured policy.

use std::time::{Duration, Instant};

use outbox_core::consumer::{Consumer, ConsumerBuilder, ConsumerHandle, Error, Policy};
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher as _;
use outbox_core::relay::Relay;
use outbox_core::{OutboxMessage, sqlx};
use outbox_kafka::rdkafka::ClientConfig;
use outbox_kafka::rdkafka::message::{Header, OwnedHeaders};
use outbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use outbox_kafka::{KafkaPublisher, KafkaTransport, headers};
use outbox_tests::TestDb;
use outbox_tests::kafka;

#[derive(Debug, serde::Deserialize)]
struct Job {
    n: i32,
}

async fn consumer(
    brokers: &str,
    group: &str,
    topic: &str,
    db_outbox: &outbox_core::Outbox,
) -> ConsumerBuilder<KafkaTransport> {
    Consumer::builder(
        kafka::transport(brokers, group, topic)
            .build()
            .await
            .expect("kafka transport"),
        Inbox::new(db_outbox, "jobs"),
    )
    .on_event_type::<Job, _>("Job", |tx, msg| {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (n) VALUES ($1)")
                .bind(msg.event.n)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    })
}

async fn effects(db: &TestDb) -> Vec<i32> {
    sqlx::query_scalar("SELECT n FROM effects ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .expect("effects")
}

async fn setup() -> (String, TestDb, outbox_core::Outbox) {
    let brokers = kafka::brokers();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("CREATE TABLE effects (pos bigserial, n int NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create effects");
    (brokers, db, outbox)
}

/// An oversized message is dead-lettered at once (a permanent error); the later messages
/// of its key stay parked behind it while other keys flow, and go on, in order, once it
/// is discarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_is_dead_lettered_at_once_and_parks_its_key_until_discarded() {
    let (brokers, db, outbox) = setup().await;
    let topic = kafka::unique("oversized");
    kafka::create_topic(&brokers, &topic, 1).await;
    let job = |n: i32, key: &str| {
        OutboxMessage::new("Job", topic.as_str(), format!(r#"{{"n":{n}}}"#)).with_key(key)
    };
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(job(0, "a")).expect("emit");
    let big = OutboxMessage::new(
        "Job",
        topic.as_str(),
        format!(r#"{{"n":1,"pad":"{}"}}"#, "x".repeat(200_000)),
    )
    .with_key("a");
    let big_id = tx.emit_message(big).expect("emit");
    tx.emit_message(job(2, "a")).expect("emit");
    tx.emit_message(job(3, "b")).expect("emit");
    tx.emit_message(job(4, "a")).expect("emit");
    tx.commit().await.expect("commit");

    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .set("message.max.bytes", "100000")
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher)
        .backoff(Duration::from_secs(60), Duration::from_secs(60)) // a retry would not finish in this test
        .spawn();
    let consumer = consumer(&brokers, &kafka::unique("oversized-group"), &topic, &outbox)
        .await
        .build()
        .expect("consumer")
        .spawn();
    let dead_now = || async {
        sqlx::query_scalar::<_, bool>("SELECT dead_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(big_id)
            .fetch_one(&db.pool)
            .await
            .expect("the big row")
    };
    outbox_tests::wait_until("the big message is dead", Duration::from_secs(60), dead_now).await;
    outbox_tests::wait_until(
        "the other key is consumed",
        Duration::from_secs(60),
        || async { effects(&db).await == [0, 3] },
    )
    .await;
    outbox_tests::relay_looked_again(&relay, 3).await;
    let (attempts, dead, error): (i32, bool, Option<String>) = sqlx::query_as(
        "SELECT attempts, dead_at IS NOT NULL, last_error FROM outbox WHERE id = $1",
    )
    .bind(big_id)
    .fetch_one(&db.pool)
    .await
    .expect("the big row");
    assert!(dead, "dead-lettered");
    assert_eq!(attempts, 1, "at once, without retries");
    let error = error.expect("last_error");
    assert!(error.contains("MessageSizeTooLarge"), "{error}");
    let sent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .expect("sent");
    assert_eq!(sent, 2, "a:2 and a:4 are parked behind the dead letter");

    let admin = outbox_core::admin::Admin::new(outbox.clone());
    assert_eq!(admin.discard(&[big_id]).await.expect("discard"), 1);
    let deadline = Instant::now() + Duration::from_secs(60);
    while effects(&db).await.len() < 4 {
        assert!(
            Instant::now() < deadline,
            "consumed only {:?}",
            effects(&db).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    relay.shutdown().await;
    consumer.shutdown().await.expect("consumer");
    // Key `a` kept its order around the dead message: 0, 2, 4.
    let order: Vec<i32> = sqlx::query_scalar("SELECT n FROM effects ORDER BY pos")
        .fetch_all(&db.pool)
        .await
        .expect("order");
    let a: Vec<i32> = order.iter().copied().filter(|n| *n != 3).collect();
    assert_eq!(a, [0, 2, 4]);
    db.cleanup().await;
}

/// Offsets 0..=5: a good job, a bad payload, an unknown event type, no headers, a bad
/// message id, a good job.
async fn produce_poison(brokers: &str, topic: &str) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("producer");
    let h = |event_type: &str, id: &str| {
        OwnedHeaders::new()
            .insert(Header {
                key: headers::MESSAGE_ID,
                value: Some(id),
            })
            .insert(Header {
                key: headers::EVENT_TYPE,
                value: Some(event_type),
            })
    };
    let id = || uuid::Uuid::now_v7().to_string();
    let messages: Vec<(Option<OwnedHeaders>, &str)> = vec![
        (Some(h("Job", &id())), r#"{"n":0}"#),
        (Some(h("Job", &id())), r#"{"n":"not a number"}"#),
        (Some(h("Unknown", &id())), r#"{"n":2}"#),
        (None, r#"{"n":3}"#),
        (Some(h("Job", "not-a-uuid")), r#"{"n":4}"#),
        (Some(h("Job", &id())), r#"{"n":5}"#),
    ];
    for (headers, payload) in messages {
        let mut record = FutureRecord::<str, str>::to(topic)
            .payload(payload)
            .key("k");
        if let Some(headers) = headers {
            record = record.headers(headers);
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("produce");
    }
}

async fn join(handle: ConsumerHandle) -> Result<(), Error> {
    tokio::time::timeout(Duration::from_secs(60), handle.join())
        .await
        .expect("the consumer stopped by itself within 60 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_policies_log_and_skip_every_poison_message() {
    let (brokers, db, outbox) = setup().await;
    let topic = kafka::unique("poison-skip");
    kafka::create_topic(&brokers, &topic, 1).await;
    produce_poison(&brokers, &topic).await;
    let consumer = consumer(
        &brokers,
        &kafka::unique("poison-skip-group"),
        &topic,
        &outbox,
    )
    .await
    .on_unknown_event_type(Policy::Skip)
    .on_undecodable(Policy::Skip)
    .build()
    .expect("consumer")
    .spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.stats().handled + consumer.stats().skipped < 6 {
        assert!(Instant::now() < deadline, "{:?}", consumer.stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = consumer.stats();
    consumer.shutdown().await.expect("consumer");
    assert_eq!((stats.handled, stats.skipped), (2, 4), "{stats:?}");
    assert_eq!(effects(&db).await, [0, 5]);
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_stops_the_consumer_by_default_and_again_after_a_restart() {
    let (brokers, db, outbox) = setup().await;
    let topic = kafka::unique("poison-stop");
    let group = kafka::unique("poison-stop-group");
    kafka::create_topic(&brokers, &topic, 1).await;
    produce_poison(&brokers, &topic).await;

    for (run, handled) in [(1, 1), (2, 0)] {
        let consumer = consumer(&brokers, &group, &topic, &outbox)
            .await
            .build()
            .expect("consumer")
            .spawn();
        let stats = loop {
            if consumer.is_finished() {
                break consumer.stats();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match join(consumer).await {
            Err(Error::Undecodable { reason, origin })
                if (origin.partition, origin.position) == (Some(0), Some(1)) =>
            {
                assert_eq!(origin.source, topic);
                assert!(reason.contains("not a valid `Job`"), "{reason}");
            }
            other => panic!("run {run}: expected a stop at offset 1, got {other:?}"),
        }
        assert_eq!(stats.handled, handled, "run {run}: {stats:?}");
        assert_eq!(effects(&db).await, [0], "run {run}");
    }
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_event_type_stops_the_consumer_when_told_to() {
    let (brokers, db, outbox) = setup().await;
    let topic = kafka::unique("poison-unknown");
    kafka::create_topic(&brokers, &topic, 1).await;
    produce_poison(&brokers, &topic).await;
    let consumer = consumer(
        &brokers,
        &kafka::unique("poison-unknown-group"),
        &topic,
        &outbox,
    )
    .await
    .on_undecodable(Policy::Skip)
    .on_unknown_event_type(Policy::Stop)
    .build()
    .expect("consumer")
    .spawn();
    match join(consumer).await {
        Err(Error::UnknownEventType { event_type, origin }) if origin.position == Some(2) => {
            assert_eq!(event_type, "Unknown")
        }
        other => panic!("expected a stop at the unknown event type, got {other:?}"),
    }
    assert_eq!(effects(&db).await, [0]);
    db.cleanup().await;
}

/// One key's message goes to a topic that does not exist (and is not created): the batch
/// returns once the other messages are acknowledged, about one round trip later, not after
/// the failing message's `message.timeout.ms` (20 s), so other keys keep flowing; the
/// failing message is reported with its cause. (On main the batch took the full timeout,
/// and the error said `MessageTimedOut`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_to_a_missing_topic_does_not_hold_back_other_keys() {
    let brokers = kafka::brokers();
    let topic = kafka::unique("present");
    kafka::create_topic(&brokers, &topic, 2).await;
    let missing = kafka::unique("missing");
    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .set("allow.auto.create.topics", "false")
        .build()
        .await
        .expect("publisher");
    // Warm up: the producer knows the cluster and the present topic.
    let warm = publisher.publish(&[kafka::job(&topic, 0)]).await;
    assert!(warm[0].is_ok(), "{warm:?}");

    let mut batch = vec![kafka::job(&missing, 1)];
    batch[0].partition_key = Some("bad".to_owned());
    for n in 2..22 {
        let mut record = kafka::job(&topic, n);
        record.partition_key = Some(format!("key-{n}"));
        batch.push(record);
    }
    let started = Instant::now();
    let results = publisher.publish(&batch).await;
    let took = started.elapsed();
    eprintln!("measured: a batch with a message to a missing topic returned in {took:?}");
    assert!(
        results[1..].iter().all(Result::is_ok),
        "the other keys are published: {results:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "about one round trip, not the 20 s message timeout: {took:?}"
    );
    let error = results[0].as_ref().expect_err("the missing topic fails");
    assert!(
        error.message().contains(&missing) && error.message().contains("does not exist"),
        "names the cause: {error}"
    );
}

/// A message to a destination the publisher was not told of (a typo in a string
/// destination) fails, naming the topic, and creates nothing: topics are created at start,
/// for the catalog's destinations and those given with `.destination(..)`, and only with
/// `.create_missing_topics(..)`. (#36: on main the producer asked the broker to create any
/// topic it was handed, and the typo became a topic.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_to_an_unknown_destination_creates_no_topic() {
    let brokers = kafka::brokers();
    let topic = kafka::unique("orders");
    let typo = kafka::unique("ordrs");
    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .create_missing_topics(1, 1)
        .build()
        .await
        .expect("publisher");
    assert!(
        kafka::topics(&brokers).iter().any(|(t, _)| *t == topic),
        "the destination it was given is created at start"
    );
    // Beside a message to its topic, as a relay's batch would be.
    let mut right = kafka::job(&topic, 0);
    right.partition_key = Some("right".to_owned());
    let results = publisher.publish(&[right, kafka::job(&typo, 1)]).await;
    assert!(results[0].is_ok(), "{results:?}");
    let error = results[1].as_ref().expect_err("no such topic");
    assert!(
        error.message().contains(&typo) && error.message().contains("does not exist"),
        "names the topic: {error}"
    );
    assert!(
        !kafka::topics(&brokers).iter().any(|(t, _)| *t == typo),
        "the typo did not become a topic"
    );
    kafka::delete_topic(&brokers, &topic).await;
}
