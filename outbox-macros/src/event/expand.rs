//! Code generation for a checked model: the `OutboxEvent` impl and the catalog entries.

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Fields, Member, Type};

use super::ast::{Attrs, Codec, Data, Destination, Input, Variant};
use super::serde_names;
use crate::attr::private_path;

pub(crate) fn derive(input: &Input<'_>) -> TokenStream {
    let p = private_path(input.attrs.krate.as_ref().map(|k| &k.value));
    let ident = input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut where_clause = where_clause.cloned().unwrap_or_else(|| syn::WhereClause {
        where_token: Default::default(),
        predicates: Default::default(),
    });
    let generic = input.generics.type_params().next().is_some();
    let codec = input.attrs.codec.as_ref().map_or(Codec::Json, |c| c.value);
    let content_type = content_type(&p, &input.attrs, codec);
    // A type that is not `Serialize` is reported once, on the type, by the assertion
    // below; the bound under a binder keeps the impl itself from failing a second time
    // (with rustc's misleading "sealed trait" note) — uses of the type still need it.
    // Another codec: its own impls and assertion (non-generic types only: `valid`).
    let serialize = if codec == Codec::Avro {
        // An Avro type is `Serialize` (apache-avro writes through serde), so `Encode` is
        // JSON's blanket impl: the `OutboxEvent` impl below routes its payload through
        // `AvroEvent` instead, which holds only under the binder (one error, the
        // assertion's, for a type that is not an Avro record).
        where_clause
            .predicates
            .push(syn::parse_quote!(for<'__outbox_codec> Self: #p::Encode));
        where_clause
            .predicates
            .push(syn::parse_quote!(for<'__outbox_codec> Self: #p::AvroEvent));
        quote_spanned!(ident.span()=> const _: () = #p::assert_avro::<#ident>();)
    } else if codec != Codec::Json {
        // `Encode` holds only where the codec's own bound does (under a binder): the
        // impl below assumes it, so a type the codec cannot take is reported once.
        where_clause
            .predicates
            .push(syn::parse_quote!(for<'__outbox_codec> Self: #p::Encode));
        codec_impls(&p, ident, codec, &content_type)
    } else if !input.generics.params.is_empty() {
        where_clause
            .predicates
            .push(syn::parse_quote!(Self: #p::serde::Serialize));
        quote!()
    } else {
        where_clause
            .predicates
            .push(syn::parse_quote!(for<'__outbox> Self: #p::serde::Serialize));
        quote_spanned!(ident.span()=> const _: () = #p::assert_serialize::<#ident>();)
    };
    let destination = destination(&p, &input.attrs);
    let version = |attrs: &Attrs| match &attrs.version {
        Some(v) => {
            let n = v.value.1;
            quote!(#p::Option::Some(#n))
        }
        None => quote!(#p::Option::None),
    };

    let shared = Shared {
        p: &p,
        input,
        destination: &destination,
        content_type: &content_type,
    };
    let (event_type_body, key_body, version_body, registrations) = match &input.data {
        Data::Struct(fields) => {
            let name = event_type_name(&input.attrs, ident);
            let key = match &input.attrs.key {
                Some(k) => {
                    if generic {
                        push_key_bound(&mut where_clause, &p, fields, &k.value);
                    }
                    let conv = key_conversion(&p, &k.value);
                    let member = &k.value;
                    quote!(#conv(&self.#member))
                }
                None => quote!(#p::Option::None),
            };
            let v = version(&input.attrs);
            let key_field = input.attrs.key.as_ref().map(|k| {
                serde_names::field_name(fields, &k.value, input.serde_rename_all.as_deref())
            });
            let reg = register(&shared, &name, &v, None, key_field);
            (quote!(#name), key, v, reg)
        }
        Data::Enum(variants) => {
            let mut names = Vec::new();
            let mut keys = Vec::new();
            let mut versions = Vec::new();
            let mut regs = TokenStream::new();
            for v in variants {
                let vi = v.ident;
                let name = event_type_name(&v.attrs, vi);
                let ver = match &v.attrs.version {
                    Some(_) => version(&v.attrs),
                    None => version(&input.attrs),
                };
                names.push(quote!(Self::#vi { .. } => #name,));
                versions.push(quote!(Self::#vi { .. } => #ver,));
                keys.push(variant_key(&p, v, &input.attrs, generic, &mut where_clause));
                let rule = v
                    .serde_rename_all
                    .as_deref()
                    .or(input.serde_rename_all_fields.as_deref());
                let key_field = v
                    .attrs
                    .key
                    .as_ref()
                    .or(input.attrs.key.as_ref())
                    .map(|k| serde_names::field_name(v.fields, &k.value, rule));
                regs.extend(register(&shared, &name, &ver, Some(vi), key_field));
            }
            if variants.is_empty() {
                // An enum without variants has no values: `*self` is matched by nothing.
                let none = quote!(match *self {});
                (none.clone(), none.clone(), none, regs)
            } else {
                (
                    quote!(match self { #(#names)* }),
                    quote!(match self { #(#keys)* }),
                    quote!(match self { #(#versions)* }),
                    regs,
                )
            }
        }
        Data::Union(_) => unreachable!("rejected by valid::check"),
    };

    let codec_hooks = if codec == Codec::Avro {
        quote! {
            fn __outbox_content_type(&self) -> #p::Cow<'static, str> {
                #p::Cow::Borrowed(#p::AVRO)
            }
            fn __outbox_encode(&self) -> #p::Result<#p::Vec<u8>, #p::CodecError> {
                <Self as #p::AvroEvent>::__encode(self)
            }
            fn __outbox_decoder() -> #p::Option<#p::Decoder<Self>> {
                #p::Option::Some(<Self as #p::AvroEvent>::__decoder())
            }
        }
    } else {
        quote!()
    };
    quote! {
        #serialize
        #[automatically_derived]
        impl #impl_generics #p::OutboxEvent for #ident #ty_generics #where_clause {
            fn event_type(&self) -> &'static str {
                #event_type_body
            }
            fn destination(&self) -> #p::Destination {
                #destination
            }
            fn partition_key(&self) -> #p::Option<#p::String> {
                #key_body
            }
            fn version(&self) -> #p::Option<::core::primitive::i32> {
                #version_body
            }
            #codec_hooks
        }
        #registrations
    }
}

/// The content type the codec writes, as an expression of type `&'static str`.
fn content_type(p: &TokenStream, attrs: &Attrs, codec: Codec) -> TokenStream {
    match (codec, &attrs.content_type) {
        (Codec::Bytes, Some(lit)) => {
            let lit = &lit.value;
            quote!(#lit)
        }
        (Codec::Bytes, None) => quote!(#p::OCTET_STREAM),
        (Codec::Protobuf, _) => quote!(#p::PROTOBUF),
        (Codec::Avro, _) => quote!(#p::AVRO),
        (Codec::Json, _) => quote!(#p::JSON),
    }
}

/// `Encode` (for the type and for a reference to it) and `Decode` through the codec,
/// with the assertion that reports a type the codec cannot take, on the type.
fn codec_impls(
    p: &TokenStream,
    ident: &syn::Ident,
    codec: Codec,
    content_type: &TokenStream,
) -> TokenStream {
    let (assert, encode, decode, reads, format) = match codec {
        Codec::Protobuf => (
            quote_spanned!(ident.span()=> const _: () = #p::assert_protobuf::<#ident>();),
            quote!(#p::ProtobufEvent::__encode(self)),
            quote!(<#ident as #p::ProtobufEvent>::__decode(payload)),
            quote!(#p::protobuf::reads(content_type)),
            "Protobuf",
        ),
        Codec::Bytes => (
            quote!(),
            quote!(#p::bytes::encode(self)),
            quote!(#p::bytes::decode(payload)),
            quote!(content_type.split(';').next().unwrap_or_default().trim()
                .eq_ignore_ascii_case(#content_type.split(';').next().unwrap_or_default().trim())),
            "bytes",
        ),
        Codec::Json | Codec::Avro => unreachable!("JSON and Avro are serde's"),
    };
    // Bounds under a binder are checked where the impl is used, not here: a type that is
    // no `prost::Message` is reported once, by the assertion on the type; `Decode` for a
    // bytes type needs `From<Vec<u8>>`, which a type that is only emitted need not have.
    let (encode_bound, decode_bound) = match codec {
        Codec::Protobuf => (
            quote!(where for<'__outbox_codec> #ident: #p::ProtobufEvent),
            quote!(where for<'__outbox_codec> #ident: #p::ProtobufEvent),
        ),
        Codec::Bytes => (
            quote!(),
            quote!(where for<'__outbox> #ident: ::core::convert::From<#p::Vec<u8>>),
        ),
        Codec::Json | Codec::Avro => unreachable!("JSON and Avro are serde's"),
    };
    quote! {
        #assert
        #[automatically_derived]
        impl #p::Encode for #ident #encode_bound {
            fn payload_content_type(&self) -> #p::Cow<'static, str> {
                #p::Cow::Borrowed(#content_type)
            }
            fn encode_payload(&self) -> #p::Result<#p::Vec<u8>, #p::CodecError> {
                #encode
            }
        }
        #[automatically_derived]
        impl<'__outbox> #p::Encode for &'__outbox #ident #encode_bound {
            fn payload_content_type(&self) -> #p::Cow<'static, str> {
                #p::Encode::payload_content_type(*self)
            }
            fn encode_payload(&self) -> #p::Result<#p::Vec<u8>, #p::CodecError> {
                #p::Encode::encode_payload(*self)
            }
        }
        #[automatically_derived]
        impl #p::Decode for #ident #decode_bound {
            const FORMAT: &'static str = #format;
            fn reads(content_type: &str) -> bool {
                #reads
            }
            fn decode_payload(payload: &[u8]) -> #p::Result<Self, #p::CodecError> {
                #decode
            }
        }
    }
}

fn event_type_name(attrs: &Attrs, ident: &syn::Ident) -> String {
    match &attrs.event_type {
        Some(et) => et.value.value(),
        None => ident.unraw().to_string(),
    }
}

/// A constant expression of type `Destination`. A path keeps its spans, so a misspelt
/// constant is reported where the user wrote it.
fn destination(p: &TokenStream, attrs: &Attrs) -> TokenStream {
    match attrs.destination.as_ref().map(|d| &d.value) {
        Some(Destination::Literal(lit)) => quote!(#p::Destination::new(#lit)),
        Some(Destination::Path(path)) => {
            quote_spanned!(path.span()=> { const __OUTBOX_DESTINATION: #p::Destination = #path; __OUTBOX_DESTINATION })
        }
        Some(Destination::Invalid) | None => unreachable!("rejected by valid::check"),
    }
}

/// `PartitionKey::to_partition_key`, spanned on the `key = ...` token so an unsupported
/// field type is reported there.
fn key_conversion(p: &TokenStream, member: &Member) -> TokenStream {
    quote_spanned!(member.span()=> <_ as #p::PartitionKey>::to_partition_key)
}

fn push_key_bound(
    where_clause: &mut syn::WhereClause,
    p: &TokenStream,
    fields: &Fields,
    member: &Member,
) {
    if let Some(ty) = field_type(fields, member) {
        where_clause
            .predicates
            .push(syn::parse_quote_spanned!(member.span()=> #ty: #p::PartitionKey));
    }
}

fn field_type<'f>(fields: &'f Fields, member: &Member) -> Option<&'f Type> {
    fields
        .iter()
        .zip(fields.members())
        .find(|(_, m)| m == member)
        .map(|(f, _)| &f.ty)
}

fn variant_key(
    p: &TokenStream,
    v: &Variant<'_>,
    enum_attrs: &Attrs,
    generic: bool,
    where_clause: &mut syn::WhereClause,
) -> TokenStream {
    let vi = v.ident;
    let key = v.attrs.key.as_ref().or(enum_attrs.key.as_ref());
    match key {
        Some(k) => {
            if generic {
                push_key_bound(where_clause, p, v.fields, &k.value);
            }
            let member = &k.value;
            let binding = format_ident!("__outbox_key");
            let conv = key_conversion(p, member);
            quote!(Self::#vi { #member: #binding, .. } => #conv(#binding),)
        }
        None => quote!(Self::#vi { .. } => #p::Option::None,),
    }
}

/// What every catalog entry of one derived type shares.
struct Shared<'a> {
    p: &'a TokenStream,
    input: &'a Input<'a>,
    destination: &'a TokenStream,
    content_type: &'a TokenStream,
}

fn register(
    shared: &Shared<'_>,
    event_type: &str,
    version: &TokenStream,
    variant: Option<&syn::Ident>,
    key: Option<String>,
) -> TokenStream {
    let Shared {
        p,
        input,
        destination,
        content_type,
    } = *shared;
    let ident = input.ident;
    let type_name = ident.unraw().to_string();
    let variant = match variant {
        Some(v) => {
            let v = v.unraw().to_string();
            quote!(#p::Option::Some(#v))
        }
        None => quote!(#p::Option::None),
    };
    let key = match key {
        Some(field) => quote!(#p::Option::Some(#field)),
        None => quote!(#p::Option::None),
    };
    // The schema, found through `schemars::JsonSchema` when the type implements it
    // (autoref: the bounded impl is tried first). A generic type has no one schema.
    let generic = !input.generics.params.is_empty();
    let codec = input.attrs.codec.as_ref().map(|c| c.value);
    let (avro, protobuf) = (codec == Some(Codec::Avro), codec == Some(Codec::Protobuf));
    let proto = match &input.data {
        Data::Struct(fields) if protobuf => super::proto::schema(ident, fields),
        _ => None,
    };
    let schema = if let Some(text) = proto {
        // The `.proto` read off the fields' prost attributes.
        quote!(|_: &mut #p::SchemaGen| #p::proto_schema(#text))
    } else if protobuf {
        // A field defined elsewhere (a message, an enumeration ...): opaque.
        quote!(#p::no_schema)
    } else if avro {
        // The Avro schema (autoref: found only for an Avro event; the assertion on the
        // type reports any other).
        quote! {
            |_: &mut #p::SchemaGen| {
                #[allow(unused_imports)]
                use #p::{NoAvroSchema as _, ViaAvroSchema as _};
                (&#p::Probe::<#ident>::NEW).outbox_avro_schema()
            }
        }
    } else if !generic {
        quote! {
            |__outbox_generator: &mut #p::SchemaGen| {
                #[allow(unused_imports)]
                use #p::{NoJsonSchema as _, ViaJsonSchema as _};
                (&#p::Probe::<#ident>::NEW).outbox_schema(__outbox_generator)
            }
        }
    } else {
        quote!(#p::no_schema)
    };
    let location = quote_spanned!(ident.span()=> ::core::file!(), ::core::line!());
    quote! {
        #p::inventory::submit! {
            #p::EventInfo::__new(
                #event_type,
                #destination,
                #version,
                ::core::concat!(::core::module_path!(), "::", #type_name),
                #variant,
                ::core::module_path!(),
                #key,
                #location,
                #schema,
                #generic,
                #content_type,
            )
        }
    }
}
