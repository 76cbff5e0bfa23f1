//! What every database's relay shares: the pipelined drain, publishing with a timeout,
//! turning publisher results into an outcome, recording it, and the stats.
//!
//! The database-specific part is a [`Claims`] implementation: claim the next batch,
//! mark rows sent, reschedule or dead-letter failed rows.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

use super::{Relay, RelayStats};
use crate::publisher::{OutboxRecord, PublishError, PublishErrorKind, Publisher};
use crate::store::Backend;

pub(crate) type SqlResult<T> = Result<T, sqlx::Error>;

/// The database side of a relay session.
pub(crate) trait Claims: Send {
    /// The keys with a pending row waiting for a retry.
    fn retrying_keys(&mut self) -> impl Future<Output = SqlResult<Vec<String>>> + Send;

    /// The oldest claimable rows (after `after`, when a batch before them is in flight).
    fn claim(
        &mut self,
        after: Option<i64>,
    ) -> impl Future<Output = SqlResult<Vec<OutboxRecord>>> + Send;

    /// Marks acknowledged rows sent (or deletes them, per `on_sent`).
    fn mark(&mut self, seqs: &[i64]) -> impl Future<Output = SqlResult<()>> + Send;

    /// Reschedules failed rows with backoff or dead-letters them; returns how many died.
    fn fail(&mut self, outcome: &Outcome) -> impl Future<Output = SqlResult<u64>> + Send;
}

/// Publishes until nothing is claimable, pipelined: while batch N is with the
/// publisher, the results of batch N-1 are recorded and batch N+1 is claimed. Batch
/// N+1 is only sent once N's results are known, and without the messages whose key
/// failed in N, so a failure still blocks the later messages of its key.
///
/// Batches after the first are claimed after the one in flight (`seq > last`), so they
/// cannot see a row of a lower `seq` that was blocked when the batch before was claimed
/// and is claimable now (its key's retry came due, or its predecessor was just marked).
/// Such a row's key had a row in retry: either when this drain started, or because it
/// failed during it. Those keys are `blocked`: prefetched batches leave them out, and
/// the next drain, which claims from the lowest `seq` again, takes them in order.
///
/// Prefetching stops at shutdown and after `rebalance_interval`; the pipeline then
/// empties (everything in flight is published and recorded) and this returns.
/// Returns how many rows were claimed.
pub(crate) async fn drain<P: Publisher, DB: Backend, S: Claims>(
    relay: &Relay<P, DB>,
    store: &mut S,
    shutdown: &watch::Receiver<bool>,
) -> SqlResult<usize> {
    let prefetch_until = Instant::now() + relay.config.rebalance_interval;
    let mut current = store.claim(None).await?;
    if current.is_empty() {
        return Ok(0);
    }
    // Filled before the first prefetch, while the first batch is being published (off
    // the latency path): until then nothing is prefetched, so nothing needs filtering.
    let mut blocked: HashSet<String> = HashSet::new();
    let mut blocked_loaded = false;
    let mut claimed = current.len();
    let mut unrecorded: Option<Outcome> = None;
    while !current.is_empty() || unrecorded.is_some() {
        let prefetch =
            !current.is_empty() && !*shutdown.borrow() && Instant::now() < prefetch_until;
        let after = current.last().map(|r| r.seq);
        let span = tracing::info_span!(
            "outbox.relay.batch",
            size = current.len(),
            first_seq = current.first().map(|r| r.seq),
            last_seq = after,
        );
        let batch = &current;
        let publish = async move {
            if batch.is_empty() {
                None
            } else {
                Some(publish(relay, batch).await)
            }
        }
        .instrument(span);
        let previous = unrecorded.take();
        let database = async {
            type Claimed = (Vec<OutboxRecord>, Option<Vec<String>>);
            if let Some(outcome) = previous {
                record(relay, store, outcome).await?;
            }
            if !prefetch {
                return SqlResult::<Claimed>::Ok((Vec::new(), None));
            }
            let retrying = if blocked_loaded {
                None
            } else {
                Some(store.retrying_keys().await?)
            };
            Ok((store.claim(after).await?, retrying))
        };
        let (results, next) = tokio::join!(publish, database);
        let (mut next, retrying) = next?;
        if let Some(keys) = retrying {
            blocked.extend(keys);
            blocked_loaded = true;
        }
        if *shutdown.borrow() {
            next.clear(); // claimed but not sent: left for the next relay
        }
        claimed += next.len();
        if let Some(results) = results {
            let outcome = Outcome::new(&current, results);
            blocked.extend(outcome.failed_keys.iter().cloned());
            unrecorded = Some(outcome);
        }
        if !blocked.is_empty() {
            // Not sent now: they wait in the table for the next drain.
            next.retain(|r| {
                r.partition_key
                    .as_ref()
                    .is_none_or(|k| !blocked.contains(k))
            });
        }
        current = next;
    }
    Ok(claimed)
}

/// Writes a batch's outcome: acknowledged rows marked sent (or deleted), failed rows
/// rescheduled or dead-lettered.
async fn record<P: Publisher, DB: Backend, S: Claims>(
    relay: &Relay<P, DB>,
    store: &mut S,
    outcome: Outcome,
) -> SqlResult<()> {
    let stats = &relay.stats;
    if !outcome.sent.is_empty() {
        store.mark(&outcome.sent).await?;
        let n = outcome.sent.len() as u64;
        RelayStats::add(&stats.published, n);
        metrics::counter!("outbox_published_total").increment(n);
    }
    if !outcome.failed_seq.is_empty() {
        let dead = store.fail(&outcome).await?;
        let failed = outcome.failed_seq.len() as u64;
        RelayStats::add(&stats.failed, failed);
        RelayStats::add(&stats.dead, dead);
        metrics::counter!("outbox_failed_total").increment(failed);
        metrics::counter!("outbox_dead_lettered_total").increment(dead);
        if dead > 0 {
            tracing::error!(
                count = dead,
                "outbox messages dead-lettered after their last attempt"
            );
        }
    }
    Ok(())
}

/// Hands `batch` to the publisher, bounded by `publish_timeout`; one result per message.
async fn publish<P: Publisher, DB: Backend>(
    relay: &Relay<P, DB>,
    batch: &[OutboxRecord],
) -> Vec<Result<(), PublishError>> {
    let config = &relay.config;
    RelayStats::add(&relay.stats.batches, 1);
    let started = std::time::Instant::now();
    let results = match tokio::time::timeout(
        config.publish_timeout,
        guarded(&relay.publisher, batch),
    )
    .await
    {
        Ok(Ok(results)) if results.len() == batch.len() => results,
        Ok(Err(panic)) => {
            tracing::error!(
                size = batch.len(),
                panic = %panic,
                "outbox publisher panicked; publishing the batch one message at a time to find the message"
            );
            isolate(relay, batch).await
        }
        Ok(Ok(results)) => {
            tracing::error!(
                expected = batch.len(),
                got = results.len(),
                "outbox publisher returned the wrong number of results; retrying the batch"
            );
            vec![Err(wrong_count()); batch.len()]
        }
        Err(_) => vec![Err(timed_out(config.publish_timeout)); batch.len()],
    };
    metrics::histogram!("outbox_publish_latency_seconds").record(started.elapsed().as_secs_f64());
    results
}

/// `publisher.publish(batch)`, with a panic caught and returned as its message: a bug in
/// a publisher (or a message that trips one) must not end the relay, nor hold back the
/// other keys' messages.
async fn guarded<P: Publisher>(
    publisher: &P,
    batch: &[OutboxRecord],
) -> Result<Vec<Result<(), PublishError>>, String> {
    use futures_util::FutureExt;
    // `publish` is called inside the guarded future: a publisher whose `publish` is a
    // plain `fn` returning a future may panic before the future exists.
    std::panic::AssertUnwindSafe(async move { publisher.publish(batch).await })
        .catch_unwind()
        .await
        .map_err(|panic| {
            panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned())
        })
}

/// After a panic on `batch`: publishes it one message at a time, in order, so that only
/// the message that makes the publisher panic fails (a retryable failure with the panic's
/// message, which counts towards `max_attempts`), and the later messages of its key are
/// not attempted. Bounded by `publish_timeout` as a whole, like the batch.
async fn isolate<P: Publisher, DB: Backend>(
    relay: &Relay<P, DB>,
    batch: &[OutboxRecord],
) -> Vec<Result<(), PublishError>> {
    let mut results: Vec<Result<(), PublishError>> = Vec::with_capacity(batch.len());
    let mut failed_keys: HashSet<&str> = HashSet::new();
    let deadline = Instant::now() + relay.config.publish_timeout;
    for record in batch {
        let key = record.partition_key.as_deref();
        if key.is_some_and(|k| failed_keys.contains(k)) || Instant::now() >= deadline {
            results.push(Err(PublishError::not_attempted()));
            continue;
        }
        let one = std::slice::from_ref(record);
        let result = match tokio::time::timeout_at(deadline, guarded(&relay.publisher, one)).await {
            Ok(Ok(mut r)) if r.len() == 1 => r.remove(0),
            Ok(Ok(_)) => Err(wrong_count()),
            Ok(Err(panic)) => {
                tracing::error!(seq = record.seq, id = %record.id, panic = %panic, "outbox publisher panicked on this message");
                Err(PublishError::retryable(format!(
                    "the publisher panicked: {panic}"
                )))
            }
            Err(_) => Err(timed_out(relay.config.publish_timeout)),
        };
        if result.is_err() {
            if let Some(key) = key {
                failed_keys.insert(key);
            }
        }
        results.push(result);
    }
    results
}

fn wrong_count() -> PublishError {
    PublishError::retryable("publisher returned the wrong number of results")
}

fn timed_out(after: std::time::Duration) -> PublishError {
    PublishError::retryable(format!("publish timed out after {after:?}"))
}

/// What happened to one batch, ready to be written back.
pub(crate) struct Outcome {
    pub(crate) sent: Vec<i64>,
    pub(crate) failed_seq: Vec<i64>,
    /// `attempts` of each failed row when it was claimed.
    pub(crate) failed_attempts: Vec<i32>,
    pub(crate) failed_error: Vec<String>,
    pub(crate) failed_permanent: Vec<bool>,
    pub(crate) failed_keys: HashSet<String>,
}

impl Outcome {
    fn new(batch: &[OutboxRecord], results: Vec<Result<(), PublishError>>) -> Outcome {
        let mut outcome = Outcome {
            sent: Vec::with_capacity(batch.len()),
            failed_seq: Vec::new(),
            failed_attempts: Vec::new(),
            failed_error: Vec::new(),
            failed_permanent: Vec::new(),
            failed_keys: HashSet::new(),
        };
        for (record, result) in batch.iter().zip(results) {
            let key = record.partition_key.as_deref();
            match result {
                Ok(()) => {
                    if let Some(key) = key.filter(|k| outcome.failed_keys.contains(*k)) {
                        tracing::warn!(
                            seq = record.seq,
                            key,
                            "publisher acknowledged a message after failing an earlier one of the same key: \
                             the broker has them out of order"
                        );
                    }
                    outcome.sent.push(record.seq);
                }
                Err(e) if e.kind() == PublishErrorKind::NotAttempted => {
                    // Left pending behind an earlier failure of its key.
                    if let Some(key) = key {
                        outcome.failed_keys.insert(key.to_owned());
                    }
                }
                Err(e) => {
                    if let Some(key) = key {
                        outcome.failed_keys.insert(key.to_owned());
                    }
                    tracing::warn!(seq = record.seq, id = %record.id, error = %e, "outbox message failed to publish");
                    outcome.failed_seq.push(record.seq);
                    outcome.failed_attempts.push(record.attempts);
                    outcome
                        .failed_permanent
                        .push(e.kind() == PublishErrorKind::Permanent);
                    outcome.failed_error.push(e.message().to_owned());
                }
            }
        }
        outcome
    }
}

/// `claim` (a `SELECT` of claimable rows with `payload` and `headers` as text, in `seq`
/// order, with its `LIMIT`) cut where its rows' payloads and headers reach `budget` bytes
/// (a placeholder): the rows before the one that crosses it, and that one, so a batch
/// always has a row and the server sends no more than the budget (plus one row).
/// `length` is the database's byte length of the text `%`.
pub(crate) fn budgeted(claim: &str, length: &str, budget: &str) -> String {
    let bytes = format!(
        "({} + {})",
        length.replace('%', "c.payload"),
        length.replace('%', "c.headers")
    );
    format!(
        "SELECT * FROM (\
           SELECT c.*, SUM({bytes}) OVER (ORDER BY c.seq) - {bytes} AS bytes_before \
           FROM ({claim}) c) w \
         WHERE w.bytes_before < {budget} ORDER BY w.seq"
    )
}

/// Decodes claimed rows as they arrive, so that a batch is never held twice (as rows
/// and as records). Its size is bounded by the claim statement ([`budgeted`]).
pub(crate) async fn decode_each<R, E>(
    rows: impl futures_util::Stream<Item = Result<R, E>>,
    decode: impl Fn(&R) -> SqlResult<OutboxRecord>,
) -> SqlResult<Vec<OutboxRecord>>
where
    sqlx::Error: From<E>,
{
    use futures_util::TryStreamExt;
    let mut rows = std::pin::pin!(rows);
    let mut batch = Vec::new();
    while let Some(row) = rows.try_next().await? {
        batch.push(decode(&row)?);
    }
    Ok(batch)
}

/// Headers written by hand may hold non-string values: they are passed on as JSON text
/// rather than blocking the relay on one row.
pub(crate) fn headers(seq: i64, text: &str) -> BTreeMap<String, String> {
    if text == "{}" {
        return BTreeMap::new();
    }
    match serde_json::from_str::<BTreeMap<String, serde_json::Value>>(text) {
        Ok(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        Err(e) => {
            tracing::warn!(seq, error = %e, "outbox row's headers are not a JSON object; publishing without them");
            BTreeMap::new()
        }
    }
}

/// For databases that compute the retry schedule in Rust (MySQL/MariaDB, SQLite): whether
/// the `i`-th failure of `outcome` dead-letters its row, and otherwise the delay before
/// the next attempt: `backoff_base * 2^attempts`, capped, with ±25% jitter. The same rule
/// as the PostgreSQL statement.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn retry_plan<P, DB: Backend>(
    relay: &Relay<P, DB>,
    outcome: &Outcome,
    i: usize,
) -> (bool, f64) {
    let config = &relay.config;
    let attempts = outcome.failed_attempts[i];
    let dead = outcome.failed_permanent[i] || attempts.saturating_add(1) >= config.max_attempts;
    let exp = 2f64.powi(attempts.clamp(0, 62));
    let delay = (config.backoff_base.as_secs_f64() * exp).min(config.backoff_cap.as_secs_f64());
    (dead, delay * (0.75 + jitter() * 0.5))
}

/// A number in `[0, 1)`, different each call (std's randomly keyed hasher; no RNG crate).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}
