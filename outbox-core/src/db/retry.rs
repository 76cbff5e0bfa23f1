//! The retry rule every database applies to a failed message (PostgreSQL's table mode
//! computes the same rule in its failure statement).

/// Whether a message that failed after `attempts` earlier failures is dead-lettered now,
/// and otherwise the delay before its next attempt: `backoff_base * 2^attempts`, capped at
/// `backoff_cap`, with ±25% jitter. PostgreSQL computes the same rule in its failure
/// statement; MySQL/MariaDB and SQLite bind what this returns.
pub(crate) fn retry_plan(
    config: &crate::config::RelayConfig,
    attempts: i32,
    permanent: bool,
) -> (bool, f64) {
    let dead = permanent || attempts.saturating_add(1) >= config.max_attempts;
    let exp = 2f64.powi(attempts.clamp(0, 62));
    let delay = (config.backoff_base.as_secs_f64() * exp).min(config.backoff_cap.as_secs_f64());
    (dead, delay * (0.75 + crate::config::jitter() * 0.5))
}
