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

/// The `crate = "..."` value: the path to the runtime (`outbox`, or a crate that
/// re-exports it), for code the manifest lookup cannot see (a macro of your own).
pub(crate) fn parse_crate_path(lit: &syn::LitStr) -> syn::Result<syn::Path> {
    lit.parse_with(syn::Path::parse_mod_style).map_err(|_| {
        syn::Error::new_spanned(
            lit,
            format_args!(
                "`crate = {:?}` is not a path; write the path to the outbox crate, e.g. `crate = \"outbox\"` or `crate = \"::my_outbox\"`",
                lit.value()
            ),
        )
    })
}

/// The path generated code reaches the runtime through: `crate = "..."` when given, else
/// the crate the caller's `Cargo.toml` depends on, under the name it gave it there.
pub(crate) fn private_path(krate: Option<&syn::Path>) -> TokenStream {
    match krate {
        Some(path) => quote::quote!(#path::__private),
        None => {
            let root = proc_macro2::Ident::new(&runtime_crate(), proc_macro2::Span::call_site());
            quote::quote!(::#root::__private)
        }
    }
}

/// The packages that hold the runtime, as (package, library name): the `outbox` facade
/// first, then the core crate it re-exports.
const RUNTIME: [(&str, &str); 2] = [("outbox", "outbox"), ("outbox-rs-core", "outbox_core")];

/// The name the caller knows the runtime by. A dependency renamed in `Cargo.toml`
/// (`ob = { package = "outbox" }`) is known by its new name; one under its own name, and
/// the package's own tests and doctests, by its library name. Without either in the
/// manifest (it could not be read), `outbox`.
fn runtime_crate() -> String {
    for (package, lib) in RUNTIME {
        match proc_macro_crate::crate_name(package) {
            Ok(proc_macro_crate::FoundCrate::Name(name)) if name != package.replace('-', "_") => {
                return name;
            }
            Ok(_) => return lib.to_owned(),
            Err(_) => {}
        }
    }
    RUNTIME[0].1.to_owned()
}
