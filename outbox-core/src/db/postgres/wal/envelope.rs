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
}

#[cfg(feature = "wal")]
/// The record an envelope holds, at position `seq`.
pub(crate) fn decode(content: &[u8], seq: i64) -> std::result::Result<OutboxRecord, DecodeError> {
    // Version 1 is one JSON object whose payload may hold line feeds; `v` comes first.
    let (e, payload) = if content.starts_with(br#"{"v":1,"#) {
        let mut e: EnvelopeIn = serde_json::from_slice(content).map_err(DecodeError::Json)?;
        let payload = e.payload.take().map(|p| Payload::from(p.get()));
        (e, payload.unwrap_or_default())
    } else {
        let end = content
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(content.len());
        let e: EnvelopeIn = serde_json::from_slice(&content[..end]).map_err(DecodeError::Json)?;
        if e.v != ENVELOPE_VERSION {
            return Err(DecodeError::Version(e.v));
        }
        let payload = content.get(end + 1..).unwrap_or_default();
        (e, Payload::from(payload))
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
