//! `outbox-rabbitmq`: publishes outbox messages to [RabbitMQ](https://www.rabbitmq.com/)
//! (AMQP 0-9-1, with the [`lapin`] client).
//!
//! ```no_run
//! # async fn demo(outbox: outbox_core::Outbox) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_core::Relay;
//! use outbox_rabbitmq::RabbitPublisher;
//!
//! // Every exchange named by the event catalog's destinations must exist.
//! let publisher = RabbitPublisher::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .build()
//!     .await?;
//! let relay = Relay::builder(outbox, publisher).spawn();
//! # relay.shutdown().await; Ok(()) }
//! ```
//!
//! # Destinations
//! A destination is `exchange/routing.key`: the message goes to `exchange` with that
//! routing key (which may itself hold `/`). A destination without `/` goes to the
//! default exchange with the destination as its routing key, that is straight to the
//! queue of that name.
//!
//! # What it guarantees
//! - **Confirmed, persistent, routed**: the channel is in confirm mode, every message is
//!   persistent (`delivery_mode = 2`) and published `mandatory`. A message counts as
//!   sent once the broker confirmed it. A message that no queue is bound to take comes
//!   back (`NO_ROUTE`) and fails for good ([`PublishError::permanent`], a dead letter
//!   naming the exchange and routing key), instead of being dropped silently. A
//!   negative confirm (`nack`) is retried.
//! - **Per-key order**: the messages of one partition key are published one after the
//!   other, each once the one before is known to be confirmed and routed; messages of
//!   different keys are all in flight at once on one channel. lapin may hand a message's
//!   return to another message's confirm: returns are matched to their messages by
//!   `message_id`, and a message's fate is decided only when its return must have been
//!   seen (the `returns` module says why). After a failure, the later messages of
//!   that key in the batch are not attempted, so a key never reaches a queue out of
//!   order. RabbitMQ keeps the order of one channel's messages in each queue; consumers
//!   keep it with one consumer per queue (or a single active consumer). The cost: a
//!   batch of one hot key takes one round trip per message.
//! - **Deduplication**: `message_id` is the outbox id; consumers skip ids they saw (a
//!   message is published again when the relay crashed between the confirm and the
//!   mark).
//! - **Recovery**: a lost connection or a closed channel fails the batch in flight as
//!   unavailable (no attempt counted, retried with the relay's outage backoff), and the
//!   next batch connects again. The relay does not restart.
//! - **Start-up check**: [`RabbitPublisherBuilder::build`] fails with
//!   [`Error::MissingDestinations`] naming every exchange (or, for the default
//!   exchange, queue) of the catalog's destinations that does not exist. A missing
//!   exchange met later fails its messages as retryable errors naming it, without
//!   publishing them: RabbitMQ would close the channel, and with it every confirm in
//!   flight.
//!
//! # Message layout
//! Body = the bytes given to `emit`. Properties: `message_id` = the outbox id, `type` = the
//! event type, `content_type` = the message's, `timestamp` = when the event was written,
//! `delivery_mode = 2`. Headers: `message-id`, `event-type`, `event-version` (if any),
//! `content-type`, `partition-key` (if any), and every header stored with the row
//! (`traceparent`, ...): the broker-neutral names of `outbox_core::publisher::headers`,
//! which `outbox-kafka` and `outbox-nats` write too.
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use outbox_core::ErrorChain;
use outbox_core::consumer::BoxError;
use outbox_core::publisher::cloudevents::{CloudEvents, is_attribute_header};
use outbox_core::publisher::{OutboxRecord, PublishError, Publisher, publish_in_chains};
use tokio::time::Instant;

use crate::returns::{Fate, Returns};

pub mod cloudevents;
mod consumer;
mod returns;
mod tls;

pub use cloudevents::CloudEventsHeaders;
pub use consumer::{RabbitToken, RabbitTransport, RabbitTransportBuilder};

/// The parsers of untrusted input, for the fuzz targets in `fuzz/`. Not a public API:
/// it changes without notice.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use std::collections::BTreeMap;

    use lapin::BasicProperties;
    use outbox_core::OutboxRecord;
    use outbox_core::publisher::cloudevents::CloudEvents;

    use crate::CloudEventsHeaders;

    /// The URL as errors, logs and `Debug` show it.
    pub fn redacted(url: &str) -> String {
        crate::redacted(url)
    }

    /// `text` as the consumer's `Transport::redact` leaves it, for a transport on `url`.
    pub fn redact_text(url: &str, text: &str) -> String {
        crate::consumer::redact_text(url, text)
    }

    /// The properties the publisher gives `record`.
    pub fn properties(
        record: &OutboxRecord,
        cloudevents: Option<(CloudEvents, CloudEventsHeaders)>,
    ) -> BasicProperties {
        let cloudevents = cloudevents.map(|(ce, headers)| (ce, headers.prefix()));
        crate::properties(record, cloudevents.as_ref())
    }

    /// The headers the consumer reads from a delivery's properties.
    pub fn text_headers(properties: &BasicProperties) -> BTreeMap<String, String> {
        crate::consumer::text_headers(properties)
    }
}

/// The headers this publisher writes.
pub mod headers {
    pub use outbox_core::publisher::headers::{
        CONTENT_TYPE, EVENT_TYPE, EVENT_VERSION, JSON, MESSAGE_ID, PARTITION_KEY,
    };

    /// The prefix outbox 0.1 gave the CloudEvents attribute headers. The publisher now
    /// writes `cloudEvents:` by default, which the SDKs read
    /// ([`CloudEventsHeaders`](crate::CloudEventsHeaders)); the consumer reads both.
    #[deprecated(
        note = "use `CloudEventsHeaders::Underscore.prefix()` for this prefix, or `CLOUDEVENTS_PREFIXES` for every prefix the consumer reads; the publisher's default is now `cloudEvents:` (`CloudEventsHeaders::AmqpBinding`)"
    )]
    pub const CLOUDEVENTS_PREFIX: &str = "cloudEvents_";

    /// The prefixes of CloudEvents attribute headers the consumer reads, in this order:
    /// `cloudEvents:` (the publisher's default), `cloudEvents_`, `ce-`
    /// ([`CloudEventsHeaders`](crate::CloudEventsHeaders)).
    pub const CLOUDEVENTS_PREFIXES: [&str; 3] = [
        crate::CloudEventsHeaders::ALL[0].prefix(),
        crate::CloudEventsHeaders::ALL[1].prefix(),
        crate::CloudEventsHeaders::ALL[2].prefix(),
    ];

    /// Headers the publisher sets itself; row headers with these names are not copied.
    pub const RESERVED: [&str; 5] = [
        MESSAGE_ID,
        EVENT_TYPE,
        EVENT_VERSION,
        CONTENT_TYPE,
        PARTITION_KEY,
    ];
}

/// Why the publisher could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker could not be reached, refused the login, or did not answer in time.
    /// Why is the [`source`](std::error::Error::source) (lapin's error, or no answer
    /// within the connect timeout): print the chain with `outbox_core::ErrorChain` (or
    /// `{:#}`).
    #[error(
        "cannot connect to RabbitMQ at {url}; check that the broker runs and that the URL, user and vhost are right"
    )]
    #[non_exhaustive]
    Connect {
        /// The URL given, without its password.
        url: String,
        /// The client's error, as text.
        #[deprecated(since = "0.2.0", note = "the client's error is the error's `source()`")]
        reason: String,
        /// Why: lapin's error, or no answer in time.
        #[source]
        source: BoxError,
    },
    /// The TLS handshake with the broker failed (`amqps://`): its certificate is not
    /// signed by a CA the client trusts, or does not name the URL's host. lapin's error
    /// is the [`source`](std::error::Error::source).
    #[error(
        "TLS with RabbitMQ at {url} failed; check the CA that verifies the broker \
         (`.tls_root_certificates(path)`, else the system's roots) and that the URL's host \
         is a name its certificate holds"
    )]
    #[non_exhaustive]
    Tls {
        /// The URL given, without its password.
        url: String,
        /// The client's error, as text.
        #[deprecated(since = "0.2.0", note = "the client's error is the error's `source()`")]
        reason: String,
        /// lapin's error.
        #[source]
        source: BoxError,
    },
    /// Destinations whose exchange (or, for the default exchange, queue) does not exist.
    #[error(
        "RabbitMQ has no {}; declare them (e.g. `rabbitmqadmin declare exchange name={} type=topic durable=true`), \
         or leave the catalog out of the check with `.skip_catalog_check()`",
        .missing.join(", "),
        .missing.first().and_then(|m| m.strip_prefix("exchange ")).and_then(|m| m.split(' ').next()).unwrap_or("<exchange>")
    )]
    MissingDestinations {
        /// What is missing, e.g. `exchange orders (for orders/order.created)`.
        missing: Vec<String>,
    },
    /// A destination that is not `exchange/routing.key` or a queue name.
    #[error("destination {destination:?} cannot be published to RabbitMQ: {reason}")]
    InvalidDestination {
        /// The destination.
        destination: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The broker did not answer a lookup. Why is the
    /// [`source`](std::error::Error::source) (lapin's error, or no answer in time).
    #[error("cannot look up {what} on RabbitMQ")]
    #[non_exhaustive]
    Lookup {
        /// The exchange or queue looked up.
        what: String,
        /// The client's error, as text.
        #[deprecated(since = "0.2.0", note = "the client's error is the error's `source()`")]
        reason: String,
        /// Why: lapin's error, or no answer in time.
        #[source]
        source: BoxError,
    },
}

/// The broker did not answer within the connect timeout: the source of a
/// [`Error::Connect`] or [`Error::Lookup`] that lapin did not fail.
#[derive(Debug)]
struct NoAnswer(Duration);

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no answer within {:?}", self.0)
    }
}

impl std::error::Error for NoAnswer {}

impl Error {
    /// [`Error::Connect`], or [`Error::Tls`] if `tls`, for the broker shown as `url`.
    #[allow(deprecated)] // `reason`, kept for one release
    fn connecting(url: String, source: BoxError, tls: bool) -> Self {
        let reason = source.to_string();
        if tls {
            Error::Tls {
                url,
                reason,
                source,
            }
        } else {
            Error::Connect {
                url,
                reason,
                source,
            }
        }
    }

    /// [`Error::Lookup`] of `what`.
    #[allow(deprecated)] // `reason`, kept for one release
    fn lookup(what: String, source: BoxError) -> Self {
        Error::Lookup {
            what,
            reason: source.to_string(),
            source,
        }
    }
}

/// The URL with its password replaced by `***`, for errors, logs and `Debug`.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user information ends at the last `@`: a password may hold an unencoded `/`
    // (lapin then refuses the URL, and the error must not show it either).
    let Some(at) = rest.rfind('@') else {
        return url.to_owned();
    };
    let user = rest[..at].split(':').next().unwrap_or("");
    format!("{scheme}://{user}:***@{}", &rest[at + 1..])
}

/// Where a destination goes: `(exchange, routing key)`.
fn route(destination: &str) -> Result<(&str, &str), String> {
    let (exchange, routing_key) = destination.split_once('/').unwrap_or(("", destination));
    if destination.contains('/') && exchange.is_empty() {
        return Err(
            "it has an empty exchange before `/`; name the queue alone to use the default exchange"
                .to_owned(),
        );
    }
    if exchange.len() > 127
        || !exchange
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
    {
        return Err(format!(
            "exchange {exchange:?} is not a RabbitMQ exchange name (at most 127 letters, digits, `-`, `_`, `.`, `:`)"
        ));
    }
    if routing_key.is_empty() && exchange.is_empty() {
        return Err("it is empty".to_owned());
    }
    if routing_key.len() > 255 {
        return Err(format!(
            "the routing key is {} bytes, over AMQP's 255",
            routing_key.len()
        ));
    }
    Ok((exchange, routing_key))
}

/// What a destination needs to exist: its exchange, or for the default exchange the
/// queue it routes to.
fn needs(destination: &str) -> Result<Needed, String> {
    let (exchange, routing_key) = route(destination)?;
    Ok(if exchange.is_empty() {
        Needed::Queue(routing_key.to_owned())
    } else {
        Needed::Exchange(exchange.to_owned())
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Needed {
    Exchange(String),
    Queue(String),
}

impl fmt::Display for Needed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Needed::Exchange(name) => write!(f, "exchange {name}"),
            Needed::Queue(name) => write!(f, "queue {name}"),
        }
    }
}

/// Whether an error is the broker's `404 NOT_FOUND`.
fn not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
}

/// Looks `needed` up with a passive declare, on a channel of its own: a failed passive
/// declare closes its channel. `Ok(false)` when it does not exist.
async fn exists(connection: &Connection, needed: &Needed) -> Result<bool, lapin::Error> {
    let channel = connection.create_channel().await?;
    let result = match needed {
        Needed::Exchange(name) => {
            channel
                .exchange_declare(
                    name.as_str().into(),
                    lapin::ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
        }
        Needed::Queue(name) => channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|_| ()),
    };
    match result {
        Ok(()) => {
            let _ = channel
                .close(200, "outbox-rabbitmq: looked up".into())
                .await;
            Ok(true)
        }
        Err(e) if not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Configures a [`RabbitPublisher`]; start with [`RabbitPublisher::builder`].
#[must_use = "a builder does nothing until `build`"]
pub struct RabbitPublisherBuilder {
    url: String,
    destinations: Vec<String>,
    check_catalog: bool,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    batch_budget: Duration,
    cloudevents: Option<CloudEvents>,
    cloudevents_headers: CloudEventsHeaders,
    ca_file: Option<std::path::PathBuf>,
}

impl fmt::Debug for RabbitPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisherBuilder")
            .field("url", &redacted(&self.url))
            .field("destinations", &self.destinations)
            .field("check_catalog", &self.check_catalog)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl RabbitPublisherBuilder {
    /// Also check at start-up that `destination`'s exchange (or queue) exists.
    pub fn destination(mut self, destination: impl Into<String>) -> Self {
        self.destinations.push(destination.into());
        self
    }

    /// Do not check the destinations of the event catalog (`outbox_core::catalog()`) at
    /// start-up; destinations added with [`destination`](Self::destination) are still
    /// checked.
    pub fn skip_catalog_check(mut self) -> Self {
        self.check_catalog = false;
        self
    }

    /// How long to wait for the broker's confirm of one message (default 5 s); past it
    /// the message is reported as unavailable (no attempt counted) and the connection is
    /// opened again for the next batch.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long connecting (TCP, TLS, login, channel) may take (default 5 s); also
    /// bounds, as a whole, a batch's look-ups of exchanges it has not met yet.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// `amqps://`: also trust the CA certificates in the PEM file `path` (a private CA
    /// that signed the broker's certificate), beside the system's roots. Read at every
    /// connect.
    pub fn tls_root_certificates(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// How long a batch may start new messages (default 12 s): a key's chain still going
    /// when it runs out reports its remaining messages as not attempted. A batch takes
    /// at most `2 × connect_timeout + batch_budget + confirm_timeout`
    /// ([`Publisher::max_publish_time`]): 27 s with the defaults, below the relay's 30 s
    /// `publish_timeout`.
    pub fn batch_budget(mut self, budget: Duration) -> Self {
        self.batch_budget = budget;
        self
    }

    /// CloudEvents 1.0 binary content mode: every message also carries the
    /// `cloudEvents:id`, `cloudEvents:source`, `cloudEvents:specversion`,
    /// `cloudEvents:type` and `cloudEvents:time` headers (the AMQP binding 1.0.2's
    /// names, which the Go, Java, C# and Python SDKs read; another prefix with
    /// [`cloudevents_headers`](Self::cloudevents_headers)), with the outbox headers and
    /// the payload unchanged ([`outbox_core::publisher::cloudevents`]).
    pub fn cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    /// The prefix of the CloudEvents headers ([`CloudEventsHeaders`]; default
    /// `cloudEvents:`): `Underscore` for consumers of outbox 0.1's `cloudEvents_`,
    /// `Knative` for Knative's RabbitMQ binding (`ce-`).
    pub fn cloudevents_headers(mut self, headers: CloudEventsHeaders) -> Self {
        self.cloudevents_headers = headers;
        self
    }

    /// Connects and checks that every destination's exchange (or queue) exists.
    pub async fn build(self) -> Result<RabbitPublisher, Error> {
        let shown = redacted(&self.url);
        let inner = Inner {
            url: self.url,
            ca_file: self.ca_file,
            server: outbox_core::telemetry::server_of(&shown),
            shown: shown.clone(),
            link: tokio::sync::Mutex::new(None),
            known: std::sync::Mutex::new(HashSet::new()),
            confirm_timeout: self.confirm_timeout,
            connect_timeout: self.connect_timeout,
            batch_budget: self.batch_budget,
            cloudevents: self
                .cloudevents
                .map(|ce| (ce, self.cloudevents_headers.prefix())),
        };
        let link = inner
            .connect()
            .await
            .map_err(|failure| failure.into_error(shown.clone()))?;
        let wanted =
            outbox_core::catalog::destinations_to_check(self.destinations, self.check_catalog);
        let mut missing = Vec::new();
        for destination in wanted {
            let needed = needs(&destination).map_err(|reason| Error::InvalidDestination {
                destination: destination.clone(),
                reason,
            })?;
            let found =
                tokio::time::timeout(inner.connect_timeout, exists(&link.connection, &needed))
                    .await
                    .map_err(|_| {
                        Error::lookup(
                            needed.to_string(),
                            Box::new(NoAnswer(inner.connect_timeout)),
                        )
                    })?
                    .map_err(|e| Error::lookup(needed.to_string(), Box::new(e)))?;
            if found {
                inner.remember(&needed);
            } else {
                missing.push(format!("{needed} (for {destination})"));
            }
        }
        if !missing.is_empty() {
            return Err(Error::MissingDestinations { missing });
        }
        *inner.link.lock().await = Some(link);
        tracing::info!(url = %shown, "outbox-rabbitmq publisher ready");
        Ok(RabbitPublisher {
            inner: Arc::new(inner),
        })
    }
}

/// Publishes outbox messages to RabbitMQ. See the [crate docs](crate).
///
/// Cheap to clone; clones share one connection.
#[derive(Clone)]
pub struct RabbitPublisher {
    inner: Arc<Inner>,
}

impl fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("url", &self.inner.shown)
            .field("confirm_timeout", &self.inner.confirm_timeout)
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// With its password: only ever handed to the client.
    url: String,
    /// `amqps://`: CA certificates to trust beside the system's.
    ca_file: Option<std::path::PathBuf>,
    /// Without it: for errors, logs and `Debug`.
    shown: String,
    /// Its host and port, for the `send` span.
    server: Option<(String, Option<u16>)>,
    /// The connection and its confirm-mode channel; `None` after a transport failure,
    /// until the next batch connects again.
    link: tokio::sync::Mutex<Option<Link>>,
    /// Exchanges and queues seen to exist, since the last connect.
    known: std::sync::Mutex<HashSet<Needed>>,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    batch_budget: Duration,
    /// CloudEvents binary mode, and the prefix of its headers.
    cloudevents: Option<(CloudEvents, &'static str)>,
}

struct Link {
    connection: Connection,
    channel: Channel,
}

/// Why [`Inner::connect`] failed: lapin's error or no answer, and whether it was TLS.
struct ConnectFailure {
    source: BoxError,
    tls: bool,
}

impl ConnectFailure {
    /// The start-up error for the broker shown as `url`.
    fn into_error(self, url: String) -> Error {
        Error::connecting(url, self.source, self.tls)
    }
}

impl Inner {
    /// A connection and a channel in confirm mode, within `connect_timeout`.
    async fn connect(&self) -> Result<Link, ConnectFailure> {
        let connect = async {
            let connection = tls::connect(
                &self.url,
                ConnectionProperties::default().with_connection_name("outbox-rabbitmq".into()),
                self.ca_file.as_deref(),
            )
            .await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(Link {
                connection,
                channel,
            })
        };
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(link)) => Ok(link),
            // lapin's errors do not carry the URL.
            Ok(Err(e)) => Err(ConnectFailure {
                tls: tls::is_tls_failure(&e),
                source: Box::new(e),
            }),
            Err(_) => Err(ConnectFailure {
                tls: false,
                source: Box::new(NoAnswer(self.connect_timeout)),
            }),
        }
    }

    fn remember(&self, needed: &Needed) {
        lock(&self.known).insert(needed.clone());
    }
}

/// One message's properties and headers.
fn properties(
    record: &OutboxRecord,
    cloudevents: Option<&(CloudEvents, &'static str)>,
) -> BasicProperties {
    let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
    let id = record.id.to_string();
    let mut table = FieldTable::default();
    table.insert(headers::MESSAGE_ID.into(), text(&id));
    table.insert(headers::EVENT_TYPE.into(), text(&record.event_type));
    table.insert(headers::CONTENT_TYPE.into(), text(&record.content_type));
    if let Some(version) = record.event_version {
        table.insert(headers::EVENT_VERSION.into(), text(&version.to_string()));
    }
    if let Some(key) = &record.partition_key {
        table.insert(headers::PARTITION_KEY.into(), text(key));
    }
    if let Some((ce, prefix)) = cloudevents {
        for (name, value) in ce.attributes(record) {
            table.insert(ShortString::from(format!("{prefix}{name}")), text(&value));
        }
    }
    for (key, value) in &record.headers {
        // Under any prefix a consumer may read: a decoder that takes both
        // `cloudEvents:` and `cloudEvents_` must not meet a forged attribute.
        let attribute = cloudevents.is_some()
            && headers::CLOUDEVENTS_PREFIXES
                .iter()
                .any(|prefix| is_attribute_header(key, prefix));
        if attribute
            || headers::RESERVED
                .iter()
                .any(|r| r.eq_ignore_ascii_case(key))
        {
            tracing::debug!(id = %record.id, header = %key, "row header shadows a reserved header; not copied");
            continue;
        }
        if key.len() > 255 {
            tracing::warn!(id = %record.id, "row header name over 255 bytes; not copied");
            continue;
        }
        table.insert(ShortString::from(key.as_str()), text(value));
    }
    let properties = BasicProperties::default()
        .with_message_id(ShortString::from(id.as_str()))
        .with_content_type(ShortString::from(record.content_type.as_ref()))
        .with_delivery_mode(2)
        .with_timestamp(u64::try_from(record.created_at.timestamp()).unwrap_or(0))
        .with_headers(table);
    // The `type` property is a short string (at most 255 bytes; `ShortString::from`
    // panics beyond): a longer event type goes in the `event-type` header alone.
    match ShortString::try_new(record.event_type.as_str()) {
        Ok(kind) => properties.with_type(kind),
        Err(_) => properties,
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A failure that says something about the transport, not the message: the link is
/// dropped and the next batch connects again.
fn transport(e: &lapin::Error) -> PublishError {
    PublishError::unavailable(format!("rabbitmq: {e}"))
}

impl RabbitPublisher {
    /// A publisher connecting to `url` (`amqp://user:password@host:5672/vhost`, or
    /// `amqps://` for TLS; the default vhost `/` is `%2f`).
    ///
    /// Errors, logs and `Debug` show the URL with its password replaced by `***`.
    pub fn builder(url: impl Into<String>) -> RabbitPublisherBuilder {
        RabbitPublisherBuilder {
            url: url.into(),
            destinations: Vec::new(),
            check_catalog: true,
            confirm_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            batch_budget: Duration::from_secs(12),
            cloudevents: None,
            cloudevents_headers: CloudEventsHeaders::default(),
            ca_file: None,
        }
    }

    /// Whether `needed` exists, asked once per connection, by `deadline`.
    async fn check(
        &self,
        link: &Link,
        needed: &Needed,
        deadline: Instant,
    ) -> Result<bool, PublishError> {
        if lock(&self.inner.known).contains(needed) {
            return Ok(true);
        }
        match tokio::time::timeout_at(deadline, exists(&link.connection, needed)).await {
            Ok(Ok(true)) => {
                self.inner.remember(needed);
                Ok(true)
            }
            Ok(Ok(false)) => Ok(false),
            Ok(Err(e)) => Err(transport(&e)),
            Err(_) => Err(PublishError::unavailable(format!(
                "rabbitmq: no answer to the lookup of {needed} within {:?}",
                self.inner.connect_timeout
            ))),
        }
    }

    /// Publishes one message, waits for its confirm, then for its fate
    /// ([`returns`]: a return lapin handed to another message's confirm
    /// counts for its own message). `Err` with `true`: the link is broken.
    async fn publish_one(
        &self,
        channel: &Channel,
        record: &OutboxRecord,
        returns: &Returns,
    ) -> Result<(), (PublishError, bool)> {
        let (exchange, routing_key) = route(&record.destination).map_err(|reason| {
            (
                PublishError::permanent(format!(
                    "rabbitmq: destination {:?} cannot be published to: {reason}",
                    record.destination
                )),
                false,
            )
        })?;
        // Before `basic_publish`: from now on this message's confirm may carry a return.
        let ticket = returns.publishing();
        let send = async {
            channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    record.payload.as_bytes(),
                    properties(record, self.inner.cloudevents.as_ref()),
                )
                .await?
                .await
        };
        // On every early return below, the ticket is dropped: the message is lost to the
        // batch's pairing, and the messages whose return it might have carried are not
        // reported routed.
        let (acked, carried) = match tokio::time::timeout(self.inner.confirm_timeout, send).await {
            Ok(Ok(Confirmation::Ack(carried))) => (true, carried),
            Ok(Ok(Confirmation::Nack(carried))) => (false, carried),
            Ok(Ok(Confirmation::NotRequested)) => {
                return Err((
                    PublishError::unavailable(
                        "rabbitmq: the channel is not in confirm mode; connecting again",
                    ),
                    true,
                ));
            }
            Ok(Err(e)) => return Err((transport(&e), true)),
            Err(_) => {
                return Err((
                    PublishError::unavailable(format!(
                        "rabbitmq: no confirm within {:?}; connecting again",
                        self.inner.confirm_timeout
                    )),
                    true,
                ));
            }
        };
        let id = record.id.to_string();
        match ticket.confirmed(carried.map(|m| returned(&m)), &id).await {
            Fate::Returned(reason) => Err((PublishError::permanent(reason), false)),
            Fate::Routed if acked => Ok(()),
            Fate::Routed => Err((
                PublishError::retryable(
                    "rabbitmq: the broker refused the message (basic.nack: an internal error of the queue)",
                ),
                false,
            )),
            Fate::Unknown => Err((
                PublishError::unavailable(
                    "rabbitmq: the connection failed, or a confirm did not come in time, before the broker \
                     told whether the message was routed; it is published again",
                ),
                true,
            )),
        }
    }
}

/// A returned message: the id it carries, and why it came back.
fn returned(message: &lapin::message::BasicReturnMessage) -> (String, String) {
    let id = message
        .delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_default();
    let reason = format!(
        "rabbitmq: no queue is bound to exchange {:?} for routing key {:?} ({} {}); \
         bind one, then release the message",
        message.delivery.exchange.as_str(),
        message.delivery.routing_key.as_str(),
        message.reply_code,
        message.reply_text
    );
    (id, reason)
}

impl Publisher for RabbitPublisher {
    fn messaging_system(&self) -> &'static str {
        "rabbitmq"
    }

    fn server(&self) -> Option<(&str, Option<u16>)> {
        let (host, port) = self.inner.server.as_ref()?;
        Some((host, *port))
    }

    /// `connect_timeout` (a reconnect, and once more for the lookups) plus `batch_budget
    /// + confirm_timeout`.
    fn max_publish_time(&self) -> Option<Duration> {
        Some(2 * self.inner.connect_timeout + self.inner.batch_budget + self.inner.confirm_timeout)
    }

    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let mut guard = self.inner.link.lock().await;
        if guard.is_none() {
            match self.inner.connect().await {
                Ok(link) => {
                    tracing::info!(url = %self.inner.shown, "outbox-rabbitmq: connected again");
                    lock(&self.inner.known).clear();
                    *guard = Some(link);
                }
                Err(failure) => {
                    let error = PublishError::unavailable(format!(
                        "rabbitmq: {}",
                        ErrorChain(&failure.into_error(self.inner.shown.clone()))
                    ));
                    return vec![Err(error); batch.len()];
                }
            }
        }
        let Some(link) = guard.as_ref() else {
            return vec![Err(PublishError::unavailable("rabbitmq: not connected")); batch.len()];
        };

        // The destinations' exchanges: a publish to a missing one closes the channel.
        let mut missing: HashSet<&str> = HashSet::new();
        let mut seen: HashSet<&str> = HashSet::new();
        let lookups_until = Instant::now() + self.inner.connect_timeout;
        for record in batch {
            let destination = record.destination.as_str();
            if !seen.insert(destination) {
                continue;
            }
            let Ok(needed) = needs(destination) else {
                continue; // refused per message below
            };
            match self.check(link, &needed, lookups_until).await {
                Ok(true) => {}
                Ok(false) => {
                    missing.insert(destination);
                }
                Err(error) => {
                    *guard = None;
                    return vec![Err(error); batch.len()];
                }
            }
        }

        let deadline = Instant::now() + self.inner.batch_budget;
        let broken = AtomicBool::new(false);
        // Every confirm of the batch comes by then: the last message starts before the
        // deadline and waits `confirm_timeout` at most.
        let returns = Returns::new(deadline + self.inner.confirm_timeout);
        let (channel, missing, broken_ref, returns_ref) =
            (&link.channel, &missing, &broken, &returns);
        let mut out = publish_in_chains(batch, deadline, |record| async move {
            if broken_ref.load(Ordering::Relaxed) {
                // The link failed under another key: nothing more goes out on it.
                return Err(PublishError::not_attempted());
            }
            if missing.contains(record.destination.as_str()) {
                return Err(PublishError::retryable(format!(
                    "rabbitmq: {} does not exist; declare it, the message is retried",
                    needs(&record.destination)
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                )));
            }
            self.publish_one(channel, record, returns_ref)
                .await
                .map_err(|(e, gone)| {
                    if gone {
                        broken_ref.store(true, Ordering::Relaxed);
                    }
                    e
                })
        })
        .await;
        // Each message's fate was known before its key's next message went out. A return
        // for a message reported routed would mean the broker confirmed a message before
        // returning it: then it fails after all (a dead letter, never a silent loss).
        let ids: HashSet<String> = batch.iter().map(|r| r.id.to_string()).collect();
        for (record, result) in batch.iter().zip(out.iter_mut()) {
            if result.is_ok()
                && let Some(reason) = returns.returned(&record.id.to_string())
            {
                tracing::error!(id = %record.id, "outbox-rabbitmq: a message came back unroutable after the broker confirmed it; it is a dead letter, and later messages of its key may have gone out before it");
                *result = Err(PublishError::permanent(reason));
            }
        }
        for (id, reason) in returns.all_returned() {
            if !ids.contains(&id) {
                tracing::error!(message_id = %id, %reason, "outbox-rabbitmq: a message that is not in the batch came back unroutable (the broker returned it after confirming it); if it is an outbox message, it was reported sent and is lost");
            }
        }
        if broken.into_inner() {
            tracing::warn!(url = %self.inner.shown, "outbox-rabbitmq: the connection or channel failed; connecting again for the next batch");
            if let Some(link) = guard.take() {
                // Closed off the batch's path: a stalled connection never answers the close.
                tokio::spawn(async move {
                    let close = link
                        .connection
                        .close(200, "outbox-rabbitmq: reconnecting".into());
                    let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::OutboxMessage;

    #[test]
    fn destinations_map_to_an_exchange_and_a_routing_key() {
        assert_eq!(
            route("orders/order.created"),
            Ok(("orders", "order.created"))
        );
        assert_eq!(route("orders/a/b"), Ok(("orders", "a/b")));
        assert_eq!(route("work-queue"), Ok(("", "work-queue")));
        assert_eq!(route("orders/"), Ok(("orders", "")));
        for bad in ["/order.created", "", "or ders/x", "örders/x"] {
            assert!(route(bad).is_err(), "{bad:?} is refused");
        }
        assert!(route(&format!("x/{}", "k".repeat(256))).is_err());
        assert_eq!(needs("orders/x"), Ok(Needed::Exchange("orders".to_owned())));
        assert_eq!(needs("jobs"), Ok(Needed::Queue("jobs".to_owned())));
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redacted("amqp://svc:hunter2@rabbit:5672/%2f"),
            "amqp://svc:***@rabbit:5672/%2f"
        );
        assert_eq!(
            redacted("amqps://svc:p%40ss@rabbit/vh"),
            "amqps://svc:***@rabbit/vh"
        );
        assert_eq!(redacted("amqp://rabbit:5672"), "amqp://rabbit:5672");
        assert_eq!(
            redacted("amqp://svc:pa/ss@rabbit/vh"),
            "amqp://svc:***@rabbit/vh",
            "an unencoded `/` in the password"
        );
        let missing = Error::MissingDestinations {
            missing: vec!["exchange orders (for orders/order.created)".to_owned()],
        };
        assert!(
            missing.to_string().contains("name=orders type=topic"),
            "{missing}"
        );
        let builder = RabbitPublisher::builder("amqp://svc:hunter2@rabbit:5672/%2f");
        assert!(!format!("{builder:?}").contains("hunter2"));
    }

    /// Found by the `headers_rabbitmq` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)): an event type
    /// over 255 bytes panicked in lapin's `ShortString::from` (the `type` property),
    /// in the relay's publish. The property is left out; the `event-type` header (a long
    /// string) carries the type, and the consumer reads it from there.
    #[test]
    fn an_event_type_over_255_bytes_is_sent_in_its_header_not_a_panic() {
        let event_type = "E".repeat(300);
        let record =
            OutboxRecord::from(OutboxMessage::new(event_type.clone(), "orders", "{}")).with_seq(1);
        let p = properties(&record, None);
        assert_eq!(*p.kind(), None);
        let read = consumer::text_headers(&p);
        assert_eq!(read.get(headers::EVENT_TYPE), Some(&event_type));
    }

    /// Found by the `redact_amqp` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)): a password with a
    /// `*` was rebuilt by the `***` put in its place (`a*` in `aa**` became `a****`).
    #[test]
    fn a_redacted_text_never_holds_the_password() {
        let (nul8, nul32) = ("\0".repeat(8), "\0".repeat(32));
        for (password, text) in [
            (format!("{nul8}*"), format!("{nul32}*\0\0*A\0Q\0\0\0\0\0")),
            ("a*".to_owned(), "aa**".to_owned()),
        ] {
            let url = format!("amqp://svc:{password}@rabbit/vh");
            let out = consumer::redact_text(&url, &text);
            assert!(!out.contains(&password), "{text:?} -> {out:?}");
        }
        assert_eq!(
            consumer::redact_text("amqp://svc:hunter2@rabbit/vh", "login hunter2 refused"),
            "login *** refused"
        );
    }

    #[test]
    fn the_layout_carries_the_id_type_and_headers() {
        let mut message = OutboxMessage::new("OrderPlaced", "orders/order.placed", "{}")
            .with_key("order-1")
            .with_header("traceparent", "00-abc-def-01")
            .with_header("Event-Type", "spoofed");
        message.event_version = Some(2);
        let record = OutboxRecord::from(message).with_seq(1);
        let p = properties(&record, None);
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            Some(record.id.to_string())
        );
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str().to_owned()),
            Some("OrderPlaced".to_owned())
        );
        assert_eq!(*p.delivery_mode(), Some(2));
        let table = p.headers().clone().unwrap_or_default();
        let get = |k: &str| match table.inner().get(k) {
            Some(AMQPValue::LongString(s)) => {
                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
            }
            _ => None,
        };
        assert_eq!(get("event-type").as_deref(), Some("OrderPlaced"));
        assert_eq!(get("event-version").as_deref(), Some("2"));
        assert_eq!(get("partition-key").as_deref(), Some("order-1"));
        assert_eq!(get("traceparent").as_deref(), Some("00-abc-def-01"));
        assert_eq!(get("Event-Type"), None, "a reserved header is not copied");
    }
}
