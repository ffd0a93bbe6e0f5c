//! What the catalog says about a captured table: its columns in the order
//! pgoutput sends them, and its key.
//!
//! Guarantee: the snapshot and the stream describe a table the same way.
//! The key is the primary key; without one, the replica identity index;
//! without that, every column under REPLICA IDENTITY FULL; otherwise none
//! (the events then have a null key).

use tokio_postgres::Client;

use crate::encode::{ColumnDesc, TableDesc};

/// Columns of `schema.table` (generated and dropped columns excluded, as
/// pgoutput excludes them), with the key marked. Returns the table's oid.
pub async fn describe(
    client: &Client,
    schema: &str,
    table: &str,
) -> Result<Option<(u32, TableDesc)>, tokio_postgres::Error> {
    let Some(row) = client
        .query_opt(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &table],
        )
        .await?
    else {
        return Ok(None);
    };
    let oid: u32 = row.get(0);
    let keys = key_columns(client, oid).await?;
    let attributes = client
        .query(
            "SELECT a.attname::text, a.atttypid, a.atttypmod
             FROM pg_attribute a
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
             ORDER BY a.attnum",
            &[&oid],
        )
        .await?;
    let names: Vec<String> = attributes.iter().map(|r| r.get(0)).collect();
    let types: Vec<(u32, i32)> = attributes.iter().map(|r| (r.get(1), r.get(2))).collect();
    let columns = columns(client, &names, &types, &keys).await?;
    Ok(Some((
        oid,
        TableDesc {
            schema: schema.to_string(),
            table: table.to_string(),
            columns,
        },
    )))
}

/// A table as the catalog has it now: its columns as [`describe`] lists
/// them (name, type and typmod, domains resolved to their base type as
/// [`columns`] resolves them) and the file its rows are in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentTable {
    pub columns: Vec<(String, u32, i32)>,
    /// `pg_class.relfilenode`: a new one after a rewrite (VACUUM FULL,
    /// CLUSTER, TRUNCATE, a rewriting ALTER TABLE), which moves rows to
    /// other blocks. `None` when the table has no columns or is gone.
    pub filenode: Option<u32>,
}

/// The table now ([`CurrentTable`]), in one statement where [`describe`]
/// takes four: a snapshot chunk checks its table with it under its lock
/// (a binary COPY is read by the planned types, and a block range names
/// the planned file's rows).
pub async fn current_table(
    client: &Client,
    schema: &str,
    table: &str,
) -> Result<CurrentTable, tokio_postgres::Error> {
    let rows = client
        .query(
            "WITH RECURSIVE a AS (
                 SELECT a.attnum, a.attname::text AS name, a.atttypid AS oid,
                     a.atttypmod AS typmod, c.relfilenode
                 FROM pg_attribute a
                 JOIN pg_class c ON c.oid = a.attrelid
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND c.relname = $2
                   AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''),
             b AS (
                 SELECT attnum, name, oid, typmod, relfilenode, 0 AS depth FROM a
                 UNION ALL
                 SELECT b.attnum, b.name, t.typbasetype, t.typtypmod, b.relfilenode, b.depth + 1
                 FROM b JOIN pg_type t ON t.oid = b.oid WHERE t.typtype = 'd')
             SELECT DISTINCT ON (attnum) name, oid, typmod, relfilenode
             FROM b ORDER BY attnum, depth DESC",
            &[&schema, &table],
        )
        .await?;
    Ok(CurrentTable {
        columns: rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect(),
        filenode: rows.first().map(|r| r.get(3)),
    })
}

/// The server's `server_version_num` (150004 for 15.4).
pub async fn server_version(client: &Client) -> Result<i32, tokio_postgres::Error> {
    Ok(client
        .query_one("SELECT current_setting('server_version_num')::int4", &[])
        .await?
        .get(0))
}

/// A leaf partition of a partitioned table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    pub oid: u32,
    pub schema: String,
    pub name: String,
    /// A heap table (a foreign table can be a partition too, which has no
    /// blocks to cut into ranges).
    pub heap: bool,
}

/// The oids of the tables (`schema.table` as configured), in their order.
/// A table that does not exist now is the inner error, naming it (a
/// config matter: renamed or dropped after the publication check, it
/// would otherwise read as one pgcdc does not capture); the outer error
/// is the query's (an outage to retry).
pub async fn table_oids(
    client: &Client,
    tables: &[String],
) -> Result<Result<Vec<u32>, String>, tokio_postgres::Error> {
    let names = super::slot::sql_tables(tables);
    let rows = client
        .query(
            "SELECT to_regclass(t)::oid FROM unnest($1::text[]) WITH ORDINALITY u(t, i) ORDER BY i",
            &[&names],
        )
        .await?;
    let oids: Vec<Option<u32>> = rows.iter().map(|r| r.get(0)).collect();
    let missing: Vec<&str> = names
        .iter()
        .zip(&oids)
        .filter(|(_, o)| o.is_none())
        .map(|(n, _)| n.as_str())
        .collect();
    if !missing.is_empty() {
        return Ok(Err(format!(
            "source.tables: {} does not exist (renamed or dropped while pgcdc started); add its name now to source.tables or restore it",
            missing.join(", ")
        )));
    }
    Ok(Ok(oids.into_iter().flatten().collect()))
}

/// The relations publishing `tables` would cover that have no usable
/// replica identity (no primary key under `REPLICA IDENTITY DEFAULT`, a
/// dropped identity index, or `NOTHING`), as SQL spells them: the tables
/// themselves, and the partitions of a partitioned table and the children
/// of an inherited one, whose own settings are the ones Postgres checks
/// (a partitioned table's does not reach them). Once such a relation is
/// published, Postgres refuses UPDATE and DELETE on it.
/// Each name comes with whether it is one of `tables` itself (rather than
/// a partition or child of one).
pub async fn without_replica_identity(
    client: &Client,
    tables: &[String],
) -> Result<Vec<(String, bool)>, tokio_postgres::Error> {
    let names = super::slot::sql_tables(tables);
    Ok(client
        .query(
            "WITH RECURSIVE tree AS (
                 SELECT to_regclass(n)::oid AS oid, true AS listed FROM unnest($1::text[]) n
                 WHERE to_regclass(n) IS NOT NULL
                 UNION
                 SELECT i.inhrelid, false FROM tree JOIN pg_inherits i ON i.inhparent = tree.oid)
             SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), tree.listed
             FROM tree JOIN pg_class c ON c.oid = tree.oid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relkind = 'r' AND NOT (
                 c.relreplident = 'f'
                 OR (c.relreplident = 'd' AND EXISTS (SELECT 1 FROM pg_index i
                     WHERE i.indrelid = c.oid AND i.indisprimary))
                 OR (c.relreplident = 'i' AND EXISTS (SELECT 1 FROM pg_index i
                     WHERE i.indrelid = c.oid AND i.indisreplident)))
             ORDER BY 1",
            &[&names],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Pairs of `tables` (as configured) where the first is a partition, at
/// any depth, of the second. Publishing through the root, Postgres sends
/// the partition's changes under the ancestor's name only, so the
/// partition's own topic would get its snapshot and nothing after.
pub async fn listed_partitions(
    client: &Client,
    tables: &[String],
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    let names = super::slot::sql_tables(tables);
    Ok(client
        .query(
            "WITH RECURSIVE t AS (
                 SELECT x.n, to_regclass(x.name)::oid AS oid
                 FROM unnest($1::text[]) WITH ORDINALITY AS x(name, n)
                 WHERE to_regclass(x.name) IS NOT NULL),
             up AS (
                 SELECT t.n, i.inhparent AS anc FROM t
                 JOIN pg_inherits i ON i.inhrelid = t.oid
                 JOIN pg_class c ON c.oid = t.oid AND c.relispartition
                 UNION
                 SELECT up.n, i.inhparent FROM up
                 JOIN pg_inherits i ON i.inhrelid = up.anc
                 JOIN pg_class c ON c.oid = up.anc AND c.relispartition)
             SELECT up.n, t.n FROM up JOIN t ON t.oid = up.anc ORDER BY 1, 2",
            &[&names],
        )
        .await?
        .iter()
        .map(|r| (by_ordinal(tables, r.get(0)), by_ordinal(tables, r.get(1))))
        .collect())
}

/// The configured name at a 1-based `WITH ORDINALITY` index over
/// [`super::slot::sql_tables`] of `tables`: queries answer in ordinals so
/// that messages use the name as the user wrote it.
pub fn by_ordinal(tables: &[String], n: i64) -> String {
    usize::try_from(n - 1)
        .ok()
        .and_then(|i| tables.get(i))
        .cloned()
        .unwrap_or_default()
}

/// The message for a [`listed_partitions`] pair.
pub fn listed_partition_problem(partition: &str, ancestor: &str) -> String {
    format!(
        "source.tables lists {partition}, a partition of {ancestor}, which it lists too: Postgres publishes the partition's changes under {ancestor}'s name, so {partition}'s topic would get its snapshot and nothing after; list one of them"
    )
}

/// The leaf partitions of a partitioned table, at any depth, in oid
/// order; `None` when the table is not partitioned.
pub async fn leaf_partitions(
    client: &Client,
    oid: u32,
) -> Result<Option<Vec<Leaf>>, tokio_postgres::Error> {
    let partitioned: bool = client
        .query_one("SELECT relkind = 'p' FROM pg_class WHERE oid = $1", &[&oid])
        .await?
        .get(0);
    if !partitioned {
        return Ok(None);
    }
    let rows = client
        .query(
            "SELECT c.oid, n.nspname::text, c.relname::text, c.relkind = 'r'
             FROM pg_partition_tree($1::oid::regclass) t
             JOIN pg_class c ON c.oid = t.relid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE t.isleaf
             ORDER BY c.oid",
            &[&oid],
        )
        .await?;
    Ok(Some(
        rows.iter()
            .map(|r| Leaf {
                oid: r.get(0),
                schema: r.get(1),
                name: r.get(2),
                heap: r.get(3),
            })
            .collect(),
    ))
}

/// Column descriptions from names and (type oid, typmod) pairs: domains
/// resolved to their base type (and its typmod), enum labels looked up
/// (for arrays of enums, the element's), all in one query.
pub async fn columns(
    client: &Client,
    names: &[String],
    types: &[(u32, i32)],
    keys: &[String],
) -> Result<Vec<ColumnDesc>, tokio_postgres::Error> {
    let oids: Vec<u32> = types.iter().map(|t| t.0).collect();
    let typmods: Vec<i32> = types.iter().map(|t| t.1).collect();
    let rows = client
        .query(
            "WITH RECURSIVE c AS (
                 SELECT * FROM unnest($1::oid[], $2::int4[]) WITH ORDINALITY AS c(oid, typmod, n)),
             b AS (
                 SELECT n, oid, typmod, 0 AS depth FROM c
                 UNION ALL
                 SELECT b.n, t.typbasetype, t.typtypmod, b.depth + 1
                 FROM b JOIN pg_type t ON t.oid = b.oid WHERE t.typtype = 'd')
             SELECT DISTINCT ON (b.n) b.oid, b.typmod, format_type(c.oid, NULL),
                 (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder)
                  FROM pg_enum e
                  WHERE e.enumtypid = CASE WHEN t.typcategory = 'A' THEN t.typelem ELSE b.oid END),
                 coalesce(t.typcategory = 'A', false)
             FROM b JOIN c ON c.n = b.n LEFT JOIN pg_type t ON t.oid = b.oid
             ORDER BY b.n, b.depth DESC",
            &[&oids, &typmods],
        )
        .await?;
    // One row per column (the LEFT JOIN keeps a column whose type is gone
    // from the current catalog), so the zip below stays aligned.
    debug_assert_eq!(rows.len(), names.len());
    Ok(names
        .iter()
        .zip(rows)
        .map(|(name, r)| ColumnDesc {
            key: keys.contains(name),
            name: name.clone(),
            type_oid: r.get(0),
            type_modifier: r.get(1),
            type_name: r.get(2),
            enum_labels: r.get(3),
            array: r.get(4),
        })
        .collect())
}

/// Names of the columns of the primary key, or else of the replica
/// identity index; empty when the table has neither.
pub async fn unique_key_columns(
    client: &Client,
    oid: u32,
) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .query(
            "WITH idx AS (
                 SELECT i.indkey FROM pg_index i
                 WHERE i.indrelid = $1 AND (i.indisprimary OR i.indisreplident)
                 ORDER BY i.indisprimary DESC LIMIT 1)
             SELECT a.attname::text FROM pg_attribute a, idx
             WHERE a.attrelid = $1 AND a.attnum = ANY(idx.indkey::int2[])
             ORDER BY array_position(idx.indkey::int2[], a.attnum)",
            &[&oid],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Names of the key columns of a relation (see the module guarantee).
pub async fn key_columns(client: &Client, oid: u32) -> Result<Vec<String>, tokio_postgres::Error> {
    let unique = unique_key_columns(client, oid).await?;
    if !unique.is_empty() {
        return Ok(unique);
    }
    let full = client
        .query_opt(
            "SELECT relreplident = 'f' FROM pg_class WHERE oid = $1",
            &[&oid],
        )
        .await?
        .is_some_and(|r| r.get::<_, bool>(0));
    if !full {
        return Ok(Vec::new());
    }
    Ok(client
        .query(
            "SELECT attname::text FROM pg_attribute
             WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
             ORDER BY attnum",
            &[&oid],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// One line of `COPY ... TO STDOUT` text format split into its fields and
/// unescaped into buffers kept from line to line: no allocation per field
/// (a snapshot parses millions of lines).
#[derive(Debug, Default)]
pub struct CopyLine {
    bytes: Vec<u8>,
    /// Byte ranges into `bytes`; `None` for `\N`.
    fields: Vec<Option<std::ops::Range<usize>>>,
}

impl CopyLine {
    /// Parses `line` (without its newline), replacing the previous one.
    pub fn parse(&mut self, line: &[u8]) {
        self.bytes.clear();
        self.fields.clear();
        for raw in line.split(|&b| b == b'\t') {
            if raw == b"\\N" {
                self.fields.push(None);
                continue;
            }
            let start = self.bytes.len();
            if raw.contains(&b'\\') {
                unescape(raw, &mut self.bytes);
            } else {
                self.bytes.extend_from_slice(raw);
            }
            self.fields.push(Some(start..self.bytes.len()));
        }
    }

    /// The fields of the last line parsed: `None` for NULL.
    pub fn fields(&self) -> impl Iterator<Item = Option<&[u8]>> + '_ {
        self.fields
            .iter()
            .map(|f| f.as_ref().map(|r| &self.bytes[r.clone()]))
    }
}

/// Rows of a `COPY ... TO STDOUT (FORMAT binary)` stream, split into
/// their fields where they lie: a signature and header, then per row a
/// field count and each field's length (-1 for NULL) and bytes, then a
/// count of -1. Anything else (a row of the wrong width, a bad length or
/// header) is an error at its byte, never a row read short.
#[derive(Debug)]
pub struct CopyBinary {
    columns: usize,
    header_read: bool,
    /// Byte ranges of the last row's fields; `None` for NULL.
    fields: Vec<Option<std::ops::Range<usize>>>,
}

/// What [`CopyBinary::next`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStep {
    /// A row, ending where given.
    Row(usize),
    /// The trailer, ending where given: no rows follow.
    End(usize),
}

/// A binary COPY stream that is not one: what is wrong, and where (a byte
/// of the `data` given to [`CopyBinary::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyError {
    pub at: usize,
    pub message: String,
}

const COPY_SIGNATURE: &[u8] = b"PGCOPY\n\xff\r\n\0";

impl CopyBinary {
    /// A reader of rows of `columns` fields.
    pub fn new(columns: usize) -> CopyBinary {
        CopyBinary {
            columns,
            header_read: false,
            fields: Vec::with_capacity(columns),
        }
    }

    /// Reads what starts at `at` in `data` (and the header before the
    /// first row); `None` when `data` ends before it does, so that the
    /// caller carries the rest over to the next message.
    pub fn next(&mut self, data: &[u8], at: usize) -> Result<Option<CopyStep>, CopyError> {
        let word = |i: usize, n: usize| data.get(i..i + n);
        let fail = |at: usize, message: String| Err(CopyError { at, message });
        let mut pos = at;
        if !self.header_read {
            let Some(fixed) = word(pos, COPY_SIGNATURE.len() + 8) else {
                return Ok(None);
            };
            if !fixed.starts_with(COPY_SIGNATURE) {
                return fail(pos, "binary COPY: no signature".into());
            }
            // Bits 16 to 31 are critical: a reader that does not know one
            // must refuse the stream (bit 16 would put an OID in each row).
            let flags = u32::from_be_bytes([fixed[11], fixed[12], fixed[13], fixed[14]]);
            if flags & 0xFFFF_0000 != 0 {
                return fail(pos + 11, format!("binary COPY: header flags {flags:#010x}"));
            }
            let ext = i32::from_be_bytes([fixed[15], fixed[16], fixed[17], fixed[18]]);
            let Ok(ext) = usize::try_from(ext) else {
                return fail(
                    pos + 15,
                    format!("binary COPY: header extension of {ext} bytes"),
                );
            };
            pos += 19 + ext;
        }
        let Some(count) = word(pos, 2) else {
            return Ok(None);
        };
        let count = i16::from_be_bytes([count[0], count[1]]);
        self.fields.clear();
        if count == -1 {
            self.header_read = true;
            return Ok(Some(CopyStep::End(pos + 2)));
        }
        if usize::try_from(count) != Ok(self.columns) {
            return fail(
                pos,
                format!(
                    "binary COPY: a row of {count} fields where the table has {} columns",
                    self.columns
                ),
            );
        }
        pos += 2;
        for _ in 0..count {
            let Some(len) = word(pos, 4) else {
                return Ok(None);
            };
            let len = i32::from_be_bytes([len[0], len[1], len[2], len[3]]);
            let Ok(n) = usize::try_from(len) else {
                if len != -1 {
                    return fail(pos, format!("binary COPY: a field of length {len}"));
                }
                self.fields.push(None);
                pos += 4;
                continue;
            };
            pos += 4;
            let end = pos + n;
            if end > data.len() {
                return Ok(None);
            }
            self.fields.push(Some(pos..end));
            pos = end;
        }
        self.header_read = true;
        Ok(Some(CopyStep::Row(pos)))
    }

    /// The fields of the last row read, in the `data` it was read from.
    pub fn fields<'d>(&'d self, data: &'d [u8]) -> impl Iterator<Item = Option<&'d [u8]>> + 'd {
        self.fields
            .iter()
            .map(move |f| f.as_ref().map(|r| &data[r.clone()]))
    }
}

/// Splits one line of `COPY ... TO STDOUT` text format into its fields:
/// `None` for `\N`, otherwise the unescaped bytes.
pub fn copy_fields(line: &[u8]) -> Vec<Option<Vec<u8>>> {
    let mut parsed = CopyLine::default();
    parsed.parse(line);
    parsed.fields().map(|f| f.map(<[u8]>::to_vec)).collect()
}

/// Appends the unescaped bytes of one COPY text field to `field`.
fn unescape(raw: &[u8], field: &mut Vec<u8>) {
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        if b != b'\\' || i + 1 == raw.len() {
            field.push(b);
            i += 1;
            continue;
        }
        let next = raw[i + 1];
        i += 2;
        match next {
            b'b' => field.push(0x08),
            b'f' => field.push(0x0C),
            b'n' => field.push(b'\n'),
            b'r' => field.push(b'\r'),
            b't' => field.push(b'\t'),
            b'v' => field.push(0x0B),
            b'0'..=b'7' => {
                let mut v = u32::from(next - b'0');
                let mut n = 1;
                while n < 3 && i < raw.len() && (b'0'..=b'7').contains(&raw[i]) {
                    v = v * 8 + u32::from(raw[i] - b'0');
                    i += 1;
                    n += 1;
                }
                field.push((v & 0xFF) as u8);
            }
            b'x' if i < raw.len() && raw[i].is_ascii_hexdigit() => {
                let mut v = 0u32;
                let mut n = 0;
                while n < 2 && i < raw.len() && raw[i].is_ascii_hexdigit() {
                    v = v * 16 + (raw[i] as char).to_digit(16).unwrap_or(0);
                    i += 1;
                    n += 1;
                }
                field.push(v as u8);
            }
            other => field.push(other),
        }
    }
}

/// What is wrong with `source.columns.<table>.exclude`, if anything: each
/// name must be a column of `table`, and not one of its key (see
/// [`key_columns`]). The message names the field.
pub async fn excluded_column_problem(
    client: &Client,
    table: &str,
    excluded: &[String],
) -> Result<Option<String>, tokio_postgres::Error> {
    let base = format!("source.columns.\"{table}\"");
    let Some(oid) = client
        .query_one(
            "SELECT to_regclass($1)::oid",
            &[&super::slot::sql_table(table)],
        )
        .await?
        .get::<_, Option<u32>>(0)
    else {
        return Ok(Some(format!("{base}: table {table} does not exist")));
    };
    let names: Vec<String> = client
        .query(
            "SELECT attname::text FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped",
            &[&oid],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let keys = key_columns(client, oid).await?;
    Ok(excluded.iter().enumerate().find_map(|(i, name)| {
        let field = format!("{base}.exclude[{i}]");
        if !names.contains(name) {
            Some(format!("{field}: {table} has no column {name}"))
        } else if keys.contains(name) {
            Some(excluded_key(&field, name, table))
        } else {
            None
        }
    }))
}

/// Why `name`, a column of `table`'s key, cannot be left out (`field`).
pub fn excluded_key(field: &str, name: &str, table: &str) -> String {
    format!("{field}: {name} is a column of {table}'s key (its primary key or replica identity index, or every column under REPLICA IDENTITY FULL without one), which every event carries")
}

/// What stops `column` of `table` from serving as its tenant column
/// (`partitioning.<table>.tenant_column`), if anything: it must exist, and
/// be in the replica identity (the primary key, or the index `REPLICA
/// IDENTITY USING INDEX` names) unless that is `FULL`, so that a delete
/// carries it. The message names the field.
pub async fn tenant_column_problem(
    client: &Client,
    table: &str,
    column: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let field = format!("partitioning.\"{table}\".tenant_column");
    let Some((schema, name)) = crate::config::split_table(table) else {
        return Ok(None); // validation already refused it
    };
    let row = client
        .query_opt(
            "SELECT c.relreplident = 'f',
                    EXISTS (SELECT 1 FROM pg_index i
                            JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
                            WHERE i.indrelid = c.oid AND a.attname = $3
                              AND ((c.relreplident = 'd' AND i.indisprimary)
                                   OR (c.relreplident = 'i' AND i.indisreplident))),
                    EXISTS (SELECT 1 FROM pg_attribute a
                            WHERE a.attrelid = c.oid AND a.attname = $3 AND a.attnum > 0 AND NOT a.attisdropped)
             FROM pg_class c WHERE c.oid = to_regclass(format('%I.%I', $1::text, $2::text))",
            &[&schema, &name, &column],
        )
        .await?;
    let Some(row) = row else {
        return Ok(Some(format!("{field}: table {table} does not exist")));
    };
    let (full, in_identity, exists): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
    Ok(if !exists {
        Some(format!("{field}: {table} has no column {column}"))
    } else if !full && !in_identity {
        Some(tenant_outside_identity(&field, column, table))
    } else {
        None
    })
}

/// The error of a tenant column a delete would not carry.
pub fn tenant_outside_identity(field: &str, column: &str, table: &str) -> String {
    format!(
        "{field}: {column} is not in the replica identity of {table} (its primary key, or the index REPLICA IDENTITY USING INDEX names), so its deletes would not carry the tenant; run ALTER TABLE {table} REPLICA IDENTITY FULL, or name a key column"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_copy_line_holds_only_the_last_line() {
        let mut line = CopyLine::default();
        line.parse(b"a\\tb\tlonger field\t\\N");
        line.parse(b"x\t\\101");
        let fields: Vec<Option<&[u8]>> = line.fields().collect();
        assert_eq!(fields, vec![Some(&b"x"[..]), Some(&b"A"[..])]);
        line.parse(b"");
        assert_eq!(line.fields().collect::<Vec<_>>(), vec![Some(&b""[..])]);
    }

    /// A binary COPY of `rows`, each a list of fields (`None` for NULL).
    fn binary_copy(flags: u32, rows: &[&[Option<&[u8]>]]) -> Vec<u8> {
        let mut b = COPY_SIGNATURE.to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&3i32.to_be_bytes());
        b.extend_from_slice(b"ext");
        for row in rows {
            b.extend_from_slice(&(row.len() as i16).to_be_bytes());
            for field in *row {
                match field {
                    None => b.extend_from_slice(&(-1i32).to_be_bytes()),
                    Some(f) => {
                        b.extend_from_slice(&(f.len() as i32).to_be_bytes());
                        b.extend_from_slice(f);
                    }
                }
            }
        }
        b.extend_from_slice(&(-1i16).to_be_bytes());
        b
    }

    fn read_all(columns: usize, data: &[u8]) -> Result<Vec<Vec<Option<Vec<u8>>>>, CopyError> {
        let mut reader = CopyBinary::new(columns);
        let (mut rows, mut at) = (Vec::new(), 0);
        loop {
            match reader.next(data, at)? {
                Some(CopyStep::Row(end)) => {
                    rows.push(reader.fields(data).map(|f| f.map(<[u8]>::to_vec)).collect());
                    at = end;
                }
                Some(CopyStep::End(end)) if end == data.len() => return Ok(rows),
                other => panic!("{other:?} at {at} of {}", data.len()),
            }
        }
    }

    #[test]
    fn binary_copy_rows_split_into_their_fields_and_errors_name_the_byte() {
        let data = binary_copy(0, &[&[Some(b"ab"), None, Some(b"")], &[None, None, None]]);
        assert_eq!(
            read_all(3, &data),
            Ok(vec![
                vec![Some(b"ab".to_vec()), None, Some(Vec::new())],
                vec![None, None, None],
            ])
        );
        // A row of another width is refused, not cut to the columns.
        let error = read_all(2, &data).expect_err("three fields, two columns");
        assert_eq!(
            error.at, 22,
            "the first row's field count, after the header"
        );
        assert!(error.message.contains("3 fields"), "{}", error.message);
        // A critical header flag (bit 16: OIDs) is refused.
        let error = read_all(3, &binary_copy(1 << 16, &[])).expect_err("OIDs");
        assert_eq!(error.at, 11);
        // Only -1 is NULL: a length of -2 is an error at its byte.
        let mut bad = data.clone();
        bad[24..28].copy_from_slice(&(-2i32).to_be_bytes());
        let error = read_all(3, &bad).expect_err("length -2");
        assert_eq!((error.at, error.message.contains("-2")), (24, true));
        // Text COPY where binary was asked for.
        let error = read_all(3, b"1\tabcdef\t\\N\n2\tghijkl\t\\N\n").expect_err("text");
        assert_eq!(
            (error.at, error.message.as_str()),
            (0, "binary COPY: no signature")
        );
        // Cut anywhere before its end, the first row waits for the rest.
        for cut in 0..38 {
            assert_eq!(
                CopyBinary::new(3).next(&data[..cut], 0),
                Ok(None),
                "cut at {cut}"
            );
        }
        let first = CopyBinary::new(3).next(&data[..38], 0);
        assert_eq!(first, Ok(Some(CopyStep::Row(38))));
    }

    #[test]
    fn copy_text_fields_unescape_and_keep_null_distinct() {
        let line = b"1\t\\N\ta\\tb\\nc\\\\d\t\t\\101\\x42";
        assert_eq!(
            copy_fields(line),
            vec![
                Some(b"1".to_vec()),
                None,
                Some(b"a\tb\nc\\d".to_vec()),
                Some(Vec::new()),
                Some(b"AB".to_vec()),
            ]
        );
    }
}
