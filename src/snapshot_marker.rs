//! Snapshot markers: the durable record of a snapshot's life, in the
//! compacted topic `<prefix>.snapshots`, keyed by slot.
//!
//! Guarantees:
//! - A `started` marker is written *before* the slot is created, and a
//!   `completed` marker only after Kafka acknowledged every snapshot row.
//!   So a slot whose latest marker is `started` belongs to an interrupted
//!   snapshot, and the connector redoes it rather than streaming on from a
//!   slot whose snapshot is missing rows.
//! - Markers record, per changelog partition, the offset where the
//!   snapshot's rows begin and end, so `pgcdc retention` can tell whether a
//!   retained log still begins with a complete snapshot.
//! - Incremental snapshots (`pgcdc snapshot`, see [`crate::incremental`])
//!   have markers of their own, keyed `<slot>/incremental/<id>`: `started`
//!   with the start offsets before any of their rows is produced, then one
//!   `started` marker per chunk with the cursor (so a restarted connector
//!   resumes after the last chunk Kafka acknowledged), and `completed` once
//!   every table was read. Reading a changelog topic from a completed
//!   snapshot's start offsets gives every row of the snapshotted tables.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::config::{Config, KafkaConfig};
use crate::sink;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Started,
    Completed,
    /// An incremental snapshot that was given up, with [`Marker::error`].
    Failed,
}

/// Which kind of snapshot a marker describes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Taken on the slot's exported snapshot when the slot was created.
    #[default]
    Initial,
    /// Taken in chunks while streaming goes on (`pgcdc snapshot`).
    Incremental,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Initial => "initial",
            Kind::Incremental => "incremental",
        }
    }
}

/// Where an incremental snapshot stands: the tables before `table` in
/// [`Marker::tables`] are done, and `table` is done up to the key `after`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub table: String,
    /// The last key copied, as the text of each key column.
    pub after: Vec<String>,
}

/// One marker record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub slot: String,
    pub phase: Phase,
    #[serde(default)]
    pub kind: Kind,
    /// The id of an incremental snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The tables of an incremental snapshot, in the order they are read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<String>,
    /// An incremental snapshot's progress (`None`: nothing read yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<Cursor>,
    /// When the captured state is complete, in ms since the epoch: the
    /// slot's consistent point (initial) or the last chunk (incremental).
    /// From then on every change is in the log too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistent_ts_ms: Option<i64>,
    /// Why an incremental snapshot failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The slot's consistent point (unknown in a `started` marker, which is
    /// written before the slot exists).
    pub consistent_point: Option<String>,
    /// topic → partition → end offset at the start of the snapshot.
    pub start_offsets: BTreeMap<String, BTreeMap<i32, i64>>,
    /// topic → partition → end offset once the snapshot was acknowledged.
    pub end_offsets: BTreeMap<String, BTreeMap<i32, i64>>,
    /// table → rows copied.
    pub rows: BTreeMap<String, u64>,
    /// table → number of chunks it was copied in.
    #[serde(default)]
    pub chunks: BTreeMap<String, usize>,
    pub ts_ms: i64,
}

impl Marker {
    /// The record key: the slot for the initial snapshot,
    /// `<slot>/incremental/<id>` for an incremental one.
    pub fn key(&self) -> String {
        match (&self.kind, &self.id) {
            (Kind::Incremental, Some(id)) => incremental_key(&self.slot, id),
            _ => self.slot.clone(),
        }
    }

    /// When the captured state is complete ([`Marker::consistent_ts_ms`],
    /// or the marker's own time for markers written before that field).
    pub fn since_ms(&self) -> i64 {
        self.consistent_ts_ms.unwrap_or(self.ts_ms)
    }
}

/// Whether a slot that does not exist now had streamed before: the latest
/// initial marker of its name is `completed`. Such a slot was dropped (or
/// removed) outside pgcdc, and changes after its last confirmed LSN may
/// never have reached Kafka, so the connector refuses to start over
/// silently.
pub fn vanished(markers: &[Marker], slot: &str) -> Option<Marker> {
    markers
        .iter()
        .rfind(|m| m.key() == slot)
        .filter(|m| m.kind == Kind::Initial && m.phase == Phase::Completed)
        .cloned()
}

/// The marker `pgcdc slot drop` writes after dropping the slot: the history
/// in Kafka breaks here, and the next start creates a new slot and takes a
/// new snapshot. It reads as an initial snapshot not yet finished.
pub fn dropped(slot: &str, ts_ms: i64) -> Marker {
    Marker {
        slot: slot.to_string(),
        phase: Phase::Started,
        kind: Kind::Initial,
        id: None,
        tables: Vec::new(),
        cursor: None,
        consistent_ts_ms: None,
        error: Some("the slot was dropped with `pgcdc slot drop`".into()),
        consistent_point: None,
        start_offsets: BTreeMap::new(),
        end_offsets: BTreeMap::new(),
        rows: BTreeMap::new(),
        chunks: BTreeMap::new(),
        ts_ms,
    }
}

/// The record key of an incremental snapshot's markers.
pub fn incremental_key(slot: &str, id: &str) -> String {
    format!("{slot}/incremental/{id}")
}

pub fn topic(config: &Config) -> String {
    format!("{}.snapshots", config.kafka.topic_prefix)
}

/// Creates the marker topic: one partition, compacted, so the latest marker
/// of every slot is kept for good.
pub async fn ensure_topic(config: &Config) -> Result<(), rdkafka::error::KafkaError> {
    sink::ensure_state_topic(&config.kafka, &topic(config)).await
}

/// Writes a marker and waits for Kafka to acknowledge it.
pub async fn write(
    producer: &sink::Producer,
    config: &Config,
    marker: &Marker,
) -> Result<(), String> {
    let payload = serde_json::to_vec(marker).map_err(|e| e.to_string())?;
    let key = marker.key();
    let f = producer
        .send(&topic(config), Some(key.as_bytes()), Some(&payload))
        .await
        .map_err(|e| e.to_string())?;
    f.await
        .map_err(|e| format!("snapshot marker not written: {e}"))
}

/// The latest marker of `slot`, reading the whole (compacted) topic.
pub async fn latest(
    kafka: &KafkaConfig,
    topic: &str,
    slot: &str,
) -> Result<Option<Marker>, String> {
    sink::latest_by_key(kafka, topic, slot)
        .await?
        .map(|v| serde_json::from_slice::<Marker>(&v).map_err(|e| format!("{topic}: {e}")))
        .transpose()
}

/// Every marker of the topic (all slots, all kinds), oldest first.
/// Records that are not markers are skipped with a warning.
pub async fn all(kafka: &KafkaConfig, topic: &str) -> Result<Vec<Marker>, String> {
    Ok(sink::read_state_topic(kafka, topic)
        .await?
        .into_iter()
        .filter_map(|(_, v)| {
            let v = v?;
            serde_json::from_slice::<Marker>(&v)
                .inspect_err(
                    |e| tracing::warn!(%topic, error = %e, "not a snapshot marker; skipped"),
                )
                .ok()
        })
        .collect())
}

/// End offsets of every partition of `topics`, as a committed reader
/// sees them.
pub async fn end_offsets(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<BTreeMap<String, BTreeMap<i32, i64>>, String> {
    offsets_as(kafka, topics, sink::Isolation::Committed).await
}

/// End offsets of every partition of `topics` past everything written,
/// open transactions included: a snapshot's [`Marker::end_offsets`].
/// Under exactly-once the snapshot's own transaction is still open when
/// its marker is written, and a committed reader's end would stop at its
/// first record.
pub async fn written_offsets(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<BTreeMap<String, BTreeMap<i32, i64>>, String> {
    offsets_as(kafka, topics, sink::Isolation::Uncommitted).await
}

async fn offsets_as(
    kafka: &KafkaConfig,
    topics: &[String],
    isolation: sink::Isolation,
) -> Result<BTreeMap<String, BTreeMap<i32, i64>>, String> {
    Ok(sink::watermarks_as(kafka, topics, isolation)
        .await?
        .into_iter()
        .map(|(t, parts)| {
            (
                t,
                parts.into_iter().map(|(p, (_, high))| (p, high)).collect(),
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn initial(slot: &str, phase: Phase) -> Marker {
        Marker {
            phase,
            consistent_point: Some("0/10".into()),
            ..dropped(slot, 1)
        }
    }

    #[test]
    fn a_missing_slot_vanished_only_if_its_latest_initial_marker_completed() {
        let completed = initial("s", Phase::Completed);
        assert_eq!(
            vanished(std::slice::from_ref(&completed), "s"),
            Some(completed.clone())
        );
        // Never started, an interrupted snapshot, or a drop pgcdc recorded.
        assert_eq!(vanished(&[], "s"), None);
        assert_eq!(vanished(&[initial("s", Phase::Started)], "s"), None);
        assert_eq!(vanished(&[completed.clone(), dropped("s", 2)], "s"), None);
        // Other slots and incremental markers do not count.
        assert_eq!(vanished(std::slice::from_ref(&completed), "t"), None);
        let mut incremental = completed.clone();
        incremental.kind = Kind::Incremental;
        incremental.id = Some("x".into());
        assert_eq!(
            vanished(&[initial("s", Phase::Started), incremental], "s"),
            None
        );
    }
}
