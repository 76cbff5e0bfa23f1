//! The pipelined drain, the same for every session: publishing with a timeout, turning
//! publisher results into an [`Outcome`], recording it, and the stats. The database's
//! part is a [`Session`]: claim the next batch, acknowledge rows, reschedule or
//! dead-letter failed rows.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use futures_util::FutureExt;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

use super::{Relay, RelayStats};
use crate::backoff::Backoff;
use crate::publisher::{OutboxRecord, PublishError, PublishErrorKind, Publisher};
use crate::store::Backend;
use crate::store::session::{Failure, Outcome, Session, SessionResult};

/// Publishes until nothing is claimable, pipelined: while batch N is with the
/// publisher, the results of batch N-1 are recorded, and, when N is full (a backlog),
/// batch N+1 is claimed. A batch that is not full means the relay has caught up: N+1 is
/// then claimed once N is acknowledged, so that it takes every row committed while N was
/// with the broker (claimed ahead, such a row would wait for one more publish: at 1,000
/// commits/s that was a third of the commit -> ack latency). Batch N+1 is only sent once
/// N's results are known, and without the messages whose key failed in N, so a failure
/// still blocks the later messages of its key.
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
///
/// A tenant of a shared relay (`turn`) does not wait for the broker on the hub's
/// connection once its turn is over (its time is up and another tenant waits for a
/// connection) and the broker has had its oldest batch out for the length of a turn:
/// the batches still with the publisher are handed over
/// ([`Drained::detached`]) and go on without the connection, and the drain returns.
/// Nothing is claimed meanwhile (what was claimed ahead is dropped, unsent), and their
/// outcomes are recorded, in send order, before the tenant's next claim
/// ([`record_outcomes`]): rows are marked only once acknowledged, and a key's later rows
/// are claimed only after its batch's outcome is written.
pub(crate) async fn drain<'r, P: Publisher, DB: Backend, S: Session>(
    relay: &'r Relay<P, DB>,
    store: &mut S,
    shutdown: &watch::Receiver<bool>,
    turn: Option<Clock<'_>>,
) -> SessionResult<Drained<'r>> {
    // A tenant of a shared relay hands its connection on after its turn.
    let prefetch_until = Instant::now()
        + relay
            .config
            .rebalance_interval
            .min(turn.map_or(Duration::MAX, |t| t.quantum));
    let mut current = store.claim(None).await?;
    let mut drained = Drained::default();
    if current.is_empty() {
        return Ok(drained);
    }
    // Filled before the first prefetch, while the first batch is being published (off
    // the latency path): until then nothing is prefetched, so nothing needs filtering.
    let mut blocked: HashSet<String> = HashSet::new();
    let mut blocked_loaded = false;
    let mut claimed = current.len();
    let mut unrecorded: Option<Outcome> = None;
    let side_by_side = relay
        .publisher
        .max_batches_in_flight()
        .min(relay.config.batches_in_flight)
        .clamp(1, MAX_BATCHES_IN_FLIGHT);
    while !current.is_empty() || unrecorded.is_some() {
        // A full batch means a backlog: claiming ahead keeps the broker busy. Otherwise
        // the next batch is claimed late, below, to be as fresh as it can be.
        let more = !current.is_empty() && !*shutdown.borrow() && Instant::now() < prefetch_until;
        let full = current.len() >= relay.config.batch_size;
        let (prefetch, late) = (more && full, more && !full);
        let after = current.last().map(|r| r.seq);
        if late && side_by_side > 1 {
            // Caught up, and the publisher takes batches side by side.
            let caught_up = CaughtUp {
                current,
                unrecorded,
                after,
                blocked,
                blocked_loaded,
                prefetch_until,
                most: side_by_side,
            };
            drained.claimed = claimed;
            return live(relay, store, shutdown, caught_up, drained, turn).await;
        }
        let span = tracing::info_span!(
            "outbox.relay.batch",
            size = current.len(),
            first_seq = current.first().map(|r| r.seq),
            last_seq = after,
        );
        let batch = std::mem::take(&mut current);
        let sent_at = Instant::now();
        let mut sending: Option<Sending<'r>> =
            (!batch.is_empty()).then(|| Box::pin(send(relay, batch).instrument(span)) as _);
        let previous = unrecorded.take();
        let database = async {
            let Some(outcome) = previous else {
                if !prefetch {
                    return Ok((Vec::new(), None));
                }
                return claim_next(store, after, blocked_loaded).await;
            };
            let (dead, next) = if prefetch {
                let retrying = retrying_keys(store, blocked_loaded).await?;
                let (dead, claimed) = store.record_and_claim(&outcome, after).await?;
                (dead, (claimed, retrying))
            } else {
                (store.record(&outcome).await?, (Vec::new(), None))
            };
            let retry_in = recorded(relay, &outcome, dead);
            drained.retry_in = min_retry(drained.retry_in, retry_in);
            Ok(next)
        };
        // The database step, with the batch's publish polled beside it.
        let mut back: Option<Sent> = None;
        let next = match sending.as_mut() {
            None => database.await,
            Some(out) => {
                tokio::pin!(database);
                loop {
                    tokio::select! {
                        next = &mut database => break next,
                        sent = &mut *out, if back.is_none() => back = Some(sent),
                    }
                }
            }
        };
        if back.is_some() {
            sending = None;
        }
        let (mut next, mut retrying) = match next {
            Ok(next) => next,
            Err(e) => {
                // The publish call is not dropped half-way.
                if let Some(out) = sending {
                    out.await;
                }
                return Err(e);
            }
        };
        if let Some(mut out) = sending {
            // A tenant whose turn is over waits for the broker without the connection.
            let over = async {
                match turn {
                    Some(turn) => turn.ends(sent_at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                sent = &mut out => back = Some(sent),
                () = over => {
                    drained.claimed = claimed;
                    drained.detached = Some(Detached::new(out));
                    return Ok(drained);
                }
            }
        }
        let results = back;
        if late && !*shutdown.borrow() {
            (next, retrying) = claim_next(store, after, blocked_loaded).await?;
        }
        if let Some(keys) = retrying {
            blocked.extend(keys);
            blocked_loaded = true;
        }
        if *shutdown.borrow() {
            next.clear(); // claimed but not sent: left for the next relay
        }
        claimed += next.len();
        if let Some((batch, results)) = results {
            let mut outcome = outcome(&batch, results);
            outcome.unavailable_delay = outage_backoff(relay, &outcome);
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
    drained.claimed = claimed;
    Ok(drained)
}

/// The most batches [`live`] keeps with the publisher at once.
const MAX_BATCHES_IN_FLIGHT: usize = 4;

/// After an empty claim while batches are out, [`live`] looks again this soon, doubling
/// up to [`LIVE_POLL_MAX`] while nothing comes (each look is a claim statement).
const LIVE_POLL_MIN: std::time::Duration = std::time::Duration::from_millis(2);
const LIVE_POLL_MAX: std::time::Duration = std::time::Duration::from_millis(32);

/// Where the pipelined drain was when it caught up: the batch to send, the outcome not
/// yet recorded, the claim cursor, the keys held back for the rest of the drain.
struct CaughtUp {
    current: Vec<OutboxRecord>,
    unrecorded: Option<Outcome>,
    after: Option<i64>,
    blocked: HashSet<String>,
    blocked_loaded: bool,
    prefetch_until: Instant,
    most: usize,
}

/// One batch with the publisher, and its results.
type Sent = (Vec<OutboxRecord>, Vec<Result<(), PublishError>>);

/// A publish call under way, owning its batch.
type Sending<'r> = futures_util::future::BoxFuture<'r, Sent>;

/// Hands `batch` to the publisher ([`publish`]); the batch comes back with its results.
async fn send<P: Publisher, DB: Backend>(relay: &Relay<P, DB>, batch: Vec<OutboxRecord>) -> Sent {
    let results = publish(relay, &batch).await;
    (batch, results)
}

/// A tenant's turn on a shared connection, as the drain sees it.
#[derive(Clone, Copy)]
pub(crate) struct Clock<'t> {
    /// When the turn began.
    pub(crate) started: Instant,
    /// How long it lasts while other tenants wait.
    pub(crate) quantum: Duration,
    /// Whether another tenant waits for a connection.
    pub(crate) contended: &'t (dyn Fn() -> bool + Send + Sync),
}

/// How often a tenant whose time is up, waiting for the broker on the connection, looks
/// whether another tenant waits for one (a load of a counter).
const CONTENTION_POLL: Duration = Duration::from_millis(2);

impl Clock<'_> {
    /// Whether the turn is over: its time is up and another tenant waits.
    pub(crate) fn over(&self) -> bool {
        self.started.elapsed() >= self.quantum && (self.contended)()
    }

    /// Resolves once the turn is over and the broker has had a batch sent at `sent_at`
    /// for a whole `quantum` more: a batch a broker acknowledges in the usual time is
    /// awaited on the connection (handed over, its outcome would wait for a turn of its
    /// own), a broker that does not answer holds the connection at most that long.
    async fn ends(self, sent_at: Instant) {
        tokio::time::sleep_until(self.started.max(sent_at) + self.quantum).await;
        while !(self.contended)() {
            tokio::time::sleep(CONTENTION_POLL).await;
        }
    }
}

/// The batches a tenant left with the publisher when its turn ended: they go on without
/// the connection; their outcomes are recorded at the start of the tenant's next turn
/// ([`record_outcomes`]), in send order.
pub(crate) struct Detached<'r> {
    out: futures_util::stream::FuturesOrdered<Sending<'r>>,
    back: Vec<Sent>,
}

impl fmt::Debug for Detached<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detached")
            .field("out", &self.out.len())
            .field("back", &self.back.len())
            .finish()
    }
}

impl<'r> Detached<'r> {
    fn new(out: Sending<'r>) -> Self {
        Detached {
            out: std::iter::once(out).collect(),
            back: Vec::new(),
        }
    }

    /// Batches handed over.
    pub(crate) fn len(&self) -> usize {
        self.out.len() + self.back.len()
    }

    /// Runs `step` (the session's hand-back) while the batches go on: a publish call
    /// makes progress only while polled.
    pub(crate) async fn beside<T>(&mut self, step: impl std::future::Future<Output = T>) -> T {
        use futures_util::StreamExt;
        tokio::pin!(step);
        loop {
            tokio::select! {
                done = &mut step => return done,
                Some(sent) = self.out.next(), if !self.out.is_empty() => self.back.push(sent),
            }
        }
    }

    /// Waits for every batch (each bounded by `publish_timeout`); their outcomes, in
    /// send order.
    pub(crate) async fn finish<P: Publisher, DB: Backend>(
        mut self,
        relay: &Relay<P, DB>,
    ) -> Vec<Outcome> {
        use futures_util::StreamExt;
        while let Some(sent) = self.out.next().await {
            self.back.push(sent);
        }
        self.back
            .into_iter()
            .map(|(batch, results)| {
                let mut outcome = outcome(&batch, results);
                outcome.unavailable_delay = outage_backoff(relay, &outcome);
                outcome
            })
            .collect()
    }
}

/// Records the outcomes of batches that came back while the tenant had no connection, in
/// send order, each leaving `outcomes` once written (a failure leaves the rest for the
/// next turn); returns when the earliest row it rescheduled may be due.
pub(crate) async fn record_outcomes<P: Publisher, DB: Backend, S: Session>(
    relay: &Relay<P, DB>,
    store: &mut S,
    outcomes: &mut std::collections::VecDeque<Outcome>,
) -> SessionResult<Option<Duration>> {
    let mut retry_in = None;
    while let Some(outcome) = outcomes.front() {
        let dead = store.record(outcome).await?;
        retry_in = min_retry(retry_in, recorded(relay, outcome, dead));
        outcomes.pop_front();
    }
    Ok(retry_in)
}

/// The drain once it has caught up, for a publisher that takes batches side by side
/// ([`Publisher::max_batches_in_flight`] > 1): each claim goes to the publisher at once,
/// beside up to `most - 1` batches still out, so a row committed while a batch is with
/// the broker waits for a claim, not for that batch.
///
/// - **One batch per key at a time.** A claim is cut before its first row whose key is
///   in a batch still out; the cursor stays before that row, so the next claim reads it
///   again, once its key's batch is back and recorded.
/// - **Outcomes in send order.** Batches come back in the order they were sent
///   (`FuturesOrdered`), each recorded before the next claim. A failed key is held back
///   for the rest of the drain, as in the pipelined drain (`blocked`); the next drain
///   claims it from its lowest `seq` again.
/// - **Back to the pipelined drain** when a claim comes back full (a backlog), at
///   shutdown and after `rebalance_interval`: no more claims, the batches out are
///   awaited and recorded, and the drain returns.
///
/// After a claim that finds nothing while batches are out, the next look comes after
/// [`LIVE_POLL_MIN`], doubling up to [`LIVE_POLL_MAX`], or as soon as a batch is back.
async fn live<'r, P: Publisher, DB: Backend, S: Session>(
    relay: &'r Relay<P, DB>,
    store: &mut S,
    shutdown: &watch::Receiver<bool>,
    caught_up: CaughtUp,
    mut drained: Drained<'r>,
    turn: Option<Clock<'_>>,
) -> SessionResult<Drained<'r>> {
    use futures_util::StreamExt;
    use futures_util::stream::FuturesOrdered;
    let CaughtUp {
        current,
        unrecorded,
        mut after,
        mut blocked,
        mut blocked_loaded,
        prefetch_until,
        most,
    } = caught_up;
    let send = |batch: Vec<OutboxRecord>| -> Sending<'r> { Box::pin(send(relay, batch)) };
    let mut out: FuturesOrdered<Sending<'r>> = FuturesOrdered::new();
    // When each batch out (or back, not yet recorded) was sent, oldest first.
    let mut sent_at: std::collections::VecDeque<Instant> = std::collections::VecDeque::new();
    // Keys of the batches out (each in one batch only).
    let mut busy: HashSet<String> = HashSet::new();
    busy.extend(current.iter().filter_map(|r| r.partition_key.clone()));
    out.push_back(send(current));
    sent_at.push_back(Instant::now());
    // Polled once so the publisher has the batch while the outcome before is recorded.
    let mut back: std::collections::VecDeque<Sent> =
        out.next().now_or_never().flatten().into_iter().collect();
    if let Some(outcome) = unrecorded {
        let dead = beside(store.record(&outcome), &mut out, &mut back).await?;
        drained.retry_in = min_retry(drained.retry_in, recorded(relay, &outcome, dead));
    }
    let mut backlog = false;
    let mut poll = Backoff::new(LIVE_POLL_MIN, LIVE_POLL_MAX);
    loop {
        // Outcomes first, in send order: a failed key is blocked before the next claim.
        while let Some((batch, results)) = back.pop_front() {
            sent_at.pop_front();
            for record in &batch {
                if let Some(key) = &record.partition_key {
                    busy.remove(key);
                }
            }
            let mut outcome = outcome(&batch, results);
            outcome.unavailable_delay = outage_backoff(relay, &outcome);
            blocked.extend(outcome.failed_keys.iter().cloned());
            let dead = beside(store.record(&outcome), &mut out, &mut back).await?;
            drained.retry_in = min_retry(drained.retry_in, recorded(relay, &outcome, dead));
        }
        let claiming = !backlog && !*shutdown.borrow() && Instant::now() < prefetch_until;
        let room = claiming && out.len() < most;
        // How long until the next look; set by the claim (unused without room for one).
        let mut wait = LIVE_POLL_MIN;
        if room {
            let (mut rows, retrying) = beside(
                claim_next(store, after, blocked_loaded),
                &mut out,
                &mut back,
            )
            .await?;
            if let Some(keys) = retrying {
                blocked.extend(keys);
                blocked_loaded = true;
            }
            // A full claim (rows or bytes) is a backlog: the pipelined drain takes over
            // once this is out.
            let bytes: usize = rows.iter().map(|r| r.payload.len()).sum();
            backlog =
                rows.len() >= relay.config.batch_size || bytes >= relay.config.max_batch_bytes;
            if let Some(cut) = rows
                .iter()
                .position(|r| r.partition_key.as_ref().is_some_and(|k| busy.contains(k)))
            {
                rows.truncate(cut);
            }
            if let Some(last) = rows.last() {
                after = Some(last.seq);
            }
            drained.claimed += rows.len();
            if *shutdown.borrow() {
                rows.clear(); // claimed but not sent: left for the next relay
            }
            // Not sent now: they wait in the table for the next drain.
            rows.retain(|r| {
                r.partition_key
                    .as_ref()
                    .is_none_or(|k| !blocked.contains(k))
            });
            if rows.is_empty() {
                wait = poll.next();
            } else {
                poll.reset();
                wait = LIVE_POLL_MIN;
                busy.extend(rows.iter().filter_map(|r| r.partition_key.clone()));
                out.push_back(send(rows));
                sent_at.push_back(Instant::now());
                back.extend(out.next().now_or_never().flatten());
                if !back.is_empty() {
                    continue;
                }
            }
        }
        if !back.is_empty() {
            continue; // came back while the database step ran: recorded first
        }
        if out.is_empty() {
            return Ok(drained);
        }
        // A batch back or, while there is room for another, the next look; a tenant
        // whose turn is over hands the batches out over instead of waiting on the
        // connection.
        let room = claiming && out.len() < most;
        let look = async {
            if room {
                tokio::time::sleep(wait).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        let oldest = sent_at.front().copied().unwrap_or_else(Instant::now);
        let over = async {
            match turn {
                Some(turn) => turn.ends(oldest).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            sent = out.next() => back.extend(sent),
            () = look => {}
            () = over => {
                drained.detached = Some(Detached {
                    out,
                    back: Vec::new(),
                });
                return Ok(drained);
            }
        }
    }
}

/// Awaits the database step `step` while the batches `out` go on: publish calls make
/// progress only while polled (a NATS chain sends its next message then, and
/// `publish_timeout` runs from the first poll), so they are polled beside it, and those
/// that finish wait in `back` in send order. On an error, every batch out is awaited
/// first, as the pipelined drain does, so no publish call is dropped half-way.
async fn beside<T, F, Fut>(
    step: F,
    out: &mut futures_util::stream::FuturesOrdered<Fut>,
    back: &mut std::collections::VecDeque<Sent>,
) -> SessionResult<T>
where
    F: std::future::Future<Output = SessionResult<T>>,
    Fut: std::future::Future<Output = Sent>,
{
    use futures_util::StreamExt;
    tokio::pin!(step);
    let result = loop {
        tokio::select! {
            result = &mut step => break result,
            Some(sent) = out.next(), if !out.is_empty() => back.push_back(sent),
        }
    };
    if result.is_err() {
        while let Some(sent) = out.next().await {
            back.push_back(sent);
        }
    }
    result
}

/// The batch after `after`, and the keys in retry unless they are loaded already.
async fn claim_next<S: Session>(
    store: &mut S,
    after: Option<i64>,
    blocked_loaded: bool,
) -> SessionResult<(Vec<OutboxRecord>, Option<Vec<String>>)> {
    let retrying = retrying_keys(store, blocked_loaded).await?;
    Ok((store.claim(after).await?, retrying))
}

/// The keys in retry, unless they are loaded already.
async fn retrying_keys<S: Session>(
    store: &mut S,
    loaded: bool,
) -> SessionResult<Option<Vec<String>>> {
    Ok(if loaded {
        None
    } else {
        Some(store.retrying_keys().await?)
    })
}

/// What a drain did: rows claimed, and when the earliest row it rescheduled may be due.
#[derive(Debug, Default)]
pub(crate) struct Drained<'r> {
    pub(crate) claimed: usize,
    /// The loop wakes then instead of waiting for its next probe.
    pub(crate) retry_in: Option<std::time::Duration>,
    /// A tenant's batches still with the publisher when its turn ended.
    pub(crate) detached: Option<Detached<'r>>,
}

fn min_retry(
    a: Option<std::time::Duration>,
    b: Option<std::time::Duration>,
) -> Option<std::time::Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The stats and logs of a batch whose outcome is written (its sent rows marked or
/// deleted, `dead` of its failed rows dead-lettered); returns when the earliest row it
/// rescheduled may be due.
fn recorded<P: Publisher, DB: Backend>(
    relay: &Relay<P, DB>,
    outcome: &Outcome,
    dead: u64,
) -> Option<std::time::Duration> {
    let stats = &relay.stats;
    if !outcome.sent.is_empty() {
        let n = outcome.sent.len() as u64;
        RelayStats::add(&stats.published, n);
        for (destination, n) in &outcome.sent_to {
            relay
                .counter_to("outbox_published_total", destination)
                .increment(*n);
        }
    }
    if outcome.failed.is_empty() {
        return None;
    }
    let failed = outcome.failed.len() as u64;
    RelayStats::add(&stats.failed, failed);
    RelayStats::add(&stats.dead, dead);
    // Per destination: the failures, and the dead letters as the database's rule decides
    // them (permanent, or the last attempt); the database's count is the truth, so when
    // it differs (a row gone meanwhile) its count goes to `other`.
    let mut by_destination: Vec<(&str, u64, u64)> = Vec::new();
    let max_attempts = relay.config.max_attempts;
    for failure in &outcome.failed {
        let last = !failure.unavailable
            && (failure.permanent || failure.attempts.saturating_add(1) >= max_attempts);
        match by_destination
            .iter_mut()
            .find(|(d, ..)| *d == failure.destination)
        {
            Some((_, failed, dead)) => {
                *failed += 1;
                *dead += u64::from(last);
            }
            None => by_destination.push((&failure.destination, 1, u64::from(last))),
        }
    }
    let foreseen: u64 = by_destination.iter().map(|(.., dead)| dead).sum();
    for (destination, failed, foreseen_dead) in &by_destination {
        relay
            .counter_to("outbox_failed_total", destination)
            .increment(*failed);
        if foreseen == dead {
            relay
                .counter_to("outbox_dead_lettered_total", destination)
                .increment(*foreseen_dead);
        }
    }
    if foreseen != dead {
        relay
            .counter_to("outbox_dead_lettered_total", super::OTHER)
            .increment(dead);
    }
    if dead > 0 {
        tracing::error!(
            count = dead,
            "outbox messages dead-lettered after their last attempt"
        );
    }
    // The earliest a rescheduled row can be due: the outage delay, or a message's
    // first backoff (-25% jitter); a later one is found by the next look.
    let broker = outcome.failed.iter().any(|f| f.unavailable);
    let own = outcome.failed.iter().any(|f| !f.unavailable);
    let first_backoff = relay.config.backoff_base.mul_f64(0.75);
    min_retry(
        broker.then_some(outcome.unavailable_delay),
        own.then_some(first_backoff),
    )
}

/// Hands `batch` to the publisher, bounded by `publish_timeout`; one result per message.
async fn publish<P: Publisher, DB: Backend>(
    relay: &Relay<P, DB>,
    batch: &[OutboxRecord],
) -> Vec<Result<(), PublishError>> {
    let config = &relay.config;
    RelayStats::add(&relay.stats.batches, 1);
    let started = std::time::Instant::now();
    let span = send_span(&relay.publisher, batch);
    let results = match tokio::time::timeout(
        config.publish_timeout,
        guarded(&relay.publisher, batch).instrument(span.clone()),
    )
    .await
    {
        Ok(Ok(results)) if results.len() == batch.len() => whole_batch_failures(results),
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
    if let Some(error) = results.iter().find_map(|r| r.as_ref().err()) {
        span.record("error.type", error.kind().as_str());
        span.record("otel.status_code", "ERROR");
    }
    relay
        .histogram("outbox_publish_latency_seconds")
        .record(started.elapsed().as_secs_f64());
    let now = chrono::Utc::now();
    // One histogram handle per destination of the batch (usually one).
    let mut in_outbox: Vec<(&str, metrics::Histogram)> = Vec::new();
    for (record, result) in batch.iter().zip(&results) {
        if result.is_ok() {
            let waited = (now - record.created_at)
                .num_microseconds()
                .unwrap_or(i64::MAX);
            let histogram = match in_outbox.iter().position(|(d, _)| *d == record.destination) {
                Some(i) => &in_outbox[i].1,
                None => {
                    let histogram =
                        relay.histogram_to("outbox_time_in_outbox_seconds", &record.destination);
                    in_outbox.push((&record.destination, histogram));
                    &in_outbox[in_outbox.len() - 1].1
                }
            };
            histogram.record(waited.max(0) as f64 / 1e6);
        }
    }
    results
}

/// The span of one publish call, named and attributed as the OpenTelemetry messaging
/// semantic conventions name a producer's send (`send {destination}`, or `send` when the
/// batch has several destinations), and linked to each message's trace (the
/// `opentelemetry` feature). `error.type` is recorded when a message fails.
fn send_span<P: Publisher>(publisher: &P, batch: &[OutboxRecord]) -> tracing::Span {
    let destination = batch
        .first()
        .map(|r| r.destination.as_str())
        .filter(|first| batch.iter().all(|r| r.destination == *first));
    let server = publisher.server();
    let span = tracing::info_span!(
        "outbox.publish",
        otel.name = %destination.map_or_else(|| "send".to_owned(), |d| format!("send {d}")),
        otel.kind = "producer",
        otel.status_code = tracing::field::Empty,
        messaging.system = publisher.messaging_system(),
        messaging.operation.type = "send",
        messaging.operation.name = "send",
        messaging.destination.name = destination,
        // For batches only (the conventions leave it out for one message).
        messaging.batch.message_count = (batch.len() > 1).then_some(batch.len()),
        server.address = server.map(|(host, _)| host),
        server.port = server.and_then(|(_, port)| port),
        error.type = tracing::field::Empty,
    );
    for record in batch {
        crate::trace::link(&span, &record.headers);
    }
    span
}

/// `publisher.publish(batch)`, with a panic caught and returned as its message: a bug in
/// a publisher (or a message that trips one) must not end the relay, nor hold back the
/// other keys' messages.
async fn guarded<P: Publisher>(
    publisher: &P,
    batch: &[OutboxRecord],
) -> Result<Vec<Result<(), PublishError>>, String> {
    // `publish` is called inside the guarded future: a publisher whose `publish` is a
    // plain `fn` returning a future may panic before the future exists.
    std::panic::AssertUnwindSafe(async move { publisher.publish(batch).await })
        .catch_unwind()
        .await
        .map_err(|panic| crate::task::panic_message(panic.as_ref()))
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
        if result.is_err()
            && let Some(key) = key
        {
            failed_keys.insert(key);
        }
        results.push(result);
    }
    results
}

fn wrong_count() -> PublishError {
    PublishError::retryable("publisher returned the wrong number of results")
}

/// The publisher did not answer in time: that says nothing about the messages.
fn timed_out(after: std::time::Duration) -> PublishError {
    PublishError::unavailable(format!("publish timed out after {after:?}"))
}

/// A batch of several messages that all failed with the same retryable error failed
/// because of the broker, not because of each message (a missing permission, a broker
/// refusing everything): reported as unavailable, so it dead-letters nothing.
/// (Messages left unattempted behind a failure of their key are not counted.)
fn whole_batch_failures(
    mut results: Vec<Result<(), PublishError>>,
) -> Vec<Result<(), PublishError>> {
    let attempted = |r: &Result<(), PublishError>| !matches!(r, Err(e) if e.kind() == PublishErrorKind::NotAttempted);
    let mut tried = results.iter().filter(|r| attempted(r));
    let first = match tried.next() {
        Some(Err(e)) if e.kind() == PublishErrorKind::Retryable => e.clone(),
        _ => return results,
    };
    let mut others = 0;
    for r in tried {
        if r.as_ref().err() != Some(&first) {
            return results;
        }
        others += 1;
    }
    if others > 0 {
        let error = PublishError::unavailable(format!(
            "every message of the batch failed the same way: {}",
            crate::ErrorChain(&first)
        ));
        for r in results.iter_mut().filter(|r| attempted(r)) {
            *r = Err(error.clone());
        }
    }
    results
}

/// When rows that failed as unavailable are due again: the next delay of the relay's
/// [`outage_backoff_for`], one step for each batch in a row with such failures; a batch
/// that publishes without them ends the outage (and the backoff starts afresh). Logged
/// when an outage starts and ends, and exposed as `outbox_relay_broker_unavailable` (1
/// during an outage).
fn outage_backoff<P, DB: Backend>(relay: &Relay<P, DB>, outcome: &Outcome) -> std::time::Duration {
    let unavailable = outcome.failed.iter().filter(|f| f.unavailable).count() as u64;
    if unavailable == 0 {
        if !outcome.sent.is_empty() {
            let mut outage = lock_outage(relay);
            if outage.attempts() > 0 {
                outage.reset();
                drop(outage);
                tracing::info!("outbox relay: the broker is publishing again");
                relay.gauge("outbox_relay_broker_unavailable", 0.0);
                relay
                    .stats
                    .broker_unavailable
                    .store(false, std::sync::atomic::Ordering::Relaxed);
            }
        }
        return std::time::Duration::ZERO;
    }
    RelayStats::add(&relay.stats.unavailable, unavailable);
    relay
        .counter("outbox_publish_unavailable_total")
        .increment(unavailable);
    let (starts, delay) = {
        let mut outage = lock_outage(relay);
        (outage.attempts() == 0, outage.next())
    };
    if starts {
        tracing::warn!(
            messages = unavailable,
            "outbox relay: the broker is unavailable; retrying with backoff for as long as it \
             lasts (these failures do not count towards max_attempts)"
        );
        relay.gauge("outbox_relay_broker_unavailable", 1.0);
        relay
            .stats
            .broker_unavailable
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    delay
}

/// The relay's outage backoff (a panic elsewhere while it was held leaves it usable).
fn lock_outage<P, DB: Backend>(relay: &Relay<P, DB>) -> std::sync::MutexGuard<'_, Backoff> {
    relay
        .outage
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The outage backoff of a relay with `config`: `backoff_base` doubling, capped at
/// `backoff_cap` and at [`OUTAGE_CAP`], with ±25% jitter.
pub(super) fn outage_backoff_for(config: &crate::config::RelayConfig) -> Backoff {
    let cap = config.backoff_cap.min(OUTAGE_CAP);
    Backoff::new(config.backoff_base.min(cap), cap).with_jitter(0.25)
}

/// The longest wait between two tries during an outage: publishing resumes within about
/// this long of the broker's return, however long the outage lasted. Not longer: each try
/// costs the publisher its own timeouts, which pace the tries during the outage anyway.
const OUTAGE_CAP: std::time::Duration = std::time::Duration::from_secs(2);

/// What the publisher's `results` for `batch` come to.
fn outcome(batch: &[OutboxRecord], results: Vec<Result<(), PublishError>>) -> Outcome {
    let mut outcome = Outcome {
        sent: Vec::with_capacity(batch.len()),
        ..Outcome::default()
    };
    let mut settled = true;
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
                match outcome
                    .sent_to
                    .iter_mut()
                    .find(|(d, _)| *d == record.destination)
                {
                    Some((_, n)) => *n += 1,
                    None => outcome.sent_to.push((record.destination.clone(), 1)),
                }
            }
            Err(e) if e.kind() == PublishErrorKind::NotAttempted => {
                settled = false;
                // Left pending behind an earlier failure of its key.
                if let Some(key) = key {
                    outcome.failed_keys.insert(key.to_owned());
                }
            }
            Err(e) => {
                if let Some(key) = key {
                    outcome.failed_keys.insert(key.to_owned());
                }
                tracing::warn!(seq = record.seq, id = %record.id, error = %crate::ErrorChain(&e), "outbox message failed to publish");
                outcome.failed.push(Failure {
                    seq: record.seq,
                    attempts: record.attempts,
                    error: crate::ErrorChain(&e).to_string(),
                    destination: record.destination.clone(),
                    permanent: e.kind() == PublishErrorKind::Permanent,
                    unavailable: e.kind() == PublishErrorKind::Unavailable,
                });
            }
        }
        if settled {
            outcome.settled_through = Some(record.seq);
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: i64, key: &str) -> OutboxRecord {
        OutboxRecord {
            seq,
            id: uuid::Uuid::now_v7(),
            event_type: "T".into(),
            event_version: None,
            destination: "d".into(),
            partition_key: Some(key.into()),
            payload: "{}".into(),
            content_type: crate::publisher::headers::JSON.into(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    /// Publishing resumes within about two seconds of the broker's return, with the
    /// default settings, however long the outage lasted (`backoff_cap` is 5 min: an
    /// outage of an hour would otherwise wait minutes after the broker came back).
    #[test]
    fn the_outage_backoff_stays_short_with_the_defaults() {
        let config = crate::config::RelayConfig::default();
        let first = outage_backoff_for(&config).next();
        assert!(first >= std::time::Duration::from_millis(750), "{first:?}");
        let mut outage = outage_backoff_for(&config);
        for rounds in 0..100 {
            let delay = outage.next();
            assert!(
                delay <= std::time::Duration::from_millis(2500),
                "round {rounds}: {delay:?}"
            );
        }
    }

    /// `backoff_base` doubling up to `backoff_cap` and 2 s, ±25%; a `backoff_base` above
    /// 2 s waits 2 s from the first round.
    #[test]
    fn the_outage_backoff_doubles_from_backoff_base_up_to_its_cap() {
        let ms = std::time::Duration::from_millis;
        let within = |delay: std::time::Duration, base: u64| {
            assert!(
                delay >= ms(base * 3 / 4) && delay <= ms(base * 5 / 4),
                "{delay:?} is not {base} ms ± 25%"
            );
        };
        let mut config = crate::config::RelayConfig {
            backoff_base: ms(250),
            ..Default::default()
        };
        let mut outage = outage_backoff_for(&config);
        for base in [250, 500, 1000, 2000, 2000] {
            within(outage.next(), base);
        }
        config.backoff_cap = ms(600);
        let mut outage = outage_backoff_for(&config);
        for base in [250, 500, 600, 600] {
            within(outage.next(), base);
        }
        config.backoff_base = ms(5000);
        config.backoff_cap = ms(60_000);
        let mut outage = outage_backoff_for(&config);
        for base in [2000, 2000] {
            within(outage.next(), base);
        }
    }

    #[test]
    fn an_outcome_is_settled_up_to_the_first_unattempted_message() {
        let batch = [
            record(1, "a"),
            record(2, "b"),
            record(3, "b"),
            record(4, "a"),
        ];
        let all_done = outcome(
            &batch,
            vec![Ok(()), Err(PublishError::retryable("x")), Ok(()), Ok(())],
        );
        assert_eq!(all_done.sent, vec![1, 3, 4]);
        let failed: Vec<i64> = all_done.failed.iter().map(|f| f.seq).collect();
        assert_eq!(failed, vec![2]);
        assert_eq!(
            all_done.settled_through,
            Some(4),
            "a failure is settled too"
        );

        let left = outcome(
            &batch,
            vec![
                Ok(()),
                Err(PublishError::retryable("x")),
                Err(PublishError::not_attempted()),
                Ok(()),
            ],
        );
        assert_eq!(
            left.settled_through,
            Some(2),
            "3 was left behind its key's failure"
        );
        assert!(left.failed_keys.contains("b"));

        let none = outcome(&batch[..1], vec![Err(PublishError::not_attempted())]);
        assert_eq!(none.settled_through, None);
    }
}
