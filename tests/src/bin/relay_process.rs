//! A relay in a process of its own, for tests that stop (SIGSTOP) or kill it: it relays
//! one outbox to a publisher that records each message it is given in the table
//! `published (id, relay)` of the same database, then acknowledges it.
//!
//! Arguments: `<postgres|mysql> <database url> <name>`. For PostgreSQL the URL's
//! `search_path` (`?options=...` is not used): pass the schema as the URL's database
//! is the test's database, and the schema as `OUTBOX_TEST_SCHEMA`. With
//! `OUTBOX_TEST_WAL_SLOT` set, the PostgreSQL outbox is in WAL mode with that slot.
//!
//! A gate, for tests that freeze a relay in the middle of a publish (PostgreSQL): with
//! `OUTBOX_TEST_GATED=<name>`, the relay of that name, given a message of type `Gated`,
//! records `(name, 'reached')` in the table `gate (relay, stage)`, waits until the
//! table holds a row of stage `open`, records `(name, 'answered')` and refuses the
//! message for good (as a broker refuses a message whose delivery timed out).
//! `OUTBOX_TEST_PUBLISH_TIMEOUT_MS` sets the relay's `publish_timeout` (default 2 s),
//! `OUTBOX_TEST_BATCH_SIZE` its `batch_size` (default 1000).

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
        let name = std::env::args().nth(3).unwrap_or_default();
        // One statement for the whole batch (in its order): a row per round trip made a
        // batch of a few hundred take longer than the 2 s publish timeout on a loaded
        // machine, and every retry timed out the same way.
        if let Recorder::Postgres(pool) = self
            && !batch.iter().any(|record| gated(record, &name))
        {
            let ids: Vec<String> = batch.iter().map(|record| record.id.to_string()).collect();
            let done = sqlx::query(
                "INSERT INTO published (id, relay) \
                 SELECT id, $2 FROM unnest($1::text[]) WITH ORDINALITY AS t(id, i) ORDER BY i",
            )
            .bind(&ids)
            .bind(&name)
            .execute(pool)
            .await
            .map(drop)
            .map_err(|e| e.to_string());
            return batch
                .iter()
                .map(|_| done.clone().map_err(PublishError::retryable))
                .collect();
        }
        let mut results = Vec::with_capacity(batch.len());
        for record in batch {
            let id = record.id.to_string();
            if let (Recorder::Postgres(pool), true) = (self, gated(record, &name)) {
                results.push(Err(gate(pool, &name).await));
                continue;
            }
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

/// `record` stops at the gate in the relay `name`.
fn gated(record: &OutboxRecord, name: &str) -> bool {
    record.event_type == "Gated" && std::env::var("OUTBOX_TEST_GATED").is_ok_and(|g| g == name)
}

/// Waits at the gate until it opens, then refuses the message for good.
async fn gate(pool: &PgPool, name: &str) -> PublishError {
    let record = |stage: &'static str| {
        sqlx::query("INSERT INTO gate (relay, stage) VALUES ($1, $2)")
            .bind(name.to_owned())
            .bind(stage)
            .execute(pool)
    };
    record("reached").await.expect("record the gate reached");
    loop {
        let open: i64 = sqlx::query_scalar("SELECT count(*) FROM gate WHERE stage = 'open'")
            .fetch_one(pool)
            .await
            .expect("look at the gate");
        if open > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    record("answered").await.expect("record the answer");
    PublishError::permanent("refused at the gate (its delivery timed out while frozen)")
}

fn relay<DB: Backend>(outbox: Outbox<DB>, publisher: Recorder, name: &str) -> Relay<Recorder, DB> {
    let publish_timeout = std::env::var("OUTBOX_TEST_PUBLISH_TIMEOUT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(Duration::from_secs(2), Duration::from_millis);
    let batch_size = std::env::var("OUTBOX_TEST_BATCH_SIZE")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    Relay::builder(outbox, publisher)
        .batch_size(batch_size)
        .application_name(name)
        .poll_interval(Duration::from_millis(200))
        .publish_timeout(publish_timeout)
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
