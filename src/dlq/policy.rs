//! Policies: what happens to a quarantined message without a person.
//!
//! Guarantee: a policy only ever touches messages still `quarantined`
//! (anything a person reviewed is theirs), an automatic replay covers only
//! its named classes and its window of first failures, and it goes
//! through the same checks as a manual one (it is an approval, not a
//! bypass). Everything else waits for `pgcdc dlq approve`.

use std::collections::BTreeMap;

use super::{Class, State};
use crate::config::{DlqAction, DlqPolicyConfig};
use crate::retention::time::{parse_span, parse_timestamp};

/// What a policy decided for one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Review, approve and replay it (both checks run); actor `auto:<policy>`.
    Replay { policy: String },
    /// Review and archive it with this reason; actor `auto:<policy>`.
    Archive { policy: String, reason: String },
}

/// What a policy looks at.
#[derive(Debug, Clone, Copy)]
pub struct Subject {
    pub state: State,
    pub class: Class,
    pub first_failure_ms: i64,
    pub quarantined_ms: i64,
}

/// The first policy (by name) that applies; replays before archives, so
/// an archive cutoff never beats a replay window.
pub fn decide(
    policies: &BTreeMap<String, DlqPolicyConfig>,
    m: &Subject,
    now_ms: i64,
) -> Option<Decision> {
    if m.state != State::Quarantined {
        return None;
    }
    let covers = |p: &DlqPolicyConfig| p.classes.iter().any(|c| c == m.class.as_str());
    for (name, p) in policies
        .iter()
        .filter(|(_, p)| p.action == DlqAction::Replay)
    {
        let window = p
            .from
            .as_deref()
            .and_then(parse_timestamp)
            .zip(p.until.as_deref().and_then(parse_timestamp));
        if let Some((from, until)) = window {
            if covers(p) && (from..until).contains(&m.first_failure_ms) {
                return Some(Decision::Replay {
                    policy: name.clone(),
                });
            }
        }
    }
    for (name, p) in policies
        .iter()
        .filter(|(_, p)| p.action == DlqAction::Archive)
    {
        let Some(after) = p.after.as_deref().and_then(parse_span) else {
            continue;
        };
        if (p.classes.is_empty() || covers(p)) && now_ms - m.quarantined_ms >= after {
            return Some(Decision::Archive {
                policy: name.clone(),
                reason: format!(
                    "not addressed within {} (policy {name})",
                    p.after.as_deref().unwrap_or_default()
                ),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> i64 {
        parse_timestamp(text).expect("time")
    }

    fn policies() -> BTreeMap<String, DlqPolicyConfig> {
        let mut p = BTreeMap::new();
        p.insert(
            "maintenance".to_string(),
            DlqPolicyConfig {
                action: DlqAction::Replay,
                classes: vec!["sink_unavailable".into()],
                from: Some("2026-12-01T02:00:00Z".into()),
                until: Some("2026-12-01T04:00:00Z".into()),
                after: None,
            },
        );
        p.insert(
            "stale".to_string(),
            DlqPolicyConfig {
                action: DlqAction::Archive,
                classes: vec![],
                from: None,
                until: None,
                after: Some("30d".into()),
            },
        );
        p
    }

    fn subject(class: Class, failed: &str, state: State) -> Subject {
        Subject {
            state,
            class,
            first_failure_ms: at(failed),
            quarantined_ms: at(failed),
        }
    }

    #[test]
    fn auto_replay_covers_only_its_class_and_window() {
        let p = policies();
        let now = at("2026-12-01T05:00:00Z");
        let replay = Some(Decision::Replay {
            policy: "maintenance".into(),
        });
        let s = |class, failed| decide(&p, &subject(class, failed, State::Quarantined), now);
        assert_eq!(s(Class::SinkUnavailable, "2026-12-01T02:00:00Z"), replay);
        assert_eq!(
            s(Class::SinkUnavailable, "2026-12-01T03:59:59.999Z"),
            replay
        );
        // The window's end is exclusive; before it is outside too.
        assert_eq!(s(Class::SinkUnavailable, "2026-12-01T04:00:00Z"), None);
        assert_eq!(s(Class::SinkUnavailable, "2026-12-01T01:59:59Z"), None);
        // Another class in the window waits for a person.
        assert_eq!(s(Class::ConstraintViolation, "2026-12-01T03:00:00Z"), None);
    }

    #[test]
    fn policies_leave_what_a_person_took_up() {
        let p = policies();
        let now = at("2027-06-01T00:00:00Z");
        for state in [State::UnderReview, State::SchemaCheck, State::Archived] {
            let m = subject(Class::SinkUnavailable, "2026-12-01T03:00:00Z", state);
            assert_eq!(decide(&p, &m, now), None, "{state}");
        }
    }

    #[test]
    fn auto_archive_after_the_cutoff_with_a_reason() {
        let p = policies();
        let m = subject(
            Class::Deserialization,
            "2026-11-01T00:00:00Z",
            State::Quarantined,
        );
        assert_eq!(decide(&p, &m, at("2026-11-30T23:59:59Z")), None);
        match decide(&p, &m, at("2026-12-01T00:00:00Z")) {
            Some(Decision::Archive { policy, reason }) => {
                assert_eq!(policy, "stale");
                assert!(reason.contains("not addressed within 30d"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // A replay window wins over the cutoff.
        let m = subject(
            Class::SinkUnavailable,
            "2026-12-01T03:00:00Z",
            State::Quarantined,
        );
        assert!(matches!(
            decide(&p, &m, at("2027-06-01T00:00:00Z")),
            Some(Decision::Replay { .. })
        ));
    }
}
