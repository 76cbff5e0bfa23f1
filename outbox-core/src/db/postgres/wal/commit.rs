//! The commit's statement: every event of a transaction as one
//! `pg_logical_emit_message` each, sent with `COMMIT` in one round trip.

use super::*;

use crate::store::trusted_sql;

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
    sqlx::query(trusted_sql(format!(
        "SELECT pg_logical_emit_message(true, $1, m) FROM unnest($2::text[]) AS u(m) WHERE {} = 0",
        super::UTF8_GUARD
    )))
    .bind(&wal.prefix)
    .bind(&envelopes)
    .execute(conn)
    .await
    .context("writing events to the WAL", &tables.outbox)?;
    Ok(())
}
