//! `consume`: consumer throughput from NATS JetStream into a PostgreSQL inbox. The
//! consumer layer (`outbox_core::consumer::Consumer` on `NatsTransport`, 8 keys at a
//! time, one inbox transaction per message) against two ceilings measured in the same
//! run: (c) the transport alone, receiving and acknowledging with no database, and (i)
//! the database alone, the same inbox transactions from 8 tasks with no broker. Target:
//! (r) / min(c, i) >= 0.7.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use outbox_core::consumer::{Consumer, Transport};
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_nats::{NatsPublisher, NatsTransport};

use crate::BoxError;
use crate::nats::{fresh_stream, records, url};
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb};

const CONCURRENCY: usize = 8;

#[derive(serde::Deserialize)]
struct Event {
    #[allow(dead_code)]
    filler: String,
}

/// A consumer whose handler inserts one row, like a real one would.
fn consumer<T: Transport>(transport: T, db: &BenchDb, name: &str) -> Result<Consumer<T>, BoxError> {
    Ok(Consumer::builder(transport, Inbox::new(&db.outbox, name))
        .concurrency(CONCURRENCY)
        .on_event_type::<Event, _>("BenchEvent", |tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO bench_effects (id) VALUES ($1)")
                    .bind(msg.id)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .build()?)
}

pub async fn consume(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let js = jetstream::new(async_nats::connect(url()).await?);
    let (name, subject) = fresh_stream(&js).await?;
    let publisher = NatsPublisher::builder(url())
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await?;
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let all = records(args, &subject, &payload);
    for batch in all.chunks(1000) {
        if let Some(Err(e)) = publisher
            .publish(batch)
            .await
            .into_iter()
            .find(Result::is_err)
        {
            return Err(format!("filling the stream: {e}").into());
        }
    }
    let events = args.events;
    let db = BenchDb::with_pool_size(args, CONCURRENCY as u32 + 4).await?;
    sqlx::query("CREATE TABLE bench_effects (id uuid NOT NULL)")
        .execute(db.outbox.pool())
        .await?;
    let wait = Duration::from_secs(600);

    // (c) The transport alone: receive and acknowledge, no database.
    let transport = NatsTransport::builder(url(), &name, "ceiling")
        .build()
        .await?;
    let started = Instant::now();
    for _ in 0..events {
        let delivery = tokio::time::timeout(wait, transport.receive())
            .await
            .map_err(|_| "the transport ceiling stalled")??;
        transport.ack(&delivery).await?;
    }
    let transport_ceiling = events as f64 / started.elapsed().as_secs_f64();
    transport.close().await;

    // (i) The database alone: the same inbox transactions, from 8 tasks.
    let inbox = Inbox::new(&db.outbox, "ceiling");
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..CONCURRENCY {
        let (inbox, next, ids) = (
            inbox.clone(),
            Arc::clone(&next),
            Arc::new(all.iter().map(|r| r.id).collect::<Vec<_>>()),
        );
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(i as usize).copied() else {
                    return Ok::<_, BoxError>(());
                };
                let processed = inbox
                    .process(id, |tx| {
                        Box::pin(async move {
                            sqlx::query("INSERT INTO bench_effects (id) VALUES ($1)")
                                .bind(id)
                                .execute(&mut **tx)
                                .await
                                .map(drop)
                        })
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                if processed.is_duplicate() {
                    return Err(format!("{id} was processed twice").into());
                }
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let db_ceiling = events as f64 / started.elapsed().as_secs_f64();

    // (r) The consumer layer.
    let transport = NatsTransport::builder(url(), &name, "consumer")
        .build()
        .await?;
    let started = Instant::now();
    let running = consumer(transport, &db, "consumer")?.spawn();
    let deadline = Instant::now() + wait;
    while running.stats().handled < events {
        if running.is_finished() || Instant::now() > deadline {
            return Err(format!("the consumer stopped at {:?}", running.stats()).into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let consumer_rate = events as f64 / started.elapsed().as_secs_f64();
    running.shutdown().await?;
    js.delete_stream(&name).await?;
    db.drop().await?;

    report.add(
        "consume",
        "(c) NatsTransport alone: receive + ack, no database",
        transport_ceiling,
        "events/s",
    );
    report.add(
        "consume",
        "(i) PostgreSQL inbox transactions, 8 tasks, no broker",
        db_ceiling,
        "events/s",
    );
    report.add(
        "consume",
        "(r) Consumer on NatsTransport, 8 keys at a time",
        consumer_rate,
        "events/s",
    );
    report.target(
        "consume",
        "(r) / min(c, i)",
        consumer_rate / transport_ceiling.min(db_ceiling),
        Target::AtLeast(0.7),
    );
    Ok(())
}
