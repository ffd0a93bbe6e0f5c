//! The states of a quarantined message and the transitions between them.
//!
//! ```text
//!  quarantined ─► under_review ─► schema_check ─► idempotency_check ─► replayed
//!                      │               │                 │
//!                      └───────────────┴─────────────────┴──────────► archived
//! ```
//!
//! Guarantee: [`check`] is the only judge of a transition; `replayed` and
//! `archived` are final, and nothing reaches `replayed` without passing
//! both checks in order.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Quarantined,
    UnderReview,
    SchemaCheck,
    IdempotencyCheck,
    Replayed,
    Archived,
}

impl State {
    pub const ALL: [State; 6] = [
        State::Quarantined,
        State::UnderReview,
        State::SchemaCheck,
        State::IdempotencyCheck,
        State::Replayed,
        State::Archived,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Quarantined => "quarantined",
            State::UnderReview => "under_review",
            State::SchemaCheck => "schema_check",
            State::IdempotencyCheck => "idempotency_check",
            State::Replayed => "replayed",
            State::Archived => "archived",
        }
    }

    pub fn parse(text: &str) -> Option<State> {
        State::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Replayed or archived: nothing follows.
    pub fn is_final(self) -> bool {
        matches!(self, State::Replayed | State::Archived)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Applied through the normal apply path.
    Applied,
    /// The idempotency check found it (or something newer) applied.
    AlreadyApplied,
    /// It failed again and came back as a new quarantine.
    Refailed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::AlreadyApplied => "already_applied",
            Outcome::Refailed => "refailed",
        }
    }

    pub fn parse(text: &str) -> Option<Outcome> {
        [Outcome::Applied, Outcome::AlreadyApplied, Outcome::Refailed]
            .into_iter()
            .find(|o| o.as_str() == text)
    }
}

/// Whether `from → to` is a transition of the workflow; the error says why
/// not.
pub fn check(from: State, to: State) -> Result<(), String> {
    use State::*;
    let allowed = matches!(
        (from, to),
        (Quarantined, UnderReview)
            | (UnderReview, SchemaCheck)
            | (SchemaCheck, IdempotencyCheck)
            | (IdempotencyCheck, Replayed)
            | (UnderReview | SchemaCheck | IdempotencyCheck, Archived)
    );
    if allowed {
        return Ok(());
    }
    Err(match (from, to) {
        (f, _) if f.is_final() => format!("{from} is final: nothing follows it"),
        (_, Replayed) => format!(
            "{from} → replayed skips a check: a replay passes schema_check and idempotency_check first"
        ),
        (Quarantined, Archived) => {
            "quarantined → archived: a message is reviewed before it is archived".to_string()
        }
        (Quarantined, _) => format!("{from} → {to}: review the message first"),
        _ => format!("{from} → {to} is not a transition of the workflow"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use State::*;

    #[test]
    fn exactly_the_diagrams_transitions_are_allowed() {
        let allowed = [
            (Quarantined, UnderReview),
            (UnderReview, SchemaCheck),
            (UnderReview, Archived),
            (SchemaCheck, IdempotencyCheck),
            (SchemaCheck, Archived),
            (IdempotencyCheck, Replayed),
            (IdempotencyCheck, Archived),
        ];
        for from in State::ALL {
            for to in State::ALL {
                let ok = check(from, to).is_ok();
                assert_eq!(ok, allowed.contains(&(from, to)), "{from} → {to}");
            }
        }
    }

    #[test]
    fn refusals_say_why() {
        let e = check(Archived, Replayed).expect_err("refused");
        assert!(e.contains("archived is final"), "{e}");
        let e = check(UnderReview, Replayed).expect_err("refused");
        assert!(e.contains("skips a check"), "{e}");
        let e = check(SchemaCheck, Replayed).expect_err("refused");
        assert!(e.contains("skips a check"), "{e}");
        let e = check(Quarantined, Archived).expect_err("refused");
        assert!(e.contains("reviewed before"), "{e}");
        let e = check(Quarantined, SchemaCheck).expect_err("refused");
        assert!(e.contains("review the message first"), "{e}");
        let e = check(Replayed, UnderReview).expect_err("refused");
        assert!(e.contains("final"), "{e}");
    }

    #[test]
    fn names_parse_back() {
        for s in State::ALL {
            assert_eq!(State::parse(s.as_str()), Some(s));
        }
        for o in [Outcome::Applied, Outcome::AlreadyApplied, Outcome::Refailed] {
            assert_eq!(Outcome::parse(o.as_str()), Some(o));
        }
    }
}
