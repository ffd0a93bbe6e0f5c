//! From a changelog's Avro writer schemas to a mirror table's columns, and
//! from decoded Avro values to Postgres text input.
//!
//! Guarantee: a value is written as the exact text Postgres reads back as
//! the same value (decimals digit for digit, timestamps to the
//! microsecond, floats in their shortest round-trip form, specials as the
//! connector sent them). The unchanged-TOAST marker and NULL stay distinct.

use std::collections::HashMap;

use apache_avro::types::Value;
use serde_json::Value as Json;

use crate::encode::types::{civil_from_days, POINT, UNCHANGED, VARIABLE_DECIMAL};
use crate::tail::format_decimal;

/// A column of a mirror table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    /// The Postgres type its text is cast to.
    pub sql_type: String,
}

impl Column {
    /// Whether the column holds integers (of any width).
    pub fn is_integer(&self) -> bool {
        matches!(self.sql_type.as_str(), "smallint" | "integer" | "bigint")
    }
}

/// The source column a record field stands for: its `pgcdc.column`, set
/// where the column's name is no valid Avro name (`Order Items`, `日本`),
/// else the field's own name.
pub fn column_name(field: &Json) -> Option<&str> {
    field["pgcdc.column"]
        .as_str()
        .or_else(|| field["name"].as_str())
}

/// One column value of a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cell {
    Null,
    /// Postgres did not send it (unchanged TOAST): keep the stored value.
    Unchanged,
    Text(String),
}

/// Named types of a schema document, by full name.
pub fn named_types(schema: &Json, namespace: &str, out: &mut HashMap<String, Json>) {
    match schema {
        Json::Object(o) => {
            let ns = o
                .get("namespace")
                .and_then(Json::as_str)
                .unwrap_or(namespace);
            if let Some(name) = o.get("name").and_then(Json::as_str) {
                if o.get("type")
                    .and_then(Json::as_str)
                    .is_some_and(|t| matches!(t, "record" | "enum" | "fixed"))
                {
                    let full = if name.contains('.') || ns.is_empty() {
                        name.to_string()
                    } else {
                        format!("{ns}.{name}")
                    };
                    out.insert(full, schema.clone());
                }
            }
            for v in o.values() {
                named_types(v, ns, out);
            }
        }
        Json::Array(items) => items.iter().for_each(|i| named_types(i, namespace, out)),
        _ => {}
    }
}

/// The row record of a Debezium envelope schema (the non-null branch of
/// `after`), a named reference resolved.
pub fn row_schema(envelope: &Json, names: &HashMap<String, Json>) -> Option<Json> {
    let after = envelope["fields"]
        .as_array()?
        .iter()
        .find(|f| f["name"] == "after")?;
    let branch = after["type"]
        .as_array()?
        .iter()
        .find(|b| b.as_str() != Some("null"))?;
    Some(resolve(branch, names).clone())
}

fn resolve<'a>(schema: &'a Json, names: &'a HashMap<String, Json>) -> &'a Json {
    match schema {
        Json::String(name) => names.get(name).unwrap_or(schema),
        other => other,
    }
}

fn full_name(schema: &Json) -> Option<String> {
    let o = schema.as_object()?;
    let name = o.get("name")?.as_str()?;
    Some(match o.get("namespace").and_then(Json::as_str) {
        Some(ns) if !name.contains('.') => format!("{ns}.{name}"),
        _ => name.to_string(),
    })
}

/// The value branch of a column's union: not `null`, not the unchanged
/// marker, and not the trailing `string` of specials.
fn value_branch<'a>(schema: &'a Json, names: &'a HashMap<String, Json>) -> &'a Json {
    match schema {
        Json::Array(variants) => variants
            .iter()
            .find(|v| v.as_str() != Some("null"))
            .map(|v| resolve(v, names))
            .unwrap_or(schema),
        other => resolve(other, names),
    }
}

/// The Postgres type of a column's Avro type.
pub fn sql_type(schema: &Json, names: &HashMap<String, Json>) -> String {
    let t = value_branch(schema, names);
    let prop = |k: &str| t.get(k).and_then(Json::as_str);
    if let Some(name) = full_name(t) {
        if name == VARIABLE_DECIMAL {
            return "numeric".into();
        }
        if name == POINT {
            return "point".into();
        }
    }
    match (prop("type"), prop("logicalType"), t.as_str()) {
        (_, Some("decimal"), _) => format!(
            "numeric({},{})",
            t.get("precision").and_then(Json::as_u64).unwrap_or(38),
            t.get("scale").and_then(Json::as_u64).unwrap_or(0)
        ),
        (_, Some("uuid"), _) => "uuid".into(),
        (_, Some("date"), _) => "date".into(),
        (_, Some("time-micros"), _) => "time".into(),
        (_, Some("local-timestamp-micros"), _) => "timestamp".into(),
        (_, Some("timestamp-micros"), _) => "timestamptz".into(),
        (Some("int"), _, _) if prop("connect.type") == Some("int16") => "smallint".into(),
        (Some("array"), _, _) => {
            let items = t.get("items").unwrap_or(&Json::Null);
            format!("{}[]", sql_type(items, names))
        }
        (Some("string"), _, _) => match prop("connect.name") {
            Some("io.debezium.data.Json") => "jsonb".into(),
            Some("io.debezium.time.Interval") => "interval".into(),
            Some("io.debezium.data.Xml") => "xml".into(),
            _ => "text".into(),
        },
        (Some(other), _, _) | (None, _, Some(other)) => match other {
            "boolean" => "boolean".into(),
            "int" => "integer".into(),
            "long" => "bigint".into(),
            "float" => "real".into(),
            "double" => "double precision".into(),
            "bytes" => "bytea".into(),
            _ => "text".into(),
        },
        _ => "text".into(),
    }
}

/// Whether a mirror column of type `mirror` takes every value of a writer
/// column of type `writer`: the same type, text, or a widening.
pub fn takes(mirror: &str, writer: &str) -> bool {
    let numeric = |t: &str| t == "numeric" || t.starts_with("numeric(");
    mirror == writer
        || mirror == "text"
        // Unconstrained numeric takes any number; numeric(p,s) only its own.
        || (mirror == "numeric"
            && (numeric(writer) || matches!(writer, "smallint" | "integer" | "bigint")))
        || matches!(
            (mirror, writer),
            ("integer", "smallint")
                | ("bigint", "smallint" | "integer")
                | ("double precision", "real")
        )
}

/// Renders one column value (a union per the column's schema).
pub fn cell(v: &Value, schema: &Json, names: &HashMap<String, Json>) -> Result<Cell, String> {
    let (v, branch) = match (v, schema) {
        (Value::Union(i, inner), Json::Array(variants)) => (
            inner.as_ref(),
            variants
                .get(*i as usize)
                .map(|b| resolve(b, names))
                .ok_or_else(|| format!("union branch {i} out of range"))?,
        ),
        (v, s) => (v, resolve(s, names)),
    };
    if matches!(v, Value::Null) {
        return Ok(Cell::Null);
    }
    if full_name(branch).as_deref() == Some(UNCHANGED) {
        return Ok(Cell::Unchanged);
    }
    render(v, branch, names).map(Cell::Text)
}

/// Postgres text input for a non-null value of Avro type `schema`.
fn render(v: &Value, schema: &Json, names: &HashMap<String, Json>) -> Result<String, String> {
    let schema = resolve(schema, names);
    Ok(match v {
        Value::Boolean(b) => if *b { "t" } else { "f" }.into(),
        Value::Int(n) => n.to_string(),
        Value::Long(n) => n.to_string(),
        Value::Float(f) => float_text(f64::from(*f), f.to_string()),
        Value::Double(f) => float_text(*f, f.to_string()),
        Value::Decimal(d) => {
            let scale = schema.get("scale").and_then(Json::as_u64).unwrap_or(0) as usize;
            let bytes: Vec<u8> = d.try_into().map_err(|e| format!("decimal: {e}"))?;
            format_decimal(&bytes, scale)
        }
        Value::Record(fields) => {
            let get = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| v);
            match full_name(schema).as_deref() {
                Some(VARIABLE_DECIMAL) => match (get("scale"), get("value")) {
                    (Some(Value::Int(scale)), Some(Value::Bytes(b))) => {
                        format_decimal(b, usize::try_from(*scale).unwrap_or(0))
                    }
                    other => return Err(format!("VariableScaleDecimal: {other:?}")),
                },
                Some(POINT) => match (get("x"), get("y")) {
                    (Some(Value::Double(x)), Some(Value::Double(y))) => format!(
                        "({},{})",
                        float_text(*x, x.to_string()),
                        float_text(*y, y.to_string())
                    ),
                    other => return Err(format!("Point: {other:?}")),
                },
                other => return Err(format!("unexpected record {other:?}")),
            }
        }
        Value::String(s) | Value::Enum(_, s) => s.clone(),
        Value::Uuid(u) => u.to_string(),
        Value::Bytes(b) | Value::Fixed(_, b) => crate::encode::bytea_hex(b),
        Value::Date(days) => date_text(i64::from(*days)),
        Value::TimeMicros(us) => time_text(*us),
        Value::TimestampMicros(us) => timestamp_text(*us, "+00"),
        Value::LocalTimestampMicros(us) => timestamp_text(*us, ""),
        Value::Array(items) => {
            let item_schema = schema.get("items").unwrap_or(&Json::Null);
            let mut parts = Vec::with_capacity(items.len());
            for item in items {
                parts.push(match cell(item, item_schema, names)? {
                    Cell::Null | Cell::Unchanged => "NULL".to_string(),
                    Cell::Text(t) => {
                        format!("\"{}\"", t.replace('\\', "\\\\").replace('"', "\\\""))
                    }
                });
            }
            format!("{{{}}}", parts.join(","))
        }
        other => return Err(format!("unsupported Avro value {other:?}")),
    })
}

fn float_text(f: f64, shortest: String) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f == f64::INFINITY {
        "Infinity".into()
    } else if f == f64::NEG_INFINITY {
        "-Infinity".into()
    } else {
        shortest
    }
}

/// `YYYY-MM-DD`, and whether the date is BC (Postgres writes year 0 as
/// 1 BC, year -1 as 2 BC, with " BC" after the time and zone).
fn date_parts(days: i64) -> (String, bool) {
    let (y, m, d) = civil_from_days(days);
    if y <= 0 {
        (format!("{:04}-{m:02}-{d:02}", 1 - y), true)
    } else {
        (format!("{y:04}-{m:02}-{d:02}"), false)
    }
}

fn bc(is_bc: bool) -> &'static str {
    if is_bc {
        " BC"
    } else {
        ""
    }
}

fn date_text(days: i64) -> String {
    let (date, is_bc) = date_parts(days);
    format!("{date}{}", bc(is_bc))
}

fn time_text(us: i64) -> String {
    let (s, frac) = (us.div_euclid(1_000_000), us.rem_euclid(1_000_000));
    format!(
        "{:02}:{:02}:{:02}.{frac:06}",
        s / 3600,
        (s / 60) % 60,
        s % 60
    )
}

fn timestamp_text(us: i64, zone: &str) -> String {
    let day_us = 86_400_000_000;
    let (date, is_bc) = date_parts(us.div_euclid(day_us));
    format!(
        "{date} {}{zone}{}",
        time_text(us.rem_euclid(day_us)),
        bc(is_bc)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_takes_its_own_type_text_and_widenings_only() {
        for (mirror, writer) in [
            ("bigint", "bigint"),
            ("bigint", "integer"),
            ("integer", "smallint"),
            ("numeric", "numeric(12,4)"),
            ("numeric", "bigint"),
            ("double precision", "real"),
            ("text", "jsonb"),
            ("text", "bigint"),
        ] {
            assert!(takes(mirror, writer), "{mirror} ← {writer}");
        }
        for (mirror, writer) in [
            ("integer", "bigint"),
            ("numeric(10,2)", "numeric(12,4)"),
            ("bigint", "text"),
            ("uuid", "text"),
            ("date", "timestamptz"),
            ("real", "double precision"),
        ] {
            assert!(!takes(mirror, writer), "{mirror} ← {writer}");
        }
    }
    use serde_json::json;

    #[test]
    fn dates_and_times_render_as_postgres_input() {
        assert_eq!(date_text(0), "1970-01-01");
        assert_eq!(date_text(19_782), "2024-02-29");
        assert_eq!(date_text(-1), "1969-12-31");
        assert_eq!(time_text(45_296_789_012), "12:34:56.789012");
        assert_eq!(
            timestamp_text(1_706_704_496_789_012, ""),
            "2024-01-31 12:34:56.789012"
        );
        assert_eq!(timestamp_text(-1, "+00"), "1969-12-31 23:59:59.999999+00");
        // The day before 0001-01-01 is the last day of 1 BC (year 0).
        assert_eq!(date_text(-719_162), "0001-01-01");
        assert_eq!(date_text(-719_163), "0001-12-31 BC");
        assert_eq!(
            timestamp_text(-719_163 * 86_400_000_000, "+00"),
            "0001-12-31 00:00:00.000000+00 BC"
        );
    }

    #[test]
    fn cells_keep_null_unchanged_and_specials_apart() {
        let names = HashMap::new();
        let unchanged = json!({"type": "enum", "name": "Unchanged", "namespace": "io.pgcdc.data", "symbols": ["UNCHANGED_TOAST"]});
        let schema = json!(["null", {"type": "long", "logicalType": "timestamp-micros"}, "string", unchanged]);
        assert_eq!(
            cell(&Value::Union(0, Box::new(Value::Null)), &schema, &names),
            Ok(Cell::Null)
        );
        assert_eq!(
            cell(
                &Value::Union(3, Box::new(Value::Enum(0, "UNCHANGED_TOAST".into()))),
                &schema,
                &names
            ),
            Ok(Cell::Unchanged)
        );
        assert_eq!(
            cell(
                &Value::Union(2, Box::new(Value::String("infinity".into()))),
                &schema,
                &names
            ),
            Ok(Cell::Text("infinity".into()))
        );
        assert_eq!(
            cell(
                &Value::Union(1, Box::new(Value::TimestampMicros(0))),
                &schema,
                &names
            ),
            Ok(Cell::Text("1970-01-01 00:00:00.000000+00".into()))
        );
        assert_eq!(sql_type(&schema, &names), "timestamptz");
    }

    #[test]
    fn arrays_render_as_quoted_literals() {
        let names = HashMap::new();
        let schema = json!({"type": "array", "items": ["null", "string"]});
        let v = Value::Array(vec![
            Value::Union(1, Box::new(Value::String("a \"b\"".into()))),
            Value::Union(0, Box::new(Value::Null)),
        ]);
        assert_eq!(
            cell(&v, &schema, &names),
            Ok(Cell::Text(r#"{"a \"b\"",NULL}"#.into()))
        );
        assert_eq!(sql_type(&schema, &names), "text[]");
    }
}
