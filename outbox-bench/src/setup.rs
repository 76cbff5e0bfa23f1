//! Command-line arguments and the benchmark database.

use std::str::FromStr;

use outbox_core::Outbox;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_core::sqlx::{self, Connection};

use crate::BoxError;

/// Parsed command line.
pub struct Args {
    pub scenario: String,
    pub events: u64,
    pub keys: u64,
    pub payload: usize,
    pub json: Option<String>,
    pub database_url: String,
}

impl Args {
    pub const USAGE: &'static str = "usage: outbox-bench <drain|pg-ceiling|article|all> \
        [--events N (100000)] [--keys K (1000)] [--payload BYTES (1024)] [--json FILE]";

    pub fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
        let scenario = it.next().ok_or("no scenario given")?;
        let mut args = Args {
            scenario,
            events: 100_000,
            keys: 1000,
            payload: 1024,
            json: None,
            database_url: std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        };
        while let Some(flag) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
            let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
            match flag.as_str() {
                "--events" => args.events = number(value()?)?,
                "--keys" => args.keys = number(value()?)?.max(1),
                "--payload" => {
                    args.payload = usize::try_from(number(value()?)?).map_err(|e| e.to_string())?
                }
                "--json" => args.json = Some(value()?),
                other => return Err(format!("unknown option {other:?}")),
            }
        }
        Ok(args)
    }
}

/// A schema of its own with migrated outbox tables.
pub struct BenchDb {
    pub outbox: Outbox,
    schema: String,
    url: String,
}

impl BenchDb {
    pub async fn new(args: &Args) -> Result<BenchDb, BoxError> {
        let schema = format!("outbox_bench_{}", uuid::Uuid::now_v7().simple());
        let base = PgConnectOptions::from_str(&args.database_url)?;
        let mut admin = sqlx::PgConnection::connect_with(&base).await?;
        sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
            .execute(&mut admin)
            .await?;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(base.options([("search_path", schema.as_str())]))
            .await?;
        let outbox = Outbox::new(pool);
        outbox.migrate().await?;
        Ok(BenchDb {
            outbox,
            schema,
            url: args.database_url.clone(),
        })
    }

    /// `events` pending rows, keys `k0..k{keys}` round robin, a JSON payload of about
    /// `payload` bytes; one statement, then VACUUM ANALYZE as a real table would have.
    pub async fn fill(&self, events: u64, keys: u64, payload: usize) -> Result<(), BoxError> {
        let filler = "x".repeat(payload.saturating_sub(60));
        sqlx::query(
            "INSERT INTO outbox (id, event_type, destination, partition_key, payload) \
             SELECT gen_random_uuid(), 'BenchEvent', 'bench.events', 'k' || (g % $2), \
                    jsonb_build_object('n', g, 'key', 'k' || (g % $2), 'filler', $3::text) \
             FROM generate_series(0, $1 - 1) g",
        )
        .bind(i64::try_from(events)?)
        .bind(i64::try_from(keys)?)
        .bind(filler)
        .execute(self.outbox.pool())
        .await?;
        sqlx::query("VACUUM ANALYZE outbox")
            .execute(self.outbox.pool())
            .await?;
        Ok(())
    }

    pub async fn drop(self) -> Result<(), BoxError> {
        self.outbox.pool().close().await;
        let mut admin = sqlx::PgConnection::connect(&self.url).await?;
        sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(&mut admin)
            .await?;
        Ok(())
    }
}
