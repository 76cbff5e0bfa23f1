//! Which messages of a batch came back unroutable, whatever confirm lapin handed their
//! return to.
//!
//! Every message goes out `mandatory`: one that no queue takes comes back
//! (`basic.return`), and RabbitMQ sends the return before it confirms that message. But
//! lapin does not pair a return with its own message: it queues the returns it receives
//! and hands the oldest to the next confirm it resolves, and a `multiple` ack (RabbitMQ
//! coalesces confirms under load) resolves its confirms in hash-map order. A message's
//! return can so ride with the confirm of any message in flight, of any key, resolved
//! before or after its own.
//!
//! [`Returns`] pairs them by the id each message carries instead (`message_id`, the
//! outbox id), and tells a message's fate only once its return, if it has one, must have
//! been seen: at the first moment after its confirm came when every message published
//! so far has had its confirm seen. Why that is enough: a message's return comes before
//! its confirm, and lapin holds back at most as many returns as there are messages
//! whose return came and whose confirm has not resolved (each such confirm takes one
//! when it resolves). With every confirm resolved and seen, lapin holds no return, and
//! every return it handed out was seen with the confirm that carried it. A weaker wait,
//! for the messages published before the message's confirm came, is not enough: a
//! return still held when the last of them resolves may go to a message published
//! later. In a batch of many keys this makes the keys go in rounds: every key's message
//! in flight, then every fate at once when the last confirm comes.
//!
//! A key's next message goes out only after its message's fate is known
//! ([`publish_in_chains`](outbox_core::publisher::publish_in_chains)), so an unroutable
//! message is never reported sent while the rest of its key goes on.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The returns and confirms of one batch's messages. See the [module](self).
#[derive(Debug)]
pub(crate) struct Returns {
    state: Mutex<State>,
    /// Signalled at every confirm seen and every message lost.
    changed: Notify,
    /// No confirm of the batch comes later than this: its last message starts before the
    /// batch's deadline, and its confirm is awaited for at most `confirm_timeout`.
    until: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// The number given to the next message published.
    next: u64,
    /// Messages published whose confirm has not been seen yet.
    open: BTreeSet<u64>,
    /// How many times `open` became empty: a message whose confirm was seen at `settled
    /// == n` knows its fate once `settled > n`.
    settled: u64,
    /// A message whose confirm will never be seen (the link failed): a return it would
    /// have carried, or that lapin would have handed to it, is lost.
    lost: bool,
    /// Returns seen, by the `message_id` they carry: why the message came back.
    returned: HashMap<String, String>,
}

/// What became of one message, once known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fate {
    /// No return: the broker routed it.
    Routed,
    /// It came back unroutable, for this reason.
    Returned(String),
    /// Cannot be known: a confirm that could have carried its return was lost with the
    /// link, or did not come in time.
    Unknown,
}

/// One message published: report its confirm with [`Ticket::confirmed`]. Dropped
/// without it (the link failed), the message counts as lost.
#[derive(Debug)]
pub(crate) struct Ticket<'a> {
    returns: &'a Returns,
    number: u64,
    done: bool,
}

impl Returns {
    /// For a batch whose confirms all come by `until`.
    pub(crate) fn new(until: Instant) -> Returns {
        Returns {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            until,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A message is about to be published (call it before `basic_publish`).
    pub(crate) fn publishing(&self) -> Ticket<'_> {
        let mut state = self.lock();
        let number = state.next;
        state.next += 1;
        state.open.insert(number);
        Ticket {
            returns: self,
            number,
            done: false,
        }
    }

    /// Why the message with this id came back, if it did.
    pub(crate) fn returned(&self, id: &str) -> Option<String> {
        self.lock().returned.get(id).cloned()
    }

    /// Every return seen: `(message id, why)`.
    pub(crate) fn all_returned(&self) -> Vec<(String, String)> {
        self.lock()
            .returned
            .iter()
            .map(|(id, why)| (id.clone(), why.clone()))
            .collect()
    }
}

impl Ticket<'_> {
    /// The message's confirm came, carrying `carried` (a return, of this message or of
    /// any other: `(message id, why)`). Waits until the message's fate is known.
    pub(crate) async fn confirmed(mut self, carried: Option<(String, String)>, id: &str) -> Fate {
        self.done = true;
        let returns = self.returns;
        let seen_at = {
            let mut state = returns.lock();
            if let Some((carried_id, why)) = carried {
                state.returned.insert(carried_id, why);
            }
            let seen_at = state.settled;
            state.open.remove(&self.number);
            if state.open.is_empty() {
                state.settled += 1;
            }
            seen_at
        };
        returns.changed.notify_waiters();
        loop {
            let changed = returns.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let state = returns.lock();
                let returned = state.returned.get(id).cloned();
                if let Some(why) = returned {
                    // Seen: whatever comes later cannot undo it.
                    return Fate::Returned(why);
                }
                if state.lost {
                    return Fate::Unknown;
                }
                if state.settled > seen_at {
                    return Fate::Routed;
                }
            }
            if tokio::time::timeout_at(returns.until, changed)
                .await
                .is_err()
            {
                return match returns.returned(id) {
                    Some(why) => Fate::Returned(why),
                    None => Fate::Unknown,
                };
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        {
            let mut state = self.returns.lock();
            state.open.remove(&self.number);
            state.lost = true;
        }
        self.returns.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;

    use super::*;

    fn returned(id: &str) -> Option<(String, String)> {
        Some((id.to_owned(), format!("{id} came back")))
    }

    /// lapin hands a's return to b's confirm, and resolves a's first: a's fate waits for
    /// b's confirm, and is its return.
    #[tokio::test]
    async fn a_return_carried_by_a_later_confirm_is_the_fate_of_its_own_message() {
        let returns = Returns::new(Instant::now() + Duration::from_secs(5));
        let (a, b) = (returns.publishing(), returns.publishing());
        let a = a.confirmed(None, "a");
        tokio::pin!(a);
        assert!(
            a.as_mut().now_or_never().is_none(),
            "a waits for b's confirm"
        );
        assert_eq!(b.confirmed(returned("a"), "b").await, Fate::Routed);
        assert_eq!(a.await, Fate::Returned("a came back".to_owned()));
    }

    /// Alone in flight, a message knows its fate with its confirm.
    #[tokio::test]
    async fn a_message_alone_in_flight_knows_its_fate_at_once() {
        let returns = Returns::new(Instant::now() + Duration::from_secs(5));
        let a = returns.publishing();
        assert_eq!(a.confirmed(None, "a").await, Fate::Routed);
        let b = returns.publishing();
        assert_eq!(
            b.confirmed(returned("b"), "b").await,
            Fate::Returned("b came back".to_owned())
        );
    }

    /// a's confirm came while b was in flight, and c was published after it: lapin may
    /// still hold a's return when b's confirm resolves and hand it to c's. a's fate
    /// waits for c too.
    #[tokio::test]
    async fn a_return_handed_to_a_message_published_later_is_still_waited_for() {
        let returns = Returns::new(Instant::now() + Duration::from_secs(5));
        let (a, b) = (returns.publishing(), returns.publishing());
        let a = a.confirmed(None, "a");
        tokio::pin!(a);
        assert!(a.as_mut().now_or_never().is_none());
        let c = returns.publishing();
        let b = b.confirmed(None, "b");
        tokio::pin!(b);
        assert!(b.as_mut().now_or_never().is_none(), "c is in flight");
        assert!(
            a.as_mut().now_or_never().is_none(),
            "c may carry a's return"
        );
        assert_eq!(c.confirmed(returned("a"), "c").await, Fate::Routed);
        assert_eq!(a.await, Fate::Returned("a came back".to_owned()));
        assert_eq!(b.await, Fate::Routed);
    }

    /// The link failed under b before its confirm came: a return it would have carried is
    /// lost, so a's fate is unknown, not routed.
    #[tokio::test]
    async fn a_lost_confirm_makes_the_fates_it_could_hold_unknown() {
        let returns = Returns::new(Instant::now() + Duration::from_secs(5));
        let (a, b) = (returns.publishing(), returns.publishing());
        let a = a.confirmed(None, "a");
        tokio::pin!(a);
        assert!(a.as_mut().now_or_never().is_none());
        drop(b);
        assert_eq!(a.await, Fate::Unknown);
    }

    #[tokio::test]
    async fn a_confirm_that_never_comes_ends_the_wait_at_the_batch_end() {
        let returns = Returns::new(Instant::now() + Duration::from_millis(50));
        let (a, _b) = (returns.publishing(), returns.publishing());
        assert_eq!(a.confirmed(None, "a").await, Fate::Unknown);
    }
}
