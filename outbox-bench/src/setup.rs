//! Command-line arguments and the benchmark database.

use std::str::FromStr;

use outbox_core::Outbox;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_core::sqlx::{self, Connection};

use crate::BoxError;
use crate::trusted_sql;

/// Parsed command line.
pub struct Args {
    pub scenarios: Vec<String>,
    pub events: u64,
    pub keys: u64,
    pub payload: usize,
    pub history: u64,
    pub idle_seconds: u64,
    pub write_iterations: usize,
    pub smoke: bool,
    pub out: String,
    pub database_url: String,
    /// The Kafka-protocol broker, or `None` for the in-process counting publisher.
    pub broker: Option<String>,
    pub latency_seconds: u64,
    pub latency_rate: u64,
    /// The relays' `batch_size` in the drain scenarios (`None`: the relay's default).
    pub batch_size: Option<usize>,
    /// The relays' `batches_in_flight` in `latency` and `sustained` (`None`: the default).
    pub batches_in_flight: Option<usize>,
    /// Seconds per writer count and variant in the `notify` scenario.
    pub notify_seconds: f64,
    /// Fail the run (exit code 3) when a figure misses its target.
    pub check: bool,
    /// The `sustained` scenario: rates tried in order (events/s), seconds per rate, and
    /// events per transaction.
    pub sustained_rates: Vec<u64>,
    pub sustained_seconds: u64,
    pub sustained_batch: u64,
    /// Seconds of load per layout in the `partitions` scenario.
    pub partitions_seconds: u64,
    /// The `restart` scenario: the groups' `session.timeout.ms`, and rounds per figure.
    pub session_timeout_ms: u64,
    pub restart_rounds: usize,
}

impl Args {
    pub const USAGE: &'static str = "usage: outbox-bench <drain|latency|write|notify|enqueue|sustained|idle|history|scale|wal|nats|rabbitmq|consume|partitions|restart|all>... \
        [--events N (100000)] [--keys K (1000)] [--payload BYTES (1024)] \
        [--history ROWS (10000000)] [--idle-seconds S (60)] [--write-iterations N (2000)] \
        [--broker HOST:PORT|memory (127.0.0.1:9092)] [--latency-seconds S (30)] [--latency-rate TX/S (1000)] \
        [--batch-size N (the relay's default)] [--batches-in-flight N (the relay's default, 1)] [--notify-seconds S (6)] [--sustained-rates R,R.. (2500,...,20000)] [--sustained-seconds S (120)] [--sustained-batch EVENTS/TX (10)] [--partitions-seconds S (120)] [--session-timeout-ms MS (10000; 0: librdkafka's defaults)] [--restart-rounds N (3)] [--check (exit 3 on a missed target)] [--smoke] [--out DIR (target/bench)]";

    /// Every scenario `run` knows, in the order of [`USAGE`](Self::USAGE).
    pub const SCENARIOS: [&'static str; 15] = [
        "drain",
        "latency",
        "write",
        "notify",
        "enqueue",
        "sustained",
        "idle",
        "history",
        "scale",
        "wal",
        "nats",
        "rabbitmq",
        "consume",
        "partitions",
        "restart",
    ];

    pub fn parse(it: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut args = Args {
            scenarios: Vec::new(),
            events: 100_000,
            keys: 1000,
            payload: 1024,
            history: 10_000_000,
            idle_seconds: 60,
            write_iterations: 2000,
            smoke: false,
            out: "target/bench".to_owned(),
            broker: Some("127.0.0.1:9092".to_owned()),
            latency_seconds: 30,
            latency_rate: 1000,
            batch_size: None,
            batches_in_flight: None,
            notify_seconds: 6.0,
            check: false,
            sustained_rates: vec![2_500, 5_000, 7_500, 10_000, 12_500, 15_000, 20_000],
            sustained_seconds: 120,
            partitions_seconds: 120,
            session_timeout_ms: 10_000,
            restart_rounds: 3,
            sustained_batch: 10,
            database_url: std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        };
        let mut it = it.peekable();
        while let Some(word) = it.next() {
            if !word.starts_with("--") {
                match word.as_str() {
                    "all" => args.scenarios.extend(
                        [
                            "drain",
                            "latency",
                            "write",
                            "notify",
                            "enqueue",
                            "idle",
                            "history",
                            "scale",
                            "wal",
                            "partitions",
                            // Last: it leaves the broker holding its messages (tansu keeps
                            // topics in memory), which slows what runs after it.
                            "sustained",
                            "restart",
                        ]
                        .map(String::from),
                    ),
                    _ if Self::SCENARIOS.contains(&word.as_str()) => args.scenarios.push(word),
                    // Refused here, not when its turn comes after minutes of the others.
                    other => {
                        return Err(format!(
                            "unknown scenario {other:?}: one of {} or all",
                            Self::SCENARIOS.join(", ")
                        ));
                    }
                }
                continue;
            }
            if word == "--smoke" {
                args.smoke = true;
                continue;
            }
            if word == "--check" {
                args.check = true;
                continue;
            }
            let value = it.next().ok_or_else(|| format!("{word} needs a value"))?;
            let number = || {
                value
                    .parse::<u64>()
                    .map_err(|e| format!("{word} {value:?}: {e}"))
            };
            match word.as_str() {
                "--events" => args.events = number()?.max(1),
                "--keys" => args.keys = number()?.max(1),
                "--payload" => {
                    args.payload = usize::try_from(number()?).map_err(|e| e.to_string())?
                }
                "--history" => args.history = number()?,
                "--idle-seconds" => args.idle_seconds = number()?.max(1),
                "--write-iterations" => {
                    args.write_iterations = usize::try_from(number()?)
                        .map_err(|e| e.to_string())?
                        .max(10)
                }
                "--out" => args.out = value,
                "--notify-seconds" => args.notify_seconds = number()?.max(1) as f64,
                "--sustained-seconds" => args.sustained_seconds = number()?.max(1),
                "--partitions-seconds" => args.partitions_seconds = number()?.max(5),
                "--session-timeout-ms" => {
                    // 0: librdkafka's defaults. Below 1 s a group churns even on tansu; an
                    // Apache Kafka broker refuses sessions below its
                    // group.min.session.timeout.ms (6 s by default).
                    args.session_timeout_ms = match number()? {
                        0 => 0,
                        ms => ms.max(1000),
                    }
                }
                "--restart-rounds" => {
                    args.restart_rounds = usize::try_from(number()?)
                        .map_err(|e| e.to_string())?
                        .max(1)
                }
                "--sustained-batch" => args.sustained_batch = number()?.max(1),
                "--sustained-rates" => {
                    args.sustained_rates = value
                        .split(',')
                        .map(|r| {
                            r.trim()
                                .parse::<u64>()
                                .map_err(|e| format!("--sustained-rates {r:?}: {e}"))
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    if args.sustained_rates.is_empty() {
                        return Err("--sustained-rates needs at least one rate".to_owned());
                    }
                }
                "--broker" => args.broker = (value != "memory").then(|| value.clone()),
                "--latency-seconds" => args.latency_seconds = number()?.max(1),
                "--latency-rate" => args.latency_rate = number()?.max(1),
                "--batch-size" => {
                    args.batch_size = Some(
                        usize::try_from(number()?)
                            .map_err(|e| e.to_string())?
                            .max(1),
                    )
                }
                "--batches-in-flight" => {
                    args.batches_in_flight =
                        Some(usize::try_from(number()?).map_err(|e| e.to_string())?)
                }
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        if args.scenarios.is_empty() {
            return Err("no scenario given".to_owned());
        }
        if args.smoke {
            args.events = args.events.min(2_000);
            args.keys = args.keys.min(50);
            args.history = args.history.min(20_000);
            args.idle_seconds = args.idle_seconds.min(6);
            args.write_iterations = args.write_iterations.min(50);
            args.latency_seconds = args.latency_seconds.min(2);
            args.latency_rate = args.latency_rate.min(100);
            args.sustained_rates = vec![200];
            args.sustained_seconds = args.sustained_seconds.min(2);
            args.partitions_seconds = args.partitions_seconds.min(6);
            // Short sessions, unless librdkafka's defaults were asked for.
            if args.session_timeout_ms != 0 {
                args.session_timeout_ms = args.session_timeout_ms.min(2_000);
            }
            args.restart_rounds = 1;
        }
        Ok(args)
    }
}

/// A schema of its own with migrated outbox tables.
pub struct BenchDb {
    pub outbox: Outbox,
    /// Where filled rows are addressed (the topic, for Kafka runs).
    pub destination: String,
    schema: String,
    url: String,
}

impl BenchDb {
    pub async fn new(args: &Args) -> Result<BenchDb, BoxError> {
        Self::with_pool_size(args, 16).await
    }

    pub async fn with_pool_size(args: &Args, size: u32) -> Result<BenchDb, BoxError> {
        Self::create(args, size, |pool| Ok(Outbox::new(pool))).await
    }

    /// A fresh schema whose pool (`size` connections) `build` makes the outbox of, migrated.
    pub async fn create(
        args: &Args,
        size: u32,
        build: impl FnOnce(sqlx::PgPool) -> outbox_core::Result<Outbox>,
    ) -> Result<BenchDb, BoxError> {
        let schema = format!("outbox_bench_{}", uuid::Uuid::now_v7().simple());
        let base = PgConnectOptions::from_str(&args.database_url)?;
        let mut admin = sqlx::PgConnection::connect_with(&base).await?;
        sqlx::query(trusted_sql(format!("CREATE SCHEMA \"{schema}\"")))
            .execute(&mut admin)
            .await?;
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .connect_with(base.options([("search_path", schema.as_str())]))
            .await?;
        let outbox = build(pool)?;
        outbox.migrate().await?;
        Ok(BenchDb {
            outbox,
            destination: "bench.events".to_owned(),
            schema,
            url: args.database_url.clone(),
        })
    }

    /// `events` pending rows, keys `k0..k{keys}` round robin, a JSON payload of about
    /// `payload` bytes; one statement, then VACUUM ANALYZE as a real table would have.
    pub async fn fill(&self, events: u64, keys: u64, payload: usize) -> Result<(), BoxError> {
        self.fill_rows(events, keys, payload, false).await
    }

    /// Like [`fill`](Self::fill); `sent` rows are history (already published).
    pub async fn fill_rows(
        &self,
        events: u64,
        keys: u64,
        payload: usize,
        sent: bool,
    ) -> Result<(), BoxError> {
        let filler = "x".repeat(payload.saturating_sub(60));
        sqlx::query(
            "INSERT INTO outbox (id, event_type, destination, partition_key, body, sent_at) \
             SELECT gen_random_uuid(), 'BenchEvent', $5, 'k' || (g % $2), \
                    convert_to(json_build_object('n', g, 'key', 'k' || (g % $2), 'filler', $3::text)::text, 'UTF8'), \
                    CASE WHEN $4 THEN now() END \
             FROM generate_series(0, $1 - 1) g",
        )
        .bind(i64::try_from(events)?)
        .bind(i64::try_from(keys)?)
        .bind(filler)
        .bind(sent)
        .bind(&self.destination)
        .execute(self.outbox.pool())
        .await?;
        sqlx::query("VACUUM ANALYZE outbox")
            .execute(self.outbox.pool())
            .await?;
        Ok(())
    }

    /// The schema's name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    pub async fn drop(self) -> Result<(), BoxError> {
        self.outbox.pool().close().await;
        let mut admin = sqlx::PgConnection::connect(&self.url).await?;
        sqlx::query(trusted_sql(format!(
            "DROP SCHEMA \"{}\" CASCADE",
            self.schema
        )))
        .execute(&mut admin)
        .await?;
        Ok(())
    }
}

/// Peak resident memory of this process since the last [`reset_peak_rss`], in bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the kernel's peak-RSS mark of this process (Linux `clear_refs` 5).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The `q` quantile (0..=1) of sorted `values`.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
