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
        "cannot read the topic list from the Kafka cluster at {brokers}: {source}; check that the brokers are \
         reachable and that `bootstrap.servers` points at them"
    )]
    Metadata {
        /// `bootstrap.servers`.
        brokers: String,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
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

    /// Creating a topic failed.
    #[error("could not create Kafka topic `{topic}`: {reason}")]
    CreateTopic {
        /// The topic.
        topic: String,
        /// The broker's or client's error.
        reason: String,
    },

    /// `.on::<T, _>()` was given a type the event catalog does not know.
    #[error(
        "`{rust_type}` is not in the event catalog, so its event type name is unknown; derive `OutboxEvent` \
         for it, or register the handler with `.on_event_type::<T, _>(\"EventTypeName\", handler)`"
    )]
    NotInCatalog {
        /// The Rust type.
        rust_type: &'static str,
    },

    /// Two handlers were registered for one event type.
    #[error("two handlers registered for event type `{0}`; register one handler per event type")]
    DuplicateHandler(String),

    /// The consumer was built without topics or without handlers.
    #[error("the consumer has {0}; add them with `.topic(..)` and `.on::<T, _>(..)`")]
    Incomplete(&'static str),

    /// The consumer could not subscribe, or librdkafka reported a fatal consumer error.
    #[error("Kafka consumer error: {0}")]
    Consumer(#[source] KafkaError),

    /// A message's event type has no handler and the policy is [`Policy::Stop`](crate::Policy::Stop).
    #[error(
        "no handler for event type `{event_type}` (message {topic}/{partition}@{offset}); the consumer stopped \
         as configured (`on_unknown_event_type(Policy::Stop)`): register a handler, or choose `Policy::Skip`"
    )]
    UnknownEventType {
        /// The event type header's value.
        event_type: String,
        /// Topic of the message.
        topic: String,
        /// Partition of the message.
        partition: i32,
        /// Offset of the message.
        offset: i64,
    },

    /// A message could not be decoded and the policy is [`Policy::Stop`](crate::Policy::Stop).
    #[error(
        "cannot decode message {topic}/{partition}@{offset}: {reason}; the consumer stopped as configured \
         (`on_undecodable(Policy::Stop)`); its offset is not committed, so it is read again after a restart"
    )]
    Undecodable {
        /// Why: a missing header, a bad message id, a payload that does not deserialize.
        reason: String,
        /// Topic of the message.
        topic: String,
        /// Partition of the message.
        partition: i32,
        /// Offset of the message.
        offset: i64,
    },

    /// A handler failed as often as `handler_attempts` allows and the policy is
    /// [`Policy::Stop`](crate::Policy::Stop).
    #[error(
        "the handler of message {id} ({event_type}, {topic}/{partition}@{offset}) failed {attempts} times, \
         last with: {error}; the consumer stopped as configured (`handler_attempts(.., Policy::Stop)`); \
         nothing was recorded and its offset is not committed, so it is read again after a restart"
    )]
    HandlerFailed {
        /// The message id.
        id: uuid::Uuid,
        /// The event type header's value.
        event_type: String,
        /// How many times the handler ran.
        attempts: u32,
        /// The last error.
        error: String,
        /// Topic of the message.
        topic: String,
        /// Partition of the message.
        partition: i32,
        /// Offset of the message.
        offset: i64,
    },

    /// A policy is [`Policy::DeadLetter`](crate::Policy::DeadLetter) but no dead-letter
    /// topic is set.
    #[error(
        "a policy is `Policy::DeadLetter` but the consumer has no dead-letter topic; \
         set one with `.dead_letter_topic(\"<topic>.dlq\")`"
    )]
    NoDeadLetterTopic,

    /// A message could not be written to the dead-letter topic; the consumer stopped
    /// without committing its offset.
    #[error(
        "could not write message {topic}/{partition}@{offset} to the dead-letter topic `{dead_letter_topic}`: \
         {reason}; the consumer stopped and did not commit the message's offset, so it is read again after \
         a restart (check that the topic exists and the consumer may write to it)"
    )]
    DeadLetter {
        /// The dead-letter topic.
        dead_letter_topic: String,
        /// The producer's error.
        reason: String,
        /// Topic of the message.
        topic: String,
        /// Partition of the message.
        partition: i32,
        /// Offset of the message.
        offset: i64,
    },

    /// The database failed.
    #[error(transparent)]
    Outbox(#[from] outbox_core::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
