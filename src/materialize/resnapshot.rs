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
//! recomputed, in one serializable transaction. The truncate watermark
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
//!  at least half the rows it read are in the mirror at (P, 0) or later? ── no ──► warn once
//!        │ yes                                   (the group skipped its records: rebuild)
//!        ▼
//!  BEGIN ─► view keys of the rows below (P, -1) ─► delete them, watermark (P, -1) ─► recompute ─► COMMIT
//! ```

use std::collections::{BTreeSet, HashMap, HashSet};

use tokio_postgres::Client;

use super::mirror::{self, Mirror, Position, Statements};
use super::view::View;
use super::MaterializeError;
use crate::config::Config;
use crate::observe;
use crate::snapshot_marker::{self, Kind, Marker, Phase};
use crate::source::pgoutput::Lsn;

/// Above this many rows to remove, every row of the read models over the
/// table is recomputed instead of the removed rows' keys one by one.
const KEYS_ONE_BY_ONE: i64 = 10_000;

/// What the rounds remember: mirrors swept (or found clean) and warned
/// about, per snapshot.
#[derive(Debug, Default)]
pub struct Sweeps {
    settled: HashSet<(String, Lsn)>,
    warned: HashSet<(String, Lsn)>,
}

/// The floor below which a mirror row predates the snapshot at `lsn`: its
/// rows carry `(lsn, 0)`.
pub fn floor(lsn: Lsn) -> Position {
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

/// Whether `committed` reaches `end` on every partition of `topics` the
/// snapshot wrote to. Under exactly-once the snapshot's transaction ends
/// in a commit marker the group never commits past until a later record
/// arrives, so one short of the end counts (a record applied after the
/// sweep is applied as usual).
pub fn applied(
    marker: &Marker,
    topics: &[String],
    committed: &std::collections::BTreeMap<(String, i32), i64>,
    exactly_once: bool,
) -> bool {
    topics.iter().all(|topic| {
        let Some(ends) = marker.end_offsets.get(topic) else {
            return true;
        };
        let starts = marker.start_offsets.get(topic);
        ends.iter().all(|(p, end)| {
            let start = starts.and_then(|s| s.get(p)).copied().unwrap_or(0);
            let wanted = if exactly_once { end - 1 } else { *end };
            *end <= start
                || committed
                    .get(&(topic.clone(), *p))
                    .is_some_and(|c| *c >= wanted)
        })
    })
}

/// One round: sweeps each mirror the slot's latest initial snapshot has
/// been applied to. Errors are the caller's to log: the next round tries
/// again.
pub async fn round(
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
        let id = (m.qualified.clone(), lsn);
        let Some(&read) = marker.rows.get(&m.source) else {
            continue;
        };
        if sweeps.settled.contains(&id) || sweeps.warned.contains(&id) {
            continue;
        }
        if watermark(db, m).await?.is_some_and(|w| w >= floor(lsn)) {
            sweeps.settled.insert(id);
            continue;
        }
        let topics = config.topics_of(&m.source);
        let mut partitions: Vec<(String, i32)> = Vec::new();
        for t in &topics {
            for p in marker.end_offsets.get(t).into_iter().flat_map(|e| e.keys()) {
                partitions.push((t.clone(), *p));
            }
        }
        let committed = crate::sink::group_committed(&config.kafka, group, partitions).await?;
        if !applied(&marker, &topics, &committed, config.kafka.exactly_once) {
            continue;
        }
        let (kept, stale) = census(db, m, lsn).await?;
        // Records of the snapshot the group never applied (offsets reset
        // past them, retention deleted them first) would leave most of its
        // rows below the floor: removing them would empty a live mirror.
        if stale > 0 && (kept as u64).saturating_mul(2) < read {
            tracing::warn!(mirror = %m.qualified, snapshot = %lsn, read, kept, stale,
                "rows the new snapshot did not read are kept: fewer than half of the rows it read are in the mirror, as if the group skipped its records; run `pgcdc rebuild` for the read models over it");
            sweeps.warned.insert(id);
            continue;
        }
        sweep(db, m, views, statements, lsn, stale).await?;
        if stale > 0 {
            metrics::counter!(observe::MATERIALIZE_RESNAPSHOT_REMOVED, "table" => m.source.clone())
                .increment(stale as u64);
            tracing::info!(mirror = %m.qualified, snapshot = %lsn, removed = stale,
                "rows the new snapshot did not read (deleted at the source while nothing was captured) removed");
        }
        sweeps.settled.insert(id);
    }
    Ok(())
}

async fn watermark(db: &Client, m: &Mirror) -> Result<Option<Position>, tokio_postgres::Error> {
    Ok(db
        .query_opt(
            "SELECT commit_lsn, seq FROM pgcdc_state.truncations WHERE mirror = $1",
            &[&m.qualified],
        )
        .await?
        .map(|r| (r.get(0), r.get(1))))
}

/// Rows at or after the snapshot, and rows older than it.
async fn census(db: &Client, m: &Mirror, lsn: Lsn) -> Result<(i64, i64), tokio_postgres::Error> {
    let (at, seq) = floor(lsn);
    let row = db
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE (_pgcdc_commit_lsn, _pgcdc_seq) > ($1, $2)),
                        count(*) FILTER (WHERE (_pgcdc_commit_lsn, _pgcdc_seq) < ($1, $2))
                 FROM {}",
                m.qualified
            ),
            &[&at, &seq],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Removes the rows below the snapshot's floor and recomputes the read
/// models over them, in one serializable transaction.
async fn sweep(
    db: &mut Client,
    m: &Mirror,
    views: &[View],
    statements: &mut Statements,
    lsn: Lsn,
    stale: i64,
) -> Result<(), MaterializeError> {
    let (at, seq) = floor(lsn);
    let tx = db
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::Serializable)
        .start()
        .await?;
    let mut affected: Vec<BTreeSet<String>> = vec![BTreeSet::new(); views.len()];
    if stale > KEYS_ONE_BY_ONE {
        for (view, out) in views.iter().zip(affected.iter_mut()) {
            if view.sources.iter().any(|(t, _)| t == &m.source) {
                view.all_keys(&tx, out).await?;
            }
        }
    } else if stale > 0 {
        let rows = tx
            .query(
                &format!(
                    "SELECT {} FROM {} WHERE (_pgcdc_commit_lsn, _pgcdc_seq) < ($1, $2)",
                    m.key_as_text(),
                    m.qualified
                ),
                &[&at, &seq],
            )
            .await?;
        for row in rows {
            let key: Vec<String> = (0..m.key.len())
                .map(|i| row.get::<_, Option<String>>(i).unwrap_or_default())
                .collect();
            super::view_keys(&tx, statements, views, m, &key, &mut affected).await?;
        }
    }
    mirror::truncate(&tx, m, (at, seq)).await?;
    super::recompute_views(&tx, views, statements, &affected).await?;
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

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
        let topics = vec!["t".to_string()];
        let committed = |c: &[(i32, i64)]| -> BTreeMap<(String, i32), i64> {
            c.iter().map(|(p, o)| (("t".to_string(), *p), *o)).collect()
        };
        // Partition 1 got no snapshot row: no commit needed there.
        assert!(applied(&m, &topics, &committed(&[(0, 20), (2, 9)]), false));
        assert!(!applied(&m, &topics, &committed(&[(0, 19), (2, 9)]), false));
        // A partition never committed is not applied.
        assert!(!applied(&m, &topics, &committed(&[(0, 20)]), false));
        // Exactly-once: the transaction's commit marker takes the last offset.
        assert!(applied(&m, &topics, &committed(&[(0, 19), (2, 8)]), true));
        assert!(!applied(&m, &topics, &committed(&[(0, 18), (2, 8)]), true));
        // A topic the marker does not know of (none written) holds nothing.
        assert!(applied(&m, &["other".to_string()], &committed(&[]), false));
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
