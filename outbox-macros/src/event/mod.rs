//! `#[derive(OutboxEvent)]`: parse (`ast`), check (`valid`), generate (`expand`, with a
//! Protobuf event's `.proto` from `proto`), or on error emit the errors plus a stub impl
//! (`fallback`).

mod ast;
mod expand;
mod fallback;
mod proto;
mod serde_names;
mod valid;

use proc_macro2::TokenStream;

use crate::attr::Errors;

pub(crate) fn derive(input: &syn::DeriveInput) -> TokenStream {
    let mut errors = Errors::default();
    let model = ast::Input::from_syn(input, &mut errors);
    valid::check(&model, &mut errors);
    if errors.is_empty() {
        expand::derive(&model)
    } else {
        let mut out = errors.to_compile_error();
        out.extend(fallback::stub(&model));
        out
    }
}
