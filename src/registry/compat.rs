//! Schema canonicalization and compatibility levels, by Avro's schema
//! resolution rules.
//!
//! Guarantee: two schema texts that differ only in whitespace or in the
//! order of JSON object attributes have the same canonical text (so the same
//! id); a schema is accepted under a level only if Avro resolution succeeds
//! fully in the direction(s) the level demands. A partial resolution (a
//! writer enum symbol or union branch the reader lacks) counts as
//! incompatible, as in Avro's Java checker that Confluent uses.

use std::fmt;
use std::str::FromStr;

use apache_avro::schema_compatibility::{Compatibility, SchemaCompatibility};
use apache_avro::Schema;

/// A compatibility level, as Confluent names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    None,
    Backward,
    BackwardTransitive,
    Forward,
    ForwardTransitive,
    Full,
    FullTransitive,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::None => "NONE",
            Level::Backward => "BACKWARD",
            Level::BackwardTransitive => "BACKWARD_TRANSITIVE",
            Level::Forward => "FORWARD",
            Level::ForwardTransitive => "FORWARD_TRANSITIVE",
            Level::Full => "FULL",
            Level::FullTransitive => "FULL_TRANSITIVE",
        }
    }

    fn transitive(self) -> bool {
        matches!(
            self,
            Level::BackwardTransitive | Level::ForwardTransitive | Level::FullTransitive
        )
    }

    /// (new schema must read old data, old schema must read new data)
    fn directions(self) -> (bool, bool) {
        match self {
            Level::None => (false, false),
            Level::Backward | Level::BackwardTransitive => (true, false),
            Level::Forward | Level::ForwardTransitive => (false, true),
            Level::Full | Level::FullTransitive => (true, true),
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Level, String> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "NONE" => Level::None,
            "BACKWARD" => Level::Backward,
            "BACKWARD_TRANSITIVE" => Level::BackwardTransitive,
            "FORWARD" => Level::Forward,
            "FORWARD_TRANSITIVE" => Level::ForwardTransitive,
            "FULL" => Level::Full,
            "FULL_TRANSITIVE" => Level::FullTransitive,
            _ => return Err(format!("Invalid compatibility level: '{s}'")),
        })
    }
}

/// A parsed schema with its canonical text.
#[derive(Debug, Clone)]
pub struct ParsedSchema {
    pub schema: Schema,
    pub canonical: String,
}

/// Parses an Avro schema and canonicalizes its JSON: object keys sorted,
/// no insignificant whitespace. Arrays (field order, symbols) keep order,
/// because order is meaningful there.
pub fn parse(text: &str) -> Result<ParsedSchema, String> {
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("Invalid schema: not JSON: {e}"))?;
    let canonical = canonical_json(&json);
    let schema = Schema::parse_str(&canonical).map_err(|e| format!("Invalid schema: {e}"))?;
    Ok(ParsedSchema { schema, canonical })
}

fn canonical_json(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let body: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical_json(&map[k])))
                .collect();
            format!("{{{}}}", body.join(","))
        }
        Value::Array(items) => {
            let body: Vec<String> = items.iter().map(canonical_json).collect();
            format!("[{}]", body.join(","))
        }
        other => other.to_string(),
    }
}

/// Replaces references to named types with their definitions; a recursive
/// reference stays a reference. The checker matches a reference only with a
/// reference of the same name, so without this a type defined in one field
/// and referenced from another would look incompatible once the defining
/// field moves (for example after a column is dropped).
fn inline_refs(schema: &Schema) -> Schema {
    use apache_avro::schema::{ArraySchema, MapSchema, Name, ResolvedSchema, UnionSchema};
    use std::collections::HashMap;
    fn go(s: &Schema, names: &HashMap<Name, &Schema>, stack: &mut Vec<Name>) -> Schema {
        match s {
            Schema::Ref { name } if !stack.contains(name) => match names.get(name) {
                Some(def) => go(def, names, stack),
                None => s.clone(),
            },
            Schema::Record(r) => {
                stack.push(r.name.clone());
                let mut r = r.clone();
                for f in &mut r.fields {
                    f.schema = go(&f.schema, names, stack);
                }
                stack.pop();
                Schema::Record(r)
            }
            Schema::Union(u) => {
                let variants = u.variants().iter().map(|v| go(v, names, stack)).collect();
                UnionSchema::new(variants)
                    .map(Schema::Union)
                    .unwrap_or_else(|_| s.clone())
            }
            Schema::Array(a) => Schema::Array(ArraySchema {
                items: Box::new(go(&a.items, names, stack)),
                attributes: a.attributes.clone(),
            }),
            Schema::Map(m) => Schema::Map(MapSchema {
                types: Box::new(go(&m.types, names, stack)),
                attributes: m.attributes.clone(),
            }),
            other => other.clone(),
        }
    }
    match ResolvedSchema::try_from(schema) {
        Ok(resolved) => {
            let names: HashMap<Name, &Schema> = resolved
                .get_names()
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            go(schema, &names, &mut Vec::new())
        }
        Err(_) => schema.clone(),
    }
}

/// Whether `reader` can fully read data written with `writer`.
pub fn can_read(writer: &Schema, reader: &Schema) -> Result<(), String> {
    let (writer, reader) = (&inline_refs(writer), &inline_refs(reader));
    match SchemaCompatibility::can_read(writer, reader) {
        Ok(Compatibility::Full) => Ok(()),
        Ok(Compatibility::Partial) => Err(
            "the reader lacks an enum symbol or union branch that the writer can produce"
                .to_string(),
        ),
        Err(e) => Err(e.to_string()),
    }
}

/// Checks `new` against the existing versions (oldest first) under `level`.
/// Returns one message per incompatibility; empty means compatible.
pub fn check(level: Level, new: &Schema, existing: &[(i32, Schema)]) -> Vec<String> {
    let (backward, forward) = level.directions();
    let against: &[(i32, Schema)] = if level.transitive() {
        existing
    } else {
        existing.last().map(std::slice::from_ref).unwrap_or(&[])
    };
    let mut problems = Vec::new();
    for (version, old) in against {
        if backward {
            if let Err(e) = can_read(old, new) {
                problems.push(format!(
                    "{level}: the new schema cannot read data written with version {version}: {e}"
                ));
            }
        }
        if forward {
            if let Err(e) = can_read(new, old) {
                problems.push(format!(
                    "{level}: version {version} cannot read data written with the new schema: {e}"
                ));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Schema {
        parse(text)
            .map(|p| p.schema)
            .unwrap_or_else(|e| panic!("{e}: {text}"))
    }

    const V1: &str = r#"{"type":"record","name":"Order","fields":[{"name":"id","type":"long"},{"name":"amount","type":"int"}]}"#;

    fn with_fields(fields: &str) -> Schema {
        s(&format!(
            r#"{{"type":"record","name":"Order","fields":[{fields}]}}"#
        ))
    }

    #[test]
    fn canonical_form_ignores_whitespace_and_attribute_order() -> Result<(), String> {
        let a = parse(V1)?;
        let b = parse(
            r#"{ "fields": [ {"type": "long", "name": "id"}, {"type":"int","name":"amount"} ],
                 "name": "Order", "type": "record" }"#,
        )?;
        assert_eq!(a.canonical, b.canonical);
        let reordered = parse(
            r#"{"type":"record","name":"Order","fields":[{"name":"amount","type":"int"},{"name":"id","type":"long"}]}"#,
        )?;
        assert_ne!(
            a.canonical, reordered.canonical,
            "field order is meaningful"
        );
        Ok(())
    }

    #[test]
    fn invalid_schemas_are_refused() {
        assert!(parse("{not json").is_err());
        assert!(parse(r#"{"type":"record","name":"X"}"#).is_err());
        assert!(parse(r#"{"type":"nosuchtype"}"#).is_err());
    }

    #[test]
    fn level_names_parse_case_insensitively() {
        assert_eq!(
            "full_transitive".parse::<Level>(),
            Ok(Level::FullTransitive)
        );
        assert!("SIDEWAYS".parse::<Level>().is_err());
    }

    // (level, new fields, compatible?) against V1.
    #[test]
    fn each_level_accepts_and_refuses_the_right_changes() {
        let v1 = vec![(1, s(V1))];
        let add_with_default = r#"{"name":"id","type":"long"},{"name":"amount","type":"int"},{"name":"note","type":["null","string"],"default":null}"#;
        let add_without_default = r#"{"name":"id","type":"long"},{"name":"amount","type":"int"},{"name":"note","type":"string"}"#;
        let remove_field = r#"{"name":"id","type":"long"}"#;
        let change_type = r#"{"name":"id","type":"long"},{"name":"amount","type":"string"}"#;
        let promote = r#"{"name":"id","type":"long"},{"name":"amount","type":"long"}"#;
        let rename_alias =
            r#"{"name":"id","type":"long"},{"name":"total","aliases":["amount"],"type":"int"}"#;
        let rename_bare = r#"{"name":"id","type":"long"},{"name":"total","type":"int"}"#;
        let cases: &[(Level, &str, bool)] = &[
            (Level::Backward, add_with_default, true),
            (Level::Backward, add_without_default, false),
            (Level::Backward, remove_field, true),
            (Level::Backward, change_type, false),
            (Level::Backward, promote, true),
            (Level::Backward, rename_alias, true),
            (Level::Backward, rename_bare, false),
            (Level::Forward, add_with_default, true),
            (Level::Forward, add_without_default, true),
            (Level::Forward, remove_field, false),
            (Level::Forward, promote, false),
            (Level::Full, add_with_default, true),
            (Level::Full, add_without_default, false),
            (Level::Full, remove_field, false),
            (Level::Full, promote, false),
            (Level::None, change_type, true),
        ];
        for (level, fields, expected) in cases {
            let problems = check(*level, &with_fields(fields), &v1);
            assert_eq!(
                problems.is_empty(),
                *expected,
                "{level} with [{fields}]: {problems:?}"
            );
        }
    }

    #[test]
    fn transitive_levels_check_every_version_not_just_the_latest() {
        // v1 {id}; v2 {id, note default}: dropping the default in v3 makes
        // v3 unable to read v1 data, although it can read v2 data.
        let v1 = with_fields(r#"{"name":"id","type":"long"}"#);
        let v2 = with_fields(
            r#"{"name":"id","type":"long"},{"name":"note","type":"string","default":""}"#,
        );
        let v3 = with_fields(r#"{"name":"id","type":"long"},{"name":"note","type":"string"}"#);
        let history = vec![(1, v1), (2, v2)];
        assert!(check(Level::Backward, &v3, &history).is_empty());
        let problems = check(Level::BackwardTransitive, &v3, &history);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("version 1"), "{problems:?}");
        assert!(!check(Level::FullTransitive, &v3, &history).is_empty());
        assert!(check(Level::ForwardTransitive, &v3, &history).is_empty());
    }

    #[test]
    fn a_named_type_may_move_between_fields() {
        // v1 defines the enum in `a` and references it from `b`; v2 drops
        // `a`, so `b` defines it. Dropping a field stays BACKWARD compatible.
        let v1 = s(r#"{"type":"record","name":"R","fields":[
            {"name":"a","type":["null",{"type":"enum","name":"E","symbols":["X"]}],"default":null},
            {"name":"b","type":["null","E"],"default":null}]}"#);
        let v2 = s(r#"{"type":"record","name":"R","fields":[
            {"name":"b","type":["null",{"type":"enum","name":"E","symbols":["X"]}],"default":null}]}"#);
        assert!(check(Level::Full, &v2, &[(1, v1)]).is_empty());
    }

    #[test]
    fn recursive_types_are_checked_without_looping() {
        let list = s(r#"{"type":"record","name":"Node","fields":[
            {"name":"v","type":"long"},{"name":"next","type":["null","Node"],"default":null}]}"#);
        assert!(can_read(&list, &list).is_ok());
    }

    #[test]
    fn a_missing_enum_symbol_is_incompatible() {
        let writer = s(r#"{"type":"enum","name":"S","symbols":["A","B"]}"#);
        let reader = s(r#"{"type":"enum","name":"S","symbols":["A"]}"#);
        assert!(can_read(&writer, &reader).is_err());
        assert!(can_read(&reader, &writer).is_ok());
    }
}
