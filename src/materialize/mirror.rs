//! Mirror tables: one per captured table, kept by upsert and delete under
//! the position guard.
//!
//! Guarantee: a change is applied only if its position is newer than every
//! position stored for its key: the row's own (`_pgcdc_commit_lsn`,
//! `_pgcdc_seq`), its tombstone after a delete, and the table's last
//! truncate. The check and the write run under a transaction-scoped
//! advisory lock on the key, inside the caller's transaction, so two
//! materializers racing on one key serialize and the second one skips.
//!
//! ```text
//!  change(key, position) ──► lock(key) ──► stored position ≥ position? ──► skip
//!                                                │ no
//!                                                ▼
//!                        upsert row + position │ delete row + tombstone │ truncate + watermark
//! ```
//!
//! A truncate removes only rows older than itself: it has no key, so it
//! can arrive after newer changes that travelled on other partitions.
//!
//! Each statement has a set-wise twin (`*_many`, `stored_positions`) that
//! takes many rows of distinct keys as one array per column: same guard,
//! same locks (taken in key order), one round trip.

use std::collections::{HashMap, HashSet};
use std::io::Write;

use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Statement, Transaction};

use super::shape::{Cell, Column};
use crate::source::slot::quote_ident;

/// The state schema: tombstones and truncate watermarks.
pub const STATE_SQL: &str = include_str!("../../sql/materialize.sql");

/// A change's position: `(commit_lsn, seq)`.
pub type Position = (i64, i64);

/// A mirror table's shape.
#[derive(Debug, Clone)]
pub struct Mirror {
    /// The captured table, `schema.table`.
    pub source: String,
    /// The mirror, quoted and qualified.
    pub qualified: String,
    /// The mirror's own name (unquoted, without schema).
    pub table: String,
    pub columns: Vec<Column>,
    /// Indexes into `columns` of the key, in key order.
    pub key: Vec<usize>,
    /// Written by this process alone (a rebuild's shadow): the key locks
    /// that serialize racing instances are not needed, and a long
    /// transaction would pile them up.
    pub private: bool,
}

impl Mirror {
    /// `table` is the mirror's name in `mirror_schema` (see [`mirror_names`]).
    pub fn new(
        mirror_schema: &str,
        table: &str,
        source: &str,
        columns: Vec<Column>,
        key: &[String],
    ) -> Result<Mirror, String> {
        let key = key
            .iter()
            .map(|k| {
                columns
                    .iter()
                    .position(|c| &c.name == k)
                    .ok_or_else(|| format!("{source}: key column {k} is not a column"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if key.is_empty() {
            return Err(format!("{source}: no key; a mirror needs one"));
        }
        Ok(Mirror {
            source: source.to_string(),
            qualified: format!("{}.{}", quote_ident(mirror_schema), quote_ident(table)),
            table: table.to_string(),
            columns,
            key,
            private: false,
        })
    }

    /// True when `columns` are the whole key, in its order, and hold
    /// integers or text, whose text a change's key carries exactly as the
    /// mirror would give it back: a row's view key under a mapping by
    /// these columns is then the change's key itself, with no need to read
    /// it from the mirror.
    pub fn key_columns_are(&self, columns: &[String]) -> bool {
        self.key.len() == columns.len()
            && self.key.iter().zip(columns).all(|(&i, name)| {
                let c = &self.columns[i];
                c.name == *name && (c.is_integer() || c.sql_type == "text")
            })
    }

    /// Creates the mirror if missing and adds columns a newer schema has.
    pub async fn ensure(&self, client: &impl GenericClient) -> Result<(), tokio_postgres::Error> {
        let cols: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("{} {}", quote_ident(&c.name), c.sql_type))
            .collect();
        let key: Vec<String> = self
            .key
            .iter()
            .map(|&i| quote_ident(&self.columns[i].name))
            .collect();
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} ({}, _pgcdc_commit_lsn bigint NOT NULL, _pgcdc_seq bigint NOT NULL, PRIMARY KEY ({}))",
                self.qualified,
                cols.join(", "),
                key.join(", ")
            ))
            .await?;
        self.rename_avro_spelt_columns(client).await?;
        for c in &self.columns {
            client
                .batch_execute(&format!(
                    "ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}",
                    self.qualified,
                    quote_ident(&c.name),
                    c.sql_type
                ))
                .await?;
        }
        Ok(())
    }

    /// Mirrors made before columns were named by `pgcdc.column` have the
    /// Avro spelling (`Order_Id` for `Order Id`): rename such a column to
    /// its source name, keeping its values, key and constraints.
    async fn rename_avro_spelt_columns(
        &self,
        client: &impl GenericClient,
    ) -> Result<(), tokio_postgres::Error> {
        let spelt: Vec<(&str, String)> = self
            .columns
            .iter()
            .map(|c| (c.name.as_str(), crate::encode::avro_name(&c.name)))
            .filter(|(name, avro)| name != avro && !self.columns.iter().any(|c| &c.name == avro))
            .collect();
        if spelt.is_empty() {
            return Ok(());
        }
        let existing: Vec<String> = client
            .query(
                "SELECT attname::text FROM pg_attribute
                 WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped",
                &[&self.qualified],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for (name, avro) in spelt {
            if existing.contains(&avro) && !existing.iter().any(|e| e == name) {
                client
                    .batch_execute(&format!(
                        "ALTER TABLE {} RENAME COLUMN {} TO {}",
                        self.qualified,
                        quote_ident(&avro),
                        quote_ident(name)
                    ))
                    .await?;
                tracing::info!(mirror = %self.qualified, "renamed a column to its source name");
            }
        }
        Ok(())
    }

    /// `k1 = $n::text::T1 AND ...` for the key, parameters from `first_param`.
    pub fn key_where(&self, first_param: usize) -> String {
        self.key
            .iter()
            .enumerate()
            .map(|(n, &i)| {
                let c = &self.columns[i];
                format!(
                    "{} = ${}::text::{}",
                    quote_ident(&c.name),
                    first_param + n,
                    c.sql_type
                )
            })
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// `(k1, ...) IN (unnest of text arrays)` for rows aliased `m`, one
    /// array parameter per key column from `first_param`.
    pub fn keys_in(&self, first_param: usize) -> String {
        if let [i] = self.key[..] {
            let c = &self.columns[i];
            if !c.sql_type.contains('[') {
                // The form the planner surely answers from the key's index.
                return format!(
                    "m.{} = ANY(${first_param}::text[]::{}[])",
                    quote_ident(&c.name),
                    c.sql_type
                );
            }
        }
        let (arrays, aliases, on) = key_unnest(self, first_param);
        format!("EXISTS (SELECT 1 FROM unnest({arrays}) AS u({aliases}) WHERE {on})")
    }

    /// Quoted column names, `$i::text::type` values, quoted key names.
    fn column_lists(&self) -> (Vec<String>, Vec<String>, Vec<String>) {
        let names: Vec<String> = self.columns.iter().map(|c| quote_ident(&c.name)).collect();
        let values = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| format!("${}::text::{}", i + 1, c.sql_type))
            .collect();
        let key = self.key.iter().map(|&i| names[i].clone()).collect();
        (names, values, key)
    }

    /// The key texts of a row's cells.
    pub fn key_of(&self, cells: &[Cell]) -> Vec<String> {
        self.key
            .iter()
            .map(|&i| match &cells[i] {
                Cell::Text(t) => t.clone(),
                _ => String::new(),
            })
            .collect()
    }

    /// The key columns as text, in key order, for a select list (a
    /// change's key is their text).
    pub fn key_as_text(&self) -> String {
        self.key
            .iter()
            .map(|&i| format!("{}::text", quote_ident(&self.columns[i].name)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The key in the fast dedup tier: `<mirror>|<key_text>`.
    pub fn cache_key(&self, key: &[String]) -> String {
        format!("{}|{}", self.qualified, self.key_text(key))
    }

    /// The key as stored in tombstones: a JSON array of the key texts.
    pub fn key_text(&self, key: &[String]) -> String {
        serde_json::to_string(key).unwrap_or_default()
    }
}

/// Mirror table names: the source table's name, or `<schema>_<table>`
/// when two captured tables share a name.
pub fn mirror_names(sources: &[String]) -> Vec<String> {
    let parts =
        |s: &str| crate::config::split_table(s).unwrap_or_else(|| (String::new(), s.into()));
    let table = |s: &str| parts(s).1;
    sources
        .iter()
        .map(|s| {
            let shared = sources.iter().filter(|o| table(o) == table(s)).count() > 1;
            if shared {
                let (schema, table) = parts(s);
                format!("{schema}_{table}")
            } else {
                table(s)
            }
        })
        .collect()
}

/// What happened to a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// Applied by [`insert_new`], without a durable look-up first.
    Inserted,
    /// Its position is not newer than the stored one: already applied.
    Duplicate,
}

/// Statements prepared once per connection (a statement text sent each
/// time costs a second round trip), and statement texts built once per
/// mirror and column mask. Cleared when the connection is replaced.
#[derive(Debug, Default)]
pub struct Statements {
    texts: HashMap<String, String>,
    prepared: HashMap<String, Statement>,
}

impl Statements {
    /// `sql`, prepared on this connection.
    pub async fn prepare(
        &mut self,
        client: &impl GenericClient,
        sql: &str,
    ) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let s = client.prepare(sql).await?;
        self.prepared.insert(sql.to_string(), s.clone());
        Ok(s)
    }

    /// A statement text, built on first use.
    fn text(&mut self, key: String, build: impl FnOnce() -> String) -> String {
        self.texts.entry(key).or_insert_with(build).clone()
    }
}

/// Whether `position` is newer than every position stored for the key
/// (row, tombstone, truncate). Takes the key's lock first, so the answer
/// holds until the transaction ends.
pub async fn is_new(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    key: &[String],
    position: Position,
) -> Result<bool, tokio_postgres::Error> {
    Ok(stored_position(tx, statements, mirror, key)
        .await?
        .is_none_or(|p| p < position))
}

/// The newest position stored for a key (row, tombstone, or truncate).
async fn stored_position(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    key: &[String],
) -> Result<Option<Position>, tokio_postgres::Error> {
    let key_text = mirror.key_text(key);
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&mirror.qualified, &key_text];
    for k in key {
        params.push(k);
    }
    // Lock and look-up in one round trip. Under SERIALIZABLE the look-up
    // reads the transaction's snapshot whatever the order; the lock only
    // makes a racing instance wait instead of failing serialization.
    let sql = statements.text(format!("stored {}", mirror.qualified), || {
        let lock = if mirror.private {
            "SELECT 1"
        } else {
            "SELECT pg_advisory_xact_lock(hashtextextended($1 || '|' || $2, 0))"
        };
        format!(
            "SELECT p.lsn, p.seq
             FROM ({lock}) l,
             LATERAL (
               SELECT _pgcdc_commit_lsn AS lsn, _pgcdc_seq AS seq FROM {m} WHERE {w}
               UNION ALL SELECT commit_lsn, seq FROM pgcdc_state.tombstones WHERE mirror = $1 AND key = $2
               UNION ALL SELECT commit_lsn, seq FROM pgcdc_state.truncations WHERE mirror = $1
             ) p",
            m = mirror.qualified,
            w = mirror.key_where(3)
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    Ok(tx
        .query(&sql, &params)
        .await?
        .iter()
        .map(|r| (r.get::<_, i64>(0), r.get::<_, i64>(1)))
        .max())
}

/// Statement parameters of a row's cells (an unchanged cell is not written).
fn cell_texts(cells: &[Cell]) -> Vec<Option<String>> {
    cells
        .iter()
        .map(|c| match c {
            Cell::Text(t) => Some(t.clone()),
            Cell::Null | Cell::Unchanged => None,
        })
        .collect()
}

/// `u` for each unchanged (TOAST) cell, `v` for each other: an upsert's
/// statement differs by it.
pub fn unchanged_mask(cells: &[Cell]) -> String {
    cells
        .iter()
        .map(|c| if *c == Cell::Unchanged { 'u' } else { 'v' })
        .collect()
}

/// The upsert's `SET` list: every written column of `mask`, and the position.
fn update_set(names: &[String], mask: &str) -> String {
    let mut set: Vec<String> = names
        .iter()
        .zip(mask.chars())
        .filter(|(_, m)| *m == 'v')
        .map(|(c, _)| format!("{c} = EXCLUDED.{c}"))
        .collect();
    set.push("_pgcdc_commit_lsn = EXCLUDED._pgcdc_commit_lsn".into());
    set.push("_pgcdc_seq = EXCLUDED._pgcdc_seq".into());
    set.join(", ")
}

/// Upserts a row (insert, update, snapshot read); call after [`is_new`].
/// Unchanged-TOAST cells keep the stored value.
pub async fn upsert(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    cells: &[Cell],
    position: Position,
) -> Result<Outcome, tokio_postgres::Error> {
    let key = mirror.key_of(cells);
    let mask = unchanged_mask(cells);
    let sql = statements.text(format!("upsert {} {mask}", mirror.qualified), || {
        let n = mirror.columns.len();
        let (names, values, key) = mirror.column_lists();
        let set = update_set(&names, &mask);
        // Clearing the key's tombstone (a re-insert) in the same statement.
        format!(
            "WITH cleared AS (DELETE FROM pgcdc_state.tombstones WHERE mirror = ${} AND key = ${})
                 INSERT INTO {} ({}, _pgcdc_commit_lsn, _pgcdc_seq) VALUES ({}, ${}, ${})
                 ON CONFLICT ({}) DO UPDATE SET {}",
            n + 3,
            n + 4,
            mirror.qualified,
            names.join(", "),
            values.join(", "),
            n + 1,
            n + 2,
            key.join(", "),
            set
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let texts = cell_texts(cells);
    let mut params: Vec<&(dyn ToSql + Sync)> =
        texts.iter().map(|t| t as &(dyn ToSql + Sync)).collect();
    let key_text = mirror.key_text(&key);
    params.push(&position.0);
    params.push(&position.1);
    params.push(&mirror.qualified);
    params.push(&key_text);
    tx.execute(&sql, &params).await?;
    Ok(Outcome::Applied)
}

/// Inserts a row whose key the durable tier is believed not to hold (the
/// Bloom filter's "never seen"), checking that in the same statement: no
/// row, no tombstone, no truncate at or after `position`. Returns whether
/// it inserted; if not, the caller takes the full path ([`is_new`]).
pub async fn insert_new(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    cells: &[Cell],
    position: Position,
) -> Result<bool, tokio_postgres::Error> {
    let sql = statements.text(format!("insert_new {}", mirror.qualified), || {
            let n = mirror.columns.len();
            let (names, values, key) = mirror.column_lists();
            format!(
                "INSERT INTO {m} ({names}, _pgcdc_commit_lsn, _pgcdc_seq)
                 SELECT {values}, ${lsn}::bigint, ${seq}::bigint
                 WHERE NOT EXISTS (SELECT 1 FROM pgcdc_state.tombstones WHERE mirror = ${mp} AND key = ${kp})
                   AND NOT EXISTS (SELECT 1 FROM pgcdc_state.truncations
                                   WHERE mirror = ${mp} AND (commit_lsn, seq) >= (${lsn}::bigint, ${seq}::bigint))
                 ON CONFLICT ({key}) DO NOTHING",
                m = mirror.qualified,
                names = names.join(", "),
                values = values.join(", "),
                lsn = n + 1,
                seq = n + 2,
                mp = n + 3,
                kp = n + 4,
                key = key.join(", "),
            )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let key = mirror.key_of(cells);
    let key_text = mirror.key_text(&key);
    let texts = cell_texts(cells);
    let mut params: Vec<&(dyn ToSql + Sync)> =
        texts.iter().map(|t| t as &(dyn ToSql + Sync)).collect();
    params.push(&position.0);
    params.push(&position.1);
    params.push(&mirror.qualified);
    params.push(&key_text);
    Ok(tx.execute(&sql, &params).await? == 1)
}

/// Deletes a row and leaves a tombstone position; call after [`is_new`].
pub async fn delete(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    key: &[String],
    position: Position,
) -> Result<Outcome, tokio_postgres::Error> {
    let k = key.len();
    // The row and its tombstone in one statement.
    let sql = statements.text(format!("delete {}", mirror.qualified), || {
        format!(
            "WITH gone AS (DELETE FROM {} WHERE {})
             INSERT INTO pgcdc_state.tombstones (mirror, key, commit_lsn, seq)
             VALUES (${}, ${}, ${}, ${})
             ON CONFLICT (mirror, key) DO UPDATE
             SET commit_lsn = EXCLUDED.commit_lsn, seq = EXCLUDED.seq, deleted_at = now()",
            mirror.qualified,
            mirror.key_where(1),
            k + 1,
            k + 2,
            k + 3,
            k + 4
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let key_text = mirror.key_text(key);
    let mut params: Vec<&(dyn ToSql + Sync)> =
        key.iter().map(|k| k as &(dyn ToSql + Sync)).collect();
    params.push(&mirror.qualified);
    params.push(&key_text);
    params.push(&position.0);
    params.push(&position.1);
    tx.execute(&sql, &params).await?;
    Ok(Outcome::Applied)
}

/// A row of a set-wise statement: one change of a key (keys distinct
/// within a set, so no statement touches a row twice).
#[derive(Debug, Clone, Copy)]
pub struct SetRow<'a> {
    pub key: &'a [String],
    pub cells: Option<&'a [Cell]>,
    pub position: Position,
}

/// `unnest($first::text[], ...)` over the key columns, aliased `k0, k1, ...`,
/// and the join condition of mirror `m` to them.
fn key_unnest(mirror: &Mirror, first: usize) -> (String, String, String) {
    let arrays = (0..mirror.key.len())
        .map(|n| format!("${}::text[]", first + n))
        .collect::<Vec<_>>()
        .join(", ");
    let aliases = (0..mirror.key.len())
        .map(|n| format!("k{n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let on = mirror
        .key
        .iter()
        .enumerate()
        .map(|(n, &i)| {
            let c = &mirror.columns[i];
            format!("m.{} = u.k{n}::{}", quote_ident(&c.name), c.sql_type)
        })
        .collect::<Vec<_>>()
        .join(" AND ");
    (arrays, aliases, on)
}

/// The key texts of `rows`, one array per key column.
fn key_arrays(mirror: &Mirror, rows: &[SetRow<'_>]) -> Vec<Vec<String>> {
    (0..mirror.key.len())
        .map(|n| rows.iter().map(|r| r.key[n].clone()).collect())
        .collect()
}

/// The cell texts of `rows`, one array per column (an unchanged cell is
/// NULL; the statement does not write it).
fn cell_arrays(mirror: &Mirror, rows: &[SetRow<'_>]) -> Vec<Vec<Option<String>>> {
    (0..mirror.columns.len())
        .map(|i| {
            rows.iter()
                .map(|r| match r.cells.map(|c| &c[i]) {
                    Some(Cell::Text(t)) => Some(t.clone()),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// `$5::text[], ...` over every column, their aliases `c0, c1, ...`, and
/// `u.c0::type, ...` (the insert's values).
fn cell_unnest(mirror: &Mirror) -> (String, String, String) {
    let n = mirror.columns.len();
    let arrays = (0..n)
        .map(|i| format!("${}::text[]", i + 5))
        .collect::<Vec<_>>()
        .join(", ");
    let aliases = (0..n)
        .map(|i| format!("c{i}"))
        .collect::<Vec<_>>()
        .join(", ");
    let values = mirror
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| format!("u.c{i}::{}", c.sql_type))
        .collect::<Vec<_>>()
        .join(", ");
    (arrays, aliases, values)
}

/// The parameters of a set-wise write: `$1` the mirror, `$2` the key texts,
/// `$3` and `$4` the positions, then one text array per column or key
/// column.
struct SetParams {
    key_texts: Vec<String>,
    lsns: Vec<i64>,
    seqs: Vec<i64>,
    arrays: Vec<Vec<Option<String>>>,
}

impl SetParams {
    fn new(mirror: &Mirror, rows: &[SetRow<'_>], arrays: Vec<Vec<Option<String>>>) -> SetParams {
        let (lsns, seqs) = rows.iter().map(|r| r.position).unzip();
        SetParams {
            key_texts: rows.iter().map(|r| mirror.key_text(r.key)).collect(),
            lsns,
            seqs,
            arrays,
        }
    }

    fn refs<'a>(&'a self, mirror: &'a Mirror) -> Vec<&'a (dyn ToSql + Sync)> {
        let mut params: Vec<&(dyn ToSql + Sync)> =
            vec![&mirror.qualified, &self.key_texts, &self.lsns, &self.seqs];
        params.extend(self.arrays.iter().map(|a| a as &(dyn ToSql + Sync)));
        params
    }
}

/// What [`stored_positions`] found.
#[derive(Debug, Default)]
pub struct Stored {
    /// The newest stored position of each row's key, by index into the
    /// rows; none for a key with no row, tombstone or truncate.
    pub positions: HashMap<usize, Position>,
    /// Indexes of the rows whose key has a row in the mirror.
    pub in_mirror: HashSet<usize>,
    /// [`Mirror::key_text`]s with a tombstone, which [`upsert_many`] clears.
    pub tombstoned: HashSet<String>,
}

/// [`stored_position`] of many keys in two statements (the key locks,
/// then the look-up).
pub async fn stored_positions(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    rows: &[SetRow<'_>],
) -> Result<Stored, tokio_postgres::Error> {
    let key_texts: Vec<String> = rows.iter().map(|r| mirror.key_text(r.key)).collect();
    if !mirror.private {
        // In one order, so that two instances locking overlapping sets
        // wait for each other rather than deadlock.
        let lock = statements
            .prepare(
                tx,
                "SELECT pg_advisory_xact_lock(hashtextextended($1 || '|' || kt, 0))
                 FROM unnest($2::text[]) AS kt ORDER BY kt",
            )
            .await?;
        tx.query(&lock, &[&mirror.qualified, &key_texts]).await?;
    }
    let sql = statements.text(format!("stored many {}", mirror.qualified), || {
        let (arrays, aliases, on) = key_unnest(mirror, 3);
        format!(
            "SELECT u.i, p.lsn, p.seq, p.kind
             FROM unnest($2::text[], {arrays}) WITH ORDINALITY AS u(kt, {aliases}, i),
             LATERAL (
               SELECT m._pgcdc_commit_lsn, m._pgcdc_seq, 'm' FROM {t} m WHERE {on}
               UNION ALL SELECT commit_lsn, seq, 't' FROM pgcdc_state.tombstones WHERE mirror = $1 AND key = u.kt
               UNION ALL SELECT commit_lsn, seq, 'r' FROM pgcdc_state.truncations WHERE mirror = $1
             ) p(lsn, seq, kind)",
            t = mirror.qualified
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let keys = key_arrays(mirror, rows);
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&mirror.qualified, &key_texts];
    params.extend(keys.iter().map(|k| k as &(dyn ToSql + Sync)));
    let mut out = Stored::default();
    for r in tx.query(&sql, &params).await? {
        let i = r.get::<_, i64>(0) as usize - 1;
        let p = (r.get::<_, i64>(1), r.get::<_, i64>(2));
        let e = out.positions.entry(i).or_insert(p);
        *e = (*e).max(p);
        match r.get::<_, &str>(3) {
            "m" => {
                out.in_mirror.insert(i);
            }
            "t" => {
                out.tombstoned.insert(key_texts[i].clone());
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The set-wise guard of a fresh key's insert, over `u(kt, lsn, seq)` of
/// mirror `$1`: its key has a tombstone ...
const TOMBSTONED: &str =
    "EXISTS (SELECT 1 FROM pgcdc_state.tombstones t WHERE t.mirror = $1 AND t.key = u.kt)";
/// ... or a truncate at or after its position.
const TRUNCATED: &str = "EXISTS (SELECT 1 FROM pgcdc_state.truncations r
                   WHERE r.mirror = $1 AND (r.commit_lsn, r.seq) >= (u.lsn, u.seq))";

/// [`insert_new`] of many rows in one statement: returns the indexes (into
/// `rows`) of those it inserted.
pub async fn insert_new_many(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    rows: &[SetRow<'_>],
) -> Result<Vec<usize>, tokio_postgres::Error> {
    let sql = statements.text(format!("insert_new many {}", mirror.qualified), || {
        let (names, _, key) = mirror.column_lists();
        let (arrays, aliases, values) = cell_unnest(mirror);
        let back = mirror
            .key
            .iter()
            .map(|&i| format!("ins.{} = u.c{i}::{}", names[i], mirror.columns[i].sql_type))
            .collect::<Vec<_>>()
            .join(" AND ");
        format!(
            "WITH u AS (
               SELECT * FROM unnest($2::text[], $3::bigint[], $4::bigint[], {arrays})
                 WITH ORDINALITY AS u(kt, lsn, seq, {aliases}, i)
             ), ins AS (
               INSERT INTO {m} ({names}, _pgcdc_commit_lsn, _pgcdc_seq)
               SELECT {values}, u.lsn, u.seq FROM u
               WHERE NOT {TOMBSTONED} AND NOT {TRUNCATED}
               ON CONFLICT ({key}) DO NOTHING
               RETURNING {keys}
             )
             SELECT u.i FROM u JOIN ins ON {back}",
            m = mirror.qualified,
            names = names.join(", "),
            key = key.join(", "),
            keys = key.join(", "),
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let params = SetParams::new(mirror, rows, cell_arrays(mirror, rows));
    Ok(tx
        .query(&sql, &params.refs(mirror))
        .await?
        .iter()
        .map(|r| r.get::<_, i64>(0) as usize - 1)
        .collect())
}

/// Fresh rows of a window at or above this many go in by [`copy_new_many`];
/// below it, the COPY's extra round trips cost more than it saves.
pub const COPY_MIN_ROWS: usize = 32;

/// [`insert_new_many`] by `COPY`: returns the indexes (into `rows`) it
/// inserted. One statement finds the rows a tombstone of their key or a
/// truncate at or after their position rules out; the others are streamed
/// straight into the mirror, which costs the server about half what the
/// guarded `INSERT ... SELECT FROM unnest` does. COPY has no `ON CONFLICT`:
/// if a row of one of the keys is there after all (a racing instance, or a
/// Bloom filter that never saw it), the COPY is rolled back to its
/// savepoint and the rows take [`insert_new_many`], so the outcome is the
/// same either way.
pub async fn copy_new_many(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    rows: &[SetRow<'_>],
) -> Result<(Vec<usize>, bool), tokio_postgres::Error> {
    let barred = statements.text("copy barred".into(), || {
        format!(
            "SELECT u.i FROM unnest($2::text[], $3::bigint[], $4::bigint[]) WITH ORDINALITY AS u(kt, lsn, seq, i)
             WHERE {TOMBSTONED} OR {TRUNCATED}"
        )
    });
    let barred = statements.prepare(tx, &barred).await?;
    let params = SetParams::new(mirror, rows, Vec::new());
    let barred: std::collections::HashSet<usize> = tx
        .query(&barred, &params.refs(mirror))
        .await?
        .iter()
        .map(|r| r.get::<_, i64>(0) as usize - 1)
        .collect();
    let open: Vec<usize> = (0..rows.len()).filter(|i| !barred.contains(i)).collect();
    if open.is_empty() {
        return Ok((open, false));
    }
    let sql = statements.text(format!("copy {}", mirror.qualified), || {
        let (names, _, _) = mirror.column_lists();
        format!(
            "COPY {} ({}, _pgcdc_commit_lsn, _pgcdc_seq) FROM STDIN",
            mirror.qualified,
            names.join(", ")
        )
    });
    let copy = statements.prepare(tx, &sql).await?;
    let mut data = Vec::with_capacity(open.len() * 64);
    for &i in &open {
        copy_row(&mut data, &rows[i]);
    }
    tx.batch_execute("SAVEPOINT pgcdc_copy").await?;
    let copied: Result<u64, tokio_postgres::Error> = async {
        let sink = tx.copy_in::<_, bytes::Bytes>(&copy).await?;
        futures_util::pin_mut!(sink);
        futures_util::SinkExt::send(&mut sink, bytes::Bytes::from(data)).await?;
        sink.finish().await
    }
    .await;
    match copied {
        Ok(_) => {
            tx.batch_execute("RELEASE SAVEPOINT pgcdc_copy").await?;
            Ok((open, true))
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
            tx.batch_execute("ROLLBACK TO SAVEPOINT pgcdc_copy").await?;
            let open_rows: Vec<SetRow<'_>> = open.iter().map(|&i| rows[i]).collect();
            let got = insert_new_many(tx, statements, mirror, &open_rows).await?;
            Ok((got.into_iter().map(|j| open[j]).collect(), false))
        }
        Err(e) => Err(e),
    }
}

/// One row of `COPY ... FROM STDIN` text format: the cells (NULL for a
/// missing or unchanged one), then the position.
fn copy_row(out: &mut Vec<u8>, row: &SetRow<'_>) {
    for cell in row.cells.unwrap_or_default() {
        match cell {
            Cell::Text(t) => copy_text(out, t),
            Cell::Null | Cell::Unchanged => out.extend_from_slice(b"\\N"),
        }
        out.push(b'\t');
    }
    // Into the buffer directly: writing to a Vec cannot fail.
    let _ = writeln!(out, "{}\t{}", row.position.0, row.position.1);
}

/// A value in COPY text format: backslash, tab, newline and carriage
/// return escaped, so that no value ends a field, a row or the data.
fn copy_text(out: &mut Vec<u8>, value: &str) {
    for &b in value.as_bytes() {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            _ => out.push(b),
        }
    }
}

/// [`upsert`] of many rows (all with the same unchanged cells) in one
/// statement; call after [`stored_positions`] in the same transaction,
/// with the tombstoned keys it found. Only their tombstones are looked up
/// to be cleared: the transaction's snapshot shows no other, and under the
/// key locks no other session adds one meanwhile.
pub async fn upsert_many(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    rows: &[SetRow<'_>],
    tombstoned: &HashSet<String>,
) -> Result<(), tokio_postgres::Error> {
    let Some(first) = rows.first().and_then(|r| r.cells) else {
        return Ok(());
    };
    let mask = unchanged_mask(first);
    let sql = statements.text(format!("upsert many {} {mask}", mirror.qualified), || {
        let (names, _, key) = mirror.column_lists();
        let (arrays, aliases, values) = cell_unnest(mirror);
        let set = update_set(&names, &mask);
        format!(
            "WITH cleared AS (DELETE FROM pgcdc_state.tombstones WHERE mirror = $1 AND key = ANY($2::text[]))
             INSERT INTO {m} ({names}, _pgcdc_commit_lsn, _pgcdc_seq)
             SELECT {values}, u.lsn, u.seq
             FROM unnest($3::bigint[], $4::bigint[], {arrays}) AS u(lsn, seq, {aliases})
             ON CONFLICT ({key}) DO UPDATE SET {set}",
            m = mirror.qualified,
            names = names.join(", "),
            key = key.join(", "),
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let mut params = SetParams::new(mirror, rows, cell_arrays(mirror, rows));
    // `$2` serves only the clearing of tombstones.
    params.key_texts.retain(|k| tombstoned.contains(k));
    tx.execute(&sql, &params.refs(mirror)).await?;
    Ok(())
}

/// [`delete`] of many keys in one statement; call after
/// [`stored_positions`].
pub async fn delete_many(
    tx: &Transaction<'_>,
    statements: &mut Statements,
    mirror: &Mirror,
    rows: &[SetRow<'_>],
) -> Result<(), tokio_postgres::Error> {
    let sql = statements.text(format!("delete many {}", mirror.qualified), || {
        let (arrays, aliases, on) = key_unnest(mirror, 5);
        format!(
            "WITH gone AS (DELETE FROM {m} m USING unnest({arrays}) AS u({aliases}) WHERE {on})
             INSERT INTO pgcdc_state.tombstones (mirror, key, commit_lsn, seq)
             SELECT $1, u.kt, u.lsn, u.seq FROM unnest($2::text[], $3::bigint[], $4::bigint[]) AS u(kt, lsn, seq)
             ON CONFLICT (mirror, key) DO UPDATE
             SET commit_lsn = EXCLUDED.commit_lsn, seq = EXCLUDED.seq, deleted_at = now()",
            m = mirror.qualified
        )
    });
    let sql = statements.prepare(tx, &sql).await?;
    let keys = key_arrays(mirror, rows)
        .into_iter()
        .map(|k| k.into_iter().map(Some).collect())
        .collect();
    let params = SetParams::new(mirror, rows, keys);
    tx.execute(&sql, &params.refs(mirror)).await?;
    Ok(())
}

/// The mirror's truncate watermark: rows and changes older than it are
/// gone for good.
pub async fn truncated_at(
    client: &impl GenericClient,
    mirror: &Mirror,
) -> Result<Option<Position>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT commit_lsn, seq FROM pgcdc_state.truncations WHERE mirror = $1",
            &[&mirror.qualified],
        )
        .await?
        .map(|r| (r.get(0), r.get(1))))
}

/// Empties a mirror and records the truncate's position, unless a newer
/// truncate is recorded.
pub async fn truncate(
    tx: &Transaction<'_>,
    mirror: &Mirror,
    position: Position,
) -> Result<Outcome, tokio_postgres::Error> {
    if !mirror.private {
        tx.query_one(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
            &[&mirror.qualified],
        )
        .await?;
    }
    if truncated_at(tx, mirror)
        .await?
        .is_some_and(|p| p >= position)
    {
        return Ok(Outcome::Duplicate);
    }
    // Only what is older than the truncate: a truncate has no key, so it
    // travels on any partition, and newer changes of other partitions may
    // already be applied.
    tx.execute(
        &format!(
            "DELETE FROM {} WHERE (_pgcdc_commit_lsn, _pgcdc_seq) < ($1, $2)",
            mirror.qualified
        ),
        &[&position.0, &position.1],
    )
    .await?;
    tx.execute(
        "DELETE FROM pgcdc_state.tombstones WHERE mirror = $1 AND (commit_lsn, seq) < ($2, $3)",
        &[&mirror.qualified, &position.0, &position.1],
    )
    .await?;
    tx.execute(
        "INSERT INTO pgcdc_state.truncations (mirror, commit_lsn, seq) VALUES ($1, $2, $3)
         ON CONFLICT (mirror) DO UPDATE
         SET commit_lsn = EXCLUDED.commit_lsn, seq = EXCLUDED.seq, truncated_at = now()",
        &[&mirror.qualified, &position.0, &position.1],
    )
    .await?;
    Ok(Outcome::Applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_row_escapes_what_would_end_a_field_a_row_or_the_data() {
        let key = vec!["1".to_string()];
        let cells = vec![
            Cell::Text("1".into()),
            Cell::Text("a\tb\nc\rd\\e".into()),
            Cell::Text("\\.".into()),
            Cell::Text("\\N".into()),
            Cell::Text(String::new()),
            Cell::Null,
            Cell::Unchanged,
        ];
        let mut out = Vec::new();
        copy_row(
            &mut out,
            &SetRow {
                key: &key,
                cells: Some(&cells),
                position: (42, 7),
            },
        );
        assert_eq!(
            String::from_utf8(out).expect("utf-8"),
            "1\ta\\tb\\nc\\rd\\\\e\t\\\\.\t\\\\N\t\t\\N\t\\N\t42\t7\n"
        );
    }

    #[test]
    fn mirror_names_stay_distinct_across_schemas() {
        let sources = vec![
            "public.orders".to_string(),
            "sales.orders".to_string(),
            "public.customers".to_string(),
        ];
        assert_eq!(
            mirror_names(&sources),
            vec!["public_orders", "sales_orders", "customers"]
        );
    }
}
