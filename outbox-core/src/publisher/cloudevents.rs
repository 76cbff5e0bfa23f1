//! CloudEvents 1.0 in **binary content mode**: a message's CloudEvents attributes as
//! headers, next to the outbox headers, with the payload as the message body (never
//! wrapped in a second envelope). Every publisher takes a [`CloudEvents`] and writes
//! the attributes with its binding's prefix: `ce_` on Kafka, `ce-` on NATS,
//! `cloudEvents_` on AMQP (RabbitMQ).
//!
//! | attribute | value |
//! | --- | --- |
//! | `specversion` | `1.0` |
//! | `id` | the outbox message id |
//! | `source` | what [`CloudEvents::new`] was given, e.g. `/orders-service` |
//! | `type` | the event type, with `.v<version>` when the event has a version (`OrderPlaced.v2`) |
//! | `time` | when the event was written (RFC 3339, UTC) |
//!
//! `datacontenttype` is the binding's content type (`content-type` header or property,
//! `application/json`), which every publisher sets anyway.

use super::OutboxRecord;

/// Turns CloudEvents binary mode on for a publisher, with the `source` attribute it
/// writes. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    source: String,
}

/// A `source` that cannot be a CloudEvents source.
#[derive(Debug, thiserror::Error)]
#[error(
    "CloudEvents source {0:?} is not usable: it must be a non-empty URI-reference without \
     whitespace or control characters, e.g. `/orders-service` or `urn:example:orders`"
)]
pub struct InvalidSource(pub String);

impl CloudEvents {
    /// `source`: a URI-reference that names the producer (`/orders-service`,
    /// `https://example.com/orders`, `urn:example:orders`).
    pub fn new(source: impl Into<String>) -> Result<CloudEvents, InvalidSource> {
        let source = source.into();
        if source.is_empty() || source.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(InvalidSource(source));
        }
        Ok(CloudEvents { source })
    }

    /// The `source` attribute.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The attributes of `record`, by their CloudEvents names (`specversion`, `id`,
    /// `source`, `type`, `time`).
    pub fn attributes(&self, record: &OutboxRecord) -> [(&'static str, String); 5] {
        let kind = match record.event_version {
            Some(version) => format!("{}.v{version}", record.event_type),
            None => record.event_type.clone(),
        };
        [
            ("specversion", "1.0".to_owned()),
            ("id", record.id.to_string()),
            ("source", self.source.clone()),
            ("type", kind),
            (
                "time",
                record
                    .created_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ),
        ]
    }
}

/// Whether `header` is a CloudEvents attribute header of the binding with `prefix`
/// (matched without regard to case): a row header with such a name is not copied when
/// the publisher writes the attributes itself.
pub fn is_attribute_header(header: &str, prefix: &str) -> bool {
    header.len() > prefix.len()
        && header.is_char_boundary(prefix.len())
        && header[..prefix.len()].eq_ignore_ascii_case(prefix)
}

/// A CloudEvents `type` as an event type and version: `OrderPlaced.v2` is
/// `("OrderPlaced", Some(2))`, as [`CloudEvents::attributes`] writes it; any other
/// `type` is taken whole, without a version. For consumers that accept events in
/// binary mode from producers that write only the CloudEvents attributes.
pub fn split_type(kind: &str) -> (&str, Option<i32>) {
    if let Some((name, text)) = kind.rsplit_once(".v") {
        // Exactly as written: `v2`, not `v02` or `v+2`.
        if let Ok(version) = text.parse::<i32>() {
            if !name.is_empty() && text == version.to_string() {
                return (name, Some(version));
            }
        }
    }
    (kind, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn record(version: Option<i32>) -> OutboxRecord {
        OutboxRecord {
            seq: 1,
            id: uuid::Uuid::nil(),
            event_type: "OrderPlaced".to_owned(),
            event_version: version,
            destination: "orders".to_owned(),
            partition_key: None,
            payload: "{}".to_owned(),
            headers: Default::default(),
            created_at: chrono::Utc
                .with_ymd_and_hms(2026, 12, 1, 10, 30, 0)
                .single()
                .expect("a time"),
            attempts: 0,
        }
    }

    #[test]
    fn the_attributes_of_a_message() {
        let ce = CloudEvents::new("/orders-service").expect("source");
        assert_eq!(
            ce.attributes(&record(None)),
            [
                ("specversion", "1.0".to_owned()),
                ("id", "00000000-0000-0000-0000-000000000000".to_owned()),
                ("source", "/orders-service".to_owned()),
                ("type", "OrderPlaced".to_owned()),
                ("time", "2026-12-01T10:30:00.000000Z".to_owned()),
            ]
        );
        assert_eq!(ce.attributes(&record(Some(2)))[3].1, "OrderPlaced.v2");
    }

    #[test]
    fn a_source_must_be_a_uri_reference() {
        for bad in ["", "orders service", "orders\n", "\t"] {
            let err = CloudEvents::new(bad).expect_err("refused");
            assert!(err.to_string().contains("URI-reference"), "{err}");
        }
        assert!(CloudEvents::new("urn:example:orders").is_ok());
    }

    #[test]
    fn a_type_splits_into_name_and_version() {
        assert_eq!(split_type("OrderPlaced.v2"), ("OrderPlaced", Some(2)));
        assert_eq!(split_type("OrderPlaced"), ("OrderPlaced", None));
        assert_eq!(
            split_type("com.example.order.v2x"),
            ("com.example.order.v2x", None)
        );
        assert_eq!(split_type(".v3"), (".v3", None));
        assert_eq!(split_type("OrderPlaced.v02"), ("OrderPlaced.v02", None));
        let ce = CloudEvents::new("/s").expect("source");
        let attributes = ce.attributes(&record(Some(7)));
        assert_eq!(split_type(&attributes[3].1), ("OrderPlaced", Some(7)));
    }

    #[test]
    fn attribute_headers_are_recognised_by_prefix() {
        assert!(is_attribute_header("ce_id", "ce_"));
        assert!(is_attribute_header("CE-Type", "ce-"));
        assert!(is_attribute_header("cloudEvents_source", "cloudEvents_"));
        assert!(!is_attribute_header("ce_", "ce_"));
        assert!(!is_attribute_header("cell", "ce_"));
        assert!(!is_attribute_header("cé_x", "ce_"));
    }
}
