//! Codecs: how an event becomes payload bytes at `emit`, and how a consumer's handler
//! reads them back, chosen by the event type.
//!
//! - **JSON**, the default: every `serde` type is [`Encode`] and [`Decode`] as JSON
//!   (`application/json`), the bytes serde_json writes.
//! - **Protobuf** (feature `protobuf`): `#[derive(OutboxEvent)]` with
//!   `#[outbox(codec = protobuf)]` on a [`prost::Message`] (a type that is not one is a
//!   compile error), `application/protobuf`.
//! - **Avro** (feature `avro`): `#[outbox(codec = avro)]` on a type deriving
//!   `apache_avro::AvroSchema`, `serde::Serialize` and `serde::Deserialize`, in Avro's
//!   [single-object encoding] (`application/avro`): two marker bytes, the writer schema's
//!   fingerprint, the datum. The AsyncAPI document carries the schema ([`avro`]).
//! - **Raw bytes**: `#[outbox(codec = bytes)]` (optionally
//!   `content_type = "image/png"`, default `application/octet-stream`) on a type that is
//!   `AsRef<[u8]>` (its payload) and `From<Vec<u8>>` (what a handler receives).
//! - Your own: implement [`Encode`] and [`Decode`] (and `OutboxEvent`, by hand: the derive
//!   takes the codecs above) for a type that is not `Serialize`.
//!
//! Every `Serialize` type is JSON by a blanket impl, so a type cannot be both `Serialize`
//! and another codec's `Encode` (Avro, whose types are `Serialize`, goes through hidden
//! hooks of `OutboxEvent` that its derive fills instead) (docs/macros.md says what to do with a Protobuf message that
//! derives serde). A reference to an event is an event when it is `Encode` too: the
//! blanket impl covers a `Serialize` type's references, the derive its codecs'; generic
//! code that emits `&E` bounds `for<'a> &'a E: Encode`.
//!
//! A consumer's handler decodes only the content types its type reads
//! ([`Decode::reads`]); any other follows the consumer's undecodable policy.
//!
//! [single-object encoding]: https://avro.apache.org/docs/1.12.0/specification/#single-object-encoding

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

/// How a handler of `T` reads payloads: what [`Decode`] says, unless the event type's
/// derive chose a codec that `serde` types cannot implement `Decode` for (Avro: its
/// types are `Deserialize`, so JSON by the blanket impl).
#[doc(hidden)]
pub struct Decoder<T> {
    /// What the type reads, for error messages.
    pub format: &'static str,
    /// Whether a payload of this content type is one the type reads.
    pub reads: fn(&str) -> bool,
    /// The value the payload holds.
    pub decode: fn(&[u8]) -> Result<T, CodecError>,
}

impl<T> std::fmt::Debug for Decoder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

impl<T: Decode> Decoder<T> {
    /// `T`'s [`Decode`].
    pub fn of() -> Self {
        Decoder {
            format: T::FORMAT,
            reads: T::reads,
            decode: T::decode_payload,
        }
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

/// The content type of an Avro payload (single-object encoding).
pub const AVRO: &str = "application/avro";

/// The AsyncAPI `schemaFormat` of the Avro schemas in the contract document.
pub const AVRO_SCHEMA_FORMAT: &str = "application/vnd.apache.avro+json;version=1.9.0";

/// The AsyncAPI `schemaFormat` of the Protobuf schemas (`.proto` text) in the contract
/// document.
pub const PROTOBUF_SCHEMA_FORMAT: &str = "application/vnd.google.protobuf;version=3";

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
    pub use super::PROTOBUF_SCHEMA_FORMAT as SCHEMA_FORMAT;

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

/// Avro through `apache-avro`, in the [single-object encoding]: what
/// `#[outbox(codec = avro)]` generates calls, and what a hand-written codec can call.
///
/// A payload is `C3 01`, the 8-byte little-endian CRC-64-AVRO (Rabin) fingerprint of
/// the writer schema's Parsing Canonical Form, then the Avro binary datum. Any Avro
/// library reads it with the writer schema, which the AsyncAPI document gives each
/// message (`schemaFormat` `application/vnd.apache.avro+json;version=1.9.0`).
///
/// A consumer whose type's schema evolved reads payloads of an earlier schema once that
/// schema is known: [`register_writer_schema`](avro::register_writer_schema) (Avro's schema resolution then fills new
/// fields from their defaults and drops removed ones). A payload of an unknown schema is
/// undecodable, with an error naming both fingerprints.
///
/// [single-object encoding]: https://avro.apache.org/docs/1.12.0/specification/#single-object-encoding
#[cfg(feature = "avro")]
pub mod avro {
    use std::any::TypeId;
    use std::collections::HashMap;
    use std::sync::{Arc, OnceLock, RwLock};

    use apache_avro::headers::{HeaderBuilder, RabinFingerprintHeader};
    use apache_avro::reader::datum::GenericDatumReader;
    use apache_avro::schema::ResolvedSchema;
    use apache_avro::{AvroSchema, GenericSingleObjectReader, Schema};
    use serde::Serialize;
    use serde::de::DeserializeOwned;

    use super::CodecError;

    pub use apache_avro;

    pub use super::AVRO as CONTENT_TYPE;

    pub use super::AVRO_SCHEMA_FORMAT as SCHEMA_FORMAT;

    /// The two marker bytes that start a single-object encoded payload.
    const MAGIC: [u8; 2] = [0xC3, 0x01];

    /// Whether `content_type` says Avro (`application/avro`, or the labels other
    /// producers use: `avro/binary`, `application/vnd.apache.avro+binary`).
    pub fn reads(content_type: &str) -> bool {
        [
            CONTENT_TYPE,
            "avro/binary",
            "application/vnd.apache.avro+binary",
        ]
        .iter()
        .any(|t| super::is_media_type(content_type, t))
    }

    /// A schema with what encoding and decoding need, made once per type.
    struct Compiled {
        schema: Schema,
        header: Vec<u8>,
        /// Reads payloads of this very schema (header checked, serde straight from the
        /// datum).
        reader: GenericSingleObjectReader,
    }

    impl Compiled {
        fn new(schema: Schema) -> Result<Self, CodecError> {
            let header = RabinFingerprintHeader::from_schema(&schema).build_header();
            let reader = GenericSingleObjectReader::builder()
                .schema(schema.clone())
                .build()?;
            Ok(Compiled {
                schema,
                header,
                reader,
            })
        }
    }

    type Cache<K> = RwLock<HashMap<K, Arc<Compiled>>>;

    /// Each type's schema, compiled at its first use.
    fn compiled<T: AvroSchema + 'static>() -> Result<Arc<Compiled>, CodecError> {
        static TYPES: OnceLock<Cache<TypeId>> = OnceLock::new();
        let types = TYPES.get_or_init(Default::default);
        let id = TypeId::of::<T>();
        if let Some(c) = types.read().unwrap_or_else(|e| e.into_inner()).get(&id) {
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(Compiled::new(T::get_schema())?);
        types
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::clone(&c));
        Ok(c)
    }

    /// The writer schemas [`register_writer_schema`] made known, by fingerprint.
    fn writers() -> &'static Cache<[u8; 8]> {
        static WRITERS: OnceLock<Cache<[u8; 8]>> = OnceLock::new();
        WRITERS.get_or_init(Default::default)
    }

    /// Makes an earlier (or another producer's) schema of an event known to this
    /// process's decoders: a payload written with it is read into a type of another
    /// schema by Avro's schema resolution.
    pub fn register_writer_schema(schema: Schema) -> Result<(), CodecError> {
        let c = Compiled::new(schema)?;
        let fingerprint = fingerprint_of(&c.header);
        writers()
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(fingerprint, Arc::new(c));
        Ok(())
    }

    fn fingerprint_of(header: &[u8]) -> [u8; 8] {
        let mut f = [0; 8];
        f.copy_from_slice(&header[2..10]);
        f
    }

    /// The fingerprint a payload of `schema` carries (CRC-64-AVRO of its Parsing
    /// Canonical Form, little-endian).
    pub fn fingerprint(schema: &Schema) -> [u8; 8] {
        fingerprint_of(&RabinFingerprintHeader::from_schema(schema).build_header())
    }

    /// `T`'s schema as the contract document gives it (the JSON form of Avro schemas).
    ///
    /// # Panics
    ///
    /// When apache-avro cannot write the schema it made as JSON (a defect of the schema's
    /// derive: the document would carry something that is no schema).
    pub fn schema_json<T: AvroSchema>() -> serde_json::Value {
        serde_json::to_value(T::get_schema()).unwrap_or_else(|e| {
            panic!(
                "the Avro schema of {} cannot be written as JSON: {e}",
                std::any::type_name::<T>()
            )
        })
    }

    /// The payload of `value`: the single-object header of `T`'s schema, then the datum.
    pub fn encode<T: AvroSchema + Serialize + 'static>(value: &T) -> Result<Vec<u8>, CodecError> {
        let c = compiled::<T>()?;
        let resolved = ResolvedSchema::try_from(&c.schema)?;
        let mut out = c.header.clone();
        apache_avro::write_avro_datum_ref(&c.schema, resolved.get_names(), value, &mut out)?;
        Ok(out)
    }

    /// The value of a payload, written with `T`'s schema or with one made known by
    /// [`register_writer_schema`].
    pub fn decode<T: AvroSchema + DeserializeOwned + 'static>(
        payload: &[u8],
    ) -> Result<T, CodecError> {
        let (written_with, mut datum) = match payload {
            [m0, m1, f @ ..] if [*m0, *m1] == MAGIC && f.len() >= 8 => {
                (fingerprint_of(payload), &f[8..])
            }
            _ => {
                return Err(format!(
                    "not an Avro single-object payload: it starts with {:02x?}, not the marker {:02x?} and an 8-byte schema fingerprint",
                    &payload[..payload.len().min(10)],
                    MAGIC
                )
                .into());
            }
        };
        let ours = compiled::<T>()?;
        if written_with == fingerprint_of(&ours.header) {
            return Ok(ours.reader.read_deser(&mut &payload[..])?);
        }
        let writer = writers()
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&written_with)
            .cloned();
        let Some(writer) = writer else {
            return Err(format!(
                "written with the Avro schema of fingerprint {} (the payload's bytes 2..10, CRC-64-AVRO little-endian), which is not {}'s ({}) and was not registered: \
                 call outbox::codec::avro::register_writer_schema with the writer's schema (the producer's contract document of that version has it)",
                hex(&written_with),
                std::any::type_name::<T>(),
                hex(&fingerprint_of(&ours.header))
            )
            .into());
        };
        let value = GenericDatumReader::builder(&writer.schema)
            .reader_schema(&ours.schema)
            .build()?
            .read_value(&mut datum)?;
        Ok(apache_avro::from_value(&value)?)
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
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
