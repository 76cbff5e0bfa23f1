//! Checks of the annotated function: async, exactly one `&mut OutboxTx` parameter, a
//! `Result` return type, and a way to reach the `Outbox` handle.

use quote::ToTokens;
use syn::{FnArg, Pat, ReturnType, Type};

use super::ast::{Args, Function};
use crate::attr::Errors;

pub(crate) fn check(args: &Args, function: &Function, errors: &mut Errors) {
    let sig = &function.item.sig;
    let name = &sig.ident;

    if sig.asyncness.is_none() {
        errors.spanned(
            sig.fn_token,
            format_args!(
                "`#[transactional_outbox]` needs an `async fn`: the wrapper awaits the transaction's begin and commit; write `async fn {name}`"
            ),
        );
    }

    match function.tx_params.as_slice() {
        [] => {
            let at: &dyn ToTokens = if sig.inputs.is_empty() {
                name
            } else {
                &sig.inputs
            };
            errors.spanned(
                at,
                format_args!(
                    "`#[transactional_outbox]` runs the body in a transaction it passes as a parameter; add `tx: &mut OutboxTx<'_>` to `{name}` (or `&mut OutboxTx<'_, DB>` for a backend other than PostgreSQL)"
                ),
            );
        }
        [_, extra @ ..] => {
            for tx in extra {
                errors.spanned(
                    &sig.inputs[tx.index],
                    "a second `OutboxTx` parameter: a `#[transactional_outbox]` function runs in one transaction; keep one `tx: &mut OutboxTx<'_>` parameter",
                );
            }
        }
    }
    for tx in &function.tx_params {
        if !tx.by_mut_ref
            && let FnArg::Typed(pt) = &sig.inputs[tx.index]
        {
            errors.spanned(
                    &pt.ty,
                    "take the transaction as `&mut OutboxTx<'_>`: the wrapper keeps it to commit or roll back after the body returns",
                );
        }
    }

    match &sig.output {
        ReturnType::Default => errors.spanned(
            name,
            format_args!(
                "`{name}` returns nothing, but a `#[transactional_outbox]` function must return `Result<T, E>` (with `E: From<outbox::Error>`): `Ok` commits, `Err` rolls back; add `-> Result<(), YourError>`"
            ),
        ),
        ReturnType::Type(_, ty) if !is_result(ty) => errors.spanned(
            ty,
            format_args!(
                "a `#[transactional_outbox]` function must return `Result<T, E>` (with `E: From<outbox::Error>`): `Ok` commits, `Err` rolls back; `{}` is not a `Result` (an alias works if its name ends in `Result`)",
                ty.to_token_stream().to_string().replace(" < ", "<").replace(" >", ">")
            ),
        ),
        ReturnType::Type(..) => {}
    }

    if args.outbox.is_none() {
        if let Some(receiver) = function.receiver() {
            errors.spanned(
                receiver,
                "a method must say where its `Outbox` handle is: write `#[transactional_outbox(outbox = self.outbox)]` (any expression giving an `Outbox` or `&Outbox`)",
            );
        } else if let Some(clash) = sig.inputs.iter().find_map(|arg| match arg {
            FnArg::Typed(pt) => match &*pt.pat {
                Pat::Ident(pi) if pi.ident == "outbox" => Some(pi),
                _ => None,
            },
            FnArg::Receiver(_) => None,
        }) {
            errors.spanned(
                clash,
                format_args!(
                    "`{name}` gets a generated first parameter `outbox: &Outbox` for the handle to begin the transaction on, and this parameter has the same name; rename it, or pass the handle yourself with `#[transactional_outbox(outbox = <expression>)]`"
                ),
            );
        }
    }
}

/// `Result<..>` spelled with any path whose last segment ends in `Result`
/// (`std::result::Result`, `anyhow::Result`, `outbox_core::Result`, an `AppResult` alias).
fn is_result(ty: &Type) -> bool {
    match ty {
        Type::Path(tp) => tp
            .path
            .segments
            .last()
            .is_some_and(|s| s.ident.to_string().ends_with("Result")),
        Type::Group(g) => is_result(&g.elem),
        Type::Paren(p) => is_result(&p.elem),
        _ => false,
    }
}
