//! `outbox serve`'s JSON API against the real PostgreSQL: reads open, paged by `seq`;
//! actions only with the token; the database password never in a reply.

mod common;

use common::{TOKEN, dashboard, http, raw};
use outbox_core::sqlx;
use outbox_tests::{TestDb, database_url};
use serde_json::json;
use uuid::Uuid;

/// A message: dead-lettered with `error`, or pending when `error` is `None`.
async fn message(db: &TestDb, key: &str, error: Option<&str>) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO outbox (id, event_type, destination, partition_key, payload, attempts, \
                             last_error, dead_at) \
         VALUES ($1, 'Served', 'orders', $2, '{}', CASE WHEN $3::text IS NULL THEN 0 ELSE 5 END, \
                 $3, CASE WHEN $3::text IS NULL THEN NULL ELSE now() END)",
    )
    .bind(id)
    .bind(key)
    .bind(error)
    .execute(&db.pool)
    .await
    .expect("insert");
    id
}

/// The test database's URL with a password in it (trust auth ignores it).
fn url_with_password() -> String {
    database_url().replacen("://postgres@", "://postgres:s3cret-pw@", 1)
}

#[tokio::test]
async fn the_api_reads_pages_and_acts_only_with_the_token() {
    let db = TestDb::new().await;
    db.outbox().await;
    let first = message(&db, "k1", Some("broker said no")).await;
    let parked = message(&db, "k1", None).await;
    let second = message(&db, "k2", Some("broker said no")).await;
    let third = message(&db, "k3", Some("too large")).await;
    let url = url_with_password();
    assert!(
        url.contains("s3cret-pw"),
        "the URL carries a password: {url}"
    );
    let served = dashboard(&db, &url, Some(TOKEN));
    let at = served.address.as_str();

    let page = http(at, "GET", "/", None, None).await;
    assert_eq!(page.code, 200);
    assert!(page.body.contains("<title>outbox</title>"));

    let status = http(at, "GET", "/api/status", None, None).await;
    assert_eq!(status.code, 200, "{}", status.body);
    let view = status.json();
    assert_eq!(view["status"]["dead"], 3);
    assert_eq!(view["status"]["pending"], 1);
    assert_eq!(view["actions_enabled"], true);
    assert!(view["status"]["last_seq"].as_i64().is_some(), "{view}");
    assert!(!status.body.contains("s3cret"), "{}", status.body);

    let errors = http(at, "GET", "/api/dead/errors", None, None).await.json();
    assert_eq!(errors[0]["error"], "broker said no");
    assert_eq!(errors[0]["count"], 2);
    assert_eq!(errors[1]["error"], "too large");

    // Two pages of two.
    let one = http(at, "GET", "/api/dead?limit=2", None, None)
        .await
        .json();
    let ids: Vec<&str> = one["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, [first.to_string(), second.to_string()]);
    assert_eq!(one["messages"][0]["held_back"], 1, "the parked message");
    let after = one["next_after_seq"].as_i64().expect("a next page");
    let two = http(
        at,
        "GET",
        &format!("/api/dead?limit=2&after_seq={after}"),
        None,
        None,
    )
    .await
    .json();
    assert_eq!(two["messages"][0]["id"], third.to_string());
    assert_eq!(two["next_after_seq"], serde_json::Value::Null);
    // A page exactly full is the last one when nothing follows (before: it offered a
    // next page, and the dashboard's "Next page" led to an empty table).
    let all = http(at, "GET", "/api/dead?limit=3", None, None)
        .await
        .json();
    assert_eq!(all["messages"].as_array().map(Vec::len), Some(3), "{all}");
    assert_eq!(all["next_after_seq"], serde_json::Value::Null, "{all}");
    let key = http(at, "GET", "/api/pending?key=k1", None, None)
        .await
        .json();
    assert_eq!(key["messages"][0]["id"], parked.to_string());
    let bad = http(at, "GET", "/api/dead?limit=0", None, None).await;
    assert_eq!(bad.code, 400, "{}", bad.body);

    // Actions: the token, or nothing changes.
    let release = json!({ "ids": [first] });
    let none = http(at, "POST", "/api/release", Some(release.clone()), None).await;
    assert_eq!(none.code, 401, "{}", none.body);
    let wrong = http(
        at,
        "POST",
        "/api/release",
        Some(release.clone()),
        Some("a-wrong-token-of-32-characters-x"),
    )
    .await;
    assert_eq!(wrong.code, 401, "{}", wrong.body);
    let dead_still = http(at, "GET", "/api/status", None, None).await.json();
    assert_eq!(dead_still["status"]["dead"], 3);
    let done = http(
        at,
        "POST",
        "/api/release",
        Some(release.clone()),
        Some(TOKEN),
    )
    .await;
    assert_eq!(done.code, 200, "{}", done.body);
    assert_eq!(done.json()["changed"], 1);
    let again = http(at, "POST", "/api/release", Some(release), Some(TOKEN)).await;
    assert_eq!(
        again.code, 409,
        "a pending message cannot be released: {}",
        again.body
    );
    let discard = http(
        at,
        "POST",
        "/api/discard",
        Some(json!({ "ids": [third] })),
        Some(TOKEN),
    )
    .await;
    assert_eq!(discard.json()["changed"], 1);
    let replay = http(at, "POST", "/api/replay", Some(json!({})), Some(TOKEN)).await;
    assert_eq!(replay.code, 400, "{}", replay.body);
    let window = json!({ "since": "2020-01-01T00:00:00Z", "until": "2999-01-01T00:00:00Z", "preview": true });
    let preview = http(at, "POST", "/api/replay", Some(window), Some(TOKEN)).await;
    assert_eq!(
        preview.json(),
        json!({ "changed": 0, "preview": true }),
        "nothing sent yet"
    );
    let garbage = raw(
        at,
        at,
        "POST",
        "/api/release",
        Some("not json".to_owned()),
        Some(TOKEN),
    )
    .await;
    assert_eq!(garbage.code, 400, "{}", garbage.body);
    assert!(
        garbage.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("JSON")),
        "{}",
        garbage.body
    );
    // Another host name (a rebinding attack's) is refused, reads included.
    let rebound = raw(at, "evil.example:80", "GET", "/api/status", None, None).await;
    assert_eq!(rebound.code, 421, "{}", rebound.body);
    for fine in [
        "localhost",
        "localhost:9999",
        "127.0.0.1",
        "[::1]:8080",
        "10.0.0.7",
    ] {
        let reply = raw(at, fine, "GET", "/api/status", None, None).await;
        assert_eq!(reply.code, 200, "Host: {fine}: {}", reply.body);
    }
    let listed = http(at, "GET", "/api/dead?limit=1", None, None)
        .await
        .json();
    assert!(
        listed["messages"][0].get("payload").is_none(),
        "no payloads: {listed}"
    );
    let unknown = http(
        at,
        "POST",
        "/api/discard",
        Some(json!({ "ids": [Uuid::now_v7()] })),
        Some(TOKEN),
    )
    .await;
    assert_eq!(unknown.code, 404, "{}", unknown.body);
    let after = http(at, "GET", "/api/status", None, None).await.json();
    assert_eq!(after["status"]["dead"], 1, "{after}");
    assert_eq!(after["status"]["pending"], 2, "{after}");
    drop(served);

    // Without a token the dashboard only reads.
    let read_only = dashboard(&db, &database_url(), None);
    let refused = http(
        &read_only.address,
        "POST",
        "/api/discard",
        Some(json!({ "ids": [second] })),
        Some(TOKEN),
    )
    .await;
    assert_eq!(refused.code, 403, "{}", refused.body);
    assert!(
        refused.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("--token"))
    );
    let view = http(&read_only.address, "GET", "/api/status", None, None)
        .await
        .json();
    assert_eq!(view["actions_enabled"], false);
    drop(read_only);
    db.cleanup().await;
}

#[tokio::test]
async fn a_short_token_is_refused_at_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", database_url())
        .env("OUTBOX_TOKEN", "short")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("shorter than 16 characters"), "{stderr}");
    assert!(
        !stderr.contains("short\""),
        "the token is not echoed: {stderr}"
    );
}
