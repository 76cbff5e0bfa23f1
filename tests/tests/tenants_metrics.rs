//! The metrics of a relay of many outboxes: a `tenant` label for the first
//! `labelled_tenants`, `other` for the rest (a test binary of its own: it installs the
//! process's metrics recorder).

use std::collections::BTreeMap;
use std::time::Duration;

use metrics_util::debugging::DebuggingRecorder;
use outbox_core::OutboxMessage;
use outbox_core::relay::{RelayConfig, Tenants};
use outbox_nats::NatsPublisher;
use outbox_tests::metrics::Seen;
use outbox_tests::nats::{fresh_stream, nats_url};
use outbox_tests::{TestDb, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_tenants_get_a_label_of_their_own_and_the_rest_share_other() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder");

    let (_js, _name, prefix) = fresh_stream().await;
    let db = TestDb::new().await;
    let mut names = Vec::new();
    for (i, outbox) in db.tenants(5).await.iter().enumerate() {
        // Tenant i has i + 1 events.
        let mut tx = outbox.begin().await.expect("begin");
        for n in 0..=i {
            tx.emit_message(OutboxMessage::new(
                "Ticked",
                format!("{prefix}.t{i}"),
                format!(r#"{{"n":{n}}}"#),
            ))
            .expect("emit");
        }
        tx.commit().await.expect("commit");
        names.push(outbox.tables().outbox.to_string());
    }
    let publisher = NatsPublisher::builder(nats_url())
        .build()
        .await
        .expect("connect to NATS");
    let mut config = RelayConfig::default();
    config.poll_interval = Duration::from_millis(200);
    let relay = Tenants::builder(publisher)
        .config(config)
        .labelled_tenants(3)
        .outboxes(db.pool.clone(), names.clone())
        .spawn()
        .expect("spawn the relay");
    let seen = std::sync::Mutex::new(Seen::by("tenant"));
    wait_until("every event is published", Duration::from_secs(30), || {
        let mut seen = seen.lock().expect("seen");
        seen.take(&snapshotter);
        let done = seen
            .by_label("outbox_published_total")
            .values()
            .sum::<f64>()
            >= 15.0;
        async move { done }
    })
    .await;
    relay.shutdown().await;
    let mut seen = seen.into_inner().expect("seen");
    seen.take(&snapshotter);

    // Tenants start in the order given: the first three are labelled.
    let published = seen.by_label("outbox_published_total");
    let expected: BTreeMap<String, f64> = [
        (names[0].clone(), 1.0),
        (names[1].clone(), 2.0),
        (names[2].clone(), 3.0),
        ("other".to_owned(), 4.0 + 5.0),
    ]
    .into();
    assert_eq!(published, expected, "outbox_published_total by tenant");
    // The gauges come with each tenant's probe, at the start of its first turn.
    let pending = seen.by_label("outbox_pending");
    assert!(
        !pending.contains_key("other") && !pending.contains_key("<none>"),
        "gauges of tenants past the labelled ones are not reported: {pending:?}"
    );
    assert_eq!(
        pending.keys().cloned().collect::<Vec<_>>(),
        names[..3].to_vec(),
        "each labelled tenant reports its gauges"
    );
    db.drop_tenants(5).await;
    db.cleanup().await;
}
