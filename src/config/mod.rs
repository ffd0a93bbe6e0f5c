//! Connector definitions: `connectors/NAME.toml`.
//!
//! Guarantee: a [`Config`] that exists has passed validation. Every error
//! names the field path (`source.tables[1]`, `kafka.properties."acks"`), and
//! no secret (passwords in DSNs, `*password*`/`*secret*` properties, the
//! registry password) is ever printed, including by `pgcdc validate`.
//!
//! ```text
//!  file text ──► toml::Value ──► ${VAR} interpolation ──► PGCDC__A__B overrides
//!                                                                │
//!        Config ◄── validate (pure, all errors at once) ◄── serde (unknown fields rejected)
//! ```
//!
//! Environment:
//! - `${VAR}` and `${VAR:-default}` inside any string value are replaced from
//!   the environment. A missing variable without a default is an error that
//!   names both the variable and the field.
//! - `PGCDC__SECTION__FIELD=value` overrides a field by path (double
//!   underscore separates levels, names are lower-cased). The value is read
//!   as a TOML value when it parses as one (`3`, `true`, `["a"]`), else as a
//!   string.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::secret::{is_sensitive_key, Dsn, Secret, REDACTED};

pub mod reference;

/// Prefix of override variables; the double underscore keeps single
/// underscores free for field names such as `topic_prefix`.
pub const OVERRIDE_PREFIX: &str = "PGCDC__";

/// Snapshot workers when unset: one per core on our reference machine.
pub const DEFAULT_SNAPSHOT_WORKERS: usize = 2;
/// Rows per snapshot chunk: large enough to amortise a query, small enough
/// that a chunk's COPY stream stays well under the producer queue.
pub const DEFAULT_SNAPSHOT_CHUNK_ROWS: u64 = 100_000;
/// Partitions for topics pgcdc creates.
pub const DEFAULT_PARTITIONS: i32 = 3;

/// One problem in a config file, with the path of the field it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: invalid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("{path}: {}", .errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid {
        path: String,
        errors: Vec<FieldError>,
    },
}

impl ConfigError {
    /// The individual field errors, for callers that print one per line.
    pub fn field_errors(&self) -> &[FieldError] {
        match self {
            ConfigError::Invalid { errors, .. } => errors,
            _ => &[],
        }
    }
}

/// A validated connector definition.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The pipeline's name; also the default consumer group and state key.
    pub name: String,
    pub source: SourceConfig,
    pub kafka: KafkaConfig,
    pub registry: RegistryConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<TargetConfig>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub read_models: BTreeMap<String, ReadModelConfig>,
    #[serde(default)]
    pub retention: RetentionConfig,
    #[serde(default)]
    pub dlq: DlqConfig,
    /// Captured tables whose rows are domain events (an event store or an
    /// outbox), keyed by `schema.table`: their inserts go to domain-event
    /// topics instead of a changelog topic.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outbox: BTreeMap<String, OutboxConfig>,
    /// Hot-key detection in the connector, on every changelog table.
    #[serde(default)]
    pub hot_keys: HotKeysConfig,
    /// Remedies for hot keys, per captured table (`schema.table`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub partitioning: BTreeMap<String, PartitioningConfig>,
}

/// The heavy-hitters sketch that finds each table's hottest keys: a
/// fixed number of counters per table (Space-Saving), whatever the number
/// of distinct keys. Hot keys are exported as `pgcdc_hot_key_rate`,
/// `pgcdc_hot_key_share` and `pgcdc_hot_key_salted`, and shown by
/// `pgcdc status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotKeysConfig {
    /// Counters per table; 0 turns detection off. A key whose share of a
    /// table's changes is above 1/capacity is always found.
    #[serde(default = "default_hot_capacity")]
    pub capacity: usize,
    /// Seconds per rate window (the rate is a sliding estimate over the
    /// last window).
    #[serde(default = "default_hot_window_secs")]
    pub window_secs: u64,
    /// A key is reported once its rate reaches this many changes per
    /// second.
    #[serde(default = "default_hot_report_per_sec")]
    pub report_per_sec: f64,
    /// Show reported keys as a fingerprint (`#` and 16 hex digits)
    /// instead of their primary key values, and tenants likewise on the
    /// materializer's per-tenant metrics.
    #[serde(default)]
    pub redact_keys: bool,
    /// A secret (16 bytes or more; `${ENV}` substitution) that keys the
    /// fingerprints: HMAC-SHA256 instead of a plain FNV-1a hash, so that a
    /// short or guessable key or tenant cannot be found by hashing
    /// candidates. Every process of a pipeline needs the same one for
    /// their fingerprints to agree.
    #[serde(default)]
    pub fingerprint_key: Option<Secret>,
}

impl Default for HotKeysConfig {
    fn default() -> Self {
        HotKeysConfig {
            capacity: default_hot_capacity(),
            window_secs: default_hot_window_secs(),
            report_per_sec: default_hot_report_per_sec(),
            redact_keys: false,
            fingerprint_key: None,
        }
    }
}

fn default_hot_capacity() -> usize {
    64
}
fn default_hot_window_secs() -> u64 {
    10
}
fn default_hot_report_per_sec() -> f64 {
    100.0
}

/// Partitioning remedies for one table. Salting: a salted key's events
/// spread over up to `salt_shards` partitions (its own and the next ones),
/// so that one key cannot saturate a partition. The cost: its changes are
/// no longer in one partition, so a consumer sees them in no particular
/// order (the materializer's position guard still applies each key's
/// newest change last); a salted delete sends its tombstone to every
/// shard's partition. Routing: declared keys and tenants go to a dedicated
/// topic of their own, which the materializer reads as the same table.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitioningConfig {
    /// Partitions a salted key's events spread over (2 to 64, at most the
    /// topic's partition count in effect); unset: no salting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt_shards: Option<u32>,
    /// Salt every key whose rate reaches this many changes per second (as
    /// the hot-key sketch measures it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt_above_per_sec: Option<f64>,
    /// Keys salted from their first change: a key in text form, or for a
    /// key of several columns a JSON array of their texts (`'["7","eu"]'`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub salt_keys: Vec<String>,
    /// The column naming a row's tenant. Its text goes with every event in
    /// the `pgcdc.tenant` header, which the materializer's
    /// `target.tenant_quota` schedules by. It must be in the primary key,
    /// or the table must be `REPLICA IDENTITY FULL`, so that a delete
    /// carries it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_column: Option<String>,
    /// Keys whose events go to the dedicated topic (written as in
    /// `salt_keys`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dedicated_keys: Vec<String>,
    /// Tenants (values of `tenant_column`) whose events go to the
    /// dedicated topic.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dedicated_tenants: Vec<String>,
    /// The dedicated topic; defaults to the table's topic plus
    /// `.dedicated`. It has the table's subjects, and the materializer
    /// reads it as the same table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedicated_topic: Option<String>,
}

impl PartitioningConfig {
    /// Whether some keys or tenants go to a dedicated topic.
    pub fn routes(&self) -> bool {
        !self.dedicated_keys.is_empty() || !self.dedicated_tenants.is_empty()
    }
}

/// Routing of an event store or outbox table (Debezium's outbox event
/// router, in the connector). Each insert (and each snapshot row) becomes
/// one record: key = the `key` column's text, value = the `payload`
/// column's text (JSON for jsonb), headers = the `headers` columns. Updates
/// and deletes are not events: they are counted and skipped.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    /// The column whose value picks the topic (Debezium's `route.by.field`).
    /// Route by the aggregate type to keep a stream in one topic, and so in
    /// order; routed by event type, a stream spans topics.
    #[serde(default = "default_outbox_route_by")]
    pub route_by: String,
    /// The topic; `{prefix}` is `kafka.topic_prefix`, `{route}` the route
    /// column's value.
    #[serde(default = "default_outbox_topic")]
    pub topic: String,
    /// The column that keys records (the stream or aggregate id), so that a
    /// stream stays in one partition, in order.
    #[serde(default = "default_outbox_key")]
    pub key: String,
    /// The column that becomes the record value.
    #[serde(default = "default_outbox_payload")]
    pub payload: String,
    /// Columns copied into record headers, under their own names (NULL
    /// gives a header without a value).
    #[serde(default = "default_outbox_headers")]
    pub headers: Vec<String>,
    /// The column that orders a stream's events in the table's snapshot.
    /// Default: the primary key, which is insertion order for an identity
    /// key; name a sequence or version column when the key is a uuid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_by: Option<String>,
}

fn default_outbox_route_by() -> String {
    "stream_type".into()
}
fn default_outbox_topic() -> String {
    "{prefix}.events.{route}".into()
}
fn default_outbox_key() -> String {
    "stream_id".into()
}
fn default_outbox_payload() -> String {
    "payload".into()
}
fn default_outbox_headers() -> Vec<String> {
    [
        "global_position",
        "event_id",
        "stream_type",
        "stream_id",
        "version",
        "event_type",
        "schema_version",
        "metadata",
        "recorded_at",
    ]
    .map(String::from)
    .to_vec()
}

impl OutboxConfig {
    /// The topic of an event whose route column holds `route`, or why that
    /// value cannot name a topic.
    pub fn topic_for(&self, prefix: &str, route: &str) -> Result<String, String> {
        let topic = self
            .topic
            .replace("{prefix}", prefix)
            .replace("{route}", route);
        if is_topic_name(&topic) {
            Ok(topic)
        } else {
            Err(format!(
                "the {} value does not make a valid Kafka topic name ({} characters of a-z, A-Z, 0-9, '.', '_', '-' at most 200)",
                self.route_by,
                topic.len()
            ))
        }
    }
}

/// The dead-letter workflow (`pgcdc dlq`, and what `pgcdc materialize`
/// does with messages it cannot apply).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlqConfig {
    /// Attempts at a batch while the target database is unavailable before
    /// its messages are quarantined as `sink_unavailable` and the
    /// partitions move on; 0 retries for ever (nothing is quarantined for
    /// an outage).
    #[serde(default = "default_dlq_max_attempts")]
    pub max_attempts: u32,
    /// Seconds between the materializer's rounds of the workflow: record
    /// new arrivals in `pgcdc_dlq`, apply the policies, export the health
    /// metrics; 0 disables them.
    #[serde(default = "default_dlq_check_secs")]
    pub check_interval_secs: u64,
    #[serde(default)]
    pub health: DlqHealthConfig,
    /// Named policies; the actor of what one does is `auto:<name>`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub policies: BTreeMap<String, DlqPolicyConfig>,
    /// Safe mappings by captured table (`schema.table`), used by the
    /// replay's schema check when a message's writer schema cannot be read
    /// as the current one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mappings: BTreeMap<String, DlqMappingConfig>,
}

impl Default for DlqConfig {
    fn default() -> Self {
        DlqConfig {
            max_attempts: default_dlq_max_attempts(),
            check_interval_secs: default_dlq_check_secs(),
            health: DlqHealthConfig::default(),
            policies: BTreeMap::new(),
            mappings: BTreeMap::new(),
        }
    }
}

/// About two minutes of backoff (0.4 s doubling to 30 s).
fn default_dlq_max_attempts() -> u32 {
    10
}
fn default_dlq_check_secs() -> u64 {
    30
}

/// When `pgcdc dlq stats` and the metrics warn.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlqHealthConfig {
    /// Warn when the last hour's arrivals exceed this many times the
    /// baseline (an EWMA of earlier hours).
    #[serde(default = "default_arrival_factor")]
    pub arrival_factor: f64,
    /// ... and are at least this many (a quiet queue is not noisy).
    #[serde(default = "default_min_arrivals")]
    pub min_arrivals: u64,
    /// Weight of each new hour in the baseline (0 < alpha <= 1).
    #[serde(default = "default_baseline_alpha")]
    pub baseline_alpha: f64,
    /// Warn when a message has waited longer than this span without being
    /// replayed or archived (the slow leak that depth does not show).
    #[serde(default = "default_max_oldest_age")]
    pub max_oldest_age: String,
}

impl Default for DlqHealthConfig {
    fn default() -> Self {
        DlqHealthConfig {
            arrival_factor: default_arrival_factor(),
            min_arrivals: default_min_arrivals(),
            baseline_alpha: default_baseline_alpha(),
            max_oldest_age: default_max_oldest_age(),
        }
    }
}

fn default_arrival_factor() -> f64 {
    3.0
}
fn default_min_arrivals() -> u64 {
    5
}
fn default_baseline_alpha() -> f64 {
    0.2
}
fn default_max_oldest_age() -> String {
    "24h".to_string()
}

/// What a policy does without a person's `approve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DlqAction {
    /// Replay (both checks still run) messages of `classes` whose first
    /// failure lies in the window `[from, until)`.
    Replay,
    /// Archive messages of `classes` (every class when empty) left
    /// unaddressed for `after`.
    Archive,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlqPolicyConfig {
    /// `replay` (messages of `classes` first failed in `[from, until)`;
    /// both replay checks still run) or `archive` (left unaddressed for
    /// `after`).
    pub action: DlqAction,
    /// Failure classes the policy covers.
    #[serde(default)]
    pub classes: Vec<String>,
    /// Replay: start of the window (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Replay: end of the window, exclusive (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// Archive: a span (`30d`) after the message's quarantine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
}

/// How an old writer's record is turned into what the reader needs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlqMappingConfig {
    /// The writer's column name → the column it became (source column
    /// names, not their Avro spellings).
    #[serde(default)]
    pub renames: BTreeMap<String, String>,
    /// Column → the value (as Postgres text) for records whose writer
    /// did not have it.
    #[serde(default)]
    pub defaults: BTreeMap<String, String>,
}

/// Rebuild-reach checks that `pgcdc materialize` runs while it works.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Seconds between checks of every read model's rebuild reach and of
    /// the slot (metrics, and a warning when a `require_reach` is not
    /// met); 0 disables them.
    #[serde(default = "default_retention_check_secs")]
    pub check_interval_secs: u64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            check_interval_secs: DEFAULT_RETENTION_CHECK_SECS,
        }
    }
}

/// Retention moves in hours or days; five minutes is fresh enough and
/// costs a few metadata requests.
pub const DEFAULT_RETENTION_CHECK_SECS: u64 = 300;
fn default_retention_check_secs() -> u64 {
    DEFAULT_RETENTION_CHECK_SECS
}

/// The source Postgres and what to capture from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Connection string of the source database.
    pub url: Dsn,
    /// Logical replication slot (pgoutput).
    pub slot: String,
    /// Publication covering `tables`.
    pub publication: String,
    /// Captured tables as `schema.table`.
    pub tables: Vec<String>,
    /// Columns left out of a captured table's events, per `schema.table`
    /// (Debezium's `column.exclude.list`): their values never reach Kafka,
    /// the registry's schemas, the dead-letter topic or the mirrors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub columns: BTreeMap<String, ColumnsConfig>,
    /// The initial snapshot, and chunking of `pgcdc snapshot`.
    #[serde(default)]
    pub snapshot: SnapshotConfig,
    /// Seconds between heartbeats (`pg_logical_emit_message`), which let
    /// the slot advance while the captured tables are idle; 0 disables.
    #[serde(default = "default_heartbeat_secs")]
    pub heartbeat_interval_secs: u64,
    /// Warn when the confirmed LSN has not moved for this many seconds
    /// while WAL grows.
    #[serde(default = "default_stall_secs")]
    pub stall_warning_secs: u64,
    /// Alert (`slot_wal_at_risk`) when the slot retains more WAL than this
    /// many bytes (current LSN minus `restart_lsn`).
    #[serde(default = "default_retained_wal_warning_bytes")]
    pub retained_wal_warning_bytes: u64,
    /// Stop `pgcdc run` (exit code 1, naming the last error) once an outage
    /// of Postgres, the broker or the registry has lasted this many
    /// seconds, counted from its first failed attempt; an attempt that ran
    /// for a minute ends the outage. 0 retries for ever.
    #[serde(default)]
    pub give_up_after_secs: u64,
}

/// One table's entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColumnsConfig {
    /// Column names, as the table spells them (case matters), whose values
    /// pgcdc never reads into an event, in the stream and in snapshots. A
    /// column of the table's key cannot be left out; a name the table does
    /// not have stops the connector at start-up.
    pub exclude: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotMode {
    /// Snapshot only when the slot is created.
    #[default]
    Initial,
    Never,
    Always,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotConfig {
    /// `initial`: snapshot when the slot is created; `never`: stream only;
    /// `always`: drop the slot and snapshot at every start.
    #[serde(default)]
    pub mode: SnapshotMode,
    /// Connections copying chunks in parallel, all in the slot's exported
    /// snapshot (1 to 64).
    #[serde(default = "default_snapshot_workers")]
    pub workers: usize,
    /// Rows per chunk of the initial snapshot: a large table is cut into
    /// key or block ranges of about this many rows.
    #[serde(default = "default_snapshot_chunk_rows")]
    pub chunk_rows: u64,
    /// Rows per chunk of an incremental snapshot (`pgcdc snapshot`): each
    /// chunk is read between two watermarks while streaming goes on.
    #[serde(default = "default_incremental_chunk_rows")]
    pub incremental_chunk_rows: u64,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        Self {
            mode: SnapshotMode::default(),
            workers: DEFAULT_SNAPSHOT_WORKERS,
            chunk_rows: DEFAULT_SNAPSHOT_CHUNK_ROWS,
            incremental_chunk_rows: DEFAULT_INCREMENTAL_CHUNK_ROWS,
        }
    }
}

/// Rows per incremental chunk: held in memory until the chunk's high
/// watermark arrives, and a key changed inside the window drops its row,
/// so small enough to keep the window short.
pub const DEFAULT_INCREMENTAL_CHUNK_ROWS: u64 = 4096;
fn default_incremental_chunk_rows() -> u64 {
    DEFAULT_INCREMENTAL_CHUNK_ROWS
}

/// Heartbeats every 10 s keep an idle slot's lag near the WAL written in
/// that time.
pub const DEFAULT_HEARTBEAT_SECS: u64 = 10;
/// Five minutes without progress while WAL grows is worth an operator's look.
pub const DEFAULT_STALL_SECS: u64 = 300;

fn default_heartbeat_secs() -> u64 {
    DEFAULT_HEARTBEAT_SECS
}
fn default_stall_secs() -> u64 {
    DEFAULT_STALL_SECS
}
/// 1 GiB: far above what a healthy slot keeps between heartbeats, far
/// below a typical `max_slot_wal_keep_size` or free disk.
pub const DEFAULT_RETAINED_WAL_WARNING_BYTES: u64 = 1 << 30;
fn default_retained_wal_warning_bytes() -> u64 {
    DEFAULT_RETAINED_WAL_WARNING_BYTES
}
fn default_snapshot_workers() -> usize {
    DEFAULT_SNAPSHOT_WORKERS
}
fn default_snapshot_chunk_rows() -> u64 {
    DEFAULT_SNAPSHOT_CHUNK_ROWS
}
/// librdkafka's own default `message.max.bytes`.
/// The least `kafka.max_message_bytes` (dead-letter records need room).
pub const MIN_MESSAGE_BYTES: usize = 16_384;

fn default_max_message_bytes() -> usize {
    1_000_000
}
fn default_partitions() -> i32 {
    DEFAULT_PARTITIONS
}
fn default_replication_factor() -> i32 {
    1
}
/// Groups source transactions for a tenth of a second: one Kafka commit
/// (a round trip to the transaction coordinator) per group, not per row.
pub const DEFAULT_TRANSACTION_INTERVAL_MS: u64 = 100;
fn default_transaction_interval_ms() -> u64 {
    DEFAULT_TRANSACTION_INTERVAL_MS
}

/// The Kafka cluster, and the changelog topics pgcdc creates in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Topics are `<topic_prefix>.<schema>.<table>`.
    pub topic_prefix: String,
    /// Partitions of the topics pgcdc creates (existing topics are kept
    /// as they are; keys hash to partitions, so changing it remaps keys).
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    /// Replication factor of the topics pgcdc creates.
    #[serde(default = "default_replication_factor")]
    pub replication_factor: i32,
    /// `cleanup.policy` of created changelog topics.
    #[serde(default)]
    pub cleanup_policy: CleanupPolicy,
    /// Opt-in exactly-once into Kafka: source transactions are produced
    /// inside Kafka transactions together with the committed position in
    /// `<prefix>.offsets`. Needs a broker with transactions.
    #[serde(default)]
    pub exactly_once: bool,
    /// In exactly-once mode, source transactions committed within this
    /// many milliseconds share one Kafka transaction.
    #[serde(default = "default_transaction_interval_ms")]
    pub transaction_interval_ms: u64,
    /// The largest record (key and value) the broker takes; a changelog
    /// event over it is quarantined as `oversized` (in parts) instead of
    /// stopping the connector. A topic the connector writes whose
    /// `max.message.bytes` is smaller lowers it at start-up (less 1 KiB of
    /// framing), with a warning.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Passed through to librdkafka (SASL, SSL, compression, ...).
    #[serde(default)]
    pub properties: Properties,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CleanupPolicy {
    #[default]
    #[serde(rename = "delete")]
    Delete,
    #[serde(rename = "compact")]
    Compact,
    #[serde(rename = "compact,delete")]
    CompactDelete,
}

impl CleanupPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            CleanupPolicy::Delete => "delete",
            CleanupPolicy::Compact => "compact",
            CleanupPolicy::CompactDelete => "compact,delete",
        }
    }
}

/// librdkafka properties; values of sensitive keys never print.
#[derive(Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct Properties(pub BTreeMap<String, String>);

impl Properties {
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter()
    }
}

impl fmt::Debug for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| {
                let shown = if is_sensitive_key(k) { REDACTED } else { v };
                (k, shown)
            }))
            .finish()
    }
}

impl Serialize for Properties {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            let shown = if is_sensitive_key(k) {
                REDACTED
            } else {
                v.as_str()
            };
            map.serialize_entry(k, shown)?;
        }
        map.end()
    }
}

/// Properties pgcdc sets itself because its delivery guarantee depends on
/// them; overriding them would silently weaken it.
pub const MANAGED_KAFKA_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "transactional.id",
    "isolation.level",
    // Acknowledgements are counted from delivery reports of every message.
    "delivery.report.only.error",
];

/// The Confluent-compatible schema registry (`pgcdc registry`, or
/// Confluent's own).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// Base URL of a Confluent-compatible schema registry; a password in
    /// its userinfo never prints.
    pub url: Dsn,
    /// HTTP basic-auth user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// HTTP basic-auth password (use `${VAR}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
}

/// The database that holds mirror tables, read models and pgcdc state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// Connection string of the target database.
    pub url: Dsn,
    /// Schema of the mirror tables.
    #[serde(default = "default_mirror_schema")]
    pub mirror_schema: String,
    /// Consumer group id; defaults to `pgcdc-<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_id: Option<String>,
    /// Changes applied per database transaction, at most.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// How long a deleted key's tombstone position is kept: at least the
    /// longest time in which Kafka can still redeliver a change, plus
    /// margin.
    #[serde(default = "default_redelivery_window_hours")]
    pub redelivery_window_hours: u64,
    /// The fast dedup tier in front of the durable positions.
    #[serde(default)]
    pub dedup: DedupConfig,
    /// Fairness between tenants (the `pgcdc.tenant` header that
    /// `partitioning.<table>.tenant_column` sets); unset: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_quota: Option<TenantQuotaConfig>,
    /// Tenants named on the per-tenant metrics (`pgcdc_tenant_*`), the
    /// first seen; later ones are summed under `tenant="_other"`, so that
    /// the number of series stays bounded.
    #[serde(default = "default_tenant_labels")]
    pub tenant_labels: usize,
    /// Stop `pgcdc materialize` (exit code 1, naming the last error) once
    /// the target database has not been reachable at start-up for this
    /// many seconds. 0 waits for ever. Once running, an outage of the
    /// target quarantines batches after `dlq.max_attempts` instead.
    #[serde(default)]
    pub give_up_after_secs: u64,
}

/// A token bucket per tenant in the materializer's batch formation. A
/// tenant's records beyond its bucket wait in memory, so that the records
/// behind them (other tenants') go first; room left in a batch goes to the
/// waiting ones anyway, so a quota never idles the materializer. Offsets
/// are committed only up to a partition's first waiting record.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantQuotaConfig {
    /// Records per second each tenant may put in batches ahead of others.
    pub rate_per_sec: f64,
    /// Records a tenant may take at once; defaults to one second's worth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<f64>,
    /// Records waiting at most, in all; at this many, the partitions that
    /// hold waiting records are paused until half have been applied.
    #[serde(default = "default_max_deferred")]
    pub max_deferred: usize,
    /// Rates of particular tenants, instead of `rate_per_sec`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, f64>,
}

fn default_max_deferred() -> usize {
    100_000
}

/// The fast dedup tier: an in-process LRU, or Redis shared by every
/// instance, with an optional Bloom filter in front of the durable look-up.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedupConfig {
    /// Keys in the in-process LRU; 0 disables it. Unused with Redis.
    #[serde(default = "default_dedup_cache_keys")]
    pub cache_keys: usize,
    /// How long a fast-tier entry lives (in-process and Redis).
    #[serde(default = "default_dedup_ttl_seconds")]
    pub ttl_seconds: u64,
    /// Expected distinct keys for the Bloom filter; 0 disables it.
    #[serde(default)]
    pub bloom_keys: usize,
    /// Redis as the shared fast tier, instead of the in-process LRU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis_url: Option<Dsn>,
    /// What an unreachable Redis does; required with `redis_url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_redis_failure: Option<RedisFailure>,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            cache_keys: DEFAULT_DEDUP_CACHE_KEYS,
            ttl_seconds: DEFAULT_DEDUP_TTL_SECONDS,
            bloom_keys: 0,
            redis_url: None,
            on_redis_failure: None,
        }
    }
}

/// What the materializer does while Redis is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RedisFailure {
    /// Stop applying (and retry Redis with backoff) until it is back.
    FailClosed,
    /// Go on with the durable tier only, and use Redis again once it is back.
    FailOpen,
}

/// About 10 MB of keys and positions.
pub const DEFAULT_DEDUP_CACHE_KEYS: usize = 100_000;
fn default_dedup_cache_keys() -> usize {
    DEFAULT_DEDUP_CACHE_KEYS
}
/// One day: long enough to cover restarts and rebalances, short enough
/// that Redis does not grow with every key ever seen.
pub const DEFAULT_DEDUP_TTL_SECONDS: u64 = 24 * 3600;
fn default_dedup_ttl_seconds() -> u64 {
    DEFAULT_DEDUP_TTL_SECONDS
}

/// 500 changes per transaction: large enough to amortize the commit,
/// small enough to keep locks short.
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Kafka's default `retention.ms` (7 days) plus one day of margin.
pub const DEFAULT_REDELIVERY_WINDOW_HOURS: u64 = 8 * 24;
fn default_batch_size() -> usize {
    DEFAULT_BATCH_SIZE
}
fn default_tenant_labels() -> usize {
    1000
}
fn default_redelivery_window_hours() -> u64 {
    DEFAULT_REDELIVERY_WINDOW_HOURS
}

fn default_mirror_schema() -> String {
    "mirror".to_string()
}

/// A denormalized view kept in the target database.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadModelConfig {
    /// Target table, `schema.table`.
    pub table: String,
    /// The target table's key columns (its primary key): one, or several
    /// for a composite key.
    pub key: Vec<String>,
    /// SQL over the mirror tables returning the rows for the keys in `$1`
    /// (an array of the key's values); for a composite key, `$1`, `$2`,
    /// ... are arrays of each key column's values in `key` order, the
    /// same element of each making one key (`WHERE (a, b) IN (SELECT *
    /// FROM unnest($1::int[], $2::text[]))`).
    pub query: String,
    /// How a change to each source table maps to affected keys.
    pub sources: Vec<ReadModelSource>,
    /// How far back this read model must stay rebuildable from the
    /// retained log: a span (`90d`), a timestamp, an LSN, or `current`.
    /// `pgcdc retention` exits 2 and `pgcdc materialize` warns when it is
    /// not met.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub require_reach: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadModelSource {
    /// Captured table, `schema.table`.
    pub table: String,
    /// The changed row's columns that are the view key, in `key` order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_columns: Option<Vec<String>>,
    /// SQL over the mirror tables returning the affected view keys for the
    /// changed row's primary key: `$1` is its first column, `$2` its
    /// second, ... (the query takes as many as it needs). Each row of the
    /// result is one view key, a column per key column in `key` order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affected_keys: Option<String>,
}

impl Config {
    /// Reads, interpolates, overrides, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::from_toml(&text, &path.display().to_string(), &env)
    }

    /// Parses and validates config text against an explicit environment.
    pub fn from_toml(
        text: &str,
        origin: &str,
        env: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        // toml's full rendering quotes the offending line, which may hold
        // a secret: its message and the place only.
        let mut value: toml::Value = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: origin.to_string(),
            message: match e.span() {
                Some(span) => {
                    let before = &text[..span.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                    format!("line {line}, column {column}: {}", e.message().trim_end())
                }
                None => e.message().trim_end().to_string(),
            },
        })?;
        let invalid = |errors| ConfigError::Invalid {
            path: origin.to_string(),
            errors,
        };
        let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let mut errors = Vec::new();
        interpolate(&mut value, "", &lookup, &mut errors);
        let overrides = apply_overrides(&mut value, env, &mut errors);
        if !errors.is_empty() {
            return Err(invalid(errors));
        }
        // An override is read as TOML unless it replaces text or may hold
        // a secret; where that guess meets the wrong type (`1234` for an
        // unset `registry.username`, `12` over a file's wrong `"12"`), the
        // other reading is tried once, and the first error stands if
        // that fails too.
        let first = serde_path_to_error::deserialize::<_, Config>(value.clone());
        let retried = match &first {
            // The last override of a path is the one in effect.
            Err(e) => overrides
                .iter()
                .rev()
                .find(|o| o.parts.join(".") == e.path().to_string())
                .and_then(|o| {
                    let mut again = value.clone();
                    o.set(&mut again, o.other_reading()?).ok()?;
                    Some(serde_path_to_error::deserialize::<_, Config>(again))
                }),
            Ok(_) => None,
        };
        // A retry that mended its field but failed at another reports that one.
        let outcome = match (first, retried) {
            (Err(e), Some(Err(again))) if again.path().to_string() != e.path().to_string() => {
                Err(again)
            }
            (_, Some(Ok(config))) => Ok(config),
            (first, _) => first,
        };
        let mut config: Config = outcome.map_err(|e| {
            let path = e.path().to_string();
            // serde quotes the value it refused ("invalid type: integer
            // `1234`, expected a string"), which may be a secret.
            let message = if holds_secret(&path) {
                "must be a string (the value is not shown: it may be a secret)".to_string()
            } else {
                e.into_inner().to_string()
            };
            invalid(vec![FieldError {
                path: if path == "." { String::new() } else { path },
                message,
            }])
        })?;
        let mut errors = config.canonicalize_tables();
        errors.extend(config.validate());
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(invalid(errors))
        }
    }

    /// Pure validation: no I/O. Returns every problem found.
    pub fn validate(&self) -> Vec<FieldError> {
        let mut v = Validator::default();
        v.check(
            is_simple_name(&self.name),
            "name",
            "must be 1-63 characters of a-z, 0-9, '_' or '-'",
        );

        let src = &self.source;
        v.check_dsn(&src.url, "source.url");
        v.check(
            is_identifier(&src.slot),
            "source.slot",
            "must be 1-63 characters of a-z, 0-9 or '_' (Postgres slot name rules)",
        );
        v.check(
            is_identifier(&src.publication),
            "source.publication",
            "must be 1-63 characters of a-z, 0-9 or '_'",
        );
        v.check(
            !src.tables.is_empty(),
            "source.tables",
            "must list at least one table",
        );
        let mut seen = BTreeSet::new();
        let mut topics: BTreeMap<String, &str> = BTreeMap::new();
        for (i, t) in src.tables.iter().enumerate() {
            let path = format!("source.tables[{i}]");
            match split_table(t) {
                None => v.push(
                    &path,
                    format!(
                        "'{t}' must be written as schema.table; double-quote a name \
                         holding '.' or '\"' (\"My Schema\".\"Order.Items\", \"\" for a quote)"
                    ),
                ),
                Some((schema, table)) if schema.len().max(table.len()) > MAX_IDENTIFIER_BYTES => v
                    .push(
                        &path,
                        format!(
                            "'{t}' has a name over Postgres' {MAX_IDENTIFIER_BYTES}-byte limit"
                        ),
                    ),
                Some(_) if !seen.insert(t.as_str()) => {
                    v.push(&path, format!("'{t}' is listed twice"))
                }
                Some(_) if self.outbox.contains_key(t) => {}
                Some(_) => {
                    let topic = self.topic_for(t);
                    // Kafka treats '.' and '_' alike in topic names.
                    match topics.insert(topic.replace('.', "_"), t) {
                        Some(other) => v.push(
                            &path,
                            format!("'{t}' and '{other}' would both write topic {topic}"),
                        ),
                        None if topic.len() > MAX_TOPIC_LEN => v.push(
                            &path,
                            format!("topic {topic} is over Kafka's {MAX_TOPIC_LEN} characters"),
                        ),
                        None => {}
                    }
                }
            }
        }
        v.check(
            (1..=64).contains(&src.snapshot.workers),
            "source.snapshot.workers",
            "must be between 1 and 64",
        );
        v.check(
            src.stall_warning_secs > 0,
            "source.stall_warning_secs",
            "must be greater than 0",
        );
        v.check(
            src.retained_wal_warning_bytes > 0,
            "source.retained_wal_warning_bytes",
            "must be greater than 0",
        );
        v.check(
            src.snapshot.chunk_rows > 0,
            "source.snapshot.chunk_rows",
            "must be greater than 0",
        );
        v.check(
            (1..=1_000_000).contains(&src.snapshot.incremental_chunk_rows),
            "source.snapshot.incremental_chunk_rows",
            "must be between 1 and 1000000",
        );

        let k = &self.kafka;
        v.check(
            !k.brokers.trim().is_empty(),
            "kafka.brokers",
            "must not be empty",
        );
        v.check(
            is_topic_name(&k.topic_prefix),
            "kafka.topic_prefix",
            "must be 1-200 characters of a-z, A-Z, 0-9, '.', '_' or '-'",
        );
        v.check(k.partitions >= 1, "kafka.partitions", "must be at least 1");
        v.check(
            (1..=60_000).contains(&k.transaction_interval_ms),
            "kafka.transaction_interval_ms",
            "must be between 1 and 60000",
        );
        v.check(
            (MIN_MESSAGE_BYTES..=1_000_000_000).contains(&k.max_message_bytes),
            "kafka.max_message_bytes",
            "must be between 16384 and 1000000000",
        );
        v.check(
            k.replication_factor >= 1,
            "kafka.replication_factor",
            "must be at least 1",
        );
        for key in k.properties.0.keys() {
            if MANAGED_KAFKA_PROPERTIES.contains(&key.as_str()) {
                v.push(
                    &format!("kafka.properties.\"{key}\""),
                    "is managed by pgcdc (its delivery guarantee depends on it); use kafka.brokers for the bootstrap servers".to_string(),
                );
            }
        }

        let r = &self.registry;
        v.check(
            r.url.expose().starts_with("http://") || r.url.expose().starts_with("https://"),
            "registry.url",
            "must be an http:// or https:// URL",
        );
        v.check(
            r.password.is_none() || r.username.is_some(),
            "registry.password",
            "is set but registry.username is not",
        );

        if let Some(t) = &self.target {
            v.check_dsn(&t.url, "target.url");
            // Mirror names must be distinct, and whole: Postgres cuts longer ones.
            let tables: Vec<String> = self
                .changelog_tables()
                .filter(|t| split_table(t).is_some())
                .cloned()
                .collect();
            let names = crate::materialize::mirror::mirror_names(&tables);
            // Outbox tables have no mirror: the index is source.tables'.
            let path = |table: &str| {
                self.source
                    .tables
                    .iter()
                    .position(|t| t == table)
                    .map_or_else(
                        || "source.tables".to_string(),
                        |j| format!("source.tables[{j}]"),
                    )
            };
            for (i, (table, mirror)) in tables.iter().zip(&names).enumerate() {
                if let Some(other) = tables[..i].iter().zip(&names).find(|(_, m)| *m == mirror) {
                    v.push(
                        &path(table),
                        format!(
                            "'{table}' and '{}' would both be mirrored as {}.{mirror}",
                            other.0, t.mirror_schema
                        ),
                    );
                } else if mirror.len() > MAX_IDENTIFIER_BYTES {
                    v.push(
                        &path(table),
                        format!(
                            "'{table}' would be mirrored as {mirror}, over Postgres' {MAX_IDENTIFIER_BYTES}-byte limit"
                        ),
                    );
                }
            }
            v.check(
                is_identifier(&t.mirror_schema),
                "target.mirror_schema",
                "must be 1-63 characters of a-z, 0-9 or '_'",
            );
            v.check(
                (1..=100_000).contains(&t.batch_size),
                "target.batch_size",
                "must be between 1 and 100000",
            );
            v.check(
                t.redelivery_window_hours >= 1,
                "target.redelivery_window_hours",
                "must be at least 1",
            );
            let d = &t.dedup;
            v.check(
                d.ttl_seconds >= 1,
                "target.dedup.ttl_seconds",
                "must be at least 1",
            );
            v.check(
                d.bloom_keys <= 1_000_000_000,
                "target.dedup.bloom_keys",
                "must be at most 1000000000",
            );
            if let Some(url) = &d.redis_url {
                if let Err(e) = redis::Client::open(url.expose()) {
                    // Parse errors name the problem, not the URL.
                    v.push(
                        "target.dedup.redis_url",
                        format!("is not a valid Redis URL ({:?})", e.kind()),
                    );
                }
                v.check(
                    d.on_redis_failure.is_some(),
                    "target.dedup.on_redis_failure",
                    "is required with redis_url: fail_closed (stop while Redis is down) or fail_open (go on with the durable tier only)",
                );
            } else {
                v.check(
                    d.on_redis_failure.is_none(),
                    "target.dedup.on_redis_failure",
                    "is set but target.dedup.redis_url is not",
                );
            }
        }
        if !self.read_models.is_empty() && self.target.is_none() {
            v.push(
                "target",
                "is required when read_models are declared".to_string(),
            );
        }
        for (name, rm) in &self.read_models {
            let base = format!("read_models.{name}");
            v.check(is_identifier(name), &base, "name must be a-z, 0-9 or '_'");
            if split_table(&rm.table).is_none() {
                v.push(
                    &format!("{base}.table"),
                    "must be written as schema.table".into(),
                );
            }
            v.check(
                !rm.key.is_empty(),
                &format!("{base}.key"),
                "must name at least one column",
            );
            v.check(
                rm.key
                    .iter()
                    .collect::<std::collections::HashSet<_>>()
                    .len()
                    == rm.key.len(),
                &format!("{base}.key"),
                "names a column twice",
            );
            v.check(
                !rm.query.trim().is_empty(),
                &format!("{base}.query"),
                "must not be empty",
            );
            v.check(
                !rm.sources.is_empty(),
                &format!("{base}.sources"),
                "must map at least one source table",
            );
            if let Some(Err(e)) = rm
                .require_reach
                .as_deref()
                .map(crate::retention::reach::Requirement::parse)
            {
                v.push(&format!("{base}.require_reach"), e);
            }
            for (i, s) in rm.sources.iter().enumerate() {
                let sp = format!("{base}.sources[{i}]");
                if !src.tables.contains(&s.table) {
                    v.push(
                        &format!("{sp}.table"),
                        format!("'{}' is not one of source.tables", s.table),
                    );
                }
                match (&s.key_columns, &s.affected_keys) {
                    (Some(cols), None) if cols.len() != rm.key.len() => v.push(
                        &format!("{sp}.key_columns"),
                        format!(
                            "has {} columns but the key has {}",
                            cols.len(),
                            rm.key.len()
                        ),
                    ),
                    (Some(_), None) | (None, Some(_)) => {}
                    _ => v.push(
                        &sp,
                        "set exactly one of key_columns or affected_keys".into(),
                    ),
                }
            }
        }
        self.validate_dlq(&mut v);
        self.validate_partitioning(&mut v);
        self.validate_columns(&mut v);
        v.errors
    }

    fn validate_columns(&self, v: &mut Validator) {
        for (table, c) in &self.source.columns {
            let base = format!("source.columns.\"{table}\"");
            if !self.source.tables.contains(table) {
                v.push(&base, format!("'{table}' is not one of source.tables"));
            } else if self.outbox.contains_key(table) {
                v.push(
                    &base,
                    format!("'{table}' is an outbox table; choose its event's columns with outbox.\"{table}\".headers"),
                );
            }
            v.check(
                !c.exclude.is_empty(),
                &format!("{base}.exclude"),
                "must name at least one column",
            );
            let tenant = self
                .partitioning
                .get(table)
                .and_then(|p| p.tenant_column.as_deref());
            for (i, name) in c.exclude.iter().enumerate() {
                let field = format!("{base}.exclude[{i}]");
                if name.is_empty() {
                    v.push(&field, "must not be empty".into());
                } else if c.exclude[..i].contains(name) {
                    v.push(&field, format!("names {name} a second time"));
                } else if tenant == Some(name.as_str()) {
                    v.push(
                        &field,
                        format!("{name} is partitioning.\"{table}\".tenant_column, which every event must carry"),
                    );
                }
            }
        }
    }

    /// The columns of `table` (`schema.table`) left out of its events.
    pub fn excluded_columns(&self, table: &str) -> &[String] {
        self.source
            .columns
            .get(table)
            .map_or(&[], |c| c.exclude.as_slice())
    }

    fn validate_partitioning(&self, v: &mut Validator) {
        let h = &self.hot_keys;
        v.check(
            h.capacity <= 4096,
            "hot_keys.capacity",
            "must be at most 4096 (0 turns detection off)",
        );
        v.check(
            h.window_secs >= 1 && h.window_secs <= 3600,
            "hot_keys.window_secs",
            "must be 1 to 3600",
        );
        v.check(
            h.report_per_sec.is_finite() && h.report_per_sec > 0.0,
            "hot_keys.report_per_sec",
            "must be a number greater than 0",
        );
        if let Some(key) = &h.fingerprint_key {
            v.check(
                key.expose().len() >= crate::partitioning::FINGERPRINT_KEY_MIN,
                "hot_keys.fingerprint_key",
                "must be at least 16 bytes (a random secret: `openssl rand -hex 16` gives 32)",
            );
        }
        for (table, p) in &self.partitioning {
            let base = format!("partitioning.\"{table}\"");
            if !self.source.tables.contains(table) {
                v.push(&base, format!("'{table}' is not one of source.tables"));
            } else if self.outbox.contains_key(table) {
                v.push(
                    &base,
                    format!("'{table}' is an outbox table; its events are keyed by stream"),
                );
            }
            match p.salt_shards {
                Some(k) => {
                    v.check(
                        (2..=64).contains(&k),
                        &format!("{base}.salt_shards"),
                        "must be 2 to 64",
                    );
                    if p.salt_above_per_sec.is_none() && p.salt_keys.is_empty() {
                        v.push(
                            &base,
                            "salts nothing: set salt_above_per_sec, salt_keys or both".into(),
                        );
                    }
                }
                None => {
                    if p.salt_above_per_sec.is_some() || !p.salt_keys.is_empty() {
                        v.push(
                            &format!("{base}.salt_shards"),
                            "is required with salt_above_per_sec or salt_keys".into(),
                        );
                    } else if p.tenant_column.is_none() && !p.routes() {
                        v.push(
                            &base,
                            "does nothing: set salt_shards, tenant_column or dedicated_keys/dedicated_tenants".into(),
                        );
                    }
                }
            }
            if let Some(rate) = p.salt_above_per_sec {
                v.check(
                    rate.is_finite() && rate > 0.0,
                    &format!("{base}.salt_above_per_sec"),
                    "must be a number greater than 0",
                );
                v.check(
                    h.capacity > 0,
                    &format!("{base}.salt_above_per_sec"),
                    "needs hot-key detection, which hot_keys.capacity = 0 turns off",
                );
            }
            for (field, list) in [
                ("salt_keys", &p.salt_keys),
                ("dedicated_keys", &p.dedicated_keys),
                ("dedicated_tenants", &p.dedicated_tenants),
            ] {
                for (i, k) in list.iter().enumerate() {
                    v.check(
                        !k.is_empty(),
                        &format!("{base}.{field}[{i}]"),
                        "must not be empty",
                    );
                }
            }
            if let Some(c) = &p.tenant_column {
                v.check(
                    !c.is_empty(),
                    &format!("{base}.tenant_column"),
                    "must not be empty",
                );
            }
            if !p.dedicated_tenants.is_empty() && p.tenant_column.is_none() {
                v.push(
                    &format!("{base}.dedicated_tenants"),
                    "needs tenant_column (the column that names a row's tenant)".into(),
                );
            }
            if let Some(t) = &p.dedicated_topic {
                if !p.routes() {
                    v.push(
                        &format!("{base}.dedicated_topic"),
                        "routes nothing: set dedicated_keys or dedicated_tenants".into(),
                    );
                }
                v.check(
                    is_topic_name(t),
                    &format!("{base}.dedicated_topic"),
                    "must be 1-249 characters of a-z, A-Z, 0-9, '.', '_' or '-'",
                );
            }
            if let Some(topic) = self.dedicated_topic(table) {
                let taken = self
                    .source
                    .tables
                    .iter()
                    .any(|t| self.topic_for(t) == topic)
                    || self.partitioning.iter().any(|(other, _)| {
                        other != table
                            && self.dedicated_topic(other).as_deref() == Some(topic.as_str())
                    });
                v.check(
                    !taken,
                    &format!("{base}.dedicated_topic"),
                    "is another table's topic: each table needs a dedicated topic of its own",
                );
            }
        }
        if let Some(q) = self.target.as_ref().and_then(|t| t.tenant_quota.as_ref()) {
            let base = "target.tenant_quota";
            v.check(
                q.rate_per_sec.is_finite() && q.rate_per_sec > 0.0,
                &format!("{base}.rate_per_sec"),
                "must be a number greater than 0",
            );
            if let Some(b) = q.burst {
                v.check(
                    b.is_finite() && b >= 1.0,
                    &format!("{base}.burst"),
                    "must be at least 1",
                );
            }
            v.check(
                q.max_deferred >= 1,
                &format!("{base}.max_deferred"),
                "must be at least 1",
            );
            for (tenant, rate) in &q.tenants {
                v.check(
                    rate.is_finite() && *rate > 0.0,
                    &format!("{base}.tenants.\"{tenant}\""),
                    "must be a number greater than 0",
                );
            }
        }
    }

    fn validate_dlq(&self, v: &mut Validator) {
        use crate::retention::time::{parse_span, parse_timestamp};
        let d = &self.dlq;
        let h = &d.health;
        v.check(
            h.arrival_factor.is_finite() && h.arrival_factor > 1.0,
            "dlq.health.arrival_factor",
            "must be a number greater than 1",
        );
        v.check(
            h.baseline_alpha > 0.0 && h.baseline_alpha <= 1.0,
            "dlq.health.baseline_alpha",
            "must be greater than 0 and at most 1",
        );
        v.check(
            parse_span(&h.max_oldest_age).is_some_and(|ms| ms > 0),
            "dlq.health.max_oldest_age",
            "must be a span such as 24h, 3d or 90m",
        );
        for (name, p) in &d.policies {
            let base = format!("dlq.policies.{name}");
            v.check(is_identifier(name), &base, "name must be a-z, 0-9 or '_'");
            for (i, c) in p.classes.iter().enumerate() {
                if crate::dlq::Class::parse(c).is_none() {
                    v.push(
                        &format!("{base}.classes[{i}]"),
                        format!(
                            "'{c}' is not a failure class ({})",
                            crate::dlq::Class::ALL
                                .iter()
                                .map(|c| c.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                }
            }
            let at = |field: &str, text: &Option<String>, v: &mut Validator| match text {
                Some(t) => {
                    let ms = parse_timestamp(t);
                    if ms.is_none() {
                        v.push(
                            &format!("{base}.{field}"),
                            "must be an RFC 3339 time such as 2026-12-01T02:00:00Z".into(),
                        );
                    }
                    ms
                }
                None => None,
            };
            match p.action {
                DlqAction::Replay => {
                    // Narrow by construction: named classes and a bounded window.
                    v.check(
                        !p.classes.is_empty(),
                        &format!("{base}.classes"),
                        "must name the classes an automatic replay covers",
                    );
                    let (from, until) = (at("from", &p.from, v), at("until", &p.until, v));
                    v.check(
                        p.from.is_some() && p.until.is_some(),
                        &base,
                        "an automatic replay needs a window: from and until",
                    );
                    if let (Some(f), Some(u)) = (from, until) {
                        v.check(u > f, &format!("{base}.until"), "must be after from");
                    }
                    v.check(
                        p.after.is_none(),
                        &format!("{base}.after"),
                        "belongs to action = \"archive\"",
                    );
                }
                DlqAction::Archive => {
                    v.check(
                        p.after
                            .as_deref()
                            .and_then(parse_span)
                            .is_some_and(|ms| ms > 0),
                        &format!("{base}.after"),
                        "is required: a span such as 30d after which unaddressed messages are archived",
                    );
                    v.check(
                        p.from.is_none() && p.until.is_none(),
                        &base,
                        "from and until belong to action = \"replay\"",
                    );
                }
            }
        }
        for (table, o) in &self.outbox {
            let base = format!("outbox.\"{table}\"");
            v.check(
                self.source.tables.contains(table),
                &base,
                "is not one of source.tables",
            );
            v.check(
                o.topic_for(&self.kafka.topic_prefix, "r").is_ok()
                    && !o
                        .topic
                        .replace("{prefix}", "")
                        .replace("{route}", "")
                        .contains(['{', '}']),
                &format!("{base}.topic"),
                "must be a Kafka topic name; {prefix} and {route} are the only placeholders",
            );
            if o.order_by.as_deref() == Some("") {
                v.push(&format!("{base}.order_by"), "must name a column".into());
            }
            for (field, column) in [
                ("route_by", &o.route_by),
                ("key", &o.key),
                ("payload", &o.payload),
            ] {
                v.check(
                    !column.is_empty(),
                    &format!("{base}.{field}"),
                    "must name a column",
                );
            }
            let mut seen = BTreeSet::new();
            for (i, h) in o.headers.iter().enumerate() {
                v.check(
                    !h.is_empty() && seen.insert(h.as_str()),
                    &format!("{base}.headers[{i}]"),
                    "must name a column, once",
                );
            }
            for (name, rm) in &self.read_models {
                for (i, s) in rm.sources.iter().enumerate() {
                    v.check(
                        &s.table != table,
                        &format!("read_models.{name}.sources[{i}].table"),
                        "is an outbox table: it has domain-event topics, no changelog to mirror",
                    );
                }
            }
        }
        for (table, m) in &d.mappings {
            let base = format!("dlq.mappings.\"{table}\"");
            v.check(
                self.source.tables.contains(table),
                &base,
                "is not one of source.tables",
            );
            for (from, to) in &m.renames {
                v.check(
                    from != to && !from.is_empty() && !to.is_empty(),
                    &format!("{base}.renames.{from}"),
                    "must name another, non-empty column",
                );
            }
        }
    }

    /// A declared read model by name (`--read-model NAME`), or an error
    /// listing the declared ones.
    pub fn read_model(&self, name: &str) -> Result<(&String, &ReadModelConfig), String> {
        self.read_models.get_key_value(name).ok_or_else(|| {
            format!(
                "--read-model {name}: not one of read_models ({})",
                self.read_models
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// The captured tables that have a changelog topic (all but the
    /// outbox tables).
    pub fn changelog_tables(&self) -> impl Iterator<Item = &String> {
        self.source
            .tables
            .iter()
            .filter(|t| !self.outbox.contains_key(*t))
    }

    /// The dedicated topic of a table that routes keys or tenants to one
    /// (`partitioning.<table>.dedicated_topic`).
    pub fn dedicated_topic(&self, table: &str) -> Option<String> {
        let p = self.partitioning.get(table).filter(|p| p.routes())?;
        Some(
            p.dedicated_topic
                .clone()
                .unwrap_or_else(|| format!("{}.dedicated", self.topic_for(table))),
        )
    }

    /// Every topic a captured table's changelog events go to: its own, and
    /// its dedicated topic if it has one.
    pub fn topics_of(&self, table: &str) -> Vec<String> {
        std::iter::once(self.topic_for(table))
            .chain(self.dedicated_topic(table))
            .collect()
    }

    /// `(table, tenant column)` of every table that names one.
    pub fn tenant_columns(&self) -> impl Iterator<Item = (&String, &String)> {
        self.partitioning
            .iter()
            .filter_map(|(t, p)| Some((t, p.tenant_column.as_ref()?)))
    }

    /// Dedicated topic → the table's own topic, for every table with one.
    pub fn homes(&self) -> HashMap<String, String> {
        self.changelog_tables()
            .filter_map(|t| Some((self.dedicated_topic(t)?, self.topic_for(t))))
            .collect()
    }

    /// The changelog topic of a captured table: `<prefix>.<schema>.<table>`
    /// under [`topic_name`]'s rule, as Debezium names it.
    pub fn topic_for(&self, table: &str) -> String {
        let names = split_table(table)
            .map(|(s, t)| format!("{s}.{t}"))
            .unwrap_or_else(|| table.to_string());
        topic_name(&format!("{}.{names}", self.kafka.topic_prefix))
    }

    /// Rewrites every table reference to [`table_name`]'s spelling, so
    /// `"public"."orders"` and `public.orders` are one table everywhere.
    /// Returns the map keys that now name a table twice.
    fn canonicalize_tables(&mut self) -> Vec<FieldError> {
        for t in &mut self.source.tables {
            *t = canonical_table(t);
        }
        for rm in self.read_models.values_mut() {
            rm.table = canonical_table(&rm.table);
            for s in &mut rm.sources {
                s.table = canonical_table(&s.table);
            }
        }
        let mut clashes = Vec::new();
        fn rekey<V>(map: &mut BTreeMap<String, V>, section: &str, clashes: &mut Vec<FieldError>) {
            for (t, v) in std::mem::take(map) {
                let spelt = canonical_table(&t);
                if map.insert(spelt.clone(), v).is_some() {
                    clashes.push(FieldError {
                        path: format!("{section}.\"{t}\""),
                        message: format!("names {spelt} a second time"),
                    });
                }
            }
        }
        rekey(&mut self.outbox, "outbox", &mut clashes);
        rekey(&mut self.dlq.mappings, "dlq.mappings", &mut clashes);
        rekey(&mut self.partitioning, "partitioning", &mut clashes);
        rekey(&mut self.source.columns, "source.columns", &mut clashes);
        clashes
    }

    /// The effective config as TOML, with secrets redacted.
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
    }
}

#[derive(Default)]
struct Validator {
    errors: Vec<FieldError>,
}

impl Validator {
    fn push(&mut self, path: &str, message: String) {
        self.errors.push(FieldError {
            path: path.to_string(),
            message,
        });
    }

    fn check(&mut self, ok: bool, path: &str, message: &str) {
        if !ok {
            self.push(path, message.to_string());
        }
    }

    fn check_dsn(&mut self, dsn: &Dsn, path: &str) {
        match crate::source::tls::Endpoint::parse(dsn) {
            // tokio-postgres's parse errors quote no values, so no secret leaks.
            Err(e) => self.push(
                path,
                format!("is not a valid Postgres connection string: {e}"),
            ),
            Ok(endpoint) => {
                if let Some(e) = endpoint.tls.conflict() {
                    self.push(path, e.to_string());
                }
            }
        }
    }
}

/// A `schema.table` reference split into the two names. Each part is
/// either bare, taken exactly as written (case kept, as Postgres' catalog
/// has it), without `.` or `"`, or double-quoted like SQL, holding any
/// characters with `""` for a quote: `"Sales Dept"."Order.Items"`.
pub fn split_table(name: &str) -> Option<(String, String)> {
    let (schema, rest) = name_part(name)?;
    let (table, rest) = name_part(rest.strip_prefix('.')?)?;
    rest.is_empty().then_some((schema, table))
}

/// One name of a `schema.table` reference, and the text after it.
fn name_part(s: &str) -> Option<(String, &str)> {
    let Some(body) = s.strip_prefix('"') else {
        let end = s.find('.').unwrap_or(s.len());
        let part = &s[..end];
        return (!part.is_empty() && !part.contains('"')).then(|| (part.to_string(), &s[end..]));
    };
    let mut name = String::new();
    let mut rest = body;
    loop {
        let quote = rest.find('"')?;
        name.push_str(&rest[..quote]);
        rest = &rest[quote + 1..];
        match rest.strip_prefix('"') {
            Some(after) => {
                name.push('"');
                rest = after;
            }
            None => return (!name.is_empty()).then_some((name, rest)),
        }
    }
}

/// How `source.tables` writes a table: each part bare where that reads
/// back the same, double-quoted otherwise. Config entries are rewritten to
/// this form when loaded, so it is the one spelling every comparison sees.
pub fn table_name(schema: &str, table: &str) -> String {
    let part = |p: &str| {
        if !p.is_empty() && !p.contains(['.', '"']) {
            p.to_string()
        } else {
            format!("\"{}\"", p.replace('"', "\"\""))
        }
    };
    format!("{}.{}", part(schema), part(table))
}

/// The table reference in [`table_name`]'s spelling, or as written when
/// it does not parse (validation then names it).
pub fn canonical_table(name: &str) -> String {
    split_table(name)
        .map(|(s, t)| table_name(&s, &t))
        .unwrap_or_else(|| name.to_string())
}

/// Debezium's topic-name rule: every character outside Kafka's alphabet
/// (`a-z A-Z 0-9 . _ -`) becomes `_`.
pub fn topic_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Kafka's limit on a topic name's length.
const MAX_TOPIC_LEN: usize = 249;

/// Postgres' limit on an identifier, in bytes (longer names are cut).
const MAX_IDENTIFIER_BYTES: usize = 63;

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

fn is_simple_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn is_topic_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 200
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

fn join_path(base: &str, key: &str) -> String {
    let simple = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    match (base.is_empty(), simple) {
        (true, true) => key.to_string(),
        (true, false) => format!("\"{key}\""),
        (false, true) => format!("{base}.{key}"),
        (false, false) => format!("{base}.\"{key}\""),
    }
}

/// Replaces `${VAR}` and `${VAR:-default}` in every string value.
fn interpolate(
    value: &mut toml::Value,
    path: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
    errors: &mut Vec<FieldError>,
) {
    match value {
        toml::Value::String(s) => match expand(s, lookup) {
            Ok(expanded) => *s = expanded,
            Err(message) => errors.push(FieldError {
                path: path.to_string(),
                message,
            }),
        },
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(item, &format!("{path}[{i}]"), lookup, errors);
            }
        }
        toml::Value::Table(table) => {
            for (k, v) in table.iter_mut() {
                interpolate(v, &join_path(path, k), lookup, errors);
            }
        }
        _ => {}
    }
}

fn expand(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| "has an unterminated '${' reference".to_string())?;
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!("has an invalid variable reference '${{{inner}}}'"));
        }
        match (lookup(name).filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(format!(
                    "environment variable {name} is not set (referenced as ${{{name}}}); for the local stack run: eval \"$(scripts/stack env)\""
                ))
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Whether the field at `path` (dotted) may hold a secret: a key whose
/// name says so, or any librdkafka property (a misspelt `sasl.pasword`
/// holds one too).
fn holds_secret(path: &str) -> bool {
    path.starts_with("kafka.properties.")
        || is_sensitive_key(path.rsplit('.').next().unwrap_or(path))
}

/// The value at `parts` in `value`, if there is one.
fn at_path<'a>(value: &'a toml::Value, parts: &[String]) -> Option<&'a toml::Value> {
    parts
        .iter()
        .try_fold(value, |v, part| v.as_table()?.get(part.as_str()))
}

/// An environment override as applied.
struct Override {
    /// Its path's fields, lowercased.
    parts: Vec<String>,
    raw: String,
    /// Read as TOML (`12`, `true`, `["a"]`) rather than kept as text.
    parsed: bool,
}

impl Override {
    /// The value the other way of reading it gives: text for one read as
    /// TOML, TOML for text (`None` where the text is not TOML).
    fn other_reading(&self) -> Option<toml::Value> {
        if self.parsed {
            Some(toml::Value::String(self.raw.clone()))
        } else {
            toml_value(&self.raw)
        }
    }

    /// Puts `v` at this override's path, making the tables on the way;
    /// `Err(i)` when the path's first `i` fields lead to a non-table.
    fn set(&self, value: &mut toml::Value, v: toml::Value) -> Result<(), usize> {
        let mut cursor = value;
        for (i, part) in self.parts.iter().enumerate() {
            let table = cursor.as_table_mut().ok_or(i)?;
            if i + 1 == self.parts.len() {
                table.insert(part.clone(), v);
                break;
            }
            cursor = table
                .entry(part.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        }
        Ok(())
    }
}

/// `raw` read as a TOML value, if it is one.
fn toml_value(raw: &str) -> Option<toml::Value> {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
}

/// Applies `PGCDC__A__B=value` overrides; returns them, in order.
fn apply_overrides(
    value: &mut toml::Value,
    env: &[(String, String)],
    errors: &mut Vec<FieldError>,
) -> Vec<Override> {
    let mut applied = Vec::new();
    for (name, raw) in env {
        let Some(path) = name.strip_prefix(OVERRIDE_PREFIX) else {
            continue;
        };
        let parts: Vec<String> = path.split("__").map(|p| p.to_ascii_lowercase()).collect();
        if parts.iter().any(|p| p.is_empty()) {
            errors.push(FieldError {
                path: String::new(),
                message: format!("environment override {name} has an empty path segment"),
            });
            continue;
        }
        // A librdkafka property or a secret is text, whatever it looks
        // like (`linger.ms` = 5, a password of digits), as is a value
        // replacing text from the file.
        let text = holds_secret(&parts.join("."))
            || at_path(value, &parts).is_some_and(toml::Value::is_str);
        let typed = if text { None } else { toml_value(raw) };
        let o = Override {
            parts,
            raw: raw.clone(),
            parsed: typed.is_some(),
        };
        let v = typed.unwrap_or_else(|| toml::Value::String(raw.clone()));
        if let Err(i) = o.set(value, v) {
            errors.push(FieldError {
                path: o.parts[..i].join("."),
                message: format!("environment override {name} descends into a non-table"),
            });
        }
        applied.push(o);
    }
    applied
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
name = "shop"
[source]
url = "postgres://app:hunter2@127.0.0.1:5432/shop"
slot = "pgcdc_shop"
publication = "pgcdc_shop"
tables = ["public.orders"]
[kafka]
brokers = "127.0.0.1:9092"
topic_prefix = "shop"
[registry]
url = "http://127.0.0.1:8081"
"#;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_toml(text, "test.toml", &env)
    }

    fn paths(err: ConfigError) -> Vec<String> {
        err.field_errors().iter().map(|e| e.path.clone()).collect()
    }

    #[test]
    fn minimal_config_gets_defaults() -> Result<(), ConfigError> {
        let c = load(MINIMAL, &[])?;
        assert_eq!(c.source.snapshot.mode, SnapshotMode::Initial);
        assert_eq!(c.source.snapshot.workers, DEFAULT_SNAPSHOT_WORKERS);
        assert_eq!(c.kafka.partitions, DEFAULT_PARTITIONS);
        assert_eq!(c.topic_for("public.orders"), "shop.public.orders");
        Ok(())
    }

    #[test]
    fn outbox_routing_is_validated_by_field_path() {
        let ok = format!(
            "{}\n[outbox.\"public.outbox\"]\nroute_by = \"aggregatetype\"\n",
            MINIMAL.replace(
                "[\"public.orders\"]",
                "[\"public.orders\", \"public.outbox\"]"
            )
        );
        let c = load(&ok, &[]).expect("valid outbox");
        let o = &c.outbox["public.outbox"];
        assert_eq!(o.key, "stream_id");
        assert_eq!(
            o.topic_for("shop", "payment"),
            Ok("shop.events.payment".to_string())
        );
        assert!(
            o.topic_for("shop", "a b").is_err(),
            "a space makes no topic name"
        );
        assert_eq!(
            c.changelog_tables().collect::<Vec<_>>(),
            vec!["public.orders"]
        );

        let missing = format!("{MINIMAL}\n[outbox.\"public.events\"]\n");
        assert_eq!(
            load(&missing, &[]).err().map(paths),
            Some(vec!["outbox.\"public.events\"".to_string()])
        );
        let placeholder = ok.replace("route_by = \"aggregatetype\"", "topic = \"x.{type}\"");
        assert_eq!(
            load(&placeholder, &[]).err().map(paths),
            Some(vec!["outbox.\"public.outbox\".topic".to_string()])
        );
        let mirrored = format!(
            "{ok}\n[read_models.m]\ntable = \"rm.m\"\nkey = [\"id\"]\nquery = \"SELECT 1 AS id\"\nsources = [{{ table = \"public.outbox\", key_columns = [\"id\"] }}]\n"
        );
        assert!(
            load(&mirrored, &[])
                .err()
                .map(paths)
                .is_some_and(|p| p.contains(&"read_models.m.sources[0].table".to_string())),
            "an outbox table has no changelog to mirror"
        );
    }

    #[test]
    fn left_out_columns_are_validated_by_field_path() {
        let with = |extra: &str| {
            format!(
                "{}\n{extra}\n",
                MINIMAL.replace(
                    "[\"public.orders\"]",
                    "[\"public.orders\", \"public.outbox\"]"
                )
            )
        };
        let ok = with("[source.columns.'public.\"orders\"']\nexclude = [\"secret\", \"Token\"]");
        let c = load(&ok, &[]).expect("valid exclusion");
        assert_eq!(c.excluded_columns("public.orders"), ["secret", "Token"]);
        assert!(c.excluded_columns("public.outbox").is_empty());
        let refused = |extra: &str| load(&with(extra), &[]).err().map(paths);
        let base = "source.columns.\"public.orders\"";
        for (extra, path) in [
            ("exclude = []", format!("{base}.exclude")),
            ("exclude = [\"a\", \"\"]", format!("{base}.exclude[1]")),
            ("exclude = [\"a\", \"b\", \"a\"]", format!("{base}.exclude[2]")),
            (
                "exclude = [\"tenant\"]\n[partitioning.\"public.orders\"]\ntenant_column = \"tenant\"",
                format!("{base}.exclude[0]"),
            ),
        ] {
            assert_eq!(
                refused(&format!("[source.columns.\"public.orders\"]\n{extra}")),
                Some(vec![path.clone()]),
                "{extra}"
            );
        }
        assert_eq!(
            refused("[source.columns.\"public.other\"]\nexclude = [\"a\"]"),
            Some(vec!["source.columns.\"public.other\"".to_string()])
        );
        assert_eq!(
            refused(
                "[outbox.\"public.outbox\"]\n[source.columns.\"public.outbox\"]\nexclude = [\"a\"]"
            ),
            Some(vec!["source.columns.\"public.outbox\"".to_string()])
        );
        assert_eq!(
            refused("[source.columns.\"public.orders\"]\nexclude = [\"a\"]\nexcluded = [\"b\"]"),
            Some(vec!["source.columns.public.orders.excluded".to_string()])
        );
    }

    #[test]
    fn partitioning_and_tenant_quotas_are_validated_by_field_path() {
        let with = |extra: &str| format!("{MINIMAL}\n{extra}\n");
        let ok = with(
            "[partitioning.\"public.orders\"]\nsalt_shards = 4\nsalt_keys = [\"7\"]\ntenant_column = \"tenant\"\ndedicated_tenants = [\"acme\"]",
        );
        let c = load(&ok, &[]).expect("valid partitioning");
        assert_eq!(
            c.dedicated_topic("public.orders").as_deref(),
            Some("shop.public.orders.dedicated")
        );
        assert_eq!(
            c.topics_of("public.orders"),
            ["shop.public.orders", "shop.public.orders.dedicated"]
        );
        assert_eq!(
            c.homes()
                .get("shop.public.orders.dedicated")
                .map(String::as_str),
            Some("shop.public.orders")
        );
        let refused = |extra: &str| load(&with(extra), &[]).err().map(paths);
        let base = "partitioning.\"public.orders\"";
        for (extra, path) in [
            (
                "salt_shards = 1\nsalt_keys = [\"7\"]",
                format!("{base}.salt_shards"),
            ),
            ("salt_shards = 4", base.to_string()),
            ("salt_keys = [\"7\"]", format!("{base}.salt_shards")),
            (
                "salt_shards = 4\nsalt_keys = [\"\"]",
                format!("{base}.salt_keys[0]"),
            ),
            (
                "dedicated_tenants = [\"acme\"]",
                format!("{base}.dedicated_tenants"),
            ),
            (
                "dedicated_keys = [\"7\"]\ndedicated_topic = \"a b\"",
                format!("{base}.dedicated_topic"),
            ),
            (
                "dedicated_keys = [\"7\"]\ndedicated_topic = \"shop.public.orders\"",
                format!("{base}.dedicated_topic"),
            ),
            ("tenant_column = \"\"", format!("{base}.tenant_column")),
            (
                "salt_above_per_sec = 5.0\nsalt_shards = 4\n[hot_keys]\ncapacity = 0",
                format!("{base}.salt_above_per_sec"),
            ),
            ("", base.to_string()),
        ] {
            assert_eq!(
                refused(&format!("[partitioning.\"public.orders\"]\n{extra}")),
                Some(vec![path.clone()]),
                "{extra}"
            );
        }
        assert_eq!(
            refused("[partitioning.\"public.other\"]\nsalt_shards = 4\nsalt_keys = [\"1\"]"),
            Some(vec!["partitioning.\"public.other\"".to_string()])
        );
        let target = "[target]\nurl = \"postgres://t@127.0.0.1/t\"\n[target.tenant_quota]";
        assert!(refused(&format!("{target}\nrate_per_sec = 50.0\nburst = 100.0\n[target.tenant_quota.tenants]\nacme = 5.0")).is_none());
        for (extra, path) in [
            ("rate_per_sec = 0.0", "target.tenant_quota.rate_per_sec"),
            (
                "rate_per_sec = 5.0\nburst = 0.5",
                "target.tenant_quota.burst",
            ),
            (
                "rate_per_sec = 5.0\nmax_deferred = 0",
                "target.tenant_quota.max_deferred",
            ),
            (
                "rate_per_sec = 5.0\n[target.tenant_quota.tenants]\nacme = -1.0",
                "target.tenant_quota.tenants.\"acme\"",
            ),
        ] {
            assert_eq!(
                refused(&format!("{target}\n{extra}")),
                Some(vec![path.to_string()]),
                "{extra}"
            );
        }
    }

    /// A table of malformed and contradictory configs: each is refused,
    /// and the error names exactly the field at fault.
    #[test]
    fn table_names_are_bare_or_quoted_and_have_one_spelling() {
        let split = split_table;
        assert_eq!(
            split("public.orders"),
            Some(("public".into(), "orders".into()))
        );
        // Bare parts keep their case, as the catalog has them.
        assert_eq!(
            split("public.Orders"),
            Some(("public".into(), "Orders".into()))
        );
        assert_eq!(
            split(r#""Sales ""Dept""".Order Items"#),
            Some((r#"Sales "Dept""#.into(), "Order Items".into()))
        );
        assert_eq!(
            split(r#"public."v1.2""#),
            Some(("public".into(), "v1.2".into()))
        );
        assert_eq!(split("日本.表"), Some(("日本".into(), "表".into())));
        for bad in [
            "orders", "a.b.c", "\"a\".", ".b", "\"\".b", "\"a.b", "a\"b.c", "\"a\"x.b", "a.\"b\"c",
        ] {
            assert_eq!(split(bad), None, "{bad}");
        }
        // One spelling: bare where that reads back the same.
        for (schema, table, spelt) in [
            ("public", "orders", "public.orders"),
            ("public", "Order Items", "public.Order Items"),
            ("Sales \"Dept\"", "v1.2", r#""Sales ""Dept"""."v1.2""#),
        ] {
            assert_eq!(table_name(schema, table), spelt);
            assert_eq!(split(spelt), Some((schema.into(), table.into())));
        }
        assert_eq!(canonical_table(r#""public"."orders""#), "public.orders");
        assert_eq!(canonical_table("not a table"), "not a table");
    }

    #[test]
    fn topics_replace_what_kafka_does_not_allow_as_debezium_does() {
        let mut c = Config::from_toml(MINIMAL, "t", &[]).expect("minimal");
        c.kafka.topic_prefix = "shop".into();
        assert_eq!(c.topic_for("public.orders"), "shop.public.orders");
        assert_eq!(
            c.topic_for(r#""Sales ""Dept""".Order Items"#),
            "shop.Sales__Dept_.Order_Items"
        );
        assert_eq!(c.topic_for("public.Café-2"), "shop.public.Caf_-2");
        assert_eq!(c.topic_for(r#"public."v1.2""#), "shop.public.v1.2");
    }

    #[test]
    fn every_malformed_or_contradictory_config_names_its_field() {
        const TARGET: &str = "[target]\nurl = \"postgres://t@127.0.0.1/t\"\n";
        const MODEL: &str = "[read_models.m]\ntable = \"rm.m\"\nkey = [\"id\"]\nquery = \"SELECT id FROM mirror.orders WHERE id = ANY($1)\"\nsources = [{ table = \"public.orders\", key_columns = [\"id\"] }]\n";
        let replace = |from: &str, to: &str| {
            assert!(MINIMAL.contains(from), "{from}");
            MINIMAL.replacen(from, to, 1)
        };
        let append = |extra: &str| format!("{MINIMAL}{extra}");
        let cases: Vec<(&str, String, &str)> = vec![
            (
                "bad pipeline name",
                replace("name = \"shop\"", "name = \"Shop Floor\""),
                "name",
            ),
            (
                "slot with a dash",
                replace("slot = \"pgcdc_shop\"", "slot = \"pgcdc-shop\""),
                "source.slot",
            ),
            (
                "publication quoted",
                replace("publication = \"pgcdc_shop\"", "publication = \"pg\\\"x\""),
                "source.publication",
            ),
            (
                "no tables",
                replace("tables = [\"public.orders\"]", "tables = []"),
                "source.tables",
            ),
            (
                "table without schema",
                replace("[\"public.orders\"]", "[\"orders\"]"),
                "source.tables[0]",
            ),
            (
                "table listed twice",
                replace(
                    "[\"public.orders\"]",
                    "[\"public.orders\", \"public.orders\"]",
                ),
                "source.tables[1]",
            ),
            (
                "the same table spelt two ways",
                replace(
                    "[\"public.orders\"]",
                    "['public.orders', '\"public\".\"orders\"']",
                ),
                "source.tables[1]",
            ),
            (
                "an unterminated quoted name",
                replace("[\"public.orders\"]", "['public.\"orders']"),
                "source.tables[0]",
            ),
            (
                "a dot in a bare name",
                replace("[\"public.orders\"]", "[\"public.orders.v2\"]"),
                "source.tables[0]",
            ),
            (
                "a name over 63 bytes",
                replace(
                    "[\"public.orders\"]",
                    &format!("[\"public.{}\"]", "o".repeat(64)),
                ),
                "source.tables[0]",
            ),
            (
                "two tables, one topic",
                replace(
                    "[\"public.orders\"]",
                    "[\"public.order lines\", \"public.order-lines\", \"public.order_lines\"]",
                ),
                "source.tables[2]",
            ),
            (
                "an unknown sslmode",
                replace(
                    "127.0.0.1:5432/shop",
                    "127.0.0.1:5432/shop?sslmode=verify-everything",
                ),
                "source.url",
            ),
            (
                "a mapping spelt two ways",
                append("[dlq.mappings.\"public.orders\"]\n[dlq.mappings.'\"public\".orders']\n"),
                // Keys come in byte order: the quoted spelling first.
                "dlq.mappings.\"public.orders\"",
            ),
            (
                "two tables, one mirror",
                format!(
                    "{}{TARGET}",
                    replace("[\"public.orders\"]", "[\"s.t\", \"u.t\", \"public.s_t\"]")
                ),
                "source.tables[2]",
            ),
            (
                "sslrootcert=system with a weak sslmode",
                replace(
                    "127.0.0.1:5432/shop",
                    "127.0.0.1:5432/shop?sslrootcert=system&sslmode=require",
                ),
                "source.url",
            ),
            (
                "not a DSN",
                replace("postgres://app:hunter2@127.0.0.1:5432/shop", "mysql://x"),
                "source.url",
            ),
            (
                "a string for a number",
                replace("[kafka]", "[kafka]\npartitions = \"three\""),
                "kafka.partitions",
            ),
            (
                "no partitions",
                replace("[kafka]", "[kafka]\npartitions = 0"),
                "kafka.partitions",
            ),
            (
                "no brokers",
                replace("brokers = \"127.0.0.1:9092\"", "brokers = \"\""),
                "kafka.brokers",
            ),
            (
                "a managed property",
                append("[kafka.properties]\n\"acks\" = \"1\"\n"),
                "kafka.properties.\"acks\"",
            ),
            (
                "error-only delivery reports",
                append("[kafka.properties]\n\"delivery.report.only.error\" = \"true\"\n"),
                "kafka.properties.\"delivery.report.only.error\"",
            ),
            (
                "snapshot without workers",
                append("[source.snapshot]\nworkers = 0\n"),
                "source.snapshot.workers",
            ),
            (
                "an unknown snapshot mode",
                append("[source.snapshot]\nmode = \"sometimes\"\n"),
                "source.snapshot.mode",
            ),
            (
                "registry not a URL",
                replace("url = \"http://127.0.0.1:8081\"", "url = \"registry\""),
                "registry.url",
            ),
            ("read model without target", append(MODEL), "target"),
            (
                "read model over an uncaptured table",
                append(&format!(
                    "{TARGET}{}",
                    MODEL.replace("table = \"public.orders\"", "table = \"public.items\"")
                )),
                "read_models.m.sources[0].table",
            ),
            (
                "a partitioning entry spelt two ways",
                append("[partitioning.\"public.orders\"]\n[partitioning.'\"public\".orders']\n"),
                "partitioning.\"public.orders\"",
            ),
            (
                "a read-model key naming a column twice",
                append(&format!(
                    "{TARGET}{}",
                    MODEL
                        .replace("key = [\"id\"]", "key = [\"id\", \"id\"]")
                        .replace("key_columns = [\"id\"]", "key_columns = [\"id\", \"id\"]")
                )),
                "read_models.m.key",
            ),
            (
                "key_columns shorter than a composite key",
                append(&format!(
                    "{TARGET}{}",
                    MODEL.replace("key = [\"id\"]", "key = [\"region\", \"id\"]")
                )),
                "read_models.m.sources[0].key_columns",
            ),
            (
                "batch of nothing",
                append(&format!("{TARGET}batch_size = 0\n")),
                "target.batch_size",
            ),
            (
                "an unknown dlq action",
                append("[dlq.policies.p]\naction = \"ignore\"\n"),
                "dlq.policies.p.action",
            ),
            (
                "a reach requirement that does not parse",
                append(&format!("{TARGET}{MODEL}require_reach = \"soon\"\n")),
                "read_models.m.require_reach",
            ),
            (
                "an outbox table not captured",
                append("[outbox.\"public.events\"]\n"),
                "outbox.\"public.events\"",
            ),
        ];
        // The same model with a composite key whose mappings agree with it.
        let composite = MODEL
            .replace("key = [\"id\"]", "key = [\"region\", \"id\"]")
            .replace(
                "key_columns = [\"id\"]",
                "key_columns = [\"region\", \"id\"]",
            );
        if let Err(e) = load(&append(&format!("{TARGET}{composite}")), &[]) {
            panic!("a composite read-model key: {:?}", paths(e));
        }
        for (what, text, path) in cases {
            match load(&text, &[]) {
                Ok(_) => panic!("{what}: accepted"),
                Err(e) => {
                    let paths = paths(e);
                    assert!(
                        paths.iter().any(|p| p == path),
                        "{what}: expected an error at {path}, got {paths:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn unknown_nested_field_is_named_by_path() {
        let text = MINIMAL.replace("[kafka]", "[kafka]\nbatch_size = 3");
        let err = load(&text, &[]).err().map(paths);
        assert_eq!(err, Some(vec!["kafka.batch_size".to_string()]));
    }

    #[test]
    fn unknown_top_level_field_is_named() {
        let text = format!("colour = \"red\"\n{MINIMAL}");
        let err = load(&text, &[])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn validation_reports_every_bad_field() {
        let text = MINIMAL
            .replace(
                "tables = [\"public.orders\"]",
                "tables = [\"orders\", \"public.orders\", \"public.orders\"]",
            )
            .replace("slot = \"pgcdc_shop\"", "slot = \"Bad-Slot\"")
            .replace(
                "[kafka]",
                "[kafka]\npartitions = 0\nproperties = { acks = \"1\" }",
            );
        let got = load(&text, &[]).err().map(paths).unwrap_or_default();
        assert_eq!(
            got,
            vec![
                "source.slot",
                "source.tables[0]",
                "source.tables[2]",
                "kafka.partitions",
                "kafka.properties.\"acks\""
            ]
        );
    }

    #[test]
    fn exactly_once_settings_are_validated() -> Result<(), ConfigError> {
        let c = load(MINIMAL, &[])?;
        assert!(!c.kafka.exactly_once);
        assert_eq!(
            c.kafka.transaction_interval_ms,
            DEFAULT_TRANSACTION_INTERVAL_MS
        );
        let text = MINIMAL.replace(
            "[kafka]",
            "[kafka]\nexactly_once = true\ntransaction_interval_ms = 0\nproperties = { \"transactional.id\" = \"x\" }",
        );
        let got = load(&text, &[]).err().map(paths).unwrap_or_default();
        assert_eq!(
            got,
            vec![
                "kafka.transaction_interval_ms",
                "kafka.properties.\"transactional.id\""
            ]
        );
        Ok(())
    }

    #[test]
    fn variables_are_interpolated_with_defaults() -> Result<(), ConfigError> {
        let text = MINIMAL.replace("127.0.0.1:9092", "${BROKERS}").replace(
            "http://127.0.0.1:8081",
            "${REGISTRY:-http://localhost:8081}",
        );
        let c = load(&text, &[("BROKERS", "b1:9092,b2:9092")])?;
        assert_eq!(c.kafka.brokers, "b1:9092,b2:9092");
        assert_eq!(c.registry.url.expose(), "http://localhost:8081");
        Ok(())
    }

    #[test]
    fn missing_variable_names_field_and_variable() {
        let text = MINIMAL.replace("127.0.0.1:9092", "${NOPE_BROKERS}");
        let err = load(&text, &[])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("kafka.brokers"), "{err}");
        assert!(err.contains("NOPE_BROKERS"), "{err}");
    }

    #[test]
    fn overrides_set_typed_values_by_path() -> Result<(), ConfigError> {
        let c = load(
            MINIMAL,
            &[
                ("PGCDC__KAFKA__PARTITIONS", "12"),
                ("PGCDC__SOURCE__SNAPSHOT__MODE", "never"),
                ("PGCDC__SOURCE__TABLES", "[\"public.a\", \"public.b\"]"),
            ],
        )?;
        assert_eq!(c.kafka.partitions, 12);
        assert_eq!(c.source.snapshot.mode, SnapshotMode::Never);
        assert_eq!(c.source.tables, vec!["public.a", "public.b"]);
        Ok(())
    }

    #[test]
    fn an_override_of_the_wrong_guessed_type_is_read_the_other_way() -> Result<(), ConfigError> {
        // Unset in the file, digits: read as an integer first, a string is wanted.
        let c = load(MINIMAL, &[("PGCDC__REGISTRY__USERNAME", "1234")])?;
        assert_eq!(c.registry.username.as_deref(), Some("1234"));
        // The file's wrong text, fixed by an override of the right type.
        let text = MINIMAL.replace(
            "topic_prefix = \"shop\"",
            "topic_prefix = \"shop\"\npartitions = \"12\"",
        );
        let refused = load(&text, &[]).expect_err("a string partition count");
        assert_eq!(paths(refused), vec!["kafka.partitions"]);
        let c = load(&text, &[("PGCDC__KAFKA__PARTITIONS", "12")])?;
        assert_eq!(c.kafka.partitions, 12);
        // Mended, but another field is wrong: that one is reported.
        let bad_slot = MINIMAL.replace("slot = \"pgcdc_shop\"", "slot = 5");
        let other = load(&bad_slot, &[("PGCDC__REGISTRY__USERNAME", "1234")])
            .expect_err("the slot is a number");
        assert_eq!(paths(other), vec!["source.slot"]);
        // Of two overrides of one path, the one in effect is retried.
        let c = load(
            MINIMAL,
            &[
                ("PGCDC__REGISTRY__USERNAME", "true"),
                ("PGCDC__registry__username", "1234"),
            ],
        )?;
        assert_eq!(c.registry.username.as_deref(), Some("1234"));
        // Wrong either way: the first reading's error stands, by path.
        let wrong =
            load(MINIMAL, &[("PGCDC__KAFKA__PARTITIONS", "many")]).expect_err("not a number");
        assert_eq!(paths(wrong), vec!["kafka.partitions"]);
        Ok(())
    }

    #[test]
    fn overrides_of_secrets_and_properties_stay_text() -> Result<(), ConfigError> {
        let text = MINIMAL.replace(
            "[registry]\nurl = \"http://127.0.0.1:8081\"",
            "[registry]\nurl = \"http://127.0.0.1:8081\"\nusername = \"u\"",
        );
        let c = load(
            &text,
            &[
                ("PGCDC__REGISTRY__PASSWORD", "12345678"),
                ("PGCDC__KAFKA__PROPERTIES__LINGER.MS", "5"),
                (
                    "PGCDC__KAFKA__PROPERTIES__ENABLE.SSL.CERTIFICATE.VERIFICATION",
                    "true",
                ),
                // Text in the file stays text.
                ("PGCDC__NAME", "2024"),
            ],
        )?;
        assert_eq!(
            c.registry.password.as_ref().map(|p| p.expose()),
            Some("12345678")
        );
        assert_eq!(
            c.kafka.properties.0.get("linger.ms").map(String::as_str),
            Some("5")
        );
        assert_eq!(
            c.kafka
                .properties
                .0
                .get("enable.ssl.certificate.verification")
                .map(String::as_str),
            Some("true")
        );
        assert_eq!(c.name, "2024");
        Ok(())
    }

    #[test]
    fn a_secret_of_the_wrong_type_is_refused_without_its_value() {
        for (text, path) in [
            (
                MINIMAL.replace("[kafka]", "[kafka]\nproperties = { \"sasl.pasword\" = 12345678 }"),
                "kafka.properties.sasl.pasword",
            ),
            (
                MINIMAL.replace(
                    "[registry]\nurl = \"http://127.0.0.1:8081\"",
                    "[registry]\nurl = \"http://127.0.0.1:8081\"\nusername = \"u\"\npassword = 12345678",
                ),
                "registry.password",
            ),
        ] {
            let err = load(&text, &[]).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(path), "{err}");
            assert!(!err.contains("12345678"), "{err}");
        }
        // Other fields keep serde's words, value included.
        let err = load(
            &MINIMAL.replace("[kafka]", "[kafka]\npartitions = \"many\""),
            &[],
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(err.contains("\"many\""), "{err}");
    }

    #[test]
    fn per_table_sections_take_any_spelling_of_the_table() -> Result<(), ConfigError> {
        let c = load(
            &format!("{MINIMAL}[partitioning.'\"public\".\"orders\"']\nsalt_shards = 2\nsalt_keys = [\"1\"]\n"),
            &[],
        )?;
        assert_eq!(
            c.partitioning
                .get("public.orders")
                .and_then(|p| p.salt_shards),
            Some(2)
        );
        Ok(())
    }

    #[test]
    fn a_syntax_error_names_its_line_but_not_the_line_text() {
        let text = MINIMAL.replacen(
            "slot = \"pgcdc_shop\"",
            "slot = \"pgcdc_shop\"\npassword = \"hunter2",
            1,
        );
        let line = text
            .lines()
            .position(|l| l.starts_with("password"))
            .map_or(0, |i| i + 1);
        let err = load(&text, &[])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(&format!("line {line}, column ")), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn override_of_unknown_field_is_rejected_by_path() {
        let err = load(MINIMAL, &[("PGCDC__KAFKA__BATCH", "1")])
            .err()
            .map(paths);
        assert_eq!(err, Some(vec!["kafka.batch".to_string()]));
    }

    #[test]
    fn redacted_toml_hides_every_secret() -> Result<(), ConfigError> {
        let text = MINIMAL.replace(
            "[registry]\nurl = \"http://127.0.0.1:8081\"",
            "[registry]\nurl = \"http://u:regpass@127.0.0.1:8081\"\nusername = \"u\"\npassword = \"regpass2\"",
        ).replace("[kafka]", "[kafka]\nproperties = { \"sasl.password\" = \"kpass\", \"compression.type\" = \"zstd\" }")
        + "\n[hot_keys]\nfingerprint_key = \"fpkey-0123456789\"\n";
        let c = load(&text, &[])?;
        let shown = c.to_redacted_toml();
        for secret in ["hunter2", "regpass2", "kpass", "fpkey"] {
            assert!(!shown.contains(secret), "{secret} leaked:\n{shown}");
        }
        assert!(shown.contains("zstd"));
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(!format!("{c:?}").contains("fpkey"));
        Ok(())
    }

    #[test]
    fn a_fingerprint_key_must_be_at_least_16_bytes_and_is_never_echoed() {
        let with = |key: &str| {
            load(
                &format!("{MINIMAL}\n[hot_keys]\nfingerprint_key = {key}\n"),
                &[],
            )
        };
        assert!(with("\"0123456789abcdef\"").is_ok());
        let err = with("\"short-secret\"").expect_err("refused");
        let text = err.to_string();
        assert_eq!(paths(err), vec!["hot_keys.fingerprint_key"]);
        assert!(!text.contains("short-secret"), "{text}");
        // A value of the wrong type is not shown either.
        let err = with("123456789").expect_err("refused").to_string();
        assert!(!err.contains("123456789"), "{err}");
    }

    #[test]
    fn read_model_sources_must_be_captured_and_unambiguous() {
        let text = format!(
            r#"{MINIMAL}
[target]
url = "postgres://127.0.0.1/t"
[read_models.order_summary]
table = "read_models.order_summary"
key = ["order_id"]
query = "SELECT 1"
sources = [
  {{ table = "public.orders", key_columns = ["id"] }},
  {{ table = "public.customers", key_columns = ["id"] }},
  {{ table = "public.orders" }},
]
"#
        );
        let got = load(&text, &[]).err().map(paths).unwrap_or_default();
        assert_eq!(
            got,
            vec![
                "read_models.order_summary.sources[1].table",
                "read_models.order_summary.sources[2]"
            ]
        );
    }

    #[test]
    fn a_reach_requirement_must_parse() {
        let base = format!(
            "{MINIMAL}\n[target]\nurl = \"postgres://127.0.0.1/t\"\n[read_models.rm]\ntable = \"r.rm\"\nkey = [\"id\"]\nquery = \"SELECT 1\"\nsources = [{{ table = \"public.orders\", key_columns = [\"id\"] }}]\n"
        );
        let with = |req: &str| load(&format!("{base}require_reach = \"{req}\"\n"), &[]);
        assert!(with("90d").is_ok());
        assert!(with("current").is_ok());
        let err = with("ninety days").err().map(paths);
        assert_eq!(err, Some(vec!["read_models.rm.require_reach".to_string()]));
    }

    #[test]
    fn redis_needs_a_valid_url_and_an_explicit_failure_policy() -> Result<(), ConfigError> {
        let base =
            format!("{MINIMAL}\n[target]\nurl = \"postgres://127.0.0.1/t\"\n[target.dedup]\n");
        let errors = |extra: &str| {
            load(&format!("{base}{extra}"), &[])
                .err()
                .map(paths)
                .unwrap_or_default()
        };
        assert_eq!(
            errors("redis_url = \"redis://127.0.0.1/0\""),
            vec!["target.dedup.on_redis_failure"]
        );
        assert_eq!(
            errors("redis_url = \"http://x\"\non_redis_failure = \"fail_open\""),
            vec!["target.dedup.redis_url"]
        );
        assert_eq!(
            errors("on_redis_failure = \"fail_open\""),
            vec!["target.dedup.on_redis_failure"]
        );
        assert_eq!(errors("ttl_seconds = 0"), vec!["target.dedup.ttl_seconds"]);
        let c = load(
            &format!("{base}redis_url = \"redis://:hunter3@127.0.0.1/0\"\non_redis_failure = \"fail_closed\""),
            &[],
        )?;
        assert!(!c.to_redacted_toml().contains("hunter3"));
        assert!(!format!("{c:?}").contains("hunter3"));
        Ok(())
    }
}
