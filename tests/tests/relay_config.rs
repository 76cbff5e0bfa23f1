//! What the relay says about its configuration and its database when it starts. This
//! binary captures every log line (one global subscriber, shared by its tests).

use std::sync::OnceLock;
use std::time::Duration;

use outbox_core::publisher::{InMemoryPublisher, OutboxRecord, PublishError, Publisher};
use outbox_core::relay::Relay;
use outbox_tests::logs::Captured;
use outbox_tests::trusted_sql;
use outbox_tests::{TestDb, wait_until};

fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| Captured::install(tracing::Level::INFO))
}

/// The in-memory publisher, saying a batch may take up to a minute by its timeouts.
#[derive(Debug, Clone)]
struct SlowBound(InMemoryPublisher);

impl Publisher for SlowBound {
    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        self.0.publish(batch).await
    }
    fn max_publish_time(&self) -> Option<Duration> {
        Some(Duration::from_secs(60))
    }
}

/// A relay whose `publish_timeout` is shorter than what the publisher's own timeouts
/// allow would give up on batches the broker may still store: building it logs an error
/// naming both; a long enough one logs nothing of the kind.
#[tokio::test]
async fn a_publish_timeout_shorter_than_the_publishers_bound_is_reported() {
    let logs = logs();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let publisher = SlowBound(InMemoryPublisher::new());
    let _fine = Relay::builder(outbox.clone(), publisher.clone())
        .publish_timeout(Duration::from_secs(90))
        .build();
    assert!(
        !logs.text().contains("publish_timeout is shorter"),
        "{}",
        logs.text()
    );
    let _short = Relay::builder(outbox.clone(), publisher)
        .publish_timeout(Duration::from_secs(30))
        .build();
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("publish_timeout is shorter"))
        .unwrap_or_else(|| panic!("an error about publish_timeout: {text}"));
    assert!(
        line.contains("ERROR") && line.contains("30s") && line.contains("60s"),
        "{line}"
    );
    db.cleanup().await;
}

/// The publish horizon assumes the `seq` identity hands out values in commit-lock order,
/// which holds only with `CACHE 1`: with a cache, a session can draw a smaller `seq` after
/// the relay sampled a larger one, and the relay would overtake it. A relay refuses such a
/// table, saying what to run, and starts once it is fixed. (On main it published.)
#[tokio::test]
async fn a_relay_refuses_an_outbox_sequence_with_a_cache() {
    let logs = logs();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let table = outbox.tables().outbox.quoted();
    let alter = |cache: u32| {
        format!(
            "DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s CACHE {cache}', \
             pg_get_serial_sequence('{}', 'seq')); END $$",
            table.replace('\'', "''")
        )
    };
    let mut conn = db.connect().await;
    outbox_core::sqlx::query(trusted_sql(alter(20)))
        .execute(&mut conn)
        .await
        .expect("set a cache");
    let mut tx = outbox.begin().await.expect("begin");
    tx.emit_message(outbox_core::OutboxMessage::new("T", "d", "{}"))
        .expect("emit");
    tx.commit().await.expect("commit");
    let published = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), published.clone())
        .reconnect_delay(Duration::from_millis(100))
        .spawn();
    wait_until(
        "the relay was refused twice",
        Duration::from_secs(20),
        || async { relay.stats().reconnects >= 2 },
    )
    .await;
    assert_eq!(published.published_count(), 0, "nothing is published");
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("CACHE 20"))
        .unwrap_or_else(|| panic!("an error naming the cache: {text}"));
    assert!(
        line.contains("ERROR") && line.contains("CACHE 1"),
        "says what to run: {line}"
    );
    outbox_core::sqlx::query(trusted_sql(alter(1)))
        .execute(&mut conn)
        .await
        .expect("back to CACHE 1");
    assert!(
        published.wait_for(1, Duration::from_secs(20)).await,
        "publishes once the sequence is fixed"
    );
    relay.shutdown().await;
    db.cleanup().await;
}
