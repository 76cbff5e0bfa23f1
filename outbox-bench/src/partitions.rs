//! Scenario `partitions`: retention under sustained load, the plain table (batched
//! deletes) against the time-partitioned one (old partitions dropped whole).
//!
//! Each layout starts with `--history` sent rows (10,000,000 by default), spread over
//! the last 10 hours with UUIDv7 ids of their time, and one-hour partitions. Then, for
//! `--partitions-seconds` (120), writers commit 2,000 events/s (10 per transaction), the
//! relay drains them (an in-process counting publisher) and retention runs every 5 s
//! with a cutoff of 2 hours: 8 of the 10 hours are due at once. Every 5 s the bench reads
//! from the server the relay's claim statement (`pg_stat_statements`: mean execution
//! time over the window) and the outbox's size (every partition and index). Figures:
//! the claim's worst window against its first, and the size at the end against the size
//! after the first retention run, per layout; the targets apply to the partitioned one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use outbox_core::postgres::PartitionInterval;
use outbox_core::relay::Relay;
use outbox_core::retention::Retention;
use outbox_core::{OutboxMessage, sqlx};
use tokio::time::Instant;

use crate::BoxError;
use crate::publisher::CountingPublisher;
use crate::report::{Report, Target};
use crate::scenarios::ServerStatements;
use crate::setup::{Args, BenchDb};
use crate::trusted_sql;

const RATE: u64 = 2_000;
const PER_TX: u64 = 10;
const WRITERS: u64 = 4;
const WINDOW: Duration = Duration::from_secs(5);
const HOUR: Duration = Duration::from_secs(3600);

/// One layout's run.
struct Run {
    /// Mean claim time per window (ms), in order.
    claims: Vec<f64>,
    /// The outbox's size per window (MiB), in order.
    sizes: Vec<f64>,
    /// The size after the first retention run (MiB).
    size_after_first: f64,
    /// The size before anything ran (MiB).
    size_before: f64,
    /// History rows still in the table at the end.
    history_left: i64,
    /// History rows due for retention at the start.
    history_due: i64,
    /// The writers' rate achieved (events/s).
    achieved: f64,
    /// Seconds the conversion of the history took (partitioned only).
    converted: Option<f64>,
}

pub async fn partitions(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let seconds = args.partitions_seconds;
    let history = args.history;
    let mut plain_end = 0.0;
    for partitioned in [false, true] {
        let layout = if partitioned {
            "partitioned by hour"
        } else {
            "plain table"
        };
        eprintln!("  {layout}: {history} history rows");
        let run = run(args, partitioned, history, seconds).await?;
        let first = run.claims.first().copied().unwrap_or(0.0);
        let worst = run.claims.iter().copied().fold(0.0, f64::max);
        let name = |what: &str| format!("{layout}: {what}");
        report.add(
            "partitions",
            &name("history rows due at the start"),
            run.history_due as f64,
            "rows",
        );
        report.add(
            "partitions",
            &name("history rows left at the end"),
            run.history_left as f64,
            "rows",
        );
        report.add(
            "partitions",
            &name("write rate achieved"),
            run.achieved,
            "events/s",
        );
        if let Some(seconds) = run.converted {
            report.add(
                "partitions",
                &name("conversion of the table with its history"),
                seconds,
                "s",
            );
        }
        report.add(
            "partitions",
            &name("claim, first 5 s window, mean"),
            first,
            "ms",
        );
        report.add(
            "partitions",
            &name("claim, worst 5 s window, mean"),
            worst,
            "ms",
        );
        report.add(
            "partitions",
            &name("outbox size before"),
            run.size_before,
            "MiB",
        );
        report.add(
            "partitions",
            &name("outbox size after the first retention run"),
            run.size_after_first,
            "MiB",
        );
        report.add(
            "partitions",
            &name("outbox size at the end"),
            run.sizes.last().copied().unwrap_or(0.0),
            "MiB",
        );
        eprintln!(
            "  {layout}: claims per window {:?} ms",
            rounded(&run.claims)
        );
        eprintln!("  {layout}: sizes per window {:?} MiB", rounded(&run.sizes));
        let end = run.sizes.last().copied().unwrap_or(0.0);
        if !partitioned {
            plain_end = end;
        }
        if partitioned {
            report.target(
                "partitions",
                "outbox size at the end, partitioned / plain",
                if plain_end > 0.0 {
                    end / plain_end
                } else {
                    0.0
                },
                Target::AtMost(0.5),
            );
            let ratio = if first > 0.0 { worst / first } else { 0.0 };
            report.target(
                "partitions",
                &name("claim, worst window / first window"),
                ratio,
                Target::AtMost(2.0),
            );
            report.target(
                "partitions",
                &name("size at the end / after the first retention run"),
                if run.size_after_first > 0.0 {
                    end / run.size_after_first
                } else {
                    0.0
                },
                Target::AtMost(1.25),
            );
        }
    }
    Ok(())
}

fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|x| (x * 100.0).round() / 100.0).collect()
}

async fn size_mib(db: &BenchDb) -> Result<f64, BoxError> {
    let bytes: i64 = sqlx::query_scalar(
        "SELECT coalesce((SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('outbox') WHERE isleaf), \
                pg_total_relation_size('outbox'))::int8",
    )
    .fetch_one(db.outbox.pool())
    .await?;
    Ok(bytes as f64 / (1024.0 * 1024.0))
}

async fn run(args: &Args, partitioned: bool, history: u64, seconds: u64) -> Result<Run, BoxError> {
    let db = BenchDb::new(args).await?;
    // History: sent rows over the last 10 hours, ids of their time (UUIDv7).
    let h = "lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0')";
    let r = "md5(g::text)";
    sqlx::query(trusted_sql(format!(
        "INSERT INTO outbox (id, event_type, destination, partition_key, body, created_at, sent_at) \
         SELECT (substr({h}, 1, 8) || '-' || substr({h}, 9, 4) || '-7' || substr({r}, 1, 3) || '-8' \
                 || substr({r}, 4, 3) || '-' || substr({r}, 7, 12))::uuid, \
                'History', 'bench.history', 'k' || (g % 1000), convert_to(json_build_object('n', g)::text, 'UTF8'), t, t \
         FROM (SELECT g, now() - interval '10 hours' + (g * interval '10 hours') / $1 AS t \
               FROM generate_series(0, $1 - 1) g) x"
    )))
    .bind(i64::try_from(history)?)
    .execute(db.outbox.pool())
    .await?;
    // The migration path: an outbox with its history converts (partitions from the
    // oldest row on).
    let mut converted = None;
    if partitioned {
        let started = std::time::Instant::now();
        db.outbox
            .partition_by_time(PartitionInterval::Hourly)
            .await?;
        converted = Some(started.elapsed().as_secs_f64());
    }
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(db.outbox.pool())
        .await?;
    let due_before: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now() - interval '2 hours'")
            .fetch_one(db.outbox.pool())
            .await?;
    let history_due: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at < $1")
        .bind(due_before)
        .fetch_one(db.outbox.pool())
        .await?;
    let size_before = size_mib(&db).await?;
    let stats = ServerStatements::new(&db).await?;
    stats.reset().await?;

    let relay = Relay::builder(db.outbox.clone(), CountingPublisher::default())
        .batch_size(500)
        .spawn();
    let retention = Retention::builder(db.outbox.clone())
        .sent_older_than(2 * HOUR)
        .keep_processed()
        .interval(WINDOW)
        .spawn();
    let done = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (outbox, done, written) = (db.outbox.clone(), done.clone(), written.clone());
        writers.push(tokio::spawn(async move {
            let mut i = w;
            while !done.load(Ordering::Relaxed) {
                let due = Duration::from_secs_f64((i * PER_TX) as f64 / RATE as f64);
                tokio::time::sleep_until(started + due).await;
                let mut tx = outbox.begin().await?;
                for e in 0..PER_TX {
                    tx.emit_message(
                        OutboxMessage::new("Load", "bench.load", r#"{"n":1}"#)
                            .with_key(format!("k{}", (i * PER_TX + e) % 1000)),
                    )?;
                }
                tx.commit().await?;
                written.fetch_add(PER_TX, Ordering::Relaxed);
                i += WRITERS;
            }
            Ok::<_, BoxError>(())
        }));
    }
    let mut claims = Vec::new();
    let mut sizes = Vec::new();
    let mut size_after_first = None;
    let mut last = stats.calls(Some("ORDER BY o.seq LIMIT")).await?;
    while started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(WINDOW).await;
        let now = stats.calls(Some("ORDER BY o.seq LIMIT")).await?;
        let calls = now.calls - last.calls;
        if calls > 0.0 {
            claims.push((now.total_ms - last.total_ms) / calls);
        }
        last = now;
        sizes.push(size_mib(&db).await?);
        if size_after_first.is_none() && retention.last_report().is_some() {
            size_after_first = sizes.last().copied();
        }
    }
    done.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    let achieved = written.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    retention.shutdown().await;
    relay.shutdown().await;
    let history_left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE event_type = 'History' AND sent_at < $1",
    )
    .bind(due_before)
    .fetch_one(db.outbox.pool())
    .await?;
    db.drop().await?;
    Ok(Run {
        claims,
        size_after_first: size_after_first.unwrap_or(size_before),
        sizes,
        size_before,
        history_left,
        history_due,
        achieved,
        converted,
    })
}
