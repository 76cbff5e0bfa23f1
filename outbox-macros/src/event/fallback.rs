//! What the derive emits beside its errors: an impl whose methods are unreachable, so
//! code using the type as an event does not fail a second time with "`OutboxEvent` is
//! not implemented".

use proc_macro2::TokenStream;
use quote::quote;

use super::ast::{Data, Input};
use crate::attr::private_path;

pub(crate) fn stub(input: &Input<'_>) -> TokenStream {
    if let Data::Union(_) = input.data {
        return TokenStream::new();
    }
    let p = private_path(input.attrs.krate.as_ref().map(|k| &k.value));
    let ident = input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut where_clause = where_clause.cloned().unwrap_or_else(|| syn::WhereClause {
        where_token: Default::default(),
        predicates: Default::default(),
    });
    if input.generics.type_params().next().is_some() {
        where_clause
            .predicates
            .push(syn::parse_quote!(Self: #p::serde::Serialize));
    }
    // The type may be neither `Serialize` nor given its codec's `Encode` (the derive
    // failed): the bound under a binder is assumed here, so no second error.
    if input.generics.type_params().next().is_none() {
        where_clause
            .predicates
            .push(syn::parse_quote!(for<'__outbox> Self: #p::Encode));
    }
    quote! {
        #[automatically_derived]
        impl #impl_generics #p::OutboxEvent for #ident #ty_generics #where_clause {
            fn event_type(&self) -> &'static str {
                ::core::unreachable!("#[derive(OutboxEvent)] failed; see the compile errors")
            }
            fn destination(&self) -> #p::Destination {
                ::core::unreachable!("#[derive(OutboxEvent)] failed; see the compile errors")
            }
        }
    }
}
