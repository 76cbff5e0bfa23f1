//! The metrics the outbox emits through the [`metrics`] facade, each with its kind, unit,
//! labels and help text, and [`describe_metrics`], which hands those descriptions to the
//! installed recorder (a Prometheus exporter prints them as `# HELP` lines; an
//! OpenTelemetry bridge takes the unit).
//!
//! The relay, the consumer and retention call [`describe_metrics`] when they start, so an
//! exporter installed before them describes everything; call it yourself after
//! installing one later. Broker crates describe their own metrics when their publisher
//! or transport is built (`outbox_kafka_producer_rebuilds_total`).
//!
//! Traces: the relay's `outbox.publish` span (`send {destination}` in OpenTelemetry) and
//! the consumer's `outbox.consume` span (`process {destination}`) carry the attributes of
//! the OpenTelemetry messaging semantic conventions; with the `opentelemetry` feature the
//! trace context travels in the message headers through the application's global
//! text-map propagator ([`context_of`] reads it back), with the crate versions
//! [`OPENTELEMETRY_VERSIONS`] names.

use metrics::Unit;

pub use crate::trace::OPENTELEMETRY_VERSIONS;
#[cfg(feature = "opentelemetry")]
pub use crate::trace::context_of;

/// What kind of metric a [`Metric`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// Only goes up (Prometheus `counter`; the name ends in `_total`).
    Counter,
    /// A value that is set (Prometheus `gauge`).
    Gauge,
    /// A distribution of observations (Prometheus `histogram` or `summary`, as the
    /// exporter is set up).
    Histogram,
}

/// One metric the outbox emits.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Metric {
    /// Its name, as the exporter shows it (units are part of it: `_seconds`, `_bytes`).
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// Its unit, for exporters that carry one (`None`: a count of things).
    pub unit: Option<Unit>,
    /// The labels the outbox sets on it, beside those of
    /// [`RelayBuilder::metric_label`](crate::relay::RelayBuilder::metric_label) (a
    /// relay of many outboxes has `tenant` instead of `outbox` and `database`).
    pub labels: &'static [&'static str],
    /// What it measures (the exporter's `# HELP` text).
    pub help: &'static str,
}

impl Metric {
    /// A metric's description (for a crate that emits metrics of its own, e.g. a
    /// publisher: pass it to [`describe`]).
    pub const fn new(
        name: &'static str,
        kind: Kind,
        unit: Option<Unit>,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Metric {
        Metric {
            name,
            kind,
            unit,
            labels,
            help,
        }
    }
}

use Kind::{Counter, Gauge, Histogram};

const SECONDS: Option<Unit> = Some(Unit::Seconds);
const CONSUMER: &[&str] = &["transport", "consumer"];

/// Every metric of outbox-core (docs/operations.md, "What to watch", has the same list
/// with advice on alerts).
pub const METRICS: &[Metric] = &[
    // The relay.
    Metric::new(
        "outbox_published_total",
        Counter,
        None,
        &["outbox", "database", "destination"],
        "Messages the broker acknowledged and the relay marked sent.",
    ),
    Metric::new(
        "outbox_failed_total",
        Counter,
        None,
        &["outbox", "database", "destination"],
        "Failed publish attempts of single messages (each retried until max_attempts).",
    ),
    Metric::new(
        "outbox_dead_lettered_total",
        Counter,
        None,
        &["outbox", "database", "destination"],
        "Messages the relay gave up on (dead-lettered; see `outbox dead`).",
    ),
    Metric::new(
        "outbox_publish_unavailable_total",
        Counter,
        None,
        &["outbox", "database"],
        "Batches the broker did not answer for (unavailable: retried without counting attempts).",
    ),
    Metric::new(
        "outbox_relay_broker_unavailable",
        Gauge,
        None,
        &["outbox", "database"],
        "1 while the relay waits for an unavailable broker, else 0.",
    ),
    Metric::new(
        "outbox_publish_latency_seconds",
        Histogram,
        SECONDS,
        &["outbox", "database"],
        "Time to publish one batch, from the first send to the last acknowledgement.",
    ),
    Metric::new(
        "outbox_time_in_outbox_seconds",
        Histogram,
        SECONDS,
        &["outbox", "database", "destination"],
        "Per message, from its created_at (the emitting transaction) to the broker's acknowledgement.",
    ),
    Metric::new(
        "outbox_pending",
        Gauge,
        None,
        &["outbox", "database"],
        "Pending messages (in retry included), refreshed every poll interval.",
    ),
    Metric::new(
        "outbox_oldest_pending_age_seconds",
        Gauge,
        SECONDS,
        &["outbox", "database"],
        "Age of the oldest pending message; the one to alert on.",
    ),
    Metric::new(
        "outbox_relay_reconnects_total",
        Counter,
        None,
        &["outbox", "database"],
        "Database sessions the relay re-established.",
    ),
    Metric::new(
        "outbox_relay_partitions",
        Gauge,
        None,
        &["outbox", "database"],
        "Partitions of the outbox this relay holds.",
    ),
    Metric::new(
        "outbox_relay_horizon_held_seconds",
        Gauge,
        SECONDS,
        &["outbox", "database"],
        "How long an open writer transaction has held the publish horizon back (PostgreSQL table mode).",
    ),
    Metric::new(
        "outbox_wal_unconfirmed_bytes",
        Gauge,
        Some(Unit::Bytes),
        &["outbox", "database"],
        "WAL the relay's replication slot has read and not confirmed yet (PostgreSQL WAL mode).",
    ),
    // Consumers.
    Metric::new(
        "outbox_consumer_handled_total",
        Counter,
        None,
        &["transport"],
        "Messages a consumer's handler processed and recorded in the inbox.",
    ),
    Metric::new(
        "outbox_consumer_duplicates_total",
        Counter,
        None,
        &["transport"],
        "Messages a consumer skipped because the inbox had them already.",
    ),
    Metric::new(
        "outbox_consumer_skipped_total",
        Counter,
        None,
        &["transport"],
        "Messages a consumer skipped by policy (no handler, or undecodable).",
    ),
    Metric::new(
        "outbox_consumer_dead_lettered_total",
        Counter,
        None,
        &["transport"],
        "Messages a consumer dead-lettered.",
    ),
    Metric::new(
        "outbox_consumer_handler_errors_total",
        Counter,
        None,
        CONSUMER,
        "Handler (or inbox database) failures of a consumer; each is retried.",
    ),
    Metric::new(
        "outbox_consumer_failing_messages",
        Gauge,
        None,
        CONSUMER,
        "Messages whose handler is failing now in this process (each holds back its key).",
    ),
    Metric::new(
        "outbox_consumer_lag",
        Gauge,
        None,
        CONSUMER,
        "Messages the broker holds for this consumer instance that it has not handled (NaN while unknown).",
    ),
    // Retention.
    Metric::new(
        "outbox_retention_deleted_total",
        Counter,
        None,
        &["kind"],
        "Rows retention deleted (kind: sent messages or processed ids).",
    ),
    Metric::new(
        "outbox_retention_batch_seconds",
        Histogram,
        SECONDS,
        &[],
        "Time of one retention DELETE batch.",
    ),
    Metric::new(
        "outbox_retention_failures_total",
        Counter,
        None,
        &[],
        "Retention runs that failed (retried at the next interval).",
    ),
];

/// Hands the description of every metric in `metrics` to the installed recorder.
pub fn describe(metrics: &[Metric]) {
    metrics::with_recorder(|recorder| {
        for m in metrics {
            let (name, help) = (m.name.into(), m.help.into());
            match m.kind {
                Kind::Counter => recorder.describe_counter(name, m.unit, help),
                Kind::Gauge => recorder.describe_gauge(name, m.unit, help),
                Kind::Histogram => recorder.describe_histogram(name, m.unit, help),
            }
        }
    });
}

/// Describes every metric of outbox-core ([`METRICS`]) to the installed recorder.
pub fn describe_metrics() {
    describe(METRICS);
}

/// The host and port of a broker's address, for the `server.address` and `server.port`
/// span attributes: `url` is a URL (`amqp://user:secret@host:5672/vhost`,
/// `nats://host:4222`) or a list of `host:port` (Kafka's bootstrap servers, the first
/// taken). What comes before an `@` (credentials) is never part of the answer. `None`
/// when no host is found.
pub fn server_of(url: &str) -> Option<(String, Option<u16>)> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let first = rest.split([',', ' ']).find(|s| !s.is_empty())?;
    // Credentials first, up to the last `@` (a password may hold `/`, `?`, `#`, `:`):
    // at worst a host is misread, never a password shown.
    let first = first.rsplit_once('@').map_or(first, |(_, host)| host);
    let authority = first.split(['/', '?', '#']).next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port))
            if !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!host.contains(':') || host.ends_with(']')) =>
        {
            (host, port.parse().ok())
        }
        _ => (authority, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strings that start like a metric's name and are not one.
    const NOT_METRICS: [&str; 2] = ["outbox_", "outbox_billing_outbox"];

    /// Every metric name in the crate's source is in [`METRICS`], and each once: a
    /// metric added without a description fails here. (A scan of the source text: every
    /// string literal `"outbox_..."` is taken for a metric's name, but those in
    /// `NOT_METRICS`.)
    #[test]
    fn every_emitted_metric_is_described() {
        let emitted = emitted_names(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
        assert!(
            emitted.len() >= 20,
            "the scan finds the metrics: {emitted:?}"
        );
        let described: Vec<&str> = METRICS.iter().map(|m| m.name).collect();
        let missing: Vec<&String> = emitted
            .iter()
            .filter(|n| !described.contains(&n.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "emitted, not in METRICS (or not a metric: add it to NOT_METRICS): {missing:?}"
        );
        let unused: Vec<&&str> = described
            .iter()
            .filter(|n| !emitted.contains(**n))
            .collect();
        assert!(unused.is_empty(), "in METRICS, never emitted: {unused:?}");
        let mut names = described.clone();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), METRICS.len(), "a name listed twice");
        for m in METRICS {
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}: counters, and only they, end in _total",
                m.name
            );
            assert_eq!(
                m.unit == SECONDS,
                m.name.ends_with("_seconds"),
                "{}: the unit is in the name",
                m.name
            );
            assert!(
                !m.help.is_empty() && m.help.ends_with('.'),
                "{}: help",
                m.name
            );
        }
    }

    /// The `"outbox_..."` literals in the `.rs` files below `dir` (this one's aside).
    fn emitted_names(dir: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut dirs = vec![std::path::PathBuf::from(dir)];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("read the source folder") {
                let path = entry.expect("an entry").path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs")
                    && !path.ends_with("telemetry.rs")
                {
                    let text = std::fs::read_to_string(&path).expect("read a source file");
                    names.extend(names_in(&text));
                }
            }
        }
        names
    }

    /// Each `"outbox_[a-z_]*"` in `text` (a whole literal: the quotes on both sides).
    fn names_in(text: &str) -> Vec<String> {
        let mut found = Vec::new();
        for (at, _) in text.match_indices("\"outbox_") {
            let rest = &text[at + 1..];
            let name: &str = rest
                .split(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .next()
                .unwrap_or_default();
            if rest[name.len()..].starts_with('"') && !NOT_METRICS.contains(&name) {
                found.push(name.to_owned());
            }
        }
        found
    }

    #[test]
    fn the_scan_finds_the_names_wherever_they_are_passed() {
        let text = "relay.counter(\"outbox_a_total\").increment(1);\n\
                    metrics::gauge!(\n    \"outbox_b\",\n    \"transport\" => x);\n\
                    self.settle(d, &c, \"outbox_c_total\"); let t = \"outbox_\";";
        assert_eq!(
            names_in(text),
            ["outbox_a_total", "outbox_b", "outbox_c_total"]
        );
    }

    /// Credentials never reach a span: only the host and the port of the first server.
    #[test]
    fn a_servers_host_and_port_without_credentials() {
        let cases = [
            (
                "amqp://user:s3cret@rabbit.example:5671/%2f",
                Some(("rabbit.example", Some(5671))),
            ),
            ("nats://127.0.0.1:4222", Some(("127.0.0.1", Some(4222)))),
            ("tls://u:p@nats.example", Some(("nats.example", None))),
            (
                "broker-1:9092,broker-2:9092",
                Some(("broker-1", Some(9092))),
            ),
            ("amqps://[::1]:5671", Some(("::1", Some(5671)))),
            ("amqp://a:b@c@host?x=1", Some(("host", None))),
            ("amqp://user:pa/ss@host", Some(("host", None))),
            ("user:1234/x@h:5672", Some(("h", Some(5672)))),
            ("nats://u:p?#@h", Some(("h", None))),
            ("", None),
            ("amqp://user:secret@/vhost", None),
        ];
        for (url, expected) in cases {
            let got = server_of(url);
            assert_eq!(
                got.as_ref().map(|(h, p)| (h.as_str(), *p)),
                expected,
                "{url:?}"
            );
            if let Some((host, _)) = got {
                for secret in ["secret", "s3cret", "user", "pa/ss", "1234/x", "p?#"] {
                    assert!(!host.contains(secret), "{url:?}: {host}");
                }
            }
        }
    }
}
