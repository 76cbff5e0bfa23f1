//! A relay in a process of its own, for tests that stop (SIGSTOP) or kill it: it relays
//! one outbox to a publisher that records each message it is given in the table
//! `published (id, relay)` of the same database, then acknowledges it.
//!
//! Arguments: `<postgres|mysql> <database url> <name>`. For PostgreSQL the URL's
//! `search_path` (`?options=...` is not used): pass the schema as the URL's database
//! is the test's database, and the schema as `OUTBOX_TEST_SCHEMA`. With
//! `OUTBOX_TEST_WAL_SLOT` set, the PostgreSQL outbox is in WAL mode with that slot.

use std::str::FromStr;
use std::time::Duration;

use outbox_core::publisher::{OutboxRecord, PublishError, Publisher};
use outbox_core::relay::Relay;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_core::sqlx::{self, MySql, MySqlPool, PgPool};
use outbox_core::{Backend, Outbox};

/// Records what it publishes in the `published` table.
#[derive(Clone)]
enum Recorder {
    Postgres(PgPool),
    MySql(MySqlPool),
}

impl Publisher for Recorder {
    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        let mut results = Vec::with_capacity(batch.len());
        for record in batch {
            let id = record.id.to_string();
            let name = std::env::args().nth(3).unwrap_or_default();
            let done = match self {
                Recorder::Postgres(pool) => {
                    sqlx::query("INSERT INTO published (id, relay) VALUES ($1, $2)")
                        .bind(&id)
                        .bind(&name)
                        .execute(pool)
                        .await
                        .map(drop)
                }
                Recorder::MySql(pool) => {
                    sqlx::query("INSERT INTO published (id, relay) VALUES (?, ?)")
                        .bind(&id)
                        .bind(&name)
                        .execute(pool)
                        .await
                        .map(drop)
                }
            };
            results.push(done.map_err(|e| PublishError::retryable(e.to_string())));
        }
        results
    }
}

fn relay<DB: Backend>(outbox: Outbox<DB>, publisher: Recorder, name: &str) -> Relay<Recorder, DB> {
    Relay::builder(outbox, publisher)
        .application_name(name)
        .poll_interval(Duration::from_millis(200))
        .publish_timeout(Duration::from_secs(2))
        .session_timeout(Duration::from_secs(10))
        .reconnect_delay(Duration::from_millis(200))
        .rebalance_interval(Duration::from_millis(200))
        .build()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [db, url, name] = args.as_slice() else {
        panic!("usage: relay_process <postgres|mysql> <database url> <name>");
    };
    outbox_tests::init_tracing();
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    match db.as_str() {
        "postgres" => {
            let schema = std::env::var("OUTBOX_TEST_SCHEMA").expect("OUTBOX_TEST_SCHEMA");
            let options = PgConnectOptions::from_str(url)
                .expect("database url")
                .options([("search_path", schema.as_str())]);
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .connect_with(options)
                .await
                .expect("connect");
            let publisher = Recorder::Postgres(pool.clone());
            let outbox = match std::env::var("OUTBOX_TEST_WAL_SLOT") {
                Ok(slot) => Outbox::builder(pool)
                    .wal_slot(slot)
                    .build()
                    .expect("WAL outbox"),
                Err(_) => Outbox::new(pool),
            };
            relay(outbox, publisher, name).run(shutdown).await;
        }
        "mysql" => {
            let pool = MySqlPool::connect(url).await.expect("connect");
            let publisher = Recorder::MySql(pool.clone());
            relay(Outbox::<MySql>::new(pool), publisher, name)
                .run(shutdown)
                .await;
        }
        other => panic!("unknown database {other}"),
    }
}
