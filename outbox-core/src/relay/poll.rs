//! The session loop of relays that poll (MySQL/MariaDB and SQLite have no `LISTEN`):
//! become the active relay, drain, and look again every `poll_interval`.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tokio::time::Instant;

use super::drain::{Claims, SqlResult, drain};
use super::{Relay, stopped};
use crate::publisher::Publisher;
use crate::store::Backend;

/// How often the pending-rows gauges are refreshed.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// A polling relay's database session.
pub(crate) trait Polled: Claims {
    /// Whether this session may publish now (it is, or just became, the one active relay).
    fn acquire(&mut self) -> impl Future<Output = SqlResult<bool>> + Send;

    /// Pending rows and the oldest one's creation time.
    fn probe(&mut self) -> impl Future<Output = SqlResult<(i64, Option<DateTime<Utc>>)>> + Send;
}

/// Runs `session` until shutdown (`Ok`) or a database error.
pub(crate) async fn run<P: Publisher, DB: Backend, S: Polled>(
    relay: &Relay<P, DB>,
    session: &mut S,
    shutdown: &mut watch::Receiver<bool>,
) -> SqlResult<()> {
    let poll = relay.config.poll_interval;
    let mut next_probe = Instant::now();
    let mut standby_logged = false;
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        if !session.acquire().await? {
            if !standby_logged {
                tracing::info!("another outbox relay is active; standing by");
                standby_logged = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(poll.max(Duration::from_millis(500))) => {}
                _ = stopped(shutdown) => {}
            }
            continue;
        }
        if standby_logged {
            tracing::info!("outbox relay is now the active one");
            standby_logged = false;
        }
        if Instant::now() >= next_probe {
            let (pending, oldest) = session.probe().await?;
            metrics::gauge!("outbox_pending").set(pending as f64);
            let age = oldest.map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            });
            metrics::gauge!("outbox_oldest_pending_age_seconds").set(age);
            next_probe = Instant::now() + PROBE_INTERVAL;
        }
        let claimed = drain(relay, session, shutdown).await?;
        if claimed > 0 {
            continue; // there may be more
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = stopped(shutdown) => {}
        }
    }
}
