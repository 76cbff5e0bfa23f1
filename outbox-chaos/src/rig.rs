//! The orchestrator: one ledger-checked run per fault.
//!
//! Each run gets a schema of its own in PostgreSQL and a topic (Kafka: a tansu broker of
//! the rig's own, in memory) or stream (NATS: a `nats-server` of the rig's own, on disk),
//! both behind a fault-injecting TCP proxy. Two relays and one consumer run as OS
//! processes (this binary's `relay` and `consume`), restarted by a supervisor whenever
//! they exit or are killed. Writers commit `(key, n)` events with their business row.
//! After the fault, the writers stop, the backlog drains, and the ledger compares what was
//! committed with what the consumer applied.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::admin::{Admin, ListFilter};
use outbox_core::sqlx::{self, PgPool, Postgres};
use outbox_core::{Outbox, OutboxMessage};
use outbox_tests::kafka::OwnBroker;
use outbox_tests::nats::OwnNats;
use outbox_tests::proxy::{Mode, Proxy};

use crate::ledger::{self, Event, Ledger};
use crate::procs::{self, SESSION_TIMEOUT};
use crate::trusted_sql;

/// The faults, each run on its own; `mixed` runs random pairs of them at once.
pub const FAULTS: [&str; 11] = [
    "relay-kill",
    "relay-stop",
    "broker-kill",
    "broker-stall",
    "broker-reset",
    "pg-kill",
    "pg-restart",
    "late-writer",
    "oversized",
    "consumer-kill",
    "mixed",
];

/// What `mixed` picks from (the ones that can overlap).
const MIXABLE: [&str; 7] = [
    "relay-kill",
    "broker-stall",
    "broker-reset",
    "pg-kill",
    "late-writer",
    "consumer-kill",
    "broker-kill",
];

/// What runs beside the first fault of a `mixed` round (no broker or proxy needed).
const BESIDE: [&str; 4] = ["relay-kill", "pg-kill", "late-writer", "consumer-kill"];

const KEYS: usize = 16;
const WRITERS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BrokerKind {
    Kafka,
    Nats,
}

/// A seeded xorshift generator: the same seed gives the same schedule.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from + 1))
    }
}

#[derive(Debug)]
struct Options {
    broker: BrokerKind,
    seed: u64,
    short: bool,
    /// PostgreSQL WAL mode (`docs/wal.md`): writers emit into the WAL, relays read a slot.
    wal: bool,
    faults: Vec<String>,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        broker: BrokerKind::Kafka,
        seed: 1,
        short: false,
        wal: false,
        faults: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--broker" => {
                options.broker = match value()?.as_str() {
                    "kafka" => BrokerKind::Kafka,
                    "nats" => BrokerKind::Nats,
                    other => return Err(format!("--broker {other}: kafka or nats")),
                }
            }
            "--seed" => {
                options.seed = value()?
                    .parse()
                    .map_err(|e| format!("--seed: a number ({e})"))?;
            }
            "--short" => options.short = true,
            "--wal" => options.wal = true,
            "--fault" => {
                let v = value()?;
                for f in v.split(',') {
                    if f == "all" {
                        options
                            .faults
                            .extend(FAULTS.iter().map(|f| (*f).to_owned()));
                    } else if FAULTS.contains(&f) {
                        options.faults.push(f.to_owned());
                    } else {
                        return Err(format!("--fault {f}: one of {} or all", FAULTS.join(", ")));
                    }
                }
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    if options.faults.is_empty() {
        options
            .faults
            .extend(FAULTS.iter().map(|f| (*f).to_owned()));
    }
    Ok(options)
}

/// `run ...`: every fault asked for, one ledger each; an error if any ledger fails.
pub async fn main(args: &[String]) -> Result<(), String> {
    let options = parse(args)?;
    let mut env = Env::start(options.broker).await?;
    let mut rng = Rng(options.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut reports = Vec::new();
    for fault in &options.faults {
        eprintln!(
            "chaos: {fault} on {:?}{} (seed {})",
            options.broker,
            if options.wal { ", WAL mode" } else { "" },
            options.seed
        );
        let report = run_one(&mut env, fault, &mut rng, options.short, options.wal).await?;
        eprintln!("chaos: {}", report.row());
        reports.push(report);
    }
    println!(
        "\n{:?}{}, seed {}, {} run{}:\n",
        options.broker,
        if options.wal { " (WAL mode)" } else { "" },
        options.seed,
        if options.short { "short" } else { "full" },
        if reports.len() == 1 { "" } else { "s" }
    );
    println!("{}", Report::header());
    for r in &reports {
        println!("{}", r.row());
    }
    for r in reports.iter().filter(|r| r.holds()) {
        for line in &r.lost_where {
            println!("chaos: {}: {line}", r.fault);
        }
    }
    let failed: Vec<&Report> = reports.iter().filter(|r| !r.holds()).collect();
    if failed.is_empty() {
        Ok(())
    } else {
        for r in &failed {
            eprintln!(
                "chaos: {} FAILED: lost {:?}; order violations {:?}; applied twice {}; unknown {}; \
                 unexpected dead letters {}; overtook the poison message {}",
                r.fault,
                &r.ledger.lost[..r.ledger.lost.len().min(10)],
                &r.ledger.order_violations[..r.ledger.order_violations.len().min(10)],
                r.ledger.applied_twice,
                r.ledger.unknown,
                r.unexpected_dead,
                r.overtook_poison
            );
            for line in &r.lost_where {
                eprintln!("chaos: {}: {line}", r.fault);
            }
        }
        Err(format!(
            "{} of {} runs broke a guarantee",
            failed.len(),
            reports.len()
        ))
    }
}

/// The broker (behind its proxy) shared by the runs of one invocation.
struct Env {
    kind: BrokerKind,
    kafka: Option<OwnBroker>,
    nats: Option<OwnNats>,
    proxy: Proxy,
    database_url: String,
    logs: PathBuf,
}

impl Env {
    async fn start(kind: BrokerKind) -> Result<Env, String> {
        let logs = std::env::temp_dir().join(format!("outbox-chaos-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
        let (kafka, nats, proxy) = match kind {
            BrokerKind::Kafka => {
                let (broker, proxy) = OwnBroker::behind_proxy().await;
                (Some(broker), None, proxy)
            }
            BrokerKind::Nats => {
                let server = tokio::task::spawn_blocking(|| OwnNats::start(None))
                    .await
                    .map_err(|e| e.to_string())?;
                let upstream = format!("127.0.0.1:{}", server.port())
                    .parse()
                    .map_err(|e| format!("{e}"))?;
                (None, Some(server), Proxy::start(upstream).await)
            }
        };
        Ok(Env {
            kind,
            kafka,
            nats,
            proxy,
            database_url: outbox_tests::database_url(),
            logs,
        })
    }

    /// What clients connect to: the proxy.
    fn broker_url(&self) -> String {
        match self.kind {
            BrokerKind::Kafka => self.proxy.addr().to_string(),
            BrokerKind::Nats => format!("nats://{}", self.proxy.addr()),
        }
    }

    fn kill_broker(&mut self) {
        if let Some(b) = &mut self.kafka {
            b.kill();
        }
        if let Some(n) = &mut self.nats {
            n.kill();
        }
        self.proxy.reset();
    }

    async fn restart_broker(&mut self) {
        if let Some(mut b) = self.kafka.take() {
            self.kafka = Some(
                tokio::task::spawn_blocking(move || {
                    b.restart();
                    b
                })
                .await
                .expect("restart the broker"),
            );
        }
        if let Some(mut n) = self.nats.take() {
            self.nats = Some(
                tokio::task::spawn_blocking(move || {
                    n.restart();
                    n
                })
                .await
                .expect("restart the server"),
            );
        }
    }
}

/// One run's figures.
#[derive(Debug)]
struct Report {
    fault: String,
    ledger: Ledger,
    duplicates: i64,
    unexpected_dead: usize,
    overtook_poison: bool,
    /// Commit to broker acknowledgement: p99 and worst.
    latency: (Duration, Duration),
    recovered: Option<Duration>,
    took: Duration,
    /// For a run that lost events: where each lost event is in the broker's log, read
    /// back to its end (Kafka), which tells a broker's loss from a consumer's.
    lost_where: Vec<String>,
}

impl Report {
    fn holds(&self) -> bool {
        self.ledger.holds() && self.unexpected_dead == 0 && !self.overtook_poison
    }

    fn header() -> String {
        "| fault | events | lost | broker's loss | skipped by the broker's fetch | order violations | applied twice | duplicates skipped by the inbox | dead letters (unexpected) | publish latency p99 / worst | recovered after the fault | run |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
            .to_owned()
    }

    fn row(&self) -> String {
        let l = &self.ledger;
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} s / {:.1} s | {} | {:.0} s |{}",
            self.fault,
            l.written,
            l.lost.len(),
            l.lost_by_broker,
            l.skipped_by_fetch,
            l.order_violations.len(),
            l.applied_twice,
            self.duplicates,
            self.unexpected_dead,
            self.latency.0.as_secs_f64(),
            self.latency.1.as_secs_f64(),
            self.recovered
                .map_or("not measured".to_owned(), |d| format!(
                    "{:.1} s",
                    d.as_secs_f64()
                )),
            self.took.as_secs_f64(),
            if self.holds() { "" } else { " FAILED" },
        )
    }
}

/// The relay and consumer processes, restarted whenever they exit (unless held).
struct Supervisor {
    procs: Vec<Proc>,
}

struct Proc {
    name: String,
    args: Vec<String>,
    child: Option<Child>,
    held: bool,
    log: PathBuf,
}

impl Supervisor {
    fn tick(&mut self) {
        for p in &mut self.procs {
            let exited = match &mut p.child {
                Some(c) => c.try_wait().ok().flatten().is_some(),
                None => true,
            };
            if exited && !p.held {
                p.child = spawn(&p.args, &p.log);
                if p.child.is_none() {
                    eprintln!("chaos: could not start {}", p.name);
                }
            }
        }
    }

    fn signal(&mut self, i: usize, signal: &str) {
        if let Some(child) = &self.procs[i].child {
            let _ = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
        }
    }

    fn kill(&mut self, i: usize) {
        self.signal(i, "-KILL");
        if let Some(mut c) = self.procs[i].child.take() {
            let _ = c.wait();
        }
    }

    fn stop_all(&mut self) {
        for i in 0..self.procs.len() {
            self.procs[i].held = true;
            self.signal(i, "-CONT");
            self.kill(i);
        }
    }
}

fn spawn(args: &[String], log: &PathBuf) -> Option<Child> {
    let exe = std::env::current_exe().ok()?;
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .ok()?;
    Command::new(exe)
        .args(args)
        .env(
            "RUST_LOG",
            // Each message the Kafka consumer receives is logged: the evidence for
            // "skipped by the broker's fetch".
            format!(
                "{},outbox_kafka::consumer=trace",
                std::env::var("RUST_LOG").unwrap_or_else(|_| {
                    "outbox_core=info,outbox_kafka=info,outbox_nats=info,rdkafka=info".to_owned()
                })
            ),
        )
        .stdin(Stdio::null())
        .stdout(out.try_clone().ok()?)
        .stderr(out)
        .spawn()
        .ok()
}

/// What the fault tasks share with the run.
struct Run {
    outbox: Outbox<Postgres>,
    rig: PgPool,
    destination: String,
    supervisor: Arc<Mutex<Supervisor>>,
    /// Poison messages: their ids and events, discarded by the operator.
    poison: Mutex<Vec<(uuid::Uuid, Event)>>,
    /// Events a killed in-memory broker had acknowledged.
    broker_lost: Mutex<HashSet<Event>>,
    /// Whether the topic was created again (a broker kill): its offsets started over.
    topic_recreated: AtomicBool,
    /// The writers' outbox (connections named `chaos-writer`, killed by `pg-kill`).
    writer: Outbox<Postgres>,
}

const PAD: usize = 200;

fn payload(key: &str, n: i32, pad: usize) -> String {
    format!(r#"{{"key":"{key}","n":{n},"pad":"{}"}}"#, "x".repeat(pad))
}

/// Commits event `(key, n)` with its business row; after an error whose outcome is
/// unknown (the connection died in the commit), asks the database whether it landed.
async fn write(run: &Run, key: &str, n: i32, pad: usize, hold: Duration) -> uuid::Uuid {
    loop {
        let attempt = async {
            let mut tx = run.writer.begin().await.map_err(|e| e.to_string())?;
            sqlx::query("INSERT INTO chaos_written (key, n) VALUES ($1, $2)")
                .bind(key)
                .bind(n)
                .execute(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
            let id = tx
                .emit_message(
                    OutboxMessage::new("Tick", run.destination.as_str(), payload(key, n, pad))
                        .with_key(key),
                )
                .map_err(|e| e.to_string())?;
            tokio::time::sleep(hold).await;
            tx.commit().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(id)
        };
        match attempt.await {
            Ok(id) => return id,
            Err(_) => loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let landed: Result<Option<i32>, _> =
                    sqlx::query_scalar("SELECT n FROM chaos_written WHERE key = $1 AND n = $2")
                        .bind(key)
                        .bind(n)
                        .fetch_optional(&run.rig)
                        .await;
                match landed {
                    Ok(Some(_)) => return uuid::Uuid::nil(),
                    Ok(None) => break,
                    Err(_) => continue,
                }
            },
        }
    }
}

async fn run_one(
    env: &mut Env,
    fault: &str,
    rng: &mut Rng,
    short: bool,
    wal: bool,
) -> Result<Report, String> {
    let started = Instant::now();
    let id = uuid::Uuid::now_v7().simple().to_string();
    let schema = format!("chaos_{}_{}", fault.replace('-', "_"), &id[20..]);
    let admin_pool = PgPool::connect(&env.database_url)
        .await
        .map_err(|e| format!("PostgreSQL at {}: {e}", env.database_url))?;
    sqlx::query(trusted_sql(format!("CREATE SCHEMA {schema}")))
        .execute(&admin_pool)
        .await
        .map_err(|e| e.to_string())?;
    let rig = procs::pool(&env.database_url, &schema, "chaos-rig", 4)
        .await
        .map_err(|e| e.to_string())?;
    let writer_pool = procs::pool(&env.database_url, &schema, "chaos-writer", 8)
        .await
        .map_err(|e| e.to_string())?;
    // WAL mode: the slot is named after the schema (both unique to the run).
    let slot = wal.then(|| schema.clone());
    let in_mode = |pool: PgPool| match &slot {
        Some(slot) => Outbox::<Postgres>::builder(pool)
            .wal_slot(slot)
            .build()
            .map_err(|e| e.to_string()),
        None => Ok(Outbox::<Postgres>::new(pool)),
    };
    let outbox = in_mode(rig.clone())?;
    outbox.migrate().await.map_err(|e| e.to_string())?;
    for ddl in [
        "CREATE TABLE chaos_written (key text, n int, PRIMARY KEY (key, n))",
        "CREATE TABLE chaos_consumed (pos bigserial PRIMARY KEY, id uuid NOT NULL, key text NOT NULL, n int NOT NULL)",
        "CREATE TABLE chaos_stats (consumer text, pid bigint, handled bigint, duplicates bigint, PRIMARY KEY (consumer, pid))",
        "CREATE TABLE chaos_acked (key text NOT NULL, n int NOT NULL, at timestamptz NOT NULL)",
    ] {
        sqlx::query(trusted_sql(ddl))
            .execute(&rig)
            .await
            .map_err(|e| e.to_string())?;
    }
    // The destination.
    let broker = env.broker_url();
    let (destination, relay_destination) = match env.kind {
        BrokerKind::Kafka => {
            let topic = format!("chaos.{schema}");
            outbox_tests::kafka::create_topic(&broker, &topic, 4).await;
            (topic.clone(), topic)
        }
        BrokerKind::Nats => {
            let stream = format!("CHAOS_{id}");
            let subject = format!("chaos-{id}.ticks");
            create_stream(&broker, &stream, &subject).await?;
            (subject.clone(), format!("{stream}/{subject}"))
        }
    };
    let kind = match env.kind {
        BrokerKind::Kafka => "kafka",
        BrokerKind::Nats => "nats",
    };
    let logs = env.logs.join(&schema);
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
    let proc = |what: &str, name: &str| Proc {
        name: name.to_owned(),
        args: [
            what.to_owned(),
            kind.to_owned(),
            env.database_url.clone(),
            schema.clone(),
            broker.clone(),
            relay_destination.clone(),
            name.to_owned(),
        ]
        .into_iter()
        .chain(slot.clone().filter(|_| what == "relay"))
        .collect(),
        child: None,
        held: false,
        log: logs.join(format!("{name}.log")),
    };
    let supervisor = Arc::new(Mutex::new(Supervisor {
        procs: vec![
            proc("relay", "chaos-relay-1"),
            proc("relay", "chaos-relay-2"),
            proc("consume", "chaos-consumer"),
        ],
    }));
    let run = Arc::new(Run {
        outbox,
        rig: rig.clone(),
        destination,
        supervisor: Arc::clone(&supervisor),
        poison: Mutex::new(Vec::new()),
        broker_lost: Mutex::new(HashSet::new()),
        topic_recreated: AtomicBool::new(false),
        writer: in_mode(writer_pool)?,
    });
    let done = Arc::new(AtomicBool::new(false));
    let supervising = {
        let (supervisor, done) = (Arc::clone(&supervisor), Arc::clone(&done));
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                supervisor.lock().unwrap_or_else(|p| p.into_inner()).tick();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // The operator: discards poison dead letters (checking that nothing of the key
    // overtook them first), and counts any other dead letter.
    let operator_state = Arc::new(Mutex::new((0usize, false)));
    let operating = {
        let (run, done, state) = (
            Arc::clone(&run),
            Arc::clone(&done),
            Arc::clone(&operator_state),
        );
        tokio::spawn(async move {
            let admin = Admin::new(run.outbox.clone());
            let mut released: HashSet<uuid::Uuid> = HashSet::new();
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let Ok(dead) = admin.dead(&ListFilter::default()).await else {
                    continue;
                };
                for message in dead {
                    let poison = run
                        .poison
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .iter()
                        .find(|(id, _)| *id == message.id)
                        .cloned();
                    match poison {
                        Some((id, (key, n))) => {
                            let later: Result<i64, _> = sqlx::query_scalar(
                                "SELECT count(*) FROM chaos_consumed WHERE key = $1 AND n > $2",
                            )
                            .bind(&key)
                            .bind(n)
                            .fetch_one(&run.rig)
                            .await;
                            if later.is_ok_and(|c| c > 0) {
                                state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
                            }
                            let _ = admin.discard(&[id]).await;
                        }
                        None => {
                            if released.insert(message.id) {
                                eprintln!(
                                    "chaos: unexpected dead letter {} ({:?}); released",
                                    message.id, message.partition_key
                                );
                                state.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
                            }
                            let _ = admin.release(&[message.id]).await;
                        }
                    }
                }
            }
        })
    };
    // The writers.
    let writing = Arc::new(AtomicBool::new(true));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (run, writing) = (Arc::clone(&run), Arc::clone(&writing));
            tokio::spawn(async move {
                let keys: Vec<String> = (0..KEYS)
                    .filter(|k| k % WRITERS == w)
                    .map(|k| format!("k{k:02}"))
                    .collect();
                let mut next = vec![0i32; keys.len()];
                let mut i = 0;
                while writing.load(Ordering::SeqCst) {
                    let k = i % keys.len();
                    write(&run, &keys[k], next[k], PAD, Duration::ZERO).await;
                    next[k] += 1;
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(4)).await;
                }
            })
        })
        .collect();

    // Warm up: the pipeline works end to end before the fault.
    wait_for(
        &rig,
        "SELECT count(*) >= 50 FROM chaos_consumed",
        Duration::from_secs(90),
    )
    .await
    .map_err(|e| format!("{fault}: the pipeline did not start: {e}"))?;
    let heal = inject(env, &run, fault, rng, short).await?;
    let recovered = recovery(&rig, heal).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    writing.store(false, Ordering::SeqCst);
    for w in writers {
        let _ = w.await;
    }

    // Drain, then wait for the consumer to apply everything the ledger expects.
    let _ = wait_for(
        &rig,
        "SELECT count(*) = 0 FROM outbox WHERE sent_at IS NULL AND dead_at IS NULL",
        Duration::from_secs(120),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut ledger = loop {
        let ledger = ledger_now(&run).await?;
        if ledger.lost.is_empty() || Instant::now() > deadline {
            break ledger;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Read the broker's log back while the broker still runs.
    let mut lost_where = Vec::new();
    if let (Some(broker), false) = (&env.kafka, ledger.lost.is_empty()) {
        let (lines, log) =
            locate_in_topic(broker.address(), &run.destination, &ledger.lost, &logs).await;
        lost_where = lines;
        // The broker's fetch skipped these (tansu): not a loss of ours, counted apart.
        // Not after the topic was created again: offsets then start over, and the
        // consumer's log mixes both.
        let consumer_log =
            std::fs::read_to_string(logs.join("chaos-consumer.log")).unwrap_or_default();
        let skipped = if run.topic_recreated.load(Ordering::SeqCst) {
            Vec::new()
        } else {
            ledger::skipped_by_fetch(&log, &ledger.lost, &ledger::received(&consumer_log))
        };
        for event in &skipped {
            lost_where.push(format!(
                "{}#{} was skipped by the broker's fetch: in its log, and the consumer received \
                 a later offset of its partition but never this one",
                event.0, event.1
            ));
        }
        ledger.lost.retain(|e| !skipped.contains(e));
        ledger.skipped_by_fetch = skipped.len();
    }
    done.store(true, Ordering::SeqCst);
    let _ = supervising.await;
    let _ = operating.await;
    supervisor
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .stop_all();
    if slot.is_some() {
        // A slot left behind would keep WAL on this server forever.
        let dropped = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match outbox_core::postgres::Slot::drop(&run.outbox).await {
                    Ok(_) => return Ok(()),
                    // Its relay's connection may still be closing.
                    Err(e) if e.to_string().contains("streams from") => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
        })
        .await;
        if let Ok(Err(e)) | Err(e) = dropped.map_err(|_| "timed out".to_owned()) {
            eprintln!("chaos: could not drop replication slot {schema}: {e}");
        }
    }
    let duplicates: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(duplicates), 0)::bigint FROM chaos_stats")
            .fetch_one(&rig)
            .await
            .unwrap_or(-1);
    let (unexpected_dead, overtook_poison) =
        *operator_state.lock().unwrap_or_else(|p| p.into_inner());
    // Commit to broker acknowledgement, per event (`created_at` is the transaction's
    // start, so a late writer's hold counts).
    let (p99, worst): (f64, f64) = sqlx::query_as(
        "SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at - created_at)), 0)::float8, \
                coalesce(max(extract(epoch FROM sent_at - created_at)), 0)::float8 \
         FROM outbox WHERE sent_at IS NOT NULL",
    )
    .fetch_one(&rig)
    .await
    .unwrap_or((-1.0, -1.0));
    let report = Report {
        fault: fault.to_owned(),
        ledger,
        duplicates,
        unexpected_dead,
        overtook_poison,
        latency: (
            Duration::from_secs_f64(p99.max(0.0)),
            Duration::from_secs_f64(worst.max(0.0)),
        ),
        recovered,
        took: started.elapsed(),
        lost_where,
    };
    // Clean up what holds: a failed run keeps its schema and logs to look at.
    if report.holds() && report.ledger.skipped_by_fetch == 0 {
        rig.close().await;
        run.writer.pool().close().await;
        let _ = sqlx::query(trusted_sql(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin_pool)
            .await;
        let _ = std::fs::remove_dir_all(&logs);
    } else {
        eprintln!(
            "chaos: kept schema {schema} and the process logs in {}",
            logs.display()
        );
    }
    Ok(report)
}

/// Where each lost event is in `topic`, read to its end: present (the relay's
/// acknowledgement was true and the consumer missed it) or absent (the broker did not keep
/// what it acknowledged, or nothing was sent). Writes the whole log, one line per message,
/// to `topic.txt` in `logs`, which a failed run keeps.
async fn locate_in_topic(
    brokers: String,
    topic: &str,
    lost: &[Event],
    logs: &std::path::Path,
) -> (Vec<String>, Vec<ledger::Logged>) {
    let t = topic.to_owned();
    let read = tokio::task::spawn_blocking(move || {
        let marks = outbox_tests::kafka::watermarks(&brokers, &t, Duration::from_secs(10));
        outbox_tests::kafka::read_to_end(
            &brokers,
            &t,
            Duration::from_secs(3),
            Duration::from_secs(120),
        )
        .map(|read| (read, marks))
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    let (read, marks) = match read {
        Ok(read) => read,
        Err(e) => {
            return (
                vec![format!("could not read {topic} back: {e}")],
                Vec::new(),
            );
        }
    };
    // What a consumer starting from "earliest" is told, beside what is there.
    let marks = match marks {
        Ok(marks) => marks
            .iter()
            .map(|(p, low, high)| {
                let first = read
                    .iter()
                    .filter(|m| m.partition == *p)
                    .map(|m| m.offset)
                    .min();
                format!("{p}: log start {low}, high watermark {high}, first offset read {first:?}")
            })
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) => format!("could not ask: {e}"),
    };
    let event_of = |payload: &str| -> Option<Event> {
        let v: serde_json::Value = serde_json::from_str(payload).ok()?;
        Some((
            v["key"].as_str()?.to_owned(),
            i32::try_from(v["n"].as_i64()?).ok()?,
        ))
    };
    let dump: String = read
        .iter()
        .map(|m| {
            let (key, n) = event_of(&m.payload).unwrap_or_default();
            format!("{} {} {key} {n} {}\n", m.partition, m.offset, m.id)
        })
        .collect();
    let file = logs.join("topic.txt");
    let dumped = match std::fs::write(&file, dump) {
        Ok(()) => format!("; the log is in {}", file.display()),
        Err(e) => format!("; could not write {}: {e}", file.display()),
    };
    let log: Vec<ledger::Logged> = read
        .iter()
        .map(|m| ledger::Logged {
            partition: m.partition,
            offset: m.offset,
            event: event_of(&m.payload),
        })
        .collect();
    let mut lines = vec![
        format!(
            "read {topic} back to its end from offset 0: {} messages{dumped}",
            read.len()
        ),
        format!("the broker's offsets per partition: {marks}"),
    ];
    lines.extend(ledger::locate(&log, lost));
    (lines, log)
}

async fn create_stream(url: &str, stream: &str, subject: &str) -> Result<(), String> {
    use async_nats::jetstream::{self, stream};
    let client = async_nats::connect(url).await.map_err(|e| e.to_string())?;
    jetstream::new(client)
        .create_stream(stream::Config {
            name: stream.to_owned(),
            subjects: vec![subject.to_owned()],
            duplicate_window: Duration::from_secs(120),
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("create stream {stream}: {e}"))?;
    Ok(())
}

/// Polls a boolean query until it is true.
async fn wait_for(pool: &PgPool, query: &str, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(true) = sqlx::query_scalar::<_, bool>(trusted_sql(query))
            .fetch_one(pool)
            .await
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("not within {timeout:?}: {query}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// From the end of the fault until everything committed before it was published.
async fn recovery(rig: &PgPool, heal: Instant) -> Option<Duration> {
    let last: i64 = loop {
        if let Ok(seq) = sqlx::query_scalar("SELECT coalesce(max(seq), 0) FROM outbox")
            .fetch_one(rig)
            .await
        {
            break seq;
        }
        if heal.elapsed() > Duration::from_secs(120) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let query = format!(
        "SELECT count(*) = 0 FROM outbox WHERE seq <= {last} AND sent_at IS NULL AND dead_at IS NULL"
    );
    wait_for(rig, &query, Duration::from_secs(120)).await.ok()?;
    Some(heal.elapsed())
}

async fn ledger_now(run: &Run) -> Result<Ledger, String> {
    let written: Vec<Event> = sqlx::query_as("SELECT key, n FROM chaos_written")
        .fetch_all(&run.rig)
        .await
        .map_err(|e| e.to_string())?;
    let applied: Vec<Event> = sqlx::query_as("SELECT key, n FROM chaos_consumed ORDER BY pos")
        .fetch_all(&run.rig)
        .await
        .map_err(|e| e.to_string())?;
    let discarded = run
        .poison
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(_, e)| e.clone())
        .collect();
    let acked_by_killed_broker = run
        .broker_lost
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(ledger::check(&ledger::Input {
        written,
        applied,
        discarded,
        acked_by_killed_broker,
    }))
}

/// Injects `fault`; returns when it ended (healed).
async fn inject(
    env: &mut Env,
    run: &Arc<Run>,
    fault: &str,
    rng: &mut Rng,
    short: bool,
) -> Result<Instant, String> {
    if fault == "mixed" {
        let rounds = if short { 3 } else { 6 };
        for _ in 0..rounds {
            let a = MIXABLE[rng.below(MIXABLE.len() as u64) as usize];
            // `a` may need the broker and its proxy (`&mut Env`); `b` runs beside it.
            let b = BESIDE[rng.below(BESIDE.len() as u64) as usize];
            eprintln!("chaos: mixed: {a} and {b}");
            let mut rng_b = Rng(rng.next() | 1);
            let (ra, rb) = tokio::join!(
                single(env, run, a, rng, true),
                single_shared(run, b, &mut rng_b)
            );
            ra?;
            rb?;
            tokio::time::sleep(rng.millis(500, 2000)).await;
        }
        return Ok(Instant::now());
    }
    single(env, run, fault, rng, short).await?;
    Ok(Instant::now())
}

/// A fault that needs no `&mut Env` (no broker kill), for the second half of `mixed`.
async fn single_shared(run: &Arc<Run>, fault: &str, rng: &mut Rng) -> Result<(), String> {
    match fault {
        "relay-kill" => relay_kills(run, rng, 2).await,
        "pg-kill" => pg_kills(run, 1).await,
        "late-writer" => late_writers(run, 1).await,
        "consumer-kill" => consumer_kills(run, rng, 1).await,
        other => Err(format!("{other} cannot run beside another fault")),
    }
}

async fn single(
    env: &mut Env,
    run: &Arc<Run>,
    fault: &str,
    rng: &mut Rng,
    short: bool,
) -> Result<(), String> {
    match fault {
        "relay-kill" => relay_kills(run, rng, if short { 5 } else { 20 }).await,
        "relay-stop" => {
            let i = rng.below(2) as usize;
            {
                let mut s = run.supervisor.lock().unwrap_or_else(|p| p.into_inner());
                s.procs[i].held = true;
                s.signal(i, "-STOP");
            }
            // Longer than the takeover bound: the other relay takes the key over; the
            // stopped one must not publish after it lost them (fencing).
            tokio::time::sleep(SESSION_TIMEOUT + Duration::from_secs(3)).await;
            let mut s = run.supervisor.lock().unwrap_or_else(|p| p.into_inner());
            s.signal(i, "-CONT");
            s.procs[i].held = false;
            Ok(())
        }
        "broker-kill" => {
            env.kill_broker();
            tokio::time::sleep(if short {
                Duration::from_secs(3)
            } else {
                Duration::from_secs(8)
            })
            .await;
            env.restart_broker().await;
            let restarted: chrono::DateTime<chrono::Utc> = now(&run.rig).await;
            if env.kind == BrokerKind::Kafka {
                // In memory: the operator re-creates the topic. What it had acknowledged
                // before it died is the broker's loss, unless it was consumed.
                run.topic_recreated.store(true, Ordering::SeqCst);
                outbox_tests::kafka::create_topic(&env.broker_url(), &run.destination, 4).await;
                // Marked sent in table mode; recorded by the relays in WAL mode.
                let acked: Vec<Event> = sqlx::query_as(
                    "SELECT convert_from(body, 'UTF8')::json->>'key', \
                            (convert_from(body, 'UTF8')::json->>'n')::int FROM outbox \
                     WHERE sent_at IS NOT NULL AND sent_at <= $1 \
                     UNION ALL SELECT key, n FROM chaos_acked WHERE at <= $1",
                )
                .bind(restarted)
                .fetch_all(&run.rig)
                .await
                .map_err(|e| e.to_string())?;
                run.broker_lost
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(acked);
            }
            Ok(())
        }
        "broker-stall" => {
            env.proxy.set(Mode::Stall);
            tokio::time::sleep(rng.millis(3000, 8000)).await;
            env.proxy.set(Mode::Forward);
            Ok(())
        }
        "broker-reset" => {
            for _ in 0..5 {
                env.proxy.reset();
                tokio::time::sleep(rng.millis(300, 1200)).await;
            }
            Ok(())
        }
        "pg-kill" => pg_kills(run, 3).await,
        "pg-restart" => {
            pg_restart()?;
            Ok(())
        }
        "late-writer" => late_writers(run, 2).await,
        "oversized" => {
            for n in 0..8 {
                let big = n == 3;
                let pad = if big { 1_500_000 } else { PAD };
                let id = write(run, "poison", n, pad, Duration::ZERO).await;
                if big {
                    run.poison
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((id, ("poison".to_owned(), n)));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // The operator discards the poison; its successors then go out.
            wait_for(
                &run.rig,
                "SELECT count(*) = 4 FROM chaos_consumed WHERE key = 'poison' AND n > 3",
                Duration::from_secs(60),
            )
            .await
        }
        "consumer-kill" => consumer_kills(run, rng, if short { 3 } else { 8 }).await,
        other => Err(format!("unknown fault {other}")),
    }
}

async fn now(pool: &PgPool) -> chrono::DateTime<chrono::Utc> {
    loop {
        if let Ok(t) = sqlx::query_scalar("SELECT now()").fetch_one(pool).await {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn relay_kills(run: &Arc<Run>, rng: &mut Rng, times: usize) -> Result<(), String> {
    for _ in 0..times {
        let i = rng.below(2) as usize;
        run.supervisor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .kill(i);
        tokio::time::sleep(rng.millis(300, 1500)).await;
    }
    Ok(())
}

async fn consumer_kills(run: &Arc<Run>, rng: &mut Rng, times: usize) -> Result<(), String> {
    for _ in 0..times {
        run.supervisor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .kill(2);
        tokio::time::sleep(rng.millis(1000, 2500)).await;
    }
    Ok(())
}

/// Terminates every connection of the relays, the consumer and the writers.
async fn pg_kills(run: &Arc<Run>, times: usize) -> Result<(), String> {
    for _ in 0..times {
        let killed: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND application_name LIKE 'chaos-%' AND application_name <> 'chaos-rig'",
        )
        .fetch_one(&run.rig)
        .await;
        eprintln!("chaos: pg-kill: {killed:?} connections terminated");
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    Ok(())
}

/// Writers whose transactions stay open for seconds while others commit after them.
async fn late_writers(run: &Arc<Run>, times: i32) -> Result<(), String> {
    let tasks: Vec<_> = (0..times)
        .map(|i| {
            let run = Arc::clone(run);
            tokio::spawn(async move {
                for n in 0..2 {
                    write(&run, &format!("late-{i}"), n, PAD, Duration::from_secs(4)).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Restarts the machine's PostgreSQL cluster (`pg_ctlcluster`), as `scripts/services.sh`
/// starts it.
fn pg_restart() -> Result<(), String> {
    let version = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("pg-restart needs a pg_ctlcluster installation: {e}"))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .max_by_key(|v| v.parse::<u32>().unwrap_or(0))
        .ok_or("pg-restart: no cluster under /etc/postgresql")?;
    let status = Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "restart",
            "-m",
            "immediate",
        ])
        .status()
        .map_err(|e| format!("pg_ctlcluster: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("pg_ctlcluster {version} main restart: {status}"))
    }
}
