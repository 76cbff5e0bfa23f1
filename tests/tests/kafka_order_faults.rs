//! Per-key order in the Kafka log through network faults between the relay and the
//! broker (#14, item 3): a fault-injecting proxy stalls every connection for longer and
//! shorter than the delivery timeouts, and resets them, while a writer keeps committing.
//! Read back afterwards and deduplicated by message id, as a consumer with an inbox
//! would, every key's events are in the order they were written, and none is missing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::relay::Relay;
use outbox_kafka::KafkaPublisher;
use outbox_tests::kafka::{self, OwnBroker};
use outbox_tests::proxy::Mode;
use outbox_tests::{TestDb, order};

/// A publisher tuned as a new user would for fast failover: short timeouts everywhere.
async fn short_timeouts(brokers: &str, topic: &str) -> KafkaPublisher {
    KafkaPublisher::builder(brokers)
        .skip_catalog_check()
        .destination(topic)
        .delivery_wait(Duration::from_secs(2))
        .request_timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("publisher")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalls_and_resets_between_relay_and_broker_keep_every_key_in_order() {
    outbox_tests::init_tracing();
    let (_broker, proxy) = OwnBroker::behind_proxy().await;
    let brokers = proxy.addr().to_string();
    let db = TestDb::with_max_connections(8).await;
    let outbox = db.outbox().await;
    let topic = kafka::unique("order-faults");
    kafka::create_topic(&brokers, &topic, 2).await;

    let publisher = short_timeouts(&brokers, &topic).await;
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .batch_size(50)
        .max_attempts(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(500))
        .publish_timeout(Duration::from_secs(10))
        .spawn();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = order::spawn_rounds(outbox.clone(), topic.clone(), Arc::clone(&stop));
    // Stalls around the 1 s request timeout and the 2 s delivery wait.
    order::stalls_and_resets(
        &proxy,
        &[1_500, 2_300, 900, 3_100, 2_000, 4_200, 1_200, 2_700],
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let rounds = writer.await.expect("writer");
    let total = rounds * order::KEYS;
    order::wait_drained(&db, Duration::from_secs(120), || {
        format!("relay {:?}", relay.stats())
    })
    .await;
    let stats = relay.stats();
    relay.shutdown().await;

    let read = {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            kafka::read_topic(&brokers, &topic, total, Duration::from_secs(60))
        })
        .await
        .expect("read the topic")
    };
    let (applied, duplicates) = order::applied(read.iter().map(|m| {
        (
            m.id.as_str(),
            m.key.as_deref().expect("a key"),
            m.payload.parse().expect("a round number"),
        )
    }));
    eprintln!(
        "measured: {total} events in {rounds} rounds; {} copies read, {duplicates} duplicates; \
         relay {stats:?}; producer rebuilds {}",
        read.len(),
        publisher.rebuilds()
    );
    order::assert_in_order(&applied);
    assert_eq!(
        applied.values().map(Vec::len).sum::<usize>(),
        total,
        "every event is in the topic"
    );
    order::assert_no_dead_letter(&db).await;
    db.cleanup().await;
}

/// librdkafka's documented gap ("1,2,3,4,5 → written 1,4,5"): a message that times out
/// in the producer is dropped while a later one of its key, queued after it, is
/// written. Here K:1 is queued during a stall, K:2 a second later through a clone of the
/// same publisher (clones share one producer); the stall ends after K:1's delivery
/// timeout and before K:2's. Whatever each call reports, the log must never hold K:2
/// without K:1 before it: no later re-send of K:1 can put it back in front.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stall_longer_than_the_delivery_timeout_leaves_no_gap_in_a_key() {
    use outbox_core::publisher::Publisher as _;
    outbox_tests::init_tracing();
    let (_broker, proxy) = OwnBroker::behind_proxy().await;
    let brokers = proxy.addr().to_string();
    let topic = kafka::unique("gap");
    kafka::create_topic(&brokers, &topic, 1).await;
    let publisher = short_timeouts(&brokers, &topic).await;
    // Connections are up (metadata fetched at build); from now on nothing moves.
    proxy.set(Mode::Stall);
    let first = {
        let (publisher, record) = (publisher.clone(), kafka::job(&topic, 1));
        tokio::spawn(async move { publisher.publish(&[record]).await })
    };
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let second = {
        let (publisher, record) = (publisher.clone(), kafka::job(&topic, 2));
        tokio::spawn(async move { publisher.publish(&[record]).await })
    };
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    proxy.set(Mode::Forward);
    let first = first.await.expect("first publish");
    let second = second.await.expect("second publish");
    eprintln!("measured: K:1 {first:?}, K:2 {second:?}");
    if second[0].is_err() {
        return; // nothing of the key's later message is in the log; no gap possible
    }
    let read = tokio::task::spawn_blocking(move || {
        kafka::read_topic(&brokers, &topic, 1, Duration::from_secs(30))
    })
    .await
    .expect("read");
    let order: Vec<&str> = read.iter().map(|r| r.payload.as_str()).collect();
    assert_eq!(
        order.first(),
        Some(&r#"{"n":1}"#),
        "K:2 was acknowledged, so K:1 must be in the log before it; the log holds {order:?} \
         (K:1: {first:?})"
    );
}
