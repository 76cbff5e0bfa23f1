//! `outbox relay`: the relay as a process of its own (docs/relay.md, "The relay as a
//! process"). Its settings come from the command line, the environment and a TOML file,
//! in that order of precedence ([`prepare`]); it serves `/metrics`, `/healthz` and
//! `/readyz`, and stops on SIGTERM or Ctrl-C within `shutdown_timeout`.

// A build without any broker feature parses the settings and refuses to run.
#![cfg_attr(
    not(any(feature = "kafka", feature = "nats", feature = "rabbitmq")),
    allow(dead_code, unused_variables)
)]

mod publisher;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use outbox_core::Outbox;
use outbox_core::relay::{Relay, RelayConfig, RelayStatsSnapshot, Tenants};
use outbox_core::store::Backend;
use serde::Deserialize;

use crate::cli::{Cli, Command, RelayArgs};
use crate::failure::{Failure, Result};
use crate::settings::{BrokerKind, LogFormat, Settings, Tenancy};
use crate::time::parse_duration;

/// Where the endpoints are served unless told otherwise.
const LISTEN: &str = "127.0.0.1:9464";
/// How long a relay has to stop after SIGTERM unless told otherwise: above the relay's
/// own bound with the default settings (`publish_timeout` + `connect_timeout`, 40 s).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(45);

/// The TOML file of `--config`: every setting of `outbox relay`, under its option's name
/// with `_` for `-`, and the database's (`database_url`, `table`, `wal`, `wal_slot`)
/// when the command line and environment do not give them. Unknown names are refused.
/// (No `Debug`: it holds passwords.)
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    database_url: Option<String>,
    table: Option<String>,
    wal: Option<bool>,
    wal_slot: Option<String>,
    broker: Option<BrokerKind>,
    broker_url: Option<String>,
    #[serde(default)]
    broker_settings: BTreeMap<String, String>,
    #[serde(default)]
    destinations: Vec<String>,
    listen: Option<SocketAddr>,
    batch_size: Option<usize>,
    max_attempts: Option<i32>,
    poll_interval: Option<String>,
    partitions: Option<u16>,
    cloudevents_source: Option<String>,
    #[serde(default)]
    tenants: Vec<String>,
    tenants_query: Option<String>,
    log_format: Option<LogFormat>,
    shutdown_timeout: Option<String>,
}

/// Whether `option` was given on the command line or `variable` in the environment.
fn given(option: &str, variable: Option<&str>) -> bool {
    variable.is_some_and(|v| std::env::var_os(v).is_some())
        || std::env::args_os().any(|a| {
            let a = a.to_string_lossy();
            a == option || a.starts_with(&format!("{option}="))
        })
}

/// A TOML error's message without the value it quotes (a type error quotes the value,
/// which may be a password): `invalid type: integer `123456`, expected ...` loses the
/// value; the other messages (unknown keys, syntax) keep their names.
fn without_value(message: &str) -> String {
    let message = message.replace('\n', " ");
    if !(message.starts_with("invalid type") || message.starts_with("invalid value")) {
        return message;
    }
    match message.split_once('`') {
        Some((before, rest)) => match rest.split_once('`') {
            Some((_, after)) => format!("{before}(value not shown){after}"),
            None => before.to_owned(),
        },
        None => message,
    }
}

/// Reads the file of `--config`, if any, and merges it under the command line and the
/// environment: the relay's settings into `args.settings`, the database's into `cli`.
/// Every missing or bad setting is an error naming the option, the variable and the
/// file's key.
pub fn prepare(cli: &mut Cli) -> Result {
    let json = cli.json;
    let Command::Relay(args) = &mut cli.command else {
        return Ok(());
    };
    let file = match &args.config {
        None => File::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Failure::Message(format!(
                    "cannot read the relay's config file {}: {e}",
                    path.display()
                ))
            })?;
            // The parser's message and the line, not its rendering of the line: that
            // line may hold a password.
            toml::from_str(&text).map_err(|e: toml::de::Error| {
                let line = e.span().map_or(String::new(), |span| {
                    let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                    format!(" (line {line})")
                });
                Failure::Message(format!(
                    "the relay's config file {} is not valid{line}: {}",
                    path.display(),
                    without_value(e.message())
                ))
            })?
        }
    };
    if cli.database_url.is_none() {
        cli.database_url = file.database_url;
    }
    if let Some(table) = file.table
        && !given("--table", Some("OUTBOX_TABLE"))
    {
        cli.table = table;
    }
    if !cli.wal && !given("--wal", None) {
        cli.wal = file.wal.unwrap_or(false);
    }
    if cli.wal_slot.is_none() {
        cli.wal_slot = file.wal_slot;
    }
    let duration = |key: &str, text: Option<String>| -> Result<Option<Duration>> {
        text.map(|t| {
            parse_duration(&t)
                .map_err(|e| Failure::Message(format!("`{key}` in the relay's config file: {e}")))
        })
        .transpose()
    };
    let broker = args.broker.or(file.broker).ok_or_else(|| {
        Failure::Message(
            "no broker given; pass --broker kafka|nats|rabbitmq, set OUTBOX_BROKER, or \
             `broker` in the config file"
                .to_owned(),
        )
    })?;
    let broker_url = args
        .broker_url
        .clone()
        .or(file.broker_url)
        .filter(|u| !u.trim().is_empty())
        .ok_or_else(|| {
            Failure::Message(
                "no broker address given; pass --broker-url, set OUTBOX_BROKER_URL, or \
                 `broker_url` in the config file"
                    .to_owned(),
            )
        })?;
    let mut broker_settings: BTreeMap<String, String> = file.broker_settings;
    for (i, setting) in args.broker_settings.iter().enumerate() {
        // Not shown: without its `=`, where its name ends is unknown, and its value may
        // be a password.
        let (name, value) = setting.split_once('=').ok_or_else(|| {
            Failure::Message(format!(
                "--broker-setting number {} is not name=value (not shown: it may hold a secret)",
                i + 1
            ))
        })?;
        broker_settings.insert(name.trim().to_owned(), value.to_owned());
    }
    let mut destinations = file.destinations;
    destinations.extend(args.destinations.iter().cloned());
    let tenancy = if !args.tenants.is_empty() {
        Tenancy::Names(args.tenants.clone())
    } else if let Some(query) = args.tenants_query.clone() {
        Tenancy::Query(query)
    } else if !file.tenants.is_empty() && file.tenants_query.is_some() {
        return Err(Failure::Message(
            "the relay's config file has both `tenants` and `tenants_query`; keep one".to_owned(),
        ));
    } else if !file.tenants.is_empty() {
        Tenancy::Names(file.tenants)
    } else if let Some(query) = file.tenants_query {
        Tenancy::Query(query)
    } else {
        Tenancy::One
    };
    let cloudevents = args
        .cloudevents_source
        .clone()
        .or(file.cloudevents_source)
        .map(|source| publisher::cloudevents(&source))
        .transpose()?;
    args.settings = Settings {
        broker: Some(broker),
        broker_url,
        broker_settings: broker_settings.into_iter().collect(),
        destinations,
        listen: args.listen.or(file.listen),
        batch_size: args.batch_size.or(file.batch_size),
        max_attempts: args.max_attempts.or(file.max_attempts),
        poll_interval: args
            .poll_interval
            .or(duration("poll_interval", file.poll_interval)?),
        partitions: args.partitions.or(file.partitions),
        cloudevents,
        tenancy,
        log_format: args.log_format.or(file.log_format).unwrap_or_default(),
        shutdown_timeout: args
            .shutdown_timeout
            .or(duration("shutdown_timeout", file.shutdown_timeout)?)
            .unwrap_or(SHUTDOWN_TIMEOUT),
        json,
    };
    Ok(())
}

/// What the endpoints read: each relay's counters (one, or one per tenant), and whether
/// the process is stopping or its relay has ended.
struct Health {
    stats: Box<dyn Fn() -> BTreeMap<String, RelayStatsSnapshot> + Send + Sync>,
    stopping: AtomicBool,
    /// The relay task ended by itself (a panic): the process is not alive any more.
    ended: AtomicBool,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
}

/// A running relay: one, or one of many outboxes.
enum Running {
    One(outbox_core::RelayHandle),
    Tenants(outbox_core::relay::TenantsHandle),
}

impl Running {
    async fn shutdown(self) {
        match self {
            Running::One(handle) => handle.shutdown().await,
            Running::Tenants(handle) => handle.shutdown().await,
        }
    }

    fn is_finished(&self) -> bool {
        match self {
            Running::One(handle) => handle.is_finished(),
            Running::Tenants(handle) => handle.is_finished(),
        }
    }
}

/// What is ready before the relay starts: the endpoints' listener (a port in use is an
/// error before anything runs) and the metrics recorder; [`start`] connects the broker too.
struct Started {
    listener: tokio::net::TcpListener,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
}

async fn start(settings: &Settings) -> Result<(Started, publisher::AnyPublisher)> {
    let listen = match settings.listen {
        Some(listen) => listen,
        None => LISTEN.parse().expect("a socket address"),
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure::Message(format!("cannot listen on {listen}: {e}")))?;
    let metrics = install_metrics()?;
    let publisher = publisher::connect(settings).await?;
    Ok((Started { listener, metrics }, publisher))
}

/// `outbox relay` for the outbox of `--table` (any database).
pub async fn run<DB: Backend>(
    args: &RelayArgs,
    outbox: Outbox<DB>,
    out: &mut impl Write,
) -> Result {
    let settings = &args.settings;
    if !matches!(settings.tenancy, Tenancy::One) {
        return Err(Failure::Message(
            "a relay of many outboxes (--tenant, --tenants-query) is PostgreSQL only; \
             run one relay per outbox on this database"
                .to_owned(),
        ));
    }
    let (started, publisher) = start(settings).await?;
    let name = outbox.tables().outbox.to_string();
    let mut builder = Relay::builder(outbox, publisher);
    if let Some(n) = settings.batch_size {
        builder = builder.batch_size(n);
    }
    if let Some(n) = settings.max_attempts {
        builder = builder.max_attempts(n);
    }
    if let Some(d) = settings.poll_interval {
        builder = builder.poll_interval(d);
    }
    if let Some(n) = settings.partitions {
        builder = builder.partitions(n);
    }
    let handle = builder.spawn();
    let stats = handle.stats_source();
    let stats = Box::new(move || BTreeMap::from([(name.clone(), stats())]));
    serve(settings, started, stats, Running::One(handle), out).await
}

/// `outbox relay` on PostgreSQL: one outbox, or many (`--tenant`, `--tenants-query`).
pub async fn run_postgres(
    args: &RelayArgs,
    outbox: Outbox<outbox_core::sqlx::Postgres>,
    out: &mut impl Write,
) -> Result {
    let settings = &args.settings;
    let names = match &settings.tenancy {
        Tenancy::One => return run(args, outbox, out).await,
        Tenancy::Names(names) => Some(names.clone()),
        Tenancy::Query(_) => None,
    };
    if outbox.options().wal.is_some() {
        return Err(Failure::Message(
            "a relay of many outboxes does not serve WAL-mode outboxes; run one relay per \
             WAL-mode outbox (without --tenant and --tenants-query)"
                .to_owned(),
        ));
    }
    let (started, publisher) = start(settings).await?;
    let mut config = RelayConfig::default();
    config.poll_interval = settings.poll_interval.unwrap_or(
        <outbox_core::sqlx::Postgres as outbox_core::store::session::Source>::POLL_INTERVAL,
    );
    if let Some(n) = settings.batch_size {
        config.batch_size = n.max(1);
    }
    if let Some(n) = settings.max_attempts {
        config.max_attempts = n.max(1);
    }
    if let Some(n) = settings.partitions {
        config.partitions = n.max(1);
    }
    let pool = outbox.pool().clone();
    let builder = Tenants::builder(publisher).config(config);
    let builder = match (names, &settings.tenancy) {
        (Some(names), _) => builder.outboxes(pool, names),
        (None, Tenancy::Query(query)) => builder.discover(pool, query.clone()),
        (None, _) => unreachable!("tenancy checked above"),
    };
    let handle = builder.spawn()?;
    let stats = Box::new(handle.stats_source());
    serve(settings, started, stats, Running::Tenants(handle), out).await
}

/// The Prometheus recorder, installed as the process's.
fn install_metrics() -> Result<metrics_exporter_prometheus::PrometheusHandle> {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|e| Failure::Message(format!("cannot install the metrics recorder: {e}")))?;
    outbox_core::telemetry::describe_metrics();
    Ok(handle)
}

/// How long the endpoints' server has to end its connections after the relay stopped.
const SERVER_GRACE: Duration = Duration::from_secs(5);

/// Serves the endpoints until SIGTERM or Ctrl-C (or the relay's end), then stops the
/// relay within `shutdown_timeout`; a second signal exits at once.
async fn serve(
    settings: &Settings,
    started: Started,
    stats: Box<dyn Fn() -> BTreeMap<String, RelayStatsSnapshot> + Send + Sync>,
    running: Running,
    out: &mut impl Write,
) -> Result {
    let Started { listener, metrics } = started;
    let health = Arc::new(Health {
        stats,
        stopping: AtomicBool::new(false),
        ended: AtomicBool::new(false),
        metrics,
    });
    let address = listener.local_addr()?;
    if settings.json {
        let line = serde_json::json!({
            "listening": address.to_string(),
            "endpoints": ["/metrics", "/healthz", "/readyz"],
        });
        writeln!(out, "{line}")?;
    } else {
        writeln!(
            out,
            "outbox relay: serving http://{address}/metrics, /healthz and /readyz"
        )?;
    }
    out.flush()?;
    let broker = settings
        .broker
        .map(|b| format!("{b:?}").to_lowercase())
        .unwrap_or_default();
    tracing::info!(%address, %broker, "outbox relay started");
    let router = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(alive))
        .route("/readyz", get(ready))
        .with_state(Arc::clone(&health));
    let (stop_server, server_stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = server_stopped.await;
            })
            .await
    });
    // Until a signal, or the relay's task ending by itself (it only does on a panic).
    let mut check = tokio::time::interval(Duration::from_millis(500));
    let signalled = loop {
        tokio::select! {
            () = crate::serve::stop_signal() => break true,
            _ = check.tick() => if running.is_finished() { break false },
        }
    };
    health.stopping.store(true, Ordering::Relaxed);
    let result = if signalled {
        tracing::info!(
            timeout = ?settings.shutdown_timeout,
            "outbox relay: stopping; publishing and recording what it holds (a second signal exits at once)"
        );
        tokio::select! {
            stopped = tokio::time::timeout(settings.shutdown_timeout, running.shutdown()) => match stopped {
                Ok(()) => {
                    tracing::info!("outbox relay stopped");
                    Ok(())
                }
                Err(_) => Err(Failure::Message(format!(
                    "the relay did not stop within {}; what it had not recorded is published \
                     again by the next relay (raise --shutdown-timeout to give it longer)",
                    crate::progress::human(settings.shutdown_timeout)
                ))),
            },
            () = crate::serve::stop_signal() => Err(Failure::Message(
                "a second signal: exiting without waiting for the relay; what it had not \
                 recorded is published again by the next relay"
                    .to_owned(),
            )),
        }
    } else {
        health.ended.store(true, Ordering::Relaxed);
        Err(Failure::Message(
            "the relay's task ended by itself (a panic: its message is in the log above); \
             exiting so that the supervisor starts it again"
                .to_owned(),
        ))
    };
    let _ = stop_server.send(());
    let _ = tokio::time::timeout(SERVER_GRACE, server).await;
    result
}

/// `/healthz`: 200 while the process runs its relay; 503 once the relay's task ended.
async fn alive(State(health): State<Arc<Health>>) -> impl IntoResponse {
    if health.ended.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "the relay ended\n")
    } else {
        (StatusCode::OK, "ok\n")
    }
}

/// `/metrics`: the Prometheus text exposition format.
async fn metrics_page(State(health): State<Arc<Health>>) -> impl IntoResponse {
    health.metrics.run_upkeep();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        health.metrics.render(),
    )
}

/// `/readyz`: 200 while every relay has its database session (working, or standing by
/// for its slot or partitions) and the broker answered its last batch; 503 otherwise,
/// and from SIGTERM on. The body says which, per outbox.
async fn ready(State(health): State<Arc<Health>>) -> impl IntoResponse {
    let stats = (health.stats)();
    let stopping = health.stopping.load(Ordering::Relaxed);
    let outboxes: BTreeMap<&String, serde_json::Value> = stats
        .iter()
        .map(|(name, s)| {
            (
                name,
                serde_json::json!({
                    "connected": s.connected,
                    "broker_unavailable": s.broker_unavailable,
                    "published": s.published,
                    "dead": s.dead,
                }),
            )
        })
        .collect();
    let ready = !stopping
        && !stats.is_empty()
        && stats.values().all(|s| s.connected && !s.broker_unavailable);
    let body = serde_json::json!({
        "ready": ready,
        "stopping": stopping,
        "outboxes": outboxes,
    });
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body))
}
