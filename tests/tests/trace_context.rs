//! Trace context across the outbox (the `opentelemetry` feature of `outbox-core`), read
//! back from an in-memory OpenTelemetry exporter: an event emitted inside a request's
//! span carries its `traceparent`; the relay's publish span and the consumer's handler
//! span link to that trace (links, not parents: delivery may come hours later), and what
//! the handler does is a child of the consumer's span. Through real NATS. The time the
//! message spent in the outbox is recorded in a histogram.

use std::sync::Mutex;
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::{OutboxMessage, Relay};
use outbox_nats::{NatsPublisher, NatsTransport};
use outbox_tests::kafka::Job;
use outbox_tests::nats::{fresh_stream, nats_url};
use outbox_tests::{TestDb, wait_until};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

fn spans(exporter: &InMemorySpanExporter, name: &str) -> Vec<SpanData> {
    exporter
        .get_finished_spans()
        .expect("finished spans")
        .into_iter()
        .filter(|s| s.name == name)
        .collect()
}

/// What this binary's tests read back: the spans and the metrics of the whole process.
struct Installed {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    snapshotter: metrics_util::debugging::Snapshotter,
}

/// Installs the process's one subscriber and one metrics recorder, once, before a test
/// makes its `TestDb` (whose own logging subscriber is installed only when none is):
/// every test of this binary calls it first. (Each test installing its own raced with
/// the other test's `TestDb::new`, and lost 3 times in 30 runs.)
fn installed() -> &'static Installed {
    static INSTALLED: std::sync::OnceLock<Installed> = std::sync::OnceLock::new();
    INSTALLED.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).expect("the only recorder");
        Installed {
            exporter,
            provider,
            snapshotter,
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_emit_through_the_relay_to_the_consumers_handler() {
    let Installed {
        exporter,
        provider,
        snapshotter,
    } = installed();

    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let (_, stream, prefix) = fresh_stream().await;
    let destination = format!("{prefix}.jobs");
    let publisher = NatsPublisher::builder(nats_url())
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await
        .expect("publisher");
    let relay = Relay::builder(outbox.clone(), publisher).spawn();

    // The request: its own trace, inside which the event is emitted.
    let request = tracing::info_span!("place order");
    let request_context = request.context().span().span_context().clone();
    assert!(request_context.is_valid());
    async {
        let mut tx = outbox.begin().await.expect("begin");
        tx.emit_message(
            OutboxMessage::new("Job", destination.as_str(), r#"{"n":1}"#).with_key("a"),
        )
        .expect("emit");
        tx.commit().await.expect("commit");
    }
    .instrument(request)
    .await;

    let headers_seen: std::sync::Arc<Mutex<Vec<String>>> = Default::default();
    let seen = std::sync::Arc::clone(&headers_seen);
    let transport = NatsTransport::builder(nats_url(), &stream, "traced")
        .build()
        .await
        .expect("transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "traced"))
        .on_event_type::<Job, _>("Job", move |_tx, msg| {
            seen.lock()
                .expect("seen")
                .push(msg.headers.get("traceparent").cloned().unwrap_or_default());
            Box::pin(async move {
                async {}
                    .instrument(tracing::info_span!("reserve stock"))
                    .await;
                Ok(())
            })
        })
        .build()
        .expect("consumer")
        .spawn();
    wait_until(
        "the consumer handled the event",
        Duration::from_secs(60),
        || async { consumer.stats().handled >= 1 },
    )
    .await;
    consumer.shutdown().await.expect("consumer");
    relay.shutdown().await;
    provider.force_flush().expect("flush");

    let trace_id = request_context.trace_id();
    let traceparent = headers_seen.lock().expect("seen")[0].clone();
    assert_eq!(
        traceparent,
        format!("00-{trace_id}-{}-01", request_context.span_id()),
        "the message carries the request's trace context"
    );
    let links_to_request = |span: &SpanData| {
        span.links.links.iter().any(|l| {
            l.span_context.trace_id() == trace_id
                && l.span_context.span_id() == request_context.span_id()
        })
    };
    let publish = spans(exporter, "outbox.publish");
    assert!(
        publish.iter().any(links_to_request),
        "a publish span links to the request: {publish:#?}"
    );
    let consume = spans(exporter, "outbox.consume");
    let consume = consume
        .iter()
        .find(|s| links_to_request(s))
        .unwrap_or_else(|| panic!("a consume span links to the request: {consume:#?}"));
    assert_ne!(
        consume.span_context.trace_id(),
        trace_id,
        "a link, not a parent"
    );
    let work = spans(exporter, "reserve stock");
    assert_eq!(work.len(), 1, "{work:#?}");
    assert_eq!(
        work[0].parent_span_id,
        consume.span_context.span_id(),
        "the handler's work is inside the consumer's span"
    );

    let in_outbox: Vec<f64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "outbox_time_in_outbox_seconds")
        .flat_map(|(.., value)| match value {
            metrics_util::debugging::DebugValue::Histogram(values) => {
                values.into_iter().map(|v| v.into_inner()).collect()
            }
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(
        in_outbox.len(),
        1,
        "one message, one observation: {in_outbox:?}"
    );
    assert!(
        in_outbox[0] > 0.0 && in_outbox[0] < 60.0,
        "commit to broker acknowledgement, in seconds: {in_outbox:?}"
    );
    db.cleanup().await;
}

/// An event of this binary for `Outbox::enqueue`.
#[derive(Debug, serde::Serialize, outbox_core::OutboxEvent)]
#[outbox(destination = "traced")]
struct Enqueued {
    n: i32,
}

/// `Outbox::enqueue` and `enqueue_messages`, into a transaction the caller owns, carry
/// the trace context as `tx.emit` does (#37: they carried none, so the relay's and the
/// consumer's spans had nothing to link to); a `traceparent` the caller set wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_enqueued_into_the_callers_transaction_carry_the_trace_context() {
    installed();
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let explicit = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let traced = OutboxMessage::new("Job", "traced", r#"{"n":1}"#);
    let kept =
        OutboxMessage::new("Job", "traced", r#"{"n":2}"#).with_header("traceparent", explicit);
    let (traced_id, kept_id) = (traced.id, kept.id);
    let (request, enqueued_id) = async {
        let request = tracing::info_span!("place order");
        let context = request.context().span().span_context().clone();
        let enqueued = async {
            let mut tx = outbox.pool().begin().await.expect("begin");
            outbox
                .enqueue_messages(&mut tx, &[traced, kept])
                .await
                .expect("enqueue_messages");
            let ids = outbox
                .enqueue(&mut tx, [Enqueued { n: 3 }])
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
            ids[0]
        }
        .instrument(request)
        .await;
        (context, enqueued)
    }
    .await;
    assert!(request.is_valid());

    let rows: Vec<(uuid::Uuid, String)> =
        outbox_core::sqlx::query_as("SELECT id, headers::text FROM outbox")
            .fetch_all(&db.pool)
            .await
            .expect("the rows");
    let traceparent = |id: uuid::Uuid| {
        let (_, headers) = rows
            .iter()
            .find(|(row, _)| *row == id)
            .unwrap_or_else(|| panic!("no row {id}: {rows:?}"));
        let headers: std::collections::BTreeMap<String, String> =
            serde_json::from_str(headers).expect("headers are a JSON object");
        headers.get("traceparent").cloned()
    };
    let request_traceparent = format!("00-{}-{}-01", request.trace_id(), request.span_id());
    assert_eq!(
        traceparent(traced_id).as_deref(),
        Some(request_traceparent.as_str()),
        "enqueue_messages: the request's trace context; the rows: {rows:?}"
    );
    assert_eq!(
        traceparent(enqueued_id).as_deref(),
        Some(request_traceparent.as_str()),
        "enqueue: the request's trace context; the rows: {rows:?}"
    );
    assert_eq!(
        traceparent(kept_id).as_deref(),
        Some(explicit),
        "a traceparent the caller set is kept"
    );
    db.cleanup().await;
}
