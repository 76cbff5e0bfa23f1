//! [`RabbitTransport`]: the RabbitMQ side of an [`outbox_core::consumer::Consumer`],
//! manual acknowledgements after the database commit, a bounded prefetch, dead letters
//! published with confirms, and a new connection after the broker went away.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::Acker;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use outbox_core::consumer::{BoxError, Delivery, Origin, Transport, dead_letter_headers};
use tokio::sync::Mutex;

use crate::{Error, Needed, exists, headers, redacted, route};

/// The first wait before connecting again.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);

/// The password of an AMQP URL, as written in it.
fn password(url: &str) -> Option<String> {
    let (_, rest) = url.split_once("://")?;
    let (userinfo, _) = rest.rsplit_once('@')?;
    let (_, password) = userinfo.split_once(':')?;
    Some(password.to_owned())
}

/// What [`RabbitTransport`] needs to acknowledge a delivery.
#[derive(Debug, Clone)]
pub struct RabbitToken {
    acker: Acker,
}

/// Configures a [`RabbitTransport`]; start with [`RabbitTransport::builder`].
pub struct RabbitTransportBuilder {
    url: String,
    queue: String,
    prefetch: u16,
    connect_timeout: Duration,
    confirm_timeout: Duration,
    dead_letter: Option<String>,
}

impl fmt::Debug for RabbitTransportBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitTransportBuilder")
            .field("url", &redacted(&self.url))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

/// Consumes outbox messages from a RabbitMQ queue, for an
/// [`outbox_core::consumer::Consumer`]; start with [`RabbitTransport::builder`].
///
/// - Manual acknowledgements, sent after the message's transaction committed; at most
///   `prefetch` messages unacknowledged. A crash, or a lost connection, before the
///   acknowledgement makes the broker deliver the message again, and the inbox skips it.
/// - A lost connection (broker restart, network) is replaced, with backoff, without
///   stopping the consumer.
/// - Dead letters are published to an exchange and routing key with publisher confirms
///   and `mandatory`: an unroutable dead letter is an error, not a silent drop.
/// - The key is the `partition-key` header. Per-key order needs one consumer on the
///   queue (or RabbitMQ's single active consumer): a broker delivers a queue's messages
///   round-robin to its consumers.
pub struct RabbitTransport {
    url: String,
    queue: String,
    prefetch: u16,
    connect_timeout: Duration,
    confirm_timeout: Duration,
    /// The connection and consumer messages are read from (`None` after it failed), and
    /// the wait before the next attempt to connect again.
    link: Mutex<(Option<(Connection, lapin::Consumer)>, Duration)>,
    dead_letter: Option<String>,
    /// The dead-letter connection and its confirm-mode channel, opened at the first
    /// dead letter.
    dead_letter_link: Mutex<Option<(Connection, Channel)>>,
}

impl fmt::Debug for RabbitTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitTransport")
            .field("url", &redacted(&self.url))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

impl RabbitTransport {
    /// A consumer of `queue` on the broker at `url` (`amqp://user:password@host:5672/vhost`).
    ///
    /// Defaults: prefetch 100, connect timeout 5 s, dead-letter confirm timeout 10 s.
    pub fn builder(url: impl Into<String>, queue: impl Into<String>) -> RabbitTransportBuilder {
        RabbitTransportBuilder {
            url: url.into(),
            queue: queue.into(),
            prefetch: 100,
            connect_timeout: Duration::from_secs(5),
            confirm_timeout: Duration::from_secs(10),
            dead_letter: None,
        }
    }

    /// A connection and a consumer of the queue.
    async fn consume(&self) -> Result<(Connection, lapin::Consumer), String> {
        let open = async {
            let connection = Connection::connect(
                &self.url,
                ConnectionProperties::default()
                    .with_connection_name("outbox-rabbitmq consumer".into()),
            )
            .await?;
            let channel = connection.create_channel().await?;
            channel
                .basic_qos(self.prefetch, BasicQosOptions::default())
                .await?;
            let consumer = channel
                .basic_consume(
                    self.queue.as_str().into(),
                    ShortString::from(""),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((connection, consumer))
        };
        match tokio::time::timeout(self.connect_timeout, open).await {
            Ok(Ok(link)) => Ok(link),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {:?}", self.connect_timeout)),
        }
    }

    /// Publishes one dead letter and waits for the broker's confirmation.
    async fn publish_dead_letter(
        &self,
        channel: &Channel,
        delivery: &Delivery<RabbitToken>,
        properties: BasicProperties,
    ) -> Result<(), String> {
        let destination = self.dead_letter.as_deref().unwrap_or_default();
        let (exchange, routing_key) = route(destination)?;
        let send = async {
            channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &delivery.payload,
                    properties,
                )
                .await?
                .await
        };
        match tokio::time::timeout(self.confirm_timeout, send).await {
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(returned)))) => Err(format!(
                "no queue is bound to exchange {exchange:?} for routing key {routing_key:?} ({} {})",
                returned.reply_code, returned.reply_text
            )),
            Ok(Ok(other)) => Err(format!("the broker did not confirm it: {other:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no confirmation within {:?}", self.confirm_timeout)),
        }
    }
}

impl RabbitTransportBuilder {
    /// How many messages the broker may deliver before they are acknowledged (default
    /// 100, at least 1).
    pub fn prefetch(mut self, messages: u16) -> Self {
        self.prefetch = messages.max(1);
        self
    }

    /// How long connecting (TCP, TLS, login, channel, consume) may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a dead letter may wait for the broker's confirmation (default 10 s).
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Where [`Policy::DeadLetter`](outbox_core::consumer::Policy::DeadLetter) publishes:
    /// `exchange/routing.key`, or a queue name alone for the default exchange (the
    /// publisher's destination syntax). [`build`](Self::build) checks that it exists.
    ///
    /// A queue's own dead-letter exchange (`x-dead-letter-exchange`) is not used: a
    /// rejected message is dropped when the queue has none, and a client cannot see a
    /// queue's arguments to check.
    pub fn dead_letter(mut self, destination: impl Into<String>) -> Self {
        self.dead_letter = Some(destination.into());
        self
    }

    /// Connects, checks that the queue and the dead-letter destination exist, and
    /// starts consuming.
    pub async fn build(self) -> Result<RabbitTransport, Error> {
        let mut needed = vec![Needed::Queue(self.queue.clone())];
        if let Some(destination) = &self.dead_letter {
            needed.push(
                crate::needs(destination).map_err(|reason| Error::InvalidDestination {
                    destination: destination.clone(),
                    reason,
                })?,
            );
        }
        let transport = RabbitTransport {
            url: self.url,
            queue: self.queue,
            prefetch: self.prefetch,
            connect_timeout: self.connect_timeout,
            confirm_timeout: self.confirm_timeout,
            link: Mutex::new((None, RECONNECT_FIRST)),
            dead_letter: self.dead_letter,
            dead_letter_link: Mutex::new(None),
        };
        let connect_error = |reason: String| Error::Connect {
            url: redacted(&transport.url),
            reason,
        };
        let connection = Connection::connect(&transport.url, ConnectionProperties::default());
        let connection = match tokio::time::timeout(transport.connect_timeout, connection).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(e)) => return Err(connect_error(e.to_string())),
            Err(_) => {
                return Err(connect_error(format!(
                    "no answer within {:?}",
                    transport.connect_timeout
                )));
            }
        };
        let mut missing = Vec::new();
        for needed in needed {
            match exists(&connection, &needed).await {
                Ok(true) => {}
                Ok(false) => missing.push(needed.to_string()),
                Err(e) => {
                    return Err(Error::Lookup {
                        what: needed.to_string(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        let _ = connection
            .close(200, "outbox-rabbitmq: checked".into())
            .await;
        if !missing.is_empty() {
            return Err(Error::MissingDestinations { missing });
        }
        let link = transport.consume().await.map_err(connect_error)?;
        transport.link.lock().await.0 = Some(link);
        tracing::info!(url = %redacted(&transport.url), queue = %transport.queue, "outbox-rabbitmq consumer ready");
        Ok(transport)
    }
}

/// An AMQP header value as text, for the values a producer puts in headers.
fn value_text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        _ => return None,
    })
}

/// The headers as text; the `message_id` and `type` properties stand in for absent
/// `message-id` and `event-type` headers (a producer other than ours).
fn text_headers(properties: &BasicProperties) -> BTreeMap<String, String> {
    let mut all = BTreeMap::new();
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            if let Some(text) = value_text(value) {
                all.insert(name.to_string(), text);
            }
        }
    }
    if let Some(id) = properties.message_id() {
        all.entry(headers::MESSAGE_ID.to_owned())
            .or_insert_with(|| id.to_string());
    }
    if let Some(kind) = properties.kind() {
        all.entry(headers::EVENT_TYPE.to_owned())
            .or_insert_with(|| kind.to_string());
    }
    all
}

impl Transport for RabbitTransport {
    type Token = RabbitToken;
    const NAME: &'static str = "rabbitmq";
    const CLOUDEVENTS_PREFIX: &'static str = headers::CLOUDEVENTS_PREFIXES[0];
    const CLOUDEVENTS_OTHER_PREFIXES: &'static [&'static str] = &[
        headers::CLOUDEVENTS_PREFIXES[1],
        headers::CLOUDEVENTS_PREFIXES[2],
    ];

    async fn receive(&self) -> Result<Delivery<RabbitToken>, BoxError> {
        let mut guard = self.link.lock().await;
        let (link, backoff) = &mut *guard;
        loop {
            let Some((_, consumer)) = link.as_mut() else {
                match self.consume().await {
                    Ok(new) => {
                        tracing::info!(queue = %self.queue, "outbox-rabbitmq consumer: connected again");
                        *link = Some(new);
                        *backoff = RECONNECT_FIRST;
                    }
                    Err(reason) => {
                        tracing::warn!(url = %redacted(&self.url), queue = %self.queue, reason = %self.redact(&reason), retry_in = ?backoff,
                            "outbox-rabbitmq consumer: cannot connect; retrying");
                        // The wait is kept across calls: a `receive` dropped for another
                        // event does not start it over.
                        let wait = *backoff;
                        *backoff = (wait * 2).min(Duration::from_secs(5));
                        tokio::time::sleep(wait).await;
                    }
                }
                continue;
            };
            match consumer.next().await {
                Some(Ok(delivery)) => {
                    let headers = text_headers(&delivery.properties);
                    return Ok(Delivery::new(
                        delivery.data,
                        headers.get(headers::PARTITION_KEY).cloned(),
                        headers,
                        Origin::new(self.queue.as_str(), None, None),
                        RabbitToken {
                            acker: delivery.acker,
                        },
                    ));
                }
                // The broker went away or closed the channel: what was delivered and
                // not acknowledged is delivered again on the next connection.
                Some(Err(e)) => {
                    tracing::warn!(queue = %self.queue, error = %e, "outbox-rabbitmq consumer: connection lost; connecting again");
                    *link = None;
                }
                None => {
                    tracing::warn!(queue = %self.queue, "outbox-rabbitmq consumer: the broker cancelled the consumer; connecting again");
                    *link = None;
                }
            }
        }
    }

    async fn ack(&self, delivery: &Delivery<RabbitToken>) -> Result<(), BoxError> {
        match delivery.token.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            // The channel it came on is gone (a new connection since): the broker
            // delivers it again.
            Ok(false) => {
                Err("not sent: its channel was closed (the connection was replaced)".into())
            }
            Err(e) => Err(Box::new(e)),
        }
    }

    fn dead_letter_destination(&self) -> Option<String> {
        self.dead_letter.clone()
    }

    async fn dead_letter(
        &self,
        delivery: &Delivery<RabbitToken>,
        reason: &str,
    ) -> Result<(), BoxError> {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        let mut table = FieldTable::default();
        for (name, value) in &delivery.headers {
            if name.len() <= 255 {
                table.insert(ShortString::from(name.as_str()), text(value));
            }
        }
        table.insert(dead_letter_headers::REASON.into(), text(reason));
        table.insert(
            dead_letter_headers::SOURCE.into(),
            text(&delivery.origin.source),
        );
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(table);
        if let Some(id) = delivery.headers.get(headers::MESSAGE_ID) {
            properties = properties.with_message_id(id.as_str().into());
        }
        let mut link = self.dead_letter_link.lock().await;
        if link.is_none() {
            let open = async {
                let connection = Connection::connect(
                    &self.url,
                    ConnectionProperties::default()
                        .with_connection_name("outbox-rabbitmq dead letters".into()),
                )
                .await?;
                let channel = connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                Ok::<_, lapin::Error>((connection, channel))
            };
            *link = Some(
                tokio::time::timeout(self.connect_timeout, open)
                    .await
                    .map_err(|_| format!("no answer within {:?}", self.connect_timeout))??,
            );
        }
        let (_, channel) = link.as_ref().expect("opened above");
        let published = self
            .publish_dead_letter(channel, delivery, properties)
            .await;
        if published.is_err() {
            // The next dead letter starts on a new connection.
            *link = None;
        }
        Ok(published?)
    }

    fn redact(&self, text: &str) -> String {
        let mut text = text.replace(&self.url, &redacted(&self.url));
        if let Some(password) = password(&self.url) {
            let decoded = outbox_core::config::percent_decoded(&password);
            for secret in [password, decoded] {
                if !secret.is_empty() {
                    text = text.replace(&secret, "***");
                }
            }
        }
        text
    }
}
