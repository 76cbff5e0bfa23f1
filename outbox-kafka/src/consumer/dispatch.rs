//! Decoding a payload into the call of its handler.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use outbox_core::{Backend, OutboxTx};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::Result;

use super::{BoxError, Received};

#[derive(Clone)]
pub(super) struct Meta {
    pub(super) id: Uuid,
    pub(super) event_type: String,
    pub(super) version: Option<i32>,
    pub(super) key: Option<String>,
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) offset: i64,
    pub(super) headers: BTreeMap<String, String>,
}

/// A decoded message, ready to be handled: calls the handler with the event, in the
/// inbox's transaction.
type Run<DB> = Box<
    dyn for<'t> FnOnce(&'t mut OutboxTx<'static, DB>) -> BoxFuture<'t, Result<(), BoxError>> + Send,
>;

/// A handler of one event type, its type erased: it decodes a payload into the call of
/// the handler (no `Any` to downcast).
pub(super) trait Dispatch<DB: Backend>: Send + Sync {
    fn decode(self: Arc<Self>, payload: &[u8], meta: Meta) -> Result<Run<DB>, serde_json::Error>;
}

pub(super) struct Typed<T, F> {
    pub(super) handler: F,
    pub(super) _event: PhantomData<fn() -> T>,
}

impl<DB: Backend, T, F> Dispatch<DB> for Typed<T, F>
where
    T: DeserializeOwned + Send + 'static,
    F: for<'t> Fn(
            &'t mut OutboxTx<'static, DB>,
            Received<T>,
        ) -> BoxFuture<'t, Result<(), BoxError>>
        + Send
        + Sync
        + 'static,
{
    fn decode(self: Arc<Self>, payload: &[u8], meta: Meta) -> Result<Run<DB>, serde_json::Error> {
        let received = Received {
            event: serde_json::from_slice::<T>(payload)?,
            id: meta.id,
            event_type: meta.event_type,
            version: meta.version,
            key: meta.key,
            topic: meta.topic,
            partition: meta.partition,
            offset: meta.offset,
            headers: meta.headers,
        };
        Ok(Box::new(move |tx| (self.handler)(tx, received)))
    }
}
