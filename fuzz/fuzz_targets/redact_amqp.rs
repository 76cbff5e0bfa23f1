//! The RabbitMQ URL redaction: the URL as errors, logs and `Debug` show it never holds
//! the password, and a text that quotes the URL or the password (as written or
//! percent-decoded, as lapin uses it) keeps neither once the consumer redacted it.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::config::percent_decoded;
use outbox_rabbitmq::fuzzing::{redact_text, redacted};

#[derive(Debug, Arbitrary)]
struct Input {
    amqps: bool,
    user: String,
    password: String,
    host: String,
    vhost: String,
    before: String,
    after: String,
    /// What the text quotes: 0 the URL, 1 the password, 2 the decoded password.
    quoted: u8,
    raw_url: String,
    raw_text: String,
}

fn without(text: &str, banned: &[char]) -> String {
    text.chars().filter(|c| !banned.contains(c)).collect()
}

fuzz_target!(|input: Input| {
    let _ = redacted(&input.raw_url);
    let _ = redact_text(&input.raw_url, &input.raw_text);

    let scheme = if input.amqps { "amqps" } else { "amqp" };
    let user = without(&input.user, &[':', '@', '/', '?', '#']);
    let host = without(&input.host, &['@', '/', '?', '#']);
    let vhost = without(&input.vhost, &['@']);
    let password = &input.password;
    let url = format!("{scheme}://{user}:{password}@{host}/{vhost}");
    let decoded = percent_decoded(password);
    let public = format!("{scheme}://{user}:***@{host}/{vhost}");

    let shown = redacted(&url);
    if !password.is_empty() && !public.contains(password.as_str()) {
        assert!(
            !shown.contains(password.as_str()),
            "{url:?} shown as {shown:?}"
        );
    }

    let quoted = match input.quoted % 3 {
        0 => url.clone(),
        1 => password.clone(),
        _ => decoded.clone(),
    };
    let text = format!("{}{quoted}{}", input.before, input.after);
    let out = redact_text(&url, &text);
    for secret in [password, &decoded] {
        if secret.is_empty()
            || public.contains(secret.as_str())
            || input.before.contains(secret.as_str())
            || input.after.contains(secret.as_str())
            || "<text withheld: it held a secret that could not be masked>"
                .contains(secret.as_str())
        {
            continue;
        }
        assert!(
            !out.contains(secret.as_str()),
            "secret {secret:?} of {url:?} left in {text:?} -> {out:?}"
        );
    }
});
