//! Connecting a pool from a URL, the same way for every database with a server.

use std::time::Duration;

use sqlx::{ConnectOptions as _, Connection};

use crate::{Error, Result};

/// How long a connect waits for the server by default (`connect_timeout=<seconds>` in the
/// URL, libpq's parameter, changes it).
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A pool connected to `url`. One direct connection is made first, bounded by the connect
/// timeout: a pool retries until its acquire timeout (30 s), a server that is down should
/// be reported at once, and one that accepts connections but never answers (frozen, or a
/// proxy whose backend is gone) must not hang the caller. Errors name the server without
/// its password ([`Error::Unavailable`]), or say what the server refused
/// ([`Error::Database`]).
pub(crate) async fn pool<DB: sqlx::Database>(url: &str) -> Result<sqlx::Pool<DB>> {
    let (url, timeout) = connect_timeout(url)?;
    let url = url.as_str();
    let target = format!(" at {}", redact_url(url));
    let classify = |source: sqlx::Error| match source {
        sqlx::Error::Database(_) | sqlx::Error::Configuration(_) => Error::Database {
            context: "connecting to the database",
            source,
        },
        source if crate::error::is_tls_error(&source) => Error::Tls {
            target: target.clone(),
            source,
        },
        source => Error::Unavailable {
            target: target.clone(),
            source,
        },
    };
    let options: <DB::Connection as Connection>::Options = url.parse().map_err(classify)?;
    let connected = tokio::time::timeout(timeout, options.connect())
        .await
        .map_err(|_| Error::Unavailable {
            target: target.clone(),
            source: sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the server accepted the connection but did not answer within {timeout:?} \
                     (connect_timeout)"
                ),
            )),
        })?;
    connected
        .map_err(classify)?
        .close()
        .await
        .map_err(classify)?;
    sqlx::pool::PoolOptions::<DB>::new()
        .connect_with(options)
        .await
        .map_err(classify)
}

/// `url` without its `connect_timeout=<seconds>` query parameter (the drivers do not know
/// it), and the timeout it gives ([`CONNECT_TIMEOUT`] without one).
fn connect_timeout(url: &str) -> Result<(String, Duration)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), CONNECT_TIMEOUT));
    };
    let mut timeout = CONNECT_TIMEOUT;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("connect_timeout", value)) => {
                let secs: f64 = value
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s >= 0.0 && s.is_finite())
                    .ok_or_else(|| {
                        Error::InvalidArgument(
                            format!(
                                "connect_timeout={value} in the database URL is not a number of \
                                 seconds; write e.g. connect_timeout=10 (0: wait indefinitely)"
                            )
                            .into(),
                        )
                    })?;
                // libpq's meaning of 0: wait indefinitely.
                timeout = if secs == 0.0 {
                    Duration::MAX
                } else {
                    Duration::from_secs_f64(secs)
                };
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, timeout))
}

/// Removes the password from a database URL so it can be shown in an error or a log line.
///
/// The user information ends at the last `@` (a password may hold `/`, `?` or `@`
/// unencoded; a host never holds `@`), unless that `@` is in a query parameter's value
/// (`?password=p@ss`). So the URL is read every way (user information up to each `@`,
/// or none), and shown the likeliest way that shows no secret of any other reading;
/// `scheme://<redacted>` if there is none.
pub fn redact_url(url: &str) -> String {
    // A scheme is a letter, then letters, digits, `+`, `-`, `.` (RFC 3986): a `://`
    // after anything else (a libpq `key=value` string with one in its password) is not
    // a URL's, and nothing of the text is shown.
    let scheme_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.');
    let Some((scheme, rest)) = url.split_once("://").filter(|(s, _)| {
        s.starts_with(|c: char| c.is_ascii_alphabetic()) && s.chars().all(scheme_char)
    }) else {
        return "<unparseable url>".to_owned();
    };
    // Every reading: the user information up to each `@` (the last first), and none;
    // none first if the last `@` comes after a `?` (it is likelier the query's).
    let mut readings: Vec<Reading<'_>> = rest
        .rmatch_indices('@')
        .map(|(at, _)| Reading::new(scheme, Some(&rest[..at]), &rest[at + 1..]))
        .collect();
    let none = Reading::new(scheme, None, rest);
    match rest.rfind('@') {
        Some(at) if rest[..at].contains('?') => readings.insert(0, none),
        _ => readings.push(none),
    }
    // The first reading that shows no byte of a secret of another.
    let span = |part: &str| {
        let start = part.as_ptr() as usize - rest.as_ptr() as usize;
        start..start + part.len()
    };
    let hides_all = |i: usize| {
        let secrets = readings.iter().flat_map(|r| &r.secrets);
        secrets.filter(|s| !s.is_empty()).all(|secret| {
            let secret = span(secret);
            readings[i]
                .shown
                .iter()
                .filter(|p| !p.is_empty())
                .all(|part| {
                    let part = span(part);
                    part.end <= secret.start || secret.end <= part.start
                })
        })
    };
    // What a reading adds between its parts (`:***@`, `=***`, the `@` and `?` of the
    // form) can join shown text into a secret of another reading, or rebuild one with a
    // `*` in it: a secret in the text that no shown part holds by itself.
    let rebuilds = |i: usize| {
        let reading = &readings[i];
        readings.iter().flat_map(|r| &r.secrets).any(|secret| {
            !secret.is_empty()
                && reading.text.contains(secret)
                && !reading.shown.iter().any(|part| part.contains(secret))
        })
    };
    match (0..readings.len()).find(|&i| hides_all(i) && !rebuilds(i)) {
        Some(i) => readings.swap_remove(i).text,
        None => format!("{scheme}://<redacted>"),
    }
}

/// A way to read `scheme://rest`.
struct Reading<'a> {
    /// The URL without its password and the values of its secret query parameters.
    text: String,
    /// The parts of `rest` in `text`.
    shown: Vec<&'a str>,
    /// The parts of `rest` this reading calls secrets.
    secrets: Vec<&'a str>,
}

impl<'a> Reading<'a> {
    /// `scheme://[userinfo@]rest`.
    fn new(scheme: &str, userinfo: Option<&'a str>, rest: &'a str) -> Reading<'a> {
        let (mut shown, mut secrets) = (Vec::new(), Vec::new());
        let (host, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        shown.push(host);
        // Query parameters can carry secrets too (`?password=...`, `?sslpassword=...`).
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                shown.push(path);
                let query: Vec<String> = query
                    .split('&')
                    .map(|pair| match pair.split_once('=') {
                        Some((name, value)) if is_secret_parameter(name) && !value.is_empty() => {
                            shown.push(name);
                            secrets.push(value);
                            format!("{name}=***")
                        }
                        _ => {
                            shown.push(pair);
                            pair.to_owned()
                        }
                    })
                    .collect();
                format!("{path}?{}", query.join("&"))
            }
            None => {
                shown.push(tail);
                tail.to_owned()
            }
        };
        let text = match userinfo {
            Some(userinfo) => match userinfo.split_once(':') {
                Some((user, password)) => {
                    shown.push(user);
                    secrets.push(password);
                    format!("{scheme}://{user}:***@{host}{tail}")
                }
                None => {
                    shown.push(userinfo);
                    format!("{scheme}://{userinfo}@{host}{tail}")
                }
            },
            None => format!("{scheme}://{host}{tail}"),
        };
        Reading {
            text,
            shown,
            secrets,
        }
    }
}

/// Whether a URL query parameter named `name` holds a secret.
fn is_secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token", "auth", "credential"]
        .iter()
        .any(|word| name.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_timeout_comes_from_the_url_and_leaves_it() {
        assert_eq!(
            connect_timeout("postgres://db/app").expect("ok"),
            ("postgres://db/app".to_owned(), CONNECT_TIMEOUT)
        );
        assert_eq!(
            connect_timeout("postgres://db/app?connect_timeout=2.5&sslmode=disable").expect("ok"),
            (
                "postgres://db/app?sslmode=disable".to_owned(),
                Duration::from_millis(2500)
            )
        );
        assert_eq!(
            connect_timeout("mysql://db/app?connect_timeout=3").expect("ok"),
            ("mysql://db/app".to_owned(), Duration::from_secs(3))
        );
        assert_eq!(
            connect_timeout("postgres://db?connect_timeout=0")
                .expect("ok")
                .1,
            Duration::MAX,
            "libpq: 0 waits indefinitely"
        );
        for bad in ["-1", "soon", ""] {
            let err =
                connect_timeout(&format!("postgres://db?connect_timeout={bad}")).expect_err(bad);
            assert!(err.to_string().contains("connect_timeout"), "{err}");
        }
    }

    #[test]
    fn redacts_password() {
        assert_eq!(
            redact_url("postgres://bob:s3cret@db:5432/app?sslmode=require"),
            "postgres://bob:***@db:5432/app?sslmode=require"
        );
        assert_eq!(redact_url("postgres://bob@db/app"), "postgres://bob@db/app");
        assert_eq!(redact_url("postgres://db/app"), "postgres://db/app");
        assert_eq!(redact_url("not a url"), "<unparseable url>");
        assert_eq!(
            redact_url("postgres://bob@db/app?sslmode=require&password=s3cret&sslpassword=k3y"),
            "postgres://bob@db/app?sslmode=require&password=***&sslpassword=***"
        );
        assert_eq!(
            redact_url("mysql://db?PASSWORD=s3cret"),
            "mysql://db?PASSWORD=***"
        );
        // Passwords with unencoded `?`, `/` or `@` (not valid URLs, so the driver's own
        // error would come with the URL as given).
        for (url, shown) in [
            ("postgres://bob:pa?ss@db/app", "postgres://bob:***@db/app"),
            (
                "postgres://bob:pa/ss@db:5432/app",
                "postgres://bob:***@db:5432/app",
            ),
            ("postgres://bob:p@ss@db/app", "postgres://bob:***@db/app"),
        ] {
            assert_eq!(redact_url(url), shown);
            assert!(!redact_url(url).contains("ss@"), "{url}");
        }
    }

    /// Found by the `redact_url` fuzz target ([docs/reliability.md](https://github.com/outbox-rs/outbox/blob/main/docs/reliability.md)): an `@` in a query
    /// parameter's value was taken for the end of the user information, and the query
    /// shown as a user name, password included; a `://` inside a libpq `key=value`
    /// string was taken for a scheme's, and what came before it shown.
    #[test]
    fn a_password_never_shows_whatever_surrounds_it() {
        for (url, secret, shown) in [
            (
                "postgres://db/app?password=p@ss",
                "p@ss",
                "postgres://db/app?password=***",
            ),
            (
                "postgres://bob@db/app?sslmode=require&password=p:x@y",
                "p:x@y",
                "postgres://bob@db/app?sslmode=require&password=***",
            ),
            (
                "postgres://:@db/?pwd=@/x:3",
                "@/x:3",
                "postgres://<redacted>",
            ),
            ("f://:*@/x@/?N@/x=", "*@/x", "f://<redacted>"),
            (
                "host=db user=bob password=pa://ss",
                "pa://ss",
                "<unparseable url>",
            ),
            // Found by the fuzz target in a fresh-clone CI run (2026-12-02): the reading
            // with user information up to the last `@` wrote `:***@` and the `?` after it,
            // which spell the `password` value of the reading without user information.
            (
                "F://___t_h\0o\0/?@@@@=@&H@z=&=/:&PASSWORD=@?",
                "@?",
                "F://<redacted>",
            ),
            (
                "postgres://db/app?x=/:&password=@?",
                "@?",
                "postgres://<redacted>",
            ),
        ] {
            let redacted = redact_url(url);
            assert!(!redacted.contains(secret), "{url} -> {redacted}");
            assert_eq!(redacted, shown, "{url}");
        }
    }
}
