//! The `.proto` schema of a `codec = protobuf` event, read off the `#[prost(...)]`
//! attributes of its fields (the ones prost's derive reads, so the schema is what the
//! type encodes): what the contract document gives the message (AsyncAPI's
//! `application/vnd.google.protobuf;version=3` schema format).
//!
//! A proto3 message of scalar fields (`optional`, `repeated`, packed or not) and maps of
//! scalars is written out whole, tags given or inferred as prost infers them. A field
//! whose type is defined elsewhere (a message, an enumeration, a oneof, a group), a
//! proto2 field (`required`, `default`), or anything protoc would refuse (a name that is
//! not ASCII, two field names that match lowercased without underscores, a number
//! protoc reserves) has no complete
//! schema here: the document then says the payload is opaque.

use syn::punctuated::Punctuated;
use syn::{Fields, Ident, Lit, Meta, Token};

/// The scalar types of proto3, as prost's attributes name them.
const SCALARS: &[&str] = &[
    "double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32",
    "fixed64", "sfixed32", "sfixed64", "bool", "string", "bytes",
];

/// The key types a proto3 map allows (any integral or string type).
const MAP_KEYS: &[&str] = &[
    "int32", "int64", "uint32", "uint64", "sint32", "sint64", "fixed32", "fixed64", "sfixed32",
    "sfixed64", "bool", "string",
];

/// The `.proto` text of `message` with `fields`, or `None` when a field is not one this
/// module writes (see the module's documentation).
pub(crate) fn schema(message: &Ident, fields: &Fields) -> Option<String> {
    let Fields::Named(named) = fields else {
        return None;
    };
    let mut lines = Vec::new();
    let mut clash_keys = std::collections::HashSet::new();
    // prost gives a field without a tag the one after the previous field's.
    let mut next_tag = 1;
    for field in &named.named {
        let name = syn::ext::IdentExt::unraw(field.ident.as_ref()?).to_string();
        // protoc takes ASCII names only, and refuses two fields whose names clash.
        if !name.is_ascii() || !clash_keys.insert(clash_key(&name)) {
            return None;
        }
        let mut prost = field.attrs.iter().filter(|a| a.path().is_ident("prost"));
        let attr = prost.next()?;
        if prost.next().is_some() {
            return None;
        }
        let metas = attr
            .parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
            .ok()?;
        let (line, tag) = field_line(&name, &metas, next_tag)?;
        lines.push(line);
        next_tag = tag.checked_add(1)?;
    }
    let message = syn::ext::IdentExt::unraw(message).to_string();
    if !message.is_ascii() {
        return None;
    }
    let mut text = format!("syntax = \"proto3\";\n\nmessage {message} {{\n");
    for line in lines {
        text.push_str("  ");
        text.push_str(&line);
        text.push('\n');
    }
    text.push_str("}\n");
    Some(text)
}

/// What two fields must not share for protoc: the name lowercased without underscores,
/// as protoc up to 3.20 compared them (`foo_bar` and `foobar` clash), which covers the
/// JSON names later versions compare (`order_id` is `orderId`).
fn clash_key(name: &str) -> String {
    name.chars()
        .filter(|c| *c != '_')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// One field's line (`repeated uint64 ids = 4 [packed = false];`) and its number, from
/// its prost attribute's items (`inferred`: its number if it names none).
fn field_line(
    name: &str,
    metas: &Punctuated<Meta, Token![,]>,
    inferred: u32,
) -> Option<(String, u32)> {
    let (mut kind, mut label, mut tag, mut packed) = (None, None, None, None);
    let mut map = None;
    for meta in metas {
        match meta {
            Meta::Path(path) => {
                let word = path.get_ident()?.to_string();
                match word.as_str() {
                    "optional" | "repeated" => label = Some(word),
                    w if SCALARS.contains(&w) => kind = Some(word),
                    // `message`, `group`, `required` (proto2) and anything unknown.
                    _ => return None,
                }
            }
            Meta::NameValue(nv) => {
                let key = nv.path.get_ident()?.to_string();
                let value = match &nv.value {
                    syn::Expr::Lit(syn::ExprLit { lit, .. }) => lit,
                    _ => return None,
                };
                match (key.as_str(), value) {
                    ("tag", Lit::Str(s)) => tag = Some(s.value().trim().parse::<u32>().ok()?),
                    ("tag", Lit::Int(i)) => tag = Some(i.base10_parse::<u32>().ok()?),
                    // `bytes = "vec"` / `bytes = "bytes"`: the Rust type, not the wire's.
                    ("bytes", Lit::Str(_)) => kind = Some("bytes".to_owned()),
                    ("packed", Lit::Str(s)) => packed = Some(s.value() == "true"),
                    ("map" | "hash_map" | "btree_map", Lit::Str(s)) => {
                        let text = s.value();
                        let (k, v) = text.split_once(',')?;
                        let (k, v) = (k.trim(), v.trim());
                        if !MAP_KEYS.contains(&k) || !SCALARS.contains(&v) {
                            return None;
                        }
                        map = Some(format!("map<{k}, {v}>"));
                    }
                    // `enumeration`, `oneof`, `default` (proto2), `json_name` ...
                    _ => return None,
                }
            }
            // `tag(4)`
            Meta::List(list) if list.path.is_ident("tag") => {
                tag = Some(
                    list.parse_args::<syn::LitInt>()
                        .ok()?
                        .base10_parse::<u32>()
                        .ok()?,
                );
            }
            Meta::List(_) => return None,
        }
    }
    // Protobuf's range, without the numbers protoc keeps for itself (19000 to 19999).
    let tag = tag
        .or(Some(inferred))
        .filter(|t| (1..=536_870_911).contains(t) && !(19_000..=19_999).contains(t))?;
    let ty = match (map, kind) {
        (Some(map), None) if label.is_none() => map,
        (None, Some(kind)) => kind,
        _ => return None,
    };
    let label = label.map(|l| format!("{l} ")).unwrap_or_default();
    let options = match packed {
        Some(false) if label == "repeated " => " [packed = false]",
        _ => "",
    };
    Some((format!("{label}{ty} {name} = {tag}{options};"), tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(item: syn::ItemStruct) -> Option<String> {
        schema(&item.ident, &item.fields)
    }

    #[test]
    fn scalars_labels_maps_and_packing_are_written() {
        let text = of(syn::parse_quote! {
            struct OrderPlaced {
                #[prost(uint64, tag = "1")]
                order_id: u64,
                #[prost(string, optional, tag = "2")]
                note: Option<String>,
                #[prost(bytes = "vec", tag = "3")]
                r#signature: Vec<u8>,
                #[prost(uint32, repeated, packed = "false", tag = "4")]
                lines: Vec<u32>,
                #[prost(map = "string, sint64", tag = "5")]
                totals: HashMap<String, i64>,
                #[prost(double, repeated, tag = 6)]
                weights: Vec<f64>,
                #[prost(bool)]
                gift: bool,
                #[prost(int32, tag(9))]
                priority: i32,
            }
        });
        assert_eq!(
            text.as_deref(),
            Some(
                "syntax = \"proto3\";\n\nmessage OrderPlaced {\n  uint64 order_id = 1;\n  optional string note = 2;\n  bytes signature = 3;\n  repeated uint32 lines = 4 [packed = false];\n  map<string, sint64> totals = 5;\n  repeated double weights = 6;\n  bool gift = 7;\n  int32 priority = 9;\n}\n"
            )
        );
    }

    #[test]
    fn a_field_defined_elsewhere_or_in_proto2_leaves_no_schema() {
        for field in [
            quote::quote!(#[prost(message, optional, tag = "1")] a: Option<Address>),
            quote::quote!(#[prost(enumeration = "Status", tag = "1")] a: i32),
            quote::quote!(#[prost(oneof = "Kind", tags = "1, 2")] a: Option<Kind>),
            quote::quote!(#[prost(map = "string, message", tag = "1")] a: HashMap<String, Address>),
            quote::quote!(#[prost(uint64, required, tag = "1")] a: u64),
            quote::quote!(#[prost(uint64, optional, default = "7", tag = "1")] a: Option<u64>),
            quote::quote!(a: u64),
            quote::quote!(#[prost(uint64, tag = "0")] a: u64),
            quote::quote!(#[prost(uint64, tag = "19000")] a: u64),
            quote::quote!(#[prost(uint64, tag = "1")] größe: u64),
            quote::quote!(#[prost(uint64, tag = "1")] a_b: u64, #[prost(uint64, tag = "2")] a__b: u64),
            quote::quote!(#[prost(uint64, tag = "1")] foo_bar: u64, #[prost(uint64, tag = "2")] foobar: u64),
            quote::quote!(#[prost(uint64, tag = "x")] a: u64),
        ] {
            let item: syn::ItemStruct = syn::parse_quote!(struct E { #field });
            assert_eq!(of(item), None, "{field}");
        }
        let tuple: syn::ItemStruct = syn::parse_quote!(
            struct E(#[prost(uint64, tag = "1")] u64);
        );
        assert_eq!(of(tuple), None);
    }
}
