//! Which changes to an Avro schema break consumers.
//!
//! An outbox consumer decodes an Avro payload with its writer schema, found by the
//! fingerprint the payload carries (`codec::avro`): any change to the schema's Parsing
//! Canonical Form (a field added or removed, a type, symbol, branch, size or name
//! changed, fields reordered) gives new messages a fingerprint that consumers deployed
//! before it do not know, so it is breaking unless the version is bumped, and the report
//! says so once. Each difference is also judged by Avro's own schema resolution (the
//! specification's "Schema Resolution"), for consumers that resolve with the writer
//! schema (a registry, `register_writer_schema`), in both directions that matter to an
//! outbox: readers of the old schema reading what the new one writes, and readers of the
//! new schema reading the backlog and replays the old one wrote.
//!
//! | change | Avro's resolution |
//! | --- | --- |
//! | a field removed that has no default in the old schema | breaking: old readers have no value for it |
//! | a field added without a default | breaking: new readers cannot read old messages |
//! | a field removed or added with a default | compatible |
//! | a field or named type renamed (aliases or not: old readers know only the old name) | breaking unless the old field has a default |
//! | a type changed; a promotion (`int` to `long`) or a union gaining the old type works one way only | breaking |
//! | a logical type, decimal precision or scale changed | breaking (same bytes, other values) |
//! | an enum symbol added (removed) without a `default` on the old (new) enum | breaking |
//! | a union branch added or removed | breaking |
//! | a fixed's size changed | breaking |
//! | documentation, aliases, defaults of fields on both sides | not a change |
//!
//! Pure JSON: it reads the schemas as the contract document writes them, so the check
//! needs no Avro library (and no feature).

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value, json};

/// Named types (records, enums, fixed) by full name, as a schema defines them.
type Names<'a> = HashMap<String, &'a Value>;

/// The differences between `old` and `new` (Avro schemas in their JSON form), each
/// with whether it breaks consumers.
pub(super) fn compare(old: &Value, new: &Value) -> Vec<(bool, String)> {
    let mut walk = Walk {
        old_names: HashMap::new(),
        new_names: HashMap::new(),
        seen: HashSet::new(),
        found: Vec::new(),
    };
    collect(old, None, &mut walk.old_names);
    collect(new, None, &mut walk.new_names);
    walk.compare("", (old, None), (new, None));
    if canonical(old, None) != canonical(new, None) {
        walk.found.push((
            true,
            "the schema's Parsing Canonical Form changed, so its fingerprint did: outbox consumers decode a payload only with its writer schema, so deploy them with the new schema registered (`outbox::codec::avro::register_writer_schema`) before the producer, or bump the version".to_owned(),
        ));
    }
    walk.found
}

struct Walk<'a> {
    old_names: Names<'a>,
    new_names: Names<'a>,
    /// Named type pairs already compared (recursive records), by full name.
    seen: HashSet<(String, String)>,
    found: Vec<(bool, String)>,
}

const PRIMITIVES: &[&str] = &[
    "null", "boolean", "int", "long", "float", "double", "bytes", "string",
];

/// A schema and the namespace it is written in (its enclosing named type's).
type In<'a, 'n> = (&'a Value, Option<&'n str>);

/// The full name of a named type: `namespace.name`, the namespace inherited.
fn full_name(schema: &Value, namespace: Option<&str>) -> Option<String> {
    let name = schema.get("name")?.as_str()?;
    Some(qualify(
        name,
        schema
            .get("namespace")
            .and_then(Value::as_str)
            .or(namespace),
    ))
}

fn qualify(name: &str, namespace: Option<&str>) -> String {
    match namespace {
        _ if name.contains('.') => name.to_owned(),
        Some(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_owned(),
    }
}

/// The namespace names inside the named type `full` are written in.
fn namespace_of(full: &str) -> Option<&str> {
    full.rsplit_once('.').map(|(ns, _)| ns)
}

fn is_named(kind: &str) -> bool {
    matches!(kind, "record" | "error" | "enum" | "fixed")
}

fn collect<'a>(schema: &'a Value, namespace: Option<&str>, names: &mut Names<'a>) {
    match schema {
        Value::Array(branches) => branches.iter().for_each(|b| collect(b, namespace, names)),
        Value::Object(map) => {
            let kind = map.get("type").and_then(Value::as_str).unwrap_or_default();
            let full = is_named(kind)
                .then(|| full_name(schema, namespace))
                .flatten();
            let inner = match &full {
                Some(full) => namespace_of(full),
                None => namespace,
            };
            match kind {
                "record" | "error" => {
                    for f in fields(schema) {
                        if let Some(t) = f.get("type") {
                            collect(t, inner, names);
                        }
                    }
                }
                "array" => map
                    .get("items")
                    .iter()
                    .for_each(|t| collect(t, inner, names)),
                "map" => map
                    .get("values")
                    .iter()
                    .for_each(|t| collect(t, inner, names)),
                _ => {
                    // `{"type": {...}}`: a type wrapped in an object.
                    if let Some(t @ (Value::Object(_) | Value::Array(_))) = map.get("type") {
                        collect(t, inner, names);
                    }
                }
            }
            if let Some(full) = full {
                names.entry(full).or_insert(schema);
            }
        }
        _ => {}
    }
}

fn fields(schema: &Value) -> &[Value] {
    schema
        .get("fields")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn field_name(f: &Value) -> &str {
    f.get("name").and_then(Value::as_str).unwrap_or_default()
}

fn show(path: &str) -> String {
    if path.is_empty() {
        "the payload".to_owned()
    } else {
        format!("`{path}`")
    }
}

/// The Parsing Canonical Form's content (what the fingerprint covers), as a value:
/// full names, and only `name`, `type`, `fields`, `symbols`, `items`, `values`, `size`.
fn canonical(schema: &Value, namespace: Option<&str>) -> Value {
    match schema {
        Value::String(s) if PRIMITIVES.contains(&s.as_str()) => schema.clone(),
        Value::String(name) => json!(qualify(name, namespace)),
        Value::Array(branches) => {
            Value::Array(branches.iter().map(|b| canonical(b, namespace)).collect())
        }
        Value::Object(map) => {
            let kind = match map.get("type") {
                Some(Value::String(k)) => k.as_str(),
                Some(other) => return canonical(other, namespace),
                None => return Value::Null,
            };
            let mut out = Map::new();
            let full = is_named(kind)
                .then(|| full_name(schema, namespace))
                .flatten();
            let inner = match &full {
                Some(full) => namespace_of(full),
                None => namespace,
            };
            if let Some(full) = &full {
                out.insert("name".into(), json!(full));
            }
            match kind {
                "record" | "error" => {
                    out.insert("type".into(), json!("record"));
                    let fields = fields(schema)
                        .iter()
                        .map(|f| {
                            json!({
                                "name": field_name(f),
                                "type": f.get("type").map_or(Value::Null, |t| canonical(t, inner)),
                            })
                        })
                        .collect();
                    out.insert("fields".into(), Value::Array(fields));
                }
                "enum" | "fixed" => {
                    out.insert("type".into(), json!(kind));
                    for key in ["symbols", "size"] {
                        if let Some(v) = map.get(key) {
                            out.insert(key.into(), v.clone());
                        }
                    }
                }
                "array" | "map" => {
                    out.insert("type".into(), json!(kind));
                    for key in ["items", "values"] {
                        if let Some(v) = map.get(key) {
                            out.insert(key.into(), canonical(v, inner));
                        }
                    }
                }
                _ if full.is_none() => return canonical(&json!(kind), namespace),
                _ => {
                    out.insert("type".into(), json!(kind));
                }
            }
            Value::Object(out)
        }
        _ => schema.clone(),
    }
}

impl<'a> Walk<'a> {
    /// A type with a reference to a named type replaced by its definition, and the
    /// namespace the result is written in.
    fn resolve<'n>(&self, (schema, ns): In<'a, 'n>, old: bool) -> (&'a Value, Option<String>) {
        let names = if old {
            &self.old_names
        } else {
            &self.new_names
        };
        match schema {
            Value::String(name) if !PRIMITIVES.contains(&name.as_str()) => {
                let full = qualify(name, ns);
                match names.get(&full).or_else(|| names.get(name)) {
                    Some(def) => (def, namespace_of(&full).map(str::to_owned)),
                    None => (schema, ns.map(str::to_owned)),
                }
            }
            Value::Object(map) => match map.get("type") {
                // `{"type": "long"}` or `{"type": {...}}`: the type inside, unless the
                // object is a named or complex type itself, or carries a logical type.
                Some(t)
                    if !t
                        .as_str()
                        .is_some_and(|k| is_named(k) || k == "array" || k == "map")
                        && map.get("logicalType").is_none() =>
                {
                    self.resolve((t, ns), old)
                }
                _ => (schema, ns.map(str::to_owned)),
            },
            _ => (schema, ns.map(str::to_owned)),
        }
    }

    fn compare(&mut self, path: &str, old: In<'a, '_>, new: In<'a, '_>) {
        let (old, old_ns) = self.resolve(old, true);
        let (new, new_ns) = self.resolve(new, false);
        let (old_ns, new_ns) = (old_ns.as_deref(), new_ns.as_deref());
        let (old_kind, new_kind) = (kind(old), kind(new));
        if old_kind != new_kind {
            // Readers of the old schema reading new messages, and the other way round.
            let forward = self.reads((new, new_ns), false, (old, old_ns), true);
            let backward = self.reads((old, old_ns), true, (new, new_ns), false);
            let why = match (forward, backward) {
                (true, true) => "each side's readers read the other's messages".to_owned(),
                (false, true) => {
                    format!("readers of the old schema cannot read {new_kind} values as {old_kind}")
                }
                (true, false) => format!(
                    "readers of the new schema cannot read old messages' {old_kind} values as {new_kind}"
                ),
                (false, false) => "neither schema's readers read the other's messages".to_owned(),
            };
            self.found.push((
                !(forward && backward),
                format!(
                    "{} changed type from {old_kind} to {new_kind}: {why}",
                    show(path)
                ),
            ));
            return;
        }
        for key in ["logicalType", "precision", "scale"] {
            let (a, b) = (old.get(key), new.get(key));
            if a != b {
                let show_v = |v: Option<&Value>| v.map_or("none".to_owned(), Value::to_string);
                self.found.push((
                    true,
                    format!(
                        "{}'s {key} changed from {} to {}: the same bytes mean other values",
                        show(path),
                        show_v(a),
                        show_v(b)
                    ),
                ));
            }
        }
        if is_named(&old_kind) {
            let on = full_name(old, old_ns).unwrap_or_default();
            let nn = full_name(new, new_ns).unwrap_or_default();
            if !self.seen.insert((on.clone(), nn.clone())) {
                return;
            }
            if on != nn {
                self.found.push((
                    true,
                    format!(
                        "{} was renamed from `{on}` to `{nn}`: readers of the old schema know only the old name",
                        show(path)
                    ),
                ));
            }
            let (old_inner, new_inner) = (namespace_of(&on), namespace_of(&nn));
            match old_kind.as_str() {
                "enum" => self.enums(path, old, new),
                "fixed" => {
                    let (a, b) = (old.get("size"), new.get("size"));
                    if a != b {
                        let show_v =
                            |v: Option<&Value>| v.map_or("none".to_owned(), Value::to_string);
                        self.found.push((
                            true,
                            format!(
                                "{}'s size changed from {} to {}",
                                show(path),
                                show_v(a),
                                show_v(b)
                            ),
                        ));
                    }
                }
                _ => self.records(path, (old, old_inner), (new, new_inner)),
            }
            return;
        }
        match old_kind.as_str() {
            "array" => {
                if let (Some(a), Some(b)) = (old.get("items"), new.get("items")) {
                    self.compare(&format!("{path}[]"), (a, old_ns), (b, new_ns));
                }
            }
            "map" => {
                if let (Some(a), Some(b)) = (old.get("values"), new.get("values")) {
                    self.compare(&format!("{path}{{}}"), (a, old_ns), (b, new_ns));
                }
            }
            "union" => self.unions(path, (old, old_ns), (new, new_ns)),
            _ => {}
        }
    }

    fn records(&mut self, path: &str, (old, old_ns): In<'a, '_>, (new, new_ns): In<'a, '_>) {
        let join = |name: &str| {
            if path.is_empty() {
                name.to_owned()
            } else {
                format!("{path}.{name}")
            }
        };
        let mut matched_new = HashSet::new();
        for of in fields(old) {
            let name = field_name(of);
            // The same name, else a field that names this one among its aliases (each
            // new field matched once: a schema may repeat a name).
            let free = |j: &usize| !matched_new.contains(j);
            let matching = (0..fields(new).len())
                .filter(free)
                .find(|j| field_name(&fields(new)[*j]) == name)
                .or_else(|| {
                    (0..fields(new).len()).filter(free).find(|j| {
                        fields(new)[*j]
                            .get("aliases")
                            .and_then(Value::as_array)
                            .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(name)))
                    })
                });
            match matching {
                Some(j) => {
                    matched_new.insert(j);
                    let nf = &fields(new)[j];
                    if field_name(nf) != name {
                        self.found.push((
                            of.get("default").is_none(),
                            format!(
                                "`{}` was renamed to `{}`{}",
                                join(name),
                                field_name(nf),
                                if of.get("default").is_none() {
                                    ": readers of the old schema cannot read new messages (they look for the old name, which has no default)"
                                } else {
                                    " (readers of the old schema use the old field's default)"
                                }
                            ),
                        ));
                    }
                    if let (Some(a), Some(b)) = (of.get("type"), nf.get("type")) {
                        self.compare(&join(name), (a, old_ns), (b, new_ns));
                    }
                }
                _ if of.get("default").is_none() => self.found.push((
                    true,
                    format!(
                        "`{}` was removed, and the old schema gives it no default: readers of the old schema cannot read new messages",
                        join(name)
                    ),
                )),
                _ => self.found.push((
                    false,
                    format!("`{}` was removed (readers of the old schema use its default)", join(name)),
                )),
            }
        }
        for (j, nf) in fields(new).iter().enumerate() {
            if matched_new.contains(&j) {
                continue;
            }
            let name = field_name(nf);
            if nf.get("default").is_none() {
                self.found.push((
                    true,
                    format!(
                        "`{}` was added without a default: readers of the new schema cannot read messages written before (the backlog, replays)",
                        join(name)
                    ),
                ));
            } else {
                self.found
                    .push((false, format!("`{}` was added with a default", join(name))));
            }
        }
    }

    fn enums(&mut self, path: &str, old: &'a Value, new: &'a Value) {
        let symbols = |s: &'a Value| -> Vec<&'a str> {
            s.get("symbols")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default()
        };
        let (a, b) = (symbols(old), symbols(new));
        let added: Vec<&str> = b.iter().filter(|s| !a.contains(s)).copied().collect();
        let removed: Vec<&str> = a.iter().filter(|s| !b.contains(s)).copied().collect();
        if !added.is_empty() {
            self.found.push((
                old.get("default").is_none(),
                format!(
                    "{} gained the symbols {added:?}{}",
                    show(path),
                    if old.get("default").is_none() {
                        ": readers of the old schema cannot read them (the old enum has no `default`)"
                    } else {
                        " (readers of the old schema read them as the enum's default)"
                    }
                ),
            ));
        }
        if !removed.is_empty() {
            self.found.push((
                new.get("default").is_none(),
                format!(
                    "{} lost the symbols {removed:?}{}",
                    show(path),
                    if new.get("default").is_none() {
                        ": readers of the new schema cannot read old messages that hold them"
                    } else {
                        " (readers of the new schema read them as the enum's default)"
                    }
                ),
            ));
        }
    }

    /// A union's branches, each with its label (a named type's full name, else its
    /// kind) and the namespace it is written in.
    fn branches<'n>(&self, (union, ns): In<'a, 'n>, old: bool) -> Vec<(String, In<'a, 'n>)> {
        union
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(|b| {
                let (r, r_ns) = self.resolve((b, ns), old);
                let label = full_name(r, r_ns.as_deref()).unwrap_or_else(|| kind(r));
                (label, (b, ns))
            })
            .collect()
    }

    /// Whether values of `writer` (resolved, a type of another kind than the reader's)
    /// are read by `reader`: a promotion, or a reader's union with a branch that reads
    /// them. A writer's union is read by no single type.
    fn reads(
        &self,
        writer: In<'a, '_>,
        writer_old: bool,
        reader: In<'a, '_>,
        reader_old: bool,
    ) -> bool {
        let (w, w_ns) = writer;
        let w_kind = kind(w);
        let w_label = full_name(w, w_ns).unwrap_or_else(|| w_kind.clone());
        let r_kind = kind(reader.0);
        let _ = writer_old;
        if promotion(&w_kind, &r_kind).is_some() {
            return true;
        }
        r_kind == "union"
            && self
                .branches(reader, reader_old)
                .iter()
                .any(|(label, _)| *label == w_label || promotion(&w_kind, label).is_some())
    }

    fn unions(&mut self, path: &str, old: In<'a, '_>, new: In<'a, '_>) {
        let a = self.branches(old, true);
        let b = self.branches(new, false);
        let labels =
            |v: &[(String, In<'a, '_>)]| v.iter().map(|(l, _)| l.clone()).collect::<Vec<_>>();
        let (la, lb) = (labels(&a), labels(&b));
        let added: Vec<&String> = lb.iter().filter(|x| !la.contains(x)).collect();
        let removed: Vec<&String> = la.iter().filter(|x| !lb.contains(x)).collect();
        if !added.is_empty() {
            self.found.push((
                true,
                format!(
                    "{} may now hold {added:?}: readers of the old schema cannot read those",
                    show(path)
                ),
            ));
        }
        if !removed.is_empty() {
            self.found.push((
                true,
                format!(
                    "{} can no longer hold {removed:?}: readers of the new schema cannot read old messages that do",
                    show(path)
                ),
            ));
        }
        // Branches of one label on both sides, paired in order (two arrays, two maps).
        let mut used = HashSet::new();
        for (label, old_branch) in &a {
            if let Some(j) = (0..b.len()).find(|j| b[*j].0 == *label && !used.contains(j)) {
                used.insert(j);
                self.compare(path, *old_branch, b[j].1);
            }
        }
    }
}

/// The kind of a resolved type: a primitive's name, `record`, `enum`, `fixed`,
/// `array`, `map`, `union` (logical types are compared on their own).
fn kind(schema: &Value) -> String {
    match schema {
        Value::String(s) => s.clone(),
        Value::Array(_) => "union".to_owned(),
        Value::Object(map) => match map.get("type") {
            Some(Value::String(t)) if t == "error" => "record".to_owned(),
            Some(Value::String(t)) => t.clone(),
            Some(other) => kind(other),
            None => "unknown".to_owned(),
        },
        _ => "unknown".to_owned(),
    }
}

/// Whether a writer's `from` is read as `to` by Avro's promotions.
fn promotion(from: &str, to: &str) -> Option<()> {
    matches!(
        (from, to),
        ("int", "long" | "float" | "double")
            | ("long", "float" | "double")
            | ("float", "double")
            | ("string", "bytes")
            | ("bytes", "string")
    )
    .then_some(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::compare;

    fn order(fields: serde_json::Value) -> serde_json::Value {
        json!({"type": "record", "name": "OrderPlaced", "namespace": "shop", "fields": fields})
    }

    /// The verdicts by Avro's resolution, and whether the fingerprint changed.
    fn verdicts(old: &serde_json::Value, new: &serde_json::Value) -> (Vec<(bool, String)>, bool) {
        let mut found = compare(old, new);
        let fingerprint = found
            .iter()
            .position(|(_, w)| w.starts_with("the schema's Parsing Canonical Form changed"));
        if let Some(i) = fingerprint {
            assert!(found[i].0, "a new fingerprint breaks outbox consumers");
            found.remove(i);
        }
        (found, fingerprint.is_some())
    }

    fn breaking(found: &[(bool, String)]) -> Vec<&str> {
        found
            .iter()
            .filter(|(b, _)| *b)
            .map(|(_, w)| w.as_str())
            .collect()
    }

    #[test]
    fn a_field_removed_without_a_default_breaks_and_with_one_does_not() {
        let old = order(json!([
            {"name": "id", "type": "long"},
            {"name": "note", "type": "string"},
            {"name": "coupon", "type": ["null", "string"], "default": null},
        ]));
        let new = order(json!([{"name": "id", "type": "long"}]));
        let (found, fingerprint) = verdicts(&old, &new);
        assert!(fingerprint);
        assert_eq!(
            breaking(&found),
            [
                "`note` was removed, and the old schema gives it no default: readers of the old schema cannot read new messages"
            ],
            "{found:?}"
        );
        assert!(
            found.contains(&(
                false,
                "`coupon` was removed (readers of the old schema use its default)".to_owned()
            )),
            "{found:?}"
        );
    }

    #[test]
    fn a_field_added_needs_a_default_for_the_backlog_and_a_new_fingerprint_either_way() {
        let old = order(json!([{"name": "id", "type": "long"}]));
        let with = order(json!([
            {"name": "id", "type": "long"},
            {"name": "note", "type": "string", "default": ""},
        ]));
        let (found, fingerprint) = verdicts(&old, &with);
        assert!(breaking(&found).is_empty(), "{found:?}");
        assert!(fingerprint, "outbox consumers need the new schema first");
        let without = order(json!([
            {"name": "id", "type": "long"},
            {"name": "note", "type": "string"},
        ]));
        let (found, _) = verdicts(&old, &without);
        assert_eq!(breaking(&found).len(), 1, "{found:?}");
        assert!(breaking(&found)[0].starts_with("`note` was added without a default"));
    }

    #[test]
    fn documentation_aliases_and_spelled_out_namespaces_are_not_changes() {
        let old = order(
            json!([{"name": "to", "type": {"type": "record", "name": "Address", "fields": [{"name": "city", "type": "string"}]}}]),
        );
        let new = json!({"type": "record", "name": "shop.OrderPlaced", "doc": "An order", "aliases": ["Placed"], "fields": [
            {"name": "to", "doc": "where", "type": {"type": "record", "name": "Address", "namespace": "shop", "fields": [{"name": "city", "type": {"type": "string"}}]}},
        ]});
        assert!(compare(&old, &new).is_empty(), "{:?}", compare(&old, &new));
        // Two records of one short name in two namespaces: each reference finds its own.
        let two = |city: &str| {
            json!({"type": "record", "name": "a.Pair", "fields": [
                {"name": "x", "type": {"type": "record", "name": "Address", "fields": [{"name": "city", "type": city}]}},
                {"name": "y", "type": {"type": "record", "name": "b.Address", "fields": [{"name": "zip", "type": "string"}]}},
                {"name": "z", "type": "Address"},
            ]})
        };
        assert!(compare(&two("string"), &two("string")).is_empty());
        let (found, _) = verdicts(&two("string"), &two("bytes"));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0]
                .1
                .starts_with("`x.city` changed type from string to bytes"),
            "{found:?}"
        );
    }

    #[test]
    fn type_changes_renames_and_aliases() {
        let old = order(json!([{"name": "id", "type": "int"}]));
        let new = order(json!([{"name": "id", "type": "long"}]));
        assert_eq!(
            breaking(&verdicts(&old, &new).0),
            [
                "`id` changed type from int to long: readers of the old schema cannot read long values as int"
            ]
        );
        // A value made optional: new readers read old messages, old readers not a null.
        let old = order(json!([{"name": "note", "type": "string"}]));
        let new = order(json!([{"name": "note", "type": ["null", "string"]}]));
        assert_eq!(
            breaking(&verdicts(&old, &new).0),
            [
                "`note` changed type from string to union: readers of the old schema cannot read union values as string"
            ]
        );
        // A renamed field: old readers look for the old name.
        let old = order(json!([{"name": "id", "type": "long"}]));
        let new = order(json!([{"name": "order_id", "type": "long", "aliases": ["id"]}]));
        assert_eq!(breaking(&verdicts(&old, &new).0).len(), 1);
        let defaulted = order(json!([{"name": "id", "type": "long", "default": 0}]));
        assert!(breaking(&verdicts(&defaulted, &new).0).is_empty());
        // A renamed record breaks, alias or not.
        let aliased = json!({"type": "record", "name": "Placed", "namespace": "shop", "aliases": ["shop.OrderPlaced"], "fields": [{"name": "id", "type": "long"}]});
        assert_eq!(breaking(&verdicts(&old, &aliased).0).len(), 1);
        // A logical type changed: the same bytes, the fingerprint unchanged, other values.
        let at = |unit: &str| {
            order(json!([{"name": "at", "type": {"type": "long", "logicalType": unit}}]))
        };
        let found = compare(&at("timestamp-millis"), &at("timestamp-micros"));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].0 && found[0].1.starts_with("`at`'s logicalType changed"),
            "{found:?}"
        );
        // A fixed decimal's size is compared (its logical type aside).
        let dec = |size: u32| {
            order(
                json!([{"name": "amount", "type": {"type": "fixed", "name": "Amount", "size": size, "logicalType": "decimal", "precision": 9, "scale": 2}}]),
            )
        };
        assert!(breaking(&verdicts(&dec(8), &dec(16)).0)[0].contains("size changed from 8 to 16"));
    }

    /// Found by the `contract_compat` fuzz target: a record that repeats a field name
    /// (not valid Avro, but a document may say it) matched both old fields to the first
    /// new one, and reported a schema compared with itself as changed.
    #[test]
    fn a_repeated_field_name_compared_with_itself_is_no_change() {
        let s = order(json!([
            {"name": "id", "type": "long", "aliases": ["id", "id"]},
            {"name": "id", "type": {"type": "record", "name": "Line", "fields": []}},
        ]));
        assert!(compare(&s, &s).is_empty(), "{:?}", compare(&s, &s));
    }

    #[test]
    fn nested_records_enums_and_unions() {
        let address = |fields: serde_json::Value| json!({"type": "record", "name": "Address", "fields": fields});
        let status = |symbols: serde_json::Value| json!({"type": "enum", "name": "Status", "symbols": symbols});
        let old = order(json!([
            {"name": "to", "type": address(json!([{"name": "city", "type": "string"}]))},
            {"name": "from", "type": "Address"},
            {"name": "status", "type": status(json!(["NEW", "PAID"]))},
            {"name": "note", "type": ["null", "string"]},
        ]));
        let new = order(json!([
            {"name": "to", "type": address(json!([]))},
            {"name": "from", "type": "shop.Address"},
            {"name": "status", "type": status(json!(["NEW", "PAID", "SHIPPED"]))},
            {"name": "note", "type": ["null", "string", "long"]},
        ]));
        let (found, fingerprint) = verdicts(&old, &new);
        assert!(fingerprint);
        let b = breaking(&found);
        assert!(
            b.iter().any(|w| w.starts_with("`to.city` was removed")),
            "{found:?}"
        );
        assert!(
            b.iter()
                .any(|w| w.starts_with("`status` gained the symbols [\"SHIPPED\"]")),
            "{found:?}"
        );
        assert!(
            b.iter()
                .any(|w| w.starts_with("`note` may now hold [\"long\"]")),
            "{found:?}"
        );
        // `from` refers to the same record: compared once, nothing more.
        assert_eq!(b.len(), 3, "{found:?}");
        assert!(compare(&old, &old).is_empty());
        // Branches of one kind are paired in order: a schema against itself is no change.
        let arrays = order(
            json!([{"name": "v", "type": [{"type": "array", "items": "int"}, {"type": "map", "values": "long"}, {"type": "array", "items": "string"}]}]),
        );
        assert!(
            compare(&arrays, &arrays).is_empty(),
            "{:?}",
            compare(&arrays, &arrays)
        );
    }
}
