//! The time-partitioned outbox (opt-in; [docs/partitions.md](https://github.com/outbox-rs/outbox/blob/main/docs/partitions.md)).
//!
//! The table is range-partitioned by its message id, a UUIDv7: its first 48 bits are the
//! emit time in milliseconds, so id ranges are time ranges, and `UNIQUE (id)` stays
//! global (a unique constraint must contain the partition key; with `created_at` as the
//! key, ids would only be unique per partition, and a consumer would skip a distinct
//! message that reused an id). One partition per hour or day (`{outbox}_p2026120213`,
//! `{outbox}_p20261202`), created ahead, and a default partition (`{outbox}_default`)
//! for ids outside every range (ids that are not UUIDv7, or from a time with no
//! partition), so that a write never fails for want of a partition.
//!
//! Retention drops a partition whose whole range is older than the cutoff and which
//! holds no pending or dead-lettered row (`DROP TABLE` under a short `lock_timeout`: it
//! needs the parent's `ACCESS EXCLUSIVE` lock for a moment). A partition that still holds
//! such a row is kept, and its sent rows are deleted row by row, as on a plain table,
//! until it can go.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sqlx::{Acquire, Executor, PgConnection, PgPool, Postgres, Row};

use super::locks;
use crate::config::{TableName, Tables};
use crate::error::DbContext;
use crate::store::trusted_sql;
use crate::{Error, Outbox, Result};

/// How much time one partition of a time-partitioned outbox covers (PostgreSQL,
/// `Outbox::partition_by_time`; [docs/partitions.md](https://github.com/outbox-rs/outbox/blob/main/docs/partitions.md)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartitionInterval {
    /// One partition per hour (UTC), 6 created ahead.
    Hourly,
    /// One partition per day (UTC), 3 created ahead.
    Daily,
}

impl PartitionInterval {
    /// The time one partition covers.
    pub fn length(self) -> Duration {
        match self {
            PartitionInterval::Hourly => Duration::from_secs(3600),
            PartitionInterval::Daily => Duration::from_secs(24 * 3600),
        }
    }
}

/// What [`Outbox::partition_by_time`](crate::Outbox) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partitioned {
    /// Rows copied from the plain table (0 when the table was already partitioned).
    pub rows_copied: u64,
    /// The partitions created (the default partition aside).
    pub partitions: Vec<String>,
    /// Relay sessions disconnected so that they register on the new table.
    pub relays_disconnected: u64,
}

/// What retention did to the partitions of a time-partitioned outbox.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionReport {
    /// Partitions created ahead.
    pub created: Vec<String>,
    /// Rows moved from the default partition into a partition created for them.
    pub moved_from_default: u64,
    /// Partitions dropped: wholly older than the cutoff, with no pending or dead row.
    pub dropped: Vec<String>,
    /// Partitions older than the cutoff kept for their pending or dead-lettered rows
    /// (their sent rows are deleted row by row).
    pub kept: Vec<String>,
    /// Partitions left for the next run: their lock was not free within 2 s.
    pub busy: Vec<String>,
}

/// Partitions created ahead of now, per interval.
fn ahead(interval: PartitionInterval) -> i64 {
    match interval {
        PartitionInterval::Hourly => 6,
        PartitionInterval::Daily => 3,
    }
}

/// The most partitions a conversion creates for the history (older rows go to the
/// default partition, and are deleted row by row).
const MOST_FOR_HISTORY: i64 = 400;

/// How long retention waits for the lock that adds or drops a partition before it
/// leaves that partition for its next run (writers and the relay queue behind a waiting
/// `ACCESS EXCLUSIVE` request, so the wait must stay short).
const LOCK_TIMEOUT: &str = "2s";

/// The lowest UUID of millisecond `ms`: a partition bound.
fn bound(ms: i64) -> String {
    let ms = u64::try_from(ms.max(0)).unwrap_or(0);
    format!(
        "{:08x}-{:04x}-0000-0000-000000000000",
        ms >> 16,
        ms & 0xffff
    )
}

/// The millisecond a bound (or a UUIDv7) stands for.
fn millis_of(uuid: &str) -> Option<i64> {
    let hex: String = uuid.chars().filter(|c| *c != '-').take(12).collect();
    i64::from_str_radix(&hex, 16).ok()
}

fn step(interval: PartitionInterval) -> i64 {
    i64::try_from(interval.length().as_millis()).unwrap_or(i64::MAX)
}

fn floor(ms: i64, step: i64) -> i64 {
    ms - ms.rem_euclid(step)
}

/// A partition's table: `{outbox}_p` and its start, in UTC.
fn partition_name(outbox: &TableName, start_ms: i64, interval: PartitionInterval) -> TableName {
    let start = Utc
        .timestamp_millis_opt(start_ms)
        .single()
        .unwrap_or_default();
    let stamp = match interval {
        PartitionInterval::Hourly => start.format("%Y%m%d%H"),
        PartitionInterval::Daily => start.format("%Y%m%d"),
    };
    outbox.with_suffix(&format!("_p{stamp}"))
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// One partition of the outbox: its table and id range (as milliseconds).
#[derive(Debug, Clone)]
struct Part {
    table: TableName,
    start: i64,
    end: i64,
}

/// The partitions of a partitioned outbox.
#[derive(Debug)]
struct Layout {
    parts: Vec<Part>,
    default: Option<TableName>,
    interval: PartitionInterval,
}

/// The outbox's partitions, or `None` when its table is not partitioned.
async fn layout(conn: &mut PgConnection, outbox: &TableName) -> sqlx::Result<Option<Layout>> {
    let key: Option<String> = sqlx::query_scalar(
        "SELECT pg_get_partkeydef(partrelid) FROM pg_partitioned_table WHERE partrelid = $1::regclass",
    )
    .bind(outbox.quoted())
    .fetch_optional(&mut *conn)
    .await?;
    // Not partitioned, or partitioned some other way (by hand): a plain table to
    // retention; the conversion refuses it (`partitioned`).
    if key.as_deref() != Some("RANGE (id)") {
        return Ok(None);
    }
    let rows = sqlx::query(
        "SELECT c.relname::text AS name, pg_get_expr(c.relpartbound, c.oid) AS bound \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = $1::regclass",
    )
    .bind(outbox.quoted())
    .fetch_all(&mut *conn)
    .await?;
    let mut parts = Vec::new();
    let mut default = None;
    for row in rows {
        let name: String = row.try_get("name")?;
        let text: String = row.try_get("bound")?;
        let table = outbox.sibling(&name);
        if text.trim() == "DEFAULT" {
            default = Some(table);
            continue;
        }
        // FOR VALUES FROM ('…') TO ('…')
        let quoted: Vec<&str> = text.split('\'').collect();
        if let (Some(from), Some(to)) = (quoted.get(1), quoted.get(3))
            && let (Some(start), Some(end)) = (millis_of(from), millis_of(to))
        {
            parts.push(Part { table, start, end });
        }
    }
    parts.sort_by_key(|p| p.start);
    let hourly = step(PartitionInterval::Hourly);
    let interval = match parts.last() {
        Some(p) if p.end - p.start <= hourly => PartitionInterval::Hourly,
        _ => PartitionInterval::Daily,
    };
    Ok(Some(Layout {
        parts,
        default,
        interval,
    }))
}

impl Outbox<Postgres> {
    /// Converts the outbox table to the time-partitioned layout ([docs/partitions.md](https://github.com/outbox-rs/outbox/blob/main/docs/partitions.md)), or
    /// does nothing if it already is partitioned by `interval`.
    ///
    /// In one transaction, holding the table's `ACCESS EXCLUSIVE` lock (writers and
    /// relays wait): every row is copied into the new table, partitions cover the
    /// history (at most 400 of them; older rows go to the default partition) and
    /// `interval`s ahead, and the old table is dropped. Relays of this outbox are
    /// disconnected, so that they register again on the new table. Grants on the old
    /// table are not carried over. Run it on a copy first, and at a quiet time: it takes
    /// as long as copying the table.
    ///
    /// # Errors
    /// A WAL-mode outbox; a table partitioned another way; database errors.
    pub async fn partition_by_time(&self, interval: PartitionInterval) -> Result<Partitioned> {
        let tables = self.tables();
        if self.options().wal.is_some() {
            return Err(Error::InvalidArgument(
                format!(
                    "{} is a WAL-mode outbox: its table holds only dead letters and set-aside \
                     keys, so there is nothing to partition",
                    tables.outbox
                )
                .into(),
            ));
        }
        let doing = "partitioning the outbox table";
        // The conversion creates the latest migrations' indexes: the migrations must be
        // applied first, or a later `migrate` would create them again and fail.
        self.migrate().await?;
        let mut conn = self.pool().acquire().await.context(doing, &tables.outbox)?;
        // Already partitioned: nothing to lock (checked again under the lock).
        if let Some(layout) = layout(&mut conn, &tables.outbox)
            .await
            .context(doing, &tables.outbox)?
            && layout.interval == interval
        {
            return Ok(Partitioned::default());
        }
        let mut tx = conn.begin().await.context(doing, &tables.outbox)?;
        let done = convert(&mut tx, tables, interval).await;
        match done {
            Ok(Some(done)) => {
                tx.commit().await.context(doing, &tables.outbox)?;
                tracing::info!(outbox = %tables.outbox, rows = done.rows_copied, partitions = done.partitions.len(), "outbox table partitioned by time");
                Ok(done)
            }
            Ok(None) => Ok(Partitioned::default()),
            Err(e) => Err(e),
        }
    }
}

/// The conversion, inside `tx`; `None` when the table is already partitioned by
/// `interval`.
async fn convert(
    tx: &mut PgConnection,
    tables: &Tables,
    interval: PartitionInterval,
) -> Result<Option<Partitioned>> {
    let outbox = &tables.outbox;
    let t = outbox.quoted();
    let doing = "partitioning the outbox table";
    tx.execute("SET LOCAL lock_timeout = '10s'")
        .await
        .context(doing, outbox)?;
    tx.execute(trusted_sql(format!(
        "LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE"
    )))
    .await
    .context(doing, outbox)?;
    let foreign: Option<String> = sqlx::query_scalar(
        "SELECT pg_get_partkeydef(partrelid) FROM pg_partitioned_table WHERE partrelid = $1::regclass",
    )
    .bind(&t)
    .fetch_optional(&mut *tx)
    .await
    .context(doing, outbox)?;
    if let Some(key) = foreign.filter(|k| k != "RANGE (id)") {
        return Err(Error::InvalidArgument(
            format!(
                "{outbox} is already partitioned by {key}, not by the outbox's layout \
                 (RANGE (id), docs/partitions.md); it is left as it is"
            )
            .into(),
        ));
    }
    if let Some(layout) = layout(tx, outbox).await.context(doing, outbox)? {
        if layout.interval == interval {
            return Ok(None);
        }
        return Err(Error::InvalidArgument(
            format!(
                "{outbox} is already partitioned {}; changing the interval of a partitioned \
                 outbox is not supported",
                layout.interval
            )
            .into(),
        ));
    }
    let old_oid: i32 = sqlx::query_scalar("SELECT $1::regclass::oid::int4")
        .bind(&t)
        .fetch_one(&mut *tx)
        .await
        .context(doing, outbox)?;
    // Relays key their advisory locks by the table's oid, which changes: they must
    // register again (they wait for this transaction, then find the new table).
    let relays: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT DISTINCT pid FROM pg_locks \
           WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = ($1)::int4::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND ((objid >= $2 AND objid < $2 + $3) OR objid = $4) AND pid <> pg_backend_pid()) r \
         WHERE pg_terminate_backend(r.pid)",
    )
    .bind(old_oid)
    .bind(i64::from(locks::RELAYS))
    .bind(i64::from(locks::MAX_RELAYS))
    .bind(i64::from(locks::IDLE))
    .fetch_one(&mut *tx)
    .await
    .context(doing, outbox)?;
    let next_seq: i64 = sqlx::query_scalar(trusted_sql(format!(
        "SELECT greatest(CASE WHEN is_called THEN last_value + 1 ELSE last_value END, \
                         (SELECT coalesce(max(seq), 0) + 1 FROM {t})) \
         FROM {}",
        sequence_of(tx, &t).await.context(doing, outbox)?
    )))
    .fetch_one(&mut *tx)
    .await
    .context(doing, outbox)?;

    // The old table's constraints, then its indexes (those left: a key's index went with
    // it), go first: the new ones take their names.
    let drops = [
        (
            format!("ALTER TABLE {t} DROP CONSTRAINT"),
            "SELECT quote_ident(conname) FROM pg_constraint \
             WHERE conrelid = $1::int4::oid AND contype IN ('p', 'u')",
        ),
        (
            "DROP INDEX".to_owned(),
            "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = $1::int4::oid",
        ),
    ];
    for (drop, names) in drops {
        let names: Vec<String> = sqlx::query_scalar(trusted_sql(names))
            .bind(old_oid)
            .fetch_all(&mut *tx)
            .await
            .context(doing, outbox)?;
        for name in names {
            tx.execute(trusted_sql(format!("{drop} {name}")))
                .await
                .context(doing, outbox)?;
        }
    }
    let old = outbox.with_suffix("_unpartitioned");
    tx.execute(trusted_sql(format!(
        "ALTER TABLE {t} RENAME TO {}",
        quote_ident(old.name())
    )))
    .await
    .context(doing, outbox)?;
    let old = old.quoted();
    let seq = outbox.with_suffix("_seq").quoted();
    let name = |suffix: &str| quote_ident(&format!("{}{suffix}", outbox.name()));
    let ddl = format!(
        "CREATE SEQUENCE {seq} START WITH {next_seq} CACHE 1; \
         CREATE TABLE {t} (LIKE {old} INCLUDING DEFAULTS) PARTITION BY RANGE (id); \
         ALTER TABLE {t} ALTER COLUMN seq SET DEFAULT nextval('{seq_text}'::regclass); \
         ALTER SEQUENCE {seq} OWNED BY {t}.seq; \
         ALTER TABLE {t} ADD CONSTRAINT {id_key} PRIMARY KEY (id); \
         CREATE INDEX {seq_idx} ON {t} (seq); \
         CREATE INDEX {pending} ON {t} (seq) WHERE sent_at IS NULL AND dead_at IS NULL; \
         CREATE INDEX {retrying} ON {t} (partition_key, seq) \
           WHERE sent_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL; \
         CREATE INDEX {dead} ON {t} (seq) WHERE dead_at IS NOT NULL; \
         CREATE INDEX {dead_key} ON {t} (partition_key, seq) WHERE dead_at IS NOT NULL",
        seq_text = seq.replace('\'', "''"),
        id_key = name("_pkey"),
        seq_idx = name("_seq_idx"),
        pending = name("_pending_idx"),
        retrying = name("_retrying_idx"),
        dead = name("_dead_idx"),
        dead_key = name("_dead_key_idx"),
    );
    tx.execute(trusted_sql(ddl.as_str()))
        .await
        .context(doing, outbox)?;

    // Partitions from the oldest UUIDv7 row (at most MOST_FOR_HISTORY back) to `ahead`.
    let step = step(interval);
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .context(doing, outbox)?;
    let now = floor(now.timestamp_millis(), step);
    let oldest: Option<String> = sqlx::query_scalar(trusted_sql(format!(
        "SELECT min(id::text COLLATE \"C\") FROM {old} WHERE substr(id::text, 15, 1) = '7'"
    )))
    .fetch_one(&mut *tx)
    .await
    .context(doing, outbox)?;
    let first = oldest
        .as_deref()
        .and_then(millis_of)
        .map_or(now, |ms| floor(ms, step))
        .clamp(now - MOST_FOR_HISTORY * step, now);
    let mut partitions = Vec::new();
    let mut start = first;
    while start <= now + ahead(interval) * step {
        let part = partition_name(outbox, start, interval);
        tx.execute(trusted_sql(format!(
            "CREATE TABLE {} PARTITION OF {t} FOR VALUES FROM ('{}') TO ('{}')",
            part.quoted(),
            bound(start),
            bound(start + step)
        )))
        .await
        .context(doing, outbox)?;
        partitions.push(part.to_string());
        start += step;
    }
    tx.execute(trusted_sql(format!(
        "CREATE TABLE {} PARTITION OF {t} DEFAULT",
        outbox.with_suffix("_default").quoted()
    )))
    .await
    .context(doing, outbox)?;
    let copied = tx
        .execute(trusted_sql(format!("INSERT INTO {t} SELECT * FROM {old}")))
        .await
        .context(doing, outbox)?
        .rows_affected();
    tx.execute(trusted_sql(format!("DROP TABLE {old}")))
        .await
        .context(doing, outbox)?;
    Ok(Some(Partitioned {
        rows_copied: copied,
        partitions,
        relays_disconnected: u64::try_from(relays).unwrap_or(0),
    }))
}

/// The outbox's `seq` sequence, quoted.
async fn sequence_of(conn: &mut PgConnection, table: &str) -> sqlx::Result<String> {
    let name: Option<String> = sqlx::query_scalar("SELECT pg_get_serial_sequence($1, 'seq')")
        .bind(table)
        .fetch_one(&mut *conn)
        .await?;
    name.ok_or_else(|| sqlx::Error::Protocol("the outbox table has no `seq` sequence".into()))
}

/// Retention's part on a partitioned outbox: partitions ahead, and old ones dropped.
/// `None` when the table is not partitioned.
pub(super) async fn maintain(
    pool: &PgPool,
    tables: &Tables,
    cutoff: Option<DateTime<Utc>>,
) -> sqlx::Result<Option<PartitionReport>> {
    let outbox = &tables.outbox;
    let mut conn = pool.acquire().await?;
    let Some(layout) = layout(&mut conn, outbox).await? else {
        return Ok(None);
    };
    let mut report = PartitionReport::default();
    let step = step(layout.interval);
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *conn)
        .await?;
    let now = floor(now.timestamp_millis(), step);
    let t = outbox.quoted();

    // Ahead: every interval from now's (or from the newest partition's end, if
    // retention has not run for a while, at most MOST_FOR_HISTORY back) to `ahead`,
    // wherever one is missing.
    let mut start = layout
        .parts
        .last()
        .map_or(now, |p| p.end.min(now))
        .max(now - MOST_FOR_HISTORY * step);
    let have: std::collections::HashSet<i64> = layout.parts.iter().map(|p| p.start).collect();
    while start <= now + ahead(layout.interval) * step {
        if !have.contains(&start) {
            let part = partition_name(outbox, start, layout.interval);
            match add_partition(&mut conn, &t, &part, layout.default.as_ref(), start, step).await {
                Ok(moved) => {
                    report.moved_from_default += moved;
                    report.created.push(part.to_string());
                }
                Err(e) if lock_timeout(&e) => report.busy.push(part.to_string()),
                Err(e) => return Err(e),
            }
        }
        start += step;
    }

    // Old: a partition whose whole range is before the cutoff, with no pending or dead
    // row, is dropped.
    let Some(cutoff) = cutoff else {
        return Ok(Some(report));
    };
    let cutoff = cutoff.timestamp_millis();
    let mut old = layout.parts.iter().filter(|p| p.end <= cutoff);
    for part in old.by_ref() {
        match drop_partition(&mut conn, &t, part).await {
            Ok(true) => report.dropped.push(part.table.to_string()),
            Ok(false) => report.kept.push(part.table.to_string()),
            Err(e) if lock_timeout(&e) => {
                // Writers queue behind each wait: one per run is enough.
                report.busy.push(part.table.to_string());
                break;
            }
            Err(e) => return Err(e),
        }
    }
    report.busy.extend(old.map(|p| p.table.to_string()));
    Ok(Some(report))
}

fn lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

/// Adds the partition `part` for `[start, start + step)`: rows of that range in the
/// default partition move into it. Returns how many moved.
async fn add_partition(
    conn: &mut PgConnection,
    parent: &str,
    part: &TableName,
    default: Option<&TableName>,
    start: i64,
    step: i64,
) -> sqlx::Result<u64> {
    let mut tx = conn.begin().await?;
    tx.execute(trusted_sql(format!(
        "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"
    )))
    .await?;
    let p = part.quoted();
    let (from, to) = (bound(start), bound(start + step));
    tx.execute(trusted_sql(format!(
        "CREATE TABLE {p} (LIKE {parent} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
    )))
    .await?;
    let mut moved = 0;
    if let Some(default) = default {
        moved = tx
            .execute(trusted_sql(format!(
                "WITH moved AS (DELETE FROM {d} WHERE id >= '{from}' AND id < '{to}' RETURNING *) \
                 INSERT INTO {p} SELECT * FROM moved",
                d = default.quoted()
            )))
            .await?
            .rows_affected();
    }
    tx.execute(trusted_sql(format!(
        "ALTER TABLE {parent} ATTACH PARTITION {p} FOR VALUES FROM ('{from}') TO ('{to}')"
    )))
    .await?;
    tx.commit().await?;
    Ok(moved)
}

/// Drops `part` if it holds no pending and no dead-lettered row (checked again under the
/// parent's lock, so that no replay or release can slip in between); `false` if kept.
async fn drop_partition(conn: &mut PgConnection, parent: &str, part: &Part) -> sqlx::Result<bool> {
    let p = part.table.quoted();
    // Each condition matches a partial index: no scan of the history.
    let busy = format!(
        "SELECT EXISTS (SELECT 1 FROM {p} WHERE sent_at IS NULL AND dead_at IS NULL) \
             OR EXISTS (SELECT 1 FROM {p} WHERE dead_at IS NOT NULL)"
    );
    let held: bool = sqlx::query_scalar(trusted_sql(&busy))
        .fetch_one(&mut *conn)
        .await?;
    if held {
        return Ok(false);
    }
    let mut tx = conn.begin().await?;
    tx.execute(trusted_sql(format!(
        "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"
    )))
    .await?;
    // The parent and this partition only (not every partition, each a wait of its own).
    tx.execute(trusted_sql(format!(
        "LOCK TABLE ONLY {parent}, {p} IN ACCESS EXCLUSIVE MODE"
    )))
    .await?;
    let held: bool = sqlx::query_scalar(trusted_sql(&busy))
        .fetch_one(&mut *tx)
        .await?;
    if held {
        return Ok(false);
    }
    tx.execute(trusted_sql(format!("DROP TABLE {p}"))).await?;
    tx.commit().await?;
    Ok(true)
}

/// For retention's row-by-row deletes on a partitioned outbox: the id range to leave
/// alone, `[from, to)`, which is every partition not wholly before `cutoff` (those go
/// whole, when their time comes). `None` when the table is not partitioned.
pub(super) async fn spared(
    pool: &PgPool,
    outbox: &TableName,
    cutoff: DateTime<Utc>,
) -> sqlx::Result<Option<(String, String)>> {
    let mut conn = pool.acquire().await?;
    let Some(layout) = layout(&mut conn, outbox).await? else {
        return Ok(None);
    };
    let cutoff = cutoff.timestamp_millis();
    let from = layout
        .parts
        .iter()
        .find(|p| p.end > cutoff)
        .map_or(i64::MAX >> 16, |p| p.start);
    let to = layout.parts.last().map_or(from, |p| p.end).max(from);
    Ok(Some((bound(from), bound(to))))
}

/// How long one interval is, for messages.
impl std::fmt::Display for PartitionInterval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PartitionInterval::Hourly => "by the hour",
            PartitionInterval::Daily => "by the day",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_is_the_lowest_uuid_of_its_millisecond() {
        let ms = 1_764_633_600_000; // 2025-12-02T00:00:00Z
        let b = bound(ms);
        assert_eq!(millis_of(&b), Some(ms));
        // A UUIDv7 of that millisecond sorts at or above it, one of the one before below.
        let v7 = uuid::Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            1_764_633_600,
            0,
        ));
        assert!(v7.to_string() >= b);
        assert!(v7.to_string() < bound(ms + 1));
        assert_eq!(millis_of(&v7.to_string()), Some(ms));
    }

    #[test]
    fn partitions_are_named_by_their_start_in_utc() {
        let outbox = TableName::parse("t", "billing.outbox").expect("name");
        let ms = 1_764_644_400_000; // 2025-12-02T03:00:00Z
        assert_eq!(
            partition_name(&outbox, ms, PartitionInterval::Hourly).to_string(),
            "billing.outbox_p2025120203"
        );
        assert_eq!(
            partition_name(
                &outbox,
                floor(ms, step(PartitionInterval::Daily)),
                PartitionInterval::Daily
            )
            .to_string(),
            "billing.outbox_p20251202"
        );
    }
}
