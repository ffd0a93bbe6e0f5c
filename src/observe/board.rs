//! The live picture behind `/readyz`, `/status` and the status page: the
//! process's phase, and a short history of its own metrics.
//!
//! Guarantee: ready means streaming (the connector) or consuming (the
//! materializer), nothing else; once a stop is requested the phase stays
//! `stopping`, so `/readyz` answers 503 from the signal until the process
//! exits. The figures are sampled from the same exporter `/metrics`
//! renders, so the page and `/metrics` never disagree.
//!
//! ```text
//!  exporter ──render every 2 s──► scrape::parse ──► history (last 6 min)
//!                                                     │
//!                       /status (JSON) ◄── Status ◄──┘──► page (HTML + SVG)
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::scrape::{self, Scrape};
use super::Alert;
use crate::config::Config;

/// Seconds between samples.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Samples kept: six minutes.
pub const SAMPLES_KEPT: usize = 180;
/// Intervals averaged into a "now" rate.
const RATE_WINDOW: usize = 5;

/// What the process is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Connecting, checking the slot and topics, registering schemas.
    Starting = 0,
    /// The initial snapshot is being copied.
    Snapshot = 1,
    /// The connector reads the replication stream.
    Streaming = 2,
    /// The materializer applies what it consumes.
    Consuming = 3,
    /// A dependency is down; waiting to start again.
    Restarting = 4,
    /// A stop was requested; draining.
    Stopping = 5,
}

impl Phase {
    fn from_u8(v: u8) -> Phase {
        match v {
            1 => Phase::Snapshot,
            2 => Phase::Streaming,
            3 => Phase::Consuming,
            4 => Phase::Restarting,
            5 => Phase::Stopping,
            _ => Phase::Starting,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Snapshot => "snapshot",
            Phase::Streaming => "streaming",
            Phase::Consuming => "consuming",
            Phase::Restarting => "restarting",
            Phase::Stopping => "stopping",
        }
    }

    pub fn is_ready(self) -> bool {
        matches!(self, Phase::Streaming | Phase::Consuming)
    }
}

static PHASE: AtomicU8 = AtomicU8::new(Phase::Starting as u8);

/// Moves the process to `phase`; a stop is final, so nothing leaves
/// `Stopping`.
pub fn set_phase(phase: Phase) {
    let _ = PHASE.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
        (now != Phase::Stopping as u8).then_some(phase as u8)
    });
}

pub fn phase() -> Phase {
    Phase::from_u8(PHASE.load(Ordering::SeqCst))
}

/// Which command serves the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Connector,
    Materializer,
}

/// A read model (or a mirror) and what feeds it.
#[derive(Debug, Clone)]
struct Model {
    name: String,
    kind: &'static str,
    tables: Vec<String>,
    topics: Vec<String>,
}

/// The pipeline's shape and its sampled history.
#[derive(Debug)]
pub struct Board {
    role: Role,
    pipeline: String,
    slot: String,
    tables: Vec<String>,
    models: Vec<Model>,
    started: Instant,
    history: Mutex<VecDeque<(f64, Scrape)>>,
}

static BOARD: OnceLock<Arc<Board>> = OnceLock::new();

impl Board {
    pub fn new(role: Role, config: &Config) -> Board {
        let tables: Vec<String> = config.changelog_tables().cloned().collect();
        let mut models: Vec<Model> = config
            .read_models
            .iter()
            .map(|(name, rm)| {
                let tables: Vec<String> = rm.sources.iter().map(|s| s.table.clone()).collect();
                Model {
                    name: name.clone(),
                    kind: "read model",
                    topics: tables.iter().map(|t| config.topic_for(t)).collect(),
                    tables,
                }
            })
            .collect();
        models.extend(tables.iter().map(|t| Model {
            name: t.clone(),
            kind: "mirror",
            tables: vec![t.clone()],
            topics: vec![config.topic_for(t)],
        }));
        Board {
            role,
            pipeline: config.name.clone(),
            slot: config.source.slot.clone(),
            tables,
            models,
            started: Instant::now(),
            history: Mutex::new(VecDeque::new()),
        }
    }

    /// The board of this process, once the admin server installed it.
    pub fn global() -> Option<Arc<Board>> {
        BOARD.get().cloned()
    }

    pub fn install(board: Arc<Board>) {
        let _ = BOARD.set(board);
    }

    /// Adds one rendering of the exporter.
    pub fn record(&self, text: &str) {
        let at = self.started.elapsed().as_secs_f64();
        self.record_at(at, scrape::parse(text));
    }

    fn record_at(&self, at: f64, scrape: Scrape) {
        let mut h = self
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        h.push_back((at, scrape));
        while h.len() > SAMPLES_KEPT {
            h.pop_front();
        }
    }

    /// The picture now.
    pub fn status(&self) -> Status {
        let h = self
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let samples: Vec<&(f64, Scrape)> = h.iter().collect();
        let empty = Scrape::default();
        let last = samples.last().map_or(&empty, |(_, s)| s);
        let phase = phase();
        let gauge = |name: &str, filter: &[(&str, &str)]| last.sum(name, filter);
        let rate = |name: &str, label: &str, values: &[String]| -> Vec<f64> {
            rates(&samples, |s| {
                values
                    .iter()
                    .map(|v| s.sum(name, &[(label, v)]).unwrap_or(0.0))
                    .sum()
            })
        };
        let level = |name: &str, label: &str, values: &[String]| -> Vec<f64> {
            samples
                .iter()
                .map(|(_, s)| {
                    values
                        .iter()
                        .map(|v| s.sum(name, &[(label, v)]).unwrap_or(0.0))
                        .sum()
                })
                .collect()
        };
        let alerts: Vec<AlertStatus> = Alert::ALL
            .iter()
            .filter(|a| a.role() == self.role)
            .map(|a| AlertStatus {
                alert: a.name(),
                firing: gauge(super::ALERT, &[("alert", a.name())]).is_some_and(|v| v >= 1.0),
                condition: a.condition(),
                runbook: a.runbook(),
            })
            .collect();
        let firing = |a: Alert| alerts.iter().any(|s| s.alert == a.name() && s.firing);
        let mut status = Status {
            role: self.role,
            pipeline: self.pipeline.clone(),
            phase,
            ready: phase.is_ready(),
            uptime_secs: self.started.elapsed().as_secs(),
            sample_every_secs: SAMPLE_EVERY.as_secs(),
            samples: samples.len(),
            tables: Vec::new(),
            slot: None,
            read_models: Vec::new(),
            dead_letters: None,
            alerts: Vec::new(),
        };
        match self.role {
            Role::Connector => {
                for t in &self.tables {
                    let one = std::slice::from_ref(t);
                    let events = rate(super::EVENTS, "table", one);
                    status.tables.push(TableStatus {
                        table: t.clone(),
                        events_total: gauge(super::EVENTS, &[("table", t)]).unwrap_or(0.0),
                        events_per_sec: now_rate(&events),
                        events_per_sec_history: events,
                        snapshot_rows: gauge(super::SNAPSHOT_ROWS, &[("table", t)]).unwrap_or(0.0),
                        snapshot_rows_estimated: gauge(
                            super::SNAPSHOT_ROWS_ESTIMATED,
                            &[("table", t)],
                        ),
                        hot_keys: hot_keys(last, t),
                        salted_events_total: gauge(super::SALTED_EVENTS, &[("table", t)])
                            .unwrap_or(0.0),
                    });
                }
                let retained: Vec<f64> = samples
                    .iter()
                    .map(|(_, s)| s.sum(super::SLOT_RETAINED_WAL_BYTES, &[]).unwrap_or(0.0))
                    .collect();
                status.slot = Some(SlotStatus {
                    slot: self.slot.clone(),
                    confirmed_lsn: gauge(super::CONFIRMED_LSN, &[])
                        .map(|v| crate::source::pgoutput::Lsn(v as u64).to_string()),
                    lag_bytes: gauge(super::REPLICATION_LAG_BYTES, &[]),
                    retained_wal_bytes: gauge(super::SLOT_RETAINED_WAL_BYTES, &[]),
                    retained_wal_history: retained,
                    stalled: firing(Alert::SlotStalled),
                    wal_at_risk: firing(Alert::SlotWalAtRisk),
                });
            }
            Role::Materializer => {
                for m in &self.models {
                    let applied = rate(super::MATERIALIZE_APPLIED, "table", &m.tables);
                    let duplicates = rate(super::MATERIALIZE_DUPLICATES, "table", &m.tables);
                    let lag = level(super::MATERIALIZE_CONSUMER_LAG, "topic", &m.topics);
                    status.read_models.push(ReadModelStatus {
                        name: m.name.clone(),
                        kind: m.kind,
                        tables: m.tables.clone(),
                        consumer_lag: lag.last().copied().unwrap_or(0.0),
                        consumer_lag_history: lag,
                        applied_per_sec: now_rate(&applied),
                        applied_per_sec_history: applied,
                        duplicates_per_sec: now_rate(&duplicates),
                        duplicates_per_sec_history: duplicates,
                        reach_requirement_met: gauge(
                            super::REACH_REQUIREMENT_MET,
                            &[("read_model", &m.name)],
                        )
                        .map(|v| v >= 1.0),
                    });
                }
                let open_states: Vec<String> = crate::dlq::State::ALL
                    .iter()
                    .filter(|s| !s.is_final())
                    .map(|s| s.as_str().to_string())
                    .collect();
                let arrivals: Vec<f64> = samples
                    .iter()
                    .map(|(_, s)| s.sum(super::DLQ_ARRIVALS, &[]).unwrap_or(0.0))
                    .collect();
                status.dead_letters = Some(DeadLetterStatus {
                    open: open_states
                        .iter()
                        .filter_map(|st| gauge(super::DLQ_DEPTH, &[("state", st)]))
                        .sum(),
                    oldest_open_age_secs: gauge(super::DLQ_OLDEST_AGE, &[]),
                    replay_success_ratio: gauge(super::DLQ_REPLAY_SUCCESS, &[]),
                    arrivals_last_hour: gauge(super::DLQ_ARRIVALS, &[]),
                    arrival_baseline_per_hour: gauge(super::DLQ_ARRIVAL_BASELINE, &[]),
                    arrivals_history: arrivals,
                });
            }
        }
        status.alerts = alerts;
        status
    }
}

/// Per-second rates between consecutive samples of a counter (`value`
/// reads it from one sample); a counter that went down (a restart) counts
/// as 0.
fn rates(samples: &[&(f64, Scrape)], value: impl Fn(&Scrape) -> f64) -> Vec<f64> {
    let values: Vec<(f64, f64)> = samples.iter().map(|(t, s)| (*t, value(s))).collect();
    values
        .windows(2)
        .map(|w| {
            let dt = w[1].0 - w[0].0;
            if dt <= 0.0 {
                0.0
            } else {
                ((w[1].1 - w[0].1) / dt).max(0.0)
            }
        })
        .collect()
}

/// The mean of the last few rates.
fn now_rate(rates: &[f64]) -> f64 {
    let tail = &rates[rates.len().saturating_sub(RATE_WINDOW)..];
    if tail.is_empty() {
        0.0
    } else {
        tail.iter().sum::<f64>() / tail.len() as f64
    }
}

/// `/status`: what the page shows, as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub role: Role,
    pub pipeline: String,
    pub phase: Phase,
    pub ready: bool,
    pub uptime_secs: u64,
    pub sample_every_secs: u64,
    /// Samples behind the histories (one every `sample_every_secs`).
    pub samples: usize,
    /// The connector's captured tables.
    pub tables: Vec<TableStatus>,
    /// The connector's slot.
    pub slot: Option<SlotStatus>,
    /// The materializer's read models, then its mirrors.
    pub read_models: Vec<ReadModelStatus>,
    /// The materializer's dead-letter health.
    pub dead_letters: Option<DeadLetterStatus>,
    pub alerts: Vec<AlertStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TableStatus {
    pub table: String,
    pub events_total: f64,
    pub events_per_sec: f64,
    pub events_per_sec_history: Vec<f64>,
    pub snapshot_rows: f64,
    /// The planner's estimate of the table's rows when its snapshot began.
    pub snapshot_rows_estimated: Option<f64>,
    /// Keys at or above `hot_keys.report_per_sec`, hottest first.
    pub hot_keys: Vec<HotKeyStatus>,
    pub salted_events_total: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct HotKeyStatus {
    /// The key's text (a fingerprint under `hot_keys.redact_keys`).
    pub key: String,
    /// Changes per second, a lower bound.
    pub rate_per_sec: f64,
    /// Its part of the table's changes.
    pub share: f64,
    pub salted: bool,
}

/// A table's hot keys in the latest sample (cooled keys read 0).
fn hot_keys(last: &Scrape, table: &str) -> Vec<HotKeyStatus> {
    let filter = [("table", table)];
    let mut out: Vec<HotKeyStatus> = last
        .matching(super::HOT_KEY_RATE, &filter)
        .filter(|s| s.value > 0.0)
        .filter_map(|s| {
            let key = s.labels.get("key")?.clone();
            let one = [("table", table), ("key", key.as_str())];
            let share = last.sum(super::HOT_KEY_SHARE, &one).unwrap_or(0.0);
            let salted = last.sum(super::HOT_KEY_SALTED, &one).unwrap_or(0.0) >= 1.0;
            Some(HotKeyStatus {
                rate_per_sec: s.value,
                share,
                salted,
                key,
            })
        })
        .collect();
    out.sort_by(|a, b| b.rate_per_sec.total_cmp(&a.rate_per_sec));
    out
}

#[derive(Debug, Clone, Serialize)]
pub struct SlotStatus {
    pub slot: String,
    pub confirmed_lsn: Option<String>,
    pub lag_bytes: Option<f64>,
    pub retained_wal_bytes: Option<f64>,
    pub retained_wal_history: Vec<f64>,
    pub stalled: bool,
    pub wal_at_risk: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReadModelStatus {
    pub name: String,
    /// `read model` or `mirror`.
    pub kind: &'static str,
    /// The captured tables it reads.
    pub tables: Vec<String>,
    /// Messages of its source topics not yet applied.
    pub consumer_lag: f64,
    pub consumer_lag_history: Vec<f64>,
    pub applied_per_sec: f64,
    pub applied_per_sec_history: Vec<f64>,
    pub duplicates_per_sec: f64,
    pub duplicates_per_sec_history: Vec<f64>,
    /// `None` when it has no `require_reach` (or none was checked yet).
    pub reach_requirement_met: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeadLetterStatus {
    pub open: f64,
    pub oldest_open_age_secs: Option<f64>,
    pub replay_success_ratio: Option<f64>,
    pub arrivals_last_hour: Option<f64>,
    pub arrival_baseline_per_hour: Option<f64>,
    pub arrivals_history: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AlertStatus {
    pub alert: &'static str,
    pub firing: bool,
    pub condition: &'static str,
    /// The README's runbook for it.
    pub runbook: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        let toml = r#"
name = "demo"
[source]
url = "postgres://u@localhost/db"
slot = "s"
publication = "p"
tables = ["public.orders", "public.customers"]
[kafka]
brokers = "localhost:9092"
topic_prefix = "demo"
[registry]
url = "http://localhost:8081"
[target]
url = "postgres://u@localhost/t"
[read_models.order_summary]
table = "read_models.order_summary"
key = ["order_id"]
query = "SELECT 1"
sources = [{ table = "public.orders", key_columns = ["id"] }]
"#;
        Config::from_toml(toml, "test.toml", &[]).expect("config")
    }

    #[test]
    fn rates_come_from_consecutive_samples_and_restarts_count_as_zero() {
        let b = Board::new(Role::Connector, &config());
        let line = |n: u64| format!("pgcdc_events_total{{table=\"public.orders\",op=\"c\"}} {n}\n");
        b.record_at(0.0, scrape::parse(&line(0)));
        b.record_at(2.0, scrape::parse(&line(100)));
        b.record_at(4.0, scrape::parse(&line(500)));
        b.record_at(6.0, scrape::parse(&line(10)));
        let s = b.status();
        let orders = s
            .tables
            .iter()
            .find(|t| t.table == "public.orders")
            .expect("orders");
        assert_eq!(orders.events_per_sec_history, vec![50.0, 200.0, 0.0]);
        assert_eq!(orders.events_total, 10.0);
        let customers = s
            .tables
            .iter()
            .find(|t| t.table == "public.customers")
            .expect("customers");
        assert_eq!(customers.events_per_sec_history, vec![0.0, 0.0, 0.0]);
        assert!(
            s.read_models.is_empty(),
            "the connector shows no read models"
        );
    }

    #[test]
    fn a_read_model_sums_its_source_tables_and_topics_and_alerts_belong_to_their_role() {
        let b = Board::new(Role::Materializer, &config());
        let text = |applied: u64, lag: u64| {
            format!(
                "pgcdc_materialize_applied_total{{table=\"public.orders\"}} {applied}\n\
                 pgcdc_materialize_applied_total{{table=\"public.customers\"}} 7\n\
                 pgcdc_materialize_consumer_lag{{topic=\"demo.public.orders\",partition=\"0\"}} {lag}\n\
                 pgcdc_materialize_consumer_lag{{topic=\"demo.public.orders\",partition=\"1\"}} 1\n\
                 pgcdc_alert{{alert=\"dlq_oldest_overdue\"}} 1\n\
                 pgcdc_alert{{alert=\"slot_stalled\"}} 1\n"
            )
        };
        b.record_at(0.0, scrape::parse(&text(0, 9)));
        b.record_at(1.0, scrape::parse(&text(30, 4)));
        let s = b.status();
        let rm = s
            .read_models
            .iter()
            .find(|m| m.name == "order_summary")
            .expect("read model");
        assert_eq!(rm.applied_per_sec_history, vec![30.0]);
        assert_eq!(rm.consumer_lag_history, vec![10.0, 5.0]);
        assert_eq!(rm.consumer_lag, 5.0);
        assert_eq!(s.read_models.len(), 3, "one read model and two mirrors");
        let names: Vec<&str> = s.alerts.iter().map(|a| a.alert).collect();
        assert!(!names.contains(&"slot_stalled"), "{names:?}");
        assert!(s
            .alerts
            .iter()
            .any(|a| a.alert == "dlq_oldest_overdue" && a.firing));
        assert!(s
            .alerts
            .iter()
            .any(|a| a.alert == "dlq_arrival_burst" && !a.firing));
    }

    #[test]
    fn nothing_leaves_stopping() {
        // The phase is process-wide; this is the only test that moves it.
        set_phase(Phase::Streaming);
        assert!(phase().is_ready());
        set_phase(Phase::Stopping);
        set_phase(Phase::Streaming);
        assert_eq!(phase(), Phase::Stopping);
        assert!(!phase().is_ready());
    }
}
