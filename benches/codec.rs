//! Micro-benchmarks of the per-change hot path (issue 10): the pgoutput
//! decoder and the Avro envelope encoder, on rows shaped like the demo's
//! `orders` (int8, int8, numeric(12,2), text, timestamptz, null text),
//! from their text (the stream, a text COPY) and from Postgres's binary
//! format (a snapshot's binary COPY).
//! Throughput is in bytes: pgoutput message bytes read by the decoder,
//! framed Avro bytes written by the encoder.
//!
//! ```text
//! cargo bench --bench codec
//! ```

use divan::counter::{BytesCount, ItemsCount};
use divan::Bencher;
use pgcdc::encode::binary;
use pgcdc::encode::types::Input;
use pgcdc::encode::{ColumnDesc, Op, Position, SourceInfo, TableCodec, TableDesc};
use pgcdc::source::pgoutput;

const ROWS: usize = 1000;

fn main() {
    divan::main();
}

/// The text columns of row `i`; `None` is NULL.
fn row(i: usize) -> [Option<String>; 6] {
    [
        Some(i.to_string()),
        Some((1 + i % 1000).to_string()),
        Some(format!("{}.25", i % 500)),
        Some(if i.is_multiple_of(3) { "paid" } else { "new" }.to_string()),
        Some("2026-12-01 21:24:20.123456+00".to_string()),
        None,
    ]
}

/// Row `i` in Postgres's binary format, as a binary COPY sends it.
fn binary_row(i: usize) -> [Option<Vec<u8>>; 6] {
    let int8 = |v: i64| Some(v.to_be_bytes().to_vec());
    // numeric `{i % 500}.25`: base-10000 digits, weight, sign, dscale 2.
    let whole = (i % 500) as u16;
    let (weight, digits): (i16, Vec<u16>) = if whole == 0 {
        (-1, vec![2500])
    } else {
        (0, vec![whole, 2500])
    };
    let mut amount = Vec::new();
    for w in [digits.len() as u16, weight as u16, 0, 2] {
        amount.extend_from_slice(&w.to_be_bytes());
    }
    for d in digits {
        amount.extend_from_slice(&d.to_be_bytes());
    }
    let status = if i.is_multiple_of(3) { "paid" } else { "new" };
    [
        int8(i as i64),
        int8(1 + (i % 1000) as i64),
        Some(amount),
        Some(status.as_bytes().to_vec()),
        // 2026-12-01 21:24:20.123456 UTC in microseconds from 2000-01-01.
        int8(849_475_460_123_456),
        None,
    ]
}

/// A pgoutput Insert message of row `i` for relation 16384.
fn insert_message(i: usize) -> Vec<u8> {
    let cols = row(i);
    let mut m = vec![b'I'];
    m.extend_from_slice(&16384u32.to_be_bytes());
    m.push(b'N');
    m.extend_from_slice(&(cols.len() as i16).to_be_bytes());
    for c in &cols {
        match c {
            None => m.push(b'n'),
            Some(text) => {
                m.push(b't');
                m.extend_from_slice(&(text.len() as i32).to_be_bytes());
                m.extend_from_slice(text.as_bytes());
            }
        }
    }
    m
}

fn orders_codec() -> TableCodec {
    let col = |name: &str, oid: u32, typmod: i32, key: bool| ColumnDesc {
        name: name.into(),
        type_oid: oid,
        type_modifier: typmod,
        type_name: String::new(),
        enum_labels: None,
        array: false,
        key,
    };
    let desc = TableDesc {
        schema: "public".into(),
        table: "orders".into(),
        columns: vec![
            col("id", 20, -1, true),
            col("customer_id", 20, -1, false),
            col("amount", 1700, (12 << 16 | 2) + 4, false),
            col("status", 25, -1, false),
            col("created_at", 1184, -1, false),
            col("note", 25, -1, false),
        ],
    };
    let mut codec = TableCodec::new("demo.public.orders", desc).expect("the orders codec");
    codec.set_ids(1, 2);
    codec
}

#[divan::bench]
fn pgoutput_decode(bencher: Bencher) {
    let messages: Vec<Vec<u8>> = (0..ROWS).map(insert_message).collect();
    let bytes: usize = messages.iter().map(Vec::len).sum();
    bencher
        .counter(BytesCount::new(bytes))
        .counter(ItemsCount::new(ROWS))
        .bench(|| {
            for m in &messages {
                let decoded = pgoutput::decode(divan::black_box(m)).expect("an insert");
                divan::black_box(decoded);
            }
        });
}

/// The source block of row `i`'s event.
fn src(i: usize) -> SourceInfo<'static> {
    SourceInfo {
        connector_name: "demo",
        db: "shop",
        position: Position {
            commit_lsn: 0x5_8B61_E000,
            seq: i as u64 + 1,
        },
        lsn: 0x5_8B61_0000 + i as u64 * 64,
        tx_id: Some(4242),
        ts_ms: 1_796_160_260_123,
        snapshot: "false",
        table_order: i as u64 + 1,
    }
}

/// The envelope encoder over `ROWS` rows given as inputs.
fn encode_envelopes(bencher: Bencher, inputs: &[Vec<Input<'_>>]) {
    let codec = orders_codec();
    let bytes: usize = inputs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            codec.encode_key(r).expect("a key").len()
                + codec
                    .encode_value(Op::Create, None, Some(r), &src(i))
                    .expect("a value")
                    .len()
        })
        .sum();
    bencher
        .counter(BytesCount::new(bytes))
        .counter(ItemsCount::new(ROWS))
        .bench(|| {
            for (i, r) in inputs.iter().enumerate() {
                let key = codec.encode_key(divan::black_box(r)).expect("a key");
                let value = codec
                    .encode_value(Op::Create, None, Some(r), &src(i))
                    .expect("a value");
                divan::black_box((key, value));
            }
        });
}

/// From each column's text (the stream, a text COPY).
#[divan::bench]
fn avro_encode_envelope(bencher: Bencher) {
    let rows: Vec<[Option<String>; 6]> = (0..ROWS).map(row).collect();
    let inputs: Vec<Vec<Input<'_>>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|c| {
                    c.as_ref()
                        .map_or(Input::Null, |t| Input::Text(t.as_bytes()))
                })
                .collect()
        })
        .collect();
    encode_envelopes(bencher, &inputs);
}

/// From Postgres's binary format (a snapshot's binary COPY): the same
/// rows, and the same bytes out (checked before timing).
#[divan::bench]
fn avro_encode_envelope_binary(bencher: Bencher) {
    let codec = orders_codec();
    let forms = codec.binary_forms().expect("orders copies in binary");
    let rows: Vec<[Option<Vec<u8>>; 6]> = (0..ROWS).map(binary_row).collect();
    let inputs: Vec<Vec<Input<'_>>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .zip(&forms)
                .map(|(c, form)| c.as_ref().map_or(Input::Null, |b| binary::input(*form, b)))
                .collect()
        })
        .collect();
    let texts: Vec<[Option<String>; 6]> = (0..ROWS).map(row).collect();
    for (i, (b, t)) in inputs.iter().zip(&texts).enumerate() {
        let t: Vec<Input<'_>> = t
            .iter()
            .map(|c| {
                c.as_ref()
                    .map_or(Input::Null, |t| Input::Text(t.as_bytes()))
            })
            .collect();
        let encode = |r: &[Input<'_>]| {
            let key = codec.encode_key(r).expect("a key");
            let value = codec.encode_value(Op::Create, None, Some(r), &src(i));
            (key, value.expect("a value"))
        };
        assert_eq!(encode(b), encode(&t), "row {i}");
    }
    encode_envelopes(bencher, &inputs);
}
