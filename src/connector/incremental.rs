//! Incremental snapshots: fresh copies of tables taken in chunks while
//! streaming goes on (`pgcdc snapshot --table ...`): DBLog's algorithm,
//! with the window defined by transaction visibility rather than a low
//! watermark (as Debezium's read-only incremental snapshots for Postgres).
//!
//! Guarantees:
//! - **A snapshot row never overwrites a newer change.** Each chunk is
//!   read in a REPEATABLE READ transaction whose snapshot `S` it records
//!   (`pg_current_snapshot()`), then a high watermark is written to the
//!   WAL (`pg_logical_emit_message`, transactional). Every transaction `S`
//!   sees committed before `S` was taken, so it is streamed before the high
//!   watermark and the chunk already holds its effect. A transaction `S`
//!   does not see that is streamed before the high watermark has a newer
//!   image of what it touched: those keys are dropped from the chunk. The
//!   rest are produced at the high watermark (`op = r`,
//!   `source.snapshot = incremental`) with its transaction's commit LSN as
//!   their position, so they order after every earlier change of their key
//!   and before every later one. Visibility, not WAL order, decides: a
//!   transaction can write its commit record before another one and still
//!   become visible after it, which a low watermark in the WAL misses.
//! - **Keys are watched before the first chunk.** Streamed changes of the
//!   table being read are recorded (key → transaction id) from the moment
//!   its turn comes, and its first chunk waits until every transaction
//!   running at that moment has ended, so none of them can be invisible to
//!   a chunk and yet streamed before the watching began.
//! - **Nothing is confirmed early.** Chunk rows are produced inside the
//!   high watermark's transaction, so the slot is confirmed past it only
//!   once Kafka acknowledged them; a chunk's cursor (and the completion)
//!   is recorded only after Kafka acknowledged its rows.
//! - **Exact start offsets.** The start offsets are read once Kafka
//!   acknowledged everything produced before the request, so reading a
//!   topic from them yields every change after the request and none
//!   before it; with the chunk rows, every row the table had when the
//!   snapshot completed.
//! - **Resumable, never looping.** Markers in `<prefix>.snapshots` (keyed
//!   `<slot>/incremental/<id>`) record the start offsets before any row,
//!   the cursor after each chunk, and completion. A restarted connector
//!   resumes after the last recorded chunk; watermarks of chunks read
//!   before the restart no longer match and are ignored. A chunk that
//!   cannot be read is tried a few times, then the snapshot is recorded
//!   as `failed` with the reason and streaming goes on.
//!
//! ```text
//!  pgcdc snapshot ──► signal (WAL message) ──► connector: marker(started, start offsets), watch the table's keys
//!  per chunk:  BEGIN REPEATABLE READ ─ S = pg_current_snapshot() ─ SELECT … WHERE key > cursor ORDER BY key LIMIT n ─ COMMIT ─► high watermark
//!  stream:     high watermark seen ──► drop keys last changed by a transaction S does not see ──► produce the rest, marker(cursor)
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio_postgres::Client;

use super::{column_list, copy_inputs, now_ms, sql_session, Output, RunError};
use crate::config::{split_table, Config};
use crate::encode::{Op, Position, SourceInfo, TableCodec, TableDesc};
use crate::observe;
use crate::snapshot_marker::{self, Cursor, Kind, Marker, Phase};
use crate::source::pgoutput::{Datum, Lsn};
use crate::source::{catalog, slot};

/// The prefix of a request for an incremental snapshot.
pub const SIGNAL_PREFIX: &str = "pgcdc.signal";
/// The prefix of chunk watermarks.
pub const WATERMARK_PREFIX: &str = "pgcdc.watermark";
/// Reads of one chunk before the snapshot is given up.
const MAX_ATTEMPTS: u32 = 4;

/// A request, as written to the WAL by [`signal`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signal {
    pub slot: String,
    pub id: String,
    /// [`SNAPSHOT`] (of `tables`) or [`STOP`] (of the snapshots `stop`).
    pub kind: String,
    pub tables: Vec<String>,
    /// The ids of the snapshots a [`STOP`] ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
}

/// A signal's kind: take a snapshot.
pub const SNAPSHOT: &str = "snapshot";
/// A signal's kind: stop snapshots.
pub const STOP: &str = "stop";
/// The reason a stopped snapshot's marker gives.
pub const STOPPED: &str = "stopped on request (pgcdc snapshot --stop)";

/// The end of a chunk's read, in the WAL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Watermark {
    slot: String,
    token: String,
}

/// Which transactions a snapshot sees, by their 32-bit ids (as the stream
/// names them; compared modulo 2^32 like Postgres does).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Visibility {
    xmin: u32,
    xmax: u32,
    xip: HashSet<u32>,
}

/// `a` comes before `b` (Postgres's `TransactionIdPrecedes`).
fn precedes(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

impl Visibility {
    /// Whether the snapshot sees the (committed) transaction `xid`.
    fn sees(&self, xid: u32) -> bool {
        precedes(xid, self.xmax) && !self.xip.contains(&xid)
    }
}

/// Streamed changes of the table whose turn it is: key → the transaction
/// that changed it last, and the last truncate's transaction.
#[derive(Debug, Default)]
struct Watch {
    table: String,
    keys: HashMap<Vec<Vec<u8>>, u32>,
    truncate: Option<u32>,
}

/// Checks the tables of a request: captured, and with a key to order
/// chunks by.
pub async fn check_tables(sql: &Client, config: &Config, tables: &[String]) -> Result<(), String> {
    if tables.is_empty() {
        return Err("--table: name at least one table".into());
    }
    for t in tables {
        if !config.source.tables.contains(t) {
            return Err(format!("--table {t}: not one of source.tables"));
        }
        // Its rows are events already routed: reading them again would put
        // older versions after newer ones in the domain topics.
        if config.outbox.contains_key(t) {
            return Err(format!(
                "--table {t}: an outbox table is not re-snapshotted (its events are in the domain-event topics; rebuild projections from the event store)"
            ));
        }
        let (schema, name) =
            split_table(t).ok_or_else(|| format!("--table {t}: not schema.table"))?;
        let (oid, _) = catalog::describe(sql, &schema, &name)
            .await
            .map_err(|e| crate::source::error_text(&e))?
            .ok_or_else(|| format!("--table {t}: the table does not exist"))?;
        let keys = catalog::unique_key_columns(sql, oid)
            .await
            .map_err(|e| crate::source::error_text(&e))?;
        if keys.is_empty() {
            return Err(format!(
                "--table {t}: an incremental snapshot needs a primary key or a replica identity index to read it in order"
            ));
        }
    }
    Ok(())
}

/// Asks the connector of `config` for an incremental snapshot of `tables`
/// (a transactional WAL message it reads in its stream) and returns the
/// snapshot's id.
pub async fn signal(sql: &Client, config: &Config, tables: &[String]) -> Result<String, String> {
    check_tables(sql, config, tables).await?;
    emit(sql, config, SNAPSHOT, tables.to_vec(), Vec::new()).await
}

/// Writes a signal of `kind` with a new id to the WAL; returns the id.
async fn emit(
    sql: &Client,
    config: &Config,
    kind: &str,
    tables: Vec<String>,
    stop: Vec<String>,
) -> Result<String, String> {
    let id: String = sql
        .query_one("SELECT replace(gen_random_uuid()::text, '-', '')", &[])
        .await
        .map_err(|e| crate::source::error_text(&e))?
        .get(0);
    let signal = Signal {
        slot: config.source.slot.clone(),
        id: id.clone(),
        kind: kind.into(),
        tables,
        stop,
    };
    let content = serde_json::to_string(&signal).map_err(|e| e.to_string())?;
    sql.execute(
        "SELECT pg_logical_emit_message(true, $1, $2)",
        &[&SIGNAL_PREFIX, &content],
    )
    .await
    .map_err(|e| crate::source::error_text(&e))?;
    Ok(id)
}

/// The latest marker of each incremental snapshot of `slot` among
/// `markers` (every marker of the topic, oldest first).
fn latest_of(slot: &str, markers: Vec<Marker>) -> Vec<Marker> {
    let mut latest: Vec<Marker> = Vec::new();
    for m in markers
        .into_iter()
        .filter(|m| m.slot == slot && m.kind == Kind::Incremental)
    {
        match latest.iter_mut().find(|l| l.id == m.id) {
            Some(l) => *l = m,
            None => latest.push(m),
        }
    }
    latest
}

/// The incremental snapshots of the pipeline's slot still running or
/// waiting, of any of `tables` (all of them when empty).
pub async fn unfinished(config: &Config, tables: &[String]) -> Result<Vec<Marker>, String> {
    let topic = snapshot_marker::topic(config);
    let markers = snapshot_marker::all(&config.kafka, &topic)
        .await
        .map_err(|e| format!("{topic}: {e}"))?;
    Ok(latest_of(&config.source.slot, markers)
        .into_iter()
        .filter(|m| m.phase == Phase::Started)
        .filter(|m| tables.is_empty() || m.tables.iter().any(|t| tables.contains(t)))
        .collect())
}

/// Asks the connector (through the WAL, like [`signal`]) to stop the
/// incremental snapshots `ids`: each is recorded as failed with the
/// reason, and what it produced stays.
pub async fn signal_stop(sql: &Client, config: &Config, ids: &[String]) -> Result<(), String> {
    emit(sql, config, STOP, Vec::new(), ids.to_vec()).await?;
    Ok(())
}

/// Waits until the snapshot `id` completed and returns its marker;
/// `progress` sees every new marker of it on the way.
pub async fn wait(
    config: &Config,
    id: &str,
    timeout: Option<Duration>,
    mut progress: impl FnMut(&Marker),
) -> Result<Marker, String> {
    let key = snapshot_marker::incremental_key(&config.source.slot, id);
    let topic = snapshot_marker::topic(config);
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    let mut last: Option<Marker> = None;
    let mut failures = 0;
    loop {
        let latest = match snapshot_marker::all(&config.kafka, &topic).await {
            Ok(all) => {
                failures = 0;
                all.into_iter().rfind(|m| m.key() == key)
            }
            // A passing broker hiccup is retried; a broker that stays away
            // is an error, not a snapshot that "never started".
            Err(e) if failures >= 10 => return Err(format!("{topic}: {e}")),
            Err(_) => {
                failures += 1;
                None
            }
        };
        if let Some(m) = latest {
            if last.as_ref() != Some(&m) {
                progress(&m);
            }
            match m.phase {
                Phase::Completed => return Ok(m),
                Phase::Failed => {
                    return Err(format!(
                        "incremental snapshot {id} failed: {}",
                        m.error.as_deref().unwrap_or("(no reason recorded)")
                    ))
                }
                Phase::Started => {}
            }
            last = Some(m);
        }
        if deadline.is_some_and(|d| std::time::Instant::now() > d) {
            return Err(format!(
                "incremental snapshot {id} did not complete in time{}",
                if last.is_none() {
                    " (it never started: is `pgcdc run` streaming from this slot?)"
                } else {
                    ""
                }
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The indexes of a table's key columns, in the Kafka key's order.
fn key_indices(desc: &TableDesc) -> Vec<usize> {
    desc.columns
        .iter()
        .enumerate()
        .filter(|(_, c)| c.key)
        .map(|(i, _)| i)
        .collect()
}

/// What a chunk read.
struct Fetched {
    /// The table's shape when it was read.
    desc: TableDesc,
    rows: Vec<Vec<Option<Vec<u8>>>>,
    /// The key texts of the last row read (the next chunk's cursor).
    last_key: Option<Vec<String>>,
    /// The snapshot the rows were read with.
    visibility: Visibility,
}

/// The chunk being read, until its high watermark is streamed.
struct Chunk {
    token: String,
    table: String,
    /// The chunk's read, once it arrived.
    fetched: Option<Fetched>,
    reader: Option<oneshot::Receiver<Result<Fetched, String>>>,
    /// The read's task, ended with the chunk (a stopped snapshot's read
    /// may otherwise wait on for old transactions).
    _task: super::AbortOnDrop,
}

/// The connector's incremental snapshots: a queue of requests, the first
/// of which is being read one chunk at a time.
pub(super) struct Engine {
    config: Arc<Config>,
    queue: VecDeque<Marker>,
    /// Unfinished snapshots of an earlier slot, to be recorded as failed.
    abandoned: Vec<Marker>,
    chunk: Option<Chunk>,
    /// Codecs of the shapes chunks were read with, by table.
    codecs: HashMap<String, TableCodec>,
    /// The streamed changes of the table being read.
    watch: Option<Watch>,
    /// Ids already started (their replayed signals are ignored).
    known: HashSet<String>,
    next_token: u64,
    /// Reads of the current chunk that failed in a row.
    attempts: u32,
}

impl Engine {
    /// Picks up the snapshots a previous run left unfinished (`markers`:
    /// every marker of the topic). On a `new_slot` they are abandoned
    /// instead: their start offsets belong to the old slot's history.
    pub(super) fn resume(config: Arc<Config>, markers: Vec<Marker>, new_slot: bool) -> Engine {
        let latest = latest_of(&config.source.slot, markers);
        let known = latest.iter().filter_map(|m| m.id.clone()).collect();
        let unfinished: Vec<Marker> = latest
            .into_iter()
            .filter(|m| m.phase == Phase::Started)
            .collect();
        let (queue, abandoned) = if new_slot {
            (VecDeque::new(), unfinished)
        } else {
            (unfinished.into(), Vec::new())
        };
        for m in &queue {
            tracing::info!(id = m.id.as_deref().unwrap_or(""), tables = ?m.tables, "resuming an incremental snapshot");
        }
        Engine {
            config,
            queue,
            abandoned,
            chunk: None,
            codecs: Default::default(),
            watch: None,
            known,
            next_token: 0,
            attempts: 0,
        }
    }

    /// Whether a chunk's read is still to arrive.
    pub(super) fn reading(&self) -> bool {
        self.chunk.as_ref().is_some_and(|c| c.reader.is_some())
    }

    /// Resolves when the chunk's read arrives (only call while
    /// [`Engine::reading`]). A failed read is retried a few times, then
    /// the snapshot is recorded as failed; streaming goes on either way.
    pub(super) async fn read_done(&mut self, output: &Output) -> Result<(), RunError> {
        let Some(chunk) = self.chunk.as_mut() else {
            return std::future::pending().await;
        };
        let Some(reader) = chunk.reader.as_mut() else {
            return std::future::pending().await;
        };
        let result = reader.await;
        chunk.reader = None;
        let message = match result {
            Ok(Ok(f)) => {
                chunk.fetched = Some(f);
                self.attempts = 0;
                return Ok(());
            }
            Ok(Err(message)) => message,
            Err(_) => "the reader stopped".to_string(),
        };
        let table = chunk.table.clone();
        // Its high watermark may still come: it no longer matches.
        self.chunk = None;
        self.attempts += 1;
        if self.attempts < MAX_ATTEMPTS {
            tracing::warn!(%table, attempt = self.attempts, error = %message, "incremental snapshot chunk failed; reading it again");
            tokio::time::sleep(Duration::from_millis(500 << self.attempts.min(4))).await;
            return Ok(());
        }
        self.fail(output, format!("{table}: {message}")).await
    }

    /// Gives the running snapshot up: a `failed` marker with the reason
    /// (so `pgcdc snapshot` and `pgcdc rebuild` stop waiting), and the next
    /// one starts.
    async fn fail(&mut self, output: &Output, reason: String) -> Result<(), RunError> {
        self.chunk = None;
        self.watch = None;
        self.attempts = 0;
        let Some(marker) = self.queue.pop_front() else {
            return Ok(());
        };
        let id = marker.id.as_deref().unwrap_or("");
        if reason == STOPPED {
            tracing::warn!(id, "incremental snapshot stopped on request");
        } else {
            tracing::error!(id, %reason, "incremental snapshot failed");
        }
        self.record_failed(output, marker, reason).await
    }

    /// Writes `marker` as failed with `reason`.
    async fn record_failed(
        &self,
        output: &Output,
        mut marker: Marker,
        reason: String,
    ) -> Result<(), RunError> {
        marker.phase = Phase::Failed;
        marker.error = Some(reason);
        marker.ts_ms = now_ms();
        snapshot_marker::write(&output.producer, &self.config, &marker)
            .await
            .map_err(RunError::Delivery)
    }

    /// A signal read from the stream: starts a snapshot (after any running
    /// one) unless it is for another slot or already known. Returns
    /// whether it wrote to Kafka (a marker).
    pub(super) async fn on_signal(
        &mut self,
        output: &Output,
        content: &[u8],
    ) -> Result<bool, RunError> {
        let mut signal: Signal = match serde_json::from_slice(content) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "an unreadable pgcdc signal was ignored");
                return Ok(false);
            }
        };
        if signal.slot != self.config.source.slot || !self.known.insert(signal.id.clone()) {
            return Ok(false);
        }
        match signal.kind.as_str() {
            SNAPSHOT => {}
            STOP => return self.stop(output, &signal.stop).await,
            other => {
                tracing::warn!(
                    kind = other,
                    "a pgcdc signal of an unknown kind was ignored"
                );
                return Ok(false);
            }
        }
        // A signal written by hand may spell a table another way.
        for t in &mut signal.tables {
            *t = crate::config::canonical_table(t);
        }

        // Outbox tables have no changelog topic to mark.
        let topics: Vec<String> = signal
            .tables
            .iter()
            .filter(|t| !self.config.outbox.contains_key(*t))
            .map(|t| self.config.topic_for(t))
            .collect();
        // The log splits exactly here: every event before the signal is
        // acknowledged first, so none lands after these offsets (a reader
        // starting at them would otherwise see an old insert whose later
        // truncate, on another partition, it never reads).
        output.producer.flush().await?;
        let start_offsets = snapshot_marker::end_offsets(&self.config.kafka, &topics)
            .await
            .map_err(RunError::Delivery)?;
        let marker = Marker {
            slot: signal.slot.clone(),
            phase: Phase::Started,
            kind: Kind::Incremental,
            id: Some(signal.id.clone()),
            tables: signal.tables.clone(),
            cursor: None,
            consistent_ts_ms: None,
            error: None,
            consistent_point: None,
            start_offsets,
            end_offsets: Default::default(),
            rows: signal.tables.iter().map(|t| (t.clone(), 0)).collect(),
            chunks: Default::default(),
            ts_ms: now_ms(),
        };
        snapshot_marker::write(&output.producer, &self.config, &marker)
            .await
            .map_err(RunError::Delivery)?;
        tracing::info!(id = %signal.id, tables = ?signal.tables, "incremental snapshot started");
        self.queue.push_back(marker);
        Ok(true)
    }

    /// Ends the snapshots `ids`, running or waiting, as failed with
    /// [`STOPPED`]; a chunk in flight is dropped (its high watermark no
    /// longer matches). Returns whether it wrote to Kafka.
    async fn stop(&mut self, output: &Output, ids: &[String]) -> Result<bool, RunError> {
        let wanted = |m: &Marker| m.id.as_ref().is_some_and(|id| ids.contains(id));
        let mut wrote = false;
        if self.queue.front().is_some_and(wanted) {
            self.fail(output, STOPPED.into()).await?;
            wrote = true;
        }
        let (stopped, kept): (Vec<Marker>, Vec<Marker>) = std::mem::take(&mut self.queue)
            .into_iter()
            .partition(wanted);
        self.queue = kept.into();
        for m in stopped {
            tracing::warn!(
                id = m.id.as_deref().unwrap_or(""),
                "incremental snapshot stopped before it began"
            );
            self.record_failed(output, m, STOPPED.into()).await?;
            wrote = true;
        }
        Ok(wrote)
    }

    /// Starts the next chunk's read when a snapshot waits and no chunk is
    /// in flight.
    pub(super) async fn schedule(&mut self, output: &Output, sql: &Client) -> Result<(), RunError> {
        for m in std::mem::take(&mut self.abandoned) {
            tracing::warn!(
                id = m.id.as_deref().unwrap_or(""),
                "an unfinished incremental snapshot of the previous slot was abandoned"
            );
            let reason =
                "the slot was created again (with a new initial snapshot) before it completed";
            self.record_failed(output, m, reason.into()).await?;
        }
        if self.chunk.is_some() {
            return Ok(());
        }
        let Some(marker) = self.queue.front() else {
            return Ok(());
        };
        // Checked at its turn, so that a request resumed after a restart
        // meets the config as it is now.
        let uncaptured: Vec<String> = marker
            .tables
            .iter()
            .filter(|t| !self.config.source.tables.contains(t))
            .cloned()
            .collect();
        if !uncaptured.is_empty() {
            return self
                .fail(
                    output,
                    format!(
                        "not captured (not in source.tables): {}",
                        uncaptured.join(", ")
                    ),
                )
                .await;
        }
        let (table, after) = match &marker.cursor {
            Some(c) => (c.table.clone(), c.after.clone()),
            None => match marker.tables.first() {
                Some(t) => (t.clone(), Vec::new()),
                None => return self.complete(output, 0).await,
            },
        };
        let (schema, name) =
            split_table(&table).ok_or_else(|| RunError::Config(format!("bad table {table}")))?;
        let Some((oid, desc)) = catalog::describe(sql, &schema, &name).await? else {
            return self.fail(output, format!("{table} no longer exists")).await;
        };
        let desc = match super::exclude::without_excluded(&output.config, desc) {
            Ok(desc) => desc,
            Err(e) => return self.fail(output, e).await,
        };
        if catalog::unique_key_columns(sql, oid).await?.is_empty() {
            return self
                .fail(
                    output,
                    format!(
                        "{table} has no primary key or replica identity index to read it in order"
                    ),
                )
                .await;
        }
        if self.codecs.get(&table).is_none_or(|c| c.desc != desc) {
            match output.codec(desc.clone()).await {
                Ok(codec) => {
                    self.codecs.insert(table.clone(), codec);
                }
                Err(e) => return self.fail(output, format!("{table}: {e}")).await,
            }
        }
        self.next_token += 1;
        // Unique across restarts too (a pid repeats in a container): a
        // watermark left by an earlier run must never match.
        let started_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let token = format!(
            "{}:{started_ns}:{}",
            self.queue
                .front()
                .and_then(|m| m.id.as_deref())
                .unwrap_or(""),
            self.next_token
        );
        // The table's turn begins: watch its keys from here, and let the
        // first chunk wait for the transactions running now.
        let first = self.watch.as_ref().is_none_or(|w| w.table != table);
        if first {
            self.watch = Some(Watch {
                table: table.clone(),
                ..Watch::default()
            });
        }
        let (tx, rx) = oneshot::channel();
        let config = self.config.clone();
        let limit = config.source.snapshot.incremental_chunk_rows;
        let task_token = token.clone();
        let task = tokio::spawn(async move {
            let result = read_chunk(&config, &task_token, desc, &after, limit, first).await;
            let _ = tx.send(result);
        });
        self.chunk = Some(Chunk {
            token,
            table,
            fetched: None,
            reader: Some(rx),
            _task: super::AbortOnDrop(task),
        });
        Ok(())
    }

    /// A streamed row (old or new image) of `codec`'s table, changed by
    /// transaction `xid`: recorded while the table is being read.
    pub(super) fn saw(&mut self, codec: &TableCodec, row: &[Datum], xid: u32) {
        let Some(watch) = self.watch.as_mut() else {
            return;
        };
        if codec.table != watch.table {
            return;
        }
        let key: Vec<Vec<u8>> = key_indices(&codec.desc)
            .into_iter()
            .map(|i| match row.get(i) {
                Some(Datum::Text(b) | Datum::Binary(b)) => b.clone(),
                _ => Vec::new(),
            })
            .collect();
        watch.keys.insert(key, xid);
    }

    /// A streamed truncate of `table` by transaction `xid`.
    pub(super) fn saw_truncate(&mut self, table: &str, xid: u32) {
        if let Some(watch) = self.watch.as_mut().filter(|w| w.table == table) {
            watch.truncate = Some(xid);
        }
    }

    /// A watermark read from the stream, inside the transaction committed
    /// at `commit_lsn`. Returns whether it wrote to Kafka (rows, a marker).
    pub(super) async fn on_watermark(
        &mut self,
        output: &Output,
        content: &[u8],
        commit_lsn: u64,
        lsn: u64,
    ) -> Result<bool, RunError> {
        let Ok(w) = serde_json::from_slice::<Watermark>(content) else {
            return Ok(false);
        };
        let Some(chunk) = self.chunk.as_ref() else {
            return Ok(false);
        };
        if w.slot != self.config.source.slot || w.token != chunk.token {
            // A chunk of an earlier run, or another pipeline's.
            return Ok(false);
        }
        if self.reading() {
            // Written after the read finished, so the read is in hand.
            self.read_done(output).await?;
        }
        let Some(chunk) = self.chunk.take() else {
            return Ok(false);
        };
        let Some(fetched) = chunk.fetched else {
            return Ok(false);
        };
        let table = chunk.table.clone();
        // The shape the chunk was read with (a column added since is
        // absent from its rows, which consumers treat as unchanged).
        let codec = self.codecs.get(&table).ok_or_else(|| RunError::Snapshot {
            table: table.clone(),
            message: "no codec for the chunk".into(),
        })?;
        let key_at = key_indices(&fetched.desc);
        let src_base = SourceInfo {
            connector_name: &self.config.name,
            db: &output.db,
            position: Position { commit_lsn, seq: 0 },
            lsn,
            tx_id: None,
            ts_ms: now_ms(),
            snapshot: "incremental",
            table_order: 0,
        };
        let seen = &fetched.visibility;
        let watch = self.watch.as_ref().filter(|w| w.table == table);
        // Streamed before this watermark by a transaction the read did
        // not see: newer than the chunk.
        let newer = |key: &Vec<Vec<u8>>| {
            watch.is_some_and(|w| w.keys.get(key).is_some_and(|x| !seen.sees(*x)))
        };
        let truncated = watch
            .and_then(|w| w.truncate)
            .is_some_and(|x| !seen.sees(x));
        let mut produced = 0u64;
        for row in &fetched.rows {
            let key: Vec<Vec<u8>> = key_at
                .iter()
                .map(|&i| row.get(i).cloned().flatten().unwrap_or_default())
                .collect();
            if truncated || newer(&key) {
                continue;
            }
            produced += 1;
            let src = SourceInfo {
                position: Position {
                    commit_lsn,
                    seq: produced,
                },
                ..src_base
            };
            output
                .emit(codec, Op::Read, None, Some(&copy_inputs(row)), &src)
                .await?;
        }
        // A transaction this read saw is seen by every later one: its
        // changes need no watching any more.
        if let Some(w) = self.watch.as_mut().filter(|w| w.table == table) {
            w.keys.retain(|_, x| !seen.sees(*x));
            if w.truncate.is_some_and(|x| seen.sees(x)) {
                w.truncate = None;
            }
        }
        metrics::counter!(observe::SNAPSHOT_ROWS, "table" => table.clone()).increment(produced);
        // The cursor (or completion) is recorded only once Kafka holds the
        // chunk's rows: a crash in between would otherwise skip them.
        output.producer.flush().await?;
        let dropped = fetched.rows.len() as u64 - produced;
        let limit = self.config.source.snapshot.incremental_chunk_rows;
        let Some(marker) = self.queue.front_mut() else {
            return Ok(true);
        };
        *marker.rows.entry(table.clone()).or_default() += produced;
        *marker.chunks.entry(table.clone()).or_default() += 1;
        tracing::info!(id = marker.id.as_deref().unwrap_or(""), %table, rows = produced, dropped_for_newer_changes = dropped, "incremental snapshot chunk");
        // A short chunk was the table's last; then the next table, if any.
        let cursor = match fetched.last_key {
            Some(after) if fetched.rows.len() as u64 >= limit => Some(Cursor { table, after }),
            _ => marker
                .tables
                .iter()
                .skip_while(|t| **t != table)
                .nth(1)
                .map(|t| Cursor {
                    table: t.clone(),
                    after: Vec::new(),
                }),
        };
        match cursor {
            Some(c) => {
                marker.cursor = Some(c);
                snapshot_marker::write(&output.producer, &self.config, marker)
                    .await
                    .map_err(RunError::Delivery)?;
            }
            None => self.complete(output, commit_lsn).await?,
        }
        Ok(true)
    }

    /// Records the running snapshot as completed and moves to the next.
    async fn complete(&mut self, output: &Output, commit_lsn: u64) -> Result<(), RunError> {
        self.watch = None;
        let Some(mut marker) = self.queue.pop_front() else {
            return Ok(());
        };
        let topics: Vec<String> = marker
            .tables
            .iter()
            .filter(|t| !self.config.outbox.contains_key(*t))
            .map(|t| self.config.topic_for(t))
            .collect();
        marker.phase = Phase::Completed;
        marker.cursor = None;
        marker.consistent_point = Some(Lsn(commit_lsn).to_string());
        marker.consistent_ts_ms = Some(now_ms());
        marker.ts_ms = now_ms();
        marker.end_offsets = snapshot_marker::written_offsets(&self.config.kafka, &topics)
            .await
            .map_err(RunError::Delivery)?;
        snapshot_marker::write(&output.producer, &self.config, &marker)
            .await
            .map_err(RunError::Delivery)?;
        tracing::info!(id = marker.id.as_deref().unwrap_or(""), rows = ?marker.rows, "incremental snapshot complete");
        Ok(())
    }
}

/// Reads one chunk: the rows after `after` in key order, in a REPEATABLE
/// READ transaction whose snapshot it records, then writes the high
/// watermark. `first`: the table's first chunk, which waits until the
/// transactions running now have ended (see the module doc).
async fn read_chunk(
    config: &Config,
    token: &str,
    desc: TableDesc,
    after: &[String],
    limit: u64,
    first: bool,
) -> Result<Fetched, String> {
    let client = sql_session(config).await.map_err(|e| e.to_string())?;
    let pg = |e: tokio_postgres::Error| crate::source::error_text(&e);
    let qualified = format!(
        "{}.{}",
        slot::quote_ident(&desc.schema),
        slot::quote_ident(&desc.table)
    );
    if first {
        // Every transaction running now has an id below a fresh one, N:
        // wait until the oldest running transaction is newer than N. That
        // is visibility (the proc array), not the commit log, so a commit
        // waiting for a synchronous standby still counts as running.
        let n: String = client
            .query_one("SELECT pg_current_xact_id()::text", &[])
            .await
            .map_err(pg)?
            .get(0);
        let mut logged = std::time::Instant::now();
        loop {
            let done: bool = client
                .query_one(
                    "SELECT pg_snapshot_xmin(pg_current_snapshot()) > $1::text::xid8",
                    &[&n],
                )
                .await
                .map_err(pg)?
                .get(0);
            if done {
                break;
            }
            if logged.elapsed() > Duration::from_secs(30) {
                logged = std::time::Instant::now();
                tracing::info!(table = %desc.qualified(), "incremental snapshot waits for the transactions that were running when it reached this table");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Key columns in the Kafka key's order, with their declared types.
    let types = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
             FROM pg_attribute a
             WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped",
            &[&qualified],
        )
        .await
        .map_err(pg)?;
    let keys: Vec<(String, String)> = desc
        .columns
        .iter()
        .filter(|c| c.key)
        .map(|c| {
            let ty = types
                .iter()
                .find(|r| r.get::<_, String>(0) == c.name)
                .map(|r| r.get::<_, String>(1))
                .unwrap_or_else(|| "text".into());
            (slot::quote_ident(&c.name), ty)
        })
        .collect();
    if keys.is_empty() {
        return Err(format!(
            "{} has no key to read it in order",
            desc.qualified()
        ));
    }
    let key_list = keys
        .iter()
        .map(|(k, _)| k.clone())
        .collect::<Vec<_>>()
        .join(", ");
    let condition = if after.len() == keys.len() {
        let literals = after
            .iter()
            .zip(&keys)
            .map(|(v, (_, ty))| format!("'{}'::{ty}", v.replace('\'', "''")))
            .collect::<Vec<_>>()
            .join(", ");
        format!(" WHERE ({key_list}) > ({literals})")
    } else {
        String::new()
    };
    let columns = column_list(&desc);
    client
        .batch_execute(
            "SET standard_conforming_strings = on; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        )
        .await
        .map_err(pg)?;
    // The first statement fixes the transaction's snapshot: this one.
    let snap = client
        .query_one(
            "SELECT pg_snapshot_xmin(s)::text, pg_snapshot_xmax(s)::text,
                    array(SELECT pg_snapshot_xip(s))::text[]
             FROM pg_current_snapshot() s",
            &[],
        )
        .await
        .map_err(pg)?;
    let xid = |t: &str| {
        t.parse::<u64>()
            .map(|x| x as u32)
            .map_err(|e| format!("xid {t}: {e}"))
    };
    let visibility = Visibility {
        xmin: xid(&snap.get::<_, String>(0))?,
        xmax: xid(&snap.get::<_, String>(1))?,
        xip: snap
            .get::<_, Vec<String>>(2)
            .iter()
            .map(|t| xid(t))
            .collect::<Result<_, _>>()?,
    };
    // The table's own rows, not its inheritance children's (whose changes
    // Postgres publishes under their own names); a partitioned table's
    // rows are all in its partitions.
    let partitioned: bool = client
        .query_one(
            "SELECT relkind = 'p' FROM pg_class WHERE oid = $1::text::regclass",
            &[&qualified],
        )
        .await
        .map_err(pg)?
        .get(0);
    let only = if partitioned { "" } else { "ONLY " };
    let copy = format!(
        "COPY (SELECT {columns} FROM {only}{qualified}{condition} ORDER BY {key_list} LIMIT {limit}) TO STDOUT"
    );
    let stream = client.copy_out(&copy).await.map_err(pg)?;
    futures_util::pin_mut!(stream);
    let mut buf: Vec<u8> = Vec::new();
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk.map_err(pg)?);
    }
    client.batch_execute("COMMIT").await.map_err(pg)?;
    let rows: Vec<Vec<Option<Vec<u8>>>> = buf
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(catalog::copy_fields)
        .collect();
    // After the read: every transaction it saw is streamed before this.
    let watermark = serde_json::to_string(&Watermark {
        slot: config.source.slot.clone(),
        token: token.to_string(),
    })
    .map_err(|e| e.to_string())?;
    client
        .execute(
            "SELECT pg_logical_emit_message(true, $1, $2)",
            &[&WATERMARK_PREFIX, &watermark],
        )
        .await
        .map_err(pg)?;
    let key_at = key_indices(&desc);
    let last_key = rows.last().map(|row: &Vec<Option<Vec<u8>>>| {
        key_at
            .iter()
            .map(|&i| {
                String::from_utf8_lossy(
                    row.get(i).cloned().flatten().as_deref().unwrap_or_default(),
                )
                .into_owned()
            })
            .collect()
    });
    Ok(Fetched {
        desc,
        rows,
        last_key,
        visibility,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_and_watermarks_are_plain_json() {
        let s = Signal {
            slot: "s".into(),
            id: "abc".into(),
            kind: "snapshot".into(),
            tables: vec!["public.orders".into()],
            stop: Vec::new(),
        };
        let text = serde_json::to_string(&s).unwrap_or_default();
        assert_eq!(
            text,
            r#"{"slot":"s","id":"abc","kind":"snapshot","tables":["public.orders"]}"#
        );
        let w: Option<Watermark> = serde_json::from_str(r#"{"slot":"s","token":"t"}"#).ok();
        assert_eq!(w.map(|w| w.token), Some("t".to_string()));
    }

    #[test]
    fn visibility_follows_postgres_snapshot_rules_across_wraparound() {
        let v = Visibility {
            xmin: 100,
            xmax: 110,
            xip: [103, 107].into(),
        };
        assert!(v.sees(99) && v.sees(100) && v.sees(105));
        assert!(
            !v.sees(103) && !v.sees(107),
            "running when the snapshot was taken"
        );
        assert!(!v.sees(110) && !v.sees(5000), "begun after it");
        // Near the 32-bit wrap, order is modular, as in Postgres.
        let w = Visibility {
            xmin: u32::MAX - 5,
            xmax: 3,
            xip: HashSet::new(),
        };
        assert!(w.sees(u32::MAX - 1) && w.sees(2));
        assert!(!w.sees(3) && !w.sees(10));
        assert!(precedes(u32::MAX, 0) && !precedes(0, u32::MAX));
    }
}
