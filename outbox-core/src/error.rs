//! The one error type of the outbox runtime.

use std::borrow::Cow;

/// Everything that can go wrong in `outbox-core`.
///
/// Each variant says what happened, to what, and what to do about it. Match on the
/// variant to act; print it (`Display`) to tell a person.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A table name or other SQL identifier given in the configuration is not valid.
    ///
    /// Raised at configuration time, before any SQL runs.
    #[error(
        "invalid {what} {name:?}: {reason}; use an SQL identifier such as `outbox` or `my_schema.outbox` \
         (ASCII letters, digits and `_`, not starting with a digit; at most {table_max} characters for a table, \
         {schema_max} for a schema)",
        table_max = crate::config::MAX_IDENTIFIER_LEN,
        schema_max = crate::config::MAX_SCHEMA_LEN
    )]
    InvalidIdentifier {
        /// Which setting was wrong (e.g. "outbox table name").
        what: &'static str,
        /// The rejected value.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// An event could not be serialized to JSON. The transaction is still usable and
    /// can be rolled back (or committed without this event).
    #[error(
        "could not serialize event `{event_type}` to JSON: {source}; check its `Serialize` implementation"
    )]
    Serialize {
        /// The event type that failed.
        event_type: String,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },

    /// An event or message is not valid (empty event type or destination, bad header...).
    #[error("invalid outbox message: {0}")]
    InvalidMessage(Cow<'static, str>),

    /// The outbox tables do not exist (or are not at the version this library needs).
    #[error(
        "the outbox table {table} does not exist in this database; run the migrations first: \
         `outbox.migrate().await?` (or the `outbox migrate` command)"
    )]
    SchemaMissing {
        /// The table that was not found.
        table: String,
    },

    /// The database holds migrations that this library version does not know, or an
    /// applied migration differs from the one shipped.
    #[error("outbox migration {version} ({description}) {problem}")]
    Migration {
        /// The migration's version number.
        version: i64,
        /// The migration's description.
        description: String,
        /// What is wrong and what to do.
        problem: Cow<'static, str>,
    },

    /// The database could not be reached.
    #[error(
        "cannot reach the database{target}: {source}; check that the server is running and that \
         the URL (e.g. DATABASE_URL) points at it"
    )]
    Unavailable {
        /// Where we tried to connect (password removed), prefixed with " at ", or empty.
        target: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The event catalog is inconsistent: two Rust types claim the same event type name
    /// on the same destination. See [`catalog::validate`](crate::catalog::validate).
    #[error(
        "inconsistent event catalog: {0}; consumers could not tell these payloads apart, so give \
         all but one of them another name with `#[outbox(event_type = \"...\")]`"
    )]
    Catalog(String),

    /// No message in the outbox has this id (an operations command named it).
    #[error(
        "no message with id {id} in {table}; check the id (`outbox pending`, `outbox dead` and \
         `outbox status` show what is there) and the table (`--table`)"
    )]
    UnknownMessage {
        /// The outbox table searched.
        table: String,
        /// The id that was not found.
        id: uuid::Uuid,
    },

    /// A message is not in the state an operation needs (replaying a message that was
    /// never sent, releasing one that is not dead-lettered...). Nothing was changed.
    #[error("message {id} is {state}, so it cannot be {operation}; {hint}; nothing was changed")]
    WrongState {
        /// The message.
        id: uuid::Uuid,
        /// Its current state: `pending`, `in retry`, `sent` or `dead-lettered`.
        state: &'static str,
        /// What was asked: `replayed`, `released`...
        operation: &'static str,
        /// What to do instead.
        hint: &'static str,
    },

    /// An argument of an operation is not valid (an empty time window, no ids...).
    /// Nothing was changed.
    #[error("invalid argument: {0}")]
    InvalidArgument(Cow<'static, str>),

    /// A database operation failed.
    #[error("database error while {context}: {source}")]
    Database {
        /// What the library was doing.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

/// `Result` with [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a driver error, recognising an unreachable server and missing tables.
    pub(crate) fn db(context: &'static str, table: &str, source: sqlx::Error) -> Self {
        if is_connection_error(&source) {
            return Error::Unavailable {
                target: String::new(),
                source,
            };
        }
        if let sqlx::Error::Database(db) = &source {
            // 42P01: undefined_table; 3F000: invalid_schema_name (PostgreSQL);
            // 42S02: no such table (MySQL/MariaDB); SQLite says it in words.
            if matches!(db.code().as_deref(), Some("42P01" | "3F000" | "42S02"))
                || db.message().starts_with("no such table")
            {
                return Error::SchemaMissing {
                    table: table.to_owned(),
                };
            }
        }
        Error::Database { context, source }
    }
}

fn is_connection_error(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
    )
}

/// Removes the password from a database URL so it can be shown in an error or a log line.
#[cfg(any(feature = "postgres", feature = "mysql"))]
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
#[cfg(any(feature = "postgres", feature = "mysql"))]
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
    #[cfg(any(feature = "postgres", feature = "mysql"))]
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
