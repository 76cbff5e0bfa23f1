//! Trace context across the outbox: with the `opentelemetry` feature, `emit` records the
//! current span's W3C trace context (`traceparent`, `tracestate`) in the message's
//! headers, and the relay's publish span and the consumer's handler span link to it. A
//! link, not a parent: a message can be delivered hours after the request that wrote it.
//! Without the feature these are no-ops.

use std::collections::BTreeMap;

#[cfg(feature = "opentelemetry")]
use crate::publisher::headers::{TRACEPARENT, TRACESTATE};

/// Adds the current span's trace context to `headers`, unless the caller set a
/// `traceparent` already or there is no sampled-or-not valid context.
#[cfg(feature = "opentelemetry")]
pub(crate) fn capture(headers: &mut BTreeMap<String, String>) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if headers.contains_key(TRACEPARENT) {
        return;
    }
    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    if !span_context.is_valid() {
        return;
    }
    headers.insert(
        TRACEPARENT.to_owned(),
        format!(
            "00-{}-{}-{:02x}",
            span_context.trace_id(),
            span_context.span_id(),
            span_context.trace_flags().to_u8()
        ),
    );
    let state = span_context.trace_state().header();
    if !state.is_empty() {
        headers.insert(TRACESTATE.to_owned(), state);
    }
}

#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn capture(_headers: &mut BTreeMap<String, String>) {}

/// `messages` with the current span's trace context (as [`capture`] adds it), copied
/// only when there is a context to add: for the write path that takes borrowed
/// messages (`Outbox::enqueue_messages`).
#[cfg(feature = "opentelemetry")]
pub(crate) fn captured(
    messages: &[crate::OutboxMessage],
) -> std::borrow::Cow<'_, [crate::OutboxMessage]> {
    let mut context = BTreeMap::new();
    capture(&mut context);
    if context.is_empty() || messages.iter().all(|m| m.headers.contains_key(TRACEPARENT)) {
        return std::borrow::Cow::Borrowed(messages);
    }
    let mut owned = messages.to_vec();
    for m in owned
        .iter_mut()
        .filter(|m| !m.headers.contains_key(TRACEPARENT))
    {
        m.headers.extend(context.clone());
    }
    std::borrow::Cow::Owned(owned)
}

#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn captured(
    messages: &[crate::OutboxMessage],
) -> std::borrow::Cow<'_, [crate::OutboxMessage]> {
    std::borrow::Cow::Borrowed(messages)
}

/// The fields of a `traceparent` header value.
#[cfg(any(feature = "opentelemetry", feature = "fuzzing", test))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace id (never 0).
    pub trace_id: u128,
    /// The parent span id (never 0).
    pub span_id: u64,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

/// Reads a `traceparent` header value (bytes from a broker: anything may arrive) as W3C
/// Trace Context (Level 1, section 3.2) defines it: `version-traceid-parentid-flags`,
/// lower-case hex of 2, 32, 16 and 2 digits, surrounded by nothing but spaces and tabs;
/// not version `ff`, not an all-zero id; after the flags nothing for version `00`, and
/// for a later version nothing or what it adds after a `-`.
#[cfg(any(feature = "opentelemetry", feature = "fuzzing", test))]
pub fn traceparent(value: &str) -> Option<TraceParent> {
    let value = value.trim_matches([' ', '\t']).as_bytes();
    let field = |from: usize, len: usize| -> Option<&str> {
        let digits = value.get(from..from + len)?;
        digits
            .iter()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            .then(|| std::str::from_utf8(digits).ok())?
    };
    let version = field(0, 2)?;
    let dashes = [2, 35, 52].iter().all(|&i| value.get(i) == Some(&b'-'));
    let end = match (version, value.get(55)) {
        ("ff", _) => return None,
        (_, None) => true,
        ("00", Some(_)) => false,
        (_, Some(next)) => *next == b'-',
    };
    if !dashes || !end {
        return None;
    }
    let parent = TraceParent {
        trace_id: u128::from_str_radix(field(3, 32)?, 16).ok()?,
        span_id: u64::from_str_radix(field(36, 16)?, 16).ok()?,
        flags: u8::from_str_radix(field(53, 2)?, 16).ok()?,
    };
    (parent.trace_id != 0 && parent.span_id != 0).then_some(parent)
}

/// The span context a `traceparent` (and `tracestate`) header names, if valid.
#[cfg(feature = "opentelemetry")]
fn remote(headers: &BTreeMap<String, String>) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let parent = traceparent(headers.get(TRACEPARENT)?)?;
    let state = headers
        .get(TRACESTATE)
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        TraceId::from(parent.trace_id),
        SpanId::from(parent.span_id),
        TraceFlags::new(parent.flags),
        true,
        state,
    ))
}

/// Links `span` to the trace context in `headers`, if any.
#[cfg(feature = "opentelemetry")]
pub(crate) fn link(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if let Some(context) = remote(headers) {
        span.add_link(context);
    }
}

#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn link(_span: &tracing::Span, _headers: &BTreeMap<String, String>) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `traceparent` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)): values W3C Trace
    /// Context does not allow were read (`+` before a hex number, upper-case hex, a
    /// version that is not hex, data after a version 00, a line break around it).
    #[test]
    fn a_traceparent_is_read_exactly_as_w3c_defines_it() {
        let (trace, span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
        let valid = TraceParent {
            trace_id: 0x4bf92f3577b34da6a3ce929d0e0e4736,
            span_id: 0x00f067aa0ba902b7,
            flags: 1,
        };
        for good in [
            format!("00-{trace}-{span}-01"),
            format!(" \t00-{trace}-{span}-01\t "),
            format!("01-{trace}-{span}-01"),
            format!("01-{trace}-{span}-01-what-a-later-version-adds"),
        ] {
            assert_eq!(traceparent(&good), Some(valid), "{good:?}");
        }
        for bad in [
            format!("\r01-{trace}-{span}-01-"),
            format!("00-{trace}-{span}-01\n"),
            format!("00-+{}-{span}-01", &trace[1..]),
            format!("00-{trace}-+{}-01", &span[1..]),
            format!("00-{trace}-{span}-+1"),
            format!("00-{}-{span}-01", trace.to_uppercase()),
            format!("00-{trace}-{span}-0A"),
            format!("zz-{trace}-{span}-01"),
            format!("0A-{trace}-{span}-01"),
            format!("00-{trace}-{span}-01-extra"),
            format!("01-{trace}-{span}-01x"),
        ] {
            assert_eq!(traceparent(&bad), None, "{bad:?}");
        }
    }

    #[cfg(feature = "opentelemetry")]
    #[test]
    fn a_traceparent_is_read_back_and_bad_ones_are_ignored() {
        let mut headers = BTreeMap::new();
        headers.insert(
            TRACEPARENT.to_owned(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        );
        headers.insert(TRACESTATE.to_owned(), "congo=t61rcWkgMzE".to_owned());
        let context = remote(&headers).expect("valid");
        assert_eq!(
            context.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
        assert!(context.is_sampled() && context.is_remote());
        assert_eq!(context.trace_state().header(), "congo=t61rcWkgMzE");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
            "00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            headers.insert(TRACEPARENT.to_owned(), bad.to_owned());
            assert!(remote(&headers).is_none(), "{bad:?}");
        }
    }

    #[cfg(feature = "opentelemetry")]
    #[test]
    fn nothing_is_captured_outside_an_opentelemetry_span() {
        let mut headers = BTreeMap::new();
        capture(&mut headers);
        assert!(headers.is_empty());
    }
}
