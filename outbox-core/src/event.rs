//! Events and the messages they become in the outbox table.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use uuid::Uuid;

use crate::codec::{CodecError, Decoder, Encode};

use crate::payload::{content_type_is_valid, default_content_type, is_json};
use crate::{Error, Result};

pub use crate::payload::Payload;

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
///     TEMPLATED = "orders.{region}"; // braces are fine
/// }
/// assert_eq!(ORDER_EVENTS.as_str(), "orders.events");
/// ```
///
/// A name no broker can take (empty, or with whitespace or a control character) is a
/// compile error:
///
/// ```compile_fail
/// outbox_core::destinations! { pub BAD = "orders events"; }
/// ```
#[macro_export]
macro_rules! destinations {
    ($( $(#[$meta:meta])* $vis:vis $name:ident = $value:literal; )*) => {
        $(
            $(#[$meta])*
            $vis const $name: $crate::Destination = $crate::Destination::new($value);
            const _: () = if !$crate::event::destination_is_valid($value) {
                ::core::panic!(
                    "{}",
                    ::core::concat!(
                        "destination ", ::core::stringify!($value),
                        " is empty or holds whitespace or a control character, which no broker \
                         takes in a topic, subject or routing key (a line break would even inject \
                         protocol commands); use a name like \"orders.events\""
                    )
                );
            };
        )*
    };
}

/// Whether `name` can be a destination on every broker: not empty, and without
/// whitespace or control characters (Unicode's, as `char::is_whitespace` and
/// `char::is_control` say). Brokers that allow less check the rest when publishing.
/// A `const fn`, so [`destinations!`](crate::destinations) checks names at compile time.
#[doc(hidden)]
pub const fn destination_is_valid(name: &str) -> bool {
    let bytes = name.as_bytes();
    if bytes.is_empty() {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        // Decode one UTF-8 scalar (the input is a `str`, so it is well formed).
        let b = bytes[i] as u32;
        let (c, len) = if b < 0x80 {
            (b, 1)
        } else if b < 0xE0 {
            (((b & 0x1F) << 6) | (bytes[i + 1] as u32 & 0x3F), 2)
        } else if b < 0xF0 {
            (
                ((b & 0x0F) << 12)
                    | ((bytes[i + 1] as u32 & 0x3F) << 6)
                    | (bytes[i + 2] as u32 & 0x3F),
                3,
            )
        } else {
            (
                ((b & 0x07) << 18)
                    | ((bytes[i + 1] as u32 & 0x3F) << 12)
                    | ((bytes[i + 2] as u32 & 0x3F) << 6)
                    | (bytes[i + 3] as u32 & 0x3F),
                4,
            )
        };
        let control = c < 0x20 || (c >= 0x7F && c <= 0x9F);
        let whitespace = matches!(
            c,
            0x20 | 0x85 | 0xA0 | 0x1680 | 0x2000
                ..=0x200A | 0x2028 | 0x2029 | 0x202F | 0x205F | 0x3000
        );
        if control || whitespace {
            return false;
        }
        i += len;
    }
    true
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
pub trait OutboxEvent: Encode {
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

    /// The payload's content type: the type's [`Encode`], unless the derive chose a
    /// codec a `serde` type cannot implement `Encode` for (Avro). Not for your impls.
    #[doc(hidden)]
    fn __outbox_content_type(&self) -> Cow<'static, str> {
        self.payload_content_type()
    }

    /// The payload's bytes, as [`__outbox_content_type`](Self::__outbox_content_type)
    /// says. Not for your impls.
    #[doc(hidden)]
    fn __outbox_encode(&self) -> Result<Vec<u8>, CodecError> {
        self.encode_payload()
    }

    /// How a consumer's handler of this type reads payloads, when not by its
    /// [`Decode`](crate::codec::Decode). Not for your impls.
    #[doc(hidden)]
    fn __outbox_decoder() -> Option<Decoder<Self>>
    where
        Self: Sized,
    {
        None
    }
}

/// A reference to an event is the event (a `serde` type's reference is JSON too; the
/// derive gives the other codecs' references their `Encode`).
impl<'a, T: OutboxEvent + ?Sized> OutboxEvent for &'a T
where
    &'a T: Encode,
{
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
    fn __outbox_content_type(&self) -> Cow<'static, str> {
        (**self).__outbox_content_type()
    }
    fn __outbox_encode(&self) -> Result<Vec<u8>, CodecError> {
        (**self).__outbox_encode()
    }
}

/// One row of the outbox, ready to be written: an event serialized with its routing
/// data and headers.
///
/// Built from an event with [`OutboxMessage::from_event`], or with
/// [`OutboxMessage::new`] and the `with_*` methods for events that are not Rust types (a
/// gateway forwarding JSON, say). It grows new fields, so it is not built with a struct
/// literal outside this crate.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
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
    /// The payload: the exact bytes the codec wrote (serde_json's, for an event).
    pub payload: Payload,
    /// What the payload is (`application/json` unless set otherwise): the
    /// `content-type` header every broker receives, and what consumers decode by.
    pub content_type: Cow<'static, str>,
    /// Extra headers (W3C `traceparent`, correlation ids, ...).
    pub headers: BTreeMap<String, String>,
}

impl OutboxMessage {
    /// Serializes `event` into a new message with a fresh UUIDv7 id.
    pub fn from_event<E: OutboxEvent + ?Sized>(event: &E) -> Result<Self> {
        let event_type = event.event_type();
        let content_type = event.__outbox_content_type();
        let payload = event.__outbox_encode().map_err(|source| {
            match source.downcast::<serde_json::Error>() {
                Ok(source) => Error::Serialize {
                    event_type: event_type.to_owned(),
                    source: *source,
                },
                Err(source) => Error::Encode {
                    event_type: event_type.to_owned(),
                    content_type: content_type.to_string(),
                    source,
                },
            }
        })?;
        let msg = OutboxMessage {
            id: Uuid::now_v7(),
            event_type: event_type.to_owned(),
            event_version: event.version(),
            destination: event.destination().as_str().to_owned(),
            partition_key: event.partition_key(),
            payload: Payload::from(payload),
            content_type,
            headers: BTreeMap::new(),
        };
        // The codec wrote the payload: only the routing and a content type of a codec of
        // the application's own need a look.
        msg.validate_routing()?;
        msg.validate_content_type()?;
        Ok(msg)
    }

    /// A message with a fresh UUIDv7 id, no key and no headers, whose payload is JSON.
    ///
    /// `payload` is stored and published byte for byte. A JSON payload must be JSON text;
    /// for another format, say which with [`with_content_type`](Self::with_content_type).
    /// The payload, its content type and the routing fields are checked when the message
    /// is emitted, and a bad message is refused with [`Error::InvalidMessage`].
    ///
    /// ```
    /// use outbox_core::OutboxMessage;
    ///
    /// let json = OutboxMessage::new("OrderPlaced", "orders", r#"{"id": 7}"#);
    /// assert_eq!(json.content_type, "application/json");
    /// let protobuf = OutboxMessage::new("OrderPlaced", "orders", vec![0x08, 0x07])
    ///     .with_content_type("application/protobuf");
    /// assert_eq!(protobuf.payload, vec![0x08, 0x07]);
    /// ```
    pub fn new(
        event_type: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<Payload>,
    ) -> Self {
        OutboxMessage {
            id: Uuid::now_v7(),
            event_type: event_type.into(),
            event_version: None,
            destination: destination.into(),
            partition_key: None,
            payload: payload.into(),
            content_type: default_content_type(),
            headers: BTreeMap::new(),
        }
    }

    /// Sets what the payload is, as a media type (`application/protobuf`,
    /// `application/vnd.apache.avro+binary`, `application/octet-stream`, ...). A JSON
    /// type (`application/json`, `...+json`) requires a JSON payload; any other is carried
    /// as it is.
    pub fn with_content_type(mut self, content_type: impl Into<Cow<'static, str>>) -> Self {
        self.content_type = content_type.into();
        self
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

    /// Checks what the database cannot: non-empty routing fields, a content type that can
    /// travel as a header, and a JSON payload where the content type says JSON.
    pub(crate) fn validate(&self) -> Result<()> {
        self.validate_routing()?;
        self.validate_content_type()?;
        if is_json(&self.content_type)
            && let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&self.payload)
        {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) has the content type {} but a payload that is not JSON \
                     ({e}); send JSON, or say what the payload is with `with_content_type` \
                     (e.g. \"application/octet-stream\")",
                    self.id, self.event_type, self.content_type
                )
                .into(),
            ));
        }
        Ok(())
    }

    fn validate_content_type(&self) -> Result<()> {
        if !content_type_is_valid(&self.content_type) {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) has the content type {:?}, which is not a media type that \
                     can travel as a header (printable ASCII `type/subtype`, parameters allowed, \
                     at most 255 bytes); use one like \"application/protobuf\"",
                    self.id, self.event_type, self.content_type
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
        if has_nul {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) contains a NUL character (in its type, destination, key or \
                     headers), which database text cannot store; remove it (a payload may hold \
                     any byte)",
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
        if !destination_is_valid(&self.destination) {
            return Err(Error::InvalidMessage(
                format!(
                    "message {} (`{}`) has the destination {:?}, which holds whitespace or a control \
                     character: no broker takes that in a topic, subject or routing key (a line break \
                     would even inject protocol commands); use a name like \"orders.events\"",
                    self.id, self.event_type, self.destination
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_with_whitespace_or_control_characters_are_invalid() {
        for bad in [
            "",
            "a b",
            "a\r\nPUB x 1",
            "a\tb",
            "a\u{85}b",
            "a\u{a0}b",
            "a\u{3000}b",
            "\u{7f}",
        ] {
            assert!(!destination_is_valid(bad), "{bad:?}");
            assert_eq!(
                !destination_is_valid(bad),
                bad.is_empty() || bad.chars().any(|c| c.is_whitespace() || c.is_control()),
                "{bad:?}: the const check agrees with std"
            );
        }
        for good in ["orders.events", "é", "注文", "a-b_c/d:e", "🦀"] {
            assert!(destination_is_valid(good), "{good:?}");
        }
        // The const check and std agree on every scalar value.
        for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
            let s = c.to_string();
            assert_eq!(
                destination_is_valid(&s),
                !(c.is_whitespace() || c.is_control()),
                "U+{:04X}",
                c as u32
            );
        }
    }
}
