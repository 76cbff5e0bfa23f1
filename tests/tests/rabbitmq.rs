//! `outbox-rabbitmq` against the real RabbitMQ (`OUTBOX_TEST_RABBITMQ_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). Each test declares an exchange and a queue
//! of its own.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::admin::{Admin, ListFilter};
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_core::{OutboxMessage, Relay, sqlx};
use outbox_rabbitmq::{Error, RabbitPublisher, RabbitTransport, headers};
use outbox_tests::kafka::Job;
use outbox_tests::proxy::Proxy;
use outbox_tests::rabbitmq::{Topology, rabbitmq_address, rabbitmq_url};
use outbox_tests::trusted_sql;
use outbox_tests::{TestDb, order, wait_until, wait_until_or};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_confirmed_persistent_messages_in_key_order() {
    let topology = Topology::declare("orders.#").await;
    let destination = format!("{}/orders.placed", topology.exchange);
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    for round in 0..4 {
        let mut tx = outbox.begin().await.expect("begin");
        for n in round * 5..round * 5 + 5 {
            for key in ["a", "b", "c"] {
                let mut message = OutboxMessage::new(
                    "OrderPlaced",
                    destination.as_str(),
                    format!(r#"{{"key":"{key}","n":{n}}}"#),
                )
                .with_key(key)
                .with_header("traceparent", "00-abc-def-01");
                message.event_version = Some(2);
                tx.emit_message(message).expect("emit");
            }
        }
        tx.commit().await.expect("commit");
    }
    let publisher = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher)
        .batch_size(7)
        .spawn();
    let read = topology.read(60, WAIT).await;
    relay.shutdown().await;

    let mut next = std::collections::HashMap::<String, u64>::new();
    let mut ids = HashSet::new();
    for m in &read {
        let id = m.message_id.clone().expect("message_id");
        assert!(ids.insert(id.clone()), "{id} twice");
        assert_eq!(m.headers.get(headers::MESSAGE_ID), Some(&id));
        assert_eq!(m.kind.as_deref(), Some("OrderPlaced"));
        assert_eq!(m.delivery_mode, Some(2), "persistent");
        assert_eq!(m.routing_key, "orders.placed");
        assert_eq!(
            m.headers.get(headers::EVENT_TYPE).map(String::as_str),
            Some("OrderPlaced")
        );
        assert_eq!(
            m.headers.get(headers::EVENT_VERSION).map(String::as_str),
            Some("2")
        );
        assert_eq!(
            m.headers.get("traceparent").map(String::as_str),
            Some("00-abc-def-01")
        );
        let body: serde_json::Value = serde_json::from_str(&m.body).expect("JSON body");
        let key = body["key"].as_str().expect("key").to_owned();
        assert_eq!(m.headers.get(headers::PARTITION_KEY), Some(&key));
        let n = body["n"].as_u64().expect("n");
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(n, *expected, "key {key} out of order");
        *expected += 1;
    }
    wait_until("every row is marked sent", WAIT, || async {
        Admin::new(outbox.clone())
            .status()
            .await
            .expect("status")
            .pending
            == 0
    })
    .await;
    topology.delete().await;
    db.cleanup().await;
}

/// `mandatory`: a message no queue is bound to take comes back, and is a dead letter
/// that names the exchange and routing key; the later messages of its key wait behind
/// it, other keys flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_is_dead_lettered_not_dropped() {
    let topology = Topology::declare("bound").await;
    let (bound, unbound) = (
        format!("{}/bound", topology.exchange),
        format!("{}/unbound", topology.exchange),
    );
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("E", unbound.as_str(), r#"{"n":0}"#).with_key("p"))
        .expect("emit");
    tx.emit_message(OutboxMessage::new("E", bound.as_str(), r#"{"n":1}"#).with_key("p"))
        .expect("emit");
    tx.emit_message(OutboxMessage::new("E", bound.as_str(), r#"{"n":2}"#).with_key("q"))
        .expect("emit");
    tx.commit().await.expect("commit");
    let publisher = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let admin = Admin::new(outbox.clone());
    wait_until("the unroutable message is dead", WAIT, || async {
        admin.status().await.expect("status").dead == 1
    })
    .await;
    let read = topology.read(1, WAIT).await;
    let body: serde_json::Value = serde_json::from_str(&read[0].body).expect("JSON body");
    assert_eq!(body["n"], 2, "q flows past the dead letter of p");
    let dead = admin
        .dead(&ListFilter::default())
        .await
        .expect("dead letters");
    assert_eq!(dead.len(), 1);
    let error = dead[0].last_error.clone().unwrap_or_default();
    assert!(
        error.contains("no queue is bound")
            && error.contains(&topology.exchange)
            && error.contains("unbound"),
        "{error}"
    );
    assert_eq!(dead[0].held_back, 1, "p:1 waits behind its dead letter");
    relay.shutdown().await;
    topology.delete().await;
    db.cleanup().await;
}

/// Many keys in flight at once, half of them to a routing key no queue takes: RabbitMQ
/// acknowledges several messages at once, and lapin hands each returned message to
/// whichever of them it resolves next. Every unroutable message must still be a dead
/// letter, and every routed one delivered and marked sent: none lost, none blamed for
/// another's return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_are_matched_to_their_own_messages() {
    let topology = Topology::declare("bound").await;
    let (bound, unbound) = (
        format!("{}/bound", topology.exchange),
        format!("{}/unbound", topology.exchange),
    );
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let keys = 200;
    let mut tx = outbox.begin().await.expect("begin");
    for k in 0..keys {
        for (prefix, destination) in [("u", &unbound), ("r", &bound)] {
            tx.emit_message(
                OutboxMessage::new("E", destination.as_str(), format!(r#"{{"k":{k}}}"#))
                    .with_key(format!("{prefix}{k}")),
            )
            .expect("emit");
        }
    }
    tx.commit().await.expect("commit");
    let publisher = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let admin = Admin::new(outbox.clone());
    wait_until("every message is sent or dead", WAIT, || async {
        admin.status().await.expect("status").pending == 0
    })
    .await;
    relay.shutdown().await;
    let dead_keys: HashSet<String> = outbox_core::sqlx::query_scalar(
        "SELECT partition_key FROM outbox WHERE dead_at IS NOT NULL",
    )
    .fetch_all(&db.pool)
    .await
    .expect("dead letters")
    .into_iter()
    .collect();
    let expected: HashSet<String> = (0..keys).map(|k| format!("u{k}")).collect();
    assert_eq!(
        dead_keys, expected,
        "exactly the unroutable messages are dead letters"
    );
    let read = topology.read(keys, WAIT).await;
    assert_eq!(read.len(), keys);
    assert!(
        read.iter().all(|m| m.routing_key == "bound"),
        "only routed messages in the queue"
    );
    topology.delete().await;
    db.cleanup().await;
}

/// Many keys in flight on one channel, each key over two routing keys of which one no
/// queue is bound to (#33). RabbitMQ sends a message's return before its confirm, but
/// it may return several messages and then confirm them with one `multiple` ack (it
/// coalesces confirms under load; a proxy makes it do so every time), and lapin then
/// hands the returns to the confirms it resolves in hash-map order: an unroutable
/// message can look confirmed while its return rides with another key's confirm. The
/// publisher must know each message's fate before its key's next message goes out: an
/// unroutable message is a dead letter and the rest of its key waits behind it. After
/// binding the routing key and releasing the dead letters, every key reaches the queue
/// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_never_lets_the_next_of_its_key_go_first() {
    outbox_tests::init_tracing();
    let topology = Topology::declare("bound").await;
    let (bound, unbound) = (
        format!("{}/bound", topology.exchange),
        format!("{}/unbound", topology.exchange),
    );
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    // Key k: messages n = 0, 1, 2; the one at n == k % 4 goes to the unbound routing key
    // (k % 4 == 3: none does). Written round by round, so that a batch holds every key.
    let (keys, per_key) = (400_usize, 3_usize);
    let unroutable = |k: usize, n: usize| n == k % 4;
    let mut tx = outbox.begin().await.expect("begin");
    for n in 0..per_key {
        for k in 0..keys {
            let destination = if unroutable(k, n) { &unbound } else { &bound };
            tx.emit_message(
                OutboxMessage::new("E", destination.as_str(), format!(r#"{{"k":{k},"n":{n}}}"#))
                    .with_key(format!("k{k}")),
            )
            .expect("emit");
        }
    }
    tx.commit().await.expect("commit");
    let expected_dead = (0..keys).filter(|k| k % 4 < 3).count() as i64;
    let coalesced = Arc::new(outbox_tests::rabbitmq::Coalesced::default());
    let counts = Arc::clone(&coalesced);
    let proxy = Proxy::start_rewriting(rabbitmq_address(), Duration::from_millis(5), move || {
        outbox_tests::rabbitmq::CoalesceConfirms::new(Arc::clone(&counts))
    })
    .await;
    let publisher = RabbitPublisher::builder(proxy.url_for(&rabbitmq_url()))
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let admin = Admin::new(outbox.clone());
    // Every unroutable message is dead, and nothing but what waits behind one is left.
    let claimable = "SELECT count(*) FROM outbox o WHERE o.sent_at IS NULL AND o.dead_at IS NULL \
                     AND NOT EXISTS (SELECT 1 FROM outbox d WHERE d.partition_key = o.partition_key \
                     AND d.seq < o.seq AND d.dead_at IS NOT NULL)";
    let counts = || async {
        let status = admin.status().await.expect("status");
        let claimable: i64 = sqlx::query_scalar(trusted_sql(claimable))
            .fetch_one(&db.pool)
            .await
            .expect("claimable");
        (status.dead, claimable, status.pending)
    };
    wait_until_or(
        "every unroutable message is dead and the rest sent or waiting behind one",
        WAIT,
        || async {
            let (dead, claimable, _) = counts().await;
            dead == expected_dead && claimable == 0
        },
        || {
            format!(
                "expected {expected_dead} dead letters, 0 claimable; proxy: {}",
                coalesced.summary()
            )
        },
    )
    .await;
    let (_, _, waiting) = counts().await;
    // Sent past its key's dead letter: what the contract forbids.
    let sent_past: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox o WHERE o.sent_at IS NOT NULL AND EXISTS \
         (SELECT 1 FROM outbox d WHERE d.partition_key = o.partition_key \
          AND d.seq < o.seq AND d.dead_at IS NOT NULL)",
    )
    .fetch_one(&db.pool)
    .await
    .expect("sent past a dead letter");

    // Bind the routing key and release the dead letters: they go out before the rest of
    // their keys.
    let channel = topology.connection.create_channel().await.expect("channel");
    channel
        .queue_bind(
            topology.queue.as_str().into(),
            topology.exchange.as_str().into(),
            "unbound".into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("bind the unbound routing key");
    let mut all = ListFilter::default();
    all.limit = keys as u32;
    let dead: Vec<uuid::Uuid> = admin
        .dead(&all)
        .await
        .expect("dead letters")
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(dead.len() as i64, expected_dead);
    admin.release(&dead).await.expect("release");
    wait_until_or(
        "every message is sent after the release",
        WAIT,
        || async {
            let (dead, _, pending) = counts().await;
            dead == 0 && pending == 0
        },
        || format!("proxy: {}", coalesced.summary()),
    )
    .await;
    relay.shutdown().await;

    let read = topology.read(keys * per_key, WAIT).await;
    let mut by_key: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    for m in &read {
        let body: serde_json::Value = serde_json::from_str(&m.body).expect("JSON body");
        let (k, n) = (
            body["k"].as_u64().expect("k"),
            body["n"].as_u64().expect("n"),
        );
        by_key.entry(k).or_default().push(n);
    }
    let out_of_order: Vec<(u64, &Vec<u64>)> = by_key
        .iter()
        .filter(|(_, ns)| ns.as_slice() != [0, 1, 2])
        .map(|(k, ns)| (*k, ns))
        .collect();
    let pairs: usize = by_key
        .values()
        .map(|ns| {
            (0..ns.len())
                .map(|i| (i + 1..ns.len()).filter(|&j| ns[i] > ns[j]).count())
                .sum::<usize>()
        })
        .sum();
    assert!(
        out_of_order.is_empty() && sent_past == 0,
        "{} of {keys} keys reached the queue out of order ({pairs} out-of-order pairs), e.g. {:?}; \
         {sent_past} messages were sent past their key's dead letter ({waiting} waited behind one); \
         proxy: {}",
        out_of_order.len(),
        &out_of_order[..out_of_order.len().min(5)],
        coalesced.summary()
    );
    assert_eq!(by_key.len(), keys);
    let (acks, confirms) = (
        coalesced.acks.load(Ordering::Relaxed),
        coalesced.confirms.load(Ordering::Relaxed),
    );
    assert!(
        acks > 0 && confirms > acks,
        "the proxy coalesced confirms: {}",
        coalesced.summary()
    );
    topology.delete().await;
    db.cleanup().await;
}

/// An exchange that does not exist when a message for it comes (created after start-up,
/// or deleted since): publishing to it would close the channel, and with it the confirms
/// of every other key in flight. The message fails alone, naming the exchange, and is a
/// dead letter after its attempts; the other keys flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_for_a_missing_exchange_fails_alone() {
    let topology = Topology::declare("ok").await;
    let id = uuid::Uuid::now_v7().simple().to_string();
    let missing = format!("gone-{id}/x");
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    for n in 0..5 {
        tx.emit_message(
            OutboxMessage::new("E", missing.as_str(), format!(r#"{{"n":{n}}}"#)).with_key("m"),
        )
        .expect("emit");
        tx.emit_message(
            OutboxMessage::new(
                "E",
                format!("{}/ok", topology.exchange),
                format!(r#"{{"n":{n}}}"#),
            )
            .with_key("q"),
        )
        .expect("emit");
    }
    tx.commit().await.expect("commit");
    let publisher = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher)
        .max_attempts(2)
        .backoff(Duration::from_millis(50), Duration::from_millis(100))
        .spawn();
    let read = topology.read(5, WAIT).await;
    assert_eq!(read.len(), 5, "q's messages all went out");
    let admin = Admin::new(outbox.clone());
    wait_until("m's first message is a dead letter", WAIT, || async {
        admin.status().await.expect("status").dead == 1
    })
    .await;
    let dead = admin
        .dead(&ListFilter::default())
        .await
        .expect("dead letters");
    let error = dead[0].last_error.clone().unwrap_or_default();
    assert!(
        error.contains(&format!("exchange gone-{id} does not exist")),
        "{error}"
    );
    relay.shutdown().await;
    topology.delete().await;
    db.cleanup().await;
}

#[tokio::test]
async fn the_start_up_check_names_every_missing_exchange_and_queue() {
    let id = uuid::Uuid::now_v7().simple().to_string();
    let topology = Topology::declare("#").await;
    let err = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .destination(format!("{}/fine", topology.exchange))
        .destination(format!("missing-{id}/order.created"))
        .destination(format!("no-such-queue-{id}"))
        .build()
        .await
        .expect_err("missing destinations");
    let Error::MissingDestinations { missing } = &err else {
        panic!("unexpected error: {err}");
    };
    assert_eq!(missing.len(), 2, "{missing:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("exchange missing-{id}"))
            && text.contains(&format!("queue no-such-queue-{id}"))
            && !text.contains(&topology.exchange),
        "{text}"
    );
    topology.delete().await;
}

#[tokio::test]
async fn a_refused_login_is_reported_without_the_password() {
    let url = rabbitmq_url().replace("guest:guest@", "guest:s3cret-pw@");
    let err = RabbitPublisher::builder(url)
        .skip_catalog_check()
        .build()
        .await
        .expect_err("wrong password");
    // The chain too: the client's error is the source, shown once (before: flattened
    // into the message).
    let chain = outbox_tests::assert_source_shown_once(&err);
    let text = format!("{err} {err:?} {chain}");
    assert!(matches!(err, Error::Connect { .. }), "{text}");
    assert!(!text.contains("s3cret-pw"), "{text}");
    assert!(text.contains("guest:***@"), "{text}");
}

/// Stalls around the confirm timeout and connection resets between the relay and the
/// broker: the publisher connects again by itself (the relay keeps running), and read
/// back and deduplicated by message id, every key is in order with nothing missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalls_and_resets_between_relay_and_broker_keep_every_key_in_order() {
    outbox_tests::init_tracing();
    let topology = Topology::declare("ticks").await;
    let destination = format!("{}/ticks", topology.exchange);
    let server = rabbitmq_url();
    let proxy = Proxy::start(rabbitmq_address()).await;
    let db = TestDb::with_max_connections(8).await;
    let outbox = db.outbox().await;
    let publisher = RabbitPublisher::builder(proxy.url_for(&server))
        .skip_catalog_check()
        .destination(&destination)
        .confirm_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(1))
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
    let writer = order::spawn_rounds(outbox.clone(), destination.clone(), Arc::clone(&stop));
    order::stalls_and_resets(&proxy, &[700, 1_300, 400, 2_100, 1_000, 2_600]).await;
    stop.store(true, Ordering::SeqCst);
    let rounds = writer.await.expect("writer");
    let total = rounds * order::KEYS;
    order::wait_drained(&db, Duration::from_secs(120), || {
        format!("relay {:?}", relay.stats())
    })
    .await;
    let stats = relay.stats();
    relay.shutdown().await;
    assert!(
        proxy.accepted() > 1,
        "the publisher connected again after the resets"
    );

    // Every copy the queue holds: at least `total`, duplicates included.
    let queued = queued(&topology).await;
    assert!(queued >= total, "{queued} of {total} messages queued");
    let read = topology.read(queued, WAIT).await;
    let copies: Vec<(String, String, usize)> = read
        .iter()
        .map(|m| {
            (
                m.message_id.clone().expect("message_id"),
                m.headers
                    .get(headers::PARTITION_KEY)
                    .cloned()
                    .expect("partition key"),
                m.body.parse().expect("a round number"),
            )
        })
        .collect();
    let (applied, duplicates) =
        order::applied(copies.iter().map(|(i, k, r)| (i.as_str(), k.as_str(), *r)));
    eprintln!(
        "measured: {total} events in {rounds} rounds; {} copies read, {duplicates} duplicates; \
         {} connections through the proxy; relay {stats:?}",
        copies.len(),
        proxy.accepted()
    );
    assert_eq!(
        applied.values().map(Vec::len).sum::<usize>(),
        total,
        "every event"
    );
    order::assert_in_order(&applied);
    order::assert_no_dead_letter(&db).await;
    topology.delete().await;
    db.cleanup().await;
}

/// A consumer whose connection stalls and is reset while it works through a backlog:
/// the transport connects again by itself (the consumer keeps running), the messages
/// unacknowledged on the lost connection come again and are skipped by the inbox, and
/// every key's effects commit once each, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_behind_stalls_and_resets_handles_every_message_once_in_key_order() {
    outbox_tests::init_tracing();
    let topology = Topology::declare("jobs").await;
    let destination = format!("{}/jobs", topology.exchange);
    let server = rabbitmq_url();
    let proxy = Proxy::start(rabbitmq_address()).await;
    let db = TestDb::with_max_connections(8).await;
    let outbox = db.outbox().await;
    sqlx::query(
        "CREATE TABLE effects (at bigserial PRIMARY KEY, key text NOT NULL, n int NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("create effects");
    let keys = ["a", "b", "c", "d", "e"];
    let jobs: Vec<_> = (0..400)
        .map(|n| outbox_tests::consumers::job(&destination, keys[n as usize % 5], n))
        .collect();
    let publisher = RabbitPublisher::builder(server.clone())
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("publisher");
    assert!(publisher.publish(&jobs).await.iter().all(Result::is_ok));

    let transport = RabbitTransport::builder(proxy.url_for(&server), &topology.queue)
        .prefetch(20)
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "jobs"))
        .concurrency(4)
        // A run that stops making progress says what it waits for within the test's time.
        .stall_warning(Duration::from_secs(5))
        .on_event_type::<Job, _>("Job", |tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (key, n) VALUES ($1, $2)")
                    .bind(msg.key.unwrap_or_default())
                    .bind(msg.event.n)
                    .execute(&mut **tx)
                    .await?;
                // Spreads the backlog (about 8 s) over the faults.
                tokio::time::sleep(Duration::from_millis(80)).await;
                Ok(())
            })
        })
        .build()
        .expect("consumer")
        .spawn();
    order::stalls_and_resets(&proxy, &[300, 500, 300, 700]).await;
    wait_until_or(
        "every job handled",
        WAIT,
        || async { consumer.stats().handled >= 400 },
        || {
            format!(
                "consumer {:?}, {} connections through the proxy (the log above has the \
                 transport's reconnections and the consumer's warnings of no progress)",
                consumer.stats(),
                proxy.accepted()
            )
        },
    )
    .await;
    let stats = consumer.stats();
    assert!(!consumer.is_finished(), "the consumer kept running");
    consumer.shutdown().await.expect("consumer");
    assert!(proxy.accepted() > 1, "the transport connected again");
    let effects: Vec<(String, i32)> = sqlx::query_as("SELECT key, n FROM effects ORDER BY at")
        .fetch_all(&db.pool)
        .await
        .expect("effects");
    eprintln!(
        "measured: 400 jobs; {} connections through the proxy; consumer {stats:?}",
        proxy.accepted()
    );
    assert_eq!(stats.handled, 400, "{stats:?}");
    assert!(
        stats.duplicates > 0,
        "acknowledgements held by a stall were lost with the reset, and those messages came again: {stats:?}"
    );
    for (i, key) in keys.iter().enumerate() {
        let committed: Vec<i32> = effects
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, n)| *n)
            .collect();
        let expected: Vec<i32> = (0..400).filter(|n| n % 5 == i as i32).collect();
        assert_eq!(committed, expected, "key {key}: each once, in order");
    }
    topology.delete().await;
    db.cleanup().await;
}

/// How many messages the queue holds (a passive declare's count).
async fn queued(topology: &Topology) -> usize {
    let channel = topology.connection.create_channel().await.expect("channel");
    let queue = channel
        .queue_declare(
            topology.queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("queue");
    queue.message_count() as usize
}
