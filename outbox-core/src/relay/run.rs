//! The one relay loop: it opens a [`Session`] of the outbox's database and drives it,
//! whatever the database. Each round: probe when the interval is up (gauges, and whether
//! anything is due), check ownership (stand by while another relay is active), drain
//! until nothing is claimable, then wait for work, the next probe or the next retry.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::drain::{Clock, Detached, drain};
use super::{Relay, RelayStats};
use crate::publisher::Publisher;
use crate::store::Backend;
use crate::store::session::{Context, Session, SessionError, SessionResult};
use crate::task::stopped;

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
    fn clock(&self) -> Clock<'t> {
        Clock {
            started: self.started,
            quantum: self.quantum,
            contended: self.contended,
        }
    }

    /// Whether the turn is over: its time is up and another tenant waits.
    fn over(&self) -> bool {
        self.clock().over()
    }

    /// Keeps the schedule for the tenant's next turn.
    fn carry(&mut self, next_probe: Instant, retry_at: Option<Instant>) {
        self.next_probe = next_probe;
        self.retry_at = retry_at;
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

impl<P: Publisher, DB: Backend> Relay<P, DB> {
    /// Runs until `shutdown` turns `true` (forever if its sender is dropped). A batch in flight
    /// is finished (published and marked) first; nothing is marked that was not acked.
    ///
    /// Database errors never end the relay: it logs them, reconnects with backoff and
    /// carries on where the database says it left off.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        const FIRST_DELAY: Duration = Duration::from_millis(50);
        let mut delay = FIRST_DELAY;
        // Once shutdown is asked, the batch in flight gets `publish_timeout` to be
        // published and `connect_timeout` more to be recorded; past that (a database that
        // stopped answering) the session is dropped: what it had not recorded is
        // published again by the next relay.
        let grace = self.config.publish_timeout + self.config.connect_timeout;
        let mut asked = shutdown.clone();
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
            if started.elapsed() > Duration::from_secs(30) {
                delay = FIRST_DELAY;
            }
            match result {
                Ok(()) => return,
                Err(e) => {
                    tracing::error!(error = %e, retry_in = ?delay, "outbox relay: database session failed; reconnecting");
                    self.counter("outbox_relay_reconnects_total").increment(1);
                    RelayStats::add(&self.stats.reconnects, 1);
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped(&mut shutdown) => return,
            }
            delay = (delay * 2).min(self.config.reconnect_delay);
        }
    }

    /// One session: until shutdown (`Ok`) or an error.
    async fn session(&self, shutdown: &mut watch::Receiver<bool>) -> SessionResult<()> {
        let cx = self.context();
        let timeout = self.config.connect_timeout;
        let mut session = tokio::select! {
            opened = tokio::time::timeout(timeout, DB::open(cx)) => match opened {
                Ok(session) => session?,
                Err(_) => return Err(SessionError::TimedOut(timeout)),
            },
            () = stopped(shutdown) => return Ok(()),
        };
        let result = self.work(&mut session, shutdown, None).await;
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
            config: &self.config,
            queries: &self.stats.queries,
            labels: self.gauges.then_some(self.labels.as_slice()),
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

    /// Drives `session` until shutdown or an error; in a tenant's `turn`, also until the
    /// tenant has nothing to do (it parks) or has had its turn while others wait.
    pub(super) async fn work<'r, S: Session>(
        &'r self,
        session: &mut S,
        shutdown: &mut watch::Receiver<bool>,
        mut turn: Option<&mut Turn<'_, 'r>>,
    ) -> SessionResult<Exit> {
        // A tenant's schedule carries over from its turns before.
        let (mut next_probe, mut retry_at) = turn
            .as_deref()
            .map_or((Instant::now(), None), |t| (t.next_probe, t.retry_at));
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
            if now >= next_probe {
                if let Some(probe) = session.probe().await? {
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
                let clock = turn.as_deref().map(Turn::clock);
                let drained = drain(self, session, shutdown, clock).await?;
                if let Some(retry_in) = drained.retry_in {
                    let due = Instant::now() + retry_in;
                    retry_at = Some(retry_at.map_or(due, |r| r.min(due)));
                }
                if let (Some(detached), Some(turn)) = (drained.detached, turn.as_deref_mut()) {
                    // Its turn is over while the broker has its batches: the connection
                    // goes to the next tenant now, not once the broker answers.
                    turn.carry(next_probe, retry_at);
                    turn.detached = Some(detached);
                    return Ok(Exit::Yield);
                }
                if drained.claimed > 0 {
                    if let Some(turn) = turn.as_deref_mut().filter(|t| t.over()) {
                        turn.carry(next_probe, retry_at);
                        return Ok(Exit::Yield);
                    }
                    continue; // there may be more
                }
            }
            let mut until = retry_at.map_or(next_probe, |r| r.min(next_probe));
            if let Some(turn) = turn.as_deref_mut() {
                if session.idle() {
                    // Nothing to do: the tenant gives its connection back until a commit,
                    // its next retry or its next probe.
                    turn.carry(next_probe, retry_at);
                    return Ok(Exit::Park(until));
                }
                if turn.over() {
                    // Waiting for writers to finish while other tenants wait for a
                    // connection: it queues again behind them.
                    turn.carry(next_probe, retry_at);
                    return Ok(Exit::Yield);
                }
                if (turn.contended)() {
                    // Looks again when its turn is up (the session's wait also ends when
                    // a tenant starts waiting for a connection).
                    until = until.min(turn.started + turn.quantum);
                }
            }
            session.wait(shutdown, until).await?;
            if retry_at.is_some_and(|t| t <= Instant::now()) {
                retry_at = None;
            }
        }
    }
}
