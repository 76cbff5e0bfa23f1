//! `catalog::validate()` refuses two Rust types that claim one event type name on one
//! destination, and one event type and version on two destinations, naming the types
//! and where they are declared. A binary of its own, so the other test binaries'
//! catalogs stay valid.

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

/// Same name on another destination, with a version of its own: not a conflict.
#[derive(Serialize, OutboxEvent)]
#[outbox(destination = "other.events", version = 2)]
struct AccountClosed;

mod audit {
    /// Same name and version (none) as `billing::AccountClosed`, on another destination:
    /// a consumer of both could not tell which is meant.
    #[derive(serde::Serialize, outbox_core::OutboxEvent)]
    #[outbox(destination = "audit.events", event_type = "AccountClosed")]
    pub struct Closed {
        pub account: u64,
    }
}

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
    // Each type with the place it is declared.
    let file = file!();
    for declaration in ["pub struct AccountClosed {", "pub enum CustomerEvent {"] {
        let line = 1 + include_str!("macros_catalog_duplicate.rs")
            .lines()
            .position(|l| l.trim() == declaration)
            .expect("declared in this file");
        assert!(
            msg.contains(&format!("({file}:{line})")),
            "{file}:{line} in {msg}"
        );
    }
    // One event type and version on two destinations.
    assert!(
        msg.contains("event type `AccountClosed` without a version is published to more than one destination: `audit.events` by `macros_catalog_duplicate::audit::Closed`"),
        "{msg}"
    );
    assert!(msg.contains("a version of its own"), "{msg}");
    assert!(msg.contains("event_type = "), "says how to fix it: {msg}");
    let _ = (
        AccountClosed.event_type(),
        crm::CustomerEvent::Other.event_type(),
    );
    let _ = billing::AccountClosed { account: 1 }.event_type();
    let _ = audit::Closed { account: 1 }.event_type();
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
            ("audit.events", "AccountClosed"),
            ("other.events", "AccountClosed"),
            ("shared.events", "AccountClosed"),
            ("shared.events", "AccountClosed"),
            ("shared.events", "Other"),
        ]
    );
}
