//! A relay of many outboxes on PostgreSQL (`relay::Tenants`): the hub its tenants share.
//!
//! - **Session connections**: at most `connections`, handed out in the order tenants ask
//!   for one (a FIFO semaphore). A tenant works on one for its turn, exactly as a relay
//!   works on its own: its advisory locks (relay slot, partitions) are taken on it, and
//!   every claim, reschedule and mark goes through it. Handed back, the connection drops
//!   all its advisory locks (`pg_advisory_unlock_all`) and waits for the next tenant.
//! - **The control connection** `LISTEN`s on every tenant's channel and holds the idle
//!   lock ([`locks::IDLE`]) of every *parked* tenant, so that their commits notify. A
//!   tenant parks only after declaring itself idle on its session (it holds the idle lock
//!   there, and has claimed since): the control connection takes the lock before the
//!   session gives its own back, so no commit between the two goes unnoticed. When a
//!   tenant's turn begins, the control connection gives the lock back: commits stop
//!   notifying while the tenant looks for rows by itself.
//! - **The control connection lost**: its locks went with it, so notifications may have
//!   been missed. It connects again, takes the parked tenants' locks again, and wakes
//!   every tenant.
//! - **A table replaced** (`outbox partition` gives it a new oid, so a new channel and new
//!   lock keys): a tenant's turn that finds a key other than the one the control
//!   connection listens for has it listen on the new channel *before* the turn begins.
//!   Its session declares itself idle on the new key, and commits then notify on the new
//!   channel: were it only heard from when the tenant parks, a commit in between would
//!   wake no one (#35: a fresh-clone CI run lost one that way). Should the control
//!   connection learn of the new table only at the park after all (it was down as the
//!   turn began), the park wakes the tenant once more, to look again.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Executor, PgConnection, PgPool, Postgres};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use super::session::lease::{Handover, Lease};
use super::session::{AnySession, Either, PgSession, connect_configured};
use super::{Options, locks};
use crate::config::{RelayConfig, Tables};
use crate::store::session::{Context, SessionError, SessionResult, Shared};
use crate::store::trusted_sql;

/// What the tenants of one PostgreSQL database share.
pub struct PgHub {
    options: PgConnectOptions,
    /// Session connections: one permit per connection.
    permits: Arc<Semaphore>,
    /// Tenants waiting for a permit.
    waiting: AtomicUsize,
    /// What passes from one tenant's session to the next: connections, notices, state.
    handover: Handover,
    control: mpsc::UnboundedSender<Command>,
    /// The key (table oid) the control connection listens for, by outbox: a turn whose
    /// session found another one asks the control task to follow the table first.
    listened: Listening,
    /// How long the control task may take per command.
    timeout: Duration,
}

/// The key each outbox's commits are listened for under, by the table's quoted name;
/// written by the control task, read by the tenants as their turns begin.
type Listening = Arc<std::sync::Mutex<HashMap<String, i32>>>;

impl std::fmt::Debug for PgHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgHub")
            .field("free", &self.permits.available_permits())
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What the control task is asked to do.
enum Command {
    /// Listen for the outbox's commits; reply with its key and wake-up.
    Join {
        table: String,
        reply: oneshot::Sender<SessionResult<Arc<Notify>>>,
    },
    /// Stop listening for the outbox's commits (its tenant has stopped).
    Leave { table: String },
    /// Take the outbox's idle lock (its commits notify); reply once it is held. `key` is
    /// the table's oid as the tenant's session found it: a table replaced since it
    /// joined (`outbox partition`) has a new one, and a new channel.
    Park {
        table: String,
        key: i32,
        reply: oneshot::Sender<SessionResult<()>>,
    },
    /// Give the outbox's idle lock back.
    Unpark { key: i32 },
    /// A tenant's turn begins on a session that found the table under `key`, not the key
    /// the control connection listens for: listen for the table as it is now, give its
    /// idle lock back, then reply (before the session may declare itself idle).
    Begin {
        table: String,
        key: i32,
        reply: oneshot::Sender<SessionResult<()>>,
    },
}

impl Command {
    /// Answers a command that cannot run now: the control connection is down.
    fn refuse(self) {
        match self {
            Command::Join { reply, .. } => {
                let _ = reply.send(Err(control_down()));
            }
            Command::Park { reply, .. } | Command::Begin { reply, .. } => {
                let _ = reply.send(Err(control_down()));
            }
            Command::Leave { .. } | Command::Unpark { .. } => {}
        }
    }
}

/// What tenants that ask while the control connection is down are told.
fn control_down() -> SessionError {
    SessionError::closed(
        "the relay's control connection",
        Some(
            "it is reconnecting (parked tenants are woken by their poll until it is back)"
                .to_owned(),
        ),
    )
}

/// Why the control task gives its connection up and connects again (its commands were
/// answered with [`control_down`]).
#[derive(Debug, thiserror::Error)]
enum Lost {
    /// A statement failed: the connection is gone, its locks with it.
    #[error(transparent)]
    Failed(#[from] sqlx::Error),
    /// A command got no answer in time.
    #[error("no answer within {0:?}")]
    Silent(Duration),
}

/// How often an idle control connection is checked (a connection that stopped answering
/// would otherwise go unnoticed until the kernel gives up on it).
const CONTROL_CHECK: Duration = Duration::from_secs(15);

/// One outbox the control connection listens for.
struct Listened {
    key: i32,
    channel: String,
    wake: Arc<Notify>,
}

/// The control connection's task: the listener, the tenants' wake-ups by channel, and the
/// idle locks it holds.
struct Control {
    pool: PgPool,
    listener: Option<PgListener>,
    /// By the table's quoted name.
    tables: HashMap<String, Listened>,
    /// Each table's key, for the tenants (kept equal to `tables`).
    listened: Listening,
    /// Channel -> wake-up.
    wakes: HashMap<String, Arc<Notify>>,
    parked: BTreeSet<i32>,
    /// How long one command or check may take.
    timeout: Duration,
}

/// Whether a failed statement means the control connection is gone (its locks with it),
/// rather than an error in the statement.
/// Takes (`take`) or gives back a parked tenant's shared idle lock, on the control
/// connection that holds them all.
async fn idle_lock(listener: &mut PgListener, key: i32, take: bool) -> Result<(), sqlx::Error> {
    let sql = if take {
        "SELECT pg_advisory_lock_shared($1, $2)"
    } else {
        "SELECT pg_advisory_unlock_shared($1, $2)"
    };
    sqlx::query(trusted_sql(sql))
        .bind(key)
        .bind(locks::IDLE)
        .execute(listener)
        .await?;
    Ok(())
}

fn connection_lost(e: &sqlx::Error) -> bool {
    !matches!(e, sqlx::Error::Database(_) | sqlx::Error::RowNotFound)
}

impl Control {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        let mut check = tokio::time::interval(CONTROL_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let Some(listener) = self.listener.as_mut() else {
                let delay = match tokio::time::timeout(self.timeout, self.reconnect()).await {
                    Ok(Ok(())) => {
                        backoff.reset();
                        tracing::info!(
                            "outbox relay: the control connection is back; waking every tenant"
                        );
                        for wake in self.wakes.values() {
                            wake.notify_one();
                        }
                        continue;
                    }
                    Ok(Err(e)) => {
                        let delay = backoff.next();
                        tracing::error!(error = %crate::ErrorChain(&e), retry_in = ?delay, "outbox relay: cannot open the control connection; parked tenants are woken by their poll until it is back");
                        delay
                    }
                    Err(_) => {
                        let delay = backoff.next();
                        tracing::error!(timeout = ?self.timeout, retry_in = ?delay, "outbox relay: the control connection did not open in time; parked tenants are woken by their poll until it is back");
                        delay
                    }
                };
                // Commands meanwhile are answered at once; the hub gone, the task ends.
                let pause = tokio::time::sleep(delay);
                tokio::pin!(pause);
                loop {
                    tokio::select! {
                        () = &mut pause => break,
                        command = commands.recv() => match command {
                            None => return,
                            Some(command) => self.apart(command),
                        },
                    }
                }
                continue;
            };
            tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else { return };
                    let timeout = self.timeout;
                    let outcome = match tokio::time::timeout(timeout, self.handle(command)).await {
                        Ok(outcome) => outcome,
                        Err(_) => Err(Lost::Silent(timeout)),
                    };
                    if let Err(why) = outcome {
                        tracing::warn!(error = %crate::ErrorChain(&why), "outbox relay: the control connection failed; connecting it again");
                        self.listener = None;
                    }
                }
                _ = check.tick() => {
                    let alive = tokio::time::timeout(self.timeout, listener.execute("SELECT 1")).await;
                    if !matches!(alive, Ok(Ok(_))) {
                        tracing::warn!("outbox relay: the control connection stopped answering; connecting it again");
                        self.listener = None;
                    }
                }
                // Without eager reconnection, a lost connection returns `Ok(None)` at once
                // (no reconnect inside, which a command could cancel half-way): the locks
                // are taken again below, on a new connection.
                received = listener.try_recv() => match received {
                    Ok(Some(n)) => {
                        if let Some(wake) = self.wakes.get(n.channel()) {
                            wake.notify_one();
                        }
                    }
                    Ok(None) => {
                        tracing::warn!("outbox relay: the control connection was lost; connecting it again");
                        self.listener = None;
                    }
                    Err(e) => {
                        tracing::warn!(error = %crate::ErrorChain(&e), "outbox relay: the control connection failed; connecting it again");
                        self.listener = None;
                    }
                },
            }
        }
    }

    /// A command while the control connection is down: bookkeeping only (a new
    /// connection takes the parked tenants' locks), or refused.
    fn apart(&mut self, command: Command) {
        match command {
            Command::Unpark { key } => {
                self.parked.remove(&key);
            }
            Command::Leave { table } => {
                self.forget(&table);
            }
            command => command.refuse(),
        }
    }

    /// Drops an outbox from the books; with whether it was parked.
    fn forget(&mut self, table: &str) -> Option<(Listened, bool)> {
        let listened = self.tables.remove(table)?;
        self.publish_key(table, None);
        self.wakes.remove(&listened.channel);
        let parked = self.parked.remove(&listened.key);
        Some((listened, parked))
    }

    /// A new control connection: without locks left from an earlier use of it,
    /// listening on every channel, holding every parked tenant's idle lock.
    async fn reconnect(&mut self) -> Result<(), sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.ignore_pool_close_event(true);
        listener.eager_reconnect(false);
        // The pool may hand back the connection an error made it drop, locks and all.
        listener.execute("SELECT pg_advisory_unlock_all()").await?;
        listener
            .listen_all(self.wakes.keys().map(String::as_str))
            .await?;
        let parked: Vec<i32> = self.parked.iter().copied().collect();
        if !parked.is_empty() {
            sqlx::query("SELECT pg_advisory_lock_shared(k, $2) FROM unnest($1::int4[]) AS k")
                .bind(&parked)
                .bind(locks::IDLE)
                .execute(&mut listener)
                .await?;
        }
        self.listener = Some(listener);
        Ok(())
    }

    /// Tells the tenants which key `table`'s commits are listened for under (`None`: no
    /// longer listened for).
    fn publish_key(&self, table: &str, key: Option<i32>) {
        if let Ok(mut listened) = self.listened.lock() {
            match key {
                Some(key) => listened.insert(table.to_owned(), key),
                None => listened.remove(table),
            };
        }
    }

    /// A session found the outbox `table` under oid `key`. If the control connection
    /// listens for it under another one, the table was replaced (`outbox partition`)
    /// since: listen on the channel of the table as it is now (looked up here, so that a
    /// session that found the old table, as the replacement committed, cannot send the
    /// control connection back to it) instead of the old one, under the same wake-up.
    /// Returns the key now listened for (`key` for a table not joined), and whether the
    /// channel changed here; `Err` when the control connection is lost.
    async fn follow(&mut self, table: &str, key: i32) -> Result<(i32, bool), Lost> {
        let Some(known) = self.tables.get(table) else {
            return Ok((key, false));
        };
        if known.key == key {
            return Ok((key, false));
        }
        let old_key = known.key;
        let Some(listener) = self.listener.as_mut() else {
            return Ok((old_key, false));
        };
        let now: Result<i32, sqlx::Error> =
            sqlx::query_scalar("SELECT $1::text::regclass::oid::int4")
                .bind(table)
                .fetch_one(&mut *listener)
                .await;
        let now = match now {
            Ok(now) => now,
            Err(e) if connection_lost(&e) => return Err(e.into()),
            // Gone altogether: its tenant's session says so in its turn.
            Err(_) => return Ok((old_key, false)),
        };
        if now == old_key {
            return Ok((old_key, false));
        }
        let channel = format!("outbox_{}", u32::from_ne_bytes(now.to_ne_bytes()));
        let Some(known) = self.tables.get_mut(table) else {
            return Ok((key, false));
        };
        let old_channel = std::mem::replace(&mut known.channel, channel.clone());
        known.key = now;
        let wake = Arc::clone(&known.wake);
        self.wakes.remove(&old_channel);
        self.wakes.insert(channel.clone(), wake);
        self.publish_key(table, Some(now));
        let was_parked = self.parked.remove(&old_key);
        tracing::info!(
            table,
            old = old_key,
            new = now,
            "outbox relay: the outbox table was replaced; listening for its new channel"
        );
        let Some(listener) = self.listener.as_mut() else {
            return Ok((now, true));
        };
        listener.unlisten(&old_channel).await?;
        listener.listen(&channel).await?;
        if was_parked {
            idle_lock(listener, old_key, false).await?;
        }
        Ok((now, true))
    }

    /// Runs one command; `Err` when the control connection is lost (the command was
    /// answered with an error).
    async fn handle(&mut self, command: Command) -> Result<(), Lost> {
        if self.listener.is_none() {
            command.refuse();
            return Ok(());
        }
        // Bookkeeping first (it needs all of `self`), then the statements.
        let gone = match &command {
            Command::Leave { table } => self.forget(table),
            _ => None,
        };
        let Some(listener) = self.listener.as_mut() else {
            return Ok(());
        };
        match command {
            Command::Join { table, reply } => {
                if let Some(known) = self.tables.get(&table) {
                    let _ = reply.send(Ok(Arc::clone(&known.wake)));
                    return Ok(());
                }
                let found: Result<(i32, String), sqlx::Error> = sqlx::query_as(
                    "SELECT oid::int4, 'outbox_' || oid::text FROM (SELECT $1::text::regclass::oid AS oid) t",
                )
                .bind(&table)
                .fetch_one(&mut *listener)
                .await;
                let (key, channel) = match found {
                    Ok(found) => found,
                    Err(e) if connection_lost(&e) => {
                        let _ = reply.send(Err(control_down()));
                        return Err(e.into());
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.into()));
                        return Ok(());
                    }
                };
                if let Some(other) = self.tables.iter().find(|(_, l)| l.key == key) {
                    // One table under two names would share one wake-up and one idle
                    // lock between two tenants.
                    let _ = reply.send(Err(SessionError::Refused(format!(
                        "{table} is the outbox {} under another name, which this relay already \
                         serves; name each outbox once",
                        other.0
                    ))));
                    return Ok(());
                }
                if let Err(e) = listener.listen(&channel).await {
                    let _ = reply.send(Err(control_down()));
                    return Err(e.into());
                }
                let wake = Arc::new(Notify::new());
                self.wakes.insert(channel.clone(), Arc::clone(&wake));
                self.publish_key(&table, Some(key));
                self.tables.insert(
                    table,
                    Listened {
                        key,
                        channel,
                        wake: Arc::clone(&wake),
                    },
                );
                let _ = reply.send(Ok(wake));
            }
            Command::Leave { .. } => {
                if let Some((gone, parked)) = gone {
                    listener.unlisten(&gone.channel).await?;
                    if parked {
                        idle_lock(listener, gone.key, false).await?;
                    }
                }
            }
            Command::Park { table, key, reply } => {
                // The key listened for is the one whose lock makes commits notify.
                let (listened, changed) = match self.follow(&table, key).await {
                    Ok(followed) => followed,
                    Err(e) => {
                        let _ = reply.send(Err(control_down()));
                        return Err(e);
                    }
                };
                // Listened for under another key than the session's, or only from now on
                // (the turn began while the control connection was down, or the table was
                // replaced again): a commit since the session declared itself idle may
                // have notified no one. The tenant looks once more.
                if (changed || listened != key)
                    && let Some(known) = self.tables.get(&table)
                {
                    known.wake.notify_one();
                }
                let key = listened;
                let Some(listener) = self.listener.as_mut() else {
                    return Ok(());
                };
                // Kept in `parked` even if this fails: a new control connection takes it.
                if self.parked.insert(key)
                    && let Err(e) = idle_lock(listener, key, true).await
                {
                    let _ = reply.send(Err(control_down()));
                    return Err(e.into());
                }
                let _ = reply.send(Ok(()));
            }
            Command::Unpark { key } => {
                if self.parked.remove(&key) {
                    idle_lock(listener, key, false).await?;
                }
            }
            Command::Begin { table, key, reply } => {
                let key = match self.follow(&table, key).await {
                    Ok((key, _)) => key,
                    Err(e) => {
                        let _ = reply.send(Err(control_down()));
                        return Err(e);
                    }
                };
                if self.parked.remove(&key)
                    && let Some(listener) = self.listener.as_mut()
                    && let Err(e) = idle_lock(listener, key, false).await
                {
                    let _ = reply.send(Err(control_down()));
                    return Err(e.into());
                }
                let _ = reply.send(Ok(()));
            }
        }
        Ok(())
    }
}

impl PgHub {
    /// Asks the control task, waiting a bounded time.
    async fn ask<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<SessionResult<T>>) -> Command,
    ) -> SessionResult<T> {
        let (reply, answer) = oneshot::channel();
        let ended = || {
            SessionError::closed(
                "the relay's control task",
                Some(
                    "it ended unexpectedly (the log before this says why): restart the relay \
                     if this repeats"
                        .to_owned(),
                ),
            )
        };
        if self.control.send(command(reply)).is_err() {
            return Err(ended());
        }
        // Each command gets `timeout`, but commands queue, and a reconnection may come
        // first.
        let most = self.timeout * 3;
        match tokio::time::timeout(most, answer).await {
            Ok(answer) => answer.unwrap_or_else(|_| Err(ended())),
            Err(_) => Err(SessionError::timed_out(
                "the relay's control connection, commands queued before this one included",
                most,
            )),
        }
    }

    /// A connection handed back recently enough that the server has not ended it
    /// (`idle_session_timeout` is the relay's session timeout), or, with `reuse` false
    /// or none there, a new one; with whether it was reused.
    async fn connection(
        &self,
        config: &RelayConfig,
        reuse: bool,
    ) -> SessionResult<(PgConnection, bool)> {
        let fresh_for = config.effective_session_timeout() / 2;
        let reused = self.handover.idle.lock().ok().and_then(|mut idle| {
            idle.retain(|(_, since)| since.elapsed() < fresh_for);
            if reuse { idle.pop() } else { None }
        });
        if let Some((conn, _)) = reused {
            return Ok((conn, true));
        }
        let timeout = config.connect_timeout;
        match tokio::time::timeout(timeout, connect_configured(&self.options, config)).await {
            Ok(conn) => Ok((conn?, false)),
            Err(_) => Err(SessionError::timed_out(
                "the database while a tenant connected",
                timeout,
            )),
        }
    }

    /// Waits for a connection, in turn with the other tenants.
    async fn permit(&self) -> SessionResult<OwnedSemaphorePermit> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        if self.permits.available_permits() == 0 {
            self.handover.asked.notify_waiters();
        }
        Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| SessionError::closed("the relay's hub", None))
    }
}

/// Counts a tenant waiting for a permit for as long as it waits (also if the wait is
/// dropped).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shared for Postgres {
    type Hub = PgHub;

    async fn hub(pool: &PgPool, config: &RelayConfig, connections: u32) -> SessionResult<PgHub> {
        let options = (*pool.connect_options())
            .clone()
            .application_name(&config.application_name);
        let control_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(config.connect_timeout)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3")
                        .await
                        .map(|_| ())
                })
            })
            .connect_lazy_with(options.clone());
        let listened = Listening::default();
        let mut control = Control {
            pool: control_pool,
            listener: None,
            tables: HashMap::new(),
            listened: Arc::clone(&listened),
            wakes: HashMap::new(),
            parked: BTreeSet::new(),
            timeout: config.connect_timeout,
        };
        // Connected now, so that a database that cannot be reached is an error here.
        control.reconnect().await?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(control.run(rx));
        let permits = usize::try_from(connections.max(1)).unwrap_or(1);
        Ok(PgHub {
            options,
            permits: Arc::new(Semaphore::new(permits)),
            waiting: AtomicUsize::new(0),
            handover: Handover::default(),
            control: tx,
            listened,
            timeout: config.connect_timeout,
        })
    }

    async fn join(hub: &PgHub, tables: &Tables, options: &Options) -> SessionResult<Arc<Notify>> {
        if options.wal.is_some() {
            return Err(SessionError::Refused(format!(
                "{} is a WAL-mode outbox; a relay of many outboxes serves table-mode outboxes \
                 only: run a relay of its own for it",
                tables.outbox
            )));
        }
        let table = tables.outbox.quoted();
        hub.ask(|reply| Command::Join { table, reply }).await
    }

    async fn leave(hub: &PgHub, tables: &Tables) {
        let _ = hub.control.send(Command::Leave {
            table: tables.outbox.quoted(),
        });
    }

    async fn open_shared<'a>(
        hub: &'a PgHub,
        cx: Context<'a, Postgres>,
        wake: Arc<Notify>,
    ) -> SessionResult<AnySession<'a>> {
        let timeout = cx.config.connect_timeout;
        let mut reuse = true;
        let session = loop {
            let permit = hub.permit().await?;
            let (conn, reused) = hub.connection(cx.config, reuse).await?;
            let lease = Lease::new(&hub.handover, permit);
            let shared = Some((Arc::clone(&wake), lease));
            match tokio::time::timeout(
                timeout,
                PgSession::setup(cx, conn, hub.options.clone(), shared),
            )
            .await
            {
                Ok(Ok(session)) => break session,
                // A connection the server ended while it waited in the hub (a restart,
                // a terminated backend): once more, on a new one.
                Ok(Err(SessionError::Database(e))) if reused && connection_lost(&e) => {
                    tracing::debug!(error = %crate::ErrorChain(&e), "outbox relay: a hub connection was gone; opening a new one");
                    reuse = false;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(SessionError::timed_out(
                        "the database while a tenant opened its session",
                        timeout,
                    ));
                }
            }
        };
        // Its commits stop notifying: the tenant looks for rows by itself now. A table
        // replaced since the control connection last heard of it is followed first, so
        // that the commits of this turn, once the session declares itself idle, notify
        // on a channel the control connection listens on.
        let (table, key) = (session.table_name(), session.table_key());
        let listened = hub
            .listened
            .lock()
            .ok()
            .and_then(|l| l.get(&table).copied());
        if listened == Some(key) {
            let _ = hub.control.send(Command::Unpark { key });
        } else if let Err(e) = hub.ask(|reply| Command::Begin { table, key, reply }).await {
            // The control connection is down: back, it wakes every tenant, and this
            // tenant's next turn asks again.
            tracing::debug!(error = %crate::ErrorChain(&e), "outbox relay: the control connection could not follow a replaced table yet");
        }
        Ok(Either::Table(session))
    }

    fn contended(hub: &PgHub) -> bool {
        hub.waiting.load(Ordering::Relaxed) > 0
    }

    async fn park<'a>(hub: &'a PgHub, session: AnySession<'a>) -> SessionResult<()> {
        use crate::store::session::Session;
        if let Either::Table(s) = &session {
            let (table, key) = (s.table_name(), s.table_key());
            tracing::trace!(outbox = %table, key, "outbox relay: a tenant parks");
            hub.ask(|reply| Command::Park { table, key, reply }).await?;
        }
        session.close().await;
        Ok(())
    }

    async fn discover(pool: &PgPool, query: &str) -> SessionResult<Vec<String>> {
        Ok(sqlx::query_scalar(trusted_sql(query))
            .fetch_all(pool)
            .await?)
    }
}
