//! Kafka headers (`outbox-kafka`'s `headers::{encode, decode}`): arbitrary headers from
//! a broker (any key, any bytes, no value) decode without panicking, each to its last
//! value as UTF-8 text; and what the publisher writes for any row, the consumer reads
//! back: the id, type, version, CloudEvents attributes and every row header it copies.
//! The bytes on the wire are librdkafka's (C); this covers our side of them.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use outbox_core::publisher::cloudevents::is_attribute_header;
use outbox_fuzz::kafka_headers as headers;
use outbox_fuzz::{Row, kafka_decode as decode, kafka_encode as encode};

fuzz_target!(|input: (Row, Vec<(String, Option<Vec<u8>>)>)| {
    let (row, raw) = input;
    let decoded = decode(raw.iter().map(|(k, v)| (k.as_str(), v.as_deref())));
    let mut last = BTreeMap::new();
    for (k, v) in &raw {
        last.insert(
            k.clone(),
            v.as_deref()
                .map(String::from_utf8_lossy)
                .unwrap_or_default()
                .into_owned(),
        );
    }
    assert_eq!(decoded, last);

    let record = row.record();
    let ce = row.cloudevents();
    let written = encode(&record, ce.as_ref());
    let read = decode(
        written
            .iter()
            .map(|(k, v)| (k.as_str(), Some(v.as_bytes()))),
    );
    let get = |name: &str| read.get(name).map(String::as_str);
    let id = record.id.to_string();
    assert_eq!(get(headers::MESSAGE_ID), Some(id.as_str()));
    assert_eq!(get(headers::EVENT_TYPE), Some(record.event_type.as_str()));
    assert_eq!(get(headers::CONTENT_TYPE), Some(record.content_type.as_ref()));
    assert_eq!(
        get(headers::EVENT_VERSION).map(str::to_owned),
        record.event_version.map(|v| v.to_string())
    );
    if let Some(ce) = &ce {
        for (name, value) in ce.attributes(&record) {
            let header = format!("{}{name}", headers::CLOUDEVENTS_PREFIX);
            assert_eq!(get(&header), Some(value.as_str()), "{header}");
        }
    }
    for (key, value) in &record.headers {
        let shadowed = headers::RESERVED.contains(&key.as_str())
            || ce.is_some() && is_attribute_header(key, headers::CLOUDEVENTS_PREFIX);
        if !shadowed {
            assert_eq!(get(key), Some(value.as_str()), "row header {key:?}");
        }
    }
});
