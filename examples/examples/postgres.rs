//! The outbox on PostgreSQL: a business change and its event commit together, a failed
//! transaction leaves neither behind. (The service-free tour is the `quickstart` example.)
//!
//! Run it with `eval "$(scripts/services.sh)" && cargo run -p outbox-examples --example postgres`
//! (PostgreSQL from `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`).

use outbox::sqlx;
use outbox::{Outbox, OutboxEvent, OutboxTx, destinations, transactional_outbox};

destinations! { ORDER_EVENTS = "orders.events"; }

/// Event type `OrderConfirmed`, to `orders.events`, keyed by order: the events of one
/// order reach the broker in the order they were committed.
#[derive(Debug, serde::Serialize, OutboxEvent)]
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

/// Confirms an order: the status change and the `OrderConfirmed` event are one
/// transaction. The macro begins it (you call `confirm_order(&outbox, id)`), commits it
/// with the events on `Ok` and rolls it back on `Err`.
#[transactional_outbox]
async fn confirm_order(tx: &mut OutboxTx<'_>, order_id: i64) -> Result<(), OrderError> {
    let total_cents: Option<i64> = sqlx::query_scalar(
        "UPDATE quickstart.orders SET status = 'confirmed' WHERE id = $1 RETURNING total_cents",
    )
    .bind(order_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(total_cents) = total_cents else {
        return Err(OrderError::NotFound(order_id)); // rolled back: no event
    };
    tx.emit(OrderConfirmed {
        order_id,
        total_cents,
    })?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::PgPool::connect(&url).await?;
    let outbox = Outbox::builder(pool.clone())
        .table("quickstart.outbox")
        .build()?;
    outbox.migrate().await?;
    println!("1. migrated: outbox tables ready in schema `quickstart`");

    sqlx::query("CREATE TABLE IF NOT EXISTS quickstart.orders (id bigint PRIMARY KEY, status text NOT NULL, total_cents bigint NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO quickstart.orders VALUES (1, 'new', 4200) ON CONFLICT (id) DO UPDATE SET status = 'new'")
        .execute(&pool)
        .await?;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM quickstart.outbox")
        .fetch_one(&pool)
        .await?;

    confirm_order(&outbox, 1).await?;
    println!(
        "2. confirmed order 1: status updated and OrderConfirmed written in the same transaction"
    );

    match confirm_order(&outbox, 999).await {
        Err(OrderError::NotFound(id)) => {
            println!("3. order {id} does not exist: transaction rolled back, no event written")
        }
        other => return Err(format!("expected NotFound, got {other:?}").into()),
    }

    let rows: Vec<(i64, String, String, Option<String>, String)> = sqlx::query_as(
        "SELECT seq, event_type, destination, partition_key, convert_from(body, 'UTF8') \
         FROM quickstart.outbox \
         WHERE sent_at IS NULL ORDER BY seq DESC LIMIT 1",
    )
    .fetch_all(&pool)
    .await?;
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM quickstart.outbox")
        .fetch_one(&pool)
        .await?;
    println!(
        "4. the outbox gained {} row(s); newest pending:",
        after - before
    );
    for (seq, event_type, destination, key, payload) in rows {
        println!(
            "   #{seq} {event_type} -> {destination} key={} {payload}",
            key.unwrap_or_default()
        );
    }
    println!("   a relay publishes pending rows to the broker and marks them sent.");
    Ok(())
}
