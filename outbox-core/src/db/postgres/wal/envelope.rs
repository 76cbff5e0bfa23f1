//! The envelope: one event as `pg_logical_emit_message` writes it, and its decoding into
//! a record.
//!
//! Version 2 (written since payloads are bytes): a JSON object of the routing fields,
//! one line feed, then the payload's bytes exactly as they were emitted. The object is
//! compact JSON, whose strings escape every line feed, so the first line feed ends it.
//! Version 1 (read, for messages still in a slot written by an older version): one JSON
//! object with the payload verbatim as its last member, `payload`.

use super::*;

/// The envelope's format version (its `v`) this version writes.
pub(crate) const ENVELOPE_VERSION: u8 = 2;

/// The routing fields of one event as written into the WAL, before its payload.
#[derive(Serialize)]
pub(super) struct EnvelopeOut<'a> {
    pub(super) v: u8,
    pub(super) id: Uuid,
    #[serde(rename = "type")]
    pub(super) event_type: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) version: Option<i32>,
    pub(super) destination: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) key: Option<&'a str>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) headers: &'a BTreeMap<String, String>,
    pub(super) created_at: DateTime<Utc>,
    /// Absent for JSON, the default.
    #[serde(skip_serializing_if = "is_default_content_type")]
    pub(super) content_type: &'a str,
}

fn is_default_content_type(content_type: &&str) -> bool {
    *content_type == crate::publisher::headers::JSON
}

#[cfg(feature = "wal")]
#[derive(Deserialize)]
pub(super) struct EnvelopeIn {
    pub(super) v: u8,
    pub(super) id: Uuid,
    #[serde(rename = "type")]
    pub(super) event_type: String,
    #[serde(default)]
    pub(super) version: Option<i32>,
    pub(super) destination: String,
    #[serde(default)]
    pub(super) key: Option<String>,
    #[serde(default)]
    pub(super) headers: BTreeMap<String, String>,
    pub(super) created_at: DateTime<Utc>,
    #[serde(default)]
    pub(super) content_type: Option<String>,
    /// Version 1 only: the payload, verbatim JSON.
    #[serde(default)]
    pub(super) payload: Option<Box<RawValue>>,
}

/// `message` as its WAL envelope (version 2).
pub(crate) fn envelope(message: &OutboxMessage, created_at: DateTime<Utc>) -> Result<Vec<u8>> {
    let out = EnvelopeOut {
        v: ENVELOPE_VERSION,
        id: message.id,
        event_type: &message.event_type,
        version: message.event_version,
        destination: &message.destination,
        key: message.partition_key.as_deref(),
        headers: &message.headers,
        created_at,
        content_type: &message.content_type,
    };
    let mut bytes = Vec::with_capacity(message.payload.len() + 160);
    serde_json::to_writer(&mut bytes, &out)
        .map_err(|e| Error::InvalidMessage(e.to_string().into()))?;
    bytes.push(b'\n');
    bytes.extend_from_slice(&message.payload);
    Ok(bytes)
}

#[cfg(feature = "wal")]
/// Why a WAL message is not a record this relay can read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    /// Not the JSON object an envelope is (or starts with).
    #[error("not an outbox envelope ({0})")]
    Json(serde_json::Error),
    /// An envelope of a version this relay does not know (a newer writer).
    #[error(
        "envelope version {0} (this relay reads versions 1 and {ENVELOPE_VERSION}): upgrade the relay"
    )]
    Version(u8),
    /// A version 2 envelope whose routing object is not followed by the line feed that
    /// starts its payload (cut short, or not written by outbox).
    #[error("envelope version 2 without the line feed after its routing fields")]
    NoPayload,
}

#[cfg(feature = "wal")]
/// The record an envelope holds, at position `seq`.
pub(crate) fn decode(content: &[u8], seq: i64) -> std::result::Result<OutboxRecord, DecodeError> {
    // The first JSON value: the whole envelope in version 1 (its payload inside, written
    // by any JSON writer, spaces and key order as it likes), the routing fields in
    // version 2, then a line feed and the payload.
    let mut values = serde_json::Deserializer::from_slice(content).into_iter::<EnvelopeIn>();
    let mut e = match values.next() {
        Some(Ok(e)) => e,
        Some(Err(error)) => return Err(DecodeError::Json(error)),
        None => {
            return Err(DecodeError::Json(serde::de::Error::custom(
                "an empty message",
            )));
        }
    };
    let end = values.byte_offset();
    let payload = match e.v {
        1 => {
            if content[end..].iter().any(|b| !b.is_ascii_whitespace()) {
                return Err(DecodeError::Json(serde::de::Error::custom(
                    "bytes after a version 1 envelope",
                )));
            }
            let payload = e
                .payload
                .take()
                .ok_or_else(|| DecodeError::Json(serde::de::Error::missing_field("payload")))?;
            Payload::from(payload.get())
        }
        ENVELOPE_VERSION => match content.get(end) {
            Some(b'\n') => Payload::from(&content[end + 1..]),
            _ => return Err(DecodeError::NoPayload),
        },
        v => return Err(DecodeError::Version(v)),
    };
    Ok(OutboxRecord {
        seq,
        id: e.id,
        event_type: e.event_type,
        event_version: e.version,
        destination: e.destination,
        partition_key: e.key,
        payload,
        content_type: e
            .content_type
            .map_or(crate::payload::default_content_type(), Into::into),
        headers: e.headers,
        created_at: e.created_at,
        attempts: 0,
    })
}

#[cfg(all(test, feature = "wal"))]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_round_trips_with_its_payload_byte_for_byte() {
        let m = OutboxMessage::new("OrderPlaced", "orders", "{\"z\":1,\n \"a\":[true]}")
            .with_key("order-1")
            .with_header("traceparent", "00-1-2-01");
        let at = Utc::now();
        let bytes = envelope(&m, at).expect("envelope");
        assert!(bytes.starts_with(br#"{"v":2,"#), "{bytes:?}");
        let r = decode(&bytes, 7).expect("decode");
        assert_eq!(r.seq, 7);
        assert_eq!(r.id, m.id);
        assert_eq!(r.payload, "{\"z\":1,\n \"a\":[true]}");
        assert_eq!(r.content_type, "application/json");
        assert_eq!(r.partition_key.as_deref(), Some("order-1"));
        assert_eq!(r.headers, m.headers);
        assert_eq!(r.created_at, at);

        let binary: Vec<u8> = (0..=255).chain([b'\n', 0, b'{']).collect();
        let m = OutboxMessage::new("Blob", "blobs", binary.clone())
            .with_content_type("application/octet-stream");
        let r = decode(&envelope(&m, at).expect("envelope"), 8).expect("decode");
        assert_eq!(r.payload, binary);
        assert_eq!(r.content_type, "application/octet-stream");
        let empty = OutboxMessage::new("Empty", "blobs", Vec::new())
            .with_content_type("application/octet-stream");
        let r = decode(&envelope(&empty, at).expect("envelope"), 9).expect("decode");
        assert!(r.payload.is_empty());

        let future = [
            br#"{"v":3,"#.as_slice(),
            &envelope(&m, at).expect("envelope")[7..],
        ]
        .concat();
        let err = decode(&future, 1).expect_err("unknown version");
        assert!(matches!(err, DecodeError::Version(3)), "{err}");
        assert!(err.to_string().contains("upgrade the relay"), "{err}");
    }

    /// A version 1 envelope is told by its `v`, whoever wrote it (PostgreSQL's
    /// `json_build_object` puts spaces around every colon); a version 2 envelope without
    /// its line feed is refused, not published with an empty payload.
    #[test]
    fn versions_are_told_by_v_and_a_cut_envelope_is_refused() {
        let spaced = r#"{"v" : 1, "id" : "0190d5a4-7a55-7c3a-9a4b-1f2e3d4c5b6a", "type" : "T", "destination" : "d", "created_at" : "2026-01-01T00:00:00Z", "payload" : {"n" : 1}}"#;
        let r = decode(spaced.as_bytes(), 1).expect("a version 1 envelope with spaces");
        assert_eq!(r.payload, r#"{"n" : 1}"#);
        let m = OutboxMessage::new("T", "d", "{}");
        let mut cut = envelope(&m, Utc::now()).expect("envelope");
        cut.truncate(cut.len() - 3); // the line feed and the payload gone
        assert!(matches!(decode(&cut, 1), Err(DecodeError::NoPayload)));
        let no_payload = spaced.replace(r#", "payload" : {"n" : 1}"#, "");
        assert!(matches!(
            decode(no_payload.as_bytes(), 1),
            Err(DecodeError::Json(_))
        ));
        assert!(decode(b"", 1).is_err());
        assert!(decode(b"not json", 1).is_err());
    }

    /// What a relay of the previous version left in a slot still publishes the bytes it
    /// would have published: the payload as it was written into the envelope.
    #[test]
    fn a_version_1_envelope_is_still_read() {
        let v1 = r#"{"v":1,"id":"0190d5a4-7a55-7c3a-9a4b-1f2e3d4c5b6a","type":"OrderPlaced","destination":"orders","key":"k","created_at":"2026-01-01T00:00:00Z","payload":{"z":1,
 "a":[true]}}"#;
        let r = decode(v1.as_bytes(), 3).expect("decode");
        assert_eq!(r.payload, "{\"z\":1,\n \"a\":[true]}");
        assert_eq!(r.content_type, "application/json");
        assert_eq!(r.partition_key.as_deref(), Some("k"));
        assert_eq!(r.event_type, "OrderPlaced");
    }
}
