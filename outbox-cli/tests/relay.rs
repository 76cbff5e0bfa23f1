//! `outbox relay` as processes of their own: three on one outbox (its partitions shared),
//! one killed with SIGKILL and another stopped with SIGTERM while a writer commits. Every
//! event reaches NATS once, each key in order; `/readyz`, `/healthz` and `/metrics`
//! answer as each process's state says (a fourth, whose table is not migrated, is alive
//! and not ready); logs are JSON when asked.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures_util::StreamExt;
use outbox_tests::nats::{fresh_stream, nats_url};
use outbox_tests::order;
use outbox_tests::process::Process;
use outbox_tests::{TestDb, database_url, wait_until, wait_until_or};

/// Starts `outbox relay` named `name` on `table`, to NATS, serving on a free port.
fn relay(name: &str, table: &str, json_logs: bool) -> Process {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox"));
    command
        .args(["--table", table])
        // JSON logs and a JSON first line go together here.
        .args(json_logs.then_some("--json"))
        .args(["relay", "--broker", "nats"])
        .args(["--listen", "127.0.0.1:0", "--partitions", "8"])
        .args(["--poll-interval", "200ms", "--shutdown-timeout", "20s"])
        .env("DATABASE_URL", database_url())
        .env("OUTBOX_BROKER_URL", nats_url())
        .env("OUTBOX_LOG", "info,outbox_core=debug,sqlx::query=error")
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_RELAY_CONFIG");
    if json_logs {
        command.args(["--log-format", "json"]);
    }
    Process::named(name, &mut command)
}

/// Where `process` serves, from the first line it prints (as text, or with `--json` as
/// `{"listening": ...}`).
async fn address(process: &Process) -> String {
    let mut address = None;
    wait_until_or(
        "the relay says where it serves",
        Duration::from_secs(60),
        || {
            let output = process.output();
            address = output
                .split("serving http://")
                .nth(1)
                .and_then(|rest| rest.split('/').next())
                .map(str::to_owned)
                .or_else(|| {
                    output
                        .lines()
                        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                        .find_map(|v| v["listening"].as_str().map(str::to_owned))
                });
            let found = address.is_some();
            async move { found }
        },
        || process.output_tail(),
    )
    .await;
    address.expect("an address")
}

/// `GET path` on `address`: the status code and body, or `None` when nothing answers.
async fn get(address: &str, path: &str) -> Option<(u16, String)> {
    tokio::net::TcpStream::connect(address).await.ok()?;
    let reply = common::raw(address, address, "GET", path, None, None).await;
    Some((reply.code, reply.body))
}

async fn stored(js: &jetstream::Context, stream: &str) -> u64 {
    let mut s = js.get_stream(stream).await.expect("stream");
    s.info().await.expect("stream info").state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relay_processes_share_an_outbox_through_sigkill_and_sigterm() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let table = format!("{}.outbox", db.schema);
    let (js, stream, prefix) = fresh_stream().await;
    let destination = format!("{prefix}.jobs");

    let mut a = relay("relay-a", &table, false);
    let mut b = relay("relay-b", &table, false);
    let mut c = relay("relay-c", &table, true);
    let (a_at, b_at, c_at) = (address(&a).await, address(&b).await, address(&c).await);
    for (name, at) in [("a", &a_at), ("b", &b_at), ("c", &c_at)] {
        wait_until(
            &format!("relay-{name} is ready"),
            Duration::from_secs(30),
            || async {
                get(at, "/readyz")
                    .await
                    .is_some_and(|(code, _)| code == 200)
            },
        )
        .await;
    }
    assert_eq!(get(&c_at, "/healthz").await, Some((200, "ok\n".to_owned())));
    // A relay without its database session (its table not migrated) is alive, not ready.
    let missing = relay("relay-unmigrated", &format!("{}.missing", db.schema), false);
    let missing_at = address(&missing).await;
    wait_until_or(
        "relay-unmigrated says its table is missing",
        Duration::from_secs(30),
        || {
            let said = missing.output().contains("the outbox table does not exist");
            async move { said }
        },
        || missing.output_tail(),
    )
    .await;
    let (code, body) = get(&missing_at, "/readyz").await.expect("it answers");
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).expect("JSON")["ready"],
        false,
        "{body}"
    );
    assert_eq!(get(&missing_at, "/healthz").await.map(|r| r.0), Some(200));
    drop(missing);

    // The writer: one event per key (12 keys) per transaction, round after round, while
    // relays die; stopped after the second death.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = order::spawn_rounds(outbox.clone(), destination.clone(), Arc::clone(&stop));

    wait_until(
        "100 events reached NATS",
        Duration::from_secs(60),
        || async { stored(&js, &stream).await >= 100 },
    )
    .await;
    a.signal("-KILL");
    wait_until("relay-a is gone", Duration::from_secs(10), || {
        let gone = a.try_wait().is_some();
        async move { gone }
    })
    .await;
    assert_eq!(
        get(&a_at, "/readyz").await,
        None,
        "a killed relay answers nothing"
    );

    wait_until(
        "300 events reached NATS",
        Duration::from_secs(60),
        || async { stored(&js, &stream).await >= 300 },
    )
    .await;
    b.signal("-TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(25);
    let status = loop {
        if let Some(status) = b.try_wait() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "relay-b did not stop within its shutdown timeout (20 s) after SIGTERM:\n{}",
            b.output_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "SIGTERM is a clean stop: {status:?}\n{}",
        b.output_tail()
    );
    assert!(
        b.output().contains("outbox relay stopped"),
        "{}",
        b.output_tail()
    );

    wait_until(
        "100 more events reached NATS",
        Duration::from_secs(60),
        || async { stored(&js, &stream).await >= 400 },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    let events = writer.await.expect("the writer") * order::KEYS;
    wait_until_or(
        "every event reached NATS through relay-c",
        Duration::from_secs(60),
        || async { stored(&js, &stream).await >= events as u64 },
        || c.output_tail(),
    )
    .await;
    wait_until(
        "every row is marked sent",
        Duration::from_secs(30),
        || async {
            outbox_core::sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM outbox WHERE sent_at IS NULL",
            )
            .fetch_one(&db.pool)
            .await
            .expect("count unsent")
                == 0
        },
    )
    .await;

    // Once each, each key in order.
    let reader = js
        .get_stream(&stream)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config::default())
        .await
        .expect("consumer");
    let mut messages = reader
        .fetch()
        .max_messages(events + 100)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch");
    let mut ids = HashSet::new();
    let mut applied: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    while let Some(m) = messages.next().await {
        let m = m.expect("message");
        let headers = m.headers.clone().expect("headers");
        let id = headers
            .get("message-id")
            .expect("a message id")
            .as_str()
            .to_owned();
        assert!(ids.insert(id.clone()), "{id} published twice");
        let key = headers
            .get("partition-key")
            .expect("a key")
            .as_str()
            .to_owned();
        let round: usize = serde_json::from_slice(&m.payload).expect("a round number");
        applied.entry(key).or_default().push(round);
    }
    assert_eq!(ids.len(), events, "every event once");
    order::assert_in_order(&applied);

    // relay-c: ready, its metrics labelled, its logs JSON.
    let (code, body) = get(&c_at, "/readyz").await.expect("relay-c answers");
    assert_eq!(code, 200, "{body}");
    let ready: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(ready["outboxes"][&table]["connected"], true, "{body}");
    let database: String = outbox_core::sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&db.pool)
        .await
        .expect("the database's name");
    let (code, metrics) = get(&c_at, "/metrics").await.expect("relay-c answers");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("# HELP outbox_published_total ")
            && metrics.contains(&format!(
                "outbox_published_total{{outbox=\"{table}\",database=\"{database}\",destination=\"{destination}\"}}"
            )),
        "{metrics}"
    );
    let output = c.output();
    let lines: Vec<&str> = output.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        lines.iter().any(|l| l.contains("\"listening\"")),
        "--json: the first line as JSON: {output}"
    );
    assert!(lines.len() > 3, "{output}");
    for line in lines {
        let object: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
        assert!(
            object["listening"].is_string()
                || (object["level"].is_string() && object["fields"].is_object()),
            "{line}"
        );
    }

    c.signal("-TERM");
    wait_until("relay-c stops", Duration::from_secs(25), || {
        let done = c.try_wait().is_some_and(|s| s.success());
        async move { done }
    })
    .await;
    js.delete_stream(&stream).await.expect("delete the stream");
    db.cleanup().await;
}

/// `outbox relay` with `args` (and `env`), no database or broker needed: its exit
/// status and standard error.
fn refused(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox"));
    command
        .args(args)
        .env("DATABASE_URL", "postgres://nobody:hunter2@127.0.0.1:1/none")
        .env_remove("OUTBOX_BROKER")
        .env_remove("OUTBOX_BROKER_URL")
        .env_remove("OUTBOX_RELAY_CONFIG");
    for (name, value) in env {
        command.env(name, value);
    }
    let out = command.output().expect("run outbox");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Bad settings are refused before anything connects, each with what to fix, and a
/// password in the config file is not shown even on the line that does not parse.
#[test]
fn bad_relay_settings_are_refused_with_what_to_fix() {
    let dir = std::env::temp_dir().join(format!("outbox-relay-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder");
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write the file");
        path.to_string_lossy().into_owned()
    };
    let unknown = file(
        "unknown.toml",
        "broker = \"nats\"\nbroker_urll = \"nats://x\"\n",
    );
    let secret = file(
        "secret.toml",
        "broker = \"nats\"\ndatabase_url = \"postgres://u:s3cr3t-pw@db/app\" junk\n",
    );
    let typed = file(
        "typed.toml",
        "broker = \"kafka\"\nbroker_url = \"k:9092\"\n[broker_settings]\n\"sasl.password\" = 4242424242\n",
    );
    let duration = file(
        "duration.toml",
        "broker = \"nats\"\nbroker_url = \"nats://x\"\npoll_interval = \"soon\"\n",
    );
    let both = file(
        "both.toml",
        "broker = \"nats\"\nbroker_url = \"nats://x\"\ntenants = [\"a.outbox\"]\ntenants_query = \"SELECT 1\"\n",
    );
    // (arguments, environment, what standard error says)
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a [&'a str]);
    let cases: Vec<Case<'_>> = vec![
        (
            vec!["relay"],
            vec![],
            &["no broker given", "--broker", "OUTBOX_BROKER"],
        ),
        (
            vec!["relay", "--broker", "nats"],
            vec![],
            &["no broker address", "--broker-url", "OUTBOX_BROKER_URL"],
        ),
        (
            vec![
                "relay",
                "--broker",
                "kafka",
                "--broker-setting",
                "acks=all",
                "--broker-setting",
                "sasl.password:hunter2",
            ],
            vec![("OUTBOX_BROKER_URL", "localhost:9092")],
            &["--broker-setting number 2 is not name=value"],
        ),
        (
            vec!["relay", "--config", &unknown],
            vec![],
            &["unknown.toml is not valid (line 2)", "broker_urll"],
        ),
        (
            vec!["relay", "--config", &secret],
            vec![],
            &["secret.toml is not valid (line 2)"],
        ),
        (
            vec!["relay", "--config", &typed],
            vec![],
            &["typed.toml is not valid (line 4)", "(value not shown)"],
        ),
        (
            vec!["relay", "--config", &duration],
            vec![],
            &["`poll_interval` in the relay's config file", "soon"],
        ),
        (
            vec!["relay", "--config", &both],
            vec![],
            &["both `tenants` and `tenants_query`"],
        ),
        (
            vec!["relay", "--broker", "nats", "--cloudevents-source", ""],
            vec![("OUTBOX_BROKER_URL", "nats://x")],
            &["CloudEvents source is not valid", "--cloudevents-source"],
        ),
        (
            vec!["relay", "--config", "/nonexistent/relay.toml"],
            vec![],
            &["cannot read the relay's config file /nonexistent/relay.toml"],
        ),
    ];
    for (args, env, expected) in cases {
        let (code, stderr) = refused(&args, &env);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        for text in expected {
            assert!(stderr.contains(text), "{args:?}: {text:?} in {stderr}");
        }
        for secret in ["hunter2", "s3cr3t-pw", "4242424242"] {
            assert!(
                !stderr.contains(secret),
                "{args:?} shows a password: {stderr}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
