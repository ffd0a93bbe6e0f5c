//! `pgcdc run`: from the WAL to Avro changelog topics, with nothing lost.
//!
//! Guarantees:
//! - **At least once, no loss.** The LSN confirmed to Postgres is the end
//!   LSN of the newest transaction whose events Kafka has all acknowledged
//!   (idempotent producer, `acks=all`), and it only moves forward. After any
//!   crash the slot replays from there, and replayed events carry the same
//!   positions.
//! - **Bounded memory.** Events stream through; no transaction is buffered.
//!   At most [`MAX_IN_FLIGHT`] messages await acknowledgement; beyond that
//!   reading from the slot pauses, while standby status updates keep
//!   flowing.
//! - **Quarantine, not stop, for the data's faults.** A value the encoder
//!   cannot take or an event over `kafka.max_message_bytes` goes to the
//!   dead-letter topic with its position and LSN (split into parts when
//!   large); its acknowledgement gates the confirmed LSN like an event's.
//! - **Schema first.** A new table shape is registered with the registry
//!   before any event with it is produced; a refused schema stops the
//!   connector with the table named, and nothing is produced with it.
//!
//! ```text
//!  slot (exported snapshot) ──► COPY per table ──► op=r ─┐
//!  START_REPLICATION ──► pgoutput ──► relation cache ────┼─► encode ──► produce ──► Acks ──► confirmed LSN
//!                                                        │                                     │
//!                         standby status updates ◄───────┴─────────────────────────────────────┘
//! ```

mod exclude;
pub mod incremental;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pgwire_replication::{Lsn as WireLsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use tokio_postgres::Client;

use crate::config::{split_table, Config, SnapshotMode};
use crate::dlq::record::Quarantine;
use crate::dlq::{classify, Class, Fault, Verdict};
use crate::encode::binary;
use crate::encode::types::{Input, SESSION_SETTINGS};
use crate::encode::{
    ColumnDesc, EncodeError, Op, Position, SourceInfo, TableCodec, TableDesc, TransactionCodec,
};
use crate::observe;
use crate::offsets::{self, Offset};
use crate::partitioning::{self, Partitioner, Placement};
use crate::registry::client::{ClientError, RegistryClient};
use crate::sink::{self, Acks};
use crate::snapshot_marker::{self, Marker, Phase};
use crate::source::pgoutput::{self, Datum, Lsn, Message, OldTuple};
use crate::source::{self, catalog, slot};

/// Messages awaiting Kafka's acknowledgement before reading pauses.
pub const MAX_IN_FLIGHT: usize = 100_000;
/// How long a restart waits for a crashed predecessor's session to end.
const SLOT_RELEASE_WAIT: Duration = Duration::from_secs(60);
/// How often confirmed progress is reported to Postgres.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("config: {0}")]
    Config(String),
    #[error("postgres: {}", source::error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("replication: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),
    #[error("{0}")]
    Slot(#[from] slot::SlotError),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("kafka: {0}")]
    Delivery(String),
    #[error("registry: {0}")]
    Registry(#[from] ClientError),
    #[error("{table} at LSN {lsn}: {source}")]
    Encode {
        table: String,
        lsn: Lsn,
        #[source]
        source: EncodeError,
    },
    #[error("pgoutput at LSN {lsn}: {source}")]
    Decode {
        lsn: Lsn,
        #[source]
        source: pgoutput::DecodeError,
    },
    #[error("a change at LSN {lsn} names relation {oid}, which no Relation message described")]
    UnknownRelation { lsn: Lsn, oid: u32 },
    #[error("snapshot of {table}: {message}")]
    Snapshot { table: String, message: String },
    #[error("gave up after an outage of {lasted_secs} s (source.give_up_after_secs = {limit_secs}); the last error: {last}")]
    GaveUp {
        lasted_secs: u64,
        limit_secs: u64,
        last: Box<RunError>,
    },
}

impl From<sink::SendError> for RunError {
    fn from(e: sink::SendError) -> RunError {
        match e {
            sink::SendError::Kafka(e) => RunError::Kafka(e),
            sink::SendError::Delivery(e) => RunError::Delivery(e),
        }
    }
}

/// `<prefix>.transaction`: BEGIN and END records of every transaction that
/// changed a captured table.
pub fn transaction_topic(config: &Config) -> String {
    format!("{}.transaction", config.kafka.topic_prefix)
}

/// Session options (`-c name=value ...`) under which values are decoded.
fn session_options() -> String {
    SESSION_SETTINGS
        .iter()
        .map(|(k, v)| format!("-c {k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The replication connection's settings (`pgcdc check` opens one too).
pub(crate) fn replication_config(config: &Config) -> Result<ReplicationConfig, RunError> {
    let endpoint = source::tls::Endpoint::parse(&config.source.url)
        .map_err(|e| RunError::Config(format!("source.url: {e}")))?;
    let pg = endpoint.pg;
    let host = match pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_string(),
    };
    let tls = endpoint
        .tls
        .replication(&host)
        .map_err(|e| RunError::Config(format!("source.url: {e}")))?;
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let password = pg
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let user = pg.get_user().unwrap_or("postgres").to_string();
    let database = pg.get_dbname().unwrap_or(&user).to_string();
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        config.source.slot.clone(),
        config.source.publication.clone(),
    )
    .with_port(port)
    .with_tls(tls)
    .with_options(session_options())
    .with_status_interval(STATUS_INTERVAL))
}

/// A SQL session with the settings the decoder expects.
async fn sql_session(config: &Config) -> Result<Client, RunError> {
    let client = source::connect(&config.source.url).await?;
    let settings: String = SESSION_SETTINGS
        .iter()
        .map(|(k, v)| format!("SET {k} = '{v}';"))
        .collect();
    client.batch_execute(&settings).await?;
    Ok(client)
}

/// Shared by the snapshot workers and the stream.
#[derive(Clone)]
struct Output {
    config: Arc<Config>,
    transactions: Arc<TransactionCodec>,
    registry: RegistryClient,
    producer: sink::Producer,
    acks: Arc<Acks>,
    db: Arc<str>,
    /// Domain-event topics known to exist (outbox routing).
    domain_topics: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// Hot keys and salting; kept across restarts.
    partitioning: Arc<Partitioner>,
    /// Partition counts of the salting tables' topics, read at start-up.
    partitions: Arc<BTreeMap<String, i32>>,
    /// The initial snapshot's rows go here, untracked, when not exactly
    /// once; [`run_snapshot`] flushes it before releasing any position.
    bulk: Option<sink::BulkProducer>,
    /// Record bounds per topic, read at start-up ([`fit_to_topics`]).
    limits: Arc<sink::Limits>,
}

impl Output {
    /// Builds and registers the codec of a table shape.
    async fn codec(&self, desc: TableDesc) -> Result<TableCodec, RunError> {
        let topic = self.config.topic_for(&desc.qualified());
        let table = desc.qualified();
        let mut codec = TableCodec::new(&topic, desc).map_err(|source| RunError::Encode {
            table: table.clone(),
            lsn: Lsn(0),
            source,
        })?;
        // Routed to domain-event topics: no changelog subjects, but every
        // column the routing names must exist.
        if let Some(o) = self.config.outbox.get(&table) {
            codec.outbox = true;
            let named = [
                ("route_by", &o.route_by),
                ("key", &o.key),
                ("payload", &o.payload),
            ]
            .into_iter()
            .chain(o.order_by.as_ref().map(|c| ("order_by", c)))
            .map(|(f, c)| (f.to_string(), c))
            .chain(
                o.headers
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (format!("headers[{i}]"), c)),
            );
            for (field, column) in named {
                if !codec.desc.columns.iter().any(|c| &c.name == column) {
                    return Err(RunError::Config(format!(
                        "outbox.\"{table}\".{field}: {table} has no column {column}"
                    )));
                }
            }
            if snapshot_order(o, &codec.desc).is_none() {
                return Err(RunError::Config(format!(
                    "outbox.\"{table}\".order_by: is required, because the key of {table} is not one integer column (name the column that orders its events)"
                )));
            }
            return Ok(codec);
        }
        let key_id = self
            .registry
            .register(&format!("{topic}-key"), &codec.key_schema)
            .await?;
        let value_id = self
            .registry
            .register(&format!("{topic}-value"), &codec.value_schema)
            .await?;
        codec.set_ids(key_id, value_id);
        tracing::info!(%topic, key_id, value_id, "table schema registered");
        // Same schemas under the dedicated topic's subjects, so it decodes
        // and evolves like the table's own.
        if let Some(dedicated) = self.config.dedicated_topic(&table) {
            self.registry
                .register(&format!("{dedicated}-key"), &codec.key_schema)
                .await?;
            self.registry
                .register(&format!("{dedicated}-value"), &codec.value_schema)
                .await?;
        }
        self.partitioning
            .prepare(&codec, &self.partitions)
            .map_err(RunError::Config)?;
        Ok(codec)
    }

    /// Produces a BEGIN or END record on the transaction topic.
    async fn emit_transaction(&self, key: &[u8], value: &[u8]) -> Result<(), RunError> {
        let topic = transaction_topic(&self.config);
        self.acks
            .send(&self.producer, &topic, Some(key), Some(value), None)
            .await?;
        Ok(())
    }

    /// Produces one event (and its tombstone after a delete). A value the
    /// encoder cannot take, or an event over `kafka.max_message_bytes`, is
    /// quarantined in the dead-letter topic instead, with its position
    /// and LSN; its delivery gates the confirmed LSN like any event's.
    async fn emit(
        &self,
        codec: &TableCodec,
        op: Op,
        before: Option<&[Input<'_>]>,
        after: Option<&[Input<'_>]>,
        src: &SourceInfo<'_>,
    ) -> Result<(), RunError> {
        if let Some(bytes) = self
            .emit_uncounted(codec, op, before, after, src, None)
            .await?
        {
            codec.meters.event(op, bytes);
        }
        Ok(())
    }

    /// [`Output::emit`] without counting the event in the table's meters:
    /// returns its payload's size if it went to the changelog (not routed
    /// as an outbox record, not quarantined), for the caller to count.
    /// With `stage` and the bulk producer, the record is pushed there for
    /// [`Output::send_staged`] instead of produced.
    async fn emit_uncounted(
        &self,
        codec: &TableCodec,
        op: Op,
        before: Option<&[Input<'_>]>,
        after: Option<&[Input<'_>]>,
        src: &SourceInfo<'_>,
        stage: Option<&mut Vec<Staged>>,
    ) -> Result<Option<usize>, RunError> {
        let table = &codec.table;
        if codec.outbox {
            if let Some(outbox) = self.config.outbox.get(table) {
                self.route(codec, outbox, op, after, src).await?;
                return Ok(None);
            }
        }
        let topic = &codec.topic;
        let encode_err = |source| RunError::Encode {
            table: table.clone(),
            lsn: Lsn(src.lsn),
            source,
        };
        let key_image = after.or(before);
        let encoded = (|| {
            let key = match key_image {
                Some(row) if codec.has_key() => Some(codec.encode_key(row)?),
                _ => None,
            };
            Ok::<_, EncodeError>((key, codec.encode_value(op, before, after, src)?))
        })();
        let (key, value) = match encoded {
            Ok(kv) => kv,
            // A value: the data's fault, so it is quarantined.
            Err(e @ EncodeError::Column { .. }) => {
                let class = match classify(&Fault::Encode) {
                    Verdict::Quarantine(c) => c,
                    _ => return Err(encode_err(e)),
                };
                let payload = unencodable_payload(codec, op, before, after, src);
                self.quarantine(
                    topic,
                    op,
                    Rejected {
                        class,
                        error: &e.to_string(),
                        key: None,
                        value: &payload,
                    },
                    src,
                    &[],
                )
                .await?;
                return Ok(None);
            }
            Err(e) => return Err(encode_err(e)),
        };
        let size = value.len() + key.as_ref().map_or(0, Vec::len);
        let limit = self.limits.of(topic);
        if size > limit {
            if let Verdict::Quarantine(class) = classify(&Fault::TooLarge) {
                let error = format!("{size} bytes, over {}", self.limit_text(topic));
                self.quarantine(
                    topic,
                    op,
                    Rejected {
                        class,
                        error: &error,
                        key: key.as_deref(),
                        value: &value,
                    },
                    src,
                    &[],
                )
                .await?;
                return Ok(None);
            }
        }
        // The new image's tenant, else the old one's (a tenant left
        // unchanged as TOAST is only in the old image, if anywhere).
        let tenant = [after, before]
            .into_iter()
            .flatten()
            .find_map(|row| self.partitioning.tenant(table, row));
        let placement = match (&key, key_image) {
            (Some(k), Some(row)) => {
                self.partitioning
                    .place(codec, k, row, tenant, op, src.position)
            }
            _ => Placement::default(),
        };
        let mut headers = None;
        for (name, value) in [
            (
                partitioning::SHARD_HEADER,
                placement.shard.map(|s| s.to_string().into_bytes()),
            ),
            (partitioning::TENANT_HEADER, tenant.map(<[u8]>::to_vec)),
        ] {
            if let Some(value) = value {
                let h: rdkafka::message::OwnedHeaders = headers.unwrap_or_default();
                headers = Some(h.insert(rdkafka::message::Header {
                    key: name,
                    value: Some(&value),
                }));
            }
        }
        let size = value.len();
        if let (Some(_), Some(stage)) = (&self.bulk, stage) {
            stage.push(Staged {
                topic: placement.topic,
                partition: placement.partition,
                key,
                value,
                headers,
            });
            return Ok(Some(size));
        }
        let topic = placement.topic.as_deref().unwrap_or(topic);
        match &self.bulk {
            Some(bulk) => {
                bulk.send(
                    topic,
                    placement.partition,
                    key.as_deref(),
                    Some(&value),
                    headers,
                )
                .await?
            }
            None => {
                self.acks
                    .send_to(
                        &self.producer,
                        topic,
                        placement.partition,
                        key.as_deref(),
                        Some(&value),
                        headers,
                    )
                    .await?
            }
        }
        if op == Op::Delete && key.is_some() {
            if placement.tombstones.is_empty() {
                self.acks
                    .send(&self.producer, topic, key.as_deref(), None, None)
                    .await?;
            }
            // Every shard's partition, so none keeps an older value.
            for p in placement.tombstones {
                self.acks
                    .send_to(&self.producer, topic, Some(p), key.as_deref(), None, None)
                    .await?;
            }
        }
        Ok(Some(size))
    }

    /// Hands staged snapshot records to the bulk producer, in order.
    async fn send_staged(
        &self,
        codec: &TableCodec,
        stage: &mut Vec<Staged>,
    ) -> Result<(), RunError> {
        let Some(bulk) = &self.bulk else {
            return Ok(());
        };
        by_partition(stage, &codec.topic, |topic| bulk.partition_count(topic));
        for r in stage.drain(..) {
            let topic = r.topic.as_deref().unwrap_or(&codec.topic);
            bulk.send(
                topic,
                r.partition,
                r.key.as_deref(),
                Some(&r.value),
                r.headers,
            )
            .await?;
        }
        Ok(())
    }

    /// Routes a row of an outbox table to its domain-event topic: key =
    /// the stream id, value = the payload, listed columns as headers, plus
    /// `pgcdc.position` and `pgcdc.lsn`. Only inserts and snapshot rows
    /// are events. A row that cannot be routed (NULL key or route, a route
    /// that makes no topic name, too large) is quarantined like any change.
    async fn route(
        &self,
        codec: &TableCodec,
        outbox: &crate::config::OutboxConfig,
        op: Op,
        after: Option<&[Input<'_>]>,
        src: &SourceInfo<'_>,
    ) -> Result<(), RunError> {
        let table = codec.desc.qualified();
        let row = match (op, after) {
            (Op::Create | Op::Read, Some(row)) => row,
            _ => {
                metrics::counter!(observe::OUTBOX_SKIPPED, "table" => table.clone(), "op" => op.code())
                    .increment(1);
                tracing::debug!(%table, op = op.code(), "outbox: not an insert, skipped");
                return Ok(());
            }
        };
        let column = |name: &str| {
            codec
                .desc
                .columns
                .iter()
                .position(|c| c.name == name)
                .map(|i| row.get(i).copied().unwrap_or(Input::Null))
                .ok_or_else(|| {
                    RunError::Config(format!(
                        "outbox.\"{table}\": the table has no column {name}"
                    ))
                })
        };
        let text = |input: Input<'_>| match input {
            Input::Text(t) => Some(t.to_vec()),
            _ => None,
        };
        let key = text(column(&outbox.key)?);
        let value = text(column(&outbox.payload)?);
        let route = text(column(&outbox.route_by)?);
        let mut pairs: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        for h in &outbox.headers {
            pairs.push((h.clone(), text(column(h)?)));
        }
        let position = format!("{}:{}", src.position.commit_lsn, src.position.seq);
        pairs.push(("pgcdc.position".into(), Some(position.into_bytes())));
        pairs.push((
            "pgcdc.lsn".into(),
            Some(Lsn(src.lsn).to_string().into_bytes()),
        ));
        let routed = match (&key, &value, &route) {
            (None, _, _) => Err((
                Fault::Encode,
                format!("the key column {} is NULL", outbox.key),
            )),
            (_, _, None) => Err((
                Fault::Encode,
                format!("the route column {} is NULL", outbox.route_by),
            )),
            (Some(k), v, Some(r)) => {
                let header_bytes: usize = pairs
                    .iter()
                    .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len))
                    .sum();
                let size = k.len() + v.as_ref().map_or(0, Vec::len) + header_bytes;
                match outbox.topic_for(&self.config.kafka.topic_prefix, &String::from_utf8_lossy(r))
                {
                    Err(e) => Err((Fault::Encode, e)),
                    Ok(t) if self.reserved_topic(&t) => Err((
                        Fault::Encode,
                        format!(
                            "the {} value routes to {t}, a topic of pgcdc's own",
                            outbox.route_by
                        ),
                    )),
                    Ok(t) if size > self.limits.of(&t) => Err((
                        Fault::TooLarge,
                        format!("{size} bytes, over {}", self.limit_text(&t)),
                    )),
                    Ok(t) => Ok(t),
                }
            }
        };
        let topic = match routed {
            Ok(t) => t,
            Err((fault, error)) => {
                let Verdict::Quarantine(class) = classify(&fault) else {
                    return Err(RunError::Config(format!("outbox.\"{table}\": {error}")));
                };
                // The event's headers travel along as pgcdc.event.*, so
                // that nothing of it is lost.
                let event: Vec<(String, Option<Vec<u8>>)> = pairs
                    .into_iter()
                    .filter(|(k, _)| !k.starts_with("pgcdc."))
                    .map(|(k, v)| (format!("pgcdc.event.{k}"), v))
                    .collect();
                let origin = self.config.topic_for(&table);
                return self
                    .quarantine(
                        &origin,
                        op,
                        Rejected {
                            class,
                            error: &error,
                            key: key.as_deref(),
                            value: value.as_deref().unwrap_or_default(),
                        },
                        src,
                        &event,
                    )
                    .await;
            }
        };
        let headers = pairs
            .iter()
            .fold(rdkafka::message::OwnedHeaders::new(), |h, (k, v)| {
                h.insert(rdkafka::message::Header {
                    key: k,
                    value: v.as_deref(),
                })
            });
        self.ensure_domain_topic(&topic).await?;
        metrics::counter!(observe::OUTBOX_EVENTS, "table" => table.clone(), "topic" => topic.clone())
            .increment(1);
        self.acks
            .send(
                &self.producer,
                &topic,
                key.as_deref(),
                value.as_deref(),
                Some(headers),
            )
            .await?;
        Ok(())
    }

    /// The bound on records to `topic`, in words.
    fn limit_text(&self, topic: &str) -> String {
        let limit = self.limits.of(topic);
        if limit < self.limits.default {
            format!("{limit}, the bound of topic {topic} (its max.message.bytes less framing)")
        } else {
            format!("kafka.max_message_bytes ({limit})")
        }
    }

    /// A topic no route may write to: a changelog, the transaction, dead-
    /// letter, snapshot-marker or offsets topic. A topic already routed to
    /// passed this check when it was created.
    fn reserved_topic(&self, topic: &str) -> bool {
        if self.known_domain_topic(topic) {
            return false;
        }
        let c = &self.config;
        c.source.tables.iter().any(|t| c.topic_for(t) == topic)
            || topic == transaction_topic(c)
            || topic == crate::materialize::dlq_topic(c)
            || topic == snapshot_marker::topic(c)
            || topic == offsets::topic(c)
    }

    fn known_domain_topic(&self, topic: &str) -> bool {
        self.domain_topics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(topic)
    }

    /// Creates a domain-event topic the first time it is routed to.
    async fn ensure_domain_topic(&self, topic: &str) -> Result<(), RunError> {
        if self.known_domain_topic(topic) {
            return Ok(());
        }
        sink::ensure_event_topics(&self.config.kafka, &[topic.to_string()]).await?;
        self.domain_topics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic.to_string());
        Ok(())
    }

    /// Writes a change that cannot go to its topic to the dead-letter
    /// topic (in parts when it is too large for one record), with `event`
    /// as extra headers.
    async fn quarantine(
        &self,
        topic: &str,
        op: Op,
        rejected: Rejected<'_>,
        src: &SourceInfo<'_>,
        event: &[(String, Option<Vec<u8>>)],
    ) -> Result<(), RunError> {
        let Rejected {
            class,
            error,
            key,
            value,
        } = rejected;
        let now = now_ms();
        let q = Quarantine {
            class: class.as_str(),
            error,
            origin_topic: topic,
            origin: None,
            position: Some((src.position.commit_lsn as i64, src.position.seq as i64)),
            lsn: Some(src.lsn),
            op: Some(op.code()),
            attempts: 1,
            first_failure_ms: now,
            last_failure_ms: now,
            replay_of: None,
        };
        tracing::error!(%topic, lsn = %Lsn(src.lsn), class = class.as_str(), %error,
            "change quarantined in the dead-letter topic (pgcdc dlq list)");
        metrics::counter!(observe::CONNECTOR_QUARANTINED, "class" => class.as_str()).increment(1);
        let dlq = crate::materialize::dlq_topic(&self.config);
        // Created when first needed (quarantines are rare).
        sink::ensure_dlq_topic(&self.config.kafka, &dlq).await?;
        let origin = format!(
            "{topic}@{}:{}:{}",
            src.position.commit_lsn,
            src.position.seq,
            op.code()
        );
        let records = q.records(
            value,
            key.map_or(0, <[u8]>::len),
            self.limits.of(&dlq),
            &origin,
        );
        for (headers, part) in records {
            let headers = event.iter().fold(headers, |h, (k, v)| {
                h.insert(rdkafka::message::Header {
                    key: k,
                    value: v.as_deref(),
                })
            });
            self.acks
                .send(&self.producer, &dlq, key, Some(part), Some(headers))
                .await?;
        }
        Ok(())
    }
}

/// The table's one integer key column (an identity or a sequence), if
/// its key is exactly that.
fn integer_key(desc: &TableDesc) -> Option<&ColumnDesc> {
    let keys: Vec<&ColumnDesc> = desc.columns.iter().filter(|c| c.key).collect();
    match keys.as_slice() {
        [key] if matches!(key.type_oid, 20 | 21 | 23) => Some(key),
        _ => None,
    }
}

/// The column that orders an outbox table's snapshot in insertion order:
/// `order_by`, else an integer key; `None` when neither (a uuid key does
/// not follow insertion order).
fn snapshot_order<'a>(
    outbox: &'a crate::config::OutboxConfig,
    desc: &'a TableDesc,
) -> Option<&'a str> {
    outbox
        .order_by
        .as_deref()
        .or_else(|| integer_key(desc).map(|k| k.name.as_str()))
}

/// A change refused from its topic: why, and its bytes.
struct Rejected<'a> {
    class: Class,
    error: &'a str,
    key: Option<&'a [u8]>,
    value: &'a [u8],
}

/// What the connector keeps of a change it cannot encode: the row images
/// as Postgres text, as JSON (`unchanged` lists unchanged TOAST columns).
fn unencodable_payload(
    codec: &TableCodec,
    op: Op,
    before: Option<&[Input<'_>]>,
    after: Option<&[Input<'_>]>,
    src: &SourceInfo<'_>,
) -> Vec<u8> {
    let image = |row: Option<&[Input<'_>]>| {
        row.map(|row| {
            let mut values = serde_json::Map::new();
            let mut unchanged = Vec::new();
            for (c, v) in codec.desc.columns.iter().zip(row) {
                match v {
                    Input::Null => {
                        values.insert(c.name.clone(), serde_json::Value::Null);
                    }
                    Input::Unchanged => unchanged.push(c.name.clone()),
                    Input::Text(_) | Input::Binary(_) => {
                        let text = v.text(&c.kind()).unwrap_or_default();
                        values.insert(
                            c.name.clone(),
                            String::from_utf8_lossy(&text).into_owned().into(),
                        );
                    }
                }
            }
            serde_json::json!({"values": values, "unchanged": unchanged})
        })
    };
    serde_json::json!({
        "table": codec.desc.qualified(),
        "op": op.code(),
        "commit_lsn": src.position.commit_lsn,
        "seq": src.position.seq,
        "lsn": Lsn(src.lsn).to_string(),
        "before": image(before),
        "after": image(after),
    })
    .to_string()
    .into_bytes()
}

fn inputs(values: &[Datum]) -> Vec<Input<'_>> {
    values
        .iter()
        .map(|d| match d {
            Datum::Null => Input::Null,
            Datum::UnchangedToast => Input::Unchanged,
            Datum::Text(b) | Datum::Binary(b) => Input::Text(b),
        })
        .collect()
}

/// A COPY row's fields as encoder inputs (`None` is SQL NULL).
fn copy_inputs(fields: &[Option<Vec<u8>>]) -> Vec<Input<'_>> {
    fields
        .iter()
        .map(|f| match f {
            None => Input::Null,
            Some(v) => Input::Text(v),
        })
        .collect()
}

/// The table's columns, quoted, for a SELECT or COPY list.
fn column_list(desc: &TableDesc) -> String {
    desc.columns
        .iter()
        .map(|c| slot::quote_ident(&c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn now_ms() -> i64 {
    observe::now_us() / 1000
}

/// Microseconds since 2000-01-01 (Postgres epoch) to milliseconds since 1970.
fn pg_time_to_ms(micros: i64) -> i64 {
    micros / 1000 + 946_684_800_000
}

/// Postgres time (µs since 2000-01-01) as Unix µs.
fn pg_time_to_us(micros: i64) -> i64 {
    micros + 946_684_800_000_000
}

/// Runs the connector until SIGINT/SIGTERM or an error.
impl RunError {
    /// What the connector does with this error: retry after a backoff (an
    /// outage of Postgres, the broker or the registry) or stop. Decided by
    /// [`classify`].
    pub fn verdict(&self) -> Verdict {
        use pgwire_replication::PgWireError as W;
        let fault = match self {
            RunError::Postgres(e) | RunError::Slot(slot::SlotError::Postgres(e))
                if source::tls::refused(e) =>
            {
                Fault::Untrusted
            }
            RunError::Replication(W::Tls(text)) if source::tls::refused_text(text) => {
                Fault::Untrusted
            }
            RunError::Replication(W::Tls(_)) => Fault::Source { sqlstate: None },
            RunError::Postgres(e) | RunError::Slot(slot::SlotError::Postgres(e)) => Fault::Source {
                sqlstate: e.code().map(|c| c.code()),
            },
            RunError::Replication(W::Io(_) | W::Task(_)) => Fault::Source { sqlstate: None },
            RunError::Replication(W::Server(text)) => Fault::Source {
                sqlstate: sqlstate_in(text),
            },
            RunError::Kafka(e) => Fault::Broker {
                refused: sink::refused(e),
            },
            RunError::Delivery(_) => Fault::Broker { refused: false },
            RunError::Registry(e) => Fault::Register { status: e.status() },
            _ => return Verdict::Stop,
        };
        classify(&fault)
    }
}

/// The SQLSTATE in a server error's text (`... (SQLSTATE 57P01)`).
fn sqlstate_in(text: &str) -> Option<&str> {
    let (_, rest) = text.rsplit_once("(SQLSTATE ")?;
    rest.strip_suffix(')').filter(|c| c.len() == 5)
}

/// First wait after a failed attempt; it doubles up to [`RESTART_MAX_BACKOFF`].
const RESTART_BACKOFF: Duration = Duration::from_secs(1);
const RESTART_MAX_BACKOFF: Duration = Duration::from_secs(30);
/// An attempt that ran this long was healthy: the next failure starts the
/// backoff again from [`RESTART_BACKOFF`], and a new outage.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// A restart loop's memory of the current outage: the next backoff, and
/// when its first attempt failed (for `source.give_up_after_secs`, and
/// the materializer's `target.give_up_after_secs`).
#[derive(Debug)]
pub(crate) struct Outage {
    limit: Option<Duration>,
    first: Duration,
    max: Duration,
    backoff: Duration,
    since: Option<Instant>,
}

/// What a restart loop does after a failed attempt.
#[derive(Debug, PartialEq)]
pub(crate) enum Next {
    /// Wait this long, then attempt again.
    Wait(Duration),
    /// The outage has lasted this long, past the limit: stop.
    GiveUp(Duration),
}

impl Outage {
    /// The connector's: `limit_secs` 0 never gives up.
    fn new(limit_secs: u64) -> Outage {
        Outage::with_backoff(limit_secs, RESTART_BACKOFF, RESTART_MAX_BACKOFF)
    }

    /// Waits `first` after the first failure, doubling up to `max`.
    pub(crate) fn with_backoff(limit_secs: u64, first: Duration, max: Duration) -> Outage {
        Outage {
            limit: (limit_secs > 0).then(|| Duration::from_secs(limit_secs)),
            first,
            max,
            backoff: first,
            since: None,
        }
    }

    /// An attempt started at `started` failed at `now`. The last wait is
    /// cut short so that one attempt falls at the limit itself.
    pub(crate) fn failed(&mut self, started: Instant, now: Instant) -> Next {
        if now.duration_since(started) >= HEALTHY_RUN {
            self.backoff = self.first;
            self.since = None;
        }
        let lasted = now.duration_since(*self.since.get_or_insert(now));
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(self.max);
        match self.limit {
            Some(limit) if lasted >= limit => Next::GiveUp(lasted),
            Some(limit) => Next::Wait(wait.min(limit - lasted)),
            None => Next::Wait(wait),
        }
    }
}

/// Runs the connector until shutdown. An outage of Postgres, the broker or
/// the registry ([`RunError::verdict`]) restarts it after a backoff, from
/// the slot's confirmed LSN, so nothing is lost and nothing is skipped,
/// until `source.give_up_after_secs` (if set) runs out; any other error
/// stops it.
///
/// ```text
///  attempt ──► error ──► classify ──► Retry: warn, back off (1 s doubling to 30 s), attempt again
///                                 │          └─► the outage outlasted give_up_after_secs: return GaveUp
///                                 └─► Stop: return the error
/// ```
pub async fn run(config: Config) -> Result<(), RunError> {
    let config = Arc::new(config);
    let mut shutdown =
        crate::Shutdown::install().map_err(|e| RunError::Config(format!("signals: {e}")))?;
    let mut outage = Outage::new(config.source.give_up_after_secs);
    // The slot watch outlives each attempt: a crash loop is a stall too,
    // and its timer must not start again with every attempt.
    let confirmed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watch = tokio::spawn(watch_slot(config.clone(), confirmed.clone()));
    let _stop_watch = AbortOnDrop(watch);
    let partitioner = Arc::new(Partitioner::new(&config));
    let publish = {
        let p = partitioner.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                p.publish();
            }
        })
    };
    let _stop_publish = AbortOnDrop(publish);
    loop {
        let started = Instant::now();
        let run = run_once(config.clone(), &mut shutdown, &confirmed, &partitioner);
        let error = match run.await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let Verdict::Retry(cause) = error.verdict() else {
            return Err(error);
        };
        metrics::counter!(observe::CONNECTOR_RESTARTS, "cause" => cause).increment(1);
        let backoff = match outage.failed(started, Instant::now()) {
            Next::Wait(d) => d,
            Next::GiveUp(lasted) => {
                return Err(RunError::GaveUp {
                    lasted_secs: lasted.as_secs(),
                    limit_secs: config.source.give_up_after_secs,
                    last: Box::new(error),
                })
            }
        };
        tracing::warn!(%error, cause, retry_in_ms = backoff.as_millis() as u64, "a service the connector needs failed or cannot be reached; restarting from the slot's confirmed LSN");
        observe::board::set_phase(observe::board::Phase::Restarting);
        tokio::select! {
            _ = shutdown.requested() => return Ok(()),
            _ = tokio::time::sleep(backoff) => {}
        }
    }
}

/// Aborts a task when dropped.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Checks the slot every heartbeat interval (at least every 10 s) on a
/// connection of its own, so that neither a stream blocked on Kafka's
/// backpressure nor a restart pauses the alerts. `confirmed` is the LSN
/// the connector last confirmed (0 before the first).
async fn watch_slot(config: Arc<Config>, confirmed: Arc<std::sync::atomic::AtomicU64>) {
    let src = &config.source;
    let every = Duration::from_secs(src.heartbeat_interval_secs.clamp(1, 10));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stall = Stall::new(
        Duration::from_secs(src.stall_warning_secs),
        src.retained_wal_warning_bytes,
    );
    let mut sql: Option<Client> = None;
    loop {
        tick.tick().await;
        if sql.as_ref().is_none_or(Client::is_closed) {
            // An outage is the stream's to report; try again next tick.
            sql = sql_session(&config).await.ok();
        }
        if let Some(c) = &sql {
            let lsn = confirmed.load(std::sync::atomic::Ordering::Acquire);
            stall.check(c, &src.slot, lsn).await;
        }
    }
}

async fn run_once(
    config: Arc<Config>,
    shutdown: &mut crate::Shutdown,
    progress: &std::sync::atomic::AtomicU64,
    partitioner: &Arc<Partitioner>,
) -> Result<(), RunError> {
    observe::board::set_phase(observe::board::Phase::Starting);
    // Nothing start-up wrote is confirmed yet, so a stop there needs no
    // drain: an interrupted snapshot is taken again at the next start (its
    // marker still says `started`), and an open Kafka transaction is fenced
    // by the next producer of the same transactional id.
    let Ready {
        sql,
        output,
        mut repl,
        relations,
        snapshots,
        resume_commit,
    } = tokio::select! {
        biased;
        _ = shutdown.requested() => {
            tracing::info!("stopped before streaming began; nothing was confirmed");
            return Ok(());
        }
        ready = prepare(config.clone(), partitioner.clone()) => ready?,
    };
    let last = stream(
        &output,
        &mut repl,
        &sql,
        relations,
        snapshots,
        resume_commit,
        shutdown,
        progress,
    )
    .await;
    let last = match last {
        Ok(l) => l,
        Err(e) => {
            repl.abort();
            // Readers must not wait for the broker's transaction timeout.
            let _ = output.producer.abort().await;
            return Err(e);
        }
    };
    // Drain what is in flight, then make the final position durable.
    let Output { acks, producer, .. } = output;
    let acks = Arc::try_unwrap(acks).map_err(|_| RunError::Delivery("acks still shared".into()))?;
    let confirmed = acks.drain(last).await.map_err(RunError::Delivery)?;
    // Exactly once, stopped inside a source transaction: its part in Kafka
    // is aborted (after delivery, so nothing is purged) and the slot
    // replays the whole transaction.
    producer.abort().await?;
    repl.update_applied_lsn(WireLsn(confirmed));
    let _ = repl.shutdown().await;
    advance_slot(&sql, &config.source.slot, confirmed).await;
    tracing::info!(confirmed = %Lsn(confirmed), "stopped");
    Ok(())
}

/// What streaming starts from.
struct Ready {
    sql: Client,
    output: Output,
    repl: ReplicationClient,
    relations: Relations,
    snapshots: incremental::Engine,
    /// Transactions committed at or before it are in Kafka already.
    resume_commit: u64,
}

/// Every `partitioning.<table>.tenant_column` exists, and a delete will
/// carry it (see [`source::catalog::tenant_column_problem`]). Checked
/// before the snapshot, so a mistake stops the connector before it has
/// produced anything.
async fn check_tenant_columns(sql: &Client, config: &Config) -> Result<(), RunError> {
    for (table, column) in config.tenant_columns() {
        if let Some(problem) = source::catalog::tenant_column_problem(sql, table, column).await? {
            return Err(RunError::Config(problem));
        }
    }
    Ok(())
}

/// The record bounds of the topics the connector writes (each table's
/// topics, the transaction and dead-letter topics): a topic whose
/// `max.message.bytes` is under `kafka.max_message_bytes` plus
/// [`sink::RECORD_FRAMING`] gets a lower bound, so that an event over it
/// is quarantined as oversized instead of refused by the broker; and
/// `config` with librdkafka's `batch.size` (unless set) under the
/// smallest `max.message.bytes` of them all, so that no batch is refused
/// either. A table's bound is the smallest of its topics'. Limits the
/// broker does not give are warned about and left as they are.
async fn fit_to_topics(
    config: Arc<Config>,
    changelog: &[String],
) -> Result<(Arc<Config>, sink::Limits), RunError> {
    let mut topics = changelog.to_vec();
    topics.push(transaction_topic(&config));
    topics.push(crate::materialize::dlq_topic(&config));
    let default = config.kafka.max_message_bytes;
    let mut limits = sink::Limits {
        default,
        topics: Default::default(),
    };
    let read = match sink::message_limits(&config.kafka, &topics).await {
        Ok(read) => read,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the topics' max.message.bytes; keeping to kafka.max_message_bytes");
            return Ok((config, limits));
        }
    };
    for (topic, limit) in &read {
        let Some(fits) = sink::lowered_bound(default, *limit) else {
            continue;
        };
        if fits < crate::config::MIN_MESSAGE_BYTES {
            return Err(RunError::Config(format!(
                "topic {topic} takes records of at most {limit} bytes (max.message.bytes): too few for pgcdc, which needs {} (raise it)",
                crate::config::MIN_MESSAGE_BYTES + sink::RECORD_FRAMING
            )));
        }
        tracing::warn!(%topic, max_message_bytes = limit, effective = fits,
            "a topic takes smaller records than kafka.max_message_bytes: events over the effective size are quarantined as oversized, and batches kept under it");
        limits.topics.insert(topic.clone(), fits);
    }
    // A table's events go to any of its topics.
    for table in config.changelog_tables() {
        let of_table = config.topics_of(table);
        if let Some(least) = of_table.iter().map(|t| limits.of(t)).min() {
            if least < default {
                limits.topics.insert(config.topic_for(table), least);
            }
        }
    }
    // A batch holds records of any size: it must fit the smallest topic.
    let Some(room) = read
        .values()
        .map(|l| l.saturating_sub(sink::RECORD_FRAMING))
        .min()
        .filter(|room| *room < sink::batch_size(&config.kafka))
    else {
        return Ok((config, limits));
    };
    if config.kafka.properties.0.contains_key("batch.size") {
        tracing::warn!(batch_size = sink::batch_size(&config.kafka), room,
            "kafka.properties sets batch.size above a topic's max.message.bytes: the broker may refuse batches to it");
        return Ok((config, limits));
    }
    let mut fitted = (*config).clone();
    fitted
        .kafka
        .properties
        .0
        .insert("batch.size".into(), room.to_string());
    Ok((Arc::new(fitted), limits))
}

/// Start-up: publication, topics, the slot, the initial snapshot of a new
/// slot, then the replication stream started from the slot's position.
async fn prepare(config: Arc<Config>, partitioning: Arc<Partitioner>) -> Result<Ready, RunError> {
    let sql = source::connect(&config.source.url).await?;
    if let Some((partition, ancestor)) = catalog::listed_partitions(&sql, &config.source.tables)
        .await?
        .into_iter()
        .next()
    {
        return Err(RunError::Config(catalog::listed_partition_problem(
            &partition, &ancestor,
        )));
    }
    for (table, c) in &config.source.columns {
        if let Some(problem) = catalog::excluded_column_problem(&sql, table, &c.exclude).await? {
            return Err(RunError::Config(problem));
        }
    }
    slot::ensure_publication(&sql, &config).await?;
    // Before replication starts: a table renamed once streaming began must
    // still be known by its oid (`Relations::captured`).
    let captured = catalog::table_oids(&sql, &config.source.tables)
        .await?
        .map_err(RunError::Config)?;
    check_tenant_columns(&sql, &config).await?;
    let topics: Vec<String> = config
        .changelog_tables()
        .flat_map(|t| config.topics_of(t))
        .collect();
    sink::ensure_topics(&config.kafka, &topics).await?;
    let (config, limits) = fit_to_topics(config, &topics).await?;
    let partitions =
        sink::partition_counts(&config.kafka, &partitioning.counted_topics(&config)).await?;
    let db: String = sql
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);

    snapshot_marker::ensure_topic(&config).await?;
    let marker_topic = snapshot_marker::topic(&config);
    let exactly_once = config.kafka.exactly_once;
    if exactly_once {
        offsets::ensure_topic(&config).await?;
    }

    // Before reading markers and offsets: in exactly-once mode this fences
    // a crashed predecessor and aborts what it left open, which would
    // otherwise hold read_committed readers back.
    let transactional_id = exactly_once.then(|| offsets::transactional_id(&config));
    let producer = sink::Producer::create(&config.kafka, transactional_id.as_deref()).await?;

    let mut existing = slot::status(&sql, &config.source.slot).await?;
    if existing.as_ref().is_some_and(|s| s.active) {
        // After a crash the old session may hold the slot for a moment.
        existing = wait_until_inactive(&sql, &config.source.slot).await?;
    }
    if existing.is_some() && config.source.snapshot.mode == SnapshotMode::Always {
        tracing::info!(slot = %config.source.slot, "snapshot mode always: dropping the slot to take a new snapshot");
        slot::drop(&sql, &config.source.slot).await?;
        existing = None;
    }
    // Every marker, read once at start: the initial snapshot's state, and
    // incremental snapshots to resume.
    let markers = snapshot_marker::all(&config.kafka, &marker_topic)
        .await
        .map_err(RunError::Delivery)?;
    if existing.is_some() && config.source.snapshot.mode != SnapshotMode::Never {
        let marker = markers.iter().rfind(|m| m.key() == config.source.slot);
        if marker.is_some_and(|m| m.phase == Phase::Started) {
            tracing::warn!(slot = %config.source.slot, "the slot's snapshot was interrupted; dropping the slot and taking the snapshot again");
            slot::drop(&sql, &config.source.slot).await?;
            existing = None;
        }
    }
    if existing.is_none() {
        if let Some(e) = slot::SlotError::vanished(&config, &markers) {
            return Err(e.into());
        }
    }
    let initial_confirmed = match &existing {
        Some(_) => {
            let status = slot::verify_usable(&sql, &config).await?;
            status
                .confirmed_flush_lsn
                .as_deref()
                .and_then(|l| l.parse::<Lsn>().ok())
                .map_or(0, |l| l.0)
        }
        None => 0,
    };

    let registry = RegistryClient::new(&config.registry)?;
    let mut transactions = TransactionCodec::new().map_err(|source| RunError::Encode {
        table: transaction_topic(&config),
        lsn: Lsn(0),
        source,
    })?;
    let txn_topic = transaction_topic(&config);
    transactions.set_ids(
        registry
            .register(&format!("{txn_topic}-key"), &transactions.key_schema)
            .await?,
        registry
            .register(&format!("{txn_topic}-value"), &transactions.value_schema)
            .await?,
    );
    // What Kafka already holds of the transactions the slot will replay.
    let resume = match (&existing, exactly_once) {
        (Some(_), true) => {
            offsets::latest(&config.kafka, &offsets::topic(&config), &config.source.slot)
                .await
                .map_err(RunError::Delivery)?
        }
        _ => None,
    };
    if let Some(r) = &resume {
        tracing::info!(commit_lsn = %r.commit_lsn, "exactly-once: Kafka holds every transaction up to this commit LSN");
    }
    let output = Output {
        transactions: Arc::new(transactions),
        registry,
        producer,
        acks: Arc::new(Acks::start(initial_confirmed, MAX_IN_FLIGHT)),
        db: Arc::from(db.as_str()),
        config: config.clone(),
        domain_topics: Default::default(),
        partitioning,
        partitions: Arc::new(partitions),
        bulk: None,
        limits: Arc::new(limits),
    };

    let mut repl = ReplicationClient::connect_gated(replication_config(&config)?).await?;
    let mut codecs: HashMap<u32, TableCodec> = HashMap::new();
    if existing.is_none() {
        let snapshot = config.source.snapshot.mode != SnapshotMode::Never;
        let mut marker = Marker {
            slot: config.source.slot.clone(),
            phase: Phase::Started,
            kind: snapshot_marker::Kind::Initial,
            id: None,
            tables: Vec::new(),
            cursor: None,
            consistent_ts_ms: None,
            error: None,
            consistent_point: None,
            start_offsets: Default::default(),
            end_offsets: Default::default(),
            rows: Default::default(),
            chunks: Default::default(),
            ts_ms: now_ms(),
        };
        if snapshot {
            // Before the slot exists: a crash from here on leaves a slot
            // whose latest marker says its snapshot is unfinished.
            marker.start_offsets = snapshot_marker::end_offsets(&config.kafka, &topics)
                .await
                .map_err(RunError::Delivery)?;
            snapshot_marker::write(&output.producer, &config, &marker)
                .await
                .map_err(RunError::Delivery)?;
            output.producer.commit().await?;
        }
        let rows = repl
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT '{}')",
                slot::quote_ident(&config.source.slot),
                if snapshot { "export" } else { "nothing" }
            ))
            .await?;
        let field = |i: usize| {
            rows.first()
                .and_then(|r| r.get(i).cloned().flatten())
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        };
        let consistent_point: Lsn = field(1).and_then(|l| l.parse().ok()).ok_or_else(|| {
            RunError::Config("CREATE_REPLICATION_SLOT returned no consistent point".into())
        })?;
        tracing::info!(slot = %config.source.slot, %consistent_point, "slot created");
        // The snapshot's state is that of this moment: `pgcdc retention`
        // reports history since then.
        marker.consistent_ts_ms = Some(now_ms());
        if !snapshot {
            // No snapshot, but still a new slot: the history in Kafka
            // breaks here (what changed before it was never captured), and
            // `pgcdc retention` must know.
            marker.phase = Phase::Completed;
            marker.consistent_point = Some(consistent_point.to_string());
            snapshot_marker::write(&output.producer, &config, &marker)
                .await
                .map_err(RunError::Delivery)?;
        }
        if exactly_once && !snapshot {
            // A new slot: an offset record of an earlier slot of the same
            // name must not make this one skip anything.
            let offset = Offset::new(&config.source.slot, 0, consistent_point.0, now_ms());
            let f = offsets::write(&output.producer, &config, &offset)
                .await
                .map_err(RunError::Delivery)?;
            output.acks.delivery(f).await.map_err(RunError::Delivery)?;
            output.producer.commit().await?;
        }
        if snapshot {
            let name = field(2).ok_or_else(|| RunError::Config("no exported snapshot".into()))?;
            observe::board::set_phase(observe::board::Phase::Snapshot);
            let (snapshot_codecs, rows, chunks) =
                run_snapshot(&output, &name, consistent_point).await?;
            codecs = snapshot_codecs;
            marker.chunks = chunks;
            marker.phase = Phase::Completed;
            marker.consistent_point = Some(consistent_point.to_string());
            marker.rows = rows;
            marker.end_offsets = snapshot_marker::written_offsets(&config.kafka, &topics)
                .await
                .map_err(RunError::Delivery)?;
            marker.ts_ms = now_ms();
            snapshot_marker::write(&output.producer, &config, &marker)
                .await
                .map_err(RunError::Delivery)?;
            if exactly_once {
                // The snapshot's rows, its marker and the position become
                // visible together, or not at all.
                let offset = Offset::new(&config.source.slot, 0, consistent_point.0, now_ms());
                let f = offsets::write(&output.producer, &config, &offset)
                    .await
                    .map_err(RunError::Delivery)?;
                output.acks.delivery(f).await.map_err(RunError::Delivery)?;
                output.producer.commit().await?;
            }
        }
    }

    // A new slot abandons the incremental snapshots of the old one.
    let snapshots = incremental::Engine::resume(config.clone(), markers, existing.is_none());
    repl.start().await?;
    repl.wait_started().await?;
    tracing::info!(slot = %config.source.slot, "streaming");
    let resume_commit = resume.as_ref().map_or(0, Offset::commit);
    Ok(Ready {
        sql,
        output,
        repl,
        relations: Relations {
            codecs,
            outside: HashSet::new(),
            captured: captured.into_iter().collect(),
            kept: exclude::Kept::default(),
        },
        snapshots,
        resume_commit,
    })
}

/// Waits up to [`SLOT_RELEASE_WAIT`] for another session to let go of the
/// slot; a slot still held after that is an error naming the holder.
async fn wait_until_inactive(
    sql: &Client,
    slot_name: &str,
) -> Result<Option<slot::SlotStatus>, RunError> {
    let deadline = std::time::Instant::now() + SLOT_RELEASE_WAIT;
    loop {
        let status = slot::status(sql, slot_name).await?;
        match &status {
            Some(s) if s.active && std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Some(s) if s.active => {
                return Err(RunError::Slot(slot::SlotError::Active {
                    slot: slot_name.to_string(),
                    pid: s.active_pid.unwrap_or_default(),
                }))
            }
            _ => return Ok(status),
        }
    }
}

/// Moves the slot's confirmed position to `lsn` once the replication
/// session has let go of it (the session ends without a final status).
async fn advance_slot(sql: &Client, slot_name: &str, lsn: u64) {
    let target = Lsn(lsn).to_string();
    for _ in 0..50 {
        match sql
            .execute(
                "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)
                 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active
                   AND confirmed_flush_lsn < $2::text::pg_lsn",
                &[&slot_name, &target],
            )
            .await
        {
            Ok(_) => {
                let done = sql
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots
                         WHERE slot_name = $1 AND confirmed_flush_lsn >= $2::text::pg_lsn",
                        &[&slot_name, &target],
                    )
                    .await
                    .is_ok_and(|r| r.is_some());
                if done {
                    return;
                }
            }
            Err(e) => tracing::debug!(error = %e, "slot advance not possible yet"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::warn!(slot = %slot_name, lsn = %target, "could not record the final position; the next start replays from the last reported one");
}

/// A table's snapshot plan: its codec and the row ranges to copy.
struct TablePlan {
    table: String,
    oid: u32,
    codec: Arc<TableCodec>,
    /// Column list of the COPY.
    columns: String,
    chunks: Vec<Chunk>,
    /// Each column's form when the chunks copy in binary ([`binary_forms`]).
    forms: Option<Arc<[binary::Form]>>,
    /// Whether a chunk of the table itself reads it `ONLY` (not
    /// partitioned: its own rows, not its inheritance children's).
    only: bool,
}

/// One chunk of a table's plan.
#[derive(Clone, Default)]
struct Chunk {
    /// The partition it reads, for a partitioned table (`None`: the table).
    partition: Option<Arc<catalog::Leaf>>,
    /// The condition on its rows (`None`: all of them).
    condition: Option<String>,
    /// The file whose blocks the condition names, when a block range.
    filenode: Option<u32>,
}

/// What one chunk copies: the COPY's column list, the chunk, and the
/// columns' forms when it copies in binary.
struct ChunkSpec<'a> {
    columns: &'a str,
    chunk: Chunk,
    forms: Option<&'a [binary::Form]>,
    only: bool,
}

/// Source sessions of one snapshot, reused from chunk to chunk: a session
/// opened per chunk cost a backend start and a SCRAM exchange on both
/// sides, twice (the chunk's own and the one that checks its columns),
/// with the copy worker idle meanwhile. A session goes back only when
/// what used it succeeded and left no transaction open; one that failed
/// is dropped, which closes it.
#[derive(Clone)]
struct Sessions {
    idle: Arc<std::sync::Mutex<Vec<Client>>>,
    /// The exported snapshot's name.
    snapshot: Arc<str>,
}

impl Sessions {
    fn new(snapshot: &str) -> Sessions {
        Sessions {
            idle: Arc::default(),
            snapshot: snapshot.into(),
        }
    }

    fn idle(&self) -> Option<Client> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        std::iter::from_fn(|| idle.pop()).find(|c| !c.is_closed())
    }

    /// An idle session, or a new one.
    async fn take(&self, config: &Config) -> Result<Client, RunError> {
        match self.idle() {
            Some(client) => Ok(client),
            None => sql_session(config).await,
        }
    }

    /// Returns a session with no transaction open.
    fn put(&self, client: Client) {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(client);
    }

    /// A session in a transaction on the exported snapshot.
    /// An idle session that fails to begin (closed by the server since)
    /// is dropped for a new one.
    async fn on_snapshot(&self, config: &Config) -> Result<Client, RunError> {
        let begin = format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{}'",
            self.snapshot.replace('\'', "''")
        );
        if let Some(client) = self.idle() {
            match client.batch_execute(&begin).await {
                Ok(()) => return Ok(client),
                Err(e) => {
                    tracing::debug!(error = %e, "an idle source session failed; opening another")
                }
            }
        }
        let client = sql_session(config).await?;
        client.batch_execute(&begin).await?;
        Ok(client)
    }

    /// The table as the catalog has it now, on a session outside any
    /// snapshot; an idle one that fails (closed by the server since) is
    /// dropped for a new one.
    async fn current(
        &self,
        config: &Config,
        schema: &str,
        table: &str,
    ) -> Result<catalog::CurrentTable, RunError> {
        if let Some(client) = self.idle() {
            match catalog::current_table(&client, schema, table).await {
                Ok(now) => {
                    self.put(client);
                    return Ok(now);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "an idle source session failed; opening another")
                }
            }
        }
        let client = sql_session(config).await?;
        let now = catalog::current_table(&client, schema, table).await?;
        self.put(client);
        Ok(now)
    }
}

/// Describes a table, registers its schemas, and cuts it (a partitioned
/// one partition by partition) into chunks of about `chunk_rows`.
async fn plan_table(
    output: &Output,
    sessions: &Sessions,
    table: &str,
) -> Result<TablePlan, RunError> {
    let client = sessions.on_snapshot(&output.config).await?;
    let (schema, name) =
        split_table(table).ok_or_else(|| RunError::Config(format!("bad table {table}")))?;
    client
        .batch_execute(&format!(
            "LOCK TABLE {}.{} IN ACCESS SHARE MODE",
            slot::quote_ident(&schema),
            slot::quote_ident(&name)
        ))
        .await?;
    // The columns as they are now, not as of the snapshot: COPY resolves
    // names against the current catalog, and DDL committed after the
    // snapshot but before the lock above must not break it. Each copy
    // checks them again under its own lock.
    let current = sessions.take(&output.config).await?;
    let (oid, desc) = catalog::describe(&current, &schema, &name)
        .await?
        .ok_or_else(|| RunError::Config(format!("table {table} does not exist")))?;
    sessions.put(current);
    let desc = exclude::without_excluded(&output.config, desc).map_err(RunError::Config)?;
    let columns = column_list(&desc);
    let qualified = format!(
        "{}.{}",
        slot::quote_ident(&schema),
        slot::quote_ident(&name)
    );
    let partitions = catalog::leaf_partitions(&client, oid).await?;
    // Read once for the table and its partitions.
    let tid_range_scans = catalog::server_version(&client).await? >= 140_000;
    // A table's own rows, without its inheritance children's: Postgres
    // publishes a child's changes under the child's name.
    let only = partitions.is_none();
    let own = if only {
        format!("ONLY {qualified}")
    } else {
        qualified.clone()
    };
    let estimate = row_estimate(&client, oid, &own).await?;
    metrics::gauge!(observe::SNAPSHOT_ROWS_ESTIMATED, "table" => table.to_string()).set(estimate);
    // An outbox table is copied whole and in key order (see copy_chunk).
    let chunks = if output.config.outbox.contains_key(table) {
        vec![Chunk::default()]
    } else if let Some(partitions) = partitions {
        // Partition by partition, each cut as a table of its own: the
        // parent has no file of its own to cut into block ranges.
        let mut chunks = Vec::new();
        for leaf in partitions {
            let leaf_qualified = format!(
                "{}.{}",
                slot::quote_ident(&leaf.schema),
                slot::quote_ident(&leaf.name)
            );
            let estimate = if leaf.heap {
                row_estimate(&client, leaf.oid, &leaf_qualified).await?
            } else {
                0.0
            };
            let partition = Arc::new(leaf);
            let target = CutTarget {
                oid: partition.oid,
                schema: &partition.schema,
                name: &partition.name,
                estimate,
            };
            let cut =
                cut_relation(output, sessions, &client, &desc, target, tid_range_scans).await?;
            chunks.extend(cut.into_iter().map(|c| Chunk {
                partition: Some(partition.clone()),
                ..c
            }));
        }
        if chunks.is_empty() {
            chunks.push(Chunk::default());
        }
        chunks
    } else {
        let target = CutTarget {
            oid,
            schema: &schema,
            name: &name,
            estimate,
        };
        cut_relation(output, sessions, &client, &desc, target, tid_range_scans).await?
    };
    // Locks are held only while planning and while each chunk copies: a
    // lock held for the whole snapshot would queue our own copies behind
    // an application's DDL waiting for it (a TRUNCATE), a deadlock no one
    // detects.
    client.batch_execute("COMMIT").await?;
    sessions.put(client);
    let codec = Arc::new(output.codec(desc).await?);
    let forms: Option<Arc<[binary::Form]>> = binary_forms(output, &codec).map(Into::into);
    let format = if forms.is_some() { "binary" } else { "text" };
    tracing::info!(%table, chunks = chunks.len(), format, "table snapshot planned");
    Ok(TablePlan {
        table: table.to_string(),
        oid,
        codec,
        columns,
        chunks,
        forms,
        only,
    })
}

/// The relation [`cut_relation`] cuts: a table, or one of its partitions.
struct CutTarget<'a> {
    oid: u32,
    schema: &'a str,
    name: &'a str,
    /// Its rows as the planner knows them.
    estimate: f64,
}

/// Cuts a table (or one partition) into chunks of about `chunk_rows` by
/// its estimate. Heap block ranges where the server scans them by TID
/// range (`tid_range_scans`: 14 and later): a chunk then reads its blocks in order with no
/// index (2M orders in 20 chunks cost the backend 0.74 s of CPU against
/// 0.86 s by key ranges). Before 14 a block range would scan the whole
/// table, so an integer key's ranges come first there.
async fn cut_relation(
    output: &Output,
    sessions: &Sessions,
    client: &Client,
    desc: &TableDesc,
    target: CutTarget<'_>,
    tid_range_scans: bool,
) -> Result<Vec<Chunk>, RunError> {
    let CutTarget {
        oid,
        schema,
        name,
        estimate,
    } = target;
    let chunk_rows = output.config.source.snapshot.chunk_rows as f64;
    let n = (estimate / chunk_rows).ceil().max(1.0) as i64;
    if n <= 1 {
        return Ok(vec![Chunk::default()]);
    }
    let qualified = format!("{}.{}", slot::quote_ident(schema), slot::quote_ident(name));
    if !tid_range_scans {
        if let Some(key) = integer_key(desc) {
            let by_key = key_chunks(client, &qualified, &slot::quote_ident(&key.name), n).await?;
            if !by_key.is_empty() {
                return Ok(by_key
                    .into_iter()
                    .map(|condition| Chunk {
                        condition,
                        ..Chunk::default()
                    })
                    .collect());
            }
        }
    }
    // The file the ranges name (the planning session's lock holds it).
    let filenode = sessions
        .current(&output.config, schema, name)
        .await?
        .filenode;
    Ok(block_chunks(client, oid, n)
        .await?
        .into_iter()
        .map(|condition| Chunk {
            filenode: condition.as_ref().and(filenode),
            condition,
            partition: None,
        })
        .collect())
}

/// A table's row count as the planner knows it: from its statistics, or,
/// for a table never analysed nor vacuumed (`reltuples` -1, or 0 before
/// Postgres 14), the planner's own estimate from its size, so that a
/// freshly loaded table is still cut into chunks.
async fn row_estimate(client: &Client, oid: u32, from: &str) -> Result<f64, RunError> {
    let stats: f64 = client
        .query_one(
            "SELECT reltuples::float8 FROM pg_class WHERE oid = $1",
            &[&oid],
        )
        .await?
        .get(0);
    if stats > 0.0 {
        return Ok(stats);
    }
    let plan = client
        .simple_query(&format!("EXPLAIN (FORMAT JSON) SELECT * FROM {from}"))
        .await?;
    let rows = plan
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0),
            _ => None,
        })
        .and_then(|json| serde_json::from_str::<serde_json::Value>(json).ok())
        .and_then(|v| v[0]["Plan"]["Plan Rows"].as_f64());
    Ok(rows.unwrap_or(0.0).max(0.0))
}

/// `n` chunks by ranges of a single integer key; none when the table is
/// empty. The first and last ranges are open, so no row is ever dropped.
async fn key_chunks(
    client: &Client,
    qualified: &str,
    k: &str,
    n: i64,
) -> Result<Vec<Option<String>>, RunError> {
    let bounds = client
        .query_one(
            &format!("SELECT min({k})::int8, max({k})::int8 FROM {qualified}"),
            &[],
        )
        .await?;
    let (Some(lo), Some(hi)) = (
        bounds.get::<_, Option<i64>>(0),
        bounds.get::<_, Option<i64>>(1),
    ) else {
        return Ok(Vec::new());
    };
    let width = ((hi as i128 - lo as i128) / n as i128 + 1) as i64;
    Ok(ranges(n, |i| lo.saturating_add(width.saturating_mul(i)))
        .into_iter()
        .map(|(start, end)| {
            Some(match (start, end) {
                (None, Some(e)) => format!("{k} < {e}"),
                (Some(s), Some(e)) => format!("{k} >= {s} AND {k} < {e}"),
                (Some(s), None) => format!("{k} >= {s}"),
                (None, None) => "true".to_string(),
            })
        })
        .collect())
}

/// `n` chunks by ranges of heap blocks (a TID range scan each), for tables
/// without a single integer key. Rows the snapshot sees stay where they
/// are while it runs: VACUUM cannot remove tuples the exported snapshot
/// still sees (it may only cut empty pages off the end), and the last
/// range is open for blocks added since.
async fn block_chunks(client: &Client, oid: u32, n: i64) -> Result<Vec<Option<String>>, RunError> {
    let blocks: i64 = client
        .query_one(
            "SELECT pg_relation_size($1::oid::regclass) / current_setting('block_size')::int8",
            &[&oid],
        )
        .await?
        .get(0);
    let n = n.min(blocks.max(1));
    let width = (blocks + n - 1) / n.max(1);
    Ok(ranges(n, |i| width.saturating_mul(i))
        .into_iter()
        .map(|(start, end)| match (start, end) {
            (None, Some(e)) => Some(format!("ctid < '({e},0)'::tid")),
            (Some(s), Some(e)) => Some(format!("ctid >= '({s},0)'::tid AND ctid < '({e},0)'::tid")),
            (Some(s), None) => Some(format!("ctid >= '({s},0)'::tid")),
            (None, None) => None,
        })
        .collect())
}

/// `n` adjacent ranges `[start(i), start(i+1))`, the first open below and
/// the last open above, so together they cover everything.
fn ranges(n: i64, start: impl Fn(i64) -> i64) -> Vec<(Option<i64>, Option<i64>)> {
    (0..n)
        .map(|i| {
            let lower = (i > 0).then(|| start(i));
            let upper = (i + 1 < n).then(|| start(i + 1));
            (lower, upper)
        })
        .collect()
}

/// Copies every table on the exported snapshot, `workers` chunks at a time.
async fn run_snapshot(
    output: &Output,
    snapshot_name: &str,
    consistent_point: Lsn,
) -> Result<
    (
        HashMap<u32, TableCodec>,
        BTreeMap<String, u64>,
        BTreeMap<String, usize>,
    ),
    RunError,
> {
    let config = &output.config;
    let sessions = Sessions::new(snapshot_name);
    let mut plans = Vec::new();
    for table in &config.source.tables {
        plans.push(plan_table(output, &sessions, table).await?);
    }
    let progress = Progress::new(&plans);
    // At least once, the rows go through an untracked producer of their
    // own that fills larger batches and is flushed below; exactly once,
    // they must share the Kafka transaction of the marker and the offset
    // record.
    let bulk = if output.producer.is_transactional() {
        output.clone()
    } else {
        let mut bulk = sink::BulkProducer::create(&config.kafka)?;
        bulk.warm(plans.iter().map(|p| p.codec.topic.clone()).collect())
            .await?;
        Output {
            bulk: Some(bulk),
            ..output.clone()
        }
    };
    let output = &bulk;
    let limit = Arc::new(tokio::sync::Semaphore::new(config.source.snapshot.workers));
    let mut tasks = tokio::task::JoinSet::new();
    for plan in &plans {
        for chunk in &plan.chunks {
            let (output, limit, sessions) = (output.clone(), limit.clone(), sessions.clone());
            let (codec, table, columns, chunk, forms, only) = (
                plan.codec.clone(),
                plan.table.clone(),
                plan.columns.clone(),
                chunk.clone(),
                plan.forms.clone(),
                plan.only,
            );
            let progress = progress.clone();
            tasks.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let spec = ChunkSpec {
                    columns: &columns,
                    chunk,
                    forms: forms.as_deref(),
                    only,
                };
                let rows = copy_chunk(
                    &output,
                    &sessions,
                    &codec,
                    spec,
                    consistent_point,
                    &progress,
                )
                .await
                .map_err(|e| match e.verdict() {
                    // An outage: the supervisor restarts and redoes the snapshot.
                    Verdict::Retry(_) => e,
                    _ => RunError::Snapshot {
                        table: table.clone(),
                        message: e.to_string(),
                    },
                })?;
                Ok::<_, RunError>((table, rows))
            });
        }
    }
    let mut rows: BTreeMap<String, u64> = plans.iter().map(|p| (p.table.clone(), 0)).collect();
    while let Some(done) = tasks.join_next().await {
        let (table, count) = done.map_err(|e| RunError::Snapshot {
            table: "?".into(),
            message: e.to_string(),
        })??;
        *rows.entry(table).or_default() += count;
    }
    // Closed now, not after the flush and the wait for acknowledgements.
    drop(sessions);
    progress.finish(&rows);
    let chunks = plans
        .iter()
        .map(|p| (p.table.clone(), p.chunks.len()))
        .collect();
    let mut codecs = HashMap::new();
    for plan in plans {
        let codec = Arc::try_unwrap(plan.codec).map_err(|_| RunError::Snapshot {
            table: plan.table.clone(),
            message: "a copy task still holds the codec".into(),
        })?;
        codecs.insert(plan.oid, codec);
    }
    // Streaming starts only after Kafka holds the whole snapshot: every
    // row (the flush) and every tracked message (the release below).
    if let Some(bulk) = &output.bulk {
        bulk.flush().await?;
    }
    output
        .acks
        .release(consistent_point.0)
        .map_err(RunError::Delivery)?;
    let mut confirmed = output.acks.confirmed();
    let mut failed = output.acks.failed();
    while *confirmed.borrow() < consistent_point.0 {
        tokio::select! {
            _ = confirmed.changed() => {}
            _ = failed.changed() => {
                if let Some(e) = failed.borrow().clone() {
                    return Err(RunError::Delivery(e));
                }
            }
        }
    }
    tracing::info!(%consistent_point, tables = codecs.len(), "snapshot complete");
    Ok((codecs, rows, chunks))
}

/// Snapshot progress: a bar per table on a terminal, log lines otherwise.
#[derive(Clone)]
struct Progress {
    bars: Option<Arc<HashMap<String, indicatif::ProgressBar>>>,
    started: std::time::Instant,
}

impl Progress {
    fn new(plans: &[TablePlan]) -> Progress {
        use std::io::IsTerminal;
        let bars = std::io::stderr().is_terminal().then(|| {
            let multi = indicatif::MultiProgress::new();
            let style = indicatif::ProgressStyle::with_template(
                "{prefix:>30} {human_pos:>12} rows {per_sec:>14} {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner());
            Arc::new(
                plans
                    .iter()
                    .map(|p| {
                        let bar = multi.add(indicatif::ProgressBar::new_spinner());
                        bar.set_style(style.clone());
                        bar.set_prefix(p.table.clone());
                        (p.table.clone(), bar)
                    })
                    .collect(),
            )
        });
        Progress {
            bars,
            started: std::time::Instant::now(),
        }
    }

    /// Adds copied rows to a table's bar (on a terminal).
    fn add(&self, table: &str, rows: u64) {
        if let Some(bar) = self.bars.as_ref().and_then(|b| b.get(table)) {
            bar.inc(rows);
        }
    }

    /// Logs a chunk's progress when there is no terminal to draw on.
    fn log(&self, table: &str, chunk_rows: u64, chunk_started: std::time::Instant) {
        if self.bars.is_none() {
            let rate = chunk_rows as f64 / chunk_started.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(%table, chunk_rows, rows_per_sec = rate, "snapshot progress");
        }
    }

    fn finish(&self, rows: &BTreeMap<String, u64>) {
        let secs = self.started.elapsed().as_secs_f64();
        if let Some(bars) = &self.bars {
            for bar in bars.values() {
                bar.finish();
            }
        }
        for (table, n) in rows {
            tracing::info!(%table, rows = n, rows_per_sec = *n as f64 / secs.max(1e-9), "table snapshot done");
        }
    }
}

/// Copies one chunk of a table on the exported snapshot as `op = r` events.
async fn copy_chunk(
    output: &Output,
    sessions: &Sessions,
    codec: &TableCodec,
    chunk: ChunkSpec<'_>,
    consistent_point: Lsn,
    progress: &Progress,
) -> Result<u64, RunError> {
    let (columns, forms, only) = (chunk.columns, chunk.forms, chunk.only);
    let client = sessions.on_snapshot(&output.config).await?;
    let table = codec.desc.qualified();
    let qualified = format!(
        "{}.{}",
        slot::quote_ident(&codec.desc.schema),
        slot::quote_ident(&codec.desc.table)
    );
    // Under this chunk's own lock, the columns must still be the planned
    // ones, names and types: COPY reads the current catalog, and a binary
    // COPY is read by the planned types.
    client
        .batch_execute(&format!("LOCK TABLE {qualified} IN ACCESS SHARE MODE"))
        .await?;
    let now = sessions
        .current(&output.config, &codec.desc.schema, &codec.desc.table)
        .await?;
    let planned = codec
        .desc
        .columns
        .iter()
        .map(|c| (c.name.clone(), c.type_oid, c.type_modifier));
    let excluded = output.config.excluded_columns(&codec.table);
    let kept = now
        .columns
        .into_iter()
        .filter(|(name, ..)| !excluded.contains(name));
    if !kept.eq(planned) {
        return Err(RunError::Snapshot {
            table,
            message: "its columns changed during the snapshot (DDL); the next start takes the snapshot again".into(),
        });
    }
    // A partition's chunk reads the partition (the lock above, on the
    // parent, covers its partitions too).
    let chunk = chunk.chunk;
    let (rel, file_now) = match &chunk.partition {
        Some(p) => (
            format!(
                "{}.{}",
                slot::quote_ident(&p.schema),
                slot::quote_ident(&p.name)
            ),
            match chunk.filenode {
                Some(_) => {
                    sessions
                        .current(&output.config, &p.schema, &p.name)
                        .await?
                        .filenode
                }
                None => None,
            },
        ),
        None => (qualified.clone(), now.filenode),
    };
    // The table's own rows, not its inheritance children's (see TablePlan).
    let from = if only && chunk.partition.is_none() {
        format!("ONLY {rel}")
    } else {
        rel.clone()
    };
    // A new file since the plan: after a TRUNCATE (or a rewriting ALTER
    // TABLE) the snapshot sees the table empty, not MVCC-safe, and the
    // stream carries the truncate; but VACUUM FULL and CLUSTER keep the
    // rows it sees, moved to other blocks, where ranges planned on the
    // old file would copy some twice and skip others.
    if chunk.filenode.is_some() && file_now != chunk.filenode {
        let moved: bool = client
            .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {from})"), &[])
            .await?
            .get(0);
        if moved {
            return Err(RunError::Snapshot {
                table,
                message: "it was rewritten during the snapshot (VACUUM FULL, CLUSTER, or moved to another tablespace), which moves its rows between the planned block ranges; the next start takes the snapshot again".into(),
            });
        }
        // Empty to the snapshot: a TRUNCATE, whose truncate the stream
        // carries; or a rewrite that keeps every column's type, which
        // copies the live rows into the new file under its own transaction
        // id, out of the snapshot's sight, and carries no truncate. Rows of
        // the new file from the transaction that made it (the one that last
        // wrote the table's pg_class row) tell the second; so does a
        // TRUNCATE refilled in its own transaction, which the retaken
        // snapshot then reads.
        let current = sessions.take(&output.config).await?;
        let rewritten: bool = current
            .query_one(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM {from} WHERE xmin =
                         (SELECT xmin FROM pg_class WHERE oid = $1::text::regclass))"
                ),
                &[&rel],
            )
            .await?
            .get(0);
        sessions.put(current);
        if rewritten {
            return Err(RunError::Snapshot {
                table,
                message: "it was rewritten during the snapshot with its columns' types kept (ALTER TABLE ... SET ACCESS METHOD, a type changed USING an expression), or truncated and refilled in one transaction: the snapshot no longer sees the rows it has not copied; the next start takes the snapshot again".into(),
            });
        }
    }
    // Events of a stream keep their order: an outbox table's rows go out
    // in its snapshot order, in one chunk.
    let order = output
        .config
        .outbox
        .get(&table)
        .and_then(|o| snapshot_order(o, &codec.desc))
        .map(|by| format!(" ORDER BY {}", slot::quote_ident(by)))
        .unwrap_or_default();
    let copy = format!(
        "COPY (SELECT {} FROM {from}{}{order}) TO STDOUT{}",
        columns,
        chunk
            .condition
            .map(|c| format!(" WHERE {c}"))
            .unwrap_or_default(),
        if forms.is_some() {
            " (FORMAT binary)"
        } else {
            ""
        }
    );
    let stream = client.copy_out(&copy).await?;
    futures_util::pin_mut!(stream);
    let started = std::time::Instant::now();
    let mut buf: Vec<u8> = Vec::new();
    let mut line = catalog::CopyLine::default();
    let mut binary_rows = catalog::CopyBinary::new(codec.desc.columns.len());
    // Bytes of the COPY data before `data`'s first, for errors; and
    // whether a binary COPY's trailer came (a stream cut short must not
    // pass for a complete chunk).
    let mut read: u64 = 0;
    let mut ended = false;
    let mut rows: u64 = 0;
    let src = SourceInfo {
        connector_name: &output.config.name,
        db: &output.db,
        position: Position {
            commit_lsn: consistent_point.0,
            seq: 0,
        },
        lsn: consistent_point.0,
        tx_id: None,
        ts_ms: now_ms(),
        snapshot: "true",
        table_order: 0,
    };
    // Looked up once: the registry's look-up by labels costs more than
    // the increment.
    let counted = metrics::counter!(observe::SNAPSHOT_ROWS, "table" => table.clone());
    // Rows and bytes not yet added to the shared counters, which both copy
    // workers would otherwise update once per row.
    let mut tally = Tally::default();
    let mut staged: Vec<Staged> = Vec::with_capacity(STAGED_ROWS);
    let mut row: Vec<Input<'static>> = Vec::with_capacity(codec.desc.columns.len());
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        // Postgres sends a row per message: whole lines are parsed where
        // they arrived, and only a part line is carried over.
        let data: &[u8] = if buf.is_empty() {
            &chunk
        } else {
            buf.extend_from_slice(&chunk);
            &buf
        };
        let mut start = 0;
        loop {
            let mut fields = reuse(row);
            let end = match forms {
                None => data[start..].iter().position(|&b| b == b'\n').map(|nl| {
                    line.parse(&data[start..start + nl]);
                    fields.extend(line.fields().map(|f| f.map_or(Input::Null, Input::Text)));
                    start + nl + 1
                }),
                Some(forms) => {
                    match binary_rows
                        .next(data, start)
                        .map_err(|e| RunError::Snapshot {
                            table: table.clone(),
                            message: format!(
                                "{} (byte {} of a chunk)",
                                e.message,
                                read + e.at as u64
                            ),
                        })? {
                        Some(catalog::CopyStep::Row(end)) => {
                            fields.extend(binary_rows.fields(data).zip(forms).map(|(f, form)| {
                                f.map_or(Input::Null, |b| binary::input(*form, b))
                            }));
                            Some(end)
                        }
                        Some(catalog::CopyStep::End(end)) => {
                            ended = true;
                            start = end;
                            None
                        }
                        None => None,
                    }
                }
            };
            let Some(end) = end else {
                row = reuse(fields);
                break;
            };
            let produced = output
                .emit_uncounted(
                    codec,
                    Op::Read,
                    None,
                    Some(&fields),
                    &src,
                    Some(&mut staged),
                )
                .await?;
            row = reuse(fields);
            tally.rows += 1;
            tally.produced += u64::from(produced.is_some());
            tally.bytes += produced.unwrap_or(0) as u64;
            rows += 1;
            start = end;
            if rows.is_multiple_of(100_000) {
                progress.log(&table, rows, started);
            }
        }
        read += start as u64;
        let rest = data[start..].to_vec();
        buf.clear();
        buf.extend_from_slice(&rest);
        if staged.len() >= STAGED_ROWS {
            output.send_staged(codec, &mut staged).await?;
        }
        if tally.rows >= 1024 {
            tally.add_to(codec, &counted, progress, &table);
        }
    }
    if !buf.is_empty() || (forms.is_some() && !ended) {
        let at = read + buf.len() as u64;
        return Err(RunError::Snapshot {
            table,
            message: format!(
                "its COPY data ended at byte {at} of a chunk, {}",
                if buf.is_empty() {
                    "without the binary trailer"
                } else {
                    "inside a row"
                }
            ),
        });
    }
    output.send_staged(codec, &mut staged).await?;
    tally.add_to(codec, &counted, progress, &table);
    client.batch_execute("COMMIT").await?;
    sessions.put(client);
    Ok(rows)
}

/// Each column's form in a binary COPY of `codec`'s table, when its chunks
/// copy in binary: every column has one, and nothing reads a column's text
/// on the way (an outbox's routing, a tenant's placement). Binary costs
/// Postgres no output function per value and pgcdc no parsing.
fn binary_forms(output: &Output, codec: &TableCodec) -> Option<Vec<binary::Form>> {
    if codec.outbox || output.partitioning.has_tenant(&codec.table) {
        return None;
    }
    codec.binary_forms()
}

/// Snapshot records a copy worker encodes before it hands them to
/// librdkafka together: a run of encodes, then a run of produce calls,
/// keeps each one's code and data in the core's caches, where alternating
/// them per row evicts both (8% less CPU per row, measured; 1,024 did no
/// better). Exactly once, the snapshot is produced row by row instead.
const STAGED_ROWS: usize = 256;

/// A snapshot record encoded and placed, not yet produced.
struct Staged {
    topic: Option<Arc<str>>,
    partition: Option<i32>,
    key: Option<Vec<u8>>,
    value: Vec<u8>,
    headers: Option<rdkafka::message::OwnedHeaders>,
}

/// Puts each partition's staged records together, in their order (a
/// stable sort, so a key's records keep theirs): librdkafka then appends
/// runs to one partition's queue, and a batch holds messages allocated
/// together, which its broker thread copies and acknowledges from warm
/// caches. The partition is the record's own, or the partitioner's pick
/// for its key among `count` partitions of its topic (`topic` unless it
/// names another, looked up once for the stage); records without one go
/// first.
fn by_partition(stage: &mut [Staged], topic: &str, count: impl Fn(&str) -> Option<i32>) {
    let own = count(topic);
    stage.sort_by_cached_key(|r| {
        r.partition.or_else(|| {
            let n = match &r.topic {
                Some(other) => count(other),
                None => own,
            };
            Some(sink::partition_for(r.key.as_deref()?, n?))
        })
    });
}

/// Snapshot rows copied and events produced by one copy worker since
/// its last report to the shared counters.
#[derive(Default)]
struct Tally {
    rows: u64,
    produced: u64,
    bytes: u64,
}

impl Tally {
    fn add_to(
        &mut self,
        codec: &TableCodec,
        counted: &metrics::Counter,
        progress: &Progress,
        table: &str,
    ) {
        if self.rows == 0 {
            return;
        }
        codec.meters.events(Op::Read, self.produced, self.bytes);
        counted.increment(self.rows);
        progress.add(table, self.rows);
        *self = Tally::default();
    }
}

/// An emptied row buffer for rows of another lifetime: the allocation is
/// kept (a collect in place), so a copy worker allocates none per row.
fn reuse<'b>(mut row: Vec<Input<'_>>) -> Vec<Input<'b>> {
    row.clear();
    row.into_iter().map(|_| Input::Null).collect()
}

/// Per-transaction state of the stream.
#[derive(Default)]
struct Txn {
    commit_lsn: u64,
    xid: u32,
    ts_ms: i64,
    /// The commit time in Unix µs.
    committed_us: i64,
    seq: u64,
    table_order: HashMap<u32, u64>,
    /// Kafka already holds this transaction (exactly-once resume).
    skip: bool,
    /// Incremental snapshot rows or markers were produced in it: in
    /// exactly-once mode they commit with it.
    produced: bool,
}

impl Txn {
    /// Debezium's transaction id: `<xid>:<commit LSN>`.
    fn id(&self) -> String {
        format!("{}:{}", self.xid, self.commit_lsn)
    }
}

/// Decides when a position may be released for confirmation.
///
/// At least once: at every source transaction boundary, behind the
/// acknowledgements of everything produced before it. Exactly once: only
/// after the Kafka transaction holding everything before it committed,
/// together with an offset record naming the newest source transaction in
/// it; boundaries seen while a Kafka transaction is open wait for its
/// commit.
struct Release {
    /// The highest position handed to [`Acks`].
    released: u64,
    exactly_once: bool,
    interval: Duration,
    /// Exactly once: when the open Kafka transaction received its first
    /// complete source transaction.
    since: Option<std::time::Instant>,
    /// Exactly once: (commit LSN, end LSN) of the newest complete source
    /// transaction in the open Kafka transaction.
    newest: Option<(u64, u64)>,
    /// Exactly once: the highest boundary waiting for the commit.
    waiting: u64,
    /// Commit times (Unix µs) of the source transactions completed since
    /// the last release: their commit-to-ack latency is recorded on it.
    committed: Vec<i64>,
}

impl Release {
    fn new(output: &Output, released: u64) -> Release {
        Release {
            released,
            exactly_once: output.producer.is_transactional(),
            interval: Duration::from_millis(output.config.kafka.transaction_interval_ms),
            since: None,
            newest: None,
            waiting: 0,
            committed: Vec::new(),
        }
    }

    async fn release(&mut self, output: &Output, lsn: u64) -> Result<(), RunError> {
        if lsn > self.released {
            self.released = lsn;
            let committed = std::mem::take(&mut self.committed);
            output
                .acks
                .release_committed(lsn, committed)
                .map_err(RunError::Delivery)?;
        }
        Ok(())
    }

    /// A source transaction (committed at `committed_us`, Unix µs) whose
    /// events were all produced.
    fn completed(&mut self, commit_lsn: u64, end_lsn: u64, committed_us: i64) {
        self.committed.push(committed_us);
        self.newest = Some((commit_lsn, end_lsn));
        self.since.get_or_insert_with(std::time::Instant::now);
    }

    /// Everything before `lsn` has been produced (or had nothing to
    /// produce).
    async fn boundary(&mut self, output: &Output, lsn: u64) -> Result<(), RunError> {
        if !self.exactly_once || !output.producer.in_transaction() {
            return self.release(output, lsn).await;
        }
        self.waiting = self.waiting.max(lsn);
        if self.since.is_some_and(|t| t.elapsed() >= self.interval) {
            self.commit(output).await?;
        }
        Ok(())
    }

    /// Exactly once: commits the open Kafka transaction with its offset
    /// record, then releases what waited for it. Call only between source
    /// transactions.
    async fn commit(&mut self, output: &Output) -> Result<(), RunError> {
        if !output.producer.in_transaction() {
            return Ok(());
        }
        if let Some((commit_lsn, end_lsn)) = self.newest.take() {
            let offset = Offset::new(&output.config.source.slot, commit_lsn, end_lsn, now_ms());
            let f = offsets::write(&output.producer, &output.config, &offset)
                .await
                .map_err(RunError::Delivery)?;
            output.acks.delivery(f).await.map_err(RunError::Delivery)?;
            self.waiting = self.waiting.max(end_lsn);
        }
        output.producer.commit().await?;
        metrics::counter!(observe::KAFKA_TRANSACTIONS).increment(1);
        self.since = None;
        let lsn = std::mem::take(&mut self.waiting);
        self.release(output, lsn).await
    }

    /// Shutdown: the open Kafka transaction is committed unless it holds
    /// part of a source transaction (then it is left for the caller to
    /// abort once deliveries are done, and the slot replays that
    /// transaction). Returns the last released position.
    async fn finish(&mut self, output: &Output, mid_transaction: bool) -> Result<u64, RunError> {
        if self.exactly_once && !mid_transaction {
            self.commit(output).await?;
        }
        Ok(self.released)
    }
}

/// Reads the replication stream until shutdown; returns the last position
/// that may be confirmed once everything in flight is acknowledged.
/// Transactions committed at or before `resume_commit` are already in Kafka
/// (exactly-once mode) and are not produced again.
// What an attempt holds, plus what outlives it (`shutdown`, `progress`).
#[allow(clippy::too_many_arguments)]
async fn stream(
    output: &Output,
    repl: &mut ReplicationClient,
    sql: &Client,
    mut relations: Relations,
    mut snapshots: incremental::Engine,
    resume_commit: u64,
    shutdown: &mut crate::Shutdown,
    progress: &std::sync::atomic::AtomicU64,
) -> Result<u64, RunError> {
    let mut confirmed = output.acks.confirmed();
    let mut failed = output.acks.failed();
    let mut txn: Option<Txn> = None;
    let mut release = Release::new(output, *confirmed.borrow());
    let mut skipped = 0u64;
    let src = &output.config.source;
    let heartbeat_every = Duration::from_secs(src.heartbeat_interval_secs.max(1));
    let mut heartbeat = tokio::time::interval(heartbeat_every);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut group_tick = tokio::time::interval(release.interval);
    group_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    progress.fetch_max(*confirmed.borrow(), std::sync::atomic::Ordering::AcqRel);
    observe::board::set_phase(observe::board::Phase::Streaming);
    loop {
        snapshots.schedule(output, sql).await?;
        tokio::select! {
            biased;
            _ = shutdown.requested() => return release.finish(output, txn.is_some()).await,
            _ = group_tick.tick(), if release.exactly_once => {
                if txn.is_none() && release.since.is_some_and(|t| t.elapsed() >= release.interval) {
                    release.commit(output).await?;
                }
            }
            _ = heartbeat.tick() => {
                if src.heartbeat_interval_secs > 0 {
                    // A WAL record of our own, so the slot can advance past
                    // WAL that the captured tables did not write.
                    sql.execute("SELECT pg_logical_emit_message(false, 'pgcdc.heartbeat', '')", &[])
                        .await?;
                }
            }
            r = failed.changed() => {
                if r.is_ok() {
                    if let Some(e) = failed.borrow().clone() {
                        return Err(RunError::Delivery(e));
                    }
                }
            }
            r = snapshots.read_done(output), if snapshots.reading() => r?,
            r = confirmed.changed() => {
                if r.is_ok() {
                    let lsn = *confirmed.borrow();
                    progress.fetch_max(lsn, std::sync::atomic::Ordering::AcqRel);
                    repl.update_applied_lsn(WireLsn(lsn));
                    metrics::gauge!(observe::CONFIRMED_LSN).set(lsn as f64);
                    tracing::debug!(confirmed = %Lsn(lsn), "confirmed");
                }
            }
            ev = repl.recv() => {
                // Only shutdown ends the stream: the server closing it is an outage.
                let Some(ev) = ev? else {
                    return Err(RunError::Replication(pgwire_replication::PgWireError::Task(
                        "the server ended the replication stream".into(),
                    )));
                };
                match ev {
                    ReplicationEvent::Begin { final_lsn, xid, commit_time_micros } => {
                        let skip = final_lsn.as_u64() <= resume_commit;
                        if skip {
                            skipped += 1;
                        } else if skipped > 0 {
                            tracing::info!(skipped, "exactly-once: skipped replayed transactions that Kafka already holds");
                            skipped = 0;
                        }
                        txn = Some(Txn {
                            commit_lsn: final_lsn.as_u64(),
                            xid,
                            ts_ms: pg_time_to_ms(commit_time_micros),
                            committed_us: pg_time_to_us(commit_time_micros),
                            skip,
                            ..Txn::default()
                        });
                    }
                    ReplicationEvent::Commit { end_lsn, .. } => {
                        if let Some(t) = txn.take().filter(|t| t.seq > 0 || t.produced) {
                            let counts: Vec<(String, u64)> = t
                                .table_order
                                .iter()
                                .map(|(oid, n)| {
                                    let table = relations.codecs.get(oid).map(|c| c.table.clone()).unwrap_or_else(|| oid.to_string());
                                    (format!("{}.{table}", output.config.kafka.topic_prefix), *n)
                                })
                                .collect();
                            // Snapshot rows alone are no transaction of the source's.
                            if t.seq > 0 {
                                let (k, v) = output
                                    .transactions
                                    .end(&t.id(), &counts, t.ts_ms)
                                    .map_err(|source| RunError::Encode { table: transaction_topic(&output.config), lsn: Lsn(t.commit_lsn), source })?;
                                output.emit_transaction(&k, &v).await?;
                            }
                            release.completed(t.commit_lsn, end_lsn.as_u64(), t.committed_us);
                        }
                        release.boundary(output, end_lsn.as_u64()).await?;
                    }
                    ReplicationEvent::KeepAlive { wal_end, .. } => {
                        // Between transactions everything up to wal_end was seen.
                        if txn.is_none() {
                            release.boundary(output, wal_end.as_u64()).await?;
                        }
                    }
                    ReplicationEvent::XLogData { wal_start, data, .. } => {
                        let lsn = Lsn(wal_start.as_u64());
                        let msg = pgoutput::decode(&data).map_err(|source| RunError::Decode { lsn, source })?;
                        on_message(output, sql, &mut relations, &mut snapshots, txn.as_mut(), lsn, msg).await?;
                    }
                    ReplicationEvent::Message { transactional: true, prefix, content, lsn } => {
                        // Requests and watermarks of incremental snapshots;
                        // a skipped transaction is already in Kafka.
                        if let Some(t) = txn.as_mut().filter(|t| !t.skip) {
                            let wrote = match prefix.as_str() {
                                incremental::SIGNAL_PREFIX => snapshots.on_signal(output, &content).await?,
                                incremental::WATERMARK_PREFIX => {
                                    snapshots.on_watermark(output, &content, t.commit_lsn, lsn.as_u64()).await?
                                }
                                _ => false,
                            };
                            t.produced |= wrote;
                        }
                    }
                    ReplicationEvent::Message { transactional: false, lsn, .. } => {
                        // Outside a transaction everything before it was seen.
                        if txn.is_none() {
                            release.boundary(output, lsn.as_u64()).await?;
                        }
                    }
                    ReplicationEvent::StoppedAt { .. } => return release.finish(output, txn.is_some()).await,
                }
            }
        }
    }
}

/// Watches the slot at every heartbeat tick and raises two alerts, each
/// with one warning log at its onset:
/// - `slot_stalled`: the confirmed LSN has not moved for `after` while WAL
///   grew;
/// - `slot_wal_at_risk`: the slot retains more than `wal_limit` bytes, or
///   its `wal_status` is not `reserved` (Postgres may remove WAL it needs).
struct Stall {
    after: Duration,
    wal_limit: u64,
    last_confirmed: u64,
    since: std::time::Instant,
    warned: bool,
    at_risk: bool,
}

impl Stall {
    fn new(after: Duration, wal_limit: u64) -> Stall {
        Stall {
            after,
            wal_limit,
            last_confirmed: 0,
            since: std::time::Instant::now(),
            warned: false,
            at_risk: false,
        }
    }

    async fn check(&mut self, sql: &Client, slot_name: &str, confirmed: u64) {
        // One round trip: lag behind the confirmed LSN, and the slot's own
        // view of what it retains. A failed query changes nothing: an
        // outage is the stream's to report.
        let row = sql
            .query_opt(
                // Before the first confirmation ($1 = 0/0), the slot's own.
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(),
                            CASE WHEN $1 = '0/0' THEN s.confirmed_flush_lsn ELSE $1::text::pg_lsn END)::bigint,
                        pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint,
                        s.wal_status, s.safe_wal_size
                   FROM (SELECT 1) one
                   LEFT JOIN pg_replication_slots s ON s.slot_name = $2",
                &[&Lsn(confirmed).to_string(), &slot_name],
            )
            .await
            .ok()
            .flatten();
        let behind: Option<i64> = row.as_ref().and_then(|r| r.get(0));
        if let Some(bytes) = behind {
            metrics::gauge!(observe::REPLICATION_LAG_BYTES).set(bytes as f64);
        }
        if let Some(r) = &row {
            let retained: Option<i64> = r.get(1);
            let status: Option<String> = r.get(2);
            let safe: Option<i64> = r.get(3);
            if let Some(b) = retained {
                metrics::gauge!(observe::SLOT_RETAINED_WAL_BYTES).set(b as f64);
            }
            if let Some(b) = safe {
                metrics::gauge!(observe::SLOT_SAFE_WAL_SIZE_BYTES).set(b as f64);
            }
            let over = retained.is_some_and(|b| b as u64 > self.wal_limit);
            let unreserved = status.as_deref().is_some_and(|s| s != "reserved");
            let at_risk = over || unreserved;
            if at_risk && !self.at_risk {
                tracing::warn!(
                    slot = %slot_name,
                    retained_bytes = retained.unwrap_or(0),
                    limit_bytes = self.wal_limit,
                    wal_status = status.as_deref().unwrap_or("unknown"),
                    "alert slot_wal_at_risk: the slot retains more WAL than source.retained_wal_warning_bytes, or Postgres may remove WAL it needs (see the README's runbook: an invalidated slot)"
                );
            }
            self.at_risk = at_risk;
            observe::Alert::SlotWalAtRisk.set(at_risk);
        }
        if confirmed != self.last_confirmed {
            self.last_confirmed = confirmed;
            self.since = std::time::Instant::now();
            self.warned = false;
            metrics::gauge!(observe::SLOT_STALLED).set(0.0);
            observe::Alert::SlotStalled.set(false);
            return;
        }
        if self.warned || self.since.elapsed() < self.after {
            return;
        }
        if let Some(bytes) = behind.filter(|b| *b > 0) {
            tracing::warn!(
                slot = %slot_name,
                confirmed = %Lsn(confirmed),
                behind_bytes = bytes,
                stalled_secs = self.since.elapsed().as_secs(),
                "alert slot_stalled: the slot's confirmed LSN has not moved while WAL grows; Postgres retains WAL for it (see the README's runbook: a slot stall)"
            );
            metrics::gauge!(observe::SLOT_STALLED).set(1.0);
            observe::Alert::SlotStalled.set(true);
            self.warned = true;
        }
    }
}

/// Marks key columns of a Relation's columns from the catalog's key.
async fn relation_desc(sql: &Client, rel: &pgoutput::Relation) -> Result<TableDesc, RunError> {
    let keys = catalog::key_columns(sql, rel.oid).await?;
    let names: Vec<String> = rel.columns.iter().map(|c| c.name.clone()).collect();
    let types: Vec<(u32, i32)> = rel
        .columns
        .iter()
        .map(|c| (c.type_oid, c.type_modifier))
        .collect();
    let columns = catalog::columns(sql, &names, &types, &keys).await?;
    Ok(TableDesc {
        schema: rel.namespace.clone(),
        table: rel.name.clone(),
        columns,
    })
}

fn key_changed(codec: &TableCodec, old: &[Datum], new: &[Datum]) -> bool {
    codec
        .desc
        .columns
        .iter()
        .zip(old.iter().zip(new))
        .any(|(c, (o, n))| c.key && o != n && *n != Datum::UnchangedToast)
}

/// The relations the stream has met: a codec per captured table, and the
/// relations outside `source.tables` whose changes are skipped.
struct Relations {
    codecs: HashMap<u32, TableCodec>,
    /// Relations a publication covers beyond the captured tables (`FOR ALL
    /// TABLES`, a table added by hand), and the partition a change was made
    /// in, which pgoutput describes too when it publishes through the root.
    outside: HashSet<u32>,
    /// The captured tables' oids, read before replication started: a
    /// Relation naming one of them outside `source.tables` is a captured
    /// table renamed.
    captured: HashSet<u32>,
    /// The columns kept of tables that leave some out.
    kept: exclude::Kept,
}

async fn on_message(
    output: &Output,
    sql: &Client,
    relations: &mut Relations,
    snapshots: &mut incremental::Engine,
    txn: Option<&mut Txn>,
    lsn: Lsn,
    msg: Message,
) -> Result<(), RunError> {
    let Relations {
        codecs,
        outside,
        captured,
        kept,
    } = relations;
    // First of all: nothing below sees a left-out column's value.
    let msg = kept.cut(msg, lsn).map_err(RunError::Config)?;
    if let Message::Relation(rel) = &msg {
        // Changes of relations outside the captured tables are skipped, as
        // Debezium's include list does: they have no snapshot, no topic
        // pgcdc made, and no consumer expecting them. A captured table
        // renamed out of the list stops the connector instead, since
        // skipping its changes would lose them.
        let name = crate::config::table_name(&rel.namespace, &rel.name);
        if !output.config.source.tables.contains(&name) {
            if codecs.contains_key(&rel.oid) || captured.contains(&rel.oid) {
                let was = codecs.get(&rel.oid).map_or_else(
                    || "a captured table".to_string(),
                    |c| format!("captured table {}", slot::sql_table(&c.table)),
                );
                return Err(RunError::Config(format!(
                    "{was} is named {0} from LSN {lsn} on (renamed, or moved to another schema); pgcdc stops rather than skip its changes: add {0} to source.tables (its changes then go to that name's topic) or rename it back",
                    slot::sql_table(&name),
                )));
            }
            outside.insert(rel.oid);
            return Ok(());
        }
        outside.remove(&rel.oid);
        let desc = kept
            .describe(&output.config, rel.oid, relation_desc(sql, rel).await?, lsn)
            .map_err(RunError::Config)?;
        if codecs.get(&rel.oid).is_none_or(|c| c.desc != desc) {
            if codecs.contains_key(&rel.oid) {
                tracing::info!(table = %desc.qualified(), %lsn, "schema change");
            }
            let codec = output.codec(desc).await?;
            // A delete must carry the tenant, or it could not be routed
            // (nor scheduled) with the key's other events.
            if let Some(column) = output.partitioning.tenant_outside_key(&codec) {
                if rel.replica_identity != source::pgoutput::ReplicaIdentity::Full {
                    let field = format!("partitioning.\"{}\".tenant_column", codec.table);
                    return Err(RunError::Config(source::catalog::tenant_outside_identity(
                        &field,
                        &column,
                        &codec.table,
                    )));
                }
            }
            codecs.insert(rel.oid, codec);
        }
        return Ok(());
    }
    // Type and Origin messages carry nothing to produce, and a skipped
    // transaction is already in Kafka.
    let Some(txn) = txn.filter(|t| !t.skip) else {
        return Ok(());
    };
    let rels: Vec<u32> = match &msg {
        Message::Insert { relation, .. }
        | Message::Update { relation, .. }
        | Message::Delete { relation, .. } => {
            vec![*relation]
        }
        Message::Truncate { relations, .. } => relations.clone(),
        _ => return Ok(()),
    };
    for oid in rels.into_iter().filter(|oid| !outside.contains(oid)) {
        let codec = codecs
            .get(&oid)
            .ok_or(RunError::UnknownRelation { lsn, oid })?;
        if txn.seq == 0 {
            let (k, v) = output
                .transactions
                .begin(&txn.id(), txn.ts_ms)
                .map_err(|source| RunError::Encode {
                    table: transaction_topic(&output.config),
                    lsn,
                    source,
                })?;
            output.emit_transaction(&k, &v).await?;
        }
        txn.seq += 1;
        let order = txn.table_order.entry(oid).or_default();
        *order += 1;
        let src = SourceInfo {
            connector_name: &output.config.name,
            db: &output.db,
            position: Position {
                commit_lsn: txn.commit_lsn,
                seq: txn.seq,
            },
            lsn: lsn.0,
            tx_id: Some(txn.xid),
            ts_ms: txn.ts_ms,
            snapshot: "false",
            table_order: *order,
        };
        match &msg {
            Message::Insert { new, .. } => {
                output
                    .emit(codec, Op::Create, None, Some(&inputs(new)), &src)
                    .await?;
                snapshots.saw(codec, new, txn.xid);
            }
            Message::Update { old, new, .. } => {
                let new_in = inputs(new);
                // An outbox row's update is no event, key change or not.
                if codec.outbox {
                    output
                        .emit(codec, Op::Update, None, Some(&new_in), &src)
                        .await?;
                    continue;
                }
                // 'K' old tuples are only sent when the key changed.
                let key_change = match old {
                    Some(OldTuple::Key(_)) => true,
                    Some(OldTuple::Full(o)) => key_changed(codec, o, new),
                    None => false,
                };
                match (old, key_change) {
                    // The old key is deleted, the new one created.
                    (Some(o), true) => {
                        let old_in = inputs(o.values());
                        output
                            .emit(codec, Op::Delete, Some(&old_in), None, &src)
                            .await?;
                        output
                            .emit(codec, Op::Create, None, Some(&new_in), &src)
                            .await?;
                        snapshots.saw(codec, o.values(), txn.xid);
                    }
                    (Some(OldTuple::Full(o)), false) => {
                        let old_in = inputs(o);
                        output
                            .emit(codec, Op::Update, Some(&old_in), Some(&new_in), &src)
                            .await?;
                    }
                    _ => {
                        output
                            .emit(codec, Op::Update, None, Some(&new_in), &src)
                            .await?;
                    }
                }
                snapshots.saw(codec, new, txn.xid);
            }
            Message::Delete { old, .. } => {
                let old_in = inputs(old.values());
                output
                    .emit(codec, Op::Delete, Some(&old_in), None, &src)
                    .await?;
                snapshots.saw(codec, old.values(), txn.xid);
            }
            Message::Truncate { .. } => {
                output.emit(codec, Op::Truncate, None, None, &src).await?;
                snapshots.saw_truncate(&codec.table, txn.xid);
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_gives_up_at_its_limit_and_a_healthy_run_ends_it() {
        let s = Duration::from_secs;
        let t0 = Instant::now();
        // Never, however long it lasts: the backoff doubles to 30 s.
        let mut forever = Outage::new(0);
        let waits: Vec<Next> = (0..7)
            .map(|n| forever.failed(t0 + s(n * 40), t0 + s(n * 40 + 1)))
            .collect();
        assert_eq!(
            waits,
            [1, 2, 4, 8, 16, 30, 30].map(|n| Next::Wait(s(n))),
            "no give-up without a limit"
        );
        assert_eq!(forever.failed(t0, t0 + s(100_000)), Next::Wait(s(1)));

        // A limit of 10 s: attempts at 0, 1, 3 and 7 s, then one at the
        // limit itself (the wait cut to 3 s), then stop.
        let mut outage = Outage::new(10);
        assert_eq!(outage.failed(t0, t0), Next::Wait(s(1)));
        assert_eq!(outage.failed(t0 + s(1), t0 + s(1)), Next::Wait(s(2)));
        assert_eq!(outage.failed(t0 + s(3), t0 + s(3)), Next::Wait(s(4)));
        assert_eq!(outage.failed(t0 + s(7), t0 + s(7)), Next::Wait(s(3)));
        assert_eq!(outage.failed(t0 + s(10), t0 + s(10)), Next::GiveUp(s(10)));

        // An attempt that ran for a minute ended the outage: the count
        // starts again from its failure, and so does the backoff.
        let mut outage = Outage::new(10);
        assert_eq!(outage.failed(t0, t0 + s(1)), Next::Wait(s(1)));
        assert_eq!(outage.failed(t0 + s(2), t0 + s(5)), Next::Wait(s(2)));
        assert_eq!(outage.failed(t0 + s(5), t0 + s(70)), Next::Wait(s(1)));
        assert_eq!(outage.failed(t0 + s(71), t0 + s(72)), Next::Wait(s(2)));
        assert_eq!(outage.failed(t0 + s(74), t0 + s(74)), Next::Wait(s(4)));
        assert_eq!(outage.failed(t0 + s(78), t0 + s(78)), Next::Wait(s(2)));
        assert_eq!(outage.failed(t0 + s(80), t0 + s(80)), Next::GiveUp(s(10)));
    }

    #[test]
    fn a_reused_row_buffer_keeps_its_allocation() {
        let line = b"42".to_vec();
        let row = vec![Input::Text(&line); 5];
        let (ptr, capacity) = (row.as_ptr() as usize, row.capacity());
        let again: Vec<Input<'static>> = reuse(row);
        assert!(again.is_empty());
        assert_eq!(again.capacity(), capacity);
        assert_eq!(again.as_ptr() as usize, ptr, "reallocated");
    }

    #[test]
    fn staged_records_go_partition_by_partition_each_in_its_order() {
        let staged =
            |topic: Option<&str>, partition: Option<i32>, key: Option<&str>, n: u8| Staged {
                topic: topic.map(Arc::from),
                partition,
                key: key.map(|k| k.as_bytes().to_vec()),
                value: vec![n],
                headers: None,
            };
        // "t" has 3 partitions, where "a" goes to 1 and "b" to 2;
        // "other" has one.
        assert_eq!(
            (sink::partition_for(b"a", 3), sink::partition_for(b"b", 3)),
            (1, 2)
        );
        let mut stage = vec![
            staged(None, None, Some("b"), 0),
            staged(None, None, Some("a"), 1),
            staged(None, None, Some("b"), 2),
            staged(None, Some(0), Some("b"), 3),
            staged(Some("other"), None, Some("b"), 4),
            staged(None, None, None, 5),
            staged(None, None, Some("a"), 6),
        ];
        by_partition(&mut stage, "t", |topic| match topic {
            "t" => Some(3),
            "other" => Some(1),
            _ => None,
        });
        let order: Vec<u8> = stage.iter().map(|r| r.value[0]).collect();
        assert_eq!(order, [5, 3, 4, 1, 6, 0, 2]);
    }

    #[test]
    fn outages_restart_the_connector_and_everything_else_stops_it() {
        use pgwire_replication::PgWireError as W;
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let cases = [
            (
                RunError::Replication(W::Io(Arc::new(io))),
                Verdict::Retry("source"),
            ),
            (
                RunError::Replication(W::Server(
                    "terminating connection due to administrator command (SQLSTATE 57P01)".into(),
                )),
                Verdict::Retry("source"),
            ),
            (
                RunError::Replication(W::Server(
                    "replication slot \"s\" does not exist (SQLSTATE 42704)".into(),
                )),
                Verdict::Stop,
            ),
            (
                RunError::Replication(W::Auth("bad password".into())),
                Verdict::Stop,
            ),
            (
                RunError::Delivery("timed out".into()),
                Verdict::Retry("broker"),
            ),
            (
                RunError::Registry(ClientError::Unreachable("refused".into())),
                Verdict::Retry("registry"),
            ),
            (
                RunError::Registry(ClientError::Incompatible {
                    subject: "s".into(),
                    message: "m".into(),
                }),
                Verdict::Stop,
            ),
            (
                RunError::Slot(slot::SlotError::Lost { slot: "s".into() }),
                Verdict::Stop,
            ),
            (RunError::Config("x".into()), Verdict::Stop),
        ];
        for (error, verdict) in cases {
            assert_eq!(error.verdict(), verdict, "{error}");
        }
        assert_eq!(sqlstate_in("x (SQLSTATE 08006)"), Some("08006"));
        assert_eq!(sqlstate_in("no code"), None);
    }

    #[test]
    fn chunk_ranges_are_adjacent_and_open_at_both_ends() {
        assert_eq!(ranges(1, |i| i * 10), vec![(None, None)]);
        assert_eq!(
            ranges(3, |i| 100 + i * 10),
            vec![(None, Some(110)), (Some(110), Some(120)), (Some(120), None)]
        );
    }
}
