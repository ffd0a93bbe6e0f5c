//! The Kafka side: client configuration, topic creation, and the producer
//! whose acknowledgements decide what may be confirmed to Postgres.
//!
//! Guarantees:
//! - User properties pass through to librdkafka unchanged, except those the
//!   delivery guarantee depends on ([`crate::config::MANAGED_KAFKA_PROPERTIES`]),
//!   which validation refuses and which are set here: the idempotent
//!   producer with `acks=all`, and the Java-compatible murmur2 partitioner,
//!   so per-key order holds and Java clients agree on partitions.
//! - [`Acks`] releases a transaction's end LSN only after every message
//!   produced before it was acknowledged, in order; the watermark it
//!   publishes only moves forward. A failed delivery stops it, and nothing
//!   after the failure is ever released.
//!
//! ```text
//!  send ──► DeliveryFuture ─┐
//!  commit(end_lsn) ─────────┼─► bounded FIFO ──► await in order ──► watch<confirmed LSN>
//! ```

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use tokio::sync::{mpsc, watch};

use crate::config::KafkaConfig;

/// A librdkafka config with the brokers and the user's pass-through
/// properties (SASL, SSL, compression, ...).
pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &kafka.brokers);
    for (k, v) in kafka.properties.iter() {
        cc.set(k, v);
    }
    cc.set_log_level(rdkafka::config::RDKafkaLogLevel::Warning);
    cc
}

/// Producer queue bound when the user sets none: 64 MiB.
pub const DEFAULT_QUEUE_KBYTES: &str = "65536";

/// The changelog producer.
pub fn producer(kafka: &KafkaConfig) -> Result<FutureProducer, KafkaError> {
    let mut cc = client_config(kafka);
    cc.set("enable.idempotence", "true")
        .set("acks", "all")
        // Java's partitioner: murmur2 of the key bytes; random for null keys.
        .set("partitioner", "murmur2_random");
    if !kafka.properties.0.contains_key("linger.ms") {
        cc.set("linger.ms", "5");
    }
    // librdkafka would buffer up to 1 GiB by default; beyond this bound
    // sends wait, which slows reading from the slot instead.
    if !kafka
        .properties
        .0
        .contains_key("queue.buffering.max.kbytes")
    {
        cc.set("queue.buffering.max.kbytes", DEFAULT_QUEUE_KBYTES);
    }
    cc.create()
}

/// Creates the topics that do not exist yet, with the configured
/// partitions, replication factor and cleanup policy.
pub async fn ensure_topics(kafka: &KafkaConfig, topics: &[String]) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = client_config(kafka).create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                kafka.partitions,
                TopicReplication::Fixed(kafka.replication_factor),
            )
            .set("cleanup.policy", kafka.cleanup_policy.as_str())
        })
        .collect();
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(new.iter(), &opts).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(KafkaError::AdminOp(code)).inspect_err(|_| {
                    tracing::error!(%topic, %code, "cannot create topic");
                })
            }
        }
    }
    Ok(())
}

/// Kafka's murmur2 (as `org.apache.kafka.common.utils.Utils.murmur2`).
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let chunks = data.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    match tail.len() {
        3 => {
            h ^= u32::from(tail[2]) << 16;
            h ^= u32::from(tail[1]) << 8;
            h ^= u32::from(tail[0]);
            h = h.wrapping_mul(M);
        }
        2 => {
            h ^= u32::from(tail[1]) << 8;
            h ^= u32::from(tail[0]);
            h = h.wrapping_mul(M);
        }
        1 => {
            h ^= u32::from(tail[0]);
            h = h.wrapping_mul(M);
        }
        _ => {}
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Java's default partitioner picks for a keyed record.
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % partitions
}

/// Enqueues a record, waiting while librdkafka's queue is full.
pub async fn send(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
) -> Result<DeliveryFuture, KafkaError> {
    loop {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic);
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(p) = payload {
            record = record.payload(p);
        }
        match producer.send_result(record) {
            Ok(f) => return Ok(f),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                // Backpressure: the queue drains as the broker acknowledges.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err((e, _)) => return Err(e),
        }
    }
}

enum Pending {
    Delivery(DeliveryFuture),
    /// Everything before this entry belongs to transactions ending at or
    /// before this LSN.
    Release(u64),
}

/// Ordered acknowledgement tracking (see the module guarantee).
#[derive(Debug)]
pub struct Acks {
    tx: mpsc::Sender<Pending>,
    confirmed: watch::Receiver<u64>,
    failed: watch::Receiver<Option<String>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pending::Delivery(_) => f.write_str("Delivery"),
            Pending::Release(l) => write!(f, "Release({l})"),
        }
    }
}

impl Acks {
    /// Starts the tracker; at most `capacity` entries wait at once, which
    /// bounds memory and slows the reader when Kafka falls behind.
    pub fn start(initial: u64, capacity: usize) -> Acks {
        let (tx, mut rx) = mpsc::channel::<Pending>(capacity);
        let (confirmed_tx, confirmed) = watch::channel(initial);
        let (failed_tx, failed) = watch::channel(None);
        tokio::spawn(async move {
            while let Some(p) = rx.recv().await {
                match p {
                    Pending::Delivery(f) => match f.await {
                        Ok(Ok(_)) => {}
                        Ok(Err((e, _))) => {
                            metrics::counter!(crate::observe::KAFKA_DELIVERY_ERRORS).increment(1);
                            let _ = failed_tx.send(Some(format!("Kafka delivery failed: {e}")));
                            return;
                        }
                        Err(_) => {
                            let _ = failed_tx.send(Some("the producer was dropped".into()));
                            return;
                        }
                    },
                    Pending::Release(lsn) => {
                        confirmed_tx.send_if_modified(|c| {
                            let moved = lsn > *c;
                            if moved {
                                *c = lsn;
                            }
                            moved
                        });
                    }
                }
            }
        });
        Acks {
            tx,
            confirmed,
            failed,
        }
    }

    /// Tracks one produced message.
    pub async fn delivery(&self, f: DeliveryFuture) -> Result<(), String> {
        self.tx
            .send(Pending::Delivery(f))
            .await
            .map_err(|_| self.failure())
    }

    /// Marks that everything tracked so far completes `lsn`.
    pub async fn release(&self, lsn: u64) -> Result<(), String> {
        self.tx
            .send(Pending::Release(lsn))
            .await
            .map_err(|_| self.failure())
    }

    /// The watermark: every message before it is acknowledged.
    pub fn confirmed(&self) -> watch::Receiver<u64> {
        self.confirmed.clone()
    }

    /// Resolves with the reason when a delivery fails.
    pub fn failed(&self) -> watch::Receiver<Option<String>> {
        self.failed.clone()
    }

    fn failure(&self) -> String {
        self.failed
            .borrow()
            .clone()
            .unwrap_or_else(|| "acknowledgement tracking stopped".into())
    }

    /// Waits until everything tracked so far is acknowledged and returns
    /// the final watermark.
    pub async fn drain(self, last: u64) -> Result<u64, String> {
        self.release(last).await?;
        let mut confirmed = self.confirmed.clone();
        let mut failed = self.failed.clone();
        drop(self.tx);
        loop {
            if *confirmed.borrow() >= last {
                return Ok(*confirmed.borrow());
            }
            if let Some(e) = failed.borrow().clone() {
                return Err(e);
            }
            tokio::select! {
                r = confirmed.changed() => if r.is_err() { break },
                r = failed.changed() => if r.is_err() { break },
            }
        }
        if *confirmed.borrow() >= last {
            Ok(*confirmed.borrow())
        } else {
            Err(self
                .failed
                .borrow()
                .clone()
                .unwrap_or_else(|| "acknowledgement tracking stopped".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_kafka_reference_values() {
        // Values from Kafka's UtilsTest.testMurmur2.
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ];
        for (input, expected) in cases {
            assert_eq!(
                murmur2(input),
                expected,
                "{}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn partition_is_positive_modulo() {
        for key in [&b"a"[..], b"hello", b"\x00\x00\x00\x00\x01"] {
            let p = partition_for(key, 3);
            assert!((0..3).contains(&p));
        }
    }
}
