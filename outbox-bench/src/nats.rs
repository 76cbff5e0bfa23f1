//! `nats`: drain throughput to NATS JetStream. Our relay with `outbox-nats` against the
//! JetStream ceiling: the same messages published straight from memory, 4,096 in flight,
//! every acknowledgement awaited. Both go to a fresh in-memory stream (like tansu's
//! in-memory storage in `drain`). The target is judged against the lower of that
//! ceiling and the database's claim+mark ceiling (d), both measured in the same run.

use std::time::Instant;

use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use outbox_nats::NatsPublisher;

use crate::BoxError;
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb};

const IN_FLIGHT: usize = 4096;

pub(crate) fn url() -> String {
    std::env::var("OUTBOX_BENCH_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A fresh in-memory stream; returns its name and subject.
pub(crate) async fn fresh_stream(js: &jetstream::Context) -> Result<(String, String), BoxError> {
    let id = uuid::Uuid::now_v7().simple().to_string();
    let (name, subject) = (
        format!("OUTBOX_BENCH_{id}"),
        format!("outbox-bench-{id}.events"),
    );
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone()],
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await?;
    Ok((name, subject))
}

/// `args.events` records for `subject`, over `args.keys` keys, each with `payload`.
pub(crate) fn records(args: &Args, subject: &str, payload: &str) -> Vec<outbox_core::OutboxRecord> {
    (0..args.events)
        .map(|i| {
            let message = outbox_core::OutboxMessage::new("BenchEvent", subject, payload)
                .with_key(format!("k{}", i % args.keys.max(1)));
            outbox_core::OutboxRecord::from(message).with_seq(i as i64)
        })
        .collect()
}

pub async fn drain(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    // The database's side of the same drain, measured in this run (as in `drain`).
    let (db_ceiling, _) = crate::scenarios::pg_ceiling(args).await?;
    let client = async_nats::connect(url()).await?;
    let js = jetstream::new(client);

    // The relay.
    let (name, subject) = fresh_stream(&js).await?;
    let mut db = BenchDb::new(args).await?;
    db.destination = subject.clone();
    db.fill(args.events, args.keys, args.payload).await?;
    let publisher = NatsPublisher::builder(url())
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await?;
    let relay_rate = crate::scenarios::timed_drain(args, &db, publisher).await?;
    db.drop().await?;
    js.delete_stream(&name).await?;

    // The ceiling.
    let (name, subject) = fresh_stream(&js).await?;
    let payload = bytes::Bytes::from(format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    ));
    let started = Instant::now();
    let acked = futures_util::stream::iter(0..args.events)
        .map(|_| {
            let (js, subject, payload) = (js.clone(), subject.clone(), payload.clone());
            async move {
                let mut headers = async_nats::HeaderMap::new();
                let id = uuid::Uuid::now_v7().to_string();
                headers.insert("Nats-Msg-Id", id.as_str());
                js.publish_with_headers(subject, headers, payload)
                    .await?
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .filter(|r| std::future::ready(r.is_ok()))
        .count()
        .await;
    let ceiling = acked as f64 / started.elapsed().as_secs_f64();
    js.delete_stream(&name).await?;
    if acked as u64 != args.events {
        return Err(format!(
            "the ceiling run had {acked} of {} acknowledged",
            args.events
        )
        .into());
    }

    // The publisher alone: the same messages in batches as the relay hands them over.
    let (name, subject) = fresh_stream(&js).await?;
    let publisher = NatsPublisher::builder(url())
        .skip_catalog_check()
        .build()
        .await?;
    let records = records(args, &subject, &String::from_utf8_lossy(&payload));
    let started = Instant::now();
    for batch in records.chunks(1000) {
        use outbox_core::publisher::Publisher;
        let results = publisher.publish(batch).await;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            return Err(format!("publisher alone: {e}").into());
        }
    }
    let alone = args.events as f64 / started.elapsed().as_secs_f64();
    js.delete_stream(&name).await?;

    report.add(
        "nats",
        "(p) NatsPublisher alone, batches of 1,000",
        alone,
        "events/s",
    );
    report.add(
        "nats",
        "(n) raw JetStream publish ceiling (no database)",
        ceiling,
        "events/s",
    );
    report.add(
        "nats",
        "(r) outbox relay -> NATS JetStream",
        relay_rate,
        "events/s",
    );
    report.add(
        "nats",
        "(d) PostgreSQL claim+mark ceiling (no broker)",
        db_ceiling,
        "events/s",
    );
    report.target(
        "nats",
        "(r) / min(n, d)",
        relay_rate / ceiling.min(db_ceiling),
        Target::AtLeast(0.7),
    );
    Ok(())
}
