//! The source article's scenario with real parts: an order service confirms orders and
//! announces `OrderConfirmed` through the outbox (PostgreSQL); the relay publishes to a
//! Kafka-protocol broker; an inventory service consumes the events idempotently and
//! reserves stock. `cargo run -p outbox-examples --example orders` runs it; the test in
//! `examples/tests/orders.rs` runs the same flow in CI.

use std::time::{Duration, Instant};

use outbox::admin::Admin;
use outbox::consumer::{Consumer, Policy};
use outbox::inbox::Inbox;
use outbox::kafka::{KafkaPublisher, KafkaTransport};
use outbox::relay::{Relay, RelayHandle};
use outbox::{Outbox, OutboxEvent, OutboxTx, destinations, sqlx, transactional_outbox};
use uuid::Uuid;

destinations! {
    /// Everything the order service announces.
    pub ORDER_EVENTS = "orders.events";
}

/// An order was confirmed: the inventory reserves its stock.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, schemars::JsonSchema, OutboxEvent)]
#[outbox(destination = ORDER_EVENTS, key = order_id)]
pub struct OrderConfirmed {
    /// The order.
    pub order_id: Uuid,
    /// What was ordered.
    pub sku: String,
    /// How many.
    pub quantity: i32,
}

/// The `info` and `servers` of the order service's event contract.
pub fn contract_info() -> outbox::contract::Info {
    outbox::contract::Info::new("orders", "1.0.0")
        .description("The events the order service announces through its outbox.")
        .server("local", "127.0.0.1:9092", "kafka")
}

/// The order service's event contract (AsyncAPI 3.0), from the event types in the
/// catalog. `cargo run -p outbox-examples --example orders -- --asyncapi orders.yaml`
/// writes it; `examples/contracts/orders.asyncapi.json` is the committed baseline that
/// `examples/tests/contract.rs` checks changes against.
pub fn contract() -> Result<outbox::contract::Document, outbox::Error> {
    outbox::contract::asyncapi(&contract_info())
}

/// Writes [`contract`] to `path`: YAML for a `.yaml`/`.yml` file, JSON otherwise.
pub fn write_contract(path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let document = contract()?;
    let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
    let text = if yaml {
        document.to_yaml()
    } else {
        document.to_json()
    };
    std::fs::write(path, text)?;
    Ok(())
}

/// What can go wrong in the order service.
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    /// No such order (or not in the `new` state).
    #[error("order {0} does not exist or is not new")]
    NotFound(Uuid),
    /// The outbox failed.
    #[error(transparent)]
    Outbox(#[from] outbox::Error),
    /// A query failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The order service.
#[derive(Debug, Clone)]
pub struct OrderService {
    outbox: Outbox,
}

impl OrderService {
    /// Confirms an order. The status change and `OrderConfirmed` commit together; an
    /// unknown order rolls back and announces nothing.
    #[transactional_outbox(outbox = self.outbox)]
    pub async fn confirm_order(
        &self,
        tx: &mut OutboxTx<'_>,
        order_id: Uuid,
    ) -> Result<(), OrderError> {
        let row: Option<(String, i32)> =
            sqlx::query_as("UPDATE orders SET status = 'confirmed' WHERE id = $1 AND status = 'new' RETURNING sku, quantity")
                .bind(order_id)
                .fetch_optional(&mut **tx)
                .await?;
        let (sku, quantity) = row.ok_or(OrderError::NotFound(order_id))?;
        tx.emit(OrderConfirmed {
            order_id,
            sku,
            quantity,
        })?;
        Ok(())
    }
}

/// Where to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// PostgreSQL.
    pub database_url: String,
    /// The Kafka-protocol broker.
    pub brokers: String,
    /// Orders to place and confirm.
    pub orders: usize,
}

/// What happened, for the summary line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Orders confirmed (each wrote one event).
    pub confirmed: usize,
    /// Confirmations refused (unknown order): no event.
    pub refused: usize,
    /// Messages the relay published.
    pub published: u64,
    /// Orders whose stock the inventory reserved (distinct orders).
    pub reserved: i64,
    /// Redeliveries the inventory skipped.
    pub duplicates_skipped: u64,
    /// Units still available of the demo SKU.
    pub stock_left: i64,
}

/// Runs the whole scenario in a schema of its own (dropped at the end) and returns what
/// happened. `log` receives one line per step.
pub async fn run(
    config: &Config,
    mut log: impl FnMut(&str),
) -> Result<Summary, Box<dyn std::error::Error + Send + Sync>> {
    let schema = format!("orders_demo_{}", Uuid::now_v7().simple());
    let admin_pool = sqlx::PgPool::connect(&config.database_url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&admin_pool)
        .await?;
    let result = scenario(config, &schema, &mut log).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(&admin_pool)
    .await?;
    result
}

async fn scenario(
    config: &Config,
    schema: &str,
    log: &mut impl FnMut(&str),
) -> Result<Summary, Box<dyn std::error::Error + Send + Sync>> {
    let options: sqlx::postgres::PgConnectOptions = config.database_url.parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.options([("search_path", schema)]))
        .await?;
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE orders (id uuid PRIMARY KEY, sku text NOT NULL, quantity int NOT NULL, status text NOT NULL);
         CREATE TABLE stock (sku text PRIMARY KEY, available int NOT NULL, reserved int NOT NULL DEFAULT 0);
         CREATE TABLE reservations (order_id uuid PRIMARY KEY, sku text NOT NULL, quantity int NOT NULL);
         INSERT INTO stock (sku, available) VALUES ('BOOK-1', 1000000);",
    )
    .execute(&pool)
    .await?;
    log(&format!(
        "database ready (schema {schema}); stock: BOOK-1 x 1000000"
    ));

    // The relay's publisher, first: it creates the topic the consumer's `build` checks.
    let publisher = KafkaPublisher::builder(&config.brokers)
        .create_missing_topics(4, 1)
        .build()
        .await?;

    // Inventory service: reserves stock, once per order, in one transaction with the
    // record of the message id. Orders of other runs (the broker may still hold them)
    // are not in this schema's `orders` table and are ignored.
    let transport = KafkaTransport::builder(&config.brokers, format!("inventory-{schema}"))
        .topic(ORDER_EVENTS.as_str())
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .build()
        .await?;
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "inventory"))
        .on::<OrderConfirmed, _>(|tx, msg| {
            Box::pin(async move {
                let ours: Option<Uuid> = sqlx::query_scalar("SELECT id FROM orders WHERE id = $1")
                    .bind(msg.event.order_id)
                    .fetch_optional(&mut **tx)
                    .await?;
                if ours.is_none() {
                    return Ok(());
                }
                sqlx::query("UPDATE stock SET available = available - $2, reserved = reserved + $2 WHERE sku = $1")
                    .bind(&msg.event.sku)
                    .bind(msg.event.quantity)
                    .execute(&mut **tx)
                    .await?;
                sqlx::query("INSERT INTO reservations (order_id, sku, quantity) VALUES ($1, $2, $3)")
                    .bind(msg.event.order_id)
                    .bind(&msg.event.sku)
                    .bind(msg.event.quantity)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .on_unknown_event_type(Policy::Skip)
        // The demo topic is shared: the README's example publishes its own
        // `OrderConfirmed` (an integer id) to `orders.events`, and this consumer reads
        // the topic from its start. Not ours, so skipped (logged and counted); a real
        // service would dead-letter it instead (`Policy::DeadLetter` with a dead-letter
        // topic). Before, it stopped the consumer after the first 10 orders (a red CI).
        .on_undecodable(Policy::Skip)
        .build()?
        .spawn();

    // Order service + relay.
    let relay: RelayHandle = Relay::builder(outbox.clone(), publisher).spawn();
    let service = OrderService {
        outbox: outbox.clone(),
    };

    let ids: Vec<Uuid> = (0..config.orders).map(|_| Uuid::now_v7()).collect();
    sqlx::query("INSERT INTO orders (id, sku, quantity, status) SELECT id, 'BOOK-1', 2, 'new' FROM unnest($1::uuid[]) AS id")
        .bind(&ids)
        .execute(&pool)
        .await?;
    log(&format!("placed {} orders of 2 x BOOK-1", ids.len()));
    for id in &ids {
        service.confirm_order(*id).await?;
    }
    log(&format!(
        "confirmed {} orders: each status change and its OrderConfirmed in one transaction",
        ids.len()
    ));
    let unknown = Uuid::now_v7();
    let refused = match service.confirm_order(unknown).await {
        Err(OrderError::NotFound(_)) => 1,
        other => {
            return Err(format!("confirming an unknown order should fail, got {other:?}").into());
        }
    };
    log("confirming an unknown order failed: rolled back, no event written");

    let reserved = match wait_until(Duration::from_secs(120), || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM reservations")
            .fetch_one(&pool)
            .await?;
        Ok((n >= ids.len() as i64).then_some(n))
    })
    .await
    {
        Ok(n) => n,
        Err(e) => {
            // Say where the events stopped: in the outbox, or between broker and consumer.
            let (pending, reserved): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM outbox WHERE sent_at IS NULL), \
                        (SELECT count(*) FROM reservations)",
            )
            .fetch_one(&pool)
            .await?;
            return Err(format!(
                "waiting for {} reservations: {e}; {reserved} reserved, {pending} events still \
                 in the outbox; relay {:?}; consumer {:?}",
                ids.len(),
                relay.stats(),
                consumer.stats()
            )
            .into());
        }
    };
    log(&format!(
        "relay published them to {}; the inventory reserved stock for {reserved} orders",
        ORDER_EVENTS
    ));

    // A redelivery (an operator replays the first message): the inventory skips it.
    let first: Uuid = sqlx::query_scalar("SELECT id FROM outbox ORDER BY seq LIMIT 1")
        .fetch_one(&pool)
        .await?;
    let before = consumer.stats().duplicates;
    Admin::new(outbox.clone()).replay(&[first]).await?;
    wait_until(Duration::from_secs(60), || async {
        Ok((consumer.stats().duplicates > before).then_some(()))
    })
    .await?;
    log("replayed one message: the inventory recognised its id and skipped it");

    let published = relay.stats().published;
    relay.shutdown().await;
    let duplicates_skipped = consumer.stats().duplicates;
    consumer.shutdown().await?;
    let (reserved, stock_left): (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM reservations), (SELECT available::bigint FROM stock WHERE sku = 'BOOK-1')")
            .fetch_one(&pool)
            .await?;
    pool.close().await;
    Ok(Summary {
        confirmed: ids.len(),
        refused,
        published,
        reserved,
        duplicates_skipped,
        stock_left,
    })
}

async fn wait_until<T, F, Fut>(
    timeout: Duration,
    mut check: F,
) -> Result<T, Box<dyn std::error::Error + Send + Sync>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Box<dyn std::error::Error + Send + Sync>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(format!("gave up after {timeout:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
