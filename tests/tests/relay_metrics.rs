//! A relay's metric labels and gauges (`RelayBuilder::metric_label`, `::gauges`,
//! `::labelled_destinations`): two relays in one process keep their metrics apart, by
//! the labels they set or by their own (`outbox`, `database`), and destinations are
//! labelled up to a bound (a test binary of its own: it installs the process's metrics
//! recorder, once, and its tests take turns reading it).

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::{Outbox, OutboxMessage, Relay};
use outbox_tests::metrics::Seen;
use outbox_tests::{TestDb, wait_until_or};

/// The process's recorder; a test holds the lock while it reads it (a snapshot takes
/// what it reads, so two tests reading at once would take each other's counts).
async fn recorder() -> (&'static Snapshotter, tokio::sync::MutexGuard<'static, ()>) {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let snapshotter = SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).expect("the only recorder");
        snapshotter
    });
    let turn = TURN.lock().await;
    snapshotter.snapshot();
    (snapshotter, turn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_in_one_process_keep_their_metrics_apart() {
    let (snapshotter, _turn) = recorder().await;

    let (a_db, b_db) = (TestDb::new().await, TestDb::new().await);
    let (a, b) = (a_db.outbox().await, b_db.outbox().await);
    let (a_pub, b_pub) = (InMemoryPublisher::new(), InMemoryPublisher::new());
    let a_relay = Relay::builder(a.clone(), a_pub.clone())
        .poll_interval(Duration::from_millis(100))
        .metric_label("outbox", "a")
        .spawn();
    let b_relay = Relay::builder(b.clone(), b_pub.clone())
        .poll_interval(Duration::from_millis(100))
        .metric_label("outbox", "b")
        .gauges(false)
        .spawn();
    for (outbox, n) in [(&a, 3), (&b, 5)] {
        let mut tx = outbox.pool().begin().await.expect("begin");
        let messages: Vec<_> = (0..n)
            .map(|i| OutboxMessage::new("Metered", "metered", format!("{{\"n\":{i}}}")))
            .collect();
        outbox
            .enqueue_messages(&mut tx, &messages)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    let seen = std::sync::Mutex::new(Seen::by("outbox"));
    wait_until_or(
        "each relay counted its own messages under its own label",
        Duration::from_secs(30),
        || {
            let mut seen = seen.lock().expect("seen");
            seen.take(snapshotter);
            let done = seen.get("outbox_published_total", "a") == Some(3.0)
                && seen.get("outbox_published_total", "b") == Some(5.0)
                && seen.get("outbox_pending", "a").is_some();
            async move { done }
        },
        || {
            format!(
                "{:?}; published a={}, b={}",
                seen.lock().expect("seen"),
                a_pub.published_count(),
                b_pub.published_count()
            )
        },
    )
    .await;
    let seen = seen.into_inner().expect("seen");
    assert_eq!(
        seen.get("outbox_published_total", "<none>"),
        None,
        "a labelled relay's counter without its label: {seen:?}"
    );
    assert_eq!(
        seen.get("outbox_pending", "b"),
        None,
        "gauges(false) reported a gauge: {seen:?}"
    );
    a_relay.shutdown().await;
    b_relay.shutdown().await;
}

/// Counter values (summed over what is not in the key) and histogram counts, by
/// (metric, `outbox`, `database`, `destination`) label values.
type Series = BTreeMap<(String, String, String, String), f64>;

fn take(snapshotter: &Snapshotter, into: &mut Series) {
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let label = |name: &str| {
            key.key()
                .labels()
                .find(|l| l.key() == name)
                .map_or_else(|| "<none>".to_owned(), |l| l.value().to_owned())
        };
        let entry = into
            .entry((
                key.key().name().to_owned(),
                label("outbox"),
                label("database"),
                label("destination"),
            ))
            .or_default();
        match value {
            DebugValue::Counter(c) => *entry += c as f64,
            DebugValue::Gauge(g) => *entry = g.into_inner(),
            DebugValue::Histogram(h) => *entry += h.len() as f64,
        }
    }
}

/// An outbox of its own table in `db`'s schema.
async fn outbox_named(db: &TestDb, table: &str) -> Outbox {
    let outbox = Outbox::builder(db.pool.clone())
        .table(table)
        .build()
        .expect("the outbox");
    outbox.migrate().await.expect("migrate");
    outbox
}

/// Two relays of two outbox tables in one database, with no label set by the
/// application: each relay's metrics carry its table and database, so they do not add
/// into one series (#37: they did), and each destination its own label up to
/// `labelled_destinations`, then `other`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_label_their_metrics_by_outbox_database_and_a_bounded_destination() {
    let (snapshotter, _turn) = recorder().await;
    let db = TestDb::new().await;
    let (orders, billing) = (
        outbox_named(&db, "orders_outbox").await,
        outbox_named(&db, "billing_outbox").await,
    );
    let database: String = outbox_core::sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&db.pool)
        .await
        .expect("the database's name");
    let (orders_pub, billing_pub) = (InMemoryPublisher::new(), InMemoryPublisher::new());
    // A relay labels the destinations of the binary's event types (the catalog) first,
    // at start: the bound leaves room for two more.
    let known: std::collections::BTreeSet<&str> = outbox_core::catalog::entries()
        .into_iter()
        .map(|e| e.destination.as_str())
        .collect();
    assert!(
        ["a", "b", "c", "d"].iter().all(|d| !known.contains(d)),
        "{known:?}"
    );
    let orders_relay = Relay::builder(orders.clone(), orders_pub.clone())
        .poll_interval(Duration::from_millis(100))
        .labelled_destinations(known.len() + 2)
        .spawn();
    let billing_relay = Relay::builder(billing.clone(), billing_pub.clone())
        .poll_interval(Duration::from_millis(100))
        .spawn();
    // orders: 1 to a, 2 to b, 3 to c, 4 to d (c and d past the bound); billing: 5 to a.
    let mut messages = Vec::new();
    for (destination, n) in [("a", 1), ("b", 2), ("c", 3), ("d", 4)] {
        for i in 0..n {
            // One destination after the other, so that a and b are the first two.
            messages.push(OutboxMessage::new(
                "Metered",
                destination,
                format!("{{\"n\":{i}}}"),
            ));
        }
    }
    for (outbox, messages) in [
        (&orders, messages),
        (
            &billing,
            (0..5)
                .map(|i| OutboxMessage::new("Metered", "a", format!("{{\"n\":{i}}}")))
                .collect(),
        ),
    ] {
        let mut tx = outbox.pool().begin().await.expect("begin");
        outbox
            .enqueue_messages(&mut tx, &messages)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    let series = std::sync::Mutex::new(Series::new());
    let published = |outbox: &str, destination: &str| {
        series
            .lock()
            .expect("series")
            .get(&(
                "outbox_published_total".to_owned(),
                outbox.to_owned(),
                database.clone(),
                destination.to_owned(),
            ))
            .copied()
    };
    wait_until_or(
        "each relay counted its messages under its outbox and destination labels",
        Duration::from_secs(30),
        || {
            take(snapshotter, &mut series.lock().expect("series"));
            let done = published("orders_outbox", "other") == Some(7.0)
                && published("billing_outbox", "a") == Some(5.0);
            async move { done }
        },
        || {
            format!(
                "{:#?}; published orders={}, billing={}",
                series.lock().expect("series"),
                orders_pub.published_count(),
                billing_pub.published_count()
            )
        },
    )
    .await;
    orders_relay.shutdown().await;
    billing_relay.shutdown().await;
    take(snapshotter, &mut series.lock().expect("series"));
    let series = series.into_inner().expect("series");
    let get = |name: &str, outbox: &str, destination: &str| {
        series
            .get(&(
                name.to_owned(),
                outbox.to_owned(),
                database.clone(),
                destination.to_owned(),
            ))
            .copied()
    };
    assert_eq!(
        get("outbox_published_total", "orders_outbox", "a"),
        Some(1.0),
        "{series:#?}"
    );
    assert_eq!(
        get("outbox_published_total", "orders_outbox", "b"),
        Some(2.0),
        "{series:#?}"
    );
    for past in ["c", "d"] {
        assert_eq!(
            get("outbox_published_total", "orders_outbox", past),
            None,
            "past the bound, {past} has no label of its own: {series:#?}"
        );
    }
    assert_eq!(
        get("outbox_time_in_outbox_seconds", "orders_outbox", "other"),
        Some(7.0),
        "one observation per message, by destination: {series:#?}"
    );
    assert_eq!(
        get("outbox_dead_lettered_total", "billing_outbox", "a"),
        Some(0.0),
        "a destination's counters start at 0: {series:#?}"
    );
    assert!(
        series
            .keys()
            .all(|(name, outbox, ..)| !name.starts_with("outbox_")
                || name.starts_with("outbox_consumer")
                || outbox != "<none>"),
        "every relay metric has its outbox label: {series:#?}"
    );
    assert!(
        get("outbox_pending", "orders_outbox", "<none>").is_some()
            && get("outbox_pending", "billing_outbox", "<none>").is_some(),
        "each relay's gauges under its own labels: {series:#?}"
    );
    db.cleanup().await;
}
