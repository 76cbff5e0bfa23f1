//! One relay session on PostgreSQL: a dedicated connection that holds the relay's
//! advisory locks and runs every claim, reschedule and mark, plus a `LISTEN` connection,
//! and, during a backlog, a second connection that marks batch N-1 while the first
//! claims N+1.
//!
//! - **Wake-up**: `LISTEN` on the outbox channel (writers notify at commit), plus a
//!   safety probe every `poll_interval` that costs one query while idle.
//! - **Order**: rows are only claimed below the *publish horizon* (`horizon.rs`), so a
//!   transaction that drew a smaller `seq` but commits later is never overtaken.
//! - **Several relays**: rows are spread over `partitions` by key; each relay holds the
//!   partitions it publishes through advisory locks on its own connection, and relays
//!   share partitions evenly. A relay that dies loses its connection and with it its
//!   partitions; it cannot claim, reschedule or dead-letter anything after that, because
//!   those go through that same connection. (A mark through the second connection can
//!   still land: it records an acknowledgement the broker gave, which is true anyway.)

mod horizon;
pub(super) mod lease;
mod ownership;
mod sql;
mod table;

pub use table::PgSession;

// What the sub-wings share (each opens with `use super::*`).
#[allow(unused_imports)]
use self::{ownership::*, sql::*, table::*};

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::{Connection, Executor, PgConnection, Postgres, Row};
use tokio::sync::watch;
use tokio::time::Instant;

use self::horizon::{Horizon, Sample};
use super::locks;
use crate::config::{OnDeadLetter, OnSent, RelayConfig};
use crate::db::rows::{budgeted, claim_columns, decode_each, record};
use crate::model::state::{self, PENDING};
use crate::publisher::OutboxRecord;
use crate::store::session::{
    Context, Outcome, Probe, Session, SessionError, SessionResult, Source,
};
use crate::task::stopped;
/// A connection of the relay's, with its settings: keepalives, marks without waiting for
/// the WAL flush, custom plans, and the idle-session timeout.
pub(super) async fn connect_configured(
    options: &sqlx::postgres::PgConnectOptions,
    config: &RelayConfig,
) -> SessionResult<PgConnection> {
    let mut conn = PgConnection::connect_with(options).await?;
    // Notice a vanished relay host in ~25 s instead of the OS default of 2 hours, so its
    // partitions are taken over (the server drops the session and its locks).
    conn.execute("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3")
        .await?;
    // The relay's marks need not wait for their WAL flush: a mark lost in a server
    // crash (at most about 3 x wal_writer_delay of them) leaves its message pending,
    // and it is published again, which at-least-once delivery allows. Marks are lost as
    // a suffix of the WAL, so a key's later mark is never kept without its earlier one.
    // Waiting for the flush would put every relay round trip in the writers' fsync
    // queue.
    conn.execute("SET synchronous_commit = off").await?;
    // Each statement is planned for its own arguments and the table as it is now. A
    // session lives for days while the outbox grows from a few rows to millions and
    // back; after five runs PostgreSQL may keep a generic plan chosen while the table
    // was tiny (a sequential scan of its one page), and until an ANALYZE invalidated
    // it every mark read the whole table: 4.7 ms for 10 rows of a 30,000-row table
    // (test `a_relay_that_started_on_a_small_table_marks_a_backlog_by_index`). Planning
    // costs tens of microseconds per statement.
    conn.execute("SET plan_cache_mode = force_custom_plan")
        .await?;
    // A relay process that stops answering (SIGSTOP, a frozen VM) keeps its TCP
    // connection alive (the kernel answers keepalives): the server ends its session,
    // and with it the partitions, once it has been idle that long (PostgreSQL >= 14).
    sqlx::query(
        "SELECT set_config('idle_session_timeout', $1, false) \
         WHERE current_setting('server_version_num')::int >= 140000",
    )
    .bind(format!(
        "{}ms",
        config.effective_session_timeout().as_millis()
    ))
    .execute(&mut conn)
    .await?;
    Ok(conn)
}
/// A relay session on PostgreSQL: table mode's or WAL mode's, as the outbox was built.
pub type AnySession<'a> = Either<PgSession<'a>, WalSession<'a>>;

#[cfg(feature = "wal")]
use super::wal::WalSession;

/// Without the `wal` feature no outbox is in WAL mode (the builder's `wal*` methods come
/// with it), and no WAL session can exist.
#[cfg(not(feature = "wal"))]
pub type WalSession<'a> = NoWal;

/// The WAL session of a build without the `wal` feature: a type without values.
#[cfg(not(feature = "wal"))]
#[derive(Debug)]
pub enum NoWal {}

#[cfg(not(feature = "wal"))]
impl Session for NoWal {
    async fn probe(&mut self) -> SessionResult<Option<Probe>> {
        match *self {}
    }
    fn probe_interval(&self) -> Duration {
        match *self {}
    }
    async fn own(&mut self) -> SessionResult<bool> {
        match *self {}
    }
    async fn wait(&mut self, _: &mut watch::Receiver<bool>, _: Instant) -> SessionResult<()> {
        match *self {}
    }
    async fn retrying_keys(&mut self) -> SessionResult<Vec<String>> {
        match *self {}
    }
    async fn claim(&mut self, _: Option<i64>) -> SessionResult<Vec<OutboxRecord>> {
        match *self {}
    }
    async fn acknowledge(&mut self, _: &Outcome) -> SessionResult<()> {
        match *self {}
    }
    async fn record_and_claim(
        &mut self,
        _: &Outcome,
        _: Option<i64>,
    ) -> SessionResult<(u64, Vec<OutboxRecord>)> {
        match *self {}
    }
    async fn fail(&mut self, _: &Outcome) -> SessionResult<u64> {
        match *self {}
    }
    async fn close(self) {
        match self {}
    }
}

impl Source for Postgres {
    const POLL_INTERVAL: Duration = Duration::from_secs(5);

    type Session<'a> = AnySession<'a>;

    async fn open<'a>(cx: Context<'a, Self>) -> SessionResult<Self::Session<'a>> {
        Ok(match &cx.options.wal {
            None => Either::Table(PgSession::connect(cx).await?),
            #[cfg(feature = "wal")]
            Some(wal) => Either::Wal(WalSession::open(cx, wal).await?),
            #[cfg(not(feature = "wal"))]
            Some(_) => {
                return Err(SessionError::Refused(format!(
                    "{} is a WAL-mode outbox; its relay reads the replication slot, which \
                     needs outbox's `wal` feature",
                    cx.tables.outbox
                )));
            }
        })
    }
}

/// Table mode's session or WAL mode's, as the outbox was built.
#[derive(Debug)]
pub enum Either<T, W> {
    /// Table mode.
    Table(T),
    /// WAL mode.
    Wal(W),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            Either::Table($s) => $e,
            Either::Wal($s) => $e,
        }
    };
}

impl<T: Session, W: Session> Session for Either<T, W> {
    async fn probe(&mut self) -> SessionResult<Option<Probe>> {
        both!(self, s => s.probe().await)
    }
    fn probe_interval(&self) -> Duration {
        both!(self, s => s.probe_interval())
    }
    async fn own(&mut self) -> SessionResult<bool> {
        both!(self, s => s.own().await)
    }
    async fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
    ) -> SessionResult<()> {
        both!(self, s => s.wait(shutdown, until).await)
    }
    async fn retrying_keys(&mut self) -> SessionResult<Vec<String>> {
        both!(self, s => s.retrying_keys().await)
    }
    async fn claim(&mut self, after: Option<i64>) -> SessionResult<Vec<OutboxRecord>> {
        both!(self, s => s.claim(after).await)
    }
    async fn acknowledge(&mut self, outcome: &Outcome) -> SessionResult<()> {
        both!(self, s => s.acknowledge(outcome).await)
    }
    async fn record_and_claim(
        &mut self,
        outcome: &Outcome,
        after: Option<i64>,
    ) -> SessionResult<(u64, Vec<OutboxRecord>)> {
        both!(self, s => s.record_and_claim(outcome, after).await)
    }
    async fn fail(&mut self, outcome: &Outcome) -> SessionResult<u64> {
        both!(self, s => s.fail(outcome).await)
    }
    async fn close(self) {
        both!(self, s => s.close().await)
    }
    fn idle(&self) -> bool {
        both!(self, s => s.idle())
    }
}
