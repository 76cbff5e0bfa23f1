//! Start-up check: every destination has a topic (or gets one, by option).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;

use crate::settings::Settings;
use crate::{Error, Result};

/// How missing topics are created at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CreateTopics {
    pub(crate) partitions: i32,
    pub(crate) replication: i32,
}

/// A client context that keeps librdkafka's last error report (its error callback, or
/// a log line at warning level or above, which is where a failed TLS handshake shows):
/// a metadata request that fails says only that the transport failed; the report says
/// why (a TLS handshake, a refused SASL authentication).
#[derive(Default)]
struct LastError(Mutex<Vec<String>>);

impl LastError {
    /// Keeps the first few distinct reports, in order; "N/M brokers are down", which
    /// follows every failure and says nothing of its cause, is left out.
    fn keep(&self, reason: &str) {
        // `[thrd:ssl://host:9093/bootstrap]: ssl://host:9093/bootstrap: SSL handshake ...`
        let reason = match reason.strip_prefix("[thrd:") {
            Some(rest) => rest.split_once("]: ").map_or(reason, |(_, r)| r),
            None => reason,
        };
        if reason.contains("brokers are down") {
            return;
        }
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < 3 && !kept.iter().any(|k| k == reason) {
            kept.push(reason.to_owned());
        }
    }

    /// What was kept, joined; `None` if nothing was.
    fn reason(&self) -> Option<String> {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (!kept.is_empty()).then(|| kept.join("; "))
    }
}

/// Its errors and warnings are logged at debug only: they are the reason of the one
/// error `build` returns if the cluster does not answer, and noise if it answers.
impl ClientContext for LastError {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(target: "librdkafka", %error, reason, "librdkafka");
        self.keep(reason);
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        use RDKafkaLogLevel::*;
        match level {
            Emerg | Alert | Critical | Error | Warning => {
                tracing::debug!(target: "librdkafka", "librdkafka: {fac} {log_message}");
                self.keep(log_message);
            }
            Notice | Info => {
                tracing::info!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            Debug => tracing::debug!(target: "librdkafka", "librdkafka: {fac} {log_message}"),
        }
    }
}

/// It never sends: only asks for metadata.
impl ProducerContext for LastError {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

/// The topics that exist on the cluster, asked by a client of its own that keeps what
/// librdkafka reports meanwhile, for the error.
pub(crate) async fn existing(settings: &Settings, timeout: Duration) -> Result<BTreeSet<String>> {
    let brokers = settings.brokers().to_owned();
    let client: BaseProducer<LastError> = settings
        .client_config()
        .create_with_context(LastError::default())
        .map_err(|e| Error::Config(settings.redact(&e.to_string())))?;
    // fetch_metadata blocks, and so does dropping a client: keep both off the runtime's
    // threads.
    let fetched = tokio::task::spawn_blocking(move || {
        let fetched = client.client().fetch_metadata(None, timeout);
        if fetched.is_err() {
            // The error callbacks wait in the client's queue until it is polled.
            client.poll(Duration::ZERO);
        }
        let reason = client.context().reason();
        fetched.map_err(|source| (source, reason))
    })
    .await
    .unwrap_or(Err((KafkaError::Canceled, None)));
    let metadata = fetched.map_err(|(source, reason)| Error::Metadata {
        brokers,
        source,
        reason: reason.map(|r| settings.redact(&r).into()),
    })?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| t.name().to_owned())
        .collect())
}

/// Checks that every topic in `wanted` exists; creates the missing ones if `create` says so.
pub(crate) async fn ensure(
    settings: &Settings,
    wanted: &BTreeSet<String>,
    create: Option<CreateTopics>,
    timeout: Duration,
) -> Result<()> {
    if wanted.is_empty() {
        return Ok(());
    }
    let have = existing(settings, timeout).await?;
    let missing: Vec<String> = wanted.difference(&have).cloned().collect();
    if missing.is_empty() {
        tracing::info!(topics = ?wanted, "outbox-kafka: every destination has a topic");
        return Ok(());
    }
    let Some(create) = create else {
        return Err(Error::MissingTopics {
            topics: missing,
            brokers: settings.brokers().to_owned(),
        });
    };
    let admin: AdminClient<DefaultClientContext> = settings.create()?;
    let new: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                create.partitions,
                TopicReplication::Fixed(create.replication),
            )
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(timeout));
    let results = admin
        .create_topics(&new, &options)
        .await
        .map_err(|e| Error::create_topic(missing.join(", "), Box::new(e)))?;
    for result in results {
        match result {
            Ok(topic) => {
                tracing::info!(%topic, partitions = create.partitions, "outbox-kafka: created topic")
            }
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(Error::create_topic(topic, Box::new(code)));
            }
        }
    }
    Ok(())
}
