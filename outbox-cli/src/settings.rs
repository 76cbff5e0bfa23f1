//! What `outbox relay` runs with: its settings once the command line, the environment
//! and the config file are merged (`relay::prepare`), and the choices they name. A leaf:
//! the command line (`cli`) holds them, the relay (`relay`) reads them.

// A build without any broker feature parses the settings and refuses to run.
#![cfg_attr(
    not(any(feature = "kafka", feature = "nats", feature = "rabbitmq")),
    allow(dead_code)
)]

use std::net::SocketAddr;
use std::time::Duration;

use outbox_core::publisher::cloudevents::CloudEvents;

/// `outbox relay --broker`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BrokerKind {
    /// Apache Kafka (and Kafka-protocol brokers).
    Kafka,
    /// NATS JetStream.
    Nats,
    /// RabbitMQ (AMQP 0-9-1).
    Rabbitmq,
}

/// `outbox relay --log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Lines for people.
    #[default]
    Text,
    /// One JSON object per line, for a log collector.
    Json,
}

/// Which outboxes the relay serves.
#[derive(Debug, Clone, Default)]
pub enum Tenancy {
    /// The one outbox of `--table`.
    #[default]
    One,
    /// These tables (PostgreSQL).
    Names(Vec<String>),
    /// The tables this query returns (PostgreSQL).
    Query(String),
}

/// `outbox relay`'s settings, from the command line, the environment and the file.
#[derive(Clone, Default)]
pub struct Settings {
    pub broker: Option<BrokerKind>,
    pub broker_url: String,
    pub broker_settings: Vec<(String, String)>,
    pub destinations: Vec<String>,
    pub listen: Option<SocketAddr>,
    pub batch_size: Option<usize>,
    pub max_attempts: Option<i32>,
    pub poll_interval: Option<Duration>,
    pub partitions: Option<u16>,
    pub cloudevents: Option<CloudEvents>,
    pub tenancy: Tenancy,
    pub log_format: LogFormat,
    pub shutdown_timeout: Duration,
    /// `--json`: the first line (where it serves) as a JSON object.
    pub json: bool,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self
            .broker_settings
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        f.debug_struct("Settings")
            .field("broker", &self.broker)
            .field("broker_settings", &names)
            .field("listen", &self.listen)
            .field("tenancy", &self.tenancy)
            .finish_non_exhaustive()
    }
}
