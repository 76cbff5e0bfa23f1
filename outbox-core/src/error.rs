//! The one error type of the outbox runtime.

use std::borrow::Cow;

/// Everything that can go wrong in `outbox-core`.
///
/// Each variant says what happened, to what, and what to do about it. Match on the
/// variant to act; print it to tell a person. A variant that wraps the driver's error
/// returns it from [`source`](std::error::Error::source) and does not repeat it in its
/// own message: print the whole chain with [`ErrorChain`] (or `anyhow`'s `{:#}`), as
/// the library's logs and the `outbox` command do.
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
        "could not serialize event `{event_type}` to JSON; check its `Serialize` implementation"
    )]
    Serialize {
        /// The event type that failed.
        event_type: String,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },

    /// An event could not be encoded by its codec (Protobuf, raw bytes, one of your
    /// own). The transaction is still usable.
    #[error("could not encode event `{event_type}` as {content_type}")]
    Encode {
        /// The event type that failed.
        event_type: String,
        /// What the codec writes.
        content_type: String,
        /// The codec's error.
        #[source]
        source: crate::codec::CodecError,
    },

    /// A message is larger than the outbox's
    /// [`max_message_bytes`](crate::OutboxBuilder::max_message_bytes): refused when it is
    /// emitted, not dead-lettered by the relay later. Nothing was written; the transaction
    /// can still be committed without it.
    #[error(
        "event `{event_type}` for `{destination}` is {bytes} bytes (payload and headers), \
         over this outbox's max_message_bytes of {limit}: the broker would refuse it and the \
         relay would dead-letter it. Make it smaller (send a reference to the data instead), \
         or raise max_message_bytes if the broker takes more"
    )]
    TooLarge {
        /// The event type.
        event_type: String,
        /// Where it was going.
        destination: String,
        /// Its payload and header bytes.
        bytes: usize,
        /// The outbox's limit.
        limit: usize,
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
        "cannot reach the database{target}; check that the server is running and that \
         the URL (e.g. DATABASE_URL) points at it"
    )]
    Unavailable {
        /// Where we tried to connect (password removed), prefixed with " at ", or empty.
        target: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The TLS handshake with the database failed (a certificate the URL's `sslrootcert`
    /// or `ssl-ca` does not vouch for, a host name the certificate does not name), or the URL asks for
    /// TLS and this build has none.
    #[error(
        "TLS with the database{target} failed; check the URL's TLS settings \
         (PostgreSQL: `sslmode` and `sslrootcert`; MySQL: `ssl-mode` and `ssl-ca`): the \
         server's certificate must be signed by that CA and, with verify-full or \
         VERIFY_IDENTITY, name the host; and that this build has TLS (feature `tls-rustls`)"
    )]
    Tls {
        /// Where we tried to connect (password removed), prefixed with " at ", or empty.
        target: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The event catalog is inconsistent: two Rust types claim the same event type name
    /// on the same destination, one event type and version is published to two
    /// destinations, or (feature `schema`) has two payload schemas. See
    /// [`catalog::validate`](crate::catalog::validate).
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

    /// The transaction can no longer commit what was done in it: an earlier error
    /// aborted it (PostgreSQL), or the server rolled it back (a MySQL deadlock). Nothing
    /// was written; roll back and run the whole unit of work again.
    #[error(
        "the transaction on {table} can no longer commit: {reason}; nothing was written: \
         roll back and run the whole unit of work again"
    )]
    TransactionAborted {
        /// The outbox table.
        table: String,
        /// What happened to the transaction.
        reason: &'static str,
    },

    /// A database operation failed.
    #[error("database error while {context}")]
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

/// An error and its sources on one line, `what happened: why: why`: the way to print an
/// [`Error`] (or any error) whole.
///
/// The outbox's errors do not repeat their source in their own message (so that
/// `anyhow`'s `{:#}` or a reporter walking [`source`](std::error::Error::source) prints
/// it once); `ErrorChain` walks the sources, and leaves out one whose text the message
/// before it already holds (some drivers' errors do both).
///
/// ```
/// use outbox_core::ErrorChain;
///
/// let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
/// let e = outbox_core::Error::Unavailable { target: " at 127.0.0.1:5432".into(), source: io.into() };
/// let line = ErrorChain(&e).to_string();
/// assert!(line.starts_with("cannot reach the database at 127.0.0.1:5432; check that the server"));
/// assert!(line.ends_with(": connection refused"), "{line}");
/// assert_eq!(line.matches("connection refused").count(), 1, "{line}");
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut before = self.0.to_string();
        f.write_str(&before)?;
        let mut next = self.0.source();
        while let Some(source) = next {
            let text = source.to_string();
            if !text.is_empty() && !before.contains(&text) {
                write!(f, ": {text}")?;
            }
            before = text;
            next = source.source();
        }
        Ok(())
    }
}

impl std::fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// Wraps a driver error, recognising an unreachable server and missing tables.
    pub(crate) fn db(context: &'static str, table: &str, source: sqlx::Error) -> Self {
        if is_tls_error(&source) {
            return Error::Tls {
                target: String::new(),
                source,
            };
        }
        if is_connection_error(&source) {
            return Error::Unavailable {
                target: String::new(),
                source,
            };
        }
        if let sqlx::Error::Database(db) = &source {
            // 25P02: in_failed_sql_transaction (PostgreSQL).
            if db.code().as_deref() == Some("25P02") {
                return Error::TransactionAborted {
                    table: table.to_owned(),
                    reason: "an earlier statement in it failed, so PostgreSQL aborted it",
                };
            }
        }
        if is_schema_missing(&source) {
            return Error::SchemaMissing {
                table: table.to_owned(),
            };
        }
        Error::Database { context, source }
    }
}

/// The database says a table or schema the statement names does not exist: the
/// migrations have not run.
pub(crate) fn is_schema_missing(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    // 42P01: undefined_table; 3F000: invalid_schema_name (PostgreSQL);
    // 42S02: no such table (MySQL/MariaDB); SQLite says it in words.
    matches!(db.code().as_deref(), Some("42P01" | "3F000" | "42S02"))
        || db.message().starts_with("no such table")
}

/// `.context(doing, table)` on a driver result: [`Error::db`] with the table named only
/// when there is an error.
pub(crate) trait DbContext<T> {
    /// The driver's error as an [`Error`], saying what the library was `doing` on `table`.
    fn context(self, doing: &'static str, table: &dyn std::fmt::Display) -> Result<T>;
}

impl<T> DbContext<T> for std::result::Result<T, sqlx::Error> {
    fn context(self, doing: &'static str, table: &dyn std::fmt::Display) -> Result<T> {
        self.map_err(|e| Error::db(doing, &table.to_string(), e))
    }
}

/// A TLS failure as the driver reports it: its own `Tls` error (TLS asked for and not
/// built in, a bad certificate file), or the I/O error a failed handshake surfaces as (an
/// unknown issuer, a host name the certificate does not name).
pub(crate) fn is_tls_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Tls(_) => true,
        #[cfg(feature = "tls-rustls")]
        sqlx::Error::Io(io) => io
            .get_ref()
            .is_some_and(|inner| inner.is::<rustls::Error>()),
        _ => false,
    }
}

fn is_connection_error(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a source prints its own message only; the chain prints the source
    /// once (failed on the old messages, which printed it twice in a chain).
    #[test]
    fn a_wrapped_driver_error_is_printed_once_in_the_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused by peer");
        let e = Error::Unavailable {
            target: " at db:5432".to_owned(),
            source: io.into(),
        };
        assert!(!e.to_string().contains("refused by peer"), "{e}");
        let chain = ErrorChain(&e).to_string();
        assert_eq!(chain.matches("refused by peer").count(), 1, "{chain}");
        assert!(
            chain.starts_with("cannot reach the database at db:5432; "),
            "{chain}"
        );

        let e = Error::db(
            "claiming a batch",
            "outbox",
            sqlx::Error::Protocol("unexpected message".to_owned()),
        );
        assert_eq!(e.to_string(), "database error while claiming a batch");
        assert_eq!(
            ErrorChain(&e).to_string(),
            "database error while claiming a batch: encountered unexpected or invalid data: \
             unexpected message"
        );
    }
}
