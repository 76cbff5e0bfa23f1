//! `outbox-rabbitmq` over TLS (`amqps://`), against RabbitMQ's TLS listener with the test
//! CA's server certificate for `localhost` (`scripts/services.sh`,
//! `OUTBOX_TEST_RABBITMQ_TLS_URL`). The exchange and the queue are declared over the
//! plain listener; everything the library does goes through TLS.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::{OutboxMessage, Relay};
use outbox_rabbitmq::{Error, RabbitPublisher, RabbitTransport};
use outbox_tests::kafka::Job;
use outbox_tests::rabbitmq::Topology;
use outbox_tests::{TestDb, tls_dir, wait_until};

fn tls_url() -> String {
    std::env::var("OUTBOX_TEST_RABBITMQ_TLS_URL").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_TEST_RABBITMQ_TLS_URL is not set: run the tests with `scripts/test.sh`, \
             or `eval \"$(scripts/services.sh)\"` first (it turns on RabbitMQ's TLS listener)"
        )
    })
}

fn ca(name: &str) -> String {
    format!("{}/{name}", tls_dir())
}

/// The relay publishes with confirms, and a consumer consumes and acknowledges, both
/// over `amqps://` with the broker verified against the test CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_and_a_consumer_consumes_over_amqps() {
    let topology = Topology::declare("jobs").await;
    let destination = format!("{}/jobs", topology.exchange);
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    for n in 0..3 {
        tx.emit_message(
            OutboxMessage::new("Job", destination.as_str(), format!(r#"{{"n":{n}}}"#))
                .with_key("a"),
        )
        .expect("emit");
    }
    tx.commit().await.expect("commit");

    let publisher = RabbitPublisher::builder(tls_url())
        .tls_root_certificates(ca("ca.crt"))
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("a publisher over amqps");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let into = Arc::clone(&seen);
    let transport = RabbitTransport::builder(tls_url(), &topology.queue)
        .tls_root_certificates(ca("ca.crt"))
        .build()
        .await
        .expect("a consumer transport over amqps");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "over-amqps"))
        .on_event_type::<Job, _>("Job", move |_tx, msg| {
            into.lock().expect("seen").push(msg.event.n);
            Box::pin(async { Ok(()) })
        })
        .build()
        .expect("consumer")
        .spawn();
    wait_until(
        "the consumer handled the 3 events over amqps",
        Duration::from_secs(30),
        || async { consumer.stats().handled >= 3 },
    )
    .await;
    consumer.shutdown().await.expect("consumer");
    relay.shutdown().await;
    assert_eq!(*seen.lock().expect("seen"), [0, 1, 2], "in key order");
    topology.delete().await;
    db.cleanup().await;
}

/// A broker whose certificate the trusted CAs did not sign: `Error::Tls`, naming TLS
/// and what to check, for the publisher and the consumer; not "check that the broker
/// runs".
#[tokio::test]
async fn a_broker_the_ca_does_not_vouch_for_is_a_tls_error() {
    let e = RabbitPublisher::builder(tls_url())
        .tls_root_certificates(ca("other-ca.crt"))
        .skip_catalog_check()
        .build()
        .await
        .expect_err("the broker's certificate is not signed by other-ca");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("TLS") && text.contains("tls_root_certificates"),
        "{text}"
    );
    assert!(!text.contains("check that the broker runs"), "{text}");
    assert!(!text.contains("guest:guest"), "the password shows: {text}");

    let e = RabbitTransport::builder(tls_url(), "any")
        .tls_root_certificates(ca("other-ca.crt"))
        .build()
        .await
        .expect_err("the consumer's transport too");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
}
