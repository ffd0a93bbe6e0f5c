//! Mirror rows that a new initial snapshot no longer holds.
//!
//! Guarantee: when the slot is created again (dropped, invalidated), its
//! initial snapshot reads every captured table afresh, but a row deleted
//! at the source while no slot captured anything has no delete in the log
//! and would stay in its mirror for ever. Once the group has applied the
//! snapshot (its committed offsets reach the end offsets of the completed
//! marker, on every partition of the table's topics, whichever instance
//! owns them), every mirror row still older than the snapshot is one the
//! snapshot did not read: it is removed as a truncate at the snapshot's
//! position would remove it, with the read-model rows that depended on it
//! recomputed, in serializable transactions of at most 10,000 rows each,
//! the last of which sets the watermark. The truncate watermark
//! records it, so a sweep happens once per snapshot and a redelivered
//! change older than the snapshot stays skipped. A snapshot row applied
//! after the sweep (a dead letter replayed, a record still in flight) is
//! newer than the watermark and is applied as usual.
//!
//! ```text
//!  <prefix>.snapshots ──► the slot's latest marker: initial, completed, consistent point P
//!        │
//!        ▼  each mirror of a table it read, whose truncate watermark is below (P, -1)
//!  group's committed offsets ≥ the marker's end offsets? ── no ──► the next round
//!        │ yes
//!        ▼
//!  every record of it still in the log, and every row it read in the ── no ──► keep them, warn once;
//!  mirror at (P, 0) or later (or deleted since, with a tombstone)?          rows short: look again in 2 min,
//!        │ yes                                                              doubling to 1 h; a record gone:
//!        ▼                                                                  never again (`pgcdc rebuild`)
//!  while more than 10,000 rows lie below (P, -1): BEGIN ─► 10,000 of them: view keys, delete, recompute ─► COMMIT
//!        │
//!        ▼
//!  BEGIN ─► view keys of the rows below (P, -1) ─► delete them, watermark (P, -1) ─► recompute ─► COMMIT
//! ```
//!
//! The checks keep live rows: a record the group never applied (offsets
//! reset past it, retention deleted it first, a dead letter not replayed
//! yet) leaves a row the snapshot read unaccounted for, and the sweep
//! waits.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::mirror::{self, Mirror, Position, Statements};
use super::view::View;
use super::MaterializeError;
use crate::config::Config;
use crate::observe;
use crate::snapshot_marker::{self, Kind, Marker, Phase};
use crate::source::pgoutput::Lsn;

/// Rows removed per transaction: beyond this many, the sweep removes them
/// in chunks of this many first (see [`sweep_chunks`]); and should the
/// last transaction still find more, every row of the read models over the
/// table is recomputed instead of the removed rows' keys one by one.
const KEYS_ONE_BY_ONE: i64 = 10_000;

/// A mirror short of rows is looked at again after this long, then after
/// twice as long each time, up to [`LAST_RECHECK`]: each look counts the
/// mirror's rows.
const FIRST_RECHECK: Duration = Duration::from_secs(120);
const LAST_RECHECK: Duration = Duration::from_secs(3600);

/// A mirror under a snapshot.
type SweepId = (String, Lsn);

/// What the rounds remember: mirrors swept (or found clean) per
/// snapshot, mirrors held off for good (a snapshot record gone from the
/// log never comes back), when a mirror short of rows is due again (a
/// replayed dead letter may complete it), and the ones already warned
/// about.
#[derive(Debug, Default)]
struct Sweeps {
    settled: HashSet<SweepId>,
    expired: HashSet<SweepId>,
    later: HashMap<SweepId, (Instant, Duration)>,
    warned: HashSet<SweepId>,
}

impl Sweeps {
    /// Whether the round looks at `id` at `now`.
    fn due(&self, id: &SweepId, now: Instant) -> bool {
        !self.settled.contains(id)
            && !self.expired.contains(id)
            && self.later.get(id).is_none_or(|(at, _)| now >= *at)
    }

    /// Records a round that held `id` off; true the first time (warn).
    fn held(&mut self, id: &SweepId, why: &HoldOff, now: Instant) -> bool {
        match why {
            HoldOff::Expired { .. } => {
                self.expired.insert(id.clone());
            }
            HoldOff::Short { .. } => {
                let wait = self
                    .later
                    .get(id)
                    .map_or(FIRST_RECHECK, |(_, w)| (*w * 2).min(LAST_RECHECK));
                self.later.insert(id.clone(), (now + wait, wait));
            }
        }
        self.warned.insert(id.clone())
    }
}

/// The floor below which a mirror row predates the snapshot at `lsn`: its
/// rows carry `(lsn, 0)`.
fn floor(lsn: Lsn) -> Position {
    (lsn.0 as i64, -1)
}

/// The completed initial snapshot the slot's latest marker describes.
fn initial_snapshot(marker: Marker) -> Option<(Lsn, Marker)> {
    if marker.phase != Phase::Completed || marker.kind != Kind::Initial {
        return None;
    }
    let lsn = marker.consistent_point.as_deref()?.parse::<Lsn>().ok()?;
    Some((lsn, marker))
}

/// A partition the snapshot wrote to, with the offsets of its first
/// record and past its last.
type Written = ((String, i32), (i64, i64));

/// The partitions of `topics` the snapshot wrote to.
fn written(marker: &Marker, topics: &[String]) -> Vec<Written> {
    let mut out = Vec::new();
    for topic in topics {
        let Some(ends) = marker.end_offsets.get(topic) else {
            continue;
        };
        let starts = marker.start_offsets.get(topic);
        for (p, end) in ends {
            let start = starts.and_then(|s| s.get(p)).copied().unwrap_or(0);
            if *end > start {
                out.push(((topic.clone(), *p), (start, *end)));
            }
        }
    }
    out
}

/// Whether `committed` is past the end of every partition the snapshot
/// wrote to. (Under exactly-once the end is past its records, open
/// transaction included, and a consumer commits past the last one.)
fn applied(
    written: &[Written],
    committed: &std::collections::BTreeMap<(String, i32), i64>,
) -> bool {
    written
        .iter()
        .all(|(tp, (_, end))| committed.get(tp).is_some_and(|c| c >= end))
}

/// Why the rows below the floor must stay, if they must.
#[derive(Debug, PartialEq)]
enum HoldOff {
    /// Retention deleted some of the snapshot's records: the group may
    /// have jumped past them.
    Expired { topic: String, partition: i32 },
    /// Fewer of the snapshot's rows reached the mirror (or were deleted
    /// since, leaving a tombstone) than it read: records skipped or
    /// dead-lettered.
    Short { read: u64, found: u64 },
}

/// Partition → the offset its log starts at.
type LogStarts = std::collections::BTreeMap<(String, i32), i64>;

/// The first check before a sweep, which needs no count of the mirror:
/// every record of the snapshot still in the log.
fn expired(written: &[Written], log_starts: &LogStarts) -> Option<HoldOff> {
    written
        .iter()
        .find(|(tp, (start, _))| log_starts.get(tp).is_some_and(|low| low > start))
        .map(|((topic, partition), _)| HoldOff::Expired {
            topic: topic.clone(),
            partition: *partition,
        })
}

/// The second: every row the snapshot read accounted for.
fn short(read: u64, found: u64) -> Option<HoldOff> {
    (found < read).then_some(HoldOff::Short { read, found })
}

/// Runs a [`round`] every `every`, on a target connection of its own
/// beside the apply (a round reads Kafka and may recompute many read-model
/// rows: the batches must not wait for it), until the task is aborted.
pub async fn keep(
    config: std::sync::Arc<Config>,
    group: String,
    url: crate::secret::Dsn,
    mirrors: HashMap<String, Mirror>,
    views: Vec<View>,
    every: std::time::Duration,
) {
    let mut sweeps = Sweeps::default();
    let mut db: Option<(Client, Statements)> = None;
    loop {
        tokio::time::sleep(every).await;
        if db.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            match crate::source::connect(&url).await {
                Ok(c) => db = Some((c, Statements::default())),
                Err(e) => {
                    tracing::warn!(error = %crate::source::error_text(&e),
                        "the sweep after a new snapshot cannot reach the target; trying again later");
                    continue;
                }
            }
        }
        let Some((c, statements)) = db.as_mut() else {
            continue;
        };
        if let Err(e) = round(
            c,
            &config,
            &group,
            &mirrors,
            &views,
            statements,
            &mut sweeps,
        )
        .await
        {
            tracing::warn!(error = %e, "the sweep after a new snapshot failed; trying again later");
        }
    }
}

/// One round: sweeps each mirror the slot's latest initial snapshot has
/// been applied to. A mirror that fails is logged and the others go on;
/// the next round tries it again.
async fn round(
    db: &mut Client,
    config: &Config,
    group: &str,
    mirrors: &HashMap<String, Mirror>,
    views: &[View],
    statements: &mut Statements,
    sweeps: &mut Sweeps,
) -> Result<(), MaterializeError> {
    let marker = snapshot_marker::latest(
        &config.kafka,
        &snapshot_marker::topic(config),
        &config.source.slot,
    )
    .await
    .map_err(MaterializeError::Markers)?;
    let Some((lsn, marker)) = marker.and_then(initial_snapshot) else {
        return Ok(());
    };
    for m in mirrors.values() {
        let Some(&read) = marker.rows.get(&m.source) else {
            continue;
        };
        let id = (m.qualified.clone(), lsn);
        if !sweeps.due(&id, Instant::now()) {
            continue;
        }
        match mirror_round(db, config, group, m, views, statements, &marker, lsn, read).await {
            Ok(None) => {
                sweeps.settled.insert(id);
            }
            Ok(Some(Held::NotYet)) => {}
            Ok(Some(Held::Off(why))) => {
                if sweeps.held(&id, &why, Instant::now()) {
                    tracing::warn!(mirror = %m.qualified, snapshot = %lsn, reason = ?why,
                        "rows the new snapshot did not read are kept for now: its records may not all have been applied; if this persists, run `pgcdc rebuild` for the read models over the table");
                }
            }
            Err(e) => {
                tracing::warn!(mirror = %m.qualified, error = %e,
                    "the sweep after a new snapshot failed; trying again later")
            }
        }
    }
    Ok(())
}

/// Why a mirror's round did not settle it.
enum Held {
    /// The group has not applied the snapshot yet.
    NotYet,
    Off(HoldOff),
}

#[allow(clippy::too_many_arguments)]
async fn mirror_round(
    db: &mut Client,
    config: &Config,
    group: &str,
    m: &Mirror,
    views: &[View],
    statements: &mut Statements,
    marker: &Marker,
    lsn: Lsn,
    read: u64,
) -> Result<Option<Held>, MaterializeError> {
    if mirror::truncated_at(db, m)
        .await?
        .is_some_and(|w| w >= floor(lsn))
    {
        return Ok(None);
    }
    let topics = config.topics_of(&m.source);
    let written = written(marker, &topics);
    let committed = crate::sink::group_committed(
        &config.kafka,
        group,
        written.iter().map(|(tp, _)| tp.clone()),
    )
    .await?;
    if !applied(&written, &committed) {
        return Ok(Some(Held::NotYet));
    }
    let log_starts = crate::sink::watermarks(&config.kafka, &topics)
        .await
        .map_err(MaterializeError::Markers)?
        .into_iter()
        .flat_map(|(t, parts)| {
            parts
                .into_iter()
                .map(move |(p, (low, _))| ((t.clone(), p), low))
        })
        .collect();
    // Before counting the mirror, which a gone record makes pointless.
    if let Some(why) = expired(&written, &log_starts) {
        return Ok(Some(Held::Off(why)));
    }
    if let Some(why) = short(read, found(db, m, lsn).await?) {
        return Ok(Some(Held::Off(why)));
    }
    // The chunks count their rows as they commit.
    let chunked = sweep_chunks(db, m, views, statements, lsn).await?;
    let last = sweep(db, m, views, statements, lsn).await?;
    metrics::counter!(observe::MATERIALIZE_RESNAPSHOT_REMOVED, "table" => m.source.clone())
        .increment(last);
    let removed = chunked + last;
    if removed > 0 {
        tracing::info!(mirror = %m.qualified, snapshot = %lsn, removed,
            "rows the new snapshot did not read (deleted at the source while nothing was captured) removed");
    }
    Ok(None)
}

/// The snapshot's rows accounted for: mirror rows at or after it, and
/// keys deleted after it (their tombstones).
async fn found(db: &Client, m: &Mirror, lsn: Lsn) -> Result<u64, tokio_postgres::Error> {
    let (at, seq) = floor(lsn);
    let row = db
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {} WHERE (_pgcdc_commit_lsn, _pgcdc_seq) > ($1, $2))
                      + (SELECT count(*) FROM pgcdc_state.tombstones
                         WHERE mirror = $3 AND (commit_lsn, seq) > ($1, $2))",
                m.qualified
            ),
            &[&at, &seq, &m.qualified],
        )
        .await?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// A mirror row's key, as text, from its `m.key_as_text()` columns
/// starting at column `from`.
fn key_at(row: &tokio_postgres::Row, from: usize, m: &Mirror) -> Vec<String> {
    (from..from + m.key.len())
        .map(|i| row.get::<_, Option<String>>(i).unwrap_or_default())
        .collect()
}

/// While more than [`KEYS_ONE_BY_ONE`] rows lie below the snapshot's
/// floor, removes that many, with their read-model keys recomputed, in a
/// serializable transaction of their own; the rows removed. [`sweep`]
/// then removes the rest and sets the watermark. Until it does, nothing
/// else treats the mirror as swept: a crash between chunks leaves fewer
/// stale rows for the next round, and a row a replayed dead letter brings
/// back below the floor meanwhile is removed by the last transaction. A
/// long sweep thus never holds one transaction that concurrent batches
/// conflict with, nor recomputes every row of the read models.
async fn sweep_chunks(
    db: &mut Client,
    m: &Mirror,
    views: &[View],
    statements: &mut Statements,
    lsn: Lsn,
) -> Result<u64, MaterializeError> {
    let (at, seq) = floor(lsn);
    let below = "(_pgcdc_commit_lsn, _pgcdc_seq) < ($1, $2)";
    let mut removed = 0;
    loop {
        let tx = super::serializable(db).await?;
        let rows = tx
            .query(
                &format!(
                    "SELECT ctid::text, {} FROM {} WHERE {below} LIMIT {}",
                    m.key_as_text(),
                    m.qualified,
                    KEYS_ONE_BY_ONE + 1
                ),
                &[&at, &seq],
            )
            .await?;
        if rows.len() as i64 <= KEYS_ONE_BY_ONE {
            tx.rollback().await?;
            return Ok(removed);
        }
        let mut affected: Vec<BTreeSet<String>> = vec![BTreeSet::new(); views.len()];
        let mut rows_at: Vec<String> = Vec::with_capacity(KEYS_ONE_BY_ONE as usize);
        for row in &rows[..KEYS_ONE_BY_ONE as usize] {
            rows_at.push(row.get(0));
            let key = key_at(row, 1, m);
            super::view_keys(&tx, statements, views, m, &key, &mut affected).await?;
        }
        let n = tx
            .execute(
                &format!(
                    "DELETE FROM {} WHERE ctid = ANY($3::text[]::tid[]) AND {below}",
                    m.qualified
                ),
                &[&at, &seq, &rows_at],
            )
            .await?;
        super::recompute_views(&tx, views, statements, &affected).await?;
        tx.commit().await?;
        removed += n;
        metrics::counter!(observe::MATERIALIZE_RESNAPSHOT_REMOVED, "table" => m.source.clone())
            .increment(n);
        tracing::info!(mirror = %m.qualified, snapshot = %lsn, removed,
            "removing rows the new snapshot did not read, in chunks");
    }
}

/// Removes the rows below the snapshot's floor and recomputes the read
/// models over them, in one serializable transaction; the rows removed.
async fn sweep(
    db: &mut Client,
    m: &Mirror,
    views: &[View],
    statements: &mut Statements,
    lsn: Lsn,
) -> Result<u64, MaterializeError> {
    let (at, seq) = floor(lsn);
    let tx = super::serializable(db).await?;
    // Counted and keyed inside the transaction: a dead letter replayed
    // since the checks may have added one.
    let below = format!(
        "FROM {} WHERE (_pgcdc_commit_lsn, _pgcdc_seq) < ($1, $2)",
        m.qualified
    );
    let stale: i64 = tx
        .query_one(&format!("SELECT count(*) {below}"), &[&at, &seq])
        .await?
        .get(0);
    let mut affected: Vec<BTreeSet<String>> = vec![BTreeSet::new(); views.len()];
    if stale > KEYS_ONE_BY_ONE {
        for (view, out) in views.iter().zip(affected.iter_mut()) {
            if view.sources.iter().any(|(t, _)| t == &m.source) {
                view.all_keys(&tx, out).await?;
            }
        }
    } else if stale > 0 {
        let rows = tx
            .query(&format!("SELECT {} {below}", m.key_as_text()), &[&at, &seq])
            .await?;
        for row in rows {
            let key = key_at(&row, 0, m);
            super::view_keys(&tx, statements, views, m, &key, &mut affected).await?;
        }
    }
    // Another instance may have swept first.
    if mirror::truncate(&tx, m, (at, seq)).await? == mirror::Outcome::Duplicate {
        return Ok(0);
    }
    super::recompute_views(&tx, views, statements, &affected).await?;
    tx.commit().await?;
    Ok(u64::try_from(stale).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Both checks, in [`mirror_round`]'s order.
    fn hold_off(
        written: &[Written],
        log_starts: &LogStarts,
        read: u64,
        found: u64,
    ) -> Option<HoldOff> {
        expired(written, log_starts).or_else(|| short(read, found))
    }

    fn marker(start: &[(i32, i64)], end: &[(i32, i64)]) -> Marker {
        Marker {
            slot: "s".into(),
            phase: Phase::Completed,
            kind: Kind::Initial,
            id: None,
            tables: vec![],
            cursor: None,
            consistent_ts_ms: None,
            error: None,
            consistent_point: Some("0/16B3748".into()),
            start_offsets: BTreeMap::from([("t".to_string(), start.iter().copied().collect())]),
            end_offsets: BTreeMap::from([("t".to_string(), end.iter().copied().collect())]),
            rows: BTreeMap::new(),
            chunks: BTreeMap::new(),
            ts_ms: 0,
        }
    }

    #[test]
    fn a_snapshot_counts_as_applied_once_every_partition_it_wrote_is_committed_past_its_end() {
        let m = marker(&[(0, 10), (1, 5), (2, 7)], &[(0, 20), (1, 5), (2, 9)]);
        let w = written(&m, &["t".to_string(), "other".to_string()]);
        // Partition 1 got no snapshot row; a topic the marker does not know
        // of got none either.
        assert_eq!(
            w,
            vec![
                (("t".to_string(), 0), (10, 20)),
                (("t".to_string(), 2), (7, 9))
            ]
        );
        let committed = |c: &[(i32, i64)]| -> BTreeMap<(String, i32), i64> {
            c.iter().map(|(p, o)| (("t".to_string(), *p), *o)).collect()
        };
        assert!(applied(&w, &committed(&[(0, 20), (2, 9)])));
        assert!(applied(&w, &committed(&[(0, 25), (1, 0), (2, 9)])));
        assert!(!applied(&w, &committed(&[(0, 19), (2, 9)])));
        // A partition never committed is not applied.
        assert!(!applied(&w, &committed(&[(0, 20)])));
    }

    #[test]
    fn rows_stay_while_records_expired_or_rows_are_missing() {
        let w = vec![(("t".to_string(), 0), (10, 20))];
        let starts = |low: i64| BTreeMap::from([(("t".to_string(), 0), low)]);
        assert_eq!(hold_off(&w, &starts(10), 100, 100), None);
        assert_eq!(hold_off(&w, &starts(0), 100, 130), None);
        assert_eq!(
            hold_off(&w, &starts(11), 100, 100),
            Some(HoldOff::Expired {
                topic: "t".into(),
                partition: 0
            })
        );
        assert_eq!(
            hold_off(&w, &starts(10), 100, 99),
            Some(HoldOff::Short {
                read: 100,
                found: 99
            })
        );
        // A table the snapshot found empty: everything below the floor goes.
        assert_eq!(hold_off(&[], &BTreeMap::new(), 0, 0), None);
    }

    #[test]
    fn a_mirror_short_of_rows_is_looked_at_less_and_less_and_one_with_records_gone_never_again() {
        let mut s = Sweeps::default();
        let short = ("mirror.a".to_string(), Lsn(1));
        let gone = ("mirror.b".to_string(), Lsn(1));
        let t0 = Instant::now();
        assert!(s.due(&short, t0) && s.due(&gone, t0));
        let why = HoldOff::Short { read: 2, found: 1 };
        // Warned once; due again after 2, 4, 8, ... minutes, at most an hour.
        assert!(s.held(&short, &why, t0));
        assert!(!s.due(&short, t0 + Duration::from_secs(119)));
        assert!(s.due(&short, t0 + Duration::from_secs(120)));
        let mut at = t0;
        let mut waits = Vec::new();
        for _ in 0..7 {
            assert!(!s.held(&short, &why, at));
            let (next, wait) = s.later[&short];
            waits.push(wait.as_secs());
            at = next;
        }
        assert_eq!(waits, [240, 480, 960, 1920, 3600, 3600, 3600]);
        let expired = HoldOff::Expired {
            topic: "t".into(),
            partition: 0,
        };
        assert!(s.held(&gone, &expired, t0));
        assert!(!s.due(&gone, t0 + Duration::from_secs(365 * 86_400)));
        // Another snapshot of the same mirror starts afresh.
        assert!(s.due(&("mirror.b".to_string(), Lsn(2)), t0));
        // A swept mirror is not looked at again.
        s.settled.insert(short.clone());
        assert!(!s.due(&short, at + LAST_RECHECK));
    }

    #[test]
    fn only_a_completed_initial_snapshot_sets_a_floor() {
        let m = marker(&[], &[]);
        assert_eq!(
            initial_snapshot(m.clone()).map(|(l, _)| floor(l)),
            Some((0x16B3748, -1))
        );
        for other in [
            Marker {
                phase: Phase::Started,
                ..m.clone()
            },
            Marker {
                kind: Kind::Incremental,
                ..m.clone()
            },
            Marker {
                consistent_point: None,
                ..m.clone()
            },
        ] {
            assert!(initial_snapshot(other).is_none());
        }
    }
}
