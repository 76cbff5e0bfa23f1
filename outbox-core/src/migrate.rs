//! The versioned SQL that creates the outbox tables, shipped inside the crate.
//!
//! Migration files are templates: `{outbox}` and `{processed}` become the configured,
//! quoted table names; `{outbox:_suffix}` becomes the quoted, unqualified name of an
//! object derived from the table (an index or a constraint); `{outbox+_suffix}` becomes
//! the quoted, qualified name of a sibling table (MySQL's writer-lock table);
//! `{outbox.name}` the table's unqualified name as a string literal, and
//! `{outbox.sqlite_sequence}` SQLite's AUTOINCREMENT counters of the table's schema (for a
//! rebuilt table). Checksums are taken over the template, so renaming the tables does not
//! invalidate applied migrations.

use crate::config::{TableName, Tables};

/// One versioned migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Applied in increasing order; never reused.
    pub version: i64,
    /// What the migration does.
    pub description: &'static str,
    /// The SQL template.
    pub sql: &'static str,
}

impl Migration {
    /// A stable 64-bit FNV-1a checksum of the template (stored as `bigint`).
    pub fn checksum(&self) -> i64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in self.sql.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        i64::from_ne_bytes(hash.to_ne_bytes())
    }

    /// The SQL with the configured names filled in, for PostgreSQL and SQLite (`"..."`).
    pub fn render(&self, tables: &Tables, quote: fn(&TableName) -> String) -> String {
        self.render_with(tables, quote, |name| format!("\"{name}\""))
    }

    /// `{outbox.name}` and `{outbox.sqlite_sequence}`.
    fn table_fact(tables: &Tables, inner: &str) -> Option<String> {
        let (table, fact) = inner.split_once('.')?;
        let table = match table {
            "outbox" => &tables.outbox,
            "processed" => &tables.processed,
            _ => return None,
        };
        match fact {
            "name" => Some(format!("'{}'", table.name().replace('\'', "''"))),
            "sqlite_sequence" => Some(match table.schema() {
                Some(schema) => format!("\"{}\".sqlite_sequence", schema.replace('"', "\"\"")),
                None => "sqlite_sequence".to_owned(),
            }),
            _ => None,
        }
    }

    /// The SQL with the configured names filled in: `quote` quotes table names,
    /// `quote_ident` the unqualified names of derived objects.
    pub fn render_with(
        &self,
        tables: &Tables,
        quote: fn(&TableName) -> String,
        quote_ident: fn(&str) -> String,
    ) -> String {
        let mut out = String::with_capacity(self.sql.len() + 64);
        let mut rest = self.sql;
        while let Some(start) = rest.find('{') {
            out.push_str(&rest[..start]);
            let after = &rest[start + 1..];
            let end = after.find('}');
            let replaced = end.and_then(|end| {
                let inner = &after[..end];
                if let Some(text) = Self::table_fact(tables, inner) {
                    return Some(text);
                }
                let (table, suffix, sibling) = if let Some((t, s)) = inner.split_once(':') {
                    (t, Some(s), false)
                } else if let Some((t, s)) = inner.split_once('+') {
                    (t, Some(s), true)
                } else {
                    (inner, None, false)
                };
                let table = match table {
                    "outbox" => &tables.outbox,
                    "processed" => &tables.processed,
                    _ => return None,
                };
                Some(match suffix {
                    None => quote(table),
                    Some(suffix) if sibling => quote(&table.with_suffix(suffix)),
                    Some(suffix) => quote_ident(&format!("{}{suffix}", table.name())),
                })
            });
            match (replaced, end) {
                (Some(text), Some(end)) => {
                    out.push_str(&text);
                    rest = &after[end + 1..];
                }
                _ => {
                    out.push('{');
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    }
}

/// A list of migrations, one row each: `version "file" => "description"`, the SQL read
/// from `migrations/<database>/<file>.sql`.
macro_rules! migrations {
    ($database:literal: $($version:literal $file:literal => $description:literal,)+) => {
        &[$(Migration {
            version: $version,
            description: $description,
            sql: include_str!(concat!("../migrations/", $database, "/", $file, ".sql")),
        }),+]
    };
}

/// The PostgreSQL migrations, in order.
#[rustfmt::skip]
pub const POSTGRES: &[Migration] = migrations!("postgres":
    1 "0001_create_outbox" => "create the outbox and processed-messages tables",
    2 "0002_dead_letter_index" => "index dead-lettered messages",
    3 "0003_stop_writing_xact_id" => "stop writing xact_id (never read)",
    4 "0004_dead_letter_key_index" => "index dead-lettered messages by key",
    5 "0005_consumer_state" => "create the consumers' state tables (running instances, failing messages)",
    6 "0006_payload_bytes" => "store payloads as bytes with a content type",
);

/// The SQLite migrations, in order.
#[rustfmt::skip]
pub const SQLITE: &[Migration] = migrations!("sqlite":
    1 "0001_create_outbox" => "create the outbox and processed-messages tables",
    2 "0002_dead_letter_key_index" => "index dead-lettered messages by key",
    3 "0003_consumer_state" => "create the consumers' state tables (running instances, failing messages)",
    4 "0004_payload_bytes" => "store payloads as bytes with a content type (the table is rebuilt)",
);

/// The MySQL/MariaDB migrations, in order.
#[rustfmt::skip]
pub const MYSQL: &[Migration] = migrations!("mysql":
    1 "0001_create_outbox" => "create the outbox, writer-lock and processed-messages tables",
    2 "0002_consumer_state" => "create the consumers' state tables (running instances, failing messages)",
    3 "0003_payload_bytes" => "store payloads as bytes with a content type",
);

/// Checks what a database says it applied against `shipped`; returns what is left to do.
pub(crate) fn pending<'m>(
    shipped: &'m [Migration],
    applied: &[(i64, String, i64)],
) -> crate::Result<Vec<&'m Migration>> {
    use crate::Error;
    for (version, description, checksum) in applied {
        match shipped.iter().find(|m| m.version == *version) {
            None => {
                return Err(Error::Migration {
                    version: *version,
                    description: description.clone(),
                    problem: "was applied to this database by a newer version of outbox-core; \
                              upgrade this program's outbox-core"
                        .into(),
                });
            }
            Some(m) if m.checksum() != *checksum => {
                return Err(Error::Migration {
                    version: *version,
                    description: description.clone(),
                    problem: "was applied with different SQL than this outbox-core ships; \
                              the tables may have been changed by hand — compare them with the shipped migration"
                        .into(),
                });
            }
            Some(_) => {}
        }
    }
    Ok(shipped
        .iter()
        .filter(|m| !applied.iter().any(|(v, _, _)| *v == m.version))
        .collect())
}

/// The statements of a migration file (split at `;` ending a line; the shipped files
/// have no `;` inside literals), without comments-only chunks.
pub(crate) fn statements(sql: &str) -> Vec<String> {
    sql.split(";\n")
        .map(|chunk| {
            chunk
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n")
                .trim()
                .trim_end_matches(';')
                .to_owned()
        })
        .filter(|s| !s.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_and_leaves_json_literals_alone() {
        let tables = Tables::new(TableName::parse("t", "app.events").expect("valid"));
        let m = Migration {
            version: 1,
            description: "x",
            sql: "CREATE TABLE {outbox} (h jsonb DEFAULT '{}'); CREATE INDEX {outbox:_idx} ON {processed} {unknown}",
        };
        assert_eq!(
            m.render(&tables, TableName::quoted),
            "CREATE TABLE \"app\".\"events\" (h jsonb DEFAULT '{}'); \
             CREATE INDEX \"events_idx\" ON \"app\".\"events_processed\" {unknown}"
        );
    }

    #[test]
    fn versions_increase_and_checksums_are_stable() {
        for pair in POSTGRES.windows(2) {
            assert!(pair[0].version < pair[1].version);
        }
        let m = Migration {
            version: 1,
            description: "x",
            sql: "SELECT 1",
        };
        // Stored in databases: must never change between releases (FNV-1a 64, checked by hand).
        assert_eq!(m.checksum(), 1_846_049_006_458_406_130);
    }
}
