//! The NATS URL list (`nats://user:pass@a,nats://b`): the credentials are taken out of
//! the URLs that errors and logs show (none of the password or token is left), and they
//! are the first URL's, percent-decoded.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::config::percent_decoded;
use outbox_nats::fuzzing::split_credentials;

#[derive(Debug, Arbitrary)]
struct Server {
    scheme: bool,
    user: String,
    /// `None`: a token (`nats://token@host`).
    password: Option<String>,
    host: String,
}

#[derive(Debug, Arbitrary)]
struct Input {
    servers: Vec<Server>,
    raw: String,
}

fn without(text: &str, banned: &[char]) -> String {
    text.chars().filter(|c| !banned.contains(c)).collect()
}

fuzz_target!(|input: Input| {
    let _ = split_credentials(&input.raw);

    let mut urls = Vec::new();
    let mut secrets = Vec::new();
    let mut public = String::new();
    let mut first = None;
    for server in &input.servers {
        // A URL list is split at commas and trimmed: no part holds either.
        let strip = |t: &str, extra: &[char]| {
            let kept: String = t.chars().filter(|c| !c.is_whitespace()).collect();
            let mut banned = vec![','];
            banned.extend_from_slice(extra);
            without(&kept, &banned)
        };
        let user = strip(&server.user, &[':', '@', '/']);
        let host = strip(&server.host, &['@', '/']);
        let scheme = if server.scheme { "nats://" } else { "" };
        let (userinfo, found) = match &server.password {
            Some(password) => {
                let mut password = strip(password, &[]);
                if !server.scheme && password.starts_with("//") {
                    // `user://...@host` is a URL with scheme `user`.
                    password.insert(0, 'x');
                }
                secrets.push(password.clone());
                (
                    format!("{user}:{password}@"),
                    (Some(percent_decoded(&user)), percent_decoded(&password)),
                )
            }
            None if user.is_empty() => continue,
            None => {
                secrets.push(user.clone());
                (format!("{user}@"), (None, percent_decoded(&user)))
            }
        };
        first.get_or_insert(found);
        public.push_str(&format!("{scheme}{host},"));
        urls.push(format!("{scheme}{userinfo}{host}"));
    }
    let (clean, found) = split_credentials(&urls.join(","));
    assert_eq!(found, first, "credentials of {urls:?}");
    for secret in &secrets {
        if secret.is_empty() || public.contains(secret.as_str()) {
            continue;
        }
        assert!(
            !clean.contains(secret.as_str()),
            "{secret:?} left in {clean:?} of {urls:?}"
        );
    }
});
