//! The command line: one binary, one subcommand per job.
//!
//! Every subcommand that talks to a pipeline takes `--config
//! connectors/NAME.toml` (or `PGCDC_CONFIG`); fields can be overridden from
//! the environment (see [`crate::config`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{canonical_table, Config, ConfigError};
use crate::registry::{api, store::Store};
use crate::secret::Dsn;
use crate::source::{self, slot};
use crate::{exit, preflight};

#[derive(Debug, Parser)]
#[command(
    name = "pgcdc",
    version,
    about = "Postgres change-data-capture to Kafka: Avro changelogs, read models, dead letters",
    long_about = "Postgres change-data-capture to Kafka: Avro changelogs, read models, dead letters.\n\n\
Exit codes: 0 ok, 1 failure, 2 a check or requirement did not hold.\n\
Logging: RUST_LOG (default info). Row values are never logged."
)]
pub struct Cli {
    /// Log lines as `text` (for people) or `json` (one object per line,
    /// for log shippers). Row values and secrets are never logged.
    #[arg(long, global = true, env = "PGCDC_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Parse and validate a connector definition, then print the effective
    /// config with secrets redacted. Exit 2 when it is invalid.
    Validate(ConfigArg),
    /// Print the configuration reference (markdown): every key with its
    /// type, default and meaning, generated from the config types.
    Reference,
    /// Preflight against the live systems: Postgres (wal_level, slots, WAL
    /// senders, role, tables, replica identity, publication, slot state),
    /// Kafka (reachability, topic configs), the schema registry and the
    /// target database. One line per check with a fix hint; exit 2 if any
    /// check fails.
    Check(ConfigArg),
    /// Run the connector: create the publication and slot if missing, take
    /// the initial snapshot, then stream every change to Kafka as Avro
    /// changelog events. SIGINT/SIGTERM flush, confirm and exit 0.
    Run(RunArgs),
    /// Build the mirror tables and read models in the target database from
    /// the changelog topics, in a consumer group, with exactly-once effects
    /// (position guard, offsets committed after the database transaction).
    /// SIGINT/SIGTERM finish the batch in hand and exit 0.
    Materialize(RunArgs),
    /// Print changelog events as JSON lines, decoded through the registry.
    /// Read-only: joins no consumer group, commits nothing.
    Tail(TailArgs),
    /// Serve a Confluent-compatible schema registry (Avro) backed by
    /// Postgres. Point pgcdc, Kafka clients and Confluent's serializers at
    /// http://LISTEN.
    Registry(RegistryArgs),
    /// How far back each read model can be rebuilt from what Kafka still
    /// holds: per source topic the retained offsets and their times, the
    /// topic's cleanup.policy and retention settings, and whether the log
    /// still begins with a complete snapshot; per read model the reach
    /// (full history since T, current state only, or not rebuildable
    /// without a new snapshot, with the gap named); and the slot's WAL and
    /// its risk of invalidation. Exit 2 when a requirement (--require, or
    /// read_models.NAME.require_reach) is not met.
    Retention(RetentionArgs),
    /// Rebuild a read model from the retained changelog: replay its source
    /// topics into shadow tables with the materializer's dedup rules, then
    /// swap them in atomically (the live mirrors of its sources, and every
    /// read model over them, recomputed in full). Refused (exit 2) when
    /// the log cannot give a complete rebuild, unless --from snapshot.
    Rebuild(RebuildArgs),
    /// Take an incremental snapshot of captured tables while `pgcdc run`
    /// streams: the connector reads them in key-ordered chunks and drops
    /// from each the keys that changes its read could not see touched, so
    /// a snapshot row never overwrites a newer change. Waits until it
    /// completed unless --no-wait. With --stop, ends the snapshots still
    /// running or waiting (of the tables given, or all) instead.
    Snapshot(SnapshotArgs),
    /// The dead-letter workflow: list, show, review, approve, replay
    /// (schema check, idempotency check, then the apply path), archive,
    /// stats, and the policies' round (enforce). Every command first
    /// records in `pgcdc_dlq` (target database) what `<prefix>.dlq` holds.
    Dlq {
        #[command(subcommand)]
        action: DlqCommand,
    },
    /// What a running `pgcdc run` or `pgcdc materialize` reports on its
    /// admin server: phase, tables and their hot keys (rate, share,
    /// salted), read models, firing alerts.
    Status(StatusArgs),
    /// Show or drop the pipeline's replication slot.
    Slot {
        #[command(subcommand)]
        action: SlotAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum SlotAction {
    /// The slot's state: LSNs, retained WAL, wal_status, safe_wal_size.
    /// Exit 2 when the slot is invalidated (wal_status=lost).
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot (refused while a connection holds it). Postgres then
    /// frees the WAL it retained; the next `pgcdc run` creates a new slot
    /// and, in snapshot mode `initial`, takes a new snapshot.
    Drop {
        #[command(flatten)]
        config: ConfigArg,
        /// Confirm: dropping a slot loses its position in the WAL.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Messages the filters match, oldest first.
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        filter: DlqFilter,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One message: its failure, origin, position, state and audit.
    Show {
        #[command(flatten)]
        config: ConfigArg,
        id: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// quarantined → under_review.
    Review(DlqMove),
    /// under_review → schema_check: the go-ahead for `replay`.
    Approve(DlqMove),
    /// Replay approved messages: schema check (archived with a note when
    /// the writer schema cannot be read and no safe mapping exists),
    /// idempotency check (`already_applied`, not applied again), then the
    /// apply path. Prints a line per message and a summary.
    Replay {
        #[command(flatten)]
        args: DlqMove,
        /// Change nothing; say what each message would do (approved or not).
        #[arg(long)]
        dry_run: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// under_review, schema_check or idempotency_check → archived, keeping
    /// the reason.
    Archive(DlqMove),
    /// Health: depth by state and class, age of the oldest open message,
    /// replay success rate, arrivals against their baseline, warnings.
    Stats {
        #[command(flatten)]
        config: ConfigArg,
        /// Evaluate at this time (RFC 3339) instead of now.
        #[arg(long)]
        at: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Exit 2 when a warning is in force.
        #[arg(long)]
        check: bool,
    },
    /// Apply the policies (dlq.policies) once, as `pgcdc materialize` does
    /// every dlq.check_interval_secs.
    Enforce {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        dry_run: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Which messages: ids, or filters (all of them must match).
#[derive(Debug, clap::Args)]
pub struct DlqFilter {
    /// Message ids (see `pgcdc dlq list`).
    pub ids: Vec<i64>,
    /// quarantined, under_review, schema_check, idempotency_check,
    /// replayed or archived; repeat for several.
    #[arg(long)]
    pub state: Vec<String>,
    /// A failure class, such as sink_unavailable.
    #[arg(long)]
    pub class: Option<String>,
    /// A captured table (schema.table).
    #[arg(long)]
    pub table: Option<String>,
    /// Quarantined at or after: RFC 3339, or a span ago (2h, 7d).
    #[arg(long)]
    pub since: Option<String>,
    /// Quarantined before: RFC 3339, or a span ago.
    #[arg(long)]
    pub until: Option<String>,
    /// Act on every message when no id or filter is given.
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, clap::Args)]
pub struct DlqMove {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(flatten)]
    pub filter: DlqFilter,
    /// Who does this (a person's name), for the audit.
    #[arg(long)]
    pub actor: String,
    /// Why, for the audit (required to archive; replay records the
    /// checks' findings instead).
    #[arg(long)]
    pub reason: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Serve the admin endpoints on ADDR: /metrics (Prometheus), /healthz,
    /// /readyz, /status (JSON) and the status page at /.
    #[arg(long, env = "PGCDC_HTTP_ADDR", alias = "metrics-addr")]
    pub http_addr: Option<SocketAddr>,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The admin server (`--http-addr`) of the process to ask.
    #[arg(long, env = "PGCDC_HTTP_ADDR", default_value = "127.0.0.1:9187")]
    pub http_addr: String,
    /// Print the `/status` JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct RetentionArgs {
    /// Connector definition, e.g. connectors/demo.toml.
    #[arg(
        long,
        short = 'c',
        env = "PGCDC_CONFIG",
        required_unless_present = "json_schema"
    )]
    pub config: Option<PathBuf>,
    /// Only this read model (and its source topics).
    #[arg(long)]
    pub read_model: Option<String>,
    /// Print the report as JSON (its schema: --json-schema).
    #[arg(long)]
    pub json: bool,
    /// Print the JSON Schema of the --json report and exit.
    #[arg(long)]
    pub json_schema: bool,
    /// How far back every reported read model must be rebuildable: a span
    /// (90d, 12h, 1d12h), a timestamp (2026-01-01 or
    /// 2026-01-01T00:00:00Z), an LSN (16/B374D848), or `current` (any
    /// complete rebuild). Exit 2 and name the shortfall when it is not met.
    #[arg(long)]
    pub require: Option<String>,
}

/// Where `pgcdc rebuild` reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RebuildFrom {
    /// The earliest complete snapshot the retained log holds, and every
    /// change after it.
    Earliest,
    /// A fresh incremental snapshot of the source tables (needs `pgcdc
    /// run` streaming); history before it is not in the rebuilt model.
    Snapshot,
}

#[derive(Debug, clap::Args)]
pub struct RebuildArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The read model to rebuild.
    #[arg(long)]
    pub read_model: String,
    /// Where the rebuild reads from.
    #[arg(long, value_enum, default_value_t = RebuildFrom::Earliest)]
    pub from: RebuildFrom,
    /// Print what the rebuild did as JSON.
    #[arg(long)]
    pub json: bool,
    /// With --from snapshot: give up when the snapshot has not completed
    /// after this many seconds (default: wait).
    #[arg(long)]
    pub snapshot_timeout_secs: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// A captured table (schema.table); repeat for several.
    #[arg(long = "table", required_unless_present = "stop")]
    pub tables: Vec<String>,
    /// Stop the incremental snapshots still running or waiting that read
    /// any of the --table tables (all of them without --table): each is
    /// recorded as failed, and the rows it produced stay.
    #[arg(long)]
    pub stop: bool,
    /// Return once the request is in the WAL, without waiting.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds (the snapshot goes on).
    #[arg(long)]
    pub timeout_secs: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Only this captured table (schema.table); default: all of them.
    #[arg(long)]
    pub table: Option<String>,
    /// Stop after this many events.
    #[arg(long, default_value_t = 100)]
    pub max: usize,
    /// Stop when nothing arrives for this many seconds.
    #[arg(long, default_value_t = 5)]
    pub idle_secs: u64,
}

#[derive(Debug, clap::Args)]
pub struct RegistryArgs {
    /// Address to listen on.
    #[arg(long, env = "PGCDC_REGISTRY_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// Postgres connection string of the store; the `pgcdc_registry`
    /// schema is created there.
    #[arg(long, env = "PGCDC_REGISTRY_STORE", hide_env_values = true)]
    pub store: String,
    /// Require basic auth with USER:PASSWORD. Prefer the environment
    /// variable or --basic-auth-file: command lines are visible to other
    /// users of the machine.
    #[arg(long, env = "PGCDC_REGISTRY_BASIC_AUTH", hide_env_values = true)]
    pub basic_auth: Option<String>,
    /// File of USER:PASSWORD lines, each an accepted credential.
    #[arg(long)]
    pub basic_auth_file: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// Connector definition, e.g. connectors/demo.toml.
    #[arg(long, short = 'c', env = "PGCDC_CONFIG")]
    pub config: PathBuf,
}

/// Why a command stopped: a message for stderr, and the exit code.
#[derive(Debug)]
struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure(e.to_string())
    }
}

/// Runs one command to completion and returns its exit code.
pub async fn execute(command: Command) -> u8 {
    let outcome = match command {
        Command::Validate(args) => validate(&args),
        Command::Reference => {
            print!("{}", crate::config::reference::markdown());
            Ok(exit::OK)
        }
        Command::Check(args) => check(&args).await,
        Command::Status(args) => status(&args).await,
        Command::Slot { action } => slot_command(action).await,
        Command::Run(args) => run(&args).await,
        Command::Materialize(args) => materialize(&args).await,
        Command::Registry(args) => registry(args).await,
        Command::Tail(args) => tail(&args).await,
        Command::Retention(args) => retention(&args).await,
        Command::Rebuild(args) => rebuild(&args).await,
        Command::Snapshot(args) => snapshot(&args).await,
        Command::Dlq { action } => dlq(action).await,
    };
    match outcome {
        Ok(code) => code,
        Err(Failure(message)) => {
            eprintln!("error: {message}");
            exit::FAILURE
        }
    }
}

async fn status(args: &StatusArgs) -> Result<u8, Failure> {
    let status = crate::observe::report::fetch(&args.http_addr)
        .await
        .map_err(Failure)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&status).unwrap_or_default()
        );
    } else {
        print!("{}", crate::observe::report::text(&status));
    }
    Ok(exit::OK)
}

/// Loads a config, printing each field error on its own line.
fn load(args: &ConfigArg) -> Result<Config, ConfigError> {
    Config::load(&args.config).inspect_err(|e| {
        if !e.field_errors().is_empty() {
            eprintln!("error: {} is invalid:", args.config.display());
            for fe in e.field_errors() {
                eprintln!("  {fe}");
            }
        }
    })
}

fn config_failure(e: ConfigError) -> Failure {
    if e.field_errors().is_empty() {
        Failure(e.to_string())
    } else {
        Failure("the config is invalid (see above)".to_string())
    }
}

fn validate(args: &ConfigArg) -> Result<u8, Failure> {
    match load(args) {
        Ok(config) => {
            print!("{}", config.to_redacted_toml());
            Ok(exit::OK)
        }
        Err(e) if !e.field_errors().is_empty() => Ok(exit::CHECK_FAILED),
        Err(e) => Err(config_failure(e)),
    }
}

async fn check(args: &ConfigArg) -> Result<u8, Failure> {
    let config = load(args).map_err(config_failure)?;
    let report = preflight::run(&config).await;
    print!("{}", report.render());
    Ok(if report.failed() {
        exit::CHECK_FAILED
    } else {
        exit::OK
    })
}

async fn slot_command(action: SlotAction) -> Result<u8, Failure> {
    let (SlotAction::Status { config: args, .. } | SlotAction::Drop { config: args, .. }) = &action;
    let config = load(args).map_err(config_failure)?;
    let name = &config.source.slot;
    let client = source::connect(&config.source.url).await.map_err(|e| {
        Failure(format!(
            "cannot connect to {}: {}",
            config.source.url.redacted(),
            source::error_text(&e)
        ))
    })?;
    match action {
        SlotAction::Status { json, .. } => {
            let status = slot::status(&client, name)
                .await?
                .ok_or_else(|| Failure(format!("slot '{name}' does not exist")))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                println!("{status}");
            }
            if status.wal_status.as_deref() == Some("lost") {
                eprintln!("error: {}", slot::SlotError::Lost { slot: name.clone() });
                return Ok(exit::CHECK_FAILED);
            }
            Ok(exit::OK)
        }
        SlotAction::Drop { yes: false, .. } => Err(Failure(format!(
            "dropping slot '{name}' loses its position in the WAL; add --yes to confirm"
        ))),
        SlotAction::Drop { yes: true, .. } => {
            match slot::drop(&client, name).await {
                Ok(()) => println!("slot '{name}' dropped"),
                // Gone already (dropped outside pgcdc): recording that is
                // the whole of the recovery's first step.
                Err(slot::SlotError::Missing(_)) => println!("slot '{name}' does not exist"),
                Err(e) => return Err(e.into()),
            }
            // So the next `pgcdc run` knows the drop was meant, creates a
            // new slot and takes a new snapshot.
            let marker = crate::snapshot_marker::dropped(name, crate::connector::now_ms());
            let recorded = async {
                crate::snapshot_marker::ensure_topic(&config)
                    .await
                    .map_err(|e| e.to_string())?;
                let producer = crate::sink::Producer::create(&config.kafka, None)
                    .await
                    .map_err(|e| e.to_string())?;
                crate::snapshot_marker::write(&producer, &config, &marker).await
            };
            recorded.await.map_err(|e| {
                Failure(format!(
                    "recording the drop in {} failed: {e}; run `pgcdc slot drop --yes` again once Kafka is reachable (the next `pgcdc run` refuses to start until then)",
                    crate::snapshot_marker::topic(&config)
                ))
            })?;
            println!(
                "recorded in {}: the next `pgcdc run` creates a new slot and takes a new snapshot",
                crate::snapshot_marker::topic(&config)
            );
            Ok(exit::OK)
        }
    }
}

async fn retention(args: &RetentionArgs) -> Result<u8, Failure> {
    let Some(path) = args.config.clone().filter(|_| !args.json_schema) else {
        print!("{}", crate::retention::JSON_SCHEMA);
        return Ok(exit::OK);
    };
    let config = load(&ConfigArg { config: path }).map_err(config_failure)?;
    let require = args
        .require
        .as_deref()
        .map(crate::retention::reach::Requirement::parse)
        .transpose()
        .map_err(|e| Failure(format!("--require: {e}")))?;
    let report =
        crate::retention::gather(&config, args.read_model.as_deref(), require.as_ref()).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    let mut code = exit::OK;
    for rm in &report.read_models {
        if let Some(shortfall) = rm.requirement.as_ref().and_then(|v| v.shortfall.as_ref()) {
            eprintln!("error: {}: {shortfall}", rm.name);
            code = exit::CHECK_FAILED;
        }
    }
    Ok(code)
}

async fn rebuild(args: &RebuildArgs) -> Result<u8, Failure> {
    use crate::materialize::rebuild::{self, RebuildError, Start};
    let config = load(&args.config).map_err(config_failure)?;
    let start = match args.from {
        RebuildFrom::Earliest => Start::Earliest,
        RebuildFrom::Snapshot => Start::Snapshot,
    };
    let timeout = args
        .snapshot_timeout_secs
        .map(std::time::Duration::from_secs);
    match rebuild::run(&config, &args.read_model, start, timeout).await {
        Ok(outcome) => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&outcome)?);
            } else {
                print!("{}", outcome.render());
            }
            Ok(exit::OK)
        }
        Err(RebuildError::Refused(why)) => {
            eprintln!("error: rebuild of {} refused: {why}", args.read_model);
            Ok(exit::CHECK_FAILED)
        }
        Err(RebuildError::Failed(why)) => Err(Failure(why)),
    }
}

async fn snapshot(args: &SnapshotArgs) -> Result<u8, Failure> {
    use crate::connector::incremental;
    let config = load(&args.config).map_err(config_failure)?;
    let client = source::connect(&config.source.url).await.map_err(|e| {
        Failure(format!(
            "cannot connect to {}: {}",
            config.source.url.redacted(),
            source::error_text(&e)
        ))
    })?;
    let name = &config.source.slot;
    match slot::status(&client, name).await? {
        None => {
            return Err(Failure(format!(
                "slot '{name}' does not exist: start `pgcdc run` first (its initial snapshot covers every table)"
            )))
        }
        Some(s) if !s.active => eprintln!(
            "note: no connector is streaming from slot '{name}' now; the {} when `pgcdc run` reads this request",
            if args.stop { "snapshots stop" } else { "snapshot begins" }
        ),
        Some(_) => {}
    }
    let tables: Vec<String> = args.tables.iter().map(|t| canonical_table(t)).collect();
    if args.stop {
        return stop_snapshots(args, &config, &client, &tables).await;
    }
    let id = incremental::signal(&client, &config, &tables)
        .await
        .map_err(Failure)?;
    println!(
        "incremental snapshot {id} requested for {}",
        args.tables.join(", ")
    );
    if args.no_wait {
        return Ok(exit::OK);
    }
    let timeout = args.timeout_secs.map(std::time::Duration::from_secs);
    let done = incremental::wait(&config, &id, timeout, |m| {
        let rows: Vec<String> = m
            .rows
            .iter()
            .map(|(t, n)| format!("{t} {n} rows"))
            .collect();
        eprintln!("  {:?}: {}", m.phase, rows.join(", "));
    })
    .await
    .map_err(Failure)?;
    let rows: Vec<String> = done
        .rows
        .iter()
        .map(|(t, n)| {
            format!(
                "{t} {n} rows in {} chunks",
                done.chunks.get(t).copied().unwrap_or(0)
            )
        })
        .collect();
    println!(
        "incremental snapshot {id} completed at LSN {}: {}",
        done.consistent_point.as_deref().unwrap_or("?"),
        rows.join(", ")
    );
    Ok(exit::OK)
}

/// `pgcdc snapshot --stop`: the unfinished snapshots of `tables` (or all),
/// a stop request for them, then (unless --no-wait) their end.
async fn stop_snapshots(
    args: &SnapshotArgs,
    config: &crate::config::Config,
    client: &tokio_postgres::Client,
    tables: &[String],
) -> Result<u8, Failure> {
    use crate::connector::incremental;
    if let Some(t) = tables.iter().find(|t| !config.source.tables.contains(t)) {
        return Err(Failure(format!("--table {t}: not one of source.tables")));
    }
    let unfinished = incremental::unfinished(config, tables)
        .await
        .map_err(Failure)?;
    if unfinished.is_empty() {
        println!("no incremental snapshot is running or waiting");
        return Ok(exit::OK);
    }
    let ids: Vec<String> = unfinished.iter().filter_map(|m| m.id.clone()).collect();
    incremental::signal_stop(client, config, &ids)
        .await
        .map_err(Failure)?;
    for m in &unfinished {
        println!(
            "stop requested for incremental snapshot {} of {}",
            m.id.as_deref().unwrap_or("?"),
            m.tables.join(", ")
        );
    }
    if args.no_wait {
        return Ok(exit::OK);
    }
    // One deadline for all of them.
    let deadline = args
        .timeout_secs
        .map(|s| std::time::Instant::now() + std::time::Duration::from_secs(s));
    for id in &ids {
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        match incremental::wait(config, id, left, |_| {}).await {
            Ok(_) => println!("incremental snapshot {id} completed before the stop reached it"),
            Err(e) if e.ends_with(incremental::STOPPED) => {
                println!("incremental snapshot {id} stopped")
            }
            // Ended for another reason meanwhile: ended all the same.
            Err(e) if e.starts_with(&format!("incremental snapshot {id} failed: ")) => {
                println!("{e}")
            }
            Err(e) => {
                return Err(Failure(format!(
                    "{e}; the stop request stays in the WAL for the connector"
                )))
            }
        }
    }
    Ok(exit::OK)
}

async fn registry(args: RegistryArgs) -> Result<u8, Failure> {
    let mut users = Vec::new();
    if let Some(pair) = &args.basic_auth {
        users.push(
            api::Credentials::parse(pair)
                .ok_or_else(|| Failure("--basic-auth must be USER:PASSWORD".to_string()))?,
        );
    }
    if let Some(path) = &args.basic_auth_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Failure(format!("cannot read {}: {e}", path.display())))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            users.push(api::Credentials::parse(line).ok_or_else(|| {
                Failure(format!(
                    "{} line {}: expected USER:PASSWORD",
                    path.display(),
                    n + 1
                ))
            })?);
        }
    }
    let dsn = Dsn::new(args.store);
    let store = Store::open(&dsn)
        .await
        .map_err(|e| Failure(format!("cannot open the store at {}: {e}", dsn.redacted())))?;
    api::serve(args.listen, store, users)
        .await
        .map_err(|e| Failure(format!("cannot serve on {}: {e}", args.listen)))?;
    Ok(exit::OK)
}

async fn tail(args: &TailArgs) -> Result<u8, Failure> {
    let config = load(&args.config).map_err(config_failure)?;
    let tables = match args.table.as_deref().map(canonical_table) {
        Some(t) if config.source.tables.contains(&t) => vec![t],
        Some(t) => return Err(Failure(format!("--table {t} is not one of source.tables"))),
        None => config.changelog_tables().cloned().collect(),
    };
    crate::tail::run(
        &config,
        &tables,
        args.max,
        std::time::Duration::from_secs(args.idle_secs),
    )
    .await
    .map_err(Failure)?;
    Ok(exit::OK)
}

async fn run(args: &RunArgs) -> Result<u8, Failure> {
    let config = load(&args.config).map_err(config_failure)?;
    if let Some(addr) = args.http_addr {
        crate::observe::server::start(addr, crate::observe::board::Role::Connector, &config)
            .await
            .map_err(Failure)?;
    }
    on_worker(crate::connector::run(config)).await??;
    Ok(exit::OK)
}

/// Runs a pipeline on a runtime worker rather than the main thread: a task
/// woken by another task of its worker runs at once, while waking the main
/// thread costs a futex round trip per replication event.
async fn on_worker<T: Send + 'static>(
    pipeline: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, Failure> {
    match tokio::spawn(pipeline).await {
        Ok(outcome) => Ok(outcome),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Failure(format!("the pipeline task stopped: {e}"))),
    }
}

async fn materialize(args: &RunArgs) -> Result<u8, Failure> {
    let config = load(&args.config).map_err(config_failure)?;
    if let Some(addr) = args.http_addr {
        crate::observe::server::start(addr, crate::observe::board::Role::Materializer, &config)
            .await
            .map_err(Failure)?;
    }
    on_worker(crate::materialize::run(config)).await??;
    Ok(exit::OK)
}

impl DlqFilter {
    fn build(&self, bulk: bool) -> Result<crate::dlq::store::Filter, Failure> {
        use crate::retention::time::{parse_span, parse_timestamp};
        let now = crate::connector::now_ms();
        let when = |flag: &str, t: &Option<String>| -> Result<Option<i64>, Failure> {
            t.as_deref()
                .map(|t| {
                    parse_timestamp(t)
                        .or_else(|| parse_span(t).map(|ago| now - ago))
                        .ok_or_else(|| {
                            Failure(format!(
                                "--{flag} {t}: not an RFC 3339 time or a span such as 2h"
                            ))
                        })
                })
                .transpose()
        };
        let states = self
            .state
            .iter()
            .map(|s| {
                crate::dlq::State::parse(s)
                    .ok_or_else(|| Failure(format!("--state {s}: not a state")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let class = self
            .class
            .as_deref()
            .map(|c| {
                crate::dlq::Class::parse(c)
                    .ok_or_else(|| Failure(format!("--class {c}: not a failure class")))
            })
            .transpose()?;
        let f = crate::dlq::store::Filter {
            ids: self.ids.clone(),
            states,
            class,
            table: self.table.as_deref().map(canonical_table),
            since_ms: when("since", &self.since)?,
            until_ms: when("until", &self.until)?,
        };
        let unfiltered = f.ids.is_empty()
            && f.states.is_empty()
            && f.class.is_none()
            && f.table.is_none()
            && f.since_ms.is_none()
            && f.until_ms.is_none();
        if bulk && unfiltered && !self.all {
            return Err(Failure(
                "name message ids, give a filter (--class, --table, --state, --since, --until) or --all"
                    .into(),
            ));
        }
        Ok(f)
    }
}

async fn dlq(action: DlqCommand) -> Result<u8, Failure> {
    use crate::dlq::{self, store, State};
    match action {
        DlqCommand::List {
            config,
            filter,
            json,
        } => {
            let cfg = load(&config).map_err(config_failure)?;
            let db = dlq::open(&cfg).await?;
            let messages = store::list(&db, &filter.build(false)?).await?;
            for m in &messages {
                if json {
                    println!("{}", serde_json::to_string(m)?);
                } else {
                    println!(
                        "{:>6}  {:<18} {:<21} {}  {}  {}",
                        m.id,
                        m.state.as_str(),
                        m.class.as_str(),
                        crate::retention::time::rfc3339(m.quarantined_ms),
                        m.source_table.as_deref().unwrap_or(&m.origin_topic),
                        m.position
                            .map(|(c, s)| format!("{c}:{s}"))
                            .unwrap_or_else(|| "-".into())
                    );
                }
            }
            if !json {
                println!("{} messages", messages.len());
            }
            Ok(exit::OK)
        }
        DlqCommand::Show { config, id, json } => {
            let cfg = load(&config).map_err(config_failure)?;
            let db = dlq::open(&cfg).await?;
            let m = store::get(&db, id).await?;
            let audit = store::audit(&db, id).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &serde_json::json!({"message": m, "audit": audit})
                    )?
                );
            } else {
                let t = crate::retention::time::rfc3339;
                println!("message {}: {} ({})", m.id, m.state, m.class);
                println!("  error: {}", m.error);
                println!(
                    "  origin: {} partition {} offset {}",
                    m.origin_topic,
                    m.origin_partition
                        .map(|p| p.to_string())
                        .unwrap_or("-".into()),
                    m.origin_offset.map(|p| p.to_string()).unwrap_or("-".into())
                );
                if let Some((c, s)) = m.position {
                    println!("  position: {c}:{s}");
                }
                println!(
                    "  attempts {}, first failure {}, last failure {}, quarantined {}",
                    m.attempts,
                    t(m.first_failure_ms),
                    t(m.last_failure_ms),
                    t(m.quarantined_ms)
                );
                if let Some(o) = m.outcome {
                    println!("  outcome: {}", o.as_str());
                }
                if let Some(r) = &m.archived_reason {
                    println!("  archived because: {r}");
                }
                if let Some(n) = &m.note {
                    println!("  note: {n}");
                }
                if let Some(old) = m.replay_of {
                    println!("  replay of message {old}");
                }
                println!("  audit:");
                for a in audit {
                    println!(
                        "    {} {} → {} by {}: {}",
                        t(a.at_ms),
                        a.from.as_deref().unwrap_or("-"),
                        a.to,
                        a.actor,
                        a.reason
                    );
                }
            }
            Ok(exit::OK)
        }
        DlqCommand::Review(args) => {
            moves(&args, &[State::Quarantined], State::UnderReview, "reviewed").await
        }
        DlqCommand::Approve(args) => {
            moves(
                &args,
                &[State::UnderReview],
                State::SchemaCheck,
                "approved for replay",
            )
            .await
        }
        DlqCommand::Archive(args) => {
            if args.reason.as_deref().is_none_or(|r| r.trim().is_empty()) {
                return Err(Failure(
                    "--reason: an archived message keeps why it was archived".into(),
                ));
            }
            moves(
                &args,
                &[
                    State::UnderReview,
                    State::SchemaCheck,
                    State::IdempotencyCheck,
                ],
                State::Archived,
                "",
            )
            .await
        }
        DlqCommand::Replay {
            args,
            dry_run,
            json,
        } => {
            dlq::check_actor(&args.actor)?;
            let cfg = load(&args.config).map_err(config_failure)?;
            let filter = args.filter.build(true)?;
            dlq::open(&cfg).await?;
            let mut replayer = crate::materialize::replay::Replayer::open(&cfg).await?;
            let summary = dlq::replay(&mut replayer, &filter, &args.actor, dry_run).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&summary)?);
            } else {
                print!("{}", summary.render());
            }
            Ok(exit::OK)
        }
        DlqCommand::Stats {
            config,
            at,
            json,
            check,
        } => {
            let cfg = load(&config).map_err(config_failure)?;
            let now = match at.as_deref() {
                Some(t) => crate::retention::time::parse_timestamp(t)
                    .ok_or_else(|| Failure(format!("--at {t}: not an RFC 3339 time")))?,
                None => crate::connector::now_ms(),
            };
            let db = dlq::open(&cfg).await?;
            let h = dlq::stats(&cfg, &db, now).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&h)?);
            } else {
                print!("{}", h.render());
            }
            Ok(if check && !h.warnings.is_empty() {
                exit::CHECK_FAILED
            } else {
                exit::OK
            })
        }
        DlqCommand::Enforce {
            config,
            dry_run,
            json,
        } => {
            let cfg = load(&config).map_err(config_failure)?;
            dlq::open(&cfg).await?;
            let mut replayer = crate::materialize::replay::Replayer::open(&cfg).await?;
            let round =
                dlq::enforce(&cfg, &mut replayer, crate::connector::now_ms(), dry_run).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&round)?);
            } else {
                for (id, why) in &round.archived {
                    println!("{id}: archived ({why})");
                }
                print!("{}", round.replayed.render());
            }
            for (id, why) in &round.failed {
                eprintln!("error: message {id}: {why}");
            }
            Ok(if round.failed.is_empty() {
                exit::OK
            } else {
                exit::FAILURE
            })
        }
    }
}

async fn moves(
    args: &DlqMove,
    from: &[crate::dlq::State],
    to: crate::dlq::State,
    default_reason: &str,
) -> Result<u8, Failure> {
    crate::dlq::check_actor(&args.actor)?;
    let cfg = load(&args.config).map_err(config_failure)?;
    let filter = args.filter.build(true)?;
    let db = crate::dlq::open(&cfg).await?;
    let reason = args.reason.as_deref().unwrap_or(default_reason);
    let report = crate::dlq::move_all(&db, &filter, from, to, &args.actor, reason).await?;
    print!("{}", report.render(to.as_str()));
    for (id, why) in &report.refused {
        eprintln!("error: message {id}: {why}");
    }
    Ok(if report.refused.is_empty() {
        exit::OK
    } else {
        exit::CHECK_FAILED
    })
}
