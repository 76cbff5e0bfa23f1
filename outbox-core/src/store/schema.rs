//! The migration dialect each database supplies, and the one runner that applies the
//! shipped migrations with it: begin (where DDL is transactional), lock, ensure the
//! migrations table, read what was applied, check it, apply what is pending and record
//! it, commit (or roll back), unlock.

use futures_util::future::BoxFuture;
use sqlx::{Encode, Executor, FromRow, IntoArguments, Type};

use crate::config::{TableName, Tables};
use crate::error::DbContext;
use crate::migrate::{Migration, pending, statements as split};
use crate::store::trusted_sql;
use crate::{Error, Result};

/// How one database runs migrations.
#[doc(hidden)]
pub trait Schema: super::Database {
    /// The shipped migrations, in order.
    const MIGRATIONS: &'static [Migration];

    /// Whether a failed migration leaves nothing behind (its DDL runs in the runner's
    /// transaction). MySQL commits DDL implicitly.
    const TRANSACTIONAL_DDL: bool;

    /// How the runner begins the migration transaction, where DDL is transactional.
    const BEGIN: &'static str = "BEGIN";

    /// Whether the runner closes its connection afterwards instead of returning it to the
    /// pool (so a cancelled migration leaves no transaction or lock on a pooled
    /// connection). Not for SQLite: an in-memory database lives as long as its
    /// connections.
    const CLOSE_AFTER: bool = true;

    /// Statements that create the outbox's schema (if the table names one) and the
    /// migrations table, if missing.
    fn ensure_table(tables: &Tables) -> Vec<String>;

    /// A table name quoted for this database (by default in double quotes).
    fn quote(table: &TableName) -> String {
        table.quoted()
    }

    /// The unqualified name of an object derived from a table (an index), quoted.
    fn quote_ident(name: &str) -> String {
        format!("\"{name}\"")
    }

    /// Three bind placeholders, for recording a migration.
    const THREE_PARAMS: &'static str = "?, ?, ?";

    /// A migration's template with the configured names filled in, as the statements to
    /// run (split at `;` ending a line).
    fn statements(migration: &Migration, tables: &Tables) -> Vec<String> {
        split(&migration.render_with(tables, Self::quote, Self::quote_ident))
    }

    /// Serialises migrators of one outbox table on `conn`, inside the migration
    /// transaction where DDL is transactional. Nothing by default: [`BEGIN`](Self::BEGIN)
    /// may take the lock itself.
    fn lock<'c>(conn: &'c mut Self::Connection, tables: &'c Tables) -> BoxFuture<'c, Result<()>> {
        let _ = (conn, tables);
        Box::pin(async { Ok(()) })
    }

    /// Releases what [`lock`](Self::lock) took and the transaction's end did not.
    /// Nothing by default.
    fn unlock<'c>(conn: &'c mut Self::Connection, tables: &'c Tables) -> BoxFuture<'c, Result<()>> {
        let _ = (conn, tables);
        Box::pin(async { Ok(()) })
    }

    /// Applies the pending migrations ([`run`] with this database's types); returns the
    /// versions applied now.
    fn migrate<'c>(
        pool: &'c sqlx::Pool<Self>,
        tables: &'c Tables,
        options: &'c Self::Options,
    ) -> BoxFuture<'c, Result<Vec<i64>>>;
}

/// The one migration runner. Other migrators of the same outbox wait at the lock, then
/// find nothing to do. The connection is closed afterwards rather than returned to the
/// pool, so a migration cancelled half-way never leaves a transaction or a lock behind
/// on a pooled connection.
pub(crate) async fn run<DB>(pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<Vec<i64>>
where
    DB: Schema,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'r> (i64, String, i64): FromRow<'r, DB::Row>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
{
    let mut conn = pool
        .acquire()
        .await
        .context("connecting to migrate", &tables.migrations)?;
    if DB::CLOSE_AFTER {
        conn.close_on_drop();
    }
    let table = &tables.migrations;
    if DB::TRANSACTIONAL_DDL {
        conn.execute(DB::BEGIN)
            .await
            .context("starting the migration transaction", table)?;
    }
    DB::lock(&mut conn, tables).await?;
    let result: Result<Vec<i64>> = async {
        for statement in DB::ensure_table(tables) {
            conn.execute(trusted_sql(statement.as_str()))
                .await
                .context("creating the migrations table", table)?;
        }
        let migrations = DB::quote(table);
        let applied: Vec<(i64, String, i64)> = sqlx::query_as(trusted_sql(format!(
            "SELECT version, description, checksum FROM {migrations} ORDER BY version"
        )))
        .fetch_all(&mut *conn)
        .await
        .context("reading the applied migrations", table)?;
        let record = format!(
            "INSERT INTO {migrations} (version, description, checksum) VALUES ({})",
            DB::THREE_PARAMS
        );
        let mut done = Vec::new();
        for m in pending(DB::MIGRATIONS, &applied)? {
            for statement in DB::statements(m, tables) {
                conn.execute(trusted_sql(statement.as_str()))
                    .await
                    .map_err(|source| Error::Migration {
                        version: m.version,
                        description: m.description.to_owned(),
                        problem: if DB::TRANSACTIONAL_DDL {
                            format!("failed: {source}; nothing was changed").into()
                        } else {
                            format!(
                                "failed: {source}; this database cannot roll back DDL, so drop what \
                                 this migration created before running it again"
                            )
                            .into()
                        },
                    })?;
            }
            sqlx::query(trusted_sql(&record))
                .bind(m.version)
                .bind(m.description)
                .bind(m.checksum())
                .execute(&mut *conn)
                .await
                .context("recording a migration", table)?;
            tracing::info!(
                version = m.version,
                description = m.description,
                "applied outbox migration"
            );
            done.push(m.version);
        }
        Ok(done)
    }
    .await;
    let ended = if DB::TRANSACTIONAL_DDL {
        let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
        conn.execute(end)
            .await
            .map(drop)
            .context("ending the migration transaction", table)
    } else {
        Ok(())
    };
    let unlocked = DB::unlock(&mut conn, tables).await;
    let done = result?;
    ended?;
    unlocked?;
    Ok(done)
}
