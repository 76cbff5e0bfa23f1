//! The derive's input as a model: the type, its fields and the `#[outbox(...)]` attributes
//! found on the type, its variants and its fields.

use syn::parse::ParseStream;
use syn::{Attribute, Expr, Fields, Generics, Ident, LitInt, LitStr, Member, Path, Token};

use super::serde_names;
use crate::attr::{Attr, Errors, parse_crate_path};

pub(crate) const VALID_KEYS: &str = "`destination = ...`, `key = field`, `event_type = \"...\"`, `version = N`, `codec = json|protobuf|avro|bytes`, `content_type = \"...\"` or `crate = \"...\"`";

pub(crate) struct Input<'a> {
    pub ident: &'a Ident,
    pub generics: &'a Generics,
    pub attrs: Attrs,
    pub data: Data<'a>,
    /// serde's `rename_all` on the type (for a struct's key field).
    pub serde_rename_all: Option<String>,
    /// serde's `rename_all_fields` on an enum (for a variant's key field).
    pub serde_rename_all_fields: Option<String>,
}

pub(crate) enum Data<'a> {
    Struct(&'a Fields),
    Enum(Vec<Variant<'a>>),
    Union(&'a syn::token::Union),
}

pub(crate) struct Variant<'a> {
    pub ident: &'a Ident,
    pub fields: &'a Fields,
    pub attrs: Attrs,
    /// serde's `rename_all` on the variant (for its key field).
    pub serde_rename_all: Option<String>,
}

/// A value with the key it was written under (`destination`, `key`...), for errors
/// about where a key may appear.
pub(crate) struct Keyed<T> {
    pub key: Path,
    pub value: T,
}

pub(crate) enum Destination {
    /// `destination = "orders.events"`
    Literal(LitStr),
    /// `destination = ORDER_EVENTS`: a `Destination` constant.
    Path(syn::ExprPath),
    /// Something else, already reported: only stops "missing destination" errors.
    Invalid,
}

/// How the event's payload is encoded (`codec = ...`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Codec {
    /// serde_json, the default.
    Json,
    /// prost.
    Protobuf,
    /// The type's bytes (`AsRef<[u8]>`).
    Bytes,
    /// apache-avro's serde support, single-object encoding.
    Avro,
}

#[derive(Default)]
pub(crate) struct Attrs {
    pub codec: Option<Keyed<Codec>>,
    pub content_type: Option<Keyed<LitStr>>,
    pub destination: Option<Keyed<Destination>>,
    pub key: Option<Keyed<Member>>,
    pub event_type: Option<Keyed<LitStr>>,
    pub version: Option<Keyed<(LitInt, i32)>>,
    pub krate: Option<Keyed<Path>>,
}

impl<'a> Input<'a> {
    pub(crate) fn from_syn(input: &'a syn::DeriveInput, errors: &mut Errors) -> Self {
        let data = match &input.data {
            syn::Data::Struct(s) => {
                collect_field_attrs(&s.fields, errors);
                Data::Struct(&s.fields)
            }
            syn::Data::Enum(e) => Data::Enum(
                e.variants
                    .iter()
                    .map(|v| {
                        collect_field_attrs(&v.fields, errors);
                        Variant {
                            ident: &v.ident,
                            fields: &v.fields,
                            attrs: Attrs::from_syn(&v.attrs, errors),
                            serde_rename_all: serde_names::rename_all(&v.attrs),
                        }
                    })
                    .collect(),
            ),
            syn::Data::Union(u) => Data::Union(&u.union_token),
        };
        Input {
            ident: &input.ident,
            generics: &input.generics,
            attrs: Attrs::from_syn(&input.attrs, errors),
            data,
            serde_rename_all: serde_names::rename_all(&input.attrs),
            serde_rename_all_fields: serde_names::rename_all_fields(&input.attrs),
        }
    }
}

/// `#[outbox]` on a field is an error: the key is named on the type.
fn collect_field_attrs(fields: &Fields, errors: &mut Errors) {
    for field in fields {
        for attr in field.attrs.iter().filter(|a| a.path().is_ident("outbox")) {
            let hint = match &field.ident {
                Some(name) => format!("#[outbox(key = {name})]"),
                None => "#[outbox(key = 0)]".to_owned(),
            };
            errors.spanned(
                attr,
                format_args!(
                    "`#[outbox(...)]` is not supported on fields; to make this field the partition key, write `{hint}` on the type (or on the enum variant)"
                ),
            );
        }
    }
}

impl Attrs {
    fn from_syn(attrs: &[Attribute], errors: &mut Errors) -> Self {
        let mut destination = Attr::none("destination");
        let mut key = Attr::none("key");
        let mut event_type = Attr::none("event_type");
        let mut version = Attr::none("version");
        let mut krate = Attr::none("crate");
        let mut codec = Attr::none("codec");
        let mut content_type = Attr::none("content_type");
        for attr in attrs.iter().filter(|a| a.path().is_ident("outbox")) {
            let result = attr.parse_nested_meta(|meta| {
                let path = meta.path.clone();
                if meta.path.is_ident("destination") {
                    let expr: Expr = meta.value()?.parse()?;
                    match expr {
                        Expr::Lit(syn::ExprLit {
                            lit: syn::Lit::Str(lit),
                            ..
                        }) => destination.set(errors, &path, keyed(&path, Destination::Literal(lit))),
                        Expr::Path(p) if p.qself.is_none() => {
                            destination.set(errors, &path, keyed(&path, Destination::Path(p)))
                        }
                        other => {
                            errors.spanned(
                                other,
                                "`destination` takes a string literal or a path to a `destinations!` constant: \
                                 `destination = \"orders.events\"` or `destination = ORDER_EVENTS`",
                            );
                            destination.set(errors, &path, keyed(&path, Destination::Invalid));
                        }
                    }
                } else if meta.path.is_ident("key") {
                    let value = meta.value()?;
                    let member = value.parse::<Member>().map_err(|e| {
                        syn::Error::new(
                            e.span(),
                            "`key` names a field: `key = order_id`, or `key = 0` for a tuple struct",
                        )
                    })?;
                    key.set(errors, &path, keyed(&path, member));
                } else if meta.path.is_ident("event_type") {
                    let lit = parse_lit_str(meta.value()?, "event_type", "`event_type = \"OrderConfirmed\"`")?;
                    event_type.set(errors, &path, keyed(&path, lit));
                } else if meta.path.is_ident("version") {
                    let value = meta.value()?;
                    let bad = |span| {
                        syn::Error::new(
                            span,
                            "`version` is the payload's schema version, a non-negative integer literal that fits in an i32: `version = 2`",
                        )
                    };
                    let lit: LitInt = value.parse().map_err(|e| bad(e.span()))?;
                    let n = lit.base10_parse::<i32>().map_err(|_| bad(lit.span()))?;
                    version.set(errors, &path, keyed(&path, (lit, n)));
                } else if meta.path.is_ident("codec") {
                    let value: syn::Ident = meta.value()?.parse().map_err(|e| {
                        syn::Error::new(e.span(), "`codec` is `json`, `protobuf`, `avro` or `bytes`: `codec = protobuf`")
                    })?;
                    let c = match value.to_string().as_str() {
                        "json" => Codec::Json,
                        "protobuf" => Codec::Protobuf,
                        "bytes" => Codec::Bytes,
                        "avro" => Codec::Avro,
                        other => {
                            return Err(syn::Error::new(
                                value.span(),
                                format_args!("unknown codec `{other}`; `codec` is `json` (the default), `protobuf` (a prost::Message), `avro` (an apache_avro::AvroSchema) or `bytes` (the type's bytes)"),
                            ));
                        }
                    };
                    codec.set(errors, &path, keyed(&path, c));
                } else if meta.path.is_ident("content_type") {
                    let lit = parse_lit_str(meta.value()?, "content_type", "`content_type = \"image/png\"`")?;
                    content_type.set(errors, &path, keyed(&path, lit));
                } else if meta.path.is_ident("crate") {
                    let lit = parse_lit_str(meta.value()?, "crate", "`crate = \"outbox\"`")?;
                    match parse_crate_path(&lit) {
                        Ok(p) => krate.set(errors, &path, keyed(&path, p)),
                        Err(e) => errors.push(e),
                    }
                } else {
                    errors.push(meta.error(format_args!(
                        "unknown key `{}` in `#[outbox(...)]`; expected {VALID_KEYS}",
                        quote::ToTokens::to_token_stream(&meta.path).to_string().replace(' ', "")
                    )));
                    skip_value(meta.input)?;
                }
                Ok(())
            });
            if let Err(e) = result {
                errors.push(e);
            }
        }
        Attrs {
            destination: destination.get(),
            key: key.get(),
            event_type: event_type.get(),
            version: version.get(),
            krate: krate.get(),
            codec: codec.get(),
            content_type: content_type.get(),
        }
    }
}

fn parse_lit_str(input: ParseStream<'_>, key: &str, example: &str) -> syn::Result<LitStr> {
    input.parse::<LitStr>().map_err(|e| {
        syn::Error::new(
            e.span(),
            format_args!("`{key}` takes a string literal: {example}"),
        )
    })
}

/// Skips `= value` or `(...)` after an unknown key so parsing goes on with the next one.
fn skip_value(input: ParseStream<'_>) -> syn::Result<()> {
    if input.peek(Token![=]) {
        input.parse::<Token![=]>()?;
        input.parse::<Expr>()?;
    } else if input.peek(syn::token::Paren) {
        let _group: proc_macro2::TokenTree = input.parse()?;
    }
    Ok(())
}

fn keyed<T>(key: &Path, value: T) -> Keyed<T> {
    Keyed {
        key: key.clone(),
        value,
    }
}
