//! The migration dialect: the whole file in one transaction under an advisory lock on
//! the outbox's name; in WAL mode, `migrate` also creates the publication and the slot.

use futures_util::future::BoxFuture;
use sqlx::{PgConnection, Postgres};

use super::{Options, wal};
use crate::Result;
use crate::config::{TableName, Tables};
use crate::error::DbContext;
use crate::migrate::{Migration, POSTGRES as MIGRATIONS};
use crate::store::schema::{self, Schema};

impl Schema for Postgres {
    const MIGRATIONS: &'static [Migration] = MIGRATIONS;
    const TRANSACTIONAL_DDL: bool = true;
    const THREE_PARAMS: &'static str = "$1, $2, $3";

    fn ensure_table(tables: &Tables) -> Vec<String> {
        let schema = tables.outbox.schema();
        schema
            .map(|s| format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""))
            .into_iter()
            .chain([format!(
                "CREATE TABLE IF NOT EXISTS {} (\
                   version bigint PRIMARY KEY, \
                   description text NOT NULL, \
                   checksum bigint NOT NULL, \
                   applied_at timestamptz NOT NULL DEFAULT now())",
                tables.migrations.quoted()
            )])
            .collect()
    }

    /// The whole file at once (the simple protocol runs its statements in order).
    fn statements(migration: &Migration, tables: &Tables) -> Vec<String> {
        vec![migration.render(tables, TableName::quoted)]
    }

    /// An advisory lock on the outbox's name, held until the migration transaction ends.
    fn lock<'c>(conn: &'c mut PgConnection, tables: &'c Tables) -> BoxFuture<'c, Result<()>> {
        Box::pin(async move {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
                .bind(format!("outbox-migrate:{}", tables.outbox))
                .execute(conn)
                .await
                .context("locking the migrations", &tables.migrations)?;
            Ok(())
        })
    }

    /// In WAL mode, also creates the publication and the replication slot: before the
    /// first event is written, since a slot sees only what is written after it.
    fn migrate<'c>(
        pool: &'c sqlx::PgPool,
        tables: &'c Tables,
        options: &'c Options,
    ) -> BoxFuture<'c, Result<Vec<i64>>> {
        Box::pin(async move {
            let applied = schema::run(pool, tables).await?;
            if let Some(w) = &options.wal {
                wal::ensure_slot(pool, tables, w).await?;
            }
            Ok(applied)
        })
    }
}
