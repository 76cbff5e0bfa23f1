//! Per-key order in a JetStream stream through network faults between the relay and the
//! server (#14, item 3): a fault-injecting proxy stalls every connection for longer and
//! shorter than the acknowledgement timeout, and resets them, while a writer keeps
//! committing. Read back and deduplicated by message id, as a consumer with an inbox
//! would, every key's events are in the order they were written, and none is missing.
//! The publisher keeps one message of a key in flight at a time, so a lost or late
//! acknowledgement can only repeat a message, never let a later one overtake it.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use futures_util::StreamExt;
use outbox_core::relay::Relay;
use outbox_nats::{NatsPublisher, headers};
use outbox_tests::nats::{fresh_stream, nats_url};
use outbox_tests::proxy::Proxy;
use outbox_tests::{TestDb, order};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalls_and_resets_between_relay_and_server_keep_every_key_in_order() {
    outbox_tests::init_tracing();
    let (js, name, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.ticks");
    let server = nats_url();
    let upstream = server
        .trim_start_matches("nats://")
        .parse()
        .expect("OUTBOX_TEST_NATS_URL is nats://host:port with an IP address");
    let proxy = Proxy::start(upstream).await;
    let db = TestDb::with_max_connections(8).await;
    let outbox = db.outbox().await;
    let publisher = NatsPublisher::builder(proxy.url_for(&server))
        .skip_catalog_check()
        .destination(&subject)
        .ack_timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher)
        .batch_size(50)
        .max_attempts(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(500))
        .publish_timeout(Duration::from_secs(20))
        .spawn();

    let stop = Arc::new(AtomicBool::new(false));
    let writer = order::spawn_rounds(outbox.clone(), subject.clone(), Arc::clone(&stop));
    // Stalls around the 1 s acknowledgement timeout.
    order::stalls_and_resets(&proxy, &[700, 1_300, 400, 2_100, 1_000, 2_600, 600, 1_700]).await;
    stop.store(true, Ordering::SeqCst);
    let rounds = writer.await.expect("writer");
    let total = rounds * order::KEYS;
    order::wait_drained(&db, Duration::from_secs(120), || {
        format!("relay {:?}", relay.stats())
    })
    .await;
    let stats = relay.stats();
    relay.shutdown().await;

    let reader = js
        .get_stream(&name)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = reader.messages().await.expect("messages");
    let mut copies: Vec<(String, String, usize)> = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.len() < total {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(message)) = tokio::time::timeout(left, messages.next()).await else {
            panic!("read {} of {total} distinct events from {name}", ids.len());
        };
        let message = message.expect("message");
        let h = message.headers.clone().expect("headers");
        let id = h.get(headers::MESSAGE_ID).expect("message id").to_string();
        let key = h
            .get(headers::PARTITION_KEY)
            .expect("partition key")
            .to_string();
        let round = std::str::from_utf8(&message.payload)
            .expect("text")
            .parse()
            .expect("a round number");
        ids.insert(id.clone());
        copies.push((id, key, round));
    }
    let (applied, duplicates) =
        order::applied(copies.iter().map(|(i, k, r)| (i.as_str(), k.as_str(), *r)));
    eprintln!(
        "measured: {total} events in {rounds} rounds; {} copies read, {duplicates} duplicates \
         (JetStream deduplicates by Nats-Msg-Id within its window); relay {stats:?}",
        copies.len()
    );
    order::assert_in_order(&applied);
    order::assert_no_dead_letter(&db).await;
    js.delete_stream(&name).await.expect("delete stream");
    db.cleanup().await;
}
