//! Code a test runs inside the library, at one of its log events: to act at an exact
//! point of the relay's work (say, commit while a tenant parks), where waiting from
//! outside would be a race. The global subscriber of [`init_tracing`](crate::init_tracing)
//! hands every `outbox_core` event, trace level included, to the hooks installed.

use std::sync::{Arc, Mutex};

/// A hook: called with each event, on the thread that logs it (which waits for it).
type Hook = Arc<dyn Fn(&tracing::Event<'_>) + Send + Sync>;

static HOOKS: Mutex<Vec<(u64, Hook)>> = Mutex::new(Vec::new());
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Calls `hook` with every `outbox_core` event of this test binary (every test's: match
/// on something of your own test, such as a table name) until the guard is dropped.
pub fn on_event(hook: impl Fn(&tracing::Event<'_>) + Send + Sync + 'static) -> Installed {
    crate::init_tracing();
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    HOOKS.lock().expect("hooks").push((id, Arc::new(hook)));
    Installed(id)
}

/// Removes its hook when dropped.
#[derive(Debug)]
pub struct Installed(u64);

impl Drop for Installed {
    fn drop(&mut self) {
        if let Ok(mut hooks) = HOOKS.lock() {
            hooks.retain(|(id, _)| *id != self.0);
        }
    }
}

/// Installs the global subscriber, once: what `RUST_LOG` (as `target=level` pairs) or
/// else `log_filter` asks for, to the test's captured output, and every `outbox_core`
/// event, trace level included, to the hooks.
///
/// One filter for the whole stack (both wants), and the printing layer gated by its own
/// targets by hand: `tracing-subscriber`'s per-layer filters dropped some `outbox_core`
/// events from both layers here (a per-thread filter state that events evaluated inside
/// other events' fields disturb, tokio-rs/tracing#3364).
pub(crate) fn init(log_filter: &str) {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let printed: Targets = match std::env::var("RUST_LOG") {
        Ok(wanted) => wanted.parse().unwrap_or_else(|e| {
            eprintln!(
                "RUST_LOG={wanted:?} is not a list of target=level ({e}); logging {log_filter}"
            );
            log_filter.parse().expect("the tests' log filter parses")
        }),
        Err(_) => log_filter.parse().expect("the tests' log filter parses"),
    };
    // Either wants it: the hooks every `outbox_core` event, the printing layer its own.
    // (Not two `Targets` merged: the more specific directive wins there, so
    // `RUST_LOG=outbox_core::db=info` would hide the relay's trace events from the hooks.)
    let wanted = printed.clone();
    let either = tracing_subscriber::filter::filter_fn(move |meta| {
        meta.target().starts_with("outbox_core") || wanted.would_enable(meta.target(), meta.level())
    });
    let _ = tracing_subscriber::registry()
        .with(either)
        .with(Printed {
            targets: printed,
            fmt: tracing_subscriber::fmt::layer().with_test_writer(),
        })
        .with(Hooks)
        .try_init();
}

/// The printing layer, gated by its own targets (events only: spans pass, for context).
struct Printed<L> {
    targets: tracing_subscriber::filter::Targets,
    fmt: L,
}

impl<S, L> tracing_subscriber::Layer<S> for Printed<L>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    L: tracing_subscriber::Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.fmt.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.fmt.on_layer(subscriber);
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.fmt.on_new_span(attrs, id, cx);
    }

    fn on_record(
        &self,
        span: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.fmt.on_record(span, values, cx);
    }

    fn on_event(&self, event: &tracing::Event<'_>, cx: tracing_subscriber::layer::Context<'_, S>) {
        let meta = event.metadata();
        if self.targets.would_enable(meta.target(), meta.level()) {
            self.fmt.on_event(event, cx);
        }
    }

    fn on_enter(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.fmt.on_enter(id, cx);
    }

    fn on_exit(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.fmt.on_exit(id, cx);
    }

    fn on_close(&self, id: tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.fmt.on_close(id, cx);
    }
}

/// The layer that calls the hooks (outside the lock: a hook may log).
struct Hooks;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Hooks {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let hooks: Vec<Hook> = match HOOKS.lock() {
            Ok(hooks) if !hooks.is_empty() => hooks.iter().map(|(_, h)| Arc::clone(h)).collect(),
            _ => return,
        };
        for hook in hooks {
            hook(event);
        }
    }
}

/// An event's fields as text, by name (`message` included): what a hook matches on.
#[derive(Debug, Default)]
pub struct Fields(pub std::collections::HashMap<&'static str, String>);

impl Fields {
    /// The fields of `event`.
    pub fn of(event: &tracing::Event<'_>) -> Fields {
        let mut fields = Fields::default();
        event.record(&mut fields);
        fields
    }

    /// The field `name`, as text.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }
}
