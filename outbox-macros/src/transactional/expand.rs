//! Code generation: the `<name>_in_tx` companion (the user's function, unchanged but for
//! its name) and `<name>`, which begins a transaction, calls the companion and commits
//! or rolls back.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{FnArg, GenericParam, Pat, PatIdent, ReturnType, Token};

use super::ast::{Args, Function};
use crate::attr::private_path;

pub(crate) fn function(args: &Args, function: &Function) -> TokenStream {
    let p = private_path(args.krate.as_ref());
    let item = &function.item;
    let sig = &item.sig;
    let vis = &item.vis;
    let name = &sig.ident;
    let companion = format_ident!("{}_in_tx", name.unraw(), span = name.span());
    let tx = &function.tx_params[0];
    let db = match &tx.db {
        Some(db) => quote!(#db),
        None => quote!(#p::DefaultBackend),
    };
    let receiver = function.receiver();

    // Documentation stays on the wrapper (the function callers see); every other
    // attribute (`cfg`, `allow`, `instrument`...) goes on both.
    let (docs, others): (Vec<_>, Vec<_>) =
        item.attrs.iter().partition(|a| a.path().is_ident("doc"));

    // The companion: the user's signature and body under the new name.
    let mut companion_sig = sig.clone();
    companion_sig.ident = companion.clone();
    let link = if receiver.is_some() {
        format!("Self::{}", name.unraw())
    } else {
        name.unraw().to_string()
    };
    let companion_doc = format!(
        " Like [`{name}`]({link}), inside a transaction the caller already has: no begin, no \
         commit. Call it from another transactional function (`{}(tx, ..)`) to join its transaction.",
        companion
    );
    let block = &item.block;
    let companion_fn = quote! {
        #(#others)*
        #[doc = #companion_doc]
        #vis #companion_sig #block
    };

    // The wrapper: the same signature without the transaction parameter, plus the
    // `outbox` handle parameter for free functions that do not name a handle.
    let mut wrapper_sig = sig.clone();
    let mut inputs: Punctuated<FnArg, Token![,]> = Punctuated::new();
    let mut call_args: Vec<TokenStream> = Vec::new();
    let handle = match &args.outbox {
        // Spanned on the expression, so a wrong type is reported there.
        Some(expr) => quote_spanned!(expr.span()=> &(#expr)),
        None => {
            let outbox = syn::Ident::new("outbox", Span::call_site());
            inputs.push(syn::parse_quote!(#outbox: &#p::Outbox<#db>));
            quote!(#outbox)
        }
    };
    let handle_local = syn::Ident::new("__outbox_handle", Span::mixed_site());
    let tx_local = syn::Ident::new("__outbox_tx", Span::mixed_site());
    for (i, arg) in sig.inputs.iter().enumerate() {
        match arg {
            FnArg::Receiver(r) => {
                let mut r = r.clone();
                if r.reference.is_none() {
                    // `mut self`: the wrapper only forwards it.
                    r.mutability = None;
                }
                let self_token = r.self_token;
                inputs.push(FnArg::Receiver(r));
                call_args.push(quote!(#self_token));
            }
            FnArg::Typed(_) if i == tx.index => call_args.push(quote!(&mut #tx_local)),
            FnArg::Typed(pt) => {
                let mut pt = pt.clone();
                let ident = match &*pt.pat {
                    Pat::Ident(pi) if pi.subpat.is_none() => pi.ident.clone(),
                    _ => syn::Ident::new(&format!("__outbox_arg{i}"), Span::mixed_site()),
                };
                pt.pat = Box::new(Pat::Ident(PatIdent {
                    attrs: Vec::new(),
                    by_ref: None,
                    mutability: None,
                    ident: ident.clone(),
                    subpat: None,
                }));
                inputs.push(FnArg::Typed(pt));
                call_args.push(quote!(#ident));
            }
        }
    }
    wrapper_sig.inputs = inputs;

    let turbofish_args: Vec<TokenStream> = sig
        .generics
        .params
        .iter()
        .filter_map(|g| match g {
            GenericParam::Type(t) => {
                let ident = &t.ident;
                Some(quote!(#ident))
            }
            GenericParam::Const(c) => {
                let ident = &c.ident;
                Some(quote!(#ident))
            }
            GenericParam::Lifetime(_) => None,
        })
        .collect();
    let turbofish = if turbofish_args.is_empty() {
        quote!()
    } else {
        quote!(::<#(#turbofish_args),*>)
    };
    let callee = if receiver.is_some() {
        quote!(Self::#companion #turbofish)
    } else {
        quote!(#companion #turbofish)
    };

    // Conversions of `outbox_core::Error` into the user's error type are spanned on the
    // return type: that is where a missing `From` impl is reported.
    let ret_span = match &sig.output {
        ReturnType::Type(_, ty) => ty.span(),
        ReturnType::Default => sig.ident.span(),
    };
    let result = syn::Ident::new("__outbox_result", Span::mixed_site());
    let value = syn::Ident::new("__outbox_value", Span::mixed_site());
    let error = syn::Ident::new("__outbox_error", Span::mixed_site());
    let begun = syn::Ident::new("__outbox_begun", Span::mixed_site());
    let begin = quote_spanned! {ret_span=>
        match #p::begin::<#db, _>(#handle_local).await {
            #p::Result::Ok(#begun) => #begun,
            #p::Result::Err(#error) => return #p::Result::Err(#error),
        }
    };
    let commit = quote_spanned! {ret_span=>
        match #p::commit::<#db, _>(#tx_local).await {
            #p::Result::Ok(()) => #p::Result::Ok(#value),
            #p::Result::Err(#error) => #p::Result::Err(#error),
        }
    };
    let wrapper_fn = quote! {
        #(#docs)*
        #(#others)*
        #vis #wrapper_sig {
            let #handle_local: &#p::Outbox<#db> = #handle;
            let mut #tx_local = #begin;
            let #result = #callee(#(#call_args),*).await;
            match #result {
                #p::Result::Ok(#value) => #commit,
                #p::Result::Err(#error) => {
                    // The body's error is what the caller gets; the events are dropped.
                    #p::rollback(#tx_local).await;
                    #p::Result::Err(#error)
                }
            }
        }
    };

    quote! {
        #wrapper_fn
        #companion_fn
    }
}
