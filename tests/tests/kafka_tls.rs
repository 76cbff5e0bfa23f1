//! `outbox-kafka` over TLS (the feature `ssl`), against a Kafka-protocol broker reached
//! over TLS only: `scripts/services.sh` puts stunnel in front of a second test broker,
//! which advertises stunnel's port (`OUTBOX_TEST_KAFKA_TLS_BROKERS`), with the test CA's
//! server certificate for `localhost`.

use std::time::Duration;

use outbox_core::Relay;
use outbox_kafka::{Error, KafkaPublisher, KafkaTransport};
use outbox_tests::consumers::{emit_jobs, handle_jobs};
use outbox_tests::{TestDb, tls_dir};

fn tls_brokers() -> String {
    std::env::var("OUTBOX_TEST_KAFKA_TLS_BROKERS").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_TEST_KAFKA_TLS_BROKERS is not set: run the tests with `scripts/test.sh`, \
             or `eval \"$(scripts/services.sh)\"` first (it starts the TLS broker)"
        )
    })
}

fn ca(name: &str) -> String {
    format!("{}/{name}", tls_dir())
}

/// The relay publishes, creating its topic, and a consumer group consumes, each over
/// TLS with the server verified against the test CA (host name included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_and_a_consumer_consumes_over_tls_only() {
    let brokers = tls_brokers();
    let topic = format!("outbox-tls-{}", uuid::Uuid::now_v7().simple());
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    emit_jobs(&outbox, &topic, 3).await;

    let publisher = KafkaPublisher::builder(&brokers)
        .set("security.protocol", "ssl")
        .set("ssl.ca.location", ca("ca.crt"))
        .skip_catalog_check()
        .destination(&topic)
        .create_missing_topics(1, 1)
        .build()
        .await
        .expect("a publisher over TLS");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let transport = KafkaTransport::builder(&brokers, "over-tls")
        .set("security.protocol", "ssl")
        .set("ssl.ca.location", ca("ca.crt"))
        .topic(&topic)
        .build()
        .await
        .expect("a consumer transport over TLS");
    let seen = handle_jobs(transport, &outbox, "over-tls", 3, Duration::from_secs(60)).await;
    relay.shutdown().await;
    assert_eq!(seen, [0, 1, 2], "in key order");
    db.cleanup().await;
}

/// A broker whose certificate the trusted CA did not sign: the publisher's start-up
/// error says TLS and the certificate, not only that the cluster could not be asked.
#[tokio::test]
async fn a_broker_the_ca_does_not_vouch_for_is_named_tls() {
    let e = KafkaPublisher::builder(tls_brokers())
        .set("security.protocol", "ssl")
        .set("ssl.ca.location", ca("other-ca.crt"))
        .skip_catalog_check()
        .destination("anything")
        .startup_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect_err("the broker's certificate is not signed by other-ca");
    assert!(matches!(e, Error::Metadata { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("SSL") && text.contains("certificate"),
        "the error does not name TLS and the certificate: {text}"
    );
}
