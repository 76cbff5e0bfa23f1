//! `outbox-bench`: measures the relay and the write path on this machine.
//!
//! ```text
//! cargo run --release -p outbox-bench -- <scenario> [--events N] [--keys K] [--payload B] [--json FILE]
//! scenarios: drain | pg-ceiling | article | all
//! ```
//! PostgreSQL from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! Every scenario works in a schema of its own, dropped at the end.

mod setup;

use std::time::{Duration, Instant};

use outbox_core::publisher::InMemoryPublisher;
use outbox_core::relay::Relay;
use outbox_core::sqlx;

use setup::{Args, BenchDb};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// seq, id, event_type, destination, partition_key, payload, headers.
type ClaimedRow = (
    i64,
    uuid::Uuid,
    String,
    String,
    Option<String>,
    String,
    String,
);
/// seq, id, event_type, destination, partition_key, payload.
type ArticleRow = (i64, uuid::Uuid, String, String, Option<String>, String);

#[tokio::main]
async fn main() {
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("outbox-bench: {e}\n\n{}", Args::USAGE);
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args).await {
        eprintln!("outbox-bench: {e}");
        std::process::exit(1);
    }
}

async fn run(args: &Args) -> Result<(), BoxError> {
    let scenarios: Vec<&str> = match args.scenario.as_str() {
        "all" => vec!["pg-ceiling", "drain", "article"],
        s => vec![s],
    };
    let mut results = Vec::new();
    for s in scenarios {
        let r = match s {
            "drain" => drain(args).await?,
            "pg-ceiling" => pg_ceiling(args).await?,
            "article" => article(args).await?,
            other => return Err(format!("unknown scenario {other:?}\n\n{}", Args::USAGE).into()),
        };
        println!(
            "{:<12} {:>8} events in {:>8.3} s = {:>9.0} events/s",
            r.name,
            r.events,
            r.seconds,
            r.rate()
        );
        results.push(r);
    }
    if let Some(path) = &args.json {
        let json: Vec<_> = results
            .iter()
            .map(|r| serde_json::json!({"scenario": r.name, "events": r.events, "seconds": r.seconds, "events_per_second": r.rate()}))
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}

struct Measured {
    name: &'static str,
    events: u64,
    seconds: f64,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.events as f64 / self.seconds
    }
}

/// (a) our relay, default settings, draining a backlog into the in-memory publisher.
async fn drain(args: &Args) -> Result<Measured, BoxError> {
    let db = BenchDb::new(args).await?;
    db.fill(args.events, args.keys, args.payload).await?;
    let publisher = InMemoryPublisher::new();
    let started = Instant::now();
    let relay = Relay::builder(db.outbox.clone(), publisher.clone()).spawn();
    if !publisher
        .wait_for(args.events as usize, Duration::from_secs(600))
        .await
    {
        return Err(format!(
            "relay published only {} of {}",
            publisher.published_count(),
            args.events
        )
        .into());
    }
    let seconds = started.elapsed().as_secs_f64();
    relay.shutdown().await;
    db.drop().await?;
    Ok(Measured {
        name: "drain",
        events: args.events,
        seconds,
    })
}

/// (d) the database ceiling: claim 1,000 pending rows in `seq` order and mark them sent,
/// on one connection, no broker.
async fn pg_ceiling(args: &Args) -> Result<Measured, BoxError> {
    let db = BenchDb::new(args).await?;
    db.fill(args.events, args.keys, args.payload).await?;
    let mut conn = db.outbox.pool().acquire().await?;
    let started = Instant::now();
    let mut done = 0_u64;
    loop {
        let rows: Vec<ClaimedRow> = sqlx::query_as(
            "SELECT seq, id, event_type, destination, partition_key, payload::text, headers::text FROM outbox \
             WHERE sent_at IS NULL AND dead_at IS NULL ORDER BY seq LIMIT 1000",
        )
        .fetch_all(&mut *conn)
        .await?;
        if rows.is_empty() {
            break;
        }
        let seqs: Vec<i64> = rows.iter().map(|r| r.0).collect();
        sqlx::query("UPDATE outbox SET sent_at = now() WHERE seq = ANY($1)")
            .bind(&seqs)
            .execute(&mut *conn)
            .await?;
        done += rows.len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(conn);
    db.drop().await?;
    Ok(Measured {
        name: "pg-ceiling",
        events: done,
        seconds,
    })
}

/// (b) the source article's relay: poll, 50 rows by creation time, send one message and
/// wait for its ack, one UPDATE per row.
async fn article(args: &Args) -> Result<Measured, BoxError> {
    use outbox_core::publisher::Publisher;
    let db = BenchDb::new(args).await?;
    db.fill(args.events, args.keys, args.payload).await?;
    // The article's own index: pending rows by creation time.
    sqlx::query("CREATE INDEX outbox_article_idx ON outbox (created_at) WHERE sent_at IS NULL")
        .execute(db.outbox.pool())
        .await?;
    let publisher = InMemoryPublisher::new();
    let pool = db.outbox.pool().clone();
    let started = Instant::now();
    let mut done = 0_u64;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<ArticleRow> = sqlx::query_as(
            "SELECT seq, id, event_type, destination, partition_key, payload::text FROM outbox \
             WHERE sent_at IS NULL ORDER BY created_at LIMIT 50 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            break;
        }
        for (seq, id, event_type, destination, key, payload) in rows {
            let record = outbox_core::OutboxRecord {
                seq,
                id,
                event_type,
                event_version: None,
                destination,
                partition_key: key,
                payload,
                headers: Default::default(),
                created_at: chrono::Utc::now(),
                attempts: 0,
            };
            let result = publisher.publish(std::slice::from_ref(&record)).await;
            if result.first().is_some_and(Result::is_ok) {
                sqlx::query("UPDATE outbox SET sent_at = now() WHERE seq = $1")
                    .bind(seq)
                    .execute(&mut *tx)
                    .await?;
                done += 1;
            }
        }
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    db.drop().await?;
    Ok(Measured {
        name: "article",
        events: done,
        seconds,
    })
}
