//! The replication slot and its publication: created by `migrate` (the relay only
//! checks), its status, and its drop ([`Slot`](crate::postgres::Slot)).

use super::*;

use crate::store::trusted_sql;

/// The replication slot of an outbox in WAL mode; see [`Status::slot`](crate::admin::Status::slot) and [`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SlotStatus {
    /// The slot's name.
    pub name: String,
    /// The slot exists. A missing slot means the relay cannot start (`migrate` creates
    /// it; see "A lost or invalidated slot" in [`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md) if it existed before).
    pub exists: bool,
    /// The server process of the relay streaming from it; `None` when no relay is.
    pub active_pid: Option<i32>,
    /// `pg_replication_slots.wal_status`: `reserved`, `extended`, `unreserved`, or `lost`
    /// (invalidated: the relay refuses to read it).
    pub wal_status: Option<String>,
    /// WAL written since the relay's last confirmation (bytes): what the relay has not
    /// yet confirmed as published, plus other activity it has not read past yet.
    pub unconfirmed_bytes: Option<i64>,
    /// WAL the slot keeps on disk (bytes from its `restart_lsn`); bounded by
    /// `max_slot_wal_keep_size`.
    pub retained_bytes: Option<i64>,
    /// How long ago the oldest commit not yet confirmed was written: from the
    /// stream's first commit when no relay runs, from the server's flush lag of the
    /// relay's connection when one does. `None` when there is none (or it is unknown).
    pub oldest_unconfirmed_age_seconds: Option<f64>,
}

/// Creates the publication and the slot if they do not exist, after checking
/// `wal_level`. The slot must exist before the first event is written: a slot sees only
/// what is written after it was created.
pub(crate) async fn ensure_slot(pool: &sqlx::PgPool, tables: &Tables, wal: &Wal) -> Result<()> {
    let mut conn = logical_conn(pool, tables, "creating the replication slot").await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(&wal.publication)
            .fetch_one(&mut *conn)
            .await
            .context("creating the publication", &tables.outbox)?;
    if !exists {
        // A publication of no table: pgoutput needs one, the relay reads only messages.
        let created = conn
            .execute(trusted_sql(format!(
                "CREATE PUBLICATION \"{}\"",
                wal.publication
            )))
            .await;
        if let Err(e) = created
            && !is_duplicate(&e)
        {
            return Err(e).context("creating the publication", &tables.outbox);
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
            if let Err(e) = created
                && !is_duplicate(&e)
            {
                return Err(e).context("creating the replication slot", &tables.outbox);
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
#[cfg(feature = "wal")]
pub(crate) async fn check_slot(pool: &sqlx::PgPool, tables: &Tables, wal: &Wal) -> Result<()> {
    let mut conn = logical_conn(pool, tables, "checking the replication slot").await?;
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
pub(super) async fn first_commit_age(pool: &sqlx::PgPool, wal: &Wal) -> sqlx::Result<Option<f64>> {
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
            tracing::debug!(error = %crate::ErrorChain(&e), "outbox status: cannot peek at the replication slot");
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

/// The replication slot of an outbox in WAL mode ([`docs/wal.md`](https://github.com/outbox-rs/outbox/blob/main/docs/wal.md)): what it holds, and its
/// drop when the outbox is retired.
#[derive(Debug)]
#[non_exhaustive]
pub struct Slot;

impl Slot {
    /// The slot's state (also in `Admin::status`, field `slot`). Refused for an outbox
    /// in table mode.
    pub async fn status(outbox: &crate::Outbox<Postgres>) -> Result<SlotStatus> {
        let wal = wal_of(outbox)?;
        slot_status(outbox.pool(), wal)
            .await
            .context("reading the replication slot", &outbox.tables().outbox)
    }

    /// Drops the outbox's replication slot and its publication (WAL mode), for an
    /// outbox you retire: a slot nobody reads keeps WAL on the server forever. The
    /// events the slot still holds (see [`SlotStatus::unconfirmed_bytes`]) are lost
    /// with it. Refused while a relay streams from it. Returns the slot's state just
    /// before it was dropped.
    pub async fn drop(outbox: &crate::Outbox<Postgres>) -> Result<SlotStatus> {
        let tables = outbox.tables();
        let wal = wal_of(outbox)?;
        let pool = outbox.pool();
        let status = Slot::status(outbox).await?;
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
        pool.execute(trusted_sql(format!(
            "DROP PUBLICATION IF EXISTS \"{}\"",
            wal.publication
        )))
        .await
        .context("dropping the publication", &tables.outbox)?;
        tracing::warn!(slot = %wal.slot, "outbox: replication slot dropped");
        Ok(status)
    }
}

/// The outbox's WAL names, or the error for an outbox in table mode.
pub(super) fn wal_of(outbox: &crate::Outbox<Postgres>) -> Result<&Wal> {
    outbox.options().wal.as_ref().ok_or_else(|| {
        Error::InvalidArgument(
            "this outbox is not in WAL mode: it has no replication slot \
             (build it with OutboxBuilder::wal, or pass --wal-slot to the CLI)"
                .into(),
        )
    })
}

pub(super) fn is_duplicate(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "42710" || c == "23505")
}

/// A connection of `pool`, once the server is known to have `wal_level = logical`.
async fn logical_conn(
    pool: &sqlx::PgPool,
    tables: &Tables,
    context: &'static str,
) -> Result<sqlx::pool::PoolConnection<Postgres>> {
    let mut conn = pool.acquire().await.context(context, &tables.outbox)?;
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
    Ok(conn)
}
