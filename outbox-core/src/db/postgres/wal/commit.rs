//! The commit's statement: every event of a transaction as one
//! `pg_logical_emit_message` each, sent with `COMMIT` in one round trip.

use super::*;

use crate::store::trusted_sql;

/// The statement that writes `messages` into the WAL, as literals (sent with `COMMIT` in
/// one round trip, like table mode's): one `pg_logical_emit_message` per event, in emit
/// order (a `VALUES` list is scanned in order). The UTF-8 guard runs first. Each envelope
/// is a `bytea` literal in hex (`decode('...', 'hex')`): the payload's bytes arrive as
/// they are whatever they hold, and no setting (`standard_conforming_strings`, the client
/// encoding) changes what the literal means.
pub(crate) fn commit_sql(wal: &Wal, messages: &[OutboxMessage]) -> Result<String> {
    let now = Utc::now();
    let mut sql = String::with_capacity(messages.iter().map(|m| 2 * m.payload.len() + 400).sum());
    sql.push_str("SELECT pg_logical_emit_message(true, ");
    let tag = super::dollar_tag(&wal.prefix);
    sql.push_str(&tag);
    sql.push_str(&wal.prefix);
    sql.push_str(&tag);
    sql.push_str(", ");
    if let [m] = messages {
        // One event (the common case): no row source to plan.
        hex_literal(&mut sql, &envelope(m, now)?);
        sql.push(')');
    } else {
        sql.push_str("m) FROM (VALUES ");
        for (i, m) in messages.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push('(');
            hex_literal(&mut sql, &envelope(m, now)?);
            sql.push(')');
        }
        sql.push_str(") AS v(m)");
    }
    // The guard is a one-time filter: evaluated once, before any message is written.
    sql.push_str(&format!(" WHERE {} = 0", super::UTF8_GUARD));
    Ok(sql)
}

/// Appends `bytes` as `decode('<hex>', 'hex')`.
fn hex_literal(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(2 * bytes.len() + 20);
    sql.push_str("decode('");
    for &b in bytes {
        sql.push(char::from(HEX[usize::from(b >> 4)]));
        sql.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    sql.push_str("', 'hex')");
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
        "SELECT pg_logical_emit_message(true, $1, m) FROM unnest($2::bytea[]) AS u(m) WHERE {} = 0",
        super::UTF8_GUARD
    )))
    .bind(&wal.prefix)
    .bind(&envelopes)
    .execute(conn)
    .await
    .context("writing events to the WAL", &tables.outbox)?;
    Ok(())
}
