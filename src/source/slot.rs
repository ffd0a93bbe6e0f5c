//! Replication slot and publication management.
//!
//! Guarantees: a publication is created only when missing, and only when
//! every relation it would cover has a replica identity (Postgres refuses
//! UPDATE and DELETE on a published one without), and never
//! altered behind the operator's back (a publication that misses a
//! captured table, or publishes a partitioned table's changes under its
//! partitions' names, is an error naming the fix); a slot is dropped only when
//! no connection holds it; an invalidated slot (`wal_status = lost`) is
//! always reported as an error with the recovery path, never skipped.

use std::fmt;

use serde::Serialize;
use tokio_postgres::Client;

use crate::config::{split_table, Config};

/// The one documented recovery from a lost or invalidated slot.
pub fn recovery_hint(slot: &str) -> String {
    format!(
        "recover with a new slot and a re-snapshot: `pgcdc slot drop --config FILE --yes` (drops '{slot}'), then start `pgcdc run` again; with snapshot mode `initial` it takes a fresh snapshot"
    )
}

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("postgres: {}", super::error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// An existing publication falls short ([`PublicationGaps::shortfall`]).
    #[error("{problem}; fix: {fix}")]
    PublicationShort { problem: String, fix: String },
    #[error("{tables}: no replica identity (no primary key under REPLICA IDENTITY DEFAULT, or NOTHING); once published, UPDATE and DELETE on them would fail at the source, so pgcdc did not create publication '{publication}'. fix: add a primary key, or ALTER TABLE ... REPLICA IDENTITY FULL (on each partition of a partitioned table, which its own setting does not reach; free for a table that is only ever inserted into)")]
    NoReplicaIdentity { publication: String, tables: String },
    #[error("slot '{slot}' is in use by process {pid}; stop that consumer first")]
    Active { slot: String, pid: i32 },
    #[error("slot '{0}' does not exist")]
    Missing(String),
    #[error("slot '{slot}' is gone, though pgcdc streamed from it (its initial snapshot completed at LSN {consistent_point}): it was dropped outside pgcdc, and changes after its last confirmed LSN may be missing from Kafka. {}", recovery_hint(.slot))]
    Vanished {
        slot: String,
        consistent_point: String,
    },
    #[error("slot '{slot}' is invalidated (wal_status=lost): the WAL it needed was removed. {}", recovery_hint(.slot))]
    Lost { slot: String },
    #[error("slot '{slot}' uses plugin '{plugin}' in database '{database}'; pgcdc needs a pgoutput slot in '{expected_database}'")]
    Foreign {
        slot: String,
        plugin: String,
        database: String,
        expected_database: String,
    },
}

impl SlotError {
    /// [`SlotError::Vanished`] when the pipeline's slot, missing now, had
    /// streamed before ([`crate::snapshot_marker::vanished`]) and snapshot
    /// mode `always` does not make a new slot expected anyway.
    pub fn vanished(
        config: &Config,
        markers: &[crate::snapshot_marker::Marker],
    ) -> Option<SlotError> {
        let src = &config.source;
        if src.snapshot.mode == crate::config::SnapshotMode::Always {
            return None;
        }
        let m = crate::snapshot_marker::vanished(markers, &src.slot)?;
        Some(SlotError::Vanished {
            slot: src.slot.clone(),
            consistent_point: m.consistent_point.unwrap_or_else(|| "?".into()),
        })
    }
}

/// What `pg_replication_slots` says about a slot, plus derived WAL figures.
#[derive(Debug, Clone, Serialize)]
pub struct SlotStatus {
    pub slot: String,
    pub plugin: String,
    pub database: String,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub restart_lsn: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes of WAL that can still be written before the slot is in danger
    /// of invalidation; `None` when `max_slot_wal_keep_size` is unlimited.
    pub safe_wal_size: Option<i64>,
    /// WAL kept for this slot (current LSN minus restart_lsn).
    pub retained_wal_bytes: Option<i64>,
    /// WAL not yet confirmed (current LSN minus confirmed_flush_lsn).
    pub lag_bytes: Option<i64>,
    /// The server's `max_slot_wal_keep_size` in bytes; `None` when
    /// unlimited (-1).
    pub max_slot_wal_keep_size: Option<i64>,
}

/// How close a slot is to being invalidated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RiskLevel {
    /// More than half of `max_slot_wal_keep_size` is left.
    Ok,
    /// Less than half is left, or Postgres already keeps WAL beyond the
    /// slot's reservation (`wal_status = extended`).
    Warning,
    /// Less than a tenth is left, or `wal_status = unreserved`: the next
    /// checkpoint may invalidate the slot.
    Critical,
    /// Invalidated: the WAL it needed is gone.
    Lost,
    /// `max_slot_wal_keep_size` is unlimited: never invalidated, but the
    /// WAL it retains is bounded only by the disk.
    Unbounded,
}

/// A slot's invalidation risk in plain words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Risk {
    pub level: RiskLevel,
    pub message: String,
}

impl SlotStatus {
    /// The slot's risk of invalidation, from `wal_status`, `safe_wal_size`
    /// and `max_slot_wal_keep_size`.
    pub fn risk(&self) -> Risk {
        let retained = self.retained_wal_bytes.unwrap_or(0);
        let status = self.wal_status.as_deref().unwrap_or("");
        if status == "lost" {
            return Risk {
                level: RiskLevel::Lost,
                message: format!(
                    "the slot is invalidated: the WAL it needed was removed. {}",
                    recovery_hint(&self.slot)
                ),
            };
        }
        let Some(limit) = self.max_slot_wal_keep_size.filter(|l| *l > 0) else {
            return Risk {
                level: RiskLevel::Unbounded,
                message: format!(
                    "max_slot_wal_keep_size is unlimited: Postgres never invalidates the slot, but keeps every WAL segment from restart_lsn ({} now) until the connector confirms it; a stopped connector lets it grow until the disk is full",
                    crate::retention::time::human_bytes(retained)
                ),
            };
        };
        let safe = self.safe_wal_size.unwrap_or(0);
        let left = safe as f64 / limit as f64;
        let level = if status == "unreserved" || left < 0.1 {
            RiskLevel::Critical
        } else if status == "extended" || left < 0.5 {
            RiskLevel::Warning
        } else {
            RiskLevel::Ok
        };
        Risk {
            level,
            message: format!(
                "the slot will be invalidated after about {} more bytes of WAL ({}% of max_slot_wal_keep_size = {} left; it retains {})",
                safe.max(0),
                (left.max(0.0) * 100.0).round() as i64,
                crate::retention::time::human_bytes(limit),
                crate::retention::time::human_bytes(retained)
            ),
        }
    }
}

impl fmt::Display for SlotStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let num = |v: Option<i64>| v.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
        writeln!(f, "slot                 {}", self.slot)?;
        writeln!(f, "plugin               {}", self.plugin)?;
        writeln!(f, "database             {}", self.database)?;
        match self.active_pid {
            Some(pid) if self.active => writeln!(f, "active               yes (pid {pid})")?,
            _ => writeln!(f, "active               no")?,
        }
        writeln!(f, "restart_lsn          {}", opt(&self.restart_lsn))?;
        writeln!(f, "confirmed_flush_lsn  {}", opt(&self.confirmed_flush_lsn))?;
        writeln!(f, "wal_status           {}", opt(&self.wal_status))?;
        writeln!(
            f,
            "safe_wal_size        {}",
            self.safe_wal_size
                .map(|n| n.to_string())
                .unwrap_or_else(|| "unlimited (max_slot_wal_keep_size = -1)".into())
        )?;
        writeln!(f, "retained_wal_bytes   {}", num(self.retained_wal_bytes))?;
        writeln!(f, "lag_bytes            {}", num(self.lag_bytes))?;
        let risk = self.risk();
        write!(f, "risk                 {:?}: {}", risk.level, risk.message)
    }
}

/// Reads a slot's status; `None` when it does not exist.
pub async fn status(
    client: &Client,
    slot: &str,
) -> Result<Option<SlotStatus>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT slot_name::text, coalesce(plugin::text, ''), coalesce(database::text, ''),
                    active, active_pid, restart_lsn::text, confirmed_flush_lsn::text,
                    wal_status, safe_wal_size,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
                    pg_size_bytes(current_setting('max_slot_wal_keep_size'))
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotStatus {
        slot: r.get(0),
        plugin: r.get(1),
        database: r.get(2),
        active: r.get(3),
        active_pid: r.get(4),
        restart_lsn: r.get(5),
        confirmed_flush_lsn: r.get(6),
        wal_status: r.get(7),
        safe_wal_size: r.get(8),
        retained_wal_bytes: r.get(9),
        lag_bytes: r.get(10),
        max_slot_wal_keep_size: Some(r.get::<_, i64>(11)).filter(|n| *n > 0),
    }))
}

/// Checks that an existing slot is usable by this pipeline.
pub async fn verify_usable(client: &Client, config: &Config) -> Result<SlotStatus, SlotError> {
    let slot = &config.source.slot;
    let status = status(client, slot)
        .await?
        .ok_or_else(|| SlotError::Missing(slot.clone()))?;
    let current_db: String = client
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    if status.plugin != "pgoutput" || status.database != current_db {
        return Err(SlotError::Foreign {
            slot: slot.clone(),
            plugin: status.plugin,
            database: status.database,
            expected_database: current_db,
        });
    }
    if status.wal_status.as_deref() == Some("lost") {
        return Err(SlotError::Lost { slot: slot.clone() });
    }
    Ok(status)
}

/// Drops the slot; refuses while a connection holds it.
pub async fn drop(client: &Client, slot: &str) -> Result<(), SlotError> {
    match status(client, slot).await? {
        None => Err(SlotError::Missing(slot.to_string())),
        Some(s) if s.active => Err(SlotError::Active {
            slot: slot.to_string(),
            pid: s.active_pid.unwrap_or_default(),
        }),
        Some(_) => {
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await?;
            Ok(())
        }
    }
}

/// Creates the publication for the captured tables when it does not exist;
/// when it exists, verifies that it covers them. Returns whether it was
/// created.
pub async fn ensure_publication(client: &Client, config: &Config) -> Result<bool, SlotError> {
    let src = &config.source;
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&src.publication],
        )
        .await?
        .is_some();
    if !exists {
        let bare = super::catalog::without_replica_identity(client, &src.tables).await?;
        if !bare.is_empty() {
            return Err(SlotError::NoReplicaIdentity {
                publication: src.publication.clone(),
                tables: bare
                    .into_iter()
                    .map(|(t, _)| t)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let tables: Vec<String> = src
            .tables
            .iter()
            .filter_map(|t| split_table(t))
            .map(|(s, t)| format!("{}.{}", quote_ident(&s), quote_ident(&t)))
            .collect();
        // Changes to a partitioned table's rows go out under its own name,
        // to its topic, rather than under a partition's (13 and later).
        let options = if super::catalog::server_version(client).await? >= 130_000 {
            " WITH (publish_via_partition_root = true)"
        } else {
            ""
        };
        client
            .batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLE {}{options}",
                quote_ident(&src.publication),
                tables.join(", ")
            ))
            .await?;
        tracing::info!(publication = %src.publication, tables = src.tables.len(), "publication created");
        return Ok(true);
    }
    match publication_gaps(client, config)
        .await?
        .shortfall(&src.publication)
    {
        Some((problem, fix)) => Err(SlotError::PublicationShort { problem, fix }),
        None => Ok(false),
    }
}

/// Where an existing publication falls short of the captured tables.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PublicationGaps {
    /// Captured tables it does not cover.
    pub missing: Vec<String>,
    /// Captured partitioned tables whose changes it publishes under their
    /// partitions' names (`publish_via_partition_root` off): their
    /// streamed changes would go to one topic per partition, apart from
    /// the table's snapshot. Not in `missing`, whose check needs the fix
    /// first (the publication lists the partitions, not the table).
    pub by_partition: Vec<String>,
    /// Captured tables whose column list (Postgres 15) leaves out columns
    /// that `source.columns` does not: the stream would lack them while a
    /// snapshot reads them.
    pub partial: Vec<PartialTable>,
}

/// A captured table a publication's column list covers in part.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PartialTable {
    pub table: String,
    /// The columns outside the list that `exclude` does not name.
    pub unlisted: Vec<String>,
    /// The `exclude` list that would match: the configured one and those.
    pub exclude: Vec<String>,
}

impl PublicationGaps {
    /// What is wrong with `publication` and the statement that fixes it,
    /// worded once for `pgcdc run` and `pgcdc check`; `None` when nothing
    /// is.
    pub fn shortfall(&self, publication: &str) -> Option<(String, String)> {
        let sql_names = |tables: &[String]| sql_tables(tables).join(", ");
        if !self.by_partition.is_empty() {
            Some((
                format!(
                    "publication '{publication}' publishes changes to the partitions of {} under the partitions' own names, to topics no snapshot fills",
                    sql_names(&self.by_partition)
                ),
                format!("ALTER PUBLICATION {publication} SET (publish_via_partition_root = true)"),
            ))
        } else if !self.missing.is_empty() {
            Some((
                format!(
                    "publication '{publication}' does not cover {}",
                    self.missing.join(", ")
                ),
                format!(
                    "ALTER PUBLICATION {publication} ADD TABLE {}",
                    sql_names(&self.missing)
                ),
            ))
        } else if let Some(p) = self.partial.first() {
            // TOML basic strings, which a column name may need escaped.
            let quoted: Vec<String> = p
                .exclude
                .iter()
                .map(|c| format!("\"{}\"", c.replace('\\', "\\\\").replace('"', "\\\"")))
                .collect();
            let more = match self.partial.len() {
                1 => String::new(),
                n => format!(" ({} more tables likewise)", n - 1),
            };
            Some((
                format!(
                    "publication '{publication}' publishes only some columns of {} (a column list), without {}, which a snapshot would still read{more}",
                    p.table,
                    p.unlisted.join(", ")
                ),
                format!(
                    "leave them out: source.columns.\"{}\".exclude = [{}] (or drop the publication's column list)",
                    p.table,
                    quoted.join(", ")
                ),
            ))
        } else {
            None
        }
    }
}

/// The configured publication's [`PublicationGaps`].
pub async fn publication_gaps(
    client: &Client,
    config: &Config,
) -> Result<PublicationGaps, tokio_postgres::Error> {
    let src = &config.source;
    let covered: Vec<String> = client
        .query(
            "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = $1",
            &[&src.publication],
        )
        .await?
        .iter()
        .map(|r| crate::config::table_name(r.get(0), r.get(1)))
        .collect();
    // `pubviaroot` exists from 13 on, as do partitioned tables in a
    // publication; read through jsonb so that 12 answers too (NULL).
    let names = sql_tables(&src.tables);
    let by_partition: Vec<String> = client
        .query(
            "SELECT t.n FROM unnest($2::text[]) WITH ORDINALITY AS t(name, n)
             JOIN pg_class c ON c.oid = to_regclass(t.name)
             WHERE c.relkind = 'p'
               AND (SELECT to_jsonb(p) ->> 'pubviaroot' FROM pg_publication p
                    WHERE p.pubname = $1) = 'false'
             ORDER BY t.n",
            &[&src.publication, &names],
        )
        .await?
        .iter()
        .map(|r| super::catalog::by_ordinal(&src.tables, r.get(0)))
        .collect();
    let missing = src
        .tables
        .iter()
        .filter(|t| !covered.contains(t) && !by_partition.contains(t))
        .cloned()
        .collect();
    // Column lists and `attnames` exist from 15 on.
    let mut partial: Vec<PartialTable> = Vec::new();
    if super::catalog::server_version(client).await? >= 150_000 {
        // Joined by name, and only the captured tables: a cast of every
        // listed name would need USAGE on schemas pgcdc does not read.
        for row in client
            .query(
                "SELECT pt.schemaname::text, pt.tablename::text, a.attname::text
                 FROM pg_publication_tables pt
                 JOIN pg_namespace n ON n.nspname = pt.schemaname
                 JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
                 JOIN pg_attribute a
                   ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
                 WHERE pt.pubname = $1
                   AND c.oid = ANY (SELECT to_regclass(t)::oid FROM unnest($2::text[]) t)
                   AND NOT (a.attname = ANY (pt.attnames))
                 ORDER BY 1, 2, a.attnum",
                &[&src.publication, &names],
            )
            .await?
        {
            let table = crate::config::table_name(row.get(0), row.get(1));
            let column: String = row.get(2);
            let excluded = config.excluded_columns(&table);
            if excluded.contains(&column) {
                continue;
            }
            match partial.last_mut() {
                Some(p) if p.table == table => {
                    p.unlisted.push(column.clone());
                    p.exclude.push(column);
                }
                _ => partial.push(PartialTable {
                    table,
                    unlisted: vec![column.clone()],
                    exclude: excluded.iter().cloned().chain([column]).collect(),
                }),
            }
        }
    }
    Ok(PublicationGaps {
        missing,
        by_partition,
        partial,
    })
}

/// [`sql_table`] of each.
pub fn sql_tables(tables: &[String]) -> Vec<String> {
    tables.iter().map(|t| sql_table(t)).collect()
}

/// A `source.tables` entry as an operator would type it in SQL, quoted
/// only where needed: `public.orders`, `public."Orders"`, `"user".t`. For
/// the fixes we suggest; statements pgcdc runs quote every name.
pub fn sql_table(table: &str) -> String {
    // After the dot any keyword is a valid name; before it, not these.
    const RESERVED: &[&str] = &[
        "all",
        "analyse",
        "analyze",
        "and",
        "any",
        "array",
        "as",
        "asc",
        "asymmetric",
        "authorization",
        "binary",
        "both",
        "case",
        "cast",
        "check",
        "collate",
        "collation",
        "column",
        "concurrently",
        "constraint",
        "create",
        "cross",
        "current_catalog",
        "current_date",
        "current_role",
        "current_schema",
        "current_time",
        "current_timestamp",
        "current_user",
        "default",
        "deferrable",
        "desc",
        "distinct",
        "do",
        "else",
        "end",
        "except",
        "false",
        "fetch",
        "for",
        "foreign",
        "freeze",
        "from",
        "full",
        "grant",
        "group",
        "having",
        "ilike",
        "in",
        "initially",
        "inner",
        "intersect",
        "into",
        "is",
        "isnull",
        "join",
        "lateral",
        "leading",
        "left",
        "like",
        "limit",
        "localtime",
        "localtimestamp",
        "natural",
        "not",
        "notnull",
        "null",
        "offset",
        "on",
        "only",
        "or",
        "order",
        "outer",
        "overlaps",
        "placing",
        "primary",
        "references",
        "returning",
        "right",
        "select",
        "session_user",
        "similar",
        "some",
        "symmetric",
        "system_user",
        "table",
        "tablesample",
        "then",
        "to",
        "trailing",
        "true",
        "union",
        "unique",
        "user",
        "using",
        "variadic",
        "verbose",
        "when",
        "where",
        "window",
        "with",
    ];
    let plain = |p: &str| {
        p.len() <= 63
            && p.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    };
    match split_table(table) {
        Some((s, t)) => {
            let schema = if plain(&s) && !RESERVED.contains(&s.as_str()) {
                s
            } else {
                quote_ident(&s)
            };
            let table = if plain(&t) { t } else { quote_ident(&t) };
            format!("{schema}.{table}")
        }
        None => table.to_string(),
    }
}

/// Quotes a Postgres identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_column_list_names_the_whole_exclude_list_to_set() {
        let gaps = PublicationGaps {
            partial: vec![
                PartialTable {
                    table: "public.cards".into(),
                    unlisted: vec!["pan".into(), "say \"hi\"".into()],
                    exclude: vec!["ssn".into(), "pan".into(), "say \"hi\"".into()],
                },
                PartialTable::default(),
            ],
            ..PublicationGaps::default()
        };
        let (problem, fix) = gaps.shortfall("p").expect("a gap");
        assert_eq!(
            problem,
            "publication 'p' publishes only some columns of public.cards (a column list), without pan, say \"hi\", which a snapshot would still read (1 more tables likewise)"
        );
        assert_eq!(
            fix,
            r#"leave them out: source.columns."public.cards".exclude = ["ssn", "pan", "say \"hi\""] (or drop the publication's column list)"#
        );
        // The fix parses as TOML to the list it names.
        let toml: toml::Value = toml::from_str(&format!(
            "exclude = {}",
            &fix[fix.find('[').unwrap_or(0)..fix.find(']').map_or(0, |i| i + 1)]
        ))
        .expect("toml");
        assert_eq!(toml["exclude"].as_array().map(Vec::len), Some(3));
        assert_eq!(PublicationGaps::default().shortfall("p"), None);
    }

    #[test]
    fn suggested_sql_quotes_only_what_needs_it() {
        assert_eq!(sql_table("public.orders"), "public.orders");
        assert_eq!(sql_table("public.Orders"), "public.\"Orders\"");
        assert_eq!(sql_table("public.user"), "public.user");
        assert_eq!(sql_table("user.orders"), "\"user\".orders");
        assert_eq!(
            sql_table(r#""Sales ""Dept""".Order Items"#),
            r#""Sales ""Dept"""."Order Items""#
        );
    }

    #[test]
    fn identifiers_are_quoted_with_embedded_quotes_doubled() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }

    fn status(wal_status: &str, safe: Option<i64>, limit: Option<i64>) -> SlotStatus {
        SlotStatus {
            slot: "s1".into(),
            plugin: "pgoutput".into(),
            database: "db".into(),
            active: false,
            active_pid: None,
            restart_lsn: Some("0/1000000".into()),
            confirmed_flush_lsn: Some("0/1000000".into()),
            wal_status: Some(wal_status.into()),
            safe_wal_size: safe,
            retained_wal_bytes: Some(1 << 20),
            lag_bytes: Some(0),
            max_slot_wal_keep_size: limit,
        }
    }

    #[test]
    fn risk_follows_what_is_left_of_the_limit() {
        let gib = 1i64 << 30;
        let r = status("reserved", Some(gib * 9 / 10), Some(gib)).risk();
        assert_eq!(r.level, RiskLevel::Ok);
        assert!(
            r.message.contains(&format!(
                "invalidated after about {} more bytes",
                gib * 9 / 10
            )),
            "{}",
            r.message
        );
        assert_eq!(
            status("reserved", Some(gib / 3), Some(gib)).risk().level,
            RiskLevel::Warning
        );
        assert_eq!(
            status("extended", Some(gib * 9 / 10), Some(gib))
                .risk()
                .level,
            RiskLevel::Warning
        );
        assert_eq!(
            status("reserved", Some(gib / 20), Some(gib)).risk().level,
            RiskLevel::Critical
        );
        assert_eq!(
            status("unreserved", Some(-5), Some(gib)).risk().level,
            RiskLevel::Critical
        );
        assert_eq!(
            status("reserved", None, None).risk().level,
            RiskLevel::Unbounded
        );
        let lost = status("lost", None, Some(gib)).risk();
        assert_eq!(lost.level, RiskLevel::Lost);
        assert!(lost.message.contains("pgcdc slot drop"));
    }

    #[test]
    fn lost_slot_error_names_the_recovery() {
        let e = SlotError::Lost { slot: "s1".into() };
        let text = e.to_string();
        assert!(text.contains("wal_status=lost"), "{text}");
        assert!(text.contains("pgcdc slot drop"), "{text}");
    }
}
