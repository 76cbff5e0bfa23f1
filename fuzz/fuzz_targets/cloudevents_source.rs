//! The CloudEvents `source` check never panics and agrees with an independent RFC 3986
//! parser (fluent-uri) on what a URI-reference is; `CloudEvents::new` accepts exactly
//! the non-empty ones, and its error message never panics either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use outbox_core::publisher::cloudevents::{CloudEvents, is_uri_reference};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let ours = is_uri_reference(text);
    let theirs = fluent_uri::UriRef::parse(text).is_ok();
    assert_eq!(
        ours, theirs,
        "URI-reference {text:?}: ours {ours}, fluent-uri {theirs}"
    );
    match CloudEvents::new(text) {
        Ok(ce) => {
            assert!(ours && !text.is_empty(), "accepted {text:?}");
            assert_eq!(ce.source(), text);
        }
        Err(e) => {
            assert!(!ours || text.is_empty(), "refused {text:?}");
            assert!(!e.to_string().is_empty());
        }
    }
});
