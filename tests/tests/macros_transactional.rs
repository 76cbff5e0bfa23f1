//! `#[transactional_outbox]`: commit on `Ok`, roll back on `Err` and on panic, joined
//! transactions, free functions and methods of a generic service.

use outbox_core::sqlx::{self, Row};
use outbox_core::{Outbox, OutboxEvent, OutboxTx, transactional_outbox};
use outbox_tests::TestDb;
use serde::Serialize;

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "orders.events", key = order_id)]
struct OrderConfirmed {
    order_id: i64,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "billing.events", key = order_id)]
struct InvoiceRequested {
    order_id: i64,
    amount: i64,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(destination = "audit")]
enum Audit {
    Confirmed { order_id: i64 },
}

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("order {0} is not new")]
    NotNew(i64),
    #[error(transparent)]
    Outbox(#[from] outbox_core::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

async fn orders_table(db: &TestDb) {
    sqlx::query("CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL)")
        .execute(&db.pool)
        .await
        .expect("create orders");
    sqlx::query("INSERT INTO orders SELECT g, 'new' FROM generate_series(1, 10) g")
        .execute(&db.pool)
        .await
        .expect("seed orders");
}

async fn status(db: &TestDb, order_id: i64) -> String {
    sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(&db.pool)
        .await
        .expect("status")
}

/// Rows of the outbox as (event_type, partition_key), in seq order.
async fn rows(db: &TestDb) -> Vec<(String, Option<String>)> {
    sqlx::query("SELECT event_type, partition_key FROM outbox ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .expect("rows")
        .iter()
        .map(|r| (r.get("event_type"), r.get("partition_key")))
        .collect()
}

/// How many statements wrote the outbox rows (one command id per statement) and how
/// many transactions (one `xmin` per transaction).
async fn statements_and_transactions(db: &TestDb) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(DISTINCT cmin::text::int), count(DISTINCT xmin::text::bigint) FROM outbox",
    )
    .fetch_one(&db.pool)
    .await
    .expect("inspect rows")
}

/// Confirms an order: the update and the event commit together.
#[transactional_outbox]
async fn confirm_order(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), OrderError> {
    let done =
        sqlx::query("UPDATE orders SET status = 'confirmed' WHERE id = $1 AND status = 'new'")
            .bind(order_id)
            .execute(&mut **tx)
            .await?;
    if done.rows_affected() == 0 {
        return Err(OrderError::NotNew(order_id));
    }
    tx.emit(OrderConfirmed { order_id })?;
    Ok(())
}

/// Joins: calls another transactional function's `_in_tx` companion, then emits more.
#[transactional_outbox]
async fn confirm_and_bill(
    tx: &mut OutboxTx<'_>,
    order_id: i64,
    amount: i64,
) -> Result<i64, OrderError> {
    let before = tx.pending().len();
    confirm_order_in_tx(tx, order_id).await?;
    tx.emit(InvoiceRequested { order_id, amount })?;
    tx.emit(Audit::Confirmed { order_id })?;
    assert_eq!(
        tx.pending().len(),
        before + 3,
        "nothing flushed or committed by the joined call"
    );
    Ok(amount * 2)
}

#[transactional_outbox]
async fn confirm_then_panic(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), OrderError> {
    confirm_order_in_tx(tx, order_id).await?;
    tx.flush().await?; // written inside the transaction, which the panic must undo
    panic!("boom after writing order {order_id}");
}

#[tokio::test]
async fn ok_commits_the_change_and_the_event() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    confirm_order(&outbox, 1).await.expect("confirmed");
    assert_eq!(status(&db, 1).await, "confirmed");
    assert_eq!(
        rows(&db).await,
        vec![("OrderConfirmed".into(), Some("1".into()))]
    );
    db.cleanup().await;
}

#[tokio::test]
async fn err_rolls_back_and_returns_the_error_unchanged() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    confirm_order(&outbox, 2).await.expect("first time");
    // Order 2 is no longer new: the body fails after nothing; order 3 fails after its
    // update and emit, inside a joined call.
    let err = confirm_order(&outbox, 2).await.expect_err("not new");
    assert!(matches!(err, OrderError::NotNew(2)), "{err:?}");

    #[transactional_outbox]
    async fn confirm_two(tx: &mut OutboxTx<'_>, a: i64, b: i64) -> Result<(), OrderError> {
        confirm_order_in_tx(tx, a).await?;
        confirm_order_in_tx(tx, b).await
    }
    let err = confirm_two(&outbox, 3, 2).await.expect_err("2 is not new");
    assert!(matches!(err, OrderError::NotNew(2)), "{err:?}");
    assert_eq!(status(&db, 3).await, "new", "order 3's update is undone");
    assert_eq!(rows(&db).await.len(), 1, "only the first commit's event");
    db.cleanup().await;
}

#[tokio::test]
async fn panic_rolls_back_and_propagates() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    let handle = {
        let outbox = outbox.clone();
        tokio::spawn(async move { confirm_then_panic(&outbox, 4).await })
    };
    let err = handle.await.expect_err("the task panicked");
    assert!(err.is_panic(), "{err:?}");
    let payload = err.into_panic();
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        msg, "boom after writing order 4",
        "the panic propagates as is"
    );
    // The dropped transaction is rolled back when its connection goes back to the pool.
    assert_eq!(db.count("outbox").await, 0, "no event survives a panic");
    assert_eq!(status(&db, 4).await, "new", "the business change is undone");
    // And the pool is still usable.
    confirm_order(&outbox, 4)
        .await
        .expect("works after the panic");
    db.cleanup().await;
}

#[tokio::test]
async fn joined_transaction_writes_once_in_emit_order() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    assert_eq!(confirm_and_bill(&outbox, 5, 21).await.expect("ok"), 42);
    assert_eq!(
        rows(&db).await,
        vec![
            ("OrderConfirmed".into(), Some("5".into())),
            ("InvoiceRequested".into(), Some("5".into())),
            ("Confirmed".into(), None),
        ],
        "several event types arrive in emit order"
    );
    assert_eq!(
        statements_and_transactions(&db).await,
        (1, 1),
        "one INSERT, one commit"
    );
    assert_eq!(status(&db, 5).await, "confirmed");

    // The caller can own the transaction too: the `_in_tx` companions join it.
    let mut tx = outbox.begin().await.expect("begin");
    confirm_order_in_tx(&mut tx, 6).await.expect("joined");
    confirm_and_bill_in_tx(&mut tx, 7, 1).await.expect("joined");
    assert_eq!(tx.pending().len(), 4);
    tx.rollback().await.expect("rollback");
    assert_eq!(status(&db, 6).await, "new");
    assert_eq!(status(&db, 7).await, "new");
    assert_eq!(
        db.count("outbox").await,
        3,
        "the rolled-back joins wrote nothing"
    );
    db.cleanup().await;
}

/// A service generic over its repository, with the outbox handle as a field.
struct OrderService<R> {
    outbox: Outbox,
    repo: R,
}

trait Repo: Send + Sync {
    fn status_for(&self, order_id: i64) -> &'static str;
}

struct Confirming;
impl Repo for Confirming {
    fn status_for(&self, _: i64) -> &'static str {
        "confirmed"
    }
}

impl<R: Repo> OrderService<R> {
    /// Sets the order's status as the repository says and emits the event.
    #[transactional_outbox(outbox = self.outbox)]
    pub async fn confirm(&self, tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), OrderError> {
        sqlx::query("UPDATE orders SET status = $2 WHERE id = $1 AND status = 'new'")
            .bind(order_id)
            .bind(self.repo.status_for(order_id))
            .execute(&mut **tx)
            .await?;
        tx.emit(OrderConfirmed { order_id })?;
        Ok(())
    }

    /// Joins `confirm` twice and fails if asked to, with generics and a where clause.
    #[transactional_outbox(outbox = self.outbox)]
    pub async fn confirm_many<I>(
        &self,
        tx: &mut OutboxTx<'_>,
        ids: I,
        fail: bool,
    ) -> Result<usize, OrderError>
    where
        I: IntoIterator<Item = i64> + Send,
        I::IntoIter: Send,
    {
        let mut n = 0;
        for id in ids {
            self.confirm_in_tx(tx, id).await?;
            n += 1;
        }
        if fail {
            return Err(OrderError::NotNew(-1));
        }
        Ok(n)
    }

    /// `&mut self`, and a handle reached through a method call.
    #[transactional_outbox(outbox = self.outbox())]
    async fn bump(&mut self, tx: &mut OutboxTx<'_>) -> Result<(), OrderError> {
        tx.emit(Audit::Confirmed { order_id: 0 })?;
        Ok(())
    }

    fn outbox(&self) -> &Outbox {
        &self.outbox
    }
}

#[tokio::test]
async fn methods_of_a_generic_service() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    orders_table(&db).await;
    let mut service = OrderService {
        outbox: outbox.clone(),
        repo: Confirming,
    };
    service.confirm(1).await.expect("confirm");
    assert_eq!(status(&db, 1).await, "confirmed");
    assert_eq!(db.count("outbox").await, 1);

    let err = service
        .confirm_many(vec![2, 3], true)
        .await
        .expect_err("asked to fail");
    assert!(matches!(err, OrderError::NotNew(-1)), "{err:?}");
    assert_eq!(status(&db, 2).await, "new", "rolled back");
    assert_eq!(db.count("outbox").await, 1);

    sqlx::query("TRUNCATE outbox")
        .execute(&db.pool)
        .await
        .expect("truncate");
    assert_eq!(service.confirm_many([2, 3, 4], false).await.expect("ok"), 3);
    assert_eq!(
        rows(&db).await,
        vec![
            ("OrderConfirmed".into(), Some("2".into())),
            ("OrderConfirmed".into(), Some("3".into())),
            ("OrderConfirmed".into(), Some("4".into())),
        ]
    );
    assert_eq!(statements_and_transactions(&db).await, (1, 1));

    service.bump().await.expect("bump");
    assert_eq!(db.count("outbox").await, 4);

    // The wrapper's future is `Send`: it can be spawned.
    let service = std::sync::Arc::new(service);
    let s = service.clone();
    tokio::spawn(async move { s.confirm(8).await })
        .await
        .expect("join")
        .expect("confirm");
    assert_eq!(status(&db, 8).await, "confirmed");
    db.cleanup().await;
}

#[tokio::test]
async fn failing_begin_is_converted_into_the_error_type() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_millis(300))
        .connect_lazy("postgres://app@127.0.0.1:1/app")
        .expect("lazy pool");
    let outbox = Outbox::new(pool);
    let err = confirm_order(&outbox, 1).await.expect_err("unreachable");
    assert!(
        matches!(
            err,
            OrderError::Outbox(outbox_core::Error::Unavailable { .. })
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn failing_commit_rolls_back_and_is_converted() {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone()); // not migrated: the outbox INSERT fails
    orders_table(&db).await;
    let err = confirm_order(&outbox, 9)
        .await
        .expect_err("no outbox table");
    assert!(
        matches!(
            err,
            OrderError::Outbox(outbox_core::Error::SchemaMissing { .. })
        ),
        "{err:?}"
    );
    assert_eq!(status(&db, 9).await, "new", "the change is not committed");
    db.cleanup().await;
}

/// WAL mode (`docs/wal.md`): the same macros, events through the WAL. `Ok` commits the
/// change and its events; `Err` and a panic after a `flush` (the event already written
/// into the WAL inside the transaction) leave nothing; a joined transaction commits its
/// events together, in emit order. Whatever leaked would reach the relay before the last
/// commit's event, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_mode_events_reach_the_stream_iff_the_transaction_commits() {
    use outbox_core::publisher::InMemoryPublisher;
    use outbox_core::relay::Relay;
    let db = TestDb::new().await;
    let (outbox, slot) = outbox_tests::wal::outbox_in(&db).await;
    orders_table(&db).await;
    confirm_order(&outbox, 1).await.expect("confirmed");
    assert!(matches!(
        confirm_order(&outbox, 1).await,
        Err(OrderError::NotNew(1))
    ));
    let panicked = {
        let outbox = outbox.clone();
        tokio::spawn(async move { confirm_then_panic(&outbox, 4).await })
    };
    assert!(panicked.await.expect_err("panicked").is_panic());
    assert_eq!(confirm_and_bill(&outbox, 5, 21).await.expect("billed"), 42);
    confirm_order(&outbox, 4)
        .await
        .expect("works after the panic");

    let publisher = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), publisher.clone()).spawn();
    let wanted = [
        ("OrderConfirmed", Some("1")),
        ("OrderConfirmed", Some("5")),
        ("InvoiceRequested", Some("5")),
        ("Confirmed", None),
        ("OrderConfirmed", Some("4")),
    ];
    assert!(
        publisher
            .wait_for(wanted.len(), std::time::Duration::from_secs(30))
            .await,
        "the committed events arrive"
    );
    let got: Vec<(String, Option<String>)> = publisher
        .published()
        .iter()
        .map(|r| (r.event_type.clone(), r.partition_key.clone()))
        .collect();
    let want: Vec<(String, Option<String>)> = wanted
        .iter()
        .map(|(t, k)| ((*t).to_owned(), k.map(str::to_owned)))
        .collect();
    assert_eq!(got, want, "exactly the committed events, in commit order");
    assert_eq!(status(&db, 4).await, "confirmed");
    assert_eq!(db.count("outbox").await, 0, "WAL mode writes no outbox row");
    relay.shutdown().await;
    outbox_tests::wal::cleanup(db, &slot).await;
}
