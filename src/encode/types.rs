//! Postgres types to Avro: the schema of a column and the conversion of a
//! value from Postgres's text output format.
//!
//! Guarantee: a value is never silently changed. Each type maps to a
//! standard Avro type or logical type; a value that the logical type cannot
//! express (numeric `NaN`, `±Infinity`, timestamp and date `±infinity`)
//! travels in a `string` branch of the union with Postgres's own text.
//! Types without a dedicated mapping travel as their exact Postgres text,
//! with the type named in the schema property `pgcdc.type`. Text that does
//! not parse as its type is an error naming the type, never a guess.
//!
//! Sessions that produce the text run with `DateStyle=ISO`,
//! `TimeZone=UTC`, `IntervalStyle=iso_8601`, `extra_float_digits=3`,
//! `lc_monetary=C` and `bytea_output=hex`, the formats parsed here
//! ([`SESSION_SETTINGS`]).
//! Domains are carried as their base type (the catalog resolves them).

use apache_avro::types::Value;
use serde_json::{json, Value as Json};

use super::datum;

/// Session settings under which the text formats below are produced.
pub const SESSION_SETTINGS: &[(&str, &str)] = &[
    ("DateStyle", "ISO"),
    ("TimeZone", "UTC"),
    // ISO 8601 durations, as Debezium's `io.debezium.time.Interval`.
    ("IntervalStyle", "iso_8601"),
    ("extra_float_digits", "3"),
    // `$1,234.56`: a fixed currency format, whatever the server's locale.
    ("lc_monetary", "C"),
    // `\x...`, the only bytea text read here (a server may default to
    // `escape`), and what a binary COPY's bytes are checked against.
    ("bytea_output", "hex"),
];

/// How a Postgres type is carried in Avro.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Bool,
    Int16,
    Int32,
    Int64,
    Float32,
    Float64,
    /// `numeric(p, s)`.
    Decimal {
        precision: u32,
        scale: u32,
    },
    /// `numeric` without a typmod: any scale.
    VariableDecimal,
    Text,
    Bytes,
    Uuid,
    Date,
    Time,
    Timestamp,
    TimestampTz,
    Json,
    /// `xml`, as its text (`io.debezium.data.Xml`).
    Xml,
    /// `interval`, as an ISO 8601 duration (`io.debezium.time.Interval`).
    Interval,
    /// `money`, as `decimal(19,2)` (the `lc_monetary=C` fraction digits).
    Money,
    /// `point`, as Debezium's `io.debezium.data.geometry.Point`.
    Point,
    /// An enum, as its label (`io.debezium.data.Enum`, labels listed).
    Enum(Vec<String>),
    /// A one-dimensional array with default bounds, as an Avro array of
    /// nullable elements; other arrays travel as their exact text.
    Array(Box<Kind>),
    /// Carried as the exact Postgres text; the type name is kept.
    Other(String),
}

impl Kind {
    /// The kind for a type oid and modifier; `type_name` names types
    /// without a dedicated mapping.
    pub fn of(oid: u32, typmod: i32, type_name: &str) -> Kind {
        match oid {
            16 => Kind::Bool,
            21 => Kind::Int16,
            23 => Kind::Int32,
            20 => Kind::Int64,
            26 => Kind::Int64, // oid is unsigned 32-bit
            700 => Kind::Float32,
            701 => Kind::Float64,
            1700 if typmod >= 4 => {
                let t = (typmod - 4) as u32;
                let precision = (t >> 16) & 0xFFFF;
                // An 11-bit signed scale: Postgres 15 allows one below zero
                // or above the precision, which Avro's decimal does not.
                let scale = ((t & 0x7FF) ^ 0x400) as i32 - 0x400;
                match u32::try_from(scale) {
                    Ok(scale) if scale <= precision => Kind::Decimal { precision, scale },
                    _ => Kind::VariableDecimal,
                }
            }
            1700 => Kind::VariableDecimal,
            25 | 1043 | 1042 | 19 | 18 => Kind::Text,
            17 => Kind::Bytes,
            2950 => Kind::Uuid,
            1082 => Kind::Date,
            1083 => Kind::Time,
            1114 => Kind::Timestamp,
            1184 => Kind::TimestampTz,
            114 | 3802 => Kind::Json,
            142 => Kind::Xml,
            1186 => Kind::Interval,
            790 => Kind::Money,
            600 => Kind::Point,
            _ => match array_element(oid) {
                // Array typmods apply to the elements (numeric(p,s)[]).
                Some(elem) => Kind::Array(Box::new(Kind::of(elem, typmod, ""))),
                None => Kind::Other(type_name.to_string()),
            },
        }
    }

    /// Whether some values of this kind travel in the special `string` branch.
    /// (Arrays: multi-dimensional ones and those with non-default bounds.)
    pub fn has_specials(&self) -> bool {
        matches!(
            self,
            Kind::Decimal { .. }
                | Kind::VariableDecimal
                | Kind::Date
                | Kind::Time
                | Kind::Timestamp
                | Kind::TimestampTz
                | Kind::Array(_)
        )
    }
}

/// The element type of the built-in array types with a dedicated mapping.
fn array_element(oid: u32) -> Option<u32> {
    Some(match oid {
        1000 => 16,   // bool[]
        1001 => 17,   // bytea[]
        1005 => 21,   // int2[]
        1007 => 23,   // int4[]
        1016 => 20,   // int8[]
        1009 => 25,   // text[]
        1015 => 1043, // varchar[]
        1014 => 1042, // char[]
        1021 => 700,  // float4[]
        1022 => 701,  // float8[]
        1231 => 1700, // numeric[]
        2951 => 2950, // uuid[]
        1182 => 1082, // date[]
        1183 => 1083, // time[]
        1115 => 1114, // timestamp[]
        1185 => 1184, // timestamptz[]
        199 => 114,   // json[]
        3807 => 3802, // jsonb[]
        143 => 142,   // xml[]
        1187 => 1186, // interval[]
        791 => 790,   // money[]
        1017 => 600,  // point[]
        _ => return None,
    })
}

/// The layout of an array element: nullable, with the element's specials.
fn element_layout(elem: &Kind) -> Layout {
    Layout {
        nullable: true,
        specials: elem.has_specials(),
        unchanged: false,
    }
}

/// Splits a one-dimensional array literal into its elements (`None` for
/// NULL); `None` when it is not one (multi-dimensional, explicit bounds).
fn array_elements(text: &str) -> Option<Vec<Option<String>>> {
    let body = text.strip_prefix('{')?.strip_suffix('}')?;
    if body.starts_with('{') {
        return None;
    }
    let mut out = Vec::new();
    if body.is_empty() {
        return Some(out);
    }
    let mut chars = body.chars().peekable();
    loop {
        let mut element = String::new();
        let quoted = chars.peek() == Some(&'"');
        if quoted {
            chars.next();
            loop {
                match chars.next()? {
                    '\\' => element.push(chars.next()?),
                    '"' => break,
                    c => element.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                element.push(c);
                chars.next();
            }
        }
        out.push(if !quoted && element == "NULL" {
            None
        } else {
            Some(element)
        });
        match chars.next() {
            None => return Some(out),
            Some(',') => {}
            Some(_) => return None,
        }
    }
}

/// Tracks named Avro types already defined in one schema document, so a
/// second use is a reference by full name.
#[derive(Debug, Default)]
pub struct Names(std::collections::BTreeSet<String>);

impl Names {
    /// The definition the first time, the full name afterwards.
    pub fn named(&mut self, full_name: &str, definition: Json) -> Json {
        if self.0.insert(full_name.to_string()) {
            definition
        } else {
            Json::String(full_name.to_string())
        }
    }
}

pub const VARIABLE_DECIMAL: &str = "io.debezium.data.VariableScaleDecimal";
pub const POINT: &str = "io.debezium.data.geometry.Point";
/// `money` values: cents in an `int8`, so 19 digits, 2 after the point.
const MONEY_PRECISION: u32 = 19;
const MONEY_SCALE: u32 = 2;
pub const UNCHANGED: &str = "io.pgcdc.data.Unchanged";
pub const UNCHANGED_SYMBOL: &str = "UNCHANGED_TOAST";

/// The Avro type of a non-null value of `kind` (without specials).
pub fn base_schema(kind: &Kind, names: &mut Names) -> Json {
    match kind {
        Kind::Bool => json!("boolean"),
        Kind::Int16 => json!({"type": "int", "connect.type": "int16"}),
        Kind::Int32 => json!("int"),
        Kind::Int64 => json!("long"),
        Kind::Float32 => json!("float"),
        Kind::Float64 => json!("double"),
        Kind::Decimal { precision, scale } => json!({
            "type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale,
            "connect.name": "org.apache.kafka.connect.data.Decimal",
            "connect.parameters": {"scale": scale.to_string(), "connect.decimal.precision": precision.to_string()}
        }),
        Kind::VariableDecimal => names.named(
            VARIABLE_DECIMAL,
            json!({
                "type": "record", "name": "VariableScaleDecimal", "namespace": "io.debezium.data",
                "fields": [{"name": "scale", "type": "int"}, {"name": "value", "type": "bytes"}],
                "connect.name": VARIABLE_DECIMAL
            }),
        ),
        Kind::Text => json!("string"),
        Kind::Bytes => json!("bytes"),
        Kind::Uuid => {
            json!({"type": "string", "logicalType": "uuid", "connect.name": "io.debezium.data.Uuid"})
        }
        Kind::Date => {
            json!({"type": "int", "logicalType": "date", "connect.name": "io.debezium.time.Date"})
        }
        Kind::Time => {
            json!({"type": "long", "logicalType": "time-micros", "connect.name": "io.debezium.time.MicroTime"})
        }
        Kind::Timestamp => json!({
            "type": "long", "logicalType": "local-timestamp-micros",
            "connect.name": "io.debezium.time.MicroTimestamp"
        }),
        Kind::TimestampTz => json!({"type": "long", "logicalType": "timestamp-micros"}),
        Kind::Json => json!({"type": "string", "connect.name": "io.debezium.data.Json"}),
        Kind::Xml => json!({"type": "string", "connect.name": "io.debezium.data.Xml"}),
        Kind::Interval => {
            json!({"type": "string", "connect.name": "io.debezium.time.Interval"})
        }
        Kind::Money => base_schema(
            &Kind::Decimal {
                precision: MONEY_PRECISION,
                scale: MONEY_SCALE,
            },
            names,
        ),
        Kind::Point => names.named(
            POINT,
            json!({
                "type": "record", "name": "Point", "namespace": "io.debezium.data.geometry",
                "fields": [
                    {"name": "x", "type": "double"},
                    {"name": "y", "type": "double"},
                    {"name": "wkb", "type": ["null", "bytes"], "default": null},
                    {"name": "srid", "type": ["null", "int"], "default": null}
                ],
                "connect.name": POINT
            }),
        ),
        Kind::Enum(labels) => json!({
            "type": "string", "connect.name": "io.debezium.data.Enum", "connect.version": 1,
            "connect.parameters": {"allowed": labels.join(",")}
        }),
        Kind::Array(elem) => json!({
            "type": "array",
            "items": column_schema(elem, &element_layout(elem), names)
        }),
        Kind::Other(name) => json!({"type": "string", "pgcdc.type": name}),
    }
}

/// Where a column's value sits in its union.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub nullable: bool,
    pub specials: bool,
    pub unchanged: bool,
}

impl Layout {
    fn value_index(&self) -> u32 {
        u32::from(self.nullable)
    }
    fn special_index(&self) -> u32 {
        self.value_index() + 1
    }
    fn unchanged_index(&self) -> u32 {
        self.value_index() + 1 + u32::from(self.specials)
    }
    fn is_union(&self) -> bool {
        self.nullable || self.specials || self.unchanged
    }
}

/// The full Avro type of a column: `["null", T, "string"?, Unchanged?]`,
/// or plain `T` for a non-null column without specials or marker.
pub fn column_schema(kind: &Kind, layout: &Layout, names: &mut Names) -> Json {
    let base = base_schema(kind, names);
    if !layout.is_union() {
        return base;
    }
    let mut branches = Vec::new();
    if layout.nullable {
        branches.push(json!("null"));
    }
    branches.push(base);
    if layout.specials {
        branches.push(json!("string"));
    }
    if layout.unchanged {
        branches.push(names.named(
            UNCHANGED,
            json!({
                "type": "enum", "name": "Unchanged", "namespace": "io.pgcdc.data",
                "symbols": [UNCHANGED_SYMBOL],
                "doc": "An unchanged TOASTed value: Postgres did not write it to the WAL. Keep the previous value."
            }),
        ));
    }
    Json::Array(branches)
}

/// A column value as it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input<'a> {
    Null,
    Unchanged,
    Text(&'a [u8]),
    /// Postgres's binary format of a [`super::binary::Form::Binary`] kind
    /// (a snapshot's binary COPY).
    Binary(&'a [u8]),
}

impl Input<'_> {
    /// The value's text: its own, or Postgres's text of a binary one
    /// (`None` for bytes that are not a value of `kind`).
    pub fn text(&self, kind: &Kind) -> Option<std::borrow::Cow<'_, [u8]>> {
        match self {
            Input::Text(t) => Some((*t).into()),
            Input::Binary(b) => super::binary::text(kind, b).map(|t| t.into_bytes().into()),
            Input::Null | Input::Unchanged => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    #[error("value does not parse as {kind}")]
    Unparsable { kind: String },
    #[error("NULL in a column declared NOT NULL or in the key")]
    UnexpectedNull,
    #[error("an unchanged TOAST marker where the schema has none")]
    UnexpectedUnchanged,
}

/// Converts one column value into its Avro union value.
pub fn convert(kind: &Kind, layout: &Layout, input: Input<'_>) -> Result<Value, ConvertError> {
    let wrap = |index: u32, v: Value| {
        if layout.is_union() {
            Value::Union(index, Box::new(v))
        } else {
            v
        }
    };
    match input {
        Input::Null if layout.nullable => Ok(Value::Union(0, Box::new(Value::Null))),
        Input::Null => Err(ConvertError::UnexpectedNull),
        Input::Unchanged if layout.unchanged => Ok(Value::Union(
            layout.unchanged_index(),
            Box::new(Value::Enum(0, UNCHANGED_SYMBOL.to_string())),
        )),
        Input::Unchanged => Err(ConvertError::UnexpectedUnchanged),
        // What write_direct declined: through Postgres's text of it.
        Input::Binary(bytes) => match super::binary::text(kind, bytes) {
            Some(text) => convert(kind, layout, Input::Text(text.as_bytes())),
            None => Err(ConvertError::Unparsable {
                kind: format!("{kind:?} (binary)"),
            }),
        },
        Input::Text(bytes) => {
            let bad = || ConvertError::Unparsable {
                kind: format!("{kind:?}"),
            };
            let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
            if kind.has_specials() && is_special(kind, text) {
                return if layout.specials {
                    Ok(wrap(
                        layout.special_index(),
                        Value::String(text.to_string()),
                    ))
                } else {
                    Err(bad())
                };
            }
            let v = parse(kind, text).ok_or_else(bad)?;
            Ok(wrap(layout.value_index(), v))
        }
    }
}

/// Writes a column's Avro bytes straight from its text, without building
/// a [`Value`], for the kinds the hot path meets most; returns false
/// (having written nothing) for anything else, which the caller then
/// takes through [`convert`]. Whatever it writes is byte for byte what
/// [`convert`] and [`datum::value`] write (tests compare the two).
pub fn write_direct(out: &mut Vec<u8>, kind: &Kind, layout: &Layout, input: Input<'_>) -> bool {
    let bytes = match input {
        Input::Null if layout.nullable => {
            datum::branch(out, 0);
            return true;
        }
        Input::Text(bytes) => bytes,
        Input::Binary(bytes) => {
            return in_value_branch(out, layout, |out| super::binary::write(out, kind, bytes))
        }
        _ => return false,
    };
    let Ok(text) = std::str::from_utf8(bytes) else {
        return false;
    };
    if kind.has_specials() && is_special(kind, text) {
        return false;
    }
    in_value_branch(out, layout, |out| {
        match kind {
            Kind::Bool => out.push(match text {
                "t" => 1,
                "f" => 0,
                _ => return None,
            }),
            Kind::Int16 => datum::long(out, text.parse::<i16>().ok()?.into()),
            Kind::Int32 => datum::long(out, text.parse::<i32>().ok()?.into()),
            Kind::Int64 => datum::long(out, text.parse::<i64>().ok()?),
            Kind::Float32 => out.extend_from_slice(&text.parse::<f32>().ok()?.to_le_bytes()),
            Kind::Float64 => out.extend_from_slice(&text.parse::<f64>().ok()?.to_le_bytes()),
            Kind::Decimal { scale, .. } => {
                let n = decimal_i128(text, *scale)?;
                datum::bytes(out, minimal_be(&n.to_be_bytes()));
            }
            Kind::Text
            | Kind::Json
            | Kind::Xml
            | Kind::Interval
            | Kind::Enum(_)
            | Kind::Other(_) => datum::string(out, text),
            Kind::Date => datum::long(out, i32::try_from(parse_date(text)?).ok()?.into()),
            Kind::Time => datum::long(out, parse_time(text)?),
            Kind::Timestamp => datum::long(out, parse_timestamp(text, false)?),
            Kind::TimestampTz => datum::long(out, parse_timestamp(text, true)?),
            _ => return None,
        }
        Some(())
    })
}

/// Writes the layout's value branch, then the value by `write`; on `None`
/// takes both back and returns false.
fn in_value_branch(
    out: &mut Vec<u8>,
    layout: &Layout,
    write: impl FnOnce(&mut Vec<u8>) -> Option<()>,
) -> bool {
    let mark = out.len();
    if layout.is_union() {
        datum::branch(out, layout.value_index());
    }
    let written = write(out).is_some();
    if !written {
        out.truncate(mark);
    }
    written
}

/// A decimal's unscaled value at `scale` (`12.5` at scale 2 is 1250), when
/// it fits an i128; `None` otherwise, as for text [`parse`] refuses.
fn decimal_i128(text: &str, scale: u32) -> Option<i128> {
    let (neg, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (int, frac) = at_point(body);
    if int.is_empty() || frac.len() > scale as usize {
        return None;
    }
    let mut n: i128 = 0;
    for d in int.bytes().chain(frac.bytes()) {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(i128::from(d - b'0'))?;
    }
    for _ in frac.len()..scale as usize {
        n = n.checked_mul(10)?;
    }
    Some(if neg { -n } else { n })
}

/// `text` before and after its first `.` (after: empty without one). A
/// byte search: on fields this short, a char searcher's set-up costs more
/// than the search.
fn at_point(text: &str) -> (&str, &str) {
    match text.bytes().position(|b| b == b'.') {
        Some(i) => (&text[..i], &text[i + 1..]),
        None => (text, ""),
    }
}

/// Big-endian two's complement without redundant sign-extension bytes,
/// as [`twos_complement`] gives it.
pub(crate) fn minimal_be(b: &[u8]) -> &[u8] {
    let mut i = 0;
    while i + 1 < b.len()
        && ((b[i] == 0 && b[i + 1] & 0x80 == 0) || (b[i] == 0xFF && b[i + 1] & 0x80 != 0))
    {
        i += 1;
    }
    &b[i..]
}

/// Values the logical type cannot carry for every reader: numeric
/// specials, infinities, and dates outside years 1 to 9999, which Avro's
/// `date` and timestamps can encode but common readers (Python's datetime
/// among them) cannot represent.
fn is_special(kind: &Kind, text: &str) -> bool {
    match kind {
        Kind::Decimal { .. } | Kind::VariableDecimal => {
            matches!(text, "NaN" | "Infinity" | "-Infinity")
        }
        // Postgres allows 24:00:00, which time-of-day readers reject.
        Kind::Time => text.starts_with("24:"),
        Kind::Array(_) => array_elements(text).is_none(),
        _ => {
            matches!(text, "infinity" | "-infinity")
                || text.ends_with(" BC")
                || text
                    .split('-')
                    .next()
                    .is_some_and(|year| year.len() > 4 && year.bytes().all(|b| b.is_ascii_digit()))
        }
    }
}

fn parse(kind: &Kind, text: &str) -> Option<Value> {
    Some(match kind {
        Kind::Bool => match text {
            "t" => Value::Boolean(true),
            "f" => Value::Boolean(false),
            _ => return None,
        },
        Kind::Int16 => Value::Int(i32::from(text.parse::<i16>().ok()?)),
        Kind::Int32 => Value::Int(text.parse().ok()?),
        Kind::Int64 => Value::Long(text.parse().ok()?),
        Kind::Float32 => Value::Float(text.parse().ok()?),
        Kind::Float64 => Value::Double(text.parse().ok()?),
        Kind::Decimal { scale, .. } => {
            let (unscaled, s) = unscaled_digits(text)?;
            if s > *scale {
                return None;
            }
            let padded = format!("{unscaled}{}", "0".repeat((*scale - s) as usize));
            Value::Decimal(apache_avro::Decimal::from(twos_complement(&padded)?))
        }
        Kind::VariableDecimal => {
            let (unscaled, s) = unscaled_digits(text)?;
            Value::Record(vec![
                ("scale".into(), Value::Int(i32::try_from(s).ok()?)),
                ("value".into(), Value::Bytes(twos_complement(&unscaled)?)),
            ])
        }
        // An enum label added after the schema was built (ALTER TYPE ...
        // ADD VALUE sends no Relation message) is still carried as is.
        Kind::Text | Kind::Json | Kind::Xml | Kind::Interval | Kind::Enum(_) | Kind::Other(_) => {
            Value::String(text.to_string())
        }
        Kind::Money => {
            // `-$1,234.56` under lc_monetary=C.
            let (neg, rest) = match text.strip_prefix('-') {
                Some(r) => (true, r),
                None => (false, text),
            };
            let digits = rest.strip_prefix('$')?.replace(',', "");
            let plain = if neg { format!("-{digits}") } else { digits };
            return parse(
                &Kind::Decimal {
                    precision: MONEY_PRECISION,
                    scale: MONEY_SCALE,
                },
                &plain,
            );
        }
        Kind::Point => {
            let (x, y) = text.strip_prefix('(')?.strip_suffix(')')?.split_once(',')?;
            let (x, y): (f64, f64) = (x.parse().ok()?, y.parse().ok()?);
            Value::Record(vec![
                ("x".into(), Value::Double(x)),
                ("y".into(), Value::Double(y)),
                (
                    "wkb".into(),
                    Value::Union(1, Box::new(Value::Bytes(point_wkb(x, y)))),
                ),
                ("srid".into(), Value::Union(0, Box::new(Value::Null))),
            ])
        }
        Kind::Array(elem) => {
            let layout = element_layout(elem);
            let mut items = Vec::new();
            for e in array_elements(text)? {
                let input = match &e {
                    None => Input::Null,
                    Some(t) => Input::Text(t.as_bytes()),
                };
                items.push(convert(elem, &layout, input).ok()?);
            }
            Value::Array(items)
        }
        Kind::Bytes => Value::Bytes(parse_bytea(text)?),
        Kind::Uuid => Value::Uuid(text.parse().ok()?),
        Kind::Date => Value::Date(i32::try_from(parse_date(text)?).ok()?),
        Kind::Time => Value::TimeMicros(parse_time(text)?),
        Kind::Timestamp => Value::LocalTimestampMicros(parse_timestamp(text, false)?),
        Kind::TimestampTz => Value::TimestampMicros(parse_timestamp(text, true)?),
    })
}

/// A point as OGC well-known binary (little-endian), as Debezium writes it.
fn point_wkb(x: f64, y: f64) -> Vec<u8> {
    let mut wkb = Vec::with_capacity(21);
    wkb.push(1);
    wkb.extend_from_slice(&1u32.to_le_bytes());
    wkb.extend_from_slice(&x.to_le_bytes());
    wkb.extend_from_slice(&y.to_le_bytes());
    wkb
}

/// `-12.340` → (`-12340`, 3): the digits without the point, and the scale.
fn unscaled_digits(text: &str) -> Option<(String, u32)> {
    let (neg, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (int, frac) = at_point(body);
    if int.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let sign = if neg { "-" } else { "" };
    Some((
        format!("{sign}{int}{frac}"),
        u32::try_from(frac.len()).ok()?,
    ))
}

/// A decimal integer string as minimal big-endian two's complement bytes.
fn twos_complement(decimal: &str) -> Option<Vec<u8>> {
    let (neg, digits) = match decimal.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, decimal),
    };
    // Magnitude in base 256, little-endian, by repeated multiply-add.
    let mut mag: Vec<u8> = vec![0];
    for d in digits.bytes() {
        if !d.is_ascii_digit() {
            return None;
        }
        let mut carry = u32::from(d - b'0');
        for limb in mag.iter_mut() {
            let v = u32::from(*limb) * 10 + carry;
            *limb = (v & 0xFF) as u8;
            carry = v >> 8;
        }
        while carry > 0 {
            mag.push((carry & 0xFF) as u8);
            carry >>= 8;
        }
    }
    // Room for the sign bit.
    mag.push(0);
    if neg {
        let mut carry = 1u16;
        for limb in mag.iter_mut() {
            let v = u16::from(!*limb) + carry;
            *limb = (v & 0xFF) as u8;
            carry = v >> 8;
        }
    }
    mag.reverse();
    // Drop redundant sign-extension bytes.
    while mag.len() > 1 {
        let (a, b) = (mag[0], mag[1]);
        if (a == 0 && b & 0x80 == 0) || (a == 0xFF && b & 0x80 != 0) {
            mag.remove(0);
        } else {
            break;
        }
    }
    Some(mag)
}

/// `\x` hex format (the default `bytea_output`).
fn parse_bytea(text: &str) -> Option<Vec<u8>> {
    let hex = text.strip_prefix("\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Days from 1970-01-01 of a proleptic Gregorian date (astronomical years).
pub(crate) fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Proleptic Gregorian date of a day count from 1970-01-01 (the inverse
/// of [`days_from_civil`]).
pub(crate) fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// `YYYY-MM-DD[ BC]`.
fn parse_date(text: &str) -> Option<i64> {
    match text.strip_suffix(" BC") {
        Some(b) => parse_civil_date(b, true),
        None => parse_civil_date(text, false),
    }
}

/// `YYYY-MM-DD` (of year `YYYY` BC when `bc`) → days since the epoch.
fn parse_civil_date(body: &str, bc: bool) -> Option<i64> {
    let mut parts = body.splitn(3, '-');
    let y: i64 = parts.next()?.parse().ok()?;
    let m: i64 = parts.next()?.parse().ok()?;
    let d: i64 = parts.next()?.parse().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    // 1 BC is astronomical year 0.
    let year = if bc { 1 - y } else { y };
    Some(days_from_civil(year, m, d))
}

/// `HH:MM:SS[.ffffff]` → microseconds since midnight (24:00:00 allowed).
fn parse_time(text: &str) -> Option<i64> {
    let mut parts = text.splitn(3, ':');
    let h: i64 = parts.next()?.parse().ok()?;
    let m: i64 = parts.next()?.parse().ok()?;
    let sec = parts.next()?;
    let (s, frac) = at_point(sec);
    let s: i64 = s.parse().ok()?;
    if frac.len() > 6 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // The digits given, padded with zeros to six (checked above).
    let micros = frac
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(6)
        .fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
    if h > 24 || m > 59 || s > 60 {
        return None;
    }
    Some(((h * 60 + m) * 60 + s) * 1_000_000 + micros)
}

/// `YYYY-MM-DD HH:MM:SS[.ffffff][+HH[:MM[:SS]]][ BC]` → microseconds since
/// the epoch (UTC when `with_zone`).
fn parse_timestamp(text: &str, with_zone: bool) -> Option<i64> {
    iso_timestamp(text.as_bytes(), with_zone).or_else(|| any_timestamp(text, with_zone))
}

/// What Postgres writes for four-digit years under `DateStyle = ISO`
/// (`YYYY-MM-DD HH:MM:SS[.f{1,6}]`, then `+HH[:MM[:SS]]` with a zone),
/// read at fixed places: a snapshot row's timestamps cost no string
/// searches. `None` for anything else, which [`any_timestamp`] reads; where
/// this gives a value, it is the one that gives.
fn iso_timestamp(b: &[u8], with_zone: bool) -> Option<i64> {
    fn num(digits: &[u8]) -> Option<i64> {
        digits.iter().try_fold(0i64, |n, &d| {
            d.is_ascii_digit().then(|| n * 10 + i64::from(d - b'0'))
        })
    }
    if b.len() < 19
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b' '
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (y, m, d) = (num(&b[..4])?, num(&b[5..7])?, num(&b[8..10])?);
    let (h, mi, s) = (num(&b[11..13])?, num(&b[14..16])?, num(&b[17..19])?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || h > 24 || mi > 59 || s > 60 {
        return None;
    }
    let mut rest = &b[19..];
    let mut micros = 0;
    if let Some(frac) = rest.strip_prefix(b".") {
        let n = frac.iter().take_while(|c| c.is_ascii_digit()).count();
        if !(1..=6).contains(&n) {
            return None;
        }
        micros = num(&frac[..n])? * 10i64.pow(6 - n as u32);
        rest = &frac[n..];
    }
    let offset = match (with_zone, rest) {
        (false, []) => 0,
        (true, [sign @ (b'+' | b'-'), zone @ ..]) => {
            let (zh, zm, zs) = match zone {
                [_, _] => (num(zone)?, 0, 0),
                [h @ .., b':', _, _] if h.len() == 2 => (num(h)?, num(&zone[3..])?, 0),
                [h @ .., b':', _, _, b':', _, _] if h.len() == 2 => {
                    (num(h)?, num(&zone[3..5])?, num(&zone[6..])?)
                }
                _ => return None,
            };
            let secs = zh * 3600 + zm * 60 + zs;
            if *sign == b'-' {
                -secs
            } else {
                secs
            }
        }
        _ => return None,
    };
    Some(
        days_from_civil(y, m, d) * 86_400_000_000 + ((h * 60 + mi) * 60 + s) * 1_000_000 + micros
            - offset * 1_000_000,
    )
}

/// [`parse_timestamp`] for any layout it takes.
fn any_timestamp(text: &str, with_zone: bool) -> Option<i64> {
    let (body, bc) = match text.strip_suffix(" BC") {
        Some(b) => (b, true),
        None => (text, false),
    };
    let (date, rest) = body.split_once(' ')?;
    let (time, offset_secs) = if with_zone {
        let at = rest.rfind(['+', '-'])?;
        let (t, z) = rest.split_at(at);
        let sign = if z.starts_with('-') { -1 } else { 1 };
        let mut zp = z[1..].split(':');
        let zh: i64 = zp.next()?.parse().ok()?;
        let zm: i64 = zp.next().map(|v| v.parse().ok()).unwrap_or(Some(0))?;
        let zs: i64 = zp.next().map(|v| v.parse().ok()).unwrap_or(Some(0))?;
        (t, sign * (zh * 3600 + zm * 60 + zs))
    } else {
        (rest, 0)
    };
    let days = parse_civil_date(date, bc)?;
    let micros = parse_time(time)?;
    days.checked_mul(86_400_000_000)?
        .checked_add(micros)?
        .checked_sub(offset_secs * 1_000_000)
}

/// The direct writer against the `Value` path, on valid and invalid text.
#[cfg(test)]
mod direct {
    use super::*;
    use proptest::prelude::*;

    fn kinds() -> Vec<Kind> {
        vec![
            Kind::Bool,
            Kind::Int16,
            Kind::Int32,
            Kind::Int64,
            Kind::Float32,
            Kind::Float64,
            Kind::Decimal {
                precision: 12,
                scale: 2,
            },
            Kind::Decimal {
                precision: 38,
                scale: 0,
            },
            Kind::Decimal {
                precision: 60,
                scale: 20,
            },
            Kind::Text,
            Kind::Json,
            Kind::Enum(vec!["happy".into()]),
            Kind::Date,
            Kind::Time,
            Kind::Timestamp,
            Kind::TimestampTz,
            Kind::Uuid,
            Kind::Money,
        ]
    }

    fn layouts() -> Vec<Layout> {
        (0..8)
            .map(|b| Layout {
                nullable: b & 1 != 0,
                specials: b & 2 != 0,
                unchanged: b & 4 != 0,
            })
            .collect()
    }

    /// What the `Value` path writes, or `None` where it refuses.
    fn through_value(kind: &Kind, layout: &Layout, input: Input<'_>) -> Option<Vec<u8>> {
        let v = convert(kind, layout, input).ok()?;
        let mut out = Vec::new();
        datum::value(&mut out, &v).ok()?;
        Some(out)
    }

    /// Writes through the direct path, checks it against the `Value` path,
    /// and tells whether the direct path took it.
    fn check(kind: &Kind, layout: &Layout, input: Input<'_>) -> bool {
        let mut out = vec![0xAA];
        let took = write_direct(&mut out, kind, layout, input);
        if took {
            let want = through_value(kind, layout, input);
            assert_eq!(
                Some(&out[1..]),
                want.as_deref(),
                "{kind:?} {layout:?} {input:?}"
            );
        } else {
            assert_eq!(out, [0xAA], "{kind:?} {input:?}: refused but wrote");
        }
        took
    }

    fn text() -> impl Strategy<Value = String> {
        let chars = proptest::collection::vec(
            proptest::sample::select(vec![
                '0', '1', '5', '9', '-', '+', '.', ':', ' ', 'B', 'C', 't', 'f', 'e', 'N', 'a',
                'I', 'n', 'x', '$', ',',
            ]),
            0..28,
        )
        .prop_map(|c| c.into_iter().collect::<String>());
        let decimal = (any::<i64>(), 0u32..40, any::<u64>(), any::<bool>()).prop_map(
            |(int, places, frac, neg)| {
                let frac = format!("{frac:020}");
                let frac = &frac[..(places as usize).min(20)];
                let sign = if neg && int >= 0 { "-" } else { "" };
                if frac.is_empty() {
                    format!("{sign}{int}")
                } else {
                    format!("{sign}{int}.{frac}")
                }
            },
        );
        let wide = (any::<u128>(), 0usize..4).prop_map(|(n, z)| format!("{n}{}", "0".repeat(z)));
        let when = (
            -4800i64..12000,
            0u32..14,
            0u32..33,
            0u32..26,
            0u32..61,
            0u32..62,
            0u32..1_000_000,
            -15i32..16,
            0u32..3,
        )
            .prop_map(|(y, mo, d, h, mi, s, us, zone, form)| {
                let date = if y <= 0 {
                    format!("{:04}-{mo:02}-{d:02} BC", 1 - y)
                } else {
                    format!("{y:04}-{mo:02}-{d:02}")
                };
                let time = match form {
                    0 => format!("{h:02}:{mi:02}:{s:02}"),
                    1 => format!("{h:02}:{mi:02}:{s:02}.{:06}", us),
                    _ => format!("{h:02}:{mi:02}:{s:02}.{}", us % 1000),
                };
                let zone = format!("{zone:+03}");
                match (form, date.strip_suffix(" BC")) {
                    (0, _) => date,
                    (1, None) => format!("{date} {time}{zone}"),
                    (1, Some(d)) => format!("{d} {time}{zone} BC"),
                    (_, None) => format!("{date} {time}"),
                    (_, Some(_)) => time,
                }
            });
        prop_oneof![
            chars,
            decimal,
            wide,
            when,
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|f| f.to_string()),
            Just("t".to_string()),
            Just("f".to_string()),
            Just("NaN".to_string()),
            Just("-Infinity".to_string()),
            Just("infinity".to_string()),
            Just("24:00:00".to_string()),
            Just("-0.00".to_string()),
        ]
    }

    /// Postgres's ISO output, and texts a character or two away from it.
    fn near_iso() -> impl Strategy<Value = String> {
        "[0-9]{4}-[01][0-9]-[0-3][0-9] [0-2][0-9]:[0-6][0-9]:[0-6][0-9](\\.[0-9]{0,7})?([+-][0-9]{1,3}(:[0-9]{1,2}){0,2})?( BC)?"
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3_000))]

        #[test]
        fn the_fixed_place_reading_of_a_timestamp_agrees_with_the_general_one(
            text in prop_oneof![near_iso(), text()],
            zone: bool,
        ) {
            if let Some(micros) = iso_timestamp(text.as_bytes(), zone) {
                prop_assert_eq!(Some(micros), any_timestamp(&text, zone), "{}", text);
            }
        }

        #[test]
        fn postgres_iso_timestamps_are_read_at_fixed_places(
            (y, mo, d, h, mi, s) in (1i64..=9999, 1i64..=12, 1i64..=28, 0i64..=23, 0i64..=59, 0i64..=59),
            frac in proptest::option::of("[0-9]{1,6}"),
            zone in proptest::option::of((any::<bool>(), 0i64..=15, proptest::option::of((0i64..=59, proptest::option::of(0i64..=59))))),
        ) {
            let mut text = format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}");
            if let Some(f) = &frac {
                text.push_str(&format!(".{f}"));
            }
            if let Some((east, zh, rest)) = zone {
                text.push_str(&format!("{}{zh:02}", if east { '+' } else { '-' }));
                if let Some((zm, zs)) = rest {
                    text.push_str(&format!(":{zm:02}"));
                    if let Some(zs) = zs {
                        text.push_str(&format!(":{zs:02}"));
                    }
                }
            }
            let with_zone = zone.is_some();
            let fixed = iso_timestamp(text.as_bytes(), with_zone);
            prop_assert!(fixed.is_some(), "{}", text);
            prop_assert_eq!(fixed, any_timestamp(&text, with_zone), "{}", text);
        }

        #[test]
        fn writes_what_the_value_path_writes_or_nothing(text in text()) {
            for kind in kinds() {
                for layout in layouts() {
                    check(&kind, &layout, Input::Text(text.as_bytes()));
                }
            }
        }
    }

    #[test]
    fn takes_the_common_values_of_each_kind_and_leaves_the_rest() {
        let layout = Layout {
            nullable: true,
            specials: true,
            unchanged: true,
        };
        let decimal = |scale| Kind::Decimal {
            precision: 38,
            scale,
        };
        for (kind, text) in [
            (Kind::Bool, "t"),
            (Kind::Int16, "-32768"),
            (Kind::Int32, "2147483647"),
            (Kind::Int64, "-9223372036854775808"),
            (Kind::Float32, "1.5"),
            (Kind::Float64, "-2.25e-7"),
            (decimal(2), "12.5"),
            (decimal(2), "-0.01"),
            (decimal(0), "99999999999999999999999999999999999999"),
            (Kind::Text, "héllo"),
            (Kind::Date, "2024-02-29"),
            (Kind::Time, "23:59:59.5"),
            (Kind::Timestamp, "2024-02-29 12:00:00.000001"),
            (Kind::TimestampTz, "2024-02-29 12:00:00.25+05:30"),
        ] {
            assert!(
                check(&kind, &layout, Input::Text(text.as_bytes())),
                "{kind:?} {text}"
            );
        }
        assert!(check(&Kind::Int64, &layout, Input::Null));
        // Left to the `Value` path: specials (BC dates among them), out-of-range values, values
        // over 128 bits, the unchanged marker, and kinds it does not cover.
        for (kind, input) in [
            (decimal(2), Input::Text(b"NaN")),
            (Kind::Date, Input::Text(b"infinity")),
            (Kind::Date, Input::Text(b"0044-03-15 BC")),
            (Kind::Int16, Input::Text(b"32768")),
            (decimal(2), Input::Text(b"1.234")),
            (
                decimal(0),
                Input::Text(b"999999999999999999999999999999999999999999"),
            ),
            (Kind::Int64, Input::Unchanged),
            (
                Kind::Uuid,
                Input::Text(b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
            ),
            (Kind::Text, Input::Text(b"\xff\xfe")),
            (Kind::Text, Input::Text(&[0xff, 0xfe])),
        ] {
            assert!(!check(&kind, &layout, input), "{kind:?} {input:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nullable(specials: bool, unchanged: bool) -> Layout {
        Layout {
            nullable: true,
            specials,
            unchanged,
        }
    }

    fn conv(kind: &Kind, text: &str) -> Result<Value, ConvertError> {
        convert(
            kind,
            &nullable(kind.has_specials(), false),
            Input::Text(text.as_bytes()),
        )
    }

    fn inner(v: Result<Value, ConvertError>) -> Value {
        match v {
            Ok(Value::Union(_, b)) => *b,
            other => panic!("not a union value: {other:?}"),
        }
    }

    #[test]
    fn numeric_typmod_gives_precision_and_scale() {
        // numeric(12,2): typmod = ((12 << 16) | 2) + 4
        assert_eq!(
            Kind::of(1700, (12 << 16 | 2) + 4, "numeric"),
            Kind::Decimal {
                precision: 12,
                scale: 2
            }
        );
        assert_eq!(Kind::of(1700, -1, "numeric"), Kind::VariableDecimal);
        // numeric(5,-2) and numeric(2,5) (Postgres 15): no Avro decimal.
        assert_eq!(
            Kind::of(1700, (5 << 16 | (-2i32 & 0x7FF)) + 4, "numeric"),
            Kind::VariableDecimal
        );
        assert_eq!(
            Kind::of(1700, (2 << 16 | 5) + 4, "numeric"),
            Kind::VariableDecimal
        );
        assert_eq!(
            Kind::of(1700, (38 << 16 | 38) + 4, "numeric"),
            Kind::Decimal {
                precision: 38,
                scale: 38
            }
        );
        assert_eq!(Kind::of(869, -1, "inet"), Kind::Other("inet".into()));
    }

    #[test]
    fn twos_complement_matches_java_bigdecimal_unscaled_bytes() {
        assert_eq!(twos_complement("0"), Some(vec![0x00]));
        assert_eq!(twos_complement("127"), Some(vec![0x7F]));
        assert_eq!(twos_complement("128"), Some(vec![0x00, 0x80]));
        assert_eq!(twos_complement("-1"), Some(vec![0xFF]));
        assert_eq!(twos_complement("-128"), Some(vec![0x80]));
        assert_eq!(twos_complement("-129"), Some(vec![0xFF, 0x7F]));
        assert_eq!(twos_complement("12050"), Some(vec![0x2F, 0x12]));
        // Beyond 128 bits: 10^40.
        let big = twos_complement(&format!("1{}", "0".repeat(40))).unwrap_or_default();
        assert_eq!(big.len(), 17);
    }

    #[test]
    fn decimals_are_rescaled_to_the_column_scale_and_nan_is_kept() {
        let k = Kind::Decimal {
            precision: 12,
            scale: 2,
        };
        assert_eq!(
            inner(conv(&k, "120.5")),
            Value::Decimal(apache_avro::Decimal::from(vec![0x2F, 0x12]))
        );
        assert_eq!(
            conv(&k, "NaN"),
            Ok(Value::Union(2, Box::new(Value::String("NaN".into()))))
        );
        assert!(
            conv(&k, "1.234").is_err(),
            "more digits than the scale is not silently rounded"
        );
        let v = Kind::VariableDecimal;
        assert_eq!(
            inner(conv(&v, "-0.001")),
            Value::Record(vec![
                ("scale".into(), Value::Int(3)),
                ("value".into(), Value::Bytes(vec![0xFF]))
            ])
        );
        assert_eq!(
            conv(&v, "-Infinity"),
            Ok(Value::Union(2, Box::new(Value::String("-Infinity".into()))))
        );
    }

    #[test]
    fn dates_and_timestamps_convert_including_bc_and_infinity() {
        assert_eq!(inner(conv(&Kind::Date, "1970-01-02")), Value::Date(1));
        assert_eq!(inner(conv(&Kind::Date, "2000-03-01")), Value::Date(11_017));
        assert_eq!(parse_date("0001-12-31 BC"), Some(-719_163));
        assert_eq!(
            conv(&Kind::Date, "0044-03-15 BC"),
            Ok(Value::Union(
                2,
                Box::new(Value::String("0044-03-15 BC".into()))
            )),
            "outside years 1-9999: exact text, readable by every Avro reader"
        );
        assert_eq!(
            conv(&Kind::Timestamp, "10000-01-01 00:00:00"),
            Ok(Value::Union(
                2,
                Box::new(Value::String("10000-01-01 00:00:00".into()))
            ))
        );
        assert_eq!(
            conv(&Kind::Date, "infinity"),
            Ok(Value::Union(2, Box::new(Value::String("infinity".into()))))
        );
        assert_eq!(
            inner(conv(&Kind::TimestampTz, "2024-01-31 12:00:00.5+00")),
            Value::TimestampMicros(1_706_702_400_500_000)
        );
        assert_eq!(
            inner(conv(&Kind::TimestampTz, "2024-01-31 17:30:00+05:30")),
            Value::TimestampMicros(1_706_702_400_000_000)
        );
        assert_eq!(
            inner(conv(&Kind::Timestamp, "1969-12-31 23:59:59.999999")),
            Value::LocalTimestampMicros(-1)
        );
        assert_eq!(parse_time("24:00:00"), Some(86_400_000_000));
        assert_eq!(
            conv(&Kind::Time, "24:00:00"),
            Ok(Value::Union(2, Box::new(Value::String("24:00:00".into()))))
        );
        assert_eq!(
            inner(conv(&Kind::Time, "23:59:59.5")),
            Value::TimeMicros(86_399_500_000)
        );
        assert!(conv(&Kind::Date, "31/01/2024").is_err());
    }

    #[test]
    fn scalars_convert_exactly() {
        assert_eq!(inner(conv(&Kind::Bool, "t")), Value::Boolean(true));
        assert_eq!(inner(conv(&Kind::Int16, "-32768")), Value::Int(-32768));
        assert!(conv(&Kind::Int16, "32768").is_err());
        assert_eq!(
            inner(conv(&Kind::Int64, "9223372036854775807")),
            Value::Long(i64::MAX)
        );
        assert!(matches!(inner(conv(&Kind::Float64, "NaN")), Value::Double(d) if d.is_nan()));
        assert_eq!(
            inner(conv(&Kind::Float32, "-Infinity")),
            Value::Float(f32::NEG_INFINITY)
        );
        assert_eq!(inner(conv(&Kind::Float64, "0.1")), Value::Double(0.1));
        assert_eq!(
            inner(conv(&Kind::Bytes, "\\x00ff")),
            Value::Bytes(vec![0, 255])
        );
        assert!(conv(&Kind::Bytes, "\\x0").is_err());
        assert_eq!(
            inner(conv(&Kind::Other("inet".into()), "10.0.0.1/8")),
            Value::String("10.0.0.1/8".into())
        );
    }

    #[test]
    fn money_point_interval_and_enum_have_dedicated_mappings() {
        assert_eq!(Kind::of(790, -1, "money"), Kind::Money);
        assert_eq!(Kind::of(1186, -1, "interval"), Kind::Interval);
        assert_eq!(Kind::of(600, -1, "point"), Kind::Point);
        assert_eq!(Kind::of(142, -1, "xml"), Kind::Xml);
        let money = |text: &str| match inner(conv(&Kind::Money, text)) {
            Value::Decimal(d) => {
                let bytes: Vec<u8> = (&d).try_into().expect("bytes");
                crate::tail::format_decimal(&bytes, 2)
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(money("$12.34"), "12.34");
        assert_eq!(
            money("-$92,233,720,368,547,758.08"),
            "-92233720368547758.08"
        );
        assert!(conv(&Kind::Money, "12.34").is_err(), "not lc_monetary=C");
        let Value::Record(p) = inner(conv(&Kind::Point, "(1.5,-2e-300)")) else {
            panic!("point")
        };
        assert_eq!(p[0].1, Value::Double(1.5));
        assert_eq!(p[1].1, Value::Double(-2e-300));
        assert!(conv(&Kind::Point, "(1,2").is_err());
        assert_eq!(
            inner(conv(&Kind::Interval, "P1Y-2M3DT-4H")),
            Value::String("P1Y-2M3DT-4H".into())
        );
        let mood = Kind::Enum(vec!["sad".into(), "ok".into()]);
        let schema = base_schema(&mood, &mut Names::default());
        assert_eq!(schema["connect.parameters"]["allowed"], "sad,ok");
        assert_eq!(inner(conv(&mood, "ok")), Value::String("ok".into()));
    }

    #[test]
    fn one_dimensional_arrays_are_typed_and_others_stay_exact_text() {
        let ints = Kind::of(1007, -1, "integer[]");
        assert_eq!(ints, Kind::Array(Box::new(Kind::Int32)));
        let null = Value::Union(0, Box::new(Value::Null));
        assert_eq!(
            inner(conv(&ints, "{1,NULL,3}")),
            Value::Array(vec![
                Value::Union(1, Box::new(Value::Int(1))),
                null.clone(),
                Value::Union(1, Box::new(Value::Int(3))),
            ])
        );
        assert_eq!(inner(conv(&ints, "{}")), Value::Array(vec![]));
        let texts = Kind::of(1009, -1, "text[]");
        assert_eq!(
            inner(conv(
                &texts,
                r#"{"a,b","NULL",NULL,"q\"uote","back\\slash"}"#
            )),
            Value::Array(vec![
                Value::Union(1, Box::new(Value::String("a,b".into()))),
                Value::Union(1, Box::new(Value::String("NULL".into()))),
                null,
                Value::Union(1, Box::new(Value::String("q\"uote".into()))),
                Value::Union(1, Box::new(Value::String("back\\slash".into()))),
            ])
        );
        for exact in ["{{1,2},{3,4}}", "[0:1]={1,2}"] {
            assert_eq!(
                conv(&ints, exact),
                Ok(Value::Union(2, Box::new(Value::String(exact.into()))))
            );
        }
        // numeric(12,2)[]: the typmod reaches the elements.
        let money = Kind::of(1231, (12 << 16 | 2) + 4, "numeric(12,2)[]");
        assert_eq!(
            money,
            Kind::Array(Box::new(Kind::Decimal {
                precision: 12,
                scale: 2
            }))
        );
        assert!(conv(&money, "{1.5,NaN}").is_ok());
        assert!(
            conv(&ints, "{1,x}").is_err(),
            "a bad element is an error, not a guess"
        );
    }

    #[test]
    fn null_and_unchanged_toast_stay_distinct() {
        let layout = nullable(false, true);
        assert_eq!(
            convert(&Kind::Text, &layout, Input::Null),
            Ok(Value::Union(0, Box::new(Value::Null)))
        );
        assert_eq!(
            convert(&Kind::Text, &layout, Input::Unchanged),
            Ok(Value::Union(
                2,
                Box::new(Value::Enum(0, UNCHANGED_SYMBOL.into()))
            ))
        );
        let key = Layout {
            nullable: false,
            specials: false,
            unchanged: false,
        };
        assert_eq!(
            convert(&Kind::Int64, &key, Input::Null),
            Err(ConvertError::UnexpectedNull)
        );
        assert_eq!(
            convert(&Kind::Int64, &key, Input::Text(b"7")),
            Ok(Value::Long(7))
        );
    }

    #[test]
    fn named_types_are_defined_once_then_referenced() {
        let mut names = Names::default();
        let first = column_schema(&Kind::VariableDecimal, &nullable(true, true), &mut names);
        let second = column_schema(&Kind::VariableDecimal, &nullable(true, true), &mut names);
        assert!(first[1].is_object() && first[3].is_object());
        assert_eq!(second[1], json!(VARIABLE_DECIMAL));
        assert_eq!(second[3], json!(UNCHANGED));
    }
}
