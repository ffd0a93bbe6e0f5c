//! Denormalized views (read models): recomputed for the keys a batch of
//! changes affected, in the same transaction as the mirror writes.
//!
//! Guarantee: a view row is always what the view's query returns on the
//! mirrors as of the transaction's commit, for every affected key. Keys
//! are collected from the mirror row both before and after each change,
//! so a row that moves (an order to another customer) updates both sides.

use std::collections::BTreeSet;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;

use crate::config::ReadModelConfig;
use crate::source::slot::quote_ident;

use super::mirror::{Mirror, Statements};

/// A recompute that failed: in the database (maybe retryable), or on a
/// key that does not fit the query's parameter.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("{}", crate::source::error_text(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Key(String),
    /// The query returned two rows for one view key.
    #[error("{0}")]
    Duplicate(String),
}

/// The recompute of a view as one statement: the query's rows upserted
/// by the view's key, a row written only where it differs from the stored
/// one, and the affected keys the query no longer returns deleted (only
/// those are looked up in the view: most keys are returned). Against
/// deleting and reinserting every affected row, an unchanged row costs no
/// write, and a changed one is updated in place (a HOT update when no
/// indexed column changed) instead of a dead row and new index entries.
///
/// `None` when the statement does not prepare: a column type without an
/// equality operator (`json`, `point`), a table whose columns do not match
/// the query's, a query that does not fit in a `WITH`.
async fn diff_statement(
    client: &tokio_postgres::Client,
    qualified: &str,
    key: &[String],
    query: &str,
) -> Option<String> {
    let columns: Vec<String> = client
        .query(
            "SELECT attname::text FROM pg_attribute
             WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped
             ORDER BY attnum",
            &[&qualified],
        )
        .await
        .ok()?
        .iter()
        .map(|r| quote_ident(&r.get::<_, String>(0)))
        .collect();
    let key: Vec<String> = key.iter().map(|k| quote_ident(k)).collect();
    let rest: Vec<&String> = columns.iter().filter(|c| !key.contains(c)).collect();
    let list =
        |item: fn(&str) -> String| rest.iter().map(|c| item(c)).collect::<Vec<_>>().join(", ");
    let on_conflict = if rest.is_empty() {
        "DO NOTHING".to_string()
    } else {
        format!(
            "DO UPDATE SET {} WHERE ({}) IS DISTINCT FROM ({})",
            list(|c| format!("{c} = EXCLUDED.{c}")),
            list(|c| format!("v.{c}")),
            list(|c| format!("EXCLUDED.{c}")),
        )
    };
    let cols = columns.join(", ");
    let gone = match &key[..] {
        [k] => format!("v.{k} = ANY(ARRAY(SELECT unnest($1) EXCEPT SELECT f.{k} FROM fresh f))"),
        _ => format!(
            "({}) IN (SELECT * FROM unnest({}) EXCEPT SELECT {} FROM fresh f)",
            key.iter()
                .map(|k| format!("v.{k}"))
                .collect::<Vec<_>>()
                .join(", "),
            (1..=key.len())
                .map(|n| format!("${n}"))
                .collect::<Vec<_>>()
                .join(", "),
            key.iter()
                .map(|k| format!("f.{k}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    };
    // A newline before the closing parenthesis: the query may end in a
    // line comment.
    let sql = format!(
        "WITH fresh ({cols}) AS ({query}\n),
         gone AS (DELETE FROM {qualified} v WHERE {gone})
         INSERT INTO {qualified} AS v ({cols}) SELECT {cols} FROM fresh
         ON CONFLICT ({}) {on_conflict}",
        key.join(", ")
    );
    match client.prepare(&sql).await {
        Ok(_) => Some(sql),
        Err(e) => {
            tracing::debug!(error = %crate::source::error_text(&e), "no one-statement recompute");
            None
        }
    }
}

/// A view key in the sets of affected keys: the key column's text, or
/// for a composite key a JSON array of its columns' texts (as mirrors
/// write their keys in tombstones). `None` when a part is NULL: no view
/// row has a NULL key column.
pub fn view_key(parts: &[Option<String>]) -> Option<String> {
    match parts {
        [one] => one.clone(),
        _ => {
            let parts: Option<Vec<&String>> = parts.iter().map(Option::as_ref).collect();
            Some(serde_json::to_string(&parts?).unwrap_or_default())
        }
    }
}

/// The view key that is a change's own key (see [`Mirror::key_columns_are`]).
fn own_key(key: &[String]) -> Option<String> {
    view_key(&key.iter().cloned().map(Some).collect::<Vec<_>>())
}

/// The view key of a row's columns `first..first + n`, read as text.
fn key_in_row(row: &tokio_postgres::Row, first: usize, n: usize) -> Option<String> {
    let parts: Vec<Option<String>> = (first..first + n).map(|i| row.get(i)).collect();
    view_key(&parts)
}

/// [`view_key`] split into its columns' texts, column by column: one
/// array per key column, for the queries' `$1`, `$2`, ...
fn key_columns_of(keys: &[String], n: usize) -> Result<Vec<Vec<String>>, String> {
    if n == 1 {
        return Ok(vec![keys.to_vec()]);
    }
    let mut columns = vec![Vec::with_capacity(keys.len()); n];
    for k in keys {
        let parts: Vec<String> =
            serde_json::from_str(k).map_err(|e| format!("key {k}: not a composite key: {e}"))?;
        if parts.len() != n {
            return Err(format!("key {k}: {} columns, not {n}", parts.len()));
        }
        for (column, part) in columns.iter_mut().zip(parts) {
            column.push(part);
        }
    }
    Ok(columns)
}

/// How a changed source row maps to view keys.
#[derive(Debug, Clone)]
pub enum Mapping {
    /// The mirror row's columns whose values are the view key, in the
    /// key's order.
    Columns(Vec<String>),
    /// SQL over the mirrors: `$1`, `$2`, ... are the changed row's key
    /// columns (as many as the query takes, in the mirror key's order),
    /// each row of the result a view key (wrapped to return its columns
    /// as text).
    Query { sql: String, params: Vec<Type> },
}

#[derive(Debug, Clone)]
pub struct View {
    pub name: String,
    pub qualified: String,
    /// The key's columns (one, or several for a composite key).
    pub key: Vec<String>,
    query: String,
    /// The types of the query's `$1`, `$2`, ... (an array of each key
    /// column's values).
    param: Vec<Type>,
    /// Deletes the rows of some keys (see [`delete_statement`]).
    delete: String,
    delete_param: Vec<Type>,
    /// The recompute as one statement that writes only what changed (see
    /// [`diff_statement`]); `None` where the target cannot take it, and the
    /// recompute deletes and reinserts every affected row instead.
    diff: Option<String>,
    /// Source table (`schema.table`) → mapping.
    pub sources: Vec<(String, Mapping)>,
}

/// Deletes the view rows of the keys in `$1` (of a composite key: the
/// rows whose columns are the same elements of `$1`, `$2`, ..., each a
/// text array cast to its column's type).
fn delete_statement(qualified: &str, key: &[String], types: &[String]) -> String {
    match key {
        [k] => format!("DELETE FROM {qualified} WHERE {} = ANY($1)", quote_ident(k)),
        _ => format!(
            "DELETE FROM {qualified} WHERE ({}) IN (SELECT * FROM unnest({}))",
            column_list(key),
            types
                .iter()
                .enumerate()
                .map(|(n, t)| format!("${}::text[]::{t}[]", n + 1))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// A `uuid` key, parsed from its text (any case, hyphens anywhere, as
/// Postgres's input accepts the usual forms) and bound in binary.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Uuid([u8; 16]);

impl std::str::FromStr for Uuid {
    type Err = ();

    fn from_str(text: &str) -> Result<Uuid, ()> {
        let text = text
            .strip_prefix('{')
            .and_then(|t| t.strip_suffix('}'))
            .unwrap_or(text);
        let hex: Vec<u8> = text.bytes().filter(|b| *b != b'-').collect();
        if hex.len() != 32 {
            return Err(());
        }
        let mut out = [0u8; 16];
        for (byte, pair) in out.iter_mut().zip(hex.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| ())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| ())?;
        }
        Ok(Uuid(out))
    }
}

impl ToSql for Uuid {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(&self.0);
        Ok(tokio_postgres::types::IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::UUID
    }

    tokio_postgres::types::to_sql_checked!();
}

/// Whether keys of type `ty` (a parameter's, or an array parameter's
/// element type) can be bound.
fn key_type_supported(ty: &Type) -> Result<(), String> {
    match *ty {
        Type::INT2 | Type::INT4 | Type::INT8 | Type::UUID => Ok(()),
        Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => Ok(()),
        _ => Err(format!(
            "keys of type {} are not supported (use integers, text or uuid)",
            ty.name()
        )),
    }
}

/// A key value (as text) bound as the parameter type Postgres inferred.
fn bind_one(ty: &Type, text: &str) -> Result<Box<dyn ToSql + Sync + Send>, String> {
    key_type_supported(ty)?;
    let bad = || format!("key '{text}' is not a {}", ty.name());
    Ok(match *ty {
        Type::INT2 => Box::new(text.parse::<i16>().map_err(|_| bad())?),
        Type::INT4 => Box::new(text.parse::<i32>().map_err(|_| bad())?),
        Type::INT8 => Box::new(text.parse::<i64>().map_err(|_| bad())?),
        Type::UUID => Box::new(text.parse::<Uuid>().map_err(|_| bad())?),
        _ => Box::new(text.to_string()),
    })
}

/// The first `params.len()` columns of a mirror key bound as `params`;
/// `None` when a value does not fit its type (the key has no rows to map).
fn bind_row(params: &[Type], key: &[String]) -> Option<Vec<Box<dyn ToSql + Sync + Send>>> {
    if key.len() < params.len() {
        return None;
    }
    params
        .iter()
        .zip(key)
        .map(|(ty, k)| bind_one(ty, k).ok())
        .collect()
}

/// Bound values as a statement's parameters.
fn refs(bound: &[Box<dyn ToSql + Sync + Send>]) -> Vec<&(dyn ToSql + Sync)> {
    bound
        .iter()
        .map(|b| b.as_ref() as &(dyn ToSql + Sync))
        .collect()
}

/// Keys (as text) bound as the array type Postgres inferred.
fn bind_many(ty: &Type, keys: &[String]) -> Result<Box<dyn ToSql + Sync + Send>, String> {
    fn parse<T: std::str::FromStr>(keys: &[String], ty: &Type) -> Result<Vec<T>, String> {
        keys.iter()
            .map(|k| {
                k.parse::<T>()
                    .map_err(|_| format!("key '{k}' is not a {}", ty.name()))
            })
            .collect()
    }
    Ok(match *ty {
        Type::INT2_ARRAY => Box::new(parse::<i16>(keys, ty)?),
        Type::INT4_ARRAY => Box::new(parse::<i32>(keys, ty)?),
        Type::INT8_ARRAY => Box::new(parse::<i64>(keys, ty)?),
        Type::UUID_ARRAY => Box::new(parse::<Uuid>(keys, ty)?),
        Type::TEXT_ARRAY | Type::VARCHAR_ARRAY | Type::BPCHAR_ARRAY | Type::NAME_ARRAY => {
            Box::new(keys.to_vec())
        }
        _ => {
            return Err(format!(
            "a key parameter of type {} is not supported (use an array of integers, text or uuid)",
            ty.name()
        ))
        }
    })
}

impl View {
    /// Creates the view's table (from its query's shape, with its key as
    /// primary key) if missing, and prepares its statements. The mirrors
    /// must exist.
    pub async fn prepare(
        client: &tokio_postgres::Client,
        name: &str,
        rm: &ReadModelConfig,
    ) -> Result<View, String> {
        let field = |f: &str| format!("read_models.{name}.{f}");
        let (schema, table) = crate::config::split_table(&rm.table)
            .ok_or_else(|| format!("{}: must be schema.table", field("table")))?;
        let qualified = format!("{}.{}", quote_ident(&schema), quote_ident(&table));
        let key = rm.key.clone();
        if key.is_empty() {
            return Err(format!("{}: needs at least one column", field("key")));
        }
        let stmt = client
            .prepare(&rm.query)
            .await
            .map_err(|e| format!("{}: {}", field("query"), crate::source::error_text(&e)))?;
        let param = stmt.params().to_vec();
        if param.len() != key.len() {
            return Err(match key.len() {
                1 => format!(
                    "{}: must take exactly one parameter ($1, the array of keys); it takes {}",
                    field("query"),
                    param.len()
                ),
                n => format!(
                    "{}: must take {n} parameters ($1 to ${n}, an array of each key column's values, in key order); it takes {}",
                    field("query"),
                    param.len()
                ),
            });
        }
        for p in &param {
            bind_many(p, &[]).map_err(|e| format!("{}: {e}", field("query")))?;
        }
        let statement = format!(
            "pgcdc_view_{}",
            name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        );
        client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema_q};
                 PREPARE {statement} AS {query};
                 CREATE TABLE IF NOT EXISTS {qualified} AS EXECUTE {statement}({nulls}) WITH NO DATA;
                 DEALLOCATE {statement};",
                schema_q = quote_ident(&schema),
                query = rm.query,
                nulls = vec!["NULL"; key.len()].join(", "),
            ))
            .await
            .map_err(|e| format!("{}: {}", field("table"), crate::source::error_text(&e)))?;
        // The primary key's columns, if it has one.
        let pk: Option<Vec<String>> = client
            .query_one(
                "SELECT (SELECT array_agg(a.attname::text ORDER BY k.n)
                         FROM pg_index i, unnest(i.indkey) WITH ORDINALITY k(attnum, n), pg_attribute a
                         WHERE i.indrelid = $1::text::regclass AND i.indisprimary
                           AND a.attrelid = i.indrelid AND a.attnum = k.attnum)",
                &[&qualified],
            )
            .await
            .map_err(|e| crate::source::error_text(&e))?
            .get(0);
        match pk {
            None => client
                .batch_execute(&format!(
                    "ALTER TABLE {qualified} ADD PRIMARY KEY ({})",
                    column_list(&key)
                ))
                .await
                .map_err(|e| format!("{}: {}", field("key"), crate::source::error_text(&e)))?,
            // A table made under another key (the key changed since): its
            // rows cannot be kept by this one.
            Some(pk) if pk.iter().collect::<BTreeSet<_>>() != key.iter().collect() => {
                return Err(format!(
                    "{}: {} has the primary key ({}), not ({}); drop the table and start again, then fill it with `pgcdc rebuild --read-model {name}`",
                    field("key"),
                    rm.table,
                    pk.join(", "),
                    key.join(", ")
                ))
            }
            Some(_) => {}
        }
        let mut key_types = Vec::new();
        for k in &key {
            let ty: Option<String> = client
                .query_opt(
                    "SELECT format_type(atttypid, atttypmod) FROM pg_attribute
                     WHERE attrelid = $1::text::regclass AND attname = $2 AND NOT attisdropped",
                    &[&qualified, k],
                )
                .await
                .map_err(|e| crate::source::error_text(&e))?
                .map(|r| r.get(0));
            key_types.push(ty.ok_or_else(|| {
                format!(
                    "{}: {k} is not a column of {} (the query's columns)",
                    field("key"),
                    rm.table
                )
            })?);
        }
        let delete = delete_statement(&qualified, &key, &key_types);
        let delete_param = client
            .prepare(&delete)
            .await
            .map_err(|e| format!("{}: {}", field("key"), crate::source::error_text(&e)))?
            .params()
            .to_vec();
        let diff = diff_statement(client, &qualified, &key, &rm.query).await;
        if diff.is_none() {
            tracing::info!(read_model = %name, "the read model is recomputed by delete and insert (its columns cannot be compared, or its query does not fit one statement)");
        }
        let mut sources = Vec::new();
        for (i, s) in rm.sources.iter().enumerate() {
            let mapping = match (&s.key_columns, &s.affected_keys) {
                (Some(cols), _) => Mapping::Columns(cols.clone()),
                (None, Some(sql)) => {
                    let af = field(&format!("sources[{i}].affected_keys"));
                    let refused = |e: tokio_postgres::Error| {
                        format!("{af}: {}", crate::source::error_text(&e))
                    };
                    let stmt = client.prepare(sql).await.map_err(refused)?;
                    let returned = stmt.columns().len();
                    if returned != key.len() {
                        return Err(format!(
                            "{af}: returns {returned} column(s), one per key column ({}) wanted",
                            key.join(", ")
                        ));
                    }
                    let params = stmt.params().to_vec();
                    // Integers, text and uuid; other types are refused.
                    for p in &params {
                        key_type_supported(p).map_err(|e| format!("{af}: {e}"))?;
                    }
                    let names: Vec<String> = (1..=key.len()).map(|n| format!("k{n}")).collect();
                    let wrapped = format!(
                        "SELECT {} FROM ({sql}) AS q({})",
                        as_text(&names, ""),
                        column_list(&names)
                    );
                    // What the query runs as must prepare too.
                    client.prepare(&wrapped).await.map_err(refused)?;
                    Mapping::Query {
                        sql: wrapped,
                        params,
                    }
                }
                (None, None) => continue,
            };
            sources.push((s.table.clone(), mapping));
        }
        Ok(View {
            name: name.to_string(),
            qualified,
            key,
            query: rm.query.clone(),
            param,
            delete,
            delete_param,
            diff,
            sources,
        })
    }

    /// Checks each source's mapping against its mirror (`mirrors` by
    /// source table): `key_columns` names columns the mirror has, and an
    /// `affected_keys` query takes no more parameters than the mirror's
    /// key has columns.
    pub fn check_sources<'a>(
        &self,
        mirrors: impl Fn(&str) -> Option<&'a Mirror>,
    ) -> Result<(), String> {
        for (i, (table, mapping)) in self.sources.iter().enumerate() {
            let field = |f: &str| format!("read_models.{}.sources[{i}].{f}", self.name);
            let Some(m) = mirrors(table) else { continue };
            match mapping {
                Mapping::Columns(cols) => {
                    if let Some(c) = cols
                        .iter()
                        .find(|c| !m.columns.iter().any(|mc| &mc.name == *c))
                    {
                        return Err(format!(
                            "{}: {table} has no column {c}",
                            field("key_columns")
                        ));
                    }
                }
                Mapping::Query { params, .. } if params.len() > m.key.len() => {
                    return Err(format!(
                        "{}: takes {} parameters, but the key of {table} has {} column(s) ($1 is its first)",
                        field("affected_keys"),
                        params.len(),
                        m.key.len()
                    ));
                }
                Mapping::Query { params, .. } => {
                    for (n, (ty, &c)) in params.iter().zip(&m.key).enumerate() {
                        let column = &m.columns[c];
                        let fits = match *ty {
                            Type::INT2 | Type::INT4 | Type::INT8 => column.is_integer(),
                            Type::UUID => column.sql_type == "uuid",
                            _ => true, // text takes any key's text
                        };
                        if !fits {
                            return Err(format!(
                                "{}: ${} is a {}, but it is given {table}'s key column {} ({})",
                                field("affected_keys"),
                                n + 1,
                                ty.name(),
                                column.name,
                                column.sql_type
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The view keys a mirror row maps to right now (none when the row
    /// does not exist).
    pub async fn keys_of(
        &self,
        client: &impl GenericClient,
        statements: &mut Statements,
        mapping: &Mapping,
        mirror: &Mirror,
        key: &[String],
        out: &mut BTreeSet<String>,
    ) -> Result<(), tokio_postgres::Error> {
        match mapping {
            // Whether or not the row exists: a key with no row recomputes
            // to nothing, which is what the view must hold for it.
            Mapping::Columns(cols) if mirror.key_columns_are(cols) => out.extend(own_key(key)),
            Mapping::Columns(cols) => {
                let params: Vec<&(dyn ToSql + Sync)> =
                    key.iter().map(|k| k as &(dyn ToSql + Sync)).collect();
                let sql = format!(
                    "SELECT {} FROM {} WHERE {}",
                    as_text(cols, ""),
                    mirror.qualified,
                    mirror.key_where(1)
                );
                let sql = statements.prepare(client, &sql).await?;
                let rows = client.query(&sql, &params).await?;
                out.extend(rows.iter().filter_map(|r| key_in_row(r, 0, cols.len())));
            }
            Mapping::Query { sql, params } => {
                let Some(bound) = bind_row(params, key) else {
                    return Ok(());
                };
                let sql = statements.prepare(client, sql).await?;
                let rows = client.query(&sql, &refs(&bound)).await?;
                out.extend(rows.iter().filter_map(|r| key_in_row(r, 0, self.key.len())));
            }
        }
        Ok(())
    }

    /// [`View::keys_of`] of many mirror rows: one statement for a column
    /// mapping, and the mapping's queries pipelined on the connection for a
    /// query mapping.
    pub async fn keys_of_many(
        &self,
        client: &impl GenericClient,
        statements: &mut Statements,
        mapping: &Mapping,
        mirror: &Mirror,
        keys: &[&[String]],
        out: &mut BTreeSet<String>,
    ) -> Result<(), tokio_postgres::Error> {
        if keys.is_empty() {
            return Ok(());
        }
        match mapping {
            // See [`View::keys_of`].
            Mapping::Columns(cols) if mirror.key_columns_are(cols) => {
                out.extend(keys.iter().filter_map(|k| own_key(k)))
            }
            Mapping::Columns(cols) => {
                let arrays: Vec<Vec<String>> = (0..mirror.key.len())
                    .map(|n| keys.iter().map(|k| k[n].clone()).collect())
                    .collect();
                let params: Vec<&(dyn ToSql + Sync)> =
                    arrays.iter().map(|a| a as &(dyn ToSql + Sync)).collect();
                let sql = format!(
                    "SELECT {} FROM {} m WHERE {}",
                    as_text(cols, "m."),
                    mirror.qualified,
                    mirror.keys_in(1)
                );
                let sql = statements.prepare(client, &sql).await?;
                let rows = client.query(&sql, &params).await?;
                out.extend(rows.iter().filter_map(|r| key_in_row(r, 0, cols.len())));
            }
            Mapping::Query { sql, params } => {
                let sql = statements.prepare(client, sql).await?;
                let bound: Vec<_> = keys.iter().filter_map(|k| bind_row(params, k)).collect();
                let params: Vec<Vec<&(dyn ToSql + Sync)>> = bound.iter().map(|b| refs(b)).collect();
                let queries = params.iter().map(|p| client.query(&sql, p));
                for rows in futures_util::future::join_all(queries).await {
                    out.extend(
                        rows?
                            .iter()
                            .filter_map(|r| key_in_row(r, 0, self.key.len())),
                    );
                }
            }
        }
        Ok(())
    }

    /// Every key the view holds now (after a truncate of a source).
    pub async fn all_keys(
        &self,
        client: &impl GenericClient,
        out: &mut BTreeSet<String>,
    ) -> Result<(), tokio_postgres::Error> {
        let rows = client
            .query(
                &format!("SELECT {} FROM {}", as_text(&self.key, ""), self.qualified),
                &[],
            )
            .await?;
        out.extend(rows.iter().filter_map(|r| key_in_row(r, 0, self.key.len())));
        Ok(())
    }

    /// Every key the view can hold given the mirrors now: each
    /// `key_columns` mapping's column values, and the `affected_keys` of
    /// every row of each other source's mirror. (`mirrors` by source table.)
    pub async fn every_key(
        &self,
        client: &impl GenericClient,
        mirrors: &[&Mirror],
    ) -> Result<BTreeSet<String>, tokio_postgres::Error> {
        use futures_util::stream::{self, StreamExt, TryStreamExt};
        let mut out = BTreeSet::new();
        for (table, mapping) in &self.sources {
            let Some(m) = mirrors.iter().find(|m| &m.source == table) else {
                continue;
            };
            match mapping {
                Mapping::Columns(cols) => {
                    let rows = client
                        .query(
                            &format!(
                                "SELECT DISTINCT {} FROM {} WHERE {}",
                                as_text(cols, ""),
                                m.qualified,
                                cols.iter()
                                    .map(|c| format!("{} IS NOT NULL", quote_ident(c)))
                                    .collect::<Vec<_>>()
                                    .join(" AND ")
                            ),
                            &[],
                        )
                        .await?;
                    out.extend(rows.iter().filter_map(|r| key_in_row(r, 0, cols.len())));
                }
                Mapping::Query { sql, params } => {
                    // The key columns the query takes, once each (a query
                    // taking none runs once if the mirror has a row).
                    let key: Vec<String> = m
                        .key
                        .iter()
                        .take(params.len())
                        .map(|&i| m.columns[i].name.clone())
                        .collect();
                    let list = match key.len() {
                        0 => "1".to_string(),
                        _ => as_text(&key, ""),
                    };
                    let keys: Vec<Vec<String>> = client
                        .query(&format!("SELECT DISTINCT {list} FROM {}", m.qualified), &[])
                        .await?
                        .iter()
                        .map(|r| (0..key.len()).map(|i| r.get(i)).collect())
                        .collect();
                    let stmt = client.prepare(sql).await?;
                    let found: Vec<Vec<tokio_postgres::Row>> =
                        stream::iter(keys.iter().filter_map(|k| bind_row(params, k)))
                            .map(|bound| {
                                let stmt = &stmt;
                                async move { client.query(stmt, &refs(&bound)).await }
                            })
                            // Pipelined on the one connection.
                            .buffer_unordered(64)
                            .try_collect()
                            .await?;
                    out.extend(
                        found
                            .iter()
                            .flatten()
                            .filter_map(|r| key_in_row(r, 0, self.key.len())),
                    );
                }
            }
        }
        Ok(out)
    }

    /// `keys` as the statement's parameters of `types`: one array per key
    /// column.
    fn bind_keys(
        &self,
        types: &[Type],
        keys: &[String],
    ) -> Result<Vec<Box<dyn ToSql + Sync + Send>>, ViewError> {
        let key_error = |e: String| ViewError::Key(format!("read model {}: {e}", self.name));
        key_columns_of(keys, self.key.len())
            .map_err(key_error)?
            .iter()
            .zip(types)
            .map(|(column, ty)| bind_many(ty, column).map_err(key_error))
            .collect()
    }

    /// Replaces the view rows of `keys` with what the query returns now.
    pub async fn recompute(
        &self,
        client: &impl GenericClient,
        statements: &mut Statements,
        keys: &BTreeSet<String>,
    ) -> Result<(), ViewError> {
        if keys.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = keys.iter().cloned().collect();
        let ins = self.bind_keys(&self.param, &keys)?;
        if let Some(diff) = &self.diff {
            let sql = statements.prepare(client, diff).await?;
            return match client.execute(&sql, &refs(&ins)).await {
                // Two rows of the query for one key: the delete-and-insert
                // path refuses them as a duplicate key, and so does this.
                Err(e) if e.code() == Some(&SqlState::CARDINALITY_VIOLATION) => {
                    Err(ViewError::Duplicate(format!(
                        "read model {}: the query returns more than one row for a key",
                        self.name
                    )))
                }
                other => other.map(|_| ()).map_err(ViewError::Db),
            };
        }
        let del = self.bind_keys(&self.delete_param, &keys)?;
        let sql = statements.prepare(client, &self.delete).await?;
        client.execute(&sql, &refs(&del)).await?;
        let sql = format!("INSERT INTO {} {}", self.qualified, self.query);
        let sql = statements.prepare(client, &sql).await?;
        client.execute(&sql, &refs(&ins)).await?;
        Ok(())
    }
}

/// `cols` quoted, for a column list.
pub(super) fn column_list(cols: &[String]) -> String {
    cols.iter()
        .map(|c| quote_ident(c))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `cols` as a select list of text values, each qualified by `prefix`.
fn as_text(cols: &[String], prefix: &str) -> String {
    cols.iter()
        .map(|c| format!("{prefix}{}::text", quote_ident(c)))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_composite_view_key_splits_back_into_its_columns() {
        let tenants = ["acme", "it's", r#"a "b", c"#, r#"["x"]"#, "日本", ""];
        let keys: Vec<String> = tenants
            .iter()
            .map(|t| view_key(&[Some(t.to_string()), Some("7".into())]).expect("a key"))
            .collect();
        assert_eq!(
            keys.iter().collect::<BTreeSet<_>>().len(),
            tenants.len(),
            "distinct tenants make distinct keys"
        );
        let columns = key_columns_of(&keys, 2).expect("split");
        assert_eq!(columns[0], tenants);
        assert_eq!(columns[1], vec!["7"; tenants.len()]);
        // A single-column key is the column's text itself.
        assert_eq!(view_key(&[Some("it's".into())]).as_deref(), Some("it's"));
        assert_eq!(
            key_columns_of(&["it's".into()], 1).expect("one"),
            [["it's"]]
        );
        // No view row has a NULL key column.
        assert_eq!(view_key(&[Some("acme".into()), None]), None);
        assert_eq!(view_key(&[None]), None);
        // A key of another arity is refused, naming it.
        let err = key_columns_of(&[r#"["a","1","2"]"#.into()], 2).expect_err("three columns");
        assert!(
            err.contains(r#"["a","1","2"]"#) && err.contains("3 columns"),
            "{err}"
        );
        assert!(key_columns_of(&["plain".into()], 2).is_err());
    }

    #[test]
    fn uuid_keys_parse_in_postgres_input_forms_and_nothing_else() {
        let want: Uuid = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
            .parse()
            .expect("canonical");
        assert_eq!(want.0[0], 0xa0);
        assert_eq!(want.0[15], 0x11);
        for form in [
            "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
            "a0eebc999c0b4ef8bb6d6bb9bd380a11",
        ] {
            assert_eq!(form.parse::<Uuid>(), Ok(want), "{form}");
        }
        for bad in [
            "",
            "a0eebc99",
            "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",
        ] {
            assert!(bad.parse::<Uuid>().is_err(), "{bad}");
        }
        let err = bind_one(&Type::UUID, "7").expect_err("not a uuid");
        assert!(err.contains("'7'") && err.contains("uuid"), "{err}");
        assert!(bind_many(
            &Type::UUID_ARRAY,
            &["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11".into()]
        )
        .is_ok());
        let err = key_type_supported(&Type::NUMERIC).expect_err("numeric keys");
        assert!(err.contains("numeric"), "{err}");
    }

    #[test]
    fn a_composite_delete_casts_each_key_array_to_its_column_type() {
        let key = ["tenant".to_string(), "order id".to_string()];
        let sql = delete_statement("rm.t", &key, &["text".into(), "bigint".into()]);
        assert_eq!(
            sql,
            r#"DELETE FROM rm.t WHERE ("tenant", "order id") IN (SELECT * FROM unnest($1::text[]::text[], $2::text[]::bigint[]))"#
        );
        assert_eq!(
            delete_statement("rm.t", &key[..1], &["text".into()]),
            r#"DELETE FROM rm.t WHERE "tenant" = ANY($1)"#
        );
    }
}
