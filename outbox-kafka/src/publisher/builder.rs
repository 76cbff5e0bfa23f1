//! [`KafkaPublisherBuilder`]: the producer settings, their defaults, and the start-up
//! check that every destination has a topic.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::publisher::cloudevents::CloudEvents;

use super::producer::{Current, create_producer};
use super::{Inner, KafkaPublisher};
use crate::Result;
use crate::settings::Settings;
use crate::topics::{self, CreateTopics};
/// The default [`delivery_wait`](KafkaPublisherBuilder::delivery_wait).
const DEFAULT_DELIVERY_WAIT: Duration = Duration::from_secs(20);

/// Configures a [`KafkaPublisher`]; start with [`KafkaPublisher::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build`"]
pub struct KafkaPublisherBuilder {
    settings: Settings,
    destinations: BTreeSet<String>,
    check_catalog: bool,
    create: Option<CreateTopics>,
    startup_timeout: Duration,
    delivery_wait: Duration,
    cloudevents: Option<CloudEvents>,
}

impl KafkaPublisher {
    /// A publisher for the cluster at `bootstrap_servers` (`host:port[,host:port...]`).
    ///
    /// Defaults: `enable.idempotence=true`, `acks=all`, `linger.ms=1`,
    /// `message.timeout.ms=0` (never: see [`delivery_wait`](KafkaPublisherBuilder::delivery_wait)),
    /// `compression.type=none`.
    pub fn builder(bootstrap_servers: impl Into<String>) -> KafkaPublisherBuilder {
        let mut settings = Settings::default();
        settings.set("bootstrap.servers", bootstrap_servers);
        KafkaPublisherBuilder {
            settings,
            destinations: BTreeSet::new(),
            check_catalog: true,
            create: None,
            startup_timeout: Duration::from_secs(10),
            delivery_wait: DEFAULT_DELIVERY_WAIT,
            cloudevents: None,
        }
    }
}

impl KafkaPublisherBuilder {
    /// Any librdkafka producer property (SASL, TLS, `client.id`, batching, ...). Wins
    /// over the defaults, `enable.idempotence` and `acks` included: weakening those gives
    /// up the ordering guarantees.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.set(key, value);
        self
    }

    /// How long the producer waits to fill a batch (`linger.ms`).
    pub fn linger(self, linger: Duration) -> Self {
        self.set("linger.ms", linger.as_millis().to_string())
    }

    /// `compression.type`: `none`, `gzip`, `snappy`, `lz4` or `zstd`.
    pub fn compression(self, codec: impl Into<String>) -> Self {
        self.set("compression.type", codec)
    }

    /// How long a batch waits for its delivery reports before it returns (default 20 s).
    ///
    /// A message whose report has not come by then is **not** dropped: it stays queued
    /// in the producer, which delivers it in order when the cluster answers. The batch
    /// reports it as unavailable (no attempt counted), and the relay's retry waits for
    /// that same delivery instead of sending a second copy. A shorter wait makes the
    /// relay notice an outage sooner; it never reorders or drops anything. A batch takes
    /// at most `1.25 ×` this plus 3 s ([`Publisher::max_publish_time`]: 28 s with the
    /// default, below the relay's default `publish_timeout` of 30 s).
    ///
    /// [`Publisher::max_publish_time`]: outbox_core::publisher::Publisher::max_publish_time
    pub fn delivery_wait(mut self, wait: Duration) -> Self {
        self.delivery_wait = wait;
        self
    }

    /// CloudEvents 1.0 binary content mode: every message also carries the `ce_id`,
    /// `ce_source`, `ce_specversion`, `ce_type` and `ce_time` headers (Kafka binding),
    /// with the outbox headers and the payload unchanged
    /// ([`outbox_core::publisher::cloudevents`]).
    pub fn cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    /// Renamed [`delivery_wait`](Self::delivery_wait): it no longer sets librdkafka's
    /// `message.timeout.ms`, whose timed-out messages leave gaps that reorder a key.
    #[deprecated(
        since = "0.2.0",
        note = "use `delivery_wait`: messages no longer time out in librdkafka (a timeout leaves a gap that reorders a key)"
    )]
    pub fn message_timeout(self, timeout: Duration) -> Self {
        self.delivery_wait(timeout)
    }

    /// How long one produce request may take (`request.timeout.ms`).
    pub fn request_timeout(self, timeout: Duration) -> Self {
        self.set("request.timeout.ms", timeout.as_millis().to_string())
    }

    /// Also check (or create) this topic at start-up, besides the catalog's destinations.
    pub fn destination(mut self, topic: impl Into<String>) -> Self {
        self.destinations.insert(topic.into());
        self
    }

    /// Do not check the destinations of the event catalog (`outbox_core::catalog()`) at
    /// start-up; only those given with [`destination`](Self::destination).
    pub fn skip_catalog_check(mut self) -> Self {
        self.check_catalog = false;
        self
    }

    /// Create missing topics at start-up with this many partitions and replicas, instead
    /// of failing: the catalog's destinations and those given with
    /// [`destination`](Self::destination), no other. A message to any other topic that
    /// does not exist fails (retryable, "topic ... does not exist") and creates nothing
    /// (`allow.auto.create.topics=false`; `.set("allow.auto.create.topics", "true")` lets
    /// the broker create whatever a message names, where the broker allows it).
    pub fn create_missing_topics(mut self, partitions: i32, replication: i32) -> Self {
        self.create = Some(CreateTopics {
            partitions,
            replication,
        });
        self
    }

    /// Time allowed for the start-up metadata and topic creation requests. Default 10 s.
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = timeout;
        self
    }

    /// Creates the producer and checks that every destination has a topic: those of the
    /// event catalog (unless [skipped](Self::skip_catalog_check)) and those given with
    /// [`destination`](Self::destination). A missing topic is an
    /// [`Error::MissingTopics`] naming it, unless [created](Self::create_missing_topics).
    ///
    /// [`Error::MissingTopics`]: crate::Error::MissingTopics
    pub async fn build(mut self) -> Result<KafkaPublisher> {
        outbox_core::telemetry::describe(&[super::producer::REBUILDS]);
        self.settings.set_default("enable.idempotence", "true");
        self.settings.set_default("acks", "all");
        // The relay hands over whole batches, so a long linger adds latency without
        // making batches fuller.
        self.settings.set_default("linger.ms", "1");
        check_no_delivery_timeout(&self.settings)?;
        self.settings.set_default("message.timeout.ms", "0");
        // Back within a second of a broker's return (librdkafka's default backs off
        // reconnects up to 10 s).
        self.settings
            .set_default("reconnect.backoff.max.ms", "1000");
        self.settings.set_default("compression.type", "none");
        // Topics are created at start, for the destinations the publisher knows, and only
        // with `create_missing_topics`; librdkafka's producer would otherwise ask the
        // broker to create any topic it is handed (a typo in a destination included).
        self.settings
            .set_default("allow.auto.create.topics", "false");
        let wanted: BTreeSet<String> =
            outbox_core::catalog::destinations_to_check(self.destinations, self.check_catalog)
                .into_iter()
                .collect();
        topics::ensure(&self.settings, &wanted, self.create, self.startup_timeout).await?;
        // After the check: a cluster that does not answer is one error, not also the
        // producer's own reports of brokers down.
        let producer = Arc::new(create_producer(&self.settings)?);
        tracing::info!(settings = ?self.settings, "outbox-kafka publisher ready");
        Ok(KafkaPublisher {
            inner: Arc::new(Inner {
                server: self
                    .settings
                    .get("bootstrap.servers")
                    .and_then(outbox_core::telemetry::server_of),
                settings: self.settings,
                cloudevents: self.cloudevents,
                producer: Mutex::new(Current {
                    generation: 0,
                    producer,
                }),
                rebuilds: AtomicU64::new(0),
                enqueue_timeout: self.delivery_wait / 4,
                delivery_wait: self.delivery_wait,
                pending: Mutex::new(HashMap::new()),
                cluster_up_since: Mutex::new(None),
                probe: Mutex::new(None),
            }),
        })
    }
}

/// Refuses a delivery timeout on the idempotent producer: librdkafka drops a timed-out
/// message while later messages of its partition are still written ("1,2,3,4,5 →
/// written 1,4,5"), and no later re-send puts it back in front of them.
fn check_no_delivery_timeout(settings: &Settings) -> Result<()> {
    let idempotent = settings
        .get("enable.idempotence")
        .is_none_or(|v| v.trim() != "false");
    for key in ["message.timeout.ms", "delivery.timeout.ms"] {
        if let Some(value) = settings.get(key)
            && idempotent
            && value.trim() != "0"
        {
            return Err(crate::Error::Config(format!(
                "{key}={value}: a delivery timeout lets librdkafka drop a message while later \
                     messages of its key are still written, which puts the key out of order in the \
                     topic; remove the setting (the publisher leaves it at 0, never) and bound how \
                     long a batch waits with `.delivery_wait(..)` instead"
            )));
        }
    }
    Ok(())
}
