//! Health figures of the dead-letter store, computed from its messages at
//! a given instant (the clock is a parameter, so tests control it).
//!
//! Depth alone misses a slow leak: when messages arrive about as fast as
//! they are addressed, depth stays flat while one message (or a class
//! nobody looks at) waits for ever. So the figures also give the age of
//! the oldest open message, and the arrival rate against its own baseline.
//!
//! Guarantee: [`compute`] is pure; the same messages and instant give the
//! same figures and warnings.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Class, Outcome, State};
use crate::config::DlqHealthConfig;
use crate::retention::time::{human_span, parse_span};

const HOUR_MS: i64 = 3_600_000;
/// Hours of history behind the arrival baseline.
pub const BASELINE_HOURS: i64 = 7 * 24;

/// What the figures need of one message.
#[derive(Debug, Clone)]
pub struct Item {
    pub id: i64,
    pub state: State,
    pub class: Class,
    /// When it was quarantined (ms since the epoch).
    pub quarantined_ms: i64,
    pub outcome: Option<Outcome>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Health {
    pub at_ms: i64,
    /// Messages by state and class.
    pub depth: BTreeMap<String, BTreeMap<String, u64>>,
    /// Messages neither replayed nor archived.
    pub open: u64,
    pub oldest_open_id: Option<i64>,
    pub oldest_open_age_ms: Option<i64>,
    pub replays: Replays,
    pub arrivals_last_hour: u64,
    /// EWMA of the hourly arrivals before the last hour.
    pub arrival_baseline_per_hour: f64,
    /// Alert `dlq_arrival_burst`: the last hour's arrivals are over
    /// `arrival_factor` times the baseline (and at least `min_arrivals`).
    pub arrival_burst: bool,
    /// Alert `dlq_oldest_overdue`: the oldest open message has waited
    /// longer than `max_oldest_age`.
    pub oldest_overdue: bool,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Replays {
    pub applied: u64,
    pub already_applied: u64,
    /// Replays that failed again and came back as new quarantines.
    pub refailed: u64,
    /// (applied + already applied) / every replay; `None` before the first.
    pub success_rate: Option<f64>,
}

pub fn compute(items: &[Item], now_ms: i64, cfg: &DlqHealthConfig) -> Health {
    let mut depth: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut replays = Replays::default();
    let mut oldest: Option<&Item> = None;
    // buckets[0] is the last hour, buckets[h] the hour h hours before it.
    let mut buckets = vec![0u64; BASELINE_HOURS as usize + 1];
    for it in items {
        *depth
            .entry(it.state.as_str().to_string())
            .or_default()
            .entry(it.class.as_str().to_string())
            .or_default() += 1;
        if !it.state.is_final() && oldest.is_none_or(|o| it.quarantined_ms < o.quarantined_ms) {
            oldest = Some(it);
        }
        match it.outcome {
            Some(Outcome::Applied) => replays.applied += 1,
            Some(Outcome::AlreadyApplied) => replays.already_applied += 1,
            Some(Outcome::Refailed) => replays.refailed += 1,
            None => {}
        }
        let ago = now_ms - it.quarantined_ms;
        if ago >= 0 {
            if let Some(b) = buckets.get_mut((ago / HOUR_MS) as usize) {
                *b += 1;
            }
        }
    }
    let total = replays.applied + replays.already_applied + replays.refailed;
    replays.success_rate =
        (total > 0).then(|| (replays.applied + replays.already_applied) as f64 / total as f64);
    let open = items.iter().filter(|i| !i.state.is_final()).count() as u64;
    // Oldest hour first, so the most recent hours weigh most.
    let mut baseline: Option<f64> = None;
    for &count in buckets[1..].iter().rev() {
        let c = count as f64;
        baseline = Some(match baseline {
            None => c,
            Some(b) => cfg.baseline_alpha * c + (1.0 - cfg.baseline_alpha) * b,
        });
    }
    let baseline = baseline.unwrap_or(0.0);
    let last_hour = buckets[0];
    let mut warnings = Vec::new();
    let arrival_burst =
        last_hour >= cfg.min_arrivals && last_hour as f64 > cfg.arrival_factor * baseline;
    let mut oldest_overdue = false;
    if arrival_burst {
        warnings.push(format!(
            "arrivals: {last_hour} in the last hour, over {}x the baseline of {baseline:.1} per hour",
            cfg.arrival_factor
        ));
    }
    let max_age = parse_span(&cfg.max_oldest_age).unwrap_or(i64::MAX);
    if let Some(o) = oldest {
        let age = now_ms - o.quarantined_ms;
        if age > max_age {
            oldest_overdue = true;
            warnings.push(format!(
                "slow leak: message {} ({}) has waited {} (over {}) with {open} open; depth alone does not show this",
                o.id,
                o.class,
                human_span(age),
                cfg.max_oldest_age
            ));
        }
    }
    Health {
        at_ms: now_ms,
        depth,
        open,
        oldest_open_id: oldest.map(|o| o.id),
        oldest_open_age_ms: oldest.map(|o| now_ms - o.quarantined_ms),
        replays,
        arrivals_last_hour: last_hour,
        arrival_baseline_per_hour: baseline,
        arrival_burst,
        oldest_overdue,
        warnings,
    }
}

impl Health {
    /// The figures as metrics (gauges: the latest round wins).
    pub fn export(&self) {
        use crate::observe;
        for state in State::ALL {
            for class in Class::ALL {
                let n = self
                    .depth
                    .get(state.as_str())
                    .and_then(|c| c.get(class.as_str()))
                    .copied()
                    .unwrap_or(0);
                metrics::gauge!(observe::DLQ_DEPTH, "state" => state.as_str(), "class" => class.as_str())
                    .set(n as f64);
            }
        }
        metrics::gauge!(observe::DLQ_OLDEST_AGE)
            .set(self.oldest_open_age_ms.unwrap_or(0) as f64 / 1000.0);
        metrics::gauge!(observe::DLQ_REPLAY_SUCCESS).set(self.replays.success_rate.unwrap_or(1.0));
        metrics::gauge!(observe::DLQ_REPLAY_REFAILED).set(self.replays.refailed as f64);
        metrics::gauge!(observe::DLQ_ARRIVALS).set(self.arrivals_last_hour as f64);
        metrics::gauge!(observe::DLQ_ARRIVAL_BASELINE).set(self.arrival_baseline_per_hour);
        metrics::gauge!(observe::DLQ_WARNINGS).set(self.warnings.len() as f64);
        observe::Alert::DlqArrivalBurst.set(self.arrival_burst);
        observe::Alert::DlqOldestOverdue.set(self.oldest_overdue);
    }

    /// Each warning with the alert it raises ([`compute`] pushes the
    /// arrival burst's first, then the overdue message's).
    pub fn alerts(&self) -> impl Iterator<Item = (crate::observe::Alert, &str)> {
        use crate::observe::Alert;
        [
            (self.arrival_burst, Alert::DlqArrivalBurst),
            (self.oldest_overdue, Alert::DlqOldestOverdue),
        ]
        .into_iter()
        .filter(|(firing, _)| *firing)
        .map(|(_, a)| a)
        .zip(self.warnings.iter().map(String::as_str))
    }

    pub fn render(&self) -> String {
        let mut out = format!(
            "dead letters at {}: {} open\n",
            crate::retention::time::rfc3339(self.at_ms),
            self.open
        );
        for (state, classes) in &self.depth {
            for (class, n) in classes {
                out.push_str(&format!("  {state:<18} {class:<21} {n}\n"));
            }
        }
        match (self.oldest_open_id, self.oldest_open_age_ms) {
            (Some(id), Some(age)) => out.push_str(&format!(
                "oldest open: message {id}, waiting {}\n",
                human_span(age)
            )),
            _ => out.push_str("oldest open: none\n"),
        }
        let r = &self.replays;
        out.push_str(&format!(
            "replays: {} applied, {} already applied, {} failed again; success rate {}\n",
            r.applied,
            r.already_applied,
            r.refailed,
            r.success_rate
                .map(|s| format!("{:.1}%", s * 100.0))
                .unwrap_or_else(|| "n/a".into())
        ));
        out.push_str(&format!(
            "arrivals: {} in the last hour, baseline {:.1} per hour\n",
            self.arrivals_last_hour, self.arrival_baseline_per_hour
        ));
        for w in &self.warnings {
            out.push_str(&format!("warning: {w}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000;

    fn item(id: i64, state: State, class: Class, at: i64) -> Item {
        Item {
            id,
            state,
            class,
            quarantined_ms: at,
            outcome: None,
        }
    }

    /// A queue where one message arrives every hour and the one before it
    /// is replayed, so depth stays at two; message 0 is never addressed.
    fn leaking(hours: i64) -> Vec<Item> {
        let mut items = vec![item(0, State::Quarantined, Class::ConstraintViolation, T0)];
        for h in 1..=hours {
            let state = if h == hours {
                State::Quarantined
            } else {
                State::Replayed
            };
            let mut it = item(h, state, Class::SinkUnavailable, T0 + h * HOUR_MS);
            if state == State::Replayed {
                it.outcome = Some(Outcome::Applied);
            }
            items.push(it);
        }
        items
    }

    #[test]
    fn a_slow_leak_is_flagged_while_depth_stays_flat() {
        let cfg = DlqHealthConfig::default(); // max_oldest_age 24h
        let mut depths = Vec::new();
        for hours in [6, 12, 20, 24, 30] {
            let now = T0 + hours * HOUR_MS + 60_000;
            let h = compute(&leaking(hours), now, &cfg);
            depths.push(h.open);
            assert_eq!(h.oldest_open_id, Some(0));
            assert_eq!(h.oldest_open_age_ms, Some(hours * HOUR_MS + 60_000));
            let leak = h.warnings.iter().any(|w| w.starts_with("slow leak"));
            assert_eq!(leak, hours >= 24, "after {hours}h: {:?}", h.warnings);
            assert_eq!(h.oldest_overdue, leak);
            assert!(!h.arrival_burst);
            let alerts: Vec<_> = h.alerts().map(|(a, _)| a.name()).collect();
            assert_eq!(
                alerts,
                if leak {
                    vec!["dlq_oldest_overdue"]
                } else {
                    vec![]
                }
            );
            // One arrival an hour is its own baseline: no arrival warning.
            assert!(
                !h.warnings.iter().any(|w| w.starts_with("arrivals")),
                "{:?}",
                h.warnings
            );
        }
        assert!(depths.iter().all(|&d| d == 2), "depth moved: {depths:?}");
    }

    #[test]
    fn a_burst_over_k_times_the_baseline_warns() {
        let cfg = DlqHealthConfig::default(); // k = 3, min 5
        let now = T0 + 100 * HOUR_MS;
        // Two arrivals every hour for 100 hours...
        let mut items: Vec<Item> = (0..200)
            .map(|i| {
                item(
                    i,
                    State::Archived,
                    Class::ConstraintViolation,
                    T0 + (i / 2) * HOUR_MS,
                )
            })
            .collect();
        let calm = compute(&items, now, &cfg);
        assert!((calm.arrival_baseline_per_hour - 2.0).abs() < 0.01);
        assert!(calm.warnings.is_empty(), "{:?}", calm.warnings);
        // ... then 5 in the last hour: under 3x the baseline of (about) 2.
        for i in 0..5 {
            items.push(item(
                1000 + i,
                State::Quarantined,
                Class::SinkUnavailable,
                now - 1000,
            ));
        }
        let h = compute(&items, now, &cfg);
        assert_eq!(h.arrivals_last_hour, 5);
        assert!(h.warnings.is_empty(), "{:?}", h.warnings);
        for i in 0..2 {
            items.push(item(
                2000 + i,
                State::Quarantined,
                Class::SinkUnavailable,
                now - 10,
            ));
        }
        let h = compute(&items, now, &cfg);
        assert_eq!(h.arrivals_last_hour, 7);
        assert!(h.warnings[0].starts_with("arrivals: 7"), "{:?}", h.warnings);
        assert!(h.arrival_burst && !h.oldest_overdue);
        let alerts: Vec<_> = h.alerts().collect();
        assert_eq!(alerts.len(), 1);
        assert_eq!(alerts[0].0.name(), "dlq_arrival_burst");
        assert!(alerts[0].1.starts_with("arrivals: 7"));
    }

    #[test]
    fn a_few_arrivals_on_a_quiet_queue_do_not_warn() {
        let cfg = DlqHealthConfig::default();
        let now = T0;
        let items: Vec<Item> = (0..4)
            .map(|i| item(i, State::Quarantined, Class::Oversized, now - 100))
            .collect();
        let h = compute(&items, now, &cfg);
        assert_eq!(h.arrival_baseline_per_hour, 0.0);
        assert!(h.warnings.is_empty(), "{:?}", h.warnings);
    }

    #[test]
    fn replay_success_rate_counts_failures_that_came_back() {
        let cfg = DlqHealthConfig::default();
        let mut items = Vec::new();
        for (i, o) in [
            Outcome::Applied,
            Outcome::Applied,
            Outcome::AlreadyApplied,
            Outcome::Refailed,
        ]
        .into_iter()
        .enumerate()
        {
            let mut it = item(i as i64, State::Replayed, Class::SinkUnavailable, T0);
            it.outcome = Some(o);
            items.push(it);
        }
        // The quarantine the failed replay came back as.
        items.push(item(9, State::Quarantined, Class::ConstraintViolation, T0));
        let h = compute(&items, T0 + 1000, &cfg);
        assert_eq!(h.replays.success_rate, Some(0.75));
        assert_eq!(h.open, 1);
        assert_eq!(h.depth["replayed"]["sink_unavailable"], 4);
        assert_eq!(h.depth["quarantined"]["constraint_violation"], 1);
        assert_eq!(compute(&[], T0, &cfg).replays.success_rate, None);
    }
}
