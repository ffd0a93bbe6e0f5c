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
//!   produced before it was acknowledged; the watermark it publishes only
//!   moves forward. A failed delivery stops it, and nothing after the
//!   failure is ever released. Tracked messages cost no future and no
//!   channel message each: librdkafka's delivery callback marks a sequence
//!   number done, and the contiguous prefix of done numbers decides.
//! - [`BulkProducer`] (the initial snapshot, at least once) tracks nothing
//!   per message: librdkafka reports failed deliveries only, and
//!   [`BulkProducer::flush`] returns only once every message sent is
//!   acknowledged, failing if any delivery failed. The connector releases
//!   no position before that flush.
//! - In exactly-once mode the [`Producer`] is transactional: every send
//!   belongs to a Kafka transaction, and nothing of it is visible to
//!   `read_committed` consumers before [`Producer::commit`] returns. The
//!   connector releases positions only after that commit.
//!
//! ```text
//!  Acks::send ──► ticket (seq, waits while the window is full) ──► librdkafka
//!  release(end_lsn) ──► mark at the next seq                          │
//!                                                                     ▼
//!  watch<confirmed LSN> ◄── marks below the acked prefix ◄── delivery callback: seq done
//! ```

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use tokio::sync::{oneshot, watch, Notify};

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

/// Creates librdkafka clients. Its refusal of a property quotes the value
/// (`Invalid value "..." for configuration property "..."`), which may be
/// a secret: every client is created through here, and the value is
/// blanked out of the error (clippy's `disallowed-methods` forbids the
/// direct calls).
pub trait CreateClient {
    /// A client with the [`Quiet`] context: librdkafka's logs with their
    /// repeats folded, short-lived clients' too.
    fn client<T: rdkafka::config::FromClientConfigAndContext<Quiet>>(
        &self,
    ) -> rdkafka::error::KafkaResult<T>;
    fn client_with<C, T>(&self, context: C) -> rdkafka::error::KafkaResult<T>
    where
        C: rdkafka::ClientContext,
        T: rdkafka::config::FromClientConfigAndContext<C>;
}

impl CreateClient for ClientConfig {
    fn client<T: rdkafka::config::FromClientConfigAndContext<Quiet>>(
        &self,
    ) -> rdkafka::error::KafkaResult<T> {
        self.client_with(Quiet)
    }

    fn client_with<C, T>(&self, context: C) -> rdkafka::error::KafkaResult<T>
    where
        C: rdkafka::ClientContext,
        T: rdkafka::config::FromClientConfigAndContext<C>,
    {
        #[allow(clippy::disallowed_methods)]
        self.create_with_context(context).map_err(without_value)
    }
}

/// A refused property's error, naming the property but not its value.
fn without_value(e: KafkaError) -> KafkaError {
    const HIDDEN: &str = "(value not shown)";
    match e {
        KafkaError::ClientConfig(res, desc, key, value) => {
            // A value quoted in the description goes with it (replacing
            // only the value would garble a text around a short one).
            let desc = if !value.is_empty() && desc.contains(&value) {
                format!("the value of \"{key}\" is refused")
            } else {
                desc
            };
            KafkaError::ClientConfig(res, desc, key, HIDDEN.to_string())
        }
        other => other,
    }
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

/// librdkafka's `linger.ms` for changes when the user sets none: a
/// change waits at most this long for others to share its batch.
const STREAM_LINGER_MS: &str = "5";
/// `linger.ms` of the snapshot's producer when the user sets none. Rows
/// are produced as fast as they are copied, and fuller batches cost the
/// broker (and librdkafka) less per message: with 5 ms the broker spent
/// 2.6 times the CPU per row that it spends on full batches.
const BULK_LINGER_MS: &str = "100";
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
    inner: ThreadedProducer<Deliveries>,
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
        Self::create_lingering(kafka, transactional_id, STREAM_LINGER_MS).await
    }

    async fn create_lingering(
        kafka: &KafkaConfig,
        transactional_id: Option<&str>,
        linger_ms: &str,
    ) -> Result<Producer, KafkaError> {
        let mut cc = producer_config(kafka, linger_ms);
        let Some(id) = transactional_id else {
            return Ok(Producer {
                inner: cc.client_with(Deliveries)?,
                open: None,
            });
        };
        cc.set("transactional.id", id);
        if !kafka.properties.0.contains_key("transaction.timeout.ms") {
            cc.set("transaction.timeout.ms", DEFAULT_TRANSACTION_TIMEOUT_MS);
        }
        let inner: ThreadedProducer<Deliveries> = cc.client_with(Deliveries)?;
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

    /// Enqueues a record, waiting while librdkafka's queue is full; the
    /// returned [`Delivery`] resolves with Kafka's answer.
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
    ) -> Result<Delivery, KafkaError> {
        self.send_with(topic, key, payload, None).await
    }

    async fn send_with(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
    ) -> Result<Delivery, KafkaError> {
        self.begin()?;
        let (tx, rx) = oneshot::channel();
        let record = Record {
            topic,
            partition: None,
            key,
            payload,
            headers,
        };
        send(&self.inner, record, Ticket::Reply(tx)).await?;
        Ok(Delivery(rx))
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
    ) -> Result<Delivery, KafkaError> {
        self.send_with(topic, key, payload, Some(headers)).await
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

/// The cluster's metadata, waiting up to 30 s. Kafka not answering within
/// the first 5 s is logged at once: an operator who started pgcdc with a
/// wrong address or a broker down would otherwise see nothing for 30 s.
fn cluster_metadata<C: rdkafka::consumer::ConsumerContext>(
    probe: &BaseConsumer<C>,
    brokers: &str,
) -> Result<rdkafka::metadata::Metadata, KafkaError> {
    const FIRST: Duration = Duration::from_secs(5);
    const ALL: Duration = Duration::from_secs(30);
    use RDKafkaErrorCode as C;
    probe.fetch_metadata(None, FIRST).or_else(|e| match e {
        // Not reached yet; anything else (refused credentials, say) is
        // the answer.
        KafkaError::MetadataFetch(
            C::OperationTimedOut
            | C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::Resolve
            | C::RequestTimedOut,
        ) => {
            tracing::warn!(%brokers, error = %e, wait_secs = (ALL - FIRST).as_secs(),
                "Kafka is not answering yet; still trying");
            probe.fetch_metadata(None, ALL - FIRST)
        }
        other => Err(other),
    })
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

/// Room a record needs beyond its key and value in a batch of its own:
/// the batch and record headers, and pgcdc's headers.
pub const RECORD_FRAMING: usize = 1024;

/// The bound on a record's key and value for a topic whose
/// `max.message.bytes` is `topic_limit`, when it is under
/// `max_message_bytes`; `None` when the topic takes that much.
pub fn lowered_bound(max_message_bytes: usize, topic_limit: usize) -> Option<usize> {
    let fits = topic_limit.saturating_sub(RECORD_FRAMING);
    (fits < max_message_bytes).then_some(fits)
}

/// librdkafka's `batch.size` when the user sets none.
pub const LIBRDKAFKA_BATCH_SIZE: usize = 1_000_000;

/// The `batch.size` librdkafka works with: the user's, or its default.
pub fn batch_size(kafka: &KafkaConfig) -> usize {
    kafka
        .properties
        .0
        .get("batch.size")
        .and_then(|b| b.parse().ok())
        .unwrap_or(LIBRDKAFKA_BATCH_SIZE)
}

/// The record bounds the connector keeps to: `kafka.max_message_bytes`,
/// lowered for each topic whose `max.message.bytes` (less
/// [`RECORD_FRAMING`]) is smaller.
#[derive(Debug, Clone, Default)]
pub struct Limits {
    pub default: usize,
    pub topics: HashMap<String, usize>,
}

impl Limits {
    /// The largest key and value a record to `topic` may have.
    pub fn of(&self, topic: &str) -> usize {
        self.topics.get(topic).copied().unwrap_or(self.default)
    }
}

/// The `max.message.bytes` of each of the `topics` that exist and whose
/// configs the broker gives.
pub async fn message_limits(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<HashMap<String, usize>, String> {
    use rdkafka::admin::ResourceSpecifier;
    if topics.is_empty() {
        return Ok(HashMap::new());
    }
    let admin: AdminClient<Quiet> = client_config(kafka).client().map_err(|e| e.to_string())?;
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    let specs: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let results = admin
        .describe_configs(specs.iter(), &opts)
        .await
        .map_err(|e| format!("describe configs: {e}"))?;
    Ok(topics
        .iter()
        .zip(results)
        .filter_map(|(topic, r)| {
            let limit = r
                .ok()?
                .get("max.message.bytes")
                .and_then(|e| e.value.as_deref()?.parse::<usize>().ok())?;
            Some((topic.clone(), limit))
        })
        .collect())
}

/// Refuses a dead-letter topic that would lose quarantined messages: one
/// created earlier with compaction (records of one key replace each
/// other). A retention the broker reports is only warned about.
pub async fn check_dlq_topic(kafka: &KafkaConfig, topic: &str) -> Result<(), String> {
    use rdkafka::admin::ResourceSpecifier;
    let admin: AdminClient<Quiet> = client_config(kafka).client().map_err(|e| e.to_string())?;
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
    let admin: AdminClient<Quiet> = client_config(kafka).client()?;
    let missing: Vec<String> = {
        let wanted = topics.to_vec();
        let probe: BaseConsumer<Quiet> = client_config(kafka).client()?;
        let brokers = kafka.brokers.clone();
        blocking(move || {
            let md = cluster_metadata(&probe, &brokers)?;
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
    let room = (kafka.max_message_bytes.max(batch_size(kafka)) + RECORD_FRAMING).to_string();
    let new: Vec<NewTopic<'_>> = missing
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                kafka.partitions,
                TopicReplication::Fixed(kafka.replication_factor),
            )
            .set("cleanup.policy", kafka.cleanup_policy.as_str())
            // Room for the largest record and batch pgcdc produces,
            // whatever the broker's default.
            .set("max.message.bytes", &room)
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

/// The offsets `group` has committed on `partitions` (those it has any
/// for), whichever of its members owns them: an offset fetch needs no
/// membership.
pub async fn group_committed(
    kafka: &KafkaConfig,
    group: &str,
    partitions: impl IntoIterator<Item = (String, i32)>,
) -> Result<std::collections::BTreeMap<(String, i32), i64>, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for (t, p) in partitions {
        tpl.add_partition(&t, p);
    }
    let consumer: BaseConsumer<Quiet> = client_config(kafka).set("group.id", group).client()?;
    let done = blocking(move || consumer.committed_offsets(tpl, Duration::from_secs(10))).await?;
    Ok(done
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some(((e.topic().to_string(), e.partition()), o)),
            _ => None,
        })
        .collect())
}

/// The partition count of each of `topics` that exists.
pub async fn partition_counts(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<std::collections::BTreeMap<String, i32>, KafkaError> {
    if topics.is_empty() {
        return Ok(Default::default());
    }
    let probe: BaseConsumer<Quiet> = client_config(kafka).client()?;
    let wanted = topics.to_vec();
    let brokers = kafka.brokers.clone();
    blocking(move || {
        let md = cluster_metadata(&probe, &brokers)?;
        Ok(md
            .topics()
            .iter()
            .filter(|t| t.error().is_none() && wanted.iter().any(|w| w == t.name()))
            .map(|t| (t.name().to_string(), t.partitions().len() as i32))
            .collect())
    })
    .await
}

/// Topic → partition → `(low, high)` watermarks, for the topics that
/// exist (a topic the broker does not know is absent).
pub async fn watermarks(
    kafka: &KafkaConfig,
    topics: &[String],
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeMap<i32, (i64, i64)>>, String>
{
    watermarks_as(kafka, topics, Isolation::Committed).await
}

/// Whose view of a partition's end: a committed reader's stops at the
/// first record of an open transaction, an uncommitted reader's does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    Committed,
    Uncommitted,
}

/// [`watermarks`] as a reader at `isolation`.
pub async fn watermarks_as(
    kafka: &KafkaConfig,
    topics: &[String],
    isolation: Isolation,
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeMap<i32, (i64, i64)>>, String>
{
    let (kafka, topics) = (kafka.clone(), topics.to_vec());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer<Quiet> = client_config(&kafka)
            .set(
                "isolation.level",
                match isolation {
                    Isolation::Committed => "read_committed",
                    Isolation::Uncommitted => "read_uncommitted",
                },
            )
            .client()
            .map_err(|e| e.to_string())?;
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
        let consumer: BaseConsumer<Quiet> = client_config(&kafka)
            .set("group.id", "pgcdc-state-reader")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .client()
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

/// What a produced message's delivery callback reports to.
enum Ticket {
    /// A caller awaits this one message ([`Delivery`]).
    Reply(oneshot::Sender<Result<(), KafkaError>>),
    /// Sequence number `seq` of an [`Acks`] window.
    Tracked(Arc<Window>, u64),
}

/// The producer's context: routes each delivery report to its ticket.
/// The idempotent producer's settings: `acks=all`, Java's partitioner,
/// `linger_ms` unless the user set `linger.ms`, and bounds on message size
/// and buffering.
fn producer_config(kafka: &KafkaConfig, linger_ms: &str) -> ClientConfig {
    let mut cc = client_config(kafka);
    cc.set("enable.idempotence", "true")
        .set("acks", "all")
        // Java's partitioner: murmur2 of the key bytes; random for null keys.
        .set("partitioner", "murmur2_random");
    if !kafka.properties.0.contains_key("linger.ms") {
        cc.set("linger.ms", linger_ms);
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
    cc
}

/// The producer of bulk copies (the initial snapshot when not exactly
/// once): idempotent, never transactional, [`BULK_LINGER_MS`] unless the
/// user set `linger.ms`, and untracked. librdkafka reports failed
/// deliveries only, so a message costs no ticket, no delivery report and
/// no window update; [`BulkProducer::flush`] waits until every message sent
/// is acknowledged, and fails if any delivery failed. The caller releases
/// positions only after it returned.
#[derive(Clone)]
pub struct BulkProducer {
    inner: ThreadedProducer<BulkDeliveries>,
    /// The first failed delivery: a `OnceLock`, so every send checks for
    /// one without a lock (two copy workers would contend on a mutex).
    failed: Arc<std::sync::OnceLock<String>>,
    /// Partition counts of the warmed topics, for [`BulkProducer::partition_count`].
    partitions: Arc<HashMap<String, i32>>,
}

impl std::fmt::Debug for BulkProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkProducer").finish_non_exhaustive()
    }
}

/// Keeps the first failed delivery of a [`BulkProducer`] (librdkafka's
/// polling thread).
struct BulkDeliveries(Arc<std::sync::OnceLock<String>>);

quiet_client_context!(BulkDeliveries);

impl ProducerContext for BulkDeliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = result {
            metrics::counter!(crate::observe::KAFKA_DELIVERY_ERRORS).increment(1);
            self.0.get_or_init(|| format!("Kafka delivery failed: {e}"));
        }
    }
}

impl BulkProducer {
    pub fn create(kafka: &KafkaConfig) -> Result<BulkProducer, KafkaError> {
        let mut cc = producer_config(kafka, BULK_LINGER_MS);
        cc.set("delivery.report.only.error", "true");
        let failed = Arc::new(std::sync::OnceLock::new());
        Ok(BulkProducer {
            inner: cc.client_with(BulkDeliveries(failed.clone()))?,
            failed,
            partitions: Arc::default(),
        })
    }

    /// Waits until the producer holds the metadata of `topics`: until then
    /// librdkafka keeps the rows in its queue, which fills within a fraction
    /// of a second and holds every copy behind it while it connects. Keeps
    /// their partition counts for [`BulkProducer::partition_count`].
    pub async fn warm(&mut self, topics: Vec<String>) -> Result<(), KafkaError> {
        let p = self.inner.clone();
        let counts = blocking(move || {
            let mut counts = HashMap::new();
            for topic in &topics {
                let metadata = p
                    .client()
                    .fetch_metadata(Some(topic), Duration::from_secs(30))?;
                if let Some(t) = metadata.topics().first() {
                    counts.insert(topic.clone(), t.partitions().len() as i32);
                }
            }
            Ok(counts)
        })
        .await?;
        self.partitions = Arc::new(counts);
        Ok(())
    }

    /// The partition count of a warmed `topic`, as read at
    /// [`BulkProducer::warm`]; `None` for a topic not warmed or without
    /// partitions. With [`partition_for`], the partition librdkafka's
    /// partitioner will most likely pick, to order sends by; only a hint,
    /// as the partitioner still places every record.
    pub fn partition_count(&self, topic: &str) -> Option<i32> {
        self.partitions.get(topic).copied().filter(|n| *n > 0)
    }

    fn failure(&self) -> Option<String> {
        self.failed.get().cloned()
    }

    /// Enqueues a record, waiting while librdkafka's queue is full; fails
    /// once any earlier delivery failed.
    pub async fn send(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
    ) -> Result<(), SendError> {
        if let Some(e) = self.failure() {
            return Err(SendError::Delivery(e));
        }
        let mut record: BaseRecord<'_, [u8], [u8], ()> = BaseRecord::to(topic);
        record.partition = partition;
        record.key = key;
        record.payload = payload;
        record.headers = headers;
        loop {
            match self.inner.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => return Err(SendError::Kafka(e)),
            }
        }
    }

    /// Waits until every message sent is acknowledged (or has failed), then
    /// fails if any delivery failed.
    pub async fn flush(&self) -> Result<(), SendError> {
        let p = self.inner.clone();
        // Each message ends within message.timeout.ms, delivered or failed.
        blocking(move || p.flush(rdkafka::util::Timeout::Never)).await?;
        match self.failure() {
            Some(e) => Err(SendError::Delivery(e)),
            None => Ok(()),
        }
    }
}

/// How long repeats of one librdkafka message are folded into a count.
const LOG_REPEAT_WINDOW: Duration = Duration::from_secs(30);

/// Counts repeats of a message kind: the first of a kind passes, the rest
/// are counted until [`LOG_REPEAT_WINDOW`] has passed since the last one
/// that passed, and the next then passes with that count.
#[derive(Default)]
struct Repeats {
    seen: HashMap<String, (Instant, u64)>,
}

impl Repeats {
    /// `Some(repeats folded since the last one passed)` when `kind` passes.
    fn admit(&mut self, kind: String, now: Instant) -> Option<u64> {
        if self.seen.len() > 1024 {
            self.seen.clear();
        }
        match self.seen.get_mut(&kind) {
            Some((last, folded)) if now.duration_since(*last) < LOG_REPEAT_WINDOW => {
                *folded += 1;
                None
            }
            Some((last, folded)) => {
                let n = *folded;
                (*last, *folded) = (now, 0);
                Some(n)
            }
            None => {
                self.seen.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

/// A message's kind: its text without digits (ports, broker ids) and
/// without the `(after 0ms in state CONNECT, 1 identical error(s)
/// suppressed)` that librdkafka appends.
fn message_kind(fac: &str, message: &str) -> String {
    let message = message.split(" (after ").next().unwrap_or(message);
    let mut kind = String::with_capacity(fac.len() + message.len());
    kind.push_str(fac);
    kind.extend(message.chars().filter(|c| !c.is_ascii_digit()));
    kind
}

static LIBRDKAFKA_REPEATS: std::sync::LazyLock<std::sync::Mutex<Repeats>> =
    std::sync::LazyLock::new(Default::default);

/// librdkafka's log lines and global errors, passed on to ours with the
/// repeats of a kind folded: in a broker outage it reports every failed
/// connection attempt of every broker thread, several a second.
pub(crate) fn librdkafka_log(level: RDKafkaLogLevel, fac: &str, message: &str) {
    if matches!(level, RDKafkaLogLevel::Debug) {
        tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}");
        return;
    }
    let admitted = LIBRDKAFKA_REPEATS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .admit(message_kind(fac, message), Instant::now());
    let Some(folded) = admitted else { return };
    let more = if folded > 0 {
        format!(
            " ({folded} more like it in the last {} s)",
            LOG_REPEAT_WINDOW.as_secs()
        )
    } else {
        String::new()
    };
    match level {
        RDKafkaLogLevel::Warning => {
            tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}{more}")
        }
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}{more}")
        }
        _ => tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}{more}"),
    }
}

/// The `ClientContext` of pgcdc's long-lived Kafka clients: librdkafka's
/// logs and global errors through [`librdkafka_log`].
macro_rules! quiet_client_context {
    ($t:ty) => {
        impl rdkafka::ClientContext for $t {
            fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
                $crate::sink::librdkafka_log(level, fac, message);
            }

            fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
                $crate::sink::librdkafka_log(
                    rdkafka::config::RDKafkaLogLevel::Error,
                    "ERROR",
                    &format!("{error}: {reason}"),
                );
            }
        }
    };
}
pub(crate) use quiet_client_context;

/// The context of pgcdc's other Kafka clients (projections, `pgcdc tail`,
/// rebuilds, and every short-lived admin client and probe through
/// [`CreateClient::client`]): librdkafka's logs with their repeats folded.
#[derive(Debug)]
pub struct Quiet;

quiet_client_context!(Quiet);

impl rdkafka::consumer::ConsumerContext for Quiet {}

/// For producers whose sends are awaited one by one (a `FutureProducer`
/// wraps its own context) or whose reports nobody reads.
impl ProducerContext for Quiet {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

/// A stream consumer whose librdkafka logs fold their repeats.
pub type QuietConsumer = rdkafka::consumer::StreamConsumer<Quiet>;

/// Runs on librdkafka's polling thread.
struct Deliveries;

quiet_client_context!(Deliveries);

impl ProducerContext for Deliveries {
    type DeliveryOpaque = Box<Ticket>;

    fn delivery(&self, result: &DeliveryResult<'_>, ticket: Box<Ticket>) {
        let result = result.as_ref().map(|_| ()).map_err(|(e, _)| e.clone());
        match *ticket {
            Ticket::Reply(tx) => {
                let _ = tx.send(result);
            }
            Ticket::Tracked(window, seq) => window.complete(seq, result),
        }
    }
}

/// Kafka's answer for one message sent with [`Producer::send`]. A
/// producer dropped before the answer resolves it with
/// [`KafkaError::Canceled`].
#[derive(Debug)]
pub struct Delivery(oneshot::Receiver<Result<(), KafkaError>>);

impl Future for Delivery {
    type Output = Result<(), KafkaError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(KafkaError::Canceled)))
    }
}

/// Enqueues a record, waiting while librdkafka's queue is full.
/// One record to produce.
struct Record<'a> {
    topic: &'a str,
    partition: Option<i32>,
    key: Option<&'a [u8]>,
    payload: Option<&'a [u8]>,
    headers: Option<OwnedHeaders>,
}

async fn send(
    producer: &ThreadedProducer<Deliveries>,
    r: Record<'_>,
    ticket: Ticket,
) -> Result<(), KafkaError> {
    let Record {
        topic,
        partition,
        key,
        payload,
        headers,
    } = r;
    let mut record: BaseRecord<'_, [u8], [u8], Box<Ticket>> =
        BaseRecord::with_opaque_to(topic, Box::new(ticket));
    if let Some(p) = partition {
        record = record.partition(p);
    }
    if let Some(k) = key {
        record = record.key(k);
    }
    if let Some(p) = payload {
        record = record.payload(p);
    }
    if let Some(h) = headers {
        record = record.headers(h);
    }
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                // Backpressure: the queue drains as the broker acknowledges.
                record = back;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err((e, back)) => {
                // Never queued: its ticket fails, so nothing after it is released.
                if let Ticket::Tracked(window, seq) = *back.delivery_opaque {
                    window.complete(seq, Err(e.clone()));
                }
                return Err(e);
            }
        }
    }
}

/// Why a tracked send failed: librdkafka refused to queue it, or the
/// tracker stopped after an earlier delivery failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    #[error("{0}")]
    Delivery(String),
}

/// Ordered acknowledgement tracking (see the module guarantee).
#[derive(Debug)]
pub struct Acks {
    window: Arc<Window>,
    confirmed: watch::Receiver<u64>,
    failed: watch::Receiver<Option<String>>,
}

/// Sequence numbers handed out to messages in flight, and the releases
/// waiting on them.
struct Window {
    state: Mutex<WindowState>,
    /// Wakes senders waiting for room.
    room: Notify,
    capacity: u64,
    confirmed: watch::Sender<u64>,
    failed: watch::Sender<Option<String>>,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("capacity", &self.capacity)
            .finish()
    }
}

struct WindowState {
    /// The next sequence number to hand out.
    next: u64,
    /// Every sequence number below it is acknowledged.
    acked: u64,
    /// Done flags of `acked..next`, at `seq % capacity`.
    done: Vec<bool>,
    /// Releases in order: `(mark, lsn, commit times)`, the LSN confirmed
    /// once every sequence number below `mark` is acknowledged.
    releases: VecDeque<(u64, u64, Vec<i64>)>,
    /// The first failure; nothing is released after it.
    failure: Option<String>,
    /// A sender waits for room.
    waiting: bool,
}

impl Window {
    fn lock(&self) -> std::sync::MutexGuard<'_, WindowState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A sequence number for one more message, once there is room.
    async fn ticket(&self) -> Result<u64, String> {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            {
                let mut s = self.lock();
                if let Some(e) = &s.failure {
                    return Err(e.clone());
                }
                if s.next - s.acked < self.capacity {
                    s.next += 1;
                    return Ok(s.next - 1);
                }
                // Registered before the lock is released: a completion
                // after it wakes this sender.
                room.as_mut().enable();
                s.waiting = true;
            }
            room.await;
        }
    }

    /// Kafka's answer for sequence number `seq` (librdkafka's thread).
    fn complete(&self, seq: u64, result: Result<(), KafkaError>) {
        let mut s = self.lock();
        if s.failure.is_some() {
            return;
        }
        if let Err(e) = result {
            metrics::counter!(crate::observe::KAFKA_DELIVERY_ERRORS).increment(1);
            let reason = format!("Kafka delivery failed: {e}");
            s.failure = Some(reason.clone());
            drop(s);
            let _ = self.failed.send(Some(reason));
            self.room.notify_waiters();
            return;
        }
        debug_assert!(
            seq >= s.acked && seq < s.next,
            "seq {seq} outside the window"
        );
        let cap = self.capacity;
        s.done[(seq % cap) as usize] = true;
        let before = s.acked;
        while s.acked < s.next && s.done[(s.acked % cap) as usize] {
            let at = (s.acked % cap) as usize;
            s.done[at] = false;
            s.acked += 1;
        }
        if s.acked == before {
            return;
        }
        self.release_ready(&mut s);
        if std::mem::take(&mut s.waiting) {
            self.room.notify_waiters();
        }
    }

    /// Publishes every release whose messages are all acknowledged.
    fn release_ready(&self, s: &mut WindowState) {
        let mut newest = None;
        while s
            .releases
            .front()
            .is_some_and(|(mark, ..)| *mark <= s.acked)
        {
            let Some((_, lsn, committed)) = s.releases.pop_front() else {
                break;
            };
            newest = Some(lsn);
            if !committed.is_empty() {
                let now = crate::observe::now_us();
                let latency = metrics::histogram!(crate::observe::COMMIT_TO_ACK);
                for at in committed {
                    latency.record((now - at).max(0) as f64 / 1e6);
                }
            }
        }
        if let Some(lsn) = newest {
            self.confirmed.send_if_modified(|c| {
                let moved = lsn > *c;
                if moved {
                    *c = lsn;
                }
                moved
            });
        }
    }
}

impl Acks {
    /// Starts the tracker; at most `capacity` messages await Kafka's
    /// answer at once, which bounds memory and slows the reader when
    /// Kafka falls behind.
    pub fn start(initial: u64, capacity: usize) -> Acks {
        let capacity = capacity.max(1);
        let (confirmed_tx, confirmed) = watch::channel(initial);
        let (failed_tx, failed) = watch::channel(None);
        let window = Arc::new(Window {
            state: Mutex::new(WindowState {
                next: 0,
                acked: 0,
                done: vec![false; capacity],
                releases: VecDeque::new(),
                failure: None,
                waiting: false,
            }),
            room: Notify::new(),
            capacity: capacity as u64,
            confirmed: confirmed_tx,
            failed: failed_tx,
        });
        Acks {
            window,
            confirmed,
            failed,
        }
    }

    /// Produces one tracked message: it gates every release after it.
    /// Waits while the window or librdkafka's queue is full.
    pub async fn send(
        &self,
        producer: &Producer,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
    ) -> Result<(), SendError> {
        self.send_to(producer, topic, None, key, payload, headers)
            .await
    }

    /// [`Acks::send`] to an explicit partition (`None`: the partitioner's).
    pub async fn send_to(
        &self,
        producer: &Producer,
        topic: &str,
        partition: Option<i32>,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
    ) -> Result<(), SendError> {
        producer.begin()?;
        let seq = self.window.ticket().await.map_err(SendError::Delivery)?;
        let ticket = Ticket::Tracked(self.window.clone(), seq);
        let record = Record {
            topic,
            partition,
            key,
            payload,
            headers,
        };
        send(&producer.inner, record, ticket).await?;
        Ok(())
    }

    /// Tracks a message sent with [`Producer::send`].
    pub async fn delivery(&self, f: Delivery) -> Result<(), String> {
        let seq = self.window.ticket().await?;
        let window = self.window.clone();
        tokio::spawn(async move { window.complete(seq, f.await) });
        Ok(())
    }

    /// Marks that everything tracked so far completes `lsn`.
    pub fn release(&self, lsn: u64) -> Result<(), String> {
        self.release_committed(lsn, Vec::new())
    }

    /// [`Acks::release`] for source transactions committed at `committed`
    /// (Unix µs): once acknowledged, their commit-to-ack latency is
    /// recorded.
    pub fn release_committed(&self, lsn: u64, committed: Vec<i64>) -> Result<(), String> {
        let mut s = self.window.lock();
        if let Some(e) = &s.failure {
            return Err(e.clone());
        }
        let mark = s.next;
        // Releases at one mark coalesce, so they never outnumber the
        // messages in flight.
        match s.releases.back_mut() {
            Some((m, l, c)) if *m == mark => {
                *l = (*l).max(lsn);
                c.extend(committed);
            }
            _ => s.releases.push_back((mark, lsn, committed)),
        }
        self.window.release_ready(&mut s);
        Ok(())
    }

    /// The watermark: every message before it is acknowledged.
    pub fn confirmed(&self) -> watch::Receiver<u64> {
        self.confirmed.clone()
    }

    /// Resolves with the reason when a delivery fails.
    pub fn failed(&self) -> watch::Receiver<Option<String>> {
        self.failed.clone()
    }

    /// Waits until everything tracked so far is acknowledged and returns
    /// the final watermark.
    pub async fn drain(self, last: u64) -> Result<u64, String> {
        self.release(last)?;
        let mut confirmed = self.confirmed.clone();
        let mut failed = self.failed.clone();
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
        Err("acknowledgement tracking stopped".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_property_is_named_without_its_value() {
        for (key, value) in [
            ("linger.ms", "hunter2-not-a-number"),
            ("sasl.pasword", "hunter2-misspelt-key"),
            ("sasl.oauthbearer.client.secret", "hunter2-oidc"),
        ] {
            let mut cc = ClientConfig::new();
            cc.set("bootstrap.servers", "127.0.0.1:1").set(key, value);
            // Unsupported in this build or not: whatever librdkafka says
            // of it must not carry the value.
            let Err(e) = cc.client::<BaseConsumer<Quiet>>() else {
                continue;
            };
            let text = format!("{e} {e:?}");
            assert!(!text.contains(value), "{key}: the value leaked: {text}");
            assert!(
                text.contains(key),
                "{key}: the property is not named: {text}"
            );
        }
        // The first one is always refused: the loop above checked something.
        let mut cc = ClientConfig::new();
        cc.set("linger.ms", "hunter2");
        assert!(matches!(
            cc.client::<BaseConsumer<Quiet>>(),
            Err(KafkaError::ClientConfig(..))
        ));
    }

    #[test]
    fn repeats_of_a_librdkafka_message_are_folded_for_a_window() {
        let kind = |port: &str| {
            message_kind(
                "FAIL",
                &format!("127.0.0.1:{port}/bootstrap: Connect failed (after 0ms in state CONNECT)"),
            )
        };
        assert_eq!(kind("35141"), kind("9092"), "numbers do not make a kind");
        assert_eq!(
            kind("1"),
            message_kind(
                "FAIL",
                "127.0.0.1:1/bootstrap: Connect failed (after 3ms in state CONNECT, 1 identical error(s) suppressed)"
            ),
            "nor librdkafka's own count"
        );
        let mut r = Repeats::default();
        let t0 = Instant::now();
        assert_eq!(r.admit(kind("1"), t0), Some(0), "the first passes");
        for s in 1..10 {
            assert_eq!(r.admit(kind("1"), t0 + Duration::from_secs(s)), None);
        }
        assert_eq!(
            r.admit(
                message_kind("FAIL", "another kind"),
                t0 + Duration::from_secs(1)
            ),
            Some(0)
        );
        // The window runs from the last one that passed.
        assert_eq!(
            r.admit(kind("1"), t0 + LOG_REPEAT_WINDOW),
            Some(9),
            "the next after the window passes with the count"
        );
        assert_eq!(r.admit(kind("1"), t0 + LOG_REPEAT_WINDOW), None);
    }

    #[test]
    fn partition_counts_are_known_for_warmed_topics_only() {
        let config = crate::config::Config::from_toml(
            r#"
name = "shop"
[source]
url = "postgres://app@127.0.0.1:5432/shop"
slot = "pgcdc_shop"
publication = "pgcdc_shop"
tables = ["public.orders"]
[kafka]
brokers = "127.0.0.1:9"
topic_prefix = "shop"
[registry]
url = "http://127.0.0.1:8081"
"#,
            "test.toml",
            &[],
        )
        .expect("config");
        let mut bulk = BulkProducer::create(&config.kafka).expect("producer");
        assert_eq!(bulk.partition_count("t"), None, "not warmed");
        bulk.partitions = Arc::new(HashMap::from([("t".to_string(), 7), ("e".to_string(), 0)]));
        assert_eq!(bulk.partition_count("t"), Some(7));
        assert_eq!(bulk.partition_count("e"), None, "no partitions read");
        assert_eq!(bulk.partition_count("u"), None, "another topic");
    }

    fn ok(acks: &Acks, seq: u64) {
        acks.window.complete(seq, Ok(()));
    }

    #[tokio::test]
    async fn a_release_waits_for_every_earlier_message_acknowledged_in_any_order() {
        let acks = Acks::start(7, 8);
        let seqs: Vec<u64> = [
            acks.window.ticket().await,
            acks.window.ticket().await,
            acks.window.ticket().await,
        ]
        .into_iter()
        .map(|t| t.expect("room"))
        .collect();
        assert_eq!(seqs, [0, 1, 2]);
        acks.release(100).expect("release");
        // A later message does not hold back the earlier release.
        let late = acks.window.ticket().await.expect("room");
        acks.release(200).expect("release");
        ok(&acks, 2);
        ok(&acks, 0);
        assert_eq!(
            *acks.confirmed().borrow(),
            7,
            "message 1 is not acknowledged yet"
        );
        ok(&acks, 1);
        assert_eq!(*acks.confirmed().borrow(), 100);
        ok(&acks, late);
        assert_eq!(*acks.confirmed().borrow(), 200);
    }

    #[tokio::test]
    async fn the_watermark_never_moves_back_and_an_empty_release_is_immediate() {
        let acks = Acks::start(0, 4);
        acks.release(50).expect("release");
        assert_eq!(*acks.confirmed().borrow(), 50);
        acks.release(40).expect("release");
        assert_eq!(*acks.confirmed().borrow(), 50);
        // Releases at one mark coalesce to the highest.
        let t = acks.window.ticket().await.expect("room");
        acks.release(90).expect("release");
        acks.release(80).expect("release");
        assert_eq!(acks.window.lock().releases.len(), 1);
        ok(&acks, t);
        assert_eq!(*acks.confirmed().borrow(), 90);
        assert_eq!(acks.drain(90).await, Ok(90));
    }

    #[tokio::test]
    async fn a_failed_delivery_stops_every_later_release() {
        let acks = Acks::start(0, 4);
        let first = acks.window.ticket().await.expect("room");
        acks.release(10).expect("release");
        let second = acks.window.ticket().await.expect("room");
        acks.release(20).expect("release");
        acks.window.complete(first, Err(KafkaError::Canceled));
        ok(&acks, second);
        assert_eq!(*acks.confirmed().borrow(), 0);
        let failure = acks.failed().borrow().clone().expect("a failure");
        assert!(failure.contains("Kafka delivery failed"), "{failure}");
        assert!(acks.release(30).is_err());
        assert!(acks.window.ticket().await.is_err());
        assert!(acks.drain(30).await.is_err());
    }

    #[tokio::test]
    async fn a_full_window_holds_senders_until_a_message_is_acknowledged() {
        let acks = Arc::new(Acks::start(0, 2));
        let a = acks.window.ticket().await.expect("room");
        let _b = acks.window.ticket().await.expect("room");
        let waiter = {
            let acks = acks.clone();
            tokio::spawn(async move { acks.window.ticket().await })
        };
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "the window is full");
        ok(&acks, a);
        let c = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .expect("task")
            .expect("room");
        assert_eq!(c, 2);
    }

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
