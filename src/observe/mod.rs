//! What an operator sees: metric names and labels, the alerts, and the
//! admin server that serves them (`--http-addr`: `/metrics`, `/healthz`,
//! `/readyz`, `/status`, and the status page at `/`).
//!
//! Guarantee: metric names are the constants below, labels are low
//! cardinality (table, operation, topic, alert), and no row value is ever
//! a label, a figure or a line of the page.

pub mod board;
pub mod page;
pub mod report;
pub mod scrape;
pub mod server;

/// Alert conditions, one series each: 1 while firing, 0 otherwise, by
/// `alert` (see [`Alert`]).
pub const ALERT: &str = "pgcdc_alert";

/// Connector restarts after an outage, by `cause` (source, broker, registry).
pub const CONNECTOR_RESTARTS: &str = "pgcdc_connector_restarts_total";
/// Change events produced, by `table` and `op` (c, u, d, r, t).
pub const EVENTS: &str = "pgcdc_events_total";
/// Bytes of Avro payload produced, by `table`.
pub const EVENT_BYTES: &str = "pgcdc_event_bytes_total";
/// Snapshot rows copied, by `table`.
pub const SNAPSHOT_ROWS: &str = "pgcdc_snapshot_rows_total";
/// The planner's row estimate of a table when its snapshot began, by
/// `table` (progress is rows copied over it).
pub const SNAPSHOT_ROWS_ESTIMATED: &str = "pgcdc_snapshot_rows_estimated";
/// Seconds from a source transaction's commit to Kafka's acknowledgement
/// of its last event (a summary: p50, p99, max over a sliding minute).
pub const COMMIT_TO_ACK: &str = "pgcdc_commit_to_ack_seconds";
/// Seconds from a source transaction's commit to the target commit that
/// made its change visible in the mirrors and read models.
pub const COMMIT_TO_VIEW: &str = "pgcdc_materialize_commit_to_view_seconds";
/// The LSN confirmed to Postgres (as a number).
pub const CONFIRMED_LSN: &str = "pgcdc_confirmed_lsn";
/// Current WAL position minus the confirmed LSN, in bytes.
pub const REPLICATION_LAG_BYTES: &str = "pgcdc_replication_lag_bytes";
/// Messages Kafka refused after librdkafka's own retries.
pub const KAFKA_DELIVERY_ERRORS: &str = "pgcdc_kafka_delivery_errors_total";
/// Kafka transactions committed (exactly-once mode).
pub const KAFKA_TRANSACTIONS: &str = "pgcdc_kafka_transactions_total";
/// Changes the materializer applied to a mirror, by source `table`.
pub const MATERIALIZE_APPLIED: &str = "pgcdc_materialize_applied_total";
/// Changes skipped because their position was already applied, by source
/// `table`.
pub const MATERIALIZE_DUPLICATES: &str = "pgcdc_materialize_duplicates_total";
/// Duplicates recognised by the in-process tier, without a database look-up.
pub const MATERIALIZE_FAST_TIER_HITS: &str = "pgcdc_materialize_fast_tier_hits_total";
/// Records sent to the dead-letter topic.
pub const MATERIALIZE_DEAD_LETTERED: &str = "pgcdc_materialize_dead_lettered_total";
/// Seconds per applied batch (one database transaction).
pub const MATERIALIZE_BATCH_SECONDS: &str = "pgcdc_materialize_batch_seconds";
/// 1 while Redis (the shared dedup tier) answers, 0 while it does not.
pub const MATERIALIZE_FAST_TIER_UP: &str = "pgcdc_materialize_fast_tier_up";
/// Durable look-ups skipped: inserts of keys the Bloom filter never saw.
pub const MATERIALIZE_BLOOM_SKIPS: &str = "pgcdc_materialize_bloom_skips_total";
/// Of those inserts, rows written by `COPY` (windows of many fresh keys).
pub const MATERIALIZE_COPIED: &str = "pgcdc_materialize_copied_total";
/// Messages not yet applied, by `topic` and `partition` (high watermark
/// minus the committed offset).
pub const MATERIALIZE_CONSUMER_LAG: &str = "pgcdc_materialize_consumer_lag";
/// Batches retried after an infrastructure error (target, Kafka, registry,
/// Redis under fail_closed), by `cause`.
pub const MATERIALIZE_RETRIES: &str = "pgcdc_materialize_retries_total";
/// Mirror rows removed after a new initial snapshot did not read them, by
/// `table`.
pub const MATERIALIZE_RESNAPSHOT_REMOVED: &str = "pgcdc_materialize_resnapshot_removed_total";
/// 1 while the confirmed LSN stands still as WAL grows.
pub const SLOT_STALLED: &str = "pgcdc_slot_stalled";
/// A read model's rebuild reach, by `read_model`: 2 full history, 1
/// current state only (compacted), 0 not rebuildable without a snapshot.
pub const REACH_KIND: &str = "pgcdc_rebuild_reach_kind";
/// Full history: since when (Unix seconds), by `read_model`; 0 otherwise.
pub const REACH_SINCE: &str = "pgcdc_rebuild_reach_since_seconds";
/// 1 when the read model's `require_reach` is met, 0 when not.
pub const REACH_REQUIREMENT_MET: &str = "pgcdc_rebuild_reach_requirement_met";
/// The first retained offset, by `topic` and `partition`.
pub const RETENTION_EARLIEST_OFFSET: &str = "pgcdc_retention_earliest_offset";
/// The high watermark, by `topic` and `partition`.
pub const RETENTION_LATEST_OFFSET: &str = "pgcdc_retention_latest_offset";
/// The timestamp of the first retained record (Unix seconds), by `topic`
/// and `partition`.
pub const RETENTION_EARLIEST_TIMESTAMP: &str = "pgcdc_retention_earliest_timestamp_seconds";
/// WAL the slot keeps (current LSN minus restart_lsn), in bytes.
pub const SLOT_RETAINED_WAL_BYTES: &str = "pgcdc_slot_retained_wal_bytes";
/// `safe_wal_size`: WAL that can still be written before the slot is in
/// danger of invalidation (absent when unlimited).
pub const SLOT_SAFE_WAL_SIZE_BYTES: &str = "pgcdc_slot_safe_wal_size_bytes";
/// Retention checks that failed (Kafka or Postgres unreachable).
pub const RETENTION_CHECK_ERRORS: &str = "pgcdc_retention_check_errors_total";
/// Changes the connector quarantined, by class.
pub const CONNECTOR_QUARANTINED: &str = "pgcdc_connector_quarantined_total";
/// Domain events routed from outbox tables, by table and topic.
pub const OUTBOX_EVENTS: &str = "pgcdc_outbox_events_total";
/// Outbox rows that are not events (updates, deletes, truncates), skipped.
pub const OUTBOX_SKIPPED: &str = "pgcdc_outbox_skipped_total";
/// Dead letters by state and class.
pub const DLQ_DEPTH: &str = "pgcdc_dlq_depth";
/// Seconds the oldest open dead letter has waited.
pub const DLQ_OLDEST_AGE: &str = "pgcdc_dlq_oldest_open_age_seconds";
/// Replays that ended applied or already applied, over every replay.
pub const DLQ_REPLAY_SUCCESS: &str = "pgcdc_dlq_replay_success_ratio";
/// Replays that failed again.
pub const DLQ_REPLAY_REFAILED: &str = "pgcdc_dlq_replay_refailed";
/// Dead letters quarantined in the last hour.
pub const DLQ_ARRIVALS: &str = "pgcdc_dlq_arrivals_last_hour";
/// EWMA of hourly arrivals before the last hour.
pub const DLQ_ARRIVAL_BASELINE: &str = "pgcdc_dlq_arrival_baseline_per_hour";
/// Health warnings in force (arrival burst, slow leak).
pub const DLQ_WARNINGS: &str = "pgcdc_dlq_health_warnings";
/// Messages a policy replayed or archived, by policy and action.
pub const DLQ_POLICY_ACTIONS: &str = "pgcdc_dlq_policy_actions_total";
/// A hot key's rate (changes/s, a lower bound), by table and key.
pub const HOT_KEY_RATE: &str = "pgcdc_hot_key_rate";
/// A hot key's share of its table's changes, by table and key.
pub const HOT_KEY_SHARE: &str = "pgcdc_hot_key_share";
/// 1 while a hot key is salted, by table and key.
pub const HOT_KEY_SALTED: &str = "pgcdc_hot_key_salted";
/// Events sent to a salted key's shard, by table.
pub const SALTED_EVENTS: &str = "pgcdc_salted_events_total";
/// Seconds a tenant's changes are behind: the age of its newest applied
/// record, or of its oldest waiting one if older, by tenant.
pub const TENANT_LAG: &str = "pgcdc_tenant_lag_seconds";
/// Records waiting behind their tenant's quota, by tenant.
pub const TENANT_WAITING: &str = "pgcdc_tenant_waiting_records";
/// Records that waited behind their tenant's quota, by tenant.
pub const TENANT_DEFERRED: &str = "pgcdc_tenant_deferred_total";
/// Partitions paused because the tenant quota's buffer is full.
pub const MATERIALIZE_PAUSED: &str = "pgcdc_materialize_paused_partitions";

/// A table's event counters ([`EVENTS`] by op, [`EVENT_BYTES`]), each
/// registered at its first use and then kept: a labelled look-up per event
/// costs more than encoding the event.
#[derive(Debug)]
pub struct TableMeters {
    table: String,
    events: [std::sync::OnceLock<metrics::Counter>; 5],
    bytes: std::sync::OnceLock<metrics::Counter>,
}

impl TableMeters {
    pub fn new(table: &str) -> TableMeters {
        TableMeters {
            table: table.to_string(),
            events: Default::default(),
            bytes: Default::default(),
        }
    }

    /// One event of `op` with a payload of `bytes`.
    pub fn event(&self, op: crate::encode::Op, bytes: usize) {
        self.events(op, 1, bytes as u64);
    }

    /// `n` events of `op` with payloads of `bytes` in all: the snapshot's
    /// copy workers count a batch of rows at once, as two of them adding
    /// to the same counters per row spend more on the shared cache line
    /// than on the addition.
    pub fn events(&self, op: crate::encode::Op, n: u64, bytes: u64) {
        use crate::encode::Op;
        let slot = match op {
            Op::Create => 0,
            Op::Update => 1,
            Op::Delete => 2,
            Op::Read => 3,
            Op::Truncate => 4,
        };
        self.events[slot]
            .get_or_init(
                || metrics::counter!(EVENTS, "table" => self.table.clone(), "op" => op.code()),
            )
            .increment(n);
        self.bytes
            .get_or_init(|| metrics::counter!(EVENT_BYTES, "table" => self.table.clone()))
            .increment(bytes);
    }
}

/// Targets whose lines above info print row values: tokio-postgres logs
/// every statement's bound parameters at debug (`executing statement ...
/// with parameters: [...]`: mirror rows, view keys), and statements' text.
const ROW_VALUE_TARGETS: &[&str] = &[
    "tokio_postgres::query",
    "tokio_postgres::prepare",
    "tokio_postgres::simple_query",
    "tokio_postgres::copy_in",
    "tokio_postgres::copy_out",
];

/// The log filter: `RUST_LOG`, or `info` by default (with Postgres's
/// NOTICEs, "already exists, skipping", held at warn).
pub fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    use tracing_subscriber::EnvFilter;
    rust_log
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new("info,tokio_postgres::connection=warn"))
}

/// Drops what [`ROW_VALUE_TARGETS`] log above info, whatever
/// [`log_filter`] lets through: a filter of its own, since `EnvFilter`
/// ranks a user's directive with field names
/// (`tokio_postgres::query[{message}]=debug`) above any directive added
/// to it.
pub fn row_value_guard(
) -> tracing_subscriber::filter::FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool> {
    tracing_subscriber::filter::filter_fn(|meta| {
        *meta.level() <= tracing::Level::INFO
            || !ROW_VALUE_TARGETS.iter().any(|t| {
                meta.target()
                    .strip_prefix(t)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
            })
    })
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// A documented alert condition. Each is exported as
/// `pgcdc_alert{alert=NAME}` (1 while it holds) and logged as a warning
/// when it begins; `deploy/prometheus/alerts.yml` has a rule for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alert {
    SlotStalled,
    SlotWalAtRisk,
    RebuildReachShort,
    DlqArrivalBurst,
    DlqOldestOverdue,
}

impl Alert {
    pub const ALL: [Alert; 5] = [
        Alert::SlotStalled,
        Alert::SlotWalAtRisk,
        Alert::RebuildReachShort,
        Alert::DlqArrivalBurst,
        Alert::DlqOldestOverdue,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Alert::SlotStalled => "slot_stalled",
            Alert::SlotWalAtRisk => "slot_wal_at_risk",
            Alert::RebuildReachShort => "rebuild_reach_short",
            Alert::DlqArrivalBurst => "dlq_arrival_burst",
            Alert::DlqOldestOverdue => "dlq_oldest_overdue",
        }
    }

    /// When it fires, in an operator's words.
    pub fn condition(self) -> &'static str {
        match self {
            Alert::SlotStalled => {
                "the slot's confirmed LSN has not moved for source.stall_warning_secs while WAL grows"
            }
            Alert::SlotWalAtRisk => {
                "the slot retains more than source.retained_wal_warning_bytes of WAL, or its wal_status is not reserved"
            }
            Alert::RebuildReachShort => {
                "a read model's rebuild reach is shorter than its require_reach"
            }
            Alert::DlqArrivalBurst => {
                "dead letters arrive above dlq.health.arrival_factor times their baseline"
            }
            Alert::DlqOldestOverdue => {
                "the oldest open dead letter has waited longer than dlq.health.max_oldest_age"
            }
        }
    }

    /// The README heading that says what to do.
    pub fn runbook(self) -> &'static str {
        match self {
            Alert::SlotStalled => "Runbook: a slot stall",
            Alert::SlotWalAtRisk => "Runbook: an invalidated slot",
            Alert::RebuildReachShort => "Runbook: rebuilding a read model",
            Alert::DlqArrivalBurst | Alert::DlqOldestOverdue => "Runbook: a poison message",
        }
    }

    /// The process that evaluates it.
    pub fn role(self) -> board::Role {
        match self {
            Alert::SlotStalled | Alert::SlotWalAtRisk => board::Role::Connector,
            _ => board::Role::Materializer,
        }
    }

    pub fn set(self, firing: bool) {
        metrics::gauge!(ALERT, "alert" => self.name()).set(if firing { 1.0 } else { 0.0 });
    }

    /// Every alert of `role` at 0, so that a rule sees the series before
    /// the first evaluation.
    pub fn reset_for(role: board::Role) {
        for a in Alert::ALL.into_iter().filter(|a| a.role() == role) {
            a.set(false);
        }
    }
}

fn describe() {
    metrics::describe_gauge!(ALERT, "1 while the alert's condition holds, by alert");
    metrics::describe_gauge!(
        SNAPSHOT_ROWS_ESTIMATED,
        "The planner's row estimate of a table when its snapshot began"
    );
    metrics::describe_counter!(EVENTS, "Change events produced, by table and op");
    metrics::describe_counter!(EVENT_BYTES, "Bytes of Avro payload produced, by table");
    metrics::describe_counter!(SNAPSHOT_ROWS, "Snapshot rows copied, by table");
    metrics::describe_histogram!(
        COMMIT_TO_ACK,
        metrics::Unit::Seconds,
        "Source commit to Kafka acknowledgement of the transaction's last event"
    );
    metrics::describe_histogram!(
        COMMIT_TO_VIEW,
        metrics::Unit::Seconds,
        "Source commit to the target commit that made the change visible"
    );
    metrics::describe_gauge!(CONFIRMED_LSN, "LSN confirmed to Postgres");
    metrics::describe_gauge!(REPLICATION_LAG_BYTES, "WAL bytes not yet confirmed");
    metrics::describe_counter!(KAFKA_DELIVERY_ERRORS, "Messages Kafka refused");
    metrics::describe_counter!(
        KAFKA_TRANSACTIONS,
        "Kafka transactions committed (exactly-once mode)"
    );
    metrics::describe_counter!(MATERIALIZE_APPLIED, "Changes applied to mirrors");
    metrics::describe_counter!(
        MATERIALIZE_DUPLICATES,
        "Changes skipped as already applied (position guard)"
    );
    metrics::describe_counter!(
        MATERIALIZE_DEAD_LETTERED,
        "Records sent to the dead-letter topic"
    );
    metrics::describe_histogram!(MATERIALIZE_BATCH_SECONDS, "Seconds per applied batch");
    metrics::describe_counter!(
        MATERIALIZE_FAST_TIER_HITS,
        "Duplicates recognised by the in-process dedup tier"
    );
    metrics::describe_gauge!(
        MATERIALIZE_FAST_TIER_UP,
        "1 while Redis, the shared dedup tier, answers"
    );
    metrics::describe_counter!(
        MATERIALIZE_BLOOM_SKIPS,
        "Durable look-ups skipped for keys the Bloom filter never saw"
    );
    metrics::describe_counter!(
        MATERIALIZE_COPIED,
        "Rows of keys the Bloom filter never saw written to a mirror by COPY"
    );
    metrics::describe_gauge!(
        MATERIALIZE_CONSUMER_LAG,
        "Messages not yet applied, by topic and partition"
    );
    metrics::describe_counter!(
        MATERIALIZE_RESNAPSHOT_REMOVED,
        "Mirror rows removed because a new initial snapshot did not read them"
    );
    metrics::describe_counter!(
        MATERIALIZE_RETRIES,
        "Batches retried after an infrastructure error, by cause"
    );
    metrics::describe_gauge!(
        SLOT_STALLED,
        "1 while the slot's confirmed LSN stands still as WAL grows"
    );
    metrics::describe_gauge!(
        REACH_KIND,
        "Rebuild reach by read model: 2 full history, 1 current state only, 0 none"
    );
    metrics::describe_gauge!(
        REACH_SINCE,
        "Full history kept since (Unix seconds), by read model"
    );
    metrics::describe_gauge!(
        REACH_REQUIREMENT_MET,
        "1 when the read model's require_reach is met"
    );
    metrics::describe_gauge!(
        RETENTION_EARLIEST_OFFSET,
        "First retained offset, by topic and partition"
    );
    metrics::describe_gauge!(
        RETENTION_LATEST_OFFSET,
        "High watermark, by topic and partition"
    );
    metrics::describe_gauge!(
        RETENTION_EARLIEST_TIMESTAMP,
        "Timestamp of the first retained record (Unix seconds)"
    );
    metrics::describe_gauge!(SLOT_RETAINED_WAL_BYTES, "WAL the slot retains, in bytes");
    metrics::describe_gauge!(
        SLOT_SAFE_WAL_SIZE_BYTES,
        "WAL that can be written before the slot is at risk of invalidation"
    );
    metrics::describe_counter!(RETENTION_CHECK_ERRORS, "Retention checks that failed");
    metrics::describe_gauge!(
        HOT_KEY_RATE,
        "Changes per second of a hot key (a lower bound), by table and key"
    );
    metrics::describe_gauge!(
        HOT_KEY_SHARE,
        "A hot key's share of its table's changes, by table and key"
    );
    metrics::describe_gauge!(HOT_KEY_SALTED, "1 while a hot key is salted");
    metrics::describe_counter!(
        SALTED_EVENTS,
        "Events spread over a salted key's shards, by table"
    );
    metrics::describe_gauge!(
        TENANT_LAG,
        "Seconds a tenant's changes are behind (newest applied, or oldest waiting), by tenant"
    );
    metrics::describe_gauge!(
        TENANT_WAITING,
        "Records waiting behind their tenant's quota, by tenant"
    );
    metrics::describe_counter!(
        TENANT_DEFERRED,
        "Records that waited behind their tenant's quota, by tenant"
    );
    metrics::describe_gauge!(
        MATERIALIZE_PAUSED,
        "Partitions paused while the tenant quota's buffer is full"
    );
    metrics::describe_counter!(
        CONNECTOR_QUARANTINED,
        "Changes the connector sent to the dead-letter topic, by class"
    );
    metrics::describe_gauge!(DLQ_DEPTH, "Dead letters by state and class");
    metrics::describe_gauge!(
        DLQ_OLDEST_AGE,
        "Seconds the oldest open dead letter has waited"
    );
    metrics::describe_gauge!(
        DLQ_REPLAY_SUCCESS,
        "Replays applied or already applied, over every replay (a replay that failed again counts against it)"
    );
    metrics::describe_gauge!(DLQ_REPLAY_REFAILED, "Replays that failed again");
    metrics::describe_gauge!(DLQ_ARRIVALS, "Dead letters quarantined in the last hour");
    metrics::describe_gauge!(
        DLQ_ARRIVAL_BASELINE,
        "EWMA of hourly dead-letter arrivals before the last hour"
    );
    metrics::describe_gauge!(DLQ_WARNINGS, "Dead-letter health warnings in force");
    metrics::describe_counter!(
        DLQ_POLICY_ACTIONS,
        "Dead letters a policy replayed or archived, by policy and action"
    );
}

#[cfg(test)]
mod tests {
    use super::Alert;

    #[test]
    fn debug_logging_never_reaches_the_targets_that_print_row_values() {
        use std::sync::{Arc, Mutex};
        use tracing_subscriber::layer::SubscriberExt;
        /// The targets of the events that got through.
        struct Seen(Arc<Mutex<Vec<String>>>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Seen {
            fn on_event(
                &self,
                event: &tracing::Event<'_>,
                _: tracing_subscriber::layer::Context<'_, S>,
            ) {
                if let Ok(mut seen) = self.0.lock() {
                    seen.push(event.metadata().target().to_string());
                }
            }
        }
        // What gets through: the held targets only at info.
        let (query, queryish, asked) = (
            "tokio_postgres::query",
            "tokio_postgres::queryish",
            "pgcdc::materialize",
        );
        for (rust_log, want) in [
            (None, vec![query]),
            (Some("debug"), vec![query, queryish, asked]),
            (Some("trace"), vec![query, queryish, asked]),
            (
                Some("info,tokio_postgres=trace,tokio_postgres::query=trace"),
                vec![query, queryish],
            ),
            // A directive with a field name outranks any added one.
            (
                Some("debug,tokio_postgres::query[{message}]=trace"),
                vec![query, queryish, asked],
            ),
        ] {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let subscriber = tracing_subscriber::registry()
                .with(super::log_filter(rust_log))
                .with(super::row_value_guard())
                .with(Seen(seen.clone()));
            tracing::subscriber::with_default(subscriber, || {
                tracing::debug!(target: "tokio_postgres::query", "executing statement s1 with parameters: [42]");
                tracing::debug!(target: "tokio_postgres::prepare", "preparing query s1");
                tracing::info!(target: "tokio_postgres::query", "at info");
                tracing::debug!(target: "tokio_postgres::queryish", "not a held target");
                tracing::debug!(target: "pgcdc::materialize", "asked for");
            });
            let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
            assert_eq!(seen, want, "{rust_log:?}");
        }
    }

    const README: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
    const RULES: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/prometheus/alerts.yml"
    ));

    /// Each alert is documented in the README's table, has its runbook
    /// there, and a Prometheus rule on its series.
    #[test]
    fn every_alert_has_a_row_a_runbook_and_a_rule() {
        for a in Alert::ALL {
            let row = format!("| `{}` |", a.name());
            assert!(README.contains(&row), "no README row {row}");
            let heading = format!("\n### {}\n", a.runbook());
            assert!(README.contains(&heading), "no README heading {heading:?}");
            let expr = format!("pgcdc_alert{{alert=\"{}\"}}", a.name());
            assert!(RULES.contains(&expr), "no rule on {expr}");
        }
    }
}
