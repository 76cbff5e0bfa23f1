//! A relay process that stops answering (SIGSTOP: a frozen VM, a paused container) keeps
//! its TCP connection, and the kernel answers keepalives for it: nothing but the server
//! ending its idle session frees its locks. With `session_timeout` (here 10 s) another
//! relay takes over within that bound, on MySQL/MariaDB (the named lock) and on
//! PostgreSQL (the partitions).

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox_core::admin::Admin;
use outbox_core::sqlx::{self, MySql};
use outbox_core::{Backend, Outbox, OutboxMessage};
use outbox_tests::backends::{TestBackend, mysql_url};
use outbox_tests::process::Process;
use outbox_tests::trusted_sql;
use outbox_tests::{TestDb, database_url, wait_until};

const WAIT: Duration = Duration::from_secs(90);
/// The relays' `session_timeout` (see `src/bin/relay_process.rs`) plus the time to notice
/// and take over (a poll, a rebalance): the documented bound.
const BOUND: Duration = Duration::from_secs(10 + 10);

/// A relay in a process of its own (`src/bin/relay_process.rs`), continued and killed
/// when dropped.
struct RelayProcess;

impl RelayProcess {
    fn start(db: &str, url: &str, name: &str, schema: Option<&str>) -> Process {
        let mut command = Command::new(env!("CARGO_BIN_EXE_relay_process"));
        command.args([db, url, name]).stdin(Stdio::null());
        if let Some(schema) = schema {
            command.env("OUTBOX_TEST_SCHEMA", schema);
        }
        Process::start(&mut command)
    }
}

async fn write<DB: Backend>(outbox: &Outbox<DB>, tag: &str, keys: usize) {
    let mut tx = outbox.begin().await.expect("begin");
    for k in 0..keys {
        tx.emit_message(OutboxMessage::new(tag, "d", "{}").with_key(format!("key-{k}")))
            .expect("emit");
    }
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stopped_relay_loses_its_partitions_within_the_session_timeout() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    sqlx::query("CREATE TABLE published (id text NOT NULL, relay text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("published table");
    let published = || async {
        sqlx::query_scalar::<_, String>("SELECT DISTINCT id FROM published")
            .fetch_all(&db.pool)
            .await
            .expect("published")
            .into_iter()
            .collect::<HashSet<_>>()
            .len()
    };
    let url = database_url();
    let a = RelayProcess::start("postgres", &url, "relay-a", Some(&db.schema));
    let b = RelayProcess::start("postgres", &url, "relay-b", Some(&db.schema));
    let admin = Admin::new(outbox.clone());
    wait_until("both relays are registered", WAIT, || async {
        admin.status().await.expect("status").relays == Some(2)
    })
    .await;
    // Registered is not yet rebalanced: write until both relays have published.
    let mut written = 0;
    for _ in 0..50 {
        write(&outbox, "Before", 64).await;
        written += 64;
        wait_until("the relays publish", WAIT, || async {
            published().await == written
        })
        .await;
        let relays: i64 = sqlx::query_scalar("SELECT count(DISTINCT relay) FROM published")
            .fetch_one(&db.pool)
            .await
            .expect("count");
        if relays == 2 {
            break;
        }
    }
    let by_a: i64 = sqlx::query_scalar("SELECT count(*) FROM published WHERE relay = 'relay-a'")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert!(by_a > 0, "relay-a holds partitions of its own");

    a.signal("-STOP");
    let stopped = Instant::now();
    write(&outbox, "After", 64).await;
    wait_until("the other relay takes over", WAIT, || async {
        published().await == written + 64
    })
    .await;
    let took = stopped.elapsed();
    eprintln!("measured: PostgreSQL takeover after SIGSTOP in {took:?}");
    assert!(took <= BOUND, "taken over within {BOUND:?}: {took:?}");
    drop((a, b));
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_stopped_relay_loses_its_lock_within_the_session_timeout() {
    let f = <MySql as TestBackend>::fixture().await;
    let pool = f.outbox.pool().clone();
    sqlx::query("CREATE TABLE published (id VARCHAR(36) NOT NULL, relay VARCHAR(32) NOT NULL)")
        .execute(&pool)
        .await
        .expect("published table");
    let database: String = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(&pool)
        .await
        .expect("database");
    let base = mysql_url();
    let url = format!("{}/{database}", base.rsplit_once('/').expect("a URL").0);
    let published = |relay: Option<&'static str>| {
        let pool = pool.clone();
        async move {
            let sql = match relay {
                Some(r) => format!("SELECT COUNT(DISTINCT id) FROM published WHERE relay = '{r}'"),
                None => "SELECT COUNT(DISTINCT id) FROM published".to_owned(),
            };
            sqlx::query_scalar::<_, i64>(trusted_sql(&sql))
                .fetch_one(&pool)
                .await
                .expect("published")
        }
    };
    let a = RelayProcess::start("mysql", &url, "relay-a", None);
    write(&f.outbox, "Before", 8).await;
    wait_until("relay-a is the active relay", WAIT, || async {
        published(Some("relay-a")).await == 8
    })
    .await;
    let b = RelayProcess::start("mysql", &url, "relay-b", None);
    write(&f.outbox, "Standby", 8).await;
    wait_until("relay-a publishes, relay-b stands by", WAIT, || async {
        published(None).await == 16
    })
    .await;
    assert_eq!(published(Some("relay-b")).await, 0, "relay-b stood by");
    // Published is not yet marked: stopped between the two, relay-a would leave its
    // batch for relay-b to publish again (at least once), and relay-b's count below
    // would include it.
    let admin = Admin::new(f.outbox.clone());
    wait_until("relay-a has marked what it published", WAIT, || async {
        admin.status().await.expect("status").pending == 0
    })
    .await;

    a.signal("-STOP");
    let stopped = Instant::now();
    write(&f.outbox, "After", 8).await;
    wait_until("relay-b takes over", WAIT, || async {
        published(None).await == 24
    })
    .await;
    let took = stopped.elapsed();
    eprintln!("measured: MySQL/MariaDB takeover after SIGSTOP in {took:?}");
    assert!(took <= BOUND, "taken over within {BOUND:?}: {took:?}");
    assert_eq!(published(Some("relay-b")).await, 8);
    drop((a, b));
    <MySql as TestBackend>::cleanup(f).await;
}
