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
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparseable url>".to_owned();
    };
    // The user information ends at the last `@`: a password may hold `/`, `?` or `@`
    // unencoded, a host never holds `@`. (An `@` in the query makes the host look like
    // user information: shown redacted rather than risk showing a password.)
    let (userinfo, rest) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (host, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    // Query parameters can carry secrets too (`?password=...`, `?sslpassword=...`).
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, value)) if is_secret_parameter(name) && !value.is_empty() => {
                        format!("{name}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    match userinfo {
        Some(userinfo) => {
            let user = userinfo.split(':').next().unwrap_or_default();
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}{tail}")
            } else {
                format!("{scheme}://{user}@{host}{tail}")
            }
        }
        None => format!("{scheme}://{host}{tail}"),
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
}
