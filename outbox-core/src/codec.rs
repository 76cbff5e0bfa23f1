//! Codecs: how an event becomes payload bytes at `emit`, and how a consumer's handler
//! reads them back, chosen by the event type.
//!
//! - **JSON**, the default: every `serde` type is [`Encode`] and [`Decode`] as JSON
//!   (`application/json`), the bytes serde_json writes.
//! - **Protobuf** (feature `protobuf`): `#[derive(OutboxEvent)]` with
//!   `#[outbox(codec = protobuf)]` on a [`prost::Message`] (a type that is not one is a
//!   compile error), `application/protobuf`.
//! - **Raw bytes**: `#[outbox(codec = bytes)]` (optionally
//!   `content_type = "image/png"`, default `application/octet-stream`) on a type that is
//!   `AsRef<[u8]>` (its payload) and `From<Vec<u8>>` (what a handler receives).
//! - Your own: implement [`Encode`] and [`Decode`] (and `OutboxEvent`, by hand: the derive
//!   takes the codecs above) for a type that is not `Serialize`.
//!
//! Every `Serialize` type is JSON by a blanket impl, so a type cannot be both `Serialize`
//! and another codec's (docs/macros.md says what to do with a Protobuf message that
//! derives serde). A reference to an event is an event when it is `Encode` too: the
//! blanket impl covers a `Serialize` type's references, the derive its codecs'; generic
//! code that emits `&E` bounds `for<'a> &'a E: Encode`.
//!
//! A consumer's handler decodes only the content types its type reads
//! ([`Decode::reads`]); any other follows the consumer's undecodable policy.

use std::borrow::Cow;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::payload::{JSON, is_json};

/// An error of a codec, with its cause.
pub type CodecError = Box<dyn std::error::Error + Send + Sync>;

/// How a value becomes a message's payload: its bytes and their content type.
///
/// Every `serde::Serialize` type is JSON. A type that is not can implement it (or have
/// `#[derive(OutboxEvent)]` implement it with `#[outbox(codec = ...)]`):
///
/// ```
/// use std::borrow::Cow;
/// use outbox_core::codec::{CodecError, Encode};
///
/// struct Thumbnail(Vec<u8>);
///
/// impl Encode for Thumbnail {
///     fn payload_content_type(&self) -> Cow<'static, str> {
///         Cow::Borrowed("image/png")
///     }
///     fn encode_payload(&self) -> Result<Vec<u8>, CodecError> {
///         Ok(self.0.clone())
///     }
/// }
/// ```
pub trait Encode {
    /// The media type of what [`encode_payload`](Self::encode_payload) writes.
    fn payload_content_type(&self) -> Cow<'static, str>;

    /// The payload's bytes: stored and delivered as they are.
    fn encode_payload(&self) -> Result<Vec<u8>, CodecError>;
}

impl<T: Serialize + ?Sized> Encode for T {
    fn payload_content_type(&self) -> Cow<'static, str> {
        Cow::Borrowed(JSON)
    }

    fn encode_payload(&self) -> Result<Vec<u8>, CodecError> {
        Ok(serde_json::to_vec(self)?)
    }
}

/// How a consumer's handler reads a payload back into its type.
///
/// Every `serde::de::DeserializeOwned` type reads JSON.
pub trait Decode: Sized {
    /// What the type reads, for error messages: `JSON`, `Protobuf`, ...
    const FORMAT: &'static str;

    /// Whether a payload of `content_type` is one this type reads. A message without a
    /// content type is read as the type's own format.
    fn reads(content_type: &str) -> bool;

    /// The value the payload holds.
    fn decode_payload(payload: &[u8]) -> Result<Self, CodecError>;
}

/// JSON is read from `application/json` and `+json` types, and from the labels other
/// producers put on JSON (`text/json`, `text/plain`); a payload that is not JSON after
/// all is undecodable when it is parsed.
impl<T: DeserializeOwned> Decode for T {
    const FORMAT: &'static str = "JSON";

    fn reads(content_type: &str) -> bool {
        is_json(content_type)
            || is_media_type(content_type, "text/json")
            || is_media_type(content_type, "text/plain")
    }

    fn decode_payload(payload: &[u8]) -> Result<Self, CodecError> {
        Ok(serde_json::from_slice(payload)?)
    }
}

/// Whether `content_type` names `essence` (a `type/subtype`), parameters and case aside.
pub fn is_media_type(content_type: &str, essence: &str) -> bool {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .eq_ignore_ascii_case(essence)
}

/// The content type of raw bytes without a type of their own.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// The content type of a Protobuf payload.
pub const PROTOBUF: &str = "application/protobuf";

/// Raw bytes: what `#[outbox(codec = bytes)]` generates calls.
#[doc(hidden)]
pub mod bytes {
    use super::CodecError;

    /// The payload of a type that is its bytes.
    pub fn encode<T: AsRef<[u8]> + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
        Ok(value.as_ref().to_vec())
    }

    /// The value of a type made from its bytes.
    pub fn decode<T: From<Vec<u8>>>(payload: &[u8]) -> Result<T, CodecError> {
        Ok(T::from(payload.to_vec()))
    }
}

/// Protobuf through `prost`: what `#[outbox(codec = protobuf)]` generates calls.
#[cfg(feature = "protobuf")]
pub mod protobuf {
    use super::CodecError;

    pub use super::PROTOBUF as CONTENT_TYPE;

    /// Whether `content_type` says Protobuf (`application/protobuf`, or the older
    /// `application/x-protobuf`).
    pub fn reads(content_type: &str) -> bool {
        super::is_media_type(content_type, CONTENT_TYPE)
            || super::is_media_type(content_type, "application/x-protobuf")
    }

    /// The message's wire format.
    pub fn encode<M: prost::Message>(message: &M) -> Result<Vec<u8>, CodecError> {
        Ok(message.encode_to_vec())
    }

    /// The message the wire format holds.
    pub fn decode<M: prost::Message + Default>(payload: &[u8]) -> Result<M, CodecError> {
        Ok(M::decode(payload)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Order {
        id: u32,
        note: String,
    }

    #[test]
    fn serde_types_are_json_with_serde_json_bytes() {
        let order = Order {
            id: 7,
            note: "é".to_owned(),
        };
        assert_eq!(order.payload_content_type(), "application/json");
        let bytes = order.encode_payload().expect("encode");
        assert_eq!(bytes, serde_json::to_vec(&order).expect("serde"));
        assert!(<Order as Decode>::reads("application/json; charset=utf-8"));
        assert!(<Order as Decode>::reads("text/plain; charset=utf-8"));
        assert!(!<Order as Decode>::reads("application/protobuf"));
        assert!(!<Order as Decode>::reads("application/octet-stream"));
        assert_eq!(Order::decode_payload(&bytes).expect("decode"), order);
        assert!(Order::decode_payload(b"\x08\x07").is_err());
    }

    #[test]
    fn raw_bytes_round_trip() {
        let bytes = bytes::encode(&vec![0u8, 255, 10]).expect("encode");
        assert_eq!(bytes, [0, 255, 10]);
        let back: Vec<u8> = bytes::decode(&bytes).expect("decode");
        assert_eq!(back, [0, 255, 10]);
        assert!(is_media_type("Application/Octet-Stream; x=1", OCTET_STREAM));
    }
}
