//! A message's body: the exact bytes its codec wrote, stored, relayed and delivered as
//! they are, and what says how to read them (its content type).

use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;

use bytes::Bytes;

/// The content type of a JSON payload, the default.
pub const JSON: &str = "application/json";

/// A message's payload: bytes, kept exactly as they were written.
///
/// The outbox stores it as bytes (`bytea`, `LONGBLOB`, `BLOB`) and every broker receives
/// it byte for byte: a signature or a digest computed over the bytes at `emit` holds at
/// the consumer. Cloning is cheap (the bytes are shared).
///
/// ```
/// use outbox_core::event::Payload;
///
/// let json = Payload::from(r#"{"id": 7}"#);
/// assert_eq!(json, r#"{"id": 7}"#);
/// assert_eq!(json.as_str(), Some(r#"{"id": 7}"#));
///
/// let binary = Payload::from(vec![0x08, 0x96, 0x01]);
/// assert_eq!(binary.as_bytes(), &[0x08, 0x96, 0x01]);
/// assert_eq!(binary.len(), 3);
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Payload(Bytes);

impl Payload {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The bytes as text, if they are UTF-8 (every JSON payload is).
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// The bytes, shared.
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// The bytes, copied into a vector of their own.
    pub fn to_vec(&self) -> Vec<u8> {
        self.0.to_vec()
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Text up to this many bytes is shown whole by `Debug`; longer text is cut.
const DEBUG_TEXT: usize = 512;

/// UTF-8 text as text (cut after 512 bytes), other bytes as their count: a log line of
/// a message stays readable and bounded.
impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_str() {
            Some(text) if text.len() <= DEBUG_TEXT => write!(f, "Payload({text:?})"),
            Some(text) => {
                let mut end = DEBUG_TEXT;
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                write!(f, "Payload({:?}... {} bytes)", &text[..end], text.len())
            }
            None => write!(f, "Payload(<{} bytes>)", self.0.len()),
        }
    }
}

/// UTF-8 text as it is (a JSON payload prints as written); other bytes as their count.
impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_str() {
            Some(text) => f.write_str(text),
            None => write!(f, "<{} bytes>", self.0.len()),
        }
    }
}

impl From<Bytes> for Payload {
    fn from(bytes: Bytes) -> Self {
        Payload(bytes)
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        Payload(Bytes::from(bytes))
    }
}

impl From<&[u8]> for Payload {
    fn from(bytes: &[u8]) -> Self {
        Payload(Bytes::copy_from_slice(bytes))
    }
}

impl<const N: usize> From<&[u8; N]> for Payload {
    fn from(bytes: &[u8; N]) -> Self {
        Payload(Bytes::copy_from_slice(bytes))
    }
}

impl From<String> for Payload {
    fn from(text: String) -> Self {
        Payload(Bytes::from(text))
    }
}

impl From<&String> for Payload {
    fn from(text: &String) -> Self {
        Payload(Bytes::copy_from_slice(text.as_bytes()))
    }
}

impl From<&str> for Payload {
    fn from(text: &str) -> Self {
        Payload(Bytes::copy_from_slice(text.as_bytes()))
    }
}

impl From<Cow<'_, str>> for Payload {
    fn from(text: Cow<'_, str>) -> Self {
        Payload::from(text.into_owned())
    }
}

impl From<Payload> for Vec<u8> {
    fn from(payload: Payload) -> Self {
        payload.0.into()
    }
}

impl PartialEq<str> for Payload {
    fn eq(&self, other: &str) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<&str> for Payload {
    fn eq(&self, other: &&str) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<String> for Payload {
    fn eq(&self, other: &String) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<Payload> for &str {
    fn eq(&self, other: &Payload) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<Payload> for str {
    fn eq(&self, other: &Payload) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl PartialEq<[u8]> for Payload {
    fn eq(&self, other: &[u8]) -> bool {
        self.as_bytes() == other
    }
}

impl PartialEq<Vec<u8>> for Payload {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.as_bytes() == other.as_slice()
    }
}

/// Whether `content_type` names JSON: `application/json` or a `+json` type
/// (`application/cloudevents+json`), parameters and case aside.
pub fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == JSON || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Whether `content_type` can travel as a header on every broker and be stored: a
/// `type/subtype` media type (RFC 6838 characters), parameters allowed, printable ASCII
/// only, at most 255 bytes.
pub(crate) fn content_type_is_valid(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
    };
    content_type.len() <= 255
        && content_type.bytes().all(|b| (0x20..0x7f).contains(&b))
        && essence
            .split_once('/')
            .is_some_and(|(kind, sub)| token(kind) && token(sub))
}

/// The content type of a message stored without one (written before payloads were
/// bytes): JSON.
pub(crate) const fn default_content_type() -> Cow<'static, str> {
    Cow::Borrowed(JSON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types_are_recognised_with_parameters_and_case() {
        for yes in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/cloudevents+json",
            "application/vnd.acme.order+json;v=2",
        ] {
            assert!(is_json(yes), "{yes}");
        }
        for no in [
            "application/protobuf",
            "application/octet-stream",
            "text/json-ish",
            "application/jsonp",
            "",
        ] {
            assert!(!is_json(no), "{no}");
        }
    }

    #[test]
    fn content_types_that_cannot_travel_are_invalid() {
        for good in [
            "application/json",
            "application/x-protobuf; messageType=\"acme.Order\"",
            "avro/binary",
            "application/vnd.apache.avro+binary",
        ] {
            assert!(content_type_is_valid(good), "{good}");
        }
        for bad in [
            "",
            "json",
            "application/",
            "/json",
            "application/json\r\nX-Injected: 1",
            "application/jsön",
            "text/plain\0",
            &format!("application/{}", "x".repeat(300)),
        ] {
            assert!(!content_type_is_valid(bad), "{bad:?}");
        }
    }

    #[test]
    fn debug_shows_text_cut_and_binary_as_a_count() {
        assert_eq!(format!("{:?}", Payload::from("{}")), r#"Payload("{}")"#);
        assert_eq!(
            format!("{:?}", Payload::from(vec![0xff, 0x00])),
            "Payload(<2 bytes>)"
        );
        let long = "é".repeat(400); // 800 bytes, cut inside no character
        let shown = format!("{:?}", Payload::from(long.as_str()));
        assert!(shown.ends_with("... 800 bytes)"), "{shown}");
        assert!(shown.len() < 600, "{shown}");
    }

    #[test]
    fn equality_is_by_bytes() {
        let p = Payload::from(r#"{"a": 1}"#);
        assert_eq!(p, r#"{"a": 1}"#);
        assert_eq!(p, br#"{"a": 1}"#.to_vec());
        assert_ne!(p, r#"{"a":1}"#);
    }
}
