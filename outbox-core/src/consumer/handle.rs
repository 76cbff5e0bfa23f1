//! One message: decode its headers, run its handler in the inbox transaction with
//! retries, apply a policy when it cannot be handled, and acknowledge it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::watch;
use tracing::Instrument;
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::inbox::{Inbox, InboxError, Processed};
use crate::model::Failure;
use crate::publisher::cloudevents::{self, split_type};
use crate::publisher::headers;
use crate::store::Backend;
use crate::store::ops::ConsumerRows;
use crate::task::stopped;

use super::dispatch::Dispatch;
use super::{ConsumerStats, Delivery, Error, Policy, Received, Transport};

/// What the consumer holds, shared by the receiving task and the handling ones.
pub(super) struct Shared<T: Transport, DB: Backend> {
    pub(super) transport: T,
    pub(super) inbox: Inbox<DB>,
    pub(super) handlers: HashMap<String, Arc<dyn Dispatch<DB>>>,
    pub(super) unknown: Policy,
    pub(super) undecodable: Policy,
    pub(super) retry_backoff: Backoff,
    pub(super) handler_attempts: Option<(u32, Policy)>,
    /// How long without progress before a warning (see `ConsumerBuilder::stall_warning`).
    pub(super) stall_warning: Duration,
    pub(super) stats: Arc<ConsumerStats>,
    /// Messages whose handler is failing now (the `outbox_consumer_failing_messages`
    /// gauge).
    pub(super) failing: AtomicI64,
    /// How often the consumer writes its heartbeat row (see
    /// `ConsumerBuilder::heartbeat`).
    pub(super) heartbeat: Duration,
}

/// How handling a message ended, when it did not stop the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Handled or disposed of, and acknowledged.
    Done,
    /// Shutdown was asked while the message was in hand; it was not acknowledged.
    Interrupted,
}

/// What went wrong with a message, in words that do not depend on the policy applied
/// (for logs and the `dlq-reason` header), at most 4 KiB.
pub(super) fn short_reason(error: &Error) -> String {
    let mut text = match error {
        Error::UnknownEventType { event_type, .. } => {
            format!("no handler for event type `{event_type}`")
        }
        Error::Undecodable { reason, .. } => format!("cannot decode the message: {reason}"),
        Error::HandlerFailed {
            attempts, error, ..
        } => format!("the handler failed {attempts} times, last with: {error}"),
        other => other.to_string(),
    };
    if text.len() > 4096 {
        let mut end = 4096;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

impl<T: Transport, DB: Backend> Shared<T, DB> {
    /// Handles one message; while it is in hand, tells the transport it is being worked
    /// on as often as the transport asks.
    pub(super) async fn handle(
        &self,
        delivery: &Delivery<T::Token>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<Step, Error> {
        let work = self.handle_inner(delivery, &mut shutdown);
        let Some(every) = self.transport.keep_alive() else {
            return work.await;
        };
        tokio::pin!(work);
        // The first renewal half an interval in: a message that waited in its key's lane
        // was renewed at most one interval before it started (by the receive loop), so
        // the broker's timer never runs more than 1.5 intervals (3/4 of `AckWait`), and a
        // quick handler sends nothing extra.
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every / 2, every);
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = tick.tick() => self.transport.working(delivery).await,
            }
        }
    }

    async fn handle_inner(
        &self,
        delivery: &Delivery<T::Token>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Step, Error> {
        let origin = &delivery.origin;
        let undecodable = |reason: String| Error::Undecodable {
            reason,
            origin: origin.clone(),
        };
        let all = &delivery.headers;
        // A structured-mode CloudEvent (`content-type: application/cloudevents+json`):
        // its `data` is the payload; its `id` and `type` stand in for absent headers.
        let structured = match all.get(headers::CONTENT_TYPE) {
            Some(content_type) if cloudevents::is_structured(content_type) => {
                match cloudevents::unwrap(&delivery.payload) {
                    Ok(event) => Some(event),
                    Err(reason) => {
                        let error = undecodable(reason);
                        return self
                            .policy(delivery, self.undecodable, error, shutdown)
                            .await;
                    }
                }
            }
            _ => None,
        };
        // The outbox headers, or a CloudEvent's in binary mode (`<prefix>type`,
        // `<prefix>id`) from a producer that writes only those. A handler registered for
        // the whole CloudEvents type takes it as it is; otherwise `OrderPlaced.v2` is
        // event type `OrderPlaced`, version 2 (as our publishers write it).
        // The first prefix with a `type` header wins (the broker's own, then the ones
        // older publishers wrote).
        let prefix = std::iter::once(T::CLOUDEVENTS_PREFIX)
            .chain(T::CLOUDEVENTS_OTHER_PREFIXES.iter().copied())
            .find(|prefix| all.contains_key(&format!("{prefix}type")))
            .unwrap_or(T::CLOUDEVENTS_PREFIX);
        let (ce_type_header, ce_id_header) = (format!("{prefix}type"), format!("{prefix}id"));
        let structured_type = structured.as_ref().and_then(|e| e.kind.as_ref());
        let (ce_type, ce_version) = match all.get(&ce_type_header).or(structured_type) {
            Some(kind) if self.handlers.contains_key(kind.as_str()) => (Some(kind.clone()), None),
            Some(kind) => {
                let (name, version) = split_type(kind);
                (Some(name.to_owned()), version)
            }
            None => (None, None),
        };
        let cloudevent = !all.contains_key(headers::EVENT_TYPE) && ce_type.is_some();
        let Some(event_type) = all.get(headers::EVENT_TYPE).cloned().or(ce_type) else {
            let error = undecodable(format!("no `{}` header", headers::EVENT_TYPE));
            return self
                .policy(delivery, self.undecodable, error, shutdown)
                .await;
        };
        let structured_id = structured.as_ref().and_then(|e| e.id.as_ref());
        let (id_header, id_value) = if all.contains_key(headers::MESSAGE_ID) || !cloudevent {
            (headers::MESSAGE_ID, all.get(headers::MESSAGE_ID))
        } else if structured.is_some() && !all.contains_key(&ce_id_header) {
            ("id", structured_id)
        } else {
            (ce_id_header.as_str(), all.get(&ce_id_header))
        };
        let id = match id_value.map(|v| v.parse::<Uuid>()) {
            Some(Ok(id)) => id,
            Some(Err(e)) => {
                let error = undecodable(format!(
                    "bad `{id_header}` header (the inbox needs a UUID): {e}"
                ));
                return self
                    .policy(delivery, self.undecodable, error, shutdown)
                    .await;
            }
            None => {
                let error = undecodable(format!("no `{id_header}` header"));
                return self
                    .policy(delivery, self.undecodable, error, shutdown)
                    .await;
            }
        };
        let Some(dispatch) = self.handlers.get(&event_type) else {
            let error = Error::UnknownEventType {
                event_type,
                origin: origin.clone(),
            };
            return self.policy(delivery, self.unknown, error, shutdown).await;
        };
        let meta = Received {
            event: (),
            id,
            event_type: event_type.clone(),
            version: match all.get(headers::EVENT_VERSION) {
                Some(v) => v.parse().ok(),
                None if cloudevent => ce_version,
                None => None,
            },
            key: delivery.key.clone(),
            origin: origin.clone(),
            headers: all.clone(),
        };
        let payload = structured
            .as_ref()
            .map_or(delivery.payload.as_slice(), |e| e.data.as_slice());
        // What the payload is: a structured event's `datacontenttype`, else the header;
        // the handler's own format when neither says (producers that write none, or an
        // empty one).
        // (A structured event's `data` without `datacontenttype` is JSON, as the
        // CloudEvents JSON format says; its `data_base64` has no format of its own.)
        let content_type = match &structured {
            Some(event) => event
                .content_type
                .as_deref()
                .or((!event.base64).then_some(headers::JSON)),
            None => all
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(headers::CONTENT_TYPE))
                .map(|(_, value)| value.as_str()),
        }
        .filter(|ct| !ct.trim().is_empty());
        if let Some(content_type) = content_type.filter(|ct| !dispatch.reads(ct)) {
            let error = undecodable(format!(
                "message {id}: the payload is `{content_type}`, and the handler of \
                 `{event_type}` reads {}",
                dispatch.format()
            ));
            return self
                .policy(delivery, self.undecodable, error, shutdown)
                .await;
        }
        let mut decoded = match Arc::clone(dispatch).decode(payload, meta.clone()) {
            Ok(run) => Some(run),
            Err(e) => {
                let error = undecodable(format!(
                    "message {id}: payload is not a valid `{event_type}`: {e}"
                ));
                return self
                    .policy(delivery, self.undecodable, error, shutdown)
                    .await;
            }
        };
        let mut backoff = self.retry_backoff;
        let mut attempts = 0_u32;
        // Whether this message's failures are recorded in the database (and counted in
        // the `outbox_consumer_failing_messages` gauge).
        let mut noted = false;
        let result = loop {
            // The first attempt uses the event decoded above; a retry decodes it again.
            let run = match decoded.take() {
                Some(run) => run,
                None => match Arc::clone(dispatch).decode(payload, meta.clone()) {
                    Ok(run) => run,
                    Err(e) => break Err(undecodable(e.to_string())),
                },
            };
            let span = process_span(&self.transport, delivery, id, &event_type);
            crate::trace::link(&span, all);
            // A panicking handler is a failing one: its transaction rolls back, and it
            // counts towards `handler_attempts` like an error.
            let outcome =
                std::panic::AssertUnwindSafe(self.inbox.process(id, run).instrument(span.clone()))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|panic| {
                        let text = crate::task::panic_message(panic.as_ref());
                        Err(InboxError::Handler(
                            format!("the handler panicked: {text}").into(),
                        ))
                    });
            let delay = match outcome {
                Ok(Processed::Handled(())) => {
                    break Ok(self
                        .settle(
                            delivery,
                            &self.stats.handled,
                            "outbox_consumer_handled_total",
                        )
                        .await);
                }
                Ok(Processed::Duplicate) => {
                    tracing::debug!(%id, %origin, transport = T::NAME, "outbox consumer: duplicate skipped by the inbox");
                    break Ok(self
                        .settle(
                            delivery,
                            &self.stats.duplicates,
                            "outbox_consumer_duplicates_total",
                        )
                        .await);
                }
                Err(e) => {
                    span.record(
                        "error.type",
                        match e {
                            InboxError::Handler(_) => "handler",
                            InboxError::Database(_) => "database",
                        },
                    );
                    span.record("otel.status_code", "ERROR");
                    self.stats.handler_errors.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("outbox_consumer_handler_errors_total", "transport" => T::NAME, "consumer" => self.inbox.consumer().to_owned()).increment(1);
                    // Only the handler's own failures count towards giving up: a database
                    // that is briefly unavailable must not dead-letter or skip messages.
                    if matches!(e, InboxError::Handler(_)) {
                        attempts += 1;
                    }
                    let error = match &e {
                        InboxError::Handler(e) => e.to_string(),
                        InboxError::Database(e) => crate::ErrorChain(e).to_string(),
                    };
                    let error = self.transport.redact(&error);
                    if let Some((max, then)) =
                        self.handler_attempts.filter(|(max, _)| attempts >= *max)
                    {
                        let failure = Error::HandlerFailed {
                            id,
                            event_type: event_type.clone(),
                            attempts: max,
                            error,
                            origin: origin.clone(),
                        };
                        break self.policy(delivery, then, failure, shutdown).await;
                    }
                    self.note_failure(id, &event_type, delivery, &error, &mut noted)
                        .await;
                    let delay = backoff.next();
                    tracing::warn!(%id, %event_type, %origin, transport = T::NAME, error = %error, retry_in = ?delay,
                        "outbox consumer: handler failed; nothing recorded, retrying");
                    delay
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped(shutdown) => break Ok(Step::Interrupted),
            }
        };
        if noted {
            self.failing_ended(id, matches!(result, Ok(Step::Done)))
                .await;
        }
        result
    }

    /// Records a failure of the handler where operators look (`outbox status`, `outbox
    /// doctor`, the dashboard) and in metrics. A database that cannot take the record
    /// does not stop the retries: the failure is in the log either way.
    async fn note_failure(
        &self,
        id: Uuid,
        event_type: &str,
        delivery: &Delivery<T::Token>,
        error: &str,
        noted: &mut bool,
    ) {
        let consumer = self.inbox.consumer();
        if !*noted {
            *noted = true;
            let failing = self.failing.fetch_add(1, Ordering::Relaxed) + 1;
            metrics::gauge!("outbox_consumer_failing_messages", "transport" => T::NAME, "consumer" => consumer.to_owned()).set(failing as f64);
        }
        let outbox = self.inbox.outbox();
        let origin = delivery.origin.to_string();
        let error: String = error.chars().take(2000).collect();
        // MySQL keeps types and keys in 255 characters; a longer one from another
        // producer must not make the record fail (it is shown, not matched on).
        let event_type: String = event_type.chars().take(255).collect();
        let key: Option<String> = delivery.key.as_ref().map(|k| k.chars().take(255).collect());
        let failure = Failure {
            consumer,
            id,
            event_type: &event_type,
            key: key.as_deref(),
            origin: &origin,
            error: &error,
        };
        if let Err(e) = DB::note_failure(outbox.pool(), outbox.tables(), failure).await {
            tracing::debug!(%id, error = %crate::ErrorChain(&e), "outbox consumer: could not record the handler's failure in the database");
        }
    }

    /// A message whose failures were noted is no longer retried here: handled or
    /// disposed of (`done`: its record goes), or left for later (shutdown, `Policy::Stop`:
    /// the record stays, as the message is still not handled).
    async fn failing_ended(&self, id: Uuid, done: bool) {
        let consumer = self.inbox.consumer();
        let failing = self.failing.fetch_sub(1, Ordering::Relaxed) - 1;
        metrics::gauge!("outbox_consumer_failing_messages", "transport" => T::NAME, "consumer" => consumer.to_owned()).set(failing as f64);
        if !done {
            return;
        }
        let outbox = self.inbox.outbox();
        if let Err(e) = DB::clear_consumer_rows(
            outbox.pool(),
            outbox.tables(),
            ConsumerRows::Failure { consumer, id },
        )
        .await
        {
            tracing::debug!(%id, error = %crate::ErrorChain(&e), "outbox consumer: could not remove the handler's failure record (status hides it once the message is processed)");
        }
    }

    /// Counts a message that needs nothing more (in `stat` and the counter `metric`)
    /// and acknowledges it.
    async fn settle(
        &self,
        delivery: &Delivery<T::Token>,
        stat: &AtomicU64,
        metric: &'static str,
    ) -> Step {
        stat.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(metric, "transport" => T::NAME).increment(1);
        self.ack(delivery).await;
        Step::Done
    }

    async fn ack(&self, delivery: &Delivery<T::Token>) {
        if let Err(e) = self.transport.ack(delivery).await {
            // The broker sends it again; the inbox skips it.
            tracing::warn!(origin = %delivery.origin, transport = T::NAME, error = %self.transport.redact(&e.to_string()),
                "outbox consumer: acknowledging failed; the message will come again and be skipped");
        }
    }

    async fn policy(
        &self,
        delivery: &Delivery<T::Token>,
        policy: Policy,
        error: Error,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Step, Error> {
        let origin = &delivery.origin;
        match policy {
            Policy::Skip => {
                tracing::warn!(%origin, transport = T::NAME, reason = %short_reason(&error),
                    "outbox consumer: message skipped (policy Skip)");
                Ok(self
                    .settle(
                        delivery,
                        &self.stats.skipped,
                        "outbox_consumer_skipped_total",
                    )
                    .await)
            }
            Policy::Stop => {
                tracing::error!(%origin, transport = T::NAME, reason = %error,
                    "outbox consumer: stops (policy Stop)");
                Err(error)
            }
            Policy::DeadLetter => {
                let destination = self.transport.dead_letter_destination().unwrap_or_default();
                let reason = self.transport.redact(&short_reason(&error));
                // A shutdown does not wait for the write: the message stays
                // unacknowledged, so it comes again (at worst twice in the dead letters).
                tokio::select! {
                    written = self.transport.dead_letter(delivery, &reason) => {
                        written.map_err(|e| Error::DeadLetter {
                            destination: destination.clone(),
                            reason: self.transport.redact(&e.to_string()),
                            origin: origin.clone(),
                        })?;
                    }
                    _ = stopped(shutdown) => return Ok(Step::Interrupted),
                }
                tracing::warn!(%origin, transport = T::NAME, dead_letter = %destination, %reason,
                    "outbox consumer: message dead-lettered");
                Ok(self
                    .settle(
                        delivery,
                        &self.stats.dead_lettered,
                        "outbox_consumer_dead_lettered_total",
                    )
                    .await)
            }
        }
    }
}

/// The span a handler runs in, named and attributed as the OpenTelemetry messaging
/// semantic conventions name a consumer's processing (`process {destination}`), with the
/// broker's own attributes: Kafka's key, partition and offset, RabbitMQ's routing key,
/// the NATS subject as the destination. Linked (by the caller) to the message's trace.
fn process_span<T: Transport>(
    transport: &T,
    delivery: &Delivery<T::Token>,
    id: Uuid,
    event_type: &str,
) -> tracing::Span {
    let origin = &delivery.origin;
    let span = tracing::info_span!(
        "outbox.consume",
        otel.name = %format!("process {}", origin.source),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        messaging.system = T::NAME,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = %origin.source,
        messaging.destination.partition.id = tracing::field::Empty,
        messaging.message.id = %id,
        messaging.consumer.group.name = transport.consumer_group(),
        messaging.kafka.message.key = tracing::field::Empty,
        messaging.kafka.offset = tracing::field::Empty,
        messaging.rabbitmq.destination.routing_key = tracing::field::Empty,
        error.type = tracing::field::Empty,
        %event_type,
        %origin,
        transport = T::NAME,
    );
    if let Some(partition) = origin.partition {
        span.record(
            "messaging.destination.partition.id",
            tracing::field::display(partition),
        );
    }
    match T::NAME {
        "kafka" => {
            if let Some(key) = &delivery.key {
                span.record("messaging.kafka.message.key", key.as_str());
            }
            if let Some(offset) = origin.position {
                span.record("messaging.kafka.offset", offset);
            }
        }
        "rabbitmq" => {
            if let Some(routing_key) = &delivery.routing_key {
                span.record(
                    "messaging.rabbitmq.destination.routing_key",
                    routing_key.as_str(),
                );
            }
        }
        _ => {}
    }
    span
}
