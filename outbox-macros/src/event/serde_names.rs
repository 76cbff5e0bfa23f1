//! The name serde gives a field in the payload, so that the catalog names the key as
//! consumers see it: `#[serde(rename = "...")]` on the field, or the `rename_all` rule
//! that applies to it. Anything serde would reject is left for serde to report.

use syn::{Attribute, Fields, LitStr, Member, Token};

/// The serialized name of `member` of `fields`, under `rename_all` (the container's,
/// or for an enum variant's fields, the variant's or the enum's `rename_all_fields`).
pub(crate) fn field_name(fields: &Fields, member: &Member, rename_all: Option<&str>) -> String {
    let Member::Named(ident) = member else {
        if let Member::Unnamed(index) = member {
            return index.index.to_string();
        }
        return String::new();
    };
    let field = fields.iter().find(|f| f.ident.as_ref() == Some(ident));
    if let Some(name) = field.and_then(|f| serde_value(&f.attrs, "rename")) {
        return name;
    }
    let name = syn::ext::IdentExt::unraw(ident).to_string();
    match rename_all {
        Some(rule) => apply(rule, &name),
        None => name,
    }
}

/// `rename_all` (serialize side) of a container or variant.
pub(crate) fn rename_all(attrs: &[Attribute]) -> Option<String> {
    serde_value(attrs, "rename_all")
}

/// An enum's `rename_all_fields`.
pub(crate) fn rename_all_fields(attrs: &[Attribute]) -> Option<String> {
    serde_value(attrs, "rename_all_fields")
}

/// `#[serde(key = "v")]` or `#[serde(key(serialize = "v"))]`.
fn serde_value(attrs: &[Attribute], key: &str) -> Option<String> {
    let mut found = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident(key) {
                if meta.input.peek(Token![=]) {
                    found = Some(meta.value()?.parse::<LitStr>()?.value());
                } else {
                    meta.parse_nested_meta(|inner| {
                        if inner.path.is_ident("serialize") {
                            found = Some(inner.value()?.parse::<LitStr>()?.value());
                        } else {
                            inner.value()?.parse::<LitStr>()?;
                        }
                        Ok(())
                    })?;
                }
            } else if meta.input.peek(Token![=]) {
                meta.value()?.parse::<syn::Expr>()?;
            } else if meta.input.peek(syn::token::Paren) {
                meta.input.parse::<proc_macro2::TokenTree>()?;
            }
            Ok(())
        });
    }
    found
}

/// serde's `rename_all` rules, applied to a snake_case field name.
fn apply(rule: &str, name: &str) -> String {
    let words = || name.split('_').filter(|w| !w.is_empty());
    let capitalized = |w: &str| {
        let mut c = w.chars();
        c.next()
            .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
            .unwrap_or_default()
    };
    match rule {
        "lowercase" => name.to_lowercase(),
        "UPPERCASE" | "SCREAMING_SNAKE_CASE" => name.to_uppercase(),
        "PascalCase" => words().map(capitalized).collect(),
        "camelCase" => {
            let pascal: String = words().map(capitalized).collect();
            let mut c = pascal.chars();
            c.next()
                .map(|f| f.to_lowercase().collect::<String>() + c.as_str())
                .unwrap_or_default()
        }
        "kebab-case" => name.replace('_', "-"),
        "SCREAMING-KEBAB-CASE" => name.to_uppercase().replace('_', "-"),
        _ => name.to_owned(), // "snake_case", or a rule serde itself will refuse
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        let cases = [
            ("camelCase", "order_id_v2", "orderIdV2"),
            ("PascalCase", "order_id", "OrderId"),
            ("snake_case", "order_id", "order_id"),
            ("SCREAMING_SNAKE_CASE", "order_id", "ORDER_ID"),
            ("kebab-case", "order_id", "order-id"),
            ("SCREAMING-KEBAB-CASE", "order_id", "ORDER-ID"),
            ("lowercase", "order_id", "order_id"),
            ("UPPERCASE", "order_id", "ORDER_ID"),
        ];
        for (rule, name, expected) in cases {
            assert_eq!(apply(rule, name), expected, "{rule}");
        }
    }

    #[test]
    fn rename_on_the_field_wins() {
        let item: syn::ItemStruct = syn::parse_quote! {
            #[serde(rename_all = "camelCase", deny_unknown_fields)]
            struct S {
                #[serde(default, rename(serialize = "id", deserialize = "ident"))]
                order_id: u64,
                customer_id: u64,
            }
        };
        let rule = rename_all(&item.attrs);
        assert_eq!(rule.as_deref(), Some("camelCase"));
        let member = |n: &str| Member::Named(syn::Ident::new(n, proc_macro2::Span::call_site()));
        assert_eq!(
            field_name(&item.fields, &member("order_id"), rule.as_deref()),
            "id"
        );
        assert_eq!(
            field_name(&item.fields, &member("customer_id"), rule.as_deref()),
            "customerId"
        );
    }
}
