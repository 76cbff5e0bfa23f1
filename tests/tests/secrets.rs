//! No password reaches a log line, an error's `Display` or `Debug`, or a builder's
//! `Debug`: a password planted in every URL form the crates take is looked for in all of
//! them, with every log line of every crate (dependencies included) captured at debug
//! level. This binary holds one test, so the log capture sees nothing else.
//!
//! Not at trace level: async-nats traces the CONNECT message it writes, password and
//! token included, whatever way they are given (`docs/nats.md` says so).

use outbox_core::Outbox;
use outbox_nats::NatsPublisher;
use outbox_tests::logs::Captured;
use outbox_tests::nats::OwnNats;
use outbox_tests::{backends::mysql_url, database_url};

const PLANTED: &str = "PLANTEDs3cret";

/// `text` (what `what` printed) must not hold the planted password.
fn clean(what: &str, text: &str) {
    assert!(!text.contains(PLANTED), "{what} shows the password: {text}");
}

/// The error's `Display` and `Debug` must not hold the password.
fn clean_error(what: &str, e: &(impl std::fmt::Display + std::fmt::Debug)) {
    clean(&format!("{what} (Display)"), &e.to_string());
    clean(&format!("{what} (Debug)"), &format!("{e:?}"));
}

/// `url` with the planted password as the password of its user information.
fn with_password(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (userinfo, host) = rest.split_once('@').unwrap_or(("user", rest));
    let user = userinfo.split(':').next().unwrap_or("user");
    format!("{scheme}://{user}:{PLANTED}@{host}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_appears_in_logs_errors_or_debug_output() {
    let logs = Captured::install(tracing::Level::DEBUG);

    // NATS, a server that requires this user and password: the credentials work when
    // given in the URL (they travel in the connect options, not the URL).
    let server = OwnNats::start(Some(("app", PLANTED)));
    let url = format!("nats://app:{PLANTED}@127.0.0.1:{}", server.port());
    let builder = NatsPublisher::builder(url.as_str()).skip_catalog_check();
    clean("NatsPublisherBuilder's Debug", &format!("{builder:?}"));
    let publisher = builder
        .build()
        .await
        .expect("the URL's credentials are accepted by the server");
    clean("NatsPublisher's Debug", &format!("{publisher:?}"));
    // A token, and a wrong password: refused, and the errors don't show them.
    let token = format!("nats://{PLANTED}@127.0.0.1:{}", server.port());
    let wrong = format!("nats://app:{PLANTED}x@127.0.0.1:{}", server.port());
    for url in [token, wrong] {
        let e = NatsPublisher::builder(url.as_str())
            .skip_catalog_check()
            .build()
            .await
            .expect_err("wrong credentials are refused");
        clean_error("NATS authorization error", &e);
    }
    // No server at all.
    let e = NatsPublisher::builder(format!("nats://app:{PLANTED}@127.0.0.1:1"))
        .build()
        .await
        .expect_err("nothing listens on port 1");
    clean_error("NATS connect error", &e);
    assert!(e.to_string().contains("nats://127.0.0.1:1"), "{e}");

    // PostgreSQL: the server trusts everyone, so a planted password connects; a server
    // that is not there gives an error naming it.
    let outbox = Outbox::connect(&with_password(&database_url()))
        .await
        .expect("trust authentication ignores the password");
    clean("Outbox's Debug", &format!("{outbox:?}"));
    outbox.migrate().await.expect("migrate");
    outbox.pool().close().await;
    for url in [
        format!("postgres://postgres:{PLANTED}@127.0.0.1:1/test"),
        format!("postgres://postgres@127.0.0.1:1/test?password={PLANTED}"),
        format!("postgres://postgres@127.0.0.1:1/test?sslmode=disable&password={PLANTED}"),
        format!("postgres://postgres:{PLANTED}@127.0.0.1:notaport/test"),
    ] {
        let e = Outbox::connect(&url)
            .await
            .expect_err("nothing listens there");
        clean_error(&format!("Outbox::connect({url})"), &e);
    }

    // MySQL/MariaDB: a wrong password and a server that is not there.
    for url in [
        with_password(&mysql_url()),
        format!("mysql://root:{PLANTED}@127.0.0.1:1/test"),
        format!("mysql://root@127.0.0.1:1/test?password={PLANTED}"),
    ] {
        match Outbox::connect_mysql(&url).await {
            Ok(outbox) => clean("Outbox<MySql>'s Debug", &format!("{outbox:?}")),
            Err(e) => clean_error(&format!("Outbox::connect_mysql({url})"), &e),
        }
    }

    let logged = logs.text();
    clean("the log", &logged);
    // The capture works and reaches the dependencies' debug lines (async-nats names the
    // server it connects to), so a leak there would have been seen.
    assert!(
        logged.contains("async_nats") && logged.contains("DEBUG"),
        "dependencies' debug lines are captured: {logged}"
    );
    assert!(logged.contains("outbox-nats publisher ready"), "{logged}");
    drop(server);
}
