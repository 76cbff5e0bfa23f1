//! RabbitMQ headers: arbitrary bytes where a delivery's properties are (parsed by lapin's
//! AMQP codec, then read by our consumer) never panic; and what the publisher writes for
//! any row, encoded to AMQP bytes and parsed back, the consumer reads back: id, type,
//! version, key, the CloudEvents attributes under the chosen prefix and every row header
//! it copies.
#![no_main]

use lapin::protocol::basic::{gen_properties, parse_properties};
use libfuzzer_sys::fuzz_target;
use outbox_core::publisher::cloudevents::is_attribute_header;
use outbox_fuzz::Row;
use outbox_rabbitmq::CloudEventsHeaders;
use outbox_rabbitmq::fuzzing::{properties, text_headers};
use outbox_rabbitmq::headers as names;

fuzz_target!(|input: (Row, u8, &[u8])| {
    let (row, prefix, raw) = input;
    if let Ok((_, parsed)) = parse_properties(raw) {
        let _ = text_headers(&parsed);
    }

    let record = row.record();
    let prefix = CloudEventsHeaders::ALL[usize::from(prefix) % 3];
    let ce = row.cloudevents();
    let written = properties(&record, ce.clone().map(|ce| (ce, prefix)));
    let bytes = cookie_factory::gen_simple(gen_properties(&written), Vec::new())
        .expect("the properties encode");
    let (rest, parsed) = parse_properties(bytes.as_slice()).expect("the properties parse back");
    assert!(rest.is_empty());
    let read = text_headers(&parsed);
    let get = |name: &str| read.get(name).map(String::as_str);
    let id = record.id.to_string();
    assert_eq!(get(names::MESSAGE_ID), Some(id.as_str()));
    assert_eq!(get(names::EVENT_TYPE), Some(record.event_type.as_str()));
    assert_eq!(
        get(names::EVENT_VERSION).map(str::to_owned),
        record.event_version.map(|v| v.to_string())
    );
    assert_eq!(get(names::PARTITION_KEY), record.partition_key.as_deref());
    if let Some(ce) = &ce {
        for (name, value) in ce.attributes(&record) {
            let header = format!("{}{name}", prefix.prefix());
            assert_eq!(get(&header), Some(value.as_str()), "{header}");
        }
    }
    for (key, value) in &record.headers {
        let reserved = names::RESERVED.iter().any(|r| r.eq_ignore_ascii_case(key));
        let attribute = ce.is_some()
            && names::CLOUDEVENTS_PREFIXES
                .iter()
                .any(|p| is_attribute_header(key, p));
        if !reserved && !attribute && key.len() <= 255 {
            assert_eq!(get(key), Some(value.as_str()), "row header {key:?}");
        }
    }
});
