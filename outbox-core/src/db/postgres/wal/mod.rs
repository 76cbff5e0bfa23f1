//! WAL mode ([`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md)): commits write each event into the write-ahead log with
//! `pg_logical_emit_message(true, prefix, envelope)`, with no row and no `NOTIFY`; the
//! relay reads them, in commit order, from a logical replication slot (pgoutput with
//! `messages 'true'`, through `pgwire-replication`), and confirms the slot's position
//! only up to the last commit whose events the broker has all acknowledged.
//!
//! Positions: the session numbers the messages it receives (`seq` of the records it
//! hands out) and remembers, per commit, the last number and the commit's end LSN.

mod commit;
mod envelope;
// The relay's side: the replication stream (feature `wal`).
#[cfg(feature = "wal")]
mod session;
mod slot;
#[cfg(feature = "wal")]
mod stream;
#[cfg(feature = "wal")]
mod table;

pub(crate) use commit::{commit_sql, emit};
#[cfg(feature = "wal")]
pub(crate) use envelope::decode;
pub(crate) use envelope::envelope;
#[cfg(feature = "wal")]
pub use session::WalSession;
#[cfg(feature = "wal")]
pub(crate) use slot::check_slot;
pub use slot::{Slot, SlotStatus};
pub(crate) use slot::{ensure_slot, slot_status};

// What the sub-wings share (each opens with `use super::*`).
#[allow(unused_imports)]
use self::{envelope::*, slot::*};
#[cfg(feature = "wal")]
#[allow(unused_imports)]
use self::{session::*, stream::*, table::*};
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Executor, PgConnection, Postgres};
use uuid::Uuid;

use super::Wal;
use super::write::{UTF8_GUARD, dollar_tag};
use crate::config::Tables;
use crate::error::DbContext;

// What only the relay's side (the stream, feature `wal`) uses.
use crate::{Error, OutboxMessage, Result};
#[cfg(feature = "wal")]
use {
    crate::Payload,
    crate::publisher::OutboxRecord,
    crate::store::session::{Context, Outcome, Probe, Session, SessionError, SessionResult},
    crate::task::stopped,
    pgwire_replication::{
        Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent,
    },
    serde::Deserialize,
    serde_json::value::RawValue,
    std::collections::{HashSet, VecDeque},
    std::time::Duration,
    tokio::sync::watch,
    tokio::time::Instant,
};
