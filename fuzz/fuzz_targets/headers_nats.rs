//! NATS headers: arbitrary headers (any names, several values) are read as text without
//! panicking, each to its last value; and what the publisher writes for any row it
//! accepts, the consumer reads back: id, type, version, key, the CloudEvents attributes
//! (percent-encoded in binary mode, decoded on reading) and every row header it copies.
//! The `NATS/1.0` wire lines are parsed by async-nats; this covers our side of them.
#![no_main]

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use outbox_core::publisher::cloudevents::is_attribute_header;
use outbox_fuzz::Row;
use outbox_nats::CloudEventsMode;
use outbox_nats::fuzzing::{headers, text_headers};
use outbox_nats::headers as names;

fuzz_target!(|input: (Row, bool, Vec<(String, Vec<String>)>)| {
    let (row, structured, raw) = input;
    // A received message's headers come from async-nats' wire parser, which holds only
    // what it accepts (names: printable ASCII without `:`; values: no line break). Since
    // 0.51 `append` panics on anything else (two crashes of this harness, kept in the
    // seeds), so the fuzzer's names and values go through the parser's checks.
    let mut map = HeaderMap::new();
    for (name, values) in &raw {
        let Ok(name) = name.parse::<HeaderName>() else {
            continue;
        };
        for value in values {
            if let Ok(value) = value.parse::<HeaderValue>() {
                map.append(name.clone(), value);
            }
        }
    }
    let _ = text_headers(Some(&map));
    let _ = text_headers(None);

    let record = row.record();
    let ce = row.cloudevents();
    let mode = if structured {
        CloudEventsMode::Structured
    } else {
        CloudEventsMode::BinaryDraft
    };
    let Ok(written) = headers(&record, ce.clone().map(|ce| (ce, mode))) else {
        return;
    };
    let read = text_headers(Some(&written));
    let get = |name: &str| read.get(name).map(String::as_str);
    let id = record.id.to_string();
    assert_eq!(get(names::MESSAGE_ID), Some(id.as_str()));
    assert_eq!(get(names::NATS_MSG_ID), Some(id.as_str()));
    assert_eq!(get(names::EVENT_TYPE), Some(record.event_type.as_str()));
    assert_eq!(
        get(names::EVENT_VERSION).map(str::to_owned),
        record.event_version.map(|v| v.to_string())
    );
    assert_eq!(get(names::PARTITION_KEY), record.partition_key.as_deref());
    if let (Some(ce), false) = (&ce, structured) {
        for (name, value) in ce.attributes(&record) {
            let header = format!("{}{name}", names::CLOUDEVENTS_PREFIX);
            assert_eq!(get(&header), Some(value.as_str()), "{header}");
        }
    }
    for (key, value) in &record.headers {
        let reserved = names::RESERVED.iter().any(|r| r.eq_ignore_ascii_case(key));
        // A `ce-*` header is decoded as an attribute by the consumer.
        let attribute = is_attribute_header(key, names::CLOUDEVENTS_PREFIX);
        if !reserved && !attribute {
            assert_eq!(get(key), Some(value.as_str()), "row header {key:?}");
        }
    }
});
