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
//! - In exactly-once mode the [`Producer`] is transactional: every send
//!   belongs to a Kafka transaction, and nothing of it is visible to
//!   `read_committed` consumers before [`Producer::commit`] returns. The
//!   connector releases positions only after that commit.
//!
//! ```text
//!  send ──► DeliveryFuture ─┐
//!  commit(end_lsn) ─────────┼─► bounded FIFO ──► await in order ──► watch<confirmed LSN>
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
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

/// Whether the broker's answer is one a retry cannot change: bad
/// credentials, a missing permission, a fenced transactional producer, or
/// a client setting librdkafka refuses. (What to do about it is decided in
/// [`crate::dlq::classify`].)
pub fn refused(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    if matches!(
        e,
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_)
    ) {
        return true;
    }
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::Authentication
                | C::SaslAuthenticationFailed
                | C::TopicAuthorizationFailed
                | C::GroupAuthorizationFailed
                | C::ClusterAuthorizationFailed
                | C::TransactionalIdAuthorizationFailed
                | C::DelegationTokenAuthorizationFailed
                | C::ProducerFenced
                | C::InvalidProducerEpoch
                | C::Fenced
                | C::InvalidConfig
                | C::InvalidArgument
        )
    )
}

/// Producer queue bound when the user sets none: 64 MiB.
pub const DEFAULT_QUEUE_KBYTES: &str = "65536";
/// Kafka transaction timeout when the user sets none: 15 minutes, the
/// broker's default `transaction.max.timeout.ms`, so a large source
/// transaction can stream through one Kafka transaction.
pub const DEFAULT_TRANSACTION_TIMEOUT_MS: &str = "900000";
/// How long one attempt to initialize or commit a Kafka transaction waits.
const TRANSACTION_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The changelog producer. With a transactional id, every send belongs to
/// a Kafka transaction that [`Producer::commit`] ends.
#[derive(Clone)]
pub struct Producer {
    inner: FutureProducer,
    /// Whether a Kafka transaction is open; `None` when not transactional.
    open: Option<Arc<Mutex<bool>>>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("transactional", &self.is_transactional())
            .finish()
    }
}

impl Producer {
    /// The idempotent producer; transactional when `transactional_id` is
    /// given, after fencing any earlier producer with the same id.
    pub async fn create(
        kafka: &KafkaConfig,
        transactional_id: Option<&str>,
    ) -> Result<Producer, KafkaError> {
        let mut cc = client_config(kafka);
        cc.set("enable.idempotence", "true")
            .set("acks", "all")
            // Java's partitioner: murmur2 of the key bytes; random for null keys.
            .set("partitioner", "murmur2_random");
        if !kafka.properties.0.contains_key("linger.ms") {
            cc.set("linger.ms", "5");
        }
        // Room for a record of max_message_bytes and its headers; larger
        // ones are quarantined before they reach librdkafka.
        if !kafka.properties.0.contains_key("message.max.bytes") {
            cc.set(
                "message.max.bytes",
                (kafka.max_message_bytes + 64 * 1024).to_string(),
            );
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
        let Some(id) = transactional_id else {
            return Ok(Producer {
                inner: cc.create()?,
                open: None,
            });
        };
        cc.set("transactional.id", id);
        if !kafka.properties.0.contains_key("transaction.timeout.ms") {
            cc.set("transaction.timeout.ms", DEFAULT_TRANSACTION_TIMEOUT_MS);
        }
        let inner: FutureProducer = cc.create()?;
        // Fences an earlier instance and aborts what it left open.
        let p = inner.clone();
        blocking(move || p.init_transactions(TRANSACTION_CALL_TIMEOUT)).await?;
        Ok(Producer {
            inner,
            open: Some(Arc::new(Mutex::new(false))),
        })
    }

    pub fn is_transactional(&self) -> bool {
        self.open.is_some()
    }

    /// Whether a Kafka transaction is open (always false when not
    /// transactional).
    pub fn in_transaction(&self) -> bool {
        self.open
            .as_ref()
            .is_some_and(|o| *o.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Enqueues a record, waiting while librdkafka's queue is full.
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
    ) -> Result<DeliveryFuture, KafkaError> {
        self.begin()?;
        send(&self.inner, topic, key, payload, None).await
    }

    /// Opens a Kafka transaction if the producer is transactional and
    /// none is open.
    fn begin(&self) -> Result<(), KafkaError> {
        if let Some(open) = &self.open {
            let mut open = open.lock().unwrap_or_else(|e| e.into_inner());
            if !*open {
                self.inner.begin_transaction()?;
                *open = true;
            }
        }
        Ok(())
    }

    /// [`Producer::send`] with record headers (inside the open Kafka
    /// transaction when transactional).
    pub async fn send_with_headers(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: OwnedHeaders,
    ) -> Result<DeliveryFuture, KafkaError> {
        self.begin()?;
        send(&self.inner, topic, key, payload, Some(headers)).await
    }

    /// Commits the open Kafka transaction, if any: its records become
    /// visible to `read_committed` consumers, all at once. Returns whether
    /// a transaction was committed. A commit that fails for good aborts
    /// the transaction and returns the error; nothing of it is visible.
    pub async fn commit(&self) -> Result<bool, KafkaError> {
        if !self.in_transaction() {
            return Ok(false);
        }
        let mut delay = Duration::from_millis(100);
        loop {
            let p = self.inner.clone();
            match blocking(move || p.commit_transaction(TRANSACTION_CALL_TIMEOUT)).await {
                Ok(()) => break,
                Err(e) if is_retriable(&e) => {
                    tracing::warn!(error = %e, "Kafka transaction commit failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    if txn_requires_abort(&e) {
                        let _ = self.abort().await;
                    }
                    return Err(e);
                }
            }
        }
        self.set_open(false);
        Ok(true)
    }

    /// Aborts the open Kafka transaction, if any.
    pub async fn abort(&self) -> Result<(), KafkaError> {
        if !self.in_transaction() {
            return Ok(());
        }
        let p = self.inner.clone();
        blocking(move || p.abort_transaction(TRANSACTION_CALL_TIMEOUT)).await?;
        self.set_open(false);
        Ok(())
    }

    /// Waits until Kafka acknowledged (or refused) every message sent so
    /// far, on every partition.
    pub async fn flush(&self) -> Result<(), KafkaError> {
        let p = self.inner.clone();
        blocking(move || p.flush(Duration::from_secs(120))).await
    }

    fn set_open(&self, value: bool) {
        if let Some(open) = &self.open {
            *open.lock().unwrap_or_else(|e| e.into_inner()) = value;
        }
    }
}

fn is_retriable(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(t) if t.is_retriable())
}

fn txn_requires_abort(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(t) if t.txn_requires_abort())
}

/// Runs a blocking librdkafka call (transactions, metadata) off the
/// runtime's worker threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, KafkaError> + Send + 'static,
) -> Result<T, KafkaError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| KafkaError::Canceled)?
}

/// Creates the topics that do not exist yet, with the configured
/// partitions, replication factor and cleanup policy. Existing topics are
/// left as they are, so brokers without topic creation (or users who
/// create topics themselves) work.
pub async fn ensure_topics(kafka: &KafkaConfig, topics: &[String]) -> Result<(), KafkaError> {
    create_missing(kafka, topics, &[]).await
}

/// Creates the dead-letter topic when it is missing: one partition (the
/// workflow reads it in order), `cleanup.policy=delete` and
/// `retention.ms=-1`, so a quarantined message is never compacted away
/// or expired before the store recorded it.
pub async fn ensure_dlq_topic(kafka: &KafkaConfig, topic: &str) -> Result<(), KafkaError> {
    let mut kafka = kafka.clone();
    kafka.partitions = 1;
    kafka.cleanup_policy = crate::config::CleanupPolicy::Delete;
    create_missing(&kafka, &[topic.to_string()], &[("retention.ms", "-1")]).await
}

/// Creates domain-event topics (outbox routing) when missing, always
/// with `cleanup.policy=delete`: compaction would keep only a stream's
/// last event.
pub async fn ensure_event_topics(kafka: &KafkaConfig, topics: &[String]) -> Result<(), KafkaError> {
    let mut kafka = kafka.clone();
    kafka.cleanup_policy = crate::config::CleanupPolicy::Delete;
    create_missing(&kafka, topics, &[]).await
}

/// Refuses a dead-letter topic that would lose quarantined messages: one
/// created earlier with compaction (records of one key replace each
/// other). A retention the broker reports is only warned about.
pub async fn check_dlq_topic(kafka: &KafkaConfig, topic: &str) -> Result<(), String> {
    use rdkafka::admin::ResourceSpecifier;
    let admin: AdminClient<DefaultClientContext> =
        client_config(kafka).create().map_err(|e| e.to_string())?;
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .map_err(|e| format!("{topic}: describe configs: {e}"))?;
    for resource in results.into_iter().flatten() {
        let value = |k: &str| resource.get(k).and_then(|e| e.value.clone());
        if let Some(policy) = value("cleanup.policy").filter(|p| p.contains("compact")) {
            return Err(format!(
                "{topic} has cleanup.policy={policy}: compaction would drop dead letters of one key; \
                 set cleanup.policy=delete and retention.ms=-1 on it"
            ));
        }
        if let Some(ms) = value("retention.ms").filter(|ms| ms != "-1") {
            tracing::warn!(%topic, retention_ms = %ms,
                "the dead-letter topic expires records; the store must record them first (pgcdc dlq, or the materializer's rounds)");
        }
    }
    Ok(())
}

async fn create_missing(
    kafka: &KafkaConfig,
    topics: &[String],
    extra: &[(&str, &str)],
) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = client_config(kafka).create()?;
    let missing: Vec<String> = {
        let wanted = topics.to_vec();
        let probe: BaseConsumer = client_config(kafka).create()?;
        blocking(move || {
            let md = probe.fetch_metadata(None, Duration::from_secs(30))?;
            let present: std::collections::HashSet<&str> = md
                .topics()
                .iter()
                .filter(|t| t.error().is_none() && !t.partitions().is_empty())
                .map(|t| t.name())
                .collect();
            Ok(wanted
                .into_iter()
                .filter(|t| !present.contains(t.as_str()))
                .collect())
        })
        .await?
    };
    if missing.is_empty() {
        return Ok(());
    }
    let new: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                kafka.partitions,
                TopicReplication::Fixed(kafka.replication_factor),
            )
            .set("cleanup.policy", kafka.cleanup_policy.as_str())
        })
        .map(|t| extra.iter().fold(t, |t, (k, v)| t.set(k, v)))
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

/// Creates a state topic of ours (snapshot markers, connector offsets):
/// one partition, compacted, so the latest record of every key is kept
/// for good.
pub async fn ensure_state_topic(kafka: &KafkaConfig, topic: &str) -> Result<(), KafkaError> {
    let mut kafka = kafka.clone();
    kafka.partitions = 1;
    kafka.cleanup_policy = crate::config::CleanupPolicy::Compact;
    ensure_topics(&kafka, &[topic.to_string()]).await
}

/// Topic → partition → `(low, high)` watermarks, for the topics that
/// exist (a topic the broker does not know is absent).
pub async fn watermarks(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeMap<i32, (i64, i64)>>, String>
{
    let (kafka, topics) = (kafka.clone(), topics.to_vec());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client_config(&kafka).create().map_err(|e| e.to_string())?;
        let mut out = std::collections::BTreeMap::new();
        for topic in &topics {
            let md = consumer
                .fetch_metadata(Some(topic), Duration::from_secs(15))
                .map_err(|e| format!("{topic}: {e}"))?;
            for t in md
                .topics()
                .iter()
                .filter(|t| t.error().is_none() && !t.partitions().is_empty())
            {
                let mut parts = std::collections::BTreeMap::new();
                for p in t.partitions() {
                    let marks = consumer
                        .fetch_watermarks(topic, p.id(), Duration::from_secs(15))
                        .map_err(|e| format!("{topic}/{}: {e}", p.id()))?;
                    parts.insert(p.id(), marks);
                }
                out.insert(topic.clone(), parts);
            }
        }
        Ok(out)
    })
    .await
    .map_err(|e| e.to_string())?
}

/// The value of the latest record with `key` in partition 0 of a
/// single-partition compacted topic (see [`read_state_topic`]).
pub async fn latest_by_key(
    kafka: &KafkaConfig,
    topic: &str,
    key: &str,
) -> Result<Option<Vec<u8>>, String> {
    Ok(read_state_topic(kafka, topic)
        .await?
        .into_iter()
        .rev()
        .find(|(k, _)| k.as_deref() == Some(key.as_bytes()))
        .and_then(|(_, v)| v))
}

/// Every record `(key, value)` of partition 0 of a single-partition state
/// topic, oldest first, read from the beginning with `read_committed`
/// (records of aborted Kafka transactions are invisible).
pub async fn read_state_topic(
    kafka: &KafkaConfig,
    topic: &str,
) -> Result<Vec<(Option<Vec<u8>>, Option<Vec<u8>>)>, String> {
    let (kafka, topic) = (kafka.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = client_config(&kafka)
            .set("group.id", "pgcdc-state-reader")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .map_err(|e| e.to_string())?;
        let mut records = Vec::new();
        // A topic not created yet holds nothing; any other failure is one.
        let exists = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .map_err(|e| format!("{topic}: {e}"))?
            .topics()
            .iter()
            .any(|t| t.error().is_none() && !t.partitions().is_empty());
        if !exists {
            return Ok(records);
        }
        let (low, high) = consumer
            .fetch_watermarks(&topic, 0, Duration::from_secs(10))
            .map_err(|e| format!("{topic}: {e}"))?;
        if high <= low {
            return Ok(records);
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Beginning)
            .map_err(|e| e.to_string())?;
        consumer.assign(&tpl).map_err(|e| e.to_string())?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if std::time::Instant::now() > deadline {
                return Err(format!("{topic}: could not read up to offset {high}"));
            }
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    records.push((m.key().map(<[u8]>::to_vec), m.payload().map(<[u8]>::to_vec)));
                    if m.offset() + 1 >= high {
                        return Ok(records);
                    }
                }
                Some(Err(e)) => return Err(format!("{topic}: {e}")),
                // Under read_committed the last offsets may be control
                // records that are never delivered: the position tells.
                None => {
                    let at = consumer.position().ok().and_then(|p| {
                        p.find_partition(&topic, 0)
                            .and_then(|e| e.offset().to_raw())
                    });
                    if at.is_some_and(|o| o >= high) {
                        return Ok(records);
                    }
                }
            }
        }
    })
    .await
    .map_err(|e| e.to_string())?
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
async fn send(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
    headers: Option<OwnedHeaders>,
) -> Result<DeliveryFuture, KafkaError> {
    loop {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic);
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(p) = payload {
            record = record.payload(p);
        }
        if let Some(h) = &headers {
            record = record.headers(h.clone());
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
    /// before this LSN; with the source commit times (Unix µs) of the
    /// transactions it completes, for the commit-to-ack latency.
    Release(u64, Vec<i64>),
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
            Pending::Release(l, _) => write!(f, "Release({l})"),
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
                    Pending::Release(lsn, committed) => {
                        confirmed_tx.send_if_modified(|c| {
                            let moved = lsn > *c;
                            if moved {
                                *c = lsn;
                            }
                            moved
                        });
                        if !committed.is_empty() {
                            let now = crate::observe::now_us();
                            let latency = metrics::histogram!(crate::observe::COMMIT_TO_ACK);
                            for at in committed {
                                latency.record((now - at).max(0) as f64 / 1e6);
                            }
                        }
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
        self.release_committed(lsn, Vec::new()).await
    }

    /// [`Acks::release`] for source transactions committed at `committed`
    /// (Unix µs): once acknowledged, their commit-to-ack latency is
    /// recorded.
    pub async fn release_committed(&self, lsn: u64, committed: Vec<i64>) -> Result<(), String> {
        self.tx
            .send(Pending::Release(lsn, committed))
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
