//! The errors of `outbox-kafka`.

use rdkafka::error::KafkaError;

/// What can go wrong when starting or running the Kafka publisher or consumer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// librdkafka refused the configuration (an unknown property, a bad value). The text
    /// is librdkafka's, with the values of secret settings replaced by `***` (librdkafka
    /// quotes the offending value, password or not).
    #[error("invalid Kafka client configuration: {0}; check the settings passed with `.set(..)`")]
    Config(String),

    /// The cluster could not be asked which topics exist.
    #[error(
        "cannot read the topic list from the Kafka cluster at {brokers}{}; {}",
        reason.as_deref().map(|r| format!(" (librdkafka: {r})")).unwrap_or_default(),
        metadata_hint(reason.as_deref())
    )]
    Metadata {
        /// `bootstrap.servers`.
        brokers: String,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
        /// Why, as librdkafka reported it meanwhile (a failed TLS handshake, a refused
        /// SASL authentication: the request's own error says only that the transport
        /// failed), with secret settings' values masked.
        reason: Option<Box<str>>,
    },

    /// Destinations that the publisher must serve have no topic.
    #[error(
        "Kafka topic(s) {} do not exist on the cluster at {brokers}; create them (or build the publisher with \
         `.create_missing_topics(partitions, replication)`)",
        topics.iter().map(|t| format!("`{t}`")).collect::<Vec<_>>().join(", ")
    )]
    MissingTopics {
        /// The missing topics, sorted.
        topics: Vec<String>,
        /// `bootstrap.servers`.
        brokers: String,
    },

    /// Topics a consumer subscribes to, or its dead-letter topic, do not exist.
    #[error(
        "Kafka topic(s) {} do not exist on the cluster at {brokers}; create them (the relay's publisher does \
         with `.create_missing_topics(..)`), or build the consumer with `build_unchecked()` to wait for them",
        topics.iter().map(|t| format!("`{t}`")).collect::<Vec<_>>().join(", ")
    )]
    NoSuchTopics {
        /// The missing topics, sorted.
        topics: Vec<String>,
        /// `bootstrap.servers`.
        brokers: String,
    },

    /// Creating a topic failed. The broker's or librdkafka's error is the
    /// [`source`](std::error::Error::source): print the chain with
    /// `outbox_core::ErrorChain` (or `{:#}`).
    #[error(
        "could not create Kafka topic `{topic}`; create it yourself, or check that the client may (its ACLs)"
    )]
    #[non_exhaustive]
    CreateTopic {
        /// The topic.
        topic: String,
        /// The broker's or client's error, as text.
        #[deprecated(
            since = "0.2.0",
            note = "the broker's or client's error is the error's `source()`"
        )]
        reason: String,
        /// The broker's or client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The consumer transport was built without topics.
    #[error("the Kafka consumer has {0}; add them with `.topic(..)`")]
    Incomplete(&'static str),

    /// The consumer could not subscribe, or librdkafka reported a fatal consumer error.
    #[error("the Kafka consumer could not subscribe, or librdkafka reported a fatal error")]
    Consumer(#[source] KafkaError),

    /// The database failed.
    #[error(transparent)]
    Outbox(#[from] outbox_core::Error),
}

impl Error {
    /// [`Error::CreateTopic`] of `topic`.
    #[allow(deprecated)] // `reason`, kept for one release
    pub(crate) fn create_topic(
        topic: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    ) -> Self {
        Error::CreateTopic {
            topic,
            reason: source.to_string(),
            source,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to check when the cluster could not be asked for metadata, after what
/// librdkafka reported.
fn metadata_hint(reason: Option<&str>) -> &'static str {
    match reason {
        Some(r) if r.contains("SSL") => {
            "check `ssl.ca.location` (the CA that signed the brokers' certificates), that the \
             brokers' certificates name the hosts in `bootstrap.servers`, and `security.protocol`"
        }
        Some(r) if r.contains("SASL") || r.contains("uthenticat") => {
            "check `sasl.mechanism`, `sasl.username` and `sasl.password`, and `security.protocol`"
        }
        _ => {
            "check that the brokers are reachable and that `bootstrap.servers` points at them \
             (and `security.protocol`, if they speak TLS or SASL)"
        }
    }
}
