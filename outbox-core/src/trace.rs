//! Trace context across the outbox: with the `opentelemetry` feature, `emit` records the
//! current span's OpenTelemetry context in the message's headers through the globally
//! configured text-map propagator (`opentelemetry::global::set_text_map_propagator`: W3C
//! trace context and baggage, B3, or a composite, as the application set it up; with none
//! set, W3C `traceparent`/`tracestate`), and the relay's `send` span and the consumer's
//! `process` span link to it, read back with the same propagator. A link, not a parent: a
//! message can be delivered hours after the request that wrote it. Without the feature
//! these are no-ops.
//!
//! Works with `opentelemetry` 0.33 and `tracing-opentelemetry` 0.34 (the versions
//! `outbox-core` depends on). An application whose subscriber has its
//! `tracing-opentelemetry` layer from another version gets no trace context: the first
//! `emit` inside a span that has no context for these versions logs a warning, once.

use std::collections::BTreeMap;

#[cfg(feature = "opentelemetry")]
use crate::publisher::headers::{TRACEPARENT, TRACESTATE};

/// The versions of the OpenTelemetry crates the `opentelemetry` feature is built with:
/// an application's `tracing-opentelemetry` layer must be of the same version for
/// `emit` to find the current span's context.
pub const OPENTELEMETRY_VERSIONS: &str = "opentelemetry 0.33, tracing-opentelemetry 0.34";

/// Message headers as the propagator writes them.
#[cfg(feature = "opentelemetry")]
struct Inject<'a>(&'a mut BTreeMap<String, String>);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

/// Message headers as the propagator reads them: by the propagator's (lower-case) name,
/// or in another case where a broker or a foreign producer changed it.
#[cfg(feature = "opentelemetry")]
struct Extract<'a>(&'a BTreeMap<String, String>);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .or_else(|| {
                self.0
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case(key))
                    .map(|(_, value)| value)
            })
            .map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// Adds the current span's trace context to `headers` through the global propagator
/// (W3C `traceparent`/`tracestate` when none is set), unless the caller set a
/// `traceparent`, or any header the propagator writes, already: what the caller set
/// wins, and nothing is mixed into it.
#[cfg(feature = "opentelemetry")]
pub(crate) fn capture(headers: &mut BTreeMap<String, String>) {
    let fields = propagator_fields();
    if caller_set(headers, &fields) {
        return;
    }
    if let Some(current) = Current::capture(&fields) {
        headers.extend(current.headers);
    }
}

/// The header names the global propagator writes (none for the no-op propagator).
#[cfg(feature = "opentelemetry")]
fn propagator_fields() -> Vec<String> {
    opentelemetry::global::get_text_map_propagator(|p| p.fields().map(str::to_owned).collect())
}

/// Whether `headers` carry trace context the caller set: a `traceparent`, or any of the
/// propagator's `fields`.
#[cfg(feature = "opentelemetry")]
fn caller_set(headers: &BTreeMap<String, String>, fields: &[String]) -> bool {
    headers.contains_key(TRACEPARENT) || fields.iter().any(|f| headers.contains_key(f))
}

/// The current span's context as headers, as the global propagator writes them (W3C
/// with the no-op propagator).
#[cfg(feature = "opentelemetry")]
struct Current {
    headers: BTreeMap<String, String>,
}

#[cfg(feature = "opentelemetry")]
impl Current {
    /// The current span's context as headers written by the propagator whose header
    /// names are `fields`, if there is one. The first span that has no context outbox's
    /// `tracing-opentelemetry` can read is reported, once. (Callers check first that the
    /// message carries no context of the caller's: nothing is read or said then.)
    fn capture(fields: &[String]) -> Option<Current> {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let span = tracing::Span::current();
        if span.is_disabled() {
            return None;
        }
        // `None`: no layer of our version knows this span (another version, none, or
        // a filter that leaves it out). A layer with a no-op tracer answers `Some`.
        let known = span
            .with_subscriber(|(id, dispatch)| tracing_opentelemetry::get_otel_context(id, dispatch))
            .flatten()
            .is_some();
        if !known {
            unreadable_span_once(&span);
            return None;
        }
        let context = span.context();
        let mut headers = BTreeMap::new();
        if fields.is_empty() {
            let span_context = context.span().span_context().clone();
            if span_context.is_valid() {
                w3c(&span_context, &mut headers);
            }
        } else {
            opentelemetry::global::get_text_map_propagator(|propagator| {
                propagator.inject_context(&context, &mut Inject(&mut headers));
            });
        }
        (!headers.is_empty()).then_some(Current { headers })
    }
}

/// `traceparent` and `tracestate` of `span_context`, as W3C Trace Context writes them.
#[cfg(feature = "opentelemetry")]
fn w3c(span_context: &opentelemetry::trace::SpanContext, headers: &mut BTreeMap<String, String>) {
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

/// The warning, once per process, that `emit` ran inside a span that has no
/// OpenTelemetry context this build can read.
#[cfg(feature = "opentelemetry")]
fn unreadable_span_once(span: &tracing::Span) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let name = span.metadata().map_or("?", |m| m.name());
    tracing::warn!(
        span = name,
        versions = OPENTELEMETRY_VERSIONS,
        "outbox: the `opentelemetry` feature is on and a message was emitted inside the span \
         {name:?}, but that span has no OpenTelemetry context that outbox can read, so messages \
         carry no trace context: the subscriber has no `tracing-opentelemetry` layer, one of \
         another version than outbox's ({OPENTELEMETRY_VERSIONS}; `cargo tree -d -i \
         tracing-opentelemetry` lists the versions in your build), or one whose filter leaves \
         this span out (logged once)"
    );
}

#[cfg(not(feature = "opentelemetry"))]
pub(crate) fn capture(_headers: &mut BTreeMap<String, String>) {}

/// `messages` with the current span's trace context (as [`capture`] adds it to each
/// message whose caller set none), copied only when there is a context to add: for the
/// write path that takes borrowed messages (`Outbox::enqueue_messages`).
#[cfg(feature = "opentelemetry")]
pub(crate) fn captured(
    messages: &[crate::OutboxMessage],
) -> std::borrow::Cow<'_, [crate::OutboxMessage]> {
    let fields = propagator_fields();
    let wanted = |m: &crate::OutboxMessage| !caller_set(&m.headers, &fields);
    if !messages.iter().any(wanted) {
        return std::borrow::Cow::Borrowed(messages);
    }
    let Some(current) = Current::capture(&fields) else {
        return std::borrow::Cow::Borrowed(messages);
    };
    let mut owned = messages.to_vec();
    for m in owned.iter_mut().filter(|m| wanted(m)) {
        m.headers.extend(current.headers.clone());
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

/// The OpenTelemetry context a message's headers carry, read with the global text-map
/// propagator (W3C `traceparent`/`tracestate` when none is configured): its span context
/// (`TraceContextExt::span`) is the trace that emitted the message, and its baggage is
/// the baggage propagated with it. An empty context when the headers carry none. For a
/// handler that wants more than the link its `process` span already has.
#[cfg(feature = "opentelemetry")]
pub fn context_of(headers: &BTreeMap<String, String>) -> opentelemetry::Context {
    use opentelemetry::trace::TraceContextExt;
    opentelemetry::global::get_text_map_propagator(|propagator| {
        if propagator.fields().next().is_none() {
            return remote(headers).map_or_else(opentelemetry::Context::new, |span_context| {
                opentelemetry::Context::new().with_remote_span_context(span_context)
            });
        }
        propagator.extract(&Extract(headers))
    })
}

/// Links `span` to the trace context in `headers`, if any.
#[cfg(feature = "opentelemetry")]
pub(crate) fn link(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let context = context_of(headers);
    let span_context = context.span().span_context().clone();
    if span_context.is_valid() {
        span.add_link(span_context);
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
