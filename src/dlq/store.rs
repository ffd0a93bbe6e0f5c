//! The `pgcdc_dlq` schema in the target database: every dead letter the
//! `<prefix>.dlq` topic holds, its state, and the audit of every
//! transition.
//!
//! ```text
//!  <prefix>.dlq ──sync──► pgcdc_dlq.messages ◄──transition──► pgcdc_dlq.audit
//!        (offsets in pgcdc_dlq.ingest, same transaction)
//! ```
//!
//! Guarantees:
//! - **Nothing is lost between topic and store.** [`sync`] records the
//!   topic's records and the next offset to read in one transaction, so a
//!   crash repeats a chunk and never skips one; a record seen twice (a
//!   batch retried after it was dead-lettered) is recorded once, by its
//!   origin.
//! - **Every state change is audited.** [`transition`] changes the state
//!   only from the state it expects, after [`super::state::check`]
//!   allowed it, and writes the audit row in the same statement.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Message as _, Offset, TopicPartitionList};
use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Row};

use super::{Class, Outcome, State};
use crate::config::Config;
use crate::sink;
use crate::sink::CreateClient as _;

pub const SCHEMA_SQL: &str = "
CREATE SCHEMA IF NOT EXISTS pgcdc_dlq;
CREATE TABLE IF NOT EXISTS pgcdc_dlq.messages (
    id bigserial PRIMARY KEY,
    dlq_topic text NOT NULL,
    dlq_partition int NOT NULL,
    dlq_offset bigint NOT NULL,
    -- The change's identity: its origin record, or its table and position
    -- for what never reached a changelog topic (the connector's).
    origin text NOT NULL,
    class text NOT NULL,
    error text NOT NULL,
    origin_topic text NOT NULL,
    origin_partition int,
    origin_offset bigint,
    commit_lsn bigint,
    seq bigint,
    source_table text,
    key bytea,
    value bytea,
    schema_id bigint,
    attempts int NOT NULL,
    first_failure timestamptz NOT NULL,
    last_failure timestamptz NOT NULL,
    quarantined_at timestamptz NOT NULL,
    replay_of bigint REFERENCES pgcdc_dlq.messages (id),
    state text NOT NULL DEFAULT 'quarantined',
    outcome text,
    note text,
    archived_reason text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (dlq_topic, dlq_partition, dlq_offset)
);
CREATE UNIQUE INDEX IF NOT EXISTS messages_origin ON pgcdc_dlq.messages (origin, coalesce(replay_of, 0));
CREATE INDEX IF NOT EXISTS messages_state ON pgcdc_dlq.messages (state, class);
CREATE INDEX IF NOT EXISTS messages_key ON pgcdc_dlq.messages (origin_topic, key);
CREATE TABLE IF NOT EXISTS pgcdc_dlq.audit (
    id bigserial PRIMARY KEY,
    message_id bigint NOT NULL REFERENCES pgcdc_dlq.messages (id),
    from_state text,
    to_state text NOT NULL,
    actor text NOT NULL,
    reason text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS audit_message ON pgcdc_dlq.audit (message_id);
-- Parts of a record split for the broker's size limit, until all arrived.
CREATE TABLE IF NOT EXISTS pgcdc_dlq.parts (
    part_id text NOT NULL,
    index int NOT NULL,
    count int NOT NULL,
    bytes bytea NOT NULL,
    PRIMARY KEY (part_id, index)
);
CREATE TABLE IF NOT EXISTS pgcdc_dlq.ingest (
    topic text NOT NULL,
    partition int NOT NULL,
    next_offset bigint NOT NULL,
    PRIMARY KEY (topic, partition)
);
";

/// Serializes syncs of several processes on one target.
const SYNC_LOCK: i64 = 0x7067_6364_646c_7131; // "pgcdcdlq1"

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("target: {}", crate::source::error_text(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("dead-letter topic: {0}")]
    Kafka(String),
    #[error("message {id}: {why}")]
    Refused { id: i64, why: String },
    #[error("no dead letter with id {0}")]
    Unknown(i64),
}

/// A dead letter as the store holds it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    pub id: i64,
    pub class: Class,
    pub state: State,
    pub outcome: Option<Outcome>,
    pub error: String,
    pub origin_topic: String,
    pub origin_partition: Option<i32>,
    pub origin_offset: Option<i64>,
    /// `(commit_lsn, seq)` of the change, when known.
    pub position: Option<(i64, i64)>,
    pub source_table: Option<String>,
    pub schema_id: Option<i64>,
    pub attempts: i32,
    pub first_failure_ms: i64,
    pub last_failure_ms: i64,
    pub quarantined_ms: i64,
    pub replay_of: Option<i64>,
    pub note: Option<String>,
    pub archived_reason: Option<String>,
    pub dlq_partition: i32,
    pub dlq_offset: i64,
    #[serde(skip)]
    pub key: Option<Vec<u8>>,
    #[serde(skip)]
    pub value: Option<Vec<u8>>,
}

/// One row of the audit.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AuditRow {
    pub from: Option<String>,
    pub to: String,
    pub actor: String,
    pub reason: String,
    pub at_ms: i64,
}

/// Which messages a command acts on; empty fields match everything.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub ids: Vec<i64>,
    pub states: Vec<State>,
    pub class: Option<Class>,
    pub table: Option<String>,
    /// Quarantined at or after (ms since the epoch).
    pub since_ms: Option<i64>,
    /// Quarantined before.
    pub until_ms: Option<i64>,
}

pub async fn ensure(db: &impl GenericClient) -> Result<(), StoreError> {
    db.batch_execute(SCHEMA_SQL).await?;
    Ok(())
}

const COLUMNS: &str =
    "id, class, state, outcome, error, origin_topic, origin_partition, origin_offset,
    commit_lsn, seq, source_table, schema_id, attempts,
    (extract(epoch FROM first_failure) * 1000)::bigint,
    (extract(epoch FROM last_failure) * 1000)::bigint,
    (extract(epoch FROM quarantined_at) * 1000)::bigint,
    replay_of, note, archived_reason, dlq_partition, dlq_offset, key, value";

fn message(r: &Row) -> DeadLetter {
    let lsn: Option<i64> = r.get(8);
    let seq: Option<i64> = r.get(9);
    DeadLetter {
        id: r.get(0),
        class: Class::parse(r.get(1)).unwrap_or(Class::Deserialization),
        state: State::parse(r.get(2)).unwrap_or(State::Quarantined),
        outcome: r.get::<_, Option<&str>>(3).and_then(Outcome::parse),
        error: r.get(4),
        origin_topic: r.get(5),
        origin_partition: r.get(6),
        origin_offset: r.get(7),
        position: lsn.zip(seq),
        source_table: r.get(10),
        schema_id: r.get(11),
        attempts: r.get(12),
        first_failure_ms: r.get(13),
        last_failure_ms: r.get(14),
        quarantined_ms: r.get(15),
        replay_of: r.get(16),
        note: r.get(17),
        archived_reason: r.get(18),
        dlq_partition: r.get(19),
        dlq_offset: r.get(20),
        key: r.get(21),
        value: r.get(22),
    }
}

/// The messages a filter matches, oldest first (the order of the topic,
/// so a key's changes replay in their order).
pub async fn list(db: &impl GenericClient, f: &Filter) -> Result<Vec<DeadLetter>, StoreError> {
    let states: Vec<&str> = f.states.iter().map(|s| s.as_str()).collect();
    let class = f.class.map(|c| c.as_str());
    let rows = db
        .query(
            &format!(
                "SELECT {COLUMNS} FROM pgcdc_dlq.messages
                 WHERE (cardinality($1::bigint[]) = 0 OR id = ANY($1))
                   AND (cardinality($2::text[]) = 0 OR state = ANY($2))
                   AND ($3::text IS NULL OR class = $3)
                   AND ($4::text IS NULL OR source_table = $4)
                   AND ($5::bigint IS NULL OR quarantined_at >= to_timestamp($5 / 1000.0))
                   AND ($6::bigint IS NULL OR quarantined_at < to_timestamp($6 / 1000.0))
                 ORDER BY dlq_partition, dlq_offset"
            ),
            &[&f.ids, &states, &class, &f.table, &f.since_ms, &f.until_ms],
        )
        .await?;
    let found: Vec<DeadLetter> = rows.iter().map(message).collect();
    if let Some(missing) = f.ids.iter().find(|id| !found.iter().any(|m| m.id == **id)) {
        // An id given by a person that matches nothing is a mistake, unless
        // the other filters excluded it.
        if f.states.is_empty() && f.class.is_none() && f.table.is_none() {
            return Err(StoreError::Unknown(*missing));
        }
    }
    Ok(found)
}

/// Approved messages (`schema_check`, `idempotency_check`) whose last
/// transition was by an actor starting with `prefix`, oldest first.
pub async fn approved_by(
    db: &impl GenericClient,
    prefix: &str,
) -> Result<Vec<(i64, String)>, StoreError> {
    let rows = db
        .query(
            "SELECT m.id, a.actor FROM pgcdc_dlq.messages m
             JOIN LATERAL (SELECT actor FROM pgcdc_dlq.audit WHERE message_id = m.id
                           ORDER BY id DESC LIMIT 1) a ON true
             WHERE m.state IN ('schema_check', 'idempotency_check')
               AND starts_with(a.actor, $1)
             ORDER BY m.dlq_partition, m.dlq_offset",
            &[&prefix],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Open dead letters of the same key (origin topic and Kafka key) older
/// than `m` in the topic.
pub async fn older_open(db: &impl GenericClient, m: &DeadLetter) -> Result<Vec<i64>, StoreError> {
    let Some(key) = &m.key else {
        return Ok(Vec::new());
    };
    let rows = db
        .query(
            "SELECT id FROM pgcdc_dlq.messages
             WHERE origin_topic = $1 AND key = $2 AND (dlq_partition, dlq_offset) < ($3, $4)
               AND state NOT IN ('replayed', 'archived')
             ORDER BY dlq_partition, dlq_offset",
            &[&m.origin_topic, key, &m.dlq_partition, &m.dlq_offset],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

pub async fn get(db: &impl GenericClient, id: i64) -> Result<DeadLetter, StoreError> {
    let row = db
        .query_opt(
            &format!("SELECT {COLUMNS} FROM pgcdc_dlq.messages WHERE id = $1"),
            &[&id],
        )
        .await?
        .ok_or(StoreError::Unknown(id))?;
    Ok(message(&row))
}

pub async fn audit(db: &impl GenericClient, id: i64) -> Result<Vec<AuditRow>, StoreError> {
    let rows = db
        .query(
            "SELECT from_state, to_state, actor, reason, (extract(epoch FROM at) * 1000)::bigint
             FROM pgcdc_dlq.audit WHERE message_id = $1 ORDER BY id",
            &[&id],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| AuditRow {
            from: r.get(0),
            to: r.get(1),
            actor: r.get(2),
            reason: r.get(3),
            at_ms: r.get(4),
        })
        .collect())
}

/// What a transition writes besides the state.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extra<'a> {
    pub outcome: Option<Outcome>,
    /// Kept on the message (a check's finding, a transformation).
    pub note: Option<&'a str>,
}

/// Moves message `id` from `from` to `to`, with an audit row; refused when
/// the workflow does not allow it or the message is no longer in `from`.
pub async fn transition(
    db: &impl GenericClient,
    id: i64,
    from: State,
    to: State,
    actor: &str,
    reason: &str,
    extra: Extra<'_>,
) -> Result<(), StoreError> {
    super::state::check(from, to).map_err(|why| StoreError::Refused { id, why })?;
    let outcome = extra.outcome.map(|o| o.as_str());
    let params: [&(dyn ToSql + Sync); 7] = [
        &id,
        &from.as_str(),
        &to.as_str(),
        &outcome,
        &extra.note,
        &actor,
        &reason,
    ];
    let moved = db
        .query_opt(
            "WITH m AS (
               UPDATE pgcdc_dlq.messages
               SET state = $3::text, outcome = coalesce($4::text, outcome), note = coalesce($5::text, note),
                   archived_reason = CASE WHEN $3::text = 'archived' THEN $7::text ELSE archived_reason END,
                   updated_at = now()
               WHERE id = $1 AND state = $2::text RETURNING id)
             INSERT INTO pgcdc_dlq.audit (message_id, from_state, to_state, actor, reason)
             SELECT id, $2::text, $3::text, $6::text, $7::text FROM m RETURNING id",
            &params,
        )
        .await?;
    if moved.is_some() {
        return Ok(());
    }
    let now = get(db, id).await?.state;
    Err(StoreError::Refused {
        id,
        why: format!("is {now}, not {from}"),
    })
}

/// What the health figures need of every message.
pub async fn health_items(db: &impl GenericClient) -> Result<Vec<super::health::Item>, StoreError> {
    let rows = db
        .query(
            "SELECT id, state, class, (extract(epoch FROM quarantined_at) * 1000)::bigint, outcome
             FROM pgcdc_dlq.messages",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| super::health::Item {
            id: r.get(0),
            state: State::parse(r.get(1)).unwrap_or(State::Quarantined),
            class: Class::parse(r.get(2)).unwrap_or(Class::Deserialization),
            quarantined_ms: r.get(3),
            outcome: r.get::<_, Option<&str>>(4).and_then(Outcome::parse),
        })
        .collect())
}

/// A dead-letter record as read from the topic.
#[derive(Debug, Clone, Default)]
struct Record {
    partition: i32,
    offset: i64,
    timestamp_ms: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: BTreeMap<String, String>,
}

/// Reads every partition of the dead-letter topic from `from` (partition
/// → next offset) to its high watermark.
fn read_topic(
    config: &Config,
    topic: &str,
    from: &BTreeMap<i32, i64>,
) -> Result<Vec<Record>, String> {
    let consumer: BaseConsumer<sink::Quiet> = sink::client_config(&config.kafka)
        .set("group.id", format!("pgcdc-dlq-sync-{}", config.name))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .client()
        .map_err(|e| e.to_string())?;
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| format!("{topic}: {e}"))?;
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    let mut ends = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .map_err(|e| format!("{topic}[{p}]: {e}"))?;
        let start = from.get(&p).copied().unwrap_or(0);
        if start > high {
            // Recorded past the topic's end: the topic was recreated, and
            // its new records would collide with the recorded offsets.
            return Err(format!(
                "{topic}[{p}]: pgcdc_dlq recorded up to offset {start} but the topic ends at {high}; \
                 was the topic recreated? Move the recorded messages aside and delete the \
                 partition's row in pgcdc_dlq.ingest to record the new topic"
            ));
        }
        if start < low {
            // Retention removed records before they were recorded here.
            tracing::error!(%topic, partition = p, from = start, low,
                "dead letters were deleted from the topic before they were recorded; set the topic's retention to keep them (retention.ms = -1)");
        }
        let start = start.max(low);
        if start < high {
            ends.insert(p, high);
            tpl.add_partition_offset(topic, p, Offset::Offset(start))
                .map_err(|e| e.to_string())?;
        }
    }
    let mut out = Vec::new();
    if ends.is_empty() {
        return Ok(out);
    }
    consumer.assign(&tpl).map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !ends.is_empty() {
        if std::time::Instant::now() > deadline {
            return Err(format!("{topic}: could not read up to {ends:?}"));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let mut headers = BTreeMap::new();
                if let Some(h) = m.headers() {
                    for h in h.iter() {
                        if let Some(v) = h.value {
                            headers.insert(h.key.to_string(), String::from_utf8_lossy(v).into());
                        }
                    }
                }
                out.push(Record {
                    partition: m.partition(),
                    offset: m.offset(),
                    timestamp_ms: m.timestamp().to_millis().unwrap_or_default(),
                    key: m.key().map(<[u8]>::to_vec),
                    value: m.payload().map(<[u8]>::to_vec),
                    headers,
                });
                if ends
                    .get(&m.partition())
                    .is_some_and(|&e| m.offset() + 1 >= e)
                {
                    ends.remove(&m.partition());
                }
            }
            Some(Err(e)) => return Err(format!("{topic}: {e}")),
            None => {
                // Control records are never delivered: the position tells.
                if let Ok(pos) = consumer.position() {
                    ends.retain(|p, e| {
                        pos.find_partition(topic, *p)
                            .and_then(|x| x.offset().to_raw())
                            .is_none_or(|o| o < *e)
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Records what the dead-letter topic holds that the store does not yet;
/// returns how many new messages were recorded.
pub async fn sync(config: &Config, db: &mut tokio_postgres::Client) -> Result<u64, StoreError> {
    let topic = crate::materialize::dlq_topic(config);
    let tx = db.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SYNC_LOCK])
        .await?;
    let from: BTreeMap<i32, i64> = tx
        .query(
            "SELECT partition, next_offset FROM pgcdc_dlq.ingest WHERE topic = $1",
            &[&topic],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let records = {
        let (config, topic, from) = (config.clone(), topic.clone(), from.clone());
        tokio::task::spawn_blocking(move || read_topic(&config, &topic, &from))
            .await
            .map_err(|e| StoreError::Kafka(e.to_string()))?
            .map_err(StoreError::Kafka)?
    };
    let mut added = 0u64;
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    for r in &records {
        added += record(&tx, config, &topic, r).await?;
        next.insert(r.partition, r.offset + 1);
    }
    for (p, o) in &next {
        tx.execute(
            "INSERT INTO pgcdc_dlq.ingest (topic, partition, next_offset) VALUES ($1, $2, $3)
             ON CONFLICT (topic, partition) DO UPDATE SET next_offset = greatest(pgcdc_dlq.ingest.next_offset, EXCLUDED.next_offset)",
            &[&topic, p, o],
        )
        .await?;
    }
    tx.commit().await?;
    if added > 0 {
        tracing::info!(added, "dead letters recorded in pgcdc_dlq");
    }
    Ok(added)
}

/// Inserts one record (once per origin) with its arrival in the audit.
async fn record(
    tx: &tokio_postgres::Transaction<'_>,
    config: &Config,
    topic: &str,
    r: &Record,
) -> Result<u64, StoreError> {
    let h = |name: &str| r.headers.get(name).map(String::as_str);
    // A part of a split record: kept until the last one arrives, which
    // then stands for the whole.
    let mut whole: Option<Vec<u8>> = None;
    if let (Some(part), Some(id)) = (h("pgcdc.part"), h("pgcdc.part.id")) {
        let Some((index, count)) = part
            .split_once('/')
            .and_then(|(i, n)| Some((i.parse::<i32>().ok()?, n.parse::<i32>().ok()?)))
            .filter(|(i, n)| (1..=*n).contains(i))
        else {
            // Kept whole rather than dropped: a person can still see it.
            tracing::error!(
                dlq_partition = r.partition,
                dlq_offset = r.offset,
                part,
                "a dead-letter part with an unreadable pgcdc.part header; recorded as it is"
            );
            return record_whole(tx, config, topic, r, r.value.clone()).await;
        };
        tx.execute(
            "INSERT INTO pgcdc_dlq.parts (part_id, index, count, bytes) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
            &[&id, &index, &count, &r.value.as_deref().unwrap_or_default()],
        )
        .await?;
        let row = tx
            .query_one(
                "SELECT count(*)::int, string_agg(bytes, ''::bytea ORDER BY index)
                 FROM pgcdc_dlq.parts WHERE part_id = $1",
                &[&id],
            )
            .await?;
        if row.get::<_, i32>(0) < count {
            return Ok(0);
        }
        whole = row.get(1);
        tx.execute("DELETE FROM pgcdc_dlq.parts WHERE part_id = $1", &[&id])
            .await?;
    }
    record_whole(tx, config, topic, r, whole.or_else(|| r.value.clone())).await
}

/// Inserts a record (or a joined split record) once per origin.
async fn record_whole(
    tx: &tokio_postgres::Transaction<'_>,
    config: &Config,
    topic: &str,
    r: &Record,
    value: Option<Vec<u8>>,
) -> Result<u64, StoreError> {
    let h = |name: &str| r.headers.get(name).map(String::as_str);
    let num = |name: &str| h(name).and_then(|v| v.parse::<i64>().ok());
    let (class, error) = match h("pgcdc.failure.class").and_then(Class::parse) {
        Some(c) => (c, h("pgcdc.failure.error").unwrap_or_default().to_string()),
        // Written by something else: keep it, and say so.
        None => (
            Class::Deserialization,
            "a record without pgcdc failure headers".to_string(),
        ),
    };
    let origin_topic = h("pgcdc.origin.topic").unwrap_or(topic).to_string();
    let origin_partition = num("pgcdc.origin.partition")
        .filter(|p| *p >= 0)
        .map(|p| p as i32);
    let origin_offset = num("pgcdc.origin.offset").filter(|o| *o >= 0);
    let position = h("pgcdc.position").and_then(|p| {
        let (c, s) = p.split_once(':')?;
        Some((c.parse::<i64>().ok()?, s.parse::<i64>().ok()?))
    });
    let origin = match (origin_partition, origin_offset, position) {
        (Some(p), Some(o), _) => format!("{origin_topic}/{p}/{o}"),
        // A key change quarantines a delete and a create at one position.
        (_, _, Some((c, s))) => format!(
            "{origin_topic}@{c}:{s}:{}",
            h("pgcdc.origin.op").unwrap_or_default()
        ),
        _ => format!("{topic}/{}/{}", r.partition, r.offset),
    };
    let source_table = config
        .source
        .tables
        .iter()
        .find(|t| config.topic_for(t) == origin_topic)
        .cloned();
    let schema_id = value
        .as_deref()
        .and_then(crate::encode::unframe)
        .map(|(id, _)| i64::from(id));
    let replay_of = num("pgcdc.replay_of");
    let first = num("pgcdc.first_failure_ms").unwrap_or(r.timestamp_ms);
    let last = num("pgcdc.last_failure_ms").unwrap_or(first);
    let attempts = num("pgcdc.attempts").unwrap_or(1) as i32;
    let params: [&(dyn ToSql + Sync); 20] = [
        &topic,
        &r.partition,
        &r.offset,
        &origin,
        &class.as_str(),
        &error,
        &origin_topic,
        &origin_partition,
        &origin_offset,
        &position.map(|p| p.0),
        &position.map(|p| p.1),
        &source_table,
        &r.key,
        &value,
        &schema_id,
        &attempts,
        &first,
        &last,
        &r.timestamp_ms,
        &replay_of,
    ];
    let row = tx
        .query_opt(
            "INSERT INTO pgcdc_dlq.messages (dlq_topic, dlq_partition, dlq_offset, origin, class, error,
                 origin_topic, origin_partition, origin_offset, commit_lsn, seq, source_table, key, value,
                 schema_id, attempts, first_failure, last_failure, quarantined_at, replay_of)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                 to_timestamp($17::bigint / 1000.0), to_timestamp($18::bigint / 1000.0), to_timestamp($19::bigint / 1000.0),
                 (SELECT id FROM pgcdc_dlq.messages WHERE id = $20))
             ON CONFLICT DO NOTHING RETURNING id",
            &params,
        )
        .await?;
    let Some(row) = row else { return Ok(0) };
    let id: i64 = row.get(0);
    let reason = match replay_of {
        Some(old) => format!("{class}: replay of message {old} failed again"),
        None => format!("{class}: classified on arrival"),
    };
    tx.execute(
        "INSERT INTO pgcdc_dlq.audit (message_id, from_state, to_state, actor, reason, at)
         VALUES ($1, NULL, 'quarantined', 'auto:quarantine', $2, to_timestamp($3::bigint / 1000.0))",
        &[&id, &reason, &r.timestamp_ms],
    )
    .await?;
    Ok(1)
}
