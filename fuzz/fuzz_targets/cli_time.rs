//! The CLI's time and age parsers (`--since`, `--sent-older-than`, ...) never panic, and
//! what they return means what the text says: `now` is now, an age counts back from now.
#![no_main]

use chrono::{DateTime, Utc};
use libfuzzer_sys::fuzz_target;
use outbox_fuzz::cli_time::{parse_age, parse_time_at};

fuzz_target!(|input: (i64, &str)| {
    let (seconds, text) = input;
    let Some(now) = DateTime::<Utc>::from_timestamp(seconds % 253_402_300_799, 0) else {
        return;
    };
    let age = parse_age(text);
    let time = parse_time_at(text, now);
    if let Ok(age) = age {
        assert!(age.as_secs() <= 100 * 365 * 86_400, "{text:?}: {age:?}");
        if let Ok(time) = &time {
            // An age is a time that long before now, unless the text is also a date.
            if text.trim().ends_with(['s', 'm', 'h', 'd', 'w']) {
                assert_eq!(
                    (now - *time).num_seconds(),
                    age.as_secs() as i64,
                    "{text:?}"
                );
            }
        }
    }
    if text.trim().eq_ignore_ascii_case("now") {
        assert_eq!(time, Ok(now));
    }
    if let Err(message) = time {
        assert!(!message.is_empty());
    }
});
