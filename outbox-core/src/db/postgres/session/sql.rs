//! The statements of one table-mode relay session, rendered once per session.

use super::*;

/// The statements of one relay, rendered once per session.
pub(super) struct Sql {
    pub(super) sample: String,
    pub(super) claim: String,
    pub(super) mark: String,
    pub(super) fail: String,
    pub(super) probe: String,
    pub(super) retrying: String,
    pub(super) count_relays: String,
}

impl Sql {
    pub(super) fn new(outbox: &str, seq_name: &str, table_key: i32, config: &RelayConfig) -> Sql {
        let on_sent = config.on_sent;
        let parked = state::parked(outbox, config.on_dead_letter == OnDeadLetter::ParkKey);
        let advisory = format!(
            "locktype = 'advisory' AND granted AND objsubid = 2 AND classid = ({table_key})::int4::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        );
        let (writers, relays, max_relays) = (locks::WRITERS, locks::RELAYS, locks::MAX_RELAYS);
        Sql {
            // Two statements, two snapshots, in this order: H first, then the writers.
            sample: format!(
                "SELECT (CASE WHEN is_called THEN last_value ELSE 0 END)::text FROM {seq_name}; \
                 SELECT coalesce(string_agg(virtualtransaction, ','), '') FROM pg_locks \
                 WHERE {advisory} AND objid = {writers}"
            ),
            claim: budgeted(
                &format!(
                    "SELECT {columns} \
                     FROM {outbox} o \
                     WHERE {pending_o} AND o.seq <= $1 AND o.seq > $5 \
                       AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now()) \
                       AND ($3::int4[] IS NULL OR \
                            ((hashtextextended(coalesce(o.partition_key, o.id::text), 0) & 9223372036854775807) % $4)::int4 \
                              = ANY($3)) \
                       AND NOT EXISTS (SELECT 1 FROM {outbox} r \
                            WHERE r.partition_key = o.partition_key AND r.seq < o.seq \
                              AND {pending_r} AND {blocker}){parked} \
                     ORDER BY o.seq LIMIT $2",
                    columns = claim_columns(|c| format!("{c}::text"), super::super::payload_bytes),
                    pending_o = state::pending("o"),
                    pending_r = state::pending("r"),
                    blocker = state::blocker("now()", "$5"),
                ),
                "octet_length(%)",
                "$6",
            ),
            mark: match on_sent {
                OnSent::Mark => format!("UPDATE {outbox} SET sent_at = now() WHERE seq = ANY($1)"),
                OnSent::Delete => format!("DELETE FROM {outbox} WHERE seq = ANY($1)"),
            },
            // A failure of the broker (`unavailable`) keeps `attempts` and never
            // dead-letters; it is due again after the relay's outage backoff ($8).
            fail: format!(
                "UPDATE {outbox} o SET \
                   attempts = o.attempts + CASE WHEN f.unavailable THEN 0 ELSE 1 END, \
                   last_error = f.error, \
                   dead_at = CASE WHEN NOT f.unavailable AND (f.permanent OR o.attempts + 1 >= $4) \
                     THEN now() END, \
                   next_attempt_at = CASE \
                     WHEN f.unavailable THEN now() + make_interval(secs => $8) \
                     WHEN f.permanent OR o.attempts + 1 >= $4 THEN o.next_attempt_at \
                     ELSE now() + make_interval(secs => least($6, $5 * power(2, least(o.attempts, 62))) * (0.75 + random() * 0.5)) END \
                 FROM UNNEST($1::bigint[], $2::text[], $3::bool[], $7::bool[]) \
                   AS f(seq, error, permanent, unavailable) \
                 WHERE o.seq = f.seq \
                 RETURNING o.dead_at IS NOT NULL AS dead"
            ),
            count_relays: format!(
                "SELECT count(*) FROM pg_locks WHERE {advisory} AND objid >= {relays} AND objid < {relays} + {max_relays}"
            ),
            retrying: state::retrying("partition_key", outbox),
            probe: format!(
                "SELECT count(*) AS pending, \
                        count(*) FILTER (WHERE next_attempt_at IS NULL OR next_attempt_at <= now()) AS due, \
                        coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age, \
                        extract(epoch FROM min(next_attempt_at) FILTER (WHERE next_attempt_at > now()) - now())::float8 \
                          AS next_due_in, \
                        (SELECT count(*) FROM pg_locks WHERE {advisory} \
                          AND objid >= {relays} AND objid < {relays} + {max_relays}) \
                          AS relays \
                 FROM {outbox} WHERE {PENDING}"
            ),
        }
    }
}
