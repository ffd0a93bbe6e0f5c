//! Row changes to Avro: key and Debezium-envelope value schemas per table,
//! and their Confluent wire-format encoding.
//!
//! Guarantees:
//! - One [`TableCodec`] per table shape; every value it writes validates
//!   against the schema registered for it, and is framed as magic byte 0,
//!   the 4-byte big-endian schema id, then the Avro binary datum. Change
//!   events are written straight to bytes in the schema's field order
//!   ([`datum`]; apache-avro's validating writer cost most of the
//!   connector's time); debug builds, so every test, check each one
//!   against apache-avro.
//! - Every value column is optional, so a before-image that carries only
//!   the replica-identity columns (REPLICA IDENTITY DEFAULT or INDEX) shows
//!   the other columns as null rather than inventing values; columns that
//!   can be TOASTed also carry the explicit unchanged marker.
//!
//! ```text
//!  TableDesc ──► schemas (Key, Envelope{before, after: Value, source, op, ts_ms, transaction})
//!      │                       │ registered ──► ids
//!      ▼                       ▼
//!  Change ──► Avro values ──► [0][id][datum]
//! ```

pub mod binary;
pub mod datum;
pub mod types;

use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use apache_avro::Schema;
use serde_json::{json, Value as Json};

use types::{column_schema, convert, ConvertError, Input, Kind, Layout, Names};

/// A column as the relation (or the catalog, for snapshots) describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnDesc {
    pub name: String,
    /// The type, with domains resolved to their base type.
    pub type_oid: u32,
    pub type_modifier: i32,
    /// Postgres type name as declared (a domain's own name), kept for
    /// types without a dedicated mapping.
    pub type_name: String,
    /// Labels of an enum type, or of the element of an array of enums.
    pub enum_labels: Option<Vec<String>>,
    /// The (base) type is an array.
    pub array: bool,
    /// Part of the Kafka key.
    pub key: bool,
}

impl ColumnDesc {
    /// How the column travels in Avro.
    pub fn kind(&self) -> Kind {
        match &self.enum_labels {
            Some(labels) if self.array => Kind::Array(Box::new(Kind::Enum(labels.clone()))),
            Some(labels) => Kind::Enum(labels.clone()),
            None => Kind::of(self.type_oid, self.type_modifier, &self.type_name),
        }
    }
}

/// A captured table's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableDesc {
    pub schema: String,
    pub table: String,
    pub columns: Vec<ColumnDesc>,
}

impl TableDesc {
    /// The table as `source.tables` writes it (see [`crate::config::table_name`]).
    pub fn qualified(&self) -> String {
        crate::config::table_name(&self.schema, &self.table)
    }
}

/// The `op` of a change event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Create,
    Update,
    Delete,
    Read,
    Truncate,
}

impl Op {
    pub fn code(self) -> &'static str {
        match self {
            Op::Create => "c",
            Op::Update => "u",
            Op::Delete => "d",
            Op::Read => "r",
            Op::Truncate => "t",
        }
    }
}

/// Where a change sits: its transaction's commit LSN and its ordinal in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub commit_lsn: u64,
    pub seq: u64,
}

/// The source block of one event.
#[derive(Debug, Clone)]
pub struct SourceInfo<'a> {
    pub connector_name: &'a str,
    pub db: &'a str,
    pub position: Position,
    /// LSN of the change record itself (0 for snapshot rows).
    pub lsn: u64,
    pub tx_id: Option<u32>,
    /// Commit time, milliseconds since the epoch.
    pub ts_ms: i64,
    /// `true`, `last` or `false`.
    pub snapshot: &'static str,
    /// Order of this event among the transaction's events for this table.
    pub table_order: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("column {column}: {source}")]
    Column {
        column: String,
        #[source]
        source: ConvertError,
    },
    #[error("{0} values for {1} columns")]
    Arity(usize, usize),
    #[error("avro: {0}")]
    Avro(String),
}

/// The Avro field name of each column: [`avro_name`], made unique by a
/// `_2`, `_3`, ... suffix where two columns sanitize alike (`a b`, `a-b`).
/// Fields whose name differs from their column carry the column's name in
/// `pgcdc.column`, which is what the materializer names mirror columns by.
pub fn field_names<'a>(columns: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut taken = std::collections::HashSet::new();
    columns
        .into_iter()
        .map(|c| {
            let base = avro_name(c);
            let mut name = base.clone();
            let mut n = 1;
            while !taken.insert(name.clone()) {
                n += 1;
                name = format!("{base}_{n}");
            }
            name
        })
        .collect()
}

/// Avro names allow [A-Za-z_][A-Za-z0-9_]*; anything else becomes `_`.
pub fn avro_name(part: &str) -> String {
    let mut s: String = part
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.as_bytes()[0].is_ascii_digit() {
        s.insert(0, '_');
    }
    s
}

/// The Debezium-compatible source block.
fn source_schema() -> Json {
    let opt = |t: &str| json!(["null", t]);
    json!({
        "type": "record", "name": "Source", "namespace": "io.pgcdc.connector.postgresql",
        "fields": [
            {"name": "version", "type": "string"},
            {"name": "connector", "type": "string"},
            {"name": "name", "type": "string"},
            {"name": "ts_ms", "type": "long"},
            {"name": "snapshot", "type": [{"type": "string", "connect.name": "io.debezium.data.Enum",
                "connect.parameters": {"allowed": "true,last,false,incremental"}}, "null"], "default": "false"},
            {"name": "db", "type": "string"},
            {"name": "sequence", "type": opt("string"), "default": null},
            {"name": "schema", "type": "string"},
            {"name": "table", "type": "string"},
            {"name": "txId", "type": opt("long"), "default": null},
            {"name": "lsn", "type": opt("long"), "default": null},
            {"name": "xmin", "type": opt("long"), "default": null},
            {"name": "commit_lsn", "type": "long"},
            {"name": "seq", "type": "long"}
        ]
    })
}

/// Schemas, registered ids and writers for one table shape.
pub struct TableCodec {
    pub desc: TableDesc,
    /// `desc`'s canonical `schema.table` name and its changelog topic,
    /// spelt once rather than per event.
    pub table: String,
    pub topic: String,
    pub meters: crate::observe::TableMeters,
    /// An outbox table, routed to domain-event topics (set by the
    /// connector).
    pub outbox: bool,
    pub key_schema: Json,
    pub value_schema: Json,
    kinds: Vec<Kind>,
    layouts: Vec<Layout>,
    key_layouts: Vec<Layout>,
    /// Built once: resolving a schema dominates encode time otherwise.
    key_writer: Writer,
    value_writer: Writer,
    key_id: Option<u32>,
    value_id: Option<u32>,
}

impl std::fmt::Debug for TableCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableCodec")
            .field("table", &self.desc.qualified())
            .field("key_id", &self.key_id)
            .field("value_id", &self.value_id)
            .finish_non_exhaustive()
    }
}

impl TableCodec {
    /// Builds the key and envelope schemas for `desc` under topic `topic`.
    pub fn new(topic: &str, desc: TableDesc) -> Result<TableCodec, EncodeError> {
        let namespace = topic
            .split('.')
            .map(avro_name)
            .collect::<Vec<_>>()
            .join(".");
        let kinds: Vec<Kind> = desc.columns.iter().map(ColumnDesc::kind).collect();
        let layouts: Vec<Layout> = kinds
            .iter()
            .map(|k| Layout {
                nullable: true,
                specials: k.has_specials(),
                unchanged: !matches!(
                    k,
                    Kind::Bool
                        | Kind::Int16
                        | Kind::Int32
                        | Kind::Int64
                        | Kind::Float32
                        | Kind::Float64
                        | Kind::Uuid
                        | Kind::Date
                        | Kind::Time
                        | Kind::Timestamp
                        | Kind::TimestampTz
                ),
            })
            .collect();
        let key_layouts: Vec<Layout> = kinds
            .iter()
            .map(|k| Layout {
                nullable: false,
                specials: k.has_specials(),
                unchanged: false,
            })
            .collect();

        let fields = field_names(desc.columns.iter().map(|c| c.name.as_str()));
        let field = |c: &ColumnDesc, name: &str, schema: Json| {
            let mut f = json!({"name": name, "type": schema});
            if name != c.name {
                f["pgcdc.column"] = json!(c.name);
            }
            f
        };
        let mut key_names = Names::default();
        let key_fields: Vec<Json> = desc
            .columns
            .iter()
            .zip(&fields)
            .zip(kinds.iter().zip(&key_layouts))
            .filter(|((c, _), _)| c.key)
            .map(|((c, name), (k, l))| field(c, name, column_schema(k, l, &mut key_names)))
            .collect();
        let key_schema = json!({
            "type": "record", "name": "Key", "namespace": namespace,
            "fields": key_fields, "connect.name": format!("{namespace}.Key")
        });

        let mut names = Names::default();
        let value_fields: Vec<Json> = desc
            .columns
            .iter()
            .zip(&fields)
            .zip(kinds.iter().zip(&layouts))
            .map(|((c, name), (k, l))| {
                let mut f = field(c, name, column_schema(k, l, &mut names));
                f["default"] = Json::Null;
                f
            })
            .collect();
        let value_record = json!({
            "type": "record", "name": "Value", "namespace": namespace,
            "fields": value_fields, "connect.name": format!("{namespace}.Value")
        });
        let value_schema = json!({
            "type": "record", "name": "Envelope", "namespace": namespace,
            "connect.name": format!("{namespace}.Envelope"),
            "fields": [
                {"name": "before", "type": ["null", value_record], "default": null},
                {"name": "after", "type": ["null", format!("{namespace}.Value")], "default": null},
                {"name": "source", "type": source_schema()},
                {"name": "op", "type": "string"},
                {"name": "ts_ms", "type": ["null", "long"], "default": null},
                {"name": "transaction", "type": ["null", {
                    "type": "record", "name": "block", "namespace": "event",
                    "fields": [
                        {"name": "id", "type": "string"},
                        {"name": "total_order", "type": "long"},
                        {"name": "data_collection_order", "type": "long"}
                    ],
                    "connect.name": "event.block"
                }], "default": null}
            ]
        });
        let table = desc.qualified();
        Ok(TableCodec {
            meters: crate::observe::TableMeters::new(&table),
            table,
            topic: topic.to_string(),
            outbox: false,
            key_writer: leak_writer(&key_schema)?,
            value_writer: leak_writer(&value_schema)?,
            key_schema,
            value_schema,
            kinds,
            layouts,
            key_layouts,
            desc,
            key_id: None,
            value_id: None,
        })
    }

    /// Whether the table has key columns (REPLICA IDENTITY NOTHING has none).
    pub fn has_key(&self) -> bool {
        self.desc.columns.iter().any(|c| c.key)
    }

    /// Sets the registry ids the encoded payloads carry.
    pub fn set_ids(&mut self, key_id: u32, value_id: u32) {
        self.key_id = Some(key_id);
        self.value_id = Some(value_id);
    }

    /// Each column's form in a binary COPY, when every column has one.
    pub fn binary_forms(&self) -> Option<Vec<binary::Form>> {
        self.desc
            .columns
            .iter()
            .zip(&self.kinds)
            .map(|(c, k)| binary::form(c.type_oid, k))
            .collect()
    }

    pub fn ids(&self) -> Option<(u32, u32)> {
        self.key_id.zip(self.value_id)
    }

    /// Writes the columns of a row (only the key columns with `key`) as
    /// the fields of its record, in the schema's order.
    fn write_row(
        &self,
        out: &mut Vec<u8>,
        values: &[Input<'_>],
        key: bool,
    ) -> Result<(), EncodeError> {
        if values.len() != self.desc.columns.len() {
            return Err(EncodeError::Arity(values.len(), self.desc.columns.len()));
        }
        let layouts = if key {
            &self.key_layouts
        } else {
            &self.layouts
        };
        let columns = self.desc.columns.iter().zip(&self.kinds).zip(layouts);
        for (((c, k), l), v) in columns.zip(values) {
            if key && !c.key {
                continue;
            }
            let column = |source| EncodeError::Column {
                column: c.name.clone(),
                source,
            };
            if types::write_direct(out, k, l, *v) {
                continue;
            }
            let val = convert(k, l, *v).map_err(column)?;
            datum::value(out, &val).map_err(EncodeError::Avro)?;
        }
        Ok(())
    }

    /// The framed key of a row (from its full image or its key image).
    pub fn encode_key(&self, values: &[Input<'_>]) -> Result<Vec<u8>, EncodeError> {
        let mut out = header(self.key_id, 16)?;
        self.write_row(&mut out, values, true)?;
        checked(out, &self.key_writer)
    }

    /// The framed envelope of one change, written field by field in the
    /// order of [`TableCodec::value_schema`].
    pub fn encode_value(
        &self,
        op: Op,
        before: Option<&[Input<'_>]>,
        after: Option<&[Input<'_>]>,
        src: &SourceInfo<'_>,
    ) -> Result<Vec<u8>, EncodeError> {
        let mut out = header(self.value_id, 256)?;
        for image in [before, after] {
            match image {
                None => datum::branch(&mut out, 0),
                Some(values) => {
                    datum::branch(&mut out, 1);
                    self.write_row(&mut out, values, false)?;
                }
            }
        }
        let opt_long = |out: &mut Vec<u8>, v: Option<i64>| match v {
            None => datum::branch(out, 0),
            Some(n) => {
                datum::branch(out, 1);
                datum::long(out, n);
            }
        };
        let pos = src.position;
        // source
        datum::string(&mut out, env!("CARGO_PKG_VERSION"));
        datum::string(&mut out, "pgcdc");
        datum::string(&mut out, src.connector_name);
        datum::long(&mut out, src.ts_ms);
        datum::branch(&mut out, 0);
        datum::string(&mut out, src.snapshot);
        datum::string(&mut out, src.db);
        datum::branch(&mut out, 1);
        let mut text = Text::default();
        datum::string(&mut out, text.sequence(pos.commit_lsn, src.lsn));
        datum::string(&mut out, &self.desc.schema);
        datum::string(&mut out, &self.desc.table);
        opt_long(&mut out, src.tx_id.map(i64::from));
        opt_long(&mut out, Some(src.lsn as i64));
        opt_long(&mut out, None);
        datum::long(&mut out, pos.commit_lsn as i64);
        datum::long(&mut out, pos.seq as i64);
        // op, ts_ms, transaction
        datum::string(&mut out, op.code());
        opt_long(&mut out, Some(src.ts_ms));
        match src.tx_id {
            None => datum::branch(&mut out, 0),
            Some(xid) => {
                datum::branch(&mut out, 1);
                datum::string(&mut out, text.transaction_id(xid, pos.commit_lsn));
                datum::long(&mut out, pos.seq as i64);
                datum::long(&mut out, src.table_order as i64);
            }
        }
        checked(out, &self.value_writer)
    }
}

/// A stack buffer for the short strings of an envelope (positions, ids),
/// written with `itoa`: no allocation and no formatting machinery per
/// event. The longest, two u64 and seven characters, fits.
struct Text {
    buf: [u8; 64],
    len: usize,
}

impl Default for Text {
    fn default() -> Text {
        Text {
            buf: [0; 64],
            len: 0,
        }
    }
}

impl Text {
    fn push(&mut self, s: &str) {
        self.buf[self.len..self.len + s.len()].copy_from_slice(s.as_bytes());
        self.len += s.len();
    }

    fn push_int(&mut self, n: impl itoa::Integer) {
        self.push(itoa::Buffer::new().format(n));
    }

    fn as_str(&self) -> &str {
        // Only ASCII was pushed.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }

    /// Debezium's `source.sequence`: `["<commit LSN>","<LSN>"]`.
    fn sequence(&mut self, commit_lsn: u64, lsn: u64) -> &str {
        self.len = 0;
        self.push("[\"");
        self.push_int(commit_lsn);
        self.push("\",\"");
        self.push_int(lsn);
        self.push("\"]");
        self.as_str()
    }

    /// Debezium's transaction id: `<xid>:<commit LSN>`.
    fn transaction_id(&mut self, xid: u32, commit_lsn: u64) -> &str {
        self.len = 0;
        self.push_int(xid);
        self.push(":");
        self.push_int(commit_lsn);
        self.as_str()
    }
}

/// Confluent wire format: magic 0, then the schema id (big-endian); the
/// Avro datum follows.
fn header(id: Option<u32>, capacity: usize) -> Result<Vec<u8>, EncodeError> {
    let id = id.ok_or_else(|| EncodeError::Avro("schema not registered yet".into()))?;
    let mut out = Vec::with_capacity(capacity);
    out.push(0);
    out.extend_from_slice(&id.to_be_bytes());
    Ok(out)
}

/// Debug builds (every test) check directly written datums against
/// apache-avro: one must decode under the schema to its end and encode
/// back, validated, to the same bytes. The first 256 of each schema are
/// checked, then one in 64: unoptimized, apache-avro's round trip would
/// cost the tests more than everything else per event.
fn checked(framed: Vec<u8>, writer: &Writer) -> Result<Vec<u8>, EncodeError> {
    #[cfg(debug_assertions)]
    let n = writer
        .written
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    #[cfg(debug_assertions)]
    if n < 256 || n.is_multiple_of(64) {
        let mut datum = &framed[5..];
        let decoded = writer
            .reader
            .read_value(&mut datum)
            .unwrap_or_else(|e| panic!("a directly written datum does not decode: {e}"));
        assert!(
            datum.is_empty(),
            "a directly written datum has trailing bytes"
        );
        let mut again = framed[..5].to_vec();
        writer
            .writer
            .write_value_ref(&mut again, &decoded)
            .unwrap_or_else(|e| panic!("a directly written datum does not validate: {e}"));
        assert_eq!(framed, again, "apache-avro encodes the datum otherwise");
    }
    #[cfg(not(debug_assertions))]
    let _ = writer;
    Ok(framed)
}

/// Confluent wire format: magic 0, schema id (big-endian), Avro datum,
/// through apache-avro's validating writer (transaction records).
fn frame(id: Option<u32>, writer: &Writer, value: &Value) -> Result<Vec<u8>, EncodeError> {
    let mut out = header(id, 64)?;
    writer
        .writer
        .write_value_ref(&mut out, value)
        .map_err(|e| EncodeError::Avro(e.to_string()))?;
    Ok(out)
}

/// BEGIN and END records of the transaction topic, as Debezium writes them.
pub struct TransactionCodec {
    pub key_schema: Json,
    pub value_schema: Json,
    key_writer: Writer,
    value_writer: Writer,
    ids: Option<(u32, u32)>,
}

impl std::fmt::Debug for TransactionCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionCodec")
            .field("ids", &self.ids)
            .finish_non_exhaustive()
    }
}

impl TransactionCodec {
    pub fn new() -> Result<TransactionCodec, EncodeError> {
        let key_schema = json!({
            "type": "record", "name": "TransactionMetadataKey", "namespace": "io.debezium.connector.common",
            "fields": [{"name": "id", "type": "string"}]
        });
        let value_schema = json!({
            "type": "record", "name": "TransactionMetadataValue", "namespace": "io.debezium.connector.common",
            "fields": [
                {"name": "status", "type": "string"},
                {"name": "id", "type": "string"},
                {"name": "event_count", "type": ["null", "long"], "default": null},
                {"name": "data_collections", "type": ["null", {"type": "array", "items": {
                    "type": "record", "name": "event_count", "namespace": "io.debezium.connector.common",
                    "fields": [
                        {"name": "data_collection", "type": "string"},
                        {"name": "event_count", "type": "long"}
                    ]}}], "default": null},
                {"name": "ts_ms", "type": "long"}
            ]
        });
        Ok(TransactionCodec {
            key_writer: leak_writer(&key_schema)?,
            value_writer: leak_writer(&value_schema)?,
            key_schema,
            value_schema,
            ids: None,
        })
    }

    pub fn set_ids(&mut self, key_id: u32, value_id: u32) {
        self.ids = Some((key_id, value_id));
    }

    /// Key and value of a BEGIN record.
    pub fn begin(&self, id: &str, ts_ms: i64) -> Result<(Vec<u8>, Vec<u8>), EncodeError> {
        self.record(id, "BEGIN", None, ts_ms)
    }

    /// Key and value of an END record with event counts per table.
    pub fn end(
        &self,
        id: &str,
        counts: &[(String, u64)],
        ts_ms: i64,
    ) -> Result<(Vec<u8>, Vec<u8>), EncodeError> {
        self.record(id, "END", Some(counts), ts_ms)
    }

    fn record(
        &self,
        id: &str,
        status: &str,
        counts: Option<&[(String, u64)]>,
        ts_ms: i64,
    ) -> Result<(Vec<u8>, Vec<u8>), EncodeError> {
        let (key_id, value_id) = self.ids.unzip();
        let key = Value::Record(vec![("id".into(), Value::String(id.into()))]);
        let (total, collections) = match counts {
            None => (
                Value::Union(0, Box::new(Value::Null)),
                Value::Union(0, Box::new(Value::Null)),
            ),
            Some(c) => (
                Value::Union(
                    1,
                    Box::new(Value::Long(c.iter().map(|(_, n)| *n as i64).sum())),
                ),
                Value::Union(
                    1,
                    Box::new(Value::Array(
                        c.iter()
                            .map(|(t, n)| {
                                Value::Record(vec![
                                    ("data_collection".into(), Value::String(t.clone())),
                                    ("event_count".into(), Value::Long(*n as i64)),
                                ])
                            })
                            .collect(),
                    )),
                ),
            ),
        };
        let value = Value::Record(vec![
            ("status".into(), Value::String(status.into())),
            ("id".into(), Value::String(id.into())),
            ("event_count".into(), total),
            ("data_collections".into(), collections),
            ("ts_ms".into(), Value::Long(ts_ms)),
        ]);
        Ok((
            frame(key_id, &self.key_writer, &key)?,
            frame(value_id, &self.value_writer, &value)?,
        ))
    }
}

/// A writer for a schema that lives as long as the process (a writer
/// borrows its schema; codecs are few and bounded by schema changes).
fn leak_writer(j: &Json) -> Result<Writer, EncodeError> {
    let schema: &'static Schema = Box::leak(Box::new(
        Schema::parse(j).map_err(|e| EncodeError::Avro(e.to_string()))?,
    ));
    let writer = GenericDatumWriter::builder(schema)
        .build()
        .map_err(|e| EncodeError::Avro(e.to_string()))?;
    #[cfg(debug_assertions)]
    let reader = apache_avro::reader::datum::GenericDatumReader::builder(schema)
        .build()
        .map_err(|e| EncodeError::Avro(e.to_string()))?;
    Ok(Writer {
        writer,
        #[cfg(debug_assertions)]
        reader,
        #[cfg(debug_assertions)]
        written: Default::default(),
    })
}

/// apache-avro's validating writer for a schema (and, in debug builds,
/// its reader, for [`checked`]).
struct Writer {
    writer: GenericDatumWriter<'static>,
    #[cfg(debug_assertions)]
    reader: apache_avro::reader::datum::GenericDatumReader<'static>,
    /// Datums written so far (debug builds).
    #[cfg(debug_assertions)]
    written: std::sync::atomic::AtomicU64,
}

/// Splits a Confluent-framed payload into its schema id and Avro datum.
pub fn unframe(bytes: &[u8]) -> Option<(u32, &[u8])> {
    match bytes {
        [0, a, b, c, d, datum @ ..] => Some((u32::from_be_bytes([*a, *b, *c, *d]), datum)),
        _ => None,
    }
}

/// Decodes an Avro datum written with `schema`.
pub fn decode_datum(schema: &Schema, datum: &[u8]) -> Result<Value, EncodeError> {
    read_datum(&datum_reader(schema)?, datum)
}

/// A reader of datums written with `schema`. Building one resolves the
/// schema's named types, which costs more than decoding a small record:
/// keep one for many datums.
pub fn datum_reader(schema: &Schema) -> Result<DatumReader<'_>, EncodeError> {
    DatumReader::builder(schema)
        .build()
        .map_err(|e| EncodeError::Avro(e.to_string()))
}

pub type DatumReader<'s> = apache_avro::reader::datum::GenericDatumReader<'s>;

/// [`decode_datum`] through a reader made by [`datum_reader`].
pub fn read_datum(reader: &DatumReader<'_>, mut datum: &[u8]) -> Result<Value, EncodeError> {
    reader
        .read_value(&mut datum)
        .map_err(|e| EncodeError::Avro(e.to_string()))
}

/// Lowercase hex digits by value.
pub(crate) const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Bytes as two lowercase hex digits each.
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 * bytes.len());
    push_hex(&mut s, bytes);
    s
}

/// Bytes as Postgres writes a `bytea` (`bytea_output = hex`): `\x`, then
/// two lowercase hex digits a byte.
pub fn bytea_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * bytes.len());
    s.push_str("\\x");
    push_hex(&mut s, bytes);
    s
}

fn push_hex(s: &mut String, bytes: &[u8]) {
    for b in bytes {
        s.push(char::from(HEX_DIGITS[usize::from(b >> 4)]));
        s.push(char::from(HEX_DIGITS[usize::from(b & 0xF)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_render_as_lowercase_hex_and_as_postgres_writes_a_bytea() {
        assert_eq!(hex(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
        assert_eq!(bytea_hex(&[0x00, 0x0f, 0xab, 0xff]), "\\x000fabff");
        assert_eq!(bytea_hex(&[]), "\\x");
    }

    fn orders() -> TableDesc {
        let col = |name: &str, oid: u32, typmod: i32, key: bool| ColumnDesc {
            name: name.into(),
            type_oid: oid,
            type_modifier: typmod,
            type_name: String::new(),
            enum_labels: None,
            array: false,
            key,
        };
        TableDesc {
            schema: "public".into(),
            table: "orders".into(),
            columns: vec![
                col("id", 20, -1, true),
                col("amount", 1700, (12 << 16 | 2) + 4, false),
                col("note", 25, -1, false),
                col("created_at", 1184, -1, false),
            ],
        }
    }

    fn src() -> SourceInfo<'static> {
        SourceInfo {
            connector_name: "demo",
            db: "shop",
            position: Position {
                commit_lsn: 100,
                seq: 1,
            },
            lsn: 90,
            tx_id: Some(7),
            ts_ms: 1_700_000_000_000,
            snapshot: "false",
            table_order: 1,
        }
    }

    #[test]
    fn envelope_round_trips_through_an_avro_reader() -> Result<(), EncodeError> {
        let mut codec = TableCodec::new("demo.public.orders", orders())?;
        codec.set_ids(1, 2);
        let row = [
            Input::Text(b"42"),
            Input::Text(b"120.50"),
            Input::Unchanged,
            Input::Text(b"2024-01-31 12:00:00+00"),
        ];
        let bytes = codec.encode_value(Op::Update, None, Some(&row), &src())?;
        let (id, datum) = unframe(&bytes).unwrap_or_default();
        assert_eq!(id, 2);
        let schema =
            Schema::parse(&codec.value_schema).map_err(|e| EncodeError::Avro(e.to_string()))?;
        let decoded = decode_datum(&schema, datum)?;
        let Value::Record(fields) = decoded else {
            panic!("not a record");
        };
        assert_eq!(fields[3], ("op".into(), Value::String("u".into())));
        let field = |fields: &[(String, Value)], name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let Some(Value::Record(source)) = field(&fields, "source") else {
            panic!("source missing: {:?}", fields[2]);
        };
        assert_eq!(
            field(&source, "sequence"),
            Some(Value::Union(
                1,
                Box::new(Value::String("[\"100\",\"90\"]".into()))
            ))
        );
        let Some(Value::Union(1, transaction)) = field(&fields, "transaction") else {
            panic!("transaction missing: {:?}", fields[5]);
        };
        let Value::Record(transaction) = *transaction else {
            panic!("transaction not a record");
        };
        assert_eq!(
            field(&transaction, "id"),
            Some(Value::String("7:100".into()))
        );
        let Value::Union(1, after) = &fields[1].1 else {
            panic!("after missing: {:?}", fields[1]);
        };
        let Value::Record(cols) = after.as_ref() else {
            panic!("after not a record");
        };
        assert_eq!(cols[0].1, Value::Union(1, Box::new(Value::Long(42))));
        assert_eq!(
            cols[2].1,
            Value::Union(2, Box::new(Value::Enum(0, "UNCHANGED_TOAST".into())))
        );
        let key = codec.encode_key(&row)?;
        assert_eq!(&key[..5], &[0, 0, 0, 0, 1]);
        Ok(())
    }

    #[test]
    fn envelope_strings_fit_the_largest_positions() {
        let mut text = Text::default();
        assert_eq!(
            text.sequence(u64::MAX, 0),
            "[\"18446744073709551615\",\"0\"]"
        );
        assert_eq!(
            text.transaction_id(u32::MAX, u64::MAX),
            "4294967295:18446744073709551615"
        );
        assert_eq!(
            text.sequence(u64::MAX, u64::MAX).len(),
            2 * 20 + 7,
            "the longest sequence"
        );
    }

    #[test]
    fn a_bad_value_names_its_column() -> Result<(), EncodeError> {
        let mut codec = TableCodec::new("demo.public.orders", orders())?;
        codec.set_ids(1, 2);
        let after = [
            Input::Text(b"42"),
            Input::Text(b"12.345"),
            Input::Null,
            Input::Null,
        ];
        let err = codec
            .encode_value(Op::Create, None, Some(&after), &src())
            .err();
        assert!(
            matches!(err, Some(EncodeError::Column { ref column, .. }) if column == "amount"),
            "{err:?}"
        );
        Ok(())
    }

    #[test]
    fn names_are_sanitized_for_avro() {
        assert_eq!(avro_name("order-lines"), "order_lines");
        assert_eq!(avro_name("1st"), "_1st");
        assert_eq!(
            field_names(["a b", "a-b", "a_b", "日本", "Id", "id"]),
            ["a_b", "a_b_2", "a_b_3", "__", "Id", "id"]
        );
    }
}

/// Fuzzing: decoding changelog messages never panics, whatever the bytes.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn value_schema() -> Schema {
        let desc = TableDesc {
            schema: "public".into(),
            table: "t".into(),
            columns: [
                ("id", 20, true),
                ("amount", 1700, false),
                ("note", 25, false),
                ("at", 1184, false),
                ("tags", 1009, false),
            ]
            .into_iter()
            .map(|(name, oid, key)| ColumnDesc {
                name: name.into(),
                type_oid: oid,
                type_modifier: if oid == 1700 { (12 << 16 | 2) + 4 } else { -1 },
                type_name: String::new(),
                enum_labels: None,
                array: oid == 1009,
                key,
            })
            .collect(),
        };
        let codec = TableCodec::new("demo.public.t", desc).expect("codec");
        Schema::parse(&codec.value_schema).expect("schema")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5_000))]

        #[test]
        fn arbitrary_framed_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let schema = value_schema();
            if let Some((_, datum)) = unframe(&bytes) {
                let _ = decode_datum(&schema, datum);
            }
            let _ = decode_datum(&schema, &bytes);
        }
    }
}
