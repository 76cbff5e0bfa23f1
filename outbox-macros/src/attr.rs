//! Shared attribute plumbing: one duplicate-detecting setter and an error collector.

use proc_macro2::TokenStream;
use quote::ToTokens;

/// Collects every error so the user sees all mistakes at once.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(crate) fn spanned(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    pub(crate) fn extend(&mut self, other: Errors) {
        if let Some(e) = other.0 {
            self.push(e);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub(crate) fn to_compile_error(&self) -> TokenStream {
        self.0
            .as_ref()
            .map(syn::Error::to_compile_error)
            .unwrap_or_default()
    }
}

/// One attribute value, set at most once.
pub(crate) struct Attr<T> {
    name: &'static str,
    value: Option<T>,
}

impl<T> Attr<T> {
    pub(crate) fn none(name: &'static str) -> Self {
        Attr { name, value: None }
    }

    /// Sets the value; a second `key = ...` is an error on that key.
    pub(crate) fn set(&mut self, errors: &mut Errors, key: &syn::Path, value: T) {
        if self.value.is_some() {
            errors.spanned(
                key,
                format_args!(
                    "duplicate `{}`: keep only one `{} = ...`",
                    self.name, self.name
                ),
            );
        } else {
            self.value = Some(value);
        }
    }

    pub(crate) fn get(self) -> Option<T> {
        self.value
    }
}

/// The `crate = "..."` value: the path to `outbox_core` for users who renamed it.
pub(crate) fn parse_crate_path(lit: &syn::LitStr) -> syn::Result<syn::Path> {
    lit.parse_with(syn::Path::parse_mod_style).map_err(|_| {
        syn::Error::new_spanned(
            lit,
            format_args!(
                "`crate = {:?}` is not a path; write the name you gave outbox-core in Cargo.toml, e.g. `crate = \"outbox\"` or `crate = \"::my_outbox\"`",
                lit.value()
            ),
        )
    })
}

/// The path generated code reaches the runtime through.
pub(crate) fn private_path(krate: Option<&syn::Path>) -> TokenStream {
    match krate {
        Some(path) => quote::quote!(#path::__private),
        None => quote::quote!(::outbox_core::__private),
    }
}
