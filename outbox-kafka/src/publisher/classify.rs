//! Error classification: what a librdkafka error, or a missing delivery report, says
//! about the message and about the producer.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::publisher::PublishError;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer};
use rdkafka::types::RDKafkaErrorCode;

/// Why a message had no delivery report while the rest of its batch did: its topic does
/// not exist (and is not created; a per-message error that counts towards
/// `max_attempts`, named so that `outbox dead` says it), or something the cluster will
/// sort out (unavailable: no attempt counted).
pub(super) async fn straggler(
    producer: &Arc<FutureProducer>,
    topic: &str,
    waited: Duration,
) -> PublishError {
    let (client, name) = (Arc::clone(producer), topic.to_owned());
    let exists = tokio::task::spawn_blocking(move || {
        let metadata = client
            .client()
            .fetch_metadata(Some(&name), Duration::from_secs(2))
            .ok()?;
        // Only "unknown topic" says it does not exist; any other topic error (no leader,
        // not authorized) is not that.
        let unknown = rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART;
        Some(match metadata.topics().iter().find(|t| t.name() == name) {
            None => false,
            Some(topic) => topic.error() != Some(unknown),
        })
    })
    .await
    .ok()
    .flatten();
    match exists {
        Some(false) => PublishError::retryable(format!(
            "kafka: topic {topic} does not exist (and the cluster does not create it): \
             create it, or fix the message's destination"
        )),
        _ => PublishError::unavailable(format!(
            "kafka: no delivery report within {waited:?}, while the rest of the batch was \
             acknowledged; retried"
        )),
    }
}

/// Error codes after which librdkafka's idempotent producer may not recover by itself:
/// its producer id / sequence state no longer matches the broker's, and every later send
/// fails. A timed-out message is among them: once one timed out during an outage, later
/// sends fail with `UnknownProducerId` / `ProducerFenced` on some brokers, and time out
/// forever on others (measured on tansu 0.6, with the broker back up).
pub(super) fn is_stuck(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::MessageTimedOut
            | RDKafkaErrorCode::UnknownProducerId
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
            | RDKafkaErrorCode::OutOfOrderSequenceNumber
            | RDKafkaErrorCode::InvalidProducerIdMapping
            | RDKafkaErrorCode::Fatal
    )
}

/// Permanent: the message itself can never be accepted. Unavailable: the cluster could
/// not be reached or did not answer in time, or the producer lost its state — nothing
/// about the message, so it never counts towards `max_attempts` (an outage dead-letters
/// nothing). Retryable: the rest (a topic that does not exist or may not be written).
pub(super) fn classify(error: &KafkaError) -> (PublishError, Option<RDKafkaErrorCode>) {
    let code = error.rdkafka_error_code();
    let text = match code {
        Some(code) => format!("kafka: {error} ({code:?})"),
        None => format!("kafka: {error}"),
    };
    let permanent = matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::BadMessage
        )
    );
    let unavailable = match code {
        None => true,
        Some(code) => is_stuck(code) || is_unavailable(code),
    };
    let error = if permanent {
        PublishError::permanent(text)
    } else if unavailable {
        PublishError::unavailable(text)
    } else {
        PublishError::retryable(text)
    };
    (error, code)
}

/// The cluster is down, unreachable, busy or moving leaders: retried for as long as it
/// lasts.
fn is_unavailable(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::Resolve
            | RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::QueueFull
            | RDKafkaErrorCode::LeaderNotAvailable
            | RDKafkaErrorCode::NotLeaderForPartition
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::BrokerNotAvailable
            | RDKafkaErrorCode::NetworkException
            | RDKafkaErrorCode::NotEnoughReplicas
            | RDKafkaErrorCode::NotEnoughReplicasAfterAppend
            | RDKafkaErrorCode::KafkaStorageError
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            // Purged by us (a replaced producer) or by librdkafka while it resets the
            // idempotent producer's state: nothing about the message.
            | RDKafkaErrorCode::PurgeQueue
            | RDKafkaErrorCode::PurgeInflight
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        let e = |code| KafkaError::MessageProduction(code);
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidTopic,
            RDKafkaErrorCode::InvalidRecord,
        ] {
            assert_eq!(
                classify(&e(code)).0.kind(),
                outbox_core::publisher::PublishErrorKind::Permanent,
                "{code:?}"
            );
        }
        for code in [
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::UnknownTopic,
            RDKafkaErrorCode::TopicAuthorizationFailed,
        ] {
            assert_eq!(
                classify(&e(code)).0.kind(),
                outbox_core::publisher::PublishErrorKind::Retryable,
                "{code:?}"
            );
        }
        // An outage says nothing about the message: never dead-lettered for it.
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::UnknownProducerId,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::PurgeQueue,
            RDKafkaErrorCode::PurgeInflight,
        ] {
            assert_eq!(
                classify(&e(code)).0.kind(),
                outbox_core::publisher::PublishErrorKind::Unavailable,
                "{code:?}"
            );
        }
        assert!(is_stuck(RDKafkaErrorCode::UnknownProducerId));
        assert!(is_stuck(RDKafkaErrorCode::ProducerFenced));
        assert!(is_stuck(RDKafkaErrorCode::MessageTimedOut));
        assert!(!is_stuck(RDKafkaErrorCode::MessageSizeTooLarge));
        assert!(!is_stuck(RDKafkaErrorCode::UnknownTopicOrPartition));
    }
}
