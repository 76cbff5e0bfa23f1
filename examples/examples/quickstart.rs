//! The whole outbox story in a few seconds, with nothing to install: an SQLite file in a
//! temporary directory and the in-memory publisher stand in for your database and broker.
//!
//! ```sh
//! cargo run -p outbox-examples --example quickstart
//! ```
//!
//! 1. a business transaction changes an order and emits an event: both commit together;
//! 2. a transaction that fails emits nothing;
//! 3. the relay publishes the pending event and marks it sent;
//! 4. a consumer processes it once, and skips a redelivery of the same message.
//!
//! The same code runs on PostgreSQL or MySQL/MariaDB by changing the `Sqlite` type and
//! the URL (see `examples/postgres.rs` and `docs/databases.md`).

use std::time::Duration;

use outbox::inbox::Inbox;
use outbox::publisher::InMemoryPublisher;
use outbox::relay::Relay;
use outbox::sqlx::{self, Sqlite};
use outbox::{Outbox, OutboxEvent, OutboxRecord, OutboxTx, destinations, transactional_outbox};

destinations! {
    /// Everything the order service announces.
    pub ORDER_EVENTS = "orders.events";
}

/// Published when an order is confirmed; keyed by order, so one order's events stay in order.
#[derive(Debug, serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(destination = ORDER_EVENTS, key = order_id)]
struct OrderConfirmed {
    order_id: i64,
    total_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("order {0} does not exist")]
    NotFound(i64),
    #[error(transparent)]
    Outbox(#[from] outbox::Error),
    #[error("order query failed: {0}")]
    Sql(#[from] sqlx::Error),
}

struct OrderService {
    outbox: Outbox<Sqlite>,
}

impl OrderService {
    /// The status change and the `OrderConfirmed` event: one transaction. The macro
    /// begins it, commits on `Ok` and rolls back on `Err`; callers write
    /// `service.confirm_order(id)`.
    #[transactional_outbox(outbox = self.outbox)]
    async fn confirm_order(
        &self,
        tx: &mut OutboxTx<'_, Sqlite>,
        order_id: i64,
    ) -> Result<(), OrderError> {
        let total_cents: Option<i64> = sqlx::query_scalar(
            "UPDATE orders SET status = 'confirmed' WHERE id = ? RETURNING total_cents",
        )
        .bind(order_id)
        .fetch_optional(&mut **tx)
        .await?;
        let total_cents = total_cents.ok_or(OrderError::NotFound(order_id))?;
        tx.emit(OrderConfirmed {
            order_id,
            total_cents,
        })?;
        Ok(())
    }
}

/// The consuming side: applies each message once. [`Inbox::process`] records the
/// message id in the processed-messages table in the same transaction as the
/// consumer's own change, so a redelivery finds it there and the handler does not run.
async fn consume(
    inbox: &Inbox<Sqlite>,
    message: &OutboxRecord,
) -> Result<bool, Box<dyn std::error::Error>> {
    let event: OrderConfirmed = serde_json::from_slice(&message.payload)?;
    let outcome = inbox
        .process(message.id, |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO shipments (order_id) VALUES (?)")
                    .bind(event.order_id)
                    .execute(&mut **tx)
                    .await
            })
        })
        .await?;
    Ok(!outcome.is_duplicate())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("outbox-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("shop.db");
    let outbox = Outbox::open(file.to_str().ok_or("temp dir is not UTF-8")?).await?;
    outbox.migrate().await?;
    let db = outbox.pool().clone();
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL, total_cents INTEGER NOT NULL)")
        .execute(&db)
        .await?;
    sqlx::query("CREATE TABLE shipments (order_id INTEGER NOT NULL)")
        .execute(&db)
        .await?;
    sqlx::query("INSERT INTO orders VALUES (1, 'new', 4200)")
        .execute(&db)
        .await?;
    println!(
        "0. Set up an SQLite database at {} with the outbox tables and an `orders` table holding order 1.",
        file.display()
    );

    let service = OrderService {
        outbox: outbox.clone(),
    };
    service.confirm_order(1).await?;
    let status: String = sqlx::query_scalar("SELECT status FROM orders WHERE id = 1")
        .fetch_one(&db)
        .await?;
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        .fetch_one(&db)
        .await?;
    println!(
        "1. Confirmed order 1: its status is now '{status}', and {pending} OrderConfirmed event waits in the outbox. Both were written by one transaction."
    );

    match service.confirm_order(999).await {
        Err(OrderError::NotFound(id)) => {
            let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
                .fetch_one(&db)
                .await?;
            println!(
                "2. Tried to confirm order {id}, which does not exist: the transaction rolled back and emitted nothing (the outbox still holds {pending} event)."
            );
        }
        other => return Err(format!("expected NotFound, got {other:?}").into()),
    }

    let broker = InMemoryPublisher::new();
    let relay = Relay::builder(outbox.clone(), broker.clone()).spawn();
    if !broker.wait_for(1, Duration::from_secs(5)).await {
        return Err("the relay did not publish within 5 s".into());
    }
    relay.shutdown().await;
    let message = broker.published().remove(0);
    let sent: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL")
        .fetch_one(&db)
        .await?;
    println!(
        "3. The relay published {} to '{}' (key {}, message id {}) and marked {sent} row sent.",
        message.event_type,
        message.destination,
        message.partition_key.as_deref().unwrap_or("-"),
        message.id
    );
    println!("   payload: {}", message.payload);

    let inbox = Inbox::new(&outbox, "shipping");
    let first = consume(&inbox, &message).await?;
    println!(
        "4. The shipping consumer received it: {}.",
        if first {
            "first time, so it created a shipment"
        } else {
            "already seen?!"
        }
    );
    let again = consume(&inbox, &message).await?;
    let shipments: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments")
        .fetch_one(&db)
        .await?;
    println!(
        "5. The broker delivered the same message again (at-least-once): {}; there is {shipments} shipment.",
        if again {
            "processed twice?!"
        } else {
            "the consumer found its id in outbox_processed and skipped it"
        }
    );
    if !first || again || shipments != 1 {
        return Err("the consumer did not deduplicate".into());
    }

    outbox.pool().close().await;
    std::fs::remove_dir_all(&dir)?;
    println!(
        "Done. Next: `cargo run -p outbox-examples --example postgres` (needs PostgreSQL), docs/databases.md."
    );
    Ok(())
}
