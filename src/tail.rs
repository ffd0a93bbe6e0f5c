//! `pgcdc tail`: print changelog events as JSON lines, decoded through the
//! registry, the way a consumer team would read them.
//!
//! Guarantee: read-only. It joins no consumer group and commits nothing;
//! it assigns partitions directly and reads from the beginning (or the
//! end with `--follow` only).

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use apache_avro::types::Value;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{json, Value as Json};

use crate::config::Config;
use crate::encode::{decode_datum, unframe};
use crate::materialize::shape::named_types;
use crate::registry::client::RegistryClient;
use crate::sink;
use crate::sink::CreateClient as _;

/// Avro value to JSON for display, guided by the writer schema: unions
/// unwrapped, decimals in decimal notation, bytes as hex.
pub fn to_json(v: &Value, schema: &Json, names: &HashMap<String, Json>) -> Json {
    let schema = match schema {
        Json::String(name) => names.get(name).unwrap_or(schema),
        other => other,
    };
    match (v, schema) {
        (Value::Union(i, inner), Json::Array(variants)) => to_json(
            inner,
            variants.get(*i as usize).unwrap_or(&Json::Null),
            names,
        ),
        (Value::Record(fields), Json::Object(o)) => {
            let defs = o
                .get("fields")
                .and_then(Json::as_array)
                .cloned()
                .unwrap_or_default();
            Json::Object(
                fields
                    .iter()
                    .zip(defs.iter().chain(std::iter::repeat(&Json::Null)))
                    .map(|((k, v), d)| {
                        (
                            k.clone(),
                            to_json(v, d.get("type").unwrap_or(&Json::Null), names),
                        )
                    })
                    .collect(),
            )
        }
        (Value::Decimal(d), Json::Object(o)) => {
            let scale = o.get("scale").and_then(Json::as_u64).unwrap_or(0) as usize;
            let bytes: Vec<u8> = d.try_into().unwrap_or_default();
            json!(format_decimal(&bytes, scale))
        }
        (Value::Null, _) => Json::Null,
        (Value::Boolean(b), _) => json!(b),
        (Value::Int(n) | Value::Date(n) | Value::TimeMillis(n), _) => json!(n),
        (
            Value::Long(n)
            | Value::TimeMicros(n)
            | Value::TimestampMillis(n)
            | Value::TimestampMicros(n)
            | Value::TimestampNanos(n)
            | Value::LocalTimestampMillis(n)
            | Value::LocalTimestampMicros(n)
            | Value::LocalTimestampNanos(n),
            _,
        ) => json!(n),
        (Value::Float(f), _) => json!(f.to_string()),
        (Value::Double(f), _) => json!(f.to_string()),
        (Value::String(s) | Value::Enum(_, s), _) => json!(s),
        (Value::Bytes(b) | Value::Fixed(_, b), _) => json!(crate::encode::hex(b)),
        (Value::Uuid(u), _) => json!(u.to_string()),
        (Value::Array(items), s) => {
            let item = s.get("items").unwrap_or(&Json::Null);
            Json::Array(items.iter().map(|i| to_json(i, item, names)).collect())
        }
        (other, _) => json!(format!("{other:?}")),
    }
}

/// Big-endian two's complement unscaled bytes and a scale, as `-12.34`.
pub fn format_decimal(bytes: &[u8], scale: usize) -> String {
    let negative = bytes.first().is_some_and(|b| b & 0x80 != 0);
    // Magnitude, big-endian.
    let mut mag: Vec<u8> = if negative {
        let mut m: Vec<u8> = bytes.iter().map(|b| !b).collect();
        for b in m.iter_mut().rev() {
            let (v, carry) = b.overflowing_add(1);
            *b = v;
            if !carry {
                break;
            }
        }
        m
    } else {
        bytes.to_vec()
    };
    // Repeated division by 10 for the decimal digits.
    let mut digits = Vec::new();
    while mag.iter().any(|&b| b != 0) {
        let mut rem = 0u32;
        for b in mag.iter_mut() {
            let cur = (rem << 8) | u32::from(*b);
            *b = (cur / 10) as u8;
            rem = cur % 10;
        }
        digits.push(b'0' + rem as u8);
    }
    while digits.len() <= scale {
        digits.push(b'0');
    }
    digits.reverse();
    let text = String::from_utf8(digits).unwrap_or_default();
    let (int, frac) = text.split_at(text.len() - scale);
    let sign = if negative { "-" } else { "" };
    if scale == 0 {
        format!("{sign}{int}")
    } else {
        format!("{sign}{int}.{frac}")
    }
}

/// Prints up to `max` events of the given tables' topics, then returns the
/// number printed. Stops early when nothing arrives for `idle`.
pub async fn run(
    config: &Config,
    tables: &[String],
    max: usize,
    idle: Duration,
) -> Result<usize, String> {
    let topics: Vec<String> = tables.iter().flat_map(|t| config.topics_of(t)).collect();
    let kafka = config.kafka.clone();
    let registry = RegistryClient::new(&config.registry).map_err(|e| e.to_string())?;
    let (tx, mut rx) =
        tokio::sync::mpsc::channel::<(String, i32, i64, Option<Vec<u8>>, Option<Vec<u8>>)>(1024);
    let reader = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let mut cc = sink::client_config(&kafka);
        // Producer-only pass-through properties would only warn here.
        for producer_only in [
            "compression.type",
            "compression.codec",
            "linger.ms",
            "batch.size",
        ] {
            cc.remove(producer_only);
        }
        let consumer: BaseConsumer<crate::sink::Quiet> = cc
            .set("group.id", "pgcdc-tail")
            .set("enable.auto.commit", "false")
            .client_with(crate::sink::Quiet)
            .map_err(|e| e.to_string())?;
        let mut tpl = TopicPartitionList::new();
        for topic in &topics {
            let md = consumer
                .fetch_metadata(Some(topic), Duration::from_secs(10))
                .map_err(|e| format!("{topic}: {e}"))?;
            for t in md.topics().iter().filter(|t| t.error().is_none()) {
                for p in t.partitions() {
                    tpl.add_partition_offset(topic, p.id(), Offset::Beginning)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        consumer.assign(&tpl).map_err(|e| e.to_string())?;
        let mut last = Instant::now();
        while last.elapsed() < idle {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    last = Instant::now();
                    let item = (
                        m.topic().to_string(),
                        m.partition(),
                        m.offset(),
                        m.key().map(<[u8]>::to_vec),
                        m.payload().map(<[u8]>::to_vec),
                    );
                    if tx.blocking_send(item).is_err() {
                        break;
                    }
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => {}
            }
        }
        Ok(())
    });
    let mut schemas: HashMap<u32, Schemas> = HashMap::new();
    let mut printed = 0;
    while let Some((topic, partition, offset, key, value)) = rx.recv().await {
        let at = format!("{topic}/{partition}@{offset}");
        let k = decode_payload(&registry, &mut schemas, key.as_deref(), &at).await?;
        let v = decode_payload(&registry, &mut schemas, value.as_deref(), &at).await?;
        let line =
            json!({"topic": topic, "partition": partition, "offset": offset, "key": k, "value": v});
        // A closed stdout (a pipe whose reader left) ends the tail quietly.
        if writeln!(std::io::stdout(), "{line}").is_err() {
            break;
        }
        printed += 1;
        if printed >= max {
            break;
        }
    }
    drop(rx);
    reader.await.map_err(|e| e.to_string())??;
    Ok(printed)
}

/// A writer schema, parsed and as JSON with its named types.
struct Schemas {
    parsed: apache_avro::Schema,
    json: Json,
    names: HashMap<String, Json>,
}

async fn decode_payload(
    registry: &RegistryClient,
    schemas: &mut HashMap<u32, Schemas>,
    bytes: Option<&[u8]>,
    at: &str,
) -> Result<Json, String> {
    let Some(bytes) = bytes else {
        return Ok(Json::Null);
    };
    let (id, datum) = unframe(bytes).ok_or_else(|| format!("{at}: not Confluent wire format"))?;
    if let std::collections::hash_map::Entry::Vacant(e) = schemas.entry(id) {
        let text = registry
            .schema_by_id(id)
            .await
            .map_err(|e| format!("{at}: {e}"))?;
        let json: Json =
            serde_json::from_str(&text).map_err(|e| format!("{at}: schema {id}: {e}"))?;
        let mut names = HashMap::new();
        named_types(&json, "", &mut names);
        let parsed =
            apache_avro::Schema::parse_str(&text).map_err(|e| format!("{at}: schema {id}: {e}"))?;
        e.insert(Schemas {
            parsed,
            json,
            names,
        });
    }
    let s = &schemas[&id];
    decode_datum(&s.parsed, datum)
        .map(|v| to_json(&v, &s.json, &s.names))
        .map_err(|e| format!("{at}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_format_with_their_scale() {
        assert_eq!(format_decimal(&[0x2F, 0x12], 2), "120.50");
        assert_eq!(format_decimal(&[0xFF], 3), "-0.001");
        assert_eq!(format_decimal(&[0x00], 0), "0");
        assert_eq!(format_decimal(&[0x80], 1), "-12.8");
    }
}
