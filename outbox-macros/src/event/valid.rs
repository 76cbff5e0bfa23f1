//! Checks of the derive's model that parsing cannot make: required keys, keys in the
//! right place, fields that exist, names that are not empty or duplicated.

use std::collections::BTreeMap;

use quote::ToTokens;
use syn::{Fields, Member};

use super::ast::{Codec, Data, Destination, Input, Keyed};
use crate::attr::Errors;

pub(crate) fn check(input: &Input<'_>, errors: &mut Errors) {
    let attrs = &input.attrs;
    if let Some(Keyed {
        value: Destination::Literal(lit),
        ..
    }) = &attrs.destination
        && lit.value().trim().is_empty()
    {
        errors.spanned(
                lit,
                "the destination is empty; name the topic (or exchange, subject) the event is published to",
            );
    }
    if let Some(et) = &attrs.event_type {
        check_event_type(&et.value, errors);
    }
    check_codec(input, errors);

    match &input.data {
        Data::Union(token) => errors.spanned(
            token,
            "`OutboxEvent` cannot be derived for a union; use a struct or an enum",
        ),
        Data::Struct(fields) => {
            if attrs.destination.is_none() {
                missing_destination(input, errors);
            }
            if let Some(key) = &attrs.key {
                check_member(&format!("`{}`", input.ident), fields, &key.value, errors);
            }
        }
        Data::Enum(variants) => {
            if attrs.destination.is_none() {
                missing_destination(input, errors);
            }
            if let Some(et) = &attrs.event_type {
                errors.spanned(
                    &et.key,
                    format_args!(
                        "`event_type` on an enum: each variant is an event type of its own; put `#[outbox(event_type = \"...\")]` on the variants (default: the variant's name)"
                    ),
                );
            }
            let mut seen: BTreeMap<String, &syn::Ident> = BTreeMap::new();
            for v in variants {
                for (name, key) in [
                    ("destination", v.attrs.destination.as_ref().map(|k| &k.key)),
                    ("crate", v.attrs.krate.as_ref().map(|k| &k.key)),
                    ("codec", v.attrs.codec.as_ref().map(|k| &k.key)),
                    (
                        "content_type",
                        v.attrs.content_type.as_ref().map(|k| &k.key),
                    ),
                ] {
                    if let Some(key) = key {
                        errors.spanned(
                            key,
                            format_args!(
                                "`{name}` cannot be set on a variant: all variants of `{}` share the enum's `#[outbox({name} = ...)]`",
                                input.ident
                            ),
                        );
                    }
                }
                let what = format!("variant `{}::{}`", input.ident, v.ident);
                match (&v.attrs.key, &attrs.key) {
                    (Some(own), _) => check_member(&what, v.fields, &own.value, errors),
                    (None, Some(shared)) => {
                        if !has_member(v.fields, &shared.value) {
                            errors.spanned(
                                v.ident,
                                format_args!(
                                    "{what} has no field `{}`, the enum's `key = {}`; add the field, or give the variant its own `#[outbox(key = ...)]`",
                                    member_str(&shared.value),
                                    member_str(&shared.value)
                                ),
                            );
                        }
                    }
                    (None, None) => {}
                }
                let event_type = match &v.attrs.event_type {
                    Some(et) => {
                        check_event_type(&et.value, errors);
                        et.value.value()
                    }
                    None => v.ident.to_string(),
                };
                if let Some(first) = seen.get(&event_type) {
                    let at: &dyn ToTokens = match &v.attrs.event_type {
                        Some(et) => &et.value,
                        None => v.ident,
                    };
                    errors.spanned(
                        at,
                        format_args!(
                            "variants `{first}` and `{}` both have event type `{event_type}`; consumers could not tell them apart: give one another `#[outbox(event_type = \"...\")]`",
                            v.ident
                        ),
                    );
                } else {
                    seen.insert(event_type, v.ident);
                }
            }
        }
    }
}

/// `codec` and `content_type`: another codec than JSON on a plain struct (a Protobuf event
/// is one message; generic types have no one codec), `content_type` only with
/// `codec = bytes` and a media type that can travel as a header.
fn check_codec(input: &Input<'_>, errors: &mut Errors) {
    let attrs = &input.attrs;
    let codec = attrs.codec.as_ref().map_or(Codec::Json, |c| c.value);
    if let Some(c) = attrs.codec.as_ref().filter(|c| c.value != Codec::Json) {
        if matches!(input.data, Data::Enum(_)) {
            errors.spanned(
                &c.key,
                "`codec` other than `json` on an enum: a Protobuf, Avro or bytes event is one type; derive it on a struct (one per event type)",
            );
        }
        if !input.generics.params.is_empty() {
            errors.spanned(
                &c.key,
                "`codec` other than `json` on a type with type or lifetime parameters: derive it on a type without (a Protobuf message, an Avro record or an owned byte buffer)",
            );
        }
    }
    if let Some(ct) = &attrs.content_type {
        if codec != Codec::Bytes {
            errors.spanned(
                &ct.key,
                "`content_type` names what `codec = bytes` sends; JSON, Protobuf and Avro have their own (`application/json`, `application/protobuf`, `application/avro`)",
            );
        }
        let value = ct.value.value();
        let essence = value.split(';').next().unwrap_or_default().trim();
        let token = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
        };
        let valid = value.len() <= 255
            && value.bytes().all(|b| (0x20..0x7f).contains(&b))
            && essence
                .split_once('/')
                .is_some_and(|(kind, sub)| token(kind) && token(sub));
        let essence = essence.to_ascii_lowercase();
        if valid && (essence == "application/json" || essence.ends_with("+json")) {
            errors.spanned(
                &ct.value,
                "`codec = bytes` with a JSON content type: the bytes would not be checked to be JSON (consumers and CloudEvents' structured mode parse them); for JSON, derive `serde::Serialize` and leave `codec` out",
            );
        }
        if !valid {
            errors.spanned(
                &ct.value,
                "`content_type` is a media type that can travel as a header: printable ASCII `type/subtype`, parameters allowed, at most 255 bytes (`content_type = \"image/png\"`)",
            );
        }
    }
}

fn missing_destination(input: &Input<'_>, errors: &mut Errors) {
    errors.spanned(
        input.ident,
        format_args!(
            "missing `#[outbox(destination = ...)]`: say where `{}` is published, e.g. `#[outbox(destination = ORDER_EVENTS)]` with a `destinations!` constant or `#[outbox(destination = \"orders.events\")]`",
            input.ident
        ),
    );
}

fn check_event_type(lit: &syn::LitStr, errors: &mut Errors) {
    if lit.value().trim().is_empty() {
        errors.spanned(
            lit,
            "the event type is empty; consumers dispatch on it: give it a name, or leave `event_type` out to use the type's name",
        );
    }
}

pub(crate) fn member_str(member: &Member) -> String {
    match member {
        Member::Named(ident) => ident.to_string(),
        Member::Unnamed(index) => index.index.to_string(),
    }
}

pub(crate) fn has_member(fields: &Fields, member: &Member) -> bool {
    fields.members().any(|m| m == *member)
}

/// `key = ...` must name a field of the right kind that exists.
fn check_member(what: &str, fields: &Fields, member: &Member, errors: &mut Errors) {
    if has_member(fields, member) {
        return;
    }
    let msg = match (fields, member) {
        (Fields::Unit, _) => format!(
            "{what} has no fields, so it has no partition key; remove `key = {}`",
            member_str(member)
        ),
        (Fields::Named(_), Member::Unnamed(i)) => format!(
            "`key = {}` is a tuple index, but {what} has named fields: {}; write `key = <field name>`",
            i.index,
            list(fields)
        ),
        (Fields::Unnamed(_), Member::Named(name)) => format!(
            "{what} is a tuple struct: name its key field by index (`key = 0`), not `{name}`"
        ),
        (Fields::Unnamed(f), Member::Unnamed(i)) => format!(
            "{what} has no field {}: its fields are numbered 0 to {}",
            i.index,
            f.unnamed.len().saturating_sub(1)
        ),
        (Fields::Named(_), Member::Named(name)) => format!(
            "{what} has no field `{name}`; its fields are {}",
            list(fields)
        ),
    };
    errors.spanned(member, msg);
}

fn list(fields: &Fields) -> String {
    let names: Vec<String> = fields
        .members()
        .map(|m| format!("`{}`", member_str(&m)))
        .collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}
