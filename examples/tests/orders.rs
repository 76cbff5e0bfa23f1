//! The orders example's whole flow against the real PostgreSQL and broker.

use outbox_examples::orders::{Config, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_flow_reserves_each_order_once() {
    // Shown if the test fails: what the relay and the consumer did (the group's
    // assignment among it).
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("info")
        .try_init();
    let config = Config {
        database_url: std::env::var("OUTBOX_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        brokers: std::env::var("OUTBOX_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".to_owned()),
        orders: 50,
    };
    let mut steps = Vec::new();
    let summary = run(&config, |s| steps.push(s.to_owned()))
        .await
        .unwrap_or_else(|e| {
            panic!("the orders flow failed: {e} (start the services with scripts/services.sh)")
        });
    let context = format!("{summary:?}, steps: {steps:#?}");
    assert_eq!(summary.confirmed, 50, "{context}");
    assert_eq!(summary.refused, 1, "{context}");
    assert_eq!(
        summary.published, 51,
        "50 confirmations + 1 replay: {context}"
    );
    assert_eq!(
        summary.reserved, 50,
        "each order reserved exactly once: {context}"
    );
    assert_eq!(
        summary.stock_left,
        1_000_000 - 100,
        "2 units per order, once: {context}"
    );
    // The replay for sure; a consumer-group rebalance may redeliver a few more
    // (at-least-once), and the inbox skips those too.
    assert!(summary.duplicates_skipped >= 1, "{context}");
}
