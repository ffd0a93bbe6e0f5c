//! The dead-letter workflow: quarantine, classify, check, then replay or
//! archive.
//!
//! ```text
//!  materialize / run ──► <prefix>.dlq ──sync──► pgcdc_dlq (state + audit)
//!                                                   │
//!   review ─► approve ─► schema check ─► idempotency check ─► apply ─► replayed
//!      │                      │                 │                      (outcome)
//!      └──────────────────────┴─────────────────┴──► archived (reason kept)
//! ```
//!
//! Guarantees:
//! - **Nothing is replayed unchecked.** Manual and automatic replays run
//!   the same [`replay`]: the schema check, then the idempotency check,
//!   then the apply path; a policy's replay is an approval, not a bypass.
//! - **Nothing is lost.** A message is durable in the topic before its
//!   origin's offsets move, recorded in the store before it can change
//!   state, and archived rather than deleted; a replay that fails again
//!   becomes a new quarantine linked to the old one.
//! - **Every transition is audited** with its actor (a person's name, or
//!   `auto:<policy>`), reason and time.

pub mod class;
pub mod health;
pub mod policy;
pub mod record;
pub mod state;
pub mod store;

use std::fmt::Write as _;

use serde::Serialize;

pub use class::{classify, Class, Fault, Verdict};
pub use state::{Outcome, State};
use store::{DeadLetter, Extra, Filter};

use crate::config::Config;
use crate::materialize::replay::{Applied, Replayer, SchemaVerdict};

#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(transparent)]
    Apply(#[from] crate::materialize::MaterializeError),
}

/// A person's name for the audit; `auto:` is the policies' prefix.
pub fn check_actor(actor: &str) -> Result<(), DlqError> {
    if actor.trim().is_empty() {
        return Err(DlqError::Usage(
            "--actor: give your name for the audit".into(),
        ));
    }
    if actor.starts_with("auto:") {
        return Err(DlqError::Usage(
            "--actor: names starting with auto: are reserved for policies".into(),
        ));
    }
    Ok(())
}

/// Connects to the target, makes the store ready and records what the
/// topic holds that it does not.
pub async fn open(config: &Config) -> Result<tokio_postgres::Client, DlqError> {
    let target = config
        .target
        .as_ref()
        .ok_or_else(|| DlqError::Usage("target: is required (the store lives there)".into()))?;
    let mut db = crate::source::connect(&target.url)
        .await
        .map_err(store::StoreError::Db)?;
    store::ensure(&db).await?;
    // Created with the workflow's settings, never auto-created by a read.
    let topic = crate::materialize::dlq_topic(config);
    crate::sink::ensure_dlq_topic(&config.kafka, &topic)
        .await
        .map_err(|e| store::StoreError::Kafka(e.to_string()))?;
    crate::sink::check_dlq_topic(&config.kafka, &topic)
        .await
        .map_err(store::StoreError::Kafka)?;
    store::sync(config, &mut db).await?;
    Ok(db)
}

/// What a command did to each message it matched.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub done: Vec<(i64, String)>,
    pub refused: Vec<(i64, String)>,
}

impl Report {
    pub fn render(&self, verb: &str) -> String {
        let mut out = String::new();
        for (id, what) in &self.done {
            let _ = writeln!(out, "{id}: {what}");
        }
        let _ = writeln!(
            out,
            "{} {verb}, {} refused",
            self.done.len(),
            self.refused.len()
        );
        out
    }
}

/// Moves every matched message `from` (any of) `to`; a message elsewhere
/// is refused with the workflow's reason.
pub async fn move_all(
    db: &tokio_postgres::Client,
    filter: &Filter,
    default_from: &[State],
    to: State,
    actor: &str,
    reason: &str,
) -> Result<Report, DlqError> {
    let mut f = filter.clone();
    if f.ids.is_empty() && f.states.is_empty() {
        f.states = default_from.to_vec();
    }
    let mut report = Report::default();
    for m in store::list(db, &f).await? {
        match store::transition(db, m.id, m.state, to, actor, reason, Extra::default()).await {
            Ok(()) => report.done.push((m.id, format!("{} → {to}", m.state))),
            Err(store::StoreError::Refused { why, .. }) => {
                report.refused.push((m.id, why));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(report)
}

/// The summary of a replay.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub dry_run: bool,
    pub messages: u64,
    pub already_applied: u64,
    pub archived: u64,
    pub replayed: u64,
    pub refailed: u64,
    /// Not approved yet (quarantined or under review).
    pub waiting: u64,
    /// One line per message.
    pub lines: Vec<String>,
}

impl Summary {
    pub fn line(&self) -> String {
        let verb = |now: &str, would: &str| {
            if self.dry_run {
                would.to_string()
            } else {
                now.to_string()
            }
        };
        let mut s = format!(
            "{} messages, {} already applied, {} {} (schema incompatible), {} {}",
            self.messages,
            self.already_applied,
            self.archived,
            verb("archived", "would be archived"),
            self.replayed,
            verb("replayed", "would be replayed"),
        );
        if self.refailed > 0 {
            let _ = write!(s, ", {} failed again (new quarantines)", self.refailed);
        }
        if self.waiting > 0 {
            let _ = write!(s, ", {} waiting for approve", self.waiting);
        }
        s
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for l in &self.lines {
            let _ = writeln!(out, "{l}");
        }
        let _ = writeln!(out, "{}", self.line());
        out
    }
}

/// Replays the approved messages a filter matches, in topic order: schema
/// check, idempotency check, apply. `dry_run` changes nothing and says
/// what each message would do (approved or not).
pub async fn replay(
    replayer: &mut Replayer,
    filter: &Filter,
    actor: &str,
    dry_run: bool,
) -> Result<Summary, DlqError> {
    let mut f = filter.clone();
    if f.ids.is_empty() && f.states.is_empty() {
        f.states = vec![
            State::Quarantined,
            State::UnderReview,
            State::SchemaCheck,
            State::IdempotencyCheck,
        ];
    }
    let messages = store::list(&*replayer.db(), &f).await?;
    let mut settled: std::collections::HashSet<i64> = std::collections::HashSet::new();
    let mut refailed: std::collections::HashSet<(String, Vec<u8>)> =
        std::collections::HashSet::new();
    let mut s = Summary {
        dry_run,
        ..Summary::default()
    };
    for m in messages {
        if m.state.is_final() {
            s.lines
                .push(format!("{}: {} already; nothing to do", m.id, m.state));
            continue;
        }
        s.messages += 1;
        let approved = matches!(m.state, State::SchemaCheck | State::IdempotencyCheck);
        if !approved && !dry_run {
            s.waiting += 1;
            s.lines.push(format!(
                "{}: {}, waiting for approve (pgcdc dlq approve)",
                m.id, m.state
            ));
            continue;
        }
        // A key's changes replay in their order: one waits while an older
        // dead letter of its key is open (and not settled by this run),
        // or failed again in this run.
        let key = m.key.clone().map(|k| (m.origin_topic.clone(), k));
        let blocking = store::older_open(&*replayer.db(), &m).await?;
        let waits_for = blocking.iter().find(|id| !settled.contains(*id)).copied();
        if waits_for.is_some() || key.as_ref().is_some_and(|k| refailed.contains(k)) {
            s.waiting += 1;
            s.lines.push(match waits_for {
                Some(id) => format!(
                    "{}: waits for message {id}, an older dead letter of its key still open",
                    m.id
                ),
                None => format!("{}: waits: an older change of its key failed again", m.id),
            });
            continue;
        }
        let refailed_before = s.refailed;
        let line = replay_one(replayer, &m, actor, dry_run, &mut s).await?;
        settled.insert(m.id);
        if s.refailed > refailed_before {
            refailed.extend(key);
        }
        let prefix = if approved { "" } else { "not approved; " };
        s.lines.push(format!("{}: {prefix}{line}", m.id));
        if !approved {
            s.waiting += 1;
        }
    }
    Ok(s)
}

async fn replay_one(
    r: &mut Replayer,
    m: &DeadLetter,
    actor: &str,
    dry_run: bool,
    s: &mut Summary,
) -> Result<String, DlqError> {
    let verdict = r.schema_check(m).await?;
    let (mapped, note) = match &verdict {
        SchemaVerdict::Compatible => (false, None),
        SchemaVerdict::Transformed(how) => (true, Some(how.clone())),
        SchemaVerdict::Incompatible(why) => {
            s.archived += 1;
            if !dry_run {
                let reason = format!("schema incompatible: {why}");
                store::transition(
                    &*r.db(),
                    m.id,
                    m.state,
                    State::Archived,
                    actor,
                    &reason,
                    Extra {
                        outcome: None,
                        note: Some(why),
                    },
                )
                .await?;
            }
            return Ok(format!(
                "{} (schema incompatible: {why})",
                if dry_run { "would archive" } else { "archived" }
            ));
        }
    };
    if m.state == State::SchemaCheck && !dry_run {
        let reason = note.as_deref().unwrap_or("schema compatible");
        store::transition(
            &*r.db(),
            m.id,
            State::SchemaCheck,
            State::IdempotencyCheck,
            actor,
            reason,
            Extra {
                outcome: None,
                note: note.as_deref(),
            },
        )
        .await?;
    }
    if r.already_applied(m, mapped).await? == Some(true) {
        s.already_applied += 1;
        if !dry_run {
            store::transition(
                &*r.db(),
                m.id,
                State::IdempotencyCheck,
                State::Replayed,
                actor,
                "already applied: the stored position of its key is not older",
                Extra {
                    outcome: Some(Outcome::AlreadyApplied),
                    note: None,
                },
            )
            .await?;
        }
        return Ok("already applied; not applied again".into());
    }
    if dry_run {
        s.replayed += 1;
        return Ok(match note {
            Some(how) => format!("would replay ({how})"),
            None => "would replay".into(),
        });
    }
    Ok(match r.apply(m, mapped, actor).await? {
        Applied::Applied => {
            s.replayed += 1;
            match note {
                Some(how) => format!("replayed ({how})"),
                None => "replayed".into(),
            }
        }
        Applied::AlreadyApplied => {
            s.already_applied += 1;
            "already applied (meanwhile); not applied again".into()
        }
        Applied::Refailed { class, error } => {
            s.refailed += 1;
            format!("failed again ({class}: {error}); quarantined anew")
        }
    })
}

/// One round of the policies at `now_ms`: what each did, by message.
#[derive(Debug, Default, Serialize)]
pub struct PolicyRound {
    pub archived: Vec<(i64, String)>,
    pub replayed: Summary,
    /// Messages a policy could not act on, with why (the round went on).
    pub failed: Vec<(i64, String)>,
}

/// Applies the policies to every quarantined message once, a message at a
/// time: one that fails (a registry outage, a person moving it meanwhile)
/// is reported and the round goes on.
pub async fn enforce(
    config: &Config,
    replayer: &mut Replayer,
    now_ms: i64,
    dry_run: bool,
) -> Result<PolicyRound, DlqError> {
    let quarantined = store::list(
        &*replayer.db(),
        &Filter {
            states: vec![State::Quarantined],
            ..Filter::default()
        },
    )
    .await?;
    let mut round = PolicyRound {
        replayed: Summary {
            dry_run,
            ..Summary::default()
        },
        ..PolicyRound::default()
    };
    // What a policy approved in an earlier round but could not replay
    // (the registry down, say): taken up again under the same policy.
    for (id, actor) in store::approved_by(&*replayer.db(), "auto:").await? {
        let still = actor.strip_prefix("auto:").is_some_and(|name| {
            config
                .dlq
                .policies
                .get(name)
                .is_some_and(|p| p.action == crate::config::DlqAction::Replay)
        });
        if !still {
            continue;
        }
        let filter = Filter {
            ids: vec![id],
            ..Filter::default()
        };
        match replay(replayer, &filter, &actor, dry_run).await {
            Ok(s) => add_replays(&mut round, &actor, s),
            Err(e) => {
                tracing::warn!(id, error = %e, "a policy could not resume this dead letter; the round goes on");
                round.failed.push((id, e.to_string()));
            }
        }
    }
    for m in &quarantined {
        let subject = policy::Subject {
            state: m.state,
            class: m.class,
            first_failure_ms: m.first_failure_ms,
            quarantined_ms: m.quarantined_ms,
        };
        let Some(decision) = policy::decide(&config.dlq.policies, &subject, now_ms) else {
            continue;
        };
        if let Err(e) = apply_decision(replayer, m.id, &decision, dry_run, &mut round).await {
            tracing::warn!(id = m.id, error = %e, "a policy could not act on this dead letter; the round goes on");
            round.failed.push((m.id, e.to_string()));
        }
    }
    Ok(round)
}

async fn apply_decision(
    replayer: &mut Replayer,
    id: i64,
    decision: &policy::Decision,
    dry_run: bool,
    round: &mut PolicyRound,
) -> Result<(), DlqError> {
    let (policy, to, reason) = match decision {
        policy::Decision::Archive { policy, reason } => (policy, State::Archived, reason.clone()),
        policy::Decision::Replay { policy } => (
            policy,
            State::SchemaCheck,
            format!("inside the window of policy {policy}: approved"),
        ),
    };
    let actor = format!("auto:{policy}");
    if !dry_run {
        let db = &*replayer.db();
        store::transition(
            db,
            id,
            State::Quarantined,
            State::UnderReview,
            &actor,
            &reason,
            Extra::default(),
        )
        .await?;
        store::transition(
            db,
            id,
            State::UnderReview,
            to,
            &actor,
            &reason,
            Extra::default(),
        )
        .await?;
    }
    if to == State::Archived {
        if !dry_run {
            metrics::counter!(crate::observe::DLQ_POLICY_ACTIONS, "policy" => policy.clone(), "action" => "archive").increment(1);
        }
        round.archived.push((id, reason));
        return Ok(());
    }
    let s = replay(
        replayer,
        &Filter {
            ids: vec![id],
            ..Filter::default()
        },
        &actor,
        dry_run,
    )
    .await?;
    if !dry_run {
        metrics::counter!(crate::observe::DLQ_POLICY_ACTIONS, "policy" => policy.clone(), "action" => "replay")
            .increment(s.replayed + s.already_applied);
    }
    add_replays(round, &actor, s);
    Ok(())
}

fn add_replays(round: &mut PolicyRound, actor: &str, s: Summary) {
    let r = &mut round.replayed;
    r.messages += s.messages;
    r.already_applied += s.already_applied;
    r.archived += s.archived;
    r.replayed += s.replayed;
    r.refailed += s.refailed;
    // A dry run counts them as not approved; the policy would approve them.
    if !s.dry_run {
        r.waiting += s.waiting;
    }
    r.lines.extend(
        s.lines
            .into_iter()
            .map(|l| format!("{actor}: {l}").replace("not approved; ", "")),
    );
}

/// The health figures at `now_ms`.
pub async fn stats(
    config: &Config,
    db: &tokio_postgres::Client,
    now_ms: i64,
) -> Result<health::Health, DlqError> {
    let items = store::health_items(db).await?;
    Ok(health::compute(&items, now_ms, &config.dlq.health))
}

/// The materializer's rounds, every `dlq.check_interval_secs`: record new
/// arrivals, apply the policies, export the health figures (and warn).
pub async fn keep(config: std::sync::Arc<Config>, held: crate::materialize::SharedHeld) {
    let every = std::time::Duration::from_secs(config.dlq.check_interval_secs.max(1));
    let mut replayer: Option<Replayer> = None;
    loop {
        tokio::time::sleep(every).await;
        if replayer.is_none() {
            let opened = match Replayer::open(&config).await {
                Ok(mut r) => store::ensure(&*r.db())
                    .await
                    .map(|()| r)
                    .map_err(DlqError::from),
                Err(e) => Err(e.into()),
            };
            match opened {
                Ok(r) => replayer = Some(r),
                Err(e) => {
                    tracing::warn!(error = %e, "dead-letter round skipped: cannot open the target");
                    continue;
                }
            }
        }
        let Some(r) = replayer.as_mut() else { continue };
        match round(&config, r, &held).await {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(error = %e, "dead-letter round failed; trying again later");
                if r.db().is_closed() {
                    replayer = None;
                }
            }
        }
    }
}

async fn round(
    config: &Config,
    r: &mut Replayer,
    held: &crate::materialize::SharedHeld,
) -> Result<(), DlqError> {
    let synced = std::time::Instant::now();
    store::sync(config, r.db()).await?;
    let now = crate::connector::now_ms();
    if !config.dlq.policies.is_empty() {
        let done = enforce(config, r, now, false).await?;
        if !done.archived.is_empty() || done.replayed.messages > 0 {
            tracing::info!(
                archived = done.archived.len(),
                replay = %done.replayed.line(),
                "dead-letter policies applied"
            );
        }
    }
    // After the policies: what they resolved no longer holds its key.
    let homes = config.homes();
    let keys = r
        .open_keys()
        .await?
        .into_iter()
        .map(|((topic, key), class)| {
            let topic = homes.get(&topic).cloned().unwrap_or(topic);
            ((topic, key), class)
        })
        .collect();
    held.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .refresh(keys, synced);
    let h = stats(config, &*r.db(), now).await?;
    h.export();
    for (alert, w) in h.alerts() {
        tracing::warn!(alert = alert.name(), warning = %w, "dead-letter health (see the README's runbook: a poison message)");
    }
    Ok(())
}
