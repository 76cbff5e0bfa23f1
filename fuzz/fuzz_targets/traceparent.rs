//! The trace-context parser (a `traceparent` header from a broker) never panics and
//! accepts exactly the values W3C Trace Context (Level 1, section 3.2) calls valid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use outbox_core::fuzzing::{TraceParent, traceparent};

/// Written from the recommendation, not from our parser: `version-traceid-parentid-flags`,
/// lower-case hex of 2, 32, 16, 2 digits; version `ff`, an all-zero trace id or parent id
/// are invalid; version `00` has nothing after the flags, a later version may have more
/// after a `-`. Leading and trailing spaces and tabs (HTTP's optional whitespace) are
/// not part of the value.
fn w3c(value: &str) -> Option<TraceParent> {
    let b = value.trim_matches([' ', '\t']).as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let (version, trace, span, flags) = (&b[0..2], &b[3..35], &b[36..52], &b[53..55]);
    let lower_hex = |s: &[u8]| s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    if ![version, trace, span, flags].into_iter().all(lower_hex) || version == b"ff" {
        return None;
    }
    let rest_ok = if version == b"00" {
        b.len() == 55
    } else {
        b.len() == 55 || b[55] == b'-'
    };
    if !rest_ok {
        return None;
    }
    let number = |s: &[u8]| {
        s.iter().fold(0u128, |n, c| {
            n * 16 + u128::from((*c as char).to_digit(16).unwrap_or(0))
        })
    };
    let parent = TraceParent {
        trace_id: number(trace),
        span_id: number(span) as u64,
        flags: number(flags) as u8,
    };
    (parent.trace_id != 0 && parent.span_id != 0).then_some(parent)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    assert_eq!(traceparent(text), w3c(text), "traceparent {text:?}");
});
