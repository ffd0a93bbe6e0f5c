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
    key: &str,
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
    let key = quote_ident(key);
    let rest: Vec<&String> = columns.iter().filter(|c| **c != key).collect();
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
    // A newline before the closing parenthesis: the query may end in a
    // line comment.
    let sql = format!(
        "WITH fresh ({cols}) AS ({query}\n),
         gone AS (DELETE FROM {qualified} v
                  WHERE v.{key} = ANY(ARRAY(SELECT unnest($1) EXCEPT SELECT f.{key} FROM fresh f)))
         INSERT INTO {qualified} AS v ({cols}) SELECT {cols} FROM fresh
         ON CONFLICT ({key}) {on_conflict}"
    );
    match client.prepare(&sql).await {
        Ok(_) => Some(sql),
        Err(e) => {
            tracing::debug!(error = %crate::source::error_text(&e), "no one-statement recompute");
            None
        }
    }
}

/// How a changed source row maps to view keys.
#[derive(Debug, Clone)]
pub enum Mapping {
    /// The mirror row's column whose value is the view key.
    Column(String),
    /// SQL over the mirrors: `$1` is the changed row's key, each row of
    /// the result a view key (wrapped to return text).
    Query { sql: String, param: Type },
}

#[derive(Debug, Clone)]
pub struct View {
    pub name: String,
    pub qualified: String,
    pub key: String,
    query: String,
    /// The type of the query's `$1` (an array of keys).
    param: Type,
    delete_param: Type,
    /// The recompute as one statement that writes only what changed (see
    /// [`diff_statement`]); `None` where the target cannot take it, and the
    /// recompute deletes and reinserts every affected row instead.
    diff: Option<String>,
    /// Source table (`schema.table`) → mapping.
    pub sources: Vec<(String, Mapping)>,
}

/// A key value (as text) bound as the parameter type Postgres inferred.
fn bind_one(ty: &Type, text: &str) -> Result<Box<dyn ToSql + Sync + Send>, String> {
    let bad = || format!("key '{text}' is not a {}", ty.name());
    Ok(match *ty {
        Type::INT2 => Box::new(text.parse::<i16>().map_err(|_| bad())?),
        Type::INT4 => Box::new(text.parse::<i32>().map_err(|_| bad())?),
        Type::INT8 => Box::new(text.parse::<i64>().map_err(|_| bad())?),
        Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => Box::new(text.to_string()),
        _ => {
            return Err(format!(
                "keys of type {} are not supported (use integers or text)",
                ty.name()
            ))
        }
    })
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
        Type::TEXT_ARRAY | Type::VARCHAR_ARRAY | Type::BPCHAR_ARRAY | Type::NAME_ARRAY => {
            Box::new(keys.to_vec())
        }
        _ => {
            return Err(format!(
                "$1 of type {} is not supported (use an array of integers or text)",
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
        let key = rm
            .key
            .first()
            .cloned()
            .ok_or_else(|| format!("{}: needs one column", field("key")))?;
        if rm.key.len() > 1 {
            return Err(format!(
                "{}: composite view keys are not supported yet",
                field("key")
            ));
        }
        let stmt = client
            .prepare(&rm.query)
            .await
            .map_err(|e| format!("{}: {}", field("query"), crate::source::error_text(&e)))?;
        let param = match stmt.params() {
            [p] => p.clone(),
            other => {
                return Err(format!(
                    "{}: must take exactly one parameter ($1, the array of keys); it takes {}",
                    field("query"),
                    other.len()
                ))
            }
        };
        bind_many(&param, &[]).map_err(|e| format!("{}: {e}", field("query")))?;
        let statement = format!(
            "pgcdc_view_{}",
            name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        );
        client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema_q};
                 PREPARE {statement} AS {query};
                 CREATE TABLE IF NOT EXISTS {qualified} AS EXECUTE {statement}(NULL) WITH NO DATA;
                 DEALLOCATE {statement};",
                schema_q = quote_ident(&schema),
                query = rm.query,
            ))
            .await
            .map_err(|e| format!("{}: {}", field("table"), crate::source::error_text(&e)))?;
        let has_pk = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = $1::text::regclass AND indisprimary)",
                &[&qualified],
            )
            .await
            .map_err(|e| crate::source::error_text(&e))?
            .get::<_, bool>(0);
        if !has_pk {
            client
                .batch_execute(&format!(
                    "ALTER TABLE {qualified} ADD PRIMARY KEY ({})",
                    quote_ident(&key)
                ))
                .await
                .map_err(|e| format!("{}: {}", field("key"), crate::source::error_text(&e)))?;
        }
        let delete_param = client
            .prepare(&format!(
                "DELETE FROM {qualified} WHERE {} = ANY($1)",
                quote_ident(&key)
            ))
            .await
            .map_err(|e| format!("{}: {}", field("key"), crate::source::error_text(&e)))?
            .params()[0]
            .clone();
        let diff = diff_statement(client, &qualified, &key, &rm.query).await;
        if diff.is_none() {
            tracing::info!(read_model = %name, "the read model is recomputed by delete and insert (its columns cannot be compared, or its query does not fit one statement)");
        }
        let mut sources = Vec::new();
        for (i, s) in rm.sources.iter().enumerate() {
            let mapping = match (&s.key_columns, &s.affected_keys) {
                (Some(cols), _) => Mapping::Column(cols.first().cloned().unwrap_or_default()),
                (None, Some(sql)) => {
                    let wrapped = format!("SELECT k::text FROM ({sql}) AS q(k)");
                    let stmt = client.prepare(&wrapped).await.map_err(|e| {
                        format!(
                            "{}: {}",
                            field(&format!("sources[{i}].affected_keys")),
                            crate::source::error_text(&e)
                        )
                    })?;
                    let param = stmt.params().first().cloned().unwrap_or(Type::TEXT);
                    // Integers and text take "0"; other types are refused.
                    bind_one(&param, "0").map_err(|e| {
                        format!("{}: {e}", field(&format!("sources[{i}].affected_keys")))
                    })?;
                    Mapping::Query {
                        sql: wrapped,
                        param,
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
            delete_param,
            diff,
            sources,
        })
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
            Mapping::Column(col) if mirror.key_is(col) => out.extend(key.first().cloned()),
            Mapping::Column(col) => {
                let params: Vec<&(dyn ToSql + Sync)> =
                    key.iter().map(|k| k as &(dyn ToSql + Sync)).collect();
                let sql = format!(
                    "SELECT {}::text FROM {} WHERE {}",
                    quote_ident(col),
                    mirror.qualified,
                    mirror.key_where(1)
                );
                let sql = statements.prepare(client, &sql).await?;
                let rows = client.query(&sql, &params).await?;
                out.extend(rows.iter().filter_map(|r| r.get::<_, Option<String>>(0)));
            }
            Mapping::Query { sql, param } => {
                let Some(k) = key.first() else { return Ok(()) };
                let Ok(bound) = bind_one(param, k) else {
                    return Ok(());
                };
                let sql = statements.prepare(client, sql).await?;
                let rows = client
                    .query(&sql, &[bound.as_ref() as &(dyn ToSql + Sync)])
                    .await?;
                out.extend(rows.iter().filter_map(|r| r.get::<_, Option<String>>(0)));
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
            Mapping::Column(col) if mirror.key_is(col) => {
                out.extend(keys.iter().filter_map(|k| k.first().cloned()))
            }
            Mapping::Column(col) => {
                let arrays: Vec<Vec<String>> = (0..mirror.key.len())
                    .map(|n| keys.iter().map(|k| k[n].clone()).collect())
                    .collect();
                let params: Vec<&(dyn ToSql + Sync)> =
                    arrays.iter().map(|a| a as &(dyn ToSql + Sync)).collect();
                let sql = format!(
                    "SELECT m.{}::text FROM {} m WHERE {}",
                    quote_ident(col),
                    mirror.qualified,
                    mirror.keys_in(1)
                );
                let sql = statements.prepare(client, &sql).await?;
                let rows = client.query(&sql, &params).await?;
                out.extend(rows.iter().filter_map(|r| r.get::<_, Option<String>>(0)));
            }
            Mapping::Query { sql, param } => {
                let sql = statements.prepare(client, sql).await?;
                let bound: Vec<_> = keys
                    .iter()
                    .filter_map(|k| k.first())
                    .filter_map(|k| bind_one(param, k).ok())
                    .collect();
                let params: Vec<[&(dyn ToSql + Sync); 1]> = bound
                    .iter()
                    .map(|b| [b.as_ref() as &(dyn ToSql + Sync)])
                    .collect();
                let queries = params.iter().map(|p| client.query(&sql, p));
                for rows in futures_util::future::join_all(queries).await {
                    out.extend(rows?.iter().filter_map(|r| r.get::<_, Option<String>>(0)));
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
                &format!(
                    "SELECT {}::text FROM {}",
                    quote_ident(&self.key),
                    self.qualified
                ),
                &[],
            )
            .await?;
        out.extend(rows.iter().filter_map(|r| r.get::<_, Option<String>>(0)));
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
                Mapping::Column(col) => {
                    let rows = client
                        .query(
                            &format!(
                                "SELECT DISTINCT {c}::text FROM {} WHERE {c} IS NOT NULL",
                                m.qualified,
                                c = quote_ident(col)
                            ),
                            &[],
                        )
                        .await?;
                    out.extend(rows.iter().map(|r| r.get::<_, String>(0)));
                }
                Mapping::Query { sql, param } => {
                    let first = quote_ident(&m.columns[m.key[0]].name);
                    let keys: Vec<String> = client
                        .query(&format!("SELECT {first}::text FROM {}", m.qualified), &[])
                        .await?
                        .iter()
                        .map(|r| r.get(0))
                        .collect();
                    let stmt = client.prepare(sql).await?;
                    let found: Vec<Vec<tokio_postgres::Row>> =
                        stream::iter(keys.iter().filter_map(|k| bind_one(param, k).ok()))
                            .map(|bound| {
                                let stmt = &stmt;
                                async move {
                                    client
                                        .query(stmt, &[bound.as_ref() as &(dyn ToSql + Sync)])
                                        .await
                                }
                            })
                            // Pipelined on the one connection.
                            .buffer_unordered(64)
                            .try_collect()
                            .await?;
                    out.extend(
                        found
                            .iter()
                            .flatten()
                            .filter_map(|r| r.get::<_, Option<String>>(0)),
                    );
                }
            }
        }
        Ok(out)
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
        let key_error = |e: String| ViewError::Key(format!("read model {}: {e}", self.name));
        if let Some(diff) = &self.diff {
            let ins = bind_many(&self.param, &keys).map_err(key_error)?;
            let sql = statements.prepare(client, diff).await?;
            return match client
                .execute(&sql, &[ins.as_ref() as &(dyn ToSql + Sync)])
                .await
            {
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
        let del = bind_many(&self.delete_param, &keys).map_err(key_error)?;
        let sql = format!(
            "DELETE FROM {} WHERE {} = ANY($1)",
            self.qualified,
            quote_ident(&self.key)
        );
        let sql = statements.prepare(client, &sql).await?;
        client
            .execute(&sql, &[del.as_ref() as &(dyn ToSql + Sync)])
            .await?;
        let ins = bind_many(&self.param, &keys).map_err(key_error)?;
        let sql = format!("INSERT INTO {} {}", self.qualified, self.query);
        let sql = statements.prepare(client, &sql).await?;
        client
            .execute(&sql, &[ins.as_ref() as &(dyn ToSql + Sync)])
            .await?;
        Ok(())
    }
}
