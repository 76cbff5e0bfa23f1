//! The macros with the `outbox` dependency renamed to `ob`: found in the manifest, and
//! with `#[outbox(crate = "...")]` / `#[transactional_outbox(crate = "...")]`.

use ob::OutboxEvent;
use outbox_tests_renamed::{Renamed, RenamedEnum, emit_renamed, emit_renamed_by_hand};

#[test]
fn derived_metadata_through_a_renamed_crate() {
    let e = Renamed { n: -5 };
    assert_eq!(e.event_type(), "Renamed");
    assert_eq!(e.destination().as_str(), "renamed.events");
    assert_eq!(e.partition_key().as_deref(), Some("-5"));
    assert_eq!(e.version(), Some(4));
    assert_eq!(RenamedEnum::Only.event_type(), "Only");
    let catalog = ob::catalog();
    assert!(
        catalog
            .iter()
            .any(|i| i.rust_type == "outbox_tests_renamed::Renamed"),
        "{catalog:#?}"
    );
    ob::catalog::validate().expect("no duplicates");
}

#[tokio::test]
async fn transactional_through_a_renamed_crate() {
    let db = outbox_tests::TestDb::new().await;
    let outbox = db.outbox().await;
    emit_renamed(&outbox, 3).await.expect("commit");
    emit_renamed_by_hand(&outbox, 4).await.expect("commit");
    assert_eq!(db.count("outbox").await, 2);
    db.cleanup().await;
}
