//! Scenario `notify`: what waking the relay costs the writers. Emitting commits against
//! the same commits writing a plain row of the outbox's shape, with and without
//! `pg_notify`, with 1, 8 and 32 concurrent writers, measured in the same run.
//!
//! A transaction that ran `NOTIFY` takes an instance-wide lock from its pre-commit until
//! it ends (its WAL flush included), so notifying commits queue one behind another. The
//! outbox's commits must not (`docs/benchmarks.md`).

use std::time::{Duration, Instant};

use outbox_core::relay::Relay;
use outbox_core::{OutboxMessage, sqlx};

use crate::BoxError;
use crate::publisher::CountingPublisher;
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb, quantile};
use crate::trusted_sql;

/// What one commit writes besides its UPDATE.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    /// A row of the outbox's shape in a table of the same definition, no notification:
    /// the floor.
    Plain,
    /// The same row, and `pg_notify` before the commit: what every emitting commit did
    /// before the relay's idle flag.
    PlainNotify,
    /// One event through `begin`/`emit_message`/`commit`, a relay running.
    Outbox,
    /// The same, no relay running: the write path alone.
    OutboxAlone,
}

const VARIANTS: [Variant; 4] = [
    Variant::Plain,
    Variant::PlainNotify,
    Variant::OutboxAlone,
    Variant::Outbox,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain row",
            Variant::PlainNotify => "plain row + pg_notify",
            Variant::Outbox => "outbox event (relay running)",
            Variant::OutboxAlone => "outbox event (no relay)",
        }
    }
}

const WRITERS: [usize; 3] = [1, 8, 32];

pub async fn notify(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let db = BenchDb::with_pool_size(args, 40).await?;
    let pool = db.outbox.pool().clone();
    for sql in [
        "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL, n bigint NOT NULL DEFAULT 0)",
        "INSERT INTO orders SELECT g, 'new' FROM generate_series(0, 99999) g",
        // The outbox's columns, defaults, identity and indexes (its unique id and pending
        // index included): the same physical work per row.
        "CREATE TABLE plain_row (LIKE outbox INCLUDING ALL)",
        "VACUUM ANALYZE orders",
    ] {
        sqlx::query(trusted_sql(sql)).execute(&pool).await?;
    }
    let seconds = if args.smoke { 0.5 } else { args.notify_seconds };
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let mut at_32 = [0.0_f64; VARIANTS.len()];
    for writers in WRITERS {
        // Interleaved rounds, so that machine noise hits every variant alike.
        let mut results: Vec<(Vec<f64>, f64)> = vec![(Vec::new(), 0.0); VARIANTS.len()];
        for _round in 0..2 {
            for (v, variant) in VARIANTS.into_iter().enumerate() {
                // The relay drains what was written so far, then waits idle.
                let relay = (variant == Variant::Outbox).then(|| {
                    Relay::builder(db.outbox.clone(), CountingPublisher::default()).spawn()
                });
                let (mut times, elapsed) =
                    run(&db, variant, writers, seconds / 2.0, &payload).await?;
                if let Some(relay) = relay {
                    relay.shutdown().await;
                }
                results[v].0.append(&mut times);
                results[v].1 += elapsed;
            }
        }
        for (v, variant) in VARIANTS.into_iter().enumerate() {
            let (times, elapsed) = &mut results[v];
            times.sort_by(f64::total_cmp);
            let rate = times.len() as f64 / *elapsed;
            let name = |what: &str| format!("{}, {writers} writer(s), {what}", variant.name());
            report.add("notify", &name("commits/s"), rate, "tx/s");
            report.add("notify", &name("p50"), quantile(times, 0.5), "ms");
            report.add("notify", &name("p99"), quantile(times, 0.99), "ms");
            if writers == 32 {
                at_32[v] = rate;
            }
        }
    }
    report.add(
        "notify",
        "32 writers: plain row + pg_notify / plain row",
        at_32[1] / at_32[0],
        "ratio",
    );
    report.target(
        "notify",
        "32 writers: outbox event, no relay / plain row (commits/s)",
        at_32[2] / at_32[0],
        Target::AtLeast(0.9),
    );
    report.add(
        "notify",
        "32 writers: outbox event, relay running / plain row (commits/s)",
        at_32[3] / at_32[0],
        "ratio",
    );
    db.drop().await?;
    Ok(())
}

/// `writers` tasks committing `variant` for `seconds`; every commit's time in ms and the
/// wall time taken.
async fn run(
    db: &BenchDb,
    variant: Variant,
    writers: usize,
    seconds: f64,
    payload: &str,
) -> Result<(Vec<f64>, f64), BoxError> {
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let outbox = db.outbox.clone();
        let payload = payload.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut times = Vec::new();
            let mut i = w as i64;
            while Instant::now() < until {
                let t = Instant::now();
                commit(&outbox, variant, i, &payload).await?;
                times.push(t.elapsed().as_secs_f64() * 1000.0);
                i += 32;
            }
            Ok::<_, BoxError>(times)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok((all, started.elapsed().as_secs_f64()))
}

async fn commit(
    outbox: &outbox_core::Outbox,
    variant: Variant,
    i: i64,
    payload: &str,
) -> Result<(), BoxError> {
    let order = i % 100_000;
    let update = "UPDATE orders SET n = n + 1, status = 'confirmed' WHERE id = $1";
    match variant {
        Variant::Outbox | Variant::OutboxAlone => {
            let mut tx = outbox.begin().await?;
            sqlx::query(trusted_sql(update))
                .bind(order)
                .execute(&mut *tx)
                .await?;
            tx.emit_message(
                OutboxMessage::new("OrderConfirmed", "orders", payload.to_owned())
                    .with_key(format!("k{}", i % 1000)),
            )?;
            tx.commit().await?;
        }
        Variant::Plain | Variant::PlainNotify => {
            let message = OutboxMessage::new("OrderConfirmed", "orders", payload.to_owned())
                .with_key(format!("k{}", i % 1000));
            let insert = "INSERT INTO plain_row \
                 (id, event_type, event_version, destination, partition_key, body, content_type, headers) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb)";
            let sql = if variant == Variant::PlainNotify {
                format!("WITH ins AS ({insert}) SELECT pg_notify('outbox_bench_plain', '')")
            } else {
                insert.to_owned()
            };
            let mut tx = outbox.pool().begin().await?;
            sqlx::query(trusted_sql(update))
                .bind(order)
                .execute(&mut *tx)
                .await?;
            sqlx::query(trusted_sql(&sql))
                .bind(message.id)
                .bind(&message.event_type)
                .bind(message.event_version)
                .bind(&message.destination)
                .bind(&message.partition_key)
                .bind(message.payload.as_bytes())
                .bind(&*message.content_type)
                .bind("{}")
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
    }
    Ok(())
}
