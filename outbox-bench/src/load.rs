//! Scenarios `enqueue` (bulk writes against a raw multi-row `INSERT`) and `sustained`
//! (a fixed write rate for minutes, relay and consumer running, stepped up until the
//! system no longer keeps up).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox_core::relay::Relay;
use outbox_core::{OutboxMessage, sqlx};

use crate::BoxError;
use crate::kafka;
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb, quantile};
use crate::trusted_sql;

/// Events per transaction in the `enqueue` scenario.
const BULK: usize = 100;
/// Concurrent writers in the `enqueue` scenario.
const BULK_WRITERS: usize = 4;

/// Scenario `enqueue`: transactions of 100 events of `--payload` bytes from 4 writers,
/// through `begin`/`emit_message`/`commit`, against the same rows written by a raw
/// multi-row `INSERT` with bound parameters into a table of the outbox's definition
/// (the payload into `body bytea`), and by the same `INSERT` of the payload into the
/// `jsonb` column the outbox wrote before payloads were bytes (#38): the cost of the
/// parse `bytea` skips. Interleaved, in the same run.
pub async fn enqueue(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let db = BenchDb::with_pool_size(args, 8).await?;
    sqlx::query("CREATE TABLE plain_row (LIKE outbox INCLUDING ALL)")
        .execute(db.outbox.pool())
        .await?;
    let seconds = if args.smoke { 0.5 } else { args.notify_seconds };
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let mut rates = [0.0_f64; 3];
    let mut totals = [(0_u64, 0.0_f64); 3];
    for _round in 0..2 {
        for (v, write) in [Write::Outbox, Write::Raw, Write::RawJsonb]
            .into_iter()
            .enumerate()
        {
            let (events, elapsed) = bulk_writers(&db, write, seconds / 2.0, &payload).await?;
            totals[v].0 += events;
            totals[v].1 += elapsed;
        }
    }
    for (v, name) in [
        "outbox: begin, 100 x emit, commit",
        "raw multi-row INSERT, bound parameters",
        "raw multi-row INSERT into jsonb (the write before #38)",
    ]
    .into_iter()
    .enumerate()
    {
        rates[v] = totals[v].0 as f64 / totals[v].1;
        report.add(
            "enqueue",
            &format!(
                "{name} ({BULK_WRITERS} writers, {BULK} x {} B)",
                args.payload
            ),
            rates[v],
            "events/s",
        );
    }
    report.target(
        "enqueue",
        "outbox / raw multi-row INSERT",
        rates[0] / rates[1],
        Target::AtLeast(0.9),
    );
    report.target(
        "enqueue",
        "raw INSERT, bytea / jsonb (#38: no parse)",
        rates[1] / rates[2],
        Target::AtLeast(1.0),
    );
    db.drop().await?;
    Ok(())
}

/// How a writer of the `enqueue` scenario writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// The outbox's write path.
    Outbox,
    /// A raw multi-row `INSERT`, the payload into `body bytea`.
    Raw,
    /// The same, the payload into `payload jsonb` (the write path before #38).
    RawJsonb,
}

/// The raw multi-row `INSERT` of [`BULK`] rows: the payload into `body`, or, with
/// `jsonb`, into the `jsonb` column of before.
fn raw_insert(jsonb: bool) -> String {
    let (column, cast) = if jsonb {
        ("payload", "::text::jsonb")
    } else {
        ("body", "")
    };
    let mut sql = format!(
        "INSERT INTO plain_row \
         (id, event_type, event_version, destination, partition_key, {column}, content_type, headers) \
         VALUES ",
    );
    for r in 0..BULK {
        let p = r * 8;
        if r > 0 {
            sql.push_str(", ");
        }
        sql.push_str(&format!(
            "(${}, ${}, ${}, ${}, ${}, ${}{cast}, ${}, ${}::jsonb)",
            p + 1,
            p + 2,
            p + 3,
            p + 4,
            p + 5,
            p + 6,
            p + 7,
            p + 8
        ));
    }
    sql
}

/// [`BULK_WRITERS`] tasks writing transactions of [`BULK`] events for `seconds`; events
/// written and the wall time taken.
async fn bulk_writers(
    db: &BenchDb,
    write: Write,
    seconds: f64,
    payload: &str,
) -> Result<(u64, f64), BoxError> {
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for w in 0..BULK_WRITERS {
        let outbox = db.outbox.clone();
        let payload = payload.to_owned();
        let sql = raw_insert(write == Write::RawJsonb);
        tasks.push(tokio::spawn(async move {
            let mut events = 0_u64;
            while Instant::now() < until {
                let messages: Vec<OutboxMessage> = (0..BULK)
                    .map(|e| {
                        OutboxMessage::new("OrderConfirmed", "orders", payload.clone())
                            .with_key(format!("k{w}-{e}"))
                    })
                    .collect();
                if write != Write::Outbox {
                    let mut tx = outbox.pool().begin().await?;
                    let mut query = sqlx::query(trusted_sql(&sql));
                    for m in &messages {
                        query = query
                            .bind(m.id)
                            .bind(m.event_type.clone())
                            .bind(m.event_version)
                            .bind(m.destination.clone())
                            .bind(m.partition_key.clone());
                        query = match write {
                            Write::RawJsonb => query.bind(m.payload.as_str().map(str::to_owned)),
                            _ => query.bind(m.payload.to_vec()),
                        };
                        query = query.bind(m.content_type.to_string()).bind("{}");
                    }
                    query.execute(&mut *tx).await?;
                    tx.commit().await?;
                } else {
                    let mut tx = outbox.begin().await?;
                    for m in messages {
                        tx.emit_message(m)?;
                    }
                    tx.commit().await?;
                }
                events += BULK as u64;
            }
            Ok::<_, BoxError>(events)
        }));
    }
    let mut events = 0;
    for t in tasks {
        events += t.await??;
    }
    Ok((events, started.elapsed().as_secs_f64()))
}

/// Writers in the `sustained` scenario.
const SUSTAINED_WRITERS: u64 = 8;
/// Backlog growth (events/s over the run) a passing rate may show.
const MAX_GROWTH: f64 = 100.0;
/// p99 commit -> broker acknowledgement a passing rate may show, in ms.
const MAX_P99_MS: f64 = 100.0;

/// Scenario `sustained`: writers commit at a fixed rate (`--sustained-batch` events per
/// transaction, 8 writers) for `--sustained-seconds` while the relay publishes to the
/// broker and a consumer reads. A rate passes when the writers keep it (98 %), the
/// backlog (committed, not acknowledged) grows by at most 100 events/s between the first
/// tenth of the run and its end, and p99 commit -> broker acknowledgement is at most
/// 100 ms. What the consumer read by the end is reported, not judged. Rates from
/// `--sustained-rates` are tried in order until one fails, in table mode, then in WAL
/// mode (a slot of its own), side by side.
pub async fn sustained(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let brokers = args.broker.clone().ok_or(
        "the sustained scenario needs a broker (--broker HOST:PORT): it measures up to the broker's acknowledgement",
    )?;
    for wal in [false, true] {
        let mode = if wal { "WAL mode" } else { "table mode" };
        let mut best = 0_u64;
        for &rate in &args.sustained_rates {
            let run = sustained_run(args, &brokers, rate, wal).await?;
            let name = |what: &str| format!("{mode}, {rate} events/s: {what}");
            report.add(
                "sustained",
                &name("write rate achieved"),
                run.achieved,
                "events/s",
            );
            report.add(
                "sustained",
                &name("backlog growth"),
                run.growth,
                "events/s (pass <= 100)",
            );
            report.add(
                "sustained",
                &name("commit -> broker acknowledged, p50"),
                run.p50_ms,
                "ms",
            );
            report.add(
                "sustained",
                &name("commit -> broker acknowledged, p99"),
                run.p99_ms,
                "ms (pass <= 100)",
            );
            crate::publisher::report_calls(report, ("sustained", &name("")), &run.calls);
            report.add(
                "sustained",
                &name("read by the consumer"),
                run.consumed as f64,
                &format!("of {} events", run.committed),
            );
            // The consumer is load on the broker, not part of the verdict: the bench's own
            // consumer may fall behind a broker that keeps everything in memory.
            let passed = run.achieved >= 0.98 * rate as f64
                && run.growth <= MAX_GROWTH
                && run.p99_ms <= MAX_P99_MS;
            eprintln!(
                "  {mode}, {rate} events/s: {}",
                if passed { "passed" } else { "failed" }
            );
            if !passed {
                break;
            }
            best = rate;
        }
        report.target_in(
            "sustained",
            &format!(
                "{mode}: highest rate sustained for {} s ({} events per transaction, {SUSTAINED_WRITERS} writers)",
                args.sustained_seconds, args.sustained_batch
            ),
            best as f64,
            "events/s",
            Target::AtLeast(10_000.0),
        );
    }
    Ok(())
}

/// The outbox a sustained run writes to: table mode or WAL mode.
enum Db {
    Table(BenchDb),
    Wal(crate::wal::WalDb),
}

impl Db {
    fn outbox(&self) -> &outbox_core::Outbox {
        match self {
            Db::Table(db) => &db.outbox,
            Db::Wal(db) => &db.outbox,
        }
    }
}

struct SustainedRun {
    achieved: f64,
    growth: f64,
    p50_ms: f64,
    p99_ms: f64,
    committed: usize,
    consumed: usize,
    calls: crate::publisher::PublishCalls,
}

async fn sustained_run(
    args: &Args,
    brokers: &str,
    rate: u64,
    wal: bool,
) -> Result<SustainedRun, BoxError> {
    let db = if wal {
        Db::Wal(crate::wal::WalDb::with_pool_size(args, 16).await?)
    } else {
        Db::Table(BenchDb::with_pool_size(args, 16).await?)
    };
    let outbox = db.outbox().clone();
    let topic = kafka::create_topic(brokers).await?;
    let mut arrivals = kafka::Arrivals::start(brokers, &topic).await?;
    let publisher = kafka::publisher(brokers, &topic).await?;
    let (ack_tx, mut acks) = kafka::Arrivals::channel();
    let publisher = crate::publisher::Acked::new(publisher, ack_tx);
    let calls = publisher.calls();
    let relay =
        crate::scenarios::in_flight(args, Relay::builder(outbox.clone(), publisher)).spawn();
    // Warm-up: one event through the whole path before the clock starts.
    let mut tx = outbox.begin().await?;
    tx.emit_message(OutboxMessage::new("Load", topic.as_str(), "{}"))?;
    tx.commit().await?;
    if !acks.wait_for(1, Duration::from_secs(60)).await {
        return Err("the warm-up event was not acknowledged within 60 s".into());
    }
    acks.seen.clear();
    if !arrivals.wait_for(1, Duration::from_secs(60)).await {
        return Err("the warm-up event did not reach the consumer within 60 s".into());
    }
    arrivals.seen.clear();
    calls.lock().map_err(|_| "publish calls poisoned")?.clear();

    let batch = args.sustained_batch.max(1);
    let seconds = args.sustained_seconds;
    let transactions = rate * seconds / batch;
    let committed_count = Arc::new(AtomicU64::new(0));
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let started = tokio::time::Instant::now();
    let mut writers = Vec::new();
    for w in 0..SUSTAINED_WRITERS {
        let (outbox, topic, payload, count) = (
            outbox.clone(),
            topic.clone(),
            payload.clone(),
            committed_count.clone(),
        );
        let keys = args.keys.max(1);
        writers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            let mut i = w;
            while i < transactions {
                let due = Duration::from_secs_f64((i * batch) as f64 / rate as f64);
                tokio::time::sleep_until(started + due).await;
                let mut tx = outbox.begin().await?;
                let mut ids = Vec::with_capacity(batch as usize);
                for e in 0..batch {
                    ids.push(
                        tx.emit_message(
                            OutboxMessage::new("Load", topic.as_str(), payload.clone())
                                .with_key(format!("k{}", (i * batch + e) % keys)),
                        )?,
                    );
                }
                tx.commit().await?;
                let at = Instant::now();
                committed.extend(ids.into_iter().map(|id| (id, at)));
                count.fetch_add(batch, Ordering::Relaxed);
                i += SUSTAINED_WRITERS;
            }
            Ok::<_, BoxError>(committed)
        }));
    }
    // Backlog = committed - acknowledged, sampled every second while the writers run.
    let mut samples: Vec<(f64, f64)> = Vec::new();
    while !writers.iter().all(|w| w.is_finished()) {
        acks.wait_for(usize::MAX, Duration::from_secs(1)).await;
        let committed = committed_count.load(Ordering::Relaxed) as f64;
        samples.push((
            started.elapsed().as_secs_f64(),
            committed - acks.seen.len() as f64,
        ));
    }
    let wrote_for = started.elapsed().as_secs_f64();
    let mut committed = Vec::new();
    for w in writers {
        committed.extend(w.await??);
    }
    let achieved = committed.len() as f64 / wrote_for;
    // From the first tenth of the run (the relay's start is not the system's pace) to
    // the last sample.
    let growth = match (
        samples.iter().find(|(t, _)| *t >= seconds as f64 / 10.0),
        samples.last(),
    ) {
        (Some(first), Some(last)) if last.0 > first.0 => (last.1 - first.1) / (last.0 - first.0),
        _ => f64::NAN,
    };
    if !acks
        .wait_for(committed.len(), Duration::from_secs(300))
        .await
    {
        return Err(format!(
            "{rate} events/s: only {} of {} events were acknowledged within 300 s of the end",
            acks.seen.len(),
            committed.len()
        )
        .into());
    }
    // What the consumer read by then (it is not waited for: it is load, not the verdict).
    arrivals
        .wait_for(committed.len(), Duration::from_secs(5))
        .await;
    relay.shutdown().await;
    let mut ms: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            acks.seen
                .get(id)
                .map(|a| a.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    match db {
        Db::Table(db) => db.drop().await?,
        Db::Wal(db) => db.drop(&[]).await?,
    }
    Ok(SustainedRun {
        achieved,
        growth,
        p50_ms: quantile(&ms, 0.5),
        p99_ms: quantile(&ms, 0.99),
        committed: committed.len(),
        consumed: committed
            .iter()
            .filter(|(id, _)| arrivals.seen.contains_key(id))
            .count(),
        calls,
    })
}
