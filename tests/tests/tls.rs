//! The library over TLS, against a PostgreSQL role that may connect over TLS only
//! (`scripts/services.sh`: `hostssl` for `outbox_tls`, everything else rejected), with
//! the server verified against the test CA (`sslmode=verify-full`, `sslrootcert`), and
//! a MariaDB user that may connect over TLS only (`REQUIRE SSL`, `ssl-mode=VERIFY_IDENTITY`).
//! The logs are the global subscriber's (`Captured`): this binary is its own.

use std::sync::OnceLock;
use std::time::Duration;

use outbox_core::publisher::InMemoryPublisher;
use outbox_core::{Error, Outbox, OutboxMessage, Relay};
use outbox_tests::backends::{drop_mysql_database, mysql_database};
use outbox_tests::logs::Captured;
use outbox_tests::{TestDb, pg_tls_url, tls_dir, wait_until};

const WAIT: Duration = Duration::from_secs(30);

fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| Captured::install(tracing::Level::INFO))
}

/// `pg_tls_url()` with the test CA replaced by one that signed nothing of the server's.
fn url_with_other_ca() -> String {
    let url = pg_tls_url().replace(
        &format!("{}/ca.crt", tls_dir()),
        &format!("{}/other-ca.crt", tls_dir()),
    );
    assert!(url.contains("other-ca.crt"), "{url}");
    url
}

/// A WAL-mode outbox in `db`'s schema whose pool connects as the TLS-only role, with
/// a slot of the test's own; its replication connection trusts `root_cert`.
async fn wal_outbox_over_tls(db: &TestDb, root_cert: &str) -> (Outbox, String) {
    outbox_tests::wal::drop_stale_slots(db).await;
    let slot = outbox_tests::wal::slot_name();
    let pool = Outbox::connect(&in_schema(&pg_tls_url(), &db.schema))
        .await
        .expect("connect over TLS (verify-full against the test CA)")
        .pool()
        .clone();
    let outbox = Outbox::builder(pool)
        .wal_slot(&slot)
        .wal_ssl_root_cert(root_cert)
        .build()
        .expect("build");
    outbox.migrate().await.expect("migrate creates the slot");
    (outbox, slot)
}

/// `url` with the session's `search_path` set to `schema` (libpq's `options`).
fn in_schema(url: &str, schema: &str) -> String {
    format!("{url}&options=-c%20search_path%3D{schema}")
}

#[tokio::test]
async fn the_relay_publishes_what_was_committed_over_a_tls_only_connection() {
    logs();
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
    logs();
    let e = Outbox::connect(&url_with_other_ca())
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
    logs();
    let url = pg_tls_url().replace("sslmode=verify-full", "sslmode=disable");
    let e = Outbox::connect(&url)
        .await
        .expect_err("the role may connect over TLS only");
    // The server's own refusal (pg_hba.conf), reported as such.
    assert!(matches!(e, Error::Database { .. }), "{e:?}");
    let shown = outbox_core::ErrorChain(&e).to_string();
    assert!(shown.contains("pg_hba.conf"), "{shown}");
}

/// WAL mode over TLS: the replication connection of a role that may connect over TLS
/// only streams what was committed, encrypted (`pg_stat_ssl` of the walsender). Failed
/// on main: the relay refused any `sslmode` of `require` and up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_mode_streams_over_a_tls_only_replication_connection() {
    logs();
    let db = TestDb::new().await;
    let ca = format!("{}/ca.crt", tls_dir());
    let (outbox, slot) = wal_outbox_over_tls(&db, &ca).await;
    let mut tx = outbox.begin().await.expect("begin");
    let id = tx
        .emit_message(OutboxMessage::new("Shipped", "orders", r#"{"id":2}"#).with_key("2"))
        .expect("emit");
    tx.commit().await.expect("commit into the WAL over TLS");

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    let streamed = publisher.wait_for(1, WAIT).await;
    let tls_lines: Vec<String> = logs()
        .text()
        .lines()
        .filter(|l| l.contains(&slot))
        .map(str::to_owned)
        .collect();
    assert!(
        streamed,
        "the WAL relay published nothing over TLS within {WAIT:?}: {:?}; its log lines: {tls_lines:#?}",
        relay.stats()
    );
    assert_eq!(publisher.published()[0].id, id);
    let encrypted: Option<bool> = outbox_core::sqlx::query_scalar(
        "SELECT s.ssl FROM pg_replication_slots r JOIN pg_stat_ssl s ON s.pid = r.active_pid \
         WHERE r.slot_name = $1",
    )
    .bind(&slot)
    .fetch_optional(&db.pool)
    .await
    .expect("read the walsender's pg_stat_ssl");
    assert_eq!(
        encrypted,
        Some(true),
        "the slot's walsender is not encrypted"
    );
    relay.shutdown().await;
    outbox_tests::wal::cleanup(db, &slot).await;
}

/// A replication connection whose CA did not sign the server's certificate: the relay
/// says TLS, and which slot, in its log, publishes nothing and tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_connection_to_a_server_its_ca_does_not_vouch_for_says_tls() {
    logs();
    let db = TestDb::new().await;
    let other = format!("{}/other-ca.crt", tls_dir());
    let (outbox, slot) = wal_outbox_over_tls(&db, &other).await;
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("Shipped", "orders", r#"{"id":3}"#))
        .expect("emit");
    tx.commit().await.expect("commit");

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .reconnect_delay(Duration::from_millis(100))
        .spawn();
    let lines = || -> Vec<String> {
        logs()
            .text()
            .lines()
            .filter(|l| l.contains(&slot))
            .map(str::to_owned)
            .collect()
    };
    wait_until("the relay's session failed twice", WAIT, || async {
        relay.stats().reconnects >= 2
    })
    .await;
    let failures: Vec<String> = lines()
        .into_iter()
        .filter(|l| l.contains("tls error") && l.contains("certificate"))
        .collect();
    assert!(
        !failures.is_empty(),
        "no log line names TLS and the certificate for slot {slot}: {:#?}",
        lines()
    );
    assert!(
        publisher.published().is_empty(),
        "published over an unverified connection"
    );
    relay.shutdown().await;
    outbox_tests::wal::cleanup(db, &slot).await;
}

/// `OUTBOX_TEST_MYSQL_TLS_URL` (`scripts/services.sh`) with the database `database`.
fn mysql_tls_url(database: &str) -> String {
    let url = std::env::var("OUTBOX_TEST_MYSQL_TLS_URL").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_TEST_MYSQL_TLS_URL is not set: run the tests with `scripts/test.sh`, or \
             `eval \"$(scripts/services.sh)\"` first (it makes the TLS-only user)"
        )
    });
    url.replace(":3306/test?", &format!(":3306/{database}?"))
}

/// MySQL/MariaDB over TLS: a user that may connect over TLS only writes, and the relay
/// publishes, through `Outbox::connect_mysql` (feature `tls-rustls`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_the_relay_publishes_over_a_tls_only_connection() {
    logs();
    let database = mysql_database("outbox_tls").await;
    let outbox = Outbox::<outbox_core::sqlx::MySql>::connect_mysql(&mysql_tls_url(&database))
        .await
        .expect("connect over TLS (VERIFY_IDENTITY against the test CA)");
    outbox.migrate().await.expect("migrate over TLS");
    let cipher: (String, String) =
        outbox_core::sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            .fetch_one(outbox.pool())
            .await
            .expect("read Ssl_cipher");
    assert!(
        !cipher.1.is_empty(),
        "the pool's connection is not encrypted: {cipher:?}"
    );

    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("Shipped", "orders", r#"{"id":4}"#).with_key("4"))
        .expect("emit");
    tx.commit().await.expect("commit over TLS");
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    assert!(
        publisher.wait_for(1, WAIT).await,
        "the relay published nothing over TLS within {WAIT:?}: {:?}",
        relay.stats()
    );
    relay.shutdown().await;
    assert_eq!(publisher.published()[0].event_type, "Shipped");
    outbox.pool().close().await;
    drop_mysql_database(&database).await;
}

/// A MariaDB whose certificate the CA did not sign is `Error::Tls`; the TLS-only user
/// without TLS is refused by the server itself.
#[tokio::test]
async fn mysql_a_server_the_ca_does_not_vouch_for_is_a_tls_error() {
    logs();
    let url = mysql_tls_url("test").replace(
        &format!("{}/ca.crt", tls_dir()),
        &format!("{}/other-ca.crt", tls_dir()),
    );
    assert!(url.contains("other-ca.crt"), "{url}");
    let e = Outbox::<outbox_core::sqlx::MySql>::connect_mysql(&url)
        .await
        .expect_err("a server signed by another CA must be refused");
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    assert!(e.to_string().contains("ssl-ca"), "{e}");
    assert!(
        !e.to_string().contains("check that the server is running"),
        "{e}"
    );

    let plain = mysql_tls_url("test").replace("ssl-mode=VERIFY_IDENTITY", "ssl-mode=DISABLED");
    let e = Outbox::<outbox_core::sqlx::MySql>::connect_mysql(&plain)
        .await
        .expect_err("the user may connect over TLS only");
    assert!(matches!(e, Error::Database { .. }), "{e:?}");
    let shown = outbox_core::ErrorChain(&e).to_string();
    assert!(shown.contains("Access denied"), "{shown}");
}
