//! A consumer that makes no progress while it has work says so itself, and a RabbitMQ
//! consumer whose connection went silent connects again; a transaction dropped while it
//! holds events says so too. The logs are the global subscriber's (`Captured`), so these
//! tests have a binary of their own.

use std::sync::Arc;
use std::sync::OnceLock;
use std::time::Duration;

use outbox_core::OutboxMessage;
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_rabbitmq::{RabbitPublisher, RabbitTransport};
use outbox_tests::kafka::Job;
use outbox_tests::logs::Captured;
use outbox_tests::proxy::Proxy;
use outbox_tests::rabbitmq::{Topology, rabbitmq_address, rabbitmq_url};
use outbox_tests::{TestDb, wait_until};
use tokio::sync::Notify;

const WAIT: Duration = Duration::from_secs(30);

fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| Captured::install(tracing::Level::INFO))
}

/// The lines logged so far that contain every one of `words`.
fn lines_with(words: &[&str]) -> Vec<String> {
    logs()
        .text()
        .lines()
        .filter(|line| words.iter().all(|w| line.contains(w)))
        .map(str::to_owned)
        .collect()
}

async fn publish(topology: &Topology, from: i32, count: i32) {
    let destination = format!("{}/jobs", topology.exchange);
    let publisher = RabbitPublisher::builder(rabbitmq_url())
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("publisher");
    let jobs: Vec<_> = (from..from + count)
        .map(|n| outbox_tests::consumers::job(&destination, &format!("k{}", n % 5), n))
        .collect();
    assert!(publisher.publish(&jobs).await.iter().all(Result::is_ok));
}

/// A half-open connection (a partition, a NAT that forgot it) delivers nothing and
/// reports no error; lapin notices only after two missed heartbeats (RabbitMQ's default:
/// 2 × 60 s). The transport sees that the broker holds ready messages while it receives
/// none, says so, and connects again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rabbitmq_consumer_whose_connection_went_silent_says_so_and_connects_again() {
    logs();
    let topology = Topology::declare("jobs").await;
    let proxy = Proxy::start(rabbitmq_address()).await;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let transport = RabbitTransport::builder(proxy.url_for(&rabbitmq_url()), &topology.queue)
        .prefetch(5)
        .connect_timeout(Duration::from_secs(1))
        .stall_check(Duration::from_secs(1))
        .build()
        .await
        .expect("transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "jobs"))
        .concurrency(2)
        .on_event_type::<Job, _>("Job", |_tx, _msg| Box::pin(async { Ok(()) }))
        .build()
        .expect("consumer")
        .spawn();
    publish(&topology, 0, 10).await;
    wait_until("the first 10 handled", WAIT, || async {
        consumer.stats().handled >= 10
    })
    .await;
    let accepted = proxy.accepted();
    proxy.freeze_open();
    publish(&topology, 10, 40).await;
    // Up to `prefetch` went into the frozen connection: the broker holds them until it
    // gives up on that connection. The other 35 are ready for a new one.
    let stats = || format!("{:?}, {} connections", consumer.stats(), proxy.accepted());
    let deadline = std::time::Instant::now() + WAIT;
    while consumer.stats().handled < 45 {
        assert!(
            std::time::Instant::now() < deadline,
            "the consumer did not get past its silent connection within {WAIT:?}: {}; its log:\n{}",
            stats(),
            lines_with(&["outbox_rabbitmq"]).join("\n")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(proxy.accepted() > accepted, "a new connection: {}", stats());
    let warned = lines_with(&["outbox-rabbitmq consumer: stuck; connecting again"]);
    assert!(
        !warned.is_empty(),
        "the transport said why it connected again; its log:\n{}",
        lines_with(&["outbox_rabbitmq"]).join("\n")
    );
    consumer.shutdown().await.expect("consumer");
    drop(proxy);
    topology.delete().await;
    db.cleanup().await;
}

/// A handler that does not end holds its key and its message: the consumer says, every
/// `stall_warning`, which message it waits for and for how long.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_whose_handler_does_not_end_says_which_message_it_waits_for() {
    logs();
    let topology = Topology::declare("jobs").await;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let transport = RabbitTransport::builder(rabbitmq_url(), &topology.queue)
        .build()
        .await
        .expect("transport");
    let release = Arc::new(Notify::new());
    let held = Arc::clone(&release);
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "stuck-handler"))
        .stall_warning(Duration::from_millis(300))
        .on_event_type::<Job, _>("Job", move |_tx, msg| {
            let held = Arc::clone(&held);
            Box::pin(async move {
                if msg.event.n == 3 {
                    held.notified().await;
                }
                Ok(())
            })
        })
        .build()
        .expect("consumer")
        .spawn();
    publish(&topology, 0, 5).await;
    let warning = "outbox consumer: no message finished while messages are in hand";
    wait_until(
        "the consumer warns of the handler that does not end",
        WAIT,
        || async {
            lines_with(&[warning, "stuck-handler"]).iter().any(|l| {
                l.contains("in_hand=1") && l.contains("key \"k3\"") && l.contains("state=queue")
            })
        },
    )
    .await;
    assert_eq!(consumer.stats().handled, 4, "the other keys went on");
    release.notify_one();
    wait_until("the last one handled", WAIT, || async {
        consumer.stats().handled == 5
    })
    .await;
    consumer.shutdown().await.expect("consumer");
    topology.delete().await;
    db.cleanup().await;
}

/// A relay whose broker is away publishes nothing while rows are due: it says so, and
/// what it waits for, then carries on when the broker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_publishes_nothing_while_rows_are_due_says_what_it_waits_for() {
    use outbox_core::publisher::{InMemoryPublisher, PublishError};
    use outbox_core::{OutboxMessage, Relay};
    logs();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |_| true,
        None,
        PublishError::unavailable("the broker is away"),
    );
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_millis(100))
        .stall_warning(Duration::from_millis(500))
        .spawn();
    let mut tx = outbox.begin().await.expect("begin");
    for n in 0..5 {
        tx.emit_message(
            OutboxMessage::new("Job", "stall.warnings", format!(r#"{{"n":{n}}}"#))
                .with_key("relay-stall-key"),
        )
        .expect("emit");
    }
    tx.commit().await.expect("commit");
    let warning = "outbox relay: nothing published while rows are due; waiting for the broker";
    wait_until(
        "the relay warns that it waits for the broker",
        WAIT,
        || async {
            lines_with(&[warning])
                .iter()
                .any(|l| l.contains("pending=5"))
        },
    )
    .await;
    assert_eq!(publisher.published_count(), 0);
    publisher.clear_failures();
    assert!(
        publisher.wait_for(5, WAIT).await,
        "published once the broker is back"
    );
    relay.shutdown().await;
    db.cleanup().await;
}

/// An `OutboxTx` dropped while it holds events (an early return, a forgotten commit)
/// says so, with how many and the first one; a committed, a rolled-back and an empty one
/// say nothing. Before, the events were gone without a word (#36).
#[tokio::test]
async fn a_transaction_dropped_holding_events_says_so() {
    logs();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let kind = format!("Dropped{}", uuid::Uuid::now_v7().simple());
    let message = || OutboxMessage::new(kind.clone(), "orders", "{}");

    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(message()).expect("emit");
    tx.commit().await.expect("commit");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(message()).expect("emit");
    tx.rollback().await.expect("rollback");
    drop(outbox.begin().await.expect("begin"));
    let first = {
        let mut tx = outbox.begin().await.expect("begin");
        let first = tx.emit_message(message()).expect("emit");
        tx.emit_message(message()).expect("emit");
        tx.flush().await.expect("flush");
        first
    };

    let lines = lines_with(&["dropped without commit()", &kind]);
    assert_eq!(
        lines.len(),
        1,
        "one warning, for the transaction dropped with events: {lines:?}"
    );
    assert!(
        lines[0].contains("events=2") && lines[0].contains(&first.to_string()),
        "the warning says how many events and names the first: {}",
        lines[0]
    );
    assert_eq!(db.count("outbox").await, 1, "only the committed event");
    db.cleanup().await;
}

/// A relay started before `migrate()` says so once, with what to do, and keeps waiting:
/// once the tables exist, it publishes. Before, it logged "database session failed" with
/// the driver's `relation ... does not exist` at every reconnect (#36).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_before_the_migrations_says_so_once_and_waits() {
    logs();
    let db = TestDb::new().await;
    let outbox = outbox_core::Outbox::new(db.pool.clone());
    let publisher = outbox_core::publisher::InMemoryPublisher::new();
    let relay = outbox_core::Relay::builder(outbox.clone(), publisher.clone())
        .reconnect_delay(Duration::from_millis(200))
        .spawn();
    wait_until("the relay tried 4 times", WAIT, || async {
        relay.stats().reconnects >= 4
    })
    .await;
    let said = lines_with(&[
        "the outbox table does not exist",
        "run the migrations first",
    ]);
    assert_eq!(said.len(), 1, "said once, not at every try: {said:?}");
    let raw = lines_with(&["database session failed", "does not exist"]);
    assert!(raw.is_empty(), "no raw driver error at every try: {raw:?}");

    outbox.migrate().await.expect("migrate");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("Late", "orders", "{}"))
        .expect("emit");
    tx.commit().await.expect("commit");
    assert!(
        publisher.wait_for(1, WAIT).await,
        "the relay waited for the tables and publishes"
    );
    relay.shutdown().await;
    db.cleanup().await;
}
