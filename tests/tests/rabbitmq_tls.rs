//! `outbox-rabbitmq` over TLS (`amqps://`), against RabbitMQ's TLS listener with the test
//! CA's server certificate for `localhost` (`scripts/services.sh`,
//! `OUTBOX_TEST_RABBITMQ_TLS_URL`). The exchange and the queue are declared over the
//! plain listener; everything the library does goes through TLS.

use std::time::Duration;

use outbox_core::Relay;
use outbox_rabbitmq::{Error, RabbitPublisher, RabbitTransport};
use outbox_tests::consumers::{emit_jobs, handle_jobs};
use outbox_tests::rabbitmq::Topology;
use outbox_tests::{TestDb, tls_dir};

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
    emit_jobs(&outbox, &destination, 3).await;

    let publisher = RabbitPublisher::builder(tls_url())
        .tls_root_certificates(ca("ca.crt"))
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("a publisher over amqps");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let transport = RabbitTransport::builder(tls_url(), &topology.queue)
        .tls_root_certificates(ca("ca.crt"))
        .build()
        .await
        .expect("a consumer transport over amqps");
    let seen = handle_jobs(transport, &outbox, "over-amqps", 3, Duration::from_secs(30)).await;
    relay.shutdown().await;
    assert_eq!(seen, [0, 1, 2], "in key order");
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
    // lapin's error is the source, shown once in the chain (before: flattened into the
    // message, and `source()` was `None`).
    let chain = outbox_tests::assert_source_shown_once(&e);
    assert!(
        !chain.contains("guest:guest"),
        "the password shows: {chain}"
    );

    let e = RabbitTransport::builder(tls_url(), "any")
        .tls_root_certificates(ca("other-ca.crt"))
        .build()
        .await
        .expect_err("the consumer's transport too");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
}
