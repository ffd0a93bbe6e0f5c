//! `pgcdc rebuild`: a read model rebuilt from the retained changelog, then
//! swapped in atomically.
//!
//! Guarantees:
//! - **No partial rebuild.** Unless the retention report finds a complete
//!   snapshot still retained in every partition of every source topic, the
//!   rebuild refuses with the report's reason. `--from snapshot` instead
//!   asks the connector for an incremental snapshot of the source tables
//!   and reads from its start offsets; history before it is then not in
//!   the rebuilt model, and the outcome says so.
//! - **The same dedup rules.** The log is replayed through the
//!   materializer's own apply path (position guard, tombstones, truncate
//!   watermarks) into shadow mirrors (schema `pgcdc_rebuild`), so
//!   duplicates, reordered partitions and snapshot rows resolve exactly as
//!   they do live.
//! - **An atomic swap.** After catching up until little is left, one
//!   transaction locks (EXCLUSIVE: writers wait, readers do not) the live
//!   mirrors of the read model's sources, every read model over them and
//!   every other source of those read models, reads the topics' end
//!   offsets under those locks and applies the rest into the shadows,
//!   replaces the live mirrors' rows, tombstones and truncate watermarks
//!   with the shadows' (DELETE and INSERT: MVCC-safe, so a reader's
//!   snapshot never sees them empty), and recomputes every read model over
//!   those mirrors in full. Readers see the old state until the commit and
//!   the rebuilt one after it. A running materializer waits on the locks;
//!   everything it redelivers afterwards up to those end offsets is a
//!   duplicate the position guard skips, so no change is lost or applied
//!   twice. That holds for a materializer still behind the rebuild's start
//!   too: the swap stores, like a truncate's, a watermark just below the
//!   starting snapshot's consistent point, so an older record of a key the
//!   rebuilt state no longer holds (deleted while nothing captured it) is
//!   skipped rather than inserted again.
//! - **Nothing skipped.** The replay never jumps over records: an offset
//!   that retention deleted before the rebuild read it is an error, and
//!   nothing is swapped.
//!
//! ```text
//!  report/snapshot ─► start offsets ─► consume ─► decode ─► guard ─► shadow mirrors   (batches)
//!  catch up ─► BEGIN ─ LOCK mirrors + read models ─ end offsets ─► rest into shadows
//!        ─ live mirrors := shadows ─ recompute read models in full ─ COMMIT
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::message::OwnedMessage;
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::Serialize;
use tokio_postgres::{Client, GenericClient};

use super::mirror::{Mirror, Position, Statements};
use super::view::View;
use super::{
    apply_batch, apply_in, decode_batch, fast_tier, prepare, refresh_statistics, Analyze,
    DeadLetters, Lookups, MaterializeError, Prepared, State,
};
use crate::config::{Config, DedupConfig};
use crate::connector::incremental;
use crate::retention::reach::ReachKind;
use crate::retention::time::rfc3339;
use crate::sink::CreateClient as _;
use crate::source::slot::quote_ident;
use crate::{retention, sink, source};

/// The schema of the shadow tables.
pub const SHADOW_SCHEMA: &str = "pgcdc_rebuild";
/// `pg_try_advisory_lock` key: one rebuild per target database at a time.
const LOCK_KEY: i64 = 0x7067_6364_7265_6275;
/// Keys per statement when a read model is recomputed in full.
const RECOMPUTE_KEYS: usize = 10_000;
/// How long the log may deliver nothing before the rebuild gives up.
const STALL_LIMIT: Duration = Duration::from_secs(60);
/// How long the swap tries to take its locks before giving up.
const LOCK_WAIT: Duration = Duration::from_secs(120);
/// Catch-up passes before the swap (each reads to the end offsets of its
/// start), so that the swap's locked tail is short under a steady load.
const CATCH_UP_ROUNDS: usize = 5;

/// Where the rebuild reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The earliest complete snapshot the retained log holds.
    Earliest,
    /// A fresh incremental snapshot, taken now by the running connector.
    Snapshot,
}

#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    /// The log cannot give a complete rebuild (or the request is wrong).
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Failed(String),
}

impl From<MaterializeError> for RebuildError {
    fn from(e: MaterializeError) -> Self {
        RebuildError::Failed(e.to_string())
    }
}

impl From<tokio_postgres::Error> for RebuildError {
    fn from(e: tokio_postgres::Error) -> Self {
        RebuildError::Failed(format!("target: {}", source::error_text(&e)))
    }
}

impl From<rdkafka::error::KafkaError> for RebuildError {
    fn from(e: rdkafka::error::KafkaError) -> Self {
        RebuildError::Failed(format!("kafka: {e}"))
    }
}

/// A partition's records that the rebuild read.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionRead {
    pub topic: String,
    pub partition: i32,
    pub from_offset: i64,
    /// Exclusive: the end offset read under the swap's locks.
    pub to_offset: i64,
}

/// What a rebuild did.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub read_model: String,
    /// `earliest` or `snapshot`.
    pub from: String,
    /// The snapshot the rebuild started from, in words.
    pub snapshot: Option<String>,
    /// What the rebuilt model does not have (history before a fresh
    /// snapshot, history a compacted topic dropped).
    pub history_note: Option<String>,
    pub partitions: Vec<PartitionRead>,
    pub records_read: u64,
    /// Of those, read inside the swap transaction, under its locks.
    pub records_read_under_lock: u64,
    pub applied: u64,
    pub duplicates: u64,
    /// Changes the target rejected (the materializer dead-letters them;
    /// the rebuild skips them the same way).
    pub rejected: u64,
    /// Mirror → rows after the swap.
    pub mirrors: BTreeMap<String, i64>,
    /// Read model → rows after the swap (every read model over the
    /// rebuilt mirrors is recomputed).
    pub read_models: BTreeMap<String, i64>,
    pub elapsed_ms: u64,
}

impl Outcome {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "read model {} rebuilt from {}",
            self.read_model,
            self.snapshot.as_deref().unwrap_or("the retained log")
        );
        let mut topics: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for p in &self.partitions {
            topics.entry(&p.topic).or_default().push(format!(
                "p{} {}..{}",
                p.partition, p.from_offset, p.to_offset
            ));
        }
        for (t, parts) in topics {
            let _ = writeln!(out, "  read         {t}: {}", parts.join(", "));
        }
        let _ = writeln!(
            out,
            "  changes      {} records read ({} under the swap's locks), {} applied, {} duplicates skipped, {} rejected",
            self.records_read,
            self.records_read_under_lock,
            self.applied,
            self.duplicates,
            self.rejected
        );
        let list = |m: &BTreeMap<String, i64>| {
            m.iter()
                .map(|(k, n)| format!("{k} {n} rows"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(out, "  mirrors      {}", list(&self.mirrors));
        let _ = writeln!(
            out,
            "  read models  {} (recomputed in full)",
            list(&self.read_models)
        );
        if let Some(n) = &self.history_note {
            let _ = writeln!(out, "  note         {n}");
        }
        let _ = writeln!(
            out,
            "  took         {:.1} s",
            self.elapsed_ms as f64 / 1000.0
        );
        out
    }
}

/// Counts over the whole rebuild.
#[derive(Debug, Default, Clone)]
struct Totals {
    read: u64,
    /// Read inside the swap transaction, under its locks.
    under_lock: u64,
    applied: u64,
    duplicates: u64,
    rejected: u64,
}

/// Rebuilds read model `name`. `snapshot_timeout` bounds the wait for a
/// fresh snapshot (`Start::Snapshot`).
pub async fn run(
    config: &Config,
    name: &str,
    start: Start,
    snapshot_timeout: Option<Duration>,
) -> Result<Outcome, RebuildError> {
    let started = Instant::now();
    let (_, rm) = config.read_model(name).map_err(RebuildError::Refused)?;
    let target = config
        .target
        .as_ref()
        .ok_or_else(|| RebuildError::Failed("target: is required".into()))?;
    let mut tables: Vec<String> = Vec::new();
    for s in &rm.sources {
        if !tables.contains(&s.table) {
            tables.push(s.table.clone());
        }
    }
    // Not read by a rebuild yet: refused rather than rebuilt without it.
    if let Some((t, d)) = tables
        .iter()
        .find_map(|t| Some((t, config.dedicated_topic(t)?)))
    {
        return Err(RebuildError::Refused(format!(
            "{t} routes keys or tenants to the dedicated topic {d} (partitioning.\"{t}\"), which a rebuild does not read yet"
        )));
    }
    let topics: Vec<String> = tables.iter().map(|t| config.topic_for(t)).collect();

    let (from, snapshot, history_note, floors) = match start {
        Start::Earliest => {
            let report = retention::gather(config, Some(name), None)
                .await
                .map_err(|e| RebuildError::Failed(e.to_string()))?;
            let reach = report
                .read_models
                .first()
                .map(|r| r.reach.clone())
                .ok_or_else(|| RebuildError::Failed("no reach for the read model".into()))?;
            if reach.kind == ReachKind::None {
                return Err(RebuildError::Refused(format!(
                    "{}. `--from snapshot` takes a fresh snapshot of {} and rebuilds from it (without the history before it)",
                    reach.summary,
                    tables.join(", ")
                )));
            }
            let note = (reach.kind == ReachKind::CurrentState).then(|| {
                format!(
                    "the rebuilt model holds the current state, not the history of changes: {}",
                    reach.summary
                )
            });
            // Everything committed before the snapshot the rebuild starts
            // from is in the rebuilt mirrors (through that snapshot).
            let floors = report
                .topics
                .iter()
                .filter(|t| t.begins_with_complete_snapshot)
                .filter_map(|t| {
                    let cp = t.snapshot.as_ref()?.consistent_point.as_deref()?;
                    Some((t.topic.clone(), floor_of(cp)?))
                })
                .collect();
            (retention::rebuild_start(&report), None, note, floors)
        }
        Start::Snapshot => {
            let sql = source::connect(&config.source.url)
                .await
                .map_err(|e| RebuildError::Failed(format!("source: {}", source::error_text(&e))))?;
            let asked = crate::connector::now_ms();
            let id = incremental::signal(&sql, config, &tables)
                .await
                .map_err(RebuildError::Refused)?;
            tracing::info!(%id, tables = ?tables, "incremental snapshot requested; waiting for the connector to take it");
            let marker = incremental::wait(config, &id, snapshot_timeout, |m| {
                tracing::info!(%id, rows = ?m.rows, phase = ?m.phase, "incremental snapshot progress");
            })
            .await
            .map_err(RebuildError::Failed)?;
            let floor = marker.consistent_point.as_deref().and_then(floor_of);
            let floors: BTreeMap<String, Position> = topics
                .iter()
                .filter_map(|t| Some((t.clone(), floor?)))
                .collect();
            (
                marker.start_offsets.clone(),
                Some(format!(
                    "the incremental snapshot {id} of {} (completed {})",
                    tables.join(", "),
                    rfc3339(marker.ts_ms)
                )),
                Some(format!(
                    "history before {} (when the snapshot was requested) is not in the rebuilt model: it holds the state the snapshot read and every change since",
                    rfc3339(asked)
                )),
                floors,
            )
        }
    };

    let mut db = source::connect(&target.url).await?;
    let locked: bool = db
        .query_one("SELECT pg_try_advisory_lock($1)", &[&LOCK_KEY])
        .await?
        .get(0);
    if !locked {
        return Err(RebuildError::Failed(
            "another pgcdc rebuild is running on this target database".into(),
        ));
    }
    let Prepared {
        registry,
        mirrors: live,
        views,
    } = prepare(config, &db).await?;
    let shadows = create_shadows(&db, &live, &topics).await?;
    let bloom_keys = target.dedup.bloom_keys.max(1_000_000);
    // The shadows are this process's alone: an in-process tier and a
    // Bloom filter over them are exact.
    let fast = fast_tier::FastTier::new(
        &DedupConfig {
            bloom_keys,
            redis_url: None,
            on_redis_failure: None,
            ..DedupConfig::default()
        },
        "rebuild",
    )
    .map_err(RebuildError::Failed)?;
    // Read models are recomputed in full at the swap, not per change.
    let mut state = State::new(registry, shadows, Vec::new(), fast);
    let dead_letters = DeadLetters {
        producer: None,
        topic: "",
        sent: Default::default(),
        replay_of: None,
        max_message_bytes: config.kafka.max_message_bytes,
    };

    let consumer: sink::QuietConsumer = sink::client_config(&config.kafka)
        .set("group.id", format!("pgcdc-rebuild-{}", config.name))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        // An offset retention deleted before we read it is an error, never
        // a silent jump to what remains.
        .set("auto.offset.reset", "error")
        .client_with(sink::Quiet)?;
    let marks = watermarks(config, &topics, &from).await?;
    let firsts = marks.start.clone();
    let mut positions = firsts.clone();
    assign(&consumer, &positions)?;
    let mut totals = Totals::default();
    let batch_size = target.batch_size;
    // Catch up until little is left, so the swap holds its locks briefly.
    let mut ends = marks.end;
    for _ in 0..CATCH_UP_ROUNDS {
        let mut last_log = Instant::now();
        while let Some(batch) = next_batch(&consumer, &mut positions, &ends, batch_size).await? {
            totals.read += batch.len() as u64;
            let t = apply_batch(&mut state, &mut db, &dead_letters, &batch).await?;
            refresh_statistics(&db, &mut state, &mut Analyze::Inline).await;
            totals.applied += t.applied;
            totals.duplicates += t.duplicates;
            totals.rejected += t.dead_lettered;
            if last_log.elapsed() > Duration::from_secs(5) {
                let left: i64 = ends
                    .iter()
                    .map(|(k, e)| e - positions.get(k).copied().unwrap_or(*e))
                    .sum();
                tracing::info!(read_model = %name, read = totals.read, left, "rebuild progress");
                last_log = Instant::now();
            }
        }
        let now = watermarks(config, &topics, &BTreeMap::new()).await?;
        let left: i64 = now
            .end
            .iter()
            .map(|(k, e)| e - positions.get(k).copied().unwrap_or(0))
            .sum();
        for (k, low) in &now.start {
            positions.entry(k.clone()).or_insert(*low);
        }
        ends = now.end;
        if left <= batch_size as i64 {
            break;
        }
        assign(&consumer, &positions)?;
    }

    let mut attempt = 0;
    let (to, mirrors, read_models) = loop {
        attempt += 1;
        // What a failed attempt did inside its transaction is rolled back:
        // so is what it changed in memory.
        let before = (positions.clone(), state.mirrors.clone(), totals.clone());
        match swap(
            &mut db,
            &mut state,
            &consumer,
            &mut positions,
            config,
            &topics,
            &tables,
            &live,
            &views,
            &floors,
            &mut totals,
        )
        .await
        {
            Ok(done) => break done,
            Err(MaterializeError::Postgres(e)) if super::is_retryable(&e) && attempt < 5 => {
                tracing::warn!(attempt, error = %source::error_text(&e), "the swap conflicted with another transaction; trying again");
                (positions, state.mirrors, totals) = before;
                state.statements = Statements::default();
                assign(&consumer, &positions)?;
            }
            Err(e) => return Err(e.into()),
        }
    };
    // The rebuild took effect; leftovers are replaced by the next one.
    if let Err(e) = drop_shadows(&db, &state.mirrors).await {
        tracing::warn!(error = %e, "the rebuild took effect, but its shadow tables were not dropped");
    }
    let _ = db
        .execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY])
        .await;
    let mut partitions: Vec<PartitionRead> = to
        .iter()
        .map(|((topic, partition), end)| PartitionRead {
            topic: topic.clone(),
            partition: *partition,
            from_offset: firsts
                .get(&(topic.clone(), *partition))
                .copied()
                .unwrap_or(0),
            to_offset: *end,
        })
        .collect();
    partitions.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
    Ok(Outcome {
        read_model: name.to_string(),
        from: match start {
            Start::Earliest => "earliest",
            Start::Snapshot => "snapshot",
        }
        .to_string(),
        snapshot,
        history_note,
        partitions,
        records_read: totals.read,
        records_read_under_lock: totals.under_lock,
        applied: totals.applied,
        duplicates: totals.duplicates,
        rejected: totals.rejected,
        mirrors,
        read_models,
        elapsed_ms: started.elapsed().as_millis() as u64,
    })
}

/// Fresh, empty shadows of the live mirrors of `topics`, with their
/// columns, constraints and indexes (`LIKE ... INCLUDING ALL`), and no
/// state left by an earlier, interrupted rebuild.
async fn create_shadows(
    db: &Client,
    live: &HashMap<String, Mirror>,
    topics: &[String],
) -> Result<HashMap<String, Mirror>, RebuildError> {
    db.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {}",
        quote_ident(SHADOW_SCHEMA)
    ))
    .await?;
    let mut shadows = HashMap::new();
    for topic in topics {
        let m = live
            .get(topic)
            .ok_or_else(|| RebuildError::Failed(format!("no mirror for {topic}")))?;
        let shadow = Mirror {
            qualified: format!("{}.{}", quote_ident(SHADOW_SCHEMA), quote_ident(&m.table)),
            private: true,
            ..m.clone()
        };
        db.batch_execute(&format!(
            "DROP TABLE IF EXISTS {s}; CREATE TABLE {s} (LIKE {l} INCLUDING ALL)",
            s = shadow.qualified,
            l = m.qualified
        ))
        .await?;
        forget_state(db, &shadow.qualified).await?;
        shadows.insert(topic.clone(), shadow);
    }
    Ok(shadows)
}

async fn drop_shadows(db: &Client, shadows: &HashMap<String, Mirror>) -> Result<(), RebuildError> {
    for s in shadows.values() {
        db.batch_execute(&format!("DROP TABLE IF EXISTS {}", s.qualified))
            .await?;
        forget_state(db, &s.qualified).await?;
    }
    Ok(())
}

/// Removes a mirror's tombstones and truncate watermark.
async fn forget_state(db: &impl GenericClient, mirror: &str) -> Result<(), tokio_postgres::Error> {
    for t in STATE_TABLES {
        db.execute(
            &format!("DELETE FROM pgcdc_state.{t} WHERE mirror = $1"),
            &[&mirror],
        )
        .await?;
    }
    Ok(())
}

/// The state tables keyed by mirror.
const STATE_TABLES: [&str; 2] = ["tombstones", "truncations"];

type Positions = HashMap<(String, i32), i64>;

/// Per partition of `topics`: where to start (from `from`, or the first
/// retained offset for a partition it does not name), the first retained
/// offset, and the high watermark now. A start below what the log retains
/// is refused.
struct Marks {
    start: Positions,
    end: Positions,
}

async fn watermarks(
    config: &Config,
    topics: &[String],
    from: &BTreeMap<String, BTreeMap<i32, i64>>,
) -> Result<Marks, RebuildError> {
    let all = sink::watermarks(&config.kafka, topics)
        .await
        .map_err(|e| RebuildError::Failed(format!("kafka: {e}")))?;
    let (mut start, mut end) = (Positions::new(), Positions::new());
    for (topic, parts) in all {
        for (p, (low, high)) in parts {
            let first = from
                .get(&topic)
                .and_then(|parts| parts.get(&p))
                .copied()
                .unwrap_or(low);
            if first < low {
                return Err(RebuildError::Refused(format!(
                    "{topic} partition {p}: the rebuild must read from offset {first}, but the log now begins at {low} (retention cut in)"
                )));
            }
            start.insert((topic.clone(), p), first.min(high));
            end.insert((topic.clone(), p), high);
        }
    }
    Ok(Marks { start, end })
}

fn assign(consumer: &sink::QuietConsumer, positions: &Positions) -> Result<(), RebuildError> {
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), offset) in positions {
        tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
    }
    consumer.assign(&tpl)?;
    Ok(())
}

/// The next records below `ends` (at most `max`); `None` once every
/// partition reached its end. Records at or past a partition's end are
/// left for later (the swap reads them again from `positions`).
async fn next_batch(
    consumer: &sink::QuietConsumer,
    positions: &mut Positions,
    ends: &Positions,
    max: usize,
) -> Result<Option<Vec<OwnedMessage>>, RebuildError> {
    let done = |positions: &Positions| {
        ends.iter()
            .all(|(k, e)| positions.get(k).copied().unwrap_or(*e) >= *e)
    };
    if done(positions) {
        return Ok(None);
    }
    let mut batch = Vec::new();
    let mut idle_since = Instant::now();
    while batch.len() < max && !done(positions) {
        match tokio::time::timeout(Duration::from_millis(300), consumer.recv()).await {
            Ok(m) => {
                let m = m.map_err(|e| match e.rdkafka_error_code() {
                    Some(
                        rdkafka::types::RDKafkaErrorCode::AutoOffsetReset
                        | rdkafka::types::RDKafkaErrorCode::OffsetOutOfRange,
                    ) => RebuildError::Failed(format!(
                        "records the rebuild had not read yet were deleted (retention cut in while it ran: {e}); nothing was swapped. Run it again, or with --from snapshot"
                    )),
                    _ => RebuildError::from(e),
                })?;
                let key = (m.topic().to_string(), m.partition());
                let Some(&end) = ends.get(&key) else { continue };
                let at = positions.entry(key).or_insert(0);
                if m.offset() < end {
                    *at = m.offset() + 1;
                    batch.push(m.detach());
                } else {
                    *at = end;
                }
                idle_since = Instant::now();
            }
            Err(_) if !batch.is_empty() => break,
            Err(_) => {
                // Under read_committed the last offsets of a partition may
                // be transaction markers, never delivered: the consumer's
                // position tells.
                if let Ok(tpl) = consumer.position() {
                    for e in tpl.elements() {
                        let key = (e.topic().to_string(), e.partition());
                        if let (Some(o), Some(end)) = (e.offset().to_raw(), ends.get(&key)) {
                            let at = positions.entry(key).or_insert(0);
                            *at = (*at).max(o.min(*end));
                        }
                    }
                }
                if idle_since.elapsed() > STALL_LIMIT && !done(positions) {
                    return Err(RebuildError::Failed(format!(
                        "the log delivered nothing for {} s before reaching its end offsets",
                        STALL_LIMIT.as_secs()
                    )));
                }
            }
        }
    }
    Ok(Some(batch))
}

/// The position just below every change committed at or after the
/// snapshot's consistent point `cp`: a "truncate" there skips exactly the
/// changes committed before it.
fn floor_of(cp: &str) -> Option<Position> {
    let lsn = cp.parse::<crate::source::pgoutput::Lsn>().ok()?;
    Some((lsn.0 as i64, -1))
}

/// 0–63 ms, so that the retries of two waiters do not stay in step.
fn jitter() -> u8 {
    (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default()
        % 64) as u8
}

type Swapped = (Positions, BTreeMap<String, i64>, BTreeMap<String, i64>);

/// The swap transaction (see the module doc). Returns the end offsets read
/// under its locks, and the rows of every mirror and read model it wrote.
#[allow(clippy::too_many_arguments)]
async fn swap(
    db: &mut Client,
    state: &mut State,
    consumer: &sink::QuietConsumer,
    positions: &mut Positions,
    config: &Config,
    topics: &[String],
    tables: &[String],
    live: &HashMap<String, Mirror>,
    views: &[View],
    floors: &BTreeMap<String, Position>,
    totals: &mut Totals,
) -> Result<Swapped, MaterializeError> {
    let over: Vec<&View> = views
        .iter()
        .filter(|v| v.sources.iter().any(|(t, _)| tables.contains(t)))
        .collect();
    // The rebuilt mirrors, the read models over them, and every other
    // mirror those read models read: writers wait, readers do not.
    let mut locked: Vec<String> = live
        .values()
        .filter(|m| {
            tables.contains(&m.source)
                || over
                    .iter()
                    .any(|v| v.sources.iter().any(|(t, _)| *t == m.source))
        })
        .map(|m| m.qualified.clone())
        .chain(over.iter().map(|v| v.qualified.clone()))
        .collect();
    locked.sort();
    locked.dedup();
    // NOWAIT, retried: waiting for one lock while holding another would
    // deadlock with a materializer's batch that holds the first and wants
    // the second. A batch ends within moments, and all are free between.
    let deadline = Instant::now() + LOCK_WAIT;
    let mut tx = loop {
        let tx = db.transaction().await?;
        match tx
            .batch_execute(&format!(
                "LOCK TABLE {} IN EXCLUSIVE MODE NOWAIT",
                locked.join(", ")
            ))
            .await
        {
            Ok(()) => break tx,
            Err(e)
                if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
                    && Instant::now() < deadline =>
            {
                drop(tx);
                tokio::time::sleep(Duration::from_millis(20 + u64::from(jitter()))).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    // Under the locks nothing else writes these tables, so whatever a
    // materializer applied to them lies below the end offsets read now.
    let marks = watermarks(config, topics, &BTreeMap::new())
        .await
        .map_err(|e| MaterializeError::Config(e.to_string()))?;
    for (k, low) in &marks.start {
        // A partition added meanwhile is read from its beginning.
        let at = positions.entry(k.clone()).or_insert(*low);
        if *at < *low {
            return Err(MaterializeError::Config(format!(
                "{} partition {}: records from offset {at} to {low} were deleted before the rebuild read them (retention cut in while it ran); nothing was swapped",
                k.0, k.1
            )));
        }
    }
    let ends = marks.end;
    assign(consumer, positions).map_err(|e| MaterializeError::Config(e.to_string()))?;
    let no_fast_path = Lookups {
        known: HashMap::new(),
        fresh: HashSet::new(),
    };
    while let Some(batch) = next_batch(
        consumer,
        positions,
        &ends,
        config.target.as_ref().map_or(500, |t| t.batch_size),
    )
    .await
    .map_err(|e| MaterializeError::Config(e.to_string()))?
    {
        if batch.is_empty() {
            continue;
        }
        totals.read += batch.len() as u64;
        totals.under_lock += batch.len() as u64;
        let (changes, dead) = decode_batch(state, &tx, &batch).await?;
        totals.rejected += dead.len() as u64;
        let sp = tx.savepoint("pgcdc_rebuild_tail").await?;
        let done = match apply_in(&sp, state, &batch, &changes, &no_fast_path, false).await {
            Ok(d) => {
                sp.commit().await?;
                d
            }
            Err(MaterializeError::Rejected) => {
                sp.rollback().await?;
                let sp = tx.savepoint("pgcdc_rebuild_tail").await?;
                let d = apply_in(&sp, state, &batch, &changes, &no_fast_path, true).await?;
                sp.commit().await?;
                d
            }
            Err(e) => return Err(e),
        };
        totals.applied += done.applied;
        totals.duplicates += done.duplicates;
        totals.rejected += done.dead.len() as u64;
    }

    let mut mirrors = BTreeMap::new();
    for topic in topics {
        let (Some(l), Some(s)) = (live.get(topic), state.mirrors.get(topic)) else {
            continue;
        };
        let columns_of = |qualified: String| {
            let tx = &tx;
            async move {
                tx.query(
                    "SELECT quote_ident(attname) FROM pg_attribute
                     WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped
                     ORDER BY attnum",
                    &[&qualified],
                )
                .await
                .map(|rows| {
                    rows.iter()
                        .map(|r| r.get::<_, String>(0))
                        .collect::<Vec<_>>()
                })
            }
        };
        let columns = columns_of(s.qualified.clone()).await?;
        // Columns the shadow gained from newer writer schemas. Only then
        // ALTER: its ACCESS EXCLUSIVE lock would wait for readers.
        let present = columns_of(l.qualified.clone()).await?;
        if columns.iter().any(|c| !present.contains(c)) {
            Mirror {
                columns: s.columns.clone(),
                ..l.clone()
            }
            .ensure(&tx)
            .await?;
        }
        let list = columns.join(", ");
        // DELETE, not TRUNCATE: a reader's older snapshot keeps seeing
        // the old rows.
        tx.batch_execute(&format!(
            "DELETE FROM {live}; INSERT INTO {live} ({list}) SELECT {list} FROM {shadow}",
            live = l.qualified,
            shadow = s.qualified
        ))
        .await?;
        forget_state(&tx, &l.qualified).await?;
        for t in STATE_TABLES {
            tx.execute(
                &format!("UPDATE pgcdc_state.{t} SET mirror = $1 WHERE mirror = $2"),
                &[&l.qualified, &s.qualified],
            )
            .await?;
        }
        if let Some((lsn, seq)) = floors.get(topic) {
            // A materializer still behind the rebuild's start would
            // otherwise re-apply an older record of a key the rebuilt
            // state no longer holds (deleted while nothing was captured,
            // or before the snapshot): every change committed before the
            // snapshot is in the rebuilt state, so it is skipped like one
            // older than a truncate.
            tx.execute(
                "INSERT INTO pgcdc_state.truncations (mirror, commit_lsn, seq) VALUES ($1, $2, $3)
                 ON CONFLICT (mirror) DO UPDATE SET commit_lsn = EXCLUDED.commit_lsn, seq = EXCLUDED.seq
                 WHERE (pgcdc_state.truncations.commit_lsn, pgcdc_state.truncations.seq)
                     < (EXCLUDED.commit_lsn, EXCLUDED.seq)",
                &[&l.qualified, lsn, seq],
            )
            .await?;
        }
        let rows: i64 = tx
            .query_one(&format!("SELECT count(*) FROM {}", l.qualified), &[])
            .await?
            .get(0);
        mirrors.insert(l.qualified.clone(), rows);
    }

    let all: Vec<&Mirror> = live.values().collect();
    let mut read_models = BTreeMap::new();
    let mut statements = super::mirror::Statements::default();
    for v in over {
        tx.batch_execute(&format!("TRUNCATE {}", v.qualified))
            .await?;
        let keys: Vec<String> = v.every_key(&tx, &all).await?.into_iter().collect();
        for chunk in keys.chunks(RECOMPUTE_KEYS) {
            let chunk: BTreeSet<String> = chunk.iter().cloned().collect();
            v.recompute(&tx, &mut statements, &chunk)
                .await
                .map_err(|e| match e {
                    super::view::ViewError::Db(e) => MaterializeError::Postgres(e),
                    super::view::ViewError::Key(k) | super::view::ViewError::Duplicate(k) => {
                        MaterializeError::Config(k)
                    }
                })?;
        }
        let rows: i64 = tx
            .query_one(&format!("SELECT count(*) FROM {}", v.qualified), &[])
            .await?
            .get(0);
        read_models.insert(v.name.clone(), rows);
    }
    tx.commit().await?;
    Ok((ends, mirrors, read_models))
}
