//! The publisher's start-up check against the event catalog, topic creation by option,
//! and settings that never show secrets.

use std::time::Duration;

use outbox_core::OutboxEvent;
use outbox_kafka::{Error, KafkaPublisher};
use outbox_tests::kafka;

/// The only catalog entry of this test binary; its topic is deleted and re-created here.
#[derive(Debug, serde::Serialize, OutboxEvent)]
#[outbox(destination = "outbox-test.startup-catalog")]
struct AuditRecorded {
    what: String,
}

const CATALOG_TOPIC: &str = "outbox-test.startup-catalog";

/// Waits until the cluster's metadata no longer lists the catalog's topic.
async fn topic_gone(brokers: &str) {
    outbox_tests::wait_until(
        "the deleted topic is gone",
        Duration::from_secs(30),
        || async {
            !kafka::topics(brokers)
                .iter()
                .any(|(t, _)| t == CATALOG_TOPIC)
        },
    )
    .await;
}

#[tokio::test]
async fn a_missing_catalog_topic_is_an_error_naming_it_unless_created_by_option() {
    let brokers = kafka::brokers();
    kafka::delete_topic(&brokers, CATALOG_TOPIC).await;
    topic_gone(&brokers).await;
    let extra = kafka::unique("startup-extra");

    let err = KafkaPublisher::builder(&brokers)
        .destination(&extra)
        .build()
        .await
        .expect_err("the catalog's topic is missing");
    match &err {
        Error::MissingTopics { topics, brokers: b } => {
            let mut expected = vec![CATALOG_TOPIC.to_owned(), extra.clone()];
            expected.sort();
            assert_eq!(topics, &expected);
            assert_eq!(b, &brokers);
        }
        other => panic!("expected MissingTopics, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains(&format!("`{CATALOG_TOPIC}`")), "{text}");
    assert!(
        text.contains("create_missing_topics"),
        "the message says what to do: {text}"
    );

    KafkaPublisher::builder(&brokers)
        .destination(&extra)
        .create_missing_topics(3, 1)
        .build()
        .await
        .expect("topics created");
    let topics = kafka::topics(&brokers);
    for t in [CATALOG_TOPIC, extra.as_str()] {
        assert!(
            topics
                .iter()
                .any(|(name, partitions)| name == t && *partitions == 3),
            "{t} with 3 partitions: {topics:?}"
        );
    }
    // Now they exist, the plain check passes.
    KafkaPublisher::builder(&brokers)
        .destination(&extra)
        .build()
        .await
        .expect("every topic exists");
    // Skipping the catalog leaves only the explicit destinations.
    kafka::delete_topic(&brokers, CATALOG_TOPIC).await;
    topic_gone(&brokers).await;
    KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .destination(&extra)
        .build()
        .await
        .expect("the catalog is not checked");
    kafka::delete_topic(&brokers, &extra).await;
    let _ = AuditRecorded {
        what: String::new(),
    }
    .event_type();
}

#[tokio::test]
async fn an_unreachable_cluster_is_a_clear_error() {
    let err = KafkaPublisher::builder("127.0.0.1:1")
        .skip_catalog_check()
        .destination("anything")
        .startup_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect_err("nothing listens on port 1");
    assert!(matches!(err, Error::Metadata { .. }), "{err:?}");
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
}

#[tokio::test]
async fn settings_never_show_secrets() {
    let brokers = kafka::brokers();
    let publisher = KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .set("sasl.username", "svc-outbox")
        .set("sasl.password", "hunter2-secret")
        .build()
        .await
        .expect("publisher (SASL settings are unused without security.protocol)");
    let shown = format!("{publisher:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(
        shown.contains("svc-outbox") && shown.contains("sasl.password"),
        "{shown}"
    );
    assert!(
        shown.contains("\"enable.idempotence\": \"true\"") && shown.contains("\"acks\": \"all\""),
        "{shown}"
    );
}

#[tokio::test]
async fn a_refused_setting_does_not_leak_its_value_in_the_error() {
    // librdkafka quotes a refused property's value in its error. This workspace builds
    // librdkafka without OpenSSL, so it refuses `ssl.key.password` (seen: "... not
    // supported in this build: OpenSSL not available at build time ssl.key.password <value>").
    let err = KafkaPublisher::builder("127.0.0.1:1")
        .skip_catalog_check()
        .set("ssl.key.password", "key-pass-secret")
        .build()
        .await
        .expect_err("ssl.key.password is refused by a build without OpenSSL");
    let text = format!("{err} / {err:?}");
    assert!(matches!(err, Error::Config(_)), "{text}");
    assert!(
        text.contains("ssl.key.password") && text.contains("***"),
        "{text}"
    );
    assert!(!text.contains("key-pass-secret"), "{text}");
}

/// What a batch may take by the publisher's own timers: a quarter of
/// `message.timeout.ms` waiting for room in librdkafka's queue, then the timeout itself,
/// plus 2 s. With the defaults that is 27 s, below the relay's default 30 s.
#[tokio::test]
async fn the_publishers_time_bound_follows_the_message_timeout() {
    use outbox_core::publisher::Publisher;
    let brokers = kafka::brokers();
    let topic = kafka::unique("bound");
    kafka::create_topic(&brokers, &topic, 1).await;
    for (timeout, bound) in [(None, 27), (Some(4), 7), (Some(40), 52)] {
        let mut builder = KafkaPublisher::builder(&brokers)
            .skip_catalog_check()
            .destination(&topic);
        if let Some(secs) = timeout {
            builder = builder.message_timeout(Duration::from_secs(secs));
        }
        let publisher = builder.build().await.expect("publisher");
        assert_eq!(
            publisher.max_publish_time(),
            Some(Duration::from_secs(bound)),
            "message.timeout.ms {timeout:?} s"
        );
    }
    // librdkafka's other name for the setting counts; 0 (never time out) has no bound.
    for (key, value, bound) in [
        ("delivery.timeout.ms", "8000", Some(Duration::from_secs(12))),
        ("message.timeout.ms", "0", None),
    ] {
        let publisher = KafkaPublisher::builder(&brokers)
            .skip_catalog_check()
            .destination(&topic)
            .set(key, value)
            .build()
            .await
            .expect("publisher");
        assert_eq!(publisher.max_publish_time(), bound, "{key}={value}");
    }
    kafka::delete_topic(&brokers, &topic).await;
}
