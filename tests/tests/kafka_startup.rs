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
    // rdkafka quotes a refused property's value in its error ("Client config error: No
    // such configuration property: ... sasl.jaas.config <value>"). `sasl.jaas.config` is
    // the Java client's, copied by mistake into librdkafka settings, secret and all. (The
    // test refused `ssl.key.password` before, which only a build without OpenSSL refuses.)
    let err = KafkaPublisher::builder("127.0.0.1:1")
        .skip_catalog_check()
        .set(
            "sasl.jaas.config",
            "org.apache.kafka.common.security.plain.PlainLoginModule required password=\"key-pass-secret\";",
        )
        .build()
        .await
        .expect_err("sasl.jaas.config is no librdkafka property");
    let text = format!("{err} / {err:?}");
    assert!(matches!(err, Error::Config(_)), "{text}");
    assert!(
        text.contains("sasl.jaas.config") && text.contains("***"),
        "{text}"
    );
    assert!(!text.contains("key-pass-secret"), "{text}");
}

/// What a batch may take by the publisher's own timers: a quarter of `delivery_wait`
/// waiting for room in librdkafka's queue, then the wait itself, plus 3 s. With the
/// defaults that is 28 s, below the relay's default 30 s.
#[tokio::test]
async fn the_publishers_time_bound_follows_the_delivery_wait() {
    use outbox_core::publisher::Publisher;
    let brokers = kafka::brokers();
    let topic = kafka::unique("bound");
    kafka::create_topic(&brokers, &topic, 1).await;
    for (wait, bound) in [(None, 28), (Some(4), 8), (Some(40), 53)] {
        let mut builder = KafkaPublisher::builder(&brokers)
            .skip_catalog_check()
            .destination(&topic);
        if let Some(secs) = wait {
            builder = builder.delivery_wait(Duration::from_secs(secs));
        }
        let publisher = builder.build().await.expect("publisher");
        assert_eq!(
            publisher.max_publish_time(),
            Some(Duration::from_secs(bound)),
            "delivery_wait {wait:?} s"
        );
        assert_eq!(
            publisher.settings().get("message.timeout.ms"),
            Some("0"),
            "librdkafka never times a message out"
        );
    }
    kafka::delete_topic(&brokers, &topic).await;
}

/// A delivery timeout on the idempotent producer lets librdkafka drop a message while
/// later ones of its key are written: refused at build, under either of its names,
/// saying what to use instead. Without idempotence (no ordering promise) it is allowed.
#[tokio::test]
async fn a_delivery_timeout_is_refused_because_it_reorders_keys() {
    let brokers = kafka::brokers();
    for key in ["message.timeout.ms", "delivery.timeout.ms"] {
        let err = KafkaPublisher::builder(&brokers)
            .skip_catalog_check()
            .set(key, "8000")
            .build()
            .await
            .expect_err("a delivery timeout is refused");
        let text = err.to_string();
        assert!(
            text.contains(&format!("{key}=8000")) && text.contains("delivery_wait"),
            "{text}"
        );
    }
    KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .set("message.timeout.ms", "0")
        .build()
        .await
        .expect("0 is no timeout");
    KafkaPublisher::builder(&brokers)
        .skip_catalog_check()
        .set("enable.idempotence", "false")
        .set("message.timeout.ms", "8000")
        .build()
        .await
        .expect("without idempotence there is no order to keep");
}
