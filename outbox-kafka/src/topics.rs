//! Start-up check: every destination has a topic (or gets one, by option).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;

use crate::settings::Settings;
use crate::{Error, Result};

/// How missing topics are created at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CreateTopics {
    pub(crate) partitions: i32,
    pub(crate) replication: i32,
}

/// The topics that exist on the cluster.
pub(crate) async fn existing(
    producer: &Arc<FutureProducer>,
    settings: &Settings,
    timeout: Duration,
) -> Result<BTreeSet<String>> {
    let producer = Arc::clone(producer);
    let brokers = settings.brokers().to_owned();
    // fetch_metadata blocks: keep it off the runtime's threads.
    let fetched =
        tokio::task::spawn_blocking(move || producer.client().fetch_metadata(None, timeout))
            .await
            .unwrap_or(Err(KafkaError::Canceled));
    let metadata = fetched.map_err(|source| Error::Metadata { brokers, source })?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| t.name().to_owned())
        .collect())
}

/// Checks that every topic in `wanted` exists; creates the missing ones if `create` says so.
pub(crate) async fn ensure(
    producer: &Arc<FutureProducer>,
    settings: &Settings,
    wanted: &BTreeSet<String>,
    create: Option<CreateTopics>,
    timeout: Duration,
) -> Result<()> {
    if wanted.is_empty() {
        return Ok(());
    }
    let have = existing(producer, settings, timeout).await?;
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
        .map_err(|e| Error::CreateTopic {
            topic: missing.join(", "),
            reason: e.to_string(),
        })?;
    for result in results {
        match result {
            Ok(topic) => {
                tracing::info!(%topic, partitions = create.partitions, "outbox-kafka: created topic")
            }
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(Error::CreateTopic {
                    topic,
                    reason: code.to_string(),
                });
            }
        }
    }
    Ok(())
}
