//! One fixture per database for the shared behaviour suite (`tests/databases.rs`): a fresh
//! outbox in a place of its own (PostgreSQL: a schema; MySQL/MariaDB: a database; SQLite:
//! a file in the temp dir), plus the few queries the suite needs in each dialect.
//!
//! MariaDB comes from `OUTBOX_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`.
//! An unreachable server fails the test; it never skips.

use std::future::Future;
use std::sync::{Mutex, OnceLock};

use outbox_core::sqlx::{self, Connection as _, Executor as _, MySql, Postgres, Sqlite};
use outbox_core::{Backend, Outbox};

use crate::TestDb;
use crate::trusted_sql;

/// A database the shared suite runs against.
pub trait TestBackend: Backend {
    /// A fresh, migrated outbox with the default table names.
    fn fixture() -> impl Future<Output = Fixture<Self>> + Send;
    /// An outbox with the table `name` (migrated) in `fixture`'s place.
    fn named(fixture: &Fixture<Self>, name: &str) -> impl Future<Output = Outbox<Self>> + Send;
    /// Runs `sql` on `conn` (inside a transaction, typically).
    fn exec_on<'c>(
        conn: &'c mut Self::Connection,
        sql: &'c str,
    ) -> impl Future<Output = u64> + Send + 'c;
    /// Runs `sql` on the pool; returns rows affected.
    fn exec(fixture: &Fixture<Self>, sql: &str) -> impl Future<Output = u64> + Send;
    /// The first column of the first row, as an integer (`count(*)`...).
    fn int(fixture: &Fixture<Self>, sql: &str) -> impl Future<Output = i64> + Send;
    /// The first column of the first row, as a float.
    fn float(fixture: &Fixture<Self>, sql: &str) -> impl Future<Output = Option<f64>> + Send;
    /// An expression: seconds from now until timestamp column `col`.
    fn seconds_until(col: &str) -> String;
    /// An expression: the time `secs` seconds ago, as the outbox stores timestamps.
    fn ago(secs: u64) -> String;
    /// Drops what the fixture created.
    fn cleanup(fixture: Fixture<Self>) -> impl Future<Output = ()> + Send;
}

/// A fresh outbox and what is needed to clean it up.
#[derive(Debug)]
pub struct Fixture<DB: Backend> {
    /// Migrated, default table names.
    pub outbox: Outbox<DB>,
    place: Place,
}

#[derive(Debug)]
enum Place {
    Postgres(Box<TestDb>),
    MySql { database: String },
    Sqlite { path: std::path::PathBuf },
}

/// MariaDB / MySQL server the tests use.
pub fn mysql_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A database of the caller's own on the test MariaDB (made as root), named
/// `<prefix>_<unique>`; drop it with [`drop_mysql_database`].
pub async fn mysql_database(prefix: &str) -> String {
    let database = format!("{prefix}_{}", unique());
    mysql_admin()
        .await
        .execute(trusted_sql(format!("CREATE DATABASE `{database}`")))
        .await
        .expect("create the test database");
    database
}

/// Drops a database made by [`mysql_database`].
pub async fn drop_mysql_database(database: &str) {
    mysql_admin()
        .await
        .execute(trusted_sql(format!("DROP DATABASE `{database}`")))
        .await
        .expect("drop the test database");
}

async fn mysql_admin() -> sqlx::MySqlConnection {
    let url = mysql_url();
    sqlx::MySqlConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("connect to the test MariaDB at {url} as root: {e}"))
}

fn unique() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

impl TestBackend for Postgres {
    async fn fixture() -> Fixture<Self> {
        let db = TestDb::new().await;
        let outbox = db.outbox().await;
        Fixture {
            outbox,
            place: Place::Postgres(Box::new(db)),
        }
    }
    async fn named(fixture: &Fixture<Self>, name: &str) -> Outbox<Self> {
        let outbox = Outbox::builder(fixture.outbox.pool().clone())
            .table(name)
            .build()
            .expect("valid name");
        outbox.migrate().await.expect("migrate");
        outbox
    }
    async fn exec_on(conn: &mut sqlx::PgConnection, sql: &str) -> u64 {
        conn.execute(trusted_sql(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }
    async fn exec(fixture: &Fixture<Self>, sql: &str) -> u64 {
        fixture
            .outbox
            .pool()
            .execute(trusted_sql(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }
    async fn int(fixture: &Fixture<Self>, sql: &str) -> i64 {
        sqlx::query_scalar(trusted_sql(format!("SELECT ({sql})::int8")))
            .fetch_one(fixture.outbox.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    async fn float(fixture: &Fixture<Self>, sql: &str) -> Option<f64> {
        sqlx::query_scalar(trusted_sql(format!("SELECT ({sql})::float8")))
            .fetch_one(fixture.outbox.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    fn seconds_until(col: &str) -> String {
        format!("extract(epoch FROM {col} - now())")
    }
    fn ago(secs: u64) -> String {
        format!("(now() - interval '{secs} seconds')")
    }
    async fn cleanup(fixture: Fixture<Self>) {
        if let Place::Postgres(db) = fixture.place {
            (*db).cleanup().await;
        }
    }
}

impl TestBackend for MySql {
    async fn fixture() -> Fixture<Self> {
        crate::init_tracing();
        let url = mysql_url();
        let mut admin = sqlx::MySqlConnection::connect(&url)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "cannot connect to the test MariaDB/MySQL at {url}: {e}\n\
                 start it (scripts/services.sh) or set OUTBOX_TEST_MYSQL_URL"
                )
            });
        let database = format!("outbox_test_{}", unique());
        admin
            .execute(trusted_sql(format!("CREATE DATABASE `{database}`")))
            .await
            .expect("create the test database");
        let options: sqlx::mysql::MySqlConnectOptions = url.parse().expect("mysql url");
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .connect_with(options.database(&database))
            .await
            .expect("connect the test pool");
        let outbox = Outbox::new(pool);
        outbox.migrate().await.expect("migrate");
        Fixture {
            outbox,
            place: Place::MySql { database },
        }
    }
    async fn named(fixture: &Fixture<Self>, name: &str) -> Outbox<Self> {
        let outbox = Outbox::builder(fixture.outbox.pool().clone())
            .table(name)
            .build()
            .expect("valid name");
        outbox.migrate().await.expect("migrate");
        outbox
    }
    async fn exec_on(conn: &mut sqlx::MySqlConnection, sql: &str) -> u64 {
        conn.execute(trusted_sql(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }
    async fn exec(fixture: &Fixture<Self>, sql: &str) -> u64 {
        fixture
            .outbox
            .pool()
            .execute(trusted_sql(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }
    async fn int(fixture: &Fixture<Self>, sql: &str) -> i64 {
        sqlx::query_scalar(trusted_sql(format!("SELECT CAST(({sql}) AS SIGNED)")))
            .fetch_one(fixture.outbox.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    async fn float(fixture: &Fixture<Self>, sql: &str) -> Option<f64> {
        sqlx::query_scalar(trusted_sql(format!("SELECT CAST(({sql}) AS DOUBLE)")))
            .fetch_one(fixture.outbox.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    fn seconds_until(col: &str) -> String {
        format!("TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {col}) / 1000000")
    }
    fn ago(secs: u64) -> String {
        format!("(UTC_TIMESTAMP(6) - INTERVAL {secs} SECOND)")
    }
    async fn cleanup(fixture: Fixture<Self>) {
        fixture.outbox.pool().close().await;
        if let Place::MySql { database } = fixture.place {
            let mut admin = sqlx::MySqlConnection::connect(&mysql_url())
                .await
                .expect("connect to drop the test database");
            admin
                .execute(trusted_sql(format!("DROP DATABASE `{database}`")))
                .await
                .expect("drop the test database");
        }
    }
}

impl TestBackend for Sqlite {
    async fn fixture() -> Fixture<Self> {
        crate::init_tracing();
        let path = std::env::temp_dir().join(format!("outbox-test-{}.db", unique()));
        let outbox = Outbox::<Sqlite>::open(path.to_str().expect("utf-8 temp path"))
            .await
            .expect("open the SQLite file");
        outbox.migrate().await.expect("migrate");
        Fixture {
            outbox,
            place: Place::Sqlite { path },
        }
    }
    async fn named(fixture: &Fixture<Self>, name: &str) -> Outbox<Self> {
        let outbox = Outbox::builder(fixture.outbox.pool().clone())
            .table(name)
            .build()
            .expect("valid name");
        outbox.migrate().await.expect("migrate");
        outbox
    }
    async fn exec_on(conn: &mut sqlx::SqliteConnection, sql: &str) -> u64 {
        conn.execute(trusted_sql(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }
    async fn exec(fixture: &Fixture<Self>, sql: &str) -> u64 {
        fixture
            .outbox
            .pool()
            .execute(trusted_sql(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .rows_affected()
    }
    async fn int(fixture: &Fixture<Self>, sql: &str) -> i64 {
        sqlx::query_scalar(trusted_sql(format!("SELECT CAST(({sql}) AS INTEGER)")))
            .fetch_one(fixture.outbox.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    async fn float(fixture: &Fixture<Self>, sql: &str) -> Option<f64> {
        sqlx::query_scalar(trusted_sql(format!("SELECT CAST(({sql}) AS REAL)")))
            .fetch_one(fixture.outbox.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
    fn seconds_until(col: &str) -> String {
        format!("(julianday({col}) - julianday('now')) * 86400.0")
    }
    fn ago(secs: u64) -> String {
        format!("strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-{secs} seconds')")
    }
    async fn cleanup(fixture: Fixture<Self>) {
        fixture.outbox.pool().close().await;
        if let Place::Sqlite { path } = fixture.place {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = path.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// SQL statements logged by sqlx (target `sqlx::query`) that mention `one_stmt_`: the
/// suite names the outbox table of its one-statement test so, to count the INSERTs.
pub fn logged_statements() -> &'static Mutex<Vec<String>> {
    static STATEMENTS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    STATEMENTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Installs the global subscriber: test output as [`crate::init_tracing`], plus a layer
/// that keeps the statements [`logged_statements`] describes.
pub fn init_statement_log() {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _, filter};

    struct Statements;
    struct Visitor(Option<String>);
    impl tracing::field::Visit for Visitor {
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            if field.name() == "db.statement" {
                self.0 = Some(value.to_owned());
            }
        }
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "db.statement" {
                self.0 = Some(format!("{value:?}"));
            }
        }
    }
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Statements {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let mut v = Visitor(None);
            event.record(&mut v);
            if let Some(sql) = v.0.filter(|s| s.contains("one_stmt_")) {
                logged_statements()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(sql);
            }
        }
    }
    let fmt = tracing_subscriber::fmt::layer()
        .with_test_writer()
        .with_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(crate::LOG_FILTER)),
        );
    let statements = Statements
        .with_filter(filter::Targets::new().with_target("sqlx::query", tracing::Level::TRACE));
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(statements)
        .try_init();
}
