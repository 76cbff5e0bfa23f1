//! `outbox-nats`: publishes outbox messages to [NATS JetStream](https://docs.nats.io/nats-concepts/jetstream).
//!
//! ```no_run
//! # async fn demo(outbox: outbox_core::Outbox) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_core::Relay;
//! use outbox_nats::NatsPublisher;
//!
//! // Every destination of the event catalog must be captured by a JetStream stream.
//! let publisher = NatsPublisher::builder("nats://127.0.0.1:4222").build().await?;
//! let relay = Relay::builder(outbox, publisher).spawn();
//! # relay.shutdown().await; Ok(()) }
//! ```
//!
//! # What it guarantees
//! - **Deduplication**: every message carries `Nats-Msg-Id: <outbox message id>`, so a
//!   message the relay publishes again (after a crash between the broker's
//!   acknowledgement and the mark) is dropped by JetStream if it arrives within the
//!   stream's duplicate window (2 minutes by default; see `duplicate_window`). A duplicate
//!   is acknowledged as a success.
//! - **Per-key order**: messages of one partition key are published one after the other,
//!   each after the previous one was acknowledged; messages of different keys are all in
//!   flight at once. After a failure, the later messages of that key in the batch are not
//!   attempted (reported as [`PublishError::not_attempted`]), so a key is never stored
//!   out of order. The cost: a batch made of one hot key takes one round trip per message.
//! - **Start-up check**: [`NatsPublisherBuilder::build`] fails with
//!   [`Error::MissingStreams`] if a destination (subject) of the event catalog, or one
//!   added with [`destination`](NatsPublisherBuilder::destination), is captured by no
//!   stream: JetStream would answer every publish with "no responders".
//!
//! # Message layout
//! Subject = the outbox destination; payload = the bytes given to `emit`; headers:
//! `Nats-Msg-Id`, `message-id`, `event-type`, `event-version` (if any), `content-type`
//! (the message's), `partition-key` (if any), and every header stored with the row
//! (`traceparent`, ...). Apart from `Nats-Msg-Id`, the names are the broker-neutral ones
//! of `outbox_core::publisher::headers`, which `outbox-kafka` writes too, so consumers
//! can share their decoding. With [`cloudevents`](NatsPublisherBuilder::cloudevents),
//! the CloudEvents attributes as `ce-*` headers (the NATS binding draft's binary mode),
//! or, with [`CloudEventsMode::Structured`], the payload wrapped in a JSON event and
//! `content-type: application/cloudevents+json`.
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::{self};
use async_nats::rustls;
use outbox_core::config::percent_decoded;
use outbox_core::consumer::BoxError;
use outbox_core::publisher::cloudevents::{
    self, CloudEvents, is_attribute_header, percent_encode_header_value,
};
use outbox_core::publisher::{OutboxRecord, PublishError, Publisher, publish_in_chains};

mod consumer;

pub use async_nats::jetstream::consumer::DeliverPolicy;
pub use consumer::{NatsTransport, NatsTransportBuilder};

/// The parsers of untrusted input, for the fuzz targets in `fuzz/`. Not a public API:
/// it changes without notice.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use std::collections::BTreeMap;

    use async_nats::HeaderMap;
    use outbox_core::publisher::cloudevents::CloudEvents;
    use outbox_core::publisher::{OutboxRecord, PublishError};

    use crate::{CloudEventsMode, Credentials};

    /// The URLs without their credentials, and the credentials found: the user and
    /// password, or (user `None`) the token.
    pub fn split_credentials(urls: &str) -> (String, Option<(Option<String>, String)>) {
        let (clean, found) = crate::split_credentials(urls);
        let found = found.map(|c| match c {
            Credentials::UserPassword(user, pass) => (Some(user), pass),
            Credentials::Token(token) => (None, token),
        });
        (clean, found)
    }

    /// The headers the publisher gives `record`.
    pub fn headers(
        record: &OutboxRecord,
        cloudevents: Option<(CloudEvents, CloudEventsMode)>,
    ) -> Result<HeaderMap, PublishError> {
        crate::nats_headers(record, cloudevents.as_ref())
    }

    /// The headers the consumer reads from a message's.
    pub fn text_headers(headers: Option<&HeaderMap>) -> BTreeMap<String, String> {
        crate::consumer::text_headers(headers)
    }
}

/// How the publisher writes CloudEvents ([`NatsPublisherBuilder::cloudevents_mode`]).
/// The consumer ([`NatsTransport`]) reads both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CloudEventsMode {
    /// Binary mode **as the NATS binding's working draft (1.0.3-wip) defines it**: the
    /// attributes as `ce-*` headers (values percent-encoded, `ce-datacontenttype`
    /// included), the payload unchanged. Read by Go's `sdk-go` `nats_jetstream/v3`. The
    /// default.
    #[default]
    BinaryDraft,
    /// Structured mode, the only mode of the released NATS binding (1.0.2): the payload
    /// is a JSON event (the attributes, and the outbox payload as `data`, or as
    /// `data_base64` when it is not JSON), with
    /// `content-type: application/cloudevents+json`; no `ce-*` headers. The outbox
    /// headers stay. Read by any JSON event format decoder.
    Structured,
}

/// The headers this publisher writes.
pub mod headers {
    pub use outbox_core::publisher::headers::{
        CONTENT_TYPE, EVENT_TYPE, EVENT_VERSION, JSON, MESSAGE_ID, PARTITION_KEY,
    };

    /// JetStream's deduplication header: the outbox message id.
    pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
    /// The prefix of the CloudEvents attribute headers (binary mode of the NATS
    /// binding's working draft 1.0.3-wip, with
    /// [`cloudevents`](crate::NatsPublisherBuilder::cloudevents)).
    pub const CLOUDEVENTS_PREFIX: &str = "ce-";

    /// Headers the publisher sets itself; row headers with these names are not copied.
    pub const RESERVED: [&str; 6] = [
        NATS_MSG_ID,
        MESSAGE_ID,
        EVENT_TYPE,
        EVENT_VERSION,
        CONTENT_TYPE,
        PARTITION_KEY,
    ];
}

/// Why the publisher or the consumer transport could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server could not be reached or refused the connection. The client's error is
    /// the [`source`](std::error::Error::source): print the chain with
    /// `outbox_core::ErrorChain` (or `{:#}`).
    #[error("cannot connect to NATS at {url}; check that the server runs and the URL is right")]
    #[non_exhaustive]
    Connect {
        /// The URL given.
        url: String,
        /// The client's error, as text.
        #[deprecated(since = "0.2.0", note = "the client's error is the error's `source()`")]
        reason: String,
        /// The client's error (async-nats' `ConnectError`).
        #[source]
        source: BoxError,
    },
    /// The TLS handshake with the server failed: its certificate is not signed by a CA
    /// the client trusts, names another host, or the server wants a client certificate.
    /// The client's error is the [`source`](std::error::Error::source).
    #[error(
        "TLS with NATS at {url} failed; check the CA that verifies the server \
         (`ConnectOptions::add_root_certificates`), that the URL's host is a name its \
         certificate holds, and the client certificate if the server asks for one"
    )]
    #[non_exhaustive]
    Tls {
        /// The URL given.
        url: String,
        /// The client's error, as text.
        #[deprecated(since = "0.2.0", note = "the client's error is the error's `source()`")]
        reason: String,
        /// The client's error (async-nats' `ConnectError`).
        #[source]
        source: BoxError,
    },
    /// Subjects no JetStream stream captures.
    #[error(
        "no JetStream stream captures subject(s) {}; create one (e.g. `nats stream add EVENTS --subjects '{}'`), \
         or leave the catalog out of the check with `.skip_catalog_check()`",
        .subjects.join(", "),
        .subjects.first().map(String::as_str).unwrap_or("<subject>")
    )]
    MissingStreams {
        /// The subjects without a stream.
        subjects: Vec<String>,
    },
    /// The consumer's stream does not exist, or its durable consumer could not be
    /// created. `reason` says what, in our words; the client's error, where there is one,
    /// is the [`source`](std::error::Error::source).
    #[error("cannot set up JetStream consumer `{consumer}` on stream `{stream}`: {reason}")]
    #[non_exhaustive]
    Consumer {
        /// The stream.
        stream: String,
        /// The durable consumer's name.
        consumer: String,
        /// What failed, and what to do.
        reason: String,
        /// The client's error, if the client failed.
        #[source]
        source: Option<BoxError>,
    },
    /// JetStream did not answer a stream lookup. The client's error is the
    /// [`source`](std::error::Error::source).
    #[error(
        "cannot look up the JetStream stream of subject {subject}; is JetStream enabled on the server?"
    )]
    #[non_exhaustive]
    Lookup {
        /// The subject looked up.
        subject: String,
        /// The client's error, as text.
        #[deprecated(since = "0.2.0", note = "the client's error is the error's `source()`")]
        reason: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

/// Credentials taken out of a NATS URL, to be handed to async-nats through its connect
/// options: async-nats logs the URL it is given (at debug level), and our errors, logs
/// and `Debug` output name the server by its URL.
#[derive(Clone)]
enum Credentials {
    /// `nats://user:password@host`.
    UserPassword(String, String),
    /// `nats://token@host`.
    Token(String),
}

/// Splits the credentials off `urls` (NATS URLs separated by commas): the URLs without
/// them, and the first credentials found (percent-decoded).
fn split_credentials(urls: &str) -> (String, Option<Credentials>) {
    let mut found = None;
    let clean: Vec<String> = urls
        .split(',')
        .map(|url| {
            let url = url.trim();
            // A scheme is a letter, then letters, digits, `+`, `-`, `.` (RFC 3986): a
            // `://` after anything else is in a password (`user:pa://ss@host`).
            let scheme_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.');
            let (scheme, rest) = match url.split_once("://") {
                Some((scheme, rest))
                    if scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                        && scheme.chars().all(scheme_char) =>
                {
                    (Some(scheme), rest)
                }
                _ => (None, url),
            };
            // The user information ends at the last `@` (a password may hold `/`, `?`
            // or `@` unencoded; a host never holds `@`).
            let Some((userinfo, host)) = rest.rsplit_once('@') else {
                return url.to_owned();
            };
            if found.is_none() {
                found = Some(match userinfo.split_once(':') {
                    Some((user, pass)) => {
                        Credentials::UserPassword(percent_decoded(user), percent_decoded(pass))
                    }
                    None => Credentials::Token(percent_decoded(userinfo)),
                });
            }
            match scheme {
                Some(scheme) => format!("{scheme}://{host}"),
                None => host.to_owned(),
            }
        })
        .collect();
    (clean.join(","), found)
}

/// Connects to `url` with the credentials taken out of it.
async fn connect(
    url: &str,
    credentials: Option<Credentials>,
    options: async_nats::ConnectOptions,
) -> Result<async_nats::Client, Error> {
    let options = match credentials {
        Some(Credentials::UserPassword(user, pass)) => options.user_and_password(user, pass),
        Some(Credentials::Token(token)) => options.token(token),
        None => options,
    };
    // With both of rustls' crypto providers compiled in (another crate of the program
    // turned on aws-lc), rustls has no default and the client's TLS set-up would panic:
    // make ring, the one this crate builds, the default unless one is set.
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    options.connect(url).await.map_err(|e| {
        let reason = e.to_string();
        let url = url.to_owned();
        let tls = is_tls_failure(&e);
        let source = Box::new(e);
        #[allow(deprecated)] // `reason`, kept for one release
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
    })
}

/// Whether the connection failed in TLS: set-up, or the handshake (an I/O error that
/// carries rustls' error).
fn is_tls_failure(e: &async_nats::ConnectError) -> bool {
    if e.kind() == async_nats::ConnectErrorKind::Tls {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<rustls::Error>()
            || cause
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.is::<rustls::Error>())
        {
            return true;
        }
        source = cause.source();
    }
    false
}

/// Fails with [`Error::MissingStreams`] naming the subjects no stream captures.
async fn check_streams(
    js: &jetstream::Context,
    subjects: impl IntoIterator<Item = String>,
) -> Result<(), Error> {
    let mut missing = Vec::new();
    for subject in subjects {
        match js.stream_by_subject(subject.as_str()).await {
            Ok(_) => {}
            Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => missing.push(subject),
            Err(e) => {
                #[allow(deprecated)] // `reason`, kept for one release
                return Err(Error::Lookup {
                    subject,
                    reason: e.to_string(),
                    source: Box::new(e),
                });
            }
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::MissingStreams { subjects: missing })
    }
}

/// Configures a [`NatsPublisher`]; start with [`NatsPublisher::builder`].
#[must_use = "a builder does nothing until `build`"]
pub struct NatsPublisherBuilder {
    /// The URL(s) without credentials.
    url: String,
    /// Credentials the URL carried.
    credentials: Option<Credentials>,
    options: async_nats::ConnectOptions,
    destinations: Vec<String>,
    check_catalog: bool,
    ack_timeout: Duration,
    batch_budget: Duration,
    cloudevents: Option<CloudEvents>,
    cloudevents_mode: CloudEventsMode,
}

impl fmt::Debug for NatsPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsPublisherBuilder")
            .field("url", &self.url)
            .field("credentials", &self.credentials.as_ref().map(|_| "***"))
            .field("destinations", &self.destinations)
            .field("check_catalog", &self.check_catalog)
            .field("ack_timeout", &self.ack_timeout)
            .finish_non_exhaustive()
    }
}

impl NatsPublisherBuilder {
    /// Connection options (credentials, TLS, name, ...) instead of the defaults.
    pub fn options(mut self, options: async_nats::ConnectOptions) -> Self {
        self.options = options;
        self
    }

    /// Also check at start-up that `subject` is captured by a stream.
    pub fn destination(mut self, subject: impl Into<String>) -> Self {
        self.destinations.push(subject.into());
        self
    }

    /// Do not check the destinations of the event catalog (`outbox_core::catalog()`) at
    /// start-up; subjects added with [`destination`](Self::destination) are still checked.
    pub fn skip_catalog_check(mut self) -> Self {
        self.check_catalog = false;
        self
    }

    /// How long to wait for JetStream's acknowledgement of one message (default 10 s);
    /// past it the message is reported as a retryable failure.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// How long a batch may start new messages (default 15 s): a key's chain that is
    /// still going when it runs out reports its remaining messages as not attempted, so
    /// a long chain of one hot key makes progress batch after batch instead of timing out
    /// as a whole. A message started just before may wait `ack_timeout` more, so a batch
    /// takes at most `batch_budget + ack_timeout` (25 s with the defaults, below the
    /// relay's 30 s `publish_timeout`; [`Publisher::max_publish_time`]).
    pub fn batch_budget(mut self, budget: Duration) -> Self {
        self.batch_budget = budget;
        self
    }

    /// CloudEvents 1.0 binary content mode **as the NATS binding's working draft
    /// (1.0.3-wip) defines it**: every message also carries the `ce-id`, `ce-source`,
    /// `ce-specversion`, `ce-type`, `ce-time` and `ce-datacontenttype` headers, values
    /// percent-encoded (draft section 3.1.3.2), with the outbox headers (`content-type:
    /// application/json` among them) and the payload unchanged
    /// ([`outbox_core::publisher::cloudevents`]). The released binding (1.0.2) knows
    /// structured mode only; Go's `sdk-go` `nats_jetstream/v3` reads this binary mode
    /// ([docs/nats.md](https://github.com/outbox-rs/outbox/blob/main/docs/nats.md)).
    pub fn cloudevents(mut self, cloudevents: CloudEvents) -> Self {
        self.cloudevents = Some(cloudevents);
        self
    }

    /// How [`cloudevents`](Self::cloudevents) writes the events: the draft's binary mode
    /// (the default) or the released binding's structured mode ([`CloudEventsMode`]).
    pub fn cloudevents_mode(mut self, mode: CloudEventsMode) -> Self {
        self.cloudevents_mode = mode;
        self
    }

    /// Connects and checks that every destination is captured by a stream.
    pub async fn build(self) -> Result<NatsPublisher, Error> {
        let client = connect(&self.url, self.credentials, self.options).await?;
        let max_payload = client.server_info().max_payload;
        let mut js = jetstream::new(client);
        js.set_timeout(self.ack_timeout);
        let wanted =
            outbox_core::catalog::destinations_to_check(self.destinations, self.check_catalog);
        check_streams(&js, wanted).await?;
        tracing::info!(url = %self.url, "outbox-nats publisher ready");
        Ok(NatsPublisher {
            js,
            ack_timeout: self.ack_timeout,
            batch_budget: self.batch_budget,
            max_payload,
            cloudevents: self.cloudevents.map(|ce| (ce, self.cloudevents_mode)),
            server: outbox_core::telemetry::server_of(&self.url),
        })
    }
}

/// Publishes outbox messages to NATS JetStream. See the [crate docs](crate).
#[derive(Clone)]
pub struct NatsPublisher {
    js: jetstream::Context,
    ack_timeout: Duration,
    batch_budget: Duration,
    /// The server's limit for one message, headers included.
    max_payload: usize,
    /// CloudEvents, and how they are written.
    cloudevents: Option<(CloudEvents, CloudEventsMode)>,
    /// The first server of the URL (without credentials), for the `send` span.
    server: Option<(String, Option<u16>)>,
}

impl fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("ack_timeout", &self.ack_timeout)
            .finish_non_exhaustive()
    }
}

impl NatsPublisher {
    /// A publisher connecting to `url` (`nats://host:4222`, or several separated by commas).
    ///
    /// Credentials in the URL (`nats://user:password@host`, `nats://token@host`) are taken
    /// out of it and passed in the connect options; errors, logs and `Debug` show the URL
    /// without them.
    pub fn builder(url: impl Into<String>) -> NatsPublisherBuilder {
        let (url, credentials) = split_credentials(&url.into());
        NatsPublisherBuilder {
            url,
            credentials,
            options: async_nats::ConnectOptions::new().name("outbox-nats"),
            destinations: Vec::new(),
            check_catalog: true,
            ack_timeout: Duration::from_secs(10),
            batch_budget: Duration::from_secs(15),
            cloudevents: None,
            cloudevents_mode: CloudEventsMode::default(),
        }
    }

    /// Publishes one message and waits for JetStream's acknowledgement.
    async fn publish_one(&self, record: &OutboxRecord) -> Result<(), PublishError> {
        check_subject(&record.destination)?;
        let headers = nats_headers(record, self.cloudevents.as_ref())?;
        let body: bytes::Bytes = match &self.cloudevents {
            Some((ce, CloudEventsMode::Structured)) => ce
                .structured(record)
                .map_err(|e| PublishError::permanent(format!("nats: {e}")))?
                .into(),
            _ => record.payload.clone().into_bytes(),
        };
        // The server closes the connection on a message over its limit (dropping every
        // acknowledgement in flight), so such a message is refused before it is sent.
        let size = body.len() + headers_len(&headers);
        if size > self.max_payload {
            return Err(PublishError::permanent(format!(
                "nats: the message is {size} bytes with its headers, over the server's max_payload of {} bytes",
                self.max_payload
            )));
        }
        let send = self
            .js
            .publish_with_headers(record.destination.clone(), headers, body);
        let acked = async {
            let ack = send.await?;
            ack.await
        };
        match tokio::time::timeout(self.ack_timeout, acked).await {
            Ok(Ok(_ack)) => Ok(()),
            Ok(Err(e)) => Err(classify(&e)),
            Err(_) => Err(PublishError::unavailable(format!(
                "nats: no acknowledgement from JetStream within {:?}",
                self.ack_timeout
            ))),
        }
    }
}

fn classify(e: &jetstream::context::PublishError) -> PublishError {
    let source = std::error::Error::source(e).map(|s| s.to_string());
    let text = match &source {
        Some(source) => format!("nats: {e}: {source}"),
        None => format!("nats: {e}"),
    };
    // Over the stream's max_msg_size (JetStream error 10054): it will never fit.
    let too_large = e.kind() == PublishErrorKind::Other
        && source.is_some_and(|s| s.contains("10054") || s.contains("maximum message size"));
    if too_large {
        return PublishError::permanent(text);
    }
    // No stream (yet), a timeout, no responders, a broken connection, a stream at its
    // limits: nothing about the message; retried with backoff for as long as it lasts.
    PublishError::unavailable(text)
}

/// Refuses a destination that is not a subject one can publish to. async-nats writes the
/// subject into the protocol line as it is: a line break would inject protocol commands
/// (sent with the relay's credentials), and a space makes the server drop the connection,
/// with every acknowledgement in flight. Wildcards (`*`, `>`) and empty tokens name no
/// single subject. All are permanent: the message can never be published as it is.
fn check_subject(subject: &str) -> Result<(), PublishError> {
    let problem = if !outbox_core::event::destination_is_valid(subject) {
        Some("it is empty or holds whitespace or a control character")
    } else if subject.split('.').any(|t| t == "*" || t == ">") {
        Some("it holds a wildcard token (`*` or `>`), which names no single subject")
    } else if subject.split('.').any(str::is_empty) {
        Some("it has an empty token (a leading, trailing or doubled `.`)")
    } else {
        None
    };
    match problem {
        Some(problem) => Err(PublishError::permanent(format!(
            "nats: the destination {subject:?} is not a subject one can publish to: {problem}; \
             fix the destination where the event is emitted, then release the message"
        ))),
        None => Ok(()),
    }
}

/// The NATS headers of `record`. A header line break would let a value forge other
/// headers (a `Nats-Msg-Id` making JetStream drop the message as a duplicate), and
/// `Nats-*` headers are commands to JetStream (`Nats-Rollup` purges a stream): both
/// are refused as permanent errors rather than sent or silently dropped.
fn nats_headers(
    record: &OutboxRecord,
    cloudevents: Option<&(CloudEvents, CloudEventsMode)>,
) -> Result<HeaderMap, PublishError> {
    let refuse = |what: String| {
        Err(PublishError::permanent(format!(
            "nats: {what}; change the header or key where the event is emitted, then release the message"
        )))
    };
    let clean = |text: &str| !text.contains(['\r', '\n']);
    let id = record.id.to_string();
    let mut h = HeaderMap::new();
    h.insert(headers::NATS_MSG_ID, id.as_str());
    h.insert(headers::MESSAGE_ID, id.as_str());
    if !clean(&record.event_type) {
        return refuse("the event type contains a line break".to_owned());
    }
    h.insert(headers::EVENT_TYPE, record.event_type.as_str());
    let structured = matches!(cloudevents, Some((_, CloudEventsMode::Structured)));
    h.insert(
        headers::CONTENT_TYPE,
        if structured {
            cloudevents::STRUCTURED_CONTENT_TYPE
        } else {
            &record.content_type
        },
    );
    if let Some(version) = record.event_version {
        h.insert(headers::EVENT_VERSION, version.to_string().as_str());
    }
    if let Some(key) = &record.partition_key {
        if !clean(key) {
            return refuse("the partition key contains a line break".to_owned());
        }
        h.insert(headers::PARTITION_KEY, key.as_str());
    }
    if let Some((ce, CloudEventsMode::BinaryDraft)) = cloudevents {
        // The draft's binary mode: every attribute as `ce-<name>`, `datacontenttype`
        // included, values percent-encoded (a `source` is ASCII already, but its `%`
        // is encoded too).
        for (name, value) in ce.attributes(record) {
            h.insert(
                format!("{}{name}", headers::CLOUDEVENTS_PREFIX).as_str(),
                percent_encode_header_value(&value).as_str(),
            );
        }
        h.insert(
            format!("{}datacontenttype", headers::CLOUDEVENTS_PREFIX).as_str(),
            &*record.content_type,
        );
    }
    for (key, value) in &record.headers {
        let attribute =
            cloudevents.is_some() && is_attribute_header(key, headers::CLOUDEVENTS_PREFIX);
        if attribute
            || headers::RESERVED
                .iter()
                .any(|r| r.eq_ignore_ascii_case(key))
        {
            continue;
        }
        // Bytes, not a `str` slice: a name with a multi-byte character across byte 5
        // must be refused below, not panic here.
        if key
            .as_bytes()
            .get(..5)
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case(b"nats-"))
        {
            return refuse(format!(
                "row header {key:?} would be read by JetStream as a command (`Nats-*` headers are reserved)"
            ));
        }
        let valid_name = !key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic() && b != b':');
        if !valid_name || !clean(value) {
            return refuse(format!(
                "row header {key:?} is not a valid NATS header (names: printable ASCII without ':'; values: no line breaks)"
            ));
        }
        h.insert(key.as_str(), value.as_str());
    }
    Ok(h)
}

/// The bytes `headers` take on the wire (`NATS/1.0\r\n`, `name: value\r\n` each, `\r\n`).
fn headers_len(headers: &HeaderMap) -> usize {
    let mut n = 12;
    for (name, values) in headers.iter() {
        for value in values {
            n += name.to_string().len() + value.as_str().len() + 4;
        }
    }
    n
}

impl Publisher for NatsPublisher {
    fn messaging_system(&self) -> &'static str {
        "nats"
    }

    fn server(&self) -> Option<(&str, Option<u16>)> {
        let (host, port) = self.server.as_ref()?;
        Some((host, *port))
    }

    /// `batch_budget + ack_timeout`: no message starts after the budget, and each waits
    /// at most `ack_timeout` for its acknowledgement.
    fn max_publish_time(&self) -> Option<Duration> {
        Some(self.batch_budget + self.ack_timeout)
    }

    /// Calls may overlap: each publishes its own key chains and awaits its own acks.
    fn max_batches_in_flight(&self) -> usize {
        4
    }

    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        // One chain per key, in batch order; messages without a key are chains of one.
        let deadline = Instant::now() + self.batch_budget;
        publish_in_chains(batch, deadline, |record| self.publish_one(record)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::OutboxMessage;

    fn record_with_header(name: &str) -> OutboxRecord {
        let message = OutboxMessage::new("Counted", "orders.events", "{}")
            .with_key("k")
            .with_header(name, "v");
        OutboxRecord::from(message).with_seq(1)
    }

    /// A header name with a multi-byte character across byte 5 used to panic in the
    /// `Nats-` prefix check (`key[..5]`), killing the relay; it is a permanent error.
    /// async-nats writes the subject into the protocol line unchecked: a line break
    /// would inject commands, a space would make the server drop the connection.
    #[test]
    fn subjects_that_cannot_be_published_to_are_refused() {
        for bad in [
            "",
            "orders events",
            "orders\r\nPUB other 2\r\nhi",
            "orders\tx",
            "orders.*",
            "orders.>",
            ">",
            ".orders",
            "orders.",
            "orders..x",
            "orders\u{a0}x",
        ] {
            let refused = check_subject(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} is refused"));
            assert_eq!(
                refused.kind(),
                outbox_core::publisher::PublishErrorKind::Permanent
            );
            assert!(refused.message().contains("not a subject"), "{refused}");
        }
        for good in ["orders", "orders.events", "a-b_c.D9", "orders.é"] {
            assert!(check_subject(good).is_ok(), "{good:?} is a subject");
        }
    }

    #[test]
    fn credentials_are_taken_out_of_the_url() {
        let (url, creds) = split_credentials("nats://app:p%40ss:w@nats1:4222,nats://nats2:4222");
        assert_eq!(url, "nats://nats1:4222,nats://nats2:4222");
        match creds {
            Some(Credentials::UserPassword(user, pass)) => {
                assert_eq!((user.as_str(), pass.as_str()), ("app", "p@ss:w"));
            }
            _ => panic!("user and password expected"),
        }
        let (url, creds) = split_credentials("tls://s3cr3t-token@nats:4443/");
        assert_eq!(url, "tls://nats:4443/");
        assert!(matches!(creds, Some(Credentials::Token(t)) if t == "s3cr3t-token"));
        let (url, creds) = split_credentials("nats://app:pa?s/s@nats:4222");
        assert_eq!(url, "nats://nats:4222");
        assert!(matches!(creds, Some(Credentials::UserPassword(_, p)) if p == "pa?s/s"));
        let (url, creds) = split_credentials("u:pw@127.0.0.1:4222");
        assert_eq!(url, "127.0.0.1:4222");
        assert!(creds.is_some());
        let (url, creds) = split_credentials("nats://127.0.0.1:4222");
        assert_eq!(url, "nats://127.0.0.1:4222");
        assert!(creds.is_none());
        assert_eq!(percent_decoded("a%2"), "a%2");
        assert_eq!(percent_decoded("%zz%41"), "%zzA");
        let shown = format!(
            "{:?}",
            NatsPublisher::builder("nats://app:hunter2@nats:4222")
        );
        assert!(
            !shown.contains("hunter2") && shown.contains("nats://nats:4222"),
            "{shown}"
        );
    }

    /// Found by the `nats_credentials` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)): in a URL
    /// without a scheme, a `://` in the password was taken for the scheme's, and the
    /// part of the password before it shown.
    #[test]
    fn a_password_holding_a_scheme_separator_is_taken_whole() {
        let (clean, found) = split_credentials("bob:pa://ss@nats:4222");
        assert_eq!(clean, "nats:4222");
        match found {
            Some(Credentials::UserPassword(user, pass)) => {
                assert_eq!((user.as_str(), pass.as_str()), ("bob", "pa://ss"));
            }
            _ => panic!("user and password expected"),
        }
        let (clean, _) = split_credentials("nats://bob:pa://ss@nats:4222");
        assert_eq!(clean, "nats://nats:4222");
    }

    #[test]
    fn a_multi_byte_header_name_is_refused_not_a_panic() {
        for name in ["abcdé", "natsé", "ñats-x", "é"] {
            let refused = nats_headers(&record_with_header(name), None)
                .err()
                .unwrap_or_else(|| panic!("{name:?} is not a valid NATS header name"));
            assert_eq!(
                refused.kind(),
                outbox_core::publisher::PublishErrorKind::Permanent
            );
            assert!(
                refused.message().contains("not a valid NATS header"),
                "{refused}"
            );
        }
        let refused = nats_headers(&record_with_header("NATS-Expected-Stream"), None)
            .expect_err("a Nats-* header is refused");
        assert!(refused.message().contains("command"), "{refused}");
        assert!(nats_headers(&record_with_header("trace-id"), None).is_ok());
    }
}
