//! Several relays on one outbox: the partition count they agree on, how many relays run,
//! and the share of partitions each holds (advisory locks on its session connection).

use super::*;

use crate::store::trusted_sql;

/// Registers this relay's partition count, or refuses to run next to relays of the same
/// outbox configured with another: they would hash keys to different partitions, and two
/// relays could then publish one key at the same time, out of order. The check and the
/// registration happen under a short exclusive lock, so two relays starting together with
/// different counts cannot both pass. A refused relay reports the error and retries like
/// after any failed session: it takes over once the others are gone (a rolling change of
/// `partitions` therefore switches over without overlap).
pub(super) async fn register_partition_count(
    conn: &mut PgConnection,
    table_key: i32,
    cx: Context<'_, Postgres>,
) -> SessionResult<()> {
    let mine = i32::from(cx.config.partitions);
    sqlx::query("SELECT pg_advisory_lock($1, $2)")
        .bind(table_key)
        .bind(locks::PARTITION_COUNT_CHECK)
        .execute(&mut *conn)
        .await?;
    let others: Option<i32> = sqlx::query_scalar(
        "SELECT (objid::int8 - $2)::int4 FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid = ($1)::int4::oid \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND objid::int8 > $2 AND objid::int8 <= $2 + 65535 AND objid::int8 <> $2 + $3 \
         LIMIT 1",
    )
    .bind(table_key)
    .bind(i64::from(locks::PARTITION_COUNT))
    .bind(i64::from(mine))
    .fetch_optional(&mut *conn)
    .await?;
    if others.is_none() {
        sqlx::query("SELECT pg_advisory_lock_shared($1, $2)")
            .bind(table_key)
            .bind(locks::PARTITION_COUNT + mine)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query("SELECT pg_advisory_unlock($1, $2)")
        .bind(table_key)
        .bind(locks::PARTITION_COUNT_CHECK)
        .execute(&mut *conn)
        .await?;
    match others {
        None => Ok(()),
        Some(theirs) => Err(SessionError::Refused(format!(
            "other relays of outbox {} run with {theirs} partitions, this one is configured with \
             {mine}; every relay of one outbox must use the same `partitions` (RelayBuilder::partitions). \
             This relay stands by and takes over when those relays are gone",
            cx.tables.outbox
        ))),
    }
}

impl PgSession<'_> {
    /// Whether the partitions held differ from what the log last said (then it is the
    /// log's new word). A tenant of a relay of many outboxes takes the same partitions
    /// again each turn: said once, not 50 tenants times every turn.
    fn partitions_changed(&mut self) -> bool {
        if self.owned == self.reported_partitions {
            return false;
        }
        self.reported_partitions.clone_from(&self.owned);
        true
    }

    pub(super) async fn count_relays(&mut self) -> SessionResult<i64> {
        self.count_queries(1);
        Ok(sqlx::query_scalar(trusted_sql(&self.sql.count_relays))
            .fetch_one(&mut self.conn)
            .await?)
    }

    /// Takes or gives back partitions so that every relay holds its fair share.
    pub(super) async fn rebalance(&mut self) -> SessionResult<()> {
        let total = i32::from(self.cx.config.partitions);
        let relays = i32::try_from(self.relays.max(1)).unwrap_or(i32::MAX);
        let share = usize::try_from((total + relays - 1) / relays).unwrap_or(1);
        if self.owned.len() > share {
            let extra: Vec<i32> = self
                .owned
                .iter()
                .rev()
                .take(self.owned.len() - share)
                .copied()
                .collect();
            self.count_queries(1);
            sqlx::query("SELECT pg_advisory_unlock($1, $2 + p) FROM unnest($3::int4[]) AS p")
                .bind(self.table_key)
                .bind(locks::PARTITIONS)
                .bind(&extra)
                .execute(&mut self.conn)
                .await?;
            for p in &extra {
                self.owned.remove(p);
            }
            if self.partitions_changed() {
                tracing::info!(outbox = %self.cx.tables.outbox, released = ?extra, relays, "outbox relay gave partitions back");
            }
        } else if self.owned.len() < share {
            // Start looking at a slot-dependent offset so relays don't all race for partition 0.
            let start = (self.slot * i32::try_from(share).unwrap_or(1)).rem_euclid(total);
            let candidates: Vec<i32> = (0..total)
                .map(|i| (start + i) % total)
                .filter(|p| !self.owned.contains(p))
                .collect();
            self.count_queries(1);
            let got: Vec<i32> = sqlx::query_scalar(
                "SELECT p FROM unnest($3::int4[]) AS p WHERE pg_try_advisory_lock($1, $2 + p) LIMIT $4",
            )
            .bind(self.table_key)
            .bind(locks::PARTITIONS)
            .bind(&candidates)
            .bind(i64::try_from(share - self.owned.len()).unwrap_or(0))
            .fetch_all(&mut self.conn)
            .await?;
            let took = !got.is_empty();
            self.owned.extend(got.iter().copied());
            if took && self.partitions_changed() {
                tracing::info!(outbox = %self.cx.tables.outbox, acquired = ?got, relays, "outbox relay took partitions");
            } else if took {
                tracing::debug!(outbox = %self.cx.tables.outbox, acquired = ?got, relays, "outbox relay took its partitions again");
            }
        }
        self.cx
            .gauge("outbox_relay_partitions", self.owned.len() as f64);
        Ok(())
    }
}
