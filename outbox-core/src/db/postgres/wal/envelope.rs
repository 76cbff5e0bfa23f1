//! The envelope: one event as `pg_logical_emit_message` writes it (a JSON object,
//! `payload` last and verbatim), and its decoding into a record.

use super::*;

/// The envelope's format version (its `v`).
pub(crate) const ENVELOPE_VERSION: u8 = 1;

/// One event as written into the WAL: a JSON object, `payload` last and verbatim.
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
    pub(super) payload: &'a RawValue,
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
    pub(super) payload: Box<RawValue>,
}

/// `message` as its WAL envelope.
pub(crate) fn envelope(message: &OutboxMessage, created_at: DateTime<Utc>) -> Result<String> {
    let payload: &RawValue = serde_json::from_str(&message.payload).map_err(|e| {
        Error::InvalidMessage(
            format!(
                "message {} (`{}`): the payload is not JSON ({e}); WAL mode carries it verbatim",
                message.id, message.event_type
            )
            .into(),
        )
    })?;
    let out = EnvelopeOut {
        v: ENVELOPE_VERSION,
        id: message.id,
        event_type: &message.event_type,
        version: message.event_version,
        destination: &message.destination,
        key: message.partition_key.as_deref(),
        headers: &message.headers,
        created_at,
        payload,
    };
    serde_json::to_string(&out).map_err(|e| Error::InvalidMessage(e.to_string().into()))
}

#[cfg(feature = "wal")]
/// Why a WAL message is not a record this relay can read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    /// Not the JSON object an envelope is.
    #[error("not an outbox envelope ({0})")]
    Json(serde_json::Error),
    /// An envelope of a version this relay does not know (a newer writer).
    #[error(
        "envelope version {0} (this relay reads version {ENVELOPE_VERSION}): upgrade the relay"
    )]
    Version(u8),
}

#[cfg(feature = "wal")]
/// The record an envelope holds, at position `seq`.
pub(crate) fn decode(content: &[u8], seq: i64) -> std::result::Result<OutboxRecord, DecodeError> {
    let e: EnvelopeIn = serde_json::from_slice(content).map_err(DecodeError::Json)?;
    if e.v != ENVELOPE_VERSION {
        return Err(DecodeError::Version(e.v));
    }
    Ok(OutboxRecord {
        seq,
        id: e.id,
        event_type: e.event_type,
        event_version: e.version,
        destination: e.destination,
        partition_key: e.key,
        payload: e.payload.get().to_owned(),
        headers: e.headers,
        created_at: e.created_at,
        attempts: 0,
    })
}

#[cfg(all(test, feature = "wal"))]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_round_trips_with_its_payload_verbatim() {
        let m = OutboxMessage::new("OrderPlaced", "orders", r#"{"z":1, "a":[true]}"#)
            .with_key("order-1")
            .with_header("traceparent", "00-1-2-01");
        let at = Utc::now();
        let text = envelope(&m, at).expect("envelope");
        assert!(text.starts_with(r#"{"v":1,"#), "{text}");
        let r = decode(text.as_bytes(), 7).expect("decode");
        assert_eq!(r.seq, 7);
        assert_eq!(r.id, m.id);
        assert_eq!(r.payload, r#"{"z":1, "a":[true]}"#);
        assert_eq!(r.partition_key.as_deref(), Some("order-1"));
        assert_eq!(r.headers, m.headers);
        assert_eq!(r.created_at, at);
        let future = text.replacen(r#""v":1"#, r#""v":2"#, 1);
        let err = decode(future.as_bytes(), 1).expect_err("unknown version");
        assert!(matches!(err, DecodeError::Version(2)), "{err}");
        assert!(err.to_string().contains("upgrade the relay"), "{err}");
        let bad = OutboxMessage::new("T", "d", "not json");
        assert!(envelope(&bad, at).is_err());
    }
}
