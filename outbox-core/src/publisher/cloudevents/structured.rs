//! CloudEvents **structured content mode** with the JSON event format (CloudEvents
//! 1.0.2 `formats/json-format.md`): the attributes and the payload in one JSON object,
//! the message's content type `application/cloudevents+json`. The NATS publisher writes
//! it on request (the released NATS binding 1.0.2 knows no other mode); every consumer
//! unwraps it.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::CloudEvents;
use crate::publisher::OutboxRecord;

/// The content type of a structured-mode message.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// Whether `content_type` (a `content-type` header) says structured mode with the JSON
/// format: `application/cloudevents+json`, parameters and case aside.
pub fn is_structured(content_type: &str) -> bool {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case(STRUCTURED_CONTENT_TYPE)
}

/// A payload whose content type says JSON but that is not JSON cannot be the `data` of a
/// JSON event.
#[derive(Debug, thiserror::Error)]
#[error(
    "message {id}: the payload is not JSON, so it cannot be the `data` of a structured-mode CloudEvent: {reason}"
)]
pub struct NotJson {
    /// The outbox message id.
    pub id: uuid::Uuid,
    /// The parser's complaint.
    pub reason: String,
}

impl CloudEvents {
    /// `record` as a JSON event: `specversion`, `id`, `source`, `type`, `time` (as
    /// [`attributes`](Self::attributes)), `datacontenttype` (the record's content type)
    /// and the payload: a JSON payload, as written, as `data`; any other as `data_base64`
    /// (the JSON format's rule for binary data).
    pub fn structured(&self, record: &OutboxRecord) -> Result<String, NotJson> {
        let mut event = serde_json::Map::new();
        for (name, value) in self.attributes(record) {
            event.insert(name.to_owned(), value.into());
        }
        event.insert(
            "datacontenttype".to_owned(),
            record.content_type.as_ref().into(),
        );
        if !crate::payload::is_json(&record.content_type) {
            use base64::Engine as _;
            let data = base64::engine::general_purpose::STANDARD.encode(&record.payload);
            event.insert("data_base64".to_owned(), data.into());
            return Ok(serde_json::to_string(&event).unwrap_or_default());
        }
        let data: &RawValue = std::str::from_utf8(&record.payload)
            .map_err(|e| e.to_string())
            .and_then(|text| serde_json::from_str(text).map_err(|e| e.to_string()))
            .map_err(|reason| NotJson {
                id: record.id,
                reason,
            })?;
        let head = serde_json::to_string(&event).unwrap_or_default();
        // The attributes, then `data` exactly as the payload was written.
        let head = head.strip_suffix('}').unwrap_or(&head);
        Ok(format!("{head},\"data\":{}}}", data.get()))
    }
}

/// A structured-mode event as a consumer needs it: its `id`, `type` and
/// `datacontenttype`, and its data: the bytes of the JSON value `data`, or the bytes
/// `data_base64` encodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwrapped {
    /// The `id` attribute.
    pub id: Option<String>,
    /// The `type` attribute.
    pub kind: Option<String>,
    /// The `datacontenttype` attribute (absent: JSON when the data came as `data`).
    pub content_type: Option<String>,
    /// The data: `data` as JSON text, or the bytes of `data_base64`.
    pub data: Vec<u8>,
    /// Whether the data came as `data_base64`.
    pub base64: bool,
}

/// Reads a JSON event (`payload` of a message whose content type [`is_structured`]).
pub fn unwrap(payload: &[u8]) -> Result<Unwrapped, String> {
    #[derive(Deserialize)]
    struct Event<'a> {
        id: Option<String>,
        #[serde(rename = "type")]
        kind: Option<String>,
        datacontenttype: Option<String>,
        #[serde(borrow)]
        data: Option<&'a RawValue>,
        data_base64: Option<String>,
    }
    let event: Event<'_> = serde_json::from_slice(payload)
        .map_err(|e| format!("a structured-mode CloudEvent that is not a JSON event: {e}"))?;
    let base64 = event.data_base64.is_some();
    let data = match (event.data, event.data_base64) {
        (Some(_), Some(_)) => {
            return Err(
                "a structured-mode CloudEvent with both `data` and `data_base64`".to_owned(),
            );
        }
        (None, Some(encoded)) => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(encoded.as_bytes())
                .map_err(|e| {
                    format!("a structured-mode CloudEvent whose `data_base64` is not base64: {e}")
                })?
        }
        (data, None) => data.map_or_else(|| b"null".to_vec(), |d| d.get().as_bytes().to_vec()),
    };
    Ok(Unwrapped {
        id: event.id,
        kind: event.kind,
        content_type: event.datacontenttype,
        data,
        base64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_through_a_json_event() {
        let ce = CloudEvents::new("/s").expect("source");
        let record = OutboxRecord {
            seq: 1,
            id: uuid::Uuid::nil(),
            event_type: "OrderPlaced".to_owned(),
            event_version: Some(2),
            destination: "orders".to_owned(),
            partition_key: None,
            payload: r#"{"order": 7, "price": 1.10}"#.into(),
            content_type: crate::publisher::headers::JSON.into(),
            headers: Default::default(),
            created_at: chrono::DateTime::UNIX_EPOCH,
            attempts: 0,
        };
        let text = ce.structured(&record).expect("JSON");
        let value: serde_json::Value = serde_json::from_str(&text).expect("a JSON event");
        assert_eq!(value["specversion"], "1.0");
        assert_eq!(value["type"], "OrderPlaced.v2");
        assert_eq!(value["datacontenttype"], "application/json");
        assert_eq!(value["data"]["order"], 7);
        assert!(
            text.ends_with(r#""data":{"order": 7, "price": 1.10}}"#),
            "{text}"
        );
        let unwrapped = unwrap(text.as_bytes()).expect("unwrapped");
        assert_eq!(unwrapped.data, br#"{"order": 7, "price": 1.10}"#);
        assert_eq!(unwrapped.kind.as_deref(), Some("OrderPlaced.v2"));
        assert_eq!(
            unwrapped.id.as_deref(),
            Some(record.id.to_string().as_str())
        );
        let not_json = OutboxRecord {
            payload: "not json".into(),
            ..record.clone()
        };
        assert!(ce.structured(&not_json).is_err());
        assert!(unwrap(br#"{"data": 1, "data_base64": "AA=="}"#).is_err());
        assert!(unwrap(br#"{"data_base64": "not base64!"}"#).is_err());
        assert!(is_structured("Application/CloudEvents+JSON; charset=utf-8"));
        assert!(!is_structured("application/json"));
    }

    /// The JSON format's rule for binary data: `data_base64`, with the content type.
    #[test]
    fn a_binary_payload_travels_as_data_base64() {
        let ce = CloudEvents::new("/s").expect("source");
        let bytes: Vec<u8> = vec![0x08, 0x96, 0x01, 0xff, 0x00];
        let record = OutboxRecord::from(
            crate::OutboxMessage::new("OrderPlaced", "orders", bytes.clone())
                .with_content_type("application/protobuf"),
        );
        let text = ce.structured(&record).expect("any bytes");
        let value: serde_json::Value = serde_json::from_str(&text).expect("a JSON event");
        assert_eq!(value["datacontenttype"], "application/protobuf");
        assert_eq!(value["data_base64"], "CJYB/wA=");
        assert!(value.get("data").is_none(), "{text}");
        let unwrapped = unwrap(text.as_bytes()).expect("unwrapped");
        assert_eq!(unwrapped.data, bytes);
        assert_eq!(
            unwrapped.content_type.as_deref(),
            Some("application/protobuf")
        );
        assert!(is_structured("Application/CloudEvents+JSON; charset=utf-8"));
        assert!(!is_structured("application/json"));
    }
}
