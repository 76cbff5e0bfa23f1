//! `outbox-nats` over TLS, against a NATS server of the test's own that accepts TLS
//! connections only, with the server certificate of the test CA (`scripts/services.sh`
//! makes it; it names `localhost`).

use std::path::PathBuf;
use std::time::Duration;

use async_nats::ConnectOptions;
use outbox_core::Relay;
use outbox_nats::{Error, NatsPublisher, NatsTransport};
use outbox_tests::consumers::{emit_jobs, handle_jobs};
use outbox_tests::nats::{OwnNats, fresh_stream_on};
use outbox_tests::{TestDb, tls_dir};

fn ca(name: &str) -> PathBuf {
    PathBuf::from(format!("{}/{name}", tls_dir()))
}

/// Options that trust only the CA in `tls_dir()/ca_file`.
///
/// Picks rustls' crypto provider first, as docs/dependencies.md tells an application
/// whose own TLS clients share the process with `wal` + `tls-rustls` (both providers are
/// compiled in then, and rustls has no default). Without it, the test's own client below
/// panicked whenever it connected before the publisher (which sets the provider itself):
/// red in CI, and every time the test ran alone.
fn trusting(ca_file: &str) -> ConnectOptions {
    let _ = rustls::crypto::ring::default_provider().install_default();
    ConnectOptions::new()
        .add_root_certificates(ca(ca_file))
        .require_tls(true)
}

/// The relay publishes and a consumer consumes through a server that speaks TLS only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_and_a_consumer_consumes_over_tls_only() {
    let server = OwnNats::start_tls();
    let url = server.url();
    let client = trusting("ca.crt")
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("the test's client over TLS to {url}: {e}"));
    let (js, stream, prefix) = fresh_stream_on(client).await;
    let subject = format!("{prefix}.jobs");
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    emit_jobs(&outbox, &subject, 3).await;

    let publisher = NatsPublisher::builder(&url)
        .options(trusting("ca.crt"))
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await
        .expect("a publisher over TLS");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();
    let transport = NatsTransport::builder(&url, &stream, "over-tls")
        .options(trusting("ca.crt"))
        .filter_subject(&subject)
        .build()
        .await
        .expect("a consumer transport over TLS");
    let seen = handle_jobs(transport, &outbox, "over-tls", 3, Duration::from_secs(30)).await;
    relay.shutdown().await;
    assert_eq!(seen, [0, 1, 2], "in key order");
    js.delete_stream(&stream).await.expect("delete stream");
    db.cleanup().await;
}

/// A server whose certificate the trusted CA did not sign: `Error::Tls`, naming TLS,
/// for the publisher and the consumer, not "check that the server runs" (failed on main:
/// `Error::Connect`); a `nats://` client without the CA is refused too.
#[tokio::test]
async fn a_server_the_ca_does_not_vouch_for_is_a_tls_error() {
    let server = OwnNats::start_tls();
    let url = server.url();
    let e = NatsPublisher::builder(&url)
        .options(trusting("other-ca.crt"))
        .skip_catalog_check()
        .build()
        .await
        .expect_err("the server's certificate is not signed by other-ca");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("TLS") && text.contains("add_root_certificates"),
        "{text}"
    );
    assert!(!text.contains("check that the server runs"), "{text}");
    // The client's error is the source, shown once in the chain (failed before: it was
    // flattened into the message, and `source()` was `None`).
    let chain = outbox_tests::assert_source_shown_once(&e);
    assert!(chain.contains("certificate"), "{chain}");

    let e = NatsTransport::builder(&url, "ANY", "reader")
        .options(trusting("other-ca.crt"))
        .build()
        .await
        .expect_err("the consumer's transport too");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");

    let plain = url.replace("tls://", "nats://");
    let e = NatsPublisher::builder(&plain)
        .skip_catalog_check()
        .build()
        .await
        .expect_err("a server that requires TLS refuses a plain client");
    // The client upgrades to TLS when the server asks for it, and then trusts only the
    // Mozilla roots, which did not sign the test CA's certificate.
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
}
