//! PostgreSQL's own options of an outbox, beside its table names ([`Options`]): WAL mode
//! and its names ([`Wal`]), set through [`OutboxBuilder::wal`] and its siblings.

use std::fmt;
use std::path::PathBuf;

use crate::Result;
use crate::config::{TableName, Tables};
#[cfg(feature = "wal")]
use {crate::OutboxBuilder, sqlx::Postgres};

/// What an outbox on PostgreSQL has beyond its table names
/// ([`Outbox::options`](crate::Outbox::options)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// WAL mode ([`OutboxBuilder::wal`]): events go through the write-ahead log, not into
    /// the outbox table. `None`: table mode.
    pub wal: Option<Wal>,
    /// What the builder was asked for, resolved by [`resolve`] once the table names are
    /// known (the slot's default name derives from the outbox table's).
    pub(crate) wal_request: Option<WalRequest>,
}

/// `OutboxBuilder::wal`, `wal_slot` and `wal_password`, before `build`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct WalRequest {
    pub(crate) slot: Option<String>,
    pub(crate) password: Option<Secret>,
    pub(crate) tls: TlsFiles,
}

/// The files of the replication connection's TLS, as libpq names them: the CA
/// certificates that verify the server (`sslrootcert`) and a client certificate and its
/// key (`sslcert`, `sslkey`). sqlx does not hand back the pool's, so WAL mode keeps its
/// own copy; the TLS mode itself (`sslmode`) is read from the pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TlsFiles {
    pub(crate) root_cert: Option<PathBuf>,
    pub(crate) client_cert: Option<PathBuf>,
    pub(crate) client_key: Option<PathBuf>,
}

impl TlsFiles {
    /// The files a connection URL names (`sslrootcert`, `sslcert`, `sslkey`), else those
    /// of libpq's variables (`PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`), as sqlx does for
    /// the pool.
    #[cfg(feature = "wal")]
    fn from_url(url: &str) -> TlsFiles {
        let file = |param: &str, var: &str| {
            url_query_param(url, param)
                .or_else(|| std::env::var(var).ok())
                .filter(|path| !path.is_empty())
                .map(PathBuf::from)
        };
        TlsFiles {
            root_cert: file("sslrootcert", "PGSSLROOTCERT"),
            client_cert: file("sslcert", "PGSSLCERT"),
            client_key: file("sslkey", "PGSSLKEY"),
        }
    }
}

/// Completes `options` for the outbox `tables` (`OutboxBuilder::build`).
pub(crate) fn resolve(options: &mut Options, tables: &Tables) -> Result<()> {
    if let Some(request) = options.wal_request.take() {
        let mut wal = Wal::new(&tables.outbox, request.slot.as_deref())?;
        wal.password = request.password;
        wal.tls = request.tls;
        options.wal = Some(wal);
    }
    Ok(())
}

/// WAL mode's names (PostgreSQL, see [`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md)): commits write each event with
/// `pg_logical_emit_message(true, prefix, envelope)`, and the relay reads them through
/// the logical replication slot `slot` (pgoutput, publication `publication`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wal {
    /// The logical replication slot (default `outbox_<table>`).
    pub slot: String,
    /// The publication pgoutput needs (default: the slot's name). It publishes no table:
    /// the relay reads only the messages.
    pub publication: String,
    /// The prefix of this outbox's messages (`outbox:<slot>`, unique like the slot): other
    /// outboxes and other users of `pg_logical_emit_message` in the database are skipped.
    pub prefix: String,
    /// The replication connection's password, when the pool's options hold one (sqlx
    /// does not hand it back). Never shown by `Debug`.
    pub(crate) password: Option<Secret>,
    /// The replication connection's TLS files (its mode is the pool's `sslmode`).
    pub(crate) tls: TlsFiles,
}

/// A password: `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(pub(crate) String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Wal {
    /// The names for the outbox table `outbox`, with the slot `slot` if given (else
    /// `outbox_<schema>_<table>`, lower-cased). A slot name is 1 to 63 characters of
    /// `a-z`, `0-9` and `_`.
    pub fn new(outbox: &TableName, slot: Option<&str>) -> Result<Wal> {
        let slot = match slot {
            Some(slot) => {
                if slot.is_empty()
                    || slot.len() > 63
                    || !slot
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                {
                    return Err(crate::Error::InvalidArgument(
                        format!(
                            "invalid replication slot name {slot:?}: PostgreSQL allows 1 to 63 \
                             characters of a-z, 0-9 and _"
                        )
                        .into(),
                    ));
                }
                slot.to_owned()
            }
            None => {
                let base = match outbox.schema() {
                    Some(schema) => format!("outbox_{schema}_{}", outbox.name()),
                    None => format!("outbox_{}", outbox.name()),
                };
                let mut slot: String = base
                    .to_lowercase()
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '_' {
                            c
                        } else {
                            '_'
                        }
                    })
                    .collect();
                slot.truncate(63);
                slot
            }
        };
        Ok(Wal {
            publication: slot.clone(),
            prefix: format!("outbox:{slot}"),
            slot,
            password: None,
            tls: TlsFiles::default(),
        })
    }
}

#[cfg(feature = "wal")]
#[cfg_attr(docsrs, doc(cfg(feature = "wal")))]
impl OutboxBuilder<Postgres> {
    /// WAL mode: commits write events into PostgreSQL's write-ahead log
    /// (`pg_logical_emit_message`), not into the outbox table, and the relay reads them
    /// from a logical replication slot. Needs `wal_level = logical` and a user with the
    /// `REPLICATION` attribute; [`Outbox::migrate`](crate::Outbox::migrate) creates the
    /// slot (before the first event: a slot sees only what is written after it). See
    /// [`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md).
    pub fn wal(mut self) -> Self {
        self.options.wal_request.get_or_insert_default();
        self
    }

    /// WAL mode with the replication slot `name` (default `outbox_<table>`).
    pub fn wal_slot(mut self, name: impl Into<String>) -> Self {
        self.options.wal_request.get_or_insert_default().slot = Some(name.into());
        self
    }

    /// The password of the relay's replication connection, when the pool's connect
    /// options hold one ([`Outbox::connect_wal`](crate::Outbox::connect_wal) takes it
    /// from the URL). Without it, the relay uses `PGPASSWORD`, if set.
    pub fn wal_password(mut self, password: impl Into<String>) -> Self {
        self.options.wal_request.get_or_insert_default().password = Some(Secret(password.into()));
        self
    }

    /// The CA certificates (a PEM file) that verify the server's certificate on the
    /// relay's replication connection, like `sslrootcert` for the pool (sqlx does not
    /// hand the pool's back). The TLS mode is the pool's `sslmode`; without this file,
    /// `verify-ca` and `verify-full` trust the Mozilla roots.
    /// [`Outbox::connect_wal`](crate::Outbox::connect_wal) takes it from the URL.
    pub fn wal_ssl_root_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.options
            .wal_request
            .get_or_insert_default()
            .tls
            .root_cert = Some(path.into());
        self
    }

    /// A client certificate and its private key (PEM files) for the replication
    /// connection, like `sslcert` and `sslkey` for the pool (mutual TLS).
    pub fn wal_ssl_client_cert(
        mut self,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        let tls = &mut self.options.wal_request.get_or_insert_default().tls;
        tls.client_cert = Some(cert.into());
        tls.client_key = Some(key.into());
        self
    }
}

#[cfg(feature = "wal")]
#[cfg_attr(docsrs, doc(cfg(feature = "wal")))]
impl crate::Outbox<Postgres> {
    /// Connects to PostgreSQL at `url` in WAL mode (see [`OutboxBuilder::wal`]), with the
    /// default table names; the relay's replication connection uses the URL's password
    /// and TLS settings (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`; TLS needs the
    /// feature `tls-rustls`).
    pub async fn connect_wal(url: &str) -> Result<Self> {
        let pool = crate::db::connect::pool(url).await?;
        let mut builder = crate::Outbox::builder(pool).wal();
        if let Some(password) = url_password(url) {
            builder = builder.wal_password(password);
        }
        builder.options.wal_request.get_or_insert_default().tls = TlsFiles::from_url(url);
        builder.build()
    }
}

#[cfg(feature = "wal")]
/// The percent-decoded password of a `postgres://user:password@host/db` URL, or of its
/// `password=` query parameter.
fn url_password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let before_query = rest.split_once('?').map_or(rest, |(before, _)| before);
    let authority = before_query.split('/').next()?;
    let in_userinfo = authority
        .rsplit_once('@')
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, password)| password);
    match in_userinfo {
        Some(password) => percent_decode(password),
        None => url_query_param(url, "password"),
    }
}

#[cfg(feature = "wal")]
/// The percent-decoded value of the query parameter `name` of a connection URL.
fn url_query_param(url: &str, name: &str) -> Option<String> {
    let query = url.split_once('?')?.1;
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key == name).then(|| percent_decode(value)).flatten()
    })
}

#[cfg(feature = "wal")]
fn percent_decode(text: &str) -> Option<String> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .ok()
        .map(|text| text.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "wal")]
    #[test]
    fn the_password_comes_from_the_url_decoded() {
        assert_eq!(
            url_password("postgres://app:s%40cr%2Ft@db:5432/x?sslmode=disable").as_deref(),
            Some("s@cr/t")
        );
        assert_eq!(url_password("postgres://app@db/x"), None);
        assert_eq!(url_password("postgres://db/x"), None);
        // Not an escape before a multi-byte character, nor at the end: kept, no panic.
        assert_eq!(
            url_password("postgres://app:%é%4@db/x").as_deref(),
            Some("%é%4")
        );
        assert_eq!(
            url_password("postgres://app:%C3%A9@db/x").as_deref(),
            Some("é")
        );
        assert_eq!(
            url_password("postgres://app@db/x?sslmode=disable&password=p%26q").as_deref(),
            Some("p&q")
        );
    }

    #[cfg(feature = "wal")]
    #[test]
    fn the_tls_files_come_from_the_url() {
        let files = TlsFiles::from_url(
            "postgres://app@db/x?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.crt&sslcert=c.pem&sslkey=k.pem",
        );
        assert_eq!(
            files.root_cert.as_deref(),
            Some(std::path::Path::new("/etc/ca.crt"))
        );
        assert_eq!(
            files.client_cert.as_deref(),
            Some(std::path::Path::new("c.pem"))
        );
        assert_eq!(
            files.client_key.as_deref(),
            Some(std::path::Path::new("k.pem"))
        );
        assert_eq!(
            url_query_param("postgres://db/x?a=1&sslmode=require", "sslmode").as_deref(),
            Some("require")
        );
        assert_eq!(
            url_query_param("postgres://db/x?xsslmode=require", "sslmode"),
            None
        );
        assert_eq!(url_query_param("postgres://db/x", "sslmode"), None);
    }

    #[test]
    fn slot_names_are_checked_and_passwords_never_shown() {
        let table = crate::config::TableName::parse("t", "billing.Outbox").expect("name");
        let mut wal = Wal::new(&table, None).expect("default");
        assert_eq!(wal.slot, "outbox_billing_outbox");
        assert_eq!(wal.prefix, "outbox:outbox_billing_outbox");
        let err = Wal::new(&table, Some("Bad-Name")).expect_err("refused");
        assert!(err.to_string().contains("a-z, 0-9 and _"), "{err}");
        wal.password = Some(Secret("hunter2".into()));
        assert!(!format!("{wal:?}").contains("hunter2"));
    }
}
