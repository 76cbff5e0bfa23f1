//! Configuring a consumer: handlers, policies, concurrency, and the checks of `build`.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::codec::{Decode, Decoder};
use crate::event::OutboxEvent;
use crate::inbox::Inbox;
use crate::store::Backend;

use super::dispatch::{Dispatch, Typed};
use super::handle::Shared;
use futures_util::future::BoxFuture;

use crate::tx::OutboxTx;

use super::{
    AsyncHandler, BoxError, Consumer, ConsumerStats, Error, Handler, Policy, Received, Transport,
};

/// Configures a [`Consumer`]; start with [`Consumer::builder`].
#[must_use = "a builder does nothing until it is built or spawned"]
pub struct ConsumerBuilder<
    T: Transport,
    #[cfg(feature = "postgres")] DB: Backend = sqlx::Postgres,
    #[cfg(not(feature = "postgres"))] DB: Backend,
> {
    transport: T,
    inbox: Inbox<DB>,
    handlers: HashMap<String, Arc<dyn Dispatch<DB>>>,
    errors: Vec<Error>,
    unknown: Policy,
    undecodable: Policy,
    retry_backoff: Backoff,
    handler_attempts: Option<(u32, Policy)>,
    concurrency: usize,
    max_in_flight: Option<usize>,
    stall_warning: Duration,
    heartbeat: Duration,
}

impl<T: Transport, DB: Backend> fmt::Debug for ConsumerBuilder<T, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("transport", &T::NAME)
            .field("inbox", &self.inbox)
            .field("event_types", &self.handlers.keys().collect::<Vec<_>>())
            .field("on_unknown_event_type", &self.unknown)
            .field("on_undecodable", &self.undecodable)
            .field("handler_attempts", &self.handler_attempts)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

/// The event type names the catalog lists for Rust type `T`.
fn catalog_names<T>() -> Vec<&'static str> {
    let full = std::any::type_name::<T>();
    let name = full.split('<').next().unwrap_or(full);
    crate::catalog()
        .into_iter()
        .filter(|e| e.rust_type == name)
        .map(|e| e.event_type)
        .collect()
}

impl<T: Transport, DB: Backend> ConsumerBuilder<T, DB> {
    pub(super) fn new(transport: T, inbox: Inbox<DB>) -> Self {
        ConsumerBuilder {
            transport,
            inbox,
            handlers: HashMap::new(),
            errors: Vec::new(),
            unknown: Policy::Skip,
            undecodable: Policy::Stop,
            retry_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(30)),
            handler_attempts: None,
            concurrency: 8,
            max_in_flight: None,
            stall_warning: Duration::from_secs(60),
            heartbeat: Duration::from_secs(10),
        }
    }

    /// Handles the event type(s) that `#[derive(OutboxEvent)]` registered for `E` (an
    /// enum: each variant's) with `handler`, which receives the inbox transaction and the
    /// decoded message, and returns a boxed future:
    ///
    /// `.on::<OrderConfirmed, _>(|tx, msg| Box::pin(async move { ...; Ok(()) }))`
    ///
    /// A type not in the event catalog is reported by [`build`](Self::build).
    pub fn on<E, F>(mut self, handler: F) -> Self
    where
        E: OutboxEvent + Decode + Send + 'static,
        F: Handler<DB, E>,
    {
        let names = catalog_names::<E>();
        if names.is_empty() {
            self.errors.push(Error::NotInCatalog {
                rust_type: std::any::type_name::<E>(),
            });
            return self;
        }
        let dispatch: Arc<dyn Dispatch<DB>> = Arc::new(Typed {
            handler,
            decoder: E::__outbox_decoder().unwrap_or_else(Decoder::of),
            _event: PhantomData::<fn() -> E>,
        });
        for name in names {
            self.add(name.to_owned(), Arc::clone(&dispatch));
        }
        self
    }

    /// Like [`on`](Self::on), with a handler written as an `async fn` of the inbox
    /// transaction and the decoded message (no `Box::pin`):
    ///
    /// ```no_run
    /// use outbox_core::OutboxTx;
    /// use outbox_core::consumer::{BoxError, Consumer, Received, Transport};
    /// use outbox_core::inbox::Inbox;
    /// # use outbox_core::OutboxEvent;
    /// # #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
    /// # #[outbox(destination = "orders", key = order_id)]
    /// # struct OrderPlaced { order_id: i64 }
    ///
    /// async fn invoice(tx: &mut OutboxTx<'static>, msg: Received<OrderPlaced>) -> Result<(), BoxError> {
    ///     sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
    ///         .bind(msg.event.order_id)
    ///         .execute(&mut **tx)
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// # fn demo(outbox: outbox_core::Outbox, transport: impl Transport) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = Consumer::builder(transport, Inbox::new(&outbox, "billing"))
    ///     .on_async::<OrderPlaced, _>(invoice)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    ///
    /// An async closure works too when its parameter types are written out
    /// (`async |tx: &mut OutboxTx<'static>, msg: Received<OrderPlaced>| { ... }`): Rust
    /// infers a closure's signature from a bound only for closures that return a boxed
    /// future, which is why [`on`](Self::on) takes those.
    pub fn on_async<E, F>(self, handler: F) -> Self
    where
        E: OutboxEvent + Decode + Send + 'static,
        F: AsyncHandler<DB, E>,
    {
        self.on::<E, _>(boxed(handler))
    }

    /// [`on_event_type`](Self::on_event_type) with an `async fn` handler (see
    /// [`on_async`](Self::on_async)).
    pub fn on_event_type_async<E, F>(self, event_type: impl Into<String>, handler: F) -> Self
    where
        E: Decode + Send + 'static,
        F: AsyncHandler<DB, E>,
    {
        self.on_event_type::<E, _>(event_type, boxed(handler))
    }

    /// Handles messages whose event type is `event_type`, with a payload that decodes
    /// to `E` (JSON for a `serde` type, see [`codec`](crate::codec); no `OutboxEvent`
    /// derive needed). `E`'s [`Decode`] decides; an Avro event type (`codec = avro`,
    /// whose serde derives make it JSON's `Decode`) is refused by
    /// [`build`](Self::build): register it with [`on`](Self::on).
    pub fn on_event_type<E, F>(mut self, event_type: impl Into<String>, handler: F) -> Self
    where
        E: Decode + Send + 'static,
        F: Handler<DB, E>,
    {
        let full = std::any::type_name::<E>();
        let name = full.split('<').next().unwrap_or(full);
        if let Some(e) = crate::catalog().into_iter().find(|e| {
            e.rust_type == name && crate::codec::is_media_type(e.content_type, crate::codec::AVRO)
        }) {
            self.errors.push(Error::CodecNeedsOn {
                rust_type: e.rust_type,
                content_type: e.content_type,
            });
        }
        let dispatch: Arc<dyn Dispatch<DB>> = Arc::new(Typed {
            handler,
            decoder: Decoder::of(),
            _event: PhantomData::<fn() -> E>,
        });
        self.add(event_type.into(), dispatch);
        self
    }

    fn add(&mut self, event_type: String, dispatch: Arc<dyn Dispatch<DB>>) {
        match self.handlers.entry(event_type) {
            Entry::Occupied(e) => self.errors.push(Error::DuplicateHandler(e.key().clone())),
            Entry::Vacant(e) => {
                e.insert(dispatch);
            }
        }
    }

    /// What to do with a message whose event type has no handler. Default [`Policy::Skip`].
    pub fn on_unknown_event_type(mut self, policy: Policy) -> Self {
        self.unknown = policy;
        self
    }

    /// What to do with a message that cannot be decoded: missing or bad `message-id` /
    /// `event-type` header, or a payload that does not deserialize into the handler's type.
    /// Default [`Policy::Stop`].
    pub fn on_undecodable(mut self, policy: Policy) -> Self {
        self.undecodable = policy;
        self
    }

    /// Backoff between retries of a failing handler: first delay and cap (default
    /// 100 ms, 30 s). A failing handler is retried in place until it succeeds or the
    /// consumer is shut down, so later messages of its key wait (per-key order is kept);
    /// other keys go on.
    pub fn retry_backoff(mut self, first: Duration, cap: Duration) -> Self {
        self.retry_backoff = Backoff::new(first, cap.max(first));
        self
    }

    /// Gives up on a message after its handler failed `attempts` times (at least 1) in
    /// a row, and applies `then` to it: [`Policy::DeadLetter`] (the usual choice),
    /// [`Policy::Stop`], or [`Policy::Skip`] (its effect is lost). Without this a failing
    /// handler is retried until it succeeds, holding back the later messages of its key.
    /// Database failures do not count: a database that is briefly down must not
    /// dead-letter messages.
    pub fn handler_attempts(mut self, attempts: u32, then: Policy) -> Self {
        self.handler_attempts = Some((attempts.max(1), then));
        self
    }

    setters! {
        /// How many keys are handled at once (default 8, at least 1). Each holds one
        /// database connection while its handler runs, so keep it below the pool's size.
        /// `1` handles every message one after the other, in the order received.
        concurrency(keys: usize) => keys.max(1);

        /// How many received messages may wait for their handler (default 32 ×
        /// concurrency). When a key's handler is retried for long, its later messages wait
        /// here; once the bound is reached the consumer stops receiving until something
        /// finishes.
        max_in_flight(messages: usize) => Some(messages.max(1));

        /// How long the consumer may make no progress while it has work before it says so
        /// in a warning (default 60 s): no message finished while messages are in hand (a
        /// handler or an acknowledgement that does not end), or nothing received while the
        /// broker reports messages waiting ([`Transport::backlog`]). The warning names
        /// what it waits for and the transport's [`state`](Transport::state), and is
        /// repeated every such period for as long as it lasts.
        stall_warning(after: Duration) => after.max(Duration::from_millis(100));

        /// How often the consumer writes its heartbeat to the database (default 10 s, at
        /// least 100 ms): what it handled, its handler errors, and the lag its transport
        /// reports ([`Transport::backlog`]), for `outbox status`, `outbox doctor` and the
        /// dashboard. An instance whose heartbeat is three intervals old is shown as gone.
        heartbeat(every: Duration) => every.max(Duration::from_millis(100));
    }

    /// Checks the configuration and creates the consumer.
    pub fn build(self) -> Result<Consumer<T, DB>, Error> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        if self.handlers.is_empty() {
            return Err(Error::NoHandlers);
        }
        let policies = [
            Some(self.unknown),
            Some(self.undecodable),
            self.handler_attempts.map(|(_, then)| then),
        ];
        if policies.contains(&Some(Policy::DeadLetter))
            && self.transport.dead_letter_destination().is_none()
        {
            return Err(Error::NoDeadLetterDestination { transport: T::NAME });
        }
        let max_in_flight = self
            .max_in_flight
            .unwrap_or(self.concurrency * 32)
            .max(self.concurrency);
        Ok(Consumer {
            inner: Arc::new(Shared {
                transport: self.transport,
                inbox: self.inbox,
                handlers: self.handlers,
                unknown: self.unknown,
                undecodable: self.undecodable,
                retry_backoff: self.retry_backoff,
                handler_attempts: self.handler_attempts,
                stall_warning: self.stall_warning,
                heartbeat: self.heartbeat,
                stats: Arc::new(ConsumerStats::default()),
                failing: Default::default(),
            }),
            concurrency: self.concurrency,
            max_in_flight,
        })
    }
}

/// An [`AsyncHandler`] as a [`Handler`]: its future, boxed.
fn boxed<DB: Backend, E, F: AsyncHandler<DB, E>>(handler: F) -> impl Handler<DB, E> {
    move |tx: &mut OutboxTx<'static, DB>, msg: Received<E>| -> BoxFuture<'_, Result<(), BoxError>> {
        Box::pin(handler(tx, msg))
    }
}
