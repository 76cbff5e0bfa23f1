//! On error the item is emitted unchanged beside the errors, so the rest of the crate
//! still type-checks against it and the user sees only the macro's errors.

use proc_macro2::TokenStream;

use crate::attr::Errors;

pub(crate) fn item(errors: &Errors, item: TokenStream) -> TokenStream {
    let mut out = errors.to_compile_error();
    out.extend(item);
    out
}
