//! WAL mode (`docs/wal.md`): commits write each event into the write-ahead log with
//! `pg_logical_emit_message(true, prefix, envelope)`, with no row and no `NOTIFY`; the
//! relay reads them, in commit order, from a logical replication slot (pgoutput with
//! `messages 'true'`, through `pgwire-replication`), and confirms the slot's position
//! only up to the last commit whose events the broker has all acknowledged.
//!
//! Positions: the session numbers the messages it receives (`seq` of the records it
//! hands out) and remembers, per commit, the last number and the commit's end LSN.

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

use crate::config::{Secret, Tables, Wal};
use crate::error::DbContext;
use crate::model::SlotStatus;
use crate::publisher::OutboxRecord;
use crate::store::session::{Context, Outcome, Probe, Session, SessionError, SessionResult};
use crate::task::stopped;
use crate::{Error, OutboxBuilder, OutboxMessage, Result};

/// The envelope's format version (its `v`).
pub(crate) const ENVELOPE_VERSION: u8 = 1;

/// One event as written into the WAL: a JSON object, `payload` last and verbatim.
#[derive(Serialize)]
struct EnvelopeOut<'a> {
    v: u8,
    id: Uuid,
    #[serde(rename = "type")]
    event_type: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    version: Option<i32>,
    destination: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    headers: &'a BTreeMap<String, String>,
    created_at: DateTime<Utc>,
    payload: &'a RawValue,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    v: u8,
    id: Uuid,
    #[serde(rename = "type")]
    event_type: String,
    #[serde(default)]
    version: Option<i32>,
    destination: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    created_at: DateTime<Utc>,
    payload: Box<RawValue>,
}

/// `message` as its WAL envelope.
pub(crate) fn envelope(message: &OutboxMessage, created_at: DateTime<Utc>) -> Result<String> {
    let payload: &RawValue = serde_json::from_str(&message.payload).map_err(|e| {
        Error::InvalidMessage(
            format!(
                "message {} (`{}`): the payload is not JSON ({e}); WAL mode carries it verbatim",
                message.id, message.event_type
            )
            .into(),
        )
    })?;
    let out = EnvelopeOut {
        v: ENVELOPE_VERSION,
        id: message.id,
        event_type: &message.event_type,
        version: message.event_version,
        destination: &message.destination,
        key: message.partition_key.as_deref(),
        headers: &message.headers,
        created_at,
        payload,
    };
    serde_json::to_string(&out).map_err(|e| Error::InvalidMessage(e.to_string().into()))
}

/// The record an envelope holds, at position `seq`.
pub(crate) fn decode(content: &[u8], seq: i64) -> std::result::Result<OutboxRecord, String> {
    let e: EnvelopeIn = serde_json::from_slice(content).map_err(|e| e.to_string())?;
    if e.v != ENVELOPE_VERSION {
        return Err(format!(
            "envelope version {} (this relay reads version {ENVELOPE_VERSION}): upgrade the relay",
            e.v
        ));
    }
    Ok(OutboxRecord {
        seq,
        id: e.id,
        event_type: e.event_type,
        event_version: e.version,
        destination: e.destination,
        partition_key: e.key,
        payload: e.payload.get().to_owned(),
        headers: e.headers,
        created_at: e.created_at,
        attempts: 0,
    })
}

/// The statement that writes `messages` into the WAL, as literals (sent with `COMMIT` in
/// one round trip, like table mode's): one `pg_logical_emit_message` per event, in emit
/// order (a `VALUES` list is scanned in order). The UTF-8 guard runs first.
pub(crate) fn commit_sql(wal: &Wal, messages: &[OutboxMessage]) -> Result<String> {
    let now = Utc::now();
    let mut sql = String::with_capacity(messages.iter().map(|m| m.payload.len() + 200).sum());
    sql.push_str("SELECT pg_logical_emit_message(true, ");
    let tag = super::dollar_tag(&wal.prefix);
    sql.push_str(&tag);
    sql.push_str(&wal.prefix);
    sql.push_str(&tag);
    sql.push_str(", ");
    if let [m] = messages {
        // One event (the common case): no row source to plan.
        super::literal(&mut sql, &envelope(m, now)?, m)?;
        sql.push(')');
    } else {
        sql.push_str("m) FROM (VALUES ");
        for (i, m) in messages.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push('(');
            super::literal(&mut sql, &envelope(m, now)?, m)?;
            sql.push(')');
        }
        sql.push_str(") AS v(m)");
    }
    // The guard is a one-time filter: evaluated once, before any message is written.
    sql.push_str(&format!(" WHERE {} = 0", super::UTF8_GUARD));
    Ok(sql)
}

/// Writes `messages` into the WAL inside the caller's transaction (bound parameters).
pub(crate) async fn emit(
    conn: &mut PgConnection,
    tables: &Tables,
    wal: &Wal,
    messages: &[OutboxMessage],
) -> Result<()> {
    let now = Utc::now();
    let envelopes = messages
        .iter()
        .map(|m| envelope(m, now))
        .collect::<Result<Vec<_>>>()?;
    sqlx::query(&format!(
        "SELECT pg_logical_emit_message(true, $1, m) FROM unnest($2::text[]) AS u(m) WHERE {} = 0",
        super::UTF8_GUARD
    ))
    .bind(&wal.prefix)
    .bind(&envelopes)
    .execute(conn)
    .await
    .context("writing events to the WAL", &tables.outbox)?;
    Ok(())
}

/// Creates the publication and the slot if they do not exist, after checking
/// `wal_level`. The slot must exist before the first event is written: a slot sees only
/// what is written after it was created.
pub(crate) async fn ensure_slot(pool: &sqlx::PgPool, tables: &Tables, wal: &Wal) -> Result<()> {
    let mut conn = pool
        .acquire()
        .await
        .context("creating the replication slot", &tables.outbox)?;
    check_wal_level(&mut conn, tables).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(&wal.publication)
            .fetch_one(&mut *conn)
            .await
            .context("creating the publication", &tables.outbox)?;
    if !exists {
        // A publication of no table: pgoutput needs one, the relay reads only messages.
        let created = conn
            .execute(format!("CREATE PUBLICATION \"{}\"", wal.publication).as_str())
            .await;
        if let Err(e) = created {
            if !is_duplicate(&e) {
                return Err(e).context("creating the publication", &tables.outbox);
            }
        }
    }
    let slot: Option<(Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT plugin::text, database::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&wal.slot)
    .fetch_optional(&mut *conn)
    .await
    .context("creating the replication slot", &tables.outbox)?;
    match slot {
        Some((plugin, database)) => {
            let here: String = sqlx::query_scalar("SELECT current_database()::text")
                .fetch_one(&mut *conn)
                .await
                .context("creating the replication slot", &tables.outbox)?;
            if plugin.as_deref() != Some("pgoutput") || database.as_deref() != Some(&here) {
                return Err(Error::InvalidArgument(
                    format!(
                        "replication slot {:?} exists but is not a pgoutput slot of database {here:?} \
                         (plugin {plugin:?}, database {database:?}): choose another slot name \
                         (OutboxBuilder::wal_slot) or drop that slot",
                        wal.slot
                    )
                    .into(),
                ));
            }
        }
        None => {
            let created = sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                .bind(&wal.slot)
                .execute(&mut *conn)
                .await;
            if let Err(e) = created {
                if !is_duplicate(&e) {
                    return Err(e).context("creating the replication slot", &tables.outbox);
                }
            }
        }
    }
    Ok(())
}

/// Checks, before the relay streams, that the slot exists and still holds the stream.
/// The relay never creates the slot: a slot sees only what is written after it is
/// created, so one made by the relay after the old one was lost would skip, silently,
/// every event committed in between. [`Outbox::migrate`](crate::Outbox::migrate)
/// creates it (before the first event).
pub(crate) async fn check_slot(pool: &sqlx::PgPool, tables: &Tables, wal: &Wal) -> Result<()> {
    let mut conn = pool
        .acquire()
        .await
        .context("checking the replication slot", &tables.outbox)?;
    check_wal_level(&mut conn, tables).await?;
    let slot: Option<(Option<String>, Option<String>, bool)> = sqlx::query_as(
        "SELECT plugin::text, wal_status, database IS NOT DISTINCT FROM current_database() \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&wal.slot)
    .fetch_optional(&mut *conn)
    .await
    .context("checking the replication slot", &tables.outbox)?;
    match slot {
        None => Err(Error::InvalidArgument(
            format!(
                "WAL relay: replication slot {:?} does not exist. On a new installation, run \
                 `outbox migrate` (or Outbox::migrate) before the first event is written: it \
                 creates the slot. If the slot existed, it was dropped, and the events committed \
                 since the relay last confirmed are in no slot: see \"A lost or invalidated slot\" \
                 in docs/wal.md before you create a new one",
                wal.slot
            )
            .into(),
        )),
        Some((_, Some(status), _)) if status == "lost" => Err(Error::InvalidArgument(
            format!(
                "WAL relay: replication slot {:?} was invalidated by PostgreSQL (it retained more \
                 WAL than max_slot_wal_keep_size allows), and the WAL it needed is gone: events \
                 committed since the relay last confirmed cannot be read from it. The relay \
                 refuses to go on, to lose nothing silently: see \"A lost or invalidated slot\" \
                 in docs/wal.md",
                wal.slot
            )
            .into(),
        )),
        Some((plugin, _, same_db)) if plugin.as_deref() != Some("pgoutput") || !same_db => {
            Err(Error::InvalidArgument(
                format!(
                    "WAL relay: replication slot {:?} is not a pgoutput slot of this database \
                     (plugin {plugin:?}): choose another slot name (OutboxBuilder::wal_slot)",
                    wal.slot
                )
                .into(),
            ))
        }
        Some(_) => Ok(()),
    }
}

/// The state of `wal`'s slot, as the server sees it (`outbox status`).
pub(crate) async fn slot_status(pool: &sqlx::PgPool, wal: &Wal) -> sqlx::Result<SlotStatus> {
    type SlotRow = (
        Option<i32>,
        Option<String>,
        Option<i64>,
        Option<i64>,
        Option<f64>,
    );
    let row: Option<SlotRow> = sqlx::query_as(
        "SELECT s.active_pid, s.wal_status, \
                    (pg_current_wal_lsn() - s.confirmed_flush_lsn)::int8, \
                    (pg_current_wal_lsn() - s.restart_lsn)::int8, \
                    extract(epoch FROM r.flush_lag)::float8 \
             FROM pg_replication_slots s \
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
             WHERE s.slot_name = $1",
    )
    .bind(&wal.slot)
    .fetch_optional(pool)
    .await?;
    let Some((active_pid, wal_status, unconfirmed, retained, lag)) = row else {
        return Ok(SlotStatus {
            name: wal.slot.clone(),
            ..SlotStatus::default()
        });
    };
    let oldest = match active_pid {
        Some(_) => lag,
        None if wal_status.as_deref() == Some("lost") => None,
        None => first_commit_age(pool, wal).await?,
    };
    Ok(SlotStatus {
        name: wal.slot.clone(),
        exists: true,
        active_pid,
        wal_status,
        unconfirmed_bytes: unconfirmed,
        retained_bytes: retained,
        oldest_unconfirmed_age_seconds: oldest,
    })
}

/// The age of the first commit the slot would stream, read without consuming it
/// (`pg_logical_slot_peek_binary_changes`: pgoutput's Begin message holds the commit
/// time). Only for a slot no relay streams from (the server refuses otherwise), and
/// given 5 s: `None` past that, or when there is nothing to stream.
async fn first_commit_age(pool: &sqlx::PgPool, wal: &Wal) -> sqlx::Result<Option<f64>> {
    let mut tx = pool.begin().await?;
    tx.execute("SET LOCAL statement_timeout = '5s'").await?;
    let peeked: sqlx::Result<Option<Vec<u8>>> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, 1, \
           'proto_version', '1', 'publication_names', $2, 'messages', 'true') LIMIT 1",
    )
    .bind(&wal.slot)
    .bind(&wal.publication)
    .fetch_optional(&mut *tx)
    .await;
    let _ = tx.rollback().await;
    let data = match peeked {
        Ok(data) => data,
        // Taken by a relay meanwhile (55006), too slow (57014), a role without
        // REPLICATION (42501)...: the age is unknown, the rest of the status stands.
        Err(e) if e.as_database_error().is_some() => {
            tracing::debug!(error = %e, "outbox status: cannot peek at the replication slot");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    // Begin: 'B', final LSN (8 bytes), commit time (8: microseconds since 2000-01-01 UTC).
    let Some(micros) = data
        .filter(|d| d.len() >= 17 && d[0] == b'B')
        .and_then(|d| d[9..17].try_into().ok())
        .map(i64::from_be_bytes)
    else {
        return Ok(None);
    };
    let epoch_2000 = DateTime::<Utc>::from_timestamp(946_684_800, 0).unwrap_or_default();
    let Some(committed) = epoch_2000.checked_add_signed(chrono::Duration::microseconds(micros))
    else {
        return Ok(None);
    };
    Ok(Some(
        (Utc::now() - committed).num_milliseconds().max(0) as f64 / 1000.0,
    ))
}

impl crate::admin::Admin<Postgres> {
    /// Drops the outbox's replication slot and its publication (WAL mode), for an
    /// outbox you retire: a slot nobody reads keeps WAL on the server forever. The
    /// events the slot still holds (see [`SlotStatus::unconfirmed_bytes`]) are lost
    /// with it. Refused while a relay streams from it. Returns the slot's state just
    /// before it was dropped.
    pub async fn drop_slot(&self) -> Result<SlotStatus> {
        let tables = self.outbox.tables();
        let Some(wal) = &tables.wal else {
            return Err(Error::InvalidArgument(
                "this outbox is not in WAL mode: it has no replication slot to drop \
                 (build it with OutboxBuilder::wal, or pass --wal-slot to the CLI)"
                    .into(),
            ));
        };
        let pool = self.outbox.pool();
        let status = slot_status(pool, wal)
            .await
            .context("reading the replication slot", &tables.outbox)?;
        if !status.exists {
            return Err(Error::InvalidArgument(
                format!(
                    "replication slot {:?} does not exist; nothing to drop",
                    wal.slot
                )
                .into(),
            ));
        }
        if let Some(pid) = status.active_pid {
            return Err(Error::InvalidArgument(
                format!(
                    "a relay (server process {pid}) streams from replication slot {:?}: stop the \
                     relays of this outbox first; nothing was dropped",
                    wal.slot
                )
                .into(),
            ));
        }
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&wal.slot)
            .execute(pool)
            .await
            .context("dropping the replication slot", &tables.outbox)?;
        pool.execute(format!("DROP PUBLICATION IF EXISTS \"{}\"", wal.publication).as_str())
            .await
            .context("dropping the publication", &tables.outbox)?;
        tracing::warn!(slot = %wal.slot, "outbox: replication slot dropped");
        Ok(status)
    }
}

fn is_duplicate(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "42710" || c == "23505")
}

async fn check_wal_level(conn: &mut PgConnection, tables: &Tables) -> Result<()> {
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&mut *conn)
        .await
        .context("reading wal_level", &tables.outbox)?;
    if level != "logical" {
        return Err(Error::InvalidArgument(
            format!(
                "WAL mode needs wal_level = logical, and this server has wal_level = {level}: \
                 run `ALTER SYSTEM SET wal_level = logical` and restart PostgreSQL \
                 (or use table mode: drop `.wal()` from the Outbox builder)"
            )
            .into(),
        ));
    }
    Ok(())
}

impl OutboxBuilder<Postgres> {
    /// WAL mode: commits write events into PostgreSQL's write-ahead log
    /// (`pg_logical_emit_message`), not into the outbox table, and the relay reads them
    /// from a logical replication slot. Needs `wal_level = logical` and a user with the
    /// `REPLICATION` attribute; [`Outbox::migrate`](crate::Outbox::migrate) creates the
    /// slot (before the first event: a slot sees only what is written after it). See
    /// `docs/wal.md`.
    pub fn wal(mut self) -> Self {
        self.wal.get_or_insert((None, None));
        self
    }

    /// WAL mode with the replication slot `name` (default `outbox_<table>`).
    pub fn wal_slot(mut self, name: impl Into<String>) -> Self {
        self.wal.get_or_insert((None, None)).0 = Some(name.into());
        self
    }

    /// The password of the relay's replication connection, when the pool's connect
    /// options hold one ([`Outbox::connect_wal`](crate::Outbox::connect_wal) takes it
    /// from the URL). Without it, the relay uses `PGPASSWORD`, if set.
    pub fn wal_password(mut self, password: impl Into<String>) -> Self {
        self.wal.get_or_insert((None, None)).1 = Some(Secret(password.into()));
        self
    }
}

impl crate::Outbox<Postgres> {
    /// Connects to PostgreSQL at `url` in WAL mode (see [`OutboxBuilder::wal`]), with the
    /// default table names; the relay's replication connection uses the URL's password.
    pub async fn connect_wal(url: &str) -> Result<Self> {
        let pool = super::super::connect::pool(url).await?;
        let mut builder = crate::Outbox::builder(pool).wal();
        if let Some(password) = url_password(url) {
            builder = builder.wal_password(password);
        }
        builder.build()
    }
}

/// The percent-decoded password of a `postgres://user:password@host/db` URL, or of its
/// `password=` query parameter.
fn url_password(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = before_query.split('/').next()?;
    let in_userinfo = authority
        .rsplit_once('@')
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, password)| password);
    let in_query = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("password="));
    percent_decode(in_userinfo.or(in_query)?)
}

/// `text` with its `%XX` escapes decoded (on bytes: a `%` before anything but two hex
/// digits stays as it is); `None` if the result is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let hex = |b: u8| char::from(b).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            if let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).and_then(|&b| hex(b)),
                bytes.get(i + 2).and_then(|&b| hex(b)),
            ) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Writes `record` into the outbox table `t` (quoted): dead with `error`, or pending
/// (parked behind its key's dead letter, or set aside while it waits for a retry at
/// `retry_at`), with its attempts. Idempotent by id: after a restart the unconfirmed
/// part of the stream comes again.
async fn insert_row(
    conn: &mut PgConnection,
    t: &str,
    record: &OutboxRecord,
    error: Option<&str>,
    retry_at: Option<DateTime<Utc>>,
) -> sqlx::Result<()> {
    let headers =
        serde_json::to_string(&record.headers).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query(&format!(
        "INSERT INTO {t} (id, event_type, event_version, destination, partition_key, payload, \
                          headers, created_at, attempts, last_error, dead_at, next_attempt_at) \
         VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7::jsonb, $8, $9, $10, \
                 CASE WHEN $10 IS NULL THEN NULL ELSE now() END, $11) \
         ON CONFLICT (id) DO NOTHING"
    ))
    .bind(record.id)
    .bind(&record.event_type)
    .bind(record.event_version)
    .bind(&record.destination)
    .bind(&record.partition_key)
    .bind(&record.payload)
    .bind(headers)
    .bind(record.created_at)
    .bind(record.attempts)
    .bind(error)
    .bind(retry_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Writes `records` into the outbox table in one statement per chunk, in their order
/// (messages parked behind a dead letter, or set aside while they wait for a retry at
/// their `retry_at`), with their attempts. Idempotent by id, like [`insert_row`].
async fn insert_rows(
    conn: &mut PgConnection,
    t: &str,
    records: &[(&OutboxRecord, Option<DateTime<Utc>>)],
) -> sqlx::Result<u64> {
    // Bounded statements: a chunk's arrays are sent as one message.
    const ROWS: usize = 1000;
    const BYTES: usize = 8 * 1024 * 1024;
    let sql = format!(
        "INSERT INTO {t} (id, event_type, event_version, destination, partition_key, payload, \
                          headers, created_at, attempts, next_attempt_at) \
         SELECT m.id, m.event_type, m.event_version, m.destination, m.partition_key, \
                m.payload::jsonb, m.headers::jsonb, m.created_at, m.attempts, m.retry_at \
         FROM UNNEST($1::uuid[], $2::text[], $3::int4[], $4::text[], $5::text[], $6::text[], \
                     $7::text[], $8::timestamptz[], $9::int4[], $10::timestamptz[]) \
              WITH ORDINALITY AS m(id, event_type, event_version, destination, partition_key, \
                                   payload, headers, created_at, attempts, retry_at, ord) \
         ORDER BY m.ord \
         ON CONFLICT (id) DO NOTHING"
    );
    let mut statements = 0;
    let mut rest = records;
    while !rest.is_empty() {
        let mut n = 0;
        let mut bytes = 0;
        while n < rest.len() && n < ROWS && (n == 0 || bytes < BYTES) {
            bytes += size_of_record(rest[n].0);
            n += 1;
        }
        let (chunk, after) = rest.split_at(n);
        rest = after;
        let mut headers = Vec::with_capacity(chunk.len());
        for (r, _) in chunk {
            headers.push(
                serde_json::to_string(&r.headers).map_err(|e| sqlx::Error::Encode(Box::new(e)))?,
            );
        }
        sqlx::query(&sql)
            .bind(chunk.iter().map(|(r, _)| r.id).collect::<Vec<_>>())
            .bind(
                chunk
                    .iter()
                    .map(|(r, _)| r.event_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(r, _)| r.event_version)
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(r, _)| r.destination.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(r, _)| r.partition_key.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(
                chunk
                    .iter()
                    .map(|(r, _)| r.payload.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(headers)
            .bind(chunk.iter().map(|(r, _)| r.created_at).collect::<Vec<_>>())
            .bind(chunk.iter().map(|(r, _)| r.attempts).collect::<Vec<_>>())
            .bind(chunk.iter().map(|(_, at)| *at).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await?;
        statements += 1;
    }
    Ok(statements)
}

/// The bytes of a message the memory bounds count: its payload and its headers.
fn size_of_record(record: &OutboxRecord) -> usize {
    record.payload.len()
        + record
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
}

/// `due` as a wall-clock time.
fn wall(due: Option<Instant>) -> Option<DateTime<Utc>> {
    let now = Instant::now();
    due.filter(|d| *d > now)
        .and_then(|d| chrono::Duration::from_std(d - now).ok())
        .map(|d| Utc::now() + d)
}

/// How long a replication connection may stay silent before the server ends it
/// (`wal_sender_timeout`): a relay that stopped answering (SIGSTOP, a frozen VM) gives
/// the slot up after that long, and a standby takes it.
pub(crate) const SENDER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Entry {
    record: OutboxRecord,
    sent: bool,
    /// Failed: not before this instant.
    due: Option<Instant>,
    /// Read from the outbox table (a released dead letter or a message parked behind
    /// one): its row's `seq`, marked there once acknowledged.
    row: Option<i64>,
    /// Its key is parked behind a dead letter: the message goes into the outbox table,
    /// behind it, instead of to the broker.
    to_table: bool,
    /// Its last attempt failed because the broker was unavailable (no attempt counted):
    /// it waits in memory, never set aside into the table for that (an outage is not a
    /// key that keeps failing).
    outage: bool,
}

/// The advisory lock (one `bigint` key, `hashtext` of this) a relay holds while it writes
/// the outbox table in WAL mode, and that a relay taking the slot waits for: a write
/// checked while its relay held the slot is read by the next relay.
fn fence_key(wal: &Wal) -> String {
    format!("outbox:wal-fence:{}", wal.slot)
}

/// Messages the replication client reads ahead of the session (its event channel), on
/// top of the session's own bounds (`RelayConfig::wal_buffer_bytes`, the count): what
/// memory holds at most is those bounds plus this many messages.
pub(crate) const READ_AHEAD: usize = 1024;

/// How long a relay that stops waits for the server to show its last confirmation.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The WAL relay session (WAL mode, `docs/wal.md`).
pub struct WalSession<'a> {
    cx: Context<'a, Postgres>,
    wal: &'a Wal,
    /// `None` while another relay holds the slot.
    client: Option<ReplicationClient>,
    /// Received and not yet acknowledged, in commit order.
    buffer: VecDeque<Entry>,
    next_seq: i64,
    /// Per received commit: the last `seq` at or before it, and its end LSN.
    commits: VecDeque<(i64, Lsn)>,
    /// Inside a transaction (between `Begin` and `Commit`).
    in_tx: bool,
    /// The open transaction holds outbox messages (not only other logical messages).
    tx_ours: bool,
    confirmed: Lsn,
    /// The end of the WAL as the server last reported it.
    wal_end: Lsn,
    /// Keys with unsent rows in the outbox table (dead letters, messages parked behind
    /// them, released ones): their messages go there, behind them, until none is left.
    parked: HashSet<String>,
    /// Table rows in the buffer.
    loaded: HashSet<i64>,
    /// The outbox table may hold rows that may go out now: read it at the next claim
    /// rather than at the next probe (a released key drains at the relay's pace).
    reload: bool,
    /// At most this many messages in memory: past it, the stream waits in the slot, and
    /// keys that wait for a retry are set aside into the outbox table.
    cap: usize,
    /// The same in payload and header bytes (`RelayConfig::wal_buffer_bytes`).
    cap_bytes: usize,
    /// The payload and header bytes of the buffer's messages.
    bytes: usize,
    /// The server process streaming the slot to this relay (`active_pid` once it took
    /// the slot): table writes check that it still holds the slot.
    walsender: Option<i32>,
}

impl std::fmt::Debug for WalSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalSession")
            .field("slot", &self.wal.slot)
            .field("buffered", &self.buffer.len())
            .field("buffered_bytes", &self.bytes)
            .field("walsender", &self.walsender)
            .finish_non_exhaustive()
    }
}

fn refused(e: PgWireError, wal: &Wal) -> SessionError {
    SessionError::Refused(format!("WAL relay: replication slot {:?}: {e}", wal.slot))
}

impl<'a> WalSession<'a> {
    pub(crate) async fn open(
        cx: Context<'a, Postgres>,
        wal: &'a Wal,
    ) -> SessionResult<WalSession<'a>> {
        use sqlx::postgres::PgSslMode;
        if matches!(
            cx.pool.connect_options().get_ssl_mode(),
            PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull
        ) {
            return Err(SessionError::Refused(
                "WAL relay: the connection asks for TLS (sslmode require/verify-*), and the \
                 replication connection does not speak TLS yet: use table mode, or reach \
                 PostgreSQL over a trusted network or a Unix socket with sslmode=prefer/disable"
                    .to_owned(),
            ));
        }
        check_slot(cx.pool, cx.tables, wal)
            .await
            .map_err(|e| SessionError::Refused(e.to_string()))?;
        let cap = (cx.config.batch_size.max(1) * 10).max(10_000);
        let cap_bytes = cx
            .config
            .wal_buffer_bytes
            .max(cx.config.max_batch_bytes.saturating_mul(2));
        Ok(WalSession {
            cx,
            wal,
            client: None,
            buffer: VecDeque::new(),
            next_seq: 1,
            commits: VecDeque::new(),
            in_tx: false,
            tx_ours: false,
            confirmed: Lsn(0),
            wal_end: Lsn(0),
            parked: HashSet::new(),
            loaded: HashSet::new(),
            reload: false,
            cap,
            cap_bytes,
            bytes: 0,
            walsender: None,
        })
    }

    fn config(&self) -> ReplicationConfig {
        let options = self.cx.pool.connect_options();
        let password = self
            .wal
            .password
            .as_ref()
            .map(|s| s.0.clone())
            .or_else(|| std::env::var("PGPASSWORD").ok())
            .unwrap_or_default();
        let host = match options.get_socket() {
            Some(dir) => dir.to_string_lossy().into_owned(),
            None => options.get_host().to_owned(),
        };
        ReplicationConfig::new(
            host,
            options.get_username(),
            password,
            options.get_database().unwrap_or(options.get_username()),
            &self.wal.slot,
            self.wal.publication.as_str(),
        )
        .with_port(options.get_port())
        .with_application_name(&self.cx.config.application_name)
        .with_options(format!(
            "-c wal_sender_timeout={}ms",
            SENDER_TIMEOUT.as_millis()
        ))
        .with_status_interval(Duration::from_millis(100))
        .with_buffer_size(READ_AHEAD)
    }

    /// Takes the slot if it is free: `Ok(false)` while another relay holds it.
    async fn start(&mut self) -> SessionResult<bool> {
        let mut client = ReplicationClient::connect(self.config())
            .await
            .map_err(|e| refused(e, self.wal))?;
        let timeout = self.cx.config.connect_timeout;
        match tokio::time::timeout(timeout, client.wait_started()).await {
            Err(_) => Err(SessionError::TimedOut(timeout)),
            Ok(Ok(())) => {
                self.client = Some(client);
                // The slot is ours now: its `active_pid` is the server process that
                // streams it to us, what every table write checks.
                self.cx.count_queries(1);
                self.walsender = sqlx::query_scalar(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                )
                .bind(&self.wal.slot)
                .fetch_optional(self.cx.pool)
                .await?
                .flatten();
                // A relay that lost the slot may be half-way through a table write it
                // began while it still held it: wait for it (its fence lock), so that
                // what it wrote is read below.
                let mut barrier = self.cx.pool.begin().await?;
                self.cx.count_queries(3);
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                    .bind(fence_key(self.wal))
                    .execute(&mut *barrier)
                    .await?;
                barrier.commit().await?;
                // Before the first message: which keys wait behind dead letters.
                self.load_table().await?;
                Ok(true)
            }
            // object_in_use: another relay streams from the slot.
            Ok(Err(PgWireError::Server(e))) if e.contains("SQLSTATE 55006") => Ok(false),
            Ok(Err(e)) => Err(refused(e, self.wal)),
        }
    }

    /// Takes in one event.
    fn take(&mut self, event: ReplicationEvent) -> SessionResult<()> {
        match event {
            ReplicationEvent::Begin { .. } => (self.in_tx, self.tx_ours) = (true, false),
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.in_tx = false;
                self.wal_end = self.wal_end.max(end_lsn);
                self.commits.push_back((self.next_seq - 1, end_lsn));
                self.confirm();
            }
            ReplicationEvent::Message {
                prefix, content, ..
            } if prefix == self.wal.prefix => {
                let record = decode(&content, self.next_seq).map_err(|e| {
                    // Never skipped: a message this relay cannot read stops it, and
                    // the slot keeps it for a relay that can.
                    SessionError::Refused(format!(
                        "WAL relay: a message of slot {:?} cannot be read: {e}",
                        self.wal.slot
                    ))
                })?;
                self.next_seq += 1;
                self.tx_ours = true;
                let to_table = record
                    .partition_key
                    .as_ref()
                    .is_some_and(|k| self.parked.contains(k));
                self.bytes += size_of_record(&record);
                self.buffer.push_back(Entry {
                    record,
                    sent: false,
                    due: None,
                    row: None,
                    to_table,
                    outage: false,
                });
            }
            // Everything decoded up to `wal_end` has been received: with nothing
            // unacknowledged, the slot may move on (WAL of other activity is freed).
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.wal_end = self.wal_end.max(wal_end);
                if !self.in_tx && self.commits.is_empty() && self.first_open().is_none() {
                    self.advance(wal_end);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes in what the stream holds now, without waiting, up to `limit` new messages.
    fn pull(&mut self, limit: usize) -> SessionResult<()> {
        use futures_util::FutureExt as _;
        let mut taken = 0;
        while taken < limit && !self.full() {
            let Some(client) = self.client.as_mut() else {
                return Ok(());
            };
            // Unconstrained: tokio's cooperative budget would make `recv` report
            // "pending" after 128 ready messages in one poll, and cap a batch at that.
            match tokio::task::unconstrained(client.recv()).now_or_never() {
                None => return Ok(()),
                Some(Ok(Some(event))) => {
                    taken += usize::from(matches!(event, ReplicationEvent::Message { .. }));
                    self.take(event)?;
                }
                Some(Ok(None)) => return Err(self.ended(None)),
                Some(Err(e)) => return Err(self.ended(Some(e))),
            }
        }
        Ok(())
    }

    /// The buffer holds its most messages or bytes: the stream waits in the slot.
    fn full(&self) -> bool {
        self.buffer.len() >= self.cap || self.bytes >= self.cap_bytes
    }

    fn ended(&mut self, e: Option<PgWireError>) -> SessionError {
        self.client = None;
        SessionError::Refused(match e {
            Some(e) => format!(
                "WAL relay: the replication stream of slot {:?} ended: {e}",
                self.wal.slot
            ),
            None => format!(
                "WAL relay: the replication stream of slot {:?} ended",
                self.wal.slot
            ),
        })
    }

    /// Drops the acknowledged head of the buffer and confirms the last commit before
    /// the first unacknowledged message.
    fn confirm(&mut self) {
        while self.buffer.front().is_some_and(|e| e.sent) {
            if let Some(e) = self.buffer.pop_front() {
                self.bytes = self.bytes.saturating_sub(size_of_record(&e.record));
            }
        }
        let first_open = self.first_open().unwrap_or(self.next_seq);
        let mut lsn = None;
        while let Some(&(last, end)) = self.commits.front() {
            if last >= first_open {
                break;
            }
            lsn = Some(end);
            self.commits.pop_front();
        }
        if let Some(lsn) = lsn {
            self.advance(lsn);
        }
    }

    /// The first message of the stream not yet acknowledged (or in the outbox table).
    /// Rows read from the table hold no position in the stream.
    fn first_open(&self) -> Option<i64> {
        self.buffer
            .iter()
            .find(|e| !e.sent && e.row.is_none())
            .map(|e| e.record.seq)
    }

    fn advance(&mut self, lsn: Lsn) {
        if lsn > self.confirmed {
            self.confirmed = lsn;
            if let Some(client) = &self.client {
                client.update_applied_lsn(lsn);
            }
        }
    }

    fn claimable(&self) -> bool {
        !self.select(0, 1, usize::MAX).is_empty()
    }

    /// The oldest claimable messages after `after`: not acknowledged, not waiting for a
    /// retry, and not behind a message of their key that waits for one.
    fn select(&self, after: i64, limit: usize, max_bytes: usize) -> Vec<OutboxRecord> {
        let now = Instant::now();
        let mut held: HashSet<&str> = HashSet::new();
        let mut batch = Vec::new();
        let mut bytes = 0;
        for e in &self.buffer {
            if e.sent || e.to_table {
                continue;
            }
            let key = e.record.partition_key.as_deref();
            if e.due.is_some_and(|d| d > now) {
                if let Some(k) = key {
                    held.insert(k);
                }
                continue;
            }
            if e.record.seq <= after || key.is_some_and(|k| held.contains(k)) {
                continue;
            }
            if batch.len() >= limit || (bytes >= max_bytes && !batch.is_empty()) {
                break;
            }
            bytes += e.record.payload.len();
            batch.push(e.record.clone());
            // A retry goes without the later messages of its key, as in table mode: if
            // it failed again while they were accepted, they would overtake it.
            if e.record.attempts > 0 {
                if let Some(k) = key {
                    held.insert(k);
                }
            }
        }
        batch
    }

    /// Writes `record` into the outbox table as a dead letter (or marks its row dead).
    async fn bury(
        &mut self,
        record: &OutboxRecord,
        row: Option<i64>,
        error: &str,
    ) -> SessionResult<()> {
        let t = self.cx.tables.outbox.quoted();
        let mut tx = self.fenced().await?;
        self.cx.count_queries(1);
        match row {
            Some(seq) => {
                sqlx::query(&format!(
                    "UPDATE {t} SET dead_at = now(), attempts = $2, last_error = $3 WHERE seq = $1"
                ))
                .bind(seq)
                .bind(record.attempts)
                .bind(error)
                .execute(&mut *tx)
                .await?;
            }
            None => insert_row(&mut tx, &t, record, Some(error), None).await?,
        }
        tx.commit().await?;
        if let Some(seq) = row {
            self.loaded.remove(&seq);
        }
        tracing::error!(
            id = %record.id,
            key = record.partition_key.as_deref(),
            error,
            "outbox WAL relay: message dead-lettered into the outbox table; the later messages \
             of its key wait there behind it (`outbox dead`, `release`, `discard`)"
        );
        Ok(())
    }

    /// Moves the messages of parked keys into the outbox table, in order (a message
    /// waiting for a retry keeps its attempts and its due time there).
    async fn park(&mut self) -> SessionResult<()> {
        let waiting: Vec<usize> = (0..self.buffer.len())
            .filter(|&i| self.buffer[i].to_table && !self.buffer[i].sent)
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        let t = self.cx.tables.outbox.quoted();
        let mut tx = self.fenced().await?;
        let records: Vec<(&OutboxRecord, Option<DateTime<Utc>>)> = waiting
            .iter()
            .map(|&i| (&self.buffer[i].record, wall(self.buffer[i].due)))
            .collect();
        let statements = insert_rows(&mut tx, &t, &records).await?;
        self.cx.count_queries(statements);
        tx.commit().await?;
        for i in waiting {
            self.buffer[i].sent = true;
        }
        Ok(())
    }

    /// Hands the unsent messages of `key` over to the outbox table: messages of the
    /// stream are written there (by [`park`](Self::park)), rows read from it are left
    /// there (the one waiting for a retry keeps its attempts and due time), and the key's
    /// later messages follow them until none is left.
    async fn shelve(&mut self, key: &str) -> SessionResult<()> {
        let mut kept = Vec::new();
        for i in 0..self.buffer.len() {
            let e = &self.buffer[i];
            if e.sent || e.record.partition_key.as_deref() != Some(key) {
                continue;
            }
            let (row, retry_at, attempts) = (e.row, wall(e.due), e.record.attempts);
            let Some(row) = row else {
                self.buffer[i].to_table = true;
                continue;
            };
            self.buffer[i].sent = true; // settled: it stays in the table
            if attempts > 0 {
                kept.push((row, attempts, retry_at));
            } else {
                self.loaded.remove(&row);
            }
        }
        self.keep_rows(kept).await?;
        self.parked.insert(key.to_owned());
        Ok(())
    }

    /// Leaves the table rows `rows` (read from the table, no longer in memory) there,
    /// each with the attempts and the due time it had in memory: `(seq, attempts,
    /// retry_at)`.
    async fn keep_rows(
        &mut self,
        rows: Vec<(i64, i32, Option<DateTime<Utc>>)>,
    ) -> SessionResult<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let t = self.cx.tables.outbox.quoted();
        let mut tx = self.fenced().await?;
        self.cx.count_queries(1);
        sqlx::query(&format!(
            "UPDATE {t} o SET attempts = u.attempts, next_attempt_at = u.retry_at \
             FROM UNNEST($1::int8[], $2::int4[], $3::timestamptz[]) AS u(seq, attempts, retry_at) \
             WHERE o.seq = u.seq"
        ))
        .bind(rows.iter().map(|r| r.0).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.1).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.2).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        for (row, _, _) in rows {
            self.loaded.remove(&row);
        }
        Ok(())
    }

    /// A transaction in which this relay may write the outbox table: it holds the slot's
    /// fence lock (see [`fence_key`]) and has checked that the slot is still streamed to
    /// this relay. A relay that lost the slot (frozen past `wal_sender_timeout`, the
    /// server ended its replication connection and a standby took over) writes nothing
    /// more: the standby may have published already what it was about to dead-letter or
    /// set aside, and a dead letter there would park a key behind a delivered message.
    async fn fenced(&mut self) -> SessionResult<sqlx::Transaction<'static, Postgres>> {
        let mut tx = self.cx.pool.begin().await?;
        self.cx.count_queries(4); // BEGIN, the lock, the check, COMMIT
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(fence_key(self.wal))
            .execute(&mut *tx)
            .await?;
        let holder: Option<i32> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&self.wal.slot)
                .fetch_optional(&mut *tx)
                .await?
                .flatten();
        if holder.is_some() && holder == self.walsender {
            return Ok(tx);
        }
        drop(tx); // rolled back
        let ours = self.walsender.take();
        self.client = None;
        tracing::warn!(
            slot = %self.wal.slot,
            walsender = ours,
            holder,
            "outbox WAL relay: this relay lost its replication slot (its server process \
             ended, likely after the relay stood still longer than wal_sender_timeout); it \
             writes nothing into the outbox table and starts over"
        );
        Err(SessionError::Refused(format!(
            "WAL relay: replication slot {:?} is no longer streamed to this relay (held by \
             server process {}); nothing was written, the relay starts over (as a standby \
             while another relay holds the slot)",
            self.wal.slot,
            holder.map_or_else(|| "none".to_owned(), |p| p.to_string())
        )))
    }

    /// With the buffer full and nothing to send, the keys that wait for a retry go into
    /// the outbox table: the stream moves on, the slot's position with it. Called only
    /// between drains, when nothing is in flight.
    async fn spill(&mut self) -> SessionResult<()> {
        let now = Instant::now();
        // Without a key, a waiting message holds nothing back: it goes alone (a row read
        // from the table stays there, with its attempts and due time).
        // A message that waits because the broker is unavailable stays: during an outage
        // the stream waits in the slot rather than pass through the table.
        let mut keyless = 0;
        let mut rows = Vec::new();
        for e in self.buffer.iter_mut() {
            if e.sent
                || e.to_table
                || e.outage
                || e.record.partition_key.is_some()
                || e.due.is_none_or(|d| d <= now)
            {
                continue;
            }
            keyless += 1;
            match e.row {
                None => e.to_table = true,
                Some(row) => {
                    e.sent = true;
                    rows.push((row, e.record.attempts, wall(e.due)));
                }
            }
        }
        self.keep_rows(rows).await?;
        let waiting: Vec<String> = self
            .buffer
            .iter()
            .filter(|e| !e.sent && !e.to_table && !e.outage && e.due.is_some_and(|d| d > now))
            .filter_map(|e| e.record.partition_key.clone())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if waiting.is_empty() && keyless == 0 {
            return Ok(());
        }
        tracing::warn!(
            keys = waiting.len(),
            keyless,
            buffered = self.buffer.len(),
            buffered_bytes = self.bytes,
            "outbox WAL relay: keys waiting for a retry are set aside into the outbox table \
             (the relay holds at most {} messages and {} bytes in memory)",
            self.cap,
            self.cap_bytes
        );
        for key in &waiting {
            self.shelve(key).await?;
        }
        self.park().await?;
        self.reload = true;
        self.confirm();
        Ok(())
    }

    /// Reads which keys have unsent rows in the outbox table, and takes into the buffer
    /// the rows that may go out (not dead, not behind a dead letter of their key).
    async fn load_table(&mut self) -> SessionResult<()> {
        let t = self.cx.tables.outbox.quoted();
        // With `SkipKey`, a dead letter holds nothing back: only the rows that will go
        // out keep their key in the table.
        let skip = self.cx.config.on_dead_letter == crate::config::OnDeadLetter::SkipKey;
        let (alive, behind_dead) = if skip {
            ("AND dead_at IS NULL", "")
        } else {
            (
                "",
                "AND NOT EXISTS (SELECT 1 FROM {t} d WHERE d.partition_key = o.partition_key \
                   AND d.seq < o.seq AND d.dead_at IS NOT NULL AND d.sent_at IS NULL)",
            )
        };
        self.cx.count_queries(2);
        let keys: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT DISTINCT partition_key FROM {t} \
             WHERE sent_at IS NULL AND partition_key IS NOT NULL {alive}"
        ))
        .fetch_all(self.cx.pool)
        .await?;
        let mut parked: HashSet<String> = keys.into_iter().collect();
        // Not written there yet, or still on their way out of it.
        for e in self
            .buffer
            .iter()
            .filter(|e| !e.sent && (e.to_table || e.row.is_some()))
        {
            parked.extend(e.record.partition_key.clone());
        }
        self.parked = parked;
        let sql = format!(
            "SELECT {columns}, \
                    (CASE WHEN o.next_attempt_at > now() + interval '1 day' THEN 86400 \
                          ELSE GREATEST(EXTRACT(EPOCH FROM o.next_attempt_at - now()), 0) END)::float8 AS wait \
             FROM {t} o \
             WHERE o.sent_at IS NULL AND o.dead_at IS NULL {behind_dead} \
             ORDER BY o.seq LIMIT $1",
            columns = crate::db::rows::claim_columns(|c| format!("{c}::text")),
            behind_dead = behind_dead.replace("{t}", &t),
        );
        let limit = self.cx.config.batch_size.max(1) * 4;
        let rows = sqlx::query(&sql)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.cx.pool)
            .await?;
        // A full page: there may be more to read once these are sent.
        self.reload = rows.len() >= limit;
        let now = Instant::now();
        for r in &rows {
            use sqlx::Row as _;
            let mut record = crate::db::rows::record(r)?;
            let wait: Option<f64> = r.try_get("wait")?;
            if !self.loaded.insert(record.seq) {
                continue;
            }
            let row = record.seq;
            record.seq = self.next_seq;
            self.next_seq += 1;
            self.bytes += size_of_record(&record);
            self.buffer.push_back(Entry {
                record,
                sent: false,
                // Capped at a day: an operator may well set `next_attempt_at` far ahead.
                due: wait
                    .filter(|w| *w > 0.0)
                    .map(|w| now + Duration::from_secs_f64(w.min(86_400.0))),
                row: Some(row),
                to_table: false,
                outage: false,
            });
        }
        Ok(())
    }

    fn entry(&mut self, seq: i64) -> Option<&mut Entry> {
        let first = self.buffer.front()?.record.seq;
        let i = usize::try_from(seq - first).ok()?;
        self.buffer.get_mut(i).filter(|e| e.record.seq == seq)
    }
}

impl Session for WalSession<'_> {
    async fn probe(&mut self) -> SessionResult<Option<Probe>> {
        if self.client.is_none() {
            return Ok(None);
        }
        self.load_table().await?;
        let now = Instant::now();
        let open: Vec<&Entry> = self.buffer.iter().filter(|e| !e.sent).collect();
        let oldest = open
            .iter()
            .map(|e| e.record.created_at)
            .min()
            .map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            });
        let next_due_in = open
            .iter()
            .filter_map(|e| e.due)
            .filter(|d| *d > now)
            .min()
            .map(|d| d - now);
        // As `outbox status` shows it per slot (the oldest age is the relay's
        // `outbox_oldest_pending_age_seconds`).
        metrics::gauge!("outbox_wal_unconfirmed_bytes")
            .set(self.wal_end.0.saturating_sub(self.confirmed.0) as f64);
        Ok(Some(Probe {
            pending: open.len() as i64,
            oldest_age_seconds: oldest,
            due: None,
            next_due_in,
        }))
    }

    fn probe_interval(&self) -> Duration {
        self.cx.config.poll_interval
    }

    async fn own(&mut self) -> SessionResult<bool> {
        match &self.client {
            Some(client) if client.is_running() => Ok(true),
            Some(_) => Err(self.ended(None)),
            None => self.start().await,
        }
    }

    async fn wait(
        &mut self,
        shutdown: &mut watch::Receiver<bool>,
        until: Instant,
    ) -> SessionResult<()> {
        if self.claimable() {
            return Ok(());
        }
        if self.full() {
            // Nothing in flight now (the drain is over): the waiting keys can move.
            let before = self.buffer.len();
            self.spill().await?;
            if self.buffer.len() < before {
                return Ok(());
            }
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = stopped(shutdown) => {}
            }
            return Ok(());
        }
        let Some(client) = self.client.as_mut() else {
            return Ok(());
        };
        let event = tokio::select! {
            event = client.recv() => event,
            () = tokio::time::sleep_until(until) => return Ok(()),
            () = stopped(shutdown) => return Ok(()),
        };
        match event {
            Ok(Some(event)) => self.take(event),
            Ok(None) => Err(self.ended(None)),
            Err(e) => Err(self.ended(Some(e))),
        }
    }

    async fn retrying_keys(&mut self) -> SessionResult<Vec<String>> {
        Ok(self
            .buffer
            .iter()
            .filter(|e| !e.sent && e.due.is_some())
            .filter_map(|e| e.record.partition_key.clone())
            .collect())
    }

    async fn claim(&mut self, after: Option<i64>) -> SessionResult<Vec<OutboxRecord>> {
        let config = self.cx.config;
        self.pull(config.batch_size.max(1) * 2)?;
        self.park().await?;
        if self.reload && self.loaded.is_empty() {
            self.load_table().await?;
        }
        Ok(self.select(
            after.unwrap_or(0),
            config.batch_size,
            config.max_batch_bytes,
        ))
    }

    async fn acknowledge(&mut self, outcome: &Outcome) -> SessionResult<()> {
        let mut rows = Vec::new();
        for &seq in &outcome.sent {
            if let Some(e) = self.entry(seq) {
                e.sent = true;
                rows.extend(e.row);
            }
        }
        if !rows.is_empty() {
            let t = self.cx.tables.outbox.quoted();
            let sql = match self.cx.config.on_sent {
                crate::config::OnSent::Mark => {
                    format!("UPDATE {t} SET sent_at = now() WHERE seq = ANY($1)")
                }
                crate::config::OnSent::Delete => format!("DELETE FROM {t} WHERE seq = ANY($1)"),
            };
            let mut tx = self.fenced().await?;
            self.cx.count_queries(1);
            sqlx::query(&sql).bind(&rows).execute(&mut *tx).await?;
            tx.commit().await?;
            for row in &rows {
                self.loaded.remove(row);
            }
            // Rows of the table went out: the ones behind them may follow now.
            self.reload = true;
        }
        self.confirm();
        Ok(())
    }

    /// Failures wait in memory and are published again after their backoff (a broker
    /// outage counts no attempt); the slot keeps them until then. A message out of
    /// attempts, or refused for good, becomes a dead letter in the outbox table, and the
    /// later messages of its key follow it there, parked behind it.
    async fn fail(&mut self, outcome: &Outcome) -> SessionResult<u64> {
        let now = Instant::now();
        let config = self.cx.config;
        let mut dead = 0;
        for (i, &seq) in outcome.failed_seq.iter().enumerate() {
            let unavailable = outcome.failed_unavailable[i];
            let Some(e) = self.entry(seq) else { continue };
            e.outage = unavailable;
            if unavailable {
                e.due = Some(now + outcome.unavailable_delay);
                continue;
            }
            let (is_dead, secs) =
                crate::config::retry_plan(config, e.record.attempts, outcome.failed_permanent[i]);
            e.record.attempts = e.record.attempts.saturating_add(1);
            if !is_dead {
                e.due = Some(now + Duration::from_secs_f64(secs));
                continue;
            }
            e.sent = true; // settled: the table has it now
            let record = e.record.clone();
            let row = e.row;
            let park_key = config.on_dead_letter == crate::config::OnDeadLetter::ParkKey;
            if let (true, Some(key)) = (park_key, record.partition_key.as_deref()) {
                // Earlier messages of its key still waiting (a retry failed in the same
                // batch) go into the table first, so they stay ahead of it there.
                let mut earlier = false;
                for l in self.buffer.iter_mut() {
                    if !l.sent
                        && l.row.is_none()
                        && l.record.seq < seq
                        && l.record.partition_key.as_deref() == Some(key)
                    {
                        l.to_table = true;
                        earlier = true;
                    }
                }
                if earlier {
                    self.park().await?;
                }
            }
            self.bury(&record, row, &outcome.failed_error[i]).await?;
            dead += 1;
            // The key's later messages wait behind it in the table, also rows read from
            // there (a released dead letter that died again); with `SkipKey` they go on.
            if let (true, Some(key)) = (park_key, &record.partition_key) {
                self.shelve(key).await?;
            }
        }
        self.park().await?;
        self.confirm();
        Ok(dead)
    }

    /// Lets the slot go once the server has taken in the last confirmation, so the next
    /// relay does not publish again what the broker acknowledged.
    ///
    /// Written is not read: the client ends the stream by closing its socket, with the
    /// server's data still unread, which resets the connection. A walsender busy sending
    /// (other transactions of the database) meets that reset before it reads the last
    /// status update, and the slot stays at the one before. So this waits until
    /// `pg_replication_slots` shows the position (it reads the slot's memory, updated as
    /// soon as the walsender reads the update).
    async fn close(mut self) {
        // Within the relay's own bound on `close` (`connect_timeout`), so that the client
        // is always shut down.
        let wait = CLOSE_WAIT.min(self.cx.config.connect_timeout.mul_f64(0.8));
        let deadline = Instant::now() + wait;
        // A message goes out as soon as it is read, and the relay may stop before it
        // reads the commit after it: with every message read acknowledged, the rest of
        // an open transaction of outbox messages is read, so that its commit is confirmed.
        while self.in_tx && self.tx_ours && self.first_open().is_none() {
            let Some(client) = self.client.as_mut() else {
                break;
            };
            let Ok(Ok(Some(event))) = tokio::time::timeout_at(deadline, client.recv()).await else {
                break;
            };
            if self.take(event).is_err() {
                break;
            }
        }
        let Some(mut client) = self.client.take() else {
            return;
        };
        let mut shown = self.confirmed.0 == 0;
        let mut failed = None;
        while !shown && client.is_running() && Instant::now() < deadline {
            self.cx.count_queries(1);
            let query = sqlx::query_scalar::<_, bool>(
                "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots \
                 WHERE slot_name = $1",
            )
            .bind(&self.wal.slot)
            .bind(self.confirmed.to_string())
            .fetch_optional(self.cx.pool);
            match tokio::time::timeout_at(deadline, query).await {
                Ok(Ok(row)) => shown = row.unwrap_or(false),
                Ok(Err(e)) => {
                    failed = Some(e.to_string());
                    break;
                }
                Err(_) => break,
            }
            if !shown {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        if !shown {
            tracing::warn!(
                slot = %self.wal.slot,
                confirmed = %self.confirmed,
                ?wait,
                error = failed.as_deref(),
                "outbox WAL relay: could not see the server take in the last confirmed \
                 position before the relay let the slot go; the next relay may publish again \
                 what came after the position the slot shows (duplicates, which consumers \
                 drop by message id)"
            );
        }
        let _ = client.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_envelope_round_trips_with_its_payload_verbatim() {
        let m = OutboxMessage::new("OrderPlaced", "orders", r#"{"z":1, "a":[true]}"#)
            .with_key("order-1")
            .with_header("traceparent", "00-1-2-01");
        let at = Utc::now();
        let text = envelope(&m, at).expect("envelope");
        assert!(text.starts_with(r#"{"v":1,"#), "{text}");
        let r = decode(text.as_bytes(), 7).expect("decode");
        assert_eq!(r.seq, 7);
        assert_eq!(r.id, m.id);
        assert_eq!(r.payload, r#"{"z":1, "a":[true]}"#);
        assert_eq!(r.partition_key.as_deref(), Some("order-1"));
        assert_eq!(r.headers, m.headers);
        assert_eq!(r.created_at, at);
        let future = text.replacen(r#""v":1"#, r#""v":2"#, 1);
        let err = decode(future.as_bytes(), 1).expect_err("unknown version");
        assert!(err.contains("upgrade the relay"), "{err}");
        let bad = OutboxMessage::new("T", "d", "not json");
        assert!(envelope(&bad, at).is_err());
    }

    #[test]
    fn the_password_comes_from_the_url_decoded() {
        assert_eq!(
            url_password("postgres://app:s%40cr%2Ft@db:5432/x?sslmode=disable").as_deref(),
            Some("s@cr/t")
        );
        assert_eq!(url_password("postgres://app@db/x"), None);
        assert_eq!(url_password("postgres://db/x"), None);
        // Not an escape before a multi-byte character, nor at the end: kept, no panic.
        assert_eq!(
            url_password("postgres://app:%é%4@db/x").as_deref(),
            Some("%é%4")
        );
        assert_eq!(
            url_password("postgres://app:%C3%A9@db/x").as_deref(),
            Some("é")
        );
        assert_eq!(
            url_password("postgres://app@db/x?sslmode=disable&password=p%26q").as_deref(),
            Some("p&q")
        );
    }

    #[test]
    fn slot_names_are_checked_and_passwords_never_shown() {
        let table = crate::config::TableName::parse("t", "billing.Outbox").expect("name");
        let mut wal = Wal::new(&table, None).expect("default");
        assert_eq!(wal.slot, "outbox_billing_outbox");
        assert_eq!(wal.prefix, "outbox:outbox_billing_outbox");
        let err = Wal::new(&table, Some("Bad-Name")).expect_err("refused");
        assert!(err.to_string().contains("a-z, 0-9 and _"), "{err}");
        wal.password = Some(Secret("hunter2".into()));
        assert!(!format!("{wal:?}").contains("hunter2"));
    }
}
