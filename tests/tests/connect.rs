//! A database that accepts connections but never answers (a frozen server, or a proxy
//! whose backend is gone): every connect has a timeout, and a relay's `shutdown()`
//! returns within its documented bound in every state, also while it connects or waits
//! on a statement the database will never answer.

use std::str::FromStr;
use std::time::{Duration, Instant};

use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_core::sqlx::{MySql, Postgres};
use outbox_core::{Error, Outbox, OutboxMessage};
use outbox_tests::proxy::{Mode, Proxy};
use outbox_tests::{TestDb, database_url, wait_until};

/// The test's own guard: far above every bound checked here, so a hang fails the test
/// instead of hanging the suite.
const GUARD: Duration = Duration::from_secs(30);

#[tokio::test]
async fn connecting_to_a_server_that_never_answers_fails_within_the_connect_timeout() {
    let hole = Proxy::black_hole().await;
    let addr = hole.addr();
    let postgres = format!("postgres://postgres:secret@{addr}/test?connect_timeout=1");
    let mysql = format!("mysql://root:secret@{addr}/test?connect_timeout=1");
    for (url, connect) in [
        (
            &postgres,
            Box::pin(async { Outbox::<Postgres>::connect(&postgres).await.map(drop) })
                as std::pin::Pin<Box<dyn std::future::Future<Output = _>>>,
        ),
        (
            &mysql,
            Box::pin(async { Outbox::<MySql>::connect_mysql(&mysql).await.map(drop) }),
        ),
    ] {
        let started = Instant::now();
        let err = tokio::time::timeout(GUARD, connect)
            .await
            .unwrap_or_else(|_| panic!("{url}: connect never returned"))
            .expect_err("nobody answers");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(3), "{url}: {took:?}");
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
        // What a person is shown: the error and its source (the driver's words).
        let text = outbox_core::ErrorChain(&err).to_string();
        assert!(
            text.contains("did not answer within 1s") && !text.contains("secret"),
            "{text}"
        );
    }
    // The default, without `connect_timeout` in the URL: 10 s.
    let started = Instant::now();
    let url = format!("postgres://postgres@{addr}/test");
    tokio::time::timeout(GUARD, Outbox::<Postgres>::connect(&url))
        .await
        .expect("connect returns")
        .expect_err("nobody answers");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(15),
        "the default connect timeout is 10 s: {took:?}"
    );
}

/// A relay that is connecting to a database that never answers stops at once when asked.
#[tokio::test]
async fn a_relay_connecting_to_a_frozen_database_shuts_down_at_once() {
    let hole = Proxy::black_hole().await;
    let pool = PgPoolOptions::new()
        .connect_lazy(&format!("postgres://postgres@{}/test", hole.addr()))
        .expect("a lazy pool");
    let relay = Relay::builder(Outbox::new(pool), InMemoryPublisher::new()).spawn();
    wait_until("the relay is connecting", GUARD, || async {
        hole.accepted() >= 1
    })
    .await;
    let started = Instant::now();
    tokio::time::timeout(GUARD, relay.shutdown())
        .await
        .expect("shutdown returns while the relay connects");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

/// A relay blocked in a statement on a connection that stopped answering returns from
/// `shutdown()` within `publish_timeout + connect_timeout`; its rows stay pending for the
/// next relay. A connect that times out counts as a failed session and is retried.
#[tokio::test]
async fn a_relay_waiting_on_a_frozen_connection_shuts_down_within_its_bound() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await; // migrated, directly
    let url = database_url();
    let server = PgConnectOptions::from_str(&url).expect("url");
    let upstream = format!("{}:{}", server.get_host(), server.get_port());
    let upstream = tokio::net::lookup_host(upstream)
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let options = PgConnectOptions::from_str(&proxy.url_for(&url))
        .expect("proxied url")
        .options([("search_path", db.schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("connect through the proxy");
    let published = InMemoryPublisher::new();
    let relay = Relay::builder(Outbox::new(pool), published.clone())
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_millis(500))
        .reconnect_delay(Duration::from_millis(100))
        .spawn();
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(OutboxMessage::new("T", "d", "{}"))
        .expect("emit");
    tx.commit().await.expect("commit");
    assert!(
        published.wait_for(1, GUARD).await,
        "the relay works through the proxy"
    );
    wait_until("the relay marked it", GUARD, || async {
        let marked: i64 = outbox_core::sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .expect("count");
        marked == 1
    })
    .await;

    // The relay polls every 100 ms: its next statement goes into the stall. (Not
    // `stats().queries`: a statement counted just before the stall may be the one that
    // is stuck, and the count then never moves again.)
    proxy.set(Mode::Stall);
    outbox_tests::wait_until_or(
        "the relay sent a statement into the stall",
        GUARD,
        || async { proxy.held() > 0 },
        || {
            format!(
                "relay {:?}; proxy: {} connections accepted, {} reads held",
                relay.stats(),
                proxy.accepted(),
                proxy.held()
            )
        },
    )
    .await;
    let started = Instant::now();
    tokio::time::timeout(GUARD, relay.shutdown())
        .await
        .expect("shutdown returns");
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1500 + 1000),
        "within publish_timeout + connect_timeout (1.5 s), plus slack: {took:?}"
    );

    // A connect through the stalled proxy times out and is retried: counted as a
    // reconnect, and nothing hangs.
    let relay = Relay::builder(
        Outbox::new(PgPoolOptions::new().connect_lazy_with(
            PgConnectOptions::from_str(&proxy.url_for(&url)).expect("proxied url"),
        )),
        InMemoryPublisher::new(),
    )
    .connect_timeout(Duration::from_millis(300))
    .reconnect_delay(Duration::from_millis(100))
    .spawn();
    outbox_tests::wait_until_or(
        "connects time out and are retried",
        GUARD,
        || async { relay.stats().reconnects >= 2 },
        || {
            format!(
                "relay {:?}; proxy: {} connections accepted",
                relay.stats(),
                proxy.accepted()
            )
        },
    )
    .await;
    tokio::time::timeout(GUARD, relay.shutdown())
        .await
        .expect("shutdown returns");
    proxy.set(Mode::Forward);
    db.cleanup().await;
}
