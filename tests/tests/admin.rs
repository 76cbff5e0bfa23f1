//! Replay and release with a relay running: re-queued messages wake the relay at commit
//! and keep their `seq`, so they go out before the newer pending messages of their key.

use std::time::Duration;

use outbox_core::admin::{Admin, ListFilter};
use outbox_core::publisher::{InMemoryPublisher, PublishError};
use outbox_core::relay::Relay;
use outbox_core::{Outbox, OutboxMessage};
use outbox_tests::{TestDb, wait_until};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

async fn write(outbox: &Outbox, event_type: &str, key: &str) -> Uuid {
    let mut tx = outbox.begin().await.expect("begin");
    let id = tx
        .emit_message(OutboxMessage::new(event_type, "orders", "{}").with_key(key))
        .expect("emit");
    tx.commit().await.expect("commit");
    id
}

/// Waits until the relay has recorded everything it published (nothing pending).
async fn drained(admin: &Admin) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while admin.status().await.expect("status").pending > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never drained"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn relay(outbox: &Outbox, publisher: &InMemoryPublisher) -> outbox_core::RelayHandle {
    // A safety poll far beyond the test: only notifications can wake it in time.
    Relay::builder(outbox.clone(), publisher.clone())
        .poll_interval(Duration::from_secs(600))
        .spawn()
}

#[tokio::test]
async fn a_replayed_message_wakes_the_relay_and_goes_out_before_newer_pending_ones_of_its_key() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let admin = Admin::new(outbox.clone());
    let publisher = InMemoryPublisher::new();
    let first = write(&outbox, "First", "k").await;
    write(&outbox, "Second", "k").await;
    let running = relay(&outbox, &publisher);
    assert!(publisher.wait_for(2, WAIT).await, "both published");
    drained(&admin).await;
    running.shutdown().await;

    let third = write(&outbox, "Third", "k").await; // pending, newer
    assert_eq!(admin.replay(&[first]).await.expect("replay"), 1);
    let pending = admin.pending(&ListFilter::default()).await.expect("list");
    let ids: Vec<Uuid> = pending.iter().map(|m| m.id).collect();
    assert_eq!(
        ids,
        [first, third],
        "the replayed message is first in seq order"
    );

    publisher.clear();
    let running = relay(&outbox, &publisher);
    assert!(
        publisher.wait_for(2, WAIT).await,
        "replayed and new published"
    );
    let order: Vec<Uuid> = publisher.published().iter().map(|r| r.id).collect();
    assert_eq!(order, [first, third]);

    // Replaying again while the relay idles: the notification at commit wakes it.
    drained(&admin).await;
    publisher.clear();
    assert_eq!(admin.replay(&[third]).await.expect("replay"), 1);
    assert!(
        publisher.wait_for(1, Duration::from_secs(5)).await,
        "woken by the replay's notification, not the 10-minute poll"
    );
    assert_eq!(publisher.published()[0].id, third);
    running.shutdown().await;
    db.cleanup().await;
}

/// A dead letter parks the later messages of its key (the default,
/// `OnDeadLetter::ParkKey`): `outbox dead` says how many it holds back, and once released
/// it goes first, with fresh attempts, then they follow. (On main, `After` went out while
/// `Poison` was dead, and reached consumers before it once released.)
#[tokio::test]
async fn a_released_dead_letter_is_published_with_fresh_attempts() {
    let db = TestDb::new().await;
    let outbox = db.outbox().await;
    let admin = Admin::new(outbox.clone());
    let publisher = InMemoryPublisher::new();
    publisher.fail_when(
        |m| m.event_type == "Poison",
        None,
        PublishError::permanent("too large"),
    );
    let running = relay(&outbox, &publisher);
    let poison = write(&outbox, "Poison", "k").await;
    let after = write(&outbox, "After", "k").await;
    let other = write(&outbox, "Other", "other-key").await;
    assert!(publisher.wait_for(1, WAIT).await, "other keys flow");
    wait_until("the poison message is dead", WAIT, || async {
        admin.status().await.expect("status").dead == 1
    })
    .await;
    // `After` stays parked behind the dead letter, also when the relay looks again.
    let looked = running.stats().queries;
    write(&outbox, "Nudge", "third-key").await;
    assert!(publisher.wait_for(2, WAIT).await, "the relay looked again");
    assert!(running.stats().queries > looked);
    let published: Vec<_> = publisher.published().iter().map(|r| r.id).collect();
    assert!(
        published.contains(&other) && !published.contains(&after),
        "{published:?}"
    );
    // Once the relay recorded `Nudge`, only `After` is pending: parked.
    wait_until("only the parked message is pending", WAIT, || async {
        let status = admin.status().await.expect("status");
        (status.pending, status.dead, status.relays) == (1, 1, Some(1))
    })
    .await;
    let dead = admin.dead(&ListFilter::default()).await.expect("dead");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, poison);
    assert_eq!(dead[0].last_error.as_deref(), Some("too large"));
    assert_eq!(dead[0].attempts, 1);
    assert_eq!(dead[0].held_back, 1, "it holds back `After`");
    publisher.clear();

    publisher.clear_failures();
    assert_eq!(admin.release_key("k").await.expect("release"), 1);
    assert!(
        publisher.wait_for(2, Duration::from_secs(5)).await,
        "released and woken"
    );
    let published = publisher.published();
    assert_eq!(
        published.iter().map(|r| r.id).collect::<Vec<_>>(),
        [poison, after],
        "the released dead letter first, then the message it held back"
    );
    assert_eq!(published[0].attempts, 0, "attempts reset");
    assert!(
        admin
            .dead(&ListFilter::default())
            .await
            .expect("dead")
            .is_empty()
    );
    running.shutdown().await;
    db.cleanup().await;
}
