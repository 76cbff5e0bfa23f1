//! `restart`: how long a Kafka consumer takes to handle its first message after a first
//! start, a graceful restart and a `kill -9` restart (#36 §2), with librdkafka's group
//! settings as they are, with static membership (`group.instance.id`) and with the
//! cooperative-sticky assignor.
//!
//! Each consumer is a process of its own (this binary, `outbox-bench __restart-member`:
//! a `KafkaTransport` and the consumer layer with a PostgreSQL inbox), so that `kill -9`
//! is a real one. Time runs from the process's spawn to its stdout line for a message
//! produced while no member ran. The references, measured in the same run: (j) a raw
//! rdkafka consumer in a new group, subscribe to its first message (the broker's own
//! join delay), and the group's `session.timeout.ms` (how long a killed member keeps
//! its partitions). Targets: a first start and a graceful restart within 1.5 × (j) + 1 s
//! (the process, its pool, the cluster check and the group join). The `kill -9`
//! restarts are reported against the session timeout, without a target: that delay is
//! the group protocol's. Static membership has no target either: tansu, the test broker,
//! does not give a restarted static member its partitions back at once (measured;
//! docs/kafka.md has the figures, and what a real cluster does).

use std::process::Stdio;
use std::str::FromStr;
use std::time::{Duration, Instant};

use outbox_core::Outbox;
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_kafka::{KafkaPublisher, KafkaTransport};
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use uuid::Uuid;

use crate::BoxError;
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb};

/// The first argument that makes this binary a consumer member instead of the bench.
pub const MEMBER: &str = "__restart-member";
/// The member's settings, as JSON in this environment variable.
const MEMBER_ENV: &str = "OUTBOX_BENCH_MEMBER";

/// librdkafka's default `session.timeout.ms`.
const LIBRDKAFKA_SESSION_TIMEOUT_MS: u64 = 45_000;

/// What a member process needs.
#[derive(serde::Serialize, serde::Deserialize)]
struct Member {
    brokers: String,
    topic: String,
    group: String,
    settings: Vec<(String, String)>,
    database_url: String,
    schema: String,
}

/// The member process: consumes `topic` in `group` through the consumer layer and
/// prints `handled <id>` for each message its handler ran for, until SIGTERM, which
/// shuts it down gracefully (offsets committed, group left unless static).
pub async fn member() -> Result<(), BoxError> {
    let json = std::env::var(MEMBER_ENV).map_err(|_| format!("{MEMBER_ENV} is not set"))?;
    let m: Member = serde_json::from_str(&json)?;
    // The consumer's own account (assignment, waiting for the group) goes to the log the
    // bench prints when a member is late.
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .with_writer(std::io::stderr)
        .init();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(
            PgConnectOptions::from_str(&m.database_url)?.options([("search_path", &m.schema)]),
        )
        .await?;
    let outbox = Outbox::new(pool);
    let mut builder = KafkaTransport::builder(&m.brokers, &m.group).topic(&m.topic);
    for (key, value) in &m.settings {
        builder = builder.set(key, value);
    }
    let transport = builder.build().await?;
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "restart"))
        .on_event_type::<serde_json::Value, _>("BenchEvent", |_tx, msg| {
            Box::pin(async move {
                // Rust's stdout is line-buffered: the line leaves at once.
                println!("handled {}", msg.id);
                Ok(())
            })
        })
        .build()?;
    let running = consumer.spawn();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => running.shutdown().await?,
        ended = running_until_finished(&running) => return Err(ended.into()),
    }
    Ok(())
}

/// Resolves when the consumer stopped on its own (an error: the bench never asks it to).
async fn running_until_finished(running: &outbox_core::consumer::ConsumerHandle) -> String {
    while !running.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    format!("the consumer stopped by itself: {:?}", running.stats())
}

/// A member process and its stdout.
struct Spawned {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    log: std::path::PathBuf,
    spawned: Instant,
}

impl Spawned {
    fn start(member: &Member, log: std::path::PathBuf) -> Result<Spawned, BoxError> {
        let stderr = std::fs::File::create(&log)?;
        let mut child = Command::new(std::env::current_exe()?)
            .arg(MEMBER)
            .env(MEMBER_ENV, serde_json::to_string(member)?)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("the member's stdout")?;
        Ok(Spawned {
            child,
            lines: BufReader::new(stdout).lines(),
            log,
            spawned: Instant::now(),
        })
    }

    /// Seconds from the spawn to the line for `id`, within `patience`; on a timeout or
    /// an early exit, the error carries the member's log.
    async fn handled(&mut self, id: Uuid, patience: Duration) -> Result<f64, BoxError> {
        let want = format!("handled {id}");
        let found = tokio::time::timeout(patience, async {
            while let Some(line) = self.lines.next_line().await? {
                if line == want {
                    return Ok::<_, std::io::Error>(true);
                }
            }
            Ok(false)
        })
        .await;
        match found {
            Ok(Ok(true)) => Ok(self.spawned.elapsed().as_secs_f64()),
            Ok(Ok(false)) => Err(self.explain(&format!("the member exited before handling {id}"))),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(self.explain(&format!(
                "the member did not handle {id} within {patience:?}"
            ))),
        }
    }

    fn explain(&self, what: &str) -> BoxError {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "{what}; the last lines of its log ({}):\n{}",
            self.log.display(),
            tail.join("\n")
        )
        .into()
    }

    /// SIGTERM, and the exit (which must be a clean one).
    async fn stop(mut self) -> Result<(), BoxError> {
        let pid = self.child.id().ok_or("the member already exited")?;
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()?;
        if !status.success() {
            return Err(format!("kill -TERM {pid}: {status}").into());
        }
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(Ok(s)) if s.success() => Ok(()),
            Ok(Ok(s)) => Err(self.explain(&format!("the member's graceful stop ended with {s}"))),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(self.explain("the member did not stop within 60 s of SIGTERM")),
        }
    }

    /// SIGKILL, and the reaping.
    async fn kill(mut self) -> Result<(), BoxError> {
        self.child.kill().await?;
        Ok(())
    }
}

/// One message for `topic` on its own key, published now; its id.
async fn produce(publisher: &KafkaPublisher, topic: &str) -> Result<Uuid, BoxError> {
    let message = outbox_core::OutboxMessage::new("BenchEvent", topic, "{}")
        .with_key(Uuid::now_v7().to_string());
    let record = outbox_core::OutboxRecord::from(message);
    let id = record.id;
    if let Some(Err(e)) = publisher.publish(&[record]).await.into_iter().next() {
        return Err(format!("producing a message for the restart: {e}").into());
    }
    Ok(id)
}

/// (j) A raw rdkafka consumer in a new group, in this process: subscribe to the first
/// message (the topic holds some already), in seconds.
async fn raw_join(
    brokers: &str,
    topic: &str,
    settings: &[(String, String)],
    patience: Duration,
) -> Result<f64, BoxError> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("outbox-bench-raw-{}", Uuid::now_v7().simple()),
        )
        .set("auto.offset.reset", "earliest");
    for (key, value) in settings {
        config.set(key, value);
    }
    let started = Instant::now();
    let consumer: StreamConsumer = config.create()?;
    consumer.subscribe(&[topic])?;
    tokio::time::timeout(patience, consumer.recv())
        .await
        .map_err(|_| format!("the raw consumer received nothing within {patience:?}"))??;
    Ok(started.elapsed().as_secs_f64())
}

fn median(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let mid = crate::setup::quantile(&values, 0.5);
    (
        mid,
        values.first().copied().unwrap_or(f64::NAN),
        values.last().copied().unwrap_or(f64::NAN),
    )
}

pub async fn restart(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let brokers = args
        .broker
        .as_deref()
        .ok_or("restart needs a Kafka-protocol broker (--broker HOST:PORT), not memory")?;
    // `--session-timeout-ms 0`: librdkafka's own group settings (a 45 s session, 3 s
    // heartbeats), as a consumer built without them has.
    let session_ms = match args.session_timeout_ms {
        0 => LIBRDKAFKA_SESSION_TIMEOUT_MS,
        ms => ms,
    };
    let session = Duration::from_millis(session_ms);
    let patience = session * 4 + Duration::from_secs(60);
    let mut group_settings = Vec::new();
    if args.session_timeout_ms != 0 {
        group_settings.push(("session.timeout.ms".to_owned(), session_ms.to_string()));
        group_settings.push((
            "heartbeat.interval.ms".to_owned(),
            (session_ms / 4).max(100).to_string(),
        ));
    }
    // Experiments (`debug=cgrp` shows the group protocol in the members' logs).
    let extra = crate::kafka::overrides("OUTBOX_BENCH_CONSUMER")?;
    if !extra.is_empty() {
        eprintln!("consumer properties set by OUTBOX_BENCH_CONSUMER: {extra:?}");
    }
    group_settings.extend(extra);
    let topic = crate::kafka::create_topic(brokers).await?;
    let publisher = crate::kafka::publisher(brokers, &topic).await?;
    let db = BenchDb::new(args).await?;
    let logs = std::path::PathBuf::from(&args.out).join("restart-logs");
    std::fs::create_dir_all(&logs)?;
    produce(&publisher, &topic).await?;

    let mut joins = Vec::new();
    for _ in 0..args.restart_rounds {
        joins.push(raw_join(brokers, &topic, &group_settings, patience).await?);
    }
    let (join, join_min, join_max) = median(joins);
    let limit = ((1.5 * join + 1.0) * 100.0).round() / 100.0;
    eprintln!("  (j) raw join: median {join:.2} s, range {join_min:.2}-{join_max:.2} s");
    report.add(
        "restart",
        "(j) raw rdkafka consumer, new group: subscribe -> first message",
        join,
        "s",
    );
    report.add(
        "restart",
        "(s) session.timeout.ms of every group below",
        session.as_secs_f64(),
        "s",
    );

    let variants: [(&str, Option<(&str, &str)>); 3] = [
        ("librdkafka's group settings", None),
        ("static membership", Some(("group.instance.id", "member"))),
        (
            "cooperative-sticky",
            Some(("partition.assignment.strategy", "cooperative-sticky")),
        ),
    ];
    let mut spawned = 0;
    for (label, extra) in variants {
        let (mut starts, mut graceful, mut killed) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.restart_rounds {
            let group = format!("outbox-bench-restart-{}", Uuid::now_v7().simple());
            let mut settings = group_settings.clone();
            if let Some((key, value)) = extra {
                // A static member's id, unique to this round's group.
                let value = if key == "group.instance.id" {
                    format!("{value}-{group}")
                } else {
                    value.to_owned()
                };
                settings.push((key.to_owned(), value));
            }
            let member = Member {
                brokers: brokers.to_owned(),
                topic: topic.clone(),
                group,
                settings,
                database_url: args.database_url.clone(),
                schema: db.schema().to_owned(),
            };
            let next = |spawned: &mut usize| {
                *spawned += 1;
                Spawned::start(&member, logs.join(format!("member-{spawned}.log")))
            };

            let id = produce(&publisher, &topic).await?;
            let mut running = next(&mut spawned)?;
            starts.push(running.handled(id, patience).await?);

            running.stop().await?;
            let id = produce(&publisher, &topic).await?;
            let mut running = next(&mut spawned)?;
            graceful.push(running.handled(id, patience).await?);

            running.kill().await?;
            let id = produce(&publisher, &topic).await?;
            let mut running = next(&mut spawned)?;
            killed.push(running.handled(id, patience).await?);
            running.stop().await?;
        }
        for (what, values) in [
            ("first start", starts),
            ("graceful restart", graceful),
            ("kill -9 restart", killed),
        ] {
            let (mid, low, high) = median(values);
            eprintln!("  {label}, {what}: median {mid:.2} s, range {low:.2}-{high:.2} s");
            let name = format!("{label}: {what} -> first handled message (median)");
            let static_membership = extra.is_some_and(|(k, _)| k == "group.instance.id");
            if what == "kill -9 restart" {
                // The group protocol's delay: a killed member keeps its partitions for its
                // session; static membership is the way around it, where the broker
                // honours it (tansu does not: docs/kafka.md).
                report.add("restart", &name, mid, "s");
                report.add(
                    "restart",
                    &format!("{label}: kill -9 restart / (s)"),
                    mid / session.as_secs_f64(),
                    "ratio",
                );
            } else if static_membership {
                report.add("restart", &name, mid, "s");
            } else {
                // Ours over the broker's own join: the process, its pool, the cluster
                // check and the subscription.
                report.target_in("restart", &name, mid, "s", Target::AtMost(limit));
            }
        }
    }
    db.drop().await?;
    Ok(())
}
