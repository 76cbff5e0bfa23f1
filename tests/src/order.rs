//! Per-key order under network faults, for every broker: a writer of numbered rounds, a
//! schedule of stalls and resets through the [`Proxy`], the wait for the drain, and the
//! check of what a deduplicating consumer applied.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{Outbox, OutboxMessage, sqlx};

use crate::TestDb;
use crate::proxy::{Mode, Proxy};

/// Keys the writer uses: `key-0` ... `key-{KEYS-1}`.
pub const KEYS: usize = 12;

/// Commits, round after round until `stop`, one event per key to `destination` with the
/// round number as payload; returns how many rounds it committed.
pub fn spawn_rounds(
    outbox: Outbox,
    destination: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut rounds = 0usize;
        while !stop.load(Ordering::SeqCst) {
            let mut tx = outbox.begin().await.expect("begin");
            for k in 0..KEYS {
                tx.emit_message(
                    OutboxMessage::new("Tick", destination.as_str(), format!("{rounds}"))
                        .with_key(format!("key-{k}")),
                )
                .expect("emit");
            }
            tx.commit().await.expect("commit");
            rounds += 1;
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        rounds
    })
}

/// For each duration: 1.2 s of traffic, then a stall that long; every other stall ends
/// with a reset of every connection.
pub async fn stalls_and_resets(proxy: &Proxy, stalls_ms: &[u64]) {
    for (i, stall) in stalls_ms.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        proxy.set(Mode::Stall);
        tokio::time::sleep(Duration::from_millis(*stall)).await;
        if i % 2 == 1 {
            proxy.reset();
        }
        proxy.set(Mode::Forward);
    }
}

/// Waits until no row of the outbox is pending (after the faults); fails the test after
/// `timeout`, with
/// `state()` in the message.
pub async fn wait_drained(db: &TestDb, timeout: Duration, state: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    loop {
        let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE sent_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .expect("pending");
        if pending == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{pending} rows still pending after {timeout:?}; {}",
            state()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a consumer with an inbox applies from `(id, key, round)` copies in log order:
/// the first copy of each id. Returns the rounds applied per key and the duplicates.
pub fn applied<'a>(
    copies: impl IntoIterator<Item = (&'a str, &'a str, usize)>,
) -> (BTreeMap<String, Vec<usize>>, usize) {
    let mut seen = HashSet::new();
    let mut applied: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut duplicates = 0;
    for (id, key, round) in copies {
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        applied.entry(key.to_owned()).or_default().push(round);
    }
    (applied, duplicates)
}

/// Fails the test unless every key starts at round 0 and goes up one round at a time
/// (no event missing, none out of order).
pub fn assert_in_order(applied: &BTreeMap<String, Vec<usize>>) {
    let mut violations = Vec::new();
    for (key, rounds) in applied {
        assert_eq!(rounds.first(), Some(&0), "{key} starts at round 0");
        for pair in rounds.windows(2) {
            if pair[1] != pair[0] + 1 {
                violations.push(format!("{key}: {} after {}", pair[1], pair[0]));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "{} per-key order violations after dedup, first: {:?}",
        violations.len(),
        &violations[..violations.len().min(10)]
    );
}

/// Fails the test if a row was dead-lettered.
pub async fn assert_no_dead_letter(db: &TestDb) {
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .expect("dead");
    assert_eq!(dead, 0, "network faults dead-letter nothing");
}
