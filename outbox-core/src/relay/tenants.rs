//! One relay process for many outboxes (tenants): one schema each in a database, or
//! several databases. See [docs/relay.md](https://github.com/outbox-rs/outbox/blob/main/docs/relay.md), "Many outboxes, one relay".
//!
//! Every tenant runs the one relay loop (`run.rs`) in *turns*. A turn takes a connection
//! from its database's hub ([`Shared`]), in the order tenants asked for one, and lasts
//! until the tenant has nothing to do (it *parks*: the connection goes back, and the
//! hub's control connection wakes it on its next commit) or, while another tenant waits,
//! until its `turn` is up (it yields and queues again at the back). So a database serves
//! any number of tenants with `connections + 1` connections, and a flooded tenant holds
//! one connection at a time, for one turn at a time. A tenant whose turn is up while
//! the broker has its batches does not wait for the broker on the connection: the
//! publish goes on without it, and the tenant queues again to record the outcomes
//! (before it claims anything) once the broker has answered.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::drain::{Detached, record_outcomes};
use super::run::{Exit, RECONNECT_FIRST, Turn, WORKED_A_WHILE};
use super::{Relay, RelayStats, RelayStatsSnapshot};
use crate::backoff::Backoff;
use crate::config::RelayConfig;
use crate::publisher::Publisher;
use crate::store::Backend;
use crate::store::session::{Outcome, Session, SessionError, SessionResult, Shared, Source};
use crate::task::{TaskHandle, stopped};
use crate::{Error, Outbox};

use super::{Destinations, OTHER};

/// A relay for many outboxes in one process. Start with [`Tenants::builder`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> outbox_core::Result<()> {
/// use outbox_core::publisher::InMemoryPublisher;
/// use outbox_core::relay::Tenants;
///
/// let relay = Tenants::builder(InMemoryPublisher::new())
///     .connections(4)
///     // Every schema with an outbox table, looked up again every minute.
///     .discover(
///         pool,
///         "SELECT table_schema || '.outbox' FROM information_schema.tables \
///          WHERE table_name = 'outbox' ORDER BY 1",
///     )
///     .spawn()?;
/// // ... later, on shutdown:
/// relay.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Tenants;

impl Tenants {
    /// Starts configuring a relay from many outboxes to `publisher` (cloned for each
    /// tenant; publishers share their connection to the broker when cloned).
    pub fn builder<P: Publisher + Clone, DB: Backend + Shared>(
        publisher: P,
    ) -> TenantsBuilder<P, DB> {
        TenantsBuilder {
            publisher,
            config: RelayConfig {
                poll_interval: <DB as Source>::POLL_INTERVAL,
                ..RelayConfig::default()
            },
            databases: Vec::new(),
            connections: 4,
            turn: Duration::from_millis(100),
            labelled: 20,
            labelled_destinations: super::LABELLED_DESTINATIONS,
            rediscover: Duration::from_secs(60),
        }
    }
}

/// Where a database's tenants come from.
enum List {
    /// Outbox tables named in the configuration.
    Names(Vec<String>),
    /// A query returning the outbox tables' names, one per row (first column, text).
    Query(String),
}

/// Configures a relay for many outboxes.
#[must_use = "a builder does nothing until it is built or spawned"]
pub struct TenantsBuilder<P, DB: Backend> {
    publisher: P,
    config: RelayConfig,
    databases: Vec<(sqlx::Pool<DB>, List)>,
    connections: u32,
    turn: Duration,
    labelled: usize,
    labelled_destinations: usize,
    rediscover: Duration,
}

impl<P, DB: Backend> fmt::Debug for TenantsBuilder<P, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantsBuilder")
            .field("config", &self.config)
            .field("databases", &self.databases.len())
            .field("connections", &self.connections)
            .field("turn", &self.turn)
            .finish_non_exhaustive()
    }
}

impl<P: Publisher + Clone, DB: Backend + Shared> TenantsBuilder<P, DB> {
    /// Serves the outbox tables `tables` (names as for `OutboxBuilder::table`, such as
    /// `"acme.outbox"`) of the database `pool` points at. The pool itself only runs
    /// [`discover`](Self::discover) queries; the relay's sessions use connections of
    /// their own (see [`connections`](Self::connections)).
    pub fn outboxes<I, S>(mut self, pool: sqlx::Pool<DB>, tables: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let names = tables.into_iter().map(Into::into).collect();
        self.databases.push((pool, List::Names(names)));
        self
    }

    /// Serves the outbox tables that `query` names (one per row, in its first column, as
    /// text) in the database `pool` points at. The query runs at start and every
    /// [`rediscover_every`](Self::rediscover_every): tenants it no longer names are
    /// stopped (after their batch in flight), new ones start.
    pub fn discover(mut self, pool: sqlx::Pool<DB>, query: impl Into<String>) -> Self {
        self.databases.push((pool, List::Query(query.into())));
        self
    }

    /// Session connections per database (at least 1; default 4), shared by its tenants in
    /// turn. The relay opens one more per database, the control connection, which
    /// listens for every tenant's commits.
    pub fn connections(mut self, n: u32) -> Self {
        self.connections = n.max(1);
        self
    }

    /// How long a tenant keeps a connection while others wait for one (default 100 ms):
    /// its drain stops claiming ahead then, and the tenant queues again once its batches
    /// are recorded.
    pub fn turn(mut self, d: Duration) -> Self {
        self.turn = d.max(Duration::from_millis(1));
        self
    }

    /// How many tenants get a metrics label of their own (`tenant` = the outbox table's
    /// name, or `<database>/<table>` with several databases); default 20. The others
    /// share `tenant="other"`: their counters and histograms add up there, and their
    /// gauges are not reported (one tenant's value would overwrite another's).
    pub fn labelled_tenants(mut self, n: usize) -> Self {
        self.labelled = n;
        self
    }

    /// How many destinations get a `destination` label of their own, across all tenants
    /// (default 32; the rest share `destination="other"`); see
    /// [`RelayBuilder::labelled_destinations`](super::RelayBuilder::labelled_destinations).
    pub fn labelled_destinations(mut self, n: usize) -> Self {
        self.labelled_destinations = n;
        self
    }

    /// How often [`discover`](Self::discover) queries run again, and outboxes named in
    /// [`outboxes`](Self::outboxes) that could not start (a table not migrated yet) are
    /// tried again (default 60 s).
    pub fn rediscover_every(mut self, d: Duration) -> Self {
        self.rediscover = d.max(Duration::from_millis(10));
        self
    }

    /// Every tenant's relay settings (batch size, timeouts, retries, ...), as for one
    /// relay. `partitions` applies per outbox.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Starts the relay on the current tokio runtime.
    ///
    /// # Errors
    /// A table name given to [`outboxes`](Self::outboxes) that is not a valid name, or no
    /// database given. (Databases that cannot be reached yet are retried in the
    /// background, as one relay retries its session.)
    pub fn spawn(self) -> crate::Result<TenantsHandle> {
        crate::telemetry::describe_metrics();
        if self.databases.is_empty() {
            return Err(Error::InvalidArgument(
                "a relay of many outboxes needs at least one database: call \
                 TenantsBuilder::outboxes or TenantsBuilder::discover"
                    .into(),
            ));
        }
        for (pool, list) in &self.databases {
            if let List::Names(names) = list {
                for name in names {
                    outbox_of(pool, name)?;
                }
            }
        }
        let several = self.databases.len() > 1;
        let shared = Arc::new(Common {
            publisher: self.publisher,
            config: self.config,
            connections: self.connections,
            turn: self.turn,
            labelled: self.labelled,
            named: AtomicUsize::new(0),
            destinations: Destinations::new(self.labelled_destinations),
            rediscover: self.rediscover,
            stats: Mutex::new(BTreeMap::new()),
        });
        let stats = Arc::clone(&shared);
        let databases = self.databases;
        let task = TaskHandle::spawn(move |shutdown| async move {
            let runs = databases.into_iter().map(|(pool, list)| {
                let prefix = several.then(|| <DB as crate::store::Database>::database_name(&pool));
                run_database(Arc::clone(&shared), pool, list, prefix, shutdown.clone())
            });
            futures_util::future::join_all(runs).await;
        });
        Ok(TenantsHandle {
            task,
            stats: Arc::new(move || {
                stats
                    .stats
                    .lock()
                    .map(|s| s.iter().map(|(k, v)| (k.clone(), v.snapshot())).collect())
                    .unwrap_or_default()
            }),
        })
    }
}

/// What every tenant of the relay shares.
struct Common<P> {
    publisher: P,
    config: RelayConfig,
    connections: u32,
    turn: Duration,
    labelled: usize,
    /// Tenants labelled so far.
    named: AtomicUsize,
    /// The destinations labelled so far, by all tenants.
    destinations: Arc<Destinations>,
    rediscover: Duration,
    stats: Mutex<BTreeMap<String, Arc<RelayStats>>>,
}

/// Controls a spawned relay of many outboxes.
#[must_use = "dropping the handle detaches the relay: it runs until the runtime ends, and cannot be stopped gracefully; keep it and call `shutdown`"]
pub struct TenantsHandle {
    task: TaskHandle,
    stats: Arc<dyn Fn() -> BTreeMap<String, RelayStatsSnapshot> + Send + Sync>,
}

impl fmt::Debug for TenantsHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantsHandle")
            .field("task", &self.task)
            .finish_non_exhaustive()
    }
}

impl TenantsHandle {
    /// Asks every tenant to stop after its batch in flight and waits until all have.
    pub async fn shutdown(self) {
        self.task.shutdown().await;
    }

    /// Whether the relay has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Each tenant's counters, by its name (the outbox table, or `<database>/<table>`
    /// with several databases).
    pub fn stats(&self) -> BTreeMap<String, RelayStatsSnapshot> {
        (self.stats)()
    }

    /// A reader of [`stats`](Self::stats) that outlives the handle: for a health
    /// endpoint that answers while [`shutdown`](Self::shutdown) has the handle.
    pub fn stats_source(
        &self,
    ) -> impl Fn() -> BTreeMap<String, RelayStatsSnapshot> + Send + Sync + 'static {
        let stats = Arc::clone(&self.stats);
        move || stats()
    }
}

fn outbox_of<DB: Backend>(pool: &sqlx::Pool<DB>, table: &str) -> crate::Result<Outbox<DB>> {
    Outbox::builder(pool.clone()).table(table).build()
}

/// Connects a database's hub (retrying until it answers), then runs its tenants, keeping
/// them in step with the tenant list, until shutdown.
async fn run_database<P: Publisher + Clone, DB: Backend + Shared>(
    common: Arc<Common<P>>,
    pool: sqlx::Pool<DB>,
    list: List,
    prefix: Option<String>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(RECONNECT_FIRST, common.config.reconnect_delay);
    let hub = loop {
        let connect = <DB as Shared>::hub(&pool, &common.config, common.connections);
        let failed = match tokio::time::timeout(common.config.connect_timeout, connect).await {
            Ok(Ok(hub)) => break Arc::new(hub),
            Ok(Err(e)) => e,
            Err(_) => SessionError::timed_out(
                "the database while the relay connected its hub",
                common.config.connect_timeout,
            ),
        };
        let delay = backoff.next();
        tracing::error!(error = %crate::ErrorChain(&failed), retry_in = ?delay, "outbox relay of many outboxes: cannot connect to a database; retrying");
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stopped(&mut shutdown) => return,
        }
    };
    let mut running: HashMap<String, TaskHandle> = HashMap::new();
    loop {
        // A named outbox that could not start (not migrated yet, say) is tried again.
        let mut missing = false;
        let names = match &list {
            List::Names(names) => Ok(names.clone()),
            List::Query(query) => {
                let timeout = common.config.connect_timeout;
                tokio::select! {
                    found = tokio::time::timeout(timeout, <DB as Shared>::discover(&pool, query)) => {
                        found.unwrap_or_else(|_| {
                            Err(SessionError::timed_out("the database to the discovery query", timeout))
                        })
                    }
                    () = stopped(&mut shutdown) => break,
                }
            }
        };
        match names {
            Ok(names) => {
                let wanted: std::collections::HashSet<&String> = names.iter().collect();
                let gone: Vec<String> = running
                    .keys()
                    .filter(|n| !wanted.contains(n))
                    .cloned()
                    .collect();
                for name in gone {
                    if let Some(task) = running.remove(&name) {
                        tracing::info!(outbox = %name, "outbox relay: the tenant list no longer names this outbox; stopping it");
                        task.shutdown().await;
                        if let Ok(outbox) = outbox_of(&pool, &name) {
                            <DB as Shared>::leave(&hub, outbox.tables()).await;
                        }
                        if let Ok(mut stats) = common.stats.lock() {
                            stats.remove(&tenant_name(prefix.as_deref(), &name));
                        }
                    }
                }
                for name in names {
                    if running.contains_key(&name) {
                        continue;
                    }
                    if *shutdown.borrow() {
                        break;
                    }
                    match start_tenant(&common, &pool, &hub, &name, prefix.as_deref()).await {
                        Ok(task) => {
                            running.insert(name, task);
                        }
                        Err(e) => {
                            missing = true;
                            tracing::error!(outbox = %name, error = %crate::ErrorChain(&e), "outbox relay: cannot serve this outbox; trying again at the next look at the tenant list");
                        }
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %crate::ErrorChain(&e), "outbox relay of many outboxes: the discovery query failed; keeping the tenants it found before")
            }
        }
        let again = match list {
            List::Names(_) if !missing => Duration::MAX,
            _ => common.rediscover,
        };
        tokio::select! {
            () = sleep_for(again) => {}
            () = stopped(&mut shutdown) => break,
        }
    }
    futures_util::future::join_all(running.into_values().map(TaskHandle::shutdown)).await;
}

/// Sleeps `d`, forever for `Duration::MAX`.
async fn sleep_for(d: Duration) {
    match Instant::now().checked_add(d) {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}

/// A tenant's name: its outbox table, after its database's name with several.
fn tenant_name(prefix: Option<&str>, table: &str) -> String {
    match prefix {
        Some(db) => format!("{db}/{table}"),
        None => table.to_owned(),
    }
}

/// Why a tenant could not start. Either way it is tried again at the next look at the
/// tenant list.
#[derive(Debug, thiserror::Error)]
enum StartError {
    /// The tenant list names a table that is not a valid outbox table name.
    #[error(transparent)]
    Name(#[from] Error),
    /// The database's hub did not take the outbox (its table is not there yet, a
    /// WAL-mode outbox, the control connection is down, ...).
    #[error(transparent)]
    Join(#[from] SessionError),
}

/// Registers the outbox `name` with the hub and spawns its loop.
async fn start_tenant<P: Publisher + Clone, DB: Backend + Shared>(
    common: &Arc<Common<P>>,
    pool: &sqlx::Pool<DB>,
    hub: &Arc<DB::Hub>,
    name: &str,
    prefix: Option<&str>,
) -> Result<TaskHandle, StartError> {
    let outbox = outbox_of(pool, name)?;
    let wake = <DB as Shared>::join(hub, outbox.tables(), outbox.options()).await?;
    let tenant = tenant_name(prefix, name);
    let labelled = common.named.fetch_add(1, Ordering::Relaxed) < common.labelled;
    let label = if labelled { tenant.as_str() } else { OTHER };
    let relay = Relay::builder(outbox, common.publisher.clone())
        .config(common.config.clone())
        .metric_label("tenant", label)
        .tenant_metrics(&common.destinations)
        .gauges(labelled)
        .build();
    if let Ok(mut stats) = common.stats.lock() {
        stats.insert(tenant.clone(), relay.stats());
    }
    let hub = Arc::clone(hub);
    let turn = common.turn;
    Ok(TaskHandle::spawn(move |shutdown| {
        run_tenant(relay, hub, wake, turn, tenant, shutdown)
    }))
}

/// What a tenant keeps from one turn to the next.
struct Kept {
    /// Its next probe.
    next_probe: Instant,
    /// Its next retry.
    retry_at: Option<Instant>,
    /// The outcomes of batches that came back while it had no connection: its next turn
    /// records them, in send order, before it claims.
    unrecorded: VecDeque<Outcome>,
}

/// One tenant: parked until a commit, a retry or its probe is due; then a turn on a
/// connection of the hub. A turn that ended with batches still with the broker is
/// followed by the wait for them, without a connection, and a turn to record them.
async fn run_tenant<P: Publisher, DB: Backend + Shared>(
    relay: Relay<P, DB>,
    hub: Arc<DB::Hub>,
    wake: Arc<Notify>,
    quantum: Duration,
    tenant: String,
    mut shutdown: watch::Receiver<bool>,
) {
    relay.start_counters();
    let mut backoff = Backoff::new(RECONNECT_FIRST, relay.config.reconnect_delay);
    let mut ready_at = Instant::now();
    let mut kept = Kept {
        next_probe: Instant::now(),
        retry_at: None,
        unrecorded: VecDeque::new(),
    };
    loop {
        if kept.unrecorded.is_empty() {
            tokio::select! {
                () = wake.notified() => {}
                () = tokio::time::sleep_until(ready_at) => {}
                () = stopped(&mut shutdown) => return,
            }
        }
        let contended = || <DB as Shared>::contended(&hub);
        let started = Instant::now();
        let result = relay
            .turn(&hub, &wake, &mut shutdown, quantum, &contended, &mut kept)
            .await;
        tracing::debug!(outbox = %tenant, took = ?started.elapsed(), exit = ?result.as_ref().ok().map(|r| r.0), "outbox relay: a tenant's turn ended");
        let result = match result {
            Ok((exit, Some(detached))) => {
                // The broker has its batches: it waits for them without a connection,
                // then queues for one to record their outcomes.
                let (waited, batches) = (Instant::now(), detached.len());
                kept.unrecorded.extend(detached.finish(&relay).await);
                tracing::debug!(outbox = %tenant, batches, took = ?waited.elapsed(), "outbox relay: a tenant's batches came back from the broker; it queues for a connection to record them");
                Ok(exit)
            }
            Ok((exit, None)) => Ok(exit),
            Err(e) => Err(e),
        };
        // A tenant is connected while its turns work (it has no session between them).
        relay
            .stats
            .connected
            .store(result.is_ok(), std::sync::atomic::Ordering::Relaxed);
        match result {
            Ok(Exit::Shutdown) if kept.unrecorded.is_empty() => return,
            Ok(Exit::Shutdown) => {}
            Ok(Exit::Park(until)) => {
                ready_at = until;
                backoff.reset();
            }
            Ok(Exit::Yield) => {
                ready_at = Instant::now();
                backoff.reset();
            }
            Err(e) => {
                backoff.reset_if_worked(started.elapsed(), WORKED_A_WHILE);
                let delay = backoff.next();
                tracing::error!(outbox = %tenant, error = %crate::ErrorChain(&e), retry_in = ?delay, "outbox relay: the tenant's session failed; trying again");
                relay.counter("outbox_relay_reconnects_total").increment(1);
                RelayStats::add(&relay.stats.reconnects, 1);
                ready_at = Instant::now() + delay;
                // A wake-up during the backoff must not cut it short.
                tokio::select! {
                    () = tokio::time::sleep_until(ready_at) => {}
                    () = stopped(&mut shutdown) => return,
                }
            }
        }
    }
}

impl<P: Publisher, DB: Backend + Shared> Relay<P, DB> {
    /// One turn: waits for a connection of the hub, then works until the tenant parks,
    /// yields, or shutdown.
    /// Outcomes in `kept.unrecorded` (batches that came back while the tenant had no
    /// connection) are recorded first, also at shutdown. Returns the batches still with
    /// the publisher when the turn ended, if any: they go on without the connection.
    async fn turn<'r>(
        &'r self,
        hub: &DB::Hub,
        wake: &Arc<Notify>,
        shutdown: &mut watch::Receiver<bool>,
        quantum: Duration,
        contended: &(dyn Fn() -> bool + Send + Sync),
        kept: &mut Kept,
    ) -> SessionResult<(Exit, Option<Detached<'r>>)> {
        // As `run`: a batch in flight at shutdown gets its time (here: the wait for a
        // connection to record its outcome, then the recording), then the session is
        // dropped.
        let grace = self.config.publish_timeout + self.config.connect_timeout;
        let t0 = Instant::now();
        let open = <DB as Shared>::open_shared(hub, self.context(), Arc::clone(wake));
        let mut session = if kept.unrecorded.is_empty() {
            tokio::select! {
                opened = open => opened?,
                () = stopped(shutdown) => return Ok((Exit::Shutdown, None)),
            }
        } else {
            let mut asked = shutdown.clone();
            tokio::select! {
                opened = open => opened?,
                () = async {
                    stopped(&mut asked).await;
                    tokio::time::sleep(grace).await;
                } => {
                    tracing::warn!(batches = kept.unrecorded.len(), ?grace, "outbox relay: no connection to record a tenant's batches came in time at shutdown; the next relay publishes them again");
                    kept.unrecorded.clear();
                    return Ok((Exit::Shutdown, None));
                }
            }
        };
        tracing::trace!(waited = ?t0.elapsed(), "outbox relay: a tenant's session opened");
        if !kept.unrecorded.is_empty()
            && let Some(retry_in) =
                record_outcomes(self, &mut session, &mut kept.unrecorded).await?
        {
            let due = Instant::now() + retry_in;
            kept.retry_at = Some(kept.retry_at.map_or(due, |r| r.min(due)));
        }
        let mut turn = Turn {
            started: Instant::now(),
            quantum,
            contended,
            next_probe: kept.next_probe,
            retry_at: kept.retry_at,
            detached: None,
        };
        let mut asked = shutdown.clone();
        let exit = tokio::select! {
            exit = self.work(&mut session, shutdown, &mut turn) => exit?,
            () = async {
                stopped(&mut asked).await;
                tokio::time::sleep(grace).await;
            } => {
                tracing::warn!(?grace, "outbox relay: the database did not let the tenant's session end in time; dropping it");
                return Ok((Exit::Shutdown, None));
            }
        };
        (kept.next_probe, kept.retry_at) = (turn.next_probe, turn.retry_at);
        let mut detached = turn.detached.take();
        let timeout = self.config.connect_timeout;
        match exit {
            Exit::Park(_) => {
                match tokio::time::timeout(timeout, <DB as Shared>::park(hub, session)).await {
                    Ok(parked) => parked?,
                    Err(_) => {
                        return Err(SessionError::timed_out(
                            "the relay's control connection while the tenant parked",
                            timeout,
                        ));
                    }
                }
            }
            Exit::Yield | Exit::Shutdown => {
                let close = tokio::time::timeout(timeout, session.close());
                match detached.as_mut() {
                    Some(out) => {
                        let _ = out.beside(close).await;
                    }
                    None => {
                        let _ = close.await;
                    }
                }
            }
        }
        Ok((exit, detached))
    }
}
