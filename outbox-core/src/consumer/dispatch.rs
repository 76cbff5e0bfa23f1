//! Decoding a payload into the call of its handler.

use std::marker::PhantomData;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::codec::{CodecError, Decoder};
use crate::store::Backend;
use crate::tx::OutboxTx;

use super::{BoxError, Handler, Received};

/// A decoded message, ready to be handled: calls the handler with the event, in the
/// inbox's transaction.
pub(super) type Run<DB> = Box<
    dyn for<'t> FnOnce(&'t mut OutboxTx<'static, DB>) -> BoxFuture<'t, Result<(), BoxError>> + Send,
>;

/// A handler of one event type, its type erased: it decodes a payload into the call of
/// the handler (no `Any` to downcast).
pub(super) trait Dispatch<DB: Backend>: Send + Sync {
    /// Whether the handler's type reads a payload of `content_type`.
    fn reads(&self, content_type: &str) -> bool;
    /// What the handler's type reads (`JSON`, `Protobuf`, ...).
    fn format(&self) -> &'static str;
    fn decode(self: Arc<Self>, payload: &[u8], meta: Received<()>) -> Result<Run<DB>, CodecError>;
}

/// The handler `F` of events of type `T`, read by `decoder`.
pub(super) struct Typed<T, F> {
    pub(super) handler: F,
    pub(super) decoder: Decoder<T>,
    pub(super) _event: PhantomData<fn() -> T>,
}

impl<DB: Backend, T, F> Dispatch<DB> for Typed<T, F>
where
    T: Send + 'static,
    F: Handler<DB, T>,
{
    fn reads(&self, content_type: &str) -> bool {
        (self.decoder.reads)(content_type)
    }

    fn format(&self) -> &'static str {
        self.decoder.format
    }

    fn decode(self: Arc<Self>, payload: &[u8], meta: Received<()>) -> Result<Run<DB>, CodecError> {
        let received = Received {
            event: (self.decoder.decode)(payload)?,
            id: meta.id,
            event_type: meta.event_type,
            version: meta.version,
            key: meta.key,
            origin: meta.origin,
            headers: meta.headers,
        };
        Ok(Box::new(move |tx| (self.handler)(tx, received)))
    }
}
