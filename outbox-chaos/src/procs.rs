//! The rig's child processes: a relay, and a consumer with the inbox. Each is what a user
//! would run, built on the public API only; the rig SIGKILLs, SIGSTOPs and restarts them.
//!
//! `outbox-chaos relay <kafka|nats> <database url> <schema> <broker> <destination> <name> [<wal slot>]`
//! `outbox-chaos consume <kafka|nats> <database url> <schema> <broker> <destination> <group>`
//!
//! For NATS the destination is `<stream>/<subject>`.

use std::str::FromStr;
use std::time::Duration;

use outbox_core::Outbox;
use outbox_core::consumer::{Consumer, Transport};
use outbox_core::inbox::Inbox;
use outbox_core::publisher::Publisher;
use outbox_core::relay::Relay;
use outbox_core::relay::RelayBuilder;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_core::sqlx::{self, PgPool, Postgres};
use outbox_kafka::{KafkaPublisher, KafkaTransport};
use outbox_nats::{NatsPublisher, NatsTransport};

/// The relay's settings in the rig: short timeouts, so that a takeover after a SIGSTOP
/// takes ~15 s (`session_timeout` is at least `2 × publish_timeout + poll + 5 s`).
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// See [`PUBLISH_TIMEOUT`].
pub const SESSION_TIMEOUT: Duration = Duration::from_millis(15_200);

/// The payload of every event: its key and number, padded.
#[derive(Debug, serde::Deserialize)]
pub struct Tick {
    /// The key.
    pub key: String,
    /// The number within the key.
    pub n: i32,
}

/// A pool on `url` whose connections use `schema`, named `application_name`.
pub async fn pool(url: &str, schema: &str, name: &str, max: u32) -> Result<PgPool, sqlx::Error> {
    let options = PgConnectOptions::from_str(url)?
        .options([("search_path", schema)])
        .application_name(name);
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
}

async fn pool_until_up(url: &str, schema: &str, name: &str, max: u32) -> PgPool {
    loop {
        match pool(url, schema, name, max).await {
            Ok(pool) => return pool,
            Err(e) => {
                eprintln!("{name}: database not reachable yet: {e}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
}

/// Builds a publisher, again every 500 ms while its broker is not there yet (the rig
/// starts relays while it kills and restarts brokers).
async fn until_built<P, E: std::fmt::Display, F: std::future::Future<Output = Result<P, E>>>(
    name: &str,
    build: impl Fn() -> F,
) -> P {
    loop {
        match build().await {
            Ok(p) => return p,
            Err(e) => {
                eprintln!("{name}: broker not ready: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// `relay ...`: runs until killed.
pub async fn relay(args: &[String]) -> Result<(), String> {
    let (args, wal_slot) = match args {
        [rest @ .., slot] if rest.len() == 6 => (rest, Some(slot)),
        _ => (args, None),
    };
    let [broker_kind, url, schema, broker, destination, name] = args else {
        return Err(
            "usage: outbox-chaos relay <kafka|nats> <database url> <schema> <broker> <destination> <name> [<wal slot>]"
                .to_owned(),
        );
    };
    outbox_tests::init_tracing();
    let pool = pool_until_up(url, schema, name, 4).await;
    // WAL mode leaves no `sent_at`: the rig learns what the broker acknowledged from
    // `chaos_acked` (to tell the in-memory broker's loss from ours).
    let acks = wal_slot.map(|_| pool.clone());
    let outbox: Outbox<Postgres> = match wal_slot {
        Some(slot) => Outbox::builder(pool)
            .wal_slot(slot)
            .build()
            .map_err(|e| e.to_string())?,
        None => Outbox::new(pool),
    };
    fn configure<P: Publisher>(
        builder: RelayBuilder<P, Postgres>,
        name: &str,
    ) -> RelayBuilder<P, Postgres> {
        builder
            .application_name(name)
            .poll_interval(Duration::from_millis(200))
            .publish_timeout(PUBLISH_TIMEOUT)
            .session_timeout(SESSION_TIMEOUT)
            .connect_timeout(Duration::from_secs(3))
            .reconnect_delay(Duration::from_millis(200))
            .rebalance_interval(Duration::from_millis(500))
            .backoff(Duration::from_millis(100), Duration::from_secs(2))
            // `OUTBOX_CHAOS_BATCHES_IN_FLIGHT=4`: the side-by-side drain under the faults.
            .batches_in_flight(
                std::env::var("OUTBOX_CHAOS_BATCHES_IN_FLIGHT")
                    .ok()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(1),
            )
    }
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    match broker_kind.as_str() {
        "kafka" => {
            let publisher = until_built(name, || {
                KafkaPublisher::builder(broker.as_str())
                    .skip_catalog_check()
                    .destination(destination.as_str())
                    .delivery_wait(Duration::from_millis(1500))
                    .build()
            })
            .await;
            let publisher = Recorded {
                inner: publisher,
                acks,
            };
            configure(Relay::builder(outbox, publisher), name)
                .build()
                .run(shutdown)
                .await;
        }
        "nats" => {
            let (_, subject) = destination
                .split_once('/')
                .ok_or("the NATS destination is <stream>/<subject>")?;
            let publisher = until_built(name, || {
                NatsPublisher::builder(broker.as_str())
                    .skip_catalog_check()
                    .destination(subject)
                    .ack_timeout(Duration::from_secs(1))
                    .batch_budget(Duration::from_secs(3))
                    .build()
            })
            .await;
            let publisher = Recorded {
                inner: publisher,
                acks,
            };
            configure(Relay::builder(outbox, publisher), name)
                .build()
                .run(shutdown)
                .await;
        }
        other => return Err(format!("unknown broker {other:?}: kafka or nats")),
    }
    Ok(())
}

/// Records, in WAL mode, each event the broker acknowledged into `chaos_acked (key, n,
/// at)` before the relay learns of it (so before the slot is confirmed past it).
struct Recorded<P> {
    inner: P,
    acks: Option<PgPool>,
}

impl<P: Publisher> Publisher for Recorded<P> {
    async fn publish(
        &self,
        batch: &[outbox_core::OutboxRecord],
    ) -> Vec<Result<(), outbox_core::publisher::PublishError>> {
        let results = self.inner.publish(batch).await;
        if let Some(pool) = &self.acks {
            let (keys, ns): (Vec<String>, Vec<i32>) = batch
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_ok())
                .filter_map(|(record, _)| {
                    let tick: Tick = serde_json::from_slice(&record.payload).ok()?;
                    Some((tick.key, tick.n))
                })
                .unzip();
            for _ in 0..50 {
                let recorded = sqlx::query(
                    "INSERT INTO chaos_acked (key, n, at) SELECT k, n, now() FROM unnest($1::text[], $2::int4[]) AS u(k, n)",
                )
                .bind(&keys)
                .bind(&ns)
                .execute(pool)
                .await;
                if recorded.is_ok() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        results
    }

    fn max_publish_time(&self) -> Option<Duration> {
        self.inner.max_publish_time()
    }

    fn max_batches_in_flight(&self) -> usize {
        self.inner.max_batches_in_flight()
    }
}

/// Applies one event: the business effect of the consumer, in the inbox's transaction.
async fn apply(
    conn: &mut sqlx::PgConnection,
    id: uuid::Uuid,
    tick: &Tick,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO chaos_consumed (id, key, n) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(&tick.key)
        .bind(tick.n)
        .execute(conn)
        .await
        .map(drop)
}

/// Records the consumer's counters (the rig reads them for the duplicates figure).
async fn record_stats(pool: &PgPool, group: &str, handled: u64, duplicates: u64) {
    let _ = sqlx::query(
        "INSERT INTO chaos_stats (consumer, pid, handled, duplicates) VALUES ($1, $2, $3, $4)
         ON CONFLICT (consumer, pid) DO UPDATE SET handled = $3, duplicates = $4",
    )
    .bind(group)
    .bind(i64::from(std::process::id()))
    .bind(handled as i64)
    .bind(duplicates as i64)
    .execute(pool)
    .await;
}

/// `consume ...`: runs until killed (or its consumer stops, with an error).
pub async fn consume(args: &[String]) -> Result<(), String> {
    let [broker_kind, url, schema, broker, destination, group] = args else {
        return Err(
            "usage: outbox-chaos consume <kafka|nats> <database url> <schema> <broker> <destination> <group>"
                .to_owned(),
        );
    };
    outbox_tests::init_tracing();
    let pool = pool_until_up(url, schema, "chaos-consumer", 4).await;
    let outbox: Outbox<Postgres> = Outbox::new(pool.clone());
    let inbox = Inbox::new(&outbox, group.as_str());
    match broker_kind.as_str() {
        "kafka" => {
            let mut builder = KafkaTransport::builder(broker.as_str(), group.as_str())
                .topic(destination.as_str());
            for (k, v) in [
                ("session.timeout.ms", "3000"),
                ("heartbeat.interval.ms", "500"),
                ("auto.commit.interval.ms", "1000"),
            ] {
                builder = builder.set(k, v);
            }
            // Unchecked: a consumer restarted while the rig holds the broker down waits for it.
            let transport = builder.build_unchecked().map_err(|e| e.to_string())?;
            consume_with(&pool, group, transport, inbox).await
        }
        "nats" => {
            let (stream, _) = destination
                .split_once('/')
                .ok_or("the NATS destination is <stream>/<subject>")?;
            // One message unacknowledged at a time: JetStream redelivers a crashed
            // consumer's messages after `AckWait`, and a later message of the same key
            // must not overtake them meanwhile.
            let transport = NatsTransport::builder(broker.as_str(), stream, group.as_str())
                .ack_wait(Duration::from_secs(5))
                .max_ack_pending(1)
                .build()
                .await
                .map_err(|e| e.to_string())?;
            consume_with(&pool, group, transport, inbox).await
        }
        other => Err(format!("unknown broker {other:?}: kafka or nats")),
    }
}

/// Runs the rig's consumer on `transport` until it ends, recording its counters.
async fn consume_with<T: Transport>(
    pool: &PgPool,
    group: &str,
    transport: T,
    inbox: Inbox<Postgres>,
) -> Result<(), String> {
    // Below the pool's four connections.
    let consumer = Consumer::builder(transport, inbox)
        .concurrency(2)
        .on_event_type::<Tick, _>("Tick", |tx, msg| {
            Box::pin(async move { Ok(apply(tx, msg.id, &msg.event).await?) })
        })
        .build()
        .map_err(|e| e.to_string())?
        .spawn();
    loop {
        let stats = consumer.stats();
        record_stats(pool, group, stats.handled, stats.duplicates).await;
        if consumer.is_finished() {
            return consumer.join().await.map_err(|e| e.to_string());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
