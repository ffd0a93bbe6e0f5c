//! Avro binary encoding written straight into a buffer, without walking a
//! schema: the caller writes fields in the schema's order and picks each
//! union branch itself (the codec owns both the schema and the order).
//!
//! Guarantee: for a value that validates against a schema, [`value`]
//! writes the bytes apache-avro's validating writer writes for it. The
//! codec's tests and its debug-build check compare the two.

use apache_avro::types::Value;

/// Zig-zag varint, Avro's `int` and `long`.
pub fn long(out: &mut Vec<u8>, n: i64) {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    while z >= 0x80 {
        out.push((z as u8) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

/// A union's branch index (the branch's value follows).
pub fn branch(out: &mut Vec<u8>, index: u32) {
    long(out, i64::from(index));
}

pub fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    long(out, b.len() as i64);
    out.extend_from_slice(b);
}

pub fn string(out: &mut Vec<u8>, s: &str) {
    bytes(out, s.as_bytes());
}

/// A value as its schema position types it; the variants the codecs
/// build, and an error naming any other.
pub fn value(out: &mut Vec<u8>, v: &Value) -> Result<(), String> {
    match v {
        Value::Null => {}
        Value::Boolean(b) => out.push(u8::from(*b)),
        Value::Int(n) | Value::Date(n) => long(out, i64::from(*n)),
        Value::Long(n)
        | Value::TimeMicros(n)
        | Value::TimestampMicros(n)
        | Value::LocalTimestampMicros(n) => long(out, *n),
        Value::Float(f) => out.extend_from_slice(&f.to_le_bytes()),
        Value::Double(f) => out.extend_from_slice(&f.to_le_bytes()),
        Value::Bytes(b) => bytes(out, b),
        Value::String(s) => string(out, s),
        Value::Uuid(u) => string(out, u.hyphenated().encode_lower(&mut [0; 36])),
        Value::Decimal(d) => {
            let b = Vec::<u8>::try_from(d).map_err(|e| e.to_string())?;
            bytes(out, &b);
        }
        Value::Enum(index, _) => long(out, i64::from(*index)),
        Value::Union(index, inner) => {
            branch(out, *index);
            value(out, inner)?;
        }
        Value::Array(items) => {
            if !items.is_empty() {
                long(out, items.len() as i64);
                for item in items {
                    value(out, item)?;
                }
            }
            out.push(0);
        }
        Value::Record(fields) => {
            for (_, f) in fields {
                value(out, f)?;
            }
        }
        other => return Err(format!("no direct encoding for {other:?}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longs_are_zigzag_varints() {
        let enc = |n: i64| {
            let mut out = Vec::new();
            long(&mut out, n);
            out
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(-1), [1]);
        assert_eq!(enc(1), [2]);
        assert_eq!(enc(-64), [0x7f]);
        assert_eq!(enc(64), [0x80, 0x01]);
        assert_eq!(
            enc(i64::MAX),
            [0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        assert_eq!(
            enc(i64::MIN),
            [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn values_encode_as_apache_avro_encodes_them() {
        let schema = apache_avro::Schema::parse_str(
            r#"{"type": "record", "name": "r", "fields": [
                {"name": "a", "type": ["null", "int"]},
                {"name": "b", "type": {"type": "array", "items": "string"}},
                {"name": "c", "type": {"type": "array", "items": "long"}},
                {"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}},
                {"name": "e", "type": {"type": "string", "logicalType": "uuid"}},
                {"name": "f", "type": "double"},
                {"name": "g", "type": "float"},
                {"name": "h", "type": "boolean"},
                {"name": "i", "type": {"type": "enum", "name": "u", "symbols": ["X", "Y"]}},
                {"name": "j", "type": {"type": "int", "logicalType": "date"}},
                {"name": "k", "type": {"type": "long", "logicalType": "timestamp-micros"}}
            ]}"#,
        )
        .expect("test value");
        let v = Value::Record(vec![
            ("a".into(), Value::Union(1, Box::new(Value::Int(-300)))),
            (
                "b".into(),
                Value::Array(vec![Value::String("é".into()), Value::String("".into())]),
            ),
            ("c".into(), Value::Array(vec![])),
            (
                "d".into(),
                Value::Decimal(apache_avro::Decimal::from(vec![0xff, 0x38])),
            ),
            (
                "e".into(),
                Value::Uuid(
                    "550e8400-e29b-41d4-a716-446655440000"
                        .parse()
                        .expect("test value"),
                ),
            ),
            ("f".into(), Value::Double(-1.5e300)),
            ("g".into(), Value::Float(0.1)),
            ("h".into(), Value::Boolean(true)),
            ("i".into(), Value::Enum(1, "Y".into())),
            ("j".into(), Value::Date(-719162)),
            ("k".into(), Value::TimestampMicros(1_700_000_000_000_000)),
        ]);
        let mut theirs = Vec::new();
        apache_avro::writer::datum::GenericDatumWriter::builder(&schema)
            .build()
            .expect("test value")
            .write_value_ref(&mut theirs, &v)
            .expect("test value");
        let mut ours = Vec::new();
        value(&mut ours, &v).expect("test value");
        assert_eq!(ours, theirs);
    }
}
