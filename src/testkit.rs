//! A kit for integration tests against a real stack (feature `testkit`):
//! attach to (or bring up) the stack, run a pipeline in-process, wait until
//! its read models have caught up with a source LSN, and compare two read
//! models with a readable diff.
//!
//! Guarantees:
//! - **No sleeps stand in for conditions.** [`Pipeline::wait_caught_up`]
//!   returns once the initial snapshot completed and the slot confirmed
//!   the LSN (Kafka holds every change up to it) and every consumer group of the pipeline committed offsets up
//!   to the topics' end offsets taken after that (its read model applied
//!   them); it polls those conditions and fails with what is missing after
//!   its timeout, or as soon as a part of the pipeline has failed.
//! - **A diff names rows by key** and the columns that differ.
//!
//! Caught up means applied or dead-lettered: the materializer commits the
//! offsets of a batch whose changes it quarantined. With
//! `kafka.exactly_once` the end offsets include transaction markers that
//! no consumer commits past, so the wait does not end; use it with the
//! default producer.
//!
//! ```text
//!  write ──► current_lsn ──► wait_caught_up: slot confirmed ≥ lsn ──► end offsets ──► groups committed ≥ end offsets
//! ```

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use crate::config::{Config, KafkaConfig};
use crate::projection::{Projection, Upcasters};
use crate::secret::Dsn;
use crate::{sink, source};

/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum KitError {
    #[error("stack: {0}")]
    Stack(String),
    #[error("not caught up after {waited:?}: {missing}")]
    Timeout { waited: Duration, missing: String },
    #[error("{part} stopped: {error}")]
    Stopped { part: String, error: String },
    /// A read model with two rows of one key: keys must be unique to compare.
    #[error("{name}: more than one row has the key {key}")]
    DuplicateKey { name: String, key: String },
    #[error("postgres: {}", source::error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

/// Connection settings of a stack, as `scripts/stack env` exports them.
#[derive(Debug, Clone)]
pub struct Stack {
    pub source_url: String,
    pub target_url: String,
    pub brokers: String,
    pub registry_url: String,
}

impl Stack {
    /// Attaches to the stack named by `PGCDC_SOURCE_URL`,
    /// `PGCDC_TARGET_URL`, `PGCDC_KAFKA_BROKERS` and `PGCDC_REGISTRY_URL`.
    pub fn from_env() -> Result<Stack, KitError> {
        Stack::from_lookup(|name| std::env::var(name).ok())
    }

    /// Brings up the local stack with `<repo>/scripts/stack up` (a no-op
    /// for what already runs) and attaches to it.
    pub fn up(repo: &Path) -> Result<Stack, KitError> {
        let script = repo.join("scripts/stack");
        let up = std::process::Command::new(&script)
            .arg("up")
            .status()
            .map_err(|e| KitError::Stack(format!("{}: {e}", script.display())))?;
        if !up.success() {
            return Err(KitError::Stack(format!(
                "scripts/stack up exited with {up}"
            )));
        }
        let env = std::process::Command::new(&script)
            .arg("env")
            .output()
            .map_err(|e| KitError::Stack(format!("{}: {e}", script.display())))?;
        let text = String::from_utf8_lossy(&env.stdout).into_owned();
        let vars = parse_exports(&text);
        Stack::from_lookup(|name| vars.get(name).cloned())
    }

    fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Stack, KitError> {
        let var = |name: &str| {
            get(name).ok_or_else(|| {
                KitError::Stack(format!(
                    "{name} is not set: run `scripts/stack up && eval \"$(scripts/stack env)\"`, or use Stack::up"
                ))
            })
        };
        Ok(Stack {
            source_url: var("PGCDC_SOURCE_URL")?,
            target_url: var("PGCDC_TARGET_URL")?,
            brokers: var("PGCDC_KAFKA_BROKERS")?,
            registry_url: var("PGCDC_REGISTRY_URL")?,
        })
    }
}

/// `export NAME=value` lines (values optionally single-quoted).
fn parse_exports(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            let v = v.trim();
            let v = v
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .or_else(|| v.strip_prefix('"').and_then(|v| v.strip_suffix('"')))
                .unwrap_or(v);
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// The WAL insert position: wait for it after a write to see that write.
pub async fn current_lsn(client: &Client) -> Result<String, KitError> {
    Ok(client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0))
}

/// What one look at a condition found.
enum Probe<T> {
    Done(T),
    /// Not yet: what is missing, in words.
    Missing(String),
}

struct Part {
    name: String,
    /// `None` once it ended and its result was reported.
    handle: Option<JoinHandle<Result<(), String>>>,
    /// `None`: stopped by aborting the task (the connector and the
    /// materializer stop on signals only; an abort loses nothing, the
    /// slot and the group replay).
    stop: Option<oneshot::Sender<()>>,
    /// The consumer group and its topics, when it consumes.
    group: Option<(String, Vec<String>)>,
}

/// A pipeline running in this process: the connector, the materializer
/// (when the config has a target) and any projections.
pub struct Pipeline {
    config: Config,
    parts: Vec<Part>,
}

impl fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<&str> = self.parts.iter().map(|p| p.name.as_str()).collect();
        f.debug_struct("Pipeline")
            .field("name", &self.config.name)
            .field("parts", &parts)
            .finish()
    }
}

impl Pipeline {
    /// Starts the connector and, when `config.target` is set, the
    /// materializer, as tasks of the current runtime.
    pub fn start(config: Config) -> Pipeline {
        let mut parts = Vec::new();
        let c = config.clone();
        parts.push(Part {
            name: "connector".into(),
            handle: Some(tokio::spawn(async move {
                crate::connector::run(c).await.map_err(|e| e.to_string())
            })),
            stop: None,
            group: None,
        });
        if let Some(target) = &config.target {
            let c = config.clone();
            let group = crate::materialize::group_id(&config, target);
            let topics = config
                .changelog_tables()
                .map(|t| config.topic_for(t))
                .collect();
            parts.push(Part {
                name: "materializer".into(),
                handle: Some(tokio::spawn(async move {
                    crate::materialize::run(c).await.map_err(|e| e.to_string())
                })),
                stop: None,
                group: Some((group, topics)),
            });
        }
        Pipeline { config, parts }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Runs `projection` over the domain-event `topics` as consumer group
    /// `group`, writing into the database at `url`.
    pub fn project(
        &mut self,
        projection: Arc<dyn Projection>,
        upcasters: Arc<Upcasters>,
        topics: Vec<String>,
        group: &str,
        url: &Dsn,
    ) {
        let (tx, rx) = oneshot::channel();
        let kafka = self.config.kafka.clone();
        let url = url.clone();
        let g = group.to_string();
        let t = topics.clone();
        let name = format!("projection {}", projection.name());
        let handle = tokio::spawn(async move {
            let stop = async {
                let _ = rx.await;
            };
            crate::projection::follow(&kafka, &g, &t, &url, projection, upcasters, stop)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        self.parts.push(Part {
            name,
            handle: Some(handle),
            stop: Some(tx),
            group: Some((group.to_string(), topics)),
        });
    }

    /// Waits until every read model of the pipeline has applied every
    /// change the source committed up to `lsn` (see the module doc).
    pub async fn wait_caught_up(
        &mut self,
        source: &Client,
        lsn: &str,
        timeout: Duration,
    ) -> Result<(), KitError> {
        let deadline = (Instant::now(), timeout);
        let slot = self.config.source.slot.clone();
        // A slot confirms its consistent point as soon as it exists, while
        // the snapshot of what was written before is still on its way to
        // Kafka: that snapshot must have completed first.
        if self.config.source.snapshot.mode != crate::config::SnapshotMode::Never {
            self.until(deadline, async |config: &Config| {
                let topic = crate::snapshot_marker::topic(config);
                let marker = crate::snapshot_marker::latest(&config.kafka, &topic, &slot)
                    .await
                    .ok()
                    .flatten();
                Ok(match marker {
                    Some(m) if m.phase == crate::snapshot_marker::Phase::Completed => {
                        Probe::Done(())
                    }
                    _ => Probe::Missing(format!(
                        "the initial snapshot of slot {slot} has not completed"
                    )),
                })
            })
            .await?;
        }
        self.until(deadline, async |_: &Config| {
            let reached: bool = source
                .query_one(
                    "SELECT coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1
                     UNION ALL SELECT false LIMIT 1",
                    &[&slot, &lsn],
                )
                .await?
                .get(0);
            Ok(if reached {
                Probe::Done(())
            } else {
                Probe::Missing(format!("slot {slot} has not confirmed {lsn}"))
            })
        })
        .await?;
        let groups: Vec<(String, Vec<String>)> =
            self.parts.iter().filter_map(|p| p.group.clone()).collect();
        for (group, topics) in groups {
            // A topic not created yet is not caught up with.
            let ends = self
                .until(deadline, async |config: &Config| {
                    let ends = end_offsets(&config.kafka, &topics).await?;
                    let missing: Vec<&String> = topics
                        .iter()
                        .filter(|t| !ends.keys().any(|(name, _)| name == *t))
                        .collect();
                    Ok(if missing.is_empty() {
                        Probe::Done(ends)
                    } else {
                        Probe::Missing(format!("group {group}: no topic {missing:?}"))
                    })
                })
                .await?;
            self.until(deadline, async |config: &Config| {
                let committed =
                    sink::group_committed(&config.kafka, &group, ends.keys().cloned()).await?;
                let behind: Vec<String> = ends
                    .iter()
                    .filter_map(|(tp, end)| {
                        let at = committed.get(tp).copied().unwrap_or(0);
                        (*end > 0 && at < *end)
                            .then(|| format!("{}[{}] at {at} of {end}", tp.0, tp.1))
                    })
                    .collect();
                Ok(if behind.is_empty() {
                    Probe::Done(())
                } else {
                    Probe::Missing(format!("group {group}: {}", behind.join(", ")))
                })
            })
            .await?;
        }
        Ok(())
    }

    /// Polls `probe` until it is done: fails at once when a part of the
    /// pipeline stopped, and with what is missing once `deadline` passed.
    async fn until<T>(
        &mut self,
        (started, timeout): (Instant, Duration),
        mut probe: impl AsyncFnMut(&Config) -> Result<Probe<T>, KitError>,
    ) -> Result<T, KitError> {
        loop {
            self.check_running().await?;
            match probe(&self.config).await? {
                Probe::Done(t) => return Ok(t),
                Probe::Missing(missing) if started.elapsed() > timeout => {
                    return Err(KitError::Timeout {
                        waited: started.elapsed(),
                        missing,
                    })
                }
                Probe::Missing(_) => tokio::time::sleep(POLL).await,
            }
        }
    }

    /// An error when a part of the pipeline has ended.
    async fn check_running(&mut self) -> Result<(), KitError> {
        for part in &mut self.parts {
            if let Some(handle) = part.handle.take_if(|h| h.is_finished()) {
                let error = match handle.await {
                    Ok(Ok(())) => "it ended".to_string(),
                    Ok(Err(e)) => e,
                    Err(e) => e.to_string(),
                };
                return Err(KitError::Stopped {
                    part: part.name.clone(),
                    error,
                });
            }
        }
        Ok(())
    }

    /// Stops every part (projections first, cleanly; then the rest).
    pub async fn stop(self) {
        for part in self.parts.into_iter().rev() {
            let Some(handle) = part.handle else { continue };
            match part.stop {
                Some(tx) => {
                    let _ = tx.send(());
                    let _ = handle.await;
                }
                None => {
                    handle.abort();
                    let _ = handle.await;
                }
            }
        }
    }
}

type Offsets = BTreeMap<(String, i32), i64>;

async fn end_offsets(kafka: &KafkaConfig, topics: &[String]) -> Result<Offsets, KitError> {
    let mut out = Offsets::new();
    for (topic, parts) in sink::watermarks(kafka, topics)
        .await
        .map_err(KitError::Stack)?
    {
        for (p, (_, high)) in parts {
            out.insert((topic.clone(), p), high);
        }
    }
    Ok(out)
}

/// A read model's rows, by key: the result of a query, each row as JSON
/// (`to_jsonb`), so that two models built differently compare by value
/// (numbers compare as numbers: `10.50` equals `10.5`, exactly to about 15
/// significant digits).
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub name: String,
    pub key: Vec<String>,
    pub rows: BTreeMap<String, serde_json::Map<String, serde_json::Value>>,
}

impl Rows {
    /// Runs `query` and keys its rows by the `key` columns.
    pub async fn read(
        client: &Client,
        name: &str,
        query: &str,
        key: &[&str],
    ) -> Result<Rows, KitError> {
        let rows = client
            .query(&format!("SELECT to_jsonb(q)::text FROM ({query}) q"), &[])
            .await?;
        let mut out = BTreeMap::new();
        for r in rows {
            let text: String = r.get(0);
            let serde_json::Value::Object(map) =
                serde_json::from_str(&text).unwrap_or(serde_json::Value::Null)
            else {
                continue;
            };
            let k = key_text(&map, key);
            if out.insert(k.clone(), map).is_some() {
                return Err(KitError::DuplicateKey {
                    name: name.to_string(),
                    key: k,
                });
            }
        }
        Ok(Rows {
            name: name.to_string(),
            key: key.iter().map(|k| k.to_string()).collect(),
            rows: out,
        })
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The differences to `other`, or `None` when both hold the same rows.
    pub fn diff(&self, other: &Rows) -> Option<Diff> {
        let mut lines = Vec::new();
        for (k, row) in &self.rows {
            match other.rows.get(k) {
                None => lines.push(format!("only in {}: {k} {}", self.name, json(row))),
                Some(o) if o != row => {
                    let mut cols: Vec<&String> = row.keys().chain(o.keys()).collect();
                    cols.sort();
                    cols.dedup();
                    let changed: Vec<String> = cols
                        .into_iter()
                        .filter(|c| !same(row.get(*c), o.get(*c)))
                        .map(|c| format!("{c}: {} vs {}", show(row.get(c)), show(o.get(c))))
                        .collect();
                    lines.push(format!("{k}: {}", changed.join("; ")));
                }
                Some(_) => {}
            }
        }
        for (k, row) in &other.rows {
            if !self.rows.contains_key(k) {
                lines.push(format!("only in {}: {k} {}", other.name, json(row)));
            }
        }
        (!lines.is_empty()).then(|| Diff {
            left: format!("{} ({} rows)", self.name, self.len()),
            right: format!("{} ({} rows)", other.name, other.len()),
            lines,
        })
    }
}

fn same(a: Option<&serde_json::Value>, b: Option<&serde_json::Value>) -> bool {
    match (a, b) {
        (Some(serde_json::Value::Number(x)), Some(serde_json::Value::Number(y))) => {
            x.as_f64() == y.as_f64()
        }
        _ => a == b,
    }
}

fn key_text(row: &serde_json::Map<String, serde_json::Value>, key: &[&str]) -> String {
    key.iter()
        .map(|k| format!("{k}={}", show(row.get(*k))))
        .collect::<Vec<_>>()
        .join(",")
}

fn show(v: Option<&serde_json::Value>) -> String {
    match v {
        None => "(no column)".into(),
        Some(v) => v.to_string(),
    }
}

fn json(row: &serde_json::Map<String, serde_json::Value>) -> String {
    serde_json::Value::Object(row.clone()).to_string()
}

/// How two read models differ, line by line (at most 25 shown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diff {
    pub left: String,
    pub right: String,
    pub lines: Vec<String>,
}

impl fmt::Display for Diff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = format!(
            "read models differ: {} vs {}, {} differences\n",
            self.left,
            self.right,
            self.lines.len()
        );
        for l in self.lines.iter().take(25) {
            let _ = writeln!(out, "  {l}");
        }
        if self.lines.len() > 25 {
            let _ = writeln!(out, "  ... and {} more", self.lines.len() - 25);
        }
        f.write_str(&out)
    }
}

/// Panics with the diff when `left` and `right` differ.
pub fn assert_same(left: &Rows, right: &Rows) {
    if let Some(d) = left.diff(right) {
        panic!("{d}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(name: &str, data: serde_json::Value) -> Rows {
        let mut out = BTreeMap::new();
        for r in data.as_array().into_iter().flatten() {
            let map = r.as_object().cloned().unwrap_or_default();
            out.insert(key_text(&map, &["id"]), map);
        }
        Rows {
            name: name.into(),
            key: vec!["id".into()],
            rows: out,
        }
    }

    #[test]
    fn a_diff_names_missing_extra_and_changed_rows_by_key() {
        let cdc = rows(
            "cdc",
            json!([{"id": 1, "amount": 10.5, "status": "settled"}, {"id": 2, "amount": 3}]),
        );
        let es = rows(
            "es",
            json!([{"id": 1, "amount": 10.50, "status": "reversed"}, {"id": 3, "amount": 4}]),
        );
        let d = cdc.diff(&es).expect("they differ");
        assert_eq!(
            d.lines,
            vec![
                "id=1: status: \"settled\" vs \"reversed\"".to_string(),
                "only in cdc: id=2 {\"amount\":3,\"id\":2}".to_string(),
                "only in es: id=3 {\"amount\":4,\"id\":3}".to_string(),
            ]
        );
        assert!(d
            .to_string()
            .starts_with("read models differ: cdc (2 rows) vs es (2 rows), 3 differences"));
        assert_eq!(cdc.diff(&cdc.clone()), None);
    }

    /// A repository whose `scripts/stack` is the given shell script.
    fn repo(script: &str) -> tempfile::TempDir {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("scripts")).expect("scripts");
        let path = dir.path().join("scripts/stack");
        std::fs::write(&path, script).expect("script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        dir
    }

    #[test]
    fn up_runs_the_stack_script_and_attaches_to_what_it_exports() {
        let ok = repo(
            "#!/bin/sh\ncase \"$1\" in\n up) exit 0 ;;\n env) echo \"export PGCDC_SOURCE_URL='postgres://s'\"; echo \"export PGCDC_TARGET_URL='postgres://t'\"; echo \"export PGCDC_KAFKA_BROKERS='127.0.0.1:1'\"; echo \"export PGCDC_REGISTRY_URL='http://r'\" ;;\nesac\n",
        );
        let stack = Stack::up(ok.path()).expect("attached");
        assert_eq!(stack.source_url, "postgres://s");
        assert_eq!(stack.brokers, "127.0.0.1:1");
        let failing = repo("#!/bin/sh\nexit 3\n");
        let err = Stack::up(failing.path())
            .expect_err("up failed")
            .to_string();
        assert!(
            err.starts_with("stack: scripts/stack up exited with"),
            "{err}"
        );
        let partial =
            repo("#!/bin/sh\n[ \"$1\" = env ] && echo \"export PGCDC_SOURCE_URL=x\"\nexit 0\n");
        let err = Stack::up(partial.path())
            .expect_err("missing settings")
            .to_string();
        assert!(err.contains("PGCDC_TARGET_URL is not set"), "{err}");
    }

    #[test]
    fn exports_parse_as_scripts_stack_env_prints_them() {
        let vars = parse_exports("export PGCDC_SOURCE_URL='postgres://a@b/c'\nexport X=1\n# no\n");
        assert_eq!(vars["PGCDC_SOURCE_URL"], "postgres://a@b/c");
        assert_eq!(vars["X"], "1");
        assert_eq!(vars.len(), 2);
    }
}
