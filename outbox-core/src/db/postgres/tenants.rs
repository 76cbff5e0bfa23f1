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

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Executor, PgConnection, PgPool, Postgres};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use super::locks;
use super::session::{Either, PgSession, connect_configured};
use crate::config::{RelayConfig, Tables};
use crate::store::session::{Context, SessionError, SessionResult, Shared};

/// What the tenants of one PostgreSQL database share.
pub struct PgHub {
    options: PgConnectOptions,
    /// Session connections: one permit per connection.
    permits: Arc<Semaphore>,
    /// Tenants waiting for a permit.
    waiting: AtomicUsize,
    /// Connections handed back, with when.
    idle: std::sync::Mutex<Vec<(PgConnection, Instant)>>,
    control: mpsc::UnboundedSender<Command>,
}

impl std::fmt::Debug for PgHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgHub")
            .field("free", &self.permits.available_permits())
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A tenant's hold on one of the hub's connections, for one turn.
pub(super) struct Lease<'a> {
    hub: &'a PgHub,
    _permit: OwnedSemaphorePermit,
}

impl Lease<'_> {
    /// Gives the connection back: without its advisory locks, ready for another tenant.
    /// A connection that fails this is closed (the server then drops its locks).
    pub(super) async fn give_back(self, mut conn: PgConnection) {
        match conn.execute("SELECT pg_advisory_unlock_all()").await {
            Ok(_) => {
                if let Ok(mut idle) = self.hub.idle.lock() {
                    idle.push((conn, Instant::now()));
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "outbox relay: closing a hub connection that failed");
            }
        }
    }
}

/// What the control task is asked to do.
enum Command {
    /// Listen for the outbox's commits; reply with its wake-up.
    Join {
        table: String,
        reply: oneshot::Sender<SessionResult<Arc<Notify>>>,
    },
    /// Take the outbox's idle lock (its commits notify); reply once it is held.
    Park {
        key: i32,
        reply: oneshot::Sender<SessionResult<()>>,
    },
    /// Give the outbox's idle lock back.
    Unpark { key: i32 },
}

/// The control connection's task: the listener, the tenants' wake-ups by channel, and the
/// idle locks it holds.
struct Control {
    pool: PgPool,
    listener: Option<PgListener>,
    channels: HashMap<String, (i32, Arc<Notify>)>,
    parked: BTreeSet<i32>,
}

/// Whether a failed statement means the control connection is gone (its locks with it),
/// rather than an error in the statement.
fn connection_lost(e: &sqlx::Error) -> bool {
    !matches!(e, sqlx::Error::Database(_) | sqlx::Error::RowNotFound)
}

impl Control {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let mut delay = Duration::from_millis(50);
        loop {
            let Some(listener) = self.listener.as_mut() else {
                match self.reconnect().await {
                    Ok(()) => {
                        delay = Duration::from_millis(50);
                        tracing::info!(
                            "outbox relay: the control connection is back; waking every tenant"
                        );
                        for (_, wake) in self.channels.values() {
                            wake.notify_one();
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %e, retry_in = ?delay, "outbox relay: cannot open the control connection; parked tenants are woken by their poll only until it is back");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(5));
                    }
                }
                continue;
            };
            tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else { return };
                    if let Err(e) = self.handle(command).await {
                        tracing::warn!(error = %e, "outbox relay: the control connection failed; connecting it again");
                        self.listener = None;
                    }
                }
                received = listener.try_recv() => match received {
                    Ok(Some(n)) => {
                        if let Some((_, wake)) = self.channels.get(n.channel()) {
                            wake.notify_one();
                        }
                    }
                    Ok(None) => {
                        tracing::warn!("outbox relay: the control connection was lost; connecting it again");
                        self.listener = None;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox relay: the control connection failed; connecting it again");
                        self.listener = None;
                    }
                },
            }
        }
    }

    /// A new control connection: listening on every channel, holding every parked
    /// tenant's idle lock.
    async fn reconnect(&mut self) -> Result<(), sqlx::Error> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.ignore_pool_close_event(true);
        listener
            .listen_all(self.channels.keys().map(String::as_str))
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

    /// Runs one command; `Err` when the control connection is lost.
    async fn handle(&mut self, command: Command) -> Result<(), sqlx::Error> {
        let Some(listener) = self.listener.as_mut() else {
            return Err(sqlx::Error::PoolClosed);
        };
        match command {
            Command::Join { table, reply } => {
                let found: Result<(i32, String), sqlx::Error> = sqlx::query_as(
                    "SELECT oid::int4, 'outbox_' || oid::text FROM (SELECT $1::text::regclass::oid AS oid) t",
                )
                .bind(&table)
                .fetch_one(&mut *listener)
                .await;
                let (key, channel) = match found {
                    Ok(found) => found,
                    Err(e) => {
                        let lost = connection_lost(&e);
                        let _ = reply.send(Err(e.into()));
                        return if lost {
                            Err(sqlx::Error::PoolClosed)
                        } else {
                            Ok(())
                        };
                    }
                };
                if let Some((_, wake)) = self.channels.get(&channel) {
                    let _ = reply.send(Ok(Arc::clone(wake)));
                    return Ok(());
                }
                if let Err(e) = listener.listen(&channel).await {
                    let _ = reply.send(Err(SessionError::Database(sqlx::Error::PoolClosed)));
                    return Err(e);
                }
                let wake = Arc::new(Notify::new());
                self.channels.insert(channel, (key, Arc::clone(&wake)));
                let _ = reply.send(Ok(wake));
            }
            Command::Park { key, reply } => {
                // Kept in `parked` even if this fails: a new control connection takes it.
                if self.parked.insert(key) {
                    let taken = sqlx::query("SELECT pg_advisory_lock_shared($1, $2)")
                        .bind(key)
                        .bind(locks::IDLE)
                        .execute(&mut *listener)
                        .await;
                    if let Err(e) = taken {
                        let _ = reply.send(Err(SessionError::Database(sqlx::Error::PoolClosed)));
                        return Err(e);
                    }
                }
                let _ = reply.send(Ok(()));
            }
            Command::Unpark { key } => {
                if self.parked.remove(&key) {
                    sqlx::query("SELECT pg_advisory_unlock_shared($1, $2)")
                        .bind(key)
                        .bind(locks::IDLE)
                        .execute(&mut *listener)
                        .await?;
                }
            }
        }
        Ok(())
    }
}

impl PgHub {
    /// Asks the control task; an error if it has ended.
    async fn ask<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<SessionResult<T>>) -> Command,
    ) -> SessionResult<T> {
        let (reply, answer) = oneshot::channel();
        if self.control.send(command(reply)).is_err() {
            return Err(SessionError::Refused(
                "the relay's control task has ended".to_owned(),
            ));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(SessionError::Database(sqlx::Error::PoolClosed)))
    }

    /// A connection handed back recently enough that the server has not ended it
    /// (`idle_session_timeout` is the relay's session timeout), or a new one.
    async fn connection(&self, config: &RelayConfig) -> SessionResult<PgConnection> {
        let fresh_for = config.effective_session_timeout() / 2;
        let reused = self.idle.lock().ok().and_then(|mut idle| {
            idle.retain(|(_, since)| since.elapsed() < fresh_for);
            idle.pop()
        });
        if let Some((conn, _)) = reused {
            return Ok(conn);
        }
        let timeout = config.connect_timeout;
        match tokio::time::timeout(timeout, connect_configured(&self.options, config)).await {
            Ok(conn) => conn,
            Err(_) => Err(SessionError::TimedOut(timeout)),
        }
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
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3")
                        .await
                        .map(|_| ())
                })
            })
            .connect_lazy_with(options.clone());
        let mut control = Control {
            pool: control_pool,
            listener: None,
            channels: HashMap::new(),
            parked: BTreeSet::new(),
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
            idle: std::sync::Mutex::new(Vec::new()),
            control: tx,
        })
    }

    async fn join(hub: &PgHub, tables: &Tables) -> SessionResult<Arc<Notify>> {
        if tables.wal.is_some() {
            return Err(SessionError::Refused(format!(
                "{} is a WAL-mode outbox; a relay of many outboxes serves table-mode outboxes \
                 only: run a relay of its own for it",
                tables.outbox
            )));
        }
        let table = tables.outbox.quoted();
        hub.ask(|reply| Command::Join { table, reply }).await
    }

    async fn open_shared<'a>(
        hub: &'a PgHub,
        cx: Context<'a, Postgres>,
        wake: Arc<Notify>,
    ) -> SessionResult<Either<PgSession<'a>, super::wal::WalSession<'a>>> {
        hub.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&hub.waiting);
        let permit = Arc::clone(&hub.permits)
            .acquire_owned()
            .await
            .map_err(|_| SessionError::Refused("the relay's hub has closed".to_owned()))?;
        drop(waiting);
        let conn = hub.connection(cx.config).await?;
        let lease = Lease {
            hub,
            _permit: permit,
        };
        let timeout = cx.config.connect_timeout;
        let session = match tokio::time::timeout(
            timeout,
            PgSession::setup(cx, conn, hub.options.clone(), Some((wake, lease))),
        )
        .await
        {
            Ok(session) => session?,
            Err(_) => return Err(SessionError::TimedOut(timeout)),
        };
        // Its commits stop notifying: the tenant looks for rows by itself now.
        let _ = hub.control.send(Command::Unpark {
            key: session.table_key(),
        });
        Ok(Either::Table(session))
    }

    fn contended(hub: &PgHub) -> bool {
        hub.waiting.load(Ordering::Relaxed) > 0
    }

    async fn park<'a>(
        hub: &'a PgHub,
        session: Either<PgSession<'a>, super::wal::WalSession<'a>>,
    ) -> SessionResult<()> {
        use crate::store::session::Session;
        if let Either::Table(s) = &session {
            let key = s.table_key();
            hub.ask(|reply| Command::Park { key, reply }).await?;
        }
        session.close().await;
        Ok(())
    }

    fn database_name(pool: &PgPool) -> String {
        pool.connect_options()
            .get_database()
            .unwrap_or("postgres")
            .to_owned()
    }

    async fn discover(pool: &PgPool, query: &str) -> SessionResult<Vec<String>> {
        Ok(sqlx::query_scalar(query).fetch_all(pool).await?)
    }
}
