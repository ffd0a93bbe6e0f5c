//! `pgcdc retention`: how far back each read model can be rebuilt, from
//! what the Kafka logs still hold and from the slot's WAL.
//!
//! Guarantees:
//! - **Only reads.** The report fetches watermarks, one record per
//!   partition (for its timestamp), topic configs, the snapshot markers
//!   and `pg_replication_slots`; it writes nothing anywhere.
//! - **No optimism.** A read model is called rebuildable only when every
//!   source topic still holds a completed snapshot's first offset in every
//!   partition ([`reach`]); otherwise the gap is named with its offsets
//!   and times. A topic the broker does not describe counts as not
//!   rebuildable, never as fine.
//! - **A stable JSON shape.** `--json` prints [`Report`], described by
//!   [`JSON_SCHEMA`] (`schema_version` 1). Fields are only ever added.
//!
//! ```text
//!  source topics ──► watermarks, first record's timestamp, cleanup.policy, retention.*
//!  <prefix>.snapshots ──► completed markers (start offsets) ──► reach per topic ──► weakest per read model
//!  pg_replication_slots ──► restart/confirmed LSN, retained WAL, wal_status, safe_wal_size ──► risk
//! ```

pub mod reach;
pub mod time;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::Serialize;

use crate::config::{Config, KafkaConfig};
use crate::observe;
use crate::sink::CreateClient as _;
use crate::snapshot_marker::{self, Marker};
use crate::source::slot::{self, Risk, RiskLevel};
use crate::{sink, source};
use reach::{PartitionRange, Reach, ReachKind, Requirement, SnapshotRef, TopicConfig, Verdict};
use time::{human_bytes, human_span, rfc3339};

/// The JSON Schema (draft 2020-12) of `pgcdc retention --json`.
pub const JSON_SCHEMA: &str = include_str!("report.schema.json");
/// Bumped only if a field changes meaning or disappears.
pub const SCHEMA_VERSION: u32 = 1;
/// How long fetching Kafka metadata, watermarks and records may take.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(15);

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema_version: u32,
    pub pipeline: String,
    pub generated_at_ms: i64,
    pub generated_at: String,
    pub read_models: Vec<ReadModelReport>,
    pub topics: Vec<TopicReport>,
    pub slot: SlotReport,
}

/// One read model: its reach and, when one is set, the requirement's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct ReadModelReport {
    pub name: String,
    pub table: String,
    /// Its source topics (details under [`Report::topics`]).
    pub topics: Vec<String>,
    pub reach: Reach,
    pub requirement: Option<Verdict>,
}

/// One changelog topic.
#[derive(Debug, Clone, Serialize)]
pub struct TopicReport {
    pub topic: String,
    pub table: String,
    /// Whether the broker knows the topic (`false`: nothing is retained).
    pub exists: bool,
    pub config: TopicConfig,
    pub partitions: Vec<PartitionRange>,
    pub begins_with_complete_snapshot: bool,
    /// The snapshot the reach rests on, or the newest one when none is
    /// fully retained.
    pub snapshot: Option<SnapshotRef>,
    pub reach: Reach,
}

/// The slot side: what Postgres keeps for the pipeline, and the risk of
/// losing it.
#[derive(Debug, Clone, Serialize)]
pub struct SlotReport {
    pub slot: String,
    pub exists: bool,
    pub active: Option<bool>,
    pub restart_lsn: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    pub retained_wal_bytes: Option<i64>,
    pub lag_bytes: Option<i64>,
    pub wal_status: Option<String>,
    pub safe_wal_size: Option<i64>,
    /// Bytes; `None` when unlimited.
    pub max_slot_wal_keep_size: Option<i64>,
    /// `None` only when the source could not be asked (see `error`).
    pub risk: Option<Risk>,
    pub error: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error("{0}")]
    Usage(String),
    #[error("kafka: {0}")]
    Kafka(String),
}

/// The read models to report: all, or the one named.
fn selected<'a>(
    config: &'a Config,
    only: Option<&str>,
) -> Result<Vec<(&'a String, &'a crate::config::ReadModelConfig)>, RetentionError> {
    match only {
        None => Ok(config.read_models.iter().collect()),
        Some(name) => config
            .read_model(name)
            .map(|rm| vec![rm])
            .map_err(RetentionError::Usage),
    }
}

/// Builds the report. `require` overrides the configured requirements
/// (`read_models.NAME.require_reach`).
pub async fn gather(
    config: &Config,
    only: Option<&str>,
    require: Option<&Requirement>,
) -> Result<Report, RetentionError> {
    let models = selected(config, only)?;
    if require.is_some() && models.is_empty() {
        return Err(RetentionError::Usage(
            "--require: the config declares no read models".into(),
        ));
    }
    // The topics of the selected read models, or of every captured table.
    let mut tables: Vec<String> = Vec::new();
    for (_, rm) in &models {
        for s in &rm.sources {
            if !tables.contains(&s.table) {
                tables.push(s.table.clone());
            }
        }
    }
    if only.is_none() {
        for t in config.changelog_tables() {
            if !tables.contains(t) {
                tables.push(t.clone());
            }
        }
    }
    let names: Vec<String> = tables.iter().map(|t| config.topic_for(t)).collect();
    let now_ms = crate::connector::now_ms();
    let (marks, configs) = tokio::try_join!(
        async {
            sink::watermarks(&config.kafka, &names)
                .await
                .map_err(RetentionError::Kafka)
        },
        topic_configs(&config.kafka, &names)
    )?;
    let markers_topic = snapshot_marker::topic(config);
    // A marker topic not created yet holds none; an unreadable one is an
    // error, never "no snapshot".
    let markers: Vec<Marker> = snapshot_marker::all(&config.kafka, &markers_topic)
        .await
        .map_err(RetentionError::Kafka)?
        .into_iter()
        .filter(|m| m.slot == config.source.slot)
        .collect();

    // One read for every timestamp wanted: each partition's first record,
    // and the records each candidate snapshot starts at (for when
    // retention will delete them). Only offsets the log holds a record at:
    // asking for others would wait for a record that never comes.
    let held = |t: &str, p: i32, o: i64| {
        marks
            .get(t)
            .and_then(|parts| parts.get(&p))
            .is_some_and(|(low, high)| *low <= o && o < *high)
    };
    let mut wanted = Vec::new();
    for (t, parts) in &marks {
        for (p, (low, _)) in parts {
            if held(t, *p, *low) {
                wanted.push((t.clone(), *p, *low));
            }
        }
    }
    for m in markers
        .iter()
        .filter(|m| m.phase == snapshot_marker::Phase::Completed)
    {
        for (t, parts) in m.start_offsets.iter().filter(|(t, _)| names.contains(t)) {
            for (p, o) in parts.iter().filter(|(p, o)| held(t, **p, **o)) {
                wanted.push((t.clone(), *p, *o));
            }
        }
    }
    let ts = record_timestamps(&config.kafka, wanted).await?;
    let ranges: HashMap<String, Vec<PartitionRange>> = marks
        .iter()
        .map(|(t, parts)| {
            let list = parts
                .iter()
                .map(|(p, (low, high))| {
                    PartitionRange::new(*p, *low, *high, ts.get(&(t.clone(), *p, *low)).copied())
                })
                .collect();
            (t.clone(), list)
        })
        .collect();

    let mut topics = Vec::new();
    for (table, name) in tables.iter().zip(&names) {
        let parts = ranges.get(name).cloned();
        let exists = parts.is_some();
        let parts = parts.unwrap_or_default();
        let tc = configs.get(name).cloned().unwrap_or_default();
        let mut r = reach::topic_reach(
            name,
            table,
            &markers_topic,
            &parts,
            &tc,
            &markers,
            &|p, o| ts.get(&(name.clone(), p, o)).copied(),
        );
        if !exists {
            r.begins_with_complete_snapshot = false;
            r.reach = Reach::none(
                format!("{name} does not exist on the broker: nothing is retained"),
                vec![reach::Gap::named(
                    name,
                    format!("{name} does not exist on the broker"),
                )],
            );
        }
        topics.push(TopicReport {
            topic: name.clone(),
            table: table.clone(),
            exists,
            config: tc,
            partitions: parts,
            begins_with_complete_snapshot: r.begins_with_complete_snapshot,
            snapshot: r.snapshot,
            reach: r.reach,
        });
    }

    let mut read_models = Vec::new();
    for (name, rm) in models {
        let mine: Vec<&TopicReport> = topics
            .iter()
            .filter(|t| rm.sources.iter().any(|s| s.table == t.table))
            .collect();
        let pairs: Vec<(&str, &Reach)> =
            mine.iter().map(|t| (t.topic.as_str(), &t.reach)).collect();
        let reach = reach::combine(name, &pairs);
        let requirement = match (require, &rm.require_reach) {
            (Some(r), _) => Some(r.clone()),
            (None, Some(text)) => Requirement::parse(text).ok(),
            (None, None) => None,
        }
        .map(|r| reach::judge(&r, &reach, now_ms));
        read_models.push(ReadModelReport {
            name: name.clone(),
            table: rm.table.clone(),
            topics: mine.iter().map(|t| t.topic.clone()).collect(),
            reach,
            requirement,
        });
    }

    Ok(Report {
        schema_version: SCHEMA_VERSION,
        pipeline: config.name.clone(),
        generated_at_ms: now_ms,
        generated_at: rfc3339(now_ms),
        read_models,
        topics,
        slot: slot_report(config).await,
    })
}

async fn slot_report(config: &Config) -> SlotReport {
    let name = config.source.slot.clone();
    let unknown = |error: String| SlotReport {
        slot: name.clone(),
        exists: false,
        active: None,
        restart_lsn: None,
        confirmed_flush_lsn: None,
        retained_wal_bytes: None,
        lag_bytes: None,
        wal_status: None,
        safe_wal_size: None,
        max_slot_wal_keep_size: None,
        risk: None,
        error: Some(error),
    };
    let client = match source::connect(&config.source.url).await {
        Ok(c) => c,
        Err(e) => {
            return unknown(format!(
                "cannot connect to {}: {}",
                config.source.url.redacted(),
                source::error_text(&e)
            ))
        }
    };
    match slot::status(&client, &name).await {
        Err(e) => unknown(source::error_text(&e)),
        Ok(None) => SlotReport {
            risk: Some(Risk {
                level: RiskLevel::Lost,
                message: format!(
                    "slot '{name}' does not exist: no WAL is kept for this pipeline, and changes made before `pgcdc run` creates it (with a new snapshot) are not captured"
                ),
            }),
            error: None,
            ..unknown(String::new())
        },
        Ok(Some(s)) => SlotReport {
            risk: Some(s.risk()),
            slot: s.slot,
            exists: true,
            active: Some(s.active),
            restart_lsn: s.restart_lsn,
            confirmed_flush_lsn: s.confirmed_flush_lsn,
            retained_wal_bytes: s.retained_wal_bytes,
            lag_bytes: s.lag_bytes,
            wal_status: s.wal_status,
            safe_wal_size: s.safe_wal_size,
            max_slot_wal_keep_size: s.max_slot_wal_keep_size,
            error: None,
        },
    }
}

/// The timestamp of the first record at or after each `(topic, partition,
/// offset)`; absent where none arrives in time.
async fn record_timestamps(
    kafka: &KafkaConfig,
    wanted: Vec<(String, i32, i64)>,
) -> Result<HashMap<(String, i32, i64), i64>, RetentionError> {
    let mut out = HashMap::new();
    // One offset per partition per round.
    let mut per: BTreeMap<(String, i32), std::collections::BTreeSet<i64>> = BTreeMap::new();
    for (t, p, o) in wanted {
        per.entry((t, p)).or_default().insert(o);
    }
    let depth = per.values().map(|o| o.len()).max().unwrap_or(0);
    let rounds: Vec<Vec<(String, i32, i64)>> = (0..depth)
        .map(|i| {
            per.iter()
                .filter_map(|((t, p), offsets)| offsets.iter().nth(i).map(|o| (t.clone(), *p, *o)))
                .collect()
        })
        .collect();
    for round in rounds {
        let k = kafka.clone();
        let found = tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer<sink::Quiet> = sink::client_config(&k)
                .set("group.id", "pgcdc-retention")
                .set("enable.auto.commit", "false")
                .set("isolation.level", "read_committed")
                .client()
                .map_err(|e| e.to_string())?;
            let mut tpl = TopicPartitionList::new();
            for (t, p, o) in &round {
                tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                    .map_err(|e| e.to_string())?;
            }
            consumer.assign(&tpl).map_err(|e| e.to_string())?;
            let mut found: HashMap<(String, i32, i64), i64> = HashMap::new();
            let deadline = std::time::Instant::now() + KAFKA_TIMEOUT;
            while found.len() < round.len() && std::time::Instant::now() < deadline {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                    let key = round
                        .iter()
                        .find(|(t, p, _)| t == m.topic() && *p == m.partition())
                        .cloned();
                    if let (Some(key), Some(ts)) = (key, m.timestamp().to_millis()) {
                        found.entry(key).or_insert(ts);
                    }
                }
            }
            Ok::<_, String>(found)
        })
        .await
        .map_err(|e| RetentionError::Kafka(e.to_string()))?
        .map_err(RetentionError::Kafka)?;
        out.extend(found);
    }
    Ok(out)
}

/// `cleanup.policy`, `retention.ms`, `retention.bytes` and
/// `delete.retention.ms` of each topic the broker describes.
async fn topic_configs(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<HashMap<String, TopicConfig>, RetentionError> {
    let admin: AdminClient<sink::Quiet> = sink::client_config(kafka)
        .client()
        .map_err(|e| RetentionError::Kafka(e.to_string()))?;
    let specs: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let opts = AdminOptions::new().request_timeout(Some(KAFKA_TIMEOUT));
    let results = admin
        .describe_configs(specs.iter(), &opts)
        .await
        .map_err(|e| RetentionError::Kafka(format!("describe configs: {e}")))?;
    let mut out = HashMap::new();
    for (topic, result) in topics.iter().zip(results) {
        // A topic that does not exist yet has no configs; reported as such.
        let Ok(resource) = result else { continue };
        let text = |k: &str| resource.get(k).and_then(|e| e.value.clone());
        let num = |k: &str| text(k).and_then(|v| v.parse::<i64>().ok());
        out.insert(
            topic.clone(),
            TopicConfig {
                cleanup_policy: text("cleanup.policy"),
                retention_ms: num("retention.ms"),
                retention_bytes: num("retention.bytes"),
                delete_retention_ms: num("delete.retention.ms"),
            },
        );
    }
    Ok(out)
}

impl Report {
    /// Whether every requirement in the report is met.
    pub fn requirements_met(&self) -> bool {
        self.read_models
            .iter()
            .all(|rm| rm.requirement.as_ref().is_none_or(|v| v.met))
    }

    /// The report as a table for people.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "pipeline {} · report of {}",
            self.pipeline, self.generated_at
        );
        if self.read_models.is_empty() {
            let _ = writeln!(out, "\nno read models declared; the topics:");
        }
        for rm in &self.read_models {
            let _ = writeln!(out, "\nread model {} ({})", rm.name, rm.table);
            let _ = writeln!(out, "  reach        {}", reach_line(&rm.reach));
            for g in &rm.reach.gaps {
                let _ = writeln!(out, "  gap          {}", gap_line(g));
            }
            if let Some(v) = &rm.requirement {
                match &v.shortfall {
                    None => {
                        let _ = writeln!(out, "  requirement  {}: met", v.requirement);
                    }
                    Some(s) => {
                        let _ = writeln!(out, "  requirement  {}: NOT MET: {s}", v.requirement);
                    }
                }
            }
            let _ = writeln!(out, "  topics       {}", rm.topics.join(", "));
        }
        for t in &self.topics {
            let _ = writeln!(out, "\ntopic {} (table {})", t.topic, t.table);
            let c = &t.config;
            let _ = writeln!(
                out,
                "  config       cleanup.policy={} retention.ms={} retention.bytes={} delete.retention.ms={}",
                c.cleanup_policy.as_deref().unwrap_or("(not reported)"),
                ms_text(c.retention_ms),
                c.retention_bytes
                    .map(|b| if b < 0 { "-1 (unlimited)".to_string() } else { human_bytes(b) })
                    .unwrap_or_else(|| "(not reported)".into()),
                ms_text(c.delete_retention_ms),
            );
            match &t.snapshot {
                Some(s) => {
                    let _ = writeln!(
                        out,
                        "  snapshot     {} snapshot{} of {} (completed {}, consistent point {}): {}",
                        s.kind,
                        s.id.as_deref().map(|i| format!(" {i}")).unwrap_or_default(),
                        s.since,
                        s.completed_at,
                        s.consistent_point.as_deref().unwrap_or("-"),
                        if t.begins_with_complete_snapshot {
                            "the retained log begins with it"
                        } else {
                            "NOT fully retained"
                        }
                    );
                }
                None => {
                    let _ = writeln!(out, "  snapshot     none recorded");
                }
            }
            let _ = writeln!(out, "  reach        {}", reach_line(&t.reach));
            if t.partitions.is_empty() {
                let _ = writeln!(out, "  partitions   none (the topic does not exist)");
                continue;
            }
            let _ = writeln!(
                out,
                "  {:<10} {:>14} {:>14}  earliest record",
                "partition", "earliest", "latest"
            );
            for p in &t.partitions {
                let _ = writeln!(
                    out,
                    "  {:<10} {:>14} {:>14}  {}",
                    p.partition,
                    p.earliest_offset,
                    p.latest_offset,
                    p.earliest_timestamp.as_deref().unwrap_or("(empty)")
                );
            }
        }
        let s = &self.slot;
        let _ = writeln!(out, "\nslot {}", s.slot);
        if let Some(e) = &s.error {
            let _ = writeln!(out, "  error        {e}");
        }
        if s.exists {
            let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
            let _ = writeln!(
                out,
                "  position     restart_lsn {}  confirmed_flush_lsn {}  wal_status {}  active {}",
                dash(&s.restart_lsn),
                dash(&s.confirmed_flush_lsn),
                dash(&s.wal_status),
                if s.active == Some(true) { "yes" } else { "no" }
            );
            let _ = writeln!(
                out,
                "  WAL          retained {}  not yet confirmed {}",
                s.retained_wal_bytes
                    .map(human_bytes)
                    .unwrap_or_else(|| "-".into()),
                s.lag_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
            );
            let _ = writeln!(
                out,
                "  limit        max_slot_wal_keep_size {}  safe_wal_size {}",
                s.max_slot_wal_keep_size
                    .map(human_bytes)
                    .unwrap_or_else(|| "unlimited (-1)".into()),
                s.safe_wal_size
                    .map(human_bytes)
                    .unwrap_or_else(|| "-".into()),
            );
        }
        if let Some(r) = &s.risk {
            let level = match r.level {
                RiskLevel::Ok => "ok",
                RiskLevel::Warning => "WARNING",
                RiskLevel::Critical => "CRITICAL",
                RiskLevel::Lost => "LOST",
                RiskLevel::Unbounded => "unbounded",
            };
            let _ = writeln!(out, "  risk         {level}: {}", r.message);
        }
        out
    }

    /// Sets the retention gauges (see [`observe`]) and warns about every
    /// unmet requirement and every slot at risk.
    pub fn export(&self) {
        let short = self
            .read_models
            .iter()
            .any(|rm| rm.requirement.as_ref().is_some_and(|v| !v.met));
        observe::Alert::RebuildReachShort.set(short);
        for rm in &self.read_models {
            let label = rm.name.clone();
            let kind = match rm.reach.kind {
                ReachKind::None => 0.0,
                ReachKind::CurrentState => 1.0,
                ReachKind::FullHistory => 2.0,
            };
            metrics::gauge!(observe::REACH_KIND, "read_model" => label.clone()).set(kind);
            metrics::gauge!(observe::REACH_SINCE, "read_model" => label.clone())
                .set(rm.reach.since_ms.map_or(0.0, |ms| ms as f64 / 1000.0));
            if let Some(v) = &rm.requirement {
                metrics::gauge!(observe::REACH_REQUIREMENT_MET, "read_model" => label.clone())
                    .set(if v.met { 1.0 } else { 0.0 });
                if let Some(s) = &v.shortfall {
                    tracing::warn!(read_model = %rm.name, requirement = %v.requirement, shortfall = %s, "alert rebuild_reach_short: the rebuild reach is below its requirement (see the README's runbook: rebuilding a read model)");
                }
            }
        }
        for t in &self.topics {
            for p in &t.partitions {
                let labels = [
                    ("topic", t.topic.clone()),
                    ("partition", p.partition.to_string()),
                ];
                metrics::gauge!(observe::RETENTION_EARLIEST_OFFSET, &labels)
                    .set(p.earliest_offset as f64);
                metrics::gauge!(observe::RETENTION_LATEST_OFFSET, &labels)
                    .set(p.latest_offset as f64);
                if let Some(ts) = p.earliest_timestamp_ms {
                    metrics::gauge!(observe::RETENTION_EARLIEST_TIMESTAMP, &labels)
                        .set(ts as f64 / 1000.0);
                }
            }
        }
        let s = &self.slot;
        if let Some(b) = s.retained_wal_bytes {
            metrics::gauge!(observe::SLOT_RETAINED_WAL_BYTES).set(b as f64);
        }
        if let Some(b) = s.safe_wal_size {
            metrics::gauge!(observe::SLOT_SAFE_WAL_SIZE_BYTES).set(b as f64);
        }
        if let Some(r) = s.risk.as_ref().filter(|r| {
            matches!(
                r.level,
                RiskLevel::Warning | RiskLevel::Critical | RiskLevel::Lost
            )
        }) {
            tracing::warn!(slot = %s.slot, level = ?r.level, "{}", r.message);
        }
    }
}

fn ms_text(ms: Option<i64>) -> String {
    match ms {
        None => "(not reported)".into(),
        Some(ms) if ms < 0 => "-1 (forever)".into(),
        Some(ms) => format!("{ms} ({})", human_span(ms)),
    }
}

fn reach_line(r: &Reach) -> String {
    let mut line = match r.kind {
        ReachKind::FullHistory => format!(
            "full history since {}{}",
            r.since.as_deref().unwrap_or("?"),
            r.since_lsn
                .as_deref()
                .map(|l| format!(" (LSN {l})"))
                .unwrap_or_default()
        ),
        ReachKind::CurrentState => "current state only (compacted)".to_string(),
        ReachKind::None => "NOT REBUILDABLE without a new snapshot".to_string(),
    };
    if let Some(u) = &r.until {
        let _ = write!(
            line,
            "; retention starts deleting what it rests on about {u}"
        );
    }
    let _ = write!(line, ". {}", r.summary);
    line
}

fn gap_line(g: &reach::Gap) -> String {
    let mut line = g.reason.clone();
    if let (Some(from), Some(to)) = (&g.missing_from, &g.missing_to) {
        let _ = write!(line, " (records written between about {from} and {to})");
    }
    line
}

/// The topic → partition → offset map a rebuild reads from: the start
/// offsets of the snapshots the report's reach rests on, or the earliest
/// retained offsets, whichever is later (a rebuild needs no record older
/// than its snapshot, and none older than the log holds).
pub fn rebuild_start(report: &Report) -> BTreeMap<String, BTreeMap<i32, i64>> {
    report
        .topics
        .iter()
        .map(|t| {
            let parts = t
                .partitions
                .iter()
                .map(|p| {
                    let start = match (&t.snapshot, t.begins_with_complete_snapshot) {
                        (Some(s), true) => s.start(p.partition).max(p.earliest_offset),
                        _ => p.earliest_offset,
                    };
                    (p.partition, start)
                })
                .collect();
            (t.topic.clone(), parts)
        })
        .collect()
}
