//! `pgcdc materialize`: mirror tables and denormalized read models in the
//! target Postgres, with exactly-once effects.
//!
//! Guarantees:
//! - **Exactly-once effects.** A batch of changes is applied in one
//!   serializable database transaction: mirror writes (under the position
//!   guard of [`mirror`]), tombstones and view recomputes together; a
//!   serialization failure (another instance's batch touched what a view
//!   read) redoes the batch. Kafka offsets are committed only after that
//!   transaction commits (asynchronously: a commit lost to a crash means
//!   a redelivery, never a skip). A redelivered
//!   change (after a crash, a rebalance, a reset of the group's offsets)
//!   carries a position that is not newer than the stored one and is
//!   skipped; two instances racing on one key serialize on a lock.
//! - **Two dedup tiers.** A fast tier ([`fast_tier`]: an in-process LRU,
//!   or Redis shared by every instance) answers "already applied" without
//!   a database round trip; a miss, an eviction, an expiry or Redis being
//!   down (under `fail_open`) falls through to the durable positions
//!   stored with the rows. An optional Bloom filter lets inserts of keys
//!   never seen skip the look-up (the insert itself is guarded).
//! - **Set-wise apply.** A batch is cut into windows of distinct keys;
//!   each costs a few statements per mirror (locks and look-up, inserts,
//!   upserts, deletes, view keys before and after) rather than several per
//!   change, with the same outcome. A rejected value fails a window's
//!   statement, and the batch is redone one change at a time with a
//!   savepoint each, which isolates the change to dead-letter.
//! - **Infrastructure errors retry, data errors dead-letter**, decided in
//!   one place ([`MaterializeError::retry_cause`]). A lost target
//!   connection, a Kafka or registry outage, or Redis under `fail_closed`
//!   retries the same batch with backoff (reconnecting as needed); its
//!   offsets do not move meanwhile.
//! - **Nothing vanishes.** A change the target rejects (a constraint, a
//!   value it cannot take) or a record that cannot be decoded goes to
//!   `<prefix>.dlq` with its failure class, error, origin and position in
//!   the headers, and Kafka acknowledges it before the batch commits. The
//!   partition moves on. A view the target cannot recompute for a change
//!   (its SQL fails on the data) dead-letters that change, found by
//!   applying the batch one change at a time. An unreachable registry is
//!   not the record's fault: the batch is retried and nothing is
//!   dead-lettered.
//!
//! ```text
//!  changelog topics ──► consumer group ──► decode (schema cache by id)
//!        │                                        │
//!        │              BEGIN ── guard ─► mirror ─┴─► affected keys ─► views ── COMMIT
//!        │                          └─ rejected ─► <prefix>.dlq (acknowledged before COMMIT)
//!        └──────────────── commit offsets ◄──────────────────────────────────────────┘
//! ```

pub mod bloom;
pub mod fairness;
pub mod fast_tier;
pub mod mirror;
pub mod rebuild;
pub mod recent;
pub mod replay;
pub mod resnapshot;
pub mod shape;
pub mod view;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use apache_avro::types::Value;
use apache_avro::Schema;
use futures_util::{pin_mut, FutureExt, TryStreamExt};
use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::Value as Json;
use tokio_postgres::{Client, GenericClient};

use crate::config::Config;
use crate::dlq::{classify, Fault, Verdict};
use crate::encode::{datum_reader, decode_datum, read_datum, unframe};
use crate::observe;
use crate::registry::client::{ClientError, RegistryClient};
use crate::sink;
use crate::sink::CreateClient as _;
use mirror::{Mirror, Outcome, Statements};
use shape::{Cell, Column};
use view::View;

#[derive(Debug, thiserror::Error)]
pub enum MaterializeError {
    #[error("config: {0}")]
    Config(String),
    #[error("target: {}", crate::source::error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("registry: {0}")]
    Registry(#[from] ClientError),
    #[error("{0}")]
    Schema(String),
    #[error("dead-letter topic: {0}")]
    DeadLetter(String),
    #[error("snapshot markers: {0}")]
    Markers(String),
    #[error("registry unavailable: {0}")]
    RegistryUnavailable(String),
    #[error(transparent)]
    Redis(#[from] fast_tier::Unavailable),
    /// A change was rejected in a batch applied without savepoints: redo
    /// it with them (never leaves [`apply_with_retry`]).
    #[error("a change was rejected; the batch is redone change by change")]
    Rejected,
    /// A read model's SQL failed on the data of this batch.
    #[error("read model: {error}")]
    ViewRejected { class: &'static str, error: String },
    #[error("gave up after {lasted_secs} s without the target database at start-up (target.give_up_after_secs = {limit_secs}); the last error: {last}")]
    GaveUp {
        lasted_secs: u64,
        limit_secs: u64,
        last: Box<MaterializeError>,
    },
}

impl MaterializeError {
    /// What [`classify`] says of a target database error after `attempts`
    /// attempts at the batch; `None` for other errors.
    pub fn target_verdict(&self, attempts: u32, max_attempts: u32) -> Option<Verdict> {
        let MaterializeError::Postgres(e) = self else {
            return None;
        };
        Some(classify(&Fault::Target {
            sqlstate: e.code().map(|c| c.code()),
            attempts,
            max_attempts,
        }))
    }

    /// The one place that decides: `Some(cause)` for an infrastructure
    /// error (retry the batch with backoff), `None` for one a retry cannot
    /// fix (stop with the error).
    pub fn retry_cause(&self) -> Option<&'static str> {
        match self {
            MaterializeError::Postgres(_) => match self.target_verdict(1, 0) {
                Some(Verdict::Retry(cause)) => Some(cause),
                _ => None,
            },
            MaterializeError::Kafka(_)
            | MaterializeError::DeadLetter(_)
            | MaterializeError::Markers(_) => Some("kafka"),
            MaterializeError::Registry(_) | MaterializeError::RegistryUnavailable(_) => {
                Some("registry")
            }
            MaterializeError::Redis(_) => Some("redis"),
            MaterializeError::Config(_)
            | MaterializeError::Schema(_)
            | MaterializeError::Rejected
            | MaterializeError::ViewRejected { .. }
            | MaterializeError::GaveUp { .. } => None,
        }
    }
}

/// The materializer's consumer group: `target.group_id`, else
/// `pgcdc-<name>`.
pub fn group_id(config: &Config, target: &crate::config::TargetConfig) -> String {
    target
        .group_id
        .clone()
        .unwrap_or_else(|| format!("pgcdc-{}", config.name))
}

pub fn dlq_topic(config: &Config) -> String {
    format!("{}.dlq", config.kafka.topic_prefix)
}

/// Datum readers by writer schema id (see [`datum_reader`]).
type Readers<'s> = HashMap<u32, crate::encode::DatumReader<'s>>;

/// A decoded writer schema.
struct Writer {
    schema: Schema,
    /// The row record's schema (the non-null branch of `after`).
    row: Json,
    names: HashMap<String, Json>,
}

/// How a writer schema's records map onto a mirror's columns: worked out
/// once per writer and mirror shape rather than for every record.
struct Plan {
    /// Per mirror column: the writer's field name and type, `None` where
    /// the writer has no such column.
    fields: Vec<Option<(String, Json)>>,
    /// Mirror columns whose writer type the mirror may not take, and why.
    mismatched: Vec<(usize, String)>,
}

/// Not the record's fault: the batch stops, nothing is dead-lettered, and
/// the offsets stay, so a restart retries.
const REGISTRY_UNAVAILABLE: &str = "registry_unavailable";

/// Why a message went to the dead-letter topic.
struct Failure {
    class: &'static str,
    error: String,
    position: Option<mirror::Position>,
}

/// A decoded change.
struct Change {
    op: String,
    position: mirror::Position,
    /// Mirror column order; `None` for a delete or truncate.
    cells: Option<Vec<Cell>>,
    /// The key texts, in key order.
    key: Vec<String>,
    /// The key in the fast dedup tier ([`Mirror::cache_key`]).
    cache_key: String,
    /// A column whose writer type the mirror's type may not take: a value
    /// the target refuses is then the schema's fault, not the value's.
    mismatch: Option<String>,
    /// The source commit time (`source.ts_ms`), for the commit-to-view
    /// latency.
    committed_ms: Option<i64>,
}

struct State {
    registry: RegistryClient,
    writers: HashMap<u32, Arc<Writer>>,
    /// Topic → mirror.
    mirrors: HashMap<String, Mirror>,
    views: Vec<View>,
    statements: Statements,
    fast: fast_tier::FastTier,
    /// A dead-letter replay's safe mapping for the message at hand
    /// (renamed fields, defaults); `None` on the live path.
    mapping: Option<crate::config::DlqMappingConfig>,
    /// Keys with an open dead letter (the live path with the workflow's
    /// rounds on; `None` elsewhere).
    held: Option<SharedHeld>,
    /// By (writer id, topic, the mirror's column count); the live path's
    /// only (a replay's mapping is per message).
    plans: HashMap<(u32, String, usize), Arc<Plan>>,
    /// Mirror → changes written since its last ANALYZE, and in all.
    growth: HashMap<String, Growth>,
    /// Dedicated topic → its table's own topic, which keys `mirrors`.
    homes: HashMap<String, String>,
}

/// The topic that keys a record's mirror: its table's own topic for a
/// record read from a dedicated topic, else its own.
fn home<'a>(homes: &'a HashMap<String, String>, topic: &'a str) -> &'a str {
    homes.get(topic).map_or(topic, String::as_str)
}

/// Writes to a mirror, for [`refresh_statistics`].
#[derive(Debug, Default)]
struct Growth {
    since: u64,
    total: u64,
}

/// Writes after which a mirror's planner statistics are refreshed: at
/// least this many, and at least a quarter of all written before.
const ANALYZE_AFTER: u64 = 10_000;

/// librdkafka's `fetch.wait.max.ms` for the live consumer when the user
/// sets none: 100 ms instead of 500. A broker that answers an empty fetch
/// only when new data arrives is unaffected (only idle fetches come more
/// often); one that polls its log while it waits, as nisshi does with
/// sleeps of half the time left, adds up to half this to every change's
/// time to visible.
const FETCH_WAIT_MAX_MS: &str = "100";

/// The live consumer's settings: offsets stored only after the target
/// commit, committed records only, and [`FETCH_WAIT_MAX_MS`] unless the
/// user set `fetch.wait.max.ms`.
fn consumer_config(kafka: &crate::config::KafkaConfig, group: &str) -> rdkafka::ClientConfig {
    let mut cc = sink::client_config(kafka);
    cc.set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed");
    if !kafka.properties.0.contains_key("fetch.wait.max.ms") {
        cc.set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS);
    }
    cc
}

/// Runs ANALYZE on mirrors written to a lot since their last one. A mirror
/// filling up (a snapshot, a rebuild) outgrows the statistics autovacuum
/// took of it when it was small, and a read model's recompute is then
/// planned as a scan of the whole mirror per batch (seen in the bench: the
/// apply rate fell fivefold). Failures only warn: statistics are an
/// optimisation.
async fn refresh_statistics(db: &Client, state: &mut State, analyze: &mut Analyze) {
    if let Analyze::Beside { running, .. } = analyze {
        // One at a time; what grows meanwhile is analyzed next time.
        if running.as_ref().is_some_and(|r| !r.is_finished()) {
            return;
        }
    }
    let mut due = Vec::new();
    for (mirror, g) in state.growth.iter_mut() {
        if g.since < ANALYZE_AFTER.max(g.total / 4) {
            continue;
        }
        g.total += g.since;
        g.since = 0;
        due.push(mirror.clone());
    }
    if due.is_empty() {
        return;
    }
    match analyze {
        Analyze::Inline => analyze_mirrors(db, &due).await,
        Analyze::Beside { url, running } => {
            let url = url.clone();
            *running = Some(tokio::spawn(async move {
                match crate::source::connect(&url).await {
                    Ok(own) => analyze_mirrors(&own, &due).await,
                    Err(e) => {
                        tracing::warn!(error = %crate::source::error_text(&e), "could not connect to refresh the mirrors' statistics")
                    }
                }
            }));
        }
    }
}

async fn analyze_mirrors(db: &Client, mirrors: &[String]) {
    for mirror in mirrors {
        if let Err(e) = db.batch_execute(&format!("ANALYZE {mirror}")).await {
            tracing::warn!(%mirror, error = %crate::source::error_text(&e), "could not refresh the mirror's statistics");
        }
    }
}

/// Where [`refresh_statistics`] runs ANALYZE.
enum Analyze {
    /// On the apply's connection between batches: a rebuild's, which
    /// swaps its mirrors in under locks an ANALYZE beside it would delay.
    Inline,
    /// On a connection of its own, beside the apply (ANALYZE takes no
    /// lock that writes wait on), so that a batch does not wait the 30 to
    /// 40 ms it takes on a mirror of a million rows.
    Beside {
        url: crate::secret::Dsn,
        running: Option<tokio::task::JoinHandle<()>>,
    },
}

/// Keys with an open dead letter: a later change of such a key that
/// leaves TOASTed columns unchanged would keep the value from before the
/// quarantined change, so it is quarantined behind it and replays after it.
/// Keys are the records' Kafka keys (the Avro key bytes, by topic), which a
/// record has even when its value cannot be decoded.
#[derive(Debug, Default)]
pub struct Held {
    /// From the store (every instance's), as of the last round.
    store: HashMap<HeldKey, &'static str>,
    /// Quarantined by this process since.
    local: HashMap<HeldKey, (&'static str, Instant)>,
}

/// `(topic, Kafka key)`.
pub type HeldKey = (String, Vec<u8>);

pub type SharedHeld = Arc<std::sync::Mutex<Held>>;

impl Held {
    fn class(&self, key: &HeldKey) -> Option<&'static str> {
        self.local
            .get(key)
            .map(|(c, _)| *c)
            .or_else(|| self.store.get(key).copied())
    }

    /// The open keys the store holds, read after `synced` (entries this
    /// process added before it are in the store now, or resolved).
    pub fn refresh(&mut self, store: HashMap<HeldKey, &'static str>, synced: Instant) {
        self.store = store;
        self.local.retain(|_, (_, at)| *at >= synced);
    }
}

/// A poisoned lock still holds good keys: holding fails closed.
fn lock_held(held: &SharedHeld) -> std::sync::MutexGuard<'_, Held> {
    held.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether a change leaves a column unchanged (an unchanged TOAST value).
fn leaves_unchanged(c: &Change) -> bool {
    c.cells
        .as_ref()
        .is_some_and(|cells| cells.iter().any(|x| matches!(x, Cell::Unchanged)))
}

fn held_failure(class: &'static str, c: &Change) -> Failure {
    Failure {
        class,
        error: "held behind an open dead letter of the same key: this change leaves TOASTed \
                columns unchanged, which the earlier change may have set; replay it after that one"
            .into(),
        position: Some(c.position),
    }
}

/// A record's key as dead letters hold it: by its table's own topic, so a
/// key that moved to or from a dedicated topic is one key.
fn held_key(
    homes: &HashMap<String, String>,
    m: &rdkafka::message::OwnedMessage,
) -> Option<HeldKey> {
    m.key()
        .map(|k| (home(homes, m.topic()).to_string(), k.to_vec()))
}

/// The class a change is held behind when it leaves a column unchanged and
/// its key was refused earlier in the batch.
fn held_in(
    homes: &HashMap<String, String>,
    refused: &HashMap<HeldKey, &'static str>,
    m: &rdkafka::message::OwnedMessage,
    c: &Change,
) -> Option<&'static str> {
    held_key(homes, m)
        .filter(|_| leaves_unchanged(c))
        .and_then(|k| refused.get(&k).copied())
}

/// Moves to `dead` every change that leaves a column unchanged while its
/// key has an open dead letter; returns the others.
fn hold_back(
    state: &State,
    batch: &[rdkafka::message::OwnedMessage],
    changes: Vec<(usize, Change)>,
    dead: &mut Vec<(usize, Failure)>,
) -> Vec<(usize, Change)> {
    let Some(held) = state.held.as_ref() else {
        return changes;
    };
    let held = lock_held(held);
    // Records of this batch that did not decode hold their keys for the
    // changes after them.
    let earlier: Vec<(usize, HeldKey, &'static str)> = dead
        .iter()
        .filter_map(|(i, f)| held_key(&state.homes, &batch[*i]).map(|k| (*i, k, f.class)))
        .collect();
    changes
        .into_iter()
        .filter_map(|(i, c)| {
            let class = held_key(&state.homes, &batch[i])
                .filter(|_| leaves_unchanged(&c))
                .and_then(|k| {
                    held.class(&k).or_else(|| {
                        earlier
                            .iter()
                            .find(|(j, e, _)| *j < i && *e == k)
                            .map(|(_, _, class)| *class)
                    })
                });
            match class {
                Some(class) => {
                    dead.push((i, held_failure(class, &c)));
                    None
                }
                None => Some((i, c)),
            }
        })
        .collect()
}

/// Remembers the keys of dead-lettered records (see [`Held`]).
fn remember<'a>(
    state: &State,
    records: impl IntoIterator<Item = (&'a rdkafka::message::OwnedMessage, &'static str)>,
) {
    if let Some(held) = state.held.as_ref() {
        let mut held = lock_held(held);
        for (m, class) in records {
            if let Some(k) = held_key(&state.homes, m) {
                held.local.insert(k, (class, Instant::now()));
            }
        }
    }
}

impl State {
    /// The live path's state: nothing cached yet, no mapping, no held keys.
    fn new(
        registry: RegistryClient,
        mirrors: HashMap<String, Mirror>,
        views: Vec<View>,
        fast: fast_tier::FastTier,
    ) -> State {
        State {
            registry,
            writers: HashMap::new(),
            mirrors,
            views,
            statements: Statements::default(),
            fast,
            mapping: None,
            held: None,
            plans: HashMap::new(),
            growth: HashMap::new(),
            homes: HashMap::new(),
        }
    }

    async fn writer(&mut self, id: u32) -> Result<Arc<Writer>, Failure> {
        if let Some(w) = self.writers.get(&id) {
            return Ok(w.clone());
        }
        let text = self.registry.schema_by_id(id).await.map_err(|e| {
            let status = e.status();
            Failure {
                // Only an id the registry does not know is the record's
                // fault; an unreachable or failing registry is retried.
                class: match classify(&Fault::SchemaLookup { status }) {
                    Verdict::Quarantine(c) => c.as_str(),
                    _ => REGISTRY_UNAVAILABLE,
                },
                error: e.to_string(),
                position: None,
            }
        })?;
        let bad = |e: String| Failure {
            class: quarantine_class(Fault::Body),
            error: format!("schema {id}: {e}"),
            position: None,
        };
        let json: Json = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let schema = Schema::parse_str(&text).map_err(|e| bad(e.to_string()))?;
        let mut names = HashMap::new();
        shape::named_types(&json, "", &mut names);
        let w = Arc::new(Writer {
            schema,
            row: shape::row_schema(&json, &names).unwrap_or(Json::Null),
            names,
        });
        self.writers.insert(id, w.clone());
        Ok(w)
    }

    /// Adds to the mirror the columns a newer writer schema has (a column
    /// added to the source table while this process runs), so that their
    /// values are written from this change on.
    async fn evolve(
        &mut self,
        db: &impl GenericClient,
        topic: &str,
        w: &Writer,
    ) -> Result<(), MaterializeError> {
        let Some(m) = self.mirrors.get_mut(home(&self.homes, topic)) else {
            return Ok(());
        };
        let added: Vec<Column> = w.row["fields"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| {
                let name = shape::column_name(f)?;
                (!m.columns.iter().any(|c| c.name == name)).then(|| Column {
                    name: name.to_string(),
                    sql_type: shape::sql_type(&f["type"], &w.names),
                })
            })
            .collect();
        if added.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = added.iter().map(|c| c.name.clone()).collect();
        m.columns.extend(added);
        if let Err(e) = m.ensure(db).await {
            // Another instance added them at the same moment.
            if !made_meanwhile(&e) {
                return Err(e.into());
            }
        }
        // Statement texts were built for the old columns.
        self.statements = Statements::default();
        tracing::info!(mirror = %m.qualified, columns = ?names, "columns added to the mirror");
        Ok(())
    }

    /// Decodes a changelog record into a change for `mirror`.
    async fn decode(&mut self, topic: &str, value: &[u8]) -> Result<Change, Failure> {
        self.decode_with(topic, value, &Readers::new()).await
    }

    /// [`State::decode`], through `readers` where one has the record's
    /// writer schema.
    async fn decode_with(
        &mut self,
        topic: &str,
        value: &[u8],
        readers: &Readers<'_>,
    ) -> Result<Change, Failure> {
        let bad = |error: String| Failure {
            class: quarantine_class(Fault::Body),
            error,
            position: None,
        };
        let (id, datum) = unframe(value).ok_or_else(|| Failure {
            class: quarantine_class(Fault::Framing),
            error: match value.first() {
                None => "an empty record".to_string(),
                Some(0) => format!("{} bytes: too short for a Confluent frame", value.len()),
                Some(b) => format!("magic byte {b:#04x}, not 0x00: not Confluent-framed Avro"),
            },
            position: None,
        })?;
        let w = self.writer(id).await?;
        let envelope = match readers.get(&id) {
            Some(r) => read_datum(r, datum),
            None => decode_datum(&w.schema, datum),
        }
        .map_err(|e| bad(e.to_string()))?;
        let Value::Record(fields) = &envelope else {
            return Err(bad("the value is not a record".into()));
        };
        let get = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| match v {
                    Value::Union(_, inner) => inner.as_ref(),
                    other => other,
                })
        };
        let op = match get("op") {
            Some(Value::String(s)) => s.clone(),
            other => return Err(bad(format!("op: {other:?}"))),
        };
        let source_long = |name: &str| match get("source") {
            Some(Value::Record(src)) => {
                src.iter()
                    .find(|(n, _)| n == name)
                    .and_then(|(_, v)| match v {
                        Value::Long(n) => Some(*n),
                        _ => None,
                    })
            }
            _ => None,
        };
        let position = source_long("commit_lsn")
            .zip(source_long("seq"))
            .ok_or_else(|| bad("source.commit_lsn/seq missing".into()))?;
        let committed_ms = source_long("ts_ms");
        let mirror = self
            .mirrors
            .get(home(&self.homes, topic))
            .ok_or_else(|| bad(format!("no mirror for topic {topic}")))?;
        let plan = match self
            .plans
            .get(&(id, topic.to_string(), mirror.columns.len()))
        {
            Some(p) => p.clone(),
            None => {
                let p = Arc::new(plan(mirror, &w, id, self.mapping.as_ref()));
                if self.mapping.is_none() {
                    self.plans
                        .insert((id, topic.to_string(), mirror.columns.len()), p.clone());
                }
                p
            }
        };
        let mapping = self.mapping.as_ref();
        let mismatch = (!plan.mismatched.is_empty()).then(|| {
            plan.mismatched
                .iter()
                .map(|(_, w)| w.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        });
        // A column's own value fails: the schema's fault only if its type changed.
        let value_class = |column: usize| {
            if plan.mismatched.iter().any(|(c, _)| *c == column) {
                classify_reader_mismatch()
            } else {
                quarantine_class(Fault::Value)
            }
        };
        let cells_of = |image: &Value| -> Result<Vec<Cell>, Failure> {
            let Value::Record(row) = image else {
                return Err(bad("row image is not a record".into()));
            };
            mirror
                .columns
                .iter()
                .zip(&plan.fields)
                .enumerate()
                .map(|(i, (c, field))| {
                    let found = field.as_ref().and_then(|(avro, schema)| {
                        row.iter()
                            .find(|(n, _)| n == avro)
                            .map(|(_, v)| (v, schema))
                    });
                    match found {
                        Some((v, schema)) => {
                            shape::cell(v, schema, &w.names).map_err(|e| Failure {
                                class: value_class(i),
                                error: format!("{}.{}: {e}", mirror.source, c.name),
                                position: Some(position),
                            })
                        }
                        // A column the writer did not have: the mapping's
                        // default, or leave it as it is.
                        None => Ok(mapping
                            .and_then(|m| m.defaults.get(&c.name))
                            .map(|d| Cell::Text(d.clone()))
                            .unwrap_or(Cell::Unchanged)),
                    }
                })
                .collect()
        };
        let after = get("after").filter(|v| !matches!(v, Value::Null));
        let before = get("before").filter(|v| !matches!(v, Value::Null));
        let (cells, image) = match op.as_str() {
            "c" | "u" | "r" => {
                let a = after.ok_or_else(|| bad(format!("op {op} without after")))?;
                let cells = cells_of(a)?;
                (Some(cells.clone()), Some(cells))
            }
            "d" => (None, before.map(cells_of).transpose()?),
            "t" => (None, None),
            other => return Err(bad(format!("unknown op {other}"))),
        };
        let key = match &image {
            Some(img) => mirror
                .key
                .iter()
                .map(|&i| match &img[i] {
                    Cell::Text(t) => Ok(t.clone()),
                    _ => Err(bad(format!(
                        "{}: key column {} is empty",
                        mirror.source, mirror.columns[i].name
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None if op == "t" => Vec::new(),
            None => return Err(bad("delete without a before image".into())),
        };
        Ok(Change {
            op,
            position,
            cells,
            cache_key: mirror.cache_key(&key),
            key,
            mismatch,
            committed_ms,
        })
    }
}

/// Works out how `w`'s records map onto `mirror` (see [`Plan`]).
fn plan(
    mirror: &Mirror,
    w: &Writer,
    id: u32,
    mapping: Option<&crate::config::DlqMappingConfig>,
) -> Plan {
    // The writer's name for a mirror column (a replay's mapping may say
    // the column was renamed since).
    let writer_name = |column: &str| -> String {
        mapping
            .and_then(|m| m.renames.iter().find(|(_, to)| *to == column))
            .map(|(from, _)| from.clone())
            .unwrap_or_else(|| column.to_string())
    };
    let fields: Vec<Option<(String, Json)>> = mirror
        .columns
        .iter()
        .map(|c| {
            let name = writer_name(&c.name);
            w.row["fields"]
                .as_array()
                .and_then(|f| {
                    f.iter()
                        .find(|f| shape::column_name(f) == Some(name.as_str()))
                })
                .and_then(|f| Some((f["name"].as_str()?.to_string(), f["type"].clone())))
        })
        .collect();
    // Types the mirror may not take (its columns only ever widen).
    let mismatched = mirror
        .columns
        .iter()
        .zip(&fields)
        .enumerate()
        .filter_map(|(i, (c, f))| {
            let (_, ty) = f.as_ref()?;
            let writer = shape::sql_type(ty, &w.names);
            (!shape::takes(&c.sql_type, &writer)).then(|| {
                (
                    i,
                    format!(
                        "{}.{}: writer schema {id} has {writer}, the mirror {}",
                        mirror.source, c.name, c.sql_type
                    ),
                )
            })
        })
        .collect();
    Plan { fields, mismatched }
}

/// Waits for a subject's latest schema (the connector may not have run
/// yet) and returns its text.
async fn latest_schema(
    registry: &RegistryClient,
    subject: &str,
) -> Result<String, MaterializeError> {
    let started = Instant::now();
    loop {
        match registry.latest(subject).await {
            Ok(Some((_, schema))) => return Ok(schema),
            Ok(None) => {}
            Err(e) => {
                // Unreachable or failing: wait for it, as for a batch.
                let Verdict::Retry(cause) = classify(&Fault::Register { status: e.status() })
                else {
                    return Err(e.into());
                };
                metrics::counter!(observe::MATERIALIZE_RETRIES, "cause" => cause).increment(1);
                tracing::warn!(%subject, error = %e, "the registry is unavailable; waiting for it");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        }
        if started.elapsed().as_secs().is_multiple_of(30) {
            tracing::info!(%subject, "waiting for the connector to register this subject");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The mirror of a captured table from its subjects' latest schemas.
async fn mirror_for(
    registry: &RegistryClient,
    config: &Config,
    table: &str,
    mirror_schema: &str,
    mirror_table: &str,
) -> Result<Mirror, MaterializeError> {
    let topic = config.topic_for(table);
    let value = latest_schema(registry, &format!("{topic}-value")).await?;
    let key = latest_schema(registry, &format!("{topic}-key")).await?;
    let value: Json =
        serde_json::from_str(&value).map_err(|e| MaterializeError::Schema(e.to_string()))?;
    let key: Json =
        serde_json::from_str(&key).map_err(|e| MaterializeError::Schema(e.to_string()))?;
    let mut names = HashMap::new();
    shape::named_types(&value, "", &mut names);
    let row = shape::row_schema(&value, &names)
        .ok_or_else(|| MaterializeError::Schema(format!("{topic}-value: no `after` record")))?;
    let columns: Vec<Column> = row["fields"]
        .as_array()
        .map(|f| {
            f.iter()
                .map(|f| Column {
                    name: shape::column_name(f).unwrap_or_default().to_string(),
                    sql_type: shape::sql_type(&f["type"], &names),
                })
                .collect()
        })
        .unwrap_or_default();
    let key_names: Vec<String> = key["fields"]
        .as_array()
        .map(|f| {
            f.iter()
                .filter_map(|f| shape::column_name(f).map(String::from))
                .collect()
        })
        .unwrap_or_default();
    Mirror::new(mirror_schema, mirror_table, table, columns, &key_names)
        .map_err(MaterializeError::Schema)
}

/// The target made ready: state schema, mirrors and read-model tables.
struct Prepared {
    registry: RegistryClient,
    /// Topic → mirror.
    mirrors: HashMap<String, Mirror>,
    views: Vec<View>,
}

/// Creates what the target needs (idempotent): the state schema, the
/// mirror of every captured table (from its subjects' latest schemas),
/// every declared read model's table, and indexes on view key columns.
async fn prepare(config: &Config, db: &Client) -> Result<Prepared, MaterializeError> {
    // `IF NOT EXISTS` is no guard against a concurrent CREATE (two
    // instances starting together collide in pg_type): one at a time.
    db.execute("SELECT pg_advisory_lock($1)", &[&PREPARE_LOCK])
        .await?;
    let prepared = prepare_locked(config, db).await;
    let unlocked = db
        .execute("SELECT pg_advisory_unlock($1)", &[&PREPARE_LOCK])
        .await;
    let prepared = prepared?;
    unlocked?;
    Ok(prepared)
}

/// Serializes [`prepare`] across processes on one target.
const PREPARE_LOCK: i64 = 0x7067_6364_7072_6570; // "pgcdcprep"

async fn prepare_locked(config: &Config, db: &Client) -> Result<Prepared, MaterializeError> {
    let target = config
        .target
        .as_ref()
        .ok_or_else(|| MaterializeError::Config("target: is required".into()))?;
    db.batch_execute(mirror::STATE_SQL).await?;
    db.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {}",
        crate::source::slot::quote_ident(&target.mirror_schema)
    ))
    .await?;
    let registry = RegistryClient::new(&config.registry)?;
    let mut mirrors = HashMap::new();
    let tables: Vec<String> = config.changelog_tables().cloned().collect();
    let names = mirror::mirror_names(&tables);
    for (table, name) in tables.iter().zip(&names) {
        let m = mirror_for(&registry, config, table, &target.mirror_schema, name).await?;
        m.ensure(db).await?;
        mirrors.insert(config.topic_for(table), m);
    }
    let mut views = Vec::new();
    for (name, rm) in &config.read_models {
        views.push(
            View::prepare(db, name, rm)
                .await
                .map_err(MaterializeError::Config)?,
        );
    }
    for view in &views {
        view.check_sources(|table| mirrors.values().find(|m| m.source == table))
            .map_err(MaterializeError::Config)?;
    }
    index_view_columns(db, &mirrors, &views).await?;
    Ok(Prepared {
        registry,
        mirrors,
        views,
    })
}

/// How often the tombstone sweep and the sweep after a new snapshot
/// ([`resnapshot::keep`]) run.
const HOUSEKEEPING: Duration = Duration::from_secs(60);

/// Runs until SIGINT/SIGTERM or an infrastructure error.
pub async fn run(config: Config) -> Result<(), MaterializeError> {
    // First of all, so a stop request during start-up ends cleanly.
    let mut shutdown = crate::Shutdown::install()
        .map_err(|e| MaterializeError::Config(format!("signals: {e}")))?;
    let config = Arc::new(config);
    let target = config
        .target
        .clone()
        .ok_or_else(|| MaterializeError::Config("target: is required".into()))?;
    let Some((mut db, prepared)) = start_on_target(&config, &target, &mut shutdown).await? else {
        tracing::info!("stopped before the target database answered");
        return Ok(());
    };
    let Prepared {
        registry,
        mirrors,
        views,
    } = prepared;
    let dlq = dlq_topic(&config);
    sink::ensure_dlq_topic(&config.kafka, &dlq).await?;
    sink::check_dlq_topic(&config.kafka, &dlq)
        .await
        .map_err(MaterializeError::Config)?;
    let producer = sink::Producer::create(&config.kafka, None).await?;
    let dead_letters = DeadLetters {
        producer: Some(&producer),
        topic: &dlq,
        sent: Default::default(),
        replay_of: None,
        max_message_bytes: config.kafka.max_message_bytes,
    };

    let group = group_id(&config, &target);
    let consumer: LiveConsumer = consumer_config(&config.kafka, &group).client_with(Commits)?;
    let homes = config.homes();
    // Dedicated topics are read as their tables' own.
    let topics: Vec<String> = mirrors.keys().chain(homes.keys()).cloned().collect();
    let topic_refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topic_refs)?;
    tracing::info!(%group, topics = topics.len(), views = views.len(), "materializing");

    let target_id: String = db
        .query_one("SELECT id::text FROM pgcdc_state.identity", &[])
        .await?
        .get(0);
    let mut fast =
        fast_tier::FastTier::new(&target.dedup, &target_id).map_err(MaterializeError::Config)?;
    if fast.has_bloom() {
        seed_bloom(&db, &mirrors, &mut fast).await?;
    }
    let mut state = State {
        held: (config.dlq.check_interval_secs > 0).then(SharedHeld::default),
        homes,
        ..State::new(registry, mirrors, views, fast)
    };
    let mut fair = fairness::Fairness::new(
        target.tenant_quota.clone(),
        fairness::TenantLabels::new(
            config
                .hot_keys
                .redact_keys
                .then(|| crate::partitioning::Fingerprints::new(&config.hot_keys)),
            target.tenant_labels,
        ),
    );
    let mut analyze = Analyze::Beside {
        url: target.url.clone(),
        running: None,
    };
    let committed = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let lag = tokio::spawn(report_lag(config.clone(), committed.clone()));
    let reach = (config.retention.check_interval_secs > 0 && !config.read_models.is_empty())
        .then(|| tokio::spawn(check_reach(config.clone())));
    let keeper = state
        .held
        .clone()
        .map(|held| tokio::spawn(crate::dlq::keep(config.clone(), held)));
    // Ends with this function, whichever way it returns.
    let _resnapshots = crate::connector::AbortOnDrop(tokio::spawn(resnapshot::keep(
        config.clone(),
        group.clone(),
        target.url.clone(),
        state.mirrors.clone(),
        state.views.clone(),
        HOUSEKEEPING,
    )));
    // At start too: an instance restarted more often than the sweep
    // interval still sweeps.
    sweep(&db, target.redelivery_window_hours).await?;
    let mut last_sweep = Instant::now();
    observe::board::set_phase(observe::board::Phase::Consuming);
    'batches: loop {
        // The tombstone sweep, also while no record comes (the wait below
        // ends for it): a target down right now is retried next time.
        if last_sweep.elapsed() >= HOUSEKEEPING {
            if let Err(e) = sweep(&db, target.redelivery_window_hours).await {
                tracing::warn!(error = %e, "tombstone sweep failed; trying again later");
            }
            last_sweep = Instant::now();
        }
        // A batch: waiting records their tenants' tokens cover, then one
        // message (waited for unless records wait), then what else is
        // ready; room left goes to the waiting (see [`fairness`]).
        let formed = Instant::now();
        // With records waiting the loop never blocks, so look for a stop
        // request here.
        if fair.waiting() > 0 && shutdown.requested().now_or_never().is_some() {
            break;
        }
        // Paused partitions whose waiting records all left are resumed
        // before the wait, which would otherwise never end.
        apply_flow(&consumer, &mut fair);
        let mut batch = fair.release(target.batch_size, false, formed);
        if batch.is_empty() && fair.waiting() == 0 {
            tokio::select! {
                _ = shutdown.requested() => break,
                _ = tokio::time::sleep_until((last_sweep + HOUSEKEEPING).into()) => continue 'batches,
                m = consumer.recv() => match m {
                    Ok(m) => batch.extend(fair.admit(m.detach(), formed)),
                    Err(e) => {
                        consumer_error(e)?;
                        // Errors can come in bursts while the broker is away.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue 'batches;
                    }
                },
            }
        }
        let mut deadline = tokio::time::Instant::now() + Duration::from_millis(20);
        // Reading past waiting records may take longer than 20 ms: on while
        // records keep coming, up to a limit (the batch's own wait).
        let limit = deadline + Duration::from_millis(230);
        while batch.len() < target.batch_size && !fair.full() {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(m)) => match fair.admit(m.detach(), formed) {
                    Some(m) => batch.push(m),
                    None => {
                        deadline = deadline
                            .max(tokio::time::Instant::now() + Duration::from_millis(2))
                            .min(limit)
                    }
                },
                Ok(Err(e)) => {
                    // Apply what came before the error.
                    consumer_error(e)?;
                    break;
                }
                Err(_) => break,
            }
        }
        apply_flow(&consumer, &mut fair);
        // After the flow decision, which must see a full buffer as full.
        if batch.len() < target.batch_size {
            let room = target.batch_size - batch.len();
            batch.extend(fair.release(room, true, formed));
        }
        if batch.is_empty() {
            continue;
        }
        let started = Instant::now();
        let mut attempt = 0u32;
        let first_failure_ms = crate::connector::now_ms();
        loop {
            let Err(e) = apply_batch(&mut state, &mut db, &dead_letters, &batch).await else {
                refresh_statistics(&db, &mut state, &mut analyze).await;
                observe::board::set_phase(observe::board::Phase::Consuming);
                break;
            };
            attempt += 1;
            if let Some(Verdict::Quarantine(class @ crate::dlq::Class::SinkUnavailable)) =
                e.target_verdict(attempt, config.dlq.max_attempts)
            {
                // The target stayed down through every attempt: the batch
                // goes to the dead-letter topic (acknowledged) and the
                // partitions move on; a replay brings it back.
                match quarantine_batch(
                    &mut state,
                    &dead_letters,
                    &batch,
                    class,
                    &e.to_string(),
                    (attempt, first_failure_ms),
                )
                .await
                {
                    Ok(n) => {
                        tracing::error!(attempts = attempt, messages = n, class = class.as_str(),
                            "target database unavailable through every attempt; the batch is quarantined (pgcdc dlq replay brings it back)");
                        metrics::counter!(observe::MATERIALIZE_DEAD_LETTERED).increment(n);
                        break;
                    }
                    // Kafka too: keep retrying; nothing moved.
                    Err(q) => {
                        tracing::warn!(error = %q, "cannot quarantine the batch yet; retrying it")
                    }
                }
            }
            let Some(cause) = e.retry_cause() else {
                return Err(e);
            };
            let delay = retry_delay(attempt);
            metrics::counter!(observe::MATERIALIZE_RETRIES, "cause" => cause).increment(1);
            observe::board::set_phase(observe::board::Phase::Restarting);
            tracing::warn!(cause, attempt, error = %e, retry_in_ms = delay.as_millis() as u64,
                "batch not applied; retrying it (its offsets stay, nothing is lost)");
            tokio::select! {
                // Nothing of the batch committed: a restart redelivers it.
                _ = shutdown.requested() => break 'batches,
                _ = tokio::time::sleep(delay) => {}
            }
            if db.is_closed() {
                match crate::source::connect(&target.url).await {
                    Ok(c) => {
                        tracing::info!("reconnected to the target database");
                        db = c;
                        // Prepared on the old connection.
                        state.statements = Statements::default();
                    }
                    Err(e) => {
                        tracing::warn!(error = %crate::source::error_text(&e), "target database still unreachable")
                    }
                }
            }
        }
        metrics::histogram!(observe::MATERIALIZE_BATCH_SECONDS)
            .record(started.elapsed().as_secs_f64());
        // Only now, with the transaction committed, do the offsets move,
        // and never past a record that waits.
        let mut next = fair.commit_points(&batch);
        fair.report(&batch, crate::connector::now_ms());
        let owned = consumer.assignment();
        // Asynchronous: the next batch need not wait for the broker's
        // answer (a failure is reported by [`Commits`]).
        commit_offsets(&consumer, &mut next, owned.as_ref().ok(), CommitMode::Async)?;
        dead_letters.batch_done();
        if let (Ok(mut c), Ok(owned)) = (committed.lock(), owned) {
            c.extend(next);
            // Partitions a rebalance gave away are the new owner's to report.
            c.retain(|(topic, partition), _| {
                let keep = owned.find_partition(topic, *partition).is_some();
                if !keep {
                    metrics::gauge!(observe::MATERIALIZE_CONSUMER_LAG,
                        "topic" => topic.clone(), "partition" => partition.to_string())
                    .set(0.0);
                }
                keep
            });
        }
    }
    // The last asynchronous commit made sure of: a restart after a clean
    // stop then redelivers nothing. Only partitions known to be still ours:
    // another owner's may be ahead by now.
    if let Ok(owned) = consumer.assignment() {
        let mut last = committed.lock().map(|c| c.clone()).unwrap_or_default();
        commit_offsets(&consumer, &mut last, Some(&owned), CommitMode::Sync)?;
    }
    if let Analyze::Beside {
        running: Some(r), ..
    } = &analyze
    {
        r.abort();
    }
    lag.abort();
    if let Some(r) = reach {
        r.abort();
    }
    if let Some(k) = keeper {
        k.abort();
    }
    tracing::info!("stopped");
    Ok(())
}

/// The wait before retry `attempt` (from 1): 0.4 s doubling to 30 s,
/// quick after a blip, gentle in an outage.
fn retry_delay(attempt: u32) -> Duration {
    Duration::from_millis(200u64 << attempt.min(8)).min(Duration::from_secs(30))
}

/// Connects to the target and prepares it. A target that is not up yet
/// (refused, starting up: what [`MaterializeError::retry_cause`] calls an
/// outage of the target, when a deploy starts both at once) is waited for
/// with backoff, as a later outage is, until `target.give_up_after_secs`
/// (if set) runs out; anything else (credentials, a missing database, a
/// refused certificate, a bad read model) stops it. `None` when a stop is
/// asked for while waiting.
async fn start_on_target(
    config: &Config,
    target: &crate::config::TargetConfig,
    shutdown: &mut crate::Shutdown,
) -> Result<Option<(Client, Prepared)>, MaterializeError> {
    let mut outage = crate::connector::Outage::with_backoff(
        target.give_up_after_secs,
        retry_delay(1),
        retry_delay(u32::MAX),
    );
    let mut attempt = 0u32;
    loop {
        let started = async {
            let db = crate::source::connect(&target.url).await?;
            let prepared = prepare(config, &db).await?;
            Ok::<_, MaterializeError>((db, prepared))
        }
        .await;
        let e = match started {
            Ok(ready) => return Ok(Some(ready)),
            Err(e) => e,
        };
        let refused =
            matches!(&e, MaterializeError::Postgres(pg) if crate::source::tls::refused(pg));
        if refused || e.retry_cause() != Some("target") {
            return Err(e);
        }
        attempt += 1;
        // No attempt here ran healthy for a while: each failure is the
        // same outage, however long a connect took to fail.
        let now = Instant::now();
        let delay = match outage.failed(now, now) {
            crate::connector::Next::Wait(d) => d,
            crate::connector::Next::GiveUp(lasted) => {
                return Err(MaterializeError::GaveUp {
                    lasted_secs: lasted.as_secs(),
                    limit_secs: target.give_up_after_secs,
                    last: Box::new(e),
                })
            }
        };
        metrics::counter!(observe::MATERIALIZE_RETRIES, "cause" => "target").increment(1);
        tracing::warn!(attempt, error = %e, retry_in_ms = delay.as_millis() as u64,
            "target database not reachable at start-up; waiting for it");
        tokio::select! {
            _ = shutdown.requested() => return Ok(None),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Commits `offsets` (the next offset to read per partition), keeping
/// only the partitions in `owned` when it is known: a partition a
/// rebalance gave away (its waiting records applied here anyway) is its
/// new owner's to commit, and ours could be behind. A failed commit only
/// warns: the changes are redelivered and the position guard skips them.
fn commit_offsets(
    consumer: &LiveConsumer,
    offsets: &mut BTreeMap<(String, i32), i64>,
    owned: Option<&TopicPartitionList>,
    mode: CommitMode,
) -> Result<(), MaterializeError> {
    if let Some(owned) = owned {
        offsets.retain(|(topic, partition), _| owned.find_partition(topic, *partition).is_some());
    }
    if offsets.is_empty() {
        return Ok(());
    }
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), offset) in offsets.iter() {
        tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
    }
    if let Err(e) = consumer.commit(&tpl, mode) {
        tracing::warn!(error = %e, "offset commit failed; the changes will be redelivered and skipped");
    }
    Ok(())
}

/// The live consumer: its offset commits are asynchronous, so a failed
/// one is reported here.
type LiveConsumer = StreamConsumer<Commits>;

/// See [`LiveConsumer`].
struct Commits;

crate::sink::quiet_client_context!(Commits);

impl ConsumerContext for Commits {
    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, _: &TopicPartitionList) {
        if let Err(e) = result {
            // After a rebalance the new owner re-reads; the guard skips.
            tracing::warn!(error = %e, "offset commit failed; the changes will be redelivered and skipped");
        }
    }
}

/// Pauses the partitions holding waiting records when the tenant quota's
/// buffer is full, and resumes them once it has drained to half (see
/// [`fairness`]). A resume that fails is tried again next time.
fn apply_flow(consumer: &LiveConsumer, fair: &mut fairness::Fairness) {
    let (pause, resume) = fair.flow();
    for (partitions, pausing) in [(pause, true), (resume, false)] {
        if partitions.is_empty() {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &partitions {
            tpl.add_partition(topic, *partition);
        }
        let done = match pausing {
            true => consumer.pause(&tpl),
            false => consumer.resume(&tpl),
        };
        match done {
            Ok(()) if pausing => tracing::info!(
                partitions = partitions.len(),
                waiting = fair.waiting(),
                "tenant quota buffer full: pausing the partitions that hold waiting records"
            ),
            Ok(()) => tracing::info!(
                partitions = partitions.len(),
                waiting = fair.waiting(),
                "tenant quota buffer drained to half: resuming"
            ),
            Err(e) => {
                tracing::warn!(error = %e, pausing, "cannot pause or resume partitions; trying again");
                if !pausing {
                    fair.still_paused(partitions);
                }
            }
        }
    }
}

/// An error the consumer reported instead of a message: a broker outage
/// is logged (librdkafka reconnects by itself, and offsets stay where they
/// are), a refusal stops the materializer. Decided by [`classify`].
fn consumer_error(e: rdkafka::error::KafkaError) -> Result<(), MaterializeError> {
    match classify(&Fault::Broker {
        refused: sink::refused(&e),
    }) {
        Verdict::Retry(cause) => {
            metrics::counter!(observe::MATERIALIZE_RETRIES, "cause" => cause).increment(1);
            tracing::warn!(error = %e, "the consumer lost the broker; waiting for it");
            Ok(())
        }
        _ => Err(e.into()),
    }
}

/// Every `retention.check_interval_secs`: every read model's rebuild reach
/// and the slot's WAL as metrics, with a warning for each requirement not
/// met (see [`crate::retention`]).
async fn check_reach(config: Arc<Config>) {
    let every = Duration::from_secs(config.retention.check_interval_secs);
    loop {
        match crate::retention::gather(&config, None, None).await {
            Ok(report) => report.export(),
            Err(e) => {
                metrics::counter!(observe::RETENTION_CHECK_ERRORS).increment(1);
                tracing::warn!(error = %e, "rebuild reach check failed; trying again later");
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// Every 5 s: consumer lag per partition, the high watermark minus the
/// offset this instance committed last, from a client of its own (so the
/// apply loop never waits on it).
async fn report_lag(
    config: Arc<Config>,
    committed: Arc<std::sync::Mutex<BTreeMap<(String, i32), i64>>>,
) {
    let client: rdkafka::consumer::BaseConsumer<sink::Quiet> =
        match sink::client_config(&config.kafka).client() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "no consumer lag metric: cannot create a Kafka client");
                return;
            }
        };
    let client = Arc::new(client);
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let offsets: Vec<((String, i32), i64)> = match committed.lock() {
            Ok(c) => c.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            Err(_) => return,
        };
        let c = client.clone();
        let highs = tokio::task::spawn_blocking(move || {
            offsets
                .into_iter()
                .filter_map(|((topic, partition), offset)| {
                    let (_, high) = c
                        .fetch_watermarks(&topic, partition, Duration::from_secs(5))
                        .ok()?;
                    Some((topic, partition, (high - offset).max(0)))
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        for (topic, partition, lag) in highs {
            metrics::gauge!(observe::MATERIALIZE_CONSUMER_LAG,
                "topic" => topic, "partition" => partition.to_string())
            .set(lag as f64);
        }
    }
}

/// Indexes every mirror column a read model maps to its keys
/// (`key_columns`): views filter and join on them, and without an index
/// each recompute scans the mirror.
async fn index_view_columns(
    db: &Client,
    mirrors: &HashMap<String, Mirror>,
    views: &[View],
) -> Result<(), MaterializeError> {
    for view in views {
        for (table, mapping) in &view.sources {
            let view::Mapping::Columns(cols) = mapping else {
                continue;
            };
            let Some(m) = mirrors.values().find(|m| &m.source == table) else {
                continue;
            };
            let key: Vec<&str> = m.key.iter().map(|&i| m.columns[i].name.as_str()).collect();
            if key.starts_with(&cols.iter().map(String::as_str).collect::<Vec<_>>()) {
                continue; // the primary key's index serves it
            }
            let name = index_name(&m.table, &cols.join(","));
            let sql = format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} ({})",
                crate::source::slot::quote_ident(&name),
                m.qualified,
                view::column_list(cols)
            );
            if let Err(e) = db.batch_execute(&sql).await {
                // Another instance starting at the same moment made it.
                if !made_meanwhile(&e) {
                    return Err(e.into());
                }
            }
        }
    }
    Ok(())
}

/// Whether DDL with `IF NOT EXISTS` failed only because a concurrent
/// transaction (another instance) created the same object first.
fn made_meanwhile(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::DUPLICATE_TABLE
            || *c == SqlState::DUPLICATE_COLUMN
            || *c == SqlState::UNIQUE_VIOLATION
    })
}

/// `<mirror>_<column>_pgcdc`; past Postgres's 63 bytes, cut and made
/// distinct again by a hash of the whole name.
fn index_name(table: &str, column: &str) -> String {
    let full = format!("{table}_{column}_pgcdc");
    if full.len() <= 63 {
        return full;
    }
    // FNV-1a: stable across Rust releases, so the name is too.
    let hash = full.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let mut cut = 50;
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}_{:012x}", &full[..cut], hash & 0xffff_ffff_ffff)
}

/// Fills the Bloom filter with every key the durable tier holds: mirror
/// rows and tombstones. (A key it misses only costs a round trip.)
async fn seed_bloom(
    db: &Client,
    mirrors: &HashMap<String, Mirror>,
    fast: &mut fast_tier::FastTier,
) -> Result<(), MaterializeError> {
    let started = Instant::now();
    let mut keys = 0u64;
    for m in mirrors.values() {
        let rows = db
            .query_raw(
                &format!("SELECT {} FROM {}", m.key_as_text(), m.qualified),
                std::iter::empty::<i32>(),
            )
            .await?;
        pin_mut!(rows);
        while let Some(row) = rows.try_next().await? {
            let key: Vec<String> = (0..m.key.len())
                .map(|i| row.get::<_, Option<String>>(i).unwrap_or_default())
                .collect();
            fast.seen(&m.cache_key(&key));
            keys += 1;
        }
    }
    let rows = db
        .query_raw(
            "SELECT mirror || '|' || key FROM pgcdc_state.tombstones",
            std::iter::empty::<i32>(),
        )
        .await?;
    pin_mut!(rows);
    while let Some(row) = rows.try_next().await? {
        fast.seen(row.get::<_, &str>(0));
        keys += 1;
    }
    tracing::info!(
        keys,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "bloom filter seeded from the durable tier"
    );
    Ok(())
}

/// Removes tombstones older than the redelivery window, but none deleted
/// since the oldest open dead letter failed: its replay's idempotency
/// check needs them, or it would bring a deleted row back.
async fn sweep(db: &Client, hours: u64) -> Result<(), MaterializeError> {
    let has_store: bool = db
        .query_one("SELECT to_regclass('pgcdc_dlq.messages') IS NOT NULL", &[])
        .await?
        .get(0);
    let oldest_open = if has_store {
        "(SELECT min(first_failure) FROM pgcdc_dlq.messages WHERE state NOT IN ('replayed', 'archived'))"
    } else {
        "NULL::timestamptz"
    };
    let removed = db
        .execute(
            &format!(
                "DELETE FROM pgcdc_state.tombstones
                 WHERE deleted_at < now() - make_interval(hours => $1)
                   AND deleted_at < coalesce({oldest_open}, 'infinity')"
            ),
            &[&(hours as i32)],
        )
        .await?;
    if removed > 0 {
        tracing::info!(removed, "tombstones past the redelivery window removed");
    }
    Ok(())
}

/// Whether a database error is about the data (the row goes to the
/// dead-letter topic) rather than the database (retry the batch).
fn is_data_error(e: &tokio_postgres::Error) -> Option<&'static str> {
    let fault = Fault::Target {
        sqlstate: Some(e.code()?.code()),
        attempts: 1,
        max_attempts: 0,
    };
    match classify(&fault) {
        Verdict::Quarantine(c) => Some(c.as_str()),
        _ => None,
    }
}

fn classify_reader_mismatch() -> &'static str {
    quarantine_class(Fault::ReaderMismatch)
}

/// The class of a fault that always quarantines.
fn quarantine_class(fault: Fault<'_>) -> &'static str {
    match classify(&fault) {
        Verdict::Quarantine(c) => c.as_str(),
        // Not reached for the faults passed here; the safest class.
        _ => crate::dlq::Class::Deserialization.as_str(),
    }
}

/// Decodes a batch: its changes, and the records that cannot be decoded
/// (with why). Columns a newer writer schema has are added to the mirror
/// first. An unreachable registry is an error, not a record's fault.
async fn decode_batch(
    state: &mut State,
    db: &impl GenericClient,
    batch: &[rdkafka::message::OwnedMessage],
) -> Result<(Vec<(usize, Change)>, Vec<(usize, Failure)>), MaterializeError> {
    let mut dead: Vec<(usize, Failure)> = Vec::new();
    let mut changes: Vec<(usize, Change)> = Vec::new();
    // Every writer's new columns first: a change decoded before a later
    // one grew the mirror would have fewer cells than the mirror columns.
    let mut seen: Vec<(u32, &str)> = Vec::new();
    let mut writers: Vec<(u32, Arc<Writer>)> = Vec::new();
    for m in batch {
        if let Some((id, _)) = m.payload().and_then(unframe) {
            if seen.contains(&(id, m.topic())) {
                continue;
            }
            seen.push((id, m.topic()));
            if let Ok(w) = state.writer(id).await {
                state.evolve(db, m.topic(), &w).await?;
                if !writers.iter().any(|(i, _)| *i == id) {
                    writers.push((id, w));
                }
            }
        }
    }
    // One reader per writer schema for the whole batch.
    let readers: Readers<'_> = writers
        .iter()
        .filter_map(|(id, w)| Some((*id, datum_reader(&w.schema).ok()?)))
        .collect();
    for (i, m) in batch.iter().enumerate() {
        // Tombstones only serve compaction; the delete event came first.
        let Some(value) = m.payload() else { continue };
        match state.decode_with(m.topic(), value, &readers).await {
            Ok(c) => changes.push((i, c)),
            Err(f) if f.class == REGISTRY_UNAVAILABLE => {
                return Err(MaterializeError::RegistryUnavailable(f.error));
            }
            Err(f) => dead.push((i, f)),
        }
    }
    Ok((changes, dead))
}

/// Sends every message of a batch the target could not take to the
/// dead-letter topic with `class`; returns how many. The position comes
/// from decoding without the target (best effort: a record that does not
/// decode goes without one).
async fn quarantine_batch(
    state: &mut State,
    dead_letters: &DeadLetters<'_>,
    batch: &[rdkafka::message::OwnedMessage],
    class: crate::dlq::Class,
    error: &str,
    attempts: (u32, i64),
) -> Result<u64, MaterializeError> {
    let mut n = 0;
    for m in batch {
        let Some(value) = m.payload() else { continue };
        let outage = |position| Failure {
            class: class.as_str(),
            error: error.to_string(),
            position,
        };
        // A record that could not be applied anyway keeps its own class.
        let f = match state.decode(m.topic(), value).await {
            Ok(c) => outage(Some(c.position)),
            Err(f) if f.class == REGISTRY_UNAVAILABLE => outage(None),
            Err(f) => f,
        };
        dead_letters.send_after(m, &f, attempts).await?;
        // Only once the dead letter is durable: a round's refresh must
        // find it in the store when it drops this entry.
        remember(state, [(m, f.class)]);
        n += 1;
    }
    Ok(n)
}

/// What a batch did.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    applied: u64,
    duplicates: u64,
    dead_lettered: u64,
}

async fn apply_batch(
    state: &mut State,
    db: &mut Client,
    dead_letters: &DeadLetters<'_>,
    batch: &[rdkafka::message::OwnedMessage],
) -> Result<Tally, MaterializeError> {
    let (changes, mut dead) = decode_batch(state, &*db, batch).await?;
    let changes = hold_back(state, batch, changes, &mut dead);
    let mut keys: Vec<&str> = Vec::new();
    // Inserts of keys the Bloom filter never saw: one guarded statement.
    let mut fresh: HashSet<String> = HashSet::new();
    for (_, c) in changes.iter().filter(|(_, c)| c.op != "t") {
        keys.push(&c.cache_key);
        if (c.op == "c" || c.op == "r") && !state.fast.may_have_seen(&c.cache_key) {
            fresh.insert(c.cache_key.clone());
        }
    }
    let known = state.fast.lookup(&keys).await?;
    let lookups = Lookups { known, fresh };
    // Undecodable records are durable in the dead-letter topic before the
    // batch commits (a redelivery fails and sends them again).
    for (i, f) in &dead {
        dead_letters.send(&batch[*i], f).await?;
    }
    let mut done = match apply_with_retry(state, db, dead_letters, batch, &changes, &lookups).await
    {
        Ok(done) => done,
        Err(MaterializeError::ViewRejected { .. }) => {
            // Find the change(s) the view cannot take: one transaction each.
            tracing::warn!("a read model rejected this batch; applying it one change at a time (the change it rejects is dead-lettered with the error)");
            let mut total = Done::default();
            // Keys refused so far: later changes of one that leave a
            // column unchanged wait behind it (see [`Held`]).
            let mut refused: HashMap<HeldKey, &'static str> = HashMap::new();
            for one in changes.chunks(1) {
                let (i, change) = &one[0];
                if let Some(class) = held_in(&state.homes, &refused, &batch[*i], change)
                    .filter(|_| state.held.is_some())
                {
                    let f = held_failure(class, change);
                    dead_letters.send(&batch[*i], &f).await?;
                    total.dead.push((*i, f));
                    continue;
                }
                match apply_with_retry(state, db, dead_letters, batch, one, &lookups).await {
                    Ok(done) => {
                        for (j, f) in &done.dead {
                            if let Some(k) = held_key(&state.homes, &batch[*j]) {
                                refused.insert(k, f.class);
                            }
                        }
                        total.add(done)
                    }
                    Err(MaterializeError::ViewRejected { class, error }) => {
                        if let Some(k) = held_key(&state.homes, &batch[*i]) {
                            refused.insert(k, class);
                        }
                        let f = Failure {
                            class,
                            error,
                            position: Some(change.position),
                        };
                        // Nothing of it committed; durable in the topic
                        // before the offsets move.
                        dead_letters.send(&batch[*i], &f).await?;
                        total.dead.push((*i, f));
                    }
                    Err(e) => return Err(e),
                }
            }
            total
        }
        Err(e) => return Err(e),
    };
    dead.append(&mut done.dead);
    // Keys of what was dead-lettered (durable by now), decodable or not.
    remember(state, dead.iter().map(|(i, f)| (&batch[*i], f.class)));
    state.fast.committed(&done.committed).await?;
    for (i, _) in changes.iter().filter(|(_, c)| c.op != "t") {
        if let Some(m) = state.mirrors.get(home(&state.homes, batch[*i].topic())) {
            match state.growth.get_mut(&m.qualified) {
                Some(g) => g.since += 1,
                None => {
                    state
                        .growth
                        .insert(m.qualified.clone(), Growth { since: 1, total: 0 });
                }
            }
        }
    }
    let now = crate::connector::now_ms();
    let latency = metrics::histogram!(observe::COMMIT_TO_VIEW);
    for (i, c) in &changes {
        if let Some(at) = c.committed_ms.filter(|_| !dead.iter().any(|(j, _)| j == i)) {
            latency.record((now - at).max(0) as f64 / 1e3);
        }
    }
    metrics::counter!(observe::MATERIALIZE_FAST_TIER_HITS).increment(done.fast_hits);
    metrics::counter!(observe::MATERIALIZE_BLOOM_SKIPS).increment(done.bloom_skips);
    metrics::counter!(observe::MATERIALIZE_COPIED).increment(done.copied);
    for (table, applied, duplicates) in &done.tables.0 {
        metrics::counter!(observe::MATERIALIZE_APPLIED, "table" => table.clone())
            .increment(*applied);
        metrics::counter!(observe::MATERIALIZE_DUPLICATES, "table" => table.clone())
            .increment(*duplicates);
    }
    metrics::counter!(observe::MATERIALIZE_DEAD_LETTERED).increment(dead.len() as u64);
    Ok(Tally {
        applied: done.applied,
        duplicates: done.duplicates,
        dead_lettered: dead.len() as u64,
    })
}

/// What the fast tier said about a batch's keys before it started.
struct Lookups {
    /// Committed positions the fast tier knows.
    known: HashMap<String, mirror::Position>,
    /// Keys the Bloom filter never saw (inserts only).
    fresh: HashSet<String>,
}

/// [`apply_once`], redone after a serialization failure or deadlock.
async fn apply_with_retry(
    state: &mut State,
    db: &mut Client,
    dead_letters: &DeadLetters<'_>,
    batch: &[rdkafka::message::OwnedMessage],
    changes: &[(usize, Change)],
    lookups: &Lookups,
) -> Result<Done, MaterializeError> {
    let (mut attempt, mut careful) = (0u32, false);
    loop {
        attempt += 1;
        match apply_once(state, db, dead_letters, batch, changes, lookups, careful).await {
            Err(MaterializeError::Rejected) => careful = true,
            // Another instance's transaction touched what this one read (a
            // view joining rows of two partitions): redo the batch.
            Err(MaterializeError::Postgres(e)) if is_retryable(&e) && attempt < 20 => {
                metrics::counter!(observe::MATERIALIZE_RETRIES, "cause" => "conflict").increment(1);
                tracing::debug!(attempt, error = %crate::source::error_text(&e), "batch conflicted; retrying");
                tokio::time::sleep(Duration::from_millis(10 * u64::from(attempt))).await;
            }
            other => return other,
        }
    }
}

/// Serialization failures and deadlocks: the batch can simply be redone.
fn is_retryable(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        *c == tokio_postgres::error::SqlState::T_R_SERIALIZATION_FAILURE
            || *c == tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED
    })
}

/// What one committed attempt at a batch did.
#[derive(Default)]
struct Done {
    committed: Vec<(String, mirror::Position)>,
    dead: Vec<(usize, Failure)>,
    applied: u64,
    duplicates: u64,
    fast_hits: u64,
    bloom_skips: u64,
    /// Of the bloom skips, rows written by COPY.
    copied: u64,
    tables: PerTable,
}

impl Done {
    fn add(&mut self, other: Done) {
        self.committed.extend(other.committed);
        self.dead.extend(other.dead);
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.fast_hits += other.fast_hits;
        self.bloom_skips += other.bloom_skips;
        self.copied += other.copied;
        for (t, a, d) in other.tables.0 {
            self.tables.count(&t, a, d);
        }
    }

    fn applied_to(&mut self, m: &Mirror, n: u64) {
        self.applied += n;
        self.tables.count(&m.source, n, 0);
    }

    fn duplicate_of(&mut self, m: &Mirror, n: u64) {
        self.duplicates += n;
        self.tables.count(&m.source, 0, n);
    }
}

/// Applied and duplicate counts by source table, for the metrics: a batch
/// touches a few tables, so a short list beats a map.
#[derive(Default)]
struct PerTable(Vec<(String, u64, u64)>);

impl PerTable {
    fn count(&mut self, table: &str, applied: u64, duplicates: u64) {
        match self.0.iter_mut().find(|(t, _, _)| t == table) {
            Some((_, a, d)) => {
                *a += applied;
                *d += duplicates;
            }
            None => self.0.push((table.to_string(), applied, duplicates)),
        }
    }
}

/// Adds the view keys a mirror row maps to now, for every view that reads
/// the mirror's table.
async fn view_keys(
    tx: &tokio_postgres::Transaction<'_>,
    statements: &mut Statements,
    views: &[View],
    m: &Mirror,
    key: &[String],
    affected: &mut [BTreeSet<String>],
) -> Result<(), tokio_postgres::Error> {
    for (view, out) in views.iter().zip(affected.iter_mut()) {
        for (t, mapping) in &view.sources {
            if t == &m.source {
                view.keys_of(tx, statements, mapping, m, key, out).await?;
            }
        }
    }
    Ok(())
}

/// Applies a batch in one serializable transaction and commits it.
/// A transaction of the apply, the sweep or a replay. Serializable: two
/// instances recomputing a view from rows of different partitions must not
/// each miss the other's change.
async fn serializable(
    db: &mut Client,
) -> Result<tokio_postgres::Transaction<'_>, tokio_postgres::Error> {
    db.build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::Serializable)
        .start()
        .await
}

async fn apply_once(
    state: &mut State,
    db: &mut Client,
    dead_letters: &DeadLetters<'_>,
    batch: &[rdkafka::message::OwnedMessage],
    changes: &[(usize, Change)],
    lookups: &Lookups,
    careful: bool,
) -> Result<Done, MaterializeError> {
    let tx = serializable(db).await?;
    let done = apply_in(&tx, state, batch, changes, lookups, careful).await?;
    // Rejected changes are durable in the dead-letter topic before the
    // batch commits: once it has, a newer change of the same key would
    // make a redelivered rejected one look like a duplicate. (A retried
    // attempt may send one twice; the dead-letter workflow deduplicates
    // by origin offset.)
    for (i, f) in &done.dead {
        dead_letters.send(&batch[*i], f).await?;
    }
    tx.commit().await?;
    Ok(done)
}

/// Applies a batch's changes and recomputes the views they affect, inside
/// `tx` (which the caller commits). `careful`: a savepoint per change, so
/// a rejected change is set aside instead of losing the transaction.
async fn apply_in(
    tx: &tokio_postgres::Transaction<'_>,
    state: &mut State,
    batch: &[rdkafka::message::OwnedMessage],
    changes: &[(usize, Change)],
    lookups: &Lookups,
    careful: bool,
) -> Result<Done, MaterializeError> {
    if !careful {
        let mut affected: Vec<BTreeSet<String>> = vec![BTreeSet::new(); state.views.len()];
        let done = apply_sets(tx, state, batch, changes, lookups, &mut affected)
            .await
            .map_err(|e| match is_data_error(&e) {
                // The transaction is lost; redo the batch with savepoints.
                Some(_) => MaterializeError::Rejected,
                None => MaterializeError::Postgres(e),
            })?;
        recompute_views(tx, &state.views, &mut state.statements, &affected).await?;
        return Ok(done);
    }
    let state_holds = state.held.is_some();
    let (views, mirrors, statements) = (&state.views, &state.mirrors, &mut state.statements);
    let homes = &state.homes;
    let mut done = Done::default();
    let mut affected: Vec<BTreeSet<String>> = vec![BTreeSet::new(); views.len()];
    // Keys refused in this batch: a later change of one that leaves a
    // column unchanged waits behind it (see [`Held`]).
    let mut refused: HashMap<HeldKey, &'static str> = HashMap::new();
    for (i, change) in changes {
        let Some(m) = mirrors.get(home(homes, batch[*i].topic())) else {
            continue;
        };
        if let Some(class) = held_in(homes, &refused, &batch[*i], change).filter(|_| state_holds) {
            done.dead.push((*i, held_failure(class, change)));
            continue;
        }
        let cache_key = &change.cache_key;
        // The fast tier can only say "applied"; everything else is checked
        // against the durable positions below.
        if change.op != "t"
            && lookups
                .known
                .get(cache_key)
                .is_some_and(|p| change.position <= *p)
        {
            done.duplicate_of(m, 1);
            done.fast_hits += 1;
            continue;
        }
        let fresh = lookups.fresh.contains(cache_key);
        // A savepoint per change only when a change was rejected before:
        // more than 64 subtransactions slow every visibility check of the
        // transaction, so the common case runs without them.
        if careful {
            tx.batch_execute("SAVEPOINT change").await?;
        }
        let sp = tx;
        let result: Result<Outcome, tokio_postgres::Error> = async {
            if change.op == "t" {
                // Every view row that may depend on the table.
                for (v, view) in views.iter().enumerate() {
                    if view.sources.iter().any(|(t, _)| t == &m.source) {
                        view.all_keys(sp, &mut affected[v]).await?;
                    }
                }
                return mirror::truncate(sp, m, change.position).await;
            }
            if let (true, Some(cells)) = (fresh, &change.cells) {
                if mirror::insert_new(sp, statements, m, cells, change.position).await? {
                    // No row before it: only the new row's view keys.
                    view_keys(sp, statements, views, m, &change.key, &mut affected).await?;
                    return Ok(Outcome::Inserted);
                }
            }
            if !mirror::is_new(sp, statements, m, &change.key, change.position).await? {
                return Ok(Outcome::Duplicate);
            }
            // View keys of the row as it was, then as it is.
            view_keys(sp, statements, views, m, &change.key, &mut affected).await?;
            match &change.cells {
                Some(cells) => mirror::upsert(sp, statements, m, cells, change.position).await?,
                None => mirror::delete(sp, statements, m, &change.key, change.position).await?,
            };
            view_keys(sp, statements, views, m, &change.key, &mut affected).await?;
            Ok(Outcome::Applied)
        }
        .await;
        match result {
            Ok(outcome) => {
                if careful {
                    tx.batch_execute("RELEASE SAVEPOINT change").await?;
                }
                match outcome {
                    Outcome::Applied | Outcome::Inserted => {
                        done.applied_to(m, 1);
                        done.bloom_skips += u64::from(outcome == Outcome::Inserted);
                        if change.op != "t" {
                            done.committed.push((cache_key.clone(), change.position));
                        }
                    }
                    Outcome::Duplicate => done.duplicate_of(m, 1),
                }
            }
            Err(e) => match is_data_error(&e) {
                // The transaction is lost; redo the batch with savepoints.
                Some(_) if !careful => return Err(MaterializeError::Rejected),
                Some(class) => {
                    tx.batch_execute("ROLLBACK TO SAVEPOINT change").await?;
                    let mut error = crate::source::error_text(&e);
                    // A value refused where the writer's type is not the
                    // mirror's: the schema changed under the mirror.
                    let class = match &change.mismatch {
                        Some(m) if class == quarantine_class(Fault::Value) => {
                            error = format!("{error} ({m})");
                            classify_reader_mismatch()
                        }
                        _ => class,
                    };
                    if let Some(k) = held_key(homes, &batch[*i]) {
                        refused.insert(k, class);
                    }
                    done.dead.push((
                        *i,
                        Failure {
                            class,
                            error,
                            position: Some(change.position),
                        },
                    ));
                }
                None => return Err(e.into()),
            },
        }
    }
    recompute_views(tx, views, statements, &affected).await?;
    Ok(done)
}

/// Recomputes each view's affected keys.
async fn recompute_views(
    tx: &tokio_postgres::Transaction<'_>,
    views: &[View],
    statements: &mut Statements,
    affected: &[BTreeSet<String>],
) -> Result<(), MaterializeError> {
    for (view, keys) in views.iter().zip(affected) {
        view.recompute(tx, statements, keys)
            .await
            .map_err(|e| match e {
                view::ViewError::Db(e) => match is_data_error(&e) {
                    Some(class) => MaterializeError::ViewRejected {
                        class,
                        error: format!("{}: {}", view.name, crate::source::error_text(&e)),
                    },
                    None => MaterializeError::Postgres(e),
                },
                view::ViewError::Key(error) => MaterializeError::ViewRejected {
                    class: "unsupported_value",
                    error,
                },
                view::ViewError::Duplicate(error) => MaterializeError::ViewRejected {
                    class: crate::dlq::Class::ConstraintViolation.as_str(),
                    error,
                },
            })?;
    }
    Ok(())
}

/// A batch's changes applied set-wise: the changes are cut into windows in
/// which every key occurs once (a truncate stands alone), and each window
/// costs a few statements per mirror instead of several per change. The
/// outcome is the one-change-at-a-time path's: the same position guard
/// under the same key locks, and view keys read before the window's
/// writes and after them, which covers every view row a change in it can
/// move (views are functions of the mirrors' state). A value the target
/// refuses fails the whole statement, and the caller redoes the batch one
/// change at a time ([`apply_in`] with `careful`).
async fn apply_sets(
    tx: &tokio_postgres::Transaction<'_>,
    state: &mut State,
    batch: &[rdkafka::message::OwnedMessage],
    changes: &[(usize, Change)],
    lookups: &Lookups,
    affected: &mut [BTreeSet<String>],
) -> Result<Done, tokio_postgres::Error> {
    let (views, mirrors, statements) = (&state.views, &state.mirrors, &mut state.statements);
    let homes = &state.homes;
    let mut done = Done::default();
    let mut window: Vec<(&Mirror, &Change)> = Vec::new();
    let mut in_window: HashSet<&str> = HashSet::new();
    for (i, change) in changes {
        let Some(m) = mirrors.get(home(homes, batch[*i].topic())) else {
            continue;
        };
        if change.op == "t" {
            apply_window(tx, statements, views, &window, lookups, affected, &mut done).await?;
            window.clear();
            in_window.clear();
            // Every view row that may depend on the table.
            for (v, view) in views.iter().enumerate() {
                if view.sources.iter().any(|(t, _)| t == &m.source) {
                    view.all_keys(tx, &mut affected[v]).await?;
                }
            }
            match mirror::truncate(tx, m, change.position).await? {
                Outcome::Duplicate => done.duplicate_of(m, 1),
                Outcome::Applied | Outcome::Inserted => done.applied_to(m, 1),
            }
            continue;
        }
        // The fast tier can only say "applied"; everything else is checked
        // against the durable positions.
        if lookups
            .known
            .get(&change.cache_key)
            .is_some_and(|p| change.position <= *p)
        {
            done.duplicate_of(m, 1);
            done.fast_hits += 1;
            continue;
        }
        if !in_window.insert(&change.cache_key) {
            apply_window(tx, statements, views, &window, lookups, affected, &mut done).await?;
            window.clear();
            in_window.clear();
            in_window.insert(&change.cache_key);
        }
        window.push((m, change));
    }
    apply_window(tx, statements, views, &window, lookups, affected, &mut done).await?;
    Ok(done)
}

/// One window of [`apply_sets`]: keys distinct, no truncate.
async fn apply_window(
    tx: &tokio_postgres::Transaction<'_>,
    statements: &mut Statements,
    views: &[View],
    window: &[(&Mirror, &Change)],
    lookups: &Lookups,
    affected: &mut [BTreeSet<String>],
    done: &mut Done,
) -> Result<(), tokio_postgres::Error> {
    fn row<'a>(c: &&'a Change) -> mirror::SetRow<'a> {
        mirror::SetRow {
            key: &c.key,
            cells: c.cells.as_deref(),
            position: c.position,
        }
    }
    let mut groups: Vec<(&Mirror, Vec<&Change>)> = Vec::new();
    for (m, c) in window {
        match groups.iter_mut().find(|(g, _)| g.qualified == m.qualified) {
            Some((_, cs)) => cs.push(c),
            None => groups.push((m, vec![c])),
        }
    }
    // Per mirror: the changes to write, and the inserts already written.
    let mut writes: Vec<Writes<'_>> = Vec::new();
    let mut inserted: Vec<(&Mirror, Vec<&Change>)> = Vec::new();
    for (m, cs) in groups {
        // Rows of keys the Bloom filter never saw: inserted by one guarded
        // statement; those it finds stored take the full path.
        let (fresh, mut rest): (Vec<&Change>, Vec<&Change>) = cs
            .into_iter()
            .partition(|c| c.cells.is_some() && lookups.fresh.contains(&c.cache_key));
        if !fresh.is_empty() {
            let rows: Vec<_> = fresh.iter().map(row).collect();
            let got: HashSet<usize> = if rows.len() >= mirror::COPY_MIN_ROWS {
                let (got, copied) = mirror::copy_new_many(tx, statements, m, &rows).await?;
                if copied {
                    done.copied += got.len() as u64;
                }
                got.into_iter().collect()
            } else {
                mirror::insert_new_many(tx, statements, m, &rows)
                    .await?
                    .into_iter()
                    .collect()
            };
            let mut ins = Vec::new();
            for (j, c) in fresh.into_iter().enumerate() {
                if got.contains(&j) {
                    ins.push(c);
                } else {
                    rest.push(c);
                }
            }
            inserted.push((m, ins));
        }
        if rest.is_empty() {
            continue;
        }
        let rows: Vec<_> = rest.iter().map(row).collect();
        let stored = mirror::stored_positions(tx, statements, m, &rows).await?;
        let (mut new, mut in_mirror) = (Vec::new(), Vec::new());
        for (j, c) in rest.into_iter().enumerate() {
            if stored.positions.get(&j).is_some_and(|p| *p >= c.position) {
                done.duplicate_of(m, 1);
                continue;
            }
            new.push(c);
            if stored.in_mirror.contains(&j) {
                in_mirror.push(c);
            }
        }
        writes.push(Writes {
            m,
            changes: new,
            in_mirror,
            tombstoned: stored.tombstoned,
        });
    }
    // View keys of the rows as they were (a key with no row has none
    // under a column mapping).
    for w in &writes {
        view_keys_many(
            tx,
            statements,
            views,
            w.m,
            &w.changes,
            &w.in_mirror,
            affected,
        )
        .await?;
    }
    for Writes {
        m,
        changes: cs,
        tombstoned,
        ..
    } in &writes
    {
        let (upserts, deletes): (Vec<&Change>, Vec<&Change>) =
            cs.iter().partition(|c| c.cells.is_some());
        // One statement per set of unchanged (TOAST) columns.
        let mut by_mask: Vec<(String, Vec<mirror::SetRow<'_>>)> = Vec::new();
        for c in &upserts {
            let mask = mirror::unchanged_mask(c.cells.as_deref().unwrap_or_default());
            match by_mask.iter_mut().find(|(k, _)| *k == mask) {
                Some((_, rows)) => rows.push(row(c)),
                None => by_mask.push((mask, vec![row(c)])),
            }
        }
        for (_, rows) in &by_mask {
            mirror::upsert_many(tx, statements, m, rows, tombstoned).await?;
        }
        if !deletes.is_empty() {
            let rows: Vec<_> = deletes.iter().map(row).collect();
            mirror::delete_many(tx, statements, m, &rows).await?;
        }
    }
    // And as they are now.
    let written = writes.iter().map(|w| (w.m, &w.changes));
    for (m, cs) in written
        .clone()
        .chain(inserted.iter().map(|(m, cs)| (*m, cs)))
    {
        view_keys_many(tx, statements, views, m, cs, cs, affected).await?;
    }
    for (m, cs) in written {
        done.applied_to(m, cs.len() as u64);
        done.committed
            .extend(cs.iter().map(|c| (c.cache_key.clone(), c.position)));
    }
    for (m, cs) in &inserted {
        done.applied_to(m, cs.len() as u64);
        done.bloom_skips += cs.len() as u64;
        done.committed
            .extend(cs.iter().map(|c| (c.cache_key.clone(), c.position)));
    }
    Ok(())
}

/// [`view_keys`] of many rows of one mirror. A column mapping reads the
/// keys of `in_mirror` only (the rows known to be in the mirror, or all of
/// `changes`): a key with no row maps to no view key. A query mapping reads
/// every change's, since its query may read other mirrors.
async fn view_keys_many(
    tx: &tokio_postgres::Transaction<'_>,
    statements: &mut Statements,
    views: &[View],
    m: &Mirror,
    changes: &[&Change],
    in_mirror: &[&Change],
    affected: &mut [BTreeSet<String>],
) -> Result<(), tokio_postgres::Error> {
    let keys: Vec<&[String]> = changes.iter().map(|c| c.key.as_slice()).collect();
    let stored: Vec<&[String]> = in_mirror.iter().map(|c| c.key.as_slice()).collect();
    for (view, out) in views.iter().zip(affected.iter_mut()) {
        for (t, mapping) in &view.sources {
            if t == &m.source {
                let keys = match mapping {
                    view::Mapping::Columns(_) => &stored,
                    view::Mapping::Query { .. } => &keys,
                };
                view.keys_of_many(tx, statements, mapping, m, keys, out)
                    .await?;
            }
        }
    }
    Ok(())
}

/// One mirror's share of a window ([`apply_window`]): the changes to write
/// (past the position guard), those of them whose key has a row in the
/// mirror, and the keys with a tombstone.
struct Writes<'a> {
    m: &'a Mirror,
    changes: Vec<&'a Change>,
    in_mirror: Vec<&'a Change>,
    tombstoned: HashSet<String>,
}

/// The dead-letter topic and the producer that writes to it (`None` for
/// a rebuild, which only counts rejections: the materializer that met them
/// first dead-lettered them).
struct DeadLetters<'a> {
    producer: Option<&'a sink::Producer>,
    topic: &'a str,
    /// Origins sent while the current batch is retried, so that a retry
    /// does not send them again.
    sent: std::sync::Mutex<HashSet<(String, i32, i64)>>,
    /// The dead letter a replay failed for (header `pgcdc.replay_of`).
    replay_of: Option<i64>,
    /// `kafka.max_message_bytes`: a larger record goes in parts.
    max_message_bytes: usize,
}

impl DeadLetters<'_> {
    /// Sends `m` with its failure in the headers; returns once Kafka
    /// acknowledged it. Once per origin until [`DeadLetters::batch_done`].
    async fn send(
        &self,
        m: &rdkafka::message::OwnedMessage,
        f: &Failure,
    ) -> Result<(), MaterializeError> {
        self.send_after(m, f, (1, crate::connector::now_ms())).await
    }

    /// [`DeadLetters::send`] after `attempts.0` attempts, the first at
    /// `attempts.1` (ms since the epoch).
    async fn send_after(
        &self,
        m: &rdkafka::message::OwnedMessage,
        f: &Failure,
        attempts: (u32, i64),
    ) -> Result<(), MaterializeError> {
        let origin = (m.topic().to_string(), m.partition(), m.offset());
        if self.sent.lock().is_ok_and(|s| s.contains(&origin)) {
            return Ok(());
        }
        self.deliver(m, f, attempts).await?;
        if let Ok(mut s) = self.sent.lock() {
            s.insert(origin);
        }
        Ok(())
    }

    /// The batch's offsets are committed: its messages are not seen again.
    fn batch_done(&self) {
        if let Ok(mut s) = self.sent.lock() {
            s.clear();
        }
    }

    async fn deliver(
        &self,
        m: &rdkafka::message::OwnedMessage,
        f: &Failure,
        (attempts, first_ms): (u32, i64),
    ) -> Result<(), MaterializeError> {
        let Some(producer) = self.producer else {
            tracing::info!(
                topic = m.topic(),
                partition = m.partition(),
                offset = m.offset(),
                class = f.class,
                "change rejected; skipped"
            );
            return Ok(());
        };
        // Not the error text: Postgres quotes the refused value in it.
        tracing::warn!(
            topic = m.topic(),
            partition = m.partition(),
            offset = m.offset(),
            class = f.class,
            "change dead-lettered (pgcdc dlq show for the error)"
        );
        let q = crate::dlq::record::Quarantine {
            class: f.class,
            error: &f.error,
            origin_topic: m.topic(),
            // A replayed connector quarantine never had an offset.
            origin: (m.offset() >= 0).then_some((m.partition(), m.offset())),
            position: f.position,
            lsn: None,
            op: None,
            attempts,
            first_failure_ms: first_ms,
            last_failure_ms: crate::connector::now_ms(),
            replay_of: self.replay_of,
        };
        // Only a replayed oversized change can be too large here.
        let value = m.payload().unwrap_or_default();
        let origin = format!(
            "{}/{}/{}/replay{}",
            m.topic(),
            m.partition(),
            m.offset(),
            self.replay_of.unwrap_or_default()
        );
        let records = q.records(
            value,
            m.key().map_or(0, <[u8]>::len),
            self.max_message_bytes,
            &origin,
        );
        for (headers, part) in records {
            let payload = m.payload().map(|_| part);
            let f = producer
                .send_with_headers(self.topic, m.key(), payload, headers)
                .await?;
            f.await
                .map_err(|e| MaterializeError::DeadLetter(e.to_string()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_consumer_waits_at_most_100_ms_for_a_fetch_unless_told_otherwise() {
        let mut kafka: crate::config::KafkaConfig =
            toml::from_str("brokers = \"127.0.0.1:9092\"\ntopic_prefix = \"demo\"").expect("kafka");
        let cc = consumer_config(&kafka, "g");
        assert_eq!(cc.get("fetch.wait.max.ms"), Some("100"));
        assert_eq!(cc.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(cc.get("isolation.level"), Some("read_committed"));
        kafka
            .properties
            .0
            .insert("fetch.wait.max.ms".into(), "500".into());
        assert_eq!(
            consumer_config(&kafka, "g").get("fetch.wait.max.ms"),
            Some("500")
        );
    }

    #[test]
    fn index_names_fit_postgres_and_stay_distinct() {
        assert_eq!(
            index_name("orders", "customer_id"),
            "orders_customer_id_pgcdc"
        );
        let long = "a".repeat(60);
        let (x, y) = (
            index_name(&long, "customer_id"),
            index_name(&long, "customer_ix"),
        );
        assert!(x.len() <= 63 && y.len() <= 63, "{x} {y}");
        assert_ne!(x, y);
        assert!(index_name(&"é".repeat(40), "c").len() <= 63);
    }
}
