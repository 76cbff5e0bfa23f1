//! `outbox-bench`: measures the relay and the write path on this machine, side by side
//! with references taken in the same run.
//!
//! ```text
//! cargo run --release -p outbox-bench -- <scenario>... [options]
//! scenarios: drain latency write notify enqueue sustained idle history scale wal partitions restart all; nats (needs NATS with JetStream,
//! `OUTBOX_BENCH_NATS`, default nats://127.0.0.1:4222; not part of `all`); rabbitmq (needs
//! RabbitMQ, `OUTBOX_BENCH_RABBITMQ`, default amqp://guest:guest@127.0.0.1:5672/%2f; not part of `all`)
//! options:   --events N --keys K --payload BYTES --history ROWS --idle-seconds S
//!            --broker HOST:PORT|memory (default 127.0.0.1:9092) --latency-seconds S --latency-rate N
//!            --session-timeout-ms MS --restart-rounds N (restart)
//!            --smoke (tiny sizes, seconds) --out DIR (JSON + SVG, default target/bench)
//! ```
//! PostgreSQL from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! Every scenario works in a schema of its own, dropped at the end.

mod consume;
mod kafka;
mod load;
mod nats;
mod notify;
mod partitions;
mod publisher;
mod rabbitmq;
mod report;
mod restart;
mod scenarios;
mod setup;
mod wal;

use setup::Args;

/// A statement built at run time from the run's own schema and table names (sqlx 0.9
/// asks every statement that is not a literal to say so).
fn trusted_sql(statement: impl Into<String>) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(statement.into())
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() {
    // A consumer process of the `restart` scenario (it spawns this binary).
    if std::env::args().nth(1).as_deref() == Some(restart::MEMBER) {
        if let Err(e) = restart::member().await {
            eprintln!("outbox-bench restart member: {e}");
            std::process::exit(1);
        }
        return;
    }
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
    let mut report = report::Report::new(args);
    for scenario in &args.scenarios {
        eprintln!("== {scenario}");
        match scenario.as_str() {
            "drain" => scenarios::drain(args, &mut report).await?,
            "latency" => scenarios::latency(args, &mut report).await?,
            "write" => scenarios::write_overhead(args, &mut report).await?,
            "idle" => scenarios::idle(args, &mut report).await?,
            "history" => scenarios::history(args, &mut report).await?,
            "scale" => scenarios::scale_out(args, &mut report).await?,
            "nats" => nats::drain(args, &mut report).await?,
            "consume" => consume::consume(args, &mut report).await?,
            "rabbitmq" => rabbitmq::drain(args, &mut report).await?,
            "notify" => notify::notify(args, &mut report).await?,
            "enqueue" => load::enqueue(args, &mut report).await?,
            "sustained" => load::sustained(args, &mut report).await?,
            "wal" => wal::wal(args, &mut report).await?,
            "partitions" => partitions::partitions(args, &mut report).await?,
            "restart" => restart::restart(args, &mut report).await?,
            other => return Err(format!("unknown scenario {other:?}\n\n{}", Args::USAGE).into()),
        }
    }
    report.finish()?;
    if args.check && !report.missed().is_empty() {
        eprintln!(
            "outbox-bench: --check: {} target(s) missed",
            report.missed().len()
        );
        std::process::exit(3);
    }
    Ok(())
}
