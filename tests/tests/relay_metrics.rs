//! A relay's metric labels and gauges (`RelayBuilder::metric_label`, `::gauges`): two
//! relays in one process keep their metrics apart (a test binary of its own: it installs
//! the process's metrics recorder).

use std::time::Duration;

use metrics_util::debugging::DebuggingRecorder;
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::{OutboxMessage, Relay};
use outbox_tests::metrics::Seen;
use outbox_tests::{TestDb, wait_until_or};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_in_one_process_keep_their_metrics_apart() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder");

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
            seen.take(&snapshotter);
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
