//! The inbox (idempotent consumption) against real PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use outbox_core::inbox::{Inbox, InboxError, Processed};
use outbox_core::{OutboxMessage, sqlx};
use outbox_tests::TestDb;
use uuid::Uuid;

async fn effects_table(db: &TestDb) {
    sqlx::query("CREATE TABLE effects (message_id uuid NOT NULL, note text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create effects");
}

/// The handler used by most tests: one row in `effects`, through the inbox transaction.
async fn apply(inbox: &Inbox, id: Uuid, note: &'static str) -> Processed<u64> {
    inbox
        .process(id, move |tx| {
            Box::pin(async move {
                let done = sqlx::query("INSERT INTO effects VALUES ($1, $2)")
                    .bind(id)
                    .bind(note)
                    .execute(&mut **tx)
                    .await?;
                Ok::<_, sqlx::Error>(done.rows_affected())
            })
        })
        .await
        .expect("process")
}

#[tokio::test]
async fn a_duplicate_is_skipped_without_running_the_handler() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    effects_table(&db).await;
    let inbox = Inbox::new(&outbox, "billing");
    let id = Uuid::now_v7();

    assert!(!inbox.is_processed(id).await.expect("lookup"));
    assert_eq!(apply(&inbox, id, "first").await, Processed::Handled(1));
    assert!(inbox.is_processed(id).await.expect("lookup"));
    assert_eq!(apply(&inbox, id, "second").await, Processed::Duplicate);
    assert!(apply(&inbox, id, "third").await.is_duplicate());

    let notes: Vec<String> = sqlx::query_scalar("SELECT note FROM effects")
        .fetch_all(&db.pool)
        .await
        .expect("effects");
    assert_eq!(notes, ["first"], "the handler ran once");

    // Another consumer name has its own record of what it processed.
    let other = Inbox::new(&outbox, "shipping");
    assert_eq!(apply(&other, id, "shipping").await, Processed::Handled(1));
    let rows: Vec<(String, Uuid)> =
        sqlx::query_as("SELECT consumer, message_id FROM outbox_processed ORDER BY consumer")
            .fetch_all(&db.pool)
            .await
            .expect("processed");
    assert_eq!(
        rows,
        [("billing".to_owned(), id), ("shipping".to_owned(), id)]
    );
    db.cleanup().await;
}

#[tokio::test]
async fn a_failed_handler_records_nothing_and_can_be_retried() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    effects_table(&db).await;
    let inbox = Inbox::new(&outbox, "billing");
    let id = Uuid::now_v7();

    let err = inbox
        .process(id, move |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO effects VALUES ($1, 'half done')")
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| e.to_string())?;
                tx.emit_message(OutboxMessage::new("Charged", "billing", "{}"))
                    .map_err(|e| e.to_string())?;
                Err::<(), _>("card declined".to_owned())
            })
        })
        .await
        .expect_err("the handler failed");
    match err {
        InboxError::Handler(e) => assert_eq!(e, "card declined"),
        other => panic!("expected the handler's error, got {other:?}"),
    }
    assert_eq!(db.count("effects").await, 0, "the effect was rolled back");
    assert_eq!(
        db.count("outbox").await,
        0,
        "the emitted event was rolled back"
    );
    assert_eq!(db.count("outbox_processed").await, 0, "nothing recorded");
    assert!(!inbox.is_processed(id).await.expect("lookup"));

    // The redelivery runs the handler again, and this time it commits.
    assert_eq!(apply(&inbox, id, "retried").await, Processed::Handled(1));
    assert_eq!(db.count("effects").await, 1);
    assert_eq!(db.count("outbox_processed").await, 1);
    db.cleanup().await;
}

#[tokio::test]
async fn events_emitted_by_a_handler_commit_with_the_processed_id() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let inbox = Inbox::new(&outbox, "orders");
    let id = Uuid::now_v7();
    for _ in 0..2 {
        let _ = inbox
            .process(id, |tx| {
                Box::pin(async move {
                    tx.emit_message(
                        OutboxMessage::new("InvoiceRequested", "billing", r#"{"order":1}"#)
                            .with_key("1"),
                    )
                })
            })
            .await
            .expect("process");
    }
    assert_eq!(
        db.count("outbox").await,
        1,
        "one event, from the first delivery"
    );
    db.cleanup().await;
}

#[tokio::test]
async fn concurrent_duplicate_deliveries_run_the_handler_exactly_once() {
    let db = TestDb::with_max_connections(20).await;
    let outbox = db.outbox().await;
    effects_table(&db).await;
    let inbox = Inbox::new(&outbox, "billing");
    let runs = Arc::new(AtomicUsize::new(0));

    for round in 0..5 {
        let id = Uuid::now_v7();
        let start = Arc::new(tokio::sync::Barrier::new(8));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (inbox, runs, start) = (inbox.clone(), Arc::clone(&runs), Arc::clone(&start));
            tasks.push(tokio::spawn(async move {
                start.wait().await;
                inbox
                    .process(id, move |tx| {
                        Box::pin(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            // Hold the transaction open so the others really overlap.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            sqlx::query("INSERT INTO effects VALUES ($1, 'x')")
                                .bind(id)
                                .execute(&mut **tx)
                                .await?;
                            Ok::<_, sqlx::Error>(())
                        })
                    })
                    .await
                    .expect("process")
            }));
        }
        let mut handled = 0;
        for t in tasks {
            if !t.await.expect("task").is_duplicate() {
                handled += 1;
            }
        }
        assert_eq!(
            handled, 1,
            "round {round}: exactly one delivery was handled"
        );
        assert_eq!(
            runs.load(Ordering::SeqCst),
            round + 1,
            "round {round}: the handler ran once per message"
        );
    }
    assert_eq!(db.count("effects").await, 5);
    db.cleanup().await;
}

#[tokio::test]
async fn a_concurrent_delivery_runs_the_handler_after_the_first_one_failed() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    effects_table(&db).await;
    let inbox = Inbox::new(&outbox, "billing");
    let id = Uuid::now_v7();
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();

    let failing = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            inbox
                .process(id, move |_tx| {
                    Box::pin(async move {
                        let _ = entered_tx.send(());
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        Err::<(), _>("boom")
                    })
                })
                .await
        })
    };
    entered_rx.await.expect("the first handler started");
    // This delivery waits on the first one's uncommitted id, then runs when it rolls back.
    let second = apply(&inbox, id, "second").await;
    assert!(matches!(
        failing.await.expect("task"),
        Err(InboxError::Handler("boom"))
    ));
    assert_eq!(second, Processed::Handled(1));
    assert_eq!(db.count("effects").await, 1);
    db.cleanup().await;
}
