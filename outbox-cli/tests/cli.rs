//! The real `outbox` binary against the real PostgreSQL: each test works in a schema of
//! its own (`--table <schema>.outbox`) and checks both what the command prints and what
//! it did to the rows.

use std::process::Output;

use outbox_core::sqlx;
use outbox_tests::trusted_sql;
use outbox_tests::{TestDb, database_url};
use uuid::Uuid;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn of(out: &Output) -> Run {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn ok(&self) -> &str {
        assert_eq!(
            self.code, 0,
            "expected success\nstdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        &self.stdout
    }

    /// A runtime failure: exit 1, one line on stderr, never a panic.
    fn failed(&self) -> &str {
        assert_eq!(
            self.code, 1,
            "expected failure\nstdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        assert_eq!(
            self.stderr.trim_end().lines().count(),
            1,
            "one line: {}",
            self.stderr
        );
        assert!(
            self.stderr.starts_with("outbox: error: "),
            "{}",
            self.stderr
        );
        &self.stderr
    }
}

/// Runs `outbox <args>` with `DATABASE_URL` set to the test server.
async fn outbox(args: &[&str]) -> Run {
    outbox_with_env(args, Some(&database_url())).await
}

async fn outbox_with_env(args: &[&str], url: Option<&str>) -> Run {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_PROCESSED_TABLE")
        .env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    let out: Output = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run the outbox binary");
    Run::of(&out)
}

/// `outbox <args>` on a terminal (a pseudo-terminal from util-linux's `script`), typing
/// `answer` and Enter; stdout and stderr both land in `stdout`.
async fn on_terminal(args: &[&str], answer: &str) -> Run {
    let mut line = vec![env!("CARGO_BIN_EXE_outbox").to_owned()];
    line.extend(args.iter().map(|a| format!("'{a}'")));
    let mut cmd = std::process::Command::new("script");
    cmd.args(["-qec", &line.join(" "), "/dev/null"])
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_PROCESSED_TABLE")
        .env("DATABASE_URL", database_url())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let answer = format!("{answer}\n");
    let out: Output = tokio::task::spawn_blocking(move || {
        let mut child = cmd
            .spawn()
            .expect("run `script` (util-linux) for a pseudo-terminal");
        std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), answer.as_bytes())
            .expect("type the answer");
        child.wait_with_output()
    })
    .await
    .expect("join")
    .expect("run the outbox binary on a terminal");
    Run::of(&out)
}

/// `outbox --table <schema>.outbox <args>`.
async fn in_db(db: &TestDb, args: &[&str]) -> Run {
    let table = format!("{}.outbox", db.schema);
    let mut all = vec!["--table", table.as_str()];
    all.extend_from_slice(args);
    outbox(&all).await
}

/// A message in a chosen state. Ages are SQL intervals before now (e.g. `'3 hours'`).
#[derive(Clone, Copy)]
struct Row<'a> {
    destination: &'a str,
    key: Option<&'a str>,
    created_ago: &'a str,
    sent_ago: Option<&'a str>,
    dead_ago: Option<&'a str>,
    retry: bool,
    attempts: i32,
}

const PENDING: Row<'static> = Row {
    destination: "orders",
    key: None,
    created_ago: "1 minute",
    sent_ago: None,
    dead_ago: None,
    retry: false,
    attempts: 0,
};

async fn insert(db: &TestDb, row: Row<'_>) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, partition_key, payload, created_at, sent_at, \
                             attempts, next_attempt_at, last_error, dead_at) \
         VALUES ($1, 'Tested', $2, $3, jsonb_build_object('n', 1), now() - $4::interval, \
                 now() - $5::interval, $6, \
                 CASE WHEN $7 OR $8::interval IS NOT NULL THEN now() + interval '1 hour' END, \
                 CASE WHEN $6 > 0 THEN 'broker said no' END, now() - $8::interval)",
    )
    .bind(id)
    .bind(row.destination)
    .bind(row.key)
    .bind(row.created_ago)
    .bind(row.sent_ago)
    .bind(row.attempts)
    .bind(row.retry)
    .bind(row.dead_ago)
    .execute(&db.pool)
    .await
    .expect("insert a test row");
    id
}

#[derive(Debug, PartialEq, Eq)]
struct State {
    sent: bool,
    dead: bool,
    attempts: i32,
    /// `next_attempt_at` is set and not in the future.
    due: bool,
    last_error: Option<String>,
}

async fn state(db: &TestDb, id: Uuid) -> Option<State> {
    sqlx::query_as::<_, (bool, bool, i32, bool, Option<String>)>(
        "SELECT sent_at IS NOT NULL, dead_at IS NOT NULL, attempts, coalesce(next_attempt_at <= now(), false), last_error \
         FROM outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&db.pool)
    .await
    .expect("read a row")
    .map(|(sent, dead, attempts, due, last_error)| State {
        sent,
        dead,
        attempts,
        due,
        last_error,
    })
}

fn requeued() -> Option<State> {
    Some(State {
        sent: false,
        dead: false,
        attempts: 0,
        // Due at once, and holding back the later messages of its key until it is sent.
        due: true,
        last_error: None,
    })
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test]
async fn migrate_creates_the_tables_once() {
    let db = TestDb::new().await;
    let out = in_db(&db, &["migrate"]).await;
    assert_eq!(
        out.ok().trim(),
        format!(
            "applied migrations 1, 2, 3, 4, 5, 6 to {}.outbox",
            db.schema
        )
    );
    assert_eq!(db.count("outbox").await, 0, "the outbox table exists");
    assert_eq!(db.count("outbox_processed").await, 0);
    assert_eq!(db.count("outbox_processed_failing").await, 0);
    let out = in_db(&db, &["migrate"]).await;
    assert!(out.ok().contains("up to date"), "{}", out.stdout);
    assert_eq!(db.count("outbox_migrations").await, 6);
    db.cleanup().await;
}

/// A consumer whose handler fails shows in `outbox status` (text and JSON) and makes
/// `outbox doctor` exit 3 once it has failed for longer than the limit.
#[tokio::test]
async fn status_and_doctor_show_a_consumer_whose_handler_fails() {
    let db = TestDb::new().await;
    db.outbox().await;
    let (schema, stuck) = (&db.schema, Uuid::now_v7());
    for sql in [
        format!(
            "INSERT INTO {schema}.outbox_processed (consumer, message_id) \
             SELECT 'billing', gen_random_uuid() FROM generate_series(1, 7)"
        ),
        format!(
            "INSERT INTO {schema}.outbox_processed_failing \
               (consumer, message_id, event_type, partition_key, origin, attempts, \
                first_failed_at, last_failed_at, last_error) \
             VALUES ('billing', '{stuck}', 'OrderPlaced', 'order-7', 'orders/0@42', 12, \
                     now() - interval '20 minutes', now(), 'no invoice template for EUR')"
        ),
        // An instance killed ten minutes ago (its heartbeat every 10 s), 5 messages behind.
        format!(
            "INSERT INTO {schema}.outbox_processed_consumers \
               (consumer, instance, transport, interval_ms, started_at, seen_at, handled, \
                handler_errors, lag) \
             VALUES ('billing', gen_random_uuid(), 'kafka', 10000, now() - interval '1 hour', \
                     now() - interval '10 minutes', 70, 12, 5)"
        ),
    ] {
        sqlx::query(trusted_sql(sql))
            .execute(&db.pool)
            .await
            .expect("insert");
    }
    let out = in_db(&db, &["status"]).await;
    let text = out.ok();
    // (The seconds of the ages depend on how long the command took to start.)
    let line = text
        .lines()
        .find(|l| l.starts_with("consumer billing: "))
        .unwrap_or_else(|| panic!("a line for the consumer: {text}"));
    assert!(
        line.starts_with("consumer billing: 0 instance(s) running (kafka), 1 gone (last seen 10m ")
            && line.contains(
                "; 7 processed in the last minute; handler failing on 1 message(s), the longest \
                 for 20m "
            ),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("billing")
            && l.contains(&stuck.to_string())
            && l.contains("order-7")
            && l.contains(" 12 ")
            && l.contains("no invoice template for EUR")),
        "{text}"
    );
    let s = json(in_db(&db, &["status", "--json"]).await.ok());
    let c = &s["consumers"][0];
    assert_eq!(c["consumer"], "billing");
    assert_eq!(c["processed_last_minute"], 7);
    assert_eq!(c["failing"][0]["message_id"], stuck.to_string());
    assert_eq!(c["failing"][0]["attempts"], 12);
    let doctor = in_db(&db, &["doctor"]).await;
    assert_eq!(doctor.code, 3, "{}", doctor.stdout);
    assert!(
        doctor.stdout.contains(
            "ACTION  consumer-gone: consumer billing: no instance is running (the last \
             heartbeat was 10m "
        ) && doctor
            .stdout
            .contains("ago); 5 message(s) waited for it then"),
        "{}",
        doctor.stdout
    );
    assert!(
        doctor.stdout.contains("consumer-failing")
            && doctor
                .stdout
                .contains("consumer billing: the handler is failing on 1 message(s)"),
        "{}",
        doctor.stdout
    );
    db.cleanup().await;
}

#[tokio::test]
async fn status_counts_pending_retries_and_dead_letters_per_destination() {
    let db = TestDb::new().await;
    db.outbox().await;
    let orders = PENDING;
    insert(
        &db,
        Row {
            created_ago: "2 hours",
            ..orders
        },
    )
    .await;
    insert(&db, orders).await;
    insert(
        &db,
        Row {
            retry: true,
            attempts: 2,
            ..orders
        },
    )
    .await;
    insert(
        &db,
        Row {
            dead_ago: Some("1 minute"),
            attempts: 10,
            ..orders
        },
    )
    .await;
    let payments = Row {
        destination: "payments",
        created_ago: "5 minutes",
        ..PENDING
    };
    insert(&db, payments).await;
    for _ in 0..4 {
        insert(
            &db,
            Row {
                sent_ago: Some("1 minute"),
                created_ago: "3 hours",
                ..orders
            },
        )
        .await;
    }

    let out = in_db(&db, &["status"]).await;
    let text = out.ok();
    assert!(
        text.contains("4 pending (1 in retry), 1 dead-lettered, oldest pending 2h 0m"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("orders ") && l.contains(" 3 ")),
        "{text}"
    );
    // A table never analysed has no estimate yet: said so, not "~0 rows".
    assert!(
        text.contains("rows in the table unknown") && !text.contains("~0 rows"),
        "{text}"
    );

    let out = in_db(&db, &["status", "--json"]).await;
    let s = json(out.ok());
    assert_eq!(s["pending"], 4);
    assert_eq!(s["in_retry"], 1);
    assert_eq!(s["dead"], 1);
    assert_eq!(s["relays"], 0);
    let oldest = s["oldest_pending_age_seconds"].as_f64().expect("an age");
    assert!((7200.0..7300.0).contains(&oldest), "{oldest}");
    let d = &s["destinations"];
    assert_eq!(d[0]["destination"], "orders");
    assert_eq!(
        (
            d[0]["pending"].clone(),
            d[0]["in_retry"].clone(),
            d[0]["dead"].clone()
        ),
        (3.into(), 1.into(), 1.into())
    );
    assert_eq!(d[1]["destination"], "payments");
    assert_eq!(
        (d[1]["pending"].clone(), d[1]["dead"].clone()),
        (1.into(), 0.into())
    );
    let p_oldest = d[1]["oldest_pending_age_seconds"].as_f64().expect("an age");
    assert!((300.0..400.0).contains(&p_oldest), "{p_oldest}");
    db.cleanup().await;
}

#[tokio::test]
async fn pending_and_dead_list_with_filters_as_text_and_json() {
    let db = TestDb::new().await;
    db.outbox().await;
    let a1 = insert(
        &db,
        Row {
            key: Some("a"),
            created_ago: "3 hours",
            ..PENDING
        },
    )
    .await;
    let a2 = insert(
        &db,
        Row {
            key: Some("a"),
            retry: true,
            attempts: 1,
            ..PENDING
        },
    )
    .await;
    let b1 = insert(
        &db,
        Row {
            key: Some("b"),
            destination: "payments",
            ..PENDING
        },
    )
    .await;
    let dead = insert(
        &db,
        Row {
            key: Some("a"),
            dead_ago: Some("1 minute"),
            attempts: 3,
            ..PENDING
        },
    )
    .await;
    insert(
        &db,
        Row {
            sent_ago: Some("1 minute"),
            ..PENDING
        },
    )
    .await;

    let ids = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|m| m["id"].as_str().expect("id").to_owned())
            .collect()
    };
    let all = json(in_db(&db, &["pending", "--json"]).await.ok());
    assert_eq!(
        ids(&all),
        [a1, a2, b1].map(|u| u.to_string()),
        "pending only, in seq order"
    );
    assert_eq!(all[1]["state"], "in_retry");
    assert_eq!(all[0]["payload"], serde_json::json!({"n": 1}));

    let f = json(
        in_db(&db, &["pending", "--json", "--destination", "payments"])
            .await
            .ok(),
    );
    assert_eq!(ids(&f), [b1.to_string()]);
    let f = json(
        in_db(&db, &["pending", "--json", "--key", "a", "--in-retry"])
            .await
            .ok(),
    );
    assert_eq!(ids(&f), [a2.to_string()]);
    let f = json(
        in_db(&db, &["pending", "--json", "--until", "1h"])
            .await
            .ok(),
    );
    assert_eq!(ids(&f), [a1.to_string()], "created before an hour ago");
    let f = json(
        in_db(&db, &["pending", "--json", "--since", "1h", "--limit", "1"])
            .await
            .ok(),
    );
    assert_eq!(ids(&f), [a2.to_string()]);

    let text = in_db(&db, &["pending"]).await;
    let text = text.ok();
    assert!(text.starts_with("SEQ"), "{text}");
    assert_eq!(text.lines().count(), 4, "header and three rows: {text}");
    assert!(
        text.contains(&a2.to_string()) && text.contains("in retry"),
        "{text}"
    );

    let d = json(in_db(&db, &["dead", "--json"]).await.ok());
    assert_eq!(ids(&d), [dead.to_string()]);
    assert_eq!(d[0]["state"], "dead");
    assert_eq!(d[0]["attempts"], 3);
    assert_eq!(d[0]["last_error"], "broker said no");
    let text = in_db(&db, &["dead", "--key", "b"]).await;
    assert_eq!(text.ok().trim(), "no dead-lettered messages");
    db.cleanup().await;
}

#[tokio::test]
async fn replay_by_id_requeues_sent_messages_all_or_nothing() {
    let db = TestDb::new().await;
    db.outbox().await;
    let sent = Row {
        sent_ago: Some("1 hour"),
        attempts: 2,
        ..PENDING
    };
    let s1 = insert(&db, sent).await;
    let s2 = insert(&db, sent).await;
    let s3 = insert(&db, sent).await;
    let pending = insert(&db, PENDING).await;
    let before = state(&db, s2).await;

    let out = in_db(&db, &["replay", "--id", &s1.to_string()]).await;
    assert!(
        out.ok().contains("re-queued 1 sent message"),
        "{}",
        out.stdout
    );
    assert_eq!(state(&db, s1).await, requeued());

    // One unknown id: nothing changes, not even the valid ids before it.
    let unknown = Uuid::now_v7();
    let out = in_db(&db, &["replay", "--id", &format!("{s2},{unknown}")]).await;
    let err = out.failed();
    assert!(
        err.contains(&format!("no message with id {unknown}")),
        "{err}"
    );
    assert_eq!(state(&db, s2).await, before, "no partial change");

    // A pending message cannot be replayed.
    let out = in_db(
        &db,
        &[
            "replay",
            "--id",
            &s3.to_string(),
            "--id",
            &pending.to_string(),
        ],
    )
    .await;
    let err = out.failed();
    assert!(
        err.contains(&format!(
            "message {pending} is pending, so it cannot be replayed"
        )),
        "{err}"
    );
    assert_eq!(state(&db, s3).await, before, "no partial change");

    let out = in_db(&db, &["replay", "--id", &format!("{s2},{s3}")]).await;
    assert!(
        out.ok().contains("re-queued 2 sent message"),
        "{}",
        out.stdout
    );
    assert_eq!(state(&db, s2).await, requeued());
    assert_eq!(state(&db, s3).await, requeued());

    let out = in_db(&db, &["replay", "--id", "not-a-uuid"]).await;
    assert_eq!(
        out.code, 2,
        "a malformed id is a usage error: {}",
        out.stderr
    );
    db.cleanup().await;
}

#[tokio::test]
async fn replay_by_sent_time_window_and_destination() {
    let db = TestDb::new().await;
    db.outbox().await;
    let sent = |ago, destination| Row {
        sent_ago: Some(ago),
        destination,
        created_ago: "1 day",
        ..PENDING
    };
    let too_old = insert(&db, sent("3 hours", "orders")).await;
    let in_window = insert(&db, sent("90 minutes", "orders")).await;
    let other_dest = insert(&db, sent("90 minutes", "payments")).await;
    let too_new = insert(&db, sent("10 minutes", "orders")).await;

    let window = [
        "replay",
        "--since",
        "2h",
        "--until",
        "30m",
        "--destination",
        "orders",
    ];
    // A window acts on many messages at once: without --yes (and no terminal to ask
    // on) it says what it would do and changes nothing.
    let out = in_db(&db, &window).await;
    assert!(
        out.failed().contains("nothing re-queued") && out.stderr.contains("--yes"),
        "{}",
        out.stderr
    );
    assert!(
        out.stdout.contains("would re-queue 1 message(s)") && out.stdout.contains("to orders"),
        "{}",
        out.stdout
    );
    assert!(state(&db, in_window).await.expect("row").sent, "unchanged");
    let out = in_db(&db, &[&window[..], &["--yes"]].concat()).await;
    assert!(
        out.ok().contains("re-queued 1 sent message"),
        "{}",
        out.stdout
    );
    assert_eq!(state(&db, in_window).await, requeued());
    for id in [too_old, other_dest, too_new] {
        assert!(state(&db, id).await.expect("row").sent, "{id} untouched");
    }

    // RFC 3339 bounds, every destination.
    let since = (chrono::Utc::now() - chrono::Duration::hours(4)).to_rfc3339();
    let until = chrono::Utc::now().to_rfc3339();
    let out = in_db(&db, &["replay", "--since", &since, "--until", &until, "-y"]).await;
    assert!(
        out.ok().contains("re-queued 3 sent message"),
        "{}",
        out.stdout
    );

    let out = in_db(&db, &["replay", "--since", "1h", "--until", "2h"]).await;
    assert!(
        out.failed().contains("the replay window is empty"),
        "{}",
        out.stderr
    );
    db.cleanup().await;
}

#[tokio::test]
async fn release_returns_dead_letters_to_pending_by_id_or_key() {
    let db = TestDb::new().await;
    db.outbox().await;
    let dead = |key| Row {
        key: Some(key),
        dead_ago: Some("5 minutes"),
        attempts: 10,
        ..PENDING
    };
    let k1a = insert(&db, dead("k1")).await;
    let k1b = insert(&db, dead("k1")).await;
    let k2 = insert(&db, dead("k2")).await;
    let k3 = insert(&db, dead("k3")).await;
    let pending = insert(
        &db,
        Row {
            key: Some("k2"),
            ..PENDING
        },
    )
    .await;
    let was = state(&db, k2).await;

    let out = in_db(&db, &["release", "--key", "k1"]).await;
    assert!(
        out.ok().contains("released 2 dead-lettered message"),
        "{}",
        out.stdout
    );
    assert_eq!(state(&db, k1a).await, requeued());
    assert_eq!(state(&db, k1b).await, requeued());

    let out = in_db(
        &db,
        &[
            "release",
            "--id",
            &k2.to_string(),
            "--id",
            &pending.to_string(),
        ],
    )
    .await;
    let err = out.failed();
    assert!(
        err.contains(&format!(
            "message {pending} is pending, so it cannot be released"
        )),
        "{err}"
    );
    assert_eq!(state(&db, k2).await, was, "no partial change");

    let out = in_db(&db, &["release", "--id", &format!("{k2},{k3}")]).await;
    assert!(
        out.ok().contains("released 2 dead-lettered message"),
        "{}",
        out.stdout
    );
    assert_eq!(state(&db, k2).await, requeued());
    assert_eq!(state(&db, k3).await, requeued());

    let out = in_db(&db, &["release", "--key", "k1"]).await;
    assert!(
        out.failed()
            .contains("no dead-lettered message has partition key \"k1\""),
        "{}",
        out.stderr
    );
    let out = in_db(&db, &["release"]).await;
    assert_eq!(out.code, 2, "--id or --key is required: {}", out.stderr);
    db.cleanup().await;
}

#[tokio::test]
async fn purge_deletes_old_history_and_dry_run_only_counts() {
    let db = TestDb::new().await;
    db.outbox().await;
    for _ in 0..3 {
        insert(
            &db,
            Row {
                sent_ago: Some("10 days"),
                created_ago: "10 days",
                ..PENDING
            },
        )
        .await;
    }
    let recent = insert(
        &db,
        Row {
            sent_ago: Some("1 day"),
            created_ago: "1 day",
            ..PENDING
        },
    )
    .await;
    let dead = insert(
        &db,
        Row {
            dead_ago: Some("10 days"),
            created_ago: "10 days",
            attempts: 1,
            ..PENDING
        },
    )
    .await;
    let pending = insert(
        &db,
        Row {
            created_ago: "20 days",
            ..PENDING
        },
    )
    .await;

    let out = in_db(&db, &["purge", "--sent-before", "7d", "--dry-run"]).await;
    assert_eq!(
        out.ok().trim(),
        format!(
            "would delete 3 sent and 0 dead-lettered message(s) from {}.outbox (dry run: nothing deleted)",
            db.schema
        )
    );
    assert_eq!(db.count("outbox").await, 6, "dry run deletes nothing");

    // More rows than --max-rows: refused, nothing deleted, retention named (#37: one
    // transaction over millions of rows is a long lock and a WAL burst).
    let out = in_db(&db, &["purge", "--sent-before", "7d", "--max-rows", "2"]).await;
    let refused = out.failed();
    assert!(
        refused.contains("would delete 3 row(s)")
            && refused.contains("--max-rows 2")
            && refused.contains("outbox retention")
            && refused.contains("nothing deleted"),
        "{refused}"
    );
    assert_eq!(
        db.count("outbox").await,
        6,
        "a refused purge deletes nothing"
    );

    let out = in_db(&db, &["purge", "--sent-before", "7d", "--max-rows", "3"]).await;
    assert!(
        out.ok().starts_with("deleted 3 sent and 0 dead-lettered"),
        "{}",
        out.stdout
    );
    assert_eq!(db.count("outbox").await, 3);
    for id in [recent, dead, pending] {
        assert!(state(&db, id).await.is_some(), "{id} kept");
    }

    // Dead letters never reached anyone: without --yes (and no terminal) nothing goes.
    let out = in_db(&db, &["purge", "--dead-before", "1d"]).await;
    assert!(
        out.failed().contains("nothing deleted") && out.stderr.contains("--yes"),
        "{}",
        out.stderr
    );
    assert!(
        out.stdout
            .starts_with("would delete 0 sent and 1 dead-lettered"),
        "{}",
        out.stdout
    );
    assert!(state(&db, dead).await.is_some(), "nothing deleted");
    // On a terminal it asks: "n" keeps them, "y" deletes them.
    let table = format!("{}.outbox", db.schema);
    let args = ["--table", table.as_str(), "purge", "--dead-before", "1d"];
    let out = on_terminal(&args, "n").await;
    assert_ne!(out.code, 0, "{}", out.stdout);
    assert!(
        out.stdout.contains("[y/N]") && out.stdout.contains("not confirmed"),
        "{}",
        out.stdout
    );
    assert!(state(&db, dead).await.is_some(), "nothing deleted");
    let out = on_terminal(&args, "y").await;
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert!(
        out.stdout.contains("deleted 0 sent and 1 dead-lettered"),
        "{}",
        out.stdout
    );
    assert!(state(&db, dead).await.is_none());
    insert(
        &db,
        Row {
            dead_ago: Some("2 days"),
            ..PENDING
        },
    )
    .await;
    let out = in_db(&db, &["purge", "--dead-before", "1d", "--yes"]).await;
    assert!(
        out.ok().starts_with("deleted 0 sent and 1 dead-lettered"),
        "{}",
        out.stdout
    );
    assert!(state(&db, dead).await.is_none());
    assert!(
        state(&db, pending).await.is_some(),
        "pending messages are never purged"
    );
    db.cleanup().await;
}

/// `n` messages sent 8 days ago.
async fn old_sent_rows(db: &TestDb, n: i32) {
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, payload, created_at, sent_at) \
         SELECT gen_random_uuid(), 'Old', 'orders', '{}', now() - interval '9 days', now() - interval '8 days' \
         FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(&db.pool)
    .await
    .expect("old sent rows");
}

#[tokio::test]
async fn retention_command_deletes_old_rows_in_batches() {
    let db = TestDb::new().await;
    db.outbox().await;
    old_sent_rows(&db, 55).await;
    let recent = insert(
        &db,
        Row {
            sent_ago: Some("1 day"),
            ..PENDING
        },
    )
    .await;
    let dead = insert(
        &db,
        Row {
            dead_ago: Some("60 days"),
            created_ago: "60 days",
            attempts: 1,
            ..PENDING
        },
    )
    .await;
    sqlx::query(
        "INSERT INTO outbox_processed (consumer, message_id, processed_at) \
         SELECT 'billing', gen_random_uuid(), now() - (CASE WHEN n <= 12 THEN interval '40 days' ELSE interval '1 day' END) \
         FROM generate_series(1, 20) AS n",
    )
    .execute(&db.pool)
    .await
    .expect("processed ids");

    let out = in_db(&db, &["retention", "--batch-size", "10"]).await;
    let text = out.ok();
    assert!(
        text.contains("deleted 55 sent messages and 12 processed ids in 8 batches")
            && text.contains(" rows/s"),
        "6 batches of sent rows (the last one short), 2 of processed ids, and the rate: {text}"
    );
    assert!(
        !out.stderr.contains('\r') && !out.stderr.contains("rows/s"),
        "no progress line when standard error is not a terminal: {:?}",
        out.stderr
    );
    assert_eq!(db.count("outbox").await, 2);
    assert!(state(&db, recent).await.is_some() && state(&db, dead).await.is_some());
    assert_eq!(db.count("outbox_processed").await, 8);
    db.cleanup().await;
}

/// On a terminal, retention over many rows shows its progress on standard error: rows
/// done of the total, the rate, the time left; the line is cleared at the end and the
/// summary follows (#37 §4).
#[tokio::test]
async fn retention_shows_its_progress_on_a_terminal() {
    let db = TestDb::new().await;
    db.outbox().await;
    old_sent_rows(&db, 3000).await;
    let table = format!("{}.outbox", db.schema);
    let out = on_terminal(
        &[
            "--table",
            &table,
            "retention",
            "--batch-size",
            "100",
            "--keep-processed",
        ],
        "",
    )
    .await;
    let text = out.ok();
    let progress = format!("{table}: deleting sent messages: 100/3,000 rows (3%), ");
    assert!(
        text.contains(&progress) && text.contains(" rows/s, ") && text.contains(" left"),
        "the first batch's line, with the rate and the time left: {text:?}"
    );
    assert!(
        text.contains("\r\x1b[2K") && text.contains("deleted 3000 sent messages"),
        "the line cleared, then the summary: {text:?}"
    );
    assert_eq!(db.count("outbox").await, 0);
    db.cleanup().await;
}

#[tokio::test]
async fn bad_input_is_one_line_with_a_fix_and_changes_nothing() {
    let db = TestDb::new().await;
    db.outbox().await;
    let sent = insert(
        &db,
        Row {
            sent_ago: Some("1 hour"),
            ..PENDING
        },
    )
    .await;
    let before = state(&db, sent).await;

    // A malformed time is a usage error, with the accepted forms.
    let out = in_db(&db, &["replay", "--since", "yesterday", "--until", "now"]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("\"yesterday\" is not a time") && out.stderr.contains("RFC 3339"),
        "{}",
        out.stderr
    );
    let out = in_db(&db, &["purge", "--sent-before", "2024-05-01T00:00:00"]).await;
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("no time zone"), "{}", out.stderr);
    assert_eq!(state(&db, sent).await, before);

    // Unreachable server.
    let table = format!("{}.outbox", db.schema);
    let out = outbox_with_env(
        &["--table", &table, "status"],
        Some("postgres://postgres@127.0.0.1:1/test"),
    )
    .await;
    let err = out.failed();
    assert!(
        err.contains("cannot reach the database at postgres://postgres@127.0.0.1:1/test"),
        "{err}"
    );
    assert!(err.contains("check that the server is running"), "{err}");

    // No server given at all.
    let out = outbox_with_env(&["status"], None).await;
    assert!(
        out.failed()
            .contains("set DATABASE_URL or pass --database-url"),
        "{}",
        out.stderr
    );

    // Missing tables, in an existing schema and in a missing one.
    for table in [
        format!("{}.nothing_here", db.schema),
        format!("{}_missing.outbox", db.schema),
    ] {
        for args in [
            vec!["status"],
            vec!["dead"],
            vec!["replay", "--id", &sent.to_string()],
        ] {
            let mut all = vec!["--table", table.as_str()];
            all.extend(args);
            let out = outbox(&all).await;
            let err = out.failed();
            assert!(
                err.contains("does not exist") && err.contains("outbox migrate"),
                "{all:?}: {err}"
            );
        }
    }

    // An invalid table name is refused before any SQL runs.
    let out = outbox(&["--table", "outbox; DROP TABLE users", "status"]).await;
    assert!(
        out.failed().contains("invalid outbox table name"),
        "{}",
        out.stderr
    );

    assert_eq!(state(&db, sent).await, before, "nothing changed");
    db.cleanup().await;
}

/// Dead-letters a `Poison` message and sends a good one through a real relay run, then
/// checks what `status`, `dead`, `release`, `pending` and `retention` say and do on the
/// database `url` names.
async fn commands_on<DB: outbox_core::Backend>(url: &str, outbox: outbox_core::Outbox<DB>) {
    use outbox_core::OutboxMessage;
    use outbox_core::publisher::{InMemoryPublisher, PublishError};

    let mut tx = outbox.begin().await.expect("begin");
    let poison = tx
        .emit_message(OutboxMessage::new("Poison", "orders", "{}").with_key("p"))
        .expect("emit");
    let good = tx
        .emit_message(OutboxMessage::new("Good", "orders", "{}").with_key("g"))
        .expect("emit");
    tx.commit().await.expect("commit");
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.event_type == "Poison",
        None,
        PublishError::permanent("broker says no"),
    );
    let relay = outbox_core::Relay::builder(outbox.clone(), publisher.clone()).spawn();
    assert!(
        publisher
            .wait_for(1, std::time::Duration::from_secs(30))
            .await
    );
    let admin = outbox_core::admin::Admin::new(outbox.clone());
    for _ in 0..300 {
        if admin.status().await.expect("status").dead == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    relay.shutdown().await;

    let run = |args: &'static [&'static str]| outbox_with_env(args, Some(url));
    let status = run(&["status"]).await;
    let text = status.ok();
    assert!(
        text.contains("0 pending (0 in retry), 1 dead-lettered"),
        "{text}"
    );
    assert!(
        text.contains("relays not tracked (SQLite)") || text.contains("0 relay(s) connected"),
        "{text}"
    );

    // The doctor's checks that every database has: the dead letter needs action.
    let doctor = run(&["doctor"]).await;
    assert_eq!(doctor.code, 3, "{}\n{}", doctor.stdout, doctor.stderr);
    assert!(
        doctor
            .stdout
            .contains("ACTION  dead-letters: 1 dead letter(s), holding back 0 later message(s)"),
        "{}",
        doctor.stdout
    );
    assert!(
        doctor.stdout.contains("1 finding(s) need action"),
        "only that one: {}",
        doctor.stdout
    );

    let dead = run(&["dead", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_str(dead.ok()).expect("JSON");
    assert_eq!(listed[0]["id"], poison.to_string(), "{listed}");
    assert_eq!(listed[0]["last_error"], "broker says no");
    assert_eq!(listed[0]["state"], "dead");

    let id = poison.to_string();
    let release = outbox_with_env(&["release", "--id", &id], Some(url)).await;
    assert!(release.ok().contains("released 1"), "{}", release.stdout);
    let pending = run(&["pending"]).await;
    assert!(pending.ok().contains(&id), "{}", pending.stdout);
    let again = outbox_with_env(&["release", "--id", &id], Some(url)).await;
    assert!(again.failed().contains("pending"), "{}", again.stderr);

    let retention = run(&["retention", "--sent-older-than", "0s", "--keep-processed"]).await;
    assert!(
        retention.ok().contains("deleted 1 sent messages"),
        "{}",
        retention.stdout
    );
    assert!(
        !admin
            .pending(&Default::default())
            .await
            .expect("pending")
            .iter()
            .any(|m| m.id == good),
        "the sent message is gone, the released one pending"
    );
}

/// The URL's scheme picks the database: the same commands work on SQLite and
/// MySQL/MariaDB. A SQLite path that does not exist is an error (except for `migrate`,
/// which creates it), not a new empty file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_and_mysql_urls() {
    use outbox_core::sqlx::{Connection as _, Executor as _, Sqlite};

    let path = std::env::temp_dir().join(format!("outbox-cli-{}.db", Uuid::now_v7().simple()));
    let url = format!("sqlite://{}", path.display());
    let missing = outbox_with_env(&["status"], Some(&url)).await;
    assert!(
        missing.failed().contains("no SQLite database at"),
        "{}",
        missing.stderr
    );
    assert!(!path.exists(), "status created no file");
    let migrate = outbox_with_env(&["migrate"], Some(&url)).await;
    assert!(
        migrate.ok().contains("applied migrations 1"),
        "{}",
        migrate.stdout
    );
    let outbox = outbox_core::Outbox::<Sqlite>::open(&url)
        .await
        .expect("open");
    commands_on(&url, outbox.clone()).await;
    outbox.pool().close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }

    let server = outbox_tests::backends::mysql_url();
    let database = format!("outbox_cli_{}", Uuid::now_v7().simple());
    let mut admin = sqlx::MySqlConnection::connect(&server)
        .await
        .expect("MariaDB at OUTBOX_TEST_MYSQL_URL");
    admin
        .execute(trusted_sql(format!("CREATE DATABASE `{database}`")))
        .await
        .expect("create database");
    let base = server.rsplit_once('/').map_or(server.as_str(), |(b, _)| b);
    let url = format!("{base}/{database}");
    let migrate = outbox_with_env(&["migrate"], Some(&url)).await;
    assert!(
        migrate.ok().contains("applied migrations 1"),
        "{}",
        migrate.stdout
    );
    let outbox = outbox_core::Outbox::connect_mysql(&url)
        .await
        .expect("connect");
    commands_on(&url, outbox.clone()).await;
    let mariadb = url.replacen("mysql:", "mariadb:", 1);
    let status = outbox_with_env(&["status"], Some(&mariadb)).await;
    assert!(
        status.ok().contains("1 pending"),
        "mariadb:// is MySQL: {}",
        status.stdout
    );
    outbox.pool().close().await;
    admin
        .execute(trusted_sql(format!("DROP DATABASE `{database}`")))
        .await
        .expect("drop database");

    let unknown = outbox_with_env(&["status"], Some("redis://127.0.0.1:6379")).await;
    assert!(
        unknown
            .failed()
            .contains("must start with postgres://, mysql://"),
        "{}",
        unknown.stderr
    );
}

/// No part of a password reaches the error line: not with an unknown scheme (the error
/// used to echo the URL's first 12 characters), not with a password in the user
/// information or in `?password=`, not with a server that cannot be reached.
#[tokio::test]
async fn a_password_in_the_url_never_reaches_the_error_line() {
    const PLANTED: &str = "PLANTEDs3cret";
    for url in [
        format!("pgsql://admin:{PLANTED}@db/app"),
        format!("{PLANTED}@db/app"),
        format!("adm:{PLANTED}@db:5432/app"),
        format!("postgres://postgres:{PLANTED}@127.0.0.1:1/test"),
        format!("postgres://postgres@127.0.0.1:1/test?password={PLANTED}"),
        format!("mysql://root:{PLANTED}@127.0.0.1:1/test"),
    ] {
        let run = outbox_with_env(&["status"], Some(&url)).await;
        let line = run.failed();
        assert!(
            !line.contains("PLANTED")
                && !line.contains("s3cret")
                && !run.stdout.contains("PLANTED"),
            "{url}: {line}"
        );
    }
    let unknown = outbox_with_env(
        &["status"],
        Some(&format!("pgsql://admin:{PLANTED}@db/app")),
    )
    .await;
    assert!(
        unknown.failed().contains("not pgsql://;"),
        "{}",
        unknown.stderr
    );
}

/// `outbox dead` says how many pending messages each dead letter holds back (the relay
/// parks a key behind its dead letter), and `outbox discard` deletes a dead letter for
/// good, all or nothing.
#[tokio::test]
async fn dead_shows_what_each_dead_letter_holds_back_and_discard_deletes_it() {
    let db = TestDb::new().await;
    db.outbox().await;
    let dead = insert(
        &db,
        Row {
            key: Some("k"),
            dead_ago: Some("1 minute"),
            attempts: 3,
            ..PENDING
        },
    )
    .await;
    for _ in 0..2 {
        insert(
            &db,
            Row {
                key: Some("k"),
                ..PENDING
            },
        )
        .await;
    }
    let text = in_db(&db, &["dead"]).await;
    let text = text.ok();
    let header = text.lines().next().expect("a header");
    assert!(header.contains("HOLDS BACK"), "{text}");
    let row = text
        .lines()
        .find(|l| l.contains(&dead.to_string()))
        .expect("the dead letter");
    let column = header.find("HOLDS BACK").expect("column");
    assert!(row[column..].trim_start().starts_with('2'), "{text}");
    let d = json(in_db(&db, &["dead", "--json"]).await.ok());
    assert_eq!(d[0]["held_back"], 2);

    // A pending message is not a dead letter: nothing is deleted.
    let pending = insert(&db, PENDING).await;
    let ids = format!("{dead},{pending}");
    let out = in_db(&db, &["discard", "--id", &ids]).await;
    assert!(
        out.stderr
            .contains("only dead-lettered messages can be discarded"),
        "{}",
        out.stderr
    );
    assert_eq!(db.count("outbox").await, 4);

    let out = in_db(&db, &["discard", "--id", &dead.to_string()]).await;
    assert!(
        out.ok().contains("discarded 1 dead-lettered message"),
        "{}",
        out.stdout
    );
    assert_eq!(db.count("outbox").await, 3);
    db.cleanup().await;
}

/// WAL mode: `migrate --wal-slot` creates the slot, `status` shows what it holds (with
/// and without a relay streaming from it), and `slot drop` is refused while a relay
/// streams, asks first, and drops the slot and its publication with `--yes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_wal_slot_and_slot_drop_asks_first() {
    use outbox_core::publisher::InMemoryPublisher;
    use outbox_core::relay::Relay;
    let db = TestDb::new().await;
    let slot = format!("owt_{}_cli", std::process::id());
    let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(&db.pool)
        .await;
    let with_slot = |args: &[&str]| {
        let mut all = vec!["--wal-slot", slot.as_str()];
        all.extend_from_slice(args);
        all.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let db = &db;
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            in_db(db, &args).await
        }
    };
    run(with_slot(&["migrate"])).await.ok();
    let outbox = outbox_core::Outbox::builder(db.pool.clone())
        .table(format!("{}.outbox", db.schema))
        .wal_slot(&slot)
        .build()
        .expect("outbox");
    let mut tx = outbox.begin().await.expect("begin");
    for n in 0..10 {
        tx.emit_message(outbox_core::OutboxMessage::new(
            "T",
            "d",
            format!("{{\"n\":{n}}}"),
        ))
        .expect("emit");
    }
    tx.commit().await.expect("commit");

    let text = run(with_slot(&["status"])).await;
    let line = text
        .ok()
        .lines()
        .find(|l| l.starts_with("replication slot"))
        .expect("a slot line")
        .to_owned();
    assert!(
        line.contains(&slot) && line.contains("no relay streaming"),
        "{line}"
    );
    assert!(line.contains("WAL reserved"), "{line}");
    let s = json(run(with_slot(&["status", "--json"])).await.ok());
    assert!(
        s["slot"]["unconfirmed_bytes"].as_i64().expect("bytes") > 0,
        "{s}"
    );
    let age = s["slot"]["oldest_unconfirmed_age_seconds"]
        .as_f64()
        .expect("the first commit's age, read from the slot");
    assert!((0.0..60.0).contains(&age), "{s}");

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    assert!(
        publisher
            .wait_for(10, std::time::Duration::from_secs(30))
            .await
    );
    let s = json(run(with_slot(&["status", "--json"])).await.ok());
    assert!(s["slot"]["active_pid"].as_i64().is_some(), "{s}");
    assert_eq!(s["relays"], 1, "{s}");
    let refused = run(with_slot(&["slot", "drop", "--yes"])).await;
    assert!(
        refused.failed().contains("stop the relays"),
        "{}",
        refused.stderr
    );
    relay.shutdown().await;

    let asked = run(with_slot(&["slot", "drop"])).await;
    assert!(
        asked.failed().contains("nothing dropped"),
        "{}",
        asked.stderr
    );
    let dropped = run(with_slot(&["slot", "drop", "--yes"])).await;
    assert!(
        dropped.ok().contains("dropped replication slot"),
        "{}",
        dropped.stdout
    );
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1) \
             OR EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
    )
    .bind(&slot)
    .fetch_one(&db.pool)
    .await
    .expect("slot");
    assert!(!exists, "slot and publication dropped");
    let text = run(with_slot(&["status"])).await;
    assert!(
        text.ok().contains("missing; the relay cannot start"),
        "{}",
        text.stdout
    );
    // Not in WAL mode, or not on PostgreSQL: a one-line refusal.
    assert!(
        in_db(&db, &["slot", "drop"])
            .await
            .failed()
            .contains("needs WAL mode")
    );
    let sqlite = outbox_with_env(&["--wal", "status"], Some("sqlite::memory:")).await;
    assert!(
        sqlite.failed().contains("PostgreSQL only"),
        "{}",
        sqlite.stderr
    );
    db.cleanup().await;
}

#[tokio::test]
async fn doctor_says_what_needs_action_and_exits_3_until_nothing_does() {
    let db = TestDb::new().await;
    db.outbox().await;
    // Replication slots are server-wide: other tests' are not this outbox's business.
    let healthy = in_db(&db, &["doctor", "--slot-wal-mib", "1000000000"]).await;
    let autovacuum: bool = sqlx::query_scalar("SELECT current_setting('autovacuum') = 'on'")
        .fetch_one(&db.pool)
        .await
        .expect("autovacuum setting");
    if autovacuum {
        let text = healthy.ok();
        assert!(text.contains("nothing needs action"), "{text}");
    } else {
        // A test server may run without autovacuum: that alone needs action.
        assert_eq!(healthy.code, 3, "{}", healthy.stdout);
        assert!(
            healthy
                .stdout
                .contains("ACTION  autovacuum: autovacuum is off on this server"),
            "{}",
            healthy.stdout
        );
        assert!(
            healthy.stdout.contains("1 finding(s) need action"),
            "{}",
            healthy.stdout
        );
    }
    assert!(
        healthy
            .stdout
            .contains("note    relays: 0 relay(s) connected"),
        "{}",
        healthy.stdout
    );

    let dead = insert(
        &db,
        Row {
            key: Some("order-9"),
            dead_ago: Some("1 hour"),
            attempts: 5,
            ..PENDING
        },
    )
    .await;
    insert(
        &db,
        Row {
            key: Some("order-9"),
            created_ago: "2 hours",
            ..PENDING
        },
    )
    .await;
    let sick = in_db(&db, &["doctor", "--oldest-pending", "10s"]).await;
    assert_eq!(
        sick.code, 3,
        "stdout: {}\nstderr: {}",
        sick.stdout, sick.stderr
    );
    assert!(
        sick.stderr.is_empty(),
        "the report is the output: {}",
        sick.stderr
    );
    for expected in [
        "ACTION  dead-letters: 1 dead letter(s), holding back 1 later message(s) of their keys",
        &format!("{dead} Tested to orders, key order-9: holds back 1 message(s)"),
        "ACTION  no-relay: 1 message(s) pending and no relay is connected",
        "ACTION  oldest-pending: the oldest pending message has waited 2h 0m (limit 10.0s)",
        "fix: see `no-relay`",
        if autovacuum {
            "3 finding(s) need action"
        } else {
            "4 finding(s) need action"
        },
    ] {
        assert!(
            sick.stdout.contains(expected),
            "{expected:?} in\n{}",
            sick.stdout
        );
    }
    let json_run = in_db(&db, &["doctor", "--json"]).await;
    assert_eq!(json_run.code, 3, "{}", json_run.stderr);
    let report = json(&json_run.stdout);
    assert_eq!(report["findings"][0]["check"], "dead-letters");
    assert_eq!(report["findings"][0]["severity"], "action");
    assert_eq!(report["status"]["dead"], 1);
    assert_eq!(report["health"]["sequence_cache"], 1);

    let discarded = in_db(&db, &["discard", "--id", &dead.to_string()]).await;
    discarded.ok();
    let still = in_db(&db, &["doctor"]).await;
    assert_eq!(
        still.code, 3,
        "a pending message and no relay: {}",
        still.stdout
    );
    assert!(!still.stdout.contains("dead-letters"), "{}", still.stdout);
    db.cleanup().await;
}

#[tokio::test]
async fn partition_converts_the_table_once_and_is_postgresql_only() {
    let db = TestDb::new().await;
    db.outbox().await;
    insert(&db, PENDING).await;

    // Without --yes and without a terminal: nothing changes.
    let refused = in_db(&db, &["partition", "--interval", "day"]).await;
    assert!(
        refused.failed().contains("nothing changed"),
        "{}",
        refused.stderr
    );
    let out = in_db(&db, &["partition", "--interval", "day", "--yes"]).await;
    let text = out.ok();
    assert!(
        text.contains("is partitioned by the day: 1 rows copied in ")
            && text.contains(" rows/s) into ")
            && text.contains("partitions"),
        "{text}"
    );
    let again = in_db(&db, &["partition", "--interval", "day", "--yes"]).await;
    assert!(
        again
            .ok()
            .contains("already partitioned by the day; nothing to do")
    );
    assert_eq!(db.count("outbox").await, 1);

    let path = std::env::temp_dir().join(format!("outbox-cli-{}.db", Uuid::now_v7().simple()));
    let url = format!("sqlite://{}", path.display());
    let lite = outbox_with_env(&["partition", "--interval", "day", "--yes"], Some(&url)).await;
    assert!(
        lite.failed()
            .contains("`outbox partition` is PostgreSQL only"),
        "{}",
        lite.stderr
    );
    db.cleanup().await;
}

/// The CLI operates MariaDB through a user that may connect over TLS only
/// (`OUTBOX_TEST_MYSQL_TLS_URL`, scripts/services.sh), and names TLS for a wrong CA.
#[tokio::test]
async fn tls_only_mariadb_is_operated_over_tls_and_a_wrong_ca_is_named() {
    let database = outbox_tests::backends::mysql_database("outbox_cli_tls").await;
    let url = std::env::var("OUTBOX_TEST_MYSQL_TLS_URL")
        .expect("OUTBOX_TEST_MYSQL_TLS_URL (run scripts/services.sh)")
        .replace(":3306/test?", &format!(":3306/{database}?"));
    let run = |command: &'static str, url: String| async move {
        outbox_with_env(&[command], Some(&url)).await
    };
    run("migrate", url.clone()).await.ok();
    let status = run("status", url.clone()).await;
    assert!(status.ok().contains("pending"), "{}", status.stdout);

    let dir = outbox_tests::tls_dir();
    let wrong = url.replace(&format!("{dir}/ca.crt"), &format!("{dir}/other-ca.crt"));
    assert_ne!(wrong, url);
    let refused = run("status", wrong).await;
    let line = refused.failed();
    assert!(line.contains("TLS") && line.contains("ssl-ca"), "{line}");
    assert!(!line.contains("check that the server is running"), "{line}");
    outbox_tests::backends::drop_mysql_database(&database).await;
}

/// A managed PostgreSQL that accepts TLS only: the CLI connects with rustls, verifies
/// the server against `sslrootcert`, and names TLS when the CA is the wrong one.
#[tokio::test]
async fn tls_only_postgres_is_operated_over_tls_and_a_wrong_ca_is_named() {
    let db = TestDb::new().await;
    let table = format!("{}.outbox", db.schema);
    let url = outbox_tests::pg_tls_url();
    let args =
        |command: &'static str| vec!["--table".to_owned(), table.clone(), command.to_owned()];
    let run = |args: Vec<String>, url: String| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        outbox_with_env(&args, Some(&url)).await
    };

    run(args("migrate"), url.clone()).await.ok();
    let status = run(args("status"), url.clone()).await;
    assert!(status.ok().contains("pending"), "{}", status.stdout);

    let dir = outbox_tests::tls_dir();
    let wrong = url.replace(&format!("{dir}/ca.crt"), &format!("{dir}/other-ca.crt"));
    assert_ne!(wrong, url);
    let refused = run(args("status"), wrong).await;
    let line = refused.failed();
    assert!(line.contains("TLS"), "{line}");
    assert!(line.contains("sslrootcert"), "{line}");
    assert!(!line.contains("check that the server is running"), "{line}");

    let plain = url.replace("sslmode=verify-full", "sslmode=disable");
    let refused = run(args("status"), plain).await;
    assert!(
        refused.failed().contains("pg_hba.conf"),
        "{}",
        refused.stderr
    );
    db.cleanup().await;
}

/// `outbox completions <shell>` needs no database; bash (a shell we did not write) loads
/// the script and completes the subcommands and their arguments from it (#37 §4).
#[tokio::test]
async fn completions_load_in_bash_and_complete_the_commands() {
    let bash = outbox_with_env(&["completions", "bash"], None).await;
    let script = std::env::temp_dir().join(format!("outbox-completions-{}.bash", Uuid::now_v7()));
    std::fs::write(&script, bash.ok()).expect("write the script");
    // What bash offers after `outbox <words>` (the last word being completed).
    let complete = |words: &[&str]| {
        let words: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
        let line = format!(
            "source '{}'; COMP_WORDS=(outbox {}); COMP_CWORD={}; \
             _outbox outbox \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; \
             printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display(),
            words.join(" "),
            words.len()
        );
        let out = std::process::Command::new("bash")
            .args(["-c", &line])
            .output()
            .expect("run bash");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let offered = complete(&["re"]);
    for command in ["release", "replay", "retention"] {
        assert!(
            offered.lines().any(|l| l == command),
            "`outbox re<TAB>`: {offered}"
        );
    }
    let offered = complete(&["completions", ""]);
    assert!(
        offered.lines().any(|l| l == "zsh"),
        "`outbox completions <TAB>`: {offered}"
    );
    let offered = complete(&["dead", "--des"]);
    assert!(
        offered.lines().any(|l| l == "--destination"),
        "`outbox dead --des<TAB>`: {offered}"
    );
    std::fs::remove_file(&script).expect("remove the script");
    for shell in ["zsh", "fish"] {
        let run = outbox_with_env(&["completions", shell], None).await;
        assert!(run.ok().contains("release"), "{shell}: {}", run.stdout);
    }
    let wrong = outbox_with_env(&["completions", "nushell"], None).await;
    assert_eq!(wrong.code, 2, "{}", wrong.stderr);
    assert!(
        wrong.stderr.contains("possible values: bash"),
        "{}",
        wrong.stderr
    );
}

/// `outbox --help` puts the options every command takes under their own heading and
/// lists the exit statuses; `partition` takes `-y` like the other confirming commands
/// (#37 §4).
#[tokio::test]
async fn help_shows_the_global_options_apart_and_the_exit_statuses() {
    let help = outbox_with_env(&["--help"], None).await;
    let text = help.ok();
    let (commands, global) = text
        .split_once("Global options:")
        .unwrap_or_else(|| panic!("a `Global options:` heading:\n{text}"));
    for option in [
        "--database-url",
        "--table",
        "--wal-slot",
        "--connect-timeout",
    ] {
        assert!(
            global.contains(option),
            "{option} under Global options:\n{text}"
        );
        assert!(!commands.contains(option), "{option} only there:\n{text}");
    }
    assert!(
        text.contains("Exit status: 0 done; 1 the command failed")
            && text.contains("3 `doctor` found"),
        "{text}"
    );
    let partition = outbox_with_env(
        &["partition", "--interval", "day", "-y"],
        Some("sqlite://x.db"),
    )
    .await;
    assert!(
        partition.failed().contains("PostgreSQL only"),
        "-y parses; the refusal is the database's: {}",
        partition.stderr
    );
}

/// `--json` on every command that changes something: what it did, as one JSON object on
/// standard output; a failure, as one JSON object on one line of standard error; a
/// command that asks first refuses without `--yes` instead of mixing its question with
/// the JSON (#37 §4: only status, pending, dead and doctor spoke JSON).
#[tokio::test]
async fn the_commands_that_change_things_speak_json_when_asked() {
    let db = TestDb::new().await;
    db.outbox().await;
    let table = format!("{}.outbox", db.schema);
    let migrate = json(in_db(&db, &["migrate", "--json"]).await.ok());
    assert_eq!(migrate["table"], table.as_str());
    assert_eq!(migrate["applied"], serde_json::json!([]), "{migrate}");

    let old_sent = Row {
        sent_ago: Some("10 days"),
        created_ago: "10 days",
        ..PENDING
    };
    let old_dead = Row {
        dead_ago: Some("10 days"),
        created_ago: "10 days",
        attempts: 1,
        ..PENDING
    };
    let sent = insert(&db, old_sent).await.to_string();
    let replay = json(in_db(&db, &["replay", "--json", "--id", &sent]).await.ok());
    assert_eq!(replay["requeued"], 1, "{replay}");
    let dead = insert(&db, old_dead).await.to_string();
    let release = json(in_db(&db, &["release", "--json", "--id", &dead]).await.ok());
    assert_eq!(release["released"], 1, "{release}");
    let dead = insert(&db, old_dead).await.to_string();
    let discard = json(in_db(&db, &["discard", "--json", "--id", &dead]).await.ok());
    assert_eq!(discard["discarded"], 1, "{discard}");
    insert(&db, old_sent).await;
    let purge = json(
        in_db(&db, &["purge", "--json", "--sent-before", "7d"])
            .await
            .ok(),
    );
    assert_eq!(
        (&purge["sent"], &purge["dead"], &purge["dry_run"]),
        (
            &serde_json::json!(1),
            &serde_json::json!(0),
            &serde_json::json!(false)
        ),
        "{purge}"
    );
    let retention = json(in_db(&db, &["retention", "--json"]).await.ok());
    for field in [
        "sent_deleted",
        "processed_deleted",
        "batches",
        "elapsed_seconds",
    ] {
        assert!(retention[field].is_number(), "{field}: {retention}");
    }

    // A failure: nothing on standard output, one JSON object on standard error.
    let unknown = uuid::Uuid::now_v7().to_string();
    let failed = in_db(&db, &["replay", "--json", "--id", &unknown]).await;
    assert_eq!(failed.code, 1, "{}", failed.stderr);
    assert_eq!(failed.stdout, "", "nothing on standard output");
    assert_eq!(
        failed.stderr.trim_end().lines().count(),
        1,
        "{}",
        failed.stderr
    );
    let error = json(&failed.stderr);
    assert!(
        error["error"]
            .as_str()
            .is_some_and(|e| e.contains(&unknown))
            && error["exit_status"] == 1,
        "{error}"
    );
    // A command that would ask: refused, nothing changed, no question on the output.
    let dead = insert(&db, old_dead).await;
    let asked = in_db(&db, &["purge", "--json", "--dead-before", "1d"]).await;
    assert_eq!(asked.code, 1, "{}", asked.stderr);
    assert_eq!(asked.stdout, "", "no preview text among the JSON");
    assert!(
        json(&asked.stderr)["error"]
            .as_str()
            .is_some_and(|e| e.contains("--yes"))
    );
    assert!(state(&db, dead).await.is_some(), "nothing deleted");
    let yes = json(
        in_db(&db, &["purge", "--json", "--dead-before", "1d", "--yes"])
            .await
            .ok(),
    );
    assert_eq!(yes["dead"], 1, "{yes}");
    db.cleanup().await;
}
