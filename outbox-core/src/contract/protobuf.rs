//! Which changes to a Protobuf schema break consumers.
//!
//! A Protobuf payload names its fields by number only: a reader finds each field by
//! its number and reads it as the type its own schema gives that number. So fields are
//! paired by number, and what matters is what one number means on each side:
//!
//! | change | verdict |
//! | --- | --- |
//! | a field number reused: the same number with another type, or given to a field that had another number (the old field's name moved) | breaking: readers of one schema misread the other's messages |
//! | a number the baseline reserved (`reserved 3;`) used by a field | breaking |
//! | a field's type changed, even to one the wire format shares (`int32` to `int64`: values out of range are cut) | breaking |
//! | a field made `repeated`, or singular | breaking |
//! | fields moved into an existing oneof, several into a new one, or one out of a oneof | breaking: a reader of the oneof keeps one value |
//! | a field removed | compatible: readers get its default value; the report says to reserve its number |
//! | a new field, a field renamed under the same number, `optional` added or removed, packing changed, one field moved into a new oneof, a oneof or the message renamed | compatible (the binary form is unchanged) |
//!
//! Breaking changes are allowed with a version bump, as for every schema
//! (`contract/compat.rs`). The schemas are the `.proto` text the contract document
//! gives (`schemaFormat` `application/vnd.google.protobuf;version=3`): the first
//! top-level message is the payload's. Pure text: the check needs no Protobuf library.

use std::collections::BTreeMap;

/// The differences between `old` and `new` (`.proto` texts), each with whether it
/// breaks consumers.
pub(super) fn compare(old: &str, new: &str) -> Vec<(bool, String)> {
    if old == new {
        // Nothing changed (even in a schema that cannot be read).
        return Vec::new();
    }
    let (old, new) = match (Message::parse(old), Message::parse(new)) {
        (Ok(old), Ok(new)) => (old, new),
        (Err(e), _) => {
            return vec![(
                true,
                format!(
                    "the baseline's Protobuf schema cannot be read ({e}), so nothing can be said about what changed"
                ),
            )];
        }
        (_, Err(e)) => return vec![(true, format!("the Protobuf schema cannot be read ({e})"))],
    };
    let mut found = Vec::new();
    if old.name != new.name {
        found.push((
            false,
            format!(
                "the message was renamed from `{}` to `{}` (the binary form has no names)",
                old.name, new.name
            ),
        ));
    }
    for (number, before) in &old.fields {
        let moved_to = new.number_of(&before.name).filter(|n| n != number);
        match (new.fields.get(number), moved_to) {
            (after, Some(to)) => {
                found.push((
                    true,
                    format!(
                        "field `{}` moved from number {number} to {to}: readers of the baseline do not find it, and readers of this schema find nothing in the messages already written; keep its number",
                        before.name
                    ),
                ));
                // Its number given to another field: a reuse as well.
                if let Some(after) = after {
                    compare_field(*number, (before, after), (&old, &new), &mut found);
                }
            }
            (Some(after), None) => {
                compare_field(*number, (before, after), (&old, &new), &mut found)
            }
            (None, None) if new.reserves_number(*number) => found.push((
                false,
                format!("field `{}` ({number}) removed, its number reserved", before.name),
            )),
            (None, None) => found.push((
                false,
                format!(
                    "field `{}` ({number}) removed: readers get its default value; reserve its number (`reserved {number};`) so that no later field reuses it",
                    before.name
                ),
            )),
        }
    }
    for (number, after) in &new.fields {
        if old.fields.contains_key(number) {
            continue; // compared above
        }
        let moved = old.number_of(&after.name).is_some();
        if old.reserves_number(*number) {
            found.push((
                true,
                format!(
                    "field number {number} (`{}`) was reserved in the baseline: a field removed before may have used it, so messages already written can hold other data there; take a new number",
                    after.name
                ),
            ));
        } else if moved {
            // Its move is reported above.
        } else if old.reserved_names.contains(&after.name) {
            found.push((
                false,
                format!(
                    "new field `{} {}` ({number}) takes a name the baseline reserved (the binary form is by number; in the JSON form, messages written before the name was reserved hold another field's value under it)",
                    after.ty, after.name
                ),
            ));
        } else {
            found.push((
                false,
                format!("new field `{} {}` ({number})", after.ty, after.name),
            ));
        }
    }
    // A oneof's verdict is found once per member: say it once.
    let mut said = std::collections::HashSet::new();
    found.retain(|f| said.insert(f.clone()));
    found
}

fn compare_field(
    number: u32,
    (before, after): (&Field, &Field),
    (old, new): (&Message, &Message),
    found: &mut Vec<(bool, String)>,
) {
    // Another field's number given to this one, or this one's given to another.
    let moved = before.name != after.name
        && (new.number_of(&before.name).is_some() || old.number_of(&after.name).is_some());
    if before.ty != after.ty || moved {
        found.push((
            true,
            format!(
                "field number {number} reused: it was `{}`, it is `{}`: readers of either schema misread the other's messages; give the new field a new number and reserve {number}",
                before.describe(),
                after.describe()
            ),
        ));
        return;
    }
    if before.repeated != after.repeated {
        found.push((
            true,
            format!(
                "field `{}` ({number}) is {} now: readers of the baseline read it as {}",
                after.name,
                if after.repeated {
                    "repeated"
                } else {
                    "singular"
                },
                if before.repeated {
                    "a list"
                } else {
                    "one value"
                }
            ),
        ));
    }
    if before.name != after.name {
        found.push((
            false,
            format!(
                "field {number} renamed from `{}` to `{}` (the binary form has numbers, not names; readers of its JSON form see the new name)",
                before.name, after.name
            ),
        ));
    }
    if before.oneof != after.oneof {
        found.push(oneof_change(number, before, after, old, new));
    }
    if before.optional != after.optional {
        found.push((
            false,
            format!(
                "field `{}` ({number}) {} `optional` (presence tracking only; the binary form is unchanged)",
                after.name,
                if after.optional { "became" } else { "is no longer" }
            ),
        ));
    }
}

/// A field that entered, left or changed its oneof. Protobuf's guide: one field moved
/// into a new oneof is safe; moving fields into an existing oneof, several into a new
/// one, or out of one loses values (a reader of the oneof keeps only the last one set).
fn oneof_change(
    number: u32,
    before: &Field,
    after: &Field,
    old: &Message,
    new: &Message,
) -> (bool, String) {
    let name = &after.name;
    // The members of a oneof that are in a oneof on the other side too (fields moving in
    // or out have verdicts of their own).
    let stayed = |m: &Message, group: &str, other: &Message| -> Vec<u32> {
        m.members(group)
            .filter(|n| other.fields.get(n).is_some_and(|f| f.oneof.is_some()))
            .collect()
    };
    match (&before.oneof, &after.oneof) {
        (None, Some(group)) => {
            let moved_in: Vec<&str> = new
                .members(group)
                .filter_map(|n| old.fields.get(&n).filter(|f| f.oneof.is_none()))
                .map(|f| f.name.as_str())
                .collect();
            // The oneof existed if one of its members was in a oneof in the baseline
            // (renamed or not).
            let existed = new
                .members(group)
                .any(|n| old.fields.get(&n).is_some_and(|f| f.oneof.is_some()));
            if existed {
                (
                    true,
                    format!(
                        "field `{name}` ({number}) moved into an existing oneof (`{group}`): a message that set it and another of the oneof keeps only one of them"
                    ),
                )
            } else if moved_in.len() > 1 {
                (
                    true,
                    format!(
                        "fields `{}` moved into the new oneof `{group}`: a message written with several of them set keeps only one",
                        moved_in.join("`, `")
                    ),
                )
            } else {
                (
                    false,
                    format!(
                        "field `{name}` ({number}) moved into the new oneof `{group}` (safe for one field)"
                    ),
                )
            }
        }
        (Some(was), Some(group)) if stayed(old, was, new) == stayed(new, group, old) => {
            (false, format!("oneof `{was}` renamed to `{group}`"))
        }
        (Some(was), _) => (
            true,
            format!(
                "field `{name}` ({number}) left the oneof `{was}`: readers of the baseline keep only one of that oneof's fields when a message sets several"
            ),
        ),
        (None, None) => unreachable!("the oneofs differ"),
    }
}

/// One field of a message.
#[derive(Debug, PartialEq)]
struct Field {
    name: String,
    /// The type as written (`uint64`, `map<string, int32>`, `acme.Address`).
    ty: String,
    repeated: bool,
    optional: bool,
    /// The oneof the field is part of.
    oneof: Option<String>,
}

impl Field {
    fn describe(&self) -> String {
        let label = if self.repeated { "repeated " } else { "" };
        format!("{label}{} {}", self.ty, self.name)
    }
}

/// The payload's message: its name, fields by number, reserved numbers and names.
#[derive(Debug, Default)]
struct Message {
    name: String,
    fields: BTreeMap<u32, Field>,
    reserved: Vec<(u32, u32)>,
    reserved_names: Vec<String>,
}

impl Message {
    fn number_of(&self, name: &str) -> Option<u32> {
        self.fields
            .iter()
            .find(|(_, f)| f.name == name)
            .map(|(n, _)| *n)
    }

    /// The numbers of the fields of oneof `group`.
    fn members<'m>(&'m self, group: &'m str) -> impl Iterator<Item = u32> + 'm {
        self.fields
            .iter()
            .filter(move |(_, f)| f.oneof.as_deref() == Some(group))
            .map(|(n, _)| *n)
    }

    fn reserves_number(&self, number: u32) -> bool {
        self.reserved
            .iter()
            .any(|&(from, to)| (from..=to).contains(&number))
    }

    /// The first top-level message of a `.proto` text.
    fn parse(text: &str) -> Result<Message, String> {
        let tokens = tokens(text)?;
        let mut p = Parser { tokens, at: 0 };
        while let Some(word) = p.next() {
            match word.as_str() {
                "message" => {
                    let name = p.ident()?;
                    p.expect("{")?;
                    let mut message = Message {
                        name,
                        ..Message::default()
                    };
                    p.body(&mut message, None)?;
                    return Ok(message);
                }
                // syntax, edition, package, import, option: to the end of the statement.
                "syntax" | "edition" | "package" | "import" | "option" => p.skip_statement()?,
                ";" => {}
                // A top-level enum or service before the message.
                "enum" | "service" | "extend" => {
                    p.ident()?;
                    p.expect("{")?;
                    p.skip_block()?;
                }
                other => return Err(format!("unexpected `{other}` at the top level")),
            }
        }
        Err("no message in it".to_owned())
    }
}

/// `.proto` tokens: words (identifiers, numbers, dotted names), strings (kept with their
/// quotes) and single symbols; comments dropped.
fn tokens(text: &str) -> Result<Vec<String>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            let end = (i + 2..chars.len().saturating_sub(1))
                .find(|&j| chars[j] == '*' && chars[j + 1] == '/')
                .ok_or("a comment that does not end")?;
            i = end + 2;
        } else if c == '"' || c == '\'' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            if i >= chars.len() {
                return Err("a string that does not end".to_owned());
            }
            i += 1;
            out.push(chars[start..i].iter().collect());
        } else if c.is_alphanumeric() || c == '_' || c == '.' || c == '-' || c == '+' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_alphanumeric() || matches!(chars[i], '_' | '.' | '-' | '+'))
            {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<String>,
    at: usize,
}

impl Parser {
    fn next(&mut self) -> Option<String> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.at).map(String::as_str)
    }

    fn need(&mut self) -> Result<String, String> {
        self.next().ok_or_else(|| "it ends too early".to_owned())
    }

    fn expect(&mut self, want: &str) -> Result<(), String> {
        match self.need()? {
            t if t == want => Ok(()),
            t => Err(format!("expected `{want}`, found `{t}`")),
        }
    }

    fn ident(&mut self) -> Result<String, String> {
        let t = self.need()?;
        if t.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_' || c == '.')
        {
            Ok(t)
        } else {
            Err(format!("expected a name, found `{t}`"))
        }
    }

    fn number(&mut self) -> Result<u32, String> {
        let t = self.need()?;
        // Decimal, hexadecimal (`0x1F`) or octal (`017`), as protoc reads them (digits
        // only: Rust's parsers would take a sign).
        let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            Some(hex) if hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
                u32::from_str_radix(hex, 16).ok()
            }
            Some(_) => None,
            None if !t.bytes().all(|b| b.is_ascii_digit()) => None,
            None if t.len() > 1 && t.starts_with('0') => u32::from_str_radix(&t[1..], 8).ok(),
            None => t.parse().ok(),
        };
        parsed.ok_or_else(|| format!("expected a field number, found `{t}`"))
    }

    /// Up to and including the next `;` at this level (or a `{ ... }` block).
    fn skip_statement(&mut self) -> Result<(), String> {
        loop {
            match self.need()?.as_str() {
                ";" => return Ok(()),
                "{" => {
                    self.skip_block()?;
                    if self.peek() == Some(";") {
                        self.at += 1;
                    }
                    return Ok(());
                }
                _ => {}
            }
        }
    }

    /// After a `{`: up to and including its `}`.
    fn skip_block(&mut self) -> Result<(), String> {
        let mut depth = 1usize;
        while depth > 0 {
            match self.need()?.as_str() {
                "{" => depth += 1,
                "}" => depth -= 1,
                _ => {}
            }
        }
        Ok(())
    }

    /// After a message's (or oneof `oneof`'s) `{`: its fields up to its `}`. Nested
    /// types are skipped, not descended into (no recursion on the input's depth).
    fn body(&mut self, message: &mut Message, oneof: Option<&str>) -> Result<(), String> {
        loop {
            let word = self.need()?;
            match word.as_str() {
                "}" => return Ok(()),
                ";" => {}
                "option" | "extensions" => self.skip_statement()?,
                "reserved" => self.reserved(message)?,
                "message" | "enum" | "extend" => {
                    self.ident()?;
                    self.expect("{")?;
                    self.skip_block()?;
                }
                "oneof" if oneof.is_none() => {
                    let group = self.ident()?;
                    self.expect("{")?;
                    self.body(message, Some(&group))?;
                }
                _ => {
                    let (mut repeated, mut optional) = (false, false);
                    let ty = match word.as_str() {
                        "repeated" => {
                            repeated = true;
                            self.ident()?
                        }
                        "optional" | "required" => {
                            optional = word == "optional";
                            self.ident()?
                        }
                        "map" => {
                            self.expect("<")?;
                            let k = self.ident()?;
                            self.expect(",")?;
                            let v = self.ident()?;
                            self.expect(">")?;
                            format!("map<{k}, {v}>")
                        }
                        "group" => return Err("proto2 groups are not read".to_owned()),
                        _ => word,
                    };
                    let name = self.ident()?;
                    self.expect("=")?;
                    let number = self.number()?;
                    if !(1..=536_870_911).contains(&number) {
                        return Err(format!(
                            "field `{name}` has number {number}, outside 1 to 536870911"
                        ));
                    }
                    if self.peek() == Some("[") {
                        // Field options, with the brackets and braces of their values.
                        let mut depth = 0usize;
                        loop {
                            match self.need()?.as_str() {
                                "[" | "{" => depth += 1,
                                "]" | "}" => {
                                    depth = depth.saturating_sub(1);
                                    if depth == 0 {
                                        break;
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    self.expect(";")?;
                    let field = Field {
                        name,
                        ty,
                        repeated,
                        optional,
                        oneof: oneof.map(str::to_owned),
                    };
                    if message.number_of(&field.name).is_some() {
                        return Err(format!("field name `{}` is used twice", field.name));
                    }
                    if let Some(other) = message.fields.insert(number, field) {
                        return Err(format!(
                            "field number {number} is used twice (`{}`)",
                            other.name
                        ));
                    }
                }
            }
        }
    }

    /// After `reserved`: `2, 15, 9 to 11;` or `"foo", "bar";`.
    fn reserved(&mut self, message: &mut Message) -> Result<(), String> {
        loop {
            let t = self.need()?;
            let quoted = t
                .strip_prefix('"')
                .and_then(|t| t.strip_suffix('"'))
                .or_else(|| t.strip_prefix('\'').and_then(|t| t.strip_suffix('\'')));
            if let Some(name) = quoted {
                message.reserved_names.push(name.to_owned());
            } else if t.starts_with(|c: char| c.is_alphabetic() || c == '_') {
                // Editions write reserved names as identifiers.
                message.reserved_names.push(t);
            } else {
                self.at -= 1;
                let from = self.number()?;
                let to = if self.peek() == Some("to") {
                    self.at += 1;
                    if self.peek() == Some("max") {
                        self.at += 1;
                        536_870_911
                    } else {
                        self.number()?
                    }
                } else {
                    from
                };
                message.reserved.push((from, to));
            }
            match self.need()?.as_str() {
                "," => {}
                ";" => return Ok(()),
                t => return Err(format!("expected `,` or `;` in `reserved`, found `{t}`")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "syntax = \"proto3\";\n\nmessage OrderPlaced {\n  uint64 order_id = 1;\n  string customer = 2;\n  bytes signature = 3;\n}\n";

    fn with(fields: &str) -> String {
        format!("syntax = \"proto3\";\nmessage OrderPlaced {{\n{fields}\n}}\n")
    }

    fn verdicts(new: &str) -> Vec<(bool, String)> {
        compare(BASE, new)
    }

    fn breaking(new: &str) -> Vec<String> {
        verdicts(new)
            .into_iter()
            .filter(|(b, _)| *b)
            .map(|(_, w)| w)
            .collect()
    }

    #[test]
    fn the_same_schema_has_no_changes() {
        assert_eq!(verdicts(BASE), vec![]);
        // Comments, options and layout are not changes.
        let spaced = "// orders\nsyntax=\"proto3\"; package acme;\noption java_package = \"x\";\n/* the event */ message OrderPlaced { option deprecated = true;\n uint64 order_id = 1 [json_name = \"orderId\"]; string customer = 2; bytes signature = 0x3; }";
        assert_eq!(verdicts(spaced), vec![]);
    }

    #[test]
    fn a_field_number_reused_breaks() {
        let reused = with("uint64 order_id = 1;\nstring customer = 2;\nstring carrier = 3;");
        let found = breaking(&reused);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with(
                "field number 3 reused: it was `bytes signature`, it is `string carrier`"
            ),
            "{found:?}"
        );
        // The same type under another name, while the old name moved elsewhere.
        let swapped = with(
            "uint64 order_id = 1;\nstring note = 2;\nbytes signature = 3;\nstring customer = 4;",
        );
        let found = breaking(&swapped);
        assert!(
            found.iter().any(|w| w.starts_with("field number 2 reused")),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|w| w.starts_with("field `customer` moved from number 2 to 4")),
            "{found:?}"
        );
    }

    #[test]
    fn a_field_moved_to_another_fields_number_breaks() {
        // Same type: found by the name, not the type.
        let old = with("uint64 order_id = 1;\nuint64 total = 2;");
        let new = with("uint64 order_id = 2;");
        let found = compare(&old, &new);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found.iter().all(|(b, _)| *b), "{found:?}");
        assert!(
            found[0]
                .1
                .starts_with("field `order_id` moved from number 1 to 2"),
            "{found:?}"
        );
        assert!(
            found[1].1.starts_with(
                "field number 2 reused: it was `uint64 total`, it is `uint64 order_id`"
            ),
            "{found:?}"
        );
    }

    #[test]
    fn numbers_and_options_are_read_as_protoc_reads_them() {
        // Options with brackets and braces in their values; hexadecimal numbers.
        let text = "message OrderPlaced { uint64 order_id = 1 [(a.b) = { list: [1, 2] }, deprecated = true]; string customer = 0x2; bytes signature = 3; }";
        assert_eq!(verdicts(text), vec![]);
        // Octal: 010 is 8, not 10.
        let octal = "message A { uint64 a = 010; }";
        assert_eq!(compare("message A { uint64 a = 8; }", octal), vec![]);
        let found = compare("message A { uint64 a = 10; }", octal);
        assert!(
            found[0].0
                && found[0]
                    .1
                    .starts_with("field `a` moved from number 10 to 8"),
            "{found:?}"
        );
        // Digits only: protoc takes no sign.
        for number in ["+5", "0x+1F", "0+7", "-1", "0x", "08"] {
            let text = format!("message A {{ uint64 a = {number}; }}");
            assert_eq!(
                compare(BASE, &text),
                vec![(
                    true,
                    format!(
                        "the Protobuf schema cannot be read (expected a field number, found `{number}`)"
                    )
                )],
                "{text}"
            );
        }
    }

    #[test]
    fn reserved_names_are_not_reserved_numbers() {
        // A removed field whose name alone is reserved still gets the advice for its number.
        let name_only = with("uint64 order_id = 1;\nreserved \"customer\";\nbytes signature = 3;");
        let found = verdicts(&name_only);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].1.contains("reserve its number (`reserved 2;`)"),
            "{found:?}"
        );
        // A new field taking a reserved name (editions write it as an identifier).
        let old = with("uint64 order_id = 1;\nreserved note;");
        let new = with("uint64 order_id = 1;\nstring note = 2;");
        let found = compare(&old, &new);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            !found[0].0 && found[0].1.contains("takes a name the baseline reserved"),
            "{found:?}"
        );
        // A field moved onto a reserved number: both are said.
        let old = with("uint64 order_id = 1;\nreserved 2;");
        let new = with("uint64 order_id = 2;");
        let found = compare(&old, &new);
        assert!(
            found
                .iter()
                .any(|(b, w)| *b && w.starts_with("field `order_id` moved from number 1 to 2")),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|(b, w)| *b && w.starts_with("field number 2 (`order_id`) was reserved")),
            "{found:?}"
        );
    }

    #[test]
    fn a_reserved_number_used_again_breaks() {
        let old = with("uint64 order_id = 1;\nreserved 2, 5 to 7;\nreserved \"customer\";");
        let new = with("uint64 order_id = 1;\nstring coupon = 6;");
        let found = compare(&old, &new);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].0
                && found[0]
                    .1
                    .starts_with("field number 6 (`coupon`) was reserved"),
            "{found:?}"
        );
    }

    #[test]
    fn type_and_cardinality_changes_break() {
        let widened = with("uint64 order_id = 1;\nstring customer = 2;\nstring signature = 3;");
        assert_eq!(breaking(&widened).len(), 1);
        let repeated =
            with("repeated uint64 order_id = 1;\nstring customer = 2;\nbytes signature = 3;");
        let found = breaking(&repeated);
        assert_eq!(found, vec!["field `order_id` (1) is repeated now: readers of the baseline read it as one value".to_owned()]);
        let map =
            with("uint64 order_id = 1;\nmap<string, string> customer = 2;\nbytes signature = 3;");
        assert!(breaking(&map)[0].starts_with("field number 2 reused"));
    }

    #[test]
    fn removals_additions_renames_and_presence_are_compatible() {
        let new = "syntax = \"proto3\";\nmessage OrderAccepted {\n  optional uint64 id = 1;\n  repeated uint32 lines = 4 [packed = false];\n  bytes signature = 3;\n}\n";
        let found = verdicts(new);
        assert!(found.iter().all(|(b, _)| !b), "{found:?}");
        let text: Vec<&str> = found.iter().map(|(_, w)| w.as_str()).collect();
        assert_eq!(
            text,
            vec![
                "the message was renamed from `OrderPlaced` to `OrderAccepted` (the binary form has no names)",
                "field 1 renamed from `order_id` to `id` (the binary form has numbers, not names; readers of its JSON form see the new name)",
                "field `id` (1) became `optional` (presence tracking only; the binary form is unchanged)",
                "field `customer` (2) removed: readers get its default value; reserve its number (`reserved 2;`) so that no later field reuses it",
                "new field `uint32 lines` (4)",
            ]
        );
        let reserved = with("uint64 order_id = 1;\nreserved 2;\nbytes signature = 3;");
        assert_eq!(
            verdicts(&reserved),
            vec![(
                false,
                "field `customer` (2) removed, its number reserved".to_owned()
            )]
        );
    }

    #[test]
    fn oneof_fields_nested_types_and_top_level_enums_are_read() {
        let text = "syntax = \"proto3\";\nenum Status { UNKNOWN = 0; }\nmessage OrderPlaced {\n  message Address { string city = 1; }\n  uint64 order_id = 1;\n  oneof who { string customer = 2; Address address = 4; }\n  bytes signature = 3;\n}\nmessage Other { string x = 1; }";
        let found = verdicts(text);
        assert_eq!(
            found,
            vec![
                (
                    false,
                    "field `customer` (2) moved into the new oneof `who` (safe for one field)"
                        .to_owned()
                ),
                (false, "new field `Address address` (4)".to_owned()),
            ]
        );
    }

    #[test]
    fn oneof_moves_that_lose_values_break() {
        let both =
            with("oneof who { uint64 order_id = 1; string customer = 2; }\nbytes signature = 3;");
        // Said once for the oneof, not once per member.
        assert_eq!(
            breaking(&both),
            vec!["fields `order_id`, `customer` moved into the new oneof `who`: a message written with several of them set keeps only one".to_owned()]
        );
        let old =
            with("uint64 order_id = 1;\noneof who { string customer = 2; }\nbytes signature = 3;");
        let into_existing =
            with("oneof who { uint64 order_id = 1; string customer = 2; }\nbytes signature = 3;");
        let found = compare(&old, &into_existing);
        assert!(
            found[0].0
                && found[0]
                    .1
                    .starts_with("field `order_id` (1) moved into an existing oneof (`who`)"),
            "{found:?}"
        );
        // Into the same oneof under a new name: still an existing one.
        let into_renamed =
            with("oneof party { uint64 order_id = 1; string customer = 2; }\nbytes signature = 3;");
        let found = compare(&old, &into_renamed);
        assert_eq!(
            found,
            vec![
                (true, "field `order_id` (1) moved into an existing oneof (`party`): a message that set it and another of the oneof keeps only one of them".to_owned()),
                (false, "oneof `who` renamed to `party`".to_owned()),
            ]
        );
        let out = compare(&old, BASE);
        assert!(
            out[0].0
                && out[0]
                    .1
                    .starts_with("field `customer` (2) left the oneof `who`"),
            "{out:?}"
        );
        let renamed = with(
            "uint64 order_id = 1;\noneof party { string customer = 2; }\nbytes signature = 3;",
        );
        assert_eq!(
            compare(&old, &renamed),
            vec![(false, "oneof `who` renamed to `party`".to_owned())]
        );
        // Renamed and given a new member: the old member did not leave it.
        let grown = with(
            "uint64 order_id = 1;\noneof party { string customer = 2; string coupon = 5; }\nbytes signature = 3;",
        );
        let found = compare(&old, &grown);
        assert!(found.iter().all(|(b, _)| !b), "{found:?}");
        assert!(
            found
                .iter()
                .any(|(_, w)| w == "oneof `who` renamed to `party`"),
            "{found:?}"
        );
    }

    #[test]
    fn a_schema_that_cannot_be_read_is_said_so() {
        for (text, why) in [
            ("syntax = \"proto3\";", "no message in it"),
            (
                "message A { uint64 a = 1; uint64 b = 1; }",
                "field number 1 is used twice (`a`)",
            ),
            (
                "message A { uint64 a = 1; string a = 2; }",
                "field name `a` is used twice",
            ),
            (
                "message A { uint64 a = 0; }",
                "field `a` has number 0, outside 1 to 536870911",
            ),
            ("message A { uint64 a = 1 ", "it ends too early"),
            ("message A { /* x }", "a comment that does not end"),
            (
                "message A { string a = \"1; }",
                "a string that does not end",
            ),
            (
                "message A { uint64 a = x; }",
                "expected a field number, found `x`",
            ),
            ("rpc A {}", "unexpected `rpc` at the top level"),
        ] {
            let found = compare(BASE, text);
            assert_eq!(
                found,
                vec![(true, format!("the Protobuf schema cannot be read ({why})"))],
                "{text}"
            );
        }
        let found = compare("x", BASE);
        assert!(
            found[0].0
                && found[0]
                    .1
                    .starts_with("the baseline's Protobuf schema cannot be read")
        );
    }
}
