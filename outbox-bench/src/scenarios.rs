//! The benchmark scenarios. Each adds its measurements to the report.

use std::time::{Duration, Instant};

use outbox_core::relay::Relay;
use outbox_core::{OutboxMessage, sqlx};

use crate::BoxError;
use crate::kafka;
use crate::publisher::CountingPublisher;
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb, peak_rss, quantile, reset_peak_rss};
use crate::trusted_sql;

const DRAIN_TIMEOUT: Duration = Duration::from_secs(900);

/// seq, id, event_type, destination, partition_key, payload, headers.
type ClaimedRow = (
    i64,
    uuid::Uuid,
    String,
    String,
    Option<String>,
    Vec<u8>,
    String,
);
/// seq, id, event_type, destination, partition_key, payload.
type ArticleRow = (i64, uuid::Uuid, String, String, Option<String>, Vec<u8>);

/// Runs relays over a filled backlog until it is drained; events/s and peak RSS.
pub(crate) async fn relay_drain(
    args: &Args,
    relays: usize,
) -> Result<(f64, Option<u64>), BoxError> {
    let mut db = BenchDb::with_pool_size(args, 4 + 2 * relays as u32).await?;
    let topic = match &args.broker {
        Some(brokers) => Some(kafka::create_topic(brokers).await?),
        None => None,
    };
    if let Some(t) = &topic {
        db.destination = t.clone();
    }
    db.fill(args.events, args.keys, args.payload).await?;
    let mut handles = Vec::new();
    let mut kafka_publishers = Vec::new();
    if let (Some(brokers), Some(topic)) = (&args.broker, &topic) {
        for _ in 0..relays {
            kafka_publishers.push(kafka::publisher(brokers, topic).await?);
        }
    }
    reset_peak_rss();
    let started = Instant::now();
    for i in 0..relays {
        handles.push(match kafka_publishers.get(i) {
            Some(p) => sized(args, Relay::builder(db.outbox.clone(), p.clone())).spawn(),
            None => sized(
                args,
                Relay::builder(db.outbox.clone(), CountingPublisher::default()),
            )
            .spawn(),
        });
    }
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        let published: u64 = handles.iter().map(|h| h.stats().published).sum();
        if published >= args.events {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("relays published only {published} of {}", args.events).into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let rss = peak_rss();
    for h in handles {
        h.shutdown().await;
    }
    db.drop().await?;
    Ok((args.events as f64 / seconds, rss))
}

/// Drains `db`'s backlog of `--events` rows with one relay (`--batch-size` if given)
/// through `publisher`; returns events/s from the relay's start to its last mark.
pub(crate) async fn timed_drain<P: outbox_core::publisher::Publisher>(
    args: &Args,
    db: &BenchDb,
    publisher: P,
) -> Result<f64, BoxError> {
    let started = Instant::now();
    let relay = sized(args, Relay::builder(db.outbox.clone(), publisher)).spawn();
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while relay.stats().published < args.events {
        if Instant::now() > deadline {
            return Err(format!("the relay published only {}", relay.stats().published).into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = args.events as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    Ok(rate)
}

/// `builder` with `--batch-size`, if given.
pub(crate) fn sized<P: outbox_core::publisher::Publisher>(
    args: &Args,
    builder: outbox_core::relay::RelayBuilder<P>,
) -> outbox_core::relay::RelayBuilder<P> {
    match args.batch_size {
        Some(n) => builder.batch_size(n),
        None => builder,
    }
}

/// Scenario 1: Drain throughput: our relay against the article's relay and the two ceilings.
pub async fn drain(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let sink = args
        .broker
        .as_deref()
        .unwrap_or("in-process counting publisher");
    let (db_ceiling, _) = pg_ceiling(args).await?;
    report.add(
        "drain",
        "(d) PostgreSQL claim+mark ceiling (no broker)",
        db_ceiling,
        "events/s",
    );
    // The relay first: its peak RSS must not include the produce ceiling's buffers.
    let (relay, rss) = relay_drain(args, 1).await?;
    let mut ceiling = db_ceiling;
    if let Some(brokers) = &args.broker {
        let topic = kafka::create_topic(brokers).await?;
        let produce =
            kafka::raw_produce(brokers, &topic, args.events, args.keys, args.payload).await?;
        report.add(
            "drain",
            "(c) raw rdkafka produce ceiling (no database)",
            produce,
            "events/s",
        );
        ceiling = ceiling.min(produce);
    }
    report.add(
        "drain",
        &format!("(a) outbox relay, defaults -> {sink}"),
        relay,
        "events/s",
    );
    let article = article(args).await?;
    report.add(
        "drain",
        &format!("(b) source article's relay -> {sink}"),
        article,
        "events/s",
    );
    report.target(
        "drain",
        "(a) / min(c, d)",
        relay / ceiling,
        Target::AtLeast(0.7),
    );
    report.target("drain", "(a) / (b)", relay / article, Target::AtLeast(20.0));
    if let Some(rss) = rss {
        report.add(
            "drain",
            "relay process peak RSS during (a)",
            rss as f64 / 1_048_576.0,
            "MiB",
        );
    }
    Ok(())
}

/// (d) claim 1,000 pending rows in `seq` order and mark them sent, one connection.
pub(crate) async fn pg_ceiling(args: &Args) -> Result<(f64, u64), BoxError> {
    let db = BenchDb::new(args).await?;
    db.fill(args.events, args.keys, args.payload).await?;
    let mut conn = db.outbox.pool().acquire().await?;
    let started = Instant::now();
    let mut done = 0_u64;
    loop {
        let rows: Vec<ClaimedRow> = sqlx::query_as(
            "SELECT seq, id, event_type, destination, partition_key, body, headers::text FROM outbox \
             WHERE sent_at IS NULL AND dead_at IS NULL ORDER BY seq LIMIT 1000",
        )
        .fetch_all(&mut *conn)
        .await?;
        if rows.is_empty() {
            break;
        }
        let seqs: Vec<i64> = rows.iter().map(|r| r.0).collect();
        sqlx::query("UPDATE outbox SET sent_at = now() WHERE seq = ANY($1)")
            .bind(&seqs)
            .execute(&mut *conn)
            .await?;
        done += rows.len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(conn);
    db.drop().await?;
    Ok((done as f64 / seconds, done))
}

/// (b) the source article's relay: 50 rows by creation time (with the article's index),
/// send one message and wait for its ack, one UPDATE per row, in one transaction.
async fn article(args: &Args) -> Result<f64, BoxError> {
    use outbox_core::publisher::Publisher;
    let mut db = BenchDb::new(args).await?;
    if let Some(brokers) = &args.broker {
        db.destination = kafka::create_topic(brokers).await?;
    }
    // The article relay is ~100x slower: a tenth of the backlog keeps the run short.
    let events = (args.events / 10).max(1000.min(args.events));
    db.fill(events, args.keys, args.payload).await?;
    sqlx::query("CREATE INDEX outbox_article_idx ON outbox (created_at) WHERE sent_at IS NULL")
        .execute(db.outbox.pool())
        .await?;
    let kafka_publisher = match &args.broker {
        Some(brokers) => Some(kafka::publisher(brokers, &db.destination).await?),
        None => None,
    };
    let counting = CountingPublisher::default();
    let pool = db.outbox.pool().clone();
    let started = Instant::now();
    let mut done = 0_u64;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<ArticleRow> = sqlx::query_as(
            "SELECT seq, id, event_type, destination, partition_key, body FROM outbox \
             WHERE sent_at IS NULL ORDER BY created_at LIMIT 50 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            break;
        }
        for (seq, id, event_type, destination, key, payload) in rows {
            let mut message = outbox_core::OutboxMessage::new(event_type, destination, payload);
            message.id = id;
            message.partition_key = key;
            let record = outbox_core::OutboxRecord::from(message).with_seq(seq);
            let result = match &kafka_publisher {
                Some(p) => p.publish(std::slice::from_ref(&record)).await,
                None => counting.publish(std::slice::from_ref(&record)).await,
            };
            if result.first().is_some_and(Result::is_ok) {
                sqlx::query("UPDATE outbox SET sent_at = now() WHERE seq = $1")
                    .bind(seq)
                    .execute(&mut *tx)
                    .await?;
                done += 1;
            }
        }
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    db.drop().await?;
    Ok(done as f64 / seconds)
}

/// Scenario 3: Write overhead: a business transaction (one UPDATE) with 0, 1 and 10
/// events, and with a plain row of the outbox's shape instead, with `--payload` bytes and
/// with 10 KB.
pub async fn write_overhead(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    for payload in [args.payload, 10 * 1024] {
        let db = BenchDb::new(args).await?;
        let mut timings = commit_timings(args, &[&db.outbox], payload).await?;
        report_commit_timings(
            report,
            ("write", &format!("{payload} B: ")),
            &mut timings[0],
            None,
            Some(Target::AtMost(1.1)),
        );
        db.drop().await?;
    }
    Ok(())
}

/// Events per business commit in [`commit_timings`]; the last variant writes one plain
/// row of the outbox's shape instead (the floor).
const VARIANTS: [usize; 3] = [0, 1, 10];

/// Creates `orders` (10,000 rows) and `plain_row` (the outbox table's definition: columns,
/// identity and indexes) in the first outbox's schema and times commits of one UPDATE
/// with 0, 1 and 10 events of `payload` bytes through each outbox, then with one plain
/// row (a prepared `INSERT` with bound parameters) instead, interleaved so that machine
/// noise hits every variant alike. Returns, per outbox, the timings in ms of each of
/// [`VARIANTS`] and then of the plain row.
pub(crate) async fn commit_timings(
    args: &Args,
    outboxes: &[&outbox_core::Outbox],
    payload: usize,
) -> Result<Vec<Vec<Vec<f64>>>, BoxError> {
    let pool = outboxes[0].pool();
    for sql in [
        "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL, n bigint NOT NULL DEFAULT 0)",
        "INSERT INTO orders SELECT g, 'new' FROM generate_series(0, 9999) g",
        "CREATE TABLE plain_row (LIKE outbox INCLUDING ALL)",
    ] {
        sqlx::query(trusted_sql(sql)).execute(pool).await?;
    }
    let mut timings = vec![vec![Vec::new(); VARIANTS.len() + 1]; outboxes.len()];
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(payload.saturating_sub(14))
    );
    let update = "UPDATE orders SET n = n + 1, status = 'confirmed' WHERE id = $1";
    let warmup = 20;
    for i in 0..args.write_iterations + warmup {
        let order = i64::try_from(i % 10_000)?;
        for (m, outbox) in outboxes.iter().enumerate() {
            for (v, &events) in VARIANTS.iter().enumerate() {
                let started = Instant::now();
                let mut tx = outbox.begin().await?;
                sqlx::query(trusted_sql(update))
                    .bind(order)
                    .execute(&mut *tx)
                    .await?;
                for e in 0..events {
                    tx.emit_message(
                        OutboxMessage::new("OrderConfirmed", "orders", payload.clone())
                            .with_key(format!("{i}-{e}")),
                    )?;
                }
                tx.commit().await?;
                if i >= warmup {
                    timings[m][v].push(started.elapsed().as_secs_f64() * 1000.0);
                }
            }
            let started = Instant::now();
            let mut tx = outbox.pool().begin().await?;
            sqlx::query(trusted_sql(update))
                .bind(order)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO plain_row \
                 (id, event_type, event_version, destination, partition_key, body, headers) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)",
            )
            .bind(uuid::Uuid::now_v7())
            .bind("OrderConfirmed")
            .bind(None::<i32>)
            .bind("orders")
            .bind(format!("{i}-0"))
            .bind(payload.as_bytes())
            .bind("{}")
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            if i >= warmup {
                timings[m][VARIANTS.len()].push(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
    }
    Ok(timings)
}

/// Reports p50 and p99 of each variant of [`commit_timings`], one event's overhead at
/// p50 in % of the commit without events (against `overhead_target`), and one event's
/// cost against a plain row's (the extra time each adds to the commit without events,
/// at p50; against `cost_target`).
pub(crate) fn report_commit_timings(
    report: &mut Report,
    (group, prefix): (&str, &str),
    timings: &mut [Vec<f64>],
    overhead_target: Option<Target>,
    cost_target: Option<Target>,
) {
    let mut p50s = Vec::new();
    let names = VARIANTS
        .iter()
        .map(|events| format!("commit with {events} event(s)"))
        .chain(["commit with a plain row".to_owned()]);
    for (t, variant) in timings.iter_mut().zip(names) {
        t.sort_by(f64::total_cmp);
        p50s.push(quantile(t, 0.5));
        let name = |q: &str| format!("{prefix}{variant}, {q}");
        report.add(group, &name("p50"), quantile(t, 0.5), "ms");
        report.add(group, &name("p99"), quantile(t, 0.99), "ms");
    }
    let overhead = (p50s[1] / p50s[0] - 1.0) * 100.0;
    let name = format!("{prefix}one event's overhead at p50");
    match overhead_target {
        Some(t) => report.target_in(group, &name, overhead, "%", t),
        None => report.add(group, &name, overhead, "%"),
    }
    let cost = (p50s[1] - p50s[0]) / (p50s[VARIANTS.len()] - p50s[0]);
    let name = format!("{prefix}one event's cost / a plain row's, at p50");
    match cost_target {
        Some(t) => report.target(group, &name, cost, t),
        None => report.add(group, &name, cost, "ratio"),
    }
}

/// Scenario 4: Idle cost: statements an idle relay sends per minute, counted by the
/// server (`pg_stat_statements`), with the relay's own count beside it.
pub async fn idle(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let db = BenchDb::new(args).await?;
    let stats = ServerStatements::new(&db).await?;
    let relay = Relay::builder(db.outbox.clone(), CountingPublisher::default()).spawn();
    // Connected, drained (nothing), declared idle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stats.reset().await?;
    let before = relay.stats().queries;
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let counted = stats.calls(None).await?;
    let own = relay.stats().queries - before;
    relay.shutdown().await;
    let per_minute = |n: f64| n * 60.0 / args.idle_seconds as f64;
    report.target_in(
        "idle",
        "statements per minute, idle relay (5 s poll), counted by the server",
        per_minute(counted.calls),
        "statements/min",
        Target::AtMost(12.0),
    );
    report.add(
        "idle",
        "statements per minute, idle relay, as the relay counts them",
        per_minute(own as f64),
        "statements/min",
    );
    db.drop().await?;
    Ok(())
}

/// What the server executed, from `pg_stat_statements` (preloaded by
/// `scripts/services.sh`), in the bench database.
pub(crate) struct ServerStatements {
    pool: sqlx::PgPool,
    /// The extension's schema, quoted (the bench's connections search their own schema).
    schema: String,
}

/// Calls and total execution time of the statements matched.
pub(crate) struct Executed {
    pub(crate) calls: f64,
    pub(crate) total_ms: f64,
}

impl ServerStatements {
    pub(crate) async fn new(db: &BenchDb) -> Result<ServerStatements, BoxError> {
        let pool = db.outbox.pool().clone();
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements SCHEMA public")
            .execute(&pool)
            .await?;
        let schema: String = sqlx::query_scalar(
            "SELECT quote_ident(extnamespace::regnamespace::text) FROM pg_extension \
             WHERE extname = 'pg_stat_statements'",
        )
        .fetch_one(&pool)
        .await?;
        // Loaded at server start only: without it the view errors on first use.
        if let Err(e) = sqlx::query(trusted_sql(format!(
            "SELECT count(*) FROM {schema}.pg_stat_statements"
        )))
        .execute(&pool)
        .await
        {
            return Err(format!(
                "pg_stat_statements is not usable ({e}): add it to shared_preload_libraries \
                 and restart PostgreSQL (scripts/services.sh does both)"
            )
            .into());
        }
        Ok(ServerStatements { pool, schema })
    }

    pub(crate) async fn reset(&self) -> Result<(), BoxError> {
        sqlx::query(trusted_sql(format!(
            "SELECT {}.pg_stat_statements_reset()",
            self.schema
        )))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Every statement run in this database since the reset (but these readings), or only
    /// those whose text contains `like`.
    pub(crate) async fn calls(&self, like: Option<&str>) -> Result<Executed, BoxError> {
        let (calls, total_ms): (f64, f64) = sqlx::query_as(trusted_sql(format!(
            "SELECT coalesce(sum(calls), 0)::float8, coalesce(sum(total_exec_time), 0)::float8 \
             FROM {}.pg_stat_statements \
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND query NOT LIKE '%pg_stat_statements%' \
               AND ($1::text IS NULL OR strpos(query, $1) > 0)",
            self.schema
        )))
        .bind(like)
        .fetch_one(&self.pool)
        .await?;
        Ok(Executed { calls, total_ms })
    }
}

/// Scenario 5: History size: the relay's own claim statement (horizon bound, partition
/// filter, blocker and parked-key clauses), timed by the server while the relay drains
/// pending rows, with 0 and with `history` retained sent rows.
pub async fn history(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let pending = if args.smoke { 2_000 } else { 20_000 };
    let mut means = Vec::new();
    for history in [0, args.history] {
        let db = BenchDb::new(args).await?;
        if history > 0 {
            db.fill_rows(history, args.keys, 64, true).await?;
        }
        db.fill(pending, args.keys, args.payload).await?;
        let stats = ServerStatements::new(&db).await?;
        stats.reset().await?;
        let relay = Relay::builder(db.outbox.clone(), CountingPublisher::default())
            .batch_size(500)
            .spawn();
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while relay.stats().published < pending {
            if Instant::now() > deadline {
                return Err(
                    format!("the relay published only {} rows", relay.stats().published).into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        relay.shutdown().await;
        // The claim is the statement ending in this clause (db/postgres/session.rs).
        let claims = stats.calls(Some("ORDER BY o.seq LIMIT")).await?;
        if claims.calls < (pending / 500) as f64 {
            return Err(format!(
                "the server saw {} claims for {pending} rows in batches of 500: the claim \
                 statement's text changed; update the pattern in the history scenario",
                claims.calls
            )
            .into());
        }
        let mean = claims.total_ms / claims.calls;
        means.push(mean);
        report.add(
            "history",
            &format!(
                "relay's claim (500 rows) with {history} sent rows retained, mean of {}",
                claims.calls
            ),
            mean,
            "ms",
        );
        db.drop().await?;
    }
    report.target(
        "history",
        "claim time, full history / empty",
        means[1] / means[0],
        Target::AtMost(1.2),
    );
    Ok(())
}

/// Scenario 6: Scale-out: drain throughput with 1, 2 and 3 relays.
pub async fn scale_out(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    for relays in 1..=3 {
        let (rate, _) = relay_drain(args, relays).await?;
        report.add("scale", &format!("{relays} relay(s)"), rate, "events/s");
    }
    Ok(())
}

/// Scenario 2: Latency: writers commit one-event transactions at `latency_rate` per second for
/// `latency_seconds` while the relay runs; a consumer timestamps each arrival. Reported:
/// commit returned → message received by the consumer (an upper bound of commit → ack).
pub async fn latency(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let mut db = BenchDb::new(args).await?;
    let outbox = db.outbox.clone();
    measure_latency(
        args,
        report,
        &outbox,
        &mut db.destination,
        ("latency", ""),
        args.latency_rate,
    )
    .await?;
    db.drop().await?;
    Ok(())
}

/// Commit -> broker acknowledgement (or the in-memory publisher) at `rate` tx/s of one
/// event each from 4 writers through `outbox`, for `--latency-seconds`, reported in
/// `group` with names prefixed by `prefix`. Returns the p99 in ms (of the broker's
/// acknowledgement when there is a broker) and the write rate achieved (tx/s).
pub(crate) async fn measure_latency(
    args: &Args,
    report: &mut Report,
    outbox: &outbox_core::Outbox,
    destination: &mut String,
    (group, prefix): (&str, &str),
    rate: u64,
) -> Result<(f64, f64), BoxError> {
    // With `--broker memory` the in-memory publisher stands in for the broker: what is
    // left is the relay's own share of the latency.
    // Through a broker, the acknowledgement times are recorded too: commit -> broker
    // acknowledged is what the target is about; the consumer adds its fetch path.
    let mut acks = None;
    let mut calls = None;
    let (mut arrivals, relay, sink) = match &args.broker {
        Some(brokers) => {
            *destination = kafka::create_topic(brokers).await?;
            let arrivals = kafka::Arrivals::start(brokers, destination).await?;
            let publisher = kafka::publisher(brokers, destination).await?;
            let (tx, acked) = kafka::Arrivals::channel();
            acks = Some(acked);
            let publisher = crate::publisher::Acked::new(publisher, tx);
            calls = Some(publisher.calls());
            (
                arrivals,
                in_flight(args, Relay::builder(outbox.clone(), publisher)).spawn(),
                "consumer",
            )
        }
        None => {
            let publisher = outbox_core::publisher::InMemoryPublisher::new();
            let arrivals = kafka::Arrivals::from_memory(&publisher);
            (
                arrivals,
                in_flight(args, Relay::builder(outbox.clone(), publisher)).spawn(),
                "in-memory publisher",
            )
        }
    };
    // Warm-up: one event through the whole path before the clock starts, so the relay's
    // connect (and the consumer's first fetch) is not counted as the writers' latency.
    let mut tx = outbox.begin().await?;
    tx.emit_message(OutboxMessage::new("Latency", destination.as_str(), "{}"))?;
    tx.commit().await?;
    if !arrivals.wait_for(1, Duration::from_secs(60)).await {
        return Err("the warm-up event did not arrive within 60 s".into());
    }
    arrivals.seen.clear();
    if let Some(acks) = acks.as_mut() {
        if !acks.wait_for(1, Duration::from_secs(5)).await {
            return Err(
                "the warm-up event reached the consumer but its acknowledgement was not recorded"
                    .into(),
            );
        }
        acks.seen.clear();
    }
    if let Some(Ok(mut calls)) = calls.as_ref().map(|c| c.lock()) {
        calls.clear(); // the warm-up's
    }
    let (committed, achieved) =
        paced_writers(args, outbox, rate, destination.clone(), args.keys).await?;

    if !arrivals
        .wait_for(committed.len(), Duration::from_secs(120))
        .await
    {
        return Err(format!(
            "only {} of {} messages reached the consumer",
            arrivals.seen.len(),
            committed.len()
        )
        .into());
    }
    relay.shutdown().await;
    report.add(
        group,
        &format!("{prefix}write rate achieved (asked {rate})"),
        achieved,
        "tx/s",
    );
    let at = (group, prefix);
    if let Some(calls) = &calls {
        crate::publisher::report_calls(report, at, calls);
    }
    let p99 = if let Some(mut acks) = acks {
        // Every consumed message was acknowledged before: all acks are in the channel.
        // Quantiles over fewer would hide the missing ones: the run fails instead.
        if !acks.wait_for(committed.len(), Duration::from_secs(5)).await {
            return Err(format!(
                "{} of {} acknowledgements recorded, though every message reached the consumer",
                acks.seen.len(),
                committed.len()
            )
            .into());
        }
        let p99 = latencies(
            report,
            at,
            &committed,
            &acks,
            "broker acknowledged",
            Some(LATENCY_TARGET),
        );
        latencies(report, at, &committed, &arrivals, sink, None);
        p99
    } else {
        latencies(
            report,
            at,
            &committed,
            &arrivals,
            sink,
            Some(LATENCY_TARGET),
        )
    };
    Ok((p99, achieved))
}

/// 4 writers committing one event each (`--payload` bytes, keys `k0..k{keys}`) at `rate`
/// tx/s for `--latency-seconds`: transaction i is due i / rate seconds after the start.
/// Returns each event's id and when its commit returned, and the rate achieved.
pub(crate) async fn paced_writers(
    args: &Args,
    outbox: &outbox_core::Outbox,
    rate: u64,
    destination: String,
    keys: u64,
) -> Result<(Vec<(uuid::Uuid, Instant)>, f64), BoxError> {
    let total = rate * args.latency_seconds;
    let writers = 4_u64;
    let payload = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (outbox, destination, payload) = (outbox.clone(), destination.clone(), payload.clone());
        tasks.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            let mut i = w;
            while i < total {
                tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate as f64))
                    .await;
                let mut tx = outbox.begin().await?;
                let id = tx.emit_message(
                    OutboxMessage::new("Latency", destination.as_str(), payload.clone())
                        .with_key(format!("k{}", i % keys.max(1))),
                )?;
                tx.commit().await?;
                committed.push((id, Instant::now()));
                i += writers;
            }
            Ok::<_, BoxError>(committed)
        }));
    }
    let mut committed = Vec::new();
    for t in tasks {
        committed.extend(t.await??);
    }
    let achieved = committed.len() as f64 / started.elapsed().as_secs_f64();
    Ok((committed, achieved))
}

/// p99 commit -> broker acknowledgement, in ms, at the latency scenario's rate.
const LATENCY_TARGET: Target = Target::AtMost(25.0);

/// p50, p99 (against `p99_target`) and max of commit -> arrival, in ms; returns the p99.
fn latencies(
    report: &mut Report,
    (group, prefix): (&str, &str),
    committed: &[(uuid::Uuid, Instant)],
    arrivals: &kafka::Arrivals,
    sink: &str,
    p99_target: Option<Target>,
) -> f64 {
    let mut ms: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            arrivals
                .seen
                .get(id)
                .map(|r| r.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let name = |q: &str| format!("{prefix}commit -> {sink}, {q}");
    report.add(group, &name("p50"), quantile(&ms, 0.5), "ms");
    match p99_target {
        Some(t) => report.target_in(group, &name("p99"), quantile(&ms, 0.99), "ms", t),
        None => report.add(group, &name("p99"), quantile(&ms, 0.99), "ms"),
    }
    report.add(
        group,
        &name("max"),
        ms.last().copied().unwrap_or(f64::NAN),
        "ms",
    );
    quantile(&ms, 0.99)
}

/// `--batches-in-flight`, if given, on `builder`.
pub(crate) fn in_flight<P: outbox_core::publisher::Publisher>(
    args: &Args,
    builder: outbox_core::relay::RelayBuilder<P>,
) -> outbox_core::relay::RelayBuilder<P> {
    match args.batches_in_flight {
        Some(n) => builder.batches_in_flight(n),
        None => builder,
    }
}
