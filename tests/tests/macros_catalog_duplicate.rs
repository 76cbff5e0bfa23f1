//! `catalog::validate()` refuses two Rust types that claim one event type name on one
//! destination. A binary of its own, so the other test binaries' catalogs stay valid.

use outbox_core::{Error, OutboxEvent};
use serde::Serialize;

mod billing {
    #[derive(serde::Serialize, outbox_core::OutboxEvent)]
    #[outbox(destination = "shared.events", event_type = "AccountClosed")]
    pub struct AccountClosed {
        pub account: u64,
    }
}

mod crm {
    /// Another type, same name, same destination: consumers could not tell them apart.
    #[derive(serde::Serialize, outbox_core::OutboxEvent)]
    #[outbox(destination = "shared.events")]
    pub enum CustomerEvent {
        AccountClosed { customer: u64 },
        Other,
    }
}

/// Same name on another destination: not a conflict.
#[derive(Serialize, OutboxEvent)]
#[outbox(destination = "other.events")]
struct AccountClosed;

#[test]
fn validate_reports_the_duplicate_and_both_types() {
    let err = outbox_core::catalog::validate().expect_err("a deliberate duplicate");
    assert!(matches!(err, Error::Catalog(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("event type `AccountClosed` on destination `shared.events`"),
        "{msg}"
    );
    assert!(
        msg.contains("`macros_catalog_duplicate::billing::AccountClosed`"),
        "{msg}"
    );
    assert!(
        msg.contains("`macros_catalog_duplicate::crm::CustomerEvent::AccountClosed`"),
        "{msg}"
    );
    assert!(!msg.contains("other.events"), "no false conflict: {msg}");
    assert!(msg.contains("event_type = "), "says how to fix it: {msg}");
    let _ = (
        AccountClosed.event_type(),
        crm::CustomerEvent::Other.event_type(),
    );
    let _ = billing::AccountClosed { account: 1 }.event_type();
    let _ = crm::CustomerEvent::AccountClosed { customer: 1 }.event_type();
}

#[test]
fn the_catalog_still_lists_all_entries() {
    let names: Vec<(&str, &str)> = outbox_core::catalog()
        .iter()
        .map(|e| (e.destination.as_str(), e.event_type))
        .collect();
    assert_eq!(
        names,
        vec![
            ("other.events", "AccountClosed"),
            ("shared.events", "AccountClosed"),
            ("shared.events", "AccountClosed"),
            ("shared.events", "Other"),
        ]
    );
}
