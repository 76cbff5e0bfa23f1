//! CloudEvents 1.0 in **binary content mode**: a message's CloudEvents attributes as
//! headers, next to the outbox headers, with the payload as the message body (never
//! wrapped in a second envelope). Every publisher takes a [`CloudEvents`] and writes
//! the attributes with its binding's prefix: `ce_` on Kafka (Kafka binding 1.0.2),
//! `ce-` on NATS (binary mode of the NATS binding's draft 1.0.3-wip, values
//! percent-encoded), `cloudEvents:` on RabbitMQ (the AMQP binding 1.0.2; `cloudEvents_`
//! and `ce-` on request). Each broker's documentation says which SDK decodes what.
//!
//! | attribute | value |
//! | --- | --- |
//! | `specversion` | `1.0` |
//! | `id` | the outbox message id |
//! | `source` | what [`CloudEvents::new`] was given, e.g. `/orders-service` (an RFC 3986 URI-reference) |
//! | `type` | the event type, with `.v<version>` when the event has a version (`OrderPlaced.v2`), after the [`type_prefix`](CloudEvents::type_prefix) if one was set (`com.example.orders.OrderPlaced.v2`) |
//! | `time` | when the event was written (RFC 3339, UTC) |
//!
//! `datacontenttype` is the binding's content type (`content-type` header or property,
//! `application/json`), which every publisher sets anyway; the NATS draft also wants it
//! as `ce-datacontenttype`, which the NATS publisher writes.
//!
//! **Structured mode** ([`CloudEvents::structured`]): the NATS publisher can instead
//! wrap the payload in a JSON event (`content-type: application/cloudevents+json`), the
//! only mode of the released NATS binding. Every consumer unwraps such a message
//! ([`unwrap`]): its handler gets the `data`.

mod structured;
mod uri;

pub use structured::{NotJson, STRUCTURED_CONTENT_TYPE, Unwrapped, is_structured, unwrap};

use super::OutboxRecord;

/// Turns CloudEvents binary mode on for a publisher, with the `source` attribute it
/// writes. See the [module docs](self).
///
/// ```
/// use outbox_core::publisher::cloudevents::CloudEvents;
///
/// let ce = CloudEvents::new("/orders-service")?.type_prefix("com.example.orders")?;
/// assert_eq!(ce.source(), "/orders-service");
/// assert!(CloudEvents::new("/dépôt").is_err()); // not a URI-reference: `/d%C3%A9p%C3%B4t` is
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    source: String,
    type_prefix: Option<String>,
}

/// A `source` that cannot be a CloudEvents source: it is empty, or not an RFC 3986
/// URI-reference. The message says where and how to fix it.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe_source(.0))]
pub struct InvalidSource(pub String);

fn describe_source(source: &str) -> String {
    const EXAMPLES: &str =
        "e.g. `/orders-service`, `urn:example:orders` or `https://example.com/orders`";
    if source.is_empty() {
        return format!(
            "CloudEvents source is empty: it must be a non-empty URI-reference (RFC 3986), {EXAMPLES}"
        );
    }
    match uri::check(source) {
        Ok(()) => format!("CloudEvents source {source:?} is not usable"),
        Err(e) => format!(
            "CloudEvents source {source:?} is not a URI-reference (RFC 3986): at byte {}: {}; {EXAMPLES}",
            e.at, e.what
        ),
    }
}

/// A [`type_prefix`](CloudEvents::type_prefix) that is not a reverse-DNS name.
#[derive(Debug, thiserror::Error)]
#[error(
    "CloudEvents type prefix {0:?} is not a reverse-DNS name: it must be labels of letters, \
     digits and `-`, separated by single dots, e.g. `com.example.orders` (the type becomes \
     `com.example.orders.OrderPlaced.v2`)"
)]
pub struct InvalidTypePrefix(pub String);

/// Whether `text` is an RFC 3986 URI-reference (the empty string is one; a CloudEvents
/// `source` must also be non-empty, which [`CloudEvents::new`] checks).
pub fn is_uri_reference(text: &str) -> bool {
    uri::check(text).is_ok()
}

impl CloudEvents {
    /// `source`: a non-empty RFC 3986 URI-reference that names the producer
    /// (`/orders-service`, `https://example.com/orders`, `urn:example:orders`). Anything
    /// else (spaces, quotes, non-ASCII characters, a lone `%`) is refused with the place
    /// of the first problem and how to fix it: percent-encode it (`/d%C3%A9p%C3%B4t`).
    pub fn new(source: impl Into<String>) -> Result<CloudEvents, InvalidSource> {
        let source = source.into();
        if source.is_empty() || uri::check(&source).is_err() {
            return Err(InvalidSource(source));
        }
        Ok(CloudEvents {
            source,
            type_prefix: None,
        })
    }

    /// Writes `type` as `<prefix>.<event type>` (`com.example.orders.OrderPlaced.v2`):
    /// the spec's SHOULD of a reverse-DNS `type`. The outbox `event-type` header keeps
    /// the bare event type, so consumers of the outbox headers see no change.
    pub fn type_prefix(self, prefix: impl Into<String>) -> Result<CloudEvents, InvalidTypePrefix> {
        let prefix = prefix.into();
        let label =
            |l: &str| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !prefix.split('.').all(label) {
            return Err(InvalidTypePrefix(prefix));
        }
        Ok(CloudEvents {
            type_prefix: Some(prefix),
            ..self
        })
    }

    /// The `source` attribute.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prefix of `type`, when one was set with [`type_prefix`](Self::type_prefix).
    pub fn type_prefix_of(&self) -> Option<&str> {
        self.type_prefix.as_deref()
    }

    /// The `type` attribute of an event type and version: `OrderPlaced.v2`, or
    /// `com.example.orders.OrderPlaced.v2` with a [`type_prefix`](Self::type_prefix).
    pub fn type_of(&self, event_type: &str, version: Option<i32>) -> String {
        let bare = match version {
            Some(version) => format!("{event_type}.v{version}"),
            None => event_type.to_owned(),
        };
        match &self.type_prefix {
            Some(prefix) => format!("{prefix}.{bare}"),
            None => bare,
        }
    }

    /// The attributes of `record`, by their CloudEvents names (`specversion`, `id`,
    /// `source`, `type`, `time`).
    pub fn attributes(&self, record: &OutboxRecord) -> [(&'static str, String); 5] {
        [
            ("specversion", "1.0".to_owned()),
            ("id", record.id.to_string()),
            ("source", self.source.clone()),
            (
                "type",
                self.type_of(&record.event_type, record.event_version),
            ),
            (
                "time",
                record
                    .created_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ),
        ]
    }
}

/// `value` percent-encoded as the HTTP binding 1.0.2 (section 3.1.3.2) and the NATS
/// binding's draft encode header values: space, `"`, `%` and every character outside
/// printable ASCII as `%XX` of its UTF-8 bytes (upper-case hex); the rest as it is.
pub fn percent_encode_header_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for &b in value.as_bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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
        if let Ok(version) = text.parse::<i32>()
            && !name.is_empty()
            && text == version.to_string()
        {
            return (name, Some(version));
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
            payload: "{}".into(),
            content_type: crate::publisher::headers::JSON.into(),
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
        // The source of issue #33: named, with the place and the fix.
        let err = CloudEvents::new("/dépôt/\"ü\"%").expect_err("refused");
        let text = err.to_string();
        assert!(text.contains(r#""/dépôt/\"ü\"%""#), "{text}");
        assert!(text.contains("at byte 2"), "{text}");
        assert!(text.contains("%C3%A9"), "{text}");
        assert!(CloudEvents::new("/d%C3%A9p%C3%B4t").is_ok());
        assert!(CloudEvents::new("/100%").is_err());
    }

    #[test]
    fn a_type_prefix_is_reverse_dns() {
        let ce = CloudEvents::new("/s")
            .expect("source")
            .type_prefix("com.example.orders")
            .expect("prefix");
        assert_eq!(
            ce.attributes(&record(Some(2)))[3].1,
            "com.example.orders.OrderPlaced.v2"
        );
        assert_eq!(
            ce.type_of("OrderPlaced", None),
            "com.example.orders.OrderPlaced"
        );
        for bad in ["", ".com", "com.", "com..example", "com example", "cöm"] {
            let err = CloudEvents::new("/s")
                .expect("source")
                .type_prefix(bad)
                .expect_err(bad);
            assert!(err.to_string().contains("reverse-DNS"), "{err}");
        }
    }

    #[test]
    fn header_values_are_percent_encoded() {
        assert_eq!(
            percent_encode_header_value("Euro \u{20AC} \u{1F600}"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(percent_encode_header_value("/a\"b%c"), "/a%22b%25c");
        assert_eq!(
            percent_encode_header_value("/orders-service"),
            "/orders-service"
        );
    }

    proptest::proptest! {
        /// The validator never panics, and accepts exactly what an independent RFC 3986
        /// parser (fluent-uri) accepts as a URI-reference.
        #[test]
        fn the_validator_agrees_with_an_independent_parser(
            text in "([a-zA-Z0-9:/?#\\[\\]@!$&'()*+,;=%._~ \"é-]|%[0-9a-fA-F]{2}|\\[::1\\]|//|[vV][0-9]\\.){0,24}"
        ) {
            let ours = is_uri_reference(&text);
            let theirs = fluent_uri::UriRef::parse(text.as_str()).is_ok();
            proptest::prop_assert_eq!(ours, theirs, "{:?}", text);
        }

        #[test]
        fn the_validator_never_panics(text in "\\PC*") {
            let _ = is_uri_reference(&text);
            let _ = CloudEvents::new(text.clone()).map_err(|e| e.to_string());
        }
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
