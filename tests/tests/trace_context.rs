//! Trace context across the outbox (the `opentelemetry` feature of `outbox-core`), read
//! back from an in-memory OpenTelemetry exporter. One trace runs from an HTTP request
//! (its caller's `traceparent` and `baggage`, read by the service with the global
//! propagator) through `emit`, the relay's `send {destination}` span and the consumer's
//! `process {destination}` span, with the messaging semantic conventions' attributes:
//! the relay's and the consumer's spans link to the request's span (links, not parents:
//! delivery may come hours later), and what the handler does is a child of `process`.
//! Through real NATS. The propagator is the application's (W3C with baggage, B3 through
//! Zipkin's own crate, none: W3C); a span outbox cannot read is reported once. The time
//! the message spent in the outbox is recorded in a histogram.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::baggage::BaggageExt;
use opentelemetry::propagation::TextMapCompositePropagator;
use opentelemetry::trace::{SpanKind, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::telemetry::{OPENTELEMETRY_VERSIONS, context_of, server_of};
use outbox_core::{Outbox, OutboxMessage, Relay};
use outbox_nats::{NatsPublisher, NatsTransport};
use outbox_tests::kafka::Job;
use outbox_tests::nats::{fresh_stream, nats_url};
use outbox_tests::{TestDb, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::Instrument;
use tracing::instrument::WithSubscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// The global propagator is the process's: one test at a time sets and uses it.
static PROPAGATOR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// The value of a span's attribute, as text.
fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

/// What the handler saw of a message: its headers, and the `tenant` baggage entry
/// `context_of` read from them.
type Handled = (BTreeMap<String, String>, Option<String>);

/// The service's `POST /orders`: the request's span has the caller's context as its
/// parent (read with the global propagator, as an application's HTTP middleware does),
/// and the order's event is emitted inside it.
async fn place_order(
    axum::extract::State((outbox, destination)): axum::extract::State<(Outbox, String)>,
    headers: axum::http::HeaderMap,
) -> axum::http::StatusCode {
    let caller = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&opentelemetry_http::HeaderExtractor(&headers))
    });
    let span = tracing::info_span!(
        "POST /orders",
        otel.kind = "server",
        http.request.method = "POST",
        http.route = "/orders"
    );
    span.set_parent(caller).expect("the caller's context");
    async move {
        let mut tx = outbox.begin().await.expect("begin");
        tx.emit_message(
            OutboxMessage::new("Job", destination.as_str(), r#"{"n":1}"#).with_key("a"),
        )
        .expect("emit");
        tx.commit().await.expect("commit");
    }
    .instrument(span)
    .await;
    axum::http::StatusCode::ACCEPTED
}

/// A request from another service: HTTP/1.1 by hand, with its trace context headers.
async fn post(address: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> String {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to the service");
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: {address}\r\ncontent-length: 0\r\nconnection: close\r\n"
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("read the response");
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_an_http_request_through_send_and_process_spans() {
    let Installed {
        exporter,
        provider,
        snapshotter,
    } = installed();
    let _propagator = PROPAGATOR.lock().await;
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));

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

    // The service, and a caller with its own trace and baggage.
    let app = axum::Router::new()
        .route("/orders", axum::routing::post(place_order))
        .with_state((outbox.clone(), destination.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port for the service");
    let address = listener.local_addr().expect("its address");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let (caller_trace, caller_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let response = post(
        address,
        "/orders",
        &[
            (
                "traceparent",
                &format!("00-{caller_trace}-{caller_span}-01"),
            ),
            ("baggage", "tenant=acme"),
        ],
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 202"), "{response}");
    server.abort();

    // What the handler saw: the headers, and the baggage the propagator reads from them.
    let seen: Arc<Mutex<Vec<Handled>>> = Default::default();
    let handled = Arc::clone(&seen);
    let transport = NatsTransport::builder(nats_url(), &stream, "traced")
        .build()
        .await
        .expect("transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "traced"))
        .on_event_type::<Job, _>("Job", move |_tx, msg| {
            let tenant = context_of(&msg.headers)
                .baggage()
                .get("tenant")
                .map(|v| v.to_string());
            handled
                .lock()
                .expect("seen")
                .push((msg.headers.clone(), tenant));
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

    // The request's span: a child of the caller's.
    let request = spans(exporter, "POST /orders")
        .into_iter()
        .find(|s| s.span_context.trace_id().to_string() == caller_trace)
        .unwrap_or_else(|| panic!("the request's span: {:#?}", spans(exporter, "POST /orders")));
    assert_eq!(request.parent_span_id.to_string(), caller_span);
    let request_context = request.span_context.clone();

    let (headers, tenant) = seen.lock().expect("seen")[0].clone();
    assert_eq!(
        headers.get("traceparent").map(String::as_str),
        Some(format!("00-{caller_trace}-{}-01", request_context.span_id()).as_str()),
        "the message carries the request's trace context: {headers:?}"
    );
    assert_eq!(
        headers.get("baggage").map(String::as_str),
        Some("tenant=acme"),
        "and the caller's baggage: {headers:?}"
    );
    assert_eq!(tenant.as_deref(), Some("acme"), "read back by `context_of`");
    let links_to_request = |span: &SpanData| {
        span.links.links.iter().any(|l| {
            l.span_context.trace_id() == request_context.trace_id()
                && l.span_context.span_id() == request_context.span_id()
        })
    };

    let send_name = format!("send {destination}");
    let send = spans(exporter, &send_name);
    let send = send
        .iter()
        .find(|s| links_to_request(s))
        .unwrap_or_else(|| panic!("a `{send_name}` span links to the request: {send:#?}"));
    assert_eq!(send.span_kind, SpanKind::Producer);
    let (host, port) = server_of(&nats_url()).expect("the NATS server's address");
    for (key, value) in [
        ("messaging.system", "nats".to_owned()),
        ("messaging.operation.type", "send".to_owned()),
        ("messaging.destination.name", destination.clone()),
        ("server.address", host),
        ("server.port", port.expect("a port").to_string()),
    ] {
        assert_eq!(
            attribute(send, key).as_deref(),
            Some(value.as_str()),
            "{key} of {send:#?}"
        );
    }
    assert_eq!(attribute(send, "error.type"), None, "nothing failed");
    assert_eq!(
        attribute(send, "messaging.batch.message_count"),
        None,
        "one message is not a batch"
    );

    let process_name = format!("process {destination}");
    let process = spans(exporter, &process_name);
    let process = process
        .iter()
        .find(|s| links_to_request(s))
        .unwrap_or_else(|| panic!("a `{process_name}` span links to the request: {process:#?}"));
    assert_eq!(process.span_kind, SpanKind::Consumer);
    assert_ne!(
        process.span_context.trace_id(),
        request_context.trace_id(),
        "a link, not a parent"
    );
    for (key, value) in [
        ("messaging.system", "nats"),
        ("messaging.operation.type", "process"),
        ("messaging.destination.name", destination.as_str()),
        ("messaging.consumer.group.name", "traced"),
        (
            "messaging.message.id",
            headers.get("message-id").expect("a message id").as_str(),
        ),
    ] {
        assert_eq!(
            attribute(process, key).as_deref(),
            Some(value),
            "{key} of {process:#?}"
        );
    }
    let work = spans(exporter, "reserve stock");
    assert_eq!(work.len(), 1, "{work:#?}");
    assert_eq!(
        work[0].parent_span_id,
        process.span_context.span_id(),
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
/// consumer's spans had nothing to link to); a `traceparent` the caller set wins. With
/// no propagator configured (the no-op one), W3C trace context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_enqueued_into_the_callers_transaction_carry_the_trace_context() {
    installed();
    let _propagator = PROPAGATOR.lock().await;
    opentelemetry::global::set_text_map_propagator(
        opentelemetry::trace::noop::NoopTextMapPropagator::new(),
    );
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

/// The headers of every row, by id.
async fn stored_headers(db: &TestDb) -> BTreeMap<uuid::Uuid, BTreeMap<String, String>> {
    let rows: Vec<(uuid::Uuid, String)> =
        outbox_core::sqlx::query_as("SELECT id, headers::text FROM outbox")
            .fetch_all(&db.pool)
            .await
            .expect("the rows");
    rows.into_iter()
        .map(|(id, headers)| {
            let headers = serde_json::from_str(&headers).expect("headers are a JSON object");
            (id, headers)
        })
        .collect()
}

/// An application that propagates B3 (Zipkin's own propagator, single header) gets B3
/// headers on its messages, not `traceparent`, and `context_of` reads them back as the
/// same span; a `b3` header the caller set is kept as it was. (Before #37 the headers
/// were W3C whatever the application configured.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_applications_propagator_writes_and_reads_the_headers_b3_here() {
    installed();
    let _propagator = PROPAGATOR.lock().await;
    // The OpenTelemetry project's B3 propagator, deprecated with its Zipkin exporter in
    // 0.33 and still the one a Rust application propagating B3 has.
    #[allow(deprecated)]
    let b3 = opentelemetry_zipkin::Propagator::with_encoding(
        opentelemetry_zipkin::B3Encoding::SingleHeader,
    );
    opentelemetry::global::set_text_map_propagator(b3);
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let theirs = "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1";
    let traced = OutboxMessage::new("Job", "traced", r#"{"n":1}"#);
    let kept = OutboxMessage::new("Job", "traced", r#"{"n":2}"#).with_header("b3", theirs);
    // The same through `enqueue_messages` (a transaction the caller owns).
    let enqueued = OutboxMessage::new("Job", "traced", r#"{"n":3}"#);
    let enqueued_kept = OutboxMessage::new("Job", "traced", r#"{"n":4}"#).with_header("b3", theirs);
    let (traced_id, kept_id) = (traced.id, kept.id);
    let (enqueued_id, enqueued_kept_id) = (enqueued.id, enqueued_kept.id);
    let request = tracing::info_span!("place order");
    let context = request.context().span().span_context().clone();
    async {
        let mut tx = outbox.begin().await.expect("begin");
        tx.emit_message(traced).expect("emit");
        tx.emit_message(kept).expect("emit");
        tx.commit().await.expect("commit");
        let mut tx = outbox.pool().begin().await.expect("begin");
        outbox
            .enqueue_messages(&mut tx, &[enqueued, enqueued_kept])
            .await
            .expect("enqueue_messages");
        tx.commit().await.expect("commit");
    }
    .instrument(request)
    .await;

    let rows = stored_headers(&db).await;
    assert_eq!(
        rows[&enqueued_id], rows[&traced_id],
        "enqueue_messages writes what emit writes"
    );
    assert_eq!(
        rows[&enqueued_kept_id].get("b3").map(String::as_str),
        Some(theirs),
        "enqueue_messages keeps the caller's b3: {rows:?}"
    );
    assert_eq!(
        rows[&enqueued_kept_id].len(),
        1,
        "and adds nothing: {rows:?}"
    );
    let traced = &rows[&traced_id];
    assert_eq!(
        traced.get("b3").map(String::as_str),
        Some(format!("{}-{}-1", context.trace_id(), context.span_id()).as_str()),
        "B3, single header: {traced:?}"
    );
    assert!(
        !traced.contains_key("traceparent"),
        "no W3C header: {traced:?}"
    );
    let read = context_of(traced);
    assert_eq!(read.span().span_context().trace_id(), context.trace_id());
    assert_eq!(read.span().span_context().span_id(), context.span_id());
    let kept = &rows[&kept_id];
    assert_eq!(kept.get("b3").map(String::as_str), Some(theirs), "{kept:?}");
    assert!(!kept.contains_key("traceparent"), "{kept:?}");
    assert_eq!(
        context_of(kept)
            .span()
            .span_context()
            .trace_id()
            .to_string(),
        "80f198ee56343ba864fe8b2a57d3eff7"
    );
    db.cleanup().await;
}

/// The warnings a subscriber without an OpenTelemetry layer of outbox's version logs.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().expect("warnings").push(message.0);
        }
    }
}

/// An application whose `tracing-opentelemetry` layer is not of outbox's version (here:
/// none at all) emits inside spans that have no context outbox can read: the first such
/// `emit` says so, once, naming the versions outbox works with, and the messages carry
/// no trace context. (Before #37 nothing was said.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_span_outbox_cannot_read_is_reported_once() {
    installed();
    let _propagator = PROPAGATOR.lock().await;
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let warnings = Warnings::default();
    let subscriber = tracing_subscriber::registry().with(warnings.clone());
    async {
        for n in 0..2 {
            async {
                let mut tx = outbox.begin().await.expect("begin");
                tx.emit_message(OutboxMessage::new(
                    "Job",
                    "traced",
                    format!(r#"{{"n":{n}}}"#),
                ))
                .expect("emit");
                tx.commit().await.expect("commit");
            }
            .instrument(tracing::info_span!("handle request"))
            .await;
        }
    }
    .with_subscriber(subscriber)
    .await;
    let warnings = warnings.0.lock().expect("warnings").clone();
    let about_it: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("tracing-opentelemetry"))
        .collect();
    assert_eq!(about_it.len(), 1, "one warning, once: {warnings:#?}");
    assert!(
        about_it[0].contains(OPENTELEMETRY_VERSIONS) && about_it[0].contains("handle request"),
        "it names the versions and the span: {about_it:?}"
    );
    let rows = stored_headers(&db).await;
    assert_eq!(rows.len(), 2);
    assert!(
        rows.values().all(|h| h.is_empty()),
        "no trace context: {rows:?}"
    );
    db.cleanup().await;
}
