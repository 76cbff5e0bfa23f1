//! What the tenants of a hub (`tenants`) hand to one another between turns: connections
//! without their advisory locks, the notice that a tenant waits for one, and what a
//! tenant's session knows that outlives it. Apart from `tenants` so that the session
//! (`session`), which a tenant runs on a lease, need not name the hub.

use std::collections::HashMap;

use sqlx::{Executor, PgConnection};
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tokio::time::Instant;

/// The part of a hub its tenants' sessions reach through their [`Lease`].
#[derive(Default)]
pub(in crate::db::postgres) struct Handover {
    /// Connections handed back, with when.
    pub(in crate::db::postgres) idle: std::sync::Mutex<Vec<(PgConnection, Instant)>>,
    /// Notified when a tenant starts waiting for a connection: a tenant that waits for
    /// writers on a connection of the hub then looks at its turn.
    pub(in crate::db::postgres) asked: Notify,
    /// What a tenant's session knows that outlives it, by outbox (its table's oid).
    carried: std::sync::Mutex<HashMap<i32, Carried>>,
}

/// What a tenant's session hands to its next one: the publish horizon (its samples stay
/// valid: the writer lock is the server's, not the session's) and how long writers have
/// held it back.
#[derive(Debug, Default)]
pub(in crate::db::postgres) struct Carried {
    pub(in crate::db::postgres) horizon: super::horizon::Horizon,
    pub(in crate::db::postgres) held_since: Option<Instant>,
    pub(in crate::db::postgres) held_reported: bool,
    /// The partitions its log last said it holds: a tenant takes them again each turn
    /// (a connection handed back drops its locks), and says so only when they change.
    pub(in crate::db::postgres) reported_partitions: std::collections::BTreeSet<i32>,
}

/// A tenant's hold on one of the hub's connections, for one turn.
pub(in crate::db::postgres) struct Lease<'a> {
    hub: &'a Handover,
    _permit: OwnedSemaphorePermit,
}

impl<'a> Lease<'a> {
    /// A turn on a connection of the hub whose handover is `hub`, held by `permit`.
    pub(in crate::db::postgres) fn new(
        hub: &'a Handover,
        permit: OwnedSemaphorePermit,
    ) -> Lease<'a> {
        Lease {
            hub,
            _permit: permit,
        }
    }

    /// What the tenant's last session left for this one.
    pub(in crate::db::postgres) fn carried(&self, key: i32) -> Carried {
        self.hub
            .carried
            .lock()
            .ok()
            .and_then(|mut c| c.remove(&key))
            .unwrap_or_default()
    }

    /// The hub's notice that a tenant waits for a connection.
    pub(in crate::db::postgres) fn asked(&self) -> &Notify {
        &self.hub.asked
    }

    /// Gives the connection back: without its advisory locks, ready for another tenant.
    /// A connection that fails this is closed (the server then drops its locks). `carry`
    /// is kept for the tenant's next session.
    pub(in crate::db::postgres) async fn give_back(
        self,
        mut conn: PgConnection,
        key: i32,
        carry: Carried,
    ) {
        if let Ok(mut carried) = self.hub.carried.lock() {
            carried.insert(key, carry);
        }
        match conn.execute("SELECT pg_advisory_unlock_all()").await {
            Ok(_) => {
                if let Ok(mut idle) = self.hub.idle.lock() {
                    idle.push((conn, Instant::now()));
                }
            }
            Err(e) => {
                tracing::debug!(error = %crate::ErrorChain(&e), "outbox relay: closing a hub connection that failed");
            }
        }
    }
}
