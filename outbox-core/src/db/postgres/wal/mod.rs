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
mod session;
mod slot;
mod stream;
mod table;

pub(crate) use commit::{commit_sql, emit};
pub(crate) use envelope::{decode, envelope};
pub use session::WalSession;
pub use slot::{Slot, SlotStatus};
pub(crate) use slot::{check_slot, ensure_slot, slot_status};

// What the sub-wings share (each opens with `use super::*`).
#[allow(unused_imports)]
use self::{envelope::*, session::*, slot::*, stream::*, table::*};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::time::Duration;

use chrono::{DateTime, Utc};
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sqlx::{Executor, PgConnection, Postgres};
use tokio::sync::watch;
use tokio::time::Instant;
use uuid::Uuid;

use super::Wal;
use super::write::{UTF8_GUARD, dollar_tag, literal};
use crate::config::Tables;
use crate::error::DbContext;
use crate::publisher::OutboxRecord;
use crate::store::session::{Context, Outcome, Probe, Session, SessionError, SessionResult};
use crate::task::stopped;
use crate::{Error, OutboxMessage, Result};
