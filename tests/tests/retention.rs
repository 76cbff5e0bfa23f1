//! Retention against real PostgreSQL, with a relay publishing at the same time.
//!
//! Run with `--nocapture` to see the measured numbers (retention rate, relay stall).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::retention::Retention;
use outbox_core::{OutboxMessage, sqlx};
use outbox_tests::TestDb;
use outbox_tests::trusted_sql;
use uuid::Uuid;

const DAY: Duration = Duration::from_secs(24 * 3600);
const OLD_SENT: i64 = 200_000;
const OLD_PROCESSED: i64 = 20_000;

/// Publish times of the messages a writer commits during the test.
#[derive(Default)]
struct Timeline {
    committed: HashMap<Uuid, Instant>,
    published: Vec<(Uuid, Instant)>,
}

/// The longest gap between two consecutive commits of the writer in `[from, to)`: when
/// the database slows the writer down, publishes are spaced out for that reason alone.
fn writer_gap(t: &Timeline, from: Instant, to: Instant) -> Duration {
    let mut commits: Vec<Instant> = t
        .committed
        .values()
        .copied()
        .filter(|c| *c >= from && *c < to)
        .collect();
    commits.sort();
    commits
        .windows(2)
        .map(|w| w[1].saturating_duration_since(w[0]))
        .max()
        .unwrap_or_default()
}

/// The longest wait for one message (commit → publish: the relay's stall) and the longest
/// gap between two consecutive publishes, among messages committed in `[from, to)`.
fn stalls(t: &Timeline, from: Instant, to: Instant) -> (Duration, Duration, usize) {
    let mut latency = Duration::ZERO;
    let mut gap = Duration::ZERO;
    let mut previous: Option<Instant> = None;
    let mut n = 0;
    for (id, at) in &t.published {
        let Some(committed) = t.committed.get(id) else {
            continue;
        };
        if *committed < from || *committed >= to {
            continue;
        }
        n += 1;
        latency = latency.max(at.saturating_duration_since(*committed));
        if let Some(p) = previous {
            gap = gap.max(at.saturating_duration_since(p));
        }
        previous = Some(*at);
    }
    (latency, gap, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_deletes_exactly_the_old_rows_in_batches_while_the_relay_keeps_publishing() {
    let db = TestDb::with_max_connections(16).await;
    let outbox = db.outbox().await;

    // History: 200,000 messages sent ten days ago, in one statement.
    let started = Instant::now();
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, partition_key, payload, created_at, sent_at) \
         SELECT gen_random_uuid(), 'Old', 'history', 'k' || (n % 100), jsonb_build_object('n', n), \
                now() - interval '10 days', now() - interval '10 days' + n * interval '1 ms' \
         FROM generate_series(1, $1) AS n",
    )
    .bind(OLD_SENT)
    .execute(&db.pool)
    .await
    .expect("insert the history");
    // Kept: messages sent two days ago, old dead letters, recent processed ids.
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload, created_at, sent_at) \
         SELECT gen_random_uuid(), 'Recent', 'history', '{}', now() - interval '2 days', now() - interval '2 days' \
         FROM generate_series(1, 1000)",
    )
    .execute(&db.pool)
    .await
    .expect("insert recent sent rows");
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload, created_at, attempts, last_error, dead_at) \
         SELECT gen_random_uuid(), 'Poison', 'history', '{}', now() - interval '60 days', 10, 'rejected', \
                now() - interval '60 days' \
         FROM generate_series(1, 10)",
    )
    .execute(&db.pool)
    .await
    .expect("insert dead letters");
    sqlx::query(
        "INSERT INTO outbox_processed (consumer, message_id, processed_at) \
         SELECT 'billing', gen_random_uuid(), \
                now() - CASE WHEN n <= $1 THEN interval '40 days' ELSE interval '1 day' END \
         FROM generate_series(1, $1 + 1000) AS n",
    )
    .bind(OLD_PROCESSED)
    .execute(&db.pool)
    .await
    .expect("insert processed ids");
    for table in ["outbox", "outbox_processed"] {
        sqlx::query(trusted_sql(format!("ANALYZE {table}")))
            .execute(&db.pool)
            .await
            .expect("analyze");
    }
    println!(
        "set-up: {OLD_SENT} old sent rows and the rest in {:?}",
        started.elapsed()
    );

    // A relay, and a writer committing one event every 10 ms.
    let publisher = InMemoryPublisher::new();
    let mut published = publisher.subscribe();
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .batch_size(100)
        .spawn();
    let timeline = Arc::new(Mutex::new(Timeline::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let recorder = {
        let timeline = Arc::clone(&timeline);
        tokio::spawn(async move {
            while let Some(record) = published.recv().await {
                let now = Instant::now();
                timeline
                    .lock()
                    .expect("timeline")
                    .published
                    .push((record.id, now));
            }
        })
    };
    let writer = {
        let (outbox, timeline, stop) = (outbox.clone(), Arc::clone(&timeline), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut n = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let mut tx = outbox.begin().await.expect("begin");
                let id = tx
                    .emit_message(
                        OutboxMessage::new("New", "live", format!(r#"{{"n":{n}}}"#))
                            .with_key(format!("k{}", n % 100)),
                    )
                    .expect("emit");
                tx.commit().await.expect("commit");
                timeline
                    .lock()
                    .expect("timeline")
                    .committed
                    .insert(id, Instant::now());
                n += 1;
            }
            n
        })
    };

    // A second of steady state first, to compare with.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let baseline_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let retention_from = Instant::now();
    let report = Retention::builder(outbox.clone())
        .sent_older_than(7 * DAY)
        .processed_older_than(30 * DAY)
        .batch_size(5000)
        .build()
        .run_once()
        .await
        .expect("retention");
    let retention_to = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let written = writer.await.expect("writer");
    assert!(
        publisher
            .wait_for(written as usize, Duration::from_secs(30))
            .await,
        "every new event is published: {} of {written}",
        publisher.published_count()
    );
    relay.shutdown().await;
    drop(publisher);
    recorder.abort();

    // Exactly the old rows are gone, in bounded batches.
    assert_eq!(report.sent_deleted, OLD_SENT as u64, "{report:?}");
    assert_eq!(report.processed_deleted, OLD_PROCESSED as u64, "{report:?}");
    // 40 full batches of sent rows and one that finds nothing; 4 + 1 of processed ids.
    assert_eq!(report.batches, 41 + 5, "{report:?}");
    assert!(!report.interrupted);
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(trusted_sql(sql))
                .fetch_one(&pool)
                .await
                .expect(sql)
        }
    };
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE event_type = 'Old'").await,
        0
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE event_type = 'Recent'").await,
        1000
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE event_type = 'Poison' AND dead_at IS NOT NULL")
            .await,
        10,
        "dead letters are kept"
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE event_type = 'New' AND sent_at IS NOT NULL").await,
        written as i64,
        "the new events are all sent and none was deleted"
    );
    assert_eq!(count("SELECT count(*) FROM outbox_processed").await, 1000);

    // The relay did not stall.
    let t = std::mem::take(&mut *timeline.lock().expect("timeline"));
    let (base_latency, base_gap, base_n) = stalls(&t, baseline_from, retention_from);
    let (latency, gap, n) = stalls(&t, retention_from, retention_to);
    let elapsed = report.elapsed.as_secs_f64();
    println!(
        "retention: {report}; {:.0} sent rows/s",
        report.sent_deleted as f64 / elapsed
    );
    println!(
        "relay during retention: {n} messages, longest commit-to-publish {latency:?}, longest gap between \
         publishes {gap:?} (writer's longest gap between commits {:?})",
        writer_gap(&t, retention_from, retention_to)
    );
    println!(
        "relay before retention: {base_n} messages, longest commit-to-publish {base_latency:?}, longest gap \
         between publishes {base_gap:?} (writer's longest gap between commits {:?})",
        writer_gap(&t, baseline_from, retention_from)
    );
    // How long the relay waited is printed above, not asserted: a busy machine can make
    // any wall-clock bound fail. What is asserted is that it went on publishing while
    // retention deleted (no lock of retention's held it back for the whole run).
    assert!(n >= 10, "the writer kept writing during retention: {n}");
    let published_during = t
        .published
        .iter()
        .filter(|(_, at)| *at >= retention_from && *at < retention_to)
        .count();
    assert!(
        published_during > 0,
        "the relay published nothing while retention ran"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn a_spawned_retention_task_runs_at_once_and_stops_on_shutdown() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload, created_at, sent_at) \
         SELECT gen_random_uuid(), 'Old', 'd', '{}', now() - interval '2 hours', now() - interval '2 hours' \
         FROM generate_series(1, 30)",
    )
    .execute(&db.pool)
    .await
    .expect("old rows");
    let handle = Retention::builder(outbox.clone())
        .sent_older_than(Duration::from_secs(3600))
        .keep_processed()
        .batch_size(7)
        .interval(Duration::from_secs(3600))
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(30);
    while handle.last_report().is_none() {
        assert!(Instant::now() < deadline, "the first run never finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = handle.last_report().expect("a report");
    assert_eq!(report.sent_deleted, 30);
    assert_eq!(report.batches, 5, "batches of at most 7: {report:?}");
    assert_eq!(report.processed_cutoff, None, "processed ids kept");
    assert_eq!(db.count("outbox").await, 0);
    // Sleeping until the next run, an hour away: shutdown ends it without waiting for it
    // (a minute is far below the hour, and far above any machine's delay).
    tokio::time::timeout(Duration::from_secs(60), handle.shutdown())
        .await
        .expect("shutdown does not wait for the next run");
    db.cleanup().await;
}
