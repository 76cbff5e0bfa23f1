//! What a Prometheus scrape of a service running the outbox shows, through
//! `metrics-exporter-prometheus` (an exporter we did not write): every outbox metric with
//! its `# HELP` and `# TYPE` (#37: there was no description, so no `# HELP`). A test
//! binary of its own: it installs the process's recorder.

use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;
use outbox_core::Relay;
use outbox_core::publisher::InMemoryPublisher;
use outbox_core::telemetry::{Kind, METRICS};
use outbox_tests::consumers::emit_jobs;
use outbox_tests::{TestDb, wait_until_or};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outbox_metric_a_scrape_shows_has_its_help_and_type() {
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder");
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let database: String = outbox_core::sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&db.pool)
        .await
        .expect("the database's name");
    let labels = format!("outbox=\"outbox\",database=\"{database}\",destination=\"scraped\"");
    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_millis(100))
        .spawn();
    emit_jobs(&outbox, "scraped", 3).await;
    // Published, and the gauges refreshed by a poll.
    wait_until_or(
        "the relay's metrics in the scrape",
        Duration::from_secs(30),
        || {
            let text = prometheus.render();
            let published = format!("\noutbox_published_total{{{labels}}} 3");
            async move {
                text.contains(&published) && text.contains("\noutbox_oldest_pending_age_seconds{")
            }
        },
        || prometheus.render(),
    )
    .await;
    relay.shutdown().await;

    let text = prometheus.render();
    // The counters exist from the relay's start, at 0 (an `increase()` over a series that
    // first appears at 1 misses that first event).
    // Labelled by outbox, database and destination (#37).
    for zero in ["outbox_dead_lettered_total", "outbox_failed_total"] {
        let series = format!("\n{zero}{{{labels}}} 0\n");
        assert!(text.contains(&series), "{series}:\n{text}");
    }
    let shown: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("outbox_"))
        .filter_map(|l| l.split([' ', '{']).next())
        .collect();
    assert!(shown.len() >= 5, "outbox metrics in the scrape:\n{text}");
    for name in shown {
        // A histogram shows as a summary: `_sum` and `_count` series of the described name.
        let base = name
            .strip_suffix("_sum")
            .or_else(|| name.strip_suffix("_count"))
            .unwrap_or(name);
        let metric = METRICS
            .iter()
            .find(|m| m.name == base)
            .unwrap_or_else(|| panic!("{base} is not in outbox_core::telemetry::METRICS"));
        assert!(
            text.contains(&format!("# HELP {base} {}", metric.help)),
            "{base}: no `# HELP` with its description in the scrape:\n{text}"
        );
        let kind = match metric.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            _ => "summary",
        };
        assert!(
            text.contains(&format!("# TYPE {base} {kind}")),
            "{base}: no `# TYPE {base} {kind}`:\n{text}"
        );
    }
    db.cleanup().await;
}
