//! The command line, as clap parses it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Parser, Subcommand};
use uuid::Uuid;

use crate::time::{parse_age, parse_duration, parse_time};

/// The forms a time takes, under the help of each command that takes one.
macro_rules! times {
    () => {
        "Times: RFC 3339 (2024-05-01T12:00:00Z), a date (2024-05-01, midnight UTC), \
         `now`, or an age before now (90s, 15m, 12h, 7d, 2w; this machine's clock)."
    };
}
const TIMES: &str = times!();

/// The times paragraph and the exit statuses, under `outbox --help`.
const MAIN_AFTER_HELP: &str = concat!(
    times!(),
    "\n\nExit status: 0 done; 1 the command failed (the reason on one line of standard \
     error; nothing changed); 2 the command line does not parse; 3 `doctor` found \
     something that needs action."
);

/// Operate a transactional outbox: migrate its tables, watch the queue, replay sent
/// messages, release dead letters and purge history.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, after_help = MAIN_AFTER_HELP)]
pub struct Cli {
    /// The database: postgres://user:password@host:5432/db, mysql://user@host:3306/db
    /// (MariaDB too) or sqlite://path/to/app.db.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        help_heading = "Global options",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database_url: Option<String>,

    /// The outbox table, optionally schema-qualified (as in the library's configuration).
    #[arg(
        long,
        env = "OUTBOX_TABLE",
        global = true,
        help_heading = "Global options",
        default_value = "outbox",
        value_name = "TABLE"
    )]
    pub table: String,

    /// The processed-messages table (default: the outbox table + `_processed`).
    #[arg(
        long,
        env = "OUTBOX_PROCESSED_TABLE",
        global = true,
        help_heading = "Global options",
        value_name = "TABLE"
    )]
    pub processed_table: Option<String>,

    /// PostgreSQL WAL mode (docs/wal.md): the outbox's replication slot, for `status`,
    /// `migrate` and `slot drop` (default with --wal: `outbox_<table>`).
    #[arg(
        long,
        env = "OUTBOX_WAL_SLOT",
        global = true,
        help_heading = "Global options",
        value_name = "SLOT"
    )]
    pub wal_slot: Option<String>,

    /// PostgreSQL WAL mode with the default slot name (`outbox_<table>`).
    #[arg(long, global = true, help_heading = "Global options")]
    pub wal: bool,

    /// Give up connecting after this long (an age such as 10s).
    #[arg(long, global = true,
        help_heading = "Global options", default_value = "10s", value_parser = parse_age, value_name = "AGE")]
    pub connect_timeout: Duration,

    /// Print JSON on standard output (status, doctor: the report; pending, dead: the
    /// messages with payloads and headers; other commands: what they did), and a failure
    /// as one JSON object on standard error. Commands that ask first need --yes with it.
    #[arg(long, global = true, help_heading = "Global options")]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the outbox tables (safe to run again).
    Migrate,
    /// Print the completion script for a shell (no database needed).
    ///
    /// E.g. `outbox completions bash > ~/.local/share/bash-completion/completions/outbox`,
    /// `outbox completions zsh > "${fpath[1]}/_outbox"`,
    /// `outbox completions fish > ~/.config/fish/completions/outbox.fish`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Pending, in-retry and dead-lettered counts, overall and per destination.
    Status,
    /// List pending messages, oldest first.
    Pending {
        #[command(flatten)]
        filter: Filter,
        /// Only messages waiting for a retry after a failure.
        #[arg(long)]
        in_retry: bool,
    },
    /// List dead-lettered messages, oldest first.
    Dead {
        #[command(flatten)]
        filter: Filter,
    },
    /// Re-queue sent messages so the relay publishes them again (e.g. after a consumer bug).
    #[command(after_help = TIMES)]
    Replay {
        /// Message ids (repeat, or separate with commas).
        #[arg(long = "id", value_name = "ID", value_delimiter = ',', required_unless_present = "since",
              conflicts_with_all = ["since", "until", "destination"])]
        ids: Vec<Uuid>,
        /// Messages sent at or after this time.
        #[arg(long, value_parser = parse_time, value_name = "TIME", requires = "until")]
        since: Option<DateTime<Utc>>,
        /// Messages sent before this time.
        #[arg(long, value_parser = parse_time, value_name = "TIME", requires = "since")]
        until: Option<DateTime<Utc>>,
        /// With --since/--until: only messages for this destination.
        #[arg(long)]
        destination: Option<String>,
        /// With --since/--until: re-queue without asking. Without it, the command says how
        /// many messages the window holds and asks on a terminal, or changes nothing.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Return dead-lettered messages to pending (attempts reset).
    Release {
        /// Message ids (repeat, or separate with commas).
        #[arg(
            long = "id",
            value_name = "ID",
            value_delimiter = ',',
            required_unless_present = "key",
            conflicts_with = "key"
        )]
        ids: Vec<Uuid>,
        /// Every dead-lettered message with this partition key.
        #[arg(long)]
        key: Option<String>,
    },
    /// Delete dead-lettered messages for good (they are never published); the later
    /// messages of their keys, parked behind them, go on.
    Discard {
        /// Message ids (repeat, or separate with commas).
        #[arg(long = "id", value_name = "ID", value_delimiter = ',', required = true)]
        ids: Vec<Uuid>,
    },
    /// Delete sent (and, if asked, dead-lettered) messages in one transaction.
    #[command(after_help = TIMES)]
    Purge {
        /// Delete messages sent before this time.
        #[arg(long, value_parser = parse_time, value_name = "TIME", required_unless_present = "dead_before")]
        sent_before: Option<DateTime<Utc>>,
        /// Delete dead-lettered messages dead-lettered before this time.
        #[arg(long, value_parser = parse_time, value_name = "TIME")]
        dead_before: Option<DateTime<Utc>>,
        /// Count what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// With --dead-before: delete without asking. Without it, the command says what it
        /// would delete and asks on a terminal, or deletes nothing.
        #[arg(long, short = 'y', conflicts_with = "dry_run")]
        yes: bool,
        /// Refuse to delete more rows than this: one transaction holds its locks and
        /// writes all its WAL at once. Above it, `outbox retention` deletes in batches.
        #[arg(long, default_value_t = 100_000, value_name = "ROWS")]
        max_rows: u64,
    },
    /// WAL mode: the outbox's replication slot (`status` shows its lag).
    Slot {
        #[command(subcommand)]
        command: SlotCommand,
    },
    /// Check the outbox's health and say what to do: dead letters and the keys they park,
    /// the oldest pending message, consumers whose handler keeps failing, open
    /// transactions holding the relay back, table bloat
    /// and autovacuum, the sequence cache, relays and their partitions, replication
    /// slots. Read-only. Exit status 3 when something needs action.
    Doctor {
        /// The oldest pending message may wait this long.
        #[arg(long, value_parser = parse_age, value_name = "AGE", default_value = "5m")]
        oldest_pending: Duration,
        /// A transaction may hold the outbox's writer lock this long.
        #[arg(long, value_parser = parse_age, value_name = "AGE", default_value = "30s")]
        open_writer: Duration,
        /// A consumer's handler may fail on one message this long.
        #[arg(long, value_parser = parse_age, value_name = "AGE", default_value = "5m")]
        consumer_failing: Duration,
        /// A consumer may have no running instance this long.
        #[arg(long, value_parser = parse_age, value_name = "AGE", default_value = "5m")]
        consumer_gone: Duration,
        /// Dead row versions in the outbox table above this many (and above a fifth of
        /// the live rows) need a vacuum.
        #[arg(long, value_name = "ROWS", default_value_t = 100_000)]
        dead_rows: i64,
        /// A replication slot may keep this many MiB of WAL.
        #[arg(long, value_name = "MIB", default_value_t = 1024)]
        slot_wal_mib: u64,
        /// The partition count the relays should run with (`RelayBuilder::partitions`).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
        partitions: Option<u16>,
    },
    /// Serve a dashboard (status, throughput, dead letters grouped by error, the keys they
    /// park; release, discard, replay) and its JSON API, until Ctrl-C. Binds to
    /// 127.0.0.1 unless told otherwise; actions need the token.
    Serve {
        /// The address to listen on (port 0: any free port; the first line printed says
        /// which).
        #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
        listen: std::net::SocketAddr,
        /// The token actions need (`Authorization: Bearer <token>`), at least 16
        /// characters. Without it the dashboard is read-only. Prefer the environment
        /// variable: a command line is visible to other users of the machine.
        #[arg(
            long,
            env = "OUTBOX_TOKEN",
            hide_env_values = true,
            value_name = "TOKEN"
        )]
        token: Option<Token>,
        /// Another host name the dashboard answers to, on any port (behind a proxy: the
        /// name the browser uses). Besides these it answers IP addresses and
        /// `localhost`; requests for any other `Host` are refused (DNS rebinding).
        #[arg(long = "allowed-host", value_name = "HOST")]
        allowed_hosts: Vec<String>,
    },
    /// Convert the outbox table to the time-partitioned layout (PostgreSQL,
    /// docs/partitions.md): retention then drops old partitions whole instead of deleting
    /// rows. Copies the table under an exclusive lock (writers and relays wait): try it
    /// on a copy first, and run it at a quiet time.
    Partition {
        /// One partition per `hour` or per `day` (UTC).
        #[arg(long, value_name = "INTERVAL")]
        interval: Interval,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Run a relay: publish the outbox's messages to a broker until SIGTERM or Ctrl-C,
    /// serving /metrics (Prometheus), /healthz and /readyz. Options win over the
    /// environment, which wins over the TOML file of --config (docs/relay.md, "The relay
    /// as a process"). Several such processes share one outbox (partitions; WAL mode
    /// stands by).
    Relay(Box<RelayArgs>),
    /// Run retention once: delete old sent messages and processed ids in small batches.
    Retention {
        /// Delete messages sent longer ago than this age.
        #[arg(long, value_parser = parse_age, value_name = "AGE", default_value = "7d", conflicts_with = "keep_sent")]
        sent_older_than: Duration,
        /// Delete processed-message ids older than this age.
        #[arg(long, value_parser = parse_age, value_name = "AGE", default_value = "30d", conflicts_with = "keep_processed")]
        processed_older_than: Duration,
        /// Keep all sent messages.
        #[arg(long)]
        keep_sent: bool,
        /// Keep all processed-message ids.
        #[arg(long)]
        keep_processed: bool,
        /// Rows per DELETE statement.
        #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
    },
}

/// `outbox relay`: each setting also in the TOML file (`--config`), under the same name
/// with `_` for `-`; the broker's client settings only there and in --broker-setting.
/// (Its `Debug` shows no address or setting value: they may hold passwords.)
#[derive(Args)]
#[command(after_help = "Durations: 500ms, 90s, 15m, 12h, 7d.")]
pub struct RelayArgs {
    /// A TOML file with the relay's settings (docs/relay.md shows one).
    #[arg(long, env = "OUTBOX_RELAY_CONFIG", value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// The broker.
    #[arg(long, env = "OUTBOX_BROKER", value_name = "BROKER")]
    pub broker: Option<crate::settings::BrokerKind>,
    /// The broker's address: Kafka's bootstrap servers (host:port,...), nats://host:4222,
    /// amqp://user:password@host:5672/vhost (amqps:// for TLS). Prefer the environment
    /// variable when it holds a password.
    #[arg(
        long,
        env = "OUTBOX_BROKER_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub broker_url: Option<String>,
    /// A client setting of the broker, `name=value` (Kafka: librdkafka's properties, such
    /// as security.protocol=SASL_SSL; RabbitMQ: tls_ca_file=PATH). Repeat it for more.
    #[arg(long = "broker-setting", value_name = "NAME=VALUE")]
    pub broker_settings: Vec<String>,
    /// A destination to check at start (the topic, subject or exchange must exist).
    /// Repeat it for more; without any, the first message to a missing one fails then.
    #[arg(long = "destination", value_name = "DESTINATION")]
    pub destinations: Vec<String>,
    /// Where /metrics, /healthz and /readyz are served (port 0: any free port; the first
    /// line printed says which). Default 127.0.0.1:9464; in a container, 0.0.0.0:9464.
    #[arg(long, env = "OUTBOX_RELAY_LISTEN", value_name = "ADDR")]
    pub listen: Option<std::net::SocketAddr>,
    /// Messages claimed and published per batch.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", value_name = "N")]
    pub batch_size: Option<usize>,
    /// Attempts of a failing message before it is dead-lettered.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", value_name = "N")]
    pub max_attempts: Option<i32>,
    /// How often an idle relay looks for work it was not woken for.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", value_parser = parse_duration, value_name = "DURATION")]
    pub poll_interval: Option<Duration>,
    /// Partitions of the outbox, shared by the relays running on it (table mode; every
    /// relay of one outbox must use the same number).
    #[arg(long, env = "OUTBOX_PARTITIONS", value_name = "N")]
    pub partitions: Option<u16>,
    /// Publish CloudEvents with this `source` (a URI reference, such as /orders-service).
    #[arg(long, env = "OUTBOX_CLOUDEVENTS_SOURCE", value_name = "URI")]
    pub cloudevents_source: Option<String>,
    /// Relay these outbox tables (tenants; PostgreSQL) instead of --table. Repeat it.
    #[arg(long = "tenant", value_name = "TABLE")]
    pub tenants: Vec<String>,
    /// Relay the outbox tables this query returns, one per row (tenants; PostgreSQL; run
    /// again every minute). --tenant wins over it.
    #[arg(long, env = "OUTBOX_TENANTS_QUERY", value_name = "SQL")]
    pub tenants_query: Option<String>,
    /// How logs are written on standard error: text, or json (one object per line).
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<crate::settings::LogFormat>,
    /// How long the relay has, after SIGTERM or Ctrl-C, to publish and record what it
    /// holds before it exits anyway (status 1; what it had not recorded is published again
    /// by the next relay). Default 45s (above the relay's own bound).
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    pub shutdown_timeout: Option<Duration>,
    /// All of the above merged with the file's (`relay::prepare`).
    #[arg(skip)]
    pub settings: crate::settings::Settings,
}

impl std::fmt::Debug for RelayArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayArgs")
            .field("config", &self.config)
            .field("broker", &self.broker)
            .field(
                "broker_url",
                &self.broker_url.as_ref().map(|_| "<redacted>"),
            )
            .field("broker_settings", &self.broker_settings.len())
            .field("listen", &self.listen)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// `outbox partition --interval`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Interval {
    /// One partition per hour.
    Hour,
    /// One partition per day.
    Day,
}

#[derive(Debug, Subcommand)]
pub enum SlotCommand {
    /// Drop the slot and its publication, for an outbox you retire: a slot nobody reads
    /// keeps WAL on the server forever. The events it still holds are lost with it.
    /// Refused while a relay streams from it.
    Drop {
        /// Drop without asking. Without it, the command shows the slot's state and asks
        /// on a terminal, or drops nothing.
        #[arg(long, short = 'y')]
        yes: bool,
    },
}

/// The dashboard's token: never in `Debug` output.
#[derive(Clone)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl std::str::FromStr for Token {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(Token(s.to_owned()))
    }
}

/// Filters shared by `pending` and `dead`.
#[derive(Debug, Args)]
#[command(after_help = TIMES)]
pub struct Filter {
    /// Only this destination.
    #[arg(long)]
    pub destination: Option<String>,
    /// Only this event type.
    #[arg(long = "type")]
    pub event_type: Option<String>,
    /// Only this partition key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only messages created at or after this time.
    #[arg(long, value_parser = parse_time, value_name = "TIME")]
    pub since: Option<DateTime<Utc>>,
    /// Only messages created before this time.
    #[arg(long, value_parser = parse_time, value_name = "TIME")]
    pub until: Option<DateTime<Utc>>,
    /// At most this many.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
}
