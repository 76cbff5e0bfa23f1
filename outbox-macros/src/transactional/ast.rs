//! The attribute's arguments and the annotated function, as a model.

use proc_macro2::{Delimiter, Group, TokenStream};
use quote::ToTokens;
use syn::parse::{Parse, ParseStream, Parser};
use syn::{Attribute, Expr, FnArg, Path, Signature, Type, Visibility};

use crate::attr::{Attr, Errors, parse_crate_path};

pub(crate) const VALID_ARGS: &str = "`outbox = <expression>` (the `Outbox` handle to begin the transaction on, e.g. `outbox = self.outbox`) or `crate = \"...\"`";

/// `#[transactional_outbox(outbox = self.outbox, crate = "...")]`
pub(crate) struct Args {
    pub outbox: Option<Expr>,
    pub krate: Option<Path>,
}

impl Args {
    pub(crate) fn parse(tokens: TokenStream, errors: &mut Errors) -> Self {
        let mut outbox = Attr::none("outbox");
        let mut krate = Attr::none("crate");
        let mut local = Errors::default();
        let parser = syn::meta::parser(|meta| {
            let path = meta.path.clone();
            if meta.path.is_ident("outbox") {
                let expr: Expr = meta.value()?.parse()?;
                outbox.set(&mut local, &path, expr);
            } else if meta.path.is_ident("crate") {
                let lit: syn::LitStr = meta.value()?.parse().map_err(|e| {
                    syn::Error::new(
                        e.span(),
                        "`crate` takes a string literal: `crate = \"outbox\"`",
                    )
                })?;
                match parse_crate_path(&lit) {
                    Ok(p) => krate.set(&mut local, &path, p),
                    Err(e) => local.push(e),
                }
            } else {
                local.push(meta.error(format_args!(
                    "unknown argument `{}` for `#[transactional_outbox]`; expected {VALID_ARGS}",
                    meta.path.to_token_stream().to_string().replace(' ', "")
                )));
                if meta.input.peek(syn::Token![=]) {
                    meta.input.parse::<syn::Token![=]>()?;
                    meta.input.parse::<Expr>()?;
                } else if meta.input.peek(syn::token::Paren) {
                    meta.input.parse::<proc_macro2::TokenTree>()?;
                }
            }
            Ok(())
        });
        if let Err(e) = parser.parse2(tokens) {
            local.push(e);
        }
        errors.extend(local);
        Args {
            outbox: outbox.get(),
            krate: krate.get(),
        }
    }
}

/// A function with its body kept as tokens, as tokio's and tracing's attributes do: the
/// body is emitted as written, so a syntax error in it is rustc's own error, where it is.
pub(crate) struct RawFn {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub sig: Signature,
    pub block: Group,
}

impl Parse for RawFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis = input.parse()?;
        let sig = input.parse()?;
        let block: Group = input.parse()?;
        if block.delimiter() != Delimiter::Brace {
            return Err(syn::Error::new(
                block.span(),
                "expected the function's body",
            ));
        }
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the function"));
        }
        Ok(RawFn {
            attrs,
            vis,
            sig,
            block,
        })
    }
}

/// The annotated `async fn` (free function or method).
pub(crate) struct Function {
    pub item: RawFn,
    /// Parameters whose type mentions `OutboxTx`, by position in `sig.inputs`.
    pub tx_params: Vec<TxParam>,
}

pub(crate) struct TxParam {
    pub index: usize,
    /// Written as `&mut OutboxTx<...>`.
    pub by_mut_ref: bool,
    /// The backend named in `OutboxTx<'_, DB>`; `None` means the default (`outbox_core::DefaultBackend`).
    pub db: Option<Type>,
}

impl Function {
    /// `None` (with an error) when the item is not a function with a body.
    pub(crate) fn parse(tokens: TokenStream, errors: &mut Errors) -> Option<Self> {
        let item: RawFn = match syn::parse2(tokens.clone()) {
            Ok(item) => item,
            Err(_) => {
                not_a_function(tokens, errors);
                return None;
            }
        };
        let tx_params = item
            .sig
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(index, arg)| match arg {
                FnArg::Typed(pt) => tx_param(&pt.ty).map(|(by_mut_ref, db)| TxParam {
                    index,
                    by_mut_ref,
                    db,
                }),
                FnArg::Receiver(_) => None,
            })
            .collect();
        Some(Function { item, tx_params })
    }

    pub(crate) fn receiver(&self) -> Option<&syn::Receiver> {
        self.item.sig.receiver()
    }
}

/// `&mut OutboxTx<'_, DB>` → `(true, Some(DB))`; `OutboxTx<'_>` by value → `(false, None)`.
fn tx_param(ty: &Type) -> Option<(bool, Option<Type>)> {
    let (by_mut_ref, inner) = match ty {
        Type::Reference(r) => (r.mutability.is_some(), &*r.elem),
        other => (false, other),
    };
    let Type::Path(tp) = inner else { return None };
    let last = tp.path.segments.last()?;
    if last.ident != "OutboxTx" {
        return None;
    }
    let db = match &last.arguments {
        syn::PathArguments::AngleBracketed(args) => args.args.iter().find_map(|a| match a {
            syn::GenericArgument::Type(t) => Some(t.clone()),
            _ => None,
        }),
        _ => None,
    };
    Some((by_mut_ref, db))
}

fn not_a_function(tokens: TokenStream, errors: &mut Errors) {
    let what = match syn::parse2::<syn::Item>(tokens.clone()) {
        Ok(syn::Item::Struct(_)) => "a struct",
        Ok(syn::Item::Enum(_)) => "an enum",
        Ok(syn::Item::Impl(_)) => "an impl block (put it on the methods inside instead)",
        Ok(syn::Item::Trait(_)) => "a trait",
        Ok(syn::Item::Mod(_)) => "a module",
        Ok(syn::Item::Const(_)) | Ok(syn::Item::Static(_)) => "a constant or static",
        Ok(syn::Item::Type(_)) => "a type alias",
        Ok(syn::Item::Use(_)) => "a `use` declaration",
        Ok(_) => "an item that is not a function",
        Err(_) => match syn::parse2::<syn::TraitItemFn>(tokens.clone()) {
            Ok(_) => {
                "a function without a body (in a trait, put it on the implementation's method)"
            }
            Err(_) => "something that is not a function",
        },
    };
    let tokens = if tokens.is_empty() {
        quote::quote!(transactional_outbox)
    } else {
        tokens
    };
    errors.spanned(
        first_tokens(tokens),
        format_args!(
            "`#[transactional_outbox]` applies to an `async fn` that takes `tx: &mut OutboxTx<'_>` and returns `Result`; found {what}"
        ),
    );
}

/// The item's head (`pub struct Name`, without attributes or body), for a short error span.
fn first_tokens(tokens: TokenStream) -> TokenStream {
    use proc_macro2::TokenTree;
    let mut out = TokenStream::new();
    let mut iter = tokens.into_iter().peekable();
    let mut after_pub = false;
    while let Some(tt) = iter.next() {
        let is_pub = matches!(&tt, TokenTree::Ident(i) if i == "pub");
        match &tt {
            TokenTree::Group(_) if after_pub => out.extend(std::iter::once(tt)),
            // An outer attribute: `#` then `[...]`.
            TokenTree::Punct(p) if p.as_char() == '#' && out.is_empty() => {
                iter.next();
            }
            TokenTree::Group(_) if !out.is_empty() => break,
            TokenTree::Punct(p)
                if !out.is_empty() && matches!(p.as_char(), ';' | '<' | ':' | '=') =>
            {
                break;
            }
            _ => out.extend(std::iter::once(tt)),
        }
        after_pub = is_pub;
    }
    out
}
