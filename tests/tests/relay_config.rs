//! What the relay says about its configuration when it is built. One test in this
//! binary: it captures every log line.

use std::time::Duration;

use outbox_core::publisher::{InMemoryPublisher, OutboxRecord, PublishError, Publisher};
use outbox_core::relay::Relay;
use outbox_tests::TestDb;
use outbox_tests::logs::Captured;

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
    let logs = Captured::install(tracing::Level::INFO);
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
