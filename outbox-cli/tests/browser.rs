//! The dashboard in a real browser (Debian's chromium, driven through chromedriver;
//! `scripts/services.sh` installs both): a dead letter shows up with the message it
//! parks, is released with the token, and the relay publishes it, then the parked one.
//!
//! `OUTBOX_DASHBOARD_SCREENSHOT=docs/dashboard.png` also saves the page, with a few
//! throughput samples, before the release (the picture in docs/operations.md).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TOKEN, dashboard};
use fantoccini::{ClientBuilder, Locator};
use outbox_core::admin::Admin;
use outbox_core::publisher::{InMemoryPublisher, PublishError};
use outbox_core::relay::Relay;
use outbox_core::sqlx;
use outbox_core::{Outbox, OutboxMessage};
use outbox_tests::{TestDb, database_url, trusted_sql, wait_until};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

/// chromedriver on a free port; killed when dropped.
struct Driver(Child, u16);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn chromedriver() -> Driver {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver (scripts/services.sh installs Debian's chromium-driver)");
    let driver = Driver(child, port);
    wait_until("chromedriver listens", WAIT, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    driver
}

/// Waits until the element's text has every one of `parts`, finding it again each time:
/// the page redraws its tables, and an element found before a redraw is stale after it.
async fn text_shows(client: &fantoccini::Client, locator: Locator<'_>, parts: &[&str]) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let text = match client.find(locator).await {
            Ok(element) => element.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if parts.iter().all(|p| text.contains(p)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{parts:?} never all shown in {locator:?}: {text:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn write(outbox: &Outbox, event_type: &str) -> Uuid {
    let mut tx = outbox.begin().await.expect("begin");
    let id = tx
        .emit_message(OutboxMessage::new(event_type, "orders", "{\"n\":1}").with_key("order-42"))
        .expect("emit");
    tx.commit().await.expect("commit");
    id
}

#[tokio::test]
async fn a_dead_letter_released_in_the_browser_is_published_before_the_message_it_parked() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let admin = Admin::new(outbox.clone());
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.event_type == "Poison",
        None,
        PublishError::permanent("the broker refused it: message too large"),
    );
    let poison = write(&outbox, "Poison").await;
    let later = write(&outbox, "Later").await;
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    wait_until("the poison message is a dead letter", WAIT, || async {
        admin.status().await.expect("status").dead == 1
    })
    .await;
    publisher.clear_failures();
    assert!(
        publisher.published().is_empty(),
        "the later message is parked"
    );

    // A consumer whose handler fails on one message (as `Consumer` records it).
    let failing = Uuid::now_v7();
    sqlx::query(trusted_sql(format!(
        "INSERT INTO {}.outbox_processed_failing \
           (consumer, message_id, event_type, partition_key, origin, attempts, last_error) \
         VALUES ('billing', '{failing}', 'OrderPlaced', 'order-7', 'orders/0@42', 4, \
                 'no invoice template for EUR')",
        db.schema
    )))
    .execute(&db.pool)
    .await
    .expect("a failing consumer");

    let served = dashboard(&db, &database_url(), Some(TOKEN));
    let driver = chromedriver().await;
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".to_owned(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1100"],
        }),
    );
    let http = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = ClientBuilder::new(http)
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{}", driver.1))
        .await
        .expect("a browser session");
    client
        .goto(&format!("http://{}/", served.address))
        .await
        .expect("open the dashboard");

    // The dead letter's row, with what it parks and its error; the error groups.
    let row = format!("tr[data-id='{poison}']");
    text_shows(
        &client,
        Locator::Css(&row),
        &["1 message(s)", "message too large"],
    )
    .await;
    text_shows(
        &client,
        Locator::Id("errors"),
        &["the broker refused it: message too large"],
    )
    .await;
    // The consumer side (#36): the failing handler's message, and the card counting it.
    text_shows(
        &client,
        Locator::Id("consumers"),
        &[
            "billing",
            &failing.to_string(),
            "order-7",
            "no invoice template for EUR",
        ],
    )
    .await;
    text_shows(&client, Locator::Id("failing-count"), &["1"]).await;
    // The throughput chart has a time axis (#36: it had one label and no axis), and
    // "Next page" is off while everything is on one page.
    text_shows(
        &client,
        Locator::Id("chart"),
        &["-15 min", "-5 min", "now", "/s"],
    )
    .await;
    let next = client
        .find(Locator::Id("dead-next"))
        .await
        .expect("the next-page button");
    assert!(
        !next.is_enabled().await.expect("whether it is enabled"),
        "one dead letter, one page: nothing next"
    );

    if let Ok(path) = std::env::var("OUTBOX_DASHBOARD_SCREENSHOT") {
        // A few throughput samples first (one every 5 s), with messages flowing.
        for i in 0..60 {
            let mut tx = outbox.begin().await.expect("begin");
            for j in 0..(20 + (i % 12) * 12) {
                tx.emit_message(
                    OutboxMessage::new("OrderPlaced", "orders", "{}").with_key(format!("o{i}-{j}")),
                )
                .expect("emit");
            }
            tx.commit().await.expect("commit");
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        client.refresh().await.expect("reload");
        client
            .wait()
            .at_most(WAIT)
            .for_element(Locator::Css(&format!("tr[data-id='{poison}']")))
            .await
            .expect("the row again");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let png = client.screenshot().await.expect("screenshot");
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path);
        std::fs::write(&path, png).expect("save the screenshot");
    }

    // The buttons stay disabled until a token is entered; then release.
    let release = Locator::Css(&format!(
        "button[data-action='release'][data-id='{poison}']"
    ));
    client
        .find(Locator::Id("token"))
        .await
        .expect("token field")
        .send_keys(TOKEN)
        .await
        .expect("type the token");
    client
        .find(Locator::Id("use-token"))
        .await
        .expect("use-token")
        .click()
        .await
        .expect("use it");
    // The page redraws its tables every 5 s: an element found just before a redraw is
    // gone (stale) by the click, so find it again until the click lands.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let clicked = async {
            let button = client.find(release).await?;
            if !button.is_enabled().await? {
                return Ok::<bool, fantoccini::error::CmdError>(false);
            }
            button.click().await?;
            Ok(true)
        }
        .await;
        if matches!(clicked, Ok(true)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the release button never took a click: {clicked:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    wait_until(
        "the relay publishes the released message and the one it parked",
        WAIT,
        || async { publisher.published().iter().any(|r| r.id == later) },
    )
    .await;
    // (The screenshot run publishes other keys' messages too.)
    let order: Vec<Uuid> = publisher
        .published()
        .iter()
        .map(|r| r.id)
        .filter(|id| [poison, later].contains(id))
        .collect();
    assert_eq!(
        order,
        [poison, later],
        "the released message first, then its key"
    );
    text_shows(&client, Locator::Id("notice"), &["release: 1 message(s)"]).await;

    client.close().await.expect("close the browser");
    drop(driver);
    drop(served);
    relay.shutdown().await;
    db.cleanup().await;
}
