//! Every type family, snapshot and stream, compared value by value with
//! what Postgres itself says, and decoded by Python's AvroDeserializer.

use std::time::Duration;

use apache_avro::types::Value;

use crate::support::{self, field, ConfigFile, ConnectorProcess, Decoder, TestDb};

const SCHEMA: &str = "
CREATE TYPE public.mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN public.positive_int AS int CHECK (VALUE > 0);
CREATE DOMAIN public.price AS numeric(10,2);
CREATE TABLE public.everything (
    id bigint PRIMARY KEY,
    i2 smallint, i4 int, i8 bigint, f4 real, f8 double precision,
    n numeric, n_scaled numeric(10,3), m money,
    t text, vc varchar(20), c char(5), b bytea, bo boolean, u uuid,
    d date, tm time, ttz timetz, ts timestamp, tstz timestamptz, iv interval,
    j json, jb jsonb, x xml, ip inet, net cidr, mac macaddr, bits bit(4), vbits varbit,
    arr int[], arr2 text[], e public.mood, dom public.positive_int, r int4range, tsr tstzrange,
    pt point, ln line, bx box, pg polygon, ci circle, ea public.mood[], dp public.price
);";

const ROW_TYPICAL: &str = "INSERT INTO public.everything VALUES (1,
    -32768, 2147483647, -9223372036854775808, 3.14159, 2.718281828459045,
    123456789012345678901234567890.123456789, 1234567.891, 12.34,
    'text with\ttab and \"quotes\" and ünïcödé', 'varchar', 'ab', '\\x00ff10', true,
    'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
    '2024-02-29', '23:59:59.999999', '12:00:00+05:30', '2024-01-31 12:34:56.789012',
    '2024-01-31 12:34:56.789012+00', '1 year 2 mons 3 days 04:05:06.789',
    '{\"a\": [1, 2.5, null]}', '{\"b\": {\"c\": true}}', '<a>x</a>', '192.168.0.1/24',
    '10.0.0.0/8', '08:00:2b:01:02:03', B'1010', B'10101',
    '{1,NULL,3}', '{{a,b},{NULL,\"d e\"}}', 'happy', 42, '[1,10)',
    '[2024-01-01 00:00+00,2024-02-01 00:00+00)',
    '(1.5,2)', '{1,-1,0}', '(1,1),(0,0)', '((0,0),(1,0),(1,1))', '<(0,0),2>',
    '{ok,NULL,happy}', 19.99)";

const ROW_EDGES: &str =
    "INSERT INTO public.everything (id, f4, f8, n, n_scaled, d, ts, tstz, t, arr, tm, m, iv, pt)
    VALUES (2, 'NaN', '-Infinity', 'NaN', 'NaN', '0044-03-15 BC', 'infinity', '-infinity',
            '', '{}', '24:00:00', '-92233720368547758.08', '-1 years 2 days -00:00:01.5',
            '(-1e-300,-Infinity)')";

const ROW_NULLS: &str = "INSERT INTO public.everything (id) VALUES (3)";

/// Columns compared as Postgres's exact text.
const TEXT_COLUMNS: &[&str] = &[
    "t", "vc", "c", "ttz", "iv", "j", "jb", "x", "ip", "net", "mac", "bits", "vbits",
    // A two-dimensional array travels as its exact text.
    "arr2", "e", "r", "tsr", "ln", "bx", "pg", "ci",
];

/// Semantic names the value schema must carry (Debezium's, where it has
/// one), with the enum's labels.
const SCHEMA_MARKS: &[&str] = &[
    r#""connect.name":"io.debezium.data.Enum""#,
    r#""allowed":"sad,ok,happy""#,
    r#""connect.name":"io.debezium.time.Interval""#,
    r#""connect.name":"io.debezium.data.Xml""#,
    r#""connect.name":"io.debezium.data.geometry.Point""#,
    r#""connect.name":"org.apache.kafka.connect.data.Decimal""#,
];

/// A session under the settings the connector's own sessions use (so that
/// Postgres writes values as the encoder reads them), with `schema` run.
async fn with_schema(db: &TestDb, schema: &str) -> tokio_postgres::Client {
    let client = db.client().await;
    let settings: String = pgcdc::encode::types::SESSION_SETTINGS
        .iter()
        .map(|(k, v)| format!("SET {k} = '{v}';"))
        .collect();
    client.batch_execute(&settings).await.expect("settings");
    client.batch_execute(schema).await.expect("schema");
    client
}

#[tokio::test]
async fn every_type_family_round_trips_without_loss() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "types").await;
    let client = with_schema(&db, SCHEMA).await;
    client.batch_execute(ROW_TYPICAL).await.expect("row 1");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.everything"],
    ));
    let topic = format!("{}.public.everything", db.name);
    let connector = ConnectorProcess::start(&config);
    support::read_topic(&stack, &topic, 1, Duration::from_secs(60)).await;
    client.batch_execute(ROW_EDGES).await.expect("row 2");
    client.batch_execute(ROW_NULLS).await.expect("row 3");
    let records = support::read_topic(&stack, &topic, 3, Duration::from_secs(60)).await;
    assert_eq!(connector.terminate().await, 0);

    let mut decoder = Decoder::new(&stack);
    for record in &records {
        let envelope = decoder
            .decode(record.value.as_deref().expect("value"))
            .await;
        let after = field(&envelope, "after");
        let Value::Long(id) = field(after, "id") else {
            panic!("id")
        };
        let id = *id;
        // What Postgres's own output functions say, in the session
        // settings the connector decodes under.
        let text_row = client
            .simple_query(&format!(
                "SELECT {} FROM public.everything WHERE id = {id}",
                TEXT_COLUMNS.join(", ")
            ))
            .await
            .expect("text row")
            .into_iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
                _ => None,
            })
            .expect("one row");
        for (i, col) in TEXT_COLUMNS.iter().enumerate() {
            let got = field(after, col);
            match text_row.get(i) {
                None => assert_eq!(got, &Value::Null, "row {id} column {col}"),
                Some(text) => assert_eq!(
                    got,
                    &Value::String(text.to_string()),
                    "row {id} column {col}"
                ),
            }
        }
        let row = client
            .query_one(
                "SELECT i2::int, i4, i8, f4::text, f8::text, n::text, n_scaled::text, b, bo, u::text,
                        CASE WHEN isfinite(d) THEN d - '1970-01-01'::date END,
                        (extract(epoch FROM tm) * 1000000)::bigint,
                        CASE WHEN isfinite(ts) THEN (extract(epoch FROM ts) * 1000000)::bigint END,
                        CASE WHEN isfinite(tstz) THEN (extract(epoch FROM tstz) * 1000000)::bigint END,
                        d::text, ts::text, tstz::text
                 FROM public.everything WHERE id = $1",
                &[&id],
            )
            .await
            .expect("row");
        let opt_int = |i: usize| row.get::<_, Option<i32>>(i);
        match (field(after, "i2"), opt_int(0)) {
            (Value::Int(v), Some(e)) => assert_eq!(*v, e),
            (Value::Null, None) => {}
            other => panic!("i2 {other:?}"),
        }
        // A one-dimensional array is an Avro array of nullable elements.
        let arr: Option<Vec<Option<i32>>> = client
            .query_one("SELECT arr FROM public.everything WHERE id = $1", &[&id])
            .await
            .expect("arr")
            .get(0);
        match (field(after, "arr"), arr) {
            (Value::Array(items), Some(expected)) => {
                let got: Vec<Option<i32>> = items
                    .iter()
                    .map(|i| match i {
                        Value::Union(_, v) => match v.as_ref() {
                            Value::Int(n) => Some(*n),
                            _ => None,
                        },
                        _ => None,
                    })
                    .collect();
                assert_eq!(got, expected, "row {id} arr");
            }
            (Value::Null, None) => {}
            other => panic!("arr {other:?}"),
        }
        let typed = client
            .query_one(
                "SELECT dom, m::numeric::text, pt[0], pt[1], ea::text[], dp::text
                 FROM public.everything WHERE id = $1",
                &[&id],
            )
            .await
            .expect("typed row");
        // A domain travels as its base type.
        match (field(after, "dom"), typed.get::<_, Option<i32>>(0)) {
            (Value::Int(v), Some(e)) => assert_eq!(*v, e, "dom"),
            (Value::Null, None) => {}
            other => panic!("dom {other:?}"),
        }
        match (field(after, "dp"), typed.get::<_, Option<String>>(5)) {
            (Value::Decimal(d), Some(e)) => {
                let bytes: Vec<u8> = d.try_into().expect("decimal bytes");
                assert_eq!(pgcdc::tail::format_decimal(&bytes, 2), e, "dp");
            }
            (Value::Null, None) => {}
            other => panic!("dp {other:?}"),
        }
        // money as decimal(19,2).
        match (field(after, "m"), typed.get::<_, Option<String>>(1)) {
            (Value::Decimal(d), Some(e)) => {
                let bytes: Vec<u8> = d.try_into().expect("decimal bytes");
                assert_eq!(pgcdc::tail::format_decimal(&bytes, 2), e, "m");
            }
            (Value::Null, None) => {}
            other => panic!("m {other:?}"),
        }
        // point as Debezium's Point {x, y, wkb, srid}.
        match (
            field(after, "pt"),
            typed.get::<_, Option<f64>>(2),
            typed.get::<_, Option<f64>>(3),
        ) {
            (Value::Record(parts), Some(x), Some(y)) => {
                assert_eq!(parts[0].1, Value::Double(x), "pt.x");
                assert_eq!(parts[1].1, Value::Double(y), "pt.y");
                let Value::Union(_, wkb) = &parts[2].1 else {
                    panic!("wkb {parts:?}")
                };
                let Value::Bytes(wkb) = wkb.as_ref() else {
                    panic!("wkb {wkb:?}")
                };
                assert_eq!(wkb.len(), 21, "wkb of a point");
                assert_eq!(&wkb[5..13], &x.to_le_bytes(), "wkb x");
            }
            (Value::Null, None, None) => {}
            other => panic!("pt {other:?}"),
        }
        // An array of enums: an Avro array of nullable labels.
        match (
            field(after, "ea"),
            typed.get::<_, Option<Vec<Option<String>>>>(4),
        ) {
            (Value::Array(items), Some(e)) => {
                let got: Vec<Option<String>> = items
                    .iter()
                    .map(|i| match i {
                        Value::Union(_, v) => match v.as_ref() {
                            Value::String(s) => Some(s.clone()),
                            _ => None,
                        },
                        _ => None,
                    })
                    .collect();
                assert_eq!(got, e, "ea");
            }
            (Value::Null, None) => {}
            other => panic!("ea {other:?}"),
        }
        match (field(after, "i8"), row.get::<_, Option<i64>>(2)) {
            (Value::Long(v), Some(e)) => assert_eq!(*v, e),
            (Value::Null, None) => {}
            other => panic!("i8 {other:?}"),
        }
        match (field(after, "f8"), row.get::<_, Option<String>>(4)) {
            (Value::Double(v), Some(e)) => assert_eq!(
                v.to_string().to_lowercase().replace("inf", "infinity"),
                e.to_lowercase().replace("infinityinity", "infinity"),
                "f8"
            ),
            (Value::Null, None) => {}
            other => panic!("f8 {other:?}"),
        }
        match (field(after, "f4"), row.get::<_, Option<String>>(3)) {
            (Value::Float(v), Some(e)) if e == "NaN" => assert!(v.is_nan()),
            (Value::Float(v), Some(e)) => assert_eq!(*v, e.parse::<f32>().expect("f4")),
            (Value::Null, None) => {}
            other => panic!("f4 {other:?}"),
        }
        // numeric without typmod: {scale, value}; specials as their text.
        match (field(after, "n"), row.get::<_, Option<String>>(5)) {
            (Value::Record(parts), Some(e)) => {
                let (Value::Int(scale), Value::Bytes(bytes)) = (&parts[0].1, &parts[1].1) else {
                    panic!("VariableScaleDecimal {parts:?}")
                };
                assert_eq!(pgcdc::tail::format_decimal(bytes, *scale as usize), e, "n");
            }
            (Value::String(s), Some(e)) => assert_eq!(s, &e, "n special"),
            (Value::Null, None) => {}
            other => panic!("n {other:?}"),
        }
        match (field(after, "n_scaled"), row.get::<_, Option<String>>(6)) {
            (Value::Decimal(d), Some(e)) => {
                let bytes: Vec<u8> = d.try_into().expect("decimal bytes");
                assert_eq!(pgcdc::tail::format_decimal(&bytes, 3), e, "n_scaled");
            }
            (Value::String(s), Some(e)) => assert_eq!(s, &e, "n_scaled special"),
            (Value::Null, None) => {}
            other => panic!("n_scaled {other:?}"),
        }
        match (field(after, "b"), row.get::<_, Option<Vec<u8>>>(7)) {
            (Value::Bytes(v), Some(e)) => assert_eq!(v, &e),
            (Value::Null, None) => {}
            other => panic!("b {other:?}"),
        }
        match (field(after, "u"), row.get::<_, Option<String>>(9)) {
            (Value::Uuid(v), Some(e)) => assert_eq!(v.to_string(), e),
            (Value::Null, None) => {}
            other => panic!("u {other:?}"),
        }
        match (
            field(after, "d"),
            row.get::<_, Option<i32>>(10),
            row.get::<_, Option<String>>(14),
        ) {
            (Value::Date(v), Some(e), _) => assert_eq!(*v, e, "d"),
            (Value::String(s), _, Some(text)) => assert_eq!(s, &text, "d special"),
            (Value::Null, None, None) => {}
            other => panic!("d {other:?}"),
        }
        match (field(after, "tm"), row.get::<_, Option<i64>>(11)) {
            (Value::TimeMicros(v), Some(e)) => assert_eq!(*v, e, "tm"),
            (Value::String(s), Some(e)) => {
                assert_eq!((s.as_str(), e), ("24:00:00", 86_400_000_000), "tm special")
            }
            (Value::Null, None) => {}
            other => panic!("tm {other:?}"),
        }
        match (field(after, "ts"), row.get::<_, Option<String>>(15)) {
            (Value::LocalTimestampMicros(v), Some(_)) => {
                assert_eq!(Some(*v), row.get::<_, Option<i64>>(12), "ts");
            }
            (Value::String(s), Some(text)) => assert_eq!(s, &text, "ts special"),
            (Value::Null, None) => {}
            other => panic!("ts {other:?}"),
        }
        match (field(after, "tstz"), row.get::<_, Option<String>>(16)) {
            (Value::TimestampMicros(v), Some(_)) => {
                assert_eq!(Some(*v), row.get::<_, Option<i64>>(13), "tstz");
            }
            (Value::String(s), Some(text)) => assert_eq!(s, &text, "tstz special"),
            (Value::Null, None) => {}
            other => panic!("tstz {other:?}"),
        }
    }

    let schema = reqwest::get(format!(
        "{}/subjects/{topic}-value/versions/latest/schema",
        stack.registry_url
    ))
    .await
    .expect("schema")
    .text()
    .await
    .expect("schema text");
    for mark in SCHEMA_MARKS {
        assert!(schema.contains(mark), "{mark} missing from {schema}");
    }

    // A standard Avro reader in another language decodes every record.
    let python = std::env::var("PGCDC_PYTHON").expect("PGCDC_PYTHON (set by scripts/test)");
    let out = tokio::process::Command::new(python)
        .arg(support::repo_file("tests/interop/read_changelog.py"))
        .args([topic.as_str(), "3", "n_scaled"])
        .env("PGCDC_REGISTRY_URL", &stack.registry_url)
        .env("PGCDC_KAFKA_BROKERS", &stack.brokers)
        .output()
        .await
        .expect("python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("decoded 3 records"), "{stdout}");
    assert!(stdout.contains("1 r n_scaled=1234567.891"), "{stdout}");
    db.drop_db().await;
}

/// Every kind a snapshot copies in binary, at its edges: each row copied
/// both ways encodes to the same key and envelope bytes, and each binary
/// value renders to the text Postgres writes for it.
const BINARY_SCHEMA: &str = r#"
CREATE TYPE public.mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN public.cents AS numeric(8,2);
CREATE TABLE public.binary_kinds (
    id bigint PRIMARY KEY, bo boolean, i2 smallint, i4 int, f4 real, f8 double precision,
    n2 numeric(12,2), n38 numeric(38,10), n0 numeric(10,0), t text, vc varchar(5), c char(5),
    nm name, b bytea, u uuid, d date, tm time, ts timestamp, tstz timestamptz, e public.mood,
    dc public.cents, j json, jb jsonb, nv numeric, o oid
);
INSERT INTO public.binary_kinds VALUES
 (1, true, -32768, -2147483648, 3.14159, 2.718281828459045, 0, 1234567890123456789012345678.0123456789,
  100000, '', 'abc', 'ab', 'n', '\x00ff10', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '2024-02-29',
  '23:59:59.999999', '2024-01-31 12:34:56.789012', '2024-01-31 12:34:56.789012+05:30', 'ok', 12.5,
  '{"a": [1, 2.50, "x y"]}', '{"b": {"c": null}, "a": 1}',
  12345678901234567890123456789012345678901234.5678, 4294967295),
 (2, false, 32767, 2147483647, 'NaN', 'Infinity', -0.01, -0.0000000001, -7, 'ünïcödé	tab', '',
  '', '', '', '00000000-0000-0000-0000-000000000000', '0044-03-15 BC', '24:00:00', 'infinity',
  '-infinity', 'happy', -0.01, '[]', '"ünï"', 'NaN', 0),
 (3, NULL, 0, 42, '-Infinity', '-0', 'NaN', 'NaN', 0, 'x', NULL, NULL, NULL, NULL, NULL,
  'infinity', '00:00:00', '0044-03-15 12:00:00 BC', '1999-12-31 23:59:59.999999+00', NULL, 0, 'null', 'null', 'Infinity', 1),
 (4, true, 1, 1, 1e-45, 1e300, 1234567890.12, 0.5, 1, 'y', 'z', 'zzzzz', 'name', '\x', NULL,
  '10000-01-01', '12:30:00.5', '10000-01-01 00:00:00', '0001-01-01 00:00:00+00', 'sad', 999999.99, '1.50', '1.50', 0.000000000000000000001, NULL),
 (5, NULL, NULL, NULL, '-0', 'NaN', 0.5, -1, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  '-infinity', NULL, '1969-12-31 23:59:59.999999', '0001-01-01 00:00:00+00'::timestamptz - interval '1 day', NULL, NULL, NULL, NULL, '-Infinity', NULL),
 (6, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  '1970-01-01', NULL, '2000-01-01 00:00:00', '9999-12-31 23:59:59.999999+00', NULL, -1, '{}', '{}', -123.4500, 42);"#;

#[tokio::test]
async fn binary_copy_values_encode_as_their_text_does() {
    use futures_util::TryStreamExt;
    use pgcdc::encode::binary::{self, Form};
    use pgcdc::encode::types::Input;
    use pgcdc::source::catalog::{self, CopyBinary, CopyStep};

    let stack = support::stack();
    let db = TestDb::create(&stack, "binkinds").await;
    let client = with_schema(&db, BINARY_SCHEMA).await;
    let (_, desc) = catalog::describe(&client, "public", "binary_kinds")
        .await
        .expect("describe")
        .expect("table");
    // What a chunk checks under its lock matches what the plan described
    // (the domain resolved to its base type), and sees a type changed
    // without a table rewrite, which a binary COPY would misread.
    let planned: Vec<(String, u32, i32)> = desc
        .columns
        .iter()
        .map(|c| (c.name.clone(), c.type_oid, c.type_modifier))
        .collect();
    let current = || async {
        let now = catalog::current_table(&client, "public", "binary_kinds").await;
        now.expect("the table now").columns
    };
    assert_eq!(current().await, planned);
    assert!(planned.contains(&("dc".into(), 1700, (8 << 16 | 2) + 4)));
    let mut codec =
        pgcdc::encode::TableCodec::new("t.public.binary_kinds", desc.clone()).expect("codec");
    codec.set_ids(1, 2);
    let forms = codec.binary_forms().expect("every column copies in binary");
    let form_of = |name: &str| {
        forms[desc
            .columns
            .iter()
            .position(|c| c.name == name)
            .expect(name)]
    };
    assert_eq!(
        ["t", "n2", "j", "jb", "nv", "o"].map(form_of),
        [
            Form::Text,
            Form::Binary,
            Form::Text,
            Form::Jsonb,
            Form::Binary,
            Form::Binary
        ]
    );

    let copy = |format: &'static str| {
        let client = &client;
        async move {
            let stream = client
                .copy_out(&format!(
                    "COPY (SELECT * FROM public.binary_kinds ORDER BY id) TO STDOUT{format}"
                ))
                .await
                .expect("copy");
            let chunks: Vec<bytes::Bytes> = stream.try_collect().await.expect("copy data");
            chunks.concat()
        }
    };
    let text_data = copy("").await;
    let text_rows: Vec<Vec<Option<Vec<u8>>>> = text_data
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(catalog::copy_fields)
        .collect();
    let binary_data = copy(" (FORMAT binary)").await;
    // Fed a byte at a time at first: a row or header cut anywhere waits
    // for the rest.
    let mut reader = CopyBinary::new(desc.columns.len());
    for cut in 0..40 {
        assert_eq!(
            reader.next(&binary_data[..cut], 0),
            Ok(None),
            "cut at {cut}"
        );
    }
    let mut binary_rows: Vec<Vec<Option<Vec<u8>>>> = Vec::new();
    let mut at = 0;
    loop {
        match reader.next(&binary_data, at).expect("binary COPY") {
            Some(CopyStep::Row(end)) => {
                binary_rows.push(
                    reader
                        .fields(&binary_data)
                        .map(|f| f.map(<[u8]>::to_vec))
                        .collect(),
                );
                at = end;
            }
            Some(CopyStep::End(end)) => {
                assert_eq!(end, binary_data.len(), "nothing after the trailer");
                break;
            }
            None => panic!("the binary COPY ends mid-row at {at}"),
        }
    }
    assert_eq!(binary_rows.len(), 6);
    assert_eq!(text_rows.len(), 6);

    let src = pgcdc::encode::SourceInfo {
        connector_name: "t",
        db: "d",
        position: pgcdc::encode::Position {
            commit_lsn: 1,
            seq: 0,
        },
        lsn: 1,
        tx_id: None,
        ts_ms: 0,
        snapshot: "true",
        table_order: 0,
    };
    for (text_row, binary_row) in text_rows.iter().zip(&binary_rows) {
        let id = String::from_utf8_lossy(text_row[0].as_deref().expect("id")).into_owned();
        let as_text: Vec<Input<'_>> = text_row
            .iter()
            .map(|f| f.as_deref().map_or(Input::Null, Input::Text))
            .collect();
        let as_binary: Vec<Input<'_>> = binary_row
            .iter()
            .zip(&forms)
            .map(|(f, form)| {
                f.as_deref()
                    .map_or(Input::Null, |b| binary::input(*form, b))
            })
            .collect();
        let encode = |row: &[Input<'_>]| {
            (
                codec.encode_key(row).expect("key"),
                codec
                    .encode_value(pgcdc::encode::Op::Read, None, Some(row), &src)
                    .expect("value"),
            )
        };
        assert_eq!(encode(&as_binary), encode(&as_text), "row {id}");
        // Each value's text (what a dead-lettered row's payload shows) is
        // Postgres's own, whichever form it came in.
        for (((c, t), b), form) in desc
            .columns
            .iter()
            .zip(text_row)
            .zip(binary_row)
            .zip(&forms)
        {
            let kind = c.kind();
            let (Some(t), Some(b)) = (t, b) else {
                assert_eq!(t.is_none(), b.is_none(), "row {id} column {}: NULL", c.name);
                continue;
            };
            let input = binary::input(*form, b);
            let shown = input.text(&kind).unwrap_or_default();
            assert_eq!(
                String::from_utf8_lossy(&shown),
                String::from_utf8_lossy(t),
                "row {id} column {}: text",
                c.name
            );
        }
    }
    client
        .batch_execute("ALTER TABLE public.binary_kinds ALTER COLUMN ts TYPE timestamptz")
        .await
        .expect("alter");
    let altered = current().await;
    assert_ne!(
        altered, planned,
        "timestamp -> timestamptz (no rewrite under UTC)"
    );
    db.drop_db().await;
}
