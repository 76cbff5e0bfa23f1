//! Scenario `wal` (issue #15): PostgreSQL WAL mode against its ceilings and table mode,
//! in the same run. Needs `wal_level = logical` (`scripts/services.sh` sets it).
//!
//! - drain: (a) the WAL relay over a backlog of `events` messages in the slot, (b) the
//!   raw logical-decoding ceiling (a second slot over the same WAL, read with
//!   `pgwire-replication`, counting messages, no broker), (c) the table relay over the
//!   same number of rows (and the raw produce ceiling with `--broker`);
//! - write: a business transaction (one UPDATE) with 0, 1 and 10 events, interleaved in
//!   table and WAL mode.

use std::str::FromStr;
use std::time::{Duration, Instant};

use outbox_core::relay::Relay;
use outbox_core::sqlx;
use outbox_core::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use outbox_core::{Outbox, OutboxMessage};
use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};

use crate::BoxError;
use crate::kafka;
use crate::publisher::CountingPublisher;
use crate::report::{Report, Target};
use crate::scenarios::sized;
use crate::setup::{Args, BenchDb, quantile};
use crate::trusted_sql;

/// Events per filling transaction.
const PER_COMMIT: u64 = 100;

/// A schema of its own with a WAL-mode outbox and its slot (`bench_<pid>_<random>`).
///
/// A slot nobody reads keeps every WAL segment after it: [`WalDb::drop`] removes this
/// one (and the scenario's extra slots) whether the scenario succeeded or not, and a new
/// `WalDb` first removes the slots of bench processes that no longer run (killed, or
/// from before this cleanup: such a slot, left by a failed run, kept 1.9 GiB on a CI
/// machine and turned a doctor test red).
pub(crate) struct WalDb {
    db: BenchDb,
    pub(crate) outbox: Outbox,
    slot: String,
}

impl WalDb {
    async fn new(args: &Args) -> Result<WalDb, BoxError> {
        Self::with_pool_size(args, 8).await
    }

    pub(crate) async fn with_pool_size(args: &Args, size: u32) -> Result<WalDb, BoxError> {
        let slot = format!(
            "bench_{}_{}",
            std::process::id(),
            &uuid::Uuid::now_v7().simple().to_string()[24..]
        );
        let db = BenchDb::create(args, size, |pool| {
            Outbox::builder(pool).wal_slot(&slot).build()
        })
        .await?;
        drop_stale_slots(db.outbox.pool()).await?;
        Ok(WalDb {
            outbox: db.outbox.clone(),
            db,
            slot,
        })
    }

    pub(crate) async fn drop(self, extra_slots: &[&str]) -> Result<(), BoxError> {
        let pool = self.outbox.pool().clone();
        let mut outcome = Ok(());
        for slot in std::iter::once(self.slot.as_str()).chain(extra_slots.iter().copied()) {
            outcome = outcome.and(drop_slot(&pool, slot).await);
        }
        sqlx::query(trusted_sql(format!(
            "DROP PUBLICATION IF EXISTS \"{}\"",
            self.slot
        )))
        .execute(&pool)
        .await?;
        outcome.and(self.db.drop().await)
    }

    /// `events` messages of this outbox's envelope in the WAL, keys `k0..k{keys}` round
    /// robin, about `payload` bytes each, `PER_COMMIT` per transaction.
    async fn fill(&self, args: &Args, destination: &str) -> Result<(), BoxError> {
        let filler = "x".repeat(args.payload.saturating_sub(60));
        let prefix = format!("outbox:{}", self.slot);
        let mut from = 0;
        while from < args.events {
            let to = (from + PER_COMMIT).min(args.events);
            sqlx::query(
                "SELECT pg_logical_emit_message(true, $1, convert_to(json_build_object(\
                   'v', 2, 'id', gen_random_uuid(), 'type', 'BenchEvent', 'destination', $2::text, \
                   'key', 'k' || (g % $3), 'created_at', now())::text || chr(10) || \
                   json_build_object('n', g, 'key', 'k' || (g % $3), 'filler', $4::text)::text, 'UTF8')) \
                 FROM generate_series($5::bigint, $6::bigint - 1) g",
            )
            .bind(&prefix)
            .bind(destination)
            .bind(i64::try_from(args.keys)?)
            .bind(&filler)
            .bind(i64::try_from(from)?)
            .bind(i64::try_from(to)?)
            .execute(self.outbox.pool())
            .await?;
            from = to;
        }
        Ok(())
    }
}

/// A replication client on `slot`, as the raw ceilings read it.
async fn raw_client(
    args: &Args,
    slot: &str,
    publication: &str,
) -> Result<ReplicationClient, BoxError> {
    let options = PgConnectOptions::from_str(&args.database_url)?;
    let config = ReplicationConfig::new(
        options.get_host(),
        options.get_username(),
        std::env::var("PGPASSWORD").unwrap_or_default(),
        options.get_database().unwrap_or(options.get_username()),
        slot,
        publication,
    )
    .with_port(options.get_port())
    .with_buffer_size(8192);
    Ok(ReplicationClient::connect(config).await?)
}

/// (b): reads `events` messages from `slot` and confirms each commit; events/s.
async fn raw_decoding(args: &Args, slot: &str, publication: &str) -> Result<f64, BoxError> {
    let mut client = raw_client(args, slot, publication).await?;
    let started = Instant::now();
    let mut seen = 0_u64;
    while seen < args.events {
        match client.recv().await? {
            Some(ReplicationEvent::Message { .. }) => seen += 1,
            Some(ReplicationEvent::Commit { end_lsn, .. }) => client.update_applied_lsn(end_lsn),
            Some(_) => {}
            None => return Err("the replication stream ended".into()),
        }
    }
    let rate = seen as f64 / started.elapsed().as_secs_f64();
    client.shutdown().await?;
    Ok(rate)
}

/// Drops `slot` if it exists, waiting (up to 5 s) for a reader that is letting go of it.
async fn drop_slot(pool: &sqlx::PgPool, slot: &str) -> Result<(), BoxError> {
    for _ in 0..100 {
        let active: Option<bool> =
            sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_optional(pool)
                .await?;
        match active {
            None => return Ok(()),
            Some(false) => {
                sqlx::query(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND NOT active",
                )
                .bind(slot)
                .execute(pool)
                .await?;
            }
            Some(true) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    Err(format!("replication slot {slot} is still read after 5 s: drop it by hand").into())
}

/// Drops the slots (and publications) of bench processes that no longer run.
async fn drop_stale_slots(pool: &sqlx::PgPool) -> Result<(), BoxError> {
    let slots: Vec<String> = sqlx::query_scalar(
        "SELECT slot_name::text FROM pg_replication_slots \
         WHERE slot_name LIKE 'bench\\_%' AND NOT active",
    )
    .fetch_all(pool)
    .await?;
    for slot in slots {
        // `bench_<pid>_<random>[_raw|_lat]`; before the pid was in the name,
        // `bench_<random>`, whose second part is no running process either.
        let pid = slot.split('_').nth(1).unwrap_or("");
        if pid.parse::<u32>().is_ok() && std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        eprintln!("dropping replication slot {slot}, left by a bench run that no longer runs");
        drop_slot(pool, &slot).await?;
        sqlx::query(trusted_sql(format!(
            "DROP PUBLICATION IF EXISTS \"{slot}\""
        )))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// The scenario.
pub async fn wal(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let db = WalDb::new(args).await?;
    let raw_slot = format!("{}_raw", db.slot);
    let outcome = wal_in(args, report, &db, &raw_slot).await;
    // The slots go whatever happened: one left behind keeps the server's WAL forever.
    let latency_slot = latency_slot(&db);
    let dropped = db.drop(&[&raw_slot, &latency_slot]).await;
    outcome.and(dropped)
}

fn latency_slot(db: &WalDb) -> String {
    format!("{}_lat", db.slot)
}

async fn wal_in(
    args: &Args,
    report: &mut Report,
    db: &WalDb,
    raw_slot: &str,
) -> Result<(), BoxError> {
    let sink = args
        .broker
        .as_deref()
        .unwrap_or("in-process counting publisher");
    let destination = match &args.broker {
        Some(brokers) => kafka::create_topic(brokers).await?,
        None => "bench.events".to_owned(),
    };
    // A second slot over the same WAL, for the ceiling.
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(raw_slot)
        .execute(db.outbox.pool())
        .await?;
    db.fill(args, &destination).await?;

    let raw = raw_decoding(args, raw_slot, &db.slot).await?;
    report.add(
        "wal",
        "(b) raw logical decoding ceiling (no broker)",
        raw,
        "events/s",
    );
    let mut ceiling = raw;
    if let Some(brokers) = &args.broker {
        let topic = kafka::create_topic(brokers).await?;
        let produce =
            kafka::raw_produce(brokers, &topic, args.events, args.keys, args.payload).await?;
        report.add(
            "wal",
            "(d) raw rdkafka produce ceiling (no database)",
            produce,
            "events/s",
        );
        ceiling = ceiling.min(produce);
    }

    let started = Instant::now();
    let relay = match &args.broker {
        Some(brokers) => sized(
            args,
            Relay::builder(
                db.outbox.clone(),
                kafka::publisher(brokers, &destination).await?,
            ),
        )
        .spawn(),
        None => sized(
            args,
            Relay::builder(db.outbox.clone(), CountingPublisher::default()),
        )
        .spawn(),
    };
    let deadline = started + Duration::from_secs(900);
    while relay.stats().published < args.events {
        if Instant::now() > deadline {
            return Err(format!("the WAL relay published only {}", relay.stats().published).into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let wal_relay = args.events as f64 / started.elapsed().as_secs_f64();
    let stats = relay.stats();
    relay.shutdown().await;
    report.add(
        "wal",
        "(a) WAL relay: messages per publish call",
        stats.published as f64 / stats.batches.max(1) as f64,
        "messages",
    );
    report.add(
        "wal",
        &format!("(a) WAL relay, defaults -> {sink}"),
        wal_relay,
        "events/s",
    );
    let (table_relay, _) = crate::scenarios::relay_drain(args, 1).await?;
    report.add(
        "wal",
        &format!("(c) table relay, defaults -> {sink}"),
        table_relay,
        "events/s",
    );
    report.target(
        "wal",
        "(a) / min(b, d)",
        wal_relay / ceiling,
        Target::AtLeast(0.8),
    );
    report.target(
        "wal",
        "(a) / (c)",
        wal_relay / table_relay,
        Target::AtLeast(1.5),
    );
    write_cost(args, report, db).await?;
    commit_throughput(args, report, db).await?;
    wal_latency(args, report, db).await?;
    Ok(())
}

/// Commit -> broker acknowledgement in WAL mode at `--latency-rate` (1,000 tx/s), then
/// at doubled rates while p99 stays within 100 ms and the writers keep up.
async fn wal_latency(args: &Args, report: &mut Report, db: &WalDb) -> Result<(), BoxError> {
    raw_latency(args, report, db).await?;
    if let Some(brokers) = &args.broker {
        let topic = kafka::create_topic(brokers).await?;
        let ms = kafka::raw_produce_latency(
            brokers,
            &topic,
            args.latency_rate,
            args.latency_seconds,
            args.payload,
        )
        .await?;
        let prefix = format!(
            "raw rdkafka produce at {} msg/s: send -> acknowledged",
            args.latency_rate
        );
        report_ceiling(report, &prefix, &ms);
    }
    // The write scenarios above left their events in the slot, and their table-mode
    // rows in the outbox table (which the WAL relay would publish first): skip both.
    sqlx::query("SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())")
        .bind(&db.slot)
        .execute(db.outbox.pool())
        .await?;
    sqlx::query("DELETE FROM outbox")
        .execute(db.outbox.pool())
        .await?;
    let mut destination = "bench.latency".to_owned();
    let mut rate = args.latency_rate;
    let mut best = None;
    let steps = if args.smoke { 1 } else { 4 };
    for step in 0..steps {
        let prefix = format!("WAL mode at {rate} tx/s: ");
        let (p99, achieved) = crate::scenarios::measure_latency(
            args,
            report,
            &db.outbox,
            &mut destination,
            ("wal", &prefix),
            rate,
        )
        .await?;
        if p99.is_nan() {
            return Err("no commit -> acknowledgement latency measured".into());
        }
        if p99 > 100.0 || achieved < 0.95 * rate as f64 {
            break;
        }
        best = Some(rate);
        if step + 1 < steps {
            rate *= 2;
        }
    }
    report.add(
        "wal",
        "WAL mode: highest rate tried with p99 <= 100 ms (writers keeping up)",
        best.map_or(0.0, |r| r as f64),
        "tx/s",
    );
    Ok(())
}

/// p50, p99 (the ceiling) and max of the sorted latencies `ms`.
fn report_ceiling(report: &mut Report, prefix: &str, ms: &[f64]) {
    report.add("wal", &format!("{prefix}, p50"), quantile(ms, 0.5), "ms");
    report.add(
        "wal",
        &format!("{prefix}, p99"),
        quantile(ms, 0.99),
        "ms (ceiling)",
    );
    report.add(
        "wal",
        &format!("{prefix}, max"),
        ms.last().copied().unwrap_or(f64::NAN),
        "ms",
    );
}

/// The latency ceiling: commit -> message received by a bare replication client (a
/// slot of its own, no relay, no broker) at `--latency-rate` from 4 writers.
async fn raw_latency(args: &Args, report: &mut Report, db: &WalDb) -> Result<(), BoxError> {
    use std::collections::HashMap;
    let slot = latency_slot(db);
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
        .bind(&slot)
        .execute(db.outbox.pool())
        .await?;
    let mut client = raw_client(args, &slot, &db.slot).await?;
    let total = args.latency_rate * args.latency_seconds;
    let reader = tokio::spawn(async move {
        let mut arrived: HashMap<uuid::Uuid, Instant> = HashMap::new();
        while (arrived.len() as u64) < total {
            match client.recv().await? {
                Some(ReplicationEvent::Message { content, .. }) => {
                    #[derive(serde::Deserialize)]
                    struct Id {
                        id: uuid::Uuid,
                    }
                    // The envelope's routing fields: its first JSON value (the
                    // payload follows it in version 2).
                    let id: Id = serde_json::Deserializer::from_slice(&content)
                        .into_iter::<Id>()
                        .next()
                        .ok_or("an empty envelope")??;
                    arrived.insert(id.id, Instant::now());
                }
                Some(ReplicationEvent::Commit { end_lsn, .. }) => {
                    client.update_applied_lsn(end_lsn);
                }
                Some(_) => {}
                None => return Err::<_, BoxError>("the replication stream ended".into()),
            }
        }
        client.shutdown().await?;
        Ok(arrived)
    });
    let (committed, _) = crate::scenarios::paced_writers(
        args,
        &db.outbox,
        args.latency_rate,
        "raw".to_owned(),
        args.keys,
    )
    .await?;
    let arrived = tokio::time::timeout(Duration::from_secs(60), reader).await???;
    let mut ms: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            arrived
                .get(id)
                .map(|r| r.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let prefix = format!(
        "raw decoding at {} tx/s: commit -> received",
        args.latency_rate
    );
    report_ceiling(report, &prefix, &ms);
    drop_slot(db.outbox.pool(), &slot).await
}

/// Commits/s and commit latency with 1, 8 and 32 concurrent writers, each committing a
/// business UPDATE with one 1 KB event as fast as it can, in table mode (row + NOTIFY)
/// and WAL mode, no relay running.
async fn commit_throughput(args: &Args, report: &mut Report, db: &WalDb) -> Result<(), BoxError> {
    let seconds = if args.smoke { 0.3 } else { 5.0 };
    let pool = PgPoolOptions::new()
        .max_connections(34)
        .connect_with(
            PgConnectOptions::from_str(&args.database_url)?
                .options([("search_path", db.db.schema())]),
        )
        .await?;
    let table = Outbox::new(pool.clone());
    let wal = Outbox::builder(pool.clone()).wal_slot(&db.slot).build()?;
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let mut at_32 = [0.0; 2];
    for writers in [1_usize, 8, 32] {
        for (m, (mode, outbox)) in [("table", &table), ("WAL", &wal)].into_iter().enumerate() {
            let deadline = Instant::now() + Duration::from_secs_f64(seconds);
            let tasks: Vec<_> = (0..writers)
                .map(|w| {
                    let (outbox, payload) = (outbox.clone(), payload.clone());
                    tokio::spawn(async move {
                        let mut ms = Vec::new();
                        let mut i = w as i64;
                        while Instant::now() < deadline {
                            let started = Instant::now();
                            let mut tx = outbox.begin().await?;
                            sqlx::query("UPDATE orders SET n = n + 1 WHERE id = $1")
                                .bind(i % 10_000)
                                .execute(&mut *tx)
                                .await?;
                            tx.emit_message(
                                OutboxMessage::new("OrderConfirmed", "orders", payload.clone())
                                    .with_key(format!("k{i}")),
                            )?;
                            tx.commit().await?;
                            ms.push(started.elapsed().as_secs_f64() * 1000.0);
                            i += 32;
                        }
                        Ok::<_, BoxError>(ms)
                    })
                })
                .collect();
            let mut ms = Vec::new();
            for t in tasks {
                ms.extend(t.await??);
            }
            ms.sort_by(f64::total_cmp);
            let rate = ms.len() as f64 / seconds;
            if writers == 32 {
                at_32[m] = rate;
            }
            let name = format!("{mode} mode, {writers} writer(s)");
            report.add("wal", &format!("{name}: commits/s"), rate, "tx/s");
            report.add(
                "wal",
                &format!("{name}: commit p50"),
                quantile(&ms, 0.5),
                "ms",
            );
            report.add(
                "wal",
                &format!("{name}: commit p99"),
                quantile(&ms, 0.99),
                "ms",
            );
        }
    }
    report.add(
        "wal",
        "32 writers: WAL mode commits/s / table mode commits/s",
        at_32[1] / at_32[0],
        "ratio",
    );
    pool.close().await;
    Ok(())
}

/// Commits of one UPDATE with 0, 1 and 10 events, table and WAL mode interleaved.
async fn write_cost(args: &Args, report: &mut Report, db: &WalDb) -> Result<(), BoxError> {
    let table = Outbox::new(db.outbox.pool().clone()); // same schema, table mode
    let mut timings =
        crate::scenarios::commit_timings(args, &[&table, &db.outbox], args.payload).await?;
    crate::scenarios::report_commit_timings(
        report,
        ("wal", "table mode: "),
        &mut timings[0],
        None,
        None,
    );
    crate::scenarios::report_commit_timings(
        report,
        ("wal", "WAL mode: "),
        &mut timings[1],
        Some(Target::AtMost(10.0)),
        None,
    );
    Ok(())
}
