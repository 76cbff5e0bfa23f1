//! Shared fixtures for the integration tests: every test gets its own PostgreSQL schema,
//! so tests run in parallel against one server without seeing each other's rows.
//!
//! The server comes from `OUTBOX_TEST_DATABASE_URL` (or `DATABASE_URL`), defaulting to
//! the one `scripts/services.sh` makes sure of: `postgres://postgres@127.0.0.1:5432/test`.
//! A missing server fails the test with a message saying how to start it; it never skips.

pub mod consumers;
pub mod hooks;
pub mod kafka;
pub mod logs;
pub mod metrics;
pub mod nats;
pub mod order;
pub mod process;
pub mod proxy;
pub mod python;
pub mod rabbitmq;
pub mod wal;

use std::str::FromStr;

use outbox_core::Outbox;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tracing::instrument::WithSubscriber as _;

/// A statement the tests build at run time (schema, table and role names they made up).
/// sqlx 0.9 asks every statement that is not a literal to say so.
pub fn trusted_sql(statement: impl Into<String>) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(statement.into())
}

/// Checks that `e` keeps the client's error as its `source()` and does not repeat it in
/// its own message, so that the chain (`ErrorChain`, `anyhow`'s `{:#}`) shows it once;
/// returns the chain.
pub fn assert_source_shown_once(e: &(dyn std::error::Error + 'static)) -> String {
    let own = e.to_string();
    let source = e
        .source()
        .unwrap_or_else(|| panic!("no source() in {own:?} ({e:?})"))
        .to_string();
    assert!(
        !own.contains(&source),
        "the message repeats its source {source:?}: {own:?}"
    );
    let chain = outbox_core::ErrorChain(e).to_string();
    assert_eq!(chain.matches(&source).count(), 1, "{chain}");
    chain
}

/// The PostgreSQL server the tests use.
pub fn database_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// The URL of the role that may reach the test PostgreSQL over TLS only, verifying the
/// server against the test CA (`scripts/services.sh` sets it up and exports it).
pub fn pg_tls_url() -> String {
    std::env::var("OUTBOX_TEST_PG_TLS_URL").unwrap_or_else(|_| {
        panic!(
            "OUTBOX_TEST_PG_TLS_URL is not set: run the tests with `scripts/test.sh`, or \
             `eval \"$(scripts/services.sh)\"` first (it makes the TLS-only role and its CA)"
        )
    })
}

/// The folder of the test CA (`ca.crt`), the server's certificate, and a CA that signed
/// nothing (`other-ca.crt`).
pub fn tls_dir() -> String {
    std::env::var("OUTBOX_TEST_TLS_DIR")
        .unwrap_or_else(|_| panic!("OUTBOX_TEST_TLS_DIR is not set: run `scripts/services.sh`"))
}

/// A schema of its own for one test, dropped by [`TestDb::cleanup`].
#[derive(Debug)]
pub struct TestDb {
    /// A pool whose `search_path` is the test's schema.
    pub pool: PgPool,
    /// The schema's name.
    pub schema: String,
    /// The pool's connect options (the test's schema as `search_path`).
    pub options: PgConnectOptions,
}

impl TestDb {
    /// Creates a fresh schema and a pool (up to 8 connections) that uses it.
    pub async fn new() -> TestDb {
        Self::with_max_connections(8).await
    }

    /// Like [`TestDb::new`] with a chosen pool size.
    pub async fn with_max_connections(max: u32) -> TestDb {
        init_tracing();
        let url = database_url();
        let base = PgConnectOptions::from_str(&url)
            .unwrap_or_else(|e| panic!("bad test database URL {url:?}: {e}"));
        let schema = format!("outbox_test_{}", uuid::Uuid::now_v7().simple());
        let mut admin = sqlx::PgConnection::connect_with(&base)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "cannot connect to the test PostgreSQL at {url}: {e}\n\
                 start the services with `scripts/services.sh` (or set OUTBOX_TEST_DATABASE_URL)"
                )
            });
        sqlx::query(trusted_sql(format!("CREATE SCHEMA \"{schema}\"")))
            .execute(&mut admin)
            .await
            .expect("create the test schema");
        let options = base.options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .connect_with(options.clone())
            .await
            .expect("connect the test pool");
        TestDb {
            pool,
            schema,
            options,
        }
    }

    /// An outbox with the default table names in this schema, migrated.
    pub async fn outbox(&self) -> Outbox {
        let outbox = Outbox::new(self.pool.clone());
        outbox.migrate().await.expect("migrate the test schema");
        outbox
    }

    /// `n` more outboxes, one per schema `<schema>_tNN`, migrated: the tenants of a
    /// relay of many outboxes. [`drop_tenants`](Self::drop_tenants) drops them.
    pub async fn tenants(&self, n: usize) -> Vec<Outbox> {
        let mut outboxes = Vec::new();
        for i in 0..n {
            let schema = format!("{}_t{i:02}", self.schema);
            sqlx::query(trusted_sql(format!("CREATE SCHEMA \"{schema}\"")))
                .execute(&self.pool)
                .await
                .expect("create a tenant's schema");
            let outbox = Outbox::builder(self.pool.clone())
                .table(format!("{schema}.outbox"))
                .build()
                .expect("a tenant's outbox");
            // Silently: 50 tenants' migrations log 200 lines, which pushed a failing
            // test's message out of CI's summary of the run.
            outbox
                .migrate()
                .with_subscriber(tracing::subscriber::NoSubscriber::default())
                .await
                .expect("migrate a tenant's outbox");
            outboxes.push(outbox);
        }
        outboxes
    }

    /// Drops the schemas of [`tenants`](Self::tenants).
    pub async fn drop_tenants(&self, n: usize) {
        for i in 0..n {
            sqlx::query(trusted_sql(format!(
                "DROP SCHEMA \"{}_t{i:02}\" CASCADE",
                self.schema
            )))
            .execute(&self.pool)
            .await
            .expect("drop a tenant's schema");
        }
    }

    /// A one-connection pool into this schema, apart from [`pool`](Self::pool): for a
    /// `PgListener` that must not share the writers' pool.
    pub fn listen_pool(&self) -> sqlx::PgPool {
        PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_lazy_with(self.options.clone())
    }

    /// A new single connection into this schema (outside the pool).
    pub async fn connect(&self) -> sqlx::PgConnection {
        sqlx::PgConnection::connect_with(&self.options)
            .await
            .expect("connect to the test schema")
    }

    /// Counts the rows of `table` in this schema.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(trusted_sql(format!("SELECT count(*) FROM \"{table}\"")))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("count rows of {table}: {e}"))
    }

    /// Drops the schema and closes the pool.
    pub async fn cleanup(self) {
        self.pool.close().await;
        let mut admin = sqlx::PgConnection::connect(&database_url())
            .await
            .expect("connect to drop the test schema");
        sqlx::query(trusted_sql(format!(
            "DROP SCHEMA \"{}\" CASCADE",
            self.schema
        )))
        .execute(&mut admin)
        .await
        .expect("drop the test schema");
    }
}

use sqlx::Connection as _;

/// What tests log without `RUST_LOG`: every crate of ours at info, and the clients'
/// warnings and errors (lapin, rdkafka, async-nats, sqlx), so that a red fault test shows
/// what the transports and the relay did (connections lost and made again, retries,
/// warnings of no progress). The output is captured, and printed only for a test that
/// failed.
pub const LOG_FILTER: &str = "warn,outbox_core=info,outbox_kafka=info,outbox_nats=info,\
     outbox_rabbitmq=info,outbox_cli=info,outbox_tests=info";

/// Logs to the test's captured output ([`LOG_FILTER`], or `RUST_LOG` given as
/// `target=level` pairs: `RUST_LOG=outbox_core=debug` for more), and hands every
/// `outbox_core` event to the hooks of [`hooks::on_event`].
pub fn init_tracing() {
    hooks::init(LOG_FILTER);
}

pub mod backends;

/// Like [`wait_until`], and a failure prints `state()` too: what the relay, the consumer
/// or the transport were doing, so that one red run of a fault test can be diagnosed.
pub async fn wait_until_or<F, Fut, S>(what: &str, timeout: std::time::Duration, check: F, state: S)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
    S: Fn() -> String,
{
    wait_until_explained(what, timeout, check, || std::future::ready(state())).await;
}

/// Like [`wait_until_or`], with a state that takes a query or two to read (what the
/// database says of a slot, its server processes and their locks): `state` runs once,
/// when the wait has failed.
pub async fn wait_until_explained<F, Fut, S, SFut>(
    what: &str,
    timeout: std::time::Duration,
    mut check: F,
    state: S,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
    S: FnOnce() -> SFut,
    SFut: std::future::Future<Output = String>,
{
    let deadline = std::time::Instant::now() + timeout;
    while !check().await {
        if std::time::Instant::now() >= deadline {
            let state = state().await;
            panic!("timed out after {timeout:?} waiting until {what}; {state}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Waits until `check` holds, looking every 10 ms; fails the test, naming `what`, if it
/// does not within `timeout`. Tests synchronise on what they can observe with this,
/// never on a sleep.
pub async fn wait_until<F, Fut>(what: &str, timeout: std::time::Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + timeout;
    while !check().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Waits until the relay has sent `n` more statements to the database than it had when
/// this was called: its loop has looked at the table again, so whatever it could claim
/// by then it has claimed (and handed to the publisher).
pub async fn relay_looked_again(relay: &outbox_core::RelayHandle, n: u64) {
    let from = relay.stats().queries;
    wait_until(
        &format!("the relay sends {n} more statements (from {from})"),
        std::time::Duration::from_secs(60),
        || async { relay.stats().queries >= from + n },
    )
    .await;
}

/// The advisory lock an idle PostgreSQL relay holds (shared) on its connection while it
/// waits for work: commits notify only while someone holds it. Keyed like every lock of
/// one outbox: `(oid of the outbox table as int4, 4_000_000)` (`locks::IDLE` in
/// `outbox-core/src/db/postgres/mod.rs`).
pub const IDLE_RELAY_LOCK: i32 = 4_000_000;

/// Holds the idle-relay lock of `outbox` on a connection of its own, as a relay waiting
/// for work does, until dropped or [`release`](Self::release)d.
#[derive(Debug)]
pub struct IdleRelay {
    conn: sqlx::PgConnection,
    table: String,
}

impl IdleRelay {
    pub async fn hold(db: &TestDb, outbox: &Outbox) -> IdleRelay {
        let mut idle = IdleRelay {
            conn: db.connect().await,
            table: outbox.tables().outbox.quoted(),
        };
        idle.lock("pg_advisory_lock_shared").await;
        idle
    }

    async fn lock(&mut self, function: &str) {
        sqlx::query(trusted_sql(format!(
            "SELECT {function}($1::text::regclass::oid::int4, $2)::text"
        )))
        .bind(&self.table)
        .bind(IDLE_RELAY_LOCK)
        .execute(&mut self.conn)
        .await
        .expect("idle relay lock");
    }

    /// Lets go of the lock, as a relay that found work does.
    pub async fn release(&mut self) {
        self.lock("pg_advisory_unlock_shared").await;
    }

    /// Takes it again.
    pub async fn take(&mut self) {
        self.lock("pg_advisory_lock_shared").await;
    }
}
