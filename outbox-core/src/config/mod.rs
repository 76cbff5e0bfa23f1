//! Table names and other settings, validated once at configuration time.

use std::fmt;
use std::time::Duration;

use crate::{Error, Result};

/// Longest accepted table name (without the schema). PostgreSQL truncates identifiers at
/// 63 bytes; we keep room for the suffixes of derived names (`_pending_idx`, `_migrations`).
pub const MAX_IDENTIFIER_LEN: usize = 48;

/// Longest accepted schema name: PostgreSQL's limit.
pub const MAX_SCHEMA_LEN: usize = 63;

// The deprecated paths of types that moved to `outbox_core::postgres` (kept for one
// release; CHANGELOG, "Breaking"). In a file of their own: `config` itself names no
// database.
#[cfg(feature = "postgres")]
mod moved;
#[cfg(feature = "postgres")]
#[allow(deprecated)]
pub use moved::{PartitionInterval, Wal};

/// A validated, optionally schema-qualified SQL table name such as `outbox` or
/// `billing.outbox`.
///
/// Parts match `[A-Za-z_][A-Za-z0-9_]*`. They are always quoted in generated SQL, so
/// names are case-sensitive and may be reserved words.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    schema: Option<String>,
    name: String,
}

impl TableName {
    /// Parses and validates `name`; `what` names the setting in the error message.
    pub fn parse(what: &'static str, name: &str) -> Result<Self> {
        let invalid = |reason| Error::InvalidIdentifier {
            what,
            name: name.to_owned(),
            reason,
        };
        let mut parts = name.split('.');
        let first = parts.next().unwrap_or_default();
        let (schema, table) = match (parts.next(), parts.next()) {
            (None, _) => (None, first),
            (Some(second), None) => (Some(first), second),
            (Some(_), Some(_)) => {
                return Err(invalid("more than one `.`; only `schema.table` is allowed"));
            }
        };
        if let Some(schema) = schema {
            validate_part(schema, MAX_SCHEMA_LEN).map_err(invalid)?;
        }
        validate_part(table, MAX_IDENTIFIER_LEN).map_err(invalid)?;
        Ok(TableName {
            schema: schema.map(str::to_owned),
            name: table.to_owned(),
        })
    }

    /// The schema, if the name is qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The unqualified table name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name quoted for PostgreSQL: `"schema"."table"`.
    pub fn quoted(&self) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}\"", self.name),
            None => format!("\"{}\"", self.name),
        }
    }

    /// The name quoted for MySQL/MariaDB: `` `schema`.`table` `` (the schema is a database).
    pub fn backticked(&self) -> String {
        match &self.schema {
            Some(s) => format!("`{s}`.`{}`", self.name),
            None => format!("`{}`", self.name),
        }
    }

    /// Another object in the same schema, named `name` as the server gave it (not
    /// validated again: a partition's name may be longer than a table name we accept).
    #[cfg(feature = "postgres")]
    pub(crate) fn sibling(&self, name: &str) -> TableName {
        TableName {
            schema: self.schema.clone(),
            name: name.to_owned(),
        }
    }

    /// A sibling table or object name in the same schema: `name` + `suffix`.
    pub(crate) fn with_suffix(&self, suffix: &str) -> TableName {
        TableName {
            schema: self.schema.clone(),
            name: format!("{}{suffix}", self.name),
        }
    }
}

fn validate_part(part: &str, max_len: usize) -> std::result::Result<(), &'static str> {
    let mut chars = part.chars();
    match chars.next() {
        None => return Err("a name part is empty"),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return Err("a name part must start with a letter or `_`");
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err("only ASCII letters, digits and `_` are allowed");
    }
    if part.len() > max_len {
        return Err("a name part is too long");
    }
    Ok(())
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableName({self})")
    }
}

/// The names the outbox uses in the database ([`Tables::new`] derives them from the
/// outbox table's name).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Tables {
    /// The outbox table (default `outbox`).
    pub outbox: TableName,
    /// The consumers' processed-messages table (default `outbox_processed`).
    pub processed: TableName,
    /// The table recording applied migrations (default: outbox table + `_migrations`).
    pub migrations: TableName,
}

impl Tables {
    /// Names derived from one outbox table name.
    pub fn new(outbox: TableName) -> Self {
        let processed = outbox.with_suffix("_processed");
        Tables {
            migrations: outbox.with_suffix("_migrations"),
            processed,
            outbox,
        }
    }
}

impl Default for Tables {
    fn default() -> Self {
        Tables::new(TableName {
            schema: None,
            name: "outbox".to_owned(),
        })
    }
}

/// What the relay does with a row once the broker acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnSent {
    /// Set `sent_at` and keep the row (for audits and replays) until retention removes it.
    #[default]
    Mark,
    /// Delete the row.
    Delete,
}

/// What happens to the later messages of a key whose message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnDeadLetter {
    /// They stay parked behind it, so nothing overtakes it: until an operator releases
    /// it (it goes first, then they follow) or discards it (`outbox discard`). Other keys
    /// flow on. `outbox dead` shows how many messages each dead letter holds back.
    #[default]
    ParkKey,
    /// They go on without it (availability over order): a released dead letter then
    /// reaches consumers after newer messages of its key.
    SkipKey,
}

/// The relay's settings. Every field has a documented default.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Rows claimed and published per cycle. Default 1000.
    pub batch_size: usize,
    /// The most payload and header bytes one batch holds (a larger message goes alone).
    /// With `batch_size`, it bounds the relay's memory: two batches are in memory at once
    /// (one with the publisher, the next one claimed), or `batches_in_flight` of them once
    /// caught up. Default 16 MiB.
    pub max_batch_bytes: usize,
    /// WAL mode ([`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md)): the most payload and header bytes the relay holds in
    /// memory, received from the slot and not yet acknowledged (beside the count bound,
    /// `max(10 × batch_size, 10,000)` messages). Past either, the stream waits in the
    /// slot. It may be passed by one message (the one that crossed it), and is never
    /// below two batches (`2 × max_batch_bytes`). Default 256 MiB.
    pub wal_buffer_bytes: usize,
    /// Once caught up with the writers, how many batches the relay may keep with the
    /// publisher at once (no key in two of them), at most 4 and at most what the
    /// publisher takes (`Publisher::max_batches_in_flight`).
    /// 1 waits for each batch's acknowledgements before the next claim. Default 1: on
    /// some machines more lowered the median commit → acknowledgement by 40%, on others
    /// the broker answered each call more slowly and it rose ([docs/benchmarks.md](https://github.com/outbox-rs/outbox/blob/main/docs/benchmarks.md)).
    pub batches_in_flight: usize,
    /// PostgreSQL: the safety poll while no notification arrives, default 5 s.
    /// MySQL/MariaDB and SQLite (no notifications): how often an idle relay looks for
    /// new rows, default 100 ms.
    pub poll_interval: Duration,
    /// Failed attempts before a message is dead-lettered. Default 10.
    pub max_attempts: i32,
    /// First retry delay; doubles per attempt, with ±25% jitter. Default 1 s.
    pub backoff_base: Duration,
    /// Longest retry delay. Default 5 min.
    pub backoff_cap: Duration,
    /// Partitions rows are spread over by key; the unit of work shared between relays.
    /// Every relay of one outbox must use the same number. Default 16.
    pub partitions: u16,
    /// A publish call that takes longer fails the whole batch (retryable). Default 30 s.
    pub publish_timeout: Duration,
    /// How long the active relay may publish nothing while rows are due before it says
    /// so in a warning (repeated every such period while it lasts), naming what it waits
    /// for. Default 60 s.
    pub stall_warning: Duration,
    /// Mark or delete acknowledged rows. Default [`OnSent::Mark`].
    pub on_sent: OnSent,
    /// The later messages of a key with a dead letter wait for it, or go on. Default
    /// [`OnDeadLetter::ParkKey`].
    pub on_dead_letter: OnDeadLetter,
    /// Longest wait between reconnection attempts after a database error. Default 5 s.
    pub reconnect_delay: Duration,
    /// How long opening a database session may take (connecting, registering) before it
    /// counts as failed; also bounds closing it. Default 10 s.
    pub connect_timeout: Duration,
    /// A relay whose process stops answering (SIGSTOP, a frozen VM, a host that paused)
    /// loses its work to the other relays after about this long: the server ends its
    /// session once it has been idle that long (PostgreSQL >= 14 `idle_session_timeout`,
    /// MySQL/MariaDB `wait_timeout`), which releases its locks. A working relay is never
    /// idle that long: the value used is at least `2 × publish_timeout + poll_interval + 5 s`
    /// (70 s with the defaults; two publish timeouts: after a publisher panic the batch
    /// is published again one message at a time).
    /// Default 60 s. (A host that vanished is noticed sooner on PostgreSQL, by TCP
    /// keepalives: ~25 s.)
    pub session_timeout: Duration,
    /// How often a busy relay re-checks how partitions are shared. Default 1 s.
    pub rebalance_interval: Duration,
    /// `application_name` of the relay's database sessions. Default `outbox-relay`.
    pub application_name: String,
}

impl RelayConfig {
    /// [`session_timeout`](Self::session_timeout) as used: never shorter than one
    /// publish plus one poll, so a working relay never loses its session to it.
    /// After a publisher panic, a batch is published once more one message at a time:
    /// two `publish_timeout`s. At most 24 days (PostgreSQL takes milliseconds in an int).
    pub(crate) fn effective_session_timeout(&self) -> Duration {
        self.session_timeout
            .max(2 * self.publish_timeout + self.poll_interval + Duration::from_secs(5))
            .min(Duration::from_secs(24 * 24 * 3600))
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 1000,
            max_batch_bytes: 16 * 1024 * 1024,
            wal_buffer_bytes: 256 * 1024 * 1024,
            batches_in_flight: 1,
            poll_interval: Duration::from_secs(5),
            max_attempts: 10,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(300),
            partitions: 16,
            publish_timeout: Duration::from_secs(30),
            stall_warning: Duration::from_secs(60),
            on_sent: OnSent::Mark,
            on_dead_letter: OnDeadLetter::ParkKey,
            reconnect_delay: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            session_timeout: Duration::from_secs(60),
            rebalance_interval: Duration::from_secs(1),
            application_name: "outbox-relay".to_owned(),
        }
    }
}

/// A number in `[0, 1)`, different each call (std's randomly keyed hasher; no RNG crate).
pub(crate) fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// `%XX` escapes of a URL part decoded (a `%` not followed by two hex digits is kept), as
/// sqlx decodes a `sqlite://` path and as NATS URLs carry credentials. Shared by the
/// `outbox` CLI and `outbox-nats`; not part of the API.
#[doc(hidden)]
pub fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// `text` with every non-empty secret of `secrets` replaced by `***`; if a secret shows
/// even so (a `***` next to a secret's `*` can rebuild it: `a*` in `aa**` becomes
/// `a****`), the whole text is withheld. Shared by the transports' redaction; not part
/// of the API.
#[doc(hidden)]
pub fn mask_secrets<'a>(text: &str, secrets: impl IntoIterator<Item = &'a str> + Clone) -> String {
    let mut out = text.to_owned();
    for secret in secrets.clone() {
        if !secret.is_empty() {
            out = out.replace(secret, "***");
        }
    }
    if secrets
        .into_iter()
        .any(|secret| !secret.is_empty() && out.contains(secret))
    {
        return "<text withheld: it held a secret that could not be masked>".to_owned();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified_names() {
        let t = TableName::parse("outbox table name", "outbox").expect("valid");
        assert_eq!(t.quoted(), "\"outbox\"");
        let t = TableName::parse("outbox table name", "billing.Outbox_2").expect("valid");
        assert_eq!(t.quoted(), "\"billing\".\"Outbox_2\"");
        assert_eq!(t.schema(), Some("billing"));
        assert_eq!(t.to_string(), "billing.Outbox_2");
    }

    #[test]
    fn rejects_injection_and_malformed_names() {
        for (bad, reason) in [
            ("", "empty"),
            ("outbox; DROP TABLE users", "only ASCII"),
            ("a.b.c", "more than one"),
            ("1outbox", "start with a letter"),
            ("out\"box", "only ASCII"),
            (".outbox", "empty"),
            ("schema.", "empty"),
            ("ünïcode", "start with a letter"),
        ] {
            let err = TableName::parse("outbox table name", bad).expect_err(bad);
            let msg = err.to_string();
            assert!(msg.contains(reason), "{bad:?}: {msg}");
            assert!(msg.contains("outbox table name"), "{msg}");
        }
        let long = "a".repeat(MAX_IDENTIFIER_LEN + 1);
        assert!(TableName::parse("outbox table name", &long).is_err());
        assert!(TableName::parse("outbox table name", &long[1..]).is_ok());
        let schema = "s".repeat(MAX_SCHEMA_LEN);
        assert!(TableName::parse("outbox table name", &format!("{schema}.t")).is_ok());
        assert!(TableName::parse("outbox table name", &format!("{schema}s.t")).is_err());
    }

    #[test]
    fn derived_names_share_the_schema() {
        let tables = Tables::new(TableName::parse("t", "s.events").expect("valid"));
        assert_eq!(tables.processed.to_string(), "s.events_processed");
        assert_eq!(tables.migrations.to_string(), "s.events_migrations");
    }
}
