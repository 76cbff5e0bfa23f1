//! [`Backoff`]: the one doubling delay of the workspace's retry and reconnect loops.
//!
//! The relay reconnecting to its database, a relay of many outboxes reconnecting a
//! database's hub or a tenant's session, the relay's outage backoff while the broker is
//! unavailable, a consumer retrying its handler, the broker crates reconnecting: each
//! waits with a [`Backoff`] of its own first delay and cap. (The retry of a failed
//! message is a schedule stored with the row, not a loop: `RelayConfig::backoff_base`
//! and `backoff_cap`, computed from its attempts.)

use std::time::Duration;

/// A delay that doubles after each failure up to a cap, with optional jitter, and starts
/// afresh with [`reset`](Self::reset) once things work again.
///
/// A value type: each loop keeps its own (it is `Copy`, so a configured one is a
/// template that every retry series starts from).
///
/// ```
/// use std::time::Duration;
/// use outbox_core::backoff::Backoff;
///
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
/// let delays: Vec<_> = (0..6).map(|_| backoff.next().as_millis()).collect();
/// assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
/// assert_eq!(backoff.attempts(), 6);
///
/// backoff.reset(); // connected again
/// assert_eq!(backoff.next(), Duration::from_millis(100));
///
/// // ±25%: each delay is somewhere from 75 to 125 ms, then from 150 to 250 ms, ...
/// let mut jittered =
///     Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).with_jitter(0.25);
/// let first = jittered.next();
/// assert!(first >= Duration::from_millis(75) && first <= Duration::from_millis(125));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    /// The next delay, before jitter.
    current: Duration,
    /// Each delay is scaled by a factor from `1 - jitter` to `1 + jitter`; 0 for none.
    jitter: f64,
    /// Delays handed out since the start or the last reset.
    attempts: u32,
}

impl Backoff {
    /// Waits `first`, then twice as long each time, never longer than `cap`.
    ///
    /// `cap` bounds the doubling: a `first` above it is still the first delay, and every
    /// later one is `cap`. Doubling saturates, so no cap is too large
    /// (`Duration::MAX` included).
    pub const fn new(first: Duration, cap: Duration) -> Self {
        Self {
            first,
            cap,
            current: first,
            jitter: 0.0,
            attempts: 0,
        }
    }

    /// Spreads each delay at random over `±fraction` of it (`0.25`: from 75% to 125%), so
    /// that many clients that failed together do not all retry together. The fraction is
    /// taken within `[0, 1]`; the doubling and the cap apply before the jitter.
    #[must_use]
    pub fn with_jitter(mut self, fraction: f64) -> Self {
        self.jitter = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        self
    }

    /// The delay to wait now; the next one is twice as long, up to the cap.
    #[allow(
        clippy::should_implement_trait,
        reason = "a backoff never runs out: an `Iterator` would hand out `Option`s that are always `Some`"
    )]
    pub fn next(&mut self) -> Duration {
        let delay = self.current;
        self.current = self.current.saturating_mul(2).min(self.cap);
        self.attempts = self.attempts.saturating_add(1);
        if self.jitter == 0.0 {
            delay
        } else {
            let factor = (1.0 - self.jitter) + crate::config::jitter() * (2.0 * self.jitter);
            Duration::try_from_secs_f64(delay.as_secs_f64() * factor).unwrap_or(Duration::MAX)
        }
    }

    /// Starts afresh: the next delay is the first one again.
    pub fn reset(&mut self) {
        self.current = self.first;
        self.attempts = 0;
    }

    /// Starts afresh if what just failed had worked for longer than `long`: a session
    /// that ran for a while before it failed is the first failure of a new series, not
    /// the next of the old one.
    pub fn reset_if_worked(&mut self, worked: Duration, long: Duration) {
        if worked > long {
            self.reset();
        }
    }

    /// How many delays [`next`](Self::next) has handed out since the start or the last
    /// [`reset`](Self::reset): the failures in a row.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn delays(backoff: &mut Backoff, n: usize) -> Vec<Duration> {
        (0..n).map(|_| backoff.next()).collect()
    }

    #[test]
    fn doubles_from_the_first_delay_up_to_the_cap() {
        let mut backoff = Backoff::new(50 * MS, 1000 * MS);
        assert_eq!(
            delays(&mut backoff, 8),
            [50, 100, 200, 400, 800, 1000, 1000, 1000].map(|n| n * MS)
        );
        assert_eq!(backoff.attempts(), 8);
    }

    #[test]
    fn a_first_delay_above_the_cap_is_kept_once() {
        // As the loops it replaced: `delay = (delay * 2).min(cap)` after a first wait.
        let mut backoff = Backoff::new(50 * MS, 10 * MS);
        assert_eq!(delays(&mut backoff, 3), [50 * MS, 10 * MS, 10 * MS]);
    }

    #[test]
    fn reset_starts_over() {
        let mut backoff = Backoff::new(MS, 32 * MS);
        delays(&mut backoff, 4);
        backoff.reset();
        assert_eq!(backoff.attempts(), 0);
        assert_eq!(delays(&mut backoff, 3), [MS, 2 * MS, 4 * MS]);
    }

    #[test]
    fn only_a_session_that_worked_long_enough_starts_over() {
        let long = Duration::from_secs(30);
        let mut backoff = Backoff::new(50 * MS, Duration::from_secs(5));
        delays(&mut backoff, 3);
        backoff.reset_if_worked(Duration::from_secs(30), long);
        assert_eq!(backoff.next(), 400 * MS, "not longer than `long`: goes on");
        backoff.reset_if_worked(Duration::from_secs(31), long);
        assert_eq!(backoff.next(), 50 * MS);
    }

    #[test]
    fn never_overflows() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::MAX);
        for _ in 0..200 {
            backoff.next();
        }
        assert_eq!(backoff.next(), Duration::MAX);
        let mut jittered = Backoff::new(Duration::MAX, Duration::MAX).with_jitter(1.0);
        for _ in 0..100 {
            jittered.next();
        }
        let mut zero = Backoff::new(Duration::ZERO, Duration::MAX);
        assert_eq!(delays(&mut zero, 3), [Duration::ZERO; 3]);
        let mut counted = Backoff::new(MS, MS);
        counted.attempts = u32::MAX;
        counted.next();
        assert_eq!(counted.attempts(), u32::MAX);
    }

    #[test]
    fn jitter_stays_within_its_fraction_of_each_delay() {
        let mut backoff = Backoff::new(1000 * MS, 4000 * MS).with_jitter(0.25);
        for _ in 0..200 {
            backoff.reset();
            for base in [1000, 2000, 4000, 4000] {
                let delay = backoff.next();
                let (low, high) = (base * 3 / 4 * MS, base * 5 / 4 * MS);
                assert!(
                    delay >= low && delay <= high,
                    "{delay:?} outside [{low:?}, {high:?}]"
                );
            }
        }
        // Not the same delay every time.
        let spread: std::collections::HashSet<Duration> = (0..50)
            .map(|_| Backoff::new(1000 * MS, 1000 * MS).with_jitter(0.25).next())
            .collect();
        assert!(spread.len() > 1);
    }

    #[test]
    fn the_jitter_fraction_is_taken_within_zero_and_one() {
        let mut none = Backoff::new(100 * MS, 100 * MS).with_jitter(-1.0);
        assert_eq!(none.next(), 100 * MS);
        let mut nan = Backoff::new(100 * MS, 100 * MS).with_jitter(f64::NAN);
        assert_eq!(nan.next(), 100 * MS);
        let mut all = Backoff::new(100 * MS, 100 * MS).with_jitter(7.0);
        for _ in 0..100 {
            assert!(all.next() <= 200 * MS);
        }
    }
}
