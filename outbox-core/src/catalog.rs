//! The event catalog: every event type `#[derive(OutboxEvent)]` saw in this binary.
//!
//! Each derived type registers itself at link time (with [`inventory`]); nothing runs
//! at start-up. Use the catalog to check at start-up that no two Rust types claim the
//! same event type name on one destination ([`validate`]), to list the destinations a
//! publisher must be able to reach, or to print an event catalog.
//!
//! ```standalone_crate
//! use outbox_core::OutboxEvent;
//!
//! #[derive(serde::Serialize, OutboxEvent)]
//! #[outbox(destination = "orders.events", version = 2)]
//! struct OrderConfirmed { order_id: u64 }
//!
//! let info = outbox_core::catalog()
//!     .into_iter()
//!     .find(|e| e.event_type == "OrderConfirmed")
//!     .expect("registered by the derive");
//! assert_eq!(info.destination.as_str(), "orders.events");
//! assert_eq!(info.version, Some(2));
//! assert!(info.rust_type.ends_with("::OrderConfirmed"));
//! outbox_core::catalog::validate().expect("no duplicate event type names");
//! ```

use std::collections::BTreeMap;

use crate::{Destination, Error, Result};

/// One event type registered by `#[derive(OutboxEvent)]`. An enum registers one entry
/// per variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventInfo {
    /// The event type name consumers dispatch on.
    pub event_type: &'static str,
    /// Where the event is published.
    pub destination: Destination,
    /// The payload's schema version, if the event type is versioned.
    pub version: Option<i32>,
    /// The Rust type, with its module path (`my_app::orders::OrderConfirmed`). Generic
    /// types are named without their parameters.
    pub rust_type: &'static str,
    /// For an enum, the variant this event type is.
    pub variant: Option<&'static str>,
    /// The module the type is declared in.
    pub module_path: &'static str,
}

impl EventInfo {
    #[doc(hidden)]
    pub const fn __new(
        event_type: &'static str,
        destination: Destination,
        version: Option<i32>,
        rust_type: &'static str,
        variant: Option<&'static str>,
        module_path: &'static str,
    ) -> Self {
        EventInfo {
            event_type,
            destination,
            version,
            rust_type,
            variant,
            module_path,
        }
    }

    fn describe(&self) -> String {
        match self.variant {
            Some(v) => format!("`{}::{v}`", self.rust_type),
            None => format!("`{}`", self.rust_type),
        }
    }
}

inventory::collect!(EventInfo);

/// Every registered event type, sorted by destination, event type and Rust type.
pub fn entries() -> Vec<&'static EventInfo> {
    let mut all: Vec<&'static EventInfo> = inventory::iter::<EventInfo>.into_iter().collect();
    all.sort_by_key(|e| (e.destination, e.event_type, e.rust_type, e.variant));
    all
}

/// The destinations a publisher checks at start-up: `extra` and, with
/// `include_catalog`, every destination of the catalog; sorted, each once. Every broker
/// crate's start-up check starts from this list.
pub fn destinations_to_check(
    extra: impl IntoIterator<Item = String>,
    include_catalog: bool,
) -> Vec<String> {
    let mut wanted: Vec<String> = extra.into_iter().collect();
    if include_catalog {
        wanted.extend(entries().iter().map(|e| e.destination.as_str().to_owned()));
    }
    wanted.sort();
    wanted.dedup();
    wanted
}

/// Checks the catalog: two different Rust types (or enum variants) must not claim the
/// same event type name on the same destination, since consumers could not tell their
/// payloads apart. Call it once at start-up.
///
/// The error ([`Error::Catalog`]) lists every conflict with the types involved.
pub fn validate() -> Result<()> {
    let mut by_route: BTreeMap<(Destination, &'static str), Vec<&'static EventInfo>> =
        BTreeMap::new();
    for e in entries() {
        let claimants = by_route.entry((e.destination, e.event_type)).or_default();
        if !claimants
            .iter()
            .any(|c| c.rust_type == e.rust_type && c.variant == e.variant)
        {
            claimants.push(e);
        }
    }
    let conflicts: Vec<String> = by_route
        .into_iter()
        .filter(|(_, claimants)| claimants.len() > 1)
        .map(|((destination, event_type), claimants)| {
            let names: Vec<String> = claimants.iter().map(|c| c.describe()).collect();
            format!(
                "event type `{event_type}` on destination `{destination}` is claimed by {}",
                names.join(" and ")
            )
        })
        .collect();
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(Error::Catalog(conflicts.join("; ")))
    }
}
