//! The library over TLS, against a PostgreSQL role that may connect over TLS only
//! (`scripts/services.sh`: `hostssl` for `outbox_tls`, everything else rejected), with
//! the server verified against the test CA (`sslmode=verify-full`, `sslrootcert`).

use std::time::Duration;

use outbox_core::publisher::InMemoryPublisher;
use outbox_core::{Error, Outbox, OutboxMessage, Relay};
use outbox_tests::{TestDb, pg_tls_url, tls_dir};

/// `url` with the session's `search_path` set to `schema` (libpq's `options`).
fn in_schema(url: &str, schema: &str) -> String {
    format!("{url}&options=-c%20search_path%3D{schema}")
}

#[tokio::test]
async fn the_relay_publishes_what_was_committed_over_a_tls_only_connection() {
    let db = TestDb::new().await;
    let outbox = Outbox::connect(&in_schema(&pg_tls_url(), &db.schema))
        .await
        .expect("connect over TLS (verify-full against the test CA)");
    outbox.migrate().await.expect("migrate over TLS");
    let ssl: bool =
        outbox_core::sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(outbox.pool())
            .await
            .expect("read pg_stat_ssl");
    assert!(ssl, "the pool's connection is not encrypted");

    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("Shipped", "orders", r#"{"id":1}"#).with_key("1"))
        .expect("emit");
    tx.commit().await.expect("commit over TLS");

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    assert!(
        publisher.wait_for(1, Duration::from_secs(30)).await,
        "the relay published nothing over TLS within 30 s: {:?}",
        relay.stats()
    );
    relay.shutdown().await;
    assert_eq!(publisher.published()[0].event_type, "Shipped");
    db.cleanup().await;
}

#[tokio::test]
async fn a_server_the_ca_does_not_vouch_for_is_a_tls_error_not_an_unreachable_server() {
    let url = pg_tls_url().replace(
        &format!("{}/ca.crt", tls_dir()),
        &format!("{}/other-ca.crt", tls_dir()),
    );
    assert!(url.contains("other-ca.crt"), "{url}");
    let e = Outbox::connect(&url)
        .await
        .expect_err("a server signed by another CA must be refused");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("TLS"), "{text}");
    assert!(text.contains("sslrootcert"), "{text}");
    assert!(!text.contains("check that the server is running"), "{text}");
}

#[tokio::test]
async fn without_tls_the_tls_only_role_is_refused_by_the_server() {
    let url = pg_tls_url().replace("sslmode=verify-full", "sslmode=disable");
    let e = Outbox::connect(&url)
        .await
        .expect_err("the role may connect over TLS only");
    // The server's own refusal (pg_hba.conf), reported as such.
    assert!(matches!(e, Error::Database { .. }), "{e:?}");
    assert!(e.to_string().contains("pg_hba.conf"), "{e}");
}
