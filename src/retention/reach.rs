//! Rebuild reach: what a retained changelog can still rebuild, decided
//! from the topics' watermarks and configs and the snapshot markers. Pure:
//! no I/O, so every rule is unit-tested here.
//!
//! Rules, per topic:
//! - A completed snapshot (initial or incremental) whose start offset is
//!   still retained in every partition (`earliest ≤ start ≤ latest`)
//!   makes the topic rebuildable: reading from there yields every row of
//!   the table, and every change after it.
//! - With such a snapshot, the reach is **full history** since the oldest
//!   of them, unless `cleanup.policy` compacts, which keeps only the
//!   latest record per key: **current state only**.
//! - Without one, the reach is **none**, and the gap is named: the
//!   partitions where retention (or DeleteRecords) removed offsets the
//!   newest snapshot needs, with the offsets and the times around them.
//!
//! A read model's reach is the weakest of its topics': none if any topic
//! has none, current state if any is compacted, else full history since
//! the latest of the topics' start times.

use std::collections::BTreeMap;

use serde::Serialize;

use super::time::{human_span, parse_span, parse_timestamp, rfc3339};
use crate::snapshot_marker::{Kind, Marker, Phase};
use crate::source::pgoutput::Lsn;

/// A partition's retained range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionRange {
    pub partition: i32,
    /// The first retained offset (the low watermark).
    pub earliest_offset: i64,
    /// The offset the next record gets (the high watermark).
    pub latest_offset: i64,
    /// The timestamp of the record at `earliest_offset`; `None` when the
    /// partition holds no record.
    pub earliest_timestamp_ms: Option<i64>,
    pub earliest_timestamp: Option<String>,
}

impl PartitionRange {
    pub fn new(partition: i32, earliest: i64, latest: i64, ts: Option<i64>) -> PartitionRange {
        PartitionRange {
            partition,
            earliest_offset: earliest,
            latest_offset: latest,
            earliest_timestamp_ms: ts,
            earliest_timestamp: ts.map(rfc3339),
        }
    }
}

/// The topic configs that decide what is kept. `None`: the broker did not
/// report it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TopicConfig {
    pub cleanup_policy: Option<String>,
    pub retention_ms: Option<i64>,
    pub retention_bytes: Option<i64>,
    /// How long tombstones stay in a compacted topic.
    pub delete_retention_ms: Option<i64>,
}

impl TopicConfig {
    /// Whether compaction may have dropped history: `cleanup.policy`
    /// contains `compact`, or the broker did not say (no optimism).
    fn compacts(&self) -> bool {
        self.cleanup_policy
            .as_deref()
            .is_none_or(|p| p.split(',').any(|x| x.trim() == "compact"))
    }

    /// Time-based deletion: `retention.ms` applies (policy `delete`, the
    /// default, or `compact,delete`) and is not -1.
    fn deletes_after_ms(&self) -> Option<i64> {
        let deletes = self
            .cleanup_policy
            .as_deref()
            .is_none_or(|p| p.split(',').any(|x| x.trim() == "delete"));
        self.retention_ms.filter(|ms| deletes && *ms >= 0)
    }
}

/// A snapshot a reach rests on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotRef {
    /// `initial` or `incremental`.
    pub kind: String,
    pub id: Option<String>,
    pub consistent_point: Option<String>,
    /// From when the captured state is complete.
    pub since_ms: i64,
    pub since: String,
    pub completed_at_ms: i64,
    pub completed_at: String,
    /// Partition → the offset where the snapshot's rows begin.
    pub start_offsets: BTreeMap<i32, i64>,
}

impl SnapshotRef {
    fn of(m: &Marker, topic: &str) -> SnapshotRef {
        SnapshotRef {
            kind: m.kind.as_str().to_string(),
            id: m.id.clone(),
            consistent_point: m.consistent_point.clone(),
            since_ms: m.since_ms(),
            since: rfc3339(m.since_ms()),
            completed_at_ms: m.ts_ms,
            completed_at: rfc3339(m.ts_ms),
            start_offsets: m.start_offsets.get(topic).cloned().unwrap_or_default(),
        }
    }

    /// Where a rebuild from this snapshot reads a partition from (0 for a
    /// partition added after it).
    pub fn start(&self, partition: i32) -> i64 {
        self.start_offsets.get(&partition).copied().unwrap_or(0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReachKind {
    /// Nothing complete: a rebuild needs a new snapshot.
    None,
    /// Compacted: the latest record per key, not the history.
    CurrentState,
    /// Every change since `since`, on top of a complete snapshot.
    FullHistory,
}

/// Records a rebuild would need that are gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gap {
    pub topic: String,
    pub partition: Option<i32>,
    /// The missing offsets are `missing_from_offset..missing_to_offset`.
    pub missing_from_offset: Option<i64>,
    pub missing_to_offset: Option<i64>,
    /// The missing records were written after this time (the snapshot's)…
    pub missing_from_ms: Option<i64>,
    pub missing_from: Option<String>,
    /// …and before this one (the earliest record still retained).
    pub missing_to_ms: Option<i64>,
    pub missing_to: Option<String>,
    pub reason: String,
}

impl Gap {
    /// A gap known only by its reason (no offsets or times to name).
    pub fn named(topic: &str, reason: String) -> Gap {
        Gap {
            topic: topic.to_string(),
            partition: None,
            missing_from_offset: None,
            missing_to_offset: None,
            missing_from_ms: None,
            missing_from: None,
            missing_to_ms: None,
            missing_to: None,
            reason,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reach {
    pub kind: ReachKind,
    /// Full history: since when.
    pub since_ms: Option<i64>,
    pub since: Option<String>,
    /// Full history: the snapshot's LSN, from which every change is kept.
    pub since_lsn: Option<String>,
    /// When time-based retention starts deleting records this reach rests
    /// on (`None`: no time-based retention applies).
    pub until_ms: Option<i64>,
    pub until: Option<String>,
    /// Why, in one sentence.
    pub summary: String,
    pub gaps: Vec<Gap>,
}

impl Reach {
    /// Not rebuildable without a new snapshot, because of `gaps`.
    pub fn none(summary: String, gaps: Vec<Gap>) -> Reach {
        Reach {
            kind: ReachKind::None,
            since_ms: None,
            since: None,
            since_lsn: None,
            until_ms: None,
            until: None,
            summary,
            gaps,
        }
    }
}

/// What one topic can rebuild, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicReach {
    pub begins_with_complete_snapshot: bool,
    /// The snapshot the reach rests on; when none qualifies, the newest
    /// completed one (whose gap is reported).
    pub snapshot: Option<SnapshotRef>,
    pub reach: Reach,
}

/// Decides one topic's reach. `markers` are all markers of the pipeline's
/// slot; `start_ts` gives the timestamp of the record at an offset, when
/// known (for `until`).
pub fn topic_reach(
    topic: &str,
    table: &str,
    markers_topic: &str,
    partitions: &[PartitionRange],
    config: &TopicConfig,
    markers: &[Marker],
    start_ts: &dyn Fn(i32, i64) -> Option<i64>,
) -> TopicReach {
    // A new slot (its initial snapshot) breaks the history: changes made
    // between the old slot and the new one were never captured. So only
    // the newest initial snapshot and the incremental ones after it count.
    let covering: Vec<&Marker> = markers
        .iter()
        .filter(|m| m.start_offsets.contains_key(topic) || m.kind == Kind::Initial)
        .collect();
    let since = covering
        .iter()
        .rposition(|m| m.kind == Kind::Initial)
        .unwrap_or(0);
    if let Some(m) = covering
        .get(since)
        .filter(|m| m.kind == Kind::Initial && m.phase == Phase::Started)
    {
        return unfinished(topic, m);
    }
    let completed: Vec<&Marker> = covering[since.min(covering.len())..]
        .iter()
        .copied()
        .filter(|m| m.phase == Phase::Completed && m.start_offsets.contains_key(topic))
        .collect();
    let retained = |s: &SnapshotRef| {
        partitions.iter().all(|p| {
            let start = s.start(p.partition);
            p.earliest_offset <= start && start <= p.latest_offset
        })
    };
    let usable = completed
        .iter()
        .map(|m| SnapshotRef::of(m, topic))
        .filter(retained)
        .min_by_key(|s| s.since_ms);
    if let Some(s) = usable {
        let until_ms = config.deletes_after_ms().and_then(|ms| {
            partitions
                .iter()
                .filter(|p| s.start(p.partition) < p.latest_offset)
                .filter_map(|p| start_ts(p.partition, s.start(p.partition)))
                .min()
                .map(|ts| ts.saturating_add(ms))
        });
        let (kind, summary) = if config.compacts() {
            let why = match &config.cleanup_policy {
                Some(p) => format!("is compacted (cleanup.policy={p})"),
                None => "did not report its cleanup.policy, so it may be compacted".to_string(),
            };
            (
                ReachKind::CurrentState,
                format!(
                    "{topic} {why}: the latest record of every key since the {} snapshot of {} is kept, not the changes before it",
                    s.kind, s.since
                ),
            )
        } else {
            (
                ReachKind::FullHistory,
                format!(
                    "{topic} holds the {} snapshot of {} and every change since",
                    s.kind, s.since
                ),
            )
        };
        let full = kind == ReachKind::FullHistory;
        return TopicReach {
            begins_with_complete_snapshot: true,
            reach: Reach {
                kind,
                since_ms: full.then_some(s.since_ms),
                since: full.then(|| s.since.clone()),
                since_lsn: if full {
                    s.consistent_point.clone()
                } else {
                    None
                },
                until_ms,
                until: until_ms.map(rfc3339),
                summary,
                gaps: Vec::new(),
            },
            snapshot: Some(s),
        };
    }
    // Nothing usable: name what is missing against the newest snapshot.
    let newest = completed
        .iter()
        .max_by_key(|m| m.ts_ms)
        .map(|m| SnapshotRef::of(m, topic));
    let mut gaps = Vec::new();
    let boundary = covering
        .get(since)
        .filter(|m| m.kind == Kind::Initial && !m.start_offsets.contains_key(topic));
    match (&newest, boundary) {
        (None, Some(slot)) => gaps.push(Gap::named(
            topic,
            format!(
                "the slot was created {} without a snapshot of {table}: rows that existed before then are not in the log (take one with `pgcdc snapshot`)",
                rfc3339(slot.since_ms())
            ),
        )),
        (None, None) => gaps.push(Gap::named(
            topic,
            format!(
                "no completed snapshot of {table} is recorded in {markers_topic}: the log may lack rows that existed before streaming began"
            ),
        )),
        (Some(s), _) => {
            for p in partitions {
                let start = s.start(p.partition);
                if start < p.earliest_offset {
                    gaps.push(Gap {
                        topic: topic.to_string(),
                        partition: Some(p.partition),
                        missing_from_offset: Some(start),
                        missing_to_offset: Some(p.earliest_offset),
                        missing_from_ms: Some(s.since_ms),
                        missing_from: Some(s.since.clone()),
                        missing_to_ms: p.earliest_timestamp_ms,
                        missing_to: p.earliest_timestamp.clone(),
                        reason: format!(
                            "offsets {start}..{} of partition {} were deleted (retention or DeleteRecords): they held rows of the {} snapshot of {}",
                            p.earliest_offset, p.partition, s.kind, s.since
                        ),
                    });
                } else if start > p.latest_offset {
                    gaps.push(Gap {
                        topic: topic.to_string(),
                        partition: Some(p.partition),
                        missing_from_offset: Some(p.latest_offset),
                        missing_to_offset: Some(start),
                        missing_from_ms: Some(s.since_ms),
                        missing_from: Some(s.since.clone()),
                        missing_to_ms: None,
                        missing_to: None,
                        reason: format!(
                            "partition {} ends at offset {} but the snapshot of {} began at {start}: the topic was recreated since",
                            p.partition, p.latest_offset, s.since
                        ),
                    });
                }
            }
        }
    }
    let summary = format!(
        "{topic} cannot be rebuilt without a new snapshot: {}",
        gaps.iter()
            .map(|g| g.reason.clone())
            .collect::<Vec<_>>()
            .join("; ")
    );
    TopicReach {
        begins_with_complete_snapshot: false,
        snapshot: newest,
        reach: Reach::none(summary, gaps),
    }
}

/// No reach while the slot's initial snapshot has not completed (it is
/// running, or was interrupted and will be taken again).
fn unfinished(topic: &str, m: &Marker) -> TopicReach {
    let reason = format!(
        "the initial snapshot begun {} has not completed: it is running, or was interrupted and the connector takes it again at its next start",
        rfc3339(m.ts_ms)
    );
    TopicReach {
        begins_with_complete_snapshot: false,
        snapshot: None,
        reach: Reach::none(
            format!("{topic} cannot be rebuilt without a new snapshot: {reason}"),
            vec![Gap::named(topic, reason)],
        ),
    }
}

/// The reach of a read model over its topics: the weakest of theirs.
pub fn combine(name: &str, topics: &[(&str, &Reach)]) -> Reach {
    let kind = topics
        .iter()
        .map(|(_, r)| r.kind)
        .min()
        .unwrap_or(ReachKind::None);
    let of_kind: Vec<&(&str, &Reach)> = topics.iter().filter(|(_, r)| r.kind == kind).collect();
    let until_ms = topics.iter().filter_map(|(_, r)| r.until_ms).min();
    let (since_ms, since_lsn) = if kind == ReachKind::FullHistory {
        let latest = topics.iter().max_by_key(|(_, r)| r.since_ms);
        let lsn = topics
            .iter()
            .filter_map(|(_, r)| r.since_lsn.as_deref())
            .filter_map(|l| l.parse::<Lsn>().ok())
            .max_by_key(|l| l.0)
            .map(|l| l.to_string());
        (latest.and_then(|(_, r)| r.since_ms), lsn)
    } else {
        (None, None)
    };
    let summary = match kind {
        ReachKind::FullHistory => format!(
            "{name} can be rebuilt with its full history since {}",
            since_ms.map(rfc3339).unwrap_or_default()
        ),
        ReachKind::CurrentState => format!(
            "{name} can be rebuilt to its current state only: {}",
            of_kind
                .iter()
                .map(|(_, r)| r.summary.clone())
                .collect::<Vec<_>>()
                .join("; ")
        ),
        ReachKind::None if topics.is_empty() => format!("{name} reads no captured table"),
        ReachKind::None => format!(
            "{name} cannot be rebuilt without a new snapshot: {}",
            of_kind
                .iter()
                .map(|(_, r)| r.summary.clone())
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    Reach {
        kind,
        since_ms,
        since: since_ms.map(rfc3339),
        since_lsn,
        until_ms,
        until: until_ms.map(rfc3339),
        summary,
        gaps: of_kind
            .iter()
            .filter(|_| kind == ReachKind::None)
            .flat_map(|(_, r)| r.gaps.clone())
            .collect(),
    }
}

/// How far back a read model must be rebuildable (`--require`, or
/// `read_models.NAME.require_reach`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// History for this long before now (`90d`).
    Span { ms: i64, text: String },
    /// History since this time (`2026-01-01T00:00:00Z`).
    Since { ms: i64, text: String },
    /// History since this LSN (`16/B374D848`).
    Lsn { lsn: Lsn, text: String },
    /// Rebuildable at all, history or not (`current`).
    CurrentState,
}

impl Requirement {
    pub fn parse(text: &str) -> Result<Requirement, String> {
        let t = text.trim();
        if t == "current" {
            return Ok(Requirement::CurrentState);
        }
        if let Some(ms) = parse_span(t) {
            return Ok(Requirement::Span {
                ms,
                text: t.to_string(),
            });
        }
        if let Some(ms) = parse_timestamp(t) {
            return Ok(Requirement::Since {
                ms,
                text: t.to_string(),
            });
        }
        if let Ok(lsn) = t.parse::<Lsn>() {
            return Ok(Requirement::Lsn {
                lsn,
                text: t.to_string(),
            });
        }
        Err(format!(
            "'{t}' is not a requirement: expected a span (90d, 12h, 1d12h), a timestamp (2026-01-01 or 2026-01-01T00:00:00Z), an LSN (16/B374D848) or `current`"
        ))
    }

    pub fn text(&self) -> String {
        match self {
            Requirement::Span { text, .. }
            | Requirement::Since { text, .. }
            | Requirement::Lsn { text, .. } => text.clone(),
            Requirement::CurrentState => "current".into(),
        }
    }
}

/// A requirement checked against a reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub requirement: String,
    /// History must reach back to this time (span and timestamp forms).
    pub required_since_ms: Option<i64>,
    pub required_since: Option<String>,
    /// History must reach back to this LSN (LSN form).
    pub required_since_lsn: Option<String>,
    pub met: bool,
    /// What is missing, in one sentence; `None` when met.
    pub shortfall: Option<String>,
}

/// Checks `req` against `reach` at time `now_ms`.
pub fn judge(req: &Requirement, reach: &Reach, now_ms: i64) -> Verdict {
    let required_ms = match req {
        Requirement::Span { ms, .. } => Some(now_ms.saturating_sub(*ms)),
        Requirement::Since { ms, .. } => Some(*ms),
        _ => None,
    };
    let required_lsn = match req {
        Requirement::Lsn { lsn, .. } => Some(*lsn),
        _ => None,
    };
    let wanted = match (required_ms, required_lsn) {
        (Some(ms), _) => format!("history since {} is required ({})", rfc3339(ms), req.text()),
        (_, Some(l)) => format!("history since LSN {l} is required"),
        _ => "a complete rebuild is required".to_string(),
    };
    let shortfall = match reach.kind {
        ReachKind::None => Some(format!("{wanted}, but {}", reach.summary)),
        ReachKind::CurrentState if *req != Requirement::CurrentState => {
            Some(format!("{wanted}, but {}", reach.summary))
        }
        ReachKind::CurrentState => None,
        ReachKind::FullHistory => {
            let since = reach.since_ms.unwrap_or(i64::MAX);
            let since_lsn = reach
                .since_lsn
                .as_deref()
                .and_then(|l| l.parse::<Lsn>().ok());
            match (required_ms, required_lsn) {
                (Some(ms), _) if since > ms => Some(format!(
                    "{wanted}, but the history kept begins {}: {} short",
                    reach.since.clone().unwrap_or_default(),
                    human_span(since - ms)
                )),
                (_, Some(l)) if since_lsn.is_none_or(|s| s.0 > l.0) => Some(format!(
                    "{wanted}, but the history kept begins at LSN {}",
                    reach.since_lsn.as_deref().unwrap_or("(unknown)")
                )),
                _ => None,
            }
        }
    };
    Verdict {
        requirement: req.text(),
        required_since_ms: required_ms,
        required_since: required_ms.map(rfc3339),
        required_since_lsn: required_lsn.map(|l| l.to_string()),
        met: shortfall.is_none(),
        shortfall,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot_marker::Kind;

    const T: &str = "p.public.orders";

    fn marker(ts: i64, start: &[(i32, i64)], kind: Kind) -> Marker {
        Marker {
            slot: "s".into(),
            phase: Phase::Completed,
            kind,
            id: (kind == Kind::Incremental).then(|| format!("id{ts}")),
            tables: Vec::new(),
            cursor: None,
            consistent_ts_ms: Some(ts),
            error: None,
            consistent_point: Some(format!("0/{ts:X}")),
            start_offsets: [(T.to_string(), start.iter().copied().collect())].into(),
            end_offsets: Default::default(),
            rows: Default::default(),
            chunks: Default::default(),
            ts_ms: ts + 5,
        }
    }

    fn parts(ranges: &[(i64, i64)]) -> Vec<PartitionRange> {
        ranges
            .iter()
            .enumerate()
            .map(|(i, (lo, hi))| PartitionRange::new(i as i32, *lo, *hi, Some(1000 + *lo)))
            .collect()
    }

    fn delete_policy(retention_ms: i64) -> TopicConfig {
        TopicConfig {
            cleanup_policy: Some("delete".into()),
            retention_ms: Some(retention_ms),
            retention_bytes: Some(-1),
            delete_retention_ms: Some(86_400_000),
        }
    }

    fn reach(p: &[PartitionRange], c: &TopicConfig, m: &[Marker]) -> TopicReach {
        topic_reach(T, "public.orders", "p.snapshots", p, c, m, &|_, o| {
            Some(2000 + o)
        })
    }

    #[test]
    fn an_untouched_log_has_full_history_since_the_oldest_retained_snapshot() {
        let m = [
            marker(100, &[(0, 0), (1, 0)], Kind::Initial),
            marker(900, &[(0, 40), (1, 50)], Kind::Incremental),
        ];
        let r = reach(&parts(&[(0, 90), (0, 95)]), &delete_policy(-1), &m);
        assert!(r.begins_with_complete_snapshot);
        assert_eq!(r.reach.kind, ReachKind::FullHistory);
        assert_eq!(r.reach.since_ms, Some(100));
        assert_eq!(r.reach.since_lsn.as_deref(), Some("0/64"));
        assert_eq!(r.reach.until_ms, None, "retention.ms = -1 never deletes");
        assert!(r.reach.gaps.is_empty());
    }

    #[test]
    fn retention_cutting_into_the_first_snapshot_falls_back_to_a_later_one() {
        let m = [
            marker(100, &[(0, 0), (1, 0)], Kind::Initial),
            marker(900, &[(0, 40), (1, 50)], Kind::Incremental),
        ];
        let r = reach(&parts(&[(10, 90), (0, 95)]), &delete_policy(7_000), &m);
        assert_eq!(r.reach.kind, ReachKind::FullHistory);
        assert_eq!(r.reach.since_ms, Some(900));
        assert_eq!(r.snapshot.map(|s| s.kind).as_deref(), Some("incremental"));
        // The record at offset 40 (ts 2040) is deleted 7 s after it was written.
        assert_eq!(r.reach.until_ms, Some(2040 + 7_000));
    }

    #[test]
    fn a_deleted_snapshot_start_is_a_named_gap() {
        let m = [marker(100, &[(0, 0), (1, 5)], Kind::Initial)];
        let r = reach(&parts(&[(0, 90), (30, 95)]), &delete_policy(-1), &m);
        assert!(!r.begins_with_complete_snapshot);
        assert_eq!(r.reach.kind, ReachKind::None);
        assert_eq!(r.reach.gaps.len(), 1);
        let g = &r.reach.gaps[0];
        assert_eq!(
            (g.partition, g.missing_from_offset, g.missing_to_offset),
            (Some(1), Some(5), Some(30))
        );
        assert_eq!(
            (g.missing_from_ms, g.missing_to_ms),
            (Some(100), Some(1030))
        );
        assert!(
            r.reach.summary.contains("offsets 5..30 of partition 1"),
            "{}",
            r.reach.summary
        );
    }

    #[test]
    fn a_new_slot_starts_a_new_history() {
        // The slot was dropped and created again: its new snapshot at 900.
        let m = [
            marker(100, &[(0, 0), (1, 0)], Kind::Initial),
            marker(500, &[(0, 20), (1, 20)], Kind::Incremental),
            marker(900, &[(0, 40), (1, 50)], Kind::Initial),
        ];
        let r = reach(&parts(&[(0, 90), (0, 95)]), &delete_policy(-1), &m);
        assert_eq!(r.reach.kind, ReachKind::FullHistory);
        assert_eq!(
            r.reach.since_ms,
            Some(900),
            "changes between the slots were never captured"
        );
        // And an older slot's snapshot never stands in for the current one.
        let r = reach(&parts(&[(0, 90), (55, 95)]), &delete_policy(-1), &m);
        assert_eq!(r.reach.kind, ReachKind::None);
        assert_eq!(
            (
                r.reach.gaps[0].partition,
                r.reach.gaps[0].missing_from_offset
            ),
            (Some(1), Some(50))
        );
    }

    #[test]
    fn a_slot_created_without_a_snapshot_breaks_the_history() {
        let mut never = marker(900, &[], Kind::Initial);
        never.start_offsets.clear();
        let m = [marker(100, &[(0, 0)], Kind::Initial), never];
        let r = reach(&parts(&[(0, 90)]), &delete_policy(-1), &m);
        assert_eq!(
            r.reach.kind,
            ReachKind::None,
            "the old slot's snapshot no longer counts"
        );
        assert!(
            r.reach.gaps[0].reason.contains("without a snapshot"),
            "{:?}",
            r.reach.gaps
        );
        // An incremental snapshot after it restores the reach.
        let m = [
            m[0].clone(),
            m[1].clone(),
            marker(950, &[(0, 60)], Kind::Incremental),
        ];
        let r = reach(&parts(&[(0, 90)]), &delete_policy(-1), &m);
        assert_eq!(
            (r.reach.kind, r.reach.since_ms),
            (ReachKind::FullHistory, Some(950))
        );
    }

    #[test]
    fn an_unreported_cleanup_policy_is_not_taken_for_full_history() {
        let m = [marker(100, &[(0, 0)], Kind::Initial)];
        let r = reach(&parts(&[(0, 9)]), &TopicConfig::default(), &m);
        assert_eq!(r.reach.kind, ReachKind::CurrentState);
        assert!(
            r.reach.summary.contains("did not report"),
            "{}",
            r.reach.summary
        );
    }

    #[test]
    fn an_unfinished_initial_snapshot_has_no_reach() {
        let mut started = marker(900, &[(0, 40)], Kind::Initial);
        started.phase = Phase::Started;
        let m = [marker(100, &[(0, 0)], Kind::Initial), started];
        let r = reach(&parts(&[(0, 90)]), &delete_policy(-1), &m);
        assert_eq!(r.reach.kind, ReachKind::None);
        assert!(
            r.reach.summary.contains("has not completed"),
            "{}",
            r.reach.summary
        );
    }

    #[test]
    fn no_snapshot_at_all_is_a_gap_too() {
        let r = reach(&parts(&[(0, 9)]), &delete_policy(-1), &[]);
        assert_eq!(r.reach.kind, ReachKind::None);
        assert!(r.reach.gaps[0].reason.contains("no completed snapshot"));
        let mut started = marker(100, &[(0, 0)], Kind::Initial);
        started.phase = Phase::Started;
        let r = reach(&parts(&[(0, 9)]), &delete_policy(-1), &[started]);
        assert_eq!(
            r.reach.kind,
            ReachKind::None,
            "an unfinished snapshot counts for nothing"
        );
    }

    #[test]
    fn a_recreated_topic_does_not_match_old_offsets() {
        let m = [marker(100, &[(0, 500)], Kind::Initial)];
        let r = reach(&parts(&[(0, 20)]), &delete_policy(-1), &m);
        assert_eq!(r.reach.kind, ReachKind::None);
        assert!(r.reach.gaps[0].reason.contains("recreated"));
    }

    #[test]
    fn compaction_keeps_current_state_only() {
        let m = [marker(100, &[(0, 0)], Kind::Initial)];
        let compact = TopicConfig {
            cleanup_policy: Some("compact".into()),
            retention_ms: Some(1000),
            ..TopicConfig::default()
        };
        let r = reach(&parts(&[(0, 9)]), &compact, &m);
        assert_eq!(r.reach.kind, ReachKind::CurrentState);
        assert_eq!(r.reach.since_ms, None);
        assert_eq!(
            r.reach.until_ms, None,
            "retention.ms does not apply to compact-only topics"
        );
        let both = TopicConfig {
            cleanup_policy: Some("compact,delete".into()),
            retention_ms: Some(1000),
            ..TopicConfig::default()
        };
        let r = reach(&parts(&[(0, 9)]), &both, &m);
        assert_eq!(r.reach.kind, ReachKind::CurrentState);
        assert_eq!(r.reach.until_ms, Some(2000 + 1000));
    }

    fn full(since: i64, lsn: &str) -> Reach {
        Reach {
            kind: ReachKind::FullHistory,
            since_ms: Some(since),
            since: Some(rfc3339(since)),
            since_lsn: Some(lsn.into()),
            until_ms: None,
            until: None,
            summary: "full".into(),
            gaps: vec![],
        }
    }

    #[test]
    fn a_read_model_reaches_as_far_as_its_weakest_topic() {
        let (a, b) = (full(100, "0/10"), full(300, "0/30"));
        let r = combine("rm", &[("a", &a), ("b", &b)]);
        assert_eq!(r.kind, ReachKind::FullHistory);
        assert_eq!(
            (r.since_ms, r.since_lsn.as_deref()),
            (Some(300), Some("0/30"))
        );
        let mut c = full(0, "0/0");
        c.kind = ReachKind::CurrentState;
        assert_eq!(
            combine("rm", &[("a", &a), ("c", &c)]).kind,
            ReachKind::CurrentState
        );
        let mut n = full(0, "0/0");
        n.kind = ReachKind::None;
        n.gaps = vec![Gap {
            topic: "n".into(),
            partition: Some(0),
            missing_from_offset: Some(0),
            missing_to_offset: Some(3),
            missing_from_ms: None,
            missing_from: None,
            missing_to_ms: None,
            missing_to: None,
            reason: "gone".into(),
        }];
        let r = combine("rm", &[("a", &a), ("c", &c), ("n", &n)]);
        assert_eq!(r.kind, ReachKind::None);
        assert_eq!(r.gaps.len(), 1);
    }

    #[test]
    fn requirements_parse_every_documented_form() {
        assert!(
            matches!(Requirement::parse("90d"), Ok(Requirement::Span { ms, .. }) if ms == 90 * 86_400_000)
        );
        assert!(matches!(
            Requirement::parse("2026-01-01T00:00:00Z"),
            Ok(Requirement::Since { .. })
        ));
        assert!(matches!(
            Requirement::parse("16/B374D848"),
            Ok(Requirement::Lsn { .. })
        ));
        assert_eq!(Requirement::parse("current"), Ok(Requirement::CurrentState));
        assert!(Requirement::parse("forever").is_err());
    }

    #[test]
    fn requirements_are_met_only_by_enough_history() {
        let now = 10 * 86_400_000;
        let r = full(now - 2 * 86_400_000, "0/100");
        let judge_text = |t: &str, r: &Reach| {
            judge(
                &Requirement::parse(t).unwrap_or(Requirement::CurrentState),
                r,
                now,
            )
        };
        assert!(judge_text("1d", &r).met);
        let v = judge_text("3d", &r);
        assert!(!v.met);
        assert!(
            v.shortfall
                .as_deref()
                .is_some_and(|s| s.contains("1d short")),
            "{v:?}"
        );
        assert!(judge_text("0/100", &r).met);
        assert!(!judge_text("0/FF", &r).met);
        assert!(judge_text("1970-01-10", &r).met);
        assert!(!judge_text("1970-01-02", &r).met);
        let mut c = r.clone();
        c.kind = ReachKind::CurrentState;
        assert!(judge_text("current", &c).met);
        assert!(!judge_text("1s", &c).met);
        let mut n = r.clone();
        n.kind = ReachKind::None;
        assert!(!judge_text("current", &n).met);
    }
}
