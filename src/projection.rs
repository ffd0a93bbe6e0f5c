//! Projections: read models built from domain events, live from the
//! domain-event topics or rebuilt from the event store's first event.
//!
//! Guarantees:
//! - **Exactly-once effects.** An event's writes and its stream's
//!   checkpoint (`pgcdc_projection.checkpoints`) commit in one transaction;
//!   a version at or below the checkpoint is a duplicate and is skipped.
//!   Kafka offsets are committed only after that transaction.
//! - **Stream order is checked, not assumed.** A version that skips ahead
//!   of the checkpoint stops the projection with the stream, the versions
//!   and the record's offset: nothing is applied out of order.
//! - **Deterministic rebuilds.** [`rebuild`] empties the projection's
//!   tables and replays the whole store in global order, in one
//!   transaction (readers see the old model until it commits). Writes come
//!   from [`Projection::apply`], a pure function of the (upcast) event.
//! - **Old event versions are upcast** by an [`Upcasters`] chain before a
//!   projection sees them, so a projection only knows the newest version.
//!
//! ```text
//!  domain topics ──► RecordedEvent ──┐
//!                                    ├─► upcast ──► guard (checkpoint) ──► apply writes + checkpoint ──► commit ──► Kafka offsets
//!  event store (rebuild) ────────────┘
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{Headers, Message};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Transaction};

use crate::config::KafkaConfig;
use crate::event_store::{EventStore, Metadata, RecordedEvent};
use crate::secret::Dsn;
use crate::sink::CreateClient as _;
use crate::{sink, source};

/// Where checkpoints live, in the projection's database.
pub const STATE_SCHEMA: &str = "pgcdc_projection";
/// Events per rebuild page and at most per live transaction.
const BATCH: usize = 500;

#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    /// A record that is not a domain event, named by its offset.
    #[error("{topic} partition {partition} offset {offset}: {reason}")]
    Record {
        topic: String,
        partition: i32,
        offset: i64,
        reason: String,
    },
    /// An event that arrived ahead of its stream's order.
    #[error("stream {stream_id}: version {got} arrived after version {applied} (expected {}){at}", applied + 1)]
    OutOfOrder {
        stream_id: String,
        applied: i64,
        got: i64,
        at: String,
    },
    #[error("stream {stream_id} version {stream_version}: cannot upcast {event_type} v{version}: {reason}")]
    Upcast {
        stream_id: String,
        stream_version: i64,
        event_type: String,
        version: i32,
        reason: String,
    },
    #[error("projection {projection}: {}", source::error_text(.source))]
    Postgres {
        projection: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// Names the projection in a Postgres error.
fn pg_error(
    projection: &dyn Projection,
) -> impl Fn(tokio_postgres::Error) -> ProjectionError + Copy + '_ {
    move |source| ProjectionError::Postgres {
        projection: projection.name().to_string(),
        source,
    }
}

/// One write of a projection: a statement and its parameters.
#[derive(Debug)]
pub struct Write {
    pub sql: String,
    pub params: Vec<Box<dyn ToSql + Sync + Send>>,
}

impl Write {
    pub fn new(sql: &str, params: Vec<Box<dyn ToSql + Sync + Send>>) -> Write {
        Write {
            sql: sql.to_string(),
            params,
        }
    }
}

/// A read model built from events. `apply` is pure: the same event gives
/// the same writes, which is what makes a replay deterministic. Writes may
/// read the projection's own tables (`UPDATE ... SET n = n + 1`).
pub trait Projection: Send + Sync {
    /// Names its checkpoints.
    fn name(&self) -> &str;
    /// Creates its tables if they do not exist.
    fn create_sql(&self) -> String;
    /// Its tables, emptied by a rebuild.
    fn tables(&self) -> Vec<String>;
    /// The writes one event makes (none for an event it ignores).
    fn apply(&self, event: &RecordedEvent) -> Vec<Write>;
}

type Step = Box<dyn Fn(serde_json::Value) -> Result<serde_json::Value, String> + Send + Sync>;

/// Upcasters: for an event type, a step from schema version `n` to `n + 1`.
/// An event runs through every step from its version on.
#[derive(Default)]
pub struct Upcasters {
    steps: HashMap<(String, i32), Step>,
}

impl std::fmt::Debug for Upcasters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<_> = self.steps.keys().collect();
        keys.sort();
        f.debug_struct("Upcasters").field("steps", &keys).finish()
    }
}

impl Upcasters {
    pub fn new() -> Upcasters {
        Upcasters::default()
    }

    /// Adds the step of `event_type` from version `from` to `from + 1`.
    pub fn step(
        mut self,
        event_type: &str,
        from: i32,
        f: impl Fn(serde_json::Value) -> Result<serde_json::Value, String> + Send + Sync + 'static,
    ) -> Upcasters {
        self.steps
            .insert((event_type.to_string(), from), Box::new(f));
        self
    }

    /// The event at the newest version its chain reaches.
    pub fn upcast(&self, mut event: RecordedEvent) -> Result<RecordedEvent, ProjectionError> {
        while let Some(step) = self
            .steps
            .get(&(event.event_type.clone(), event.schema_version))
        {
            event.payload = step(event.payload).map_err(|reason| ProjectionError::Upcast {
                stream_id: event.stream_id.clone(),
                stream_version: event.version,
                event_type: event.event_type.clone(),
                version: event.schema_version,
                reason,
            })?;
            event.schema_version += 1;
        }
        Ok(event)
    }
}

/// A domain-event record (as the connector's outbox routing writes it,
/// with the default headers) as an event.
pub fn from_record(
    topic: &str,
    partition: i32,
    offset: i64,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &BTreeMap<String, Option<String>>,
) -> Result<RecordedEvent, ProjectionError> {
    let bad = |reason: String| ProjectionError::Record {
        topic: topic.to_string(),
        partition,
        offset,
        reason,
    };
    let header = |name: &str| {
        headers
            .get(name)
            .cloned()
            .flatten()
            .ok_or_else(|| bad(format!("no {name} header")))
    };
    let number = |name: &str| {
        header(name)?
            .parse::<i64>()
            .map_err(|_| bad(format!("header {name} is not a number")))
    };
    let stream_id = match key {
        Some(k) => String::from_utf8(k.to_vec()).map_err(|_| bad("the key is not UTF-8".into()))?,
        None => header("stream_id")?,
    };
    let payload = serde_json::from_slice(value.ok_or_else(|| bad("no value".into()))?)
        .map_err(|e| bad(format!("the value is not JSON: {e}")))?;
    let metadata: Metadata = match headers.get("metadata").cloned().flatten() {
        Some(m) => serde_json::from_str(&m).map_err(|e| bad(format!("header metadata: {e}")))?,
        None => Metadata::default(),
    };
    let recorded = header("recorded_at")?;
    Ok(RecordedEvent {
        global_position: number("global_position").ok(),
        event_id: header("event_id")?,
        stream_type: header("stream_type")?,
        stream_id,
        version: number("version")?,
        event_type: header("event_type")?,
        schema_version: i32::try_from(number("schema_version")?)
            .map_err(|_| bad("header schema_version is out of range".into()))?,
        payload,
        metadata,
        recorded_at_ms: timestamptz_ms(&recorded)
            .ok_or_else(|| bad(format!("header recorded_at is not a timestamp: {recorded}")))?,
    })
}

/// Postgres's ISO text of a timestamptz in UTC (`2026-12-01 12:00:00.5+00`).
fn timestamptz_ms(text: &str) -> Option<i64> {
    let iso = text.replacen(' ', "T", 1);
    let iso = match iso.rfind(['+', '-']) {
        Some(at) if at > 10 && !iso[at..].contains(':') => format!("{iso}:00"),
        _ => iso,
    };
    crate::retention::time::parse_timestamp(&iso)
}

/// Creates the checkpoint table and the projection's tables, under a
/// lock: projections starting together would collide in `CREATE ... IF
/// NOT EXISTS` (a unique violation in the catalog).
pub async fn prepare(db: &Client, projection: &dyn Projection) -> Result<(), ProjectionError> {
    let pg = pg_error(projection);
    let ddl = format!(
        "BEGIN;
         SELECT pg_advisory_xact_lock(hashtextextended('pgcdc_projection:prepare', 0));
         CREATE SCHEMA IF NOT EXISTS {STATE_SCHEMA};
         CREATE TABLE IF NOT EXISTS {STATE_SCHEMA}.checkpoints (
             projection text NOT NULL,
             stream_id text NOT NULL,
             version bigint NOT NULL,
             PRIMARY KEY (projection, stream_id));
         {}
         COMMIT;",
        projection.create_sql()
    );
    if let Err(e) = db.batch_execute(&ddl).await {
        let _ = db.batch_execute("ROLLBACK").await;
        return Err(pg(e));
    }
    Ok(())
}

/// What applying events did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    pub applied: u64,
    pub duplicates: u64,
}

/// Applies one event under its stream's checkpoint. `at` names where the
/// event came from, for an out-of-order error.
async fn apply_one(
    tx: &Transaction<'_>,
    projection: &dyn Projection,
    event: &RecordedEvent,
    at: &str,
    counts: &mut Applied,
) -> Result<(), ProjectionError> {
    let pg = pg_error(projection);
    let applied: i64 = tx
        .query_opt(
            &format!(
                "SELECT version FROM {STATE_SCHEMA}.checkpoints WHERE projection = $1 AND stream_id = $2 FOR UPDATE"
            ),
            &[&projection.name(), &event.stream_id],
        )
        .await
        .map_err(pg)?
        .map_or(0, |r| r.get(0));
    if event.version <= applied {
        counts.duplicates += 1;
        return Ok(());
    }
    if event.version != applied + 1 {
        return Err(ProjectionError::OutOfOrder {
            stream_id: event.stream_id.clone(),
            applied,
            got: event.version,
            at: at.to_string(),
        });
    }
    for w in projection.apply(event) {
        let params: Vec<&(dyn ToSql + Sync)> = w
            .params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        tx.execute(&w.sql, &params).await.map_err(pg)?;
    }
    tx.execute(
        &format!(
            "INSERT INTO {STATE_SCHEMA}.checkpoints (projection, stream_id, version) VALUES ($1, $2, $3)
             ON CONFLICT (projection, stream_id) DO UPDATE SET version = excluded.version"
        ),
        &[&projection.name(), &event.stream_id, &event.version],
    )
    .await
    .map_err(pg)?;
    counts.applied += 1;
    Ok(())
}

/// Serializes a rebuild and live batches of one projection.
async fn lock(
    tx: &Transaction<'_>,
    projection: &dyn Projection,
) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('pgcdc_projection:' || $1, 0))",
        &[&projection.name()],
    )
    .await
    .map(|_| ())
}

/// Rebuilds `projection` in `db` from the first event of `store` (read
/// through `events`), in one transaction.
///
/// The store is read in one snapshot taken after the projection's lock:
/// every event a live [`follow`] applied before is in it (its source
/// transaction committed before the connector could route it), and every
/// event after it reaches `follow` later, which goes on from the rebuilt
/// checkpoints (anything already in the snapshot is a duplicate).
pub async fn rebuild(
    db: &mut Client,
    events: &mut Client,
    store: &EventStore,
    projection: &dyn Projection,
    upcasters: &Upcasters,
) -> Result<Applied, ProjectionError> {
    let pg = pg_error(projection);
    prepare(db, projection).await?;
    let tx = db.transaction().await.map_err(pg)?;
    lock(&tx, projection).await.map_err(pg)?;
    // DELETE, not TRUNCATE: readers keep seeing the old model (TRUNCATE's
    // lock would block them for the whole rebuild).
    for table in projection.tables() {
        tx.batch_execute(&format!("DELETE FROM {table}"))
            .await
            .map_err(pg)?;
    }
    tx.execute(
        &format!("DELETE FROM {STATE_SCHEMA}.checkpoints WHERE projection = $1"),
        &[&projection.name()],
    )
    .await
    .map_err(pg)?;
    let snapshot = events
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(pg)?;
    let mut counts = Applied::default();
    let mut after = 0;
    loop {
        let page = store
            .read_all(&snapshot, after, BATCH as i64)
            .await
            .map_err(pg)?;
        let Some(last) = page.last().and_then(|e| e.global_position) else {
            break;
        };
        for event in page {
            let at = format!(" at global position {}", event.global_position.unwrap_or(0));
            let event = upcasters.upcast(event)?;
            apply_one(&tx, projection, &event, &at, &mut counts).await?;
        }
        after = last;
    }
    snapshot.rollback().await.map_err(pg)?;
    tx.commit().await.map_err(pg)?;
    Ok(counts)
}

/// Follows the domain-event `topics` as consumer group `group` and applies
/// them to `projection` in the database at `url`, until `stop` resolves.
///
/// A batch the target refuses for a reason a retry can fix (a lost
/// connection, a serialization conflict: [`crate::dlq::classify`] decides)
/// is applied again, from the same records, after a backoff and a fresh
/// connection; anything else stops the projection with the error.
pub async fn follow(
    kafka: &KafkaConfig,
    group: &str,
    topics: &[String],
    url: &Dsn,
    projection: Arc<dyn Projection>,
    upcasters: Arc<Upcasters>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Applied, ProjectionError> {
    let pg = pg_error(&*projection);
    let mut db = source::connect(url).await.map_err(pg)?;
    prepare(&db, projection.as_ref()).await?;
    sink::ensure_event_topics(kafka, topics).await?;
    let consumer: sink::QuietConsumer = sink::client_config(kafka)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .client_with(sink::Quiet)?;
    let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer.subscribe(&refs)?;
    tokio::pin!(stop);
    let mut total = Applied::default();
    loop {
        // A batch: what arrives until the topics pause for a moment.
        let mut batch = Vec::new();
        tokio::select! {
            _ = &mut stop => return Ok(total),
            m = consumer.recv() => match m {
                Ok(m) => batch.push(m.detach()),
                // librdkafka retries on its own; the next poll goes on.
                Err(e) => {
                    tracing::warn!(projection = projection.name(), error = %e, "kafka: poll failed");
                    continue;
                }
            },
        }
        while batch.len() < BATCH {
            match tokio::time::timeout(Duration::from_millis(20), consumer.recv()).await {
                Ok(Ok(m)) => batch.push(m.detach()),
                Ok(Err(_)) | Err(_) => break,
            }
        }
        let mut attempts = 0u32;
        let counts = loop {
            match apply_batch(&mut db, projection.as_ref(), &upcasters, &batch).await {
                Ok(counts) => break counts,
                Err(ProjectionError::Postgres { source, .. }) if retryable(&source, attempts) => {
                    attempts += 1;
                    let wait = Duration::from_millis(400 * (1 << attempts.min(6)));
                    tracing::warn!(projection = projection.name(), attempts, error = %source::error_text(&source),
                        "target: the batch failed; applying it again after {wait:?}");
                    tokio::time::sleep(wait).await;
                    if db.is_closed() {
                        match source::connect(url).await {
                            Ok(c) => db = c,
                            Err(e) => {
                                tracing::warn!(projection = projection.name(), error = %source::error_text(&e), "target: cannot reconnect yet")
                            }
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        };
        total.applied += counts.applied;
        total.duplicates += counts.duplicates;
        let mut next: BTreeMap<(String, i32), i64> = BTreeMap::new();
        for m in &batch {
            next.insert((m.topic().to_string(), m.partition()), m.offset() + 1);
        }
        let mut offsets = rdkafka::TopicPartitionList::new();
        for ((topic, partition), offset) in next {
            offsets.add_partition_offset(&topic, partition, rdkafka::Offset::Offset(offset))?;
        }
        // A failed commit (a rebalance) only means redelivery, which the
        // checkpoints skip.
        if let Err(e) = consumer.commit(&offsets, CommitMode::Sync) {
            tracing::warn!(projection = projection.name(), error = %e, "kafka: offset commit failed; the batch will be redelivered and skipped");
        }
    }
}

/// Whether the classifier calls a target error an outage to retry.
fn retryable(e: &tokio_postgres::Error, attempts: u32) -> bool {
    let code = e.as_db_error().map(|d| d.code().code());
    let fault = crate::dlq::Fault::Target {
        sqlstate: code,
        attempts,
        // Projections have no dead-letter path: retry outages for ever.
        max_attempts: 0,
    };
    matches!(crate::dlq::classify(&fault), crate::dlq::Verdict::Retry(_))
}

/// Applies one batch of records in one transaction.
async fn apply_batch(
    db: &mut Client,
    projection: &dyn Projection,
    upcasters: &Upcasters,
    batch: &[rdkafka::message::OwnedMessage],
) -> Result<Applied, ProjectionError> {
    let pg = pg_error(projection);
    let mut counts = Applied::default();
    let tx = db.transaction().await.map_err(pg)?;
    lock(&tx, projection).await.map_err(pg)?;
    for m in batch {
        let headers: BTreeMap<String, Option<String>> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_string(),
                            h.value.map(|v| String::from_utf8_lossy(v).into_owned()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let event = from_record(
            m.topic(),
            m.partition(),
            m.offset(),
            m.key(),
            m.payload(),
            &headers,
        )?;
        let event = upcasters.upcast(event)?;
        let at = format!(
            " ({} partition {} offset {})",
            m.topic(),
            m.partition(),
            m.offset()
        );
        apply_one(&tx, projection, &event, &at, &mut counts).await?;
    }
    tx.commit().await.map_err(pg)?;
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(version: i32, payload: serde_json::Value) -> RecordedEvent {
        RecordedEvent {
            global_position: Some(1),
            event_id: "e".into(),
            stream_type: "t".into(),
            stream_id: "s".into(),
            version: 1,
            event_type: "Happened".into(),
            schema_version: version,
            payload,
            metadata: Metadata::default(),
            recorded_at_ms: 0,
        }
    }

    #[test]
    fn upcasters_chain_from_any_old_version_to_the_newest() {
        let up = Upcasters::new()
            .step("Happened", 1, |mut p| {
                p["b"] = p["a"].clone();
                Ok(p)
            })
            .step("Happened", 2, |mut p| {
                p["c"] = json!(3);
                Ok(p)
            });
        let from_v1 = up.upcast(event(1, json!({"a": 1}))).expect("v1");
        assert_eq!(from_v1.schema_version, 3);
        assert_eq!(from_v1.payload, json!({"a": 1, "b": 1, "c": 3}));
        let from_v2 = up.upcast(event(2, json!({"a": 1, "b": 1}))).expect("v2");
        assert_eq!(from_v2.payload, from_v1.payload);
        let newest = up.upcast(event(3, json!({"x": 0}))).expect("v3");
        assert_eq!(
            newest.payload,
            json!({"x": 0}),
            "nothing to do at the newest"
        );
        let failing = Upcasters::new().step("Happened", 1, |_| Err("no a".into()));
        assert!(matches!(
            failing.upcast(event(1, json!({}))),
            Err(ProjectionError::Upcast { version: 1, .. })
        ));
    }

    #[test]
    fn a_record_becomes_an_event_or_an_error_naming_its_offset() {
        let mut headers: BTreeMap<String, Option<String>> = [
            ("global_position", "7"),
            ("event_id", "id-1"),
            ("stream_type", "payment"),
            ("version", "2"),
            ("event_type", "PaymentSettled"),
            ("schema_version", "1"),
            ("metadata", r#"{"intent": "settle", "actor": "app"}"#),
            ("recorded_at", "2026-12-01 12:00:00.250123+00"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Some(v.to_string())))
        .collect();
        let e = from_record(
            "t",
            0,
            5,
            Some(b"payment-1"),
            Some(br#"{"day": 3}"#),
            &headers,
        )
        .expect("an event");
        assert_eq!(e.stream_id, "payment-1");
        assert_eq!(e.version, 2);
        assert_eq!(e.global_position, Some(7));
        assert_eq!(e.metadata.intent.as_deref(), Some("settle"));
        assert_eq!(e.payload, json!({"day": 3}));
        assert_eq!(e.recorded_at_ms, 1_796_126_400_250);
        headers.remove("version");
        let err = from_record("t", 2, 9, Some(b"k"), Some(b"{}"), &headers)
            .expect_err("no version")
            .to_string();
        assert_eq!(err, "t partition 2 offset 9: no version header");
        assert_eq!(
            timestamptz_ms("2026-12-01 13:00:00+01"),
            Some(1_796_126_400_000)
        );
    }
}
