//! Procedural macros of the outbox framework: `#[derive(OutboxEvent)]` and
//! `#[transactional_outbox]`.
//!
//! Use them through `outbox` (its default `macros` feature re-exports both); the
//! generated code names `::outbox::__private` and nothing else (or the name the caller's
//! `Cargo.toml` gave `outbox` or `outbox-rs-core`, or the `crate = "..."` path). Each macro is a
//! pipeline: `ast` parses the input into a model, `valid` checks it, `expand` writes the
//! code and `fallback` writes what is emitted beside the errors when the input is wrong.

mod attr;
mod event;
mod transactional;

use proc_macro::TokenStream;

/// Implements `outbox_core::OutboxEvent` and registers the type in the event catalog.
///
/// See `outbox_core::OutboxEvent` and [`docs/macros.md`](https://github.com/outbox-rs/outbox/blob/main/docs/macros.md) for the attributes.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    event::derive(&input).into()
}

/// Runs an `async fn` in an outbox transaction: begin, run, commit on `Ok`, roll back on
/// `Err` or panic. Also emits `<name>_in_tx`, which joins a transaction the caller owns.
///
/// See `outbox_core::transactional_outbox` and [`docs/macros.md`](https://github.com/outbox-rs/outbox/blob/main/docs/macros.md).
#[proc_macro_attribute]
pub fn transactional_outbox(args: TokenStream, item: TokenStream) -> TokenStream {
    transactional::expand(args.into(), item.into()).into()
}
