//! Transactional writes → relay → Kafka (the shared tansu broker) → typed, idempotent
//! consumer, against real PostgreSQL.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use outbox_core::consumer::Consumer;
use outbox_core::relay::Relay;
use outbox_core::{OutboxEvent, OutboxMessage, sqlx};
use outbox_kafka::{KafkaPublisher, headers};
use outbox_tests::TestDb;
use outbox_tests::kafka;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The event of this test. Its catalog destination is replaced per test by a unique topic.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(destination = "outbox-test.counted", key = key, version = 3)]
struct Counted {
    key: String,
    n: i32,
}

/// id, key, n, Kafka key, version, event type, headers.
type ConsumedRow = (
    Uuid,
    String,
    i32,
    Option<String>,
    Option<i32>,
    String,
    serde_json::Value,
);

const KEYS: usize = 50;
const PER_KEY: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_thousand_events_arrive_once_in_effect_in_key_order_with_their_headers() {
    let brokers = kafka::brokers();
    let db = TestDb::with_max_connections(16).await;
    let outbox = db.outbox().await;
    sqlx::query(
        "CREATE TABLE consumed (pos bigserial PRIMARY KEY, id uuid NOT NULL, key text NOT NULL, n int NOT NULL, \
         kafka_key text, version int, event_type text NOT NULL, headers jsonb NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("create consumed");
    let topic = kafka::unique("e2e");
    kafka::create_topic(&brokers, &topic, 4).await;

    // 5,000 events over 50 keys, 100 transactions of 50 events, from 5 writers; every
    // writer owns 10 keys, so the per-key order of writes is defined.
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..5 {
        let (outbox, topic) = (outbox.clone(), topic.clone());
        writers.push(tokio::spawn(async move {
            let keys: Vec<String> = (0..KEYS)
                .filter(|k| k % 5 == w)
                .map(|k| format!("key-{k}"))
                .collect();
            let mut all = Vec::new();
            for n in 0..PER_KEY {
                for key in &keys {
                    let mut m = OutboxMessage::from_event(&Counted {
                        key: key.clone(),
                        n: n as i32,
                    })
                    .expect("serialize");
                    m.destination = topic.clone();
                    all.push(
                        m.with_header(
                            "traceparent",
                            format!("00-{:032x}-{:016x}-01", n + 1, n + 1),
                        )
                        .with_header("correlation-id", format!("corr-{key}-{n}")),
                    );
                }
            }
            for chunk in all.chunks(50) {
                let mut tx = outbox.begin().await.expect("begin");
                for m in chunk {
                    tx.emit_message(m.clone()).expect("emit");
                }
                tx.commit().await.expect("commit");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let written = started.elapsed();
    assert_eq!(db.count("outbox").await, (KEYS * PER_KEY) as i64);

    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .build()
        .await
        .expect("publisher");
    let builder = Consumer::builder(
        kafka::transport(&brokers, kafka::unique("e2e-group"), &topic)
            .build()
            .await
            .expect("kafka transport"),
        outbox_core::inbox::Inbox::new(&outbox, "e2e"),
    )
    .on::<Counted, _>(|tx, msg| {
        Box::pin(async move {
            let headers = serde_json::to_value(&msg.headers)?;
            sqlx::query(
                "INSERT INTO consumed (id, key, n, kafka_key, version, event_type, headers) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(msg.id)
            .bind(&msg.event.key)
            .bind(msg.event.n)
            .bind(&msg.key)
            .bind(msg.version)
            .bind(&msg.event_type)
            .bind(headers)
            .execute(&mut **tx)
            .await?;
            Ok(())
        })
    });
    let consumer = builder.build().expect("consumer").spawn();

    let relay_started = Instant::now();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .batch_size(500)
        .spawn();
    let total = (KEYS * PER_KEY) as i64;
    wait_until(
        Duration::from_secs(120),
        "every row marked sent",
        || async {
            let sent: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")
                    .fetch_one(&db.pool)
                    .await
                    .expect("sent");
            sent >= total
        },
    )
    .await;
    let published = relay_started.elapsed();
    wait_until(Duration::from_secs(120), "every event consumed", || async {
        db.count("consumed").await >= total
    })
    .await;
    let end_to_end = relay_started.elapsed();
    let sent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .expect("sent");
    assert_eq!(sent, total, "every row marked sent");

    // At-least-once delivery brings duplicates: publish every 10th event again. The inbox
    // must skip them all.
    let again = sqlx::query("UPDATE outbox SET sent_at = NULL WHERE seq % 10 = 0")
        .execute(&db.pool)
        .await
        .expect("republish")
        .rows_affected();
    assert_eq!(again, (total / 10) as u64);
    sqlx::query("SELECT pg_notify(outbox_channel, '') FROM (SELECT 'outbox_' || 'outbox'::regclass::oid::text AS outbox_channel) c")
        .execute(&db.pool)
        .await
        .expect("wake the relay");
    wait_until(
        Duration::from_secs(60),
        "the duplicates reached the consumer",
        || async { consumer.stats().duplicates >= again },
    )
    .await;
    relay.shutdown().await;
    let stats = consumer.stats();
    consumer
        .shutdown()
        .await
        .expect("the consumer ended cleanly");

    assert_eq!(stats.handled, total as u64, "{stats:?}");
    assert_eq!(stats.duplicates, again, "{stats:?}");
    assert_eq!(stats.skipped, 0, "{stats:?}");
    assert_eq!(
        db.count("consumed").await,
        total,
        "every event took effect exactly once"
    );
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT id) FROM consumed")
        .fetch_one(&db.pool)
        .await
        .expect("distinct");
    assert_eq!(distinct, total);

    // Per-key order, keys and headers.
    let rows: Vec<ConsumedRow> = sqlx::query_as(
        "SELECT id, key, n, kafka_key, version, event_type, headers FROM consumed ORDER BY pos",
    )
    .fetch_all(&db.pool)
    .await
    .expect("consumed rows");
    let ids: HashMap<Uuid, (String, i32)> = sqlx::query_as::<_, (Uuid, String, i32)>(
        "SELECT id, partition_key, (convert_from(body, 'UTF8')::jsonb->>'n')::int FROM outbox",
    )
    .fetch_all(&db.pool)
    .await
    .expect("outbox ids")
    .into_iter()
    .map(|(id, k, n)| (id, (k, n)))
    .collect();
    let mut next: BTreeMap<String, i32> = BTreeMap::new();
    for (id, key, n, kafka_key, version, event_type, h) in &rows {
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(
            n, expected,
            "key {key}: event {n} arrived when {expected} was due (order broken)"
        );
        *expected += 1;
        assert_eq!(
            ids.get(id),
            Some(&(key.clone(), *n)),
            "message id {id} is the outbox row's id"
        );
        assert_eq!(
            kafka_key.as_deref(),
            Some(key.as_str()),
            "the Kafka key is the partition key"
        );
        assert_eq!(*version, Some(3));
        assert_eq!(event_type, "Counted");
        let h: BTreeMap<String, String> = serde_json::from_value(h.clone()).expect("headers");
        let id_text = id.to_string();
        let trace = format!("00-{:032x}-{:016x}-01", n + 1, n + 1);
        let corr = format!("corr-{key}-{n}");
        let expected_headers: BTreeMap<&str, &str> = [
            (headers::MESSAGE_ID, id_text.as_str()),
            (headers::EVENT_TYPE, "Counted"),
            (headers::EVENT_VERSION, "3"),
            (headers::CONTENT_TYPE, "application/json"),
            (headers::TRACEPARENT, trace.as_str()),
            ("correlation-id", corr.as_str()),
        ]
        .into_iter()
        .collect();
        let got: BTreeMap<&str, &str> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(got, expected_headers, "headers of {id}");
    }
    assert_eq!(next.len(), KEYS);
    assert!(next.values().all(|c| *c == PER_KEY as i32), "{next:?}");
    assert_eq!(
        publisher.rebuilds(),
        0,
        "no producer rebuild on a healthy broker"
    );

    eprintln!(
        "measured: wrote {total} events in {written:?}; relay start → all acked by Kafka and marked in \
         {published:?}; → all consumed in {end_to_end:?} ({:.0} events/s end to end)",
        total as f64 / end_to_end.as_secs_f64()
    );
    db.cleanup().await;
}

async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The chaos rig's read-back after a lost event: every partition to its end, with
/// offsets, empty partitions included, and no consumer group to wait for. Two batches:
/// tansu's high watermark would end the first after its first record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_is_read_back_to_its_end_with_offsets() {
    use outbox_core::publisher::Publisher as _;
    let brokers = kafka::brokers();
    let topic = kafka::unique("read-back");
    kafka::create_topic(&brokers, &topic, 3).await;
    let publisher = kafka::job_publisher(&brokers, &topic).await;
    let jobs: Vec<_> = (0..30).map(|n| kafka::job(&topic, n)).collect();
    for batch in jobs.chunks(15) {
        for result in publisher.publish(batch).await {
            result.expect("published");
        }
    }
    let (b, t) = (brokers.clone(), topic.clone());
    let read = tokio::task::spawn_blocking(move || {
        kafka::read_to_end(&b, &t, Duration::from_secs(2), Duration::from_secs(30))
    })
    .await
    .expect("the reader")
    .expect("read to the end");
    // One key: one partition, in publish order, offsets from 0; the others are empty.
    let ids: Vec<String> = jobs.iter().map(|j| j.id.to_string()).collect();
    assert_eq!(read.iter().map(|m| m.id.clone()).collect::<Vec<_>>(), ids);
    assert!(read.iter().all(|m| m.partition == read[0].partition));
    assert_eq!(
        read.iter().map(|m| m.offset).collect::<Vec<_>>(),
        (0..30).collect::<Vec<i64>>()
    );
    kafka::delete_topic(&brokers, &topic).await;
}
