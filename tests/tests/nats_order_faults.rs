//! Per-key order in a JetStream stream through network faults between the relay and the
//! server (#14, item 3): a fault-injecting proxy stalls every connection for longer and
//! shorter than the acknowledgement timeout, and resets them, while a writer keeps
//! committing. Read back and deduplicated by message id, as a consumer with an inbox
//! would, every key's events are in the order they were written, and none is missing.
//! The publisher keeps one message of a key in flight at a time, so a lost or late
//! acknowledgement can only repeat a message, never let a later one overtake it.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use futures_util::StreamExt;
use outbox_core::relay::Relay;
use outbox_core::{OutboxMessage, sqlx};
use outbox_nats::{NatsPublisher, headers};
use outbox_tests::TestDb;
use outbox_tests::nats::{fresh_stream, nats_url};
use outbox_tests::proxy::{Mode, Proxy};

const KEYS: usize = 12;

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

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (outbox, subject, stop) = (outbox.clone(), subject.clone(), stop.clone());
        tokio::spawn(async move {
            let mut rounds = 0usize;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let mut tx = outbox.begin().await.expect("begin");
                for k in 0..KEYS {
                    tx.emit_message(
                        OutboxMessage::new("Tick", subject.as_str(), format!("{rounds}"))
                            .with_key(format!("key-{k}")),
                    )
                    .expect("emit");
                }
                tx.commit().await.expect("commit");
                rounds += 1;
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            rounds
        })
    };
    for (i, stall_ms) in [700u64, 1_300, 400, 2_100, 1_000, 2_600, 600, 1_700]
        .into_iter()
        .enumerate()
    {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        proxy.set(Mode::Stall);
        tokio::time::sleep(Duration::from_millis(stall_ms)).await;
        if i % 2 == 1 {
            proxy.reset();
        }
        proxy.set(Mode::Forward);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rounds = writer.await.expect("writer");
    let total = rounds * KEYS;

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .expect("pending");
        if pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{pending} rows still pending 120 s after the last fault; relay {:?}",
            relay.stats()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
    let mut seen = HashSet::new();
    let mut applied: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let (mut copies, mut duplicates) = (0usize, 0usize);
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.len() < total {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(message)) = tokio::time::timeout(left, messages.next()).await else {
            panic!("read {} of {total} distinct events from {name}", seen.len());
        };
        let message = message.expect("message");
        copies += 1;
        let h = message.headers.clone().expect("headers");
        let id = h.get(headers::MESSAGE_ID).expect("message id").to_string();
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let key = h
            .get(headers::PARTITION_KEY)
            .expect("partition key")
            .to_string();
        let n: usize = std::str::from_utf8(&message.payload)
            .expect("text")
            .parse()
            .expect("a round number");
        applied.entry(key).or_default().push(n);
    }
    let mut violations = Vec::new();
    for (key, ns) in &applied {
        assert_eq!(ns.first(), Some(&0), "{key} starts at round 0");
        for pair in ns.windows(2) {
            if pair[1] != pair[0] + 1 {
                violations.push(format!("{key}: {} after {}", pair[1], pair[0]));
            }
        }
    }
    eprintln!(
        "measured: {total} events in {rounds} rounds; {copies} copies read, {duplicates} duplicates \
         (JetStream deduplicates by Nats-Msg-Id within its window); relay {stats:?}"
    );
    assert!(
        violations.is_empty(),
        "{} per-key order violations after dedup, first: {:?}",
        violations.len(),
        &violations[..violations.len().min(10)]
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .expect("dead");
    assert_eq!(dead, 0, "network faults dead-letter nothing");
    js.delete_stream(&name).await.expect("delete stream");
    db.cleanup().await;
}
