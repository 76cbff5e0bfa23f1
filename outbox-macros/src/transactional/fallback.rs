//! What is emitted beside the errors, so that the user sees only the macro's errors,
//! where the mistake is: the item unchanged when it is not a function; otherwise the
//! wrapper and its `_in_tx` companion with the signatures callers expect (async, the
//! transaction parameter removed from the wrapper, the generated `outbox` handle added)
//! and bodies that are never run, so callers type-check against them.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::ext::IdentExt;
use syn::punctuated::Punctuated;
use syn::{FnArg, Pat, Token};

use super::ast::{Args, Function};
use crate::attr::{Errors, private_path};

pub(crate) fn item(errors: &Errors, item: TokenStream) -> TokenStream {
    let mut out = errors.to_compile_error();
    out.extend(item);
    out
}

pub(crate) fn function(errors: &Errors, args: &Args, function: &Function) -> TokenStream {
    let p = private_path(args.krate.as_ref());
    let item = &function.item;
    let vis = &item.vis;
    let name = &item.sig.ident;
    let db = match function.tx_params.first().and_then(|tx| tx.db.as_ref()) {
        Some(db) => quote!(#db),
        None => quote!(#p::DefaultBackend),
    };
    let (docs, others): (Vec<_>, Vec<_>) =
        item.attrs.iter().partition(|a| a.path().is_ident("doc"));

    let mut wrapper = item.sig.clone();
    wrapper.asyncness = Some(Default::default());
    let mut inputs: Punctuated<FnArg, Token![,]> = Punctuated::new();
    let names_outbox = item.sig.inputs.iter().any(|arg| {
        matches!(arg, FnArg::Typed(pt) if matches!(&*pt.pat, Pat::Ident(pi) if pi.ident == "outbox"))
    });
    if args.outbox.is_none() && function.receiver().is_none() && !names_outbox {
        let outbox = syn::Ident::new("outbox", Span::call_site());
        inputs.push(syn::parse_quote!(#outbox: &#p::Outbox<#db>));
    }
    for (i, arg) in item.sig.inputs.iter().enumerate() {
        if !function.tx_params.iter().any(|tx| tx.index == i) {
            inputs.push(arg.clone());
        }
    }
    wrapper.inputs = inputs;

    let mut companion = item.sig.clone();
    companion.asyncness = Some(Default::default());
    companion.ident = format_ident!("{}_in_tx", name.unraw(), span = name.span());

    let errors = errors.to_compile_error();
    quote! {
        #errors
        #(#docs)*
        #(#others)*
        #[allow(unused_variables, unused_mut, clippy::all)]
        #vis #wrapper {
            ::core::unreachable!("`#[transactional_outbox]` reported an error on this function")
        }
        #(#others)*
        #[allow(unused_variables, unused_mut, clippy::all)]
        #vis #companion {
            ::core::unreachable!("`#[transactional_outbox]` reported an error on this function")
        }
    }
}
