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

/// The span context a `traceparent` (and `tracestate`) header names, if valid.
#[cfg(feature = "opentelemetry")]
fn remote(headers: &BTreeMap<String, String>) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let parent = headers.get(TRACEPARENT)?;
    let mut parts = parent.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2
        || version == "ff"
        || trace.len() != 32
        || span.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    let state = headers
        .get(TRACESTATE)
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let context = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        state,
    );
    context.is_valid().then_some(context)
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

#[cfg(all(test, feature = "opentelemetry"))]
mod tests {
    use super::*;

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

    #[test]
    fn nothing_is_captured_outside_an_opentelemetry_span() {
        let mut headers = BTreeMap::new();
        capture(&mut headers);
        assert!(headers.is_empty());
    }
}
