//! Connector offsets for the exactly-once mode: the newest source
//! transaction whose events Kafka holds, in the compacted topic
//! `<prefix>.offsets`, keyed by slot.
//!
//! Guarantees:
//! - An offset record is produced in the same Kafka transaction as the
//!   events it covers, so a `read_committed` reader sees both or neither.
//! - On start, the connector skips every replayed source transaction whose
//!   commit LSN is at or before the committed record's: Kafka already holds
//!   its events. What a crash left uncommitted was aborted by the broker
//!   and is produced again.
//!
//! ```text
//!  events of txns …→ T ─┐
//!  offset {commit_lsn(T)} ─┴─► one Kafka transaction ──► commit ──► confirm end_lsn(T) to Postgres
//! ```

use serde::{Deserialize, Serialize};

use crate::config::{Config, KafkaConfig};
use crate::sink;
use crate::source::pgoutput::Lsn;

/// One offset record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offset {
    pub slot: String,
    /// Commit LSN of the newest source transaction whose events are
    /// committed in Kafka; `0/0` right after a snapshot.
    pub commit_lsn: String,
    /// The position that may be confirmed to Postgres.
    pub end_lsn: String,
    pub ts_ms: i64,
}

impl Offset {
    pub fn new(slot: &str, commit_lsn: u64, end_lsn: u64, ts_ms: i64) -> Offset {
        Offset {
            slot: slot.to_string(),
            commit_lsn: Lsn(commit_lsn).to_string(),
            end_lsn: Lsn(end_lsn).to_string(),
            ts_ms,
        }
    }

    /// The commit LSN as a number (0 when unparseable: skip nothing).
    pub fn commit(&self) -> u64 {
        self.commit_lsn.parse::<Lsn>().map_or(0, |l| l.0)
    }
}

pub fn topic(config: &Config) -> String {
    format!("{}.offsets", config.kafka.topic_prefix)
}

/// The Kafka transactional id of a connector: one per slot, so a restarted
/// connector fences its predecessor.
pub fn transactional_id(config: &Config) -> String {
    format!("pgcdc.{}.{}", config.name, config.source.slot)
}

/// Creates the offsets topic: one partition, compacted.
pub async fn ensure_topic(config: &Config) -> Result<(), rdkafka::error::KafkaError> {
    sink::ensure_state_topic(&config.kafka, &topic(config)).await
}

/// Produces an offset record into the open Kafka transaction.
pub async fn write(
    producer: &sink::Producer,
    config: &Config,
    offset: &Offset,
) -> Result<sink::Delivery, String> {
    let payload = serde_json::to_vec(offset).map_err(|e| e.to_string())?;
    producer
        .send(&topic(config), Some(offset.slot.as_bytes()), Some(&payload))
        .await
        .map_err(|e| format!("{}: {e}", topic(config)))
}

/// The latest committed offset record of `slot`.
pub async fn latest(
    kafka: &KafkaConfig,
    topic: &str,
    slot: &str,
) -> Result<Option<Offset>, String> {
    sink::latest_by_key(kafka, topic, slot)
        .await?
        .map(|v| serde_json::from_slice::<Offset>(&v).map_err(|e| format!("{topic}: {e}")))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_round_trip_as_readable_json() {
        let o = Offset::new("s", 0x1_0000_00A0, 0x1_0000_00F0, 7);
        let json = serde_json::to_string(&o).expect("serialize");
        assert!(json.contains("\"commit_lsn\":\"1/A0\""), "{json}");
        let back: Offset = serde_json::from_str(&json).expect("parse");
        assert_eq!(back, o);
        assert_eq!(back.commit(), 0x1_0000_00A0);
    }
}
