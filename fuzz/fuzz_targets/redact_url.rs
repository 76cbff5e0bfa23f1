//! The database URL redaction (`outbox-core`, in every connection error): whatever the
//! URL, the password in its user information and the value of a secret query parameter
//! (`password=`, `sslpassword=`, ...) never appear in the output; nor do they in a
//! libpq `key=value` connection string, which the redaction does not parse.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use outbox_core::fuzzing::redact_url;

#[derive(Debug, Arbitrary)]
struct Input {
    scheme: String,
    user: String,
    password: Option<String>,
    host: String,
    path: String,
    query: Vec<(String, String)>,
    /// Which query parameter holds a secret (its value is the secret checked).
    secret_parameter: Option<(u8, String)>,
    /// A `key=value` connection string instead of a URL.
    dsn: bool,
    raw: String,
}

const SECRET_NAMES: [&str; 5] = ["password", "sslpassword", "PASSWORD", "auth_token", "pwd"];

fn without(text: &str, banned: &[char]) -> String {
    text.chars().filter(|c| !banned.contains(c)).collect()
}

fuzz_target!(|input: Input| {
    // Arbitrary text: never panics.
    let _ = redact_url(&input.raw);

    let user = without(&input.user, &[':', '@', '/', '?', '#']);
    let host = without(&input.host, &['@', '/', '?', '#']);
    let path = format!("/{}", without(&input.path, &['?', '#']));
    let mut pairs: Vec<(String, String)> = input
        .query
        .iter()
        .map(|(k, v)| (without(k, &['&', '=', '#']), without(v, &['&', '#'])))
        .filter(|(k, _)| !SECRET_NAMES.iter().any(|s| s.eq_ignore_ascii_case(k)))
        .collect();
    let mut secrets = Vec::new();
    let mut shown: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if let Some((i, value)) = &input.secret_parameter {
        let value = without(value, &['&', '#']);
        let name = SECRET_NAMES[usize::from(*i) % SECRET_NAMES.len()];
        pairs.push((name.to_owned(), value.clone()));
        shown.push(format!("{name}=***"));
        secrets.push(value);
    }
    if let Some(password) = &input.password {
        secrets.push(password.clone());
    }
    let (url, public) = if input.dsn {
        // libpq's `key=value` form: nothing of it is shown but what we put around it.
        let mut dsn = format!("host={host} user={user}");
        if let Some(password) = &input.password {
            dsn.push_str(&format!(" password={password}"));
        }
        (dsn, "<unparseable url>".to_owned())
    } else {
        let userinfo = match &input.password {
            Some(password) => format!("{user}:{password}@"),
            None if user.is_empty() => String::new(),
            None => format!("{user}@"),
        };
        let query: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{}", query.join("&"))
        };
        let url = format!("{}://{userinfo}{host}{path}{query}", input.scheme);
        // What may be shown: everything but the secrets, plus the marks put in their place.
        let (scheme, query) = (&input.scheme, shown.join("&"));
        let public = format!(
            "{scheme}://{host}{path}?{query}\n{scheme}://{user}@{host}{path}?{query}\n\
             {scheme}://{user}:***@{host}{path}?{query}\n<unparseable url>\n{scheme}://<redacted>"
        );
        (url, public)
    };
    let redacted = redact_url(&url);
    // The marks in place of secrets, as one character no secret holds: a secret made of
    // `*` and shown text (`*@/F` beside `***@/F`) is not shown.
    let unmarked = redacted.replace("***", "\u{fffd}");
    for secret in &secrets {
        // A secret that is also a piece of what may be shown cannot be told apart.
        if secret.is_empty() || public.contains(secret.as_str()) {
            continue;
        }
        let shown = if secret.contains('\u{fffd}') { &redacted } else { &unmarked };
        assert!(
            !shown.contains(secret.as_str()),
            "secret {secret:?} shown: {url:?} -> {redacted:?}"
        );
    }
});
