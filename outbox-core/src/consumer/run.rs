//! The receive loop and per-key scheduling: messages of one key one after the other,
//! different keys at once, up to the concurrency.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::model::Beat;
use crate::store::Backend;
use crate::store::ops::ConsumerRows;
use crate::task::stopped;

use super::handle::{Shared, Step};
use super::{Delivery, Error, Transport};

/// Messages in one lane are handled in order: one lane per key, and one per message
/// without a key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Lane {
    Key(String),
    Unkeyed(u64),
}

/// The messages received and not yet handled, by lane.
struct Lanes<A> {
    /// Waiting messages of each lane that is running or ready.
    waiting: HashMap<Lane, VecDeque<Delivery<A>>>,
    /// Lanes with a waiting message and no running handler, oldest first.
    ready: VecDeque<Lane>,
    /// Lanes that are running or ready.
    busy: HashSet<Lane>,
    /// Messages received and not finished (waiting or running).
    held: usize,
    unkeyed: u64,
}

impl<A> Lanes<A> {
    fn new() -> Self {
        Lanes {
            waiting: HashMap::new(),
            ready: VecDeque::new(),
            busy: HashSet::new(),
            held: 0,
            unkeyed: 0,
        }
    }

    fn push(&mut self, delivery: Delivery<A>) {
        self.held += 1;
        let lane = match &delivery.key {
            Some(key) => Lane::Key(key.clone()),
            None => {
                self.unkeyed += 1;
                Lane::Unkeyed(self.unkeyed)
            }
        };
        self.waiting
            .entry(lane.clone())
            .or_default()
            .push_back(delivery);
        if self.busy.insert(lane.clone()) {
            self.ready.push_back(lane);
        }
    }

    /// The next message to start, from the lane that has waited longest.
    fn next(&mut self) -> Option<(Lane, Delivery<A>)> {
        let lane = self.ready.pop_front()?;
        let delivery = self
            .waiting
            .get_mut(&lane)
            .and_then(VecDeque::pop_front)
            .expect("a ready lane has a waiting message");
        Some((lane, delivery))
    }

    /// A lane's message finished: the lane is ready again if more wait in it.
    fn finished(&mut self, lane: Lane) {
        self.held -= 1;
        if self.waiting.get(&lane).is_some_and(|q| !q.is_empty()) {
            self.ready.push_back(lane);
        } else {
            self.waiting.remove(&lane);
            self.busy.remove(&lane);
        }
    }
}

pub(super) async fn run<T: Transport, DB: Backend>(
    shared: Arc<Shared<T, DB>>,
    concurrency: usize,
    max_in_flight: usize,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), Error> {
    tracing::info!(transport = T::NAME, inbox = ?shared.inbox, concurrency, max_in_flight,
        "outbox consumer started");
    let beating = Beating::start(Arc::clone(&shared));
    let mut lanes = Lanes::new();
    let mut running: JoinSet<(Lane, Result<Step, Error>)> = JoinSet::new();
    // When each running lane's message started, and where it came from.
    let mut started: HashMap<Lane, (Instant, String)> = HashMap::new();
    let mut progress = Instant::now();
    let mut stall_tick = tokio::time::interval(shared.stall_warning);
    stall_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    stall_tick.reset();
    // Messages waiting behind their key's running handler are kept alive too (the
    // running ones keep themselves alive).
    let keep_alive = shared.transport.keep_alive();
    let mut keep_alive_tick =
        tokio::time::interval(keep_alive.unwrap_or(Duration::from_secs(86_400)));
    keep_alive_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    keep_alive_tick.reset();
    let result = loop {
        while running.len() < concurrency {
            let Some((lane, delivery)) = lanes.next() else {
                break;
            };
            let shared = Arc::clone(&shared);
            let shutdown = shutdown.clone();
            started.insert(lane.clone(), (Instant::now(), delivery.origin.to_string()));
            running.spawn(async move {
                let outcome = shared.handle(&delivery, shutdown).await;
                (lane, outcome)
            });
        }
        tokio::select! {
            biased;
            _ = stopped(&mut shutdown) => break Ok(()),
            Some(joined) = running.join_next(), if !running.is_empty() => {
                let (lane, outcome) = match joined {
                    Ok(done) => done,
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    Err(e) => unreachable!("handler tasks are aborted only after the loop: {e}"),
                };
                started.remove(&lane);
                progress = Instant::now();
                match outcome {
                    Ok(Step::Done) => lanes.finished(lane),
                    Ok(Step::Interrupted) => break Ok(()),
                    Err(e) => break Err(e),
                }
            }
            _ = keep_alive_tick.tick(), if keep_alive.is_some() => {
                for delivery in lanes.waiting.values().flatten() {
                    shared.transport.working(delivery).await;
                }
            }
            _ = stall_tick.tick() => {
                if progress.elapsed() >= shared.stall_warning {
                    warn_stalled(&shared, &lanes, &started, progress).await;
                }
            }
            received = shared.transport.receive(), if lanes.held < max_in_flight => match received {
                Ok(delivery) => {
                    progress = Instant::now();
                    lanes.push(delivery);
                }
                // The transport's own error may name its connection: redacted.
                Err(source) => break Err(Error::Transport {
                    transport: T::NAME,
                    source: shared.transport.redact(&source.to_string()).into(),
                }),
            },
        }
    };
    let mut result = result;
    drop(started);
    match &result {
        // Messages in hand finish (a handler being retried sees the shutdown and stops
        // without acknowledging), so their acknowledgements are sent. An error among
        // them (a `Policy::Stop`, a failed dead-letter write) is the consumer's result.
        Ok(()) => {
            while let Some(joined) = running.join_next().await {
                match joined {
                    Ok((_, Err(e))) if result.is_ok() => result = Err(e),
                    Ok((_, Err(e))) => {
                        tracing::error!(transport = T::NAME, error = %crate::ErrorChain(&e), "outbox consumer: a handler failed while stopping")
                    }
                    Ok(_) => {}
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    Err(_) => {}
                }
            }
        }
        // Stopping on an error: the other handlers are dropped mid-way. Their
        // transactions roll back, and what they did not acknowledge comes again.
        Err(_) => running.shutdown().await,
    }
    drop(lanes);
    beating.stop().await;
    let stats = shared.stats.snapshot();
    match Arc::try_unwrap(shared) {
        Ok(shared) => shared.transport.close().await,
        Err(_) => tracing::warn!(
            transport = T::NAME,
            "outbox consumer: the transport is still in use and was not closed"
        ),
    }
    tracing::info!(transport = T::NAME, ?stats, "outbox consumer stopped");
    result
}

/// The heartbeat task of one `run`: stopped (its row deleted) at the end of a graceful
/// run; aborted if the run ends otherwise (a panic, a dropped `run` future), so that a
/// dead consumer does not go on looking alive, nor keep its transport open.
struct Beating {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Beating {
    fn start<T: Transport, DB: Backend>(shared: Arc<Shared<T, DB>>) -> Beating {
        let (stop, beats) = watch::channel(false);
        Beating {
            stop,
            task: Some(tokio::spawn(heartbeat(shared, beats))),
        }
    }

    /// Stops the heartbeat and waits for it to leave (delete its row).
    async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

impl Drop for Beating {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// Resolves when `stop` turns `true` or its sender is gone.
async fn ended(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// How long the transport may take to tell its lag.
const LAG_TIMEOUT: Duration = Duration::from_secs(10);

/// Writes the instance's heartbeat row every `shared.heartbeat` until `stop` turns
/// `true`, then deletes it (a graceful stop: the instance is gone, not dead). A database
/// or broker that does not answer delays a beat, never the consumer.
async fn heartbeat<T: Transport, DB: Backend>(
    shared: Arc<Shared<T, DB>>,
    stop: watch::Receiver<bool>,
) {
    let instance = uuid::Uuid::now_v7();
    let consumer = shared.inbox.consumer();
    let outbox = shared.inbox.outbox();
    let interval_ms = i64::try_from(shared.heartbeat.as_millis()).unwrap_or(i64::MAX);
    // The lag, asked of the transport in a loop of its own: a broker slower to answer
    // than the heartbeat interval (Kafka asks it for offsets) delays the lag, never the
    // heartbeat. -1: not known.
    let last_lag = std::sync::atomic::AtomicI64::new(-1);
    let ask_lag = async {
        let mut stop = stop.clone();
        let mut tick = tokio::time::interval(shared.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = ended(&mut stop) => break,
            }
            let lag = tokio::select! {
                lag = tokio::time::timeout(LAG_TIMEOUT, shared.transport.backlog()) => lag.ok().flatten(),
                _ = ended(&mut stop) => break,
            };
            let lag = lag.and_then(|l| i64::try_from(l).ok());
            // Unknown (no partitions held, the broker did not answer): NaN, not the last
            // value, which would go on counting partitions this instance no longer reads.
            metrics::gauge!("outbox_consumer_lag", "transport" => T::NAME, "consumer" => consumer.to_owned())
                .set(lag.map_or(f64::NAN, |lag| lag as f64));
            last_lag.store(lag.unwrap_or(-1), std::sync::atomic::Ordering::Relaxed);
        }
    };
    let beat = async {
        let mut stop = stop.clone();
        let mut tick = tokio::time::interval(shared.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut warned = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = ended(&mut stop) => break,
            }
            let stats = shared.stats.snapshot();
            let lag = last_lag.load(std::sync::atomic::Ordering::Relaxed);
            let beat = Beat {
                consumer,
                instance,
                transport: T::NAME,
                interval_ms,
                handled: i64::try_from(stats.handled).unwrap_or(i64::MAX),
                handler_errors: i64::try_from(stats.handler_errors).unwrap_or(i64::MAX),
                lag: (lag >= 0).then_some(lag),
            };
            let written = tokio::select! {
                written = DB::beat(outbox.pool(), outbox.tables(), beat) => written,
                _ = ended(&mut stop) => break,
            };
            match written {
                Ok(()) => warned = false,
                // Once per outage: the consumer itself goes on.
                Err(e) if !warned => {
                    warned = true;
                    let hint = if crate::error::is_schema_missing(&e) {
                        "; run the migrations (`outbox migrate`)"
                    } else {
                        ""
                    };
                    tracing::warn!(transport = T::NAME, %consumer, error = %crate::ErrorChain(&e),
                        "outbox consumer: could not write its heartbeat{hint}; status and doctor will show it as gone");
                }
                Err(_) => {}
            }
        }
    };
    tokio::join!(ask_lag, beat);
    let gone = ConsumerRows::Instance { consumer, instance };
    let left = tokio::time::timeout(
        Duration::from_secs(5),
        DB::clear_consumer_rows(outbox.pool(), outbox.tables(), gone),
    )
    .await;
    if !matches!(left, Ok(Ok(_))) {
        tracing::debug!(transport = T::NAME, %consumer, "outbox consumer: its heartbeat row stays (status shows it as gone once it is old)");
    }
}

/// Says what a consumer that made no progress for `stall_warning` waits for: messages in
/// hand that do not finish, or a broker that holds messages it does not deliver.
async fn warn_stalled<T: Transport, DB: Backend, A>(
    shared: &Shared<T, DB>,
    lanes: &Lanes<A>,
    started: &HashMap<Lane, (Instant, String)>,
    progress: Instant,
) {
    let idle = progress.elapsed();
    let transport = shared.transport.state();
    if lanes.held > 0 {
        let oldest = started
            .iter()
            .min_by_key(|(_, (at, _))| *at)
            .map(|(lane, (at, origin))| {
                let key = match lane {
                    Lane::Key(key) => format!("key {key:?}"),
                    Lane::Unkeyed(_) => "no key".to_owned(),
                };
                format!(
                    "{origin} ({key}), in its handler or acknowledgement for {:?}",
                    at.elapsed()
                )
            })
            .unwrap_or_else(|| "none running".to_owned());
        tracing::warn!(transport = T::NAME, inbox = ?shared.inbox, no_progress_for = ?idle,
            in_hand = lanes.held, running = started.len(), %oldest, state = %transport,
            "outbox consumer: no message finished while messages are in hand; waiting for the oldest running one");
        return;
    }
    match shared.transport.backlog().await {
        Some(waiting) if waiting > 0 => {
            tracing::warn!(transport = T::NAME, inbox = ?shared.inbox, no_progress_for = ?idle,
                waiting, state = %transport,
                "outbox consumer: nothing received while the broker holds messages for it; waiting for the transport");
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::Origin;

    fn delivery(key: Option<&str>, n: i64) -> Delivery<i64> {
        Delivery::new(
            Vec::new(),
            key.map(str::to_owned),
            Default::default(),
            Origin::new("t", None, Some(n)),
            n,
        )
    }

    #[test]
    fn a_key_waits_for_its_previous_message_and_other_keys_do_not() {
        let mut lanes = Lanes::new();
        lanes.push(delivery(Some("a"), 1));
        lanes.push(delivery(Some("a"), 2));
        lanes.push(delivery(Some("b"), 3));
        lanes.push(delivery(None, 4));
        lanes.push(delivery(None, 5));
        let (a, first) = lanes.next().expect("a");
        assert_eq!(first.token, 1);
        let (b, third) = lanes.next().expect("b");
        assert_eq!(third.token, 3);
        let (n4, fourth) = lanes.next().expect("unkeyed");
        assert_eq!(fourth.token, 4);
        let (n5, fifth) = lanes.next().expect("unkeyed, its own lane");
        assert_eq!(fifth.token, 5);
        assert!(lanes.next().is_none(), "a's second waits for its first");
        lanes.finished(b);
        assert!(lanes.next().is_none());
        lanes.finished(a);
        let (a, second) = lanes.next().expect("a again");
        assert_eq!(second.token, 2);
        for lane in [a, n4, n5] {
            lanes.finished(lane);
        }
        assert_eq!(lanes.held, 0);
        assert!(lanes.waiting.is_empty() && lanes.busy.is_empty() && lanes.ready.is_empty());
    }
}
