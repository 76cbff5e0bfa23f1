//! The one relay loop: it opens a [`Session`] of the outbox's database and drives it,
//! whatever the database. Each round: probe when the interval is up (gauges, and whether
//! anything is due), check ownership (stand by while another relay is active), drain
//! until nothing is claimable, then wait for work, the next probe or the next retry.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::drain::{Clock, Detached, drain};
use super::{Relay, RelayStats};
use crate::backoff::Backoff;
use crate::publisher::Publisher;
use crate::store::Backend;
use crate::store::session::{Context, Session, SessionError, SessionResult};
use crate::task::stopped;

/// How the loop shares its session, which [`Relay::work`] asks at each point where a
/// relay of many outboxes ([`super::Tenants`]) differs from a relay of its own: the loop
/// itself knows no tenant. A relay of its own ([`Alone`]) keeps its session until
/// shutdown or an error; a tenant ([`Turn`]) gives its connection back when it has nothing
/// to do or its turn is over.
pub(super) trait Sharing<'r> {
    /// The schedule to start from: the next probe and the next retry.
    fn resume(&self) -> (Instant, Option<Instant>);
    /// The turn as the drain sees it (`None`: the session is not shared).
    fn clock(&self) -> Option<Clock<'_>>;
    /// The drain returned with batches still with the publisher (only with a clock):
    /// they go on without the session, and the loop returns this.
    fn hand_over(&mut self, detached: Detached<'r>, schedule: (Instant, Option<Instant>)) -> Exit;
    /// After a drain that claimed rows: whether to return instead of draining on.
    fn after_claim(&mut self, schedule: (Instant, Option<Instant>)) -> Option<Exit>;
    /// Before the loop waits until `until`: return instead (`Err`), or the instant to
    /// wait until. `idle`: the session has nothing in flight and may be parked.
    fn before_wait(
        &mut self,
        idle: bool,
        schedule: (Instant, Option<Instant>),
        until: Instant,
    ) -> Result<Instant, Exit>;
}

/// A relay of its own: it keeps its session.
pub(super) struct Alone;

impl<'r> Sharing<'r> for Alone {
    fn resume(&self) -> (Instant, Option<Instant>) {
        (Instant::now(), None)
    }
    fn clock(&self) -> Option<Clock<'_>> {
        None
    }
    fn hand_over(&mut self, detached: Detached<'r>, _: (Instant, Option<Instant>)) -> Exit {
        // The drain hands batches over only at the end of a turn, and there is none.
        unreachable!(
            "a relay of its own was handed {} batches: its drain has no turn",
            detached.len()
        )
    }
    fn after_claim(&mut self, _: (Instant, Option<Instant>)) -> Option<Exit> {
        None
    }
    fn before_wait(
        &mut self,
        _: bool,
        _: (Instant, Option<Instant>),
        until: Instant,
    ) -> Result<Instant, Exit> {
        Ok(until)
    }
}

/// A tenant's turn on a shared connection ([`super::Tenants`]).
pub(super) struct Turn<'t, 'r> {
    /// When it began.
    pub(super) started: Instant,
    /// How long it lasts while other tenants wait.
    pub(super) quantum: Duration,
    /// Whether another tenant waits for a connection.
    pub(super) contended: &'t (dyn Fn() -> bool + Send + Sync),
    /// The tenant's next probe, carried from turn to turn.
    pub(super) next_probe: Instant,
    /// The tenant's next retry, carried from turn to turn.
    pub(super) retry_at: Option<Instant>,
    /// The batches still with the publisher when the turn ended: they go on without the
    /// connection.
    pub(super) detached: Option<Detached<'r>>,
}

impl<'t> Turn<'t, '_> {
    /// The turn's time, for the drain.
    fn time(&self) -> Clock<'t> {
        Clock {
            started: self.started,
            quantum: self.quantum,
            contended: self.contended,
        }
    }

    /// Whether the turn is over: its time is up and another tenant waits.
    fn over(&self) -> bool {
        self.time().over()
    }

    /// Keeps the schedule for the tenant's next turn.
    fn carry(&mut self, (next_probe, retry_at): (Instant, Option<Instant>)) {
        self.next_probe = next_probe;
        self.retry_at = retry_at;
    }
}

impl<'r> Sharing<'r> for Turn<'_, 'r> {
    fn resume(&self) -> (Instant, Option<Instant>) {
        (self.next_probe, self.retry_at)
    }
    fn clock(&self) -> Option<Clock<'_>> {
        Some(self.time())
    }
    fn hand_over(&mut self, detached: Detached<'r>, schedule: (Instant, Option<Instant>)) -> Exit {
        // Its turn is over while the broker has its batches: the connection goes to the
        // next tenant now, not once the broker answers.
        self.carry(schedule);
        self.detached = Some(detached);
        Exit::Yield
    }
    fn after_claim(&mut self, schedule: (Instant, Option<Instant>)) -> Option<Exit> {
        self.over().then(|| {
            self.carry(schedule);
            Exit::Yield
        })
    }
    fn before_wait(
        &mut self,
        idle: bool,
        schedule: (Instant, Option<Instant>),
        until: Instant,
    ) -> Result<Instant, Exit> {
        if idle {
            // Nothing to do: the tenant gives its connection back until a commit, its
            // next retry or its next probe.
            self.carry(schedule);
            return Err(Exit::Park(until));
        }
        if self.over() {
            // Waiting for writers to finish while other tenants wait for a connection:
            // it queues again behind them.
            self.carry(schedule);
            return Err(Exit::Yield);
        }
        if (self.contended)() {
            // Looks again when its turn is up (the session's wait also ends when a
            // tenant starts waiting for a connection).
            return Ok(until.min(self.started + self.quantum));
        }
        Ok(until)
    }
}

/// Why [`Relay::work`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Exit {
    /// Shutdown was asked.
    Shutdown,
    /// The tenant has nothing to do until the instant given (or a commit).
    Park(Instant),
    /// The tenant's turn is over while it still has work.
    Yield,
}

/// The first wait before connecting again after a session failed; it doubles up to
/// `reconnect_delay` while sessions keep failing ([`Relay::run`], and each database and
/// tenant of [`super::Tenants`]).
pub(super) const RECONNECT_FIRST: Duration = Duration::from_millis(50);

/// A session that worked this long before it failed starts the reconnect backoff afresh.
pub(super) const WORKED_A_WHILE: Duration = Duration::from_secs(30);

impl<P: Publisher, DB: Backend> Relay<P, DB> {
    /// Runs until `shutdown` turns `true` (forever if its sender is dropped). A batch in flight
    /// is finished (published and marked) first; nothing is marked that was not acked.
    ///
    /// Database errors never end the relay: it logs them, reconnects with backoff and
    /// carries on where the database says it left off.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        crate::telemetry::describe_metrics();
        // The counters exist from the start, at 0: a rate or `increase()` over a series
        // that first appears at 1 misses that first event (the first dead letter of a
        // process would not fire an alert on `increase(outbox_dead_lettered_total[..])`).
        // Those labelled by destination start at 0 for the destinations of this
        // binary's event types (the catalog), and for any other at its first use.
        for counter in [
            "outbox_publish_unavailable_total",
            "outbox_relay_reconnects_total",
        ] {
            self.counter(counter).increment(0);
        }
        self.start_counters();
        let mut backoff = Backoff::new(RECONNECT_FIRST, self.config.reconnect_delay);
        // Once shutdown is asked, the batch in flight gets `publish_timeout` to be
        // published and `connect_timeout` more to be recorded; past that (a database that
        // stopped answering) the session is dropped: what it had not recorded is
        // published again by the next relay.
        let grace = self.config.publish_timeout + self.config.connect_timeout;
        let mut asked = shutdown.clone();
        // The tables were missing at the last try, and the relay said so (once).
        let mut said_schema_missing = false;
        loop {
            let started = std::time::Instant::now();
            let result = tokio::select! {
                result = self.session(&mut shutdown) => result,
                () = async {
                    stopped(&mut asked).await;
                    tokio::time::sleep(grace).await;
                } => {
                    tracing::warn!(?grace, "outbox relay: the database did not let the session end in time; dropping it");
                    return;
                }
            };
            // A session that worked for a while before failing starts the backoff afresh.
            backoff.reset_if_worked(started.elapsed(), WORKED_A_WHILE);
            let delay = match result {
                Ok(()) => return,
                Err(e) => {
                    let delay = backoff.next();
                    if !e.is_schema_missing() {
                        said_schema_missing = false;
                        tracing::error!(error = %crate::ErrorChain(&e), retry_in = ?delay, "outbox relay: database session failed; reconnecting");
                    } else if !said_schema_missing {
                        // Started before `migrate()`: said once, clearly, then waited for.
                        tracing::error!(
                            table = %self.outbox.tables().outbox,
                            error = %crate::ErrorChain(&e),
                            "outbox relay: the outbox table does not exist in this database; \
                             run the migrations first: `outbox.migrate().await?` (or the \
                             `outbox migrate` command). The relay waits for it, trying again \
                             with backoff (at most every reconnect_delay)"
                        );
                        said_schema_missing = true;
                    } else {
                        tracing::debug!(retry_in = ?delay, "outbox relay: the outbox table still does not exist");
                    }
                    self.counter("outbox_relay_reconnects_total").increment(1);
                    RelayStats::add(&self.stats.reconnects, 1);
                    delay
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped(&mut shutdown) => return,
            }
        }
    }

    /// One session: until shutdown (`Ok`) or an error.
    async fn session(&self, shutdown: &mut watch::Receiver<bool>) -> SessionResult<()> {
        let cx = self.context();
        let timeout = self.config.connect_timeout;
        let mut session = tokio::select! {
            opened = tokio::time::timeout(timeout, DB::open(cx)) => match opened {
                Ok(session) => session?,
                Err(_) => {
                    return Err(SessionError::timed_out(
                        "the database while the relay opened its session",
                        timeout,
                    ));
                }
            },
            () = stopped(shutdown) => return Ok(()),
        };
        let connected = &self.stats.connected;
        connected.store(true, std::sync::atomic::Ordering::Relaxed);
        let result = self.work(&mut session, shutdown, &mut Alone).await;
        connected.store(false, std::sync::atomic::Ordering::Relaxed);
        if result.is_ok() {
            // Hand the work over at once instead of when the connection times out.
            let _ = tokio::time::timeout(timeout, session.close()).await;
        }
        result.map(|_| ())
    }

    /// What a session of this relay works with.
    pub(super) fn context(&self) -> Context<'_, DB> {
        Context {
            pool: self.outbox.pool(),
            tables: self.outbox.tables(),
            options: self.outbox.options(),
            config: &self.config,
            queries: &self.stats.queries,
            labels: self
                .metrics
                .gauges
                .then_some(self.metrics.labels.as_slice()),
        }
    }

    /// Warns when the active relay published nothing for `stall_warning` while rows are
    /// due (every `stall_warning` while it lasts), with what it waits for.
    fn check_progress(
        &self,
        probe: &crate::store::session::Probe,
        progress: &mut (super::RelayStatsSnapshot, Instant),
        warned_at: &mut Option<Instant>,
    ) {
        let stats = self.stats.snapshot();
        let due = probe.due.unwrap_or(probe.pending);
        if stats.published != progress.0.published || due == 0 {
            *progress = (stats, Instant::now());
            *warned_at = None;
            return;
        }
        let idle = progress.1.elapsed();
        let every = self.config.stall_warning;
        if idle < every || warned_at.is_some_and(|at| at.elapsed() < every) {
            return;
        }
        *warned_at = Some(Instant::now());
        let (failed, unavailable) = (
            stats.failed - progress.0.failed,
            stats.unavailable - progress.0.unavailable,
        );
        let waits_for = if unavailable > 0 {
            "the broker (publish attempts fail as unavailable or time out; it retries with its outage backoff)"
        } else if failed > 0 {
            "messages that fail to publish (retried with backoff, then dead-lettered)"
        } else {
            "a claim that returns nothing: rows held back by open writers (per-key order), parked keys, or a horizon that does not move"
        };
        tracing::warn!(no_progress_for = ?idle, pending = probe.pending, due,
            oldest_pending_age_seconds = probe.oldest_age_seconds,
            batches = stats.batches - progress.0.batches, failed, unavailable,
            reconnects = stats.reconnects - progress.0.reconnects,
            "outbox relay: nothing published while rows are due; waiting for {waits_for}");
    }

    /// Drives `session` until shutdown or an error; shared (a tenant's [`Turn`]), also
    /// until `sharing` says the tenant parks or yields.
    pub(super) async fn work<'r, S: Session>(
        &'r self,
        session: &mut S,
        shutdown: &mut watch::Receiver<bool>,
        sharing: &mut impl Sharing<'r>,
    ) -> SessionResult<Exit> {
        // A tenant's schedule carries over from its turns before.
        let (mut next_probe, mut retry_at) = sharing.resume();
        let mut standby = false;
        // The counts at the last progress, and when.
        let mut progress = (self.stats.snapshot(), Instant::now());
        let mut warned_at: Option<Instant> = None;
        loop {
            if *shutdown.borrow() {
                return Ok(Exit::Shutdown);
            }
            let now = Instant::now();
            let mut nothing_due = false;
            if now >= next_probe
                && let Some(probe) = session.probe().await?
            {
                self.check_progress(&probe, &mut progress, &mut warned_at);
                self.gauge("outbox_pending", probe.pending as f64);
                self.gauge(
                    "outbox_oldest_pending_age_seconds",
                    probe.oldest_age_seconds,
                );
                next_probe = now + session.probe_interval();
                retry_at = probe.next_due_in.map(|d| now + d);
                nothing_due = probe.due == Some(0);
            }
            if !session.own().await? {
                if !standby {
                    tracing::info!("another outbox relay is active; standing by");
                    standby = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(self.config.poll_interval.max(Duration::from_millis(500))) => {}
                    _ = stopped(shutdown) => {}
                }
                continue;
            }
            if standby {
                tracing::info!("outbox relay is now the active one");
                standby = false;
            }
            if !nothing_due {
                let drained = drain(self, session, shutdown, sharing.clock()).await?;
                if let Some(retry_in) = drained.retry_in {
                    let due = Instant::now() + retry_in;
                    retry_at = Some(retry_at.map_or(due, |r| r.min(due)));
                }
                if let Some(detached) = drained.detached {
                    return Ok(sharing.hand_over(detached, (next_probe, retry_at)));
                }
                if drained.claimed > 0 {
                    if let Some(exit) = sharing.after_claim((next_probe, retry_at)) {
                        return Ok(exit);
                    }
                    continue; // there may be more
                }
            }
            let until = retry_at.map_or(next_probe, |r| r.min(next_probe));
            let until = match sharing.before_wait(session.idle(), (next_probe, retry_at), until) {
                Ok(until) => until,
                Err(exit) => return Ok(exit),
            };
            session.wait(shutdown, until).await?;
            if retry_at.is_some_and(|t| t <= Instant::now()) {
                retry_at = None;
            }
        }
    }
}
