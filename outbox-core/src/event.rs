//! Events and the messages they become in the outbox table.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use uuid::Uuid;

use crate::{Error, Result};

/// A named place events are published to: a Kafka topic, an exchange, a subject.
///
/// Declare destinations once with [`destinations!`](crate::destinations) so a misspelt
/// route is a compile error instead of a topic nobody reads.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Destination(&'static str);

impl Destination {
    /// A destination named `name`.
    pub const fn new(name: &'static str) -> Self {
        Destination(name)
    }

    /// The destination's name.
    pub const fn as_str(&self) -> &'static str {
        self.0
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Destination({:?})", self.0)
    }
}

impl From<Destination> for &'static str {
    fn from(d: Destination) -> Self {
        d.0
    }
}

impl AsRef<str> for Destination {
    fn as_ref(&self) -> &str {
        self.0
    }
}

/// Declares named [`Destination`] constants.
///
/// ```
/// outbox_core::destinations! {
///     /// Everything the order service announces.
///     pub ORDER_EVENTS = "orders.events";
///     pub(crate) AUDIT = "audit";
/// }
/// assert_eq!(ORDER_EVENTS.as_str(), "orders.events");
/// ```
#[macro_export]
macro_rules! destinations {
    ($( $(#[$meta:meta])* $vis:vis $name:ident = $value:literal; )*) => {
        $(
            $(#[$meta])*
            $vis const $name: $crate::Destination = $crate::Destination::new($value);
        )*
    };
}

/// An event that can be written to the outbox.
///
/// Usually derived with `#[derive(OutboxEvent)]`; it can be implemented by hand:
///
/// ```
/// use outbox_core::{Destination, OutboxEvent};
///
/// #[derive(serde::Serialize)]
/// struct OrderConfirmed { order_id: u64 }
///
/// impl OutboxEvent for OrderConfirmed {
///     fn event_type(&self) -> &'static str { "OrderConfirmed" }
///     fn destination(&self) -> Destination { Destination::new("orders.events") }
///     fn partition_key(&self) -> Option<String> { Some(self.order_id.to_string()) }
/// }
/// ```
pub trait OutboxEvent: Serialize {
    /// The event type name consumers dispatch on, e.g. `"OrderConfirmed"`.
    fn event_type(&self) -> &'static str;

    /// Where the event is published.
    fn destination(&self) -> Destination;

    /// The partition key: events with the same key are published in the order they were
    /// written. `None` means no ordering with respect to other events.
    fn partition_key(&self) -> Option<String> {
        None
    }

    /// The schema version of the payload, if the event type is versioned.
    fn version(&self) -> Option<i32> {
        None
    }
}

impl<T: OutboxEvent + ?Sized> OutboxEvent for &T {
    fn event_type(&self) -> &'static str {
        (**self).event_type()
    }
    fn destination(&self) -> Destination {
        (**self).destination()
    }
    fn partition_key(&self) -> Option<String> {
        (**self).partition_key()
    }
    fn version(&self) -> Option<i32> {
        (**self).version()
    }
}

/// One row of the outbox, ready to be written: an event serialized with its routing
/// data and headers.
///
/// Built from an event with [`OutboxMessage::from_event`], or field by field for events
/// that are not Rust types (a gateway forwarding JSON, say).
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// The message id (UUIDv7): consumers deduplicate on it.
    pub id: Uuid,
    /// The event type name.
    pub event_type: String,
    /// The payload's schema version.
    pub event_version: Option<i32>,
    /// Where the message is published.
    pub destination: String,
    /// Messages with the same key are published in order.
    pub partition_key: Option<String>,
    /// The payload, as JSON text.
    pub payload: String,
    /// Extra headers (W3C `traceparent`, correlation ids, ...).
    pub headers: BTreeMap<String, String>,
}

impl OutboxMessage {
    /// Serializes `event` into a new message with a fresh UUIDv7 id.
    pub fn from_event<E: OutboxEvent + ?Sized>(event: &E) -> Result<Self> {
        let event_type = event.event_type();
        let payload = serde_json::to_string(event).map_err(|source| Error::Serialize {
            event_type: event_type.to_owned(),
            source,
        })?;
        let msg = OutboxMessage {
            id: Uuid::now_v7(),
            event_type: event_type.to_owned(),
            event_version: event.version(),
            destination: event.destination().as_str().to_owned(),
            partition_key: event.partition_key(),
            payload,
            headers: BTreeMap::new(),
        };
        // serde_json wrote the payload, so it is JSON: only the routing needs a look.
        msg.validate_routing()?;
        Ok(msg)
    }

    /// A message with a fresh UUIDv7 id, no key and no headers.
    ///
    /// `payload` must be JSON text; that and the routing fields are checked when the
    /// message is emitted, and a bad message is refused with [`Error::InvalidMessage`].
    pub fn new(
        event_type: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<String>,
    ) -> Self {
        OutboxMessage {
            id: Uuid::now_v7(),
            event_type: event_type.into(),
            event_version: None,
            destination: destination.into(),
            partition_key: None,
            payload: payload.into(),
            headers: BTreeMap::new(),
        }
    }

    /// Sets the partition key.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The headers as the JSON object text the outbox stores.
    pub(crate) fn headers_json(&self) -> Result<String> {
        if self.headers.is_empty() {
            return Ok("{}".to_owned());
        }
        serde_json::to_string(&self.headers).map_err(|source| Error::Serialize {
            event_type: self.event_type.clone(),
            source,
        })
    }

    /// Checks what the database cannot: non-empty routing fields and a JSON payload.
    pub(crate) fn validate(&self) -> Result<()> {
        self.validate_routing()?;
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&self.payload) {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) has a payload that is not JSON ({e}); the outbox stores JSON payloads",
                    self.id, self.event_type
                )
                .into(),
            ));
        }
        Ok(())
    }

    fn validate_routing(&self) -> Result<()> {
        let has_nul = self.event_type.contains('\0')
            || self.destination.contains('\0')
            || self
                .partition_key
                .as_deref()
                .is_some_and(|k| k.contains('\0'))
            || self
                .headers
                .iter()
                .any(|(k, v)| k.contains('\0') || v.contains('\0'));
        if has_nul || self.payload.contains("\\u0000") {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) contains a NUL character (in its type, destination, key, headers \
                     or as \\u0000 in its payload), which database text and PostgreSQL jsonb cannot \
                     store; remove it",
                    self.id, self.event_type
                )
                .into(),
            ));
        }
        if self.event_type.trim().is_empty() {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} has an empty event type; give every event a type name",
                    self.id
                )
                .into(),
            ));
        }
        if self.destination.trim().is_empty() {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) has an empty destination; say where it is published",
                    self.id, self.event_type
                )
                .into(),
            ));
        }
        if let Some(value) = self.headers.get("") {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) has a header with an empty name (value {value:?}); name every header",
                    self.id, self.event_type
                )
                .into(),
            ));
        }
        Ok(())
    }
}
