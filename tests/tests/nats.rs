//! `outbox-nats` against the real NATS server with JetStream (`OUTBOX_TEST_NATS_URL`,
//! default `nats://127.0.0.1:4222`). Each test works in a stream and subjects of its own.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;
use outbox_core::publisher::{PublishError, PublishErrorKind, Publisher};
use outbox_core::{OutboxMessage, OutboxRecord, Relay};
use outbox_nats::{Error, NatsPublisher, headers};
use outbox_tests::TestDb;
use outbox_tests::nats::{OwnNats, fresh_stream, fresh_stream_at, nats_url};
use uuid::Uuid;

async fn stored(js: &jetstream::Context, name: &str) -> u64 {
    let mut s = js.get_stream(name).await.expect("stream");
    s.info().await.expect("stream info").state.messages
}

/// What kind of failure each result is (`None`: published).
fn kinds(results: &[Result<(), PublishError>]) -> Vec<Option<PublishErrorKind>> {
    results
        .iter()
        .map(|r| r.as_ref().err().map(|e| e.kind()))
        .collect()
}

fn record(subject: &str, key: &str, n: i32) -> OutboxRecord {
    let mut message =
        OutboxMessage::new("Counted", subject, format!(r#"{{"key":"{key}","n":{n}}}"#))
            .with_key(key)
            .with_header("traceparent", "00-abc-def-01");
    message.event_version = Some(2);
    OutboxRecord::from(message).with_seq(i64::from(n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_to_jetstream_in_key_order_with_ids_for_deduplication() {
    let (js, name, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.orders");
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    for round in 0..4 {
        let mut tx = outbox.begin().await.expect("begin");
        for n in round * 5..round * 5 + 5 {
            for key in ["a", "b", "c"] {
                tx.emit_message(
                    OutboxMessage::new(
                        "Counted",
                        subject.as_str(),
                        format!(r#"{{"key":"{key}","n":{n}}}"#),
                    )
                    .with_key(key),
                )
                .expect("emit");
            }
        }
        tx.commit().await.expect("commit");
    }
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher)
        .batch_size(7)
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(30);
    while stored(&js, &name).await < 60 {
        assert!(
            Instant::now() < deadline,
            "stored {}",
            stored(&js, &name).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.shutdown().await;
    let sent: i64 =
        outbox_core::sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .expect("count sent");
    assert_eq!(sent, 60, "every message marked sent");

    let reader = js
        .get_stream(&name)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config::default())
        .await
        .expect("consumer");
    let mut messages = reader
        .fetch()
        .max_messages(100)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch");
    let mut next: HashMap<String, i64> = HashMap::new();
    let mut seen = 0;
    while let Some(m) = messages.next().await {
        let m = m.expect("message");
        let h = m.headers.clone().expect("headers");
        let get = |k: &str| h.get(k).map(|v| v.as_str().to_owned());
        // (JetStream consumes `Nats-Msg-Id` for deduplication; see the next test.)
        let id = get(headers::MESSAGE_ID).expect("message-id header");
        assert!(Uuid::parse_str(&id).is_ok(), "message-id {id}");
        assert_eq!(get(headers::EVENT_TYPE).as_deref(), Some("Counted"));
        assert_eq!(
            get(headers::CONTENT_TYPE).as_deref(),
            Some("application/json")
        );
        let payload: serde_json::Value = serde_json::from_slice(&m.payload).expect("JSON");
        let key = payload["key"].as_str().expect("key").to_owned();
        assert_eq!(get(headers::PARTITION_KEY).as_deref(), Some(key.as_str()));
        let n = payload["n"].as_i64().expect("n");
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(n, *expected, "key {key} in order");
        *expected += 1;
        seen += 1;
    }
    assert_eq!(seen, 60);
    js.delete_stream(&name).await.expect("delete stream");
    db.cleanup().await;
}

#[tokio::test]
async fn a_message_published_twice_is_stored_once() {
    let (js, name, prefix) = fresh_stream().await;
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    let r = record(&format!("{prefix}.x"), "k", 1);
    for _ in 0..2 {
        // The second time is what the relay does after a crash before its mark.
        let results = publisher.publish(std::slice::from_ref(&r)).await;
        assert!(results[0].is_ok(), "{results:?}");
    }
    assert_eq!(
        stored(&js, &name).await,
        1,
        "JetStream dropped the duplicate"
    );
    js.delete_stream(&name).await.expect("delete stream");
}

#[tokio::test]
async fn a_failure_holds_back_the_rest_of_its_key_only() {
    let (js, name, prefix) = fresh_stream().await;
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .ack_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("publisher");
    let good = format!("{prefix}.x");
    let batch = [
        // No stream captures it: "no responders", which says nothing about the message
        // (retried for as long as it lasts, never dead-lettered for it).
        record("outbox-test-nowhere.x", "k1", 1),
        record(&good, "k1", 2),
        record(&good, "k2", 1),
    ];
    let results = publisher.publish(&batch).await;
    let kinds = kinds(&results);
    assert_eq!(
        kinds,
        vec![
            Some(PublishErrorKind::Unavailable),
            Some(PublishErrorKind::NotAttempted),
            None
        ],
        "{results:?}"
    );
    assert_eq!(stored(&js, &name).await, 1, "only k2 was stored");
    js.delete_stream(&name).await.expect("delete stream");
}

#[tokio::test]
async fn a_destination_without_a_stream_is_refused_at_start_up() {
    let missing = format!("outbox-test-missing-{}.orders", Uuid::now_v7().simple());
    match NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&missing)
        .build()
        .await
    {
        Err(e @ Error::MissingStreams { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(&missing) && text.contains("nats stream add"),
                "{text}"
            );
        }
        Err(e) => panic!("expected MissingStreams, got {e}"),
        Ok(_) => panic!("expected MissingStreams, got a publisher"),
    }
    match NatsPublisher::builder("nats://127.0.0.1:1").build().await {
        Err(e @ Error::Connect { .. }) => {
            assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
            outbox_tests::assert_source_shown_once(&e);
        }
        Err(e) => panic!("expected Connect, got {e}"),
        Ok(_) => panic!("expected Connect, got a publisher"),
    }
}

/// Messages the server would choke on are refused before they are sent, as permanent
/// failures (dead-lettered at once), and the connection keeps working for the others: one
/// over the server's `max_payload` (the server would close the connection, dropping every
/// acknowledgement in flight), a header value with a line break (it could forge a
/// `Nats-Msg-Id` and have the message dropped as a duplicate), a `Nats-*` row header
/// (a command to JetStream).
#[tokio::test]
async fn bad_messages_are_refused_before_they_are_sent() {
    let (js, name, prefix) = fresh_stream().await;
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    let subject = format!("{prefix}.x");
    let mut too_large = record(&subject, "big", 1);
    too_large.payload = format!(r#"{{"filler":"{}"}}"#, "x".repeat(2 * 1024 * 1024)).into();
    let mut forged = record(&subject, "forged", 1);
    forged
        .headers
        .insert("note".to_owned(), "a\r\nNats-Msg-Id: fixed".to_owned());
    let mut command = record(&subject, "command", 1);
    command
        .headers
        .insert("Nats-Rollup".to_owned(), "all".to_owned());
    let fine = record(&subject, "fine", 1);
    let results = publisher.publish(&[too_large, forged, command, fine]).await;
    let kinds = kinds(&results);
    assert_eq!(
        kinds,
        vec![
            Some(PublishErrorKind::Permanent),
            Some(PublishErrorKind::Permanent),
            Some(PublishErrorKind::Permanent),
            None
        ],
        "{results:?}"
    );
    let text = |i: usize| {
        results[i]
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default()
    };
    assert!(text(0).contains("max_payload"), "{}", text(0));
    assert!(
        text(1).contains("line break") || text(1).contains("not a valid"),
        "{}",
        text(1)
    );
    assert!(text(2).contains("Nats-Rollup"), "{}", text(2));
    // The connection survived: the next batch goes through.
    let after = publisher.publish(&[record(&subject, "after", 1)]).await;
    assert!(after[0].is_ok(), "{after:?}");
    assert_eq!(
        stored(&js, &name).await,
        2,
        "only the fine messages were stored"
    );
    js.delete_stream(&name).await.expect("delete stream");
}

/// CI once failed on a brand-new NATS server: its store folder did not exist yet, and
/// test streams created and deleted in parallel raced on creating it (JetStream 10049,
/// "error creating store for stream"). The test streams must work on such a server.
/// (With file-backed test streams this failed here in about one run in five.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_streams_can_be_created_in_parallel_on_a_brand_new_server() {
    for _ in 0..4 {
        let server = OwnNats::start(None);
        let url = server.url();
        let started = Instant::now();
        let made = futures_util::future::join_all((0..16).map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    let (js, name, _) = fresh_stream_at(&url).await;
                    js.delete_stream(&name).await.expect("delete stream");
                }
            })
        }))
        .await;
        for result in made {
            if let Err(e) = result {
                // Dropped while panicking, the server prints its log.
                eprintln!(
                    "a task failed {:?} after the server on {url} started",
                    started.elapsed()
                );
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }
}

/// async-nats writes the subject into the protocol line unchecked. A CR LF in a
/// destination injected a `PUB` of another subject (stored by the server, and the row
/// marked sent); a space made the server drop the connection on every attempt, holding
/// back every other key for the ack timeout. Both are now refused before anything is
/// sent, as permanent failures, and the other messages go out at once.
#[tokio::test]
async fn destinations_that_are_no_subject_are_refused_before_they_are_sent() {
    let (js, name, prefix) = fresh_stream().await;
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .ack_timeout(Duration::from_secs(30))
        .build()
        .await
        .expect("publisher");
    let injected = record(
        &format!("{prefix}.x\r\nPUB {prefix}.injected 2\r\nhi"),
        "a",
        1,
    );
    let spaced = record(&format!("{prefix}.x y"), "b", 1);
    let wildcard = record(&format!("{prefix}.*"), "c", 1);
    let fine = record(&format!("{prefix}.x"), "d", 1);
    let started = Instant::now();
    let results = publisher.publish(&[injected, spaced, wildcard, fine]).await;
    let kinds = kinds(&results);
    assert_eq!(
        kinds,
        vec![
            Some(PublishErrorKind::Permanent),
            Some(PublishErrorKind::Permanent),
            Some(PublishErrorKind::Permanent),
            None
        ],
        "{results:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "no ack timeout was waited for"
    );
    assert_eq!(
        stored(&js, &name).await,
        1,
        "only the fine message was stored"
    );
    js.delete_stream(&name).await.expect("delete stream");
}

/// No message starts after `batch_budget`, and each waits at most `ack_timeout`: a
/// batch takes at most their sum (25 s with the defaults, below the relay's 30 s).
#[tokio::test]
async fn the_publishers_time_bound_is_its_budget_plus_one_ack_timeout() {
    let defaults = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .build()
        .await
        .expect("publisher");
    assert_eq!(defaults.max_publish_time(), Some(Duration::from_secs(25)));
    let custom = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .batch_budget(Duration::from_secs(3))
        .ack_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect("publisher");
    assert_eq!(custom.max_publish_time(), Some(Duration::from_secs(5)));
}

/// A consumer whose dead letters would land in what it reads would handle them again,
/// fail again and write them again, for ever: refused at build, with what to do.
#[tokio::test]
async fn a_consumer_that_would_read_its_own_dead_letters_is_refused() {
    let (js, stream, prefix) = fresh_stream().await;
    let (events, dead) = (format!("{prefix}.jobs"), format!("{prefix}.dlq"));
    let err = outbox_nats::NatsTransport::builder(nats_url(), &stream, "reads-all")
        .dead_letter_subject(&dead)
        .build()
        .await
        .expect_err("the dead letters are in its stream, unfiltered");
    assert!(matches!(err, Error::Consumer { .. }), "{err:?}");
    assert!(err.to_string().contains(".filter_subject("), "{err}");
    // Our own finding: no client error behind it.
    assert!(std::error::Error::source(&err).is_none(), "{err:?}");
    // A stream that does not exist: what to do in the message, the client's error as
    // its source (before: both in one string).
    let err = outbox_nats::NatsTransport::builder(nats_url(), format!("{stream}_NONE"), "reader")
        .build()
        .await
        .expect_err("no such stream");
    assert!(matches!(err, Error::Consumer { .. }), "{err:?}");
    assert!(err.to_string().contains("create it first"), "{err}");
    outbox_tests::assert_source_shown_once(&err);
    for filter in [events.as_str(), &format!("{prefix}.*")] {
        let built = outbox_nats::NatsTransport::builder(nats_url(), &stream, "filtered")
            .filter_subject(filter)
            .dead_letter_subject(&dead)
            .build()
            .await;
        if filter == events {
            assert!(built.is_ok(), "{:?}", built.err());
        } else {
            assert!(built.is_err(), "{filter} also reads {dead}");
        }
    }
    let _ = js.delete_stream(&stream).await;
}

/// `deliver_policy(New)`: a durable created after messages were stored reads only what
/// comes after it (the default, `All`, reads the stream from the start). A durable that
/// exists keeps its policy: asking another one is refused at build, with the server's
/// reason. (#36: where a new consumer starts, and how to start from the latest.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_durable_with_deliver_policy_new_reads_only_what_comes_after_it() {
    let (js, stream, prefix) = fresh_stream().await;
    let subject = format!("{prefix}.jobs");
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&subject)
        .build()
        .await
        .expect("publisher");
    let store = |numbers: std::ops::Range<i32>| {
        let records: Vec<OutboxRecord> = numbers
            .map(|n| outbox_tests::kafka::job(&subject, n))
            .collect();
        let publisher = &publisher;
        async move {
            let results = publisher.publish(&records).await;
            assert!(results.iter().all(Result::is_ok), "stored: {results:?}");
        }
    };
    store(0..3).await;
    let transport = outbox_nats::NatsTransport::builder(nats_url(), &stream, "from-now")
        .deliver_policy(outbox_nats::DeliverPolicy::New)
        .build()
        .await
        .expect("a durable that starts from new messages");
    store(3..5).await;
    let seen = outbox_tests::consumers::handle_jobs(
        transport,
        &outbox,
        "from-now",
        2,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        seen,
        [3, 4],
        "only what was stored after the durable was created"
    );

    let err = outbox_nats::NatsTransport::builder(nats_url(), &stream, "from-now")
        .deliver_policy(outbox_nats::DeliverPolicy::All)
        .build()
        .await
        .expect_err("an existing durable's policy cannot change");
    assert!(matches!(err, Error::Consumer { .. }), "{err:?}");
    let _ = js.delete_stream(&stream).await;
    db.cleanup().await;
}
