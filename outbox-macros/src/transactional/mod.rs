//! `#[transactional_outbox]`: parse (`ast`), check (`valid`), generate the wrapper and the
//! `_in_tx` companion (`expand`), or on error emit the errors beside the item unchanged
//! (not a function) or beside a best-effort wrapper and companion (`fallback`).

mod ast;
mod expand;
mod fallback;
mod valid;

use proc_macro2::TokenStream;

use crate::attr::Errors;

pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let args = ast::Args::parse(args, &mut errors);
    let Some(function) = ast::Function::parse(item.clone(), &mut errors) else {
        return fallback::item(&errors, item);
    };
    valid::check(&args, &function, &mut errors);
    if errors.is_empty() {
        expand::function(&args, &function)
    } else {
        fallback::function(&errors, &args, &function)
    }
}
