//! WAL mode end to end (`docs/wal.md`): PostgreSQL's WAL → the relay → the real broker
//! (tansu for Kafka, the NATS JetStream service). 20,000 events over 200 keys from 4
//! concurrent writers: every emitted id arrives, and each key's events arrive in the
//! order they were committed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox_core::relay::Relay;
use outbox_core::{Outbox, OutboxMessage};
use outbox_tests::TestDb;
use uuid::Uuid;

const KEYS: usize = 200;
const WRITERS: usize = 4;
/// Events per key: 20,000 in all.
const PER_KEY: usize = 100;

/// The 4 writers, concurrently: each owns 50 keys and commits `PER_KEY` transactions of
/// one event per key. Returns each key's ids in commit order.
async fn write(outbox: &Outbox, destination: &str) -> HashMap<String, Vec<Uuid>> {
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (outbox, destination) = (outbox.clone(), destination.to_owned());
            tokio::spawn(async move {
                let keys: Vec<String> = (0..KEYS)
                    .filter(|k| k % WRITERS == w)
                    .map(|k| format!("k{k:03}"))
                    .collect();
                let mut ids: HashMap<String, Vec<Uuid>> = HashMap::new();
                for n in 0..PER_KEY {
                    let mut tx = outbox.begin().await.expect("begin");
                    for key in &keys {
                        let id = tx
                            .emit_message(
                                OutboxMessage::new(
                                    "Counted",
                                    destination.as_str(),
                                    format!(r#"{{"key":"{key}","n":{n}}}"#),
                                )
                                .with_key(key.as_str()),
                            )
                            .expect("emit");
                        ids.entry(key.clone()).or_default().push(id);
                    }
                    tx.commit().await.expect("commit");
                }
                ids
            })
        })
        .collect();
    let mut all = HashMap::new();
    for w in writers {
        all.extend(w.await.expect("writer"));
    }
    all
}

/// Every emitted id arrived (and nothing else), and per key the first arrivals are in
/// commit order. `arrived` is (key, id) in the broker's order for that key.
fn check(written: &HashMap<String, Vec<Uuid>>, arrived: &[(String, Uuid)]) {
    let emitted: HashSet<Uuid> = written.values().flatten().copied().collect();
    assert_eq!(emitted.len(), KEYS * PER_KEY);
    let got: HashSet<Uuid> = arrived.iter().map(|(_, id)| *id).collect();
    assert_eq!(got.len(), emitted.len(), "every event arrived");
    assert!(got == emitted, "the ids are the emitted ids");
    let mut seen = HashSet::new();
    let mut per_key: HashMap<&str, Vec<Uuid>> = HashMap::new();
    for (key, id) in arrived {
        if seen.insert(*id) {
            per_key.entry(key.as_str()).or_default().push(*id);
        }
    }
    for (key, ids) in written {
        assert_eq!(
            per_key.get(key.as_str()),
            Some(ids),
            "key {key}: commit order"
        );
    }
    eprintln!(
        "measured: {} arrivals for {} events ({} again)",
        arrived.len(),
        emitted.len(),
        arrived.len() - emitted.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_thousand_events_reach_kafka_in_commit_order_per_key() {
    use outbox_tests::kafka;
    let db = TestDb::with_max_connections(12).await;
    let (outbox, slot) = outbox_tests::wal::outbox_in(&db).await;
    let brokers = kafka::brokers();
    let topic = kafka::unique("wal");
    kafka::create_topic(&brokers, &topic, 4).await;
    let publisher = outbox_kafka::KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&topic)
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let started = Instant::now();
    let written = write(&outbox, &topic).await;
    let wrote = started.elapsed();
    outbox_tests::wait_until(
        "the relay publishes all",
        Duration::from_secs(120),
        || async { relay.stats().published >= (KEYS * PER_KEY) as u64 },
    )
    .await;
    let published = started.elapsed();
    let read = tokio::task::spawn_blocking({
        let (brokers, topic) = (brokers.clone(), topic.clone());
        move || kafka::read_topic(&brokers, &topic, KEYS * PER_KEY, Duration::from_secs(120))
    })
    .await
    .expect("read");
    eprintln!(
        "measured: written in {wrote:?}, published after {published:?}, read after {:?}",
        started.elapsed()
    );
    relay.shutdown().await;
    // Kafka keeps a key's messages in one partition, in log order.
    let arrived: Vec<(String, Uuid)> = read
        .iter()
        .map(|r| {
            let key = r.key.clone().expect("a key");
            let id = r.id.parse().expect("uuid");
            (key, id)
        })
        .collect();
    let partitions: HashMap<&str, HashSet<i32>> = read.iter().fold(HashMap::new(), |mut m, r| {
        m.entry(r.key.as_deref().unwrap_or(""))
            .or_default()
            .insert(r.partition);
        m
    });
    assert!(
        partitions.values().all(|p| p.len() == 1),
        "one partition per key"
    );
    check(&written, &arrived);
    kafka::delete_topic(&brokers, &topic).await;
    outbox_tests::wal::cleanup(db, &slot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_thousand_events_reach_nats_in_commit_order_per_key() {
    use async_nats::jetstream::consumer;
    use futures_util::StreamExt;
    use outbox_core::sqlx;
    let db = TestDb::with_max_connections(12).await;
    let (outbox, slot) = outbox_tests::wal::outbox_in(&db).await;
    let (js, name, prefix) = outbox_tests::nats::fresh_stream().await;
    let subject = format!("{prefix}.counts");
    let publisher = outbox_nats::NatsPublisher::builder(outbox_tests::nats::nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let written = write(&outbox, &subject).await;
    let reader = js
        .get_stream(&name)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config::default())
        .await
        .expect("consumer");
    let mut arrived: Vec<(String, Uuid)> = Vec::new();
    let mut distinct = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while distinct.len() < KEYS * PER_KEY {
        assert!(
            Instant::now() < deadline,
            "read {} distinct events of {}",
            distinct.len(),
            KEYS * PER_KEY
        );
        let mut batch = reader
            .fetch()
            .max_messages(1000)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .expect("fetch");
        while let Some(m) = batch.next().await {
            let m = m.expect("message");
            let h = m.headers.clone().expect("headers");
            let get = |k: &str| h.get(k).map(|v| v.as_str().to_owned());
            let id: Uuid = get(outbox_nats::headers::MESSAGE_ID)
                .expect("message id")
                .parse()
                .expect("uuid");
            let key = get(outbox_nats::headers::PARTITION_KEY).expect("key");
            distinct.insert(id);
            arrived.push((key, id));
            m.ack().await.expect("ack");
        }
    }
    relay.shutdown().await;
    check(&written, &arrived);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(rows, 0, "WAL mode writes no outbox row");
    js.delete_stream(&name).await.expect("delete stream");
    outbox_tests::wal::cleanup(db, &slot).await;
}
